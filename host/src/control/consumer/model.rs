//! A deterministic model of one reader and its subscribers (docs/design.md, "One reader,
//! subscribers", C1–C4): the real writer, the VMM's real session and [`Subscribers`],
//! and subscribers that call them as the control handler does — all in one thread, the
//! interleaving drawn from a seed (the mailbox never times out, its spin is zero).
//!
//! What the schedule mixes: the guest writing (bursts up to three rings: the writer laps
//! the reader in overwrite mode, drops in stop mode), serving its mailbox (`--swap
//! guest`), and finishing before its vCPU thread is seen to end; the VMM's drain rounds;
//! subscribers that stream (partial pieces, as text on stdout) or take whole pages (the
//! page sinks), fetch with small and large budgets, take a batch only in part and then
//! detach, detach, die without detaching, or stop asking; a swap left pending by a round
//! before a subscriber's last request with a ring or more written after it; stop and
//! overwrite, host and guest swaps. At the end the vCPU stops, the last subscriber (if
//! any) reads to every CPU's end, and the VMM's own output takes what nobody took.
//!
//! Checked: inside every output (each subscriber's, the VMM's own) the events go up and
//! every gap is exactly the losses it reported; across outputs no event appears twice,
//! except what a subscriber that died was sent and had not acknowledged (C4: named); all
//! outputs together hold `read` events and report `lost` (the VMM's counts), and `read
//! + lost` is the writer's index.
//!
//! Seeded bugs (docs/fuzzing.md), one build with `--cfg hyptrace_seeded_bug_consumer`, the
//! bug chosen by `HYPTRACE_SEEDED_BUG` (`seeded_bugs_are_caught` runs each):
//! `piece_from_start` (a piece starts at its page's start, not at the reading position),
//! `ack_unchecked` (an acknowledgement of an item never sent is taken),
//! `unsend_dropped` (what a leaving subscriber did not acknowledge is dropped),
//! `end_too_early` (a CPU's end is queued while its walk waits for the subscriber).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::page::{page_header, Events, PAGE_HEADER_SIZE};
use hyptrace_abi::{events, HeapMem};
use hyptrace_output::{Clock, Missed, OutputError, PageSink, RunSummary};
use hyptrace_reader::callbacks::{Direct, Mailbox};
use hyptrace_reader::{Callbacks, RingBuffer};
use hyptrace_writer::Writer;

use super::{RunMeta, Subscribers};
use crate::control::protocol::{Ack, PieceBatch};
use crate::drain::outbox::BatchItem;
use crate::drain::session::{Output, Session};

type Mem = &'static HeapMem;
type VmmSession = Session<Mem, Box<dyn Callbacks + Send>>;

/// The seeded schedule's random numbers (splitmix64; the flight model's too).
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One output's stream of one CPU: events must go up, every gap covered by losses.
#[derive(Debug, Default, Clone)]
struct Stream {
    next: Option<u64>,
    pending_lost: u64,
    events: u64,
    lost: u64,
}

impl Stream {
    fn lost(&mut self, n: u64) {
        self.pending_lost += n;
        self.lost += n;
    }

    /// The event `seq`; `Err` when it does not follow with the losses reported.
    fn event(&mut self, seq: u64, what: &str) -> Result<(), String> {
        if let Some(next) = self.next {
            if seq != next + self.pending_lost {
                return Err(format!(
                    "{what}: event {seq} after {next} with {} lost reported",
                    self.pending_lost
                ));
            }
        }
        self.next = Some(seq + 1);
        self.pending_lost = 0;
        self.events += 1;
        Ok(())
    }
}

/// How often the schedules reached each hazard (the model asserts each was reached).
#[derive(Debug, Default, Clone, Copy)]
struct Coverage {
    /// A subscriber left (detached or died) with the reading position mid-page.
    left_mid_page: u64,
    /// A subscriber's last request left a guest swap pending...
    left_swap_pending: u64,
    /// ...and the guest wrote a ring or more after it.
    ring_after_pending: u64,
    /// A fetch while the writer had finished and its vCPU thread was not seen to end.
    finished_window: u64,
    /// A round that could not read because the subscriber had not taken enough.
    held: u64,
    /// A hostile acknowledgement refused.
    refused_acks: u64,
    /// Runs whose own output (text or pages) wrote events a subscriber left.
    own_output_after: u64,
}

/// Every output's events, for the cross checks.
#[derive(Default)]
struct Seen {
    cov: Coverage,
    /// Each event output, once.
    events: BTreeSet<u64>,
    /// Events a subscriber that died was sent and had not acknowledged (C4).
    allowed: BTreeSet<u64>,
    repeats: u64,
    printed: u64,
    lost: u64,
    /// Losses reported in what a subscriber that died had not acknowledged.
    lost_repeats: u64,
}

impl Seen {
    fn event(&mut self, seq: u64, what: &str) -> Result<(), String> {
        self.printed += 1;
        if !self.events.insert(seq) {
            if !self.allowed.contains(&seq) {
                return Err(format!("{what}: event {seq} output twice"));
            }
            self.repeats += 1;
        }
        Ok(())
    }
}

/// The VMM's own page output: its pages' events, recorded.
#[derive(Default)]
struct Recorded {
    stream: Stream,
    seqs: Vec<u64>,
    error: Option<String>,
}

struct RecordSink(Arc<Mutex<Recorded>>);

impl PageSink for RecordSink {
    fn page(&mut self, _cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        let r = &mut *self.0.lock().unwrap_or_else(|e| e.into_inner());
        match missed {
            Missed::Count(n) => r.stream.lost(n),
            Missed::None => {}
            // The VMM counts every loss of a guest ring: an unknown count is a fault.
            Missed::Unknown => r.error = Some("the VMM's output lost a count".into()),
        }
        let (ts, commit) = page_header(page).unwrap_or((0, 0));
        let len = (commit as usize).min(page.len() - PAGE_HEADER_SIZE);
        for ev in Events::new(&page[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len], ts) {
            let Ok(ev) = ev else {
                r.error = Some("the VMM's output got a page that does not decode".into());
                break;
            };
            let seq = u64::from_le_bytes(ev.payload[8..16].try_into().unwrap_or([0; 8]));
            if let Err(e) = r.stream.event(seq, "the VMM's output") {
                r.error.get_or_insert(e);
            }
            r.seqs.push(seq);
        }
        Ok(())
    }
    fn trailing_lost(&mut self, _cpu: u32, lost: u64) -> Result<(), OutputError> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stream
            .lost(lost);
        Ok(())
    }
    fn finish(self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        Ok(())
    }
}

/// The VMM's own text output, shared with the check.
struct SharedVec(Arc<Mutex<Vec<u8>>>);
impl std::io::Write for SharedVec {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Where the VMM's own output went.
enum VmmOut {
    Pages(Arc<Mutex<Recorded>>),
    Text(Arc<Mutex<Vec<u8>>>),
}

/// The VMM: its session, the claim, whether the vCPU thread ended.
struct Vmm {
    session: VmmSession,
    subs: Subscribers,
    meta: RunMeta,
    stopped: bool,
    out: VmmOut,
}

impl Vmm {
    /// One round of the run loop.
    fn round(&mut self) -> Result<(), String> {
        let stopped = self.stopped;
        if let Some((cpu, e)) = self.session.service(|_| stopped).into_iter().next() {
            return Err(format!("VMM round: cpu {cpu}: {e}"));
        }
        self.session.flush().map_err(|e| e.to_string())
    }
}

/// One subscriber.
struct Sub {
    conn: u64,
    token: u64,
    stream: Stream,
    /// The last item taken.
    seq: u64,
    /// Events taken since the last acknowledgement (repeats allowed if it dies).
    unacked: Vec<u64>,
    /// Losses reported in what it took since the last acknowledgement (the same).
    unacked_lost: u64,
    ended: bool,
}

impl Sub {
    fn acks(&self) -> Vec<Ack> {
        if self.seq == 0 {
            Vec::new()
        } else {
            vec![Ack {
                cpu: 0,
                seq: self.seq,
            }]
        }
    }

    /// Takes the first `n` items of `b` (all: `usize::MAX`), as the client does.
    fn take(&mut self, b: &PieceBatch, n: usize, seen: &mut Seen) -> Result<(), String> {
        let (data, mut at) = (b.payload(), 0usize);
        for it in &b.items {
            // The first item may have any number (earlier ones went to others).
            if self.ended || (self.seq != 0 && it.seq != self.seq + 1) {
                return Err(format!(
                    "item {} after {} (ended {})",
                    it.seq, self.seq, self.ended
                ));
            }
            let len = match it.item {
                BatchItem::Piece { len, .. } => len,
                BatchItem::End { .. } => 0,
            };
            if (it.seq - b.items[0].seq) as usize >= n {
                break;
            }
            match it.item {
                BatchItem::Piece {
                    first,
                    events,
                    missed,
                    ..
                } => {
                    self.stream.lost(missed);
                    let bytes = &data[at..at + len];
                    let (ts, _) = page_header(bytes).unwrap_or((0, 0));
                    let mut k = 0;
                    for ev in Events::new(&bytes[PAGE_HEADER_SIZE..], ts) {
                        let ev = ev.map_err(|e| format!("a piece that does not decode: {e}"))?;
                        let seq =
                            u64::from_le_bytes(ev.payload[8..16].try_into().unwrap_or([0; 8]));
                        if seq != first + k {
                            return Err(format!("piece first {first}: event {k} is {seq}"));
                        }
                        self.stream.event(seq, "a subscriber")?;
                        seen.event(seq, "a subscriber")?;
                        self.unacked.push(seq);
                        k += 1;
                    }
                    if k != events {
                        return Err(format!("a piece of {k} events says {events}"));
                    }
                }
                BatchItem::End { lost } => {
                    self.stream.lost(lost);
                    self.ended = true;
                }
            }
            at += len;
            self.seq = it.seq;
        }
        seen.lost += self.stream.lost;
        self.unacked_lost += self.stream.lost;
        self.stream.lost = 0;
        Ok(())
    }
}

/// The writer, the VMM over the same memory, its output.
fn setup(mode: Mode, guest_swap: bool, text: bool) -> (Writer<Mem>, Vmm) {
    let l = RingGeometry::new(1, 5, 4096, mode, guest_swap).expect("layout");
    let mem: Mem = Box::leak(Box::new(HeapMem::new(l.region_size)));
    let cb: Box<dyn Callbacks + Send> = if guest_swap {
        // No wall time decides anything: a request never times out, never spins.
        Box::new(Mailbox::new(mem, l, Duration::from_secs(3600)).with_spin(Duration::ZERO))
    } else {
        Box::new(Direct::new(mem, l))
    };
    let reader = RingBuffer::alloc(mem, l, cb, 1_000_000, 1).expect("alloc");
    let w = Writer::attach(mem, 0).expect("writer");
    let clock = Clock::nanoseconds();
    let (output, out) = if text {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let o = Output::text(Box::new(SharedVec(Arc::clone(&buf))), 1);
        (o, VmmOut::Text(buf))
    } else {
        let rec = Arc::new(Mutex::new(Recorded::default()));
        (
            Output::Pages(Box::new(RecordSink(Arc::clone(&rec)))),
            VmmOut::Pages(rec),
        )
    };
    // Two pages of pieces: a subscriber that does not fetch holds the reading back.
    let mut session = Session::new(reader, output, clock.clone()).with_outbox_bytes(2 * 4096);
    session.set_live_drain(false);
    let vmm = Vmm {
        session,
        subs: Subscribers::new(),
        meta: RunMeta {
            clock,
            formats: hyptrace_output::guest_formats(),
        },
        stopped: false,
        out,
    };
    (w, vmm)
}

/// A new subscriber (`partial`: a text stream); the VMM may refuse it (one at a time).
fn subscribe(vmm: &mut Vmm, conn: u64, partial: bool) -> Result<Sub, String> {
    let info = vmm
        .subs
        .subscribe(&mut vmm.session, (conn, partial), &vmm.meta, Instant::now())
        .map_err(|e| e.0)?;
    Ok(Sub {
        conn,
        token: info.token,
        stream: Stream::default(),
        seq: 0,
        unacked: Vec::new(),
        unacked_lost: 0,
        ended: false,
    })
}

/// A fetch: acknowledges what `s` took, takes `take` items of the answer.
fn fetch(
    vmm: &mut Vmm,
    s: &mut Sub,
    max: u64,
    take: usize,
    seen: &mut Seen,
) -> Result<bool, String> {
    let acks = s.acks();
    let stopped = vmm.stopped;
    let b = vmm
        .subs
        .fetch(
            &mut vmm.session,
            (s.conn, s.token),
            (&acks, max, 0),
            (&vmm.meta.clock, Some(&|_| stopped)),
            Instant::now(),
        )
        .map_err(|e| format!("fetch: {}", e.0))?;
    s.unacked.clear();
    s.unacked_lost = 0;
    s.take(&b, take, seen)?;
    Ok(!b.items.is_empty())
}

/// A fetch acknowledging an item `s` was not sent: refused (nothing changes); taken,
/// it is a fetch like any (the checks then find what it dropped).
fn hostile_ack(vmm: &mut Vmm, s: &mut Sub, k: u64, seen: &mut Seen) -> Result<(), String> {
    let acks = vec![Ack {
        cpu: 0,
        seq: s.seq + 1 + k * 1000,
    }];
    let stopped = vmm.stopped;
    let r = vmm.subs.fetch(
        &mut vmm.session,
        (s.conn, s.token),
        (&acks, 1 << 20, 0),
        (&vmm.meta.clock, Some(&|_| stopped)),
        Instant::now(),
    );
    match r {
        Err(_) => {
            seen.cov.refused_acks += 1;
            Ok(())
        }
        Ok(b) => {
            s.unacked.clear();
            s.unacked_lost = 0;
            s.take(&b, usize::MAX, seen)
        }
    }
}

fn detach(vmm: &mut Vmm, s: &mut Sub) -> Result<(), String> {
    let acks = s.acks();
    vmm.subs
        .detach(&mut vmm.session, (s.conn, s.token), &acks, Instant::now())
        .map_err(|e| format!("detach: {}", e.0))?;
    s.unacked.clear();
    s.unacked_lost = 0;
    Ok(())
}

/// A subscriber leaves: where the reading stands then (C1's hazards).
fn leaving(vmm: &Vmm, seen: &mut Seen, index: u64, pending_at: &mut Option<u64>) {
    let r = vmm.session.reader();
    if r.position(0).is_some_and(|p| p.consumed > 0) {
        seen.cov.left_mid_page += 1;
    }
    if r.request_in_flight(0) {
        seen.cov.left_swap_pending += 1;
        pending_at.get_or_insert(index);
    }
}

/// Writes `n` markers (the index in `seq`); returns how many the writer took.
fn write(w: &mut Writer<Mem>, index: &mut u64, n: u64) {
    for _ in 0..n {
        let p = events::marker(events::vcpu_pid(0), *index, 0);
        use hyptrace_writer::WriteOutcome::{Dropped, Written};
        if matches!(w.write_enabled(*index * 10, &p), Written | Dropped) {
            *index += 1;
        }
    }
}

/// One seeded run: returns the error the checks found.
fn run(seed: u64, mode: Mode, guest_swap: bool, steps: u32) -> Result<Coverage, String> {
    let mut rng = Rng(seed);
    let text = rng.below(2) == 0;
    let (mut w, mut vmm) = setup(mode, guest_swap, text);
    let mut seen = Seen::default();
    let (mut index, mut conn, mut finished) = (0u64, 1u64, false);
    let mut sub: Option<Sub> = None;
    // Where the writer stood when a subscriber left a swap pending (a ring after it?).
    let mut pending_at: Option<u64> = None;
    let ring = 5 * 4096 / 32;
    for _ in 0..steps {
        if pending_at.is_some_and(|at| index >= at + ring) {
            seen.cov.ring_after_pending += 1;
            pending_at = None;
        }
        match rng.below(17) {
            0..=3 if !finished => {
                // Mostly small bursts; now and then three rings' worth.
                let n = if rng.below(8) == 0 {
                    600
                } else {
                    rng.below(60)
                };
                write(&mut w, &mut index, n);
            }
            4 | 5 if !finished => {
                w.serve_mailbox();
            }
            6 | 7 => {
                vmm.round()?;
                if vmm.session.held(0) {
                    seen.cov.held += 1;
                }
            }
            8..=10 => match &mut sub {
                Some(s) if !s.ended => {
                    if finished && !vmm.stopped {
                        seen.cov.finished_window += 1;
                    }
                    let max = if rng.below(2) == 0 { 1 } else { 1 << 20 };
                    fetch(&mut vmm, s, max, usize::MAX, &mut seen)?;
                }
                _ => {}
            },
            11 => {
                // Takes part of a batch, then detaches at what it took.
                if let Some(mut s) = sub.take() {
                    let take = rng.below(4) as usize;
                    fetch(&mut vmm, &mut s, 1 << 20, take, &mut seen)?;
                    leaving(&vmm, &mut seen, index, &mut pending_at);
                    detach(&mut vmm, &mut s)?;
                }
            }
            12 => {
                if let Some(mut s) = sub.take() {
                    leaving(&vmm, &mut seen, index, &mut pending_at);
                    detach(&mut vmm, &mut s)?;
                }
            }
            13 => {
                // Dies: what it was sent and did not acknowledge may come again (C4).
                if let Some(s) = sub.take() {
                    leaving(&vmm, &mut seen, index, &mut pending_at);
                    seen.allowed.extend(s.unacked.iter().copied());
                    seen.lost_repeats += s.unacked_lost;
                    vmm.subs.gone(&mut vmm.session, s.conn);
                }
            }
            14 if sub.is_none() => {
                conn += 1;
                sub = Some(subscribe(&mut vmm, conn, rng.below(2) == 0)?);
            }
            15 if !finished && rng.below(4) == 0 => {
                // The writer finishes; its vCPU thread is seen to end only later.
                w.serve_mailbox();
                w.finish();
                finished = true;
            }
            16 => {
                // A hostile acknowledgement: an item never sent (C2 refuses it).
                if let Some(s) = &mut sub {
                    hostile_ack(&mut vmm, s, rng.below(3), &mut seen)?;
                }
            }
            _ => {}
        }
    }
    if !finished {
        w.serve_mailbox();
        w.finish();
    }
    finish(&mut vmm, sub, &mut seen)?;
    Ok(seen.cov)
}

/// The vCPU stops; the last subscriber (if any) reads to the end and detaches; the
/// VMM's own output takes the rest; the checks.
fn finish(vmm: &mut Vmm, sub: Option<Sub>, seen: &mut Seen) -> Result<(), String> {
    vmm.stopped = true;
    if let Some(mut s) = sub {
        // Bounded: each round reads or sends; the rings hold a bounded number of pages.
        for _ in 0..10_000 {
            if s.ended {
                break;
            }
            vmm.round()?;
            fetch(vmm, &mut s, 1 << 20, usize::MAX, seen)?;
        }
        if !s.ended {
            return Err("the subscriber never got the CPU's end".into());
        }
        detach(vmm, &mut s)?;
    }
    for _ in 0..10_000 {
        if !vmm.session.is_live(0) {
            break;
        }
        vmm.round()?;
    }
    vmm.session.end_cpu(0).map_err(|e| e.to_string())?;
    vmm.session.flush().map_err(|e| e.to_string())?;
    if vmm.session.is_live(0) {
        return Err("the VMM never ended the CPU".into());
    }
    let before = seen.printed;
    own_output(vmm, seen)?;
    if seen.printed > before {
        seen.cov.own_output_after += 1;
    }
    let st = vmm.session.stats(0);
    let written = vmm.session.writer_index(0);
    if st.read + st.lost != written {
        return Err(format!(
            "VMM: read {} + lost {} != written {written}",
            st.read, st.lost
        ));
    }
    if seen.printed - seen.repeats != st.read || seen.lost - seen.lost_repeats != st.lost {
        return Err(format!(
            "the outputs hold {} events ({} repeats allowed) and {} lost ({} repeated), the VMM read {} and lost {}",
            seen.printed, seen.repeats, seen.lost, seen.lost_repeats, st.read, st.lost
        ));
    }
    Ok(())
}

/// The VMM's own output, into `seen`.
fn own_output(vmm: &mut Vmm, seen: &mut Seen) -> Result<(), String> {
    match &vmm.out {
        VmmOut::Pages(rec) => {
            let r = rec.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(e) = &r.error {
                return Err(e.clone());
            }
            for &seq in &r.seqs {
                seen.event(seq, "the VMM's output")?;
            }
            seen.lost += r.stream.lost;
        }
        VmmOut::Text(buf) => {
            let text = String::from_utf8_lossy(&buf.lock().unwrap_or_else(|e| e.into_inner()))
                .into_owned();
            let mut stream = Stream::default();
            for line in text.lines() {
                let num = |key: &str| {
                    line.split(key)
                        .nth(1)
                        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
                        .and_then(|n| n.parse::<u64>().ok())
                };
                if line.contains("EVENTS DROPPED") {
                    stream.lost(num("[").unwrap_or(0));
                } else if let Some(seq) = num("seq=") {
                    stream.event(seq, "the VMM's output")?;
                    seen.event(seq, "the VMM's output")?;
                }
            }
            seen.lost += stream.lost;
        }
    }
    Ok(())
}

/// Seeds per mode and swap mode in the test command.
const SEEDS: u64 = 150;
/// Steps per seeded run.
const STEPS: u32 = 500;

/// Every seeded run: the first whose checks fail, and why; else what they reached.
fn all_runs() -> Result<Coverage, String> {
    let mut total = Coverage::default();
    for mode in [Mode::Overwrite, Mode::Stop] {
        for guest_swap in [true, false] {
            for seed in 0..SEEDS {
                let c = run(seed, mode, guest_swap, STEPS)
                    .map_err(|e| format!("seed {seed} ({mode:?}, guest swap {guest_swap}): {e}"))?;
                total.left_mid_page += c.left_mid_page;
                total.left_swap_pending += c.left_swap_pending;
                total.ring_after_pending += c.ring_after_pending;
                total.finished_window += c.finished_window;
                total.held += c.held;
                total.refused_acks += c.refused_acks;
                total.own_output_after += c.own_output_after;
            }
        }
    }
    Ok(total)
}

/// The model passes every seed, and its schedules reach every hazard it is for.
#[cfg(not(hyptrace_seeded_bug_consumer))]
#[test]
fn one_reader_and_its_subscribers_model() {
    let c = all_runs().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("model coverage: {c:?}");
    let reached = [
        c.left_mid_page,
        c.left_swap_pending,
        c.ring_after_pending,
        c.finished_window,
        c.held,
        c.refused_acks,
        c.own_output_after,
    ];
    assert!(
        reached.iter().all(|&n| n > 0),
        "a hazard never reached: {c:?}"
    );
}

/// Each seeded bug (docs/fuzzing.md) is caught by the model.
#[cfg(hyptrace_seeded_bug_consumer)]
#[test]
fn seeded_bugs_are_caught() {
    for bug in hyptrace_reader::seeded::CONSUMER_BUGS {
        hyptrace_reader::seeded::select(bug);
        let e = all_runs().expect_err(bug);
        eprintln!("seeded bug {bug} caught: {e}");
    }
}
