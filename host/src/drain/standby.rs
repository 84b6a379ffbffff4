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
//! ([`crate::drain::session::Session::fill_time`]), and which CPU it runs on. The standby
//! thread runs with the same scheduling advantage as the loop
//! ([`ReaderPriority`]), on every CPU it may use except the loop's, and looks every
//! quarter of the fill time: at least [`CALM_PERIOD`] apart, or [`MIN_PERIOD`] for
//! [`ALERT_FOR`] after the loop was late (each look preempts a vCPU, which costs it
//! dearly here, so it looks closely only in phases of stalls). When the loop is more than
//! a quarter of the fill time past its planned wake-up ([`Beat::late_at`]), the
//! standby takes the session's lock — only if it is free: a loop held off in the middle
//! of a round holds it — and drains ([`crate::drain::session::Session::relieve`]). So a
//! stall is caught within three quarters of a fill time after the loop's last round
//! (plus the floor of the look period), while the ring still has room at the rates
//! where the floor is short against the fill time. While no writer writes, or writes
//! so slowly that the loop's own idle period is short against the fill time, the
//! standby sleeps until the loop wakes it: an idle VM costs it only its looks in the
//! loop's first 100 ms, while the loop assumes a fast writer.
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

use crate::drain::priority::{thread_cpu_time, ReaderPriority};

/// Shortest time between two looks of the standby while it is alert (the loop was
/// late lately, [`ALERT_FOR`]): bounds what it costs the vCPU whose core it shares. A
/// look preempts that vCPU, and on this PVM machine a vCPU preempted once loses about
/// 100 µs of its writing (measured: the writer's whole-loop mean rose 10 % with a look
/// every 1 ms, 43 % with one every 250 µs).
pub const MIN_PERIOD: Duration = Duration::from_millis(1);
/// Shortest time between two looks while the loop has been on time for [`ALERT_FOR`]:
/// about 2.5 % of a flat-out vCPU here.
pub const CALM_PERIOD: Duration = Duration::from_millis(4);
/// How long the standby stays alert after the loop was late (its wake-up more than half
/// a fill time past its plan, whether it woke by itself or the standby took a turn).
/// The stalls seen here come in phases, a few seconds apart.
pub const ALERT_FOR: Duration = Duration::from_secs(10);
/// Lateness in the loop's first this long does not make the standby alert: the loop's
/// rate estimate starts high on purpose (`session::START_RATE`), so its fill time is
/// short and every wake-up looks late.
pub const WARM_UP: Duration = Duration::from_millis(100);
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
    /// Alert until this time (ns since `epoch`; 0: calm): look every [`MIN_PERIOD`].
    alert_until_ns: AtomicU64,
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
            alert_until_ns: AtomicU64::new(0),
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
    /// fill time ([`crate::drain::session::Session::fill_time`]).
    fn publish(&self, now: Instant, wait: Duration, fill: Option<Duration>, cpu: i32) {
        self.due_ns
            .store(self.since_epoch(now).saturating_add(nanos(wait)), Relaxed);
        self.fill_ns.store(fill.map_or(u64::MAX, nanos), Relaxed);
        self.cpu.store(cpu, Relaxed);
    }

    /// How often the standby looks at `now`: every quarter fill time, at least
    /// [`MIN_PERIOD`] apart while alert and [`CALM_PERIOD`] otherwise; `None` while
    /// there is nothing to watch (no writer writes, or its ring takes so long to fill
    /// that the loop's own idle period is within a quarter of it).
    pub fn period_at(&self, now: Instant) -> Option<Duration> {
        let quarter = self.fill_ns.load(Relaxed) / 4;
        let floor = if self.since_epoch(now) < self.alert_until_ns.load(Relaxed) {
            MIN_PERIOD
        } else {
            CALM_PERIOD
        };
        (quarter < self.idle_ns).then(|| Duration::from_nanos(quarter).max(floor))
    }

    /// The loop is `late` past its plan at `now`: more than half a fill time (past
    /// [`WARM_UP`]) makes the standby look closely ([`MIN_PERIOD`]) for the next
    /// [`ALERT_FOR`].
    fn woke(&self, now: Instant, late: Duration) {
        let fill = self.fill_ns.load(Relaxed);
        let t = self.since_epoch(now);
        if fill != u64::MAX && nanos(late) > fill / 2 && t >= nanos(WARM_UP) {
            self.alert_until_ns
                .store(t.saturating_add(nanos(ALERT_FOR)), Relaxed);
        }
    }

    /// How far the loop is past its planned wake-up at `now`.
    fn lateness(&self, now: Instant) -> Duration {
        Duration::from_nanos(
            self.since_epoch(now)
                .saturating_sub(self.due_ns.load(Relaxed)),
        )
    }

    /// Whether the loop is late at `now`: more than a quarter of the fill time past its
    /// planned wake-up while a writer writes.
    pub fn late_at(&self, now: Instant) -> bool {
        let fill = self.fill_ns.load(Relaxed);
        fill != u64::MAX && nanos(self.lateness(now)) > fill / 4
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
                    let Some(period) = b.period_at(Instant::now()) else {
                        // Nothing to watch: sleep until the loop sees a writer again
                        // (`beat`) or stops. The flag is set before the check, so a
                        // wake-up between them is not lost (park returns at once
                        // after an unpark).
                        priority.set_active(false);
                        b.asleep.store(true, Relaxed);
                        if b.period_at(Instant::now()).is_none() && !b.stop.load(Relaxed) {
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
                    let now = Instant::now();
                    b.woke(now, b.lateness(now));
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
    /// [`crate::drain::session::Session::fill_time`]. Wakes the standby when there is a writer
    /// to watch again.
    pub fn beat(&self, now: Instant, wait: Duration, fill: Option<Duration>) {
        self.beat.publish(now, wait, fill, current_cpu());
        if self.beat.asleep.load(Relaxed) && self.beat.period_at(now).is_some() {
            if let Some(t) = &self.thread {
                t.thread().unpark();
            }
        }
    }

    /// The drain loop woke `late` past the wait it asked for, at `now`: a late wake-up
    /// (more than half a fill time) makes the standby look closely for a while.
    pub fn woke(&self, now: Instant, late: Duration) {
        self.beat.woke(now, late);
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
        let t0 = b.epoch + WARM_UP;
        let ms = Duration::from_millis;
        // No writer: never late, nothing to watch.
        b.publish(t0, ms(1), None, 0);
        assert!(!b.late_at(t0 + Duration::from_secs(60)));
        assert_eq!(b.period_at(t0), None);
        // A ring that fills in 8 ms: due at +1 ms, late past +3 ms.
        b.publish(t0, ms(1), Some(ms(8)), 0);
        assert!(!b.late_at(t0 + Duration::from_micros(2999)));
        assert!(b.late_at(t0 + Duration::from_micros(3001)));
        // Calm: a look every CALM_PERIOD at most. A wake-up late by less than half a
        // fill leaves it calm, and so does any in the loop's WARM_UP; a later one makes
        // it alert for ALERT_FOR: a look every quarter fill (2 ms), but no closer than
        // MIN_PERIOD.
        assert_eq!(b.period_at(t0), Some(CALM_PERIOD));
        b.woke(t0, ms(4));
        b.woke(t0 - ms(1), ms(5));
        assert_eq!(b.period_at(t0), Some(CALM_PERIOD));
        b.woke(t0, ms(5));
        assert_eq!(b.period_at(t0), Some(ms(2)));
        assert_eq!(b.lateness(t0 + ms(4)), ms(3));
        b.publish(t0, Duration::ZERO, Some(Duration::from_micros(100)), 0);
        assert_eq!(b.period_at(t0 + ALERT_FOR - ms(1)), Some(MIN_PERIOD));
        assert_eq!(b.period_at(t0 + ALERT_FOR), Some(CALM_PERIOD));
        // A slow writer (a quarter fill beyond the loop's idle period): nothing to watch.
        b.publish(t0, ms(5), Some(ms(40)), 0);
        assert_eq!(b.period_at(t0), None);
        assert!(!b.late_at(t0 + ms(14)));
        assert!(b.late_at(t0 + ms(16)));
    }
}
