//! The drain's pieces: one bounded round of ring pages into a [`PageSink`]
//! ([`drain_pages`]), what a writer took in ([`written`]), the published attempts' check
//! (R3) and the kernel-style statistics a sink ends with. The engine that runs them per
//! CPU is [`crate::CpuReads`].

use std::time::{Duration, Instant};

use hyptrace_abi::SharedMem;
use hyptrace_output::{KernelCpuStat, Missed, OutputError, PageSink};
use hyptrace_reader::{Attempts, Callbacks, CpuStats, ReadError, RingBuffer};

/// Most page bytes one drain round hands to the sink from one CPU.
pub const ROUND_MAX_BYTES: usize = 4 << 20;
/// Longest one drain round of one CPU goes on.
pub const ROUND_MAX_TIME: Duration = Duration::from_millis(20);

/// Why a drain failed: the ring (hostile or broken guest data) or the output.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// Reading a ring failed (the guest wrote something no writer of ours writes).
    #[error("reading the ring")]
    Read(#[from] ReadError),
    /// The sink failed.
    #[error("writing the output")]
    Sink(#[from] OutputError),
}

/// One bounded round of reading CPU `rcpu` of `reader` into `sink` as CPU `cpu`: at most
/// `max_bytes` of pages, about `max_time`. Returns whether it stopped at a bound (more
/// may be there) rather than because nothing more is committed (then `sink.idle()` was
/// called). Pages carry their losses (`missed`), as the reader counted them.
///
/// # Errors
///
/// [`DrainError::Read`] when the ring holds what no writer of ours writes (the CPU
/// should not be read again), [`DrainError::Sink`] when the output fails.
///
/// # Examples
///
/// ```
/// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
/// # use hyptrace_reader::{Direct, RingBuffer};
/// # use std::{sync::Arc, time::Duration};
/// let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
/// let mem = Arc::new(HeapMem::new(l.region_size));
/// let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem, l), 1_000_000, 1)?;
/// # struct Count(u32);
/// # impl hyptrace_output::PageSink for Count {
/// #     fn page(&mut self, _: u32, _: &[u8], _: hyptrace_output::Missed) -> Result<(), hyptrace_output::OutputError> { self.0 += 1; Ok(()) }
/// #     fn finish(self: Box<Self>, _: &hyptrace_output::RunSummary) -> Result<(), hyptrace_output::OutputError> { Ok(()) }
/// # }
/// let mut sink = Count(0); // any PageSink: TraceDatSink, PerfettoSink, ...
/// let more = hyptrace_embed::drain_pages(&mut reader, 0, 0, &mut sink, 1 << 20, Duration::from_millis(5))?;
/// assert!(!more); // nothing written yet
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn drain_pages<M: SharedMem, C: Callbacks>(
    reader: &mut RingBuffer<M, C>,
    rcpu: u32,
    cpu: u32,
    sink: &mut (impl PageSink + ?Sized),
    max_bytes: usize,
    max_time: Duration,
) -> Result<bool, DrainError> {
    let started = Instant::now();
    let mut bytes = 0usize;
    while bytes < max_bytes {
        if bytes > 0 && started.elapsed() >= max_time {
            return Ok(true);
        }
        let Some(page) = reader.next_page(rcpu)? else {
            // Caught up: a sink that holds pages back may hand them over now.
            sink.idle()?;
            return Ok(false);
        };
        bytes = bytes.saturating_add(page.bytes.len().max(1));
        sink.page(cpu, page.bytes, Missed::count(page.missed))?;
    }
    Ok(true)
}

/// Events the writer of `cpu` took in (committed or dropped), from its control block.
/// `still_read`: whether the CPU is still read live.
///
/// The writer publishes an event's `commit` before it stores `entries`: a vCPU stopped
/// or crashed between the two leaves the control block one event behind its pages.
/// Once such a CPU has been read to the end, the one committed event the reader found
/// beyond `entries + dropped` counts as written.
/// # Examples
///
/// ```
/// # use std::{sync::Arc, time::Duration};
/// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
/// # use hyptrace_embed::Tracer;
/// # use hyptrace_output::{Clock, TraceDatSink, TraceDatVersion};
/// let geometry = RingGeometry::new(2, 4, 4096, Mode::Stop, false)?;
/// let mem = Arc::new(HeapMem::new(geometry.region_size)); // a VMM: GuestRegionMem
/// let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
/// # #[allow(unused_mut)]
/// let mut tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
/// assert_eq!(hyptrace_embed::written(tracer.reader(), 0, true), 0); // nothing written yet
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn written<M: SharedMem, C: Callbacks>(
    reader: &RingBuffer<M, C>,
    cpu: u32,
    still_read: bool,
) -> u64 {
    let index = reader.writer_index(cpu);
    if !reader.writer_finished(cpu) && !still_read {
        let st = reader.stats(cpu);
        let seen = st.read.saturating_add(st.lost);
        if seen == index.saturating_add(1) {
            return seen;
        }
    }
    index
}

/// Invariant R3 (docs/design.md, "Published attempts"): whether a CPU's published
/// attempts `a` agree with the `written` events its writer took in ([`written`]):
/// no problem seen ([`Attempts::problem`]), and `attempted − skipped` equal to
/// `written` for a writer that `finished` — or, for one stopped or crashed mid-run, equal
/// to it or one more (it counts an attempt before it writes or skips the event). Guest
/// numbers: no sum or difference may overflow.
/// # Examples
///
/// ```
/// use hyptrace_reader::Attempts;
/// let a = Attempts { attempted: 10, skipped: 2, ..Attempts::default() };
/// assert!(hyptrace_embed::attempts_consistent(&a, 8, true));
/// assert!(hyptrace_embed::attempts_consistent(&a, 7, false)); // stopped mid-event
/// assert!(!hyptrace_embed::attempts_consistent(&a, 7, true));
/// ```
pub fn attempts_consistent(a: &Attempts, written: u64, finished: bool) -> bool {
    let Some(taken) = a.attempted.checked_sub(a.skipped) else {
        return false;
    };
    a.problem.is_none()
        && (taken == written || (!finished && written.checked_add(1) == Some(taken)))
}

/// The kernel-style per-CPU statistics a sink writes at its end (trace.dat's CPUSTAT
/// options) for a CPU whose writer took in `written` events and whose reader saw `st`.
/// # Examples
///
/// ```
/// let st = hyptrace_reader::CpuStats { read: 90, lost: 10, ..Default::default() };
/// let k = hyptrace_embed::kernel_cpu_stat(100, &st);
/// assert_eq!((k.entries, k.read_events), (0, 90)); // nothing left unread
/// ```
pub fn kernel_cpu_stat(written: u64, st: &CpuStats) -> KernelCpuStat {
    KernelCpuStat {
        entries: written.saturating_sub(st.read.saturating_add(st.lost)),
        overrun: st.overrun,
        commit_overrun: 0,
        bytes: st.bytes,
        oldest_event_ts: 0,
        now_ts: 0,
        dropped_events: st.dropped,
        read_events: st.read,
    }
}

#[cfg(test)]
mod tests {
    // The drain and final-walk cases (losses, a scribbled ring, a stopped writer, a
    // trailing loss) are the shared table's: tests/support/drain_cases.rs, run against
    // `Tracer` by tests/drain.rs and against the CLI's session by the host crate.
    use super::*;

    /// R3's cases: exact for a finished writer; one attempt ahead of what was written
    /// for a writer stopped mid-event, never more, never behind; a problem seen or a
    /// published skipped above attempted is never consistent (no wrapped difference).
    #[test]
    fn attempts_consistent_cases() {
        let a = |attempted, skipped| Attempts {
            attempted,
            skipped,
            problem: None,
        };
        assert!(attempts_consistent(&a(10, 3), 7, true));
        assert!(!attempts_consistent(&a(10, 3), 6, true));
        assert!(!attempts_consistent(&a(10, 3), 8, true));
        assert!(attempts_consistent(&a(10, 3), 7, false));
        assert!(attempts_consistent(&a(10, 3), 6, false));
        assert!(!attempts_consistent(&a(10, 3), 5, false));
        assert!(!attempts_consistent(&a(10, 3), 8, false));
        assert!(!attempts_consistent(&a(3, 10), 0, false));
        assert!(attempts_consistent(&a(u64::MAX, 0), u64::MAX, false));
        assert!(!attempts_consistent(&a(0, 0), u64::MAX, false));
        let bad = Attempts {
            problem: Some(hyptrace_reader::AttemptsProblem::SkippedAboveAttempted {
                attempted: 1,
                skipped: 2,
            }),
            ..a(10, 3)
        };
        assert!(!attempts_consistent(&bad, 7, true));
    }
}
