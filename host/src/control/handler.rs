//! The control socket's commands, executed by the run loop between its drain rounds
//! (docs/design.md, "The control socket"): enable bits, stats, and the subscriber's
//! `subscribe`/`fetch`/`detach` ([`Subscribers`]). Adding a command: a
//! [`Command`] variant and its answer in `protocol.rs`, and its arm here.

use std::time::Instant;

use crate::control::consumer::{RunMeta, Subscribers};
use crate::control::protocol::{CpuLive, LiveStats};
use crate::control::server::{Answer, Command, EventSwitch, Handler, Refusal};
use crate::drain::outbox::Unsent;
use crate::drain::session::Session;
use crate::vmm::vm::RunningVm;

/// The run loop's state a command acts on, for the length of one `serve`.
pub struct RunControl<'s> {
    /// The session: the one reader of every ring (C1).
    pub session: &'s mut Session,
    /// The VM.
    pub running: &'s RunningVm,
    /// The guest's event registrations (enable bits).
    pub events: &'s dyn EventSwitch,
    /// Why the run is stopping, if it is.
    pub stop: Option<String>,
    /// The claim of live attach.
    pub subscribers: &'s mut Subscribers,
    /// The run's clock and formats (what a subscriber needs).
    pub meta: &'s RunMeta,
    /// `--drain live`: the VMM's own output reads every ring (no subscriber can).
    pub drain_live: bool,
    /// A vCPU crashed and the crash dump is not taken yet: nothing may be read.
    pub hold: bool,
}

impl Handler for RunControl<'_> {
    fn handle(&mut self, conn: u64, cmd: &Command) -> Result<Answer, Refusal> {
        let now = Instant::now();
        match cmd {
            Command::Enable { event } => self.events.set(event, true),
            Command::Disable { event } => self.events.set(event, false),
            Command::List => self.events.list(),
            Command::Stats => Ok(Answer::Stats(self.stats())),
            Command::Subscribe { partial } => {
                self.subscribable()?;
                self.subscribers
                    .subscribe(self.session, (conn, *partial), self.meta, now)
                    .map(Answer::Subscribed)
            }
            Command::Fetch {
                token,
                acks,
                max_bytes,
                knots,
            } => {
                let running = self.running;
                let stopped = |c: u32| running.vcpu_finished(c);
                // While a crash is not dumped yet nothing is read (the dump comes first).
                let read = (!self.hold).then_some(&stopped as &dyn Fn(u32) -> bool);
                self.subscribers
                    .fetch(
                        self.session,
                        (conn, *token),
                        (acks, *max_bytes, *knots),
                        (&self.meta.clock, read),
                        now,
                    )
                    .map(Answer::Pieces)
            }
            Command::Detach { token, acks } => {
                self.subscribers
                    .detach(self.session, (conn, *token), acks, now)?;
                Ok(Answer::Detached)
            }
        }
    }

    fn gone(&mut self, conn: u64) {
        if let Some(unsent) = self.subscribers.gone(self.session, conn) {
            log::info!("the subscriber disconnected without detaching");
            note_unsent(&unsent, "disconnected");
        }
    }
}

/// C4: names what a subscriber that left without detaching was sent and did not
/// acknowledge: it goes out again (to the next subscriber or the VMM's own output), and
/// may also be in that subscriber's output.
pub fn note_unsent(unsent: &[Unsent], how: &str) {
    for u in unsent.iter().filter(|u| u.events > 0) {
        note!(
            "hyptrace: warning: cpu {}: events {}..{} ({}) were sent to a subscriber that {how} without acknowledging them: they are delivered again and may repeat what it wrote",
            u.cpu,
            u.first,
            u.first.saturating_add(u.events),
            u.events
        );
    }
}

impl RunControl<'_> {
    /// A subscriber may take only a VMM that does not read for its own output while the
    /// guest runs (`--drain none`).
    fn subscribable(&self) -> Result<(), Refusal> {
        if self.drain_live {
            return Err(
                "subscribe needs a VMM run with --drain none (this one runs --drain live: its own output reads the rings)"
                    .into(),
            );
        }
        Ok(())
    }

    /// `stats`: the live per-CPU counters (docs/design.md, "The control socket").
    fn stats(&mut self) -> LiveStats {
        let nr = self.session.reader().nr_cpus();
        let cpus = (0..nr)
            .map(|cpu| {
                // The engine's account as it stands; R3: the guest's published
                // attempts, read now (a problem seen is kept).
                let acc = self.session.account(cpu);
                let (s, a) = (acc.stats, acc.attempts);
                CpuLive {
                    cpu,
                    running: !self.running.vcpu_finished(cpu),
                    attempted: a.attempted,
                    skipped: a.skipped,
                    attempts_problem: a.problem.map(|p| p.to_string()),
                    // Live from the control block (with --drain none nothing else
                    // refreshes it): events taken in, committed or dropped.
                    written: s.written.max(acc.written),
                    read: s.read,
                    lost: s.lost,
                    overrun: s.overrun,
                    dropped: s.dropped,
                    bytes: s.bytes,
                    pages_touched: s.pages_touched,
                    swaps: s.swaps,
                    error: acc.error,
                }
            })
            .collect();
        LiveStats {
            elapsed_s: self.running.started_at().elapsed().as_secs_f64(),
            stopping: self.stop.clone(),
            subscribed: self.subscribers.claimed(),
            cpus,
        }
    }
}
