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

use crate::elf::GuestImage;
use crate::layout::{Layout, HUGE_PAGE, MAX_MEM_BYTES, MAX_VCPUS, MIN_MEM_BYTES};
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
    /// Boot the guest payload on KVM, run a workload on every vCPU, report.
    Run(RunArgs),
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
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub vcpus: u32,
    /// Events each vCPU writes.
    #[arg(long, value_name = "N", default_value_t = 100_000)]
    pub events: u64,
    /// Events per second per vCPU; 0 = as fast as possible.
    #[arg(long, value_name = "R", default_value_t = 200_000)]
    pub rate: u64,
    /// Guest workload.
    #[arg(long, value_enum, default_value_t = WorkloadArg::Steady)]
    pub workload: WorkloadArg,
    /// Ring buffer size per vCPU in KiB, reader page included (at least 3 pages).
    #[arg(long = "buffer-kb", value_name = "K", default_value_t = 1024)]
    pub buffer_kb: u64,
    /// Ring page size in bytes: a power of two, at least 4096.
    #[arg(long = "page-size", value_name = "B", default_value_t = 4096)]
    pub page_size: u64,
    /// Guest memory in MiB [default: just enough for the guest image, stacks, parameters
    /// and trace region, rounded up to 2 MiB; at most 3072].
    #[arg(long = "mem-mb", value_name = "M")]
    pub mem_mb: Option<u64>,
    /// Ring mode when full.
    #[arg(long, value_enum, default_value_t = ModeArg::Overwrite)]
    pub mode: ModeArg,
    /// Who swaps the reader page.
    #[arg(long, value_enum, default_value_t = SwapArg::Host)]
    pub swap: SwapArg,
    /// Host reader poll period in milliseconds (at least 1).
    #[arg(long = "poll-ms", value_name = "MS", default_value_t = 1)]
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
    }
}

fn usage_error(msg: impl std::fmt::Display) -> i32 {
    eprintln!("hyptrace: error: {msg}");
    EXIT_USAGE
}

/// Size of the trace region for `vcpus` rings of `pages_per_cpu` pages (reader page
/// included) of `page_size` bytes: the ring-buffer pack layout's own number.
pub fn trace_region_bytes(
    vcpus: u32,
    pages_per_cpu: u64,
    page_size: u64,
    mode: ModeArg,
    swap: SwapArg,
) -> Result<u64, String> {
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
    .map(|l| l.region_size as u64)
    .map_err(|e| format!("trace region: {e}"))
}

/// A validated `run` configuration.
#[derive(Debug)]
struct Plan {
    cfg: VmConfig,
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
    if buffer % a.page_size != 0 {
        return Err(format!(
            "--buffer-kb {} is not a multiple of the page size ({} bytes)",
            a.buffer_kb, a.page_size
        ));
    }
    let pages = buffer / a.page_size;
    let trace = trace_region_bytes(a.vcpus, pages, a.page_size, a.mode, a.swap)?;
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

/// `hyptrace run`.
pub fn run(a: &RunArgs) -> i32 {
    let plan = match plan(a) {
        Ok(p) => p,
        Err(msg) => return usage_error(msg),
    };
    let vm = match Vm::new(plan.cfg) {
        Ok(vm) => vm,
        Err(e) if e.is_input_error() => return usage_error(e),
        Err(e) => {
            eprintln!("hyptrace: error: {e}");
            return EXIT_RUNTIME;
        }
    };
    let term = match termination_flag() {
        Ok(t) => t,
        Err(msg) => {
            eprintln!("hyptrace: error: {msg}");
            return EXIT_RUNTIME;
        }
    };
    let tsc_khz = vm.tsc_khz();
    let tsc_offset = vm.tsc_offset();
    let running = match vm.start(&plan.params) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("hyptrace: error: {e}");
            return EXIT_RUNTIME;
        }
    };
    let deadline = plan.duration.map(|d| running.started_at() + d);
    let mut stop_reason: Option<&str> = None;
    while !running.wait_timeout(plan.poll) {
        // The ring-buffer reader will poll the trace region here, every --poll-ms.
        if stop_reason.is_none() {
            stop_reason = if term.load(Ordering::SeqCst) {
                Some("interrupted")
            } else if deadline.is_some_and(|d| Instant::now() >= d) {
                Some("--duration elapsed")
            } else if running.any_crashed() {
                Some("a vCPU crashed")
            } else {
                None
            };
            if stop_reason.is_some() {
                running.stop();
            }
        }
    }
    let wall = running.started_at().elapsed();
    let start_tsc = running.start_tsc();
    let outcomes = running.wait();

    if let Some(r) = stop_reason {
        eprintln!("hyptrace: stopped: {r}");
    }
    let report = summary(&outcomes, tsc_khz, start_tsc, tsc_offset, wall);
    eprint!("{report}");
    let code = exit_code(&outcomes);
    if let Some(path) = &a.stats {
        let json = stats_json(a, &outcomes, tsc_khz, wall, stop_reason, code);
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

fn summary(
    outcomes: &[VcpuOutcome],
    tsc_khz: u64,
    start_tsc: u64,
    tsc_offset: Option<i64>,
    wall: Duration,
) -> String {
    let mut s = String::new();
    let mut total = 0;
    let ms = |cycles: u64| {
        if tsc_khz == 0 {
            0.0
        } else {
            cycles as f64 / tsc_khz as f64
        }
    };
    for (id, o) in outcomes.iter().enumerate() {
        let _ = match o {
            VcpuOutcome::Finished(st) => {
                total += st.attempted;
                let t = ms(st.tsc_end.wrapping_sub(st.tsc_start));
                // Events per millisecond = thousands per second.
                let rate = if t > 0.0 {
                    st.attempted as f64 / t * 1000.0
                } else {
                    0.0
                };
                // First guest instruction relative to the start of the vCPU threads, when
                // guest and host TSCs can be related.
                let started = match tsc_offset {
                    Some(off) => {
                        let host = st.tsc_start.wrapping_sub(off as u64);
                        format!(
                            ", first instruction {:.3} ms after start",
                            ms(host.wrapping_sub(start_tsc))
                        )
                    }
                    None => String::new(),
                };
                writeln!(
                    s,
                    "hyptrace: vcpu {id}: finished: {} events attempted, {} skipped, {t:.3} ms in the guest ({:.2} M events/s){started}",
                    st.attempted,
                    st.skipped,
                    rate / 1e6,
                )
            }
            VcpuOutcome::Panicked(msg) => writeln!(s, "hyptrace: vcpu {id}: guest panicked: {msg}"),
            VcpuOutcome::Faulted(msg) => writeln!(s, "hyptrace: vcpu {id}: guest crashed: {msg}"),
            VcpuOutcome::Stopped => writeln!(s, "hyptrace: vcpu {id}: stopped"),
            VcpuOutcome::Error(msg) => writeln!(s, "hyptrace: vcpu {id}: error: {msg}"),
        };
    }
    let _ = writeln!(
        s,
        "hyptrace: {} vCPUs, {total} events attempted by finished vCPUs, {:.3} s",
        outcomes.len(),
        wall.as_secs_f64()
    );
    s
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn stats_json(
    a: &RunArgs,
    outcomes: &[VcpuOutcome],
    tsc_khz: u64,
    wall: Duration,
    stop_reason: Option<&str>,
    code: i32,
) -> String {
    let mut s = String::from("{\n");
    let _ = writeln!(
        s,
        "  \"workload\": {},",
        json_str(&format!("{:?}", a.workload).to_lowercase())
    );
    let _ = writeln!(s, "  \"vcpus\": {},", a.vcpus);
    let _ = writeln!(s, "  \"events_per_vcpu\": {},", a.events);
    let _ = writeln!(s, "  \"rate\": {},", a.rate);
    let _ = writeln!(s, "  \"tsc_khz\": {tsc_khz},");
    let _ = writeln!(s, "  \"wall_seconds\": {:.6},", wall.as_secs_f64());
    let _ = writeln!(
        s,
        "  \"stop_reason\": {},",
        stop_reason.map_or("null".to_string(), json_str)
    );
    let _ = writeln!(s, "  \"exit_code\": {code},");
    s.push_str("  \"per_vcpu\": [\n");
    for (id, o) in outcomes.iter().enumerate() {
        let body = match o {
            VcpuOutcome::Finished(st) => format!(
                "\"outcome\": \"finished\", \"attempted\": {}, \"skipped\": {}, \"tsc_start\": {}, \"tsc_end\": {}, \"mailbox_served\": {}",
                st.attempted, st.skipped, st.tsc_start, st.tsc_end, st.mailbox_served
            ),
            VcpuOutcome::Panicked(m) => format!("\"outcome\": \"panicked\", \"message\": {}", json_str(m)),
            VcpuOutcome::Faulted(m) => format!("\"outcome\": \"faulted\", \"message\": {}", json_str(m)),
            VcpuOutcome::Stopped => "\"outcome\": \"stopped\"".to_string(),
            VcpuOutcome::Error(m) => format!("\"outcome\": \"error\", \"message\": {}", json_str(m)),
        };
        let comma = if id + 1 < outcomes.len() { "," } else { "" };
        let _ = writeln!(s, "    {{\"vcpu\": {id}, {body}}}{comma}");
    }
    s.push_str("  ]\n}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> RunArgs {
        let mut v = vec!["hyptrace", "run"];
        v.extend_from_slice(extra);
        match Cli::try_parse_from(v).expect("parses").command {
            Command::Run(a) => a,
        }
    }

    #[test]
    fn defaults_plan() {
        let p = plan(&args(&[])).expect("default plan");
        assert_eq!(p.cfg.vcpus, 2);
        assert_eq!(p.params.events, 100_000);
        assert!(p.cfg.mem_bytes >= p.cfg.trace_region_bytes);
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            &["--vcpus", "0"][..],
            &["--vcpus", "100000"],
            &["--page-size", "5000"],
            &["--page-size", "2048"],
            &["--buffer-kb", "8"],
            &["--buffer-kb", "13"],
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

    #[test]
    fn json_escapes() {
        assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
