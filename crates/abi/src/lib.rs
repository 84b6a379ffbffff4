//! hyptrace shared-memory ABI: what the guest writer and the host reader agree on.
//!
//! - [`page`]: Linux `buffer_data_page` and ring-buffer event encoding (byte-compatible,
//!   so pages copied into a trace.dat are read by trace-cmd);
//! - [`layout`]: the trace region (pack header, per-CPU descriptors, control blocks,
//!   pages with footers) and its validation;
//! - [`mem`]: the memory-access trait both sides use, over raw memory or safe words;
//! - [`events`]: the built-in guest events; [`registry`]: the event-registration table; [`guest`]: the VMM ⇄ guest contract
//!   (the run-parameter block as one `#[repr(C)]` zerocopy struct, [`guest::RunParamBlock`]).
//!
//! `docs/abi.md` describes every structure; `docs/design.md` the protocol.
#![no_std]
#![warn(missing_docs)]

#[cfg(feature = "alloc")]
extern crate alloc;

pub mod events;
pub mod guest;
pub mod layout;
pub mod mem;
pub mod page;
pub mod registry;

pub use layout::{LayoutError, Mode, RingGeometry};
#[cfg(feature = "alloc")]
pub use mem::{HeapMem, WordMem};
pub use mem::{RawMem, SharedMem};
