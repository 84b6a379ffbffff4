//! The standby drainer: a second thread that drains the rings while the drain loop is
//! late.
//!
//! **Why.** The drain loop's thread can be held off its core for milliseconds while a
//! vCPU writes on: here by the hypervisor below this machine (its steal counter rises),
//! elsewhere by an interrupt storm or a thread of higher priority. A 1 MiB ring lasts
//! 2.3 ms at 16 M events/s, so such a stall loses events however fast the loop drains
//! once it runs again. Nothing on the loop's own CPU can help; a thread on another CPU
//! can.
//!
//! **How.** Every round the drain loop publishes a [`Beat`]: when it means to wake
//! next, how long the fastest writer's ring takes to fill at its recent rate
//! ([`crate::session::Session::fill_time`]), and which CPU it runs on. The standby
//! thread runs with the same scheduling advantage as the loop
//! ([`ReaderPriority`]), on every CPU it may use except the loop's, and checks every
//! quarter of the fill time (at least [`MIN_PERIOD`] apart). When the loop is more than
//! a quarter of the fill time past its planned wake-up ([`Beat::late_at`]), the
//! standby takes the session's lock — only if it is free: a loop held off in the middle
//! of a round holds it — and drains ([`crate::session::Session::relieve`]). So a
//! stall is caught at most three quarters of a fill time after the loop's last round,
//! while the ring still has room. While no writer writes, or writes so slowly that the
//! loop's own idle period is short against the fill time, the standby sleeps until the
//! loop wakes it: an idle VM costs it nothing.
//!
//! **Invariant D1** (docs/design.md, "The standby drainer"): one drainer at a time —
//! every read of the rings and every write of the output happens under the session's
//! lock. The standby never ends a CPU (final walks stay with the loop, which knows which
//! vCPUs stopped), never reads while `hold` says so (a crash waits for its dump, a vCPU
//! ended, a stop was asked for), and is stopped and joined before the loop returns.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::session::{thread_cpu_time, ReaderPriority};

/// Shortest time between two checks of the standby: bounds what it costs the vCPU
/// whose core it shares (a wake-up preempts that vCPU) while a fast writer writes.
pub const MIN_PERIOD: Duration = Duration::from_micros(250);
/// Longest one turn of the standby drains before it lets the drain loop (blocked on
/// the lock meanwhile) have the session back.
pub const TURN_BUDGET: Duration = Duration::from_millis(5);

/// What the drain loop tells the standby every round (all atomics: read without a lock;
/// each value is only a hint for when to look, the session's lock orders the draining).
#[derive(Debug)]
pub struct Beat {
    epoch: Instant,
    /// When the loop means to wake next, in ns since `epoch`.
    due_ns: AtomicU64,
    /// The fill time of the fastest writer's ring in ns; `u64::MAX` while none writes.
    fill_ns: AtomicU64,
    /// The CPU the loop ran its last round on (-1: unknown).
    cpu: AtomicI32,
    /// The loop's idle period (`--poll-ms`) in ns.
    idle_ns: u64,
    stop: AtomicBool,
    /// The standby is asleep until woken (no writer writes fast enough to watch).
    asleep: AtomicBool,
    turns: AtomicU64,
    rounds: AtomicU64,
}

impl Beat {
    /// A beat for a loop whose idle period is `idle`, due now.
    pub fn new(idle: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            due_ns: AtomicU64::new(0),
            fill_ns: AtomicU64::new(u64::MAX),
            cpu: AtomicI32::new(-1),
            idle_ns: nanos(idle),
            stop: AtomicBool::new(false),
            asleep: AtomicBool::new(false),
            turns: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
        }
    }

    fn since_epoch(&self, t: Instant) -> u64 {
        nanos(t.saturating_duration_since(self.epoch))
    }

    /// The loop's round at `now`: it means to wake after `wait`; `fill` is its writers'
    /// fill time ([`crate::session::Session::fill_time`]).
    fn publish(&self, now: Instant, wait: Duration, fill: Option<Duration>, cpu: i32) {
        self.due_ns
            .store(self.since_epoch(now).saturating_add(nanos(wait)), Relaxed);
        self.fill_ns.store(fill.map_or(u64::MAX, nanos), Relaxed);
        self.cpu.store(cpu, Relaxed);
    }

    /// How often the standby looks now: `None` while there is nothing to watch (no
    /// writer writes, or its ring takes so long to fill that the loop's own idle period
    /// is within a quarter of it).
    pub fn period(&self) -> Option<Duration> {
        let quarter = self.fill_ns.load(Relaxed) / 4;
        (quarter < self.idle_ns).then(|| Duration::from_nanos(quarter).max(MIN_PERIOD))
    }

    /// Whether the loop is late at `now`: more than a quarter of the fill time past its
    /// planned wake-up while a writer writes.
    pub fn late_at(&self, now: Instant) -> bool {
        let fill = self.fill_ns.load(Relaxed);
        if fill == u64::MAX {
            return false;
        }
        let due = self.due_ns.load(Relaxed);
        self.since_epoch(now) > due.saturating_add(fill / 4)
    }

    /// Turns the standby took, and the drain rounds it ran in them.
    pub fn taken(&self) -> (u64, u64) {
        (self.turns.load(Relaxed), self.rounds.load(Relaxed))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The standby thread of one drain loop (see the module).
#[derive(Debug)]
pub struct Standby {
    beat: Arc<Beat>,
    /// Returns the CPU time the thread used.
    thread: Option<JoinHandle<Duration>>,
}

/// What a standby did in a run ([`Standby::stop`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StandbyTimes {
    /// Turns it took while the loop was late.
    pub turns: u64,
    /// Drain rounds it ran in them.
    pub rounds: u64,
    /// CPU time its thread used (waking up to look included).
    pub cpu: Duration,
}

impl Standby {
    /// Whether a standby can help here: the process may run on at least two CPUs, and
    /// the environment does not say `HYPTRACE_STANDBY=off`.
    pub fn wanted() -> bool {
        if std::env::var_os("HYPTRACE_STANDBY").is_some_and(|v| v == "off") {
            log::debug!("standby drainer: off (HYPTRACE_STANDBY=off)");
            return false;
        }
        std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
    }

    /// Starts the standby of a loop with idle period `idle` over `session`: when the
    /// loop is late it calls `relieve` (which returns the drain rounds it ran) with the
    /// session locked, unless `hold()`.
    pub fn start<S: Send + 'static>(
        session: Arc<Mutex<S>>,
        idle: Duration,
        mut relieve: impl FnMut(&mut S) -> u64 + Send + 'static,
        hold: impl Fn() -> bool + Send + 'static,
    ) -> std::io::Result<Self> {
        let beat = Arc::new(Beat::new(idle));
        let b = Arc::clone(&beat);
        let thread = std::thread::Builder::new()
            .name("hyptrace-standby".into())
            .spawn(move || {
                let mut priority = ReaderPriority::raise();
                let mut place = Placement::new();
                while !b.stop.load(Relaxed) {
                    let Some(period) = b.period() else {
                        // Nothing to watch: sleep until the loop sees a writer again
                        // (`beat`) or stops. The flag is set before the check, so a
                        // wake-up between them is not lost (park returns at once
                        // after an unpark).
                        priority.set_active(false);
                        b.asleep.store(true, Relaxed);
                        if b.period().is_none() && !b.stop.load(Relaxed) {
                            std::thread::park();
                        }
                        b.asleep.store(false, Relaxed);
                        continue;
                    };
                    priority.set_active(true);
                    std::thread::park_timeout(period);
                    place.away_from(b.cpu.load(Relaxed));
                    if b.stop.load(Relaxed) || !b.late_at(Instant::now()) || hold() {
                        continue;
                    }
                    let mut s = match session.try_lock() {
                        Ok(s) => s,
                        // The loop panicked while it held the lock: the run fails
                        // anyway; draining on keeps nothing wrong.
                        Err(TryLockError::Poisoned(p)) => p.into_inner(),
                        // The loop holds it: it runs (or was held off mid-round).
                        Err(TryLockError::WouldBlock) => continue,
                    };
                    let rounds = relieve(&mut s);
                    drop(s);
                    b.turns.fetch_add(1, Relaxed);
                    b.rounds.fetch_add(rounds, Relaxed);
                }
                thread_cpu_time()
            })?;
        Ok(Self {
            beat,
            thread: Some(thread),
        })
    }

    /// The drain loop's round at `now`, before it sleeps `wait`; `fill` is
    /// [`crate::session::Session::fill_time`]. Wakes the standby when there is a writer
    /// to watch again.
    pub fn beat(&self, now: Instant, wait: Duration, fill: Option<Duration>) {
        self.beat.publish(now, wait, fill, current_cpu());
        if self.beat.asleep.load(Relaxed) && self.beat.period().is_some() {
            if let Some(t) = &self.thread {
                t.thread().unpark();
            }
        }
    }

    /// What the standby did so far: turns taken, drain rounds run in them.
    pub fn taken(&self) -> (u64, u64) {
        self.beat.taken()
    }

    /// Stops the thread and waits for it (at most one turn, [`TURN_BUDGET`], plus a
    /// wake-up); a panic in it is passed on.
    pub fn stop(mut self) -> StandbyTimes {
        let cpu = self.halt(true);
        let (turns, rounds) = self.beat.taken();
        StandbyTimes { turns, rounds, cpu }
    }

    /// Stops and joins the thread (once); passes a panic in it on if `propagate`.
    fn halt(&mut self, propagate: bool) -> Duration {
        self.beat.stop.store(true, Relaxed);
        let Some(t) = self.thread.take() else {
            return Duration::ZERO;
        };
        t.thread().unpark();
        match t.join() {
            Ok(cpu) => cpu,
            Err(p) if propagate => std::panic::resume_unwind(p),
            Err(_) => Duration::ZERO,
        }
    }
}

impl Drop for Standby {
    /// Stops the thread (an early return of the loop, a panic): never left running.
    /// While the caller is already panicking, a panic of the thread is not raised on
    /// top of it.
    fn drop(&mut self) {
        self.halt(!std::thread::panicking());
    }
}

/// The CPU the calling thread runs on (-1 if unknown).
fn current_cpu() -> i32 {
    // SAFETY: sched_getcpu has no preconditions; it returns -1 on failure.
    unsafe { libc::sched_getcpu() }
}

/// Keeps the standby thread off the drain loop's CPU: on every CPU the thread was
/// allowed at its start except that one. A system call only when the loop's CPU
/// changed; nothing when excluding it would leave no CPU.
struct Placement {
    allowed: Option<libc::cpu_set_t>,
    away_from: i32,
}

impl Placement {
    fn new() -> Self {
        // SAFETY: cpu_set_t is plain data (all zeros is the empty set); getaffinity of
        // the calling thread (pid 0) writes at most `size_of::<cpu_set_t>()` bytes into
        // the set we own.
        let allowed = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0)
                .then_some(set)
        };
        Self {
            allowed,
            away_from: -1,
        }
    }

    fn away_from(&mut self, cpu: i32) {
        let Some(allowed) = self.allowed else { return };
        let Ok(c) = usize::try_from(cpu) else { return };
        if cpu == self.away_from || c >= libc::CPU_SETSIZE as usize {
            return;
        }
        self.away_from = cpu;
        let mut set = allowed;
        // SAFETY: CPU_CLR and CPU_COUNT on a set we own; `c < CPU_SETSIZE` (checked
        // above), the bit index the set holds. Then setaffinity of the calling thread
        // (pid 0) from that set, of its own size.
        let ok = unsafe {
            libc::CPU_CLR(c, &mut set);
            if libc::CPU_COUNT(&set) == 0 {
                return;
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        };
        if !ok {
            log::debug!(
                "standby drainer: could not move off cpu {cpu}: {}",
                std::io::Error::last_os_error()
            );
            self.allowed = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_is_a_quarter_fill_past_the_planned_wake_up() {
        let b = Beat::new(Duration::from_millis(5));
        let t0 = b.epoch + Duration::from_millis(10);
        // No writer: never late, nothing to watch.
        b.publish(t0, Duration::from_millis(1), None, 0);
        assert!(!b.late_at(t0 + Duration::from_secs(60)));
        assert_eq!(b.period(), None);
        // A ring that fills in 4 ms: due at +1 ms, late past +2 ms.
        b.publish(
            t0,
            Duration::from_millis(1),
            Some(Duration::from_millis(4)),
            0,
        );
        assert!(!b.late_at(t0 + Duration::from_micros(1999)));
        assert!(b.late_at(t0 + Duration::from_micros(2001)));
        assert_eq!(b.period(), Some(Duration::from_millis(1)));
        // A very fast writer: checks no closer than MIN_PERIOD.
        b.publish(t0, Duration::ZERO, Some(Duration::from_micros(100)), 0);
        assert_eq!(b.period(), Some(MIN_PERIOD));
        // A slow one (a quarter fill beyond the loop's idle period): nothing to watch.
        b.publish(
            t0,
            Duration::from_millis(5),
            Some(Duration::from_millis(40)),
            0,
        );
        assert_eq!(b.period(), None);
        assert!(!b.late_at(t0 + Duration::from_millis(14)));
        assert!(b.late_at(t0 + Duration::from_millis(16)));
    }
}
