//! The writer's tail moving to the next page: over a page the reader released, or
//! pushing the head on (overwrite mode, counting the overrun).

use core::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};

use hyptrace_abi::layout::{
    ctl, footer, link, Mode, FT_COMMIT, FT_HEAD, LINK_FLAGS, LINK_HEAD, LINK_UPDATE,
};
use hyptrace_abi::page::{COMMIT_OFFSET, RB_MISSED_EVENTS};

use hyptrace_abi::SharedMem;

use crate::swap::footer_stats_to;
use crate::{
    page_id, swap_reader_page_hinted, RingError, SwapStatus, Writer, MOVE_RETRIES, RELEASED_ORDER,
};

impl<M: SharedMem> Writer<M> {
    /// Moves the tail to the next page. Returns `Ok(false)` when the ring is full in
    /// stop mode.
    ///
    /// Invariant W2, kept here: the writer only ever moves onto the page its tail's link
    /// names, and onto the head page only after turning the HEAD link into UPDATE with
    /// a compare-exchange (overwrite mode) — so it never writes the reader page, which
    /// no ring link names.
    #[cold]
    pub(super) fn move_tail(&mut self) -> Result<bool, RingError> {
        let tf = self.l.footer_off(self.tail);
        let mut attempts = 0;
        let next = loop {
            attempts += 1;
            if attempts > MOVE_RETRIES {
                return Err(RingError::Retries);
            }
            // Acquire: paired with the SeqCst compare-exchange in swap_reader_page_hinted (the
            // reader page it put in the ring has its link set before, W2) and the SeqCst link
            // stores of Writer::push_head (S1).
            let lk = self.mem.load(tf + footer::NEXT, Acquire);
            let nid = page_id(&self.l, self.cpu, lk >> 2)?;
            match lk & LINK_FLAGS {
                0 => break nid,
                LINK_HEAD => {
                    if self.l.mode == Mode::Stop {
                        // The host may have read the head page already (released pages):
                        // then a swap of our own frees it, and the tail's link names the
                        // old reader page next.
                        if self.swap_released(nid)? {
                            continue;
                        }
                        return Ok(false);
                    }
                    // Overwrite: take the head link; a swap racing us makes this fail
                    // (it replaced the link with the reader page): retry.
                    // SeqCst: paired with the SeqCst compare-exchange of the same link in
                    // swap_reader_page_hinted: exactly one of the two takes H|HEAD (W2,
                    // S1). Failure Acquire: paired with the swap's exchange; we reload.
                    if self
                        .mem
                        .compare_exchange(
                            tf + footer::NEXT,
                            lk,
                            link(nid, LINK_UPDATE),
                            SeqCst,
                            Acquire,
                        )
                        .is_err()
                    {
                        continue;
                    }
                    self.push_head(tf, nid)?;
                    break nid;
                }
                _ => return Err(RingError::BadLink(lk)),
            }
        };
        // Leave the old tail: its entry count is final, it is no longer the commit page.
        // Release: paired with the AcqRel swap of page_entries in Writer::push_head: a later
        // head push counts these events as overrun once (R1).
        self.mem
            .store(tf + footer::PAGE_ENTRIES, self.page_entries, Release);
        // AcqRel: FT_COMMIT leaves the old tail before it is set on the new one (S1).
        self.mem
            .fetch_and(tf + footer::WRITER_STATUS, !FT_COMMIT, AcqRel);
        // Start the new page.
        let nf = self.l.footer_off(next);
        let off = self.l.page_off(next);
        self.pages_touched = self.pages_touched.wrapping_add(1);
        // page_seq 0 first ("never written"), the real one last: a writer stopped in
        // the middle of this set-up leaves a page a post-mortem walk leaves out (its
        // old events were already counted as overrun), never a half-reset page.
        // Release: paired with the Acquire loads of page_seq in RingBuffer::finalize and
        // Writer::resume: a page being reset reads as never written (W4).
        self.mem.store(nf + footer::PAGE_SEQ, 0, Release);
        self.mem.store(off + COMMIT_OFFSET, 0, Relaxed);
        self.mem.store(nf + footer::PAGE_ENTRIES, 0, Relaxed);
        self.mem.store(
            nf + footer::FIRST_INDEX,
            self.entries + self.dropped,
            Relaxed,
        );
        self.mem
            .store(nf + footer::MISSED, self.lost_pending, Relaxed);
        // Release: paired with the Acquire loads of page_seq in RingBuffer::finalize and
        // Writer::resume: commit, first_index and missed above come first (W3, W4).
        self.mem
            .store(nf + footer::PAGE_SEQ, self.pages_touched, Release);
        // AcqRel: FT_COMMIT on the new tail, after it left the old one (S1).
        self.mem
            .fetch_or(nf + footer::WRITER_STATUS, FT_COMMIT, AcqRel);
        self.commit_flags = if self.lost_pending != 0 {
            RB_MISSED_EVENTS
        } else {
            0
        };
        self.lost_pending = 0;
        self.tail = next;
        self.tail_off = off;
        self.write = 0;
        self.page_entries = 0;
        self.mem.store(self.ctl + ctl::LOST_PENDING, 0, Relaxed);
        self.mem
            .store(self.ctl + ctl::PAGES_TOUCHED, self.pages_touched, Relaxed);
        // Release: the new page's footer is initialised before anyone sees it as tail.
        // Paired with the Acquire loads of tail_page in RingBuffer::writer_on_reader,
        // swap_reader_page_hinted and Writer::attach (W1 across pages, W2).
        self.mem
            .store(self.ctl + ctl::TAIL_PAGE, u64::from(next), Release);
        Ok(true)
    }

    /// Released pages (stop mode, `--swap guest`; docs/design.md "Released pages"): the
    /// tail met the head page `head`. If the host has read it in place (its `page_seq`
    /// is at most the control block's `released`, which only the host stores), run one
    /// swap here, in the writer: `head` becomes the reader page and the reader page —
    /// read too: the initial one, or a page an earlier such swap took — goes back into
    /// the ring before the new head, where the tail moves next. No round trip: the host
    /// releases pages with one store whenever it has read them, and the writer takes
    /// them back when it needs them, even after its vCPU was off its core for a while.
    /// Returns whether it swapped. Only with `released` set does this run, and the host
    /// sets it only when it runs no swaps itself (one swapper per CPU, S1).
    #[cold]
    fn swap_released(&mut self, head: u32) -> Result<bool, RingError> {
        // Acquire: paired with the Release store of released in RingBuffer::advance_released: the
        // host's reads of every page up to it happen before this writer reuses them (R2).
        let released = self.ctl_load(ctl::RELEASED, RELEASED_ORDER);
        if released == 0 {
            return Ok(false);
        }
        let hf = self.l.footer_off(head);
        // Relaxed: this writer's own store (move_tail).
        let seq = self.mem.load(hf + footer::PAGE_SEQ, Relaxed);
        if seq == 0 || seq > released {
            return Ok(false);
        }
        // The new reader page carries the current footer stats before the swap publishes
        // it: a poke that loads reader_page afterwards never sees a counter go back.
        footer_stats_to(&self.mem, &self.l, self.cpu, head);
        match swap_reader_page_hinted(&self.mem, &self.l, self.cpu, &mut self.swap_hint)? {
            SwapStatus::Swapped { .. } => {
                self.self_swaps = self.self_swaps.wrapping_add(1);
                Ok(true)
            }
            // Neither happens with this writer as the only swapper (it is not on the
            // reader page, and it is not pushing the head); no space then.
            SwapStatus::Busy | SwapStatus::Contended => Ok(false),
        }
    }

    /// Overwrite mode, with the link to `head` (in footer `tf`) turned to UPDATE:
    /// account the overwritten events, move FT_HEAD and the HEAD link to the page after
    /// `head`, then clear UPDATE. While UPDATE is set no swap can take `head`; once the
    /// new HEAD link is published (before UPDATE is cleared) a swap that starts its search
    /// past the tail (hinted) can take the new head and complete — it only replaces
    /// `head`'s link, and clearing UPDATE on the tail's link, which still names `head`,
    /// keeps the ring consistent. S1: the footer bits are moved before the new HEAD link
    /// is published (set before a link names the page, cleared after it stopped).
    pub(super) fn push_head(&mut self, tf: usize, head: u32) -> Result<(), RingError> {
        let hf = self.l.footer_off(head);
        // Taken (and zeroed: the page is reset when the writer moves onto it) with one
        // swap, so a push finished again on attach does not count the page twice.
        // AcqRel: paired with the Release store of page_entries in Writer::move_tail (R1:
        // overrun counts the page's events once, even when a stopped push is finished again).
        let lost = self.mem.swap(hf + footer::PAGE_ENTRIES, 0, AcqRel);
        // A page holds at most one event per 8 bytes of data.
        if lost > (self.cap / 8) as u64 {
            return Err(RingError::BadCount(lost));
        }
        self.overrun = self.overrun.wrapping_add(lost);
        self.mem
            .store(self.ctl + ctl::OVERRUN, self.overrun, Relaxed);
        // Acquire: paired with the SeqCst link changes of swap_reader_page_hinted (S1).
        let nl = self.mem.load(hf + footer::NEXT, Acquire);
        let nn = page_id(&self.l, self.cpu, nl >> 2)?;
        // Finishing a stopped push (finish_push), the new HEAD link is not there yet.
        if nl & LINK_FLAGS != 0 {
            return Err(RingError::BadLink(nl));
        }
        // SeqCst (FT_HEAD, then the links): one total order with the SeqCst stores and loads
        // of mark_new_head: FT_HEAD moves before the new HEAD link is published (S1).
        self.mem
            .fetch_and(hf + footer::WRITER_STATUS, !FT_HEAD, SeqCst);
        self.mem.fetch_or(
            self.l.footer_off(nn) + footer::WRITER_STATUS,
            FT_HEAD,
            SeqCst,
        );
        #[cfg(not(hyptrace_seeded_bug))]
        let new_head = link(nn, LINK_HEAD);
        // Seeded bug for the model checker: forget to mark the new head, so the ring
        // loses its head and a later swap cannot find it / the writer laps the reader.
        #[cfg(hyptrace_seeded_bug)]
        let new_head = link(nn, 0);
        // SeqCst: paired with the SeqCst loads of these links in mark_new_head and the Acquire
        // loads of find_head: the new HEAD link is published before UPDATE is cleared (S1).
        self.mem.swap(hf + footer::NEXT, new_head, SeqCst);
        self.mem.swap(tf + footer::NEXT, link(head, 0), SeqCst);
        Ok(())
    }
}
