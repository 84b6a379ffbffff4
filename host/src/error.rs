//! Errors of the VMM.

use thiserror::Error;

use crate::elf::ElfError;
use crate::memory_map::MemoryMapError;

/// Errors creating or starting a VM.
#[derive(Debug, Error)]
pub enum Error {
    /// The configuration does not fit guest memory.
    #[error(transparent)]
    MemoryMap(#[from] MemoryMapError),
    /// The guest image is not a loadable ELF.
    #[error("bad guest image: {0}")]
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
    #[error("cannot open the KVM device {0}")]
    KvmUnavailable(String),
    /// More vCPUs than KVM allows.
    #[error("too many vCPUs: {want} requested, KVM allows {max}")]
    TooManyVcpus {
        /// Requested.
        want: u32,
        /// KVM's limit.
        max: u32,
    },
    /// A KVM ioctl failed.
    #[error("{what}: {source}")]
    Kvm {
        /// What was being done.
        what: &'static str,
        /// The error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be created or written.
    #[error("guest memory: {0}")]
    Memory(String),
    /// A vCPU thread could not be started, or the kick signal installed.
    #[error("{0}")]
    Host(String),
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
                | Self::KvmUnavailable(_)
                | Self::TooManyVcpus { .. }
        )
    }

    pub(crate) fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Self {
        move |source| Self::Kvm { what, source }
    }
}

/// Result of the VMM's operations.
pub type Result<T> = std::result::Result<T, Error>;
