//! Reader benchmarks over a `HeapMem` region, swapping through `Direct` callbacks.
//!
//! - `read/next_event`: consuming event reads over full pages (decode, the page copy-out
//!   and one swap per page included, amortised); 32-byte payloads, ~110 events a page.
//! - `read/next_page`: page-at-a-time reads (copy-out, validation, one swap a page).
//! - `swap_reader/ring_pages/N`: one `swap_reader_page` (via `Direct::swap_reader`)
//!   with a full page waiting, on rings of N pages; the writer fills the next page
//!   between swaps (not timed). The swap finds the head by walking from the tail, so
//!   its cost grows with the ring when the reader keeps up with the writer.
//!
//! `cargo bench -p hyptrace-reader --bench read` (add `-- --quick` for a fast pass).
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::HeapMem;
use hyptrace_reader::{Callbacks, Direct, Item, RingBuffer, SwapReply, SwapStatus};
use hyptrace_writer::{WriteOutcome, Writer};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

type Rb = RingBuffer<Arc<HeapMem>, Direct<Arc<HeapMem>>>;

const PAGES: u32 = 64;
const PAYLOAD: usize = 32;

/// A region whose ring (stop mode) the writer filled with `PAYLOAD`-byte events; the
/// writer is left on the last page. Returns the reader and the number of events.
fn filled() -> (Rb, u64) {
    let l = RingGeometry::new(1, PAGES + 1, 4096, Mode::Stop, false).expect("layout");
    let mem = Arc::new(HeapMem::new(l.region_size));
    let rb = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 1_000_000, 1)
        .expect("alloc");
    let mut w = Writer::attach(mem, 0).expect("attach");
    let mut p = [0u8; PAYLOAD];
    let mut ts = 1_000u64;
    loop {
        ts += 37;
        p[..8].copy_from_slice(&ts.to_le_bytes());
        if w.write(0, ts, &p) != WriteOutcome::Written {
            break;
        }
    }
    let n = w.entries();
    (rb, n)
}

fn read_benches(c: &mut Criterion) {
    let (_, total) = filled();
    // The writer's last page stays unread by a live reader.
    let per_page = total / u64::from(PAGES);
    let readable = total - per_page;
    let mut g = c.benchmark_group("read");
    g.throughput(Throughput::Elements(readable));
    g.bench_function("next_event", |b| {
        b.iter_batched(
            || filled().0,
            |mut rb| {
                let mut n = 0u64;
                while let Some(it) = rb.next_event(0).expect("read") {
                    if let Item::Event { ts, payload } = it {
                        black_box((ts, payload));
                        n += 1;
                    }
                }
                assert!(n >= readable);
                rb
            },
            BatchSize::LargeInput,
        )
    });
    g.throughput(Throughput::Elements(u64::from(PAGES - 1)));
    g.bench_function("next_page", |b| {
        b.iter_batched(
            || filled().0,
            |mut rb| {
                let mut n = 0u32;
                while let Some(p) = rb.next_page(0).expect("read") {
                    black_box(p.bytes);
                    n += 1;
                }
                assert_eq!(n, PAGES - 1);
                rb
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn swap_benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("swap_reader");
    g.throughput(Throughput::Elements(1));
    for pages in [4u32, 64, 512] {
        let l = RingGeometry::new(1, pages, 4096, Mode::Overwrite, false).expect("layout");
        let mem = Arc::new(HeapMem::new(l.region_size));
        l.init_region(&*mem, 1_000_000, 1);
        let cb = Direct::new(mem.clone(), l);
        let mut w = Writer::attach(mem.clone(), 0).expect("attach");
        // One event fills a page: each write moves the writer to a new page.
        let big = vec![0u8; w.max_payload()];
        let mut ts = 0u64;
        w.write(0, ts, &big);
        g.bench_function(BenchmarkId::new("ring_pages", pages), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    // A full page waits: the writer moves on (overwrite mode never blocks).
                    ts += 1;
                    w.write(0, ts, &big);
                    let t = Instant::now();
                    let s = cb.swap_reader(0).expect("swap");
                    total += t.elapsed();
                    assert!(matches!(s, SwapReply::Done(SwapStatus::Swapped { .. })));
                }
                total
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = read_benches, swap_benches
}
criterion_main!(benches);
