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
    /// A page handed to a sink is malformed (too short, commit past the page...), or
    /// comes for a CPU that cannot take it.
    #[error("bad page (cpu {cpu}): {problem}")]
    BadPage {
        /// CPU the page came from.
        cpu: u32,
        /// What is wrong (the data of the message, not a cause: no source).
        problem: PageProblem,
    },
    /// Bad metadata given to a sink (page size, CPU number...).
    #[error("bad trace metadata: {0}")]
    Meta(MetaError),
    /// zstd failed (to set up a compressor, or to compress a CPU's data or a metadata
    /// section): the zstd error is the source.
    #[error("zstd compression{}", .cpu.map_or_else(String::new, |c| format!(" of cpu {c}'s data")))]
    Compress {
        /// The CPU whose data was compressed (`None`: not one CPU's data).
        cpu: Option<u32>,
        /// What zstd said.
        #[source]
        source: std::io::Error,
    },
    /// Reading a trace.dat failed (its own error: the reader's; boxed: the error stays
    /// small).
    #[error(transparent)]
    Dat(Box<DatError>),
    /// A Perfetto trace (read back by tests and tools) does not decode.
    #[error("malformed perfetto trace")]
    Perfetto(#[source] prost::DecodeError),
    /// The output failed earlier (or was finished): nothing more is written. The first
    /// error said why; this one need not be reported again.
    #[error("output closed after an earlier error")]
    Closed,
    /// Reading a raw page stream (`--format raw`) failed (its own error: the raw
    /// reader's).
    #[error(transparent)]
    Raw(#[from] RawError),
    /// A part of a multi-buffer trace.dat is refused (boxed: the error stays small).
    #[error(transparent)]
    Part(Box<PartError>),
    /// Reading a part of a multi-buffer trace.dat failed.
    #[error("reading a buffer part")]
    ReadPart(#[source] Box<DatError>),
    /// The CPU data of a trace.dat was placed after its first byte was written (a bug
    /// of the writer, not of its input).
    #[error("cpu {0}'s data moved after its start")]
    Moved(u32),
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
}

/// Reading a trace.dat failed ([`crate::TraceFile`]: opening it, its pages, its
/// records). A sink fed from it, or a report written from it, fails with an
/// [`OutputError`] that holds this one ([`OutputError::Dat`]).
#[derive(Debug, thiserror::Error)]
pub enum DatError {
    /// Reading the file failed. Its text is the path; the OS error is its source.
    #[error("{}", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The file is malformed: where (its text), and what is wrong there (the source,
    /// printed after it by the chain printer).
    #[error("malformed trace.dat at offset {offset}{}", .within.map_or_else(String::new, |b| format!(" (byte {b} of the section there)")))]
    Format {
        /// Byte offset in the file where the problem was found (for a problem inside a
        /// section: the section's).
        offset: u64,
        /// For a problem inside a (possibly decompressed) section at `offset`: the
        /// offset within the section.
        within: Option<u64>,
        /// What is wrong.
        #[source]
        problem: DatProblem,
    },
    /// A trace.dat feature this reader does not implement.
    #[error("unsupported trace.dat: {0}")]
    Unsupported(UnsupportedDat),
}

impl DatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn format(offset: impl TryInto<u64>, problem: DatProblem) -> Self {
        Self::Format {
            offset: offset.try_into().unwrap_or(u64::MAX),
            within: None,
            problem,
        }
    }
}

/// The text of `e` and of each of its sources, joined by `": "`, a source whose text
/// the text so far already holds left out (an I/O error naming its path after a
/// message naming it): each cause printed once. Bounded at 16 links (a cycle of
/// sources would not end). The one chain printer of the workspace (host/'s messages
/// and the reader's damage notes).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    for _ in 0..16 {
        let Some(src) = next else { break };
        let s = src.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        next = src.source();
    }
    text
}

impl From<DatError> for OutputError {
    fn from(e: DatError) -> Self {
        Self::Dat(Box::new(e))
    }
}

impl From<std::io::Error> for OutputError {
    fn from(source: std::io::Error) -> Self {
        Self::Io { path: None, source }
    }
}

/// A `format` or `header_page` text of a trace.dat that cannot be parsed is malformed
/// trace.dat (the format error is the problem).
impl From<hyptrace_format::FormatError> for DatError {
    fn from(e: hyptrace_format::FormatError) -> Self {
        Self::format(0u64, DatProblem::Text(e))
    }
}

/// What is malformed in a trace.dat ([`DatError::Format`]): each reason with its
/// numbers. A `&'static str` names the item read (`"section size"`, `"cpu data
/// offset"`): a label of the reader, not a message.
#[derive(Debug, thiserror::Error)]
pub enum DatProblem {
    /// Not a trace.dat's magic.
    #[error("not a trace.dat (bad magic)")]
    Magic,
    /// The version is not a number (the text the file has).
    #[error("bad version {0:?}")]
    Version(String),
    /// A page size not accepted.
    #[error("bad page size {0}")]
    PageSize(usize),
    /// An item runs past the end of the file (or of its section, option or block).
    #[error("{0} runs past the end")]
    PastEnd(&'static str),
    /// A length larger than the bytes that follow it.
    #[error("{what} {len} is more than the {left} bytes left")]
    Length {
        /// The item.
        what: &'static str,
        /// Its length.
        len: u64,
        /// Bytes left after it.
        left: u64,
    },
    /// A `\0`-terminated name longer than the reader takes.
    #[error("{what} longer than {max} bytes")]
    LongName {
        /// The item.
        what: &'static str,
        /// The longest accepted.
        max: usize,
    },
    /// Another tag where a section's tag is (`header_page`, `header_event`, `options`
    /// or `flyrecord`).
    #[error("expected {0}")]
    Expected(&'static str),
    /// More CPUs than the reader takes.
    #[error("{cpus} CPUs, more than {max}")]
    Cpus {
        /// The file's count.
        cpus: u32,
        /// The most accepted.
        max: u32,
    },
    /// A v7 compression name no compressor has (an unknown one is
    /// [`UnsupportedDat::Compression`]).
    #[error("compression name damaged")]
    CompressionName,
    /// A v7 section offset past the end of the file.
    #[error("section offset past the end of the file")]
    SectionPastEnd,
    /// A v7 section of another id than the option naming it says.
    #[error("section id {id}, expected {want}")]
    SectionId {
        /// The id found.
        id: u16,
        /// The id expected.
        want: u16,
    },
    /// A compressed section in a file that is not compressed.
    #[error("compressed section in an uncompressed file")]
    CompressedSection,
    /// A compressed section's block larger than the section.
    #[error("compressed size {csize} runs past the section of {size} bytes")]
    CompressedSize {
        /// The block's compressed size.
        csize: usize,
        /// The section's size.
        size: usize,
    },
    /// A compressed block refused before it is decompressed.
    #[error("compressed block {0}")]
    Block(BlockProblem),
    /// zstd could not decompress a block (or set up a decompressor): the zstd error is
    /// the source.
    #[error("zstd")]
    Zstd(#[source] std::io::Error),
    /// A block decompressed to another size than its header says.
    #[error("zstd: {got} bytes, expected {want}")]
    ZstdSize {
        /// Bytes decompressed.
        got: usize,
        /// Bytes the header says.
        want: usize,
    },
    /// The chain of v7 options sections comes back to a section (or is longer than the
    /// reader follows).
    #[error("options sections loop")]
    OptionsLoop,
    /// A v7 file whose options name no header_page section.
    #[error("no header_page section")]
    NoHeaderPage,
    /// The `header_page` text does not fit in the metadata budget.
    #[error("header_page text of {0}")]
    OverBudget(BudgetOver),
    /// A `format` or `header_page` text that does not parse.
    #[error(transparent)]
    Text(hyptrace_format::FormatError),
}

/// Why a compressed block (a v7 section or chunk) is refused before it is decompressed
/// ([`DatProblem::Block`], and the damage note of a skipped chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BlockProblem {
    /// More compressed bytes than any zstd frame of the uncompressed size takes.
    #[error("claims {cs} bytes compressed for {us}: more than any zstd frame of them takes")]
    Bound {
        /// Compressed size.
        cs: usize,
        /// Uncompressed size.
        us: usize,
    },
    /// More uncompressed bytes than a block may have.
    #[error("claims {us} bytes uncompressed, more than the {cap} accepted")]
    Cap {
        /// Uncompressed size.
        us: usize,
        /// The most accepted.
        cap: usize,
    },
    /// A ratio no real trace compresses to.
    #[error("claims {us} bytes from {cs} compressed, more than {ratio} times: no real trace compresses so far")]
    Ratio {
        /// Uncompressed size.
        us: usize,
        /// Compressed size.
        cs: usize,
        /// The largest ratio accepted.
        ratio: u64,
    },
}

/// Bytes of metadata past the reader's budget, and the budget
/// ([`DatProblem::OverBudget`] and the damage notes of what was not read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetOver {
    /// Bytes that did not fit.
    pub bytes: u64,
    /// The budget of all metadata, MiB.
    pub budget_mib: u64,
    /// The share of it for options sections, MiB.
    pub options_mib: u64,
    /// MiB taken so far.
    pub used_mib: u64,
    /// MiB taken by options sections so far.
    pub options_used_mib: u64,
}

impl std::fmt::Display for BudgetOver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes past the metadata budget ({} MiB for all metadata, {} MiB of it for options sections; {} MiB taken, {} MiB by options sections)",
            self.bytes, self.budget_mib, self.options_mib, self.used_mib, self.options_used_mib
        )
    }
}

/// What is wrong with a page handed to a sink ([`OutputError::BadPage`]).
#[derive(Debug, thiserror::Error)]
pub enum PageProblem {
    /// The CPU is not one of the trace's.
    #[error("cpu {cpu} ≥ nr_cpus {nr_cpus}")]
    NoSuchCpu {
        /// The page's CPU.
        cpu: u32,
        /// CPUs of the trace.
        nr_cpus: u32,
    },
    /// The page is not of the trace's page size.
    #[error("page of {len} bytes, page size is {page_size}")]
    Size {
        /// The page's length.
        len: usize,
        /// The trace's page size.
        page_size: usize,
    },
    /// The output buffer of an exported copy has another length than the page.
    #[error("output of {out} bytes for a page of {len}")]
    OutputSize {
        /// The output's length.
        out: usize,
        /// The page's.
        len: usize,
    },
    /// Shorter than a page header.
    #[error("page of {0} bytes")]
    Short(usize),
    /// The committed data (with the loss count after it) runs past the page.
    #[error("commit {commit} (+ missed count) runs past the page of {len} bytes")]
    CommitPast {
        /// Committed bytes.
        commit: usize,
        /// The page's length.
        len: usize,
    },
    /// A page (or a loss) for a CPU that was ended.
    #[error("page after the CPU was ended")]
    Ended,
    /// The CPU has no data in this file.
    #[error("cpu has no data")]
    NoData,
    /// `-F` could not walk the page.
    #[error("-F: {0}")]
    Filter(crate::tracedat::PageFilterError),
}

/// Metadata a sink refuses ([`OutputError::Meta`]).
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// The page size is not a power of two in `MIN_PAGE_SIZE..=MAX_PAGE_SIZE`.
    #[error("page size {0} is not a power of two in 4096..=64MiB")]
    PageSize(usize),
    /// No CPU, or more than 4096.
    #[error("{0} CPUs")]
    Cpus(u32),
    /// Two formats with one id.
    #[error("duplicate event id {0}")]
    DuplicateEventId(u16),
    /// More VMs ([`crate::TraceMeta::groups`]) than a trace holds.
    #[error("{count} VMs: at most {max}")]
    Groups {
        /// VMs given.
        count: usize,
        /// The most a trace holds (`MAX_GROUPS`).
        max: usize,
    },
    /// A VM ([`crate::TraceMeta::groups`]) with a bad name, no CPU, CPUs past the trace's
    /// or inside an earlier VM's.
    #[error("VM {name:?}: CPUs {first}+{count} of {nr_cpus} (a name is 1 to 64 of [A-Za-z0-9_.-]; VMs in order, disjoint)")]
    Group {
        /// Its name.
        name: String,
        /// Its first CPU.
        first: u32,
        /// Its CPUs.
        count: u32,
        /// The trace's CPUs.
        nr_cpus: u32,
    },
    /// VMs ([`crate::TraceMeta::groups`]) for a sink that holds one.
    #[error("{sink} holds one VM, not {vms}")]
    OneVm {
        /// The sink.
        sink: &'static str,
        /// The VMs asked for.
        vms: usize,
    },
    /// A TSC frequency of 0.
    #[error("tsc_khz is 0")]
    TscKhzZero,
    /// A TSC too fast for a 31-bit multiplier.
    #[error("tsc_khz {0} too large")]
    TscKhzTooLarge(u64),
    /// A TSC too slow for any shift.
    #[error("tsc_khz {0} too small")]
    TscKhzTooSmall(u64),
    /// A TSC2NSEC conversion trace-cmd would print differently.
    #[error("TSC2NSEC mult {mult} shift {shift} offset {offset}: trace-cmd needs offset 0, 0 < mult < 2^31, shift <= 32")]
    Tsc2Nsec {
        /// Multiplier.
        mult: u32,
        /// Right shift.
        shift: u32,
        /// Cycles subtracted first.
        offset: u64,
    },
    /// A metadata section whose size does not fit the 32 bits of a compressed block.
    #[error("section of {0} bytes too large to compress")]
    SectionTooLarge(usize),
    /// The metadata grew past where the CPU data were placed.
    #[error("metadata of {bytes} bytes past the CPU data at {data_start}")]
    PastData {
        /// The metadata's length.
        bytes: usize,
        /// Where the CPU data start.
        data_start: u64,
    },
}

/// A trace.dat feature this reader does not implement ([`DatError::Unsupported`]).
#[derive(Debug, thiserror::Error)]
pub enum UnsupportedDat {
    /// A big-endian file.
    #[error("big-endian trace")]
    BigEndian,
    /// A version other than 6 and 7.
    #[error("trace.dat version {0}")]
    Version(u32),
    /// A latency (text) trace.
    #[error("latency (text) trace.dat")]
    Latency,
    /// A compression other than none and zstd (its name, as the file has it).
    #[error("compression {0}")]
    Compression(String),
    /// A `header_page` other than the kernel's (8-byte commit, data at 16).
    #[error("header_page {0:?}")]
    HeaderPage(hyptrace_format::format::HeaderPage),
    /// The top buffer's page size is not the file's.
    #[error("buffer page size {0} != file page size")]
    BufferPageSize(usize),
    /// More CPUs of larger pages than the reader's memory budget holds.
    #[error("{readers} CPUs of {page_size}-byte pages would need {need_mib} MiB of read buffers, more than {budget_mib} MiB")]
    ReadMemory {
        /// CPUs to read.
        readers: usize,
        /// The file's page size.
        page_size: usize,
        /// What they would need.
        need_mib: u64,
        /// The budget.
        budget_mib: u64,
    },
}

/// Reading a raw page stream failed ([`crate::RawReader`], [`crate::RawTrace`]). A
/// sink fed from it fails with an [`OutputError`] that holds this one
/// ([`OutputError::Raw`]).
#[derive(Debug, thiserror::Error)]
pub enum RawError {
    /// Reading failed. Its text is the stream's file (when known); the OS error is its
    /// source.
    #[error("{}", .path.as_ref().map_or_else(|| "reading a raw page stream".to_string(), |p| p.display().to_string()))]
    Io {
        /// The stream's file, when known.
        path: Option<PathBuf>,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The stream is malformed: the file, when known, and what is wrong at it.
    #[error("malformed raw page stream: {}{problem}", .path.as_ref().map_or_else(String::new, |p| format!("{}: ", p.display())))]
    Malformed {
        /// The stream's file, when known.
        path: Option<PathBuf>,
        /// What is wrong.
        problem: RawProblem,
    },
}

/// What is wrong with a raw page stream ([`RawError::Malformed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RawProblem {
    /// It ends inside a record.
    #[error("truncated")]
    Truncated,
    /// Not a raw stream's magic.
    #[error("bad magic")]
    Magic,
    /// A page size not accepted.
    #[error("bad page size")]
    PageSize,
    /// A CPU count not accepted.
    #[error("bad cpu count")]
    CpuCount,
    /// The clock name is longer than a stream may hold.
    #[error("clock name too long")]
    ClockName,
    /// A page record for a CPU the stream does not have.
    #[error("cpu out of range")]
    Cpu,
    /// The end record's CPU count is not the header's.
    #[error("bad cpu count in the end record")]
    EndCpuCount,
    /// An unknown record tag.
    #[error("bad record tag")]
    Tag,
}

/// A part of a multi-buffer trace.dat refused ([`OutputError::Part`]).
#[derive(Debug, thiserror::Error)]
#[error("buffer {name} ({path}): {problem}", path = .path.display())]
pub struct PartError {
    /// The part's instance name.
    pub name: String,
    /// Its file.
    pub path: PathBuf,
    /// Why it does not fit.
    pub problem: PartProblem,
}

/// Why a part of a multi-buffer trace.dat is refused ([`PartError`]).
#[derive(Debug, thiserror::Error)]
pub enum PartProblem {
    /// The instance name is not one a part may have.
    #[error("not a name of [A-Za-z0-9_.-], 1 to 64 bytes")]
    Name,
    /// Not v7, or another page size.
    #[error("v{version} with {page_size} B pages")]
    Version {
        /// The part's version.
        version: u32,
        /// Its page size.
        page_size: usize,
    },
    /// The part is damaged (the first damage it has).
    #[error("damaged: {0}")]
    Damaged(crate::damage::Damage),
    /// Another clock, or one with offsets.
    #[error("clock {found:?}, not {want}")]
    Clock {
        /// The part's clock.
        found: Option<String>,
        /// The set's.
        want: String,
    },
    /// A second part of that name.
    #[error("a second buffer of that name")]
    SecondName,
    /// Compressed unlike the first part.
    #[error("compressed unlike buffer {0}")]
    Compression(String),
    /// An event id with another format than an earlier part's.
    #[error("event id {id} is {here} here, {there} in buffer {first}")]
    EventId {
        /// The id.
        id: u16,
        /// `system:name` in this part.
        here: String,
        /// `system:name` in the earlier part.
        there: String,
        /// The earlier part.
        first: String,
    },
    /// An event id twice in the part.
    #[error("event id {0} twice")]
    EventIdTwice(u16),
}

/// Conditions of this crate carried in an `io::Error`, told from the system's own
/// errors by their type ([`Marker::is`]), not by kind or message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marker {
    /// A write after the output failed or finished.
    Closed,
    /// A file's writer thread ended (it panicked).
    ThreadGone,
}

impl std::fmt::Display for Marker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Marker::Closed => "output closed after an earlier error",
            Marker::ThreadGone => "the output's writer thread ended",
        })
    }
}

impl std::error::Error for Marker {}

impl Marker {
    /// The `io::Error` carrying it.
    pub(crate) fn error(self) -> std::io::Error {
        let kind = match self {
            Marker::Closed => std::io::ErrorKind::Other,
            Marker::ThreadGone => std::io::ErrorKind::BrokenPipe,
        };
        std::io::Error::new(kind, self)
    }

    /// Whether `e` carries it.
    pub(crate) fn is(self, e: &std::io::Error) -> bool {
        e.get_ref()
            .and_then(|s| s.downcast_ref::<Marker>())
            .is_some_and(|m| *m == self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The typed details print as the messages users saw when they were text.
    #[test]
    fn typed_details_print_as_before() {
        let e = crate::export::check_page_size(1000).expect_err("not a power of two");
        assert_eq!(
            e.to_string(),
            "bad trace metadata: page size 1000 is not a power of two in 4096..=64MiB"
        );
        let e = RawError::Malformed {
            path: Some("/tmp/a.raw".into()),
            problem: RawProblem::Truncated,
        };
        assert_eq!(
            e.to_string(),
            "malformed raw page stream: /tmp/a.raw: truncated"
        );
        let e = OutputError::Part(Box::new(PartError {
            name: "b".into(),
            path: "/tmp/b.dat".into(),
            problem: PartProblem::EventIdTwice(7),
        }));
        assert_eq!(e.to_string(), "buffer b (/tmp/b.dat): event id 7 twice");
        let e = OutputError::BadPage {
            cpu: 2,
            problem: PageProblem::NoSuchCpu { cpu: 2, nr_cpus: 1 },
        };
        assert_eq!(e.to_string(), "bad page (cpu 2): cpu 2 ≥ nr_cpus 1");
        let e = DatError::Unsupported(UnsupportedDat::Version(9));
        assert_eq!(e.to_string(), "unsupported trace.dat: trace.dat version 9");
    }

    /// A malformed trace.dat says where, then (its source) what is wrong there.
    #[test]
    fn a_format_error_says_where_then_what() {
        let ratio = BlockProblem::Ratio {
            us: 2_048_000,
            cs: 1000,
            ratio: 1024,
        };
        let e = DatError::format(16u64, DatProblem::Block(ratio));
        assert_eq!(e.to_string(), "malformed trace.dat at offset 16");
        assert_eq!(
            error_chain(&e),
            "malformed trace.dat at offset 16: compressed block claims 2048000 bytes from 1000 compressed, more than 1024 times: no real trace compresses so far"
        );
        let chain = |d: &[u8]| error_chain(&crate::TraceFile::parse(d).expect_err("refused"));
        assert_eq!(
            chain(b"not a trace.dat"),
            "malformed trace.dat at offset 0: not a trace.dat (bad magic)"
        );
        assert_eq!(
            chain(&crate::tracedat::MAGIC[..5]),
            "malformed trace.dat at offset 0: magic runs past the end"
        );
        let mut d = crate::tracedat::MAGIC.to_vec();
        d.extend_from_slice(b"x6\0\0\x08");
        d.extend_from_slice(&1000u32.to_le_bytes());
        assert_eq!(
            chain(&d),
            "malformed trace.dat at offset 10: bad version \"x6\""
        );
    }
}
