//! Freestanding runtime: entry stub, CPU helpers, the C memory functions that
//! `compiler_builtins` expects from libc, and the panic handler.
//!
//! Runs at CPL3 with IOPL=3 (so `in`/`out` work, `hlt` does not), no interrupts, no IDT:
//! any CPU exception triple-faults.

use core::arch::{asm, global_asm};
use core::fmt::{self, Write};
use core::panic::PanicInfo;

use hyptrace_abi::guest::{result, PANIC_MSG_MAX, PORT_PANIC};
// The C memory functions (`memcpy` ...): linked from the guest images' one copy.
use hyptrace_guest_mem as _;

// Entry: rdi = pack GPA, rsi = vCPU id, rdx = RunParams GPA, rsp = top of this vCPU's
// stack (set by the VMM). Align the stack and call `guest_main` (never returns).
global_asm!(
    ".section .text.entry,\"ax\",@progbits",
    ".global _start",
    "_start:",
    "    and rsp, -16",
    "    xor ebp, ebp",
    "    call {main}",
    "2:  pause",
    "    jmp 2b",
    main = sym crate::guest_main,
);

/// Reads the time-stamp counter.
#[inline(always)]
pub fn rdtsc() -> u64 {
    let lo: u32;
    let hi: u32;
    // SAFETY: `rdtsc` only reads the TSC into edx:eax (CR4.TSD is clear, so it is
    // allowed at CPL3); no memory is touched.
    unsafe {
        asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Writes a 32-bit value to an I/O port (an exit to the VMM).
#[inline(always)]
pub fn out32(port: u16, value: u32) {
    // SAFETY: port I/O is allowed at CPL3 with IOPL=3; the VMM handles the exit. No
    // guest memory is touched.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") value, options(nomem, nostack, preserves_flags))
    };
}

/// Stores a byte at `gs:[off]`. The VMM sets every vCPU's GS base to the GPA of its
/// result slot, so the panic handler can reach the slot without any other context.
#[inline(always)]
fn gs_store_u8(off: usize, value: u8) {
    // SAFETY: GS base is this vCPU's result slot (VMM contract) and callers keep `off`
    // inside the slot; the slot is guest memory owned by this vCPU.
    unsafe {
        asm!("mov byte ptr gs:[{off}], {v}", off = in(reg) off, v = in(reg_byte) value, options(nostack, preserves_flags))
    };
}

/// Stores a u64 at `gs:[off]` (see [`gs_store_u8`]).
#[inline(always)]
fn gs_store_u64(off: usize, value: u64) {
    // SAFETY: as in `gs_store_u8`: `off + 8` stays inside this vCPU's result slot.
    unsafe {
        asm!("mov qword ptr gs:[{off}], {v}", off = in(reg) off, v = in(reg) value, options(nostack, preserves_flags))
    };
}

/// Writes the panic message into the result slot, truncated to [`PANIC_MSG_MAX`].
struct SlotMsg {
    len: usize,
}

impl Write for SlotMsg {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for &b in s.as_bytes() {
            if self.len == PANIC_MSG_MAX {
                break;
            }
            gs_store_u8(result::MSG + self.len, b);
            self.len += 1;
        }
        Ok(())
    }
}

#[panic_handler]
fn panic(info: &PanicInfo<'_>) -> ! {
    let mut msg = SlotMsg { len: 0 };
    let _ = write!(msg, "{}", info.message());
    if let Some(loc) = info.location() {
        let _ = write!(msg, " ({}:{})", loc.file(), loc.line());
    }
    gs_store_u64(result::STATUS, 2);
    out32(PORT_PANIC, msg.len as u32);
    // The VMM stops this vCPU at the exit; never resume.
    loop {
        core::hint::spin_loop();
    }
}
