//! Embedding hyptrace in a VMM that owns its guest memory.
//!
//! The guest writes one Linux-`buffer_data_page`-compatible ring per vCPU inside guest
//! memory; the VMM allocates the rings there, gives the guest their address, answers the
//! guest's event registration, drains full pages into an output sink while the guest
//! runs, and walks what is left once it stopped. Everything the guest wrote is treated
//! as hostile: errors, never panics, every loop bounded.
//!
//! The loop, with host-run swaps (the VMM swaps reader pages on guest memory; nothing
//! per event exits):
//!
//! 1. `RingGeometry::new(vcpus, pages_per_cpu, page_size, Mode::Stop, false)?
//!    .with_events(DEFAULT_TABLE_SIZE)?` — the rings' shape, with a registration table.
//! 2. Reserve `geometry.region_size` bytes of guest memory for it; wrap them in
//!    [`GuestRegionMem::new`] (any vm-memory `GuestMemoryMmap`) and share it in an `Arc`.
//! 3. [`Tracer::alloc`] writes the pack, control blocks and pages. Give the guest the
//!    region's guest-physical address as docs/abi.md's entry ABI (version 1) says: `rdi`
//!    at entry on every vCPU (another kind of guest: its own boot protocol).
//!    Trap the guest's doorbell writes (a port `out`, or an unbacked MMIO page) and
//!    map them with a [`Doorbell`] ([`PortDoorbell`], [`MmioDoorbell`]) to a [`Ring`].
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
//! Here with a writer on heap memory standing in for the guest (`examples/embed.rs` in
//! the repository is the same loop in a KVM VMM booting the stock guest):
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
//! use hyptrace_embed::{Events, Tracer};
//! use hyptrace_output::{Clock, TraceDatSink, TraceDatVersion};
//!
//! hyptrace_writer::event! {
//!     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
//!         print: "\"n=%u\", REC->n", fields: { n: u32 } }
//! }
//! let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
//! let mem = Arc::new(HeapMem::new(geometry.region_size)); // a VMM: GuestRegionMem
//! let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
//! let mut tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
//! let events = Arc::new(Events::new(mem.clone(), geometry));
//!
//! // The guest (vCPU 0): attach, register (its exit: on_register), write.
//! let mut w = hyptrace_writer::Writer::attach(mem.clone(), 0)?;
//! hyptrace_writer::events::register(&*mem, &[Tick::event()], || {
//!     events.on_register(0);
//! })?;
//! for n in 0..100 { Tick::emit_at(&mut w, 1000 + u64::from(n), n); }
//! w.finish();
//!
//! let formats = events.wait(Duration::from_secs(10))?.formats;
//! let dir = tempfile::tempdir()?;
//! let meta = tracer.trace_meta(Clock::guest_tsc(1_000_000)?, formats);
//! let mut sink = TraceDatSink::create(dir.path().join("t.dat"), meta, TraceDatVersion::V7)?;
//! tracer.drain(&mut sink)?; // every poll period while the vCPUs run
//! let accounts = tracer.finish(Box::new(sink))?;
//! assert_eq!((accounts[0].written, accounts[0].stats.read, accounts[0].stats.lost), (100, 100, 0));
//! assert!(accounts[0].consistent());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod doorbell;
mod drain;
mod events;
mod mem;
mod select;

pub use doorbell::{Access, Doorbell, MmioDoorbell, PortDoorbell, Ring};
pub use drain::{
    attempts_consistent, drain_pages, kernel_cpu_stat, written, CpuAccount, DrainError, Tracer,
    ROUND_MAX_BYTES, ROUND_MAX_TIME,
};
pub use events::{
    to_format, Events, Exit, LateRegistration, RegisterError, Registered, Settled, ANSWER_HOLD_MAX,
    MAX_EARLY_EXITS,
};
pub use mem::{GuestRegionMem, RegionError};
pub use select::{matches, EventInfo, EventsError, Selection};
