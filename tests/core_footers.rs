//! Footer and link invariants of the ring at quiescent points.
//!
//! Random interleavings (seeded, reproducible) of writes, swaps (direct and through the
//! mailbox), `update_footers` and writer re-attaches on tiny rings, in both modes; after
//! every step the whole ring is checked:
//! - exactly one FT_READER (the control block's reader page), one FT_COMMIT (its tail
//!   page), one FT_HEAD; exactly one link carries LINK_HEAD, none LINK_UPDATE, and it
//!   names the FT_HEAD page; the ring (walked from the head) holds every page but the
//!   reader page, which no ring link names;
//! - the unread chain (reader page, then head..tail unless the writer is on the reader
//!   page) recounts the writer's counters exactly: `page_entries` of every page the
//!   writer left equals the events decoded from it; `first_index` steps by the events
//!   of the page before plus the loss between (stop mode: exactly `missed`; overwrite:
//!   only between the reader page and the head); every event's seq (in its payload)
//!   equals its index; read + lost + unread == entries + dropped; lost == overrun +
//!   dropped; page_seq consecutive along the ring, pages_touched == page_seq(tail);
//! - the reader page footer's stats equal the control block after `update_footers`;
//!   the swapped-in page's overrun equals the control block's at the swap;
//!   pages_touched and overrun never decrease.
//!
//! A concurrent version runs a writer thread and a swapping thread and checks the same
//! at quiescent points (both paused at a gate that fails, never hangs, when a thread
//! panics).

use hyptrace::rng::Rng;
use hyptrace_abi::layout::{
    ctl, footer, link, link_id, Mode, RingGeometry, FT_COMMIT, FT_HEAD, FT_READER, LINK_FLAGS,
    LINK_HEAD, LINK_UPDATE, MBOX_OP_SWAP, MBOX_OP_UPDATE_FOOTERS, MBOX_STATUS_BUSY, MBOX_STATUS_OK,
};
use hyptrace_abi::page::{Events, COMMIT_LEN_MASK, COMMIT_OFFSET, RB_MISSED_EVENTS};
use hyptrace_abi::{HeapMem, SharedMem};
use hyptrace_reader::{Config, Direct, Item, Mailbox, RingBuffer};
use hyptrace_writer::{
    swap_reader_page, swap_reader_page_hinted, update_footers, SwapHint, SwapStatus, WriteOutcome,
    Writer,
};
use std::sync::atomic::Ordering::{Acquire, Release};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

fn ld(m: &HeapMem, off: usize) -> u64 {
    m.load(off, Acquire)
}

fn ft(m: &HeapMem, l: &RingGeometry, id: u32, off: usize) -> u64 {
    ld(m, l.footer_off(id) + off)
}

/// Decodes page `id`: (events, seqs of the events whose payload carries one).
fn decode(m: &HeapMem, l: &RingGeometry, id: u32) -> Vec<Option<u64>> {
    let mut page = vec![0u8; l.page_size];
    m.read_bytes(l.page_off(id), &mut page);
    let commit = ld(m, l.page_off(id) + COMMIT_OFFSET);
    let len = (commit & COMMIT_LEN_MASK) as usize;
    assert!(len <= l.data_capacity(), "page {id}: commit {commit:#x}");
    let ts = u64::from_le_bytes(page[..8].try_into().unwrap());
    Events::new(&page[16..16 + len], ts)
        .map(|e| {
            let e = e.unwrap_or_else(|err| panic!("page {id}: {err}"));
            // Payloads of 8+ bytes start with their seq (< 2^32); shorter ones are all
            // 0xff, which also tells a 5..7-byte payload padded to 8 apart.
            (e.payload.len() >= 8 && e.payload[4] != 0xff)
                .then(|| u64::from_le_bytes(e.payload[..8].try_into().unwrap()))
        })
        .collect()
}

/// What the test knows besides the region: outcomes of the writes and the reading done
/// by the swaps.
#[derive(Default, Debug, Clone)]
struct Model {
    attempts: u64,
    written: u64,
    dropped: u64,
    swaps: u64,
    /// Events on pages that stopped being the reader page (read).
    read_done: u64,
    /// Losses seen at swaps: first_index(new reader) - end(old reader).
    lost_by_swaps: u64,
    last_touched: u64,
    last_overrun: u64,
    last_footer_overrun: u64,
}

/// Checks every invariant of `cpu`'s ring (see the module doc). `fresh_footers`: the
/// reader page footer was just refreshed by `update_footers`.
fn check(m: &HeapMem, l: &RingGeometry, cpu: u32, md: &mut Model, fresh_footers: bool, what: &str) {
    let c = l.ctl(cpu);
    let first = l.first_page(cpu);
    let pages: Vec<u32> = (first..first + l.pages_per_cpu).collect();
    let r = ld(m, c + ctl::READER_PAGE);
    let t = ld(m, c + ctl::TAIL_PAGE);
    assert!(l.owns(cpu, r) && l.owns(cpu, t), "{what}: ids {r} {t}");
    let (r, t) = (r as u32, t as u32);
    let with = |off: usize, bit: u64| -> Vec<u32> {
        pages
            .iter()
            .copied()
            .filter(|&p| ft(m, l, p, off) & bit != 0)
            .collect()
    };
    assert_eq!(
        with(footer::READER_STATUS, FT_READER),
        vec![r],
        "{what}: FT_READER"
    );
    assert_eq!(
        with(footer::WRITER_STATUS, FT_COMMIT),
        vec![t],
        "{what}: FT_COMMIT"
    );
    let heads = with(footer::WRITER_STATUS, FT_HEAD);
    assert_eq!(heads.len(), 1, "{what}: FT_HEAD on {heads:?}");
    let h = heads[0];
    assert_ne!(h, r, "{what}: the reader page is the head");
    // Links: one HEAD flag, no UPDATE at rest, naming the head.
    let flagged: Vec<(u32, u64)> = pages
        .iter()
        .map(|&p| (p, ft(m, l, p, footer::NEXT)))
        .filter(|&(_, lk)| lk & LINK_FLAGS != 0)
        .collect();
    assert_eq!(
        flagged.len(),
        1,
        "{what}: flagged links {flagged:?} (reader page {r}, tail {t})"
    );
    let (hp, hl) = flagged[0];
    assert_eq!(hl & LINK_FLAGS, LINK_HEAD, "{what}: link {hl:#x}");
    assert_eq!(
        link_id(hl),
        u64::from(h),
        "{what}: HEAD link names {}",
        hl >> 2
    );
    assert_ne!(hp, r, "{what}: the reader page's link carries HEAD");
    // The ring, walked from the head: every page but the reader page, once.
    let mut ring = vec![h];
    let mut p = h;
    loop {
        let nx = link_id(ft(m, l, p, footer::NEXT));
        assert!(l.owns(cpu, nx), "{what}: link out of range");
        p = nx as u32;
        if p == h {
            break;
        }
        assert!(
            !ring.contains(&p),
            "{what}: ring cycle without the head at {p}"
        );
        ring.push(p);
    }
    assert_eq!(ring.len(), pages.len() - 1, "{what}: ring {ring:?}");
    assert!(
        !ring.contains(&r),
        "{what}: reader page {r} in the ring {ring:?}"
    );
    assert_eq!(
        hp,
        *ring.last().unwrap(),
        "{what}: HEAD link not on the page before head"
    );
    // Page contents: every page the writer left has its final entry count.
    let mut decoded = std::collections::HashMap::new();
    for &p in &pages {
        let ev = decode(m, l, p);
        if p != t {
            assert_eq!(
                ft(m, l, p, footer::PAGE_ENTRIES),
                ev.len() as u64,
                "{what}: page {p} page_entries"
            );
        }
        decoded.insert(p, ev);
    }
    // The unread chain.
    let mut chain = vec![r];
    if t != r {
        let at = ring.iter().position(|&p| p == t).expect("tail in the ring");
        chain.extend_from_slice(&ring[..=at]);
    }
    let fi = |p: u32| ft(m, l, p, footer::FIRST_INDEX);
    let seq = |p: u32| ft(m, l, p, footer::PAGE_SEQ);
    let mut gaps = 0;
    let mut unread = 0;
    for (k, &p) in chain.iter().enumerate() {
        let ev = &decoded[&p];
        for (i, s) in ev.iter().enumerate() {
            if let Some(s) = s {
                assert_eq!(*s, fi(p) + i as u64, "{what}: page {p} event {i}: index");
            }
        }
        unread += ev.len() as u64;
        let missed = ft(m, l, p, footer::MISSED);
        if seq(p) != 0 {
            let flag = ld(m, l.page_off(p) + COMMIT_OFFSET) & RB_MISSED_EVENTS != 0;
            assert_eq!(
                flag,
                missed != 0,
                "{what}: page {p}: missed flag vs {missed}"
            );
        }
        if k == 0 {
            continue;
        }
        let prev = chain[k - 1];
        let end = fi(prev) + decoded[&prev].len() as u64;
        assert!(fi(p) >= end, "{what}: page {p} index {} < {end}", fi(p));
        let gap = fi(p) - end;
        match l.mode {
            Mode::Stop => assert_eq!(gap, missed, "{what}: page {p}: gap vs missed"),
            Mode::Overwrite => {
                assert_eq!(missed, 0, "{what}: missed in overwrite mode");
                if k > 1 {
                    assert_eq!(gap, 0, "{what}: hole inside the unread ring at {p}");
                }
            }
        }
        gaps += gap;
        if k > 1 {
            assert_eq!(seq(p), seq(prev) + 1, "{what}: page_seq along the ring");
        } else {
            assert!(
                seq(p) > seq(prev),
                "{what}: reader page newer than the head"
            );
        }
    }
    let entries = ld(m, c + ctl::ENTRIES);
    let dropped = ld(m, c + ctl::DROPPED);
    let overrun = ld(m, c + ctl::OVERRUN);
    let pending = ld(m, c + ctl::LOST_PENDING);
    let touched = ld(m, c + ctl::PAGES_TOUCHED);
    assert_eq!(
        (entries, dropped),
        (md.written, md.dropped),
        "{what}: counters"
    );
    assert_eq!(entries + dropped, md.attempts, "{what}: attempts");
    assert_eq!(
        fi(r),
        md.read_done + md.lost_by_swaps,
        "{what}: reader page index"
    );
    assert_eq!(
        md.read_done + unread + md.lost_by_swaps + gaps + pending,
        md.attempts,
        "{what}: read + unread + lost != attempts"
    );
    assert_eq!(
        md.lost_by_swaps + gaps + pending,
        overrun + dropped,
        "{what}: lost != overrun + dropped"
    );
    match l.mode {
        Mode::Stop => assert_eq!(overrun, 0, "{what}"),
        Mode::Overwrite => assert_eq!((dropped, pending), (0, 0), "{what}"),
    }
    assert_eq!(touched, seq(t), "{what}: pages_touched vs tail page_seq");
    assert!(
        touched >= md.last_touched,
        "{what}: pages_touched decreased"
    );
    assert!(overrun >= md.last_overrun, "{what}: overrun decreased");
    md.last_touched = touched;
    md.last_overrun = overrun;
    assert_eq!(ld(m, c + ctl::SWAPS), md.swaps, "{what}: swaps");
    let rf = |off| ft(m, l, r, off);
    assert!(
        rf(footer::OVERRUN) <= overrun,
        "{what}: footer overrun ahead"
    );
    assert!(rf(footer::OVERRUN) >= md.last_footer_overrun || md.swaps == 0);
    md.last_footer_overrun = rf(footer::OVERRUN);
    if fresh_footers {
        assert_eq!(
            (
                rf(footer::ENTRIES),
                rf(footer::PAGES_TOUCHED),
                rf(footer::OVERRUN),
                rf(footer::DROPPED)
            ),
            (entries, touched, overrun, dropped),
            "{what}: reader footer stats after update_footers"
        );
    }
}

/// Swaps `cpu`'s reader page as a reader that read it completely would, keeping the
/// model's read/lost accounting. Returns whether it swapped.
fn swap_and_account(
    m: &HeapMem,
    l: &RingGeometry,
    cpu: u32,
    md: &Mutex<Model>,
    concurrent: bool,
    via: impl FnOnce() -> SwapStatus,
) -> bool {
    let c = l.ctl(cpu);
    let r = ld(m, c + ctl::READER_PAGE) as u32;
    let t = ld(m, c + ctl::TAIL_PAGE) as u32;
    if t == r {
        // The writer is on the reader page: nothing to swap (and the swap agrees, when
        // the writer cannot leave the page meanwhile).
        if !concurrent {
            assert_eq!(via(), SwapStatus::Busy);
        }
        return false;
    }
    // The writer left the reader page: its content is final.
    let n = decode(m, l, r).len() as u64;
    let end = ft(m, l, r, footer::FIRST_INDEX) + n;
    let overrun_before = ld(m, c + ctl::OVERRUN);
    let page = match via() {
        SwapStatus::Swapped { page } => page,
        // Lost every attempt to a writer pushing the head: nothing changed.
        SwapStatus::Contended if concurrent => return false,
        s => panic!("swap {s:?} while the writer is not on the reader page"),
    };
    assert_eq!(ld(m, c + ctl::READER_PAGE), u64::from(page));
    assert_ne!(page, r);
    let first = ft(m, l, page, footer::FIRST_INDEX);
    assert!(first >= end, "swapped-in page {page} index {first} < {end}");
    let fo = ft(m, l, page, footer::OVERRUN);
    assert!(
        fo >= overrun_before && fo <= ld(m, c + ctl::OVERRUN),
        "swap overrun"
    );
    let mut md = md.lock().unwrap();
    md.read_done += n;
    md.lost_by_swaps += first - end;
    md.swaps += 1;
    true
}

fn random_payload(rng: &mut Rng, max: usize, seq: u64) -> Vec<u8> {
    let len = match rng.below(10) {
        0 => 0,
        1 => rng.below(8) as usize,
        2..=5 => 8 + rng.below(120) as usize,
        6 | 7 => 100 + rng.below(700) as usize,
        8 => 1000 + rng.below(2000) as usize,
        _ => max - rng.below(64) as usize,
    };
    let mut p: Vec<u8> = (0..len).map(|i| ((i as u8) ^ (seq as u8)) & 0x7f).collect();
    if len < 8 {
        p.fill(0xff);
    } else {
        p[..8].copy_from_slice(&seq.to_le_bytes());
    }
    p
}

fn next_ts(rng: &mut Rng, ts: &mut u64) -> u64 {
    match rng.below(20) {
        0 => *ts += 1 << (27 + rng.below(20)),
        1 => return ts.saturating_sub(rng.below(1000)), // backwards: clamped
        _ => *ts += rng.below(1000),
    }
    *ts
}

fn region(cpus: u32, pages: u32, mode: Mode) -> (Arc<HeapMem>, RingGeometry) {
    let l = RingGeometry::new(cpus, pages, 4096, mode, false).unwrap();
    let m = Arc::new(HeapMem::new(l.region_size));
    l.init_region(&*m, 0, 1);
    (m, l)
}

/// One random single-threaded run on a 2-CPU region.
fn random_run(seed: u64, mode: Mode, pages: u32, steps: usize) {
    let mut rng = Rng(seed);
    let (m, l) = region(2, pages, mode);
    let mut ws: Vec<Writer<Arc<HeapMem>>> = (0..2)
        .map(|c| Writer::attach(m.clone(), c).unwrap())
        .collect();
    let models: Vec<Mutex<Model>> = (0..2).map(|_| Mutex::new(Model::default())).collect();
    let mut ts = [0u64; 2];
    let mut mbox_seq = [0u64; 2];
    for step in 0..steps {
        let cpu = rng.below(2) as u32;
        let ci = cpu as usize;
        let what = format!("seed {seed:#x} {mode:?} {pages} pages step {step} cpu {cpu}");
        let mut fresh = false;
        match rng.below(100) {
            0..=64 => {
                let seq = models[ci].lock().unwrap().attempts;
                let p = random_payload(&mut rng, l.max_payload(), seq);
                let t = next_ts(&mut rng, &mut ts[ci]);
                let out = ws[ci].write(0, t, &p);
                let mut md = models[ci].lock().unwrap();
                md.attempts += 1;
                match out {
                    WriteOutcome::Written => md.written += 1,
                    WriteOutcome::Dropped => md.dropped += 1,
                    o => panic!("{what}: {o:?}"),
                }
            }
            65..=79 => {
                swap_and_account(&m, &l, cpu, &models[ci], false, || {
                    swap_reader_page(&*m, &l, cpu).unwrap()
                });
            }
            80..=84 => {
                // Swap through the mailbox, served by the writer.
                let w = &mut ws[ci];
                let seqs = &mut mbox_seq[ci];
                swap_and_account(&m, &l, cpu, &models[ci], false, || {
                    *seqs += 1;
                    m.store(
                        l.ctl(cpu) + ctl::MBOX_REQ,
                        (*seqs << 8) | MBOX_OP_SWAP,
                        Release,
                    );
                    assert!(w.serve_mailbox());
                    match ld(&m, l.ctl(cpu) + ctl::MBOX_ACK) {
                        a if a == (*seqs << 8) | MBOX_STATUS_OK => SwapStatus::Swapped {
                            page: ld(&m, l.ctl(cpu) + ctl::READER_PAGE) as u32,
                        },
                        a if a == (*seqs << 8) | MBOX_STATUS_BUSY => SwapStatus::Busy,
                        a => panic!("mailbox ack {a:#x}"),
                    }
                });
            }
            85..=94 => {
                if rng.chance(50) {
                    update_footers(&*m, &l, cpu).unwrap();
                } else {
                    mbox_seq[ci] += 1;
                    let req = (mbox_seq[ci] << 8) | MBOX_OP_UPDATE_FOOTERS;
                    m.store(l.ctl(cpu) + ctl::MBOX_REQ, req, Release);
                    assert!(ws[ci].serve_mailbox());
                    assert_eq!(ld(&m, l.ctl(cpu) + ctl::MBOX_ACK), req & !0xff);
                }
                fresh = true;
            }
            _ => {
                // The guest side restarts: a new writer resumes from the shared state
                // (W4; stopped inside a write: `reattach_after_write_stopped_anywhere`).
                ws[ci] = Writer::attach(m.clone(), cpu).unwrap();
            }
        }
        let mut md = models[ci].lock().unwrap();
        assert_eq!(
            (ws[ci].entries(), ws[ci].dropped(), ws[ci].overrun()),
            (md.written, md.dropped, ld(&m, l.ctl(cpu) + ctl::OVERRUN)),
            "{what}: writer counters"
        );
        check(&m, &l, cpu, &mut md, fresh, &what);
    }
    // Both CPUs lost and read something over the run (tiny rings, many steps).
    for (cpu, md) in models.iter().enumerate() {
        let md = md.lock().unwrap();
        assert!(
            md.swaps > 0 && md.read_done > 0,
            "seed {seed:#x} cpu {cpu}: {md:?}"
        );
        let lost = md.lost_by_swaps + md.dropped;
        assert!(
            lost > 0,
            "seed {seed:#x} {mode:?} cpu {cpu}: nothing lost: {md:?}"
        );
    }
}

#[test]
fn random_interleavings_overwrite() {
    for seed in 0..12u64 {
        for pages in [3, 4, 5] {
            random_run(0x0f00 + seed, Mode::Overwrite, pages, 1500);
        }
    }
}

#[test]
fn random_interleavings_stop() {
    for seed in 0..12u64 {
        for pages in [3, 4, 5] {
            random_run(0x5700 + seed, Mode::Stop, pages, 1500);
        }
    }
}

/// Regression: in stop mode, once an event was dropped because the ring is full, the
/// tail page is closed — a later, smaller event must not be written on it (the loss
/// would then sit inside a page, where no `first_index` can place it, and the reader
/// would report it late, as a trailing loss).
#[test]
fn stop_mode_drop_closes_the_tail_page() {
    let (m, l) = region(1, 3, Mode::Stop);
    let mut rb = RingBuffer::attach(m.clone(), Direct::new(m.clone(), l)).unwrap();
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    let mut outs = vec![];
    for seq in 0u64..40 {
        // Alternate events that do not fit the rest of a full page with small ones.
        let mut p = vec![0u8; if seq % 2 == 0 { 1000 } else { 8 }];
        p[..8].copy_from_slice(&seq.to_le_bytes());
        outs.push(w.write(0, seq, &p));
    }
    let first_drop = outs
        .iter()
        .position(|o| *o == WriteOutcome::Dropped)
        .unwrap();
    assert!(
        outs[first_drop..]
            .iter()
            .all(|o| *o == WriteOutcome::Dropped),
        "written after a drop without a new page: {outs:?}"
    );
    // And the reader sees every loss in its place.
    rb.finalize(0).unwrap();
    let mut next = 0;
    let mut pending = 0;
    while let Some(it) = rb.next_event(0).unwrap() {
        match it {
            Item::Lost(n) => pending += n,
            Item::Event { payload, .. } => {
                let s = u64::from_le_bytes(payload[..8].try_into().unwrap());
                assert_eq!(s - next, pending, "loss before seq {s} not reported there");
                pending = 0;
                next = s + 1;
            }
        }
    }
    assert_eq!(next + pending, 40);
}

/// Regression (fixed): `Writer::attach` resumed a tail page holding events but took its
/// event count from the footer's `page_entries`, which the writer only stores when it leaves
/// a page (it is 0 while the writer is on it). After a re-attach the page's final
/// `page_entries` counts only the events written since, and in overwrite mode pushing
/// that page as head under-counts `overrun` (lost != overrun + dropped).
#[test]
fn reattach_keeps_tail_page_entries() {
    let (m, l) = region(1, 3, Mode::Overwrite);
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    let mut md = Model::default();
    for seq in 0..5u64 {
        assert_eq!(w.write(0, seq, &seq.to_le_bytes()), WriteOutcome::Written);
        md.attempts += 1;
        md.written += 1;
    }
    // The guest side restarts and resumes on the same tail page.
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    // Fill the ring until the page written before the re-attach is overwritten.
    for seq in 5..2000u64 {
        let mut p = [0u8; 64];
        p[..8].copy_from_slice(&seq.to_le_bytes());
        assert_eq!(w.write(0, seq, &p), WriteOutcome::Written);
        md.attempts += 1;
        md.written += 1;
    }
    check(&m, &l, 0, &mut md, false, "after re-attach");
    let t = ld(&m, l.ctl(0) + ctl::TAIL_PAGE) as u32;
    for p in 0..l.pages_per_cpu {
        if p != t {
            assert_eq!(
                ft(&m, &l, p, footer::PAGE_ENTRIES),
                decode(&m, &l, p).len() as u64
            );
        }
    }
}

/// A barrier for the threads of one test that never waits for a thread that died: a
/// party that panics (its [`Gate::guard`] drops while unwinding) aborts the gate, and
/// every wait then panics instead of spinning on. Used with `std::thread::scope`, which
/// joins every thread and propagates the first panic: a failing thread fails the test,
/// it never hangs it.
struct Gate {
    parties: usize,
    arrived: AtomicUsize,
    aborted: AtomicBool,
}

/// Aborts its gate when dropped during a panic.
struct GateGuard<'a>(&'a Gate);

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.aborted.store(true, SeqCst);
        }
    }
}

impl Gate {
    fn new(parties: usize) -> Self {
        Self {
            parties,
            arrived: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
        }
    }
    /// Keep alive for as long as the party takes part.
    fn guard(&self) -> GateGuard<'_> {
        GateGuard(self)
    }
    /// The `round`-th wait (from 1) of a party: returns once every party arrived there.
    fn wait(&self, round: usize) {
        self.arrived.fetch_add(1, SeqCst);
        while self.arrived.load(SeqCst) < round * self.parties {
            assert!(
                !self.aborted.load(SeqCst),
                "another thread of the test failed"
            );
            std::thread::yield_now();
        }
    }
}

/// The same invariants with a writer thread and a swapping thread running
/// concurrently, checked at quiescent points where both wait at a [`Gate`]. The swapper
/// uses the hinted swap (as `Direct` and the mailbox do) and the plain one in turn; a
/// swap that lost every attempt to the writer (`Contended`) is an outcome.
fn concurrent_run(seed: u64, mode: Mode, pages: u32, rounds: usize) {
    let (m, l) = region(1, pages, mode);
    let model = Mutex::new(Model::default());
    let gate = Gate::new(3);
    std::thread::scope(|s| {
        s.spawn(|| {
            let _g = gate.guard();
            let mut rng = Rng(seed);
            let mut w = Writer::attach(m.clone(), 0).unwrap();
            let mut ts = 0;
            for round in 0..rounds {
                gate.wait(2 * round + 1);
                for _ in 0..rng.below(40) {
                    let seq = model.lock().unwrap().attempts;
                    let p = random_payload(&mut rng, w.max_payload(), seq);
                    let t = next_ts(&mut rng, &mut ts);
                    let out = w.write(0, t, &p);
                    let mut md = model.lock().unwrap();
                    md.attempts += 1;
                    match out {
                        WriteOutcome::Written => md.written += 1,
                        WriteOutcome::Dropped => md.dropped += 1,
                        o => panic!("{o:?}"),
                    }
                }
                gate.wait(2 * round + 2);
            }
        });
        s.spawn(|| {
            let _g = gate.guard();
            let mut rng = Rng(seed ^ 0xabcdef);
            let mut hint = SwapHint::default();
            for round in 0..rounds {
                gate.wait(2 * round + 1);
                for _ in 0..rng.below(6) {
                    if rng.chance(70) {
                        let hinted = rng.chance(50);
                        swap_and_account(&m, &l, 0, &model, true, || {
                            if hinted {
                                swap_reader_page_hinted(&*m, &l, 0, &mut hint).unwrap()
                            } else {
                                swap_reader_page(&*m, &l, 0).unwrap()
                            }
                        });
                    } else {
                        update_footers(&*m, &l, 0).unwrap();
                    }
                    std::thread::yield_now();
                }
                gate.wait(2 * round + 2);
            }
        });
        let _g = gate.guard();
        for round in 0..rounds {
            gate.wait(2 * round + 1);
            gate.wait(2 * round + 2);
            // Quiescent: both threads wait at the next round's gate.
            let mut md = model.lock().unwrap();
            let what = format!("concurrent seed {seed:#x} {mode:?} {pages} pages round {round}");
            check(&m, &l, 0, &mut md, false, &what);
            if round % 3 == 0 {
                update_footers(&*m, &l, 0).unwrap();
                check(&m, &l, 0, &mut md, true, &what);
            }
        }
    });
    let md = model.lock().unwrap();
    assert!(md.swaps > 0 && md.read_done > 0, "{md:?}");
    assert!(
        md.lost_by_swaps + md.dropped > 0,
        "{mode:?}: nothing lost: {md:?}"
    );
    assert_eq!(ld(&m, l.ctl(0) + ctl::SWAPS), md.swaps);
}

#[test]
fn concurrent_writer_and_swapper_overwrite() {
    for (i, pages) in [3, 4, 5].into_iter().enumerate() {
        concurrent_run(0xc0 + i as u64, Mode::Overwrite, pages, 600);
    }
}

#[test]
fn concurrent_writer_and_swapper_stop() {
    for (i, pages) in [3, 4, 5].into_iter().enumerate() {
        concurrent_run(0x50 + i as u64, Mode::Stop, pages, 600);
    }
}

/// A region whose accesses run a hook first, given the kind of access and its offset:
/// lets a test run the writer "during" a swap, between two of its accesses,
/// deterministically.
struct HookMem<'a> {
    m: &'a HeapMem,
    hook: std::cell::RefCell<Box<dyn FnMut(Access, usize) + 'a>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    Load,
    Store,
    Swap,
    Cas,
    Or,
    And,
    Add,
    Write,
    Read,
}

impl HookMem<'_> {
    fn on(&self, a: Access, off: usize) {
        (self.hook.borrow_mut())(a, off)
    }
}

impl SharedMem for HookMem<'_> {
    fn size(&self) -> usize {
        self.m.size()
    }
    fn load(&self, off: usize, order: std::sync::atomic::Ordering) -> u64 {
        self.on(Access::Load, off);
        self.m.load(off, order)
    }
    fn store(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) {
        self.on(Access::Store, off);
        self.m.store(off, val, order)
    }
    fn swap(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) -> u64 {
        self.on(Access::Swap, off);
        self.m.swap(off, val, order)
    }
    fn compare_exchange(
        &self,
        off: usize,
        current: u64,
        new: u64,
        success: std::sync::atomic::Ordering,
        failure: std::sync::atomic::Ordering,
    ) -> Result<u64, u64> {
        self.on(Access::Cas, off);
        self.m.compare_exchange(off, current, new, success, failure)
    }
    fn fetch_or(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) -> u64 {
        self.on(Access::Or, off);
        self.m.fetch_or(off, val, order)
    }
    fn fetch_and(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) -> u64 {
        self.on(Access::And, off);
        self.m.fetch_and(off, val, order)
    }
    fn fetch_add(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) -> u64 {
        self.on(Access::Add, off);
        self.m.fetch_add(off, val, order)
    }
    fn write_bytes(&self, off: usize, src: &[u8]) {
        self.on(Access::Write, off);
        self.m.write_bytes(off, src)
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        self.on(Access::Read, off);
        self.m.read_bytes(off, dst)
    }
}

/// A payload that fills most of a 4 KiB page: two never share one.
const ONE_PAGE: usize = 2000;

/// Writes `n` one-page events (each moves the tail and, ring full in overwrite mode,
/// pushes the head), timestamps `*ts + 1` on; each must be written.
fn write_pages<M: SharedMem>(w: &mut Writer<M>, ts: &mut u64, n: usize) {
    for _ in 0..n {
        *ts += 1;
        assert_eq!(w.write(0, *ts, &[0u8; ONE_PAGE]), WriteOutcome::Written);
    }
}

/// Invariant S1 at a quiescent point: one FT_READER (the reader page), one FT_COMMIT
/// (the tail page), one FT_HEAD, one flagged link, HEAD, naming the FT_HEAD page.
fn assert_s1(m: &HeapMem, l: &RingGeometry, what: &str) {
    let c = l.ctl(0);
    let with = |off: usize, bit: u64| -> Vec<u32> {
        (0..l.pages_per_cpu)
            .filter(|&p| ft(m, l, p, off) & bit != 0)
            .collect()
    };
    let (r, t) = (ld(m, c + ctl::READER_PAGE), ld(m, c + ctl::TAIL_PAGE));
    assert_eq!(
        with(footer::READER_STATUS, FT_READER),
        vec![r as u32],
        "{what}"
    );
    assert_eq!(
        with(footer::WRITER_STATUS, FT_COMMIT),
        vec![t as u32],
        "{what}"
    );
    let links: Vec<u64> = (0..l.pages_per_cpu)
        .map(|p| ft(m, l, p, footer::NEXT))
        .collect();
    let flagged: Vec<&u64> = links.iter().filter(|&&lk| lk & LINK_FLAGS != 0).collect();
    assert_eq!(flagged.len(), 1, "{what}: links {links:x?}");
    assert_eq!(
        flagged[0] & LINK_FLAGS,
        LINK_HEAD,
        "{what}: links {links:x?}"
    );
    assert_eq!(
        with(footer::WRITER_STATUS, FT_HEAD),
        vec![link_id(*flagged[0]) as u32],
        "{what}: FT_HEAD vs the HEAD link (links {links:x?})"
    );
}

/// Defect (S1): the swap's FT_HEAD fix-up — set FT_HEAD on the new head, re-load the
/// reader page's link, clear FT_HEAD again if the link changed — cleared the FT_HEAD
/// that a writer lapping the ring had just set: the ring's HEAD link then named a page
/// without FT_HEAD until the next head move. Here the writer pushes the new head right
/// after the swap made it (before the swap re-loads the link), then laps the ring until
/// that page is the head again (before the swap clears its bit).
#[test]
fn swap_fixup_keeps_ft_head_of_a_lapping_writer() {
    let (m, l) = region(1, 4, Mode::Overwrite);
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    let mut ts = 0;
    // Fill the 3 ring pages (1, 2, 3): tail 3, its link names the head, 1.
    write_pages(&mut w, &mut ts, 3);
    let (reader, head, after, before_head) = (0u32, 1u32, 2u32, 3u32);
    let next = |p: u32| l.footer_off(p) + footer::NEXT;
    let status = |p: u32| l.footer_off(p) + footer::WRITER_STATUS;
    // 0: before the swap's exchange; 1: after it; 2: the writer pushed the new head;
    // 3: the writer lapped the ring back to it.
    let stage = std::cell::Cell::new(0);
    let hm = HookMem {
        m: &m,
        hook: std::cell::RefCell::new(Box::new(|a, off| {
            let mut write = |n| write_pages(&mut w, &mut ts, n);
            match (stage.get(), a) {
                (0, Access::Cas) if off == next(before_head) => stage.set(1),
                (1, Access::Load) if off == next(reader) => {
                    // Onto the old reader page (now in the ring), then push `after`.
                    write(2);
                    stage.set(2);
                }
                (2, Access::And) if off == status(after) => {
                    // Push 3, then 0: `after` is the head again.
                    write(2);
                    stage.set(3);
                }
                _ => {}
            }
        })),
    };
    let r = swap_reader_page(&hm, &l, 0);
    drop(hm);
    assert_eq!(r, Ok(SwapStatus::Swapped { page: head }));
    assert_eq!(stage.get(), 3, "the interleaving did not happen");
    assert_eq!(link_id(ft(&m, &l, reader, footer::NEXT)), u64::from(after));
    assert_s1(&m, &l, "after the swap");
    // And the ring goes on correctly.
    for _ in 0..7 {
        write_pages(&mut w, &mut ts, 1);
        assert_s1(&m, &l, "writing on");
    }
}

/// Known bug (found by the loom model): `swap_reader_page` searches the head with one
/// bounded pass from the tail (`find_head`) and returns `NoHead` at once when that pass
/// misses it; a writer pushing the head while the search walks the ring (overwrite
/// mode: the HEAD flag moves ahead of the walker) makes the swap fail although the ring
/// is fine. A swap racing the writer must retry (it has SWAP_RETRIES), not fail.
#[test]
fn swap_racing_head_pushes_does_not_fail() {
    let (m, l) = region(1, 4, Mode::Overwrite);
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    let mut ts = 0;
    // Fill the 3 ring pages: tail = last page, its link flags the head.
    write_pages(&mut w, &mut ts, 3);
    // Before each link the swap loads, the writer fills one more page (pushing the head
    // one page on, as a running writer does while the swapping thread is slow).
    let pushes = std::cell::Cell::new(0);
    let is_link = |off: usize| {
        off >= l.pages_off && (off - l.pages_off) % l.page_size == l.page_size - 96 + footer::NEXT
    };
    let hm = HookMem {
        m: &m,
        hook: std::cell::RefCell::new(Box::new(|a, off| {
            if a == Access::Load && is_link(off) && pushes.get() < 4 {
                pushes.set(pushes.get() + 1);
                write_pages(&mut w, &mut ts, 1);
            }
        })),
    };
    let r = swap_reader_page(&hm, &l, 0);
    drop(hm);
    assert!(matches!(r, Ok(SwapStatus::Swapped { .. })), "{r:?}");
}

/// A region through which a writer can be stopped between two of its stores: every
/// mutating access is counted (and logged with its offset) and, once `cut` says so
/// after one of them, every later mutation is ignored — as if the writer (a vCPU) had
/// stopped right there. Loads still answer, so the stopped writer runs on without
/// effect (its loops are bounded).
struct CutMem<'a> {
    m: &'a HeapMem,
    armed: std::cell::Cell<bool>,
    frozen: std::cell::Cell<bool>,
    log: std::cell::RefCell<Vec<usize>>,
    /// Given (number of mutations since armed, offset of the last one): stop now?
    cut: Box<dyn Fn(usize, usize) -> bool + 'a>,
}

impl<'a> CutMem<'a> {
    fn new(m: &'a HeapMem, cut: impl Fn(usize, usize) -> bool + 'a) -> Self {
        Self {
            m,
            armed: false.into(),
            frozen: false.into(),
            log: Vec::new().into(),
            cut: Box::new(cut),
        }
    }
    /// Runs one mutation unless frozen; counts it and freezes when `cut` says so.
    fn mutate<T>(&self, off: usize, f: impl FnOnce() -> T, frozen: impl FnOnce() -> T) -> T {
        if self.frozen.get() {
            return frozen();
        }
        let r = f();
        if self.armed.get() {
            let mut log = self.log.borrow_mut();
            log.push(off);
            if (self.cut)(log.len(), off) {
                self.frozen.set(true);
            }
        }
        r
    }
}

impl SharedMem for CutMem<'_> {
    fn size(&self) -> usize {
        self.m.size()
    }
    fn load(&self, off: usize, order: std::sync::atomic::Ordering) -> u64 {
        self.m.load(off, order)
    }
    fn store(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) {
        self.mutate(off, || self.m.store(off, val, order), || ())
    }
    fn swap(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) -> u64 {
        let cur = || self.m.load(off, std::sync::atomic::Ordering::SeqCst);
        self.mutate(off, || self.m.swap(off, val, order), cur)
    }
    fn compare_exchange(
        &self,
        off: usize,
        current: u64,
        new: u64,
        success: std::sync::atomic::Ordering,
        failure: std::sync::atomic::Ordering,
    ) -> Result<u64, u64> {
        let frozen = || match self.m.load(off, std::sync::atomic::Ordering::SeqCst) {
            v if v == current => Ok(v),
            v => Err(v),
        };
        self.mutate(
            off,
            || self.m.compare_exchange(off, current, new, success, failure),
            frozen,
        )
    }
    fn fetch_or(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) -> u64 {
        let cur = || self.m.load(off, std::sync::atomic::Ordering::SeqCst);
        self.mutate(off, || self.m.fetch_or(off, val, order), cur)
    }
    fn fetch_and(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) -> u64 {
        let cur = || self.m.load(off, std::sync::atomic::Ordering::SeqCst);
        self.mutate(off, || self.m.fetch_and(off, val, order), cur)
    }
    fn fetch_add(&self, off: usize, val: u64, order: std::sync::atomic::Ordering) -> u64 {
        let cur = || self.m.load(off, std::sync::atomic::Ordering::SeqCst);
        self.mutate(off, || self.m.fetch_add(off, val, order), cur)
    }
    fn write_bytes(&self, off: usize, src: &[u8]) {
        self.mutate(off, || self.m.write_bytes(off, src), || ())
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        self.m.read_bytes(off, dst)
    }
}

/// An event of the re-attach tests: its index (as the writer will number it) and its
/// timestamp in the payload, `len` bytes in all (≥ 16).
fn indexed_payload(seq: u64, ts: u64, len: usize) -> Vec<u8> {
    let mut p = vec![0x5a; len];
    p[..8].copy_from_slice(&seq.to_le_bytes());
    p[8..16].copy_from_slice(&ts.to_le_bytes());
    p
}

/// What a re-attach test does before the interrupted write.
#[derive(Clone, Copy, Debug)]
enum Before {
    /// A few small events: the interrupted one lands on the same page.
    SamePage,
    /// The tail page nearly full: the interrupted one moves the tail (overwrite: after
    /// filling the ring, it pushes the head).
    PageMove,
    /// Stop mode, ring full: the interrupted (large) event is dropped.
    Drop,
}

/// Writes events through a [`CutMem`], stops the writer inside one write (after the
/// mutation `cut` picks), attaches a new writer to the same memory, writes on, then
/// reads everything back and checks what a reader must see: no error, every event's
/// index (in its payload) where the reader's count puts it, each loss reported right
/// before the event after it (W3), every timestamp as written, and the total.
/// Returns the offsets the interrupted write mutated, in order.
fn interrupted_write(
    mode: Mode,
    before: Before,
    cut: impl Fn(usize, usize) -> bool,
    what: &str,
) -> Vec<usize> {
    let (m, l) = region(1, 4, mode);
    let cm = CutMem::new(&m, cut);
    let mut w = Writer::attach(&cm, 0).unwrap();
    let mut ts = 1000u64;
    let mut next_seq = 0u64;
    let mut write = |w: &mut Writer<&CutMem>, ts: u64, len: usize| {
        let out = w.write(0, ts, &indexed_payload(next_seq, ts, len));
        assert!(
            matches!(out, WriteOutcome::Written | WriteOutcome::Dropped),
            "{what}: {out:?}"
        );
        next_seq += 1;
        out
    };
    let big = 2000;
    match before {
        Before::SamePage => {
            for _ in 0..5 {
                ts += 10;
                write(&mut w, ts, 24);
            }
        }
        Before::PageMove => {
            // Fill the ring (overwrite: more than once), ending on a page with no room
            // for the next big event.
            // (One big event per page; 3 ring pages.)
            for _ in 0..if mode == Mode::Overwrite { 7 } else { 2 } {
                ts += 10;
                write(&mut w, ts, big);
            }
        }
        Before::Drop => {
            assert_eq!(mode, Mode::Stop);
            // The 3 ring pages full (one big event each): the next write is the first
            // drop.
            for _ in 0..3 {
                ts += 10;
                assert_eq!(write(&mut w, ts, big), WriteOutcome::Written, "{what}");
            }
        }
    }
    // The interrupted write: a timestamp jump that needs a TIME_EXTEND.
    ts += (1 << 30) + 7;
    let len = if matches!(before, Before::SamePage) {
        24
    } else {
        big
    };
    cm.armed.set(true);
    write(&mut w, ts, len);
    assert!(cm.frozen.get() || !cm.log.borrow().is_empty(), "{what}");
    let log = cm.log.take();
    // The guest side restarts: a new writer on the memory as the old one left it.
    let mut w = Writer::attach(&m, 0).unwrap();
    let resumed = w.entries() + w.dropped();
    assert!(
        resumed == next_seq - 1 || resumed == next_seq,
        "{what}: resumed at index {resumed}, {next_seq} attempts"
    );
    let mut seq = resumed;
    // Enough to fill the ring again (overwrite: to lap it).
    for k in 0..400u64 {
        ts += 3 + k;
        let out = w.write(0, ts, &indexed_payload(seq, ts, 24 + (k as usize % 3) * 8));
        assert!(
            matches!(out, WriteOutcome::Written | WriteOutcome::Dropped),
            "{what}: {out:?}"
        );
        seq += 1;
    }
    assert_eq!(w.entries() + w.dropped(), seq, "{what}: writer index");
    // Read everything back, as the host does after the writer stopped.
    let mut rb = RingBuffer::attach(m.clone(), Direct::new(m.clone(), l)).unwrap();
    rb.finalize(0).unwrap_or_else(|e| panic!("{what}: {e}"));
    let (mut next, mut pending, mut events) = (0u64, 0u64, 0u64);
    loop {
        match rb.next_event(0) {
            Ok(None) => break,
            Ok(Some(Item::Lost(n))) => pending += n,
            Ok(Some(Item::Event { ts, payload })) => {
                let s = u64::from_le_bytes(payload[..8].try_into().unwrap());
                let t = u64::from_le_bytes(payload[8..16].try_into().unwrap());
                assert!(s >= next, "{what}: event {s} after {next}");
                assert_eq!(s - next, pending, "{what}: loss before event {s} not there");
                assert_eq!(ts, t, "{what}: timestamp of event {s}");
                pending = 0;
                next = s + 1;
                events += 1;
            }
            Err(e) => panic!("{what}: read error after {events} events: {e}"),
        }
    }
    assert_eq!(next + pending, seq, "{what}: read + lost != written");
    assert!(events > 0, "{what}");
    log
}

fn ctl_word(off: usize) -> impl Fn(usize, usize) -> bool {
    let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false).unwrap();
    let at = l.ctl(0) + off;
    move |_, o| o == at
}

/// Defect: a write stopped after publishing `commit` but before storing `entries`
/// left the control block one event behind the page; a writer attaching then numbered
/// the next page one short (the reader fails with IndexBackwards) and stamped the
/// events after it with deltas from a stale `write_stamp`.
#[test]
fn reattach_after_write_stopped_after_commit() {
    let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false).unwrap();
    let commits: Vec<usize> = (0..4).map(|p| l.page_off(p) + COMMIT_OFFSET).collect();
    for mode in [Mode::Stop, Mode::Overwrite] {
        for before in [Before::SamePage, Before::PageMove] {
            let what = format!("{mode:?} {before:?} stopped after commit");
            // A move stores the new page's commit (0) first: stop after the event's.
            let nth = if matches!(before, Before::PageMove) {
                2
            } else {
                1
            };
            let seen = std::cell::Cell::new(0);
            let cut = |_, o| {
                seen.set(seen.get() + usize::from(commits.contains(&o)));
                seen.get() == nth && commits.contains(&o)
            };
            let log = interrupted_write(mode, before, cut, &what);
            assert!(commits.contains(log.last().unwrap()), "{what}: {log:?}");
        }
    }
}

/// Defect: a write stopped between `entries` and `write_stamp`: the next events on the
/// page were stamped with deltas from the stale `write_stamp`.
#[test]
fn reattach_after_write_stopped_after_entries() {
    for mode in [Mode::Stop, Mode::Overwrite] {
        for before in [Before::SamePage, Before::PageMove] {
            let what = format!("{mode:?} {before:?} stopped after entries");
            interrupted_write(mode, before, ctl_word(ctl::ENTRIES), &what);
        }
    }
}

/// As above, stopped between `bytes` and `write_stamp`.
#[test]
fn reattach_after_write_stopped_after_bytes() {
    for mode in [Mode::Stop, Mode::Overwrite] {
        for before in [Before::SamePage, Before::PageMove] {
            let what = format!("{mode:?} {before:?} stopped after bytes");
            interrupted_write(mode, before, ctl_word(ctl::BYTES), &what);
        }
    }
}

/// Defect: a drop stopped between `dropped` and `lost_pending` (stop mode): the writer
/// attaching did not know the tail page is closed (W3), wrote the next small event on
/// it, and the loss was reported after that event instead of before it.
#[test]
fn reattach_after_drop_stopped_after_dropped() {
    let what = "stop drop stopped after dropped";
    interrupted_write(Mode::Stop, Before::Drop, ctl_word(ctl::DROPPED), what);
}

/// Every place a write can stop (after each of its mutations, in each scenario): the
/// writer attaching afterwards goes on so that the reader sees exactly what was
/// written (W4). Writes stopped inside a head push (overwrite mode, the UPDATE flag
/// still on a link) are left out: see `Writer::resume`.
#[test]
fn reattach_after_write_stopped_anywhere() {
    for (mode, before) in [
        (Mode::Stop, Before::SamePage),
        (Mode::Stop, Before::PageMove),
        (Mode::Stop, Before::Drop),
        (Mode::Overwrite, Before::SamePage),
        (Mode::Overwrite, Before::PageMove),
    ] {
        let all = interrupted_write(mode, before, |_, _| false, "dry run");
        for k in 1..=all.len() {
            let what = format!("{mode:?} {before:?} stopped after mutation {k} of {all:?}");
            interrupted_write(mode, before, move |n, _| n == k, &what);
        }
    }
}

/// A reader whose swaps run in the guest (`Mailbox` callbacks).
type GuestSwapReader = RingBuffer<Arc<HeapMem>, Mailbox<Arc<HeapMem>>>;

/// One CPU with `--swap guest` in `mode` (stop mode: released pages, the reader reads in
/// place and the writer swaps released pages back itself; overwrite: mailbox swaps),
/// 6 × 4 KiB pages, a reader.
fn guest_swap_region(mode: Mode) -> (Arc<HeapMem>, RingGeometry, GuestSwapReader) {
    let cfg = Config {
        nr_cpus: 1,
        buffer_bytes: 6 * 4096,
        page_size: 4096,
        mode,
        guest_swap: true,
    };
    let l = cfg.layout().unwrap();
    let m = Arc::new(HeapMem::new(l.region_size));
    let cb = Mailbox::new(m.clone(), l, std::time::Duration::from_secs(60));
    let rb = RingBuffer::alloc(m.clone(), l, cb, 0, 1).unwrap();
    (m, l, rb)
}

/// Reads what the reader can now, checking each event's index (its payload) against
/// the count and the loss reported before it; returns the next index expected and
/// adds the events it lost to `lost`.
fn read_checked<C: hyptrace_reader::Callbacks>(
    rb: &mut RingBuffer<Arc<HeapMem>, C>,
    mut next: u64,
    lost: &mut u64,
    what: &str,
) -> u64 {
    let mut pending = 0;
    loop {
        match rb.next_event(0) {
            Ok(None) => break,
            Ok(Some(Item::Lost(n))) => pending += n,
            Ok(Some(Item::Event { payload, .. })) => {
                let s = u64::from_le_bytes(payload[..8].try_into().unwrap());
                assert_eq!(
                    s,
                    next + pending,
                    "{what}: event {s}, expected {next} + {pending} lost"
                );
                *lost += pending;
                (next, pending) = (s + 1, 0);
            }
            Err(e) => panic!("{what}: read error at {next}: {e}"),
        }
    }
    assert_eq!(pending, 0, "{what}: a loss with no event after it yet");
    next
}

/// Writes event `seq` (1000 bytes, indexed) at `ts`, which must be written; counts it.
fn write_indexed<M: SharedMem>(w: &mut Writer<M>, seq: &mut u64, ts: u64, what: &str) {
    let out = w.write(0, ts, &indexed_payload(*seq, ts, 1000));
    assert_eq!(out, WriteOutcome::Written, "{what}: write {seq}");
    *seq += 1;
}

/// W4 for a swap the writer runs itself (released pages): stopped after any of its
/// mutations — inside the swap, between the compare-exchange that put the old reader
/// page into the ring and the store of `reader_page`, or in the move after it — the
/// writer attaching afterwards finishes it and goes on: the reader sees every event
/// once, in order, and the writer keeps taking released pages back (before the fix,
/// a writer attaching after the compare-exchange moved onto the old reader page and
/// answered Busy to every later swap: it dropped every event from then on).
/// Returns the offsets the interrupted write mutated.
fn interrupted_self_swap(cut: impl Fn(usize, usize) -> bool, what: &str) -> Vec<usize> {
    let (m, _, mut rb) = guest_swap_region(Mode::Stop);
    let cm = CutMem::new(&m, cut);
    let mut w = Writer::attach(&cm, 0).unwrap();
    // 1000-byte events, 3 per page, 6 ring pages: 18 fill the ring, and the reader has
    // read (and released) all but the tail page, which the writer has not left.
    let fill = 3 * u64::from(w.layout().pages_per_cpu - 1);
    let (mut seq, mut ts) = (0u64, 100u64);
    for _ in 0..fill {
        ts += 10;
        write_indexed(&mut w, &mut seq, ts, what);
    }
    let mut lost = 0;
    let mut next = read_checked(&mut rb, 0, &mut lost, what);
    assert_eq!(next, fill, "{what}");
    // The interrupted write: the tail meets the head, a released page: a self swap.
    cm.armed.set(true);
    ts += 10;
    let before = w.self_swaps();
    w.write(0, ts, &indexed_payload(seq, ts, 1000));
    seq += 1;
    let log = cm.log.take();
    if !cm.frozen.get() {
        assert_eq!(w.self_swaps(), before + 1, "{what}: the dry run swaps");
    }
    // The guest side restarts: a new writer on the memory as the old one left it.
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    // S1 at rest again: the attach finished the stopped swap or undid its first store.
    assert_s1(&m, w.layout(), what);
    let resumed = w.entries() + w.dropped();
    assert!(
        resumed == seq - 1 || resumed == seq,
        "{what}: resumed at index {resumed}, {seq} attempts"
    );
    seq = resumed;
    // Three ring-fulls more, read every page-full: nothing may be dropped now.
    for k in 0..60u64 {
        ts += 10;
        write_indexed(&mut w, &mut seq, ts, what);
        if k % 3 == 2 {
            next = read_checked(&mut rb, next, &mut lost, what);
        }
    }
    assert!(
        w.self_swaps() >= 10,
        "{what}: self swaps {}",
        w.self_swaps()
    );
    w.finish();
    rb.finalize(0).unwrap_or_else(|e| panic!("{what}: {e}"));
    next = read_checked(&mut rb, next, &mut lost, what);
    assert_eq!(next, seq, "{what}: read + lost != written");
    assert_eq!((w.dropped(), lost), (0, 0), "{what}: dropped, lost");
    log
}

#[test]
fn reattach_after_a_released_page_swap_stopped_anywhere() {
    let all = interrupted_self_swap(|_, _| false, "dry run");
    assert!(all.len() > 10, "{all:?}");
    for k in 1..=all.len() {
        let what = format!("stopped after mutation {k} of {all:?}");
        interrupted_self_swap(move |n, _| n == k, &what);
    }
}

/// The same for a mailbox swap (`--swap guest`, overwrite mode): the writer stopped
/// inside the swap it ran for the host's request. The writer attaching finishes the
/// swap and answers the request — serving it again would swap the page out of the
/// reader's hands before it read it (its events lost without a count) — and the
/// reader reads every event, or counts it lost, once, in order.
fn interrupted_mailbox_swap(
    cut: impl Fn(usize, usize) -> bool,
    may_lose: bool,
    what: &str,
) -> Vec<usize> {
    let (m, _, mut rb) = guest_swap_region(Mode::Overwrite);
    let cm = CutMem::new(&m, cut);
    let mut w = Writer::attach(&cm, 0).unwrap();
    let (mut seq, mut ts) = (0u64, 100u64);
    // Two pages and a bit; the reader asks for a swap, nobody answers yet.
    for _ in 0..7 {
        ts += 10;
        write_indexed(&mut w, &mut seq, ts, what);
    }
    let mut lost = 0;
    let mut next = read_checked(&mut rb, 0, &mut lost, what);
    assert!(rb.request_in_flight(0), "{what}: a swap request is pending");
    // The interrupted serve.
    cm.armed.set(true);
    assert!(w.serve_mailbox(), "{what}");
    let log = cm.log.take();
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    assert_s1(&m, w.layout(), what);
    seq = w.entries() + w.dropped();
    // Writing on, serving and reading: a ring-full and more, every page read.
    for _ in 0..40 {
        ts += 10;
        write_indexed(&mut w, &mut seq, ts, what);
        for _ in 0..4 {
            w.serve_mailbox();
            next = read_checked(&mut rb, next, &mut lost, what);
        }
    }
    w.finish();
    rb.finalize(0).unwrap_or_else(|e| panic!("{what}: {e}"));
    next = read_checked(&mut rb, next, &mut lost, what);
    assert_eq!(next, seq, "{what}: read + lost != written");
    // The reader kept up: nothing overwritten, and no page taken from it unread —
    // except after a stop between the swap's store of `reader_page` and the answer:
    // the swap is complete, nothing in the ring tells it from a request not yet served,
    // and serving it again swaps out the page the reader was about to read (counted
    // lost, exactly: at most the page's 3 events).
    if may_lose {
        assert!(lost <= 3, "{what}: {lost} events lost");
    } else {
        assert_eq!(lost, 0, "{what}: events lost");
    }
    log
}

#[test]
fn reattach_after_a_mailbox_swap_stopped_anywhere() {
    let all = interrupted_mailbox_swap(|_, _| false, false, "dry run");
    let (_, l, _) = guest_swap_region(Mode::Overwrite);
    let (reader_page, ack) = (l.ctl(0) + ctl::READER_PAGE, l.ctl(0) + ctl::MBOX_ACK);
    let published = all.iter().position(|&o| o == reader_page).unwrap() + 1;
    assert_eq!(all.last(), Some(&ack), "{all:?}");
    for k in 1..=all.len() {
        let what = format!("stopped after mutation {k} of {all:?}");
        let may_lose = (published..all.len()).contains(&k);
        interrupted_mailbox_swap(move |n, _| n == k, may_lose, &what);
    }
}

/// Defect (S1, issue 27): a swap that gave up (`Contended`) left `after|HEAD` in the
/// reader page's link, stored by its last attempt before a compare-exchange that lost:
/// at rest two links carried HEAD. Here the writer fills a page (pushing the head)
/// right before each of the swap's compare-exchanges, so every attempt loses; the swap
/// must leave the reader page's link without a flag.
#[test]
fn contended_swap_leaves_no_flag_on_the_reader_page() {
    let (m, l) = region(1, 4, Mode::Overwrite);
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    let mut ts = 0;
    write_pages(&mut w, &mut ts, 3);
    let hm = HookMem {
        m: &m,
        hook: std::cell::RefCell::new(Box::new(|a, _off| {
            if a == Access::Cas {
                write_pages(&mut w, &mut ts, 1);
            }
        })),
    };
    let r = swap_reader_page(&hm, &l, 0);
    drop(hm);
    assert_eq!(r, Ok(SwapStatus::Contended));
    assert_s1(&m, &l, "after a contended swap");
}

/// Defect (S1, found in review of issue 27): a writer stopped inside a head push after
/// it published the new HEAD link (`H.next = N|HEAD`) but before it cleared UPDATE on
/// its tail's link; a hinted swap (`--swap host`, hint H: the page the last swap put in
/// the ring) took N meanwhile (`H.next = R`, `R.next = N'|HEAD`). The writer attaching
/// finished the push from the start: it read `H.next = R` as the page after H and
/// flagged it (`H.next = R|HEAD`, FT_HEAD on R): two HEAD links, two FT_HEAD pages. A
/// push whose HEAD link was published is finished by clearing UPDATE alone.
#[test]
fn reattach_after_a_published_head_push_and_a_swap() {
    let (m, l) = region(1, 4, Mode::Overwrite);
    let next = |p: u32| l.footer_off(p) + footer::NEXT;
    let (reader, head, tail) = (0u32, 1u32, 3u32);
    let cm = CutMem::new(&m, move |_, off| off == next(head));
    let mut w = Writer::attach(&cm, 0).unwrap();
    let mut ts = 0;
    // Fill the 3 ring pages (1, 2, 3): tail 3, its link names the head, 1.
    write_pages(&mut w, &mut ts, 3);
    assert_eq!(ft(&m, &l, tail, footer::NEXT), link(head, LINK_HEAD));
    // The push of 1 stops right after `1.next = 2|HEAD` (the outcome of a write whose
    // stores stop halfway says nothing).
    cm.armed.set(true);
    w.write(0, 4, &[0u8; ONE_PAGE]);
    assert!(cm.frozen.get(), "the push did not reach the new HEAD link");
    assert_eq!(ft(&m, &l, tail, footer::NEXT), link(head, LINK_UPDATE));
    assert_eq!(ft(&m, &l, head, footer::NEXT), link(2, LINK_HEAD));
    // A hinted swap starting at 1 finds 2|HEAD and takes page 2.
    let r = swap_reader_page_hinted(&*m, &l, 0, &mut SwapHint::at(head));
    assert_eq!(r, Ok(SwapStatus::Swapped { page: 2 }));
    assert_eq!(ft(&m, &l, head, footer::NEXT), link(reader, 0));
    // The writer attaches again: one HEAD link, naming the FT_HEAD page.
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    assert_s1(&m, &l, "after the re-attach");
    ts = 4;
    for _ in 0..7 {
        write_pages(&mut w, &mut ts, 1);
        assert_s1(&m, &l, "writing on");
    }
}
