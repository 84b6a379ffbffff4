//! A trace region inside a VMM's vm-memory guest memory, as [`SharedMem`].

use hyptrace_abi::{RawMem, SharedMem};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryError, GuestMemoryMmap};

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
/// lives (it holds a clone of the [`GuestMemoryMmap`], whose regions are shared).
///
/// ```
/// use hyptrace_abi::SharedMem;
/// use hyptrace_embed::GuestRegionMem;
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
///
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4 << 20)])?;
/// let region = GuestRegionMem::new(&mem, GuestAddress(2 << 20), 1 << 20)?;
/// assert_eq!((region.gpa(), region.size()), (2 << 20, 1 << 20));
/// assert!(GuestRegionMem::new(&mem, GuestAddress(3 << 20), 2 << 20).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct GuestRegionMem {
    // Keeps the mapping alive for as long as `raw` is used.
    _memory: GuestMemoryMmap,
    gpa: u64,
    raw: RawMem,
}

impl GuestRegionMem {
    /// The `len` bytes at `gpa` of `memory`: one mapped region must hold them all.
    pub fn new(
        memory: &GuestMemoryMmap,
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
            _memory: memory.clone(),
            gpa: gpa.0,
            raw,
        })
    }

    /// Guest-physical address of the first byte (the pack: what the guest is given).
    pub fn gpa(&self) -> u64 {
        self.gpa
    }
}

impl SharedMem for GuestRegionMem {
    hyptrace_abi::forward_shared_mem!(self => self.raw);
}
