//! hyptrace output: sinks for exported ring pages (trace.dat v6/v7, Chrome trace-event
//! JSON, text, raw page streams), a trace.dat reader, and the `trace-cmd report -t`
//! compatible text formatter shared by `run`, `report` and the text sink.

mod clock;
mod error;
mod export;
pub mod format;
pub mod merge;
mod plugins;
pub mod printfmt;
mod sink;
mod sinks;
pub mod symbols;
mod target;
pub mod text;
pub mod tracedat;

pub use clock::{Clock, TscConversion};
pub use error::OutputError;
pub use export::{
    check_page_size, commit_len, export_page, export_page_into, page_missed, Missed, MAX_PAGE_SIZE,
    MIN_PAGE_SIZE,
};
pub use format::{
    guest_formats, trailing_lost_format, EventFormat, Field, HYPTRACE_SYSTEM, TRAILING_LOST_NAME,
};
pub use merge::{MergeWindow, Merged, Merger, Released};
pub use printfmt::{Program, Unsupported};
/// The old name of [`KernelCpuStat`], kept only until the host uses the new one.
#[doc(hidden)]
pub use sink::KernelCpuStat as CpuStats;
pub use sink::{KernelCpuStat, PageSink, RunSummary, TraceMeta};
pub use sinks::{JsonSink, RawSink, RawTrace, TextSink, JSON_PID, RAW_MAGIC};
pub use symbols::KernelSymbols;
pub use target::{OutputFile, OutputTarget, TargetKind};
pub use text::{
    escape_guest_bytes, escape_guest_str, escaped_guest_bytes, format_drop, format_event,
    format_guest_line, format_window_exceeded, guest_printers, EventPrinter,
};
pub use tracedat::{
    write_trace_dat, TraceDatSink, TraceDatVersion, TraceFile, TraceItem, TraceRecord,
};
