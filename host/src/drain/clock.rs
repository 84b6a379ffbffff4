//! Guest time on a host clock (`--clock mono|boot|tsc`).
//!
//! Pages keep raw guest TSC values. At start the VMM knows the guest TSC frequency
//! (`KVM_GET_TSC_KHZ`) and the guest − host TSC offset (set to 0 and read back where
//! KVM allows; see [`crate::vmm::vm::Vm::tsc_offset`]). [`HostClock::calibrate`] takes a
//! paired sample of the host TSC and the host clock (the tightest of `TRIES`
//! `lfence;rdtsc; clock_gettime; lfence;rdtsc` brackets) and starts the run's
//! [`ClockMap`] there, with the kHz frequency as slope.
//!
//! Every [`RECHECK_EVERY`] (and at the end) [`HostClock::recheck`] takes a new sample,
//! measures the map's error at it, and appends a knot (*a correction*) on the current
//! line whose slope is the host clock's rate measured since the previous sample plus
//! what removes the measured error over the next period: the map follows the host
//! clock (the kHz rounding, NTP's slewing) without ever moving a time already
//! converted (invariant K1, *knots never move what was converted*, docs/design.md "Clock").
//! A sample whose bracket is too wide, or whose error is too large to be drift (a clock
//! step, a TSC jump), is a warning with its size and is left out.

use std::time::{Duration, Instant};

use hyptrace_output::{Clock, ClockMap, Knot, OutputError, TscConversion, SLOPE_SHIFT};

use crate::vmm::time::{clock_ns, ClockKind};

/// How often a run corrects its map.
pub const RECHECK_EVERY: Duration = Duration::from_millis(500);
/// Map error (ns) above which a run warns (once): the corrections do not keep up.
pub const DRIFT_WARN_NS: u64 = 1_000;
/// Largest rate difference (ppm) a correction believes between the host clock and the
/// TSC: NTP slews by at most 500 ppm; an error beyond this much of the elapsed time (plus
/// [`STEP_SLACK_NS`]) is a step, not drift.
const MAX_RATE_PPM: u64 = 1_000;
/// Error always accepted as drift, ns.
const STEP_SLACK_NS: u64 = 10_000;
/// A bracket wider than this many times the calibration's (plus 200 cycles) is refused.
const WIDTH_FACTOR: u64 = 4;
/// Shortest span between two samples a rate is measured over (a shorter one, e.g. the
/// final re-check right after a periodic one, reuses the last rate: bracket noise over a
/// short span would give a wild rate).
const MIN_RATE_SPAN: Duration = Duration::from_millis(250);
/// A step seen by this many re-checks in a row is real (a suspend moved BOOTTIME, the
/// TSC jumped): the map then slews onto it (at most [`MAX_RATE_PPM`]), warned.
const STEP_PERSIST: u32 = 3;
/// Brackets tried per sample (the tightest wins).
const TRIES: usize = 64;

/// `lfence; rdtsc; lfence`: the TSC read in program order (what the vDSO's
/// `clock_gettime` does too), so a bracket really brackets.
fn fenced_tsc() -> u64 {
    // SAFETY: `lfence` and `rdtsc` have no preconditions on x86-64 (SSE2 is baseline).
    unsafe {
        core::arch::x86_64::_mm_lfence();
        let t = core::arch::x86_64::_rdtsc();
        core::arch::x86_64::_mm_lfence();
        t
    }
}

/// One paired sample: the host TSC at the middle of the tightest `rdtsc; clock_gettime;
/// rdtsc` bracket, the clock reading inside it, and the bracket's width in cycles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Host TSC (middle of the bracket).
    pub tsc: u64,
    /// Host clock, ns.
    pub ns: u64,
    /// Bracket width, cycles.
    pub width: u64,
}

/// The tightest of `TRIES` brackets of `clock`.
pub fn sample(clock: libc::clockid_t) -> Sample {
    let mut best = Sample {
        tsc: 0,
        ns: 0,
        width: u64::MAX,
    };
    for _ in 0..TRIES {
        let a = fenced_tsc();
        let ns = clock_ns(clock);
        let b = fenced_tsc();
        let width = b.wrapping_sub(a);
        if width < best.width {
            best = Sample {
                tsc: a.wrapping_add(width / 2),
                ns,
                width,
            };
        }
    }
    best
}

/// The run's clock: the map from guest TSC to the chosen host clock, and how it held.
#[derive(Clone, Debug)]
pub struct HostClock {
    /// Which clock.
    pub kind: ClockKind,
    /// Guest TSC frequency.
    pub tsc_khz: u64,
    /// Guest − host TSC offset assumed (what KVM reported, else 0).
    pub tsc_offset: i64,
    /// The clock every output converts with (its map, for `mono`/`boot`, is corrected
    /// while the run goes).
    pub clock: Clock,
    /// The kHz line anchored at calibration, never corrected: what `max_drift_ns`
    /// measures.
    line: Clock,
    /// The calibration sample (host TSC, host ns, width).
    pub anchor: Option<Sample>,
    /// The sample the host clock's rate is measured from (at least [`MIN_RATE_SPAN`]
    /// before the next one).
    last: Option<Sample>,
    /// The host clock's rate (ns per cycle × 2^`SLOPE_SHIFT`) last measured (at first:
    /// the kHz frequency's).
    rate: u128,
    /// Largest |drift| of the uncorrected kHz line seen by the re-checks, ns.
    pub max_drift_ns: u64,
    /// Largest |error| of the corrected map seen by the re-checks, ns.
    pub max_error_ns: u64,
    /// Re-checks done.
    pub checks: u64,
    /// Knots appended.
    pub corrections: u64,
    /// Samples refused (bracket too wide, clock step or TSC jump).
    pub rejected: u64,
    warned: bool,
    warned_width: bool,
    /// Consecutive re-checks that saw a step (see [`STEP_PERSIST`]).
    steps: u32,
    last_check: Option<Instant>,
}

impl HostClock {
    /// Calibrates the map for `kind` (a sample now; `tsc`: no map).
    pub fn calibrate(kind: ClockKind, tsc_khz: u64, tsc_offset: i64) -> Result<Self, OutputError> {
        let (clock, line, anchor) = match kind.clockid() {
            None => (Clock::raw_tsc(), Clock::raw_tsc(), None),
            Some(id) => {
                let base = Clock::guest_tsc(tsc_khz)?;
                let s = sample(id);
                let offset_ns = anchor_offset(base.tsc.as_ref(), s, tsc_offset);
                let line = base.with_offset_ns(offset_ns);
                let map = ClockMap::new(Knot {
                    tsc: s.tsc.wrapping_add_signed(tsc_offset),
                    ns: s.ns,
                    slope: ((1_000_000u128 << SLOPE_SHIFT) / u128::from(tsc_khz)) as u64,
                });
                (line.clone().with_map(kind.name(), map), line, Some(s))
            }
        };
        Ok(Self {
            kind,
            tsc_khz,
            tsc_offset,
            clock,
            line,
            anchor,
            last: anchor,
            rate: (1_000_000u128 << SLOPE_SHIFT) / u128::from(tsc_khz.max(1)),
            max_drift_ns: 0,
            max_error_ns: 0,
            checks: 0,
            corrections: 0,
            rejected: 0,
            warned: false,
            warned_width: false,
            steps: 0,
            last_check: Some(Instant::now()),
        })
    }

    /// Converts a host TSC value to the run's clock (for the VMM's own stamps).
    pub fn host_tsc_ns(&self, host_tsc: u64) -> u64 {
        self.clock
            .to_ns(host_tsc.wrapping_add_signed(self.tsc_offset))
    }

    /// Signed error now: what the map says minus what the host clock says, ns.
    pub fn drift_now(&self) -> Option<i64> {
        let id = self.kind.clockid()?;
        let s = sample(id);
        let predicted = self.host_tsc_ns(s.tsc);
        Some(predicted.wrapping_sub(s.ns) as i64)
    }

    /// Re-checks and corrects the map if [`RECHECK_EVERY`] has passed (or `force`).
    pub fn recheck(&mut self, force: bool) {
        let due = self.last_check.is_none_or(|t| t.elapsed() >= RECHECK_EVERY);
        if !(force || due) {
            return;
        }
        self.last_check = Some(Instant::now());
        let Some(id) = self.kind.clockid() else {
            return;
        };
        let s = sample(id);
        self.checks += 1;
        let g = s.tsc.wrapping_add_signed(self.tsc_offset);
        let drift = self.line.to_ns(g).wrapping_sub(s.ns) as i64;
        self.max_drift_ns = self.max_drift_ns.max(drift.unsigned_abs());
        let err = self.clock.to_ns(g).wrapping_sub(s.ns) as i64;
        if !self.plausible(s, err) {
            self.rejected += 1;
            return;
        }
        self.max_error_ns = self.max_error_ns.max(err.unsigned_abs());
        log::debug!(
            "clock re-check: map − {} = {err} ns (kHz line {drift} ns)",
            self.kind.name()
        );
        if err.unsigned_abs() > DRIFT_WARN_NS && !self.warned {
            self.warned = true;
            log::warn!(
                "guest clock map was {err} ns off CLOCK_{} at a re-check (corrected; see --stats clock.max_error_ns)",
                self.kind.name().to_uppercase()
            );
        }
        self.measure_rate(s);
        self.correct(s);
    }

    /// Updates the measured rate from the rate sample to `s` if they are far enough
    /// apart (then `s` becomes the rate sample).
    fn measure_rate(&mut self, s: Sample) {
        let Some(prev) = self.last else {
            self.last = Some(s);
            return;
        };
        let (Some(dt), Some(dns)) = (s.tsc.checked_sub(prev.tsc), s.ns.checked_sub(prev.ns)) else {
            return;
        };
        if dt == 0 || dns < MIN_RATE_SPAN.as_nanos() as u64 {
            return;
        }
        self.rate = (u128::from(dns) << SLOPE_SHIFT) / u128::from(dt);
        self.last = Some(s);
    }

    /// (K1: the knot goes through `ClockMap::extend`.) Appends a knot now whose slope brings the map onto the host clock (sample `s`,
    /// going on at the measured rate) one [`RECHECK_EVERY`] later.
    fn correct(&mut self, s: Sample) {
        let Some(map) = self.clock.map.clone() else {
            return;
        };
        let rate = self.rate;
        let period = u128::from(self.tsc_khz) * RECHECK_EVERY.as_millis();
        let (g, off) = (s.tsc.wrapping_add_signed(self.tsc_offset), self.tsc_offset);
        let lo = rate - rate * u128::from(MAX_RATE_PPM) / 1_000_000;
        let hi = rate + rate * u128::from(MAX_RATE_PPM) / 1_000_000;
        let knot = map.extend(
            || fenced_tsc().wrapping_add_signed(off),
            |t, ns| {
                // The host clock one period after the knot, from the sample and the rate.
                let ahead = u128::from(t.wrapping_sub(g)) + period;
                let target = i128::from(s.ns) + ((ahead * rate) >> SLOPE_SHIFT) as i128;
                let slope = ((target - i128::from(ns)) << SLOPE_SHIFT) / period.max(1) as i128;
                (slope.max(0) as u128).clamp(lo, hi) as u64
            },
        );
        if knot.is_some() {
            self.corrections += 1;
        }
    }

    /// Whether sample `s`, with map error `err`, may correct the map; warns (with the
    /// size) when not. A step is left out until it persisted [`STEP_PERSIST`] re-checks;
    /// then the map slews onto it from this sample (the rate is measured afresh from it).
    fn plausible(&mut self, s: Sample, err: i64) -> bool {
        let calib = self.anchor.map_or(0, |a| a.width);
        let max_width = calib.saturating_mul(WIDTH_FACTOR).saturating_add(200);
        if s.width > max_width {
            let msg = format!(
                "clock re-check: bracket {} cycles wide (calibration {calib}), sample left out",
                s.width
            );
            if std::mem::replace(&mut self.warned_width, true) {
                log::debug!("{msg}");
            } else {
                log::warn!("{msg}");
            }
            return false;
        }
        let elapsed = self
            .last
            .map_or(0, |p| s.ns.saturating_sub(p.ns))
            .saturating_add(RECHECK_EVERY.as_nanos() as u64);
        let bound = elapsed / 1_000_000 * MAX_RATE_PPM + STEP_SLACK_NS;
        if err.unsigned_abs() <= bound {
            self.steps = 0;
            return true;
        }
        self.steps = self.steps.saturating_add(1);
        let clock = self.kind.name().to_uppercase();
        if self.steps < STEP_PERSIST {
            let msg = format!(
                "CLOCK_{clock} is {err} ns from the map's TSC prediction (more than {bound} ns: a clock step or a TSC jump); left out of the map"
            );
            if self.steps == 1 {
                log::warn!("{msg}");
            } else {
                log::debug!("{msg}");
            }
            return false;
        }
        if self.steps == STEP_PERSIST {
            log::warn!(
                "CLOCK_{clock} stayed {err} ns from the map for {STEP_PERSIST} re-checks: the map slews onto it (at most {MAX_RATE_PPM} ppm)"
            );
        }
        self.last = Some(s);
        true
    }

    /// One line for the end of a run (`-v`): the corrections and the worst error.
    pub fn summary(&self) -> Option<String> {
        self.kind.clockid()?;
        Some(format!(
            "clock {}: {} corrections in {} re-checks, max error {} ns (uncorrected kHz line: {} ns), {} samples left out",
            self.kind.name(),
            self.corrections,
            self.checks,
            self.max_error_ns,
            self.max_drift_ns,
            self.rejected
        ))
    }

    /// What `--stats` says of the clock.
    pub fn stats(&self) -> ClockStats {
        let (mult, shift) = self.clock.tsc.map_or((0, 0), |t| (t.mult, t.shift));
        ClockStats {
            calibration_width_cycles: self.anchor.map_or(0, |a| a.width),
            checks: self.checks,
            corrections: self.corrections,
            max_drift_ns: self.max_drift_ns,
            max_error_ns: self.max_error_ns,
            mult,
            name: self.kind.name(),
            offset_ns: self.clock.offset_ns,
            rejected: self.rejected,
            shift,
            tsc_khz: self.tsc_khz,
            tsc_offset: self.tsc_offset,
        }
    }
}

/// The `--stats` `clock` object (keys in alphabetical order).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ClockStats {
    /// Width of the calibration bracket, host cycles (0: no calibration).
    pub calibration_width_cycles: u64,
    /// Re-checks done during the run.
    pub checks: u64,
    /// Knots appended to the map (corrections).
    pub corrections: u64,
    /// Largest |drift| of the uncorrected kHz line at a re-check, ns.
    pub max_drift_ns: u64,
    /// Largest |error| of the corrected map at a re-check, ns.
    pub max_error_ns: u64,
    /// First segment's TSC2NSEC multiplier (0: raw TSC).
    pub mult: u32,
    /// `mono`, `boot` or `tsc`.
    pub name: &'static str,
    /// First segment's ns offset after scaling.
    pub offset_ns: i64,
    /// Samples left out (bracket too wide, clock step, TSC jump), each warned.
    pub rejected: u64,
    /// First segment's TSC2NSEC shift.
    pub shift: u32,
    /// Guest TSC frequency.
    pub tsc_khz: u64,
    /// Guest − host TSC offset assumed.
    pub tsc_offset: i64,
}

/// One memory ping of a guest in the `align` workload's ping phase: the host clock just
/// before the request and just after the answer, and the guest TSC the guest read when
/// it saw the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ping {
    /// Host clock before the request, ns.
    pub before_ns: u64,
    /// Guest TSC when the guest saw it.
    pub guest_tsc: u64,
    /// Host clock after the answer, ns.
    pub after_ns: u64,
}

/// Pings the guest vCPU whose result slot is at `slot` (`RUN_FLAG_ALIGN_PING`) with
/// request numbers `first..first + n` (never reuse one; 0 and `PING_STOP` are not
/// requests) through guest memory (no exit), on host clock `clock` (`tsc`: the
/// monotonic clock); each wait is
/// bounded by `timeout` (an unanswered ping is left out). [`end_pings`] ends the phase.
pub fn ping_guest(
    mem: &vm_memory::GuestMemoryMmap,
    slot: u64,
    clock: ClockKind,
    first: u64,
    n: u32,
    timeout: Duration,
) -> Vec<Ping> {
    use hyptrace_abi::guest::result;
    use std::sync::atomic::Ordering;
    use vm_memory::{Bytes, GuestAddress};
    let at = |off: usize| GuestAddress(slot + off as u64);
    let clock = clock.clockid().unwrap_or(libc::CLOCK_MONOTONIC);
    let mut out = Vec::with_capacity(n as usize);
    let first = first.max(1);
    // Exclusive end: k never reaches PING_STOP (u64::MAX).
    for k in first..first.saturating_add(u64::from(n)) {
        let before_ns = clock_ns(clock);
        if mem
            .store(k, at(result::PING_REQ), Ordering::Release)
            .is_err()
        {
            break;
        }
        let deadline = Instant::now() + timeout;
        let answered = loop {
            match mem.load::<u64>(at(result::PING_ACK), Ordering::Acquire) {
                Ok(a) if a == k => break true,
                Ok(_) => {}
                Err(_) => break false,
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::hint::spin_loop();
        };
        let after_ns = clock_ns(clock);
        if !answered {
            continue;
        }
        if let Ok(guest_tsc) = mem.load::<u64>(at(result::PING_TSC), Ordering::Acquire) {
            out.push(Ping {
                before_ns,
                guest_tsc,
                after_ns,
            });
        }
    }
    out
}

/// Ends the guest's ping phase (see [`ping_guest`]).
pub fn end_pings(mem: &vm_memory::GuestMemoryMmap, slot: u64) {
    use vm_memory::{Bytes, GuestAddress};
    let addr = GuestAddress(slot + hyptrace_abi::guest::result::PING_REQ as u64);
    let _ = mem.store(
        hyptrace_abi::guest::PING_STOP,
        addr,
        std::sync::atomic::Ordering::Release,
    );
}

/// `offset_ns` such that guest TSC `s.tsc + tsc_offset` maps to `s.ns`.
fn anchor_offset(t: Option<&TscConversion>, s: Sample, tsc_offset: i64) -> i64 {
    let Some(t) = t else { return 0 };
    let guest = s.tsc.wrapping_add_signed(tsc_offset);
    let scaled = i128::from(t.to_ns(guest));
    let off = i128::from(s.ns) - scaled;
    off.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmm::time::monotonic_ns;

    #[test]
    fn anchor_maps_the_sample_exactly() {
        let t = TscConversion::from_tsc_khz(2_000_000).unwrap();
        let s = Sample {
            tsc: 10_000,
            ns: 1_000_000,
            width: 40,
        };
        let off = anchor_offset(Some(&t), s, 0);
        assert_eq!(off, 1_000_000 - 5_000);
        let clock = Clock::guest_tsc(2_000_000).unwrap().with_offset_ns(off);
        assert_eq!(clock.to_ns(10_000), 1_000_000);
        // Guest TSC ahead of the host's by 2000 cycles: guest 12000 is host 10000.
        let off = anchor_offset(Some(&t), s, 2_000);
        let clock = Clock::guest_tsc(2_000_000).unwrap().with_offset_ns(off);
        assert_eq!(clock.to_ns(12_000), 1_000_000);
    }

    #[test]
    fn calibration_tracks_the_host_clock() {
        let khz = match kvm_free_tsc_khz() {
            Some(k) => k,
            None => return,
        };
        let mut c = HostClock::calibrate(ClockKind::Mono, khz, 0).unwrap();
        let before = monotonic_ns();
        let now = c.host_tsc_ns(crate::vmm::time::host_tsc());
        let after = monotonic_ns();
        // Not a timing assertion: the map is anchored on this clock a moment ago, so
        // "now" lies between two readings up to the (generous) rounding drift.
        assert!(
            now + 1_000_000 >= before && now <= after + 1_000_000,
            "{before} {now} {after}"
        );
        c.recheck(true);
        assert_eq!(c.checks, 1);
        let raw = HostClock::calibrate(ClockKind::Tsc, khz, 0).unwrap();
        assert_eq!(raw.clock.to_ns(12345), 12345);
        assert_eq!(raw.stats().name, "tsc");
        assert_eq!(raw.stats().mult, 0);
    }

    /// A map off by 5 µs: the re-check sees it, records it, and the next knots bring the
    /// map back without moving what it gave before.
    #[test]
    fn recheck_corrects_the_map_without_moving_the_past() {
        let Some(khz) = kvm_free_tsc_khz() else {
            return;
        };
        let mut c = HostClock::calibrate(ClockKind::Mono, khz, 0).unwrap();
        let map = c.clock.map.clone().unwrap();
        let first = map.last().unwrap();
        // Skew the map: the first knot 5 µs late.
        let skewed = ClockMap::new(Knot {
            ns: first.ns + 5_000,
            ..first
        });
        c.clock.map = Some(skewed.clone());
        let probe = first.tsc + 1_000;
        let before = skewed.to_ns(probe);
        // A sample may be left out (a bracket too wide on a loaded machine): re-check
        // until one correction happened (bounded).
        for _ in 0..100 {
            c.recheck(true);
            if c.corrections > 0 {
                break;
            }
        }
        assert_eq!(c.corrections, 1, "{c:?}");
        assert_eq!(c.corrections + c.rejected, c.checks);
        assert!(c.max_error_ns >= 4_000, "{}", c.max_error_ns);
        assert_eq!(skewed.knots().len(), 2);
        assert_eq!(
            skewed.to_ns(probe),
            before,
            "a knot never moves a converted time"
        );
        assert_eq!(c.stats().max_error_ns, c.max_error_ns);
        assert_eq!(c.stats().corrections, 1);
        assert_eq!(c.stats().rejected, c.rejected);
    }

    /// A step (the map 5 ms off) is left out, counted and not folded in, until it
    /// persisted STEP_PERSIST re-checks; then the map corrects towards it.
    #[test]
    fn a_step_is_left_out_until_it_persists() {
        let Some(khz) = kvm_free_tsc_khz() else {
            return;
        };
        let mut c = HostClock::calibrate(ClockKind::Mono, khz, 0).unwrap();
        let first = c.clock.map.as_ref().unwrap().last().unwrap();
        let skewed = ClockMap::new(Knot {
            ns: first.ns + 5_000_000,
            ..first
        });
        c.clock.map = Some(skewed.clone());
        // Bounded: a sample may also be left out for its width on a loaded machine.
        for _ in 0..100 {
            c.recheck(true);
            if c.steps >= STEP_PERSIST - 1 {
                break;
            }
        }
        assert_eq!(c.steps, STEP_PERSIST - 1, "{c:?}");
        assert_eq!(c.corrections, 0);
        assert_eq!(c.rejected, c.checks);
        assert_eq!(skewed.knots().len(), 1, "a step is not folded in");
        for _ in 0..100 {
            c.recheck(true);
            if c.corrections > 0 {
                break;
            }
        }
        assert_eq!(c.corrections, 1, "{c:?}");
        assert_eq!(skewed.knots().len(), 2);
        assert!(c.max_error_ns >= 4_000_000, "{}", c.max_error_ns);
    }

    /// The host TSC frequency measured over 20 ms (no KVM needed).
    fn kvm_free_tsc_khz() -> Option<u64> {
        let a = sample(libc::CLOCK_MONOTONIC);
        std::thread::sleep(Duration::from_millis(20));
        let b = sample(libc::CLOCK_MONOTONIC);
        let ns = b.ns.checked_sub(a.ns)?;
        (ns > 0).then(|| b.tsc.wrapping_sub(a.tsc).saturating_mul(1_000_000) / ns)
    }
}
