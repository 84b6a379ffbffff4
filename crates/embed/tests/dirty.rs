//! The rings in a VMM's guest memory with a dirty bitmap (`GuestMemoryMmap<AtomicBitmap>`,
//! as cloud-hypervisor keeps it; Firecracker's `Option<AtomicBitmap>` likewise): every
//! page the host reader writes while it drains is marked dirty, so a live migration
//! copies it again; pages it only reads stay clean.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::SharedMem;
use hyptrace_embed::GuestRegionMem;
use hyptrace_reader::{Direct, RingBuffer};
use hyptrace_writer::{WriteOutcome, Writer};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::bitmap::Bitmap;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

const PAGE: usize = 4096;
/// The second of the guest memory's two regions (offsets in a region's bitmap are from
/// the region's start, not guest addresses: the rings are not in the first region).
const REGION: u64 = 4 << 20;
/// Where the rings start in guest memory, and in their region.
const GPA: u64 = REGION + (1 << 20);
const REL: usize = (GPA - REGION) as usize;

type Mem = GuestMemoryMmap<AtomicBitmap>;

/// Clears the dirty bitmap of `mem`'s one region.
fn reset(mem: &Mem) {
    for at in [0, REGION] {
        let r = mem.find_region(GuestAddress(at)).expect("region");
        let mmap: &vm_memory::MmapRegion<AtomicBitmap> = r;
        mmap.bitmap().reset();
    }
}

/// The region's bytes, page by page.
fn pages(m: &GuestRegionMem<AtomicBitmap>) -> Vec<Vec<u8>> {
    (0..m.size() / PAGE)
        .map(|p| {
            let mut b = vec![0u8; PAGE];
            m.read_bytes(p * PAGE, &mut b);
            b
        })
        .collect()
}

fn run(mode: Mode) {
    let mem = Mem::from_ranges(&[(GuestAddress(0), 1 << 20), (GuestAddress(REGION), 4 << 20)])
        .expect("guest memory");
    let l = RingGeometry::new(2, 16, PAGE, mode, false).expect("geometry");
    let rings =
        Arc::new(GuestRegionMem::new(&mem, GuestAddress(GPA), l.region_size).expect("region"));
    let mut rb = RingBuffer::alloc(
        rings.clone(),
        l,
        Direct::new(rings.clone(), l),
        1_000_000,
        1,
    )
    .expect("alloc");
    let bitmap = || {
        mem.find_region(GuestAddress(REGION))
            .expect("region")
            .bitmap()
    };
    let first = || mem.find_region(GuestAddress(0)).expect("region").bitmap();
    // Allocating wrote the whole region: all of it dirty.
    for p in 0..l.region_size / PAGE {
        assert!(bitmap().dirty_at(REL + p * PAGE), "page {p} after alloc");
    }
    // The guest writes (here through the same memory; what it writes is KVM's dirty
    // log's business, not this bitmap's, so the bitmap is cleared after it).
    for cpu in 0..2 {
        let mut w = Writer::attach(rings.clone(), cpu).expect("writer");
        let mut ts = 100u64;
        for n in 0..5000u64 {
            ts += 10;
            if w.write(0, ts, &n.to_le_bytes()) != WriteOutcome::Written && mode == Mode::Stop {
                break;
            }
        }
    }
    let before = pages(&rings);
    reset(&mem);
    // The host drains both CPUs: swaps, footer and counter updates.
    let mut read = 0;
    for cpu in 0..2 {
        while let Some(p) = rb.next_page(cpu).expect("page") {
            read += 1;
            std::hint::black_box(p.bytes);
        }
    }
    assert!(read > 4, "{read} pages read");
    let after = pages(&rings);
    let (mut changed, mut dirty) = (0, 0);
    for (p, (b, a)) in before.iter().zip(&after).enumerate() {
        let d = bitmap().dirty_at(REL + p * PAGE);
        if b != a {
            changed += 1;
            assert!(
                d,
                "{mode:?}: page {p} written by the host, not marked dirty"
            );
        }
        dirty += usize::from(d);
    }
    assert!(changed > 0, "{mode:?}: the drain wrote nothing");
    assert!(dirty >= changed);
    // Reading marks nothing: every page read again, every word loaded.
    reset(&mem);
    let _ = pages(&rings);
    for off in (0..rings.size()).step_by(8) {
        std::hint::black_box(rings.load(off, Ordering::Acquire));
    }
    for p in 0..before.len() {
        assert!(
            !bitmap().dirty_at(REL + p * PAGE),
            "{mode:?}: page {p} marked by reads"
        );
    }
    // Outside the rings: nothing.
    assert!(!bitmap().dirty_at(0) && !bitmap().dirty_at((3 << 20) + 8));
    assert!((0..1 << 20).step_by(PAGE).all(|o| !first().dirty_at(o)));
    // A compare-exchange that fails writes nothing: no mark.
    reset(&mem);
    let v = rings.load(0, Ordering::Acquire);
    assert!(rings
        .compare_exchange(0, v.wrapping_add(1), 0, Ordering::AcqRel, Ordering::Acquire)
        .is_err());
    assert!(!bitmap().dirty_at(REL));
}

#[test]
fn host_writes_are_marked_dirty_stop() {
    run(Mode::Stop);
}

#[test]
fn host_writes_are_marked_dirty_overwrite() {
    run(Mode::Overwrite);
}
