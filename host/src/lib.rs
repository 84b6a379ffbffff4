//! hyptrace-host: the VMM that boots the hyptrace guest payload on KVM (one thread per
//! vCPU, guest at CPL3) and the `hyptrace` command line.
//!
//! ```no_run
//! use hyptrace_host::{RunParams, Vm, VmConfig, GUEST_ELF};
//! let vm = Vm::new(VmConfig {
//!     vcpus: 2,
//!     mem_bytes: 64 << 20,
//!     guest_elf: GUEST_ELF.into(),
//!     trace_region_bytes: 4 << 20,
//!     trace_region_align: 4096,
//! })?;
//! let region = vm.trace_region(); // hand to the ring-buffer reader before start
//! let running = vm.start(&RunParams { events: 1000, ..Default::default() })?;
//! while !running.wait_timeout(std::time::Duration::from_millis(1)) { /* poll region */ }
//! let outcomes = running.wait();
//! # Ok::<(), hyptrace_host::Error>(())
//! ```

pub mod arch;
pub mod attach;
pub mod bench;
pub mod cli;
pub mod clock;
pub mod consumer;
pub mod control;
pub mod convert;
pub mod dump;
pub mod elf;
pub mod error;
pub mod events;
#[cfg(test)]
mod flight_model;
pub mod host_events;
pub mod logging;
pub mod memory_map;
pub mod plan;
pub mod protocol;
pub mod report;
pub mod run;
pub mod session;
pub mod signals;
pub mod standby;
pub mod trace_mem;
pub mod vcpu;
pub mod vm;

pub use error::{Error, Result};
pub use memory_map::GuestMemoryMap;
pub use vcpu::{VcpuError, VcpuOutcome, VcpuStats};
pub use vm::{host_tsc, RunParams, RunningVm, TraceRegion, Vm, VmConfig};

/// The guest payload built from guest/ (by the `hyptrace-payload` crate's build script).
pub use hyptrace_payload::GUEST_ELF;
