//! `trace-cmd report -t` text of a trace.dat, streamed, with formatting threads.

use std::collections::BTreeSet;
use std::io::Write;

use crate::export::Missed;
use crate::text::{format_drop, format_guest_line};
use crate::OutputError;

use super::filter::{FilterSet, ReportOutcome};
use super::records::{TraceItem, TraceRecord};
use super::{Damage, TraceFile};

/// How many bytes the report collects before writing them out.
pub(super) const WRITE_CHUNK: usize = 64 << 10;

impl TraceFile {
    /// Formats one item the way `trace-cmd report -t` does (no newline). Returns false
    /// for items trace-cmd would not print (bad pages).
    pub fn format_item(&self, out: &mut String, item: &TraceItem<'_>) -> bool {
        match item {
            TraceItem::Dropped { cpu, missed, .. } => {
                format_drop(out, *cpu, *missed);
                true
            }
            TraceItem::BadPage { .. } => false,
            TraceItem::Event(r) => {
                format_guest_line(
                    out,
                    &self.printers,
                    &self.cmdlines,
                    r.cpu,
                    r.ts_ns,
                    r.payload,
                );
                true
            }
        }
    }

    /// [`TraceFile::format_item`] and a newline, the line (if printed) after its
    /// buffer's name as `trace-cmd report` prints a file with buffer instances: the name
    /// right-aligned to the longest and `": "` (the top level: blanks and two spaces);
    /// an event right after its CPU's drop marker has none (trace-cmd prints the two as
    /// one record, the name before the marker). `drop` is the state between calls.
    pub fn format_report_line(
        &self,
        out: &mut String,
        item: &TraceItem<'_>,
        drop: &mut Option<(u16, u32)>,
    ) -> bool {
        let at = match item {
            TraceItem::Event(r) => (r.instance, r.cpu),
            TraceItem::Dropped { instance, cpu, .. } => (*instance, *cpu),
            TraceItem::BadPage { .. } => return false,
        };
        let joined = matches!(item, TraceItem::Event(_)) && *drop == Some(at);
        *drop = matches!(item, TraceItem::Dropped { .. }).then_some(at);
        if !self.instances.is_empty() && !joined {
            let name = self.instance_name(at.0);
            let pad = self.name_width.saturating_sub(name.map_or(0, str::len));
            out.extend(std::iter::repeat_n(' ', pad));
            out.push_str(name.unwrap_or(""));
            out.push_str(if name.is_some() { ": " } else { "  " });
        }
        let printed = self.format_item(out, item);
        if printed {
            out.push('\n');
        }
        printed
    }

    /// Writes the `trace-cmd report -t` text (`cpus=N` then one line per item, as
    /// [`TraceFile::format_item`] formats it) of the items `filter` selects to `out`,
    /// streaming: lines are collected in a small buffer and written out in chunks. With
    /// more than one thread ([`ReportFilter::threads`]), this thread reads and merges
    /// while the others format batches of items, written in order (memory: a few
    /// batches). Returns how many events were printed.
    ///
    /// Damage in the CPU data (see [`TraceFile::write_report_with`]) is read past and
    /// not reported.
    pub fn write_report(
        &self,
        out: &mut dyn Write,
        filter: &ReportFilter,
    ) -> Result<u64, OutputError> {
        self.write_report_with(out, filter, &mut |_| {})
    }

    /// [`TraceFile::write_report`], handing every damaged part of the CPU data that
    /// reading went past (a compressed chunk skipped, data cut short, a page that did not
    /// decode) to `on_damage` when it is found; every readable event is printed.
    pub fn write_report_with(
        &self,
        out: &mut dyn Write,
        filter: &ReportFilter,
        on_damage: &mut dyn FnMut(Damage),
    ) -> Result<u64, OutputError> {
        self.write_report_outcome(out, filter, on_damage)
            .map(|o| o.printed)
    }

    /// [`TraceFile::write_report_with`], returning what the selection matched too (the
    /// `-F` filters that passed nothing, how many events the selected CPUs hold).
    pub fn write_report_outcome(
        &self,
        out: &mut dyn Write,
        filter: &ReportFilter,
        on_damage: &mut dyn FnMut(Damage),
    ) -> Result<ReportOutcome, OutputError> {
        let threads = match filter.threads {
            // The reading thread plus one formatting thread per core: reading takes about
            // a third of the work, so one formatter per core keeps every core busy.
            0 => std::thread::available_parallelism().map_or(1, |n| (n.get() + 1).min(MAX_THREADS)),
            n => n.min(MAX_THREADS),
        };
        let head = format!("cpus={}\n", self.nr_cpus);
        out.write_all(head.as_bytes())?;
        let outcome = if threads <= 1 {
            let mut s = String::with_capacity(WRITE_CHUNK + 4096);
            let mut drop = None;
            let n = self.select(filter, on_damage, |item| {
                self.format_report_line(&mut s, item, &mut drop);
                if s.len() >= WRITE_CHUNK {
                    out.write_all(s.as_bytes())?;
                    s.clear();
                }
                Ok(())
            })?;
            out.write_all(s.as_bytes())?;
            n
        } else {
            std::thread::scope(|sc| {
                let mut p = Pipeline::start(self, sc, threads - 1);
                let n = self.select(filter, on_damage, |item| p.push(item, out))?;
                p.finish(out)?;
                Ok::<ReportOutcome, OutputError>(n)
            })?
        };
        out.flush()?;
        Ok(outcome)
    }

    /// Pulls the items `filter` selects, in order, into `emit`; returns how many events
    /// were selected and what matched (a read error is returned after the items before
    /// it).
    fn select(
        &self,
        filter: &ReportFilter,
        on_damage: &mut dyn FnMut(Damage),
        mut emit: impl FnMut(&TraceItem<'_>) -> Result<(), OutputError>,
    ) -> Result<ReportOutcome, OutputError> {
        let mut filters = FilterSet::compile(&filter.events, &self.formats).map_err(Box::new)?;
        let mut recs = self.records_of(|c| filter.wants_cpu(c));
        let (mut printed, mut read, mut complete) = (0u64, 0u64, true);
        let mut skip = filter.skip;
        // Bounded: every item consumes the CPUs' data.
        loop {
            for d in recs.take_damage() {
                on_damage(d);
            }
            let Some(item) = recs.next_item() else {
                break;
            };
            if let TraceItem::BadPage {
                cpu, page, error, ..
            } = &item
            {
                on_damage(Damage {
                    cpu: Some(*cpu),
                    offset: None,
                    what: format!(
                        "page {page} does not decode ({error}): the rest of it is skipped"
                    ),
                });
            }
            if let TraceItem::Event(r) = &item {
                read += 1;
                if let Some(f) = &mut filters {
                    if !f.wants(r.payload, r.cpu, &self.cmdlines) {
                        continue;
                    }
                }
                if skip > 0 {
                    skip -= 1;
                    continue;
                }
                if filter.limit.is_some_and(|l| printed >= l) {
                    complete = false;
                    break;
                }
                printed += 1;
            } else if skip > 0 {
                continue;
            }
            emit(&item)?;
        }
        for d in recs.take_damage() {
            on_damage(d);
        }
        match recs.take_error() {
            Some(e) => Err(e.into()),
            None => Ok(ReportOutcome {
                printed,
                read,
                complete,
                unmatched: filters.map(|f| f.unmatched()).unwrap_or_default(),
            }),
        }
    }

    /// The whole `trace-cmd report -t` text, in memory (tests; a read error ends it
    /// early: use [`TraceFile::write_report`] to see it).
    pub fn report(&self) -> String {
        let mut v = Vec::new();
        let _ = self.write_report(&mut v, &ReportFilter::default());
        String::from_utf8_lossy(&v).into_owned()
    }
}

/// What `report` prints: CPUs, events (by `-F` filters), how many.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReportFilter {
    /// CPUs to print (`None`: all).
    pub cpus: Option<BTreeSet<u32>>,
    /// Event filters, one per `-F` (empty: all events): trace-cmd's `EVENTS[: EXPR]`
    /// or hyptrace's `SYSTEM:EVENT` globs ([`FilterSet`] has the syntax); an event is
    /// printed when any filter passes it.
    pub events: Vec<String>,
    /// Events (of those selected) to skip first.
    pub skip: u64,
    /// Most events to print.
    pub limit: Option<u64>,
    /// Threads (this one and formatting threads); 0: one per core, at most 8.
    pub threads: usize,
}

/// Most threads `report` uses.
pub(super) const MAX_THREADS: usize = 8;
/// Items per batch handed to a formatting thread (small in unit tests: many batches).
pub(super) const BATCH_ITEMS: usize = if cfg!(test) { 61 } else { 4096 };
/// Payload bytes per batch (a batch is sent when it holds this much, whatever the
/// item count: big pages with big events do not make big batches).
pub(super) const BATCH_BYTES: usize = 1 << 20;

/// An item copied out of its page for a formatting thread.
pub(super) enum BatchItem {
    Event {
        cpu: u32,
        instance: u16,
        ts_ns: u64,
        start: usize,
        len: usize,
    },
    Dropped {
        cpu: u32,
        instance: u16,
        missed: Missed,
    },
}

/// Items (their payloads in `bytes`) and, once formatted, their text.
#[derive(Default)]
pub(super) struct Batch {
    items: Vec<BatchItem>,
    bytes: Vec<u8>,
    text: String,
}

impl Batch {
    fn format(&mut self, f: &TraceFile) {
        self.text.clear();
        // A batch never ends with a drop marker (see `Pipeline::push`): its event is in
        // the same batch.
        let mut drop = None;
        for it in &self.items {
            let item = match *it {
                BatchItem::Event {
                    cpu,
                    instance,
                    ts_ns,
                    start,
                    len,
                } => TraceItem::Event(TraceRecord {
                    cpu,
                    instance,
                    ts_raw: 0,
                    ts_ns,
                    payload: self.bytes.get(start..start + len).unwrap_or_default(),
                }),
                BatchItem::Dropped {
                    cpu,
                    instance,
                    missed,
                } => TraceItem::Dropped {
                    cpu,
                    instance,
                    missed,
                },
            };
            f.format_report_line(&mut self.text, &item, &mut drop);
        }
    }
}

/// Formatting threads fed batches round-robin; their texts are taken back in the same
/// order, so the output keeps the merged order. At most two batches per thread are in
/// flight.
pub(super) struct Pipeline {
    to: Vec<std::sync::mpsc::Sender<Batch>>,
    from: Vec<std::sync::mpsc::Receiver<Batch>>,
    sent: usize,
    written: usize,
    cur: Batch,
    spare: Vec<Batch>,
}

impl Pipeline {
    fn start<'s, 'e: 's>(
        f: &'e TraceFile,
        sc: &'s std::thread::Scope<'s, 'e>,
        workers: usize,
    ) -> Self {
        let workers = workers.max(1);
        let (mut to, mut from) = (Vec::new(), Vec::new());
        for _ in 0..workers {
            let (tx, rx) = std::sync::mpsc::channel::<Batch>();
            let (rtx, rrx) = std::sync::mpsc::channel::<Batch>();
            sc.spawn(move || {
                // Ends when the pipeline drops its sender (or stops taking results).
                for mut b in rx {
                    b.format(f);
                    if rtx.send(b).is_err() {
                        break;
                    }
                }
            });
            to.push(tx);
            from.push(rrx);
        }
        Self {
            to,
            from,
            sent: 0,
            written: 0,
            cur: Batch::default(),
            spare: Vec::new(),
        }
    }

    fn push(&mut self, item: &TraceItem<'_>, out: &mut dyn Write) -> Result<(), OutputError> {
        match item {
            TraceItem::Event(r) => {
                let start = self.cur.bytes.len();
                self.cur.bytes.extend_from_slice(r.payload);
                self.cur.items.push(BatchItem::Event {
                    cpu: r.cpu,
                    instance: r.instance,
                    ts_ns: r.ts_ns,
                    start,
                    len: r.payload.len(),
                });
            }
            TraceItem::Dropped {
                cpu,
                instance,
                missed,
            } => self.cur.items.push(BatchItem::Dropped {
                cpu: *cpu,
                instance: *instance,
                missed: *missed,
            }),
            TraceItem::BadPage { .. } => {}
        }
        let full = self.cur.items.len() >= BATCH_ITEMS || self.cur.bytes.len() >= BATCH_BYTES;
        // A drop marker stays with the event after it (one line prefix for both).
        if full && !matches!(item, TraceItem::Dropped { .. }) {
            self.send(out)?;
        }
        Ok(())
    }

    fn send(&mut self, out: &mut dyn Write) -> Result<(), OutputError> {
        if self.sent - self.written >= 2 * self.to.len() {
            self.write_one(out)?;
        }
        let mut next = self.spare.pop().unwrap_or_default();
        next.items.clear();
        next.bytes.clear();
        let b = std::mem::replace(&mut self.cur, next);
        self.to[self.sent % self.to.len()]
            .send(b)
            .map_err(|_| OutputError::Closed)?;
        self.sent += 1;
        Ok(())
    }

    /// Writes the oldest batch in flight.
    fn write_one(&mut self, out: &mut dyn Write) -> Result<(), OutputError> {
        let b = self.from[self.written % self.from.len()]
            .recv()
            .map_err(|_| OutputError::Closed)?;
        self.written += 1;
        out.write_all(b.text.as_bytes())?;
        self.spare.push(b);
        Ok(())
    }

    fn finish(mut self, out: &mut dyn Write) -> Result<(), OutputError> {
        if !self.cur.items.is_empty() {
            self.send(out)?;
        }
        while self.written < self.sent {
            self.write_one(out)?;
        }
        Ok(())
    }
}

impl ReportFilter {
    fn wants_cpu(&self, cpu: u32) -> bool {
        self.cpus.as_ref().is_none_or(|s| s.contains(&cpu))
    }
}
