//! The streaming sinks, one file per family: text (`trace-cmd report -t` lines), Chrome
//! trace-event JSON, raw page streams (`--format raw`, with their reader) and native
//! Perfetto; what they share (the output, the constructors of [`StreamSink`], page
//! decoding) is in `stream`, the merged sinks' release path in `merged`. The trace.dat
//! sink is `crate::tracedat`'s.

mod json;
mod merged;
pub mod perfetto;
mod raw;
mod stream;
mod text;

pub use json::{JsonSink, JSON_MAX_SAFE_INTEGER};
pub use raw::{is_raw_stream, RawReader, RawSink, RawTrace, RAW_MAGIC, RAW_MAGIC_V1};
pub use stream::{page_events, PageEvents, StreamOut, StreamSink, JSON_PID};
pub use text::TextSink;
