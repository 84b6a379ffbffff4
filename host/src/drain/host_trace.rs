//! `--host-trace EVENTS`: the host kernel's own ftrace events (sched_switch, irq...)
//! recorded through tracefs in a private instance `instances/hyptrace-NS-PID-START`, on the
//! instance's `x86-tsc` trace clock (the guest's TSC domain: docs/design.md "Host
//! kernel events"), read from `per_cpu/cpuN/trace_pipe_raw` by one host thread and
//! handed to the session as extra CPUs of the output. `collect --host-trace` uses the
//! same instance and thread on the `mono` clock ([`TraceClock`]) and writes the pages
//! as one more part (`crate::flight::collect::host`).
//!
//! Invariant H1 (docs/design.md): a run uses and removes only the instance it made
//! (named after its maker, [`instance`]); it is removed when [`HostTrace`] is dropped
//! (normal end, Ctrl-C, an error); one left by a killed VMM is removed by a later
//! [`HostTrace::prepare`] once its name proves its maker dead. The pid filter names the
//! vCPU threads by the kernel's ids, or the run is refused ([`procfs::kernel_ids`]).
//!
//! Invariant H2: host kernel event ids are renumbered into
//! [`hyptrace_abi::registry::FIRST_HOST_KERNEL_ID`].. (a range no guest event gets),
//! in the pages themselves, so guest and host formats share one id space in every
//! output.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hyptrace_abi::page::{decode_record, Record, PAGE_HEADER_SIZE};
use hyptrace_abi::registry::{FIRST_HOST_KERNEL_ID, FIRST_VMM_ID};
use hyptrace_output::format::{glob, HeaderPage};
use hyptrace_output::{page_missed, EventFormat, Missed};

pub mod instance;
pub mod procfs;

use instance::Instance;

/// Where tracefs is mounted.
pub const TRACEFS: &str = "/sys/kernel/tracing";
/// Environment variable naming another tracefs mount (tests point it at a directory
/// that is not one).
pub const TRACEFS_ENV: &str = "HYPTRACE_TRACEFS";

/// The tracefs mount to use: `$HYPTRACE_TRACEFS`, else [`TRACEFS`].
pub fn tracefs_root() -> PathBuf {
    std::env::var_os(TRACEFS_ENV).map_or_else(|| PathBuf::from(TRACEFS), PathBuf::from)
}
/// Prefix of our instances' names (`hyptrace-NS-PID-START`, [`instance::Maker`]).
pub const INSTANCE_PREFIX: &str = "hyptrace-";
/// Per-CPU buffer of the instance, KiB (the kernel allocates it).
pub const BUFFER_KB: u32 = 4096;
/// Pages the reader thread may hold for the session (all CPUs): the bound on host
/// memory; past it the thread waits, and the kernel's ring overruns (counted).
pub const FEED_PAGES: usize = 1024;
/// How long the reader thread sleeps when every CPU's `trace_pipe_raw` was empty.
pub const IDLE_POLL: Duration = Duration::from_millis(2);
/// How far before an empty read of a host CPU's ring the merger is told nothing older
/// is to come from it, in ms: the kernel stamps an event before it commits it, so one
/// stamped just before the read may appear just after.
pub const QUIET_MARGIN_MS: u64 = 1;
/// Longest the reader thread goes on reading after it was told to stop.
pub const FINAL_READ_MAX: Duration = Duration::from_secs(5);
/// Longest the final read waits for the next page before it looks whether the run was
/// aborted (a second Ctrl-C must end it within 1 s).
pub const FINAL_READ_POLL: Duration = Duration::from_millis(50);
/// How long [`HostTrace::start`] waits for the vCPU threads to be named.
pub const TID_WAIT: Duration = Duration::from_secs(2);

/// What went wrong with tracefs.
#[derive(Debug, thiserror::Error)]
pub enum HostTraceError {
    /// tracefs is not there.
    #[error("--host-trace: tracefs is not mounted at {0} (mount -t tracefs nodev {0})")]
    NotMounted(PathBuf),
    /// tracefs is there, but this user may not search or write it (EACCES/EPERM: a
    /// tracefs directory is root's, mode 0700).
    #[error("--host-trace: permission denied on {path} (run as root)", path = .path.display())]
    PermissionDenied {
        /// The directory refused.
        path: PathBuf,
        /// The refusal.
        #[source]
        source: std::io::Error,
    },
    /// A tracefs file could not be read or written (permissions: run as root).
    #[error("--host-trace: {path}", path = .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A pattern matched no host event.
    #[error("--host-trace: no host kernel event matches '{0}' (see {TRACEFS}/available_events)")]
    NoMatch(String),
    /// Too many events for the id range.
    #[error("--host-trace: {0} events selected, at most {max}", max = FIRST_VMM_ID - FIRST_HOST_KERNEL_ID)]
    TooMany(usize),
    /// The instance has not the trace clock asked for.
    #[error("--host-trace: the kernel has no {want} trace clock (trace_clock offers: {offers})")]
    NoClock {
        /// The clock asked for.
        want: &'static str,
        /// What `trace_clock` offers.
        offers: String,
    },
    /// A format file could not be parsed.
    #[error("--host-trace: {path}", path = .path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: hyptrace_output::FormatError,
    },
    /// The kernel's pages are larger than the run's.
    #[error("--host-trace: kernel pages of {kernel} bytes do not fit the run's {run}-byte pages")]
    PageSize {
        /// The kernel's.
        kernel: usize,
        /// The run's.
        run: usize,
    },
    /// The reader thread could not be started.
    #[error("--host-trace: reader thread")]
    Thread(#[source] std::io::Error),
    /// An instance of this run's name exists, not made by this run (H1: left alone).
    #[error("--host-trace: {path} exists and this run did not make it: left alone", path = .0.display())]
    Exists(PathBuf),
    /// The vCPU threads' kernel ids are not known (a pid namespace): the filter would
    /// name no thread.
    #[error("--host-trace: {0}; the instance's pid filter takes the kernel's ids (run outside the pid namespace or with the host's /proc, or use --host-trace-all)")]
    PidNamespace(String),
}

impl HostTraceError {
    /// Whether the environment or the user's input is at fault (exit 2).
    pub fn is_input_error(&self) -> bool {
        !matches!(self, Self::Thread(_))
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> HostTraceError + '_ {
    move |source| HostTraceError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Most bytes read from one tracefs text file.
const MAX_TEXT: usize = 1 << 20;

/// Reads a tracefs text file with large reads: some (`events/header_page`) answer a
/// read at a nonzero offset with nothing, so `read_to_string`'s small first probe read
/// would cut them short.
pub(crate) fn read_text(path: &Path) -> Result<String, HostTraceError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    // Bounded: at most MAX_TEXT bytes.
    while out.len() < MAX_TEXT {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn write_text(path: &Path, text: &str) -> Result<(), HostTraceError> {
    std::fs::write(path, text).map_err(io_err(path))
}

/// `--host-trace`'s request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostTraceSpec {
    /// Patterns: `SYSTEM:EVENT` (globs), `SYSTEM`, or an event name.
    pub patterns: Vec<String>,
    /// `--host-trace-all`: every task, not only the vCPU threads.
    pub all: bool,
}

impl HostTraceSpec {
    /// Splits `--host-trace` values at commas.
    pub fn parse(values: &[String], all: bool) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        let patterns = values
            .iter()
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        Some(Self { patterns, all })
    }
}

/// Whether `pat` selects event `sys:name`.
pub(crate) fn selects(pat: &str, sys: &str, name: &str) -> bool {
    match pat.split_once(':') {
        Some((s, e)) => glob(s, sys) && glob(if e.is_empty() { "*" } else { e }, name),
        None => glob(pat, sys) || glob(pat, name),
    }
}

/// The trace clock of the instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceClock {
    /// `x86-tsc`, the host's TSC (`run`/`record`: the run's clock map converts it).
    Tsc,
    /// `mono`, CLOCK_MONOTONIC nanoseconds (`collect`: the time line of every VM).
    Mono,
}

impl TraceClock {
    /// Its name in tracefs' `trace_clock`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Tsc => "x86-tsc",
            Self::Mono => "mono",
        }
    }
}

/// An instance set up (clock, events chosen, formats read), not yet recording.
#[derive(Debug)]
pub struct HostTrace {
    instance: Instance,
    /// `(tracefs system/event dir, format with the renumbered id)`.
    events: Vec<(PathBuf, EventFormat)>,
    /// Kernel id → our id (H2).
    ids: BTreeMap<u16, u16>,
    kernel_page: usize,
    nr_cpus: u32,
    all: bool,
    clock: TraceClock,
}

impl HostTrace {
    /// Creates the instance under `root` (tracefs), removes dead runs' instances, sets
    /// the trace clock `clock` and reads the formats of the events `spec` selects.
    /// Nothing is recorded yet.
    pub fn prepare(
        root: &Path,
        spec: &HostTraceSpec,
        clock: TraceClock,
    ) -> Result<Self, HostTraceError> {
        // H1: the filter must name the vCPU threads as the kernel does, or it names
        // nobody and the run records no host event.
        if !spec.all {
            procfs::kernel_ids().map_err(HostTraceError::PidNamespace)?;
        }
        let instance = Instance::create(root)?;
        let clocks = read_text(&instance.path("trace_clock"))?;
        if !clocks
            .split_whitespace()
            .any(|c| c.trim_matches(['[', ']']) == clock.name())
        {
            return Err(HostTraceError::NoClock {
                want: clock.name(),
                offers: clocks.trim().to_string(),
            });
        }
        write_text(&instance.path("trace_clock"), clock.name())?;
        write_text(&instance.path("tracing_on"), "0")?;
        write_text(&instance.path("buffer_size_kb"), &BUFFER_KB.to_string())?;
        let hp = instance.path("events/header_page");
        let header = HeaderPage::parse(&read_text(&hp)?)
            .map_err(|source| HostTraceError::Format { path: hp, source })?;
        let kernel_page = header.data_offset + header.data_size;
        let events = select_events(&instance.path("events"), &spec.patterns)?;
        let ids = events
            .iter()
            .zip(FIRST_HOST_KERNEL_ID..)
            .map(|((_, f), ours)| (f.id, ours))
            .collect();
        let events = events
            .into_iter()
            .zip(FIRST_HOST_KERNEL_ID..)
            .map(|((p, f), id)| (p, EventFormat { id, ..f }))
            .collect();
        let nr_cpus = std::fs::read_dir(instance.path("per_cpu"))
            .map_err(io_err(&instance.path("per_cpu")))?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("cpu"))
            .count() as u32;
        Ok(Self {
            instance,
            events,
            ids,
            kernel_page,
            nr_cpus,
            all: spec.all,
            clock,
        })
    }

    /// The kernel's page size (`events/header_page`): the smallest page size a
    /// [`HostTrace::start`] takes.
    pub fn kernel_page(&self) -> usize {
        self.kernel_page
    }

    /// The formats of the selected events, with our ids (H2).
    pub fn formats(&self) -> Vec<EventFormat> {
        self.events.iter().map(|(_, f)| f.clone()).collect()
    }

    /// Host CPUs (each one more CPU of the output).
    pub fn nr_cpus(&self) -> u32 {
        self.nr_cpus
    }

    /// Starts recording: the event filter on the vCPU threads (unless `--host-trace-all`),
    /// the events enabled, and the reader thread, which hands pages of `page_size`
    /// bytes (the run's). On [`TraceClock::Tsc`] they are stamped in the guest's TSC
    /// domain (`+ tsc_offset`; `tsc_khz` sets the quiet notes' margin); on
    /// [`TraceClock::Mono`] they carry CLOCK_MONOTONIC ns and the pair is not used.
    pub fn start(
        self,
        vcpus: u32,
        page_size: usize,
        (tsc_offset, tsc_khz): (i64, u64),
    ) -> Result<HostTraceFeed, HostTraceError> {
        if self.kernel_page > page_size || self.kernel_page < PAGE_HEADER_SIZE {
            return Err(HostTraceError::PageSize {
                kernel: self.kernel_page,
                run: page_size,
            });
        }
        let tids = if self.all {
            Vec::new()
        } else {
            vcpu_tids(vcpus, TID_WAIT)
        };
        if !self.all {
            // No vCPU thread left (a run that ended at once): our own pid (the kernel's
            // id: /proc's, H1), so that the filter still excludes every other task.
            let mut list: Vec<String> = tids.iter().map(|(_, t)| t.to_string()).collect();
            if list.is_empty() {
                let me = procfs::self_pid().map_err(io_err(Path::new("/proc/self")))?;
                list.push(me.to_string());
            }
            log::debug!("host trace: vCPU threads {tids:?}");
            write_text(&self.instance.path("set_event_pid"), &list.join(" "))?;
        }
        for (dir, _) in &self.events {
            write_text(&dir.join("enable"), "1")?;
        }
        let mut files = Vec::new();
        for cpu in 0..self.nr_cpus {
            let p = self
                .instance
                .path(&format!("per_cpu/cpu{cpu}/trace_pipe_raw"));
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&p)
                .map_err(io_err(&p))?;
            files.push(f);
        }
        write_text(&self.instance.path("tracing_on"), "1")?;
        let (tx, rx) = std::sync::mpsc::sync_channel(FEED_PAGES);
        let shared = Arc::new(FeedShared::default());
        let pump = Pump {
            files,
            tx,
            ids: self.ids.clone(),
            kernel_page: self.kernel_page,
            page_size,
            stamps: match self.clock {
                TraceClock::Tsc => Stamps::Tsc {
                    offset: tsc_offset,
                    margin: tsc_khz.saturating_mul(QUIET_MARGIN_MS),
                },
                TraceClock::Mono => Stamps::Mono,
            },
            shared: Arc::clone(&shared),
        };
        let thread = std::thread::Builder::new()
            .name("hyptrace-hosttrace".into())
            .spawn(move || pump.run())
            .map_err(HostTraceError::Thread)?;
        Ok(HostTraceFeed {
            rx,
            thread: Some(thread),
            shared,
            tids,
            nr_cpus: self.nr_cpus,
            trace: self,
        })
    }
}

/// Reads `events/` and picks the events `patterns` select, in tracefs order.
fn select_events(
    events: &Path,
    patterns: &[String],
) -> Result<Vec<(PathBuf, EventFormat)>, HostTraceError> {
    let mut found = Vec::new();
    let mut matched = vec![false; patterns.len()];
    let mut systems: Vec<_> = std::fs::read_dir(events)
        .map_err(io_err(events))?
        .flatten()
        .filter(|e| e.path().is_dir())
        .collect();
    systems.sort_by_key(std::fs::DirEntry::file_name);
    for s in systems {
        let sys = s.file_name().to_string_lossy().into_owned();
        let mut evs: Vec<_> = std::fs::read_dir(s.path())
            .map_err(io_err(&s.path()))?
            .flatten()
            .filter(|e| e.path().join("format").is_file())
            .collect();
        evs.sort_by_key(std::fs::DirEntry::file_name);
        for e in evs {
            let name = e.file_name().to_string_lossy().into_owned();
            let mut hit = false;
            for (i, p) in patterns.iter().enumerate() {
                if selects(p, &sys, &name) {
                    matched[i] = true;
                    hit = true;
                }
            }
            if hit {
                let fp = e.path().join("format");
                let f = EventFormat::parse(&sys, &read_text(&fp)?)
                    .map_err(|source| HostTraceError::Format { path: fp, source })?;
                found.push((e.path(), f));
            }
        }
    }
    if let Some(i) = matched.iter().position(|m| !m) {
        return Err(HostTraceError::NoMatch(patterns[i].clone()));
    }
    let max = usize::from(FIRST_VMM_ID - FIRST_HOST_KERNEL_ID);
    if found.len() > max {
        return Err(HostTraceError::TooMany(found.len()));
    }
    Ok(found)
}

/// The tids of this process's threads named `vcpu0`..`vcpu{n-1}` (std names a thread
/// from inside it, so this waits up to `wait` for all of them), with their vCPU number.
/// The ids are /proc's (the first of each thread's `NSpid`): the kernel's own when
/// [`procfs::kernel_ids`] says so.
pub fn vcpu_tids(n: u32, wait: Duration) -> Vec<(u32, i32)> {
    let until = Instant::now() + wait;
    loop {
        let mut found = Vec::new();
        if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
            for e in dir.flatten() {
                let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                    continue;
                };
                let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
                if let Some(v) = comm
                    .trim()
                    .strip_prefix("vcpu")
                    .and_then(|v| v.parse().ok())
                {
                    if v < n {
                        found.push((v, tid));
                    }
                }
            }
        }
        found.sort_unstable();
        if found.len() >= n as usize || Instant::now() >= until {
            return found;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What the reader thread hands the session.
#[derive(Debug)]
pub enum Fed {
    /// One page of host CPU `cpu`, `page_size` bytes, ids renumbered, timestamps in the
    /// guest's TSC domain (on [`TraceClock::Mono`]: CLOCK_MONOTONIC ns).
    Page {
        /// Host CPU.
        cpu: u32,
        /// The page.
        page: Vec<u8>,
        /// The data events it holds (as far as they decode).
        events: u64,
    },
    /// Host CPU `cpu`'s ring was empty after TSC `tsc` (guest domain; on
    /// [`TraceClock::Mono`]: ns): nothing older is still to come from it.
    Quiet {
        /// Host CPU.
        cpu: u32,
        /// The time taken before the read that found it empty.
        tsc: u64,
    },
}

#[derive(Debug, Default)]
struct FeedShared {
    stop: AtomicBool,
    /// Nobody wants what is left (an abort, the feed dropped): the thread ends at once.
    abandon: AtomicBool,
    pages: AtomicU64,
    events: AtomicU64,
    error: std::sync::Mutex<Option<String>>,
}

/// How the reader thread stamps what it hands on.
#[derive(Clone, Copy, Debug)]
enum Stamps {
    /// Host TSC + `offset` (the guest's domain); `margin`: [`QUIET_MARGIN_MS`] in cycles.
    Tsc { offset: i64, margin: u64 },
    /// CLOCK_MONOTONIC ns as the kernel's pages have them.
    Mono,
}

impl Stamps {
    /// What a page's times are shifted by.
    fn offset(self) -> i64 {
        match self {
            Self::Tsc { offset, .. } => offset,
            Self::Mono => 0,
        }
    }

    /// The time of a quiet note for a read that starts now.
    fn quiet_from_now(self) -> u64 {
        match self {
            Self::Tsc { offset, margin } => crate::vmm::time::host_tsc()
                .wrapping_add_signed(offset)
                .saturating_sub(margin),
            Self::Mono => crate::vmm::time::monotonic_ns()
                .saturating_sub(QUIET_MARGIN_MS.saturating_mul(1_000_000)),
        }
    }
}

/// The reader thread's state.
struct Pump {
    files: Vec<File>,
    tx: SyncSender<Fed>,
    ids: BTreeMap<u16, u16>,
    kernel_page: usize,
    page_size: usize,
    stamps: Stamps,
    shared: Arc<FeedShared>,
}

impl Pump {
    /// Reads every CPU until stopped, then until every ring is empty. Memory: one page
    /// being read, plus the channel's [`FEED_PAGES`].
    fn run(mut self) {
        let mut buf = vec![0u8; self.kernel_page];
        let mut stopped_at: Option<Instant> = None;
        loop {
            if self.shared.abandon.load(Ordering::Acquire) {
                return;
            }
            let stopping = self.shared.stop.load(Ordering::Acquire);
            if stopping {
                // Recording is off by then; should it not be (the write to tracing_on
                // failed), a busy host must not keep the final read going for ever.
                let at = *stopped_at.get_or_insert_with(Instant::now);
                if at.elapsed() > FINAL_READ_MAX {
                    let mut g = self.shared.error.lock().unwrap_or_else(|e| e.into_inner());
                    g.get_or_insert_with(|| {
                        format!("the final read did not empty the rings within {FINAL_READ_MAX:?}")
                    });
                    return;
                }
            }
            let mut any = false;
            for cpu in 0..self.files.len() {
                // Bounded per CPU per round: a ring refilled as fast as it is read does
                // not starve the others.
                for _ in 0..64 {
                    if self.shared.abandon.load(Ordering::Acquire) {
                        return;
                    }
                    match self.read_one(cpu, &mut buf) {
                        Ok(true) => any = true,
                        Ok(false) => break,
                        Err(()) => return,
                    }
                }
            }
            if stopping && !any {
                return;
            }
            if !any {
                std::thread::sleep(IDLE_POLL);
            }
        }
    }

    /// One read of `cpu`'s `trace_pipe_raw`: `Ok(true)` a page went out, `Ok(false)`
    /// empty, `Err` the session is gone or the file failed (recorded).
    fn read_one(&mut self, cpu: usize, buf: &mut [u8]) -> Result<bool, ()> {
        let quiet = self.stamps.quiet_from_now();
        let n = match self.files[cpu].read(buf) {
            Ok(0) => 0,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => 0,
            Err(e) => {
                let mut g = self.shared.error.lock().unwrap_or_else(|e| e.into_inner());
                g.get_or_insert_with(|| format!("host cpu {cpu}: trace_pipe_raw: {e}"));
                return Err(());
            }
        };
        let cpu = cpu as u32;
        let msg = if n < PAGE_HEADER_SIZE {
            Fed::Quiet { cpu, tsc: quiet }
        } else {
            let mut page = vec![0u8; self.page_size];
            page[..n].copy_from_slice(&buf[..n]);
            let events = self.rewrite(&mut page);
            self.shared.pages.fetch_add(1, Ordering::Relaxed);
            self.shared.events.fetch_add(events, Ordering::Relaxed);
            Fed::Page { cpu, page, events }
        };
        let page = matches!(msg, Fed::Page { .. });
        match self.tx.try_send(msg) {
            Ok(()) => Ok(page),
            // A quiet note may be dropped (the next one says as much); a page waits.
            Err(TrySendError::Full(Fed::Quiet { .. })) => Ok(false),
            Err(TrySendError::Full(m)) => self.tx.send(m).map(|()| true).map_err(|_| ()),
            Err(TrySendError::Disconnected(_)) => Err(()),
        }
    }

    /// Renumbers the event ids of a page (H2) and moves its time stamp into the guest's
    /// TSC domain; returns its data events. Stops at the first record that does not
    /// decode (the sinks see and report the same).
    fn rewrite(&self, page: &mut [u8]) -> u64 {
        let ts = u64::from_le_bytes(page[..8].try_into().unwrap_or_default());
        page[..8].copy_from_slice(&ts.wrapping_add_signed(self.stamps.offset()).to_le_bytes());
        let commit = u64::from_le_bytes(page[8..16].try_into().unwrap_or_default());
        let len = (commit & hyptrace_abi::page::COMMIT_LEN_MASK) as usize;
        let end = PAGE_HEADER_SIZE.saturating_add(len).min(page.len());
        let data = &mut page[PAGE_HEADER_SIZE..end];
        let mut off = 0;
        let mut events = 0;
        // Every record advances by at least 4 bytes: bounded by the page.
        while let Ok(Some((rec, next))) = decode_record(data, off) {
            if let Record::Data { start, len, .. } = rec {
                if len >= 2 {
                    let id = u16::from_le_bytes([data[start], data[start + 1]]);
                    if let Some(ours) = self.ids.get(&id) {
                        data[start..start + 2].copy_from_slice(&ours.to_le_bytes());
                    }
                    events += 1;
                }
            }
            off = next;
        }
        events
    }
}

/// What a consumer of the feed counted per host CPU: the events read and those the
/// kernel's pages say were lost (their counts), and the pages flagged as after a loss
/// without a count.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostTally {
    /// Per host CPU: (events read, events lost).
    pub cpus: Vec<(u64, u64)>,
    /// Pages flagged as after a loss whose count the kernel did not store.
    pub lost_pages_unknown: u64,
}

impl HostTally {
    /// Nothing counted yet, for `nr_cpus` host CPUs.
    pub fn new(nr_cpus: u32) -> Self {
        Self {
            cpus: vec![(0, 0); nr_cpus as usize],
            lost_pages_unknown: 0,
        }
    }

    /// Counts a page of host CPU `cpu` holding `events` ([`Fed::Page`]); returns the
    /// loss before it, as the page says (an unknown count too), for the sink that takes
    /// the page.
    pub fn page(&mut self, cpu: u32, page: &[u8], events: u64) -> Missed {
        let missed = page_missed(page);
        if missed == Missed::Unknown {
            self.lost_pages_unknown = self.lost_pages_unknown.saturating_add(1);
        }
        if let Some((read, lost)) = self.cpus.get_mut(cpu as usize) {
            *read = read.saturating_add(events);
            *lost = lost.saturating_add(missed.counted());
        }
        missed
    }

    /// Events lost, all CPUs.
    pub fn lost(&self) -> u64 {
        self.cpus.iter().fold(0, |a, c| a.saturating_add(c.1))
    }
}

/// The kernel's losses on one host CPU (`per_cpu/cpuN/stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostCpuLoss {
    /// `overrun`: events overwritten before they were read.
    pub overrun: u64,
    /// `dropped events`.
    pub dropped: u64,
}

/// One step of the final read ([`HostTraceFeed::next_final`]).
#[derive(Debug)]
pub enum FinalRead {
    /// An item.
    Item(Fed),
    /// Nothing within the wait; the thread is still reading.
    Waiting,
    /// The thread has read everything (or ended).
    Done,
}

/// A recording instance and its reader thread; the session takes its pages. Dropping
/// it stops the thread and removes the instance (H1).
pub struct HostTraceFeed {
    rx: Receiver<Fed>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<FeedShared>,
    tids: Vec<(u32, i32)>,
    nr_cpus: u32,
    trace: HostTrace,
}

impl std::fmt::Debug for HostTraceFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTraceFeed")
            .field("tids", &self.tids)
            .field("nr_cpus", &self.nr_cpus)
            .finish_non_exhaustive()
    }
}

impl HostTraceFeed {
    /// The next item, if one is there.
    pub fn try_next(&self) -> Option<Fed> {
        self.rx.try_recv().ok()
    }

    /// Stops recording; the thread reads what is left. [`HostTraceFeed::next_final`]
    /// then returns it all.
    pub fn stop(&self) {
        let _ = std::fs::write(self.trace.instance.path("tracing_on"), "0");
        self.shared.stop.store(true, Ordering::Release);
    }

    /// After [`HostTraceFeed::stop`]: the next item, waiting at most `wait` for the
    /// thread.
    pub fn next_final(&self, wait: Duration) -> FinalRead {
        match self.rx.recv_timeout(wait) {
            Ok(item) => FinalRead::Item(item),
            Err(RecvTimeoutError::Timeout) => FinalRead::Waiting,
            Err(RecvTimeoutError::Disconnected) => FinalRead::Done,
        }
    }

    /// Tells the thread to end at once, leaving what the rings still hold unread (the
    /// run was aborted).
    pub fn abandon(&self) {
        self.stop();
        self.shared.abandon.store(true, Ordering::Release);
    }

    /// The vCPU threads' `(vcpu, tid)` the filter names (empty with `--host-trace-all`).
    pub fn tids(&self) -> &[(u32, i32)] {
        &self.tids
    }

    /// Host CPUs.
    pub fn nr_cpus(&self) -> u32 {
        self.nr_cpus
    }

    /// Pages and events read so far.
    pub fn read(&self) -> (u64, u64) {
        (
            self.shared.pages.load(Ordering::Relaxed),
            self.shared.events.load(Ordering::Relaxed),
        )
    }

    /// The reader thread's failure, if any.
    pub fn error(&self) -> Option<String> {
        self.shared
            .error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The kernel's comm of each task it saw switch (tracefs' global `saved_cmdlines`,
    /// which recording `sched_switch` fills): `(pid, comm)`, at most 1 MiB read; a line
    /// that is not `PID COMM`, or a comm with a control character (any user names its
    /// tasks), is skipped. Empty if unreadable.
    pub fn saved_cmdlines(&self) -> Vec<(i32, String)> {
        let text = read_text(&self.trace.instance.root_path("saved_cmdlines")).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let (pid, comm) = l.split_once(' ')?;
                let pid = pid.parse::<i32>().ok().filter(|&p| p > 0)?;
                let ok = !comm.is_empty() && !comm.chars().any(char::is_control);
                ok.then(|| (pid, comm.to_string()))
            })
            .collect()
    }

    /// The kernel's per-CPU loss counters (`per_cpu/cpuN/stats`).
    pub fn kernel_losses(&self) -> Vec<HostCpuLoss> {
        (0..self.nr_cpus)
            .map(|c| {
                let text = read_text(&self.trace.instance.path(&format!("per_cpu/cpu{c}/stats")))
                    .unwrap_or_default();
                let get = |key: &str| {
                    text.lines()
                        .find_map(|l| l.strip_prefix(key))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0)
                };
                HostCpuLoss {
                    overrun: get("overrun:"),
                    dropped: get("dropped events:"),
                }
            })
            .collect()
    }
}

impl Drop for HostTraceFeed {
    fn drop(&mut self) {
        // Nobody takes what is left: the thread ends at its next read.
        self.abandon();
        // Unblock a thread waiting for room, then wait for it: the files must be
        // closed before the instance can be removed.
        while self.rx.try_recv().is_ok() {}
        if let Some(t) = self.thread.take() {
            // The thread ends at its next empty round or when it sees the channel gone;
            // receiving keeps a full channel moving.
            while !t.is_finished() {
                while self.rx.try_recv().is_ok() {}
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = t.join();
        }
        for (dir, _) in &self.trace.events {
            let _ = std::fs::write(dir.join("enable"), "0");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        assert!(selects("sched:sched_switch", "sched", "sched_switch"));
        assert!(selects("irq:*", "irq", "irq_handler_entry"));
        assert!(selects("irq", "irq", "softirq_entry"));
        assert!(selects("sched_switch", "sched", "sched_switch"));
        assert!(!selects("sched:sched_wakeup", "sched", "sched_switch"));
        let s = HostTraceSpec::parse(&["sched:sched_switch, irq:*".into()], false).unwrap();
        assert_eq!(s.patterns, ["sched:sched_switch", "irq:*"]);
    }

    /// A page of the kernel's with `commit` (flags included) and, after its `len`
    /// data bytes, `stored` as the lost-events count.
    fn kernel_page(commit: u64, len: usize, stored: u64) -> Vec<u8> {
        let mut p = vec![0u8; 4096];
        p[8..16].copy_from_slice(&commit.to_le_bytes());
        p[16 + len..24 + len].copy_from_slice(&stored.to_le_bytes());
        p
    }

    #[test]
    fn tally_counts_per_cpu_and_returns_the_loss() {
        use hyptrace_abi::page::{RB_MISSED_EVENTS, RB_MISSED_STORED};
        let (events, stored) = (RB_MISSED_EVENTS, RB_MISSED_STORED);
        let mut t = HostTally::new(2);
        assert_eq!(t.page(0, &kernel_page(8, 8, 0), 3), Missed::None);
        assert_eq!(
            t.page(1, &kernel_page(events | stored | 8, 8, 5), 2),
            Missed::Count(5)
        );
        // A loss without a count reaches the sink as one (not as no loss), counted apart.
        assert_eq!(
            t.page(1, &kernel_page(events | 8, 8, 7), 1),
            Missed::Unknown
        );
        // A CPU the tally does not have (never sent): counted nowhere, no panic.
        assert_eq!(
            t.page(9, &kernel_page(events | stored, 0, 4), 1),
            Missed::Count(4)
        );
        assert_eq!(t.cpus, [(3, 0), (3, 5)]);
        assert_eq!(t.lost(), 5);
        assert_eq!(t.lost_pages_unknown, 1);
    }
}
