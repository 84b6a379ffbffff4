//! The trace memory file (`--trace-mem PATH`) as a post-mortem reader sees it: its
//! layout, and [`parse`], which checks a file's bytes (hostile: a file can be
//! truncated, corrupted or made up) and gives the region as a [`Snapshot`] with the
//! per-CPU reader positions. The VMM side (creating and mapping the file) is
//! `hyptrace_host::trace_mem`; the layout is documented in docs/abi.md ("Trace memory
//! file").
//!
//! ```text
//! 0             header: HEADER_FIXED bytes of fields, then one POS_STRIDE record per CPU
//! header_size   the trace region, byte for byte as the guest sees it at region_gpa
//! header_size + region_size rounded up to 4 KiB: end of file
//! ```

use core::sync::atomic::Ordering::Acquire;

use hyptrace_abi::layout::{RingGeometry, MAX_CPUS};
use hyptrace_abi::SharedMem;

use crate::postmortem::{Position, Snapshot};

/// Magic of the trace memory file: `"HTMEMF01"`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"HTMEMF01");
/// Version of the file layout (2: page-exact position records, P1).
pub const VERSION: u32 = 2;
/// Bytes of fixed header fields (the positions follow at [`hdr::POS_OFF`]'s value).
pub const HEADER_FIXED: usize = 256;
/// Bytes of one CPU's reader position record.
pub const POS_STRIDE: usize = 128;
/// Alignment of the region in the file (the mapping's offset must be page-aligned).
pub const FILE_ALIGN: usize = 4096;
/// `events_abi`: the formats are rebuilt from the region — its event registration
/// table as the host answered it, else the built-in guest events.
pub const EVENTS_BUILTIN_V1: u64 = 1;

/// Header field offsets.
pub mod hdr {
    /// u64 [`super::MAGIC`].
    pub const MAGIC: usize = 0;
    /// u32 version, u32 header size (= offset of the region in the file).
    pub const VERSION_HEADER_SIZE: usize = 8;
    /// u32 ring page size, u32 number of CPUs.
    pub const PAGE_SIZE_NR_CPUS: usize = 16;
    /// u64 guest-physical address of the region.
    pub const REGION_GPA: usize = 24;
    /// u64 size of the region (the pack's `region_size`).
    pub const REGION_SIZE: usize = 32;
    /// u64 TSC frequency of the guest in kHz.
    pub const TSC_KHZ: usize = 40;
    /// u64 generation (the pack's).
    pub const GENERATION: usize = 48;
    /// u64 pid of the VMM that wrote the file.
    pub const PID: usize = 56;
    /// u64 state ([`super::STATE_RUNNING`], ...).
    pub const STATE: usize = 64;
    /// u64 event formats ([`super::EVENTS_BUILTIN_V1`]).
    pub const EVENTS_ABI: usize = 72;
    /// u64 offset of the per-CPU reader positions.
    pub const POS_OFF: usize = 80;
    /// u64 bytes per position record ([`super::POS_STRIDE`]).
    pub const POS_STRIDE: usize = 88;
    /// u64 file offset of the per-CPU meta pages (`hyptrace_abi::layout::meta`, one
    /// `meta::PAGE_SIZE` page per CPU, after the region); 0: none.
    pub const META_OFF: usize = 96;
    // 104..256 reserved, zero.
}

/// Per-CPU position record offsets (from the record start).
pub mod pos {
    /// u64: number of position updates so far; 0 = none; slot `active & 1` is newest.
    pub const ACTIVE: usize = 0;
    /// Slot 0: u64 reader page, u64 consumed data bytes, u64 expected index, u64 the
    /// reader page's `page_seq`, u64 its `first_index`, u64 printed index (P1).
    pub const SLOT0: usize = 8;
    /// Slot 1, as slot 0.
    pub const SLOT1: usize = 56;
    /// Bytes of a slot.
    pub const SLOT_LEN: usize = 48;
}

/// State: the VMM set the file up; the guest has not started.
pub const STATE_CREATED: u64 = 0;
/// State: the guest runs (or the VMM died while it did).
pub const STATE_RUNNING: u64 = 1;
/// State: the run ended and the VMM read what it read.
pub const STATE_ENDED: u64 = 2;
/// State: the guest crashed or hung.
pub const STATE_CRASHED: u64 = 3;

/// Size of the header for `nr_cpus` CPUs.
pub fn header_size(nr_cpus: u32) -> usize {
    (HEADER_FIXED + nr_cpus as usize * POS_STRIDE).next_multiple_of(FILE_ALIGN)
}

/// The guest-memory length of the region's mapping (the region rounded up to 4 KiB).
pub fn mapped_len(region_size: usize) -> usize {
    region_size.next_multiple_of(FILE_ALIGN)
}

/// Offset of the slot that update number `n` uses.
pub fn slot_off(n: u64) -> usize {
    if n & 1 == 0 {
        pos::SLOT0
    } else {
        pos::SLOT1
    }
}

/// The newest position record of `cpu` in a header (`None`: none recorded, or a
/// reader page id that does not fit). `h` must hold `pos_off + (cpu + 1) * POS_STRIDE`
/// bytes (the caller checked).
pub fn read_position<M: SharedMem + ?Sized>(h: &M, pos_off: usize, cpu: u32) -> Option<Position> {
    let base = pos_off + cpu as usize * POS_STRIDE;
    let n = h.load(base + pos::ACTIVE, Acquire);
    if n == 0 {
        return None;
    }
    let slot = base + slot_off(n);
    let reader = u32::try_from(h.load(slot, Acquire)).ok()?;
    let w = |i: usize| h.load(slot + 8 * i, Acquire);
    Some(Position {
        reader,
        consumed: w(1),
        expected: w(2),
        page_seq: w(3),
        first_index: w(4),
        printed: w(5),
    })
}

/// Largest region a file may claim (guest memory is at most 3 GiB).
pub const MAX_REGION: u64 = 4 << 30;
/// Largest header a file may claim.
pub const MAX_HEADER: usize = 1 << 20;

/// Why a file is not a trace memory file hyptrace can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    /// Shorter than the fixed header.
    #[error("too short for a trace memory header ({0} bytes)")]
    Short(usize),
    /// Wrong magic.
    #[error("not a hyptrace trace memory file (bad magic)")]
    Magic,
    /// Unknown version.
    #[error("unsupported trace memory file version {0}")]
    Version(u32),
    /// A header field is out of range.
    #[error("bad header: {0}")]
    Header(String),
    /// The pack at the start of the region does not parse.
    #[error("trace region")]
    Pack(#[source] hyptrace_abi::layout::LayoutError),
}

/// A parsed trace memory file.
#[derive(Debug)]
pub struct FileImage<'a> {
    /// The region (its pack parsed into `layout`).
    pub region: Snapshot<'a>,
    /// The ring layout, from the pack.
    pub layout: RingGeometry,
    /// Each CPU's reader position, if one was recorded and usable.
    pub positions: Vec<Option<Position>>,
    /// Guest TSC frequency (header, else the pack; 0: unknown).
    pub tsc_khz: u64,
    /// `STATE_*` word as the VMM left it.
    pub state: u64,
    /// Pid of the VMM that wrote it.
    pub pid: u64,
    /// Guest-physical address of the region.
    pub gpa: u64,
    /// What is wrong but not fatal (truncated region, unusable positions, ...).
    pub warnings: Vec<String>,
}

impl FileImage<'_> {
    /// What the state word says, for messages.
    pub fn state_name(&self) -> &'static str {
        match self.state {
            STATE_CREATED => "created (the guest never started)",
            STATE_RUNNING => "running (the VMM died or still runs)",
            STATE_ENDED => "ended",
            STATE_CRASHED => "crashed",
            _ => "unknown",
        }
    }
}

fn word(b: &[u8], off: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(s) = b.get(off..off + 8) {
        w.copy_from_slice(s);
    }
    u64::from_le_bytes(w)
}

/// The fixed header's checks (magic, version, header size, region size): the header
/// length and the region size.
fn check_fixed(bytes: &[u8]) -> Result<(usize, usize), FileError> {
    if bytes.len() < HEADER_FIXED {
        return Err(FileError::Short(bytes.len()));
    }
    if word(bytes, hdr::MAGIC) != MAGIC {
        return Err(FileError::Magic);
    }
    let vh = word(bytes, hdr::VERSION_HEADER_SIZE);
    if vh as u32 != VERSION {
        return Err(FileError::Version(vh as u32));
    }
    let header_len = (vh >> 32) as usize;
    if !(HEADER_FIXED..=MAX_HEADER).contains(&header_len) || !header_len.is_multiple_of(FILE_ALIGN)
    {
        return Err(FileError::Header(format!("header size {header_len}")));
    }
    let region_size = word(bytes, hdr::REGION_SIZE);
    if region_size > MAX_REGION {
        return Err(FileError::Header(format!("region size {region_size}")));
    }
    Ok((header_len, region_size as usize))
}

/// The length of the file its fixed header (`head`, hostile) declares: the header, the
/// region rounded up to [`FILE_ALIGN`], and the meta pages when [`hdr::META_OFF`] puts
/// them right after the region (as the VMM does; another offset is not counted: nothing
/// a post-mortem reader does needs them). The checks are [`parse`]'s.
pub fn declared_len(head: &[u8]) -> Result<u64, FileError> {
    let (header_len, region_size) = check_fixed(head)?;
    let end = (header_len + mapped_len(region_size)) as u64;
    let nr_cpus = word(head, hdr::PAGE_SIZE_NR_CPUS) >> 32;
    let meta_ok = word(head, hdr::META_OFF) == end && (1..=MAX_CPUS as u64).contains(&nr_cpus);
    Ok(if meta_ok {
        end + nr_cpus * hyptrace_abi::layout::meta::PAGE_SIZE as u64
    } else {
        end
    })
}

/// Checks the bytes of a trace memory file (all of them hostile) and returns the
/// region as a snapshot with its layout and positions. A region shorter than the
/// header says (a truncated file) reads as zeros past the end, with a warning; the
/// pack and descriptors must be present and valid.
pub fn parse(bytes: &[u8]) -> Result<FileImage<'_>, FileError> {
    let (header_len, region_size) = check_fixed(bytes)?;
    let Some(held) = bytes.get(header_len..) else {
        return Err(FileError::Header(format!(
            "header size {header_len} past the end of the file ({} bytes)",
            bytes.len()
        )));
    };
    let mut warnings = Vec::new();
    let held = &held[..held.len().min(region_size)];
    if held.len() < region_size {
        warnings.push(format!(
            "the file is truncated: {} of the region's {region_size} bytes are there; the rest reads as zeros",
            held.len()
        ));
    }
    let region = Snapshot::new(held, region_size);
    let layout = RingGeometry::parse(&region).map_err(FileError::Pack)?;
    let pn = word(bytes, hdr::PAGE_SIZE_NR_CPUS);
    let (page_size, nr_cpus) = (pn as u32 as usize, (pn >> 32) as u32);
    if page_size != layout.page_size || nr_cpus != layout.nr_cpus {
        warnings.push(format!(
            "the header says {nr_cpus} CPUs of {page_size}-byte pages, the pack {} of {}: the pack is used",
            layout.nr_cpus, layout.page_size
        ));
    }
    let pos_off = word(bytes, hdr::POS_OFF);
    let stride = word(bytes, hdr::POS_STRIDE);
    let nr = layout.nr_cpus as usize;
    let positions_fit = pos_off == HEADER_FIXED as u64
        && stride == POS_STRIDE as u64
        && nr <= MAX_CPUS
        && HEADER_FIXED + nr * POS_STRIDE <= header_len;
    let positions = if positions_fit {
        let h = Snapshot::new(&bytes[..header_len], header_len);
        (0..layout.nr_cpus)
            .map(|c| read_position(&h, HEADER_FIXED, c))
            .collect()
    } else {
        warnings.push(
            "the reader positions are unusable: every CPU is read from the start of its reader page"
                .into(),
        );
        vec![None; nr]
    };
    let mut tsc_khz = word(bytes, hdr::TSC_KHZ);
    if tsc_khz == 0 {
        tsc_khz = region.load(hyptrace_abi::layout::pack::TSC_KHZ, Acquire);
    }
    Ok(FileImage {
        layout,
        positions,
        tsc_khz,
        state: word(bytes, hdr::STATE),
        pid: word(bytes, hdr::PID),
        gpa: word(bytes, hdr::REGION_GPA),
        warnings,
        region,
    })
}
