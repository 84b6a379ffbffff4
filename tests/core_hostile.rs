//! Hostile shared memory: the reader (attach, poke, next_event, next_page, finalize,
//! take_trailing_loss, sync_writer_counters) and the writer-domain operations
//! (swap_reader_page, update_footers, Writer::attach/write) on corrupted regions return
//! errors or valid data — never panic, never hang.
//!
//! Valid regions with real content (both modes, wrapped rings, swapped pages) are
//! corrupted in targeted and random ways — link cycles, ids out of range or of another
//! CPU, swapped reader page ids, commit past the page or going backwards, bad length
//! words, index going backwards, duplicate page_seq, broken magics and status bits,
//! huge counters, random pack fields and random bytes — before and between the
//! operations, from a seeded RNG (the seed is in every failure message). Every loop in
//! the code under test must be bounded: a watchdog fails the test if an iteration
//! takes more than 60 s. `RingGeometry::parse` gets random and mutated packs.

use hyptrace::rng::Rng;
use hyptrace_abi::layout::{
    cpu_desc, ctl, footer, link, Mode, RingGeometry, CTL_SIZE, FOOTER_SIZE, LINK_HEAD, LINK_UPDATE,
    PACK_HEADER_SIZE,
};
use hyptrace_abi::page::{header_word, COMMIT_OFFSET, PAGE_HEADER_SIZE, TYPE_PADDING};
use hyptrace_abi::{HeapMem, SharedMem, WordMem};
use hyptrace_reader::{Direct, Item, RingBuffer};
use hyptrace_writer::{swap_reader_page, update_footers, WriteOutcome, Writer};
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

/// Values that stress arithmetic: huge, near powers of two, small.
fn nasty(rng: &mut Rng, huge: bool) -> u64 {
    let v = match rng.below(8) {
        0 => 0,
        1 => rng.below(8),
        2 => 1 << rng.below(64),
        3 => (1 << rng.below(64)) - 1,
        4 => u64::MAX - rng.below(4),
        5 => u64::from(u32::MAX) + rng.below(3),
        _ => rng.next(),
    };
    if huge {
        v
    } else {
        // Leave room for counting on (see `huge_counters_*`).
        v & ((1 << 62) - 1)
    }
}

const PAGES: u32 = 4;
const CPUS: u32 = 2;

/// A valid region with real content: both CPUs wrapped their rings, a few pages read.
fn base_region(mode: Mode, seed: u64) -> (Vec<u8>, RingGeometry) {
    let l = RingGeometry::new(CPUS, PAGES, 4096, mode, false).unwrap();
    let m = Arc::new(HeapMem::new(l.region_size));
    let mut rb = RingBuffer::alloc(m.clone(), l, Direct::new(m.clone(), l), 0, 1).unwrap();
    let mut rng = Rng(seed);
    for cpu in 0..CPUS {
        let mut w = Writer::attach(m.clone(), cpu).unwrap();
        let mut ts = 0;
        for seq in 0..(200 + rng.below(400)) {
            ts += rng.below(1 << 28);
            let len = rng.pick(&[0usize, 4, 8, 24, 100, 120, 500, 1500]);
            let mut p = vec![seq as u8; len];
            if len >= 8 {
                p[..8].copy_from_slice(&seq.to_le_bytes());
            }
            w.write(0, ts, &p);
            if rng.below(40) == 0 {
                while let Ok(Some(_)) = rb.next_event(cpu) {}
            }
        }
    }
    (m.to_vec(), l)
}

fn word_of(l: &RingGeometry, rng: &mut Rng, cpu: u32) -> usize {
    // A word of a footer, a page header, or the control block of `cpu`.
    let page = l.first_page(cpu) + rng.below(u64::from(PAGES)) as u32;
    match rng.below(3) {
        0 => l.footer_off(page) + 8 * rng.below((FOOTER_SIZE / 8) as u64) as usize,
        1 => l.page_off(page) + 8 * rng.below(2) as usize,
        _ => l.ctl(cpu) + 8 * rng.below((CTL_SIZE / 8) as u64) as usize,
    }
}

/// Applies one corruption to `m`; returns what it did (for failure messages).
fn corrupt(m: &HeapMem, l: &RingGeometry, rng: &mut Rng, huge: bool) -> String {
    let cpu = rng.below(u64::from(CPUS)) as u32;
    let first = l.first_page(cpu);
    let page = first + rng.below(u64::from(PAGES)) as u32;
    let other = first + rng.below(u64::from(PAGES)) as u32;
    let f = l.footer_off(page);
    let c = l.ctl(cpu);
    let ld = |off: usize| m.load(off, Relaxed);
    let st = |off: usize, v: u64| m.store(off, v, Relaxed);
    match rng.below(17) {
        0 => {
            // Link cycles, out-of-range ids, other CPUs' pages, every flag combination.
            let target = match rng.below(5) {
                0 => page,
                1 => other,
                2 => l.first_page((cpu + 1) % CPUS) + 1,
                3 => (l.total_pages() + rng.below(5)) as u32,
                _ => rng.next() as u32,
            };
            let v = link(target, rng.pick(&[0, LINK_HEAD, LINK_UPDATE, 3]));
            st(f + footer::NEXT, v);
            format!("link of {page} = {v:#x}")
        }
        1 => {
            let v = match rng.below(4) {
                0 => u64::from(other),
                1 => l.total_pages() + rng.below(3),
                2 => u64::from(l.first_page((cpu + 1) % CPUS)),
                _ => nasty(rng, true),
            };
            let which = rng.pick(&[ctl::READER_PAGE, ctl::TAIL_PAGE]);
            st(c + which, v);
            format!("ctl {cpu} +{which} = {v}")
        }
        2 => {
            // Swapped reader page ids: the control block and FT_READER disagree.
            let r = ld(c + ctl::READER_PAGE);
            st(c + ctl::READER_PAGE, u64::from(other));
            st(l.footer_off(other) + footer::READER_STATUS, 2);
            format!("reader {r} -> {other}")
        }
        3 => {
            let off = l.page_off(page) + COMMIT_OFFSET;
            let old = ld(off);
            let v = match rng.below(5) {
                0 => (l.data_capacity() + 1 + rng.below(100) as usize) as u64,
                1 => old.saturating_sub(1 + rng.below(64)) & !3, // backwards
                2 => old | (rng.below(4) << 30),
                3 => old | (1 << (32 + rng.below(32))),
                _ => nasty(rng, true),
            };
            st(off, v);
            format!("commit of {page}: {old:#x} -> {v:#x}")
        }
        4 => {
            // Bad event data: length words below 4, lengths past the end, padding.
            let at = l.page_off(page) + PAGE_HEADER_SIZE + 4 * rng.below(64) as usize;
            let (h, a) = match rng.below(4) {
                0 => (header_word(0, 1), rng.below(4) as u32),
                1 => (header_word(0, 0), u32::MAX - rng.below(8) as u32),
                2 => (header_word(TYPE_PADDING, 1), rng.next() as u32),
                _ => (rng.next() as u32, rng.next() as u32),
            };
            let mut b = [0u8; 8];
            b[..4].copy_from_slice(&h.to_le_bytes());
            b[4..].copy_from_slice(&a.to_le_bytes());
            m.write_bytes(at, &b);
            format!("event data of {page} at {at:#x}: {h:#x} {a:#x}")
        }
        5 => {
            let old = ld(f + footer::FIRST_INDEX);
            let v = match rng.below(3) {
                0 => old.saturating_sub(1 + rng.below(100)),
                1 => old + rng.below(1000),
                _ => nasty(rng, huge),
            };
            st(f + footer::FIRST_INDEX, v);
            format!("first_index of {page}: {old} -> {v}")
        }
        6 => {
            let v = ld(l.footer_off(other) + footer::PAGE_SEQ);
            st(f + footer::PAGE_SEQ, v);
            format!("page_seq of {page} = that of {other} ({v})")
        }
        7 => {
            let which = rng.pick(&[
                footer::ENTRIES,
                footer::PAGES_TOUCHED,
                footer::OVERRUN,
                footer::DROPPED,
                footer::PAGE_ENTRIES,
                footer::MISSED,
                footer::PAGE_SEQ,
            ]);
            let v = nasty(rng, huge);
            st(f + which, v);
            format!("footer {page} +{which} = {v}")
        }
        8 => {
            let which = rng.pick(&[footer::WRITER_STATUS, footer::READER_STATUS]);
            let v = rng.below(8);
            st(f + which, v);
            format!("status {page} +{which} = {v}")
        }
        9 => {
            st(f + footer::ID_MAGIC, rng.next());
            format!("id/magic of {page}")
        }
        10 => {
            let which = rng.pick(&[
                ctl::ENTRIES,
                ctl::OVERRUN,
                ctl::DROPPED,
                ctl::PAGES_TOUCHED,
                ctl::BYTES,
                ctl::WRITE_STAMP,
                ctl::LOST_PENDING,
                ctl::SWAPS,
            ]);
            let v = nasty(rng, huge);
            st(c + which, v);
            format!("ctl {cpu} +{which} = {v}")
        }
        11 => {
            let which = rng.pick(&[ctl::MAGIC, ctl::VERSION_SIZE, ctl::MBOX_REQ, ctl::MBOX_ACK]);
            st(c + which, rng.next());
            format!("ctl {cpu} +{which} random")
        }
        12 => {
            let off = 8 * rng.below((PACK_HEADER_SIZE / 8) as u64) as usize;
            let v = nasty(rng, true);
            st(off, v);
            format!("pack +{off} = {v:#x}")
        }
        13 => {
            let d =
                l.desc(cpu) + rng.pick(&[cpu_desc::CPU, cpu_desc::FIRST_PAGE, cpu_desc::CTL_OFF]);
            let v = nasty(rng, true);
            st(d, v);
            format!("desc {cpu} +{d:#x} = {v:#x}")
        }
        14 => {
            // A cycle of links that skips the head.
            let a = first + 1 + rng.below(u64::from(PAGES) - 1) as u32;
            let b = first + 1 + rng.below(u64::from(PAGES) - 1) as u32;
            st(l.footer_off(a) + footer::NEXT, link(b, 0));
            st(l.footer_off(b) + footer::NEXT, link(a, 0));
            format!("cycle {a} <-> {b}")
        }
        15 => {
            let off = word_of(l, rng, cpu);
            let v = nasty(rng, huge);
            st(off, v);
            format!("word {off:#x} = {v:#x}")
        }
        _ => {
            // Random bytes anywhere in the CPU's pages.
            let off =
                l.page_off(first) + rng.below((PAGES as usize * l.page_size) as u64 - 8) as usize;
            let b = rng.next().to_le_bytes();
            let n = 1 + rng.below(8) as usize;
            m.write_bytes(off, &b[..n]);
            format!("{n} random bytes at {off:#x}")
        }
    }
}

/// What the sessions got through (to check the fuzzing reaches the interesting code).
static ATTACHED: AtomicU64 = AtomicU64::new(0);
static EVENTS: AtomicU64 = AtomicU64::new(0);
static ERRORS: AtomicU64 = AtomicU64::new(0);
static SWAPPED: AtomicU64 = AtomicU64::new(0);
static WRITTEN: AtomicU64 = AtomicU64::new(0);

type Rb = RingBuffer<Arc<HeapMem>, Direct<Arc<HeapMem>>>;

/// Per-CPU accounting of what the reader handed out, to check its stats.
#[derive(Default, Clone, Copy)]
struct Seen {
    read: u64,
    lost: u64,
}

/// Runs a random session of operations on a corrupted region.
fn session(
    m: &Arc<HeapMem>,
    l: &RingGeometry,
    rng: &mut Rng,
    huge: bool,
    reader: bool,
    log: &mut Vec<String>,
) {
    let mut rb: Option<Rb> = None;
    let mut seen = [Seen::default(); CPUS as usize];
    let mut writers: Vec<Option<Writer<Arc<HeapMem>>>> = (0..CPUS).map(|_| None).collect();
    let mut corrupt_writer = [false; CPUS as usize];
    for _ in 0..40 {
        let cpu = if rng.below(20) == 0 {
            CPUS + rng.below(3) as u32
        } else {
            rng.below(u64::from(CPUS)) as u32
        };
        let ci = cpu as usize;
        match rng.below(14) {
            0 => log.push(corrupt(m, l, rng, huge)),
            1 if reader => {
                let r = RingBuffer::attach(m.clone(), Direct::new(m.clone(), *l));
                log.push(format!("attach: {}", r.is_ok()));
                if let Ok(r) = r {
                    ATTACHED.fetch_add(1, Relaxed);
                    rb = Some(r);
                    seen = [Seen::default(); CPUS as usize];
                }
            }
            2 => {
                if let Ok(hyptrace_writer::SwapStatus::Swapped { .. }) =
                    swap_reader_page(&**m, l, cpu)
                {
                    SWAPPED.fetch_add(1, Relaxed);
                }
            }
            3 => {
                let _ = update_footers(&**m, l, cpu);
            }
            4 if ci < CPUS as usize => {
                if let Ok(w) = Writer::attach(m.clone(), cpu) {
                    writers[ci] = Some(w);
                    corrupt_writer[ci] = false;
                }
            }
            5 if ci < CPUS as usize => {
                if let Some(w) = writers[ci].as_mut() {
                    for i in 0..rng.below(60) {
                        let len = rng.pick(&[0usize, 8, 100, 1000, 3000]);
                        let out = w.write(0, rng.next() >> rng.below(64), &vec![i as u8; len]);
                        if corrupt_writer[ci] {
                            assert_eq!(out, WriteOutcome::Corrupt, "writer resumed after Corrupt");
                        }
                        corrupt_writer[ci] |= out == WriteOutcome::Corrupt;
                        if out == WriteOutcome::Written {
                            WRITTEN.fetch_add(1, Relaxed);
                        }
                        w.serve_mailbox();
                    }
                }
            }
            _ => {
                let Some(rb) = rb.as_mut() else { continue };
                let op = rng.below(7);
                log.push(format!("reader op {op} cpu {cpu}"));
                match op {
                    0 => {
                        let _ = rb.poke(cpu);
                    }
                    1 | 2 => {
                        for _ in 0..5000 {
                            match rb.next_event(cpu) {
                                Ok(Some(Item::Event { payload, .. })) => {
                                    assert!(payload.len() <= l.data_capacity());
                                    seen[ci].read += 1;
                                    EVENTS.fetch_add(1, Relaxed);
                                }
                                Ok(Some(Item::Lost(n))) => seen[ci].lost += n,
                                Ok(None) => break,
                                Err(_) => {
                                    ERRORS.fetch_add(1, Relaxed);
                                    break;
                                }
                            }
                        }
                    }
                    3 => {
                        for _ in 0..50 {
                            match rb.next_page(cpu) {
                                Ok(Some(p)) => {
                                    assert!(p.commit_len <= l.data_capacity());
                                    assert!(p.bytes.len() >= PAGE_HEADER_SIZE + p.commit_len);
                                    seen[ci].read += p.events;
                                    seen[ci].lost += p.missed;
                                }
                                Ok(None) | Err(_) => break,
                            }
                        }
                    }
                    4 => {
                        let _ = rb.finalize(cpu);
                    }
                    5 => {
                        if ci < CPUS as usize {
                            seen[ci].lost += rb.take_trailing_loss(cpu);
                        }
                    }
                    _ => {
                        let _ = rb.sync_writer_counters(cpu);
                        let _ = rb.commit_page(cpu);
                    }
                }
                if ci < CPUS as usize {
                    let st = rb.stats(cpu);
                    assert_eq!(
                        (st.read, st.lost),
                        (seen[ci].read, seen[ci].lost),
                        "reader stats"
                    );
                }
            }
        }
    }
}

/// Runs `f` on a thread, failing if it panics or takes longer than `limit` (a hang).
fn with_watchdog(limit: Duration, f: impl FnOnce(&AtomicU64) + Send + 'static) {
    let progress = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let (p2, d2) = (progress.clone(), done.clone());
    let t = std::thread::spawn(move || {
        f(&p2);
        d2.store(true, SeqCst);
    });
    let mut last = u64::MAX;
    let mut since = std::time::Instant::now();
    while !t.is_finished() {
        std::thread::sleep(Duration::from_millis(50));
        let p = progress.load(SeqCst);
        if p != last {
            last = p;
            since = std::time::Instant::now();
        } else if since.elapsed() > limit {
            panic!("iteration {p} did not finish within {limit:?}: a hang");
        }
    }
    t.join().unwrap();
    assert!(done.load(SeqCst));
}

fn fuzz(iterations: u64, seed0: u64, huge: bool, reader: bool) {
    with_watchdog(Duration::from_secs(60), move |progress| {
        let bases: Vec<(Vec<u8>, RingGeometry)> = [Mode::Overwrite, Mode::Stop]
            .into_iter()
            .enumerate()
            .map(|(i, mode)| base_region(mode, seed0 + i as u64))
            .collect();
        for it in 0..iterations {
            progress.store(it, SeqCst);
            let seed = seed0 ^ (it.wrapping_mul(0x1000_0000_01b3));
            let mut log = vec![];
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut rng = Rng(seed);
                let (bytes, l) = &bases[rng.below(2) as usize];
                let m = Arc::new(HeapMem::new(bytes.len()));
                m.write_bytes(0, bytes);
                for _ in 0..rng.below(6) {
                    log.push(corrupt(&m, l, &mut rng, huge));
                }
                session(&m, l, &mut rng, huge, reader, &mut log);
            }));
            if let Err(e) = res {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("seed {seed:#x} (iteration {it}): {msg}\n  after: {log:?}");
            }
        }
    });
}

#[test]
fn hostile_regions_never_panic_or_hang() {
    fuzz(6000, 0x4057_11e0, false, true);
    let got = [&ATTACHED, &EVENTS, &ERRORS, &SWAPPED, &WRITTEN].map(|c| c.load(Relaxed));
    eprintln!("attached, events read, read errors, swaps, events written: {got:?}");
    assert!(
        got.iter().all(|&n| n > 100),
        "the fuzzing does not reach the code: {got:?}"
    );
}

/// `RingGeometry::parse` on random bytes and on valid packs with random fields: an error or
/// a layout that fits the region and equals the one computed from its parameters.
#[test]
fn layout_parse_random_and_mutated_packs() {
    let mut rng = Rng(0x1a70);
    let good = RingGeometry::new(3, 5, 4096, Mode::Overwrite, true).unwrap();
    for it in 0..20000 {
        let m = if it % 2 == 0 {
            let n = rng.below(4096) as usize;
            let b: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            WordMem::from_bytes(&b)
        } else {
            let m = WordMem::new(if rng.below(4) == 0 {
                rng.below(good.region_size as u64) as usize
            } else {
                good.region_size
            });
            if m.size() >= good.pages_off {
                good.write_pack(&m, 1, 2);
            }
            for _ in 0..1 + rng.below(3) {
                if m.size() >= 8 {
                    let off = 8 * rng.below((m.size().min(PACK_HEADER_SIZE + 3 * 64) / 8) as u64)
                        as usize;
                    m.store(off, nasty(&mut rng, true), Relaxed);
                }
            }
            m
        };
        if let Ok(l) = RingGeometry::parse(&m) {
            assert!(l.region_size <= m.size(), "iteration {it}");
            let again = RingGeometry::new(
                l.nr_cpus,
                l.pages_per_cpu,
                l.page_size,
                l.mode,
                l.guest_swap,
            )
            .unwrap();
            assert_eq!(again, l, "iteration {it}");
        }
    }
}

/// A writer on a ring whose links were corrupted stops with `Corrupt` (and stays
/// stopped) instead of panicking or writing outside its pages.
#[test]
fn writer_on_corrupt_links_stops_with_corrupt() {
    for mode in [Mode::Overwrite, Mode::Stop] {
        for bad in [
            link(77, 0),
            link(1, LINK_HEAD | LINK_UPDATE),
            link(1, LINK_UPDATE),
            link(u32::MAX, 0),
            u64::MAX,
            link(PAGES + 1, LINK_HEAD),
        ] {
            let l = RingGeometry::new(2, PAGES, 4096, mode, false).unwrap();
            let m = HeapMem::new(l.region_size);
            l.init_region(&m, 0, 1);
            let mut w = Writer::attach(&m, 0).unwrap();
            let tail = m.load(l.ctl(0) + ctl::TAIL_PAGE, Relaxed) as u32;
            m.store(l.footer_off(tail) + footer::NEXT, bad, Relaxed);
            let outs: Vec<WriteOutcome> = (0..20).map(|i| w.write(0, i, &[0u8; 1500])).collect();
            let k = outs
                .iter()
                .position(|o| *o == WriteOutcome::Corrupt)
                .unwrap_or_else(|| panic!("{mode:?} {bad:#x}: {outs:?}"));
            assert!(
                outs[k..].iter().all(|o| *o == WriteOutcome::Corrupt),
                "{outs:?}"
            );
            assert!(
                outs[..k].iter().all(|o| *o == WriteOutcome::Written),
                "{outs:?}"
            );
            // The other CPU's ring is untouched and still works.
            let mut w1 = Writer::attach(&m, 1).unwrap();
            assert_eq!(w1.write(0, 1, &[1; 8]), WriteOutcome::Written);
        }
    }
}

/// Huge counters in the control block and footers (near u64::MAX) must not make the
/// writer-domain side (Writer::attach/write/serve_mailbox, swap_reader_page,
/// update_footers) panic.
///
/// Known bug: the writer continues its counters from the control block
/// (`Writer::attach`: entries, dropped, overrun, pages_touched, bytes, lost_pending) and
/// adds a head page's `page_entries` to `overrun` (`push_head`) with plain `+`, so
/// huge values panic with overflow checks (see `writer_huge_ctl_entries`).
#[test]
fn huge_counters_writer_side_never_panics() {
    fuzz(1500, 0x0b16_c0de, true, false);
}

/// The same with the reader. Known bug (also fuzz/regressions/region/
/// reader-expected-overflow*): a footer `first_index` (or control-block
/// `entries`/`dropped`, through `take_trailing_loss`) near u64::MAX makes the reader's
/// `expected += 1` (crates/reader/src/consume.rs, `next_event`; `+= n` in `next_page`)
/// overflow: a panic with overflow checks (debug, tests), a wrap in release.
#[test]
fn huge_counters_never_panic() {
    fuzz(600, 0x0b16_c0de, true, true);
}

/// Known writer bug, minimal: `ENTRIES` near u64::MAX in the control block; the writer
/// attaches and its first write overflows `entries += 1` (crates/writer/src/write.rs,
/// `write_enabled`) instead of writing (wrapping) or reporting `Corrupt`.
#[test]
fn writer_huge_ctl_entries() {
    for (which, v) in [
        (ctl::ENTRIES, u64::MAX),
        (ctl::OVERRUN, u64::MAX),
        (ctl::DROPPED, u64::MAX),
    ] {
        let l = RingGeometry::new(1, PAGES, 4096, Mode::Overwrite, false).unwrap();
        let m = HeapMem::new(l.region_size);
        l.init_region(&m, 0, 1);
        m.store(l.ctl(0) + which, v, Relaxed);
        if let Ok(mut w) = Writer::attach(&m, 0) {
            for i in 0..20 {
                let out = w.write(0, i, &[0u8; 1500]);
                assert!(matches!(out, WriteOutcome::Written | WriteOutcome::Corrupt));
            }
        }
    }
}
