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
//! use hyptrace_host::pipeline::plan::Plan;
//! use hyptrace_host::pipeline::run::{Run, Target};
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use hyptrace_output::{
    Clock, Compression, EventFormat, OutputError, OutputTarget, PageSink, QuietStdout,
    ThreadedSink, TraceMeta,
};
use hyptrace_reader::{Callbacks, ReadError};

use crate::control::consumer::{RunMeta, Subscribers, SUBSCRIBER_GRACE};
use crate::control::handler::{note_unsent, RunControl};
use crate::control::server::ControlServer;
use crate::drain::clock::HostClock;
use crate::drain::host_trace::{self, HostTrace, HostTraceFeed};
use crate::drain::priority::{thread_cpu_time, ReaderPriority};
use crate::drain::session::HostTraceStats;
use crate::drain::session::{Output, Session, MIN_POLL};
use crate::drain::signals::Interrupts;
use crate::drain::sink::{make_sink, FormatArg};
use crate::drain::standby::Standby;
use crate::flight::trace_mem::TraceMemFile;
use crate::pipeline::plan::Plan;
use crate::pipeline::report::{
    CpuReport, Destination, Failures, GuestView, HostEventsStats, ReaderTimes, RunReport, Stop,
    Timing,
};
use crate::vmm::guest_mem::{alloc_reader_wrapped, GuestTraceMem};
use crate::vmm::host_events::{HostEvents, Recording};
use crate::vmm::registration::{EventTable, EventsError, Selection, Settled, VmEventTable};
use crate::vmm::vcpu::VcpuOutcome;
use crate::vmm::vm::{RunningVm, Vm};

/// Where a run sends its events.
pub enum Target {
    /// Text lines on stdout (`run`).
    Stdout,
    /// A page sink of the caller's (`bench`: counting or timing sinks).
    Sink(Box<dyn PageSink + Send>),
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
        /// The compression of a v7 trace.dat (other formats: ignored).
        compression: Compression,
    },
}

/// Why a run could not start, or was aborted. Failures once the vCPUs run are part of
/// the [`RunReport`] instead.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Creating or starting the VM failed.
    #[error(transparent)]
    Vm(#[from] crate::vmm::error::Error),
    /// The guest TSC frequency gives no clock.
    #[error("guest clock ({tsc_khz} kHz)")]
    Clock {
        /// The frequency.
        tsc_khz: u64,
        /// Why.
        #[source]
        source: OutputError,
    },
    /// The output file could not be opened.
    #[error("cannot write {path}", path = .path.display())]
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
    #[error("trace buffers")]
    TraceBuffers(#[source] ReadError),
    /// A second Ctrl-C / SIGTERM: nothing was written.
    #[error("aborted: no output written")]
    Aborted,
    /// `--trace-mem`: the file could not be set up.
    #[error(transparent)]
    TraceMem(#[from] crate::flight::trace_mem::TraceMemError),
    /// `-e` / `--disable` named an event the guest did not register.
    #[error(transparent)]
    Events(#[from] EventsError),
    /// `--control`: the socket could not be set up.
    #[error(transparent)]
    Control(#[from] crate::control::server::ControlError),
    /// `--host-trace`: tracefs could not be set up.
    #[error(transparent)]
    HostTrace(#[from] crate::drain::host_trace::HostTraceError),
}

impl RunError {
    /// Whether the user's input or environment is at fault (exit 2) rather than a
    /// failure at run time (exit 1).
    pub fn is_input_error(&self) -> bool {
        match self {
            Self::Vm(e) => e.is_input_error(),
            Self::HostTrace(e) => e.is_input_error(),
            Self::Sink { .. } | Self::TraceMem(_) | Self::Events(_) | Self::Control(_) => true,
            _ => false,
        }
    }
}

/// Called with the run's event table once the VM has started (e.g. to serve a control
/// socket: [`EventTable::enable`], [`EventTable::disable`], [`EventTable::list`]).
pub type EventsHook = Box<dyn FnOnce(VmEventTable)>;

/// Makes a page sink for a run's trace metadata (page size, CPUs, the guest clock).
pub type MakeSink = Box<dyn FnOnce(TraceMeta) -> Result<Box<dyn PageSink + Send>, OutputError>>;

/// Wraps the reader's callbacks (e.g. to time every swap).
pub type WrapCallbacks = Box<dyn FnOnce(Box<dyn Callbacks + Send>) -> Box<dyn Callbacks + Send>>;

/// A run: a checked plan, where its events go, and the signals that stop it.
pub struct Run<'a> {
    plan: Plan,
    target: Target,
    interrupts: Option<&'static Interrupts>,
    wrap: Option<WrapCallbacks>,
    events_hook: Option<EventsHook>,
    crash_dump: Option<OutputTarget>,
    control: Option<&'a std::path::Path>,
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
            events_hook: None,
            crash_dump: None,
            control: None,
        }
    }

    /// `hook` gets the run's event table once the VM has started, before the guest's
    /// registration is answered (its `enable`/`disable`/`list` say `NotRegistered` until
    /// then).
    pub fn on_events(mut self, hook: EventsHook) -> Self {
        self.events_hook = Some(hook);
        self
    }

    /// Where a crash or hang writes its dump (`--crash-dump`, checked by the caller;
    /// the format comes from `plan.flight.crash_dump`'s extension).
    pub fn crash_dump(mut self, target: Option<OutputTarget>) -> Self {
        self.crash_dump = target;
        self
    }

    /// A control socket at `control` (`--control`, checked by the caller with
    /// [`ControlServer::check`]): bound once the trace memory file exists (a client
    /// that sees the socket finds the file), its commands executed between drain rounds.
    pub fn control(mut self, control: &'a std::path::Path) -> Self {
        self.control = Some(control);
        self
    }

    /// Signals stop the run (a first one) or abort it (a second one).
    pub fn interrupts(mut self, interrupts: &'static Interrupts) -> Self {
        self.interrupts = Some(interrupts);
        self
    }

    /// The reader's callbacks (`Direct` or `Mailbox`) go through `wrap`.
    pub fn wrap_callbacks(mut self, wrap: WrapCallbacks) -> Self {
        self.wrap = Some(wrap);
        self
    }

    /// Boots the VM, drains the rings while it runs and after, and reports: the steps
    /// `Booted::boot` (trace memory file, VM, clock, the VMM's ring), the control socket,
    /// `Booted::rings` (the event table and the guest's rings), the registration
    /// settled and the output opened, the drain loop (`Live::poll_loop`), and
    /// `Live::conclude` (final walks, accounting, the report).
    pub fn execute(self) -> Result<RunReport, RunError> {
        let Run {
            plan,
            target,
            interrupts,
            wrap,
            events_hook,
            crash_dump,
            control,
        } = self;
        let nr = plan.cfg.vcpus;
        let created_tsc = crate::vmm::time::host_tsc();
        // `--host-trace`: tracefs checked (exit 2) before the VM exists.
        let host_trace = plan
            .host_trace
            .as_ref()
            .map(|s| HostTrace::prepare(&host_trace::tracefs_root(), s))
            .transpose()?;
        let (mut b, vm) = Booted::boot(&plan)?;
        // After the trace memory file (created by `boot`): a consumer that finds the
        // socket finds the file.
        let server = control.map(ControlServer::bind).transpose()?;
        let (table, reader) = b.rings(&vm, &plan, wrap)?;
        // No event before the run reads: the registration's answer waits for the drain
        // loop (released right before it starts, or on any early return).
        let gate = AnswerGate::hold(&table);
        let running = vm.start_with_events(&plan.params, table.clone())?;
        let host_trace = host_trace
            .map(|h| {
                let formats = h.formats();
                let tsc_offset = b.tsc_offset.unwrap_or(0);
                h.start(nr, plan.ring.page_size, (tsc_offset, b.tsc_khz))
                    .map(|feed| (feed, formats))
            })
            .transpose()?;
        if let Some(tm) = &b.trace_mem {
            tm.set_state(crate::flight::trace_mem::STATE_RUNNING);
        }
        log::info!("started {nr} vCPUs ({} kHz TSC)", b.tsc_khz);
        if let Some(hook) = events_hook {
            hook(table.clone());
        }
        let limits = (plan.duration, plan.flight.hang_timeout);
        let formats = settle_events(&table, &running, limits, &plan.events, interrupts)?;
        // The output is opened once the formats are known (the guest writes no event
        // before its registration is answered); a failure stops the VM (dropped).
        let clock = b.host_clock.clock.clone();
        let stdout = Arc::new(StdoutState::default());
        let (output, shown) = match open_output(
            target,
            &plan,
            &clock,
            &stdout,
            &formats,
            host_trace.as_ref(),
            interrupts,
        ) {
            Ok(o) => o,
            Err(e) => {
                // Before the VM (dropped next, joining its vCPUs): vCPU 0 may be
                // waiting for the answer the gate holds.
                drop(gate);
                return Err(e);
            }
        };
        let trace_mem = b.trace_mem.take().map(Arc::new);
        let mut session = b.session(reader, output, &formats, &plan, trace_mem.as_ref());
        if let Some((feed, hformats)) = host_trace {
            let first = nr + u32::from(plan.host_events);
            session = session.with_host_trace(feed, first, &hformats);
        }
        let flight = Flight::new(&plan, trace_mem, crash_dump, clock, formats);
        let mut live = Live {
            deadline: plan.duration.map(|d| running.started_at() + d),
            running,
            session: Arc::new(Mutex::new(session)),
            flight,
            stdout,
            interrupts,
            heartbeat: Heartbeat::new(shows_progress(&shown)),
            stop: None,
            failures: Failures::default(),
            nr,
            control: server.as_ref(),
            events: table,
            clock: b.host_clock,
        };
        drop(gate);
        let (aborted, reader) = live.poll_loop(plan.poll);
        live.clock.recheck(true);
        if let Some(line) = live.clock.summary() {
            log::info!("{line}");
        }
        let timing = Timing {
            created_tsc,
            tsc_khz: b.tsc_khz,
            start_tsc: live.running.start_tsc(),
            tsc_offset: b.tsc_offset,
            answered_tsc: live.events.answered_tsc(),
            wall: live.running.started_at().elapsed(),
            reader,
        };
        live.conclude(aborted, timing, shown, &plan, b.guest)
    }
}

/// What the drain loop's thread measured of itself, at debug level (`-vv`).
fn log_reader_thread(
    rounds: u64,
    used: Duration,
    wall: Duration,
    (longest_round, longest_late): (Duration, Duration),
    output_waits: &hyptrace_output::OutputWaits,
    standby: Option<&crate::drain::standby::StandbyTimes>,
) {
    log::debug!(
        "reader thread: {rounds} rounds, {:.1} ms CPU in {:.1} ms ({:.2} % of a core); longest round {:.3} ms, longest late wake-up {:.3} ms",
        used.as_secs_f64() * 1e3,
        wall.as_secs_f64() * 1e3,
        100.0 * used.as_secs_f64() / wall.as_secs_f64().max(1e-9),
        longest_round.as_secs_f64() * 1e3,
        longest_late.as_secs_f64() * 1e3,
    );
    if output_waits.count > 0 {
        log::debug!(
            "reader thread: waited for the output {} times, {:.1} ms in all, longest {:.3} ms",
            output_waits.count,
            output_waits.total.as_secs_f64() * 1e3,
            output_waits.longest.as_secs_f64() * 1e3,
        );
    }
    if let Some(s) = standby {
        log::debug!(
            "standby drainer: took over {} times while the reader thread was late ({} drain rounds), {:.1} ms CPU",
            s.turns,
            s.rounds,
            s.cpu.as_secs_f64() * 1e3
        );
    }
}

/// Progress lines when the events are not on the terminal (a caller's sink: none).
fn shows_progress(shown: &Shown) -> bool {
    match shown {
        Shown::Stdout => !std::io::stdout().is_terminal(),
        Shown::File { .. } => true,
        Shown::Sink => false,
    }
}

/// What a run set up besides the VM before its rings exist: the trace memory file, the
/// clock map and the VMM's own ring.
struct Booted {
    trace_mem: Option<TraceMemFile>,
    guest: GuestView,
    tsc_khz: u64,
    tsc_offset: Option<i64>,
    host_clock: HostClock,
    generation: u64,
    /// `--host-events`: the VMM's ring in host memory, fed by the vCPU threads' exits
    /// and the reader's callbacks.
    host: Option<(Arc<HostEvents>, crate::vmm::host_events::HostReader)>,
}

impl Booted {
    /// Creates the trace memory file (F1–F6) and the VM on it, calibrates the one map
    /// guest TSC → `--clock` of every output (see [`crate::drain::clock`]) and the
    /// VMM's ring.
    fn boot(plan: &Plan) -> Result<(Self, Vm), RunError> {
        log::debug!(
            "plan: {} vCPUs, {} MiB guest memory, trace region {} bytes ({} pages of {} bytes per vCPU, mode {:?}, guest swap {})",
            plan.cfg.vcpus,
            plan.cfg.mem_bytes >> 20,
            plan.ring.region_size,
            plan.ring.pages_per_cpu,
            plan.ring.page_size,
            plan.ring.mode,
            plan.ring.guest_swap
        );
        let trace_mem = match &plan.flight.trace_mem {
            Some(path) => Some(TraceMemFile::create(path, &plan.ring).map_err(RunError::TraceMem)?),
            None => None,
        };
        let mut vm = Vm::with_trace_backing(
            plan.cfg.clone(),
            trace_mem.as_ref().map(TraceMemFile::region_backing),
        )?;
        let guest = GuestView {
            memory: vm.memory().clone(),
            map: vm.layout().clone(),
        };
        let tsc_khz = vm.tsc_khz();
        let tsc_offset = vm.tsc_offset();
        let host_clock = HostClock::calibrate(plan.clock, tsc_khz, tsc_offset.unwrap_or(0))
            .map_err(|source| RunError::Clock { tsc_khz, source })?;
        log::debug!("clock: {:?}", host_clock.stats());
        let generation = crate::vmm::time::host_tsc();
        let host = if plan.host_events {
            let (events, reader) = HostEvents::new(
                plan.cfg.vcpus,
                plan.ring.page_size,
                tsc_khz,
                tsc_offset.unwrap_or(0),
                generation,
            )
            .map_err(RunError::TraceBuffers)?;
            vm.record_exits(Arc::clone(&events));
            Some((events, reader))
        } else {
            None
        };
        let booted = Self {
            trace_mem,
            guest,
            tsc_khz,
            tsc_offset,
            host_clock,
            generation,
            host,
        };
        Ok((booted, vm))
    }

    /// The event table over the trace region and the rings allocated in it, their
    /// callbacks through the caller's `wrap` and the VMM's recording; the trace memory
    /// file's header written.
    fn rings(
        &self,
        vm: &Vm,
        plan: &Plan,
        wrap: Option<WrapCallbacks>,
    ) -> Result<(VmEventTable, crate::vmm::guest_mem::Reader), RunError> {
        let user_wrap = wrap.unwrap_or_else(|| Box::new(|cb| cb));
        let recording = self.host.as_ref().map(|(e, _)| Arc::clone(e));
        let wrap: WrapCallbacks = Box::new(move |cb| {
            let cb = user_wrap(cb);
            match recording {
                Some(ev) => Box::new(Recording::new(cb, ev)),
                None => cb,
            }
        });
        let table: VmEventTable = Arc::new(EventTable::new(
            Arc::new(GuestTraceMem::new(vm.trace_region())),
            plan.ring,
            plan.events.clone(),
        ));
        let generation = self.generation;
        let reader = alloc_reader_wrapped(
            vm.trace_region(),
            plan.ring,
            self.tsc_khz,
            generation,
            plan.mailbox_timeout,
            wrap,
        )
        .map_err(RunError::TraceBuffers)?;
        log::debug!(
            "rings allocated in the trace region (generation {generation:#x}); the {} runs the swaps",
            if plan.ring.guest_swap { "guest" } else { "host" }
        );
        if let Some(tm) = &self.trace_mem {
            tm.write_header(&plan.ring, vm.layout().trace_gpa, self.tsc_khz, generation);
            log::info!("trace memory in {}", tm.path().display());
        }
        Ok((table, reader))
    }

    /// The session over the rings: the formats, the trace memory file's recorder (P2:
    /// positions recorded around every flush, printed vs consumed), the VMM's ring.
    fn session(
        &mut self,
        reader: crate::vmm::guest_mem::Reader,
        output: Output,
        formats: &[EventFormat],
        plan: &Plan,
        trace_mem: Option<&Arc<TraceMemFile>>,
    ) -> Session {
        let mut session =
            Session::new(reader, output, self.host_clock.clock.clone()).with_formats(formats);
        if let Some(tm) = trace_mem {
            let tm = Arc::clone(tm);
            session = session.with_recorder(Arc::new(move |c, p| tm.record(c, p)));
        }
        if let Some((events, reader_h)) = self.host.take() {
            session = session.with_host_events(reader_h, events);
        }
        session.set_live_drain(plan.flight.drain_live);
        session
    }
}

impl Flight {
    /// The flight recorder state of a run of `plan`.
    fn new(
        plan: &Plan,
        trace_mem: Option<Arc<TraceMemFile>>,
        crash_dump: Option<OutputTarget>,
        clock: Clock,
        formats: Vec<EventFormat>,
    ) -> Self {
        Flight {
            trace_mem,
            hang: plan.flight.hang_timeout.map(|timeout| HangWatch {
                timeout,
                last: None,
                since: Instant::now(),
            }),
            dump_target: crash_dump.map(|t| {
                let path = plan.flight.crash_dump.clone().unwrap_or_default();
                // Checked before the run (an unknown extension is refused then).
                let format = crate::drain::sink::format_for(None, &path, "--crash-dump")
                    .unwrap_or(crate::drain::sink::FormatArg::Dat);
                (t, format, path)
            }),
            dumped: false,
            run_meta: RunMeta { clock, formats },
            drain_live: plan.flight.drain_live,
            meta: vec![crate::flight::trace_mem::MetaValues::default(); plan.cfg.vcpus as usize],
            subscribers: Subscribers::new(),
        }
    }
}

/// Holds the answer to the guest's event registration ([`EventTable::hold_answers`])
/// while it lives: the run opens its output meanwhile, and releases the answer right
/// before its drain loop starts — or on any early return, when it is dropped.
struct AnswerGate(VmEventTable);

impl AnswerGate {
    fn hold(table: &VmEventTable) -> Self {
        table.hold_answers();
        Self(Arc::clone(table))
    }
}

impl Drop for AnswerGate {
    fn drop(&mut self) {
        self.0.release_answers();
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
    plan: &Plan,
    clock: &Clock,
    stdout: &Arc<StdoutState>,
    formats: &[EventFormat],
    host_trace: Option<&(HostTraceFeed, Vec<EventFormat>)>,
    interrupts: Option<&'static Interrupts>,
) -> Result<(Output, Shown), RunError> {
    let (ring, nr, host_events) = (&plan.ring, plan.cfg.vcpus, plan.host_events);
    // `--host-events`: one more CPU, the VMM's (comm `vmm`, system `vmm`).
    let meta = || {
        let mut m = TraceMeta {
            formats: formats.to_vec(),
            ..TraceMeta::guest(ring.page_size, nr, clock.clone())
        };
        if host_events {
            m.nr_cpus = nr + 1;
            m.cmdlines
                .insert(hyptrace_abi::events::vcpu_pid(nr), "vmm".into());
            m.formats.extend(crate::vmm::host_events::formats());
        }
        // `--host-trace`: the host CPUs after those, the vCPU threads named.
        if let Some((feed, hformats)) = host_trace {
            m.nr_cpus += feed.nr_cpus();
            m.formats.extend(hformats.iter().cloned());
            for &(v, tid) in feed.tids() {
                m.cmdlines.insert(tid, format!("vcpu{v}"));
            }
        }
        m
    };
    let text_cpus = nr + u32::from(host_events) + host_trace.map_or(0, |(feed, _)| feed.nr_cpus());
    match target {
        Target::Sink(sink) => Ok((Output::Pages(sink), Shown::Sink)),
        Target::MakeSink(make) => {
            let meta = meta();
            let sink = make(meta).map_err(RunError::MakeSink)?;
            Ok((Output::Pages(sink), Shown::Sink))
        }
        Target::Stdout => Ok((
            Output::text(
                Box::new(std::io::BufWriter::with_capacity(
                    1 << 16,
                    CountedStdout {
                        out: QuietStdout::default(),
                        state: Arc::clone(stdout),
                    },
                )),
                text_cpus,
            ),
            Shown::Stdout,
        )),
        Target::File {
            target,
            path,
            format,
            compression,
        } => {
            let meta = meta();
            // The file is written on its own thread (ThreadedSink): a stalled write(2)
            // costs queue space there, not the reader's time at the rings.
            // A second Ctrl-C stops the sink thread (and a reader waiting for it) at once.
            let abort = move || interrupts.is_some_and(Interrupts::aborted);
            match make_sink(&target, format, compression, meta)
                .and_then(ThreadedSink::new)
                .map(|t| t.cancel_on(abort))
            {
                Ok(sink) => Ok((Output::Pages(Box::new(sink)), Shown::File { path, format })),
                // A signal ended the wait for a FIFO's reader: nothing can be written.
                Err(OutputError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::Interrupted =>
                {
                    note!(
                        "hyptrace: no reader opened {} before the signal",
                        path.display()
                    );
                    Err(RunError::Aborted)
                }
                Err(source) => Err(RunError::Sink { path, source }),
            }
        }
    }
}

/// Waits until the guest's event registration is answered (or it writes without one,
/// or the run stops first), says which entries were rejected, and returns the formats
/// of the accepted events. An `-e`/`--disable` name no registered event has is an
/// input error (the VM is stopped).
///
/// The wait follows the SDK protocol (vCPU 0 registers, the others wait for the
/// answer), however late vCPU 0 starts: it ends when vCPU 0 registers or ends, or the
/// run stops (a crash, a signal, `--duration`), or `--hang-timeout` passed since the
/// start with no registration (the hang watch then starts). A run that goes on without
/// a registration refuses a later one (L1, [`EventTable::settle`]).
fn settle_events(
    table: &VmEventTable,
    running: &RunningVm,
    (duration, hang_timeout): (Option<Duration>, Option<Duration>),
    selection: &Selection,
    interrupts: Option<&Interrupts>,
) -> Result<Vec<EventFormat>, RunError> {
    let since_start = |d: Option<Duration>| d.map(|d| running.started_at() + d);
    let (deadline, hang) = (since_start(duration), since_start(hang_timeout));
    let settled = table.settle(Duration::from_millis(1), || {
        running.vcpu_finished(0)
            || running.any_crashed()
            || interrupts.is_some_and(|i| i.stop_requested() || i.aborted())
            || deadline.is_some_and(|d| Instant::now() >= d)
            || hang.is_some_and(|d| Instant::now() >= d)
    });
    log::debug!("event registration: {settled:?}");
    if let Settled::Refused(why) = &settled {
        note!("hyptrace: warning: the guest's event registration table was refused: {why}");
    }
    for r in table.rejections() {
        note!("hyptrace: warning: {r}");
    }
    let selecting = !selection.enable.is_empty() || !selection.disable.is_empty();
    // A guest that writes without registering, or whose vCPU 0 ended cleanly without it,
    // has none of the events asked for; a crash or a stop while waiting is reported as
    // such instead.
    let unregistered = settled == Settled::Unregistered
        || (settled == Settled::None && running.vcpu_finished(0) && !running.any_crashed());
    let error = match table.selection_error() {
        Some(e) => Some(e),
        None if selecting && unregistered => Some(EventsError::NotRegistered),
        None => None,
    };
    if let Some(e) = error {
        running.stop();
        return Err(RunError::Events(e));
    }
    Ok(table.formats())
}

/// What [`finish_session`] accounts: the vCPUs' reports, the failures, the VMM's ring
/// (`--host-events`) and the host kernel's events (`--host-trace`).
type Finished = (
    Vec<CpuReport>,
    Failures,
    Option<HostEventsStats>,
    Option<HostTraceStats>,
);

/// Every vCPU has stopped: the final read-only walks, the per-CPU accounting, the
/// output finished. A second signal meanwhile aborts.
fn finish_session(
    mut session: Session,
    mut failures: Failures,
    interrupts: Option<&Interrupts>,
) -> Result<Finished, RunError> {
    let nr = session.reader().nr_cpus();
    let aborted = || interrupts.is_some_and(Interrupts::aborted);
    for cpu in 0..nr {
        if session.abandon_if(&aborted) {
            return Err(RunError::Aborted);
        }
        if let Err(e) = session.end_cpu_unless(cpu, &aborted) {
            log::debug!("cpu {cpu}: final walk failed: {e}");
            session.fail_cpu(cpu, &e);
            failures.session(Some(cpu), &e);
        }
    }
    if let Err(e) = session.end_host() {
        log::debug!("host events: final walk failed: {e}");
        failures.session(None, &e);
    }
    if session.abandon_if(&aborted) {
        return Err(RunError::Aborted);
    }
    if let Err(e) = session.end_host_trace_unless(&aborted) {
        log::debug!("host trace: final read failed: {e}");
        failures.session(None, &e);
    }
    if session.abandon_if(&aborted) {
        return Err(RunError::Aborted);
    }
    let host_trace = session.host_trace_stats();
    if let Some(e) = host_trace.as_ref().and_then(|h| h.error.clone()) {
        failures.other(format!("host trace: {e}"));
    }
    if let Err(e) = session.flush() {
        failures.session(None, &e);
    }
    if session.abandon_if(&aborted) {
        return Err(RunError::Aborted);
    }
    let cpus: Vec<CpuReport> = (0..nr)
        .map(|cpu| {
            // R3: published by the guest's writer as it went, whatever the end.
            let a = session.attempts(cpu);
            CpuReport {
                finished: session.writer_finished(cpu),
                attempted: Some(a.attempted),
                skipped: Some(a.skipped),
                attempts_problem: a.problem,
                written: session.writer_index(cpu),
                stats: session.stats(cpu),
                error: session.error(cpu).map(str::to_string),
                page_events: page_events(session.reader().layout()),
            }
        })
        .collect();
    let host = session.host_stats().map(|s| HostEventsStats {
        lost: s.lost,
        read: s.read,
    });
    let text = session.writes_text();
    if let Err(e) = session.finish(&sink_summary(&cpus)) {
        // An abort during the sink's last writes stopped them (ThreadedSink::cancel_on):
        // nothing was written (the unfinished sink removed its files).
        if aborted() {
            return Err(RunError::Aborted);
        }
        failures.session(None, &e);
    }
    // Text lines go to stdout, whose last writes can block on a pipe nobody reads: an
    // abort that came meanwhile still aborts (exit 130), as it would have during the
    // loop. (A file is complete once its sink finished: it stays, and the run ends as
    // it would have.)
    if text && interrupts.is_some_and(Interrupts::aborted) {
        return Err(RunError::Aborted);
    }
    Ok((cpus, failures, host, host_trace))
}

/// Most events one page of `l` holds: its data area over the smallest record (8 bytes:
/// a header word and the shortest payload).
fn page_events(l: &hyptrace_abi::RingGeometry) -> u64 {
    (l.data_capacity() / 8) as u64
}

/// The per-CPU statistics a page sink writes at its end (trace.dat's stat options).
fn sink_summary(cpus: &[CpuReport]) -> hyptrace_output::RunSummary {
    hyptrace_output::RunSummary {
        cpus: cpus
            .iter()
            .map(|r| hyptrace_embed::kernel_cpu_stat(r.written, &r.stats))
            .collect(),
    }
}

/// A run while its vCPUs run: the poll loop and the stop policy.
struct Live<'a> {
    running: RunningVm,
    /// Shared with the standby drainer (invariant D1: one drainer at a time, under
    /// this lock); the loop's own uses lock it for a moment each.
    session: Arc<Mutex<Session>>,
    flight: Flight,
    stdout: Arc<StdoutState>,
    interrupts: Option<&'a Interrupts>,
    heartbeat: Option<Heartbeat>,
    deadline: Option<Instant>,
    stop: Option<Stop>,
    failures: Failures,
    nr: u32,
    control: Option<&'a ControlServer>,
    events: VmEventTable,
    clock: HostClock,
}

impl Live<'_> {
    /// After the drain loop: the vCPUs joined, the trace memory file's final state, the
    /// final walks and the accounting of every CPU ([`finish_session`]), the report.
    fn conclude(
        self,
        aborted: bool,
        timing: Timing,
        shown: Shown,
        plan: &Plan,
        guest: GuestView,
    ) -> Result<RunReport, RunError> {
        let Live {
            running,
            session,
            stdout,
            stop,
            failures,
            flight,
            clock,
            interrupts,
            events: table,
            ..
        } = self;
        // poll_loop joined the standby drainer, the session's only other owner.
        let session = Arc::into_inner(session)
            .expect("the standby drainer was joined")
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        let outcomes = running.wait();
        if let Some(tm) = &flight.trace_mem {
            let crashed =
                outcomes.iter().any(VcpuOutcome::is_crash) || matches!(stop, Some(Stop::Hang(_)));
            tm.set_state(if crashed {
                crate::flight::trace_mem::STATE_CRASHED
            } else {
                crate::flight::trace_mem::STATE_ENDED
            });
        }
        if aborted {
            // Dropping the session drops the sink: its temporary files go.
            let mut session = session;
            session.abandon_output();
            return Err(RunError::Aborted);
        }
        let (cpus, mut failures, host_events, host_trace) =
            finish_session(session, failures, interrupts)?;
        // L1: a registration refused because the run went on without one fails the run.
        if let Some(late) = table.late_registration() {
            failures.other(late.to_string());
        }
        let destination = match shown {
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
            echo: plan.echo.clone(),
            mode: plan.mode,
            guest: Some(guest),
            clock: Some(clock.stats()),
            host_events,
            host_trace,
            verbose: log::log_enabled!(log::Level::Info),
        })
    }

    /// Polls every `poll` until every vCPU has stopped and been read; returns whether a
    /// second signal aborted the run.
    ///
    /// Adaptive: the wait between rounds is [`Session::next_wait`] (`poll` while the
    /// writers are idle, down to continuous draining while one outpaces the reader), and
    /// the thread runs with a scheduling advantage ([`ReaderPriority`]) for the loop's
    /// length. Returns also what the loop measured of itself ([`ReaderTimes`]).
    fn poll_loop(&mut self, poll: Duration) -> (bool, ReaderTimes) {
        // A command on the control socket ends the wait: served at once, not at the
        // next poll (an idle run sleeps its whole `--poll-ms`).
        if let Some(c) = self.control {
            let w = self.running.waker();
            c.set_waker(Some(Box::new(move || w.wake())));
        }
        let mut priority = ReaderPriority::raise();
        let standby = self.start_standby(poll);
        // Rounds in a row that found every writer idle: after IDLE_ROUNDS the boost is
        // given back (cheaper wake-ups) until a writer writes again.
        const IDLE_ROUNDS: u32 = 16;
        let mut idle_rounds = 0u32;
        let cpu0 = thread_cpu_time();
        let mut rounds = 0u64;
        // The longest round (service + control + clock) and the longest wait beyond what
        // was asked for (the thread waiting for a core): where a stall came from.
        let (mut longest_round, mut longest_late) = (Duration::ZERO, Duration::ZERO);
        let aborted = loop {
            rounds += 1;
            let wait = {
                let mut s = locked(&self.session);
                let wait = s.next_wait(poll);
                if let Some(b) = &standby {
                    b.beat(Instant::now(), wait, s.fill_time());
                }
                wait
            };
            idle_rounds = if wait >= poll {
                idle_rounds.saturating_add(1)
            } else {
                0
            };
            priority.set_active(idle_rounds < IDLE_ROUNDS);
            let waited = Instant::now();
            let all_done = self.running.wait_timeout(wait);
            let round = Instant::now();
            let late = round.saturating_duration_since(waited + wait);
            longest_late = longest_late.max(late);
            if let Some(b) = &standby {
                b.woke(round, late);
            }
            if self.interrupts.is_some_and(Interrupts::aborted) {
                log::info!("aborted by a second signal");
                self.running.stop();
                break true;
            }
            self.check_stop();
            self.service();
            self.serve_control();
            self.clock.recheck(false);
            if let Some(h) = &mut self.heartbeat {
                h.tick(&locked(&self.session), self.nr, self.running.started_at());
            }
            longest_round = longest_round.max(round.elapsed());
            if all_done && {
                let s = locked(&self.session);
                (0..self.nr).all(|c| !s.is_live(c))
            } {
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
        if let Some(c) = self.control {
            c.set_waker(None);
        }
        let used = thread_cpu_time().saturating_sub(cpu0);
        let standby = standby.map(Standby::stop);
        let output_waits = locked(&self.session).output_waits();
        drop(priority);
        let wall = self.running.started_at().elapsed();
        log_reader_thread(
            rounds,
            used,
            wall,
            (longest_round, longest_late),
            &output_waits,
            standby.as_ref(),
        );
        let l = *locked(&self.session).reader().layout();
        (
            aborted,
            ReaderTimes {
                live: self.flight.drain_live,
                cpu: used,
                longest_late,
                longest_round,
                output_waits,
                buffer_kb: u64::from(l.pages_per_cpu) * l.page_size as u64 / 1024,
                ring_bytes: u64::from(l.pages_per_cpu.saturating_sub(1)) * l.data_capacity() as u64,
                standby: standby.unwrap_or_default(),
            },
        )
    }

    /// The standby drainer of this loop (`crate::drain::standby`), with live draining on at
    /// least two CPUs: it drains while the loop is late, and records the reader
    /// positions in the trace memory file after each turn, as the loop does after its
    /// rounds. It holds off while any vCPU crashed or ended or a stop was asked for.
    fn start_standby(&self, poll: Duration) -> Option<Standby> {
        if !self.flight.drain_live || !Standby::wanted() {
            return None;
        }
        let watch = self.running.watch();
        let tm = self.flight.trace_mem.clone();
        let nr = self.nr;
        let relieve = move |s: &mut Session| {
            let rounds = s.relieve(crate::drain::standby::TURN_BUDGET);
            if let Some(tm) = &tm {
                record_positions(s, tm, nr);
            }
            rounds
        };
        let hold = move || !watch.all_running();
        match Standby::start(Arc::clone(&self.session), poll, relieve, hold) {
            Ok(s) => Some(s),
            Err(e) => {
                log::info!("standby drainer: not started ({e}); the reader thread drains alone");
                None
            }
        }
    }

    /// Executes the control socket's waiting commands.
    fn serve_control(&mut self) {
        let Some(control) = self.control else { return };
        let mut session = locked(&self.session);
        let mut h = RunControl {
            session: &mut session,
            running: &self.running,
            events: self.events.as_ref(),
            stop: self.stop.as_ref().map(ToString::to_string),
            subscribers: &mut self.flight.subscribers,
            meta: &self.flight.run_meta,
            drain_live: self.flight.drain_live,
            hold: !self.flight.dumped && self.running.any_crashed(),
        };
        control.serve(&mut h);
    }

    /// C4's bound: a subscriber that asked for nothing [`SUBSCRIBER_GRACE`] after every
    /// vCPU stopped loses the claim (the run must end); this session's own output then
    /// takes the rest.
    fn end_claim_if_late(&mut self) {
        let all_done = (0..self.nr).all(|c| self.running.vcpu_finished(c));
        let mut session = locked(&self.session);
        let late = self
            .flight
            .subscribers
            .end_if_late(&mut session, all_done, Instant::now());
        if let Some(unsent) = late {
            note!(
                "hyptrace: warning: the subscriber asked for nothing within {} s of the vCPUs' end: the VMM writes the rest itself",
                SUBSCRIBER_GRACE.as_secs()
            );
            note_unsent(&unsent, "stopped asking");
        }
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
            // A crash after the run was stopped for another reason is still dumped
            // (service holds the rings until then).
            if !self.flight.dumped && self.running.any_crashed() {
                self.crash_dump();
            }
            return;
        }
        let signal = self.interrupts.filter(|i| i.stop_requested());
        let why = if let Some(i) = signal {
            Some(Stop::Signal(i.signal_name()))
        } else if self.deadline.is_some_and(|d| Instant::now() >= d) {
            Some(Stop::Duration)
        } else if self.running.any_crashed() {
            Some(Stop::Crash)
        } else if let Some(t) = self.hung() {
            Some(Stop::Hang(t))
        } else if hyptrace_output::stdout_closed() {
            Some(Stop::StdoutClosed)
        } else {
            None
        };
        if let Some(why) = why {
            let crash = matches!(why, Stop::Crash | Stop::Hang(_));
            self.stop_for(why);
            if crash {
                self.crash_dump();
            }
        }
    }

    /// `--hang-timeout`: whether no vCPU made progress for that long. Progress is a
    /// change of any CPU's writer index (`entries + dropped` in its control block: an
    /// event committed or dropped) or of the number of vCPUs that exited.
    fn hung(&mut self) -> Option<Duration> {
        let h = self.flight.hang.as_mut()?;
        let session = locked(&self.session);
        let reader = session.reader();
        let index = (0..self.nr).fold(0u64, |a, c| a.wrapping_add(reader.writer_index(c)));
        let exited = (0..self.nr)
            .filter(|&c| self.running.vcpu_finished(c))
            .count();
        if exited == self.nr as usize {
            return None;
        }
        let now = (index, exited);
        if h.last != Some(now) {
            h.last = Some(now);
            h.since = Instant::now();
            return None;
        }
        (h.since.elapsed() >= h.timeout).then_some(h.timeout)
    }

    /// A crash or hang: the vCPUs are stopped (waited for, bounded); every CPU's
    /// committed, unconsumed events are dumped read-only (no swaps) to `--crash-dump`
    /// if there is one; the reason and the last event per vCPU go to stderr. Runs once,
    /// before any final walk consumes the rings.
    fn crash_dump(&mut self) {
        if std::mem::replace(&mut self.flight.dumped, true) {
            return;
        }
        let t0 = Instant::now();
        // The vCPUs leave KVM_RUN at the kick; a vCPU thread that does not end within
        // the bound is dumped anyway (reads are atomics and copies: safe, less exact).
        while !self.running.wait_timeout(Duration::from_millis(20))
            && t0.elapsed() < Duration::from_secs(5)
        {}
        let reason = match &self.stop {
            Some(Stop::Hang(_)) => self.stop.as_ref().map(ToString::to_string),
            _ => self.running.crash_reason(),
        }
        .unwrap_or_else(|| "a vCPU crashed".into());
        note!("hyptrace: guest crashed: {reason}");
        let session = locked(&self.session);
        let reader = session.reader();
        let session = &*session;
        let target = self.flight.dump_target.as_ref().map(|(t, f, _)| (t, *f));
        let (report, err) = crate::flight::dump::write_crash_dump(
            &**reader.mem(),
            reader.layout(),
            &|c| reader.position(c),
            &|c| session.is_live(c),
            &self.flight.run_meta.clock,
            &self.flight.run_meta.formats,
            target,
        );
        let _ = std::io::stderr().write_all(
            report
                .last_events(&self.flight.run_meta.clock, &self.flight.run_meta.formats)
                .as_bytes(),
        );
        if let Some((_, _, path)) = &self.flight.dump_target {
            match err {
                None => note!(
                    "hyptrace: crash dump: {} events ({} lost before them) written to {} in {:.1} ms",
                    report.events(),
                    report.cpus.iter().map(|c| c.lost).fold(0, u64::saturating_add),
                    crate::drain::sink::shown_path(path),
                    t0.elapsed().as_secs_f64() * 1e3
                ),
                Some(e) => self.failures.other(format!(
                    "writing the crash dump {}: {}",
                    path.display(),
                    crate::exit::chain(&e)
                )),
            }
            for c in &report.cpus {
                for w in &c.warnings {
                    note!("hyptrace: crash dump: warning: {w}");
                }
            }
        }
    }

    /// Records every CPU's reader position in the trace memory file, and with `--drain
    /// none` its meta page's writer counters (live attach).
    fn record_positions(&mut self) {
        if let Some(tm) = &self.flight.trace_mem {
            let session = locked(&self.session);
            record_positions(&session, tm, self.nr);
            if !self.flight.drain_live {
                for c in 0..self.nr {
                    update_meta(&session, tm, &mut self.flight.meta, c);
                }
            }
        }
    }

    /// One round over the CPUs and a flush of the output; a failure stops the run.
    fn service(&mut self) {
        self.end_claim_if_late();
        let running = &self.running;
        // A crash not yet dumped: nothing is consumed before the dump (check_stop
        // takes it at the next round). A vCPU that crashed after check_stop looked is
        // polled, not walked, until then.
        let hold = !self.flight.dumped;
        if hold && running.any_crashed() {
            return;
        }
        let stopped = |c| running.vcpu_finished(c) && !(hold && running.any_crashed());
        let failed = locked(&self.session).service(stopped);
        self.record_positions();
        for (cpu, e) in failed {
            log::debug!("cpu {cpu}: {e}");
            self.failures.session(Some(cpu), &e);
            self.stop_for(Stop::Failed(if e.is_output() {
                "output failed".into()
            } else {
                format!("reading vcpu {cpu} failed")
            }));
        }
        let flushed = locked(&self.session).flush();
        if let Err(e) = flushed {
            self.failures.session(None, &e);
            self.stop_for(Stop::Failed("output failed".into()));
        }
    }
}

/// The run's session, locked: the drain loop's and the control socket's uses, each for
/// a moment (invariant D1). A panic elsewhere while holding it fails the run anyway.
fn locked(session: &Mutex<Session>) -> MutexGuard<'_, Session> {
    session.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Records every CPU's reader position in the trace memory file (what a dump after a
/// SIGKILL must not emit again).
fn record_positions(session: &Session, tm: &TraceMemFile, nr: u32) {
    for c in 0..nr {
        if let Some(p) = session.position(c) {
            tm.record(c, p);
        }
    }
}

/// The flight recorder state of a run.
struct Flight {
    /// `--trace-mem`.
    trace_mem: Option<Arc<TraceMemFile>>,
    /// `--hang-timeout`.
    hang: Option<HangWatch>,
    /// `--crash-dump`: where, in which format, the path for messages.
    dump_target: Option<(OutputTarget, FormatArg, PathBuf)>,
    /// The crash dump was taken (or there was none to take).
    dumped: bool,
    /// The guest clock and the event formats (the guest's registrations).
    run_meta: RunMeta,
    /// `--drain live` (a subscriber can attach only with `none`).
    drain_live: bool,
    /// Per CPU, what its meta page says (written with `--trace-mem`).
    meta: Vec<crate::flight::trace_mem::MetaValues>,
    /// The subscriber of live attach (C1–C4).
    subscribers: Subscribers,
}

/// `--hang-timeout`: the last progress seen and since when.
struct HangWatch {
    timeout: Duration,
    last: Option<(u64, usize)>,
    since: Instant,
}

/// Refreshes `cpu`'s meta page: the writer's counters from its control block (hostile
/// values, shown as they are), the reader's from the one reader (docs/abi.md).
fn update_meta(
    session: &Session,
    tm: &TraceMemFile,
    meta: &mut [crate::flight::trace_mem::MetaValues],
    cpu: u32,
) {
    let Some(m) = meta.get_mut(cpu as usize) else {
        return;
    };
    let reader = session.reader();
    let l = reader.layout();
    let c = l.ctl(cpu);
    let mem = reader.mem();
    use hyptrace_abi::layout::ctl;
    use hyptrace_abi::SharedMem as _;
    m.entries = mem.load(c + ctl::ENTRIES, Ordering::Relaxed);
    m.overrun = mem.load(c + ctl::OVERRUN, Ordering::Relaxed);
    m.pages_touched = mem.load(c + ctl::PAGES_TOUCHED, Ordering::Relaxed);
    let s = reader.stats(cpu);
    if let Some(p) = reader.position(cpu) {
        let id = p.reader.saturating_sub(l.first_page(cpu));
        if id != m.reader_id {
            m.lost_events = s.lost.saturating_sub(m.lost_total);
        }
        m.reader_id = id;
        m.read = p.expected.saturating_sub(s.lost);
    }
    m.lost_total = s.lost;
    tm.write_meta(cpu, m);
}

/// Stdout for `run`, through the output crate's [`QuietStdout`]: a reader that went
/// away (`| head`) ends the run quietly. After the first EPIPE every write is accepted
/// and discarded, so the run keeps reading (the accounting stays exact) while it stops;
/// [`hyptrace_output::stdout_closed`] tells the run loop. Counts the lines that did
/// reach stdout.
#[derive(Debug, Default)]
struct StdoutState {
    lines: AtomicU64,
}

struct CountedStdout {
    out: QuietStdout,
    state: Arc<StdoutState>,
}

impl Write for CountedStdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let was_closed = hyptrace_output::stdout_closed();
        let n = self.out.write(buf)?;
        if was_closed {
            return Ok(n);
        }
        if hyptrace_output::stdout_closed() {
            log::debug!("stdout closed by its reader");
        } else {
            let nl = buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
            self.state.lines.fetch_add(nl, Ordering::Relaxed);
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
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
