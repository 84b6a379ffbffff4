//! trace.dat files we write, read by the real trace-cmd (`report -t`, `dump --summary`)
//! and by our reader: same lines, exact counts, every field, drop markers.

mod common;

use std::collections::BTreeMap;

use common::*;
use hyptrace_abi::page::{decode_record, Record, PAGE_HEADER_SIZE};
use hyptrace_output::*;

struct Gen {
    /// (cpu, raw ts, payload) in generation order.
    events: Vec<(u32, u64, Vec<u8>)>,
    /// Per CPU pages (raw ring pages, missed).
    pages: Vec<Vec<(Vec<u8>, Missed)>>,
    /// (cpu, index in that cpu's event list) → the loss before it.
    drops: BTreeMap<(u32, usize), Missed>,
}

/// A deterministic workload: 3 CPUs, small and huge deltas (TIME_EXTEND), long
/// strings, quotes, losses (every third one of unknown count: `RB_MISSED_EVENTS` alone).
fn generate(page_size: usize, nr_cpus: u32, per_cpu: usize) -> Gen {
    let mut events = Vec::new();
    let mut pages = Vec::new();
    let mut drops = BTreeMap::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for cpu in 0..nr_cpus {
        let mut b = PageBuilder::new(page_size);
        let mut ts = 5_000_000_000u64 + u64::from(cpu) * 7;
        for i in 0..per_cpu {
            let r = next();
            ts += match r % 10 {
                0 => (1 << 27) + (r >> 40), // needs a TIME_EXTEND
                1 => 0,                     // same timestamp
                2 => 1 << 40,               // very large gap
                _ => (r >> 50) % 5000 + 1,
            };
            if i > 0 && r % 97 == 0 {
                let n = match drops.len() % 3 {
                    2 => Missed::Unknown,
                    _ => Missed::Count((r >> 20) % 1000 + 1),
                };
                b.lose_as(n);
                let idx = events
                    .iter()
                    .filter(|e: &&(u32, u64, Vec<u8>)| e.0 == cpu)
                    .count();
                drops.insert((cpu, idx), n);
            }
            let seq = i as u64;
            let payload = match r % 3 {
                0 => marker(cpu, seq, r),
                1 => span(cpu, seq, r >> 32, r % 100_000),
                _ => {
                    let len = (r >> 8) as usize % 241;
                    let msg: String = (0..len)
                        .map(|k| (b' ' + ((k as u64 + r) % 95) as u8) as char)
                        .collect();
                    text(cpu, seq, &msg)
                }
            };
            b.push(ts, &payload);
            events.push((cpu, ts, payload));
        }
        pages.push(b.finish());
    }
    Gen {
        events,
        pages,
        drops,
    }
}

/// The order pages are fed to the sink in.
#[derive(Clone, Copy)]
enum Order {
    /// CPUs interleaved as a live run would, CPU 0 first.
    Interleaved,
    /// Interleaved, the last CPU first: its data goes first into the file.
    Reversed,
    /// CPU after CPU, each ended (`PageSink::end_cpu`) after its pages, as `convert`
    /// feeds a trace.dat: every CPU's data written straight into the output.
    ByCpu,
}

/// Writes the pages through the streaming sink, CPUs interleaved as a live run would.
fn write(
    g: &Gen,
    path: &std::path::Path,
    meta: TraceMeta,
    version: TraceDatVersion,
    compression: Compression,
) {
    write_in(Order::Interleaved, g, path, meta, version, compression);
}

/// [`write`] with the pages fed in `order`.
fn write_in(
    order: Order,
    g: &Gen,
    path: &std::path::Path,
    meta: TraceMeta,
    version: TraceDatVersion,
    compression: Compression,
) {
    let mut sink: Box<dyn PageSink> =
        Box::new(TraceDatSink::create_with(path, meta, version, compression).unwrap());
    let max = g.pages.iter().map(Vec::len).max().unwrap_or(0);
    let mut cpus: Vec<usize> = (0..g.pages.len()).collect();
    if let Order::Reversed = order {
        cpus.reverse();
    }
    if let Order::ByCpu = order {
        for &cpu in &cpus {
            for (page, missed) in &g.pages[cpu] {
                sink.page(cpu as u32, page, *missed).unwrap();
            }
            sink.end_cpu(cpu as u32).unwrap();
        }
    } else {
        for i in 0..max {
            for &cpu in &cpus {
                if let Some((page, missed)) = g.pages[cpu].get(i) {
                    sink.page(cpu as u32, page, *missed).unwrap();
                }
            }
        }
    }
    let stats = (0..meta_cpus(g)).map(|c| KernelCpuStat {
        overrun: 3,
        read_events: 10 + c as u64,
        ..Default::default()
    });
    sink.finish(&RunSummary {
        cpus: stats.collect(),
    })
    .unwrap();
}

fn meta_cpus(g: &Gen) -> usize {
    g.pages.len()
}

/// The lines trace-cmd must print, computed independently of our reader.
fn expected_lines(g: &Gen, clock: &Clock) -> Vec<String> {
    let mut per_cpu: BTreeMap<u32, Vec<(u64, Vec<u8>)>> = BTreeMap::new();
    for (cpu, ts, p) in &g.events {
        per_cpu.entry(*cpu).or_default().push((*ts, p.clone()));
    }
    let mut all = Vec::new();
    for (cpu, evs) in &per_cpu {
        for (i, (ts, p)) in evs.iter().enumerate() {
            let ns = clock.tsc.map_or(*ts, |t| t.trace_cmd_ns(*ts));
            all.push((ns, *cpu, i, p.clone()));
        }
    }
    all.sort_by_key(|e| (e.0, e.1, e.2));
    let mut out = vec![format!("cpus={}", per_cpu.len())];
    for (ns, cpu, i, p) in all {
        // trace-cmd's words: "[%lld EVENTS DROPPED]", "[EVENTS DROPPED]" without a count.
        match g.drops.get(&(cpu, i)) {
            Some(Missed::Count(n)) => out.push(format!("CPU:{cpu} [{n} EVENTS DROPPED]")),
            Some(_) => out.push(format!("CPU:{cpu} [EVENTS DROPPED]")),
            None => {}
        }
        let seq = u64::from_le_bytes(p[8..16].try_into().unwrap());
        let w = |o: usize| u64::from_le_bytes(p[o..o + 8].try_into().unwrap());
        let (name, fields) = match u16::from_le_bytes([p[0], p[1]]) {
            1000 => ("marker", format!("seq={seq} value={}", w(16))),
            1001 => ("span", format!("seq={seq} id={} dur={}", w(16), w(24))),
            _ => {
                let end = p[20..].iter().position(|&c| c == 0).unwrap();
                (
                    "text",
                    format!(
                        "seq={seq} msg={}",
                        String::from_utf8(p[20..20 + end].to_vec()).unwrap()
                    ),
                )
            }
        };
        out.push(norm(&format!(
            "vcpu{cpu}-{} [{cpu:03}] {}.{:09}: {name}: {fields}",
            cpu + 1,
            ns / 1_000_000_000,
            ns % 1_000_000_000
        )));
    }
    out
}

fn check(
    page_size: usize,
    version: TraceDatVersion,
    compression: Compression,
    clock: Clock,
    name: &str,
) {
    check_in(
        Order::Interleaved,
        page_size,
        version,
        compression,
        clock,
        name,
    );
}

/// [`check`] of a file whose pages were fed in `order`.
fn check_in(
    order: Order,
    page_size: usize,
    version: TraceDatVersion,
    compression: Compression,
    clock: Clock,
    name: &str,
) {
    // Reversed: enough pages that the last CPU hands chunks on before the end.
    let per_cpu = match (order, page_size > 4096) {
        (Order::Reversed, _) => 6000,
        (_, true) => 900,
        (_, false) => 400,
    };
    let g = generate(page_size, 3, per_cpu);
    // Our pages never start with a TIME_EXTEND (trace-cmd would hide a drop marker).
    for cpu_pages in &g.pages {
        for (p, _) in cpu_pages {
            let len = commit_len(p).unwrap();
            let data = &p[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len];
            assert!(matches!(
                decode_record(data, 0),
                Ok(Some((Record::Data { delta: 0, .. }, _)))
            ));
        }
    }
    assert!(!g.drops.is_empty(), "workload has losses");
    assert!(
        g.drops.values().any(|m| *m == Missed::Unknown),
        "workload has a loss of unknown count"
    );
    let dir = scratch_dir(name);
    let path = dir.join("trace.dat");
    write_in(
        order,
        &g,
        &path,
        TraceMeta::guest(page_size, 3, clock.clone()),
        version,
        compression,
    );
    let expected = expected_lines(&g, &clock);
    assert_eq!(expected.len(), 1 + g.events.len() + g.drops.len());

    // Our reader.
    let f = TraceFile::open(&path).unwrap();
    let zstd = compression == Compression::Zstd && version == TraceDatVersion::V7;
    assert_eq!(
        f.compression.as_ref().map(|c| c.0.as_str()),
        match (version, zstd) {
            (TraceDatVersion::V6, _) => None,
            (_, true) => Some("zstd"),
            (_, false) => Some("none"),
        }
    );
    assert_eq!(f.page_size, page_size);
    assert_eq!(f.tsc2nsec, clock.tsc);
    // Where each CPU's data went: the first CPU to hand a chunk on writes first.
    let offs: Vec<u64> = f.cpus.iter().map(|b| b.offset).collect();
    match order {
        Order::Reversed if zstd => assert!(offs[2] < offs[0], "{offs:?}"),
        Order::ByCpu => assert!(offs.windows(2).all(|w| w[0] < w[1]), "{offs:?}"),
        _ => {}
    }
    assert_eq!(f.event_count(), g.events.len());
    let ours: Vec<String> = f.report().lines().map(norm).collect();
    assert_eq!(ours, expected);
    assert_eq!(f.cpu_stats().len(), 3);
    assert!(f.cpu_stats()[2].contains("read events: 12"));

    // The real trace-cmd.
    let Some((out, err, ok)) = trace_cmd(&["report", "-t"], &path) else {
        return;
    };
    assert!(ok, "trace-cmd failed: {err}");
    assert_eq!(err, "", "trace-cmd stderr");
    assert!(!out.contains("[UNKNOWN EVENT]") && !out.contains("[FAILED TO PARSE]"));
    let theirs: Vec<String> = out.lines().map(norm).collect();
    assert_eq!(theirs.len(), expected.len(), "line count");
    for (i, (t, e)) in theirs.iter().zip(&expected).enumerate() {
        assert_eq!(t, e, "line {i}");
    }
    let raw_theirs: Vec<&str> = out.lines().collect();
    let raw_ours = f.report();
    let raw_ours: Vec<&str> = raw_ours.lines().collect();
    assert_eq!(
        raw_ours, raw_theirs,
        "byte-identical lines (padding included)"
    );
    let (out, err, ok) = trace_cmd(&["dump", "--summary"], &path).unwrap();
    assert!(ok && err.is_empty(), "{err}");
    assert!(
        out.contains(&format!("{page_size}\t[Page size, bytes]")),
        "{out}"
    );
    if zstd {
        assert!(out.contains("zstd\t[Compression algorithm]"), "{out}");
    }
    let (out, err, _) = trace_cmd(&["report", "--stat"], &path).unwrap();
    assert!(err.is_empty());
    assert!(
        out.contains(&f.stat_text()),
        "{out}\n---\n{}",
        f.stat_text()
    );
}

#[test]
fn v6_4k_tsc() {
    check(
        4096,
        TraceDatVersion::V6,
        Compression::None,
        Clock::guest_tsc(2_918_400).unwrap(),
        "v6-4k",
    );
}

#[test]
fn v7_4k_tsc() {
    check(
        4096,
        TraceDatVersion::V7,
        Compression::None,
        Clock::guest_tsc(2_918_400).unwrap(),
        "v7-4k",
    );
}

#[test]
fn v7_zstd_4k_tsc() {
    check(
        4096,
        TraceDatVersion::V7,
        Compression::Zstd,
        Clock::guest_tsc(2_918_400).unwrap(),
        "v7z-4k",
    );
}

#[test]
fn v7_zstd_16k_ns() {
    check(
        16384,
        TraceDatVersion::V7,
        Compression::Zstd,
        Clock::nanoseconds(),
        "v7z-16k",
    );
}

/// v6 has no compression: asking for zstd writes a plain v6.
#[test]
fn v6_ignores_zstd() {
    check(
        4096,
        TraceDatVersion::V6,
        Compression::Zstd,
        Clock::guest_tsc(2_918_400).unwrap(),
        "v6z-4k",
    );
}

#[test]
fn v6_16k_ns() {
    check(
        16384,
        TraceDatVersion::V6,
        Compression::None,
        Clock::nanoseconds(),
        "v6-16k",
    );
}

#[test]
fn v7_16k_tsc() {
    check(
        16384,
        TraceDatVersion::V7,
        Compression::None,
        Clock::guest_tsc(1_000_000).unwrap(),
        "v7-16k",
    );
}

/// The last CPU's pages first: its data is written straight into the file, first,
/// the other CPUs' after it — trace-cmd reads each CPU at its offset.
#[test]
fn v7_zstd_cpus_out_of_order() {
    check_in(
        Order::Reversed,
        4096,
        TraceDatVersion::V7,
        Compression::Zstd,
        Clock::guest_tsc(2_918_400).unwrap(),
        "v7z-reversed",
    );
}

#[test]
fn v6_cpus_out_of_order() {
    check_in(
        Order::Reversed,
        4096,
        TraceDatVersion::V6,
        Compression::None,
        Clock::nanoseconds(),
        "v6-reversed",
    );
}

/// CPU after CPU, each ended: every CPU's data written straight to its place.
#[test]
fn v7_zstd_cpu_by_cpu() {
    check_in(
        Order::ByCpu,
        4096,
        TraceDatVersion::V7,
        Compression::Zstd,
        Clock::guest_tsc(2_918_400).unwrap(),
        "v7z-bycpu",
    );
}

#[test]
fn v6_cpu_by_cpu() {
    check_in(
        Order::ByCpu,
        16384,
        TraceDatVersion::V6,
        Compression::None,
        Clock::nanoseconds(),
        "v6-bycpu",
    );
}

#[test]
fn trace_cmd_converts_our_files() {
    let g = generate(4096, 2, 100);
    let dir = scratch_dir("convert");
    let path = dir.join("t6.dat");
    write(
        &g,
        &path,
        TraceMeta::guest(4096, 2, Clock::guest_tsc(2_000_000).unwrap()),
        TraceDatVersion::V6,
        Compression::None,
    );
    let out7 = dir.join("t7.dat");
    let st = std::process::Command::new("trace-cmd")
        .args(["convert", "--file-version", "7", "-i"])
        .arg(&path)
        .arg("-o")
        .arg(&out7)
        .output();
    let Ok(st) = st else {
        let _ = trace_cmd(&["report"], &path); // prints SKIP / enforces HYPTRACE_REQUIRE_TRACE_CMD
        return;
    };
    assert!(st.status.success());
    // trace-cmd's own v7 (zstd by default) reads back identically with our reader.
    let a = TraceFile::open(&path).unwrap().report();
    let b = TraceFile::open(&out7).unwrap();
    assert_eq!(b.version, 7);
    assert_eq!(a, b.report());
}

/// A zstd v7 with an empty CPU (no pages) between two with pages: our reader and
/// trace-cmd see every event, and `trace-cmd convert` makes an uncompressed copy that
/// reads the same.
#[test]
fn zstd_with_an_empty_cpu() {
    let g0 = generate(4096, 3, 300);
    let g = Gen {
        events: g0.events.iter().filter(|e| e.0 != 1).cloned().collect(),
        pages: vec![g0.pages[0].clone(), Vec::new(), g0.pages[2].clone()],
        drops: g0.drops.into_iter().filter(|d| d.0 .0 != 1).collect(),
    };
    let dir = scratch_dir("zstd-empty");
    let path = dir.join("z.dat");
    let clock = Clock::guest_tsc(2_000_000).unwrap();
    write(
        &g,
        &path,
        TraceMeta::guest(4096, 3, clock.clone()),
        TraceDatVersion::V7,
        Compression::Zstd,
    );
    let f = TraceFile::open(&path).unwrap();
    assert_eq!(f.event_count(), g.events.len());
    let mut expected = expected_lines(&g, &clock);
    expected[0] = "cpus=3".into();
    let ours: Vec<String> = f.report().lines().map(norm).collect();
    assert_eq!(ours, expected);
    let Some((out, err, ok)) = trace_cmd(&["report", "-t"], &path) else {
        return;
    };
    assert!(ok && err.is_empty(), "{err}");
    let theirs: Vec<String> = out.lines().map(norm).collect();
    assert_eq!(theirs, expected);
    let plain = dir.join("plain.dat");
    let st = std::process::Command::new("trace-cmd")
        .args(["convert", "--compression", "none", "-i"])
        .arg(&path)
        .arg("-o")
        .arg(&plain)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let p = TraceFile::open(&plain).unwrap();
    assert_eq!(p.compression.as_ref().map(|c| c.0.as_str()), Some("none"));
    assert_eq!(p.report(), f.report());
}

/// zstd makes the file several times smaller on marker-heavy pages.
#[test]
fn zstd_is_smaller() {
    let g = generate(4096, 3, 3000);
    let dir = scratch_dir("zstd-size");
    let meta = TraceMeta::guest(4096, 3, Clock::guest_tsc(2_000_000).unwrap());
    let (a, b) = (dir.join("a.dat"), dir.join("b.dat"));
    write(&g, &a, meta.clone(), TraceDatVersion::V7, Compression::None);
    write(&g, &b, meta, TraceDatVersion::V7, Compression::Zstd);
    let (sa, sb) = (
        std::fs::metadata(&a).unwrap().len(),
        std::fs::metadata(&b).unwrap().len(),
    );
    assert!(sb * 2 < sa, "zstd {sb} bytes vs {sa} uncompressed");
    assert_eq!(
        TraceFile::open(&a).unwrap().report(),
        TraceFile::open(&b).unwrap().report()
    );
}
