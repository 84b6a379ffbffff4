//! `drain`'s subscriber row: what a subscriber receives (docs/design.md, "One reader,
//! subscribers") — the VMM's session reading a host region filled beforehand into its
//! outbox, a real control socket, and a client that subscribes, fetches 1 MiB at a time
//! (acknowledging the last batch) and checks every piece as `dump --attach` does (its
//! events decoded and counted), until an answer brings nothing new. The run loop runs as
//! the VMM's: serves the requests queued, reads a round, waits until the next request
//! (or its poll period).

use std::time::{Duration, Instant};

use hyptrace_abi::page::{page_header, Events, PAGE_HEADER_SIZE};
use hyptrace_output::{Clock, Discard};

use super::drain::{filled_region, ReaderDrainRow, Throughput};
use super::error::SubscriberError;
use super::stats::Summary;
use super::{BenchError, Cfg};
use crate::control::consumer::{RunMeta, Subscribers};
use crate::control::protocol::{Ack, Answer, Command, Outcome};
use crate::control::server::{ControlServer, CtlConn, Handler, Refusal};
use crate::drain::outbox::BatchItem;
use crate::drain::session::{Output, Session};

/// Bytes asked for per fetch (what `dump --attach` asks for).
const FETCH: u64 = 1 << 20;

/// The run loop's idle period (`--poll-ms`'s default).
const POLL: Duration = Duration::from_millis(5);

/// The run loop's side: subscribe and fetch over the session.
struct Vmm<S> {
    session: S,
    subs: Subscribers,
    meta: RunMeta,
}

impl<M: hyptrace_abi::SharedMem, C: hyptrace_reader::Callbacks> Handler for Vmm<Session<M, C>> {
    fn handle(&mut self, conn: u64, cmd: &Command) -> Result<Answer, Refusal> {
        let now = Instant::now();
        match cmd {
            Command::Subscribe { partial } => self
                .subs
                .subscribe(&mut self.session, (conn, *partial), &self.meta, now)
                .map(Answer::Subscribed),
            Command::Fetch {
                token,
                acks,
                max_bytes,
                knots,
            } => self
                .subs
                .fetch(
                    &mut self.session,
                    (conn, *token),
                    (acks, *max_bytes, *knots),
                    (&self.meta.clock, Some(&|_| false)),
                    now,
                )
                .map(Answer::Pieces),
            _ => Err("not in this bench".into()),
        }
    }
    fn gone(&mut self, conn: u64) {
        self.subs.gone(&mut self.session, conn);
    }
}

/// The client: subscribes, fetches until nothing new comes; returns (pieces, bytes of
/// them, seconds from the first fetch).
fn subscriber(sock: &std::path::Path) -> Result<(u64, u64, f64), SubscriberError> {
    let ctl = |request| move |source| SubscriberError::Control { request, source };
    let answer = |request, got: &dyn std::fmt::Debug| SubscriberError::Answer {
        request,
        got: format!("{got:?}"),
    };
    let mut c = CtlConn::connect(sock, Duration::from_secs(30)).map_err(ctl("connect"))?;
    let token = match c
        .request(Command::Subscribe { partial: false })
        .map_err(ctl("subscribe"))?
    {
        Outcome::Ok(Answer::Subscribed(i)) => i.token,
        r => return Err(answer("subscribe", &r)),
    };
    let (mut pieces, mut bytes, mut acks) = (0u64, 0u64, Vec::new());
    let fetch = |acks: Vec<Ack>| Command::Fetch {
        token,
        acks,
        max_bytes: FETCH,
        knots: 0,
    };
    let t = Instant::now();
    // As `dump --attach --follow`: while answers come at least half full, the next fetch
    // goes out before the batch is checked (acknowledging what came before it).
    let mut in_flight: Option<u64> = None;
    loop {
        let id = match in_flight.take() {
            Some(id) => id,
            None => c.send(fetch(acks.clone())).map_err(ctl("fetch"))?,
        };
        let b = match c.receive(id).map_err(ctl("fetch"))? {
            Outcome::Ok(Answer::Pieces(b)) => b,
            r => return Err(answer("fetch", &r)),
        };
        if b.items.is_empty() {
            return Ok((pieces, bytes, t.elapsed().as_secs_f64()));
        }
        if b.bytes >= FETCH / 2 {
            in_flight = Some(c.send(fetch(acks.clone())).map_err(ctl("fetch"))?);
        }
        let (data, mut at) = (b.payload(), 0usize);
        for it in &b.items {
            if let BatchItem::Piece { events, len, .. } = it.item {
                let p = data
                    .get(at..at.saturating_add(len))
                    .ok_or(SubscriberError::PiecePastBatch)?;
                let (ts, _) = page_header(p).unwrap_or((0, 0));
                let n = Events::new(&p[PAGE_HEADER_SIZE..], ts).count() as u64;
                if n != events {
                    return Err(SubscriberError::PieceCount {
                        counted: n,
                        said: events,
                    });
                }
                at += len;
                pieces += 1;
                bytes += len as u64;
            }
            acks = vec![Ack {
                cpu: it.cpu,
                seq: it.seq,
            }];
        }
    }
}

/// One run: the session and socket in this thread, the subscriber in another.
fn subscriber_once(pages: u32) -> Result<(u64, u64, f64), BenchError> {
    let rb = filled_region(pages)?;
    let mut session = Session::new(rb, Output::Pages(Box::new(Discard)), Clock::nanoseconds());
    session.set_live_drain(false);
    let mut vmm = Vmm {
        session,
        subs: Subscribers::new(),
        meta: RunMeta {
            clock: Clock::nanoseconds(),
            formats: hyptrace_output::guest_formats(),
        },
    };
    let dir = tempfile::Builder::new()
        .prefix("hyptrace-bench-")
        .tempdir()
        .map_err(BenchError::TempFile)?;
    let sock = dir.path().join("s");
    let server = ControlServer::bind(&sock)?;
    std::thread::scope(|s| {
        let server = server;
        // The run loop as the VMM's: woken by each request queued (the waker), else
        // sleeping a poll period (bounded: the client ends at the first empty answer, or
        // fails, and a thread that ends wakes nobody: the period ends the wait).
        let me = std::thread::current();
        server.set_waker(Some(Box::new(move || me.unpark())));
        let client = std::thread::Builder::new()
            .name("hyptrace-sub".into())
            .spawn_scoped(s, || subscriber(&sock))
            .map_err(|e| BenchError::Subscriber(SubscriberError::Thread(e)));
        let client = match client {
            Ok(c) => c,
            Err(e) => return Err(e),
        };
        while !client.is_finished() {
            server.serve(&mut vmm);
            // As the run loop: a round of reading into the outbox between requests.
            if let Some((cpu, e)) = vmm.session.service(|_| false).into_iter().next() {
                // The socket closed: the client's wait for a reply ends now, not at
                // its timeout.
                drop(server);
                let _ = client.join();
                return Err(BenchError::Subscriber(SubscriberError::Session {
                    cpu,
                    source: e,
                }));
            }
            let wait = vmm.session.next_wait(POLL);
            if !wait.is_zero() {
                std::thread::park_timeout(wait);
            }
        }
        server.set_waker(None);
        client
            .join()
            .unwrap_or(Err(SubscriberError::Panicked))
            .map_err(BenchError::Subscriber)
    })
}

/// The subscriber row: `reps` runs over a region of `drain_pages` pages.
pub(super) fn subscriber_drain(cfg: &Cfg) -> Result<ReaderDrainRow, BenchError> {
    let (mut mbs, mut pps) = (Vec::new(), Vec::new());
    for _ in 0..cfg.reps {
        let (pieces, bytes, secs) = subscriber_once(cfg.drain_pages)?;
        mbs.push(bytes as f64 / secs / 1e6);
        pps.push(pieces as f64 / secs);
    }
    Ok(ReaderDrainRow {
        throughput: Throughput {
            mb_per_s: Summary::of(&mbs),
            pages_per_s: Summary::of(&pps),
        },
        mb_per_s_incl_fsync: Summary::of(&mbs),
        pages: cfg.drain_pages,
    })
}
