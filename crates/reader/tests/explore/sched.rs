//! The controlled scheduler of `explore.rs`: logical threads run as OS threads, one at a
//! time, handing a token over at yield points; a [`Strategy`] picks who goes on at each
//! one. [`SchedMem`] puts a yield point before every access to the shared region.

use hyptrace_abi::{HeapMem, SharedMem};
use std::any::Any;
use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a thread waits for the token while no step happens anywhere before the
/// process is stopped with a message (a thread blocked outside every yield point would
/// otherwise hang the test: the scoped threads could never be joined).
const STALL: Duration = Duration::from_secs(60);

/// Where a logical thread yields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// Before an access to the shared memory (inside an operation).
    Access,
    /// Before the thread's first access, its first yield point: nothing shared happened
    /// since it got the token, so switching here is the same as not having given it the
    /// token (the DFS does not branch here; PCT applies a change point falling here).
    Start,
    /// Between two operations (a write, a read call, a mailbox service).
    Rest,
    /// Between two operations, waiting for another thread: the thread is not run again
    /// until another one passes a rest point or ends (or every thread waits).
    Idle,
    /// The thread ended (or, for the first pick, no thread ran yet).
    End,
}

/// Picks the thread that runs next at each yield point.
pub trait Strategy {
    /// Called at every yield point, before the first and when a thread ends (`point`
    /// [`Point::End`], `step` not counted again). `step` counts the yield points of the
    /// execution so far (1 at the first); `current` is the thread yielding at `point`
    /// (`usize::MAX` before the first); `enabled` (never empty, ascending) are the
    /// threads that may run, `current` among them unless it ended or waits. Returns one
    /// of `enabled`.
    fn pick(&mut self, step: u64, current: usize, point: Point, enabled: &[usize]) -> usize;
}

/// A small deterministic generator (splitmix64): schedules and test data from a seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x6a09_e667_f3bc_c908)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Shuffles `v` (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

/// PCT (Burckhardt, Kothari, Musuvathi, Nagarakatte: "A Randomized Scheduler with
/// Probabilistic Guarantees of Finding Bugs", ASPLOS 2010): the threads get random
/// distinct priorities `d..d+n`, and `d - 1` change points at random distinct steps
/// in `1..=k` lower the thread running there to priority `1..d-1`; the enabled thread
/// with the highest priority always runs. A bug of depth `d` (needing `d - 1` ordering
/// constraints) is found with probability at least `1 / (n k^(d-1))` per execution.
/// Every yield point is a step and a pick (a thread's first one too, [`Point::Start`]),
/// so a change point applies at the very step it was drawn for, to the thread there.
#[derive(Debug)]
pub struct Pct {
    prio: Vec<u64>,
    /// (step, priority), by step.
    changes: Vec<(u64, u64)>,
    next: usize,
}

impl Pct {
    /// The schedule of `seed` for `threads` threads, depth `d`, about `k` steps.
    pub fn new(seed: u64, threads: usize, d: usize, k: u64) -> Self {
        let mut rng = Rng::new(seed);
        let d = d.max(1) as u64;
        let mut prio: Vec<u64> = (0..threads as u64).map(|i| d + i).collect();
        rng.shuffle(&mut prio);
        let mut steps = std::collections::BTreeSet::new();
        while (steps.len() as u64) < (d - 1).min(k) {
            steps.insert(1 + rng.below(k.max(1)));
        }
        let mut lows: Vec<u64> = (1..d).collect();
        rng.shuffle(&mut lows);
        let changes = steps.into_iter().zip(lows).collect();
        Self {
            prio,
            changes,
            next: 0,
        }
    }
}

impl Strategy for Pct {
    fn pick(&mut self, step: u64, current: usize, _: Point, enabled: &[usize]) -> usize {
        while let Some(&(at, low)) = self.changes.get(self.next) {
            if at > step {
                break;
            }
            // The scheduler picks at every step: a change point is never passed over.
            assert_eq!(at, step, "PCT: the pick at change point {at} was skipped");
            if let Some(p) = self.prio.get_mut(current) {
                *p = low;
            }
            self.next += 1;
        }
        let best = enabled.iter().copied().max_by_key(|&t| self.prio[t]);
        best.unwrap_or(enabled[0])
    }
}

/// One scheduling decision of [`Dfs`]: where it was made (so that a replay can check it
/// reached the same decision) and the threads it may pick.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Decision {
    step: u64,
    current: usize,
    point: Point,
    options: Vec<usize>,
}

/// A recorded decision and the option taken now.
#[derive(Debug)]
struct Branch {
    at: Decision,
    taken: usize,
}

/// Preemption-bounded depth-first search (Musuvathi and Qadeer, "Iterative context
/// bounding", PLDI 2007): every schedule with at most `bound` preemptions (a switch away
/// from a thread that could go on), each exactly once. Stateless: each execution
/// replays the decisions of the previous one up to its last untried branch. The replay
/// is strict: an execution must reach every recorded decision of its prefix, at the
/// same step, thread and point, with the same options, else [`Dfs::advance`] reports
/// nondeterminism (a schedule that is not a function of its decisions would make the
/// search repeat or skip schedules).
#[derive(Debug)]
pub struct Dfs {
    bound: u32,
    stack: Vec<Branch>,
    pos: usize,
    used: u32,
    /// The first replayed decision that differs from the recorded one.
    divergence: Option<String>,
}

impl Dfs {
    /// A search over schedules with at most `bound` preemptions.
    pub fn new(bound: u32) -> Self {
        Self {
            bound,
            stack: Vec::new(),
            pos: 0,
            used: 0,
            divergence: None,
        }
    }

    /// Checks that the execution just run replayed its prefix exactly (every recorded
    /// decision reached, as recorded), then prepares the next one: `Ok(false)` once
    /// every schedule was run, `Err` (nondeterminism) if the replay diverged.
    pub fn advance(&mut self) -> Result<bool, String> {
        if let Some(d) = self.divergence.take() {
            return Err(format!(
                "DFS replay diverged (the execution is not deterministic): {d}"
            ));
        }
        if self.pos < self.stack.len() {
            return Err(format!(
                "DFS replay diverged (the execution is not deterministic): the execution \
                 ended after {} of the {} decisions recorded, before {:?}",
                self.pos,
                self.stack.len(),
                self.stack[self.pos].at
            ));
        }
        (self.pos, self.used) = (0, 0);
        while let Some(b) = self.stack.last_mut() {
            if b.taken + 1 < b.at.options.len() {
                b.taken += 1;
                return Ok(true);
            }
            self.stack.pop();
        }
        Ok(false)
    }
}

impl Strategy for Dfs {
    fn pick(&mut self, step: u64, current: usize, point: Point, enabled: &[usize]) -> usize {
        if enabled.len() == 1 {
            return enabled[0];
        }
        // Going on with the current thread is free; so is any choice when it cannot. At
        // a thread's first yield point it goes on: switching there would only repeat the
        // decision that gave it the token (each schedule would run twice).
        let goes_on = enabled.contains(&current)
            && matches!(point, Point::Access | Point::Rest | Point::Start);
        let default = if goes_on { current } else { enabled[0] };
        let mut options = vec![default];
        if point != Point::Start && (!goes_on || self.used < self.bound) {
            options.extend(enabled.iter().copied().filter(|&t| t != default));
        }
        let here = Decision {
            step,
            current,
            point,
            options,
        };
        match self.stack.get(self.pos) {
            Some(b) if b.at != here => {
                self.divergence.get_or_insert_with(|| {
                    format!("decision {} is {here:?}, recorded {:?}", self.pos, b.at)
                });
            }
            Some(_) => {}
            None => self.stack.push(Branch { at: here, taken: 0 }),
        }
        let b = &self.stack[self.pos];
        let choice = b.at.options[b.taken.min(b.at.options.len() - 1)];
        // Only after a divergence (reported by `advance`) can the choice be disabled.
        let choice = if enabled.contains(&choice) {
            choice
        } else {
            default
        };
        if goes_on && choice != current {
            self.used += 1;
        }
        self.pos += 1;
        choice
    }
}

/// Unwinds a thread out of an execution that failed elsewhere (not a failure itself).
struct Aborted;

thread_local! {
    /// The logical thread this OS thread runs (`None`: not a scheduled thread, e.g. the
    /// test's main thread setting up or checking an execution: no yield points).
    static ME: Cell<Option<usize>> = const { Cell::new(None) };
}

struct State<'a> {
    strategy: &'a mut (dyn Strategy + Send),
    /// The thread holding the token.
    current: usize,
    alive: Vec<bool>,
    /// The thread's last yield was between two operations.
    at_rest: Vec<bool>,
    /// The thread waits for another one to pass a rest point.
    idle: Vec<bool>,
    /// The thread passed a yield point.
    started: Vec<bool>,
    steps: u64,
    rest_checks: u64,
    concurrent_checks: u64,
    /// (step, thread) at every hand-over of the token.
    switches: Vec<(u64, usize)>,
    failure: Option<String>,
}

impl State<'_> {
    fn enabled(&mut self) -> Vec<usize> {
        let pick = |s: &Self| -> Vec<usize> {
            (0..s.alive.len())
                .filter(|&t| s.alive[t] && !s.idle[t])
                .collect()
        };
        let e = pick(self);
        if !e.is_empty() {
            return e;
        }
        // Every live thread waits for another: let them all go on (they poll again).
        self.idle.iter_mut().for_each(|i| *i = false);
        pick(self)
    }

    fn pick(&mut self, current: usize, point: Point) -> Option<usize> {
        let enabled = self.enabled();
        if enabled.is_empty() {
            return None;
        }
        let step = self.steps;
        let next = self.strategy.pick(step, current, point, &enabled);
        let next = if enabled.contains(&next) {
            next
        } else {
            enabled[0]
        };
        if next != current {
            self.switches.push((step, next));
        }
        self.current = next;
        Some(next)
    }
}

/// What an execution did (for the reports).
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    /// Yield points.
    pub steps: u64,
    /// Rest points where every other live thread was at rest too (the callers check
    /// their invariants there).
    pub rest_checks: u64,
    /// Those of them where every other thread was alive (at rest between two of its
    /// operations, not ended): checks in the middle of the run.
    pub concurrent_checks: u64,
}

/// One execution's scheduler: `names.len()` logical threads, at most `max_steps`
/// yield points, decisions by the strategy it borrows.
pub struct Sched<'a> {
    names: Vec<&'static str>,
    max_steps: u64,
    st: Mutex<State<'a>>,
    cv: Condvar,
}

impl<'a> Sched<'a> {
    /// A scheduler for threads `names`.
    pub fn new(
        names: &[&'static str],
        max_steps: u64,
        strategy: &'a mut (dyn Strategy + Send),
    ) -> Self {
        let n = names.len();
        Self {
            names: names.to_vec(),
            max_steps,
            st: Mutex::new(State {
                strategy,
                current: usize::MAX,
                alive: vec![true; n],
                at_rest: vec![true; n],
                idle: vec![false; n],
                started: vec![false; n],
                steps: 0,
                rest_checks: 0,
                concurrent_checks: 0,
                switches: Vec::new(),
                failure: None,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<'a>> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `bodies` (one per name, in order) as the logical threads, one at a time,
    /// and joins them. `Err`: the message of the first thread that panicked, or of the
    /// step bound.
    pub fn run(&self, bodies: Vec<Box<dyn FnOnce() + Send + '_>>) -> Result<Outcome, String> {
        assert_eq!(bodies.len(), self.names.len(), "one body per thread");
        self.lock().pick(usize::MAX, Point::End);
        std::thread::scope(|s| {
            for (i, body) in bodies.into_iter().enumerate() {
                std::thread::Builder::new()
                    .name(self.names[i].to_string())
                    .spawn_scoped(s, move || self.thread_main(i, body))
                    .expect("spawn a scheduled thread");
            }
        });
        let st = self.lock();
        match &st.failure {
            Some(msg) => Err(msg.clone()),
            None => Ok(Outcome {
                steps: st.steps,
                rest_checks: st.rest_checks,
                concurrent_checks: st.concurrent_checks,
            }),
        }
    }

    fn thread_main(&self, me: usize, body: Box<dyn FnOnce() + Send + '_>) {
        ME.with(|m| m.set(Some(me)));
        let r = panic::catch_unwind(AssertUnwindSafe(|| {
            self.wait_turn(me, self.lock());
            body()
        }));
        if let Err(p) = r {
            if !p.is::<Aborted>() {
                let msg = panic_message(&*p);
                self.fail(format!("thread {} panicked: {msg}", self.names[me]));
            }
        }
        self.end(me);
        ME.with(|m| m.set(None));
    }

    /// Records the first failure and wakes every thread (they unwind).
    fn fail(&self, msg: String) {
        let mut st = self.lock();
        st.failure.get_or_insert(msg);
        self.cv.notify_all();
    }

    fn end(&self, me: usize) {
        let mut st = self.lock();
        st.alive[me] = false;
        st.at_rest[me] = true;
        // An end is progress for every thread waiting for another.
        st.idle.iter_mut().for_each(|i| *i = false);
        if st.failure.is_none() {
            st.pick(me, Point::End);
        }
        self.cv.notify_all();
    }

    /// Waits until `me` holds the token; unwinds (as [`Aborted`]) if the execution failed.
    fn wait_turn(&self, me: usize, mut st: MutexGuard<'_, State<'a>>) {
        let (mut seen, mut since) = (st.steps, Instant::now());
        while st.current != me && st.failure.is_none() {
            st = self
                .cv
                .wait_timeout(st, Duration::from_secs(1))
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if st.steps != seen {
                (seen, since) = (st.steps, Instant::now());
            } else if since.elapsed() > STALL {
                eprintln!(
                    "explore: no step for {STALL:?} at step {seen}: thread {} holds the token \
                     but is blocked outside every yield point; stopping the process",
                    self.names.get(st.current).unwrap_or(&"?")
                );
                std::process::exit(101);
            }
        }
        if st.failure.is_some() {
            drop(st);
            abort();
        }
    }

    /// A yield point of the calling thread (none on an unscheduled thread).
    pub fn yield_at(&self, point: Point) {
        let Some(me) = ME.with(Cell::get) else {
            return;
        };
        let mut st = self.lock();
        if st.failure.is_some() {
            drop(st);
            return abort();
        }
        st.steps += 1;
        if st.steps > self.max_steps {
            let msg = format!(
                "step bound {} exceeded (thread {} at {point:?}): livelock or scenario too long",
                self.max_steps, self.names[me]
            );
            st.failure.get_or_insert(msg);
            self.cv.notify_all();
            drop(st);
            return abort();
        }
        st.at_rest[me] = matches!(point, Point::Rest | Point::Idle);
        let point = if !std::mem::replace(&mut st.started[me], true) && point == Point::Access {
            Point::Start
        } else {
            point
        };
        match point {
            Point::Rest => st.idle.iter_mut().for_each(|i| *i = false),
            Point::Idle => st.idle[me] = true,
            Point::Access | Point::Start | Point::End => {}
        }
        let next = st.pick(me, point).unwrap_or(me);
        if next != me {
            self.cv.notify_all();
        }
        self.wait_turn(me, st);
    }

    /// A rest point of the calling thread (between two of its operations): runs `check`
    /// first if every other live thread is at rest too (no operation in progress
    /// anywhere: the invariants that hold at rest must hold now).
    pub fn rest(&self, check: impl FnOnce()) {
        if let Some(me) = ME.with(Cell::get) {
            let quiet = {
                let mut st = self.lock();
                let others = || (0..st.alive.len()).filter(|&t| t != me);
                let quiet = others().all(|t| !st.alive[t] || st.at_rest[t]);
                let all_alive = others().all(|t| st.alive[t]);
                st.rest_checks += u64::from(quiet);
                st.concurrent_checks += u64::from(quiet && all_alive);
                quiet
            };
            if quiet {
                check();
            }
        }
        self.yield_at(Point::Rest);
    }

    /// The calling thread waits for another one to make progress (between operations).
    pub fn idle(&self) {
        self.yield_at(Point::Idle);
    }

    /// A hash of the hand-overs of the token so far (distinct schedules, distinct
    /// hand-overs).
    pub fn fingerprint(&self) -> u64 {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let mut h = DefaultHasher::new();
        self.lock().switches.hash(&mut h);
        h.finish()
    }

    /// The hand-overs of the token so far: `step:thread`, for failure reports.
    pub fn schedule(&self) -> String {
        let st = self.lock();
        let all: Vec<String> = st
            .switches
            .iter()
            .map(|&(s, t)| format!("{s}:{}", self.names.get(t).unwrap_or(&"?")))
            .collect();
        let skip = all.len().saturating_sub(200);
        let head = if skip > 0 {
            format!("... ({skip} earlier) ")
        } else {
            String::new()
        };
        format!(
            "{} steps, token hand-overs (step:thread) {head}{}",
            st.steps,
            all[skip..].join(" ")
        )
    }
}

/// Unwinds out of a failed execution, unless already unwinding (a drop touching the
/// region while its thread unwinds must not panic again).
fn abort() {
    if !std::thread::panicking() {
        panic::resume_unwind(Box::new(Aborted));
    }
}

/// The message of a panic payload.
pub fn panic_message(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".to_string())
}

/// The shared region with a yield point before every access: the writer, the reader and
/// their callbacks see a [`HeapMem`] (real atomics), one access at a time.
pub struct SchedMem<'a, 's> {
    mem: &'a HeapMem,
    sched: &'a Sched<'s>,
}

impl<'a, 's> SchedMem<'a, 's> {
    /// `mem` accessed under `sched`.
    pub fn new(mem: &'a HeapMem, sched: &'a Sched<'s>) -> Self {
        Self { mem, sched }
    }

    fn at(&self) -> &HeapMem {
        self.sched.yield_at(Point::Access);
        self.mem
    }
}

impl SharedMem for SchedMem<'_, '_> {
    fn size(&self) -> usize {
        self.mem.size()
    }
    fn load(&self, off: usize, order: Ordering) -> u64 {
        self.at().load(off, order)
    }
    fn store(&self, off: usize, val: u64, order: Ordering) {
        self.at().store(off, val, order)
    }
    fn swap(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.at().swap(off, val, order)
    }
    fn compare_exchange(
        &self,
        off: usize,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64> {
        self.at()
            .compare_exchange(off, current, new, success, failure)
    }
    fn fetch_or(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.at().fetch_or(off, val, order)
    }
    fn fetch_and(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.at().fetch_and(off, val, order)
    }
    fn fetch_add(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.at().fetch_add(off, val, order)
    }
    fn write_bytes(&self, off: usize, src: &[u8]) {
        self.at().write_bytes(off, src)
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        self.at().read_bytes(off, dst)
    }
    // The `*_unchecked` methods keep the trait's defaults: they call the checked ones
    // above, so they are yield points too.
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    /// Two threads taking turns at every yield point (a strategy for these tests).
    struct Alternate;

    impl Strategy for Alternate {
        fn pick(&mut self, _: u64, current: usize, _: Point, enabled: &[usize]) -> usize {
            let other = enabled.iter().copied().find(|&t| t != current);
            other.unwrap_or(enabled[0])
        }
    }

    /// One thread at a time, switching where the strategy says: the accesses of the two
    /// threads alternate exactly.
    #[test]
    fn one_thread_at_a_time_in_the_strategy_order() {
        let mut s = Alternate;
        let sched = Sched::new(&["a", "b"], 100, &mut s);
        let log = Mutex::new(Vec::new());
        let body = |name: &'static str| {
            let (sched, log) = (&sched, &log);
            Box::new(move || {
                for _ in 0..3 {
                    sched.yield_at(Point::Access);
                    log.lock().unwrap().push(name);
                }
            }) as Box<dyn FnOnce() + Send + '_>
        };
        let out = sched.run(vec![body("a"), body("b")]).expect("no failure");
        assert_eq!(*log.lock().unwrap(), ["a", "b", "a", "b", "a", "b"]);
        assert_eq!(out.steps, 6);
    }

    /// A panic fails the execution with its message; the other thread, waiting for the
    /// token, unwinds instead of hanging.
    #[test]
    fn a_panic_fails_the_execution() {
        let mut s = Alternate;
        let sched = Sched::new(&["a", "b"], 100, &mut s);
        let after = AtomicU64::new(0);
        let r = sched.run(vec![
            Box::new(|| {
                sched.yield_at(Point::Access);
                panic!("boom");
            }),
            Box::new(|| loop {
                sched.yield_at(Point::Access);
                after.fetch_add(1, Relaxed);
            }),
        ]);
        let msg = r.expect_err("the panic is a failure");
        assert!(msg.contains("thread a panicked: boom"), "{msg}");
        assert!(after.load(Relaxed) <= 2, "b ran on after the failure");
    }

    /// A livelock ends at the step bound with a message.
    #[test]
    fn the_step_bound_ends_a_livelock() {
        let mut s = Alternate;
        let sched = Sched::new(&["a", "b"], 50, &mut s);
        let spin = || loop {
            sched.idle();
        };
        let r = sched.run(vec![Box::new(spin), Box::new(spin)]);
        assert!(r.expect_err("a failure").contains("step bound 50 exceeded"));
    }

    /// PCT: the same seed gives the same schedule; the highest priority runs until a
    /// change point or its end.
    #[test]
    fn pct_is_a_function_of_its_seed() {
        let run = |seed| {
            let mut p = Pct::new(seed, 2, 3, 40);
            let sched = Sched::new(&["a", "b"], 1000, &mut p);
            let body = || {
                for _ in 0..20 {
                    sched.yield_at(Point::Access);
                }
            };
            sched.run(vec![Box::new(body), Box::new(body)]).unwrap();
            sched.schedule()
        };
        for seed in 0..20 {
            assert_eq!(run(seed), run(seed));
        }
        let distinct: std::collections::BTreeSet<String> = (0..20).map(run).collect();
        assert!(distinct.len() > 5, "{distinct:?}");
    }

    /// Runs `dfs` to the end over a program of two threads, `a` and `b`, the body of
    /// each given by `body(execution, thread, sched, log)`; returns the log of every
    /// execution (the characters the bodies pushed), or the nondeterminism reported.
    fn dfs_logs<F>(dfs: &mut Dfs, body: F) -> Result<Vec<String>, String>
    where
        F: Fn(u64, usize, &Sched<'_>, &Mutex<String>) + Sync,
    {
        let mut logs = Vec::new();
        loop {
            let log = Mutex::new(String::new());
            {
                let n = logs.len() as u64;
                let sched = Sched::new(&["a", "b"], 1000, dfs);
                let (sched, log, body) = (&sched, &log, &body);
                let bodies: Vec<Box<dyn FnOnce() + Send + '_>> = (0..2)
                    .map(|t| Box::new(move || body(n, t, sched, log)) as Box<_>)
                    .collect();
                sched.run(bodies).expect("no failure");
            }
            logs.push(log.into_inner().unwrap());
            assert!(logs.len() < 10_000, "the DFS does not end");
            if !dfs.advance()? {
                return Ok(logs);
            }
        }
    }

    /// `steps` accesses, each logged (`a` or `b`) right after its yield point.
    fn accesses(steps: usize) -> impl Fn(u64, usize, &Sched<'_>, &Mutex<String>) + Sync {
        move |_, t, sched, log| {
            for _ in 0..steps {
                sched.yield_at(Point::Access);
                log.lock().unwrap().push(if t == 0 { 'a' } else { 'b' });
            }
        }
    }

    /// The interleavings of `n` accesses of `a` with `n` of `b` that have at most
    /// `bound` preemptions, counted independently of the DFS: with two threads every
    /// switch but the last (to the thread left after the other one ended) is a
    /// preemption, so a word of `r` runs has `r - 2` of them.
    fn interleavings(n: u32, bound: u32) -> usize {
        (0u32..1 << (2 * n))
            .filter(|w| w.count_ones() == n)
            .filter(|&w| {
                let switches = (1..2 * n).filter(|&i| (w >> i & 1) != (w >> (i - 1) & 1));
                switches.count() as u32 <= bound + 1
            })
            .count()
    }

    /// The DFS over two threads of `n` accesses each runs every interleaving with at
    /// most `bound` preemptions exactly once: as many executions as such interleavings
    /// (counted independently), each a distinct one, none with more preemptions. (3 and
    /// 4 accesses: 2, 6, 14, 18, 20 and 2, 8, 26, 44, 62, 68, 70 schedules for bounds 0,
    /// 1, ...)
    #[test]
    fn dfs_runs_each_schedule_within_the_bound_once() {
        for n in [2u32, 3, 4] {
            for bound in 0..=2 * n {
                let logs = dfs_logs(&mut Dfs::new(bound), accesses(n as usize)).unwrap();
                let distinct: std::collections::BTreeSet<&String> = logs.iter().collect();
                assert_eq!(
                    distinct.len(),
                    logs.len(),
                    "{n} accesses, bound {bound}: a schedule twice: {logs:?}"
                );
                let expect = interleavings(n, bound);
                assert_eq!(logs.len(), expect, "{n} accesses, bound {bound}: {logs:?}");
                let runs =
                    |w: &String| 1 + w.as_bytes().windows(2).filter(|p| p[0] != p[1]).count();
                assert!(
                    logs.iter().all(|w| runs(w) <= bound as usize + 2),
                    "{logs:?}"
                );
            }
        }
        assert_eq!(
            [0, 1, 2, 3, 4].map(|b| interleavings(3, b)),
            [2, 6, 14, 18, 20],
            "the independent count"
        );
        assert_eq!(
            [0, 1, 2, 3, 4, 5, 6].map(|b| interleavings(4, b)),
            [2, 8, 26, 44, 62, 68, 70],
            "the independent count"
        );
    }

    /// Strict replay: an execution that ends before reaching every recorded decision of
    /// its prefix (here the second one, where `a` takes one access fewer) is reported as
    /// nondeterminism, not taken for the end of a branch.
    #[test]
    fn dfs_replay_ending_early_is_nondeterminism() {
        let body = |n: u64, t: usize, sched: &Sched<'_>, _: &Mutex<String>| {
            let steps = if t == 0 && n > 0 { 2 } else { 3 };
            for _ in 0..steps {
                sched.yield_at(Point::Access);
            }
        };
        let err = dfs_logs(&mut Dfs::new(2), body).expect_err("nondeterminism");
        assert!(err.contains("ended after"), "{err}");
    }

    /// Strict replay: a replayed decision with the same options but reached at another
    /// kind of yield point (a rest point instead of an access) is nondeterminism.
    #[test]
    fn dfs_replay_at_another_point_is_nondeterminism() {
        let body = |n: u64, t: usize, sched: &Sched<'_>, _: &Mutex<String>| {
            sched.yield_at(Point::Access);
            let later = if t == 0 && n > 0 {
                Point::Rest
            } else {
                Point::Access
            };
            sched.yield_at(later);
            sched.yield_at(Point::Access);
        };
        let err = dfs_logs(&mut Dfs::new(2), body).expect_err("nondeterminism");
        assert!(err.contains("Rest") && err.contains("recorded"), "{err}");
    }

    /// PCT: a change point at a thread's first access (its first yield point) lowers it
    /// there: the other thread runs before that access, not one access later.
    #[test]
    fn pct_change_point_at_a_first_access_applies_there() {
        let run = |changes: Vec<(u64, u64)>| {
            let mut p = Pct {
                prio: vec![4, 3],
                changes,
                next: 0,
            };
            let sched = Sched::new(&["a", "b"], 100, &mut p);
            let log = Mutex::new(String::new());
            let (s, l) = (&sched, &log);
            let bodies: Vec<Box<dyn FnOnce() + Send + '_>> = (0..2)
                .map(|t| Box::new(move || accesses(3)(0, t, s, l)) as Box<_>)
                .collect();
            sched.run(bodies).unwrap();
            log.into_inner().unwrap()
        };
        assert_eq!(run(vec![]), "aaabbb");
        // Step 1 is a's first access; step 2 its second.
        assert_eq!(run(vec![(1, 1)]), "bbbaaa");
        assert_eq!(run(vec![(2, 1)]), "abbbaa");
    }
}
