//! Live attach (`hyptrace dump --attach SOCKET [--follow]`): a second process reads a
//! running VM's rings zero-copy, as user space maps the kernel ring buffer and asks for
//! the next reader page.
//!
//! The VMM runs `--drain none --trace-mem FILE --control SOCKET`. The client claims the
//! consumer role (`attach`: one consumer at a time), maps the trace memory file
//! read-only ([`ReadOnlyMap`]), and reads each CPU's reader page in place with the
//! ordinary consuming reader ([`hyptrace_reader::RingBuffer`]) whose swap callback is a
//! `get_reader CPU` on the socket ([`SocketSwap`]): the VMM swaps (host side, through its
//! own reader and callbacks; the guest stays the writer) and updates the CPU's meta page.
//! Losses are counted exactly from the pages' first event indexes (R1), as in-process.
//! When a vCPU stops (`get_reader` answers `ended`) or the VMM goes away (the socket
//! closes), the CPU gets the final read-only walk of what is left in the file.
//!
//! The file is hostile input like guest memory: the header is checked against the
//! file's size before anything is mapped, the pack is validated by the reader, and
//! every page id, commit and record is checked as for the in-process reader.

use std::cell::{Cell, RefCell};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{self, Acquire};
use std::time::{Duration, Instant};

use hyptrace_abi::layout::meta;
use hyptrace_abi::SharedMem;
use hyptrace_output::{Clock, OutputTarget, RunSummary, TraceMeta};
use hyptrace_reader::callbacks::{SwapReply, SwapStatus};
use hyptrace_reader::trace_file::{self, hdr};
use hyptrace_reader::{Callbacks, ReadError, RingBuffer};

use crate::cli::FormatArg;
use crate::session::{Output, Session};

/// How long the client waits for one reply of the VMM.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(15);
/// The poll interval of `--follow` when no CPU had anything.
pub const FOLLOW_POLL: Duration = Duration::from_millis(10);
/// Rounds of a one-shot drain (without `--follow`) at most: it ends earlier, at the
/// first round that found nothing new.
const DRAIN_MAX_ROUNDS: usize = 1 << 16;

/// Why live attach failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The socket cannot be reached or talked to.
    #[error("--attach {path}: {why}", path = .path.display())]
    Socket {
        /// The socket.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The VMM refused the attach (busy, `--drain live`, no `--trace-mem`).
    #[error("--attach {path}: the VMM refused: {why}", path = .path.display())]
    Refused {
        /// The socket.
        path: PathBuf,
        /// Its reason.
        why: String,
    },
    /// The trace memory file is not usable.
    #[error("{path}: {why}", path = .path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The output failed.
    #[error("cannot write {path}: {why}", path = .path.display())]
    Output {
        /// The output.
        path: PathBuf,
        /// Why.
        why: String,
    },
}

impl AttachError {
    /// The exit code: 2 for input that cannot be used, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Refused { .. } | Self::File { .. } => crate::cli::EXIT_USAGE,
            Self::Socket { .. } | Self::Output { .. } => crate::cli::EXIT_RUNTIME,
        }
    }
}

/// A read-only shared mapping of part of a file (`mmap(PROT_READ, MAP_SHARED)`), read
/// through atomics and volatile copies like guest memory. Writes through the
/// [`SharedMem`] interface are refused (ignored with an error log): the consuming reader
/// never writes on this path (its swap and footer callbacks go to the VMM).
pub struct ReadOnlyMap {
    ptr: *mut u8,
    len: usize,
    /// The part of the mapping the accessors expose (`<= len`).
    size: usize,
}

impl std::fmt::Debug for ReadOnlyMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadOnlyMap")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl ReadOnlyMap {
    /// Maps `len` bytes of `file` at `offset` (4 KiB aligned) read-only; the accessors
    /// see the first `size` of them. The caller checked that the file holds them.
    pub fn map(
        file: &std::fs::File,
        offset: u64,
        len: usize,
        size: usize,
    ) -> std::io::Result<Self> {
        if len == 0 || size > len || !offset.is_multiple_of(4096) {
            return Err(std::io::Error::other("bad mapping request"));
        }
        let off = libc::off_t::try_from(offset).map_err(std::io::Error::other)?;
        // SAFETY: a fresh read-only shared mapping of an open file; no address hint, so
        // nothing existing is replaced. The result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
            size,
        })
    }

    fn check(&self, off: usize, n: usize) -> bool {
        off.checked_add(n).is_some_and(|end| end <= self.size)
    }

    /// The word at `off` (8-aligned, inside), or `None`.
    fn word(&self, off: usize) -> Option<&AtomicU64> {
        if !off.is_multiple_of(8) || !self.check(off, 8) {
            return None;
        }
        // SAFETY: `off` is 8-aligned and inside the mapping (checked), whose base is
        // page-aligned and which lives as long as `self`; the other process (the VMM, the
        // guest) writes these words only atomically; this one only loads them.
        Some(unsafe { AtomicU64::from_ptr(self.ptr.add(off).cast::<u64>()) })
    }

    fn refused(&self, what: &str, off: usize) {
        log::error!("read-only trace memory: {what} at {off:#x} refused");
    }
}

impl Drop for ReadOnlyMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of `len` bytes, unmapped once; no reference
        // into it outlives `self` (the accessors copy out).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

impl SharedMem for ReadOnlyMap {
    fn size(&self) -> usize {
        self.size
    }
    fn load(&self, off: usize, order: Ordering) -> u64 {
        // Out of range reads as 0: every caller checked its offsets against the layout
        // (which is checked against `size`), so this does not happen.
        // Only a Relaxed load is allowed on read-only memory (an Acquire or SeqCst
        // atomic load may be implemented as a read-modify-write, which would fault on a
        // PROT_READ page; Rust's atomics rules make it UB): a Relaxed load, then a fence
        // of the order asked, which gives the load Acquire's ordering.
        let v = self.word(off).map_or(0, |w| w.load(Ordering::Relaxed));
        if matches!(
            order,
            Ordering::Acquire | Ordering::AcqRel | Ordering::SeqCst
        ) {
            std::sync::atomic::fence(order);
        }
        v
    }
    fn store(&self, off: usize, _val: u64, _order: Ordering) {
        self.refused("store", off);
    }
    fn swap(&self, off: usize, _val: u64, _order: Ordering) -> u64 {
        self.refused("swap", off);
        self.load(off, Acquire)
    }
    fn compare_exchange(
        &self,
        off: usize,
        _current: u64,
        _new: u64,
        _success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64> {
        self.refused("compare_exchange", off);
        Err(self.load(off, failure))
    }
    fn fetch_or(&self, off: usize, _val: u64, order: Ordering) -> u64 {
        self.refused("fetch_or", off);
        self.load(off, order)
    }
    fn fetch_and(&self, off: usize, _val: u64, order: Ordering) -> u64 {
        self.refused("fetch_and", off);
        self.load(off, order)
    }
    fn fetch_add(&self, off: usize, _val: u64, order: Ordering) -> u64 {
        self.refused("fetch_add", off);
        self.load(off, order)
    }
    fn write_bytes(&self, off: usize, _src: &[u8]) {
        self.refused("write_bytes", off);
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        if !self.check(off, dst.len()) {
            dst.fill(0);
            return;
        }
        for (i, b) in dst.iter_mut().enumerate() {
            // SAFETY: `off + i` is inside the mapping (the range is checked above);
            // volatile: the other process may be writing these bytes.
            *b = unsafe { std::ptr::read_volatile(self.ptr.add(off + i)) };
        }
    }
}

/// The connection to the VMM's control socket: one request line, one reply line.
struct Conn {
    out: UnixStream,
    inp: BufReader<UnixStream>,
    line: String,
}

impl Conn {
    fn connect(path: &Path) -> Result<Self, AttachError> {
        let err = |why: String| AttachError::Socket {
            path: path.to_path_buf(),
            why,
        };
        let s = UnixStream::connect(path).map_err(|e| err(format!("cannot connect: {e}")))?;
        s.set_read_timeout(Some(REPLY_TIMEOUT))
            .and_then(|()| s.set_write_timeout(Some(REPLY_TIMEOUT)))
            .map_err(|e| err(e.to_string()))?;
        let r = s.try_clone().map_err(|e| err(e.to_string()))?;
        Ok(Self {
            out: s,
            inp: BufReader::with_capacity(4096, r),
            line: String::new(),
        })
    }

    /// Sends `cmd`; returns `Ok(Ok(payload))` for `ok`, `Ok(Err(reason))` for `err`,
    /// `Err` when the VMM is gone or the reply is not a protocol line.
    fn request(&mut self, cmd: &str) -> Result<Result<String, String>, String> {
        self.out
            .write_all(format!("{cmd}\n").as_bytes())
            .map_err(|e| format!("send: {e}"))?;
        self.line.clear();
        // Bounded: one reply line is at most this long (the VMM's replies are short).
        let mut limited = (&mut self.inp).take(1 << 20);
        match limited.read_line(&mut self.line) {
            Ok(0) => return Err("the VMM closed the socket".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("receive: {e}")),
        }
        let l = self.line.trim_end_matches(['\n', '\r']);
        if let Some(p) = l.strip_prefix("ok") {
            Ok(Ok(p.trim_start().to_string()))
        } else if let Some(p) = l.strip_prefix("err") {
            Ok(Err(p.trim_start().to_string()))
        } else {
            Err(format!(
                "not a protocol reply: {:?}",
                l.chars().take(80).collect::<String>()
            ))
        }
    }
}

/// The swap callback of the attached reader: `get_reader CPU` on the control socket.
pub struct SocketSwap {
    conn: RefCell<Conn>,
    /// Per CPU: the VMM said its vCPU stopped (`ended`): the final walk is next.
    ended: Vec<Cell<bool>>,
    /// The VMM went away (or the connection failed): why.
    gone: RefCell<Option<String>>,
    /// Swaps the VMM did for us.
    swaps: Cell<u64>,
}

impl SocketSwap {
    fn ended(&self, cpu: u32) -> bool {
        self.gone.borrow().is_some() || self.ended.get(cpu as usize).is_some_and(Cell::get)
    }
}

impl SocketSwap {
    /// Asks the VMM which vCPUs still run (`stats`): a stopped one is marked ended
    /// (its final walk is next); a VMM that went away marks every CPU. For idle
    /// rounds, where no swap is asked for (every reader waits on its writer's page).
    fn probe(&self) {
        if self.gone.borrow().is_some() {
            return;
        }
        let r = self.conn.borrow_mut().request("stats");
        let payload = match r {
            Ok(Ok(p)) => p,
            Ok(Err(why)) if why.starts_with("the run ended") => {
                *self.gone.borrow_mut() = Some(why);
                return;
            }
            Ok(Err(why)) => {
                log::debug!("attach: stats: {why}");
                return;
            }
            Err(why) => {
                *self.gone.borrow_mut() = Some(why);
                return;
            }
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&payload) else {
            return;
        };
        let Some(cpus) = v.get("cpus").and_then(|c| c.as_array()) else {
            return;
        };
        for c in cpus.iter().take(self.ended.len()) {
            let cpu = c.get("cpu").and_then(serde_json::Value::as_u64);
            let running = c.get("running").and_then(serde_json::Value::as_bool);
            if let (Some(cpu), Some(false)) = (cpu, running) {
                if let Some(e) = usize::try_from(cpu).ok().and_then(|i| self.ended.get(i)) {
                    e.set(true);
                }
            }
        }
    }
}

impl Callbacks for SocketSwap {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        if self.ended(cpu) {
            return Ok(SwapReply::Done(SwapStatus::Busy));
        }
        let r = self.conn.borrow_mut().request(&format!("get_reader {cpu}"));
        match r {
            Err(why) => {
                log::debug!("attach: {why}");
                *self.gone.borrow_mut() = Some(why);
                Ok(SwapReply::Done(SwapStatus::Busy))
            }
            Ok(Err(why)) if why.starts_with("the run ended") => {
                *self.gone.borrow_mut() = Some(why);
                Ok(SwapReply::Done(SwapStatus::Busy))
            }
            Ok(Err(why)) => Err(ReadError::External { cpu, why }),
            Ok(Ok(p)) => {
                let mut w = p.split(' ');
                match w.next() {
                    Some("swapped") => {
                        let page = w.next().and_then(|x| x.parse::<u32>().ok());
                        let Some(page) = page else {
                            return Err(ReadError::External {
                                cpu,
                                why: format!("bad get_reader reply {p:?}"),
                            });
                        };
                        self.swaps.set(self.swaps.get() + 1);
                        Ok(SwapReply::Done(SwapStatus::Swapped { page }))
                    }
                    Some("pending") => Ok(SwapReply::Pending),
                    Some("ended") => {
                        if let Some(c) = self.ended.get(cpu as usize) {
                            c.set(true);
                        }
                        Ok(SwapReply::Done(SwapStatus::Busy))
                    }
                    _ => Ok(SwapReply::Done(SwapStatus::Busy)),
                }
            }
        }
    }

    fn update_footers(&self, _cpu: u32) -> Result<bool, ReadError> {
        // Nothing to refresh from here: the stats come from the control blocks at the
        // end and from the meta pages.
        Ok(false)
    }
    fn releases(&self, _cpu: u32) -> bool {
        // One consumer at a time, through the VMM's `get_reader` swaps.
        false
    }
}

/// The trace memory file of a running VMM, mapped read-only.
struct Mapped {
    region: ReadOnlyMap,
    metas: Option<ReadOnlyMap>,
    tsc_khz: u64,
}

/// A header word of the file (read once through a small mapping of the header).
fn map_file(path: &Path, nr_cpus_hint: u32) -> Result<Mapped, AttachError> {
    let err = |why: String| AttachError::File {
        path: path.to_path_buf(),
        why,
    };
    // F4: O_NONBLOCK so that a FIFO named by the VMM does not block the open; refused
    // by the type check below (a mapping never blocks on the flag).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| err(format!("cannot open: {e}")))?;
    let md = file.metadata().map_err(|e| err(e.to_string()))?;
    if !md.file_type().is_file() {
        return Err(err("not a regular file".into()));
    }
    let flen = md.len();
    if flen < trace_file::HEADER_FIXED as u64 {
        return Err(err(format!("{flen} bytes: too short for the header")));
    }
    let head = ReadOnlyMap::map(&file, 0, trace_file::HEADER_FIXED, trace_file::HEADER_FIXED)
        .map_err(|e| err(format!("mmap: {e}")))?;
    let w = |off: usize| head.load(off, Acquire);
    if w(hdr::MAGIC) != trace_file::MAGIC {
        return Err(err("not a trace memory file (bad magic)".into()));
    }
    let vh = w(hdr::VERSION_HEADER_SIZE);
    if vh as u32 != trace_file::VERSION {
        return Err(err(format!("version {}", vh as u32)));
    }
    let header_len = (vh >> 32) as usize;
    if !(trace_file::HEADER_FIXED..=trace_file::MAX_HEADER).contains(&header_len)
        || !header_len.is_multiple_of(trace_file::FILE_ALIGN)
    {
        return Err(err(format!("header size {header_len}")));
    }
    let region_size = w(hdr::REGION_SIZE);
    if region_size == 0 || region_size > trace_file::MAX_REGION {
        return Err(err(format!("region size {region_size}")));
    }
    let region_size = region_size as usize;
    let mapped = trace_file::mapped_len(region_size);
    if (header_len as u64).saturating_add(mapped as u64) > flen {
        return Err(err(format!(
            "{flen} bytes: shorter than its header ({header_len}) and region ({mapped})"
        )));
    }
    let region = ReadOnlyMap::map(&file, header_len as u64, mapped, region_size)
        .map_err(|e| err(format!("mmap: {e}")))?;
    let nr = u64::from(nr_cpus_hint.max(1));
    let meta_off = w(hdr::META_OFF);
    let meta_len = nr.saturating_mul(meta::PAGE_SIZE as u64);
    let metas = if meta_off != 0
        && meta_off.is_multiple_of(4096)
        && meta_off.saturating_add(meta_len) <= flen
    {
        ReadOnlyMap::map(&file, meta_off, meta_len as usize, meta_len as usize).ok()
    } else {
        None
    };
    Ok(Mapped {
        region,
        metas,
        tsc_khz: w(hdr::TSC_KHZ),
    })
}

/// One CPU's meta page as the VMM last wrote it.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct MetaView {
    /// `reader.id`.
    pub reader_id: u32,
    /// `reader.lost_events`.
    pub lost_events: u64,
    /// `entries`.
    pub entries: u64,
    /// `overrun`.
    pub overrun: u64,
    /// `read`.
    pub read: u64,
    /// `pages_lost` (events lost in total on the consumer's side).
    pub lost_total: u64,
    /// `pages_touched`.
    pub pages_touched: u64,
}

fn read_meta(m: &ReadOnlyMap, cpu: u32) -> Option<MetaView> {
    let base = (cpu as usize).checked_mul(meta::PAGE_SIZE)?;
    let w = |o: usize| m.load(base + o, Acquire);
    let sizes = w(meta::META_PAGE_SIZE);
    if sizes as u32 as usize != meta::PAGE_SIZE || (sizes >> 32) as usize != meta::STRUCT_LEN {
        return None;
    }
    Some(MetaView {
        reader_id: w(meta::READER_ID) as u32,
        lost_events: w(meta::READER_LOST_EVENTS),
        entries: w(meta::ENTRIES),
        overrun: w(meta::OVERRUN),
        read: w(meta::READ),
        lost_total: w(meta::PAGES_LOST),
        pages_touched: w(meta::PAGES_TOUCHED),
    })
}

/// What an attach read.
#[derive(Debug, Default)]
pub struct AttachReport {
    /// Per CPU: events written to the output, events lost.
    pub cpus: Vec<(u64, u64)>,
    /// Swaps the VMM did for this client.
    pub swaps: u64,
    /// Why the reading ended.
    pub ended: String,
    /// The meta pages at the end.
    pub metas: Vec<Option<MetaView>>,
}

/// The options of one attach.
pub struct AttachOpts<'a> {
    /// The control socket.
    pub socket: &'a Path,
    /// Keep reading until the VM exits (or `stop` says so).
    pub follow: bool,
    /// The output and its format.
    pub target: &'a OutputTarget,
    /// The output's path (for messages).
    pub out_path: &'a Path,
    /// The format.
    pub format: FormatArg,
    /// Polled between rounds: stop (SIGINT) and flush.
    pub stop: &'a dyn Fn() -> bool,
}

/// Attaches to the VMM behind `o.socket`, reads and writes its events, returns what was
/// read.
pub fn attach(o: &AttachOpts<'_>) -> Result<AttachReport, AttachError> {
    let mut conn = Conn::connect(o.socket)?;
    let reply = conn.request("attach").map_err(|why| AttachError::Socket {
        path: o.socket.to_path_buf(),
        why,
    })?;
    let info = reply.map_err(|why| AttachError::Refused {
        path: o.socket.to_path_buf(),
        why,
    })?;
    let v: serde_json::Value = serde_json::from_str(&info).map_err(|e| AttachError::Socket {
        path: o.socket.to_path_buf(),
        why: format!("bad attach reply: {e}"),
    })?;
    let Some(path) = v
        .get("trace_mem")
        .and_then(|p| p.as_str())
        .map(PathBuf::from)
    else {
        return Err(AttachError::Socket {
            path: o.socket.to_path_buf(),
            why: "the attach reply names no trace memory file".into(),
        });
    };
    let nr_hint = v
        .get("nr_cpus")
        .and_then(serde_json::Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n as usize <= hyptrace_abi::layout::MAX_CPUS)
        .unwrap_or(1);
    let mapped = map_file(&path, nr_hint)?;
    let file_err = |why: String| AttachError::File {
        path: path.clone(),
        why,
    };
    let nr = nr_hint;
    let swap = SocketSwap {
        conn: RefCell::new(conn),
        ended: (0..nr).map(|_| Cell::new(false)).collect(),
        gone: RefCell::new(None),
        swaps: Cell::new(0),
    };
    let Mapped {
        region,
        metas,
        tsc_khz,
    } = mapped;
    let reader = RingBuffer::attach(region, swap).map_err(|e| file_err(e.to_string()))?;
    let l = *reader.layout();
    if l.nr_cpus != nr {
        return Err(file_err(format!(
            "the VMM says {nr} CPUs, the pack {}",
            l.nr_cpus
        )));
    }
    let tsc_khz = if tsc_khz == 0 {
        reader
            .mem()
            .load(hyptrace_abi::layout::pack::TSC_KHZ, Acquire)
    } else {
        tsc_khz
    };
    let clock = Clock::guest_tsc(tsc_khz).unwrap_or_else(|e| {
        log::warn!("guest clock ({tsc_khz} kHz): {e}: timestamps are raw TSC values");
        Clock::nanoseconds()
    });
    let mut tmeta = TraceMeta::guest(l.page_size, l.nr_cpus, clock.clone());
    let formats = match crate::dump::region_formats(reader.mem(), &l) {
        Ok(Some(f)) => f,
        Ok(None) => tmeta.formats.clone(),
        Err(e) => {
            log::warn!("the event registration table: {e}: the built-in formats are used");
            tmeta.formats.clone()
        }
    };
    tmeta.formats = formats.clone();
    let out_err = |why: String| AttachError::Output {
        path: o.out_path.to_path_buf(),
        why,
    };
    // Text on stdout streams line by line (as `hyptrace run` prints: the session's own
    // merger, written every round); files and the other formats go through the page
    // sinks (a file appears whole at the end, as for `record -o`).
    let output =
        if o.format == FormatArg::Text && o.target.kind() == hyptrace_output::TargetKind::Stdout {
            Output::text(Box::new(std::io::stdout()), l.nr_cpus)
        } else {
            Output::Pages(
                crate::run::make_sink(
                    o.target,
                    o.format,
                    hyptrace_output::Compression::Zstd,
                    tmeta,
                )
                .map_err(|e| out_err(e.to_string()))?,
            )
        };
    let mut session = Session::new(reader, output, clock).with_formats(&formats);
    let progress = |s: &Session<ReadOnlyMap, SocketSwap>| -> u64 {
        (0..nr).fold(0u64, |a, c| {
            let st = s.stats(c);
            a.wrapping_add(st.read)
                .wrapping_add(st.lost)
                .wrapping_add(st.swaps)
        })
    };
    let started = Instant::now();
    let mut last = progress(&session);
    let mut rounds = 0usize;
    let ended = loop {
        // No CPU is walked as stopped here: the stopped ones get their final walk
        // below, once the loop ends.
        let failed = session.service(|_| false);
        for (cpu, e) in failed {
            log::warn!("cpu {cpu}: {e}");
        }
        session.flush().map_err(|e| out_err(e.to_string()))?;
        let cb = session.reader().callbacks();
        if let Some(why) = cb.gone.borrow().clone() {
            break format!("the VMM went away ({why})");
        }
        if (0..nr).all(|c| cb.ended(c) || session.error(c).is_some()) {
            break "every vCPU stopped".to_string();
        }
        if (o.stop)() {
            break "interrupted".to_string();
        }
        rounds += 1;
        let now = progress(&session);
        let idle = now == last;
        last = now;
        if !o.follow && (idle || rounds >= DRAIN_MAX_ROUNDS) {
            break format!("drained in {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
        }
        if idle {
            std::thread::sleep(FOLLOW_POLL);
            session.reader().callbacks().probe();
        }
    };
    // CPUs whose vCPU stopped (or all, if the VMM is gone) get the final walk of what is
    // left; the others stop where they are.
    for c in 0..nr {
        if session.reader().callbacks().ended(c) {
            if let Err(e) = session.end_cpu(c) {
                log::warn!("cpu {c}: final walk: {e}");
            }
        }
    }
    // The CPUs still running stop here: what was read is all this attach delivers.
    session.stop_reading();
    session.flush().map_err(|e| out_err(e.to_string()))?;
    let cpus: Vec<(u64, u64)> = (0..nr)
        .map(|c| {
            let s = session.stats(c);
            (s.read, s.lost)
        })
        .collect();
    let metas_now = (0..nr)
        .map(|c| metas.as_ref().and_then(|m| read_meta(m, c)))
        .collect();
    let swaps = session.reader().callbacks().swaps.get();
    let summary = RunSummary {
        cpus: (0..nr)
            .map(|c| {
                let s = session.stats(c);
                hyptrace_output::KernelCpuStat {
                    entries: 0,
                    overrun: s.overrun,
                    commit_overrun: 0,
                    bytes: s.bytes,
                    oldest_event_ts: 0,
                    now_ts: 0,
                    dropped_events: s.dropped,
                    read_events: s.read,
                }
            })
            .collect(),
    };
    session
        .finish(&summary)
        .map_err(|e| out_err(e.to_string()))?;
    Ok(AttachReport {
        cpus,
        swaps,
        ended,
        metas: metas_now,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(region_size: u64, header_len: u64, meta_off: u64) -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        let mut w = |off: usize, v: u64| b[off..off + 8].copy_from_slice(&v.to_le_bytes());
        w(hdr::MAGIC, trace_file::MAGIC);
        w(
            hdr::VERSION_HEADER_SIZE,
            u64::from(trace_file::VERSION) | (header_len << 32),
        );
        w(hdr::REGION_SIZE, region_size);
        w(hdr::META_OFF, meta_off);
        b
    }

    /// The trace memory file is hostile: a bad magic, version, header size, a region
    /// larger than the file, a short file are errors before anything is mapped past the
    /// header; a region of garbage is refused by the pack check; nothing panics.
    #[test]
    fn hostile_files_are_errors() {
        let dir = std::env::temp_dir().join(format!("hyptrace-attach-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("f");
        let mut cases: Vec<(&str, Vec<u8>)> =
            vec![("short", vec![0u8; 100]), ("magic", vec![0u8; 8192])];
        let mut v = header(4096, 4096, 0);
        v[8] = 9;
        cases.push(("version", v));
        cases.push(("header size", header(4096, 100, 0)));
        cases.push(("header huge", header(4096, 1 << 40, 0)));
        cases.push(("region zero", header(0, 4096, 0)));
        cases.push(("region past the end", header(1 << 20, 4096, 0)));
        cases.push(("region huge", header(u64::MAX, 4096, 0)));
        for (what, bytes) in cases {
            std::fs::write(&path, &bytes).expect("write");
            let r = map_file(&path, 1);
            assert!(r.is_err(), "{what}: mapped");
        }
        // A header that fits, a region of garbage, meta pages out of range: mapped
        // (metas ignored), then refused by the pack check.
        let mut bytes = header(8192, 4096, 1 << 40);
        bytes.extend((0..8192u32).map(|i| (i * 7) as u8));
        std::fs::write(&path, &bytes).expect("write");
        let m = map_file(&path, 4).expect("maps");
        assert!(m.metas.is_none());
        let r = hyptrace_reader::RingBuffer::attach(m.region, NoSwap);
        assert!(r.is_err(), "garbage region accepted");
        // Out-of-range accesses of the mapping read as zeros, writes are refused.
        let m = map_file(&path, 1).expect("maps");
        assert_eq!(m.region.load(1 << 30, Acquire), 0);
        m.region.store(0, 1, Ordering::Relaxed);
        let mut b = [1u8; 16];
        m.region.read_bytes(usize::MAX - 4, &mut b);
        assert_eq!(b, [0u8; 16]);
        // A FIFO (no writer) is refused at once, not waited on (F4).
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("cstr");
        // SAFETY: mkfifo with a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
        assert!(map_file(&fifo, 1).is_err(), "a FIFO mapped");
        let _ = std::fs::remove_dir_all(&dir);
    }

    struct NoSwap;
    impl Callbacks for NoSwap {
        fn swap_reader(&self, _cpu: u32) -> Result<SwapReply, ReadError> {
            Ok(SwapReply::Done(SwapStatus::Busy))
        }
        fn update_footers(&self, _cpu: u32) -> Result<bool, ReadError> {
            Ok(false)
        }
        fn releases(&self, _cpu: u32) -> bool {
            false
        }
    }
}
