//! The output sinks: which format a path asks for, whether a path can receive an output
//! (checked before the VM starts), and the page sink of each format.

use std::borrow::Cow;
use std::io::Write;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use hyptrace_output::tracedat::{FilterCounts, FilterError, FilterSet, FilteredSink, PageSource};
use hyptrace_output::{
    Compression, JsonSink, OutputError, OutputTarget, PageSink, PerfettoSink, RawSink, StreamSink,
    TextSink, TraceDatSink, TraceDatVersion, TraceMeta,
};

/// The output formats (what `record --format` and the extensions name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// trace.dat version 7.
    Dat,
    /// trace.dat version 6.
    Dat6,
    /// Chrome trace-event JSON.
    Json,
    /// Native Perfetto trace.
    Perfetto,
    /// Text, as `trace-cmd report -t`.
    Text,
    /// Raw ring pages.
    Raw,
}

impl Format {
    /// The name `--format` takes for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Dat => "dat",
            Self::Dat6 => "dat6",
            Self::Json => "json",
            Self::Perfetto => "perfetto",
            Self::Text => "text",
            Self::Raw => "raw",
        }
    }
}

/// The name `--compression` takes for `c`.
pub fn compression_name(c: Compression) -> &'static str {
    match c {
        Compression::Zstd => "zstd",
        Compression::None => "none",
    }
}

/// `--compression zstd` asked of a format other than a v7 trace.dat (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("--compression {compression} applies to --format dat only, not {format}")]
pub struct CompressionMismatch {
    /// The compression asked for.
    pub compression: String,
    /// The output's format.
    pub format: String,
}

/// The compression of an output of `format` (`record`/`convert --compression`): a v7
/// trace.dat is zstd-compressed unless `none` is asked (like trace-cmd); no other
/// format is compressed, and asking to is refused.
pub fn compression_for(
    format: Format,
    compression: Option<Compression>,
) -> Result<Compression, CompressionMismatch> {
    match (format, compression) {
        (Format::Dat, c) => Ok(c.unwrap_or(Compression::Zstd)),
        (_, None | Some(Compression::None)) => Ok(Compression::None),
        (f, Some(c)) => Err(CompressionMismatch {
            compression: compression_name(c).into(),
            format: f.name().into(),
        }),
    }
}

/// An output path that cannot receive an output, and why.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path} ({flag})", path = .path.display())]
pub struct DestinationError {
    /// The path given.
    pub path: PathBuf,
    /// The flag that named it.
    pub flag: String,
    /// Why.
    #[source]
    pub source: DestinationProblem,
}

/// Why an output path cannot receive an output.
#[derive(Debug, thiserror::Error)]
pub enum DestinationProblem {
    /// The path cannot be written.
    #[error(transparent)]
    Output(OutputError),
    /// No `--format`, and the extension names none.
    #[error("unknown extension `.{0}` (known: {KNOWN_EXTENSIONS}); name the format with --format")]
    UnknownExtension(String),
}

/// The extensions that name a format (what [`format_for`] takes).
pub const KNOWN_EXTENSIONS: &str =
    ".dat, .json, .txt, .text, .raw, .pftrace, .perfetto-trace, .perfetto";

/// Checks, before the VM starts, that `path` can receive the output of `flag`, and says
/// in one line why not (`hyptrace_output::OutputTarget::check`: a regular file or a new
/// path is written to a temporary name in its directory and renamed, a symlink is
/// followed, a device or FIFO is written in place, `-` is stdout, a directory or an
/// unwritable place is refused).
pub fn check_destination(path: &Path, flag: &str) -> Result<OutputTarget, DestinationError> {
    OutputTarget::check(path).map_err(|e| DestinationError {
        path: path.to_path_buf(),
        flag: flag.to_string(),
        source: DestinationProblem::Output(e),
    })
}

/// How the files written from trace data are made (`--output-mode`, `--direct-io`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileOpts {
    /// The permission bits a new file is created with (less the umask).
    pub mode: u32,
    /// Whole blocks of a regular file past the page cache
    /// ([`OutputTarget::with_direct_io`]).
    pub direct_io: bool,
}

impl Default for FileOpts {
    fn default() -> Self {
        Self {
            mode: OutputTarget::PRIVATE,
            direct_io: false,
        }
    }
}

/// [`check_destination`], the file to be made as `opts` says.
pub fn check_with(
    path: &Path,
    flag: &str,
    opts: FileOpts,
) -> Result<OutputTarget, DestinationError> {
    check_destination(path, flag).map(|t| {
        let t = t.with_mode(opts.mode);
        if opts.direct_io {
            t.with_direct_io()
        } else {
            t
        }
    })
}

/// Writes `text` to a checked destination (temporary file renamed, or in place).
pub fn write_destination(target: &OutputTarget, text: &str) -> Result<(), OutputError> {
    let mut f = target.open()?;
    f.write_all(text.as_bytes())
        .map_err(|source| OutputError::Io {
            path: Some(target.path().to_path_buf()),
            source,
        })?;
    f.finish()
}

/// `format`, else the format the extension of `output` (named by `flag`) names: a
/// path without an extension (`-`, a device, `trace`) is a trace.dat; an extension
/// that names no format is refused (exit 2), never guessed. An explicit `format` the
/// extension disagrees with (`--format json -o t.dat`) is obeyed, with a warning on
/// stderr ([`extension_disagrees`]).
pub fn format_for(
    format: Option<Format>,
    output: &Path,
    flag: &str,
) -> Result<Format, DestinationError> {
    if let Some(f) = format {
        if let Some(w) = extension_disagrees(f, output, flag) {
            note!("hyptrace: warning: {w}");
        }
        return Ok(f);
    }
    let Some(ext) = output.extension() else {
        return Ok(Format::Dat);
    };
    let ext = ext.to_string_lossy();
    format_of_extension(&ext).ok_or_else(|| DestinationError {
        path: output.to_path_buf(),
        flag: flag.to_string(),
        source: DestinationProblem::UnknownExtension(ext.into_owned()),
    })
}

/// The format an extension names (case-insensitive), if it names one.
fn format_of_extension(ext: &str) -> Option<Format> {
    Some(match ext.to_ascii_lowercase().as_str() {
        "dat" => Format::Dat,
        "json" => Format::Json,
        "txt" | "text" => Format::Text,
        "raw" => Format::Raw,
        "pftrace" | "perfetto-trace" | "perfetto" => Format::Perfetto,
        _ => return None,
    })
}

/// Why `output`'s extension disagrees with the explicit `format`, if it names another
/// format (`.dat` agrees with `dat` and `dat6`; no extension, or one naming no format,
/// agrees with any).
pub fn extension_disagrees(format: Format, output: &Path, flag: &str) -> Option<String> {
    let ext = output.extension()?.to_string_lossy();
    let named = format_of_extension(&ext)?;
    let agree = named == format || (named == Format::Dat && format == Format::Dat6);
    (!agree).then(|| {
        format!(
            "{} ({flag}) is written as --format {}, though `.{}` names --format {}",
            shown_path(output),
            format.name(),
            crate::exit::printable(&ext),
            named.name(),
        )
    })
}

/// A path for messages ([`crate::exit::printable`]); `-` is stdout.
pub fn shown_path(p: &Path) -> Cow<'_, str> {
    if p.as_os_str() == "-" {
        Cow::Borrowed("stdout")
    } else {
        match p.to_string_lossy() {
            Cow::Borrowed(s) => crate::exit::printable(s),
            Cow::Owned(s) => Cow::Owned(crate::exit::printable(&s).into_owned()),
        }
    }
}

/// The page sink of `format` on `target` (`compression`: of a v7 trace.dat).
pub fn make_sink(
    target: &OutputTarget,
    format: Format,
    compression: Compression,
    meta: TraceMeta,
) -> Result<Box<dyn PageSink + Send>, OutputError> {
    Ok(match format {
        Format::Dat => Box::new(TraceDatSink::open_with(
            target,
            meta,
            TraceDatVersion::V7,
            compression,
        )?),
        Format::Dat6 => Box::new(TraceDatSink::open(target, meta, TraceDatVersion::V6)?),
        Format::Json => Box::new(JsonSink::open(target, meta)?),
        Format::Perfetto => Box::new(PerfettoSink::open(target, meta)?),
        Format::Text => Box::new(TextSink::open(target, meta)?),
        Format::Raw => Box::new(RawSink::open(target, meta)?),
    })
}

/// The `-F` filters of `convert`/`record`, compiled against the formats of the output
/// (`None` without -F), with the comms `COMM` reads. Compiled before the output is made:
/// a bad filter (exit 2) leaves nothing behind.
pub struct Filters {
    set: FilterSet,
    cmdlines: std::collections::BTreeMap<i32, String>,
}

impl Filters {
    /// `specs` (one per -F) compiled against `meta`'s formats.
    pub fn compile(specs: &[String], meta: &TraceMeta) -> Result<Option<Self>, FilterError> {
        Ok(FilterSet::compile(specs, &meta.formats)?.map(|set| Self {
            set,
            cmdlines: meta.cmdlines.clone(),
        }))
    }
}

/// `sink` behind `filters` ([`FilteredSink`]: every format gets only the kept events),
/// with the handle of its counts; `sink` itself without filters. `src`: where the
/// pages come from (which bits of `commit` are the length).
pub fn behind_filters(
    sink: Box<dyn PageSink + Send>,
    filters: Option<Filters>,
    src: PageSource,
) -> (Box<dyn PageSink + Send>, Option<Arc<FilterCounts>>) {
    match filters {
        None => (sink, None),
        Some(f) => {
            let (s, counts) = FilteredSink::new(sink, f.set, src, f.cmdlines);
            (Box::new(s), Some(counts))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations() {
        let dir = std::env::temp_dir().join(format!("hyptrace-dest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let p = |n: &str| dir.join(n);
        let err = |path: &Path, flag: &str| {
            crate::exit::chain(&check_destination(path, flag).expect_err("accepted"))
        };
        std::fs::write(p("file"), b"x").expect("write");
        // New file, existing file, a symlink to either: fine.
        check_destination(&p("new.dat"), "-o").expect("new file");
        check_destination(&p("file"), "-o").expect("existing file");
        std::os::unix::fs::symlink(p("file"), p("link")).expect("symlink");
        check_destination(&p("link"), "-o").expect("symlink to a file");
        std::os::unix::fs::symlink(p("later"), p("dangling")).expect("symlink");
        check_destination(&p("dangling"), "-o").expect("dangling symlink, target creatable");
        std::os::unix::fs::symlink("/nonexistent/dir/x", p("nowhere")).expect("symlink");
        let e = err(&p("nowhere"), "-o");
        assert!(e.contains("does not exist"), "{e}");
        // A FIFO is written in place.
        let fifo = std::ffi::CString::new(p("fifo").as_os_str().as_encoded_bytes()).expect("c");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        check_destination(&p("fifo"), "-o").expect("fifo");
        // Refused: a directory, a missing directory, a file used as a directory.
        let e = err(&dir, "--stats");
        assert!(
            e.contains("(--stats)") && e.contains("is a directory"),
            "{e}"
        );
        let e = err(&p("sub/"), "-o");
        assert!(e.contains("directory"), "{e}");
        let e = err(&p("missing/x.json"), "--json");
        assert!(e.contains("does not exist"), "{e}");
        let e = err(&p("file/x.json"), "--json");
        assert!(e.contains("--json"), "{e}");
        let e = err(Path::new(""), "-o");
        assert!(e.contains("empty"), "{e}");
        // Formats from extensions; an unknown one is refused, no extension is dat.
        let fmt = |p: &str| format_for(None, Path::new(p), "-o");
        assert_eq!(fmt("a.JSON").expect("json"), Format::Json);
        assert_eq!(fmt("a.pftrace").expect("perfetto"), Format::Perfetto);
        assert_eq!(fmt("-").expect("stdout"), Format::Dat);
        assert_eq!(fmt("/dev/null").expect("device"), Format::Dat);
        for bad in ["x.dat6", "x.unknownext"] {
            let e = crate::exit::chain(&fmt(bad).expect_err(bad));
            assert!(e.contains("(-o)") && e.contains(".dat, .json"), "{e}");
        }
        let raw = Some(Format::Raw);
        assert_eq!(
            format_for(raw, Path::new("x.zzz"), "-o").expect("raw"),
            Format::Raw
        );
        // An explicit format the extension disagrees with: obeyed, warned.
        let warn = |f, p: &str| extension_disagrees(f, Path::new(p), "-o");
        assert_eq!(
            warn(Format::Json, "t.dat").as_deref(),
            Some("t.dat (-o) is written as --format json, though `.dat` names --format dat")
        );
        assert!(warn(Format::Dat, "t.JSON").is_some());
        for (f, p) in [
            (Format::Dat6, "t.dat"),
            (Format::Json, "t.json"),
            (Format::Text, "t.txt"),
            (Format::Raw, "t.zzz"),
            (Format::Perfetto, "-"),
        ] {
            assert_eq!(warn(f, p), None, "{p}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `-o clickhouse://...` that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ServerOutputError {
    /// `--format` or `--compression` beside a server, which takes rows (exit 2).
    #[error("--format and --compression name file formats; -o clickhouse://... writes rows")]
    Formatted,
    /// A bad URL (exit 2), or a server that cannot be used (exit 1).
    #[error(transparent)]
    ClickHouse(#[from] hyptrace_clickhouse::ClickHouseError),
}

impl ServerOutputError {
    /// The user's mistake (exit 2), not the server's.
    pub fn is_usage(&self) -> bool {
        match self {
            Self::Formatted => true,
            Self::ClickHouse(e) => e.is_usage(),
        }
    }
}

/// `-o clickhouse://...` of `record`, `convert` and `collect`: the URL checked, the
/// server reached and its tables created, before any work. `formatted`: `--format` or
/// `--compression` was given, which a server does not take.
pub fn clickhouse_output(
    url: &str,
    formatted: bool,
) -> Result<
    (
        hyptrace_clickhouse::ClickHouseUrl,
        hyptrace_clickhouse::Client,
    ),
    ServerOutputError,
> {
    let url = hyptrace_clickhouse::ClickHouseUrl::parse(url)
        .map_err(|e| ServerOutputError::ClickHouse(e.into()))?;
    if formatted {
        return Err(ServerOutputError::Formatted);
    }
    let client = hyptrace_clickhouse::prepare(&url)?;
    Ok((url, client))
}
