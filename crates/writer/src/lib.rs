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

use core::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use hyptrace_abi::layout::{
    ctl, LayoutError, RingGeometry, CTL_MAGIC, WRITER_ACTIVE, WRITER_FINISHED,
};
/// The shared-memory trait (re-exported: the [`event!`] macro's code names it).
pub use hyptrace_abi::SharedMem;

mod recover;
mod swap;
mod tail;
mod write;

pub use swap::{swap_reader_page, swap_reader_page_hinted, update_footers, SwapHint};

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

    /// Marks the writer finished: it will write no more (the host may then read
    /// without swapping).
    pub fn finish(&mut self) {
        // Release: paired with the Acquire loads of writer_state in RingBuffer::writer_finished
        // and Mailbox::request: every commit and counter comes before FINISHED (R1).
        self.mem
            .swap(self.ctl + ctl::WRITER_STATE, WRITER_FINISHED, Release);
    }
}

#[cfg(test)]
mod tests;

/// The README's code blocks, run as doc tests (README and crate docs cannot drift).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
