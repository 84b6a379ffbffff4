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
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{self, Acquire};
use std::time::{Duration, Instant};

use hyptrace_abi::layout::meta;
use hyptrace_abi::SharedMem;
use hyptrace_output::{OutputError, OutputTarget, RunSummary, TraceMeta};
use hyptrace_reader::callbacks::{SwapReply, SwapStatus};
use hyptrace_reader::trace_file::{self, hdr};
use hyptrace_reader::{Callbacks, ReadError, RingBuffer};

use crate::control::protocol::{
    Answer, AttachInfo, Command, ConsumerPosition, Outcome, ReaderStatus,
};
use crate::control::server::{CtlConn, CtlError};
use crate::drain::clock::HostClock;
use crate::drain::session::{Output, Session, SessionError};
use crate::drain::sink::FormatArg;
use crate::vmm::time::ClockKind;

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
    #[error("--attach {path}", path = .path.display())]
    Socket {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        why: SocketProblem,
    },
    /// The VMM refused the attach (busy, `--drain live`, no `--trace-mem`).
    #[error("--attach {path}: the VMM refused: {why}", path = .path.display())]
    Refused {
        /// The socket.
        path: PathBuf,
        /// Its reason, as the VMM words it.
        why: String,
    },
    /// The trace memory file is not usable.
    #[error("{path}", path = .path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        why: FileError,
    },
    /// The output failed.
    #[error("cannot write {path}", path = .path.display())]
    Output {
        /// The output.
        path: PathBuf,
        /// Why.
        #[source]
        why: OutputProblem,
    },
}

/// What went wrong on the control socket.
#[derive(Debug, thiserror::Error)]
pub enum SocketProblem {
    /// Connecting, sending or the reply.
    #[error(transparent)]
    Ctl(#[from] CtlError),
    /// The VMM answered something else than the attach asked for.
    #[error("a reply to another request: {0}")]
    OtherReply(String),
}

/// What is wrong with the trace memory file the VMM named.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// An I/O step failed.
    #[error("{what}")]
    Io {
        /// The step (`cannot open`, `mmap`, ...).
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Not a regular file (F4).
    #[error("not a regular file")]
    NotRegular,
    /// Shorter than its fixed header.
    #[error("{0} bytes: too short for the header")]
    TooShort(u64),
    /// Bad magic.
    #[error("not a trace memory file (bad magic)")]
    BadMagic,
    /// A file version this reader does not know.
    #[error("version {0}")]
    Version(u32),
    /// The header's size is out of bounds.
    #[error("header size {0}")]
    HeaderSize(usize),
    /// The region's size is out of bounds.
    #[error("region size {0}")]
    RegionSize(u64),
    /// Shorter than the header and region it declares.
    #[error("{len} bytes: shorter than its header ({header}) and region ({region})")]
    Truncated {
        /// The file's length.
        len: u64,
        /// The header's length.
        header: usize,
        /// The mapped region's length.
        region: usize,
    },
    /// The VMM's CPU count is out of bounds, or not the pack's.
    #[error("the VMM says {vmm} CPUs{}", .pack.map(|p| format!(", the pack {p}")).unwrap_or_default())]
    Cpus {
        /// What the VMM says.
        vmm: u32,
        /// What the pack says (when it was read).
        pack: Option<u32>,
    },
    /// The rings in it do not attach, or do not start where the VMM says (C1).
    #[error(transparent)]
    Read(#[from] ReadError),
}

/// What failed in the output.
#[derive(Debug, thiserror::Error)]
pub enum OutputProblem {
    /// Opening or writing the sink.
    #[error(transparent)]
    Sink(#[from] OutputError),
    /// The session's output.
    #[error(transparent)]
    Session(#[from] SessionError),
}

impl AttachError {
    /// The exit code: 2 for input that cannot be used, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Refused { .. } | Self::File { .. } => crate::exit::EXIT_USAGE,
            Self::Socket { .. } | Self::Output { .. } => crate::exit::EXIT_RUNTIME,
        }
    }
}

/// A read-only shared mapping of part of a file (`mmap(PROT_READ, MAP_SHARED)`), read
/// through atomics and volatile copies like guest memory. Writes through the
/// [`SharedMem`] interface are refused (ignored with an error log): the consuming reader
/// never writes on this path (its swap and footer callbacks go to the VMM).
pub struct ReadOnlyMap {
    map: memmap2::MmapRaw,
    /// The part of the mapping the accessors expose (`<= len`).
    size: usize,
}

impl std::fmt::Debug for ReadOnlyMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadOnlyMap")
            .field("len", &self.map.len())
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
        let map = memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map_raw_read_only(file)?;
        Ok(Self { map, size })
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
        Some(unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(off).cast::<u64>()) })
    }

    fn refused(&self, what: &str, off: usize) {
        log::error!("read-only trace memory: {what} at {off:#x} refused");
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
            *b = unsafe { std::ptr::read_volatile(self.map.as_ptr().add(off + i)) };
        }
    }
}

/// The swap callback of the attached reader: `get_reader` on the control socket, for
/// the claim `token`, naming the page the consumer has read (C1).
pub struct SocketSwap {
    conn: RefCell<CtlConn>,
    /// The claim.
    token: u64,
    /// Per CPU: the reader page as the VMM last named it (the attach reply, then each
    /// swap's answer) — never the guest's word.
    pages: Vec<Cell<u32>>,
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

    fn request(&self, cmd: Command) -> Option<Outcome> {
        if self.gone.borrow().is_some() {
            return None;
        }
        let r = self.conn.borrow_mut().request(cmd);
        match r {
            Ok(Outcome::Err(why)) if why.starts_with("the run ended") => {
                *self.gone.borrow_mut() = Some(why);
                None
            }
            Ok(o) => Some(o),
            Err(e) => {
                log::debug!("attach: {e}");
                *self.gone.borrow_mut() = Some(crate::exit::chain(&e));
                None
            }
        }
    }

    /// Asks the VMM which vCPUs still run (`stats`): a stopped one is marked ended
    /// (its final walk is next); a VMM that went away marks every CPU. For idle
    /// rounds, where no swap is asked for (every reader waits on its writer's page).
    fn probe(&self) {
        match self.request(Command::Stats) {
            Some(Outcome::Ok(Answer::Stats(st))) => {
                for c in st.cpus.iter().filter(|c| !c.running) {
                    if let Some(e) = self.ended.get(c.cpu as usize) {
                        e.set(true);
                    }
                }
            }
            Some(o) => log::debug!("attach: stats: {o:?}"),
            None => {}
        }
    }
}

impl Callbacks for SocketSwap {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        if self.ended(cpu) {
            return Ok(SwapReply::Done(SwapStatus::Busy));
        }
        let Some(slot) = self.pages.get(cpu as usize) else {
            return Err(ReadError::BadCpu(cpu));
        };
        let page = slot.get();
        let cmd = Command::GetReader {
            token: self.token,
            cpu,
            page,
        };
        let external = |why: String| ReadError::External { cpu, why };
        let status = match self.request(cmd) {
            None => return Ok(SwapReply::Done(SwapStatus::Busy)),
            Some(Outcome::Err(why)) => return Err(external(why)),
            Some(Outcome::Ok(Answer::Reader {
                cpu: c,
                page: p,
                status,
            })) if c == cpu && p == page => status,
            Some(o) => {
                return Err(external(format!(
                    "get_reader {cpu} {page}: a reply to another request: {o:?}"
                )))
            }
        };
        Ok(match status {
            ReaderStatus::Swapped { page: new, .. } => {
                slot.set(new);
                self.swaps.set(self.swaps.get() + 1);
                SwapReply::Done(SwapStatus::Swapped { page: new })
            }
            ReaderStatus::Pending => SwapReply::Pending,
            ReaderStatus::Busy => SwapReply::Done(SwapStatus::Busy),
            ReaderStatus::Ended => {
                if let Some(c) = self.ended.get(cpu as usize) {
                    c.set(true);
                }
                SwapReply::Done(SwapStatus::Busy)
            }
        })
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
    let err = |why: FileError| AttachError::File {
        path: path.to_path_buf(),
        why,
    };
    let io = |what: &'static str| move |source| err(FileError::Io { what, source });
    // F4: O_NONBLOCK so that a FIFO named by the VMM does not block the open; refused
    // by the type check below (a mapping never blocks on the flag).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io("cannot open"))?;
    let md = file.metadata().map_err(io("stat"))?;
    if !md.file_type().is_file() {
        return Err(err(FileError::NotRegular));
    }
    let flen = md.len();
    if flen < trace_file::HEADER_FIXED as u64 {
        return Err(err(FileError::TooShort(flen)));
    }
    let head = ReadOnlyMap::map(&file, 0, trace_file::HEADER_FIXED, trace_file::HEADER_FIXED)
        .map_err(io("mmap"))?;
    let w = |off: usize| head.load(off, Acquire);
    if w(hdr::MAGIC) != trace_file::MAGIC {
        return Err(err(FileError::BadMagic));
    }
    let vh = w(hdr::VERSION_HEADER_SIZE);
    if vh as u32 != trace_file::VERSION {
        return Err(err(FileError::Version(vh as u32)));
    }
    let header_len = (vh >> 32) as usize;
    if !(trace_file::HEADER_FIXED..=trace_file::MAX_HEADER).contains(&header_len)
        || !header_len.is_multiple_of(trace_file::FILE_ALIGN)
    {
        return Err(err(FileError::HeaderSize(header_len)));
    }
    let region_size = w(hdr::REGION_SIZE);
    if region_size == 0 || region_size > trace_file::MAX_REGION {
        return Err(err(FileError::RegionSize(region_size)));
    }
    let region_size = region_size as usize;
    let mapped = trace_file::mapped_len(region_size);
    if (header_len as u64).saturating_add(mapped as u64) > flen {
        return Err(err(FileError::Truncated {
            len: flen,
            header: header_len,
            region: mapped,
        }));
    }
    let region =
        ReadOnlyMap::map(&file, header_len as u64, mapped, region_size).map_err(io("mmap"))?;
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

/// One CPU's meta page, read whole: under its sequence count (the same even count
/// before and after the fields, at most [`META_TRIES`] tries), so one view never mixes
/// two updates; `None` when the sizes are wrong or no consistent read came.
fn read_meta(m: &ReadOnlyMap, cpu: u32) -> Option<MetaView> {
    let base = (cpu as usize).checked_mul(meta::PAGE_SIZE)?;
    for _ in 0..META_TRIES {
        // Acquire: pairs with the Release store of the even count in write_meta.
        let before = m.load(base + meta::SEQ, Acquire);
        if before & 1 != 0 {
            std::hint::spin_loop();
            continue;
        }
        let view = read_meta_fields(m, base)?;
        // The fields before the second load of the count (they are Relaxed loads).
        std::sync::atomic::fence(Acquire);
        if m.load(base + meta::SEQ, Ordering::Relaxed) == before {
            return Some(view);
        }
    }
    None
}

/// Tries of [`read_meta`] (the VMM's updates take microseconds).
const META_TRIES: usize = 1000;

fn read_meta_fields(m: &ReadOnlyMap, base: usize) -> Option<MetaView> {
    let w = |o: usize| m.load(base + o, Ordering::Relaxed);
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
    /// The CPUs whose reading stopped for an error, and why (the exit is not 0).
    pub errors: Vec<(u32, String)>,
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

type AttachSession = Session<ReadOnlyMap, SocketSwap>;

/// The attached reader, the meta pages' mapping, the file's TSC frequency.
type Opened = (
    RingBuffer<ReadOnlyMap, SocketSwap>,
    Option<ReadOnlyMap>,
    u64,
);

/// Connects and claims the consumer role: the connection and the VMM's answer.
fn claim(socket: &Path) -> Result<(CtlConn, AttachInfo), AttachError> {
    let sock_err = |why: SocketProblem| AttachError::Socket {
        path: socket.to_path_buf(),
        why,
    };
    let mut conn = CtlConn::connect(socket, REPLY_TIMEOUT).map_err(|e| sock_err(e.into()))?;
    // C3: the VMM refuses an attach while it settles the last consumer's swap: ask
    // again, bounded.
    let started = Instant::now();
    loop {
        match conn.request(Command::Attach) {
            Ok(Outcome::Ok(Answer::Attached(info))) => return Ok((conn, info)),
            Ok(Outcome::Err(why))
                if why.starts_with("busy: settling") && started.elapsed() < REPLY_TIMEOUT =>
            {
                std::thread::sleep(FOLLOW_POLL);
            }
            Ok(Outcome::Err(why)) => {
                return Err(AttachError::Refused {
                    path: socket.to_path_buf(),
                    why,
                })
            }
            Ok(o) => return Err(sock_err(SocketProblem::OtherReply(format!("{o:?}")))),
            Err(e) => return Err(sock_err(e.into())),
        }
    }
}

/// Maps the file the VMM named, attaches the reader to it and starts each CPU where
/// the VMM says the reading stands (C1).
fn open_reader(conn: CtlConn, info: &AttachInfo) -> Result<Opened, AttachError> {
    let path = info.trace_mem.clone();
    let file_err = |why: FileError| AttachError::File {
        path: path.clone(),
        why,
    };
    let nr = info.nr_cpus;
    if nr == 0 || nr as usize > hyptrace_abi::layout::MAX_CPUS {
        return Err(file_err(FileError::Cpus {
            vmm: nr,
            pack: None,
        }));
    }
    let Mapped {
        region,
        metas,
        tsc_khz,
    } = map_file(&path, nr)?;
    let mut pages = vec![None; nr as usize];
    for p in &info.positions {
        if let Some(slot) = pages.get_mut(p.cpu as usize) {
            *slot = Some(*p);
        }
    }
    let swap = SocketSwap {
        conn: RefCell::new(conn),
        token: info.token,
        pages: pages
            .iter()
            .map(|p| Cell::new(p.map_or(0, |p| p.page)))
            .collect(),
        // A CPU the VMM gave no position for is in its final walk: ended.
        ended: pages.iter().map(|p| Cell::new(p.is_none())).collect(),
        gone: RefCell::new(None),
        swaps: Cell::new(0),
    };
    let mut reader = RingBuffer::attach(region, swap).map_err(|e| file_err(e.into()))?;
    if reader.layout().nr_cpus != nr {
        return Err(file_err(FileError::Cpus {
            vmm: nr,
            pack: Some(reader.layout().nr_cpus),
        }));
    }
    crate::control::consumer::start(&mut reader, info).map_err(|e| file_err(e.into()))?;
    Ok((reader, metas, tsc_khz))
}

/// The output session over `reader`: the clock, the formats, the sink. The clock is
/// this process's own map onto CLOCK_MONOTONIC (calibrated now, guest TSC = host TSC
/// assumed: the VMM sets the offset to 0), corrected while it reads like a run's.
fn open_session(
    reader: RingBuffer<ReadOnlyMap, SocketSwap>,
    tsc_khz: u64,
    o: &AttachOpts<'_>,
) -> Result<(AttachSession, HostClock), AttachError> {
    let l = *reader.layout();
    let tsc_khz = if tsc_khz == 0 {
        reader
            .mem()
            .load(hyptrace_abi::layout::pack::TSC_KHZ, Acquire)
    } else {
        tsc_khz
    };
    let host_clock = HostClock::calibrate(ClockKind::Mono, tsc_khz, 0)
        .or_else(|e| {
            log::warn!(
                "guest clock ({tsc_khz} kHz): {}: timestamps are raw TSC values",
                crate::exit::chain(&e)
            );
            HostClock::calibrate(ClockKind::Tsc, tsc_khz, 0)
        })
        .map_err(|e| out_err(o, e))?;
    let clock = host_clock.clock.clone();
    let mut tmeta = TraceMeta::guest(l.page_size, l.nr_cpus, clock.clone());
    let formats = match crate::vmm::registration::region_formats(reader.mem(), &l) {
        Ok(Some(f)) => f,
        Ok(None) => tmeta.formats.clone(),
        Err(e) => {
            log::warn!(
                "the event registration table: {}: the built-in formats are used",
                crate::exit::chain(&e)
            );
            tmeta.formats.clone()
        }
    };
    tmeta.formats = formats.clone();
    // Text on stdout streams line by line (as `hyptrace run` prints: the session's own
    // merger, written every round); files and the other formats go through the page
    // sinks (a file appears whole at the end, as for `record -o`).
    let output =
        if o.format == FormatArg::Text && o.target.kind() == hyptrace_output::TargetKind::Stdout {
            Output::text(Box::new(std::io::stdout()), l.nr_cpus)
        } else {
            Output::Pages(
                crate::drain::sink::make_sink(
                    o.target,
                    o.format,
                    hyptrace_output::Compression::Zstd,
                    tmeta,
                )
                .map_err(|e| out_err(o, e))?,
            )
        };
    Ok((
        Session::new(reader, output, clock).with_formats(&formats),
        host_clock,
    ))
}

fn out_err(o: &AttachOpts<'_>, why: impl Into<OutputProblem>) -> AttachError {
    AttachError::Output {
        path: o.out_path.to_path_buf(),
        why: why.into(),
    }
}

/// Reads rounds until the VMM goes, every vCPU stopped, a stop, or (one-shot) a round
/// that found nothing new; returns why it ended.
fn read_rounds(
    session: &mut AttachSession,
    clock: &mut HostClock,
    o: &AttachOpts<'_>,
) -> Result<String, AttachError> {
    let nr = session.reader().nr_cpus();
    let progress = |s: &AttachSession| -> u64 {
        (0..nr).fold(0u64, |a, c| {
            let st = s.stats(c);
            a.wrapping_add(st.read)
                .wrapping_add(st.lost)
                .wrapping_add(st.swaps)
        })
    };
    let started = Instant::now();
    let mut last = progress(session);
    let mut rounds = 0usize;
    loop {
        clock.recheck(false);
        // No CPU is walked as stopped here: the stopped ones get their final walk
        // once the loop ends.
        for (cpu, e) in session.service(|_| false) {
            log::warn!("cpu {cpu}: {e}");
        }
        session.flush().map_err(|e| out_err(o, e))?;
        let cb = session.reader().callbacks();
        if let Some(why) = cb.gone.borrow().clone() {
            return Ok(format!("the VMM went away ({why})"));
        }
        if (0..nr).all(|c| cb.ended(c) || session.error(c).is_some()) {
            return Ok("every vCPU stopped".to_string());
        }
        if (o.stop)() {
            return Ok("interrupted".to_string());
        }
        rounds += 1;
        let now = progress(session);
        // A swap the VMM asked the guest for is progress to come: not idle (C3).
        let pending = (0..nr).any(|c| session.reader().request_in_flight(c));
        let idle = now == last && !pending;
        last = now;
        if !o.follow && (idle || rounds >= DRAIN_MAX_ROUNDS) {
            return Ok(format!(
                "drained in {:.1} ms",
                started.elapsed().as_secs_f64() * 1e3
            ));
        }
        if idle {
            std::thread::sleep(FOLLOW_POLL);
            session.reader().callbacks().probe();
        }
    }
}

/// Ends the claim: tells the VMM where each CPU's reading stopped (C1), or that this
/// consumer read it to its end (C4), so the next consumer and the VMM's own final read
/// output nothing twice. A CPU with a swap in flight is left to the VMM to settle (C3).
fn detach(session: &AttachSession, walked: &[bool]) {
    let reader = session.reader();
    let cb = reader.callbacks();
    if cb.gone.borrow().is_some() {
        return;
    }
    let positions: Vec<ConsumerPosition> = (0..reader.nr_cpus())
        .filter_map(|cpu| {
            if walked.get(cpu as usize) == Some(&true) {
                return Some(ConsumerPosition {
                    cpu,
                    page: 0,
                    consumed: 0,
                    expected: 0,
                    done: true,
                });
            }
            if reader.request_in_flight(cpu) || session.error(cpu).is_some() {
                return None;
            }
            Some(ConsumerPosition::at(cpu, reader.position(cpu)?))
        })
        .collect();
    let cmd = Command::Detach {
        token: cb.token,
        positions,
    };
    match cb.request(cmd) {
        Some(Outcome::Ok(Answer::Detached)) | None => {}
        Some(Outcome::Err(why)) => {
            log::warn!("detach: the VMM refused a position (the next consumer may repeat part of a page): {why}")
        }
        Some(o) => log::warn!("detach: a reply to another request: {o:?}"),
    }
}

/// Attaches to the VMM behind `o.socket`, reads and writes its events, returns what was
/// read.
pub fn attach(o: &AttachOpts<'_>) -> Result<AttachReport, AttachError> {
    let (conn, info) = claim(o.socket)?;
    let (reader, metas, tsc_khz) = open_reader(conn, &info)?;
    let nr = reader.nr_cpus();
    let (mut session, mut clock) = open_session(reader, tsc_khz, o)?;
    let ended = read_rounds(&mut session, &mut clock, o)?;
    clock.recheck(true);
    if let Some(line) = clock.summary() {
        log::info!("{line}");
    }
    // CPUs whose vCPU stopped (or all, if the VMM is gone) get the final walk of what is
    // left; the others stop where they are.
    let mut walked = vec![false; nr as usize];
    for c in 0..nr {
        if session.reader().callbacks().ended(c) && session.is_live(c) {
            match session.end_cpu(c) {
                Ok(()) => walked[c as usize] = true,
                Err(e) => log::warn!("cpu {c}: final walk: {e}"),
            }
        }
    }
    detach(&session, &walked);
    // The CPUs still running stop here: what was read is all this attach delivers.
    session.stop_reading();
    session.flush().map_err(|e| out_err(o, e))?;
    let stats: Vec<_> = (0..nr).map(|c| session.stats(c)).collect();
    let errors = (0..nr)
        .filter_map(|c| session.error(c).map(|e| (c, e.to_string())))
        .collect();
    let metas = (0..nr)
        .map(|c| metas.as_ref().and_then(|m| read_meta(m, c)))
        .collect();
    let swaps = session.reader().callbacks().swaps.get();
    let summary = RunSummary {
        cpus: stats
            .iter()
            .map(|s| hyptrace_output::KernelCpuStat {
                entries: 0,
                overrun: s.overrun,
                commit_overrun: 0,
                bytes: s.bytes,
                oldest_event_ts: 0,
                now_ts: 0,
                dropped_events: s.dropped,
                read_events: s.read,
            })
            .collect(),
    };
    session.finish(&summary).map_err(|e| out_err(o, e))?;
    Ok(AttachReport {
        cpus: stats.iter().map(|s| (s.read, s.lost)).collect(),
        swaps,
        ended,
        metas,
        errors,
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

    /// A meta page is read whole under its sequence count: an update under way (odd
    /// count) gives no view rather than a mix of two updates; an even count gives the
    /// fields.
    #[test]
    fn meta_page_read_under_its_sequence_count() {
        let dir = std::env::temp_dir().join(format!("hyptrace-meta-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("m");
        let mut page = vec![0u8; meta::PAGE_SIZE];
        let mut w = |off: usize, v: u64| page[off..off + 8].copy_from_slice(&v.to_le_bytes());
        w(
            meta::META_PAGE_SIZE,
            meta::PAGE_SIZE as u64 | ((meta::STRUCT_LEN as u64) << 32),
        );
        w(meta::ENTRIES, 77);
        w(meta::SEQ, 3);
        std::fs::write(&path, &page).expect("write");
        let f = std::fs::File::open(&path).expect("open");
        let m = ReadOnlyMap::map(&f, 0, meta::PAGE_SIZE, meta::PAGE_SIZE).expect("map");
        assert!(read_meta(&m, 0).is_none(), "an update under way is no view");
        page[meta::SEQ..meta::SEQ + 8].copy_from_slice(&4u64.to_le_bytes());
        std::fs::write(&path, &page).expect("write");
        assert_eq!(read_meta(&m, 0).map(|v| v.entries), Some(77));
        let _ = std::fs::remove_dir_all(&dir);
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
