//! The `hyptrace` command line.
//!
//! Exit codes: [`EXIT_OK`] 0, [`EXIT_RUNTIME`] 1 (a host-side failure), [`EXIT_USAGE`] 2
//! (bad input, no usable /dev/kvm), [`EXIT_CRASH`] 3 (the guest panicked or faulted).
//! Errors are one line on stderr: `hyptrace: error: ...`.

use std::borrow::Cow;
use std::ffi::OsString;
use std::fmt::Write as _;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use hyptrace_abi::guest::{Workload, RUN_FLAG_SERVE_MAILBOX};
use hyptrace_abi::layout as ring;

use hyptrace_output::{
    Clock, JsonSink, PageSink, RawSink, TextSink, TraceDatSink, TraceDatVersion, TraceMeta,
};
use hyptrace_reader::Merger;
use std::io::{IsTerminal, Write};

use crate::elf::GuestImage;
use crate::layout::{Layout, HUGE_PAGE, MAX_MEM_BYTES, MAX_VCPUS, MIN_MEM_BYTES};
use crate::trace::{alloc_reader, Output, Session};
use crate::vcpu::VcpuOutcome;
use crate::vm::{RunParams, Vm, VmConfig, DEFAULT_SEED};
use crate::GUEST_ELF;

/// Success.
pub const EXIT_OK: i32 = 0;
/// A failure at run time (host side).
pub const EXIT_RUNTIME: i32 = 1;
/// Bad input or environment.
pub const EXIT_USAGE: i32 = 2;
/// The guest crashed.
pub const EXIT_CRASH: i32 = 3;

/// hyptrace: per-vCPU tracing ring buffers in guest memory, read by the host.
#[derive(Debug, Parser)]
#[command(
    name = "hyptrace",
    version,
    about = "hyptrace: per-vCPU tracing ring buffers in guest memory, written by the guest, read by the host",
    propagate_version = true
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Boot the guest on KVM, run a workload on every vCPU, print every event (merged
    /// by time, as `trace-cmd report -t` prints them) and a per-CPU summary.
    Run(RunArgs),
    /// Like `run`, but stream the ring pages into a file: trace.dat (v7 or v6) that
    /// trace-cmd and KernelShark read, Chrome trace-event JSON, text, or raw pages.
    Record(RecordArgs),
    /// Print a trace.dat (ours or one trace-cmd wrote) as `trace-cmd report -t` does.
    Report(ReportArgs),
    /// Measure the writer in the guest and natively, drain throughput, swap latency in
    /// both modes, the highest loss-free rate and start-up time; print a table and
    /// optionally write JSON (see docs/benchmarks.md).
    Bench(crate::bench::BenchArgs),
}

/// Output formats of `record`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// trace.dat version 7 (trace-cmd's current format), uncompressed.
    Dat,
    /// trace.dat version 6.
    Dat6,
    /// Chrome trace-event JSON (Perfetto UI, chrome://tracing).
    Json,
    /// Text, one event per line as `trace-cmd report -t` prints it.
    Text,
    /// Raw ring pages (see docs/output.md).
    Raw,
}

/// Options of `hyptrace record`.
#[derive(Clone, Debug, Args)]
pub struct RecordArgs {
    /// Output file (written to a temporary name, renamed when complete).
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        default_value = "trace.dat"
    )]
    pub output: PathBuf,
    /// Output format [default: from the extension: .dat → dat, .json → json, .txt →
    /// text, .raw → raw; otherwise dat].
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// Options of the run.
    #[command(flatten)]
    pub run: RunArgs,
}

/// Options of `hyptrace report`.
#[derive(Clone, Debug, Args)]
pub struct ReportArgs {
    /// The trace.dat to read (v6, v7, v7 compressed with zstd).
    #[arg(
        short = 'i',
        long = "input",
        value_name = "FILE",
        default_value = "trace.dat"
    )]
    pub input: PathBuf,
    /// Print the per-CPU statistics instead of the events.
    #[arg(long)]
    pub stat: bool,
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
}

impl From<WorkloadArg> for Workload {
    fn from(w: WorkloadArg) -> Self {
        match w {
            WorkloadArg::Steady => Workload::Steady,
            WorkloadArg::Mixed => Workload::Mixed,
            WorkloadArg::Burst => Workload::Burst,
            WorkloadArg::Panic => Workload::Panic,
            WorkloadArg::Fault => Workload::Fault,
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
    /// The guest swaps on the host's mailbox requests.
    Guest,
}

/// Options of `hyptrace run`.
#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// Number of vCPUs (one host thread each).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 2,
        allow_negative_numbers = true
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
    /// Events per second per vCPU; 0 = as fast as possible.
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
    /// Host reader poll period in milliseconds (at least 1).
    #[arg(
        long = "poll-ms",
        value_name = "MS",
        default_value_t = 1,
        allow_negative_numbers = true
    )]
    pub poll_ms: u64,
    /// Stop the vCPUs after S seconds (decimals allowed) [default: run to completion].
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub duration: Option<f64>,
    /// Write run statistics (JSON) to FILE.
    #[arg(long, value_name = "FILE")]
    pub stats: Option<PathBuf>,
    /// Guest payload ELF to load instead of the embedded one.
    #[arg(long, value_name = "PATH")]
    pub guest: Option<PathBuf>,
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
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return EXIT_OK;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                let _ = e.print();
                return EXIT_USAGE;
            }
            let text = e.render().to_string();
            let line = text.lines().next().unwrap_or("invalid arguments");
            return usage_error(line.strip_prefix("error: ").unwrap_or(line));
        }
    };
    match cli.command {
        Command::Run(args) => run(&args),
        Command::Record(args) => record(&args),
        Command::Report(args) => report(&args),
        Command::Bench(args) => crate::bench::bench(&args),
    }
}

fn usage_error(msg: impl std::fmt::Display) -> i32 {
    eprintln!("hyptrace: error: {msg}");
    EXIT_USAGE
}

/// The trace region layout for `vcpus` rings of `pages_per_cpu` pages (reader page
/// included) of `page_size` bytes.
pub fn ring_layout(
    vcpus: u32,
    pages_per_cpu: u64,
    page_size: u64,
    mode: ModeArg,
    swap: SwapArg,
) -> Result<ring::Layout, String> {
    let pages = u32::try_from(pages_per_cpu)
        .map_err(|_| format!("{pages_per_cpu} pages per vCPU is too many"))?;
    let mode = match mode {
        ModeArg::Overwrite => ring::Mode::Overwrite,
        ModeArg::Stop => ring::Mode::Stop,
    };
    ring::Layout::new(
        vcpus,
        pages,
        page_size as usize,
        mode,
        swap == SwapArg::Guest,
    )
    .map_err(|e| format!("trace region: {e}"))
}

/// A validated `run` configuration.
#[derive(Debug)]
struct Plan {
    cfg: VmConfig,
    ring: ring::Layout,
    params: RunParams,
    duration: Option<Duration>,
    poll: Duration,
}

fn plan(a: &RunArgs) -> Result<Plan, String> {
    if a.vcpus == 0 {
        return Err("--vcpus must be at least 1".into());
    }
    if a.vcpus > MAX_VCPUS {
        return Err(format!(
            "--vcpus {} is more than the limit of {MAX_VCPUS}",
            a.vcpus
        ));
    }
    if !a.page_size.is_power_of_two() || a.page_size < ring::MIN_PAGE_SIZE as u64 {
        return Err(format!(
            "--page-size {} must be a power of two of at least {}",
            a.page_size,
            ring::MIN_PAGE_SIZE
        ));
    }
    if a.page_size > ring::MAX_PAGE_SIZE as u64 {
        return Err(format!(
            "--page-size {} is larger than the limit of {}",
            a.page_size,
            ring::MAX_PAGE_SIZE
        ));
    }
    let min_pages = ring::MIN_PAGES_PER_CPU as u64;
    let min_kb = min_pages * a.page_size / 1024;
    let buffer = a
        .buffer_kb
        .checked_mul(1024)
        .ok_or_else(|| format!("--buffer-kb {} is too large", a.buffer_kb))?;
    if buffer < min_pages * a.page_size {
        return Err(format!(
            "--buffer-kb {} is below the minimum of {min_kb} KiB ({min_pages} pages of {} bytes: reader page + 2 ring pages)",
            a.buffer_kb, a.page_size
        ));
    }
    let pages = buffer.div_ceil(a.page_size);
    let ring_layout = ring_layout(a.vcpus, pages, a.page_size, a.mode, a.swap)?;
    let trace = ring_layout.region_size as u64;
    if a.poll_ms == 0 {
        return Err("--poll-ms must be at least 1".into());
    }
    let duration = match a.duration {
        None => None,
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Some(Duration::from_secs_f64(s)),
        Some(s) => {
            return Err(format!(
                "--duration {s} must be a positive number of seconds"
            ))
        }
    };

    let (elf, name): (Cow<'static, [u8]>, String) = match &a.guest {
        None => (Cow::Borrowed(GUEST_ELF), "embedded guest".into()),
        Some(p) => {
            let bytes = std::fs::read(p)
                .map_err(|e| format!("cannot read guest image {}: {e}", p.display()))?;
            (Cow::Owned(bytes), p.display().to_string())
        }
    };
    let image = GuestImage::parse(&elf).map_err(|e| format!("bad guest image {name}: {e}"))?;
    if image.start < crate::layout::LOW_END {
        return Err(format!(
            "bad guest image {name}: loads at {:#x}, below {:#x} (reserved for page tables)",
            image.start,
            crate::layout::LOW_END
        ));
    }
    if image.end > MAX_MEM_BYTES {
        return Err(format!(
            "bad guest image {name}: ends at {:#x}, past the largest guest memory",
            image.end
        ));
    }
    let align = a.page_size;
    let need = Layout::required_mem(&image, a.vcpus, trace, align).max(MIN_MEM_BYTES);
    let need_mb = need.div_ceil(1 << 20);
    if need > MAX_MEM_BYTES {
        return Err(format!(
            "this configuration needs {need_mb} MiB of guest memory, more than the limit of {} MiB (lower --vcpus or --buffer-kb)",
            MAX_MEM_BYTES >> 20
        ));
    }
    let mem_bytes = match a.mem_mb {
        None => need,
        Some(mb) => {
            if mb > MAX_MEM_BYTES >> 20 {
                return Err(format!(
                    "--mem-mb {mb} is more than the limit of {} MiB",
                    MAX_MEM_BYTES >> 20
                ));
            }
            let bytes = (mb << 20).div_ceil(HUGE_PAGE) * HUGE_PAGE;
            if bytes < need {
                return Err(format!(
                    "--mem-mb {mb} is too small: the guest image, stacks, parameters and a {trace}-byte trace region need {need_mb} MiB",
                ));
            }
            bytes
        }
    };
    let mut flags = 0;
    if a.swap == SwapArg::Guest {
        flags |= RUN_FLAG_SERVE_MAILBOX;
    }
    Ok(Plan {
        ring: ring_layout,
        cfg: VmConfig {
            vcpus: a.vcpus,
            mem_bytes,
            guest_elf: elf,
            trace_region_bytes: trace,
            trace_region_align: align,
        },
        params: RunParams {
            workload: a.workload.into(),
            events: a.events,
            rate: a.rate,
            seed: DEFAULT_SEED,
            flags,
            burst: 0,
            payload: 0,
        },
        duration,
        poll: Duration::from_millis(a.poll_ms),
    })
}

/// Ctrl-C / SIGTERM flag (a second Ctrl-C kills the process).
fn termination_flag() -> Result<Arc<AtomicBool>, String> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let term = Arc::new(AtomicBool::new(false));
    for sig in [SIGINT, SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(sig, 130, Arc::clone(&term))
            .and_then(|_| signal_hook::flag::register(sig, Arc::clone(&term)))
            .map_err(|e| format!("cannot install the signal handlers: {e}"))?;
    }
    Ok(term)
}

/// Where `execute` sends the trace.
enum Target {
    /// Text lines on stdout (`run`).
    Stdout,
    /// A file in a format (`record`).
    File(PathBuf, FormatArg),
}

/// Per-CPU result of a run, as printed and written to `--stats`.
#[derive(Debug, Clone, Default)]
struct CpuReport {
    /// The writer finished (not stopped or crashed mid-write).
    finished: bool,
    attempted: Option<u64>,
    skipped: Option<u64>,
    written: u64,
    stats: hyptrace_reader::CpuStats,
    error: Option<String>,
}

impl CpuReport {
    /// `written == read + lost`, `lost == overrun + dropped`, and `written ==
    /// attempted − skipped` when the guest reported its counts.
    fn consistent(&self) -> bool {
        let s = &self.stats;
        // The reader's count of lost events (gaps in the event index) is exact. The
        // writer's own overrun counter can be one page ahead of it when the vCPU was
        // stopped in the middle of overwriting a page: the page was counted but not yet
        // overwritten, and was read. Compared only for writers that finished.
        // Guest numbers: sums that overflow match nothing.
        self.error.is_none()
            && s.read.checked_add(s.lost) == Some(self.written)
            && (!self.finished || s.overrun.checked_add(s.dropped) == Some(s.lost))
            && match (self.attempted, self.skipped) {
                (Some(a), Some(k)) => a.checked_sub(k) == Some(self.written),
                _ => true,
            }
    }
}

/// `hyptrace run`.
pub fn run(a: &RunArgs) -> i32 {
    execute(a, Target::Stdout)
}

/// `hyptrace record`.
pub fn record(a: &RecordArgs) -> i32 {
    let format = a.format.unwrap_or_else(|| {
        match a
            .output
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("json") => FormatArg::Json,
            Some("txt") | Some("text") => FormatArg::Text,
            Some("raw") => FormatArg::Raw,
            _ => FormatArg::Dat,
        }
    });
    execute(&a.run, Target::File(a.output.clone(), format))
}

/// `hyptrace report`.
pub fn report(a: &ReportArgs) -> i32 {
    let file = match hyptrace_output::TraceFile::open(&a.input) {
        Ok(f) => f,
        // Errors that already name the file (I/O) are not prefixed again.
        Err(e) => {
            let msg = e.to_string();
            let path = a.input.display().to_string();
            return usage_error(if msg.contains(&path) {
                msg
            } else {
                format!("{path}: {msg}")
            });
        }
    };
    let text = if a.stat {
        file.stat_text()
    } else {
        file.report()
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => EXIT_OK,
        // A closed pipe (`| head`) is not an error worth a message.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => EXIT_OK,
        Err(e) => {
            eprintln!("hyptrace: error: writing the report: {e}");
            EXIT_RUNTIME
        }
    }
}

fn runtime_error(msg: impl std::fmt::Display) -> i32 {
    eprintln!("hyptrace: error: {msg}");
    EXIT_RUNTIME
}

fn make_sink(
    path: &std::path::Path,
    format: FormatArg,
    meta: TraceMeta,
) -> Result<Box<dyn PageSink>, String> {
    let r: Result<Box<dyn PageSink>, hyptrace_output::OutputError> = match format {
        FormatArg::Dat => {
            TraceDatSink::create(path, meta, TraceDatVersion::V7).map(|s| Box::new(s) as _)
        }
        FormatArg::Dat6 => {
            TraceDatSink::create(path, meta, TraceDatVersion::V6).map(|s| Box::new(s) as _)
        }
        FormatArg::Json => JsonSink::create(path, meta).map(|s| Box::new(s) as _),
        FormatArg::Text => TextSink::create(path, meta).map(|s| Box::new(s) as _),
        FormatArg::Raw => RawSink::create(path, meta).map(|s| Box::new(s) as _),
    };
    r.map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Boots the VM, drains the rings while it runs and after, and reports.
fn execute(a: &RunArgs, target: Target) -> i32 {
    let plan = match plan(a) {
        Ok(p) => p,
        Err(msg) => return usage_error(msg),
    };
    let nr = plan.cfg.vcpus;
    let vm = match Vm::new(plan.cfg) {
        Ok(vm) => vm,
        Err(e) if e.is_input_error() => return usage_error(e),
        Err(e) => return runtime_error(e),
    };
    let tsc_khz = vm.tsc_khz();
    let tsc_offset = vm.tsc_offset();
    let clock = match Clock::guest_tsc(tsc_khz) {
        Ok(c) => c,
        Err(e) => return runtime_error(format!("guest clock ({tsc_khz} kHz): {e}")),
    };
    let output = match &target {
        Target::Stdout => Output::Text {
            out: Box::new(std::io::BufWriter::with_capacity(
                1 << 16,
                std::io::stdout(),
            )),
            merger: Merger::new(nr as usize),
            payloads: vec![Default::default(); nr as usize],
        },
        Target::File(path, format) => {
            let meta = TraceMeta::guest(plan.ring.page_size, nr, clock.clone());
            match make_sink(path, *format, meta) {
                Ok(s) => Output::Pages(s),
                Err(msg) => return usage_error(msg),
            }
        }
    };
    let generation = crate::vm::host_tsc();
    let reader = match alloc_reader(vm.trace_region(), plan.ring, tsc_khz, generation) {
        Ok(r) => r,
        Err(e) => return runtime_error(format!("trace buffers: {e}")),
    };
    let term = match termination_flag() {
        Ok(t) => t,
        Err(msg) => return runtime_error(msg),
    };
    let running = match vm.start(&plan.params) {
        Ok(r) => r,
        Err(e) => return runtime_error(e),
    };
    let mut session = Session::new(reader, output, clock);
    let deadline = plan.duration.map(|d| running.started_at() + d);
    let progress = matches!(target, Target::File(..)) && std::io::stderr().is_terminal();
    let mut stop_reason: Option<String> = None;
    let mut host_error = false;
    let mut last_progress = Instant::now();
    loop {
        // A round that stopped at its bound left data behind: come back at once.
        let wait = if session.backlog() {
            Duration::ZERO
        } else {
            plan.poll
        };
        let all_done = running.wait_timeout(wait);
        if stop_reason.is_none() {
            stop_reason = if term.load(Ordering::SeqCst) {
                Some("interrupted".into())
            } else if deadline.is_some_and(|d| Instant::now() >= d) {
                Some("--duration elapsed".into())
            } else if running.any_crashed() {
                Some("a vCPU crashed".into())
            } else {
                None
            };
            if stop_reason.is_some() {
                running.stop();
            }
        }
        for (cpu, e) in session.service(|c| running.vcpu_finished(c)) {
            eprintln!("hyptrace: error: reading vcpu {cpu}: {e}");
            host_error = true;
            if stop_reason.is_none() {
                stop_reason = Some(format!("reading vcpu {cpu} failed"));
                running.stop();
            }
        }
        if let Err(e) = session.flush() {
            eprintln!("hyptrace: error: {e}");
            host_error = true;
            if stop_reason.is_none() {
                stop_reason = Some("output failed".into());
                running.stop();
            }
        }
        if progress && last_progress.elapsed() >= Duration::from_millis(500) {
            last_progress = Instant::now();
            let read = sat_sum((0..nr).map(|c| session.stats(c).read));
            let lost = sat_sum((0..nr).map(|c| session.stats(c).lost));
            eprint!("\rhyptrace: recording: {read} events read, {lost} lost ");
        }
        if all_done && (0..nr).all(|c| !session.is_live(c)) {
            break;
        }
    }
    if progress {
        eprintln!();
    }
    let wall = running.started_at().elapsed();
    let start_tsc = running.start_tsc();
    let outcomes = running.wait();
    // Every vCPU has stopped: read what is left, read-only.
    for cpu in 0..nr {
        if let Err(e) = session.end_cpu(cpu) {
            eprintln!("hyptrace: error: reading vcpu {cpu}: {e}");
            session.fail_cpu(cpu, &e);
            host_error = true;
        }
    }
    if let Err(e) = session.flush() {
        eprintln!("hyptrace: error: {e}");
        host_error = true;
    }

    let reports: Vec<CpuReport> = (0..nr)
        .map(|cpu| {
            let (attempted, skipped) = match outcomes.get(cpu as usize) {
                Some(VcpuOutcome::Finished(st)) => (Some(st.attempted), Some(st.skipped)),
                _ => (None, None),
            };
            let stats = session.stats(cpu);
            CpuReport {
                finished: session.writer_finished(cpu),
                attempted,
                skipped,
                written: session.writer_index(cpu),
                stats,
                error: session.error(cpu).map(str::to_string),
            }
        })
        .collect();
    let summary_stats = hyptrace_output::RunSummary {
        cpus: reports
            .iter()
            .map(|r| hyptrace_output::CpuStats {
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
    };
    let lines = match session.finish(&summary_stats) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("hyptrace: error: {e}");
            host_error = true;
            0
        }
    };

    if let Some(r) = &stop_reason {
        eprintln!("hyptrace: stopped: {r}");
    }
    let mut code = exit_code(&outcomes);
    let consistent = reports.iter().all(CpuReport::consistent);
    if code == EXIT_OK && (host_error || !consistent) {
        code = EXIT_RUNTIME;
    }
    eprint!(
        "{}",
        summary(&outcomes, &reports, tsc_khz, start_tsc, tsc_offset, wall, lines, &target)
    );
    if !consistent {
        eprintln!("hyptrace: error: accounting mismatch: written != read + lost on some vCPU");
    }
    if let Some(path) = &a.stats {
        let json = stats_json(
            a,
            &outcomes,
            &reports,
            tsc_khz,
            wall,
            stop_reason.as_deref(),
            code,
        );
        if let Err(e) = std::fs::write(path, json) {
            eprintln!("hyptrace: error: cannot write {}: {e}", path.display());
            return EXIT_RUNTIME;
        }
    }
    code
}

/// 1 if a vCPU failed on the host side, else 3 if the guest crashed, else 0.
pub fn exit_code(outcomes: &[VcpuOutcome]) -> i32 {
    if outcomes.iter().any(|o| matches!(o, VcpuOutcome::Error(_))) {
        EXIT_RUNTIME
    } else if outcomes.iter().any(VcpuOutcome::is_crash) {
        EXIT_CRASH
    } else {
        EXIT_OK
    }
}

#[allow(clippy::too_many_arguments)]
fn summary(
    outcomes: &[VcpuOutcome],
    reports: &[CpuReport],
    tsc_khz: u64,
    start_tsc: u64,
    tsc_offset: Option<i64>,
    wall: Duration,
    lines: u64,
    target: &Target,
) -> String {
    let mut s = String::new();
    let ms = |cycles: u64| {
        if tsc_khz == 0 {
            0.0
        } else {
            cycles as f64 / tsc_khz as f64
        }
    };
    for (id, o) in outcomes.iter().enumerate() {
        let outcome = match o {
            VcpuOutcome::Finished(st) => {
                let t = ms(st.tsc_end.wrapping_sub(st.tsc_start));
                let started = match tsc_offset {
                    Some(off) => format!(
                        ", first instruction {:.3} ms after start",
                        ms(st
                            .tsc_start
                            .wrapping_sub(off as u64)
                            .wrapping_sub(start_tsc))
                    ),
                    None => String::new(),
                };
                format!("finished in {t:.3} ms{started}")
            }
            VcpuOutcome::Panicked(msg) => format!("guest panicked: {msg}"),
            VcpuOutcome::Faulted(msg) => format!("guest crashed: {msg}"),
            VcpuOutcome::Stopped => "stopped".to_string(),
            VcpuOutcome::Error(msg) => format!("error: {msg}"),
        };
        let _ = writeln!(s, "hyptrace: vcpu {id}: {outcome}");
        if let Some(r) = reports.get(id) {
            let st = &r.stats;
            let opt = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
            let _ = writeln!(
                s,
                "hyptrace: cpu {id}: attempted {} skipped {} written {} read {} lost {} (overrun {} dropped {}) swaps {} pages_touched {} bytes {}{}",
                opt(r.attempted),
                opt(r.skipped),
                r.written,
                st.read,
                st.lost,
                st.overrun,
                st.dropped,
                st.swaps,
                st.pages_touched,
                st.bytes,
                if r.consistent() { "" } else { "  MISMATCH" }
            );
        }
    }
    // Totals of guest numbers saturate (a hostile guest's counters can be anything).
    let read = sat_sum(reports.iter().map(|r| r.stats.read));
    let lost = sat_sum(reports.iter().map(|r| r.stats.lost));
    let written = sat_sum(reports.iter().map(|r| r.written));
    let secs = wall.as_secs_f64();
    let mb = sat_sum(reports.iter().map(|r| r.stats.bytes)) as f64 / 1e6;
    let _ = writeln!(
        s,
        "hyptrace: {} vCPUs: written {written} = read {read} + lost {lost}; {secs:.3} s, {mb:.1} MB of events ({:.1} MB/s){}",
        outcomes.len(),
        if secs > 0.0 { mb / secs } else { 0.0 },
        match target {
            Target::Stdout => format!(", {lines} lines printed"),
            Target::File(p, f) => format!(", {:?} written to {}", f, p.display()),
        }
    );
    s
}

/// The sum of `v`, saturating at `u64::MAX`.
fn sat_sum(v: impl IntoIterator<Item = u64>) -> u64 {
    v.into_iter().fold(0, u64::saturating_add)
}

fn stats_json(
    a: &RunArgs,
    outcomes: &[VcpuOutcome],
    reports: &[CpuReport],
    tsc_khz: u64,
    wall: Duration,
    stop_reason: Option<&str>,
    code: i32,
) -> String {
    let cpus: Vec<serde_json::Value> = reports
        .iter()
        .enumerate()
        .map(|(cpu, r)| {
            let st = &r.stats;
            serde_json::json!({
                "cpu": cpu,
                "attempted": r.attempted,
                "skipped": r.skipped,
                "written": r.written,
                "read": st.read,
                "overrun": st.overrun,
                "dropped": st.dropped,
                "lost": st.lost,
                "swaps": st.swaps,
                "pages_touched": st.pages_touched,
                "bytes": st.bytes,
                "pages_read": st.pages_read,
                "outcome": outcome_name(outcomes.get(cpu)),
                "error": r.error,
            })
        })
        .collect();
    // The most telling outcome of any vCPU: a host error, then a crash (the other vCPUs
    // are then `stopped` because of it, whatever their order), then a stop.
    let guest_exit = ["error", "panic", "fault", "stopped"]
        .into_iter()
        .find(|want| outcomes.iter().any(|o| outcome_name(Some(o)) == *want))
        .unwrap_or("ok");
    let v = serde_json::json!({
        "cpus": cpus,
        "guest_exit": guest_exit,
        "workload": format!("{:?}", a.workload).to_lowercase(),
        "mode": format!("{:?}", a.mode).to_lowercase(),
        "swap": format!("{:?}", a.swap).to_lowercase(),
        "vcpus": a.vcpus,
        "events_per_vcpu": a.events,
        "rate": a.rate,
        "tsc_khz": tsc_khz,
        "wall_seconds": wall.as_secs_f64(),
        "stop_reason": stop_reason,
        "exit_code": code,
    });
    let mut s = serde_json::to_string_pretty(&v).unwrap_or_else(|_| "{}".into());
    s.push('\n');
    s
}

/// `ok`, `panic`, `fault`, `stopped`, `error` (or `unknown` without an outcome).
fn outcome_name(o: Option<&VcpuOutcome>) -> &'static str {
    match o {
        Some(VcpuOutcome::Finished(_)) => "ok",
        Some(VcpuOutcome::Panicked(_)) => "panic",
        Some(VcpuOutcome::Faulted(_)) => "fault",
        Some(VcpuOutcome::Stopped) => "stopped",
        Some(VcpuOutcome::Error(_)) => "error",
        None => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> RunArgs {
        let mut v = vec!["hyptrace", "run"];
        v.extend_from_slice(extra);
        match Cli::try_parse_from(v).expect("parses").command {
            Command::Run(a) => a,
            c => panic!("not run: {c:?}"),
        }
    }

    #[test]
    fn defaults_plan() {
        let p = plan(&args(&[])).expect("default plan");
        assert_eq!(p.cfg.vcpus, 2);
        assert_eq!(p.params.events, 100_000);
        assert!(p.cfg.mem_bytes >= p.cfg.trace_region_bytes);
    }

    /// Issue 8 defect 4: guest counters at the top of u64 made the summary's sums
    /// overflow (a panic in debug builds, wrapped garbage in release builds).
    #[test]
    fn summary_of_hostile_counters_saturates() {
        let hostile = hyptrace_reader::CpuStats {
            written: u64::MAX,
            read: 3,
            overrun: u64::MAX,
            dropped: u64::MAX,
            lost: u64::MAX - 3,
            pages_touched: u64::MAX,
            bytes: u64::MAX,
            ..Default::default()
        };
        let report = CpuReport {
            finished: true,
            attempted: Some(u64::MAX),
            skipped: Some(u64::MAX),
            written: u64::MAX,
            stats: hostile,
            error: None,
        };
        // read + lost == written per CPU, but overrun + dropped overflows.
        assert!(!report.consistent());
        let reports = vec![report.clone(), report];
        let outcomes = vec![VcpuOutcome::Stopped, VcpuOutcome::Stopped];
        let text = summary(
            &outcomes,
            &reports,
            1_000_000,
            0,
            None,
            Duration::from_secs(1),
            0,
            &Target::Stdout,
        );
        let m = u64::MAX;
        assert!(
            text.contains(&format!("written {m} = read 6 + lost {m}")),
            "{text}"
        );
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            &["--vcpus", "0"][..],
            &["--vcpus", "100000"],
            &["--page-size", "5000"],
            &["--page-size", "2048"],
            &["--buffer-kb", "8"],
            &["--mem-mb", "1"],
            &["--mem-mb", "100000"],
            &["--poll-ms", "0"],
            &["--duration", "-1"],
            &["--guest", "/nonexistent/guest.elf"],
            &["--vcpus", "256", "--buffer-kb", "65536"],
        ] {
            assert!(plan(&args(bad)).is_err(), "{bad:?} accepted");
        }
    }
}
