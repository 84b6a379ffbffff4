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

use clap::Args;
use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::SharedMem;
use hyptrace_output::{
    format_guest_line, guest_printers, Clock, EventFormat, EventPrinter, OutputError, OutputTarget,
    PageSink, RunSummary, TraceMeta,
};
use hyptrace_reader::postmortem::{walk_cpu, CpuDump, Position};
use hyptrace_reader::trace_file;

use crate::cli::{FormatArg, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE};

/// `eprintln!` that never panics: stderr may be a closed pipe.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Options of `hyptrace dump`.
#[derive(Clone, Debug, Args)]
pub struct DumpArgs {
    /// The trace memory file a VMM ran with (`run`/`record --trace-mem PATH`), killed,
    /// crashed or finished.
    #[arg(
        long = "trace-mem",
        value_name = "PATH",
        required_unless_present = "attach",
        conflicts_with = "attach"
    )]
    pub trace_mem: Option<PathBuf>,
    /// Live attach: read a running VMM's rings through its control socket (the VMM runs
    /// `--drain none --trace-mem FILE --control SOCKET`; one consumer at a time).
    #[arg(long = "attach", value_name = "SOCKET")]
    pub attach: Option<PathBuf>,
    /// With --attach: keep reading until the VM exits (or SIGINT), instead of draining
    /// what is there now.
    #[arg(long, requires = "attach")]
    pub follow: bool,
    /// Output file (as `record -o`: written to a temporary name and renamed; `-` is
    /// stdout).
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE",
        default_value = "trace.dat"
    )]
    pub output: PathBuf,
    /// Output format [default: from the extension, as `record`].
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
}

/// Why a dump failed.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// The trace memory file cannot be read.
    #[error("cannot read {path}: {source}", path = .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The trace memory file is not usable.
    #[error("{path}: {source}", path = .path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: trace_file::FileError,
    },
    /// The output failed.
    #[error("cannot write {path}: {source}", path = .path.display())]
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
            Some(s) => s.page(cpu, p.bytes, (p.missed > 0).then_some(p.missed)),
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

/// The bytes of a trace memory file: mapped read-only when no VMM can be writing it,
/// else read into memory.
pub enum TraceMemBytes {
    /// Read whole (the VMM that wrote it may still run).
    Owned(Vec<u8>),
    /// A private read-only mapping of the whole file.
    Mapped {
        /// The mapping.
        ptr: *const u8,
        /// Its length (the file's, more than 0).
        len: usize,
    },
}

impl std::ops::Deref for TraceMemBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            // SAFETY: a read-only mapping of `len` bytes that lives as long as `self`
            // (unmapped in Drop only). It is made only for a file whose VMM is gone
            // (`read_trace_mem`), so nothing writes the bytes while the slice lives.
            Self::Mapped { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl Drop for TraceMemBytes {
    fn drop(&mut self) {
        if let Self::Mapped { ptr, len } = *self {
            // SAFETY: the mapping made in `read_trace_mem`, unmapped once; no slice of it
            // outlives `self` (Deref borrows it).
            unsafe { libc::munmap(ptr as *mut libc::c_void, len) };
        }
    }
}

/// Whether the VMM that wrote a trace memory file (its header's state and pid, in
/// `head`) may still be writing it: state created or running and a process with that
/// pid exists (or the header is unreadable).
fn writer_may_run(head: &[u8]) -> bool {
    let word = |off: usize| {
        head.get(off..off + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let (Some(state), Some(pid)) = (word(trace_file::hdr::STATE), word(trace_file::hdr::PID))
    else {
        return true;
    };
    if state != trace_file::STATE_CREATED && state != trace_file::STATE_RUNNING {
        return false;
    }
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The bytes of a trace memory file (a regular file, at most the largest region and
/// header: a hostile size is refused, not allocated): mapped read-only when its VMM is
/// gone (killed, crashed, finished: the usual case, no copy of up to 4 GiB), read whole
/// when it may still run (a private copy: the bytes do not change under the parser).
pub fn read_trace_mem(path: &Path) -> Result<TraceMemBytes, DumpError> {
    let err = |source| DumpError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(err)?;
    let meta = f.metadata().map_err(err)?;
    if !meta.file_type().is_file() {
        return Err(err(std::io::Error::other("not a regular file")));
    }
    let max = trace_file::MAX_REGION + trace_file::MAX_HEADER as u64;
    if meta.len() > max {
        return Err(err(std::io::Error::other(format!(
            "{} bytes: larger than any trace memory file ({max})",
            meta.len()
        ))));
    }
    let mut head = Vec::with_capacity(trace_file::HEADER_FIXED);
    (&mut f)
        .take(trace_file::HEADER_FIXED as u64)
        .read_to_end(&mut head)
        .map_err(err)?;
    let len = usize::try_from(meta.len()).map_err(|e| err(std::io::Error::other(e)))?;
    if len > 0 && !writer_may_run(&head) {
        // SAFETY: a fresh private read-only mapping of the whole file (its length as
        // just read); no address hint. The result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            )
        };
        if ptr != libc::MAP_FAILED {
            return Ok(TraceMemBytes::Mapped {
                ptr: ptr.cast_const().cast(),
                len,
            });
        }
        log::debug!(
            "{}: mmap failed ({}): reading it",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    let mut bytes = head;
    bytes.reserve(len.saturating_sub(bytes.len()));
    f.take(max).read_to_end(&mut bytes).map_err(err)?;
    Ok(TraceMemBytes::Owned(bytes))
}

/// Dumps a trace memory file's unconsumed events into `target` in `format`. Returns
/// what was dumped and the warnings of the file itself.
pub fn dump_trace_mem(
    bytes: &[u8],
    path: &Path,
    target: &OutputTarget,
    out_path: &Path,
    format: FormatArg,
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
                "guest clock ({} kHz): {e}: timestamps are raw TSC values",
                img.tsc_khz
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
    match region_formats(&img.region, &l) {
        Ok(Some(f)) => meta.formats = f,
        Ok(None) => {}
        Err(e) => warnings.push(format!(
            "the event registration table: {e}: the built-in guest event formats are used"
        )),
    }
    let mut sink = crate::run::make_sink(target, format, hyptrace_output::Compression::Zstd, meta)
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
pub fn dump(a: &DumpArgs) -> i32 {
    let format = crate::cli::format_for(a.format, &a.output);
    let target = match crate::cli::check_destination(&a.output, "-o") {
        Ok(t) => t,
        Err(e) => {
            note!("hyptrace: error: {e}");
            return EXIT_USAGE;
        }
    };
    let started = std::time::Instant::now();
    let Some(trace_mem) = &a.trace_mem else {
        return match &a.attach {
            Some(socket) => dump_attach(socket, a.follow, &target, &a.output, format, started),
            None => {
                note!("hyptrace: error: dump needs --trace-mem PATH or --attach SOCKET");
                EXIT_USAGE
            }
        };
    };
    let r = read_trace_mem(trace_mem)
        .and_then(|bytes| dump_trace_mem(&bytes, trace_mem, &target, &a.output, format));
    match r {
        Ok((report, warnings)) => {
            for w in &warnings {
                note!("hyptrace: dump: {w}");
            }
            let _ = std::io::Write::write_all(&mut std::io::stderr(), report.summary().as_bytes());
            note!(
                "hyptrace: dump: {} events written to {} in {:.1} ms{}",
                report.events(),
                crate::report::shown_path(&a.output),
                started.elapsed().as_secs_f64() * 1e3,
                if report.damaged() {
                    " (partial: see the warnings)"
                } else {
                    ""
                }
            );
            EXIT_OK
        }
        Err(e) => {
            note!("hyptrace: error: {e}");
            e.exit_code()
        }
    }
}

/// `hyptrace dump --attach SOCKET [--follow]`: live attach (`crate::attach`).
fn dump_attach(
    socket: &Path,
    follow: bool,
    target: &OutputTarget,
    out_path: &Path,
    format: FormatArg,
    started: std::time::Instant,
) -> i32 {
    let interrupts = if follow {
        match crate::signals::Interrupts::install() {
            Ok(i) => Some(i),
            Err(e) => {
                note!("hyptrace: error: {e}");
                return EXIT_RUNTIME;
            }
        }
    } else {
        None
    };
    let stop = || interrupts.is_some_and(|i| i.stop_requested());
    let o = crate::attach::AttachOpts {
        socket,
        follow,
        target,
        out_path,
        format,
        stop: &stop,
    };
    match crate::attach::attach(&o) {
        Ok(r) => {
            let (ev, lost) = r.cpus.iter().fold((0u64, 0u64), |(e, l), c| {
                (e.saturating_add(c.0), l.saturating_add(c.1))
            });
            for (cpu, c) in r.cpus.iter().enumerate() {
                note!(
                    "hyptrace: attach: cpu {cpu}: {} events read, {} lost",
                    c.0,
                    c.1
                );
                if let Some(Some(m)) = r.metas.get(cpu) {
                    note!(
                        "hyptrace: attach: cpu {cpu} meta page: reader {} lost_events {} entries {} overrun {} read {} lost {} pages_touched {}",
                        m.reader_id, m.lost_events, m.entries, m.overrun, m.read, m.lost_total, m.pages_touched
                    );
                }
            }
            note!(
                "hyptrace: attach: {ev} events ({lost} lost) written to {} in {:.1} ms, {} swaps; {}",
                crate::report::shown_path(out_path),
                started.elapsed().as_secs_f64() * 1e3,
                r.swaps,
                r.ended
            );
            // A CPU whose reading stopped for an error: its output is not complete.
            for (cpu, e) in &r.errors {
                note!("hyptrace: attach: error: cpu {cpu}: reading stopped: {e}");
            }
            if r.errors.is_empty() {
                EXIT_OK
            } else {
                EXIT_RUNTIME
            }
        }
        Err(e) => {
            note!("hyptrace: error: {e}");
            e.exit_code()
        }
    }
}

/// The formats of the events the guest registered, rebuilt from the region's
/// registration table as the host accepted it (`None`: the pack has no table; the
/// built-in formats apply). The table is hostile: parsed from a private copy.
pub fn region_formats<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
) -> Result<Option<Vec<EventFormat>>, String> {
    use hyptrace_abi::registry::{MAX_TABLE_SIZE, STATE_DONE, STATE_OFF, STATE_READY};
    if l.events_size == 0 {
        return Ok(None);
    }
    let mut bytes = vec![0u8; l.events_size.min(MAX_TABLE_SIZE)];
    mem.read_bytes(l.events_off, &mut bytes);
    let Some(state) = bytes.get_mut(STATE_OFF..STATE_OFF + 8) else {
        return Err("too short".into());
    };
    let st = u64::from_le_bytes(state.try_into().unwrap_or([0; 8]));
    if st != STATE_DONE && st != STATE_READY {
        return Err(format!("state {st}: never answered"));
    }
    // The host answered this table (DONE): parse it as it was when READY.
    state.copy_from_slice(&STATE_READY.to_le_bytes());
    let reg = hyptrace_reader::registry::parse_table(&bytes).map_err(|e| e.to_string())?;
    Ok(Some(
        reg.events.iter().map(crate::events::to_format).collect(),
    ))
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
    target: Option<(&OutputTarget, FormatArg)>,
) -> (DumpReport, Option<OutputError>) {
    let Some((target, format)) = target else {
        return dump_region(mem, l, positions, include, None);
    };
    let meta = TraceMeta {
        formats: formats.to_vec(),
        ..TraceMeta::guest(l.page_size, l.nr_cpus, clock.clone())
    };
    let mut sink =
        match crate::run::make_sink(target, format, hyptrace_output::Compression::Zstd, meta) {
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

    fn file_with(tag: &str, state: u64, pid: u64) -> (PathBuf, Vec<u8>) {
        let path =
            std::env::temp_dir().join(format!("hyptrace-dump-{}-{tag}.trace", std::process::id()));
        let mut bytes: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8).collect();
        bytes[trace_file::hdr::STATE..trace_file::hdr::STATE + 8]
            .copy_from_slice(&state.to_le_bytes());
        bytes[trace_file::hdr::PID..trace_file::hdr::PID + 8].copy_from_slice(&pid.to_le_bytes());
        std::fs::write(&path, &bytes).expect("write");
        (path, bytes)
    }

    /// A file whose VMM is gone is mapped read-only (not copied); one whose VMM may
    /// still run (running, its pid alive) is read into memory. Same bytes either way.
    #[test]
    fn trace_mem_mapped_only_when_its_vmm_is_gone() {
        let me = u64::from(std::process::id());
        for (tag, state, pid, mapped) in [
            ("ended", trace_file::STATE_ENDED, me, true),
            ("crashed", trace_file::STATE_CRASHED, me, true),
            ("live", trace_file::STATE_RUNNING, me, false),
            (
                "dead",
                trace_file::STATE_RUNNING,
                u64::from(u32::MAX >> 1),
                true,
            ),
        ] {
            let (path, bytes) = file_with(tag, state, pid);
            let got = read_trace_mem(&path).expect("read");
            assert_eq!(matches!(got, TraceMemBytes::Mapped { .. }), mapped, "{tag}");
            assert_eq!(&got[..], &bytes[..], "{tag}");
            drop(got);
            let _ = std::fs::remove_file(&path);
        }
    }
}
