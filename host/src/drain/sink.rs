//! The output sinks: which format a path asks for, whether a path can receive an output
//! (checked before the VM starts), and the page sink of each format.

use std::borrow::Cow;
use std::io::Write;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use clap::ValueEnum;
use hyptrace_output::tracedat::{FilterCounts, FilterError, FilterSet, FilteredSink, PageSource};
use hyptrace_output::{
    Compression, JsonSink, OutputError, OutputTarget, PageSink, PerfettoSink, RawSink, StreamSink,
    TextSink, TraceDatSink, TraceDatVersion, TraceMeta,
};

/// Output formats of `record`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// trace.dat version 7 (trace-cmd's current format), zstd-compressed like
    /// `trace-cmd record` (see --compression).
    Dat,
    /// trace.dat version 6.
    Dat6,
    /// Chrome trace-event JSON (Perfetto UI, chrome://tracing).
    Json,
    /// Native Perfetto trace (protobuf TracePackets; open in ui.perfetto.dev).
    Perfetto,
    /// Text, one event per line as `trace-cmd report -t` prints it.
    Text,
    /// Raw ring pages (see docs/output.md).
    Raw,
}

/// Compressions of a v7 trace.dat (`record --compression`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CompressionArg {
    /// zstd, as `trace-cmd record` writes by default.
    Zstd,
    /// Uncompressed: pages copied verbatim.
    None,
}

impl From<CompressionArg> for hyptrace_output::Compression {
    fn from(c: CompressionArg) -> Self {
        match c {
            CompressionArg::Zstd => Self::Zstd,
            CompressionArg::None => Self::None,
        }
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
    format: FormatArg,
    compression: Option<CompressionArg>,
) -> Result<hyptrace_output::Compression, CompressionMismatch> {
    let name = |v: Option<clap::builder::PossibleValue>| {
        v.map_or_else(String::new, |p| p.get_name().to_string())
    };
    match (format, compression) {
        (FormatArg::Dat, c) => Ok(c.unwrap_or(CompressionArg::Zstd).into()),
        (_, None | Some(CompressionArg::None)) => Ok(hyptrace_output::Compression::None),
        (f, Some(c)) => Err(CompressionMismatch {
            compression: name(c.to_possible_value()),
            format: name(f.to_possible_value()),
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

/// `--output-mode MODE` of the commands that write files from trace data (`run`,
/// `record`, `dump`, `convert`): the permission bits those files are created with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::Args)]
pub struct OutputModeArg {
    /// Permission bits (octal, 000-777) of the files written from trace data — the
    /// output, --stats, a crash dump — less the umask. Owner-only by default (the trace
    /// may be private); e.g. 0644 lets others read them. A device, a FIFO or stdout
    /// keeps its own mode.
    #[arg(
        long = "output-mode",
        value_name = "MODE",
        default_value = "0600",
        value_parser = parse_mode
    )]
    pub output_mode: u32,
}

impl Default for OutputModeArg {
    fn default() -> Self {
        Self {
            output_mode: OutputTarget::PRIVATE,
        }
    }
}

impl OutputModeArg {
    /// [`check_destination`], the file to be created with this mode.
    pub fn check(&self, path: &Path, flag: &str) -> Result<OutputTarget, DestinationError> {
        check_destination(path, flag).map(|t| t.with_mode(self.output_mode))
    }
}

/// Parses `--output-mode`: 3 or 4 octal digits (`644`, `0644`), permission bits only
/// (no set-id or sticky bit).
pub fn parse_mode(s: &str) -> Result<u32, String> {
    let digits = s.strip_prefix("0o").unwrap_or(s);
    let ok = (3..=4).contains(&digits.len()) && digits.bytes().all(|b| (b'0'..=b'7').contains(&b));
    match u32::from_str_radix(digits, 8) {
        Ok(m) if ok && m <= 0o777 => Ok(m),
        _ => Err("expected octal permission bits 000-777, e.g. 0600 or 0644".into()),
    }
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
    format: Option<FormatArg>,
    output: &Path,
    flag: &str,
) -> Result<FormatArg, DestinationError> {
    if let Some(f) = format {
        if let Some(w) = extension_disagrees(f, output, flag) {
            note!("hyptrace: warning: {w}");
        }
        return Ok(f);
    }
    let Some(ext) = output.extension() else {
        return Ok(FormatArg::Dat);
    };
    let ext = ext.to_string_lossy();
    format_of_extension(&ext).ok_or_else(|| DestinationError {
        path: output.to_path_buf(),
        flag: flag.to_string(),
        source: DestinationProblem::UnknownExtension(ext.into_owned()),
    })
}

/// The format an extension names (case-insensitive), if it names one.
fn format_of_extension(ext: &str) -> Option<FormatArg> {
    Some(match ext.to_ascii_lowercase().as_str() {
        "dat" => FormatArg::Dat,
        "json" => FormatArg::Json,
        "txt" | "text" => FormatArg::Text,
        "raw" => FormatArg::Raw,
        "pftrace" | "perfetto-trace" | "perfetto" => FormatArg::Perfetto,
        _ => return None,
    })
}

/// Why `output`'s extension disagrees with the explicit `format`, if it names another
/// format (`.dat` agrees with `dat` and `dat6`; no extension, or one naming no format,
/// agrees with any).
pub fn extension_disagrees(format: FormatArg, output: &Path, flag: &str) -> Option<String> {
    let ext = output.extension()?.to_string_lossy();
    let named = format_of_extension(&ext)?;
    let agree = named == format || (named == FormatArg::Dat && format == FormatArg::Dat6);
    let name = |f: FormatArg| f.to_possible_value().map(|v| v.get_name().to_string());
    (!agree).then(|| {
        format!(
            "{} ({flag}) is written as --format {}, though `.{}` names --format {}",
            shown_path(output),
            name(format).unwrap_or_default(),
            crate::exit::printable(&ext),
            name(named).unwrap_or_default(),
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
    format: FormatArg,
    compression: Compression,
    meta: TraceMeta,
) -> Result<Box<dyn PageSink + Send>, OutputError> {
    Ok(match format {
        FormatArg::Dat => Box::new(TraceDatSink::open_with(
            target,
            meta,
            TraceDatVersion::V7,
            compression,
        )?),
        FormatArg::Dat6 => Box::new(TraceDatSink::open(target, meta, TraceDatVersion::V6)?),
        FormatArg::Json => Box::new(JsonSink::open(target, meta)?),
        FormatArg::Perfetto => Box::new(PerfettoSink::open(target, meta)?),
        FormatArg::Text => Box::new(TextSink::open(target, meta)?),
        FormatArg::Raw => Box::new(RawSink::open(target, meta)?),
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
        assert_eq!(fmt("a.JSON").expect("json"), FormatArg::Json);
        assert_eq!(fmt("a.pftrace").expect("perfetto"), FormatArg::Perfetto);
        assert_eq!(fmt("-").expect("stdout"), FormatArg::Dat);
        assert_eq!(fmt("/dev/null").expect("device"), FormatArg::Dat);
        for bad in ["x.dat6", "x.unknownext"] {
            let e = crate::exit::chain(&fmt(bad).expect_err(bad));
            assert!(e.contains("(-o)") && e.contains(".dat, .json"), "{e}");
        }
        let raw = Some(FormatArg::Raw);
        assert_eq!(
            format_for(raw, Path::new("x.zzz"), "-o").expect("raw"),
            FormatArg::Raw
        );
        // An explicit format the extension disagrees with: obeyed, warned.
        let warn = |f, p: &str| extension_disagrees(f, Path::new(p), "-o");
        assert_eq!(
            warn(FormatArg::Json, "t.dat").as_deref(),
            Some("t.dat (-o) is written as --format json, though `.dat` names --format dat")
        );
        assert!(warn(FormatArg::Dat, "t.JSON").is_some());
        for (f, p) in [
            (FormatArg::Dat6, "t.dat"),
            (FormatArg::Json, "t.json"),
            (FormatArg::Text, "t.txt"),
            (FormatArg::Raw, "t.zzz"),
            (FormatArg::Perfetto, "-"),
        ] {
            assert_eq!(warn(f, p), None, "{p}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn output_modes() {
        assert_eq!(parse_mode("0600"), Ok(0o600));
        assert_eq!(parse_mode("644"), Ok(0o644));
        assert_eq!(parse_mode("0o640"), Ok(0o640));
        for bad in [
            "", "6", "64", "4755", "1777", "0x644", "0888", "u+r", "00644",
        ] {
            assert!(parse_mode(bad).is_err(), "{bad}");
        }
        let dir = std::env::temp_dir();
        let t = OutputModeArg { output_mode: 0o644 }
            .check(&dir.join("x.dat"), "-o")
            .expect("check");
        assert_eq!(t.mode(), 0o644);
        let t = check_destination(&dir.join("x.dat"), "-o").expect("check");
        assert_eq!(t.mode(), OutputTarget::PRIVATE);
    }
}
