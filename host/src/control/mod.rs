//! The control protocol: the typed wire messages, the socket server and its client,
//! and the consumers' claims on the rings (C1–C4 in docs/design.md). Imports the drain
//! and VMM layers.

pub mod consumer;
pub mod protocol;
pub mod server;
