//! Running a VM with a reader, as `hyptrace record` does, and measuring it: the
//! sections' common harness ([`vm_run`], on the run pipeline).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyptrace_abi::guest::{result, Workload};
use hyptrace_abi::layout::Mode;
use hyptrace_output::{Discard, PageSink, Tap, ThreadedSink};
use hyptrace_reader::{Callbacks, ReadError, SwapReply, SwapStatus};
use vm_memory::{Bytes, GuestAddress};

use super::{plan, BenchError};
use crate::drain::sink::{check_destination, make_sink, Format};
use crate::pipeline::run::{MakeSink, Run, Target};
use crate::vmm::time::host_tsc;
use crate::vmm::vcpu::VcpuOutcome;
use hyptrace_output::Compression;

/// One VM run.
pub(super) struct VmSpec {
    pub(super) vcpus: u32,
    pub(super) workload: Workload,
    pub(super) events: u64,
    pub(super) rate: u64,
    pub(super) payload: u32,
    /// The rings' mode (`--mode`).
    pub(super) mode: Mode,
    /// Whether the guest swaps (`--swap guest`; else the host's reader).
    pub(super) guest_swap: bool,
    pub(super) pages: u64,
    pub(super) sink: SinkKind,
    /// Time every swap_reader call.
    pub(super) time_swaps: bool,
    /// Whether the reader drains while the guest runs (`--drain live`; else `none`).
    pub(super) drain_live: bool,
    /// The `bench` workload's typed loop ([`hyptrace_abi::guest::RUN_FLAG_BENCH_TYPED`]).
    pub(super) typed: bool,
}

impl Default for VmSpec {
    /// One vCPU writing `steady` markers flat out, overwrite mode, host swaps, the
    /// default rings, a live reader into no file: every section names what it changes.
    fn default() -> Self {
        Self {
            vcpus: 1,
            workload: Workload::Steady,
            events: 0,
            rate: 0,
            payload: 0,
            mode: Mode::Overwrite,
            guest_swap: false,
            pages: super::DEFAULT_PAGES,
            sink: SinkKind::Null,
            time_swaps: false,
            drain_live: true,
            typed: false,
        }
    }
}

/// Where a bench run's pages go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SinkKind {
    /// Counted only (the reader alone).
    Null,
    /// A temporary file of this format, as `record -o` writes it (its own thread).
    File(Format, Compression),
}

impl SinkKind {
    /// `--format raw`.
    pub(super) const RAW: Self = Self::File(Format::Raw, Compression::Zstd);
    /// The default trace.dat (v7, zstd).
    pub(super) const DAT: Self = Self::File(Format::Dat, Compression::Zstd);

    /// What the rows call it: `none (reader alone)`, `raw`, `trace.dat zstd`, `trace.dat none`, ….
    pub(super) fn name(self) -> String {
        match self {
            Self::Null => "none (reader alone)".into(),
            Self::File(Format::Dat, Compression::Zstd) => "trace.dat zstd".into(),
            Self::File(Format::Dat, Compression::None) => "trace.dat none".into(),
            Self::File(f, _) => f.name().into(),
        }
    }
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
    /// What the run's reader measured of itself (its waits for the output, its latest
    /// wake-up): why a lossy run lost.
    pub(super) reader: crate::pipeline::report::ReaderTimes,
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

impl Timed {
    /// Runs `op` (a swap) and logs its time.
    fn timed(
        &self,
        cpu: u32,
        op: impl FnOnce() -> Result<SwapReply, ReadError>,
    ) -> Result<SwapReply, ReadError> {
        let t = host_tsc();
        let r = op();
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
}

impl Callbacks for Timed {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        self.timed(cpu, || self.inner.swap_reader(cpu))
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        self.inner.update_footers(cpu)
    }
    fn releases(&self, cpu: u32) -> bool {
        self.inner.releases(cpu)
    }
}

/// What reaches the sink (counted by a [`Tap`] in front of it).
#[derive(Debug, Default)]
struct SinkStats {
    pages: AtomicU64,
    bytes: AtomicU64,
    /// Smallest page time_stamp seen (u64::MAX: none).
    first_ts: AtomicU64,
}

impl SinkStats {
    fn count(&self, page: &[u8]) {
        self.pages.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(page.len() as u64, Ordering::Relaxed);
        if let Some(ts) = page.get(..8) {
            let ts = u64::from_le_bytes(ts.try_into().unwrap_or([0xff; 8]));
            self.first_ts.fetch_min(ts, Ordering::Relaxed);
        }
    }
}

/// A new temporary file `hyptrace-bench-*.EXT` (in the temporary directory), removed
/// when the returned path is dropped.
pub(super) fn temp_path(ext: &str) -> Result<tempfile::TempPath, BenchError> {
    tempfile::Builder::new()
        .prefix("hyptrace-bench-")
        .suffix(&format!(".{ext}"))
        .tempfile()
        .map(tempfile::NamedTempFile::into_temp_path)
        .map_err(BenchError::TempFile)
}

/// What the rows call who swaps: `guest` or `host`.
pub(super) fn swapper(guest_swap: bool) -> &'static str {
    if guest_swap {
        "guest"
    } else {
        "host"
    }
}

/// One VM run through the run pipeline ([`Run`]), its sink counted and its swaps timed
/// as `spec` says; any failure of the run is an error.
pub(super) fn vm_run(spec: &VmSpec) -> Result<VmOut, BenchError> {
    let plan = plan(spec)?;
    let tmp = temp_path("out")?;
    let sink_stats = Arc::new(SinkStats {
        first_ts: AtomicU64::new(u64::MAX),
        ..SinkStats::default()
    });
    let target = check_destination(&tmp, "bench")?;
    let (kind, stats) = (spec.sink, sink_stats.clone());
    let make: MakeSink = Box::new(move |meta| {
        let inner: Box<dyn PageSink + Send> = match kind {
            SinkKind::Null => Box::new(Discard),
            SinkKind::File(format, c) => make_sink(&target, format, c, meta)?,
        };
        let counted = Box::new(Tap::new(inner, move |_cpu: u32, page: &[u8]| {
            stats.count(page)
        }));
        Ok(match kind {
            // The reader alone (the writer section): no thread.
            SinkKind::Null => counted,
            // A file, as `record -o` writes it: on its own thread (ThreadedSink).
            SinkKind::File(..) => Box::new(ThreadedSink::new(counted)?),
        })
    });
    let log = Arc::new(Mutex::new(SwapLog::default()));
    let mut run = Run::new(plan, Target::MakeSink(make));
    if spec.time_swaps {
        let log = log.clone();
        run = run.wrap_callbacks(Box::new(move |inner| Box::new(Timed { inner, log })));
    }
    let report = run.execute()?;
    if report.failures.any() {
        return Err(BenchError::RunFailed(Box::new(report)));
    }
    let t = &report.timing;
    let mut out = VmOut {
        tsc_khz: t.tsc_khz,
        t_new: t.created_tsc,
        t_start: t.start_tsc,
        tsc_offset: t.tsc_offset.unwrap_or(0),
        wall: t.wall,
        reader: t.reader,
        ..VmOut::default()
    };
    for c in &report.cpus {
        // Guest numbers: saturate.
        out.written = out.written.saturating_add(c.written);
        out.read = out.read.saturating_add(c.stats.read);
        out.lost = out.lost.saturating_add(c.stats.lost);
        out.bytes = out.bytes.saturating_add(c.stats.bytes);
    }
    let guest = report.guest.as_ref();
    for (i, o) in report.outcomes.iter().enumerate() {
        match o {
            VcpuOutcome::Finished(st) => {
                out.tsc_entry.push(st.tsc_start);
                // From the workload's start: the wait for the registration's answer
                // is no part of what the guest wrote in its time.
                let start = report.timing.workload_start(st.tsc_start);
                out.guest_cycles = out.guest_cycles.max(st.tsc_end.wrapping_sub(start));
            }
            other => {
                return Err(BenchError::Vcpu {
                    cpu: i,
                    outcome: other.clone(),
                })
            }
        }
        let rd = |off: usize| {
            guest.map_or(0, |g| {
                let slot = g.map.result_slot(i as u32);
                g.memory
                    .read_obj::<u64>(GuestAddress(slot + off as u64))
                    .unwrap_or(0)
            })
        };
        out.bench_cycles.push(rd(result::BENCH_CYCLES));
        out.bench_min_chunk.push(rd(result::BENCH_MIN_CHUNK));
    }
    out.pages = sink_stats.pages.load(Ordering::Relaxed);
    let first = sink_stats.first_ts.load(Ordering::Relaxed);
    out.first_ts = (first != u64::MAX).then_some(first);
    out.swaps = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::writer::writer_spec;
    use crate::bench::{PAGE_SIZE, POLL_MS};
    use crate::drain::session::MAILBOX_TIMEOUT;
    use crate::pipeline::plan::ring_layout;
    use crate::vmm::elf::GuestImage;
    use crate::vmm::memory_map::{GuestMemoryMap, MIN_MEM_BYTES};

    /// The plan of a bench run is the VM bench booted before it used the pipeline: the
    /// same rings, memory (whole 2 MiB pages), workload, payload, flags and poll.
    #[test]
    fn plan_matches_the_bench_vm() {
        for (vcpus, mode, guest_swap) in [(1, Mode::Overwrite, false), (2, Mode::Stop, true)] {
            let spec = VmSpec {
                vcpus,
                workload: Workload::Bench,
                events: 123_456,
                payload: 64,
                mode,
                guest_swap,
                ..VmSpec::default()
            };
            let p = plan(&spec).expect("plan");
            let ring = ring_layout(vcpus, spec.pages, PAGE_SIZE, mode, guest_swap).expect("ring");
            assert_eq!(p.ring, ring);
            let image = GuestImage::parse(crate::GUEST_ELF).expect("image");
            let need =
                GuestMemoryMap::required_mem(&image, vcpus, ring.region_size as u64, PAGE_SIZE)
                    .max(MIN_MEM_BYTES);
            assert_eq!(p.cfg.mem_bytes, need.div_ceil(2 << 20) * (2 << 20));
            assert_eq!(p.cfg.trace_region_bytes, ring.region_size as u64);
            assert_eq!(p.params.workload, Workload::Bench);
            assert_eq!((p.params.events, p.params.rate), (123_456, 0));
            assert_eq!(p.params.payload, 64);
            assert_eq!(
                p.params.flags,
                if guest_swap {
                    hyptrace_abi::guest::RUN_FLAG_SERVE_MAILBOX
                } else {
                    0
                }
            );
            assert_eq!(p.poll, std::time::Duration::from_millis(POLL_MS));
            assert_eq!(p.mailbox_timeout, MAILBOX_TIMEOUT);
            assert!(p.flight.drain_live);
            assert_eq!(p.flight.crash_dump, None);
        }
        let unread = plan(&VmSpec {
            drain_live: false,
            ..writer_spec(1, 16)
        })
        .expect("plan");
        assert!(!unread.flight.drain_live);
        assert_eq!(unread.flight.crash_dump, None, "no trace.dat in the cwd");
        let typed = plan(&VmSpec {
            typed: true,
            ..writer_spec(1, 16)
        })
        .expect("plan");
        assert_eq!(
            typed.params.flags,
            hyptrace_abi::guest::RUN_FLAG_BENCH_TYPED
        );
    }
}
