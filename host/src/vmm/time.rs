//! The host clocks a run can put its events on ([`ClockKind`]) and reading them.

/// The clock every output uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClockKind {
    /// Host `CLOCK_MONOTONIC` (what `clock_gettime`, `perf` and trace-cmd's `mono` use).
    #[default]
    Mono,
    /// Host `CLOCK_BOOTTIME` (monotonic + time suspended).
    Boot,
    /// Raw guest TSC cycles, unconverted (like trace-cmd's `x86-tsc` clock without
    /// TSC2NSEC).
    Tsc,
}

impl ClockKind {
    /// Lower-case name (`--stats`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Mono => "mono",
            Self::Boot => "boot",
            Self::Tsc => "tsc",
        }
    }

    pub fn clockid(self) -> Option<libc::clockid_t> {
        match self {
            Self::Mono => Some(libc::CLOCK_MONOTONIC),
            Self::Boot => Some(libc::CLOCK_BOOTTIME),
            Self::Tsc => None,
        }
    }
}

/// Reads a host clock in ns.
pub fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call; the clock
    // ids used here exist on every supported kernel (the result is checked).
    let r = unsafe { libc::clock_gettime(id, &mut ts) };
    if r != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Host `CLOCK_MONOTONIC` in ns.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// Host `CLOCK_BOOTTIME` in ns.
pub fn boottime_ns() -> u64 {
    clock_ns(libc::CLOCK_BOOTTIME)
}

/// Host TSC now.
pub fn host_tsc() -> u64 {
    // SAFETY: `rdtsc` has no preconditions on x86-64 (it only reads the counter).
    unsafe { core::arch::x86_64::_rdtsc() }
}
