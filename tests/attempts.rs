//! Issue 26: every run reports the guest's attempted and skipped events — published by
//! its writer as it goes (invariant R3, docs/design.md "Published attempts") — not only
//! runs whose guest finished: a `--duration` run and crashed guests too (never `?`, never
//! null). VM tests skip without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1. Counts only.

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// Per CPU of `--stats`: (attempted, skipped, written), each a number.
fn counts(json: &serde_json::Value) -> Vec<(u64, u64, u64)> {
    json["cpus"]
        .as_array()
        .expect("cpus")
        .iter()
        .map(|c| {
            let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{k} in {c}"));
            assert!(c["attempts_problem"].is_null(), "{c}");
            (u("attempted"), u("skipped"), u("written"))
        })
        .collect()
}

/// Runs `hyptrace run ARGS --stats F`; returns the exit code, stderr and the JSON.
fn run_with_stats(tag: &str, args: &[&str]) -> (Option<i32>, String, serde_json::Value) {
    let dir = TempDir::new(tag);
    let st = dir.file("stats.json");
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--stats", &st]);
    let o = env::run(BIN, &all);
    let err = env::stderr(&o);
    let text = std::fs::read_to_string(&st).unwrap_or_else(|e| panic!("{st}: {e}: {err}"));
    let json = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (o.status.code(), err, json)
}

/// A `--duration` run with `guest:span` disabled: `--stats` and the summary lines give
/// every CPU's attempted and skipped (the spans), and `attempted − skipped` is `written`
/// or one more (the vCPU stopped between counting an event and writing it).
#[test]
fn a_duration_run_reports_attempted_and_skipped() {
    if !kvm_available(KRATE, "a_duration_run_reports_attempted_and_skipped") {
        return;
    }
    let _vm = vm_lock();
    let (code, err, json) = run_with_stats(
        "attempts-duration",
        &[
            "--vcpus",
            "2",
            "--workload",
            "mixed",
            "--rate",
            "5000",
            "--events",
            "100000000",
            "--duration",
            "1",
            "--disable",
            "guest:span",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(json["end"], "duration", "{json}");
    for (cpu, (attempted, skipped, written)) in counts(&json).into_iter().enumerate() {
        assert!(skipped > 0 && written > 0, "cpu {cpu}: {json}");
        let taken = attempted - skipped;
        assert!(
            taken == written || taken == written + 1,
            "cpu {cpu}: {json}"
        );
        let line = format!("cpu {cpu}: attempted {attempted} skipped {skipped} written {written}");
        assert!(err.contains(&line), "{line} not in {err}");
    }
    assert!(!err.contains("attempted ?"), "{err}");
}

/// Crashed guests (a panic, with the markers disabled: every event skipped; a triple
/// fault): exit 3, and each CPU's attempted and skipped are what the workload did
/// before it crashed (16 markers each).
#[test]
fn crashed_guests_report_attempted_and_skipped() {
    if !kvm_available(KRATE, "crashed_guests_report_attempted_and_skipped") {
        return;
    }
    let _vm = vm_lock();
    for (workload, disable) in [("panic", Some("guest:marker")), ("fault", None)] {
        let mut args = vec!["--vcpus", "2", "--workload", workload, "--events", "1000"];
        if let Some(d) = disable {
            args.extend_from_slice(&["--disable", d]);
        }
        let (code, err, json) = run_with_stats(&format!("attempts-{workload}"), &args);
        assert_eq!(code, Some(3), "{workload}: {err}");
        assert_eq!(json["end"], "guest_crashed", "{workload}: {json}");
        for (cpu, c) in counts(&json).into_iter().enumerate() {
            // The workloads write 16 markers before they crash (EVENTS_BEFORE_CRASH);
            // the other vCPU may be stopped by the crash before its own 16.
            let (attempted, skipped, written) = c;
            assert!(attempted <= 16, "{workload} cpu {cpu}: {json}");
            if disable.is_some() {
                assert_eq!(written, 0, "{workload} cpu {cpu}: {json}");
            } else {
                assert_eq!(skipped, 0, "{workload} cpu {cpu}: {json}");
            }
            let taken = attempted - skipped;
            assert!(
                taken == written || taken == written + 1,
                "{workload} cpu {cpu}: {json}"
            );
        }
        // The vCPU that crashed first did its 16 events: attempted (and, markers
        // disabled, skipped) although no vCPU finished.
        let c = counts(&json);
        let most = if disable.is_some() {
            c.iter().map(|c| c.1).max()
        } else {
            c.iter().map(|c| c.0).max()
        };
        assert_eq!(most, Some(16), "{workload}: {json}");
        assert!(!err.contains("attempted ?"), "{err}");
    }
}
