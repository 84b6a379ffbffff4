//! The flight recorder: the trace-memory file one VMM owns (F1–F6), the post-mortem
//! dump of it, the live attach to a running VMM's rings, and `collect` of several VMMs. Imports the control,
//! drain and VMM layers.

pub mod attach;
pub mod collect;
pub mod dump;
#[cfg(test)]
mod flight_model;
pub mod trace_mem;
