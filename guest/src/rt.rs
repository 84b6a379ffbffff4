//! Freestanding runtime: the entry stub and the panic handler; the CPU helpers, the C
//! memory functions that `compiler_builtins` expects from libc and the panic report are
//! the guest images' shared runtime (`hyptrace-guest-rt`, guest/rt).
//!
//! Runs at CPL3 with IOPL=3 (so `in`/`out` work, `hlt` does not), no interrupts, no IDT:
//! any CPU exception triple-faults.

use core::panic::PanicInfo;

// Entry: rdi = pack GPA, rsi = vCPU id, rdx = RunParams GPA, rsp = top of this vCPU's
// stack (set by the VMM). Align the stack and call `guest_main` (never returns).
hyptrace_guest_rt::entry!(crate::guest_main);

pub use hyptrace_guest_rt::{out32, rdtsc};

#[panic_handler]
fn panic(info: &PanicInfo<'_>) -> ! {
    hyptrace_guest_rt::report_panic(info)
}
