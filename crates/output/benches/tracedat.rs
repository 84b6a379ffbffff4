//! Output benchmarks: ring pages already in memory written to a file.
//!
//! - `tracedat/v7/pages`, `tracedat/v6/pages`: `TraceDatSink` (trace.dat v7 / v6)
//!   writing `PAGES` full 4 KiB pages of `guest:marker` events (2 CPUs), header and
//!   final sync included.
//! - `tracedat/v7-zstd/pages`: the same, zstd-compressed (`record`'s default); the
//!   compressed size is printed once.
//! - `zstd/level/L`: the compression alone (10-page chunks, one context reused, no file)
//!   at zstd levels -1000 (the catch-up level of a live sink that fell behind), -5, -1,
//!   1 and 3 (the sink's, trace-cmd's), with the ratio printed once: the cost of
//!   `v7-zstd` over `v7`.
//! - `cpu/v7/pages`, `cpu/v7-zstd/pages`, `cpu/zstd-level/3`: the same work timed in
//!   **CPU time** of the process (all threads, `/proc/self/stat`, 10 ms ticks: use the
//!   throughput, not single samples) instead of wall time: what the drain costs when it
//!   has the cores to itself — on a loaded machine the wall-clock numbers measure the
//!   other tenants.
//! - `tracedat/raw/pages`: `RawSink` over the same pages, for comparison.
//! - `tracedat/v7-zstd-text/pages`: v7 zstd of pages where every fourth event is a
//!   `guest:text` (a string field: its bytes are made safe, G2) — the cost of the
//!   string walk; `tracedat/v7-zstd-bycpu/pages`: the marker pages fed CPU by CPU, each
//!   CPU ended (`PageSink::end_cpu`), as `convert` feeds a trace.dat: every CPU written
//!   straight into the output, nothing spilled.
//! - `sinks/text/pages`, `sinks/json/pages`, `sinks/perfetto/pages`: the text, JSON and
//!   Perfetto sinks over the marker pages (their per-event lookups, formatting and
//!   encoding). With `tracedat/{raw,v7,v7-zstd,v6}` every sink `record` offers has a
//!   criterion bench; `.ci/bench-report` compares them, as ratios to `tracedat/raw` of
//!   the same run, with docs/bench-sinks.json (a report in CI, never a failure).
//! - `tracedat/v7-mapped/pages`, `cpu/v7-mapped/pages`: v7 with a run's clock map
//!   (`--clock mono`: 120 knots, a minute of corrections): every page retimed to ns
//!   (`Clock::retime_page`) on its way in — the cost of the corrected clock over `v7`.
//!
//! Throughput is reported in bytes of pages. `cargo bench -p hyptrace-output --bench
//! tracedat` (add `-- --quick` for a fast pass).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use hyptrace_abi::events;
use hyptrace_abi::page::{self, COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_output::{
    Clock, ClockMap, Compression, JsonSink, Knot, Missed, PageSink, PerfettoSink, RawSink,
    RunSummary, StreamSink, TextSink, TraceDatSink, TraceDatVersion, TraceMeta, SLOPE_SHIFT,
};
use std::path::PathBuf;
use std::time::Duration;

const PAGE: usize = 4096;
const PAGES: usize = 2048;
const CPUS: u32 = 2;

/// A full page of events (delta 100 each), as the reader hands it out: the payload of
/// event `seq` is `payload(seq)`.
fn page_of(ts: u64, first_seq: u64, payload: impl Fn(u64) -> Vec<u8>) -> Vec<u8> {
    let mut p = vec![0u8; PAGE];
    p[..8].copy_from_slice(&ts.to_le_bytes());
    let cap = PAGE - PAGE_HEADER_SIZE - 96;
    let (mut at, mut seq) = (0, first_seq);
    loop {
        let payload = payload(seq);
        let size = page::data_event_size(payload.len());
        if at + size > cap {
            break;
        }
        let mut hdr = [0u8; 8];
        let delta = if at == 0 { 0 } else { 100 };
        let hlen = page::encode_data_header(&mut hdr, payload.len(), delta);
        let o = PAGE_HEADER_SIZE + at;
        p[o..o + hlen].copy_from_slice(&hdr[..hlen]);
        p[o + hlen..o + hlen + payload.len()].copy_from_slice(&payload);
        at += size;
        seq += 1;
    }
    p[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&(at as u64).to_le_bytes());
    p
}

/// A full page of marker events.
fn page_of_markers(cpu: u32, first_seq: u64, ts: u64) -> Vec<u8> {
    page_of(ts, first_seq, |seq| {
        events::marker(events::vcpu_pid(cpu), seq, seq).to_vec()
    })
}

/// A full page of events, every fourth a `guest:text` of 40 bytes, the rest markers.
fn page_with_text(cpu: u32, first_seq: u64, ts: u64) -> Vec<u8> {
    let msg = b"a guest text of forty bytes, plain ASCII";
    page_of(ts, first_seq, |seq| {
        if seq % 4 == 0 {
            let mut buf = [0u8; 128];
            let n = events::text(&mut buf, events::vcpu_pid(cpu), seq, msg).expect("text");
            buf[..n].to_vec()
        } else {
            events::marker(events::vcpu_pid(cpu), seq, seq).to_vec()
        }
    })
}

fn pages() -> Vec<(u32, Vec<u8>)> {
    (0..PAGES)
        .map(|i| {
            let cpu = (i % CPUS as usize) as u32;
            (
                cpu,
                page_of_markers(cpu, i as u64 * 200, 1_000_000 + i as u64 * 20_000),
            )
        })
        .collect()
}

fn meta() -> TraceMeta {
    TraceMeta::guest(PAGE, CPUS, Clock::guest_tsc(2_600_000).expect("clock"))
}

/// [`meta`] with a run's map: 120 knots 500 ms of a 2.6 GHz TSC apart, spanning the
/// pages' times.
fn mapped_meta() -> TraceMeta {
    let slope = (1_000_000u128 << SLOPE_SHIFT) / 2_600_000;
    let map = ClockMap::new(Knot {
        tsc: 0,
        ns: 1_000_000_000,
        slope: slope as u64,
    });
    let span = (PAGES as u64 * 20_000).div_ceil(120);
    for k in 1..=120u64 {
        map.extend(|| k * span, |_, _| (slope + (k as u128 % 3)) as u64);
    }
    let mut m = meta();
    m.clock = m.clock.with_map("mono", map);
    m
}

fn out_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("hyptrace-bench-{}-{tag}", std::process::id()))
}

fn write_all(mut sink: Box<dyn PageSink>, pages: &[(u32, Vec<u8>)]) {
    for (cpu, p) in pages {
        sink.page(*cpu, p, Missed::None).expect("page");
    }
    sink.finish(&RunSummary::default()).expect("finish");
}

/// The pages CPU by CPU, each CPU ended after its last (as `convert` feeds a trace.dat).
fn write_by_cpu(mut sink: Box<dyn PageSink>, pages: &[(u32, Vec<u8>)]) {
    for cpu in 0..CPUS {
        for (c, p) in pages {
            if *c == cpu {
                sink.page(cpu, p, Missed::None).expect("page");
            }
        }
        sink.end_cpu(cpu).expect("end");
    }
    sink.finish(&RunSummary::default()).expect("finish");
}

fn tracedat_benches(c: &mut Criterion) {
    let pages = pages();
    let mut g = c.benchmark_group("tracedat");
    g.throughput(Throughput::Bytes((PAGES * PAGE) as u64));
    for (name, v, z, mapped) in [
        ("v7", TraceDatVersion::V7, Compression::None, false),
        ("v7-mapped", TraceDatVersion::V7, Compression::None, true),
        ("v7-zstd", TraceDatVersion::V7, Compression::Zstd, false),
        ("v6", TraceDatVersion::V6, Compression::None, false),
    ] {
        let path = out_path(&format!("{name}.dat"));
        let meta = if mapped { mapped_meta } else { meta };
        g.bench_function(BenchmarkId::new(name, PAGES), |b| {
            b.iter(|| {
                let sink = TraceDatSink::create_with(&path, meta(), v, z).expect("create");
                write_all(Box::new(sink), &pages);
            })
        });
        if let Ok(m) = std::fs::metadata(&path) {
            println!(
                "{name}: {} bytes for {} bytes of pages ({:.1}x)",
                m.len(),
                PAGES * PAGE,
                (PAGES * PAGE) as f64 / m.len() as f64
            );
        }
        let _ = std::fs::remove_file(&path);
    }
    let path = out_path("pages.raw");
    g.bench_function(BenchmarkId::new("raw", PAGES), |b| {
        b.iter(|| {
            let sink = RawSink::create(&path, meta()).expect("create");
            write_all(Box::new(sink), &pages);
        })
    });
    let _ = std::fs::remove_file(&path);
    let text: Vec<(u32, Vec<u8>)> = pages
        .iter()
        .enumerate()
        .map(|(i, (cpu, _))| {
            let ts = 1_000_000 + i as u64 * 20_000;
            (*cpu, page_with_text(*cpu, i as u64 * 200, ts))
        })
        .collect();
    type Pages = [(u32, Vec<u8>)];
    type Feed = fn(Box<dyn PageSink>, &Pages);
    let runs: [(&str, &Pages, Feed); 2] = [
        ("v7-zstd-text", &text, write_all),
        ("v7-zstd-bycpu", &pages, write_by_cpu),
    ];
    for (name, input, feed) in runs {
        let path = out_path(&format!("{name}.dat"));
        g.bench_function(BenchmarkId::new(name, PAGES), |b| {
            b.iter(|| {
                let (v, z) = (TraceDatVersion::V7, Compression::Zstd);
                let sink = TraceDatSink::create_with(&path, meta(), v, z).expect("create");
                feed(Box::new(sink), input);
            })
        });
        let _ = std::fs::remove_file(&path);
    }
    g.finish();
}

/// A sink of another format into `path`.
type MakeSink = fn(&PathBuf) -> Box<dyn PageSink>;

fn sink_benches(c: &mut Criterion) {
    let pages = pages();
    let mut g = c.benchmark_group("sinks");
    g.throughput(Throughput::Bytes((PAGES * PAGE) as u64));
    let sinks: [(&str, MakeSink); 3] = [
        ("text", |p| {
            Box::new(TextSink::create(p, meta()).expect("create"))
        }),
        ("json", |p| {
            Box::new(JsonSink::create(p, meta()).expect("create"))
        }),
        ("perfetto", |p| {
            Box::new(PerfettoSink::create(p, meta()).expect("create"))
        }),
    ];
    for (name, make) in sinks {
        let path = out_path(&format!("pages.{name}"));
        g.bench_function(BenchmarkId::new(name, PAGES), |b| {
            b.iter(|| write_all(make(&path), &pages))
        });
        let _ = std::fs::remove_file(&path);
    }
    g.finish();
}

fn zstd_benches(c: &mut Criterion) {
    let pages = pages();
    let data: Vec<u8> = pages.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    let mut g = c.benchmark_group("zstd");
    g.throughput(Throughput::Bytes(data.len() as u64));
    let chunk = 10 * PAGE;
    for level in [-1000, -5, -1, 1, 3] {
        let mut z = zstd::bulk::Compressor::new(level).expect("zstd");
        let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(chunk));
        let mut total = 0usize;
        for c in data.chunks(chunk) {
            out.clear();
            total += z.compress_to_buffer(c, &mut out).expect("compress");
        }
        println!(
            "zstd level {level}: {:.1}x",
            data.len() as f64 / total as f64
        );
        g.bench_function(BenchmarkId::new("level", level), |b| {
            b.iter(|| {
                for c in data.chunks(chunk) {
                    out.clear();
                    z.compress_to_buffer(c, &mut out).expect("compress");
                }
            })
        });
    }
    g.finish();
}

/// CPU time (user + system) of this process so far, all threads included (exited ones
/// too), from `/proc/self/stat` (clock ticks of 10 ms).
fn process_cpu() -> Duration {
    let s = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &s[s.rfind(')').expect("stat") + 2..];
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // utime, stime: fields 14 and 15 of stat = 11 and 12 after the state (field 3).
    Duration::from_millis((f[11] + f[12]) * 10)
}

fn cpu_benches(c: &mut Criterion) {
    let pages = pages();
    let mut g = c.benchmark_group("cpu");
    g.throughput(Throughput::Bytes((PAGES * PAGE) as u64));
    for (name, z, mapped) in [
        ("v7", Compression::None, false),
        ("v7-mapped", Compression::None, true),
        ("v7-zstd", Compression::Zstd, false),
    ] {
        let path = out_path(&format!("cpu-{name}.dat"));
        let meta = if mapped { mapped_meta } else { meta };
        g.bench_function(BenchmarkId::new(name, PAGES), |b| {
            b.iter_custom(|iters| {
                let t0 = process_cpu();
                for _ in 0..iters {
                    let sink = TraceDatSink::create_with(&path, meta(), TraceDatVersion::V7, z)
                        .expect("create");
                    write_all(Box::new(sink), &pages);
                }
                // A zero would break criterion's statistics: at least one tick.
                (process_cpu() - t0).max(Duration::from_millis(10))
            })
        });
        let _ = std::fs::remove_file(&path);
    }
    let data: Vec<u8> = pages.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    let chunk = 10 * PAGE;
    let mut z = zstd::bulk::Compressor::new(3).expect("zstd");
    let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(chunk));
    g.bench_function(BenchmarkId::new("zstd-level", 3), |b| {
        b.iter_custom(|iters| {
            let t0 = process_cpu();
            for _ in 0..iters {
                for c in data.chunks(chunk) {
                    out.clear();
                    z.compress_to_buffer(c, &mut out).expect("compress");
                }
            }
            (process_cpu() - t0).max(Duration::from_millis(10))
        })
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
}

criterion_group! {
    name = benches;
    config = config();
    targets = tracedat_benches, sink_benches, zstd_benches, cpu_benches
}
criterion_main!(benches);
