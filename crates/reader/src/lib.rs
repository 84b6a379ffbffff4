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
use hyptrace_abi::layout::{self, ctl, footer, LayoutError, Mode, RingGeometry};
use hyptrace_abi::SharedMem;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Acquire;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

mod accounting;
mod consume;
mod error;
mod swap;

pub use error::ReadError;

/// Swaps one `next_event`/`next_page` call may do before returning (a hostile writer
/// could otherwise hand out empty pages forever).
const MAX_SWAPS_PER_CALL: u32 = 4;

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

/// The README's code blocks, run as doc tests (README and crate docs cannot drift).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
