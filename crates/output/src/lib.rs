//! hyptrace output: sinks for exported ring pages (trace.dat v6/v7 (zstd), Chrome
//! trace-event JSON, native Perfetto protobuf, text, raw page streams), a trace.dat reader, and the `trace-cmd report -t`
//! compatible text formatter shared by `run`, `report` and the text sink.
//!
//! A [`PageSink`] takes ring pages as the reader hands them out (`hyptrace-reader`'s
//! `next_page`; `hyptrace-embed` runs that loop for a VMM); [`TraceFile`] reads a
//! trace.dat back, merged across CPUs as trace-cmd orders it:
//!
//! ```
//! use hyptrace_abi::{events, page};
//! use hyptrace_output::{Clock, Missed, PageSink, RunSummary, TraceDatSink, TraceDatVersion};
//! use hyptrace_output::{TraceFile, TraceItem, TraceMeta};
//!
//! // One 4 KiB ring page of CPU 0 holding one `guest:marker` event at time 1000.
//! let ev = events::marker(events::vcpu_pid(0), 1, 2);
//! let mut p = vec![0u8; 4096];
//! let mut hdr = [0u8; 8];
//! let n = page::encode_data_header(&mut hdr, ev.len(), 0);
//! let data = page::PAGE_HEADER_SIZE;
//! p[data..data + n].copy_from_slice(&hdr[..n]);
//! p[data + n..data + n + ev.len()].copy_from_slice(&ev);
//! p[..8].copy_from_slice(&1000u64.to_le_bytes()); // time_stamp
//! p[8..16].copy_from_slice(&((n + ev.len()) as u64).to_le_bytes()); // commit
//!
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("t.dat");
//! let meta = TraceMeta::guest(4096, 1, Clock::nanoseconds()); // + registered formats
//! let mut sink = TraceDatSink::create(&path, meta, TraceDatVersion::V7)?;
//! sink.page(0, &p, Missed::None)?;
//! Box::new(sink).finish(&RunSummary::default())?;
//!
//! let file = TraceFile::open(&path)?;
//! let mut records = file.records();
//! let Some(TraceItem::Event(r)) = records.next_item() else { panic!("no event") };
//! assert_eq!((r.cpu, r.ts_ns, &r.payload[..ev.len()]), (0, 1000, &ev[..]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod blockwrite;
mod clock;
mod damage;
mod error;
mod export;
mod idtable;
pub mod merge;
mod plugins;
mod sink;
mod sinks;
mod tap;
mod target;
pub mod text;
mod threaded;
pub mod tracedat;

pub use clock::{Clock, ClockMap, Knot, TscConversion, SLOPE_SHIFT};
pub use error::{
    error_chain, BlockProblem, BudgetOver, DatError, DatProblem, MetaError, OutputError,
    PageProblem, PartError, PartProblem, RawError, RawProblem, UnsupportedDat,
};
pub use export::{
    check_page_size, commit_len, export_page, export_page_into, page_missed, Missed, MAX_PAGE_SIZE,
    MIN_PAGE_SIZE,
};
pub use hyptrace_format::{
    common_fields, guest_formats, trailing_lost_format, EventFormat, Field, FormatError,
    HYPTRACE_SYSTEM, TRAILING_LOST_NAME,
};
/// Event formats, the print-format language and kernel symbols live in `hyptrace-format`
/// (the reader checks registrations with them without this crate's zstd and prost); the
/// paths `hyptrace_output::format`, `printfmt` and `symbols` name its modules.
pub use hyptrace_format::{format, printfmt, symbols};
pub use hyptrace_format::{KernelSymbols, Program, Unsupported};
pub use merge::{MergeWindow, Merged, Merger, Released};
/// The old name of [`KernelCpuStat`], kept only until the host uses the new one.
#[doc(hidden)]
pub use sink::KernelCpuStat as CpuStats;
pub use sink::{
    CpuGroup, KernelCpuStat, OutputWaits, PageSink, RunSummary, TraceMeta, MAX_CPUS, MAX_GROUPS,
};
pub use sinks::perfetto::{self, PerfettoSink};
pub use sinks::{
    is_raw_stream, page_events, JsonSink, PageEvents, RawReader, RawSink, RawTrace, StreamOut,
    StreamSink, TextSink, JSON_MAX_SAFE_INTEGER, JSON_PID, RAW_MAGIC, RAW_MAGIC_V1,
};
pub use tap::{Discard, Tap};
pub use target::{
    set_wait_interrupt, stdout_closed, OutputFile, OutputTarget, QuietStdout, TargetKind,
};
pub use text::{
    escape_guest_bytes, escape_guest_str, escaped_guest_bytes, format_drop, format_event,
    format_guest_line, format_window_exceeded, guest_printers, EventPrinter,
};
pub use threaded::ThreadedSink;
pub use tracedat::{
    write_buffers, write_trace_dat, write_trace_dat_with, BufferPart, BufferSet, Compression,
    ReportFilter, TraceDatSink, TraceDatVersion, TraceFile, TraceItem, TraceRecord,
};

/// The README's code blocks, run as doc tests (README and crate docs cannot drift).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
