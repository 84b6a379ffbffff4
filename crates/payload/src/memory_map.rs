//! The guest-physical memory map.
//!
//! Guest memory is one region `[0, mem_bytes)`, identity-mapped with 2 MiB user pages
//! (so GPA = guest-virtual address):
//!
//! | GPA                          | what                                                  |
//! |------------------------------|-------------------------------------------------------|
//! | `0x0000_0000`                | unused page                                           |
//! | [`GDT_ADDR`]  `0x1000`       | GDT (null, kernel code/data, TSS, user code/data)     |
//! | [`TSS_ADDR`]  `0x2000`       | 64-bit TSS + I/O bitmap allowing ports 0..8191 (PVM)   |
//! | [`PML4_ADDR`] `0x3000`       | PML4                                                  |
//! | [`PDPT_ADDR`] `0x4000`       | PDPT                                                  |
//! | [`PD_ADDR`]   `0x5000`       | one PD per GiB (2 MiB pages, P/RW/US)                 |
//! | up to [`LOW_END`] (2 MiB)    | reserved for the VMM                                  |
//! | image (from the ELF)         | guest payload, where its program headers say (≥ 2 MiB) |
//! | `params_gpa` (2 MiB aligned) | RunParams block, result slots follow at +128          |
//! | `stacks_gpa`                 | one [`STACK_SIZE`] stack per vCPU (vCPU i: top at `stacks_gpa + (i+1)*STACK_SIZE`) |
//! | `trace_gpa` (2 MiB aligned)  | trace region (`trace_len` bytes), rdi at entry        |
//! | rest up to `mem_bytes`       | unused                                                |
//! | [`DOORBELL_GPA`] `0xc000_0000` | no memory: the MMIO doorbell page (mapped, unbacked, uncached; its 2 MiB page's PD at [`DOORBELL_PD_ADDR`]) |
//!
//! Memory is limited to [`MAX_MEM_BYTES`] (3 GiB) so that it stays below the 32-bit
//! hole, where KVM's TSS pages ([`KVM_TSS_ADDR`]) live.

use hyptrace_abi::guest::{RUN_PARAMS_SIZE, VCPU_RESULT_SIZE};
use thiserror::Error;

use crate::elf::GuestImage;

/// 4 KiB.
pub const PAGE_SIZE: u64 = 4096;
/// 2 MiB, the page size of the identity map.
pub const HUGE_PAGE: u64 = 2 << 20;
/// GDT.
pub const GDT_ADDR: u64 = 0x1000;
/// TSS.
pub const TSS_ADDR: u64 = 0x2000;
/// PML4.
pub const PML4_ADDR: u64 = 0x3000;
/// PDPT.
pub const PDPT_ADDR: u64 = 0x4000;
/// First PD (one per GiB of guest memory).
pub const PD_ADDR: u64 = 0x5000;
/// The MMIO doorbell page (docs/abi.md, "Doorbell"): the first address past the largest
/// guest memory, 2 MiB-aligned. No memory slot backs it, so a guest store there exits
/// (`KVM_EXIT_MMIO`). The identity map always maps its 2 MiB page (user, uncached); the
/// guest is told to ring there only when its entry `rcx` holds this address
/// ([`crate::boot::VcpuBoot::rcx`]).
pub const DOORBELL_GPA: u64 = MAX_MEM_BYTES;
/// The PD that maps the doorbell's GiB (the one after guest memory's last PD).
pub const DOORBELL_PD_ADDR: u64 = PD_ADDR + (DOORBELL_GPA >> 30) * PAGE_SIZE;
const _: () = assert!(DOORBELL_GPA >= MAX_MEM_BYTES && DOORBELL_GPA.is_multiple_of(HUGE_PAGE));
const _: () = assert!(DOORBELL_GPA < KVM_TSS_ADDR && DOORBELL_PD_ADDR + PAGE_SIZE <= LOW_END);
/// End of the VMM's low area; the image must be loaded at or above it.
pub const LOW_END: u64 = HUGE_PAGE;
/// Largest guest memory.
pub const MAX_MEM_BYTES: u64 = 3 << 30;
/// Smallest guest memory.
pub const MIN_MEM_BYTES: u64 = 4 << 20;
/// Per-vCPU stack size.
pub const STACK_SIZE: u64 = 64 << 10;
/// Where KVM puts its 3 TSS pages (`KVM_SET_TSS_ADDR`, needed on Intel): above guest memory.
pub const KVM_TSS_ADDR: u64 = 0xfffb_d000;
/// Largest trace region alignment.
pub const MAX_TRACE_ALIGN: u64 = 1 << 30;
/// Most vCPUs a VM may have (KVM's own limit may be lower).
pub const MAX_VCPUS: u32 = 256;

/// Why a configuration does not fit guest memory.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MemoryMapError {
    /// No vCPU.
    #[error("the number of vCPUs must be at least 1")]
    NoVcpus,
    /// Too many vCPUs.
    #[error("too many vCPUs: {0} (at most {MAX_VCPUS})")]
    TooManyVcpus(u32),
    /// Memory size not a multiple of 2 MiB or out of range.
    #[error("guest memory size {0:#x} must be a multiple of 2 MiB between 4 MiB and 3 GiB")]
    BadMemSize(u64),
    /// The image overlaps the VMM's low memory.
    #[error("guest image [{0:#x}, {1:#x}) overlaps the VMM's low memory (below {LOW_END:#x})")]
    ImageTooLow(u64, u64),
    /// Everything does not fit.
    #[error("guest memory too small: {need} bytes needed ({need_mb} MiB) for the image, stacks, parameters and trace region, {have} bytes given")]
    TooSmall {
        /// Bytes needed.
        need: u64,
        /// The same in MiB, rounded up.
        need_mb: u64,
        /// Bytes available.
        have: u64,
    },
    /// The trace region alignment is not a power of two or too large.
    #[error("trace region alignment {0:#x} is not a power of two up to 1 GiB")]
    BadTraceAlign(u64),
    /// The trace region size is zero.
    #[error("the trace region must not be empty")]
    EmptyTraceRegion,
}

/// Where everything is, in guest-physical addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestMemoryMap {
    /// Guest memory size.
    pub mem_bytes: u64,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Image range `[start, end)`.
    pub image: (u64, u64),
    /// RunParams block.
    pub params_gpa: u64,
    /// Bytes reserved for the RunParams block and the result slots (page multiple).
    pub params_len: u64,
    /// First result slot (`params_gpa + RUN_PARAMS_SIZE`).
    pub results_gpa: u64,
    /// Bottom of vCPU 0's stack.
    pub stacks_gpa: u64,
    /// Trace region (page-aligned, 2 MiB-aligned in fact).
    pub trace_gpa: u64,
    /// Trace region size.
    pub trace_len: u64,
}

const fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl GuestMemoryMap {
    /// Bytes of guest memory needed for `image`, `vcpus` and a trace region of
    /// `trace_len` bytes (a multiple of 2 MiB).
    pub fn required_mem(image: &GuestImage, vcpus: u32, trace_len: u64, trace_align: u64) -> u64 {
        let l = Self::place(image, vcpus, trace_len, trace_align, u64::MAX);
        align_up(l.trace_gpa + l.trace_len, HUGE_PAGE)
    }

    fn place(
        image: &GuestImage,
        vcpus: u32,
        trace_len: u64,
        trace_align: u64,
        mem_bytes: u64,
    ) -> Self {
        let n = u64::from(vcpus);
        let params_gpa = align_up(image.end.max(LOW_END), HUGE_PAGE);
        let params_len = align_up(
            RUN_PARAMS_SIZE as u64 + n * VCPU_RESULT_SIZE as u64,
            PAGE_SIZE,
        );
        let stacks_gpa = params_gpa + params_len;
        let trace_gpa = align_up(stacks_gpa + n * STACK_SIZE, trace_align.max(HUGE_PAGE));
        Self {
            mem_bytes,
            vcpus,
            image: (image.start, image.end),
            params_gpa,
            params_len,
            results_gpa: params_gpa + RUN_PARAMS_SIZE as u64,
            stacks_gpa,
            trace_gpa,
            trace_len,
        }
    }

    /// Lays out guest memory, checking that everything fits. The trace region is aligned
    /// to `trace_align` (a power of two, e.g. the ring page size), at least 2 MiB.
    pub fn new(
        image: &GuestImage,
        vcpus: u32,
        mem_bytes: u64,
        trace_len: u64,
        trace_align: u64,
    ) -> Result<Self, MemoryMapError> {
        if vcpus == 0 {
            return Err(MemoryMapError::NoVcpus);
        }
        if vcpus > MAX_VCPUS {
            return Err(MemoryMapError::TooManyVcpus(vcpus));
        }
        if trace_len == 0 {
            return Err(MemoryMapError::EmptyTraceRegion);
        }
        if !trace_align.is_power_of_two() || trace_align > MAX_TRACE_ALIGN {
            return Err(MemoryMapError::BadTraceAlign(trace_align));
        }
        if image.start < LOW_END {
            return Err(MemoryMapError::ImageTooLow(image.start, image.end));
        }
        if mem_bytes & (HUGE_PAGE - 1) != 0 || !(MIN_MEM_BYTES..=MAX_MEM_BYTES).contains(&mem_bytes)
        {
            return Err(MemoryMapError::BadMemSize(mem_bytes));
        }
        // A huge image or trace region must report "too small", not overflow.
        let need = if image.end > MAX_MEM_BYTES || trace_len > MAX_MEM_BYTES {
            image.end.saturating_add(trace_len)
        } else {
            Self::required_mem(image, vcpus, trace_len, trace_align)
        };
        if need > mem_bytes {
            return Err(MemoryMapError::TooSmall {
                need,
                need_mb: need.div_ceil(1 << 20),
                have: mem_bytes,
            });
        }
        Ok(Self::place(image, vcpus, trace_len, trace_align, mem_bytes))
    }

    /// Result slot of vCPU `id`.
    pub fn result_slot(&self, id: u32) -> u64 {
        self.results_gpa + u64::from(id) * VCPU_RESULT_SIZE as u64
    }

    /// Initial stack pointer of vCPU `id`.
    pub fn stack_top(&self, id: u32) -> u64 {
        self.stacks_gpa + (u64::from(id) + 1) * STACK_SIZE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(start: u64, end: u64) -> GuestImage {
        GuestImage {
            entry: start,
            segments: vec![],
            start,
            end,
        }
    }

    #[test]
    fn areas_do_not_overlap() {
        let img = image(0x20_0000, 0x20_9000);
        let l = GuestMemoryMap::new(&img, 4, 64 << 20, 5 << 20, HUGE_PAGE).unwrap();
        assert_eq!(l.params_gpa, 0x40_0000);
        assert!(l.results_gpa + 4 * VCPU_RESULT_SIZE as u64 <= l.stacks_gpa);
        assert!(l.stack_top(3) <= l.trace_gpa);
        assert_eq!(l.trace_gpa % HUGE_PAGE, 0);
        assert!(l.trace_gpa + l.trace_len <= l.mem_bytes);
    }

    #[test]
    fn rejects_bad_configs() {
        let img = image(0x20_0000, 0x20_9000);
        assert_eq!(
            GuestMemoryMap::new(&img, 0, 64 << 20, 1 << 20, HUGE_PAGE),
            Err(MemoryMapError::NoVcpus)
        );
        assert!(matches!(
            GuestMemoryMap::new(&img, 1, 8 << 20, 64 << 20, HUGE_PAGE),
            Err(MemoryMapError::TooSmall { .. })
        ));
        assert!(matches!(
            GuestMemoryMap::new(&img, 1, 8 << 20, u64::MAX, HUGE_PAGE),
            Err(MemoryMapError::TooSmall { .. })
        ));
        assert_eq!(
            GuestMemoryMap::new(&img, 1, (8 << 20) + 4096, 1 << 20, HUGE_PAGE),
            Err(MemoryMapError::BadMemSize((8 << 20) + 4096))
        );
        let low = image(0x10_0000, 0x10_9000);
        assert!(matches!(
            GuestMemoryMap::new(&low, 1, 64 << 20, 1 << 20, HUGE_PAGE),
            Err(MemoryMapError::ImageTooLow(..))
        ));
    }
}
