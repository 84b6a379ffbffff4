//! `drain`: page-at-a-time reading (`next_page`, validation and copy-out included) into
//! a raw page file and into a null sink, on a host region filled beforehand (the reader
//! alone); what a subscriber receives over the control socket (`subscriber.rs`); and
//! `hyptrace record`'s pipeline in a VM with the guest writing as fast as it can (lossy by
//! design: overwrite mode).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use hyptrace_abi::guest::Workload;
use hyptrace_abi::layout as ring;
use hyptrace_abi::HeapMem;
use hyptrace_output::{Clock, Missed, PageSink, RawSink, RunSummary, StreamSink, TraceMeta};
use hyptrace_reader::{Direct, RingBuffer};
use hyptrace_writer::{WriteOutcome, Writer};
use serde::Serialize;

use super::harness::{temp_path, vm_run, SinkKind, VmSpec};
use super::stats::{Summary, Tsc};
use super::{bench_payload, BenchError, Cfg, Measured, PAGE_SIZE};

/// The `drain` JSON object; a section not run is `{}` in each.
#[derive(Clone, Debug, Serialize)]
pub(super) struct DrainReport {
    pub(super) reader_to_file: Measured<ReaderDrainRow>,
    pub(super) reader_only: Measured<ReaderDrainRow>,
    pub(super) vm_record_raw: Measured<VmDrainRow>,
    /// What a subscriber receives over the control socket (the VMM's session reading).
    pub(super) subscriber: Measured<ReaderDrainRow>,
}

impl DrainReport {
    /// The rows of the table, in order, with what they measure.
    pub(super) fn throughputs(&self) -> [(&'static str, Option<&Throughput>); 4] {
        [
            (
                "reader → raw file (page cache)",
                self.reader_to_file.get().map(|r| &r.throughput),
            ),
            (
                "reader → null sink",
                self.reader_only.get().map(|r| &r.throughput),
            ),
            (
                "VM record --format raw",
                self.vm_record_raw.get().map(|r| &r.throughput),
            ),
            (
                "subscriber ← VMM (control socket)",
                self.subscriber.get().map(|r| &r.throughput),
            ),
        ]
    }
}

/// What every drain row reports.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Throughput {
    /// MB (10⁶ bytes) of 4 KiB pages per second.
    pub(super) mb_per_s: Summary,
    pub(super) pages_per_s: Summary,
}

/// The reader alone, on a region filled beforehand (and the subscriber's row).
#[derive(Clone, Debug, Serialize)]
pub(super) struct ReaderDrainRow {
    #[serde(flatten)]
    pub(super) throughput: Throughput,
    /// Including the sink's `finish` (a file's fsync and rename).
    pub(super) mb_per_s_incl_fsync: Summary,
    pub(super) pages: u32,
}

/// `record --format raw` of a guest writing flat out.
#[derive(Clone, Debug, Serialize)]
pub(super) struct VmDrainRow {
    #[serde(flatten)]
    pub(super) throughput: Throughput,
    /// Lost / written, per run.
    pub(super) lost_fraction: Summary,
    pub(super) events: u64,
    pub(super) payload: u32,
}

/// The reader over a host region (1 CPU, stop mode).
pub(super) type Region = RingBuffer<Arc<HeapMem>, Direct<Arc<HeapMem>>>;

/// A host region (1 CPU, stop mode, `pages` pages) filled by the writer with 16-byte
/// payloads; returns the reader over it.
pub(super) fn filled_region(pages: u32) -> Result<Region, BenchError> {
    let p = bench_payload(16);
    filled_with(pages, |_| p.clone())
}

/// A host region of `pages` pages filled by the writer with `payload(n)` as the `n`-th
/// event's, until the ring is full; returns the reader over it.
pub(super) fn filled_with(
    pages: u32,
    mut payload: impl FnMut(u64) -> Vec<u8>,
) -> Result<Region, BenchError> {
    let l = ring::RingGeometry::new(1, pages, PAGE_SIZE as usize, ring::Mode::Stop, false)?;
    let mem = Arc::new(HeapMem::new(l.region_size));
    let rb = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 1_000_000, 1)?;
    let mut w = Writer::attach(mem, 0)?;
    let mut ts = 1000u64;
    for n in 0.. {
        ts += 37;
        if w.write(0, ts, &payload(n)) != WriteOutcome::Written {
            break;
        }
    }
    Ok(rb)
}

/// Reads every complete page of a filled region into `sink`; returns (pages, bytes,
/// seconds until the last page was handed to the sink, seconds including the sink's
/// `finish`: for a file, its fsync and rename).
fn drain_once(pages: u32, sink: Option<PathBuf>) -> Result<(u64, u64, f64, f64), BenchError> {
    let mut rb = filled_region(pages)?;
    let meta = TraceMeta::guest(PAGE_SIZE as usize, 1, Clock::nanoseconds());
    let mut sink: Option<Box<dyn PageSink + Send>> = match &sink {
        Some(p) => Some(Box::new(RawSink::create(p, meta)?)),
        None => None,
    };
    let t = Instant::now();
    let read = pump(&mut rb, sink.as_deref_mut())?;
    let streamed = t.elapsed().as_secs_f64();
    if let Some(s) = sink {
        s.finish(&RunSummary { cpus: Vec::new() })?;
    }
    Ok((read.pages, read.bytes, streamed, t.elapsed().as_secs_f64()))
}

/// What [`pump`] read.
pub(super) struct Pumped {
    pub(super) pages: u64,
    pub(super) bytes: u64,
    pub(super) events: u64,
}

/// Reads every page of CPU 0 of `rb` into `sink`, or into nothing (each page only
/// looked at): the reader's side of the drain and sinks sections.
pub(super) fn pump<S: PageSink + ?Sized>(
    rb: &mut Region,
    mut sink: Option<&mut S>,
) -> Result<Pumped, BenchError> {
    let mut read = Pumped {
        pages: 0,
        bytes: 0,
        events: 0,
    };
    while let Some(pg) = rb.next_page(0)? {
        read.pages += 1;
        read.bytes += pg.bytes.len() as u64;
        read.events += pg.events;
        match sink.as_mut() {
            Some(s) => s.page(0, pg.bytes, Missed::count(pg.missed))?,
            None => {
                std::hint::black_box(pg.bytes);
            }
        }
    }
    Ok(read)
}

/// The reader into a file, then into nothing, `reps` times each.
fn reader_drain(cfg: &Cfg, to_file: bool) -> Result<ReaderDrainRow, BenchError> {
    let (mut mbs, mut pps, mut synced) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..cfg.reps {
        let tmp = temp_path("raw")?;
        let (n, bytes, secs, total) =
            drain_once(cfg.drain_pages, to_file.then(|| tmp.to_path_buf()))?;
        mbs.push(bytes as f64 / secs / 1e6);
        pps.push(n as f64 / secs);
        synced.push(bytes as f64 / total / 1e6);
    }
    Ok(ReaderDrainRow {
        throughput: Throughput {
            mb_per_s: Summary::of(&mbs),
            pages_per_s: Summary::of(&pps),
        },
        mb_per_s_incl_fsync: Summary::of(&synced),
        pages: cfg.drain_pages,
    })
}

/// End to end: `hyptrace record --format raw` of a guest writing as fast as it can.
fn vm_drain(cfg: &Cfg, tsc: Tsc) -> Result<VmDrainRow, BenchError> {
    let (mut mbs, mut pps, mut lost) = (Vec::new(), Vec::new(), Vec::new());
    let events = cfg.events * 4;
    for _ in 0..cfg.reps {
        let o = vm_run(&VmSpec {
            workload: Workload::Bench,
            events,
            payload: 16,
            sink: SinkKind::RAW,
            ..VmSpec::default()
        })?;
        let guest_s = tsc.ns(o.guest_cycles as f64) / 1e9;
        let secs = o.wall.as_secs_f64().max(guest_s);
        mbs.push((o.pages * PAGE_SIZE) as f64 / secs / 1e6);
        pps.push(o.pages as f64 / secs);
        lost.push(o.lost as f64 / o.written.max(1) as f64);
    }
    Ok(VmDrainRow {
        throughput: Throughput {
            mb_per_s: Summary::of(&mbs),
            pages_per_s: Summary::of(&pps),
        },
        lost_fraction: Summary::of(&lost),
        events,
        payload: 16,
    })
}

/// The three drains.
pub(super) fn drain_section(cfg: &Cfg, tsc: Tsc) -> Result<DrainReport, BenchError> {
    let reader_to_file = reader_drain(cfg, true)?;
    eprintln!(
        "  reader_to_file: {:.0} MB/s",
        reader_to_file.throughput.mb_per_s.median
    );
    let reader_only = reader_drain(cfg, false)?;
    eprintln!(
        "  reader_only: {:.0} MB/s",
        reader_only.throughput.mb_per_s.median
    );
    let vm = vm_drain(cfg, tsc)?;
    eprintln!("  vm_record_raw: {:.0} MB/s", vm.throughput.mb_per_s.median);
    // The subscriber's row is the caller's to add (`subscriber.rs` builds on this file).
    Ok(DrainReport {
        reader_to_file: Measured::Ran(reader_to_file),
        reader_only: Measured::Ran(reader_only),
        vm_record_raw: Measured::Ran(vm),
        subscriber: Measured::NotRun {},
    })
}
