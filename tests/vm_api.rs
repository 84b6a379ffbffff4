//! Tests of the VMM library API (`hyptrace_host::Vm`): boot, outcomes, trace region,
//! stop. Skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1. Counts, never durations.

use std::time::Duration;

use hyptrace_abi::guest::Workload;
use hyptrace_host::{RunParams, VcpuOutcome, Vm, VmConfig, GUEST_ELF};

/// Whether KVM-backed tests can run (prints `SKIP` or fails under
/// `HYPTRACE_REQUIRE_KVM=1`; logs the test for CI): see `tests/support/env.rs`.
fn kvm_available(test: &str) -> bool {
    hyptrace::env::kvm_available("vm_api", test)
}

/// A VM whose trace region holds `pages` ring pages per vCPU, initialised by the
/// ring-buffer reader (the guest writer attaches to it at start).
fn vm(vcpus: u32, pages: u32) -> Vm {
    vm_with_reader(vcpus, pages).0
}

fn vm_with_reader(vcpus: u32, pages: u32) -> (Vm, hyptrace_host::vmm::guest_mem::Reader) {
    let layout =
        hyptrace_abi::RingGeometry::new(vcpus, pages, 4096, hyptrace_abi::Mode::Overwrite, false)
            .expect("layout");
    let vm = Vm::new(VmConfig {
        vcpus,
        mem_bytes: 32 << 20,
        guest_elf: GUEST_ELF.into(),
        trace_region_bytes: layout.region_size as u64,
        trace_region_align: 65536,
        doorbell: hyptrace_host::DoorbellKind::Port,
    })
    .expect("create VM");
    let reader = hyptrace_host::vmm::guest_mem::alloc_reader(
        vm.trace_region(),
        layout,
        vm.tsc_khz(),
        1,
        hyptrace_host::drain::session::MAILBOX_TIMEOUT,
    )
    .expect("trace buffers");
    (vm, reader)
}

#[test]
fn outcomes_and_trace_region() {
    if !kvm_available("outcomes_and_trace_region") {
        return;
    }
    let (vm, mut reader) = vm_with_reader(3, 768);
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
    assert_eq!(region.len(), reader.layout().region_size);
    assert!(region.gpa() + region.len() as u64 <= l.mem_bytes);
    assert!(l.stack_top(2) <= region.gpa());
    assert!(l.result_slot(2) + 256 <= l.stacks_gpa);
    assert!(l.image.1 <= l.params_gpa);
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
                assert!(s.tsc_end >= s.tsc_start);
            }
            o => panic!("unexpected {o:?}"),
        }
    }
    // The region outlives the VM: the writers' counters are still readable there.
    use hyptrace_abi::layout::ctl;
    use hyptrace_abi::SharedMem;
    for cpu in 0..3 {
        let entries = reader.mem().load(
            reader.layout().ctl(cpu) + ctl::ENTRIES,
            std::sync::atomic::Ordering::Acquire,
        );
        assert_eq!(entries, 777, "cpu {cpu}");
        // The attempts its writer published (R3).
        let a = reader.attempts(cpu).expect("cpu");
        assert_eq!(
            (a.attempted, a.skipped, a.problem),
            (777, 0, None),
            "cpu {cpu}"
        );
    }
}

#[test]
fn stop_interrupts_spinning_guests() {
    if !kvm_available("stop_interrupts_spinning_guests") {
        return;
    }
    let running = vm(2, 64)
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
        let running = vm(2, 64)
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
    let out = vm(1, 64)
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
    let out = vm(1, 64)
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
    let running = vm(2, 64)
        .start(&RunParams {
            events: u64::MAX,
            rate: 0,
            ..Default::default()
        })
        .expect("start");
    drop(running);
}
