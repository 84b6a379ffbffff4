//! Running a VM with a reader, as `hyptrace record` does, and measuring it: the
//! sections' common harness ([`vm_run`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyptrace_abi::guest::{result, Workload, RUN_FLAG_SERVE_MAILBOX};
use hyptrace_output::{Clock, OutputError, PageSink, RawSink, RunSummary, TraceMeta};
use hyptrace_output::{TraceDatSink, TraceDatVersion};
use hyptrace_reader::{Callbacks, ReadError, RingBuffer, SwapReply, SwapStatus};
use vm_memory::{Bytes, GuestAddress};

use super::{BenchError, PAGE_SIZE};
use crate::cli::{ring_layout, ModeArg, SwapArg};
use crate::elf::GuestImage;
use crate::memory_map::{GuestMemoryMap, MIN_MEM_BYTES};
use crate::session::{GuestTraceMem, Output, Session, MAILBOX_TIMEOUT};
use crate::vcpu::VcpuOutcome;
use crate::vm::{host_tsc, RunParams, Vm, VmConfig, DEFAULT_SEED};
use crate::GUEST_ELF;

/// One VM run.
pub(super) struct VmSpec {
    pub(super) vcpus: u32,
    pub(super) workload: Workload,
    pub(super) events: u64,
    pub(super) rate: u64,
    pub(super) payload: u32,
    pub(super) mode: ModeArg,
    pub(super) swap: SwapArg,
    pub(super) pages: u64,
    pub(super) sink: SinkKind,
    /// Time every swap_reader call.
    pub(super) time_swaps: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SinkKind {
    Null,
    Raw,
    Dat,
}

/// What a VM run measured.
#[derive(Debug, Default)]
pub(super) struct VmOut {
    pub(super) tsc_khz: u64,
    /// Host TSC before `Vm::new`, and when the vCPU threads were started.
    pub(super) t_new: u64,
    pub(super) t_start: u64,
    pub(super) tsc_offset: i64,
    /// Per vCPU: guest TSC at entry, and the bench workload's cycles / fastest chunk.
    pub(super) tsc_entry: Vec<u64>,
    pub(super) bench_cycles: Vec<u64>,
    pub(super) bench_min_chunk: Vec<u64>,
    pub(super) written: u64,
    pub(super) read: u64,
    pub(super) lost: u64,
    pub(super) bytes: u64,
    pub(super) pages: u64,
    pub(super) first_ts: Option<u64>,
    pub(super) wall: Duration,
    /// Guest-side duration of the workload (longest vCPU), in TSC cycles.
    pub(super) guest_cycles: u64,
    pub(super) swaps: SwapLog,
}

/// Timings of `swap_reader` calls (host TSC cycles).
#[derive(Debug, Default, Clone)]
pub(super) struct SwapLog {
    pub(super) swapped: Vec<u64>,
    pub(super) busy: Vec<u64>,
    /// Calls answered "pending" (a mailbox request not answered within the spin).
    pub(super) pending: u64,
    /// Calls that only picked up the answer to an earlier pending request (not timed).
    pub(super) after_pending: u64,
    pub(super) errors: u64,
    pub(super) was_pending: Vec<bool>,
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
pub(super) struct TempPath(pub(super) PathBuf);

impl TempPath {
    pub(super) fn new(ext: &str) -> Self {
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

pub(super) fn guest_mem_bytes(vcpus: u32, trace: u64) -> Result<u64, BenchError> {
    let image = GuestImage::parse(GUEST_ELF).map_err(BenchError::GuestImage)?;
    let need = GuestMemoryMap::required_mem(&image, vcpus, trace, PAGE_SIZE).max(MIN_MEM_BYTES);
    Ok(need.div_ceil(2 << 20) * (2 << 20))
}

pub(super) fn vm_run(spec: &VmSpec) -> Result<VmOut, BenchError> {
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
    })?;
    let tsc_khz = vm.tsc_khz();
    let tsc_offset = vm.tsc_offset().unwrap_or(0);
    let clock = Clock::guest_tsc(tsc_khz).map_err(BenchError::Clock)?;
    let nr = spec.vcpus;
    let tmp = TempPath::new("out");
    let meta = TraceMeta::guest(layout.page_size, nr, clock.clone());
    let inner: Option<Box<dyn PageSink>> = match spec.sink {
        SinkKind::Null => None,
        SinkKind::Raw => Some(Box::new(RawSink::create(&tmp.0, meta)?)),
        SinkKind::Dat => Some(Box::new(TraceDatSink::create(
            &tmp.0,
            meta,
            TraceDatVersion::V7,
        )?)),
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
    // As `session::alloc_reader`, but with the callbacks wrapped when swaps are timed.
    let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), layout, MAILBOX_TIMEOUT);
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
        .map_err(BenchError::TraceBuffers)?;
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
    let running = vm.start(&params)?;
    let t_start = running.start_tsc();
    // TODO(pipeline): from here to the outcomes, `record`'s run loop (poll, service,
    // stop on a reader error, final walk, finish): use the `Run` pipeline once it takes
    // a ready sink and callbacks and reports per-CPU stats, the vCPU outcomes and the
    // guest memory (result slots).
    let mut session = Session::new(reader, Output::Pages(Box::new(sink)), clock);
    let poll = Duration::from_millis(1);
    let mut error: Option<BenchError> = None;
    loop {
        let all_done = running.wait_timeout(poll);
        for (cpu, e) in session.service(|c| running.vcpu_finished(c)) {
            error.get_or_insert(BenchError::Read { cpu, source: e });
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
            error.get_or_insert(BenchError::Read { cpu, source: e });
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
        error.get_or_insert(BenchError::Output(e));
    }
    for (i, o) in outcomes.iter().enumerate() {
        match o {
            VcpuOutcome::Finished(st) => {
                out.tsc_entry.push(st.tsc_start);
                out.guest_cycles = out.guest_cycles.max(st.tsc_end.wrapping_sub(st.tsc_start));
            }
            other => {
                error.get_or_insert_with(|| BenchError::Vcpu {
                    cpu: i,
                    outcome: other.clone(),
                });
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
