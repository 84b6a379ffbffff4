//! `hyptrace record --format perfetto` of real guest runs (skipped without /dev/kvm
//! unless HYPTRACE_REQUIRE_KVM=1), decoded with Perfetto's official schema
//! (perfetto_trace_pb2 from the `perfetto` PyPI package, through
//! crates/output/tests/perfetto_decode.py; skipped without it unless
//! HYPTRACE_REQUIRE_PERFETTO=1): every packet decodes, one thread track per vCPU under
//! the "hyptrace guest" process, events per vCPU == the run's `read`, lost counts on the track ==
//! the run's `lost` (trailing losses included), slices balanced, fields as args.

use hyptrace::env::{self, kvm_available, perfetto_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

fn decode(path: &str, events: bool) -> serde_json::Value {
    serde_json::from_slice(&env::perfetto_decode(path, events)).expect("decoder JSON")
}

fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// Records `args` into a Perfetto trace and checks it against `--stats`; returns the
/// decoded summary and the stats.
fn record_and_check(
    dir: &TempDir,
    name: &str,
    args: &[&str],
) -> (serde_json::Value, serde_json::Value) {
    let out = dir.file(&format!("{name}.pftrace"));
    let stats = dir.file(&format!("{name}.json"));
    let mut all = vec!["record", "-o", &out, "--stats", &stats];
    all.extend_from_slice(args);
    let o = env::run(BIN, &all);
    assert_eq!(o.status.code(), Some(0), "{all:?}: {}", env::stderr(&o));
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let v = decode(&out, false);
    let cpus = s["cpus"].as_array().unwrap();
    assert_eq!(v["process"]["name"], "hyptrace guest", "{name}");
    assert_eq!(v["clocks"][0][0], 64, "{name}");
    let threads = v["threads"].as_object().unwrap();
    assert_eq!(threads.len(), cpus.len(), "{name}: {v}");
    for c in cpus {
        let cpu = u(&c["cpu"]);
        let uuid = (0x1000 + cpu).to_string();
        let th = &v["threads"][&uuid];
        assert_eq!(th["name"], format!("vcpu{cpu}"), "{name}");
        assert_eq!(u(&th["tid"]), cpu + 1, "{name}");
        let t = &v["tracks"][&uuid];
        let instants: u64 = t["instants"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| !k.starts_with("lost"))
            .map(|(_, n)| u(n))
            .sum();
        let events = instants + u(&t["begins"]);
        assert_eq!(events, u(&c["read"]), "{name}: cpu {cpu}: {t} vs {c}");
        assert_eq!(
            u(&t["lost"]),
            u(&c["lost"]),
            "{name}: cpu {cpu}: {t} vs {c}"
        );
        assert_eq!(u(&t["lost_unknown"]), 0, "{name}: cpu {cpu}");
    }
    (v, s)
}

/// Lossy and lossless runs, both modes, 2 and 3 vCPUs.
#[test]
fn record_perfetto_matches_stats() {
    if !kvm_available(KRATE, "record_perfetto_matches_stats") || !perfetto_available() {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("perfetto");
    for mode in ["overwrite", "stop"] {
        for vcpus in ["2", "3"] {
            let name = format!("{mode}-{vcpus}");
            let (v, s) = record_and_check(
                &dir,
                &name,
                &[
                    "--format",
                    "perfetto",
                    "--vcpus",
                    vcpus,
                    "--mode",
                    mode,
                    "--buffer-kb",
                    "16",
                    "--workload",
                    "mixed",
                    "--events",
                    "6000",
                    "--rate",
                    "0",
                    // Read at the end: losses whatever the scheduling.
                    "--drain",
                    "none",
                ],
            );
            let lost: u64 = s["cpus"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| u(&c["lost"]))
                .sum();
            assert!(lost > 0, "{name}: the run lost nothing: {s}");
            // Spans became slices, markers and texts instants.
            for t in v["tracks"].as_object().unwrap().values() {
                assert!(u(&t["begins"]) > 0, "{name}: {t}");
                assert!(u(&t["instants"]["marker"]) > 0, "{name}: {t}");
                assert!(u(&t["instants"]["text"]) > 0, "{name}: {t}");
            }
        }
    }
    // The default run (steady markers), with every event's args checked.
    let (v, s) = record_and_check(
        &dir,
        "steady",
        &["--format", "perfetto", "--events", "3000"],
    );
    let out = dir.file("steady.pftrace");
    let full = decode(&out, true);
    assert_eq!(full["packets"], v["packets"]);
    let mut per_track: std::collections::BTreeMap<u64, (u64, Option<u64>)> = Default::default();
    for e in full["events"].as_array().unwrap() {
        if e[3].as_str().is_some_and(|n| n.starts_with("lost")) {
            continue;
        }
        assert_eq!(e[3], "marker", "{e}");
        assert_eq!(e[4], serde_json::json!(["guest"]));
        // Markers carry seq (increasing per vCPU: 0, 1, 2... unless events were lost)
        // and value as args.
        let seq = u(&e[5]["seq"]);
        let t = per_track.entry(u(&e[0])).or_default();
        assert!(t.1.is_none_or(|last| seq > last), "{e}");
        *t = (t.0 + 1, Some(seq));
        assert!(e[5]["value"].is_u64(), "{e}");
    }
    let read: u64 = s["cpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| u(&c["read"]))
        .sum();
    assert_eq!(per_track.values().map(|t| t.0).sum::<u64>(), read);
    assert_eq!(per_track.len(), 2);
}

/// The extension picks the format; `--compression` with it is a usage error.
#[test]
fn perfetto_by_extension() {
    if !kvm_available(KRATE, "perfetto_by_extension") || !perfetto_available() {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("perfetto-ext");
    let (v, _) = record_and_check(&dir, "ext", &["--events", "500"]);
    assert!(u(&v["packets"]) >= 1000, "{v}");
    let out = dir.file("x.pftrace");
    let o = env::run(BIN, &["record", "-o", &out, "--compression", "zstd"]);
    env::assert_usage_error(&o, "--compression with perfetto", "--compression zstd");
    assert!(!std::path::Path::new(&out).exists());
}
