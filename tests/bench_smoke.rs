//! Smoke test of `hyptrace bench`: `--quick --json F` boots the guest (skipped without
//! /dev/kvm unless HYPTRACE_REQUIRE_KVM=1), exits 0 and writes JSON with every section.
//! Checks keys and shapes only — never a duration or a rate.

use std::path::PathBuf;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");

/// Whether KVM-backed tests can run (prints `SKIP` or fails under
/// `HYPTRACE_REQUIRE_KVM=1`; logs the test for CI): see `tests/support/env.rs`.
fn kvm_available(test: &str) -> bool {
    hyptrace::env::kvm_available("bench_smoke", test)
}

fn temp_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("hyptrace-test-{}-{tag}", std::process::id()))
}

fn is_number(v: &serde_json::Value) -> bool {
    v.as_f64().is_some_and(f64::is_finite)
}

/// A `{median, min, max, spread, samples}` summary of numbers.
fn assert_summary(v: &serde_json::Value, what: &str) {
    for k in ["median", "min", "max", "spread"] {
        assert!(is_number(&v[k]), "{what}.{k} not a number: {v}");
    }
    assert!(v["samples"].is_array(), "{what}.samples: {v}");
}

#[test]
fn bench_quick_writes_json() {
    if !kvm_available("bench_quick_writes_json") {
        return;
    }
    let json = temp_path("bench.json");
    let out = Command::new(BIN)
        .args(["bench", "--quick", "--json"])
        .arg(&json)
        .output()
        .expect("run hyptrace bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    let text = std::fs::read_to_string(&json)
        .unwrap_or_else(|e| panic!("no JSON written ({e}); stderr: {stderr}"));
    let _ = std::fs::remove_file(&json);
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");

    for k in [
        "version",
        "quick",
        "machine",
        "config",
        "startup",
        "writer",
        "swap",
        "drain",
        "max_rate",
        "sinks",
        "sustained",
        "criterion",
    ] {
        assert!(v.get(k).is_some(), "missing key {k}: {v}");
    }
    assert_eq!(v["quick"], true);
    for k in ["cpu", "kernel", "kvm", "tsc_khz"] {
        assert!(v["machine"].get(k).is_some(), "machine.{k}: {v}");
    }
    for k in [
        "first_event_ms",
        "vm_create_ms",
        "start_to_first_instruction_ms",
    ] {
        assert_summary(&v["startup"][k], k);
    }
    let writer = v["writer"].as_array().expect("writer rows");
    assert!(!writer.is_empty(), "no writer rows");
    for r in writer {
        for k in ["vcpus", "payload", "guest_rate_vs_native", "guest_vs_bound"] {
            assert!(is_number(&r[k]), "writer.{k}: {r}");
        }
        for k in [
            "guest_ns",
            "guest_mean_ns",
            "guest_unread_ns",
            "guest_unread_mean_ns",
            "native_ns",
            "native_mean_ns",
            "bound_ns",
            "rdtsc_ns",
        ] {
            assert_summary(&r[k], k);
        }
        // The typed loops run for the payload sizes that have one (16: --quick's).
        let t = &r["typed"];
        if r["payload"] == 16 {
            for k in [
                "guest_ns",
                "guest_mean_ns",
                "native_ns",
                "native_mean_ns",
                "bound_ns",
                "bound_mean_ns",
            ] {
                assert_summary(&t[k], k);
            }
            for k in ["guest_vs_bound", "native_vs_bound"] {
                assert!(is_number(&t[k]), "writer.typed.{k}: {r}");
            }
        }
    }
    for mode in ["host", "guest"] {
        let s = &v["swap"][mode];
        for k in [
            "swapped",
            "median_ns",
            "p10_ns",
            "p90_ns",
            "p99_ns",
            "pending",
        ] {
            assert!(is_number(&s[k]), "swap.{mode}.{k}: {s}");
        }
    }
    for k in ["reader_to_file", "reader_only", "vm_record_raw"] {
        assert_summary(&v["drain"][k]["mb_per_s"], k);
        assert_summary(&v["drain"][k]["pages_per_s"], k);
    }
    let rates = v["max_rate"].as_array().expect("max_rate rows");
    assert!(!rates.is_empty());
    for r in rates {
        assert!(
            is_number(&r["vcpus"]) && is_number(&r["max_rate_zero_loss"]),
            "{r}"
        );
        assert!(r["runs"].as_array().is_some_and(|a| !a.is_empty()), "{r}");
    }
    // One row per sink (the reader alone first), each with its throughput.
    let sinks = v["sinks"]["rows"].as_array().expect("sinks rows");
    let names: Vec<&str> = sinks.iter().filter_map(|r| r["sink"].as_str()).collect();
    assert_eq!(
        names,
        [
            "none (reader alone)",
            "raw",
            "trace.dat none",
            "trace.dat zstd",
            "dat6",
            "perfetto",
            "json",
            "text"
        ]
    );
    for r in sinks {
        assert_summary(&r["mb_per_s"], "sinks");
        assert!(
            is_number(&r["vs_null"]) && is_number(&r["file_bytes"]),
            "{r}"
        );
    }
    // The flat-out runs, then three sinks at two fractions, a loss per run each.
    let st = &v["sustained"];
    assert!(
        is_number(&st["flat_out"]) && is_number(&st["events"]),
        "{st}"
    );
    let rows = st["rows"].as_array().expect("sustained rows");
    assert_eq!(rows.len(), 6, "{st}");
    for r in rows {
        assert!(r["lost"].as_array().is_some_and(|a| !a.is_empty()), "{r}");
        assert!(r["lossless"].is_boolean() && is_number(&r["rate"]), "{r}");
    }
}
