//! The engine's per-CPU read state and the final walk: which CPUs are still read live,
//! which failed (with their first error), which had their final read-only walk, the walk
//! itself and the per-CPU account (`written = read + lost`, R1; the published attempts,
//! R3). [`crate::Tracer`] is built from it, and so is the `hyptrace` binary's session,
//! which adds its policy (text lines, subscribers, pacing, the flight recorder) on top:
//! one state machine for both.

use hyptrace_abi::SharedMem;
use hyptrace_output::{PageSink, RunSummary};
use hyptrace_reader::{Attempts, Callbacks, CpuStats, ReadError, RingBuffer};

use crate::drain::{
    attempts_consistent, drain_pages, kernel_cpu_stat, written, DrainError, ROUND_MAX_BYTES,
    ROUND_MAX_TIME,
};

/// Where the reading of one CPU stands; it only goes forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    /// Its vCPU may run: read live, in bounded rounds that swap pages away from the
    /// writer (unless a live read failed: [`CpuReads::failed`]).
    #[default]
    Live,
    /// Its writer stopped: the final read-only walk has begun (writer counters synced,
    /// the reader finalized, no swap from now on); only the walk reads it.
    Walking,
    /// The walk is over (complete or failed) and the losses after the last page taken:
    /// nothing more of it is read or output.
    Ended,
}

/// One CPU's state.
#[derive(Debug)]
struct CpuRead<E> {
    phase: Phase,
    /// A live read failed: not polled again; the final walk still runs.
    failed: bool,
    /// The first error seen on the CPU (a live read, its walk or its output).
    error: Option<E>,
}

/// The per-CPU read state machine of the one reader of a VM's rings, with errors of
/// type `E` (the reader's own [`DrainError`], or what a caller records).
///
/// A CPU starts [`Phase::Live`]; a live read that fails makes it [`CpuReads::failed`]
/// (no more live rounds, the error kept); once its vCPU stopped, [`CpuReads::walk`] (into
/// a page sink; [`CpuReads::walk_with`]: rounds of the caller's; or, for a walk that goes
/// on over several calls, [`CpuReads::begin_walk`], the rounds,
/// [`CpuReads::trailing_loss`] and [`CpuReads::end`]) reads the rest read-only, a failed
/// CPU included. Its account ([`CpuReads::account`]) counts the one event a writer
/// stopped between its commit and its `entries` left behind only once it ended.
///
/// # Examples
///
/// ```
/// # use std::{sync::Arc, time::Duration};
/// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
/// # use hyptrace_reader::{Direct, RingBuffer};
/// use hyptrace_embed::{CpuReads, Phase};
/// let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
/// let mem = Arc::new(HeapMem::new(l.region_size));
/// let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem, l), 1_000_000, 1)?;
/// let mut reads = CpuReads::<String>::new(1); // errors as the caller keeps them
/// assert!(reads.polls(0));
/// # struct Count;
/// # impl hyptrace_output::PageSink for Count {
/// #     fn page(&mut self, _: u32, _: &[u8], _: hyptrace_output::Missed) -> Result<(), hyptrace_output::OutputError> { Ok(()) }
/// #     fn finish(self: Box<Self>, _: &hyptrace_output::RunSummary) -> Result<(), hyptrace_output::OutputError> { Ok(()) }
/// # }
/// reads.walk(&mut reader, 0, &mut Count)?; // its vCPU stopped
/// assert_eq!(reads.phase(0), Phase::Ended);
/// assert!(reads.account(&mut reader, 0).consistent());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct CpuReads<E = DrainError> {
    cpus: Vec<CpuRead<E>>,
}

impl<E> CpuReads<E> {
    /// `nr_cpus` CPUs, every one [`Phase::Live`].
    /// # Examples
    ///
    /// ```
    /// let reads = hyptrace_embed::CpuReads::<String>::new(2);
    /// assert!(reads.is_live(1) && !reads.is_live(2));
    /// ```
    pub fn new(nr_cpus: u32) -> Self {
        let cpus = (0..nr_cpus)
            .map(|_| CpuRead {
                phase: Phase::Live,
                failed: false,
                error: None,
            })
            .collect();
        Self { cpus }
    }

    /// Where the reading of `cpu` stands (a CPU out of range: [`Phase::Ended`]).
    /// # Examples
    ///
    /// ```
    /// use hyptrace_embed::{CpuReads, Phase};
    /// let mut reads = CpuReads::<String>::new(1);
    /// assert!(reads.end(0));
    /// assert_eq!((reads.phase(0), reads.phase(7)), (Phase::Ended, Phase::Ended));
    /// ```
    pub fn phase(&self, cpu: u32) -> Phase {
        self.cpus
            .get(cpu as usize)
            .map_or(Phase::Ended, |c| c.phase)
    }

    /// Whether `cpu` still has to be read: it has not ended.
    /// # Examples
    ///
    /// ```
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// assert!(reads.is_live(0));
    /// reads.end(0);
    /// assert!(!reads.is_live(0));
    /// ```
    pub fn is_live(&self, cpu: u32) -> bool {
        self.phase(cpu) != Phase::Ended
    }

    /// Whether a live round may read `cpu`: [`Phase::Live`] and no live read failed.
    /// # Examples
    ///
    /// ```
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(2);
    /// reads.fail(1, "bad footer".into());
    /// assert!(reads.polls(0) && !reads.polls(1));
    /// ```
    pub fn polls(&self, cpu: u32) -> bool {
        self.cpus
            .get(cpu as usize)
            .is_some_and(|c| c.phase == Phase::Live && !c.failed)
    }

    /// Whether a live read of `cpu` failed (it is not polled again; its walk still runs).
    /// # Examples
    ///
    /// ```
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// reads.record(0, || "output".into()); // an error, no failed live read
    /// assert!(!reads.failed(0) && reads.error(0).is_some());
    /// ```
    pub fn failed(&self, cpu: u32) -> bool {
        self.cpus.get(cpu as usize).is_some_and(|c| c.failed)
    }

    /// The first error seen on `cpu`, if any.
    /// # Examples
    ///
    /// ```
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// reads.fail(0, "first".into());
    /// reads.fail(0, "second".into());
    /// assert_eq!(reads.error(0).map(String::as_str), Some("first"));
    /// ```
    pub fn error(&self, cpu: u32) -> Option<&E> {
        self.cpus.get(cpu as usize).and_then(|c| c.error.as_ref())
    }

    /// A live read of `cpu` failed with `e`: it is not polled again, and `e` is kept
    /// unless an error was already. Returns whether `e` is the CPU's first error.
    /// # Examples
    ///
    /// ```
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// assert!(reads.fail(0, "scribbled".into()));
    /// assert!(!reads.fail(0, "again".into()));
    /// ```
    pub fn fail(&mut self, cpu: u32, e: E) -> bool {
        let Some(c) = self.cpus.get_mut(cpu as usize) else {
            return false;
        };
        c.failed = true;
        self.record(cpu, || e)
    }

    /// Keeps the error `e()` makes as `cpu`'s, unless it has one already (the phase
    /// stays). Returns whether it was kept.
    /// # Examples
    ///
    /// ```
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// assert!(reads.record(0, || "walk".into()));
    /// assert!(!reads.record(0, || unreachable!("made only when kept")));
    /// ```
    pub fn record(&mut self, cpu: u32, e: impl FnOnce() -> E) -> bool {
        match self.cpus.get_mut(cpu as usize) {
            Some(c) if c.error.is_none() => {
                c.error = Some(e());
                true
            }
            _ => false,
        }
    }

    /// Ends `cpu`: nothing more of it is read. Returns `false` if there is no such CPU or
    /// it ended already.
    /// # Examples
    ///
    /// ```
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// assert!(reads.end(0) && !reads.end(0) && !reads.end(1));
    /// ```
    pub fn end(&mut self, cpu: u32) -> bool {
        match self.cpus.get_mut(cpu as usize) {
            Some(c) if c.phase != Phase::Ended => {
                c.phase = Phase::Ended;
                true
            }
            _ => false,
        }
    }

    /// The writer of `cpu` stopped: the final walk begins, once (later calls and an
    /// ended CPU: `Ok(false)`) — its writer counters synced, the reader switched to the
    /// read-only walk (`finalize`: no swap from now on). Returns whether it began now.
    /// Its rounds are the caller's (a page sink: [`drain_pages`]), until one returns
    /// that nothing more is committed; then [`CpuReads::trailing_loss`] and
    /// [`CpuReads::end`]. [`CpuReads::walk`] is all of it into a page sink.
    ///
    /// # Errors
    ///
    /// [`ReadError`] when the control block or the reader page is not one a writer of
    /// ours leaves (the walk has begun all the same: it is not begun again).
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_reader::{Direct, RingBuffer};
    /// # let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
    /// # let mem = Arc::new(HeapMem::new(l.region_size));
    /// # let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem, l), 1_000_000, 1)?;
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// assert!(reads.begin_walk(&mut reader, 0)?);
    /// assert!(!reads.begin_walk(&mut reader, 0)? && !reads.polls(0));
    /// while reader.next_event(0)?.is_some() {} // the caller's rounds
    /// assert_eq!(reads.trailing_loss(&mut reader, 0), 0);
    /// reads.end(0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn begin_walk<M: SharedMem, C: Callbacks>(
        &mut self,
        reader: &mut RingBuffer<M, C>,
        cpu: u32,
    ) -> Result<bool, ReadError> {
        match self.cpus.get_mut(cpu as usize) {
            Some(c) if c.phase == Phase::Live => c.phase = Phase::Walking,
            _ => return Ok(false),
        }
        reader.sync_writer_counters(cpu)?;
        reader.finalize(cpu)?;
        Ok(true)
    }

    /// The events of `cpu` lost after its last page (stop mode: dropped while the ring
    /// was full at the end), once its walk read everything (R1: they complete
    /// `written = read + lost`); counted in its stats once, 0 when asked again or before
    /// the walk is complete.
    /// # Examples
    ///
    /// See [`CpuReads::begin_walk`].
    pub fn trailing_loss<M: SharedMem, C: Callbacks>(
        &self,
        reader: &mut RingBuffer<M, C>,
        cpu: u32,
    ) -> u64 {
        reader.take_trailing_loss(cpu)
    }

    /// The whole final walk of `cpu` into `sink` (its vCPU stopped): begun
    /// ([`CpuReads::begin_walk`]), read in bounded rounds to the end, the losses after its
    /// last page handed to `sink`, the CPU ended — whatever failed. An ended CPU: `Ok`.
    ///
    /// # Errors
    ///
    /// The first [`DrainError`]: of the ring (the rest of it is not read; the CPU ends
    /// all the same) or the sink. Not recorded: the caller decides
    /// ([`CpuReads::record`]).
    ///
    /// # Examples
    ///
    /// See [`CpuReads`].
    pub fn walk<M: SharedMem, C: Callbacks>(
        &mut self,
        reader: &mut RingBuffer<M, C>,
        cpu: u32,
        sink: &mut (impl PageSink + ?Sized),
    ) -> Result<(), DrainError> {
        let (r, lost) = self.walk_with(reader, cpu, |reader| {
            drain_pages(reader, cpu, cpu, sink, ROUND_MAX_BYTES, ROUND_MAX_TIME)
        });
        r?;
        if lost > 0 {
            sink.trailing_lost(cpu, lost)?;
        }
        Ok(())
    }

    /// The whole final walk of `cpu` (its vCPU stopped), each bounded round by `round`
    /// (it returns whether it stopped at a bound: more may be left), for an output of
    /// the caller's: begun ([`CpuReads::begin_walk`]; a walk begun earlier goes on where
    /// it is), read to the end, the CPU ended — whatever failed. Returns the first
    /// failure and the losses after the last page ([`CpuReads::trailing_loss`], for the
    /// caller's output; 0 unless the walk read to the end); an ended CPU: `(Ok, 0)`.
    /// # Examples
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_reader::{Direct, ReadError, RingBuffer};
    /// # let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
    /// # let mem = Arc::new(HeapMem::new(l.region_size));
    /// # let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem, l), 1_000_000, 1)?;
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// let mut events = 0;
    /// let (r, lost) = reads.walk_with(&mut reader, 0, |reader| {
    ///     while reader.next_event(0)?.is_some() {
    ///         events += 1; // the caller's output
    ///     }
    ///     Ok::<_, ReadError>(false)
    /// });
    /// assert!(r.is_ok() && (events, lost) == (0, 0) && !reads.is_live(0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn walk_with<M: SharedMem, C: Callbacks, F: From<ReadError>>(
        &mut self,
        reader: &mut RingBuffer<M, C>,
        cpu: u32,
        mut round: impl FnMut(&mut RingBuffer<M, C>) -> Result<bool, F>,
    ) -> (Result<(), F>, u64) {
        if !self.is_live(cpu) {
            return (Ok(()), 0);
        }
        let mut r = self.begin_walk(reader, cpu).map(|_| true).map_err(F::from);
        // Bounded: each round consumes at least one item of those left, or ends.
        while let Ok(true) = r {
            r = round(reader);
        }
        // R1: the drops after the last page, once the walk read everything.
        let lost = self.trailing_loss(reader, cpu);
        self.end(cpu);
        (r.map(|_| ()), lost)
    }

    /// Events the writer of `cpu` took in ([`written`]): with the one event a writer
    /// stopped between commit and `entries` left beyond them once `cpu` ended (R1).
    /// # Examples
    ///
    /// See [`CpuReads::account`].
    pub fn written<M: SharedMem, C: Callbacks>(&self, reader: &RingBuffer<M, C>, cpu: u32) -> u64 {
        written(reader, cpu, self.is_live(cpu))
    }

    /// The account of `cpu` as it stands, with a copy of its error.
    /// # Examples
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_reader::{Direct, RingBuffer};
    /// # let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
    /// # let mem = Arc::new(HeapMem::new(l.region_size));
    /// # let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem, l), 1_000_000, 1)?;
    /// let mut reads = hyptrace_embed::CpuReads::<String>::new(1);
    /// reads.record(0, || "the output failed".into());
    /// let a = reads.account(&mut reader, 0);
    /// assert!(a.balanced() && !a.consistent()); // nothing written, one error
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn account<M: SharedMem, C: Callbacks>(
        &self,
        reader: &mut RingBuffer<M, C>,
        cpu: u32,
    ) -> CpuAccount<E>
    where
        E: Clone,
    {
        self.account_with(reader, cpu, self.error(cpu).cloned())
    }

    /// Every CPU's account, the errors moved into them.
    /// # Examples
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_reader::{Direct, RingBuffer};
    /// # let l = RingGeometry::new(2, 4, 4096, Mode::Stop, false)?;
    /// # let mem = Arc::new(HeapMem::new(l.region_size));
    /// # let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem, l), 1_000_000, 1)?;
    /// let reads = hyptrace_embed::CpuReads::<hyptrace_embed::DrainError>::new(2);
    /// assert_eq!(reads.into_accounts(&mut reader).len(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn into_accounts<M: SharedMem, C: Callbacks>(
        self,
        reader: &mut RingBuffer<M, C>,
    ) -> Vec<CpuAccount<E>> {
        let mut reads = self;
        (0..reads.cpus.len())
            .zip(0u32..)
            .map(|(i, cpu)| {
                let error = reads.cpus[i].error.take();
                reads.account_with(reader, cpu, error)
            })
            .collect()
    }

    fn account_with<M: SharedMem, C: Callbacks, F>(
        &self,
        reader: &mut RingBuffer<M, C>,
        cpu: u32,
        error: Option<F>,
    ) -> CpuAccount<F> {
        CpuAccount {
            written: self.written(reader, cpu),
            stats: reader.stats(cpu),
            finished: reader.writer_finished(cpu),
            attempts: reader.attempts(cpu).unwrap_or_default(),
            error,
        }
    }
}

/// The final account of one CPU ([`crate::CpuReads::account`]), with its error of type `E`.
#[derive(Debug)]
pub struct CpuAccount<E = DrainError> {
    /// Events the writer took in (committed or dropped).
    pub written: u64,
    /// The reader's counters: `read`, `lost` (= `overrun + dropped` once all is read)...
    pub stats: CpuStats,
    /// Whether the writer said it finished.
    pub finished: bool,
    /// What the guest's writer published of its attempts (R3).
    pub attempts: Attempts,
    /// Why reading this CPU stopped early, if it did.
    pub error: Option<E>,
}

impl<E> CpuAccount<E> {
    /// Whether every event written was read or counted lost (`written = read + lost`,
    /// R1) and the published attempts agree ([`attempts_consistent`], R3) — errors aside.
    /// # Examples
    ///
    /// ```
    /// let a = hyptrace_embed::CpuAccount::<String> {
    ///     written: 10,
    ///     stats: hyptrace_reader::CpuStats { read: 7, lost: 3, ..Default::default() },
    ///     finished: true,
    ///     attempts: hyptrace_reader::Attempts { attempted: 12, skipped: 2, ..Default::default() },
    ///     error: None,
    /// };
    /// assert!(a.balanced() && a.consistent());
    /// ```
    pub fn balanced(&self) -> bool {
        self.stats.read.checked_add(self.stats.lost) == Some(self.written)
            && attempts_consistent(&self.attempts, self.written, self.finished)
    }

    /// [`CpuAccount::balanced`], and no error stopped the reading of the CPU.
    /// # Examples
    ///
    /// See [`CpuAccount::balanced`].
    pub fn consistent(&self) -> bool {
        self.error.is_none() && self.balanced()
    }
}

/// The per-CPU statistics a sink writes at its end (trace.dat's CPUSTAT options), one
/// per account ([`kernel_cpu_stat`]).
/// # Examples
///
/// ```
/// let a = hyptrace_embed::CpuAccount::<String> {
///     written: 10,
///     stats: hyptrace_reader::CpuStats { read: 7, lost: 3, ..Default::default() },
///     finished: true,
///     attempts: Default::default(),
///     error: None,
/// };
/// assert_eq!(hyptrace_embed::run_summary(&[a]).cpus[0].read_events, 7);
/// ```
pub fn run_summary<E>(accounts: &[CpuAccount<E>]) -> RunSummary {
    RunSummary {
        cpus: accounts
            .iter()
            .map(|a| kernel_cpu_stat(a.written, &a.stats))
            .collect(),
    }
}
