//! The `hyptrace` command line.
//!
//! Exit codes: [`EXIT_OK`] 0 (the run completed: the guest finished, or was stopped as
//! asked by `--duration` or a first Ctrl-C / SIGTERM, and every event is accounted for),
//! [`EXIT_RUNTIME`] 1 (a host-side failure), [`EXIT_USAGE`] 2 (bad input, an unusable
//! output path, no usable /dev/kvm), [`EXIT_CRASH`] 3 (the guest panicked or faulted),
//! [`EXIT_ABORT`] 130 (a second Ctrl-C aborted the run; no output file is left).
//! An error is one line on stderr, `hyptrace: error: ...` (argument errors are followed
//! by clap's hints: valid values, tips, usage).

pub mod logging;

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};
use hyptrace_abi::guest::Workload;
use hyptrace_output::{OutputError, OutputTarget};

use crate::drain::signals::{Interrupts, SignalError};
use crate::exit::{EXIT_ABORT, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE};
use crate::pipeline::plan::{Plan, PlanError};
use crate::pipeline::run::{Run, RunError, Target};
use crate::vmm::memory_map::MAX_VCPUS;

pub use crate::drain::signals::SIGNAL_BURST;
pub use crate::pipeline::plan::{ring_layout, MAX_DURATION_S};
pub use crate::pipeline::report::exit_code;

/// The reader's poll period while the rings are idle (`--poll-ms`): a wake-up costs
/// ~23 µs of CPU on the nested-virtualisation machines this was measured on, so 1 ms
/// cost 2.2 % of a core for an idle VM and 5 ms costs 0.4 % (docs/benchmarks.md); a
/// writer that writes is polled sooner (down to continuously) whatever the period.
pub const DEFAULT_POLL_MS: u64 = 5;

/// What the counters of the summary and of `--stats` mean (`run --help`, `record --help`).
const COUNTERS_HELP: &str = "\
Counters (per vCPU, in the summary on stderr and in --stats):
  attempted  events the guest workload tried to emit
  skipped    of those, events whose tracepoint was disabled (never reach the writer)
  written    events the writer took in: attempted - skipped. Each one was either
             committed to the ring or, in --mode stop while the ring was full, dropped
  read       events the host read from the ring (printed or recorded)
  lost       events written but never read: overrun + dropped
  overrun    committed events overwritten before the reader got them (--mode overwrite)
  dropped    events refused because the ring was full (--mode stop)
Every vCPU must satisfy written = read + lost (else MISMATCH, exit 1).

Exit status: 0 the run completed (the guest finished, or was stopped by --duration or a
first Ctrl-C/SIGTERM; --stats says which in \"end\"); 1 runtime error; 2 bad input or an
unusable output path (checked before the VM starts); 3 the guest crashed; 130 aborted by
a second Ctrl-C (temporary files removed, no output file).";

/// hyptrace: per-vCPU tracing ring buffers in guest memory, read by the host.
#[derive(Debug, Parser)]
#[command(
    name = "hyptrace",
    version,
    about = "hyptrace: per-vCPU tracing ring buffers in guest memory, written by the guest, read by the host",
    propagate_version = true
)]
pub struct Cli {
    /// Show the VMM's steps on stderr (-v: info, -vv: debug, -vvv: trace; RUST_LOG
    /// overrides, e.g. RUST_LOG=hyptrace_host=debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Boot the guest on KVM, run a workload on every vCPU, print every event (merged
    /// by time, as `trace-cmd report -t` prints them) and a per-CPU summary.
    #[command(after_help = COUNTERS_HELP)]
    Run(RunArgs),
    /// Like `run`, but stream the ring pages into a file: trace.dat (v7 or v6) that
    /// trace-cmd and KernelShark read, Chrome trace-event JSON, text, or raw pages.
    #[command(after_help = COUNTERS_HELP)]
    Record(RecordArgs),
    /// Print a trace.dat (ours or one trace-cmd wrote, v6, v7, v7 zstd) or a raw page
    /// stream (`record --format raw`) as `trace-cmd report -t` does, streaming.
    Report(ReportArgs),
    /// Boot the guest until it registers its events, print them (system, name, id,
    /// fields, print fmt, as `trace-cmd list -e -F`) and exit.
    List(ListArgs),
    /// Write the events left in a trace memory file (`--trace-mem`) — of a VMM killed,
    /// crashed or finished — to a file in any `record` format: every committed event
    /// no reader consumed, with the exact losses. With `--attach SOCKET`: read a running
    /// VMM's rings live (`--drain none --trace-mem --control`), once or `--follow`.
    Dump(crate::flight::dump::DumpArgs),
    /// Convert a trace (trace.dat v6/v7/zstd, ours or the kernel's, or a raw page
    /// stream) into any output format of `record`.
    Convert(ConvertArgs),
    /// Measure the writer in the guest and natively, drain throughput, swap latency in
    /// both modes, the highest loss-free rate and start-up time; print a table and
    /// optionally write JSON (see docs/benchmarks.md).
    Bench(crate::bench::BenchArgs),
    /// Send one command to a running `run`/`record --control PATH` and print the reply:
    /// `enable EVENT`, `disable EVENT`, `stats` (JSON), `list` (JSON). Exit 0 on `ok`,
    /// 1 on an `err` reply or when the socket cannot be reached, 2 on bad usage.
    Ctl(CtlArgs),
}

/// Options of `hyptrace ctl`.
#[derive(Clone, Debug, Args)]
pub struct CtlArgs {
    /// The control socket (`--control PATH` of the run).
    #[arg(value_name = "PATH")]
    pub path: PathBuf,
    /// The command and its arguments, e.g. `disable guest:marker`.
    #[arg(value_name = "CMD", required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// Output formats of `record`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// trace.dat version 7 (trace-cmd's current format), zstd-compressed like
    /// `trace-cmd record` (see --compression).
    Dat,
    /// trace.dat version 6.
    Dat6,
    /// Chrome trace-event JSON (Perfetto UI, chrome://tracing).
    Json,
    /// Native Perfetto trace (protobuf TracePackets; open in ui.perfetto.dev).
    Perfetto,
    /// Text, one event per line as `trace-cmd report -t` prints it.
    Text,
    /// Raw ring pages (see docs/output.md).
    Raw,
}

/// Compressions of a v7 trace.dat (`record --compression`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CompressionArg {
    /// zstd, as `trace-cmd record` writes by default.
    Zstd,
    /// Uncompressed: pages copied verbatim.
    None,
}

impl From<CompressionArg> for hyptrace_output::Compression {
    fn from(c: CompressionArg) -> Self {
        match c {
            CompressionArg::Zstd => Self::Zstd,
            CompressionArg::None => Self::None,
        }
    }
}

/// Options of `hyptrace record`.
#[derive(Clone, Debug, Args)]
pub struct RecordArgs {
    /// Output file: a regular file is written to a temporary name and renamed when
    /// complete (a symlink's target is written that way); a device, a FIFO or `-`
    /// (stdout) is written in place. A directory or an unwritable location is refused
    /// before the VM starts.
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        default_value = "trace.dat"
    )]
    pub output: PathBuf,
    /// Output format [default: from the extension: .dat → dat, .json → json, .txt →
    /// text, .raw → raw, .pftrace/.perfetto-trace → perfetto; otherwise dat].
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// Compression of a trace.dat v7 (`--format dat`) [default: zstd, like trace-cmd];
    /// `none` writes the pages uncompressed. Other formats are never compressed.
    #[arg(long, value_enum, value_name = "C")]
    pub compression: Option<CompressionArg>,
    /// Options of the run.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Options of `hyptrace report`.
#[derive(Clone, Debug, Args)]
pub struct ReportArgs {
    /// The trace to read: trace.dat (v6, v7, v7 compressed with zstd) or a raw page
    /// stream, told apart by their magic [default: trace.dat].
    #[arg(value_name = "FILE", conflicts_with = "input_flag")]
    pub input: Option<PathBuf>,
    /// The trace to read (as trace-cmd's -i).
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    pub input_flag: Option<PathBuf>,
    /// Print the per-CPU statistics instead of the events.
    #[arg(long)]
    pub stat: bool,
    /// Only these CPUs: a list of numbers and ranges, e.g. `0,2-3` (repeatable).
    #[arg(long = "cpu", value_name = "LIST", value_parser = parse_cpu_list)]
    pub cpu: Vec<Vec<u32>>,
    /// Only these events: `[SYSTEM:]EVENT` with `*`/`?` globs, comma-separated
    /// (repeatable), e.g. `sched:*`, `*:sched_switch`, `guest:marker`, `irq_*`.
    /// trace.dat input only; trace-cmd's `/FILTER` expressions are not supported.
    #[arg(short = 'F', long = "events", value_name = "SYSTEM:EVENT")]
    pub events: Vec<String>,
    /// Skip the first N events (of those selected). trace.dat input only.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub skip: u64,
    /// Print at most N events (of those selected). trace.dat input only.
    #[arg(long, value_name = "N")]
    pub count: Option<u64>,
    /// List the CPUs that have data, then exit (as trace-cmd). trace.dat input only.
    #[arg(long = "cpus")]
    pub list_cpus: bool,
    /// List the CPUs with the time of their first event, then exit (as trace-cmd).
    /// trace.dat input only.
    #[arg(long = "first-event")]
    pub first_event: bool,
    /// List the CPUs with the time of their last event, then exit (as trace-cmd).
    /// trace.dat input only.
    #[arg(long = "last-event")]
    pub last_event: bool,
}

impl ReportArgs {
    /// The file to read: the positional FILE, else `-i`, else `trace.dat`.
    pub fn path(&self) -> PathBuf {
        self.input
            .clone()
            .or_else(|| self.input_flag.clone())
            .unwrap_or_else(|| PathBuf::from("trace.dat"))
    }
}

/// Parses a CPU list: numbers and ranges separated by commas (`0,2-3`).
pub fn parse_cpu_list(s: &str) -> Result<Vec<u32>, String> {
    const MAX: u32 = 65535;
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .ok()
                .filter(|&n| n <= MAX)
                .ok_or_else(|| format!("`{t}` is not a CPU number (0 to {MAX})"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("range `{part}` goes backwards"));
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    Ok(out)
}

/// Options of `hyptrace convert`.
#[derive(Clone, Debug, Args)]
pub struct ConvertArgs {
    /// The trace to read: trace.dat (v6, v7, v7 zstd; ours or the kernel's) or a raw
    /// page stream.
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    pub input: PathBuf,
    /// Output file (`-` is stdout; a regular file is written to a temporary name and
    /// renamed when complete).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    /// Output format [default: from the extension of -o, as `record`].
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
}

/// Options of `hyptrace list`.
#[derive(Clone, Debug, Args)]
pub struct ListArgs {
    /// Guest payload ELF to load instead of the embedded one.
    #[arg(long, value_name = "PATH")]
    pub guest: Option<PathBuf>,
}

/// Workloads of the guest payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WorkloadArg {
    /// `guest:marker` events at --rate.
    Steady,
    /// Markers, spans and texts (some longer than 112 bytes), pseudo-random.
    Mixed,
    /// Bursts of back-to-back events with pauses, far above the drain rate.
    Burst,
    /// A few events, then a guest panic (exit code 3).
    Panic,
    /// A few events, then a CPU fault / triple fault (exit code 3).
    Fault,
    /// Clock alignment: events/2 port exits, each between two guest TSC stamps; the
    /// second marker's value is the host clock the VMM read at the exit.
    Align,
}

impl From<WorkloadArg> for Workload {
    fn from(w: WorkloadArg) -> Self {
        match w {
            WorkloadArg::Steady => Workload::Steady,
            WorkloadArg::Mixed => Workload::Mixed,
            WorkloadArg::Burst => Workload::Burst,
            WorkloadArg::Panic => Workload::Panic,
            WorkloadArg::Fault => Workload::Fault,
            WorkloadArg::Align => Workload::Align,
        }
    }
}

/// What the writer does when a ring is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Flight recorder: overwrite the oldest unread page.
    Overwrite,
    /// Drop new events while the ring is full.
    Stop,
}

/// Who swaps the reader page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SwapArg {
    /// The host reader swaps (lockless, against the writer).
    Host,
    /// The guest swaps: in stop mode the pages the host read in place and released,
    /// when it needs them (no round trip); in overwrite mode on the host's mailbox
    /// requests.
    Guest,
}

/// Options of `hyptrace run`.
#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// Number of vCPUs (one host thread each), 1 to 256.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 2,
        allow_negative_numbers = true,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_VCPUS))
    )]
    pub vcpus: u32,
    /// Events each vCPU writes.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 100_000,
        allow_negative_numbers = true
    )]
    pub events: u64,
    /// Events per second per vCPU; 0 = as fast as possible. The guest catches up at most
    /// 200 µs on its schedule: held off its core longer, it goes on at R and ends later.
    #[arg(
        long,
        value_name = "R",
        default_value_t = 200_000,
        allow_negative_numbers = true
    )]
    pub rate: u64,
    /// Guest workload.
    #[arg(long, value_enum, default_value_t = WorkloadArg::Steady)]
    pub workload: WorkloadArg,
    /// Ring buffer size per vCPU in KiB, reader page included, rounded up to whole pages
    /// (like trace-cmd's -b); at least 3 pages (reader page + 2 ring pages).
    #[arg(
        long = "buffer-kb",
        value_name = "K",
        default_value_t = 1024,
        allow_negative_numbers = true
    )]
    pub buffer_kb: u64,
    /// Ring page size in bytes: a power of two, at least 4096.
    #[arg(
        long = "page-size",
        value_name = "B",
        default_value_t = 4096,
        allow_negative_numbers = true
    )]
    pub page_size: u64,
    /// Guest memory in MiB [default: just enough for the guest image, stacks, parameters
    /// and trace region, rounded up to 2 MiB; at most 3072].
    #[arg(long = "mem-mb", value_name = "M", allow_negative_numbers = true)]
    pub mem_mb: Option<u64>,
    /// Ring mode when full.
    #[arg(long, value_enum, default_value_t = ModeArg::Overwrite)]
    pub mode: ModeArg,
    /// Who swaps the reader page.
    #[arg(long, value_enum, default_value_t = SwapArg::Host)]
    pub swap: SwapArg,
    /// Host reader poll period in milliseconds while the rings are idle (at least 1;
    /// a writer that writes is polled sooner, down to continuously).
    #[arg(
        long = "poll-ms",
        value_name = "MS",
        default_value_t = DEFAULT_POLL_MS,
        allow_negative_numbers = true
    )]
    pub poll_ms: u64,
    /// `--swap guest`: milliseconds a mailbox request (a swap in overwrite mode, a
    /// footer update) may stay unanswered before the writer counts as stuck (an error
    /// naming the CPU), counted while a writer is attached. Generous by default: on a
    /// loaded host a runnable vCPU can wait long for a core.
    #[arg(
        long = "mailbox-timeout-ms",
        value_name = "MS",
        default_value_t = 5000,
        allow_negative_numbers = true
    )]
    pub mailbox_timeout_ms: u64,
    /// Stop the vCPUs after S seconds (decimals allowed, more than 0) [default: run to
    /// completion]. A run stopped this way exits 0.
    #[arg(
        long,
        value_name = "S",
        allow_negative_numbers = true,
        value_parser = crate::pipeline::plan::parse_duration
    )]
    pub duration: Option<f64>,
    /// Write run statistics (JSON) to FILE: the counters per vCPU, how the run ended
    /// ("end"), the crash detail if the guest crashed, the exit code.
    #[arg(long, value_name = "FILE")]
    pub stats: Option<PathBuf>,
    /// Guest payload ELF to load instead of the embedded one.
    #[arg(long, value_name = "PATH")]
    pub guest: Option<PathBuf>,
    /// Clock of every timestamp (text, JSON, raw, trace.dat, --stats): host
    /// CLOCK_MONOTONIC, CLOCK_BOOTTIME, or the raw guest TSC counter.
    #[arg(long, value_enum, default_value_t = crate::drain::clock::ClockKind::Mono)]
    pub clock: crate::drain::clock::ClockKind,
    /// Record the VMM's own events (vCPU exits, swaps, pokes, mailbox timeouts) on the
    /// same clock, as one more CPU (number = --vcpus, comm `vmm`, system `vmm`).
    #[arg(long)]
    pub host_events: bool,
    /// Record only the events PATTERN names (repeatable): SYSTEM:EVENT (globs `*` `?`
    /// in either part, e.g. 'guest:*'), a system or an event name, or `all`
    /// [default: every event the guest registers]. A name no registered event has is an
    /// error (exit 2).
    #[arg(short = 'e', long = "event", value_name = "PATTERN")]
    pub event: Vec<String>,
    /// Do not record the events PATTERN names (repeatable, applied after -e); they count
    /// as skipped.
    #[arg(long, value_name = "PATTERN")]
    pub disable: Vec<String>,
    /// Serve a control socket at PATH while the VM runs (owner-only; a stale socket
    /// there is replaced, anything else refused): `hyptrace ctl PATH enable|disable
    /// EVENT`, `stats`, `list`. Removed at exit.
    #[arg(long, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Flight recorder options (`--drain`, `--hang-timeout`, `--crash-dump`, `--trace-mem`).
    #[command(flatten)]
    pub flight: FlightArgs,
}

/// Who consumes the rings while the guest runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DrainArg {
    /// The VMM's reader drains every ring while the guest runs.
    Live,
    /// Flight recorder: nothing consumes while the guest runs (with --mode overwrite
    /// the rings keep the newest events); the rings are read at the end, on a crash,
    /// or by `hyptrace dump` from --trace-mem.
    None,
}

/// Flight recorder and post-mortem options of `run` and `record`.
#[derive(Clone, Debug, Args)]
pub struct FlightArgs {
    /// Who consumes the rings while the guest runs: `live` (the VMM's reader) or
    /// `none` (flight recorder: read at the end, on a crash or by `hyptrace dump`).
    /// With --mode stop, `none` keeps the first ring-full of events per vCPU.
    #[arg(long, value_enum, default_value_t = DrainArg::Live)]
    pub drain: DrainArg,
    /// A guest that makes no progress for S seconds (no vCPU commits or drops an event
    /// and no vCPU exits) counts as hung: the vCPUs are stopped, the rings dumped as
    /// for a crash, exit 3 [default: no limit].
    #[arg(
        long = "hang-timeout",
        value_name = "S",
        allow_negative_numbers = true,
        value_parser = crate::pipeline::plan::parse_duration
    )]
    pub hang_timeout: Option<f64>,
    /// On a guest crash or hang, write every committed event no reader consumed to
    /// FILE (format from the extension: .dat trace.dat, .json, .txt, .raw) [default:
    /// trace.dat with `run --drain none`, none otherwise: the run's output gets them].
    #[arg(long = "crash-dump", value_name = "FILE")]
    pub crash_dump: Option<PathBuf>,
    /// Put the trace region in a shared mapping of FILE (created owner-only, e.g.
    /// /dev/shm/vm1.trace) that outlives the VMM: `hyptrace dump --trace-mem FILE`
    /// reads it after a SIGKILL or a crash.
    #[arg(long = "trace-mem", value_name = "FILE")]
    pub trace_mem: Option<PathBuf>,
}

/// Why a command failed, mapped to the exit code in one place ([`CliError::exit_code`]).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The command line does not parse (clap's message and hints).
    #[error("{0}")]
    Args(String),
    /// The options of a run do not fit (a flag and its limit).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// An output path is unusable.
    #[error(transparent)]
    Destination(#[from] DestinationError),
    /// The signal handlers could not be installed.
    #[error(transparent)]
    Signals(#[from] SignalError),
    /// The run could not start, or was aborted.
    #[error(transparent)]
    Run(#[from] RunError),
    /// `--stats` could not be written.
    #[error("cannot write stats: {0}")]
    Stats(#[source] OutputError),
    /// `report`/`convert`: the input is not a readable trace, or asks for what its
    /// kind cannot give.
    #[error("{0}")]
    ReportInput(String),
    /// `report`: writing the report to stdout failed.
    #[error("writing the report: {0}")]
    ReportWrite(#[source] std::io::Error),
    /// `--control`: the socket cannot be created at the path.
    #[error(transparent)]
    Control(#[from] crate::control::server::ControlError),
    /// `ctl`: the command cannot be sent.
    #[error("ctl: {0}")]
    CtlUsage(String),
    /// `ctl`: the socket cannot be reached, or its reply is not one.
    #[error("ctl: {0}")]
    Ctl(#[source] crate::control::server::CtlError),
    /// `list`: the guest's events could not be read.
    #[error(transparent)]
    List(#[from] crate::vmm::registration::ListError),
    /// `convert`: writing the output failed.
    #[error("{0}")]
    ConvertOutput(#[source] OutputError),
}

impl CliError {
    /// The exit code: 2 for bad input or environment, 130 for an abort, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Args(_)
            | Self::Plan(_)
            | Self::Destination(_)
            | Self::ReportInput(_)
            | Self::Control(_)
            | Self::CtlUsage(_) => EXIT_USAGE,
            Self::Run(RunError::Aborted) => EXIT_ABORT,
            Self::Run(e) if e.is_input_error() => EXIT_USAGE,
            Self::List(e) => e.exit_code(),
            Self::Signals(_)
            | Self::Run(_)
            | Self::Stats(_)
            | Self::ReportWrite(_)
            | Self::Ctl(_) => EXIT_RUNTIME,
            Self::ConvertOutput(_) => EXIT_RUNTIME,
        }
    }

    /// Says so on stderr (one line; an abort is no error) and returns the exit code.
    fn report(&self) -> i32 {
        match self {
            Self::Run(RunError::Aborted) => note!("hyptrace: {self}"),
            _ => note!("hyptrace: error: {self}"),
        }
        self.exit_code()
    }
}

/// Runs the command line of this process; returns the exit code.
pub fn main() -> i32 {
    main_with(std::env::args_os())
}

/// Runs a command line; returns the exit code.
pub fn main_with<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return args_error(&e),
    };
    crate::cli::logging::init(cli.verbose);
    let r = match cli.command {
        Command::Run(args) => run(&args),
        Command::Record(args) => record(&args),
        Command::List(args) => list(&args),
        Command::Report(args) => crate::pipeline::convert::report(&args).map(|()| EXIT_OK),
        Command::Convert(args) => crate::pipeline::convert::convert(&args).map(|()| EXIT_OK),
        Command::Bench(args) => return crate::bench::bench(&args),
        Command::Dump(args) => return crate::flight::dump::dump(&args),
        Command::Ctl(args) => ctl(&args),
    };
    match r {
        Ok(code) => code,
        Err(e) => e.report(),
    }
}

/// Help and version (exit 0), or a command line that does not parse (exit 2).
fn args_error(e: &clap::Error) -> i32 {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return EXIT_OK;
    }
    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        let _ = e.print();
        return EXIT_USAGE;
    }
    // clap's message whole: the error line, then its hints (valid values, tips,
    // usage), which a user needs to fix the command line.
    let text = e.render().to_string();
    let text = text.trim_end();
    let text = text.strip_prefix("error: ").unwrap_or(text);
    CliError::Args(if text.is_empty() {
        "invalid arguments".into()
    } else {
        text.into()
    })
    .report()
}

/// An output path that cannot receive an output, and why.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path} ({flag}): {why}", path = .path.display(), why = why(.source))]
pub struct DestinationError {
    /// The path given.
    pub path: PathBuf,
    /// The flag that named it.
    pub flag: String,
    /// Why.
    #[source]
    pub source: OutputError,
}

/// An I/O error says why on its own (the path is in the message already).
fn why(e: &OutputError) -> String {
    match e {
        OutputError::Io { source, .. } => source.to_string(),
        e => e.to_string(),
    }
}

/// Checks, before the VM starts, that `path` can receive the output of `flag`, and says
/// in one line why not (`hyptrace_output::OutputTarget::check`: a regular file or a new
/// path is written to a temporary name in its directory and renamed, a symlink is
/// followed, a device or FIFO is written in place, `-` is stdout, a directory or an
/// unwritable place is refused).
pub fn check_destination(path: &Path, flag: &str) -> Result<OutputTarget, DestinationError> {
    OutputTarget::check(path).map_err(|source| DestinationError {
        path: path.to_path_buf(),
        flag: flag.to_string(),
        source,
    })
}

/// Writes `text` to a checked destination (temporary file renamed, or in place).
pub fn write_destination(target: &OutputTarget, text: &str) -> Result<(), OutputError> {
    let mut f = target.open()?;
    f.write_all(text.as_bytes())
        .map_err(|source| OutputError::Io {
            path: Some(target.path().to_path_buf()),
            source,
        })?;
    f.finish()
}

/// `hyptrace run`.
pub fn run(a: &RunArgs) -> Result<i32, CliError> {
    execute(a, None)
}

/// The format of `record`: `--format`, else from the file's extension.
fn record_format(a: &RecordArgs) -> FormatArg {
    format_for(a.format, &a.output)
}

/// `format`, else the format the extension of `output` names (dat otherwise).
pub fn format_for(format: Option<FormatArg>, output: &Path) -> FormatArg {
    format.unwrap_or_else(|| {
        match output
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("json") => FormatArg::Json,
            Some("txt") | Some("text") => FormatArg::Text,
            Some("raw") => FormatArg::Raw,
            Some("pftrace") | Some("perfetto-trace") | Some("perfetto") => FormatArg::Perfetto,
            _ => FormatArg::Dat,
        }
    })
}

/// `hyptrace record`.
pub fn record(a: &RecordArgs) -> Result<i32, CliError> {
    let format = record_format(a);
    let compression = match (format, a.compression) {
        (FormatArg::Dat, c) => c.unwrap_or(CompressionArg::Zstd).into(),
        (_, None | Some(CompressionArg::None)) => hyptrace_output::Compression::None,
        (f, Some(c)) => {
            return Err(CliError::Args(format!(
                "--compression {} applies to --format dat only, not {}",
                format!("{c:?}").to_lowercase(),
                format!("{f:?}").to_lowercase()
            )))
        }
    };
    execute(&a.run, Some((&a.output, format, compression)))
}

/// `hyptrace list`: the guest's registered events on stdout, its rejected entries as
/// warnings on stderr.
pub fn list(a: &ListArgs) -> Result<i32, CliError> {
    let mut argv: Vec<OsString> = ["hyptrace", "run", "--vcpus", "1", "--events", "0"]
        .iter()
        .map(OsString::from)
        .collect();
    if let Some(g) = &a.guest {
        argv.push("--guest".into());
        argv.push(g.clone().into_os_string());
    }
    let Command::Run(run_args) = Cli::try_parse_from(argv)
        .map_err(|e| CliError::Args(e.to_string()))?
        .command
    else {
        unreachable!("parsed as `run`")
    };
    let plan = Plan::new(&run_args)?;
    let (events, rejected) = crate::vmm::registration::list_guest(plan)?;
    for r in rejected {
        note!("hyptrace: warning: {r}");
    }
    let mut text = String::new();
    for e in &events {
        text.push_str(&format!("system: {}\n", e.reg.system));
        text.push_str(&crate::vmm::registration::to_format(&e.reg).to_format_text());
        text.push('\n');
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(CliError::ReportWrite(e)),
        _ => Ok(EXIT_OK),
    }
}

/// `hyptrace ctl`: prints an `ok` reply's payload on stdout (exit 0), an `err` reply on
/// stderr (exit 1).
pub fn ctl(a: &CtlArgs) -> Result<i32, CliError> {
    use crate::control::server::{CtlError, CtlOutcome};
    match crate::control::server::ctl(&a.path, &a.command) {
        Ok(CtlOutcome::Ok(answer)) => {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", answer.text()).and_then(|()| out.flush());
            Ok(EXIT_OK)
        }
        Ok(CtlOutcome::Err(why)) => {
            note!("hyptrace: ctl: err {why}");
            Ok(EXIT_RUNTIME)
        }
        Err(CtlError::Usage(u)) => Err(CliError::CtlUsage(u.0)),
        Err(e) => Err(CliError::Ctl(e)),
    }
}

/// `run` and `record`: checks the options and every output path before the VM boots
/// (a bad one costs nothing), runs the pipeline, prints the report, writes `--stats`.
/// Returns the run's exit code (its causes are on stderr already).
fn execute(
    a: &RunArgs,
    file: Option<(&PathBuf, FormatArg, hyptrace_output::Compression)>,
) -> Result<i32, CliError> {
    let mut plan = Plan::new(a)?;
    if file.is_some() {
        plan.flight.for_record(&a.flight);
    }
    let crash_dump = plan
        .flight
        .crash_dump
        .as_deref()
        .map(|p| check_destination(p, "--crash-dump"))
        .transpose()?;
    if !plan.flight.drain_live && a.mode == ModeArg::Stop {
        note!("hyptrace: note: --drain none with --mode stop keeps the first ring-full of events of each vCPU and drops the rest");
    }
    let target = match file {
        None => Target::Stdout,
        Some((path, format, compression)) => Target::File {
            target: check_destination(path, "-o")?,
            path: path.clone(),
            format,
            compression,
        },
    };
    let stats = a
        .stats
        .as_deref()
        .map(|p| check_destination(p, "--stats"))
        .transpose()?;
    // Before any temporary file exists: a signal from now on stops or aborts cleanly.
    let interrupts = Interrupts::install()?;
    // Last of the checks (a refused path costs nothing); removed when dropped, on every
    // way out of this function.
    // (The socket itself is bound by the run, once the trace memory file exists.)
    if let Some(p) = a.control.as_deref() {
        crate::control::server::ControlServer::check(p)?;
    }
    let mut run = Run::new(plan, target)
        .interrupts(interrupts)
        .crash_dump(crash_dump);
    if let Some(c) = a.control.as_deref() {
        run = run.control(c);
    }
    let report = run.execute()?;
    let _ = write!(std::io::stderr(), "{report}");
    let code = report.exit_code();
    if let Some(st) = &stats {
        write_destination(st, &report.stats_json(code)).map_err(CliError::Stats)?;
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations() {
        let dir = std::env::temp_dir().join(format!("hyptrace-dest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let p = |n: &str| dir.join(n);
        let err = |path: &Path, flag: &str| {
            check_destination(path, flag)
                .expect_err("accepted")
                .to_string()
        };
        std::fs::write(p("file"), b"x").expect("write");
        // New file, existing file, a symlink to either: fine.
        check_destination(&p("new.dat"), "-o").expect("new file");
        check_destination(&p("file"), "-o").expect("existing file");
        std::os::unix::fs::symlink(p("file"), p("link")).expect("symlink");
        check_destination(&p("link"), "-o").expect("symlink to a file");
        std::os::unix::fs::symlink(p("later"), p("dangling")).expect("symlink");
        check_destination(&p("dangling"), "-o").expect("dangling symlink, target creatable");
        std::os::unix::fs::symlink("/nonexistent/dir/x", p("nowhere")).expect("symlink");
        let e = err(&p("nowhere"), "-o");
        assert!(e.contains("does not exist"), "{e}");
        // A FIFO is written in place.
        let fifo = std::ffi::CString::new(p("fifo").as_os_str().as_encoded_bytes()).expect("c");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        check_destination(&p("fifo"), "-o").expect("fifo");
        // Refused: a directory, a missing directory, a file used as a directory.
        let e = err(&dir, "--stats");
        assert!(
            e.contains("(--stats)") && e.contains("is a directory"),
            "{e}"
        );
        let e = err(&p("sub/"), "-o");
        assert!(e.contains("directory"), "{e}");
        let e = err(&p("missing/x.json"), "--json");
        assert!(e.contains("does not exist"), "{e}");
        let e = err(&p("file/x.json"), "--json");
        assert!(e.contains("--json"), "{e}");
        let e = err(Path::new(""), "-o");
        assert!(e.contains("empty"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn guest_text_escaped() {
        assert_eq!(
            hyptrace_output::escape_guest_str("plain text"),
            "plain text"
        );
        assert_eq!(
            hyptrace_output::escape_guest_str("a\x1b[2Jb\n"),
            "a\\x1b[2Jb\\n"
        );
    }

    /// The OS error under a message, found by walking `source()`.
    fn os_error(e: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
        let mut cur = Some(e);
        while let Some(e) = cur {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                return Some(io.kind());
            }
            cur = e.source();
        }
        None
    }

    /// Errors keep their sources: the I/O error under "cannot read guest image" and
    /// under "cannot write ... (-o)" is reachable through `source()`.
    #[test]
    fn errors_keep_their_sources() {
        let a = match Cli::try_parse_from(["hyptrace", "run", "--guest", "/nonexistent/g.elf"])
            .expect("parses")
            .command
        {
            Command::Run(a) => a,
            c => panic!("not run: {c:?}"),
        };
        let e = CliError::from(Plan::new(&a).expect_err("no such guest"));
        assert!(e.to_string().contains("cannot read guest image"), "{e}");
        assert_eq!(os_error(&e), Some(std::io::ErrorKind::NotFound), "{e:?}");
        assert_eq!(e.exit_code(), EXIT_USAGE);
        let e = CliError::from(
            check_destination(Path::new("/nonexistent/dir/x.dat"), "-o").expect_err("no dir"),
        );
        assert!(os_error(&e).is_some(), "{e:?}");
    }

    /// Each kind of failure maps to its exit code.
    #[test]
    fn exit_codes() {
        assert_eq!(CliError::Args("x".into()).exit_code(), EXIT_USAGE);
        assert_eq!(CliError::Plan(PlanError::PollMs).exit_code(), EXIT_USAGE);
        assert_eq!(CliError::Run(RunError::Aborted).exit_code(), EXIT_ABORT);
        let kvm = crate::vmm::error::Error::KvmUnavailable("/dev/kvm".into());
        assert_eq!(CliError::Run(RunError::Vm(kvm)).exit_code(), EXIT_USAGE);
        let io = std::io::Error::other("x");
        assert_eq!(CliError::ReportWrite(io).exit_code(), EXIT_RUNTIME);
    }
}
