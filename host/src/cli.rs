//! The `hyptrace` command line.
//!
//! Exit codes: [`EXIT_OK`] 0 (the run completed: the guest finished, or was stopped as
//! asked by `--duration` or a first Ctrl-C / SIGTERM, and every event is accounted for),
//! [`EXIT_RUNTIME`] 1 (a host-side failure), [`EXIT_USAGE`] 2 (bad input, an unusable
//! output path, no usable /dev/kvm), [`EXIT_CRASH`] 3 (the guest panicked or faulted),
//! [`EXIT_ABORT`] 130 (a second Ctrl-C aborted the run; no output file is left).
//! An error is one line on stderr, `hyptrace: error: ...` (argument errors are followed
//! by clap's hints: valid values, tips, usage).

use std::borrow::Cow;
use std::ffi::OsString;
use std::fmt::Write as _;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use hyptrace_abi::guest::{Workload, RUN_FLAG_SERVE_MAILBOX};
use hyptrace_abi::layout as ring;

use hyptrace_output::{
    Clock, JsonSink, OutputTarget, PageSink, RawSink, TextSink, TraceDatSink, TraceDatVersion,
    TraceMeta,
};
use hyptrace_reader::Merger;
use std::io::{IsTerminal, Write};

use crate::elf::GuestImage;
use crate::memory_map::{GuestMemoryMap, HUGE_PAGE, MAX_MEM_BYTES, MAX_VCPUS, MIN_MEM_BYTES};
use crate::trace::{alloc_reader, Output, Session, SessionError};
use crate::vcpu::VcpuOutcome;
use crate::vm::{RunParams, Vm, VmConfig, DEFAULT_SEED};
use crate::GUEST_ELF;

/// `eprintln!` that never panics: stderr may be a closed pipe (`2>&1 | head`).
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Success.
pub const EXIT_OK: i32 = 0;
/// A failure at run time (host side).
pub const EXIT_RUNTIME: i32 = 1;
/// Bad input or environment.
pub const EXIT_USAGE: i32 = 2;
/// The guest crashed.
pub const EXIT_CRASH: i32 = 3;
/// Aborted by a second Ctrl-C / SIGTERM (128 + SIGINT, what shells report).
pub const EXIT_ABORT: i32 = 130;

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
            // clap's message whole: the error line, then its hints (valid values, tips,
            // usage), which a user needs to fix the command line.
            let text = e.render().to_string();
            let text = text.trim_end();
            let text = text.strip_prefix("error: ").unwrap_or(text);
            return usage_error(if text.is_empty() {
                "invalid arguments"
            } else {
                text
            });
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
    note!("hyptrace: error: {msg}");
    EXIT_USAGE
}

/// Longest `--duration`, in seconds (about 31 years).
pub const MAX_DURATION_S: f64 = 1e9;

/// `--duration`: seconds, finite, more than 0, at most [`MAX_DURATION_S`].
fn parse_duration(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| "not a number of seconds (e.g. 2 or 0.5)".to_string())?;
    if v.is_nan() {
        Err("not a number of seconds (e.g. 2 or 0.5)".into())
    } else if v.is_infinite() {
        Err(format!(
            "must be a finite number of seconds, at most {MAX_DURATION_S:.0} (leave --duration out to run to completion)"
        ))
    } else if v <= 0.0 {
        Err("must be more than 0 seconds".into())
    } else if v > MAX_DURATION_S {
        Err(format!(
            "more than the limit of {MAX_DURATION_S:.0} seconds"
        ))
    } else {
        Ok(v)
    }
}

/// The trace region layout for `vcpus` rings of `pages_per_cpu` pages (reader page
/// included) of `page_size` bytes.
pub fn ring_layout(
    vcpus: u32,
    pages_per_cpu: u64,
    page_size: u64,
    mode: ModeArg,
    swap: SwapArg,
) -> Result<ring::RingGeometry, String> {
    let pages = u32::try_from(pages_per_cpu)
        .map_err(|_| format!("{pages_per_cpu} pages per vCPU is too many"))?;
    let mode = match mode {
        ModeArg::Overwrite => ring::Mode::Overwrite,
        ModeArg::Stop => ring::Mode::Stop,
    };
    ring::RingGeometry::new(
        vcpus,
        pages,
        page_size as usize,
        mode,
        swap == SwapArg::Guest,
    )
    .map_err(|e| format!("trace region: {e}"))
}

/// The largest `n` in `lo..=hi` with `ok(n)`, for `ok` true up to some point and false
/// after it; `None` if `ok(lo)` is false. At most 64 probes.
fn largest(lo: u64, hi: u64, ok: impl Fn(u64) -> bool) -> Option<u64> {
    if hi < lo || !ok(lo) {
        return None;
    }
    if ok(hi) {
        return Some(hi);
    }
    // ok(good) && !ok(bad)
    let (mut good, mut bad) = (lo, hi);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if ok(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Some(good)
}

/// A validated `run` configuration.
#[derive(Debug)]
struct Plan {
    cfg: VmConfig,
    ring: ring::RingGeometry,
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
    // Every ring lives in guest memory: no vCPU's can be larger than all of it.
    let max_kb = MAX_MEM_BYTES / 1024;
    if a.buffer_kb > max_kb {
        return Err(format!(
            "--buffer-kb {} is more than the limit of {max_kb} KiB per vCPU (guest memory is at most {} MiB)",
            a.buffer_kb,
            MAX_MEM_BYTES >> 20
        ));
    }
    let buffer = a.buffer_kb * 1024;
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
    if image.start < crate::memory_map::LOW_END {
        return Err(format!(
            "bad guest image {name}: loads at {:#x}, below {:#x} (reserved for page tables)",
            image.start,
            crate::memory_map::LOW_END
        ));
    }
    if image.end > MAX_MEM_BYTES {
        return Err(format!(
            "bad guest image {name}: ends at {:#x}, past the largest guest memory",
            image.end
        ));
    }
    let align = a.page_size;
    let need = GuestMemoryMap::required_mem(&image, a.vcpus, trace, align).max(MIN_MEM_BYTES);
    let need_mb = need.div_ceil(1 << 20);
    if need > MAX_MEM_BYTES {
        let fits = |pages: u64| {
            self::ring_layout(a.vcpus, pages, a.page_size, a.mode, a.swap).is_ok_and(|l| {
                GuestMemoryMap::required_mem(&image, a.vcpus, l.region_size as u64, align)
                    .max(MIN_MEM_BYTES)
                    <= MAX_MEM_BYTES
            })
        };
        return Err(match largest(min_pages, pages, fits) {
            Some(p) => format!(
                "--buffer-kb {} with {} vCPUs needs {need_mb} MiB of guest memory, more than the limit of {} MiB: at most {} KiB per vCPU fits (lower --buffer-kb or --vcpus)",
                a.buffer_kb,
                a.vcpus,
                MAX_MEM_BYTES >> 20,
                p * a.page_size / 1024
            ),
            None => format!(
                "{} vCPUs need {need_mb} MiB of guest memory even with the smallest rings, more than the limit of {} MiB (lower --vcpus or --page-size)",
                a.vcpus,
                MAX_MEM_BYTES >> 20
            ),
        });
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

/// Signals that arrive within this time of the one that started a stop (or an abort)
/// count as that one: `timeout` signals the process and then its process group, so one
/// `timeout -s INT` delivers two SIGINTs at once, and a terminal's Ctrl-C reaches every
/// process of a pipeline.
pub const SIGNAL_BURST: Duration = Duration::from_millis(500);

/// What Ctrl-C (SIGINT) and SIGTERM asked for. Decided in the signal handler itself,
/// with the time the signal arrived (not when a thread got around to it), using only
/// async-signal-safe operations (atomics, `clock_gettime`, `write`, `_exit`):
/// 1. the first signal: stop cleanly (the vCPUs stop, everything committed is read and
///    written out, exit 0); `hyptrace: stopping… (Ctrl-C again to abort)` on stderr;
/// 2. a second one, later than [`SIGNAL_BURST`]: abort — the run returns at once without
///    finishing its output, which drops the sinks: their temporary and spill files are
///    removed, no output file appears; exit 130;
/// 3. a third one (the process did not manage to return): exit 130 immediately.
#[derive(Debug, Default)]
pub struct Interrupts {
    /// CLOCK_MONOTONIC ns (at least 1) of the signal that asked for the stop; 0: none.
    stop_at: AtomicU64,
    /// The same for the abort.
    abort_at: AtomicU64,
    signal: AtomicI32,
    tty: AtomicBool,
}

/// What a signal does, given the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SignalAction {
    /// The first: stop cleanly.
    Stop,
    /// Within [`SIGNAL_BURST`] of the stop or the abort: part of it.
    Burst,
    /// Abort.
    Abort,
    /// Exit at once.
    Exit,
}

impl Interrupts {
    /// Installs the handlers (once per process) and returns the shared state.
    pub fn install() -> Result<&'static Interrupts, String> {
        static STATE: std::sync::OnceLock<Result<&'static Interrupts, String>> =
            std::sync::OnceLock::new();
        STATE
            .get_or_init(|| {
                use signal_hook::consts::{SIGINT, SIGTERM};
                let state: &'static Interrupts = Box::leak(Box::default());
                state
                    .tty
                    .store(std::io::stderr().is_terminal(), Ordering::SeqCst);
                for sig in [SIGINT, SIGTERM] {
                    let handler = move || state.handle(sig, monotonic_ns());
                    // SAFETY: `handle` is async-signal-safe: it uses atomics,
                    // `write(2)` on fd 2 with static bytes and `_exit(2)`; no allocation,
                    // no lock, no `std::io`.
                    unsafe { signal_hook::low_level::register(sig, handler) }
                        .map_err(|e| format!("cannot install the signal handlers: {e}"))?;
                }
                Ok(state)
            })
            .clone()
    }

    /// In the signal handler: decide, say so on stderr, exit on a third signal.
    fn handle(&self, sig: i32, now_ns: u64) {
        let action = self.on_signal(sig, now_ns);
        let msg: &[u8] = match action {
            SignalAction::Burst => return,
            SignalAction::Stop => "hyptrace: stopping… (Ctrl-C again to abort)\n".as_bytes(),
            SignalAction::Abort => {
                b"hyptrace: aborting: removing temporary files (Ctrl-C again to exit at once)\n"
            }
            SignalAction::Exit => b"hyptrace: exiting at once; temporary files may remain\n",
        };
        if self.tty.load(Ordering::Relaxed) {
            write_stderr_raw(b"\r\x1b[K");
        }
        write_stderr_raw(msg);
        if action == SignalAction::Exit {
            // SAFETY: `_exit` is async-signal-safe and ends the process.
            unsafe { libc::_exit(EXIT_ABORT) };
        }
    }

    /// The decision for a signal `sig` arriving at `now_ns` (CLOCK_MONOTONIC).
    fn on_signal(&self, sig: i32, now_ns: u64) -> SignalAction {
        let now = now_ns.clamp(1, u64::MAX - 1);
        let window = SIGNAL_BURST.as_nanos() as u64;
        let sc = Ordering::SeqCst;
        match self.stop_at.compare_exchange(0, now, sc, sc) {
            Ok(_) => {
                self.signal.store(sig, sc);
                return SignalAction::Stop;
            }
            Err(at) if now.saturating_sub(at) < window => return SignalAction::Burst,
            Err(_) => {}
        }
        match self.abort_at.compare_exchange(0, now, sc, sc) {
            Ok(_) => SignalAction::Abort,
            Err(at) if at == u64::MAX || now.saturating_sub(at) < window => SignalAction::Burst,
            Err(at) => {
                if self.abort_at.compare_exchange(at, u64::MAX, sc, sc).is_ok() {
                    SignalAction::Exit
                } else {
                    SignalAction::Burst
                }
            }
        }
    }

    /// A clean stop was asked for.
    pub fn stop_requested(&self) -> bool {
        self.stop_at.load(Ordering::SeqCst) != 0
    }

    /// An abort was asked for.
    pub fn aborted(&self) -> bool {
        self.abort_at.load(Ordering::SeqCst) != 0
    }

    /// The name of the signal that asked for the stop (`SIGINT`, `SIGTERM`).
    pub fn signal_name(&self) -> &'static str {
        match self.signal.load(Ordering::SeqCst) {
            signal_hook::consts::SIGTERM => "SIGTERM",
            _ => "SIGINT",
        }
    }
}

/// CLOCK_MONOTONIC in ns (async-signal-safe).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// `write(2)` to stderr, result ignored (async-signal-safe).
fn write_stderr_raw(b: &[u8]) {
    // SAFETY: `b` is valid for `b.len()` bytes for the duration of the call.
    let _ = unsafe { libc::write(2, b.as_ptr().cast(), b.len()) };
}

/// Checks, before the VM starts, that `path` can receive the output of `flag`, and says
/// in one line why not (`hyptrace_output::OutputTarget::check`: a regular file or a new
/// path is written to a temporary name in its directory and renamed, a symlink is
/// followed, a device or FIFO is written in place, `-` is stdout, a directory or an
/// unwritable place is refused).
pub fn check_destination(path: &Path, flag: &str) -> Result<OutputTarget, String> {
    OutputTarget::check(path).map_err(|e| {
        let why = match &e {
            hyptrace_output::OutputError::Io { source, .. } => source.to_string(),
            e => e.to_string(),
        };
        format!("cannot write {} ({flag}): {why}", path.display())
    })
}

/// Writes `text` to a checked destination (temporary file renamed, or in place).
pub fn write_destination(target: &OutputTarget, text: &str) -> Result<(), String> {
    let mut f = target.open().map_err(|e| e.to_string())?;
    f.write_all(text.as_bytes())
        .map_err(|e| format!("{}: {e}", target.path().display()))?;
    f.finish().map_err(|e| e.to_string())
}

/// Stdout for `run`: a reader that went away (`| head`) ends the run quietly. After
/// the first EPIPE every write is accepted and discarded, so the run keeps reading
/// (the accounting stays exact) while it stops; `closed` tells the run loop. Counts the
/// lines that did reach stdout.
#[derive(Debug, Default)]
struct StdoutState {
    closed: AtomicBool,
    lines: std::sync::atomic::AtomicU64,
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

/// Failures of a run, reported once each after the summary (the last lines on stderr):
/// the first output failure (later ones are its consequences), the first read failure
/// of each vCPU.
#[derive(Debug, Default)]
struct Failures {
    output: Option<String>,
    read: Vec<(u32, String)>,
    other: Vec<String>,
}

impl Failures {
    fn session(&mut self, cpu: Option<u32>, e: &SessionError) {
        match (e, cpu) {
            (SessionError::Output(msg), _) => {
                self.output.get_or_insert_with(|| msg.clone());
            }
            (e, Some(cpu)) => {
                if !self.read.iter().any(|(c, _)| *c == cpu) {
                    self.read.push((cpu, e.to_string()));
                }
            }
            (e, None) => self.other.push(e.to_string()),
        }
    }

    fn any(&self) -> bool {
        self.output.is_some() || !self.read.is_empty() || !self.other.is_empty()
    }

    fn output_failed(&self) -> bool {
        self.output.is_some()
    }

    fn print(&self, target: &Target) {
        for (cpu, e) in &self.read {
            note!("hyptrace: error: reading vcpu {cpu}: {e}");
        }
        for e in &self.other {
            note!("hyptrace: error: {e}");
        }
        if let Some(e) = &self.output {
            let e = e.strip_prefix("output: ").unwrap_or(e);
            match target {
                Target::Stdout => note!("hyptrace: error: writing to stdout: {e}"),
                Target::File(p, _) => note!("hyptrace: error: writing {}: {e}", p.display()),
            }
        }
    }
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
        // A failure on the CPU (read or output) is reported on its own; it is no
        // accounting mismatch when the counts balance. Guest numbers: sums that
        // overflow match nothing.
        s.read.checked_add(s.lost) == Some(self.written)
            && (!self.finished || s.overrun.checked_add(s.dropped) == Some(s.lost))
            && match (self.attempted, self.skipped) {
                (Some(a), Some(k)) => a.checked_sub(k) == Some(self.written),
                _ => true,
            }
    }
}

impl CpuReport {
    /// The mark after the CPU's summary line: none when the counts balance;
    /// `INCOMPLETE` when a failure (`failed`: reading or writing) stopped the reading
    /// with events still unread — the failure is the cause, reported on its own;
    /// `MISMATCH` otherwise.
    fn flag(&self, failed: bool) -> String {
        let seen = self.stats.read.saturating_add(self.stats.lost);
        if self.consistent() {
            String::new()
        } else if failed && self.written > seen {
            format!(
                "  INCOMPLETE: {} events not read after the failure",
                self.written - seen
            )
        } else {
            "  MISMATCH".into()
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
            note!("hyptrace: error: writing the report: {e}");
            EXIT_RUNTIME
        }
    }
}

fn runtime_error(msg: impl std::fmt::Display) -> i32 {
    note!("hyptrace: error: {msg}");
    EXIT_RUNTIME
}

fn make_sink(
    target: &OutputTarget,
    format: FormatArg,
    meta: TraceMeta,
) -> Result<Box<dyn PageSink>, String> {
    let r: Result<Box<dyn PageSink>, hyptrace_output::OutputError> = match format {
        FormatArg::Dat => {
            TraceDatSink::open(target, meta, TraceDatVersion::V7).map(|s| Box::new(s) as _)
        }
        FormatArg::Dat6 => {
            TraceDatSink::open(target, meta, TraceDatVersion::V6).map(|s| Box::new(s) as _)
        }
        FormatArg::Json => JsonSink::open(target, meta).map(|s| Box::new(s) as _),
        FormatArg::Text => TextSink::open(target, meta).map(|s| Box::new(s) as _),
        FormatArg::Raw => RawSink::open(target, meta).map(|s| Box::new(s) as _),
    };
    r.map_err(|e| format!("cannot write {}: {e}", target.path().display()))
}

/// Boots the VM, drains the rings while it runs and after, and reports.
fn execute(a: &RunArgs, target: Target) -> i32 {
    let plan = match plan(a) {
        Ok(p) => p,
        Err(msg) => return usage_error(msg),
    };
    // Every output path is checked before the VM boots: a bad one costs nothing.
    let out_target = match &target {
        Target::File(path, _) => match check_destination(path, "-o") {
            Ok(t) => Some(t),
            Err(msg) => return usage_error(msg),
        },
        Target::Stdout => None,
    };
    let stats_target = match a.stats.as_deref().map(|p| check_destination(p, "--stats")) {
        Some(Err(msg)) => return usage_error(msg),
        Some(Ok(t)) => Some(t),
        None => None,
    };
    // Before any temporary file exists: a signal from now on stops or aborts cleanly.
    let interrupts = match Interrupts::install() {
        Ok(i) => i,
        Err(msg) => return runtime_error(msg),
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
    let stdout = Arc::new(StdoutState::default());
    let output = match &target {
        Target::Stdout => Output::Text {
            out: Box::new(std::io::BufWriter::with_capacity(
                1 << 16,
                QuietStdout {
                    out: std::io::stdout(),
                    state: Arc::clone(&stdout),
                },
            )),
            merger: Merger::new(nr as usize),
            payloads: vec![Default::default(); nr as usize],
        },
        Target::File(_, format) => {
            let meta = TraceMeta::guest(plan.ring.page_size, nr, clock.clone());
            let Some(t) = &out_target else {
                return runtime_error("no output destination");
            };
            match make_sink(t, *format, meta) {
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
    let running = match vm.start(&plan.params) {
        Ok(r) => r,
        Err(e) => return runtime_error(e),
    };
    let mut session = Session::new(reader, output, clock);
    let deadline = plan.duration.map(|d| running.started_at() + d);
    let events_on_tty = matches!(target, Target::Stdout) && std::io::stdout().is_terminal();
    let mut heartbeat = Heartbeat::new(!events_on_tty);
    let mut stop_reason: Option<Stop> = None;
    let mut failures = Failures::default();
    let mut aborted = false;
    loop {
        // A round that stopped at its bound left data behind: come back at once.
        let wait = if session.backlog() {
            Duration::ZERO
        } else {
            plan.poll
        };
        let all_done = running.wait_timeout(wait);
        if interrupts.aborted() {
            aborted = true;
            running.stop();
            break;
        }
        if stop_reason.is_none() {
            stop_reason = if interrupts.stop_requested() {
                Some(Stop::Signal(interrupts.signal_name()))
            } else if deadline.is_some_and(|d| Instant::now() >= d) {
                Some(Stop::Duration)
            } else if running.any_crashed() {
                Some(Stop::Crash)
            } else if stdout.closed.load(Ordering::Relaxed) {
                Some(Stop::StdoutClosed)
            } else {
                None
            };
            if stop_reason.is_some() {
                running.stop();
            }
        }
        for (cpu, e) in session.service(|c| running.vcpu_finished(c)) {
            failures.session(Some(cpu), &e);
            if stop_reason.is_none() {
                stop_reason = Some(Stop::Failed(match e {
                    SessionError::Output(_) => "output failed".into(),
                    _ => format!("reading vcpu {cpu} failed"),
                }));
                running.stop();
            }
        }
        if let Err(e) = session.flush() {
            failures.session(None, &e);
            if stop_reason.is_none() {
                stop_reason = Some(Stop::Failed("output failed".into()));
                running.stop();
            }
        }
        if let Some(h) = &mut heartbeat {
            h.tick(&session, nr, running.started_at());
        }
        if all_done && (0..nr).all(|c| !session.is_live(c)) {
            break;
        }
    }
    if let Some(h) = &mut heartbeat {
        h.end();
    }
    let wall = running.started_at().elapsed();
    let start_tsc = running.start_tsc();
    let outcomes = running.wait();
    if aborted {
        return abort(session);
    }
    // Every vCPU has stopped: read what is left, read-only.
    for cpu in 0..nr {
        if let Err(e) = session.end_cpu(cpu) {
            session.fail_cpu(cpu, &e);
            failures.session(Some(cpu), &e);
        }
    }
    if let Err(e) = session.flush() {
        failures.session(None, &e);
    }
    if interrupts.aborted() {
        return abort(session);
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
    if let Err(e) = session.finish(&summary_stats) {
        failures.session(None, &e);
    }
    let lines = stdout.lines.load(Ordering::Relaxed);

    // How the run ended, then the summary, then what went wrong (the last lines).
    match &stop_reason {
        Some(Stop::Failed(_)) | None => {}
        Some(r) => note!("hyptrace: stopped: {r}"),
    }
    let mut code = exit_code(&outcomes);
    let consistent = reports.iter().all(CpuReport::consistent);
    if code == EXIT_OK && (failures.any() || !consistent) {
        code = EXIT_RUNTIME;
    }
    let written_to = match &target {
        Target::Stdout => Written::Stdout(lines),
        Target::File(p, _) if failures.output_failed() => Written::Failed(p),
        Target::File(p, f) => Written::File(p, *f),
    };
    note!(
        "{}",
        summary(
            &outcomes,
            &reports,
            tsc_khz,
            start_tsc,
            tsc_offset,
            wall,
            written_to,
            failures.any()
        )
        .trim_end()
    );
    let lost: u64 = reports.iter().map(|r| r.stats.lost).sum();
    if lost > 0 {
        note!("hyptrace: hint: {}", loss_hint(a.mode));
    }
    if reports
        .iter()
        .any(|r| r.flag(failures.any()).contains("MISMATCH"))
    {
        note!("hyptrace: error: accounting mismatch on a vCPU marked MISMATCH: written != read + lost, lost != overrun + dropped, or written != attempted - skipped");
    }
    failures.print(&target);
    if let Some(st) = &stats_target {
        let end = run_end(&outcomes, stop_reason.as_ref(), failures.any());
        let json = stats_json(
            a,
            &outcomes,
            &reports,
            tsc_khz,
            wall,
            stop_reason.as_ref().map(|r| r.to_string()).as_deref(),
            end,
            code,
        );
        if let Err(e) = write_destination(st, &json) {
            note!("hyptrace: error: cannot write stats: {e}");
            return EXIT_RUNTIME;
        }
    }
    code
}

/// A second Ctrl-C: drop the session without finishing its output (the sink removes
/// its temporary and spill files when dropped), say so, exit 130.
fn abort(session: Session) -> i32 {
    drop(session);
    note!("hyptrace: aborted: no output written");
    EXIT_ABORT
}

/// Why a run stopped before its guest finished.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stop {
    /// The first Ctrl-C (SIGINT) or SIGTERM.
    Signal(&'static str),
    /// `--duration` elapsed.
    Duration,
    /// A vCPU crashed; the others were stopped.
    Crash,
    /// Stdout was closed by its reader (`| head`).
    StdoutClosed,
    /// Reading a ring or writing the output failed (reported on its own).
    Failed(String),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Signal(sig) => write!(f, "interrupted by {sig}"),
            Self::Duration => f.write_str("--duration elapsed"),
            Self::Crash => f.write_str("a vCPU crashed"),
            Self::StdoutClosed => f.write_str("stdout closed"),
            Self::Failed(what) => f.write_str(what),
        }
    }
}

/// `end` of `--stats`: how the run ended. `guest_finished`, `duration`, `signal`,
/// `stdout_closed` (exit 0 when every event is accounted for), `guest_crashed` (3),
/// `error` (1).
fn run_end(outcomes: &[VcpuOutcome], stop: Option<&Stop>, failed: bool) -> &'static str {
    if outcomes.iter().any(|o| matches!(o, VcpuOutcome::Error(_))) || failed {
        return "error";
    }
    if outcomes.iter().any(VcpuOutcome::is_crash) {
        return "guest_crashed";
    }
    match stop {
        None => "guest_finished",
        Some(Stop::Signal(_)) => "signal",
        Some(Stop::Duration) => "duration",
        Some(Stop::StdoutClosed) => "stdout_closed",
        Some(Stop::Crash) => "guest_crashed",
        Some(Stop::Failed(_)) => "error",
    }
}

/// What to do about lost events, for the mode that lost them.
fn loss_hint(mode: ModeArg) -> &'static str {
    match mode {
        ModeArg::Stop => {
            "events were lost (dropped while a ring was full): raise --buffer-kb or lower --rate, or use --mode overwrite to keep the newest events"
        }
        ModeArg::Overwrite => {
            "events were lost (overwritten before they were read): raise --buffer-kb or lower --rate"
        }
    }
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
    written_to: Written<'_>,
    failed: bool,
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
            VcpuOutcome::Panicked(msg) => {
                format!("guest panicked: {}", hyptrace_output::escape_guest_str(msg))
            }
            VcpuOutcome::Faulted(msg) => {
                format!("guest crashed: {}", hyptrace_output::escape_guest_str(msg))
            }
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
                r.flag(failed)
            );
        }
    }
    // Totals of guest numbers saturate (a hostile guest's counters can be anything).
    let read = sat_sum(reports.iter().map(|r| r.stats.read));
    let lost = sat_sum(reports.iter().map(|r| r.stats.lost));
    let written = sat_sum(reports.iter().map(|r| r.written));
    let secs = wall.as_secs_f64();
    let mb = sat_sum(reports.iter().map(|r| r.stats.bytes)) as f64 / 1e6;
    let overrun = sat_sum(reports.iter().map(|r| r.stats.overrun));
    let dropped = sat_sum(reports.iter().map(|r| r.stats.dropped));
    let n = outcomes.len();
    let _ = writeln!(
        s,
        "hyptrace: {n} vCPU{}: written {written} = read {read} + lost {lost} (overrun {overrun}, dropped {dropped}); {secs:.3} s, {mb:.1} MB of events ({:.1} MB/s), {}",
        if n == 1 { "" } else { "s" },
        if secs > 0.0 { mb / secs } else { 0.0 },
        match written_to {
            Written::Stdout(n) => format!("{n} line{} printed", if n == 1 { "" } else { "s" }),
            Written::File(p, f) => format!("{} written to {}", format_name(f), shown_path(p)),
            Written::Failed(p) => format!("{} not written", shown_path(p)),
        }
    );
    s
}

/// The sum of `v`, saturating at `u64::MAX`.
fn sat_sum(v: impl IntoIterator<Item = u64>) -> u64 {
    v.into_iter().fold(0, u64::saturating_add)
}

/// Where the events went, for the last words of the summary.
enum Written<'a> {
    /// Lines that reached stdout.
    Stdout(u64),
    /// A complete file.
    File(&'a Path, FormatArg),
    /// The output failed (the error follows the summary).
    Failed(&'a Path),
}

/// What a file of `format` is called in messages.
fn format_name(format: FormatArg) -> &'static str {
    match format {
        FormatArg::Dat => "trace.dat (v7)",
        FormatArg::Dat6 => "trace.dat (v6)",
        FormatArg::Json => "JSON",
        FormatArg::Text => "text",
        FormatArg::Raw => "raw pages",
    }
}

/// A path for messages; `-` is stdout.
fn shown_path(p: &Path) -> Cow<'_, str> {
    if p.as_os_str() == "-" {
        Cow::Borrowed("stdout")
    } else {
        p.to_string_lossy()
    }
}

/// The crash of a vCPU for `--stats`: its kind, the message (a panic's text comes from
/// the guest; JSON escapes it) and the instruction pointer when the host read it.
fn crash_json(cpu: usize, o: &VcpuOutcome) -> Option<serde_json::Value> {
    let (kind, msg) = match o {
        VcpuOutcome::Panicked(m) => ("panic", m),
        VcpuOutcome::Faulted(m) => ("fault", m),
        _ => return None,
    };
    // `where_` in vcpu.rs appends "(rip 0x…, …)" when the registers could be read.
    let rip = msg.rfind("(rip 0x").and_then(|i| {
        let hex: String = msg[i + 7..]
            .chars()
            .take_while(char::is_ascii_hexdigit)
            .collect();
        u64::from_str_radix(&hex, 16).ok()
    });
    Some(serde_json::json!({
        "cpu": cpu,
        "kind": kind,
        "message": msg,
        "rip": rip.map(|r| format!("{r:#x}")),
    }))
}

#[allow(clippy::too_many_arguments)]
fn stats_json(
    a: &RunArgs,
    outcomes: &[VcpuOutcome],
    reports: &[CpuReport],
    tsc_khz: u64,
    wall: Duration,
    stop_reason: Option<&str>,
    end: &str,
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
                "crash": outcomes.get(cpu).and_then(|o| crash_json(cpu, o)),
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
        "end": end,
        "crash": outcomes.iter().enumerate().find_map(|(cpu, o)| crash_json(cpu, o)),
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
            Written::Stdout(0),
            false,
        );
        let m = u64::MAX;
        assert!(
            text.contains(&format!("written {m} = read 6 + lost {m}")),
            "{text}"
        );
    }

    fn parse_err(extra: &[&str]) -> String {
        let mut v = vec!["hyptrace", "run"];
        v.extend_from_slice(extra);
        match Cli::try_parse_from(v) {
            Ok(c) => panic!("{extra:?} parsed: {c:?}"),
            Err(e) => e.render().to_string(),
        }
    }

    #[test]
    fn range_errors_name_the_flag_and_the_limit() {
        for (bad, needles) in [
            (&["--vcpus", "0"][..], &["--vcpus", "1..=256"][..]),
            (&["--vcpus", "-1"], &["--vcpus", "1..=256"]),
            (&["--vcpus", "100000"], &["--vcpus", "1..=256"]),
            (
                &["--duration", "inf"],
                &["--duration", "finite", "1000000000"],
            ),
            (&["--duration", "nan"], &["--duration", "not a number"]),
            (&["--duration", "-1"], &["--duration", "more than 0"]),
            (&["--duration", "0"], &["--duration", "more than 0"]),
            (&["--duration", "1e10"], &["--duration", "limit"]),
            (&["--workload", "nope"], &["possible values: steady, mixed"]),
        ] {
            let e = parse_err(bad);
            for n in needles {
                assert!(e.contains(n), "{bad:?}: {e:?} lacks {n:?}");
            }
        }
        let e = plan(&args(&["--buffer-kb", "99999999999"])).expect_err("accepted");
        assert!(
            e.contains("--buffer-kb") && e.contains("3145728 KiB"),
            "{e}"
        );
        assert_eq!(parse_duration("0.5"), Ok(0.5));
    }

    /// The largest --buffer-kb the memory-limit message names is accepted, one page more
    /// is not.
    #[test]
    fn buffer_limit_is_exact() {
        let e = plan(&args(&["--vcpus", "256", "--buffer-kb", "65536"])).expect_err("fits?");
        let max: u64 = e
            .split("at most ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no limit in {e}"));
        assert!(
            e.contains("guest memory") && e.contains("--buffer-kb"),
            "{e}"
        );
        let ok = max.to_string();
        plan(&args(&["--vcpus", "256", "--buffer-kb", &ok])).expect("the limit fits");
        let over = (max + 4).to_string();
        assert!(plan(&args(&["--vcpus", "256", "--buffer-kb", &over])).is_err());
    }

    #[test]
    fn largest_search() {
        assert_eq!(largest(3, 100, |n| n <= 42), Some(42));
        assert_eq!(largest(3, 100, |_| true), Some(100));
        assert_eq!(largest(3, 100, |_| false), None);
        assert_eq!(largest(3, 3, |n| n == 3), Some(3));
        assert_eq!(largest(5, 3, |_| true), None);
    }

    #[test]
    fn destinations() {
        let dir = std::env::temp_dir().join(format!("hyptrace-dest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let p = |n: &str| dir.join(n);
        std::fs::write(p("file"), b"x").expect("write");
        // New file, existing file, a symlink to either: fine.
        check_destination(&p("new.dat"), "-o").expect("new file");
        check_destination(&p("file"), "-o").expect("existing file");
        std::os::unix::fs::symlink(p("file"), p("link")).expect("symlink");
        check_destination(&p("link"), "-o").expect("symlink to a file");
        std::os::unix::fs::symlink(p("later"), p("dangling")).expect("symlink");
        check_destination(&p("dangling"), "-o").expect("dangling symlink, target creatable");
        std::os::unix::fs::symlink("/nonexistent/dir/x", p("nowhere")).expect("symlink");
        let e = check_destination(&p("nowhere"), "-o").expect_err("target dir missing");
        assert!(e.contains("does not exist"), "{e}");
        // A FIFO is written in place.
        let fifo = std::ffi::CString::new(p("fifo").as_os_str().as_encoded_bytes()).expect("c");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        check_destination(&p("fifo"), "-o").expect("fifo");
        // Refused: a directory, a missing directory, a file used as a directory.
        let e = check_destination(&dir, "--stats").expect_err("dir");
        assert!(
            e.contains("(--stats)") && e.contains("is a directory"),
            "{e}"
        );
        let e = check_destination(&p("sub/"), "-o").expect_err("trailing slash");
        assert!(e.contains("directory"), "{e}");
        let e = check_destination(&p("missing/x.json"), "--json").expect_err("missing dir");
        assert!(e.contains("does not exist"), "{e}");
        let e = check_destination(&p("file/x.json"), "--json").expect_err("not a dir");
        assert!(e.contains("--json"), "{e}");
        let e = check_destination(Path::new(""), "-o").expect_err("empty");
        assert!(e.contains("empty"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Signals within SIGNAL_BURST of the first count as one; a later one aborts; a
    /// third, later still, exits.
    #[test]
    fn signal_bursts() {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let st = Interrupts::default();
        let w = SIGNAL_BURST.as_nanos() as u64;
        let t0 = 5_000_000_000u64;
        assert_eq!(st.on_signal(SIGTERM, t0), SignalAction::Stop);
        assert!(st.stop_requested() && !st.aborted());
        assert_eq!(st.signal_name(), "SIGTERM");
        // `timeout` signals the process, then its group.
        assert_eq!(st.on_signal(SIGINT, t0), SignalAction::Burst);
        assert_eq!(st.on_signal(SIGINT, t0 + w - 1), SignalAction::Burst);
        assert_eq!(
            st.on_signal(SIGINT, t0 - 10),
            SignalAction::Burst,
            "handlers race"
        );
        assert!(!st.aborted());
        assert_eq!(st.signal_name(), "SIGTERM");
        assert_eq!(st.on_signal(SIGINT, t0 + w), SignalAction::Abort);
        assert!(st.aborted());
        assert_eq!(st.on_signal(SIGINT, t0 + w + w / 2), SignalAction::Burst);
        assert_eq!(st.on_signal(SIGINT, t0 + 3 * w), SignalAction::Exit);
        assert_eq!(st.on_signal(SIGINT, t0 + 9 * w), SignalAction::Burst);
        assert!(monotonic_ns() > 0);
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

    #[test]
    fn crash_detail() {
        let f = VcpuOutcome::Faulted("triple fault (rip 0x1f00a, rsp 0x10)".into());
        let v = crash_json(1, &f).expect("crash");
        assert_eq!(v["rip"], "0x1f00a");
        assert_eq!(v["kind"], "fault");
        assert_eq!(v["cpu"], 1);
        let p = VcpuOutcome::Panicked("boom \"quoted\"\x07".into());
        let v = crash_json(0, &p).expect("crash");
        assert_eq!(v["message"], "boom \"quoted\"\x07");
        assert!(v["rip"].is_null());
        let text = serde_json::to_string(&v).expect("json");
        assert!(
            text.contains("\\u0007") && text.contains("\\\"quoted"),
            "{text}"
        );
        assert!(crash_json(0, &VcpuOutcome::Stopped).is_none());
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            &["--page-size", "5000"][..],
            &["--page-size", "2048"],
            &["--buffer-kb", "8"],
            &["--mem-mb", "1"],
            &["--mem-mb", "100000"],
            &["--poll-ms", "0"],
            &["--guest", "/nonexistent/guest.elf"],
            &["--vcpus", "256", "--buffer-kb", "65536"],
        ] {
            assert!(plan(&args(bad)).is_err(), "{bad:?} accepted");
        }
    }
}
