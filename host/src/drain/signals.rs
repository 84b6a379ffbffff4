//! Ctrl-C (SIGINT) and SIGTERM: the first stops a run cleanly, a second one later
//! aborts it, a third exits at once. Decided in the signal handler (async-signal-safe),
//! read by the run loop ([`crate::pipeline::run`]).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::exit::EXIT_ABORT;

/// The signal handlers could not be installed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot install the signal handlers")]
pub struct SignalError(#[source] Arc<std::io::Error>);

/// Signals that arrive within this time of the one that started a stop (or an abort)
/// count as that one: `timeout` signals the process and then its process group, so one
/// `timeout -s INT` delivers two SIGINTs at once, and a terminal's Ctrl-C reaches every
/// process of a pipeline.
pub const SIGNAL_BURST: Duration = Duration::from_millis(500);

/// What Ctrl-C (SIGINT) and SIGTERM asked for. Decided in the signal handler itself,
/// with the time the signal arrived (not when a thread got around to it), using only
/// async-signal-safe operations (atomics, `clock_gettime`, `write`, `_exit`):
/// 1. the first signal: stop cleanly (the vCPUs stop, everything committed is read and
///    written out, exit 0); `hyptrace: stopping… (Ctrl-C again to abort)` on stderr;
/// 2. a second one, later than [`SIGNAL_BURST`]: abort — the run returns at once without
///    finishing its output, which drops the sinks: their temporary and spill files are
///    removed, no output file appears; exit 130;
/// 3. a third one (the process did not manage to return): exit 130 immediately.
#[derive(Debug, Default)]
pub struct Interrupts {
    /// CLOCK_MONOTONIC ns (at least 1) of the signal that asked for the stop; 0: none.
    stop_at: AtomicU64,
    /// The same for the abort.
    abort_at: AtomicU64,
    signal: AtomicI32,
    tty: AtomicBool,
}

/// What a signal does, given the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SignalAction {
    /// The first: stop cleanly.
    Stop,
    /// Within [`SIGNAL_BURST`] of the stop or the abort: part of it.
    Burst,
    /// Abort.
    Abort,
    /// Exit at once.
    Exit,
}

impl Interrupts {
    /// Installs the handlers (once per process) and returns the shared state.
    pub fn install() -> Result<&'static Interrupts, SignalError> {
        static STATE: std::sync::OnceLock<Result<&'static Interrupts, SignalError>> =
            std::sync::OnceLock::new();
        STATE
            .get_or_init(|| {
                use signal_hook::consts::{SIGINT, SIGTERM};
                let state: &'static Interrupts = Box::leak(Box::default());
                state
                    .tty
                    .store(std::io::stderr().is_terminal(), Ordering::SeqCst);
                for sig in [SIGINT, SIGTERM] {
                    let handler = move || state.handle(sig, monotonic_ns());
                    // SAFETY: `handle` is async-signal-safe: it uses atomics,
                    // `write(2)` on fd 2 with static bytes and `_exit(2)`; no allocation,
                    // no lock, no `std::io`.
                    unsafe { signal_hook::low_level::register(sig, handler) }
                        .map_err(|e| SignalError(Arc::new(e)))?;
                }
                Ok(state)
            })
            .clone()
    }

    /// In the signal handler: decide, say so on stderr, exit on a third signal.
    fn handle(&self, sig: i32, now_ns: u64) {
        let action = self.on_signal(sig, now_ns);
        let msg: &[u8] = match action {
            SignalAction::Burst => return,
            SignalAction::Stop => "hyptrace: stopping… (Ctrl-C again to abort)\n".as_bytes(),
            SignalAction::Abort => {
                b"hyptrace: aborting: removing temporary files (Ctrl-C again to exit at once)\n"
            }
            SignalAction::Exit => b"hyptrace: exiting at once; temporary files may remain\n",
        };
        if self.tty.load(Ordering::Relaxed) {
            write_stderr_raw(b"\r\x1b[K");
        }
        write_stderr_raw(msg);
        if action == SignalAction::Exit {
            // SAFETY: `_exit` is async-signal-safe and ends the process.
            unsafe { libc::_exit(EXIT_ABORT) };
        }
    }

    /// The decision for a signal `sig` arriving at `now_ns` (CLOCK_MONOTONIC).
    fn on_signal(&self, sig: i32, now_ns: u64) -> SignalAction {
        let now = now_ns.clamp(1, u64::MAX - 1);
        let window = SIGNAL_BURST.as_nanos() as u64;
        let sc = Ordering::SeqCst;
        match self.stop_at.compare_exchange(0, now, sc, sc) {
            Ok(_) => {
                self.signal.store(sig, sc);
                return SignalAction::Stop;
            }
            Err(at) if now.saturating_sub(at) < window => return SignalAction::Burst,
            Err(_) => {}
        }
        match self.abort_at.compare_exchange(0, now, sc, sc) {
            Ok(_) => SignalAction::Abort,
            Err(at) if at == u64::MAX || now.saturating_sub(at) < window => SignalAction::Burst,
            Err(at) => {
                if self.abort_at.compare_exchange(at, u64::MAX, sc, sc).is_ok() {
                    SignalAction::Exit
                } else {
                    SignalAction::Burst
                }
            }
        }
    }

    /// A clean stop was asked for.
    pub fn stop_requested(&self) -> bool {
        self.stop_at.load(Ordering::SeqCst) != 0
    }

    /// An abort was asked for.
    pub fn aborted(&self) -> bool {
        self.abort_at.load(Ordering::SeqCst) != 0
    }

    /// How many of the stop and the abort were asked for (0 to 2): changes with each
    /// signal that is not part of a burst.
    pub fn signals(&self) -> u64 {
        u64::from(self.stop_requested()) + u64::from(self.aborted())
    }

    /// The name of the signal that asked for the stop (`SIGINT`, `SIGTERM`).
    pub fn signal_name(&self) -> &'static str {
        match self.signal.load(Ordering::SeqCst) {
            signal_hook::consts::SIGTERM => "SIGTERM",
            _ => "SIGINT",
        }
    }
}

/// CLOCK_MONOTONIC in ns (async-signal-safe).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; clock_gettime is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// `write(2)` to stderr, result ignored (async-signal-safe).
fn write_stderr_raw(b: &[u8]) {
    // SAFETY: `b` is valid for `b.len()` bytes for the duration of the call.
    let _ = unsafe { libc::write(2, b.as_ptr().cast(), b.len()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Signals within SIGNAL_BURST of the first count as one; a later one aborts; a
    /// third, later still, exits.
    #[test]
    fn signal_bursts() {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let st = Interrupts::default();
        let w = SIGNAL_BURST.as_nanos() as u64;
        let t0 = 5_000_000_000u64;
        assert_eq!(st.on_signal(SIGTERM, t0), SignalAction::Stop);
        assert!(st.stop_requested() && !st.aborted());
        assert_eq!(st.signal_name(), "SIGTERM");
        // `timeout` signals the process, then its group.
        assert_eq!(st.on_signal(SIGINT, t0), SignalAction::Burst);
        assert_eq!(st.on_signal(SIGINT, t0 + w - 1), SignalAction::Burst);
        assert_eq!(
            st.on_signal(SIGINT, t0 - 10),
            SignalAction::Burst,
            "handlers race"
        );
        assert!(!st.aborted());
        assert_eq!(st.signal_name(), "SIGTERM");
        assert_eq!(st.on_signal(SIGINT, t0 + w), SignalAction::Abort);
        assert!(st.aborted());
        assert_eq!(st.on_signal(SIGINT, t0 + w + w / 2), SignalAction::Burst);
        assert_eq!(st.on_signal(SIGINT, t0 + 3 * w), SignalAction::Exit);
        assert_eq!(st.on_signal(SIGINT, t0 + 9 * w), SignalAction::Burst);
        assert!(monotonic_ns() > 0);
    }
}
