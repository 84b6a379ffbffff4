//! The runtime control socket (`run/record --control PATH`) and its client (`hyptrace
//! ctl PATH CMD...`).
//!
//! A Unix stream socket, owner-only (0600), served by one host thread while the VM runs.
//! The messages are [`crate::control::protocol`]'s: one JSON request per line, one JSON reply line
//! per request, naming the request it answers (docs/design.md, "The control socket").
//!
//! Everything a client sends is hostile input: lines are bounded ([`MAX_LINE`]), so
//! are the clients served at once ([`MAX_CLIENTS`]; more get a `busy` error), an idle
//! client is dropped after [`CLIENT_IDLE`], a client that does not read its replies
//! cannot block the server (write timeout). A bad request gets an error reply; the VM
//! keeps running.
//!
//! The socket thread only parses; every command is executed by the run loop between its
//! drain rounds ([`ControlServer::serve`] with a [`Handler`]), which owns the session and
//! the VM — and the subscriber claim (C2: checked when a request executes, not when it is
//! parsed). A request whose client gave up waiting is dropped, never executed late, and
//! a client that disconnects is reported to the handler ([`Handler::gone`]) after its
//! last request, in queue order.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::control::protocol::{
    parse_reply, truncate, ReplyError, Request as Wire, RequestError, MAX_FETCH_BYTES, VERSION,
};
pub use crate::control::protocol::{Answer, Command, Outcome, Reply};

/// Longest request line a client may send, its newline included (a `fetch` or `detach`
/// acknowledging 256 CPUs takes about 8 KiB).
pub const MAX_LINE: usize = 32 << 10;
/// Clients served at once; more are answered `busy` and closed.
pub const MAX_CLIENTS: usize = 8;
/// A client that completes no request for this long is disconnected.
pub const CLIENT_IDLE: Duration = Duration::from_secs(30);
/// A request line must be complete this long after its first byte, or the client is
/// disconnected: a client trickling bytes cannot hold a client slot (8 of them cannot
/// keep a ninth client out for longer than this).
pub const LINE_DEADLINE: Duration = Duration::from_secs(5);
/// Longest a client waits for the run loop to take its request; past it the request is
/// cancelled (never executed) and the client told so.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Jobs the run loop executes per call of [`ControlServer::serve`].
const SERVE_BATCH: usize = 2 * MAX_CLIENTS;
/// How often the socket threads look at the stop flag.
const TICK: Duration = Duration::from_millis(50);

/// Why the run loop refused a command (one line for the client).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

impl From<String> for Refusal {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl From<&str> for Refusal {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

/// Executes commands: the run loop implements it over its session and VM.
pub trait Handler {
    /// Executes `cmd` for the client `conn` (an id unique in the run).
    fn handle(&mut self, conn: u64, cmd: &Command) -> Result<Answer, Refusal>;
    /// The client `conn` disconnected; no request of it comes after this.
    fn gone(&mut self, conn: u64);
}

/// Switching events on and off in the guest's enable words (atomically, one bit; the
/// other bits stay) and listing them: implemented over the guest's registrations
/// (`crate::vmm::registration::EventTable`, below).
pub trait EventSwitch {
    /// Enables (`on`) or disables the events `spec` names on every vCPU (the patterns
    /// of `-e`); returns what changed, for the reply.
    fn set(&self, spec: &str, on: bool) -> Result<Answer, Refusal>;
    /// The events, their fields and whether they are enabled.
    fn list(&self) -> Result<Answer, Refusal>;
}

/// A request's life: queued, then taken by the run loop or cancelled by its client
/// (whichever comes first; a cancelled request is never executed).
const QUEUED: u8 = 0;
const TAKEN: u8 = 1;
const CANCELLED: u8 = 2;

/// A request from a client, executed by the run loop.
struct Request {
    id: u64,
    cmd: Command,
    conn: u64,
    state: Arc<AtomicU8>,
    reply: SyncSender<Reply>,
}

/// What the socket threads hand the run loop, in order.
enum Job {
    /// A request.
    Run(Request),
    /// The client went away.
    Gone(u64),
}

/// Why the socket could not be set up (exit 2: the path is the user's input).
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The path exists and is not a socket.
    #[error("--control {path}: exists and is not a socket", path = .0.display())]
    NotSocket(PathBuf),
    /// Another process accepts on the socket.
    #[error("--control {path}: a live socket (another process serves it)", path = .0.display())]
    InUse(PathBuf),
    /// An OS error on the path.
    #[error("--control {path}", path = .path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Wakes the run loop when a command is queued (set by the run: [`ControlServer::set_waker`]).
pub type WakeFn = Box<dyn Fn() + Send + Sync>;

/// The queue of jobs to the run loop, and how to wake it for one. Never longer than two
/// jobs per client (each client has at most one request in flight and one `Gone`), and
/// the clients are bounded ([`MAX_CLIENTS`]).
///
/// A mutex, not a lock-free channel: the run loop's thread may run real-time on the core
/// of a client thread, and a channel's receiver spins (yielding, which a real-time thread
/// does not give a normal one) while a sender it preempted is half-way through a send —
/// a round of the loop then lasted until the kernel's real-time throttling (about 1 s).
/// The loop only ever `try_lock`s it ([`ControlServer::serve`]): it never waits for a
/// client thread.
#[derive(Clone)]
struct Queue {
    jobs: Arc<Mutex<VecDeque<Job>>>,
    /// The server stopped: nothing is taken any more.
    closed: Arc<AtomicBool>,
    waker: Arc<Mutex<Option<WakeFn>>>,
}

impl Queue {
    /// Queues `job` (a moment's lock) and wakes the run loop; false when the run ended.
    fn send(&self, job: Job) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(job);
        if let Some(w) = self
            .waker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            w();
        }
        true
    }
}

/// The control socket of a run: its thread accepts clients and parses their lines; the
/// run loop executes the commands ([`ControlServer::serve`]). Dropping it stops the
/// thread and removes the socket.
pub struct ControlServer {
    path: PathBuf,
    /// Device and inode of the socket we bound: removed at the end only if it is still
    /// ours.
    id: (u64, u64),
    stop: Arc<AtomicBool>,
    jobs: Arc<Mutex<VecDeque<Job>>>,
    waker: Arc<Mutex<Option<WakeFn>>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ControlError + '_ {
    move |source| ControlError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Removes a socket left by a process that is gone (nobody accepts on it: connecting is
/// refused); refuses anything else that exists at `path`.
fn clear_stale(path: &Path) -> Result<(), ControlError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(path)(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(ControlError::NotSocket(path.to_path_buf()));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(ControlError::InUse(path.to_path_buf())),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            // Remove it only if it is still the socket we looked at.
            let again = std::fs::symlink_metadata(path).map_err(io_err(path))?;
            if (again.dev(), again.ino()) != (meta.dev(), meta.ino()) {
                return Err(ControlError::InUse(path.to_path_buf()));
            }
            log::info!("removing the stale socket {}", path.display());
            std::fs::remove_file(path).map_err(io_err(path))
        }
        Err(e) => Err(io_err(path)(e)),
    }
}

impl ControlServer {
    /// Checks that a socket can be bound at `path` (nothing there, or a stale socket,
    /// which is removed): `run` checks its `--control` before the VM boots and binds
    /// later.
    pub fn check(path: &Path) -> Result<(), ControlError> {
        clear_stale(path)
    }

    /// Creates the socket at `path` (owner-only: 0600; a stale socket there is
    /// replaced, anything else refused) and starts its thread.
    pub fn bind(path: &Path) -> Result<Self, ControlError> {
        clear_stale(path)?;
        // The socket file is created with the umask's permissions: owner-only from the
        // start, so no other user can connect between bind and chmod. (umask is
        // process-wide: files other threads create meanwhile are owner-only too.)
        // SAFETY: umask only swaps the process's file-mode mask; it cannot fail.
        let old = unsafe { libc::umask(0o177) };
        let bound = UnixListener::bind(path);
        // SAFETY: as above, restoring the previous mask.
        unsafe { libc::umask(old) };
        let listener = bound.map_err(io_err(path))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(io_err(path))?;
        let meta = std::fs::symlink_metadata(path).map_err(io_err(path))?;
        listener.set_nonblocking(true).map_err(io_err(path))?;
        let stop = Arc::new(AtomicBool::new(false));
        let jobs = Arc::new(Mutex::new(VecDeque::new()));
        let waker = Arc::new(Mutex::new(None));
        let tx = Queue {
            jobs: Arc::clone(&jobs),
            closed: Arc::clone(&stop),
            waker: Arc::clone(&waker),
        };
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("hyptrace-control".into())
                .spawn(move || accept_loop(&listener, &tx, &stop))
                .map_err(io_err(path))?
        };
        log::info!("control socket at {}", path.display());
        Ok(Self {
            path: path.to_path_buf(),
            id: (meta.dev(), meta.ino()),
            stop,
            jobs,
            waker,
            thread: Some(thread),
        })
    }

    /// Has every queued command wake the run loop with `w` (the loop then need not poll
    /// the queue often: an idle run sleeps its whole `--poll-ms`).
    /// `None` stops the wake-ups (the run ended).
    pub fn set_waker(&self, w: Option<WakeFn>) {
        *self.waker.lock().unwrap_or_else(|e| e.into_inner()) = w;
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Executes the jobs waiting (a bounded batch) with `h`; returns how many. A
    /// request its client cancelled (it gave up waiting) is dropped unexecuted.
    pub fn serve(&self, h: &mut dyn Handler) -> usize {
        let mut n = 0;
        while n < SERVE_BATCH {
            // Never waits for a client thread (see `Queue`): a queue it holds is
            // looked at again at the next round (its send wakes the loop).
            let Ok(mut jobs) = self.jobs.try_lock() else {
                break;
            };
            let Some(job) = jobs.pop_front() else { break };
            drop(jobs);
            n += 1;
            let req = match job {
                Job::Gone(conn) => {
                    h.gone(conn);
                    continue;
                }
                Job::Run(r) => r,
            };
            // C2: taken here, or cancelled by its client first: never both.
            if req
                .state
                .compare_exchange(QUEUED, TAKEN, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                log::debug!("control: request {} cancelled by its client", req.id);
                continue;
            }
            let outcome = match h.handle(req.conn, &req.cmd) {
                Ok(a) => Outcome::Ok(a),
                Err(Refusal(why)) => Outcome::Err(why),
            };
            // The client waits for a taken request (it cannot cancel it any more); it
            // may be gone (disconnected): nothing to do then.
            let _ = req.reply.try_send(Reply::to(Some(req.id), outcome));
        }
        n
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            if let Err(p) = t.join() {
                log::error!("the control socket thread panicked: {p:?}");
            }
        }
        // Only the socket we bound (a user may have replaced it meanwhile).
        if let Ok(m) = std::fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// Waits until `fd` is readable or `timeout` passes.
fn wait_readable(fd: i32, timeout: Duration) {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid pollfd for the duration of the call; the result is only a hint
    // (the accept that follows is non-blocking).
    unsafe { libc::poll(&mut p, 1, ms) };
}

/// An error reply to no request (the line was none).
fn refuse_line(why: impl Into<String>) -> String {
    Reply::to(None, Outcome::Err(why.into())).line()
}

/// The socket thread: accepts clients (at most [`MAX_CLIENTS`] at once, each on its own
/// scoped thread, all joined before it returns) until `stop`.
fn accept_loop(listener: &UnixListener, tx: &Queue, stop: &AtomicBool) {
    let active = AtomicUsize::new(0);
    let mut next_id: u64 = 0;
    std::thread::scope(|s| {
        while !stop.load(Ordering::Relaxed) {
            wait_readable(listener.as_raw_fd(), TICK);
            let mut stream = match listener.accept() {
                Ok((st, _)) => st,
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    continue
                }
                Err(e) => {
                    // EMFILE and the like: back off instead of spinning.
                    log::warn!("control socket: accept: {e}");
                    std::thread::sleep(TICK);
                    continue;
                }
            };
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            if active.load(Ordering::Relaxed) >= MAX_CLIENTS {
                let _ = stream.write_all(refuse_line("busy: too many clients").as_bytes());
                continue;
            }
            active.fetch_add(1, Ordering::Relaxed);
            next_id = next_id.wrapping_add(1).max(1);
            let conn = next_id;
            let active = &active;
            let tx = tx.clone();
            let spawned = std::thread::Builder::new()
                .name("hyptrace-ctl-client".into())
                .spawn_scoped(s, move || {
                    client(stream, &tx, stop, conn);
                    // C2: after the client's last request, in queue order.
                    tx.send(Job::Gone(conn));
                    active.fetch_sub(1, Ordering::Relaxed);
                });
            if let Err(e) = spawned {
                log::warn!("control socket: cannot start a client thread: {e}");
                active.fetch_sub(1, Ordering::Relaxed);
            }
        }
    });
}

/// Serves one client: reads lines (bounded), has the run loop execute each, writes the
/// reply. Returns when the client closes, misbehaves, idles, or the server stops.
fn client(mut stream: UnixStream, tx: &Queue, stop: &AtomicBool, conn: u64) {
    if stream.set_read_timeout(Some(TICK)).is_err() {
        return;
    }
    let mut buf: Vec<u8> = Vec::with_capacity(MAX_LINE);
    let mut chunk = [0u8; 1024];
    // The last complete request (idle), and the first byte of the line under way.
    let mut last = Instant::now();
    let mut line_started: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        // Complete lines first (several may have come in one read).
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            if nl + 1 > MAX_LINE {
                break;
            }
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let peer = Peer(stream.as_raw_fd());
            let (reply, data) = execute_line(&line[..nl], tx, stop, (conn, peer));
            if write_answer(&mut stream, reply.as_bytes(), &data).is_err() {
                return;
            }
            last = Instant::now();
            line_started = (!buf.is_empty()).then_some(last);
        }
        // A line with its newline is at most MAX_LINE bytes.
        let complete = buf.iter().take(MAX_LINE).position(|&b| b == b'\n');
        if complete.is_none() && buf.len() >= MAX_LINE {
            let why = format!("line too long (at most {MAX_LINE} bytes, its newline included)");
            let _ = stream.write_all(refuse_line(why).as_bytes());
            return;
        }
        if line_started.is_some_and(|t| t.elapsed() >= LINE_DEADLINE) {
            let why = format!(
                "timeout: the request line was not complete {} s after its first byte",
                LINE_DEADLINE.as_secs()
            );
            let _ = stream.write_all(refuse_line(why).as_bytes());
            return;
        }
        if buf.is_empty() && last.elapsed() >= CLIENT_IDLE {
            let _ = stream.write_all(refuse_line("idle: disconnected").as_bytes());
            return;
        }
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => {
                if buf.is_empty() {
                    line_started = Some(Instant::now());
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
    let _ = stream.write_all(refuse_line("the run ended").as_bytes());
}

/// Parses a line and has the run loop execute it (bounded wait); returns the reply line
/// and the bytes that follow it (a `fetch` answer's pieces; none for the others).
fn execute_line(
    line: &[u8],
    tx: &Queue,
    stop: &AtomicBool,
    (conn, peer): (u64, Peer),
) -> (String, Vec<bytes::Bytes>) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Ok(text) = std::str::from_utf8(line) else {
        return (refuse_line("not UTF-8"), Vec::new());
    };
    let req = match Wire::parse(text) {
        Ok(r) => r,
        Err(e @ RequestError::Malformed(_)) => {
            let why = format!("{}: {:?}", crate::exit::chain(&e), truncate(text, 40));
            return (refuse_line(why), Vec::new());
        }
        Err(e) => {
            return (
                Reply::to(e.id(), Outcome::Err(e.to_string())).line(),
                Vec::new(),
            )
        }
    };
    let mut reply = forward(req, tx, stop, (conn, peer));
    let data = match &mut reply.outcome {
        Outcome::Ok(Answer::Pieces(b)) => std::mem::take(&mut b.data),
        _ => Vec::new(),
    };
    (reply.line(), data)
}

/// Writes a reply `line` and the `pieces` after it (a `fetch` answer's bytes) in as
/// few vectored writes as the kernel takes: the pieces are the outbox's own, uncopied.
fn write_answer(
    stream: &mut UnixStream,
    line: &[u8],
    pieces: &[bytes::Bytes],
) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> = std::iter::once(line)
        .chain(pieces.iter().map(|p| &p[..]))
        .filter(|s| !s.is_empty())
        .map(std::io::IoSlice::new)
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        match stream.write_vectored(rest) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => std::io::IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A client's socket, to notice that the client went away while its request waits.
#[derive(Clone, Copy, Debug)]
struct Peer(i32);

impl Peer {
    /// Whether the client hung up (or its socket failed): its requests are not wanted.
    fn gone(self) -> bool {
        let mut p = libc::pollfd {
            fd: self.0,
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call, zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }
}

/// Has the run loop execute `req` (bounded wait: a request not taken yet is cancelled
/// past [`REPLY_TIMEOUT`], or as soon as its client hung up — C2: a gone client's
/// `fetch` never sends pieces nobody will take).
fn forward(req: Wire, tx: &Queue, stop: &AtomicBool, (conn, peer): (u64, Peer)) -> Reply {
    let (rtx, rrx) = mpsc::sync_channel(1);
    let state = Arc::new(AtomicU8::new(QUEUED));
    let id = req.id;
    let job = Job::Run(Request {
        id,
        cmd: req.cmd,
        conn,
        state: Arc::clone(&state),
        reply: rtx,
    });
    let err = |why: &str| Reply::to(Some(id), Outcome::Err(why.into()));
    if !tx.send(job) {
        return err("the run ended");
    }
    let start = Instant::now();
    loop {
        match rrx.recv_timeout(TICK) {
            Ok(r) => return r,
            Err(RecvTimeoutError::Disconnected) => return err("the run ended"),
            Err(RecvTimeoutError::Timeout) => {
                let late =
                    stop.load(Ordering::Relaxed) || start.elapsed() >= REPLY_TIMEOUT || peer.gone();
                if late
                    && state
                        .compare_exchange(QUEUED, CANCELLED, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    return err(if stop.load(Ordering::Relaxed) {
                        "the run ended"
                    } else {
                        "timeout: the run loop did not take the request (cancelled: it will not run)"
                    });
                }
                // Taken: the run loop is executing it; its reply comes.
            }
        }
    }
}

/// How `hyptrace ctl` ended.
#[derive(Debug)]
pub enum CtlOutcome {
    /// Done: the answer.
    Ok(Answer),
    /// Refused: the reason.
    Err(String),
}

/// Why `hyptrace ctl` could not get a reply.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The command is not one.
    #[error(transparent)]
    Usage(#[from] crate::control::protocol::UsageError),
    /// Connecting failed.
    #[error("cannot connect to {path}", path = .path.display())]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Sending or receiving failed.
    #[error("{path}: {what}", path = .path.display())]
    Io {
        /// The socket.
        path: PathBuf,
        /// What was done.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The reply is not the answer to our request.
    #[error("{path}", path = .path.display())]
    Reply {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: crate::control::protocol::ReplyError,
    },
    /// The connection closed, or the reply is too long.
    #[error("{path}: {why}", path = .path.display())]
    Closed {
        /// The socket.
        path: PathBuf,
        /// What happened.
        why: &'static str,
    },
}

/// A connection to a control socket: one request, one reply, checked to answer it.
#[derive(Debug)]
pub struct CtlConn {
    path: PathBuf,
    out: UnixStream,
    inp: std::io::BufReader<UnixStream>,
    next_id: u64,
}

/// The longest reply line a client reads (stats/list of 256 CPUs and 64 events fit).
const MAX_REPLY: u64 = 4 << 20;

impl CtlConn {
    /// Connects to `path`; every reply is awaited at most `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, CtlError> {
        let s = UnixStream::connect(path).map_err(|source| CtlError::Connect {
            path: path.to_path_buf(),
            source,
        })?;
        let io = |what| {
            move |source| CtlError::Io {
                path: path.to_path_buf(),
                what,
                source,
            }
        };
        s.set_read_timeout(Some(timeout))
            .and_then(|()| s.set_write_timeout(Some(timeout)))
            .map_err(io("setting timeouts"))?;
        let r = s.try_clone().map_err(io("cloning the socket"))?;
        Ok(Self {
            path: path.to_path_buf(),
            out: s,
            inp: std::io::BufReader::with_capacity(4096, r),
            next_id: 1,
        })
    }

    /// Sends `cmd`, returns the outcome of the reply that answers it.
    pub fn request(&mut self, cmd: Command) -> Result<Outcome, CtlError> {
        let id = self.send(cmd)?;
        self.receive(id)
    }

    /// Sends `cmd` without waiting for its reply (a subscriber keeps one `fetch` in
    /// flight while it writes the last batch); returns the request's id, for
    /// [`CtlConn::receive`]. The server answers a connection's requests in order.
    pub fn send(&mut self, cmd: Command) -> Result<u64, CtlError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut line = serde_json::to_string(&Wire {
            v: VERSION,
            id,
            cmd,
        })
        .map_err(|e| CtlError::Io {
            path: self.path.clone(),
            what: "encoding the request",
            source: e.into(),
        })?;
        line.push('\n');
        let Err(source) = self.out.write_all(line.as_bytes()) else {
            return Ok(id);
        };
        // A server that refused the connection (`busy`) wrote why before it closed:
        // that is the answer, not the broken pipe.
        let mut reply = String::new();
        let said = std::io::BufRead::read_line(&mut (&mut self.inp).take(MAX_REPLY), &mut reply);
        if let (Ok(n), Err(ReplyError::Refused(why))) = (said, parse_reply(reply.trim_end(), id)) {
            if n > 0 {
                return Err(CtlError::Reply {
                    path: self.path.clone(),
                    source: ReplyError::Refused(why),
                });
            }
        }
        Err(CtlError::Io {
            path: self.path.clone(),
            what: "sending",
            source,
        })
    }

    /// The outcome of the reply to request `id` (sent last, or after the requests whose
    /// replies were received): a reply to anything else is an error.
    pub fn receive(&mut self, id: u64) -> Result<Outcome, CtlError> {
        let mut reply = String::new();
        let n = std::io::BufRead::read_line(&mut (&mut self.inp).take(MAX_REPLY), &mut reply)
            .map_err(|source| CtlError::Io {
                path: self.path.clone(),
                what: "reading the reply",
                source,
            })?;
        if n == 0 || !reply.ends_with('\n') {
            return Err(CtlError::Closed {
                path: self.path.clone(),
                why: if n == 0 {
                    "the connection closed without a reply"
                } else {
                    "the reply is too long or cut off"
                },
            });
        }
        let mut outcome = parse_reply(reply.trim_end(), id).map_err(|source| CtlError::Reply {
            path: self.path.clone(),
            source,
        })?;
        if let Outcome::Ok(Answer::Pieces(b)) = &mut outcome {
            b.data = vec![self.read_payload(b.bytes)?.into()];
        }
        Ok(outcome)
    }

    /// The `n` bytes after a `fetch` answer's line (at most [`MAX_FETCH_BYTES`]: a VMM
    /// that says more is not believed).
    fn read_payload(&mut self, n: u64) -> Result<Vec<u8>, CtlError> {
        if n > MAX_FETCH_BYTES {
            return Err(CtlError::Closed {
                path: self.path.clone(),
                why: "a fetch answer announces more bytes than a fetch may carry",
            });
        }
        let mut data = Vec::with_capacity(n as usize);
        let io = |source| CtlError::Io {
            path: self.path.clone(),
            what: "reading a fetch answer's bytes",
            source,
        };
        (&mut self.inp).take(n).read_to_end(&mut data).map_err(io)?;
        if data.len() as u64 != n {
            return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        Ok(data)
    }
}

/// The client: sends `words` as one command to the socket at `path` and returns the
/// answer.
pub fn ctl(path: &Path, words: &[String]) -> Result<CtlOutcome, CtlError> {
    let cmd = Command::from_words(words)?;
    // What is there, before connecting: a file is "not a socket", not "refused".
    if let Ok(m) = std::fs::metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !m.file_type().is_socket() {
            let what = if m.is_dir() {
                "a directory"
            } else if m.is_file() {
                "a regular file"
            } else {
                "not a socket"
            };
            return Err(CtlError::Connect {
                path: path.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("not a socket ({what}; give the --control PATH of a run)"),
                ),
            });
        }
    }
    // Bounded: the server answers (or cancels) within REPLY_TIMEOUT.
    let mut c = CtlConn::connect(path, REPLY_TIMEOUT + Duration::from_secs(5))?;
    Ok(match c.request(cmd)? {
        Outcome::Ok(a) => CtlOutcome::Ok(a),
        Outcome::Err(e) => CtlOutcome::Err(e),
    })
}

impl<M: hyptrace_abi::SharedMem> EventSwitch for crate::vmm::registration::EventTable<M> {
    fn set(&self, spec: &str, on: bool) -> Result<Answer, Refusal> {
        let names = if on {
            self.enable(spec)
        } else {
            self.disable(spec)
        }
        .map_err(|e| Refusal(crate::exit::chain(&e)))?;
        Ok(Answer::Switched {
            events: names,
            enabled: on,
        })
    }

    fn list(&self) -> Result<Answer, Refusal> {
        use crate::control::protocol::{EventEntry, FieldEntry};
        let events = crate::vmm::registration::EventTable::list(self)
            .map_err(|e| Refusal(crate::exit::chain(&e)))?
            .into_iter()
            .map(|e| EventEntry {
                name: e.reg.full_name(),
                id: e.reg.id.into(),
                slot: e.reg.slot,
                enabled: e.enabled,
                fields: e
                    .reg
                    .fields
                    .iter()
                    .map(|f| FieldEntry {
                        name: f.name.clone(),
                        ctype: f.ctype.clone(),
                        offset: f.offset,
                        size: f.size,
                        signed: f.signed,
                    })
                    .collect(),
            })
            .collect();
        Ok(Answer::Events { events })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::protocol::{LiveStats, PieceBatch};

    /// Answers `stats` with an empty table, `subscribe` for the first client, `fetch`
    /// for the subscriber with 3 bytes after the line; records `gone`.
    #[derive(Default)]
    struct Fake {
        holder: Option<u64>,
        gone: Vec<u64>,
        executed: Vec<Command>,
    }
    impl Handler for Fake {
        fn handle(&mut self, conn: u64, cmd: &Command) -> Result<Answer, Refusal> {
            self.executed.push(cmd.clone());
            match cmd {
                Command::Stats => Ok(Answer::Stats(LiveStats {
                    elapsed_s: 0.0,
                    stopping: None,
                    subscribed: false,
                    cpus: Vec::new(),
                })),
                Command::Subscribe { .. } if self.holder.is_none() => {
                    self.holder = Some(conn);
                    Ok(Answer::Detached)
                }
                Command::Subscribe { .. } => Err("busy: another subscriber".into()),
                Command::Fetch { .. } if self.holder == Some(conn) => {
                    Ok(Answer::Pieces(PieceBatch {
                        items: Vec::new(),
                        knots: Vec::new(),
                        knots_from: 0,
                        bytes: 3,
                        data: vec![bytes::Bytes::from_static(&[7, 8, 9])],
                    }))
                }
                _ => Err("no".into()),
            }
        }
        fn gone(&mut self, conn: u64) {
            self.gone.push(conn);
            if self.holder == Some(conn) {
                self.holder = None;
            }
        }
    }

    fn temp_sock(tag: &str) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("hyptrace-ctl-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let sock = dir.join("s");
        (dir, sock)
    }

    /// The run loop answers through `serve`; the socket is 0600 and removed on drop; a
    /// client past MAX_CLIENTS is told `busy` while the others stay served.
    #[test]
    fn server_serves_and_bounds_clients() {
        let (dir, sock) = temp_sock("serve");
        let server = ControlServer::bind(&sock).expect("bind");
        let mode = std::fs::metadata(&sock).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let idle: Vec<UnixStream> = (0..MAX_CLIENTS)
            .map(|_| UnixStream::connect(&sock).expect("connect"))
            .collect();
        let mut extra = UnixStream::connect(&sock).expect("connect");
        extra
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut busy = String::new();
        let _ = extra.read_to_string(&mut busy);
        let r: Reply = serde_json::from_str(busy.trim_end()).expect("a reply");
        assert!(
            matches!(&r.outcome, Outcome::Err(e) if e.starts_with("busy")),
            "{busy:?}"
        );
        drop(idle);
        let mut h = Fake::default();
        std::thread::scope(|s| {
            let client = s.spawn(|| {
                // The idle clients' threads leave within a tick: retry while busy.
                let start = Instant::now();
                loop {
                    match ctl(&sock, &["stats".to_string()]) {
                        Err(CtlError::Reply { .. }) | Ok(CtlOutcome::Err(_)) => {
                            assert!(start.elapsed() < Duration::from_secs(30), "busy");
                            std::thread::sleep(TICK);
                        }
                        r => return r.expect("ctl"),
                    }
                }
            });
            let start = Instant::now();
            while !client.is_finished() {
                assert!(start.elapsed() < Duration::from_secs(60), "no reply");
                server.serve(&mut h);
                std::thread::sleep(Duration::from_millis(5));
            }
            match client.join().expect("client") {
                CtlOutcome::Ok(Answer::Stats(s)) => assert!(s.cpus.is_empty()),
                r => panic!("{r:?}"),
            }
        });
        drop(server);
        assert!(!sock.exists(), "removed on drop");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Sends `cmd` on `c` while the "run loop" (this thread) serves with `h` (bounded).
    fn ask(server: &ControlServer, h: &mut dyn Handler, c: &mut CtlConn, cmd: Command) -> Outcome {
        std::thread::scope(|s| {
            let t = s.spawn(|| c.request(cmd).expect("reply"));
            let start = Instant::now();
            while !t.is_finished() {
                server.serve(h);
                std::thread::sleep(Duration::from_millis(2));
                assert!(start.elapsed() < Duration::from_secs(30), "no reply");
            }
            t.join().expect("client")
        })
    }

    /// C2: the claim is the handler's; a client's disconnect reaches it after its last
    /// request, so a second client's `subscribe` queued after it succeeds. A `fetch`
    /// answer's bytes follow its line and reach the client whole.
    #[test]
    fn gone_comes_after_the_clients_requests() {
        let (dir, sock) = temp_sock("gone");
        let server = ControlServer::bind(&sock).expect("bind");
        let h = &mut Fake::default();
        let t = Duration::from_secs(30);
        let mut a = CtlConn::connect(&sock, t).expect("a");
        let mut b = CtlConn::connect(&sock, t).expect("b");
        let fetch = Command::Fetch {
            token: 0,
            acks: Vec::new(),
            max_bytes: 1,
            knots: 0,
        };
        let sub = Command::Subscribe { partial: false };
        assert!(matches!(
            ask(&server, h, &mut b, fetch.clone()),
            Outcome::Err(_)
        ));
        assert_eq!(
            ask(&server, h, &mut a, sub.clone()),
            Outcome::Ok(Answer::Detached)
        );
        assert!(matches!(
            ask(&server, h, &mut b, sub.clone()),
            Outcome::Err(_)
        ));
        for _ in 0..2 {
            match ask(&server, h, &mut a, fetch.clone()) {
                Outcome::Ok(Answer::Pieces(p)) => assert_eq!(*p.payload(), [7, 8, 9]),
                o => panic!("{o:?}"),
            }
        }
        drop(a);
        let start = Instant::now();
        while h.gone.is_empty() {
            server.serve(h);
            std::thread::sleep(TICK);
            assert!(start.elapsed() < Duration::from_secs(30), "gone never came");
        }
        assert_eq!(ask(&server, h, &mut b, sub), Outcome::Ok(Answer::Detached));
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Sends `bytes` on a new connection and returns the reply line (the server thread
    /// answers malformed and oversized lines itself; `stats` needs `serve`).
    fn raw_reply(server: &ControlServer, sock: &Path, bytes: &[u8]) -> String {
        let mut c = UnixStream::connect(sock).expect("connect");
        c.set_read_timeout(Some(Duration::from_millis(20)))
            .expect("timeout");
        c.write_all(bytes).expect("send");
        let mut h = Fake::default();
        let mut got = Vec::new();
        let start = Instant::now();
        while !got.contains(&b'\n') {
            assert!(start.elapsed() < Duration::from_secs(30), "no reply");
            server.serve(&mut h);
            let mut b = [0u8; 4096];
            match c.read(&mut b) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&b[..n]),
                Err(_) => {}
            }
        }
        String::from_utf8_lossy(&got).into_owned()
    }

    /// A request line is at most MAX_LINE bytes with its newline: one byte more is
    /// refused (and the connection closed), exactly at the bound it is served.
    #[test]
    fn the_line_bound_is_exact() {
        let (dir, sock) = temp_sock("line");
        let server = ControlServer::bind(&sock).expect("bind");
        let line = |len: usize| {
            let head = format!(r#"{{"v":{VERSION},"id":1,"cmd":"stats""#);
            let mut l = head.into_bytes();
            l.extend(std::iter::repeat_n(b' ', len - l.len() - 2));
            l.extend_from_slice(b"}\n");
            assert_eq!(l.len(), len);
            l
        };
        let ok = raw_reply(&server, &sock, &line(MAX_LINE));
        assert!(ok.contains(r#""kind":"stats""#), "{ok}");
        for len in [MAX_LINE + 1, MAX_LINE + 1000] {
            let r = raw_reply(&server, &sock, &line(len));
            assert!(r.contains("line too long"), "{len}: {r}");
        }
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Eight clients trickling a byte at a time hold no slot past LINE_DEADLINE: a
    /// ninth client is served once their lines run out of time (bounded wait), and each
    /// of them was told why it was disconnected.
    #[test]
    fn trickling_clients_do_not_keep_others_out() {
        let (dir, sock) = temp_sock("trickle");
        let server = ControlServer::bind(&sock).expect("bind");
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let tricklers: Vec<_> = (0..MAX_CLIENTS)
                .map(|_| {
                    let mut c = UnixStream::connect(&sock).expect("connect");
                    let stop = &stop;
                    s.spawn(move || {
                        c.set_read_timeout(Some(TICK)).expect("timeout");
                        let mut got = String::new();
                        // Bounded: the server disconnects it, or the test stops it.
                        for _ in 0..2000 {
                            if stop.load(Ordering::Relaxed) || c.write_all(b" ").is_err() {
                                break;
                            }
                            let mut b = [0u8; 512];
                            match c.read(&mut b) {
                                Ok(0) => break,
                                Ok(n) => got.push_str(&String::from_utf8_lossy(&b[..n])),
                                Err(_) => {}
                            }
                        }
                        got
                    })
                })
                .collect();
            let start = Instant::now();
            let mut h = Fake::default();
            let served = loop {
                server.serve(&mut h);
                let mut c = CtlConn::connect(&sock, Duration::from_secs(30)).expect("connect");
                match c.request(Command::Stats) {
                    Ok(_) => break true,
                    Err(CtlError::Reply {
                        source: crate::control::protocol::ReplyError::Refused(why),
                        ..
                    }) => assert!(why.starts_with("busy"), "{why}"),
                    Err(e) => panic!("{e}"),
                }
                if start.elapsed() > 6 * LINE_DEADLINE {
                    break false;
                }
                std::thread::sleep(TICK);
            };
            stop.store(true, Ordering::Relaxed);
            assert!(served, "the trickling clients kept the ninth out");
            for t in tricklers {
                let got = t.join().expect("trickler");
                assert!(got.contains("timeout: the request line"), "{got:?}");
            }
        });
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// C2: a request its client gave up on is never executed late.
    #[test]
    fn a_cancelled_request_is_not_executed() {
        let (rtx, _rrx) = mpsc::sync_channel(1);
        let jobs = Arc::new(Mutex::new(VecDeque::new()));
        let state = Arc::new(AtomicU8::new(CANCELLED));
        jobs.lock().expect("queue").push_back(Job::Run(Request {
            id: 1,
            cmd: Command::Stats,
            conn: 1,
            state,
            reply: rtx,
        }));
        let server = ControlServer {
            path: PathBuf::from("/nonexistent/hyptrace-test"),
            id: (0, 0),
            stop: Arc::new(AtomicBool::new(true)),
            jobs,
            waker: Arc::new(Mutex::new(None)),
            thread: None,
        };
        let mut h = Fake::default();
        assert_eq!(server.serve(&mut h), 1);
        assert!(h.executed.is_empty(), "{:?}", h.executed);
    }

    /// A stale socket is replaced, a regular file or a live socket refused.
    #[test]
    fn bind_checks_the_path() {
        let (dir, sock) = temp_sock("bind");
        drop(UnixListener::bind(&sock).expect("bind"));
        let server = ControlServer::bind(&sock).expect("stale replaced");
        let e = ControlServer::bind(&sock).expect_err("live");
        assert!(matches!(e, ControlError::InUse(_)), "{e}");
        drop(server);
        std::fs::write(&sock, b"x").expect("write");
        let e = ControlServer::bind(&sock).expect_err("file");
        assert!(matches!(e, ControlError::NotSocket(_)), "{e}");
        assert_eq!(std::fs::read(&sock).expect("kept"), b"x");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
