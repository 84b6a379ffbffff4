//! A page sink on its own thread: the reader hands pages over with a copy into a chunk
//! and goes back to the rings, while the sink's `write(2)`s (page cache, compression)
//! run on the sink thread.
//!
//! Why: the reader must free ring pages at the pace the writer fills them (stop mode
//! drops what does not fit), but a file write can stall for milliseconds (page cache
//! faulting in fresh memory, writeback throttling: one 1 MiB `write(2)` took 2.3 ms on
//! these machines, docs/benchmarks.md), and while the reader waits in it no page is
//! swapped. With the sink on its own thread such a stall costs queue space, not events.
//!
//! Bounds: at most [`MAX_CHUNKS`] chunks of about [`CHUNK_BYTES`] exist (allocated on
//! demand, then reused): the memory in flight is bounded by constants, never by what
//! the guest writes. When all are in flight the reader waits for one (back-pressure:
//! the rings fill and stop mode drops, counted, as with a slow synchronous sink); each
//! such wait is timed ([`PageSink::waits`]), so a run can say its output held it back.
//! A partly filled chunk is handed over by [`PageSink::idle`] once it is
//! [`FLUSH_AFTER`] old, so output keeps flowing at low rates.
//!
//! Errors: the first error of the inner sink ends the thread; the reader sees it at its
//! next call (page, idle, trailing_lost or finish), later calls get
//! [`OutputError::Closed`]. The inner sink is then dropped unfinished: no output that
//! looks complete. A panic in the sink thread is resumed on the reader's thread.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::{Missed, OutputError, OutputWaits, PageSink, RunSummary};

/// Page bytes per chunk (a chunk holds at least one page, whatever its size).
pub const CHUNK_BYTES: usize = 1 << 20;
/// Chunks in existence at most (queued, being written, or being filled): 32 MiB of
/// 4 KiB pages, ~70 ms of pages at 450 MB/s.
pub const MAX_CHUNKS: usize = 32;
/// Age after which [`PageSink::idle`] hands over a partly filled chunk.
pub const FLUSH_AFTER: Duration = Duration::from_millis(20);

/// One page in a chunk.
struct PageRef {
    cpu: u32,
    start: usize,
    len: usize,
    missed: Missed,
}

/// Pages copied back to back, and where each one is.
#[derive(Default)]
struct Chunk {
    data: Vec<u8>,
    pages: Vec<PageRef>,
    /// [`PageSink::quiet`] notes (the latest per CPU), passed on after the pages.
    quiet: std::collections::BTreeMap<u32, u64>,
}

/// What the reader sends to the sink thread, in order.
enum Msg {
    Chunk(Chunk),
    TrailingLost(u32, u64),
    EndCpu(u32),
}

type Worker = JoinHandle<Result<Box<dyn PageSink + Send>, OutputError>>;

/// [`PageSink`] that runs another one on its own thread (see the module).
pub struct ThreadedSink {
    tx: Option<SyncSender<Msg>>,
    /// Chunks the sink thread is done with.
    free: Receiver<Chunk>,
    /// Chunks allocated so far (at most [`MAX_CHUNKS`]).
    allocated: usize,
    /// The chunk being filled, and when its first page came.
    cur: Chunk,
    since: Option<Instant>,
    worker: Option<Worker>,
    /// The thread ended with an error already returned once.
    closed: bool,
    /// Back-pressure: the waits for a chunk the thread was still writing.
    waits: OutputWaits,
    /// When to stop writing, shared with the thread.
    stop: Arc<Stop>,
}

/// When the sink stops writing at once: [`PageSink::abandon`]ed, or
/// [`ThreadedSink::cancel_on`]'s condition holds.
#[derive(Default)]
struct Stop {
    abandoned: AtomicBool,
    cancel: std::sync::OnceLock<Cancel>,
}

impl Stop {
    fn stopped(&self) -> bool {
        self.abandoned.load(Ordering::Relaxed) || self.cancel.get().is_some_and(|c| c())
    }
}

/// A condition under which the sink stops writing at once (see
/// [`ThreadedSink::cancel_on`]).
type Cancel = Box<dyn Fn() -> bool + Send + Sync>;

/// How often a reader waiting for a free chunk checks the cancel condition.
const CANCEL_POLL: Duration = Duration::from_millis(20);

impl ThreadedSink {
    /// Starts the sink thread around `inner` (told its pages come from live rings,
    /// [`PageSink::set_live`]).
    pub fn new(mut inner: Box<dyn PageSink + Send>) -> Result<Self, OutputError> {
        inner.set_live();
        let (tx, rx) = sync_channel::<Msg>(MAX_CHUNKS + 1);
        let (free_tx, free) = sync_channel::<Chunk>(MAX_CHUNKS + 1);
        let stop = Arc::new(Stop::default());
        let stopped = Arc::clone(&stop);
        let worker = std::thread::Builder::new()
            .name("hyptrace-sink".into())
            .spawn(move || run(inner, &rx, &free_tx, &|| stopped.stopped()))
            .map_err(|e| OutputError::Io {
                path: None,
                source: e,
            })?;
        Ok(Self {
            tx: Some(tx),
            free,
            allocated: 1,
            cur: Chunk::default(),
            since: None,
            worker: Some(worker),
            closed: false,
            waits: OutputWaits::default(),
            stop,
        })
    }

    /// Once `cancel()` holds (e.g. a second Ctrl-C), the sink behaves as
    /// [`PageSink::abandon`]ed: the thread stops before its next page, a reader waiting
    /// for room gets [`OutputError::Closed`] within `CANCEL_POLL` (20 ms).
    #[must_use]
    pub fn cancel_on(self, cancel: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        let _ = self.stop.cancel.set(Box::new(cancel));
        self
    }

    /// The sink thread ended early (its error, once), or had already.
    fn fail(&mut self) -> OutputError {
        self.tx = None;
        if self.closed {
            return OutputError::Closed;
        }
        self.closed = true;
        match self.worker.take().map(JoinHandle::join) {
            Some(Ok(Err(e))) => e,
            Some(Ok(Ok(_))) | None => OutputError::Closed,
            Some(Err(panic)) => std::panic::resume_unwind(panic),
        }
    }

    fn send(&mut self, msg: Msg) -> Result<(), OutputError> {
        let sent = match &self.tx {
            Some(tx) => tx.send(msg).is_ok(),
            None => false,
        };
        if sent {
            Ok(())
        } else {
            Err(self.fail())
        }
    }

    /// An empty chunk: one the thread is done with, a new one while fewer than
    /// [`MAX_CHUNKS`] exist, else the next one the thread finishes (back-pressure).
    fn take_free(&mut self) -> Result<Chunk, OutputError> {
        if let Ok(c) = self.free.try_recv() {
            return Ok(c);
        }
        if self.allocated < MAX_CHUNKS {
            self.allocated += 1;
            return Ok(Chunk::default());
        }
        let t = Instant::now();
        // Bounded: each turn waits CANCEL_POLL; it ends when a chunk comes back, the
        // thread ends, or the sink is cancelled.
        let got = loop {
            match self.free.recv_timeout(CANCEL_POLL) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !self.stop.stopped() => {}
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    self.abandon();
                    break None;
                }
                r => break r.ok(),
            }
        };
        self.waits.add(t.elapsed());
        match got {
            Some(c) => Ok(c),
            None => Err(self.fail()),
        }
    }

    /// Hands the chunk being filled to the thread (if it holds a page).
    fn send_cur(&mut self) -> Result<(), OutputError> {
        if self.cur.pages.is_empty() && self.cur.quiet.is_empty() {
            return Ok(());
        }
        let next = self.take_free()?;
        let full = std::mem::replace(&mut self.cur, next);
        self.since = None;
        self.send(Msg::Chunk(full))
    }

    fn check(&mut self) -> Result<(), OutputError> {
        if self.tx.is_none() {
            return Err(self.fail());
        }
        Ok(())
    }
}

/// The sink thread: writes every page of every chunk in order, gives the chunks back.
fn run(
    mut inner: Box<dyn PageSink + Send>,
    rx: &Receiver<Msg>,
    free: &SyncSender<Chunk>,
    abandoned: &dyn Fn() -> bool,
) -> Result<Box<dyn PageSink + Send>, OutputError> {
    for msg in rx {
        match msg {
            Msg::Chunk(mut c) => {
                for p in &c.pages {
                    if abandoned() {
                        // Dropped unfinished: no output that looks complete.
                        return Err(OutputError::Closed);
                    }
                    let page = c
                        .data
                        .get(p.start..p.start + p.len)
                        .ok_or(OutputError::Closed)?;
                    inner.page(p.cpu, page, p.missed)?;
                }
                for (&cpu, &ts) in &c.quiet {
                    inner.quiet(cpu, ts)?;
                }
                c.data.clear();
                c.pages.clear();
                c.quiet.clear();
                // Never full (room for every chunk); gone only if the reader is.
                let _ = free.try_send(c);
            }
            Msg::TrailingLost(cpu, lost) => inner.trailing_lost(cpu, lost)?,
            Msg::EndCpu(cpu) => inner.end_cpu(cpu)?,
        }
    }
    Ok(inner)
}

// Every method written out: a default body would hide the call from the inner sink
// (crate::tap).
#[deny(clippy::missing_trait_methods)]
impl PageSink for ThreadedSink {
    fn abandon(&mut self) {
        self.stop.abandoned.store(true, Ordering::Relaxed);
        self.tx = None;
    }

    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        self.check()?;
        if !self.cur.pages.is_empty() && self.cur.data.len() + page.len() > CHUNK_BYTES {
            self.send_cur()?;
        }
        if self.cur.data.capacity() == 0 {
            self.cur.data.reserve(CHUNK_BYTES.max(page.len()));
        }
        let start = self.cur.data.len();
        self.cur.data.extend_from_slice(page);
        self.cur.pages.push(PageRef {
            cpu,
            start,
            len: page.len(),
            missed,
        });
        self.since.get_or_insert_with(Instant::now);
        Ok(())
    }

    /// Kept with the chunk being filled (the latest per CPU) and passed on after its
    /// pages: a note may only come late.
    fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
        self.check()?;
        let q = self.cur.quiet.entry(cpu).or_insert(ts);
        *q = (*q).max(ts);
        self.since.get_or_insert_with(Instant::now);
        Ok(())
    }

    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        self.check()?;
        self.send_cur()?;
        self.send(Msg::TrailingLost(cpu, lost))
    }

    fn end_cpu(&mut self, cpu: u32) -> Result<(), OutputError> {
        self.check()?;
        self.send_cur()?;
        self.send(Msg::EndCpu(cpu))
    }

    /// The inner sink was told at [`ThreadedSink::new`]: pages on a thread are live.
    fn set_live(&mut self) {}

    fn idle(&mut self) -> Result<(), OutputError> {
        self.check()?;
        if self.since.is_some_and(|t| t.elapsed() >= FLUSH_AFTER) {
            self.send_cur()?;
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        self.check()?;
        self.send_cur()?;
        self.tx = None;
        match self.worker.take().map(JoinHandle::join) {
            Some(Ok(Ok(inner))) => inner.finish(summary),
            Some(Ok(Err(e))) => Err(e),
            None => Err(OutputError::Closed),
            Some(Err(panic)) => std::panic::resume_unwind(panic),
        }
    }

    fn waits(&self) -> OutputWaits {
        self.waits
    }
}

impl Drop for ThreadedSink {
    fn drop(&mut self) {
        // Unfinished: the thread writes what it has and drops the inner sink unfinished
        // (no output that looks complete); a panic there was a bug: passed on here
        // (unless this thread is unwinding already).
        self.tx = None;
        if let Some(w) = self.worker.take() {
            if let Err(panic) = w.join() {
                if !std::thread::panicking() {
                    std::panic::resume_unwind(panic);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Records what it gets; fails at page `fail_at` if set.
    #[derive(Clone, Default)]
    struct Rec {
        log: Arc<Mutex<Vec<String>>>,
        fail_at: Option<usize>,
    }

    impl PageSink for Rec {
        fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
            let mut log = self.log.lock().unwrap();
            if Some(log.len()) == self.fail_at {
                return Err(OutputError::Meta(crate::MetaError::Cpus(7)));
            }
            log.push(format!("p{cpu}:{}:{}:{missed:?}", page[0], page.len()));
            Ok(())
        }
        fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
            self.log.lock().unwrap().push(format!("t{cpu}:{lost}"));
            Ok(())
        }
        fn finish(self: Box<Self>, _: &RunSummary) -> Result<(), OutputError> {
            self.log.lock().unwrap().push("finish".into());
            Ok(())
        }
    }

    #[test]
    fn pages_arrive_in_order_across_chunks() {
        let rec = Rec::default();
        let mut s = Box::new(ThreadedSink::new(Box::new(rec.clone())).unwrap());
        let mut want = Vec::new();
        // More than MAX_CHUNKS chunks' worth: chunks are reused (back-pressure).
        let n = (MAX_CHUNKS + 8) * (CHUNK_BYTES / 4096);
        for i in 0..n {
            let page = vec![(i % 251) as u8; 4096];
            let missed = match i % 7 {
                3 => Missed::Count(i as u64),
                5 => Missed::Unknown,
                _ => Missed::None,
            };
            s.page((i % 3) as u32, &page, missed).unwrap();
            want.push(format!("p{}:{}:4096:{missed:?}", i % 3, i % 251));
            if i % 1000 == 0 {
                s.idle().unwrap();
            }
        }
        s.trailing_lost(1, 9).unwrap();
        want.push("t1:9".into());
        s.finish(&RunSummary::default()).unwrap();
        want.push("finish".into());
        assert_eq!(*rec.log.lock().unwrap(), want);
    }

    #[test]
    fn idle_hands_over_an_old_partial_chunk() {
        let rec = Rec::default();
        let mut s = ThreadedSink::new(Box::new(rec.clone())).unwrap();
        s.page(0, &[1; 4096], Missed::None).unwrap();
        s.idle().unwrap();
        std::thread::sleep(FLUSH_AFTER + Duration::from_millis(5));
        s.idle().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while rec.log.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "the page never reached the sink");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(rec.log.lock().unwrap()[0], "p0:1:4096:None");
    }

    #[test]
    fn the_first_error_comes_back_once_then_closed() {
        let rec = Rec {
            fail_at: Some(5),
            ..Rec::default()
        };
        let mut s = Box::new(ThreadedSink::new(Box::new(rec.clone())).unwrap());
        let mut errors = Vec::new();
        for _ in 0..(3 * CHUNK_BYTES / 4096) {
            if let Err(e) = s.page(0, &[0; 4096], Missed::None) {
                errors.push(e);
            }
        }
        let end = s.finish(&RunSummary::default());
        if let Err(e) = end {
            errors.push(e);
        }
        assert!(
            matches!(
                errors.first(),
                Some(OutputError::Meta(crate::MetaError::Cpus(7)))
            ),
            "{errors:?}"
        );
        assert!(errors[1..].iter().all(|e| matches!(e, OutputError::Closed)));
        // Never finished: the inner sink was dropped unfinished.
        assert!(!rec.log.lock().unwrap().contains(&"finish".to_string()));
    }

    /// Holds its first page until `gate` opens (or 10 s pass), then takes pages at once.
    struct Gated {
        gate: std::sync::mpsc::Receiver<()>,
        held: bool,
    }

    impl PageSink for Gated {
        fn page(&mut self, _: u32, _: &[u8], _: Missed) -> Result<(), OutputError> {
            if !self.held {
                self.held = true;
                let _ = self.gate.recv_timeout(Duration::from_secs(10));
            }
            Ok(())
        }
        fn finish(self: Box<Self>, _: &RunSummary) -> Result<(), OutputError> {
            Ok(())
        }
    }

    /// The reader's waits for room are counted: none while chunks are free, one when
    /// every chunk is in flight behind a stalled write.
    #[test]
    fn waits_for_room_are_counted() {
        let (open, gate) = std::sync::mpsc::channel();
        let mut s = ThreadedSink::new(Box::new(Gated { gate, held: false })).unwrap();
        // One 1 MiB page per chunk: MAX_CHUNKS pages fill every chunk (the first one
        // stalls in the inner sink), the next one has to wait for a chunk back.
        let page = vec![7u8; CHUNK_BYTES];
        for _ in 0..MAX_CHUNKS {
            s.page(0, &page, Missed::None).unwrap();
        }
        assert_eq!(s.waits(), OutputWaits::default());
        // The stalled write ends 300 ms from now, long after this thread asks for a
        // chunk; the join below propagates a panic of the opener.
        let opener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            open.send(()).unwrap();
        });
        s.page(0, &page, Missed::None).unwrap();
        let w = s.waits();
        assert_eq!(w.count, 1, "{w:?}");
        assert!(w.longest > Duration::ZERO && w.total == w.longest, "{w:?}");
        opener.join().unwrap();
        Box::new(s).finish(&RunSummary::default()).unwrap();
    }
}
