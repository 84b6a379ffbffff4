use super::*;
use hyptrace_abi::layout::WRITER_ACTIVE;
use hyptrace_abi::page::{self, COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_abi::HeapMem;
use hyptrace_writer::{WriteOutcome, Writer};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

type TestRb = RingBuffer<Arc<HeapMem>, Direct<Arc<HeapMem>>>;

fn setup(mode: Mode, ring_pages: u64) -> (Arc<HeapMem>, TestRb) {
    let cfg = Config {
        nr_cpus: 1,
        buffer_bytes: ring_pages * 4096,
        page_size: 4096,
        mode,
        guest_swap: false,
    };
    let l = cfg.layout().unwrap();
    let mem = Arc::new(HeapMem::new(l.region_size));
    let rb = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 0, 1).unwrap();
    (mem, rb)
}

fn drain<C: Callbacks>(
    rb: &mut RingBuffer<Arc<HeapMem>, C>,
    out: &mut Vec<Result<(u64, u64), u64>>,
) {
    while let Some(it) = rb.next_event(0).unwrap() {
        out.push(match it {
            Item::Event { ts, payload } => {
                Ok((ts, u64::from_le_bytes(payload[..8].try_into().unwrap())))
            }
            Item::Lost(n) => Err(n),
        });
    }
}

/// Checks a stream: seq strictly increasing, each gap equal to the loss reported right
/// before it; returns (read, lost).
fn check_stream(items: &[Result<(u64, u64), u64>]) -> (u64, u64) {
    let (mut next, mut read, mut lost, mut pending) = (0u64, 0, 0, 0);
    let mut last_ts = 0;
    for it in items {
        match *it {
            Err(n) => pending += n,
            Ok((ts, seq)) => {
                assert!(ts >= last_ts);
                last_ts = ts;
                assert_eq!(seq - next, pending, "gap at seq {seq}");
                lost += pending;
                pending = 0;
                next = seq + 1;
                read += 1;
            }
        }
    }
    (read, lost + pending)
}

#[test]
fn interleaved_write_and_read_both_modes() {
    for mode in [Mode::Stop, Mode::Overwrite] {
        let (mem, mut rb) = setup(mode, 4);
        let mut w = Writer::attach(mem.clone(), 0).unwrap();
        let mut items = vec![];
        let mut written = 0;
        for i in 0..5000u64 {
            let mut p = [0u8; 40];
            p[..8].copy_from_slice(&i.to_le_bytes());
            if w.write(0, i * 3, &p) == WriteOutcome::Written {
                written += 1;
            }
            if i % 1000 == 0 {
                rb.poke(0).unwrap();
                drain(&mut rb, &mut items);
            }
        }
        rb.finalize(0).unwrap();
        drain(&mut rb, &mut items);
        let (read, lost) = check_stream(&items);
        let st = rb.sync_writer_counters(0).unwrap();
        assert_eq!(st.written, written);
        assert_eq!(read + lost, 5000, "{mode:?}");
        assert_eq!(st.written + st.dropped, 5000);
        assert_eq!(lost, st.overrun + st.dropped, "{mode:?}");
        assert!(lost > 0, "{mode:?}: this run must lose events");
    }
}

#[test]
fn pages_carry_missed_counts() {
    let (mem, mut rb) = setup(Mode::Overwrite, 2);
    let mut w = Writer::attach(mem.clone(), 0).unwrap();
    for i in 0..100u64 {
        w.write(0, i, &[i as u8; 500]);
    }
    rb.finalize(0).unwrap();
    let mut total = 0;
    let mut missed = 0;
    while let Some(p) = rb.next_page(0).unwrap() {
        total += p.events;
        missed += p.missed;
    }
    assert_eq!(total + missed, 100);
    assert_eq!(missed, w.overrun());
}

#[test]
fn hostile_commit_and_ids_are_errors() {
    let (mem, mut rb) = setup(Mode::Stop, 4);
    let l = *rb.layout();
    let mut w = Writer::attach(mem.clone(), 0).unwrap();
    w.write(0, 1, &[0; 16]);
    // Swap the page in, then corrupt its commit.
    assert!(matches!(rb.next_event(0), Ok(Some(_))));
    let reader = mem.load(l.ctl(0) + ctl::READER_PAGE, Relaxed) as u32;
    mem.store(l.page_off(reader) + COMMIT_OFFSET, 1 << 29, Relaxed);
    assert!(matches!(rb.next_event(0), Err(ReadError::BadCommit { .. })));
    mem.store(l.ctl(0) + ctl::READER_PAGE, 1 << 40, Relaxed);
    assert!(matches!(
        rb.poke(0),
        Err(ReadError::Ring {
            err: hyptrace_writer::RingError::BadPageId(_),
            ..
        })
    ));
    assert!(rb.commit_page(0).is_ok());
    mem.store(l.ctl(0) + ctl::TAIL_PAGE, 3 << 33, Relaxed);
    assert!(matches!(
        rb.commit_page(0),
        Err(ReadError::BadPageId { .. })
    ));
}

/// R3: the published attempts read as the writer counted them; hostile ones — skipped
/// above attempted, a counter going down between two reads — are returned as read with
/// a problem that stays once seen.
#[test]
fn published_attempts_and_hostile_ones() {
    let (mem, mut rb) = setup(Mode::Stop, 4);
    let c = rb.layout().ctl(0);
    let mut w = Writer::attach(mem.clone(), 0).unwrap();
    w.write(0, 1, &[0; 16]);
    w.skip();
    let a = rb.attempts(0).unwrap();
    assert_eq!((a.attempted, a.skipped, a.problem), (2, 1, None));
    assert!(matches!(rb.attempts(1), Err(ReadError::BadCpu(1))));
    // Down from 2 attempts to 1.
    mem.store(c + ctl::ATTEMPTED, 1, Relaxed);
    let a = rb.attempts(0).unwrap();
    assert_eq!((a.attempted, a.skipped), (1, 1));
    assert!(
        matches!(
            a.problem,
            Some(AttemptsProblem::Decreased {
                was_attempted: 2,
                ..
            })
        ),
        "{a:?}"
    );
    // Back up: the problem stays.
    mem.store(c + ctl::ATTEMPTED, 5, Relaxed);
    assert!(rb.attempts(0).unwrap().problem.is_some());
    let (mem, mut rb) = setup(Mode::Stop, 4);
    let c = rb.layout().ctl(0);
    mem.store(c + ctl::ATTEMPTED, 3, Relaxed);
    mem.store(c + ctl::SKIPPED, u64::MAX, Relaxed);
    let a = rb.attempts(0).unwrap();
    assert_eq!(
        a.problem,
        Some(AttemptsProblem::SkippedAboveAttempted {
            attempted: 3,
            skipped: u64::MAX
        })
    );
}

/// Sets the flag when dropped (also while unwinding): a thread waiting for it stops.
struct SetOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn mailbox_backend_with_writer_thread() {
    let cfg = Config {
        nr_cpus: 1,
        buffer_bytes: 3 * 4096,
        page_size: 4096,
        mode: Mode::Stop,
        guest_swap: true,
    };
    let l = cfg.layout().unwrap();
    let mem = Arc::new(HeapMem::new(l.region_size));
    let mut rb = RingBuffer::alloc(
        mem.clone(),
        l,
        Mailbox::new(mem.clone(), l, Duration::from_secs(10)),
        0,
        1,
    )
    .unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut items = vec![];
    // Scoped: a panic of either side fails the test; the reader loop also stops (and
    // fails) if the writer thread ended early, so nothing waits on a dead thread.
    let (entries, dropped) = std::thread::scope(|s| {
        let t = s.spawn(|| {
            let mut w = Writer::attach(mem.clone(), 0).unwrap();
            let mut i = 0u64;
            while !stop.load(Relaxed) {
                w.serve_mailbox();
                if i < 20000 {
                    w.write(0, i, &i.to_le_bytes());
                    i += 1;
                } else {
                    std::thread::yield_now();
                }
            }
            (w.entries(), w.dropped())
        });
        // Stops the writer however this closure ends (a failed assertion included).
        let _stop = SetOnDrop(&stop);
        let mut last = (std::time::Instant::now(), 0);
        loop {
            assert!(!t.is_finished(), "the writer thread ended early");
            rb.poke(0).unwrap();
            drain(&mut rb, &mut items);
            let (read, lost) = check_stream(&items);
            if read + lost == 20000
                || (rb.stats(0).written + rb.stats(0).dropped == 20000
                    && read == rb.stats(0).written)
            {
                break;
            }
            // No progress at all for a long time is a hang, not slowness.
            if read + lost != last.1 {
                last = (std::time::Instant::now(), read + lost);
            }
            if last.0.elapsed() > Duration::from_secs(120) {
                panic!("no progress for 120 s at {} events", last.1);
            }
        }
        stop.store(true, Relaxed);
        t.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
    });
    rb.finalize(0).unwrap();
    drain(&mut rb, &mut items);
    let (read, lost) = check_stream(&items);
    assert_eq!((read, lost), (entries, dropped));
    assert_eq!(read + lost, 20000);
    assert!(rb.stats(0).swaps >= 1);
}

#[test]
fn mailbox_times_out_on_a_dead_writer() {
    let cfg = Config {
        nr_cpus: 1,
        buffer_bytes: 3 * 4096,
        page_size: 4096,
        mode: Mode::Stop,
        guest_swap: true,
    };
    let l = cfg.layout().unwrap();
    let mem = Arc::new(HeapMem::new(l.region_size));
    let mut rb = RingBuffer::alloc(
        mem.clone(),
        l,
        Mailbox::new(mem.clone(), l, Duration::from_millis(100)),
        0,
        1,
    )
    .unwrap();
    // A writer attached, then died (M2: the timeout runs only once one is attached).
    mem.store(l.ctl(0) + ctl::WRITER_STATE, WRITER_ACTIVE, Relaxed);
    // Requests do not block: the first poke leaves one in flight; later pokes report
    // the timeout once it is older than 100 ms.
    let start = std::time::Instant::now();
    let err = loop {
        match rb.poke(0) {
            Ok(_) => assert!(
                start.elapsed() < Duration::from_secs(30),
                "no timeout reported"
            ),
            Err(e) => break e,
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert!(matches!(err, ReadError::MailboxTimeout { .. }), "{err}");
    assert!(start.elapsed() >= Duration::from_millis(100));
}

/// M2: a request to a ring no writer attached to yet (its vCPU has not run: on a loaded
/// host vCPUs start seconds late) is pending however long it waits, never a timeout;
/// once a writer attached and does not answer, the timeout runs (from the last poll that
/// saw none: the drain loop polls every few ms).
#[test]
fn mailbox_timeout_runs_from_the_writers_attach() {
    let cfg = Config {
        nr_cpus: 1,
        buffer_bytes: 3 * 4096,
        page_size: 4096,
        mode: Mode::Stop,
        guest_swap: true,
    };
    let l = cfg.layout().unwrap();
    let mem = Arc::new(HeapMem::new(l.region_size));
    let timeout = Duration::from_millis(1);
    let mb = Mailbox::new(mem.clone(), l, timeout).with_spin(Duration::ZERO);
    let _rb = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 0, 1).unwrap();
    // Each wait is over the timeout (a sleep lasts at least as long as asked).
    for _ in 0..3 {
        assert!(!mb.update_footers(0).unwrap(), "pending, not attached");
        std::thread::sleep(timeout * 5);
    }
    mem.store(l.ctl(0) + ctl::WRITER_STATE, WRITER_ACTIVE, Relaxed);
    std::thread::sleep(timeout * 5);
    let err = mb.update_footers(0).unwrap_err();
    assert!(
        matches!(err, ReadError::MailboxTimeout { cpu: 0, .. }),
        "{err}"
    );
}

/// The post-mortem walk of CPU 0 from `pos`: the sequence numbers (payload's first 8
/// bytes) of the events it dumps, and its report.
fn dump_cpu0(
    mem: &HeapMem,
    l: &RingGeometry,
    pos: postmortem::Position,
) -> (Vec<u64>, postmortem::CpuDump) {
    let mut dumped = Vec::new();
    let d = postmortem::walk_cpu(mem, l, 0, Some(pos), |p| {
        let len = u64::from_le_bytes(p.bytes[8..16].try_into().unwrap()) as usize;
        for e in page::Events::new(&p.bytes[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len], 0) {
            dumped.push(u64::from_le_bytes(
                e.unwrap().payload[..8].try_into().unwrap(),
            ));
        }
        Ok::<(), ()>(())
    })
    .unwrap();
    (dumped, d)
}

/// A reader over the mailbox callbacks, on a heap region.
type MailboxReader = RingBuffer<Arc<HeapMem>, Mailbox<Arc<HeapMem>>>;

/// One CPU in stop mode with `--swap guest` (released pages: the `Mailbox` callbacks), a
/// ring of `pages` 4 KiB pages, a reader and an attached writer.
fn released_setup(
    pages: u64,
) -> (
    Arc<HeapMem>,
    RingGeometry,
    MailboxReader,
    Writer<Arc<HeapMem>>,
) {
    let cfg = Config {
        nr_cpus: 1,
        buffer_bytes: pages * 4096,
        page_size: 4096,
        mode: Mode::Stop,
        guest_swap: true,
    };
    let l = cfg.layout().unwrap();
    let mem = Arc::new(HeapMem::new(l.region_size));
    let cb = Mailbox::new(mem.clone(), l, Duration::from_secs(60));
    let rb = RingBuffer::alloc(mem.clone(), l, cb, 0, 1).unwrap();
    let w = Writer::attach(mem.clone(), 0).unwrap();
    (mem, l, rb, w)
}

/// Writes a 1000-byte event (three per 4 KiB page) whose payload starts with `seq`.
fn write_seq(w: &mut Writer<Arc<HeapMem>>, seq: u64) -> WriteOutcome {
    let mut p = [0u8; 1000];
    p[..8].copy_from_slice(&seq.to_le_bytes());
    w.write(0, 10 + seq, &p)
}

/// Released pages (`--swap guest`, stop mode): the reader reads the ring pages in
/// place, following the writer, and releases each one it has read with one store —
/// no mailbox request at all; the writer, its ring full, swaps released pages back by
/// itself and writes on without a drop. Nothing is read twice, nothing lost; a page
/// not yet released is never reused (the writer drops instead).
#[test]
fn released_pages_are_taken_back_by_the_writer() {
    let (mem, l, mut rb, mut w) = released_setup(8);
    let ring = u64::from(l.pages_per_cpu) - 1;
    // 1000-byte events, three per page.
    let mut seq = 0u64;
    let mut write = |w: &mut Writer<Arc<HeapMem>>, n: u64| {
        let mut outcomes = Vec::new();
        for _ in 0..n {
            outcomes.push(write_seq(w, seq));
            seq += 1;
        }
        outcomes
    };
    // Four full pages and two events on the fifth (the tail), read in place, tail too.
    write(&mut w, 14);
    let mut items = Vec::new();
    drain(&mut rb, &mut items);
    assert_eq!(items.len(), 14);
    assert!(!rb.request_in_flight(0));
    assert_eq!(
        rb.stats(0).swaps,
        4,
        "the four pages the writer left, released"
    );
    assert_eq!(mem.load(l.ctl(0) + ctl::RELEASED, Relaxed), 4);
    // Three ring-fulls more, three pages between two reads: the writer needs the
    // released pages back, and gets them without anyone answering a request; every
    // event is written.
    for _ in 0..ring {
        let out = write(&mut w, 9);
        assert!(out.iter().all(|o| *o == WriteOutcome::Written), "{out:?}");
        drain(&mut rb, &mut items);
    }
    assert!(w.self_swaps() >= 2 * ring, "self swaps {}", w.self_swaps());
    assert_eq!(w.mailbox_served(), 0, "no request was needed");
    assert_eq!(w.dropped(), 0);
    let (read, lost) = check_stream(&items);
    assert_eq!((read, lost), (14 + 9 * ring, 0));
    // Without the reader the writer stops at the last released page: it drops, it
    // never takes a page the reader has not read.
    let out = write(&mut w, 3 * ring + 6);
    assert!(out.contains(&WriteOutcome::Dropped), "{out:?}");
    w.finish();
    rb.finalize(0).unwrap();
    drain(&mut rb, &mut items);
    let (read, lost) = check_stream(&items);
    assert_eq!(read + lost, seq);
    assert_eq!(lost, w.dropped());
    assert_eq!(w.mailbox_served(), 0);
}

/// The post-mortem walk after a live reader with released pages (a crash dump, or
/// `dump --trace-mem` after a SIGKILL): it starts where the reader stood — a ring page,
/// part consumed — and skips the reader page and every released page: every event is
/// either consumed or in the dump, once, in order.
#[test]
fn postmortem_after_released_pages_starts_where_the_reader_stood() {
    let (mem, l, mut rb, mut w) = released_setup(6);
    let mut seq = 0u64;
    let mut consumed = Vec::new();
    // Rounds of writing past the ring (self swaps) and reading part of it.
    for _round in 0..8 {
        for _ in 0..6 {
            assert_eq!(write_seq(&mut w, seq), WriteOutcome::Written);
            seq += 1;
        }
        // Consume all but the last few events (the reader stops mid-page).
        for _ in 0..5 {
            match rb.next_event(0).unwrap() {
                Some(Item::Event { payload, .. }) => {
                    consumed.push(u64::from_le_bytes(payload[..8].try_into().unwrap()))
                }
                other => panic!("{other:?}"),
            }
        }
    }
    assert!(w.self_swaps() > 0);
    let pos = rb.position(0).expect("live");
    let (dumped, d) = dump_cpu0(&mem, &l, pos);
    assert!(d.warnings.is_empty(), "{:?}", d.warnings);
    assert_eq!((d.lost, d.trailing_lost), (0, 0));
    let all: Vec<u64> = consumed.iter().chain(&dumped).copied().collect();
    assert_eq!(
        all,
        (0..seq).collect::<Vec<_>>(),
        "consumed {consumed:?} dumped {dumped:?}"
    );
}

/// The post-mortem walk after a releasing reader that has not released anything yet:
/// it left the (empty) reader page for the first ring page and consumed part of it,
/// `released` is still 0 — the dump starts after what it consumed, not at the reader
/// page (which would repeat the consumed events).
#[test]
fn postmortem_before_the_first_release() {
    let (mem, l, mut rb, mut w) = released_setup(6);
    for seq in 0..2u64 {
        assert_eq!(write_seq(&mut w, seq), WriteOutcome::Written);
    }
    match rb.next_event(0).unwrap() {
        Some(Item::Event { payload, .. }) => assert_eq!(payload[0], 0),
        other => panic!("{other:?}"),
    }
    assert_eq!(mem.load(l.ctl(0) + ctl::RELEASED, Relaxed), 0);
    let pos = rb.position(0).expect("live");
    let (dumped, d) = dump_cpu0(&mem, &l, pos);
    assert!(d.warnings.is_empty(), "{:?}", d.warnings);
    assert_eq!(dumped, vec![1]);
    assert_eq!((d.lost, d.trailing_lost), (0, 0));
}

/// Pushes the events of a handed-out page or piece onto `out` (its loss first), checking
/// its index and event count against the events it holds.
fn take_piece(p: &crate::PageOut<'_>, out: &mut Vec<Result<(u64, u64), u64>>) {
    if p.missed > 0 {
        out.push(Err(p.missed));
    }
    let (ts, _) = hyptrace_abi::page::page_header(p.bytes).unwrap();
    let data = &p.bytes[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + p.commit_len];
    let mut n = 0;
    for ev in hyptrace_abi::page::Events::new(data, ts) {
        let ev = ev.unwrap();
        let seq = u64::from_le_bytes(ev.payload[..8].try_into().unwrap());
        assert_eq!(
            seq,
            p.first_index + n,
            "the piece's index names its first event"
        );
        out.push(Ok((ev.ts, seq)));
        n += 1;
    }
    assert_eq!(n, p.events);
}

/// C1 (one reader, any mix of reads): events, partial pieces and whole pages of one CPU
/// read in a seeded mix, each starting where the last stopped — every event once, in
/// order, with its own timestamp (a piece from mid-page carries the clock where it
/// starts), every gap exactly the losses reported (overwrite, a small ring; stop mode).
#[test]
fn events_pieces_and_pages_in_any_mix() {
    for mode in [Mode::Stop, Mode::Overwrite] {
        let (mem, mut rb) = setup(mode, 4);
        let mut w = Writer::attach(mem.clone(), 0).unwrap();
        let mut items = vec![];
        let mut rng = 0x1234_5678u64;
        let mut mid_page_pieces = 0;
        for i in 0..30_000u64 {
            let mut p = [0u8; 40];
            p[..8].copy_from_slice(&i.to_le_bytes());
            w.write(0, i * 3, &p);
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            match (rng >> 33) % 97 {
                0 => {
                    while let Some(it) = rb.next_event(0).unwrap() {
                        items.push(match it {
                            Item::Event { ts, payload } => {
                                Ok((ts, u64::from_le_bytes(payload[..8].try_into().unwrap())))
                            }
                            Item::Lost(n) => Err(n),
                        });
                        if (rng >> 20).is_multiple_of(3) {
                            break; // leave the page mid-way
                        }
                    }
                }
                1..=3 => {
                    let partial = (rng >> 40).is_multiple_of(2);
                    let before = rb.position(0).unwrap();
                    if let Some(p) = rb.next_piece(0, partial).unwrap() {
                        take_piece(&p, &mut items);
                        let after = rb.position(0).unwrap();
                        mid_page_pieces +=
                            u32::from(before.consumed > 0 && before.reader == after.reader);
                    }
                }
                4 => {
                    while let Some(p) = rb.next_page(0).unwrap() {
                        take_piece(&p, &mut items);
                    }
                }
                _ => {}
            }
        }
        rb.finalize(0).unwrap();
        while let Some(p) = rb.next_piece(0, false).unwrap() {
            take_piece(&p, &mut items);
        }
        let trailing = rb.take_trailing_loss(0);
        let (read, lost) = check_stream(&items);
        assert_eq!(read + lost + trailing, 30_000, "{mode:?}");
        assert_eq!(rb.stats(0).read, read, "{mode:?}");
        assert!(mid_page_pieces > 0, "{mode:?}: no piece started mid-page");
        let ts: Vec<u64> = items
            .iter()
            .filter_map(|i| i.ok().map(|(t, s)| t - s * 3))
            .collect();
        assert!(ts.iter().all(|&d| d == 0), "{mode:?}: a timestamp moved");
    }
}
