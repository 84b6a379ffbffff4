//! Errors of the output crate.

use std::path::PathBuf;

/// Everything that can go wrong while exporting pages or reading a trace.dat.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// An I/O error, with the path it concerns when known. Its text is the path (or "I/O
    /// error"); the OS error is its source, which the printer appends.
    #[error("{}", .path.as_ref().map_or_else(|| "I/O error".to_string(), |p| p.display().to_string()))]
    Io {
        /// File concerned, if known.
        path: Option<PathBuf>,
        /// Underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A page handed to a sink is malformed (too short, commit past the page...).
    #[error("bad page (cpu {cpu}): {reason}")]
    BadPage {
        /// CPU the page came from.
        cpu: u32,
        /// What is wrong.
        reason: String,
    },
    /// Bad metadata given to a sink (page size, CPU number...).
    #[error("bad trace metadata: {0}")]
    BadMeta(String),
    /// A trace.dat file is malformed.
    #[error("malformed trace.dat at offset {offset}: {reason}")]
    Format {
        /// Byte offset in the file (or in the decompressed section) where the problem was found.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A trace.dat feature this reader does not implement.
    #[error("unsupported trace.dat: {0}")]
    Unsupported(String),
    /// The output failed earlier (or was finished): nothing more is written. The first
    /// error said why; this one need not be reported again.
    #[error("output closed after an earlier error")]
    Closed,
    /// A raw page stream (`--format raw`) is malformed.
    #[error("malformed raw page stream: {0}")]
    Raw(String),
    /// A `report -F` filter is refused.
    #[error(transparent)]
    Filter(#[from] Box<crate::tracedat::FilterError>),
    /// A sink outside this crate failed (e.g. `hyptrace-clickhouse`'s server errors):
    /// its own typed error, shown as it is.
    #[error(transparent)]
    Sink(Box<dyn std::error::Error + Send + Sync>),
}

impl OutputError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: Some(path.into()),
            source,
        }
    }

    pub(crate) fn format(offset: impl TryInto<u64>, reason: impl Into<String>) -> Self {
        Self::Format {
            offset: offset.try_into().unwrap_or(u64::MAX),
            reason: reason.into(),
        }
    }
}

impl From<std::io::Error> for OutputError {
    fn from(source: std::io::Error) -> Self {
        Self::Io { path: None, source }
    }
}

/// A `format` or `header_page` text of a trace.dat that cannot be parsed is malformed
/// trace.dat (the format error is the whole reason: it has no source of its own).
impl From<hyptrace_format::FormatError> for OutputError {
    fn from(e: hyptrace_format::FormatError) -> Self {
        Self::format(0u64, e.to_string())
    }
}
