//! Who wrote a row: the host, the VM, the run; and the run clock's wall-clock offset.

use std::io::Read;

/// The names on every row of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunIdentity {
    /// The host name (`gethostname`).
    pub host: String,
    /// The VM: the URL's `?vm=NAME`, else `HOST-PID` (the VMM's pid).
    pub vm: String,
    /// A run id unique per run: 32 hex digits, 128 random bits.
    pub run: String,
}

/// Longest host name kept.
const MAX_HOST: usize = 255;

/// This machine's host name (`unknown` if it has none).
pub fn hostname() -> String {
    let mut b = [0u8; MAX_HOST + 1];
    // SAFETY: `b` is writable for its whole length, which is what is passed.
    let r = unsafe { libc::gethostname(b.as_mut_ptr().cast(), b.len()) };
    let n = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    match (r, &b[..n]) {
        (0, h) if !h.is_empty() => String::from_utf8_lossy(h).into_owned(),
        _ => "unknown".into(),
    }
}

/// 128 random bits as hex: from `/dev/urandom`, else (no such device) the time and pid
/// hashed with std's randomly keyed hasher.
fn run_id() -> String {
    let mut b = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok();
    if !ok {
        use std::hash::{BuildHasher, Hasher};
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        for (i, half) in b.chunks_mut(8).enumerate() {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(t);
            h.write_u32(std::process::id());
            h.write_usize(i);
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl RunIdentity {
    /// This run's identity: the VM named `vm` if given.
    pub fn new(vm: Option<&str>) -> Self {
        let host = hostname();
        let vm = vm.map_or_else(|| format!("{host}-{}", std::process::id()), str::to_string);
        Self {
            host,
            vm,
            run: run_id(),
        }
    }
}

fn clock_ns(id: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to.
    unsafe { libc::clock_gettime(id, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// What to add to a time on the host clock `clock` (a [`hyptrace_output::Clock`]'s
/// name: `mono` or `boot`) to get the Unix time in ns, read once now; `None` for any
/// other clock (raw TSC: no wall time).
pub fn unix_offset(clock: &str) -> Option<i64> {
    let id = match clock {
        "mono" => libc::CLOCK_MONOTONIC,
        "boot" => libc::CLOCK_BOOTTIME,
        _ => return None,
    };
    // Read between two wall-clock reads: the midpoint is the wall time of the read.
    let a = clock_ns(libc::CLOCK_REALTIME);
    let c = clock_ns(id);
    let b = clock_ns(libc::CLOCK_REALTIME);
    i64::try_from((a + b) / 2 - c).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_differ_and_offsets_are_wall_time() {
        let a = RunIdentity::new(None);
        let b = RunIdentity::new(Some("vm1"));
        assert_ne!(a.run, b.run);
        assert_eq!(a.run.len(), 32);
        assert_eq!(b.vm, "vm1");
        assert!(a.vm.ends_with(&format!("-{}", std::process::id())));
        let off = unix_offset("mono").unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i128;
        let mono = clock_ns(libc::CLOCK_MONOTONIC);
        assert!((mono + i128::from(off) - now).abs() < 1_000_000_000);
        assert_eq!(unix_offset("x86-tsc"), None);
    }
}
