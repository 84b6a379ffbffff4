//! End-to-end tests of `hyptrace record` and `hyptrace report` with real guests (skipped
//! without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1) and the real trace-cmd (skipped
//! with `SKIP: trace-cmd not installed` unless HYPTRACE_REQUIRE_TRACE_CMD=1): every
//! event and every field of what trace-cmd prints, drop markers with exact counts,
//! our `report` line-identical to `trace-cmd report -t`, Chrome JSON, text and raw
//! files, and bad input. Counts, order and contents — never durations.

use std::process::Output;

use hyptrace::env::{self, assert_usage_error, kvm_available, vm_lock, TempDir};
use hyptrace::model::Model;
use hyptrace::text::{check_stream, collapse_spaces, parse_all, CpuTally, Line, StreamRules};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// One CPU of `--stats`.
#[derive(Debug, Clone)]
struct CpuStats {
    written: u64,
    read: u64,
    overrun: u64,
    dropped: u64,
    lost: u64,
    pages_read: u64,
}

/// `--stats` of a run.
#[derive(Debug)]
struct Stats {
    cpus: Vec<CpuStats>,
    tsc_khz: u64,
    json: serde_json::Value,
}

impl Stats {
    fn read(&self) -> u64 {
        self.cpus.iter().map(|c| c.read).sum()
    }
}

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing or not a u64 in {v}"))
}

/// `hyptrace record -o OUT --stats S ARGS`, which must succeed.
fn record(out: &str, args: &[&str]) -> Stats {
    let dir = TempDir::new("stats");
    let stats = dir.file("stats.json");
    let mut all = vec!["record", "-o", out, "--stats", &stats];
    all.extend_from_slice(args);
    let o = env::run(BIN, &all);
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{all:?}: stderr: {err}");
    assert!(!err.contains("error"), "{all:?}: {err}");
    assert!(o.stdout.is_empty(), "{all:?}: stdout: {}", env::stdout(&o));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("JSON");
    let cpus: Vec<CpuStats> = json["cpus"]
        .as_array()
        .expect("cpus")
        .iter()
        .map(|c| CpuStats {
            written: u(c, "written"),
            read: u(c, "read"),
            overrun: u(c, "overrun"),
            dropped: u(c, "dropped"),
            lost: u(c, "lost"),
            pages_read: u(c, "pages_read"),
        })
        .collect();
    for (i, c) in cpus.iter().enumerate() {
        assert_eq!(c.written, c.read + c.lost, "cpu {i}: {json}");
        assert_eq!(c.lost, c.overrun + c.dropped, "cpu {i}: {json}");
    }
    Stats {
        cpus,
        tsc_khz: u(&json, "tsc_khz"),
        json,
    }
}

/// Runs a program that must succeed with nothing on stderr; returns stdout.
fn clean_stdout(prog: &str, args: &[&str]) -> String {
    let o: Output = env::run(prog, args);
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{prog} {args:?}: stderr: {err}");
    assert!(err.is_empty(), "{prog} {args:?}: stderr: {err}");
    env::stdout(&o)
}

/// Checks a trace.dat with the real trace-cmd and with `hyptrace report`:
/// - `trace-cmd report -t`: nothing on stderr, `cpus=N` first, no unknown or unparsed
///   event, every event of the workload with its exact fields, per CPU seq gaps equal
///   to the drop marker before them, timestamps non-decreasing, event count == sum(read);
///   per CPU: events == read, printed drops + the loss after the last page == lost;
/// - `trace-cmd report` (µs) prints the same events;
/// - `trace-cmd dump --summary` succeeds and shows the version and page size;
/// - `hyptrace report -i F` prints the same lines as `trace-cmd report -t`.
fn check_dat(path: &str, s: &Stats, workload: &str, version: u32, page: u64, what: &str) {
    let tc = clean_stdout("trace-cmd", &["report", "-t", "-i", path]);
    assert!(
        tc.starts_with(&format!("cpus={}\n", s.cpus.len())),
        "{what}"
    );
    assert!(!tc.contains("[UNKNOWN EVENT]"), "{what}");
    assert!(!tc.contains("FAILED TO PARSE"), "{what}");
    let lines = parse_all(&tc, what);
    let rules = StreamRules {
        cpus: s.cpus.len() as u32,
        workload: Some(workload.to_string()),
        merged: true,
    };
    let tally = check_stream(&lines, &rules);
    // Events, not counting the carriers of trailing losses.
    let events = lines
        .iter()
        .filter(|l| matches!(l, Line::Event(e) if e.name != "trailing_lost"))
        .count() as u64;
    assert_eq!(
        events,
        s.read(),
        "{what}: events printed != sum(read): {}",
        s.json
    );
    check_tally(&tally, s, what);

    // Without -t: µs timestamps, same events in the same order.
    let tc_us = clean_stdout("trace-cmd", &["report", "-i", path]);
    let us = parse_all(&tc_us, what);
    assert_eq!(
        check_stream(&us, &rules),
        tally,
        "{what}: report vs report -t"
    );
    assert_eq!(us.len(), lines.len(), "{what}");
    for (a, b) in us.iter().zip(&lines) {
        match (a, b) {
            (Line::Event(a), Line::Event(b)) => {
                assert_eq!(
                    (a.cpu, &a.name, &a.fields),
                    (b.cpu, &b.name, &b.fields),
                    "{what}"
                );
                // trace-cmd rounds ns to the nearest µs.
                assert_eq!(
                    a.ts_ns,
                    (b.ts_ns + 500) / 1000 * 1000,
                    "{what}: {a:?} vs {b:?}"
                );
            }
            (a, b) => assert_eq!(a, b, "{what}"),
        }
    }

    let dump = clean_stdout("trace-cmd", &["dump", "--summary", "-i", path]);
    assert!(
        dump.contains(&format!("{version}\t[Version]")),
        "{what}: {dump}"
    );
    assert!(
        dump.contains(&format!("{page}\t[Page size, bytes]")),
        "{what}: {dump}"
    );

    let ours = clean_stdout(BIN, &["report", "-i", path]);
    let a: Vec<String> = tc.lines().map(collapse_spaces).collect();
    let b: Vec<String> = ours.lines().map(collapse_spaces).collect();
    assert_eq!(a.len(), b.len(), "{what}: hyptrace report line count");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x, y, "{what}: line {}: trace-cmd vs hyptrace report", i + 1);
    }
}

/// Per CPU: events == read, and the printed drop markers sum to `lost` exactly —
/// trailing losses included (every format shows them, issue 9): the markers after the
/// CPU's last event account for every event attempted after it.
fn check_tally(tally: &[CpuTally], s: &Stats, what: &str) {
    for (i, (t, c)) in tally.iter().zip(&s.cpus).enumerate() {
        assert_eq!(t.events, c.read, "{what}: cpu {i}: {t:?}: {}", s.json);
        assert_eq!(t.dropped, c.lost, "{what}: cpu {i}: {t:?}: {}", s.json);
        let after_last = c.written - t.last_seq.map_or(0, |l| l + 1);
        assert_eq!(t.trailing, after_last, "{what}: cpu {i}: {t:?}: {}", s.json);
        if c.overrun > 0 && c.dropped == 0 {
            // Overwrite mode keeps the newest events.
            assert_eq!(after_last, 0, "{what}: cpu {i}");
        }
    }
}

/// `record` of real guest runs into trace.dat v6, v7 (zstd, the default) and v7
/// `--compression none`, both modes, 4 KiB and 16 KiB pages, the mixed workload, 2 and 3
/// vCPUs, a 4-page buffer read only at the end (`--drain none`: losses on every CPU
/// whatever the scheduling — a live reader can keep up with a short run), read back by
/// trace-cmd and by `hyptrace report`.
#[test]
fn record_trace_dat_matrix() {
    if !kvm_available(KRATE, "record_trace_dat_matrix") || !env::trace_cmd_available() {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("dat");
    for mode in ["overwrite", "stop"] {
        for (page, buffer, vcpus) in [("4096", "16", "2"), ("16384", "64", "3")] {
            for (format, version, compression) in
                [("dat6", 6, "none"), ("dat", 7, "zstd"), ("dat", 7, "none")]
            {
                let what = format!(
                    "--mode {mode} --page-size {page} --format {format} --compression {compression}"
                );
                let path = dir.file(&format!("{mode}-{page}-{format}-{compression}.dat"));
                let z: &[&str] = if format == "dat" && compression == "none" {
                    &["--compression", "none"]
                } else {
                    &[]
                };
                let s = record(
                    &path,
                    &[
                        z,
                        &[
                            "--format",
                            format,
                            "--vcpus",
                            vcpus,
                            "--mode",
                            mode,
                            "--page-size",
                            page,
                            "--buffer-kb",
                            buffer,
                            "--workload",
                            "mixed",
                            "--events",
                            "6000",
                            "--rate",
                            "0",
                            "--drain",
                            "none",
                        ],
                    ]
                    .concat(),
                );
                for (i, c) in s.cpus.iter().enumerate() {
                    assert!(c.lost > 0, "{what}: cpu {i} lost nothing: {}", s.json);
                    assert!(c.read > 0, "{what}: cpu {i} read nothing: {}", s.json);
                }
                check_dat(&path, &s, "mixed", version, page.parse().unwrap(), &what);
                if version == 7 {
                    // zstd by default, like trace-cmd record.
                    let dump = clean_stdout("trace-cmd", &["dump", "--summary", "-i", &path]);
                    assert!(
                        dump.contains(&format!("{compression}\t[Compression algorithm]")),
                        "{what}: {dump}"
                    );
                }
            }
        }
    }
    assert!(
        dir.entries()
            .iter()
            .all(|e| e.ends_with(".dat") && !e.starts_with('.')),
        "leftover files: {:?}",
        dir.entries()
    );
}

/// The acceptance: `hyptrace record -o F --vcpus 2 --events 50000` (default
/// rate, mode and buffer), then `trace-cmd report -i F` prints the 100000 events with
/// the right fields, and `hyptrace report -i F` prints the same lines as
/// `trace-cmd report -t -i F`.
#[test]
fn acceptance_record_2_vcpus_50000_events() {
    if !kvm_available(KRATE, "acceptance_record_2_vcpus_50000_events")
        || !env::trace_cmd_available()
    {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("acceptance");
    let path = dir.file("trace.dat");
    // Lossless needs the reader to get a core in time (the default ring holds ~0.2 s of
    // the default rate): one of three runs on a machine loaded by something else.
    let mut attempt = 0;
    let s = loop {
        attempt += 1;
        let s = record(&path, &["--vcpus", "2", "--events", "50000"]);
        if attempt < 3 && s.cpus.iter().any(|c| c.lost > 0) {
            for c in &s.cpus {
                assert_eq!(c.written, c.read + c.lost, "{}", s.json);
            }
            eprintln!("attempt {attempt} lost events (machine busy?): {}", s.json);
            std::thread::sleep(std::time::Duration::from_millis(500));
            continue;
        }
        break s;
    };
    for (i, c) in s.cpus.iter().enumerate() {
        assert_eq!(
            (c.written, c.read, c.lost),
            (50000, 50000, 0),
            "cpu {i}: {}",
            s.json
        );
    }
    let tc = clean_stdout("trace-cmd", &["report", "-i", &path]);
    let lines = parse_all(&tc, "trace-cmd report");
    let tally = check_stream(
        &lines,
        &StreamRules {
            cpus: 2,
            workload: Some("steady".into()),
            merged: true,
        },
    );
    let events = lines.iter().filter(|l| matches!(l, Line::Event(_))).count();
    assert_eq!(events, 100_000);
    for t in &tally {
        assert_eq!((t.events, t.dropped, t.last_seq), (50000, 0, Some(49_999)));
    }
    check_dat(&path, &s, "steady", 7, 4096, "acceptance");
}

/// An integer arg of Chrome JSON: a number up to 2^53 − 1, the decimal digits in a
/// string above (JavaScript viewers would round it).
fn json_int(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Number(n) => {
            let x = n.as_u64().expect("unsigned");
            assert!(x < 1 << 53, "{x} above 2^53 - 1 as a number");
            x.to_string()
        }
        serde_json::Value::String(s) => {
            let x: u64 = s.parse().expect("decimal digits");
            assert!(x >= 1 << 53, "{x} fits a double but is a string");
            x.to_string()
        }
        v => panic!("not an integer: {v}"),
    }
}

/// The args of a Chrome JSON event as `trace-cmd report` would print its fields.
fn json_fields(name: &str, args: &serde_json::Value) -> String {
    let i = |k: &str| json_int(&args[k]);
    match name {
        "marker" => format!("seq={} value={}", i("seq"), i("value")),
        "span" => format!("seq={} id={} dur={}", i("seq"), i("id"), i("dur")),
        "text" => format!(
            "seq={} msg={}",
            i("seq"),
            args["msg"].as_str().expect("msg is a string")
        ),
        n => panic!("unexpected event {n}"),
    }
}

/// Chrome trace-event JSON (by extension and by --format): valid JSON, every entry has
/// ph, ts, pid, tid, name (X: dur), the exact event count, every field, `lost events`
/// with exact counts before the events after a loss, entries in time order across CPUs.
#[test]
fn record_chrome_json() {
    if !kvm_available(KRATE, "record_chrome_json") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("json");
    for (name, extra) in [("t.json", &[][..]), ("t.out", &["--format", "json"][..])] {
        let path = dir.file(name);
        let mut args = vec![
            "--vcpus",
            "2",
            "--workload",
            "mixed",
            "--events",
            "5000",
            "--rate",
            "0",
            "--buffer-kb",
            "16",
            // The newest ring-full, read at the end: every CPU loses its first events
            // (a `lost events` entry before its first event) whatever the scheduling.
            "--mode",
            "overwrite",
            "--drain",
            "none",
        ];
        args.extend_from_slice(extra);
        let s = record(&path, &args);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("JSON");
        assert_eq!(v["displayTimeUnit"], "ns", "{name}");
        let evs = v["traceEvents"].as_array().expect("traceEvents");
        let mut models: Vec<Model> = (0..2).map(|c| Model::new("mixed", c)).collect();
        let mut next = [0u64; 2];
        let mut pending = [0u64; 2];
        let mut printed_lost = [0u64; 2];
        let mut events = [0u64; 2];
        let mut threads = Vec::new();
        // Time order across CPUs: an entry sorts at `ts`, a span (`X`) at its end.
        let mut prev_ns = 0u64;
        for e in evs {
            for k in ["ph", "ts", "pid", "tid", "name"] {
                assert!(e.get(k).is_some(), "{name}: {k} missing in {e}");
            }
            assert!(e["ts"].is_number(), "{name}: {e}");
            if e["ph"] != "M" {
                let ns =
                    |v: &serde_json::Value| (v.as_f64().expect("number") * 1000.0).round() as u64;
                let at = ns(&e["ts"]) + if e["ph"] == "X" { ns(&e["dur"]) } else { 0 };
                assert!(at >= prev_ns, "{name}: time goes back at {e}");
                prev_ns = at;
            }
            assert_eq!(e["pid"], 1, "{name}: {e}");
            let tid = e["tid"].as_u64().expect("tid") as usize;
            assert!(tid < 2, "{name}: {e}");
            let ph = e["ph"].as_str().expect("ph");
            let ev_name = e["name"].as_str().expect("name");
            match (ph, ev_name) {
                ("M", "process_name") => {
                    // The name Perfetto's process track has too.
                    assert_eq!(e["args"]["name"], "hyptrace guest", "{name}");
                }
                ("M", "thread_name") => {
                    assert_eq!(e["args"]["name"], format!("vcpu{tid}"), "{name}");
                    threads.push(tid);
                }
                ("i", "lost events") => {
                    let n = e["args"]["count"].as_u64().expect("count");
                    assert!(n > 0, "{name}: {e}");
                    pending[tid] += n;
                    printed_lost[tid] += n;
                }
                ("i", "marker") | ("i", "text") | ("X", "span") => {
                    if ph == "X" {
                        // dur: the span's TSC cycles in µs (3 decimals).
                        let cycles = e["args"]["dur"].as_u64().expect("dur arg") as f64;
                        let us = e["dur"].as_f64().expect("dur");
                        let want = cycles * 1000.0 / s.tsc_khz as f64;
                        assert!((us - want).abs() < 0.0015, "{name}: {e}: want {want}");
                    } else {
                        assert_eq!(e["s"], "t", "{name}: {e}");
                    }
                    let seq = e["args"]["seq"].as_u64().expect("seq");
                    assert_eq!(seq, next[tid] + pending[tid], "{name}: cpu {tid}: {e}");
                    pending[tid] = 0;
                    next[tid] = seq + 1;
                    let want = models[tid].at(seq);
                    assert_eq!(ev_name, want.name, "{name}: {e}");
                    assert_eq!(json_fields(ev_name, &e["args"]), want.fields, "{name}: {e}");
                    events[tid] += 1;
                }
                _ => panic!("{name}: unexpected entry {e}"),
            }
        }
        threads.sort_unstable();
        assert_eq!(threads, vec![0, 1], "{name}");
        for (i, c) in s.cpus.iter().enumerate() {
            assert_eq!(events[i], c.read, "{name}: cpu {i}: {}", s.json);
            assert!(c.lost > 0, "{name}: cpu {i}: {}", s.json);
            let after_last = c.written - next[i];
            assert_eq!(printed_lost[i] + after_last, c.lost, "{name}: cpu {i}");
        }
    }
}

/// `--format text` / `.txt`: `cpus=N` then the events as `trace-cmd report -t` prints
/// them (pages in arrival order: time order per CPU); `--format raw` / `.raw` parses
/// with `RawTrace::parse`, holds every page and event read, its end record carries the
/// run's counts, and it replays into a text file with the same events.
#[test]
fn record_text_and_raw() {
    use hyptrace_output::{PageSink, RawTrace, StreamSink, TextSink, TraceMeta};

    if !kvm_available(KRATE, "record_text_and_raw") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("text-raw");
    let base = [
        "--vcpus",
        "2",
        "--workload",
        "mixed",
        "--events",
        "5000",
        "--rate",
        "0",
        "--buffer-kb",
        "16",
        "--mode",
        "stop",
    ];
    let rules = StreamRules {
        cpus: 2,
        workload: Some("mixed".into()),
        merged: false,
    };
    let check_text = |text: &str, s: &Stats, what: &str| {
        assert!(text.starts_with("cpus=2\n"), "{what}");
        let lines = parse_all(text, what);
        let tally = check_stream(&lines, &rules);
        check_tally(&tally, s, what);
    };
    for (name, extra) in [("t.txt", &[][..]), ("t.log", &["--format", "text"][..])] {
        let path = dir.file(name);
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let s = record(&path, &args);
        check_text(&std::fs::read_to_string(&path).expect("text"), &s, name);
    }
    for (name, extra) in [("t.raw", &[][..]), ("t.bin", &["--format", "raw"][..])] {
        let path = dir.file(name);
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let s = record(&path, &args);
        let raw = RawTrace::parse(&std::fs::read(&path).expect("raw")).expect("raw parses");
        assert_eq!((raw.page_size, raw.nr_cpus), (4096, 2), "{name}");
        for cpu in 0..2u32 {
            let c = &s.cpus[cpu as usize];
            let pages: Vec<&Vec<u8>> = raw
                .pages
                .iter()
                .filter(|(pc, _)| *pc == cpu)
                .map(|(_, p)| p)
                .collect();
            // An event-less page carries a trailing loss (at most one per CPU, last).
            let len = |p: &Vec<u8>| {
                u64::from_le_bytes(p[8..16].try_into().unwrap())
                    & hyptrace_abi::page::COMMIT_LEN_MASK
            };
            let carriers = pages.iter().filter(|p| len(p) == 0).count();
            assert!(carriers <= 1, "{name}: cpu {cpu}: {carriers} empty pages");
            if carriers == 1 {
                assert_eq!(len(pages[pages.len() - 1]), 0, "{name}: cpu {cpu}");
            }
            assert_eq!(
                (pages.len() - carriers) as u64,
                c.pages_read,
                "{name}: cpu {cpu}: {}",
                s.json
            );
            let mut events = 0u64;
            for p in pages {
                let len = (u64::from_le_bytes(p[8..16].try_into().unwrap())
                    & hyptrace_abi::page::COMMIT_LEN_MASK) as usize;
                let ts = u64::from_le_bytes(p[..8].try_into().unwrap());
                for e in hyptrace_abi::page::Events::new(&p[16..16 + len], ts) {
                    e.unwrap_or_else(|err| panic!("{name}: {err}"));
                    events += 1;
                }
            }
            assert_eq!(events, c.read, "{name}: cpu {cpu}");
            let sum = raw.summary.as_ref().expect("end record");
            let st = &sum.cpus[cpu as usize];
            assert_eq!(st.read_events, c.read, "{name}: cpu {cpu}");
            assert_eq!(st.overrun, c.overrun, "{name}: cpu {cpu}");
            assert_eq!(st.dropped_events, c.dropped, "{name}: cpu {cpu}");
        }
        // Replay into a text file: the same events, every field.
        let text_path = dir.path().join(format!("{name}.replayed.txt"));
        let sink = TextSink::create(
            &text_path,
            TraceMeta::guest(raw.page_size, raw.nr_cpus, raw.clock.clone()),
        )
        .expect("text sink");
        raw.replay(Box::new(sink) as Box<dyn PageSink>)
            .expect("replay");
        check_text(
            &std::fs::read_to_string(&text_path).expect("replayed"),
            &s,
            name,
        );
    }
}

/// `report -i` a missing file, a directory, a bad magic or version: exit 2, one clear
/// error line, no panic, nothing on stdout; truncated or garbled trace.dat files: exit 1,
/// damaged.
#[test]
fn report_bad_input_exit_2() {
    let dir = TempDir::new("report-bad");
    usage(&["report", "-i", &dir.file("missing.dat")], "No such file");
    usage(&["report", "-i", dir.path().to_str().unwrap()], "directory");
    // A real trace.dat (written by the output crate, no VM needed).
    let good = dir.file("good.dat");
    write_small_dat(&good);
    let ok = env::run(BIN, &["report", "-i", &good]);
    assert_eq!(ok.status.code(), Some(0), "{}", env::stderr(&ok));
    let bytes = std::fs::read(&good).expect("read");
    let put = |name: &str, b: &[u8]| {
        let p = dir.file(name);
        std::fs::write(&p, b).expect("write");
        p
    };
    // Too short to hold the magic: not a trace.dat (bad input).
    for n in [0, 1, 3] {
        let p = put(&format!("trunc-{n}.dat"), &bytes[..n]);
        usage(&["report", "-i", &p], "");
    }
    // A trace.dat cut short is damaged: exit 1, what is readable printed, no panic.
    for n in [10, 11, 100, 1000, bytes.len() / 2, bytes.len() - 1] {
        let p = put(&format!("trunc-{n}.dat"), &bytes[..n]);
        damaged(&["report", "-i", &p]);
    }
    let mut bad_magic = bytes.clone();
    bad_magic[..3].copy_from_slice(b"XYZ");
    usage(
        &["report", "-i", &put("magic.dat", &bad_magic)],
        "not a trace.dat",
    );
    let mut bad_version = bytes.clone();
    bad_version[10] = b'9';
    usage(&["report", "-i", &put("version.dat", &bad_version)], "");
    let mut garbage = bytes[..10].to_vec();
    garbage.extend((0..5000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    damaged(&["report", "-i", &put("garbage.dat", &garbage)]);
    usage(
        &["report", "-i", &put("text.dat", b"cpus=2\nnot a trace\n")],
        "",
    );
}

/// A damaged trace.dat: exit 1 naming it damaged, no panic (docs/output.md "Damaged files").
fn damaged(args: &[&str]) {
    let o = env::run(BIN, args);
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
    assert!(err.contains("damaged trace.dat"), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

fn usage(args: &[&str], needle: &str) {
    let o = env::run(BIN, args);
    assert_usage_error(&o, &format!("{args:?}"), needle);
}

/// A small valid trace.dat (v6, one page of one marker per CPU) through the output
/// crate's sink.
fn write_small_dat(path: &str) {
    use hyptrace_output::{Clock, PageSink, RunSummary, TraceDatSink, TraceDatVersion, TraceMeta};
    let meta = TraceMeta::guest(4096, 2, Clock::guest_tsc(2_000_000).expect("clock"));
    let mut sink =
        TraceDatSink::create(std::path::Path::new(path), meta, TraceDatVersion::V6).expect("sink");
    for cpu in 0..2u32 {
        let mut page = vec![0u8; 4096];
        page[..8].copy_from_slice(&1_000_000u64.to_le_bytes());
        let payload = hyptrace_abi::events::marker(hyptrace_abi::events::vcpu_pid(cpu), 0, 0);
        // One small-data record: type_len = payload words, delta 0.
        let words = payload.len().div_ceil(4);
        page[16..20].copy_from_slice(&(words as u32).to_le_bytes());
        page[20..20 + payload.len()].copy_from_slice(&payload);
        page[8..16].copy_from_slice(&(4 + 4 * words as u64).to_le_bytes());
        sink.page(cpu, &page, hyptrace_output::Missed::None)
            .expect("page");
    }
    Box::new(sink)
        .finish(&RunSummary { cpus: Vec::new() })
        .expect("finish");
}

/// `record -o` into a missing directory, under /proc and /sys (no file can be created
/// there, even as root), and onto an existing directory (the rename fails at the end):
/// a clear one-line error, non-zero exit, no file at the final path and no temporary
/// file left next to it.
#[test]
fn record_bad_output_paths() {
    if !kvm_available(KRATE, "record_bad_output_paths") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("bad-out");
    let run = ["--vcpus", "2", "--events", "2000"];
    for (out, code) in [
        (dir.file("missing/t.dat"), 2),
        (dir.file("missing/t.json"), 2),
        ("/proc/hyptrace-it-t.dat".to_string(), 2),
        ("/sys/hyptrace-it-t.json".to_string(), 2),
    ] {
        let mut args = vec!["record", "-o", &out];
        args.extend_from_slice(&run);
        let o = env::run(BIN, &args);
        let err = env::stderr(&o);
        assert_eq!(o.status.code(), Some(code), "{out}: {err}");
        assert_eq!(err.lines().count(), 1, "{out}: {err}");
        assert!(
            err.starts_with("hyptrace: error: cannot write "),
            "{out}: {err}"
        );
        assert!(err.contains(&out), "{out}: {err}");
        assert!(!err.contains("panicked"), "{out}: {err}");
        assert!(!std::path::Path::new(&out).exists(), "{out}");
    }
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
    // An existing directory at the output path: the run happens, the final rename fails.
    let target = dir.file("outdir");
    std::fs::create_dir(&target).expect("mkdir");
    for format in ["dat", "dat6", "json", "text", "raw"] {
        let mut args = vec!["record", "-o", &target, "--format", format];
        args.extend_from_slice(&run);
        let o = env::run(BIN, &args);
        let err = env::stderr(&o);
        assert_ne!(o.status.code(), Some(0), "{format}: {err}");
        assert!(
            err.lines()
                .any(|l| l.starts_with("hyptrace: error: ") && l.contains(&target)),
            "{format}: {err}"
        );
        assert!(!err.contains("panicked"), "{format}: {err}");
        assert!(std::path::Path::new(&target).is_dir(), "{format}");
        assert_eq!(
            dir.entries(),
            vec!["outdir".to_string()],
            "{format}: leftovers"
        );
        assert!(
            std::fs::read_dir(&target).unwrap().next().is_none(),
            "{format}"
        );
    }
}

/// The events of a filtered recording as `tool` reads `path`: every one passes the -F
/// of [`record_filters_keep_what_passes_and_account_for_the_rest`]; returns (events,
/// the sum of the drop markers).
fn filtered_events(tool: &str, path: &str, what: &str) -> (u64, u64) {
    let text = clean_stdout(tool, &["report", "-t", "-i", path]);
    let (mut events, mut drops) = (0, 0);
    for line in parse_all(&text, what) {
        match line {
            Line::Event(e) if e.name == "trailing_lost" => {}
            Line::Event(e) => {
                let seq: u64 = e
                    .fields
                    .strip_prefix("seq=")
                    .and_then(|f| f.split(' ').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("{what}: {e:?}"));
                let passes = e.name == "text" || (e.name == "marker" && seq >= 100);
                assert!(passes, "{what}: the filter should have dropped {e:?}");
                events += 1;
            }
            Line::Drop { count, .. } => drops += count.expect("a counted drop"),
            Line::Cpus(_) | Line::WindowExceeded => {}
        }
    }
    (events, drops)
}

/// `record -F` (issue 39): trace.dat (read by trace-cmd and by `hyptrace report`), a
/// raw stream and text hold only the events the filters pass; `--stats` and the summary
/// account for every event read: kept + dropped by the filter = read, kept = the
/// output's events, and the losses (a 16 KiB stop-mode ring read only at the end) are
/// still all shown, as drop markers summing to `lost`. An unknown field is exit 2 with
/// no output; a filter that passes nothing says so.
#[test]
fn record_filters_keep_what_passes_and_account_for_the_rest() {
    if !kvm_available(
        KRATE,
        "record_filters_keep_what_passes_and_account_for_the_rest",
    ) {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("record-f");
    let args = [
        "--vcpus",
        "2",
        "--workload",
        "mixed",
        "--events",
        "3000",
        "--rate",
        "0",
        "--buffer-kb",
        "16",
        "--mode",
        "stop",
        "--drain",
        "none",
        "-F",
        "marker: seq >= 100",
        "-F",
        "text",
    ];
    for (ext, tools) in [
        ("dat", &["trace-cmd", BIN][..]),
        ("raw", &[BIN][..]),
        ("txt", &[][..]),
    ] {
        let out = dir.file(&format!("f.{ext}"));
        let s = record(&out, &args);
        let f = &s.json["filter"];
        let (kept, dropped) = (u(f, "kept"), u(f, "dropped"));
        assert_eq!(kept + dropped, s.read(), "{ext}: {}", s.json);
        assert!(kept > 0 && dropped > 0, "{ext}: {}", s.json);
        assert_eq!(f["unmatched"], serde_json::json!([]), "{ext}");
        let lost: u64 = s.cpus.iter().map(|c| c.lost).sum();
        assert!(lost > 0, "{ext}: no loss to account for: {}", s.json);
        for tool in tools {
            if *tool == "trace-cmd" && !env::trace_cmd_available() {
                continue;
            }
            let what = format!("{ext} read by {tool}");
            assert_eq!(filtered_events(tool, &out, &what), (kept, lost), "{what}");
        }
        if ext == "txt" {
            let text = std::fs::read_to_string(&out).expect("text output");
            let events = parse_all(&text, ext)
                .iter()
                .filter(|l| matches!(l, Line::Event(_)))
                .count() as u64;
            assert_eq!(events, kept, "{ext}");
        }
    }
    let out = dir.file("bad.dat");
    let o = env::run(
        BIN,
        &[
            "record",
            "--events",
            "10",
            "-F",
            "marker: nope > 1",
            "-o",
            &out,
        ],
    );
    assert_usage_error(&o, "unknown field", "has no field `nope`");
    assert!(!std::path::Path::new(&out).exists());
    let o = env::run(
        BIN,
        &[
            "record",
            "--events",
            "10",
            "-F",
            "marker: seq > 99",
            "-o",
            &out,
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let err = env::stderr(&o);
    assert!(
        err.contains("-F 'marker: seq > 99' matched no event of the run")
            && err.contains(
                "hyptrace: -F kept 0 of the 20 events read (20 dropped by the filter, not lost)"
            ),
        "{err}"
    );
}

/// A soft limit on open files too low for a trace.dat of 8 vCPUs (their descriptors, a
/// spill file each, and each output file's writer thread and `O_DIRECT` descriptor) is
/// raised to the hard limit at start: the record succeeds where, before the raise, it
/// failed with "Too many open files" below a soft limit of 29.
#[test]
fn a_low_soft_limit_on_open_files_is_raised() {
    if !kvm_available(KRATE, "a_low_soft_limit_on_open_files_is_raised") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("nofile");
    let path = dir.file("t.dat");
    let cmd = format!("ulimit -Sn 24 && exec {BIN} record --vcpus 8 --events 20000 -o {path}");
    let o = std::process::Command::new("sh")
        .args(["-c", &cmd])
        .output()
        .expect("sh");
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("Too many open files"), "{err}");
    assert!(
        err.contains("written 160000 = read 160000 + lost 0"),
        "{err}"
    );
}
