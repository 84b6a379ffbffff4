//! `hyptrace convert -i IN -o OUT --format F` (issue 11): any input `report` reads (a
//! raw page stream, trace.dat v6/v7/v7-zstd, ours or the kernel's) to any output format
//! of `record`. `convert` raw → dat → `report` prints the lines the run's text output
//! has; a kernel trace.dat converts to trace.dat with its formats and cmdlines (the
//! report is the same). The VM part is skipped without /dev/kvm unless
//! HYPTRACE_REQUIRE_KVM=1.

use std::path::PathBuf;

use hyptrace::env::{self, assert_usage_error, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("crates/output/tests/fixtures")
        .join(name)
        .to_str()
        .expect("utf-8 path")
        .to_string()
}

/// Runs `hyptrace ARGS`: exit 0 (else fails with stderr), stdout.
fn ok(args: &[&str]) -> String {
    let o = env::run(BIN, args);
    assert_eq!(o.status.code(), Some(0), "{args:?}: {}", env::stderr(&o));
    env::stdout(&o)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The lines of a trace.dat report without the `trailing_lost` records trace.dat needs
/// to carry a loss after a CPU's last page (each right after its marker: checked).
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

/// Per CPU, without the time column: `comm-pid [cpu] name: fields`.
fn per_cpu(s: &str, cpus: usize) -> Vec<Vec<String>> {
    let mut out = vec![Vec::new(); cpus];
    for l in s.lines().skip(1) {
        let (head, rest) = l.split_once("] ").unwrap_or((l, ""));
        let cpu: usize = head
            .rsplit_once('[')
            .and_then(|(_, c)| c.parse().ok())
            .unwrap_or_else(|| panic!("no cpu column: {l}"));
        let rest = rest.split_once(": ").map_or(rest, |(_, r)| r);
        out[cpu].push(format!("{head}] {rest}"));
    }
    out
}

/// `record --format raw`, then: convert raw → text (the text sink, as `record --format
/// text` writes it), raw → dat → report, raw → dat → raw → report, dat → dat6 →
/// report, raw → json: the same lines everywhere, and the run's own text output (a
/// second, deterministic run with `--format text`) has the same lines per CPU.
#[test]
fn raw_to_dat_to_report_gives_the_run_lines() {
    if !kvm_available(KRATE, "raw_to_dat_to_report_gives_the_run_lines") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("convert-vm");
    let (raw, txt, dat, dat6, raw2, json, run_txt, stats) = (
        dir.file("t.raw"),
        dir.file("t.txt"),
        dir.file("t.dat"),
        dir.file("t6.dat"),
        dir.file("t2.raw"),
        dir.file("t.json"),
        dir.file("run.txt"),
        dir.file("stats.json"),
    );
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
    let mut args = vec!["record", "--format", "raw", "-o", &raw, "--stats", &stats];
    args.extend(common);
    ok(&args);
    let mut args = vec!["record", "--format", "text", "-o", &run_txt];
    args.extend(common);
    ok(&args);

    ok(&["convert", "-i", &raw, "-o", &txt, "--format", "text"]);
    ok(&["convert", "-i", &raw, "-o", &dat]);
    let text = read(&txt);
    assert!(text.starts_with("cpus=2\n"), "{text}");
    // report of the raw stream itself is the text sink's output.
    assert_eq!(
        ok(&["report", &raw]),
        text,
        "report raw vs convert raw → text"
    );
    // raw → dat → report.
    let report = ok(&["report", &dat]);
    assert_eq!(
        without_trailing_records(&report),
        text,
        "raw → dat → report"
    );
    // dat → raw → report, dat → dat6 → report.
    ok(&["convert", "-i", &dat, "-o", &raw2, "--format", "raw"]);
    assert_eq!(ok(&["report", &raw2]), text, "dat → raw → report");
    ok(&["convert", "-i", &dat, "-o", &dat6, "--format", "dat6"]);
    assert_eq!(ok(&["report", &dat6]), report, "dat → dat6 → report");
    // raw → json: valid JSON.
    ok(&["convert", "-i", &raw, "-o", &json]);
    let v: serde_json::Value = serde_json::from_str(&read(&json)).expect("json");
    assert!(v.is_object() || v.is_array());

    // Every event the run read is in the text.
    let s: serde_json::Value = serde_json::from_str(&read(&stats)).expect("stats");
    let read_events: u64 = s["cpus"]
        .as_array()
        .expect("cpus")
        .iter()
        .map(|c| c["read"].as_u64().expect("read"))
        .sum();
    let lines = text
        .lines()
        .filter(|l| !l.starts_with("cpus=") && !l.starts_with("CPU:"))
        .count() as u64;
    assert_eq!(lines, read_events, "{s}");

    // The run's own text output: the same lines per CPU (times differ between runs;
    // the workload is deterministic when nothing is dropped).
    let run_text = read(&run_txt);
    if text.contains("DROPPED") || run_text.contains("DROPPED") {
        println!("NOTE: a run dropped events; per-CPU comparison with the second run skipped");
    } else {
        assert_eq!(
            per_cpu(&run_text, 2),
            per_cpu(&text, 2),
            "run text vs convert"
        );
    }
}

/// `trace-cmd report -t PATH` (exit 0), its stdout.
fn trace_cmd_report(p: &str) -> String {
    let o = std::process::Command::new("trace-cmd")
        .args(["report", "-t", p])
        .output()
        .expect("trace-cmd");
    assert!(o.status.success(), "trace-cmd report {p}");
    env::stdout(&o)
}

/// A kernel trace.dat (v6, v7, v7-zstd) converts to trace.dat v7 and v6 with its formats
/// and cmdlines: the report is the same.
#[test]
fn kernel_dat_to_dat_keeps_the_report() {
    let dir = TempDir::new("convert-kernel");
    for src in ["kernel-v6.dat", "kernel-v7.dat", "kernel-v7-zstd.dat"] {
        let f = fixture(src);
        let want = ok(&["report", &f]);
        for (fmt, name) in [("dat", "o7.dat"), ("dat6", "o6.dat")] {
            let out = dir.file(name);
            ok(&["convert", "-i", &f, "-o", &out, "--format", fmt]);
            assert_eq!(ok(&["report", &out]), want, "{src} → {fmt}");
            // The real trace-cmd reads the converted file as it reads the original.
            if env::trace_cmd_available() {
                let tc = trace_cmd_report;
                assert_eq!(tc(&out), tc(&f), "trace-cmd: {src} → {fmt}");
            }
        }
        // → text: the report's lines.
        let out = dir.file("k.txt");
        ok(&["convert", "-i", &f, "-o", &out]);
        assert_eq!(read(&out), want, "{src} → text");
        // → raw: refused (a raw stream carries no formats), and nothing is left.
        let out = dir.file("k.raw");
        let o = env::run(BIN, &["convert", "-i", &f, "-o", &out]);
        assert_usage_error(&o, "kernel → raw", "raw page stream");
        assert!(!std::path::Path::new(&out).exists());
    }
}

#[test]
fn bad_inputs_and_outputs_are_usage_errors() {
    let dir = TempDir::new("convert-bad");
    let junk = dir.file("junk");
    std::fs::write(&junk, b"HTRAWPG").expect("write");
    let out = dir.file("o.dat");
    let o = env::run(BIN, &["convert", "-i", &junk, "-o", &out]);
    assert_usage_error(&o, "junk", "bad magic");
    let o = env::run(BIN, &["convert", "-i", &dir.file("missing"), "-o", &out]);
    assert_usage_error(&o, "missing", "missing");
    let f = fixture("kernel-v6.dat");
    let o = env::run(BIN, &["convert", "-i", &f, "-o", "/nonexistent/dir/x.dat"]);
    assert_usage_error(&o, "bad -o", "(-o)");
    let o = env::run(BIN, &["convert", "-i", &f, "-o", &out, "--format", "nope"]);
    assert_usage_error(&o, "bad format", "possible values");
    // A raw stream cut inside a page: an error naming it, no output left.
    let mut raw = b"HTRAWPG1".to_vec();
    raw.extend_from_slice(&4096u32.to_le_bytes());
    raw.extend_from_slice(&1u32.to_le_bytes());
    raw.extend_from_slice(&[0u8; 16]);
    raw.extend_from_slice(&0u32.to_le_bytes());
    raw.extend_from_slice(&1u32.to_le_bytes());
    raw.extend_from_slice(&0u32.to_le_bytes());
    raw.extend_from_slice(&[0u8; 100]);
    let cut = dir.file("cut.raw");
    std::fs::write(&cut, &raw).expect("write");
    let o = env::run(BIN, &["convert", "-i", &cut, "-o", &out]);
    assert_usage_error(&o, "cut raw", "truncated");
    assert!(!std::path::Path::new(&out).exists());
    let o = env::run(BIN, &["report", &cut]);
    assert!(!env::stderr(&o).contains("panicked"));
    assert_eq!(o.status.code(), Some(2), "{}", env::stderr(&o));
}

/// `convert -F` (issue 39): an unknown event or field is exit 2 naming it, with no
/// output left; a filter that passes nothing says so, and the count line says what was
/// kept and dropped.
#[test]
fn filters_are_checked_and_accounted() {
    let dir = TempDir::new("convert-f");
    let f = fixture("kernel-v6.dat");
    let out = dir.file("o.dat");
    let o = env::run(
        BIN,
        &[
            "convert",
            "-F",
            "sched_switch: nope > 1",
            "-i",
            &f,
            "-o",
            &out,
        ],
    );
    assert_usage_error(&o, "unknown field", "has no field `nope`");
    let o = env::run(
        BIN,
        &["convert", "-F", "no_such_event", "-i", &f, "-o", &out],
    );
    assert_usage_error(&o, "unknown event", "matches `no_such_event`");
    assert!(!std::path::Path::new(&out).exists());
    let json = dir.file("o.json");
    let none = "sched_switch: prev_pid > 100000000";
    let o = env::run(BIN, &["convert", "-F", none, "-i", &f, "-o", &json]);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let err = env::stderr(&o);
    assert!(
        err.contains(&format!("-F '{none}' matched no event of the file")),
        "{err}"
    );
    assert!(err.contains("hyptrace: -F kept 0 of "), "{err}");
    assert!(!read(&json).contains("sched_switch"), "{}", read(&json));
}

/// A copy of kernel trace.dat v6 `src` at `dst` whose CPU's second page says events
/// were lost before it, count unknown (`RB_MISSED_EVENTS` without `RB_MISSED_STORED`,
/// as the kernel writes when it cannot store the count). Returns that CPU.
fn with_unknown_loss(src: &str, dst: &str) -> u32 {
    use hyptrace_abi::page::{COMMIT_OFFSET, RB_MISSED_EVENTS};
    let mut d = std::fs::read(src).expect("fixture");
    let fly = d
        .windows(10)
        .position(|w| w == b"flyrecord\0")
        .expect("v6 flyrecord section")
        + 10;
    let le = |d: &[u8], at: usize| u64::from_le_bytes(d[at..at + 8].try_into().unwrap());
    // Per CPU (offset, size); the first CPU with two pages or more.
    let cpu = (0..64)
        .find(|&c| le(&d, fly + 16 * c + 8) >= 2 * 4096)
        .expect("a CPU with two pages");
    let at = le(&d, fly + 16 * cpu) as usize + 4096 + COMMIT_OFFSET;
    let commit = le(&d, at) | RB_MISSED_EVENTS;
    d[at..at + 8].copy_from_slice(&commit.to_le_bytes());
    std::fs::write(dst, &d).expect("write");
    cpu as u32
}

/// The loss lines (`CPU:N [..EVENTS DROPPED]`) of a report, in order.
fn loss_lines(report: &str) -> Vec<&str> {
    report
        .lines()
        .filter(|l| l.contains("EVENTS DROPPED]"))
        .collect()
}

/// A kernel page that says events were lost without a count reaches every output
/// (the sinks were handed no loss for it before `Missed`): trace.dat keeps the flag
/// (trace-cmd prints `[EVENTS DROPPED]` where it does for the input), text prints
/// trace-cmd's line, JSON a `lost events` instant with a null count, Perfetto a
/// `lost events` instant without a count.
#[test]
fn kernel_loss_of_unknown_count_reaches_every_output() {
    let dir = TempDir::new("convert-unknown-loss");
    let f = dir.file("in.dat");
    let cpu = with_unknown_loss(&fixture("kernel-v6.dat"), &f);
    let line = format!("CPU:{cpu} [EVENTS DROPPED]");
    let want = ok(&["report", &f]);
    let losses = loss_lines(&want);
    assert!(
        losses.contains(&line.as_str()),
        "our reader of the input: {losses:?}"
    );
    let tc = trace_cmd_report;
    let tc_in = env::trace_cmd_available().then(|| tc(&f));
    if let Some(t) = &tc_in {
        assert_eq!(loss_lines(t), losses, "trace-cmd of the input");
    }
    for (fmt, name) in [("dat", "o7.dat"), ("dat6", "o6.dat")] {
        let out = dir.file(name);
        ok(&["convert", "-i", &f, "-o", &out, "--format", fmt]);
        assert_eq!(ok(&["report", &out]), want, "→ {fmt}");
        if let Some(t) = &tc_in {
            // Every line, the loss line at its place among the events.
            assert_eq!(&tc(&out), t, "trace-cmd: → {fmt}");
        }
    }
    let txt = dir.file("o.txt");
    ok(&["convert", "-i", &f, "-o", &txt]);
    assert_eq!(read(&txt), want, "→ text");
    let json = dir.file("o.json");
    ok(&["convert", "-i", &f, "-o", &json]);
    let v: serde_json::Value = serde_json::from_str(&read(&json)).expect("json");
    let lost: Vec<_> = v["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["name"] == "lost events")
        .collect();
    assert_eq!(lost.len(), losses.len(), "→ json: {lost:?}");
    let unknown = lost.iter().filter(|e| e["args"]["count"].is_null()).count();
    assert_eq!(unknown, 1, "→ json: {lost:?}");
    if env::perfetto_available() {
        let pf = dir.file("o.pftrace");
        ok(&["convert", "-i", &f, "-o", &pf, "--format", "perfetto"]);
        let v: serde_json::Value =
            serde_json::from_slice(&env::perfetto_decode(&pf, false)).expect("decoder JSON");
        let unknown: u64 = v["tracks"]
            .as_object()
            .expect("tracks")
            .values()
            .map(|t| t["lost_unknown"].as_u64().unwrap_or(0))
            .sum();
        assert_eq!(unknown, 1, "→ perfetto: {v}");
    }
}
