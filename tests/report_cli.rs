//! `hyptrace report` as trace-cmd users type it (issue 11): the input positional or
//! with `-i`, `--cpu LIST`, `-F/--filter` (trace-cmd's filters, hyptrace's globs), `--skip`/`--count`,
//! `--stat`, trace-cmd's `--cpus`/`--first-event`/`--last-event`, clap's errors for what it does not take, a raw page stream read like a
//! trace.dat (told apart by magic), a corrupt file an error (never a panic). The
//! kernel fixtures need no VM; the raw stream comes from a VM run (skipped without
//! /dev/kvm unless HYPTRACE_REQUIRE_KVM=1).

use std::collections::BTreeSet;
use std::path::PathBuf;

use hyptrace::env::{self, assert_usage_error, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("crates/output/tests/fixtures")
        .join(name)
        .to_str()
        .expect("utf-8 path")
        .to_string()
}

/// `report ARGS`: exit 0, stdout.
fn report(args: &[&str]) -> String {
    let mut a = vec!["report"];
    a.extend_from_slice(args);
    let o = env::run(BIN, &a);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", env::stderr(&o));
    env::stdout(&o)
}

/// The event lines (not `cpus=`, not drop markers).
fn events(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| !l.starts_with("cpus=") && !l.starts_with("CPU:"))
        .collect()
}

/// The CPU column `[NNN]` of an event line.
fn cpu_of(line: &str) -> u32 {
    let i = line.find(" [").expect("cpu column");
    line[i + 2..i + 5].parse().expect("cpu number")
}

/// The event name of an event line (after the time).
fn name_of(line: &str) -> &str {
    let i = line.find("]").expect("cpu column");
    let rest = &line[i..];
    let j = rest.find(": ").expect("time") + 2;
    rest[j..].split(':').next().expect("name").trim()
}

#[test]
fn positional_and_dash_i_are_the_same() {
    let f = fixture("kernel-v7-zstd.dat");
    let a = report(&[&f]);
    let b = report(&["-i", &f]);
    assert_eq!(a, b);
    let want = std::fs::read_to_string(fixture("kernel-v7-zstd.report-t.txt")).expect("fixture");
    assert_eq!(a.lines().count(), want.lines().count());
    // Both at once: clap's error.
    let o = env::run(BIN, &["report", &f, "-i", &f]);
    assert_usage_error(&o, "FILE and -i", "cannot be used with");
}

/// trace-cmd's `-t` (full timestamps) is accepted; ours are always full: the same
/// output as without it.
#[test]
fn dash_t_prints_what_report_prints() {
    for name in ["kernel-v6.dat", "kernel-v7-zstd.dat"] {
        let f = fixture(name);
        let plain = report(&[&f]);
        assert!(!events(&plain).is_empty(), "{name}");
        assert_eq!(report(&["-t", &f]), plain, "{name}");
        assert_eq!(report(&["-t", "-i", &f]), plain, "{name}");
    }
}

/// `hyptrace ARGS` with stdin from `file` (redirected: a regular file) or piped (its
/// bytes written into a pipe by a thread).
fn with_stdin(args: &[&str], file: &str, piped: bool) -> std::process::Output {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let stdin = if piped {
        Stdio::piped()
    } else {
        Stdio::from(std::fs::File::open(file).expect("input"))
    };
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let feeder = child.stdin.take().map(|mut w| {
        let data = std::fs::read(file).expect("input");
        // A reader that stops early closes the pipe: the write error is fine.
        std::thread::spawn(move || drop(w.write_all(&data)))
    });
    let o = child.wait_with_output().expect("wait");
    if let Some(f) = feeder {
        f.join().expect("feeder");
    }
    o
}

/// `report -` and `report -i -` read stdin: a redirected file or a pipe prints exactly
/// what `report FILE` prints; junk on stdin is a usage error naming stdin.
#[test]
fn stdin_is_read_like_a_file() {
    for name in ["kernel-v6.dat", "kernel-v7.dat", "kernel-v7-zstd.dat"] {
        let f = fixture(name);
        let want = report(&[&f]);
        for piped in [false, true] {
            for args in [
                &["report", "-"][..],
                &["report", "-i", "-"],
                &["report", "--stat", "-"],
            ] {
                let o = with_stdin(args, &f, piped);
                assert_eq!(
                    o.status.code(),
                    Some(0),
                    "{name} {args:?}: {}",
                    env::stderr(&o)
                );
                let expect = if args.contains(&"--stat") {
                    report(&["--stat", &f])
                } else {
                    want.clone()
                };
                assert_eq!(env::stdout(&o), expect, "{name} {args:?} piped={piped}");
            }
        }
    }
    let dir = TempDir::new("report-stdin");
    let junk = dir.file("junk");
    std::fs::write(&junk, b"not a trace at all").expect("write");
    let o = with_stdin(&["report", "-"], &junk, true);
    assert_usage_error(&o, "junk on stdin", "stdin: not a trace.dat");
}

#[test]
fn cpu_list_selects_cpus() {
    let f = fixture("kernel-v6.dat");
    let all = report(&[&f]);
    let cpus: BTreeSet<u32> = events(&all).iter().map(|l| cpu_of(l)).collect();
    assert!(cpus.len() >= 2, "fixture has events of {cpus:?}");
    let first = *cpus.iter().next().expect("a cpu");
    let one = report(&[&f, "--cpu", &first.to_string()]);
    assert!(one.starts_with("cpus="), "{one}");
    let lines = events(&one);
    assert!(!lines.is_empty());
    assert!(lines.iter().all(|l| cpu_of(l) == first), "{one}");
    // The lines of one CPU are the lines of the whole report on that CPU, in order.
    let want: Vec<&str> = events(&all)
        .into_iter()
        .filter(|l| cpu_of(l) == first)
        .collect();
    assert_eq!(lines, want);
    // Lists and ranges: all CPUs again.
    let max = *cpus.iter().last().expect("a cpu");
    let range = report(&[&f, "--cpu", &format!("0-{max}")]);
    assert_eq!(range, all);
    let list: Vec<String> = cpus.iter().map(u32::to_string).collect();
    let list = report(&[&f, "--cpu", &list.join(",")]);
    assert_eq!(list, all);
    // A CPU without data: only the cpus= line, and a word on stderr (exit 0).
    let o = env::run(BIN, &["report", &f, "--cpu", "999"]);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    assert!(events(&env::stdout(&o)).is_empty(), "{}", env::stdout(&o));
    assert_eq!(
        env::stderr(&o),
        "hyptrace: --cpu 999 matched no event of the file\n"
    );
    // A CPU with data says nothing.
    let o = env::run(BIN, &["report", &f, "--cpu", &first.to_string()]);
    assert_eq!(env::stderr(&o), "");
}

#[test]
fn event_globs_select_events() {
    let f = fixture("kernel-v7.dat");
    let all = report(&[&f]);
    let names: BTreeSet<&str> = events(&all).iter().map(|l| name_of(l)).collect();
    assert!(names.contains("sched_switch"), "{names:?}");
    let sched = report(&[&f, "-F", "sched:*"]);
    let got = events(&sched);
    assert!(!got.is_empty());
    assert!(
        got.iter().all(|l| name_of(l).starts_with("sched_")),
        "{sched}"
    );
    let want: Vec<&str> = events(&all)
        .into_iter()
        .filter(|l| name_of(l).starts_with("sched_"))
        .collect();
    assert_eq!(got, want);
    // `*:NAME`, a bare NAME, a comma list and repeated flags.
    let sw = report(&[&f, "--filter", "*:sched_switch"]);
    assert!(events(&sw).iter().all(|l| name_of(l) == "sched_switch"));
    assert_eq!(sw, report(&[&f, "-F", "sched_switch"]));
    let two = report(&[&f, "-F", "sched_switch,sched_wakeup"]);
    assert_eq!(
        two,
        report(&[&f, "-F", "sched_switch", "-F", "sched:sched_wakeup"])
    );
    assert!(events(&two).len() > events(&sw).len());
    // `--events` is run/record's count: report refuses it, pointing at -F.
    let o = env::run(BIN, &["report", &f, "--events", "sched_switch"]);
    assert_usage_error(&o, "report --events", "use -F");
    // An event pattern that matches no event of the file is a usage error naming it.
    let o = env::run(BIN, &["report", &f, "-F", "nosuch:*"]);
    assert_usage_error(&o, "-F nosuch:*", "no event of the file matches `nosuch:*`");
}

/// trace-cmd's filter expressions (libtraceevent's): refused with one line naming the
/// event, field or place when wrong, a word on stderr when they match nothing.
#[test]
fn filter_expressions_are_checked() {
    let f = fixture("kernel-v7.dat");
    for (filter, needle) in [
        (
            "guest:markr",
            "-F 'guest:markr': no event of the file matches `guest:markr`",
        ),
        (
            "sched_switchh: prev_pid > 0",
            "no event of the file matches `sched_switchh`",
        ),
        (
            "sched_switch: prev_pidd != 0",
            "-F 'sched_switch: prev_pidd != 0': sched:sched_switch has no field `prev_pidd`",
        ),
        (
            "sched_switch: prev_pid != ",
            "syntax error at column 27: expected a value",
        ),
        ("sched_switch: (prev_pid != 0", "syntax error at column 29"),
        (
            "sched_switch: next_comm > 1",
            "`next_comm` of sched:sched_switch is not a number",
        ),
        (r#"sched_switch: next_comm =~ "\(a""#, "regular expression"),
    ] {
        let o = env::run(BIN, &["report", &f, "-F", filter]);
        assert_usage_error(&o, filter, needle);
    }
    // Bounded: a filter longer than 4096 bytes is refused.
    let long = format!(
        "sched_switch: {}prev_pid == 1",
        "prev_pid == 1 && ".repeat(300)
    );
    let o = env::run(BIN, &["report", &f, "-F", &long]);
    assert_usage_error(&o, "long filter", "more than 4096");
    // A filter that passes nothing: the cpus= line, a word on stderr, exit 0; the one
    // that passes something is not named.
    let o = env::run(
        BIN,
        &[
            "report",
            &f,
            "-F",
            "sched_switch: prev_pid > 5000000",
            "-F",
            "sched_wakeup",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    assert!(!events(&env::stdout(&o)).is_empty());
    assert_eq!(
        env::stderr(&o),
        "hyptrace: -F 'sched_switch: prev_pid > 5000000' matched no event of the file\n"
    );
    // With --cpu: said of those CPUs.
    let o = env::run(
        BIN,
        &["report", &f, "--cpu", "1", "-F", "sched_switch: CPU == 0"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    assert_eq!(
        env::stderr(&o),
        "hyptrace: -F 'sched_switch: CPU == 0' matched no event of the file on --cpu 1\n"
    );
    // --count stops before the end: nothing is known of the rest, nothing said.
    let o = env::run(
        BIN,
        &[
            "report",
            &f,
            "--count",
            "1",
            "-F",
            "sched_wakeup",
            "-F",
            "sched_switch: prev_pid > 5000000",
        ],
    );
    assert_eq!(env::stderr(&o), "");
}

#[test]
fn skip_and_count() {
    let f = fixture("kernel-v7-zstd.dat");
    let all = report(&[&f, "-F", "sched:*"]);
    let all = events(&all);
    assert!(all.len() > 10);
    let part = report(&[&f, "-F", "sched:*", "--skip", "3", "--count", "5"]);
    assert_eq!(events(&part), all[3..8].to_vec());
    let none = report(&[&f, "--count", "0"]);
    assert!(events(&none).is_empty(), "{none}");
}

#[test]
fn stat_kept() {
    let f = fixture("kernel-v6.dat");
    let s = report(&[&f, "--stat"]);
    let want = std::fs::read_to_string(fixture("kernel.stat.txt")).expect("fixture");
    assert!(want.contains(&s), "{s}");
}

#[test]
fn bad_flags_and_inputs_are_usage_errors() {
    let f = fixture("kernel-v6.dat");
    let o = env::run(BIN, &["report", &f, "--bogus"]);
    assert_usage_error(&o, "unknown flag", "unexpected argument '--bogus'");
    assert!(env::stderr(&o).contains("Usage:"), "{}", env::stderr(&o));
    for (list, needle) in [
        ("3-1", "backwards"),
        ("x", "not a CPU"),
        ("1,", "not a CPU"),
    ] {
        let o = env::run(BIN, &["report", &f, "--cpu", list]);
        assert_usage_error(&o, list, needle);
    }
    let dir = TempDir::new("report-bad");
    let junk = dir.file("junk.dat");
    std::fs::write(&junk, b"not a trace at all").expect("write");
    let o = env::run(BIN, &["report", &junk]);
    assert_usage_error(&o, "junk", "bad magic");
    let o = env::run(BIN, &["report", &dir.file("missing.dat")]);
    assert_usage_error(&o, "missing", "missing.dat");
    // A trace.dat cut inside its compressed pages: damaged (exit 1, the damage named),
    // fewer lines, no panic (docs/output.md "Damaged files"; tests/damaged.rs). trace-cmd
    // writes the CPU table in an options section after the pages: a cut loses it.
    let data = std::fs::read(fixture("kernel-v7-zstd.dat")).expect("fixture");
    let whole = env::stdout(&env::run(BIN, &["report", &fixture("kernel-v7-zstd.dat")]));
    for cut in [data.len() / 2, data.len() - 100, data.len() - 1] {
        let p = dir.file("cut.dat");
        std::fs::write(&p, &data[..cut]).expect("write");
        let o = env::run(BIN, &["report", &p]);
        let err = env::stderr(&o);
        assert!(!err.contains("panicked"), "{err}");
        // The end of the file is the strings section (section names) no reader needs:
        // cut there, every event is printed and nothing is damaged.
        if o.status.code() == Some(0) {
            assert!(err.is_empty(), "{err}");
            assert_eq!(env::stdout(&o), whole, "cut at {cut}");
            continue;
        }
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("damaged: offset "), "{err}");
        assert!(env::stdout(&o).lines().count() < whole.lines().count());
    }
}

/// `record --format raw` is read by `report` (detected by its magic) and prints what
/// `record --format text` of the same workload would: the same lines as the text
/// sink, since the run's pages are replayed into it.
/// A trace.dat whose file header is damaged: nothing is readable (exit 1), said once
/// on one line — the file, that nothing is readable, where, and what is wrong there.
#[test]
fn an_unreadable_header_names_where_and_what() {
    let dir = TempDir::new("report-unreadable");
    let magic = b"\x17\x08\x44tracing";
    for (name, rest, why) in [
        (
            "cut.dat",
            &b"7\0\0\x08\x00\x10\x00\x00"[..],
            "malformed trace.dat at offset 18: compression name runs past the end",
        ),
        (
            "version.dat",
            &b"x7\0\0\x08\x00\x10\x00\x00"[..],
            "malformed trace.dat at offset 10: bad version \"x7\"",
        ),
    ] {
        let p = dir.file(name);
        std::fs::write(&p, [&magic[..], rest].concat()).expect("write");
        let o = env::run(BIN, &["report", &p]);
        assert_eq!(o.status.code(), Some(1), "{}", env::stderr(&o));
        assert_eq!(
            env::stderr(&o),
            format!("hyptrace: error: {p}: damaged trace.dat, nothing is readable: {why}\n")
        );
    }
}

#[test]
fn raw_stream_is_reported() {
    if !kvm_available(KRATE, "raw_stream_is_reported") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("report-raw");
    let raw = dir.file("t.raw");
    let o = env::run(
        BIN,
        &[
            "record", "--format", "raw", "-o", &raw, "--vcpus", "2", "--events", "3000", "--rate",
            "0", "--mode", "stop",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let text = report(&[&raw]);
    assert!(text.starts_with("cpus=2\n"), "{text}");
    assert_eq!(text, report(&["-i", &raw]));
    // From a pipe: streamed, the same lines.
    let o = with_stdin(&["report", "-"], &raw, true);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    assert_eq!(env::stdout(&o), text);
    let n = events(&text).len();
    assert!(n > 0);
    // --cpu works on raw input too.
    let one = report(&[&raw, "--cpu", "1"]);
    assert!(events(&one).iter().all(|l| cpu_of(l) == 1), "{one}");
    assert!(!events(&one).is_empty() && events(&one).len() < n);
    // -F on a raw stream (issue 39): the same lines, only those it passes.
    let markers = report(&[&raw, "-F", "marker: seq < 1000"]);
    let seq = |l: &str| -> u64 {
        let f = l.split("seq=").nth(1).expect("a seq field");
        f.split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("seq")
    };
    let want: Vec<&str> = events(&text)
        .into_iter()
        .filter(|l| seq(l) < 1000)
        .collect();
    assert!(!want.is_empty() && want.len() < n, "{text}");
    assert_eq!(events(&markers), want);
    let o = env::run(BIN, &["report", &raw, "-F", "marker: nope > 1"]);
    assert_usage_error(&o, "raw -F unknown field", "has no field `nope`");
    // A slice needs a trace.dat: a usage error naming convert.
    let o = env::run(BIN, &["report", &raw, "--skip", "1"]);
    assert_usage_error(&o, "raw --skip", "convert");
    // --stat: the end record.
    let st = report(&[&raw, "--stat"]);
    assert!(st.contains("CPU: 0\n") && st.contains("CPU: 1\n"), "{st}");
    // Cut anywhere: the lines before the cut, or an error; never a panic.
    let data = std::fs::read(&raw).expect("raw");
    let cut = dir.file("cut.raw");
    for n in (0..data.len()).step_by(data.len() / 40 + 1) {
        std::fs::write(&cut, &data[..n]).expect("write");
        let o = env::run(BIN, &["report", &cut]);
        let err = env::stderr(&o);
        assert!(!err.contains("panicked"), "{n}: {err}");
        assert!(matches!(o.status.code(), Some(0 | 2)), "{n}: {err}");
    }
}

/// `--cpus`, `--first-event`, `--last-event` print what trace-cmd prints (checked
/// against the real trace-cmd when it is installed).
#[test]
fn cpu_listing_like_trace_cmd() {
    let dir = TempDir::new("report-cpus");
    for name in ["kernel-v6.dat", "kernel-v7.dat", "kernel-v7-zstd.dat"] {
        // A relative path, as trace-cmd echoes it.
        std::fs::copy(fixture(name), dir.path().join(name)).expect("copy");
        for flags in [
            &["--cpus"][..],
            &["--first-event"],
            &["--last-event"],
            &["--first-event", "--last-event"],
        ] {
            let mut args = vec!["report", name];
            args.extend_from_slice(flags);
            let o = std::process::Command::new(BIN)
                .args(&args)
                .current_dir(dir.path())
                .output()
                .expect("run");
            assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
            let ours = env::stdout(&o);
            assert!(
                ours.starts_with(&format!("List of CPUs in {name} with data:\n  0")),
                "{ours}"
            );
            if flags.contains(&"--first-event") {
                assert!(ours.contains("\tFirst event:  515."), "{ours}");
            }
            if !env::trace_cmd_available() {
                continue;
            }
            // trace-cmd takes its flags before the file only.
            let mut targs = vec!["report"];
            targs.extend_from_slice(flags);
            targs.push(name);
            let t = std::process::Command::new("trace-cmd")
                .args(&targs)
                .current_dir(dir.path())
                .output()
                .expect("trace-cmd");
            assert_eq!(ours, env::stdout(&t), "{name} {flags:?}");
        }
    }
}
