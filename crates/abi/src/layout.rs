//! The trace region: pack header, per-CPU descriptors, control blocks and pages.
//!
//! ```text
//!  region offset 0
//!  +--------------------------+  pack header (PACK_HEADER_SIZE bytes)
//!  | magic "HTPACK01" ver size|
//!  | nr_cpus page_size flags  |
//!  | offsets of the parts     |
//!  +--------------------------+  cpu_descs_off: nr_cpus x CPU_DESC_SIZE
//!  | cpu 0: nr_pages first_pg |
//!  |   reader_pg ctl_off ...  |
//!  +--------------------------+  ctl_off (per CPU, CTL_SIZE each, 64-aligned)
//!  | control block: magic,    |
//!  |  reader/tail page ids,   |
//!  |  counters, enable word,  |
//!  |  mailbox                 |
//!  +--------------------------+  pages_off (page_size aligned)
//!  | page 0 | page 1 | ...    |  global page ids; CPU c owns
//!  +--------------------------+  [first_page, first_page + nr_pages)
//! ```
//!
//! Every page is a Linux `buffer_data_page` with a [`footer`] in its last
//! [`FOOTER_SIZE`] bytes. All integers are little-endian (x86_64).

use crate::mem::SharedMem;
use crate::page::PAGE_HEADER_SIZE;
use core::sync::atomic::Ordering::Relaxed;

/// Magic of the pack header: `"HTPACK01"`.
pub const PACK_MAGIC: u64 = u64::from_le_bytes(*b"HTPACK01");
/// Current pack version.
pub const PACK_VERSION: u32 = 5;
/// Size of the pack header.
pub const PACK_HEADER_SIZE: usize = 128;
/// Size of one per-CPU descriptor.
pub const CPU_DESC_SIZE: usize = 64;
/// Magic of a control block: `"HTCTL001"`.
pub const CTL_MAGIC: u64 = u64::from_le_bytes(*b"HTCTL001");
/// Size of a control block.
pub const CTL_SIZE: usize = 256;
/// Size of the page footer at the end of every page.
pub const FOOTER_SIZE: usize = 96;
/// Magic in every footer: `"HTFT"`.
pub const FOOTER_MAGIC: u32 = u32::from_le_bytes(*b"HTFT");
/// Smallest page size.
pub const MIN_PAGE_SIZE: usize = 4096;
/// Largest page size (the commit field keeps 30 bits of length).
pub const MAX_PAGE_SIZE: usize = 1 << 24;
/// Most CPUs a pack describes.
pub const MAX_CPUS: usize = 1024;
/// Fewest pages per CPU: the reader page and two ring pages.
pub const MIN_PAGES_PER_CPU: usize = 3;
/// Most pages per CPU (page ids and links keep 32 bits).
pub const MAX_PAGES_PER_CPU: usize = 1 << 24;

/// Pack flag: overwrite mode (flight recorder). Without it: stop-when-full.
pub const PACK_FLAG_OVERWRITE: u32 = 1 << 0;
/// Pack flag: the host asks the guest writer to run swap/update (mailbox) instead of
/// running them itself.
pub const PACK_FLAG_GUEST_SWAP: u32 = 1 << 1;
/// All pack flags this version knows.
pub const PACK_FLAGS_KNOWN: u32 = PACK_FLAG_OVERWRITE | PACK_FLAG_GUEST_SWAP;

/// Pack header field offsets (from the region start).
pub mod pack {
    /// u64 [`super::PACK_MAGIC`].
    pub const MAGIC: usize = 0;
    /// u32 version.
    pub const VERSION: usize = 8;
    /// u32 header size ([`super::PACK_HEADER_SIZE`]).
    pub const HEADER_SIZE: usize = 12;
    /// u32 number of CPUs.
    pub const NR_CPUS: usize = 16;
    /// u32 page size in bytes.
    pub const PAGE_SIZE: usize = 20;
    /// u32 size of one CPU descriptor ([`super::CPU_DESC_SIZE`]).
    pub const CPU_DESC_SIZE: usize = 24;
    /// u32 flags (`PACK_FLAG_*`).
    pub const FLAGS: usize = 28;
    /// u64 size of the whole region.
    pub const REGION_SIZE: usize = 32;
    /// u64 offset of the CPU descriptors.
    pub const CPU_DESCS_OFF: usize = 40;
    /// u64 offset of page 0.
    pub const PAGES_OFF: usize = 48;
    /// u64 total number of pages.
    pub const TOTAL_PAGES: usize = 56;
    /// u64 offset of the event registration table (0: none), between the control
    /// blocks and page 0, 64-aligned (see [`crate::registry`]).
    pub const EVENTS_OFF: usize = 64;
    /// u64 size of the event registration table.
    pub const EVENTS_SIZE: usize = 72;
    /// u64 TSC frequency in kHz as the host measured it (0: unknown).
    pub const TSC_KHZ: usize = 80;
    /// u64 region generation (host-chosen; lets a dump tell runs apart).
    pub const GENERATION: usize = 88;
    // 96..128 reserved, zero.
}

/// A per-CPU meta page in the Linux `trace_buffer_meta` layout (`include/uapi/linux/
/// trace_mmap.h`, with the ring-buffer remotes' `pages_lost` / `pages_touched` in the
/// two words that were reserved): what an external consumer attached to a running VMM
/// (`hyptrace dump --attach`) reads. Host-written only: the meta pages live in the
/// trace memory file after the region, out of the guest's reach (docs/abi.md, "Live
/// attach"). All integers little-endian.
pub mod meta {
    /// u32 size of one meta page (4096).
    pub const META_PAGE_SIZE: usize = 0;
    /// u32 bytes of the struct ([`STRUCT_LEN`]).
    pub const META_STRUCT_LEN: usize = 4;
    /// u32 sub-buffer (page) size.
    pub const SUBBUF_SIZE: usize = 8;
    /// u32 sub-buffers of the CPU (ring pages + the reader page).
    pub const NR_SUBBUFS: usize = 12;
    /// u64 events lost before the current reader page (since the previous one).
    pub const READER_LOST_EVENTS: usize = 16;
    /// u32 the current reader page, as an index into the CPU's pages (`< nr_subbufs`).
    pub const READER_ID: usize = 24;
    /// u32 bytes of the reader page's data the VMM knows consumed (0 after a swap).
    pub const READER_READ: usize = 28;
    /// u64 flags (0).
    pub const FLAGS: usize = 32;
    /// u64 events the writer committed (its control block's `entries`).
    pub const ENTRIES: usize = 40;
    /// u64 events overwritten before anyone read them (`overrun`).
    pub const OVERRUN: usize = 48;
    /// u64 events handed to the consumer in swapped-out reader pages.
    pub const READ: usize = 56;
    /// u64 events lost in total on the consumer's side (the sum of every `lost_events`).
    pub const PAGES_LOST: usize = 64;
    /// u64 pages the writer has moved onto (`pages_touched`).
    pub const PAGES_TOUCHED: usize = 72;
    /// Bytes of the struct.
    pub const STRUCT_LEN: usize = 80;
    /// u64 sequence count of the updates (hyptrace's, after Linux's struct: odd while
    /// an update is under way; a reader retries until it reads the same even count
    /// before and after the fields).
    pub const SEQ: usize = 80;
    /// Size of one meta page.
    pub const PAGE_SIZE: usize = 4096;
}

/// Per-CPU descriptor field offsets (from the descriptor start).
pub mod cpu_desc {
    /// u32 CPU number.
    pub const CPU: usize = 0;
    /// u32 pages of this CPU (ring pages + the reader page).
    pub const NR_PAGES: usize = 4;
    /// u32 global id of this CPU's first page.
    pub const FIRST_PAGE: usize = 8;
    /// u32 global id of the initial reader page.
    pub const READER_PAGE: usize = 12;
    /// u64 offset of this CPU's control block.
    pub const CTL_OFF: usize = 16;
    /// u64 offset of a `trace_buffer_meta` page for external consumers (0: none; reserved).
    pub const META_OFF: usize = 24;
    // 32..64 reserved, zero.
}

/// Control block field offsets (from the control block start). Every field is a u64
/// accessed atomically.
///
/// Writer-owned (only the writer stores them; others load): `TAIL_PAGE`,
/// `ENTRIES`, `OVERRUN`, `DROPPED`, `PAGES_TOUCHED`, `BYTES`, `WRITE_STAMP`,
/// `ATTEMPTED`, `SKIPPED`, `LOST_PENDING`, `MBOX_ACK`, `WRITER_STATE`.
/// Swap-owned (stored by `swap_reader_page`, wherever it runs): `READER_PAGE`, `SWAPS`.
/// Host-owned (the guest only loads them): `ENABLE`, `MBOX_REQ`, `RELEASED`.
///
/// The fields are grouped by **who stores them how often**, one group per 64-byte cache
/// line (PACK_VERSION 3; docs/design.md "Control-block cache lines"), so that a swap,
/// which runs on the reader's core up to once per page, never takes away the line the
/// writer stores on every event:
///
/// ```text
///   0..64    magic, version; writer, once per page or rarer: tail_page, overrun,
///            dropped, pages_touched, lost_pending, writer_state   (the swap loads)
///  64..128   writer, every event: entries, bytes, write_stamp,
///            attempted, skipped                                   (others load rarely)
/// 128..192   host: enable, mbox_req, released                      (the writer loads)
/// 192..256   the swap: reader_page, swaps; writer: mbox_ack        (host and swap)
/// ```
pub mod ctl {
    /// u64 [`super::CTL_MAGIC`].
    pub const MAGIC: usize = 0;
    /// u64: low 32 bits version, high 32 bits size ([`super::CTL_SIZE`]).
    pub const VERSION_SIZE: usize = 8;
    /// Global id of the page the writer writes (tail = commit page here: one writer,
    /// no nesting).
    pub const TAIL_PAGE: usize = 16;
    /// Events lost because the writer overwrote unread pages (overwrite mode).
    pub const OVERRUN: usize = 24;
    /// Events dropped because the ring was full (stop mode).
    pub const DROPPED: usize = 32;
    /// Pages the writer moved onto.
    pub const PAGES_TOUCHED: usize = 40;
    /// Stop mode: drops not yet marked on a page.
    pub const LOST_PENDING: usize = 48;
    /// Writer state ([`super::WRITER_IDLE`], ...).
    pub const WRITER_STATE: usize = 56;
    /// Events committed in total (stored after every event: its own cache line).
    pub const ENTRIES: usize = 64;
    /// Bytes of event data committed (headers, TIME_EXTENDs and padded payloads).
    pub const BYTES: usize = 72;
    /// Timestamp of the last committed event.
    pub const WRITE_STAMP: usize = 80;
    /// Events attempted: every write call, enabled or not, stored (Relaxed) before the
    /// event is written or skipped (invariant R3, docs/design.md "Published attempts").
    /// Added in PACK_VERSION 5.
    pub const ATTEMPTED: usize = 88;
    /// Of those, events skipped because their enable bit was clear (or the host rejected
    /// them): stored with Release after `ATTEMPTED`, so a reader that loads it with
    /// Acquire and then `ATTEMPTED` never sees `skipped > attempted` from an honest
    /// writer (R3). Added in PACK_VERSION 5.
    pub const SKIPPED: usize = 96;
    // 104..128 reserved (writer-owned).
    /// Host → guest (separate cache line): enable bits of the registered events
    /// (bit n = slot n, [`crate::registry::EventEntry::slot`]). The host flips them
    /// atomically (fetch_or / fetch_and: other bits stay); the writer loads them once per
    /// event.
    pub const ENABLE: usize = 128;
    /// Host → guest: mailbox request, `seq << 8 | op` (`MBOX_OP_*`); seq starts at 1.
    pub const MBOX_REQ: usize = 136;
    // 144: reserved (the hand-off's `mbox_arg` up to PACK_VERSION 3).
    /// Host → guest, stop mode: the `page_seq` of the last page the host has read in
    /// place, ring order (0: none; only grows). The writer may run a swap by itself
    /// when its tail meets the head page and that page's `page_seq` is at most this
    /// value: the page becomes the reader page and the reader page (also read) goes
    /// back into the ring (docs/design.md, "Released pages"). Added in PACK_VERSION 4.
    pub const RELEASED: usize = 152;
    // 160..192 reserved (host-owned).
    /// Global id of the current reader page.
    pub const READER_PAGE: usize = 192;
    /// Successful reader-page swaps.
    pub const SWAPS: usize = 200;
    /// Guest → host: acknowledgement of the last mailbox request,
    /// `seq << 8 | status`.
    pub const MBOX_ACK: usize = 208;
    // 216..256 reserved.
}

/// Writer state: not attached yet.
pub const WRITER_IDLE: u64 = 0;
/// Writer state: attached and writing.
pub const WRITER_ACTIVE: u64 = 1;
/// Writer state: the writer will not write any more (clean end).
pub const WRITER_FINISHED: u64 = 2;

/// Mailbox op: swap the reader page.
pub const MBOX_OP_SWAP: u64 = 1;
/// Mailbox op: update the reader page footer's stats.
pub const MBOX_OP_UPDATE_FOOTERS: u64 = 2;
// Mailbox op 3 (the swap hand-off of PACK_VERSION 3) is retired: released pages
// ([`ctl::RELEASED`]) replaced it; a writer answers it `MBOX_STATUS_ERROR`.
/// Mailbox status: done.
pub const MBOX_STATUS_OK: u64 = 0;
/// Mailbox status: nothing to swap (the writer is on the reader page).
pub const MBOX_STATUS_BUSY: u64 = 1;
/// Mailbox status: the operation failed (corrupt ring, bad op).
pub const MBOX_STATUS_ERROR: u64 = 2;
/// Mailbox status: the swap lost every attempt to the writer moving the head; nothing
/// changed, ask again (added in ABI 1.1; a 1.0 writer answered `MBOX_STATUS_ERROR`).
pub const MBOX_STATUS_CONTENDED: u64 = 3;

/// Footer field offsets (from the footer start, `page_size - FOOTER_SIZE` into the page).
///
/// ```text
///  0 writer_status  FT_HEAD | FT_COMMIT           (atomic RMW only: writer and swap)
///  8 reader_status  FT_READER                     (swap only)
/// 16 entries        } stats, refreshed in the reader page's footer by
/// 24 pages_touched  } update_footers (ring_buffer_ext's footer.stats) and
/// 32 overrun        } by the swap (overrun at swap time)
/// 40 dropped        }
/// 48 next           link: next page id << 2 | LINK_HEAD | LINK_UPDATE
/// 56 first_index    index of this page's first event (events before it,
///                   written or dropped, on this CPU)
/// 64 page_seq       pages_touched value when the writer moved onto it (1-based;
///                   0 = never written): ring order for a post-mortem walk
/// 72 missed         stop mode: events dropped right before this page
/// 80 page_entries   events on this page (final once the writer left it)
/// 88 id_magic       low 32: global page id; high 32: FOOTER_MAGIC
/// ```
pub mod footer {
    /// Writer status bits (`FT_HEAD`, `FT_COMMIT`).
    pub const WRITER_STATUS: usize = 0;
    /// Reader status bits (`FT_READER`).
    pub const READER_STATUS: usize = 8;
    /// Stats: events committed.
    pub const ENTRIES: usize = 16;
    /// Stats: pages touched.
    pub const PAGES_TOUCHED: usize = 24;
    /// Stats: events overwritten.
    pub const OVERRUN: usize = 32;
    /// Stats: events dropped (stop mode).
    pub const DROPPED: usize = 40;
    /// Link to the next page.
    pub const NEXT: usize = 48;
    /// Index of the page's first event.
    pub const FIRST_INDEX: usize = 56;
    /// Page sequence number.
    pub const PAGE_SEQ: usize = 64;
    /// Events dropped right before this page.
    pub const MISSED: usize = 72;
    /// Events on this page.
    pub const PAGE_ENTRIES: usize = 80;
    /// Page id (low 32) and [`super::FOOTER_MAGIC`] (high 32).
    pub const ID_MAGIC: usize = 88;
}

/// writer_status: this page is the head (the next page the reader swaps out).
pub const FT_HEAD: u64 = 1 << 0;
/// reader_status: this page is the reader page.
pub const FT_READER: u64 = 1 << 1;
/// writer_status: this page is the commit (tail) page.
pub const FT_COMMIT: u64 = 1 << 2;

/// Link flag: the page this link points to is the head.
pub const LINK_HEAD: u64 = 1;
/// Link flag: the writer is moving the head past the page this link points to.
pub const LINK_UPDATE: u64 = 2;
/// Mask of the link flags.
pub const LINK_FLAGS: u64 = 3;

/// Builds a link word.
pub const fn link(page_id: u32, flags: u64) -> u64 {
    ((page_id as u64) << 2) | (flags & LINK_FLAGS)
}

/// Page id a link word points to (its upper bits beyond 32 must be zero: see
/// [`link_target`]).
pub const fn link_id(link: u64) -> u64 {
    link >> 2
}

/// Page id of a link if it fits 32 bits.
pub fn link_target(link: u64) -> Option<u32> {
    u32::try_from(link >> 2).ok()
}

/// Ring mode of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Flight recorder: the writer overwrites the oldest unread page, counting `overrun`.
    Overwrite,
    /// The writer drops new events while the ring is full, counting `dropped`.
    Stop,
}

/// Why a pack or layout is not acceptable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// Page size not a power of two in `MIN_PAGE_SIZE..=MAX_PAGE_SIZE`.
    BadPageSize(u64),
    /// CPU count 0 or over `MAX_CPUS`.
    BadCpuCount(u64),
    /// Pages per CPU under `MIN_PAGES_PER_CPU` or over `MAX_PAGES_PER_CPU`.
    BadPageCount(u64),
    /// The layout does not fit the region (or overflows).
    TooSmall {
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// Wrong magic in the pack, a control block or a footer.
    BadMagic,
    /// Unsupported version or structure size.
    BadVersion(u32),
    /// Unknown flag bits.
    BadFlags(u32),
    /// A descriptor is inconsistent (CPU number, page range, offsets).
    BadDescriptor(u32),
    /// The event registration table's size (or offset) is not one this layout allows.
    BadEventTable(u64),
}

impl core::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::BadPageSize(s) => write!(
                f,
                "page size {s} is not a power of two between {MIN_PAGE_SIZE} and {MAX_PAGE_SIZE}"
            ),
            Self::BadCpuCount(n) => write!(f, "CPU count {n} is not in 1..={MAX_CPUS}"),
            Self::BadPageCount(n) => write!(
                f,
                "{n} pages per CPU is not in {MIN_PAGES_PER_CPU}..={MAX_PAGES_PER_CPU}"
            ),
            Self::TooSmall { needed, available } => write!(
                f,
                "trace region needs {needed} bytes, {available} available"
            ),
            Self::BadMagic => write!(f, "bad magic"),
            Self::BadVersion(v) => write!(f, "unsupported version or size {v}"),
            Self::BadFlags(x) => write!(f, "unknown flags {x:#x}"),
            Self::BadDescriptor(c) => write!(f, "inconsistent descriptor for CPU {c}"),
            Self::BadEventTable(v) => write!(
                f,
                "event registration table size or offset {v} is not a multiple of 64 in 64..={}",
                crate::registry::MAX_TABLE_SIZE
            ),
        }
    }
}

/// Where everything is in a trace region: computed by the host when it allocates,
/// parsed (and validated) from the pack by the guest and by post-mortem readers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingGeometry {
    /// Number of CPUs.
    pub nr_cpus: u32,
    /// Page size.
    pub page_size: usize,
    /// Pages per CPU (ring + reader). All CPUs have the same count.
    pub pages_per_cpu: u32,
    /// Mode of every CPU's ring.
    pub mode: Mode,
    /// Whether the guest runs swap/update on the host's mailbox requests.
    pub guest_swap: bool,
    /// Offset of the CPU descriptors.
    pub cpu_descs_off: usize,
    /// Offset of the first control block (CPU c's is at `ctl_off + c * CTL_SIZE`).
    pub ctl_off: usize,
    /// Offset of the event registration table (0: none).
    pub events_off: usize,
    /// Size of the event registration table (0: none).
    pub events_size: usize,
    /// Offset of page 0.
    pub pages_off: usize,
    /// Total size of the region.
    pub region_size: usize,
}

const fn align_up(v: usize, a: usize) -> usize {
    (v + a - 1) & !(a - 1)
}

impl RingGeometry {
    /// Computes the layout for `nr_cpus` CPUs with `pages_per_cpu` pages (reader page
    /// included) of `page_size` bytes, without an event registration table (see
    /// [`RingGeometry::with_events`]).
    ///
    /// ```
    /// use hyptrace_abi::{registry::DEFAULT_TABLE_SIZE, Mode, RingGeometry};
    /// let l = RingGeometry::new(4, 16, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// assert_eq!((l.nr_cpus, l.pages_per_cpu, l.page_size), (4, 16, 4096));
    /// assert!(l.region_size >= 4 * 16 * 4096); // what the VMM reserves in guest memory
    /// assert!(RingGeometry::new(1, 2, 4096, Mode::Stop, false).is_err()); // < 3 pages
    /// # Ok::<(), hyptrace_abi::LayoutError>(())
    /// ```
    pub fn new(
        nr_cpus: u32,
        pages_per_cpu: u32,
        page_size: usize,
        mode: Mode,
        guest_swap: bool,
    ) -> Result<Self, LayoutError> {
        Self::with_table(nr_cpus, pages_per_cpu, page_size, mode, guest_swap, 0)
    }

    /// The same layout with an event registration table of `size` bytes (0: none; else a
    /// multiple of 64 in `registry::HEADER_SIZE..=registry::MAX_TABLE_SIZE`) between the
    /// control blocks and page 0.
    pub fn with_events(self, size: usize) -> Result<Self, LayoutError> {
        Self::with_table(
            self.nr_cpus,
            self.pages_per_cpu,
            self.page_size,
            self.mode,
            self.guest_swap,
            size,
        )
    }

    fn with_table(
        nr_cpus: u32,
        pages_per_cpu: u32,
        page_size: usize,
        mode: Mode,
        guest_swap: bool,
        events_size: usize,
    ) -> Result<Self, LayoutError> {
        if events_size != 0
            && (!events_size.is_multiple_of(64)
                || !(crate::registry::HEADER_SIZE..=crate::registry::MAX_TABLE_SIZE)
                    .contains(&events_size))
        {
            return Err(LayoutError::BadEventTable(events_size as u64));
        }
        if !page_size.is_power_of_two() || !(MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&page_size) {
            return Err(LayoutError::BadPageSize(page_size as u64));
        }
        if nr_cpus == 0 || nr_cpus as usize > MAX_CPUS {
            return Err(LayoutError::BadCpuCount(nr_cpus.into()));
        }
        let ppc = pages_per_cpu as usize;
        if !(MIN_PAGES_PER_CPU..=MAX_PAGES_PER_CPU).contains(&ppc) {
            return Err(LayoutError::BadPageCount(pages_per_cpu.into()));
        }
        let n = nr_cpus as usize;
        let cpu_descs_off = PACK_HEADER_SIZE;
        let ctl_off = align_up(cpu_descs_off + n * CPU_DESC_SIZE, 64);
        let ctl_end = ctl_off + n * CTL_SIZE;
        let events_off = if events_size == 0 { 0 } else { ctl_end };
        let pages_off = align_up(ctl_end + events_size, page_size);
        let total = (n as u64) * (ppc as u64) * (page_size as u64);
        let region = (pages_off as u64)
            .checked_add(total)
            .filter(|&r| r <= usize::MAX as u64 / 2);
        let region_size = match region {
            Some(r) => r as usize,
            None => {
                return Err(LayoutError::TooSmall {
                    needed: u64::MAX,
                    available: usize::MAX as u64,
                })
            }
        };
        Ok(Self {
            nr_cpus,
            page_size,
            pages_per_cpu,
            mode,
            guest_swap,
            cpu_descs_off,
            ctl_off,
            events_off,
            events_size,
            pages_off,
            region_size,
        })
    }

    /// Pages per CPU needed for at least `bytes` of ring (reader page not counted), at
    /// least [`MIN_PAGES_PER_CPU`] in all: like trace-cmd's `-b`, rounded up to whole pages.
    pub fn pages_for_bytes(bytes: u64, page_size: usize) -> u64 {
        let ring = bytes
            .div_ceil(page_size as u64)
            .max(MIN_PAGES_PER_CPU as u64 - 1);
        ring + 1
    }

    /// Usable data bytes of a page (after the header, before the footer).
    pub const fn data_capacity(&self) -> usize {
        self.page_size - PAGE_HEADER_SIZE - FOOTER_SIZE
    }

    /// Largest payload an event can carry (it must fit an empty page in the long form).
    pub const fn max_payload(&self) -> usize {
        self.data_capacity() - 8
    }

    /// Total number of pages.
    pub const fn total_pages(&self) -> u64 {
        self.nr_cpus as u64 * self.pages_per_cpu as u64
    }

    /// Global id of CPU `cpu`'s first page.
    pub const fn first_page(&self, cpu: u32) -> u32 {
        cpu * self.pages_per_cpu
    }

    /// Whether global page `id` belongs to CPU `cpu`.
    pub const fn owns(&self, cpu: u32, id: u64) -> bool {
        let first = self.first_page(cpu) as u64;
        id >= first && id < first + self.pages_per_cpu as u64
    }

    /// Offset of page `id` (caller validated the id).
    pub const fn page_off(&self, id: u32) -> usize {
        self.pages_off + id as usize * self.page_size
    }

    /// Offset of page `id`'s footer.
    pub const fn footer_off(&self, id: u32) -> usize {
        self.page_off(id) + self.page_size - FOOTER_SIZE
    }

    /// Offset of CPU `cpu`'s control block.
    pub const fn ctl(&self, cpu: u32) -> usize {
        self.ctl_off + cpu as usize * CTL_SIZE
    }

    /// Offset of CPU `cpu`'s descriptor.
    pub const fn desc(&self, cpu: u32) -> usize {
        self.cpu_descs_off + cpu as usize * CPU_DESC_SIZE
    }

    /// Pack flags of this layout.
    pub const fn flags(&self) -> u32 {
        let mut f = 0;
        if matches!(self.mode, Mode::Overwrite) {
            f |= PACK_FLAG_OVERWRITE;
        }
        if self.guest_swap {
            f |= PACK_FLAG_GUEST_SWAP;
        }
        f
    }

    /// Writes the pack header and CPU descriptors (not the control blocks or pages).
    pub fn write_pack<M: SharedMem + ?Sized>(&self, mem: &M, tsc_khz: u64, generation: u64) {
        // The header is written with atomic word stores: the guest reads it the same way.
        let w = |off: usize, v: u64| mem.store(off, v, Relaxed);
        w(pack::MAGIC, PACK_MAGIC);
        w(
            pack::VERSION,
            u64::from(PACK_VERSION) | ((PACK_HEADER_SIZE as u64) << 32),
        );
        w(
            pack::NR_CPUS,
            u64::from(self.nr_cpus) | ((self.page_size as u64) << 32),
        );
        w(
            pack::CPU_DESC_SIZE,
            CPU_DESC_SIZE as u64 | (u64::from(self.flags()) << 32),
        );
        w(pack::REGION_SIZE, self.region_size as u64);
        w(pack::CPU_DESCS_OFF, self.cpu_descs_off as u64);
        w(pack::PAGES_OFF, self.pages_off as u64);
        w(pack::TOTAL_PAGES, self.total_pages());
        w(pack::EVENTS_OFF, self.events_off as u64);
        w(pack::EVENTS_SIZE, self.events_size as u64);
        w(pack::TSC_KHZ, tsc_khz);
        w(pack::GENERATION, generation);
        for off in (96..PACK_HEADER_SIZE).step_by(8) {
            w(off, 0);
        }
        for cpu in 0..self.nr_cpus {
            let d = self.desc(cpu);
            let first = self.first_page(cpu);
            w(
                d + cpu_desc::CPU,
                u64::from(cpu) | (u64::from(self.pages_per_cpu) << 32),
            );
            w(
                d + cpu_desc::FIRST_PAGE,
                u64::from(first) | (u64::from(first) << 32),
            );
            w(d + cpu_desc::CTL_OFF, self.ctl(cpu) as u64);
            w(d + cpu_desc::META_OFF, 0);
            for off in (32..CPU_DESC_SIZE).step_by(8) {
                w(d + off, 0);
            }
        }
    }

    /// Parses and validates the pack at the start of `mem` (hostile input: every field
    /// is checked against the region and against the layout this crate computes).
    ///
    /// ```
    /// use hyptrace_abi::{Mode, RawMem, RingGeometry};
    /// let l = RingGeometry::new(1, 4, 4096, Mode::Overwrite, false)?;
    /// let mut words = vec![0u64; l.region_size / 8];
    /// // SAFETY: 8-aligned, valid for region_size bytes while `words` lives; only this
    /// // RawMem accesses it.
    /// let mem = unsafe { RawMem::new(words.as_mut_ptr().cast(), l.region_size) };
    /// assert!(RingGeometry::parse(&mem).is_err()); // no pack yet
    /// l.init_region(&mem, 2_600_000, 1); // the reader's alloc does this
    /// assert_eq!(RingGeometry::parse(&mem)?, l);
    /// # Ok::<(), hyptrace_abi::LayoutError>(())
    /// ```
    pub fn parse<M: SharedMem + ?Sized>(mem: &M) -> Result<Self, LayoutError> {
        if mem.size() < PACK_HEADER_SIZE {
            return Err(LayoutError::TooSmall {
                needed: PACK_HEADER_SIZE as u64,
                available: mem.size() as u64,
            });
        }
        let r = |off: usize| mem.load(off, Relaxed);
        if r(pack::MAGIC) != PACK_MAGIC {
            return Err(LayoutError::BadMagic);
        }
        let vs = r(pack::VERSION);
        if vs as u32 != PACK_VERSION || (vs >> 32) as usize != PACK_HEADER_SIZE {
            return Err(LayoutError::BadVersion(vs as u32));
        }
        let np = r(pack::NR_CPUS);
        let nr_cpus = np as u32;
        let page_size = (np >> 32) as usize;
        let df = r(pack::CPU_DESC_SIZE);
        if df as u32 as usize != CPU_DESC_SIZE {
            return Err(LayoutError::BadVersion(df as u32));
        }
        let flags = (df >> 32) as u32;
        if flags & !PACK_FLAGS_KNOWN != 0 {
            return Err(LayoutError::BadFlags(flags));
        }
        if nr_cpus == 0 || nr_cpus as usize > MAX_CPUS {
            return Err(LayoutError::BadCpuCount(nr_cpus.into()));
        }
        if mem.size() < PACK_HEADER_SIZE + nr_cpus as usize * CPU_DESC_SIZE {
            return Err(LayoutError::TooSmall {
                needed: (PACK_HEADER_SIZE + nr_cpus as usize * CPU_DESC_SIZE) as u64,
                available: mem.size() as u64,
            });
        }
        let d0 = PACK_HEADER_SIZE;
        let pages_per_cpu = (r(d0 + cpu_desc::CPU) >> 32) as u32;
        let mode = if flags & PACK_FLAG_OVERWRITE != 0 {
            Mode::Overwrite
        } else {
            Mode::Stop
        };
        let events_size = r(pack::EVENTS_SIZE);
        if events_size > crate::registry::MAX_TABLE_SIZE as u64 {
            return Err(LayoutError::BadEventTable(events_size));
        }
        let l = Self::with_table(
            nr_cpus,
            pages_per_cpu,
            page_size,
            mode,
            flags & PACK_FLAG_GUEST_SWAP != 0,
            events_size as usize,
        )?;
        if r(pack::EVENTS_OFF) != l.events_off as u64 {
            return Err(LayoutError::BadEventTable(r(pack::EVENTS_OFF)));
        }
        if r(pack::REGION_SIZE) != l.region_size as u64
            || r(pack::CPU_DESCS_OFF) != l.cpu_descs_off as u64
            || r(pack::PAGES_OFF) != l.pages_off as u64
            || r(pack::TOTAL_PAGES) != l.total_pages()
        {
            return Err(LayoutError::BadDescriptor(u32::MAX));
        }
        if (mem.size() as u64) < l.region_size as u64 {
            return Err(LayoutError::TooSmall {
                needed: l.region_size as u64,
                available: mem.size() as u64,
            });
        }
        for cpu in 0..nr_cpus {
            let d = l.desc(cpu);
            let first = l.first_page(cpu);
            let fr = r(d + cpu_desc::FIRST_PAGE);
            let reader = (fr >> 32) as u32;
            if r(d + cpu_desc::CPU) != u64::from(cpu) | (u64::from(pages_per_cpu) << 32)
                || fr as u32 != first
                || !l.owns(cpu, reader.into())
                || r(d + cpu_desc::CTL_OFF) != l.ctl(cpu) as u64
            {
                return Err(LayoutError::BadDescriptor(cpu));
            }
        }
        Ok(l)
    }

    /// Initialises CPU `cpu`'s control block and pages: reader page = first page, ring
    /// = the others linked in order, head = tail = the first ring page.
    pub fn init_cpu<M: SharedMem + ?Sized>(&self, mem: &M, cpu: u32) {
        let c = self.ctl(cpu);
        for off in (0..CTL_SIZE).step_by(8) {
            mem.store(c + off, 0, Relaxed);
        }
        let first = self.first_page(cpu);
        let n = self.pages_per_cpu;
        let reader = first;
        let head = first + 1;
        mem.store(c + ctl::MAGIC, CTL_MAGIC, Relaxed);
        mem.store(
            c + ctl::VERSION_SIZE,
            u64::from(PACK_VERSION) | ((CTL_SIZE as u64) << 32),
            Relaxed,
        );
        mem.store(c + ctl::READER_PAGE, reader.into(), Relaxed);
        mem.store(c + ctl::TAIL_PAGE, head.into(), Relaxed);
        mem.store(c + ctl::ENABLE, u64::MAX, Relaxed);
        for id in first..first + n {
            let p = self.page_off(id);
            mem.write_bytes(p, &[0u8; 8]);
            mem.store(p + crate::page::COMMIT_OFFSET, 0, Relaxed);
            let f = self.footer_off(id);
            for off in (0..FOOTER_SIZE).step_by(8) {
                mem.store(f + off, 0, Relaxed);
            }
            mem.store(
                f + footer::ID_MAGIC,
                u64::from(id) | (u64::from(FOOTER_MAGIC) << 32),
                Relaxed,
            );
            // Ring: first+1 -> first+2 -> ... -> last -> first+1. The reader page
            // points at the head, like a freshly swapped-out page.
            let next = if id == reader || id == first + n - 1 {
                head
            } else {
                id + 1
            };
            let flags = if id == first + n - 1 { LINK_HEAD } else { 0 };
            mem.store(f + footer::NEXT, link(next, flags), Relaxed);
        }
        mem.store(
            self.footer_off(reader) + footer::READER_STATUS,
            FT_READER,
            Relaxed,
        );
        mem.store(
            self.footer_off(head) + footer::WRITER_STATUS,
            FT_HEAD | FT_COMMIT,
            Relaxed,
        );
        mem.store(self.footer_off(head) + footer::PAGE_SEQ, 1, Relaxed);
        mem.store(c + ctl::PAGES_TOUCHED, 1, Relaxed);
        mem.store(
            self.desc(cpu) + cpu_desc::FIRST_PAGE,
            u64::from(first) | (u64::from(reader) << 32),
            Relaxed,
        );
    }
}

impl RingGeometry {
    /// Writes the pack and initialises every CPU's control block and pages.
    pub fn init_region<M: SharedMem + ?Sized>(&self, mem: &M, tsc_khz: u64, generation: u64) {
        self.write_pack(mem, tsc_khz, generation);
        // The registration table starts empty (STATE_EMPTY): the guest fills it.
        for off in (self.events_off..self.events_off + self.events_size).step_by(8) {
            mem.store(off, 0, Relaxed);
        }
        for cpu in 0..self.nr_cpus {
            self.init_cpu(mem, cpu);
        }
    }
}
impl core::error::Error for LayoutError {}
