//! hyptrace's per-CPU ring-buffer writer.
//!
//! One [`Writer`] per CPU writes Linux-format events into its ring of pages in shared
//! memory, lock-free and without ever waiting for the reader. The writer-domain
//! operations behind the reader's callbacks, [`swap_reader_page`] and
//! [`update_footers`], are free functions over the same shared memory: the host runs
//! them itself (`--swap host`, concurrently with the writer on its CPU) or asks the
//! writer to run them through the mailbox ([`Writer::serve_mailbox`], `--swap guest`).
//!
//! The protocol (links with HEAD/UPDATE flags, who writes which word) and its
//! invariants are described in `docs/design.md`; each is stated again where it is kept.
//!
//! `no_std`, no allocation; the same code runs in the guest, in host threads and under
//! loom (through [`SharedMem`]).
//!
//! ```
//! use hyptrace_abi::{events, HeapMem, Mode, RingGeometry};
//! use hyptrace_writer::{swap_reader_page, update_footers, SwapStatus, WriteOutcome, Writer};
//!
//! // The host initialises the region (hyptrace-reader's RingBuffer::alloc does this).
//! let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
//! let mem = HeapMem::new(l.region_size);
//! l.init_region(&mem, 1_000_000, 1);
//!
//! // The guest attaches to its CPU's ring and writes; every event enabled here.
//! let mut w = Writer::attach(&mem, 0)?;
//! for seq in 0..200 {
//!     let ev = events::marker(events::vcpu_pid(0), seq, seq * 2);
//!     assert_eq!(w.write_enabled(1000 + seq, &ev), WriteOutcome::Written);
//! }
//!
//! // The host, concurrently: take the oldest full page out of the ring, refresh stats.
//! assert!(matches!(swap_reader_page(&mem, &l, 0)?, SwapStatus::Swapped { .. }));
//! update_footers(&mem, &l, 0)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![no_std]
#![warn(missing_docs)]

#[cfg(any(test, loom))]
extern crate std;

pub mod events;

use core::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use hyptrace_abi::layout::{
    ctl, footer, link, LayoutError, Mode, RingGeometry, CTL_MAGIC, FT_COMMIT, FT_HEAD, FT_READER,
    LINK_FLAGS, LINK_HEAD, LINK_UPDATE, MBOX_OP_SWAP, MBOX_OP_UPDATE_FOOTERS, MBOX_STATUS_BUSY,
    MBOX_STATUS_CONTENDED, MBOX_STATUS_ERROR, MBOX_STATUS_OK, WRITER_ACTIVE, WRITER_FINISHED,
};
use hyptrace_abi::page::{self, COMMIT_OFFSET, PAGE_HEADER_SIZE, RB_MISSED_EVENTS};
/// The shared-memory trait (re-exported: the [`event!`] macro's code names it).
pub use hyptrace_abi::SharedMem;

/// Most attempts of a swap (each failed attempt means the writer moved the head).
#[cfg(not(loom))]
pub const SWAP_RETRIES: u32 = 16;
/// Most attempts of a swap, in the loom models: the same code gives up after fewer
/// attempts, so that the executions in which every attempt fails (the swap that gives up,
/// docs/design.md "S1 and a swap that gives up") stay few enough to explore them all.
#[cfg(loom)]
pub const SWAP_RETRIES: u32 = 3;
/// Most attempts of the writer to move its tail (each failure means a swap moved the
/// head under it; a swap changes a link at most once per call, so this never runs out
/// unless the ring is corrupt).
pub const MOVE_RETRIES: u32 = 8;

/// The ordering of the `commit` store that publishes an event (invariant W1: Release).
#[cfg(not(hyptrace_seeded_bug_relaxed_commit))]
const COMMIT_ORDER: core::sync::atomic::Ordering = Release;
/// Seeded bug for the model checker (`--cfg hyptrace_seeded_bug_relaxed_commit`): the
/// commit is published Relaxed, so a reader that sees it may read the payload before it
/// was written (W1 broken); loom reports the race on the payload bytes.
#[cfg(hyptrace_seeded_bug_relaxed_commit)]
const COMMIT_ORDER: core::sync::atomic::Ordering = Relaxed;

/// The ordering of the writer's load of `released` (invariant R2: Acquire).
#[cfg(not(hyptrace_seeded_bug_relaxed_release))]
const RELEASED_ORDER: core::sync::atomic::Ordering = Acquire;
/// Seeded bug for the model checker (`--cfg hyptrace_seeded_bug_relaxed_release`): the
/// writer loads `released` Relaxed, so it may rewrite a released page before the host's
/// reads of it happened (R2 broken); loom reports the race on the page's bytes.
#[cfg(hyptrace_seeded_bug_relaxed_release)]
const RELEASED_ORDER: core::sync::atomic::Ordering = Relaxed;

/// What became of one event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Committed to the ring.
    Written,
    /// Not written: its enable bit is clear (counted as skipped).
    Disabled,
    /// Not written: the ring is full in stop mode (counted as dropped).
    Dropped,
    /// Not written: the payload can never fit a page.
    TooLarge,
    /// Not written: the ring's links are corrupt (the writer stops writing).
    Corrupt,
}

/// Result of a swap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwapStatus {
    /// The head page became the reader page; the old reader page joined the ring.
    Swapped {
        /// The new reader page.
        page: u32,
    },
    /// The writer is on the reader page: there is nothing to swap yet.
    Busy,
    /// The swap lost every attempt to the writer (an overwriting writer kept pushing the
    /// head, or lapped the whole ring during the head search). Nothing changed on the
    /// reader's side; try again later. A lost race is an outcome, never an error.
    Contended,
}

impl SwapStatus {
    /// Whether the swap moved a page to the reader.
    pub const fn swapped(&self) -> bool {
        matches!(self, Self::Swapped { .. })
    }
}

/// Why a writer-domain operation failed: the shared ring is inconsistent (corrupt or
/// hostile), or the head kept moving.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingError {
    /// The pack or a control block is not valid.
    RingGeometry(LayoutError),
    /// A page id in a control block or link is outside the CPU's pages.
    BadPageId(u64),
    /// No head link found within the ring length.
    NoHead,
    /// A link carries flags it cannot carry here.
    BadLink(u64),
    /// The writer's tail move failed every attempt (a link that keeps changing under
    /// the writer: only a corrupt ring does that; a swap changes a link at most once).
    Retries,
    /// The CPU number is out of range.
    BadCpu(u32),
    /// A page's event count is more than a page can hold.
    BadCount(u64),
}

impl core::fmt::Display for RingError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::RingGeometry(e) => write!(f, "bad layout: {e}"),
            Self::BadPageId(id) => write!(f, "page id {id} outside this CPU's pages"),
            Self::NoHead => write!(f, "no head page found in the ring"),
            Self::BadLink(l) => write!(f, "unexpected link word {l:#x}"),
            Self::Retries => write!(
                f,
                "tail move retries exhausted: the ring's links keep changing"
            ),
            Self::BadCpu(c) => write!(f, "CPU {c} out of range"),
            Self::BadCount(n) => write!(f, "page event count {n} is more than a page holds"),
        }
    }
}

impl core::error::Error for RingError {}

impl From<LayoutError> for RingError {
    fn from(e: LayoutError) -> Self {
        Self::RingGeometry(e)
    }
}

/// Between two attempts of a bounded retry loop. Only a CPU hint: no thread waits for
/// another here, and the loom models keep it that way — a yield there would let the
/// writer finish whatever made the attempt fail before the next one, hiding the
/// interleavings in which a descheduled writer makes every attempt fail (the swap that
/// gives up: docs/design.md, "S1 and a swap that gives up").
#[inline]
fn relax() {
    core::hint::spin_loop();
}

/// Validates that `id` is one of `cpu`'s pages.
#[inline]
fn page_id(l: &RingGeometry, cpu: u32, id: u64) -> Result<u32, RingError> {
    if l.owns(cpu, id) {
        Ok(id as u32)
    } else {
        Err(RingError::BadPageId(id))
    }
}

/// The per-CPU writer. Its fields cache what only the writer changes; the shared
/// control block mirrors what other agents read (see `hyptrace_abi::layout::ctl`).
#[derive(Debug)]
pub struct Writer<M: SharedMem> {
    mem: M,
    l: RingGeometry,
    cpu: u32,
    ctl: usize,
    cap: usize,
    max_payload: usize,
    tail: u32,
    tail_off: usize,
    /// Bytes used in the tail page's data area.
    write: usize,
    /// `cap` while the tail page takes events (no drop pending, ring not corrupt), else
    /// 0: the write path's fast case tests `write + size <= open` alone
    /// ([`Writer::refresh_open`] keeps it after everything that changes those).
    open: usize,
    /// RB_MISSED_EVENTS if the tail page starts after drops (stop mode), else 0.
    commit_flags: u64,
    write_stamp: u64,
    entries: u64,
    dropped: u64,
    overrun: u64,
    pages_touched: u64,
    bytes: u64,
    page_entries: u64,
    lost_pending: u64,
    /// Events attempted (every write call), published in `ctl::ATTEMPTED` (R3).
    attempted: u64,
    /// Events skipped (disabled), published in `ctl::SKIPPED` (R3).
    skipped: u64,
    mbox_seen: u64,
    mbox_served: u64,
    /// Swaps run by the writer itself on released pages.
    self_swaps: u64,
    /// Where the last mailbox swap left the HEAD link (see [`SwapHint`]).
    swap_hint: SwapHint,
    corrupt: bool,
}

impl<M: SharedMem> Writer<M> {
    /// Attaches to CPU `cpu`'s ring in the trace region `mem` (the pack at offset 0),
    /// which the host initialised. Validates the pack and the control block.
    pub fn attach(mem: M, cpu: u32) -> Result<Self, RingError> {
        let l = RingGeometry::parse(&mem)?;
        if cpu >= l.nr_cpus {
            return Err(RingError::BadCpu(cpu));
        }
        let c = l.ctl(cpu);
        if mem.load(c + ctl::MAGIC, Relaxed) != CTL_MAGIC {
            return Err(RingError::RingGeometry(LayoutError::BadMagic));
        }
        // Acquire: paired with the Release store of tail_page in Writer::move_tail (of the
        // writer that left this ring): the tail page's set-up is visible to resume() (W4).
        let tail = page_id(&l, cpu, mem.load(c + ctl::TAIL_PAGE, Acquire))?;
        let mut w = Self {
            cap: l.data_capacity(),
            max_payload: l.max_payload(),
            tail,
            tail_off: l.page_off(tail),
            write: 0,
            open: 0,
            commit_flags: 0,
            write_stamp: mem.load(c + ctl::WRITE_STAMP, Relaxed),
            entries: mem.load(c + ctl::ENTRIES, Relaxed),
            dropped: mem.load(c + ctl::DROPPED, Relaxed),
            overrun: mem.load(c + ctl::OVERRUN, Relaxed),
            pages_touched: mem.load(c + ctl::PAGES_TOUCHED, Relaxed),
            bytes: mem.load(c + ctl::BYTES, Relaxed),
            page_entries: 0,
            lost_pending: mem.load(c + ctl::LOST_PENDING, Relaxed),
            // R3: a writer attaching to a ring another left goes on counting from its
            // published attempts (the host reads them as one count per CPU).
            attempted: mem.load(c + ctl::ATTEMPTED, Relaxed),
            skipped: mem.load(c + ctl::SKIPPED, Relaxed),
            // Requests are served once: a request whose seq was acknowledged is done (a
            // request posted before this attach is still served).
            // Acquire: paired with the Release store of mbox_ack in Writer::serve_request (M1).
            mbox_seen: mem.load(c + ctl::MBOX_ACK, Acquire) >> 8,
            mbox_served: 0,
            self_swaps: 0,
            swap_hint: SwapHint::default(),
            corrupt: false,
            mem,
            l,
            cpu,
            ctl: c,
        };
        w.resume();
        w.refresh_open();
        // Release: paired with the Acquire loads of writer_state in RingBuffer::writer_finished
        // and Mailbox::request: the counters resume() stored back come before the state (W4).
        w.mem.swap(c + ctl::WRITER_STATE, WRITER_ACTIVE, Release);
        Ok(w)
    }

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
    fn resume(&mut self) {
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

    /// The CPU this writer writes for.
    pub fn cpu(&self) -> u32 {
        self.cpu
    }

    /// The layout of the trace region.
    pub fn layout(&self) -> &RingGeometry {
        &self.l
    }

    /// The shared memory.
    pub fn mem(&self) -> &M {
        &self.mem
    }

    /// Events committed.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Events dropped (stop mode, ring full).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Events overwritten (overwrite mode).
    pub fn overrun(&self) -> u64 {
        self.overrun
    }

    /// Events skipped because disabled.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Events attempted: every [`Writer::write`], [`Writer::write_enabled`] and
    /// [`Writer::skip`] (written, dropped, skipped or refused).
    pub fn attempted(&self) -> u64 {
        self.attempted
    }

    /// Counts one attempt and publishes it (invariant R3: before the event is written,
    /// dropped or skipped, so a writer stopped anywhere has counted every event it took
    /// in). One Relaxed store into the cache line the write path stores anyway.
    #[inline(always)]
    fn count_attempt(&mut self) {
        self.attempted = self.attempted.wrapping_add(1);
        self.ctl_store(ctl::ATTEMPTED, self.attempted, Relaxed);
    }

    /// Counts one event as skipped (disabled) without writing it: what
    /// [`Writer::write`] does when the slot's bit is clear, for callers that test
    /// [`Writer::enabled`] themselves before building the payload. Counts the attempt too.
    #[inline(always)]
    pub fn skip(&mut self) {
        self.count_attempt();
        self.skipped = self.skipped.wrapping_add(1);
        // Release: pairs with the Acquire load of skipped in
        // hyptrace_reader::RingBuffer::attempts, which loads attempted after it: the
        // attempt stored above is visible there, so skipped <= attempted (R3).
        self.ctl_store(ctl::SKIPPED, self.skipped, Release);
    }

    /// Mailbox requests served.
    pub fn mailbox_served(&self) -> u64 {
        self.mbox_served
    }

    /// Swaps the writer ran by itself on pages the host released ([`ctl::RELEASED`]).
    pub fn self_swaps(&self) -> u64 {
        self.self_swaps
    }

    /// Largest payload [`Writer::write`] accepts.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    /// Whether event slot `slot` (0..64) is enabled: one relaxed load of the enable word
    /// the host flips.
    #[inline(always)]
    pub fn enabled(&self, slot: u32) -> bool {
        (self.ctl_load(ctl::ENABLE, Relaxed) >> (slot & 63)) & 1 != 0
    }

    /// Loads word `field` (a `ctl::*` offset) of this CPU's control block, without the
    /// region check of every access (the writer at the bound: validated once, at attach).
    #[inline(always)]
    fn ctl_load(&self, field: usize, order: core::sync::atomic::Ordering) -> u64 {
        // A constant at every call site: the check folds away.
        assert!(field < hyptrace_abi::layout::CTL_SIZE && field.is_multiple_of(8));
        // SAFETY: attach parsed the geometry against this region (`RingGeometry::parse`:
        // `region_size <= mem.size()`, and every control block lies below `region_size`)
        // and checked `cpu < nr_cpus`; `self.ctl` is that CPU's control block (64-aligned)
        // and `field` an 8-aligned offset inside it (asserted above), so the word is
        // 8-aligned and inside the region; `size()` never changes (the trait's contract).
        unsafe { self.mem.load_unchecked(self.ctl + field, order) }
    }

    /// Stores word `field` of this CPU's control block; see [`Writer::ctl_load`].
    #[inline(always)]
    fn ctl_store(&self, field: usize, v: u64, order: core::sync::atomic::Ordering) {
        assert!(field < hyptrace_abi::layout::CTL_SIZE && field.is_multiple_of(8));
        // SAFETY: as in `ctl_load`: an 8-aligned word of this CPU's control block, inside
        // the region validated at attach.
        unsafe { self.mem.store_unchecked(self.ctl + field, v, order) }
    }

    /// Writes one event of `payload` with timestamp `ts` if slot `slot` is enabled.
    ///
    /// reserve → fill → commit: the event (and a TIME_EXTEND before it when the delta
    /// needs more than 27 bits) is written past the committed bytes of the tail page,
    /// then `commit` is published with Release, so a reader that loads `commit` with
    /// Acquire sees the whole payload. A `ts` below the previous event's is clamped to
    /// it (delta 0), never turned into a huge unsigned delta.
    ///
    /// ```
    /// use core::sync::atomic::Ordering::SeqCst;
    /// use hyptrace_abi::layout::ctl;
    /// use hyptrace_abi::{events, HeapMem, Mode, RingGeometry, SharedMem};
    /// use hyptrace_writer::{WriteOutcome, Writer};
    /// let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
    /// let mem = HeapMem::new(l.region_size);
    /// l.init_region(&mem, 1_000_000, 1);
    /// let mut w = Writer::attach(&mem, 0)?;
    /// let ev = events::marker(events::vcpu_pid(0), 0, 0);
    /// assert_eq!(w.write(3, 100, &ev), WriteOutcome::Written); // init enables every slot
    /// mem.fetch_and(l.ctl(0) + ctl::ENABLE, !(1 << 3), SeqCst); // the host disables slot 3
    /// assert_eq!(w.write(3, 200, &ev), WriteOutcome::Disabled); // counted as skipped
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn write(&mut self, slot: u32, ts: u64, payload: &[u8]) -> WriteOutcome {
        if !self.enabled(slot) {
            self.skip();
            return WriteOutcome::Disabled;
        }
        self.write_enabled(ts, payload)
    }

    /// [`Writer::write`] without the enable check (the attempt is counted all the same).
    #[inline]
    pub fn write_enabled(&mut self, ts: u64, payload: &[u8]) -> WriteOutcome {
        // R3: counted before anything of the event is written (the commit's Release
        // keeps this store before it).
        self.count_attempt();
        let ts = ts.max(self.write_stamp);
        let delta = ts - self.write_stamp;
        let size = page::data_event_size(payload.len());
        // The common case, one test each: the event follows others on the tail page,
        // needs no TIME_EXTEND, and fits. `open` is 0 while a drop is pending or the
        // ring is corrupt, and a payload over `max_payload` makes `size > cap`, so
        // those go the slow way too.
        if self.write != 0 && delta <= page::MAX_DELTA && self.write + size <= self.open {
            let at = self.tail_off + PAGE_HEADER_SIZE + self.write;
            // SAFETY: the reservation (see `write_slow`): `write + size <= open <= cap`.
            unsafe { self.put_event(at, delta, payload, size) };
            self.commit(ts, size);
            return WriteOutcome::Written;
        }
        let out = self.write_slow(ts, payload);
        self.refresh_open();
        out
    }

    /// Keeps `open` (see the field) after the slow path and attach.
    #[inline(always)]
    fn refresh_open(&mut self) {
        self.open = if self.corrupt || self.lost_pending != 0 {
            0
        } else {
            self.cap
        };
    }

    /// Everything [`Writer::write_enabled`]'s fast case leaves: the first event of a
    /// page, a TIME_EXTEND, a page move, a drop, a payload too large, a corrupt ring.
    /// `ts` is clamped already.
    #[inline(never)]
    fn write_slow(&mut self, mut ts: u64, payload: &[u8]) -> WriteOutcome {
        if payload.len() > self.max_payload {
            return WriteOutcome::TooLarge;
        }
        if self.corrupt {
            return WriteOutcome::Corrupt;
        }
        let size = page::data_event_size(payload.len());
        let mut delta = ts - self.write_stamp;
        let mut need = size
            + if delta > page::MAX_DELTA {
                page::TIME_EXTEND_SIZE
            } else {
                0
            };
        if self.write == 0 {
            need = size;
        }
        // After a drop (stop mode), the tail page is closed: an event written on it now
        // would put the loss inside the page, where no first_index can mark it (W3).
        if self.lost_pending != 0 || self.write + need > self.cap {
            match self.move_tail() {
                Ok(true) => need = size,
                Ok(false) => {
                    self.dropped = self.dropped.wrapping_add(1);
                    self.lost_pending = self.lost_pending.wrapping_add(1);
                    self.ctl_store(ctl::DROPPED, self.dropped, Relaxed);
                    self.ctl_store(ctl::LOST_PENDING, self.lost_pending, Relaxed);
                    return WriteOutcome::Dropped;
                }
                Err(_) => {
                    self.corrupt = true;
                    return WriteOutcome::Corrupt;
                }
            }
        }
        // The writer at the bound: from here to the commit every access goes to the
        // tail page's header and to `[at, data + write + need)`, which lies inside the
        // page's data area — `write + need <= cap` holds here: either the test above
        // said so, or the tail just moved (`write = 0`, `need = size <= cap`, since
        // `payload.len() <= max_payload`) — and the tail page is one of this CPU's pages
        // (`page_id`-checked where `tail` was set: attach, move_tail), inside the region
        // that attach validated (`RingGeometry::parse`: `region_size <= mem.size()`).
        // So the accesses need no check of their own: `*_unchecked`, each with that
        // argument (the SAFETY comments below refer to it as "the reservation"). The
        // fast case of `write_enabled` is this with `write != 0`, no TIME_EXTEND and
        // `write + size <= open <= cap` tested directly.
        debug_assert!(self.write + need <= self.cap);
        let mut at = self.tail_off + PAGE_HEADER_SIZE + self.write;
        if self.write == 0 {
            // First event of the page: the page's time_stamp is its time, delta 0.
            // SAFETY: the page's first 8 bytes (`time_stamp`, plain data) of the tail
            // page, inside the region (the reservation).
            unsafe {
                self.mem
                    .write_bytes_unchecked(self.tail_off, &ts.to_le_bytes())
            };
            delta = 0;
        } else if delta > page::MAX_DELTA {
            // A jump beyond 59 bits (years of TSC) is recorded as the largest extend,
            // and the event's time as what the page then decodes to.
            let d = if delta > page::MAX_EXTENDED_DELTA {
                ts = self.write_stamp + page::MAX_EXTENDED_DELTA;
                page::MAX_EXTENDED_DELTA
            } else {
                delta
            };
            // SAFETY: the TIME_EXTEND's 8 bytes are the first of the `need` reserved
            // (the reservation).
            unsafe {
                self.mem
                    .write_bytes_unchecked(at, &page::encode_time_extend(d))
            };
            at += page::TIME_EXTEND_SIZE;
            delta = 0;
        }
        // SAFETY: the event's `size` bytes end the `need` reserved (the reservation).
        unsafe { self.put_event(at, delta, payload, size) };
        self.commit(ts, need);
        WriteOutcome::Written
    }

    /// Writes a data event (header with `delta`, padded payload: `size` bytes) at `at`.
    ///
    /// # Safety
    /// `[at, at + size)` lies in the tail page's data area (the reservation) and
    /// `size == data_event_size(payload.len())`, `delta <= MAX_DELTA`.
    #[inline(always)]
    unsafe fn put_event(&self, at: usize, delta: u64, payload: &[u8], size: usize) {
        let mut hdr = [0u8; 8];
        let hlen = page::encode_data_header(&mut hdr, payload.len(), delta as u32);
        // Fixed-size stores (one instruction each), never a variable-length copy: a
        // small copy is a call to memcpy, which in the guest is a `rep movsb`.
        // SAFETY: the event's header (4 or 8 bytes, `hlen`) starts its `size` bytes
        // (the caller's reservation).
        unsafe {
            if hlen == 4 {
                self.mem.write_bytes_unchecked(at, &hdr[..4]);
            } else {
                self.mem.write_bytes_unchecked(at, &hdr);
            }
        }
        let at = at + hlen;
        let padded = size - hlen;
        if padded != payload.len() {
            // Zero the event's last word (its 1..=3 padding bytes), then copy the payload
            // over its head: one 4-byte store instead of a memset call.
            // SAFETY: `[at + padded - 4, at + padded)` is the end of the event's bytes
            // (`size = hlen + padded`; padded >= 4 here) (the caller's reservation).
            unsafe { self.mem.write_bytes_unchecked(at + padded - 4, &[0u8; 4]) };
        }
        // SAFETY: the payload's bytes follow the header inside the event's bytes
        // (`payload.len() <= padded`) (the caller's reservation).
        unsafe { self.mem.write_bytes_unchecked(at, payload) };
    }

    /// Publishes the event just written (`need` bytes with its TIME_EXTEND, at time
    /// `ts`) and counts it.
    #[inline(always)]
    fn commit(&mut self, ts: u64, need: usize) {
        self.write += need;
        // Publish: the payload above happens-before any Acquire load that sees this (W1).
        // Release (COMMIT_ORDER): paired with the Acquire load of commit in
        // RingBuffer::refresh (and Writer::resume).
        // SAFETY: the tail page's `commit` word (8-aligned: pages are page-aligned and
        // COMMIT_OFFSET is 8), inside the region (the reservation).
        unsafe {
            self.mem.store_unchecked(
                self.tail_off + COMMIT_OFFSET,
                self.write as u64 | self.commit_flags,
                COMMIT_ORDER,
            )
        };
        self.write_stamp = ts;
        // Counters may have been continued from shared memory (attach): wrap, never
        // overflow-panic.
        self.entries = self.entries.wrapping_add(1);
        self.page_entries += 1;
        self.bytes = self.bytes.wrapping_add(need as u64);
        self.ctl_store(ctl::ENTRIES, self.entries, Relaxed);
        self.ctl_store(ctl::BYTES, self.bytes, Relaxed);
        self.ctl_store(ctl::WRITE_STAMP, ts, Relaxed);
    }

    /// Moves the tail to the next page. Returns `Ok(false)` when the ring is full in
    /// stop mode.
    ///
    /// Invariant W2, kept here: the writer only ever moves onto the page its tail's link
    /// names, and onto the head page only after turning the HEAD link into UPDATE with
    /// a compare-exchange (overwrite mode) — so it never writes the reader page, which
    /// no ring link names.
    #[cold]
    fn move_tail(&mut self) -> Result<bool, RingError> {
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
    fn push_head(&mut self, tf: usize, head: u32) -> Result<(), RingError> {
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

    /// Marks the writer finished: it will write no more (the host may then read
    /// without swapping).
    pub fn finish(&mut self) {
        // Release: paired with the Acquire loads of writer_state in RingBuffer::writer_finished
        // and Mailbox::request: every commit and counter comes before FINISHED (R1).
        self.mem
            .swap(self.ctl + ctl::WRITER_STATE, WRITER_FINISHED, Release);
    }
}

/// What [`scan_page`] found in the committed bytes of the writer's own tail page.
#[derive(Clone, Copy, Debug)]
struct PageScan {
    /// Data events decoded.
    events: u64,
    /// The page's clock after the last record: its `time_stamp` plus every delta and
    /// TIME_EXTEND (the timestamp of its last event, as the writer's `write_stamp`).
    clock: u64,
    /// Bytes of the last data event with the TIME_EXTEND before it (what the write that
    /// committed it added to `bytes`).
    last_bytes: u64,
    /// The bytes are exactly what this writer writes: data events and TIME_EXTENDs
    /// ending at `len`. Anything else (padding, an absolute TIME_STAMP, a record
    /// running past `len`, a bad length word) is not ours.
    clean: bool,
}

/// Decodes the `len` committed bytes of the page at `page` (the writer's own tail page,
/// on attach) straight from shared memory, without allocation. Bounded: every record
/// advances at least 4 bytes, so at most `len / 4` iterations; stops at the first
/// record this writer would not have written.
fn scan_page<M: SharedMem + ?Sized>(mem: &M, page: usize, len: usize) -> PageScan {
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

/// Finds the head: the page named by the one link that carries HEAD (or UPDATE while
/// the writer moves it), walking from the tail at most the ring's length. Returns the
/// footer offset of the page whose link names the head, and that link.
fn find_head<M: SharedMem + ?Sized>(
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
fn try_swap<M: SharedMem + ?Sized>(
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
struct SwapSides {
    /// Footer offset of the page whose link now names `reader`.
    pf: usize,
    /// The old reader page, now in the ring.
    reader: u32,
    /// The page taken out: the new reader page.
    head: u32,
    /// The page after `head`: the new head.
    after: u32,
}

/// The steps of a swap after its compare-exchange: the footer bits, `head`'s overrun
/// snapshot, FT_HEAD on the new head, then `head` published as the reader page. Run by
/// every swap ([`swap_reader_page_hinted`]) and again by a writer attaching after one
/// stopped halfway ([`Writer::finish_own_swap`]): each step can be done again.
fn complete_swap<M: SharedMem + ?Sized>(
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
fn mark_new_head<M: SharedMem + ?Sized>(
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
fn footer_stats_to<M: SharedMem + ?Sized>(mem: &M, l: &RingGeometry, cpu: u32, page: u32) {
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

#[cfg(test)]
mod tests;
