//! x86-64 long-mode set-up: identity page tables, GDT, TSS and the vCPU registers for a
//! CPL3 entry (see `docs` of [`crate::layout`] and the bring-up notes: under PVM guest
//! code at CPL0 is emulated, so the payload runs in user mode).

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, CpuId};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryError, GuestMemoryMmap};

use crate::vmm::memory_map::{
    GuestMemoryMap, GDT_ADDR, HUGE_PAGE, PDPT_ADDR, PD_ADDR, PML4_ADDR, TSS_ADDR,
};

/// GDT: null, kernel code, kernel data, TSS (two slots), user code, user data.
const GDT: [u64; 5] = [
    0,
    0x00af_9b00_0000_ffff, // 0x08 kernel code, L=1
    0x00cf_9300_0000_ffff, // 0x10 kernel data
    0,                     // 0x18 TSS (filled in)
    0,
];
const GDT_USER: [u64; 2] = [
    0x00af_fb00_0000_ffff, // 0x28 user code, L=1, DPL3
    0x00cf_f300_0000_ffff, // 0x30 user data, DPL3
];
const GDT_ENTRIES: u64 = 7;
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

/// Writes the GDT, the TSS and the identity page tables for `[0, layout.mem_bytes)`.
pub fn setup_memory(
    mem: &GuestMemoryMmap,
    layout: &GuestMemoryMap,
) -> Result<(), GuestMemoryError> {
    // GDT with the 16-byte TSS descriptor (type 0xb: busy 64-bit TSS, present, DPL0).
    let tss_lo = (TSS_LIMIT & 0xffff)
        | ((TSS_ADDR & 0xff_ffff) << 16)
        | (0x8b << 40)
        | (((TSS_LIMIT >> 16) & 0xf) << 48)
        | (((TSS_ADDR >> 24) & 0xff) << 56);
    let tss_hi = TSS_ADDR >> 32;
    let mut gdt = GDT.to_vec();
    gdt[3] = tss_lo;
    gdt[4] = tss_hi;
    gdt.extend_from_slice(&GDT_USER);
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(GDT_ADDR + 8 * i as u64))?;
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
    Ok(())
}

fn segment(selector: u16, type_: u8, dpl: u8, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        ..Default::default()
    }
}

/// Sets up vCPU `id` to start at `entry` in 64-bit user mode, with the registers of
/// the contract (`hyptrace_abi::guest`): rdi = trace region (pack) GPA, rsi = vCPU id,
/// rdx = RunParams GPA, rsp = top of its stack. GS base = its result slot.
pub fn setup_vcpu(
    vcpu: &VcpuFd,
    cpuid: &CpuId,
    id: u32,
    layout: &GuestMemoryMap,
    entry: u64,
) -> Result<(), kvm_ioctls::Error> {
    vcpu.set_cpuid2(cpuid)?;

    let mut sregs = vcpu.get_sregs()?;
    let code = segment(USER_CS, 0xb, 3, true);
    let data = segment(USER_DS, 0x3, 3, false);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.ss = data;
    sregs.gs = kvm_segment {
        base: layout.result_slot(id),
        ..data
    };
    sregs.tr = kvm_segment {
        base: TSS_ADDR,
        limit: TSS_LIMIT as u32,
        selector: TSS_SELECTOR,
        type_: 0xb,
        present: 1,
        dpl: 0,
        db: 0,
        s: 0,
        l: 0,
        g: 0,
        ..Default::default()
    };
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (GDT_ENTRIES * 8 - 1) as u16;
    // No IDT: any exception triple-faults, which the VMM sees as KVM_EXIT_SHUTDOWN.
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT;
    sregs.efer = EFER_LME | EFER_LMA;
    vcpu.set_sregs(&sregs)?;

    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu)?;

    let regs = kvm_regs {
        rip: entry,
        rsp: layout.stack_top(id),
        rdi: layout.trace_gpa,
        rsi: u64::from(id),
        rdx: layout.params_gpa,
        rflags: RFLAGS,
        ..Default::default()
    };
    vcpu.set_regs(&regs)
}

/// The vCPU TSC offset (`KVM_{GET,SET}_DEVICE_ATTR`, group `KVM_VCPU_TSC_CTRL`, attr
/// `KVM_VCPU_TSC_OFFSET`): guest TSC = host TSC + offset. kvm-ioctls has no x86 wrapper.
mod tsc_ioctl {
    vmm_sys_util::ioctl_iow_nr!(
        KVM_SET_DEVICE_ATTR,
        0xAE,
        0xe1,
        kvm_bindings::kvm_device_attr
    );
    vmm_sys_util::ioctl_iow_nr!(
        KVM_GET_DEVICE_ATTR,
        0xAE,
        0xe2,
        kvm_bindings::kvm_device_attr
    );
}

fn tsc_offset_ioctl(vcpu: &VcpuFd, set: bool, value: &mut i64) -> std::io::Result<()> {
    let attr = kvm_bindings::kvm_device_attr {
        flags: 0,
        group: kvm_bindings::KVM_VCPU_TSC_CTRL,
        attr: u64::from(kvm_bindings::KVM_VCPU_TSC_OFFSET),
        addr: value as *mut i64 as u64,
    };
    let nr = if set {
        tsc_ioctl::KVM_SET_DEVICE_ATTR()
    } else {
        tsc_ioctl::KVM_GET_DEVICE_ATTR()
    };
    // SAFETY: a device-attribute ioctl on a vCPU fd with a valid `kvm_device_attr` whose
    // `addr` points to an i64 that lives across the call (the kernel reads or writes
    // exactly 8 bytes there); the return value is checked.
    let ret = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(vcpu, nr, &attr) };
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Reads the vCPU's TSC offset (guest TSC − host TSC); `Err` on kernels without it.
pub fn tsc_offset(vcpu: &VcpuFd) -> std::io::Result<i64> {
    let mut v = 0;
    tsc_offset_ioctl(vcpu, false, &mut v)?;
    Ok(v)
}

/// Sets the vCPU's TSC offset (0 makes guest and host TSCs equal on hardware KVM; PVM
/// ignores it and runs with 0 anyway).
pub fn set_tsc_offset(vcpu: &VcpuFd, offset: i64) -> std::io::Result<()> {
    let mut v = offset;
    tsc_offset_ioctl(vcpu, true, &mut v)
}
