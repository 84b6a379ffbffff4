//! The run pipeline: a checked [`Plan`] → a booted VM → a
//! [`Session`](crate::drain::session::Session) draining its rings while the vCPUs run
//! (poll loop, stop policy) and after (final walks) → a [`RunReport`]. `run`, `record`
//! and `bench` use it; the CLI only parses, checks and reports.
//!
//! Stop policy: the first signal (`Interrupts`), `--duration`, a crashed vCPU, a closed
//! stdout or a failure stops the vCPUs; everything committed is still read (R1 holds
//! at the end). A second signal aborts: [`RunError::Aborted`], the output is dropped
//! unfinished (its temporary files are removed).
//!
//! ```no_run
//! use hyptrace_host::pipeline::options::RunArgs;
//! use hyptrace_host::pipeline::plan::Plan;
//! use hyptrace_host::pipeline::run::{Run, Target};
//!
//! // `hyptrace run --events 10`, typed.
//! let args = RunArgs { events: 10, ..RunArgs::default() };
//! let report = Run::new(Plan::new(&args)?, Target::Stdout).execute()?;
//! eprint!("{report}"); // the summary, as `hyptrace run` prints it
//! let json = report.stats_json(report.exit_code()); // what `--stats` writes
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hyptrace_output::{Compression, OutputError, OutputTarget, PageSink, TraceMeta};
use hyptrace_reader::{Callbacks, ReadError};

use crate::control::server::ControlServer;
use crate::drain::host_trace::{self, HostTrace, TraceClock};
use crate::drain::signals::Interrupts;
use crate::drain::sink::Format;
use crate::pipeline::plan::Plan;
use crate::pipeline::report::{Failures, RunReport, Timing};
use crate::vmm::registration::{EventsError, VmEventTable};

use boot::Booted;
use flight::Flight;
use heartbeat::{shows_progress, Heartbeat};
use live::Live;
use output::{open_output, StdoutState};
use register::{settle_events, AnswerGate};

mod boot;
mod crash;
mod finish;
mod flight;
mod heartbeat;
mod live;
mod output;
mod register;

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
        format: Format,
        /// The compression of a v7 trace.dat (other formats: ignored).
        compression: Compression,
        /// `-F`: only the events these filters pass are written.
        filters: Vec<String>,
    },
    /// Rows in a ClickHouse server (`record -o clickhouse://...`): reached, its tables
    /// created, before the VM starts (docs/fleet.md).
    ClickHouse {
        /// The URL.
        url: hyptrace_clickhouse::ClickHouseUrl,
        /// A client of the server, checked.
        client: hyptrace_clickhouse::Client,
        /// `-F`: only the events these filters pass are written.
        filters: Vec<String>,
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
    /// `-F` names an event or field the run's events do not have, or does not parse.
    #[error("{0} (the run's events: `hyptrace list`)")]
    Filter(hyptrace_output::tracedat::FilterError),
}

/// The filter's text is the whole message (what is wrong, as data): not a source, so
/// the chain prints it once.
impl From<hyptrace_output::tracedat::FilterError> for RunError {
    fn from(e: hyptrace_output::tracedat::FilterError) -> Self {
        Self::Filter(e)
    }
}

impl RunError {
    /// Whether the user's input or environment is at fault (exit 2) rather than a
    /// failure at run time (exit 1).
    pub fn is_input_error(&self) -> bool {
        match self {
            Self::Vm(e) => e.is_input_error(),
            Self::HostTrace(e) => e.is_input_error(),
            Self::Sink { .. }
            | Self::TraceMem(_)
            | Self::Events(_)
            | Self::Control(_)
            | Self::Filter(_) => true,
            _ => false,
        }
    }
}

/// Called with the run's event table once the VM has started (e.g. to serve a control
/// socket: [`Events::enable`](hyptrace_embed::Events::enable),
/// [`Events::disable`](hyptrace_embed::Events::disable),
/// [`Events::list`](hyptrace_embed::Events::list)).
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
            Self::ClickHouse { url, .. } => f.debug_tuple("ClickHouse").field(url).finish(),
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
            .map(|s| HostTrace::prepare(&host_trace::tracefs_root(), s, TraceClock::Tsc))
            .transpose()?;
        let (mut b, vm) = Booted::boot(&plan)?;
        // After the trace memory file (created by `boot`): a consumer that finds the
        // socket finds the file.
        let server = control.map(ControlServer::bind).transpose()?;
        let (table, reader) = b.rings(&vm, &plan, wrap)?;
        // No event before the run reads: the registration's answer waits for the drain
        // loop (released right before it starts; on an early return, when the VM is
        // stopped: `RegisterHook::on_stop`, whatever the drop order).
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
        let (output, shown) = open_output(
            target,
            &plan,
            &clock,
            &stdout,
            &formats,
            host_trace.as_ref(),
            interrupts,
        )?;
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
