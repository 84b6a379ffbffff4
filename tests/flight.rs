//! The flight recorder (issue 13): `--drain none`, crash dumps (`--crash-dump`,
//! `--hang-timeout`), file-backed trace memory (`--trace-mem`) and `hyptrace dump`.
//! VM tests are skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1.
//!
//! Crash workloads are scenarios of the adversary guest (guest/src/bin/adversary.rs:
//! `--rate` picks the scenario, vCPU 0 writes `--events` markers with seq 0..N and
//! then crashes; the other vCPUs write N markers and finish). Every child process runs
//! under a bound ([`WALL`]) and is killed past it: a test fails, never hangs.
//!
//! `MEASURE` lines (recovery completeness, crash-to-dump and kill-to-dump times):
//! `cargo test --release --test flight -- --nocapture --test-threads 1`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyptrace::adversary::adversary_guest;
use hyptrace::env::{kvm_available, trace_cmd_available, vm_lock, TempDir};
use hyptrace::rng::Rng;
use hyptrace::text::{check_stream, parse_all, CpuTally, Line, StreamRules};
use hyptrace_abi::layout::ctl;
use hyptrace_abi::SharedMem;
use hyptrace_reader::postmortem::walk_cpu;
use hyptrace_reader::trace_file;

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// Longest any child may run (boot, run, dump on a loaded machine).
const WALL: Duration = Duration::from_secs(60);

/// Adversary scenarios (guest/src/bin/adversary.rs, `Scenario`).
mod sc {
    pub const HONEST: u32 = 0;
    pub const CRASH_FAULT: u32 = 20;
    pub const CRASH_PANIC: u32 = 21;
    pub const CRASH_UD: u32 = 22;
    pub const CRASH_HANG: u32 = 23;
}

/// Events of one marker page: (4096 - 16 header - 96 footer) / 28 bytes per marker.
const MARKERS_PER_PAGE: u64 = 142;

fn guest() -> String {
    let target = Path::new(BIN)
        .parent()
        .and_then(Path::parent)
        .expect("target dir");
    adversary_guest(target)
        .unwrap_or_else(|e| panic!("{e}"))
        .to_str()
        .expect("utf-8")
        .to_string()
}

/// What a bounded child run gave.
struct Ran {
    code: Option<i32>,
    stderr: String,
    wall: Duration,
}

/// Spawns `hyptrace args` with stdout to `stdout` (a file path) or null.
fn spawn(args: &[&str], stdout: Option<&str>, stderr: &str) -> Child {
    let out = match stdout {
        Some(p) => Stdio::from(std::fs::File::create(p).expect("stdout file")),
        None => Stdio::null(),
    };
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(Stdio::from(
            std::fs::File::create(stderr).expect("stderr file"),
        ))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {BIN}: {e}"))
}

/// Waits for `child` at most [`WALL`]; kills it (and fails) past that.
fn finish(mut child: Child, stderr: &str, started: Instant) -> Ran {
    loop {
        match child.try_wait().expect("try_wait") {
            Some(st) => {
                return Ran {
                    code: st.code(),
                    stderr: std::fs::read_to_string(stderr).unwrap_or_default(),
                    wall: started.elapsed(),
                }
            }
            None if started.elapsed() > WALL => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "hyptrace ran past {WALL:?}: {}",
                    std::fs::read_to_string(stderr).unwrap_or_default()
                );
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn run_bounded(args: &[&str], dir: &TempDir, tag: &str) -> Ran {
    let err = dir.file(&format!("{tag}.stderr"));
    let t = Instant::now();
    finish(spawn(args, None, &err), &err, t)
}

fn no_panic(r: &Ran, what: &str) {
    assert!(
        !r.stderr.contains("panicked at") && !r.stderr.contains("RUST_BACKTRACE"),
        "{what}: the host panicked:\n{}",
        r.stderr
    );
}

/// Parses and checks a text dump: per CPU, seq contiguous except where a drop line
/// says how many were lost (and the first seq is the losses before it).
fn check_text(path: &str, cpus: u32) -> Vec<CpuTally> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let lines = parse_all(&text, path);
    check_stream(
        &lines,
        &StreamRules {
            cpus,
            workload: None,
            merged: false,
        },
    )
}

/// One crash case: vCPU 0 writes `n` markers and crashes (`scenario`), `--drain
/// none`: the crash dump holds the newest events of its ring up to the last one, in
/// order, and the losses before them exactly; exit 3; the reason and vCPU 0's last
/// event on stderr.
fn crash_case(g: &str, dir: &TempDir, scenario: u32, n: u64, extra: &[&str]) -> (CpuTally, Ran) {
    let dump = dir.file(&format!("crash-{scenario}-{n}.txt"));
    let (sc, ev) = (scenario.to_string(), n.to_string());
    let mut args = vec![
        "run",
        "--guest",
        g,
        "--rate",
        &sc,
        "--events",
        &ev,
        "--vcpus",
        "2",
        "--buffer-kb",
        "16",
        "--drain",
        "none",
        "--crash-dump",
        &dump,
    ];
    args.extend_from_slice(extra);
    let r = run_bounded(&args, dir, &format!("crash-{scenario}-{n}"));
    no_panic(&r, "crash run");
    assert_eq!(r.code, Some(3), "scenario {scenario}: {}", r.stderr);
    assert!(
        r.stderr.contains("hyptrace: guest crashed: "),
        "no reason line: {}",
        r.stderr
    );
    let last = format!("seq={} value={}", n - 1, n - 1);
    let line = r
        .stderr
        .lines()
        .find(|l| l.starts_with("hyptrace: vcpu 0: last event:"))
        .unwrap_or_else(|| panic!("no last event of vcpu 0: {}", r.stderr));
    assert!(line.ends_with(&last), "{line} does not end with {last}");
    assert!(
        r.stderr.contains("hyptrace: crash dump: "),
        "no dump line: {}",
        r.stderr
    );
    let t = check_text(&dump, 2);
    let t0 = t[0].clone();
    // Every event up to the crash, the newest ones: the last is seq n-1, and the ring
    // (3 ring pages of 16 KiB) keeps at least two full pages of them.
    assert_eq!(t0.last_seq, Some(n - 1), "scenario {scenario}: {t0:?}");
    assert_eq!(t0.events + t0.dropped, n, "{t0:?}");
    assert!(
        t0.events >= n.min(2 * MARKERS_PER_PAGE),
        "only {} events: {t0:?}",
        t0.events
    );
    (t0, r)
}

/// Triple faults (store to unmapped memory, invalid opcode) and a guest panic after N
/// events, N at seeded random points: the dump has the newest events, in order, with
/// exact losses; exit 3. With `--format dat` trace-cmd reads the crash dump.
#[test]
fn crash_dump_holds_the_last_events() {
    if !kvm_available(KRATE, "crash_dump_holds_the_last_events") {
        return;
    }
    let _l = vm_lock();
    let g = guest();
    let dir = TempDir::new("crash");
    let mut rng = Rng(0x666c_6967_6874);
    let mut complete = 0;
    let mut runs = 0;
    let mut times = Vec::new();
    for scenario in [sc::CRASH_FAULT, sc::CRASH_PANIC, sc::CRASH_UD] {
        for _ in 0..2 {
            let n = 50 + rng.below(20_000);
            let (t, r) = crash_case(&g, &dir, scenario, n, &[]);
            runs += 1;
            // Complete: every event still in the ring is in the dump (the asserts
            // above hold: contiguous to the last, losses exact).
            complete += 1;
            let ms = r
                .stderr
                .lines()
                .find_map(|l| {
                    l.split(" in ")
                        .nth(1)
                        .filter(|_| l.starts_with("hyptrace: crash dump:"))
                        .and_then(|s| s.strip_suffix(" ms"))
                        .and_then(|s| s.parse::<f64>().ok())
                })
                .unwrap_or(f64::NAN);
            times.push(ms);
            println!(
                "MEASURE crash scenario {scenario} after {n} events: dump {} events, {} lost, crash-to-dump {ms:.1} ms, wall {:.2} s",
                t.events,
                t.dropped,
                r.wall.as_secs_f64()
            );
        }
    }
    println!("MEASURE crash recovery complete in {complete}/{runs} runs, dump times {times:?} ms");
    if trace_cmd_available() {
        let dat = dir.file("crash.dat");
        let r = run_bounded(
            &[
                "run",
                "--guest",
                &g,
                "--rate",
                "20",
                "--events",
                "3000",
                "--vcpus",
                "1",
                "--buffer-kb",
                "16",
                "--drain",
                "none",
                "--crash-dump",
                &dat,
            ],
            &dir,
            "crash-dat",
        );
        assert_eq!(r.code, Some(3), "{}", r.stderr);
        let o = Command::new("trace-cmd")
            .args(["report", &dat])
            .output()
            .expect("trace-cmd");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("seq=2999 value=2999"), "{out}");
    }
}

/// A guest that stops making progress: `--hang-timeout` fires, the dump is written,
/// exit 3, `--stats` says `guest_hung`.
#[test]
fn hang_timeout_fires_and_dumps() {
    if !kvm_available(KRATE, "hang_timeout_fires_and_dumps") {
        return;
    }
    let _l = vm_lock();
    let g = guest();
    let dir = TempDir::new("hang");
    let stats = dir.file("stats.json");
    let (t, r) = crash_case(
        &g,
        &dir,
        sc::CRASH_HANG,
        5000,
        &["--hang-timeout", "2", "--stats", &stats],
    );
    assert!(r.stderr.contains("the guest hung"), "{}", r.stderr);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("json");
    assert_eq!(json["end"], "guest_hung", "{json}");
    assert_eq!(json["exit_code"], 3, "{json}");
    println!("MEASURE hang: dump {} events, {} lost", t.events, t.dropped);
}

/// Without `--crash-dump` (and `--drain live`) a crash still prints its reason and
/// the last event per vCPU, and writes no file.
#[test]
fn crash_without_dump_file_reports() {
    if !kvm_available(KRATE, "crash_without_dump_file_reports") {
        return;
    }
    let _l = vm_lock();
    let g = guest();
    let dir = TempDir::new("nodump");
    let err = dir.file("err");
    let t = Instant::now();
    let child = Command::new(BIN)
        .current_dir(dir.path())
        .args([
            "run", "--guest", &g, "--rate", "21", "--events", "100", "--vcpus", "1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&err).expect("err")))
        .spawn()
        .expect("spawn");
    let r = finish(child, &err, t);
    assert_eq!(r.code, Some(3), "{}", r.stderr);
    assert!(r.stderr.contains("guest panic"), "{}", r.stderr);
    assert!(!r.stderr.contains("crash dump:"), "{}", r.stderr);
    assert_eq!(dir.entries(), vec!["err".to_string()]);
}

/// Reads a trace memory file and returns each CPU's `entries` (from its control block).
fn entries_in(path: &str) -> Vec<u64> {
    let bytes = std::fs::read(path).expect("trace mem");
    let img = trace_file::parse(&bytes).expect("parse");
    (0..img.layout.nr_cpus)
        .map(|c| {
            img.region.load(
                img.layout.ctl(c) + ctl::ENTRIES,
                std::sync::atomic::Ordering::Relaxed,
            )
        })
        .collect()
}

/// Starts an honest writer for ever with `--trace-mem`, waits (bounded) until every
/// vCPU wrote at least `min` events, SIGKILLs it; returns when the kill was sent.
fn run_and_kill(
    args: &[&str],
    mem: &str,
    stdout: Option<&str>,
    err: &str,
    min: u64,
    extra_ms: u64,
) -> Instant {
    let t = Instant::now();
    let mut child = spawn(args, stdout, err);
    loop {
        let ok = std::fs::read(mem)
            .ok()
            .and_then(|b| {
                trace_file::parse(&b).ok().map(|img| {
                    (0..img.layout.nr_cpus).all(|c| {
                        img.region.load(
                            img.layout.ctl(c) + ctl::ENTRIES,
                            std::sync::atomic::Ordering::Relaxed,
                        ) >= min
                    })
                })
            })
            .unwrap_or(false);
        if ok {
            break;
        }
        if let Some(st) = child.try_wait().expect("try_wait") {
            panic!(
                "hyptrace ended before the kill ({st}): {}",
                std::fs::read_to_string(err).unwrap_or_default()
            );
        }
        if t.elapsed() > WALL {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no progress in {mem} within {WALL:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(extra_ms));
    child.kill().expect("SIGKILL");
    let killed = Instant::now();
    let st = child.wait().expect("wait");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&st),
        Some(9),
        "{st}"
    );
    killed
}

/// SIGKILL mid-run with `--drain none --trace-mem`: `dump --trace-mem` recovers the
/// newest events of each CPU, contiguous except at reported losses, ending at the
/// last committed event (the control block's `entries` can lag the pages by one), a
/// ring's worth per CPU; the file is owner-only; trace-cmd reads the trace.dat.
#[test]
fn sigkill_drain_none_dump_recovers_the_newest() {
    if !kvm_available(KRATE, "sigkill_drain_none_dump_recovers_the_newest") {
        return;
    }
    let _l = vm_lock();
    let g = guest();
    let dir = TempDir::new("kill");
    let mut rng = Rng(0x6b69_6c6c);
    const ROUNDS: usize = 3;
    for round in 0..ROUNDS {
        // A fresh path per round: `run_and_kill` polls the file for progress, and a
        // previous round's file (which already shows every CPU past `min`) would end
        // the wait before the new VMM has replaced it.
        let mem = dir.file(&format!("vm{round}.trace"));
        let err = dir.file(&format!("run{round}.err"));
        let sc = sc::HONEST.to_string();
        let killed = run_and_kill(
            &[
                "run",
                "--guest",
                &g,
                "--rate",
                &sc,
                "--events",
                "0",
                "--vcpus",
                "2",
                "--buffer-kb",
                "64",
                "--drain",
                "none",
                "--trace-mem",
                &mem,
            ],
            &mem,
            None,
            &err,
            2000,
            rng.below(300),
        );
        let mode = std::fs::metadata(&mem).expect("meta").permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        let entries = entries_in(&mem);
        let txt = dir.file(&format!("dump{round}.txt"));
        let r = run_bounded(&["dump", "--trace-mem", &mem, "-o", &txt], &dir, "dump");
        let to_dump = killed.elapsed();
        no_panic(&r, "dump");
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        assert!(!r.stderr.contains("warning"), "{}", r.stderr);
        let t = check_text(&txt, 2);
        for (c, tc) in t.iter().enumerate() {
            let last = tc.last_seq.expect("events");
            assert!(
                last + 1 == entries[c] || last == entries[c],
                "cpu {c}: last seq {last}, entries {}",
                entries[c]
            );
            // 64 KiB: 15 ring pages of 142 markers; all but the tail page full.
            assert!(tc.events >= 14 * MARKERS_PER_PAGE, "cpu {c}: {tc:?}");
            assert_eq!(tc.events + tc.dropped, last + 1, "cpu {c}: {tc:?}");
        }
        println!(
            "MEASURE sigkill round {round}: per CPU {:?} events recovered (complete: last seq = last committed), kill-to-dump-written {:.1} ms (dump process {:.1} ms)",
            t.iter().map(|c| c.events).collect::<Vec<_>>(),
            to_dump.as_secs_f64() * 1e3,
            r.wall.as_secs_f64() * 1e3
        );
    }
    if trace_cmd_available() {
        let mem = dir.file(&format!("vm{}.trace", ROUNDS - 1));
        let dat = dir.file("dump.dat");
        let r = run_bounded(&["dump", "--trace-mem", &mem, "-o", &dat], &dir, "dumpdat");
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        let o = Command::new("trace-cmd")
            .args(["report", &dat])
            .output()
            .expect("trace-cmd");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(String::from_utf8_lossy(&o.stdout).contains("marker:"));
    }
}

/// SIGKILL mid-run with `--drain live --trace-mem`: the dump holds only events the
/// live reader had not consumed — none of them was printed on stdout (no duplicates),
/// every CPU's dump starts after what was printed.
#[test]
fn sigkill_drain_live_dump_has_no_duplicates() {
    if !kvm_available(KRATE, "sigkill_drain_live_dump_has_no_duplicates") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("live");
    let mem = dir.file("vm.trace");
    let out = dir.file("out.txt");
    let err = dir.file("run.err");
    // Paced, with 64 KiB pages: the reader keeps up and sits on the page the writer
    // is on, having consumed (and printed: stdout is flushed every 64 KiB) part of it
    // — a dump that ignored the reader's position would repeat those events.
    run_and_kill(
        &[
            "run",
            "--events",
            "100000000",
            "--rate",
            "5000",
            "--vcpus",
            "2",
            "--page-size",
            "65536",
            "--buffer-kb",
            "512",
            "--trace-mem",
            &mem,
        ],
        &mem,
        Some(&out),
        &err,
        3000,
        300,
    );
    let printed = std::fs::read_to_string(&out).expect("stdout");
    // The last line may be cut by the kill.
    let mut max_printed = [None::<u64>; 2];
    for l in printed.lines() {
        if let Ok(Line::Event(e)) = hyptrace::text::parse_line(l) {
            if let (Some(s), Some(m)) = (e.seq(), max_printed.get_mut(e.cpu as usize)) {
                *m = Some(m.map_or(s, |x: u64| x.max(s)));
            }
        }
    }
    let txt = dir.file("dump.txt");
    let r = run_bounded(&["dump", "--trace-mem", &mem, "-o", &txt], &dir, "dump");
    no_panic(&r, "dump");
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let text = std::fs::read_to_string(&txt).expect("dump");
    let mut first_dumped = [None::<u64>; 2];
    for l in parse_all(&text, "dump") {
        if let Line::Event(e) = l {
            let f = &mut first_dumped[e.cpu as usize];
            if f.is_none() {
                *f = e.seq();
            }
        }
    }
    for c in 0..2 {
        if let (Some(p), Some(d)) = (max_printed[c], first_dumped[c]) {
            assert!(
                d > p,
                "cpu {c}: dump starts at seq {d}, but {p} was printed"
            );
        }
    }
    println!("MEASURE live sigkill: printed up to {max_printed:?}, dump from {first_dumped:?}");
}

/// A short finished run's trace memory file, and what it holds.
fn finished_file(dir: &TempDir) -> Vec<u8> {
    let mem = dir.file("done.trace");
    // An existing file is reused, made owner-only.
    std::fs::write(&mem, b"old").expect("write");
    std::fs::set_permissions(&mem, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .expect("chmod");
    let r = run_bounded(
        &[
            "run",
            "--events",
            "3000",
            "--vcpus",
            "2",
            "--buffer-kb",
            "32",
            "--drain",
            "none",
            "--trace-mem",
            &mem,
        ],
        dir,
        "done",
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let mode = std::fs::metadata(&mem).expect("meta").permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600
    );
    // The file of a finished run dumps too: the positions are those of the live
    // reader (none with `--drain none`), so the dump holds what the rings held at the
    // end — what the final walk printed.
    let txt = dir.file("done.txt");
    let d = run_bounded(&["dump", "--trace-mem", &mem, "-o", &txt], dir, "donedump");
    assert_eq!(d.code, Some(0), "{}", d.stderr);
    std::fs::read(&mem).expect("file")
}

/// Walks every CPU of a (possibly corrupted) file in process, from its recorded
/// positions and from none: must not panic; a bounded amount of output. Returns the
/// events of the walks from no position (a finished run recorded that it printed
/// everything: from its positions nothing is left, P2).
fn walk_all(bytes: &[u8]) -> Result<u64, String> {
    let img = trace_file::parse(bytes).map_err(|e| e.to_string())?;
    let mut events = 0u64;
    for c in 0..img.layout.nr_cpus {
        for pos in [img.positions[c as usize], None] {
            let d = walk_cpu(&img.region, &img.layout, c, pos, |p| {
                assert_eq!(p.bytes.len(), img.layout.page_size);
                Ok::<(), ()>(())
            })
            .expect("no sink error");
            // Older pages (P2) may come before the walk's own: still each page once.
            assert!(d.pages <= u64::from(img.layout.pages_per_cpu));
            if pos.is_none() {
                events += d.events;
            }
        }
    }
    Ok(events)
}

/// Corrupted trace memory files — random bytes, truncated, wrong magic, hostile
/// footers, links, commits, page_seq and first_index — give an error or a partial dump
/// with warnings, never a panic or a hang (in process, and through `hyptrace dump`).
#[test]
fn corrupted_trace_mem_files() {
    if !kvm_available(KRATE, "corrupted_trace_mem_files") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("corrupt");
    let good = finished_file(&dir);
    let base = walk_all(&good).expect("good file");
    assert!(base > 0);
    let img = trace_file::parse(&good).expect("parse");
    let l = img.layout;
    let hdr = trace_file::header_size(l.nr_cpus);
    let mut rng = Rng(0x636f_7272);
    let mut cases: Vec<(String, Vec<u8>)> = Vec::new();
    // Random bytes.
    cases.push((
        "random".into(),
        (0..good.len()).map(|_| rng.next() as u8).collect(),
    ));
    // Wrong magic.
    let mut b = good.clone();
    b[0] ^= 0xff;
    cases.push(("magic".into(), b));
    // Truncated at many places.
    for cut in [
        0,
        7,
        255,
        hdr - 1,
        hdr + 100,
        hdr + l.pages_off + 5000,
        good.len() - 1,
    ] {
        cases.push((
            format!("truncated at {cut}"),
            good[..cut.min(good.len())].to_vec(),
        ));
    }
    // Hostile footers, links, commits, sequence numbers, first indexes, positions.
    let word = |b: &mut Vec<u8>, off: usize, v: u64| {
        b[off..off + 8].copy_from_slice(&v.to_le_bytes());
    };
    for k in 0..40 {
        let mut b = good.clone();
        let cpu = (k % l.nr_cpus as usize) as u32;
        let page = l.first_page(cpu) + (rng.below(u64::from(l.pages_per_cpu)) as u32);
        let f = hdr + l.footer_off(page);
        use hyptrace_abi::layout::footer;
        match k % 8 {
            0 => word(&mut b, f + footer::PAGE_SEQ, rng.below(4)),
            1 => word(&mut b, f + footer::FIRST_INDEX, rng.next()),
            2 => word(&mut b, f + footer::NEXT, rng.next()),
            3 => word(&mut b, f + footer::ID_MAGIC, rng.next()),
            4 => word(&mut b, hdr + l.page_off(page) + 8, rng.next()),
            5 => word(&mut b, hdr + l.ctl(cpu) + ctl::READER_PAGE, rng.next()),
            6 => word(
                &mut b,
                hdr + l.ctl(cpu) + ctl::ENTRIES,
                u64::MAX - rng.below(3),
            ),
            _ => {
                // Garbage in a page's data: torn or misframed events.
                for _ in 0..64 {
                    let off = hdr + l.page_off(page) + 16 + rng.below(4000) as usize;
                    b[off] = rng.next() as u8;
                }
            }
        }
        // And sometimes a hostile position record.
        if k % 3 == 0 {
            let p = trace_file::HEADER_FIXED + cpu as usize * trace_file::POS_STRIDE;
            word(&mut b, p, 1 + rng.below(5));
            word(&mut b, p + 8, rng.next());
            word(&mut b, p + 16, rng.next());
            word(&mut b, p + 32, rng.below(8));
            word(&mut b, p + 40, rng.next() >> rng.below(64));
        }
        cases.push((format!("hostile {k}"), b));
    }
    let mut errors = 0;
    for (what, bytes) in &cases {
        match std::panic::catch_unwind(|| walk_all(bytes)) {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => errors += 1,
            Err(_) => panic!("{what}: the walk panicked"),
        }
    }
    assert!(errors >= 3, "random, magic and short files must be errors");
    // A few through the CLI: exit 0 (partial, warnings) or 2 (unusable), no panic.
    for (i, (what, bytes)) in cases.iter().enumerate().step_by(7) {
        let p = dir.file(&format!("bad{i}.trace"));
        std::fs::write(&p, bytes).expect("write");
        let out = dir.file(&format!("bad{i}.dat"));
        let r = run_bounded(&["dump", "--trace-mem", &p, "-o", &out], &dir, "bad");
        no_panic(&r, what);
        assert!(
            matches!(r.code, Some(0) | Some(2)),
            "{what}: {:?} {}",
            r.code,
            r.stderr
        );
        if r.code == Some(2) {
            assert!(
                r.stderr.contains("hyptrace: error: "),
                "{what}: {}",
                r.stderr
            );
        }
    }
    let r = run_bounded(
        &[
            "dump",
            "--trace-mem",
            &dir.file("nope"),
            "-o",
            &dir.file("x.dat"),
        ],
        &dir,
        "nope",
    );
    assert_eq!(r.code, Some(2), "{}", r.stderr);
}

/// `--drain none` without a crash: nothing is read while the guest runs, the final walk
/// gets the newest ring-full (overwrite): the last event, contiguous, exact losses,
/// written = read + lost (exit 0). With `--mode stop` the first ring-full, and a note.
#[test]
fn drain_none_keeps_the_newest_or_the_first() {
    if !kvm_available(KRATE, "drain_none_keeps_the_newest_or_the_first") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("drain");
    let out = dir.file("o.txt");
    let r = run_bounded(
        &[
            "record",
            "-o",
            &out,
            "--drain",
            "none",
            "--events",
            "20000",
            "--rate",
            "0",
            "--vcpus",
            "2",
            "--buffer-kb",
            "16",
        ],
        &dir,
        "over",
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    for t in check_text(&out, 2) {
        assert_eq!(t.last_seq, Some(19_999), "{t:?}");
        assert_eq!(t.events + t.dropped, 20_000, "{t:?}");
        assert!(t.events >= 2 * MARKERS_PER_PAGE && t.events < 4 * MARKERS_PER_PAGE);
    }
    let r = run_bounded(
        &[
            "record",
            "-o",
            &out,
            "--drain",
            "none",
            "--mode",
            "stop",
            "--events",
            "20000",
            "--rate",
            "0",
            "--vcpus",
            "2",
            "--buffer-kb",
            "16",
        ],
        &dir,
        "stop",
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(
        r.stderr.contains("keeps the first ring-full"),
        "{}",
        r.stderr
    );
    for t in check_text(&out, 2) {
        assert_eq!(t.events + t.trailing, 20_000, "{t:?}");
        assert!(t.events >= 2 * MARKERS_PER_PAGE && t.events < 4 * MARKERS_PER_PAGE);
        assert_eq!(t.last_seq, Some(t.events - 1), "the first events: {t:?}");
    }
}

/// `--hang-timeout` counts progress, not speed: a guest writing 20 events/s with a
/// 1-second timeout is not hung (exit 0).
#[test]
fn slow_guest_is_not_hung() {
    if !kvm_available(KRATE, "slow_guest_is_not_hung") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("slow");
    let r = run_bounded(
        &[
            "run",
            "--events",
            "40",
            "--rate",
            "20",
            "--vcpus",
            "1",
            "--hang-timeout",
            "1",
        ],
        &dir,
        "slow",
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(!r.stderr.contains("hung"), "{}", r.stderr);
}

/// `--trace-mem` in a directory that does not exist: exit 2, the flag named.
#[test]
fn trace_mem_bad_path_is_bad_input() {
    let dir = TempDir::new("badpath");
    let p = dir.file("missing/vm.trace");
    let r = run_bounded(&["run", "--events", "1", "--trace-mem", &p], &dir, "bad");
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("--trace-mem"), "{}", r.stderr);
}
