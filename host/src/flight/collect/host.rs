//! `collect --host-trace EVENTS`: the host kernel's events, once, as one more part of
//! the trace (the buffer instance [`HOST_PART`]). The instance and its reader thread are
//! `record --host-trace`'s ([`crate::drain::host_trace`]), on the trace clock `mono`: the
//! kernel's pages carry CLOCK_MONOTONIC ns, the time line every collected VM is on
//! (docs/design.md "Collecting several VMs", M4). No pid filter: the VMs' vCPU threads
//! are other processes'.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use hyptrace_output::{
    Clock, EventFormat, KernelCpuStat, OutputError, OutputTarget, PageSink, RunSummary, TraceMeta,
};

use crate::drain::host_trace::{
    Fed, FinalRead, HostCpuLoss, HostTally, HostTrace, HostTraceFeed, FINAL_READ_POLL,
};
use crate::drain::sink::Format;
use crate::exit::chain;

use super::COLLECT_CLOCK;

/// The host part's instance name (a VM may not have it when `--host-trace` is given).
pub const HOST_PART: &str = "host";

/// What the host part read.
#[derive(Debug, Default)]
pub struct HostOutcome {
    /// Per host CPU: events read, lost (the counts the kernel's pages carry).
    pub tally: HostTally,
    /// The kernel's own loss counters per CPU (`per_cpu/cpuN/stats`).
    pub kernel: Vec<HostCpuLoss>,
    /// Why the host part is incomplete (recording or writing failed); what was read
    /// before is in the part.
    pub failed: Option<String>,
    /// Whether its part was written (it has one to add).
    pub has_part: bool,
    /// Why its part was left out of the trace.
    pub left_out: Option<OutputError>,
    /// The comms of the host's tasks (`saved_cmdlines`), for the file's command lines.
    pub cmdlines: Vec<(i32, String)>,
}

impl HostOutcome {
    /// Whether the host part is complete: read without error and in the trace.
    pub fn complete(&self) -> bool {
        self.failed.is_none() && self.left_out.is_none()
    }

    /// Its accounting lines, as a VM's ([`super::CollectReport::lines`]).
    pub fn lines(&self, interrupted: bool) -> Vec<String> {
        let mut v = Vec::new();
        for (cpu, (read, lost)) in self.tally.cpus.iter().enumerate() {
            v.push(format!(
                "{HOST_PART}: cpu {cpu}: {read} events read, {lost} lost"
            ));
        }
        let read = self
            .tally
            .cpus
            .iter()
            .fold(0u64, |a, c| a.saturating_add(c.0));
        let (overrun, dropped) = self.kernel.iter().fold((0u64, 0u64), |(o, d), k| {
            (o.saturating_add(k.overrun), d.saturating_add(k.dropped))
        });
        let state = if self.complete() && !interrupted {
            "complete"
        } else {
            "INCOMPLETE"
        };
        v.push(format!(
            "{HOST_PART}: {read} events read, {} lost, {} pages after an uncounted loss (kernel: {overrun} overrun, {dropped} dropped): {state}",
            self.tally.lost(),
            self.tally.lost_pages_unknown
        ));
        if let Some(e) = &self.failed {
            v.push(format!("{HOST_PART}: error: {e}"));
        }
        if let Some(e) = &self.left_out {
            v.push(format!(
                "{HOST_PART}: error: left out of the trace: {}",
                chain(e)
            ));
        }
        v
    }
}

/// The host kernel's events being recorded.
pub struct HostRecording {
    feed: HostTraceFeed,
    formats: Vec<EventFormat>,
    page_size: usize,
}

/// Starts recording the host kernel's events (before the VMs are subscribed to, so
/// their whole time is covered), in pages of the kernel's size.
pub fn start(trace: HostTrace) -> Result<HostRecording, String> {
    let formats = trace.formats();
    let page_size = trace.kernel_page();
    // `mono` (prepared so): the TSC pair is not used.
    trace
        .start(0, page_size, (0, 0))
        .map(|feed| HostRecording {
            feed,
            formats,
            page_size,
        })
        .map_err(|e| chain(&e))
}

/// The host part's sink: a single-buffer trace.dat v7 (zstd, as the VMs' parts), clock
/// `mono` in ns with no conversion, the host events' formats only, no command lines (the
/// file's are its top level's: the host's comms go there, [`HostOutcome::cmdlines`]).
fn open_part(
    part: &Path,
    page_size: usize,
    nr_cpus: u32,
    formats: &[EventFormat],
) -> Result<Box<dyn PageSink + Send>, OutputError> {
    let target = OutputTarget::check(part)?;
    let clock = Clock {
        name: COLLECT_CLOCK.into(),
        ..Clock::nanoseconds()
    };
    let mut meta = TraceMeta::guest(page_size, nr_cpus, clock);
    meta.cmdlines.clear();
    // The host events' formats only: a part of host kernel formats holds host CPUs,
    // which a JSON or Perfetto output names as such (`BufferSet::sink_meta`).
    meta.formats = formats.to_vec();
    crate::drain::sink::make_sink(
        &target,
        Format::Dat,
        hyptrace_output::Compression::Zstd,
        meta,
    )
}

/// One item of the feed into the part; quiet notes are for live mergers (the part is
/// merged by time once complete).
fn take(item: Fed, tally: &mut HostTally, sink: &mut dyn PageSink) -> Result<(), OutputError> {
    match item {
        Fed::Quiet { .. } => Ok(()),
        Fed::Page { cpu, page, events } => {
            let missed = tally.page(cpu, &page, events);
            sink.page(cpu, &page, missed)
        }
    }
}

/// Takes the feed's pages into the part until `done` (every VM's thread ended) or a
/// stop, then stops recording and takes the rest (bounded: the thread gives up after
/// `FINAL_READ_MAX`). The feed is dropped at the end: the instance is removed (H1).
pub fn follow_host(
    rec: HostRecording,
    part: &Path,
    done: &AtomicBool,
    stop: &(dyn Fn() -> bool + Sync),
) -> HostOutcome {
    let HostRecording {
        feed,
        formats,
        page_size,
    } = rec;
    let mut out = HostOutcome {
        tally: HostTally::new(feed.nr_cpus()),
        ..HostOutcome::default()
    };
    let mut sink = match open_part(part, page_size, feed.nr_cpus(), &formats) {
        Ok(s) => s,
        Err(e) => {
            out.failed = Some(format!("{}: {}", part.display(), chain(&e)));
            return out;
        }
    };
    let r = pump(&feed, &mut out.tally, sink.as_mut(), done, stop);
    out.kernel = feed.kernel_losses();
    out.cmdlines = feed.saved_cmdlines();
    let summary = RunSummary {
        cpus: out
            .tally
            .cpus
            .iter()
            .zip(&out.kernel)
            .map(|(&(read, lost), k)| KernelCpuStat {
                overrun: k.overrun,
                dropped_events: lost,
                read_events: read,
                ..KernelCpuStat::default()
            })
            .collect(),
    };
    let finished = r.and_then(|()| sink.finish(&summary).map_err(|e| chain(&e)));
    out.has_part = true;
    out.failed = finished.err().or_else(|| feed.error());
    out
}

/// The reading itself: live until `done` or a stop, then the final read.
fn pump(
    feed: &HostTraceFeed,
    tally: &mut HostTally,
    sink: &mut dyn PageSink,
    done: &AtomicBool,
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<(), String> {
    let write = |e: OutputError| format!("writing the host part: {}", chain(&e));
    let mut stopped = false;
    // Bounded: ends when the VMs' threads end (each bounded by its VMM or a stop), when
    // a stop is asked for, or when the reader thread ends (a failure); then the final
    // read, which the thread bounds by FINAL_READ_MAX.
    loop {
        if !stopped && (done.load(Ordering::Acquire) || stop()) {
            feed.stop();
            stopped = true;
        }
        match feed.next_final(FINAL_READ_POLL) {
            FinalRead::Item(item) => take(item, tally, sink).map_err(write)?,
            FinalRead::Waiting => {}
            FinalRead::Done => return Ok(()),
        }
    }
}
