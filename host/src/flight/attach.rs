//! Live attach (`hyptrace dump --attach SOCKET [--follow]`): a second process subscribes
//! to a running VMM (docs/design.md, "One reader, subscribers"). The VMM is the only
//! reader of its rings; it reads them for the subscriber and sends what it read — pieces
//! of pages, each a page of its own — over the control socket; the subscriber writes
//! them in any `record` format and acknowledges them with its next request, so the next
//! subscriber or the VMM's own output goes on exactly after them.
//!
//! The VMM is a socket peer, hostile like any: a batch is taken only when it answers our
//! request, its items follow each other (sequence numbers, event indexes), every piece
//! decodes to the events it says, and the clock's knots only go forward.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hyptrace_abi::page::{page_header, Events, PAGE_HEADER_SIZE};
use hyptrace_output::{
    Clock, ClockMap, Missed, OutputError, OutputTarget, PageSink, RunSummary, TraceMeta,
};

use crate::control::protocol::{
    Ack, Answer, Command, Outcome, PieceBatch, SubscribeInfo, WireClock, MAX_FETCH_BYTES,
};
use crate::control::server::{CtlConn, CtlError};
use crate::drain::outbox::BatchItem;
use crate::drain::sink::Format;

/// How long the client waits for one reply of the VMM.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(15);
/// The poll interval of `--follow` when the VMM had nothing new.
pub const FOLLOW_POLL: Duration = Duration::from_millis(10);
/// The pause of `--follow` after an answer that held less than half a fetch (caught up).
pub const CAUGHT_UP_POLL: Duration = Duration::from_millis(1);
/// Bytes of pieces asked for per `fetch`.
const FETCH_BYTES: u64 = 1 << 20;

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
    /// The VMM refused the subscription (busy, `--drain live`).
    #[error("--attach {path}: the VMM refused: {why}", path = .path.display())]
    Refused {
        /// The socket.
        path: PathBuf,
        /// Its reason, as the VMM words it.
        why: String,
    },
    /// The VMM's run is on another clock than the one asked for (`collect`).
    #[error("--attach {path}: the run is on clock {clock}; every VM must run --clock {want} (the default)", path = .path.display())]
    Clock {
        /// The socket.
        path: PathBuf,
        /// The run's clock.
        clock: String,
        /// The clock asked for.
        want: String,
    },
    /// What the VMM sent cannot be true.
    #[error("--attach {path}: the VMM sent {why}", path = .path.display())]
    Untrusted {
        /// The socket.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The output failed.
    #[error("cannot write {path}", path = .path.display())]
    Output {
        /// The output.
        path: PathBuf,
        /// Why.
        #[source]
        why: OutputError,
    },
}

/// What went wrong on the control socket.
#[derive(Debug, thiserror::Error)]
pub enum SocketProblem {
    /// Connecting, sending or the reply.
    #[error(transparent)]
    Ctl(#[from] CtlError),
    /// The VMM answered something else than the request asked for.
    #[error("a reply to another request: {0}")]
    OtherReply(String),
    /// The VMM refused a request of the subscription.
    #[error("the VMM refused: {0}")]
    Refused(String),
}

impl AttachError {
    /// The exit code: 2 for a refused subscription, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Refused { .. } | Self::Clock { .. } => crate::exit::EXIT_USAGE,
            Self::Socket { .. } | Self::Untrusted { .. } | Self::Output { .. } => {
                crate::exit::EXIT_RUNTIME
            }
        }
    }
}

/// What an attach read.
#[derive(Debug, Default)]
pub struct AttachReport {
    /// Per CPU: events written to the output, events lost.
    pub cpus: Vec<(u64, u64)>,
    /// Batches fetched.
    pub fetches: u64,
    /// Why the reading ended.
    pub ended: String,
    /// The CPUs whose reading is not complete though it should be, and why (the exit is
    /// not 0).
    pub errors: Vec<(u32, String)>,
    /// With [`AttachOpts::keep_on_error`]: the error that ended the reading after the
    /// output was open (the output holds what was taken before it).
    pub failed: Option<AttachError>,
}

/// The options of one attach.
pub struct AttachOpts<'a> {
    /// The control socket.
    pub socket: &'a Path,
    /// Keep reading until every vCPU's events ended (or `stop` says so).
    pub follow: bool,
    /// The output and its format.
    pub target: &'a OutputTarget,
    /// The output's path (for messages).
    pub out_path: &'a Path,
    /// The format.
    pub format: Format,
    /// Polled between fetches: stop (SIGINT).
    pub stop: &'a dyn Fn() -> bool,
    /// The host clock the run must be on (with its map), or any.
    pub clock: Option<&'a str>,
    /// An error once the output is open ends the reading, not the output: it is
    /// finished with what was taken and the error is [`AttachReport::failed`].
    pub keep_on_error: bool,
    /// Makes the output from the run's metadata instead of `target` in `format`
    /// (`collect -o clickhouse://`: each VM's rows streamed as they are read).
    pub sink: Option<SinkMaker<'a>>,
}

/// Makes an output sink from the subscribed run's metadata ([`AttachOpts::sink`]).
pub type SinkMaker<'a> =
    &'a (dyn Fn(TraceMeta) -> Result<Box<dyn PageSink + Send>, OutputError> + Sync);

/// One CPU as the subscriber follows it.
#[derive(Debug, Default, Clone, Copy)]
struct CpuFollow {
    /// The last item's sequence number (0: none yet).
    seq: u64,
    /// The index after the last piece's events (none before the first piece).
    next: Option<u64>,
    /// The end came: nothing more of this CPU.
    ended: bool,
    read: u64,
    lost: u64,
    bytes: u64,
}

/// The subscription: what it took so far, the clock it rebuilds, the output.
struct Subscriber {
    path: PathBuf,
    cpus: Vec<CpuFollow>,
    page_size: usize,
    map: Option<ClockMap>,
    knots: u64,
    page: Vec<u8>,
    /// Batches fetched so far.
    fetches: u64,
}

impl Subscriber {
    fn untrusted(&self, why: String) -> AttachError {
        AttachError::Untrusted {
            path: self.path.clone(),
            why,
        }
    }

    /// The acknowledgements of everything taken (C2: only numbers the VMM sent).
    fn acks(&self) -> Vec<Ack> {
        (0u32..)
            .zip(&self.cpus)
            .filter(|(_, c)| c.seq > 0)
            .map(|(cpu, c)| Ack { cpu, seq: c.seq })
            .collect()
    }

    fn all_ended(&self) -> bool {
        self.cpus.iter().all(|c| c.ended)
    }

    /// Takes a batch into `sink`: checks it item by item (numbers in sequence, event
    /// indexes following each other, every piece what it says), writes each piece as a
    /// page, each end as the CPU's trailing loss. Returns whether it held anything.
    fn take(&mut self, b: &PieceBatch, sink: &mut dyn PageSink) -> Result<bool, AttachError> {
        let data = b.payload();
        if data.len() as u64 != b.bytes {
            return Err(self.untrusted(format!("{} bytes for {}", data.len(), b.bytes)));
        }
        // The knots from `knots_from` on: those this side has are skipped (a fetch sent
        // before the last answer was taken asks for them again), a gap is a lie.
        if b.knots_from > self.knots {
            let why = format!(
                "clock knots from {} (this side has {})",
                b.knots_from, self.knots
            );
            return Err(self.untrusted(why));
        }
        let have = usize::try_from(self.knots - b.knots_from).unwrap_or(usize::MAX);
        for k in b.knots.iter().skip(have) {
            let map = self.map.as_ref();
            if !map.is_some_and(|m| m.append(*k)) {
                return Err(self.untrusted(format!("a clock knot out of order: {k:?}")));
            }
            self.knots += 1;
        }
        let mut at = 0usize;
        for it in &b.items {
            let cpu = it.cpu as usize;
            let Some(c) = self.cpus.get(cpu).copied() else {
                return Err(self.untrusted(format!("an item of CPU {}", it.cpu)));
            };
            // The first item may have any number (the items before it went to earlier
            // readers); after it they follow each other.
            if c.ended || it.seq == 0 || (c.seq != 0 && it.seq != c.seq + 1) {
                return Err(self.untrusted(format!(
                    "item {} of cpu {} after item {}{}",
                    it.seq,
                    it.cpu,
                    c.seq,
                    if c.ended { " (its end)" } else { "" }
                )));
            }
            match it.item {
                BatchItem::Piece {
                    first,
                    events,
                    missed,
                    len,
                } => {
                    let end = at.checked_add(len).filter(|&e| e <= data.len());
                    let Some(end) = end else {
                        return Err(self.untrusted(format!("a piece past its batch ({len} bytes)")));
                    };
                    self.piece(it.cpu, (first, events, missed), &data[at..end], sink)?;
                    at = end;
                }
                BatchItem::End { lost } => {
                    self.cpus[cpu].ended = true;
                    self.cpus[cpu].lost = c.lost.saturating_add(lost);
                    if lost > 0 {
                        sink.trailing_lost(it.cpu, lost)
                            .map_err(|why| self.out_err(why))?;
                    }
                }
            }
            self.cpus[cpu].seq = it.seq;
        }
        if at != data.len() {
            return Err(self.untrusted(format!("{} bytes no piece names", data.len() - at)));
        }
        Ok(!b.items.is_empty())
    }

    fn out_err(&self, why: OutputError) -> AttachError {
        AttachError::Output {
            path: self.path.clone(),
            why,
        }
    }

    /// One piece of `cpu`: its first index right after the last piece's events and
    /// the losses before it; decodes to `events` events; written as a page.
    fn piece(
        &mut self,
        cpu: u32,
        (first, events, missed): (u64, u64, u64),
        bytes: &[u8],
        sink: &mut dyn PageSink,
    ) -> Result<(), AttachError> {
        let c = self.cpus[cpu as usize];
        if bytes.len() < PAGE_HEADER_SIZE || bytes.len() > self.page_size {
            return Err(self.untrusted(format!("a piece of {} bytes", bytes.len())));
        }
        if let Some(next) = c.next {
            if next.checked_add(missed) != Some(first) {
                return Err(self.untrusted(format!(
                    "cpu {cpu}: events from {first} after {next} with {missed} lost"
                )));
            }
        }
        let (ts, commit) = page_header(bytes).unwrap_or((0, 0));
        let data = &bytes[PAGE_HEADER_SIZE..];
        let counted = Events::new(data, ts).try_fold(0u64, |n, e| e.map(|_| n + 1));
        if commit as usize != data.len() || counted != Ok(events) {
            return Err(self.untrusted(format!(
                "cpu {cpu}: a piece that is not what it says ({events} events, {} bytes)",
                data.len()
            )));
        }
        self.page.clear();
        self.page.extend_from_slice(bytes);
        self.page.resize(self.page_size, 0);
        sink.page(cpu, &self.page, Missed::count(missed))
            .map_err(|why| self.out_err(why))?;
        let c = &mut self.cpus[cpu as usize];
        c.next = Some(first.saturating_add(events));
        c.read = c.read.saturating_add(events);
        c.lost = c.lost.saturating_add(missed);
        c.bytes = c.bytes.saturating_add(data.len() as u64);
        Ok(())
    }
}

/// One request of the subscription: the answer, or why there is none; `Ok(None)` when
/// the run ended (the VMM said so, or its socket closed).
fn request(
    conn: &mut CtlConn,
    o: &AttachOpts<'_>,
    cmd: Command,
) -> Result<Option<Answer>, AttachError> {
    match conn.send(cmd) {
        Ok(id) => receive(conn, o, id),
        Err(e) => answer(o, Err(e)),
    }
}

/// The answer to request `id` (sent before), as [`request`] takes it.
fn receive(conn: &mut CtlConn, o: &AttachOpts<'_>, id: u64) -> Result<Option<Answer>, AttachError> {
    answer(o, conn.receive(id))
}

fn answer(o: &AttachOpts<'_>, r: Result<Outcome, CtlError>) -> Result<Option<Answer>, AttachError> {
    let sock_err = |why: SocketProblem| AttachError::Socket {
        path: o.socket.to_path_buf(),
        why,
    };
    match r {
        Ok(Outcome::Ok(a)) => Ok(Some(a)),
        Ok(Outcome::Err(why)) if why.starts_with("the run ended") => Ok(None),
        Ok(Outcome::Err(why)) => Err(sock_err(SocketProblem::Refused(why))),
        Err(CtlError::Closed { .. }) => Ok(None),
        Err(e) => Err(sock_err(e.into())),
    }
}

/// Connects and subscribes: the connection and the VMM's answer.
fn subscribe(o: &AttachOpts<'_>, partial: bool) -> Result<(CtlConn, SubscribeInfo), AttachError> {
    let sock_err = |why: SocketProblem| AttachError::Socket {
        path: o.socket.to_path_buf(),
        why,
    };
    let mut conn = CtlConn::connect(o.socket, REPLY_TIMEOUT).map_err(|e| sock_err(e.into()))?;
    match conn.request(Command::Subscribe { partial }) {
        Ok(Outcome::Ok(Answer::Subscribed(info))) => Ok((conn, info)),
        Ok(Outcome::Err(why)) => Err(AttachError::Refused {
            path: o.socket.to_path_buf(),
            why,
        }),
        Ok(a) => Err(sock_err(SocketProblem::OtherReply(format!("{a:?}")))),
        Err(e) => Err(sock_err(e.into())),
    }
}

/// The run's clock as the VMM describes it (its map rebuilt from the knots).
fn rebuild_clock(c: &WireClock) -> Option<(Clock, Option<ClockMap>)> {
    let clock = Clock {
        name: c.name.clone(),
        tsc: c.tsc,
        offset_ns: c.offset_ns,
        map: None,
    };
    let Some((first, rest)) = c.knots.split_first() else {
        return Some((clock, None));
    };
    let map = ClockMap::new(*first);
    if !rest.iter().all(|k| map.append(*k)) {
        return None;
    }
    Some((clock.with_map(&c.name, map.clone()), Some(map)))
}

/// The subscription and its output, from the VMM's answer.
fn open(
    o: &AttachOpts<'_>,
    info: &SubscribeInfo,
) -> Result<(Subscriber, Box<dyn PageSink + Send>), AttachError> {
    let untrusted = |why: String| AttachError::Untrusted {
        path: o.socket.to_path_buf(),
        why,
    };
    let nr = info.nr_cpus;
    if nr == 0 || nr as usize > hyptrace_abi::layout::MAX_CPUS {
        return Err(untrusted(format!("{nr} CPUs")));
    }
    let Some((clock, map)) = rebuild_clock(&info.clock) else {
        return Err(untrusted("a clock whose knots go back".into()));
    };
    if let Some(want) = o.clock {
        if clock.name != want || map.is_none() {
            return Err(AttachError::Clock {
                path: o.socket.to_path_buf(),
                clock: crate::exit::printable(&clock.name).into_owned(),
                want: want.into(),
            });
        }
    }
    let meta = TraceMeta {
        formats: info.formats.clone(),
        ..TraceMeta::guest(info.page_size as usize, nr, clock)
    };
    meta.validate()
        .map_err(|e| untrusted(crate::exit::chain(&e)))?;
    let sink = match o.sink {
        Some(make) => make(meta),
        None => crate::drain::sink::make_sink(
            o.target,
            o.format,
            hyptrace_output::Compression::Zstd,
            meta,
        ),
    }
    .map_err(|why| AttachError::Output {
        path: o.out_path.to_path_buf(),
        why,
    })?;
    let knots = info.clock.knots.len() as u64;
    let sub = Subscriber {
        path: o.socket.to_path_buf(),
        cpus: vec![CpuFollow::default(); nr as usize],
        page_size: info.page_size as usize,
        map,
        knots,
        page: Vec::new(),
        fetches: 0,
    };
    Ok((sub, sink))
}

/// Fetches until every CPU ended, the VMM went away, a stop, or (one-shot) an answer
/// with nothing new; returns why it ended. With `--follow`, while the VMM has a backlog
/// (an answer at least half full), the next fetch is sent before the last batch is
/// written — it acknowledges what was taken before that batch — so that the VMM reads and
/// sends while this side writes; what a fetch still in flight at the end brings is not
/// taken (not acknowledged: it goes to the next reader).
fn fetch_rounds(
    conn: &mut CtlConn,
    token: u64,
    sub: &mut Subscriber,
    sink: &mut dyn PageSink,
    o: &AttachOpts<'_>,
) -> Result<String, AttachError> {
    let started = Instant::now();
    let fetch = |sub: &Subscriber| Command::Fetch {
        token,
        acks: sub.acks(),
        max_bytes: FETCH_BYTES.min(MAX_FETCH_BYTES),
        knots: sub.knots,
    };
    let mut in_flight: Option<u64> = None;
    let ended = loop {
        let got = match in_flight.take() {
            Some(id) => receive(conn, o, id)?,
            None => request(conn, o, fetch(sub))?,
        };
        let batch = match got {
            Some(Answer::Pieces(b)) => b,
            Some(a) => {
                let why = SocketProblem::OtherReply(format!("{a:?}"));
                return Err(AttachError::Socket {
                    path: o.socket.to_path_buf(),
                    why,
                });
            }
            None => return Ok("the VMM went away".into()),
        };
        sub.fetches += 1;
        let backlog = batch.bytes >= FETCH_BYTES / 2;
        if o.follow && backlog {
            in_flight = match conn.send(fetch(sub)) {
                Ok(id) => Some(id),
                Err(e) => answer(o, Err(e)).map(|_| None)?,
            };
        }
        let any = sub.take(&batch, sink)?;
        sink.idle().map_err(|why| sub.out_err(why))?;
        if sub.all_ended() {
            break "every vCPU's events ended".to_string();
        }
        if (o.stop)() {
            break "interrupted".to_string();
        }
        if !any {
            if !o.follow {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                break format!("drained in {ms:.1} ms");
            }
            std::thread::sleep(FOLLOW_POLL);
        } else if o.follow && !backlog {
            // Caught up: the next fetch a poll later, as the VMM's own reader paces
            // itself. Each request wakes the VMM's run loop (a real-time thread): asked
            // back to back, it would keep a vCPU sharing its core from writing.
            std::thread::sleep(CAUGHT_UP_POLL);
        }
    };
    // A fetch still in flight: its answer is read, not taken (`detach` hands it back).
    if let Some(id) = in_flight {
        if receive(conn, o, id)?.is_none() {
            return Ok("the VMM went away".into());
        }
    }
    Ok(ended)
}

/// Subscribes to the VMM behind `o.socket`, writes what it sends, returns what was read.
pub fn attach(o: &AttachOpts<'_>) -> Result<AttachReport, AttachError> {
    // Text on stdout streams the writer's page as far as it is committed; the page
    // formats take whole pages (the writer's page comes once it is left, or at the end).
    let partial =
        o.format == Format::Text && o.target.kind() == hyptrace_output::TargetKind::Stdout;
    let (mut conn, info) = subscribe(o, partial)?;
    let (mut sub, mut sink) = open(o, &info)?;
    let (ended, failed) = match fetch_rounds(&mut conn, info.token, &mut sub, sink.as_mut(), o) {
        Ok(ended) => (ended, None),
        Err(e) if o.keep_on_error => ("stopped by an error".to_string(), Some(e)),
        Err(e) => return Err(e),
    };
    // Everything taken is acknowledged; the rest is the next reader's (C1). A VMM that
    // went away needs no detach; one whose socket failed gets none (its connection
    // closing hands back what was not acknowledged, C4).
    let socket_failed = matches!(failed, Some(AttachError::Socket { .. }));
    if !ended.starts_with("the VMM went away") && !socket_failed {
        let cmd = Command::Detach {
            token: info.token,
            acks: sub.acks(),
        };
        match request(&mut conn, o, cmd) {
            Ok(Some(Answer::Detached) | None) => {}
            Ok(Some(a)) => log::warn!("detach: a reply to another request: {a:?}"),
            Err(e) if failed.is_some() => log::warn!("detach: {}", crate::exit::chain(&e)),
            Err(e) => return Err(e),
        }
    }
    let errors = if o.follow && !sub.all_ended() && ended.starts_with("the VMM went away") {
        (0u32..)
            .zip(&sub.cpus)
            .filter(|(_, c)| !c.ended)
            .map(|(cpu, _)| (cpu, "the VMM went away before this CPU's end: the output holds what it sent (the rest: its own output, or `hyptrace dump --trace-mem` of its file)".to_string()))
            .collect()
    } else {
        Vec::new()
    };
    let summary = RunSummary {
        cpus: sub
            .cpus
            .iter()
            .map(|c| hyptrace_output::KernelCpuStat {
                entries: 0,
                overrun: 0,
                commit_overrun: 0,
                bytes: c.bytes,
                oldest_event_ts: 0,
                now_ts: 0,
                dropped_events: c.lost,
                read_events: c.read,
            })
            .collect(),
    };
    sink.finish(&summary).map_err(|why| sub.out_err(why))?;
    Ok(AttachReport {
        cpus: sub.cpus.iter().map(|c| (c.read, c.lost)).collect(),
        fetches: sub.fetches,
        ended,
        errors,
        failed,
    })
}
