//! `hyptrace report` and `convert` of a trace.dat v7 with buffer instances (the files
//! `hyptrace collect` writes, one instance per VM): `report` prints every instance's
//! events in one time order, line for line what `trace-cmd report -t` prints (checked
//! when trace-cmd is installed; HYPTRACE_REQUIRE_TRACE_CMD=1 makes its absence fail);
//! `--cpu` selects a CPU in every instance; `convert` writes it to JSON and Perfetto
//! with a process per instance, and refuses it (exit 2) for the formats that cannot
//! name an instance on an event, naming its instances, writing nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use hyptrace::env::{self, TempDir};
use hyptrace_output::tracedat::{write_buffers, BufferPart};
use hyptrace_output::{
    Clock, Compression, OutputTarget, PageSink, RunSummary, TraceDatSink, TraceDatVersion,
    TraceMeta,
};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");

/// A page of `cpu` holding `n` markers from `seq`, 10 ns apart from `ts`.
fn page(cpu: u32, ts: u64, seq: u64, n: u64) -> Vec<u8> {
    let mut p = vec![0u8; 4096];
    p[..8].copy_from_slice(&ts.to_le_bytes());
    let mut at = 16;
    for k in 0..n {
        let payload = hyptrace_abi::events::marker(
            hyptrace_abi::events::vcpu_pid(cpu),
            seq + k,
            (seq + k) * 3,
        );
        let mut hdr = [0u8; 8];
        let delta = if k == 0 { 0 } else { 10 };
        let h = hyptrace_abi::page::encode_data_header(&mut hdr, payload.len(), delta);
        p[at..at + h].copy_from_slice(&hdr[..h]);
        p[at + h..at + h + payload.len()].copy_from_slice(&payload);
        at += h + payload.len();
    }
    p[8..16].copy_from_slice(&((at - 16) as u64).to_le_bytes());
    p
}

/// A part of `cpus` CPUs, `pages` pages each, its times from `start`.
fn part(dir: &Path, name: &str, cpus: u32, pages: u64, start: u64) -> BufferPart {
    let path = dir.join(format!("{name}.part.dat"));
    let meta = TraceMeta::guest(4096, cpus, Clock::nanoseconds());
    let mut s = TraceDatSink::create_with(&path, meta, TraceDatVersion::V7, Compression::Zstd)
        .expect("part");
    for i in 0..pages {
        for c in 0..cpus {
            let ts = start + i * 1000 + u64::from(c) * 3;
            s.page(c, &page(c, ts, i * 20, 20), hyptrace_output::Missed::None)
                .expect("page");
        }
    }
    Box::new(s).finish(&RunSummary::default()).expect("finish");
    BufferPart {
        name: name.into(),
        path,
    }
}

/// `web` (1 CPU) and `db` (2 CPUs, starting 5 ns later: interleaved) in `all.dat`.
fn multi(dir: &TempDir) -> PathBuf {
    let d = PathBuf::from(dir.file(""));
    let parts = [
        part(&d, "web", 1, 6, 1_000_000),
        part(&d, "db", 2, 4, 1_000_005),
    ];
    let out = PathBuf::from(dir.file("all.dat"));
    let meta = TraceMeta::guest(4096, 2, Clock::nanoseconds());
    let target = OutputTarget::check(&out).expect("target");
    assert_eq!(
        write_buffers(&target, meta, &parts).expect("write"),
        [120, 160]
    );
    out
}

fn hyptrace(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().expect("run hyptrace")
}

/// `report` prints all 280 events, each after its VM's name, in one time order; it is
/// `trace-cmd report -t`, line for line.
#[test]
fn report_prints_every_instance() {
    let dir = TempDir::new("instances-report");
    let all = multi(&dir);
    let path = all.to_str().unwrap();
    let o = hyptrace(&["report", path]);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let ours = env::stdout(&o);
    let count = |p: &str| ours.lines().filter(|l| l.starts_with(p)).count();
    assert_eq!((count("web: "), count(" db: ")), (120, 160), "{ours}");
    let ts: Vec<f64> = ours
        .lines()
        .skip(1)
        .filter_map(|l| l.split(": marker").next()?.rsplit(' ').next()?.parse().ok())
        .collect();
    assert_eq!(ts.len(), 280);
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "not in time order");
    // --cpu 1: db's second CPU only.
    let o = hyptrace(&["report", "--cpu", "1", path]);
    let cpu1 = env::stdout(&o);
    assert_eq!(cpu1.matches("[001]").count(), 80, "{cpu1}");
    assert_eq!(cpu1.lines().count(), 81);
    if !env::trace_cmd_available() {
        return;
    }
    let t = Command::new("trace-cmd")
        .args(["report", "-t", "-i", path])
        .output()
        .expect("trace-cmd");
    assert!(t.status.success(), "{}", String::from_utf8_lossy(&t.stderr));
    assert_eq!(
        ours,
        String::from_utf8_lossy(&t.stdout),
        "ours != trace-cmd's"
    );
}

/// `convert` of a multi-buffer file to a format that cannot name an instance on an
/// event (trace.dat v6, raw): exit 2 naming the instances, no output left.
#[test]
fn convert_refuses_instances() {
    let dir = TempDir::new("instances-convert");
    let all = multi(&dir);
    for fmt in ["dat6", "raw"] {
        let out = dir.file(&format!("out.{fmt}"));
        let args = [
            "convert",
            "-i",
            all.to_str().unwrap(),
            "-o",
            &out,
            "--format",
            fmt,
        ];
        let o = hyptrace(&args);
        let ext = fmt;
        let err = env::stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{ext}: {err}");
        assert!(err.contains("2 buffer instances (web, db)"), "{err}");
        assert!(
            err.contains("only as trace.dat v7 (the instances kept), JSON"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!Path::new(&out).exists(), "{ext}: output left");
    }
}

/// `convert` of a multi-buffer file to trace.dat (v7, zstd or not): the instances
/// kept, named, in order, their events those of the input (`report` prints the same
/// lines, trace-cmd too when installed); `-F` is refused (exit 2), nothing written.
#[test]
fn convert_keeps_instances_in_trace_dat() {
    let dir = TempDir::new("instances-dat");
    let all = multi(&dir);
    let path = all.to_str().unwrap();
    let want = env::stdout(&hyptrace(&["report", path]));
    for c in ["zstd", "none"] {
        let out = dir.file(&format!("copy-{c}.dat"));
        let o = hyptrace(&["convert", "-i", path, "-o", &out, "--compression", c]);
        assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
        let f = hyptrace_output::TraceFile::open(&out).expect("open");
        let names: Vec<&str> = f.instances.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["web", "db"]);
        assert!(f.damage.is_empty(), "{:?}", f.damage);
        let got = env::stdout(&hyptrace(&["report", &out]));
        assert_eq!(got, want, "{c}");
        if env::trace_cmd_available() {
            let t = Command::new("trace-cmd")
                .args(["report", "-t", "-i", &out])
                .output()
                .expect("trace-cmd");
            assert_eq!(String::from_utf8_lossy(&t.stdout), want, "{c}: trace-cmd");
        }
    }
    let out = dir.file("filtered.dat");
    let o = hyptrace(&["convert", "-i", path, "-o", &out, "-F", "marker"]);
    assert_eq!(o.status.code(), Some(2), "{}", env::stderr(&o));
    assert!(
        env::stderr(&o).contains("-F is not taken"),
        "{}",
        env::stderr(&o)
    );
    assert!(!Path::new(&out).exists());
}

/// `convert` of a multi-buffer file to text: `report`'s lines (each after its
/// instance's name), in the file; with `-F`, only the events it passes.
#[test]
fn convert_names_instances_in_text() {
    let dir = TempDir::new("instances-text");
    let all = multi(&dir);
    let path = all.to_str().unwrap();
    let out = dir.file("all.txt");
    let o = hyptrace(&["convert", "-i", path, "-o", &out]);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let text = std::fs::read_to_string(&out).expect("text");
    let r = hyptrace(&["report", path]);
    assert_eq!(text, env::stdout(&r));
    let count = |t: &str, p: &str| t.lines().filter(|l| l.starts_with(p)).count();
    assert_eq!((count(&text, "web: "), count(&text, " db: ")), (120, 160));
    let o = hyptrace(&["convert", "-i", path, "-o", &out, "-F", "marker: seq < 10"]);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let text = std::fs::read_to_string(&out).expect("text");
    // web: seqs 0..9 of its one CPU; db: of each of its two.
    assert_eq!(
        (count(&text, "web: "), count(&text, " db: ")),
        (10, 20),
        "{text}"
    );
    let o = hyptrace(&["convert", "-i", path, "-o", &out, "-F", "nope"]);
    assert_eq!(o.status.code(), Some(2), "{}", env::stderr(&o));
}

/// `convert` of a multi-buffer file to JSON: a process per instance named after it,
/// every entry's `vm` its instance (and `pid` that process, `tid` its CPU in the
/// instance), 120 markers of web and 160 of db, each instance's CPUs' seqs in order,
/// the whole in one time order.
#[test]
fn convert_names_instances_in_json() {
    let dir = TempDir::new("instances-json");
    let all = multi(&dir);
    let out = dir.file("all.json");
    let o = hyptrace(&["convert", "-i", all.to_str().unwrap(), "-o", &out]);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("json")).expect("JSON");
    let entries = v["traceEvents"].as_array().expect("traceEvents");
    let pids: std::collections::BTreeMap<u64, &str> = entries
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(pids.values().copied().collect::<Vec<_>>(), ["web", "db"]);
    let mut seen: std::collections::BTreeMap<(String, u64), Vec<u64>> = Default::default();
    let mut last = 0.0f64;
    for e in entries.iter().filter(|e| e["ph"] != "M") {
        assert_eq!(e["name"], "marker", "{e}");
        let vm = e["vm"].as_str().expect("vm");
        assert_eq!(pids.get(&e["pid"].as_u64().unwrap()), Some(&vm), "{e}");
        let ts = e["ts"].as_f64().expect("ts");
        assert!(ts >= last, "not in time order at {e}");
        last = ts;
        let key = (vm.to_string(), e["tid"].as_u64().expect("tid"));
        seen.entry(key)
            .or_default()
            .push(e["args"]["seq"].as_u64().unwrap());
    }
    let keys: Vec<(&str, u64)> = seen.keys().map(|(v, t)| (v.as_str(), *t)).collect();
    assert_eq!(keys, [("db", 0), ("db", 1), ("web", 0)]);
    for ((vm, _), seqs) in &seen {
        let n = if vm == "web" { 120 } else { 80 };
        assert!(seqs.iter().copied().eq(0..n), "{vm}: {seqs:?}");
    }
}

/// `convert` of a multi-buffer file to Perfetto: valid against Perfetto's protos, a
/// process per instance named after it, its CPUs threads of it (no tid twice), 120
/// markers on web's thread, 80 on each of db's two.
#[test]
fn convert_names_instances_in_perfetto() {
    if !env::perfetto_available() {
        return;
    }
    let dir = TempDir::new("instances-perfetto");
    let all = multi(&dir);
    let out = dir.file("all.pftrace");
    let o = hyptrace(&["convert", "-i", all.to_str().unwrap(), "-o", &out]);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let v: serde_json::Value =
        serde_json::from_slice(&env::perfetto_decode(&out, false)).expect("decoder JSON");
    let mut got: Vec<(String, String, u64)> = Vec::new();
    for (uuid, th) in v["threads"].as_object().expect("threads") {
        let process = &v["processes"][th["parent"].to_string()];
        let markers = v["tracks"][uuid]["instants"]["marker"]
            .as_u64()
            .unwrap_or(0);
        got.push((
            process["name"].as_str().expect("process").to_string(),
            th["name"].as_str().expect("name").to_string(),
            markers,
        ));
    }
    got.sort();
    let want = [
        ("db", "vcpu0", 80),
        ("db", "vcpu1", 80),
        ("web", "vcpu0", 120),
    ];
    let want: Vec<(String, String, u64)> = want
        .iter()
        .map(|(p, t, n)| (p.to_string(), t.to_string(), *n))
        .collect();
    assert_eq!(got, want, "{v}");
    assert_eq!(v["processes"].as_object().map(|p| p.len()), Some(2));
}
