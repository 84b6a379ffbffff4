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

use crate::control::protocol::{truncate, Request as Wire, RequestError};

pub use crate::control::protocol::{Answer, Command, Outcome, Reply};

mod client;

pub use client::{ctl, CtlConn, CtlError, CtlOutcome};

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
        let events = hyptrace_embed::Events::list(self)
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
mod tests;
