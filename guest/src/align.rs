//! The `align` workload: guest TSC stamps around a VMM exit the host stamps with its
//! clock, so a test can check that the host-clock conversion puts the host's stamp
//! between the guest's two (see `hyptrace_abi::guest::Workload::Align`).

use core::arch::asm;

use hyptrace_abi::events;
use hyptrace_abi::guest::{result, PORT_ALIGN};

use crate::emit::{Emitter, Sink};
use crate::rt::{out32, rdtsc};

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

/// `events / 2` exits, each bracketed by two TSC stamps and recorded as two markers.
pub fn run<S: Sink>(events: u64, cpu: u32, em: &mut Emitter<S>) {
    let pid = events::vcpu_pid(cpu);
    for i in 0..events / 2 {
        let before = rdtsc();
        // The VMM stores its clock at ALIGN_HOST before it resumes this vCPU.
        out32(PORT_ALIGN, cpu);
        let after = rdtsc();
        let host = gs_load_u64(result::ALIGN_HOST);
        for (seq, ts, value) in [(2 * i, before, i), (2 * i + 1, after, host)] {
            let p = events::marker(pid, seq, value);
            em.attempted += 1;
            if !em.sink().write(events::MARKER_SLOT, ts, &p) {
                em.skipped += 1;
            }
        }
    }
}
