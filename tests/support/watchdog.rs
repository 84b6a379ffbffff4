//! Tests that fail, never hang: a progress watchdog, panic-propagating guards, and a
//! per-thread allocation counter.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs `f` on its own thread and fails (panics here) if `f` panics, or if the progress
/// counter it is given does not change for `stall` (a hang: the stuck thread is left
/// behind and dies with the test process). Slowness is not a failure: only a counter
/// that stops moving is.
pub fn with_watchdog(stall: Duration, f: impl FnOnce(&AtomicU64) + Send + 'static) {
    let progress = Arc::new(AtomicU64::new(0));
    let p2 = progress.clone();
    let t = std::thread::spawn(move || f(&p2));
    let mut last = u64::MAX;
    let mut since = Instant::now();
    while !t.is_finished() {
        std::thread::sleep(Duration::from_millis(20));
        let p = progress.load(SeqCst);
        if p != last {
            last = p;
            since = Instant::now();
        } else if since.elapsed() > stall {
            panic!("no progress for {stall:?} at step {p}: a hang");
        }
    }
    if let Err(e) = t.join() {
        std::panic::resume_unwind(e);
    }
}

/// Sets its flag when dropped — also while unwinding — so threads waiting for the flag
/// (a `stop` or `abort`) stop when the thread holding the guard ends or fails.
pub struct SetOnDrop<'a>(pub &'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, SeqCst);
    }
}

/// Joins a scoped thread, re-raising its panic in the caller.
pub fn join<T>(h: std::thread::ScopedJoinHandle<'_, T>) -> T {
    h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
}

thread_local! {
    /// Bytes allocated minus bytes freed by this thread.
    static NET: Cell<i64> = const { Cell::new(0) };
    /// Highest `NET` since the last [`reset_peak`].
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

/// A global allocator that counts, per thread, the bytes it holds (allocated minus
/// freed) and their peak. Install it in a test binary with
/// `#[global_allocator] static A: CountingAlloc = CountingAlloc;`.
pub struct CountingAlloc;

fn count(delta: i64) {
    // try_with: the thread-locals are gone during thread teardown; not counted then.
    let _ = NET.try_with(|n| {
        let v = n.get().saturating_add(delta);
        n.set(v);
        let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
    });
}

// SAFETY: every method forwards to the system allocator with the caller's arguments
// unchanged (so its contract is the system allocator's); the counting touches only
// const-initialised thread-locals without destructors, which never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as i64));
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded unchanged; `ptr` came from `System` with `layout`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

/// Bytes this thread holds (allocated minus freed) — meaningful only with
/// [`CountingAlloc`] installed.
pub fn thread_net_bytes() -> i64 {
    NET.try_with(Cell::get).unwrap_or(0)
}

/// The highest [`thread_net_bytes`] since the last reset; resets the peak to now.
pub fn take_thread_peak() -> i64 {
    let now = thread_net_bytes();
    PEAK.try_with(|p| p.replace(now)).unwrap_or(0)
}
