//! Start-up work that runs beside the VM's creation ([`Overlap`]): the trace region
//! faulted in ([`prefault`]) on a thread of its own while the creating thread makes the
//! VM, its memory slot, tables and vCPUs.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::vmm::memory_map::GuestMemoryMap;

/// A job run once, on a thread of its own or — when that thread has not begun it by the
/// time its result is needed ([`Overlap::finish`]) — on the caller's: a late thread (a
/// busy host, a hypervisor that schedules it late) never makes the start slower than
/// doing the job in line.
pub(crate) struct Overlap<T> {
    state: Arc<State<T>>,
    thread: Option<JoinHandle<()>>,
}

type Job<T> = Box<dyn FnOnce() -> T + Send>;

struct State<T> {
    /// `None` once someone took the job.
    job: Mutex<Option<Job<T>>>,
    /// The thread's result.
    result: Mutex<Option<T>>,
}

impl<T> State<T> {
    fn take_job(&self) -> Option<Job<T>> {
        self.job.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl<T: Send + 'static> Overlap<T> {
    /// Starts `job` on a thread named `name` (if no thread can be made, the job waits
    /// for [`Overlap::finish`]).
    pub(crate) fn start(name: &str, job: impl FnOnce() -> T + Send + 'static) -> Self {
        let state = Arc::new(State {
            job: Mutex::new(Some(Box::new(job) as Job<T>)),
            result: Mutex::new(None),
        });
        let theirs = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                if let Some(job) = theirs.take_job() {
                    let r = job();
                    *theirs.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                }
            })
            .map_err(|e| log::debug!("{name} thread: {e}; done in line"))
            .ok();
        Self { state, thread }
    }

    /// The job's result: run here if its thread has not taken it yet, else waited for.
    /// `None` only if the thread panicked.
    pub(crate) fn finish(mut self) -> Option<T> {
        if let Some(job) = self.state.take_job() {
            return Some(job());
        }
        if let Some(h) = self.thread.take() {
            // A panicked job left no result: `None`.
            let _ = h.join();
        }
        self.state
            .result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

impl<T> Drop for Overlap<T> {
    /// Not finished (an early return): the job is dropped unrun if its thread has not
    /// begun it, else waited for — it never outlives what it works on.
    fn drop(&mut self) {
        drop(self.state.take_job());
        if let Some(h) = self.thread.take() {
            let _ = h.join();
        }
    }
}

/// Backs the trace region with transparent huge pages and faults it in beside the VM's
/// creation; [`Overlap::finish`] it before the rings are written.
///
/// The host writes a footer into every ring page before the guest starts (docs/abi.md),
/// so every page of the region is faulted in anyway: 2 MiB at a time (`MADV_HUGEPAGE`;
/// Debian's THP mode is `madvise`) costs two faults a 4 MiB ring instead of 1024, and the
/// kernel's zeroing of those pages — the bulk of the time — runs beside
/// `KVM_GET_SUPPORTED_CPUID` and the vCPUs' creation instead of after them. The rest of
/// guest memory keeps 4 KiB pages: the host and the guest touch few of its pages, and a
/// huge page would zero 2 MiB for each. The `madvise` calls are hints: refused (an older
/// kernel), nothing changes but the time. A trace region in a file (`--trace-mem`) is
/// left as it is.
pub(crate) fn prefault(memory: &GuestMemoryMmap, layout: &GuestMemoryMap) -> Overlap<()> {
    let trace = anonymous_range(memory, layout.trace_gpa, layout.trace_len);
    if let Some((addr, len)) = trace {
        advise(addr, len, libc::MADV_HUGEPAGE);
    }
    // `memory` (an Arc'd mapping) travels with the job: the range stays mapped while it
    // is populated, whoever drops the VM.
    let keep = memory.clone();
    Overlap::start("prefault", move || {
        // A huge page at a time: the populate holds the address space's lock (read)
        // while it faults, and the creating thread's mmap(2)s (a vCPU's `kvm_run`, a
        // thread's stack) wait for it (write) between two steps only.
        if let Some((addr, len)) = trace {
            for off in (0..len).step_by(HUGE_PAGE) {
                advise(
                    addr + off,
                    HUGE_PAGE.min(len - off),
                    libc::MADV_POPULATE_WRITE,
                );
            }
        }
        drop(keep);
    })
}

/// A transparent huge page (x86-64).
const HUGE_PAGE: usize = 2 << 20;

/// The host address and length of `len` bytes of guest memory at `gpa`, if they are one
/// anonymous mapping.
fn anonymous_range(memory: &GuestMemoryMmap, gpa: u64, len: u64) -> Option<(usize, usize)> {
    let region = memory.find_region(GuestAddress(gpa))?;
    let start = gpa.checked_sub(region.start_addr().0)?;
    if region.file_offset().is_some() || start.checked_add(len)? > region.len() {
        return None;
    }
    let host = memory.get_host_address(GuestAddress(gpa)).ok()?;
    Some((host as usize, usize::try_from(len).ok()?))
}

/// `madvise(addr, len, advice)` on guest memory: a hint, a refusal is logged only.
fn advise(addr: usize, len: usize, advice: libc::c_int) {
    // SAFETY: `addr..addr + len` lies in one live anonymous mapping of guest memory that
    // the caller keeps mapped for the call (`prefault` moves a handle on it into the
    // job); MADV_HUGEPAGE changes how it is backed and MADV_POPULATE_WRITE faults its
    // pages in as a write would, fresh anonymous memory staying zero: neither changes
    // its contents or its lifetime.
    let r = unsafe { libc::madvise(addr as *mut libc::c_void, len, advice) };
    if r != 0 {
        log::debug!(
            "madvise({advice}) on guest memory: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// The job runs exactly once, whether its thread or `finish` takes it, and gives
    /// its result; nothing of it is left running after `finish`.
    #[test]
    fn a_job_runs_once_and_gives_its_result() {
        for _ in 0..50 {
            let runs = Arc::new(AtomicU32::new(0));
            let r = Arc::clone(&runs);
            let o = Overlap::start("t", move || r.fetch_add(1, Ordering::SeqCst) + 41);
            assert_eq!(o.finish(), Some(41));
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            assert_eq!(Arc::strong_count(&runs), 1, "the job is gone");
        }
    }

    /// Dropped unfinished: the job ran at most once, and a job its thread had begun was
    /// waited for (nothing of it outlives the drop: it may hold guest memory).
    #[test]
    fn a_dropped_job_does_not_outlive_the_drop() {
        for _ in 0..50 {
            let runs = Arc::new(AtomicU32::new(0));
            let r = Arc::clone(&runs);
            drop(Overlap::start("t", move || {
                r.fetch_add(1, Ordering::SeqCst);
            }));
            assert!(runs.load(Ordering::SeqCst) <= 1);
            assert_eq!(Arc::strong_count(&runs), 1, "the job is gone");
        }
    }

    /// Only a range inside one anonymous region is advised.
    #[test]
    fn the_prefaulted_region_is_in_guest_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        assert!(anonymous_range(&mem, 2 << 20, 2 << 20).is_some());
        assert!(anonymous_range(&mem, 2 << 20, (2 << 20) + 4096).is_none());
        assert!(anonymous_range(&mem, 4 << 20, 4096).is_none());
    }
}
