//! The same guest event prints the same line everywhere (issue 10): `hyptrace run`
//! (the host's session with text output: its merger and formatter), `record --format
//! text` (the text sink) and `record` + `report` (trace.dat written by the sink, read
//! back by `TraceFile`). One merger (`hyptrace_output::Merger`) and one line formatter
//! (`format_guest_line`, `format_drop`) serve all three. One difference by design (G2 in
//! docs/design.md): the bytes of a guest string the text escapes are `?` in trace.dat,
//! so `report` prints those messages sanitized.
//!
//! Every event kind: markers, spans, texts (short, 240 bytes, with control characters,
//! bidirectional controls, backslashes and bytes that are not UTF-8), an event id
//! without a format, drop markers in the middle of a run (stop mode, ring full, then
//! read) and after the last page (trailing losses), ties in time across CPUs. The
//! heap part needs no VM; the VM part (`--workload mixed --mode stop` through the real
//! binary) is skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1.

use hyptrace::capture::Captured;
use std::sync::Arc;

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};
use hyptrace_abi::events::{marker, span, text, vcpu_pid};
use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::HeapMem;
use hyptrace_host::drain::session::{Output, Session};
use hyptrace_output::{
    Clock, PageSink, RunSummary, StreamSink, TextSink, TraceDatSink, TraceDatVersion, TraceFile,
    TraceMeta,
};
use hyptrace_reader::{Direct, RingBuffer};
use hyptrace_writer::{WriteOutcome, Writer};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

type Mem = Arc<HeapMem>;

const CPUS: u32 = 2;
const PAGES: u32 = 4;
const PAGE_SIZE: usize = 4096;
/// A guest TSC of 2.9184 GHz (a conversion with a remainder).
const TSC_KHZ: u64 = 2_918_400;
/// An event id without a format.
const UNKNOWN_ID: u16 = 4242;

fn clock() -> Clock {
    Clock::guest_tsc(TSC_KHZ).expect("clock")
}

/// The messages of the `text` events: short, escaped, long.
fn messages() -> Vec<Vec<u8>> {
    let mut long: Vec<u8> = (0..240u32).map(|i| b'a' + (i % 26) as u8).collect();
    long[100] = b'\\';
    vec![
        b"hello".to_vec(),
        b"two\nlines\tand \"quotes\" and a \\ backslash".to_vec(),
        b"\x1b[31mred\x1b[0m \x7f del".to_vec(),
        "bidi \u{202e}olleh\u{202c} sep\u{2028}x c1\u{85}"
            .as_bytes()
            .to_vec(),
        b"not utf-8: \xff\xfe\xc3(".to_vec(),
        long,
    ]
}

/// One event of the script: `(cpu, kind)`; the payloads are built from it.
fn payload(cpu: u32, seq: u64) -> Vec<u8> {
    let pid = vcpu_pid(cpu);
    let msgs = messages();
    match seq % 9 {
        0 | 4 | 7 => marker(pid, seq, seq * 3).to_vec(),
        1 | 5 => span(pid, seq, seq % 5, 1000 + seq).to_vec(),
        3 => {
            // An id without a format: the common header and some bytes.
            let mut p = vec![0u8; 24];
            p[..2].copy_from_slice(&UNKNOWN_ID.to_le_bytes());
            p[4..8].copy_from_slice(&pid.to_le_bytes());
            p[8..16].copy_from_slice(&seq.to_le_bytes());
            p
        }
        _ => {
            let msg = &msgs[(seq as usize / 9) % msgs.len()];
            let mut buf = [0u8; 512];
            let n = text(&mut buf, pid, seq, msg).expect("text payload");
            buf[..n].to_vec()
        }
    }
}

/// Runs the script over a fresh heap ring into `output` and finishes the session.
/// The script is deterministic (same writes, same reads at the same points), so every
/// output sees the same pages. Returns how many events were written and dropped.
fn run_script(output: Output) -> (u64, u64) {
    let l = RingGeometry::new(CPUS, PAGES, PAGE_SIZE, Mode::Stop, false).expect("layout");
    let m: Mem = Arc::new(HeapMem::new(l.region_size));
    let rb = RingBuffer::alloc(m.clone(), l, Direct::new(m.clone(), l), TSC_KHZ, 1).expect("alloc");
    let mut s = Session::new(rb, output, clock());
    let mut writers: Vec<Writer<Mem>> = (0..CPUS)
        .map(|c| Writer::attach(m.clone(), c).expect("attach"))
        .collect();
    let (mut written, mut dropped) = (0u64, 0u64);
    let mut seq = [0u64; CPUS as usize];
    // Three phases: fill past the ring (drops), read it, write again (the next page
    // carries the loss: a mid-run drop marker), read; then fill past the ring again
    // and stop (trailing losses).
    for (phase, per_cpu) in [(0u64, 400u64), (1, 150), (2, 500)] {
        for i in 0..per_cpu {
            for cpu in 0..CPUS {
                // Interleaved times, with ties across CPUs every 4th event.
                let base = 1_000_000_000 + phase * 10_000_000 + i * 2900;
                let ts = if i % 4 == 0 {
                    base
                } else {
                    base + u64::from(cpu) * 1400
                };
                let c = cpu as usize;
                let p = payload(cpu, seq[c]);
                seq[c] += 1;
                match writers[c].write(0, ts, &p) {
                    WriteOutcome::Written => written += 1,
                    WriteOutcome::Dropped => dropped += 1,
                    o => panic!("cpu {cpu}: {o:?}"),
                }
            }
        }
        if phase < 2 {
            for _ in 0..64 {
                assert!(s.service(|_| false).is_empty());
                s.flush().expect("flush");
                if !s.backlog() {
                    break;
                }
            }
        }
    }
    for w in &mut writers {
        w.finish();
    }
    assert!(s.service(|_| true).is_empty());
    s.flush().expect("flush");
    s.finish(&RunSummary::default()).expect("finish");
    (written, dropped)
}

fn meta() -> TraceMeta {
    TraceMeta::guest(PAGE_SIZE, CPUS, clock())
}

/// The event and drop-marker lines of `report`, without the `trailing_lost` records
/// trace.dat needs to carry a loss after a CPU's last page (each right after its
/// marker: checked).
fn without_trailing_records(report: &str) -> String {
    let lines: Vec<&str> = report.lines().collect();
    let mut out = String::new();
    for (i, l) in lines.iter().enumerate() {
        if l.contains(" trailing_lost: ") {
            assert!(
                i > 0 && lines[i - 1].contains("EVENTS DROPPED]"),
                "trailing_lost record without its marker: {l}"
            );
            continue;
        }
        out.push_str(l);
        out.push('\n');
    }
    out
}

#[test]
fn every_event_kind_prints_the_same_in_run_text_sink_and_report() {
    // (a) `hyptrace run`: the session's text output.
    let run = Captured::keeping();
    let (written, dropped) = run_script(Output::text(Box::new(run.clone()), CPUS));
    // (b) `record --format text`: the text sink.
    let sink_out = Captured::keeping();
    let sink = TextSink::to_writer(Box::new(sink_out.clone()), meta()).expect("text sink");
    assert_eq!(
        run_script(Output::Pages(Box::new(sink) as Box<dyn PageSink + Send>)),
        (written, dropped)
    );
    // (c) `record` + `report`: trace.dat written by the sink, read back.
    let dir = TempDir::new("same-lines");
    let dat = dir.file("t.dat");
    let sink = TraceDatSink::create(&dat, meta(), TraceDatVersion::V7).expect("trace.dat sink");
    assert_eq!(
        run_script(Output::Pages(Box::new(sink) as Box<dyn PageSink + Send>)),
        (written, dropped)
    );
    let report = TraceFile::open(&dat).expect("read back").report();

    let run = format!("cpus={CPUS}\n{}", run.text());
    let text = sink_out.text();
    let report = without_trailing_records(&report);
    // G2: trace.dat holds each string byte the text escapes as '?' (trace-cmd prints
    // strings raw), so `report` of it prints the sanitized message where `run` prints the
    // escaped one; every other byte of every line is the same.
    let mut report_want = run.clone();
    for m in messages() {
        let mut safe = m.clone();
        if hyptrace_output::tracedat::sanitize_guest_string(&mut safe) > 0 {
            report_want = report_want.replace(
                &hyptrace_output::escaped_guest_bytes(&m),
                &hyptrace_output::escaped_guest_bytes(&safe),
            );
        }
    }
    // What the script must have produced, so the comparison covers every kind.
    assert!(dropped > 0, "no drops");
    for needle in [
        ": marker: ",
        ": span: ",
        ": text: ",
        "[UNKNOWN EVENT]:      id=4242",
        "two\\nlines\\tand \"quotes\" and a \\ backslash",
        "\\x1b[31mred\\x1b[0m \\x7f del",
        "\\u{202e}olleh\\u{202c} sep\\u{2028}x c1\\x85",
        "not utf-8: \\xff\\xfe\\xc3(",
    ] {
        assert!(run.contains(needle), "run output lacks {needle:?}");
    }
    let markers: Vec<&str> = run
        .lines()
        .filter(|l| l.contains("EVENTS DROPPED"))
        .collect();
    assert!(
        markers.len() >= 2 * CPUS as usize,
        "drop markers: {markers:?}"
    );
    let last = run.lines().last().expect("lines");
    assert!(
        last.contains("EVENTS DROPPED"),
        "no trailing marker: {last}"
    );
    assert!(
        run.lines().any(|l| l.len() > 300),
        "the long text line is missing"
    );
    let sum: u64 = markers
        .iter()
        .filter_map(|l| l.split('[').nth(1)?.split(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(sum, dropped, "drop markers sum to the drops");
    assert_eq!(
        run.lines().count() as u64,
        1 + written + markers.len() as u64
    );
    // Same lines, same order, byte for byte.
    for (name, run, other) in [
        ("text sink", &run, &text),
        ("report", &report_want, &report),
    ] {
        if let Some((i, (a, b))) = run
            .lines()
            .zip(other.lines())
            .enumerate()
            .find(|(_, (a, b))| a != b)
        {
            panic!("run and {name} differ at line {i}:\n  run:   {a}\n  {name}: {b}");
        }
        assert_eq!(run.lines().count(), other.lines().count(), "{name}");
        assert_eq!(run, other, "{name}");
    }
}

/// Lines of a `hyptrace` invocation's stdout (which must succeed).
fn stdout_of(args: &[&str]) -> String {
    let o = env::run(BIN, args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", env::stderr(&o));
    env::stdout(&o)
}

/// The real binary: `run` stdout, `record --format text` and `record` + `report` of the
/// same deterministic guest workload (seeded; 3000 events per vCPU fit the default
/// buffer: no drops) print the same lines. Times, and so the interleaving of the two
/// vCPUs, differ between runs: each CPU's lines are compared in order, without the
/// time column.
#[test]
fn vm_mixed_stop_prints_the_same_in_run_record_text_and_report() {
    if !kvm_available(
        KRATE,
        "vm_mixed_stop_prints_the_same_in_run_record_text_and_report",
    ) {
        return;
    }
    let _g = vm_lock();
    let dir = TempDir::new("same-lines-vm");
    let txt = dir.file("t.txt");
    let dat = dir.file("t.dat");
    let common = [
        "--workload",
        "mixed",
        "--mode",
        "stop",
        "--events",
        "3000",
        "--vcpus",
        "2",
    ];
    let mut args = vec!["run"];
    args.extend(common);
    let run = stdout_of(&args);
    let mut args = vec!["record", "-o", &txt, "--format", "text"];
    args.extend(common);
    assert!(stdout_of(&args).is_empty());
    let text = std::fs::read_to_string(&txt).expect("text file");
    let mut args = vec!["record", "-o", &dat];
    args.extend(common);
    assert!(stdout_of(&args).is_empty());
    let report = stdout_of(&["report", "-i", &dat]);
    // Per CPU, without the time column: `comm-pid [cpu] name: fields`.
    let strip = |s: &str| -> Vec<Vec<String>> {
        let mut cpus = vec![Vec::new(); 2];
        for l in s.lines().skip(1) {
            let (head, rest) = l.split_once("] ").unwrap_or((l, ""));
            let cpu: usize = head
                .rsplit_once('[')
                .and_then(|(_, c)| c.parse().ok())
                .unwrap_or_else(|| panic!("no cpu column: {l}"));
            let rest = rest.split_once(": ").map_or(rest, |(_, r)| r);
            cpus[cpu].push(format!("{head}] {rest}"));
        }
        cpus
    };
    assert!(run.starts_with("cpus=2\n") || !run.starts_with("cpus="));
    let run = format!("cpus=2\n{}", run.strip_prefix("cpus=2\n").unwrap_or(&run));
    let (run, text, report) = (strip(&run), strip(&text), strip(&report));
    assert!(
        run.iter().all(|c| c.len() == 3000),
        "{:?} lines",
        run.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert!(
        !run.concat().iter().any(|l| l.contains("DROPPED")),
        "drops: the run is not deterministic"
    );
    assert_eq!(run, text, "run vs record --format text");
    assert_eq!(run, report, "run vs record + report");
}
