//! The C memory functions (`memcpy`, `memmove`, `memset`, `memcmp`, `bcmp`): there is
//! no libc in a guest, the compiler emits calls to them, and the writer copies every
//! event's payload with `memcpy` when its length is not a constant.
//!
//! Written with fixed-size moves, `rep movsb/stosb` and plain loops that LLVM will not
//! turn back into calls to themselves.

use core::arch::asm;

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
