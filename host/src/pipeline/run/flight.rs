//! The flight recorder state of a run: the trace memory file's reader positions and
//! meta pages (`--trace-mem`), the crash dump's target, the live-attach subscriber.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyptrace_output::{Clock, EventFormat, OutputTarget};

use crate::control::consumer::{RunMeta, Subscribers};
use crate::drain::session::Session;
use crate::drain::sink::Format;
use crate::flight::trace_mem::TraceMemFile;
use crate::pipeline::plan::Plan;

/// The flight recorder state of a run.
pub(super) struct Flight {
    /// `--trace-mem`.
    pub(super) trace_mem: Option<Arc<TraceMemFile>>,
    /// `--hang-timeout`.
    pub(super) hang: Option<HangWatch>,
    /// `--crash-dump`: where, in which format, the path for messages.
    pub(super) dump_target: Option<(OutputTarget, Format, PathBuf)>,
    /// The crash dump was taken (or there was none to take).
    pub(super) dumped: bool,
    /// The guest clock and the event formats (the guest's registrations).
    pub(super) run_meta: RunMeta,
    /// `--drain live` (a subscriber can attach only with `none`).
    pub(super) drain_live: bool,
    /// Per CPU, what its meta page says (written with `--trace-mem`).
    pub(super) meta: Vec<crate::flight::trace_mem::MetaValues>,
    /// The subscriber of live attach (C1–C4).
    pub(super) subscribers: Subscribers,
}

impl Flight {
    /// The flight recorder state of a run of `plan`.
    pub(super) fn new(
        plan: &Plan,
        trace_mem: Option<Arc<TraceMemFile>>,
        crash_dump: Option<OutputTarget>,
        clock: Clock,
        formats: Vec<EventFormat>,
    ) -> Self {
        Flight {
            trace_mem,
            hang: plan.flight.hang_timeout.map(|timeout| HangWatch {
                timeout,
                last: None,
                since: Instant::now(),
            }),
            dump_target: crash_dump.map(|t| {
                let path = plan.flight.crash_dump.clone().unwrap_or_default();
                // Checked before the run (an unknown extension is refused then).
                let format = crate::drain::sink::format_for(None, &path, "--crash-dump")
                    .unwrap_or(crate::drain::sink::Format::Dat);
                (t, format, path)
            }),
            dumped: false,
            run_meta: RunMeta { clock, formats },
            drain_live: plan.flight.drain_live,
            meta: vec![crate::flight::trace_mem::MetaValues::default(); plan.cfg.vcpus as usize],
            subscribers: Subscribers::new(),
        }
    }
}

/// Records every CPU's reader position in the trace memory file (what a dump after a
/// SIGKILL must not emit again).
pub(super) fn record_positions(session: &Session, tm: &TraceMemFile, nr: u32) {
    for c in 0..nr {
        if let Some(p) = session.position(c) {
            tm.record(c, p);
        }
    }
}

/// Refreshes `cpu`'s meta page: the writer's counters from its control block (hostile
/// values, shown as they are), the reader's from the one reader (docs/abi.md).
pub(super) fn update_meta(
    session: &Session,
    tm: &TraceMemFile,
    meta: &mut [crate::flight::trace_mem::MetaValues],
    cpu: u32,
) {
    let Some(m) = meta.get_mut(cpu as usize) else {
        return;
    };
    let reader = session.reader();
    let l = reader.layout();
    let c = l.ctl(cpu);
    let mem = reader.mem();
    use hyptrace_abi::layout::ctl;
    use hyptrace_abi::SharedMem as _;
    m.entries = mem.load(c + ctl::ENTRIES, Ordering::Relaxed);
    m.overrun = mem.load(c + ctl::OVERRUN, Ordering::Relaxed);
    m.pages_touched = mem.load(c + ctl::PAGES_TOUCHED, Ordering::Relaxed);
    let s = reader.stats(cpu);
    if let Some(p) = reader.position(cpu) {
        let id = p.reader.saturating_sub(l.first_page(cpu));
        if id != m.reader_id {
            m.lost_events = s.lost.saturating_sub(m.lost_total);
        }
        m.reader_id = id;
        m.read = p.expected.saturating_sub(s.lost);
    }
    m.lost_total = s.lost;
    tm.write_meta(cpu, m);
}

/// `--hang-timeout`: the last progress seen and since when.
pub(super) struct HangWatch {
    pub(super) timeout: Duration,
    pub(super) last: Option<(u64, usize)>,
    pub(super) since: Instant,
}
