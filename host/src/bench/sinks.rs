//! `sinks`: each output format's throughput behind the reader — the pages of a host
//! region filled beforehand with `guest:marker` events (28 bytes each, as the rate
//! search's guest writes them), read page by page (`next_page`) into the sink that
//! `record -o FILE --format F` makes (`make_sink`, in the temporary directory) on its
//! own thread as `record` runs it (`ThreadedSink`: the reader and the sink overlap),
//! timed until its `finish` returned (compression workers drained, the file synced and
//! renamed): what the sink sustains behind the reader, against the reader into nothing
//! on the same pages.

use std::time::Instant;

use hyptrace_abi::events::{marker, vcpu_pid};
use hyptrace_output::{Clock, PageSink, RunSummary, ThreadedSink, TraceMeta};
use serde::Serialize;

use super::drain::pump;
use super::drain::{filled_with, Region};
use super::harness::{temp_path, SinkKind};
use super::stats::Summary;
use super::{BenchError, Cfg, PAGE_SIZE};
use crate::drain::sink::{check_destination, make_sink, Format};
use hyptrace_output::Compression;

/// The sinks measured, in the table's order.
const SINKS: [SinkKind; 7] = [
    SinkKind::RAW,
    SinkKind::File(Format::Dat, Compression::None),
    SinkKind::DAT,
    SinkKind::File(Format::Dat6, Compression::None),
    SinkKind::File(Format::Perfetto, Compression::None),
    SinkKind::File(Format::Json, Compression::None),
    SinkKind::File(Format::Text, Compression::None),
];

/// One sink's row.
#[derive(Clone, Debug, Serialize)]
pub(super) struct SinkRow {
    /// `none (reader alone)`, `raw`, `trace.dat zstd`, ….
    pub(super) sink: String,
    /// MB (10⁶ bytes) of 4 KiB ring pages per second, until `finish` returned.
    pub(super) mb_per_s: Summary,
    /// Events per second, likewise.
    pub(super) events_per_s: Summary,
    /// The median against the reader alone's median.
    pub(super) vs_null: f64,
    /// Bytes of the file written (the last run).
    pub(super) file_bytes: u64,
}

/// The `sinks` JSON object.
#[derive(Clone, Debug, Serialize)]
pub(super) struct SinksReport {
    /// Ring pages per run (each run reads all of them).
    pub(super) pages: u32,
    /// Events per run.
    pub(super) events: u64,
    pub(super) rows: Vec<SinkRow>,
}

/// A region of `pages` pages of markers.
fn markers(pages: u32) -> Result<Region, BenchError> {
    filled_with(pages, |n| {
        marker(vcpu_pid(0), n, n.wrapping_mul(7)).to_vec()
    })
}

/// One run: every page of a fresh region into `kind`'s sink (or nowhere); returns
/// (bytes of pages, events, seconds until `finish` returned, bytes of the file).
fn sink_once(pages: u32, kind: SinkKind) -> Result<(u64, u64, f64, u64), BenchError> {
    let mut rb = markers(pages)?;
    let tmp = temp_path("out")?;
    let mut sink: Option<Box<dyn PageSink + Send>> = match kind {
        SinkKind::Null => None,
        SinkKind::File(format, c) => {
            let target = check_destination(&tmp, "bench")?;
            let meta = TraceMeta::guest(PAGE_SIZE as usize, 1, Clock::nanoseconds());
            let sink = make_sink(&target, format, c, meta)?;
            Some(Box::new(ThreadedSink::new(sink)?))
        }
    };
    let t = Instant::now();
    let read = pump(&mut rb, sink.as_deref_mut())?;
    if let Some(s) = sink {
        s.finish(&RunSummary { cpus: Vec::new() })?;
    }
    let secs = t.elapsed().as_secs_f64();
    let file = std::fs::metadata(&tmp).map_or(0, |m| m.len());
    Ok((read.bytes, read.events, secs, file))
}

/// `reps` runs into `kind`.
fn sink_row(cfg: &Cfg, kind: SinkKind) -> Result<(SinkRow, u64), BenchError> {
    let (mut mbs, mut eps, mut file, mut events) = (Vec::new(), Vec::new(), 0, 0);
    for _ in 0..cfg.reps {
        let (bytes, n, secs, f) = sink_once(cfg.drain_pages, kind)?;
        mbs.push(bytes as f64 / secs / 1e6);
        eps.push(n as f64 / secs);
        (file, events) = (f, n);
    }
    let row = SinkRow {
        sink: kind.name(),
        mb_per_s: Summary::of(&mbs),
        events_per_s: Summary::of(&eps),
        vs_null: 1.0,
        file_bytes: file,
    };
    Ok((row, events))
}

/// The reader alone, then every sink of [`SINKS`].
pub(super) fn sinks_section(cfg: &Cfg) -> Result<SinksReport, BenchError> {
    let (null, events) = sink_row(cfg, SinkKind::Null)?;
    let base = null.mb_per_s.median;
    let mut rows = vec![null];
    for kind in SINKS {
        let (mut row, _) = sink_row(cfg, kind)?;
        row.vs_null = if base > 0.0 {
            row.mb_per_s.median / base
        } else {
            0.0
        };
        eprintln!(
            "  {}: {:.0} MB/s ({:.2} of the reader alone)",
            row.sink, row.mb_per_s.median, row.vs_null
        );
        rows.push(row);
    }
    Ok(SinksReport {
        pages: cfg.drain_pages,
        events,
        rows,
    })
}
