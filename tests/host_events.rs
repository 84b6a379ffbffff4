//! `--host-events`: the VMM's own events in the same trace, on the same clock, as one
//! more CPU (skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1; the trace-cmd part
//! skipped unless trace-cmd is installed or HYPTRACE_REQUIRE_TRACE_CMD=1). Order and
//! counts, never durations.

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};
use hyptrace::text::{parse_all, Event, Line};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");
const VCPUS: u32 = 2;
const EXITS: u64 = 200;

fn events(text: &str, what: &str) -> (Option<u32>, Vec<Event>) {
    let mut cpus = None;
    let mut evs = Vec::new();
    for l in parse_all(text, what) {
        match l {
            Line::Cpus(n) => cpus = Some(n),
            Line::Event(e) => evs.push(e),
            Line::Drop { .. } => panic!("{what}: unexpected loss"),
            Line::WindowExceeded => panic!("{what}: the merger lost the order across CPUs"),
        }
    }
    (cpus, evs)
}

/// The `align` workload with `--host-events`, as printed (by `run`, `hyptrace report` or
/// `trace-cmd report -t`): times never go backwards; the VMM's events are CPU `VCPUS`,
/// comm `vmm`; for each vCPU, every `PORT_ALIGN` exit the VMM recorded is printed
/// between the guest's markers just before and just after it (`before, exit, after`,
/// `EXITS` times), and its final `PORT_EXIT` exit after its last marker.
fn check_interleaving(evs: &[Event], what: &str) {
    for w in evs.windows(2) {
        assert!(w[0].ts_ns <= w[1].ts_ns, "{what}: time goes back: {w:?}");
    }
    for v in 0..VCPUS {
        // The guest's markers of vCPU v and the VMM's exits of vCPU v, in print order.
        let mut seq: Vec<String> = Vec::new();
        for e in evs {
            if e.cpu == v && e.name == "marker" {
                let s = e.seq().expect("seq");
                seq.push(if s % 2 == 0 { "before" } else { "after" }.into());
            } else if e.cpu == VCPUS && e.name == "vcpu_exit" {
                assert_eq!(e.comm, "vmm", "{what}: {e:?}");
                assert_eq!(e.field("reason"), Some("io"), "{what}: an I/O exit: {e:?}");
                if e.field("vcpu") == Some(&v.to_string()) {
                    let port = e.field("port").map(str::to_string);
                    let hex = |p: u16| Some(format!("{p:#x}"));
                    if port == hex(hyptrace_abi::registry::PORT_REGISTER) {
                        // vCPU 0's one registration exit, before its first event.
                        continue;
                    }
                    seq.push(if port == hex(hyptrace_abi::guest::PORT_ALIGN) {
                        "exit".into()
                    } else if port == hex(hyptrace_abi::guest::PORT_EXIT) {
                        "end".into()
                    } else {
                        panic!("{what}: unexpected port {port:?}")
                    });
                }
            } else {
                assert!(e.cpu <= VCPUS, "{what}: {e:?}");
            }
        }
        let mut want: Vec<String> = Vec::new();
        for _ in 0..EXITS {
            want.extend(["before", "exit", "after"].map(String::from));
        }
        want.push("end".into());
        assert_eq!(
            seq, want,
            "{what}: vCPU {v}: guest and VMM events out of order"
        );
    }
}

fn align_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["--workload", "align", "--vcpus", "2", "--events", "400"];
    v.extend_from_slice(extra);
    v
}

/// `run --host-events`: one text stream interleaves guest and VMM events in time order.
/// Without the flag: only the guest's CPUs and events.
#[test]
fn run_interleaves_guest_and_vmm_events() {
    if !kvm_available(KRATE, "run_interleaves_guest_and_vmm_events") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("host-events-run");
    let stats = dir.file("stats.json");
    let read_stats = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("json")
    };
    let mut args = vec!["run", "--stats", &stats];
    args.extend(align_args(&["--host-events"]));
    let out = env::run(BIN, &args);
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let (_, evs) = events(&env::stdout(&out), "run --host-events");
    check_interleaving(&evs, "run --host-events");
    let s = read_stats();
    let vmm = evs.iter().filter(|e| e.cpu == VCPUS).count() as u64;
    assert_eq!(s["host_events"]["read"], vmm, "{s}");
    assert_eq!(s["host_events"]["lost"], 0, "{s}");
    assert_eq!(s["cpus"].as_array().map(Vec::len), Some(VCPUS as usize));

    let mut args = vec!["run", "--stats", &stats];
    args.extend(align_args(&[]));
    let out = env::run(BIN, &args);
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let (_, evs) = events(&env::stdout(&out), "run");
    assert_eq!(evs.len() as u64, u64::from(VCPUS) * 2 * EXITS);
    assert!(evs.iter().all(|e| e.cpu < VCPUS && e.name == "marker"));
    let s = read_stats();
    assert!(s.get("host_events").is_none(), "{s}");
}

/// `record --host-events` into trace.dat v7 and v6: the real trace-cmd sees one more CPU
/// and prints the same interleaving; `hyptrace report` prints the same lines' times.
/// Without the flag the file has the guest's CPUs only.
#[test]
fn trace_dat_carries_the_vmm_cpu() {
    if !kvm_available(KRATE, "trace_dat_carries_the_vmm_cpu") || !env::trace_cmd_available() {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("host-events");
    for format in ["dat", "dat6"] {
        let path = dir.file(&format!("h.{format}"));
        let mut args = vec!["record", "-o", &path, "--format", format];
        args.extend(align_args(&["--host-events"]));
        let out = env::run(BIN, &args);
        assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
        let tc = env::run("trace-cmd", &["report", "-t", "-i", &path]);
        assert!(tc.status.success(), "{}", env::stderr(&tc));
        let what = format!("trace-cmd {format}");
        let (cpus, theirs) = events(&env::stdout(&tc), &what);
        assert_eq!(cpus, Some(VCPUS + 1), "{what}");
        assert!(!env::stdout(&tc).contains("[UNKNOWN EVENT]"), "{what}");
        check_interleaving(&theirs, &what);
        let ours = env::run(BIN, &["report", "-i", &path]);
        assert!(ours.status.success(), "{}", env::stderr(&ours));
        let (_, ours) = events(&env::stdout(&ours), "hyptrace report");
        let t = |v: &[Event]| v.iter().map(|e| (e.cpu, e.ts_ns)).collect::<Vec<_>>();
        assert_eq!(t(&ours), t(&theirs), "{what}: hyptrace report vs trace-cmd");

        let path = dir.file(&format!("g.{format}"));
        let mut args = vec!["record", "-o", &path, "--format", format];
        args.extend(align_args(&[]));
        let out = env::run(BIN, &args);
        assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
        let tc = env::run("trace-cmd", &["report", "-t", "-i", &path]);
        let (cpus, evs) = events(&env::stdout(&tc), "without --host-events");
        assert_eq!(cpus, Some(VCPUS));
        assert!(evs.iter().all(|e| e.cpu < VCPUS && e.name == "marker"));
    }
}
