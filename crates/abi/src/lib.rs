//! hyptrace shared-memory ABI (placeholder while the core lands).
#![no_std]
pub mod events;
pub mod guest;
pub mod page;
