//! The guest-physical memory map: `hyptrace_payload::memory_map` (the one layout, shared
//! with any VMM that embeds the payload).

pub use hyptrace_payload::memory_map::*;
