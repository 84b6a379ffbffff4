//! hyptrace-host: the VMM that boots the hyptrace guest payload on KVM (one thread per
//! vCPU, guest at CPL3) and the `hyptrace` command line.
//!
//! ```no_run
//! use hyptrace_host::{DoorbellKind, RunParams, Vm, VmConfig, GUEST_ELF};
//! let vm = Vm::new(VmConfig {
//!     vcpus: 2,
//!     mem_bytes: 64 << 20,
//!     guest_elf: GUEST_ELF.into(),
//!     trace_region_bytes: 4 << 20,
//!     trace_region_align: 4096,
//!     doorbell: DoorbellKind::Port, // or Mmio (`--doorbell mmio`)
//! })?;
//! let region = vm.trace_region(); // hand to the ring-buffer reader before start
//! let running = vm.start(&RunParams { events: 1000, ..Default::default() })?;
//! while !running.wait_timeout(std::time::Duration::from_millis(1)) { /* poll region */ }
//! let outcomes = running.wait();
//! # Ok::<(), hyptrace_host::Error>(())
//! ```

#[macro_use]
pub mod exit;

pub mod bench;
pub mod cli;
pub mod control;
pub mod drain;
pub mod flight;
pub mod pipeline;
pub mod vmm;

pub use vmm::error::{Error, Result};
pub use vmm::guest_mem::TraceRegion;
pub use vmm::memory_map::GuestMemoryMap;
pub use vmm::time::host_tsc;
pub use vmm::vcpu::{VcpuError, VcpuOutcome, VcpuStats};
pub use vmm::vm::{DoorbellKind, RunParams, RunningVm, Vm, VmConfig};

/// The guest payload built from guest/ (by the `hyptrace-payload` crate's build script).
pub use hyptrace_payload::GUEST_ELF;
