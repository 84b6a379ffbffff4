//! The MMIO doorbell on a real vCPU (docs/abi.md, "Doorbell"; issue 38): with
//! `--doorbell mmio` the VMM hands the guest the doorbell page in its entry `rcx` and
//! serves only that page; the stock guest and the C SDK's guest register their events
//! and end through it — every vCPU exit the VMM records (`--host-events`) for the bells
//! is an MMIO exit, none a port write — and the trace is complete (written = read + lost,
//! every event read). A guest that rings by port anyway is a guest crash (exit 3)
//! naming the port doorbell. The hostile MMIO writes (another offset, another vCPU's
//! id) are tests/vm_adversarial.rs's `mmio_*` cases.
//!
//! Skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1. Counts, never durations.

use hyptrace::adversary::example_rust_guest;
use hyptrace::cguest::c_guest;
use hyptrace::env::{self, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");
const VCPUS: u64 = 2;
const EVENTS: u64 = 2000;

/// The doorbell exits `vmm:vcpu_exit` recorded: (MMIO exits, port writes to the
/// register port 0x512, port writes to the exit port 0x510).
fn bell_exits(text: &str) -> (usize, usize, usize) {
    let exits = || text.lines().filter(|l| l.contains(" vcpu_exit: "));
    (
        exits().filter(|l| l.contains(" reason=mmio ")).count(),
        exits().filter(|l| l.ends_with("port=0x512")).count(),
        exits().filter(|l| l.ends_with("port=0x510")).count(),
    )
}

/// The guest (`--guest`, or the embedded one) recorded as text with `--host-events` on
/// `doorbell`: it must succeed with every event of every vCPU read and none lost.
/// Returns the doorbell exits ([`bell_exits`]).
fn record(guest: Option<&str>, doorbell: &str) -> (usize, usize, usize) {
    let _vm = vm_lock();
    let dir = TempDir::new("doorbell");
    let (out, st) = (dir.file("t.txt"), dir.file("stats.json"));
    let (vcpus, events) = (VCPUS.to_string(), EVENTS.to_string());
    let mut args = vec![
        "record",
        "--doorbell",
        doorbell,
        "--host-events",
        "--vcpus",
        &vcpus,
        "--events",
        &events,
        "-o",
        &out,
        "--stats",
        &st,
    ];
    if let Some(g) = guest {
        args.extend(["--guest", g]);
    }
    let o = env::run(BIN, &args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", env::stderr(&o));
    let stats = std::fs::read_to_string(&st).expect("--stats");
    let json: serde_json::Value = serde_json::from_str(&stats).expect("--stats is JSON");
    let cpus = json["cpus"].as_array().expect("cpus");
    assert_eq!(cpus.len() as u64, VCPUS, "{stats}");
    // The VMM's own events (--host-events), the exits counted below: none lost.
    assert_eq!(json["host_events"]["lost"].as_u64(), Some(0), "{stats}");
    for c in cpus {
        let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{k} in {c}"));
        let (written, read, lost) = (u("written"), u("read"), u("lost"));
        assert_eq!(written, read + lost, "{c}");
        assert_eq!((u("attempted"), written, lost), (EVENTS, EVENTS, 0), "{c}");
    }
    bell_exits(&std::fs::read_to_string(&out).expect("the text output"))
}

/// One registration (vCPU 0) and one exit per vCPU: the doorbell's rings.
const RINGS: usize = 1 + VCPUS as usize;

/// The stock guest rings where the VMM says: by MMIO with `--doorbell mmio` (every bell
/// an MMIO exit, no port bell), by port by default (the other way round).
#[test]
fn stock_guest_rings_the_doorbell_it_is_given() {
    if !kvm_available(KRATE, "stock_guest_rings_the_doorbell_it_is_given") {
        return;
    }
    assert_eq!(record(None, "mmio"), (RINGS, 0, 0));
    assert_eq!(record(None, "port"), (0, 1, VCPUS as usize));
}

/// The C SDK's example guest (`ht_attach_doorbell` with its entry `rcx`) registers its
/// event and exits by MMIO, the trace complete.
#[test]
fn c_guest_rings_the_mmio_doorbell() {
    if !kvm_available(KRATE, "c_guest_rings_the_mmio_doorbell") {
        return;
    }
    let elf = c_guest(&env::target_dir(BIN)).unwrap_or_else(|e| panic!("{e}"));
    let elf = elf.to_str().expect("utf-8 path");
    assert_eq!(record(Some(elf), "mmio"), (RINGS, 0, 0));
}

/// A guest that ignores its entry `rcx` (the example Rust guest rings by port) under
/// `--doorbell mmio`: its port ring is a guest crash, exit 3, naming the port doorbell.
#[test]
fn port_ring_under_the_mmio_doorbell_is_a_guest_crash() {
    if !kvm_available(KRATE, "port_ring_under_the_mmio_doorbell_is_a_guest_crash") {
        return;
    }
    let guest = example_rust_guest(&env::target_dir(BIN)).unwrap_or_else(|e| panic!("{e}"));
    let g = guest.to_str().expect("utf-8 path");
    let _vm = vm_lock();
    let o = env::run(
        BIN,
        &["run", "--guest", g, "--doorbell", "mmio", "--events", "10"],
    );
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.lines().any(|l| l.contains("vcpu 0")
            && l.contains("port 0x512")
            && l.contains("serves the MMIO doorbell")),
        "{err}"
    );
}

/// With the largest guest memory (3 GiB, whose last PD sits right before the doorbell's)
/// the MMIO doorbell still rings: the RAM map and the doorbell's map do not collide.
#[test]
fn mmio_doorbell_next_to_the_largest_memory() {
    if !kvm_available(KRATE, "mmio_doorbell_next_to_the_largest_memory") {
        return;
    }
    let _vm = vm_lock();
    let o = env::run(
        BIN,
        &[
            "run",
            "--doorbell",
            "mmio",
            "--mem-mb",
            "3072",
            "--events",
            "100",
        ],
    );
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(err.contains("written 200 = read 200 + lost 0"), "{err}");
}
