use std::collections::BTreeMap;

use super::bre::compile_bre;
use super::expr::{parse, Ast, MAX_DEPTH, MAX_EXPR_LEN};
use super::{FilterErrorKind as E, FilterSet};
use crate::format::{common_fields, EventFormat, Field};

fn field(t: &str, n: &str, offset: usize, size: usize, signed: bool) -> Field {
    Field {
        type_name: t.into(),
        name: n.into(),
        offset,
        size,
        signed,
    }
}

/// `sched:sched_switch` (id 10), `sched:sched_wakeup` (id 11), `guest:text` (id 12, a
/// `__data_loc` string) and `ftrace:kernel_stack` (id 13).
fn formats() -> Vec<EventFormat> {
    let ev = |system: &str, name: &str, id, fields| EventFormat {
        system: system.into(),
        name: name.into(),
        id,
        common_fields: common_fields(),
        fields,
        print_fmt: String::new(),
    };
    vec![
        ev(
            "sched",
            "sched_switch",
            10,
            vec![
                field("char[16]", "prev_comm", 8, 16, false),
                field("int", "prev_pid", 24, 4, true),
                field("long", "prev_state", 32, 8, true),
                field("char[16]", "next_comm", 40, 16, false),
                field("int", "next_pid", 56, 4, true),
            ],
        ),
        ev(
            "sched",
            "sched_wakeup",
            11,
            vec![
                field("char[16]", "comm", 8, 16, false),
                field("int", "pid", 24, 4, true),
            ],
        ),
        ev(
            "guest",
            "text",
            12,
            vec![field("__data_loc char[]", "msg", 8, 4, false)],
        ),
        ev(
            "ftrace",
            "kernel_stack",
            13,
            vec![field("int", "size", 8, 4, true)],
        ),
    ]
}

fn header(id: u16, pid: i32, len: usize) -> Vec<u8> {
    let mut p = vec![0u8; len];
    p[..2].copy_from_slice(&id.to_le_bytes());
    p[4..8].copy_from_slice(&pid.to_le_bytes());
    p
}

fn comm(p: &mut [u8], at: usize, s: &str) {
    p[at..at + s.len()].copy_from_slice(s.as_bytes());
}

fn switch(prev: (&str, i32), state: i64, next: (&str, i32)) -> Vec<u8> {
    let mut p = header(10, prev.1, 64);
    comm(&mut p, 8, prev.0);
    p[24..28].copy_from_slice(&prev.1.to_le_bytes());
    p[32..40].copy_from_slice(&state.to_le_bytes());
    comm(&mut p, 40, next.0);
    p[56..60].copy_from_slice(&next.1.to_le_bytes());
    p
}

fn wakeup(c: &str, pid: i32) -> Vec<u8> {
    let mut p = header(11, 7, 32);
    comm(&mut p, 8, c);
    p[24..28].copy_from_slice(&pid.to_le_bytes());
    p
}

fn text(msg: &str) -> Vec<u8> {
    let mut p = header(12, 7, 12);
    let loc = 12u32 | ((msg.len() as u32 + 1) << 16);
    p[8..12].copy_from_slice(&loc.to_le_bytes());
    p.extend_from_slice(msg.as_bytes());
    p.push(0);
    p
}

fn cmdlines() -> BTreeMap<i32, String> {
    [(7, "bash".to_string()), (42, "vcpu0".to_string())].into()
}

fn set(specs: &[&str]) -> FilterSet {
    let specs: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
    FilterSet::compile(&specs, &formats())
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("filters")
}

fn passes(spec: &str, payload: &[u8]) -> bool {
    set(&[spec]).wants(payload, 1, &cmdlines())
}

fn refused(spec: &str) -> E {
    let specs = vec![spec.to_string()];
    match FilterSet::compile(&specs, &formats()) {
        Err(e) => {
            assert_eq!(e.spec, spec);
            e.kind
        }
        Ok(_) => panic!("{spec}: accepted"),
    }
}

#[test]
fn numeric_comparisons() {
    let p = switch(("bash", 7), 1, ("vcpu0", 42));
    for (expr, want) in [
        ("prev_pid == 7", true),
        ("prev_pid != 7", false),
        ("prev_pid < 8", true),
        ("prev_pid < 7", false),
        ("prev_pid <= 7", true),
        ("prev_pid > 6", true),
        ("prev_pid > 7", false),
        ("prev_pid >= 7", true),
        ("next_pid == 0x2a", true),
        ("next_pid == 052", true),
        ("next_pid == 42", true),
        ("prev_pid == next_pid", false),
        ("prev_pid < next_pid", true),
        ("prev_state & 1", true),
        ("prev_state & 2", false),
        ("prev_state | 0", true),
        ("prev_state ^ 1", false),
        ("next_pid - 42", false),
        ("next_pid + 1", true),
        ("next_pid * 0", false),
        ("next_pid / 0", false),
        ("next_pid % 0", false),
        ("next_pid >> 64", false),
        ("next_pid << 1", true),
        ("CPU == 1", true),
        ("common_pid == 7", true),
    ] {
        assert_eq!(passes(&format!("sched_switch: {expr}"), &p), want, "{expr}");
    }
}

#[test]
fn signed_values_compare_unsigned_as_libtraceevent() {
    // A negative int is sign-extended to 64 bits and compared as u64: -1 is the
    // largest value, not below 0.
    let p = switch(("bash", -1), -1, ("x", 0));
    assert!(passes("sched_switch: prev_pid > 0", &p));
    assert!(passes("sched_switch: prev_pid == 0xffffffffffffffff", &p));
    assert!(!passes("sched_switch: prev_pid == 0xffffffff", &p));
}

#[test]
fn string_comparisons() {
    let p = switch(("bash", 7), 1, ("vcpu0", 42));
    for (expr, want) in [
        (r#"next_comm == "vcpu0""#, true),
        (r#"next_comm == "vcpu""#, false),
        (r#"next_comm != "vcpu""#, true),
        (r#"next_comm =~ "vcpu""#, true),
        (r#"next_comm =~ "^VCPU[0-9]$""#, true),
        (r#"next_comm =~ "^cpu""#, false),
        (r#"next_comm !~ "cpu""#, false),
        (r#"next_comm =~ "x\|cpu""#, true),
        (r#"next_comm =~ "vc+""#, false),
        (r#"next_comm =~ "vc\+""#, true),
        (r#"next_comm == "vc" "pu0""#, true),
        (r#"next_comm == 'vcpu0'"#, true),
        (r#"COMM == "bash""#, true),
        (r#"COMM =~ "^b""#, true),
        ("prev_state == 1", true),
        ("prev_state == '\x01'", true),
    ] {
        assert_eq!(passes(&format!("sched_switch: {expr}"), &p), want, "{expr}");
    }
    // A one-character 'c' is its code.
    let d = switch(("bash", 7), i64::from(b'D'), ("x", 1));
    assert!(passes("sched_switch: prev_state == 'D'", &d));
    // `__data_loc` strings.
    assert!(passes(r#"guest/text: msg == "hello""#, &text("hello")));
    assert!(passes(r#"text: msg =~ "l\{2\}""#, &text("hello")));
    assert!(!passes(r#"text: msg =~ "l\{3\}""#, &text("hello")));
}

#[test]
fn logic_groups_from_the_left_with_one_precedence() {
    let p = switch(("bash", 7), 1, ("vcpu0", 42));
    // (true || x) && false: false, where C's precedence gives true.
    assert!(!passes(
        "sched_switch: prev_pid == 7 || next_pid == 1 && next_pid == 0",
        &p
    ));
    assert!(passes(
        "sched_switch: prev_pid == 7 || (next_pid == 1 && next_pid == 0)",
        &p
    ));
    // (false && x) || true: true.
    assert!(passes(
        "sched_switch: prev_pid == 0 && next_pid == 0 || next_pid == 42",
        &p
    ));
    // `!` takes one term.
    assert!(passes("sched_switch: !prev_pid == 0 && next_pid == 42", &p));
    assert!(!passes(
        "sched_switch: !(prev_pid == 7 && next_pid == 42)",
        &p
    ));
    assert!(passes("sched_switch: !!(prev_pid == 7)", &p));
    assert!(passes("sched_switch: !(prev_state & 2)", &p));
    let Ast::And(v) = parse("a == 1 || b == 2 && c == 3").unwrap() else {
        panic!("not an and")
    };
    assert!(matches!(v.as_slice(), [Ast::Or(o), Ast::Num { .. }] if o.len() == 2));
}

#[test]
fn syntax_errors_name_the_place() {
    for (expr, col) in [
        ("prev_pid", 9),
        ("prev_pid == ", 13),
        ("prev_pid & 1 == 1", 14),
        ("prev_pid = 1", 10),
        ("(prev_pid == 1", 15),
        ("prev_pid == 1)", 14),
        ("prev_pid == 1 &&", 17),
        ("1 == prev_pid", 1),
        ("prev_pid == 12ab", 13),
        ("prev_pid == 99999999999999999999", 13),
        (r#"next_comm == "x"#, 14),
        ("prev_pid == 1 $", 15),
        ("prev_pid == 1, next_pid == 2", 14),
        ("()", 2),
        ("", 1),
        (r#"next_comm < "x""#, 13),
        ("prev_pid =~ 1", 13),
    ] {
        // Columns of the whole filter.
        match refused(&format!("sched_switch: {expr}")) {
            E::Syntax(at, _) => assert_eq!(at + 1, col + 14, "{expr}"),
            k => panic!("{expr}: {k}"),
        }
    }
}

#[test]
fn checked_against_the_formats() {
    assert_eq!(refused("nosuch"), E::NoEvent("nosuch".into()));
    assert_eq!(
        refused("sched_switch,nosuch: prev_pid == 1"),
        E::NoEvent("nosuch".into())
    );
    assert_eq!(refused("guest:markr"), E::NoEvent("guest:markr".into()));
    assert_eq!(
        refused("sched_switch: pid == 1"),
        E::NoField("pid".into(), "sched:sched_switch".into())
    );
    assert_eq!(
        refused("sched_switch: prev_pid == pidd"),
        E::NoField("pidd".into(), "sched:sched_switch".into())
    );
    assert!(
        matches!(refused("sched: nosuch == 1"), E::NoField(f, s) if f == "nosuch" && s.contains("none of"))
    );
    assert!(matches!(
        refused("sched_switch: next_comm == 1"),
        E::NotNumber(..)
    ));
    assert!(matches!(
        refused("sched_switch: COMM > 1"),
        E::NotNumber(..)
    ));
    assert!(matches!(
        refused(r#"sched_switch: prev_pid == "1""#),
        E::NotString(..)
    ));
    assert!(matches!(
        refused(r#"sched_switch: CPU =~ "1""#),
        E::NotString(..)
    ));
    assert_eq!(refused(": prev_pid == 1"), E::NoEvents);
}

#[test]
fn a_field_one_selected_event_lacks_fails_there() {
    // libtraceevent: the comparison is false for the event without the field.
    let f = "sched_switch,sched_wakeup: prev_pid == 7 || pid == 3";
    assert!(passes(f, &switch(("bash", 7), 0, ("x", 1))));
    assert!(passes(f, &wakeup("bash", 3)));
    assert!(!passes(f, &wakeup("bash", 7)));
    assert!(passes("sched: !prev_pid == 1", &wakeup("bash", 7)));
}

#[test]
fn events_are_whole_case_insensitive_regexes() {
    let sw = switch(("bash", 7), 0, ("x", 1));
    let wk = wakeup("bash", 3);
    for (spec, s, w) in [
        ("sched_switch", true, false),
        ("SCHED_SWITCH", true, false),
        ("sched", true, true),
        ("sched/.*", true, true),
        ("sched/sched_w.*", false, true),
        ("sched_sw", false, false),
        ("sched_*", true, true),
        ("sched_switch, sched_wakeup", true, true),
        // hyptrace's globs.
        ("sched:*", true, true),
        ("*:sched_switch", true, false),
        ("sched:sched_s*", true, false),
        ("guest:text,sched_wakeup", false, true),
    ] {
        if spec == "sched_sw" {
            assert_eq!(refused(spec), E::NoEvent("sched_sw".into()));
            continue;
        }
        assert_eq!(passes(spec, &sw), s, "{spec}");
        assert_eq!(passes(spec, &wk), w, "{spec}");
    }
}

#[test]
fn filters_combine_as_trace_cmd() {
    let mut f = set(&[
        "sched_switch: prev_pid == 7",
        "sched_wakeup",
        "sched_switch: next_pid == 5000",
    ]);
    let c = cmdlines();
    // Any filter passes: printed.
    assert!(f.wants(&switch(("bash", 7), 0, ("x", 1)), 0, &c));
    assert!(!f.wants(&switch(("bash", 8), 0, ("x", 1)), 0, &c));
    // A stack trace of CPU 0 (printed before) is printed, every one of them as 3.1.6
    // prints them; not one of CPU 1.
    let stack = header(13, 7, 16);
    assert!(f.wants(&stack, 0, &c));
    assert!(f.wants(&stack, 0, &c));
    assert!(!f.wants(&stack, 1, &c));
    assert!(!f.wants(&text("x"), 0, &c));
    assert_eq!(
        f.unmatched(),
        vec![
            "sched_wakeup".to_string(),
            "sched_switch: next_pid == 5000".to_string()
        ]
    );
    assert!(f.wants(&wakeup("a", 1), 1, &c));
    assert_eq!(
        f.unmatched(),
        vec!["sched_switch: next_pid == 5000".to_string()]
    );
    assert!(FilterSet::compile(&[], &formats()).unwrap().is_none());
}

#[test]
fn short_payloads_read_as_zero() {
    let p = header(10, 7, 8);
    assert!(passes("sched_switch: prev_pid == 0", &p));
    assert!(passes(r#"sched_switch: next_comm == """#, &p));
    let mut t = text("hello");
    t[10] = 0xff; // length past the payload
    assert!(passes(r#"text: msg == """#, &t));
}

#[test]
fn hostile_filters_are_bounded() {
    let long = format!(
        "sched_switch: {}",
        "prev_pid == 1 && ".repeat(MAX_EXPR_LEN / 10) + "prev_pid == 1"
    );
    assert!(matches!(refused(&long), E::TooLong(..)));
    let deep = format!(
        "sched_switch: {}prev_pid == 1{}",
        "(".repeat(MAX_DEPTH + 1),
        ")".repeat(MAX_DEPTH + 1)
    );
    assert_eq!(refused(&deep), E::TooDeep(MAX_DEPTH));
    let nots = format!("sched_switch: {}prev_pid == 1", "!".repeat(MAX_DEPTH + 1));
    assert_eq!(refused(&nots), E::TooDeep(MAX_DEPTH));
    // A chain of `&&` is flat: as long as the length allows.
    let chain = format!(
        "sched_switch: {}prev_pid == 1",
        "prev_pid == 1 && ".repeat(200)
    );
    assert!(passes(&chain, &switch(("a", 1), 0, ("b", 2))));
    let big = format!(r#"sched_switch: next_comm =~ "{}""#, "a".repeat(2000));
    assert!(matches!(refused(&big), E::Regex(..)));
    let huge = r#"sched_switch: next_comm =~ "\(\(\(\(a*\)\{100\}\)\{100\}\)\{100\}\)""#;
    assert!(matches!(refused(huge), E::Regex(..)));
    assert!(matches!(
        refused(r#"sched_switch: next_comm =~ "\(a\)\1""#),
        E::Regex(..)
    ));
    assert!(matches!(
        refused(r#"sched_switch: next_comm =~ "[a""#),
        E::Regex(..)
    ));
    let many: Vec<String> = (0..=super::MAX_FILTERS)
        .map(|_| "sched".to_string())
        .collect();
    assert!(matches!(
        FilterSet::compile(&many, &formats())
            .map(|_| ())
            .unwrap_err()
            .kind,
        E::TooMany(_)
    ));
}

#[test]
fn basic_regular_expressions() {
    for (re, text, want) in [
        ("a.c", "xabcx", true),
        ("^abc$", "abc", true),
        ("^abc$", "abcd", false),
        ("a*", "", true),
        ("*a", "x*a", true),
        ("^*a", "*a", true),
        ("a\\{2\\}", "aa", true),
        ("a{2}", "a{2}", true),
        ("(a)", "(a)", true),
        ("\\(ab\\)*c", "ababc", true),
        ("a|b", "a|b", true),
        ("a\\|b", "b", true),
        ("a+", "a+", true),
        ("a?", "a?", true),
        ("[[:digit:]]x", "5x", true),
        ("[]a]", "]", true),
        ("[^a]", "a", false),
        ("[\\]", "\\", true),
        ("\\<ab\\>", "x ab y", true),
        ("a$b", "a$b", true),
        ("ABC", "abc", true),
        ("x.y", "x\ny", true),
    ] {
        let r = compile_bre(re, false).unwrap_or_else(|e| panic!("{re}: {e}"));
        assert_eq!(r.is_match(text.as_bytes()), want, "{re} on {text:?}");
    }
    assert!(compile_bre("a\\", false).is_err());
    assert!(compile_bre("sched_*", true).unwrap().is_match(b"sched"));
    assert!(!compile_bre("sched", true)
        .unwrap()
        .is_match(b"sched_switch"));
}
