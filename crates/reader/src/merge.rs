//! Merging the per-CPU event streams by timestamp, live.
//!
//! Each CPU's events arrive in timestamp order, so once CPU c delivered an event at
//! time t, no later event of c is older than t. An event is released when its time is
//! at or below the *watermark*: the smallest last-seen time over the CPUs that are not
//! finished. The output is therefore exactly ordered (ties: lower CPU first) while the
//! run goes on; events wait only while some CPU is silent and not finished. A caller
//! that must bound its memory releases the oldest events ahead of the watermark with
//! [`Merger::pop_oldest`] (the host does so past a fixed cap, with a marker line).

use std::collections::{BinaryHeap, VecDeque};

/// An item of a CPU's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Merged<T> {
    /// An event.
    Event(T),
    /// `n` events of this CPU were lost here.
    Lost(u64),
}

#[derive(Debug)]
struct Cpu<T> {
    queue: VecDeque<(u64, Merged<T>)>,
    last: u64,
    seen: bool,
    done: bool,
}

/// Watermark merger across CPUs.
#[derive(Debug)]
pub struct Merger<T> {
    cpus: Vec<Cpu<T>>,
}

impl<T> Merger<T> {
    /// A merger for `n` CPUs.
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
        }
    }

    /// Queues an event of `cpu` at `ts` (timestamps of one CPU must not decrease; a
    /// decreasing one is queued at the CPU's last time).
    pub fn push(&mut self, cpu: usize, ts: u64, item: Merged<T>) {
        let c = &mut self.cpus[cpu];
        let ts = if c.seen && ts < c.last { c.last } else { ts };
        c.last = ts;
        c.seen = true;
        c.queue.push_back((ts, item));
    }

    /// Marks `cpu` finished: it delivers nothing more.
    pub fn finish(&mut self, cpu: usize) {
        self.cpus[cpu].done = true;
    }

    /// Events queued in total.
    pub fn pending(&self) -> usize {
        self.cpus.iter().map(|c| c.queue.len()).sum()
    }

    fn watermark(&self) -> Option<u64> {
        let mut w: Option<u64> = None;
        for c in &self.cpus {
            if c.done {
                continue;
            }
            if !c.seen {
                return None;
            }
            w = Some(w.map_or(c.last, |w| w.min(c.last)));
        }
        Some(w.unwrap_or(u64::MAX))
    }

    /// Releases, in order, every queued event at or below the watermark.
    pub fn pop_ready(&mut self, mut out: impl FnMut(usize, u64, Merged<T>)) {
        let Some(wm) = self.watermark() else { return };
        let mut heap: BinaryHeap<std::cmp::Reverse<(u64, usize)>> = BinaryHeap::new();
        for (i, c) in self.cpus.iter().enumerate() {
            if let Some(&(ts, _)) = c.queue.front() {
                if ts <= wm {
                    heap.push(std::cmp::Reverse((ts, i)));
                }
            }
        }
        while let Some(std::cmp::Reverse((_, i))) = heap.pop() {
            let c = &mut self.cpus[i];
            if let Some((ts, item)) = c.queue.pop_front() {
                out(i, ts, item);
            }
            if let Some(&(ts, _)) = c.queue.front() {
                if ts <= wm {
                    heap.push(std::cmp::Reverse((ts, i)));
                }
            }
        }
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

    /// Releases queued events oldest first **regardless of the watermark**, while `out`
    /// returns true (the event it is given is released either way). For a caller that
    /// bounds its memory: a CPU that neither delivers nor finishes would otherwise hold
    /// every other CPU's events back without limit. Events the held-back CPU delivers
    /// later may be older than some released here (the caller says so in its output).
    pub fn pop_oldest(&mut self, mut out: impl FnMut(usize, u64, Merged<T>) -> bool) {
        let mut heap: BinaryHeap<std::cmp::Reverse<(u64, usize)>> = BinaryHeap::new();
        for (i, c) in self.cpus.iter().enumerate() {
            if let Some(&(ts, _)) = c.queue.front() {
                heap.push(std::cmp::Reverse((ts, i)));
            }
        }
        while let Some(std::cmp::Reverse((_, i))) = heap.pop() {
            let c = &mut self.cpus[i];
            let Some((ts, item)) = c.queue.pop_front() else {
                continue;
            };
            if let Some(&(next, _)) = c.queue.front() {
                heap.push(std::cmp::Reverse((next, i)));
            }
            if !out(i, ts, item) {
                return;
            }
        }
    }

    /// Releases everything queued, in order (at the end of a run).
    pub fn drain(&mut self, out: impl FnMut(usize, u64, Merged<T>)) {
        for c in &mut self.cpus {
            c.done = true;
        }
        self.pop_ready(out);
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
}
