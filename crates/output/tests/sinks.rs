//! Sinks: trace.dat atomicity, Chrome JSON, text, raw streams.

mod common;

use common::*;
use hyptrace_output::*;

fn pages_2cpu() -> Vec<(u32, Vec<u8>, Missed)> {
    let mut out = Vec::new();
    for cpu in 0..2u32 {
        let mut b = PageBuilder::new(4096);
        b.push(1_000, &marker(cpu, 1, 10));
        b.push(3_000_000, &span(cpu, 2, 9, 2_000_000));
        b.lose(5);
        b.push(
            4_000_000,
            &text(cpu, 3, "quote \" backslash \\ tab \t nl \n ctl \u{1} end"),
        );
        for (p, m) in b.finish() {
            out.push((cpu, p, m));
        }
    }
    out
}

fn leftovers(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn trace_dat_dropped_or_failed_leaves_nothing() {
    let dir = scratch_dir("atomic");
    let path = dir.join("out.dat");
    {
        let mut s = TraceDatSink::create(
            &path,
            TraceMeta::guest(4096, 2, Clock::nanoseconds()),
            TraceDatVersion::V7,
        )
        .unwrap();
        for (c, p, m) in pages_2cpu() {
            s.page(c, &p, m).unwrap();
        }
        assert!(
            !leftovers(&dir).is_empty(),
            "spill files exist while running"
        );
        // Bad pages are refused, the sink stays usable.
        assert!(s.page(5, &[0u8; 4096], Missed::None).is_err());
        assert!(s.page(0, &[0u8; 100], Missed::None).is_err());
    }
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    // A previous complete file is untouched by a failed run.
    std::fs::write(&path, b"old").unwrap();
    drop(
        TraceDatSink::create(
            &path,
            TraceMeta::guest(4096, 2, Clock::nanoseconds()),
            TraceDatVersion::V6,
        )
        .unwrap(),
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    assert_eq!(leftovers(&dir), vec!["out.dat".to_string()]);
    // A bad clock for trace-cmd is refused up front.
    let mut clock = Clock::guest_tsc(2_000_000).unwrap();
    clock.tsc.as_mut().unwrap().offset = 5;
    assert!(
        TraceDatSink::create(&path, TraceMeta::guest(4096, 2, clock), TraceDatVersion::V6).is_err()
    );
    assert!(TraceDatSink::create(
        &path,
        TraceMeta::guest(1000, 2, Clock::nanoseconds()),
        TraceDatVersion::V6
    )
    .is_err());
}

#[test]
fn trace_dat_pages_page_aligned_and_verbatim() {
    let dir = scratch_dir("aligned");
    let path = dir.join("out.dat");
    let pages = pages_2cpu();
    write_trace_dat(
        &path,
        TraceMeta::guest(4096, 2, Clock::nanoseconds()),
        TraceDatVersion::V6,
        pages.iter().map(|(c, p, m)| (*c, p.as_slice(), *m)),
        &RunSummary::default(),
    )
    .unwrap();
    let data = std::fs::read(&path).unwrap();
    assert_eq!(data.len() % 4096, 0);
    let f = TraceFile::parse(&data).unwrap();
    for (cpu, buf) in f.cpus.iter().enumerate() {
        let mine: Vec<Vec<u8>> = pages
            .iter()
            .filter(|p| p.0 == cpu as u32)
            .map(|(c, p, m)| export_page(*c, p, *m).unwrap())
            .collect();
        let mut read = Vec::new();
        let mut it = f.pages(cpu).unwrap();
        while let Some(p) = it.next_page().unwrap() {
            read.extend_from_slice(p);
        }
        // Verbatim but for G2: the guest string bytes the text escapes are '?'.
        let mine = mine.concat();
        assert_eq!(read.len(), mine.len());
        let changed: Vec<(u8, u8)> = read
            .iter()
            .zip(&mine)
            .filter(|(r, m)| r != m)
            .map(|(r, m)| (*r, *m))
            .collect();
        assert!(
            !changed.is_empty()
                && changed
                    .iter()
                    .all(|&(r, m)| r == b'?' && m.is_ascii_control()),
            "{changed:?}"
        );
        // Each CPU's pages sit page-aligned in the file.
        let at = buf.offset as usize;
        assert_eq!(&data[at..at + read.len()], read.as_slice());
        assert_eq!(at % 4096, 0);
    }
}

#[test]
fn chrome_json() {
    let dir = scratch_dir("json");
    let path = dir.join("t.json");
    let clock = Clock::guest_tsc(2_000_000).unwrap(); // 2 cycles per ns
    let meta = TraceMeta::guest(4096, 2, clock.clone());
    let mut sink: Box<dyn PageSink> = Box::new(JsonSink::create(&path, meta).unwrap());
    let pages = pages_2cpu();
    for (c, p, m) in &pages {
        sink.page(*c, p, *m).unwrap();
    }
    sink.finish(&RunSummary::default()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let evs = v["traceEvents"].as_array().unwrap();
    // 1 process_name + 2 thread_name + 2×3 events + 2 lost markers.
    assert_eq!(evs.len(), 1 + 2 + 6 + 2);
    for e in evs {
        for k in ["ph", "ts", "pid", "tid", "name"] {
            assert!(e.get(k).is_some(), "{k} missing in {e}");
        }
        assert_eq!(e["pid"], 1);
        if e["ph"] == "X" {
            assert!(e["dur"].is_number());
        }
    }
    let spans: Vec<_> = evs.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(spans.len(), 2);
    // span at 3_000_000 cycles = 1.5 ms, dur 2_000_000 cycles = 1 ms → starts at 0.5 ms.
    assert_eq!(spans[0]["dur"].as_f64().unwrap(), 1000.0);
    assert_eq!(spans[0]["ts"].as_f64().unwrap(), 500.0);
    assert_eq!(spans[0]["args"]["id"], 9);
    let texts: Vec<_> = evs.iter().filter(|e| e["name"] == "text").collect();
    assert_eq!(
        texts[0]["args"]["msg"],
        "quote \" backslash \\ tab \t nl \n ctl \u{1} end"
    );
    assert_eq!(texts[0]["ph"], "i");
    assert_eq!(texts[0]["tid"], 0);
    assert_eq!(texts[1]["tid"], 1);
    let lost: Vec<_> = evs.iter().filter(|e| e["name"] == "lost events").collect();
    assert_eq!(lost.len(), 2);
    assert_eq!(lost[0]["args"]["count"], 5);
    assert_eq!(lost[0]["ts"].as_f64().unwrap(), 2000.0);
    let names: Vec<_> = evs
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].clone())
        .collect();
    assert_eq!(names, vec!["vcpu0", "vcpu1"]);
    // ns precision: 1_000 cycles = 500 ns = 0.500 µs.
    let m = evs.iter().find(|e| e["name"] == "marker").unwrap();
    assert_eq!(m["ts"].as_f64().unwrap(), 0.5);
    let raw = std::fs::read_to_string(&path).unwrap();
    assert!(raw.contains("\"ts\":0.500,"), "{raw}");
}

/// Groups (several VMs): JSON names each VM's process and every entry's `vm` (pid the
/// VM's, tid the vCPU's number in it, the loss markers too); metadata whose groups
/// overlap, leave the CPUs or have a bad name is refused; the sinks that cannot name
/// a VM (text, raw, trace.dat) refuse groups.
#[test]
fn groups_name_vms_or_are_refused() {
    let dir = scratch_dir("groups");
    let mut meta = TraceMeta::guest(4096, 0, Clock::guest_tsc(2_000_000).unwrap());
    meta.nr_cpus = 0;
    meta.cmdlines.clear();
    meta.push_group("web", 1, Some(&Default::default()))
        .unwrap();
    meta.push_group("db", 1, Some(&Default::default())).unwrap();
    assert_eq!(meta.nr_cpus, 2);
    meta.validate().unwrap();
    let path = dir.join("t.json");
    let mut sink: Box<dyn PageSink> = Box::new(JsonSink::create(&path, meta.clone()).unwrap());
    for (c, p, m) in &pages_2cpu() {
        sink.page(*c, p, *m).unwrap();
    }
    sink.finish(&RunSummary::default()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let evs = v["traceEvents"].as_array().unwrap();
    let procs: Vec<(u64, &str)> = evs
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(procs, [(1, "web"), (2, "db")]);
    let events: Vec<_> = evs.iter().filter(|e| e["ph"] != "M").collect();
    assert_eq!(events.len(), 2 * 3 + 2);
    for e in events {
        let want = if e["pid"] == 1 { "web" } else { "db" };
        assert_eq!(e["vm"], want, "{e}");
        assert_eq!(e["tid"], 0, "{e}");
    }
    let bad = |f: &dyn Fn(&mut TraceMeta)| {
        let mut m = meta.clone();
        f(&mut m);
        m.validate().is_err()
    };
    assert!(bad(&|m| m.groups[1].first = 0)); // overlap
    assert!(bad(&|m| m.groups[1].count = 2)); // past the CPUs
    assert!(bad(&|m| m.groups[0].name = "a b".into()));
    assert!(bad(&|m| m.groups[0].count = 0));
    let t = |name: &str| OutputTarget::check(dir.join(name)).unwrap();
    assert!(TextSink::open(&t("t.txt"), meta.clone()).is_err());
    assert!(RawSink::open(&t("t.raw"), meta.clone()).is_err());
    assert!(TraceDatSink::open(&t("t.dat"), meta, TraceDatVersion::V7).is_err());
}

#[test]
fn text_sink_matches_report() {
    let dir = scratch_dir("text");
    let meta = TraceMeta::guest(4096, 1, Clock::guest_tsc(2_500_000).unwrap());
    let mut b = PageBuilder::new(4096);
    let mut ts = 1_000_000u64;
    for i in 0..300u64 {
        ts += 977 + (i % 7 / 6) * (1 << 28);
        b.push(ts, &marker(0, i, i * 3));
        if i == 150 {
            b.lose(12);
        }
    }
    let pages = b.finish();
    let txt = dir.join("t.txt");
    let dat = dir.join("t.dat");
    let mut sink: Box<dyn PageSink> = Box::new(TextSink::create(&txt, meta.clone()).unwrap());
    for (p, m) in &pages {
        sink.page(0, p, *m).unwrap();
    }
    sink.finish(&RunSummary::default()).unwrap();
    write_trace_dat(
        &dat,
        meta,
        TraceDatVersion::V6,
        pages.iter().map(|(p, m)| (0, p.as_slice(), *m)),
        &RunSummary::default(),
    )
    .unwrap();
    let report = TraceFile::open(&dat).unwrap().report();
    assert_eq!(std::fs::read_to_string(&txt).unwrap(), report);
    assert!(report.contains("CPU:0 [12 EVENTS DROPPED]"));
}

#[test]
fn raw_roundtrip_to_trace_dat() {
    let dir = scratch_dir("raw");
    let meta = TraceMeta::guest(4096, 2, Clock::guest_tsc(2_918_400).unwrap());
    let raw = dir.join("t.raw");
    let mut sink: Box<dyn PageSink> = Box::new(RawSink::create(&raw, meta.clone()).unwrap());
    let pages = pages_2cpu();
    for (c, p, m) in &pages {
        sink.page(*c, p, *m).unwrap();
    }
    let stats = RunSummary {
        cpus: vec![
            KernelCpuStat {
                overrun: 5,
                read_events: 3,
                ..Default::default()
            };
            2
        ],
    };
    sink.finish(&stats).unwrap();
    let t = RawTrace::parse(&std::fs::read(&raw).unwrap()).unwrap();
    assert_eq!((t.page_size, t.nr_cpus), (4096, 2));
    assert_eq!(t.clock, meta.clock);
    assert_eq!(t.summary.as_ref(), Some(&stats));
    for ((c, p), (c2, p2, m2)) in t.pages.iter().zip(&pages) {
        assert_eq!(c, c2);
        assert_eq!(p, &export_page(*c2, p2, *m2).unwrap());
    }
    let a = dir.join("a.dat");
    let b = dir.join("b.dat");
    t.replay(Box::new(
        TraceDatSink::create(&a, meta.clone(), TraceDatVersion::V7).unwrap(),
    ))
    .unwrap();
    write_trace_dat(
        &b,
        meta,
        TraceDatVersion::V7,
        pages.iter().map(|(c, p, m)| (*c, p.as_slice(), *m)),
        &stats,
    )
    .unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

#[test]
fn guest_line_formatter_is_report_formatter() {
    // The live formatter (format_guest_line) prints what report prints for our files.
    let printers = guest_printers();
    let meta = TraceMeta::guest(4096, 2, Clock::guest_tsc(2_918_400).unwrap());
    let mut lines = vec!["cpus=2".to_string()];
    let pages = pages_2cpu();
    let dir = scratch_dir("live");
    let dat = dir.join("t.dat");
    write_trace_dat(
        &dat,
        meta.clone(),
        TraceDatVersion::V6,
        pages.iter().map(|(c, p, m)| (*c, p.as_slice(), *m)),
        &RunSummary::default(),
    )
    .unwrap();
    let f = TraceFile::open(&dat).unwrap();
    let mut recs = f.records();
    while let Some(item) = recs.next_item() {
        let mut s = String::new();
        match item {
            TraceItem::Event(r) => format_guest_line(
                &mut s,
                &printers,
                &meta.cmdlines,
                r.cpu,
                meta.clock.to_ns(r.ts_raw),
                r.payload,
            ),
            TraceItem::Dropped { cpu, missed, .. } => format_drop(&mut s, cpu, missed),
            TraceItem::BadPage { .. } => unreachable!(),
        }
        lines.push(s);
    }
    // (the text message's newline, tab and control byte are escaped: one line per item.)
    assert_eq!(lines.join("\n") + "\n", f.report());
}

/// A guest text event that tries to forge a drop marker and an event line.
const FORGED: &str = "x\nCPU:0 [999 EVENTS DROPPED]\n           vcpu0-1     [000]     9.000000000: marker:               seq=7 value=7\r\x1b[2K\u{202e}end";
const FORGED_ESCAPED: &str = "x\\nCPU:0 [999 EVENTS DROPPED]\\n           vcpu0-1     [000]     9.000000000: marker:               seq=7 value=7\\r\\x1b[2K\\u{202e}end";

fn forged_pages() -> Vec<(Vec<u8>, Missed)> {
    let mut b = PageBuilder::new(4096);
    b.push(1_000, &marker(0, 1, 10));
    b.push(2_000, &text(0, 2, FORGED));
    b.push(3_000, &marker(0, 3, 30));
    b.finish()
}

/// Lines of a text output: exactly `events` event lines plus the `cpus=` line, no drop
/// marker (none was lost), the message escaped on its line.
fn check_forged_text(out: &str, what: &str, msg: &str) {
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{what}: {out}");
    assert_eq!(lines[0], "cpus=1", "{what}");
    assert!(
        !lines.iter().any(|l| l.starts_with("CPU:")),
        "{what}: forged marker: {out}"
    );
    assert_eq!(lines.iter().filter(|l| l.contains("marker:")).count(), 3);
    assert!(
        lines[2].ends_with(&format!("msg={msg}")),
        "{what}: {}",
        lines[2]
    );
    assert!(
        out.bytes().all(|c| c == b'\n' || !c.is_ascii_control()),
        "{what}"
    );
}

#[test]
fn forged_lines_are_escaped_in_every_text_output() {
    let dir = scratch_dir("forged");
    let meta = TraceMeta::guest(4096, 1, Clock::nanoseconds());
    let pages = forged_pages();
    // TextSink.
    let txt = dir.join("t.txt");
    let mut sink: Box<dyn PageSink> = Box::new(TextSink::create(&txt, meta.clone()).unwrap());
    for (p, m) in &pages {
        sink.page(0, p, *m).unwrap();
    }
    sink.finish(&RunSummary::default()).unwrap();
    check_forged_text(
        &std::fs::read_to_string(&txt).unwrap(),
        "text sink",
        FORGED_ESCAPED,
    );
    // trace.dat report.
    let dat = dir.join("t.dat");
    write_trace_dat(
        &dat,
        meta.clone(),
        TraceDatVersion::V7,
        pages.iter().map(|(p, m)| (0, p.as_slice(), *m)),
        &RunSummary::default(),
    )
    .unwrap();
    let f = TraceFile::open(&dat).unwrap();
    // G2: trace.dat holds the message's escaped bytes as '?' (trace-cmd prints it raw).
    let mut in_dat = FORGED.as_bytes().to_vec();
    assert_eq!(
        hyptrace_output::tracedat::sanitize_guest_string(&mut in_dat),
        7
    );
    let in_dat = hyptrace_output::escaped_guest_bytes(&in_dat);
    assert!(!in_dat.contains('\\'), "{in_dat}");
    check_forged_text(&f.report(), "report", &in_dat);
    // The live formatter (`run`).
    let printers = guest_printers();
    let mut live = String::from("cpus=1\n");
    let mut recs = f.records();
    while let Some(item) = recs.next_item() {
        if let TraceItem::Event(r) = item {
            format_guest_line(&mut live, &printers, &meta.cmdlines, 0, r.ts_ns, r.payload);
            live.push('\n');
        }
    }
    check_forged_text(&live, "run", &in_dat);
    // JSON: valid, and the message exact.
    let js = dir.join("t.json");
    let mut sink: Box<dyn PageSink> = Box::new(JsonSink::create(&js, meta.clone()).unwrap());
    for (p, m) in &pages {
        sink.page(0, p, *m).unwrap();
    }
    sink.finish(&RunSummary::default()).unwrap();
    let raw = std::fs::read_to_string(&js).unwrap();
    let v: serde_json::Value = serde_json::from_str(&raw).unwrap();
    let msgs: Vec<_> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "text")
        .map(|e| e["args"]["msg"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(msgs, vec![FORGED.to_string()]);
    assert!(!raw.lines().any(|l| l.starts_with("CPU:")));
}

#[test]
fn escape_guest_str_for_panic_messages() {
    assert_eq!(escape_guest_str("plain \\ text"), "plain \\ text");
    assert!(matches!(
        escape_guest_str("plain"),
        std::borrow::Cow::Borrowed(_)
    ));
    assert_eq!(
        escape_guest_str("boom\x1b[2J\n\tat\u{7f}\u{85}\u{2028}x"),
        "boom\\x1b[2J\\n\\tat\\x7f\\x85\\u{2028}x"
    );
    assert_eq!(escaped_guest_bytes(b"a\xffb\xc3"), "a\\xffb\\xc3");
    assert_eq!(escaped_guest_bytes("é ü".as_bytes()), "é ü");
}

/// Bytes written into a shared buffer, and how many there were when `finish` began.
#[derive(Clone, Default)]
struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Shared {
    fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

/// Issue 10: a CPU that delivers no page used to make the text sink hold every other
/// CPU's lines until `finish` (memory growing with the guest's output). Now the sink
/// keeps within `MergeWindow::DEFAULT`, like `hyptrace run`: past it, a marker line
/// naming the silent CPU, then the oldest lines; everything is written once.
#[test]
fn text_sink_is_bounded_when_a_cpu_is_silent() {
    const N: u64 = 300_000; // > MergeWindow::DEFAULT.events lines
    let meta = TraceMeta::guest(4096, 2, Clock::nanoseconds());
    let out = Shared::default();
    let mut sink: Box<dyn PageSink> =
        Box::new(TextSink::to_writer(Box::new(out.clone()), meta).unwrap());
    let mut b = PageBuilder::new(4096);
    let mut most_unwritten = 0u64;
    for i in 0..N {
        b.push(1_000 + i * 10, &marker(0, i, i));
        if b.pages.len() > 8 {
            for (p, m) in std::mem::take(&mut b.pages) {
                sink.page(0, &p, m).unwrap();
            }
            let written_lines = out.text().lines().count() as u64;
            most_unwritten = most_unwritten.max(i.saturating_sub(written_lines));
        }
    }
    for (p, m) in b.finish() {
        sink.page(0, &p, m).unwrap();
    }
    let before_finish = out.len();
    assert!(before_finish > 0, "nothing written before finish");
    assert!(
        most_unwritten <= MergeWindow::DEFAULT.events as u64 + 2000,
        "held {most_unwritten} lines"
    );
    sink.finish(&RunSummary::default()).unwrap();
    let text = out.text();
    let markers: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("hyptrace: merge window exceeded:"))
        .collect();
    assert!(!markers.is_empty());
    assert!(markers.iter().all(|l| l.contains("cpu 1")), "{markers:?}");
    assert_eq!(
        text.lines().count() as u64,
        1 + N + markers.len() as u64,
        "every line once"
    );
    // The lines stay in time order (one CPU).
    let seqs: Vec<u64> = text
        .lines()
        .filter_map(|l| l.split("seq=").nth(1)?.split(' ').next()?.parse().ok())
        .collect();
    assert_eq!(seqs, (0..N).collect::<Vec<_>>());
}

/// Integers a JavaScript viewer cannot hold exactly (above 2^53 − 1) are written as
/// decimal strings in the args; smaller ones stay numbers; a span's duration is taken
/// from the field, not from the (string) arg.
#[test]
fn chrome_json_big_integers_as_strings() {
    let dir = scratch_dir("json-big");
    let path = dir.join("t.json");
    let meta = TraceMeta::guest(4096, 1, Clock::nanoseconds());
    let mut b = PageBuilder::new(4096);
    let safe = JSON_MAX_SAFE_INTEGER;
    b.push(1_000, &marker(0, 1, safe));
    b.push(2_000, &marker(0, 2, safe + 1));
    b.push(3_000, &marker(0, u64::MAX, u64::MAX));
    b.push(10_000, &span(0, 4, u64::MAX, 4_000));
    let mut sink: Box<dyn PageSink> = Box::new(JsonSink::create(&path, meta).unwrap());
    for (p, m) in b.finish() {
        sink.page(0, &p, m).unwrap();
    }
    sink.finish(&RunSummary::default()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let evs = v["traceEvents"].as_array().unwrap();
    let m: Vec<_> = evs.iter().filter(|e| e["name"] == "marker").collect();
    assert_eq!(m.len(), 3);
    assert_eq!(m[0]["args"]["value"], serde_json::json!(safe));
    assert_eq!(m[0]["args"]["seq"], serde_json::json!(1));
    assert_eq!(m[1]["args"]["value"], serde_json::json!("9007199254740992"));
    assert_eq!(
        m[2]["args"]["value"],
        serde_json::json!("18446744073709551615")
    );
    assert_eq!(
        m[2]["args"]["seq"],
        serde_json::json!("18446744073709551615")
    );
    let s = evs.iter().find(|e| e["ph"] == "X").unwrap();
    assert_eq!(s["args"]["id"], serde_json::json!("18446744073709551615"));
    assert_eq!(s["args"]["dur"], serde_json::json!(4000));
    assert_eq!(s["dur"].as_f64().unwrap(), 4.0);
    assert_eq!(s["ts"].as_f64().unwrap(), 6.0);
    // Every number in the file is exact in a double.
    let raw = std::fs::read_to_string(&path).unwrap();
    assert!(!raw.contains(":18446744073709551615"), "{raw}");
}

/// Two CPUs' events in the same nanosecond of the display clock, their raw TSC values
/// in the opposite order of their CPUs: the text sink (`record --format text`,
/// `report` of a raw stream) orders them as the trace.dat report and the real
/// `trace-cmd report` order that file's events — lower CPU first. It ordered by the raw
/// TSC before, so `tests/convert.rs` saw the two outputs differ in runs where two
/// vCPUs' events fell into one nanosecond.
#[test]
fn text_orders_same_nanosecond_events_as_trace_cmd() {
    // 2.6 GHz: 2.6 raw ticks a nanosecond; `r` and `r + 1` show the same time.
    let clock = Clock::guest_tsc(2_600_000).unwrap();
    let r = (2_600_000u64..)
        .find(|&r| clock.to_ns(r) == clock.to_ns(r + 1))
        .unwrap();
    assert_eq!(clock.trace_cmd_ns(r), clock.trace_cmd_ns(r + 1));
    let meta = TraceMeta::guest(4096, 2, clock);
    let mut pages = Vec::new();
    for (cpu, ts) in [(0u32, r + 1), (1, r)] {
        let mut b = PageBuilder::new(4096);
        b.push(ts, &marker(cpu, cpu.into(), 7));
        for (p, m) in b.finish() {
            pages.push((cpu, p, m));
        }
    }
    let out = Shared::default();
    let mut sink: Box<dyn PageSink> =
        Box::new(TextSink::to_writer(Box::new(out.clone()), meta.clone()).unwrap());
    for (c, p, m) in &pages {
        sink.page(*c, p, *m).unwrap();
    }
    sink.finish(&RunSummary::default()).unwrap();
    let text = out.text();
    let cpus = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| l.contains("marker:"))
            .map(|l| norm(l).split(' ').nth(1).unwrap_or("").to_string())
            .collect()
    };
    assert_eq!(cpus(&text), ["[000]", "[001]"], "{text}");

    let dir = scratch_dir("tie");
    let dat = dir.path().join("tie.dat");
    let mut sink = TraceDatSink::create(&dat, meta, TraceDatVersion::V7).unwrap();
    for (c, p, m) in &pages {
        sink.page(*c, p, *m).unwrap();
    }
    Box::new(sink).finish(&RunSummary::default()).unwrap();
    let report = TraceFile::open(&dat).unwrap().report();
    assert_eq!(cpus(&report), ["[000]", "[001]"], "{report}");
    if let Some((out, err, ok)) = trace_cmd(&["report", "-t"], &dat) {
        assert!(ok, "trace-cmd report: {err}");
        assert_eq!(cpus(&out), ["[000]", "[001]"], "{out}");
    }
}
