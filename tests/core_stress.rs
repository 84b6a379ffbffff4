//! Multi-threaded stress of the core: one `Writer` thread per CPU writing into a small
//! ring on a shared `HeapMem`, while the reader thread pokes and drains every CPU
//! continuously (`next_event`), swapping through `Direct` or through the writers'
//! mailbox (`Mailbox`, the writers serve it between events), in both ring modes.
//!
//! Per CPU, every event carries `(cpu, seq, ts)` and a seq-derived fill; the reader
//! checks, exactly:
//! - seq strictly increasing; every seq gap equals the `Item::Lost` reported right
//!   before that event (and the trailing loss at the end);
//! - timestamps round-trip exactly (the ts in the payload) and never decrease;
//! - payload bytes are the ones written (no torn or overwritten data is handed out);
//! - attempts == read + lost; lost == overrun + dropped (writer's counters) == the sum
//!   of `Item::Lost`; entries + dropped == attempts;
//! - losses really happen: the reader stalls (by construction, waiting on the writers'
//!   progress counters) while each writer writes more than its whole ring can hold;
//! - swaps really happen: at least one swap per stall, and pages_read covers read.
//!
//! Defaults write 5 M events per test, 4 tests: 10^7 per mode, 2 x 10^7 in total.
//! `HYPTRACE_STRESS_EVENTS` (events per test, at least 200 000) overrides that: the
//! oversubscribed CI step (`.ci/oversubscribed.sh`) runs several copies at once next to
//! CPU hogs with fewer events each — there the point is preemption at every point, not
//! volume.
//!
//! The threads run in a `std::thread::scope`; a thread that panics raises a shared
//! abort flag that every wait loop checks, so the test fails — never hangs — when any
//! thread fails, and a wait that sees no progress at all for [`STUCK`] fails too.

use hyptrace_abi::layout::{Mode, RingGeometry, FOOTER_SIZE};
use hyptrace_abi::page::{data_event_size, PAGE_HEADER_SIZE};
use hyptrace_abi::HeapMem;
use hyptrace_reader::{Callbacks, Direct, Item, Mailbox, RingBuffer};
use hyptrace_writer::{WriteOutcome, Writer};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A wait that sees no progress for this long is a hang (a lost wake-up or a livelock,
/// never slowness: every wait is for another thread's next few events).
const STUCK: Duration = Duration::from_secs(120);

const CPUS: u32 = 2;
const PAGE: usize = 4096;
/// Pages per CPU: the reader page and 3 ring pages.
const PAGES_PER_CPU: u32 = 4;
const DEFAULT_EVENTS_PER_TEST: u64 = 5_000_000;
/// Header of every payload: cpu, seq, ts (u64 each).
const HDR: usize = 24;

/// Fewest events per test: every CPU still gets several pause blocks (losses).
const MIN_EVENTS_PER_TEST: u64 = 200_000;

fn events_per_test() -> u64 {
    std::env::var("HYPTRACE_STRESS_EVENTS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(DEFAULT_EVENTS_PER_TEST, |n| n.max(MIN_EVENTS_PER_TEST))
}

/// Payload length of event `seq`: mostly small, sometimes past the small form (112).
fn payload_len(seq: u64) -> usize {
    if seq % 97 == 13 {
        200
    } else {
        HDR + ((seq * 7) % 11) as usize * 4 + (seq % 3) as usize
    }
}

fn fill_byte(seq: u64, i: usize) -> u8 {
    (seq as u8).wrapping_mul(31).wrapping_add(i as u8)
}

fn make_payload(buf: &mut [u8; 256], cpu: u32, seq: u64, ts: u64) -> usize {
    let n = payload_len(seq);
    buf[..8].copy_from_slice(&u64::from(cpu).to_le_bytes());
    buf[8..16].copy_from_slice(&seq.to_le_bytes());
    buf[16..24].copy_from_slice(&ts.to_le_bytes());
    for (i, b) in buf[HDR..n].iter_mut().enumerate() {
        *b = fill_byte(seq, i);
    }
    n
}

fn u64_at(p: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(p[at..at + 8].try_into().unwrap())
}

/// Per-CPU state of the checking reader.
#[derive(Default, Debug)]
struct Check {
    /// Seq expected next if nothing is lost.
    next: u64,
    read: u64,
    lost_items: u64,
    pending_lost: u64,
    last_ts: u64,
}

impl Check {
    fn item(&mut self, cpu: u32, it: Item<'_>) {
        match it {
            Item::Lost(n) => {
                assert!(n > 0, "cpu {cpu}: Lost(0)");
                self.pending_lost += n;
                self.lost_items += n;
            }
            Item::Event { ts, payload } => {
                assert!(payload.len() >= HDR, "cpu {cpu}: short payload");
                let (pc, seq, pts) = (u64_at(payload, 0), u64_at(payload, 8), u64_at(payload, 16));
                assert_eq!(pc, u64::from(cpu), "event of another cpu");
                assert!(seq >= self.next, "cpu {cpu}: seq {seq} after {}", self.next);
                assert_eq!(
                    seq - self.next,
                    self.pending_lost,
                    "cpu {cpu}: gap before seq {seq} != loss reported there"
                );
                self.pending_lost = 0;
                self.next = seq + 1;
                assert_eq!(
                    ts, pts,
                    "cpu {cpu}: seq {seq}: timestamp did not round-trip"
                );
                assert!(
                    ts >= self.last_ts,
                    "cpu {cpu}: seq {seq}: ts went backwards"
                );
                self.last_ts = ts;
                let n = payload_len(seq);
                assert_eq!(payload.len(), (n + 3) & !3, "cpu {cpu}: seq {seq}: length");
                for (i, &b) in payload[HDR..n].iter().enumerate() {
                    assert_eq!(b, fill_byte(seq, i), "cpu {cpu}: seq {seq}: byte {i}");
                }
                assert!(payload[n..].iter().all(|&b| b == 0), "padding not zero");
                self.read += 1;
            }
        }
    }
}

struct Shared {
    /// Events attempted so far, per CPU (published by the writers).
    progress: Vec<AtomicU64>,
    /// Seq up to which the reader accounted for everything (read or lost), per CPU.
    reader_pos: Vec<AtomicU64>,
    /// Writer → reader: do not read this CPU until cleared.
    pause_req: Vec<AtomicBool>,
    /// Reader → writer: paused (acknowledges `pause_req`).
    paused: Vec<AtomicBool>,
    /// A writer finished writing.
    done: Vec<AtomicBool>,
    /// The reader no longer needs the writers (mailbox mode: stop serving).
    stop: AtomicBool,
    /// A thread panicked: every other thread stops waiting and fails.
    abort: AtomicBool,
}

/// Raises `abort` when the thread holding it unwinds (a failed assertion), so the
/// other threads do not wait forever for it.
struct AbortOnPanic<'a>(&'a AtomicBool);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, SeqCst);
        }
    }
}

impl Shared {
    /// Fails this thread if another one failed.
    fn check_abort(&self, who: &str) {
        assert!(!self.abort.load(SeqCst), "{who}: another thread failed");
    }
}

struct WriterResult {
    entries: u64,
    dropped: u64,
    overrun: u64,
    served: u64,
    self_swaps: u64,
    stalls: u64,
}

/// Events per phase block. Blocks 0, 1, 2 of every 4 are throttled (the writer stays
/// within `WINDOW` events of the reader, so the reader reads and swaps a lot, racing
/// the writer on the same pages); block 3 starts with a pause of the reader during
/// which the writer overflows its whole ring (guaranteed losses), then runs free.
const BLOCK: u64 = 16384;
/// Throttle window: less than a page, so throttled phases lose nothing.
const WINDOW: u64 = 100;

struct Ctx {
    mailbox: bool,
    sh: Arc<Shared>,
    /// Events that surely overflow a whole ring.
    overflow: u64,
}

/// Waits for the reader (serving the mailbox meanwhile); fails if another thread
/// failed or if nothing happens for [`STUCK`].
fn wait_until(w: &mut Writer<Arc<HeapMem>>, ctx: &Ctx, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !cond() {
        if !(ctx.mailbox && w.serve_mailbox()) {
            // Yield first; on a busy machine, leave the CPU to the reader for a while.
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) {
            ctx.sh.check_abort("writer");
            assert!(
                start.elapsed() < STUCK,
                "writer: reader made no progress for {STUCK:?}"
            );
        }
    }
}

fn writer_thread(mem: Arc<HeapMem>, cpu: u32, n: u64, ctx: Ctx, t0: Instant) -> WriterResult {
    let mut w = Writer::attach(mem, cpu).unwrap();
    let sh = ctx.sh.clone();
    let c = cpu as usize;
    let mut buf = [0u8; 256];
    let mut stalls = 0;
    let mut last_written = None;
    for seq in 0..n {
        if ctx.mailbox {
            w.serve_mailbox();
        }
        let in_block = seq % BLOCK;
        if (seq / BLOCK) % 4 == 3 {
            if in_block == 0 {
                sh.pause_req[c].store(true, Release);
                wait_until(&mut w, &ctx, || sh.paused[c].load(Acquire));
            } else if in_block == ctx.overflow {
                stalls += 1;
                sh.pause_req[c].store(false, Release);
            }
        } else {
            // Wait on the last event actually written: drops not yet marked on a page
            // are invisible to the reader until the writer starts a new page.
            if let Some(lw) = last_written {
                wait_until(&mut w, &ctx, || {
                    lw < sh.reader_pos[c].load(Acquire) + WINDOW
                });
            }
        }
        // Real clock, plus a jump every 4096 events so TIME_EXTENDs get written.
        let ts = t0.elapsed().as_nanos() as u64 + (seq / 4096) * (1 << 28);
        let len = make_payload(&mut buf, cpu, seq, ts);
        match w.write(0, ts, &buf[..len]) {
            WriteOutcome::Written => last_written = Some(seq),
            WriteOutcome::Dropped => {}
            o => panic!("cpu {cpu}: seq {seq}: {o:?}"),
        }
        if seq % 64 == 63 {
            sh.progress[c].store(seq + 1, Release);
        }
    }
    sh.pause_req[c].store(false, Release);
    sh.progress[c].store(n, Release);
    sh.done[c].store(true, Release);
    if ctx.mailbox {
        wait_until(&mut w, &ctx, || sh.stop.load(Acquire));
    }
    w.finish();
    WriterResult {
        entries: w.entries(),
        dropped: w.dropped(),
        overrun: w.overrun(),
        served: w.mailbox_served(),
        self_swaps: w.self_swaps(),
        stalls,
    }
}

fn drain<C: Callbacks>(
    rb: &mut RingBuffer<Arc<HeapMem>, C>,
    cpu: u32,
    ck: &mut Check,
    pos: &AtomicU64,
) -> u64 {
    let mut n = 0;
    // Honest writers: any error is a real inconsistency (a lost race is `Ok`).
    while let Some(it) = rb
        .next_event(cpu)
        .unwrap_or_else(|e| panic!("cpu {cpu}: next_event: {e}"))
    {
        ck.item(cpu, it);
        n += 1;
        if n % 32 == 0 {
            pos.store(ck.next + ck.pending_lost, Release);
        }
    }
    pos.store(ck.next + ck.pending_lost, Release);
    n
}

fn run<C: Callbacks>(
    mode: Mode,
    mailbox: bool,
    make_cb: impl FnOnce(Arc<HeapMem>, RingGeometry) -> C,
) {
    let total = events_per_test();
    let per_cpu = total.div_ceil(u64::from(CPUS));
    let l = RingGeometry::new(CPUS, PAGES_PER_CPU, PAGE, mode, mailbox).unwrap();
    let mem = Arc::new(HeapMem::new(l.region_size));
    let cb = make_cb(mem.clone(), l);
    let mut rb = RingBuffer::alloc(mem.clone(), l, cb, 0, 1).unwrap();

    // Most events a page can hold, and events that surely overflow a whole ring (all
    // ring pages plus the reader page the writer may be on).
    let min_event = data_event_size(HDR);
    let per_page = (PAGE - PAGE_HEADER_SIZE - FOOTER_SIZE) / min_event;
    let overflow = per_page as u64 * u64::from(PAGES_PER_CPU) + 1;
    assert!(overflow < BLOCK);

    let n = CPUS as usize;
    let sh = Arc::new(Shared {
        progress: (0..n).map(|_| AtomicU64::new(0)).collect(),
        reader_pos: (0..n).map(|_| AtomicU64::new(0)).collect(),
        pause_req: (0..n).map(|_| AtomicBool::new(false)).collect(),
        paused: (0..n).map(|_| AtomicBool::new(false)).collect(),
        done: (0..n).map(|_| AtomicBool::new(false)).collect(),
        stop: AtomicBool::new(false),
        abort: AtomicBool::new(false),
    });
    let t0 = Instant::now();
    let mut ck: Vec<Check> = (0..CPUS).map(|_| Check::default()).collect();
    let results: Vec<WriterResult> = std::thread::scope(|s| {
        let writers: Vec<_> = (0..CPUS)
            .map(|cpu| {
                let m = mem.clone();
                let ctx = Ctx {
                    mailbox,
                    sh: sh.clone(),
                    overflow,
                };
                s.spawn(move || {
                    let sh = ctx.sh.clone();
                    let _g = AbortOnPanic(&sh.abort);
                    writer_thread(m, cpu, per_cpu, ctx, t0)
                })
            })
            .collect();
        let _g = AbortOnPanic(&sh.abort);
        let mut last_progress = (Instant::now(), 0u64);
        let mut idle = 0u32;
        loop {
            sh.check_abort("reader");
            let all_done = sh.done.iter().all(|d| d.load(Acquire));
            let (mut moved, mut got) = (0, 0);
            for cpu in 0..CPUS {
                let c = cpu as usize;
                if sh.pause_req[c].load(Acquire) {
                    // Acknowledge and leave this CPU alone until the writer clears it.
                    sh.paused[c].store(true, Release);
                    continue;
                }
                sh.paused[c].store(false, Release);
                rb.poke(cpu)
                    .unwrap_or_else(|e| panic!("cpu {cpu}: poke: {e}"));
                got += drain(&mut rb, cpu, &mut ck[c], &sh.reader_pos[c]);
                moved += sh.progress[c].load(Acquire);
            }
            if all_done {
                break;
            }
            // Nothing to read: leave the CPU to the writers (a busy machine).
            idle = if got == 0 { idle + 1 } else { 0 };
            if idle > 64 {
                std::thread::sleep(Duration::from_micros(20));
            } else if idle > 0 {
                std::thread::yield_now();
            }
            if moved != last_progress.1 {
                last_progress = (Instant::now(), moved);
            } else {
                assert!(
                    last_progress.0.elapsed() < STUCK,
                    "reader: writers made no progress for {STUCK:?}"
                );
            }
        }
        // Writers are done writing: one more live pass, then stop them and read the rest
        // with the final walk.
        for cpu in 0..CPUS {
            let c = cpu as usize;
            rb.poke(cpu)
                .unwrap_or_else(|e| panic!("cpu {cpu}: poke: {e}"));
            drain(&mut rb, cpu, &mut ck[c], &sh.reader_pos[c]);
        }
        sh.stop.store(true, Release);
        // A writer's panic fails the test here (the others saw `abort` and stopped).
        writers
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    for cpu in 0..CPUS {
        let c = cpu as usize;
        rb.finalize(cpu)
            .unwrap_or_else(|e| panic!("cpu {cpu}: finalize: {e}"));
        drain(&mut rb, cpu, &mut ck[c], &sh.reader_pos[c]);
        assert!(rb.finished(cpu));
        assert_eq!(rb.take_trailing_loss(cpu), 0, "next_event took it already");
    }

    for cpu in 0..CPUS {
        let c = &ck[cpu as usize];
        let r = &results[cpu as usize];
        let st = rb.sync_writer_counters(cpu).unwrap();
        let what = format!("{mode:?} mailbox={mailbox} cpu {cpu}: {st:?} {c:?}");
        assert_eq!(
            c.next + c.pending_lost,
            per_cpu,
            "{what}: trailing gap != loss"
        );
        assert_eq!(
            c.read + c.lost_items,
            per_cpu,
            "{what}: attempts != read + lost"
        );
        assert_eq!(
            (st.written, st.dropped, st.overrun),
            (r.entries, r.dropped, r.overrun),
            "{what}: control block != writer"
        );
        assert_eq!(r.entries + r.dropped, per_cpu, "{what}");
        assert_eq!(
            c.lost_items,
            r.overrun + r.dropped,
            "{what}: lost != overrun + dropped"
        );
        assert_eq!(st.lost, c.lost_items, "{what}: reader's lost");
        assert_eq!(st.read, c.read, "{what}: reader's read");
        // Losses happen by construction: each pause overflows the ring.
        let want_stalls = (per_cpu / BLOCK + 1) / 4;
        assert!(
            r.stalls >= want_stalls.max(1),
            "{what}: {} stalls",
            r.stalls
        );
        match mode {
            Mode::Overwrite => assert!(r.overrun > 0 && r.dropped == 0, "{what}"),
            Mode::Stop => assert!(r.dropped > 0 && r.overrun == 0, "{what}"),
        }
        // Throttled phases (3/4 of the events) lose nothing: the reader read them all.
        assert!(c.read >= per_cpu / 2, "{what}: read too little");
        // Swaps happen by construction: after each pause the writer has left the
        // reader page, so draining must swap at least once; and every page read was
        // swapped in (or walked at the end).
        assert!(
            st.swaps >= r.stalls,
            "{what}: {} swaps < {} stalls",
            st.swaps,
            r.stalls
        );
        assert!(
            st.pages_read >= c.read.div_ceil(per_page as u64),
            "{what}: pages_read too small"
        );
        match (mailbox, mode) {
            (true, Mode::Overwrite) => assert!(
                r.served >= st.swaps,
                "{what}: swaps not served by the writer"
            ),
            // Released pages: the reader asks for no swap; the writer swaps back the
            // pages released (a reader swap each), never more.
            (true, Mode::Stop) => assert!(
                r.self_swaps > 0 && r.self_swaps <= st.swaps,
                "{what}: {} self swaps for {} pages released",
                r.self_swaps,
                st.swaps
            ),
            (false, _) => assert_eq!(r.self_swaps, 0, "{what}"),
        }
        eprintln!(
            "{mode:?} mailbox={mailbox} cpu {cpu}: attempts {per_cpu} read {} lost {} \
             (overrun {} dropped {}) swaps {} pages {} stalls {} served {} in {:?}",
            c.read,
            c.lost_items,
            r.overrun,
            r.dropped,
            st.swaps,
            st.pages_read,
            r.stalls,
            r.served,
            t0.elapsed()
        );
    }
}

fn direct(m: Arc<HeapMem>, l: RingGeometry) -> Direct<Arc<HeapMem>> {
    Direct::new(m, l)
}

fn mailbox(m: Arc<HeapMem>, l: RingGeometry) -> Mailbox<Arc<HeapMem>> {
    Mailbox::new(m, l, Duration::from_secs(60))
}

#[test]
fn stress_overwrite_direct() {
    run(Mode::Overwrite, false, direct);
}

#[test]
fn stress_stop_direct() {
    run(Mode::Stop, false, direct);
}

#[test]
fn stress_overwrite_mailbox() {
    run(Mode::Overwrite, true, mailbox);
}

#[test]
fn stress_stop_mailbox() {
    run(Mode::Stop, true, mailbox);
}
