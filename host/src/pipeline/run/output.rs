//! Where a run's events go: text lines merged on stdout (counted, a closed stdout
//! ends the run quietly) or a page sink.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hyptrace_output::{
    Clock, EventFormat, OutputError, QuietStdout, TargetKind, ThreadedSink, TraceMeta,
};

use crate::drain::host_trace::HostTraceFeed;
use crate::drain::session::Output;
use crate::drain::signals::Interrupts;
use crate::drain::sink::{behind_filters, make_sink, Filters, Format};
use crate::pipeline::plan::Plan;
use hyptrace_output::tracedat::FilterCounts;
use hyptrace_output::tracedat::PageSource;

use super::{RunError, Target};

/// What the report says of where the events went.
pub(super) enum Shown {
    Stdout,
    File {
        path: PathBuf,
        format: Format,
        /// `-F`: what the filters kept and dropped.
        filter: Option<Arc<FilterCounts>>,
        /// A regular file written through the page cache.
        page_cache: bool,
    },
    Sink,
}

/// The output of a run: text lines merged on stdout, or a page sink.
pub(super) fn open_output(
    target: Target,
    plan: &Plan,
    clock: &Clock,
    stdout: &Arc<StdoutState>,
    formats: &[EventFormat],
    host_trace: Option<&(HostTraceFeed, Vec<EventFormat>)>,
    interrupts: Option<&'static Interrupts>,
) -> Result<(Output, Shown), RunError> {
    let (ring, nr, host_events) = (&plan.ring, plan.cfg.vcpus, plan.host_events);
    // `--host-events`: one more CPU, the VMM's (comm `vmm`, system `vmm`).
    let meta = || {
        let mut m = TraceMeta {
            formats: formats.to_vec(),
            ..TraceMeta::guest(ring.page_size, nr, clock.clone())
        };
        if host_events {
            m.nr_cpus = nr + 1;
            m.cmdlines
                .insert(hyptrace_abi::events::vcpu_pid(nr), "vmm".into());
            m.formats.extend(crate::vmm::host_events::formats());
        }
        // `--host-trace`: the host CPUs after those, the vCPU threads named.
        if let Some((feed, hformats)) = host_trace {
            m.nr_cpus += feed.nr_cpus();
            m.formats.extend(hformats.iter().cloned());
            for &(v, tid) in feed.tids() {
                m.cmdlines.insert(tid, format!("vcpu{v}"));
            }
        }
        m
    };
    let text_cpus = nr + u32::from(host_events) + host_trace.map_or(0, |(feed, _)| feed.nr_cpus());
    match target {
        Target::Sink(sink) => Ok((Output::Pages(sink), Shown::Sink)),
        Target::MakeSink(make) => {
            let meta = meta();
            let sink = make(meta).map_err(RunError::MakeSink)?;
            Ok((Output::Pages(sink), Shown::Sink))
        }
        Target::ClickHouse {
            url,
            client,
            filters,
        } => clickhouse(&url, client, &filters, meta(), interrupts),
        Target::Stdout => Ok((
            Output::text(
                Box::new(std::io::BufWriter::with_capacity(
                    1 << 16,
                    CountedStdout {
                        out: QuietStdout::default(),
                        state: Arc::clone(stdout),
                    },
                )),
                text_cpus,
            ),
            Shown::Stdout,
        )),
        Target::File {
            target,
            path,
            format,
            compression,
            filters,
        } => {
            let meta = meta();
            let page_cache = target.kind() == TargetKind::File && !target.is_direct_io();
            // Checked against the events the guest registered, before the file exists.
            let filters = Filters::compile(&filters, &meta)?;
            // The file is written on its own thread (ThreadedSink): a stalled write(2)
            // costs queue space there, not the reader's time at the rings.
            // A second Ctrl-C stops the sink thread (and a reader waiting for it) at once.
            let abort = move || interrupts.is_some_and(Interrupts::aborted);
            let mut filter = None;
            match make_sink(&target, format, compression, meta)
                .and_then(|s| {
                    let (s, counts) = behind_filters(s, filters, PageSource::Ring);
                    filter = counts;
                    ThreadedSink::new(s)
                })
                .map(|t| t.cancel_on(abort))
            {
                Ok(sink) => Ok((
                    Output::Pages(Box::new(sink)),
                    Shown::File {
                        path,
                        format,
                        filter,
                        page_cache,
                    },
                )),
                // A signal ended the wait for a FIFO's reader: nothing can be written.
                Err(OutputError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::Interrupted =>
                {
                    note!(
                        "hyptrace: no reader opened {} before the signal",
                        path.display()
                    );
                    Err(RunError::Aborted)
                }
                Err(source) => Err(RunError::Sink { path, source }),
            }
        }
    }
}

/// The ClickHouse sink ([`hyptrace_clickhouse::ClickHouseSink`]) behind the filters,
/// on its own thread (a slow or absent server back-pressures through the bounded
/// [`ThreadedSink`] queue: the rings fill, stop mode counts its drops).
fn clickhouse(
    url: &hyptrace_clickhouse::ClickHouseUrl,
    client: hyptrace_clickhouse::Client,
    filters: &[String],
    meta: TraceMeta,
    interrupts: Option<&'static Interrupts>,
) -> Result<(Output, Shown), RunError> {
    use hyptrace_clickhouse::{ClickHouseSink, Options, RunIdentity};
    let filters = Filters::compile(filters, &meta)?;
    let who = RunIdentity::new(url.vm.as_deref());
    log::info!("ClickHouse run {} (vm {})", who.run, who.vm);
    let abort = move || interrupts.is_some_and(Interrupts::aborted);
    let sink = ClickHouseSink::new(client, &url.database, who, meta, Options::default())
        .and_then(|s| {
            // A second Ctrl-C also ends a batch's retries (else up to 60 s).
            let s = s.cancel_on(abort);
            let (s, _) = behind_filters(Box::new(s), filters, PageSource::Ring);
            ThreadedSink::new(s)
        })
        .map_err(RunError::MakeSink)?;
    Ok((Output::Pages(Box::new(sink.cancel_on(abort))), Shown::Sink))
}

/// Stdout for `run`, through the output crate's [`QuietStdout`]: a reader that went
/// away (`| head`) ends the run quietly. After the first EPIPE every write is accepted
/// and discarded, so the run keeps reading (the accounting stays exact) while it stops;
/// [`hyptrace_output::stdout_closed`] tells the run loop. Counts the lines that did
/// reach stdout.
#[derive(Debug, Default)]
pub(super) struct StdoutState {
    pub(super) lines: AtomicU64,
}

pub(super) struct CountedStdout {
    pub(super) out: QuietStdout,
    pub(super) state: Arc<StdoutState>,
}

impl Write for CountedStdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let was_closed = hyptrace_output::stdout_closed();
        let n = self.out.write(buf)?;
        if was_closed {
            return Ok(n);
        }
        if hyptrace_output::stdout_closed() {
            log::debug!("stdout closed by its reader");
        } else {
            let nl = buf[..n].iter().filter(|&&b| b == b'\n').count() as u64;
            self.state.lines.fetch_add(nl, Ordering::Relaxed);
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}
