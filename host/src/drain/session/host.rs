//! The host's own rings in a session: the VMM's ring (`--host-events`) and the host
//! kernel's events (`--host-trace`), read beside the guest's CPUs.

use std::sync::Arc;

use hyptrace_abi::SharedMem;
use hyptrace_embed::CpuReads;
use hyptrace_output::{Clock, EventFormat, EventPrinter};
use hyptrace_reader::{Callbacks, CpuStats};

use crate::drain::host_trace::{Fed, FinalRead, HostTally, HostTraceFeed, FINAL_READ_POLL};

use super::drain::{drain_ring, end_in_output};
use super::print::text_page;
use super::{CpuRun, Output, Session, SessionError};

/// The VMM's ring in a session (see [`crate::vmm::host_events`]).
pub(super) struct HostCpu {
    pub(super) reader: crate::vmm::host_events::HostReader,
    pub(super) events: Arc<crate::vmm::host_events::HostEvents>,
    /// Where its reading stands (the engine's state machine, one CPU).
    pub(super) reads: CpuReads<String>,
    pub(super) run: CpuRun,
    /// Its CPU number in the output (the guest's CPU count).
    pub(super) cpu: u32,
}

/// The host kernel's CPUs in a session (`--host-trace`, [`crate::drain::host_trace`]).
pub(super) struct HostTraceCpus {
    pub(super) feed: HostTraceFeed,
    /// The output CPU of host CPU 0.
    pub(super) first: u32,
    /// What its pages carried and say was lost.
    pub(super) tally: HostTally,
    pub(super) ended: bool,
}

/// What `--host-trace` read and lost (`--stats` `host_trace`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostTraceStats {
    /// Host CPUs recorded.
    pub cpus: u32,
    /// The output CPU of host CPU 0.
    pub first_cpu: u32,
    /// Pages read from `trace_pipe_raw`.
    pub pages: u64,
    /// Events in them.
    pub events: u64,
    /// Events lost, as the pages' lost-events counts say.
    pub lost: u64,
    /// Pages flagged as after a loss whose count the kernel did not store.
    pub lost_pages_unknown: u64,
    /// The kernel's `overrun` (all CPUs, `per_cpu/cpuN/stats`).
    pub overrun: u64,
    /// The kernel's `dropped events` (all CPUs).
    pub dropped: u64,
    /// The vCPU threads' tids the filter named (empty: `--host-trace-all`).
    pub vcpu_threads: Vec<i32>,
    /// The reader thread's failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl HostTraceCpus {
    /// One item of the reader thread into the output.
    fn take(&mut self, item: Fed, output: &mut Output, clock: &Clock) -> Result<(), SessionError> {
        match item {
            Fed::Quiet { cpu, tsc } => match output {
                Output::Text { merger, .. } => {
                    merger.advance((self.first + cpu) as usize, clock.to_ns(tsc));
                    Ok(())
                }
                Output::Pages(sink) => Ok(sink.quiet(self.first + cpu, tsc)?),
            },
            Fed::Page { cpu, page, events } => {
                let out = self.first + cpu;
                let missed = self.tally.page(cpu, &page, events);
                match output {
                    Output::Pages(sink) => Ok(sink.page(out, &page, missed)?),
                    Output::Text {
                        merger, payloads, ..
                    } => {
                        text_page(
                            merger,
                            &mut payloads[out as usize],
                            out,
                            &page,
                            missed,
                            clock,
                        );
                        Ok(())
                    }
                }
            }
        }
    }
}

impl<M: SharedMem, C: Callbacks> Session<M, C> {
    /// Adds the VMM's ring (`--host-events`) as CPU `nr_cpus` of the output (comm
    /// `vmm`, formats of [`crate::vmm::host_events::formats`]). A text output must have been
    /// made for `nr_cpus + 1` CPUs ([`Output::text`]).
    pub fn with_host_events(
        mut self,
        reader: crate::vmm::host_events::HostReader,
        events: Arc<crate::vmm::host_events::HostEvents>,
    ) -> Self {
        let cpu = self.reader.nr_cpus();
        self.cmdlines.insert(events.pid(), "vmm".into());
        for f in crate::vmm::host_events::formats() {
            self.printers.insert(f.id, EventPrinter::new(f));
        }
        self.host = Some(HostCpu {
            reader,
            events,
            reads: CpuReads::new(1),
            run: CpuRun::default(),
            cpu,
        });
        self
    }

    /// One bounded round over the VMM's ring; a text output's merger then knows no
    /// VMM event older than the watermark taken before the round is still to come.
    pub(super) fn service_host(&mut self) -> Option<SessionError> {
        let h = self.host.as_mut()?;
        if !h.reads.polls(0) {
            return None;
        }
        let mark = h.events.watermark();
        let r = drain_ring(
            &mut h.reader,
            0,
            h.cpu,
            &mut h.run,
            &mut self.output,
            &self.clock,
        )
        .and_then(|more| {
            h.run.more = more;
            h.reader.poke(0).map(|_| ()).map_err(SessionError::from)
        });
        match r {
            Ok(()) => {
                if let (false, Output::Text { merger, .. }) = (h.run.more, &mut self.output) {
                    merger.advance(h.cpu as usize, self.clock.to_ns(mark));
                }
                None
            }
            Err(e) => {
                h.reads.fail(0, crate::exit::chain(&e));
                Some(e)
            }
        }
    }

    /// Ends the VMM's ring (after every vCPU stopped): no more events, the rest read.
    pub fn end_host(&mut self) -> Result<(), SessionError> {
        let Some(h) = self.host.as_mut() else {
            return Ok(());
        };
        if !h.reads.is_live(0) {
            return Ok(());
        }
        h.events.finish();
        let (mut r, trailing) = h.reads.walk_with(&mut h.reader, 0, |reader| {
            drain_ring(reader, 0, h.cpu, &mut h.run, &mut self.output, &self.clock)
        });
        let lost = std::mem::take(&mut h.run.pending_lost).saturating_add(trailing);
        if let Err(e) = end_in_output(&mut self.output, h.cpu, h.run.last_ns, lost) {
            r = r.and(Err(SessionError::Sink(e)));
        }
        r
    }

    /// Adds the host kernel's CPUs (`--host-trace`) as CPUs `first..first + n` of the
    /// output, printed with `formats` (renumbered ids, H2); the vCPU threads' tids get
    /// their `vcpuN` names. A text output must have been made for all of them.
    pub fn with_host_trace(
        mut self,
        feed: HostTraceFeed,
        first: u32,
        formats: &[EventFormat],
    ) -> Self {
        for f in formats {
            self.printers.insert(f.id, EventPrinter::new(f.clone()));
        }
        for &(v, tid) in feed.tids() {
            self.cmdlines.insert(tid, format!("vcpu{v}"));
        }
        self.host_trace = Some(HostTraceCpus {
            tally: HostTally::new(feed.nr_cpus()),
            feed,
            first,
            ended: false,
        });
        self
    }

    /// Takes the pages the host trace's reader thread has read (bounded per round).
    pub(super) fn service_host_trace(&mut self) -> Option<SessionError> {
        let h = self.host_trace.as_mut()?;
        if h.ended {
            return None;
        }
        for _ in 0..crate::drain::host_trace::FEED_PAGES {
            let item = h.feed.try_next()?;
            if let Err(e) = h.take(item, &mut self.output, &self.clock) {
                return Some(e);
            }
        }
        None
    }

    /// Stops the host trace and takes everything its thread still reads (after every
    /// vCPU stopped). Bounded: the kernel's rings are finite and recording is off, and
    /// the thread gives up after [`crate::drain::host_trace::FINAL_READ_MAX`]. Gives up
    /// within [`FINAL_READ_POLL`] once `abort()` says so (a second Ctrl-C: the thread
    /// is told to leave the rest unread).
    pub fn end_host_trace_unless(&mut self, abort: &dyn Fn() -> bool) -> Result<(), SessionError> {
        let Some(h) = self.host_trace.as_mut() else {
            return Ok(());
        };
        if h.ended {
            return Ok(());
        }
        h.ended = true;
        h.feed.stop();
        let mut r = Ok(());
        loop {
            if abort() {
                h.feed.abandon();
                return r;
            }
            match h.feed.next_final(FINAL_READ_POLL) {
                FinalRead::Item(item) => {
                    if let Err(e) = h.take(item, &mut self.output, &self.clock) {
                        r = r.and(Err(e));
                    }
                }
                FinalRead::Waiting => {}
                FinalRead::Done => break,
            }
        }
        if let Output::Text { merger, .. } = &mut self.output {
            for c in 0..h.feed.nr_cpus() {
                merger.finish((h.first + c) as usize);
            }
        }
        r
    }

    /// What the host trace read and lost (`--host-trace`), if any.
    pub fn host_trace_stats(&self) -> Option<HostTraceStats> {
        let h = self.host_trace.as_ref()?;
        let (pages, events) = h.feed.read();
        let kernel = h.feed.kernel_losses();
        Some(HostTraceStats {
            cpus: h.feed.nr_cpus(),
            first_cpu: h.first,
            pages,
            events,
            lost: h.tally.lost(),
            lost_pages_unknown: h.tally.lost_pages_unknown,
            overrun: kernel.iter().map(|k| k.overrun).sum(),
            dropped: kernel.iter().map(|k| k.dropped).sum(),
            vcpu_threads: h.feed.tids().iter().map(|&(_, t)| t).collect(),
            error: h.feed.error(),
        })
    }

    /// Events read from the VMM's ring and lost there (`--host-events`), if any.
    pub fn host_stats(&self) -> Option<CpuStats> {
        self.host.as_ref().map(|h| h.reader.stats(0))
    }
}
