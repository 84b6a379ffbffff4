//! Events lost after a CPU's last page (`PageSink::trailing_lost`): every format shows
//! them, markers sum to every loss, and the real trace-cmd prints them for trace.dat.

mod common;

use common::*;
use hyptrace_output::*;

const NR: u32 = 3;
/// Losses before pages, per CPU.
const MID: [u64; 3] = [5, 17, 0];
/// Losses after the last page, per CPU.
const TRAILING: [u64; 3] = [298_257, 0, 4];

fn total() -> u64 {
    MID.iter().sum::<u64>() + TRAILING.iter().sum::<u64>()
}

/// Per CPU pages: 40 markers, a mid-run loss after the 20th.
fn pages() -> Vec<Vec<(Vec<u8>, Missed)>> {
    (0..NR)
        .map(|cpu| {
            let mut b = PageBuilder::new(4096);
            for i in 0..40u64 {
                if i == 20 && MID[cpu as usize] > 0 {
                    b.lose(MID[cpu as usize]);
                }
                // CPU 2 ends first, CPU 0 last.
                b.push(1_000 + i * 100 * u64::from(NR - cpu), &marker(cpu, i, i));
            }
            b.finish()
        })
        .collect()
}

/// Feeds the pages (CPUs interleaved) and the trailing losses, then finishes.
fn feed(mut sink: Box<dyn PageSink>) {
    let pages = pages();
    let max = pages.iter().map(Vec::len).max().unwrap();
    for i in 0..max {
        for (cpu, p) in pages.iter().enumerate() {
            if let Some((page, missed)) = p.get(i) {
                sink.page(cpu as u32, page, *missed).unwrap();
            }
        }
    }
    for (cpu, &n) in TRAILING.iter().enumerate() {
        if n > 0 {
            sink.trailing_lost(cpu as u32, n).unwrap();
        }
    }
    sink.finish(&RunSummary::default()).unwrap();
}

fn meta() -> TraceMeta {
    TraceMeta::guest(4096, NR, Clock::guest_tsc(2_000_000).unwrap())
}

/// Sum of `CPU:N [K EVENTS DROPPED]` lines; each trailing marker comes after its CPU's
/// last event line (and no event of that CPU follows it).
fn check_text(out: &str, what: &str) {
    let lines: Vec<&str> = out.lines().collect();
    let mut sum = 0;
    for l in &lines {
        if let Some(r) = l.strip_prefix("CPU:") {
            let k = r.split('[').nth(1).unwrap().split(' ').next().unwrap();
            sum += k.parse::<u64>().unwrap();
        }
    }
    assert_eq!(sum, total(), "{what}: markers sum to every loss");
    for (cpu, &n) in TRAILING.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let marker = format!("CPU:{cpu} [{n} EVENTS DROPPED]");
        let at = lines.iter().position(|l| *l == marker).expect(&marker);
        let tag = format!("[{cpu:03}]");
        let last_event = lines.iter().rposition(|l| l.contains(&tag)).unwrap();
        assert!(
            at > 0 && lines[..at].iter().any(|l| l.contains(&tag)),
            "{what}: {marker} after events"
        );
        let after: Vec<_> = lines[at + 1..]
            .iter()
            .filter(|l| l.contains(&tag) && l.contains("marker:"))
            .collect();
        assert!(after.is_empty(), "{what}: events after {marker}: {after:?}");
        assert!(last_event > 0);
    }
}

#[test]
fn text_shows_trailing_losses() {
    let dir = scratch_dir("trailing-text");
    let p = dir.join("t.txt");
    feed(Box::new(TextSink::create(&p, meta()).unwrap()));
    check_text(&std::fs::read_to_string(&p).unwrap(), "text");
}

#[test]
fn json_shows_trailing_losses() {
    let dir = scratch_dir("trailing-json");
    let p = dir.join("t.json");
    feed(Box::new(JsonSink::create(&p, meta()).unwrap()));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let evs = v["traceEvents"].as_array().unwrap();
    let lost: Vec<_> = evs.iter().filter(|e| e["name"] == "lost events").collect();
    let sum: u64 = lost
        .iter()
        .map(|e| e["args"]["count"].as_u64().unwrap())
        .sum();
    assert_eq!(sum, total());
    // The trailing marker sits at the CPU's last event.
    for (cpu, &n) in TRAILING.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let last_ts = evs
            .iter()
            .filter(|e| e["tid"] == cpu && e["name"] == "marker")
            .map(|e| e["ts"].as_f64().unwrap())
            .fold(0.0, f64::max);
        let m = lost
            .iter()
            .find(|e| e["tid"] == cpu && e["args"]["count"] == n)
            .unwrap();
        assert_eq!(m["ts"].as_f64().unwrap(), last_ts);
    }
}

#[test]
fn raw_carries_trailing_losses_into_every_format() {
    let dir = scratch_dir("trailing-raw");
    let raw = dir.join("t.raw");
    feed(Box::new(RawSink::create(&raw, meta()).unwrap()));
    let t = RawTrace::parse(&std::fs::read(&raw).unwrap()).unwrap();
    // Replayed into text and trace.dat: the same bytes as fed directly.
    let (a, b) = (dir.join("a.txt"), dir.join("b.txt"));
    t.replay(Box::new(TextSink::create(&a, meta()).unwrap()))
        .unwrap();
    feed(Box::new(TextSink::create(&b, meta()).unwrap()));
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let (a, b) = (dir.join("a.dat"), dir.join("b.dat"));
    t.replay(Box::new(
        TraceDatSink::create(&a, meta(), TraceDatVersion::V7).unwrap(),
    ))
    .unwrap();
    feed(Box::new(
        TraceDatSink::create(&b, meta(), TraceDatVersion::V7).unwrap(),
    ));
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let (a, b) = (dir.join("az.dat"), dir.join("bz.dat"));
    let z = || TraceDatSink::create_with(&a, meta(), TraceDatVersion::V7, Compression::Zstd);
    t.replay(Box::new(z().unwrap())).unwrap();
    feed(Box::new(
        TraceDatSink::create_with(&b, meta(), TraceDatVersion::V7, Compression::Zstd).unwrap(),
    ));
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

fn check_dat(version: TraceDatVersion, compression: Compression, name: &str) {
    let dir = scratch_dir(name);
    let p = dir.join("t.dat");
    feed(Box::new(
        TraceDatSink::create_with(&p, meta(), version, compression).unwrap(),
    ));
    let f = TraceFile::open(&p).unwrap();
    assert_eq!(f.event_count(), 40 * NR as usize);
    assert_eq!(f.dropped(), (total(), 0));
    let ours = f.report();
    check_text(&ours, "report");
    // One `trailing_lost` line right after each trailing marker, carrying the count.
    for (cpu, &n) in TRAILING.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let marker = format!("CPU:{cpu} [{n} EVENTS DROPPED]");
        let lines: Vec<&str> = ours.lines().collect();
        let at = lines.iter().position(|l| *l == marker).unwrap();
        assert!(
            lines[at + 1].contains(&format!("[{cpu:03}]"))
                && lines[at + 1].ends_with(&format!("trailing_lost:        count={n}")),
            "{}",
            lines[at + 1]
        );
    }
    let Some((out, err, ok)) = trace_cmd(&["report", "-t"], &p) else {
        return;
    };
    assert!(ok, "{err}");
    assert_eq!(err, "");
    assert_eq!(out, ours, "trace-cmd prints what our report prints");
    check_text(&out, "trace-cmd");
}

#[test]
fn trace_dat_v7_shows_trailing_losses_in_trace_cmd() {
    check_dat(TraceDatVersion::V7, Compression::None, "trailing-v7");
}

#[test]
fn trace_dat_v7_zstd_shows_trailing_losses_in_trace_cmd() {
    check_dat(TraceDatVersion::V7, Compression::Zstd, "trailing-v7z");
}

#[test]
fn trace_dat_v6_shows_trailing_losses_in_trace_cmd() {
    check_dat(TraceDatVersion::V6, Compression::None, "trailing-v6");
}

#[test]
fn no_trailing_loss_no_extra_format() {
    // A run without trailing losses writes the same file as before (no hyptrace format).
    let dir = scratch_dir("trailing-none");
    let p = dir.join("t.dat");
    let mut s = TraceDatSink::create(&p, meta(), TraceDatVersion::V6).unwrap();
    s.trailing_lost(1, 0).unwrap();
    assert!(s.trailing_lost(NR, 5).is_err());
    Box::new(s).finish(&RunSummary::default()).unwrap();
    let f = TraceFile::open(&p).unwrap();
    assert!(f.formats.iter().all(|f| !f.is_trailing_lost()));
    assert!(f.report().lines().all(|l| !l.starts_with("CPU:")));
}
