//! Feeding a trace.dat's pages into a sink (`convert`, `collect`): the CPUs merged by
//! page time, or CPU after CPU for a sink that writes each CPU's data in one piece.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::{Clock, OutputError, PageSink, RunSummary, TraceFile, TraceMeta};

/// The metadata a sink needs to write what `f` holds: its formats, cmdlines, clock.
pub fn meta_of(f: &TraceFile) -> TraceMeta {
    TraceMeta {
        page_size: f.page_size,
        nr_cpus: f.nr_cpus,
        cmdlines: f.cmdlines.clone(),
        clock: Clock {
            name: f.clock.clone().unwrap_or_else(|| "local".into()),
            tsc: f.tsc2nsec,
            offset_ns: f.ts_offset,
            map: None,
        },
        formats: f.formats.clone(),
        groups: Vec::new(),
    }
}

/// The pages of CPUs, each with its CPU in the sink.
pub type PageCursors = Vec<(u32, crate::tracedat::CpuPages)>;

/// Feeds every page of `f` into `sink`, the CPUs' pages merged by page time, ties to
/// the lower CPU (each CPU's in file order; a heap of the CPUs' current pages: O(log
/// CPUs) per page; memory: each CPU's read buffer, pages handed over where they lie),
/// then finishes it. Damaged CPU data read past (a chunk skipped, data cut short) goes
/// to `on_damage` when found.
pub fn pump_pages(
    f: &TraceFile,
    sink: Box<dyn PageSink>,
    on_damage: &mut dyn FnMut(crate::tracedat::Damage),
    filtered: bool,
) -> Result<(), OutputError> {
    pump_cursors(cursors_of(f), sink, on_damage, filtered)
}

/// The pages of every CPU of `f`'s top level, each with its CPU.
pub fn cursors_of(f: &TraceFile) -> PageCursors {
    f.all_pages().into_iter().map(|c| (c.cpu(), c)).collect()
}

/// [`pump_pages`] of any CPUs' pages, each given with its CPU in the sink (several
/// buffers' CPUs one after the other: [`crate::TraceMeta::groups`]).
pub fn pump_cursors(
    cursors: PageCursors,
    mut sink: Box<dyn PageSink>,
    on_damage: &mut dyn FnMut(crate::tracedat::Damage),
    filtered: bool,
) -> Result<(), OutputError> {
    let (cpus, mut cursors): (Vec<u32>, Vec<_>) = cursors.into_iter().unzip();
    // (page time, cpu, index) of each CPU's current page, oldest first.
    let mut heads = BinaryHeap::new();
    for (i, c) in cursors.iter_mut().enumerate() {
        if let Some(ts) = next_head(c)? {
            heads.push(Reverse((ts, cpus[i], i)));
        }
        c.take_damage().into_iter().for_each(&mut *on_damage);
    }
    // Bounded: every step consumes a page of some CPU. Stdout closed (`| head`): the
    // rest would be discarded, so stop.
    while let Some(Reverse((_, cpu, i))) = heads.pop() {
        if crate::stdout_closed() {
            break;
        }
        feed_page(sink.as_mut(), cpu, cursors[i].page(), on_damage, filtered)?;
        if let Some(ts) = next_head(&mut cursors[i])? {
            heads.push(Reverse((ts, cpu, i)));
        }
        cursors[i]
            .take_damage()
            .into_iter()
            .for_each(&mut *on_damage);
    }
    sink.finish(&RunSummary::default())
}

/// Hands `page` of `cpu` to `sink`, its losses kept; a page that does not decode is
/// named to `on_damage` and copied as the reader read it ([`page_as_read`]: its
/// records as they are, the commit as trace-cmd takes it), or with `filtered` (-F) cut
/// at the damage.
///
/// [`page_as_read`]: crate::tracedat::page_as_read
fn feed_page(
    sink: &mut dyn PageSink,
    cpu: u32,
    page: &[u8],
    on_damage: &mut dyn FnMut(crate::tracedat::Damage),
    filtered: bool,
) -> Result<(), OutputError> {
    let damage = crate::tracedat::page_damage(page);
    // A damaged page goes with its commit as read (a copy only where that differs).
    let page = match damage {
        Some(_) => crate::tracedat::page_as_read(page),
        None => std::borrow::Cow::Borrowed(page),
    };
    if let Some(why) = damage {
        let rest = if filtered {
            "its events before the damage filtered, the rest left out"
        } else {
            "copied as it is"
        };
        on_damage(crate::tracedat::Damage {
            cpu: Some(cpu),
            offset: None,
            what: format!("a page does not decode ({why}): {rest}"),
        });
    }
    sink.page(cpu, &page, crate::page_missed(&page))
}

/// [`pump_pages`] for a sink that takes each CPU's pages in one piece (trace.dat): CPU
/// after CPU, each one ended ([`PageSink::end_cpu`]) after its last page, so the sink
/// writes every CPU's data straight to its place.
pub fn pump_by_cpu(
    cursors: PageCursors,
    mut sink: Box<dyn PageSink>,
    on_damage: &mut dyn FnMut(crate::tracedat::Damage),
    filtered: bool,
) -> Result<(), OutputError> {
    // Each CPU's reader dropped after its CPU (memory: one CPU's read buffer).
    for (cpu, mut c) in cursors {
        // Bounded: every step consumes a page of the CPU.
        loop {
            if crate::stdout_closed() {
                break;
            }
            let more = match c.next_page()? {
                Some(page) => {
                    feed_page(sink.as_mut(), cpu, page, on_damage, filtered)?;
                    true
                }
                None => false,
            };
            c.take_damage().into_iter().for_each(&mut *on_damage);
            if !more {
                break;
            }
        }
        sink.end_cpu(cpu)?;
    }
    sink.finish(&RunSummary::default())
}

/// The time of `c`'s next page (`None` at its end).
fn next_head(c: &mut crate::tracedat::CpuPages) -> Result<Option<u64>, OutputError> {
    Ok(c.next_page()?.map(|p| {
        p.get(..8).map_or(0, |b| {
            let mut w = [0u8; 8];
            w.copy_from_slice(b);
            u64::from_le_bytes(w)
        })
    }))
}
