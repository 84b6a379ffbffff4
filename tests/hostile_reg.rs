//! Hostile event registrations (issue 26): the C guest tests/support/c/hostile_reg.c
//! registers `hreg:good` and, per class (chosen by `--rate`), entries built to crash,
//! hang or fool trace-cmd: format-string tricks, zero division, huge and `*` widths,
//! huge `__print_hex`/`__print_array` lengths, newline/ESC escapes in the format, in
//! names, in strings, duplicate/overlapping fields, too many fields, unknown helpers, a
//! second registration. Each class is recorded (`record -o X.dat`), printed by
//! `hyptrace report` and converted to JSON, then printed by the real `trace-cmd report`
//! under a 10 s bound: no signal, no hang, every line a `cpus=` header or one of the
//! good events (with its fields, each exactly once: nothing forged), and every hostile
//! entry named on stderr with its reason (G1, G2 in docs/design.md). VM tests skip
//! without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1; the trace-cmd part skips without
//! trace-cmd unless HYPTRACE_REQUIRE_TRACE_CMD=1.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use hyptrace::cguest::c_test_guest;
use hyptrace::env::{self, kvm_available, trace_cmd_available, vm_lock, TempDir};
use hyptrace::text::{parse_line, Line};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");
/// Events of hreg:good per vCPU.
const EVENTS: u64 = 20;
const VCPUS: u32 = 2;
/// Bound of every hyptrace and trace-cmd run.
const BOUND: Duration = Duration::from_secs(10);
/// Bound of a VM run (boot on a busy machine included).
const VM_BOUND: Duration = Duration::from_secs(60);

fn elf() -> String {
    let target = Path::new(BIN)
        .parent()
        .and_then(Path::parent)
        .expect("the hyptrace binary lives in <target>/<profile>/");
    c_test_guest(target, "hostile_reg")
        .unwrap_or_else(|e| panic!("{e}"))
        .to_str()
        .expect("utf-8 path")
        .to_string()
}

/// Runs `prog args` with stdout and stderr to files of `dir`, killed past `bound`;
/// returns (exit code or None for a signal, stdout, stderr).
fn bounded(
    dir: &TempDir,
    tag: &str,
    prog: &str,
    args: &[&str],
    bound: Duration,
) -> (Option<i32>, String, String) {
    let out = dir.file(&format!("{tag}.out"));
    let err = dir.file(&format!("{tag}.err"));
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {prog}: {e}"));
    let status = env::wait_exit(&mut child, &format!("{prog} {args:?}"), bound);
    let read = |p: &str| String::from_utf8_lossy(&std::fs::read(p).expect("output")).into_owned();
    (status.code(), read(&out), read(&err))
}

/// A class: its `--rate`, and the rejections it must produce: (entry index, label,
/// a piece of the reason).
struct Class {
    name: &'static str,
    rate: u32,
    rejected: &'static [(u32, &'static str, &'static str)],
    /// The good event's strings.
    strings: Strings,
}

/// What the good event's strings are in a class.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Strings {
    Clean,
    /// Control bytes and a forged line inside tag and msg.
    Hostile,
    /// msg's `__data_loc` outside the record (even seq) or without its NUL (odd seq).
    Lying,
}

const DIV: &str = "divides by something other than a literal";

const CLASSES: &[Class] = &[
    Class {
        name: "format-string tricks",
        rate: 1,
        rejected: &[
            (1, "hreg:pct_n", "conversion %n"),
            (2, "hreg:str_of_int", "a %s argument"),
            (3, "hreg:char_conv", "conversion %c"),
            (4, "hreg:sym", "conversion %pS"),
            (5, "hreg:mac", "conversion %pI/%pM"),
            (6, "hreg:too_few", "fewer arguments than conversions"),
            (7, "hreg:not_a_field", "REC-> names no field"),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "zero division",
        rate: 2,
        rejected: &[
            (1, "hreg:div0", DIV),
            (2, "hreg:mod0", DIV),
            (3, "hreg:div_field", DIV),
            (4, "hreg:div_minus1", DIV),
            (5, "hreg:table_div0", DIV),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "huge width",
        rate: 3,
        rejected: &[
            (1, "hreg:w9", "does not parse: width"),
            (2, "hreg:p9", "does not parse: width"),
            (3, "hreg:w65", "width or precision of 65 (at most 64)"),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "* width",
        rate: 4,
        rejected: &[
            (1, "hreg:star_w", "`*` width"),
            (2, "hreg:star_p", "`*` width"),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "huge hex/array length",
        rate: 5,
        rejected: &[
            (1, "hreg:hex_huge", "fixed array field"),
            (2, "hreg:hex_field", "literal length"),
            (3, "hreg:hex_past", "reads 17 bytes of a 16-byte field"),
            (
                4,
                "hreg:array_huge",
                "reads 799992 bytes of a 16-byte field",
            ),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "newline/ESC in the format",
        rate: 6,
        rejected: &[
            (1, "hreg:nl", "escape \\n"),
            (2, "hreg:cr", "escape \\r"),
            (3, "hreg:esc_e", "escape \\e"),
            (4, "hreg:esc_oct", "escape \\0"),
            (5, "hreg:esc_hex", "escape \\x"),
            (6, "hreg:sym_nl", "escape \\n"),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "newline/ESC in names",
        rate: 7,
        rejected: &[
            (1, "?", "system has bytes that are not printable ASCII"),
            (2, "?", "name has bytes that are not printable ASCII"),
            (3, "?", "name \"dash-name\" is not an identifier"),
            (
                4,
                "hreg:field_nl",
                "field 0: name has bytes that are not printable ASCII",
            ),
            (
                5,
                "hreg:type_nl",
                "field 0 (seq): C type has bytes that are not printable ASCII",
            ),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "newline/ESC in strings",
        rate: 8,
        rejected: &[],
        strings: Strings::Hostile,
    },
    Class {
        name: "duplicate/overlapping fields",
        rate: 9,
        rejected: &[
            (1, "hreg:dup", "field 1 (a): same name as field 0"),
            (
                2,
                "hreg:overlap",
                "field 1 (b): bytes 12..16 overlap field 0 (a)",
            ),
            (
                3,
                "hreg:past",
                "field 1 (b): bytes 16..24 lie outside the record's fields (8..20)",
            ),
            (
                4,
                "hreg:badsize",
                "field 0 (a): size 4 does not match u64 (8 bytes)",
            ),
            (
                5,
                "hreg:badtype",
                "field 0 (a): unknown C type \"struct task_struct *\"",
            ),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "absurd field count",
        rate: 10,
        rejected: &[(
            1,
            "hreg:many",
            "40 fields is over the limit of 32 per event",
        )],
        strings: Strings::Clean,
    },
    Class {
        name: "unknown helpers",
        rate: 11,
        rejected: &[
            (1, "hreg:bitmask", "uses \"__get_bitmask\""),
            (2, "hreg:dynarray", "uses \"__get_dynamic_array\""),
            (3, "hreg:expect", "uses \"__builtin_expect\""),
            (4, "hreg:func", "uses \"some_kernel_function\""),
            (5, "hreg:symbol", "uses \"jiffies\""),
            (6, "hreg:stmt", "does not parse: statement expression"),
        ],
        strings: Strings::Clean,
    },
    Class {
        name: "second registration",
        rate: 12,
        rejected: &[],
        strings: Strings::Clean,
    },
    Class {
        name: "lying __data_loc",
        rate: 13,
        rejected: &[],
        strings: Strings::Lying,
    },
];

/// hreg:good's fields for event `i` as every reader prints them.
fn good_fields(i: u64, strings: Strings) -> String {
    match strings {
        // G2: each control byte of the guest's strings is a '?' in trace.dat.
        Strings::Hostile => format!(
            "seq={i} tag=t??[2J?{} msg=m?          <idle>-0     [007]     9.999999: hreg:good: seq=424242?[31m",
            i % 10
        ),
        // G2: a location outside the record is an empty string, a missing NUL replaces
        // the last byte.
        Strings::Lying if i.is_multiple_of(2) => format!("seq={i} tag=tag{} msg=", i % 10),
        Strings::Lying => format!("seq={i} tag=tag{} msg=m?", i % 10),
        Strings::Clean => format!("seq={i} tag=tag{} msg=msg", i % 10),
    }
}

/// Every line of a report is `cpus=N` or a hreg:good event; each (cpu, seq) once, with
/// its exact fields. Returns the number of events.
fn check_report(what: &str, text: &str, strings: Strings) {
    let mut seen = std::collections::BTreeSet::new();
    for (n, l) in text.lines().enumerate() {
        match parse_line(l) {
            Ok(Line::Cpus(c)) => assert_eq!(c, VCPUS, "{what}: {l:?}"),
            Ok(Line::Event(e)) => {
                assert_eq!(e.name, "good", "{what}: line {}: {l:?}", n + 1);
                let seq = e.seq().unwrap_or_else(|| panic!("{what}: no seq: {l:?}"));
                assert_eq!(
                    e.fields,
                    good_fields(seq, strings),
                    "{what}: line {}",
                    n + 1
                );
                assert_eq!(e.pid, i64::from(e.cpu) + 1, "{what}: {l:?}");
                assert!(seen.insert((e.cpu, seq)), "{what}: twice: {l:?}");
            }
            other => panic!("{what}: line {} is no event line: {l:?} ({other:?})", n + 1),
        }
    }
    assert_eq!(
        seen.len() as u64,
        u64::from(VCPUS) * EVENTS,
        "{what}:\n{text}"
    );
}

fn check_class(elf: &str, c: &Class) {
    let dir = TempDir::new(&format!("hostile-reg-{}", c.rate));
    let dat = dir.file("x.dat");
    let (code, _, err) = bounded(
        &dir,
        "record",
        BIN,
        &[
            "record",
            "--guest",
            elf,
            "--vcpus",
            &VCPUS.to_string(),
            "--rate",
            &c.rate.to_string(),
            "--events",
            &EVENTS.to_string(),
            "-o",
            &dat,
        ],
        VM_BOUND,
    );
    assert_eq!(code, Some(0), "{}: record:\n{err}", c.name);
    // Each hostile entry named with its reason, and nothing else rejected.
    let rejections: Vec<&str> = err.lines().filter(|l| l.contains(") rejected: ")).collect();
    for (i, label, why) in c.rejected {
        let head = format!("event {i} ({label}) rejected: ");
        assert!(
            rejections
                .iter()
                .any(|l| l.contains(&head) && l.contains(why)),
            "{}: no {head:?} with {why:?} in:\n{err}",
            c.name
        );
    }
    assert_eq!(rejections.len(), c.rejected.len(), "{}:\n{err}", c.name);
    if c.strings != Strings::Clean {
        assert!(
            err.contains("bytes in guest strings written as '?'"),
            "{}:\n{err}",
            c.name
        );
    }
    let (code, out, err) = bounded(&dir, "report", BIN, &["report", &dat], BOUND);
    assert_eq!(code, Some(0), "{}: hyptrace report: {err}", c.name);
    check_report(&format!("{}: hyptrace report", c.name), &out, c.strings);
    let json = dir.file("x.json");
    let (code, _, err) = bounded(
        &dir,
        "json",
        BIN,
        &["convert", "-i", &dat, "-o", &json],
        BOUND,
    );
    assert_eq!(code, Some(0), "{}: convert to JSON: {err}", c.name);
    let text = std::fs::read_to_string(&json).expect("json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert!(text.contains("\"seq\""), "{}: {v}", c.name);
    if !trace_cmd_available() {
        return;
    }
    let (code, out, err) = bounded(
        &dir,
        "trace-cmd",
        "trace-cmd",
        &["report", "-i", &dat],
        BOUND,
    );
    assert_eq!(
        code,
        Some(0),
        "{}: trace-cmd report died or failed: {err}",
        c.name
    );
    check_report(&format!("{}: trace-cmd report", c.name), &out, c.strings);
}

fn run_class(test: &str, rate: u32) {
    if !kvm_available(KRATE, test) {
        return;
    }
    let c = CLASSES.iter().find(|c| c.rate == rate).expect("class");
    let elf = elf();
    let _vm = vm_lock();
    check_class(&elf, c);
}

/// One test per class (one VM at a time).
macro_rules! classes {
    ($($name:ident = $rate:expr;)*) => {$(
        #[test]
        fn $name() {
            run_class(stringify!($name), $rate);
        }
    )*};
}

classes! {
    format_string_tricks = 1;
    zero_division = 2;
    huge_width = 3;
    star_width = 4;
    huge_hex_and_array_lengths = 5;
    newline_and_esc_in_the_format = 6;
    newline_and_esc_in_names = 7;
    newline_and_esc_in_strings = 8;
    duplicate_and_overlapping_fields = 9;
    absurd_field_count = 10;
    unknown_helpers = 11;
    second_registration = 12;
    lying_data_loc = 13;
}
