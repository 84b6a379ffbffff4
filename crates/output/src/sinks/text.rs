//! The text sink: `trace-cmd report -t` lines, merged across CPUs.

use crate::error::PageProblem;
use std::collections::BTreeMap;

use super::merged::{queue_line, release_merged, Piece};
use super::stream::{page_events, StreamOut, StreamSink};
use crate::export::{export_page_into, page_missed, Missed};
use crate::merge::{MergeWindow, Merger};
use crate::sink::{PageSink, RunSummary, TraceMeta};
use crate::text::{format_drop, format_guest_line, format_window_exceeded, EventPrinter};
use crate::OutputError;

/// Text sink: `cpus=N`, then every event as `trace-cmd report -t` prints it, merged
/// across CPUs by time (ties: lower CPU first), each page's drop marker right before
/// its first event — with the one [`Merger`] of `hyptrace run` and `report`: pages of
/// one CPU arrive in time order, so a line is written once every CPU that may still
/// deliver pages has delivered one at or after its time; the rest at `finish`. Memory is
/// bounded by [`MergeWindow::DEFAULT`] (lines, and their bytes): a CPU that delivers no
/// page never holds the others' lines beyond it — past it, the line
/// [`crate::format_window_exceeded`] and the oldest lines down to half the window are
/// written, as `hyptrace run` does.
pub struct TextSink {
    meta: TraceMeta,
    printers: BTreeMap<u16, EventPrinter>,
    out: Option<StreamOut>,
    scratch: Vec<u8>,
    /// Formatted lines waiting for the watermark (each with its newline).
    merger: Merger<String>,
    /// Where released lines are gathered before a write.
    buf: String,
}

impl TextSink {
    /// Writes, in time order, every queued line the merger releases (all of them when
    /// `all`), and the window marker if it is exceeded.
    fn release(&mut self, all: bool) -> Result<(), OutputError> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        release_merged(
            &mut self.merger,
            out,
            &mut self.buf,
            all,
            |buf, piece| match piece {
                Piece::Item { text, .. } => buf.push_str(text),
                Piece::WindowExceeded { held, lagging } => {
                    format_window_exceeded(buf, held, lagging);
                    buf.push('\n');
                }
            },
        )
    }
}

/// Text: `cpus=N`, then the lines.
impl StreamSink for TextSink {
    fn from_output(mut out: StreamOut, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        meta.check_one_vm("the text sink")?;
        out.write_all(format!("cpus={}\n", meta.nr_cpus).as_bytes())?;
        let printers = meta
            .formats
            .iter()
            .map(|f| (f.id, EventPrinter::new(f.clone())))
            .collect();
        let n = meta.nr_cpus as usize;
        Ok(Self {
            scratch: vec![0; meta.page_size],
            meta,
            printers,
            out: Some(out),
            merger: Merger::with_window(n, MergeWindow::DEFAULT),
            buf: String::new(),
        })
    }
}

impl PageSink for TextSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        self.meta.check_page(cpu, page)?;
        export_page_into(cpu, page, missed, &mut self.scratch)?;
        let missed = page_missed(&self.scratch);
        let (_, events, _err) = page_events(&self.scratch);
        if self.out.is_none() {
            return Ok(());
        }
        let c = cpu as usize;
        if missed != Missed::None {
            let mut s = String::new();
            format_drop(&mut s, cpu, missed);
            s.push('\n');
            // The marker goes right before the page's first event (same time, same CPU).
            let t = events
                .first()
                .map_or(self.merger.last(c).unwrap_or(0), |e| {
                    self.meta.clock.to_ns(e.0)
                });
            queue_line(&mut self.merger, c, t, s);
        }
        for (ts, payload) in events {
            let mut s = String::new();
            let ns = self.meta.clock.to_ns(ts);
            format_guest_line(
                &mut s,
                &self.printers,
                &self.meta.cmdlines,
                cpu,
                ns,
                payload,
            );
            s.push('\n');
            queue_line(&mut self.merger, c, ns, s);
        }
        if self.merger.last(c).is_none() {
            // A page without events still tells that this CPU delivers.
            self.merger.advance(c, 0);
        }
        self.release(false)
    }

    /// Lines of other CPUs up to `ts` no longer wait for `cpu`.
    fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
        if self.out.is_none() || cpu >= self.meta.nr_cpus {
            return Ok(());
        }
        self.merger.advance(cpu as usize, self.meta.clock.to_ns(ts));
        self.release(false)
    }

    /// A `CPU:N [lost EVENTS DROPPED]` line after the CPU's last event.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        if cpu >= self.meta.nr_cpus {
            return Err(OutputError::BadPage {
                cpu,
                problem: PageProblem::NoSuchCpu {
                    cpu,
                    nr_cpus: self.meta.nr_cpus,
                },
            });
        }
        if lost == 0 || self.out.is_none() {
            return Ok(());
        }
        let c = cpu as usize;
        let mut s = String::new();
        format_drop(&mut s, cpu, Missed::Count(lost));
        s.push('\n');
        let t = self.merger.last(c).unwrap_or(0);
        queue_line(&mut self.merger, c, t, s);
        self.release(false)
    }

    fn finish(mut self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        self.release(true)?;
        match self.out.take() {
            Some(o) => o.close(),
            None => Ok(()),
        }
    }
}
