//! The VMM's side of subscribers (live attach; docs/design.md, "One reader, subscribers",
//! C1–C4): who holds the claim, what a `fetch` sends and takes back, what a `detach`
//! or a subscriber that went away leaves. The session is the one reader of every ring
//! (C1); this module only decides who gets what it read. Generic over the session's
//! memory and callbacks, so the run loop (`run/live.rs`, `RunControl`) and the deterministic
//! model below run the same code.

use std::time::{Duration, Instant};

use hyptrace_abi::SharedMem;
use hyptrace_output::{Clock, EventFormat};
use hyptrace_reader::Callbacks;

use crate::control::protocol::{
    Ack, PieceBatch, SubscribeInfo, WireClock, WireItem, MAX_FETCH_BYTES, MAX_FETCH_ITEMS,
};
use crate::control::server::Refusal;
use crate::drain::outbox::Unsent;
use crate::drain::session::Session;

/// How long a subscriber may go without a request once every vCPU stopped (C4) before
/// the VMM takes the claim back and writes the rest itself.
pub const SUBSCRIBER_GRACE: Duration = Duration::from_secs(10);
/// Most clock knots one `fetch` answer carries (a subscriber missing more gets the rest
/// with its next fetches; a run adds a few per minute).
const MAX_KNOTS: usize = 1024;

/// The subscriber holding the claim: its connection and token (C2), and when it last
/// asked for anything (C4's bound).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Claim {
    conn: u64,
    token: u64,
    last: Instant,
}

/// What a subscriber needs to write the events: the run's clock and formats.
#[derive(Debug, Clone)]
pub struct RunMeta {
    /// The clock of the pages' timestamps (with the run's map, if any).
    pub clock: Clock,
    /// The event formats.
    pub formats: Vec<EventFormat>,
}

/// The claim.
#[derive(Debug, Default)]
pub struct Subscribers {
    claim: Option<Claim>,
    next_token: u64,
}

impl Subscribers {
    /// No subscriber yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether a subscriber holds the claim.
    pub fn claimed(&self) -> bool {
        self.claim.is_some()
    }

    /// C2: `what` is only for the connection and token holding the claim, checked when
    /// the request executes; the claim's clock restarts (C4).
    fn check(&mut self, conn: u64, token: u64, what: &str, now: Instant) -> Result<(), Refusal> {
        match &mut self.claim {
            Some(c) if c.conn == conn && c.token == token => {
                c.last = now;
                Ok(())
            }
            Some(c) if c.token == token => {
                Err(format!("{what}: claim {token} belongs to another connection").into())
            }
            _ => Err(format!(
                "{what}: claim {token} is not the VMM's subscriber (ended, or never subscribed)"
            )
            .into()),
        }
    }

    /// `subscribe` for `conn`: one subscriber at a time; from now on the session reads
    /// every ring for it (C1).
    pub fn subscribe<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &mut Session<M, C>,
        (conn, partial): (u64, bool),
        meta: &RunMeta,
        now: Instant,
    ) -> Result<SubscribeInfo, Refusal> {
        if self.claim.is_some() {
            return Err("busy: another subscriber is attached (one at a time)".into());
        }
        self.next_token = self.next_token.wrapping_add(1).max(1);
        let token = self.next_token;
        self.claim = Some(Claim {
            conn,
            token,
            last: now,
        });
        s.subscribe(partial);
        let l = s.reader().layout();
        let c = &meta.clock;
        Ok(SubscribeInfo {
            token,
            nr_cpus: l.nr_cpus,
            page_size: u32::try_from(l.page_size).unwrap_or(u32::MAX),
            clock: WireClock {
                name: c.name.clone(),
                tsc: c.tsc,
                offset_ns: c.offset_ns,
                knots: c.map.as_ref().map_or_else(Vec::new, |m| m.knots_from(0)),
            },
            formats: meta.formats.clone(),
            pid: std::process::id(),
        })
    }

    /// Takes the subscriber's acknowledgements (C2: each names an item it was sent).
    fn take_acks<M: SharedMem, C: Callbacks>(
        s: &mut Session<M, C>,
        what: &str,
        acks: &[Ack],
    ) -> Result<(), Refusal> {
        for a in acks {
            s.ack(a.cpu, a.seq).map_err(|e| format!("{what}: {e}"))?;
        }
        Ok(())
    }

    /// `fetch` of the claim `token`: takes the acknowledgements, reads the rings one
    /// round as the run loop does (`read`: which vCPUs stopped; `None` while the loop may
    /// not read, a crash not dumped yet), sends what is queued (at most `max_bytes`),
    /// with the clock's knots after the first `knots`. The answer so holds what was
    /// committed when it came: a one-shot subscriber stops at the first empty one.
    pub fn fetch<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &mut Session<M, C>,
        (conn, token): (u64, u64),
        (acks, max_bytes, knots): (&[Ack], u64, u64),
        (clock, read): (&Clock, Option<&dyn Fn(u32) -> bool>),
        now: Instant,
    ) -> Result<PieceBatch, Refusal> {
        self.check(conn, token, "fetch", now)?;
        Self::take_acks(s, "fetch", acks)?;
        let max = max_bytes.clamp(1, MAX_FETCH_BYTES) as usize;
        if let Some(stopped) = read {
            s.read_for_fetch(stopped, max);
        }
        let batch = s.send(max, MAX_FETCH_ITEMS);
        let from = usize::try_from(knots).unwrap_or(usize::MAX);
        let mut knots = clock
            .map
            .as_ref()
            .map_or_else(Vec::new, |m| m.knots_from(from));
        knots.truncate(MAX_KNOTS);
        Ok(PieceBatch {
            items: batch
                .items
                .into_iter()
                .map(|(cpu, seq, item)| WireItem { cpu, seq, item })
                .collect(),
            knots,
            knots_from: from as u64,
            bytes: batch.len as u64,
            data: batch.data,
        })
    }

    /// `detach` of the claim `token`: takes the acknowledgements (refused, and the claim
    /// kept, unless each names an item sent: C2), then the claim ends; what was sent and
    /// not acknowledged goes out again (the subscriber said it did not take it).
    pub fn detach<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &mut Session<M, C>,
        (conn, token): (u64, u64),
        acks: &[Ack],
        now: Instant,
    ) -> Result<(), Refusal> {
        self.check(conn, token, "detach", now)?;
        Self::take_acks(s, "detach", acks)?;
        self.claim = None;
        s.unsubscribe();
        Ok(())
    }

    /// The client `conn` went away: if it held the claim, the claim ends and what it
    /// was sent and did not acknowledge goes out again — returned, for the caller to
    /// name (C4: it may be in that subscriber's output too).
    pub fn gone<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &mut Session<M, C>,
        conn: u64,
    ) -> Option<Vec<Unsent>> {
        if self.claim.is_some_and(|c| c.conn == conn) {
            self.claim = None;
            return Some(s.unsubscribe());
        }
        None
    }

    /// C4's bound: with every vCPU stopped (`all_done`), a subscriber that asked for
    /// nothing for [`SUBSCRIBER_GRACE`] loses the claim; as [`Subscribers::gone`].
    pub fn end_if_late<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &mut Session<M, C>,
        all_done: bool,
        now: Instant,
    ) -> Option<Vec<Unsent>> {
        let c = self.claim?;
        if all_done && now.saturating_duration_since(c.last) >= SUBSCRIBER_GRACE {
            self.claim = None;
            return Some(s.unsubscribe());
        }
        None
    }
}

#[cfg(test)]
pub(crate) mod model;
