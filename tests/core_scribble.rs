//! Hostile memory WHILE reading: honest writer threads write flat out (and serve the
//! mailbox), a scribbler thread corrupts the region concurrently — random bytes into
//! pages, footers, links and control-block words, and targeted lies (commit beyond the
//! capacity, `first_index` backwards or huge, page ids out of range, duplicate
//! `page_seq`, HEAD/UPDATE flags on every link, huge counters, mailbox words) — while the
//! reader runs `poke`, `next_event`, `next_page`, `finalize` and the final walk,
//! `take_trailing_loss`, `sync_writer_counters` and re-attaches, over `Direct` and over
//! `Mailbox` callbacks.
//!
//! Every reader call must return `Ok` or a `ReadError`:
//! - never panic (the reader runs inside the test; a panic fails it);
//! - within a bounded number of shared-memory operations (a counting `SharedMem`
//!   fails the call past [`OPS_PER_CALL`]), and the whole test under a progress
//!   watchdog that fails rather than hangs;
//! - with bounded memory: the reader thread's heap (counted by a global allocator)
//!   never grows with what the guest writes;
//! - with stats that never go backwards (sums of guest numbers saturate, never wrap),
//!   and items within a page's capacity.
//!
//! Seeded (the seed is in every failure message); the number of reader calls is fixed,
//! not the time, so a busy machine makes a run slower, never weaker.

use hyptrace::rng::Rng;
use hyptrace::watchdog::{join, take_thread_peak, thread_net_bytes, with_watchdog, SetOnDrop};
use hyptrace_abi::layout::{
    ctl, footer, link, Mode, RingGeometry, CTL_SIZE, FOOTER_SIZE, LINK_HEAD, LINK_UPDATE,
};
use hyptrace_abi::page::{COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_abi::{HeapMem, SharedMem};
use hyptrace_reader::{Callbacks, CpuStats, Direct, Item, Mailbox, RingBuffer};
use hyptrace_writer::{WriteOutcome, Writer};
use std::sync::atomic::Ordering::{self, Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

#[global_allocator]
static ALLOC: hyptrace::watchdog::CountingAlloc = hyptrace::watchdog::CountingAlloc;

const CPUS: u32 = 2;
const PAGES: u32 = 5;
const PAGE: usize = 4096;
/// Reader calls per test run.
const READER_CALLS: u64 = 60_000;
/// The reader goes on past READER_CALLS, at most this many times as many calls, until
/// the coverage is reached.
const MAX_CALLS_FACTOR: u64 = 50;
/// Shared-memory operations one reader call may do: swaps (≤ 5 per call, 16 retries,
/// each a head search of ≤ `PAGES` links) plus footers, commits and the copies —
/// a few hundred in the worst case. A loop bounded by a guest value would exceed it.
const OPS_PER_CALL: u64 = 5_000;
/// Heap the reader thread may hold beyond what it held after attaching: the final
/// walk's page list, error strings, a re-attached reader (two page buffers per CPU).
const HEAP_BOUND: i64 = 64 * 1024;
/// No progress at all for this long is a hang.
const STALL: Duration = Duration::from_secs(90);

/// Values that stress arithmetic.
fn nasty(rng: &mut Rng) -> u64 {
    match rng.below(7) {
        0 => 0,
        1 => rng.below(8),
        2 => 1 << rng.below(64),
        3 => (1 << rng.below(64)) - 1,
        4 => u64::MAX - rng.below(4),
        5 => u64::from(u32::MAX) + rng.below(3),
        _ => rng.next(),
    }
}

/// The reader's view of the region: counts every shared-memory operation, so a call
/// that loops on guest data is caught even when it would end eventually.
/// (The mailbox's wait for an answer — loads of `MBOX_ACK` and `WRITER_STATE` for at
/// most `MAILBOX_SPIN` — is bounded in time, not in steps: not counted.)
struct Counted {
    m: Arc<HeapMem>,
    l: RingGeometry,
    ops: AtomicU64,
}

impl Counted {
    fn tick(&self) {
        self.ops.fetch_add(1, Relaxed);
    }
}

impl SharedMem for Counted {
    fn size(&self) -> usize {
        self.m.size()
    }
    fn load(&self, off: usize, order: Ordering) -> u64 {
        let spin = (0..CPUS).any(|c| {
            off == self.l.ctl(c) + ctl::MBOX_ACK || off == self.l.ctl(c) + ctl::WRITER_STATE
        });
        if !spin {
            self.tick();
        }
        self.m.load(off, order)
    }
    fn store(&self, off: usize, val: u64, order: Ordering) {
        self.tick();
        self.m.store(off, val, order)
    }
    fn swap(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.tick();
        self.m.swap(off, val, order)
    }
    fn compare_exchange(
        &self,
        off: usize,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64> {
        self.tick();
        self.m.compare_exchange(off, current, new, success, failure)
    }
    fn fetch_or(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.tick();
        self.m.fetch_or(off, val, order)
    }
    fn fetch_and(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.tick();
        self.m.fetch_and(off, val, order)
    }
    fn fetch_add(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.tick();
        self.m.fetch_add(off, val, order)
    }
    fn write_bytes(&self, off: usize, src: &[u8]) {
        self.tick();
        self.m.write_bytes(off, src)
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        self.tick();
        self.m.read_bytes(off, dst)
    }
}

/// One scribble: a random or targeted lie somewhere in the CPU's pages or control
/// block. Returns a label (for coverage counts).
fn scribble(m: &HeapMem, l: &RingGeometry, rng: &mut Rng) -> usize {
    let cpu = rng.below(u64::from(CPUS)) as u32;
    let first = l.first_page(cpu);
    let page = first + rng.below(u64::from(PAGES)) as u32;
    let other = first + rng.below(u64::from(PAGES)) as u32;
    let f = l.footer_off(page);
    let c = l.ctl(cpu);
    let kind = rng.below(15) as usize;
    match kind {
        0 => {
            // Random bytes into a page (data, header or footer).
            let off = l.page_off(page) + rng.below((PAGE - 8) as u64) as usize;
            let b = rng.next().to_le_bytes();
            m.write_bytes(off, &b[..1 + rng.below(8) as usize]);
        }
        1 => {
            // A random word of a footer or of the control block.
            let off = if rng.below(2) == 0 {
                f + 8 * rng.below((FOOTER_SIZE / 8) as u64) as usize
            } else {
                c + 8 * rng.below((CTL_SIZE / 8) as u64) as usize
            };
            m.store(off, nasty(rng), Relaxed);
        }
        2 => {
            // Commit beyond the capacity, backwards, with stray flag bits.
            let off = l.page_off(page) + COMMIT_OFFSET;
            let old = m.load(off, Relaxed);
            let v = match rng.below(4) {
                0 => (l.data_capacity() + 4 + 4 * rng.below(64) as usize) as u64,
                1 => old.saturating_sub(4 * (1 + rng.below(64))),
                2 => old | (1 << (32 + rng.below(32))),
                _ => nasty(rng),
            };
            m.store(off, v, Relaxed);
        }
        3 => {
            // first_index backwards, far ahead, or huge.
            let old = m.load(f + footer::FIRST_INDEX, Relaxed);
            let v = match rng.below(3) {
                0 => old.saturating_sub(1 + rng.below(1000)),
                1 => old.saturating_add(rng.below(1 << 40)),
                _ => u64::MAX - rng.below(1000),
            };
            m.store(f + footer::FIRST_INDEX, v, Relaxed);
        }
        4 => {
            // Page ids out of range or of the other CPU, in links and the control block.
            let id = match rng.below(4) {
                0 => l.total_pages() + rng.below(5),
                1 => u64::from(l.first_page((cpu + 1) % CPUS)),
                2 => u64::from(u32::MAX) + rng.below(3),
                _ => rng.next() >> rng.below(64),
            };
            match rng.below(3) {
                0 => m.store(f + footer::NEXT, (id << 2) | rng.below(4), Relaxed),
                1 => m.store(c + ctl::READER_PAGE, id, Relaxed),
                _ => m.store(c + ctl::TAIL_PAGE, id, Relaxed),
            }
        }
        5 => {
            // Duplicate page_seq.
            let v = m.load(l.footer_off(other) + footer::PAGE_SEQ, Relaxed);
            m.store(f + footer::PAGE_SEQ, v, Relaxed);
        }
        6 => {
            // HEAD / UPDATE flags everywhere.
            for p in first..first + PAGES {
                if rng.below(2) == 0 {
                    let fl = rng.pick(&[LINK_HEAD, LINK_UPDATE, LINK_HEAD | LINK_UPDATE]);
                    m.fetch_or(l.footer_off(p) + footer::NEXT, fl, Relaxed);
                }
            }
        }
        7 => {
            // A link cycle skipping the head, or a link to itself.
            let v = link(other, rng.pick(&[0, LINK_HEAD]));
            m.store(f + footer::NEXT, v, Relaxed);
        }
        8 => {
            // Huge counters in the footers and the control block.
            let which = rng.pick(&[
                footer::ENTRIES,
                footer::PAGES_TOUCHED,
                footer::OVERRUN,
                footer::DROPPED,
                footer::PAGE_ENTRIES,
                footer::MISSED,
            ]);
            m.store(f + which, nasty(rng), Relaxed);
            let which = rng.pick(&[ctl::ENTRIES, ctl::OVERRUN, ctl::DROPPED, ctl::PAGES_TOUCHED]);
            m.store(c + which, u64::MAX - rng.below(1 << 20), Relaxed);
        }
        9 => {
            // Mailbox lies: random acks and requests, finished/active writer states.
            let which = rng.pick(&[ctl::MBOX_ACK, ctl::MBOX_REQ, ctl::WRITER_STATE]);
            let v = match rng.below(3) {
                0 => rng.below(4),
                1 => (m.load(c + ctl::MBOX_REQ, Relaxed) & !0xff) | rng.below(256),
                _ => rng.next(),
            };
            m.store(c + which, v, Relaxed);
        }
        10 => {
            // The reader page id swapped with another page's.
            m.store(c + ctl::READER_PAGE, u64::from(other), Relaxed);
        }
        11 => {
            // A broken footer magic / id.
            m.store(f + footer::ID_MAGIC, rng.next(), Relaxed);
        }
        13 => {
            // A ladder of huge losses: the ring pages in page_seq order, each claiming
            // to start ~2^62 events after the previous one (their sum passes 2^64).
            let rs = m.load(l.footer_off(first) + footer::PAGE_SEQ, Relaxed);
            for (i, p) in (first..first + PAGES).enumerate() {
                let i = i as u64;
                m.store(l.footer_off(p) + footer::PAGE_SEQ, rs + i, Relaxed);
                m.store(
                    l.footer_off(p) + footer::FIRST_INDEX,
                    i.wrapping_mul((1 << 62) + rng.below(1000)),
                    Relaxed,
                );
            }
        }
        12 => {
            // Bad record headers at the start of the data.
            let at = l.page_off(page) + PAGE_HEADER_SIZE + 4 * rng.below(16) as usize;
            m.write_bytes(at, &(rng.next() as u32).to_le_bytes());
        }
        _ => {
            // A burst of random bytes anywhere in the CPU's pages.
            for _ in 0..1 + rng.below(16) {
                let off =
                    l.page_off(first) + rng.below((PAGES as usize * PAGE - 8) as u64) as usize;
                m.write_bytes(off, &rng.next().to_le_bytes());
            }
        }
    }
    kind
}

/// What a run got through (to check it reaches the interesting code).
#[derive(Default, Debug)]
struct Coverage {
    calls: u64,
    events: u64,
    pages: u64,
    errors: u64,
    finalized: u64,
    attached: u64,
    written: u64,
    scribbles: u64,
    /// Most shared-memory operations one call did.
    max_ops: u64,
    /// Most heap the reader held beyond what it held after attaching.
    max_heap: i64,
}

impl Coverage {
    /// Whether the reader has met every kind of outcome the run checks for.
    fn reached(&self) -> bool {
        [
            self.events,
            self.pages,
            self.errors,
            self.finalized,
            self.attached,
        ]
        .iter()
        .all(|&n| n > 0)
    }
}

fn make_cb(m: &Arc<Counted>, l: RingGeometry, mailbox: bool) -> Box<dyn Callbacks + Send> {
    if mailbox {
        Box::new(Mailbox::new(m.clone(), l, Duration::from_millis(50)))
    } else {
        Box::new(Direct::new(m.clone(), l))
    }
}

type Rb = RingBuffer<Arc<Counted>, Box<dyn Callbacks + Send>>;

/// Checks what must hold after every reader call on `cpu`.
fn check_stats(before: &CpuStats, after: &CpuStats, what: &str) {
    for (name, a, b) in [
        ("read", before.read, after.read),
        ("lost", before.lost, after.lost),
        ("bytes", before.bytes, after.bytes),
        ("swaps", before.swaps, after.swaps),
        ("pages_read", before.pages_read, after.pages_read),
        ("contended", before.contended, after.contended),
    ] {
        assert!(
            b >= a,
            "{what}: stats.{name} went backwards ({a} -> {b}): a wrapped sum"
        );
    }
}

fn reader(
    mut rb: Rb,
    (m, l, mailbox): (&Arc<Counted>, RingGeometry, bool),
    seed: u64,
    progress: &AtomicU64,
    healed: &AtomicU64,
    cov: &mut Coverage,
) {
    let mut seen_heal = 0;
    let mut rng = Rng(seed ^ 0x5eed);
    // What the reader may hold from here on is bounded, whatever the guest writes.
    let base = thread_net_bytes();
    take_thread_peak();
    let cap = l.data_capacity();
    // At least READER_CALLS; on past them (bounded) until the run reached every part
    // of the code it is meant to: on a loaded machine the writers may have had too
    // little CPU for the reader to meet an honest event in the first calls (a
    // condition, not luck: the coverage asserted below).
    for call in 0..READER_CALLS * MAX_CALLS_FACTOR {
        if call >= READER_CALLS && cov.reached() {
            break;
        }
        progress.store(call, SeqCst);
        // Let the writers and the scribbler run between calls (not after every call:
        // on a busy machine each yield can cost a whole time slice).
        if call % 8 == 0 {
            std::thread::yield_now();
        }
        let heal = healed.load(SeqCst);
        if heal != seen_heal {
            // Freshly initialised rings: start over, like a host attaching to them.
            seen_heal = heal;
            if let Ok(r) = RingBuffer::attach(m.clone(), make_cb(m, l, mailbox)) {
                rb = r;
                cov.attached += 1;
            }
        }
        let cpu = if rng.below(50) == 0 {
            CPUS + rng.below(2) as u32
        } else {
            rng.below(u64::from(CPUS)) as u32
        };
        let before = rb.stats(cpu);
        let op = rng.below(100);
        let what = format!("seed {seed:#x} call {call} op {op} cpu {cpu}");
        let ops0 = m.ops.load(Relaxed);
        let ok = match op {
            0..=9 => rb.poke(cpu).is_ok(),
            10..=59 => match rb.next_event(cpu) {
                Ok(Some(Item::Event { payload, .. })) => {
                    assert!(payload.len() <= cap, "{what}: payload {}", payload.len());
                    cov.events += 1;
                    true
                }
                Ok(Some(Item::Lost(n))) => {
                    assert!(n > 0, "{what}: Lost(0)");
                    true
                }
                Ok(None) => true,
                Err(_) => false,
            },
            60..=79 => match rb.next_page(cpu) {
                Ok(Some(p)) => {
                    assert!(p.commit_len <= cap, "{what}: commit_len {}", p.commit_len);
                    assert_eq!(p.bytes.len(), PAGE, "{what}");
                    assert!(p.events as usize <= cap / 4, "{what}: {} events", p.events);
                    cov.pages += 1;
                    true
                }
                Ok(None) => true,
                Err(_) => false,
            },
            80..=84 => {
                let r = rb.finalize(cpu);
                cov.finalized += u64::from(r.is_ok());
                r.is_ok()
            }
            85..=88 => {
                let n = rb.take_trailing_loss(cpu);
                let after = rb.stats(cpu);
                assert_eq!(
                    after.lost,
                    before.lost.saturating_add(n),
                    "{what}: trailing loss {n} not counted once"
                );
                true
            }
            89..=92 => {
                let ok = rb.sync_writer_counters(cpu).is_ok();
                let _ = rb.commit_page(cpu);
                let _ = rb.writer_index(cpu);
                let _ = rb.writer_finished(cpu);
                ok
            }
            _ => {
                // Re-attach (the pack and reader pages may be lies by now).
                if let Ok(r) = RingBuffer::attach(m.clone(), make_cb(m, l, mailbox)) {
                    rb = r;
                    cov.attached += 1;
                }
                true
            }
        };
        let ops = m.ops.load(Relaxed) - ops0;
        assert!(
            ops <= OPS_PER_CALL,
            "{what}: {ops} shared-memory operations in one call: a loop on guest data"
        );
        cov.max_ops = cov.max_ops.max(ops);
        cov.calls += 1;
        cov.errors += u64::from(!ok);
        if !(85..=88).contains(&op) && op < 93 {
            // (sync_writer_counters overwrites written/overrun/dropped, not these.)
            check_stats(&before, &rb.stats(cpu), &what);
        }
        let held = take_thread_peak() - base;
        cov.max_heap = cov.max_heap.max(held);
        assert!(
            held <= HEAP_BOUND,
            "{what}: the reader holds {held} more heap bytes than after attaching"
        );
    }
    assert!(thread_net_bytes() - base <= HEAP_BOUND);
}

fn run(mode: Mode, mailbox: bool, seed: u64) {
    let cov = Arc::new(std::sync::Mutex::new(Coverage::default()));
    let cov2 = cov.clone();
    with_watchdog(STALL, move |progress| {
        let l = RingGeometry::new(CPUS, PAGES, PAGE, mode, mailbox).unwrap();
        let heap = Arc::new(HeapMem::new(l.region_size));
        l.init_region(&*heap, 0, 1);
        let m = Arc::new(Counted {
            m: heap.clone(),
            l,
            ops: AtomicU64::new(0),
        });
        let stop = AtomicBool::new(false);
        let healed = AtomicU64::new(0);
        let written = AtomicU64::new(0);
        let scribbles = AtomicU64::new(0);
        let mut c = Coverage::default();
        // Attached before any writer or the scribbler runs: on a loaded machine the
        // scribbler may otherwise lie before the reader thread's first attach (a refusal
        // the test cannot go on from; later attaches meet lies and are counted).
        let rb: Rb = RingBuffer::attach(m.clone(), make_cb(&m, l, mailbox)).expect("attach");
        std::thread::scope(|s| {
            let writers: Vec<_> = (0..CPUS)
                .map(|cpu| {
                    let (heap, stop, written, healed) = (&heap, &stop, &written, &healed);
                    s.spawn(move || {
                        let _g = SetOnDrop(stop);
                        let mut rng = Rng(seed ^ u64::from(cpu));
                        let mut w: Option<Writer<&HeapMem>> = None;
                        let mut ts = 0u64;
                        let mut p = [0u8; 300];
                        let mut seen_heal = 0;
                        while !stop.load(Relaxed) {
                            let heal = healed.load(SeqCst);
                            if heal != seen_heal {
                                // Fresh rings: a new writer, as after a guest reboot.
                                seen_heal = heal;
                                w = None;
                            }
                            let Some(wr) = w.as_mut() else {
                                // (Re-)attach; a lying control block may refuse.
                                w = Writer::attach(&**heap, cpu).ok();
                                std::thread::yield_now();
                                continue;
                            };
                            for _ in 0..64 {
                                wr.serve_mailbox();
                                ts += rng.below(1 << 29);
                                let len = rng.pick(&[0usize, 8, 24, 100, 300]);
                                p[..8].copy_from_slice(&ts.to_le_bytes());
                                match wr.write(0, ts, &p[..len]) {
                                    WriteOutcome::Written => {
                                        written.fetch_add(1, Relaxed);
                                    }
                                    WriteOutcome::Corrupt => {
                                        w = None;
                                        break;
                                    }
                                    _ => {}
                                }
                            }
                            std::thread::yield_now();
                        }
                    })
                })
                .collect();
            let scribbler = {
                let (heap, stop, scribbles, healed) = (&heap, &stop, &scribbles, &healed);
                s.spawn(move || {
                    let _g = SetOnDrop(stop);
                    let mut rng = Rng(seed.rotate_left(17));
                    while !stop.load(Relaxed) {
                        // Heal (re-initialise the rings): the writers and the reader
                        // start over and get some honest data through...
                        let gen = healed.load(SeqCst) + 1;
                        l.init_region(&**heap, 0, gen);
                        healed.store(gen, SeqCst);
                        std::thread::sleep(Duration::from_micros(rng.below(2000)));
                        // ...then a burst of lies while they run.
                        for _ in 0..rng.below(300) {
                            if stop.load(Relaxed) {
                                break;
                            }
                            scribble(heap, &l, &mut rng);
                            scribbles.fetch_add(1, Relaxed);
                            if rng.below(16) == 0 {
                                std::thread::sleep(Duration::from_micros(rng.below(200)));
                            }
                        }
                    }
                })
            };
            let _g = SetOnDrop(&stop);
            reader(rb, (&m, l, mailbox), seed, progress, &healed, &mut c);
            stop.store(true, SeqCst);
            for w in writers {
                join(w);
            }
            join(scribbler);
        });
        c.written = written.load(Relaxed);
        c.scribbles = scribbles.load(Relaxed);
        *cov2.lock().unwrap() = c;
    });
    let c = cov.lock().unwrap();
    eprintln!("{mode:?} mailbox={mailbox} seed {seed:#x}: {c:?}");
    // The run reached the code: events and pages read, errors seen, walks started.
    assert!(c.calls >= READER_CALLS, "{c:?}");
    for (name, n) in [
        ("events read", c.events),
        ("pages read", c.pages),
        ("errors", c.errors),
        ("final walks", c.finalized),
        ("re-attaches", c.attached),
        ("events written", c.written),
        ("scribbles", c.scribbles),
    ] {
        assert!(n > 0, "{mode:?} mailbox={mailbox}: no {name}: {c:?}");
    }
}

#[test]
fn scribbled_while_reading_overwrite_direct() {
    run(Mode::Overwrite, false, 0x5c21_b000);
}

#[test]
fn scribbled_while_reading_stop_direct() {
    run(Mode::Stop, false, 0x5c21_b001);
}

#[test]
fn scribbled_while_reading_overwrite_mailbox() {
    run(Mode::Overwrite, true, 0x5c21_b002);
}

#[test]
fn scribbled_while_reading_stop_mailbox() {
    run(Mode::Stop, true, 0x5c21_b003);
}
