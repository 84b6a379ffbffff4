//! A run while its vCPUs run: the poll loop, the standby drainer, the control
//! socket's commands between rounds and the stop policy.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::control::consumer::SUBSCRIBER_GRACE;
use crate::control::handler::{note_unsent, RunControl};
use crate::control::server::ControlServer;
use crate::drain::clock::HostClock;
use crate::drain::priority::{thread_cpu_time, ReaderPriority};
use crate::drain::session::{Session, MIN_POLL};
use crate::drain::signals::Interrupts;
use crate::drain::standby::Standby;
use crate::pipeline::report::{Failures, ReaderTimes, Stop};
use crate::vmm::registration::VmEventTable;
use crate::vmm::vm::RunningVm;

use super::flight::{record_positions, update_meta, Flight};
use super::heartbeat::Heartbeat;
use super::output::StdoutState;

/// A run while its vCPUs run: the poll loop and the stop policy.
pub(super) struct Live<'a> {
    pub(super) running: RunningVm,
    /// Shared with the standby drainer (invariant D1: one drainer at a time, under
    /// this lock); the loop's own uses lock it for a moment each.
    pub(super) session: Arc<Mutex<Session>>,
    pub(super) flight: Flight,
    pub(super) stdout: Arc<StdoutState>,
    pub(super) interrupts: Option<&'a Interrupts>,
    pub(super) heartbeat: Option<Heartbeat>,
    pub(super) deadline: Option<Instant>,
    pub(super) stop: Option<Stop>,
    pub(super) failures: Failures,
    pub(super) nr: u32,
    pub(super) control: Option<&'a ControlServer>,
    pub(super) events: VmEventTable,
    pub(super) clock: HostClock,
}

impl Live<'_> {
    /// Polls every `poll` until every vCPU has stopped and been read; returns whether a
    /// second signal aborted the run.
    ///
    /// Adaptive: the wait between rounds is [`Session::next_wait`] (`poll` while the
    /// writers are idle, down to continuous draining while one outpaces the reader), and
    /// the thread runs with a scheduling advantage ([`ReaderPriority`]) for the loop's
    /// length. Returns also what the loop measured of itself ([`ReaderTimes`]).
    pub(super) fn poll_loop(&mut self, poll: Duration) -> (bool, ReaderTimes) {
        // A command on the control socket ends the wait: served at once, not at the
        // next poll (an idle run sleeps its whole `--poll-ms`).
        if let Some(c) = self.control {
            let w = self.running.waker();
            c.set_waker(Some(Box::new(move || w.wake())));
        }
        let mut priority = ReaderPriority::raise();
        let standby = self.start_standby(poll);
        // Rounds in a row that found every writer idle: after IDLE_ROUNDS the boost is
        // given back (cheaper wake-ups) until a writer writes again.
        const IDLE_ROUNDS: u32 = 16;
        let mut idle_rounds = 0u32;
        let cpu0 = thread_cpu_time();
        let mut rounds = 0u64;
        // The longest round (service + control + clock) and the longest wait beyond what
        // was asked for (the thread waiting for a core): where a stall came from.
        let (mut longest_round, mut longest_late) = (Duration::ZERO, Duration::ZERO);
        let aborted = loop {
            rounds += 1;
            let wait = {
                let mut s = locked(&self.session);
                let wait = s.next_wait(poll);
                if let Some(b) = &standby {
                    b.beat(Instant::now(), wait, s.fill_time());
                }
                wait
            };
            idle_rounds = if wait >= poll {
                idle_rounds.saturating_add(1)
            } else {
                0
            };
            priority.set_active(idle_rounds < IDLE_ROUNDS);
            let waited = Instant::now();
            let all_done = self.running.wait_timeout(wait);
            let round = Instant::now();
            let late = round.saturating_duration_since(waited + wait);
            longest_late = longest_late.max(late);
            if let Some(b) = &standby {
                b.woke(round, late);
            }
            if self.interrupts.is_some_and(Interrupts::aborted) {
                log::info!("aborted by a second signal");
                self.running.stop();
                break true;
            }
            self.check_stop();
            self.service();
            self.serve_control();
            self.clock.recheck(false);
            if let Some(h) = &mut self.heartbeat {
                h.tick(&locked(&self.session), self.nr, self.running.started_at());
            }
            longest_round = longest_round.max(round.elapsed());
            if all_done && {
                let s = locked(&self.session);
                (0..self.nr).all(|c| !s.is_live(c))
            } {
                break false;
            }
            if all_done {
                // Every vCPU said it is done but a thread has not exited yet (its CPU is
                // read once it has): wait_timeout no longer sleeps, so sleep here — a
                // real-time reader spinning would keep that thread off its core.
                std::thread::sleep(MIN_POLL);
            }
        };
        if let Some(h) = &mut self.heartbeat {
            h.end();
        }
        if let Some(c) = self.control {
            c.set_waker(None);
        }
        let used = thread_cpu_time().saturating_sub(cpu0);
        let standby = standby.map(Standby::stop);
        let output_waits = locked(&self.session).output_waits();
        drop(priority);
        let wall = self.running.started_at().elapsed();
        log_reader_thread(
            rounds,
            used,
            wall,
            (longest_round, longest_late),
            &output_waits,
            standby.as_ref(),
        );
        let l = *locked(&self.session).reader().layout();
        (
            aborted,
            ReaderTimes {
                live: self.flight.drain_live,
                cpu: used,
                longest_late,
                longest_round,
                output_waits,
                buffer_kb: u64::from(l.pages_per_cpu) * l.page_size as u64 / 1024,
                ring_bytes: u64::from(l.pages_per_cpu.saturating_sub(1)) * l.data_capacity() as u64,
                standby: standby.unwrap_or_default(),
            },
        )
    }

    /// The standby drainer of this loop (`crate::drain::standby`), with live draining on at
    /// least two CPUs: it drains while the loop is late, and records the reader
    /// positions in the trace memory file after each turn, as the loop does after its
    /// rounds. It holds off while any vCPU crashed or ended or a stop was asked for.
    fn start_standby(&self, poll: Duration) -> Option<Standby> {
        if !self.flight.drain_live || !Standby::wanted() {
            return None;
        }
        let watch = self.running.watch();
        let tm = self.flight.trace_mem.clone();
        let nr = self.nr;
        let relieve = move |s: &mut Session| {
            let rounds = s.relieve(crate::drain::standby::TURN_BUDGET);
            if let Some(tm) = &tm {
                record_positions(s, tm, nr);
            }
            rounds
        };
        let hold = move || !watch.all_running();
        match Standby::start(Arc::clone(&self.session), poll, relieve, hold) {
            Ok(s) => Some(s),
            Err(e) => {
                log::info!("standby drainer: not started ({e}); the reader thread drains alone");
                None
            }
        }
    }

    /// Executes the control socket's waiting commands.
    fn serve_control(&mut self) {
        let Some(control) = self.control else { return };
        let mut session = locked(&self.session);
        let mut h = RunControl {
            session: &mut session,
            running: &self.running,
            events: self.events.as_ref(),
            stop: self.stop.as_ref().map(ToString::to_string),
            subscribers: &mut self.flight.subscribers,
            meta: &self.flight.run_meta,
            drain_live: self.flight.drain_live,
            hold: !self.flight.dumped && self.running.any_crashed(),
        };
        control.serve(&mut h);
    }

    /// C4's bound: a subscriber that asked for nothing [`SUBSCRIBER_GRACE`] after every
    /// vCPU stopped loses the claim (the run must end); this session's own output then
    /// takes the rest.
    fn end_claim_if_late(&mut self) {
        let all_done = (0..self.nr).all(|c| self.running.vcpu_finished(c));
        let mut session = locked(&self.session);
        let late = self
            .flight
            .subscribers
            .end_if_late(&mut session, all_done, Instant::now());
        if let Some(unsent) = late {
            note!(
                "hyptrace: warning: the subscriber asked for nothing within {} s of the vCPUs' end: the VMM writes the rest itself",
                SUBSCRIBER_GRACE.as_secs()
            );
            note_unsent(&unsent, "stopped asking");
        }
    }

    /// Stops the vCPUs for the first reason that came up, once.
    fn stop_for(&mut self, why: Stop) {
        if self.stop.is_none() {
            log::info!("stopping the vCPUs: {why}");
            self.stop = Some(why);
            self.running.stop();
        }
    }

    /// A signal, `--duration`, a crash or a closed stdout stops the run.
    fn check_stop(&mut self) {
        if self.stop.is_some() {
            // A crash after the run was stopped for another reason is still dumped
            // (service holds the rings until then).
            if !self.flight.dumped && self.running.any_crashed() {
                self.crash_dump();
            }
            return;
        }
        let signal = self.interrupts.filter(|i| i.stop_requested());
        let why = if let Some(i) = signal {
            Some(Stop::Signal(i.signal_name()))
        } else if self.deadline.is_some_and(|d| Instant::now() >= d) {
            Some(Stop::Duration)
        } else if self.running.any_crashed() {
            Some(Stop::Crash)
        } else if let Some(t) = self.hung() {
            Some(Stop::Hang(t))
        } else if hyptrace_output::stdout_closed() {
            Some(Stop::StdoutClosed)
        } else {
            None
        };
        if let Some(why) = why {
            let crash = matches!(why, Stop::Crash | Stop::Hang(_));
            self.stop_for(why);
            if crash {
                self.crash_dump();
            }
        }
    }

    /// Records every CPU's reader position in the trace memory file, and with `--drain
    /// none` its meta page's writer counters (live attach).
    fn record_positions(&mut self) {
        if let Some(tm) = &self.flight.trace_mem {
            let session = locked(&self.session);
            record_positions(&session, tm, self.nr);
            if !self.flight.drain_live {
                for c in 0..self.nr {
                    update_meta(&session, tm, &mut self.flight.meta, c);
                }
            }
        }
    }

    /// One round over the CPUs and a flush of the output; a failure stops the run.
    fn service(&mut self) {
        self.end_claim_if_late();
        let running = &self.running;
        // A crash not yet dumped: nothing is consumed before the dump (check_stop
        // takes it at the next round). A vCPU that crashed after check_stop looked is
        // polled, not walked, until then.
        let hold = !self.flight.dumped;
        if hold && running.any_crashed() {
            return;
        }
        let stopped = |c| running.vcpu_finished(c) && !(hold && running.any_crashed());
        let failed = locked(&self.session).service(stopped);
        self.record_positions();
        for (cpu, e) in failed {
            log::debug!("cpu {cpu}: {e}");
            self.failures.session(Some(cpu), &e);
            self.stop_for(Stop::Failed(if e.is_output() {
                "output failed".into()
            } else {
                format!("reading vcpu {cpu} failed")
            }));
        }
        let flushed = locked(&self.session).flush();
        if let Err(e) = flushed {
            self.failures.session(None, &e);
            self.stop_for(Stop::Failed("output failed".into()));
        }
    }
}

/// The run's session, locked: the drain loop's and the control socket's uses, each for
/// a moment (invariant D1). A panic elsewhere while holding it fails the run anyway.
pub(super) fn locked(session: &Mutex<Session>) -> MutexGuard<'_, Session> {
    session.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the drain loop's thread measured of itself, at debug level (`-vv`).
pub(super) fn log_reader_thread(
    rounds: u64,
    used: Duration,
    wall: Duration,
    (longest_round, longest_late): (Duration, Duration),
    output_waits: &hyptrace_output::OutputWaits,
    standby: Option<&crate::drain::standby::StandbyTimes>,
) {
    log::debug!(
        "reader thread: {rounds} rounds, {:.1} ms CPU in {:.1} ms ({:.2} % of a core); longest round {:.3} ms, longest late wake-up {:.3} ms",
        used.as_secs_f64() * 1e3,
        wall.as_secs_f64() * 1e3,
        100.0 * used.as_secs_f64() / wall.as_secs_f64().max(1e-9),
        longest_round.as_secs_f64() * 1e3,
        longest_late.as_secs_f64() * 1e3,
    );
    if output_waits.count > 0 {
        log::debug!(
            "reader thread: waited for the output {} times, {:.1} ms in all, longest {:.3} ms",
            output_waits.count,
            output_waits.total.as_secs_f64() * 1e3,
            output_waits.longest.as_secs_f64() * 1e3,
        );
    }
    if let Some(s) = standby {
        log::debug!(
            "standby drainer: took over {} times while the reader thread was late ({} drain rounds), {:.1} ms CPU",
            s.turns,
            s.rounds,
            s.cpu.as_secs_f64() * 1e3
        );
    }
}
