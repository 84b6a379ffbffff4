//! The guest payload's ELF64 image: parsed and checked by `hyptrace_payload::elf` (the
//! one loader, shared with any VMM that embeds the payload).

pub use hyptrace_payload::elf::*;
