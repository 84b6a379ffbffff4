//! The guest's trace region as the ring reader's memory ([`GuestTraceMem`]), and the
//! rings allocated in it ([`alloc_reader`]).

use std::sync::Arc;
use std::time::Duration;

use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::SharedMem;
use hyptrace_reader::{Callbacks, ReadError, RingBuffer};

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, VolatileSlice};

/// The trace region of a VM as [`SharedMem`]: atomics and volatile copies on the guest
/// memory, which the guest's vCPUs write concurrently ([`hyptrace_embed::GuestRegionMem`],
/// the one wrapper, shared with any VMM that embeds the reader).
#[derive(Debug)]
pub struct GuestTraceMem {
    raw: hyptrace_embed::GuestRegionMem,
}

impl GuestTraceMem {
    /// Wraps a VM's trace region.
    pub fn new(region: TraceRegion) -> Self {
        let raw = hyptrace_embed::GuestRegionMem::new(
            region.memory(),
            vm_memory::GuestAddress(region.gpa()),
            region.len(),
        )
        .expect("a VM's trace region is page-aligned inside one region of its memory");
        Self { raw }
    }
}

impl SharedMem for GuestTraceMem {
    hyptrace_abi::forward_shared_mem!(self => self.raw);
}

/// The reader over a VM's trace region.
pub type Reader = RingBuffer<Arc<GuestTraceMem>, Box<dyn Callbacks + Send>>;

/// Allocates the rings in the trace region (pack, control blocks, linked pages) and
/// returns the reader, with host-executed (`Direct`) or guest-executed (`Mailbox`)
/// callbacks.
pub fn alloc_reader(
    region: TraceRegion,
    layout: RingGeometry,
    tsc_khz: u64,
    generation: u64,
    mailbox_timeout: Duration,
) -> Result<Reader, ReadError> {
    alloc_reader_wrapped(region, layout, tsc_khz, generation, mailbox_timeout, |cb| {
        cb
    })
}

/// [`alloc_reader`] with the callbacks passed through `wrap` (e.g. to time every swap).
pub fn alloc_reader_wrapped(
    region: TraceRegion,
    layout: RingGeometry,
    tsc_khz: u64,
    generation: u64,
    mailbox_timeout: Duration,
    wrap: impl FnOnce(Box<dyn Callbacks + Send>) -> Box<dyn Callbacks + Send>,
) -> Result<Reader, ReadError> {
    let mem = Arc::new(GuestTraceMem::new(region));
    let cb = wrap(hyptrace_reader::callbacks::for_geometry(
        mem.clone(),
        layout,
        mailbox_timeout,
    ));
    RingBuffer::alloc(mem, layout, cb, tsc_khz, generation)
}

/// The trace region: a page-aligned range of guest memory the ring-buffer reader
/// initialises and reads while the guest writes it.
///
/// It holds a handle on guest memory, so the mapping stays valid for as long as this
/// value (or a clone) lives, even after the VM is gone. The guest's vCPUs write the
/// same bytes concurrently: access it only through atomics or volatile accesses (or
/// [`VolatileSlice`]), never through `&`/`&mut` references to the bytes while the VM
/// runs.
#[derive(Clone, Debug)]
pub struct TraceRegion {
    memory: GuestMemoryMmap,
    gpa: u64,
    len: usize,
}

impl TraceRegion {
    /// The `len` bytes at `gpa` of `memory` (which must hold them: the VM checks its
    /// layout before it makes one).
    pub(crate) fn new(memory: GuestMemoryMmap, gpa: u64, len: usize) -> Self {
        Self { memory, gpa, len }
    }

    /// Guest-physical (= guest-virtual) address.
    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never, for a VM).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region as a volatile slice.
    pub fn as_volatile_slice(&self) -> VolatileSlice<'_, vm_memory::bitmap::BS<'_, ()>> {
        self.memory
            .get_slice(GuestAddress(self.gpa), self.len)
            .expect("trace region is in guest memory")
    }

    /// Guest memory the region lives in.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }
}
