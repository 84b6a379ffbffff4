//! Guest-registered events end to end: the built-in events registered by the payload
//! (their formats are the built-in ones, so they print as before), `-e` / `--disable`
//! changing what is recorded with exact `skipped` counts, unknown names (exit 2),
//! `hyptrace list`, and the example Rust guest (guest/src/bin/example_rust.rs): events
//! the host never saw, printed by the real trace-cmd with their fields, and malformed
//! registrations rejected one by one while the valid ones are traced.
//!
//! VM tests skip without /dev/kvm (fail with HYPTRACE_REQUIRE_KVM=1), trace-cmd checks
//! without trace-cmd (fail with HYPTRACE_REQUIRE_TRACE_CMD=1). Counts and contents —
//! never durations.

use std::process::Output;

use hyptrace::adversary::example_rust_guest;
use hyptrace::env::{
    self, assert_usage_error, kvm_available, trace_cmd_available, vm_lock, TempDir,
};
use hyptrace::model::Model;

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// One CPU of `--stats`: attempted, skipped, written, read, lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counts {
    attempted: u64,
    skipped: u64,
    written: u64,
    read: u64,
    lost: u64,
}

/// `hyptrace run --stats F ARGS`: the output and the per-CPU counts.
fn run(args: &[&str]) -> (Output, Vec<Counts>) {
    let dir = TempDir::new("events");
    let stats = dir.file("stats.json");
    let mut all = vec!["run", "--stats", &stats];
    all.extend_from_slice(args);
    let out = env::run(BIN, &all);
    let text = std::fs::read_to_string(&stats).unwrap_or_else(|e| {
        panic!(
            "{args:?}: no stats ({e}); exit {:?}; stderr: {}",
            out.status.code(),
            env::stderr(&out)
        )
    });
    let json: serde_json::Value = serde_json::from_str(&text).expect("--stats is JSON");
    let u = |c: &serde_json::Value, k: &str| {
        c[k].as_u64()
            .unwrap_or_else(|| panic!("{k} missing in {c}"))
    };
    let cpus = json["cpus"]
        .as_array()
        .expect("cpus")
        .iter()
        .map(|c| Counts {
            attempted: u(c, "attempted"),
            skipped: u(c, "skipped"),
            written: u(c, "written"),
            read: u(c, "read"),
            lost: u(c, "lost"),
        })
        .collect();
    (out, cpus)
}

/// The event lines of `text` as (cpu, name, fields).
fn events(text: &str) -> Vec<(u32, String, String)> {
    text.lines()
        .filter_map(|l| {
            let open = l.find("] ")?;
            let cpu: u32 = l[l.find('[')? + 1..open].trim().parse().ok()?;
            let rest = &l[open + 2..];
            let colon = rest.find(": ")?;
            let after = rest[colon + 2..].trim_start();
            let name_end = after.find(':')?;
            let name = after[..name_end].to_string();
            let fields = after[name_end + 1..].trim_start().to_string();
            Some((cpu, name, fields))
        })
        .collect()
}

const EVENTS: u64 = 3000;

/// `-e` / `--disable` change what is recorded: per vCPU, `skipped` is exactly the number
/// of events of the disabled types the mixed workload attempted (from its model),
/// `written == attempted - skipped == read + lost`, and every printed event is one the
/// selection enables, with the fields the model says for its `seq`.
#[test]
fn selection_changes_counts_with_exact_skipped() {
    if !kvm_available(KRATE, "selection_changes_counts_with_exact_skipped") {
        return;
    }
    let _lock = vm_lock();
    let n = EVENTS.to_string();
    let base = [
        "--workload",
        "mixed",
        "--vcpus",
        "2",
        "--events",
        &n,
        "--rate",
        "0",
        "--mode",
        "stop",
        "--buffer-kb",
        "2048",
    ];
    let cases: &[(&[&str], &[&str])] = &[
        (&[], &["marker", "span", "text"]),
        (&["-e", "all"], &["marker", "span", "text"]),
        (&["-e", "guest:marker"], &["marker"]),
        (&["--disable", "text"], &["marker", "span"]),
        (
            &["-e", "guest:*", "--disable", "guest:span"],
            &["marker", "text"],
        ),
        (&["-e", "span", "-e", "text"], &["span", "text"]),
    ];
    for (sel, enabled) in cases {
        let mut args: Vec<&str> = base.to_vec();
        args.extend_from_slice(sel);
        let (out, cpus) = run(&args);
        let err = env::stderr(&out);
        assert_eq!(out.status.code(), Some(0), "{sel:?}: {err}");
        assert_eq!(cpus.len(), 2, "{sel:?}");
        let printed = events(&env::stdout(&out));
        for (cpu, c) in cpus.iter().enumerate() {
            let mut model = Model::new("mixed", cpu as u32);
            let skipped = (0..EVENTS)
                .filter(|&s| !enabled.contains(&model.at(s).name))
                .count() as u64;
            assert_eq!(c.attempted, EVENTS, "{sel:?} cpu {cpu}: {c:?}");
            assert_eq!(c.skipped, skipped, "{sel:?} cpu {cpu}: {c:?}");
            assert_eq!(
                c.written,
                c.attempted - c.skipped,
                "{sel:?} cpu {cpu}: {c:?}"
            );
            assert_eq!(c.written, c.read + c.lost, "{sel:?} cpu {cpu}: {c:?}");
            assert_eq!(
                c.lost, 0,
                "{sel:?} cpu {cpu}: a 2 MiB stop-mode ring: {c:?}"
            );
            let mine: Vec<&(u32, String, String)> =
                printed.iter().filter(|e| e.0 == cpu as u32).collect();
            assert_eq!(mine.len() as u64, c.read, "{sel:?} cpu {cpu}");
            let mut model = Model::new("mixed", cpu as u32);
            for (_, name, fields) in mine {
                assert!(enabled.contains(&name.as_str()), "{sel:?}: {name} {fields}");
                let seq: u64 = fields
                    .strip_prefix("seq=")
                    .and_then(|f| f.split(' ').next())
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("{sel:?}: no seq in {fields}"));
                let want = model.at(seq);
                assert_eq!(
                    (name.as_str(), fields.as_str()),
                    (want.name, want.fields.as_str())
                );
            }
        }
    }
}

/// A name no registered event has is bad input (exit 2), naming the registered events.
#[test]
fn unknown_event_names_are_usage_errors() {
    if !kvm_available(KRATE, "unknown_event_names_are_usage_errors") {
        return;
    }
    let _lock = vm_lock();
    for sel in [
        ["-e", "guest:nope"],
        ["--disable", "nope"],
        ["-e", "other:*"],
    ] {
        let mut args = vec!["run", "--events", "10"];
        args.extend_from_slice(&sel);
        let out = env::run(BIN, &args);
        assert_usage_error(
            &out,
            &format!("{sel:?}"),
            "(the guest registered: guest:marker, guest:span, guest:text)",
        );
    }
}

/// `hyptrace list` prints what the payload registered: exactly the built-in formats (so
/// the registered built-ins are the text formatter's fast-path formats and print as
/// before), each after `system: guest`.
#[test]
fn list_prints_the_registered_builtins() {
    if !kvm_available(KRATE, "list_prints_the_registered_builtins") {
        return;
    }
    let _lock = vm_lock();
    let out = env::run(BIN, &["list"]);
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let want: String = hyptrace_output::guest_formats()
        .iter()
        .map(|f| format!("system: {}\n{}\n", f.system, f.to_format_text()))
        .collect();
    assert_eq!(env::stdout(&out), want);
}

/// The example Rust guest's events (`demo:packet`, `demo:tick`, declared with the
/// `event!` macro; the host has never seen them): listed, recorded into trace.dat and
/// printed by the real trace-cmd with every field; `-e demo:tick` records only ticks
/// (the packets skipped).
#[test]
fn example_rust_guest_events_end_to_end() {
    if !kvm_available(KRATE, "example_rust_guest_events_end_to_end") {
        return;
    }
    let guest = example_rust_guest(&env::target_dir(BIN)).unwrap_or_else(|e| panic!("{e}"));
    let g = guest.to_str().expect("utf-8 path");
    let _lock = vm_lock();
    let out = env::run(BIN, &["list", "--guest", g]);
    let list = env::stdout(&out);
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    assert!(
        list.contains("system: demo\nname: packet\nID: 2000\n"),
        "{list}"
    );
    assert!(
        list.contains("\tfield:s32 proto;\toffset:12;\tsize:4;\tsigned:1;\n"),
        "{list}"
    );
    assert!(list.contains("name: tick\nID: 2001\n"), "{list}");

    const N: u64 = 40;
    let want = |cpu: u32, only_ticks: bool| -> Vec<(u32, String, String)> {
        (0..N)
            .flat_map(|i| {
                let p = (
                    cpu,
                    "packet".to_string(),
                    format!(
                        "len={} proto={} flags={} ok={}",
                        i * 3,
                        -(i as i64),
                        i & 0xff,
                        u8::from(i % 2 == 0)
                    ),
                );
                let t = (
                    cpu,
                    "tick".to_string(),
                    format!("n={i} delta={}", 5 - i as i64),
                );
                if only_ticks {
                    vec![t]
                } else {
                    vec![p, t]
                }
            })
            .collect()
    };
    let n = N.to_string();
    for only_ticks in [false, true] {
        let dir = TempDir::new("example");
        let dat = dir.file("ex.dat");
        let mut args = vec![
            "record", "-o", &dat, "--guest", g, "--vcpus", "2", "--events", &n,
        ];
        if only_ticks {
            args.extend_from_slice(&["-e", "demo:tick"]);
        }
        let (out, cpus) = run_record(&args, &dir);
        assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
        for (cpu, c) in cpus.iter().enumerate() {
            assert_eq!(c.attempted, 2 * N, "cpu {cpu}: {c:?}");
            assert_eq!(
                c.skipped,
                if only_ticks { N } else { 0 },
                "cpu {cpu}: {c:?}"
            );
            assert_eq!(c.written, c.read + c.lost, "cpu {cpu}: {c:?}");
        }
        // Our own report of the file.
        let ours = env::run(BIN, &["report", "-i", &dat]);
        assert_eq!(ours.status.code(), Some(0), "{}", env::stderr(&ours));
        for (what, text) in [("hyptrace report", env::stdout(&ours))]
            .into_iter()
            .chain(trace_cmd_report(&dat).map(|t| ("trace-cmd report", t)))
        {
            let got = events(&text);
            for cpu in 0..2 {
                let mine: Vec<_> = got.iter().filter(|e| e.0 == cpu).cloned().collect();
                assert_eq!(mine, want(cpu, only_ticks), "{what} cpu {cpu}:\n{text}");
            }
        }
    }
}

/// `record ARGS --stats F`.
fn run_record(args: &[&str], dir: &TempDir) -> (Output, Vec<Counts>) {
    let stats = dir.file("stats.json");
    let mut all: Vec<&str> = args.to_vec();
    all.extend_from_slice(&["--stats", &stats]);
    let out = env::run(BIN, &all);
    let text = std::fs::read_to_string(&stats)
        .unwrap_or_else(|e| panic!("no stats ({e}): {}", env::stderr(&out)));
    let json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let cpus = json["cpus"]
        .as_array()
        .expect("cpus")
        .iter()
        .map(|c| Counts {
            attempted: c["attempted"].as_u64().expect("attempted"),
            skipped: c["skipped"].as_u64().expect("skipped"),
            written: c["written"].as_u64().expect("written"),
            read: c["read"].as_u64().expect("read"),
            lost: c["lost"].as_u64().expect("lost"),
        })
        .collect();
    (out, cpus)
}

/// `trace-cmd report FILE`, or `None` (skipped) without trace-cmd.
fn trace_cmd_report(path: &str) -> Option<String> {
    if !trace_cmd_available() {
        return None;
    }
    let out = std::process::Command::new("trace-cmd")
        .args(["report", path])
        .output()
        .expect("trace-cmd runs");
    assert!(
        out.status.success(),
        "trace-cmd report: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A guest registering malformed events next to valid ones (the example guest with
/// `--rate 1`): each bad entry is rejected with a warning naming it and the reason, the
/// valid ones are traced; a rejected event is never written.
#[test]
fn malformed_registrations_are_rejected_one_by_one_in_a_vm() {
    if !kvm_available(
        KRATE,
        "malformed_registrations_are_rejected_one_by_one_in_a_vm",
    ) {
        return;
    }
    let guest = example_rust_guest(&env::target_dir(BIN)).unwrap_or_else(|e| panic!("{e}"));
    let g = guest.to_str().expect("utf-8 path");
    let _lock = vm_lock();
    let (out, cpus) = run(&["--guest", g, "--vcpus", "1", "--events", "5", "--rate", "1"]);
    let err = env::stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("hyptrace: warning: event "))
        .collect();
    assert_eq!(
        warnings,
        [
            "hyptrace: warning: event 1 (demo:bad_overlap) rejected: field 1 (b): bytes 12..16 overlap field 0 (a)",
            "hyptrace: warning: event 2 (demo:bad_size) rejected: field 0 (a): size 8 does not match u32 (4 bytes)",
            "hyptrace: warning: event 4 (demo:bad_slot) rejected: enable bit 64 is out of range (0..64)",
            "hyptrace: warning: event 5 (demo:bad_type) rejected: field 0 (a): unknown C type \"struct foo\"",
            "hyptrace: warning: event 6 (demo:packet) rejected: demo:packet is already registered by event 0",
        ],
        "{err}"
    );
    let printed = events(&env::stdout(&out));
    let names: Vec<&str> = printed.iter().map(|e| e.1.as_str()).collect();
    assert_eq!(names.len(), 10, "{printed:?}");
    assert!(
        names.iter().all(|n| *n == "packet" || *n == "tick"),
        "{names:?}"
    );
    assert_eq!(
        cpus,
        [Counts {
            attempted: 10,
            skipped: 0,
            written: 10,
            read: 10,
            lost: 0
        }]
    );
}
