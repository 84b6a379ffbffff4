//! The workloads (`hyptrace_abi::guest::Workload`).

use hyptrace_abi::events::{MARKER_SLOT, TEXT_MAX_MSG};
use hyptrace_abi::guest::{
    Workload, BENCH_CHUNK, PACE_MAX_LAG_US, PORT_SLEEP, RUN_FLAG_BENCH_TYPED, SLEEP_MAX_US,
};

use crate::emit::{Emitter, Sink};
use crate::rt::{out32, rdtsc};
use crate::Params;
use hyptrace_abi::guest::WorkloadRng as Rng;

/// Events written before the `panic` and `fault` workloads crash.
const EVENTS_BEFORE_CRASH: u64 = 16;
/// Burst length when the parameter block says 0.
const DEFAULT_BURST: u64 = 1024;
/// An address no page table maps (PML4 slot 254): a store there page-faults, and
/// with no IDT that is a triple fault.
const UNMAPPED: u64 = 0x0000_7f00_dead_0000;

/// Paces event `i` at `rate` events/s from `start`: absolute deadlines (no drift), but
/// never more than [`PACE_MAX_LAG_US`] behind them. A vCPU that was off its core longer
/// (descheduled by the host, or the whole machine by the one below it) resumes at `rate`
/// from where it stands instead of writing its late events back to back, and the run
/// ends that much later (the host reports how much).
struct Pacer {
    start: u64,
    tsc_hz: u64,
    rate: u64,
    /// [`PACE_MAX_LAG_US`] in TSC cycles.
    max_lag: u64,
}

impl Pacer {
    fn new(start: u64, p: &Params) -> Self {
        let tsc_hz = p.tsc_khz.saturating_mul(1000);
        Self {
            start,
            tsc_hz,
            rate: p.rate,
            max_lag: p.tsc_khz.saturating_mul(PACE_MAX_LAG_US) / 1000,
        }
    }

    fn enabled(&self) -> bool {
        self.rate != 0 && self.tsc_hz != 0
    }

    /// TSC deadline of event `i`.
    fn deadline(&self, i: u64) -> u64 {
        let off = u128::from(i) * u128::from(self.tsc_hz) / u128::from(self.rate);
        self.start.wrapping_add(off as u64)
    }

    /// Waits (serving the mailbox) until event `i` is due; if it is already more than
    /// the lag overdue, moves the schedule so that it is due the lag ago.
    fn wait<S: Sink>(&mut self, i: u64, em: &mut Emitter<S>) {
        if !self.enabled() {
            return;
        }
        let due = self.deadline(i);
        let late = rdtsc().wrapping_sub(due) as i64;
        if late > self.max_lag as i64 {
            self.start = self.start.wrapping_add(late as u64 - self.max_lag);
            return;
        }
        spin_until(due, self.tsc_hz / 1000, em);
    }
}

/// A deadline further away than this asks the VMM to sleep (`PORT_SLEEP`): one exit
/// costs ~30 µs here, so closer deadlines are spun for (at 200 000 events/s the gap is
/// 5 µs: always spun).
const SLEEP_MIN_US: u64 = 200;
/// What the pacer keeps spinning for after a sleep (the sleep's own lateness).
const SLEEP_MARGIN_US: u64 = 100;

/// Waits until TSC `deadline`, serving the mailbox: sleeps in the VMM (bounded steps)
/// while the deadline is far, spins the rest. `tsc_khz` 0: spins only.
fn spin_until<S: Sink>(deadline: u64, tsc_khz: u64, em: &mut Emitter<S>) {
    loop {
        let left = deadline.wrapping_sub(rdtsc()) as i64;
        if left <= 0 {
            break;
        }
        em.idle();
        if let Some(us) = (left as u64).saturating_mul(1000).checked_div(tsc_khz) {
            if us > SLEEP_MIN_US {
                let sleep = (us - SLEEP_MARGIN_US).min(u64::from(SLEEP_MAX_US));
                out32(PORT_SLEEP, sleep as u32);
                continue;
            }
        }
        core::hint::spin_loop();
    }
}

/// Largest payload of the `bench` workload (longer requests are cut to it).
pub const BENCH_MAX_PAYLOAD: usize = 2048;

/// What the `bench` workload measured (TSC cycles).
pub struct BenchResult {
    /// The whole timed loop.
    pub cycles: u64,
    /// The fastest full chunk of [`BENCH_CHUNK`] events (0 if there was none).
    pub min_chunk: u64,
}

/// Runs the workload, its `--rate` schedule starting at TSC `start`; the `bench` workload
/// returns what it measured.
pub fn run<S: Sink>(p: &Params, cpu: u32, start: u64, em: &mut Emitter<S>) -> Option<BenchResult> {
    let mut pacer = Pacer::new(start, p);
    match p.workload {
        Workload::Bench => return Some(bench(p, em)),
        Workload::Steady => {
            for i in 0..p.events {
                pacer.wait(i, em);
                em.marker(i);
            }
        }
        Workload::Mixed => mixed(p, cpu, &mut pacer, em),
        Workload::Align => crate::align::run(p, cpu, em),
        Workload::Burst => {
            let burst = if p.burst == 0 {
                DEFAULT_BURST
            } else {
                u64::from(p.burst)
            };
            let mut i = 0;
            while i < p.events {
                if pacer.enabled() {
                    pacer.wait(i, em);
                } else if i != 0 {
                    // As fast as possible between bursts, but still a pause: ~1 ms.
                    let gap = if p.tsc_khz != 0 { p.tsc_khz } else { 1 << 20 };
                    spin_until(rdtsc().wrapping_add(gap), p.tsc_khz, em);
                }
                // A burst is one section: in `--swap guest` mode the mailbox waits for
                // its end, so a burst longer than the ring overruns it (tests count on it).
                let end = (i + burst).min(p.events);
                em.hold_mailbox(true);
                while i < end {
                    em.marker(i);
                    i += 1;
                }
                em.hold_mailbox(false);
            }
        }
        Workload::Panic => {
            let n = p.events.min(EVENTS_BEFORE_CRASH);
            for i in 0..n {
                em.marker(i);
            }
            panic!("guest workload panic on vcpu {cpu} after {n} events");
        }
        Workload::Fault => {
            for i in 0..p.events.min(EVENTS_BEFORE_CRASH) {
                em.marker(i);
            }
            // SAFETY: deliberately invalid: the store page-faults and the vCPU
            // triple-faults (no IDT); nothing is ever written.
            unsafe { (UNMAPPED as *mut u64).write_volatile(0xdead) };
            panic!("fault workload survived a store to {UNMAPPED:#x}");
        }
    }
    None
}

/// `bench`: `events` events of `payload` bytes, back to back, through the same path as
/// every workload (`Emitter::emit`: rdtsc + `Writer::write`, + the mailbox check in
/// `--swap guest` mode), timed with the TSC per chunk of [`BENCH_CHUNK`] events. The
/// host runs the same loop natively (`hyptrace bench`) to compare. The payload is a
/// slice whose length the writer learns at run time, or with [`RUN_FLAG_BENCH_TYPED`]
/// an array whose length it knows at compile time, as a typed event's.
fn bench<S: Sink>(p: &Params, em: &mut Emitter<S>) -> BenchResult {
    if p.flags & RUN_FLAG_BENCH_TYPED != 0 {
        return match p.payload {
            0 => bench_typed::<S, 0>(p, em),
            8 => bench_typed::<S, 8>(p, em),
            16 => bench_typed::<S, 16>(p, em),
            24 => bench_typed::<S, 24>(p, em),
            32 => bench_typed::<S, 32>(p, em),
            64 => bench_typed::<S, 64>(p, em),
            128 => bench_typed::<S, 128>(p, em),
            256 => bench_typed::<S, 256>(p, em),
            n => panic!("bench: no typed loop for a {n}-byte payload"),
        };
    }
    let mut buf = [0u8; BENCH_MAX_PAYLOAD];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = i as u8;
    }
    let payload = &buf[..(p.payload as usize).min(BENCH_MAX_PAYLOAD)];
    timed(p, || em.emit(MARKER_SLOT, core::hint::black_box(payload)))
}

// The typed loops above are those of `BENCH_TYPED_SIZES`: a change of the list fails the
// build here until the match follows it (the host's list is checked by a unit test).
const _: () = assert!(matches!(
    hyptrace_abi::guest::BENCH_TYPED_SIZES,
    [0, 8, 16, 24, 32, 64, 128, 256]
));

/// [`bench`] with an `N`-byte payload whose length is a constant (the bytes are not).
fn bench_typed<S: Sink, const N: usize>(p: &Params, em: &mut Emitter<S>) -> BenchResult {
    let mut buf = [0u8; N];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = i as u8;
    }
    timed(p, || em.emit(MARKER_SLOT, &core::hint::black_box(&buf)[..]))
}

/// Runs `one` `events` times, timed per chunk of [`BENCH_CHUNK`] events.
#[inline(always)]
fn timed(p: &Params, mut one: impl FnMut()) -> BenchResult {
    let mut min_chunk = u64::MAX;
    let mut i = 0;
    let t0 = rdtsc();
    while i < p.events {
        let end = (i + BENCH_CHUNK).min(p.events);
        let full = end - i == BENCH_CHUNK;
        let c0 = rdtsc();
        while i < end {
            one();
            i += 1;
        }
        let c = rdtsc().wrapping_sub(c0);
        if full && c < min_chunk {
            min_chunk = c;
        }
    }
    BenchResult {
        cycles: rdtsc().wrapping_sub(t0),
        min_chunk: if min_chunk == u64::MAX { 0 } else { min_chunk },
    }
}

/// Markers, spans and texts (1..=TEXT_MAX_MSG bytes, so many longer than 112) picked
/// pseudo-randomly.
fn mixed<S: Sink>(p: &Params, cpu: u32, pacer: &mut Pacer, em: &mut Emitter<S>) {
    let mut rng = Rng::new(p.seed, cpu);
    let mut msg = [0u8; TEXT_MAX_MSG];
    for i in 0..p.events {
        pacer.wait(i, em);
        let r = rng.next();
        match r % 8 {
            0..=3 => em.marker(r >> 8),
            4 | 5 => em.span((r >> 16) & 0xffff, (r >> 32) & 0xf_ffff),
            _ => {
                let len = 1 + ((r >> 24) as usize) % TEXT_MAX_MSG;
                let n = fill_text(&mut msg[..len], cpu, i);
                em.text(&msg[..n]);
            }
        }
    }
}

/// Fills `buf` with "vcpu C event I " followed by a letter pattern; returns its length.
fn fill_text(buf: &mut [u8], cpu: u32, i: u64) -> usize {
    let mut n = 0;
    let cap = buf.len();
    let mut put = |b: u8, n: &mut usize| {
        if *n < cap {
            buf[*n] = b;
            *n += 1;
        }
    };
    for &b in b"vcpu " {
        put(b, &mut n);
    }
    for b in Dec::new(u64::from(cpu)).bytes() {
        put(b, &mut n);
    }
    for &b in b" event " {
        put(b, &mut n);
    }
    for b in Dec::new(i).bytes() {
        put(b, &mut n);
    }
    put(b' ', &mut n);
    let mut k = 0u8;
    while n < cap {
        put(b'a' + k % 26, &mut n);
        k = k.wrapping_add(1);
    }
    n
}

/// Decimal digits of a u64 without allocation.
struct Dec {
    digits: [u8; 20],
    start: usize,
}

impl Dec {
    fn new(mut v: u64) -> Self {
        let mut digits = [0u8; 20];
        let mut start = 20;
        loop {
            start -= 1;
            digits[start] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        Self { digits, start }
    }

    fn bytes(&self) -> impl Iterator<Item = u8> + '_ {
        self.digits[self.start..].iter().copied()
    }
}
