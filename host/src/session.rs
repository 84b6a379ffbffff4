//! The host side of tracing a run: the trace region as shared memory, the reader with
//! its callbacks (host-executed or guest mailbox), and the drain loop that turns pages
//! into text lines or hands them to an output sink.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::{RawMem, SharedMem};
use hyptrace_output::{
    format_drop, format_guest_line, format_window_exceeded, guest_printers, Clock, EventFormat,
    EventPrinter, MergeWindow, Merged, Merger, Missed, PageSink, Released,
};
use hyptrace_reader::{Callbacks, CpuStats, Item, ReadError, RingBuffer};

use crate::vm::TraceRegion;

/// How long the host waits, by default (`--mailbox-timeout-ms`), for the guest writer to
/// answer a mailbox request before it reports a stuck writer. The host cores are shared by every vCPU, the reader and
/// whatever else the machine runs: on a machine loaded several times beyond its cores
/// a runnable vCPU thread can wait for a core for hundreds of milliseconds (500 ms was
/// seen to expire at a load of 10 on 2 cores), so the bound is generous; the reader
/// serves the other CPUs meanwhile and `--duration`/signals are checked between polls.
pub const MAILBOX_TIMEOUT: Duration = Duration::from_secs(5);

/// The trace region of a VM as [`SharedMem`]: atomics and volatile copies on the guest
/// memory, which the guest's vCPUs write concurrently.
#[derive(Debug)]
pub struct GuestTraceMem {
    // Keeps the guest memory mapped for as long as `raw` is used.
    _region: TraceRegion,
    raw: RawMem,
}

impl GuestTraceMem {
    /// Wraps a VM's trace region.
    pub fn new(region: TraceRegion) -> Self {
        let (_, ptr, len) = region.raw_parts();
        // SAFETY: `ptr` is the host mapping of `len` bytes of guest memory that `region`
        // keeps mapped (it holds a clone of the GuestMemoryMmap) for as long as `self`
        // lives; the region starts page-aligned, so 8-byte aligned. The guest accesses
        // it only through its own atomics and stores (another domain), and the host only
        // through this RawMem (atomics and volatile byte copies) — never through Rust
        // references to the bytes.
        let raw = unsafe { RawMem::new(ptr, len) };
        Self {
            _region: region,
            raw,
        }
    }
}

impl SharedMem for GuestTraceMem {
    hyptrace_abi::forward_shared_mem!(self => self.raw);
}

/// The reader over a VM's trace region.
pub type Reader = RingBuffer<Arc<GuestTraceMem>, Box<dyn Callbacks + Send>>;

/// Allocates the rings in the trace region (pack, control blocks, linked pages) and
/// returns the reader, with host-executed (`Direct`) or guest-executed (`Mailbox`)
/// callbacks.
pub fn alloc_reader(
    region: TraceRegion,
    layout: RingGeometry,
    tsc_khz: u64,
    generation: u64,
    mailbox_timeout: Duration,
) -> Result<Reader, ReadError> {
    alloc_reader_wrapped(region, layout, tsc_khz, generation, mailbox_timeout, |cb| {
        cb
    })
}

/// [`alloc_reader`] with the callbacks passed through `wrap` (e.g. to time every swap).
pub fn alloc_reader_wrapped(
    region: TraceRegion,
    layout: RingGeometry,
    tsc_khz: u64,
    generation: u64,
    mailbox_timeout: Duration,
    wrap: impl FnOnce(Box<dyn Callbacks + Send>) -> Box<dyn Callbacks + Send>,
) -> Result<Reader, ReadError> {
    let mem = Arc::new(GuestTraceMem::new(region));
    let cb = wrap(hyptrace_reader::callbacks::for_geometry(
        mem.clone(),
        layout,
        mailbox_timeout,
    ));
    RingBuffer::alloc(mem, layout, cb, tsc_khz, generation)
}

/// Most events one drain round reads from one CPU (text output).
pub const ROUND_MAX_EVENTS: usize = 1 << 16;
/// Most page bytes one drain round hands to the sink from one CPU (page output).
pub const ROUND_MAX_BYTES: usize = 4 << 20;
/// Longest one drain round of one CPU goes on (checked every few items).
pub const ROUND_MAX_TIME: Duration = Duration::from_millis(20);
/// Most events the text merger holds back (all CPUs). Past it, the oldest are printed
/// ahead of the CPU that holds them back, after a marker line, down to half of it.
pub const MERGE_MAX_EVENTS: usize = 1 << 18;
/// Most payload bytes the text merger holds back (all CPUs); as [`MERGE_MAX_EVENTS`].
pub const MERGE_MAX_BYTES: usize = 16 << 20;
/// The text merger's window.
pub const MERGE_WINDOW: MergeWindow = MergeWindow {
    events: MERGE_MAX_EVENTS,
    bytes: MERGE_MAX_BYTES,
};

/// Where the events go.
pub enum Output {
    /// Text lines (`trace-cmd report -t` format), merged across CPUs by time.
    Text {
        /// The destination.
        out: Box<dyn Write>,
        /// Merges the CPUs' streams (events carry their payload length; the bytes wait
        /// in `payloads`, one FIFO per CPU, so no event costs an allocation).
        merger: Merger<usize>,
        /// Payload bytes of the queued events, per CPU, in order.
        payloads: Vec<std::collections::VecDeque<u8>>,
    },
    /// Whole pages into a sink (trace.dat, JSON, text file, raw).
    Pages(Box<dyn PageSink>),
}

impl Output {
    /// Text output to `out`, merging `nr_cpus` CPUs.
    pub fn text(out: Box<dyn Write>, nr_cpus: u32) -> Self {
        Output::Text {
            out,
            merger: Merger::with_window(nr_cpus as usize, MERGE_WINDOW),
            payloads: vec![Default::default(); nr_cpus as usize],
        }
    }
}

/// Per-CPU state of a session.
#[derive(Debug, Default, Clone)]
struct CpuRun {
    /// The final walk has run (or was attempted): nothing more is read.
    ended: bool,
    /// A live read failed: no more polls; the final walk runs once its vCPU stopped.
    failed: bool,
    /// The last drain round stopped at its bound: more may be committed.
    more: bool,
    last_ts: u64,
    pending_lost: u64,
    error: Option<String>,
}

/// Drains a VM's rings while it runs and after it stopped.
///
/// Generic over the reader's memory and callbacks so that it runs over a heap region
/// in tests; the VMM uses the defaults (guest memory, `Direct`/`Mailbox`).
///
/// Bounds (every one independent of what the guest does): a drain round reads at most
/// [`ROUND_MAX_EVENTS`] events or [`ROUND_MAX_BYTES`] of pages of one CPU and lasts at
/// most about [`ROUND_MAX_TIME`]; the text merger holds at most [`MERGE_MAX_EVENTS`]
/// events and [`MERGE_MAX_BYTES`] payload bytes (plus the one event being queued).
pub struct Session<M = Arc<GuestTraceMem>, C = Box<dyn Callbacks + Send>> {
    reader: RingBuffer<M, C>,
    output: Output,
    cpus: Vec<CpuRun>,
    clock: Clock,
    printers: BTreeMap<u16, EventPrinter>,
    cmdlines: BTreeMap<i32, String>,
    line: String,
    lines: u64,
    /// The first output error (reported once; later output is discarded).
    output_error: Option<String>,
    /// `--drain live`: live CPUs are polled; `--drain none`: only final walks.
    live_drain: bool,
}

/// What went wrong while draining a CPU.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The ring is inconsistent or the writer did not answer.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// A page sink failed (writing, or the page or metadata it was given).
    #[error("output: {0}")]
    Sink(#[from] hyptrace_output::OutputError),
    /// Writing the text lines failed.
    #[error("output: {0}")]
    Write(#[source] std::io::Error),
}

impl SessionError {
    /// Whether the output failed (rather than reading a ring).
    pub fn is_output(&self) -> bool {
        matches!(self, Self::Sink(_) | Self::Write(_))
    }
}

impl<M: SharedMem, C: Callbacks> Session<M, C> {
    /// A session over `reader` writing to `output`; timestamps convert with `clock`.
    pub fn new(reader: RingBuffer<M, C>, output: Output, clock: Clock) -> Self {
        let n = reader.nr_cpus();
        let cmdlines = (0..n)
            .map(|c| (hyptrace_abi::events::vcpu_pid(c), format!("vcpu{c}")))
            .collect();
        Self {
            reader,
            output,
            cpus: vec![CpuRun::default(); n as usize],
            clock,
            printers: guest_printers(),
            cmdlines,
            line: String::new(),
            lines: 0,
            output_error: None,
            live_drain: true,
        }
    }

    /// `--drain none` (`false`): [`Session::service`] no longer polls CPUs whose vCPU
    /// runs — nothing is consumed until the vCPU has stopped (flight recorder).
    pub fn set_live_drain(&mut self, live: bool) {
        self.live_drain = live;
    }

    /// Prints events with `formats` (the guest's registered events) instead of the
    /// built-in guest events' formats [`Session::new`] starts with.
    pub fn with_formats(mut self, formats: &[EventFormat]) -> Self {
        self.printers = formats
            .iter()
            .map(|f| (f.id, EventPrinter::new(f.clone())))
            .collect();
        self
    }

    /// The reader.
    pub fn reader(&self) -> &RingBuffer<M, C> {
        &self.reader
    }

    /// A swap for an external consumer (`get_reader` on the control socket): see
    /// [`RingBuffer::swap_external`]. Only with `--drain none` (this session does not
    /// consume while the vCPU runs), never once the CPU's final walk began.
    pub fn swap_external(&mut self, cpu: u32) -> Result<Option<(u32, u64)>, ReadError> {
        match self.cpus.get(cpu as usize) {
            Some(st) if !st.ended && !self.live_drain => self.reader.swap_external(cpu),
            _ => Ok(None),
        }
    }

    /// Stops reading before the CPUs ended (live attach without `--follow`, or
    /// interrupted): marks every CPU finished in the text merger so that the next
    /// [`Session::flush`] releases every line it holds. Nothing is read after it.
    pub fn stop_reading(&mut self) {
        for st in &mut self.cpus {
            st.ended = true;
            st.more = false;
        }
        if let Output::Text { merger, .. } = &mut self.output {
            for c in 0..merger.nr_cpus() {
                merger.finish(c);
            }
        }
    }

    /// Text lines printed so far (events, drop markers and merge-window markers).
    pub fn lines(&self) -> u64 {
        self.lines
    }

    /// Whether `cpu` still has to be read (its final walk has not run yet).
    pub fn is_live(&self, cpu: u32) -> bool {
        self.cpus.get(cpu as usize).is_some_and(|c| !c.ended)
    }

    /// The first error seen on `cpu`, if any.
    pub fn error(&self, cpu: u32) -> Option<&str> {
        self.cpus.get(cpu as usize).and_then(|c| c.error.as_deref())
    }

    /// Whether the last round over a CPU stopped at its bound with more to read: the
    /// caller should come back without waiting.
    pub fn backlog(&self) -> bool {
        self.cpus.iter().any(|c| !c.ended && !c.failed && c.more)
    }

    /// Events (and loss markers) the text merger holds back now, and their payload bytes.
    pub fn queued(&self) -> (usize, usize) {
        match &self.output {
            Output::Text { merger, .. } => (merger.pending(), merger.pending_bytes()),
            Output::Pages(_) => (0, 0),
        }
    }

    /// Times the text merger's cap released events ahead of a CPU that held them back.
    pub fn merge_overflows(&self) -> u64 {
        match &self.output {
            Output::Text { merger, .. } => merger.overflows(),
            Output::Pages(_) => 0,
        }
    }

    /// One poll of a live CPU: one bounded drain round (swapping pages away from the
    /// writer), then a poke (update_footers).
    pub fn poll(&mut self, cpu: u32) -> Result<(), SessionError> {
        match self.cpus.get(cpu as usize) {
            Some(st) if !st.ended && !st.failed => {}
            _ => return Ok(()),
        }
        let before = log::log_enabled!(log::Level::Debug).then(|| self.reader.stats(cpu));
        // Drain first (swaps), then poke: with the mailbox, one request is in flight
        // per CPU at a time, and a page swap matters more than refreshed stats.
        let r = self.drain(cpu).and_then(|more| {
            self.cpus[cpu as usize].more = more;
            if self.reader.request_in_flight(cpu) {
                log::trace!("cpu {cpu}: mailbox request pending, no poke this round");
                Ok(())
            } else {
                self.reader
                    .poke(cpu)
                    .map(|_| ())
                    .map_err(SessionError::from)
            }
        });
        if let Some(b) = before {
            self.log_poll(cpu, &b);
        }
        match r {
            // The guest writer finished (mailbox mode): nothing more to ask it; the rest
            // is read by `end_cpu` once its vCPU has stopped.
            Err(SessionError::Read(ReadError::WriterStopped { .. })) => {
                log::debug!("cpu {cpu}: the guest writer finished; the rest is read read-only");
                self.cpus[cpu as usize].more = false;
                Ok(())
            }
            Err(e @ SessionError::Read(ReadError::MailboxTimeout { .. })) => {
                log::debug!("cpu {cpu}: {e}");
                Err(e)
            }
            r => r,
        }
    }

    /// Logs what one poll of `cpu` did (`before`: its counters before): swaps and
    /// events at trace level; swaps lost to the writer (contended, retried at the next
    /// poll) at debug level.
    fn log_poll(&self, cpu: u32, before: &CpuStats) {
        let now = self.reader.stats(cpu);
        log::trace!(
            "cpu {cpu}: poll: {} swaps, {} events read, {} lost{}",
            now.swaps.saturating_sub(before.swaps),
            now.read.saturating_sub(before.read),
            now.lost.saturating_sub(before.lost),
            if self.cpus[cpu as usize].more {
                " (round bound reached: more to read)"
            } else {
                ""
            }
        );
        let contended = now.contended.saturating_sub(before.contended);
        if contended > 0 {
            log::debug!(
                "cpu {cpu}: {contended} swap(s) lost every retry to the writer (contended; {} so far)",
                now.contended
            );
        }
    }

    /// The writer of `cpu` has stopped (finished, crashed or stopped): switch to the
    /// read-only walk of what is left and read it all (in bounded rounds, printing
    /// between them). Never swaps. Runs once per CPU: later calls return `Ok`. Whatever
    /// fails, the CPU is marked finished in the merger afterwards, so one CPU's failure
    /// never holds back the other CPUs' output; the error is recorded
    /// ([`Session::error`]) and returned.
    pub fn end_cpu(&mut self, cpu: u32) -> Result<(), SessionError> {
        let Some(st) = self.cpus.get_mut(cpu as usize) else {
            return Ok(());
        };
        if st.ended {
            return Ok(());
        }
        st.ended = true;
        st.more = false;
        let mut r = self.final_walk(cpu);
        let trailing = self.reader.take_trailing_loss(cpu);
        let st = &mut self.cpus[cpu as usize];
        let lost = std::mem::take(&mut st.pending_lost).saturating_add(trailing);
        let ts = st.last_ts;
        match &mut self.output {
            Output::Text { merger, .. } => {
                if lost > 0 {
                    merger.push(cpu as usize, ts, Merged::Lost(lost));
                }
                merger.finish(cpu as usize);
            }
            Output::Pages(sink) => {
                if lost > 0 {
                    if let Err(e) = sink.trailing_lost(cpu, lost) {
                        r = r.and(Err(SessionError::Sink(e)));
                    }
                }
            }
        }
        if let Err(e) = &r {
            self.fail_cpu(cpu, e);
        }
        r
    }

    fn final_walk(&mut self, cpu: u32) -> Result<(), SessionError> {
        log::debug!("cpu {cpu}: final read-only walk");
        self.reader.sync_writer_counters(cpu)?;
        self.reader.finalize(cpu)?;
        // Bounded: the walk covers the pages left in the ring, each round consumes at
        // least one item of them or ends the walk.
        while self.drain(cpu)? {
            // Print between rounds (the merger's cap bounds what waits); an output
            // error is kept and reported by the caller's own flush.
            let _ = self.flush();
        }
        Ok(())
    }

    /// Records the first error seen on `cpu` (reported by [`Session::error`]).
    pub fn fail_cpu(&mut self, cpu: u32, e: &SessionError) {
        if let Some(st) = self.cpus.get_mut(cpu as usize) {
            st.error.get_or_insert_with(|| e.to_string());
        }
    }

    /// One round over the CPUs not yet ended: a CPU whose vCPU has stopped
    /// (`vcpu_stopped`) gets the final read-only walk, the others one bounded poll. A
    /// mailbox request that timed out because its vCPU stopped meanwhile is no error:
    /// that CPU gets the final walk instead. A CPU whose live read failed is not polled
    /// again; it is walked once its vCPU has stopped. Returns each CPU's first failure
    /// once (later failures of the same CPU are recorded nowhere else), for the caller
    /// to report.
    pub fn service(&mut self, vcpu_stopped: impl Fn(u32) -> bool) -> Vec<(u32, SessionError)> {
        let mut failed = Vec::new();
        for cpu in 0..self.reader.nr_cpus() {
            let st = &self.cpus[cpu as usize];
            if st.ended {
                continue;
            }
            let had_error = st.error.is_some();
            let r = if vcpu_stopped(cpu) {
                self.end_cpu(cpu)
            } else if st.failed || !self.live_drain {
                continue;
            } else {
                match self.poll(cpu) {
                    Err(SessionError::Read(ReadError::MailboxTimeout { .. }))
                        if vcpu_stopped(cpu) =>
                    {
                        self.end_cpu(cpu)
                    }
                    Err(e) => {
                        self.cpus[cpu as usize].failed = true;
                        self.fail_cpu(cpu, &e);
                        Err(e)
                    }
                    Ok(()) => Ok(()),
                }
            };
            if let Err(e) = r {
                if !had_error {
                    failed.push((cpu, e));
                }
            }
        }
        failed
    }

    /// One bounded round of reading `cpu` into the output: returns whether it stopped
    /// at a bound (more may be there) rather than because nothing more is committed.
    fn drain(&mut self, cpu: u32) -> Result<bool, SessionError> {
        let started = std::time::Instant::now();
        match &mut self.output {
            Output::Text {
                merger, payloads, ..
            } => {
                let st = &mut self.cpus[cpu as usize];
                let fifo = &mut payloads[cpu as usize];
                for n in 0..ROUND_MAX_EVENTS {
                    if merger.is_full() || (n % 256 == 255 && started.elapsed() >= ROUND_MAX_TIME) {
                        return Ok(true);
                    }
                    let Some(item) = self.reader.next_event(cpu)? else {
                        return Ok(false);
                    };
                    match item {
                        Item::Event { ts, payload } => {
                            if st.pending_lost > 0 {
                                merger.push(
                                    cpu as usize,
                                    ts,
                                    Merged::Lost(std::mem::take(&mut st.pending_lost)),
                                );
                            }
                            st.last_ts = ts;
                            fifo.extend(payload);
                            let n = payload.len();
                            merger.push_sized(cpu as usize, ts, Merged::Event(n), n);
                        }
                        Item::Lost(n) => st.pending_lost = st.pending_lost.saturating_add(n),
                    }
                }
                Ok(true)
            }
            Output::Pages(sink) => {
                let mut bytes = 0usize;
                while bytes < ROUND_MAX_BYTES {
                    if bytes > 0 && started.elapsed() >= ROUND_MAX_TIME {
                        return Ok(true);
                    }
                    let Some(page) = self.reader.next_page(cpu)? else {
                        return Ok(false);
                    };
                    bytes = bytes.saturating_add(page.bytes.len().max(1));
                    let missed = (page.missed > 0).then_some(page.missed);
                    sink.page(cpu, page.bytes, missed)?;
                }
                Ok(true)
            }
        }
    }

    /// Prints the merged events that are ready (all of them once every CPU ended). If
    /// the merger holds more than its cap ([`MERGE_MAX_EVENTS`], [`MERGE_MAX_BYTES`]) —
    /// a CPU that neither writes nor ends holds the others back — it prints a marker
    /// line naming that CPU and the oldest events down to half the cap: order across
    /// CPUs is no longer exact from there. Returns the first output error once; after
    /// it, lines are discarded.
    pub fn flush(&mut self) -> Result<(), SessionError> {
        let Output::Text {
            out,
            merger,
            payloads,
        } = &mut self.output
        else {
            return Ok(());
        };
        let mut p = LinePrinter {
            out: out.as_mut(),
            payloads,
            clock: &self.clock,
            printers: &self.printers,
            cmdlines: &self.cmdlines,
            line: &mut self.line,
            lines: &mut self.lines,
            discard: self.output_error.is_some(),
            err: None,
            payload: Vec::new(),
        };
        merger.release(|r| match r {
            Released::Item { cpu, ts, item } => p.item(cpu, ts, item),
            Released::WindowExceeded { held, lagging } => {
                let mut line = String::new();
                format_window_exceeded(&mut line, held, lagging);
                line.push('\n');
                p.raw(&line);
            }
        });
        if let Some(e) = p.err.take() {
            self.output_error = Some(e.to_string());
            return Err(SessionError::Write(e));
        }
        Ok(())
    }

    /// Per-CPU statistics (reader's view, with the writer's counters once it stopped).
    pub fn stats(&self, cpu: u32) -> CpuStats {
        self.reader.stats(cpu)
    }

    /// Whether the writer of `cpu` said it finished (rather than being stopped or
    /// crashing in the middle of a write).
    pub fn writer_finished(&self, cpu: u32) -> bool {
        self.reader.writer_finished(cpu)
    }

    /// Events the writer of `cpu` took in (committed or dropped), from its control block.
    ///
    /// The writer publishes an event's `commit` before it stores `entries`: a vCPU
    /// stopped (`--duration`, Ctrl-C) or crashed between the two leaves the control
    /// block one event behind its pages. Once such a CPU has been read to the end, the
    /// one committed event the reader found beyond `entries + dropped` counts as written.
    pub fn writer_index(&self, cpu: u32) -> u64 {
        let index = self.reader.writer_index(cpu);
        if !self.reader.writer_finished(cpu) && !self.is_live(cpu) {
            let st = self.reader.stats(cpu);
            let seen = st.read.saturating_add(st.lost);
            if seen == index.saturating_add(1) {
                return seen;
            }
        }
        index
    }

    /// Finishes the output: flushes text, or closes the sink with the summary.
    pub fn finish(self, summary: &hyptrace_output::RunSummary) -> Result<u64, SessionError> {
        match self.output {
            Output::Text { mut out, .. } => {
                // After a reported output error, the same error again is no news.
                if let Err(e) = out.flush() {
                    if self.output_error.is_none() {
                        return Err(SessionError::Write(e));
                    }
                }
            }
            Output::Pages(sink) => sink.finish(summary)?,
        }
        Ok(self.lines)
    }
}

/// Formats and writes the text lines of one [`Session::flush`].
struct LinePrinter<'a> {
    out: &'a mut dyn Write,
    payloads: &'a mut [std::collections::VecDeque<u8>],
    clock: &'a Clock,
    printers: &'a BTreeMap<u16, EventPrinter>,
    cmdlines: &'a BTreeMap<i32, String>,
    line: &'a mut String,
    lines: &'a mut u64,
    /// An earlier flush failed: count lines, write nothing.
    discard: bool,
    err: Option<std::io::Error>,
    payload: Vec<u8>,
}

impl LinePrinter<'_> {
    fn item(&mut self, cpu: usize, ts: u64, item: Merged<usize>) {
        self.line.clear();
        match item {
            Merged::Event(len) => {
                let fifo = &mut self.payloads[cpu];
                let len = len.min(fifo.len());
                self.payload.clear();
                self.payload.extend(fifo.drain(..len));
                format_guest_line(
                    self.line,
                    self.printers,
                    self.cmdlines,
                    cpu as u32,
                    self.clock.to_ns(ts),
                    &self.payload,
                )
            }
            Merged::Lost(n) => format_drop(self.line, cpu as u32, Missed::Count(n)),
        }
        self.line.push('\n');
        let line = std::mem::take(self.line);
        self.raw(&line);
        *self.line = line;
    }

    fn raw(&mut self, text: &str) {
        *self.lines += 1;
        if !self.discard && self.err.is_none() {
            if let Err(e) = self.out.write_all(text.as_bytes()) {
                self.err = Some(e);
            }
        }
    }
}
