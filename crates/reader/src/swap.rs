//! Pages changing hands with the writer: the poke (`update_footers`), the reader page
//! refreshed into the local buffer, advancing to the next page (a swap, or a page the
//! writer released), the writer found on the reader page.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use hyptrace_abi::layout::{self, ctl, footer, RingGeometry};
use hyptrace_abi::page::{self, COMMIT_LEN_MASK, COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_abi::SharedMem;

use crate::{
    valid_page, Callbacks, CpuState, CpuStats, ReadError, RingBuffer, SwapReply, SwapStatus,
};

impl<M: SharedMem, C: Callbacks> RingBuffer<M, C> {
    /// Polls `cpu`: runs `update_footers`, refreshes the stats from the reader page
    /// footer (checking that the counters only grow), and wakes waiters if the writer
    /// committed events since the last poke. Returns the stats.
    pub fn poke(&mut self, cpu: u32) -> Result<CpuStats, ReadError> {
        self.check_cpu(cpu)?;
        if !self.cb.update_footers(cpu)? {
            // In flight (mailbox): the footer is refreshed by a later poke.
            return Ok(self.cpus[cpu as usize].stats);
        }
        let st = &mut self.cpus[cpu as usize];
        // Acquire: paired with the Release store of reader_page in swap_reader_page_hinted
        // (Direct: this thread; Mailbox: ordered by Mailbox::acked, M1).
        let reader = valid_page(
            &self.layout,
            cpu,
            self.mem
                .load(self.layout.ctl(cpu) + ctl::READER_PAGE, Acquire),
        )?;
        let f = self.layout.footer_off(reader);
        // Acquire: update_footers stores these Relaxed; they are ordered by the Release/Acquire
        // pair of mbox_ack (Writer::serve_request / Mailbox::acked) or by running here (Direct).
        let get = |o: usize| self.mem.load(f + o, Acquire);
        let (entries, touched, overrun, dropped) = (
            get(footer::ENTRIES),
            get(footer::PAGES_TOUCHED),
            get(footer::OVERRUN),
            get(footer::DROPPED),
        );
        for (what, old, new) in [
            ("entries", st.stats.written, entries),
            ("pages_touched", st.stats.pages_touched, touched),
            ("overrun", st.stats.overrun, overrun),
            ("dropped", st.stats.dropped, dropped),
        ] {
            if new < old {
                return Err(ReadError::CounterBackwards {
                    cpu,
                    what,
                    old,
                    new,
                });
            }
        }
        st.stats.written = entries;
        st.stats.pages_touched = touched;
        st.stats.overrun = overrun;
        st.stats.dropped = dropped;
        let stats = st.stats;
        if entries != st.last_entries {
            st.last_entries = entries;
            self.waiter.notify();
        }
        Ok(stats)
    }

    /// Whether a swap request for `cpu` is in flight (mailbox callbacks).
    pub fn request_in_flight(&self, cpu: u32) -> bool {
        self.cpus
            .get(cpu as usize)
            .is_some_and(|c| c.swap_in_flight)
    }

    /// The commit (tail) page of `cpu` as the writer last published it.
    pub fn commit_page(&self, cpu: u32) -> Result<u32, ReadError> {
        self.check_cpu(cpu)?;
        // Acquire: paired with the Release store of tail_page in Writer::move_tail.
        valid_page(
            &self.layout,
            cpu,
            self.mem
                .load(self.layout.ctl(cpu) + ctl::TAIL_PAGE, Acquire),
        )
    }

    /// Copies newly committed bytes of the reader page into the local buffer.
    pub(super) fn refresh(mem: &M, l: &RingGeometry, st: &mut CpuState) -> Result<(), ReadError> {
        let off = l.page_off(st.reader);
        // Acquire: paired with the Release store of commit in Writer::write (W1): every byte
        // below it is copied as written.
        let commit = mem.load(off + COMMIT_OFFSET, Acquire);
        let len = (commit & COMMIT_LEN_MASK) as usize;
        if len > l.data_capacity()
            || len < st.copied
            || commit & !(COMMIT_LEN_MASK | page::RB_MISSED_FLAGS) != 0
        {
            return Err(ReadError::BadCommit {
                cpu: st.cpu,
                page: st.reader,
                commit,
                had: st.copied,
            });
        }
        if len > st.copied {
            if st.copied == 0 {
                mem.read_bytes(off, &mut st.buf[..8]);
                st.clock = u64::from_le_bytes(st.buf[..8].try_into().unwrap_or([0; 8]));
            }
            let (a, b) = (PAGE_HEADER_SIZE + st.copied, PAGE_HEADER_SIZE + len);
            mem.read_bytes(off + a, &mut st.buf[a..b]);
            st.copied = len;
        }
        Ok(())
    }

    /// Makes `page` the page being read (after a swap or in the final walk), computing
    /// the loss before it from its first event index.
    pub(super) fn enter_page(
        mem: &M,
        l: &RingGeometry,
        st: &mut CpuState,
        page: u32,
    ) -> Result<(), ReadError> {
        let f = l.footer_off(page);
        // Acquire: first_index is stored before the Release of page_seq / tail_page in
        // Writer::move_tail. R1: losses are counted here, from first_index, exactly.
        let first = mem.load(f + footer::FIRST_INDEX, Acquire);
        let expected = st.expected;
        if first < expected {
            return Err(ReadError::IndexBackwards {
                cpu: st.cpu,
                page,
                first,
                expected,
            });
        }
        st.pending_lost = st.pending_lost.saturating_add(first - expected);
        st.expected = first;
        st.reader = page;
        st.copied = 0;
        st.read = 0;
        st.page_events = 0;
        st.stats.pages_read += 1;
        Ok(())
    }

    /// Moves to the next page: a swap while live, the next page of the final walk
    /// after. Returns false when there is none now.
    pub(super) fn advance(&mut self, cpu: u32) -> Result<bool, ReadError> {
        let st = &mut self.cpus[cpu as usize];
        if let Some(q) = st.final_queue.as_mut() {
            let Some(next) = q.pop_front() else {
                return Ok(false);
            };
            Self::enter_page(&self.mem, &self.layout, st, next)?;
            return Ok(true);
        }
        if self.cb.releases(cpu) {
            return self.advance_released(cpu);
        }
        self.advance_swap(cpu)
    }

    /// One `swap_reader` request: the page after the reader page becomes the reader
    /// page when the answer says swapped.
    fn advance_swap(&mut self, cpu: u32) -> Result<bool, ReadError> {
        let reply = self.cb.swap_reader(cpu)?;
        // M1: while a swap request is in flight the reader page is not touched: next_event
        // and next_page only call advance until the answer came.
        self.cpus[cpu as usize].swap_in_flight = reply == SwapReply::Pending;
        match reply {
            SwapReply::Done(SwapStatus::Busy) | SwapReply::Pending => Ok(false),
            SwapReply::Done(SwapStatus::Contended) => {
                let st = &mut self.cpus[cpu as usize];
                st.stats.contended = st.stats.contended.saturating_add(1);
                Ok(false)
            }
            SwapReply::Done(SwapStatus::Swapped { page }) => {
                // The page the swap reports (read from reader_page with Acquire by the
                // in-process callbacks, paired with its Release store in
                // swap_reader_page_hinted; the VMM's word for an attached consumer, C1).
                let page = valid_page(&self.layout, cpu, u64::from(page))?;
                let st = &mut self.cpus[cpu as usize];
                if page == st.reader {
                    return Err(ReadError::SwapNoProgress { cpu, page });
                }
                st.stats.swaps += 1;
                Self::enter_page(&self.mem, &self.layout, st, page)?;
                Ok(true)
            }
        }
    }

    /// [`RingBuffer::advance`] with released pages (docs/design.md, "Released pages";
    /// stop mode, `--swap guest`): no request, no round trip. The page being read is
    /// read to its end and the writer has left it (the callers checked, tail before
    /// commit), so the page its link names is the one the writer moved onto next: the
    /// link of a page the writer left changes only in a swap that takes the page after
    /// it as head, which the writer runs only on released pages — and this one is not
    /// released yet. That page is read next, in place (the writer never rewrites a page
    /// above `released`), and the page left is released: its `page_seq` is stored in
    /// `released` (Release) after everything of it was read, its link included (R2).
    /// The writer swaps released pages back by itself when its tail meets them.
    fn advance_released(&mut self, cpu: u32) -> Result<bool, ReadError> {
        let l = self.layout;
        let st = &mut self.cpus[cpu as usize];
        let f = l.footer_off(st.reader);
        // Acquire: paired with the SeqCst link change of the writer's own swap (it ran
        // before the writer moved along this link and published tail_page with Release,
        // which writer_on_reader loaded with Acquire) and the init (W2).
        let lk = self.mem.load(f + footer::NEXT, Acquire);
        let next = valid_page(&l, cpu, layout::link_id(lk))?;
        if lk & layout::LINK_FLAGS != 0 || next == st.reader {
            // Not a link the writer moved along: only a writer that is not ours leaves one.
            return Err(ReadError::BadLink {
                cpu,
                page: st.reader,
                link: lk,
            });
        }
        // Acquire: paired with the Release stores of page_seq in Writer::move_tail.
        let left = self.mem.load(f + footer::PAGE_SEQ, Acquire);
        Self::enter_page(&self.mem, &l, st, next)?;
        if left > st.released {
            st.released = left;
            st.stats.swaps = st.stats.swaps.saturating_add(1);
            // Release: paired with the Acquire load of released in Writer::swap_released:
            // every read of the page left (and of its link) comes before the writer may
            // reuse it (R2).
            self.mem.store(l.ctl(cpu) + ctl::RELEASED, left, Release);
        }
        Ok(true)
    }

    /// Whether the writer is still on `cpu`'s reader page (its page is not complete).
    pub(super) fn writer_on_reader(&self, cpu: u32) -> Result<bool, ReadError> {
        let st = &self.cpus[cpu as usize];
        if st.final_queue.is_some() {
            return Ok(false);
        }
        // Acquire: paired with the Release store of tail_page in Writer::move_tail; loaded
        // before commit (RingBuffer::refresh): if the writer left, that commit is final (W1).
        let tail = valid_page(
            &self.layout,
            cpu,
            self.mem
                .load(self.layout.ctl(cpu) + ctl::TAIL_PAGE, Acquire),
        )?;
        Ok(tail == st.reader)
    }

    /// How many pages the writer of `cpu` moved onto since the page this reader is on
    /// (the writer's page's `page_seq` less the reader page's, at most the CPU's page
    /// count): 0 while the writer is on the reader page, the ring's length once it lapped
    /// the reader. A hint for the drain loop's pace, from guest-written words: hostile
    /// values give a wrong pace, nothing else. 0 for a CPU out of range.
    pub fn pages_behind(&self, cpu: u32) -> u64 {
        let Some(st) = self.cpus.get(cpu as usize) else {
            return 0;
        };
        let l = &self.layout;
        // Relaxed: a hint only; nothing is read on the strength of it.
        let tail = self.mem.load(l.ctl(cpu) + ctl::TAIL_PAGE, Relaxed);
        let Ok(tail) = valid_page(l, cpu, tail) else {
            return 0;
        };
        let seq = |page: u32| {
            self.mem
                .load(l.footer_off(page) + footer::PAGE_SEQ, Relaxed)
        };
        seq(tail)
            .saturating_sub(seq(st.reader))
            .min(u64::from(l.pages_per_cpu))
    }
}
