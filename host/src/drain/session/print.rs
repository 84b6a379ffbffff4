//! Text lines: events merged across CPUs in time order, printed when ready, losses
//! and markers between them.

use std::collections::BTreeMap;
use std::io::Write;

use hyptrace_abi::SharedMem;
use hyptrace_output::{
    format_drop, format_guest_line, format_window_exceeded, Clock, EventPrinter, Merged, Merger,
    Missed, Released,
};
use hyptrace_reader::Callbacks;

use super::{CpuRun, Output, Session, SessionError};

impl<M: SharedMem, C: Callbacks> Session<M, C> {
    /// Prints the merged events that are ready (all of them once every CPU ended). If
    /// the merger holds more than its cap ([`MERGE_MAX_EVENTS`](super::MERGE_MAX_EVENTS),
    /// [`MERGE_MAX_BYTES`](super::MERGE_MAX_BYTES)) —
    /// a CPU that neither writes nor ends holds the others back — it prints a marker
    /// line naming that CPU and the oldest events down to half the cap: order across
    /// CPUs is no longer exact from there. Returns the first output error once; after
    /// it, lines are discarded.
    pub fn flush(&mut self) -> Result<(), SessionError> {
        if let Some(e) = self.deferred_output.take() {
            return Err(e);
        }
        // P2: what was consumed may be printed from here on.
        // (Seeded bug, docs/fuzzing.md's flight model: this record left out.)
        if !cfg!(hyptrace_seeded_bug_record_after_print) {
            self.record_positions();
        }
        let r = self.print_ready();
        // P2: and now it is (what the merger released).
        self.record_positions();
        r
    }

    /// Prints what the merger releases; counts it as printed (P2).
    fn print_ready(&mut self) -> Result<(), SessionError> {
        let Output::Text {
            out,
            merger,
            payloads,
        } = &mut self.output
        else {
            return Ok(());
        };
        let mut p = LinePrinter {
            out: out.as_mut(),
            payloads,
            printers: &self.printers,
            cmdlines: &self.cmdlines,
            line: &mut self.line,
            lines: &mut self.lines,
            discard: self.output_error.is_some(),
            err: None,
            payload: Vec::new(),
            printed: &mut self.printed,
        };
        merger.release(|r| match r {
            Released::Item { cpu, ts, item } => p.item(cpu, ts, item),
            Released::WindowExceeded { held, lagging } => {
                let mut line = String::new();
                format_window_exceeded(&mut line, held, lagging);
                line.push('\n');
                p.raw(&line);
            }
        });
        if p.err.is_none() {
            // The lines counted as printed are out of this process (a buffered writer
            // would hold them).
            if let Err(e) = p.out.flush() {
                p.err = Some(e);
            }
        }
        if let Some(e) = p.err.take() {
            self.output_error = Some(crate::exit::chain(&e));
            return Err(SessionError::Write(e));
        }
        Ok(())
    }

    /// Whether the output is text lines (`run`'s stdout) rather than a page sink.
    pub fn writes_text(&self) -> bool {
        matches!(self.output, Output::Text { .. })
    }
}

/// Queues the events of a host kernel page (CPU `cpu` of the output) in the merger.
pub(super) fn text_page(
    merger: &mut Merger<usize>,
    fifo: &mut std::collections::VecDeque<u8>,
    cpu: u32,
    page: &[u8],
    missed: Missed,
    clock: &Clock,
) {
    let Some((ts, commit)) = hyptrace_abi::page::page_header(page) else {
        return;
    };
    let len = (commit & hyptrace_abi::page::COMMIT_LEN_MASK) as usize;
    let end = hyptrace_abi::page::PAGE_HEADER_SIZE
        .saturating_add(len)
        .min(page.len());
    let data = &page[hyptrace_abi::page::PAGE_HEADER_SIZE..end];
    let mut lost = missed.is_loss().then_some(missed);
    for ev in hyptrace_abi::page::Events::new(data, ts) {
        let Ok(ev) = ev else { break };
        let ns = clock.to_ns(ev.ts);
        if let Some(m) = lost.take() {
            merger.push(cpu as usize, ns, Merged::Lost(m));
        }
        fifo.extend(ev.payload);
        let n = ev.payload.len();
        merger.push_sized(cpu as usize, ns, Merged::Event(n), n);
    }
}

/// Queues an event of `cpu` at `ns` in the text merger (its payload in `fifo`), after
/// the losses found before it. Merged by the time a line shows, as trace-cmd orders a
/// trace.dat's events: events of two CPUs in the same nanosecond go lower CPU first,
/// whatever their raw order.
pub(super) fn merge_event(
    merger: &mut Merger<usize>,
    fifo: &mut std::collections::VecDeque<u8>,
    st: &mut CpuRun,
    cpu: u32,
    ns: u64,
    payload: &[u8],
) {
    if st.pending_lost > 0 {
        let lost = std::mem::take(&mut st.pending_lost);
        merger.push(cpu as usize, ns, Merged::Lost(Missed::Count(lost)));
    }
    st.last_ns = ns;
    fifo.extend(payload);
    let n = payload.len();
    merger.push_sized(cpu as usize, ns, Merged::Event(n), n);
}

/// Formats and writes the text lines of one [`Session::flush`].
pub(super) struct LinePrinter<'a> {
    pub(super) out: &'a mut dyn Write,
    pub(super) payloads: &'a mut [std::collections::VecDeque<u8>],
    pub(super) printers: &'a BTreeMap<u16, EventPrinter>,
    pub(super) cmdlines: &'a BTreeMap<i32, String>,
    pub(super) line: &'a mut String,
    pub(super) lines: &'a mut u64,
    /// An earlier flush failed: count lines, write nothing.
    pub(super) discard: bool,
    pub(super) err: Option<std::io::Error>,
    pub(super) payload: Vec<u8>,
    /// Per CPU, the index below which every event was written (P2).
    pub(super) printed: &'a mut [u64],
}

impl LinePrinter<'_> {
    /// Prints the merger's `item` of `cpu` at `ns` (the merger holds display times).
    fn item(&mut self, cpu: usize, ns: u64, item: Merged<usize>) {
        self.line.clear();
        match item {
            Merged::Event(len) => {
                let fifo = &mut self.payloads[cpu];
                let len = len.min(fifo.len());
                self.payload.clear();
                self.payload.extend(fifo.drain(..len));
                format_guest_line(
                    self.line,
                    self.printers,
                    self.cmdlines,
                    cpu as u32,
                    ns,
                    &self.payload,
                )
            }
            Merged::Lost(m) => format_drop(self.line, cpu as u32, m),
        }
        if let Some(p) = self.printed.get_mut(cpu) {
            *p = p.saturating_add(match item {
                Merged::Event(_) => 1,
                // An unknown count adds none: its page is counted apart (HostTally).
                Merged::Lost(m) => m.counted(),
            });
        }
        self.line.push('\n');
        let line = std::mem::take(self.line);
        self.raw(&line);
        *self.line = line;
    }

    fn raw(&mut self, text: &str) {
        *self.lines += 1;
        if !self.discard && self.err.is_none() {
            if let Err(e) = self.out.write_all(text.as_bytes()) {
                self.err = Some(e);
            }
        }
    }
}
