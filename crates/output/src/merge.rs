//! The one time-merge of per-CPU event streams: `hyptrace run` (the host's session,
//! live), the text sink (`record --format text`, live) and `report`
//! ([`crate::TraceFile::records`], pulling one item at a time) all use [`Merger`].
//!
//! Each CPU's events arrive in timestamp order, so once CPU c delivered an event at
//! time t, no later event of c should be older than t. An event is released when its
//! time is at or below the *watermark*: the smallest last-seen time over the CPUs that
//! are not finished (a CPU's last-seen time is the largest it delivered: a time going
//! backwards never lowers it). Among released events the order is by time, ties to the
//! lower CPU — what trace-cmd does: the CPU whose next event is oldest goes first, each
//! CPU's own events in the order they came, printed with their own times. So the
//! output is exactly ordered while the run goes on; events wait only while some CPU is
//! silent and not finished.
//!
//! **Bounded memory** ([`MergeWindow`]): a CPU that neither delivers nor finishes would
//! hold every other CPU's events back without limit. A merger made
//! [`Merger::with_window`] counts what it holds (events and the byte sizes the caller
//! gives with [`Merger::push_sized`]); [`Merger::release`] then, past the window,
//! reports [`Released::WindowExceeded`] (naming the lagging CPU: the caller prints
//! [`crate::format_window_exceeded`]) and releases the oldest events ahead of the
//! watermark down to half the window. Events the held-back CPU delivers later may then
//! be older than some already released (the marker line says so).
//!
//! **Cost**: O(log CPUs) per item pushed or released, whatever the CPU count: the CPUs'
//! front items are kept in a binary heap by (time, CPU) and the watermark in a min-tree
//! over the CPUs' last times (a file naming 4096 CPUs merges in the time of its events).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// An item of a CPU's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Merged<T> {
    /// An event.
    Event(T),
    /// Events of this CPU were lost here ([`crate::Missed::Count`], or
    /// [`crate::Missed::Unknown`] where the page said so without a count).
    Lost(crate::Missed),
}

/// How much a merger holds before it releases events ahead of a lagging CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MergeWindow {
    /// Most items held (all CPUs).
    pub events: usize,
    /// Most bytes held (all CPUs; the sizes given to [`Merger::push_sized`]).
    pub bytes: usize,
}

impl MergeWindow {
    /// The window of `hyptrace run` and the text sink: 2^18 items, 16 MiB.
    pub const DEFAULT: Self = Self {
        events: 1 << 18,
        bytes: 16 << 20,
    };
}

/// What [`Merger::release`] hands out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Released<T> {
    /// The next item in merged order.
    Item {
        /// Index of the CPU (stream) it came from.
        cpu: usize,
        /// Its time, as pushed.
        ts: u64,
        /// The item.
        item: Merged<T>,
    },
    /// The window is exceeded: `held` items wait for CPU `lagging` (`None`: no CPU is
    /// known to lag); the oldest are released next, ahead of the watermark.
    WindowExceeded {
        /// Items held when the window was found exceeded.
        held: usize,
        /// The CPU holding the watermark back.
        lagging: Option<usize>,
    },
}

#[derive(Debug)]
struct Cpu<T> {
    /// `(time, item, bytes)` in arrival order.
    queue: VecDeque<(u64, Merged<T>, usize)>,
    /// Largest time delivered (the CPU's part of the watermark).
    last: u64,
    seen: bool,
    done: bool,
}

/// Watermark merger across CPUs (see the module documentation).
///
/// ```
/// use hyptrace_output::{Merged, Merger, Released};
/// let mut m = Merger::new(2);
/// m.push(0, 10, Merged::Event("a"));
/// m.push(0, 30, Merged::Event("c"));
/// m.push(1, 20, Merged::Event("b"));
/// m.finish(0);
/// m.finish(1);
/// let mut order = Vec::new();
/// m.release(|r| if let Released::Item { item: Merged::Event(e), .. } = r { order.push(e) });
/// assert_eq!(order, ["a", "b", "c"]);
/// ```
#[derive(Debug)]
pub struct Merger<T> {
    cpus: Vec<Cpu<T>>,
    /// `(front time, cpu)` of every CPU whose queue is not empty, one entry each.
    fronts: BinaryHeap<Reverse<(u64, usize)>>,
    /// The last time of every CPU not finished (`u64::MAX` for a finished one).
    lasts: MinTree,
    /// CPUs neither finished nor seen (while there are any, there is no watermark).
    unseen: usize,
    held: usize,
    bytes: usize,
    window: Option<MergeWindow>,
    overflows: u64,
}

impl<T> Merger<T> {
    /// A merger for `n` CPUs, without a window (it holds what the watermark holds).
    pub fn new(n: usize) -> Self {
        Self {
            cpus: (0..n)
                .map(|_| Cpu {
                    queue: VecDeque::new(),
                    last: 0,
                    seen: false,
                    done: false,
                })
                .collect(),
            fronts: BinaryHeap::new(),
            lasts: MinTree::new(n),
            unseen: n,
            held: 0,
            bytes: 0,
            window: None,
            overflows: 0,
        }
    }

    /// A merger for `n` CPUs that [`Merger::release`] keeps within `window`.
    pub fn with_window(n: usize, window: MergeWindow) -> Self {
        Self {
            window: Some(window),
            ..Self::new(n)
        }
    }

    /// Number of CPUs.
    pub fn nr_cpus(&self) -> usize {
        self.cpus.len()
    }

    /// Queues an item of `cpu` at `ts` (size 0 for the window). A CPU out of range is
    /// ignored.
    pub fn push(&mut self, cpu: usize, ts: u64, item: Merged<T>) {
        self.push_sized(cpu, ts, item, 0);
    }

    /// Queues an item of `cpu` at `ts` that counts `bytes` against the window. A CPU out
    /// of range is ignored.
    pub fn push_sized(&mut self, cpu: usize, ts: u64, item: Merged<T>, bytes: usize) {
        self.advance(cpu, ts);
        let Some(c) = self.cpus.get_mut(cpu) else {
            return;
        };
        if c.queue.is_empty() {
            self.fronts.push(Reverse((ts, cpu)));
        }
        c.queue.push_back((ts, item, bytes));
        self.held += 1;
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// Tells that `cpu` will deliver nothing older than `ts` (without an item).
    pub fn advance(&mut self, cpu: usize, ts: u64) {
        let Some(c) = self.cpus.get_mut(cpu) else {
            return;
        };
        c.last = if c.seen { c.last.max(ts) } else { ts };
        if !c.seen && !c.done {
            self.unseen -= 1;
        }
        c.seen = true;
        if !c.done {
            self.lasts.set(cpu, c.last);
        }
    }

    /// The largest time `cpu` delivered (or [`Merger::advance`]d to); `None` before
    /// anything.
    pub fn last(&self, cpu: usize) -> Option<u64> {
        self.cpus.get(cpu).filter(|c| c.seen).map(|c| c.last)
    }

    /// Marks `cpu` finished: it delivers nothing more.
    pub fn finish(&mut self, cpu: usize) {
        let Some(c) = self.cpus.get_mut(cpu) else {
            return;
        };
        if !c.done {
            c.done = true;
            if !c.seen {
                self.unseen -= 1;
            }
            self.lasts.set(cpu, u64::MAX);
        }
    }

    /// Whether `cpu` is finished (true for a CPU out of range).
    pub fn is_finished(&self, cpu: usize) -> bool {
        self.cpus.get(cpu).is_none_or(|c| c.done)
    }

    /// Items queued in total.
    pub fn pending(&self) -> usize {
        self.held
    }

    /// Items queued for `cpu` (0 for a CPU out of range).
    pub fn queued(&self, cpu: usize) -> usize {
        self.cpus.get(cpu).map_or(0, |c| c.queue.len())
    }

    /// Bytes queued in total (the sizes given to [`Merger::push_sized`]).
    pub fn pending_bytes(&self) -> usize {
        self.bytes
    }

    /// Whether the merger holds as much as its window allows (never without a window).
    pub fn is_full(&self) -> bool {
        self.window
            .is_some_and(|w| self.held >= w.events || self.bytes >= w.bytes)
    }

    /// Times [`Merger::release`] found the window exceeded.
    pub fn overflows(&self) -> u64 {
        self.overflows
    }

    /// The smallest last time of the CPUs not finished (`u64::MAX` when all are);
    /// `None` while one of them has delivered nothing.
    fn watermark(&self) -> Option<u64> {
        (self.unseen == 0).then(|| self.lasts.min())
    }

    /// Takes the oldest front item, ties to the lower CPU, if its time is at or below
    /// `limit` (accounting).
    fn take_oldest(&mut self, limit: u64) -> Option<(usize, u64, Merged<T>)> {
        let &Reverse((ts, cpu)) = self.fronts.peek()?;
        if ts > limit {
            return None;
        }
        self.fronts.pop();
        let c = &mut self.cpus[cpu];
        let (ts, item, bytes) = c.queue.pop_front()?;
        if let Some(&(next, _, _)) = c.queue.front() {
            self.fronts.push(Reverse((next, cpu)));
        }
        self.held -= 1;
        self.bytes = self.bytes.saturating_sub(bytes);
        Some((cpu, ts, item))
    }

    /// Releases, in order, every queued item whose time is at or below the watermark
    /// (ties: lower CPU first).
    pub fn pop_ready(&mut self, mut out: impl FnMut(usize, u64, Merged<T>)) {
        let Some(wm) = self.watermark() else { return };
        self.pop_upto(wm, &mut out, |_, _| true);
    }

    /// Releases items oldest first among those at or below `limit`, each to `out`, while
    /// `more(held, bytes)` (asked after each one, with what is still held) says so.
    fn pop_upto(
        &mut self,
        limit: u64,
        mut out: impl FnMut(usize, u64, Merged<T>),
        mut more: impl FnMut(usize, usize) -> bool,
    ) {
        // Bounded: each step takes an item.
        while let Some((cpu, ts, item)) = self.take_oldest(limit) {
            out(cpu, ts, item);
            if !more(self.held, self.bytes) {
                return;
            }
        }
    }

    /// The next item in merged order if it is released (at or below the watermark):
    /// for a caller that pulls one item at a time (`report`).
    pub fn next_ready(&mut self) -> Option<(usize, u64, Merged<T>)> {
        let wm = self.watermark()?;
        self.take_oldest(wm)
    }

    /// The CPU holding the watermark back: the first CPU not finished that has
    /// delivered nothing yet, else the one with the smallest last time. `None` when
    /// every CPU is finished.
    pub fn lagging(&self) -> Option<usize> {
        let mut best: Option<(u64, usize)> = None;
        for (i, c) in self.cpus.iter().enumerate() {
            if c.done {
                continue;
            }
            if !c.seen {
                return Some(i);
            }
            if best.is_none_or(|(t, _)| c.last < t) {
                best = Some((c.last, i));
            }
        }
        best.map(|(_, i)| i)
    }

    /// Releases queued items oldest first **regardless of the watermark**, while `out`
    /// returns true (the item it is given is released either way). Items the held-back
    /// CPU delivers later may be older than some released here (the caller says so).
    pub fn pop_oldest(&mut self, mut out: impl FnMut(usize, u64, Merged<T>) -> bool) {
        let go = std::cell::Cell::new(true);
        self.pop_upto(
            u64::MAX,
            |cpu, ts, item| go.set(out(cpu, ts, item)),
            |_, _| go.get(),
        );
    }

    /// Releases what is ready ([`Merger::pop_ready`]); then, if the merger is still at
    /// or past its window, hands out one [`Released::WindowExceeded`] and releases the
    /// oldest items ahead of the watermark until it holds at most half the window (in
    /// items and in bytes). Without a window this is `pop_ready`.
    pub fn release(&mut self, mut out: impl FnMut(Released<T>)) {
        self.pop_ready(|cpu, ts, item| out(Released::Item { cpu, ts, item }));
        let Some(w) = self.window else { return };
        if !self.is_full() {
            return;
        }
        self.overflows = self.overflows.saturating_add(1);
        out(Released::WindowExceeded {
            held: self.held,
            lagging: self.lagging(),
        });
        self.pop_upto(
            u64::MAX,
            |cpu, ts, item| out(Released::Item { cpu, ts, item }),
            |held, bytes| held > w.events / 2 || bytes > w.bytes / 2,
        );
    }

    /// Releases everything queued, in order (at the end of a run: every CPU finished).
    pub fn drain(&mut self, out: impl FnMut(usize, u64, Merged<T>)) {
        for cpu in 0..self.cpus.len() {
            self.finish(cpu);
        }
        self.pop_ready(out);
    }
}

/// The minimum of `n` values, each set in O(log n).
#[derive(Debug)]
struct MinTree {
    /// Leaves at `size..size + n` (`u64::MAX` past `n`), each inner node the minimum of
    /// its two children; the root at 1.
    nodes: Vec<u64>,
    size: usize,
}

impl MinTree {
    /// `n` values, all `u64::MAX`.
    fn new(n: usize) -> Self {
        let size = n.max(1).next_power_of_two();
        Self {
            nodes: vec![u64::MAX; 2 * size],
            size,
        }
    }

    fn set(&mut self, i: usize, v: u64) {
        let mut at = self.size + i;
        self.nodes[at] = v;
        // Bounded: log2(size) steps to the root.
        while at > 1 {
            at /= 2;
            self.nodes[at] = self.nodes[2 * at].min(self.nodes[2 * at + 1]);
        }
    }

    fn min(&self) -> u64 {
        self.nodes[1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_only_below_watermark_in_order() {
        let mut m = Merger::new(2);
        m.push(0, 10, Merged::Event("a"));
        m.push(0, 30, Merged::Event("c"));
        let mut out = vec![];
        m.pop_ready(|c, t, e| out.push((c, t, e)));
        assert!(out.is_empty(), "cpu 1 not seen yet");
        m.push(1, 20, Merged::Event("b"));
        m.pop_ready(|c, t, e| out.push((c, t, e)));
        assert_eq!(
            out,
            vec![(0, 10, Merged::Event("a")), (1, 20, Merged::Event("b"))]
        );
        m.finish(1);
        m.pop_ready(|c, t, e| out.push((c, t, e)));
        assert_eq!(out.last(), Some(&(0, 30, Merged::Event("c"))));
        assert_eq!(m.pending(), 0);
    }

    #[test]
    fn pop_oldest_ignores_the_watermark_and_stops_when_told() {
        let mut m = Merger::new(3);
        for t in [10, 20, 30] {
            m.push(0, t, Merged::Event(t));
        }
        m.push(2, 15, Merged::Event(15));
        assert_eq!(m.lagging(), Some(1), "cpu 1 never delivered");
        let mut out = vec![];
        m.pop_ready(|_, t, _| out.push(t));
        assert!(out.is_empty());
        m.pop_oldest(|_, t, _| {
            out.push(t);
            out.len() < 3
        });
        assert_eq!(out, vec![10, 15, 20]);
        assert_eq!(m.pending(), 1);
        m.push(1, 5, Merged::Event(5));
        assert_eq!(m.lagging(), Some(1));
        m.finish(1);
        assert_eq!(m.lagging(), Some(2));
    }

    #[test]
    fn ties_go_to_lower_cpu() {
        let mut m = Merger::new(3);
        for c in [2, 0, 1] {
            m.push(c, 5, Merged::Event(c));
        }
        let mut out = vec![];
        m.drain(|c, _, _| out.push(c));
        assert_eq!(out, vec![0, 1, 2]);
    }

    /// A time going backwards keeps its own time (printed as delivered) and its place in
    /// its CPU's order; the watermark never goes back. Drained, the order is
    /// trace-cmd's: the CPU whose next item is oldest first.
    #[test]
    fn times_going_backwards_keep_their_time() {
        let mut m = Merger::new(2);
        m.push(0, 10, Merged::Event("a"));
        m.push(0, 2, Merged::Event("b"));
        m.push(1, 5, Merged::Event("c"));
        assert_eq!(m.last(0), Some(10));
        let mut out = vec![];
        m.pop_ready(|c, t, e| out.push((c, t, e)));
        assert_eq!(out, vec![(1, 5, Merged::Event("c"))]);
        m.push(1, 3, Merged::Event("d"));
        m.drain(|c, t, e| out.push((c, t, e)));
        assert_eq!(
            out[1..],
            [
                (1, 3, Merged::Event("d")),
                (0, 10, Merged::Event("a")),
                (0, 2, Merged::Event("b")),
            ]
        );
    }

    #[test]
    fn next_ready_pulls_one_at_a_time() {
        let mut m = Merger::new(2);
        m.push(0, 7, Merged::Event(0));
        assert_eq!(m.next_ready(), None, "cpu 1 not seen");
        m.push(1, 7, Merged::Event(1));
        m.push(1, 9, Merged::Event(2));
        assert_eq!(m.next_ready(), Some((0, 7, Merged::Event(0))));
        assert_eq!(m.next_ready(), Some((1, 7, Merged::Event(1))));
        assert_eq!(m.next_ready(), None, "cpu 0 may still deliver before 9");
        m.finish(0);
        assert_eq!(m.next_ready(), Some((1, 9, Merged::Event(2))));
        assert_eq!(m.next_ready(), None);
    }

    /// A silent CPU never makes a windowed merger hold more than its window: past it,
    /// one marker and the oldest items down to half the window, in items and in bytes.
    #[test]
    fn the_window_bounds_a_silent_cpu() {
        let w = MergeWindow {
            events: 8,
            bytes: 100,
        };
        let mut m = Merger::with_window(2, w);
        let mut out = vec![];
        let mut most = 0;
        for t in 0..100u64 {
            m.push_sized(0, t, Merged::Event(t), 1);
            most = most.max(m.pending());
            m.release(|r| out.push(r));
        }
        assert!(most <= w.events, "held {most}");
        let markers: Vec<_> = out
            .iter()
            .filter(|r| matches!(r, Released::WindowExceeded { .. }))
            .collect();
        assert_eq!(
            markers[0],
            &Released::WindowExceeded {
                held: 8,
                lagging: Some(1)
            }
        );
        assert_eq!(markers.len() as u64, m.overflows());
        assert_eq!(m.pending(), 100 - (out.len() - markers.len()));
        // Items stay in order, markers between them.
        let ts: Vec<u64> = out
            .iter()
            .filter_map(|r| match r {
                Released::Item { ts, .. } => Some(*ts),
                _ => None,
            })
            .collect();
        assert!(ts.windows(2).all(|p| p[0] < p[1]));
        // Bytes: one big item fills the byte window; released down to half.
        m.push_sized(0, 200, Merged::Event(200), 100);
        let mut n = 0;
        m.release(|r| n += usize::from(matches!(r, Released::Item { .. })));
        assert!(m.pending_bytes() <= w.bytes / 2 && n > 0);
        // Without a window, release never goes ahead of the watermark.
        let mut m = Merger::new(2);
        for t in 0..1000u64 {
            m.push_sized(0, t, Merged::Event(t), 1 << 20);
        }
        m.release(|_| panic!("released ahead of the watermark"));
        assert_eq!(m.pending(), 1000);
    }

    /// The heap and the min-tree release what a scan of every CPU releases: random
    /// pushes (many ties, times going backwards), advances and finishes on 37 CPUs,
    /// pulled with `next_ready` and `pop_ready`, against the definition (the oldest
    /// front at or below the smallest last time of the CPUs not finished, ties to the
    /// lower CPU).
    #[test]
    fn heap_releases_what_a_scan_releases() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        const N: usize = 37;
        let mut m = Merger::new(N);
        // The reference: queues, last times, seen and done flags.
        let mut q: Vec<VecDeque<(u64, u32)>> = vec![VecDeque::new(); N];
        let (mut last, mut seen, mut done) = ([0u64; N], [false; N], [false; N]);
        let (mut id, mut released) = (0u32, 0);
        for step in 0..20_000 {
            let cpu = rnd(N as u64) as usize;
            match rnd(10) {
                0..=5 => {
                    let ts = rnd(50) + step / 10;
                    m.push(cpu, ts, Merged::Event(id));
                    q[cpu].push_back((ts, id));
                    last[cpu] = if seen[cpu] { last[cpu].max(ts) } else { ts };
                    seen[cpu] = true;
                    id += 1;
                }
                6 => {
                    let ts = rnd(50) + step / 10;
                    m.advance(cpu, ts);
                    last[cpu] = if seen[cpu] { last[cpu].max(ts) } else { ts };
                    seen[cpu] = true;
                }
                7 if rnd(20) == 0 => {
                    m.finish(cpu);
                    done[cpu] = true;
                }
                _ => {
                    let want = (0..N)
                        .filter(|&c| !done[c])
                        .try_fold(u64::MAX, |w, c| seen[c].then(|| w.min(last[c])))
                        .and_then(|wm| {
                            (0..N)
                                .filter_map(|c| q[c].front().map(|f| (f.0, c)))
                                .filter(|&(ts, _)| ts <= wm)
                                .min()
                        })
                        .map(|(_, c)| {
                            let (ts, e) = q[c].pop_front().unwrap();
                            (c, ts, Merged::Event(e))
                        });
                    released += usize::from(want.is_some());
                    assert_eq!(m.next_ready(), want, "step {step}");
                }
            }
        }
        let mut got = vec![];
        m.drain(|c, ts, e| got.push((c, ts, e)));
        let mut want = vec![];
        while let Some((_, c)) = (0..N).filter_map(|c| q[c].front().map(|f| (f.0, c))).min() {
            let (ts, e) = q[c].pop_front().unwrap();
            want.push((c, ts, Merged::Event(e)));
        }
        assert_eq!(got, want);
        assert_eq!(m.pending(), 0);
        assert!(
            released > 1000 && got.len() > 100,
            "{released} {}",
            got.len()
        );
    }

    #[test]
    fn out_of_range_cpus_are_ignored() {
        let mut m = Merger::new(1);
        m.push(5, 1, Merged::Event(()));
        m.finish(5);
        m.advance(5, 1);
        assert_eq!(m.pending(), 0);
        assert!(m.is_finished(5));
        assert_eq!(m.last(5), None);
    }
}
