//! The `align` workload: guest TSC stamps around a VMM exit the host stamps with its
//! clock, so a test can check that the host-clock conversion puts the host's stamp
//! between the guest's two (see `hyptrace_abi::guest::Workload::Align`).

use core::arch::asm;

use hyptrace_abi::events;
use hyptrace_abi::guest::{result, PING_IDLE_SECONDS, PING_STOP, PORT_ALIGN};

use crate::emit::{Emitter, Sink};
use crate::rt::{out32, rdtsc};

/// `lfence; rdtsc`: the TSC once every earlier instruction (loads included) completed.
fn lfence_rdtsc() -> u64 {
    let lo: u32;
    let hi: u32;
    // SAFETY: `lfence` and `rdtsc` only order execution and read the counter.
    unsafe {
        asm!("lfence", "rdtsc", out("eax") lo, out("edx") hi, options(nostack, preserves_flags))
    };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Reads the u64 at `gs:[off]` (this vCPU's result slot: the VMM contract).
fn gs_load_u64(off: usize) -> u64 {
    let v: u64;
    // SAFETY: GS base is this vCPU's result slot (set by the VMM) and `off + 8` is inside
    // it; a plain load of guest memory this vCPU owns.
    unsafe {
        asm!("mov {v}, qword ptr gs:[{off}]", off = in(reg) off, v = out(reg) v, options(nostack, preserves_flags, readonly))
    };
    v
}

/// `events / 2` exits, each bracketed by two TSC stamps and recorded as two markers;
/// then the ping phase if `RUN_FLAG_ALIGN_PING` is set.
pub fn run<S: Sink>(p: &crate::Params, cpu: u32, em: &mut Emitter<S>) {
    exits(p.events, cpu, em);
    if p.flags & hyptrace_abi::guest::RUN_FLAG_ALIGN_PING != 0 {
        ping(p.tsc_khz);
    }
}

fn exits<S: Sink>(events: u64, cpu: u32, em: &mut Emitter<S>) {
    let pid = events::vcpu_pid(cpu);
    for i in 0..events / 2 {
        let before = rdtsc();
        // The VMM stores its clock at ALIGN_HOST before it resumes this vCPU.
        out32(PORT_ALIGN, cpu);
        let after = rdtsc();
        let host = gs_load_u64(result::ALIGN_HOST);
        for (seq, ts, value) in [(2 * i, before, i), (2 * i + 1, after, host)] {
            let p = events::marker(pid, seq, value);
            em.sink().write(events::MARKER_SLOT, ts, &p);
        }
    }
}

/// Stores a u64 at `gs:[off]` (this vCPU's result slot).
fn gs_store_u64(off: usize, v: u64) {
    // SAFETY: GS base is this vCPU's result slot and `off + 8` is inside it; a plain
    // store to guest memory this vCPU owns (x86 stores are not reordered with older
    // stores: the host sees PING_TSC before PING_ACK).
    unsafe {
        asm!("mov qword ptr gs:[{off}], {v}", off = in(reg) off, v = in(reg) v, options(nostack, preserves_flags))
    };
}

/// The ping phase (`RUN_FLAG_ALIGN_PING`): answers each new request number in
/// `PING_REQ` with the TSC at the moment it saw it (`PING_TSC`, then `PING_ACK`), no
/// exit involved, until `PING_STOP` or `PING_IDLE_SECONDS` without a request.
pub fn ping(tsc_khz: u64) {
    let idle = tsc_khz
        .max(1)
        .saturating_mul(1000)
        .saturating_mul(PING_IDLE_SECONDS);
    let mut last = 0u64;
    let mut since = rdtsc();
    loop {
        let req = gs_load_u64(result::PING_REQ);
        // `rdtsc` may run ahead of the load that saw the request (a cache miss of
        // ~100 ns): `lfence` makes it wait for that load.
        let now = lfence_rdtsc();
        if req == PING_STOP {
            return;
        }
        if req != last && req != 0 {
            gs_store_u64(result::PING_TSC, now);
            gs_store_u64(result::PING_ACK, req);
            last = req;
            since = now;
        } else if now.wrapping_sub(since) > idle {
            return;
        }
        core::hint::spin_loop();
    }
}
