//! The run pipeline: a checked [`Plan`] → a booted VM → a [`Session`] draining its
//! rings while the vCPUs run (poll loop, stop policy) and after (final walks) → a
//! [`RunReport`]. `run`, `record` and `bench` use it; the CLI only parses, checks and
//! reports.
//!
//! Stop policy: the first signal (`Interrupts`), `--duration`, a crashed vCPU, a closed
//! stdout or a failure stops the vCPUs; everything committed is still read (R1 holds
//! at the end). A second signal aborts: [`RunError::Aborted`], the output is dropped
//! unfinished (its temporary files are removed).
//!
//! ```no_run
//! use clap::Parser;
//! use hyptrace_host::cli::{Cli, Command};
//! use hyptrace_host::plan::Plan;
//! use hyptrace_host::run::{Run, Target};
//!
//! let Command::Run(args) = Cli::parse_from(["hyptrace", "run", "--events", "10"]).command
//! else {
//!     unreachable!()
//! };
//! let report = Run::new(Plan::new(&args)?, Target::Stdout).execute()?;
//! eprint!("{report}"); // the summary, as `hyptrace run` prints it
//! let json = report.stats_json(report.exit_code()); // what `--stats` writes
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyptrace_abi::layout::RingGeometry;
use hyptrace_output::{
    Clock, JsonSink, OutputError, OutputTarget, PageSink, RawSink, TextSink, TraceDatSink,
    TraceDatVersion, TraceMeta,
};
use hyptrace_reader::{Callbacks, ReadError};

use crate::cli::FormatArg;
use crate::plan::Plan;
use crate::report::{CpuReport, Destination, Failures, GuestView, RunReport, Stop, Timing};
use crate::session::{
    alloc_reader_wrapped, thread_cpu_time, Output, ReaderPriority, Session, MIN_POLL,
};
use crate::signals::Interrupts;
use crate::vcpu::VcpuOutcome;
use crate::vm::{RunningVm, Vm};

/// `eprintln!` that never panics: stderr may be a closed pipe (`2>&1 | head`).
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Where a run sends its events.
pub enum Target {
    /// Text lines on stdout (`run`).
    Stdout,
    /// A page sink of the caller's (`bench`: counting or timing sinks).
    Sink(Box<dyn PageSink>),
    /// A page sink of the caller's made once the VM's clock is known (`bench`: counting
    /// sinks around a file sink).
    MakeSink(MakeSink),
    /// A checked file in a format (`record`).
    File {
        /// The destination, checked before the VM starts.
        target: OutputTarget,
        /// The path as given (for messages).
        path: PathBuf,
        /// The format.
        format: FormatArg,
    },
}

/// Why a run could not start, or was aborted. Failures once the vCPUs run are part of
/// the [`RunReport`] instead.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Creating or starting the VM failed.
    #[error(transparent)]
    Vm(#[from] crate::Error),
    /// The guest TSC frequency gives no clock.
    #[error("guest clock ({tsc_khz} kHz): {source}")]
    Clock {
        /// The frequency.
        tsc_khz: u64,
        /// Why.
        #[source]
        source: OutputError,
    },
    /// The output file could not be opened.
    #[error("cannot write {path}: {source}", path = .path.display())]
    Sink {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: OutputError,
    },
    /// A [`Target::MakeSink`] sink could not be made.
    #[error(transparent)]
    MakeSink(OutputError),
    /// The rings could not be set up in the trace region.
    #[error("trace buffers: {0}")]
    TraceBuffers(#[source] ReadError),
    /// A second Ctrl-C / SIGTERM: nothing was written.
    #[error("aborted: no output written")]
    Aborted,
}

impl RunError {
    /// Whether the user's input or environment is at fault (exit 2) rather than a
    /// failure at run time (exit 1).
    pub fn is_input_error(&self) -> bool {
        match self {
            Self::Vm(e) => e.is_input_error(),
            Self::Sink { .. } => true,
            _ => false,
        }
    }
}

/// Makes a page sink for a run's trace metadata (page size, CPUs, the guest clock).
pub type MakeSink = Box<dyn FnOnce(TraceMeta) -> Result<Box<dyn PageSink>, OutputError>>;

/// Wraps the reader's callbacks (e.g. to time every swap).
pub type WrapCallbacks = Box<dyn FnOnce(Box<dyn Callbacks + Send>) -> Box<dyn Callbacks + Send>>;

/// A run: a checked plan, where its events go, and the signals that stop it.
pub struct Run<'a> {
    plan: Plan,
    target: Target,
    interrupts: Option<&'a Interrupts>,
    wrap: Option<WrapCallbacks>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stdout => f.write_str("Stdout"),
            Self::Sink(_) => f.write_str("Sink"),
            Self::MakeSink(_) => f.write_str("MakeSink"),
            Self::File { path, format, .. } => f
                .debug_struct("File")
                .field("path", path)
                .field("format", format)
                .finish_non_exhaustive(),
        }
    }
}

impl std::fmt::Debug for Run<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run")
            .field("plan", &self.plan)
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl<'a> Run<'a> {
    /// A run of `plan` into `target`. Without [`Run::interrupts`] no signal stops it.
    pub fn new(plan: Plan, target: Target) -> Self {
        Self {
            plan,
            target,
            interrupts: None,
            wrap: None,
        }
    }

    /// Signals stop the run (a first one) or abort it (a second one).
    pub fn interrupts(mut self, interrupts: &'a Interrupts) -> Self {
        self.interrupts = Some(interrupts);
        self
    }

    /// The reader's callbacks (`Direct` or `Mailbox`) go through `wrap`.
    pub fn wrap_callbacks(mut self, wrap: WrapCallbacks) -> Self {
        self.wrap = Some(wrap);
        self
    }

    /// Boots the VM, drains the rings while it runs and after, and reports.
    pub fn execute(self) -> Result<RunReport, RunError> {
        let Run {
            plan,
            target,
            interrupts,
            wrap,
        } = self;
        let nr = plan.cfg.vcpus;
        log::debug!(
            "plan: {nr} vCPUs, {} MiB guest memory, trace region {} bytes ({} pages of {} bytes per vCPU, mode {:?}, guest swap {})",
            plan.cfg.mem_bytes >> 20,
            plan.ring.region_size,
            plan.ring.pages_per_cpu,
            plan.ring.page_size,
            plan.ring.mode,
            plan.ring.guest_swap
        );
        let created_tsc = crate::vm::host_tsc();
        let vm = Vm::new(plan.cfg)?;
        let guest = GuestView {
            memory: vm.memory().clone(),
            map: vm.layout().clone(),
        };
        let tsc_khz = vm.tsc_khz();
        let tsc_offset = vm.tsc_offset();
        let clock =
            Clock::guest_tsc(tsc_khz).map_err(|source| RunError::Clock { tsc_khz, source })?;
        let stdout = Arc::new(StdoutState::default());
        let (output, target) = open_output(target, &plan.ring, nr, &clock, &stdout)?;
        let generation = crate::vm::host_tsc();
        let wrap = wrap.unwrap_or_else(|| Box::new(|cb| cb));
        let reader = alloc_reader_wrapped(
            vm.trace_region(),
            plan.ring,
            tsc_khz,
            generation,
            plan.mailbox_timeout,
            wrap,
        )
        .map_err(RunError::TraceBuffers)?;
        log::debug!(
            "rings allocated in the trace region (generation {generation:#x}); {} swaps",
            if plan.ring.guest_swap {
                "the guest runs the"
            } else {
                "the host runs the"
            }
        );
        let running = vm.start(&plan.params)?;
        log::info!("started {nr} vCPUs ({tsc_khz} kHz TSC)");
        // Progress when the events are not on the terminal (a caller's sink: none).
        let heartbeat = match target {
            Shown::Stdout => !std::io::stdout().is_terminal(),
            Shown::File { .. } => true,
            Shown::Sink => false,
        };
        let mut live = Live {
            deadline: plan.duration.map(|d| running.started_at() + d),
            running,
            session: Session::new(reader, output, clock),
            stdout,
            interrupts,
            heartbeat: Heartbeat::new(heartbeat),
            stop: None,
            failures: Failures::default(),
            nr,
        };
        let (aborted, reader_cpu) = live.poll_loop(plan.poll);
        let timing = Timing {
            created_tsc,
            tsc_khz,
            start_tsc: live.running.start_tsc(),
            tsc_offset,
            wall: live.running.started_at().elapsed(),
            reader_cpu,
        };
        let Live {
            running,
            session,
            stdout,
            stop,
            failures,
            ..
        } = live;
        let outcomes = running.wait();
        if aborted {
            // Dropping the session drops the sink: its temporary files go.
            return Err(RunError::Aborted);
        }
        let (cpus, failures) = finish_session(session, &outcomes, failures, interrupts)?;
        let destination = match target {
            Shown::Stdout => Destination::Stdout {
                lines: stdout.lines.load(Ordering::Relaxed),
            },
            Shown::File { path, format } => Destination::File { path, format },
            Shown::Sink => Destination::Sink,
        };
        Ok(RunReport {
            outcomes,
            cpus,
            timing,
            stop,
            failures,
            destination,
            echo: plan.echo,
            mode: plan.mode,
            guest: Some(guest),
        })
    }
}

/// What the report says of where the events went.
enum Shown {
    Stdout,
    File { path: PathBuf, format: FormatArg },
    Sink,
}

/// The output of a run: text lines merged on stdout, or a page sink.
fn open_output(
    target: Target,
    ring: &RingGeometry,
    nr: u32,
    clock: &Clock,
    stdout: &Arc<StdoutState>,
) -> Result<(Output, Shown), RunError> {
    match target {
        Target::Sink(sink) => Ok((Output::Pages(sink), Shown::Sink)),
        Target::MakeSink(make) => {
            let meta = TraceMeta::guest(ring.page_size, nr, clock.clone());
            let sink = make(meta).map_err(RunError::MakeSink)?;
            Ok((Output::Pages(sink), Shown::Sink))
        }
        Target::Stdout => Ok((
            Output::text(
                Box::new(std::io::BufWriter::with_capacity(
                    1 << 16,
                    QuietStdout {
                        out: std::io::stdout(),
                        state: Arc::clone(stdout),
                    },
                )),
                nr,
            ),
            Shown::Stdout,
        )),
        Target::File {
            target,
            path,
            format,
        } => {
            let meta = TraceMeta::guest(ring.page_size, nr, clock.clone());
            match make_sink(&target, format, meta) {
                Ok(sink) => Ok((Output::Pages(sink), Shown::File { path, format })),
                Err(source) => Err(RunError::Sink { path, source }),
            }
        }
    }
}

/// The page sink of `format` on `target`.
fn make_sink(
    target: &OutputTarget,
    format: FormatArg,
    meta: TraceMeta,
) -> Result<Box<dyn PageSink>, OutputError> {
    Ok(match format {
        FormatArg::Dat => Box::new(TraceDatSink::open(target, meta, TraceDatVersion::V7)?),
        FormatArg::Dat6 => Box::new(TraceDatSink::open(target, meta, TraceDatVersion::V6)?),
        FormatArg::Json => Box::new(JsonSink::open(target, meta)?),
        FormatArg::Text => Box::new(TextSink::open(target, meta)?),
        FormatArg::Raw => Box::new(RawSink::open(target, meta)?),
    })
}

/// Every vCPU has stopped: the final read-only walks, the per-CPU accounting, the
/// output finished. A second signal meanwhile aborts.
fn finish_session(
    mut session: Session,
    outcomes: &[VcpuOutcome],
    mut failures: Failures,
    interrupts: Option<&Interrupts>,
) -> Result<(Vec<CpuReport>, Failures), RunError> {
    let nr = session.reader().nr_cpus();
    for cpu in 0..nr {
        if let Err(e) = session.end_cpu(cpu) {
            log::debug!("cpu {cpu}: final walk failed: {e}");
            session.fail_cpu(cpu, &e);
            failures.session(Some(cpu), &e);
        }
    }
    if let Err(e) = session.flush() {
        failures.session(None, &e);
    }
    if interrupts.is_some_and(Interrupts::aborted) {
        return Err(RunError::Aborted);
    }
    let cpus: Vec<CpuReport> = (0..nr)
        .map(|cpu| {
            let (attempted, skipped) = match outcomes.get(cpu as usize) {
                Some(VcpuOutcome::Finished(st)) => (Some(st.attempted), Some(st.skipped)),
                _ => (None, None),
            };
            CpuReport {
                finished: session.writer_finished(cpu),
                attempted,
                skipped,
                written: session.writer_index(cpu),
                stats: session.stats(cpu),
                error: session.error(cpu).map(str::to_string),
            }
        })
        .collect();
    if let Err(e) = session.finish(&sink_summary(&cpus)) {
        failures.session(None, &e);
    }
    Ok((cpus, failures))
}

/// The per-CPU statistics a page sink writes at its end (trace.dat's stat options).
fn sink_summary(cpus: &[CpuReport]) -> hyptrace_output::RunSummary {
    hyptrace_output::RunSummary {
        cpus: cpus
            .iter()
            .map(|r| hyptrace_output::KernelCpuStat {
                entries: r
                    .written
                    .saturating_sub(r.stats.read.saturating_add(r.stats.lost)),
                overrun: r.stats.overrun,
                commit_overrun: 0,
                bytes: r.stats.bytes,
                oldest_event_ts: 0,
                now_ts: 0,
                dropped_events: r.stats.dropped,
                read_events: r.stats.read,
            })
            .collect(),
    }
}

/// A run while its vCPUs run: the poll loop and the stop policy.
struct Live<'a> {
    running: RunningVm,
    session: Session,
    stdout: Arc<StdoutState>,
    interrupts: Option<&'a Interrupts>,
    heartbeat: Option<Heartbeat>,
    deadline: Option<Instant>,
    stop: Option<Stop>,
    failures: Failures,
    nr: u32,
}

impl Live<'_> {
    /// Polls every `poll` until every vCPU has stopped and been read; returns whether a
    /// second signal aborted the run.
    ///
    /// Adaptive: the wait between rounds is [`Session::next_wait`] (`poll` while the
    /// writers are idle, down to continuous draining while one outpaces the reader), and
    /// the thread runs with a scheduling advantage ([`ReaderPriority`]) for the loop's
    /// length. Returns also the CPU time the loop's thread used.
    fn poll_loop(&mut self, poll: Duration) -> (bool, Duration) {
        let mut priority = ReaderPriority::raise();
        // Rounds in a row that found every writer idle: after IDLE_ROUNDS the boost is
        // given back (cheaper wake-ups) until a writer writes again.
        const IDLE_ROUNDS: u32 = 16;
        let mut idle_rounds = 0u32;
        let cpu0 = thread_cpu_time();
        let mut rounds = 0u64;
        let aborted = loop {
            rounds += 1;
            let wait = self.session.next_wait(poll);
            idle_rounds = if wait >= poll {
                idle_rounds.saturating_add(1)
            } else {
                0
            };
            priority.set_active(idle_rounds < IDLE_ROUNDS);
            let all_done = self.running.wait_timeout(wait);
            if self.interrupts.is_some_and(Interrupts::aborted) {
                log::info!("aborted by a second signal");
                self.running.stop();
                break true;
            }
            self.check_stop();
            self.service();
            if let Some(h) = &mut self.heartbeat {
                h.tick(&self.session, self.nr, self.running.started_at());
            }
            if all_done && (0..self.nr).all(|c| !self.session.is_live(c)) {
                break false;
            }
            if all_done {
                // Every vCPU said it is done but a thread has not exited yet (its CPU is
                // read once it has): wait_timeout no longer sleeps, so sleep here — a
                // real-time reader spinning would keep that thread off its core.
                std::thread::sleep(MIN_POLL);
            }
        };
        if let Some(h) = &mut self.heartbeat {
            h.end();
        }
        let used = thread_cpu_time().saturating_sub(cpu0);
        drop(priority);
        let wall = self.running.started_at().elapsed();
        log::debug!(
            "reader thread: {rounds} rounds, {:.1} ms CPU in {:.1} ms ({:.2} % of a core)",
            used.as_secs_f64() * 1e3,
            wall.as_secs_f64() * 1e3,
            100.0 * used.as_secs_f64() / wall.as_secs_f64().max(1e-9)
        );
        (aborted, used)
    }

    /// Stops the vCPUs for the first reason that came up, once.
    fn stop_for(&mut self, why: Stop) {
        if self.stop.is_none() {
            log::info!("stopping the vCPUs: {why}");
            self.stop = Some(why);
            self.running.stop();
        }
    }

    /// A signal, `--duration`, a crash or a closed stdout stops the run.
    fn check_stop(&mut self) {
        if self.stop.is_some() {
            return;
        }
        let signal = self.interrupts.filter(|i| i.stop_requested());
        let why = if let Some(i) = signal {
            Some(Stop::Signal(i.signal_name()))
        } else if self.deadline.is_some_and(|d| Instant::now() >= d) {
            Some(Stop::Duration)
        } else if self.running.any_crashed() {
            Some(Stop::Crash)
        } else if self.stdout.closed.load(Ordering::Relaxed) {
            Some(Stop::StdoutClosed)
        } else {
            None
        };
        if let Some(why) = why {
            self.stop_for(why);
        }
    }

    /// One round over the CPUs and a flush of the output; a failure stops the run.
    fn service(&mut self) {
        let running = &self.running;
        for (cpu, e) in self.session.service(|c| running.vcpu_finished(c)) {
            log::debug!("cpu {cpu}: {e}");
            self.failures.session(Some(cpu), &e);
            self.stop_for(Stop::Failed(if e.is_output() {
                "output failed".into()
            } else {
                format!("reading vcpu {cpu} failed")
            }));
        }
        if let Err(e) = self.session.flush() {
            self.failures.session(None, &e);
            self.stop_for(Stop::Failed("output failed".into()));
        }
    }
}

/// Stdout for `run`: a reader that went away (`| head`) ends the run quietly. After
/// the first EPIPE every write is accepted and discarded, so the run keeps reading
/// (the accounting stays exact) while it stops; `closed` tells the run loop. Counts the
/// lines that did reach stdout.
#[derive(Debug, Default)]
struct StdoutState {
    closed: AtomicBool,
    lines: AtomicU64,
}

struct QuietStdout {
    out: std::io::Stdout,
    state: Arc<StdoutState>,
}

impl Write for QuietStdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.state.closed.load(Ordering::Relaxed) {
            return Ok(buf.len());
        }
        match self.out.write(buf) {
            Ok(n) => {
                let nl = buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
                self.state.lines.fetch_add(nl, Ordering::Relaxed);
                Ok(n)
            }
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                log::debug!("stdout closed by its reader");
                self.state.closed.store(true, Ordering::Relaxed);
                Ok(buf.len())
            }
            Err(e) => Err(e),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.state.closed.load(Ordering::Relaxed) {
            return Ok(());
        }
        match self.out.flush() {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                self.state.closed.store(true, Ordering::Relaxed);
                Ok(())
            }
            r => r,
        }
    }
}

/// Progress of a run whose events are not on the terminal (`record`, or `run` with
/// stdout redirected): on a terminal stderr a status line redrawn every 0.5 s, else
/// one line every 5 s — a long, otherwise silent recording shows it is alive.
struct Heartbeat {
    tty: bool,
    every: Duration,
    last: Instant,
    drawn: bool,
}

impl Heartbeat {
    fn new(enabled: bool) -> Option<Self> {
        let tty = std::io::stderr().is_terminal();
        enabled.then(|| Self {
            tty,
            every: if tty {
                Duration::from_millis(500)
            } else {
                Duration::from_secs(5)
            },
            last: Instant::now(),
            drawn: false,
        })
    }

    fn tick(&mut self, session: &Session, nr: u32, started: Instant) {
        if self.last.elapsed() < self.every {
            return;
        }
        self.last = Instant::now();
        let read: u64 = (0..nr).map(|c| session.stats(c).read).sum();
        let lost: u64 = (0..nr).map(|c| session.stats(c).lost).sum();
        let t = started.elapsed().as_secs_f64();
        if self.tty {
            self.drawn = true;
            let mut err = std::io::stderr();
            let _ = write!(
                err,
                "\r\x1b[Khyptrace: recording: {t:.1} s, {read} events read, {lost} lost"
            );
            let _ = err.flush();
        } else {
            note!("hyptrace: recording: {t:.1} s, {read} events read, {lost} lost");
        }
    }

    /// Ends the status line before other messages.
    fn end(&mut self) {
        if std::mem::take(&mut self.drawn) {
            note!();
        }
    }
}
