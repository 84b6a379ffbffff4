//! hyptrace's stock guest payload and how to boot it, for any VMM.
//!
//! [`GUEST_ELF`] is the no_std guest built from `guest/` by this crate's build script
//! (the one build of it: the `hyptrace` VMM embeds it from here). [`Boot`] is its boot
//! recipe as plain data: the ELF's segments, page tables and GDT written into any
//! vm-memory guest memory, the run parameter block, and each vCPU's initial registers
//! and segments as plain numbers ([`boot::VcpuBoot`]) for the VMM to hand to its
//! hypervisor. [`exits`] decodes the port writes the guest makes. Nothing here knows
//! KVM; `examples/embed.rs` shows a KVM VMM using it.
//!
//! Contract details (entry registers, the run parameter block, result slots, ports):
//! `hyptrace_abi::guest` and docs/abi.md.
//!
//! This crate is `publish = false`: its build script needs the repository's `guest/`
//! workspace (`../../guest`), so it builds only inside the hyptrace repository. An
//! embedder tracing its own guest does not need it — the guest links `hyptrace-writer`
//! (or the C SDK) and the VMM uses `hyptrace-embed` and `hyptrace-output`; to boot the
//! stock guest, depend on this crate by path or git (README.md, "Why it is not
//! published").

pub mod boot;
pub mod cpuid;
pub mod elf;
pub mod exits;
pub mod memory_map;

pub use boot::{Boot, BootError, VcpuBoot};
pub use elf::{ElfError, GuestImage};
pub use memory_map::{GuestMemoryMap, MemoryMapError};

/// The stock guest payload (a static x86-64 ELF executable) built from `guest/`.
///
/// ```
/// let image = hyptrace_payload::GuestImage::parse(hyptrace_payload::GUEST_ELF)?;
/// assert!(image.entry >= image.start && image.entry < image.end);
/// # Ok::<(), hyptrace_payload::ElfError>(())
/// ```
pub static GUEST_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/hyptrace-guest.elf"));

/// The README's code blocks, run as doc tests (README and crate docs cannot drift).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
