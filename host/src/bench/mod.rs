//! `hyptrace bench`: end-to-end benchmarks in a real VM, with native baselines measured
//! in the same invocation (see docs/benchmarks.md).
//!
//! Sections (each in the printed table and the JSON written by `--json FILE`):
//! - `writer`: guest ns/event per payload size and vCPU count, from the guest's TSC (the
//!   `bench` workload times its own write loop, chunk by chunk), against the same loop
//!   run natively in host threads on a heap region of the same layout, and against the
//!   bound — one `rdtsc` plus a raw store of the same bytes — and `rdtsc` alone.
//! - `drain`: page-at-a-time reading (`next_page`, validation and copy-out included)
//!   into a raw page file and into a null sink, on a host region filled beforehand
//!   (the reader alone); and `hyptrace record`'s pipeline in a VM with the guest
//!   writing as fast as it can.
//! - `swap`: every `swap_reader` call of a real drain timed, host-executed (`Direct`
//!   on guest memory) and guest-executed (the mailbox round trip), no exits.
//! - `max_rate`: the highest `--rate` sustained with zero loss in stop mode at the
//!   default poll interval and buffer size (a short doubling + bisection search). Every
//!   run writes at least twice what a ring holds, so a loss-free run means the reader
//!   kept up. `--quick` makes one run at the first rate: a lower bound, not a search
//!   (`searched: false`); a search that never lost reports a lower bound too
//!   (`first_lossy_rate: null`, `lower_bound: true`).
//! - `startup`: VMM start (before the VM is created) → the first event's timestamp.
//!
//! Module map: `harness` (a VM run with a reader, as `record`), `stats`
//! (`Quantiles`, JSON summaries, TSC units), one file per section
//! (`startup`, `writer`, `swap`, `drain`, `rate`, `criterion`) each with its
//! typed rows, and `table` (the text). `BenchReport` is the JSON.
//!
//! Times are TSC cycles converted with the vCPUs' TSC frequency (guest TSC = host TSC
//! on this machine; see `Vm::tsc_offset`). Every figure is a median over repetitions;
//! spreads are reported next to them. No figure is asserted.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use hyptrace_abi::guest::{BENCH_CHUNK, RUN_FLAG_BENCH_TYPED};
use hyptrace_abi::layout::Mode;
use serde::Serialize;

use crate::drain::session::MAILBOX_TIMEOUT;
use crate::exit::{EXIT_RUNTIME, EXIT_USAGE};
use crate::pipeline::plan::Plan;

mod criterion;
mod drain;
mod error;
mod harness;
pub mod options;
mod rate;
pub mod report;
mod sinks;
mod startup;
mod stats;
mod subscriber;
mod sustained;
mod swap;
mod table;
mod writer;

use drain::DrainReport;
pub use error::{BenchError, SubscriberError};
pub use options::{BenchArgs, BenchWhat};
use stats::Tsc;
use swap::SwapReport;

/// Sections of `hyptrace bench` (`--only`, from [`options::SectionArg`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// Guest vs native vs bound ns/event.
    Writer,
    /// swap_reader latency.
    Swap,
    /// Drain throughput.
    Drain,
    /// Highest loss-free rate.
    Rate,
    /// Each output format's throughput.
    Sinks,
    /// Sustained records.
    Sustained,
}

/// Ring pages per vCPU (reader page included): the CLI's default `--buffer-kb` of 4 KiB
/// pages.
const DEFAULT_PAGES: u64 = crate::pipeline::options::DEFAULT_BUFFER_KB * 1024 / PAGE_SIZE;
const PAGE_SIZE: u64 = 4096;
/// Largest payload of the guest's bench workload.
const MAX_BENCH_PAYLOAD: u32 = 2048;
/// The idle poll of every bench run: the CLI's default `--poll-ms`.
const POLL_MS: u64 = crate::pipeline::options::DEFAULT_POLL_MS;

/// The checked plan of a VM run of `spec`: `hyptrace run`'s options (typed, checked
/// by [`Plan::new`] as the CLI's are), then what the CLI cannot say (the bench
/// workload, its payload, guest memory in whole 2 MiB pages). Here, in the bench's
/// options layer: the sections below it say what they run with the lower layers'
/// types ([`harness::VmSpec`]), as the pipeline's plan does.
fn plan(spec: &harness::VmSpec) -> Result<Plan, BenchError> {
    use crate::pipeline::options::{DrainArg, FlightArgs, ModeArg, RunArgs, SwapArg};
    let args = RunArgs {
        vcpus: spec.vcpus,
        events: spec.events,
        rate: spec.rate,
        mode: match spec.mode {
            Mode::Overwrite => ModeArg::Overwrite,
            Mode::Stop => ModeArg::Stop,
        },
        swap: if spec.guest_swap {
            SwapArg::Guest
        } else {
            SwapArg::Host
        },
        buffer_kb: spec.pages * PAGE_SIZE / 1024,
        page_size: PAGE_SIZE,
        flight: FlightArgs {
            drain: if spec.drain_live {
                DrainArg::Live
            } else {
                DrainArg::None
            },
            ..FlightArgs::default()
        },
        ..RunArgs::default()
    };
    let mut plan = Plan::new(&args)?;
    plan.params.workload = spec.workload;
    plan.params.payload = spec.payload;
    if spec.typed {
        plan.params.flags |= RUN_FLAG_BENCH_TYPED;
    }
    plan.cfg.mem_bytes = plan.cfg.mem_bytes.div_ceil(2 << 20) * (2 << 20);
    plan.mailbox_timeout = MAILBOX_TIMEOUT;
    // A failed bench run is an error of its own; no crash-dump file (which `run
    // --drain none` would write into the working directory) is wanted.
    plan.flight.crash_dump = None;
    Ok(plan)
}

/// The effective configuration.
#[derive(Clone, Debug)]
struct Cfg {
    quick: bool,
    vcpus: Vec<u32>,
    payloads: Vec<u32>,
    events: u64,
    reps: u32,
    swap_events: u64,
    swap_rate: u64,
    drain_pages: u32,
    rate_seconds: f64,
    rate_steps: u32,
    /// Runs per step of the rate search (all must be loss-free).
    rate_repeats: u32,
    /// Events of each `sustained` record (and of the rate search's confirmation).
    sustained_events: u64,
    /// `--only` (empty: every section).
    only: Vec<Section>,
}

impl Cfg {
    fn new(a: &BenchArgs) -> Result<Self, BenchError> {
        let q = a.quick;
        let vcpus = if a.vcpus.is_empty() {
            if q {
                vec![1]
            } else {
                vec![1, 2]
            }
        } else {
            a.vcpus.clone()
        };
        let payloads = if a.payloads.is_empty() {
            if q {
                vec![16]
            } else {
                vec![0, 8, 16, 64, 256]
            }
        } else {
            a.payloads.clone()
        };
        if let Some(&v) = vcpus.iter().find(|&&v| v == 0 || v > 64) {
            return Err(BenchError::Vcpus(v));
        }
        if let Some(&p) = payloads.iter().find(|&&p| p > MAX_BENCH_PAYLOAD) {
            return Err(BenchError::Payload(p));
        }
        let events = a.events.unwrap_or(if q { 100_000 } else { 1_000_000 });
        if events < BENCH_CHUNK {
            return Err(BenchError::Events(events));
        }
        let reps = a.reps.unwrap_or(if q { 1 } else { 5 });
        if reps == 0 {
            return Err(BenchError::Reps);
        }
        Ok(Self {
            quick: q,
            vcpus,
            payloads,
            events,
            reps,
            swap_events: if q { 20_000 } else { 400_000 },
            swap_rate: 1_000_000,
            drain_pages: if q { 512 } else { 8192 },
            rate_seconds: if q { 0.05 } else { 5.0 },
            rate_steps: if q { 0 } else { 8 },
            rate_repeats: if q { 1 } else { 3 },
            sustained_events: if q { 2_000_000 } else { 60_000_000 },
            only: a.only.iter().map(|&s| s.into()).collect(),
        })
    }
}

/// The payload bytes of the bench workload's events (the guest writes the same).
fn bench_payload(n: u32) -> Vec<u8> {
    (0..n as usize).map(|i| i as u8).collect()
}

/// A section's object in the JSON: its row, or `{}` when the section was not run
/// (`--only`).
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
enum Measured<T> {
    /// Measured.
    Ran(T),
    /// Not run: serialised as `{}`.
    NotRun {},
}

impl<T> Measured<T> {
    fn get(&self) -> Option<&T> {
        match self {
            Self::Ran(t) => Some(t),
            Self::NotRun {} => None,
        }
    }
}

/// Everything `hyptrace bench` measured: the `--json` document (docs/benchmarks.md).
#[derive(Clone, Debug, Serialize)]
struct BenchReport {
    version: u32,
    quick: bool,
    machine: Machine,
    config: BenchConfig,
    startup: startup::StartupReport,
    writer: Vec<writer::WriterRow>,
    swap: SwapReport,
    drain: DrainReport,
    max_rate: Vec<rate::RateRow>,
    sinks: Measured<sinks::SinksReport>,
    sustained: Measured<sustained::SustainedReport>,
    /// `--criterion DIR`'s medians, keyed by benchmark id; `null` without it.
    criterion: Option<BTreeMap<String, criterion::CriterionRow>>,
    /// The sections that failed (their fields stay `{}`/empty): the run exits 1.
    failed: Vec<FailedSection>,
    wall_seconds: f64,
}

/// A section that failed, and why.
#[derive(Clone, Debug, Serialize)]
struct FailedSection {
    section: String,
    error: String,
}

impl BenchReport {
    /// The JSON text: keys sorted at every level (as `serde_json::Value` orders them),
    /// pretty-printed, one trailing newline.
    fn json(&self) -> String {
        let mut s = serde_json::to_value(self)
            .and_then(|v| serde_json::to_string_pretty(&v))
            .unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    }
}

/// The machine the figures come from.
#[derive(Clone, Debug, Serialize)]
struct Machine {
    cpu: String,
    cpus: usize,
    kernel: String,
    /// `pvm` or `kvm`.
    kvm: &'static str,
    tsc_khz: u64,
    /// `/proc/loadavg`'s three averages when the bench started and when it ended.
    loadavg_at_start: String,
    loadavg_at_end: String,
}

impl Machine {
    /// The note the table prints when other work ran beside the bench: a 1-minute load
    /// average at the start or the end above half the CPUs (the bench itself keeps
    /// about one CPU busy). Its medians may then be slow and its spreads wide.
    fn busy_note(&self) -> Option<String> {
        let one = |s: &str| s.split_whitespace().next()?.parse::<f64>().ok();
        let (a, b) = (one(&self.loadavg_at_start), one(&self.loadavg_at_end));
        let worst = a.into_iter().chain(b).fold(0.0, f64::max);
        (self.cpus > 0 && worst > 1.0 + self.cpus as f64 / 2.0).then(|| {
            format!(
                "note: the machine was busy (load average {} at the start, {} at the end, {} CPUs): \
                 other work ran beside, so medians may be slow and spreads wide; compare rows of this run as ratios",
                self.loadavg_at_start, self.loadavg_at_end, self.cpus
            )
        })
    }
}

/// `/proc/loadavg`'s three averages.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The effective configuration, as run.
#[derive(Clone, Debug, Default, Serialize)]
struct BenchConfig {
    vcpus: Vec<u32>,
    payloads: Vec<u32>,
    events_per_vcpu: u64,
    reps: u32,
    chunk_events: u64,
    ring_pages_per_vcpu: u64,
    page_size: u64,
    poll_ms: u32,
}

impl SwapReport {
    fn not_run() -> Self {
        Self {
            host: Measured::NotRun {},
            guest: Measured::NotRun {},
            host_live_drain: Measured::NotRun {},
            guest_live_drain: Measured::NotRun {},
        }
    }
}

impl DrainReport {
    fn not_run() -> Self {
        Self {
            reader_to_file: Measured::NotRun {},
            reader_only: Measured::NotRun {},
            vm_record_raw: Measured::NotRun {},
            subscriber: Measured::NotRun {},
        }
    }
}

/// `hyptrace bench`.
pub fn bench(a: &BenchArgs) -> Result<(), BenchCmdError> {
    if let Some(BenchWhat::Report(r)) = &a.what {
        let plan = report::ReportBench {
            input: &r.input,
            reps: r.reps,
            trace_cmd: &r.trace_cmd,
        };
        return report::bench_report(&plan).map_err(BenchCmdError::Report);
    }
    let cfg = Cfg::new(a).map_err(BenchCmdError::Options)?;
    // An empty criterion import would write `"criterion": {}` over a JSON that had them.
    if let Some(d) = a.criterion.as_deref() {
        if criterion::import_criterion(d).is_empty() {
            return Err(BenchCmdError::Options(BenchError::NoCriterion(d.into())));
        }
    }
    // Before the first VM boots: a bad --json path costs nothing.
    let json_target = a
        .json
        .as_deref()
        .map(|p| crate::drain::sink::check_destination(p, "--json"))
        .transpose()?;
    let v = run_all(&cfg, a).map_err(BenchCmdError::Run)?;
    print!("{}", table::table(&v));
    if let Some(t) = &json_target {
        crate::drain::sink::write_destination(t, &v.json()).map_err(BenchCmdError::Json)?;
    }
    match v
        .failed
        .iter()
        .map(|f| f.section.as_str())
        .collect::<Vec<_>>()
    {
        names if names.is_empty() => Ok(()),
        names => Err(BenchCmdError::Sections(names.join(", "))),
    }
}

/// Why `hyptrace bench` failed (the CLI prints it and maps it to its exit code).
#[derive(Debug, thiserror::Error)]
pub enum BenchCmdError {
    /// The options do not fit (exit 2).
    #[error(transparent)]
    Options(BenchError),
    /// The `--json` path is unusable (exit 2).
    #[error(transparent)]
    Destination(#[from] crate::drain::sink::DestinationError),
    /// A measurement failed (exit 1).
    #[error("bench")]
    Run(#[source] BenchError),
    /// Sections failed (each error printed as it happened); the others' results were
    /// printed and written (exit 1).
    #[error("bench: these sections failed (see above; the JSON lists them under \"failed\"): {0}")]
    Sections(String),
    /// `--json` could not be written (exit 1).
    #[error("cannot write --json")]
    Json(#[source] hyptrace_output::OutputError),
    /// `bench report` failed.
    #[error("bench report")]
    Report(#[source] report::ReportBenchError),
}

impl BenchCmdError {
    /// The exit code of each failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Options(_) | Self::Destination(_) => EXIT_USAGE,
            Self::Run(_) | Self::Json(_) | Self::Sections(_) => EXIT_RUNTIME,
            Self::Report(e) => e.exit_code(),
        }
    }
}

/// A section's result, or — its error printed and noted in `failed` — nothing: a
/// failing section does not discard what the sections before and after it measured.
fn keep<T>(failed: &mut Vec<FailedSection>, section: &str, r: Result<T, BenchError>) -> Option<T> {
    match r {
        Ok(t) => Some(t),
        Err(e) => {
            let error = crate::exit::chain(&e);
            eprintln!("hyptrace bench: {section} failed: {error}");
            failed.push(FailedSection {
                section: section.into(),
                error,
            });
            None
        }
    }
}

fn run_all(cfg: &Cfg, a: &BenchArgs) -> Result<BenchReport, BenchError> {
    let t0 = Instant::now();
    let load_at_start = loadavg();
    eprintln!("hyptrace bench: startup");
    // Every other section needs the TSC frequency it measures: its failure ends the run.
    let (startup, tsc) = startup::startup(cfg)?;
    let on = |s: Section| cfg.only.is_empty() || cfg.only.contains(&s);
    let mut failed = Vec::new();
    let mut writer = Vec::new();
    if on(Section::Writer) {
        eprintln!("hyptrace bench: writer (guest, native, bound)");
        writer = keep(&mut failed, "writer", writer::writer_section(cfg, tsc)).unwrap_or_default();
    }
    let mut swap = SwapReport::not_run();
    if on(Section::Swap) {
        eprintln!("hyptrace bench: swap latency");
        swap = keep(&mut failed, "swap", swap::swap_section(cfg, tsc)).unwrap_or(swap);
    }
    let mut drain = DrainReport::not_run();
    if on(Section::Drain) {
        eprintln!("hyptrace bench: drain");
        drain = keep(&mut failed, "drain", drain::drain_section(cfg, tsc)).unwrap_or(drain);
        if let Some(sub) = keep(
            &mut failed,
            "drain (subscriber)",
            subscriber::subscriber_drain(cfg),
        ) {
            eprintln!("  subscriber: {:.0} MB/s", sub.throughput.mb_per_s.median);
            drain.subscriber = Measured::Ran(sub);
        }
    }
    let mut max_rate = Vec::new();
    if on(Section::Rate) {
        eprintln!("hyptrace bench: highest loss-free rate");
        max_rate = keep(&mut failed, "rate", rate::max_rate_section(cfg)).unwrap_or_default();
    }
    let mut sinks = Measured::NotRun {};
    if on(Section::Sinks) {
        eprintln!("hyptrace bench: sinks");
        if let Some(r) = keep(&mut failed, "sinks", sinks::sinks_section(cfg)) {
            sinks = Measured::Ran(r);
        }
    }
    let mut sustained = Measured::NotRun {};
    if on(Section::Sustained) {
        eprintln!("hyptrace bench: sustained records");
        if let Some(r) = keep(&mut failed, "sustained", sustained::sustained_section(cfg)) {
            sustained = Measured::Ran(r);
        }
    }
    let criterion = a.criterion.as_deref().map(criterion::import_criterion);
    Ok(BenchReport {
        version: 1,
        quick: cfg.quick,
        machine: machine(tsc, &load_at_start),
        config: BenchConfig {
            vcpus: cfg.vcpus.clone(),
            payloads: cfg.payloads.clone(),
            events_per_vcpu: cfg.events,
            reps: cfg.reps,
            chunk_events: BENCH_CHUNK,
            ring_pages_per_vcpu: DEFAULT_PAGES,
            page_size: PAGE_SIZE,
            poll_ms: POLL_MS as u32,
        },
        startup,
        writer,
        swap,
        drain,
        max_rate,
        sinks,
        sustained,
        criterion,
        failed,
        wall_seconds: t0.elapsed().as_secs_f64(),
    })
}

fn machine(tsc: Tsc, load_at_start: &str) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    Machine {
        cpu,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        kernel,
        kvm: if pvm { "pvm" } else { "kvm" },
        tsc_khz: tsc.khz,
        loadavg_at_start: load_at_start.to_string(),
        loadavg_at_end: loadavg(),
    }
}
