//! Freestanding runtime: entry stub, CPU helpers, the C memory functions that
//! `compiler_builtins` expects from libc, and the panic handler.
//!
//! Runs at CPL3 with IOPL=3 (so `in`/`out` work, `hlt` does not), no interrupts, no IDT:
//! any CPU exception triple-faults.

use core::arch::{asm, global_asm};
use core::fmt::{self, Write};
use core::panic::PanicInfo;

use hyptrace_abi::guest::{result, PANIC_MSG_MAX, PORT_PANIC};

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

// The C memory functions. Written with `rep movsb/stosb` and plain loops that LLVM will
// not turn back into calls to themselves.

/// Copies `n` bytes, `N <= n <= 2 * N`, as two possibly overlapping unaligned `T`
/// moves (the first and the last `N` bytes): no loop, no call.
///
/// # Safety
/// `dst` and `src` valid for `n` bytes, not overlapping, and `N <= n <= 2 * N` where
/// `N = size_of::<T>()`.
#[inline(always)]
unsafe fn copy_two<T: Copy>(dst: *mut u8, src: *const u8, n: usize) {
    let k = core::mem::size_of::<T>();
    // SAFETY: `[0, k)` and `[n - k, n)` lie inside both ranges since k <= n; unaligned
    // accesses are allowed; both loads happen before the stores (no overlap anyway).
    unsafe {
        let a = src.cast::<T>().read_unaligned();
        let b = src.add(n - k).cast::<T>().read_unaligned();
        dst.cast::<T>().write_unaligned(a);
        dst.add(n - k).cast::<T>().write_unaligned(b);
    }
}

/// # Safety
/// `dst` and `src` valid for `n` bytes, not overlapping.
#[no_mangle]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // Copies up to 256 bytes (event payloads) as two overlapping moves: `rep movsb` has
    // a start-up cost of tens of cycles, more than an event's whole write.
    // SAFETY: (all arms) the caller guarantees both ranges for `n` bytes, and each arm
    // meets `copy_two`'s size condition.
    unsafe {
        match n {
            0 => return dst,
            1 => {
                dst.write(src.read());
                return dst;
            }
            2..=3 => {
                copy_two::<u16>(dst, src, n);
                return dst;
            }
            4..=7 => {
                copy_two::<u32>(dst, src, n);
                return dst;
            }
            8..=16 => {
                copy_two::<u64>(dst, src, n);
                return dst;
            }
            17..=32 => {
                copy_two::<u128>(dst, src, n);
                return dst;
            }
            33..=64 => {
                copy_two::<[u128; 2]>(dst, src, n);
                return dst;
            }
            65..=128 => {
                copy_two::<[u128; 4]>(dst, src, n);
                return dst;
            }
            129..=256 => {
                copy_two::<[u128; 8]>(dst, src, n);
                return dst;
            }
            _ => {}
        }
    }
    // SAFETY: the caller guarantees both ranges; `rep movsb` copies exactly `n` bytes
    // forwards (DF is clear per the ABI).
    unsafe {
        asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _, inout("rsi") src => _,
             options(nostack, preserves_flags));
    }
    dst
}

/// # Safety
/// `dst` and `src` valid for `n` bytes; they may overlap.
#[no_mangle]
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize).wrapping_sub(src as usize) >= n {
        // dst is below src or the ranges do not overlap: a forward copy is safe.
        // SAFETY: forwarded caller guarantees.
        return unsafe { memcpy(dst, src, n) };
    }
    // SAFETY: dst > src with overlap: copy backwards from the last byte, then restore DF.
    unsafe {
        asm!("std", "rep movsb", "cld",
             inout("rcx") n => _, inout("rdi") dst.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
             options(nostack));
    }
    dst
}

/// # Safety
/// `dst` valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller guarantees the range; `rep stosb` stores `n` bytes forwards.
    unsafe {
        asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _, in("al") c as u8,
             options(nostack, preserves_flags));
    }
    dst
}

/// # Safety
/// `a` and `b` valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: i < n and the caller guarantees both ranges; volatile keeps LLVM from
        // recognising the loop as a call to memcmp/bcmp.
        let (x, y) = unsafe { (a.add(i).read_volatile(), b.add(i).read_volatile()) };
        if x != y {
            return i32::from(x) - i32::from(y);
        }
        i += 1;
    }
    0
}

/// # Safety
/// `a` and `b` valid for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: forwarded caller guarantees.
    unsafe { memcmp(a, b, n) }
}
