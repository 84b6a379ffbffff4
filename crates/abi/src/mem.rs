//! The memory-access trait through which the writer and the reader touch the shared
//! trace region, and its implementations.
//!
//! Offsets are bytes from the start of the region. A word offset is 8-byte aligned and
//! `off + 8 <= size()`; a byte range lies inside the region. The writer and the reader
//! check every offset they derive from shared data *before* calling these methods;
//! implementations still check and panic on a violation (a bug in this crate, never a
//! consequence of hostile data), so no call can touch memory outside the region.
//!
//! Every offset is used either atomically (the `load`..`fetch_*` methods) or as plain
//! data (`read_bytes` / `write_bytes`), never both: the loom model relies on it.

use core::sync::atomic::{AtomicU64, Ordering};

/// Access to a shared region of memory: atomic 64-bit words and plain byte ranges.
///
/// ```
/// use core::sync::atomic::Ordering::{Acquire, Release};
/// use hyptrace_abi::{RawMem, SharedMem};
/// let mut words = [0u64; 8];
/// // SAFETY: 8-aligned, 64 bytes valid while `words` lives; only this RawMem accesses it.
/// let mem = unsafe { RawMem::new(words.as_mut_ptr().cast(), 64) };
/// mem.store(8, 42, Release);
/// assert_eq!(mem.fetch_add(8, 1, Release), 42);
/// assert_eq!(mem.load(8, Acquire), 43);
/// mem.write_bytes(16, b"hello");
/// let mut b = [0u8; 5];
/// mem.read_bytes(16, &mut b);
/// assert_eq!((&b, mem.size()), (b"hello", 64));
/// ```
pub trait SharedMem {
    /// Size of the region in bytes.
    fn size(&self) -> usize;
    /// Atomic load of the word at `off`.
    fn load(&self, off: usize, order: Ordering) -> u64;
    /// Atomic store to the word at `off`.
    fn store(&self, off: usize, val: u64, order: Ordering);
    /// Atomic swap of the word at `off`.
    fn swap(&self, off: usize, val: u64, order: Ordering) -> u64;
    /// Atomic compare-and-exchange of the word at `off`.
    fn compare_exchange(
        &self,
        off: usize,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64>;
    /// Atomic OR into the word at `off`, returning the previous value.
    fn fetch_or(&self, off: usize, val: u64, order: Ordering) -> u64;
    /// Atomic AND into the word at `off`, returning the previous value.
    fn fetch_and(&self, off: usize, val: u64, order: Ordering) -> u64;
    /// Atomic add to the word at `off`, returning the previous value.
    fn fetch_add(&self, off: usize, val: u64, order: Ordering) -> u64;
    /// Copies `src` into the region at `off` (plain data).
    fn write_bytes(&self, off: usize, src: &[u8]);
    /// Copies bytes of the region at `off` into `dst` (plain data).
    fn read_bytes(&self, off: usize, dst: &mut [u8]);

    /// [`SharedMem::load`] for a caller that validated `off` once, ahead (the writer: at
    /// attach, docs/design.md "Writer at the bound"); implementations may skip the check
    /// ([`RawMem`] does). The default checks anyway.
    ///
    /// # Safety
    /// `off` is 8-aligned and `off + 8 <= self.size()` (`size()` never changes).
    #[inline(always)]
    unsafe fn load_unchecked(&self, off: usize, order: Ordering) -> u64 {
        self.load(off, order)
    }
    /// [`SharedMem::store`] without the check; see [`SharedMem::load_unchecked`].
    ///
    /// # Safety
    /// `off` is 8-aligned and `off + 8 <= self.size()`.
    #[inline(always)]
    unsafe fn store_unchecked(&self, off: usize, val: u64, order: Ordering) {
        self.store(off, val, order)
    }
    /// [`SharedMem::write_bytes`] without the check; see [`SharedMem::load_unchecked`].
    ///
    /// # Safety
    /// `off + src.len() <= self.size()` (no overflow), and the bytes are plain data
    /// (never accessed as atomic words).
    #[inline(always)]
    unsafe fn write_bytes_unchecked(&self, off: usize, src: &[u8]) {
        self.write_bytes(off, src)
    }
}

/// Implements the atomic-word methods of [`SharedMem`] (`load` … `fetch_add`) by calling
/// the same method on the atomic word that `$this.$word(off)` returns (a
/// `core::sync::atomic::AtomicU64`, or loom's, which has the same methods). Used inside an
/// `impl SharedMem for ...` block, next to `size` and the byte copies.
#[macro_export]
macro_rules! atomic_word_ops {
    ($this:ident, $word:ident) => {
        #[inline(always)]
        fn load(&$this, off: usize, order: core::sync::atomic::Ordering) -> u64 {
            $this.$word(off).load(order)
        }
        #[inline(always)]
        fn store(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) {
            $this.$word(off).store(val, order)
        }
        #[inline(always)]
        fn swap(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) -> u64 {
            $this.$word(off).swap(val, order)
        }
        #[inline(always)]
        fn compare_exchange(
            &$this,
            off: usize,
            current: u64,
            new: u64,
            success: core::sync::atomic::Ordering,
            failure: core::sync::atomic::Ordering,
        ) -> Result<u64, u64> {
            $this.$word(off).compare_exchange(current, new, success, failure)
        }
        #[inline(always)]
        fn fetch_or(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) -> u64 {
            $this.$word(off).fetch_or(val, order)
        }
        #[inline(always)]
        fn fetch_and(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) -> u64 {
            $this.$word(off).fetch_and(val, order)
        }
        #[inline(always)]
        fn fetch_add(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) -> u64 {
            $this.$word(off).fetch_add(val, order)
        }
    };
}

/// Implements every [`SharedMem`] method by forwarding it to `$via`, an expression on
/// `$this` (the method's `self`) that yields something implementing `SharedMem`: for
/// references, smart pointers and wrappers. Used inside an `impl SharedMem for ...` block.
#[macro_export]
macro_rules! forward_shared_mem {
    ($this:ident => $via:expr) => {
        #[inline(always)]
        fn size(&$this) -> usize {
            $via.size()
        }
        #[inline(always)]
        fn load(&$this, off: usize, order: core::sync::atomic::Ordering) -> u64 {
            $via.load(off, order)
        }
        #[inline(always)]
        fn store(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) {
            $via.store(off, val, order)
        }
        #[inline(always)]
        fn swap(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) -> u64 {
            $via.swap(off, val, order)
        }
        #[inline(always)]
        fn compare_exchange(
            &$this,
            off: usize,
            current: u64,
            new: u64,
            success: core::sync::atomic::Ordering,
            failure: core::sync::atomic::Ordering,
        ) -> Result<u64, u64> {
            $via.compare_exchange(off, current, new, success, failure)
        }
        #[inline(always)]
        fn fetch_or(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) -> u64 {
            $via.fetch_or(off, val, order)
        }
        #[inline(always)]
        fn fetch_and(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) -> u64 {
            $via.fetch_and(off, val, order)
        }
        #[inline(always)]
        fn fetch_add(&$this, off: usize, val: u64, order: core::sync::atomic::Ordering) -> u64 {
            $via.fetch_add(off, val, order)
        }
        #[inline(always)]
        fn write_bytes(&$this, off: usize, src: &[u8]) {
            $via.write_bytes(off, src)
        }
        #[inline(always)]
        fn read_bytes(&$this, off: usize, dst: &mut [u8]) {
            $via.read_bytes(off, dst)
        }
        #[inline(always)]
        unsafe fn load_unchecked(&$this, off: usize, order: core::sync::atomic::Ordering) -> u64 {
            // SAFETY: the caller's contract, passed on unchanged (same region, same size).
            unsafe { $via.load_unchecked(off, order) }
        }
        #[inline(always)]
        unsafe fn store_unchecked(
            &$this,
            off: usize,
            val: u64,
            order: core::sync::atomic::Ordering,
        ) {
            // SAFETY: the caller's contract, passed on unchanged (same region, same size).
            unsafe { $via.store_unchecked(off, val, order) }
        }
        #[inline(always)]
        unsafe fn write_bytes_unchecked(&$this, off: usize, src: &[u8]) {
            // SAFETY: the caller's contract, passed on unchanged (same region, same size).
            unsafe { $via.write_bytes_unchecked(off, src) }
        }
    };
}

impl<T: SharedMem + ?Sized> SharedMem for &T {
    crate::forward_shared_mem!(self => (**self));
}

/// Panics unless `[off, off + len)` lies inside a region of `size` bytes.
#[inline(always)]
#[track_caller]
fn check_range(off: usize, len: usize, size: usize) {
    match off.checked_add(len) {
        Some(end) if end <= size => {}
        _ => out_of_range(off, len, size),
    }
}

#[inline(always)]
#[track_caller]
fn check_word(off: usize, size: usize) {
    if !off.is_multiple_of(8) || off >= size || size - off < 8 {
        out_of_range(off, 8, size)
    }
}

#[cold]
#[inline(never)]
#[track_caller]
fn out_of_range(off: usize, len: usize, size: usize) -> ! {
    panic!("shared-memory access [{off:#x}+{len}] outside a region of {size:#x} bytes (unchecked offset)")
}

/// A region of raw memory: guest memory mapped into the VMM, the guest's own view of
/// its trace region, or a heap allocation. Word accesses are atomic; byte reads are
/// volatile, because the other side may be writing the same bytes (hostile input).
#[derive(Debug)]
pub struct RawMem {
    base: *mut u8,
    size: usize,
}

// SAFETY: RawMem only hands out atomic word accesses and volatile/plain byte copies into
// memory that `RawMem::new`'s caller guaranteed to stay valid; sharing it between
// threads is the point (writer and reader on different CPUs).
unsafe impl Send for RawMem {}
// SAFETY: see `Send`: all accesses through `&RawMem` are atomic or byte copies.
unsafe impl Sync for RawMem {}

impl RawMem {
    /// Wraps `size` bytes at `base`.
    ///
    /// # Safety
    /// `base` must be 8-byte aligned and valid for reads and writes of `size` bytes for
    /// the lifetime of the returned value (and of every copy of the pointer it hands
    /// out), and the memory must only be accessed by others through atomics or byte
    /// copies (as another `RawMem`, another domain such as a guest, or a device).
    pub const unsafe fn new(base: *mut u8, size: usize) -> Self {
        Self { base, size }
    }

    /// The base pointer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.base
    }

    #[inline(always)]
    fn word(&self, off: usize) -> &AtomicU64 {
        check_word(off, self.size);
        // SAFETY: `off` is 8-aligned and inside the region (checked above); the base is
        // 8-aligned and valid for the region's lifetime (`new`'s contract); all other
        // accesses to this word are atomic (module contract).
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast::<u64>()) }
    }
}

impl SharedMem for RawMem {
    #[inline(always)]
    fn size(&self) -> usize {
        self.size
    }
    crate::atomic_word_ops!(self, word);
    #[inline(always)]
    fn write_bytes(&self, off: usize, src: &[u8]) {
        check_range(off, src.len(), self.size);
        // SAFETY: the destination range is inside the region (checked), which is valid
        // for writes (`new`'s contract); `src` is a distinct Rust slice, so they do not
        // overlap. The writer only writes bytes not yet published by a commit, so no
        // one reads them concurrently under the protocol.
        unsafe { core::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(off), src.len()) }
    }
    #[inline(always)]
    unsafe fn load_unchecked(&self, off: usize, order: Ordering) -> u64 {
        debug_assert!(off.is_multiple_of(8) && off < self.size && self.size - off >= 8);
        // SAFETY: `off` is 8-aligned and inside the region (the caller's contract); the
        // base is 8-aligned and valid for the region's lifetime (`new`'s contract); all
        // other accesses to this word are atomic (module contract).
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast::<u64>()) }.load(order)
    }
    #[inline(always)]
    unsafe fn store_unchecked(&self, off: usize, val: u64, order: Ordering) {
        debug_assert!(off.is_multiple_of(8) && off < self.size && self.size - off >= 8);
        // SAFETY: as in `load_unchecked`.
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast::<u64>()) }.store(val, order)
    }
    #[inline(always)]
    unsafe fn write_bytes_unchecked(&self, off: usize, src: &[u8]) {
        debug_assert!(off.checked_add(src.len()).is_some_and(|e| e <= self.size));
        // SAFETY: the destination range is inside the region (the caller's contract),
        // which is valid for writes (`new`'s contract); `src` is a distinct Rust slice;
        // the bytes are plain data not yet published (as in `write_bytes`).
        unsafe { core::ptr::copy_nonoverlapping(src.as_ptr(), self.base.add(off), src.len()) }
    }
    #[inline]
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        check_range(off, dst.len(), self.size);
        // Volatile, word-wise where aligned: the other side may be writing these bytes
        // (a hostile or buggy writer), and the copy must not be elided or torn into UB.
        let mut i = 0;
        let n = dst.len();
        while i < n && !(off + i).is_multiple_of(8) {
            // SAFETY: `off + i` is inside the checked range.
            dst[i] = unsafe { core::ptr::read_volatile(self.base.add(off + i)) };
            i += 1;
        }
        while n - i >= 8 {
            // SAFETY: `off + i` is 8-aligned (loop above) and `off + i + 8 <= off + n`,
            // inside the checked range.
            let w = unsafe { core::ptr::read_volatile(self.base.add(off + i).cast::<u64>()) };
            dst[i..i + 8].copy_from_slice(&w.to_ne_bytes());
            i += 8;
        }
        while i < n {
            // SAFETY: `off + i` is inside the checked range.
            dst[i] = unsafe { core::ptr::read_volatile(self.base.add(off + i)) };
            i += 1;
        }
    }
}

/// A safe, heap-backed region of atomic words (no `unsafe`): the test and fuzzing
/// backend. Byte accesses read-modify-write whole words with relaxed atomics.
#[cfg(feature = "alloc")]
#[derive(Debug)]
pub struct WordMem {
    words: alloc::boxed::Box<[AtomicU64]>,
}

#[cfg(feature = "alloc")]
impl WordMem {
    /// A zeroed region of `size` bytes (rounded up to whole words).
    pub fn new(size: usize) -> Self {
        let n = size.div_ceil(8);
        Self {
            words: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// A region holding a copy of `bytes` (rounded up to whole words, zero-filled).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let m = Self::new(bytes.len());
        m.write_bytes(0, bytes);
        m
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> alloc::vec::Vec<u8> {
        let mut v = alloc::vec![0u8; self.size()];
        self.read_bytes(0, &mut v);
        v
    }

    fn w(&self, off: usize) -> &AtomicU64 {
        check_word(off, self.size());
        &self.words[off / 8]
    }
}

#[cfg(feature = "alloc")]
impl SharedMem for WordMem {
    fn size(&self) -> usize {
        self.words.len() * 8
    }
    crate::atomic_word_ops!(self, w);
    fn write_bytes(&self, off: usize, src: &[u8]) {
        check_range(off, src.len(), self.size());
        for (i, &b) in src.iter().enumerate() {
            let a = off + i;
            let shift = (a % 8) * 8;
            let w = &self.words[a / 8];
            // Single writer per byte under the protocol; the other bytes of the word
            // may belong to other data, so update this byte only.
            let old = w.load(Ordering::Relaxed);
            let new = (old & !(0xffu64 << shift)) | (u64::from(b) << shift);
            w.store(new, Ordering::Relaxed);
        }
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        check_range(off, dst.len(), self.size());
        for (i, d) in dst.iter_mut().enumerate() {
            let a = off + i;
            *d = (self.words[a / 8].load(Ordering::Relaxed) >> ((a % 8) * 8)) as u8;
        }
    }
}

/// A heap region with the raw fast path of [`RawMem`] and a safe constructor: the
/// backend of tests, stress runs and benchmarks.
#[cfg(feature = "alloc")]
#[derive(Debug)]
pub struct HeapMem {
    // Keeps the allocation alive; `raw` points into it.
    _words: alloc::boxed::Box<[AtomicU64]>,
    raw: RawMem,
}

#[cfg(feature = "alloc")]
impl HeapMem {
    /// A zeroed region of `size` bytes (rounded up to whole words).
    pub fn new(size: usize) -> Self {
        let words: alloc::boxed::Box<[AtomicU64]> =
            (0..size.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        let ptr = words.as_ptr() as *mut u8;
        // SAFETY: the boxed slice is 8-aligned, `words.len() * 8` bytes long, never
        // moved or freed while `self` lives (the box's heap memory is stable), and only
        // accessed through `raw` (atomics and byte copies).
        let raw = unsafe { RawMem::new(ptr, words.len() * 8) };
        Self { _words: words, raw }
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> alloc::vec::Vec<u8> {
        let mut v = alloc::vec![0u8; self.raw.size()];
        self.raw.read_bytes(0, &mut v);
        v
    }
}

#[cfg(feature = "alloc")]
impl core::ops::Deref for HeapMem {
    type Target = RawMem;
    fn deref(&self) -> &RawMem {
        &self.raw
    }
}

#[cfg(feature = "alloc")]
impl SharedMem for HeapMem {
    crate::forward_shared_mem!(self => self.raw);
}

#[cfg(feature = "alloc")]
impl<T: SharedMem + ?Sized> SharedMem for alloc::sync::Arc<T> {
    crate::forward_shared_mem!(self => (**self));
}

#[cfg(all(test, feature = "alloc"))]
mod tests {
    use super::*;
    use core::sync::atomic::Ordering::Relaxed;

    /// The unchecked accessors reach the same bytes as the checked ones, for `RawMem`
    /// (its own fast path, through `HeapMem`'s forwarding) and for `WordMem` (the
    /// trait's checked defaults): the last word and the last bytes of the region too.
    #[test]
    fn unchecked_accessors_match_the_checked_ones() {
        fn check<M: SharedMem>(m: &M) {
            let last = m.size() - 8;
            // SAFETY: 8-aligned offsets with 8 bytes inside the region; byte ranges inside it.
            unsafe {
                m.store_unchecked(last, 0x1122_3344_5566_7788, Relaxed);
                m.store_unchecked(0, 42, Relaxed);
                assert_eq!(m.load_unchecked(0, Relaxed), 42);
                assert_eq!(m.load(last, Relaxed), 0x1122_3344_5566_7788);
                m.write_bytes_unchecked(16, &[1, 2, 3, 4, 5]);
                m.write_bytes_unchecked(m.size() - 3, &[9, 8, 7]);
            }
            let mut b = [0u8; 5];
            m.read_bytes(16, &mut b);
            assert_eq!(b, [1, 2, 3, 4, 5]);
            let mut e = [0u8; 3];
            m.read_bytes(m.size() - 3, &mut e);
            assert_eq!(e, [9, 8, 7]);
        }
        check(&HeapMem::new(256));
        check(&WordMem::new(256));
    }
}
