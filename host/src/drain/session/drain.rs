//! Reading the guest's rings: one bounded round per CPU while it runs, the final walk
//! once its vCPU stopped, failures and aborts.

use std::time::{Duration, Instant};

use hyptrace_abi::SharedMem;
use hyptrace_embed::Phase;
use hyptrace_output::{Clock, Merged, Missed, OutputError};
use hyptrace_reader::{Callbacks, CpuStats, Item, ReadError, RingBuffer};

use super::print::merge_event;
use super::{
    CpuRun, Output, Session, SessionError, POKE_EVERY, ROUND_MAX_BYTES, ROUND_MAX_EVENTS,
    ROUND_MAX_TIME,
};

impl<M: SharedMem, C: Callbacks> Session<M, C> {
    /// One poll of a live CPU: one bounded drain round (swapping pages away from the
    /// writer), then a poke (update_footers) if the last one is [`POKE_EVERY`] old.
    pub fn poll(&mut self, cpu: u32) -> Result<(), SessionError> {
        // A CPU in its final walk is read by the walk only (its writer stopped).
        if !self.reads.polls(cpu) {
            return Ok(());
        }
        let before = log::log_enabled!(log::Level::Debug).then(|| self.reader.stats(cpu));
        // Drain first (swaps), then poke: with the mailbox, one request is in flight
        // per CPU at a time, and a page swap matters more than refreshed stats.
        let r = self.drain(cpu).and_then(|more| {
            self.cpus[cpu as usize].more = more;
            let st = &mut self.cpus[cpu as usize];
            if self.reader.request_in_flight(cpu) {
                log::trace!("cpu {cpu}: mailbox request pending, no poke this round");
                Ok(())
            } else if st.poked.is_some_and(|t| t.elapsed() < POKE_EVERY) {
                // The adaptive loop polls a busy CPU every few microseconds; the footer
                // stats need no such rate (and with the mailbox each poke is a request
                // the next swap would wait behind).
                Ok(())
            } else {
                st.poked = Some(Instant::now());
                self.reader
                    .poke(cpu)
                    .map(|_| ())
                    .map_err(SessionError::from)
            }
        });
        if let Some(b) = before {
            self.log_poll(cpu, &b);
        }
        match r {
            // The guest writer finished (mailbox mode): nothing more to ask it; the rest
            // is read by `end_cpu` once its vCPU has stopped.
            Err(SessionError::Read(ReadError::WriterStopped { .. })) => {
                log::debug!("cpu {cpu}: the guest writer finished; the rest is read read-only");
                self.cpus[cpu as usize].more = false;
                Ok(())
            }
            Err(e @ SessionError::Read(ReadError::MailboxTimeout { .. })) => {
                log::debug!("cpu {cpu}: {e}");
                Err(e)
            }
            r => r,
        }
    }

    /// Logs what one poll of `cpu` did (`before`: its counters before): swaps and
    /// events at trace level; swaps lost to the writer (contended, retried at the next
    /// poll) at debug level.
    fn log_poll(&self, cpu: u32, before: &CpuStats) {
        let now = self.reader.stats(cpu);
        log::trace!(
            "cpu {cpu}: poll: {} swaps, {} events read, {} lost{}",
            now.swaps.saturating_sub(before.swaps),
            now.read.saturating_sub(before.read),
            now.lost.saturating_sub(before.lost),
            if self.cpus[cpu as usize].more {
                " (round bound reached: more to read)"
            } else {
                ""
            }
        );
        let contended = now.contended.saturating_sub(before.contended);
        if contended > 0 {
            log::debug!(
                "cpu {cpu}: {contended} swap(s) lost every retry to the writer (contended; {} so far)",
                now.contended
            );
        }
    }

    /// The writer of `cpu` has stopped (finished, crashed or stopped): switch to the
    /// read-only walk of what is left and read it all (in bounded rounds, printing
    /// between them). Never swaps. Runs once per CPU: later calls return `Ok`. Whatever
    /// fails, the CPU is marked finished in the merger afterwards, so one CPU's failure
    /// never holds back the other CPUs' output; the error is recorded
    /// ([`Session::error`]) and returned.
    pub fn end_cpu(&mut self, cpu: u32) -> Result<(), SessionError> {
        self.end_cpu_unless(cpu, &|| false)
    }

    /// [`Session::end_cpu`], its walk cut short between rounds once `abort()` holds
    /// (a second Ctrl-C: the output is dropped anyway, so reading on is wasted time).
    /// With a subscriber (C1) the walk goes into the outbox as far as it takes pieces,
    /// then the CPU's end: the CPU ends when the subscriber acknowledges that
    /// ([`Session::ack`]), or — should it leave first — when this session's own output
    /// took the rest ([`Session::end_cpu`] again, after it left).
    pub fn end_cpu_unless(
        &mut self,
        cpu: u32,
        abort: &dyn Fn() -> bool,
    ) -> Result<(), SessionError> {
        if !self.is_live(cpu) || (self.subscriber.is_some() && self.outbox.ended(cpu)) {
            return Ok(());
        }
        let mut r = match self.final_walk(cpu, abort) {
            // The subscriber has pieces to take first.
            Ok(false) => return Ok(()),
            Ok(true) => Ok(()),
            Err(e) => Err(e),
        };
        let trailing = self.reads.trailing_loss(&mut self.reader, cpu);
        let st = &mut self.cpus[cpu as usize];
        let lost = std::mem::take(&mut st.pending_lost).saturating_add(trailing);
        if self.subscriber.is_some() && r.is_ok() {
            self.outbox.end(cpu, lost);
            return Ok(());
        }
        self.mark_ended(cpu);
        let ns = self.cpus[cpu as usize].last_ns;
        if let Err(e) = end_in_output(&mut self.output, cpu, ns, lost) {
            r = r.and(Err(SessionError::Sink(e)));
        }
        if let Err(e) = &r {
            self.fail_cpu(cpu, e);
        }
        r
    }

    /// The read-only walk of what is left of `cpu` (started once: the writer stopped),
    /// in bounded rounds with the output flushed between them. Returns whether it is
    /// complete: not while a subscriber has the outbox full (it takes pieces first).
    fn final_walk(&mut self, cpu: u32, abort: &dyn Fn() -> bool) -> Result<bool, SessionError> {
        if self.reads.phase(cpu) == Phase::Live {
            log::debug!("cpu {cpu}: final read-only walk");
        }
        self.reads.begin_walk(&mut self.reader, cpu)?;
        // Bounded: the walk covers the pages left in the ring, each round consumes at
        // least one item of them or ends the walk.
        while !abort() && self.drain(cpu)? {
            // Print between rounds (the merger's cap bounds what waits); an output
            // error is kept and reported by the caller's own flush.
            let _ = self.flush();
        }
        // (Seeded bug `end_too_early`, docs/fuzzing.md: the walk ends while it waits.)
        Ok(self.subscriber.is_none()
            || !self.outbox.full(cpu)
            || hyptrace_reader::seeded::on("end_too_early"))
    }

    /// The run is aborted: the page sink stops writing at once (what it queued is
    /// not written); dropped next, it leaves no output file.
    pub fn abandon_output(&mut self) {
        if let Output::Pages(sink) = &mut self.output {
            sink.abandon();
        }
    }

    /// Whether `aborted()` holds; if so the output is abandoned
    /// ([`Session::abandon_output`]), for the caller to return at once.
    pub fn abandon_if(&mut self, aborted: &dyn Fn() -> bool) -> bool {
        let a = aborted();
        if a {
            self.abandon_output();
        }
        a
    }

    /// Records the first error seen on `cpu` (reported by [`Session::error`]).
    pub fn fail_cpu(&mut self, cpu: u32, e: &SessionError) {
        self.reads.record(cpu, || crate::exit::chain(e));
    }

    /// One round over the CPUs not yet ended: a CPU whose vCPU has stopped
    /// (`vcpu_stopped`) gets the final read-only walk, the others one bounded poll. A
    /// mailbox request that timed out because its vCPU stopped meanwhile is no error:
    /// that CPU gets the final walk instead. A CPU whose live read failed is not polled
    /// again; it is walked once its vCPU has stopped. Returns each CPU's first failure
    /// once (later failures of the same CPU are recorded nowhere else), for the caller
    /// to report.
    pub fn service(&mut self, vcpu_stopped: impl Fn(u32) -> bool) -> Vec<(u32, SessionError)> {
        let mut failed = std::mem::take(&mut self.deferred);
        for cpu in 0..self.reader.nr_cpus() {
            if !self.reads.is_live(cpu) {
                continue;
            }
            let had_error = self.reads.error(cpu).is_some();
            let r = if vcpu_stopped(cpu) {
                self.end_cpu(cpu)
            } else if self.reads.failed(cpu) || !self.reads_live() {
                continue;
            } else {
                match self.poll(cpu) {
                    Err(SessionError::Read(ReadError::MailboxTimeout { .. }))
                        if vcpu_stopped(cpu) =>
                    {
                        self.end_cpu(cpu)
                    }
                    Err(e) => {
                        self.poll_failed(cpu, &e);
                        Err(e)
                    }
                    Ok(()) => Ok(()),
                }
            };
            if let Err(e) = r {
                if !had_error {
                    failed.push((cpu, e));
                }
            }
        }
        if let Some(e) = self.service_host() {
            let cpu = self.reader.nr_cpus();
            failed.push((cpu, e));
        }
        if let Some(e) = self.service_host_trace() {
            failed.push((self.reader.nr_cpus(), e));
        }
        failed
    }

    /// A live read of `cpu` failed: it is not polled again, and the error is recorded.
    fn poll_failed(&mut self, cpu: u32, e: &SessionError) {
        self.reads.fail(cpu, crate::exit::chain(e));
    }

    /// The standby drainer's turn ([`crate::drain::standby`]), taken while the drain loop is
    /// late: polls every CPU that is still read live until it is caught up (no round
    /// stopped at its bound) or `budget` is spent, then prints what is ready. Never
    /// ends a CPU (final walks stay with the drain loop, which knows which vCPUs
    /// stopped) and never reads the VMM's own ring. A failure is recorded as
    /// [`Session::service`] records it and returned by the next `service`, except a
    /// mailbox timeout: that one the drain loop meets again at its next poll, where it
    /// can tell a stopped vCPU from a stuck writer. Returns the rounds it drained.
    pub fn relieve(&mut self, budget: Duration) -> u64 {
        if !self.reads_live() {
            return 0;
        }
        let started = Instant::now();
        let mut rounds = 0u64;
        for cpu in 0..self.reader.nr_cpus() {
            // Bounded: each poll is a bounded round, and the loop ends at the budget.
            loop {
                if !self.reads.polls(cpu) {
                    break;
                }
                rounds += 1;
                match self.poll(cpu) {
                    Ok(()) => {}
                    Err(SessionError::Read(ReadError::MailboxTimeout { .. })) => break,
                    Err(e) => {
                        self.poll_failed(cpu, &e);
                        self.deferred.push((cpu, e));
                        break;
                    }
                }
                if !self.cpus[cpu as usize].more || started.elapsed() >= budget {
                    break;
                }
            }
        }
        if let Err(e) = self.flush() {
            self.deferred_output = Some(e);
        }
        rounds
    }

    /// One bounded round of reading `cpu` into the output: returns whether it stopped
    /// at a bound (more may be there) rather than because nothing more is committed.
    fn drain(&mut self, cpu: u32) -> Result<bool, SessionError> {
        if let Some(partial) = self.subscriber {
            return self.drain_pieces(cpu, partial);
        }
        // C1: what a subscriber left goes out first, in order.
        self.output_outbox(cpu)?;
        drain_ring(
            &mut self.reader,
            cpu,
            cpu,
            &mut self.cpus[cpu as usize],
            &mut self.output,
            &self.clock,
        )
    }
}

/// The end of CPU `cpu` in `output`, whatever ended it: the `lost` events after its last
/// one read (at its time `last_ns`) and, in text, the CPU finished in the merger, so that
/// it never holds the other CPUs' output back.
pub(super) fn end_in_output(
    output: &mut Output,
    cpu: u32,
    last_ns: u64,
    lost: u64,
) -> Result<(), OutputError> {
    match output {
        Output::Text { merger, .. } => {
            if lost > 0 {
                merger.push(cpu as usize, last_ns, Merged::Lost(Missed::Count(lost)));
            }
            merger.finish(cpu as usize);
            Ok(())
        }
        Output::Pages(sink) if lost > 0 => sink.trailing_lost(cpu, lost),
        Output::Pages(_) => Ok(()),
    }
}

/// The index the reading of `cpu` starts at (P2: nothing below it is ours to print).
pub(super) fn reader_start<M: SharedMem, C: Callbacks>(reader: &RingBuffer<M, C>, cpu: u32) -> u64 {
    reader.position(cpu).map_or(0, |p| p.expected)
}

/// One bounded round of reading CPU `rcpu` of `reader` into `output` as CPU `cpu`:
/// returns whether it stopped at a bound (more may be there) rather than because
/// nothing more is committed. The guest's rings (`rcpu == cpu`) and the VMM's own ring
/// (`--host-events`: its CPU 0 is the output's CPU `nr_vcpus`) go through here.
pub(super) fn drain_ring<M: SharedMem, C: Callbacks>(
    reader: &mut RingBuffer<M, C>,
    rcpu: u32,
    cpu: u32,
    st: &mut CpuRun,
    output: &mut Output,
    clock: &Clock,
) -> Result<bool, SessionError> {
    let started = std::time::Instant::now();
    match output {
        Output::Text {
            merger, payloads, ..
        } => {
            let fifo = &mut payloads[cpu as usize];
            for n in 0..ROUND_MAX_EVENTS {
                if merger.is_full() || (n % 256 == 255 && started.elapsed() >= ROUND_MAX_TIME) {
                    return Ok(true);
                }
                let Some(item) = reader.next_event(rcpu)? else {
                    return Ok(false);
                };
                match item {
                    Item::Event { ts, payload } => {
                        merge_event(merger, fifo, st, cpu, clock.to_ns(ts), payload);
                    }
                    Item::Lost(n) => st.pending_lost = st.pending_lost.saturating_add(n),
                }
            }
            Ok(true)
        }
        Output::Pages(sink) => hyptrace_embed::drain_pages(
            reader,
            rcpu,
            cpu,
            sink.as_mut(),
            ROUND_MAX_BYTES,
            ROUND_MAX_TIME,
        )
        .map_err(|e| match e {
            hyptrace_embed::DrainError::Read(e) => SessionError::Read(e),
            hyptrace_embed::DrainError::Sink(e) => SessionError::Sink(e),
        }),
    }
}
