//! Post-mortem walks: every committed event of a CPU that no reader consumed, read from
//! a trace region whose writer is gone (a crashed or stopped guest, a VMM killed with
//! SIGKILL and its file-backed trace memory, a finished run's file) — read-only, no
//! swaps, no writer, nothing trusted.
//!
//! The order of the pages comes from the footers alone: the reader page first (from
//! where its reader stopped, [`Position`]), then every ring page whose `page_seq` is
//! above the reader page's, by `page_seq` — ring order from the head to the tail
//! (docs/design.md, "After the writer stopped"). With released pages the reader page
//! and every page up to the control block's `released` were read: the walk is the ring
//! pages above them, from where the reader stood on the first one. Losses come from the pages'
//! `first_index` (R1: exact, at the place they happened).
//!
//! Unlike [`crate::RingBuffer::finalize`], which fails a CPU at the first inconsistency,
//! a walk goes on where it can and says what it skipped ([`CpuDump::warnings`]): a page
//! with a foreign footer, a repeated `page_seq` or an index going backwards is left out;
//! a commit past the data area is clamped; an event that does not decode (torn, or
//! garbage) ends its page there — the events before it are kept, nothing after it on
//! that page is guessed at. Every loop is bounded by the CPU's page count and the page
//! length; host memory is one page buffer per walk.

use core::sync::atomic::Ordering::Acquire;

use hyptrace_abi::layout::{ctl, footer, Mode, RingGeometry, FOOTER_MAGIC};
use hyptrace_abi::page::{self, COMMIT_LEN_MASK, COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_abi::SharedMem;

/// Most warnings kept per CPU (more are counted, not kept).
pub const MAX_WARNINGS: usize = 16;

/// Where a reader of a CPU stopped: its reader page (named exactly: its id, its
/// `page_seq` and its `first_index`, P1), the data bytes of that page it consumed (a
/// record boundary), the event index after the last event it consumed (or reported as
/// lost), and the index below which every event is known to be in its output
/// (`printed` ≤ `expected`, P2: the events between were consumed and may or may not
/// have reached the output when the reader died).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Position {
    /// The reader page id.
    pub reader: u32,
    /// Data bytes of the reader page consumed.
    pub consumed: u64,
    /// Index of the next event the reader expected.
    pub expected: u64,
    /// The reader page's `page_seq` when the position was taken.
    pub page_seq: u64,
    /// The reader page's `first_index` when the position was taken.
    pub first_index: u64,
    /// Every event below this index is in the reader's output.
    pub printed: u64,
}

/// One page for the output: a whole `page_size` buffer (`time_stamp`, `commit` = data
/// length without flags, the data, zeros after it), with the events lost right before it.
#[derive(Debug)]
pub struct DumpPage<'a> {
    /// The page bytes.
    pub bytes: &'a [u8],
    /// Events lost right before this page (0: none).
    pub missed: u64,
    /// Events on the page.
    pub events: u64,
}

/// What a walk of one CPU found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuDump {
    /// The CPU.
    pub cpu: u32,
    /// Events dumped.
    pub events: u64,
    /// Events lost before or between the dumped ones (from `first_index`).
    pub lost: u64,
    /// Events the writer took in but that are on no page (after the last page: stop-mode
    /// drops, or a control block ahead of the pages), from its `entries + dropped`.
    pub trailing_lost: u64,
    /// Pages with events handed out.
    pub pages: u64,
    /// The writer's event index (`entries + dropped` of its control block).
    pub writer_index: u64,
    /// The index after the last event dumped (or lost).
    pub end_index: u64,
    /// Timestamp and payload of the last event dumped.
    pub last_event: Option<(u64, Vec<u8>)>,
    /// What was skipped or cut, and why (at most [`MAX_WARNINGS`]).
    pub warnings: Vec<String>,
    /// Warnings not kept.
    pub more_warnings: u64,
    /// P2: the first and last index of the dumped events that the reader had consumed
    /// but not recorded as printed when it died: they may also be in its output.
    pub may_repeat: Option<(u64, u64)>,
    /// P2: the first and last index of the events the reader had consumed but not
    /// recorded as printed that are on no page any more (counted in `lost`): in its
    /// output, or nowhere.
    pub unplaced: Option<(u64, u64)>,
}

impl CpuDump {
    fn warn(&mut self, w: String) {
        if self.warnings.len() < MAX_WARNINGS {
            self.warnings.push(w);
        } else {
            self.more_warnings = self.more_warnings.saturating_add(1);
        }
    }

    /// Whether the walk skipped or cut anything.
    pub fn damaged(&self) -> bool {
        !self.warnings.is_empty()
    }
}

/// A read-only snapshot of a trace region in host memory (a file's bytes), as
/// [`SharedMem`]: `size` may be larger than the bytes held (a truncated file), the
/// missing part reads as zeros. Only the loads and byte copies are used by a walk; the
/// writing methods panic (a bug of the caller: a snapshot is never written).
#[derive(Debug)]
pub struct Snapshot<'a> {
    bytes: &'a [u8],
    size: usize,
}

impl<'a> Snapshot<'a> {
    /// A snapshot of `bytes` that claims `size` bytes (at least `bytes.len()`).
    pub fn new(bytes: &'a [u8], size: usize) -> Self {
        Self {
            bytes,
            size: size.max(bytes.len()),
        }
    }

    /// Bytes actually held (the rest reads as zeros).
    pub fn held(&self) -> usize {
        self.bytes.len()
    }

    fn copy(&self, off: usize, dst: &mut [u8]) {
        let end = off.checked_add(dst.len()).filter(|&e| e <= self.size);
        assert!(end.is_some(), "snapshot read out of range");
        dst.fill(0);
        if let Some(src) = self.bytes.get(off..) {
            let n = src.len().min(dst.len());
            dst[..n].copy_from_slice(&src[..n]);
        }
    }
}

impl SharedMem for Snapshot<'_> {
    fn size(&self) -> usize {
        self.size
    }
    fn load(&self, off: usize, _: core::sync::atomic::Ordering) -> u64 {
        assert!(off.is_multiple_of(8), "unaligned snapshot load");
        let mut b = [0u8; 8];
        self.copy(off, &mut b);
        u64::from_le_bytes(b)
    }
    fn store(&self, _: usize, _: u64, _: core::sync::atomic::Ordering) {
        unreachable!("a snapshot is read-only")
    }
    fn swap(&self, _: usize, _: u64, _: core::sync::atomic::Ordering) -> u64 {
        unreachable!("a snapshot is read-only")
    }
    fn compare_exchange(
        &self,
        _: usize,
        _: u64,
        _: u64,
        _: core::sync::atomic::Ordering,
        _: core::sync::atomic::Ordering,
    ) -> Result<u64, u64> {
        unreachable!("a snapshot is read-only")
    }
    fn fetch_or(&self, _: usize, _: u64, _: core::sync::atomic::Ordering) -> u64 {
        unreachable!("a snapshot is read-only")
    }
    fn fetch_and(&self, _: usize, _: u64, _: core::sync::atomic::Ordering) -> u64 {
        unreachable!("a snapshot is read-only")
    }
    fn fetch_add(&self, _: usize, _: u64, _: core::sync::atomic::Ordering) -> u64 {
        unreachable!("a snapshot is read-only")
    }
    fn write_bytes(&self, _: usize, _: &[u8]) {
        unreachable!("a snapshot is read-only")
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        self.copy(off, dst)
    }
}

/// Walks CPU `cpu` of the region in `mem` (layout `l`, parsed from the same memory)
/// from `pos` (where its reader stopped; `None`: from the start of its reader page, as
/// if nothing of it was consumed), handing every page with unconsumed events to `out`
/// in order. `mem` must not change during the walk (a stopped writer, a file).
///
/// ```
/// # use hyptrace_abi::{events, HeapMem, Mode, RingGeometry};
/// let l = RingGeometry::new(1, 4, 4096, Mode::Overwrite, false)?;
/// let mem = HeapMem::new(l.region_size);
/// l.init_region(&mem, 1_000_000, 1);
/// let mut w = hyptrace_writer::Writer::attach(&mem, 0)?;
/// for seq in 0..10 {
///     w.write_enabled(seq, &events::marker(events::vcpu_pid(0), seq, 0));
/// }
/// // The writer stopped (or crashed, or this is a file): walk what no reader consumed.
/// let mut pages = 0;
/// let d = hyptrace_reader::postmortem::walk_cpu(&mem, &l, 0, None, |_page| {
///     pages += 1;
///     Ok::<(), std::convert::Infallible>(())
/// })?;
/// assert_eq!((d.events, d.lost, pages), (10, 0, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn walk_cpu<M: SharedMem + ?Sized, E>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
    pos: Option<Position>,
    mut out: impl FnMut(DumpPage<'_>) -> Result<(), E>,
) -> Result<CpuDump, E> {
    let mut d = CpuDump {
        cpu,
        ..CpuDump::default()
    };
    if cpu >= l.nr_cpus {
        d.warn(format!("cpu {cpu}: not in the region"));
        return Ok(d);
    }
    // The writer is gone: exact (R1; for a file, what it left).
    d.writer_index = crate::ctl_writer_index(mem, l, cpu);
    let f = Footers { mem, l };
    let uses_released = l.mode == Mode::Stop && l.guest_swap;
    let (reader, reader_seq) = unconsumed_reader_page(&f, cpu, pos, uses_released, &mut d);
    let mut order = ring_order(&f, cpu, reader, reader_seq, &mut d);
    let at_pos = position_on_walk(&f, cpu, &order, pos, &mut d);
    // P2: every event from `printed` on is dumped (by index: whatever page holds it);
    // the ones below `expected` may also be in the reader's output.
    let floor = pos.map(|p| p.printed.min(p.expected));
    if let (Some(floor), false) = (floor, uses_released) {
        let first_seq = order.first().map_or(u64::MAX, |&id| f.seq(id));
        let older = older_pages(mem, l, cpu, &order, first_seq, floor);
        if !older.is_empty() {
            order.splice(0..0, older);
        }
    }
    let expected = match (floor, reader) {
        (Some(floor), _) => floor,
        (None, Some(r)) => f.first_index(r),
        (None, None) => order.first().map_or(0, |&id| f.first_index(id)),
    };
    let mut w = PageWalk {
        f,
        cpu,
        d,
        expected,
        consumed_to: pos.map_or(0, |p| p.expected),
        pending_lost: 0,
        at_pos,
    };
    let mut buf = vec![0u8; l.page_size];
    let mut outbuf = vec![0u8; l.page_size];
    for id in order {
        if let Some(page) = w.page(id, &mut buf, &mut outbuf) {
            out(page)?;
        }
    }
    Ok(w.finish())
}

/// The footer words of a region's pages.
struct Footers<'a, M: ?Sized> {
    mem: &'a M,
    l: &'a RingGeometry,
}

impl<M: SharedMem + ?Sized> Footers<'_, M> {
    /// Whether page `id`'s footer names it (its id and the magic).
    fn valid(&self, id: u32) -> bool {
        self.mem
            .load(self.l.footer_off(id) + footer::ID_MAGIC, Acquire)
            == u64::from(id) | (u64::from(FOOTER_MAGIC) << 32)
    }

    fn seq(&self, id: u32) -> u64 {
        self.mem
            .load(self.l.footer_off(id) + footer::PAGE_SEQ, Acquire)
    }

    fn first_index(&self, id: u32) -> u64 {
        self.mem
            .load(self.l.footer_off(id) + footer::FIRST_INDEX, Acquire)
    }
}

/// The reader page of `cpu` if the walk starts on it (one of the CPU's pages, its footer
/// valid, not released or left by the reader), and the `page_seq` above which ring pages
/// are walked.
fn unconsumed_reader_page<M: SharedMem + ?Sized>(
    f: &Footers<'_, M>,
    cpu: u32,
    pos: Option<Position>,
    uses_released: bool,
    d: &mut CpuDump,
) -> (Option<u32>, u64) {
    let c = f.l.ctl(cpu);
    let raw_reader = f.mem.load(c + ctl::READER_PAGE, Acquire);
    let reader = if f.l.owns(cpu, raw_reader) && f.valid(raw_reader as u32) {
        Some(raw_reader as u32)
    } else {
        d.warn(format!(
            "cpu {cpu}: reader page {raw_reader} is not one of its pages (or its footer is foreign): only ring pages are read"
        ));
        None
    };
    // Released pages (`--swap guest`, stop mode; docs/design.md "Released pages"): the
    // live reader reads the ring in place and releases every page up to `released` —
    // the reader page among them — and stands on a ring page after them. Even before
    // its first release it has left the reader page once its position names another
    // page. A hostile value only moves where the walk starts; it is never trusted for
    // a bound.
    // Acquire: paired with the Release store of released in RingBuffer::advance_released.
    let released = f.mem.load(c + ctl::RELEASED, Acquire);
    let reader = reader.filter(|&r| {
        let consumed = (released != 0 && f.seq(r) <= released)
            || (uses_released && pos.is_some_and(|p| p.reader != r));
        !consumed
    });
    let reader_seq = reader.map_or(released, |r| f.seq(r));
    (reader, reader_seq)
}

/// The pages to walk in order: `reader` first, then the ring pages with events the
/// reader has not had (valid footers, `page_seq` above `reader_seq`), in ring order;
/// foreign footers and repeated sequence numbers are skipped with a warning. Bounded by
/// the CPU's page count.
fn ring_order<M: SharedMem + ?Sized>(
    f: &Footers<'_, M>,
    cpu: u32,
    reader: Option<u32>,
    reader_seq: u64,
    d: &mut CpuDump,
) -> Vec<u32> {
    let first = f.l.first_page(cpu);
    let mut ring: Vec<(u64, u32)> = Vec::new();
    for id in first..first.saturating_add(f.l.pages_per_cpu) {
        if Some(id) == reader {
            continue;
        }
        if !f.valid(id) {
            d.warn(format!("cpu {cpu}: page {id}: foreign footer, skipped"));
            continue;
        }
        let seq = f.seq(id);
        if seq > reader_seq {
            ring.push((seq, id));
        }
    }
    ring.sort_unstable();
    let mut order: Vec<u32> = Vec::with_capacity(ring.len() + 1);
    order.extend(reader);
    let mut last_seq = None;
    for (seq, id) in ring {
        if last_seq == Some(seq) {
            d.warn(format!(
                "cpu {cpu}: page {id}: sequence number {seq} repeated, skipped"
            ));
            continue;
        }
        last_seq = Some(seq);
        order.push(id);
    }
    order
}

/// `pos` if it names the walk's first page (else a warning: the walk goes by index).
fn position_on_walk<M: SharedMem + ?Sized>(
    f: &Footers<'_, M>,
    cpu: u32,
    order: &[u32],
    pos: Option<Position>,
    d: &mut CpuDump,
) -> Option<Position> {
    // P1: the position names the walk's first page only when id, page_seq and
    // first_index all match (a page that came back with new contents is another page).
    let at_pos = order.first().and_then(|&id| {
        pos.filter(|p| {
            p.reader == id
                && (cfg!(hyptrace_seeded_bug_page_inexact)
                    || (p.page_seq == f.seq(id) && p.first_index == f.first_index(id)))
        })
    });
    if let (Some(p), None) = (pos, at_pos) {
        d.warn(format!(
            "cpu {cpu}: the recorded position (page {} seq {} first event {}) names no page as it is now: read from event {} by index",
            p.reader, p.page_seq, p.first_index, p.printed.min(p.expected)
        ));
    }
    at_pos
}

/// The walk over the ordered pages of one CPU.
struct PageWalk<'a, M: ?Sized> {
    f: Footers<'a, M>,
    cpu: u32,
    d: CpuDump,
    /// Index of the next event to dump.
    expected: u64,
    /// The index after the last event the reader consumed (0: no position).
    consumed_to: u64,
    /// Events lost since the last page handed out.
    pending_lost: u64,
    /// The position, when it names the walk's first page.
    at_pos: Option<Position>,
}

/// The last event decoded on a page: its timestamp, and where its payload lies in the
/// decoded bytes (offset, length).
type LastEvent = Option<(u64, usize, usize)>;

impl<M: SharedMem + ?Sized> PageWalk<'_, M> {
    /// Page `id` (read into `buf`): its events from `expected` on, copied into `outbuf`
    /// as a whole page, or `None` when it has none.
    fn page<'o>(&mut self, id: u32, buf: &mut [u8], outbuf: &'o mut [u8]) -> Option<DumpPage<'o>> {
        // Every page starts at its first index: the loss before it is what its first
        // index says; events below `expected` (already in the output) are skipped by
        // index (P2).
        let first_index = self.f.first_index(id);
        self.gap_before(first_index);
        let skip_events = self.expected - first_index;
        let len = self.read(id, buf);
        let time_stamp = u64::from_le_bytes(buf[..8].try_into().unwrap_or([0; 8]));
        let data = &buf[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len];
        let (start, clock) = self.unconsumed_start(id, data, time_stamp, skip_events)?;
        let rest = &data[start..];
        let (n, cut, last) = self.decode(id, rest, clock, start);
        if n > 0 && self.expected < self.consumed_to {
            let last = self
                .expected
                .saturating_add(n - 1)
                .min(self.consumed_to - 1);
            let from = self.d.may_repeat.map_or(self.expected, |r| r.0);
            self.d.may_repeat = Some((from, last));
        }
        self.expected = self.expected.saturating_add(n);
        if n == 0 {
            return None;
        }
        if let Some((ts, at, plen)) = last {
            self.d.last_event = rest.get(at..at + plen).map(|p| (ts, p.to_vec()));
        }
        outbuf.fill(0);
        outbuf[..8].copy_from_slice(&clock.to_le_bytes());
        outbuf[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&(cut as u64).to_le_bytes());
        outbuf[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + cut].copy_from_slice(&rest[..cut]);
        let missed = core::mem::take(&mut self.pending_lost);
        self.d.lost = self.d.lost.saturating_add(missed);
        self.d.events = self.d.events.saturating_add(n);
        self.d.pages += 1;
        Some(DumpPage {
            bytes: outbuf,
            missed,
            events: n,
        })
    }

    /// A page starting above `expected`: the events between are lost (and, those the
    /// reader consumed, unplaced).
    fn gap_before(&mut self, first_index: u64) {
        if first_index > self.expected {
            let gap = first_index - self.expected;
            // Consumed, not recorded as printed, and on no page any more.
            let end = self.consumed_to.min(first_index);
            if end > self.expected {
                let from = self.d.unplaced.map_or(self.expected, |r| r.0);
                self.d.unplaced = Some((from, end - 1));
            }
            self.pending_lost = self.pending_lost.saturating_add(gap);
            self.expected = first_index;
        }
    }

    /// Reads page `id` into `buf` (header and committed data); returns the data length,
    /// clamped to the data area.
    fn read(&mut self, id: u32, buf: &mut [u8]) -> usize {
        let off = self.f.l.page_off(id);
        let cap = self.f.l.data_capacity();
        // Acquire: paired with the Release store of commit in Writer::write (W1).
        let commit = self.f.mem.load(off + COMMIT_OFFSET, Acquire);
        let mut len = (commit & COMMIT_LEN_MASK) as usize;
        if len > cap {
            self.d.warn(format!(
                "cpu {}: page {id}: commit {len} past the data area ({cap}): clamped",
                self.cpu
            ));
            len = cap;
        }
        self.f
            .mem
            .read_bytes(off, &mut buf[..PAGE_HEADER_SIZE + len]);
        len
    }

    /// Where the unconsumed part of page `id` starts in `data` and the clock there,
    /// after `skip_events` events already in the output; `None` when the whole page is
    /// below `expected`. Bounded: each record is at least 4 bytes.
    fn unconsumed_start(
        &mut self,
        id: u32,
        data: &[u8],
        time_stamp: u64,
        skip_events: u64,
    ) -> Option<(usize, u64)> {
        let resume = self.at_pos.filter(|p| {
            cfg!(hyptrace_seeded_bug_page_inexact) && p.reader == id && p.printed >= p.expected
        });
        if let Some(p) = resume {
            // Seeded bug (P1): resumes at the record's byte offset on the page it names,
            // the page named by its id alone (docs/fuzzing.md, the flight model).
            self.expected = p.expected;
            return Some(((p.consumed as usize).min(data.len()), time_stamp));
        }
        if skip_events == 0 {
            return Some((0, time_stamp));
        }
        let mut it = page::Events::new(data, time_stamp);
        let mut k = 0u64;
        while k < skip_events {
            match it.next() {
                Some(Ok(_)) => k += 1,
                Some(Err(_)) | None => break,
            }
        }
        // Fewer events than to skip: the whole page is below `expected`, already output.
        (k == skip_events).then(|| (it.offset(), it.clock()))
    }

    /// Decodes the events of `rest` (starting at data offset `start` of page `id`):
    /// their count, where the page is cut (at the first event that does not decode, or
    /// its end) and the last event.
    fn decode(
        &mut self,
        id: u32,
        rest: &[u8],
        clock: u64,
        start: usize,
    ) -> (u64, usize, LastEvent) {
        let mut n = 0u64;
        let mut cut = rest.len();
        let mut last = None;
        for ev in page::Events::new(rest, clock) {
            match ev {
                Ok(e) => {
                    n += 1;
                    let at = e.payload.as_ptr() as usize - rest.as_ptr() as usize;
                    last = Some((e.ts, at, e.payload.len()));
                }
                Err(e) => {
                    let at = match e {
                        page::DecodeError::Truncated { offset }
                        | page::DecodeError::BadLength { offset } => offset,
                    };
                    self.d.warn(format!(
                        "cpu {}: page {id}: {e} (at data offset {}): the page is cut there",
                        self.cpu,
                        start + at
                    ));
                    cut = at;
                    break;
                }
            }
        }
        (n, cut, last)
    }

    /// The dump, with the losses after the last page.
    fn finish(mut self) -> CpuDump {
        let d = &mut self.d;
        // Losses with no page after them, and what the writer counted past the pages.
        let trailing = d.writer_index.saturating_sub(self.expected);
        // P2: the reader may have consumed some of these (stop-mode drops it counted as
        // lost) without recording them as printed: they are unplaced as the gaps above.
        let end = self.consumed_to.min(d.writer_index);
        if end > self.expected {
            let from = d.unplaced.map_or(self.expected, |r| r.0);
            d.unplaced = Some((from, end - 1));
        }
        d.trailing_lost = trailing.saturating_add(self.pending_lost);
        d.end_index = self.expected.max(d.writer_index);
        self.d
    }
}

/// P2: the pages of `cpu` older than the walk (`page_seq` below `first_seq`, not in
/// `order`, footers valid) that still hold events from index `floor` on: a reader that
/// died consumed them before it printed them. In `page_seq` order; a page whose
/// successor starts at or below `floor` holds nothing from there and is left out.
fn older_pages<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
    cpu: u32,
    order: &[u32],
    first_seq: u64,
    floor: u64,
) -> Vec<u32> {
    let first = l.first_page(cpu);
    let mut older: Vec<(u64, u32)> = (first..first.saturating_add(l.pages_per_cpu))
        .filter(|id| !order.contains(id))
        .filter(|&id| {
            mem.load(l.footer_off(id) + footer::ID_MAGIC, Acquire)
                == u64::from(id) | (u64::from(FOOTER_MAGIC) << 32)
        })
        .map(|id| (mem.load(l.footer_off(id) + footer::PAGE_SEQ, Acquire), id))
        .filter(|&(seq, _)| seq != 0 && seq < first_seq)
        .collect();
    older.sort_unstable();
    older.dedup_by_key(|p| p.0);
    let first_index = |id: u32| mem.load(l.footer_off(id) + footer::FIRST_INDEX, Acquire);
    let next_first: Vec<u64> = older
        .iter()
        .skip(1)
        .map(|&(_, id)| first_index(id))
        .chain(order.first().map(|&id| first_index(id)))
        .collect();
    older
        .iter()
        .zip(
            next_first
                .iter()
                .copied()
                .chain(core::iter::repeat(u64::MAX)),
        )
        .filter(|&(_, next)| next > floor)
        .map(|(&(_, id), _)| id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_abi::layout::Mode;
    use hyptrace_abi::HeapMem;
    use hyptrace_writer::Writer;

    /// A 1-CPU overwrite region of 6 pages with `n` 16-byte events (payload = index).
    fn region(n: u64) -> (HeapMem, RingGeometry) {
        let l = RingGeometry::new(1, 6, 4096, Mode::Overwrite, false).expect("layout");
        let mem = HeapMem::new(l.region_size);
        l.init_region(&mem, 1_000_000, 1);
        let mut w = Writer::attach(&mem, 0).expect("attach");
        for i in 0..n {
            let mut p = [0u8; 16];
            p[..8].copy_from_slice(&i.to_le_bytes());
            let _ = w.write(0, 100 + i, &p);
        }
        (mem, l)
    }

    /// Walks CPU 0; returns the event indexes (from the payloads) and the dump.
    fn walk(mem: &HeapMem, l: &RingGeometry, pos: Option<Position>) -> (Vec<u64>, CpuDump) {
        let mut seen = Vec::new();
        let d = walk_cpu(mem, l, 0, pos, |p| {
            let len = u64::from_le_bytes(p.bytes[8..16].try_into().expect("8")) as usize;
            let data = &p.bytes[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len];
            for e in page::Events::new(data, 0) {
                let e = e.expect("decodes");
                seen.push(u64::from_le_bytes(e.payload[..8].try_into().expect("8")));
            }
            Ok::<(), ()>(())
        })
        .expect("walk");
        (seen, d)
    }

    /// Overwrite mode, nothing consumed: the newest events, contiguous up to the last,
    /// and the losses before them exactly the overwritten ones.
    #[test]
    fn newest_events_with_exact_losses() {
        let n = 2000;
        let (mem, l) = region(n);
        let (seen, d) = walk(&mem, &l, None);
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        assert_eq!(seen.last(), Some(&(n - 1)));
        assert!(seen.windows(2).all(|w| w[1] == w[0] + 1));
        assert_eq!(d.lost, seen[0]);
        assert_eq!(d.events + d.lost + d.trailing_lost, n);
        assert_eq!(d.last_event.as_ref().map(|e| e.0), Some(100 + n - 1));
    }

    /// A torn last event (commit cut in its middle) is cut off with a warning; the
    /// events before it stay, nothing is misparsed.
    #[test]
    fn torn_last_event_is_cut_off() {
        let n = 2000;
        let (mem, l) = region(n);
        let tail = mem.load(l.ctl(0) + ctl::TAIL_PAGE, Acquire) as u32;
        let c = l.page_off(tail) + COMMIT_OFFSET;
        let commit = mem.load(c, Acquire);
        mem.store(c, commit - 6, core::sync::atomic::Ordering::Relaxed);
        let (seen, d) = walk(&mem, &l, None);
        assert_eq!(seen.last(), Some(&(n - 2)), "the torn event is gone");
        assert!(seen.windows(2).all(|w| w[1] == w[0] + 1));
        assert!(
            d.warnings.iter().any(|w| w.contains("cut there")),
            "{:?}",
            d.warnings
        );
    }

    /// From a reader's position: exactly the events after it, none before (P1: the
    /// page named by id, page_seq and first_index).
    #[test]
    fn position_skips_what_was_consumed() {
        let (mem, l) = region(50);
        // Everything is on the first ring page; make it the reader page as a swap would.
        let tail = mem.load(l.ctl(0) + ctl::TAIL_PAGE, Acquire);
        let (all, _) = walk(&mem, &l, None);
        assert_eq!(all.len(), 50);
        mem.store(
            l.ctl(0) + ctl::READER_PAGE,
            tail,
            core::sync::atomic::Ordering::Relaxed,
        );
        let f = l.footer_off(tail as u32);
        // 20 events of 20 bytes (4-byte header + 16) consumed and printed.
        let pos = Position {
            reader: tail as u32,
            consumed: 20 * 20,
            expected: 20,
            page_seq: mem.load(f + footer::PAGE_SEQ, Acquire),
            first_index: mem.load(f + footer::FIRST_INDEX, Acquire),
            printed: 20,
        };
        let (seen, d) = walk(&mem, &l, Some(pos));
        assert_eq!(seen, (20..50).collect::<Vec<_>>());
        assert_eq!((d.lost, d.may_repeat, d.unplaced), (0, None, None));
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        // P2: consumed through 19, printed through 11: 12..19 are dumped and marked.
        let (seen, d) = walk(&mem, &l, Some(Position { printed: 12, ..pos }));
        assert_eq!(seen, (12..50).collect::<Vec<_>>());
        assert_eq!(d.may_repeat, Some((12, 19)));
        // P1: a record of another page_seq names another page (it came back with new
        // contents): not trusted for bytes; read from `printed` by index.
        let (seen, d) = walk(
            &mem,
            &l,
            Some(Position {
                page_seq: pos.page_seq + 7,
                ..pos
            }),
        );
        assert_eq!(seen, (20..50).collect::<Vec<_>>());
        assert!(
            d.warnings.iter().any(|w| w.contains("names no page")),
            "{:?}",
            d.warnings
        );
    }

    /// P2: stop-mode drops the reader consumed (counted lost) and never recorded as
    /// printed are on no page: counted in `trailing_lost` and named unplaced, since the
    /// live output may hold their drop line (found by the flight model).
    #[test]
    fn consumed_unprinted_drops_are_unplaced() {
        let l = RingGeometry::new(1, 6, 4096, Mode::Stop, false).expect("layout");
        let mem = HeapMem::new(l.region_size);
        l.init_region(&mem, 1_000_000, 1);
        let mut w = Writer::attach(&mem, 0).expect("attach");
        for i in 0..2000u64 {
            let mut p = [0u8; 16];
            p[..8].copy_from_slice(&i.to_le_bytes());
            let _ = w.write(0, 100 + i, &p);
        }
        let reader = mem.load(l.ctl(0) + ctl::READER_PAGE, Acquire);
        let f = l.footer_off(reader as u32);
        // Consumed through 1999 (the drops counted lost), printed through 999.
        let pos = Position {
            reader: reader as u32,
            consumed: 0,
            expected: 2000,
            page_seq: mem.load(f + footer::PAGE_SEQ, Acquire),
            first_index: mem.load(f + footer::FIRST_INDEX, Acquire),
            printed: 1000,
        };
        let (seen, d) = walk(&mem, &l, Some(pos));
        assert!(seen.is_empty(), "{seen:?}");
        assert_eq!((d.trailing_lost, d.unplaced), (1000, Some((1000, 1999))));
    }

    /// P2: a reader that consumed pages it never printed, whose pages went back to the
    /// ring: the walk finds the older pages that still hold them, dumps them marked,
    /// and counts the ones no page holds any more as unplaced (and lost).
    #[test]
    fn consumed_unprinted_events_are_found_or_counted() {
        // 6 pages of 4 KiB, 20-byte events: about 200 a page; 3 pages' worth.
        let (mem, l) = region(600);
        let (all, _) = walk(&mem, &l, None);
        assert_eq!(all.len(), 600);
        // A reader that consumed through 449 and printed through 99.
        let pos = Position {
            reader: 0,
            consumed: 0,
            expected: 450,
            page_seq: 0,
            first_index: 0,
            printed: 100,
        };
        let (seen, d) = walk(&mem, &l, Some(pos));
        assert_eq!(seen, (100..600).collect::<Vec<_>>(), "{:?}", d.warnings);
        assert_eq!(d.may_repeat, Some((100, 449)));
        assert_eq!((d.lost, d.unplaced), (0, None));
    }
}
