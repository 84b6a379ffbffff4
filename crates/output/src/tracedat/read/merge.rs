//! The records of all CPUs of a trace.dat merged by time with the one [`Merger`],
//! pulled one item at a time: each CPU has its next unit (drop marker + event, or a bad
//! page) queued, and only the CPU whose item was just taken is read again, so an item
//! costs O(log CPUs), not a look at every CPU.

use crate::merge::{Merged, Merger};
use crate::DatError;

use super::records::{CpuCursor, Slot, TraceItem, TraceRecord};
use super::{Damage, TraceFile};

impl TraceFile {
    /// Events (and drop markers) of all CPUs of every buffer (the top level and the
    /// [`TraceFile::instances`]) merged by timestamp, ties to the lower CPU (across
    /// buffers: the earlier buffer), as trace-cmd orders them (the one [`Merger`] of `run` and the text sink, pulled one
    /// item at a time: it holds the next record or two of each CPU). Pull items with
    /// [`Records::next_item`]; a read error (I/O, a corrupt compressed chunk) ends the
    /// items and is then in [`Records::error`].
    pub fn records(&self) -> Records<'_> {
        self.records_of(|_| true)
    }

    /// [`TraceFile::records`] of the CPUs `want` accepts (by CPU number, in every
    /// buffer); the others' pages are not read.
    pub fn records_of(&self, want: impl Fn(u32) -> bool) -> Records<'_> {
        self.records_where(|_, cpu| want(cpu))
    }

    /// [`TraceFile::records`] of the CPUs `want` accepts by buffer
    /// ([`TraceRecord::instance`]) and CPU number; the others' pages are not read.
    pub fn records_where(&self, want: impl Fn(u16, u32) -> bool) -> Records<'_> {
        let readers = self.readers();
        let mut cpus: Vec<CpuCursor> = self
            .buffers()
            .flat_map(|(i, cpus)| cpus.iter().map(move |b| (i, b)))
            .filter(|(i, b)| want(*i, b.cpu))
            .map(|(i, b)| CpuCursor::new(self, b, i, readers))
            .collect();
        // Ties: the top level first, then the instances in file order (trace-cmd's
        // order of its handles), in a buffer the lower CPU.
        cpus.sort_by_key(|c| (c.instance, c.cpu));
        Records {
            merger: Merger::new(cpus.len()),
            // Filled in CPU order (popped from the end).
            to_fill: (0..cpus.len()).rev().collect(),
            cpus,
            scratch: Vec::with_capacity(2),
            error: None,
            damage: Vec::new(),
            _file: std::marker::PhantomData,
        }
    }
}

/// The merged events of a [`TraceFile`], pulled one at a time with
/// [`Records::next_item`] (each item borrows the CPU's current page).
pub struct Records<'a> {
    cpus: Vec<CpuCursor>,
    /// Holds the next unit (drop marker + event, or a bad page) of every CPU not done.
    merger: Merger<Slot>,
    /// The CPUs (indexes) whose next unit is to be read before the next item: all of
    /// them at first, then the one whose unit was just taken whole.
    to_fill: Vec<usize>,
    scratch: Vec<Slot>,
    error: Option<DatError>,
    /// Damage the CPUs' readers found, not taken yet.
    damage: Vec<Damage>,
    _file: std::marker::PhantomData<&'a TraceFile>,
}

impl Records<'_> {
    /// The next item in merged order; `None` at the end or after a read error
    /// ([`Records::error`]).
    pub fn next_item(&mut self) -> Option<TraceItem<'_>> {
        if self.error.is_some() {
            return None;
        }
        // Bounded: the CPUs waiting for a fill, each filled once.
        while let Some(i) = self.to_fill.pop() {
            let c = &mut self.cpus[i];
            let r = c.fill(&mut self.scratch);
            self.damage.append(&mut c.pages.damage);
            match r {
                Ok(Some(key)) => {
                    while let Some(slot) = self.scratch.pop() {
                        self.merger.push(i, key, Merged::Event(slot));
                    }
                }
                Ok(None) => self.merger.finish(i),
                Err(e) => {
                    self.error = Some(e);
                    return None;
                }
            }
        }
        // Every CPU not done has its next unit queued: the oldest is always released.
        let (i, _, m) = self.merger.next_ready()?;
        if self.merger.queued(i) == 0 {
            // Read after the caller is done with this item (it borrows the page).
            self.to_fill.push(i);
        }
        let c = &self.cpus[i];
        Some(match m {
            Merged::Event(Slot::Event {
                ts_raw,
                ts_ns,
                start,
                len,
            }) => TraceItem::Event(TraceRecord {
                cpu: c.cpu,
                instance: c.instance,
                ts_raw,
                ts_ns,
                // In range: decode_record checked it against the page's data area
                // (or, for an event running past the commit, the whole page).
                payload: &c.pages.page()[start..start + len],
            }),
            Merged::Event(Slot::Dropped(missed)) => TraceItem::Dropped {
                cpu: c.cpu,
                instance: c.instance,
                missed,
            },
            Merged::Event(Slot::Bad { page, error }) => TraceItem::BadPage {
                cpu: c.cpu,
                instance: c.instance,
                page,
                error,
            },
            Merged::Lost(missed) => TraceItem::Dropped {
                cpu: c.cpu,
                instance: c.instance,
                missed,
            },
        })
    }

    /// The read error that ended the items, if any.
    pub fn error(&self) -> Option<&DatError> {
        self.error.as_ref()
    }

    /// Takes the read error that ended the items, if any.
    pub fn take_error(&mut self) -> Option<DatError> {
        self.error.take()
    }

    /// Takes the damage the CPUs' readers went past since the last call (a chunk
    /// skipped, data cut short; docs/output.md "Damaged files"). Each item pulled
    /// reads at most a chunk of one CPU: taken after every item, this stays small.
    pub fn take_damage(&mut self) -> Vec<Damage> {
        std::mem::take(&mut self.damage)
    }
}
