//! What `explore.rs` checks: S1 at rest over all pages of the CPU, and the events a
//! consuming read hands out (indexes, timestamps, losses).

use hyptrace_abi::layout::{
    ctl, footer, link_id, RingGeometry, FT_COMMIT, FT_HEAD, FT_READER, LINK_FLAGS, LINK_HEAD,
};
use hyptrace_abi::page::{Events, PAGE_HEADER_SIZE};
use hyptrace_abi::{HeapMem, SharedMem};
use hyptrace_reader::{Item, PageOut};
use std::sync::atomic::Ordering::Acquire;

/// The text of the S1 failure a swap that gives up with a flag left on the reader
/// page's link causes (the seeded bug's test looks for it).
pub const S1_FLAGGED_LINKS: &str = "S1 broken: links carrying a flag";

/// The payload of event `seq` written at `ts`: `seq` (u64 LE), `ts` (u64 LE), then
/// filler up to `len` (≥ 16) bytes.
pub fn payload(seq: u64, ts: u64, len: usize) -> Vec<u8> {
    let mut p = vec![0xa5; len.max(16)];
    p[..8].copy_from_slice(&seq.to_le_bytes());
    p[8..16].copy_from_slice(&ts.to_le_bytes());
    p
}

/// Invariant S1 of `cpu`'s ring at rest (no write, swap or update in progress), read
/// straight from the region (no yield points): exactly one page has FT_READER (the
/// control block's reader page), one FT_COMMIT (its tail page), one FT_HEAD (not the
/// reader page); exactly one page link carries a flag, HEAD, naming the FT_HEAD page;
/// the ring walked from the head holds every page but the reader page, once.
pub fn assert_s1(m: &HeapMem, l: &RingGeometry, cpu: u32, what: &str) {
    let ld = |off: usize| m.load(off, Acquire);
    let first = l.first_page(cpu);
    let pages: Vec<u32> = (first..first + l.pages_per_cpu).collect();
    let (r, t) = (
        ld(l.ctl(cpu) + ctl::READER_PAGE),
        ld(l.ctl(cpu) + ctl::TAIL_PAGE),
    );
    assert!(
        l.owns(cpu, r) && l.owns(cpu, t),
        "{what}: reader page {r}, tail {t}"
    );
    let with = |off: usize, bit: u64| -> Vec<u32> {
        let set = |&p: &u32| ld(l.footer_off(p) + off) & bit != 0;
        pages.iter().copied().filter(set).collect()
    };
    let links: Vec<u64> = pages
        .iter()
        .map(|&p| ld(l.footer_off(p) + footer::NEXT))
        .collect();
    let state = format!("reader page {r}, tail {t}, links {links:x?}");
    let readers = with(footer::READER_STATUS, FT_READER);
    assert_eq!(
        readers,
        vec![r as u32],
        "{what}: S1: FT_READER pages ({state})"
    );
    let commits = with(footer::WRITER_STATUS, FT_COMMIT);
    assert_eq!(
        commits,
        vec![t as u32],
        "{what}: S1: FT_COMMIT pages ({state})"
    );
    let heads = with(footer::WRITER_STATUS, FT_HEAD);
    assert_eq!(heads.len(), 1, "{what}: S1: FT_HEAD on {heads:?} ({state})");
    let flagged: Vec<(u32, u64)> = pages
        .iter()
        .zip(&links)
        .filter(|&(_, &lk)| lk & LINK_FLAGS != 0)
        .map(|(&p, &lk)| (p, lk))
        .collect();
    assert_eq!(
        flagged.len(),
        1,
        "{what}: {S1_FLAGGED_LINKS} (page, link): {flagged:x?}, exactly one must ({state})"
    );
    let (_, hl) = flagged[0];
    assert_eq!(
        hl & LINK_FLAGS,
        LINK_HEAD,
        "{what}: S1: the flag is not HEAD ({state})"
    );
    assert_eq!(
        link_id(hl),
        u64::from(heads[0]),
        "{what}: S1: the HEAD link names another page than FT_HEAD {heads:?} ({state})"
    );
    // The ring from the head: every page but the reader page, once, back to the head.
    let mut seen = vec![heads[0]];
    let mut p = heads[0];
    for _ in 2..l.pages_per_cpu {
        let lk = ld(l.footer_off(p) + footer::NEXT);
        assert!(
            l.owns(cpu, link_id(lk)),
            "{what}: S1: link {lk:#x} of page {p} ({state})"
        );
        p = link_id(lk) as u32;
        seen.push(p);
    }
    let back = link_id(ld(l.footer_off(p) + footer::NEXT));
    let mut ring = seen.clone();
    ring.sort_unstable();
    let expect: Vec<u32> = pages
        .iter()
        .copied()
        .filter(|&q| u64::from(q) != r)
        .collect();
    assert!(
        ring == expect && back == u64::from(heads[0]),
        "{what}: S1: the ring from the head is {seen:?} then {back}, not every page but the \
         reader page once ({state})"
    );
}

/// What a consuming read handed out so far, checked item by item: every event's index
/// (the first 8 bytes of its payload) is the next one expected plus the losses reported
/// right before it; its timestamp is the one in its payload and never goes back.
#[derive(Debug, Default, Clone)]
pub struct ReadCheck {
    /// The index of the next event expected.
    pub next: u64,
    /// Losses reported but not yet followed by an event.
    pub pending: u64,
    /// Events read.
    pub read: u64,
    /// Events lost, as reported.
    pub lost: u64,
    last_ts: u64,
}

impl ReadCheck {
    /// Takes one item of [`hyptrace_reader::RingBuffer::next_event`].
    pub fn item(&mut self, item: Item<'_>, what: &str) {
        match item {
            Item::Lost(n) => {
                assert!(n > 0, "{what}: a loss of 0 events");
                self.pending += n;
            }
            Item::Event { ts, payload } => self.event(ts, payload, what),
        }
    }

    fn event(&mut self, ts: u64, payload: &[u8], what: &str) {
        assert!(
            payload.len() >= 16,
            "{what}: payload of {} bytes",
            payload.len()
        );
        let seq = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
        let stamp = u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes"));
        assert_eq!(
            seq,
            self.next + self.pending,
            "{what}: event {seq} read, expected {} after {} lost",
            self.next,
            self.pending
        );
        assert_eq!(ts, stamp, "{what}: event {seq}: timestamp");
        assert!(ts >= self.last_ts, "{what}: event {seq}: time went back");
        self.last_ts = ts;
        self.lost += std::mem::take(&mut self.pending);
        self.next = seq + 1;
        self.read += 1;
    }

    /// Takes one page of [`hyptrace_reader::RingBuffer::next_page`]: its loss, then its
    /// events decoded from the copy, which must number `page.events`.
    pub fn page(&mut self, page: &PageOut<'_>, what: &str) {
        self.pending += page.missed;
        let ts0 = u64::from_le_bytes(page.bytes[..8].try_into().expect("8 bytes"));
        let data = &page.bytes[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + page.commit_len];
        let mut n = 0;
        for ev in Events::new(data, ts0) {
            let ev = ev.unwrap_or_else(|e| panic!("{what}: page handed out: {e}"));
            self.event(ev.ts, ev.payload, what);
            n += 1;
        }
        assert_eq!(n, page.events, "{what}: events on a page handed out");
    }

    /// The read ended: losses with no event after them count too.
    pub fn end(&mut self) {
        self.lost += std::mem::take(&mut self.pending);
    }
}
