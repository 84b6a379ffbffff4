//! A hyptrace guest in Rust (the template: copy this crate and change `guest_main`).
//!
//! Every vCPU enters at `_start` (from `hyptrace_guest_rt::entry!`) with the VMM's entry
//! registers (docs/abi.md, "Entry"); vCPU 0 registers the guest's events with the host,
//! the others wait for the answer; each attaches its ring-buffer writer, writes
//! `--events` `myguest:step` events and ends its run. The writer publishes what it was
//! given (attempted, skipped) as it goes; the host prints every event with its fields.
#![no_std]
#![no_main]

use hyptrace_abi::guest::RunParamBlock;
use hyptrace_abi::layout::pack;
use hyptrace_abi::RawMem;
use hyptrace_guest_rt::Doorbell;
use hyptrace_writer::events::{register, wait_registered, Event};
use hyptrace_writer::{event, Writer};

hyptrace_guest_rt::entry!(guest_main);

event! {
    /// One step of the guest's work.
    pub struct Step {
        system: "myguest",
        name: "step",
        slot: 0,
        id: 0,
        print: "\"i=%llu cpu=%u\", REC->i, REC->cpu",
        fields: { i: u64, cpu: u32 },
    }
}

/// Entry (from `_start`): `pack` = the trace region's address, `cpu` = this vCPU's id,
/// `params` = the run-parameter block's address, `bell` = where to ring the VMM (0: by
/// port, else its MMIO doorbell page).
#[no_mangle]
pub extern "C" fn guest_main(pack_gpa: u64, cpu: u64, params: u64, bell: u64) -> ! {
    hyptrace_guest_rt::mark_start();
    let bell = Doorbell::from_entry(bell);
    // SAFETY: the VMM placed the run-parameter block at `params` (identity-mapped,
    // aligned) before any vCPU ran; plain integers, valid for any bytes.
    let p = unsafe { (params as usize as *const RunParamBlock).read_volatile() };
    if !p.header_ok() || cpu >= u64::from(p.nr_vcpus) {
        panic!("bad run parameter block");
    }
    let cpu = cpu as u32;
    // SAFETY: the trace region starts with its pack header, which says how long it is.
    let region = unsafe { ((pack_gpa as usize + pack::REGION_SIZE) as *const u64).read_volatile() };
    // SAFETY: the region is `region` bytes at `pack_gpa` for the life of the VM; the host
    // accesses it only through atomics and volatile copies (the writer validates it).
    let mem = unsafe { RawMem::new(pack_gpa as *mut u8, region as usize) };

    let events: [&Event<'static>; 1] = [Step::event()];
    let registered = if cpu == 0 {
        register(&mem, &events, || bell.register())
    } else {
        wait_registered(&mem, &events, 1 << 34)
    };
    if let Err(e) = registered {
        panic!("cannot register the events: {e}");
    }
    let mut w = match Writer::attach(mem, cpu) {
        Ok(w) => w,
        Err(e) => panic!("cannot attach the trace writer: {e}"),
    };
    for i in 0..p.events {
        Step::emit(&mut w, i, cpu);
    }
    w.finish();
    hyptrace_guest_rt::exit_by(bell, cpu)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    hyptrace_guest_rt::report_panic(info)
}
