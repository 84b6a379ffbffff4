//! `hyptrace report` and `hyptrace convert`: read any trace hyptrace reads — trace.dat
//! v6/v7/v7-zstd (ours or the kernel's, via trace-cmd) or a raw page stream (`record
//! --format raw`), told apart by their magic — and print it as `trace-cmd report -t`
//! does, or write it in any output format of `record` (the sinks of the run pipeline,
//! [`crate::drain::sink::make_sink`], so every format `record` writes is a `convert` target).
//!
//! Both stream: a trace.dat is read a page (or a compression chunk) per CPU at a time, a
//! raw stream a page per CPU at a time; memory does not grow with the file.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use hyptrace_output::tracedat::{FilterCounts, FilterSet, ReportOutcome};
use hyptrace_output::{
    tracedat::MAGIC as DAT_MAGIC, DatError, KernelCpuStat, Missed, OutputError, PageSink, RawError,
    RawReader, ReportFilter, RunSummary, TextSink, TraceFile, TraceMeta,
};

use crate::drain::sink::{behind_filters, format_for, Filters, Format};
use crate::pipeline::options::{self, ConvertArgs, ReportArgs};
use hyptrace_output::tracedat::{
    cursors_of, meta_of, pump_by_cpu, pump_cursors, pump_pages, PageCursors, PageSource,
};

/// What a trace file is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// trace.dat (any version; the reader checks it).
    TraceDat,
    /// A raw page stream (`record --format raw`).
    Raw,
}

/// Why `report` or `convert` failed.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// The input is not a readable trace (exit 2): its name (`stdin` for `-`), then the
    /// reader's error (the source; a path it carried left out: the name says it).
    #[error("{name}")]
    Input {
        /// The input's name.
        name: String,
        /// What the reader found.
        #[source]
        source: OutputError,
    },
    /// The input cannot be read (exit 2): its name, then the I/O error.
    #[error("{name}")]
    ReadInput {
        /// The input's name.
        name: String,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// The input starts with neither magic (exit 2).
    #[error("{name}: not a trace.dat, nor a hyptrace raw page stream (bad magic)")]
    NotATrace {
        /// The input's name.
        name: String,
    },
    /// A trace.dat piped to stdin cannot be copied to the temporary file it is read from
    /// (exit 2).
    #[error("stdin: cannot copy the trace.dat to a temporary file in {}", dir.display())]
    Spool {
        /// The temporary directory.
        dir: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// A trace.dat with buffer instances asked for what cannot keep them (exit 2):
    /// `PATH: N buffer instances (NAMES): WHY`.
    #[error("{}: {count} buffer instances ({}{}): {why}", path.display(), names.join(", "), if *count > names.len() { ", ..." } else { "" })]
    Instances {
        /// The input.
        path: PathBuf,
        /// Its instances.
        count: usize,
        /// The first few instances' names.
        names: Vec<String>,
        /// What cannot keep them, and what can.
        why: &'static str,
    },
    /// `report --events` (exit 2).
    #[error("report has no --events (that is run/record's event count); to select events use -F [SYSTEM:]EVENT")]
    EventsMisused,
    /// `report` of a raw page stream with an option only a trace.dat answers (exit 2).
    #[error("{}: --skip, --count, --cpus, --first-event and --last-event need a trace.dat; convert the raw stream first: hyptrace convert -i {} -o trace.dat", path.display(), path.display())]
    RawNeedsDat {
        /// The input.
        path: PathBuf,
    },
    /// `convert` to a raw page stream of a trace with events other than hyptrace's own
    /// guest events (exit 2).
    #[error("{}: event {system}:{name} has no place in a raw page stream (it carries no event formats; only hyptrace's own guest events convert to raw)", path.display())]
    NotRaw {
        /// The input.
        path: PathBuf,
        /// The event's system.
        system: String,
        /// The event's name.
        name: String,
    },
    /// A `-F` filter is refused (exit 2).
    #[error(transparent)]
    Filter(#[from] hyptrace_output::tracedat::FilterError),
    /// The output path is unusable (exit 2).
    #[error(transparent)]
    Destination(#[from] crate::drain::sink::DestinationError),
    /// `report`: writing the report to stdout failed.
    #[error("writing the report")]
    Write(#[source] std::io::Error),
    /// `convert`: writing the output failed.
    #[error(transparent)]
    Output(OutputError),
    /// The trace.dat is damaged: every readable event was printed or converted, each
    /// damaged part named in a warning (exit 1; docs/output.md "Damaged files").
    #[error("{}: damaged trace.dat ({count} damaged {}): every readable event was {done}", path.display(), if *count == 1 { "part" } else { "parts" })]
    Damaged {
        /// The input.
        path: std::path::PathBuf,
        /// How many damaged parts were read past.
        count: usize,
        /// "printed" or "converted".
        done: &'static str,
    },
    /// `--compression` asked of a format that is not compressed (exit 2).
    #[error(transparent)]
    Compression(#[from] crate::drain::sink::CompressionMismatch),
    /// `-o clickhouse://...`: a bad URL (exit 2) or a server that cannot be used.
    #[error(transparent)]
    ClickHouse(#[from] crate::drain::sink::ServerOutputError),
    /// The trace.dat is damaged where nothing after the damage can be found (its file
    /// header, its options chain, its CPU table): nothing was read (exit 1). Its name,
    /// then the damage (the source).
    #[error("{name}: damaged trace.dat, nothing is readable")]
    Unreadable {
        /// The input's name.
        name: String,
        /// The damage.
        #[source]
        source: DatError,
    },
}

impl ConvertError {
    /// 2 for bad input or an unusable output path, else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Input { .. }
            | Self::ReadInput { .. }
            | Self::NotATrace { .. }
            | Self::Spool { .. }
            | Self::Instances { .. }
            | Self::EventsMisused
            | Self::RawNeedsDat { .. }
            | Self::NotRaw { .. }
            | Self::Filter(_)
            | Self::Destination(_)
            | Self::Compression(_) => crate::exit::EXIT_USAGE,
            Self::ClickHouse(e) if e.is_usage() => crate::exit::EXIT_USAGE,
            Self::ClickHouse(_) => crate::exit::EXIT_RUNTIME,
            Self::Write(_) | Self::Output(_) | Self::Damaged { .. } | Self::Unreadable { .. } => {
                crate::exit::EXIT_RUNTIME
            }
        }
    }
}

/// Where `convert` writes: a file in a format, or a ClickHouse server.
enum Destination {
    File {
        target: hyptrace_output::OutputTarget,
        format: Format,
        compression: hyptrace_output::Compression,
    },
    ClickHouse {
        url: hyptrace_clickhouse::ClickHouseUrl,
        client: hyptrace_clickhouse::Client,
    },
}

/// `-o` of `convert`, checked before the input is read: a path (its format, the file
/// writable) or `clickhouse://...` (the URL, the server reached, its tables created).
fn destination(a: &ConvertArgs) -> Result<Destination, ConvertError> {
    if let Some(url) = a
        .output
        .to_str()
        .filter(|s| hyptrace_clickhouse::is_clickhouse_url(s))
    {
        let formatted = a.format.is_some() || a.compression.is_some();
        let (url, client) = crate::drain::sink::clickhouse_output(url, formatted)?;
        return Ok(Destination::ClickHouse { url, client });
    }
    let format = format_for(options::format(a.format), &a.output, "-o")?;
    let compression = crate::drain::sink::compression_for(format, a.compression.map(Into::into))?;
    let target = a.files.check(&a.output, "-o")?;
    Ok(Destination::File {
        target,
        format,
        compression,
    })
}

impl Destination {
    /// The file's target, format and compression (none for a server).
    fn file(
        &self,
    ) -> Option<(
        &hyptrace_output::OutputTarget,
        Format,
        hyptrace_output::Compression,
    )> {
        match self {
            Self::File {
                target,
                format,
                compression,
            } => Some((target, *format, *compression)),
            Self::ClickHouse { .. } => None,
        }
    }

    /// The file format (none for a server).
    fn format(&self) -> Option<Format> {
        self.file().map(|(_, format, _)| format)
    }

    /// The sink of a trace `meta` describes, read from `input` (the VM's name on the
    /// rows: the URL's `?vm=`, else the input's file stem).
    fn sink(
        &self,
        meta: TraceMeta,
        input: &Path,
    ) -> Result<Box<dyn PageSink + Send>, ConvertError> {
        match self {
            Self::File {
                target,
                format,
                compression,
            } => crate::drain::sink::make_sink(target, *format, *compression, meta)
                .map_err(ConvertError::Output),
            Self::ClickHouse { url, client } => {
                use hyptrace_clickhouse::{ClickHouseSink, Options, RunIdentity};
                let stem = input.file_stem().map(|s| s.to_string_lossy().into_owned());
                let vm = url.vm.clone().or(stem).unwrap_or_else(|| "stdin".into());
                let who = RunIdentity::new(Some(&vm));
                let s = ClickHouseSink::new(
                    client.clone(),
                    &url.database,
                    who,
                    meta,
                    Options::default(),
                )
                .map_err(ConvertError::Output)?;
                Ok(Box::new(s))
            }
        }
    }
}

/// An input path for messages; `-` is stdin.
fn input_name(path: &Path) -> std::borrow::Cow<'_, str> {
    if path.as_os_str() == "-" {
        "stdin".into()
    } else {
        path.to_string_lossy()
    }
}

/// An error reading the input `path`, which names it once: its name first, the path
/// an I/O error or a raw stream's error carried (the input's, or the descriptor stdin
/// is read through) left out.
fn input_error(path: &Path, e: impl Into<OutputError>) -> ConvertError {
    let name = input_name(path).into_owned();
    match e.into() {
        OutputError::Io {
            path: Some(_),
            source,
        } => ConvertError::ReadInput { name, source },
        OutputError::Dat(d) => match *d {
            DatError::Io { source, .. } => ConvertError::ReadInput { name, source },
            d => ConvertError::Input {
                name,
                source: d.into(),
            },
        },
        OutputError::Raw(RawError::Io { source, .. }) => ConvertError::ReadInput { name, source },
        OutputError::Raw(RawError::Malformed { problem, .. }) => ConvertError::Input {
            name,
            source: RawError::Malformed {
                path: None,
                problem,
            }
            .into(),
        },
        source => ConvertError::Input { name, source },
    }
}

/// An input trace, opened: a trace.dat (read by offset) or a raw page stream (read
/// front to back).
pub enum Input {
    /// A trace.dat, and how many damaged parts its opening warned about.
    TraceDat(Box<TraceFile>, usize),
    /// A raw page stream (`record --format raw`).
    Raw(RawReader),
}

/// An I/O error reading `path` as an input error.
fn read_error(path: &Path, source: std::io::Error) -> ConvertError {
    ConvertError::ReadInput {
        name: input_name(path).into_owned(),
        source,
    }
}

/// Up to 10 bytes from the start of `r`: enough for either magic.
fn read_head(r: &mut dyn Read, path: &Path) -> Result<Vec<u8>, ConvertError> {
    let mut head = [0u8; 10];
    let mut n = 0;
    // Bounded: each read fills part of 10 bytes or ends.
    while n < head.len() {
        match r.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(read_error(path, e)),
        }
    }
    Ok(head[..n].to_vec())
}

/// Tells a trace.dat from a raw page stream by its first bytes.
fn kind_of(head: &[u8], path: &Path) -> Result<InputKind, ConvertError> {
    if head.starts_with(DAT_MAGIC) {
        Ok(InputKind::TraceDat)
    } else if hyptrace_output::is_raw_stream(head) {
        Ok(InputKind::Raw)
    } else {
        Err(ConvertError::NotATrace {
            name: input_name(path).into_owned(),
        })
    }
}

/// Opens a trace.dat: a file whose metadata is damaged beyond reading is a damaged
/// file (exit 1), an unsupported one bad input (exit 2). The damage `open` read past
/// is warned about, one line each; returns the file and how many there were. `at` is
/// what is opened (stdin's `/proc/self/fd/N`), `path` the name messages show.
fn open_dat(at: &Path, path: &Path) -> Result<(TraceFile, usize), ConvertError> {
    let file = TraceFile::open(at).map_err(|e| match e {
        source @ DatError::Format { .. } => ConvertError::Unreadable {
            name: input_name(path).into_owned(),
            source,
        },
        e => input_error(path, e),
    })?;
    for d in &file.damage {
        warn_damage(path, d);
    }
    let n = file.damage.len();
    Ok((file, n))
}

/// A trace.dat with buffer instances (`hyptrace collect`'s, trace-cmd's `record -B`)
/// converts to JSON and Perfetto (a process per instance, [`grouped`]), text
/// (`report`'s, [`report_into`]) and trace.dat v7 ([`instances_to_dat`]); to the other
/// formats, which cannot name an instance on an event, it is refused (exit 2) rather
/// than converted without them; `report` prints every instance.
fn refuse_instances(f: &TraceFile, path: &Path) -> Result<(), ConvertError> {
    if f.instances.is_empty() {
        return Ok(());
    }
    Err(instances_error(
        f,
        path,
        "convert writes such a file only as trace.dat v7 (the instances kept), JSON or Perfetto (a process per instance) or text; `hyptrace report` prints every instance's events (trace-cmd and KernelShark read the file as it is)",
    ))
}

/// The one line (exit 2) of why `path`, a file with buffer instances, does not
/// convert: `PATH: N buffer instances (NAMES): WHY`.
fn instances_error(f: &TraceFile, path: &Path, why: &'static str) -> ConvertError {
    ConvertError::Instances {
        path: path.to_path_buf(),
        count: f.instances.len(),
        names: f.instances.iter().take(8).map(|i| i.name.clone()).collect(),
        why,
    }
}

/// The one-line warning of a damaged part of `path`.
fn warn_damage(path: &Path, d: &hyptrace_output::tracedat::Damage) {
    let line = format!("{}: damaged: {d}", path.display());
    note!("hyptrace: warning: {}", crate::exit::printable(&line));
}

/// Opens the input `path` (`-`: stdin), told apart by its magic.
pub fn open_input(path: &Path) -> Result<Input, ConvertError> {
    if path.as_os_str() == "-" {
        return open_stdin(path);
    }
    let mut f = std::fs::File::open(path).map_err(|e| read_error(path, e))?;
    match kind_of(&read_head(&mut f, path)?, path)? {
        InputKind::TraceDat => open_dat(path, path).map(|(f, n)| Input::TraceDat(Box::new(f), n)),
        InputKind::Raw => RawReader::open(path)
            .map(Input::Raw)
            .map_err(|e| input_error(path, e)),
    }
}

/// Stdin as the input. A raw page stream is read from it as it comes (a page per CPU
/// held). A trace.dat is read by offset: stdin redirected from a file is that file
/// (`/proc/self/fd/0`); a pipe is first copied to an unlinked temporary file in
/// $TMPDIR (disk, not memory: memory does not grow with the input), removed by the
/// system when the reader closes it, whatever way the process ends.
fn open_stdin(path: &Path) -> Result<Input, ConvertError> {
    use std::os::fd::AsRawFd;
    let mut stdin = std::io::stdin();
    let head = read_head(&mut stdin, path)?;
    match kind_of(&head, path)? {
        InputKind::Raw => {
            let r = std::io::Cursor::new(head).chain(stdin);
            RawReader::from_reader(Box::new(r), "stdin")
                .map(Input::Raw)
                .map_err(|e| input_error(path, e))
        }
        InputKind::TraceDat => {
            let fd0 = Path::new("/proc/self/fd/0");
            let regular = std::fs::metadata(fd0).is_ok_and(|m| m.is_file());
            if regular {
                return open_dat(fd0, path).map(|(f, n)| Input::TraceDat(Box::new(f), n));
            }
            let spool_err = |source| ConvertError::Spool {
                dir: std::env::temp_dir(),
                source,
            };
            let mut spool = tempfile::tempfile().map_err(spool_err)?;
            spool.write_all(&head).map_err(spool_err)?;
            std::io::copy(&mut stdin.lock(), &mut spool).map_err(spool_err)?;
            let at = PathBuf::from(format!("/proc/self/fd/{}", spool.as_raw_fd()));
            // The reader opens its own descriptor of the spool; this one may close.
            open_dat(&at, path).map(|(f, n)| Input::TraceDat(Box::new(f), n))
        }
    }
}

/// A failed write to stdout: quiet for a closed pipe (`| head`), else an error.
fn stdout_result(e: OutputError, path: &Path) -> Result<(), ConvertError> {
    match e {
        OutputError::Io { path: None, source } => {
            if source.kind() == std::io::ErrorKind::BrokenPipe {
                Ok(())
            } else {
                Err(ConvertError::Write(source))
            }
        }
        e => Err(input_error(path, e)),
    }
}

/// The report filter of the command line.
fn filter(a: &ReportArgs) -> ReportFilter {
    let cpus = (!a.cpu.is_empty()).then(|| a.cpu.iter().flatten().copied().collect());
    ReportFilter {
        cpus,
        events: a.filters.filter.clone(),
        skip: a.skip,
        limit: a.count,
        threads: 0,
    }
}

/// `hyptrace report`.
pub fn report(a: &ReportArgs) -> Result<(), ConvertError> {
    let path = a.path();
    if a.events_misused.is_some() {
        return Err(ConvertError::EventsMisused);
    }
    let f = filter(a);
    match open_input(&path)? {
        Input::TraceDat(file, mut damage) => {
            let mut out = std::io::stdout().lock();
            let damaged = |count: usize| match count {
                0 => Ok(()),
                count => Err(ConvertError::Damaged {
                    path: path.clone(),
                    count,
                    done: "printed",
                }),
            };
            if a.list_cpus || a.first_event || a.last_event || a.stat {
                let text = if a.list_cpus || a.first_event || a.last_event {
                    cpu_list(&file, a, &path)?
                } else {
                    file.stat_text()
                };
                return match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                    Err(e) => stdout_result(e.into(), &path),
                    Ok(()) => damaged(damage),
                };
            }
            // Checked before the first line: a bad filter is exit 2 with nothing printed.
            FilterSet::compile(&f.events, &file.formats)?;
            let r = file.write_report_outcome(&mut out, &f, &mut |d| {
                damage += 1;
                warn_damage(&path, &d);
            });
            match r {
                Ok(o) => {
                    note_unmatched(a, &o);
                    damaged(damage)
                }
                Err(e) => stdout_result(e, &path),
            }
        }
        Input::Raw(reader) => report_raw(a, &f, &path, reader),
    }
}

/// Says on stderr which `-F` filters and which `--cpu` list matched no event of the
/// file (once the whole file was read: `--count` may stop it first).
fn note_unmatched(a: &ReportArgs, o: &ReportOutcome) {
    if !o.complete {
        return;
    }
    let cpus: Vec<String> = a.cpu.iter().flatten().map(u32::to_string).collect();
    if !cpus.is_empty() && o.read == 0 {
        note!(
            "hyptrace: --cpu {} matched no event of the file",
            cpus.join(",")
        );
        return;
    }
    let on = if cpus.is_empty() {
        String::new()
    } else {
        format!(" on --cpu {}", cpus.join(","))
    };
    for spec in &o.unmatched {
        let line = format!("-F '{spec}' matched no event of the file{on}");
        note!("hyptrace: {}", crate::exit::printable(&line));
    }
}

/// `--cpus`, `--first-event`, `--last-event`: trace-cmd's list of the CPUs with data,
/// with the times of their first/last events (µs, rounded, as trace-cmd prints them).
fn cpu_list(f: &TraceFile, a: &ReportArgs, path: &Path) -> Result<String, ConvertError> {
    use std::fmt::Write as _;
    let mut s = format!("List of CPUs in {} with data:\n", path.display());
    let mut cpus: Vec<u32> = f
        .cpus
        .iter()
        .filter(|b| b.size > 0)
        .map(|b| b.cpu)
        .collect();
    cpus.sort_unstable();
    cpus.dedup();
    let t = |ns: u64| {
        let us = ns.saturating_add(500) / 1000;
        format!("{:5}.{:06}", us / 1_000_000, us % 1_000_000)
    };
    for cpu in cpus {
        if a.cpu.iter().flatten().next().is_some() && !a.cpu.iter().flatten().any(|&c| c == cpu) {
            continue;
        }
        let _ = write!(s, "  {cpu}");
        if a.first_event || a.last_event {
            if let Some((first, last)) = f.cpu_span(cpu).map_err(|e| input_error(path, e))? {
                if a.first_event {
                    let _ = write!(s, "\tFirst event:{}", t(first));
                }
                if a.last_event {
                    let _ = write!(s, "\tLast event:{}", t(last));
                }
            }
        }
        s.push('\n');
    }
    Ok(s)
}

/// `report` of a raw page stream: replayed into the text sink of `record --format
/// text` (the same lines as the run printed).
fn report_raw(
    a: &ReportArgs,
    f: &ReportFilter,
    path: &Path,
    reader: RawReader,
) -> Result<(), ConvertError> {
    if f.skip > 0 || f.limit.is_some() || a.list_cpus || a.first_event || a.last_event {
        return Err(ConvertError::RawNeedsDat {
            path: path.to_path_buf(),
        });
    }
    let cpus: Option<BTreeSet<u32>> = f.cpus.clone();
    let want = move |c: u32| cpus.as_ref().is_none_or(|s| s.contains(&c));
    if a.stat {
        let summary = std::sync::Arc::new(std::sync::Mutex::new(None));
        let sink = Box::new(StatSink(summary.clone()));
        reader
            .replay(sink, want)
            .map_err(|e| input_error(path, e))?;
        let s = summary
            .lock()
            .map(|g| g.clone())
            .unwrap_or_default()
            .unwrap_or_default();
        let text = stat_text(&s);
        let mut out = std::io::stdout().lock();
        return match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
            Err(e) => stdout_result(e.into(), path),
            Ok(()) => Ok(()),
        };
    }
    use hyptrace_output::StreamSink as _;
    let meta = reader.meta();
    let filters = compile_filters(&f.events, &meta)?;
    let sink =
        TextSink::to_writer(Box::new(std::io::stdout()), meta).map_err(|e| input_error(path, e))?;
    let (sink, counts) = behind_filters(Box::new(sink), filters, PageSource::Ring);
    match reader.replay(sink, want) {
        Ok(()) => {
            if let Some(c) = counts {
                note_unmatched(a, &outcome_of(&c));
            }
            Ok(())
        }
        Err(e) => stdout_result(e, path),
    }
}

/// The `-F` filters of a command compiled against `meta` (a bad one: exit 2).
fn compile_filters(specs: &[String], meta: &TraceMeta) -> Result<Option<Filters>, ConvertError> {
    Ok(Filters::compile(specs, meta)?)
}

/// What a whole input's -F kept, as a report's outcome.
fn outcome_of(c: &FilterCounts) -> ReportOutcome {
    ReportOutcome {
        printed: c.kept(),
        read: c.kept().saturating_add(c.dropped()),
        complete: true,
        unmatched: c.unmatched(),
    }
}

/// `convert -F`: how many events the filters kept and dropped, and each filter that
/// passed none, on stderr.
fn note_filtered(c: &FilterCounts) {
    let read = c.kept().saturating_add(c.dropped());
    note!(
        "hyptrace: -F kept {} of {read} events ({} dropped by the filter, not lost)",
        c.kept(),
        c.dropped()
    );
    if c.cut() > 0 {
        note!(
            "hyptrace: -F: {} page(s) stopped early (damaged, or a kept event did not fit)",
            c.cut()
        );
    }
    for spec in c.unmatched() {
        let line = format!("-F '{spec}' matched no event of the file");
        note!("hyptrace: {}", crate::exit::printable(&line));
    }
}

/// The `--stat` block of a raw stream's end record (as `trace-cmd report --stat`
/// prints a trace.dat's CPUSTAT options).
fn stat_text(s: &RunSummary) -> String {
    let mut t = String::from(
        "\nKernel buffer statistics:\n  Note: \"entries\" are the entries left in the kernel ring buffer and are not\n        recorded in the trace data. They should all be zero.\n\n",
    );
    for (cpu, c) in s.cpus.iter().enumerate() {
        let c: &KernelCpuStat = c;
        t.push_str(&c.to_cpustat_text(cpu as u32));
        if !t.ends_with('\n') {
            t.push('\n');
        }
        t.push('\n');
    }
    t
}

/// Keeps only the end record's stats.
struct StatSink(std::sync::Arc<std::sync::Mutex<Option<RunSummary>>>);

impl PageSink for StatSink {
    fn page(&mut self, _cpu: u32, _page: &[u8], _missed: Missed) -> Result<(), OutputError> {
        Ok(())
    }

    fn trailing_lost(&mut self, _cpu: u32, _lost: u64) -> Result<(), OutputError> {
        Ok(())
    }

    fn finish(self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        if let Ok(mut g) = self.0.lock() {
            *g = Some(summary.clone());
        }
        Ok(())
    }
}

/// The CPUs of a trace.dat with buffer instances as one sink's
/// ([`TraceMeta::groups`]): the top level's CPUs first when it has data (a process of
/// their own), then each instance a group of its name, its CPUs after the earlier
/// ones' (named from the file's cmdlines as vCPUs of the instance); with the pages of
/// each, numbered so.
fn grouped(f: &TraceFile) -> Result<(TraceMeta, PageCursors), OutputError> {
    let mut meta = meta_of(f);
    let mut cursors: PageCursors = Vec::new();
    if f.cpus.iter().any(|b| b.size > 0) {
        cursors.extend(cursors_of(f));
    } else {
        meta.nr_cpus = 0;
        meta.cmdlines.clear();
    }
    for (i, inst) in f.instances.iter().enumerate() {
        let count = inst.cpus.iter().map(|b| b.cpu.saturating_add(1)).max();
        let first = meta.nr_cpus;
        meta.push_group(&inst.name, count.unwrap_or(1), Some(&f.cmdlines))?;
        let pages = f.instance_pages(i).unwrap_or_default();
        cursors.extend(pages.into_iter().map(|c| (first + c.cpu(), c)));
    }
    meta.validate()?;
    Ok((meta, cursors))
}

/// What a trace.dat with buffer instances needs to convert to one (exit 2 if not): no
/// `-F` (each instance would need its own filter counts), no data in the top level
/// (the file written has the instances only, as `collect` writes).
fn check_instances_to_dat(
    f: &TraceFile,
    specs: &[String],
    path: &Path,
) -> Result<(), ConvertError> {
    let why = if !specs.is_empty() {
        "-F is not taken when the output keeps buffer instances (filter into JSON, Perfetto or text)"
    } else if f.cpus.iter().any(|b| b.size > 0) {
        "its top-level buffer holds data besides the instances: a trace.dat of instances only is written (convert it to JSON, Perfetto or text)"
    } else {
        return Ok(());
    };
    Err(instances_error(f, path, why))
}

/// A trace.dat with buffer instances into a trace.dat v7 keeping them: each instance
/// first written, CPU by CPU, as a part (a single-buffer trace.dat of its own in a
/// temporary directory next to the output), then the parts become the instances of
/// one file ([`hyptrace_output::write_buffers`], as `collect` assembles its VMs').
/// Every instance must be on a clock of nanoseconds (no TSC2NSEC/OFFSET: `collect`'s
/// files are); another is refused by the assembly, named.
fn instances_to_dat(
    f: &TraceFile,
    target: &hyptrace_output::OutputTarget,
    compression: hyptrace_output::Compression,
    on_damage: &mut dyn FnMut(hyptrace_output::tracedat::Damage),
) -> Result<(), OutputError> {
    use hyptrace_output::{BufferPart, OutputTarget, TraceDatSink, TraceDatVersion};
    let dir = target.spill_dir();
    let tmp = tempfile::Builder::new()
        .prefix(".hyptrace-convert.")
        .tempdir_in(&dir)
        .map_err(|source| OutputError::Io {
            path: Some(dir.clone()),
            source,
        })?;
    let base = meta_of(f);
    let mut parts = Vec::with_capacity(f.instances.len());
    for (i, inst) in f.instances.iter().enumerate() {
        let count = inst.cpus.iter().map(|b| b.cpu.saturating_add(1)).max();
        let meta = TraceMeta {
            nr_cpus: count.unwrap_or(1),
            ..base.clone()
        };
        let path = tmp.path().join(format!("{i}.dat"));
        let part = OutputTarget::check(&path)?;
        let sink = TraceDatSink::open_with(&part, meta, TraceDatVersion::V7, compression)?;
        let cursors = f.instance_pages(i).unwrap_or_default();
        let cursors = cursors.into_iter().map(|c| (c.cpu(), c)).collect();
        pump_by_cpu(cursors, Box::new(sink), on_damage, false)?;
        parts.push(BufferPart {
            name: inst.name.clone(),
            path,
        });
    }
    hyptrace_output::write_buffers(target, base, &parts).map(drop)
}

/// `report`'s text of `f` (every buffer instance's lines after its name, as
/// `trace-cmd report -t` prints them), the events `specs` (-F) pass, into `target`.
fn report_into(
    f: &TraceFile,
    specs: &[String],
    target: &hyptrace_output::OutputTarget,
    on_damage: &mut dyn FnMut(hyptrace_output::tracedat::Damage),
) -> Result<(), OutputError> {
    let filter = ReportFilter {
        events: specs.to_vec(),
        ..ReportFilter::default()
    };
    let mut out = std::io::BufWriter::with_capacity(1 << 16, target.open()?);
    f.write_report_outcome(&mut out, &filter, on_damage)?;
    let out = out.into_inner().map_err(|e| {
        let (err, file) = e.into_parts();
        file.get_ref().error(err)
    })?;
    out.finish()
}

/// Pages of CPUs, each with its CPU in the sink ([`pump_cursors`]).
/// A raw page stream carries no event formats (its reader assumes hyptrace's guest
/// events): only a trace of those converts to raw.
fn check_raw_formats(f: &TraceFile, path: &Path) -> Result<(), ConvertError> {
    let guest = hyptrace_output::guest_formats();
    match f
        .formats
        .iter()
        .find(|x| !x.is_trailing_lost() && !guest.contains(x))
    {
        None => Ok(()),
        Some(x) => Err(ConvertError::NotRaw {
            path: path.to_path_buf(),
            system: x.system.clone(),
            name: x.name.clone(),
        }),
    }
}

/// `hyptrace convert`.
pub fn convert(a: &ConvertArgs) -> Result<(), ConvertError> {
    let dest = destination(a)?;
    let input = open_input(&a.input)?;
    let mut damage = 0usize;
    let specs = &a.filters.filter;
    let (r, counts) = match (input, dest.file()) {
        (Input::Raw(reader), _) => {
            let meta = reader.meta();
            let filters = compile_filters(specs, &meta)?;
            let sink = dest.sink(meta, &a.input)?;
            let (sink, counts) = behind_filters(sink, filters, PageSource::Ring);
            (reader.replay(sink, |_| true), counts)
        }
        (Input::TraceDat(f, n), Some((target, Format::Dat, compression)))
            if !f.instances.is_empty() =>
        {
            damage = n;
            check_instances_to_dat(&f, specs, &a.input)?;
            let mut on_damage = |d| {
                damage += 1;
                warn_damage(&a.input, &d);
            };
            (
                instances_to_dat(&f, target, compression, &mut on_damage),
                None,
            )
        }
        (Input::TraceDat(f, n), Some((target, Format::Text, _))) if !f.instances.is_empty() => {
            damage = n;
            // `report`'s text: every instance's lines after its name.
            FilterSet::compile(specs, &f.formats)?;
            let mut on_damage = |d| {
                damage += 1;
                warn_damage(&a.input, &d);
            };
            (report_into(&f, specs, target, &mut on_damage), None)
        }
        (Input::TraceDat(f, n), _) => {
            damage = n;
            if dest.format() == Some(Format::Raw) {
                check_raw_formats(&f, &a.input)?;
            }
            // Buffer instances: JSON and Perfetto only, a process per instance.
            let (meta, cursors) = if f.instances.is_empty() {
                (meta_of(&f), None)
            } else {
                if !matches!(dest.format(), Some(Format::Json | Format::Perfetto)) {
                    refuse_instances(&f, &a.input)?;
                }
                let (m, c) = grouped(&f).map_err(|e| input_error(&a.input, e))?;
                (m, Some(c))
            };
            let filters = compile_filters(specs, &meta)?;
            let sink = dest.sink(meta, &a.input)?;
            let (sink, counts) = behind_filters(sink, filters, PageSource::TraceDat);
            let filtered = counts.is_some();
            let mut on_damage = |d| {
                damage += 1;
                warn_damage(&a.input, &d);
            };
            let r = match (cursors, dest.format()) {
                (Some(c), _) => pump_cursors(c, sink, &mut on_damage, filtered),
                // A trace.dat keeps each CPU's data in one piece: fed CPU by CPU, it is
                // written once, straight to its place.
                (None, Some(Format::Dat | Format::Dat6)) => {
                    pump_by_cpu(cursors_of(&f), sink, &mut on_damage, filtered)
                }
                (None, _) => pump_pages(&f, sink, &mut on_damage, filtered),
            };
            (r, counts)
        }
    };
    if let (Ok(()), Some(c)) = (&r, &counts) {
        note_filtered(c);
    }
    if r.is_ok() && damage > 0 {
        return Err(ConvertError::Damaged {
            path: a.input.clone(),
            count: damage,
            done: "converted",
        });
    }
    r.map_err(|e| match e {
        OutputError::Dat(_) | OutputError::Raw(_) => input_error(&a.input, e),
        e => ConvertError::Output(e),
    })
}
