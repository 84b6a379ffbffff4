//! hyptrace's host-side reader.
//!
//! [`RingBuffer`] allocates (initialises) the per-CPU rings in a trace region, and reads
//! them back through two callbacks ([`Callbacks`]): `swap_reader(cpu)` takes the next
//! full page away from the writer, `update_footers(cpu)` refreshes the writer's stats in
//! the reader page footer; [`RingBuffer::poke`] polls. Reads are consuming: per CPU an
//! event at a time ([`RingBuffer::next_event`]) or a whole page at a time
//! ([`RingBuffer::next_page`], for zero-copy output), with the exact number of events
//! lost at the exact place of the loss. After the writer stopped (or crashed),
//! [`RingBuffer::finalize`] switches to a read-only walk of the remaining pages in ring
//! order, recovered from the footers' page sequence numbers — no swaps.
//!
//! **Every byte of the region is hostile input**: the writer may be buggy, crashed or
//! malicious. Every id, length, commit and counter read from the region is validated,
//! every loop is bounded, and inconsistencies are [`ReadError`]s — never panics, never
//! accesses outside the region.
//!
//! ```
//! use std::sync::Arc;
//! use hyptrace_abi::{events, HeapMem, Mode, RingGeometry};
//! use hyptrace_reader::{Direct, Item, RingBuffer};
//!
//! let l = RingGeometry::new(1, 4, 4096, Mode::Overwrite, false)?;
//! let mem = Arc::new(HeapMem::new(l.region_size)); // a VMM: its guest memory
//! // Host-run swaps (`Direct`); `callbacks::for_geometry` picks the mailbox for
//! // guest-run ones.
//! let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 1_000_000, 1)?;
//!
//! // The writer (in a guest, normally) writes 1000 events into a 3-page ring.
//! let mut w = hyptrace_writer::Writer::attach(mem.clone(), 0)?;
//! for seq in 0..1000 {
//!     w.write_enabled(seq, &events::marker(events::vcpu_pid(0), seq, 0));
//! }
//! w.finish();
//!
//! // Consuming read; then (the writer stopped) the final read-only walk.
//! reader.sync_writer_counters(0)?;
//! reader.finalize(0)?;
//! let (mut read, mut lost) = (0u64, 0u64);
//! while let Some(item) = reader.next_event(0)? {
//!     match item {
//!         Item::Event { .. } => read += 1,
//!         Item::Lost(n) => lost += n,
//!     }
//! }
//! // Overwrite mode kept the newest events; every loss counted where it happened.
//! assert_eq!(read + lost, 1000);
//! assert_eq!((reader.stats(0).read, reader.stats(0).lost), (read, lost));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod callbacks;
pub mod postmortem;
pub mod registry;
#[doc(hidden)]
pub mod seeded;
pub mod trace_file;

pub use callbacks::{
    Callbacks, Direct, Mailbox, MailboxOp, MailboxPort, MailboxSeq, MailboxStatus, SwapReply,
    SwapStatus,
};
use hyptrace_abi::layout::{self, ctl, footer, LayoutError, Mode, RingGeometry, FOOTER_MAGIC};
use hyptrace_abi::page::{self, Record, COMMIT_LEN_MASK, COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_abi::SharedMem;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Swaps one `next_event`/`next_page` call may do before returning (a hostile writer
/// could otherwise hand out empty pages forever).
const MAX_SWAPS_PER_CALL: u32 = 4;

/// Errors of the reader. Most mean the shared region is inconsistent: the writer is
/// buggy, crashed mid-operation, or hostile.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// The pack or layout is invalid (why: the source).
    #[error("trace region")]
    RingGeometry(#[source] LayoutError),
    /// A writer-domain operation failed.
    #[error("cpu {cpu}: {err}")]
    Ring {
        /// The CPU.
        cpu: u32,
        /// What went wrong.
        err: hyptrace_writer::RingError,
    },
    /// No such CPU.
    #[error("cpu {0} out of range")]
    BadCpu(u32),
    /// A page id read from the region is not one of the CPU's pages.
    #[error("cpu {cpu}: page id {id} outside its pages")]
    BadPageId {
        /// The CPU.
        cpu: u32,
        /// The id.
        id: u64,
    },
    /// A page's commit is past its data area or went backwards.
    #[error("cpu {cpu}: page {page}: bad commit {commit:#x} (had {had} bytes)")]
    BadCommit {
        /// The CPU.
        cpu: u32,
        /// The page.
        page: u32,
        /// The commit word.
        commit: u64,
        /// Bytes already seen.
        had: usize,
    },
    /// Event data did not decode.
    #[error("cpu {cpu}: page {page}: {err}")]
    Decode {
        /// The CPU.
        cpu: u32,
        /// The page.
        page: u32,
        /// The decoder's error.
        err: page::DecodeError,
    },
    /// A page's first event index is before events already read.
    #[error("cpu {cpu}: page {page} starts at event {first}, before {expected}")]
    IndexBackwards {
        /// The CPU.
        cpu: u32,
        /// The page.
        page: u32,
        /// Its first index.
        first: u64,
        /// Index expected.
        expected: u64,
    },
    /// Released pages: the link of a page the writer left is not one it moved along (a
    /// flagged link, or one naming the page itself).
    #[error("cpu {cpu}: page {page} was left by the writer through link {link:#x}, which no writer of ours leaves")]
    BadLink {
        /// The CPU.
        cpu: u32,
        /// The page the writer left.
        page: u32,
        /// Its link word.
        link: u64,
    },
    /// Released pages: a reader attached to a ring another reader has released pages of
    /// (where that reader stood is not in the ring: it would read pages the writer may
    /// rewrite).
    #[error("cpu {cpu}: another reader released pages of this ring up to page_seq {released}; a reader with released pages can only start on a fresh ring")]
    AlreadyReleased {
        /// The CPU.
        cpu: u32,
        /// The control block's `released`.
        released: u64,
    },
    /// A swap reported success but the reader page did not change.
    #[error("cpu {cpu}: swap reported success but reader page stayed {page}")]
    SwapNoProgress {
        /// The CPU.
        cpu: u32,
        /// The reader page.
        page: u32,
    },
    /// A footer counter went backwards.
    #[error("cpu {cpu}: footer counter {what} went backwards ({old} -> {new})")]
    CounterBackwards {
        /// The CPU.
        cpu: u32,
        /// Which counter.
        what: &'static str,
        /// Previous value.
        old: u64,
        /// New value.
        new: u64,
    },
    /// A footer is not ours (magic or id).
    #[error("cpu {cpu}: page {page}: bad footer")]
    BadFooter {
        /// The CPU.
        cpu: u32,
        /// The page.
        page: u32,
    },
    /// Two pages claim the same sequence number in the final walk.
    #[error("cpu {cpu}: pages {a} and {b} have the same sequence number")]
    DuplicateSeq {
        /// The CPU.
        cpu: u32,
        /// One page.
        a: u32,
        /// The other.
        b: u32,
    },
    /// The writer did not answer a mailbox request in time.
    #[error(
        "cpu {cpu}: the guest writer did not answer the mailbox within {timeout:?} (stuck writer?)"
    )]
    MailboxTimeout {
        /// The CPU.
        cpu: u32,
        /// The timeout.
        timeout: Duration,
    },
    /// The writer has finished (it serves no more mailbox requests): read the rest with
    /// [`RingBuffer::finalize`].
    #[error("cpu {cpu}: the writer has finished")]
    WriterStopped {
        /// The CPU.
        cpu: u32,
    },
    /// The writer answered a mailbox request with a failure.
    #[error("cpu {cpu}: the guest writer failed a mailbox request (status {status})")]
    MailboxFailed {
        /// The CPU.
        cpu: u32,
        /// The status.
        status: u64,
    },
    /// A configuration value is invalid.
    #[error("{0}")]
    Config(String),
}

impl From<LayoutError> for ReadError {
    fn from(e: LayoutError) -> Self {
        Self::RingGeometry(e)
    }
}

/// Configuration of a trace buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Number of CPUs.
    pub nr_cpus: u32,
    /// Ring bytes per CPU (rounded up to whole pages, at least 2 ring pages; the reader
    /// page comes on top).
    pub buffer_bytes: u64,
    /// Page size (power of two ≥ 4096).
    pub page_size: usize,
    /// Overwrite (flight recorder) or stop-when-full.
    pub mode: Mode,
    /// Whether the guest serves swap/update requests itself (mailbox).
    pub guest_swap: bool,
}

impl Config {
    /// The region layout for this configuration.
    pub fn layout(&self) -> Result<RingGeometry, ReadError> {
        if !self.page_size.is_power_of_two()
            || self.page_size < layout::MIN_PAGE_SIZE
            || self.page_size > layout::MAX_PAGE_SIZE
        {
            return Err(LayoutError::BadPageSize(self.page_size as u64).into());
        }
        let pages = RingGeometry::pages_for_bytes(self.buffer_bytes, self.page_size);
        let pages = u32::try_from(pages).map_err(|_| LayoutError::BadPageCount(pages))?;
        Ok(RingGeometry::new(
            self.nr_cpus,
            pages,
            self.page_size,
            self.mode,
            self.guest_swap,
        )?)
    }
}

/// What a CPU's writer published of its attempts (invariant R3, docs/design.md
/// "Published attempts"): read from its control block at any moment
/// ([`RingBuffer::attempts`]), hostile values included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attempts {
    /// Events the guest attempted (written, dropped, skipped or refused), as published.
    pub attempted: u64,
    /// Of those, events skipped (disabled), as published.
    pub skipped: u64,
    /// The first reason the published counters cannot be true (kept once seen): an
    /// honest writer never gives one.
    pub problem: Option<AttemptsProblem>,
}

/// Why a CPU's published attempts cannot be true (R3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AttemptsProblem {
    /// More events skipped than attempted.
    #[error("the guest published skipped {skipped} > attempted {attempted}")]
    SkippedAboveAttempted {
        /// Attempted, as read.
        attempted: u64,
        /// Skipped, as read.
        skipped: u64,
    },
    /// A counter went down between two reads.
    #[error("the guest's published attempted/skipped went down from {was_attempted}/{was_skipped} to {attempted}/{skipped}")]
    Decreased {
        /// Attempted at the earlier read.
        was_attempted: u64,
        /// Skipped at the earlier read.
        was_skipped: u64,
        /// Attempted now.
        attempted: u64,
        /// Skipped now.
        skipped: u64,
    },
}

/// Per-CPU statistics, as the reader sees them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuStats {
    /// Events the writer committed (from the footer after the last poke, or the control
    /// block after the writer stopped).
    pub written: u64,
    /// Events read.
    pub read: u64,
    /// Events overwritten (writer's count).
    pub overrun: u64,
    /// Events dropped while the ring was full (writer's count).
    pub dropped: u64,
    /// Events lost as the reader saw them (gaps in the event index), reported where
    /// they happened. Equals `overrun + dropped` once everything is read.
    pub lost: u64,
    /// Pages the writer moved onto.
    pub pages_touched: u64,
    /// Bytes of event data read (encoded sizes).
    pub bytes: u64,
    /// Pages this reader took from the writer: reader-page swaps it did or asked for,
    /// or (released pages) pages it read in place and released.
    pub swaps: u64,
    /// Pages read (consumed).
    pub pages_read: u64,
    /// Swaps that lost every attempt to a writer moving the head (retried later).
    pub contended: u64,
}

/// A page handed out by [`RingBuffer::next_page`].
#[derive(Debug)]
pub struct PageOut<'a> {
    /// The whole page (`page_size` bytes) as copied from the ring: header and committed
    /// data (commit flags cleared); the bytes after the data are not meaningful (stale
    /// data, footer) — sinks zero them.
    pub bytes: &'a [u8],
    /// Committed data bytes.
    pub commit_len: usize,
    /// Events lost right before this page (0: none).
    pub missed: u64,
    /// Events on the page.
    pub events: u64,
    /// The index of its first event (the writer's count: the events before it were
    /// handed out before, or lost — `missed` of them right before this page).
    pub first_index: u64,
    /// Timestamp of the first event, if any.
    pub first_ts: Option<u64>,
    /// Timestamp of the last event, if any.
    pub last_ts: Option<u64>,
}

/// An item of a CPU's consuming read.
#[derive(Debug, PartialEq, Eq)]
pub enum Item<'a> {
    /// An event: absolute timestamp and payload (zero-padded to its encoded length).
    Event {
        /// Timestamp (guest clock).
        ts: u64,
        /// Payload.
        payload: &'a [u8],
    },
    /// `n` events were lost right here (before the next event).
    Lost(u64),
}

#[derive(Debug)]
struct CpuState {
    cpu: u32,
    reader: u32,
    buf: Vec<u8>,
    /// Data bytes of the reader page copied into `buf`.
    copied: usize,
    /// Offset of the next record in the data area.
    read: usize,
    clock: u64,
    page_events: u64,
    expected: u64,
    pending_lost: u64,
    /// A piece handed out from the middle of a page, rebuilt as a page of its own
    /// ([`RingBuffer::next_piece`]).
    piece: Vec<u8>,
    stats: CpuStats,
    last_entries: u64,
    /// Final walk: remaining pages in ring order (set by `finalize`).
    final_queue: Option<VecDeque<u32>>,
    trailing_done: bool,
    /// A swap request is in flight (mailbox): the writer may swap at any moment, after
    /// which our page is back in the ring — so the page is not touched again until the
    /// answer is in.
    swap_in_flight: bool,
    /// Released pages ([`Callbacks::releases`]): the last `page_seq` stored in the
    /// control block's `released` (0: none yet; only grows).
    released: u64,
    /// The writer's published attempts at the last [`RingBuffer::attempts`] (R3).
    attempts: Attempts,
}

/// Wakes threads waiting for data ([`RingBuffer::waiter`]).
#[derive(Debug, Default)]
pub struct Waiter {
    gen: Mutex<u64>,
    cv: Condvar,
}

impl Waiter {
    fn notify(&self) {
        let mut g = self.gen.lock().unwrap_or_else(|p| p.into_inner());
        *g += 1;
        self.cv.notify_all();
    }

    /// Waits until a poke finds new events after generation `seen` or `timeout`
    /// passes; returns the current generation.
    pub fn wait(&self, seen: u64, timeout: Duration) -> u64 {
        let g = self.gen.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .cv
            .wait_timeout_while(g, timeout, |g| *g == seen)
            .unwrap_or_else(|p| p.into_inner());
        *g
    }

    /// The current generation.
    pub fn generation(&self) -> u64 {
        *self.gen.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The host side of the per-CPU trace buffers.
#[derive(Debug)]
pub struct RingBuffer<M, C> {
    mem: M,
    layout: RingGeometry,
    cb: C,
    cpus: Vec<CpuState>,
    waiter: Arc<Waiter>,
}

/// The writer's event index of CPU `cpu` (`cpu < l.nr_cpus`) from its control block:
/// events it took in, committed or dropped (`entries + dropped`; hostile values
/// saturate). Exact once the writer stopped; a snapshot while it runs.
pub fn ctl_writer_index<M: SharedMem + ?Sized>(mem: &M, l: &RingGeometry, cpu: u32) -> u64 {
    let c = l.ctl(cpu);
    // Acquire: the writer stores entries/dropped Relaxed: pairs with no store; read after
    // the vCPU stopped or writer_state said FINISHED (Release in Writer::finish).
    mem.load(c + ctl::ENTRIES, Acquire)
        .saturating_add(mem.load(c + ctl::DROPPED, Acquire))
}

impl<M: SharedMem, C: Callbacks> RingBuffer<M, C> {
    /// Allocates the buffers: writes the pack and initialises every CPU's ring in `mem`
    /// (the trace region, at least `layout.region_size` bytes).
    pub fn alloc(
        mem: M,
        layout: RingGeometry,
        cb: C,
        tsc_khz: u64,
        generation: u64,
    ) -> Result<Self, ReadError> {
        if mem.size() < layout.region_size {
            return Err(LayoutError::TooSmall {
                needed: layout.region_size as u64,
                available: mem.size() as u64,
            }
            .into());
        }
        layout.init_region(&mem, tsc_khz, generation);
        Self::attach(mem, cb)
    }

    /// Attaches to a region already initialised (by `alloc`, possibly in another
    /// process, or found in a dump), validating its pack. With callbacks that release
    /// pages ([`Callbacks::releases`]) only to a ring no reader released pages of
    /// ([`ReadError::AlreadyReleased`]).
    pub fn attach(mem: M, cb: C) -> Result<Self, ReadError> {
        let layout = RingGeometry::parse(&mem)?;
        let mut cpus = Vec::with_capacity(layout.nr_cpus as usize);
        for cpu in 0..layout.nr_cpus {
            // Acquire: paired with the Release store of reader_page in swap_reader_page_hinted;
            // then first_index: stored before the Release of page_seq in Writer::move_tail.
            let reader = valid_page(
                &layout,
                cpu,
                mem.load(layout.ctl(cpu) + ctl::READER_PAGE, Acquire),
            )?;
            let first = mem.load(layout.footer_off(reader) + footer::FIRST_INDEX, Acquire);
            // R2: a reader with released pages starts only where none were released.
            // Acquire: paired with the Release store of released in advance_released.
            let released = mem.load(layout.ctl(cpu) + ctl::RELEASED, Acquire);
            if cb.releases(cpu) && released != 0 {
                return Err(ReadError::AlreadyReleased { cpu, released });
            }
            cpus.push(CpuState {
                cpu,
                reader,
                buf: vec![0u8; layout.page_size],
                copied: 0,
                read: 0,
                clock: 0,
                page_events: 0,
                expected: first,
                pending_lost: 0,
                piece: Vec::new(),
                stats: CpuStats::default(),
                last_entries: 0,
                final_queue: None,
                trailing_done: false,
                swap_in_flight: false,
                released: 0,
                attempts: Attempts::default(),
            });
        }
        Ok(Self {
            mem,
            layout,
            cb,
            cpus,
            waiter: Arc::new(Waiter::default()),
        })
    }

    /// The layout of the region.
    pub fn layout(&self) -> &RingGeometry {
        &self.layout
    }

    /// The shared memory.
    pub fn mem(&self) -> &M {
        &self.mem
    }

    /// The callbacks.
    pub fn callbacks(&self) -> &C {
        &self.cb
    }

    /// Number of CPUs.
    pub fn nr_cpus(&self) -> u32 {
        self.layout.nr_cpus
    }

    /// A handle to wait for data found by [`RingBuffer::poke`].
    pub fn waiter(&self) -> Arc<Waiter> {
        self.waiter.clone()
    }

    /// Sets the enable word of `cpu`'s built-in events (bit n = slot n).
    pub fn set_enable(&self, cpu: u32, bits: u64) -> Result<(), ReadError> {
        self.check_cpu(cpu)?;
        // Release: pairs with no Acquire: the writer loads enable Relaxed (Writer::enabled,
        // one load per event); a flip takes effect at some later event.
        self.mem.store(
            self.layout.ctl(cpu) + ctl::ENABLE,
            bits,
            std::sync::atomic::Ordering::Release,
        );
        Ok(())
    }

    fn check_cpu(&self, cpu: u32) -> Result<(), ReadError> {
        if cpu < self.layout.nr_cpus {
            Ok(())
        } else {
            Err(ReadError::BadCpu(cpu))
        }
    }

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

    /// Copies newly committed bytes of the reader page into the local buffer.
    fn refresh(mem: &M, l: &RingGeometry, st: &mut CpuState) -> Result<(), ReadError> {
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
    fn enter_page(
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
    fn advance(&mut self, cpu: u32) -> Result<bool, ReadError> {
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
    fn writer_on_reader(&self, cpu: u32) -> Result<bool, ReadError> {
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

    /// The next item of `cpu`'s consuming read: an event, or the count of events lost
    /// right here. `Ok(None)` when nothing more is committed now.
    pub fn next_event(&mut self, cpu: u32) -> Result<Option<Item<'_>>, ReadError> {
        self.check_cpu(cpu)?;
        let mut swaps = 0;
        loop {
            let st = &mut self.cpus[cpu as usize];
            if st.pending_lost > 0 {
                let n = std::mem::take(&mut st.pending_lost);
                st.stats.lost = st.stats.lost.saturating_add(n);
                return Ok(Some(Item::Lost(n)));
            }
            // Decode what is already copied (each record advances `read`; bounded by the page).
            while st.read < st.copied {
                let data = &st.buf[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + st.copied];
                let (rec, next) = match page::decode_record(data, st.read) {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        st.read = st.copied;
                        break;
                    }
                    Err(err) => {
                        return Err(ReadError::Decode {
                            cpu,
                            page: st.reader,
                            err,
                        })
                    }
                };
                let size = next - st.read;
                st.read = next;
                st.stats.bytes += size as u64;
                match rec {
                    Record::Data { delta, start, len } => {
                        st.clock = st.clock.wrapping_add(delta);
                        st.page_events += 1;
                        st.expected = st.expected.saturating_add(1);
                        st.stats.read += 1;
                        let ts = st.clock;
                        let st = &self.cpus[cpu as usize];
                        let a = PAGE_HEADER_SIZE + start;
                        return Ok(Some(Item::Event {
                            ts,
                            payload: &st.buf[a..a + len],
                        }));
                    }
                    Record::TimeExtend { delta } => st.clock = st.clock.wrapping_add(delta),
                    Record::TimeStamp { ts } => st.clock = ts,
                    Record::Padding { .. } => {}
                }
            }
            if self.cpus[cpu as usize].swap_in_flight {
                if swaps >= MAX_SWAPS_PER_CALL || !self.advance(cpu)? {
                    return Ok(None);
                }
                swaps += 1;
                continue;
            }
            // Order: the tail is loaded before the commit, so if the writer has left
            // the page, the commit loaded after is final.
            let writer_here = self.writer_on_reader(cpu)?;
            let st = &mut self.cpus[cpu as usize];
            Self::refresh(&self.mem, &self.layout, st)?;
            if st.read < st.copied {
                continue;
            }
            if writer_here || swaps >= MAX_SWAPS_PER_CALL {
                return Ok(None);
            }
            if !self.advance(cpu)? {
                let n = self.take_trailing_loss(cpu);
                return Ok((n > 0).then_some(Item::Lost(n)));
            }
            swaps += 1;
        }
    }

    /// The next complete page of `cpu` (consuming), for page-at-a-time output: what
    /// [`RingBuffer::next_piece`] hands out with `partial` false. A page is handed out
    /// once the writer has left it (or, in the final walk, as it is). `Ok(None)` when no
    /// complete page is available now.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use hyptrace_abi::{events, HeapMem, Mode, RingGeometry};
    /// # use hyptrace_reader::{Direct, RingBuffer};
    /// let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
    /// let mem = Arc::new(HeapMem::new(l.region_size));
    /// let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 1_000_000, 1)?;
    /// let mut w = hyptrace_writer::Writer::attach(mem.clone(), 0)?;
    /// for seq in 0..200 { // 24-byte markers: more than one page
    ///     w.write_enabled(seq, &events::marker(events::vcpu_pid(0), seq, 0));
    /// }
    /// let page = reader.next_page(0)?.expect("a full page"); // swapped out of the ring
    /// assert_eq!((page.bytes.len(), page.missed, page.first_ts), (4096, 0, Some(0)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn next_page(&mut self, cpu: u32) -> Result<Option<PageOut<'_>>, ReadError> {
        self.next_piece(cpu, false)
    }

    /// The next piece of `cpu`'s consuming read (invariant C1, docs/design.md "One
    /// reader"): the committed part of the reader page not handed out yet, from the
    /// reading position (a record boundary) to the commit, as a page of its own — time
    /// stamp the clock at that position, commit its length — so every sink takes it. From
    /// the start of a page it is the page itself. With `partial` false only once the
    /// writer has left the page (its commit is final, W1; in the final walk at once);
    /// with `partial` true also the part of the writer's page committed so far.
    /// Events, pieces and pages of one CPU may be read in any mix: each starts where the
    /// last one stopped. `Ok(None)` when nothing is available now.
    pub fn next_piece(
        &mut self,
        cpu: u32,
        partial: bool,
    ) -> Result<Option<PageOut<'_>>, ReadError> {
        self.check_cpu(cpu)?;
        if !self.piece_ready(cpu, partial)? {
            return Ok(None);
        }
        Self::hand_out(&mut self.cpus[cpu as usize]).map(Some)
    }

    /// Moves `cpu`'s reader (swaps, bounded) until it stands before a piece
    /// [`RingBuffer::next_piece`] may hand out; false when there is none now.
    fn piece_ready(&mut self, cpu: u32, partial: bool) -> Result<bool, ReadError> {
        for _ in 0..=MAX_SWAPS_PER_CALL {
            if self.cpus[cpu as usize].swap_in_flight {
                if !self.advance(cpu)? {
                    return Ok(false);
                }
                continue;
            }
            let writer_here = self.writer_on_reader(cpu)?;
            let st = &mut self.cpus[cpu as usize];
            Self::refresh(&self.mem, &self.layout, st)?;
            if st.read < st.copied && (partial || !writer_here) {
                return Ok(true);
            }
            if writer_here || !self.advance(cpu)? {
                return Ok(false);
            }
        }
        Ok(false)
    }

    /// Hands out `st`'s reader page from its reading position to what is copied (C1):
    /// validates and counts the events first (a page that does not decode is an error,
    /// nothing of it is counted), then moves the position to the end.
    fn hand_out(st: &mut CpuState) -> Result<PageOut<'_>, ReadError> {
        // (Seeded bug `piece_from_start`, docs/fuzzing.md: the reading position ignored.)
        let from = if seeded::on("piece_from_start") {
            0
        } else {
            st.read
        };
        let to = st.copied;
        let data = &st.buf[PAGE_HEADER_SIZE + from..PAGE_HEADER_SIZE + to];
        let start_clock = st.clock;
        let mut events = page::Events::new(data, start_clock);
        let (mut first_ts, mut last_ts, mut n) = (None, None, 0u64);
        for ev in events.by_ref() {
            let ev = ev.map_err(|err| ReadError::Decode {
                cpu: st.cpu,
                page: st.reader,
                err,
            })?;
            first_ts.get_or_insert(ev.ts);
            last_ts = Some(ev.ts);
            n += 1;
        }
        st.clock = events.clock();
        st.read = to;
        st.page_events += n;
        let first_index = st.expected;
        st.expected = st.expected.saturating_add(n);
        st.stats.read += n;
        st.stats.bytes += (to - from) as u64;
        let missed = std::mem::take(&mut st.pending_lost);
        st.stats.lost = st.stats.lost.saturating_add(missed);
        let len = to - from;
        let bytes = if from == 0 {
            // The local copy carries the length without flags; sinks add their own.
            st.buf[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&(len as u64).to_le_bytes());
            &st.buf[..]
        } else {
            // Mid-page: the rest rebuilt as a page that starts at the reading position.
            let piece = &mut st.piece;
            piece.resize(st.buf.len(), 0);
            piece[..8].copy_from_slice(&start_clock.to_le_bytes());
            piece[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&(len as u64).to_le_bytes());
            piece[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len]
                .copy_from_slice(&st.buf[PAGE_HEADER_SIZE + from..PAGE_HEADER_SIZE + to]);
            &piece[..]
        };
        Ok(PageOut {
            bytes,
            commit_len: len,
            missed,
            events: n,
            first_index,
            first_ts,
            last_ts,
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

fn valid_page(l: &RingGeometry, cpu: u32, id: u64) -> Result<u32, ReadError> {
    if l.owns(cpu, id) {
        Ok(id as u32)
    } else {
        Err(ReadError::BadPageId { cpu, id })
    }
}

#[cfg(test)]
mod tests;
