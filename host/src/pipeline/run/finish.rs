//! The end of a run: the vCPUs joined, the final walks, the per-CPU accounting, the
//! output finished, the report.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use hyptrace_abi::SharedMem;
use hyptrace_reader::Callbacks;

use crate::drain::session::{HostTraceStats, Session};
use crate::drain::signals::Interrupts;
use crate::pipeline::plan::Plan;
use crate::pipeline::report::{
    CpuReport, Destination, Failures, FilterReport, GuestView, HostEventsStats, RunReport, Stop,
    Timing,
};
use crate::vmm::vcpu::VcpuOutcome;

use super::live::Live;
use super::output::Shown;
use super::RunError;

/// What [`finish_session`] accounts: the vCPUs' reports, the failures, the VMM's ring
/// (`--host-events`) and the host kernel's events (`--host-trace`).
pub(super) type Finished = (
    Vec<CpuReport>,
    Failures,
    Option<HostEventsStats>,
    Option<HostTraceStats>,
);

/// Every vCPU has stopped: the final read-only walks, the per-CPU accounting, the
/// output finished. A second signal meanwhile aborts.
pub(super) fn finish_session<M: SharedMem, C: Callbacks>(
    mut session: Session<M, C>,
    mut failures: Failures,
    interrupts: Option<&Interrupts>,
) -> Result<Finished, RunError> {
    let nr = session.reader().nr_cpus();
    let aborted = || interrupts.is_some_and(Interrupts::aborted);
    for cpu in 0..nr {
        if session.abandon_if(&aborted) {
            return Err(RunError::Aborted);
        }
        if let Err(e) = session.end_cpu_unless(cpu, &aborted) {
            log::debug!("cpu {cpu}: final walk failed: {e}");
            session.fail_cpu(cpu, &e);
            failures.session(Some(cpu), &e);
        }
    }
    if let Err(e) = session.end_host() {
        log::debug!("host events: final walk failed: {e}");
        failures.session(None, &e);
    }
    if session.abandon_if(&aborted) {
        return Err(RunError::Aborted);
    }
    if let Err(e) = session.end_host_trace_unless(&aborted) {
        log::debug!("host trace: final read failed: {e}");
        failures.session(None, &e);
    }
    if session.abandon_if(&aborted) {
        return Err(RunError::Aborted);
    }
    let host_trace = session.host_trace_stats();
    if let Some(e) = host_trace.as_ref().and_then(|h| h.error.clone()) {
        failures.other(format!("host trace: {e}"));
    }
    if let Err(e) = session.flush() {
        failures.session(None, &e);
    }
    if session.abandon_if(&aborted) {
        return Err(RunError::Aborted);
    }
    // The engine's accounts (R1; R3: the attempts published by the guest's writer as it
    // went, whatever the end), as `hyptrace_embed::Tracer::finish` gives them.
    let accounts: Vec<_> = (0..nr).map(|cpu| session.account(cpu)).collect();
    let summary = hyptrace_embed::run_summary(&accounts);
    let page_events = page_events(session.reader().layout());
    let cpus: Vec<CpuReport> = accounts
        .into_iter()
        .map(|a| CpuReport::from_account(a, page_events))
        .collect();
    let host = session.host_stats().map(|s| HostEventsStats {
        lost: s.lost,
        read: s.read,
    });
    let text = session.writes_text();
    if let Err(e) = session.finish(&summary) {
        // An abort during the sink's last writes stopped them (ThreadedSink::cancel_on):
        // nothing was written (the unfinished sink removed its files).
        if aborted() {
            return Err(RunError::Aborted);
        }
        failures.session(None, &e);
    }
    // Text lines go to stdout, whose last writes can block on a pipe nobody reads: an
    // abort that came meanwhile still aborts (exit 130), as it would have during the
    // loop. (A file is complete once its sink finished: it stays, and the run ends as
    // it would have.)
    if text && interrupts.is_some_and(Interrupts::aborted) {
        return Err(RunError::Aborted);
    }
    Ok((cpus, failures, host, host_trace))
}

/// Most events one page of `l` holds: its data area over the smallest record (8 bytes:
/// a header word and the shortest payload).
pub(super) fn page_events(l: &hyptrace_abi::RingGeometry) -> u64 {
    (l.data_capacity() / 8) as u64
}

impl Live<'_> {
    /// After the drain loop: the vCPUs joined, the trace memory file's final state, the
    /// final walks and the accounting of every CPU ([`finish_session`]), the report.
    pub(super) fn conclude(
        self,
        aborted: bool,
        timing: Timing,
        shown: Shown,
        plan: &Plan,
        guest: GuestView,
    ) -> Result<RunReport, RunError> {
        let Live {
            running,
            session,
            stdout,
            stop,
            failures,
            flight,
            clock,
            interrupts,
            events: table,
            ..
        } = self;
        // poll_loop joined the standby drainer, the session's only other owner.
        let session = Arc::into_inner(session)
            .expect("the standby drainer was joined")
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        let outcomes = running.wait();
        if let Some(tm) = &flight.trace_mem {
            let crashed =
                outcomes.iter().any(VcpuOutcome::is_crash) || matches!(stop, Some(Stop::Hang(_)));
            tm.set_state(if crashed {
                crate::flight::trace_mem::STATE_CRASHED
            } else {
                crate::flight::trace_mem::STATE_ENDED
            });
        }
        if aborted {
            // Dropping the session drops the sink: its temporary files go.
            let mut session = session;
            session.abandon_output();
            return Err(RunError::Aborted);
        }
        let (cpus, mut failures, host_events, host_trace) =
            finish_session(session, failures, interrupts)?;
        // L1: a registration refused because the run went on without one fails the run.
        if let Some(late) = table.late_registration() {
            failures.other(late.to_string());
        }
        let destination = match shown {
            Shown::Stdout => Destination::Stdout {
                lines: stdout.lines.load(Ordering::Relaxed),
            },
            Shown::File {
                path,
                format,
                filter,
                page_cache,
            } => Destination::File {
                path,
                format,
                page_cache,
                filter: filter.map(|c| FilterReport {
                    kept: c.kept(),
                    dropped: c.dropped(),
                    unmatched: c.unmatched(),
                }),
            },
            Shown::Sink => Destination::Sink,
        };
        Ok(RunReport {
            outcomes,
            cpus,
            timing,
            stop,
            failures,
            destination,
            echo: plan.echo.clone(),
            mode: plan.mode,
            guest: Some(guest),
            clock: Some(clock.stats()),
            host_events,
            host_trace,
            verbose: log::log_enabled!(log::Level::Info),
        })
    }
}

/// The drain cases the embed library's `Tracer` runs too (one table for both).
#[cfg(test)]
#[path = "../../../../crates/embed/tests/support/drain_cases.rs"]
mod drain_cases;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use hyptrace_abi::layout::RingGeometry;
    use hyptrace_abi::HeapMem;
    use hyptrace_output::Clock;
    use hyptrace_reader::{Direct, RingBuffer};

    use super::drain_cases::{run_cases, Account, DrainPath, Tally};
    use super::finish_session;
    use crate::drain::session::{Output, Session};
    use crate::pipeline::report::Failures;

    /// The CLI's path: the run loop's rounds (`Session::service`, the vCPUs running) and
    /// the run's end (`finish_session`: the final walks, the accounts, the reports).
    struct Cli(Session<Arc<HeapMem>, Direct<Arc<HeapMem>>>);

    impl DrainPath for Cli {
        fn new(mem: Arc<HeapMem>, geometry: RingGeometry, sink: Tally) -> Self {
            let cb = Direct::new(mem.clone(), geometry);
            let rb = RingBuffer::alloc(mem, geometry, cb, 1_000_000, 1).expect("alloc");
            Self(Session::new(
                rb,
                Output::Pages(Box::new(sink)),
                Clock::nanoseconds(),
            ))
        }
        fn drain(&mut self) {
            // Bounded: every round reads what is committed, the writers do not run now.
            loop {
                let _ = self.0.service(|_| false);
                if !self.0.backlog() {
                    break;
                }
            }
        }
        fn finish(self) -> Vec<Account> {
            let (cpus, _, _, _) =
                finish_session(self.0, Failures::default(), None).expect("finish");
            cpus.into_iter()
                .map(|r| Account {
                    written: r.written,
                    balanced: r.consistent(),
                    error: r.error.is_some(),
                    stats: r.stats,
                })
                .collect()
        }
    }

    #[test]
    fn cli_drain_runs_the_shared_cases() {
        run_cases::<Cli>();
    }
}
