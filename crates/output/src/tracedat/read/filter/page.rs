//! `convert -F` and `record -F`: a data page re-encoded without the events a
//! [`FilterSet`] rejects, and a [`PageSink`] that hands every page through it.
//!
//! The kept events keep their exact times: each is written with its delta from the
//! previous kept event (a rejected event's delta goes to the next kept one), behind a
//! TIME_EXTEND where that overflows the 27-bit delta (an absolute TIME_STAMP where the
//! time went back, which only a TIME_STAMP of the input can do). The page keeps its
//! time stamp, its lost-events flags and their stored count (moved to the new end of
//! the data), its commit says the new data length, the rest is zeroed. Paddings and
//! time records of the input are not copied (the kept events' times carry them).

use crate::error::PageProblem;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hyptrace_abi::page::{
    encode_data_header, encode_time_extend, fix_abs_ts, header_word, page_header, Events,
    COMMIT_LEN_MASK, COMMIT_OFFSET, DELTA_BITS, MAX_DELTA, MAX_EXTENDED_DELTA, PAGE_HEADER_SIZE,
    RB_MISSED_EVENTS, RB_MISSED_FLAGS, RB_MISSED_STORED, TYPE_TIME_STAMP,
};

use super::{FilterSet, PageFilterError};
use crate::sink::{OutputWaits, PageSink, RunSummary};
use crate::{Missed, OutputError};

/// What [`FilterSet::filter_page`] did with a page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageFiltered {
    /// Events kept.
    pub kept: u64,
    /// Events the filters rejected.
    pub dropped: u64,
    /// The page stopped here: a record that does not decode, a commit past the page,
    /// or a kept event the page cannot carry (its later records are not in the output).
    pub cut: bool,
    /// The clock after the page's last decoded event (the page's time stamp if none).
    pub end_ts: u64,
}

/// Where the pages a filter reads come from: which bits of `commit` are the length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageSource {
    /// The guest's ring (`record -F`, raw streams): the ring's 30-bit length.
    Ring,
    /// A trace.dat file (`convert -F`): the 27 bits trace-cmd's kbuffer reads, as
    /// the trace.dat reader does.
    TraceDat,
}

impl PageSource {
    /// The mask of the length in `commit`.
    pub fn commit_mask(self) -> u64 {
        match self {
            Self::Ring => COMMIT_LEN_MASK,
            Self::TraceDat => super::super::records::READ_COMMIT_MASK,
        }
    }
}

/// Writes `bytes` at `*at` of `out`, advancing `*at`; `None` past `limit`.
fn put(out: &mut [u8], at: &mut usize, limit: usize, bytes: &[u8]) -> Option<()> {
    let end = at.checked_add(bytes.len()).filter(|&e| e <= limit)?;
    out[*at..end].copy_from_slice(bytes);
    *at = end;
    Some(())
}

/// The time records that bring the clock from `prev` to `ts` (the event then carries
/// the returned delta): a TIME_EXTEND per 59 bits of a forward gap, an absolute
/// TIME_STAMP for a time that went back; `None` if none fits or reaches `ts`.
fn time_records(
    out: &mut [u8],
    at: &mut usize,
    limit: usize,
    prev: u64,
    ts: u64,
    page_ts: u64,
) -> Option<u32> {
    if ts >= prev {
        let mut delta = ts - prev;
        if delta <= MAX_DELTA {
            return Some(delta as u32);
        }
        // Bounded: at most 64 / 59 + 1 steps.
        while delta > 0 {
            let step = delta.min(MAX_EXTENDED_DELTA);
            put(out, at, limit, &encode_time_extend(step))?;
            delta -= step;
        }
        return Some(0);
    }
    let abs = ts & MAX_EXTENDED_DELTA;
    if fix_abs_ts(abs, page_ts) != ts {
        return None;
    }
    let lo = header_word(TYPE_TIME_STAMP, (abs & MAX_DELTA) as u32).to_le_bytes();
    let hi = ((abs >> DELTA_BITS) as u32).to_le_bytes();
    put(out, at, limit, &lo)?;
    put(out, at, limit, &hi)?;
    Some(0)
}

/// Writes event `payload` at `ts` (time records first), or nothing if it does not
/// fit or its time cannot be carried.
fn put_event(
    out: &mut [u8],
    at: &mut usize,
    limit: usize,
    clocks: (u64, u64, u64),
    payload: &[u8],
) -> Option<()> {
    let (prev, ts, page_ts) = clocks;
    let start = *at;
    let written = (|| {
        let delta = time_records(out, at, limit, prev, ts, page_ts)?;
        let mut hdr = [0u8; 8];
        let n = encode_data_header(&mut hdr, payload.len(), delta);
        put(out, at, limit, &hdr[..n])?;
        put(out, at, limit, payload)?;
        let pad = hyptrace_abi::page::align4(payload.len()) - payload.len();
        put(out, at, limit, &[0u8; 3][..pad])
    })();
    if written.is_none() {
        out[start..*at].fill(0);
        *at = start;
    }
    written
}

/// Makes filtered page `out` say loss `loss` before it (flags in `commit`, a count
/// stored after the data where it fits, else the flag alone).
fn set_loss(out: &mut [u8], loss: Missed) {
    let Some((_, commit)) = page_header(out) else {
        return;
    };
    let len = commit & COMMIT_LEN_MASK;
    let end = PAGE_HEADER_SIZE + len as usize;
    out[end..].fill(0);
    let mut word = len;
    match loss {
        Missed::Count(n) if n > 0 && end + 8 <= out.len() => {
            out[end..end + 8].copy_from_slice(&n.to_le_bytes());
            word |= RB_MISSED_FLAGS;
        }
        _ if loss.is_loss() => word |= RB_MISSED_EVENTS,
        _ => {}
    }
    out[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&word.to_le_bytes());
}

impl FilterSet {
    /// Re-encodes data page `page` of `cpu` into `out` (cleared, then `page.len()`
    /// bytes) with only the events the filters pass ([`FilterSet::wants`], so the
    /// stack traces after a kept event stay too). The output page's time stamp is the
    /// first kept event's time (it has delta 0 at offset 0, where trace-cmd shows a
    /// loss). A record that does not decode ends the page (`cut`): what came before it
    /// is kept or dropped as the filters say; a commit past the page is read up to the
    /// page's end (`cut` too); a kept event the page cannot carry ends it (`cut`).
    /// Only a page shorter than its header is an error.
    pub fn filter_page(
        &mut self,
        cpu: u32,
        page: &[u8],
        src: PageSource,
        cmdlines: &BTreeMap<i32, String>,
        out: &mut Vec<u8>,
    ) -> Result<PageFiltered, PageFilterError> {
        let (page_ts, commit) = page_header(page).ok_or(PageFilterError::Short(page.len()))?;
        let len = commit & src.commit_mask();
        let (end, past) = match usize::try_from(len)
            .ok()
            .and_then(|l| l.checked_add(PAGE_HEADER_SIZE))
            .filter(|&e| e <= page.len())
        {
            Some(end) => (end, false),
            None => (page.len(), true),
        };
        let stored = (commit & RB_MISSED_EVENTS != 0 && commit & RB_MISSED_STORED != 0)
            .then(|| page.get(end..end + 8))
            .flatten();
        out.clear();
        out.resize(page.len(), 0);
        let limit = page.len() - stored.map_or(0, <[u8]>::len);
        let mut at = PAGE_HEADER_SIZE;
        let mut done = PageFiltered {
            cut: past,
            end_ts: page_ts,
            ..PageFiltered::default()
        };
        let mut out_ts = page_ts;
        let mut prev = page_ts;
        // Bounded: the iterator consumes at least 4 bytes of the page per record.
        for ev in Events::new(&page[PAGE_HEADER_SIZE..end], page_ts) {
            let Ok(ev) = ev else {
                done.cut = true;
                break;
            };
            done.end_ts = ev.ts;
            if !self.wants(ev.payload, cpu, cmdlines) {
                done.dropped += 1;
                continue;
            }
            if done.kept == 0 {
                (out_ts, prev) = (ev.ts, ev.ts);
            }
            if put_event(out, &mut at, limit, (prev, ev.ts, out_ts), ev.payload).is_none() {
                done.cut = true;
                break;
            }
            prev = ev.ts;
            done.kept += 1;
        }
        out[..8].copy_from_slice(&out_ts.to_le_bytes());
        if let Some(count) = stored {
            out[at..at + count.len()].copy_from_slice(count);
        }
        // A stored flag whose count the page did not hold says no more than "some".
        let flags = match stored {
            Some(_) => commit & RB_MISSED_FLAGS,
            None => commit & RB_MISSED_EVENTS,
        };
        let word = flags | (at - PAGE_HEADER_SIZE) as u64;
        out[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&word.to_le_bytes());
        Ok(done)
    }
}

/// What the filters of a [`FilteredSink`] kept and dropped, shared with its maker (the
/// sink may run on another thread).
#[derive(Debug, Default)]
pub struct FilterCounts {
    kept: AtomicU64,
    dropped: AtomicU64,
    cut: AtomicU64,
    unmatched: Mutex<Vec<String>>,
}

impl FilterCounts {
    /// Events the filters passed.
    pub fn kept(&self) -> u64 {
        self.kept.load(Ordering::Relaxed)
    }

    /// Events the filters rejected (not written; not lost).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Pages whose later records are not in the output ([`PageFiltered::cut`]).
    pub fn cut(&self) -> u64 {
        self.cut.load(Ordering::Relaxed)
    }

    /// The filters that passed no event (known once the sink finished).
    pub fn unmatched(&self) -> Vec<String> {
        self.unmatched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Cut pages named on stderr, one line each; the rest are only counted.
const CUT_WARNINGS: u64 = 10;

/// The loss of both `a` and `b` (a sum past `u64` is a loss of unknown count).
fn add_loss(a: Missed, b: Missed) -> Missed {
    match (a, b) {
        (x, y) if !y.is_loss() => x,
        (x, y) if !x.is_loss() => y,
        (Missed::Count(x), Missed::Count(y)) => {
            x.checked_add(y).map_or(Missed::Unknown, Missed::Count)
        }
        _ => Missed::Unknown,
    }
}

/// A [`PageSink`] that hands each page to `inner` without the events a [`FilterSet`]
/// rejects ([`FilterSet::filter_page`]): one filter for every output format. A page
/// left with no event is not handed on: `inner` is told the CPU's clock moved on
/// ([`PageSink::quiet`]) and the page's loss goes to the CPU's next page handed on
/// (or to [`PageSink::trailing_lost`] at the end), where trace-cmd shows it.
pub struct FilteredSink {
    inner: Box<dyn PageSink + Send>,
    filters: FilterSet,
    src: PageSource,
    cmdlines: BTreeMap<i32, String>,
    buf: Vec<u8>,
    counts: Arc<FilterCounts>,
    /// Per CPU: pages seen, the loss of pages not handed on, waiting for the CPU's
    /// next page handed on.
    cpus: BTreeMap<u32, (u64, Missed)>,
}

impl FilteredSink {
    /// `inner` behind `filters` (compiled against the formats `inner` writes; `cmdlines`
    /// give `COMM`) for pages from `src`; the counts are shared through the returned
    /// handle.
    pub fn new(
        inner: Box<dyn PageSink + Send>,
        filters: FilterSet,
        src: PageSource,
        cmdlines: BTreeMap<i32, String>,
    ) -> (Self, Arc<FilterCounts>) {
        let counts = Arc::new(FilterCounts::default());
        let sink = Self {
            inner,
            filters,
            src,
            cmdlines,
            buf: Vec::new(),
            counts: Arc::clone(&counts),
            cpus: BTreeMap::new(),
        };
        (sink, counts)
    }

    /// Counts a cut page (page `index` of `cpu`), named on stderr for the first few.
    fn note_cut(&self, cpu: u32, index: u64) {
        let n = self.counts.cut.fetch_add(1, Ordering::Relaxed);
        if n < CUT_WARNINGS {
            eprintln!(
                "hyptrace: -F: CPU {cpu} page {index}: the page stops early (damaged, or a \
                 kept event does not fit); its later events are left out"
            );
        }
    }

    /// The loss page `page` (from `missed` or its flags, read with the source's mask)
    /// says.
    fn page_loss(&self, page: &[u8], missed: Missed) -> Missed {
        if missed.is_loss() {
            return missed;
        }
        match page_header(page) {
            Some((_, commit)) if commit & RB_MISSED_EVENTS != 0 => Missed::Unknown,
            _ => Missed::None,
        }
    }
}

// Every method written out: a default body would hide the call from the inner sink
// (crate::tap).
#[deny(clippy::missing_trait_methods)]
impl PageSink for FilteredSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        let done = self
            .filters
            .filter_page(cpu, page, self.src, &self.cmdlines, &mut self.buf)
            .map_err(|e| OutputError::BadPage {
                cpu,
                problem: PageProblem::Filter(e),
            })?;
        self.counts.kept.fetch_add(done.kept, Ordering::Relaxed);
        self.counts
            .dropped
            .fetch_add(done.dropped, Ordering::Relaxed);
        let (index, carried) = self.cpus.get(&cpu).copied().unwrap_or((0, Missed::None));
        if done.cut {
            self.note_cut(cpu, index);
        }
        let loss = add_loss(carried, self.page_loss(page, missed));
        if done.kept == 0 {
            self.cpus.insert(cpu, (index + 1, loss));
            return self.inner.quiet(cpu, done.end_ts);
        }
        self.cpus.insert(cpu, (index + 1, Missed::None));
        if carried.is_loss() {
            set_loss(&mut self.buf, loss);
        }
        self.inner.page(cpu, &self.buf, loss)
    }

    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        let carried = self
            .cpus
            .get_mut(&cpu)
            .map_or(Missed::None, |c| std::mem::replace(&mut c.1, Missed::None));
        let total = match add_loss(carried, Missed::count(lost)) {
            Missed::Count(n) if n > 0 => n,
            // A count is all `trailing_lost` carries: an unknown loss shows as one.
            Missed::Unknown => lost.max(1),
            _ => return Ok(()),
        };
        self.inner.trailing_lost(cpu, total)
    }

    fn end_cpu(&mut self, cpu: u32) -> Result<(), OutputError> {
        if self.cpus.get(&cpu).is_some_and(|c| c.1.is_loss()) {
            self.trailing_lost(cpu, 0)?;
        }
        self.inner.end_cpu(cpu)
    }

    fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
        self.inner.quiet(cpu, ts)
    }

    fn idle(&mut self) -> Result<(), OutputError> {
        self.inner.idle()
    }

    fn set_live(&mut self) {
        self.inner.set_live();
    }

    fn abandon(&mut self) {
        self.inner.abandon();
    }

    fn finish(mut self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        let pending: Vec<u32> = self
            .cpus
            .iter()
            .filter(|(_, c)| c.1.is_loss())
            .map(|(&cpu, _)| cpu)
            .collect();
        for cpu in pending {
            self.trailing_lost(cpu, 0)?;
        }
        *self
            .counts
            .unmatched
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = self.filters.unmatched();
        self.inner.finish(summary)
    }

    fn waits(&self) -> OutputWaits {
        self.inner.waits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{common_fields, EventFormat, Field};
    use crate::{page_missed, Missed};

    const PAGE: usize = 4096;

    /// `t:ev` (id 7) with an `int val` at offset 8 and `t:other` (id 8).
    fn formats() -> Vec<EventFormat> {
        let ev = |name: &str, id| EventFormat {
            system: "t".into(),
            name: name.into(),
            id,
            common_fields: common_fields(),
            fields: vec![Field {
                type_name: "int".into(),
                name: "val".into(),
                offset: 8,
                size: 4,
                signed: true,
            }],
            print_fmt: String::new(),
        };
        vec![ev("ev", 7), ev("other", 8)]
    }

    fn payload(id: u16, val: i32) -> Vec<u8> {
        let mut p = vec![0u8; 12];
        p[..2].copy_from_slice(&id.to_le_bytes());
        p[8..12].copy_from_slice(&val.to_le_bytes());
        p
    }

    /// A page at `page_ts` of events (delta, id, val), a delta above 27 bits written
    /// behind a TIME_EXTEND as the kernel does; `missed`: a stored lost count.
    fn page(page_ts: u64, events: &[(u64, u16, i32)], missed: Option<u64>) -> Vec<u8> {
        let mut p = vec![0u8; PAGE];
        p[..8].copy_from_slice(&page_ts.to_le_bytes());
        let mut at = PAGE_HEADER_SIZE;
        for &(delta, id, val) in events {
            let mut d = delta as u32;
            if delta > MAX_DELTA {
                p[at..at + 8].copy_from_slice(&encode_time_extend(delta));
                at += 8;
                d = 0;
            }
            let pl = payload(id, val);
            let mut hdr = [0u8; 8];
            let n = encode_data_header(&mut hdr, pl.len(), d);
            p[at..at + n].copy_from_slice(&hdr[..n]);
            p[at + n..at + n + pl.len()].copy_from_slice(&pl);
            at += n + pl.len();
        }
        let mut word = (at - PAGE_HEADER_SIZE) as u64;
        if let Some(m) = missed {
            word |= RB_MISSED_EVENTS | RB_MISSED_STORED;
            p[at..at + 8].copy_from_slice(&m.to_le_bytes());
        }
        p[8..16].copy_from_slice(&word.to_le_bytes());
        p
    }

    /// The (time, payload) of every event of `p`.
    fn events(p: &[u8]) -> Vec<(u64, Vec<u8>)> {
        let (ts, commit) = page_header(p).unwrap();
        let end = PAGE_HEADER_SIZE + (commit & COMMIT_LEN_MASK) as usize;
        Events::new(&p[PAGE_HEADER_SIZE..end], ts)
            .map(|e| e.map(|e| (e.ts, e.payload.to_vec())).unwrap())
            .collect()
    }

    fn filters(spec: &str) -> FilterSet {
        FilterSet::compile(&[spec.to_string()], &formats())
            .unwrap()
            .unwrap()
    }

    /// The kept events keep their exact times: a dropped event's delta moves to the
    /// next kept one, behind a TIME_EXTEND where the sum overflows 27 bits; the lost
    /// count stays stored after the new data; the tail is zeroed.
    #[test]
    fn kept_events_keep_their_times_and_the_page_its_losses() {
        let input = page(
            1000,
            &[
                (10, 7, 1),
                (MAX_DELTA, 7, 2),
                (5, 7, 1),
                (1 << 40, 8, 1),
                (3, 7, 1),
            ],
            Some(42),
        );
        let mut f = filters("ev: val == 1");
        let mut out = Vec::new();
        let done = f
            .filter_page(0, &input, PageSource::Ring, &BTreeMap::new(), &mut out)
            .unwrap();
        assert_eq!(
            done,
            PageFiltered {
                kept: 3,
                dropped: 2,
                cut: false,
                end_ts: 1000 + 10 + MAX_DELTA + 5 + (1 << 40) + 3,
            }
        );
        let want: Vec<_> = events(&input)
            .into_iter()
            .filter(|(_, p)| p[0] == 7 && p[8] == 1)
            .collect();
        assert_eq!(events(&out), want);
        // 10 + MAX_DELTA + 5 needed a TIME_EXTEND before the second kept event.
        let (_, commit) = page_header(&out).unwrap();
        assert_eq!(commit & COMMIT_LEN_MASK, 3 * 16 + 2 * 8);
        assert_eq!(page_missed(&out), Missed::Count(42));
        let end = PAGE_HEADER_SIZE + (commit & COMMIT_LEN_MASK) as usize;
        assert!(out[end + 8..].iter().all(|&b| b == 0));
        // The page's time stamp is the first kept event's time.
        assert_eq!(page_header(&out).unwrap().0, 1010);
    }

    /// Random pages: the output holds exactly the events the filter passes, at their
    /// times, and fits the page.
    #[test]
    fn random_pages_keep_exactly_what_passes() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..500 {
            let n = (next() % 200) as usize;
            let evs: Vec<(u64, u16, i32)> = (0..n)
                .map(|_| {
                    let delta = match next() % 4 {
                        0 => next() % 16,
                        1 => MAX_DELTA - next() % 4,
                        2 => next() % (1 << 40),
                        _ => next() % 100_000,
                    };
                    (delta, 7 + (next() % 2) as u16, (next() % 4) as i32)
                })
                .collect();
            let missed = (next() % 3 == 0).then(|| next() % 1000);
            let input = page(next() % (1 << 50), &evs, missed);
            let mut f = filters("ev: val > 1");
            let mut out = Vec::new();
            let done = f
                .filter_page(1, &input, PageSource::Ring, &BTreeMap::new(), &mut out)
                .unwrap();
            let want: Vec<_> = events(&input)
                .into_iter()
                .filter(|(_, p)| p[0] == 7 && p[8] > 1)
                .collect();
            assert_eq!(events(&out), want);
            assert_eq!(done.kept as usize, want.len());
            assert_eq!(done.kept + done.dropped, n as u64);
            assert_eq!(out.len(), PAGE);
            let m = missed.map_or(Missed::None, Missed::Count);
            assert_eq!(page_missed(&out), m);
        }
    }

    /// A page shorter than its header is an error, not a panic; a commit past the page
    /// is read to the page's end; a record that does not decode ends the page.
    #[test]
    fn damaged_pages() {
        let mut f = filters("ev");
        let mut out = Vec::new();
        let mut bad = page(0, &[(1, 7, 1)], None);
        bad[8..16].copy_from_slice(&(PAGE as u64).to_le_bytes());
        let done = f
            .filter_page(0, &bad, PageSource::Ring, &BTreeMap::new(), &mut out)
            .unwrap();
        assert_eq!((done.kept, done.cut), (1, true));
        assert!(f
            .filter_page(0, &bad[..8], PageSource::Ring, &BTreeMap::new(), &mut out)
            .is_err());
        let mut cut = page(0, &[(1, 7, 1), (1, 7, 1)], None);
        // The second record's length word says 2 bytes (below 4): it does not decode.
        cut[PAGE_HEADER_SIZE + 16..PAGE_HEADER_SIZE + 20].copy_from_slice(&0u32.to_le_bytes());
        cut[PAGE_HEADER_SIZE + 20..PAGE_HEADER_SIZE + 24].copy_from_slice(&2u32.to_le_bytes());
        let done = f
            .filter_page(0, &cut, PageSource::Ring, &BTreeMap::new(), &mut out)
            .unwrap();
        assert_eq!((done.kept, done.cut), (1, true));
    }

    /// Runs `f` over `page` from the ring, expecting no error.
    fn run(f: &mut FilterSet, page: &[u8], src: PageSource, out: &mut Vec<u8>) -> PageFiltered {
        f.filter_page(0, page, src, &BTreeMap::new(), out)
            .expect("a page with a header filters")
    }

    /// A kept event 2^59 + 2 ticks after the previous kept one (two TIME_EXTENDs of
    /// 2^58 + 1 between them, beyond one TIME_EXTEND and any TIME_STAMP of the page)
    /// is written behind a chain of TIME_EXTENDs, at its exact time.
    #[test]
    fn a_gap_beyond_one_time_extend_is_a_chain() {
        let mut p = page(0, &[(1, 7, 1)], None);
        let mut at = PAGE_HEADER_SIZE + 16;
        for _ in 0..2 {
            p[at..at + 8].copy_from_slice(&encode_time_extend((1 << 58) + 1));
            at += 8;
        }
        let mut hdr = [0u8; 8];
        let n = encode_data_header(&mut hdr, 12, 0);
        p[at..at + n].copy_from_slice(&hdr[..n]);
        p[at + n..at + n + 12].copy_from_slice(&payload(7, 1));
        at += n + 12;
        p[8..16].copy_from_slice(&((at - PAGE_HEADER_SIZE) as u64).to_le_bytes());
        let want = events(&p);
        assert_eq!(want[1].0, (1 << 59) + 3);
        let mut out = Vec::new();
        let done = run(&mut filters("ev"), &p, PageSource::Ring, &mut out);
        assert_eq!((done.kept, done.cut), (2, false));
        assert_eq!(events(&out), want);
    }

    /// 33 long-form events with length word 117 (121 bytes each as the kernel and
    /// trace-cmd read them, 124 re-encoded) fit the input page but not the output:
    /// the 33rd and later are cut, the page is not an error.
    #[test]
    fn kept_events_that_do_not_fit_cut_the_page() {
        let mut p = vec![0u8; PAGE];
        let mut at = PAGE_HEADER_SIZE;
        for i in 0..33u8 {
            p[at..at + 4].copy_from_slice(&header_word(0, 1).to_le_bytes());
            p[at + 4..at + 8].copy_from_slice(&117u32.to_le_bytes());
            p[at + 8..at + 10].copy_from_slice(&7u16.to_le_bytes());
            p[at + 16] = i;
            at += 121;
        }
        let word = (at - PAGE_HEADER_SIZE) as u64 | RB_MISSED_FLAGS;
        p[8..16].copy_from_slice(&word.to_le_bytes());
        p[at..at + 8].copy_from_slice(&9u64.to_le_bytes());
        let want = events(&p);
        assert_eq!(want.len(), 33);
        let mut out = Vec::new();
        let done = run(&mut filters("ev"), &p, PageSource::Ring, &mut out);
        assert!(done.cut);
        assert_eq!(done.kept, 32);
        // Re-encoded, a payload keeps its bytes and gains the padding to 4.
        let got = events(&out);
        assert_eq!(got.len(), 32);
        assert!(got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.0 == w.0 && g.1.len() == 116 && g.1[..113] == w.1[..]));
        assert_eq!(page_missed(&out), Missed::Count(9));
    }

    /// The records of a page as trace-cmd's kbuffer walks them: (offset in the data,
    /// is a data event), up to the commit (27 bits).
    fn kbuffer_records(p: &[u8]) -> Vec<(usize, bool)> {
        let (_, commit) = page_header(p).unwrap();
        let end = PAGE_HEADER_SIZE + (commit & ((1 << 27) - 1)) as usize;
        let data = &p[PAGE_HEADER_SIZE..end];
        let mut recs = Vec::new();
        let mut at = 0;
        while at + 4 <= data.len() {
            let w = u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
            let (size, is_data) = match w & 0x1f {
                29 => (
                    u32::from_le_bytes(data[at + 4..at + 8].try_into().unwrap()) as usize + 4,
                    false,
                ),
                30 | 31 => (8, false),
                0 => (
                    u32::from_le_bytes(data[at + 4..at + 8].try_into().unwrap()) as usize + 4,
                    true,
                ),
                n => (4 + 4 * n as usize, true),
            };
            recs.push((at, is_data));
            at += size;
        }
        recs
    }

    /// kbuffer shows a page's loss only on a data record at offset 0: the output
    /// page's time stamp is the first kept event's time, so it has delta 0 there even
    /// when the dropped events before it took more than 27 bits of time.
    #[test]
    fn the_first_kept_event_is_at_offset_0() {
        let input = page(100, &[(1 << 30, 8, 0), (5, 7, 1), (7, 7, 1)], Some(5));
        let mut out = Vec::new();
        let done = run(&mut filters("ev"), &input, PageSource::Ring, &mut out);
        assert_eq!(done.kept, 2);
        assert_eq!(kbuffer_records(&out)[0], (0, true));
        assert_eq!(page_header(&out).unwrap().0, 100 + (1 << 30) + 5);
        assert_eq!(events(&out), events(&input)[1..]);
        assert_eq!(page_missed(&out), Missed::Count(5));
    }

    /// A trace.dat page is read with kbuffer's 27-bit commit: bits 27-29 set over a
    /// one-event length leave the stale events after it out; the output's commit
    /// holds only the loss flags of the input's high bits.
    #[test]
    fn a_trace_dat_page_is_read_with_kbuffers_mask() {
        let mut p = page(0, &[(1, 7, 1), (1, 7, 1), (1, 7, 1)], None);
        let word = 16u64 | (0b111 << 27) | (1 << 40);
        p[8..16].copy_from_slice(&word.to_le_bytes());
        let mut out = Vec::new();
        let done = run(&mut filters("ev"), &p, PageSource::TraceDat, &mut out);
        assert_eq!((done.kept, done.cut), (1, false));
        let (_, commit) = page_header(&out).unwrap();
        assert_eq!(commit, 16);
    }

    /// What a [`FilteredSink`] hands on.
    #[derive(Debug, PartialEq, Eq)]
    enum Call {
        Page(u32, u64, Missed),
        Quiet(u32, u64),
        Trailing(u32, u64),
    }

    struct Log(Arc<Mutex<Vec<Call>>>);

    impl PageSink for Log {
        fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
            let ts = page_header(page).unwrap().0;
            self.0.lock().unwrap().push(Call::Page(cpu, ts, missed));
            Ok(())
        }
        fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
            self.0.lock().unwrap().push(Call::Quiet(cpu, ts));
            Ok(())
        }
        fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
            self.0.lock().unwrap().push(Call::Trailing(cpu, lost));
            Ok(())
        }
        fn finish(self: Box<Self>, _: &RunSummary) -> Result<(), OutputError> {
            Ok(())
        }
    }

    /// A page the filter empties is not handed on: the inner sink hears the CPU's
    /// clock moved on, and the page's loss goes to the CPU's next page handed on (or
    /// to `trailing_lost` at the end).
    #[test]
    fn empty_pages_move_the_clock_and_carry_their_loss() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (mut sink, counts) = FilteredSink::new(
            Box::new(Log(Arc::clone(&log))),
            filters("ev"),
            PageSource::Ring,
            BTreeMap::new(),
        );
        let other = page(10, &[(5, 8, 0)], None);
        let kept = page(100, &[(3, 7, 1)], None);
        sink.page(0, &other, Missed::Count(4)).unwrap();
        sink.page(0, &other, Missed::None).unwrap();
        sink.page(0, &kept, Missed::Count(2)).unwrap();
        sink.page(1, &other, Missed::Count(6)).unwrap();
        // A loss of unknown count is carried as one, never as no loss.
        sink.page(2, &other, Missed::Unknown).unwrap();
        sink.page(2, &kept, Missed::None).unwrap();
        Box::new(sink).finish(&RunSummary::default()).unwrap();
        let calls = std::mem::take(&mut *log.lock().unwrap());
        assert_eq!(
            calls,
            [
                Call::Quiet(0, 15),
                Call::Quiet(0, 15),
                Call::Page(0, 103, Missed::Count(6)),
                Call::Quiet(1, 15),
                Call::Quiet(2, 15),
                Call::Page(2, 103, Missed::Unknown),
                Call::Trailing(1, 6),
            ]
        );
        assert_eq!((counts.kept(), counts.dropped(), counts.cut()), (2, 4, 0));
    }

    /// A writer into a shared buffer.
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A CPU whose events the filter all drops does not hold the other CPU's events
    /// back in the text sink's merger: past its window (2^18 events) that would print
    /// a "merge window exceeded" line.
    #[test]
    fn a_cpu_the_filter_empties_does_not_hold_the_text_merge() {
        use crate::StreamSink as _;
        let meta = crate::TraceMeta {
            page_size: PAGE,
            nr_cpus: 2,
            cmdlines: BTreeMap::new(),
            clock: crate::Clock::raw_tsc(),
            formats: formats(),
            groups: Vec::new(),
        };
        let buf = Arc::new(Mutex::new(Vec::new()));
        let text = crate::TextSink::to_writer(Box::new(Shared(Arc::clone(&buf))), meta).unwrap();
        let (mut sink, counts) = FilteredSink::new(
            Box::new(text),
            filters("ev"),
            PageSource::Ring,
            BTreeMap::new(),
        );
        let per_page = 250u64;
        let pages = (1 << 18) / per_page + 100;
        for n in 0..pages {
            let ts = n * per_page * 10;
            let other: Vec<_> = (0..per_page).map(|_| (10, 8, 0)).collect();
            let ev: Vec<_> = (0..per_page).map(|_| (10, 7, 1)).collect();
            sink.page(0, &page(ts, &other, None), Missed::None).unwrap();
            sink.page(1, &page(ts + 5, &ev, None), Missed::None)
                .unwrap();
        }
        Box::new(sink).finish(&RunSummary::default()).unwrap();
        assert_eq!(counts.kept(), pages * per_page);
        let out = String::from_utf8(std::mem::take(&mut *buf.lock().unwrap())).unwrap();
        // The `cpus=2` header, then every kept event.
        assert_eq!(out.lines().count() as u64, 1 + pages * per_page);
        assert!(!out.contains("merge window exceeded"));
    }
}
