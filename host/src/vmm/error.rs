//! Errors of the VMM.

use thiserror::Error;

use crate::vmm::elf::ElfError;
use crate::vmm::memory_map::MemoryMapError;

/// Errors creating or starting a VM.
#[derive(Debug, Error)]
pub enum Error {
    /// The configuration does not fit guest memory.
    #[error(transparent)]
    MemoryMap(#[from] MemoryMapError),
    /// The guest image is not a loadable ELF.
    #[error("bad guest image")]
    Elf(#[from] ElfError),
    /// The guest image lies (partly) outside guest memory.
    #[error(
        "guest image [{start:#x}, {end:#x}) does not fit in guest memory ({mem_bytes:#x} bytes)"
    )]
    ImageOutsideMemory {
        /// Image start.
        start: u64,
        /// Image end.
        end: u64,
        /// Guest memory size.
        mem_bytes: u64,
    },
    /// `/dev/kvm` cannot be opened (missing, or no permission).
    #[error("cannot open the KVM device {path}{}", kvm_hint(.source.as_ref()))]
    KvmUnavailable {
        /// The device's path.
        path: String,
        /// The OS error (`None`: the path has a NUL byte).
        #[source]
        source: Option<vmm_sys_util::errno::Error>,
    },
    /// More vCPUs than KVM allows.
    #[error("too many vCPUs: {want} requested, KVM allows {max}")]
    TooManyVcpus {
        /// Requested.
        want: u32,
        /// KVM's limit.
        max: u32,
    },
    /// A KVM ioctl failed.
    #[error("{what}")]
    Kvm {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be mapped.
    #[error("guest memory")]
    MemoryMmap(#[source] vm_memory::mmap::FromRangesError),
    /// Guest memory could not be read or written (tables, image, run parameters).
    #[error("guest memory")]
    Memory(#[from] vm_memory::GuestMemoryError),
    /// The signal that kicks vCPU threads out of `KVM_RUN` could not be installed.
    #[error("cannot install the vCPU kick signal handler")]
    KickSignal(#[source] vmm_sys_util::errno::Error),
    /// A vCPU thread could not be started.
    #[error("cannot start the thread of vCPU {id}")]
    VcpuThread {
        /// The vCPU.
        id: u32,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Whether the error comes from the user's input or environment (bad configuration,
    /// bad guest image, no usable /dev/kvm) rather than a failure at run time.
    pub fn is_input_error(&self) -> bool {
        matches!(
            self,
            Self::MemoryMap(_)
                | Self::Elf(_)
                | Self::ImageOutsideMemory { .. }
                | Self::KvmUnavailable { .. }
                | Self::TooManyVcpus { .. }
        )
    }

    pub(crate) fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Self {
        move |source| Self::Kvm { what, source }
    }
}

impl From<hyptrace_payload::BootError> for Error {
    fn from(e: hyptrace_payload::BootError) -> Self {
        match e {
            hyptrace_payload::BootError::Elf(e) => Self::Elf(e),
            hyptrace_payload::BootError::MemoryMap(e) => Self::MemoryMap(e),
            hyptrace_payload::BootError::Memory(e) => Self::Memory(e),
        }
    }
}

/// Result of the VMM's operations.
pub type Result<T> = std::result::Result<T, Error>;

/// What a failed open of the KVM device means for the user.
fn kvm_hint(e: Option<&vmm_sys_util::errno::Error>) -> &'static str {
    match e.map(|e| e.errno()) {
        None => ": the path has a NUL byte",
        Some(libc::ENOENT | libc::ENODEV | libc::ENXIO) => " (not available)",
        Some(libc::EACCES | libc::EPERM) => " (need read/write access)",
        Some(_) => "",
    }
}
