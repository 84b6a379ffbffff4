//! The client side of the control socket: a connection ([`CtlConn`]) that sends
//! requests and reads their replies (bounded), and `hyptrace ctl` ([`ctl`]).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::control::protocol::{
    parse_reply, Answer, Command, Outcome, ReplyError, Request as Wire, MAX_FETCH_BYTES, VERSION,
};

use super::REPLY_TIMEOUT;

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
                what: reading("reading the reply", &source),
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
        let io = |source: std::io::Error| CtlError::Io {
            path: self.path.clone(),
            what: reading("reading a fetch answer's bytes", &source),
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

/// What a failed read was: `what`, or, when the read timed out, that the peer stopped
/// answering (the socket's read timeout says `EAGAIN`, which names nothing).
fn reading(what: &'static str, e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            "no reply within the timeout (the VMM stopped answering)"
        }
        _ => what,
    }
}
