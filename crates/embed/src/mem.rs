//! A trace region inside a VMM's vm-memory guest memory, as [`SharedMem`].

use core::sync::atomic::Ordering;
use hyptrace_abi::{RawMem, SharedMem};

use vm_memory::bitmap::Bitmap;
use vm_memory::{
    Address, GuestAddress, GuestMemoryBackend, GuestMemoryError, GuestMemoryMmap, GuestMemoryRegion,
};

/// Why a range of guest memory cannot hold the trace region.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The range is not inside one mapped region of guest memory.
    #[error("trace region [{gpa:#x}, +{len:#x}) is not inside one region of guest memory")]
    NotMapped {
        /// Its guest-physical address.
        gpa: u64,
        /// Its length.
        len: usize,
        /// What vm-memory said.
        #[source]
        source: GuestMemoryError,
    },
    /// The range does not start 8-byte aligned in the host mapping.
    #[error("trace region at {gpa:#x} is not 8-byte aligned")]
    Unaligned {
        /// Its guest-physical address.
        gpa: u64,
    },
}

/// `len` bytes of guest memory at `gpa`, accessed the way the ring protocol needs:
/// 64-bit atomics and volatile byte copies, never references to the bytes (the guest's
/// vCPUs write the same bytes concurrently). It keeps the guest memory mapped while it
/// lives (it holds a clone of `M`, whose regions are shared).
///
/// Generic over the bitmap of vm-memory's [`GuestMemoryMmap`]: `()` (none), `AtomicBitmap`
/// (cloud-hypervisor), `Option<AtomicBitmap>` (Firecracker). Only `GuestMemoryMmap`: its
/// clones share their regions (`Arc`), which keeps the mapping `self` points into alive; a
/// backend whose clone copied its memory would leave `self` pointing into the caller's.
/// **Every host write** (a store, swap, compare-exchange or fetch-op, a byte copy: the
/// reader's swaps, pokes and footer updates) **marks the pages it wrote dirty** in the
/// region's bitmap, so live migration copies them again; loads mark nothing, and what the
/// guest's vCPUs write is KVM's dirty log's, not this bitmap's.
///
/// ```
/// use hyptrace_abi::SharedMem;
/// use hyptrace_embed::GuestRegionMem;
/// use std::sync::atomic::Ordering::Release;
/// use vm_memory::bitmap::AtomicBitmap;
/// use vm_memory::bitmap::Bitmap;
/// use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
///
/// let mem = GuestMemoryMmap::<AtomicBitmap>::from_ranges(&[(GuestAddress(0), 4 << 20)])?;
/// let region = GuestRegionMem::new(&mem, GuestAddress(2 << 20), 1 << 20)?;
/// assert_eq!((region.gpa(), region.size()), (2 << 20, 1 << 20));
/// assert!(GuestRegionMem::new(&mem, GuestAddress(3 << 20), 2 << 20).is_err());
/// region.store(0x3000, 7, Release); // the page at 2 MiB + 12 KiB is now dirty
/// let bitmap = mem.find_region(GuestAddress(0)).unwrap().bitmap();
/// assert!(bitmap.dirty_at((2 << 20) + 0x3000) && !bitmap.dirty_at(2 << 20));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GuestRegionMem<B: Bitmap + 'static = ()> {
    /// Keeps the mapping alive for as long as `raw` is used, and holds the bitmaps.
    memory: GuestMemoryMmap<B>,
    gpa: u64,
    raw: RawMem,
}

impl<B: Bitmap + 'static> core::fmt::Debug for GuestRegionMem<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("GuestRegionMem")
            .field("gpa", &self.gpa)
            .field("size", &self.raw.size())
            .finish_non_exhaustive()
    }
}

impl<B: Bitmap + 'static> GuestRegionMem<B> {
    /// The `len` bytes at `gpa` of `memory`: one mapped region must hold them all.
    ///
    /// # Errors
    ///
    /// [`RegionError::NotMapped`] when no one region holds the range,
    /// [`RegionError::Unaligned`] when its host address is not 8-byte aligned.
    /// # Examples
    ///
    /// ```
    /// use vm_memory::{GuestAddress, GuestMemoryMmap};
    /// use hyptrace_abi::SharedMem;
    /// let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)])?;
    /// let rings = hyptrace_embed::GuestRegionMem::new(&memory, GuestAddress(2 << 20), 64 << 10)?;
    /// assert_eq!((rings.gpa(), rings.size()), (2 << 20, 64 << 10));
    /// assert!(hyptrace_embed::GuestRegionMem::new(&memory, GuestAddress(4 << 20), 4096).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Safety
    ///
    /// A safe function: the region keeps a clone of `memory` (its mapping shared, not copied)
    /// for as long as it lives, and reaches the bytes only through atomics and volatile copies,
    /// as the guest does from its side.
    pub fn new(
        memory: &GuestMemoryMmap<B>,
        gpa: GuestAddress,
        len: usize,
    ) -> Result<Self, RegionError> {
        let slice = memory
            .get_slice(gpa, len)
            .map_err(|source| RegionError::NotMapped {
                gpa: gpa.0,
                len,
                source,
            })?;
        let ptr = slice.ptr_guard_mut().as_ptr();
        if ptr.align_offset(8) != 0 {
            return Err(RegionError::Unaligned { gpa: gpa.0 });
        }
        // SAFETY: `ptr` is the host mapping of `len` bytes of one region of `memory`
        // (get_slice checked the range), 8-byte aligned (checked); the clone of `memory`
        // kept in `self` holds that region (its mmap is shared, not copied) for as long
        // as `self` lives. The guest accesses the bytes only through its own atomics and
        // stores (another domain), the host only through this RawMem (atomics and
        // volatile byte copies), never through Rust references.
        let raw = unsafe { RawMem::new(ptr, len) };
        Ok(Self {
            memory: memory.clone(),
            gpa: gpa.0,
            raw,
        })
    }

    /// Guest-physical address of the first byte (the pack: what the guest is given).
    /// # Examples
    ///
    /// ```
    /// use vm_memory::{GuestAddress, GuestMemoryMmap};
    /// let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)])?;
    /// let rings = hyptrace_embed::GuestRegionMem::new(&memory, GuestAddress(2 << 20), 4096)?;
    /// assert_eq!(rings.gpa(), 2 << 20); // the address the guest is given
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    /// Marks `[off, off + len)` of the region dirty in its guest memory region's bitmap
    /// (one region holds the whole range: checked at [`GuestRegionMem::new`]).
    fn dirty(&self, off: usize, len: usize) {
        let at = GuestAddress(self.gpa).unchecked_add(off as u64);
        if let Some((region, addr)) = self.memory.to_region_addr(at) {
            region.bitmap().mark_dirty(addr.raw_value() as usize, len);
        }
    }
}

impl<B: Bitmap + 'static> SharedMem for GuestRegionMem<B> {
    fn size(&self) -> usize {
        self.raw.size()
    }
    fn load(&self, off: usize, order: Ordering) -> u64 {
        self.raw.load(off, order)
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        self.raw.read_bytes(off, dst)
    }
    // Every write below: the raw write (its own bounds check first), then the pages
    // marked dirty.
    fn store(&self, off: usize, val: u64, order: Ordering) {
        self.raw.store(off, val, order);
        self.dirty(off, 8);
    }
    fn swap(&self, off: usize, val: u64, order: Ordering) -> u64 {
        let v = self.raw.swap(off, val, order);
        self.dirty(off, 8);
        v
    }
    fn compare_exchange(
        &self,
        off: usize,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64> {
        let r = self
            .raw
            .compare_exchange(off, current, new, success, failure);
        if r.is_ok() {
            self.dirty(off, 8);
        }
        r
    }
    fn fetch_or(&self, off: usize, val: u64, order: Ordering) -> u64 {
        let v = self.raw.fetch_or(off, val, order);
        self.dirty(off, 8);
        v
    }
    fn fetch_and(&self, off: usize, val: u64, order: Ordering) -> u64 {
        let v = self.raw.fetch_and(off, val, order);
        self.dirty(off, 8);
        v
    }
    fn fetch_add(&self, off: usize, val: u64, order: Ordering) -> u64 {
        let v = self.raw.fetch_add(off, val, order);
        self.dirty(off, 8);
        v
    }
    fn write_bytes(&self, off: usize, src: &[u8]) {
        self.raw.write_bytes(off, src);
        self.dirty(off, src.len());
    }
}
