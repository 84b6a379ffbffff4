//! The runtime control socket (`run/record --control PATH`) and its client (`hyptrace
//! ctl PATH CMD...`).
//!
//! A Unix stream socket, owner-only (0600), served by one host thread while the VM runs.
//! Line protocol (docs/design.md, "The control socket"): one command per line, one reply
//! line per command, `ok[ PAYLOAD]` or `err REASON`:
//!
//! | command | reply |
//! |---|---|
//! | `enable EVENT` | `ok SYSTEM:EVENT enabled` (EVENT as `-e` takes it) |
//! | `disable EVENT` | `ok SYSTEM:EVENT disabled` |
//! | `stats` | `ok {JSON}`: the live per-CPU counters |
//! | `list` | `ok {JSON}`: the events and whether they are enabled |
//! | `attach` | `ok {JSON}`: claims the consumer role (live attach; one client at a time, others get `err busy ...`); the trace memory file's path and geometry |
//! | `get_reader CPU` | `ok swapped PAGE LOST`, `ok busy` or `ok pending`: swaps the CPU's reader page (the attached client only) |
//!
//! Everything a client sends is hostile input: lines are bounded ([`MAX_LINE`]), so
//! are the clients served at once ([`MAX_CLIENTS`]; more get `err busy`), an idle client
//! is dropped after [`CLIENT_IDLE`], a client that does not read its replies cannot
//! block the server (write timeout). A bad command gets an `err` reply; the VM keeps
//! running.
//!
//! The socket thread only parses; every command is executed by the run loop between its
//! drain rounds ([`ControlServer::serve`] with a [`Handler`]), which owns the session and
//! the VM. New commands (the flight recorder's) are a [`Command`] variant, a parse arm in
//! [`Command::parse`] and an arm in the run loop's [`Handler`].

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest command line a client may send, newline excluded.
pub const MAX_LINE: usize = 512;
/// Clients served at once; more are answered `err busy` and closed.
pub const MAX_CLIENTS: usize = 8;
/// A client that sends nothing for this long is disconnected.
pub const CLIENT_IDLE: Duration = Duration::from_secs(30);
/// Longest a client waits for the run loop to execute its command.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Commands the run loop executes per call of [`ControlServer::serve`].
const SERVE_BATCH: usize = MAX_CLIENTS;
/// How often the socket threads look at the stop flag.
const TICK: Duration = Duration::from_millis(50);

/// A command of the control protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `enable EVENT`: set the event's enable bit on every vCPU.
    Enable(String),
    /// `disable EVENT`: clear it.
    Disable(String),
    /// `stats`: the live per-CPU counters.
    Stats,
    /// `list`: the events and their state.
    List,
    /// `attach`: claim the consumer role (live attach: `hyptrace dump --attach`). The
    /// socket thread keeps the claim (one client at a time) and releases it when that
    /// client disconnects; the run loop checks that the VMM can have a consumer.
    Attach,
    /// `get_reader CPU`: swap the CPU's reader page for the attached consumer.
    GetReader(u32),
}

impl Command {
    /// Parses one line (without its newline). Words are separated by spaces or tabs.
    pub fn parse(line: &str) -> Result<Self, String> {
        let mut words = line.split([' ', '\t']).filter(|w| !w.is_empty());
        let Some(verb) = words.next() else {
            return Err("empty command".into());
        };
        let args: Vec<&str> = words.take(3).collect();
        let one = |name: &str| -> Result<String, String> {
            match args.as_slice() {
                [e] => Ok((*e).to_string()),
                [] => Err(format!("{name}: missing EVENT")),
                _ => Err(format!("{name}: takes one EVENT")),
            }
        };
        let none = |cmd: Command| -> Result<Command, String> {
            if args.is_empty() {
                Ok(cmd)
            } else {
                Err(format!("{verb}: takes no argument"))
            }
        };
        match verb {
            "enable" => one("enable").map(Self::Enable),
            "disable" => one("disable").map(Self::Disable),
            "stats" => none(Self::Stats),
            "list" => none(Self::List),
            "attach" => none(Self::Attach),
            "get_reader" => match args.as_slice() {
                [c] => c
                    .parse::<u32>()
                    .map(Self::GetReader)
                    .map_err(|_| format!("get_reader: bad CPU {:?}", truncate(c, 16))),
                [] => Err("get_reader: missing CPU".into()),
                _ => Err("get_reader: takes one CPU".into()),
            },
            _ => Err(format!(
                "unknown command {:?} (enable EVENT, disable EVENT, stats, list, attach, get_reader CPU)",
                truncate(verb, 32)
            )),
        }
    }
}

/// At most `n` characters of `s`, for messages that quote hostile input.
fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// A reply: one line on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `ok` or `ok PAYLOAD`.
    Ok(String),
    /// `err REASON`.
    Err(String),
}

impl Reply {
    /// The reply line (newline included); newlines in the text become spaces.
    pub fn line(&self) -> String {
        let (tag, text) = match self {
            Self::Ok(t) => ("ok", t),
            Self::Err(t) => ("err", t),
        };
        let text: String = text
            .chars()
            .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
            .collect();
        if text.is_empty() {
            format!("{tag}\n")
        } else {
            format!("{tag} {text}\n")
        }
    }
}

/// Executes commands: the run loop implements it over its session and VM.
pub trait Handler {
    /// Executes `cmd`.
    fn handle(&mut self, cmd: &Command) -> Reply;
}

/// Switching events on and off in the guest's enable words (atomically, one bit; the
/// other bits stay) and listing them: implemented over the guest's registrations
/// (`crate::events::EventTable`, below).
pub trait EventSwitch {
    /// Enables (`on`) or disables the events `spec` names on every vCPU (the patterns
    /// of `-e`); returns what changed, for the reply.
    fn set(&self, spec: &str, on: bool) -> Result<String, String>;
    /// The events, their fields and whether they are enabled, as a JSON value.
    fn list(&self) -> Result<serde_json::Value, String>;
}

/// A request from a client, executed by the run loop.
struct Request {
    cmd: Command,
    reply: SyncSender<Reply>,
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
    #[error("--control {path}: {source}", path = .path.display())]
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

/// The queue of commands to the run loop, and how to wake it for one.
#[derive(Clone)]
struct Queue {
    tx: SyncSender<Request>,
    waker: Arc<Mutex<Option<WakeFn>>>,
}

impl Queue {
    /// Queues `req` (never blocks) and wakes the run loop.
    fn send(&self, req: Request) -> Result<(), TrySendError<Request>> {
        self.tx.try_send(req)?;
        if let Some(w) = self
            .waker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            w();
        }
        Ok(())
    }
}

/// The control socket of a run: its thread accepts clients and parses their lines; the
/// run loop executes the commands ([`ControlServer::serve`]). Dropping it stops the
/// thread and removes the socket.
pub struct ControlServer {
    path: PathBuf,
    /// The client holding the consumer role (`attach`), 0 for none.
    consumer: Arc<AtomicU64>,
    /// Device and inode of the socket we bound: removed at the end only if it is still
    /// ours.
    id: (u64, u64),
    stop: Arc<AtomicBool>,
    rx: Receiver<Request>,
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
        let consumer = Arc::new(AtomicU64::new(0));
        let (tx, rx) = mpsc::sync_channel(MAX_CLIENTS);
        let waker = Arc::new(Mutex::new(None));
        let tx = Queue {
            tx,
            waker: Arc::clone(&waker),
        };
        let thread = {
            let stop = Arc::clone(&stop);
            let consumer = Arc::clone(&consumer);
            std::thread::Builder::new()
                .name("hyptrace-control".into())
                .spawn(move || accept_loop(&listener, &tx, &stop, &consumer))
                .map_err(io_err(path))?
        };
        log::info!("control socket at {}", path.display());
        Ok(Self {
            path: path.to_path_buf(),
            consumer,
            id: (meta.dev(), meta.ino()),
            stop,
            rx,
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

    /// Whether a client holds the consumer role now.
    pub fn attached(&self) -> bool {
        self.consumer.load(Ordering::Acquire) != 0
    }

    /// Executes the commands waiting (a bounded batch) with `h`; returns how many.
    pub fn serve(&self, h: &mut dyn Handler) -> usize {
        let mut n = 0;
        while n < SERVE_BATCH {
            let Ok(req) = self.rx.try_recv() else { break };
            let reply = h.handle(&req.cmd);
            // The client may have given up (timeout, gone): nothing to do then.
            let _ = req.reply.try_send(reply);
            n += 1;
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

/// The socket thread: accepts clients (at most [`MAX_CLIENTS`] at once, each on its own
/// scoped thread, all joined before it returns) until `stop`.
fn accept_loop(listener: &UnixListener, tx: &Queue, stop: &AtomicBool, consumer: &AtomicU64) {
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
                let _ = stream.write_all(
                    Reply::Err("busy: too many clients".into())
                        .line()
                        .as_bytes(),
                );
                continue;
            }
            active.fetch_add(1, Ordering::Relaxed);
            next_id = next_id.wrapping_add(1).max(1);
            let me = Client {
                id: next_id,
                consumer,
            };
            let active = &active;
            let tx = tx.clone();
            let spawned = std::thread::Builder::new()
                .name("hyptrace-ctl-client".into())
                .spawn_scoped(s, move || {
                    client(stream, &tx, stop, &me);
                    me.release();
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
fn client(mut stream: UnixStream, tx: &Queue, stop: &AtomicBool, me: &Client<'_>) {
    if stream.set_read_timeout(Some(TICK)).is_err() {
        return;
    }
    let mut buf: Vec<u8> = Vec::with_capacity(MAX_LINE + 1);
    let mut chunk = [0u8; 256];
    let mut last = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        // Complete lines first (several may have come in one read).
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let reply = execute_line(&line[..nl], tx, stop, me);
            if stream.write_all(reply.line().as_bytes()).is_err() {
                return;
            }
            last = Instant::now();
        }
        if buf.len() > MAX_LINE {
            let _ = stream.write_all(
                Reply::Err(format!("line too long (at most {MAX_LINE} bytes)"))
                    .line()
                    .as_bytes(),
            );
            return;
        }
        if last.elapsed() >= CLIENT_IDLE {
            let _ = stream.write_all(Reply::Err("idle: disconnected".into()).line().as_bytes());
            return;
        }
        match stream.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                last = Instant::now();
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
    let _ = stream.write_all(Reply::Err("the run ended".into()).line().as_bytes());
}

/// One connected client: its id and the consumer claim it may hold.
struct Client<'a> {
    id: u64,
    consumer: &'a AtomicU64,
}

impl Client<'_> {
    /// Releases the consumer role if this client holds it.
    fn release(&self) {
        let _ = self
            .consumer
            .compare_exchange(self.id, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// Parses a line and has the run loop execute it (bounded wait). `attach` claims the
/// consumer role for `me` first (released again if the run loop refuses it);
/// `get_reader` is only for the client holding it.
fn execute_line(line: &[u8], tx: &Queue, stop: &AtomicBool, me: &Client<'_>) -> Reply {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let Ok(text) = std::str::from_utf8(line) else {
        return Reply::Err("not UTF-8".into());
    };
    let cmd = match Command::parse(text) {
        Ok(c) => c,
        Err(e) => return Reply::Err(e),
    };
    match cmd {
        Command::Attach => {
            let claimed =
                me.consumer
                    .compare_exchange(0, me.id, Ordering::AcqRel, Ordering::Acquire);
            match claimed {
                Ok(_) => {
                    let r = forward(cmd, tx, stop);
                    if matches!(r, Reply::Err(_)) {
                        me.release();
                    }
                    r
                }
                Err(holder) if holder == me.id => forward(cmd, tx, stop),
                Err(_) => {
                    Reply::Err("busy: another consumer is attached (one consumer at a time)".into())
                }
            }
        }
        Command::GetReader(_) if me.consumer.load(Ordering::Acquire) != me.id => Reply::Err(
            "get_reader: not attached (send attach first; one consumer at a time)".into(),
        ),
        cmd => forward(cmd, tx, stop),
    }
}

/// Has the run loop execute `cmd` (bounded wait).
fn forward(cmd: Command, tx: &Queue, stop: &AtomicBool) -> Reply {
    let (rtx, rrx) = mpsc::sync_channel(1);
    match tx.send(Request { cmd, reply: rtx }) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => return Reply::Err("busy: try again".into()),
        Err(TrySendError::Disconnected(_)) => return Reply::Err("the run ended".into()),
    }
    let start = Instant::now();
    loop {
        match rrx.recv_timeout(TICK) {
            Ok(r) => return r,
            Err(RecvTimeoutError::Disconnected) => return Reply::Err("the run ended".into()),
            Err(RecvTimeoutError::Timeout) => {
                if stop.load(Ordering::Relaxed) {
                    return Reply::Err("the run ended".into());
                }
                if start.elapsed() >= REPLY_TIMEOUT {
                    return Reply::Err("timeout: the run loop did not answer".into());
                }
            }
        }
    }
}

/// How `hyptrace ctl` ended.
#[derive(Debug)]
pub enum CtlOutcome {
    /// `ok`: the payload (may be empty).
    Ok(String),
    /// `err`: the reason.
    Err(String),
}

/// Why `hyptrace ctl` could not get a reply.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// The command cannot be sent (too long, a newline in it).
    #[error("{0}")]
    Usage(String),
    /// Connecting failed.
    #[error("cannot connect to {path}: {source}", path = .path.display())]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Sending or receiving failed, or the reply is not a protocol line.
    #[error("{path}: {why}", path = .path.display())]
    Protocol {
        /// The socket.
        path: PathBuf,
        /// What went wrong.
        why: String,
    },
}

/// The client: sends `words` as one command line to the socket at `path` and returns the
/// reply.
pub fn ctl(path: &Path, words: &[String]) -> Result<CtlOutcome, CtlError> {
    let line = words.join(" ");
    if line.contains(['\n', '\r']) {
        return Err(CtlError::Usage("a command cannot contain a newline".into()));
    }
    if line.len() > MAX_LINE {
        return Err(CtlError::Usage(format!(
            "command too long (at most {MAX_LINE} bytes)"
        )));
    }
    let mut s = UnixStream::connect(path).map_err(|source| CtlError::Connect {
        path: path.to_path_buf(),
        source,
    })?;
    let proto = |why: String| CtlError::Protocol {
        path: path.to_path_buf(),
        why,
    };
    // Bounded: the server answers within REPLY_TIMEOUT.
    let limit = REPLY_TIMEOUT + Duration::from_secs(5);
    s.set_read_timeout(Some(limit))
        .and_then(|()| s.set_write_timeout(Some(limit)))
        .map_err(|e| proto(e.to_string()))?;
    s.write_all(format!("{line}\n").as_bytes())
        .map_err(|e| proto(format!("sending: {e}")))?;
    // One reply line, bounded (stats/list JSON of up to 256 CPUs fits easily).
    let mut reply = Vec::new();
    let mut chunk = [0u8; 4096];
    const MAX_REPLY: usize = 4 << 20;
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                reply.extend_from_slice(&chunk[..n]);
                if reply.contains(&b'\n') {
                    break;
                }
                if reply.len() > MAX_REPLY {
                    return Err(proto("reply too long".into()));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(proto(format!("reading the reply: {e}"))),
        }
    }
    let end = reply
        .iter()
        .position(|&b| b == b'\n')
        .ok_or_else(|| proto("the connection closed without a reply".into()))?;
    let text = String::from_utf8_lossy(&reply[..end]).into_owned();
    if let Some(rest) = text.strip_prefix("ok") {
        if rest.is_empty() || rest.starts_with(' ') {
            return Ok(CtlOutcome::Ok(rest.trim_start_matches(' ').to_string()));
        }
    }
    if let Some(rest) = text.strip_prefix("err") {
        if rest.is_empty() || rest.starts_with(' ') {
            return Ok(CtlOutcome::Err(rest.trim_start_matches(' ').to_string()));
        }
    }
    Err(proto(format!("not a reply: {:?}", truncate(&text, 80))))
}

impl<M: hyptrace_abi::SharedMem> EventSwitch for crate::events::EventTable<M> {
    fn set(&self, spec: &str, on: bool) -> Result<String, String> {
        let names = if on {
            self.enable(spec)
        } else {
            self.disable(spec)
        }
        .map_err(|e| e.to_string())?;
        Ok(format!(
            "{} {}",
            names.join(","),
            if on { "enabled" } else { "disabled" }
        ))
    }

    fn list(&self) -> Result<serde_json::Value, String> {
        let events: Vec<serde_json::Value> = crate::events::EventTable::list(self)
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|e| {
                let fields: Vec<serde_json::Value> = e
                    .reg
                    .fields
                    .iter()
                    .map(|f| {
                        serde_json::json!({
                            "name": f.name,
                            "type": f.ctype,
                            "offset": f.offset,
                            "size": f.size,
                            "signed": f.signed,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "name": e.reg.full_name(),
                    "id": e.reg.id,
                    "slot": e.reg.slot,
                    "enabled": e.enabled,
                    "fields": fields,
                })
            })
            .collect();
        Ok(serde_json::json!({ "events": events }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_commands() {
        assert_eq!(
            Command::parse("enable guest:marker"),
            Ok(Command::Enable("guest:marker".into()))
        );
        assert_eq!(
            Command::parse("  disable\tall "),
            Ok(Command::Disable("all".into()))
        );
        assert_eq!(Command::parse("stats"), Ok(Command::Stats));
        assert_eq!(Command::parse("list"), Ok(Command::List));
        for bad in [
            "",
            "   ",
            "enable",
            "enable a b",
            "stats x",
            "frobnicate",
            "ENABLE x",
        ] {
            assert!(Command::parse(bad).is_err(), "{bad:?} parsed");
        }
        let long = "x".repeat(10_000);
        let e = Command::parse(&long).expect_err("unknown");
        assert!(e.len() < 200, "{e}");
    }

    #[test]
    fn reply_lines() {
        assert_eq!(Reply::Ok(String::new()).line(), "ok\n");
        assert_eq!(Reply::Ok("a".into()).line(), "ok a\n");
        assert_eq!(Reply::Err("x\ny".into()).line(), "err x y\n");
    }

    struct Echo;
    impl Handler for Echo {
        fn handle(&mut self, cmd: &Command) -> Reply {
            match cmd {
                Command::Stats => Reply::Ok("{}".into()),
                c => Reply::Err(format!("{c:?}")),
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
        assert!(busy.starts_with("err busy"), "{busy:?}");
        drop(idle);
        std::thread::scope(|s| {
            let client = s.spawn(|| {
                // The idle clients' threads leave within a tick: retry while busy.
                let start = Instant::now();
                loop {
                    let r = ctl(&sock, &["stats".to_string()]).expect("ctl");
                    match r {
                        CtlOutcome::Err(e) if e.starts_with("busy") => {
                            assert!(start.elapsed() < Duration::from_secs(30), "busy");
                            std::thread::sleep(TICK);
                        }
                        r => return r,
                    }
                }
            });
            let start = Instant::now();
            while !client.is_finished() {
                assert!(start.elapsed() < Duration::from_secs(60), "no reply");
                server.serve(&mut Echo);
                std::thread::sleep(Duration::from_millis(5));
            }
            match client.join().expect("client") {
                CtlOutcome::Ok(t) => assert_eq!(t, "{}"),
                r => panic!("{r:?}"),
            }
        });
        drop(server);
        assert!(!sock.exists(), "removed on drop");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Sends `line` on `s` and reads one reply line, while the "run loop" (this
    /// thread) serves with `h` (bounded).
    fn ask(server: &ControlServer, h: &mut dyn Handler, s: &UnixStream, line: &str) -> String {
        let mut w = s.try_clone().expect("clone");
        w.write_all(format!("{line}\n").as_bytes()).expect("send");
        let r = s.try_clone().expect("clone");
        r.set_read_timeout(Some(Duration::from_millis(20)))
            .expect("timeout");
        let mut r = std::io::BufReader::new(r);
        let mut out = String::new();
        let start = Instant::now();
        loop {
            server.serve(h);
            match std::io::BufRead::read_line(&mut r, &mut out) {
                Ok(_) if out.ends_with('\n') => return out.trim_end().to_string(),
                Ok(0) => panic!("closed"),
                _ => {}
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no reply to {line}"
            );
        }
    }

    struct Consumer;
    impl Handler for Consumer {
        fn handle(&mut self, cmd: &Command) -> Reply {
            match cmd {
                Command::Attach => Reply::Ok("{}".into()),
                Command::GetReader(c) => Reply::Ok(format!("swapped {c} 0")),
                _ => Reply::Err("no".into()),
            }
        }
    }

    /// One consumer at a time: a second `attach` is `busy`, `get_reader` is only for the
    /// attached client, the claim ends when that client disconnects.
    #[test]
    fn attach_claims_the_consumer_role() {
        assert_eq!(Command::parse("attach"), Ok(Command::Attach));
        assert_eq!(Command::parse("get_reader 3"), Ok(Command::GetReader(3)));
        for bad in [
            "attach x",
            "get_reader",
            "get_reader -1",
            "get_reader x",
            "get_reader 1 2",
        ] {
            assert!(Command::parse(bad).is_err(), "{bad:?} parsed");
        }
        let (dir, sock) = temp_sock("attach");
        let server = ControlServer::bind(&sock).expect("bind");
        let h = &mut Consumer;
        let a = UnixStream::connect(&sock).expect("connect");
        let b = UnixStream::connect(&sock).expect("connect");
        assert_eq!(
            ask(&server, h, &b, "get_reader 0").split(' ').next(),
            Some("err")
        );
        assert_eq!(ask(&server, h, &a, "attach"), "ok {}");
        assert!(server.attached());
        assert_eq!(ask(&server, h, &a, "attach"), "ok {}", "again: still ours");
        assert_eq!(ask(&server, h, &a, "get_reader 1"), "ok swapped 1 0");
        let busy = ask(&server, h, &b, "attach");
        assert!(busy.starts_with("err busy"), "{busy}");
        let not = ask(&server, h, &b, "get_reader 1");
        assert!(not.contains("not attached"), "{not}");
        drop(a);
        // The client thread notices the close within a tick or so: retry, bounded.
        let start = Instant::now();
        loop {
            let r = ask(&server, h, &b, "attach");
            if r == "ok {}" {
                break;
            }
            assert!(r.starts_with("err busy"), "{r}");
            assert!(start.elapsed() < Duration::from_secs(30), "never released");
            std::thread::sleep(TICK);
        }
        assert_eq!(ask(&server, h, &b, "get_reader 0"), "ok swapped 0 0");
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
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
