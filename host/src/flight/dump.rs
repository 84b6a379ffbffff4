//! Post-mortem dumps: every committed event no reader consumed, written to a file in
//! any `record` format — from the guest memory of a VM whose guest crashed or hung
//! (`--crash-dump`, written by the run pipeline) and from a trace memory file
//! (`hyptrace dump --trace-mem PATH`: after the VMM was killed, or of a finished run).
//!
//! Both walk the rings read-only with `hyptrace_reader::postmortem::walk_cpu` (no
//! swaps, nothing asked of the guest, nothing trusted): per CPU the reader page from
//! where its reader stopped, then the ring pages in `page_seq` order, with the exact
//! losses from the pages' `first_index`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};

use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::SharedMem;
use hyptrace_output::{
    format_guest_line, guest_printers, Clock, EventFormat, EventPrinter, Missed, OutputError,
    OutputTarget, PageSink, RunSummary, TraceMeta,
};
use hyptrace_reader::postmortem::{walk_cpu, CpuDump, Position};
use hyptrace_reader::trace_file;

use crate::drain::sink::Format;
use crate::exit::{EXIT_OK, EXIT_RUNTIME, EXIT_USAGE};

/// Where `hyptrace dump` reads the rings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DumpSource {
    /// A trace memory file (`--trace-mem PATH`).
    TraceMem(PathBuf),
    /// A running VMM's control socket (`--attach SOCKET`), once or until it exits
    /// (`follow`).
    Attach {
        /// The socket.
        socket: PathBuf,
        /// `--follow`.
        follow: bool,
    },
}

/// What `hyptrace dump` does, typed (converted from the options `dump` parses).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpPlan {
    /// The source (`None`: neither was given, refused).
    pub source: Option<DumpSource>,
    /// The output file (`-` is stdout).
    pub output: PathBuf,
    /// The output format (`None`: from the extension).
    pub format: Option<Format>,
    /// How the output file is made (its permission bits, the page cache).
    pub files: crate::drain::sink::FileOpts,
}

/// Why a dump failed.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// The trace memory file cannot be read.
    #[error("cannot read {path}", path = .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The path is not a regular file, or cannot be opened (F4).
    #[error("--trace-mem {path}", path = .path.display())]
    Open {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        why: crate::flight::trace_mem::FileProblem,
    },
    /// The header declares more than the file holds (F5).
    #[error("{path}: the header declares {declared} bytes, the file holds {held}: truncated or not a trace memory file", path = .path.display())]
    Short {
        /// The file.
        path: PathBuf,
        /// Bytes the header declares.
        declared: u64,
        /// Bytes the file holds.
        held: u64,
    },
    /// The file got shorter while it was read (F5).
    #[error("{path}: the file shrank while it was read ({read} of {declared} bytes): another process truncated it", path = .path.display())]
    Shrunk {
        /// The file.
        path: PathBuf,
        /// Bytes read.
        read: u64,
        /// Bytes the header declares.
        declared: u64,
    },
    /// The trace memory file is not usable.
    #[error("{path}", path = .path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: trace_file::FileError,
    },
    /// The output failed.
    #[error("cannot write {path}", path = .path.display())]
    Output {
        /// The output.
        path: PathBuf,
        /// Why.
        #[source]
        source: OutputError,
    },
}

impl DumpError {
    /// 2 for input that cannot be used, 1 for an output failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Output { .. } => EXIT_RUNTIME,
            _ => EXIT_USAGE,
        }
    }
}

/// What a dump found, per CPU.
#[derive(Debug, Default)]
pub struct DumpReport {
    /// One entry per CPU walked.
    pub cpus: Vec<CpuDump>,
}

impl DumpReport {
    /// Events dumped in all.
    pub fn events(&self) -> u64 {
        self.cpus
            .iter()
            .map(|c| c.events)
            .fold(0, u64::saturating_add)
    }

    /// Whether any CPU's walk skipped or cut something.
    pub fn damaged(&self) -> bool {
        self.cpus.iter().any(CpuDump::damaged)
    }

    /// The per-CPU lines of the summary on stderr (events, losses, warnings).
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for c in &self.cpus {
            let _ = writeln!(
                s,
                "hyptrace: dump: cpu {}: {} events, {} lost before them, {} lost after the last page (writer index {})",
                c.cpu, c.events, c.lost, c.trailing_lost, c.writer_index
            );
            for w in &c.warnings {
                let _ = writeln!(s, "hyptrace: dump: warning: {w}");
            }
            if c.more_warnings > 0 {
                let _ = writeln!(
                    s,
                    "hyptrace: dump: warning: cpu {}: {} more warnings",
                    c.cpu, c.more_warnings
                );
            }
        }
        s
    }

    /// "vcpu N: last event: <line as `run` prints it>" for every CPU, for a crash report.
    pub fn last_events(&self, clock: &Clock, formats: &[EventFormat]) -> String {
        let printers: BTreeMap<u16, EventPrinter> = if formats.is_empty() {
            guest_printers()
        } else {
            formats
                .iter()
                .map(|f| (f.id, EventPrinter::new(f.clone())))
                .collect()
        };
        let cmdlines: BTreeMap<i32, String> = self
            .cpus
            .iter()
            .map(|c| {
                (
                    hyptrace_abi::events::vcpu_pid(c.cpu),
                    format!("vcpu{}", c.cpu),
                )
            })
            .collect();
        let mut s = String::new();
        for c in &self.cpus {
            match &c.last_event {
                Some((ts, payload)) => {
                    let mut line = String::new();
                    format_guest_line(
                        &mut line,
                        &printers,
                        &cmdlines,
                        c.cpu,
                        clock.to_ns(*ts),
                        payload,
                    );
                    let _ = writeln!(s, "hyptrace: vcpu {}: last event: {}", c.cpu, line.trim());
                }
                None => {
                    let _ = writeln!(
                        s,
                        "hyptrace: vcpu {}: no unconsumed event in its ring",
                        c.cpu
                    );
                }
            }
        }
        s
    }

    /// The statistics a page sink writes at its end.
    fn sink_summary(&self) -> RunSummary {
        RunSummary {
            cpus: self
                .cpus
                .iter()
                .map(|c| hyptrace_output::KernelCpuStat {
                    entries: 0,
                    overrun: c.lost,
                    commit_overrun: 0,
                    bytes: 0,
                    oldest_event_ts: 0,
                    now_ts: 0,
                    dropped_events: c.trailing_lost,
                    read_events: c.events,
                })
                .collect(),
        }
    }
}

/// Walks every CPU of the region in `mem` for which `include(cpu)`, from its reader's
/// position (`positions(cpu)`), handing the pages to `sink` (if any). A sink failure
/// stops the dump: the walks so far and the error are returned.
pub fn dump_region<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    positions: &dyn Fn(u32) -> Option<Position>,
    include: &dyn Fn(u32) -> bool,
    mut sink: Option<&mut dyn PageSink>,
) -> (DumpReport, Option<OutputError>) {
    let mut report = DumpReport::default();
    for cpu in 0..l.nr_cpus {
        if !include(cpu) {
            continue;
        }
        let r = walk_cpu(mem, l, cpu, positions(cpu), |p| match sink.as_mut() {
            Some(s) => s.page(cpu, p.bytes, Missed::count(p.missed)),
            None => Ok(()),
        });
        match r {
            Ok(d) => {
                if d.trailing_lost > 0 {
                    if let Some(s) = sink.as_mut() {
                        if let Err(e) = s.trailing_lost(cpu, d.trailing_lost) {
                            report.cpus.push(d);
                            return (report, Some(e));
                        }
                    }
                }
                report.cpus.push(d);
            }
            Err(e) => return (report, Some(e)),
        }
    }
    (report, None)
}

/// A trace memory file as read for a dump: a private copy of the bytes its header
/// declares (F5), and whether a VMM held it while it was read (F6).
#[derive(Debug)]
pub struct TraceMemRead {
    /// The header, the region and the meta pages, as long as the header declares.
    pub bytes: Vec<u8>,
    /// A VMM held the file's lock (it runs and may be writing): the copy is of one
    /// moment, events may have been committed since.
    pub live: bool,
}

/// Reads a trace memory file for a dump (docs/design.md, "Trace-memory file ownership"):
/// the type is checked before any blocking open (F4); the length comes from the fixed
/// header, is checked against the file's size, and exactly that many bytes are read
/// (F5: a sparse or padded file is not read past it; nothing is mapped, so a file cut
/// short under the reader is an error, never SIGBUS). `live` comes from the file's lock
/// (F6).
pub fn read_trace_mem(path: &Path) -> Result<TraceMemRead, DumpError> {
    let err = |source| DumpError::Read {
        path: path.to_path_buf(),
        source,
    };
    // F4: O_NONBLOCK|O_NOFOLLOW open, then fstat: a FIFO or a symlink is refused at once.
    let (file, md) =
        crate::flight::trace_mem::open_regular(path).map_err(|why| DumpError::Open {
            path: path.to_path_buf(),
            why,
        })?;
    // F6: a VMM holds its file exclusively for as long as it runs (the kernel drops the
    // lock when the process dies, even by SIGKILL). The shared lock is only a test.
    let live = !crate::flight::trace_mem::try_flock(&file, libc::LOCK_SH).map_err(err)?;
    if !live {
        let _ = crate::flight::trace_mem::try_flock(&file, libc::LOCK_UN);
    }
    let mut head = Vec::with_capacity(trace_file::HEADER_FIXED);
    (&file)
        .take(trace_file::HEADER_FIXED as u64)
        .read_to_end(&mut head)
        .map_err(err)?;
    let file_err = |source| DumpError::File {
        path: path.to_path_buf(),
        source,
    };
    let declared = trace_file::declared_len(&head).map_err(file_err)?;
    // F5: the header may not claim more than the file holds.
    if declared > md.len() {
        return Err(DumpError::Short {
            path: path.to_path_buf(),
            declared,
            held: md.len(),
        });
    }
    let len = usize::try_from(declared).map_err(|e| err(std::io::Error::other(e)))?;
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(len)
        .map_err(|e| err(std::io::Error::other(e)))?;
    bytes.extend_from_slice(&head);
    (&file)
        .take(declared - head.len() as u64)
        .read_to_end(&mut bytes)
        .map_err(err)?;
    // F5: cut short while read (another process truncated it): an error, not a signal.
    if bytes.len() < len {
        return Err(DumpError::Shrunk {
            path: path.to_path_buf(),
            read: bytes.len() as u64,
            declared,
        });
    }
    Ok(TraceMemRead { bytes, live })
}

/// Dumps a trace memory file's unconsumed events into `target` in `format`. Returns
/// what was dumped and the warnings of the file itself.
pub fn dump_trace_mem(
    bytes: &[u8],
    path: &Path,
    target: &OutputTarget,
    out_path: &Path,
    format: Format,
) -> Result<(DumpReport, Vec<String>), DumpError> {
    let img = trace_file::parse(bytes).map_err(|source| DumpError::File {
        path: path.to_path_buf(),
        source,
    })?;
    let mut warnings = img.warnings.clone();
    warnings.push(format!(
        "{}: written by pid {}, state {}",
        path.display(),
        img.pid,
        img.state_name()
    ));
    let clock = match Clock::guest_tsc(img.tsc_khz) {
        Ok(c) => c,
        Err(e) => {
            warnings.push(format!(
                "guest clock ({} kHz): {}: timestamps are raw TSC values",
                img.tsc_khz,
                crate::exit::chain(&e)
            ));
            Clock::nanoseconds()
        }
    };
    let l = img.layout;
    let out_err = |source| DumpError::Output {
        path: out_path.to_path_buf(),
        source,
    };
    let mut meta = TraceMeta::guest(l.page_size, l.nr_cpus, clock);
    match crate::vmm::registration::region_formats(&img.region, &l) {
        Ok(Some(f)) => meta.formats = f,
        Ok(None) => {}
        Err(e) => warnings.push(format!(
            "the event registration table: {}: the built-in guest event formats are used",
            crate::exit::chain(&e)
        )),
    }
    let mut sink =
        crate::drain::sink::make_sink(target, format, hyptrace_output::Compression::Zstd, meta)
            .map_err(out_err)?;
    let positions = |c: u32| img.positions.get(c as usize).copied().flatten();
    let (report, err) = dump_region(&img.region, &l, &positions, &|_| true, Some(sink.as_mut()));
    if let Some(e) = err {
        return Err(out_err(e));
    }
    sink.finish(&report.sink_summary()).map_err(out_err)?;
    Ok((report, warnings))
}

/// `hyptrace dump`: returns the exit code (0: dumped, even partly — warnings on
/// stderr; 2: the file is unusable; 1: the output failed).
pub fn dump(a: &DumpPlan) -> Result<i32, DumpCmdError> {
    let format = crate::drain::sink::format_for(a.format, &a.output, "-o")?;
    let target = crate::drain::sink::check_with(&a.output, "-o", a.files)?;
    let started = std::time::Instant::now();
    let trace_mem = match &a.source {
        None => return Err(DumpCmdError::NoSource),
        Some(DumpSource::Attach { socket, follow }) => {
            return dump_attach(socket, *follow, &target, &a.output, format, started)
        }
        Some(DumpSource::TraceMem(p)) => p,
    };
    let (report, warnings) = read_trace_mem(trace_mem).and_then(|read| {
        let (report, mut warnings) =
            dump_trace_mem(&read.bytes, trace_mem, &target, &a.output, format)?;
        if read.live {
            // F6: the VMM runs: the dump is of the moment of the copy.
            warnings.push(
                "a running VMM holds the file: this is a copy of one moment, it writes on".into(),
            );
        }
        Ok((report, warnings))
    })?;
    for w in &warnings {
        note!("hyptrace: dump: {w}");
    }
    // P2: what may also be in the live output, and what is in it or nowhere.
    for c in &report.cpus {
        if let Some((a0, b)) = c.may_repeat {
            note!(
                "hyptrace: dump: cpu {}: events {a0}..{b} ({}) may repeat the live output (the VMM was killed between printing them and recording it)",
                c.cpu,
                b - a0 + 1
            );
        }
        if let Some((a0, b)) = c.unplaced {
            note!(
                "hyptrace: dump: cpu {}: events {a0}..{b} ({}) are in the live output or lost (the VMM consumed them and was killed before recording them printed; their pages were reused; counted as lost here)",
                c.cpu,
                b - a0 + 1
            );
        }
    }
    let _ = std::io::Write::write_all(&mut std::io::stderr(), report.summary().as_bytes());
    note!(
        "hyptrace: dump: {} events written to {} in {:.1} ms{}",
        report.events(),
        crate::drain::sink::shown_path(&a.output),
        started.elapsed().as_secs_f64() * 1e3,
        if report.damaged() {
            " (partial: see the warnings)"
        } else {
            ""
        }
    );
    Ok(EXIT_OK)
}

/// Why `hyptrace dump` failed (the CLI prints it and maps it to its exit code).
#[derive(Debug, thiserror::Error)]
pub enum DumpCmdError {
    /// The output path is unusable (exit 2).
    #[error(transparent)]
    Destination(#[from] crate::drain::sink::DestinationError),
    /// Neither `--trace-mem` nor `--attach` (exit 2).
    #[error("dump needs --trace-mem PATH or --attach SOCKET")]
    NoSource,
    /// `--follow`: the signal handlers could not be installed (exit 1).
    #[error(transparent)]
    Signals(#[from] crate::drain::signals::SignalError),
    /// The trace memory file could not be dumped.
    #[error(transparent)]
    Dump(#[from] DumpError),
    /// Live attach failed.
    #[error(transparent)]
    Attach(#[from] crate::flight::attach::AttachError),
}

impl DumpCmdError {
    /// The exit code of each failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Destination(_) | Self::NoSource => EXIT_USAGE,
            Self::Signals(_) => EXIT_RUNTIME,
            Self::Dump(e) => e.exit_code(),
            Self::Attach(e) => e.exit_code(),
        }
    }
}

/// `hyptrace dump --attach SOCKET [--follow]`: live attach (`crate::flight::attach`).
fn dump_attach(
    socket: &Path,
    follow: bool,
    target: &OutputTarget,
    out_path: &Path,
    format: Format,
    started: std::time::Instant,
) -> Result<i32, DumpCmdError> {
    let interrupts = if follow {
        Some(crate::drain::signals::Interrupts::install()?)
    } else {
        None
    };
    let stop = || interrupts.is_some_and(|i| i.stop_requested());
    let o = crate::flight::attach::AttachOpts {
        socket,
        follow,
        target,
        out_path,
        format,
        stop: &stop,
        clock: None,
        keep_on_error: false,
        sink: None,
    };
    let r = crate::flight::attach::attach(&o)?;
    let (ev, lost) = r.cpus.iter().fold((0u64, 0u64), |(e, l), c| {
        (e.saturating_add(c.0), l.saturating_add(c.1))
    });
    for (cpu, c) in r.cpus.iter().enumerate() {
        note!(
            "hyptrace: attach: cpu {cpu}: {} events received, {} lost",
            c.0,
            c.1
        );
    }
    note!(
        "hyptrace: attach: {ev} events ({lost} lost) written to {} in {:.1} ms, {} fetches; {}",
        crate::drain::sink::shown_path(out_path),
        started.elapsed().as_secs_f64() * 1e3,
        r.fetches,
        r.ended
    );
    // A CPU whose reading stopped for an error: its output is not complete.
    for (cpu, e) in &r.errors {
        note!("hyptrace: attach: error: cpu {cpu}: {e}");
    }
    Ok(if r.errors.is_empty() {
        EXIT_OK
    } else {
        EXIT_RUNTIME
    })
}

/// Writes a crash dump of the VM's rings (stopped vCPUs: nothing changes them) into
/// `target` in `format`: every CPU in `include`, from its reader's position.
pub fn write_crash_dump<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    positions: &dyn Fn(u32) -> Option<Position>,
    include: &dyn Fn(u32) -> bool,
    clock: &Clock,
    formats: &[EventFormat],
    target: Option<(&OutputTarget, Format)>,
) -> (DumpReport, Option<OutputError>) {
    let Some((target, format)) = target else {
        return dump_region(mem, l, positions, include, None);
    };
    let meta = TraceMeta {
        formats: formats.to_vec(),
        ..TraceMeta::guest(l.page_size, l.nr_cpus, clock.clone())
    };
    let mut sink = match crate::drain::sink::make_sink(
        target,
        format,
        hyptrace_output::Compression::Zstd,
        meta,
    ) {
        Ok(s) => s,
        Err(e) => {
            let (r, _) = dump_region(mem, l, positions, include, None);
            return (r, Some(e));
        }
    };
    let (report, err) = dump_region(mem, l, positions, include, Some(sink.as_mut()));
    if let Some(e) = err {
        return (report, Some(e));
    }
    let e = sink.finish(&report.sink_summary()).err();
    (report, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hyptrace-dump-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    /// A file whose header declares a 2-page region and one CPU's meta page after it
    /// (4096 header + 8192 region + 4096 meta), bytes patterned.
    fn declared_file() -> Vec<u8> {
        let mut b: Vec<u8> = (0..4 * 4096u32).map(|i| (i % 251) as u8).collect();
        let mut w = |off: usize, v: u64| b[off..off + 8].copy_from_slice(&v.to_le_bytes());
        w(trace_file::hdr::MAGIC, trace_file::MAGIC);
        w(
            trace_file::hdr::VERSION_HEADER_SIZE,
            u64::from(trace_file::VERSION) | (4096 << 32),
        );
        w(trace_file::hdr::PAGE_SIZE_NR_CPUS, 4096 | (1 << 32));
        w(trace_file::hdr::REGION_SIZE, 8000);
        w(trace_file::hdr::META_OFF, 3 * 4096);
        b
    }

    /// F5: the length comes from the header (header + region rounded up + meta pages);
    /// a meta offset elsewhere is not counted; hostile headers are errors.
    #[test]
    fn declared_len_from_the_header() {
        let b = declared_file();
        assert_eq!(trace_file::declared_len(&b), Ok(4 * 4096));
        let mut c = b.clone();
        c[trace_file::hdr::META_OFF..trace_file::hdr::META_OFF + 8]
            .copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert_eq!(trace_file::declared_len(&c), Ok(3 * 4096));
        assert!(trace_file::declared_len(&b[..100]).is_err());
        let mut m = b.clone();
        m[0] ^= 1;
        assert!(trace_file::declared_len(&m).is_err());
        let mut r = b;
        r[trace_file::hdr::REGION_SIZE..trace_file::hdr::REGION_SIZE + 8]
            .copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(trace_file::declared_len(&r).is_err());
    }

    /// F5: exactly the declared bytes are read from a file padded (sparsely) far past
    /// them; a file shorter than its header declares is refused (exit 2).
    #[test]
    fn reads_only_what_the_header_declares() {
        let d = dir("declared");
        let p = d.join("f");
        let b = declared_file();
        std::fs::write(&p, &b).expect("write");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .expect("open");
        f.set_len(1 << 32).expect("sparse");
        let got = read_trace_mem(&p).expect("read");
        assert_eq!(got.bytes, b);
        assert!(!got.live);
        f.set_len(b.len() as u64 - 1).expect("cut");
        let e = read_trace_mem(&p).expect_err("short");
        assert!(matches!(e, DumpError::Short { .. }), "{e}");
        assert_eq!(e.exit_code(), EXIT_USAGE);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// F4: a FIFO (no writer: a blocking open would wait for ever), a symlink and a
    /// directory are refused at once (exit 2).
    #[test]
    fn non_regular_paths_are_refused_without_blocking() {
        let d = dir("types");
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("cstr");
        // SAFETY: mkfifo with a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
        let reg = d.join("reg");
        std::fs::write(&reg, declared_file()).expect("write");
        let link = d.join("link");
        std::os::unix::fs::symlink(&reg, &link).expect("symlink");
        for p in [&fifo, &link, &d] {
            let e = read_trace_mem(p).expect_err("refused");
            assert!(matches!(e, DumpError::Open { .. }), "{e}");
            let text = crate::exit::chain(&e);
            assert!(text.contains("not a regular file"), "{text}");
            assert_eq!(e.exit_code(), EXIT_USAGE);
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    /// F6: a file whose lock another open file holds exclusively (a running VMM) is read
    /// as live; once released, as finished. The bytes are the same.
    #[test]
    fn live_means_a_vmm_holds_the_lock() {
        let d = dir("live");
        let p = d.join("f");
        let b = declared_file();
        std::fs::write(&p, &b).expect("write");
        let holder = std::fs::File::open(&p).expect("open");
        assert!(crate::flight::trace_mem::try_flock(&holder, libc::LOCK_EX).expect("flock"));
        let got = read_trace_mem(&p).expect("read");
        assert!(got.live);
        assert_eq!(got.bytes, b);
        drop(holder);
        let got = read_trace_mem(&p).expect("read");
        assert!(!got.live);
        assert_eq!(got.bytes, b);
        let _ = std::fs::remove_dir_all(&d);
    }
}
