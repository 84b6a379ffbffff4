//! Model checking (loom) of the real writer against the real writer-domain swap.
//!
//! Run (the CI runs exactly these; `--nocapture` shows each model's execution count):
//!
//! ```text
//! # the models (the correct protocol: every execution must pass)
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p hyptrace-writer --release --test loom -- --nocapture
//! # seeded bug 1 (push_head does not flag the new head): caught as an S1 violation
//! RUSTFLAGS="--cfg loom --cfg hyptrace_seeded_bug" CARGO_TARGET_DIR=target/loom-seeded \
//!     LOOM_MAX_PREEMPTIONS=2 cargo test -p hyptrace-writer --release --test loom
//! # seeded bug 3 (`released` loaded Relaxed by the writer, R2): a causality violation
//! RUSTFLAGS="--cfg loom --cfg hyptrace_seeded_bug_relaxed_release" \
//!     CARGO_TARGET_DIR=target/loom-seeded3 LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p hyptrace-writer --release --test loom
//! # seeded bug 4 (a swap that gives up leaves `after|HEAD` in the reader page's link,
//! # S1, issue 27): caught as two flagged links at rest
//! RUSTFLAGS="--cfg loom --cfg hyptrace_seeded_bug_contended_link" \
//!     CARGO_TARGET_DIR=target/loom-seeded4 LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p hyptrace-writer --release --test loom
//! # seeded bug 2 (the commit published Relaxed, W1): caught as a causality violation
//! RUSTFLAGS="--cfg loom --cfg hyptrace_seeded_bug_relaxed_commit" \
//!     CARGO_TARGET_DIR=target/loom-seeded2 LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p hyptrace-writer --release --test loom
//! ```
//!
//! Each model ([`Model`]): one CPU, a ring of 4 pages (the reader page and 3 ring pages;
//! 3 in the lap model, 5 in the five-page one) in a loom [`Region`]; a writer thread writes events (one-page
//! payloads, so every event after the first moves the tail: `move_tail`, and in
//! overwrite mode `push_head`; or three 1300-byte events and a TIME_EXTEND per page),
//! while a reader thread reads the reader page and gets the next one like the host
//! reader — a plain swap, a hinted swap (as `Direct` does), or a swap request in the
//! mailbox that the writer thread serves between its writes — only once the writer left
//! the reader page, after reading that page completely; or, with released pages, reads
//! the ring pages in place after the writer and releases them, and the writer swaps
//! them back itself. A swap that loses to the writer
//! (`Contended`) and a request left unanswered are outcomes; while a request is in
//! flight the reader does not touch its page (M1). Afterwards the main thread answers a
//! request still in flight, checks the ring (S1: one FT_READER / FT_COMMIT / FT_HEAD,
//! exactly one flagged link among all pages — the reader page's included — HEAD, naming
//! the FT_HEAD page, no UPDATE, the reader page outside the ring),
//! reads everything left in ring order, and checks the events: in order, each seq equal
//! to its index, timestamps as written, gaps exactly the `first_index` jumps, read +
//! lost == attempts, lost == overrun + dropped.
//!
//! Under loom the writer crate's `relax()` does not yield (a spin hint, as in the real
//! build) and a swap gives up after 3 attempts instead of 16 (`SWAP_RETRIES`, which also
//! bounds the rounds of the swap's FT_HEAD fix-up, `mark_new_head`): with a yield between
//! attempts the writer always finished what made an attempt fail, so no execution could
//! make a swap give up (issue 27's two-HEAD state was out of reach); with 16 attempts
//! the models take 10-40 times longer for the same code path. The cost: the writer
//! running between two attempts is a preemption now, where a yield was free.
//!
//! The region: every 8-byte word is either atomic (pack, control blocks, footers, the
//! page `commit` words: loom `AtomicU64`) or plain data (page `time_stamp` and data
//! areas: `loom::cell::UnsafeCell<u32>` per 4 bytes, so loom reports a read of event
//! bytes that is not ordered after their write by the commit's Release/Acquire). An
//! atomic access to a plain word, or the reverse, panics.
#![cfg(loom)]
// A seeded-bug build runs only the model that must catch its bug, so some payload sizes
// and swap paths the other models use go unused there.
#![cfg_attr(
    any(
        hyptrace_seeded_bug,
        hyptrace_seeded_bug_relaxed_commit,
        hyptrace_seeded_bug_relaxed_release,
        hyptrace_seeded_bug_contended_link
    ),
    allow(dead_code)
)]

use hyptrace_abi::layout::{
    ctl, footer, link_id, Mode, RingGeometry, FOOTER_SIZE, FT_COMMIT, FT_HEAD, FT_READER,
    LINK_FLAGS, LINK_HEAD, MBOX_OP_SWAP, MBOX_STATUS_BUSY, MBOX_STATUS_CONTENDED, MBOX_STATUS_OK,
};
use hyptrace_abi::page::{Events, COMMIT_LEN_MASK, COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_abi::SharedMem;
use hyptrace_writer::{
    swap_reader_page, swap_reader_page_hinted, SwapHint, SwapStatus, WriteOutcome, Writer,
};
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::Ordering::{Acquire, Release};
use std::sync::Arc;

/// One 8-byte word of the region.
enum Slot {
    /// Never accessed (padding between the control blocks and the pages).
    Unused,
    Atomic(AtomicU64),
    /// Plain data, as two 4-byte cells (events are 4-byte aligned).
    Plain([UnsafeCell<u32>; 2]),
}

/// A trace region for loom: see the module doc.
struct Region {
    slots: Vec<Slot>,
}

// SAFETY: the plain cells are loom `UnsafeCell`s, only accessed through `with` /
// `with_mut`, which loom checks for data races; the atomics are loom atomics.
unsafe impl Sync for Region {}
// SAFETY: as above; the region owns its cells.
unsafe impl Send for Region {}

impl Region {
    fn new(l: &RingGeometry) -> Self {
        let used_header = l.ctl_off + l.nr_cpus as usize * hyptrace_abi::layout::CTL_SIZE;
        let slots = (0..l.region_size / 8)
            .map(|w| {
                let off = w * 8;
                if off < l.pages_off {
                    return if off < used_header {
                        Slot::Atomic(AtomicU64::new(0))
                    } else {
                        Slot::Unused
                    };
                }
                let in_page = (off - l.pages_off) % l.page_size;
                let plain = in_page < COMMIT_OFFSET
                    || (PAGE_HEADER_SIZE..l.page_size - FOOTER_SIZE).contains(&in_page);
                if plain {
                    Slot::Plain([UnsafeCell::new(0), UnsafeCell::new(0)])
                } else {
                    Slot::Atomic(AtomicU64::new(0))
                }
            })
            .collect();
        Self { slots }
    }

    fn atomic(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0, "unaligned atomic access at {off:#x}");
        match &self.slots[off / 8] {
            Slot::Atomic(a) => a,
            _ => panic!("atomic access to a plain or unused word at {off:#x}"),
        }
    }

    fn cell(&self, off: usize) -> &UnsafeCell<u32> {
        match &self.slots[off / 8] {
            Slot::Plain(c) => &c[(off % 8) / 4],
            _ => panic!("plain access to an atomic or unused word at {off:#x}"),
        }
    }

    /// Applies `f(cell offset, byte range within the cell, range within the buffer)`
    /// over `[off, off + len)`, one call per 4-byte cell.
    fn cells(&self, off: usize, len: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
        assert!(off + len <= self.size(), "range outside the region");
        let mut i = 0;
        while i < len {
            let a = off + i;
            let base = a & !3;
            let lo = a - base;
            let n = (4 - lo).min(len - i);
            f(base, lo, i, n);
            i += n;
        }
    }
}

impl SharedMem for Region {
    fn size(&self) -> usize {
        self.slots.len() * 8
    }
    hyptrace_abi::atomic_word_ops!(self, atomic);
    fn write_bytes(&self, off: usize, src: &[u8]) {
        self.cells(off, src.len(), |base, lo, i, n| {
            self.cell(base).with_mut(|p| {
                // SAFETY: loom hands out exclusive access for the closure (and reports a
                // race if another thread accesses the cell concurrently).
                let v = unsafe { &mut *p };
                let mut b = v.to_le_bytes();
                b[lo..lo + n].copy_from_slice(&src[i..i + n]);
                *v = u32::from_le_bytes(b);
            })
        })
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        self.cells(off, dst.len(), |base, lo, i, n| {
            // SAFETY: loom checks this read against concurrent writes of the cell.
            let v = self.cell(base).with(|p| unsafe { *p });
            dst[i..i + n].copy_from_slice(&v.to_le_bytes()[lo..lo + n]);
        })
    }
}

type Mem = Arc<Region>;

/// Pages of a CPU (the reader page and 3 ring pages), unless a model says otherwise.
const PAGES: u32 = 4;
const PAGE: usize = 4096;
/// A payload that fills most of a page: two never fit one page.
const BIG: usize = 2000;
/// Three of these and a TIME_EXTEND fit one page (3 × 1308 + 8 ≤ 3984 bytes).
const SMALL: usize = 1300;

fn ld(m: &Region, off: usize) -> u64 {
    m.load(off, Acquire)
}

/// An event's payload: its index and its timestamp, then filler.
fn payload(seq: u64, ts: u64, len: usize) -> Vec<u8> {
    let mut p = vec![0x5a; len];
    p[..8].copy_from_slice(&seq.to_le_bytes());
    p[8..16].copy_from_slice(&ts.to_le_bytes());
    p
}

/// How the reader gets the next page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// `swap_reader_page`, without a hint.
    Plain,
    /// `swap_reader_page_hinted`, keeping the hint (as the host's `Direct` does).
    Hinted,
    /// A swap request in the mailbox, run by the writer thread between its writes
    /// (`Writer::serve_mailbox`, `--swap guest`).
    Mailbox,
    /// Hinted and plain swaps in turn, one hint kept across them (as the concurrent
    /// stress in `tests/core_footers.rs` does): a hinted swap after a plain one starts
    /// its search at a page two swaps old.
    Mixed,
    /// Released pages (stop mode, `--swap guest`): the reader reads the ring pages in
    /// place, following the writer's links, and releases each page it has read with one
    /// store of its `page_seq` in `released`; the writer swaps released pages back by
    /// itself when its tail meets them. No request.
    Release,
}

/// The host reader, reduced to what the model needs: it tracks the reader page, how
/// many of its events were read, and the index of the next event.
#[derive(Debug)]
struct MiniReader {
    page: u32,
    seen: usize,
    expected: u64,
    lost: u64,
    read: u64,
    via: Via,
    hint: SwapHint,
    mbox_seq: u64,
    /// A mailbox request is in flight: the reader page is not touched (M1).
    pending: bool,
    /// Swaps asked for so far (`Via::Mixed` alternates by it).
    asked: u64,
    /// The last `page_seq` stored in `released` (Release).
    released: u64,
    /// Swaps that lost to the writer, and requests left unanswered for now: outcomes.
    contended: u64,
    unanswered: u64,
}

impl MiniReader {
    fn new(m: &Region, l: &RingGeometry, via: Via) -> Self {
        let page = ld(m, l.ctl(0) + ctl::READER_PAGE) as u32;
        let expected = ld(m, l.footer_off(page) + footer::FIRST_INDEX);
        Self {
            page,
            seen: 0,
            expected,
            lost: 0,
            read: 0,
            via,
            hint: SwapHint::default(),
            mbox_seq: 0,
            pending: false,
            asked: 0,
            released: 0,
            contended: 0,
            unanswered: 0,
        }
    }

    /// Reads the events of the reader page committed so far and not read yet.
    fn read_committed(&mut self, m: &Region, l: &RingGeometry) {
        let off = l.page_off(self.page);
        let commit = ld(m, off + COMMIT_OFFSET);
        let len = (commit & COMMIT_LEN_MASK) as usize;
        assert!(len <= l.data_capacity(), "commit {commit:#x}");
        if len == 0 {
            return;
        }
        let mut buf = vec![0u8; PAGE_HEADER_SIZE + len];
        m.read_bytes(off, &mut buf[..8]);
        m.read_bytes(off + PAGE_HEADER_SIZE, &mut buf[PAGE_HEADER_SIZE..]);
        let ts = u64::from_le_bytes(buf[..8].try_into().unwrap());
        let events: Vec<u64> = Events::new(&buf[PAGE_HEADER_SIZE..], ts)
            .map(|e| {
                let e = e.expect("committed data decodes");
                assert!(e.payload.len() >= 16, "payload {}", e.payload.len());
                assert_eq!(
                    e.ts,
                    u64::from_le_bytes(e.payload[8..16].try_into().unwrap()),
                    "timestamp"
                );
                u64::from_le_bytes(e.payload[..8].try_into().unwrap())
            })
            .collect();
        assert!(
            events.len() >= self.seen,
            "events disappeared from the reader page"
        );
        for &seq in &events[self.seen..] {
            assert_eq!(
                seq, self.expected,
                "event out of order or loss not at a page start"
            );
            self.expected += 1;
            self.read += 1;
        }
        self.seen = events.len();
    }

    /// Makes `page` the page being read, counting the loss before it.
    fn enter(&mut self, m: &Region, l: &RingGeometry, page: u32) {
        let first = ld(m, l.footer_off(page) + footer::FIRST_INDEX);
        assert!(
            first >= self.expected,
            "page {page} starts before events read"
        );
        self.lost += first - self.expected;
        self.expected = first;
        self.page = page;
        self.seen = 0;
    }

    /// The swap handed out `page`: read it.
    fn swapped(&mut self, m: &Region, l: &RingGeometry, page: u32) {
        assert_ne!(page, self.page);
        assert_eq!(ld(m, l.ctl(0) + ctl::READER_PAGE), u64::from(page));
        self.enter(m, l, page);
        self.read_committed(m, l);
    }

    /// Looks for the answer to the request in flight, `tries` times (yielding between:
    /// the host's bounded spin). Returns whether a page was swapped in.
    fn poll_answer(&mut self, m: &Region, l: &RingGeometry, tries: usize) -> bool {
        for i in 0..tries {
            let ack = ld(m, l.ctl(0) + ctl::MBOX_ACK);
            if ack >> 8 == self.mbox_seq {
                self.pending = false;
                return match ack & 0xff {
                    MBOX_STATUS_OK => {
                        let page = ld(m, l.ctl(0) + ctl::READER_PAGE) as u32;
                        self.swapped(m, l, page);
                        true
                    }
                    MBOX_STATUS_CONTENDED => {
                        self.contended += 1;
                        false
                    }
                    MBOX_STATUS_BUSY => panic!("busy although the writer left the reader page"),
                    s => panic!("mailbox status {s}"),
                };
            }
            if i + 1 < tries {
                loom::thread::yield_now();
            }
        }
        self.unanswered += 1;
        false
    }

    /// One step of the live reader: read the reader page; if the writer has left it,
    /// swap and read the new one.
    fn step(&mut self, m: &Region, l: &RingGeometry) -> bool {
        let c = l.ctl(0);
        if self.pending {
            // M1: nothing of the reader page is touched while the request is in flight.
            return self.poll_answer(m, l, 2);
        }
        if self.via != Via::Release {
            assert_eq!(ld(m, c + ctl::READER_PAGE), u64::from(self.page));
        }
        // The tail before the commit: if the writer left the page, what is read next is
        // final.
        let tail = ld(m, c + ctl::TAIL_PAGE) as u32;
        self.read_committed(m, l);
        if tail == self.page {
            return false;
        }
        self.asked += 1;
        let status = match self.via {
            Via::Plain => swap_reader_page(m, l, 0),
            Via::Hinted => swap_reader_page_hinted(m, l, 0, &mut self.hint),
            Via::Mixed if self.asked % 2 == 1 => swap_reader_page_hinted(m, l, 0, &mut self.hint),
            Via::Mixed => swap_reader_page(m, l, 0),
            Via::Release => {
                // The writer left the page: its link names where the writer went (the
                // link of an unreleased page the writer left does not change). Read
                // that page in place (a write of the writer to it would be a race loom
                // reports), then release the page left: everything of it was read.
                let f = l.footer_off(self.page);
                let lk = ld(m, f + footer::NEXT);
                assert_eq!(lk & LINK_FLAGS, 0, "the link the writer moved along");
                let left = ld(m, f + footer::PAGE_SEQ);
                self.enter(m, l, link_id(lk) as u32);
                if left > self.released {
                    self.released = left;
                    m.store(c + ctl::RELEASED, left, Release);
                }
                // As the real reader: the new page's bytes are read after the release
                // (its next round), while the writer may already take the page left.
                self.read_committed(m, l);
                return true;
            }
            Via::Mailbox => {
                self.mbox_seq += 1;
                m.store(
                    c + ctl::MBOX_REQ,
                    (self.mbox_seq << 8) | MBOX_OP_SWAP,
                    Release,
                );
                self.pending = true;
                return self.poll_answer(m, l, 2);
            }
        };
        match status.expect("swap failed: the ring is inconsistent") {
            SwapStatus::Swapped { page } => {
                self.swapped(m, l, page);
                true
            }
            SwapStatus::Busy => panic!("busy although the writer left the reader page"),
            SwapStatus::Contended => {
                self.contended += 1;
                false
            }
        }
    }
}

/// The ring's structural invariants at rest (S1). Returns (head, ring from the head).
fn check_ring(m: &Region, l: &RingGeometry) -> (u32, Vec<u32>) {
    let pages = l.pages_per_cpu;
    let c = l.ctl(0);
    let r = ld(m, c + ctl::READER_PAGE) as u32;
    let t = ld(m, c + ctl::TAIL_PAGE) as u32;
    assert!(r < pages && t < pages);
    let with = |off: usize, bit: u64| -> Vec<u32> {
        (0..pages)
            .filter(|&p| ld(m, l.footer_off(p) + off) & bit != 0)
            .collect()
    };
    assert_eq!(
        with(footer::READER_STATUS, FT_READER),
        vec![r],
        "S1: FT_READER"
    );
    assert_eq!(
        with(footer::WRITER_STATUS, FT_COMMIT),
        vec![t],
        "S1: FT_COMMIT"
    );
    let links: Vec<u64> = (0..pages)
        .map(|p| ld(m, l.footer_off(p) + footer::NEXT))
        .collect();
    let flagged: Vec<u32> = (0..pages)
        .filter(|&p| links[p as usize] & LINK_FLAGS != 0)
        .collect();
    assert!(
        !flagged.is_empty(),
        "S1: no link carries HEAD, the head is lost; links {links:x?}"
    );
    assert_eq!(flagged.len(), 1, "S1: flagged links {links:x?}");
    let lk = links[flagged[0] as usize];
    assert_eq!(lk & LINK_FLAGS, LINK_HEAD, "S1: link {lk:#x}");
    let heads = with(footer::WRITER_STATUS, FT_HEAD);
    assert_eq!(
        heads,
        vec![link_id(lk) as u32],
        "S1: FT_HEAD not (only) on the page the HEAD link names; links {links:x?}"
    );
    let h = heads[0];
    assert_ne!(
        flagged[0], r,
        "S1: no ring link carries HEAD, only the reader page's; links {links:x?}"
    );
    let mut ring = vec![h];
    let mut p = h;
    for _ in 0..pages {
        p = link_id(links[p as usize]) as u32;
        if p == h {
            break;
        }
        ring.push(p);
    }
    assert_eq!(ring.len(), pages as usize - 1, "S1: ring {ring:?}");
    assert!(
        !ring.contains(&r),
        "S1: reader page {r} in the ring {ring:?}"
    );
    (h, ring)
}

/// One model: the events (payload length, timestamp) a writer writes against `steps`
/// steps of a reader, in `mode`.
#[derive(Clone, Debug)]
struct Model {
    mode: Mode,
    pages: u32,
    events: Vec<(usize, u64)>,
    /// Events written before the threads start (no interleaving to explore there).
    setup: usize,
    /// The writer thread yields after every `burst` events (0: never), as a writer
    /// between bursts does; a yield is a context switch loom does not count as a
    /// preemption, so a bound of 2 preemptions reaches deeper interleavings.
    burst: usize,
    steps: usize,
    via: Via,
    /// Executions in which the writer swapped released pages back (this model's own
    /// count: [`check_released`] needs its model to reach that swap).
    self_swap_runs: Arc<std::sync::atomic::AtomicUsize>,
    /// This model's own preemption bound (else `LOOM_MAX_PREEMPTIONS`, else 2).
    preemptions: Option<usize>,
}

impl Model {
    fn new(mode: Mode, events: usize, len: usize, steps: usize, via: Via) -> Self {
        Self {
            mode,
            pages: PAGES,
            events: (0..events as u64).map(|i| (len, 100 + i * 10)).collect(),
            setup: 0,
            burst: 0,
            steps,
            via,
            self_swap_runs: Arc::default(),
            preemptions: None,
        }
    }

    fn run(&self) {
        let l = RingGeometry::new(1, self.pages, PAGE, self.mode, false).unwrap();
        let mem: Mem = Arc::new(Region::new(&l));
        l.init_region(&*mem, 0, 1);
        let events = self.events.clone();
        let mut w = Writer::attach(mem.clone(), 0).unwrap();
        fn write(w: &mut Writer<Mem>, events: &[(usize, u64)], seq: usize) {
            let (len, ts) = events[seq];
            match w.write(0, ts, &payload(seq as u64, ts, len)) {
                WriteOutcome::Written | WriteOutcome::Dropped => {}
                o => panic!("write {seq}: {o:?}"),
            }
        }
        for seq in 0..self.setup {
            write(&mut w, &events, seq);
        }
        let (setup, burst, via, n) = (self.setup, self.burst, self.via, events.len());
        let writer = loom::thread::spawn(move || {
            for seq in setup..n {
                write(&mut w, &events, seq);
                if via == Via::Mailbox {
                    w.serve_mailbox();
                }
                if burst > 0 && (seq + 1 - setup) % burst == 0 && seq + 1 < n {
                    loom::thread::yield_now();
                }
            }
            w
        });
        let rm = mem.clone();
        let steps = self.steps;
        let reader = loom::thread::spawn(move || {
            let mut rd = MiniReader::new(&rm, &l, via);
            for _ in 0..steps {
                rd.step(&rm, &l);
            }
            rd
        });
        let mut w = writer.join().unwrap();
        let mut rd = reader.join().unwrap();
        if w.self_swaps() > 0 {
            self.self_swap_runs.fetch_add(1, Relaxed);
        }
        if rd.pending {
            // A request still in flight: the writer answers it (M1: the answer is not
            // dropped), as a writer serving its mailbox in its idle loop would.
            // (The writer thread may have served it after the reader stopped looking.)
            w.serve_mailbox();
            rd.poll_answer(&mem, &l, 1);
            assert!(!rd.pending, "request not answered");
        }

        // At rest: the ring's invariants, the counters, then read what is left in ring
        // order (as the final walk does) and account for every event.
        let (_, ring) = check_ring(&mem, &l);
        let c = l.ctl(0);
        let attempts = n as u64;
        assert_eq!(ld(&mem, c + ctl::ENTRIES), w.entries());
        assert_eq!(ld(&mem, c + ctl::DROPPED), w.dropped());
        assert_eq!(ld(&mem, c + ctl::OVERRUN), w.overrun());
        assert_eq!(w.entries() + w.dropped(), attempts);
        let t = ld(&mem, c + ctl::TAIL_PAGE) as u32;
        rd.read_committed(&mem, &l);
        if t != rd.page {
            // Released pages: the ring from the head starts with pages read and released
            // but not swapped out yet; what is left comes after the page being read.
            let from = match self.via {
                Via::Release => ring.iter().position(|&p| p == rd.page).map_or(0, |i| i + 1),
                _ => 0,
            };
            for &p in &ring[from..] {
                rd.enter(&mem, &l, p);
                rd.read_committed(&mem, &l);
                if p == t {
                    break;
                }
            }
        }
        let pending = ld(&mem, c + ctl::LOST_PENDING);
        assert_eq!(rd.expected + pending, attempts, "{rd:?}");
        assert_eq!(rd.read + rd.lost + pending, attempts, "{rd:?}");
        assert_eq!(rd.lost + pending, w.overrun() + w.dropped(), "{rd:?}");
    }
}

/// Checks `model` under loom and reports how many executions it explored.
fn check(name: &str, model: Model) {
    use std::sync::atomic::AtomicUsize;
    let n = Arc::new(AtomicUsize::new(0));
    let n2 = n.clone();
    let t = std::time::Instant::now();
    let mut b = builder();
    // A model's own bound raises the default, never lowers LOOM_MAX_PREEMPTIONS.
    b.preemption_bound = b.preemption_bound.max(model.preemptions);
    let bound = b.preemption_bound;
    b.check(move || {
        n2.fetch_add(1, Relaxed);
        model.run()
    });
    eprintln!(
        "loom model {name}: {} executions (preemption bound {bound:?}) in {:.1} s",
        n.load(Relaxed),
        t.elapsed().as_secs_f64()
    );
}

fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    b.max_branches = 100_000;
    b
}

/// Checks `model` (with a seeded bug) and asserts that loom caught it with a panic message
/// containing `needle` (described as `as_what`), not some other failure.
#[cfg(any(
    hyptrace_seeded_bug,
    hyptrace_seeded_bug_relaxed_commit,
    hyptrace_seeded_bug_relaxed_release,
    hyptrace_seeded_bug_contended_link
))]
fn assert_caught(name: &str, model: Model, needle: &str, as_what: &str) {
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(name, model)))
        .expect_err("the seeded bug was not caught");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains(needle), "caught, but not as {as_what}: {msg}");
}

/// The models proper (left out of the seeded-bug builds, which run only their
/// seeded test).
#[cfg(not(any(
    hyptrace_seeded_bug,
    hyptrace_seeded_bug_relaxed_commit,
    hyptrace_seeded_bug_relaxed_release,
    hyptrace_seeded_bug_contended_link
)))]
mod models {
    use super::*;

    /// Overwrite mode, two plain reader steps against a ring of 4 events.
    #[test]
    fn overwrite_writer_vs_two_swaps() {
        check(
            "overwrite 4/2 plain",
            Model::new(Mode::Overwrite, 4, BIG, 2, Via::Plain),
        );
    }

    /// Stop mode: the writer fills the ring and drops while the reader swaps.
    #[test]
    fn stop_writer_vs_two_swaps() {
        check(
            "stop 5/2 plain",
            Model::new(Mode::Stop, 5, BIG, 2, Via::Plain),
        );
    }

    /// The hinted swap (as `Direct` and the guest's mailbox use it): the second swap
    /// starts its head search where the first left the HEAD link, while the writer may be
    /// pushing the head (overwrite) — including the window where the new HEAD link is
    /// published but the writer still holds UPDATE on its tail's link.
    #[test]
    fn hinted_swaps_overwrite() {
        check(
            "overwrite 4/2 hinted",
            Model::new(Mode::Overwrite, 4, BIG, 2, Via::Hinted),
        );
    }

    /// The mailbox path (`--swap guest`), stop mode: the reader posts swap requests, the
    /// writer thread serves them between its writes; busy/contended/unanswered are
    /// outcomes, and a request in flight keeps the reader off its page (M1).
    #[test]
    fn mailbox_stop() {
        check(
            "stop 4/2 mailbox",
            Model::new(Mode::Stop, 4, BIG, 2, Via::Mailbox),
        );
    }

    /// Released pages (`--swap guest`, stop mode): the reader reads the ring pages in place
    /// while the writer writes on (a write to a page being read would be a race loom
    /// reports) and releases each page it has read with one store; the writer, its ring
    /// full, swaps released pages back by itself (S1 holds at rest) and never takes one
    /// the reader has not released; every event is read once or counted as dropped.
    #[test]
    fn released_pages_stop() {
        check_released(
            "stop 5/3 released",
            Model::new(Mode::Stop, 5, BIG, 3, Via::Release),
        );
    }

    /// [`check`] of a released-pages model that must reach the writer's own swap in some
    /// execution (else the model would not test what it is for).
    fn check_released(name: &str, model: Model) {
        let runs = Arc::clone(&model.self_swap_runs);
        check(name, model);
        assert!(
            runs.load(Relaxed) > 0,
            "{name}: no execution reached a swap of a released page"
        );
    }

    /// Released pages with pages already full when the threads start (the first step
    /// reads two pages and releases them while the writer, its ring full, needs them).
    #[test]
    fn released_pages_stop_prefilled() {
        let mut m = Model::new(Mode::Stop, 6, BIG, 3, Via::Release);
        m.setup = 3;
        check_released("stop 6/3 released, 3 before", m);
    }

    /// The mailbox path in overwrite mode.
    #[test]
    fn mailbox_overwrite() {
        check(
            "overwrite 4/2 mailbox",
            Model::new(Mode::Overwrite, 4, BIG, 2, Via::Mailbox),
        );
    }

    /// Pages holding several events and a TIME_EXTEND: three events per page, the third
    /// 2^28 ticks after the second; the reader reads a page while the writer appends to it
    /// (hinted swaps, stop mode).
    fn multi_event_model() -> Model {
        let mut m = Model::new(Mode::Stop, 5, SMALL, 2, Via::Hinted);
        for (i, e) in m.events.iter_mut().enumerate() {
            if i >= 2 {
                e.1 += 1 << 28;
            }
        }
        m
    }

    #[test]
    fn multi_event_pages_time_extend() {
        check("stop 5x1300/2 time-extend hinted", multi_event_model());
    }

    /// A writer that laps the ring after a swap (overwrite): the smallest ring (the reader
    /// page and 2 ring pages), both filled before the threads start, then 3 more one-page
    /// events in bursts of 2 against one hinted swap. The writer can push the page the swap
    /// made the head and lap the ring back to it while the swap marks it (its FT_HEAD
    /// fix-up); S1's FT_HEAD is checked at the end. The old fix-up (set, re-load the link,
    /// clear if it changed) fails here: the writer pushes the new head before the re-load
    /// and makes it the head again before the clear (2 preemptions and a burst yield).
    fn lap_model() -> Model {
        let mut m = Model::new(Mode::Overwrite, 5, BIG, 1, Via::Hinted);
        m.pages = 3;
        m.setup = 2;
        m.burst = 2;
        m
    }

    #[test]
    fn writer_laps_after_swap() {
        check("overwrite 3 pages 2+3/1 lap hinted", lap_model());
    }

    /// Issue 27's ring: 5 pages (4 in the ring), all full before the threads start, then
    /// 3 one-page events (3 head pushes, a yield after the first 2) against two swaps,
    /// hinted then plain with the hint kept. Every head push races a swap's search, its
    /// hint, its exchange and its FT_HEAD fix-up. Bound 2: at 3 (or 5 events at 2) the
    /// model ran past 10 minutes without finishing.
    fn five_page_model() -> Model {
        let mut m = Model::new(Mode::Overwrite, 7, BIG, 2, Via::Mixed);
        m.pages = 5;
        m.setup = 4;
        m.burst = 2;
        m
    }

    #[test]
    fn five_page_ring_pushed_during_swaps() {
        check("overwrite 5 pages 4+3/2 mixed", five_page_model());
    }
}

/// Seeded bug 1 (`--cfg hyptrace_seeded_bug`: push_head publishes the new head's link
/// without the HEAD flag): the ring loses its head, and the overwrite model reports
/// exactly that — an S1 violation of the ring at rest: no link carries HEAD. (Before
/// issue 27's fix the first execution caught showed the reader page's stale flag, left
/// by a swap that gave up, as the only flagged link.)
#[cfg(hyptrace_seeded_bug)]
#[test]
fn seeded_bug_lost_head_flag_is_caught() {
    assert_caught(
        "seeded: no HEAD flag",
        Model::new(Mode::Overwrite, 4, BIG, 2, Via::Plain),
        "S1: no link carries HEAD, the head is lost",
        "the lost head",
    );
}

/// What loom reports for a plain access not ordered after a conflicting one.
#[cfg(any(
    hyptrace_seeded_bug_relaxed_commit,
    hyptrace_seeded_bug_relaxed_release
))]
const CAUSALITY: &str = "Causality violation: Concurrent read and write accesses";

/// Seeded bug 2 (`--cfg hyptrace_seeded_bug_relaxed_commit`: the commit that publishes
/// an event is stored Relaxed instead of Release, W1): a reader that sees the commit
/// can read the payload before it was written; loom reports the race on the payload
/// cells as a causality violation.
#[cfg(hyptrace_seeded_bug_relaxed_commit)]
#[test]
fn seeded_relaxed_commit_is_caught() {
    assert_caught(
        "seeded: relaxed commit",
        Model::new(Mode::Stop, 2, SMALL, 1, Via::Plain),
        CAUSALITY,
        "a race on the payload",
    );
}

/// Seeded bug 3 (`--cfg hyptrace_seeded_bug_relaxed_release`: the writer loads
/// `released` Relaxed instead of Acquire, R2): it may rewrite a page the reader released
/// before the reader's reads of that page happened; loom reports the race on the page's
/// cells as a causality violation.
#[cfg(hyptrace_seeded_bug_relaxed_release)]
#[test]
fn seeded_relaxed_release_is_caught() {
    assert_caught(
        "seeded: relaxed release",
        Model::new(Mode::Stop, 5, BIG, 3, Via::Release),
        CAUSALITY,
        "a race on a released page",
    );
}

/// Seeded bug 4 (`--cfg hyptrace_seeded_bug_contended_link`: a swap that gives up leaves
/// `after|HEAD` in the reader page's link, issue 27): the hinted overwrite model reaches
/// a swap whose every attempt loses to the writer (one held UPDATE while descheduled)
/// and reports two flagged links at rest.
#[cfg(hyptrace_seeded_bug_contended_link)]
#[test]
fn seeded_contended_link_is_caught() {
    assert_caught(
        "seeded: a swap that gives up leaves HEAD on the reader page",
        Model::new(Mode::Overwrite, 4, BIG, 2, Via::Hinted),
        "S1: flagged links",
        "two flagged links at rest",
    );
}
