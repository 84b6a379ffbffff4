//! Damaged trace.dat files (docs/output.md "Damaged files"): a real recorded trace (v7
//! zstd with many chunks over four CPUs, and v6) is truncated at 10 offsets and has a
//! 16-byte run overwritten at 10 offsets, spread through the file (file header, header
//! page, event formats, command lines, options, first chunk, middle, last chunk, end;
//! positions computed from the file's own layout, bytes from a seeded generator). On
//! every copy `hyptrace report` prints at least as many events as `trace-cmd report`
//! (0 when trace-cmd crashes or hangs), never panics nor hangs, and exits 1 (0 on the
//! intact file); `hyptrace convert` exits 1 likewise and its trace.dat holds what
//! `report` printed. Skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1; trace-cmd
//! checks skipped without it unless HYPTRACE_REQUIRE_TRACE_CMD=1.

use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};
use hyptrace::rng::Rng;
use hyptrace_output::tracedat::option;
use hyptrace_output::TraceFile;

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");
/// How long one report may take (the file is a few MB: well under a second).
const TIMEOUT: Duration = Duration::from_secs(10);

/// One damaged copy: what was done and where.
struct Damage {
    what: String,
    data: Vec<u8>,
}

/// Runs `prog args`, stdout to `out`, stderr to `err`, at most `timeout`: the exit
/// status, or `None` when it had to be killed.
fn run_timed(prog: &str, args: &[&str], out: &Path, err: &Path) -> Option<ExitStatus> {
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(out).unwrap())
        .stderr(std::fs::File::create(err).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {prog}: {e}"));
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return Some(st);
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Event lines of a `report -t` text: `COMM-PID [CPU] SECS.FRAC: ...`.
fn event_lines(text: &[u8]) -> u64 {
    let text = String::from_utf8_lossy(text);
    let mut n = 0;
    for line in text.lines() {
        let mut words = line.split_whitespace().skip_while(|w| !w.starts_with('['));
        let cpu = words.next().unwrap_or("");
        let ts = words.next().unwrap_or("");
        let cpu_ok = cpu.len() > 2
            && cpu.ends_with(']')
            && cpu[1..cpu.len() - 1].bytes().all(|b| b.is_ascii_digit());
        let ts_ok = ts
            .strip_suffix(':')
            .and_then(|t| t.split_once('.'))
            .is_some_and(|(s, f)| {
                !s.is_empty() && s.bytes().chain(f.bytes()).all(|b| b.is_ascii_digit())
            });
        n += u64::from(cpu_ok && ts_ok);
    }
    n
}

fn le32(d: &[u8], at: usize) -> usize {
    u32::from_le_bytes(d[at..at + 4].try_into().unwrap()) as usize
}

fn le64(d: &[u8], at: usize) -> usize {
    u64::from_le_bytes(d[at..at + 8].try_into().unwrap()) as usize
}

/// Offsets worth damaging, by name, computed from the intact file's layout: for v7 the
/// metadata sections the options name, the options section, the first, a middle and
/// the last compression chunk; for v6 the metadata before the first page and pages.
fn landmarks(path: &Path, d: &[u8]) -> Vec<(&'static str, usize, usize)> {
    let f = TraceFile::open(path).unwrap();
    let mut m = Vec::new();
    // (name, start, end) regions.
    m.push(("file header", 12, 28));
    let section = |id: u16| {
        f.options
            .iter()
            .find(|o| o.id == id)
            .map(|o| le64(&o.data, 0))
    };
    let data_start = f.cpus.iter().map(|c| c.offset as usize).min().unwrap();
    if f.version == 7 {
        for (name, id) in [
            ("header_page", option::HEADER_INFO),
            ("event formats", option::EVENT_FORMATS),
            ("cmdlines", option::CMDLINES),
        ] {
            let at = section(id).unwrap();
            m.push((name, at + 16, at + 16 + le64(d, at + 8)));
        }
        // The options offset follows the two compression strings after byte 18.
        let strings = d[18..].iter().filter(|&&b| b == 0).take(2).count();
        assert_eq!(strings, 2);
        let mut p = 18;
        for _ in 0..2 {
            p += d[p..].iter().position(|&b| b == 0).unwrap() + 1;
        }
        let opts = le64(d, p);
        m.push(("options", opts + 16, opts + 16 + le64(d, opts + 8)));
    } else {
        // v6: header_page text from byte 38; formats and options before the pages.
        m.push(("header_page", 38, 38 + le64(d, 30)));
        m.push(("event formats", data_start / 3, data_start / 2));
        m.push(("options", data_start * 2 / 3, data_start - 64));
    }
    // CPU data: the first chunk/page of the first CPU, the middle, the last of the last.
    let mut cpus = f.cpus.clone();
    cpus.sort_by_key(|c| c.offset);
    let (first, last) = (cpus[0].clone(), cpus[cpus.len() - 1].clone());
    if f.is_compressed() {
        let chunk_at = |c: &hyptrace_output::tracedat::CpuBuffer, last: bool| {
            let mut at = c.offset as usize + 4;
            for _ in 1..if last { le32(d, c.offset as usize) } else { 1 } {
                at += 8 + le32(d, at);
            }
            (at, at + 8 + le32(d, at))
        };
        let (s, e) = chunk_at(&first, false);
        m.push(("first chunk header", s, s + 8));
        m.push(("first chunk", s + 8, e));
        let (s, e) = chunk_at(&last, true);
        m.push(("last chunk", s + 8, e));
    } else {
        let s = first.offset as usize;
        m.push(("first page", s, s + f.page_size));
        let e = (last.offset + last.size) as usize;
        m.push(("last page", e - f.page_size, e));
    }
    let end = (last.offset + last.size) as usize;
    m.push((
        "middle of the data",
        (data_start + end) / 2 - 50_000,
        (data_start + end) / 2 + 50_000,
    ));
    m
}

/// The file offsets of every compressed chunk's zstd frame (none for uncompressed data).
fn frame_starts(path: &Path, d: &[u8]) -> Vec<usize> {
    let f = TraceFile::open(path).unwrap();
    let mut v = Vec::new();
    if !f.is_compressed() {
        return v;
    }
    for c in &f.cpus {
        let mut at = c.offset as usize + 4;
        for _ in 0..le32(d, c.offset as usize) {
            v.push(at + 8);
            at += 8 + le32(d, at);
        }
    }
    v.sort_unstable();
    v
}

/// 10 truncated copies and 10 with a 16-byte run overwritten, at offsets picked from
/// the landmarks' regions by a seeded generator.
fn damaged_copies(path: &Path, seed: u64) -> Vec<Damage> {
    let d = std::fs::read(path).unwrap();
    let marks = landmarks(path, &d);
    let mut rng = Rng(seed);
    let pick =
        |rng: &mut Rng, (s, e): (usize, usize)| s + rng.below((e - s).max(1) as u64) as usize;
    let mut out = Vec::new();
    let mut cut = |what: String, at: usize| {
        out.push(Damage {
            what: format!("truncated at {at} ({what})"),
            data: d[..at].to_vec(),
        })
    };
    let region = |name: &str| {
        marks
            .iter()
            .find(|m| m.0 == name)
            .map(|m| (m.1, m.2))
            .unwrap_or_else(|| panic!("no {name} in {marks:?}"))
    };
    let names: Vec<&str> = marks
        .iter()
        .map(|m| m.0)
        .filter(|n| *n != "first chunk header")
        .collect();
    for name in &names {
        cut((*name).to_string(), pick(&mut rng, region(name)));
    }
    cut("end - 3000".into(), d.len() - 3000);
    cut("end - 1".into(), d.len() - 1);
    let mut out: Vec<Damage> = out.into_iter().take(10).collect();
    let mut spots: Vec<&str> = marks.iter().map(|m| m.0).collect();
    spots.push("middle of the data");
    let frames = frame_starts(path, &d);
    for name in spots.into_iter().take(10) {
        let mut at = pick(&mut rng, region(name)).min(d.len() - 16);
        // In compressed data, the run starts at the frame of the chunk it falls in:
        // zstd then always tells (the chunks carry no checksum: a run inside a frame
        // may decompress into garbage pages, whose records trace-cmd reads across page
        // boundaries in its chunk buffer, which no reader bound to the page can match).
        if let Some(&f) = frames.iter().rev().find(|&&f| f <= at && at < f + 4096) {
            at = f;
        }
        let mut data = d.clone();
        for b in &mut data[at..at + 16] {
            *b = rng.next() as u8;
        }
        out.push(Damage {
            what: format!("16 bytes overwritten at {at} ({name})"),
            data,
        });
    }
    out
}

/// Reports and converts every damaged copy of `path`; returns the failures and prints
/// the table.
fn check_copies(dir: &TempDir, path: &Path, tag: &str, seed: u64) -> Vec<String> {
    let mut bad = Vec::new();
    let copies = damaged_copies(path, seed);
    let intact = Damage {
        what: "intact".into(),
        data: std::fs::read(path).unwrap(),
    };
    let (mut detected, mut overwritten) = (0, 0);
    for (i, dmg) in std::iter::once(intact).chain(copies).enumerate() {
        let p = dir.file(&format!("{tag}-{i}.dat"));
        std::fs::write(&p, &dmg.data).unwrap();
        let (out, err) = (dir.file("out"), dir.file("err"));
        let tc = match run_timed("trace-cmd", &["report", &p], out.as_ref(), err.as_ref()) {
            Some(_) => event_lines(&std::fs::read(&out).unwrap()),
            None => 0,
        };
        let st = run_timed(BIN, &["report", &p], out.as_ref(), err.as_ref());
        let ours = event_lines(&std::fs::read(&out).unwrap());
        let stderr = std::fs::read_to_string(&err).unwrap_or_default();
        let code = st.and_then(|s| s.code());
        println!(
            "{tag} {:55} trace-cmd {tc:7} hyptrace {ours:7} exit {code:?} {}",
            dmg.what,
            stderr.lines().next().unwrap_or("")
        );
        let truncated = dmg.what.starts_with("truncated");
        overwritten += u64::from(!truncated && i > 0);
        detected += u64::from(!truncated && code == Some(1));
        // Exit 1 exactly when damage was found and named; a truncated copy always is,
        // the intact file never; an overwritten run may hit bytes no check can tell
        // from good ones (a text field, a raw zstd literal): then exit 0, no warning.
        let named = stderr.contains("damaged");
        if st.is_none() {
            bad.push(format!("{tag} {}: hyptrace report hung", dmg.what));
            continue;
        }
        if stderr.contains("panicked") || !matches!(code, Some(0 | 1)) {
            bad.push(format!("{tag} {}: exit {code:?}: {stderr}", dmg.what));
        } else if (code == Some(1)) != named || (i == 0 && named) || (truncated && !named) {
            bad.push(format!(
                "{tag} {}: exit {code:?}, damage named: {named}: {stderr}",
                dmg.what
            ));
        }
        if ours < tc {
            bad.push(format!(
                "{tag} {}: {ours} events < trace-cmd's {tc}",
                dmg.what
            ));
        }
        bad.extend(check_convert(dir, &p, code, ours).map(|e| format!("{tag} {}: {e}", dmg.what)));
    }
    println!("{tag}: {detected} of {overwritten} overwritten runs detected");
    bad
}

/// `convert` of a copy exits as `report` did and its trace.dat holds the `events`
/// `report` printed.
fn check_convert(dir: &TempDir, p: &str, code: Option<i32>, events: u64) -> Option<String> {
    let conv = dir.file("conv.dat");
    let _ = std::fs::remove_file(&conv);
    let (out, err) = (dir.file("cout"), dir.file("cerr"));
    let st = run_timed(
        BIN,
        &["convert", "-i", p, "-o", &conv],
        out.as_ref(),
        err.as_ref(),
    );
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    let Some(st) = st else {
        return Some("hyptrace convert hung".into());
    };
    if st.code() != code || stderr.contains("panicked") {
        return Some(format!(
            "convert exit {:?}, report's {code:?}: {stderr}",
            st.code()
        ));
    }
    if events == 0 {
        return None;
    }
    let st = run_timed(BIN, &["report", &conv], out.as_ref(), err.as_ref());
    let n = event_lines(&std::fs::read(&out).unwrap());
    (st.is_none() || n != events).then(|| format!("converted: {n} events, report printed {events}"))
}

#[test]
fn damaged_files_read_like_trace_cmd_or_better() {
    if !kvm_available(KRATE, "damaged_files_read_like_trace_cmd_or_better") {
        return;
    }
    if !env::trace_cmd_available() {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("damaged");
    let mut bad = Vec::new();
    for (tag, format, seed) in [("v7", "dat", 26), ("v6", "dat6", 62)] {
        let path = dir.file(&format!("{tag}.dat"));
        let args = [
            "record",
            "-o",
            &path,
            "--format",
            format,
            "--vcpus",
            "4",
            "--events",
            "100000",
            "--workload",
            "mixed",
            "--buffer-kb",
            "16384",
        ];
        let o = env::run(BIN, &args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", env::stderr(&o));
        bad.extend(check_copies(&dir, path.as_ref(), tag, seed));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
