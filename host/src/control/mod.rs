//! The control protocol: the typed wire messages, the socket server and its client, the
//! commands the run loop executes, and the subscriber's claim (C1–C4 in docs/design.md).
//! Imports the drain and VMM layers.

pub mod consumer;
pub mod handler;
pub mod protocol;
pub mod server;
