//! trace.dat v6/v7: writer ([`TraceDatSink`]) and reader ([`TraceFile`]).

mod read;
mod strings;

/// How a guest string is written into a trace.dat page (G2): [`strings::sanitize`].
pub use strings::sanitize as sanitize_guest_string;
mod cpudata;
mod cpuout;
mod head;
mod ids;
mod multi;
mod params;
mod pump;
mod write;
mod zpool;

pub use ids::{option, MAGIC};
pub use multi::{valid_instance_name, write_buffers, BufferPart, BufferSet, MAX_INSTANCE_NAME};
pub use params::{Compression, TraceDatVersion, ZSTD_CHUNK_PAGES};
pub use pump::{cursors_of, meta_of, pump_by_cpu, pump_cursors, pump_pages, PageCursors};
pub use read::{
    max_chunk, page_as_read, page_damage, CpuBuffer, CpuPages, Damage, FilterCounts, FilterError,
    FilterErrorKind, FilterSet, FilteredSink, Instance, PageFilterError, PageFiltered, PageSource,
    Records, ReportFilter, ReportOutcome, TraceFile, TraceItem, TraceOption, TraceRecord,
    MAX_CHUNK, MAX_INSTANCES, MAX_RATIO, METADATA_BUDGET, OPTIONS_SHARE, READ_BUDGET,
};
pub use write::{write_trace_dat, write_trace_dat_with, TraceDatSink, TRAILING_LOST_ID};
