//! The VMM: the KVM virtual machine and its vCPU threads, the guest's memory map and
//! ELF image, the x86 CPL3 set-up, the guest trace memory, the event registration the
//! guest asks for, and the VMM's own events. The lowest layer of host/: it imports no
//! other folder of this crate (docs/design.md, "Where things are").

pub mod arch;
pub mod elf;
pub mod error;
pub mod guest_mem;
pub mod host_events;
pub mod memory_map;
mod overlap;
pub mod registration;
pub mod time;
pub mod vcpu;
pub mod vm;
