//! The drain loop's pace: backlog, the adaptive wait between rounds, what is queued.

use std::time::{Duration, Instant};

use hyptrace_abi::layout::ctl;
use hyptrace_abi::SharedMem;
use hyptrace_reader::Callbacks;

use super::{Output, Session, MIN_POLL, POLLS_PER_FILL, RATE_HALF_LIFE, REQUEST_POLL};

impl<M: SharedMem, C: Callbacks> Session<M, C> {
    /// Whether the last round over a CPU stopped at its bound with more to read: the
    /// caller should come back without waiting.
    pub fn backlog(&self) -> bool {
        (0u32..)
            .zip(&self.cpus)
            .any(|(cpu, c)| self.reads.is_live(cpu) && !self.reads.failed(cpu) && c.more)
    }

    /// How long the drain loop may wait before its next round, from how full each live
    /// ring is and how fast its writer filled it lately (no exit: the writer's `bytes`
    /// counter in the control block, against the bytes this reader consumed): `idle`
    /// (`--poll-ms`) when no writer writes; [`MIN_POLL`] ("continuous" draining) while
    /// a writer writes and its ring is at least half full; in between, a [`POLLS_PER_FILL`]th of the time
    /// the free part of the fullest ring would take to fill at its writer's recent
    /// rate; `0` when a round stopped at its bound ([`Session::backlog`]); at most
    /// [`REQUEST_POLL`] while a mailbox request is in flight, or a quarter of the time it
    /// has been (a vCPU off its core answers late: polling it often only takes the core). The guest's counters are
    /// only a hint here: hostile values can make the loop poll at most every
    /// [`MIN_POLL`] (each round is bounded), nothing else. With `--drain none` no ring
    /// is read while the guest runs, so however fast a writer fills it, the loop waits
    /// `idle`: polling sooner would read nothing and only take CPU from the vCPUs.
    pub fn next_wait(&mut self, idle: Duration) -> Duration {
        self.next_wait_at(idle, Instant::now())
    }

    /// [`Session::next_wait`] at the time `now` (tests step a clock of their own).
    pub fn next_wait_at(&mut self, idle: Duration, now: Instant) -> Duration {
        if self.backlog() {
            return Duration::ZERO;
        }
        if !self.reads_live() {
            self.fill_time = None;
            return idle.max(MIN_POLL);
        }
        let l = *self.reader.layout();
        let cap = (l.pages_per_cpu as u64).saturating_mul(l.data_capacity() as u64);
        let mut wait = idle;
        let mut fill: Option<f64> = None;
        for cpu in 0..self.reader.nr_cpus() {
            if !self.reads.is_live(cpu) || self.reads.failed(cpu) {
                continue;
            }
            let st = &mut self.cpus[cpu as usize];
            let in_flight = if self.reader.request_in_flight(cpu) {
                // Due within microseconds while the writer runs; one unanswered for
                // longer means its vCPU is off its core (or holds its mailbox while it
                // catches up): asking every 50 µs would keep a vCPU that shares the
                // reader's core from answering. A quarter of the time it has waited.
                let since = *st.requested.get_or_insert(now);
                let backoff = now.saturating_duration_since(since) / 4;
                wait = wait.min(REQUEST_POLL.max(backoff));
                true
            } else {
                st.requested = None;
                false
            };
            // Relaxed: a hint for the poll period only (the writer stores it Relaxed
            // after each commit); nothing is read on the strength of it.
            let written = self.reader.mem().load(
                l.ctl(cpu) + ctl::BYTES,
                std::sync::atomic::Ordering::Relaxed,
            );
            // What the ring holds unread: the bytes written and not read, but at most
            // the pages the writer moved onto since the reader's page (by their
            // `page_seq`) and the one it is on — the byte counters' difference alone also
            // holds what the writer overwrote before the reader got to it: after one lap
            // it said "full" for ever.
            let dc = l.data_capacity() as u64;
            let pages = self.reader.pages_behind(cpu).saturating_add(1);
            let unread = written
                .saturating_sub(self.reader.stats(cpu).bytes)
                .min(pages.saturating_mul(dc))
                .min(cap);
            let st = &mut self.cpus[cpu as usize];
            if let Some((at, before)) = st.fill {
                let dt = now.saturating_duration_since(at).as_secs_f64();
                if dt > 0.0 {
                    let inst = written.saturating_sub(before) as f64 / dt;
                    // Up at once, down by half per RATE_HALF_LIFE: a burst is caught at
                    // its first sign, a pause is not taken for the end of the writing.
                    // By time, not per round: rounds come every MIN_POLL while the ring
                    // fills, and halving per round forgot a fast writer within a
                    // fraction of a millisecond its vCPU was off its core — the loop
                    // then slept the idle period while the ring filled in less.
                    let decay = 0.5f64.powf(dt / RATE_HALF_LIFE.as_secs_f64());
                    st.rate = inst.max(st.rate * decay);
                }
            }
            st.fill = Some((now, written));
            // A writer that stopped writing fills nothing, however full its ring; nor is
            // anything read of a ring whose swap waits for its writer's answer (polled
            // as above), however full it is.
            if st.rate < 1.0 || in_flight {
                continue;
            }
            let whole = cap as f64 / st.rate;
            fill = Some(fill.map_or(whole, |f| f.min(whole)));
            if unread.saturating_mul(2) >= cap {
                wait = MIN_POLL;
            } else {
                let to_full = (cap - unread) as f64 / st.rate;
                let w = Duration::try_from_secs_f64(to_full / f64::from(POLLS_PER_FILL));
                wait = wait.min(w.unwrap_or(idle));
            }
        }
        self.fill_time = fill.and_then(|f| Duration::try_from_secs_f64(f).ok());
        wait.max(MIN_POLL).min(idle.max(MIN_POLL))
    }

    /// The time the fastest writer's whole ring takes to fill at its recent rate, as
    /// [`Session::next_wait`] last estimated it; `None` while no writer writes. What the
    /// standby drainer ([`crate::drain::standby`]) measures the drain loop's lateness against.
    pub fn fill_time(&self) -> Option<Duration> {
        self.fill_time
    }

    /// Events (and loss markers) the text merger holds back now, and their payload bytes.
    pub fn queued(&self) -> (usize, usize) {
        match &self.output {
            Output::Text { merger, .. } => (merger.pending(), merger.pending_bytes()),
            Output::Pages(_) => (0, 0),
        }
    }

    /// How long the reader has waited so far for the page sink to take pages (its
    /// back-pressure, [`hyptrace_output::OutputWaits`]); nothing for text output.
    pub fn output_waits(&self) -> hyptrace_output::OutputWaits {
        match &self.output {
            Output::Pages(sink) => sink.waits(),
            Output::Text { .. } => hyptrace_output::OutputWaits::default(),
        }
    }

    /// Times the text merger's cap released events ahead of a CPU that held them back.
    pub fn merge_overflows(&self) -> u64 {
        match &self.output {
            Output::Text { merger, .. } => merger.overflows(),
            Output::Pages(_) => 0,
        }
    }
}
