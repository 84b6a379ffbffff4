//! The shared structures as `#[repr(C)]` types (zerocopy), for tools that read a copy of
//! the trace region as bytes (a dump, a file-backed region) and for documentation. The
//! live protocol accesses the same fields as atomic words at the offsets of
//! [`crate::layout`]; the assertions below keep both descriptions identical at compile
//! time. Little-endian (x86_64) hosts and guests only.

use crate::layout::{
    cpu_desc, ctl, footer, pack, CPU_DESC_SIZE, CTL_SIZE, FOOTER_SIZE, PACK_HEADER_SIZE,
};
use crate::page::{COMMIT_OFFSET, PAGE_HEADER_SIZE, TIME_STAMP_OFFSET};
use core::mem::{offset_of, size_of};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The pack header at the start of the trace region.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct PackHeader {
    /// `PACK_MAGIC`.
    pub magic: u64,
    /// `PACK_VERSION`.
    pub version: u32,
    /// `PACK_HEADER_SIZE`.
    pub header_size: u32,
    /// Number of CPUs.
    pub nr_cpus: u32,
    /// Page size.
    pub page_size: u32,
    /// `CPU_DESC_SIZE`.
    pub cpu_desc_size: u32,
    /// `PACK_FLAG_*`.
    pub flags: u32,
    /// Region size.
    pub region_size: u64,
    /// Offset of the CPU descriptors.
    pub cpu_descs_off: u64,
    /// Offset of page 0.
    pub pages_off: u64,
    /// Total pages.
    pub total_pages: u64,
    /// Event registration table offset (reserved).
    pub events_off: u64,
    /// Event registration table size (reserved).
    pub events_size: u64,
    /// TSC kHz.
    pub tsc_khz: u64,
    /// Generation.
    pub generation: u64,
    /// Reserved, zero.
    pub reserved: [u64; 4],
}

/// A per-CPU descriptor.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct CpuDesc {
    /// CPU number.
    pub cpu: u32,
    /// Pages of this CPU.
    pub nr_pages: u32,
    /// First global page id.
    pub first_page: u32,
    /// Initial reader page.
    pub reader_page: u32,
    /// Control block offset.
    pub ctl_off: u64,
    /// `trace_buffer_meta` page offset (reserved).
    pub meta_off: u64,
    /// Reserved, zero.
    pub reserved: [u64; 4],
}

/// A per-CPU control block.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct CtlBlock {
    /// `CTL_MAGIC`.
    pub magic: u64,
    /// Version (low 32 bits) and size (high 32 bits).
    pub version_size: u64,
    /// Reader page id.
    pub reader_page: u64,
    /// Tail page id.
    pub tail_page: u64,
    /// Events committed.
    pub entries: u64,
    /// Events overwritten.
    pub overrun: u64,
    /// Events dropped.
    pub dropped: u64,
    /// Pages touched.
    pub pages_touched: u64,
    /// Bytes committed.
    pub bytes: u64,
    /// Last event time.
    pub write_stamp: u64,
    /// Drops not yet marked on a page.
    pub lost_pending: u64,
    /// Swaps done.
    pub swaps: u64,
    /// Writer state.
    pub writer_state: u64,
    /// Mailbox acknowledgement.
    pub mbox_ack: u64,
    /// Reserved (writer-owned).
    pub reserved0: [u64; 2],
    /// Enable bits.
    pub enable: u64,
    /// Mailbox request.
    pub mbox_req: u64,
    /// Reserved.
    pub reserved1: [u64; 14],
}

/// The footer at the end of every page.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct Footer {
    /// `FT_HEAD | FT_COMMIT`.
    pub writer_status: u64,
    /// `FT_READER`.
    pub reader_status: u64,
    /// Stats: entries.
    pub entries: u64,
    /// Stats: pages touched.
    pub pages_touched: u64,
    /// Stats: overrun.
    pub overrun: u64,
    /// Stats: dropped.
    pub dropped: u64,
    /// Link to the next page.
    pub next: u64,
    /// Index of the first event.
    pub first_index: u64,
    /// Page sequence number.
    pub page_seq: u64,
    /// Drops right before this page.
    pub missed: u64,
    /// Events on the page.
    pub page_entries: u64,
    /// Page id (low 32) and `FOOTER_MAGIC` (high 32).
    pub id_magic: u64,
}

/// The Linux `buffer_data_page` header.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct DataPageHeader {
    /// Time of the first event.
    pub time_stamp: u64,
    /// Committed bytes and `RB_MISSED_*` flags.
    pub commit: u64,
}

macro_rules! same_offset {
    ($t:ty, $f:ident, $c:expr) => {
        const _: () = assert!(offset_of!($t, $f) == $c);
    };
}

const _: () = assert!(size_of::<PackHeader>() == PACK_HEADER_SIZE);
const _: () = assert!(size_of::<CpuDesc>() == CPU_DESC_SIZE);
const _: () = assert!(size_of::<CtlBlock>() == CTL_SIZE);
const _: () = assert!(size_of::<Footer>() == FOOTER_SIZE);
const _: () = assert!(size_of::<DataPageHeader>() == PAGE_HEADER_SIZE);
same_offset!(PackHeader, magic, pack::MAGIC);
same_offset!(PackHeader, version, pack::VERSION);
same_offset!(PackHeader, header_size, pack::HEADER_SIZE);
same_offset!(PackHeader, nr_cpus, pack::NR_CPUS);
same_offset!(PackHeader, page_size, pack::PAGE_SIZE);
same_offset!(PackHeader, cpu_desc_size, pack::CPU_DESC_SIZE);
same_offset!(PackHeader, flags, pack::FLAGS);
same_offset!(PackHeader, region_size, pack::REGION_SIZE);
same_offset!(PackHeader, cpu_descs_off, pack::CPU_DESCS_OFF);
same_offset!(PackHeader, pages_off, pack::PAGES_OFF);
same_offset!(PackHeader, total_pages, pack::TOTAL_PAGES);
same_offset!(PackHeader, events_off, pack::EVENTS_OFF);
same_offset!(PackHeader, events_size, pack::EVENTS_SIZE);
same_offset!(PackHeader, tsc_khz, pack::TSC_KHZ);
same_offset!(PackHeader, generation, pack::GENERATION);
same_offset!(CpuDesc, cpu, cpu_desc::CPU);
same_offset!(CpuDesc, nr_pages, cpu_desc::NR_PAGES);
same_offset!(CpuDesc, first_page, cpu_desc::FIRST_PAGE);
same_offset!(CpuDesc, reader_page, cpu_desc::READER_PAGE);
same_offset!(CpuDesc, ctl_off, cpu_desc::CTL_OFF);
same_offset!(CpuDesc, meta_off, cpu_desc::META_OFF);
same_offset!(CtlBlock, magic, ctl::MAGIC);
same_offset!(CtlBlock, version_size, ctl::VERSION_SIZE);
same_offset!(CtlBlock, reader_page, ctl::READER_PAGE);
same_offset!(CtlBlock, tail_page, ctl::TAIL_PAGE);
same_offset!(CtlBlock, entries, ctl::ENTRIES);
same_offset!(CtlBlock, overrun, ctl::OVERRUN);
same_offset!(CtlBlock, dropped, ctl::DROPPED);
same_offset!(CtlBlock, pages_touched, ctl::PAGES_TOUCHED);
same_offset!(CtlBlock, bytes, ctl::BYTES);
same_offset!(CtlBlock, write_stamp, ctl::WRITE_STAMP);
same_offset!(CtlBlock, lost_pending, ctl::LOST_PENDING);
same_offset!(CtlBlock, swaps, ctl::SWAPS);
same_offset!(CtlBlock, writer_state, ctl::WRITER_STATE);
same_offset!(CtlBlock, mbox_ack, ctl::MBOX_ACK);
same_offset!(CtlBlock, enable, ctl::ENABLE);
same_offset!(CtlBlock, mbox_req, ctl::MBOX_REQ);
same_offset!(Footer, writer_status, footer::WRITER_STATUS);
same_offset!(Footer, reader_status, footer::READER_STATUS);
same_offset!(Footer, entries, footer::ENTRIES);
same_offset!(Footer, pages_touched, footer::PAGES_TOUCHED);
same_offset!(Footer, overrun, footer::OVERRUN);
same_offset!(Footer, dropped, footer::DROPPED);
same_offset!(Footer, next, footer::NEXT);
same_offset!(Footer, first_index, footer::FIRST_INDEX);
same_offset!(Footer, page_seq, footer::PAGE_SEQ);
same_offset!(Footer, missed, footer::MISSED);
same_offset!(Footer, page_entries, footer::PAGE_ENTRIES);
same_offset!(Footer, id_magic, footer::ID_MAGIC);
same_offset!(DataPageHeader, time_stamp, TIME_STAMP_OFFSET);
same_offset!(DataPageHeader, commit, COMMIT_OFFSET);

#[cfg(all(test, feature = "alloc"))]
mod tests {
    use super::*;
    use crate::layout::{Mode, RingGeometry, PACK_MAGIC};
    use crate::mem::WordMem;
    use crate::SharedMem;

    #[test]
    fn a_region_read_as_bytes_matches_the_pack_the_host_wrote() {
        let l = RingGeometry::new(2, 4, 4096, Mode::Stop, true).unwrap();
        let m = WordMem::new(l.region_size);
        l.init_region(&m, 2_600_000, 7);
        let bytes = m.to_vec();
        let (h, _) = PackHeader::read_from_prefix(&bytes).unwrap();
        assert_eq!(h.magic, PACK_MAGIC);
        assert_eq!(
            (h.nr_cpus, h.page_size, h.tsc_khz, h.generation),
            (2, 4096, 2_600_000, 7)
        );
        assert_eq!(h.region_size as usize, l.region_size);
        let d = CpuDesc::read_from_bytes(&bytes[l.desc(1)..l.desc(1) + CPU_DESC_SIZE]).unwrap();
        assert_eq!((d.cpu, d.nr_pages, d.first_page), (1, 4, 4));
        let c = CtlBlock::read_from_bytes(&bytes[l.ctl(1)..l.ctl(1) + CTL_SIZE]).unwrap();
        assert_eq!(c.reader_page, 4);
        let f = Footer::read_from_bytes(&bytes[l.footer_off(5)..l.footer_off(5) + FOOTER_SIZE])
            .unwrap();
        assert_eq!(f.id_magic as u32, 5);
        assert_eq!(f.page_seq, 1);
        assert_eq!(
            m.load(
                l.footer_off(5) + footer::NEXT,
                core::sync::atomic::Ordering::Relaxed
            ),
            f.next
        );
    }
}
