//! What the streaming sinks (text, JSON, raw, Perfetto) share: where they write, their
//! one set of constructors ([`StreamSink`]), the decoding of a page's events and the
//! identity of the VM in the viewers.

use std::io::Write;
use std::path::Path;

use hyptrace_abi::page::{page_header, Events, PAGE_HEADER_SIZE};

use crate::export::commit_len;
use crate::sink::TraceMeta;
use crate::target::{OutputFile, OutputTarget};
use crate::OutputError;

/// The JSON `pid` of the VM (and the Perfetto process track's).
pub const JSON_PID: u32 = 1;
/// Name of the process track, in Perfetto and Chrome JSON alike.
pub const PROCESS_NAME: &str = "hyptrace guest";

/// The constructors of a sink that streams into one output ([`TextSink`](crate::TextSink),
/// [`JsonSink`](crate::JsonSink), [`RawSink`](crate::RawSink),
/// [`PerfettoSink`](crate::PerfettoSink)): into a path, a checked target or any writer.
/// A sink implements [`from_output`](Self::from_output); the three others follow.
///
/// ```
/// use hyptrace_output::{Clock, PageSink, RunSummary, StreamSink, TextSink, TraceMeta};
/// let meta = TraceMeta::guest(4096, 1, Clock::nanoseconds());
/// let sink = TextSink::to_writer(Box::new(std::io::sink()), meta)?;
/// Box::new(sink).finish(&RunSummary::default())?;
/// # Ok::<(), hyptrace_output::OutputError>(())
/// ```
pub trait StreamSink: Sized {
    /// The sink writing into `out`, its header written.
    ///
    /// # Errors
    /// Metadata [`TraceMeta::validate`] refuses, or the header's write.
    fn from_output(out: StreamOut, meta: TraceMeta) -> Result<Self, OutputError>;

    /// The sink into `path`, checked and opened as [`OutputTarget`] does: `-` is stdout,
    /// a regular file is written under a temporary name and renamed at `finish`, a
    /// device or FIFO is written in place.
    ///
    /// # Errors
    /// The path's check ([`OutputTarget::check`]), then as [`open`](Self::open).
    fn create(path: impl AsRef<Path>, meta: TraceMeta) -> Result<Self, OutputError> {
        Self::open(&OutputTarget::check(path)?, meta)
    }

    /// The sink into a checked target; the metadata is checked before the file is made.
    ///
    /// # Errors
    /// Bad metadata, the file's creation, or as [`from_output`](Self::from_output).
    fn open(target: &OutputTarget, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        Self::from_output(StreamOut::File(target.open()?), meta)
    }

    /// The sink into any writer (stdout...).
    ///
    /// # Errors
    /// As [`from_output`](Self::from_output).
    fn to_writer(w: Box<dyn Write + Send>, meta: TraceMeta) -> Result<Self, OutputError> {
        Self::from_output(StreamOut::Writer(w), meta)
    }
}

/// Where a streaming sink writes: a checked output file (written under a temporary name
/// and renamed when the sink finishes, see [`OutputTarget`]) or any writer.
pub enum StreamOut {
    /// A file opened from an [`OutputTarget`].
    File(OutputFile),
    /// Any writer (stdout, a socket, a buffer...).
    Writer(Box<dyn Write + Send>),
}

impl StreamOut {
    /// Writes `b`; an error names the output (a file's path) and closes a file output
    /// (its temporary file removed).
    ///
    /// # Errors
    /// The write's, with the file's path when it is a file.
    pub fn write_all(&mut self, b: &[u8]) -> Result<(), OutputError> {
        match self {
            StreamOut::File(f) => f.write_all(b).map_err(|e| f.error(e)),
            StreamOut::Writer(w) => w.write_all(b).map_err(OutputError::from),
        }
    }

    /// Ends the output: a file is renamed into place, a writer flushed.
    ///
    /// # Errors
    /// The rename's or the flush's.
    pub fn close(self) -> Result<(), OutputError> {
        match self {
            StreamOut::File(f) => f.finish(),
            StreamOut::Writer(mut w) => w.flush().map_err(OutputError::from),
        }
    }
}

/// What [`page_events`] decodes: `(page time_stamp, [(raw ts, payload)], decode error)`.
pub type PageEvents<'a> = (u64, Vec<(u64, &'a [u8])>, Option<String>);

/// Decodes the events of an exported page ([`crate::export_page_into`]): `(raw ts,
/// payload)` each; stops at the first decode error (returned with the events before
/// it). Every sink that shows events decodes them here (an out-of-tree sink too:
/// `hyptrace-clickhouse`).
pub fn page_events(page: &[u8]) -> PageEvents<'_> {
    let Some((ts, _)) = page_header(page) else {
        return (0, Vec::new(), Some("short page".into()));
    };
    let len = commit_len(page).unwrap_or(0);
    let Some(area) = page.get(PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len) else {
        return (ts, Vec::new(), Some("commit past the page".into()));
    };
    let mut out = Vec::new();
    for e in Events::new(area, ts) {
        match e {
            Ok(e) => out.push((e.ts, e.payload)),
            Err(err) => return (ts, out, Some(err.to_string())),
        }
    }
    (ts, out, None)
}
