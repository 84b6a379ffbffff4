//! `max_rate`: the highest `--rate` sustained with zero loss in stop mode at the default
//! poll interval and buffer size, for `--swap host` and `--swap guest` (a doubling +
//! bisection search; a step passes only if every one of its [`Cfg::rate_repeats`] runs
//! lost nothing, and the row reports how much each run of the first lossy step lost:
//! the spread). Every run lasts at least `rate_seconds` (5 s) and writes at least twice
//! what a ring holds, so a loss-free run means the reader kept up as a user's record
//! does, its output's backlog included; the rate found is then confirmed by
//! [`Cfg::rate_repeats`] records of `sustained_events` (60 M) events each.
//! `--quick` makes one run at the first rate: a lower bound, not a search
//! (`searched: false`); a search that never lost reports a lower bound too
//! (`first_lossy_rate: null`, `lower_bound: true`).

use serde::Serialize;

use super::harness::{swapper, vm_run, SinkKind, VmSpec};
use super::{BenchError, Cfg, DEFAULT_PAGES, PAGE_SIZE};
use crate::pipeline::report::ms;
use hyptrace_abi::layout::Mode;

/// Events per vCPU that overflow a ring of the rate search twice over if the reader
/// does not drain it (`guest:marker`: 4-byte header + 24-byte payload), so a run without
/// loss is evidence.
const RATE_FILL_EVENTS: u64 = 2 * DEFAULT_PAGES * PAGE_SIZE / 28;

/// One `max_rate` row: the search for one vCPU count.
#[derive(Clone, Debug, Serialize)]
pub(super) struct RateRow {
    pub(super) vcpus: u32,
    /// `host` or `guest` (`--swap`).
    pub(super) swap: &'static str,
    /// Runs per step (all must be loss-free).
    pub(super) repeats: u32,
    /// Events lost by each run of the first lossy step (the spread of the edge).
    pub(super) first_lossy_lost: Vec<u64>,
    /// The highest rate run without loss (0: none).
    pub(super) max_rate_zero_loss: u64,
    /// Events/s per vCPU the guest reached in that step, the slowest of its runs: below
    /// `max_rate_zero_loss` by what the vCPU was held off its core (a pacing guest
    /// catches up at most `PACE_MAX_LAG_US`, then goes on at the rate). 0: no such step.
    pub(super) achieved_zero_loss: f64,
    /// The lowest rate that lost events, if any did.
    pub(super) first_lossy_rate: Option<u64>,
    /// No rate lost events: `max_rate_zero_loss` is a lower bound.
    pub(super) lower_bound: bool,
    /// False for `--quick`'s single run.
    pub(super) searched: bool,
    /// Events lost by each confirming record at `max_rate_zero_loss` (empty: none run).
    pub(super) confirm_lost: Vec<u64>,
    /// Every confirming record lost nothing and read everything written.
    pub(super) confirm_lossless: bool,
    /// Events of each confirming record.
    pub(super) confirm_events: u64,
    pub(super) runs: Vec<RateRun>,
    pub(super) mode: &'static str,
    pub(super) poll_ms: u32,
    pub(super) buffer_kb: u64,
    /// Where the runs write (the temporary directory: `TMPDIR`).
    pub(super) sink: String,
}

/// One run of the search.
#[derive(Clone, Debug, Serialize)]
pub(super) struct RateRun {
    pub(super) rate: u64,
    pub(super) events_per_vcpu: u64,
    pub(super) lost: u64,
    pub(super) read: u64,
    /// Events/s per vCPU the guest reached (its own TSC).
    pub(super) achieved_rate: f64,
    /// Nothing lost, everything written read.
    pub(super) ok: bool,
    /// The reader's waits for the output (the file's writes) in all, ms.
    pub(super) output_wait_ms: f64,
    /// The reader's latest wake-up (held off its core), ms.
    pub(super) longest_late_ms: f64,
    /// Turns the standby drainer took while the reader was late.
    pub(super) standby_turns: u64,
}

impl RateRow {
    /// The highest loss-free rate, in words.
    pub(super) fn text(&self) -> String {
        let good = self.max_rate_zero_loss;
        match (self.first_lossy_rate, self.searched) {
            (_, false) if good > 0 => {
                format!("at least {good} events/s per vCPU (--quick: one run, no search)")
            }
            (_, false) => {
                let lossy = self.runs.first().map_or(0, |r| r.rate);
                format!("not measured (--quick: the one run at {lossy}/s lost events)")
            }
            (Some(bad), _) if good == 0 => {
                format!("below {bad} events/s per vCPU (the first rate tried lost events)")
            }
            (Some(bad), _) => format!(
                "{good} events/s per vCPU{}{} (first lossy rate: {bad}, lost {:?} in {} runs{})",
                self.reached(),
                self.confirmed(),
                self.first_lossy_lost,
                self.repeats,
                self.why(bad)
            ),
            (None, _) => format!(
                "at least {good} events/s per vCPU{}{} (no rate tried lost events)",
                self.reached(),
                self.confirmed()
            ),
        }
    }

    /// The confirming records, in words (nothing when none ran).
    fn confirmed(&self) -> String {
        let m = self.confirm_events / 1_000_000;
        match self.confirm_lost.as_slice() {
            [] => String::new(),
            l if self.confirm_lossless => {
                format!("; {m} M-event records: lossless {} of {}", l.len(), l.len())
            }
            l => format!("; {m} M-event records at it: NOT lossless, lost {l:?}"),
        }
    }

    /// What the reader measured in the lossy runs at `bad`: its waits for the output and
    /// its latest wake-up, the largest of each (what bounded the rate).
    fn why(&self, bad: u64) -> String {
        let most = self
            .runs
            .iter()
            .filter(|r| r.rate == bad && !r.ok)
            .map(|r| (r.output_wait_ms, r.longest_late_ms))
            .reduce(|(w, l), (rw, rl)| (w.max(rw), l.max(rl)));
        match most {
            Some((wait, late)) => format!(
                "; there the reader waited for the output up to {wait:.1} ms in a run and woke up to {late:.1} ms late"
            ),
            None => String::new(),
        }
    }

    /// What the guest reached at the highest loss-free rate, when the vCPU was held off
    /// its core for more than 1 % of the run (else nothing).
    fn reached(&self) -> String {
        let good = self.max_rate_zero_loss as f64;
        if self.achieved_zero_loss > 0.0 && self.achieved_zero_loss < good * 0.99 {
            format!(", reached {:.0}", self.achieved_zero_loss)
        } else {
            String::new()
        }
    }
}

/// `repeats` runs at `rate`: whether all lost nothing, and what each lost.
fn rate_step(
    cfg: &Cfg,
    vcpus: u32,
    guest_swap: bool,
    rate: u64,
    runs: &mut Vec<RateRun>,
) -> Result<(bool, Vec<u64>), BenchError> {
    let mut lost = Vec::new();
    let mut ok = true;
    for _ in 0..cfg.rate_repeats.max(1) {
        let r = rate_run(cfg, vcpus, guest_swap, rate)?;
        ok &= r.ok;
        lost.push(r.lost);
        runs.push(r);
        if cfg.quick {
            break;
        }
    }
    Ok((ok, lost))
}

fn rate_run(cfg: &Cfg, vcpus: u32, guest_swap: bool, rate: u64) -> Result<RateRun, BenchError> {
    let events = ((rate as f64 * cfg.rate_seconds) as u64).max(RATE_FILL_EVENTS);
    rate_record(vcpus, guest_swap, rate, events)
}

/// One stop-mode record of `events` per vCPU at `rate` into the default trace.dat.
fn rate_record(
    vcpus: u32,
    guest_swap: bool,
    rate: u64,
    events: u64,
) -> Result<RateRun, BenchError> {
    let o = vm_run(&VmSpec {
        vcpus,
        events,
        rate,
        mode: Mode::Stop,
        guest_swap,
        sink: SinkKind::DAT,
        ..VmSpec::default()
    })?;
    let achieved = if o.guest_cycles > 0 {
        events as f64 * o.tsc_khz as f64 * 1000.0 / o.guest_cycles as f64
    } else {
        0.0
    };
    Ok(RateRun {
        rate,
        events_per_vcpu: events,
        lost: o.lost,
        read: o.read,
        achieved_rate: achieved,
        ok: o.lost == 0 && o.written == o.read,
        output_wait_ms: ms(o.reader.output_waits.total),
        longest_late_ms: ms(o.reader.longest_late),
        standby_turns: o.reader.standby.turns,
    })
}

/// The search for one vCPU count: double until a loss (or the cap), then bisect,
/// `rate_steps` steps at most, until the bracket is within 1/16 of its lower end.
fn search(cfg: &Cfg, vcpus: u32, guest_swap: bool) -> Result<RateRow, BenchError> {
    let mut runs = Vec::new();
    let mut good = 0u64;
    let mut bad = None;
    let mut bad_lost = Vec::new();
    let mut rate = 1_000_000u64;
    // Doubling until the first loss (or the cap): not counted against the bisection's
    // steps, so a high edge is still narrowed down (from 1 M, 5 doublings reach 32 M
    // events/s). `--quick` makes one run.
    if cfg.quick {
        rate = 200_000;
    }
    while rate <= 256_000_000 {
        let (ok, lost) = rate_step(cfg, vcpus, guest_swap, rate, &mut runs)?;
        if ok {
            good = rate;
            rate *= 2;
        } else {
            bad = Some(rate);
            bad_lost = lost;
            break;
        }
        if cfg.quick {
            break;
        }
    }
    let mut steps = 0;
    while let Some(b) = bad {
        if steps >= cfg.rate_steps || b - good <= good / 16 {
            break;
        }
        steps += 1;
        let mid = good + (b - good) / 2;
        let (ok, lost) = rate_step(cfg, vcpus, guest_swap, mid, &mut runs)?;
        if ok {
            good = mid;
        } else {
            bad = Some(mid);
            bad_lost = lost;
        }
    }
    // The confirmation: records as long as a user's at the rate found.
    let (mut confirm_lost, mut confirm_lossless) = (Vec::new(), true);
    if !cfg.quick && good > 0 {
        for _ in 0..cfg.rate_repeats.max(1) {
            let r = rate_record(vcpus, guest_swap, good, cfg.sustained_events)?;
            confirm_lossless &= r.ok;
            confirm_lost.push(r.lost);
        }
    }
    let achieved_zero_loss = runs
        .iter()
        .filter(|r| r.rate == good && r.ok)
        .map(|r| r.achieved_rate)
        .reduce(f64::min)
        .unwrap_or(0.0);
    Ok(RateRow {
        vcpus,
        swap: swapper(guest_swap),
        repeats: if cfg.quick {
            1
        } else {
            cfg.rate_repeats.max(1)
        },
        first_lossy_lost: bad_lost,
        max_rate_zero_loss: good,
        achieved_zero_loss,
        first_lossy_rate: bad,
        lower_bound: bad.is_none(),
        searched: !cfg.quick,
        confirm_lost,
        confirm_lossless,
        confirm_events: cfg.sustained_events,
        runs,
        mode: "stop",
        poll_ms: super::POLL_MS as u32,
        buffer_kb: DEFAULT_PAGES * PAGE_SIZE / 1024,
        sink: format!("trace.dat v7 file in {}", std::env::temp_dir().display()),
    })
}

/// The `max_rate` rows: one search per vCPU count.
pub(super) fn max_rate_section(cfg: &Cfg) -> Result<Vec<RateRow>, BenchError> {
    let mut rows = Vec::new();
    for &v in &cfg.vcpus {
        for guest_swap in [false, true] {
            let row = search(cfg, v, guest_swap)?;
            eprintln!("  vcpus {v}, swap {}: {}", row.swap, row.text());
            rows.push(row);
        }
    }
    Ok(rows)
}
