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
//!
//! ```
//! use hyptrace_abi::page::{decode_record, encode_data_header, Events, Record};
//! use hyptrace_abi::{events, Mode, RingGeometry};
//!
//! // The trace region of 2 CPUs, 8 pages of 4 KiB each (reader page included).
//! let l = RingGeometry::new(2, 8, 4096, Mode::Overwrite, false)?;
//! assert!(l.page_off(l.first_page(1)) + 4096 <= l.region_size);
//!
//! // One Linux ring-buffer event: header word, then the payload (a `marker`).
//! let payload = events::marker(events::vcpu_pid(0), 7, 42);
//! let mut data = vec![0u8; 64];
//! let mut hdr = [0u8; 8];
//! let n = encode_data_header(&mut hdr, payload.len(), 5);
//! data[..n].copy_from_slice(&hdr[..n]);
//! data[n..n + payload.len()].copy_from_slice(&payload);
//! let end = n + payload.len();
//! let (rec, next) = decode_record(&data[..end], 0).unwrap().unwrap();
//! assert!(matches!(rec, Record::Data { delta: 5, .. }) && next == end);
//! let ev = Events::new(&data[..end], 1000).next().unwrap().unwrap();
//! assert_eq!((ev.ts, &ev.payload[..payload.len()]), (1005, &payload[..]));
//! # Ok::<(), hyptrace_abi::LayoutError>(())
//! ```
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

/// The README's code blocks, run as doc tests (README and crate docs cannot drift).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
