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

use crate::OutputError;

/// Cycle → nanosecond conversion (`ns = ((cyc - offset) * mult) >> shift`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
            return Err(OutputError::BadMeta("tsc_khz is 0".into()));
        }
        let mut shift = 32u32;
        loop {
            let mult = (1_000_000u128 << shift) / u128::from(tsc_khz);
            if mult <= i32::MAX as u128 {
                if mult == 0 {
                    return Err(OutputError::BadMeta(format!("tsc_khz {tsc_khz} too large")));
                }
                return Ok(Self {
                    mult: mult as u32,
                    shift,
                    offset: 0,
                });
            }
            if shift == 0 {
                return Err(OutputError::BadMeta(format!("tsc_khz {tsc_khz} too small")));
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
        })
    }

    /// Raw guest TSC cycles shown as they are (`--clock tsc`): clock `x86-tsc` without
    /// TSC2NSEC, like `trace-cmd record -C x86-tsc`.
    pub fn raw_tsc() -> Self {
        Self {
            name: "x86-tsc".into(),
            tsc: None,
            offset_ns: 0,
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
        }
    }

    /// Converts a raw page timestamp to ns (then adds [`Self::offset_ns`], wrapping).
    pub fn to_ns(&self, raw: u64) -> u64 {
        let ns = match &self.tsc {
            Some(t) => t.to_ns(raw),
            None => raw,
        };
        ns.wrapping_add_signed(self.offset_ns)
    }

    /// What trace-cmd 3.1.6 prints for a raw timestamp of a file with this clock:
    /// TSC2NSEC (offset ignored, see [`TscConversion::trace_cmd_ns`]) then OFFSET.
    pub fn trace_cmd_ns(&self, raw: u64) -> u64 {
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
