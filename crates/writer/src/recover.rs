//! A writer attaching to a ring another writer of its CPU left (a restarted guest):
//! its tail page scanned, a swap or head push it stopped halfway finished, an
//! interrupted mailbox request answered.

use core::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};

use hyptrace_abi::layout::{
    ctl, footer, link, Mode, FT_COMMIT, LINK_FLAGS, LINK_HEAD, LINK_UPDATE, MBOX_OP_SWAP,
    MBOX_STATUS_OK,
};
use hyptrace_abi::page::{self, COMMIT_OFFSET, PAGE_HEADER_SIZE, RB_MISSED_EVENTS};

use hyptrace_abi::SharedMem;

use crate::swap::{complete_swap, find_head, footer_stats_to, SwapSides};
use crate::{page_id, RingError, SwapHint, Writer};

impl<M: SharedMem> Writer<M> {
    /// Derives where to go on from the pages, not from the control block's counters
    /// (attach-time work only; the write path is unchanged).
    ///
    /// *Invariant W4 (resume): a writer attaching to a ring another writer left —
    /// stopped anywhere, even between two stores — goes on exactly where the pages say
    /// that writer was.* The control block can lag the pages: `write` publishes
    /// `commit` before it stores `entries`, `bytes` and `write_stamp`, and a drop stores
    /// `dropped` before `lost_pending`; a move stores `lost_pending = 0` and
    /// `pages_touched` before `tail_page`. So:
    /// - the tail page is decoded ([`scan_page`], bounded): its events `n` and its clock
    ///   (`time_stamp` + deltas + TIME_EXTENDs) give `write_stamp` and `page_entries`;
    /// - its `first_index + n` is the index after its last event; with `dropped` (stored
    ///   first, so never behind) the identity `entries + dropped = first_index + n +
    ///   lost_pending` (drops only happen after the tail page's last event, W3) tells
    ///   which counter lags: `entries` (a write stopped after its commit) or
    ///   `lost_pending` (a drop stopped before it, or a move stopped after clearing it);
    /// - `lost_pending > 0` closes the tail page (W3); the new page's missed flag comes
    ///   from the footer's `missed` (set before the first event gives `commit` its flag);
    /// - `pages_touched` is the tail page's `page_seq`; a page set up by a move that
    ///   stopped before publishing `tail_page` (page_seq above the tail's) goes back to
    ///   page_seq 0, "never written"; FT_COMMIT is put back on the tail page alone (such
    ///   a move may have moved it already).
    ///
    /// Memory that does not fit (a page this writer would not have written, counters
    /// ahead of the page in overwrite mode, a commit beyond the page) is handled the
    /// safe way: the tail page is closed, so the next event starts a new page whose
    /// `first_index` is never below an index already on a page (a reader sees a gap,
    /// never an index going backwards). The corrected counters are stored back.
    /// `bytes` (a statistic nobody checks) can still miss one event if the writer
    /// stopped between `entries` and `bytes`.
    #[cold]
    pub(super) fn resume(&mut self) {
        // A swap the previous writer ran itself, stopped halfway: finish it first, so
        // that the ring and `reader_page` agree again (W4; without this the tail moved
        // onto the old reader page and every later swap answered Busy).
        match self.finish_own_swap() {
            Ok(true) => self.answer_interrupted_request(),
            Ok(false) => {}
            Err(_) => self.corrupt = true,
        }
        let tf = self.l.footer_off(self.tail);
        // A head push stopped while it held UPDATE on the tail's link: finish it (every
        // step of `push_head` can be done again; the pushed page's event count is
        // taken with a swap, so it is counted as overrun once).
        // Acquire: paired with the SeqCst link changes in Writer::push_head, Writer::move_tail
        // and swap_reader_page_hinted (S1).
        let tl = self.mem.load(tf + footer::NEXT, Acquire);
        if tl & LINK_FLAGS == LINK_UPDATE {
            let pushed = page_id(&self.l, self.cpu, tl >> 2);
            if pushed.and_then(|h| self.finish_push(tf, h)).is_err() {
                self.corrupt = true;
            }
        }
        let (mem, c) = (&self.mem, self.ctl);
        // Acquire: paired with the Release store of commit in Writer::write (W1): scan_page
        // decodes committed bytes only (W4).
        let commit = mem.load(self.tail_off + COMMIT_OFFSET, Acquire);
        let len = (commit & page::COMMIT_LEN_MASK) as usize;
        let scan = if len <= self.cap {
            scan_page(mem, self.tail_off, len)
        } else {
            PageScan {
                events: 0,
                clock: self.write_stamp,
                last_bytes: 0,
                clean: false,
            }
        };
        let mut closed = !scan.clean;
        // Acquire: first_index is stored Relaxed before the Release store of page_seq in
        // Writer::move_tail; ordered here by the Acquire load of tail_page in attach (W3, W4).
        let index_end = mem
            .load(tf + footer::FIRST_INDEX, Acquire)
            .wrapping_add(scan.events);
        let base = self
            .entries
            .wrapping_add(self.dropped)
            .wrapping_sub(self.lost_pending);
        // How far the pages are ahead of the counters: 1 after a write stopped between
        // its commit and `entries`; -1 after a drop stopped before `lost_pending`; -k
        // after a move (with k drops pending) stopped between clearing `lost_pending`
        // and publishing `tail_page`.
        let ahead = index_end.wrapping_sub(base) as i64;
        if ahead > 0 {
            if ahead == 1 && scan.clean {
                self.bytes = self.bytes.wrapping_add(scan.last_bytes);
            }
            self.entries = self.entries.wrapping_add(ahead as u64);
        } else if ahead < 0 {
            match self.l.mode {
                Mode::Stop => {
                    self.lost_pending = self.lost_pending.wrapping_sub(ahead as u64);
                }
                // No drops in overwrite mode: counters ahead of the page do not fit.
                // Keep them (the next page's first_index leaves a gap) and close.
                Mode::Overwrite => closed = true,
            }
        }
        if len > 0 {
            self.write = if closed { self.cap } else { len };
            if scan.events > 0 {
                self.write_stamp = scan.clock;
            }
        } else if closed {
            self.write = self.cap;
        }
        self.page_entries = scan.events;
        let missed = mem.load(tf + footer::MISSED, Relaxed) != 0;
        self.commit_flags = if missed || commit & RB_MISSED_EVENTS != 0 {
            RB_MISSED_EVENTS
        } else {
            0
        };
        // Acquire: paired with the Release store of page_seq in Writer::move_tail (W4).
        self.pages_touched = mem.load(tf + footer::PAGE_SEQ, Acquire);
        for (off, v) in [
            (ctl::ENTRIES, self.entries),
            (ctl::BYTES, self.bytes),
            (ctl::WRITE_STAMP, self.write_stamp),
            (ctl::LOST_PENDING, self.lost_pending),
            (ctl::PAGES_TOUCHED, self.pages_touched),
        ] {
            mem.store(c + off, v, Relaxed);
        }
        let first = self.l.first_page(self.cpu);
        for p in first..first + self.l.pages_per_cpu {
            let f = self.l.footer_off(p);
            // A page set up by a move that stopped before publishing it as the tail
            // carries a page_seq above the tail's: back to "never written", or a
            // post-mortem walk would read it (with a stale first_index) after the
            // tail page, which this writer goes on filling.
            // Acquire/Release on page_seq: paired with Writer::move_tail's Release stores and with
            // the Acquire loads of page_seq in RingBuffer::finalize (a page_seq 0 page is skipped)
            // (W4).
            if p != self.tail && mem.load(f + footer::PAGE_SEQ, Acquire) > self.pages_touched {
                mem.store(f + footer::PAGE_SEQ, 0, Release);
            }
            let ws = f + footer::WRITER_STATUS;
            // AcqRel on FT_COMMIT: pairs with no reader load (the host never reads the status
            // bits); kept after the page_seq fix-up for the S1 checks (loom models, tests).
            if p == self.tail {
                mem.fetch_or(ws, FT_COMMIT, AcqRel);
            } else if mem.load(ws, Relaxed) & FT_COMMIT != 0 {
                mem.fetch_and(ws, !FT_COMMIT, AcqRel);
            }
        }
    }

    /// With swaps run in the guest (`guest_swap`: mailbox swaps, released pages) this
    /// writer's domain is the only one that swaps, so a swap stopped between its
    /// compare-exchange — which put the old reader page `R` into the ring, in place of
    /// the head `H` — and its store of `reader_page` can only be a previous writer's.
    /// Such a ring has a link naming `R`, which no ring link names otherwise (W2), and
    /// two links naming `after` (`R`'s, with HEAD, and `H`'s own): finish the swap's
    /// remaining steps (each can be done again) and publish `H` as the reader page.
    /// Returns whether there was one. Bounded: two passes over the CPU's pages.
    fn finish_own_swap(&mut self) -> Result<bool, RingError> {
        if !self.l.guest_swap {
            return Ok(false);
        }
        let (mem, l, cpu, c) = (&self.mem, &self.l, self.cpu, self.ctl);
        // Acquire: paired with the Release store of reader_page by the last finished swap.
        let reader = page_id(l, cpu, mem.load(c + ctl::READER_PAGE, Acquire))?;
        let first = l.first_page(cpu);
        let pages = first..first + l.pages_per_cpu;
        // Acquire: paired with the SeqCst link changes of swap_reader_page_hinted (S1).
        let names = |p: u32, target: u32| {
            p != reader
                && mem.load(l.footer_off(p) + footer::NEXT, Acquire) >> 2 == u64::from(target)
        };
        let Some(before) = pages.clone().find(|&p| names(p, reader)) else {
            // No swap got past its compare-exchange; one may have stopped before it,
            // with `after|HEAD` stored in the reader page's link: clear the flag, as a
            // swap that gives up does (S1).
            // SeqCst: like the link stores of swap_reader_page_hinted (S1).
            mem.fetch_and(l.footer_off(reader) + footer::NEXT, !LINK_FLAGS, SeqCst);
            return Ok(false);
        };
        // Acquire: as above; set by the swap before its compare-exchange.
        let rl = mem.load(l.footer_off(reader) + footer::NEXT, Acquire);
        if rl & LINK_FLAGS != LINK_HEAD {
            return Err(RingError::BadLink(rl));
        }
        let after = page_id(l, cpu, rl >> 2)?;
        let mut taken = pages.filter(|&p| names(p, after));
        let (Some(head), None) = (taken.next(), taken.next()) else {
            return Err(RingError::BadLink(rl));
        };
        // The new reader page carries the current footer stats (as swap_released gives
        // it) before the rest of the swap publishes it.
        footer_stats_to(mem, l, cpu, head);
        // Relaxed: this writer's own counter; no writer runs now.
        let overrun = mem.load(c + ctl::OVERRUN, Relaxed);
        let sides = SwapSides {
            pf: l.footer_off(before),
            reader,
            head,
            after,
        };
        complete_swap(mem, l, cpu, sides, overrun);
        self.swap_hint = SwapHint::at(reader);
        Ok(true)
    }

    /// After [`Writer::finish_own_swap`]: a swap request still waiting for its answer
    /// was the one that swap served (the previous writer stopped inside it), so it is
    /// answered as done — serving it again would swap the page out of the reader's
    /// hands before it read it.
    fn answer_interrupted_request(&mut self) {
        // Acquire: paired with the Release store of mbox_req in Mailbox::request (M1).
        let req = self.mem.load(self.ctl + ctl::MBOX_REQ, Acquire);
        if req >> 8 != self.mbox_seen && req & 0xff == MBOX_OP_SWAP {
            self.mbox_seen = req >> 8;
            // Release: paired with the Acquire load of mbox_ack in Mailbox::acked (M1).
            self.mem.store(
                self.ctl + ctl::MBOX_ACK,
                (req & !0xff) | MBOX_STATUS_OK,
                Release,
            );
        }
    }

    /// Finishes a head push the previous writer stopped while it held UPDATE on its
    /// tail's link (footer `tf`), naming the pushed page `head`. Once the push published
    /// the new HEAD link, the head is no longer the push's to move: a hinted swap may
    /// have taken the new head since (`--swap host`: `head`'s link then names the old
    /// reader page, and that page's link carries HEAD), so only UPDATE is cleared.
    /// Before that, no swap can have got past UPDATE: the push is run again (each of its
    /// steps can be done again). Published is "the first flagged link along the ring from
    /// `head` is not the tail's own UPDATE" ([`find_head`], bounded; S1: at rest the
    /// push's HEAD link, or a swap's after it, is the only other one).
    fn finish_push(&mut self, tf: usize, head: u32) -> Result<(), RingError> {
        let (f, _) = find_head(&self.mem, &self.l, self.cpu, head)?;
        if f == tf {
            return self.push_head(tf, head);
        }
        // SeqCst: as push_head's last step (S1).
        self.mem.swap(tf + footer::NEXT, link(head, 0), SeqCst);
        Ok(())
    }
}

/// What [`scan_page`] found in the committed bytes of the writer's own tail page.
#[derive(Clone, Copy, Debug)]
pub(super) struct PageScan {
    /// Data events decoded.
    pub(super) events: u64,
    /// The page's clock after the last record: its `time_stamp` plus every delta and
    /// TIME_EXTEND (the timestamp of its last event, as the writer's `write_stamp`).
    pub(super) clock: u64,
    /// Bytes of the last data event with the TIME_EXTEND before it (what the write that
    /// committed it added to `bytes`).
    pub(super) last_bytes: u64,
    /// The bytes are exactly what this writer writes: data events and TIME_EXTENDs
    /// ending at `len`. Anything else (padding, an absolute TIME_STAMP, a record
    /// running past `len`, a bad length word) is not ours.
    pub(super) clean: bool,
}

/// Decodes the `len` committed bytes of the page at `page` (the writer's own tail page,
/// on attach) straight from shared memory, without allocation. Bounded: every record
/// advances at least 4 bytes, so at most `len / 4` iterations; stops at the first
/// record this writer would not have written.
pub(super) fn scan_page<M: SharedMem + ?Sized>(mem: &M, page: usize, len: usize) -> PageScan {
    let data = page + PAGE_HEADER_SIZE;
    let word = |off: usize| {
        let mut b = [0u8; 4];
        mem.read_bytes(data + off, &mut b);
        u32::from_le_bytes(b)
    };
    let mut ts = [0u8; 8];
    mem.read_bytes(page, &mut ts);
    let mut s = PageScan {
        events: 0,
        clock: u64::from_le_bytes(ts),
        last_bytes: 0,
        clean: true,
    };
    let (mut off, mut group) = (0usize, 0usize);
    while off < len {
        if off + 8 > len {
            // Every record this writer writes is at least 8 bytes.
            s.clean = false;
            break;
        }
        let h = word(off);
        let delta = u64::from(h >> 5);
        let size = match h & 0x1f {
            page::TYPE_TIME_EXTEND => {
                let d = (u64::from(word(off + 4)) << page::DELTA_BITS) + delta;
                s.clock = s.clock.wrapping_add(d);
                page::TIME_EXTEND_SIZE
            }
            0 => match word(off + 4) as usize {
                lw if lw >= 4 => 8 + page::align4(lw - 4),
                _ => {
                    s.clean = false;
                    break;
                }
            },
            t @ 1..=page::TYPE_DATA_MAX => 4 + 4 * t as usize,
            // Padding or an absolute TIME_STAMP: never written by this writer.
            _ => {
                s.clean = false;
                break;
            }
        };
        if size > len - off {
            s.clean = false;
            break;
        }
        off += size;
        if h & 0x1f != page::TYPE_TIME_EXTEND {
            s.clock = s.clock.wrapping_add(delta);
            s.events += 1;
            s.last_bytes = (off - group) as u64;
            group = off;
        }
    }
    s
}
