//! Writer hot-path benchmarks, with their baselines in the same run.
//!
//! - `write/payload/N`: `Writer::write` (reserve + fill + commit) of an N-byte payload
//!   with an rdtsc timestamp, as the guest does, on a `HeapMem` region (the raw-memory
//!   fast path). The ring is in overwrite mode with 256 pages, so it never fills; the
//!   page moves (one per ~4 KB) are included, amortised.
//! - `write/time_extend/16`: every event's delta is ≥ 2^27, so each one (but the first
//!   of a page) carries a TIME_EXTEND.
//! - `write/disabled`: `write` on a disabled slot (one relaxed load and a counter).
//! - `event/enabled` / `event/disabled`: the typed `emit_at` of an event declared with
//!   `hyptrace_writer::event!` (two u64 fields: a 24-byte record like `guest:marker`),
//!   slot enabled / disabled; compare with `write/payload/16` (same record size less the
//!   8-byte header the macro builds) and `write/disabled`.
//! - `baseline/rdtsc`: the timestamp alone.
//! - `baseline/raw_store/N`: a plain copy of the same N bytes into a 1 MiB buffer at a
//!   moving offset — the lower bound.
//! - `baseline/rdtsc_raw_store/N`: one rdtsc plus a raw store of the timestamp and the
//!   same bytes — the bound the writer is measured against.
//! - `baseline/rtrb/N`: `rtrb` (SPSC ring of bytes) pushing the 8-byte rdtsc timestamp
//!   and the payload as one slice (`push_entire_slice`); single thread, the consumer
//!   side drains (without copying) whenever the ring runs short of space.
//!
//! `cargo bench -p hyptrace-writer --bench write` (add `-- --quick` for a fast pass).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hyptrace_abi::layout::{ctl, Mode, RingGeometry};
use hyptrace_abi::{HeapMem, SharedMem};
use hyptrace_writer::{event, Writer};
use std::hint::black_box;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

const PAYLOADS: [usize; 5] = [0, 8, 16, 64, 256];
const RING_PAGES: u32 = 256;

/// The guest's clock: the TSC.
#[inline(always)]
fn rdtsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: RDTSC has no preconditions (it only reads the time-stamp counter) and is
    // available on every x86_64 CPU.
    unsafe {
        core::arch::x86_64::_rdtsc()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        use std::sync::OnceLock;
        static START: OnceLock<std::time::Instant> = OnceLock::new();
        START
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_nanos() as u64
    }
}

fn region(mode: Mode) -> (HeapMem, RingGeometry) {
    let l = RingGeometry::new(1, RING_PAGES + 1, 4096, mode, false).expect("layout");
    let mem = HeapMem::new(l.region_size);
    l.init_region(&mem, 1_000_000, 1);
    (mem, l)
}

fn payload(n: usize) -> Vec<u8> {
    (0..n).map(|i| i as u8).collect()
}

fn writer_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("write");
    g.throughput(Throughput::Elements(1));
    for n in PAYLOADS {
        let (mem, _) = region(Mode::Overwrite);
        let mut w = Writer::attach(&mem, 0).expect("attach");
        let p = payload(n);
        g.bench_with_input(BenchmarkId::new("payload", n), &p, |b, p| {
            b.iter(|| w.write(0, rdtsc(), black_box(p)))
        });
    }
    {
        let (mem, _) = region(Mode::Overwrite);
        let mut w = Writer::attach(&mem, 0).expect("attach");
        let p = payload(16);
        let mut ts = 0u64;
        g.bench_function(BenchmarkId::new("time_extend", 16), |b| {
            b.iter(|| {
                ts += 1 << 28;
                w.write(0, black_box(ts), black_box(&p))
            })
        });
    }
    {
        let (mem, l) = region(Mode::Overwrite);
        // Slot 1 disabled, the others enabled.
        mem.store(l.ctl(0) + ctl::ENABLE, !2u64, Relaxed);
        let mut w = Writer::attach(&mem, 0).expect("attach");
        let p = payload(16);
        g.bench_function("disabled", |b| {
            b.iter(|| w.write(black_box(1), black_box(0), black_box(&p)))
        });
    }
    g.finish();
}

event! {
    /// The benchmark's event: two u64 fields, a 24-byte record.
    struct BenchEvent {
        system: "bench",
        name: "ev",
        slot: 1,
        id: 1500,
        print: "\"a=%llu b=%llu\", REC->a, REC->b",
        fields: { a: u64, b: u64 },
    }
}

fn event_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("event");
    g.throughput(Throughput::Elements(1));
    let (mem, l) = region(Mode::Overwrite);
    // No registration table in this region: the event keeps its requested id.
    let _ = hyptrace_writer::events::write_table(&mem, &[BenchEvent::event()]);
    let mut w = Writer::attach(&mem, 0).expect("attach");
    g.bench_function("enabled", |b| {
        b.iter(|| BenchEvent::emit_at(&mut w, rdtsc(), black_box(1), black_box(2)))
    });
    mem.store(l.ctl(0) + ctl::ENABLE, !2u64, Relaxed);
    let before = w.entries();
    let bytes = mem.load(l.ctl(0) + ctl::BYTES, Relaxed);
    g.bench_function("disabled", |b| {
        b.iter(|| BenchEvent::emit_at(&mut w, black_box(0), black_box(1), black_box(2)))
    });
    // A disabled event costs no ring space.
    assert_eq!(w.entries(), before);
    assert_eq!(mem.load(l.ctl(0) + ctl::BYTES, Relaxed), bytes);
    g.finish();
}

fn baseline_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("baseline");
    g.throughput(Throughput::Elements(1));
    g.bench_function("rdtsc", |b| b.iter(rdtsc));
    const BUF: usize = 1 << 20;
    for n in PAYLOADS {
        let p = payload(n);
        let mut buf = vec![0u8; BUF];
        let mut off = 0usize;
        g.bench_with_input(BenchmarkId::new("raw_store", n), &p, |b, p| {
            b.iter(|| {
                if off + p.len() > BUF {
                    off = 0;
                }
                buf[off..off + p.len()].copy_from_slice(black_box(p));
                off += p.len().max(4);
                black_box(&buf);
            })
        });
        let mut off = 0usize;
        g.bench_with_input(BenchmarkId::new("rdtsc_raw_store", n), &p, |b, p| {
            b.iter(|| {
                let need = 8 + p.len();
                if off + need > BUF {
                    off = 0;
                }
                buf[off..off + 8].copy_from_slice(&rdtsc().to_le_bytes());
                buf[off + 8..off + need].copy_from_slice(black_box(p));
                off += need;
                black_box(&buf);
            })
        });
        let (mut prod, mut cons) = rtrb::RingBuffer::<u8>::new(BUF);
        let mut rec = [0u8; 8 + 256];
        g.bench_with_input(BenchmarkId::new("rtrb", n), &p, |b, p| {
            b.iter(|| {
                let need = 8 + p.len();
                if prod.slots() < need {
                    let k = cons.slots();
                    cons.read_chunk(k).expect("readable").commit_all();
                }
                // The record (timestamp + payload) is assembled on the stack and pushed
                // as one slice: one copy into the ring, one tail publication.
                rec[..8].copy_from_slice(&rdtsc().to_le_bytes());
                rec[8..need].copy_from_slice(black_box(p));
                prod.push_entire_slice(&rec[..need]).expect("space");
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

criterion_group! {
    name = benches;
    config = config();
    targets = writer_benches, event_benches, baseline_benches
}
criterion_main!(benches);
