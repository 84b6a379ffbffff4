//! hyptrace's event formats, with no I/O and no compression: what the reader needs to
//! check a guest's registration and what every output prints with.
//!
//! - [`format`](mod@format): one event's `format` file ([`EventFormat`], [`Field`]): the built-in
//!   guest events, the text the kernel prints in `events/<system>/<event>/format`, its
//!   parsing, `header_page`, the `[SYSTEM:]EVENT` glob;
//! - [`printfmt`]: the `print fmt:` language, compiled once per event into a
//!   [`Program`] and run per event, and [`check_guest_format`], the subset of it a guest
//!   may register (docs/abi.md, "Print formats a guest may register");
//! - [`symbols`]: the kernel symbols of a trace (`%pS`, `%s` of printk formats);
//! - [`escape_guest_bytes`] and its kin: guest bytes made safe for one line of text.
//!
//! `hyptrace-reader` checks registrations with it; `hyptrace-output` re-exports it
//! (`hyptrace_output::format`, `printfmt`, `symbols`) and prints with it.
//!
//! ```
//! use hyptrace_format::{check_guest_format, guest_formats, EventFormat, KernelSymbols, Program};
//!
//! let marker = guest_formats().remove(0);
//! check_guest_format(&marker)?; // the built-ins are in the guest subset
//! let text = marker.to_format_text();
//! assert_eq!(EventFormat::parse("guest", &text)?, marker);
//!
//! let p = Program::compile(&marker, &marker.print_fmt, 8)?;
//! let mut payload = [0u8; 24];
//! payload[8..16].copy_from_slice(&7u64.to_le_bytes()); // seq
//! payload[16..24].copy_from_slice(&42u64.to_le_bytes()); // value
//! let mut line = String::new();
//! p.run(&mut line, &payload, &KernelSymbols::new()).expect("fields in the payload");
//! assert_eq!(line, "seq=7 value=42");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod escape;
pub mod format;
pub mod printfmt;
pub mod symbols;

pub use error::FormatError;
pub use escape::{escape_guest_bytes, escape_guest_str, escaped_guest_bytes, must_escape};
pub use format::{
    common_fields, guest_formats, trailing_lost_format, EventFormat, Field, HeaderPage,
    HYPTRACE_SYSTEM, TRAILING_LOST_NAME,
};
pub use printfmt::{check_guest_format, GuestFormatError, Program, Unsupported};
pub use symbols::KernelSymbols;

/// The README's code blocks, run as doc tests (README and crate docs cannot drift).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
