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
//! Times are TSC cycles converted with the vCPUs' TSC frequency (guest TSC = host TSC
//! on this machine; see `Vm::tsc_offset`). Every figure is a median over repetitions;
//! spreads are reported next to them. No figure is asserted.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use hyptrace_abi::guest::{result, Workload, BENCH_CHUNK, RUN_FLAG_SERVE_MAILBOX};
use hyptrace_abi::layout as ring;
use hyptrace_abi::{HeapMem, RawMem, SharedMem};
use hyptrace_output::{Clock, OutputError, PageSink, RawSink, RunSummary, TraceMeta};
use hyptrace_output::{TraceDatSink, TraceDatVersion};
use hyptrace_reader::{Callbacks, Direct, Mailbox, ReadError, RingBuffer, SwapReply, SwapStatus};
use hyptrace_writer::{WriteOutcome, Writer};
use serde_json::{json, Value};
use vm_memory::{Bytes, GuestAddress};

use crate::cli::{ring_layout, ModeArg, SwapArg, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE};
use crate::elf::GuestImage;
use crate::memory_map::{GuestMemoryMap, MIN_MEM_BYTES};
use crate::trace::{GuestTraceMem, Output, Session, MAILBOX_TIMEOUT};
use crate::vcpu::VcpuOutcome;
use crate::vm::{host_tsc, RunParams, Vm, VmConfig, DEFAULT_SEED};
use crate::GUEST_ELF;

/// Options of `hyptrace bench`.
#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// A tiny smoke run (one vCPU count, one payload, one repetition, short searches).
    #[arg(long)]
    pub quick: bool,
    /// Write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// vCPU counts of the writer runs [default: 1,2; --quick: 1].
    #[arg(long, value_name = "N,..", value_delimiter = ',')]
    pub vcpus: Vec<u32>,
    /// Payload sizes in bytes of the writer runs [default: 0,8,16,64,256; --quick: 16].
    #[arg(long, value_name = "B,..", value_delimiter = ',')]
    pub payloads: Vec<u32>,
    /// Events per vCPU per writer run [default: 1000000; --quick: 100000].
    #[arg(long, value_name = "N")]
    pub events: Option<u64>,
    /// Repetitions of every measurement [default: 5; --quick: 1].
    #[arg(long, value_name = "N")]
    pub reps: Option<u32>,
    /// Also import criterion's results from DIR (e.g. target/criterion after `cargo
    /// bench`): medians of the rtrb, raw-store and rdtsc baselines etc. go into the JSON.
    #[arg(long, value_name = "DIR")]
    pub criterion: Option<PathBuf>,
    /// Only these sections (startup always runs: it measures the TSC frequency)
    /// [default: all].
    #[arg(long, value_enum, value_name = "S,..", value_delimiter = ',')]
    pub only: Vec<Section>,
}

/// Sections of `hyptrace bench`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Section {
    /// Guest vs native vs bound ns/event.
    Writer,
    /// swap_reader latency, both modes.
    Swap,
    /// Drain throughput.
    Drain,
    /// Highest loss-free rate.
    Rate,
}

/// Ring pages per vCPU (reader page included): `--buffer-kb 1024` of 4 KiB pages, the
/// CLI's default.
const DEFAULT_PAGES: u64 = 256;
const PAGE_SIZE: u64 = 4096;
/// Largest payload of the guest's bench workload.
const MAX_BENCH_PAYLOAD: u32 = 2048;

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
}

impl Cfg {
    fn new(a: &BenchArgs) -> Result<Self, String> {
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
            return Err(format!("--vcpus {v}: must be 1..=64"));
        }
        if let Some(&p) = payloads.iter().find(|&&p| p > MAX_BENCH_PAYLOAD) {
            return Err(format!("--payloads {p}: at most {MAX_BENCH_PAYLOAD} bytes"));
        }
        let events = a.events.unwrap_or(if q { 100_000 } else { 1_000_000 });
        if events < BENCH_CHUNK {
            return Err(format!("--events {events}: at least {BENCH_CHUNK}"));
        }
        let reps = a.reps.unwrap_or(if q { 1 } else { 5 });
        if reps == 0 {
            return Err("--reps must be at least 1".into());
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
            rate_seconds: if q { 0.05 } else { 0.25 },
            rate_steps: if q { 1 } else { 12 },
        })
    }
}

/// Median (upper for an even count) of a sample; 0 for none.
fn median(v: &[f64]) -> f64 {
    quantile(v, 0.5)
}

/// The `q`-quantile (nearest rank) of a sample; 0 for none.
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((s.len() as f64 * q).ceil() as usize).clamp(1, s.len()) - 1;
    s[i]
}

/// Summary of a sample: median, min, max, and the relative spread (max−min)/median.
fn summary(v: &[f64]) -> Value {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let med = median(v);
    json!({
        "median": med,
        "min": if v.is_empty() { 0.0 } else { min },
        "max": if v.is_empty() { 0.0 } else { max },
        "spread": if med > 0.0 { (max - min) / med } else { 0.0 },
        "samples": v,
    })
}

/// TSC cycles → ns.
#[derive(Clone, Copy, Debug)]
struct Tsc {
    khz: u64,
}

impl Tsc {
    fn ns(self, cycles: f64) -> f64 {
        cycles * 1e6 / self.khz.max(1) as f64
    }
}

/// `hyptrace bench`.
pub fn bench(a: &BenchArgs) -> i32 {
    let cfg = match Cfg::new(a) {
        Ok(c) => c,
        Err(msg) => {
            eprintln!("hyptrace: error: {msg}");
            return EXIT_USAGE;
        }
    };
    // Before the first VM boots: a bad --json path costs nothing.
    let json_target = match a
        .json
        .as_deref()
        .map(|p| crate::cli::check_destination(p, "--json"))
    {
        Some(Err(msg)) => {
            eprintln!("hyptrace: error: {msg}");
            return EXIT_USAGE;
        }
        Some(Ok(t)) => Some(t),
        None => None,
    };
    match run_all(&cfg, a) {
        Ok(v) => {
            print!("{}", table(&v));
            if let Some(t) = &json_target {
                let mut s = serde_json::to_string_pretty(&v).unwrap_or_else(|_| "{}".into());
                s.push('\n');
                if let Err(e) = crate::cli::write_destination(t, &s) {
                    eprintln!("hyptrace: error: cannot write --json: {e}");
                    return EXIT_RUNTIME;
                }
            }
            EXIT_OK
        }
        Err(e) => {
            eprintln!("hyptrace: error: bench: {e}");
            EXIT_RUNTIME
        }
    }
}

fn run_all(cfg: &Cfg, a: &BenchArgs) -> Result<Value, String> {
    let t0 = Instant::now();
    eprintln!("hyptrace bench: startup");
    let (startup, tsc) = startup(cfg)?;
    let on = |s: Section| a.only.is_empty() || a.only.contains(&s);
    let mut writer = Value::Array(Vec::new());
    if on(Section::Writer) {
        eprintln!("hyptrace bench: writer (guest, native, bound)");
        writer = writer_section(cfg, tsc)?;
    }
    let mut swap =
        json!({ "host": {}, "guest": {}, "host_live_drain": {}, "guest_live_drain": {} });
    if on(Section::Swap) {
        eprintln!("hyptrace bench: swap latency");
        swap = json!({
            "host": swap_pingpong(cfg, tsc, SwapArg::Host)?,
            "guest": swap_pingpong(cfg, tsc, SwapArg::Guest)?,
            "host_live_drain": swap_section(cfg, tsc, SwapArg::Host)?,
            "guest_live_drain": swap_section(cfg, tsc, SwapArg::Guest)?,
        });
    }
    let mut drain = json!({ "reader_to_file": {}, "reader_only": {}, "vm_record_raw": {} });
    if on(Section::Drain) {
        eprintln!("hyptrace bench: drain");
        drain = drain_section(cfg, tsc)?;
    }
    let mut max_rate = Value::Array(Vec::new());
    if on(Section::Rate) {
        eprintln!("hyptrace bench: highest loss-free rate");
        max_rate = max_rate_section(cfg)?;
    }
    let criterion = match &a.criterion {
        Some(dir) => import_criterion(dir),
        None => Value::Null,
    };
    Ok(json!({
        "version": 1,
        "quick": cfg.quick,
        "machine": machine(tsc),
        "config": {
            "vcpus": cfg.vcpus,
            "payloads": cfg.payloads,
            "events_per_vcpu": cfg.events,
            "reps": cfg.reps,
            "chunk_events": BENCH_CHUNK,
            "ring_pages_per_vcpu": DEFAULT_PAGES,
            "page_size": PAGE_SIZE,
            "poll_ms": 1,
        },
        "startup": startup,
        "writer": writer,
        "swap": swap,
        "drain": drain,
        "max_rate": max_rate,
        "criterion": criterion,
        "wall_seconds": t0.elapsed().as_secs_f64(),
    }))
}

fn machine(tsc: Tsc) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let loadavg = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    json!({
        "cpu": model,
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "kernel": kernel,
        "kvm": if pvm { "pvm" } else { "kvm" },
        "tsc_khz": tsc.khz,
        "loadavg_at_end": loadavg,
    })
}

// ---------------------------------------------------------------------------------
// Running a VM with a reader, like `hyptrace record`.

/// One VM run.
struct VmSpec {
    vcpus: u32,
    workload: Workload,
    events: u64,
    rate: u64,
    payload: u32,
    mode: ModeArg,
    swap: SwapArg,
    pages: u64,
    sink: SinkKind,
    /// Time every swap_reader call.
    time_swaps: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SinkKind {
    Null,
    Raw,
    Dat,
}

/// What a VM run measured.
#[derive(Debug, Default)]
struct VmOut {
    tsc_khz: u64,
    /// Host TSC before `Vm::new`, and when the vCPU threads were started.
    t_new: u64,
    t_start: u64,
    tsc_offset: i64,
    /// Per vCPU: guest TSC at entry, and the bench workload's cycles / fastest chunk.
    tsc_entry: Vec<u64>,
    bench_cycles: Vec<u64>,
    bench_min_chunk: Vec<u64>,
    written: u64,
    read: u64,
    lost: u64,
    bytes: u64,
    pages: u64,
    first_ts: Option<u64>,
    wall: Duration,
    /// Guest-side duration of the workload (longest vCPU), in TSC cycles.
    guest_cycles: u64,
    swaps: SwapLog,
}

/// Timings of `swap_reader` calls (host TSC cycles).
#[derive(Debug, Default, Clone)]
struct SwapLog {
    swapped: Vec<u64>,
    busy: Vec<u64>,
    /// Calls answered "pending" (a mailbox request not answered within the spin).
    pending: u64,
    /// Calls that only picked up the answer to an earlier pending request (not timed).
    after_pending: u64,
    errors: u64,
    was_pending: Vec<bool>,
}

/// Callbacks that time every swap.
struct Timed {
    inner: Box<dyn Callbacks + Send>,
    log: Arc<Mutex<SwapLog>>,
}

impl Callbacks for Timed {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        let t = host_tsc();
        let r = self.inner.swap_reader(cpu);
        let dt = host_tsc().wrapping_sub(t);
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let c = cpu as usize;
        if log.was_pending.len() <= c {
            log.was_pending.resize(c + 1, false);
        }
        let after = std::mem::replace(&mut log.was_pending[c], false);
        match r {
            Ok(SwapReply::Pending) => {
                log.pending += 1;
                log.was_pending[c] = true;
            }
            Ok(_) if after => log.after_pending += 1,
            Ok(SwapReply::Done(SwapStatus::Swapped { .. })) => log.swapped.push(dt),
            // Busy and contended swaps change nothing: timed as "nothing to swap".
            Ok(SwapReply::Done(SwapStatus::Busy | SwapStatus::Contended)) => log.busy.push(dt),
            Err(_) => log.errors += 1,
        }
        r
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        self.inner.update_footers(cpu)
    }
}

/// Counts what reaches the sink (and the first page's timestamp), then forwards.
struct CountSink {
    inner: Option<Box<dyn PageSink>>,
    stats: Arc<SinkStats>,
}

#[derive(Debug, Default)]
struct SinkStats {
    pages: AtomicU64,
    bytes: AtomicU64,
    /// Smallest page time_stamp seen (u64::MAX: none).
    first_ts: AtomicU64,
}

impl PageSink for CountSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Option<u64>) -> Result<(), OutputError> {
        self.stats.pages.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes
            .fetch_add(page.len() as u64, Ordering::Relaxed);
        if let Some(ts) = page.get(..8) {
            let ts = u64::from_le_bytes(ts.try_into().unwrap_or([0xff; 8]));
            self.stats.first_ts.fetch_min(ts, Ordering::Relaxed);
        }
        match self.inner.as_mut() {
            Some(s) => s.page(cpu, page, missed),
            None => Ok(()),
        }
    }
    fn finish(self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        match self.inner {
            Some(s) => s.finish(summary),
            None => Ok(()),
        }
    }
}

/// A temporary file name, removed when dropped.
struct TempPath(PathBuf);

impl TempPath {
    fn new(ext: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        Self(std::env::temp_dir().join(format!(
            "hyptrace-bench-{}-{}.{ext}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        )))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn guest_mem_bytes(vcpus: u32, trace: u64) -> Result<u64, String> {
    let image = GuestImage::parse(GUEST_ELF).map_err(|e| format!("guest image: {e}"))?;
    let need = GuestMemoryMap::required_mem(&image, vcpus, trace, PAGE_SIZE).max(MIN_MEM_BYTES);
    Ok(need.div_ceil(2 << 20) * (2 << 20))
}

fn vm_run(spec: &VmSpec) -> Result<VmOut, String> {
    let layout = ring_layout(spec.vcpus, spec.pages, PAGE_SIZE, spec.mode, spec.swap)?;
    let trace = layout.region_size as u64;
    let mem_bytes = guest_mem_bytes(spec.vcpus, trace)?;
    let t_new = host_tsc();
    let vm = Vm::new(VmConfig {
        vcpus: spec.vcpus,
        mem_bytes,
        guest_elf: GUEST_ELF.into(),
        trace_region_bytes: trace,
        trace_region_align: PAGE_SIZE,
    })
    .map_err(|e| e.to_string())?;
    let tsc_khz = vm.tsc_khz();
    let tsc_offset = vm.tsc_offset().unwrap_or(0);
    let clock = Clock::guest_tsc(tsc_khz).map_err(|e| format!("guest clock: {e}"))?;
    let nr = spec.vcpus;
    let tmp = TempPath::new("out");
    let meta = TraceMeta::guest(layout.page_size, nr, clock.clone());
    let inner: Option<Box<dyn PageSink>> = match spec.sink {
        SinkKind::Null => None,
        SinkKind::Raw => Some(Box::new(
            RawSink::create(&tmp.0, meta).map_err(|e| e.to_string())?,
        )),
        SinkKind::Dat => Some(Box::new(
            TraceDatSink::create(&tmp.0, meta, TraceDatVersion::V7).map_err(|e| e.to_string())?,
        )),
    };
    let sink_stats = Arc::new(SinkStats {
        first_ts: AtomicU64::new(u64::MAX),
        ..SinkStats::default()
    });
    let sink = CountSink {
        inner,
        stats: sink_stats.clone(),
    };
    let mem = Arc::new(GuestTraceMem::new(vm.trace_region()));
    let cb: Box<dyn Callbacks + Send> = if layout.guest_swap {
        Box::new(Mailbox::new(mem.clone(), layout, MAILBOX_TIMEOUT))
    } else {
        Box::new(Direct::new(mem.clone(), layout))
    };
    let log = Arc::new(Mutex::new(SwapLog::default()));
    let cb: Box<dyn Callbacks + Send> = if spec.time_swaps {
        Box::new(Timed {
            inner: cb,
            log: log.clone(),
        })
    } else {
        cb
    };
    let reader = RingBuffer::alloc(mem, layout, cb, tsc_khz, host_tsc())
        .map_err(|e| format!("trace buffers: {e}"))?;
    let params = RunParams {
        workload: spec.workload,
        events: spec.events,
        rate: spec.rate,
        seed: DEFAULT_SEED,
        flags: if spec.swap == SwapArg::Guest {
            RUN_FLAG_SERVE_MAILBOX
        } else {
            0
        },
        burst: 0,
        payload: spec.payload,
    };
    let results: Vec<u64> = (0..nr).map(|i| vm.layout().result_slot(i)).collect();
    let memory = vm.memory().clone();
    let running = vm.start(&params).map_err(|e| e.to_string())?;
    let t_start = running.start_tsc();
    let mut session = Session::new(reader, Output::Pages(Box::new(sink)), clock);
    let poll = Duration::from_millis(1);
    let mut error: Option<String> = None;
    loop {
        let all_done = running.wait_timeout(poll);
        for (cpu, e) in session.service(|c| running.vcpu_finished(c)) {
            error.get_or_insert_with(|| format!("reading vcpu {cpu}: {e}"));
            running.stop();
        }
        if all_done && (0..nr).all(|c| !session.is_live(c)) {
            break;
        }
        if error.is_some() && all_done {
            break;
        }
    }
    let wall = running.started_at().elapsed();
    let outcomes = running.wait();
    for cpu in 0..nr {
        if let Err(e) = session.end_cpu(cpu) {
            error.get_or_insert_with(|| format!("reading vcpu {cpu}: {e}"));
        }
    }
    let mut out = VmOut {
        tsc_khz,
        t_new,
        t_start,
        tsc_offset,
        wall,
        ..VmOut::default()
    };
    for cpu in 0..nr {
        let st = session.stats(cpu);
        // Guest numbers: saturate.
        out.written = out.written.saturating_add(session.writer_index(cpu));
        out.read = out.read.saturating_add(st.read);
        out.lost = out.lost.saturating_add(st.lost);
        out.bytes = out.bytes.saturating_add(st.bytes);
    }
    let summary = RunSummary { cpus: Vec::new() };
    if let Err(e) = session.finish(&summary) {
        error.get_or_insert_with(|| format!("output: {e}"));
    }
    for (i, o) in outcomes.iter().enumerate() {
        match o {
            VcpuOutcome::Finished(st) => {
                out.tsc_entry.push(st.tsc_start);
                out.guest_cycles = out.guest_cycles.max(st.tsc_end.wrapping_sub(st.tsc_start));
            }
            other => {
                error.get_or_insert_with(|| format!("vcpu {i}: {other:?}"));
            }
        }
        let slot = results[i];
        let rd = |off: usize| {
            memory
                .read_obj::<u64>(GuestAddress(slot + off as u64))
                .unwrap_or(0)
        };
        out.bench_cycles.push(rd(result::BENCH_CYCLES));
        out.bench_min_chunk.push(rd(result::BENCH_MIN_CHUNK));
    }
    if let Some(e) = error {
        return Err(e);
    }
    out.pages = sink_stats.pages.load(Ordering::Relaxed);
    let first = sink_stats.first_ts.load(Ordering::Relaxed);
    out.first_ts = (first != u64::MAX).then_some(first);
    out.swaps = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(out)
}

// ---------------------------------------------------------------------------------
// Start-up.

fn startup(cfg: &Cfg) -> Result<(Value, Tsc), String> {
    let mut first_event = Vec::new();
    let mut vm_new = Vec::new();
    let mut first_insn = Vec::new();
    let mut khz = 0;
    for _ in 0..cfg.reps.max(3) {
        let o = vm_run(&VmSpec {
            vcpus: 1,
            workload: Workload::Steady,
            events: 1000,
            rate: 0,
            payload: 0,
            mode: ModeArg::Overwrite,
            swap: SwapArg::Host,
            pages: DEFAULT_PAGES,
            sink: SinkKind::Null,
            time_swaps: false,
        })?;
        khz = o.tsc_khz;
        let tsc = Tsc { khz };
        let host = |guest: u64| guest.wrapping_sub(o.tsc_offset as u64);
        if let Some(ts) = o.first_ts {
            first_event.push(tsc.ns(host(ts).wrapping_sub(o.t_new) as i64 as f64) / 1e6);
        }
        vm_new.push(tsc.ns(o.t_start.wrapping_sub(o.t_new) as f64) / 1e6);
        if let Some(&e) = o.tsc_entry.first() {
            first_insn.push(tsc.ns(host(e).wrapping_sub(o.t_start) as i64 as f64) / 1e6);
        }
    }
    Ok((
        json!({
            "first_event_ms": summary(&first_event),
            "vm_create_ms": summary(&vm_new),
            "start_to_first_instruction_ms": summary(&first_insn),
        }),
        Tsc { khz },
    ))
}

// ---------------------------------------------------------------------------------
// Writer: guest vs native vs bound.

/// Cycles of a timed loop: the whole and the fastest full chunk.
#[derive(Clone, Copy, Debug)]
struct Timing {
    cycles: u64,
    min_chunk: u64,
}

/// Runs `one` `events` times in chunks of [`BENCH_CHUNK`], timed with the TSC, exactly
/// as the guest's bench workload does.
#[inline(always)]
fn timed_loop(events: u64, mut one: impl FnMut()) -> Timing {
    let mut min_chunk = u64::MAX;
    let mut i = 0;
    let t0 = host_tsc();
    while i < events {
        let end = (i + BENCH_CHUNK).min(events);
        let full = end - i == BENCH_CHUNK;
        let c0 = host_tsc();
        while i < end {
            one();
            i += 1;
        }
        let c = host_tsc().wrapping_sub(c0);
        if full && c < min_chunk {
            min_chunk = c;
        }
    }
    Timing {
        cycles: host_tsc().wrapping_sub(t0),
        min_chunk: if min_chunk == u64::MAX { 0 } else { min_chunk },
    }
}

fn bench_payload(n: u32) -> Vec<u8> {
    (0..n as usize).map(|i| i as u8).collect()
}

/// The guest's loop run natively: the same `Writer` on raw memory (a heap region of
/// the guest's layout, overwrite mode), with the guest's emit path (count, rdtsc,
/// write, count skipped).
fn native_writer(payload: u32, events: u64) -> Result<Timing, String> {
    let l = ring::RingGeometry::new(
        1,
        DEFAULT_PAGES as u32,
        PAGE_SIZE as usize,
        ring::Mode::Overwrite,
        false,
    )
    .map_err(|e| e.to_string())?;
    let heap = HeapMem::new(l.region_size);
    l.init_region(&heap, 1_000_000, 1);
    // SAFETY: `heap` owns `size()` bytes at `as_ptr()`, 8-aligned, and outlives the
    // writer (both are dropped at the end of this function, the writer first); it is
    // only accessed through this RawMem and `heap`'s own atomics/byte copies.
    let raw = unsafe { RawMem::new(heap.as_ptr(), heap.size()) };
    let mut w = Writer::attach(raw, 0).map_err(|e| e.to_string())?;
    let p = bench_payload(payload);
    let (mut attempted, mut skipped) = (0u64, 0u64);
    let t = timed_loop(events, || {
        attempted += 1;
        let ts = host_tsc();
        if w.write(
            hyptrace_abi::events::MARKER_SLOT,
            ts,
            std::hint::black_box(&p),
        ) == WriteOutcome::Disabled
        {
            skipped += 1;
        }
    });
    std::hint::black_box((attempted, skipped));
    Ok(t)
}

/// The bound: one rdtsc plus a raw store of the timestamp and the same payload bytes
/// into a buffer of the ring's size, at a moving offset.
fn native_bound(payload: u32, events: u64) -> Timing {
    let len = (DEFAULT_PAGES * PAGE_SIZE) as usize;
    let mut buf = vec![0u8; len];
    let p = bench_payload(payload);
    let need = 8 + p.len();
    let mut off = 0usize;
    let t = timed_loop(events, || {
        if off + need > len {
            off = 0;
        }
        buf[off..off + 8].copy_from_slice(&host_tsc().to_le_bytes());
        buf[off + 8..off + need].copy_from_slice(std::hint::black_box(&p));
        off += need;
        std::hint::black_box(&buf);
    });
    std::hint::black_box(&buf);
    t
}

/// `rdtsc` alone.
fn native_rdtsc(events: u64) -> Timing {
    let mut acc = 0u64;
    let t = timed_loop(events, || acc = acc.wrapping_add(host_tsc()));
    std::hint::black_box(acc);
    t
}

/// Runs `f` on `n` threads at once; returns their results.
fn on_threads<T: Send>(n: u32, f: impl Fn() -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n).map(|_| s.spawn(&f)).collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    })
}

fn writer_section(cfg: &Cfg, tsc: Tsc) -> Result<Value, String> {
    let per_event = |cycles: u64, events: u64| tsc.ns(cycles as f64) / events.max(1) as f64;
    let chunk = |t: Timing| per_event(t.min_chunk, BENCH_CHUNK);
    let mut rows = Vec::new();
    for &v in &cfg.vcpus {
        for &p in &cfg.payloads {
            let (mut g_mean, mut g_best) = (Vec::new(), Vec::new());
            let (mut n_mean, mut n_best) = (Vec::new(), Vec::new());
            let (mut b_mean, mut b_best) = (Vec::new(), Vec::new());
            let mut r_best = Vec::new();
            for _ in 0..cfg.reps {
                let o = vm_run(&VmSpec {
                    vcpus: v,
                    workload: Workload::Bench,
                    events: cfg.events,
                    rate: 0,
                    payload: p,
                    mode: ModeArg::Overwrite,
                    swap: SwapArg::Host,
                    pages: DEFAULT_PAGES,
                    sink: SinkKind::Null,
                    time_swaps: false,
                })?;
                for (c, m) in o.bench_cycles.iter().zip(&o.bench_min_chunk) {
                    g_mean.push(per_event(*c, cfg.events));
                    g_best.push(per_event(*m, BENCH_CHUNK));
                }
                for t in on_threads(v, || native_writer(p, cfg.events)) {
                    let t = t?;
                    n_mean.push(per_event(t.cycles, cfg.events));
                    n_best.push(chunk(t));
                }
                let b = native_bound(p, cfg.events);
                b_mean.push(per_event(b.cycles, cfg.events));
                b_best.push(chunk(b));
                r_best.push(chunk(native_rdtsc(cfg.events.min(1 << 20))));
            }
            let (g, n, b) = (median(&g_best), median(&n_best), median(&b_best));
            eprintln!(
                "  vcpus {v} payload {p:>4}: guest {g:6.2} ns  native {n:6.2} ns  bound {b:6.2} ns"
            );
            rows.push(json!({
                "vcpus": v,
                "payload": p,
                "event_bytes": hyptrace_abi::page::data_event_size(p as usize),
                "guest_ns": summary(&g_best),
                "guest_mean_ns": summary(&g_mean),
                "native_ns": summary(&n_best),
                "native_mean_ns": summary(&n_mean),
                "bound_ns": summary(&b_best),
                "bound_mean_ns": summary(&b_mean),
                "rdtsc_ns": summary(&r_best),
                "guest_rate_vs_native": if g > 0.0 { n / g } else { 0.0 },
                "guest_vs_bound": if b > 0.0 { g / b } else { 0.0 },
                "native_vs_bound": if b > 0.0 { n / b } else { 0.0 },
            }));
        }
    }
    Ok(Value::Array(rows))
}

// ---------------------------------------------------------------------------------
// Swap latency.

fn swap_section(cfg: &Cfg, tsc: Tsc, swap: SwapArg) -> Result<Value, String> {
    let mut log = SwapLog::default();
    let mut wall = 0.0;
    for _ in 0..cfg.reps.min(3) {
        // A steady writer the reader keeps up with: every swap takes one full page the
        // reader has just been waiting for (the common case; the head search is the
        // longest then).
        let o = vm_run(&VmSpec {
            vcpus: 1,
            workload: Workload::Steady,
            events: cfg.swap_events,
            rate: cfg.swap_rate,
            payload: 0,
            mode: ModeArg::Overwrite,
            swap,
            pages: DEFAULT_PAGES,
            sink: SinkKind::Null,
            time_swaps: true,
        })?;
        wall += o.wall.as_secs_f64();
        let s = o.swaps;
        log.swapped.extend(s.swapped);
        log.busy.extend(s.busy);
        log.pending += s.pending;
        log.after_pending += s.after_pending;
        log.errors += s.errors;
    }
    let ns: Vec<f64> = log.swapped.iter().map(|&c| tsc.ns(c as f64)).collect();
    let busy: Vec<f64> = log.busy.iter().map(|&c| tsc.ns(c as f64)).collect();
    eprintln!(
        "  {:?}: {} swaps, median {:.0} ns, p99 {:.0} ns, {} pending",
        swap,
        ns.len(),
        median(&ns),
        quantile(&ns, 0.99),
        log.pending
    );
    Ok(json!({
        "mode": format!("{swap:?}").to_lowercase(),
        "swapped": ns.len(),
        "median_ns": median(&ns),
        "p10_ns": quantile(&ns, 0.10),
        "p90_ns": quantile(&ns, 0.90),
        "p99_ns": quantile(&ns, 0.99),
        "min_ns": ns.iter().copied().fold(f64::INFINITY, f64::min).min(f64::MAX),
        "max_ns": ns.iter().copied().fold(0.0, f64::max),
        "busy": busy.len(),
        "busy_median_ns": median(&busy),
        "pending": log.pending,
        "answered_after_pending": log.after_pending,
        "errors": log.errors,
        "wall_seconds": wall,
        "workload": { "rate": cfg.swap_rate, "events": cfg.swap_events, "ring_pages": DEFAULT_PAGES },
    }))
}

/// One swap at a time, measured alone: a steady writer in a VM fills pages; every
/// ~150 µs the host swaps — itself on guest memory (`Direct`, the reader's own
/// callbacks), or by posting a request in the mailbox and spinning until the guest's
/// acknowledgement (the same protocol as `Mailbox`, without its 30 µs give-up, so a
/// round trip is timed even when the vCPU thread was descheduled). No exits either way.
fn swap_pingpong(cfg: &Cfg, tsc: Tsc, swap: SwapArg) -> Result<Value, String> {
    use hyptrace_abi::layout::{
        ctl, MBOX_OP_SWAP, MBOX_STATUS_BUSY, MBOX_STATUS_CONTENDED, MBOX_STATUS_OK,
    };
    let layout = ring_layout(1, DEFAULT_PAGES, PAGE_SIZE, ModeArg::Overwrite, swap)?;
    let trace = layout.region_size as u64;
    let vm = Vm::new(VmConfig {
        vcpus: 1,
        mem_bytes: guest_mem_bytes(1, trace)?,
        guest_elf: GUEST_ELF.into(),
        trace_region_bytes: trace,
        trace_region_align: PAGE_SIZE,
    })
    .map_err(|e| e.to_string())?;
    let reader = crate::trace::alloc_reader(vm.trace_region(), layout, vm.tsc_khz(), 1)
        .map_err(|e| format!("trace buffers: {e}"))?;
    let samples = if cfg.quick { 200 } else { 3000 };
    let running = vm
        .start(&RunParams {
            workload: Workload::Steady,
            events: u64::MAX,
            rate: cfg.swap_rate,
            flags: if swap == SwapArg::Guest {
                RUN_FLAG_SERVE_MAILBOX
            } else {
                0
            },
            ..RunParams::default()
        })
        .map_err(|e| e.to_string())?;
    let mem = reader.mem().clone();
    let c = layout.ctl(0);
    let (mut swapped, mut busy, mut timeouts, mut transient) = (Vec::new(), 0u64, 0u64, 0u64);
    let mut seq = mem.load(c + ctl::MBOX_REQ, Ordering::Acquire) >> 8;
    // Let the guest attach its writer first.
    std::thread::sleep(Duration::from_millis(20));
    let mut tries = 0;
    while swapped.len() < samples && tries < samples * 4 && !running.is_finished() {
        tries += 1;
        let until = Instant::now() + Duration::from_micros(150);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        let t = host_tsc();
        let status = match swap {
            SwapArg::Host => match reader.callbacks().swap_reader(0) {
                Ok(SwapReply::Done(SwapStatus::Swapped { .. })) => MBOX_STATUS_OK,
                // The overwriting writer kept pushing the head under every attempt.
                Ok(SwapReply::Done(SwapStatus::Contended)) => {
                    transient += 1;
                    continue;
                }
                Ok(_) => MBOX_STATUS_BUSY,
                Err(e) => return Err(format!("swap: {e}")),
            },
            SwapArg::Guest => {
                seq += 1;
                mem.store(
                    c + ctl::MBOX_REQ,
                    (seq << 8) | MBOX_OP_SWAP,
                    Ordering::Release,
                );
                let deadline = Instant::now() + Duration::from_millis(50);
                loop {
                    let ack = mem.load(c + ctl::MBOX_ACK, Ordering::Acquire);
                    if ack >> 8 == seq {
                        break ack & 0xff;
                    }
                    if Instant::now() > deadline {
                        break u64::MAX;
                    }
                    std::hint::spin_loop();
                }
            }
        };
        let dt = host_tsc().wrapping_sub(t);
        match status {
            MBOX_STATUS_OK => swapped.push(tsc.ns(dt as f64)),
            MBOX_STATUS_BUSY => busy += 1,
            MBOX_STATUS_CONTENDED => transient += 1,
            u64::MAX => {
                timeouts += 1;
                break;
            }
            s => return Err(format!("guest swap failed (status {s})")),
        }
    }
    running.stop();
    let _ = running.wait();
    eprintln!(
        "  {swap:?} alone: {} swaps, median {:.0} ns, p99 {:.0} ns",
        swapped.len(),
        median(&swapped),
        quantile(&swapped, 0.99)
    );
    Ok(json!({
        "mode": format!("{swap:?}").to_lowercase(),
        "swapped": swapped.len(),
        "median_ns": median(&swapped),
        "p10_ns": quantile(&swapped, 0.10),
        "p90_ns": quantile(&swapped, 0.90),
        "p99_ns": quantile(&swapped, 0.99),
        "max_ns": swapped.iter().copied().fold(0.0, f64::max),
        "busy": busy,
        "pending": timeouts,
        "transient_failures": transient,
        "workload": { "rate": cfg.swap_rate, "ring_pages": DEFAULT_PAGES, "interval_us": 150 },
    }))
}

// ---------------------------------------------------------------------------------
// Drain throughput.

/// A host region (1 CPU, stop mode, `pages` pages) filled by the writer with 16-byte
/// payloads; returns the reader over it.
fn filled_region(pages: u32) -> Result<RingBuffer<Arc<HeapMem>, Direct<Arc<HeapMem>>>, String> {
    let l = ring::RingGeometry::new(1, pages, PAGE_SIZE as usize, ring::Mode::Stop, false)
        .map_err(|e| e.to_string())?;
    let mem = Arc::new(HeapMem::new(l.region_size));
    let rb = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 1_000_000, 1)
        .map_err(|e| e.to_string())?;
    let mut w = Writer::attach(mem, 0).map_err(|e| e.to_string())?;
    let p = bench_payload(16);
    let mut ts = 1000u64;
    loop {
        ts += 37;
        if w.write(0, ts, &p) != WriteOutcome::Written {
            break;
        }
    }
    Ok(rb)
}

/// Reads every complete page of a filled region into `sink`; returns (pages, bytes,
/// seconds until the last page was handed to the sink, seconds including the sink's
/// `finish`: for a file, its fsync and rename).
fn drain_once(pages: u32, sink: Option<PathBuf>) -> Result<(u64, u64, f64, f64), String> {
    let mut rb = filled_region(pages)?;
    let meta = TraceMeta::guest(PAGE_SIZE as usize, 1, Clock::nanoseconds());
    let mut sink: Option<RawSink> = match &sink {
        Some(p) => Some(RawSink::create(p, meta).map_err(|e| e.to_string())?),
        None => None,
    };
    let (mut n, mut bytes) = (0u64, 0u64);
    let t = Instant::now();
    while let Some(pg) = rb.next_page(0).map_err(|e| e.to_string())? {
        n += 1;
        bytes += pg.bytes.len() as u64;
        match sink.as_mut() {
            Some(s) => s
                .page(0, pg.bytes, (pg.missed > 0).then_some(pg.missed))
                .map_err(|e| e.to_string())?,
            None => {
                std::hint::black_box(pg.bytes);
            }
        }
    }
    let streamed = t.elapsed().as_secs_f64();
    if let Some(s) = sink {
        Box::new(s)
            .finish(&RunSummary { cpus: Vec::new() })
            .map_err(|e| e.to_string())?;
    }
    Ok((n, bytes, streamed, t.elapsed().as_secs_f64()))
}

fn drain_section(cfg: &Cfg, tsc: Tsc) -> Result<Value, String> {
    let mut out = serde_json::Map::new();
    for (name, to_file) in [("reader_to_file", true), ("reader_only", false)] {
        let (mut mbs, mut pps, mut synced) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..cfg.reps {
            let tmp = TempPath::new("raw");
            let (n, bytes, secs, total) =
                drain_once(cfg.drain_pages, to_file.then(|| tmp.0.clone()))?;
            mbs.push(bytes as f64 / secs / 1e6);
            pps.push(n as f64 / secs);
            synced.push(bytes as f64 / total / 1e6);
        }
        eprintln!("  {name}: {:.0} MB/s", median(&mbs));
        out.insert(
            name.into(),
            json!({
                "mb_per_s": summary(&mbs),
                "pages_per_s": summary(&pps),
                "mb_per_s_incl_fsync": summary(&synced),
                "pages": cfg.drain_pages,
            }),
        );
    }
    // End to end: `hyptrace record --format raw` of a guest writing as fast as it can.
    let (mut mbs, mut pps, mut lost) = (Vec::new(), Vec::new(), Vec::new());
    let events = cfg.events * 4;
    for _ in 0..cfg.reps {
        let o = vm_run(&VmSpec {
            vcpus: 1,
            workload: Workload::Bench,
            events,
            rate: 0,
            payload: 16,
            mode: ModeArg::Overwrite,
            swap: SwapArg::Host,
            pages: DEFAULT_PAGES,
            sink: SinkKind::Raw,
            time_swaps: false,
        })?;
        let guest_s = tsc.ns(o.guest_cycles as f64) / 1e9;
        let secs = o.wall.as_secs_f64().max(guest_s);
        mbs.push((o.pages * PAGE_SIZE) as f64 / secs / 1e6);
        pps.push(o.pages as f64 / secs);
        lost.push(o.lost as f64 / o.written.max(1) as f64);
    }
    eprintln!("  vm_record_raw: {:.0} MB/s", median(&mbs));
    out.insert(
        "vm_record_raw".into(),
        json!({
            "mb_per_s": summary(&mbs),
            "pages_per_s": summary(&pps),
            "lost_fraction": summary(&lost),
            "events": events,
            "payload": 16,
        }),
    );
    Ok(Value::Object(out))
}

// ---------------------------------------------------------------------------------
// Highest loss-free rate.

/// Events per vCPU that overflow a ring of the rate search twice over if the reader
/// does not drain it (`guest:marker`: 4-byte header + 24-byte payload), so a run without
/// loss is evidence.
const RATE_FILL_EVENTS: u64 = 2 * DEFAULT_PAGES * PAGE_SIZE / 28;

fn rate_run(cfg: &Cfg, vcpus: u32, rate: u64) -> Result<(bool, Value), String> {
    let events = ((rate as f64 * cfg.rate_seconds) as u64).max(RATE_FILL_EVENTS);
    let o = vm_run(&VmSpec {
        vcpus,
        workload: Workload::Steady,
        events,
        rate,
        payload: 0,
        mode: ModeArg::Stop,
        swap: SwapArg::Host,
        pages: DEFAULT_PAGES,
        sink: SinkKind::Dat,
        time_swaps: false,
    })?;
    let achieved = if o.guest_cycles > 0 {
        events as f64 * o.tsc_khz as f64 * 1000.0 / o.guest_cycles as f64
    } else {
        0.0
    };
    let ok = o.lost == 0 && o.written == o.read;
    Ok((
        ok,
        json!({ "rate": rate, "events_per_vcpu": events, "lost": o.lost, "read": o.read, "achieved_rate": achieved, "ok": ok }),
    ))
}

fn max_rate_section(cfg: &Cfg) -> Result<Value, String> {
    let mut rows = Vec::new();
    for &v in &cfg.vcpus {
        let mut runs = Vec::new();
        let mut good = 0u64;
        let mut bad = None;
        let mut rate = 200_000u64;
        let mut steps = 0;
        // Double until a loss (or the guest cannot go faster), then bisect.
        while steps < cfg.rate_steps && rate <= 256_000_000 {
            steps += 1;
            let (ok, r) = rate_run(cfg, v, rate)?;
            runs.push(r);
            if ok {
                good = rate;
                rate *= 2;
            } else {
                bad = Some(rate);
                break;
            }
        }
        while let Some(b) = bad {
            if steps >= cfg.rate_steps || b - good <= good / 16 {
                break;
            }
            steps += 1;
            let mid = good + (b - good) / 2;
            let (ok, r) = rate_run(cfg, v, mid)?;
            runs.push(r);
            if ok {
                good = mid;
            } else {
                bad = Some(mid);
            }
        }
        let row = json!({
            "vcpus": v,
            "max_rate_zero_loss": good,
            "first_lossy_rate": bad,
            "lower_bound": bad.is_none(),
            "searched": !cfg.quick,
            "runs": runs,
            "mode": "stop",
            "poll_ms": 1,
            "buffer_kb": DEFAULT_PAGES * PAGE_SIZE / 1024,
            "sink": "trace.dat v7 file",
        });
        eprintln!("  vcpus {v}: {}", rate_text(&row));
        rows.push(row);
    }
    Ok(Value::Array(rows))
}

// ---------------------------------------------------------------------------------
// Criterion import.

/// Criterion's `new/estimates.json` medians under `dir`, keyed by benchmark id.
fn import_criterion(dir: &Path) -> Value {
    let mut out = serde_json::Map::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            if p.file_name().is_some_and(|n| n == "new") {
                let est = p.join("estimates.json");
                let Ok(text) = std::fs::read_to_string(&est) else {
                    continue;
                };
                let Ok(v) = serde_json::from_str::<Value>(&text) else {
                    continue;
                };
                let Ok(rel) = d.strip_prefix(dir) else {
                    continue;
                };
                let m = &v["median"];
                out.insert(
                    rel.to_string_lossy().into_owned(),
                    json!({
                        "median_ns": m["point_estimate"],
                        "ci_low_ns": m["confidence_interval"]["lower_bound"],
                        "ci_high_ns": m["confidence_interval"]["upper_bound"],
                    }),
                );
            } else if p.file_name().is_some_and(|n| n != "report" && n != "base") {
                stack.push(p);
            }
        }
    }
    Value::Object(out)
}

// ---------------------------------------------------------------------------------
// The table.

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// A JSON number as table text (`-` when absent), so that widths apply: `Value`'s own
/// `Display` ignores them.
fn n(v: &Value) -> String {
    match v {
        Value::Number(x) => x.to_string(),
        Value::String(x) => x.clone(),
        _ => "-".into(),
    }
}

/// The highest loss-free rate of a `max_rate` row, in words.
fn rate_text(r: &Value) -> String {
    let good = n(&r["max_rate_zero_loss"]);
    match (r["first_lossy_rate"].as_u64(), r["searched"].as_bool()) {
        (_, Some(false)) if r["max_rate_zero_loss"].as_u64().unwrap_or(0) > 0 => {
            format!("at least {good} events/s per vCPU (--quick: one run, no search)")
        }
        (_, Some(false)) => {
            let lossy = r["runs"][0]["rate"].as_u64().unwrap_or(0);
            format!("not measured (--quick: the one run at {lossy}/s lost events)")
        }
        (Some(bad), _) if r["max_rate_zero_loss"].as_u64() == Some(0) => {
            format!("below {bad} events/s per vCPU (the first rate tried lost events)")
        }
        (Some(bad), _) => format!("{good} events/s per vCPU (first lossy rate: {bad})"),
        (None, _) => format!("at least {good} events/s per vCPU (no rate tried lost events)"),
    }
}

fn table(v: &Value) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let m = &v["machine"];
    let _ = writeln!(
        s,
        "hyptrace bench: {} ({} CPUs), kernel {}, {}, TSC {} kHz{}",
        m["cpu"].as_str().unwrap_or("?"),
        n(&m["cpus"]),
        m["kernel"].as_str().unwrap_or("?"),
        m["kvm"].as_str().unwrap_or("?"),
        n(&m["tsc_khz"]),
        if v["quick"].as_bool() == Some(true) {
            " (--quick)"
        } else {
            ""
        }
    );
    let _ = writeln!(
        s,
        "\nwriter, ns/event (median of the fastest {}-event chunk per run; spread = (max-min)/median)",
        BENCH_CHUNK
    );
    let _ = writeln!(
        s,
        "{:>5} {:>7} {:>15} {:>15} {:>15} {:>7} {:>12} {:>11}",
        "vcpus",
        "payload",
        "guest",
        "native",
        "rdtsc+store",
        "rdtsc",
        "native/guest",
        "guest/bound"
    );
    for r in v["writer"].as_array().into_iter().flatten() {
        let cell = |k: &str| {
            format!(
                "{:.2} ±{:>3.0}%",
                f(&r[k]["median"]),
                f(&r[k]["spread"]) * 100.0
            )
        };
        let _ = writeln!(
            s,
            "{:>5} {:>7} {:>15} {:>15} {:>15} {:>7.2} {:>12.2} {:>11.2}",
            n(&r["vcpus"]),
            n(&r["payload"]),
            cell("guest_ns"),
            cell("native_ns"),
            cell("bound_ns"),
            f(&r["rdtsc_ns"]["median"]),
            f(&r["guest_rate_vs_native"]),
            f(&r["guest_vs_bound"]),
        );
    }
    let _ = writeln!(
        s,
        "\nswap_reader latency, ns (alone: one swap every 150 µs; live: every swap of a drain, pending = mailbox not answered within 30 µs)"
    );
    let _ = writeln!(
        s,
        "{:>17} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "swap", "swaps", "median", "p10", "p90", "p99", "pending"
    );
    for k in ["host", "guest", "host_live_drain", "guest_live_drain"] {
        let r = &v["swap"][k];
        let _ = writeln!(
            s,
            "{:>17} {:>8} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8}",
            k,
            n(&r["swapped"]),
            f(&r["median_ns"]),
            f(&r["p10_ns"]),
            f(&r["p90_ns"]),
            f(&r["p99_ns"]),
            n(&r["pending"])
        );
    }
    let _ = writeln!(
        s,
        "\ndrain (4 KiB pages; raw file incl. its final fsync: {:.0} MB/s)",
        f(&v["drain"]["reader_to_file"]["mb_per_s_incl_fsync"]["median"])
    );
    for (k, what) in [
        ("reader_to_file", "reader → raw file (page cache)"),
        ("reader_only", "reader → null sink"),
        ("vm_record_raw", "VM record --format raw"),
    ] {
        let r = &v["drain"][k];
        let _ = writeln!(
            s,
            "  {what:<32} {:>8.0} MB/s ±{:>3.0}%  {:>9.0} pages/s",
            f(&r["mb_per_s"]["median"]),
            f(&r["mb_per_s"]["spread"]) * 100.0,
            f(&r["pages_per_s"]["median"]),
        );
    }
    let _ = writeln!(
        s,
        "\nhighest --rate with zero loss (stop mode, poll 1 ms, 1 MiB/vCPU, record to trace.dat)"
    );
    for r in v["max_rate"].as_array().into_iter().flatten() {
        let v = r["vcpus"].as_u64().unwrap_or(0);
        let who = format!("{v} vCPU{}:", if v == 1 { "" } else { "s" });
        let _ = writeln!(s, "  {who:<10} {}", rate_text(r));
    }
    let st = &v["startup"];
    let _ = writeln!(
        s,
        "\nstart-up: VMM start → first event {:.2} ms (VM creation {:.2} ms, vCPU start → first instruction {:.2} ms)",
        f(&st["first_event_ms"]["median"]),
        f(&st["vm_create_ms"]["median"]),
        f(&st["start_to_first_instruction_ms"]["median"]),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(median(&v), 3.0);
        assert_eq!(quantile(&v, 0.99), 5.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(median(&[]), 0.0);
    }

    /// The table: numbers right-aligned under their headers (a `Value`'s `Display`
    /// ignores widths), no JSON `null` in the text, a --quick rate reported as a lower
    /// bound.
    #[test]
    fn table_aligned_without_nulls() {
        let sum = |x: f64| json!({ "median": x, "spread": 0.0 });
        let v = json!({
            "quick": true,
            "machine": { "cpu": "X", "cpus": 2, "kernel": "k", "kvm": "kvm", "tsc_khz": 1000 },
            "writer": [{ "vcpus": 1, "payload": 16, "guest_ns": sum(12.5), "native_ns": sum(10.0),
                         "bound_ns": sum(9.0), "rdtsc_ns": sum(8.0),
                         "guest_rate_vs_native": 0.8, "guest_vs_bound": 1.4 }],
            "swap": { "host": { "swapped": 200, "median_ns": 70.0, "p10_ns": 40.0,
                                "p90_ns": 300.0, "p99_ns": 900.0, "pending": 0 } },
            "max_rate": [
                { "vcpus": 1, "max_rate_zero_loss": 200000, "first_lossy_rate": null,
                  "searched": false, "runs": [{ "rate": 200000 }] },
                { "vcpus": 2, "max_rate_zero_loss": 400000, "first_lossy_rate": null,
                  "searched": true, "runs": [] },
                { "vcpus": 4, "max_rate_zero_loss": 300000, "first_lossy_rate": 350000,
                  "searched": true, "runs": [] },
            ],
        });
        let t = table(&v);
        assert!(!t.replace("null sink", "").contains("null"), "{t}");
        assert!(
            t.contains("1 vCPU:    at least 200000 events/s per vCPU (--quick"),
            "{t}"
        );
        assert!(t.contains("2 vCPUs:   at least 400000"), "{t}");
        assert!(
            t.contains("300000 events/s per vCPU (first lossy rate: 350000)"),
            "{t}"
        );
        let lines: Vec<&str> = t.lines().collect();
        let at = |needle: &str| {
            lines
                .iter()
                .position(|l| l.starts_with(needle))
                .unwrap_or_else(|| panic!("no line {needle:?} in {t}"))
        };
        // Every column ends where its header ends.
        let ends = |l: &str| -> Vec<usize> {
            let b: Vec<char> = l.chars().collect();
            (0..b.len())
                .filter(|&i| b[i] != ' ' && (i + 1 == b.len() || b[i + 1] == ' '))
                .collect()
        };
        let h = at("vcpus payload");
        let row = lines[h + 1];
        assert_eq!(ends(lines[h]).first(), ends(row).first(), "{t}");
        assert_eq!(ends(lines[h]).last(), ends(row).last(), "{t}");
        assert_eq!(lines[h].chars().count(), row.chars().count(), "{t}");
        let h = lines
            .iter()
            .position(|l| l.trim_start().starts_with("swap "))
            .expect("swap");
        assert_eq!(ends(lines[h]), ends(lines[h + 1]), "{t}");
    }

    #[test]
    fn native_loops_run() {
        let t = native_writer(16, 4 * BENCH_CHUNK).expect("native");
        assert!(t.cycles >= t.min_chunk);
        assert!(native_bound(16, BENCH_CHUNK).cycles > 0);
    }
}
