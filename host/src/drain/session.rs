//! The host side of tracing a run: the trace region as shared memory, the reader with
//! its callbacks (host-executed or guest mailbox), and the drain loop that turns pages
//! into text lines or hands them to an output sink.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyptrace_abi::SharedMem;
use hyptrace_embed::{CpuAccount, CpuReads};
use hyptrace_output::{
    guest_printers, Clock, EventFormat, EventPrinter, MergeWindow, Merger, PageSink,
};
use hyptrace_reader::postmortem::Position;
use hyptrace_reader::{Callbacks, CpuStats, ReadError, RingBuffer};

use crate::drain::outbox::Outbox;
use crate::vmm::guest_mem::GuestTraceMem;

use drain::reader_start;
use host::{HostCpu, HostTraceCpus};

mod drain;
mod host;
mod pacing;
mod print;
mod subscribe;

pub use host::HostTraceStats;

/// How long the host waits, by default (`--mailbox-timeout-ms`), for the guest writer to
/// answer a mailbox request before it reports a stuck writer. The host cores are shared by every vCPU, the reader and
/// whatever else the machine runs: on a machine loaded several times beyond its cores
/// a runnable vCPU thread can wait for a core for hundreds of milliseconds (500 ms was
/// seen to expire at a load of 10 on 2 cores), so the bound is generous; the reader
/// serves the other CPUs meanwhile and `--duration`/signals are checked between polls.
pub const MAILBOX_TIMEOUT: Duration = Duration::from_secs(5);

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

/// Shortest wait of the adaptive drain loop between two rounds ([`Session::next_wait`]):
/// while a writer outpaces the reader the loop drains "continuously", but still sleeps
/// this long between rounds, so that a reader thread with a real-time policy never
/// takes a core from the vCPUs for good (a vCPU preempted by the reader gets its core
/// back; with `--swap guest` it is the one that answers the reader's requests).
pub const MIN_POLL: Duration = Duration::from_micros(20);
/// Wait of the drain loop while a mailbox request (`--swap guest`) is in flight: the
/// writer answers at its next event or idle check once its vCPU runs, so the answer is
/// due within microseconds; the reader sleeps (the vCPU may need its core) and checks.
pub const REQUEST_POLL: Duration = Duration::from_micros(50);
/// Fraction of the time the ring would take to fill at the writer's recent rate that
/// the loop waits at most: it polls this many times before the ring could fill.
pub const POLLS_PER_FILL: u32 = 4;

/// The writing rate (bytes/s) [`Session::next_wait`] assumes at the start, before it
/// measured one: 1 GB/s, a quarter of a 1 MiB ring's fill time is ~260 µs; halved every
/// [`RATE_HALF_LIFE`] while nothing is written, the wait reaches the default `--poll-ms`
/// within about 100 ms.
pub const START_RATE: f64 = 1e9;
/// How fast [`Session::next_wait`] forgets a writer's rate while it writes less: the
/// estimate halves every this long (it rises at once). Long against a vCPU's absence
/// from its core (milliseconds), short against a human's idea of idle.
pub const RATE_HALF_LIFE: Duration = Duration::from_millis(20);

/// Shortest time between two pokes (`update_footers`: the footer stats) of one CPU by
/// [`Session::poll`].
pub const POKE_EVERY: Duration = Duration::from_millis(1);

/// Where the events go.
pub enum Output {
    /// Text lines (`trace-cmd report -t` format), merged across CPUs by time.
    Text {
        /// The destination.
        out: Box<dyn Write + Send>,
        /// Merges the CPUs' streams (events carry their payload length; the bytes wait
        /// in `payloads`, one FIFO per CPU, so no event costs an allocation).
        merger: Merger<usize>,
        /// Payload bytes of the queued events, per CPU, in order.
        payloads: Vec<std::collections::VecDeque<u8>>,
    },
    /// Whole pages into a sink (trace.dat, JSON, text file, raw).
    Pages(Box<dyn PageSink + Send>),
}

impl Output {
    /// Text output to `out`, merging `nr_cpus` CPUs.
    pub fn text(out: Box<dyn Write + Send>, nr_cpus: u32) -> Self {
        Output::Text {
            out,
            merger: Merger::with_window(nr_cpus as usize, MERGE_WINDOW),
            payloads: vec![Default::default(); nr_cpus as usize],
        }
    }
}

/// Per-CPU state of a session's policy (pacing, text merging, losses waiting for the
/// output); where its reading stands is the engine's ([`CpuReads`]).
#[derive(Debug, Default, Clone)]
struct CpuRun {
    /// The last drain round stopped at its bound: more may be committed.
    more: bool,
    /// The time (ns, as the text merger holds it) of the last event read: where a loss
    /// found after it is merged.
    last_ns: u64,
    pending_lost: u64,
    /// The writer's byte counter (control block) at the last [`Session::next_wait`],
    /// when, and the rate (bytes/s) it moved at: what the adaptive wait learns from.
    fill: Option<(Instant, u64)>,
    rate: f64,
    /// When the last poke (update_footers) was asked for.
    poked: Option<Instant>,
    /// Since when a mailbox request of this CPU is in flight, as [`Session::next_wait`]
    /// saw it.
    requested: Option<Instant>,
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
    /// The engine's per-CPU read state (live, failed with its first error, walking,
    /// ended): the one state machine `hyptrace_embed::Tracer` runs too.
    reads: CpuReads<String>,
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
    /// `--host-events`: the VMM's own ring, read as CPU `nr_cpus` of the output.
    host: Option<HostCpu>,
    /// `--host-trace`: the host kernel's CPUs, after the guest's (and the VMM's).
    host_trace: Option<HostTraceCpus>,
    /// Failures of [`Session::relieve`] (the standby drainer), for the next
    /// [`Session::service`] to return: the drain loop reports them as its own.
    deferred: Vec<(u32, SessionError)>,
    /// The time the fastest writer's whole ring takes to fill at its recent rate (as
    /// of the last [`Session::next_wait`]); `None` while no writer writes.
    fill_time: Option<Duration>,
    /// An output error [`Session::relieve`] met, for the next [`Session::flush`] to
    /// return (the first output error is returned once).
    deferred_output: Option<SessionError>,
    /// P2: per CPU, the index below which every event is in the output (text: written;
    /// a page sink: only once it is finished).
    printed: Vec<u64>,
    /// P2: where positions are recorded, before and after every flush.
    recorder: Option<Recorder>,
    /// C1: what the reader read for a subscriber and nobody took yet; the own output
    /// takes its front first once nobody subscribes.
    outbox: Outbox,
    /// A subscriber holds the claim (C1): reading goes into `outbox`, in partial pieces
    /// (`Some(true)`: the writer's page as far as it is committed) or whole pages.
    subscriber: Option<bool>,
    /// A page-sized buffer for the pieces the own output takes from `outbox`.
    scratch: Vec<u8>,
}

/// Records a CPU's position (P2): the trace memory file's `record`.
pub type Recorder = Arc<dyn Fn(u32, Position) + Send + Sync>;

/// What went wrong while draining a CPU.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The ring is inconsistent or the writer did not answer.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// A page sink failed (writing, or the page or metadata it was given).
    #[error("output")]
    Sink(#[from] hyptrace_output::OutputError),
    /// Writing the text lines failed.
    #[error("output")]
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
        let printed = (0..n).map(|c| reader_start(&reader, c)).collect();
        Self {
            reads: CpuReads::new(n),
            reader,
            output,
            // Start as if every writer wrote fast: the first waits are short and double
            // per idle round up to `--poll-ms`, so a guest that writes at once is
            // drained from its first page, not after a whole idle period.
            cpus: vec![
                CpuRun {
                    rate: START_RATE,
                    ..CpuRun::default()
                };
                n as usize
            ],
            clock,
            printers: guest_printers(),
            cmdlines,
            line: String::new(),
            lines: 0,
            output_error: None,
            live_drain: true,
            host: None,
            host_trace: None,
            deferred: Vec::new(),
            fill_time: None,
            deferred_output: None,
            printed,
            recorder: None,
            outbox: Outbox::new(n),
            subscriber: None,
            scratch: Vec::new(),
        }
    }

    /// Has every flush record each CPU's position with `r` before it prints (the
    /// events consumed may be printed from now on) and after (they are), P2. Records
    /// the starting positions at once: a VMM killed in its first drain round, before
    /// any other record, has consumed pages (they went back to the ring) and printed
    /// nothing; without a record the walk would start at the reader page and skip them
    /// uncounted.
    pub fn with_recorder(mut self, r: Recorder) -> Self {
        self.recorder = Some(r);
        self.record_positions();
        self
    }

    /// Where the reading of `cpu` stands, with what is in the output (P1, P2).
    pub fn position(&self, cpu: u32) -> Option<Position> {
        let mut p = self.reader.position(cpu)?;
        p.printed = self
            .printed
            .get(cpu as usize)
            .copied()
            .unwrap_or(0)
            .min(p.expected);
        Some(p)
    }

    /// Records every CPU's position (P2), if a recorder is set.
    pub fn record_positions(&self) {
        if let Some(r) = &self.recorder {
            for c in 0..self.reader.nr_cpus() {
                if let Some(p) = self.position(c) {
                    r(c, p);
                }
            }
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

    /// Marks `cpu` ended: nothing more is read or output of it; `false` if there is no
    /// such CPU or it ended already.
    fn mark_ended(&mut self, cpu: u32) -> bool {
        let ended = self.reads.end(cpu);
        if ended {
            self.cpus[cpu as usize].more = false;
        }
        ended
    }

    /// Text lines printed so far (events, drop markers and merge-window markers).
    pub fn lines(&self) -> u64 {
        self.lines
    }

    /// Whether `cpu` still has to be read (its final walk has not run yet).
    pub fn is_live(&self, cpu: u32) -> bool {
        self.reads.is_live(cpu)
    }

    /// The first error seen on `cpu`, if any.
    pub fn error(&self, cpu: u32) -> Option<&str> {
        self.reads.error(cpu).map(String::as_str)
    }

    /// Per-CPU statistics (reader's view, with the writer's counters once it stopped).
    pub fn stats(&self, cpu: u32) -> CpuStats {
        self.reader.stats(cpu)
    }

    /// Events the writer of `cpu` took in (committed or dropped), from its control block.
    ///
    /// The writer publishes an event's `commit` before it stores `entries`: a vCPU
    /// stopped (`--duration`, Ctrl-C) or crashed between the two leaves the control
    /// block one event behind its pages. Once such a CPU has been read to the end, the
    /// one committed event the reader found beyond `entries + dropped` counts as written.
    pub fn writer_index(&self, cpu: u32) -> u64 {
        self.reads.written(&self.reader, cpu)
    }

    /// The account of `cpu` as it stands (R1, R3: the engine's, as `Tracer` gives it).
    pub fn account(&mut self, cpu: u32) -> CpuAccount<String> {
        self.reads.account(&mut self.reader, cpu)
    }

    /// Finishes the output: flushes text, or closes the sink with the summary.
    pub fn finish(mut self, summary: &hyptrace_output::RunSummary) -> Result<u64, SessionError> {
        // P2: once the output is finished, everything consumed is in it.
        let done: Vec<u64> = (0..self.reader.nr_cpus())
            .map(|c| self.reader.position(c).map_or(0, |p| p.expected))
            .collect();
        let recorder = self.recorder.take();
        let record = |printed: &[u64], reader: &RingBuffer<M, C>| {
            if let Some(r) = &recorder {
                for (c, &e) in (0u32..).zip(printed) {
                    if let Some(mut p) = reader.position(c) {
                        p.printed = e.min(p.expected);
                        r(c, p);
                    }
                }
            }
        };
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
        if self.output_error.is_none() {
            record(&done, &self.reader);
        }
        Ok(self.lines)
    }
}
