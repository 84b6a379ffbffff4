//! x86-64 long-mode set-up: identity page tables, GDT, TSS and the vCPU registers for a
//! CPL3 entry (see [`crate::vmm::memory_map`] and the bring-up notes: under PVM guest
//! code at CPL0 is emulated, so the payload runs in user mode).

use hyptrace_payload::boot::{self, Segment};
use hyptrace_payload::cpuid;
use kvm_bindings::{kvm_cpuid_entry2, kvm_fpu, kvm_regs, kvm_segment, CpuId};
use kvm_ioctls::VcpuFd;
use vm_memory::{GuestMemoryError, GuestMemoryMmap};

use crate::vmm::memory_map::GuestMemoryMap;

pub use hyptrace_payload::boot::{RFLAGS, USER_CS, USER_DS};

/// Writes the GDT, the TSS and the identity page tables for `[0, layout.mem_bytes)`
/// (`hyptrace_payload::boot::setup_memory`).
pub fn setup_memory(
    mem: &GuestMemoryMmap,
    layout: &GuestMemoryMap,
) -> Result<(), GuestMemoryError> {
    boot::setup_memory(mem, layout)
}

fn segment(s: Segment) -> kvm_segment {
    kvm_segment {
        base: s.base,
        limit: s.limit,
        selector: s.selector,
        type_: s.type_,
        present: s.present,
        dpl: s.dpl,
        db: s.db,
        s: s.s,
        l: s.l,
        g: s.g,
        ..Default::default()
    }
}

/// The CPUID table of vCPU `id`: what the guest's environment provides
/// (`hyptrace_payload::cpuid`), not the host's whole supported table, whose query
/// (`KVM_GET_SUPPORTED_CPUID`) took ~0.45 ms of the start-up under a nested hypervisor.
fn guest_cpuid(id: u32) -> CpuId {
    let entries = cpuid::guest_cpuid(id, cpuid::host_cpuid).map(|l| kvm_cpuid_entry2 {
        function: l.function,
        eax: l.eax,
        ebx: l.ebx,
        ecx: l.ecx,
        edx: l.edx,
        ..Default::default()
    });
    CpuId::from_entries(&entries).expect("five entries are far below KVM_MAX_CPUID_ENTRIES")
}

/// Sets up vCPU `id` to start at `entry` in 64-bit user mode, in the state
/// `hyptrace_payload::boot::vcpu_boot` gives (the registers of the contract,
/// `hyptrace_abi::guest`: rdi = trace region (pack) GPA, rsi = vCPU id, rdx = RunParams
/// GPA, rcx = `doorbell`: 0 or the MMIO doorbell page (`DoorbellKind::entry_rcx`), rsp =
/// top of its stack, GS base = its result slot).
pub fn setup_vcpu(
    vcpu: &VcpuFd,
    id: u32,
    layout: &GuestMemoryMap,
    entry: u64,
    doorbell: u64,
) -> Result<(), kvm_ioctls::Error> {
    vcpu.set_cpuid2(&guest_cpuid(id))?;
    let b = boot::VcpuBoot {
        rcx: doorbell,
        ..boot::vcpu_boot(layout, id, entry)
    };
    let mut sregs = vcpu.get_sregs()?;
    (sregs.cs, sregs.ds, sregs.es) = (segment(b.cs), segment(b.ds), segment(b.es));
    (sregs.fs, sregs.gs, sregs.ss) = (segment(b.fs), segment(b.gs), segment(b.ss));
    sregs.tr = segment(b.tr);
    (sregs.gdt.base, sregs.gdt.limit) = (b.gdt.base, b.gdt.limit);
    // No IDT: any exception triple-faults, which the VMM sees as KVM_EXIT_SHUTDOWN.
    (sregs.idt.base, sregs.idt.limit) = (b.idt.base, b.idt.limit);
    (sregs.cr0, sregs.cr3, sregs.cr4, sregs.efer) = (b.cr0, b.cr3, b.cr4, b.efer);
    vcpu.set_sregs(&sregs)?;
    vcpu.set_fpu(&kvm_fpu {
        fcw: b.fcw,
        mxcsr: b.mxcsr,
        ..Default::default()
    })?;
    vcpu.set_regs(&kvm_regs {
        rip: b.rip,
        rsp: b.rsp,
        rdi: b.rdi,
        rsi: b.rsi,
        rdx: b.rdx,
        rcx: b.rcx,
        rflags: b.rflags,
        ..Default::default()
    })
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
