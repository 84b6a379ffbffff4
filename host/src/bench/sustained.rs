//! `sustained`: long records as a user makes them. The writer's flat-out rate is the
//! fastest of [`RUNS`] overwrite runs (one vCPU, `guest:marker` events, read into no
//! file: the writer's own pace, not what an output's threads leave it of its core);
//! then, for the default trace.dat (zstd), `--compression none` and
//! `--format raw`, [`RUNS`] stop-mode records at each of [`FRACTIONS`] of that rate, each
//! of `sustained_events` events (60 M; `--quick`: 2 M): how many events each lost. A
//! fraction holds for a sink only if every run lost nothing.

use serde::Serialize;

use super::harness::{vm_run, SinkKind, VmSpec};
use super::{BenchError, Cfg};
use crate::drain::sink::Format;
use crate::pipeline::report::ms;
use hyptrace_abi::layout::Mode;
use hyptrace_output::Compression;

/// Runs per measurement.
const RUNS: usize = 3;
/// The rates tried, as fractions of the flat-out rate (the goal, and the stretch).
const FRACTIONS: [f64; 2] = [0.25, 0.5];
/// The sinks of the stop-mode records.
const SINKS: [SinkKind; 3] = [
    SinkKind::DAT,
    SinkKind::File(Format::Dat, Compression::None),
    SinkKind::RAW,
];

/// One sink at one rate.
#[derive(Clone, Debug, Serialize)]
pub(super) struct SustainedRow {
    pub(super) sink: String,
    /// Of the flat-out rate.
    pub(super) fraction: f64,
    /// `--rate`, events/s.
    pub(super) rate: u64,
    /// Events lost by each run.
    pub(super) lost: Vec<u64>,
    /// Events/s the guest reached in each run (its own TSC).
    pub(super) achieved: Vec<f64>,
    /// The reader's waits for the output in each run, ms.
    pub(super) output_wait_ms: Vec<f64>,
    /// Every run lost nothing and read everything written.
    pub(super) lossless: bool,
}

/// The `sustained` JSON object.
#[derive(Clone, Debug, Serialize)]
pub(super) struct SustainedReport {
    /// Events per run.
    pub(super) events: u64,
    /// The guest's rate in each flat-out overwrite run, events/s.
    pub(super) flat_out_runs: Vec<f64>,
    /// The fastest of them.
    pub(super) flat_out: f64,
    pub(super) rows: Vec<SustainedRow>,
}

/// The guest's rate in a run of `events` events that took `cycles` at `tsc_khz`.
fn achieved(events: u64, tsc_khz: u64, cycles: u64) -> f64 {
    if cycles == 0 {
        return 0.0;
    }
    events as f64 * tsc_khz as f64 * 1000.0 / cycles as f64
}

/// The flat-out runs: overwrite, no pacing, the live reader counting pages into no
/// file. (Into the default trace.dat the compression workers share the cores with the
/// vCPU: on a 2-core Intel Xeon that measured 36.9 M events/s where the writer alone
/// wrote 52.8 M/s, and every fraction of it asked less of the sinks than the goal
/// means; docs/benchmarks.md, "Seventh session".)
fn flat_out(events: u64, runs: usize) -> Result<Vec<f64>, BenchError> {
    (0..runs)
        .map(|_| {
            let o = vm_run(&VmSpec {
                events,
                sink: SinkKind::Null,
                ..VmSpec::default()
            })?;
            Ok(achieved(events, o.tsc_khz, o.guest_cycles))
        })
        .collect()
}

/// `runs` stop-mode records of `events` at `rate` into `sink`.
fn row(
    (sink, fraction, rate): (SinkKind, f64, u64),
    events: u64,
    runs: usize,
) -> Result<SustainedRow, BenchError> {
    let mut r = SustainedRow {
        sink: sink.name(),
        fraction,
        rate,
        lost: Vec::new(),
        achieved: Vec::new(),
        output_wait_ms: Vec::new(),
        lossless: true,
    };
    for _ in 0..runs {
        let o = vm_run(&VmSpec {
            events,
            rate,
            mode: Mode::Stop,
            sink,
            ..VmSpec::default()
        })?;
        r.lossless &= o.lost == 0 && o.written == o.read;
        r.lost.push(o.lost);
        r.achieved.push(achieved(events, o.tsc_khz, o.guest_cycles));
        r.output_wait_ms.push(ms(o.reader.output_waits.total));
    }
    Ok(r)
}

/// The section: the flat-out rate, then every sink at every fraction.
pub(super) fn sustained_section(cfg: &Cfg) -> Result<SustainedReport, BenchError> {
    let runs = if cfg.quick { 1 } else { RUNS };
    let events = cfg.sustained_events;
    let flat_out_runs = flat_out(events, runs)?;
    let flat = flat_out_runs.iter().copied().fold(0.0, f64::max);
    if flat < 1.0 {
        // `--rate 0` would mean "flat out": no fraction of nothing.
        return Err(BenchError::NoFlatOut);
    }
    eprintln!(
        "  flat out: {:.1} M events/s (fastest of {runs})",
        flat / 1e6
    );
    let mut rows = Vec::new();
    for sink in SINKS {
        for fraction in FRACTIONS {
            let rate = (flat * fraction) as u64;
            let r = row((sink, fraction, rate), events, runs)?;
            eprintln!(
                "  {} at {:.0} % ({:.1} M/s): lost {:?}",
                r.sink,
                fraction * 100.0,
                rate as f64 / 1e6,
                r.lost
            );
            rows.push(r);
        }
    }
    Ok(SustainedReport {
        events,
        flat_out_runs,
        flat_out: flat,
        rows,
    })
}
