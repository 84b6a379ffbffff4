//! The reader page swap (Linux's lockless reader swap), lock-free against the writer,
//! run by the host or by the guest writer serving a mailbox request; the head search
//! and the footers it updates.

use core::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};

use hyptrace_abi::layout::{
    ctl, footer, link, RingGeometry, FT_HEAD, FT_READER, LINK_FLAGS, LINK_HEAD, LINK_UPDATE,
    MBOX_OP_SWAP, MBOX_OP_UPDATE_FOOTERS, MBOX_STATUS_BUSY, MBOX_STATUS_CONTENDED,
    MBOX_STATUS_ERROR, MBOX_STATUS_OK,
};

use hyptrace_abi::SharedMem;

use crate::{page_id, relax, RingError, SwapStatus, Writer, SWAP_RETRIES};

impl<M: SharedMem> Writer<M> {
    /// Serves a pending mailbox request (`--swap guest`): runs the requested
    /// writer-domain operation on this CPU and acknowledges it. One relaxed load when
    /// there is nothing to do. Returns whether a request was served.
    #[inline]
    pub fn serve_mailbox(&mut self) -> bool {
        // Acquire: paired with the Release store of mbox_req in Mailbox::request (M1).
        let req = self.ctl_load(ctl::MBOX_REQ, Acquire);
        if req >> 8 == self.mbox_seen {
            return false;
        }
        self.serve_request(req);
        true
    }

    #[cold]
    fn serve_request(&mut self, req: u64) {
        self.mbox_seen = req >> 8;
        let status = match req & 0xff {
            MBOX_OP_SWAP => {
                match swap_reader_page_hinted(&self.mem, &self.l, self.cpu, &mut self.swap_hint) {
                    Ok(SwapStatus::Swapped { .. }) => MBOX_STATUS_OK,
                    Ok(SwapStatus::Busy) => MBOX_STATUS_BUSY,
                    Ok(SwapStatus::Contended) => MBOX_STATUS_CONTENDED,
                    Err(_) => MBOX_STATUS_ERROR,
                }
            }
            MBOX_OP_UPDATE_FOOTERS => match update_footers(&self.mem, &self.l, self.cpu) {
                Ok(()) => MBOX_STATUS_OK,
                Err(_) => MBOX_STATUS_ERROR,
            },
            _ => MBOX_STATUS_ERROR,
        };
        self.mbox_served = self.mbox_served.wrapping_add(1);
        // Release: paired with the Acquire load of mbox_ack in Mailbox::acked: the swap's
        // reader_page and footers are visible to a reader that sees the answer (M1).
        self.mem
            .store(self.ctl + ctl::MBOX_ACK, (req & !0xff) | status, Release);
    }
}

/// Finds the head: the page named by the one link that carries HEAD (or UPDATE while
/// the writer moves it), walking from the tail at most the ring's length. Returns the
/// footer offset of the page whose link names the head, and that link.
pub(super) fn find_head<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
    tail: u32,
) -> Result<(usize, u64), RingError> {
    let mut p = tail;
    for _ in 0..l.pages_per_cpu {
        let f = l.footer_off(p);
        // Acquire: paired with the SeqCst link changes of Writer::push_head and
        // swap_reader_page_hinted (S1).
        let lk = mem.load(f + footer::NEXT, Acquire);
        if lk & LINK_FLAGS != 0 {
            return Ok((f, lk));
        }
        p = page_id(l, cpu, lk >> 2)?;
    }
    Err(RingError::NoHead)
}

/// Swaps CPU `cpu`'s reader page with the head page (the Linux lockless reader swap),
/// lock-free against the writer, from any thread or domain. The caller must have read
/// the reader page completely; only one swap per CPU may run at a time (the reader's
/// side serialises them).
///
/// 1. the reader page's link := the page after head, flagged HEAD;
/// 2. compare-exchange the link naming the head from `head|HEAD` to the reader page —
///    this moves the head atomically, and fails if the writer is moving it (UPDATE) or
///    moved it; then retry, at most [`SWAP_RETRIES`] times;
/// 3. footers: READER moves to the old head, HEAD to the new head, and the new reader
///    page's footer gets `overrun` (read before the exchange, as Linux does).
///
/// Returns [`SwapStatus::Busy`] without touching anything when the writer is on the
/// reader page (the page is not complete yet), and [`SwapStatus::Contended`] when the
/// writer moved the head under every attempt (nothing changed: try again later). An
/// `Err` always means the ring is inconsistent.
pub fn swap_reader_page<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
) -> Result<SwapStatus, RingError> {
    swap_reader_page_hinted(mem, l, cpu, &mut SwapHint::default())
}

/// Where the previous swap of a CPU left the HEAD link: the page that was the reader
/// page then, whose link the swap set to `after|HEAD`. The next swap starts its head
/// search there instead of at the tail (Linux keeps `cpu_buffer->head_page` for the
/// same purpose). When the reader keeps up with the writer, the head is the page the
/// writer is on or just left, so a search from the tail walks the whole ring (one
/// footer load per page: ~1 µs for 256 pages); from the hint it takes one step.
///
/// A hint is only where a search starts: it is used only if it names one of the CPU's
/// pages other than the reader page (so a ring page), and the search from it is
/// bounded like the one from the tail. Keep one per CPU, private to whoever runs the
/// swaps of that CPU (the host's `Direct` callbacks, or the guest writer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwapHint(Option<u32>);

impl SwapHint {
    /// A hint naming `page` (as [`SwapHint::page`] returned it after a swap).
    pub const fn at(page: u32) -> Self {
        Self(Some(page))
    }

    /// The page the next search starts at, if any.
    pub const fn page(&self) -> Option<u32> {
        self.0
    }
}

/// [`swap_reader_page`], starting the head search at `hint` (see [`SwapHint`]) and
/// updating it for the next swap. Retries search from the tail, as without a hint.
pub fn swap_reader_page_hinted<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
    hint: &mut SwapHint,
) -> Result<SwapStatus, RingError> {
    if cpu >= l.nr_cpus {
        return Err(RingError::BadCpu(cpu));
    }
    let c = l.ctl(cpu);
    // Acquire: paired with the Release store of reader_page by the previous swap (one swap
    // per CPU at a time). Then tail_page: paired with the Release store in
    // Writer::move_tail; the writer not on the reader page means it is complete (W2).
    let reader = page_id(l, cpu, mem.load(c + ctl::READER_PAGE, Acquire))?;
    let tail = page_id(l, cpu, mem.load(c + ctl::TAIL_PAGE, Acquire))?;
    if tail == reader {
        return Ok(SwapStatus::Busy);
    }
    // A ring page (not the reader page) the last swap left the HEAD link on.
    let start = hint.0.filter(|&h| h != reader && l.owns(cpu, u64::from(h)));
    let r = try_swap(mem, l, cpu, (reader, tail), start, hint);
    if r == Ok(SwapStatus::Contended) {
        // S1, kept here: a swap that gives up leaves no flag in the reader page's link.
        // An attempt whose compare-exchange lost stored `after|HEAD` there; left, the
        // ring at rest shows two HEAD links, the reader page's naming a page that may no
        // longer be the head (docs/design.md, "S1 and a swap that gives up"). No ring
        // link names the reader page (every compare-exchange failed) and the writer is
        // not on it (checked above), so no one else loads or stores this word now. (An
        // error leaves the words as they are: the ring is inconsistent already, and a
        // post-mortem sees it as the swap found it.)
        #[cfg(not(hyptrace_seeded_bug_contended_link))]
        // SeqCst: like the stores of this link in try_swap (S1).
        mem.fetch_and(l.footer_off(reader) + footer::NEXT, !LINK_FLAGS, SeqCst);
    }
    r
}

/// The attempts of [`swap_reader_page_hinted`] (at most [`SWAP_RETRIES`]) to swap
/// `reader` (the writer's tail was `tail` at the check), the first head search starting
/// at `start`. When it gives up it may leave `after|HEAD` in the reader page's link: the
/// caller clears the flag.
pub(super) fn try_swap<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
    (reader, tail): (u32, u32),
    mut start: Option<u32>,
    hint: &mut SwapHint,
) -> Result<SwapStatus, RingError> {
    let c = l.ctl(cpu);
    let rf = l.footer_off(reader);
    for _ in 0..SWAP_RETRIES {
        // Search from the hint, else (and on retries) from where the writer is now: it
        // may have moved since the last try.
        let from = match start.take() {
            Some(h) => h,
            // Acquire: paired with the Release store of tail_page in Writer::move_tail.
            None => page_id(l, cpu, mem.load(c + ctl::TAIL_PAGE, Acquire)).unwrap_or(tail),
        };
        let (pf, lk) = match find_head(mem, l, cpu, from) {
            Ok(found) => found,
            // The writer pushed the head past our walk (overwrite mode): search again.
            Err(RingError::NoHead) => {
                relax();
                continue;
            }
            Err(e) => return Err(e),
        };
        if lk & LINK_FLAGS != LINK_HEAD {
            // UPDATE: the writer is pushing the head; it finishes without waiting for us.
            if lk & LINK_FLAGS == LINK_UPDATE {
                relax();
                continue;
            }
            return Err(RingError::BadLink(lk));
        }
        let head = page_id(l, cpu, lk >> 2)?;
        if head == reader {
            return Err(RingError::BadPageId(head.into()));
        }
        // Acquire: paired with the SeqCst link stores of Writer::push_head (S1).
        let hl = mem.load(l.footer_off(head) + footer::NEXT, Acquire);
        let after = page_id(l, cpu, hl >> 2)?;
        // SeqCst: R's link is set before the compare-exchange below puts R in the ring, so the
        // writer's Acquire load of a link naming R (Writer::move_tail) sees it (W2, S1).
        mem.swap(rf + footer::NEXT, link(after, LINK_HEAD), SeqCst);
        // Acquire: the writer stores overrun Relaxed: pairs with no store; a snapshot taken
        // before the exchange, as Linux does (exact losses come from first_index: R1).
        let overrun = mem.load(c + ctl::OVERRUN, Acquire);
        // SeqCst: paired with the writer's SeqCst compare-exchange H|HEAD -> H|UPDATE in
        // Writer::move_tail: exactly one of them takes the head (W2, S1).
        if mem
            .compare_exchange(pf + footer::NEXT, lk, link(reader, 0), SeqCst, Acquire)
            .is_err()
        {
            relax();
            continue;
        }
        complete_swap(
            mem,
            l,
            cpu,
            SwapSides {
                pf,
                reader,
                head,
                after,
            },
            overrun,
        );
        // The old reader page is in the ring now, its link naming the new head.
        *hint = SwapHint(Some(reader));
        return Ok(SwapStatus::Swapped { page: head });
    }
    Ok(SwapStatus::Contended)
}

/// The pages of a swap whose compare-exchange put the old reader page into the ring.
#[derive(Clone, Copy)]
pub(super) struct SwapSides {
    /// Footer offset of the page whose link now names `reader`.
    pub(super) pf: usize,
    /// The old reader page, now in the ring.
    pub(super) reader: u32,
    /// The page taken out: the new reader page.
    pub(super) head: u32,
    /// The page after `head`: the new head.
    pub(super) after: u32,
}

/// The steps of a swap after its compare-exchange: the footer bits, `head`'s overrun
/// snapshot, FT_HEAD on the new head, then `head` published as the reader page. Run by
/// every swap ([`swap_reader_page_hinted`]) and again by a writer attaching after one
/// stopped halfway ([`Writer::finish_own_swap`]): each step can be done again.
pub(super) fn complete_swap<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
    s: SwapSides,
    overrun: u64,
) {
    let (hf, rf) = (l.footer_off(s.head), l.footer_off(s.reader));
    // SeqCst: footer bits after the exchange, before reader_page is published (S1).
    mem.fetch_and(hf + footer::WRITER_STATUS, !FT_HEAD, SeqCst);
    mem.swap(hf + footer::READER_STATUS, FT_READER, SeqCst);
    mem.swap(rf + footer::READER_STATUS, 0, SeqCst);
    mem.store(hf + footer::OVERRUN, overrun, Relaxed);
    mark_new_head(mem, l, s.pf, s.reader, s.after);
    // Release: paired with the Acquire loads of reader_page in RingBuffer (attach, poke,
    // advance, finalize), Mailbox::swap_reader, update_footers and the next swap: the
    // footers above come first (S1).
    let c = l.ctl(cpu);
    mem.store(c + ctl::READER_PAGE, u64::from(s.head), Release);
    mem.fetch_add(c + ctl::SWAPS, 1, Relaxed);
}

/// FT_HEAD on `after`, the page a swap just made the head by putting the old reader page
/// `reader` into the ring behind it (`pf` is the footer of the page before `reader`),
/// while the writer may push that head on and even lap the ring back to it meanwhile.
///
/// The writer changes `after`'s FT_HEAD only inside its head pushes, always *after* the
/// link change that decides it: it sets the bit while it holds UPDATE on the link naming
/// `reader` (pushing `reader`; the HEAD link naming `after` follows), and clears it after
/// turning `reader`'s link from `after|HEAD` to `after|UPDATE` (pushing `after`). So
/// "`after` is or is becoming the head" is `pf`'s link = `reader|UPDATE` (loaded first)
/// or `reader`'s link = `after|HEAD`. The swap writes the bit that this predicate gave
/// (true at first: the swap just made `after` the head), then evaluates it again: equal,
/// and any later change of the predicate is followed by a write of the writer, which
/// then has the last word; different, the writer moved the head past `after` or back to
/// it meanwhile, and the swap writes the new value. Never a blind undo: the old fix-up
/// (set, re-load the link, clear if it changed) could clear the bit a writer that lapped
/// the ring had just set (S1 broken until the next head move). Each extra round needs the
/// writer to move the head by half a ring during one round of the swap; after
/// [`SWAP_RETRIES`] rounds the writer's next push of `after` puts the bit right.
pub(super) fn mark_new_head<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    pf: usize,
    reader: u32,
    after: u32,
) {
    let ws = l.footer_off(after) + footer::WRITER_STATUS;
    let rl = l.footer_off(reader) + footer::NEXT;
    let mut head = true;
    for _ in 0..SWAP_RETRIES {
        // SeqCst: the bit store and the link loads below are a store -> load pair: only SeqCst
        // (with Writer::push_head's SeqCst link stores and FT_HEAD changes) keeps a lapping
        // writer's change from being missed (S1).
        if head {
            mem.fetch_or(ws, FT_HEAD, SeqCst);
        } else {
            mem.fetch_and(ws, !FT_HEAD, SeqCst);
        }
        let becoming = mem.load(pf + footer::NEXT, SeqCst) == link(reader, LINK_UPDATE);
        let now = becoming || mem.load(rl, SeqCst) == link(after, LINK_HEAD);
        if now == head {
            return;
        }
        head = now;
    }
}

/// Copies the writer's counters (entries, pages_touched, overrun, dropped) into the
/// reader page's footer stats, as `ring_buffer_ext`'s `update_footers` does.
pub fn update_footers<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
) -> Result<(), RingError> {
    if cpu >= l.nr_cpus {
        return Err(RingError::BadCpu(cpu));
    }
    // Acquire: paired with the Release store of reader_page in swap_reader_page_hinted
    // (update and swap run in the same domain, one at a time: M1).
    let reader = page_id(l, cpu, mem.load(l.ctl(cpu) + ctl::READER_PAGE, Acquire))?;
    footer_stats_to(mem, l, cpu, reader);
    Ok(())
}

/// Copies the control block's `entries`, `pages_touched`, `overrun` and `dropped` of
/// `cpu` (`< nr_cpus`) into the footer stats of its page `page`.
pub(super) fn footer_stats_to<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
    page: u32,
) {
    let (c, f) = (l.ctl(cpu), l.footer_off(page));
    for (from, to) in [
        (ctl::ENTRIES, footer::ENTRIES),
        (ctl::PAGES_TOUCHED, footer::PAGES_TOUCHED),
        (ctl::OVERRUN, footer::OVERRUN),
        (ctl::DROPPED, footer::DROPPED),
    ] {
        mem.store(f + to, mem.load(c + from, Relaxed), Relaxed);
    }
}
