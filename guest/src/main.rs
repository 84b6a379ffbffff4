//! hyptrace guest payload: runs one workload per vCPU at CPL3 and reports through its
//! result slot and the exit ports (see `hyptrace_abi::guest`).
//!
//! VMM contract beyond `hyptrace_abi::guest`: every vCPU's GS base is the GPA of its
//! result slot (used by the panic handler, which has no other context).
#![no_std]
#![no_main]

mod align;
mod block;
mod builtin;
mod emit;
mod rt;
mod workload;

use hyptrace_abi::guest::{result, Workload, VCPU_RESULT_SIZE};

use block::Block;
use emit::{Emitter, WriterSink};
use hyptrace_abi::guest::RUN_FLAG_SERVE_MAILBOX;
use hyptrace_abi::layout::pack as pack_hdr;
use hyptrace_abi::RawMem;
use hyptrace_guest_rt::Doorbell;
use hyptrace_writer::Writer;
use rt::rdtsc;

/// The run parameters the workloads use.
pub struct Params {
    /// Workload number (checked).
    pub workload: Workload,
    /// Events to attempt.
    pub events: u64,
    /// Events per second, 0 = as fast as possible.
    pub rate: u64,
    /// TSC frequency in kHz (0 = unknown: no pacing).
    pub tsc_khz: u64,
    /// Seed of the pseudo-random choices.
    pub seed: u64,
    /// `RUN_FLAG_*`.
    pub flags: u32,
    /// Events per burst (`burst` workload).
    pub burst: u32,
    /// Payload bytes of each event (`bench` workload).
    pub payload: u32,
}

/// Entry from `_start`: rdi = pack GPA, rsi = vCPU id, rdx = RunParams GPA, rcx = the
/// MMIO doorbell page or 0 (ring by port).
#[no_mangle]
pub extern "C" fn guest_main(pack: u64, cpu: u64, params_gpa: u64, bell: u64) -> ! {
    let bell = Doorbell::from_entry(bell);
    let tsc_start = rdtsc();
    let p = Block(params_gpa).read_params();
    if !p.header_ok() {
        panic!("bad run parameter block");
    }
    let nr = u64::from(p.nr_vcpus);
    if cpu >= nr {
        panic!("vcpu id {cpu} out of range (nr_vcpus {nr})");
    }
    let Some(workload) = Workload::from_u32(p.workload) else {
        panic!("unknown workload {}", p.workload);
    };
    let slot = Block(params_gpa + p.results_off + cpu * VCPU_RESULT_SIZE as u64);
    slot.write_u64(result::TSC_START, tsc_start);
    let params = Params {
        workload,
        events: p.events,
        rate: p.rate,
        tsc_khz: p.tsc_khz,
        seed: p.seed,
        flags: p.flags,
        burst: p.burst,
        payload: p.payload,
    };

    let cpu = cpu as u32;
    // The trace region: its size is in the pack the host wrote (the writer validates
    // the whole pack against it).
    let region = Block(pack).read_u64(pack_hdr::REGION_SIZE) as usize;
    // SAFETY: the host placed the trace region at `pack`, identity-mapped, page-aligned,
    // `region` bytes long (its own pack says so), for the life of the VM; the host
    // accesses it only through atomics and volatile copies.
    let mem = unsafe { RawMem::new(pack as *mut u8, region) };
    // Attach first: it walks this vCPU's ring, whose first touch costs this guest
    // about a millisecond here (every page faulted in), and that is no part of its
    // --rate schedule. Then register, before the first event: the host sets the enable
    // bits of the registered events while it answers, and holds the answer until it
    // reads (the schedule starts after it).
    let writer = match Writer::attach(mem, cpu) {
        Ok(w) => w,
        Err(e) => panic!("cannot attach the trace writer: {e}"),
    };
    builtin::register_builtins(writer.mem(), cpu, bell);
    let serve = params.flags & RUN_FLAG_SERVE_MAILBOX != 0;
    let mut em = Emitter::new(WriterSink::new(writer, serve), cpu);
    // The --rate schedule starts now, once the registration is answered (the run holds
    // the answer until it reads): the wait for it is not lateness to catch up on.
    let bench = workload::run(&params, cpu, rdtsc(), &mut em);
    let w = em.sink().writer();
    w.finish();
    let served = w.mailbox_served();

    slot.write_u64(result::TSC_END, rdtsc());
    slot.write_u64(result::MAILBOX_SERVED, served);
    if let Some(b) = bench {
        slot.write_u64(result::BENCH_CYCLES, b.cycles);
        slot.write_u64(result::BENCH_MIN_CHUNK, b.min_chunk);
    }
    slot.write_u64(result::STATUS, 1);
    bell.exit(cpu);
    loop {
        core::hint::spin_loop();
    }
}
