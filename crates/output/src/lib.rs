//! hyptrace output: sinks for exported ring pages (trace.dat v6/v7 (zstd), Chrome
//! trace-event JSON, native Perfetto protobuf, text, raw page streams), a trace.dat reader, and the `trace-cmd report -t`
//! compatible text formatter shared by `run`, `report` and the text sink.

mod clock;
mod error;
mod export;
pub mod format;
pub mod merge;
pub mod perfetto;
mod plugins;
pub mod printfmt;
mod sink;
mod sinks;
pub mod symbols;
mod target;
pub mod text;
mod threaded;
pub mod tracedat;

pub use clock::{Clock, TscConversion};
pub use error::OutputError;
pub use export::{
    check_page_size, commit_len, export_page, export_page_into, page_missed, Missed, MAX_PAGE_SIZE,
    MIN_PAGE_SIZE,
};
pub use format::{
    common_fields, guest_formats, trailing_lost_format, EventFormat, Field, HYPTRACE_SYSTEM,
    TRAILING_LOST_NAME,
};
pub use merge::{MergeWindow, Merged, Merger, Released};
pub use perfetto::PerfettoSink;
pub use printfmt::{Program, Unsupported};
/// The old name of [`KernelCpuStat`], kept only until the host uses the new one.
#[doc(hidden)]
pub use sink::KernelCpuStat as CpuStats;
pub use sink::{KernelCpuStat, OutputWaits, PageSink, RunSummary, TraceMeta};
pub use sinks::{
    is_raw_stream, JsonSink, RawReader, RawSink, RawTrace, TextSink, JSON_MAX_SAFE_INTEGER,
    JSON_PID, RAW_MAGIC, RAW_MAGIC_V1,
};
pub use symbols::KernelSymbols;
pub use target::{OutputFile, OutputTarget, TargetKind};
pub use text::{
    escape_guest_bytes, escape_guest_str, escaped_guest_bytes, format_drop, format_event,
    format_guest_line, format_window_exceeded, guest_printers, EventPrinter,
};
pub use threaded::ThreadedSink;
pub use tracedat::{
    write_trace_dat, write_trace_dat_with, Compression, ReportFilter, TraceDatSink,
    TraceDatVersion, TraceFile, TraceItem, TraceRecord,
};
