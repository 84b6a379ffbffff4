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

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hyptrace_abi::page::{
    encode_data_header, encode_time_extend, fix_abs_ts, header_word, page_header, Events,
    COMMIT_LEN_MASK, COMMIT_OFFSET, DELTA_BITS, MAX_DELTA, MAX_EXTENDED_DELTA, PAGE_HEADER_SIZE,
    RB_MISSED_EVENTS, RB_MISSED_STORED, TYPE_TIME_STAMP,
};

use super::FilterSet;
use crate::sink::{OutputWaits, PageSink, RunSummary};
use crate::OutputError;

/// What [`FilterSet::filter_page`] did with a page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageFiltered {
    /// Events kept.
    pub kept: u64,
    /// Events the filters rejected.
    pub dropped: u64,
    /// The page stopped decoding here (its later records are not in the output).
    pub cut: bool,
}

/// Why a page could not be re-encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageFilterError {
    /// Shorter than its header.
    #[error("a page of {0} bytes is shorter than its header")]
    Short(usize),
    /// The kept events do not fit the page (an input with unusual long-form lengths).
    #[error("the kept events need {0} bytes, more than the page's {1}")]
    Overflow(usize, usize),
    /// A time the page's time stamp cannot reach.
    #[error("an event time {0:#x} no TIME_STAMP of this page can carry")]
    Time(u64),
}

/// Writes `bytes` at `*at` of `out`, advancing `*at`; `Overflow` past `limit`.
fn put(out: &mut [u8], at: &mut usize, limit: usize, bytes: &[u8]) -> Result<(), PageFilterError> {
    let end =
        at.checked_add(bytes.len())
            .filter(|&e| e <= limit)
            .ok_or(PageFilterError::Overflow(
                at.saturating_add(bytes.len()),
                limit,
            ))?;
    out[*at..end].copy_from_slice(bytes);
    *at = end;
    Ok(())
}

/// The time records that bring the clock from `prev` to `ts` (the event then carries
/// the returned delta).
fn time_records(
    out: &mut [u8],
    at: &mut usize,
    limit: usize,
    prev: u64,
    ts: u64,
    page_ts: u64,
) -> Result<u32, PageFilterError> {
    let delta = ts.wrapping_sub(prev);
    if ts >= prev && delta <= MAX_DELTA {
        return Ok(delta as u32);
    }
    if ts >= prev && delta <= MAX_EXTENDED_DELTA {
        put(out, at, limit, &encode_time_extend(delta))?;
        return Ok(0);
    }
    let abs = ts & MAX_EXTENDED_DELTA;
    if fix_abs_ts(abs, page_ts) != ts {
        return Err(PageFilterError::Time(ts));
    }
    let lo = header_word(TYPE_TIME_STAMP, (abs & MAX_DELTA) as u32).to_le_bytes();
    let hi = ((abs >> DELTA_BITS) as u32).to_le_bytes();
    put(out, at, limit, &lo)?;
    put(out, at, limit, &hi)?;
    Ok(0)
}

impl FilterSet {
    /// Re-encodes data page `page` of `cpu` into `out` (cleared, then `page.len()`
    /// bytes) with only the events the filters pass ([`FilterSet::wants`], so the
    /// stack traces after a kept event stay too). A record that does not decode ends
    /// the page (`cut`): what came before it is kept or dropped as the filters say; a
    /// commit past the page is read up to the page's end (`cut` too).
    pub fn filter_page(
        &mut self,
        cpu: u32,
        page: &[u8],
        cmdlines: &BTreeMap<i32, String>,
        out: &mut Vec<u8>,
    ) -> Result<PageFiltered, PageFilterError> {
        let (page_ts, commit) = page_header(page).ok_or(PageFilterError::Short(page.len()))?;
        let len = commit & COMMIT_LEN_MASK;
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
        out[..8].copy_from_slice(&page_ts.to_le_bytes());
        let limit = page.len() - stored.map_or(0, <[u8]>::len);
        let mut at = PAGE_HEADER_SIZE;
        let mut done = PageFiltered {
            cut: past,
            ..PageFiltered::default()
        };
        let mut prev = page_ts;
        // Bounded: the iterator consumes at least 4 bytes of the page per record.
        for ev in Events::new(&page[PAGE_HEADER_SIZE..end], page_ts) {
            let Ok(ev) = ev else {
                done.cut = true;
                break;
            };
            if !self.wants(ev.payload, cpu, cmdlines) {
                done.dropped += 1;
                continue;
            }
            let delta = time_records(out, &mut at, limit, prev, ev.ts, page_ts)?;
            let mut hdr = [0u8; 8];
            let n = encode_data_header(&mut hdr, ev.payload.len(), delta);
            put(out, &mut at, limit, &hdr[..n])?;
            put(out, &mut at, limit, ev.payload)?;
            let pad = hyptrace_abi::page::align4(ev.payload.len()) - ev.payload.len();
            put(out, &mut at, limit, &[0u8; 3][..pad])?;
            prev = ev.ts;
            done.kept += 1;
        }
        if let Some(count) = stored {
            out[at..at + count.len()].copy_from_slice(count);
        }
        // A stored flag whose count the page did not hold says no more than "some".
        let flags = match stored {
            Some(_) => commit & !COMMIT_LEN_MASK,
            None => commit & !COMMIT_LEN_MASK & !RB_MISSED_STORED,
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

    /// The filters that passed no event (known once the sink finished).
    pub fn unmatched(&self) -> Vec<String> {
        self.unmatched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A [`PageSink`] that hands each page to `inner` without the events a [`FilterSet`]
/// rejects ([`FilterSet::filter_page`]): one filter for every output format. A page
/// left with no event and no loss is not handed on.
pub struct FilteredSink {
    inner: Box<dyn PageSink + Send>,
    filters: FilterSet,
    cmdlines: BTreeMap<i32, String>,
    buf: Vec<u8>,
    counts: Arc<FilterCounts>,
}

impl FilteredSink {
    /// `inner` behind `filters` (compiled against the formats `inner` writes; `cmdlines`
    /// give `COMM`); the counts are shared through the returned handle.
    pub fn new(
        inner: Box<dyn PageSink + Send>,
        filters: FilterSet,
        cmdlines: BTreeMap<i32, String>,
    ) -> (Self, Arc<FilterCounts>) {
        let counts = Arc::new(FilterCounts::default());
        let sink = Self {
            inner,
            filters,
            cmdlines,
            buf: Vec::new(),
            counts: Arc::clone(&counts),
        };
        (sink, counts)
    }
}

impl PageSink for FilteredSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Option<u64>) -> Result<(), OutputError> {
        let done = self
            .filters
            .filter_page(cpu, page, &self.cmdlines, &mut self.buf)
            .map_err(|e| OutputError::BadPage {
                cpu,
                reason: format!("-F: {e}"),
            })?;
        self.counts.kept.fetch_add(done.kept, Ordering::Relaxed);
        self.counts
            .dropped
            .fetch_add(done.dropped, Ordering::Relaxed);
        let lossy = missed.is_some_and(|n| n > 0)
            || page_header(page).is_some_and(|(_, c)| c & RB_MISSED_EVENTS != 0);
        if done.kept == 0 && !lossy {
            return Ok(());
        }
        self.inner.page(cpu, &self.buf, missed)
    }

    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        self.inner.trailing_lost(cpu, lost)
    }

    fn end_cpu(&mut self, cpu: u32) -> Result<(), OutputError> {
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

    fn finish(self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
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
            .filter_page(0, &input, &BTreeMap::new(), &mut out)
            .unwrap();
        assert_eq!(
            done,
            PageFiltered {
                kept: 3,
                dropped: 2,
                cut: false
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
        assert_eq!(&out[..8], &input[..8]);
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
                .filter_page(1, &input, &BTreeMap::new(), &mut out)
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
        let done = f.filter_page(0, &bad, &BTreeMap::new(), &mut out).unwrap();
        assert_eq!((done.kept, done.cut), (1, true));
        assert!(f
            .filter_page(0, &bad[..8], &BTreeMap::new(), &mut out)
            .is_err());
        let mut cut = page(0, &[(1, 7, 1), (1, 7, 1)], None);
        // The second record's length word says 2 bytes (below 4): it does not decode.
        cut[PAGE_HEADER_SIZE + 16..PAGE_HEADER_SIZE + 20].copy_from_slice(&0u32.to_le_bytes());
        cut[PAGE_HEADER_SIZE + 20..PAGE_HEADER_SIZE + 24].copy_from_slice(&2u32.to_le_bytes());
        let done = f.filter_page(0, &cut, &BTreeMap::new(), &mut out).unwrap();
        assert_eq!((done.kept, done.cut), (1, true));
    }
}
