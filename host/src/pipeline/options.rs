//! The options of the commands as the user gives them (clap derives them from these
//! types; the CLI composes them into its commands): what a run, a record, a report, a
//! conversion, a listing and a control command take. One definition of each option; the
//! pipeline checks them once ([`crate::pipeline::plan::Plan::new`]).
//!
//! This file, `bench/options.rs` and `cli/` are the only places
//! clap appears (tests/layers.rs checks it): the value enums here convert into the
//! lower layers' own types ([`Format`], [`Compression`], [`ClockKind`]) with `From`.

use std::path::{Path, PathBuf};

use clap::{ArgGroup, Args, ValueEnum};
use hyptrace_abi::guest::Workload;

use hyptrace_output::{Compression, OutputTarget};

use crate::drain::sink::{check_with, DestinationError, FileOpts, Format};
use crate::flight::dump::{DumpPlan, DumpSource};
use crate::vmm::memory_map::MAX_VCPUS;
use crate::vmm::time::ClockKind;

/// Longest `--duration`, in seconds (about 31 years).
pub const MAX_DURATION_S: f64 = 1e9;

/// Why a `--duration` value is refused (clap prints it after the flag).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not a number.
    #[error("not a number of seconds (e.g. 2 or 0.5)")]
    NotANumber,
    /// Infinite.
    #[error("must be a finite number of seconds, at most {MAX_DURATION_S:.0} (leave --duration out to run to completion)")]
    Infinite,
    /// 0 or negative.
    #[error("must be more than 0 seconds")]
    NotPositive,
    /// Above [`MAX_DURATION_S`].
    #[error("more than the limit of {MAX_DURATION_S:.0} seconds")]
    OverLimit,
}

/// `--duration`: seconds, finite, more than 0, at most [`MAX_DURATION_S`].
pub fn parse_duration(s: &str) -> Result<f64, DurationError> {
    let v: f64 = s.trim().parse().map_err(|_| DurationError::NotANumber)?;
    if v.is_nan() {
        Err(DurationError::NotANumber)
    } else if v.is_infinite() {
        Err(DurationError::Infinite)
    } else if v <= 0.0 {
        Err(DurationError::NotPositive)
    } else if v > MAX_DURATION_S {
        Err(DurationError::OverLimit)
    } else {
        Ok(v)
    }
}

/// Why an `--events` value is refused (clap prints it after the flag).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventCountError {
    /// A number, but not a count.
    #[error("not a count of events (0 to {})", u64::MAX)]
    NotACount,
    /// Not a number: likely an event name meant for -e.
    #[error(
        "--events N is the number of events each vCPU writes; to select events use -e/--event {0}"
    )]
    EventName(String),
}

/// `run`/`record --events`: the number of events each vCPU writes.
pub fn parse_event_count(s: &str) -> Result<u64, EventCountError> {
    let t = s.trim();
    t.parse().map_err(|_| {
        if t.trim_start_matches(['-', '+'])
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            EventCountError::NotACount
        } else {
            EventCountError::EventName(s.to_string())
        }
    })
}

/// The reader's poll period while the rings are idle (`--poll-ms`): a wake-up costs
/// ~23 µs of CPU on the nested-virtualisation machines this was measured on, so 1 ms
/// cost 2.2 % of a core for an idle VM and 5 ms costs 0.4 % (docs/benchmarks.md); a
/// writer that writes is polled sooner (down to continuously) whatever the period.
pub const DEFAULT_POLL_MS: u64 = 5;

// The other defaults of `run`/`record`, shared by their clap attributes and
// `RunArgs::default()` (one value each).
const DEFAULT_VCPUS: u32 = 2;
const DEFAULT_EVENTS: u64 = 100_000;
const DEFAULT_RATE: u64 = 200_000;
/// `--buffer-kb`: a ring that lasts ~10 ms for a writer at a quarter of its flat-out
/// rate here (~17 M events/s, 470 MB/s), so the reader rides out the stalls of the
/// hypervisor below (1.5–5 ms measured) in stop mode (docs/benchmarks.md).
pub const DEFAULT_BUFFER_KB: u64 = 4096;
const DEFAULT_PAGE_SIZE: u64 = 4096;
const DEFAULT_MAILBOX_TIMEOUT_MS: u64 = 5000;

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

/// Options of `hyptrace collect`.
#[derive(Clone, Debug, Args)]
pub struct CollectArgs {
    /// Keep reading until every VM's vCPUs ended (or Ctrl-C), instead of collecting
    /// what is there now.
    #[arg(long)]
    pub follow: bool,
    /// Output: a trace.dat (v7, zstd; one buffer instance per VM), text (`.txt`,
    /// `.text`: `trace-cmd report -t` lines merged by time, each prefixed with its VM's
    /// name), Perfetto (`.pftrace`) or Chrome JSON (`.json`) (a process per VM, named
    /// after it), written to a temporary name and renamed when complete; `-` is stdout.
    /// `clickhouse://HOST:PORT/DATABASE`: each VM's events rows of a ClickHouse server
    /// (`vm` = its name), stored once every VM was read (docs/fleet.md).
    #[arg(short = 'o', long = "output", value_name = "FILE", required = true)]
    pub output: PathBuf,
    /// Output format: dat, text, json or perfetto [default: from the extension; no
    /// extension or `-`: dat].
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// The VMs: each the control socket of a running `run --drain none --control
    /// SOCKET` (on --clock mono, the default), named `NAME=SOCKET` or, without a name,
    /// by the socket's file stem. A name is 1 to 64 of [A-Za-z0-9_.-], once each; at
    /// most 64 VMs.
    #[arg(value_name = "NAME=SOCKET", required = true, num_args = 1..)]
    pub vms: Vec<String>,
    /// Record the host kernel's ftrace EVENTS too, once (comma-separated, repeatable:
    /// SYSTEM:EVENT with globs, a system or an event name, e.g.
    /// 'sched:sched_switch,irq:*'), through a private tracefs instance on the `mono`
    /// clock (the VMs' time line), every task's, as the buffer instance `host` (a
    /// process `host` in JSON/Perfetto). Needs a writable /sys/kernel/tracing (root);
    /// not with clickhouse://.
    #[arg(long, value_name = "EVENTS")]
    pub host_trace: Vec<String>,
    /// `--output-mode` of the output file.
    #[command(flatten)]
    pub files: OutputModeArg,
}

/// Options of `hyptrace record`.
#[derive(Clone, Debug, Args)]
pub struct RecordArgs {
    /// Output file: a regular file is written to a temporary name and renamed when
    /// complete (a symlink's target is written that way); a device, a FIFO or `-`
    /// (stdout) is written in place. A directory or an unwritable location is refused
    /// before the VM starts. `clickhouse://HOST:PORT/DATABASE[?vm=NAME]`: every event a
    /// row of a ClickHouse server (docs/fleet.md).
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        default_value = "trace.dat"
    )]
    pub output: PathBuf,
    /// Output format [default: from the extension: .dat → dat, .json → json, .txt/.text
    /// → text, .raw → raw, .pftrace/.perfetto-trace/.perfetto → perfetto; no extension
    /// (`-`, a device) → dat; any other extension is refused (exit 2)].
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// Compression of a trace.dat v7 (`--format dat`) [default: zstd, like trace-cmd];
    /// `none` writes the pages uncompressed. Other formats are never compressed.
    #[arg(long, value_enum, value_name = "C")]
    pub compression: Option<CompressionArg>,
    /// `-F`: the events to write.
    #[command(flatten)]
    pub filters: FilterArgs,
    /// Options of the run.
    #[command(flatten)]
    pub run: RunArgs,
}

/// `-F` of `report`, `convert` and `record`: trace-cmd's event filters.
#[derive(Clone, Debug, Default, Args)]
pub struct FilterArgs {
    /// Only the events FILTER passes, as `trace-cmd report -F` (libtraceevent's
    /// filters): `EVENTS` or `'EVENTS: EXPR'`. EVENTS: comma-separated
    /// `[SYSTEM/]EVENT`, each a regular expression matched whole, ignoring case (an
    /// EVENT alone also names a whole system: `sched`); EXPR: comparisons of the
    /// event's fields (`== != < <= > >=` on numbers, decimal or 0x hex; `== != =~ !~`
    /// on strings, `=~` a regex; `COMM`, `CPU`), bit tests (`flags & 4`), `&&`, `||`
    /// (one precedence, left to right, as libtraceevent), `!`, parentheses, e.g.
    /// 'sched_switch: prev_pid != 0 && next_comm =~ "vcpu"', 'marker: seq > 5'.
    /// hyptrace's `SYSTEM:EVENT` globs (`guest:marker`, `sched:*`) are kept. Repeatable:
    /// an event is kept when any -F passes it. An unknown event or field is exit 2; a
    /// filter that passes nothing says so on stderr. `convert` and `record` write only
    /// the kept events, in every format (a trace.dat's or raw stream's pages re-encoded
    /// with the kept events' exact times), and say on stderr how many -F dropped.
    #[arg(short = 'F', long = "filter", value_name = "FILTER")]
    pub filter: Vec<String>,
}

/// Options of `hyptrace report`.
#[derive(Clone, Debug, Args)]
pub struct ReportArgs {
    /// The trace to read: trace.dat (v6, v7, v7 compressed with zstd) or a raw page
    /// stream, told apart by their magic; `-` is stdin (a raw stream is read as it
    /// comes, a piped trace.dat is first copied to an unlinked temporary file)
    /// [default: trace.dat].
    #[arg(value_name = "FILE", conflicts_with = "input_flag")]
    pub input: Option<PathBuf>,
    /// The trace to read (as trace-cmd's -i).
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    pub input_flag: Option<PathBuf>,
    /// Print the per-CPU statistics instead of the events.
    #[arg(long)]
    pub stat: bool,
    /// Full timestamps, not truncated to 6 places (as trace-cmd's -t): accepted for
    /// trace-cmd's command lines; hyptrace's report always prints full nanoseconds.
    #[arg(short = 't')]
    pub full_time: bool,
    /// Only these CPUs: a list of numbers and ranges, e.g. `0,2-3` (repeatable).
    #[arg(long = "cpu", value_name = "LIST", value_parser = parse_cpu_list)]
    pub cpu: Vec<Vec<u32>>,
    /// `-F`: the events to print.
    #[command(flatten)]
    pub filters: FilterArgs,
    /// Not a report flag (`--events N` is the event count of `run`/`record`): refused
    /// with a pointer to -F.
    #[arg(long = "events", hide = true, value_name = "X", num_args = 0..)]
    pub events_misused: Option<Vec<String>>,
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

/// Highest CPU number a `--cpu` list may name.
const MAX_CPU: u32 = 65535;

/// Why a `--cpu` list is refused (clap prints it after the flag).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuListError {
    /// A part that is not a CPU number.
    #[error("`{0}` is not a CPU number (0 to {MAX_CPU})")]
    NotACpu(String),
    /// A range whose end is below its start.
    #[error("range `{0}` goes backwards")]
    Backwards(String),
}

/// Parses a CPU list: numbers and ranges separated by commas (`0,2-3`).
pub fn parse_cpu_list(s: &str) -> Result<Vec<u32>, CpuListError> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .ok()
                .filter(|&n| n <= MAX_CPU)
                .ok_or_else(|| CpuListError::NotACpu(t.to_string()))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(CpuListError::Backwards(part.to_string()));
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    Ok(out)
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

impl From<FormatArg> for Format {
    fn from(f: FormatArg) -> Self {
        match f {
            FormatArg::Dat => Self::Dat,
            FormatArg::Dat6 => Self::Dat6,
            FormatArg::Json => Self::Json,
            FormatArg::Perfetto => Self::Perfetto,
            FormatArg::Text => Self::Text,
            FormatArg::Raw => Self::Raw,
        }
    }
}

/// `--format`, converted (`None`: from the output's extension).
pub fn format(f: Option<FormatArg>) -> Option<Format> {
    f.map(Format::from)
}

/// Compressions of a v7 trace.dat (`record --compression`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CompressionArg {
    /// zstd, as `trace-cmd record` writes by default.
    Zstd,
    /// Uncompressed: pages copied verbatim.
    None,
}

impl From<CompressionArg> for Compression {
    fn from(c: CompressionArg) -> Self {
        match c {
            CompressionArg::Zstd => Self::Zstd,
            CompressionArg::None => Self::None,
        }
    }
}

/// The clock every output uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum ClockArg {
    /// Host `CLOCK_MONOTONIC` (what `clock_gettime`, `perf` and trace-cmd's `mono` use).
    #[default]
    Mono,
    /// Host `CLOCK_BOOTTIME` (monotonic + time suspended).
    Boot,
    /// Raw guest TSC cycles, unconverted (like trace-cmd's `x86-tsc` clock without
    /// TSC2NSEC).
    Tsc,
}

impl From<ClockArg> for ClockKind {
    fn from(c: ClockArg) -> Self {
        match c {
            ClockArg::Mono => Self::Mono,
            ClockArg::Boot => Self::Boot,
            ClockArg::Tsc => Self::Tsc,
        }
    }
}

/// `--output-mode MODE` of the commands that write files from trace data (`run`,
/// `record`, `dump`, `convert`): the permission bits those files are created with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Args)]
pub struct OutputModeArg {
    /// Permission bits (octal, 000-777) of the files written from trace data — the
    /// output, --stats, a crash dump — less the umask. Owner-only by default (the trace
    /// may be private); e.g. 0644 lets others read them. A device, a FIFO or stdout
    /// keeps its own mode.
    #[arg(
        long = "output-mode",
        value_name = "MODE",
        default_value = "0600",
        value_parser = parse_mode
    )]
    pub output_mode: u32,
    /// Write every whole block of the regular files made from trace data (the output,
    /// its per-CPU spill files, --stats, a crash dump) past the page cache (O_DIRECT, in
    /// 4 MiB blocks on a thread per file; where the file system refuses it, silently
    /// through the cache). Without it each 1 MiB block goes the way the last writes
    /// measured faster, the page cache or past it. Forcing it leaves no dirty pages to
    /// flush at the end, but the output goes at the disk's pace even where the page
    /// cache would take a burst of a few GB, and each file holds up to 12 MiB of buffers.
    /// See docs/output.md
    #[arg(long = "direct-io")]
    pub direct_io: bool,
}

impl Default for OutputModeArg {
    fn default() -> Self {
        Self {
            output_mode: OutputTarget::PRIVATE,
            direct_io: false,
        }
    }
}

impl OutputModeArg {
    /// How the files are made.
    pub fn opts(&self) -> FileOpts {
        FileOpts {
            mode: self.output_mode,
            direct_io: self.direct_io,
        }
    }

    /// [`check_destination`](crate::drain::sink::check_destination), the file to be
    /// made as these options say.
    pub fn check(&self, path: &Path, flag: &str) -> Result<OutputTarget, DestinationError> {
        check_with(path, flag, self.opts())
    }
}

/// Parses `--output-mode`: 3 or 4 octal digits (`644`, `0644`), permission bits only
/// (no set-id or sticky bit).
pub fn parse_mode(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    let ok = (3..=4).contains(&digits.len()) && digits.bytes().all(|b| (b'0'..=b'7').contains(&b));
    match u32::from_str_radix(digits, 8) {
        Ok(m) if ok && m <= 0o777 => Ok(m),
        _ => Err("expected octal permission bits 000-777, e.g. 0600 or 0644".into()),
    }
}

/// Options of `hyptrace convert`.
#[derive(Clone, Debug, Args)]
pub struct ConvertArgs {
    /// The trace to read: trace.dat (v6, v7, v7 zstd; ours or the kernel's) or a raw
    /// page stream; `-` is stdin (as `report -`).
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    pub input: PathBuf,
    /// Output file (`-` is stdout; a regular file is written to a temporary name and
    /// renamed when complete), or `clickhouse://HOST:PORT/DATABASE[?vm=NAME]`: every
    /// event a row of a ClickHouse server (docs/fleet.md).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    /// Output format [default: from the extension of -o, as `record`].
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// Compression of a trace.dat v7 (`--format dat`) [default: zstd, like trace-cmd];
    /// `none` writes the pages uncompressed. Other formats are never compressed.
    #[arg(long, value_enum, value_name = "C")]
    pub compression: Option<CompressionArg>,
    /// `-F`: the events to write.
    #[command(flatten)]
    pub filters: FilterArgs,
    /// `--output-mode` of the output file.
    #[command(flatten)]
    pub files: OutputModeArg,
}

/// Options of `hyptrace dump`: exactly one of `--trace-mem` and `--attach` (one group,
/// so the usage shows both forms).
#[derive(Clone, Debug, Args)]
#[command(group(
    ArgGroup::new("source")
        .required(true)
        .multiple(false)
        .args(["trace_mem", "attach"])
))]
pub struct DumpArgs {
    /// The trace memory file a VMM ran with (`run`/`record --trace-mem PATH`), killed,
    /// crashed or finished.
    #[arg(long = "trace-mem", value_name = "PATH")]
    pub trace_mem: Option<PathBuf>,
    /// Live attach: read a running VMM's rings through its control socket (the VMM runs
    /// `--drain none --trace-mem FILE --control SOCKET`; one consumer at a time).
    #[arg(long = "attach", value_name = "SOCKET")]
    pub attach: Option<PathBuf>,
    /// With --attach: keep reading until the VM exits (or SIGINT), instead of draining
    /// what is there now.
    #[arg(long, requires = "attach")]
    pub follow: bool,
    /// Output file (as `record -o`: written to a temporary name and renamed; `-` is
    /// stdout).
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        default_value = "trace.dat"
    )]
    pub output: PathBuf,
    /// Output format [default: from the extension, as `record`].
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// `--output-mode` of the output file.
    #[command(flatten)]
    pub files: OutputModeArg,
}

impl DumpArgs {
    /// The typed plan of these options.
    pub fn plan(&self) -> DumpPlan {
        let source = match (&self.trace_mem, &self.attach) {
            (Some(p), _) => Some(DumpSource::TraceMem(p.clone())),
            (None, Some(socket)) => Some(DumpSource::Attach {
                socket: socket.clone(),
                follow: self.follow,
            }),
            (None, None) => None,
        };
        DumpPlan {
            source,
            output: self.output.clone(),
            format: format(self.format),
            files: self.files.opts(),
        }
    }
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
    /// Bursts of 1024 back-to-back events with pauses, far above the drain rate (with
    /// `--swap guest` the mailbox is served between bursts only).
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

impl From<ModeArg> for hyptrace_abi::layout::Mode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Overwrite => Self::Overwrite,
            ModeArg::Stop => Self::Stop,
        }
    }
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

/// Where the guest rings the VMM (docs/abi.md, "Doorbell").
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DoorbellArg {
    /// Port I/O (`out` to ports 0x512 and 0x510): every guest's.
    Port,
    /// Stores to an unbacked guest-physical page, whose address the guest gets in its
    /// entry `rcx`; a guest that rings by port anyway is a guest fault (exit 3).
    Mmio,
}

impl From<DoorbellArg> for crate::vmm::vm::DoorbellKind {
    fn from(d: DoorbellArg) -> Self {
        match d {
            DoorbellArg::Port => Self::Port,
            DoorbellArg::Mmio => Self::Mmio,
        }
    }
}

/// Options of `hyptrace run`.
#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// Number of vCPUs (one host thread each), 1 to 256.
    #[arg(
        long,
        value_name = "N",
        default_value_t = DEFAULT_VCPUS,
        allow_negative_numbers = true,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_VCPUS))
    )]
    pub vcpus: u32,
    /// Events each vCPU writes (a count; to select events use -e/--event).
    #[arg(
        long,
        value_name = "N",
        default_value_t = DEFAULT_EVENTS,
        allow_negative_numbers = true,
        value_parser = parse_event_count
    )]
    pub events: u64,
    /// Events per second per vCPU; 0 = as fast as possible. The guest catches up at most
    /// 200 µs on its schedule: held off its core longer, it goes on at R and ends later.
    #[arg(
        long,
        value_name = "R",
        default_value_t = DEFAULT_RATE,
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
        default_value_t = DEFAULT_BUFFER_KB,
        allow_negative_numbers = true
    )]
    pub buffer_kb: u64,
    /// Ring page size in bytes: a power of two, at least 4096.
    #[arg(
        long = "page-size",
        value_name = "B",
        default_value_t = DEFAULT_PAGE_SIZE,
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
        default_value_t = DEFAULT_MAILBOX_TIMEOUT_MS,
        allow_negative_numbers = true
    )]
    pub mailbox_timeout_ms: u64,
    /// Stop the vCPUs after S seconds (decimals allowed, more than 0) [default: run to
    /// completion]. A run stopped this way exits 0.
    #[arg(
        long,
        value_name = "S",
        allow_negative_numbers = true,
        value_parser = parse_duration
    )]
    pub duration: Option<f64>,
    /// Write run statistics (JSON) to FILE: the counters per vCPU, how the run ended
    /// ("end"), the crash detail if the guest crashed, the exit code.
    #[arg(long, value_name = "FILE")]
    pub stats: Option<PathBuf>,
    /// Guest payload ELF to load instead of the embedded one.
    #[arg(long, value_name = "PATH")]
    pub guest: Option<PathBuf>,
    /// How the guest rings the VMM to have its event registration answered and to say it
    /// finished: port I/O, or stores to an MMIO page (the embedded guest, the Rust
    /// template and C guests using ht_attach_doorbell follow what the VMM says).
    #[arg(long, value_enum, default_value_t = DoorbellArg::Port)]
    pub doorbell: DoorbellArg,
    /// Clock of every timestamp (text, JSON, raw, trace.dat, --stats): host
    /// CLOCK_MONOTONIC, CLOCK_BOOTTIME, or the raw guest TSC counter.
    #[arg(long, value_enum, default_value_t = ClockArg::Mono)]
    pub clock: ClockArg,
    /// Record the VMM's own events (vCPU exits, swaps, pokes, mailbox timeouts) on the
    /// same clock, as one more CPU (number = --vcpus, comm `vmm`, system `vmm`).
    #[arg(long)]
    pub host_events: bool,
    /// Record the host kernel's ftrace EVENTS too (comma-separated, repeatable:
    /// SYSTEM:EVENT with globs, a system or an event name, e.g.
    /// 'sched:sched_switch,irq:*'), through a private tracefs instance on the x86-tsc
    /// clock, as more CPUs after the guest's (and the VMM's). Only the vCPU threads'
    /// events unless --host-trace-all. Needs a writable /sys/kernel/tracing (root).
    #[arg(long, value_name = "EVENTS")]
    pub host_trace: Vec<String>,
    /// With --host-trace: every task's events, not only the vCPU threads'.
    #[arg(long, requires = "host_trace")]
    pub host_trace_all: bool,
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
    /// `--output-mode` of the output, --stats and crash dump files.
    #[command(flatten)]
    pub files: OutputModeArg,
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
        value_parser = parse_duration
    )]
    pub hang_timeout: Option<f64>,
    /// On a guest crash or hang, write every committed event no reader consumed to
    /// FILE (format from the extension, as `record -o`: .dat trace.dat, .json, .txt,
    /// .raw, .pftrace perfetto; an unknown extension is refused) [default:
    /// trace.dat with `run --drain none`, none otherwise: the run's output gets them].
    #[arg(long = "crash-dump", value_name = "FILE")]
    pub crash_dump: Option<PathBuf>,
    /// Put the trace region in a shared mapping of FILE (created owner-only, e.g.
    /// /dev/shm/vm1.trace) that outlives the VMM: `hyptrace dump --trace-mem FILE`
    /// reads it after a SIGKILL or a crash.
    #[arg(long = "trace-mem", value_name = "FILE")]
    pub trace_mem: Option<PathBuf>,
}

impl Default for FlightArgs {
    /// The defaults the command line gives (`--drain live`, nothing else).
    fn default() -> Self {
        Self {
            drain: DrainArg::Live,
            hang_timeout: None,
            crash_dump: None,
            trace_mem: None,
        }
    }
}

impl Default for RunArgs {
    /// The options of a bare `hyptrace run` (the tests check they are what clap gives):
    /// what the bench harness and `list` start from, as typed values.
    fn default() -> Self {
        Self {
            vcpus: DEFAULT_VCPUS,
            events: DEFAULT_EVENTS,
            rate: DEFAULT_RATE,
            workload: WorkloadArg::Steady,
            buffer_kb: DEFAULT_BUFFER_KB,
            page_size: DEFAULT_PAGE_SIZE,
            mem_mb: None,
            mode: ModeArg::Overwrite,
            swap: SwapArg::Host,
            poll_ms: DEFAULT_POLL_MS,
            mailbox_timeout_ms: DEFAULT_MAILBOX_TIMEOUT_MS,
            duration: None,
            stats: None,
            guest: None,
            doorbell: DoorbellArg::Port,
            clock: ClockArg::Mono,
            host_events: false,
            host_trace: Vec::new(),
            host_trace_all: false,
            event: Vec::new(),
            disable: Vec::new(),
            control: None,
            flight: FlightArgs::default(),
            files: OutputModeArg::default(),
        }
    }
}

/// `hyptrace run EXTRA..` parsed as the command line parses it (the tests of the plan).
#[cfg(test)]
pub(crate) fn parse_run(extra: &[&str]) -> Result<RunArgs, clap::Error> {
    use clap::Parser;
    #[derive(Parser)]
    struct Line {
        #[command(flatten)]
        run: RunArgs,
    }
    Line::try_parse_from(std::iter::once("run").chain(extra.iter().copied())).map(|l| l.run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::sink::check_destination;

    /// `RunArgs::default()` is what a bare `hyptrace run` parses into.
    #[test]
    fn run_defaults_are_the_command_lines() {
        let parsed = parse_run(&[]).expect("parses");
        assert_eq!(format!("{parsed:?}"), format!("{:?}", RunArgs::default()));
    }

    /// Every `--format`/`--compression`/`--clock` value converts to the lower layers'
    /// own value of the same name.
    #[test]
    fn value_enums_convert_by_name() {
        for f in FormatArg::value_variants() {
            let name = f.to_possible_value().map(|v| v.get_name().to_string());
            assert_eq!(name.as_deref(), Some(Format::from(*f).name()));
        }
        for c in CompressionArg::value_variants() {
            let name = c.to_possible_value().map(|v| v.get_name().to_string());
            let lower = crate::drain::sink::compression_name(Compression::from(*c));
            assert_eq!(name.as_deref(), Some(lower));
        }
        for c in ClockArg::value_variants() {
            let name = c.to_possible_value().map(|v| v.get_name().to_string());
            assert_eq!(name.as_deref(), Some(ClockKind::from(*c).name()));
        }
    }

    #[test]
    fn output_modes() {
        assert_eq!(parse_mode("0600"), Ok(0o600));
        assert_eq!(parse_mode("644"), Ok(0o644));
        assert_eq!(parse_mode("0o640"), Ok(0o640));
        for bad in [
            "", "6", "64", "4755", "1777", "0x644", "0888", "u+r", "00644",
        ] {
            assert!(parse_mode(bad).is_err(), "{bad}");
        }
        let dir = std::env::temp_dir();
        let t = OutputModeArg {
            output_mode: 0o644,
            direct_io: false,
        }
        .check(&dir.join("x.dat"), "-o")
        .expect("check");
        assert_eq!(t.mode(), 0o644);
        assert!(!t.is_direct_io());
        let t = check_destination(&dir.join("x.dat"), "-o").expect("check");
        assert_eq!(t.mode(), OutputTarget::PRIVATE);
        assert!(!t.is_direct_io(), "through the page cache by default");
        // --direct-io reaches the target (`run`, `record`, `convert`, `dump` check
        // through it).
        let run = parse_run(&["--direct-io"]).expect("parses");
        let t = run.files.check(&dir.join("x.dat"), "-o").expect("check");
        assert!(t.is_direct_io());
    }
}
