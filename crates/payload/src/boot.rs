//! The boot recipe of a hyptrace guest as plain data: what goes into guest memory (the
//! GDT, the TSS, identity page tables, the ELF's segments, the run parameter block) and
//! the initial state of each vCPU as plain numbers ([`VcpuBoot`]), which a VMM copies
//! into its hypervisor's register structures (`kvm_regs`/`kvm_sregs`/`kvm_fpu` on KVM).
//!
//! The guest runs in 64-bit **user mode** (CPL3, IOPL=3): under PVM guest code at CPL0
//! is emulated, and code written for CPL3 runs on hardware KVM too. No IDT: any CPU
//! exception triple-faults (KVM reports `KVM_EXIT_SHUTDOWN`).

use hyptrace_abi::guest::{RunParamBlock, RUN_PARAMS_SIZE, VCPU_RESULT_SIZE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use crate::elf::{ElfError, GuestImage};
use crate::memory_map::{
    GuestMemoryMap, MemoryMapError, DOORBELL_GPA, DOORBELL_PD_ADDR, GDT_ADDR, HUGE_PAGE, PDPT_ADDR,
    PD_ADDR, PML4_ADDR, TSS_ADDR,
};

/// GDT: null, kernel code, kernel data, TSS (two slots, filled in), user code, user data.
const GDT: [u64; 7] = [
    0,
    0x00af_9b00_0000_ffff, // 0x08 kernel code, L=1
    0x00cf_9300_0000_ffff, // 0x10 kernel data
    0,                     // 0x18 TSS (filled in)
    0,
    0x00af_fb00_0000_ffff, // 0x28 user code, L=1, DPL3
    0x00cf_f300_0000_ffff, // 0x30 user data, DPL3
];
const TSS_SELECTOR: u16 = 0x18;
/// User code selector (RPL 3).
pub const USER_CS: u16 = 0x28 | 3;
/// User data selector (RPL 3).
pub const USER_DS: u16 = 0x30 | 3;
/// The TSS: 104 bytes, then an I/O permission bitmap for ports 0..IO_BITMAP_PORTS (all
/// allowed), then the 0xff terminator byte.
const TSS_BASE_SIZE: u64 = 104;
const IO_BITMAP_PORTS: u64 = 8192;
const TSS_LIMIT: u64 = TSS_BASE_SIZE + IO_BITMAP_PORTS / 8;

const PTE_P: u64 = 1;
const PTE_RW: u64 = 1 << 1;
const PTE_US: u64 = 1 << 2;
const PTE_PWT: u64 = 1 << 3;
const PTE_PCD: u64 = 1 << 4;
const PTE_PS: u64 = 1 << 7;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
/// RFLAGS: IOPL=3 (in/out allowed at CPL3) | the reserved bit 1.
pub const RFLAGS: u64 = 0x3002;

/// Why a guest cannot be booted as asked.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The image is not a loadable guest.
    #[error("guest image")]
    Elf(#[from] ElfError),
    /// The configuration does not fit guest memory.
    #[error("guest memory map")]
    MemoryMap(#[from] MemoryMapError),
    /// Writing guest memory failed (an address outside it).
    #[error("writing guest memory")]
    Memory(#[from] GuestMemoryError),
}

/// A segment register's hidden state, field for field as KVM's `kvm_segment`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Segment {
    pub base: u64,
    pub limit: u32,
    pub selector: u16,
    pub type_: u8,
    pub present: u8,
    pub dpl: u8,
    pub db: u8,
    pub s: u8,
    pub l: u8,
    pub g: u8,
}

/// A descriptor table register (GDTR, IDTR).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// Linear base address.
    pub base: u64,
    /// Limit (size − 1).
    pub limit: u16,
}

/// The initial state of one vCPU, as plain numbers. Registers not named are zero;
/// `fcw`/`mxcsr` are the x87/SSE defaults. On KVM also call `set_cpuid2` with the
/// table of [`crate::cpuid::guest_cpuid`] (KVM refuses `EFER.LME` without its long-mode
/// bit; the guest's core library uses SSE2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct VcpuBoot {
    /// Entry point (the ELF's).
    pub rip: u64,
    /// Top of this vCPU's stack.
    pub rsp: u64,
    /// Guest-physical address of the trace pack (the trace region).
    pub rdi: u64,
    /// The vCPU id.
    pub rsi: u64,
    /// Guest-physical address of the run parameter block.
    pub rdx: u64,
    /// Where the guest rings its doorbell (entry ABI version 2, docs/abi.md "Doorbell"):
    /// 0 = by port (what [`vcpu_boot`] gives), else the guest-physical address of the
    /// MMIO doorbell page — [`crate::memory_map::DOORBELL_GPA`], which [`setup_memory`]
    /// maps; the VMM then serves `hyptrace_embed::MmioDoorbell::new(DOORBELL_GPA)`.
    pub rcx: u64,
    pub rflags: u64,
    pub cs: Segment,
    pub ds: Segment,
    pub es: Segment,
    pub fs: Segment,
    /// GS base = this vCPU's result slot (the guest's panic handler finds it there).
    pub gs: Segment,
    pub ss: Segment,
    pub tr: Segment,
    pub gdt: Table,
    pub idt: Table,
    pub cr0: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub efer: u64,
    pub fcw: u16,
    pub mxcsr: u32,
}

impl VcpuBoot {
    /// This state with the MMIO doorbell handed over: `rcx` =
    /// [`crate::memory_map::DOORBELL_GPA`] (docs/abi.md, "Doorbell"). The VMM serves
    /// `hyptrace_embed::MmioDoorbell::new(DOORBELL_GPA)` and leaves that page unbacked.
    ///
    /// ```
    /// use hyptrace_payload::{memory_map::DOORBELL_GPA, Boot, GUEST_ELF};
    /// let boot = Boot::new(GUEST_ELF, 1, 1 << 20, 4096)?;
    /// assert_eq!(boot.vcpu(0).rcx, 0); // by port
    /// assert_eq!(boot.vcpu(0).mmio_doorbell().rcx, DOORBELL_GPA);
    /// # Ok::<(), hyptrace_payload::BootError>(())
    /// ```
    pub fn mmio_doorbell(self) -> Self {
        Self {
            rcx: DOORBELL_GPA,
            ..self
        }
    }
}

fn flat(selector: u16, type_: u8, code: bool) -> Segment {
    Segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 3,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
    }
}

/// The entry state of vCPU `id` (registers of the contract in `hyptrace_abi::guest`:
/// rdi = trace region GPA, rsi = vCPU id, rdx = run parameter block GPA, rcx = 0 (ring
/// the doorbell by port; [`VcpuBoot::mmio_doorbell`] hands over the MMIO page), rsp =
/// top of its stack, GS base = its result slot).
pub fn vcpu_boot(layout: &GuestMemoryMap, id: u32, entry: u64) -> VcpuBoot {
    let data = flat(USER_DS, 0x3, false);
    VcpuBoot {
        rip: entry,
        rsp: layout.stack_top(id),
        rdi: layout.trace_gpa,
        rsi: u64::from(id),
        rdx: layout.params_gpa,
        rcx: 0,
        rflags: RFLAGS,
        cs: flat(USER_CS, 0xb, true),
        ds: data,
        es: data,
        fs: data,
        gs: Segment {
            base: layout.result_slot(id),
            ..data
        },
        ss: data,
        tr: Segment {
            base: TSS_ADDR,
            limit: TSS_LIMIT as u32,
            selector: TSS_SELECTOR,
            type_: 0xb,
            present: 1,
            ..Segment::default()
        },
        gdt: Table {
            base: GDT_ADDR,
            limit: (GDT.len() * 8 - 1) as u16,
        },
        idt: Table::default(),
        cr0: CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG,
        cr3: PML4_ADDR,
        cr4: CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT,
        efer: EFER_LME | EFER_LMA,
        fcw: 0x37f,
        mxcsr: 0x1f80,
    }
}

/// Writes the GDT, the TSS and the identity page tables for `[0, layout.mem_bytes)`
/// into `mem` (any vm-memory guest memory covering the VMM's low area). The 2 MiB page
/// of [`DOORBELL_GPA`] is mapped too (user, writable, uncached), with no memory behind
/// it: a guest told to ring there (`rcx`) exits on its store; another guest's access
/// there is an unbacked access, a guest fault.
pub fn setup_memory<M>(mem: &M, layout: &GuestMemoryMap) -> Result<(), GuestMemoryError>
where
    M: Bytes<GuestAddress, E = GuestMemoryError> + ?Sized,
{
    // The 16-byte TSS descriptor (type 0xb: busy 64-bit TSS, present, DPL0).
    let mut gdt = GDT;
    gdt[3] = (TSS_LIMIT & 0xffff)
        | ((TSS_ADDR & 0xff_ffff) << 16)
        | (0x8b << 40)
        | (((TSS_LIMIT >> 16) & 0xf) << 48)
        | (((TSS_ADDR >> 24) & 0xff) << 56);
    gdt[4] = TSS_ADDR >> 32;
    for (i, e) in (0u64..).zip(gdt) {
        mem.write_obj(e, GuestAddress(GDT_ADDR + 8 * i))?;
    }
    // TSS with an I/O bitmap allowing every port below IO_BITMAP_PORTS. IOPL=3 already
    // allows port I/O at CPL3 on hardware KVM, but PVM does not keep the guest's IOPL in
    // user mode (rflags reads back IOPL=0) and its emulator then checks this bitmap.
    mem.write_obj(TSS_BASE_SIZE as u16, GuestAddress(TSS_ADDR + 102))?;
    mem.write_slice(
        &[0u8; (IO_BITMAP_PORTS / 8) as usize],
        GuestAddress(TSS_ADDR + TSS_BASE_SIZE),
    )?;
    mem.write_obj(0xffu8, GuestAddress(TSS_ADDR + TSS_LIMIT))?;

    // Page tables: PML4[0] -> PDPT; PDPT[g] -> PD g; PD entries map 2 MiB user pages.
    let table = PTE_P | PTE_RW | PTE_US;
    mem.write_obj(PDPT_ADDR | table, GuestAddress(PML4_ADDR))?;
    let pages = layout.mem_bytes / HUGE_PAGE;
    for g in 0..pages.div_ceil(512) {
        mem.write_obj(
            (PD_ADDR + g * 4096) | table,
            GuestAddress(PDPT_ADDR + 8 * g),
        )?;
    }
    for p in 0..pages {
        mem.write_obj(
            (p * HUGE_PAGE) | table | PTE_PS,
            GuestAddress(PD_ADDR + 8 * p),
        )?;
    }
    // The doorbell's GiB has a PD of its own (guest memory ends before it).
    let g = DOORBELL_GPA >> 30;
    mem.write_obj(DOORBELL_PD_ADDR | table, GuestAddress(PDPT_ADDR + 8 * g))?;
    let entry = ((DOORBELL_GPA >> 21) & 511) * 8;
    mem.write_obj(
        DOORBELL_GPA | table | PTE_PS | PTE_PWT | PTE_PCD,
        GuestAddress(DOORBELL_PD_ADDR + entry),
    )?;
    Ok(())
}

/// Copies the loadable segments of `elf` (parsed as `image`) to their physical
/// addresses. Only the file bytes are copied: the rest of each segment (`.bss`) must be
/// zero already, as fresh anonymous memory is.
pub fn load_image<M>(mem: &M, elf: &[u8], image: &GuestImage) -> Result<(), BootError>
where
    M: Bytes<GuestAddress, E = GuestMemoryError> + ?Sized,
{
    for (i, seg) in image.segments.iter().enumerate() {
        let bytes = usize::try_from(seg.offset)
            .ok()
            .zip(usize::try_from(seg.filesz).ok())
            .and_then(|(o, n)| elf.get(o..o.checked_add(n)?))
            .ok_or(ElfError::BadSegment(
                i,
                "file range past the end of the file",
            ))?;
        mem.write_slice(bytes, GuestAddress(seg.paddr))?;
    }
    Ok(())
}

/// Writes the run parameter block and zeroed result slots for every vCPU, in one write,
/// before any vCPU runs.
pub fn write_params<M>(
    mem: &M,
    layout: &GuestMemoryMap,
    block: &RunParamBlock,
) -> Result<(), GuestMemoryError>
where
    M: Bytes<GuestAddress, E = GuestMemoryError> + ?Sized,
{
    let mut bytes = vec![0u8; RUN_PARAMS_SIZE + layout.vcpus as usize * VCPU_RESULT_SIZE];
    bytes[..RUN_PARAMS_SIZE].copy_from_slice(&block.to_bytes());
    mem.write_slice(&bytes, GuestAddress(layout.params_gpa))
}

/// A guest image placed in guest memory: the parsed ELF and the memory map, with the
/// steps that put it there.
///
/// ```
/// use hyptrace_payload::{Boot, GUEST_ELF};
/// use vm_memory::{GuestAddress, GuestMemoryMmap};
///
/// let trace_len = 1 << 20; // RingGeometry::region_size, rounded up to a page
/// let boot = Boot::new(GUEST_ELF, 2, trace_len, 4096)?;
/// let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), boot.mem_bytes() as usize)])?;
/// boot.load(&mem)?; // tables and image; then write_params, then the vCPUs:
/// let vcpu0 = boot.vcpu(0);
/// assert_eq!((vcpu0.rdi, vcpu0.rsi), (boot.layout().trace_gpa, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Boot<'a> {
    elf: &'a [u8],
    image: GuestImage,
    layout: GuestMemoryMap,
}

impl<'a> Boot<'a> {
    /// Lays out `elf` for `vcpus` vCPUs and a trace region of `trace_len` bytes aligned
    /// to `trace_align` (a power of two, e.g. the ring page size), in the smallest guest
    /// memory that holds them ([`Boot::mem_bytes`]).
    pub fn new(
        elf: &'a [u8],
        vcpus: u32,
        trace_len: u64,
        trace_align: u64,
    ) -> Result<Self, BootError> {
        let image = GuestImage::parse(elf)?;
        let need = GuestMemoryMap::required_mem(&image, vcpus, trace_len, trace_align)
            .max(crate::memory_map::MIN_MEM_BYTES);
        Self::with_memory(elf, vcpus, need, trace_len, trace_align)
    }

    /// [`Boot::new`] in `mem_bytes` of guest memory (a multiple of 2 MiB, 4 MiB..=3 GiB).
    pub fn with_memory(
        elf: &'a [u8],
        vcpus: u32,
        mem_bytes: u64,
        trace_len: u64,
        trace_align: u64,
    ) -> Result<Self, BootError> {
        let image = GuestImage::parse(elf)?;
        let layout = GuestMemoryMap::new(&image, vcpus, mem_bytes, trace_len, trace_align)?;
        Ok(Self { elf, image, layout })
    }

    /// Guest memory size: one region `[0, mem_bytes)`.
    pub fn mem_bytes(&self) -> u64 {
        self.layout.mem_bytes
    }

    /// Where everything is.
    pub fn layout(&self) -> &GuestMemoryMap {
        &self.layout
    }

    /// The parsed image.
    pub fn image(&self) -> &GuestImage {
        &self.image
    }

    /// Writes the tables ([`setup_memory`]) and the image ([`load_image`]) into `mem`.
    pub fn load<M>(&self, mem: &M) -> Result<(), BootError>
    where
        M: Bytes<GuestAddress, E = GuestMemoryError> + ?Sized,
    {
        setup_memory(mem, &self.layout)?;
        load_image(mem, self.elf, &self.image)
    }

    /// Writes the run parameter block ([`write_params`]).
    pub fn write_params<M>(&self, mem: &M, block: &RunParamBlock) -> Result<(), BootError>
    where
        M: Bytes<GuestAddress, E = GuestMemoryError> + ?Sized,
    {
        Ok(write_params(mem, &self.layout, block)?)
    }

    /// The entry state of vCPU `id` ([`vcpu_boot`]).
    pub fn vcpu(&self, id: u32) -> VcpuBoot {
        vcpu_boot(&self.layout, id, self.image.entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory_map::{MAX_MEM_BYTES, MIN_MEM_BYTES, PAGE_SIZE};
    use vm_memory::GuestMemoryMmap;

    /// The page-table entry that maps `va` with 2 MiB pages, walked as the CPU does.
    fn pde(mem: &GuestMemoryMmap, va: u64) -> u64 {
        let addr = |e: u64| e & 0x000f_ffff_ffff_f000;
        let read = |gpa: u64| mem.read_obj::<u64>(GuestAddress(gpa)).unwrap();
        let pml4e = read(PML4_ADDR + 8 * ((va >> 39) & 511));
        let pdpte = read(addr(pml4e) + 8 * ((va >> 30) & 511));
        assert_eq!(
            pml4e & pdpte & (PTE_P | PTE_RW | PTE_US),
            PTE_P | PTE_RW | PTE_US
        );
        read(addr(pdpte) + 8 * ((va >> 21) & 511))
    }

    /// The doorbell's 2 MiB page is mapped (user, writable, uncached) past the largest
    /// guest memory, with its own PD in the VMM's low area, and the RAM mapping below
    /// it is untouched.
    #[test]
    fn the_doorbell_page_is_mapped_uncached_past_the_largest_memory() {
        let layout = GuestMemoryMap {
            mem_bytes: MAX_MEM_BYTES,
            vcpus: 1,
            image: (HUGE_PAGE, 2 * HUGE_PAGE),
            params_gpa: 2 * HUGE_PAGE,
            params_len: PAGE_SIZE,
            results_gpa: 2 * HUGE_PAGE + 128,
            stacks_gpa: 2 * HUGE_PAGE + PAGE_SIZE,
            trace_gpa: 4 * HUGE_PAGE,
            trace_len: HUGE_PAGE,
        };
        // Only the low area (the tables) is needed to walk them.
        let mem =
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), HUGE_PAGE as usize)]).unwrap();
        setup_memory(&mem, &layout).unwrap();
        let bell = pde(&mem, DOORBELL_GPA);
        let want = PTE_P | PTE_RW | PTE_US | PTE_PS | PTE_PWT | PTE_PCD;
        assert_eq!(bell, DOORBELL_GPA | want);
        let last = MAX_MEM_BYTES - HUGE_PAGE;
        assert_eq!(pde(&mem, last), last | PTE_P | PTE_RW | PTE_US | PTE_PS);
        assert_eq!(DOORBELL_PD_ADDR, PD_ADDR + 3 * PAGE_SIZE);
        // Nothing else of the doorbell's GiB is mapped.
        assert_eq!(pde(&mem, DOORBELL_GPA + HUGE_PAGE), 0);
    }

    /// `vcpu_boot` rings by port (rcx 0); `mmio_doorbell` hands over the page.
    #[test]
    fn rcx_is_the_doorbell() {
        let layout = GuestMemoryMap {
            mem_bytes: MIN_MEM_BYTES,
            vcpus: 1,
            image: (HUGE_PAGE, HUGE_PAGE + PAGE_SIZE),
            params_gpa: HUGE_PAGE + PAGE_SIZE,
            params_len: PAGE_SIZE,
            results_gpa: HUGE_PAGE + PAGE_SIZE + 128,
            stacks_gpa: HUGE_PAGE + 2 * PAGE_SIZE,
            trace_gpa: HUGE_PAGE,
            trace_len: HUGE_PAGE,
        };
        let b = vcpu_boot(&layout, 0, HUGE_PAGE);
        assert_eq!(b.rcx, 0);
        assert_eq!(
            b.mmio_doorbell(),
            VcpuBoot {
                rcx: DOORBELL_GPA,
                ..b
            }
        );
    }
}
