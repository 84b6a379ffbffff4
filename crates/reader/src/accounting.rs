//! What a CPU's reading accounts for: its position (P2), its statistics and the
//! writer's counters, the final walk's end, trailing losses.

use std::sync::atomic::Ordering::Acquire;

use hyptrace_abi::layout::{self, ctl, footer, FOOTER_MAGIC};
use hyptrace_abi::SharedMem;

use crate::{
    ctl_writer_index, postmortem, valid_page, Attempts, AttemptsProblem, Callbacks, CpuStats,
    ReadError, RingBuffer,
};

impl<M: SharedMem, C: Callbacks> RingBuffer<M, C> {
    /// Where the consuming read of `cpu` stands: its reader page, the data bytes of it
    /// consumed, and the index of the next event (losses found but not yet reported are
    /// not counted as consumed). A post-mortem walk from here
    /// ([`postmortem::walk_cpu`]) reads exactly what this reader has not consumed (in the
    /// final walk: the page being walked). `None` for a CPU out of range.
    pub fn position(&self, cpu: u32) -> Option<postmortem::Position> {
        let st = self.cpus.get(cpu as usize)?;
        let f = self.layout.footer_off(st.reader);
        let expected = st.expected.saturating_sub(st.pending_lost);
        Some(postmortem::Position {
            reader: st.reader,
            consumed: st.read as u64,
            expected,
            // P1: the page named exactly. Acquire: paired with the Release store of
            // page_seq in Writer::move_tail (first_index is stored before it).
            page_seq: self.mem.load(f + footer::PAGE_SEQ, Acquire),
            first_index: self.mem.load(f + footer::FIRST_INDEX, Acquire),
            // Printing is the caller's: by default what was consumed.
            printed: expected,
        })
    }

    /// Statistics of `cpu` so far.
    pub fn stats(&self, cpu: u32) -> CpuStats {
        self.cpus
            .get(cpu as usize)
            .map(|c| c.stats)
            .unwrap_or_default()
    }

    /// The attempts `cpu`'s writer has published so far (invariant R3), read now from
    /// its control block: `skipped` (Acquire), then `attempted`. Guest numbers: a
    /// published `skipped` above `attempted`, or a counter below what an earlier call
    /// read, is kept as the CPU's [`Attempts::problem`] (the first one, for good); the
    /// values are returned as read all the same. The counters cannot be checked
    /// against what was written here: that needs the writer stopped (R3's cases, in the
    /// caller's accounting).
    pub fn attempts(&mut self, cpu: u32) -> Result<Attempts, ReadError> {
        self.check_cpu(cpu)?;
        let c = self.layout.ctl(cpu);
        // Acquire: paired with the Release store of skipped in Writer::skip, which comes
        // after its store of attempted: that attempt is visible to the load below (R3).
        let skipped = self.mem.load(c + ctl::SKIPPED, Acquire);
        // Acquire: pairs with no store (attempted is stored Relaxed); loaded after
        // skipped, which is what keeps skipped <= attempted for an honest writer.
        let attempted = self.mem.load(c + ctl::ATTEMPTED, Acquire);
        let st = &mut self.cpus[cpu as usize];
        let was = st.attempts;
        let problem = if skipped > attempted {
            Some(AttemptsProblem::SkippedAboveAttempted { attempted, skipped })
        } else if attempted < was.attempted || skipped < was.skipped {
            Some(AttemptsProblem::Decreased {
                was_attempted: was.attempted,
                was_skipped: was.skipped,
                attempted,
                skipped,
            })
        } else {
            None
        };
        st.attempts = Attempts {
            attempted,
            skipped,
            problem: was.problem.or(problem),
        };
        Ok(st.attempts)
    }

    /// Reads the writer's own counters from `cpu`'s control block into the stats (use
    /// once the writer stopped: they are final then). Hostile values are taken as they
    /// are; the caller compares them with what was read.
    pub fn sync_writer_counters(&mut self, cpu: u32) -> Result<CpuStats, ReadError> {
        self.check_cpu(cpu)?;
        let c = self.layout.ctl(cpu);
        let st = &mut self.cpus[cpu as usize];
        // Acquire: the writer stores its counters Relaxed: pairs with no store; exact once
        // writer_state says FINISHED (Release in Writer::finish) or the vCPU stopped (R1).
        st.stats.written = self.mem.load(c + ctl::ENTRIES, Acquire);
        st.stats.overrun = self.mem.load(c + ctl::OVERRUN, Acquire);
        st.stats.dropped = self.mem.load(c + ctl::DROPPED, Acquire);
        st.stats.pages_touched = self.mem.load(c + ctl::PAGES_TOUCHED, Acquire);
        Ok(st.stats)
    }

    /// Switches `cpu` to the final, read-only walk: the writer has stopped (finished or
    /// crashed), so instead of swapping, the reader reads what is left of its reader
    /// page and then every ring page holding unread events, in ring order — the pages
    /// whose sequence number is above the reader page's, sorted by it. Needs nothing
    /// from the writer but the footers.
    pub fn finalize(&mut self, cpu: u32) -> Result<(), ReadError> {
        self.check_cpu(cpu)?;
        let l = self.layout;
        let st = &mut self.cpus[cpu as usize];
        if std::mem::take(&mut st.swap_in_flight) {
            // The writer may have run the requested swap before it stopped: then the
            // reader page it made is where reading goes on.
            // Acquire: paired with the Release store of reader_page in swap_reader_page_hinted
            // (a swap the writer served after our request: M1).
            let actual = valid_page(
                &l,
                cpu,
                self.mem.load(l.ctl(cpu) + ctl::READER_PAGE, Acquire),
            )?;
            if actual != st.reader {
                st.stats.swaps += 1;
                Self::enter_page(&self.mem, &l, st, actual)?;
            }
        }
        // With released pages the page being read is a ring page: the pages after it
        // (page_seq above its own) are the rest, and every page at or below `released`
        // (the reader page among them) was read.
        // Acquire (page_seq, id_magic): paired with the Release stores of page_seq in
        // Writer::move_tail and Writer::resume: a page's set-up comes before its page_seq.
        let reader_seq = self
            .mem
            .load(l.footer_off(st.reader) + footer::PAGE_SEQ, Acquire);
        let mut pages: Vec<(u64, u32)> = Vec::new();
        let first = l.first_page(cpu);
        for id in first..first + l.pages_per_cpu {
            if id == st.reader {
                continue;
            }
            let f = l.footer_off(id);
            let im = self.mem.load(f + footer::ID_MAGIC, Acquire);
            if im != u64::from(id) | (u64::from(FOOTER_MAGIC) << 32) {
                return Err(ReadError::BadFooter { cpu, page: id });
            }
            // Acquire: paired with the Release stores of page_seq in Writer::move_tail (W4).
            let seq = self.mem.load(f + footer::PAGE_SEQ, Acquire);
            if seq > reader_seq {
                pages.push((seq, id));
            }
        }
        pages.sort_unstable();
        for w in pages.windows(2) {
            if w[0].0 == w[1].0 {
                return Err(ReadError::DuplicateSeq {
                    cpu,
                    a: w[0].1,
                    b: w[1].1,
                });
            }
        }
        st.final_queue = Some(pages.into_iter().map(|(_, id)| id).collect());
        Ok(())
    }

    /// Whether `cpu` is in the final walk and has nothing left.
    pub fn finished(&self, cpu: u32) -> bool {
        self.cpus.get(cpu as usize).is_some_and(|c| {
            c.final_queue.as_ref().is_some_and(|q| q.is_empty()) && c.read >= c.copied
        })
    }

    /// The writer's event index of `cpu`: events it took in, committed or dropped
    /// (`entries + dropped` of its control block; hostile values saturate). 0 for a CPU
    /// out of range.
    pub fn writer_index(&self, cpu: u32) -> u64 {
        if cpu >= self.layout.nr_cpus {
            return 0;
        }
        ctl_writer_index(&self.mem, &self.layout, cpu)
    }

    /// Whether the writer of `cpu` marked itself finished (rather than being stopped or
    /// crashing in the middle of a write).
    pub fn writer_finished(&self, cpu: u32) -> bool {
        // Acquire: paired with the Release swap of writer_state in Writer::finish (R1).
        cpu < self.layout.nr_cpus
            && self
                .mem
                .load(self.layout.ctl(cpu) + ctl::WRITER_STATE, Acquire)
                == layout::WRITER_FINISHED
    }

    /// At the end of the final walk: the events lost after the last page (stop mode:
    /// dropped while the ring was full, with no page started after them), from the
    /// writer's index (`entries + dropped`) minus the events accounted for. Counted in
    /// the stats once; 0 before the walk ended or when called again.
    pub fn take_trailing_loss(&mut self, cpu: u32) -> u64 {
        if !self.finished(cpu) {
            return 0;
        }
        let total = self.writer_index(cpu);
        let st = &mut self.cpus[cpu as usize];
        if st.trailing_done {
            return 0;
        }
        st.trailing_done = true;
        // R1: drops after the last page complete written = read + lost.
        let n = total
            .saturating_sub(st.expected)
            .saturating_add(std::mem::take(&mut st.pending_lost));
        st.expected = st.expected.max(total);
        st.stats.lost = st.stats.lost.saturating_add(n);
        n
    }
}
