#![doc = include_str!("../README.md")]
//!
//! ## The loop
//!
//! With host-run swaps (the VMM swaps reader pages on guest memory; nothing
//! per event exits):
//!
//! 1. `RingGeometry::new(vcpus, pages_per_cpu, page_size, Mode::Stop, false)?
//!    .with_events(DEFAULT_TABLE_SIZE)?` — the rings' shape, with a registration table.
//! 2. Reserve `geometry.region_size` bytes of guest memory for it; wrap them in
//!    [`GuestRegionMem::new`] (any vm-memory `GuestMemoryMmap`) and share it in an `Arc`.
//! 3. [`Tracer::alloc`] writes the pack, control blocks and pages. Give the guest the
//!    region's guest-physical address as docs/abi.md's entry ABI (version 2) says: `rdi`
//!    at entry on every vCPU (another kind of guest: its own boot protocol), and in
//!    `rcx` the doorbell: 0 (ports) or the address of an MMIO page your page tables map
//!    and no memory slot backs. Trap the guest's doorbell writes (a port `out`, or a
//!    store to that page) and map them with the [`Doorbell`] you handed over
//!    ([`PortDoorbell`], [`MmioDoorbell`]) to a [`Ring`].
//! 4. [`Events::new`] on the same memory: its [`Events::on_register`] answers the guest's
//!    registration ([`Ring::Register`]) on the vCPU thread (before resuming the vCPU). It is the one
//!    registration state machine: the `hyptrace` binary runs it too.
//! 5. Start the vCPUs. [`Events::wait`] returns the registered formats; open a sink with
//!    [`Tracer::trace_meta`] (e.g. `hyptrace_output::TraceDatSink`, `PerfettoSink`). A
//!    registration exit after the wait ended without one is refused and kept
//!    ([`Events::late_registration`]): fail the run naming it (invariant L1: the output
//!    has the formats of every event let into the rings).
//! 6. While vCPUs run: [`Tracer::drain`], then sleep a poll period (1–5 ms; sooner when
//!    it returns `true`).
//! 7. Once every vCPU stopped: [`Tracer::finish`] — the final walks, losses, the sink's
//!    end — returns one [`CpuAccount`] per CPU, with `written = read + lost`.
//!
//! A VMM with outputs of its own (text lines, subscribers) builds on [`CpuReads`]
//! instead, the per-CPU read state and final walk `Tracer` is made of: the `hyptrace`
//! binary's session does, so both read, walk and account the same way.
//!
//! ## The documentation of each item
//!
//! In the manner of kvm-ioctls: every public function and method has an `# Examples`
//! section (each one runs as a doc test; the KVM side is in `examples/embed.rs`), and
//! each one that returns a `Result` an `# Errors` section (clippy's
//! `missing_errors_doc` is denied here). No public function is `unsafe`, so none needs
//! a `# Safety` section; [`GuestRegionMem::new`] says why wrapping guest memory is safe.

#![deny(clippy::missing_errors_doc)]

mod doorbell;
mod drain;
mod events;
mod mem;
mod reads;
mod select;
mod tracer;

pub use doorbell::{Access, Doorbell, MmioDoorbell, PortDoorbell, Ring};
pub use drain::{
    attempts_consistent, drain_pages, kernel_cpu_stat, written, DrainError, ROUND_MAX_BYTES,
    ROUND_MAX_TIME,
};
pub use events::{
    to_format, Events, Exit, LateRegistration, RegisterError, Registered, Settled, ANSWER_HOLD_MAX,
    MAX_EARLY_EXITS,
};
pub use mem::{GuestRegionMem, RegionError};
pub use reads::{run_summary, CpuAccount, CpuReads, Phase};
pub use select::{matches, EventInfo, EventsError, Selection};
pub use tracer::Tracer;
