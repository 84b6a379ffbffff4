//! Guest clock: raw TSC cycles in the pages, converted to nanoseconds when read.
//!
//! The conversion is the one trace-cmd applies for its `TSC2NSEC` option:
//! `ns = (cycles * mult) >> shift`, computed exactly on 96 bits and wrapped to 64 bits
//! (trace-cmd's `mul_u64_u32_shr`), so our text/JSON timestamps are the ones
//! `trace-cmd report` prints.
//!
//! Verified with trace-cmd 3.1.6 (see docs/output.md): TSC2NSEC is honoured in v6 and v7
//! whatever the trace clock's name; its `offset` is **ignored** by `report`; a multiplier
//! of 2^31 or more is sign-extended (trace-cmd keeps it in an `int`), which gives garbage,
//! so [`TscConversion::from_tsc_khz`] keeps `mult ≤ i32::MAX`.
//!
//! Putting guest time on a host clock (`CLOCK_MONOTONIC`...) needs a signed nanosecond
//! offset added *after* the scaling: [`Clock::offset_ns`], which trace.dat carries in
//! trace-cmd's OFFSET option (id 7, a decimal string; `report` adds it to every
//! converted timestamp: `ts = mul_u64_u32_shr(raw, mult, shift) + offset`).
//!
//! A run on a host clock (`--clock mono|boot`) instead converts through a [`ClockMap`]:
//! a continuous piecewise-linear map whose knots the run adds while it goes (see
//! docs/design.md "Clock"). Every output converts with [`Clock::to_ns`]; files carry the
//! converted nanoseconds ([`Clock::retime_page`], [`Clock::file_clock`]).

use crate::error::MetaError;
use std::sync::{Arc, PoisonError, RwLock};

use hyptrace_abi::page::{
    decode_record, fix_abs_ts, header_word, page_header, Record, COMMIT_LEN_MASK, DELTA_BITS,
    MAX_DELTA, MAX_EXTENDED_DELTA, PAGE_HEADER_SIZE,
};

use crate::OutputError;

/// Fixed-point shift of a [`Knot`]'s slope (ns per cycle × 2^32).
pub const SLOPE_SHIFT: u32 = 32;

/// One knot of a [`ClockMap`]: from guest TSC `tsc` on, `ns = ns + ((t - tsc) * slope) >>
/// SLOPE_SHIFT`, until the next knot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Knot {
    /// Guest TSC where this segment starts.
    pub tsc: u64,
    /// Host clock (ns) the map gives at `tsc`.
    pub ns: u64,
    /// ns per cycle × 2^[`SLOPE_SHIFT`].
    pub slope: u64,
}

impl Knot {
    /// The map's value at `tsc` on this segment's line (wrapping; before `tsc`: the line
    /// extended backwards).
    pub fn at(&self, tsc: u64) -> u64 {
        let scaled = |d: u64| ((u128::from(d) * u128::from(self.slope)) >> SLOPE_SHIFT) as u64;
        if tsc >= self.tsc {
            self.ns.wrapping_add(scaled(tsc - self.tsc))
        } else {
            self.ns.wrapping_sub(scaled(self.tsc - tsc))
        }
    }
}

/// The one conversion from a TSC-stamped source (guest rings, the VMM's host events, any
/// later host source stamped in the guest's TSC domain) to a host clock: a continuous,
/// piecewise-linear map shared by every output of a run (clones share the knots).
///
/// Invariant K1 (docs/design.md "Clock", *knots never move what was converted*): a knot is
/// only appended, at a TSC read under the write lock, and starts on the previous segment's
/// line; so the value of any TSC already converted (every TSC stamped before that moment)
/// never changes, and every output, whenever it converts, gives the same nanoseconds.
#[derive(Clone, Debug)]
pub struct ClockMap {
    knots: Arc<RwLock<Vec<Knot>>>,
}

impl PartialEq for ClockMap {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.knots, &other.knots)
    }
}
impl Eq for ClockMap {}

impl ClockMap {
    /// A map with its first knot.
    pub fn new(first: Knot) -> Self {
        Self {
            knots: Arc::new(RwLock::new(vec![first])),
        }
    }

    /// Converts a guest TSC value: the segment of the last knot at or before it (before
    /// the first knot: the first segment extended backwards).
    pub fn to_ns(&self, tsc: u64) -> u64 {
        convert(
            &self.knots.read().unwrap_or_else(PoisonError::into_inner),
            tsc,
        )
    }

    /// Rewrites the timestamps of an exported page in place from guest TSC to this
    /// map's ns (see [`Clock::retime_page`]), under one read lock.
    fn retime_page(&self, page: &mut [u8], tsc_offset: i64) -> u64 {
        let knots = self.knots.read().unwrap_or_else(PoisonError::into_inner);
        // A page's times rise: keep the segment of the previous record while it holds.
        let mut seg: Option<usize> = None;
        retime(page, |t| {
            let t = t.wrapping_add_signed(tsc_offset);
            if let Some(i) = seg {
                let next = knots.get(i + 1).map_or(u64::MAX, |k| k.tsc);
                if knots[i].tsc <= t && (t < next || i + 1 == knots.len()) {
                    return knots[i].at(t);
                }
            }
            let i = knots.partition_point(|k| k.tsc <= t).saturating_sub(1);
            seg = Some(i);
            knots.get(i).map_or(t, |k| k.at(t))
        })
    }

    /// Appends a knot at the TSC `now()` returns (read under the write lock), on the
    /// current line, with slope `slope(knot_tsc, knot_ns)`. Returns the knot, or `None`
    /// if `now()` is not after the last knot.
    pub fn extend(
        &self,
        now: impl FnOnce() -> u64,
        slope: impl FnOnce(u64, u64) -> u64,
    ) -> Option<Knot> {
        let mut knots = self.knots.write().unwrap_or_else(PoisonError::into_inner);
        let t = now();
        let last = *knots.last()?;
        if t <= last.tsc {
            return None;
        }
        let ns = last.at(t);
        let k = Knot {
            tsc: t,
            ns,
            slope: slope(t, ns),
        };
        knots.push(k);
        Some(k)
    }

    /// Appends a knot another map made ([`ClockMap::extend`]): a replica of that map
    /// (a subscriber's, docs/design.md "One reader, subscribers") gets its knots in
    /// order and converts as it does (K1 holds for the replica as for the original: each
    /// knot comes after every TSC converted before it arrived). Refused (false) unless
    /// it is after the last knot.
    pub fn append(&self, k: Knot) -> bool {
        let mut knots = self.knots.write().unwrap_or_else(PoisonError::into_inner);
        if knots.last().is_some_and(|last| k.tsc <= last.tsc) {
            return false;
        }
        knots.push(k);
        true
    }

    /// Knots from the `from`-th on (a replica asks for those it lacks).
    pub fn knots_from(&self, from: usize) -> Vec<Knot> {
        let knots = self.knots.read().unwrap_or_else(PoisonError::into_inner);
        knots.get(from..).map_or_else(Vec::new, <[Knot]>::to_vec)
    }

    /// Knots so far.
    pub fn knots(&self) -> Vec<Knot> {
        self.knots
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The last knot.
    pub fn last(&self) -> Option<Knot> {
        self.knots
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .last()
            .copied()
    }
}

/// Cycle → nanosecond conversion (`ns = ((cyc - offset) * mult) >> shift`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct TscConversion {
    /// Multiplier.
    pub mult: u32,
    /// Right shift (0..=32).
    pub shift: u32,
    /// Cycles subtracted before the multiplication.
    pub offset: u64,
}

impl TscConversion {
    /// The conversion for a TSC running at `tsc_khz` kHz: the largest shift (≤ 32) whose
    /// multiplier `(10^6 << shift) / tsc_khz` fits 31 bits (trace-cmd sign-extends bit
    /// 31), offset 0.
    pub fn from_tsc_khz(tsc_khz: u64) -> Result<Self, OutputError> {
        if tsc_khz == 0 {
            return Err(OutputError::Meta(MetaError::TscKhzZero));
        }
        let mut shift = 32u32;
        loop {
            let mult = (1_000_000u128 << shift) / u128::from(tsc_khz);
            if mult <= i32::MAX as u128 {
                if mult == 0 {
                    return Err(OutputError::Meta(MetaError::TscKhzTooLarge(tsc_khz)));
                }
                return Ok(Self {
                    mult: mult as u32,
                    shift,
                    offset: 0,
                });
            }
            if shift == 0 {
                return Err(OutputError::Meta(MetaError::TscKhzTooSmall(tsc_khz)));
            }
            shift -= 1;
        }
    }

    /// The identity conversion (timestamps already in ns): mult 1, shift 0.
    pub const IDENTITY: Self = Self {
        mult: 1,
        shift: 0,
        offset: 0,
    };

    /// Converts an absolute cycle count to ns: `((cycles - offset) * mult) >> shift`.
    /// (trace-cmd ignores `offset`; the trace.dat writer only accepts 0.)
    pub fn to_ns(&self, cycles: u64) -> u64 {
        self.scale(cycles.wrapping_sub(self.offset))
    }

    /// Exactly what trace-cmd 3.1.6 computes for a TSC2NSEC option: offset ignored,
    /// `mult` sign-extended from 32 bits, low and high halves multiplied separately
    /// (wrapping). Equal to [`Self::scale`] when `mult ≤ i32::MAX` and `shift ≤ 32`.
    pub fn trace_cmd_ns(&self, ts: u64) -> u64 {
        let m = self.mult as i32 as i64 as u64;
        let shift = self.shift.min(32);
        let al = ts & 0xffff_ffff;
        let ah = ts >> 32;
        let mut r = al.wrapping_mul(m) >> shift;
        if ah != 0 {
            r = r.wrapping_add(ah.wrapping_mul(m) << (32 - shift));
        }
        r
    }

    /// Converts a duration in cycles to ns (no offset).
    pub fn scale(&self, cycles: u64) -> u64 {
        let shift = self.shift.min(63);
        ((u128::from(cycles) * u128::from(self.mult)) >> shift) as u64
    }
}

/// [`ClockMap::to_ns`] over `knots`.
fn convert(knots: &[Knot], tsc: u64) -> u64 {
    match knots.last() {
        Some(k) if tsc >= k.tsc => k.at(tsc),
        Some(_) => {
            let i = knots.partition_point(|k| k.tsc <= tsc).saturating_sub(1);
            knots.get(i).map_or(tsc, |k| k.at(tsc))
        }
        None => tsc,
    }
}

fn put_word(page: &mut [u8], at: usize, w: u32) {
    if let Some(b) = page.get_mut(at..at + 4) {
        b.copy_from_slice(&w.to_le_bytes());
    }
}

/// The delta from `prev` to `want` that fits `max` (0 if `want` is behind, `max` if
/// too far) and whether it had to be clamped.
fn fit(want: u64, prev: u64, max: u64) -> (u64, bool) {
    match want.checked_sub(prev) {
        Some(d) if d <= max => (d, false),
        Some(_) => (max, true),
        None => (0, true),
    }
}

/// Rewrites the page time and every record's time of a buffer_data_page in place so
/// that a reader adding the deltas gets `conv(raw time)` for each record. Records keep
/// their sizes (a data delta stays in its 27 bits: nanosecond deltas are smaller than
/// cycle deltas for any TSC of 1 GHz or more); a delta that cannot be encoded (times
/// going back, which only hostile stamps do, or one too large) is clamped to its field.
/// Returns how many were clamped. Stops at the first record that does not decode
/// (the page is bounded: each record advances by at least 4 bytes).
fn retime(page: &mut [u8], mut conv: impl FnMut(u64) -> u64) -> u64 {
    let Some((raw_page_ts, commit)) = page_header(page) else {
        return 0;
    };
    let page_ts = conv(raw_page_ts);
    page[..8].copy_from_slice(&page_ts.to_le_bytes());
    let end = PAGE_HEADER_SIZE
        .saturating_add((commit & COMMIT_LEN_MASK) as usize)
        .min(page.len());
    let (mut raw, mut prev, mut off, mut clamped) = (raw_page_ts, page_ts, 0usize, 0u64);
    while let Ok(Some((rec, next))) = decode_record(&page[PAGE_HEADER_SIZE..end], off) {
        let at = PAGE_HEADER_SIZE + off;
        let type_len = u32::from(page[at]) & 0x1f;
        match rec {
            Record::Data { delta, .. } => {
                raw = raw.wrapping_add(delta);
                let (d, c) = fit(conv(raw), prev, MAX_DELTA);
                put_word(page, at, header_word(type_len, d as u32));
                prev += d;
                clamped += u64::from(c);
            }
            Record::TimeExtend { delta } => {
                raw = raw.wrapping_add(delta);
                let (d, c) = fit(conv(raw), prev, MAX_EXTENDED_DELTA);
                put_word(page, at, header_word(type_len, (d & MAX_DELTA) as u32));
                put_word(page, at + 4, (d >> DELTA_BITS) as u32);
                prev += d;
                clamped += u64::from(c);
            }
            Record::TimeStamp { ts } => {
                raw = fix_abs_ts(ts, raw_page_ts);
                let abs = conv(raw) & MAX_EXTENDED_DELTA;
                put_word(page, at, header_word(type_len, (abs & MAX_DELTA) as u32));
                put_word(page, at + 4, (abs >> DELTA_BITS) as u32);
                prev = fix_abs_ts(abs, page_ts);
            }
            Record::Padding { .. } => {}
        }
        off = next;
    }
    clamped
}

/// The clock of a trace: the name recorded in the TRACECLOCK option and how raw page
/// timestamps become nanoseconds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Clock {
    /// Trace clock name (`x86-tsc` for raw guest TSC, `local` for ns clocks...).
    pub name: String,
    /// Conversion of raw timestamps; `None` means they already are ns (or are shown raw).
    pub tsc: Option<TscConversion>,
    /// Nanoseconds added (wrapping, signed) after the conversion: maps the converted
    /// guest TSC onto a host clock. trace.dat: the OFFSET option.
    pub offset_ns: i64,
    /// A run's piecewise map onto a host clock: when set, [`Self::to_ns`] converts through
    /// it (`tsc` and `offset_ns` then only describe the first segment) and files carry
    /// nanoseconds ([`Self::file_clock`], [`Self::retime_page`]).
    pub map: Option<ClockMap>,
}

impl Clock {
    /// Raw guest TSC cycles at `tsc_khz`, recorded as trace clock `x86-tsc` with a TSC2NSEC
    /// option.
    ///
    /// ```
    /// let clock = hyptrace_output::Clock::guest_tsc(2_000_000)?; // a 2 GHz TSC
    /// assert_eq!(clock.to_ns(2_000_000_000), 1_000_000_000);
    /// # Ok::<(), hyptrace_output::OutputError>(())
    /// ```
    pub fn guest_tsc(tsc_khz: u64) -> Result<Self, OutputError> {
        Ok(Self {
            name: "x86-tsc".into(),
            tsc: Some(TscConversion::from_tsc_khz(tsc_khz)?),
            offset_ns: 0,
            map: None,
        })
    }

    /// Raw guest TSC cycles shown as they are (`--clock tsc`): clock `x86-tsc` without
    /// TSC2NSEC, like `trace-cmd record -C x86-tsc`.
    pub fn raw_tsc() -> Self {
        Self {
            name: "x86-tsc".into(),
            tsc: None,
            offset_ns: 0,
            map: None,
        }
    }

    /// The same clock with `offset_ns` added after the conversion.
    pub fn with_offset_ns(mut self, offset_ns: i64) -> Self {
        self.offset_ns = offset_ns;
        self
    }

    /// Timestamps already in ns (clock `local`).
    pub fn nanoseconds() -> Self {
        Self {
            name: "local".into(),
            tsc: None,
            offset_ns: 0,
            map: None,
        }
    }

    /// The same clock converting through `map`, named `name` (the host clock: `mono`,
    /// `boot`).
    pub fn with_map(mut self, name: &str, map: ClockMap) -> Self {
        self.name = name.into();
        self.map = Some(map);
        self
    }

    /// The clock a file written with this one declares: with a map, the host clock's name
    /// and timestamps already in ns (pages go through [`Self::retime_page`]); else itself.
    pub fn file_clock(&self) -> Self {
        match self.map {
            Some(_) => Self {
                name: self.name.clone(),
                tsc: None,
                offset_ns: 0,
                map: None,
            },
            None => self.clone(),
        }
    }

    /// Rewrites an exported page's timestamps (page time, data deltas, TIME_EXTEND and
    /// TIME_STAMP records) in place from guest TSC to ns when this clock has a map, so
    /// files carry the map's times in the format of [`Self::file_clock`]; nothing
    /// without a map. Returns how many deltas had to be clamped (hostile stamps only).
    pub fn retime_page(&self, page: &mut [u8]) -> u64 {
        self.retime_page_from(page, 0)
    }

    /// [`Self::retime_page`] for a page stamped in another TSC domain: `tsc_offset` is
    /// added to each of its times before the map (e.g. a host kernel buffer recorded with
    /// trace_clock `x86-tsc`: host TSC + the run's guest − host offset).
    pub fn retime_page_from(&self, page: &mut [u8], tsc_offset: i64) -> u64 {
        self.map
            .as_ref()
            .map_or(0, |m| m.retime_page(page, tsc_offset))
    }

    /// Converts a raw page timestamp to ns (through the map if there is one; else the
    /// scaling then [`Self::offset_ns`], wrapping).
    pub fn to_ns(&self, raw: u64) -> u64 {
        if let Some(m) = &self.map {
            return m.to_ns(raw);
        }
        let ns = match &self.tsc {
            Some(t) => t.to_ns(raw),
            None => raw,
        };
        ns.wrapping_add_signed(self.offset_ns)
    }

    /// What trace-cmd 3.1.6 prints for a raw timestamp of a file with this clock:
    /// TSC2NSEC (offset ignored, see [`TscConversion::trace_cmd_ns`]) then OFFSET.
    pub fn trace_cmd_ns(&self, raw: u64) -> u64 {
        if let Some(m) = &self.map {
            // The file carries these ns (clock without TSC2NSEC): printed as they are.
            return m.to_ns(raw);
        }
        let ns = match &self.tsc {
            Some(t) => t.trace_cmd_ns(raw),
            None => raw,
        };
        ns.wrapping_add_signed(self.offset_ns)
    }

    /// Converts a duration in raw units to ns.
    pub fn duration_ns(&self, raw: u64) -> u64 {
        match &self.tsc {
            Some(t) => t.scale(raw),
            None => raw,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_khz() {
        let c = TscConversion::from_tsc_khz(2_000_000).unwrap();
        assert_eq!((c.mult, c.shift), (1 << 30, 31));
        assert_eq!(c.to_ns(2_000_000_000), 1_000_000_000);
        let c = TscConversion::from_tsc_khz(1_000_000).unwrap();
        assert_eq!(c.to_ns(123_456_789_012), 123_456_789_012);
        let c = TscConversion::from_tsc_khz(2_918_400).unwrap();
        let ns = c.to_ns(2_918_400_000 * 10);
        assert!(ns.abs_diff(10_000_000_000) < 10, "{ns}");
        let c = TscConversion::from_tsc_khz(1).unwrap();
        assert_eq!(c.to_ns(5), 5_000_000);
        assert!(TscConversion::from_tsc_khz(0).is_err());
        assert!(TscConversion::from_tsc_khz(u64::MAX).is_err());
    }

    #[test]
    fn offset_is_added_after_scaling() {
        let c = Clock::guest_tsc(2_000_000).unwrap().with_offset_ns(-500);
        assert_eq!(c.to_ns(2_000), 500);
        assert_eq!(c.trace_cmd_ns(2_000), 500);
        assert_eq!(c.duration_ns(2_000), 1_000);
        let c = Clock::raw_tsc();
        assert_eq!(c.to_ns(123_456), 123_456);
        assert_eq!(Clock::nanoseconds().with_offset_ns(7).to_ns(1), 8);
        // Wrapping, never a panic, on any guest value.
        let c = Clock::guest_tsc(1_000_000)
            .unwrap()
            .with_offset_ns(i64::MIN);
        let _ = c.to_ns(u64::MAX);
    }

    /// A 2 GHz map starting at TSC 1000 = 5000 ns, a knot appended at 3000.
    fn two_knot_map() -> ClockMap {
        let m = ClockMap::new(Knot {
            tsc: 1_000,
            ns: 5_000,
            slope: 1 << (SLOPE_SHIFT - 1),
        });
        let k = m.extend(|| 3_000, |_, _| 3 << (SLOPE_SHIFT - 2)).unwrap();
        assert_eq!(
            (k.tsc, k.ns),
            (3_000, 6_000),
            "the knot starts on the current line"
        );
        m
    }

    #[test]
    fn map_is_continuous_and_knots_only_extend() {
        let m = two_knot_map();
        assert_eq!(m.to_ns(1_000), 5_000);
        assert_eq!(m.to_ns(2_000), 5_500);
        assert_eq!(m.to_ns(998), 4_999); // the first segment, extended backwards
        assert_eq!(m.to_ns(3_000), 6_000);
        assert_eq!(m.to_ns(3_004), 6_003);
        assert!(
            m.extend(|| 3_000, |_, _| 1).is_none(),
            "not after the last knot"
        );
        assert_eq!(m.knots().len(), 2);
        let c = Clock::guest_tsc(2_000_000)
            .unwrap()
            .with_map("mono", m.clone());
        assert_eq!(c.to_ns(2_000), 5_500);
        assert_eq!(c.trace_cmd_ns(2_000), 5_500);
        let f = c.file_clock();
        assert_eq!(
            (f.name.as_str(), f.tsc, f.offset_ns, f.map),
            ("mono", None, 0, None)
        );
        // Wrapping, never a panic.
        let _ = (m.to_ns(0), m.to_ns(u64::MAX));
    }

    /// A page with a data event, a TIME_EXTEND, a long data event and a TIME_STAMP:
    /// after retiming, a reader adding the deltas gets the map's value of each raw time.
    #[test]
    fn retime_rewrites_every_time_of_a_page() {
        use hyptrace_abi::page::{encode_data_header, encode_time_extend, Events, TYPE_TIME_STAMP};
        let m = two_knot_map();
        let clock = Clock::guest_tsc(2_000_000)
            .unwrap()
            .with_map("mono", m.clone());
        let mut page = vec![0u8; 512];
        let mut data = Vec::new();
        let mut hdr = [0u8; 8];
        let n = encode_data_header(&mut hdr, 8, 100);
        data.extend_from_slice(&hdr[..n]);
        data.extend_from_slice(&[1; 8]);
        data.extend_from_slice(&encode_time_extend(MAX_DELTA + 5));
        let n = encode_data_header(&mut hdr, 200, 7);
        data.extend_from_slice(&hdr[..n]);
        data.extend_from_slice(&[2; 200]);
        let abs: u64 = (1 << 40) + 1_000;
        data.extend_from_slice(
            &header_word(TYPE_TIME_STAMP, (abs & MAX_DELTA) as u32).to_le_bytes(),
        );
        data.extend_from_slice(&((abs >> DELTA_BITS) as u32).to_le_bytes());
        let n = encode_data_header(&mut hdr, 4, 3);
        data.extend_from_slice(&hdr[..n]);
        data.extend_from_slice(&[3; 4]);
        let data = &data[..];
        page[..8].copy_from_slice(&2_000u64.to_le_bytes());
        page[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
        page[16..16 + data.len()].copy_from_slice(data);
        let raw: Vec<u64> = Events::new(data, 2_000).map(|e| e.unwrap().ts).collect();
        assert_eq!(raw.len(), 3);
        assert_eq!(clock.retime_page(&mut page), 0);
        let (ts, _) = page_header(&page).unwrap();
        assert_eq!(ts, m.to_ns(2_000));
        let got: Vec<u64> = Events::new(&page[16..16 + data.len()], ts)
            .map(|e| e.unwrap().ts)
            .collect();
        let want: Vec<u64> = raw.iter().map(|&t| m.to_ns(t)).collect();
        assert_eq!(got, want);
        // The same page stamped 1000 cycles behind, retimed with that offset: same times.
        let mut behind = vec![0u8; 512];
        behind[..8].copy_from_slice(&1_000u64.to_le_bytes());
        behind[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
        behind[16..16 + data.len()].copy_from_slice(data);
        let abs_behind = abs - 1_000;
        let ts_at = 16 + data.len() - 16;
        behind[ts_at..ts_at + 4].copy_from_slice(
            &header_word(TYPE_TIME_STAMP, (abs_behind & MAX_DELTA) as u32).to_le_bytes(),
        );
        behind[ts_at + 4..ts_at + 8]
            .copy_from_slice(&((abs_behind >> DELTA_BITS) as u32).to_le_bytes());
        assert_eq!(clock.retime_page_from(&mut behind, 1_000), 0);
        assert_eq!(behind, page);
        // Payloads untouched; a clock without a map leaves the page alone.
        assert_eq!(&page[20..28], &[1; 8]);
        let before = page.clone();
        assert_eq!(
            Clock::guest_tsc(2_000_000).unwrap().retime_page(&mut page),
            0
        );
        assert_eq!(page, before);
    }

    /// Hostile times going back are clamped (delta 0), never a panic or a wrap.
    #[test]
    fn retime_clamps_times_going_back() {
        let m = two_knot_map();
        let clock = Clock::raw_tsc().with_map("mono", m);
        let mut page = vec![0u8; 64];
        // Page time near u64::MAX, one event whose delta wraps the raw time past 0.
        page[..8].copy_from_slice(&(u64::MAX - 1).to_le_bytes());
        page[8..16].copy_from_slice(&8u64.to_le_bytes());
        page[16..20].copy_from_slice(&header_word(1, 10).to_le_bytes());
        assert_eq!(clock.retime_page(&mut page), 1);
        // A truncated page: nothing read past it.
        let mut short = vec![0u8; 8];
        assert_eq!(clock.retime_page(&mut short), 0);
    }

    #[test]
    fn matches_split_multiplication() {
        // trace-cmd's mul_u64_u32_shr: low and high 32-bit halves multiplied separately.
        fn split(a: u64, mul: u32, shift: u32) -> u64 {
            let al = a & 0xffff_ffff;
            let ah = a >> 32;
            let mut r = (al * u64::from(mul)) >> shift;
            if ah != 0 {
                r = r.wrapping_add((ah * u64::from(mul)) << (32 - shift));
            }
            r
        }
        let c = TscConversion::from_tsc_khz(2_918_400).unwrap();
        for a in [
            0u64,
            1,
            0xffff_ffff,
            0x1_0000_0000,
            0x1234_5678_9abc_def0,
            u64::MAX / 3,
        ] {
            assert_eq!(c.scale(a), split(a, c.mult, c.shift), "{a:#x}");
            assert_eq!(c.trace_cmd_ns(a), c.scale(a), "{a:#x}");
        }
        // Observed with trace-cmd 3.1.6: mult 2^31, shift 30 turns 1e9 into 15179869184.
        let bad = TscConversion {
            mult: 1 << 31,
            shift: 30,
            offset: 0,
        };
        assert_eq!(bad.trace_cmd_ns(1_000_000_000), 15_179_869_184);
        for khz in [
            1u64, 999, 1_000_000, 2_000_000, 2_918_400, 4_000_000, 10_000_000,
        ] {
            assert!(TscConversion::from_tsc_khz(khz).unwrap().mult <= i32::MAX as u32);
        }
    }
}
