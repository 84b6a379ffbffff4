//! Tests of the VMM library API (`hyptrace_host::Vm`): boot, outcomes, trace region,
//! stop. Skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1. Counts, never durations.

use std::time::Duration;

use hyptrace_abi::guest::Workload;
use hyptrace_host::{RunParams, VcpuOutcome, Vm, VmConfig, GUEST_ELF};

/// Whether KVM-backed tests can run (see tests/vm_boot.rs).
fn kvm_available(test: &str) -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        if std::env::var("HYPTRACE_REQUIRE_KVM").is_ok_and(|v| v == "1") {
            panic!("/dev/kvm not available (or not accessible) and HYPTRACE_REQUIRE_KVM=1");
        }
        println!("SKIP: /dev/kvm not available");
    }
    if ok {
        log_vm_test(test);
    }
    ok
}

/// Appends the test's name to `$HYPTRACE_VM_TEST_LOG` (CI checks that VM tests ran).
fn log_vm_test(test: &str) {
    use std::io::Write as _;
    if let Some(path) = std::env::var_os("HYPTRACE_VM_TEST_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{}: {test}", env!("CARGO_CRATE_NAME"));
        }
    }
}

fn vm(vcpus: u32, trace: u64) -> Vm {
    Vm::new(VmConfig {
        vcpus,
        mem_bytes: 32 << 20,
        guest_elf: GUEST_ELF.into(),
        trace_region_bytes: trace,
        trace_region_align: 65536,
    })
    .expect("create VM")
}

#[test]
fn outcomes_and_trace_region() {
    if !kvm_available("outcomes_and_trace_region") {
        return;
    }
    let vm = vm(3, (3 << 20) + 4096);
    assert!(vm.tsc_khz() > 0);
    // The VMM sets the guest TSC offset to 0 where the kernel supports it.
    assert!(
        matches!(vm.tsc_offset(), None | Some(0)),
        "{:?}",
        vm.tsc_offset()
    );
    let l = vm.layout().clone();
    let region = vm.trace_region();
    assert_eq!(region.gpa(), l.trace_gpa);
    assert_eq!(region.gpa() % 65536, 0);
    assert_eq!(region.len(), (3 << 20) + 4096);
    assert!(region.gpa() + region.len() as u64 <= l.mem_bytes);
    assert!(l.stack_top(2) <= region.gpa());
    assert!(l.result_slot(2) + 256 <= l.stacks_gpa);
    assert!(l.image.1 <= l.params_gpa);

    // The host can write the region through its pointer (the reader initialises it so).
    let (gpa, ptr, len) = region.raw_parts();
    assert_eq!(gpa, l.trace_gpa);
    // SAFETY: the region is `len` bytes of live guest memory kept mapped by `region`;
    // no vCPU runs yet, so nothing else accesses it.
    unsafe {
        ptr.write_volatile(0xa5);
        ptr.add(len - 1).write_volatile(0x5a);
    }
    let running = vm
        .start(&RunParams {
            events: 777,
            workload: Workload::Mixed,
            ..Default::default()
        })
        .expect("start");
    while !running.wait_timeout(Duration::from_millis(5)) {}
    assert!(running.is_finished());
    assert!(!running.any_crashed());
    let outcomes = running.wait();
    assert_eq!(outcomes.len(), 3);
    for o in outcomes {
        match o {
            VcpuOutcome::Finished(s) => {
                assert_eq!(s.attempted, 777);
                assert_eq!(s.skipped, 0);
                assert!(s.tsc_end >= s.tsc_start);
            }
            o => panic!("unexpected {o:?}"),
        }
    }
    // The region outlives the VM and kept what the host wrote (the guest does not touch
    // it yet).
    // SAFETY: as above; the VM and its threads are gone.
    unsafe {
        assert_eq!(ptr.read_volatile(), 0xa5);
        assert_eq!(ptr.add(len - 1).read_volatile(), 0x5a);
    }
}

#[test]
fn stop_interrupts_spinning_guests() {
    if !kvm_available("stop_interrupts_spinning_guests") {
        return;
    }
    let running = vm(2, 1 << 20)
        .start(&RunParams {
            events: u64::MAX,
            rate: 0,
            ..Default::default()
        })
        .expect("start");
    assert!(!running.wait_timeout(Duration::from_millis(100)));
    running.stop();
    running.stop(); // idempotent
    let outcomes = running.wait();
    assert_eq!(outcomes, vec![VcpuOutcome::Stopped, VcpuOutcome::Stopped]);
}

#[test]
fn stop_right_after_start() {
    if !kvm_available("stop_right_after_start") {
        return;
    }
    for _ in 0..5 {
        let running = vm(2, 1 << 20)
            .start(&RunParams {
                events: u64::MAX,
                rate: 1,
                ..Default::default()
            })
            .expect("start");
        running.stop();
        for o in running.wait() {
            assert_eq!(o, VcpuOutcome::Stopped);
        }
    }
}

#[test]
fn crash_outcomes() {
    if !kvm_available("crash_outcomes") {
        return;
    }
    let out = vm(1, 1 << 20)
        .start(&RunParams {
            events: 5,
            workload: Workload::Panic,
            ..Default::default()
        })
        .expect("start")
        .wait();
    match &out[..] {
        [VcpuOutcome::Panicked(m)] => assert!(
            m.starts_with("guest workload panic on vcpu 0 after 5 events"),
            "{m}"
        ),
        o => panic!("unexpected {o:?}"),
    }
    let out = vm(1, 1 << 20)
        .start(&RunParams {
            events: 5,
            workload: Workload::Fault,
            ..Default::default()
        })
        .expect("start")
        .wait();
    match &out[..] {
        [VcpuOutcome::Faulted(m)] => assert!(m.contains("KVM_EXIT_SHUTDOWN"), "{m}"),
        o => panic!("unexpected {o:?}"),
    }
}

#[test]
fn dropping_a_running_vm_stops_it() {
    if !kvm_available("dropping_a_running_vm_stops_it") {
        return;
    }
    let running = vm(2, 1 << 20)
        .start(&RunParams {
            events: u64::MAX,
            rate: 0,
            ..Default::default()
        })
        .expect("start");
    drop(running);
}
