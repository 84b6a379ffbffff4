//! The command line under real use (issue 9), with the real binary: signals (a clean
//! stop, `timeout`'s double signal, an abort that leaves nothing behind), output paths
//! refused before the VM starts, one root-cause message per failure, a closed stdout,
//! whole argument errors, the summary's wording and hints, `--stats` (how the run ended,
//! the crash detail), the heartbeat, `bench --quick`'s rate and the README.
//!
//! VM-booting tests are skipped without /dev/kvm (unless HYPTRACE_REQUIRE_KVM=1); the
//! ones that need root (mount, mknod) print `SKIP: ...` when they cannot. Every wait is
//! bounded; no duration is asserted.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// How long any one child may take before the test kills it and fails.
const LIMIT: Duration = Duration::from_secs(120);

fn stats(path: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
}

/// Every vCPU of `--stats` balances: written = read + lost.
fn assert_balanced(s: &serde_json::Value) {
    for c in s["cpus"].as_array().expect("cpus") {
        let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{k} in {c}"));
        assert_eq!(u("written"), u("read") + u("lost"), "{s}");
    }
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &str) {
    let st = Command::new("mkfifo").arg(path).status().expect("mkfifo");
    assert!(st.success(), "mkfifo {path}");
}

/// Spawns `cmd` with its stderr read on a thread: lines arrive on the channel as they
/// come.
fn spawn_watched(
    cmd: &mut Command,
) -> (Child, mpsc::Receiver<String>, std::thread::JoinHandle<()>) {
    let mut child = cmd.stderr(Stdio::piped()).spawn().expect("spawn");
    let err = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        for line in BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx, h)
}

/// Waits (bounded) until the pipe `r` reads from holds at least half its capacity: what
/// the run has left to print then (the rest of its rings) no longer fits, so it blocks.
fn wait_pipe_full(r: &impl std::os::fd::AsRawFd) {
    let fd = r.as_raw_fd();
    let t0 = Instant::now();
    loop {
        // SAFETY: fcntl F_GETPIPE_SZ on a pipe fd this process owns; no memory passed.
        let size = unsafe { libc::fcntl(fd, libc::F_GETPIPE_SZ) };
        let mut held: libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int to the pointer, which is valid for the call.
        let ok = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut held) } == 0;
        if ok && size > 0 && held >= size / 2 {
            return;
        }
        assert!(
            t0.elapsed() < LIMIT,
            "the pipe never filled ({held} of {size} bytes)"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits (bounded) for a stderr line containing `needle`; returns the lines so far.
fn wait_line(rx: &mpsc::Receiver<String>, needle: &str, seen: &mut Vec<String>) {
    let t0 = Instant::now();
    while t0.elapsed() < LIMIT {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) => {
                let hit = l.contains(needle);
                seen.push(l);
                if hit {
                    return;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    panic!("no stderr line with {needle:?}: {seen:#?}");
}

/// A tmpfs mounted on a new directory (unmounted when dropped), or `None` with a SKIP
/// line when this process may not mount.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn new(dir: &TempDir, name: &str, opts: &str) -> Option<Self> {
        let p = dir.path().join(name);
        std::fs::create_dir(&p).expect("mkdir");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(&p)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            println!("SKIP: cannot mount a tmpfs (needs root)");
            return None;
        }
        Some(Self(p))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// `mknod path c major minor`, or `None` with a SKIP line without the privilege.
fn mknod_char(path: &Path, major: u32, minor: u32) -> Option<()> {
    let ok = Command::new("mknod")
        .arg(path)
        .args(["c", &major.to_string(), &minor.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("SKIP: cannot mknod (needs root)");
    }
    ok.then_some(())
}

fn trace_complete(path: &str) -> bool {
    env::run(BIN, &["report", "-i", path, "--stat"])
        .status
        .success()
}

// ---- 2: signals ---------------------------------------------------------------------

/// `timeout -s INT` signals the process and then its group: two SIGINTs at once. They
/// count as one clean stop: exit 0, a complete trace.dat, no temporary or spill file,
/// `--stats` says the run ended by a signal. 20 times. On a loaded machine the signal
/// can come before the process has installed its handlers (before it creates any
/// file): then it dies of the SIGINT (130) and leaves nothing at all.
#[test]
fn interrupted_records_leave_no_debris() {
    if !kvm_available(KRATE, "interrupted_records_leave_no_debris") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("int");
    let (out, st) = (dir.file("t.dat"), dir.file("s.json"));
    let mut clean = 0;
    for i in 0..20 {
        let o = Command::new("timeout")
            .args([
                "--preserve-status",
                "-s",
                "INT",
                "1",
                BIN,
                "record",
                "-o",
                &out,
            ])
            .args(["--stats", &st, "--events", "100000000"])
            .output()
            .expect("timeout");
        let err = env::stderr(&o);
        if o.status.code() == Some(130) && err.is_empty() {
            assert!(dir.entries().is_empty(), "run {i}: {:?}", dir.entries());
            continue;
        }
        clean += 1;
        assert_eq!(o.status.code(), Some(0), "run {i}: {err}");
        check_clean_stop(&dir, &out, &st, &err, &format!("run {i}"));
    }
    println!("{clean} of 20 runs stopped cleanly, the others were signalled before start-up");
}

/// Waits (bounded by `LIMIT`) until process `pid` catches SIGINT: its handler is
/// installed (`SigCgt` in /proc/PID/status has SIGINT's bit).
fn wait_sigint_caught(pid: u32) {
    let caught = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .is_some_and(|m| m & (1 << (libc::SIGINT - 1)) != 0)
    };
    let t0 = Instant::now();
    while !caught() && t0.elapsed() < LIMIT {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A clean stop by SIGINT: one "stopping" line, no abort, complete output, `--stats`
/// says `signal`; removes the files for the next run.
fn check_clean_stop(dir: &TempDir, out: &str, st: &str, err: &str, what: &str) {
    assert_eq!(
        err.matches("stopping… (Ctrl-C again to abort)").count(),
        1,
        "{what}: {err}"
    );
    assert!(!err.contains("aborting"), "{what}: {err}");
    assert!(
        err.contains("stopped: interrupted by SIGINT"),
        "{what}: {err}"
    );
    assert_eq!(dir.entries(), ["s.json", "t.dat"], "{what}: {err}");
    assert!(trace_complete(out), "{what}: incomplete trace.dat");
    let s = stats(st);
    assert_eq!(s["end"], "signal", "{s}");
    assert_eq!(s["exit_code"], 0, "{s}");
    assert_balanced(&s);
    std::fs::remove_file(out).expect("rm");
    std::fs::remove_file(st).expect("rm");
}

/// What `timeout` does, once the run is under way (its temporary files exist): SIGINT
/// to the process, then to its process group, at once. One clean stop, every time.
#[test]
fn signal_to_process_and_group_is_one_stop() {
    use std::os::unix::process::CommandExt;
    if !kvm_available(KRATE, "signal_to_process_and_group_is_one_stop") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("grp");
    let (out, st) = (dir.file("t.dat"), dir.file("s.json"));
    for i in 0..5 {
        let mut child = Command::new(BIN)
            .args([
                "record",
                "-o",
                &out,
                "--stats",
                &st,
                "--events",
                "100000000",
            ])
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let t0 = Instant::now();
        while dir.entries().is_empty() && t0.elapsed() < LIMIT {
            std::thread::sleep(Duration::from_millis(10));
        }
        // The output's temporary file can come before the signal handlers (under load
        // the SIGINT then killed the process: exit by signal, nothing on stderr).
        wait_sigint_caught(child.id());
        let pid = child.id().to_string();
        let group = format!("-{pid}");
        let st_kill = Command::new("sh")
            .args(["-c", "kill -INT \"$1\" \"$2\"", "sh", &pid, &group])
            .status()
            .expect("kill");
        assert!(st_kill.success());
        let (code, err) = stderr_and_exit(&mut child, "record");
        assert_eq!(code, Some(0), "run {i}: {err}");
        check_clean_stop(&dir, &out, &st, &err, &format!("run {i}"));
    }
}

/// A second Ctrl-C, later than the burst window, aborts: exit 130. The run is held in a
/// write to a stdout pipe nobody reads, so the first Ctrl-C cannot complete the stop
/// before the second arrives.
#[test]
fn second_ctrl_c_aborts_with_130() {
    if !kvm_available(KRATE, "second_ctrl_c_aborts_with_130") {
        return;
    }
    let _vm = vm_lock();
    let (mut child, rx, reader) = spawn_watched(
        Command::new(BIN)
            .args(["run", "--events", "100000000"])
            .stdout(Stdio::piped()),
    );
    let mut stdout = child.stdout.take().expect("stdout");
    // A one-page pipe: a few dozen lines fill it, far less than the rings hold.
    // SAFETY: F_SETPIPE_SZ on a pipe fd this process owns; no memory passed. (It may
    // fail if the run already wrote more: then the pipe keeps its size.)
    unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&stdout),
            libc::F_SETPIPE_SZ,
            4096,
        )
    };
    // The run prints: its handlers are installed. Then the unread pipe fills up (a
    // condition, waited for): the run blocks on its output, so the first Ctrl-C cannot
    // finish it and the second one aborts.
    let mut byte = [0u8; 1];
    stdout.read_exact(&mut byte).expect("first byte");
    wait_pipe_full(&stdout);
    env::signal(&child, "-INT");
    let mut seen = Vec::new();
    wait_line(&rx, "stopping…", &mut seen);
    std::thread::sleep(Duration::from_millis(700));
    env::signal(&child, "-INT");
    wait_line(&rx, "aborting", &mut seen);
    drop(stdout);
    let st = env::wait_exit(&mut child, "aborted run", LIMIT);
    reader.join().expect("stderr reader");
    seen.extend(rx.try_iter());
    assert_eq!(st.code(), Some(130), "{seen:#?}");
    assert!(seen.iter().any(|l| l.contains("aborted")), "{seen:#?}");
    assert!(!seen.iter().any(|l| l.contains("panicked")), "{seen:#?}");
    abort_during_a_long_final_walk();
}

/// The bound on an abort's exit in [`abort_during_a_long_final_walk`]: generous (the
/// goal is under 1 s, printed), far below the ~15 s the walk it cuts short takes.
const ABORT_BOUND: Duration = Duration::from_secs(8);

/// A second Ctrl-C while the clean stop's final walks write 2 × 128 MiB of full rings
/// to JSON (~15 s): the walk and the sink thread stop at once, exit 130, no file left.
fn abort_during_a_long_final_walk() {
    let dir = TempDir::new("abort-walk");
    let out = dir.file("t.json");
    let (mut child, rx, reader) = spawn_watched(
        Command::new(BIN)
            .args([
                "record",
                "-o",
                &out,
                "--rate",
                "0",
                "--events",
                "10000000000", // minutes flat out: still writing at the signals
                "--vcpus",
                "2",
                "--buffer-kb",
                "131072",
            ])
            .stdout(Stdio::null()),
    );
    let mut seen = Vec::new();
    // The first heartbeat: 5 s flat out, far more than the rings hold.
    wait_line(&rx, "recording:", &mut seen);
    env::signal(&child, "-INT");
    wait_line(&rx, "stopping…", &mut seen);
    // Past the burst window: the next signal is a second Ctrl-C.
    std::thread::sleep(Duration::from_millis(700));
    env::signal(&child, "-INT");
    let t0 = Instant::now();
    let st = env::wait_exit(&mut child, "abort during the final walk", ABORT_BOUND);
    let took = t0.elapsed();
    println!("second Ctrl-C to exit: {:.3} s", took.as_secs_f64());
    reader.join().expect("stderr reader");
    seen.extend(rx.try_iter());
    assert_eq!(st.code(), Some(130), "{seen:#?}");
    assert!(seen.iter().any(|l| l.contains("aborting")), "{seen:#?}");
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
}

/// Two Ctrl-Cs apart during a `record`: whichever wins (the clean stop finishing, or
/// the abort), no temporary or spill file is left, and the output is complete (exit 0)
/// or absent (exit 130).
#[test]
fn ctrl_c_twice_during_record_leaves_complete_or_nothing() {
    if !kvm_available(
        KRATE,
        "ctrl_c_twice_during_record_leaves_complete_or_nothing",
    ) {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("int2");
    let out = dir.file("t.dat");
    for format in ["dat", "json", "text"] {
        let (mut child, rx, reader) = spawn_watched(
            Command::new(BIN)
                .args(["record", "-o", &out, "--format", format])
                .args(["--events", "100000000", "--vcpus", "2", "--rate", "0"])
                .stdout(Stdio::null()),
        );
        // Wait for the sink's temporary files: the run is under way.
        let t0 = Instant::now();
        while dir.entries().is_empty() && t0.elapsed() < LIMIT {
            std::thread::sleep(Duration::from_millis(10));
        }
        wait_sigint_caught(child.id());
        std::thread::sleep(Duration::from_millis(200));
        env::signal(&child, "-INT");
        let mut seen = Vec::new();
        wait_line(&rx, "stopping…", &mut seen);
        std::thread::sleep(Duration::from_millis(600));
        let _ = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status();
        let st = env::wait_exit(&mut child, "record", LIMIT);
        reader.join().expect("stderr reader");
        seen.extend(rx.try_iter());
        match st.code() {
            Some(0) => {
                assert_eq!(dir.entries(), ["t.dat"], "{format}: {seen:#?}");
                if format == "dat" {
                    assert!(trace_complete(&out), "{format}");
                }
                std::fs::remove_file(&out).expect("rm");
            }
            Some(130) => assert!(dir.entries().is_empty(), "{format}: {:?}", dir.entries()),
            c => panic!("{format}: exit {c:?}: {seen:#?}"),
        }
    }
}

/// A record into a FIFO nobody reads waits for a reader, and says so; Ctrl-C ends
/// the wait: exit 130, a message naming the FIFO, no spill file. The same for a
/// `--stats` FIFO, waited for at the end.
#[test]
fn ctrl_c_ends_a_wait_for_a_fifo_reader() {
    if !kvm_available(KRATE, "ctrl_c_ends_a_wait_for_a_fifo_reader") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("fifo");
    let fifo = dir.file("pipe");
    mkfifo(&fifo);
    let out = dir.file("t.dat");
    for (args, needle) in [
        (
            vec!["record", "-o", &fifo, "--events", "100000"],
            fifo.clone(),
        ),
        (
            vec![
                "record", "-o", &fifo, "--format", "json", "--events", "100000",
            ],
            fifo.clone(),
        ),
        (
            vec!["record", "-o", &out, "--events", "1000", "--stats", &fifo],
            "--stats".to_string(),
        ),
    ] {
        let (mut child, rx, reader) =
            spawn_watched(Command::new(BIN).args(&args).stdout(Stdio::null()));
        let mut seen = Vec::new();
        wait_line(&rx, "waiting for a reader of the FIFO", &mut seen);
        env::signal(&child, "-INT");
        let st = env::wait_exit(&mut child, "record to a fifo", LIMIT);
        reader.join().expect("stderr reader");
        seen.extend(rx.try_iter());
        assert_eq!(st.code(), Some(130), "{args:?}: {seen:#?}");
        assert!(
            seen.iter()
                .any(|l| l.contains("no reader opened") && l.contains(&needle)),
            "{args:?}: {seen:#?}"
        );
        let _ = std::fs::remove_file(&out);
        assert_eq!(dir.entries(), ["pipe"], "{args:?}: {seen:#?}");
    }
}

// ---- 3: output paths checked before the VM starts ------------------------------------

/// Exit 2, one `hyptrace: error: cannot write PATH (FLAG): ...` line, nothing else: no
/// vCPU line, no bench section was started.
fn assert_refused(args: &[&str], path: &str, flag: &str, needle: &str) {
    let o = env::run(BIN, args);
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(
        err.starts_with(&format!("hyptrace: error: cannot write {path} ({flag}): ")),
        "{args:?}: {err}"
    );
    assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
    assert!(o.stdout.is_empty(), "{args:?}");
}

#[test]
fn bad_destinations_refused_before_the_vm_starts() {
    let dir = TempDir::new("dest");
    let d = dir.path().to_str().expect("utf-8").to_string();
    let file = dir.file("file");
    std::fs::write(&file, b"x").expect("write");
    let out = dir.file("t.dat");
    let nodir = dir.file("missing/s.json");
    let under_file = format!("{file}/s.json");
    assert_refused(&["record", "-o", &d], &d, "-o", "is a directory");
    for fmt in ["dat", "json", "text", "raw"] {
        assert_refused(
            &["record", "-o", &d, "--format", fmt],
            &d,
            "-o",
            "is a directory",
        );
    }
    assert_refused(
        &["record", "-o", &out, "--stats", &nodir],
        &nodir,
        "--stats",
        "does not exist",
    );
    assert_refused(
        &["record", "-o", &out, "--stats", &d],
        &d,
        "--stats",
        "directory",
    );
    assert_refused(&["run", "--stats", &d], &d, "--stats", "is a directory");
    assert_refused(
        &["run", "--stats", &under_file],
        &under_file,
        "--stats",
        "Not a directory",
    );
    assert_refused(
        &["bench", "--quick", "--json", &d],
        &d,
        "--json",
        "is a directory",
    );
    assert_refused(
        &["bench", "--quick", "--json", &nodir],
        &nodir,
        "--json",
        "does not exist",
    );
    // An extension that names no format, without --format: refused, never guessed.
    for name in ["x.unknownext", "x.dat6"] {
        let p = dir.file(name);
        assert_refused(&["record", "-o", &p], &p, "-o", "unknown extension");
        assert_refused(&["run", "--crash-dump", &p], &p, "--crash-dump", ".pftrace");
        assert_refused(&["convert", "-i", &file, "-o", &p], &p, "-o", "--format");
    }
    assert_eq!(dir.entries(), ["file"]);
    // A read-only location.
    if let Some(ro) = Tmpfs::new(&dir, "ro", "ro,size=64k") {
        let p = ro.0.join("b.json").to_str().expect("utf-8").to_string();
        assert_refused(
            &["bench", "--quick", "--json", &p],
            &p,
            "--json",
            "Read-only",
        );
        let p = ro.0.join("t.dat").to_str().expect("utf-8").to_string();
        assert_refused(&["record", "-o", &p], &p, "-o", "Read-only");
    }
}

/// `bench --criterion DIR` without criterion results: exit 2 before anything runs, and
/// the `--json` file (here one that had figures) is left as it was (an empty import once
/// wrote `"criterion": {}` over the tracked docs/bench.json).
#[test]
fn bench_criterion_without_results_is_refused() {
    let dir = TempDir::new("crit");
    let empty = dir.file("criterion");
    std::fs::create_dir(&empty).expect("mkdir");
    let json = dir.file("b.json");
    std::fs::write(&json, b"{\"criterion\": {\"x\": 1}}").expect("write");
    let o = env::run(
        BIN,
        &["bench", "--quick", "--json", &json, "--criterion", &empty],
    );
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no criterion results"), "{err}");
    assert_eq!(
        std::fs::read(&json).expect("read"),
        b"{\"criterion\": {\"x\": 1}}"
    );
}

// ---- 5: write failures --------------------------------------------------------------

/// ENOSPC while recording: exit 1, the cause said once, as the last line; no success
/// line, no MISMATCH (a vCPU whose reading the failure cut short is INCOMPLETE, with
/// the number of events not read), no file.
#[test]
fn full_disk_reports_one_cause_last() {
    if !kvm_available(KRATE, "full_disk_reports_one_cause_last") {
        return;
    }
    let dir = TempDir::new("enospc");
    let Some(small) = Tmpfs::new(&dir, "small", "size=64k") else {
        return;
    };
    let _vm = vm_lock();
    let st = dir.file("s.json");
    for fmt in ["dat", "json", "text", "raw"] {
        let out = small.0.join("x.out").to_str().expect("utf-8").to_string();
        let o = env::run(
            BIN,
            &[
                "record", "-o", &out, "--format", fmt, "--events", "200000", "--stats", &st,
            ],
        );
        let err = env::stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{fmt}: {err}");
        let errors: Vec<&str> = err.lines().filter(|l| l.contains("error")).collect();
        assert_eq!(errors.len(), 1, "{fmt}: {err}");
        assert_eq!(err.lines().last(), Some(errors[0]), "{fmt}: {err}");
        assert!(
            errors[0].contains("No space left on device"),
            "{fmt}: {err}"
        );
        // One path per message.
        assert_eq!(errors[0].matches(out.as_str()).count(), 1, "{fmt}: {err}");
        // The total is true arithmetic: written = read + lost + unread.
        let total = err
            .lines()
            .find(|l| l.contains(" vCPUs: written "))
            .unwrap_or_else(|| panic!("{fmt}: no total line: {err}"));
        let nums: Vec<u64> = total
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|t| t.parse().ok())
            .collect();
        // "N vCPUs: written W = read R + lost L [+ unread U] (overrun ...".
        let (w, rd, l) = (nums[1], nums[2], nums[3]);
        let u = if total.contains("+ unread ") {
            nums[4]
        } else {
            0
        };
        assert_eq!(w, rd + l + u, "{fmt}: {total}");
        // A hint, if any, blames the output, not the ring size or the rate.
        assert!(!err.contains("--buffer-kb"), "{fmt}: {err}");
        assert!(!err.contains("written to"), "{fmt}: {err}");
        assert!(
            !err.contains("MISMATCH") && !err.contains("mismatch"),
            "{fmt}: {err}"
        );
        assert_eq!(std::fs::read_dir(&small.0).expect("ls").count(), 0, "{fmt}");
        let s = stats(&st);
        assert_eq!(s["end"], "error", "{s}");
        assert_eq!(s["exit_code"], 1, "{s}");
        for (i, c) in s["cpus"].as_array().expect("cpus").iter().enumerate() {
            let u = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{k} in {c}"));
            let line = err
                .lines()
                .find(|l| l.starts_with(&format!("hyptrace: cpu {i}: ")))
                .unwrap_or_else(|| panic!("no cpu {i} line: {err}"));
            let unread = u("written") - u("read") - u("lost");
            if unread == 0 {
                assert!(!line.contains("INCOMPLETE"), "{line}");
            } else {
                let mark = format!("INCOMPLETE: {unread} events not read after the failure");
                assert!(line.ends_with(&mark), "{line}");
            }
        }
    }
}

/// Issue 26: each path and each cause is named exactly once in an error line (one
/// line, `hyptrace: error: what: cause`).
#[test]
fn error_lines_name_each_path_and_cause_once() {
    let dir = TempDir::new("onepath");
    let missing = dir.file("missing.dat");
    let os = |errno: i32| std::io::Error::from_raw_os_error(errno).to_string();
    let once = |args: &[&str], path: &str, cause: &str, code: i32| {
        let o = env::run(BIN, args);
        let err = env::stderr(&o);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        let line = err
            .lines()
            .rfind(|l| l.starts_with("hyptrace: error: "))
            .unwrap_or_else(|| panic!("{args:?}: no error line: {err}"));
        assert_eq!(line.matches(path).count(), 1, "{args:?}: {line}");
        assert_eq!(line.matches(cause).count(), 1, "{args:?}: {line}");
    };
    let enoent = os(libc::ENOENT);
    once(
        &["convert", "-i", &missing, "-o", &dir.file("x.txt")],
        &missing,
        &enoent,
        2,
    );
    once(&["report", "-i", &missing], &missing, &enoent, 2);
    once(
        &["record", "-o", "/nonexistent-dir/x.dat", "--events", "10"],
        "/nonexistent-dir/x.dat",
        "does not exist",
        2,
    );
    if !kvm_available(KRATE, "error_lines_name_each_path_and_cause_once") {
        return;
    }
    let _vm = vm_lock();
    for fmt in ["text", "dat"] {
        let args = [
            "record",
            "-o",
            "/dev/full",
            "--format",
            fmt,
            "--events",
            "1000",
        ];
        once(&args, "/dev/full", &os(libc::ENOSPC), 1);
    }
}

/// A `--stats` that cannot be written (a full device): exit 1, the error last.
#[test]
fn stats_write_failure_is_the_last_line() {
    if !kvm_available(KRATE, "stats_write_failure_is_the_last_line") {
        return;
    }
    let dir = TempDir::new("statsfull");
    let full = dir.path().join("full");
    if mknod_char(&full, 1, 7).is_none() {
        return;
    }
    let _vm = vm_lock();
    let full = full.to_str().expect("utf-8");
    let o = env::run(BIN, &["run", "--events", "100", "--stats", full]);
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("hyptrace: error: cannot write ") && last.contains(full),
        "{err}"
    );
    assert_eq!(
        err.lines().filter(|l| l.contains("error:")).count(),
        1,
        "{err}"
    );
}

// ---- 6: a closed stdout -------------------------------------------------------------

/// `hyptrace run | head -2`: exit 0, no error, the run stopped and accounted for.
#[test]
fn closed_stdout_ends_the_run_quietly() {
    if !kvm_available(KRATE, "closed_stdout_ends_the_run_quietly") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("epipe");
    let st = dir.file("s.json");
    let mut child = Command::new(BIN)
        .args(["run", "--events", "10000000", "--stats", &st])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let (code, err) = close_stdout_after(&mut child, "run | head", |out| {
        let mut out = BufReader::new(out);
        for _ in 0..2 {
            let mut line = String::new();
            out.read_line(&mut line).expect("line");
            assert!(line.contains("marker"), "{line}");
        }
    });
    assert_eq!(code, Some(0), "{err}");
    assert!(
        !err.contains("error") && !err.contains("Broken pipe"),
        "{err}"
    );
    // Quiet: nothing on stderr (the summary is in --stats, and with -v).
    assert_eq!(err, "", "{err}");
    let s = stats(&st);
    assert_eq!(s["end"], "stdout_closed", "{s}");
    assert_eq!(s["exit_code"], 0, "{s}");
    assert_balanced(&s);
}

/// `child`'s stdout given to `read`, then closed (`| head`); its exit code and stderr.
fn close_stdout_after(
    child: &mut Child,
    what: &str,
    read: impl FnOnce(std::process::ChildStdout),
) -> (Option<i32>, String) {
    read(child.stdout.take().expect("stdout"));
    stderr_and_exit(child, what)
}

/// All of `child`'s stderr, then its exit code (within [`LIMIT`]).
fn stderr_and_exit(child: &mut Child, what: &str) -> (Option<i32>, String) {
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    (env::wait_exit(child, what, LIMIT).code(), err)
}

/// A child whose stdout is a pipe nobody reads (its read end closed before the start):
/// its first write meets a broken pipe, whenever it comes.
fn with_closed_stdout(args: &[&str]) -> std::process::Output {
    let (r, w) = std::io::pipe().expect("pipe");
    drop(r);
    Command::new(BIN)
        .args(args)
        .stdout(w)
        .stderr(Stdio::piped())
        .output()
        .expect("spawn")
}

/// `convert -o - | head` and `record -o - | head`: exit 0, no error; convert says
/// nothing at all, nor does record, whose run ends as `stdout_closed` with every event
/// accounted for (in `--stats`).
#[test]
fn closed_stdout_ends_record_and_convert_quietly() {
    let kernel = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("crates/output/tests/fixtures/kernel-v7-zstd.dat");
    let kernel = kernel.to_str().expect("utf-8");
    for fmt in ["text", "json", "dat", "perfetto"] {
        let o = with_closed_stdout(&["convert", "-i", kernel, "-o", "-", "--format", fmt]);
        assert_eq!(o.status.code(), Some(0), "{fmt}: {}", env::stderr(&o));
        assert_eq!(env::stderr(&o), "", "{fmt}");
    }
    if !kvm_available(KRATE, "closed_stdout_ends_record_and_convert_quietly") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("epipe-record");
    let st = dir.file("s.json");
    // Streaming formats (a trace.dat is written at the end, from its spill files).
    for fmt in ["text", "raw"] {
        let o = with_closed_stdout(&[
            "record", "-o", "-", "--format", fmt, "--events", "10000000", "--stats", &st,
        ]);
        let err = env::stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{fmt}: {err}");
        assert!(
            !err.contains("error") && !err.contains("Broken pipe"),
            "{fmt}: {err}"
        );
        assert_eq!(err, "", "{fmt}");
        let s = stats(&st);
        assert_eq!(s["end"], "stdout_closed", "{fmt}: {s}");
        assert_eq!(s["exit_code"], 0, "{fmt}: {s}");
        assert_balanced(&s);
    }
    assert_eq!(dir.entries(), ["s.json"]);
}

/// `record -o - | head -c 100` for the formats written at the end (trace.dat, Perfetto)
/// and JSON, after the guest finished or `--duration`: exit 0 and quiet as every closed
/// stdout (README), `end` is `stdout_closed`, and the summary (`-v`) says the output is
/// incomplete, never "written to stdout".
#[test]
fn closed_stdout_is_never_called_written() {
    if !kvm_available(KRATE, "closed_stdout_is_never_called_written") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("epipe-late");
    let st = dir.file("s.json");
    let finished = &["--events", "100000"][..];
    let duration = &[
        "--events",
        "100000000",
        "--rate",
        "100000",
        "--duration",
        "0.5",
    ][..];
    for (fmt, verbose, until) in [
        ("dat", true, finished),
        ("json", true, finished),
        ("perfetto", true, finished),
        ("dat", false, finished),
        ("dat", true, duration),
    ] {
        let mut args = vec!["record", "-o", "-", "--format", fmt, "--stats", &st];
        args.extend_from_slice(until);
        if verbose {
            args.push("-v");
        }
        let mut child = Command::new(BIN)
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        // `head -c 100`: 100 bytes read, then the pipe closed.
        let (code, err) = close_stdout_after(&mut child, "record -o - | head -c 100", |mut out| {
            out.read_exact(&mut [0u8; 100]).expect("100 bytes");
        });
        assert_eq!(code, Some(0), "{fmt}: {err}");
        assert!(!err.contains("written to stdout"), "{fmt}: {err}");
        if verbose {
            assert!(
                err.contains("stdout closed early: ") && err.contains("output incomplete"),
                "{fmt}: {err}"
            );
        } else {
            assert_eq!(err, "", "{fmt}");
        }
        let s = stats(&st);
        assert_eq!(s["end"], "stdout_closed", "{fmt}: {s}");
        assert_eq!(s["exit_code"], 0, "{fmt}: {s}");
    }
}

// ---- 7: messages --------------------------------------------------------------------

/// `-e` naming a host kernel event system or event (`-e sched`, a common slip) says to
/// record it with `--host-trace` — from tracefs's `available_events`, or, where that
/// cannot be read, from the well-known systems; exit 2 as any unknown event. A name
/// that is nowhere gets no such pointer.
#[test]
fn an_event_of_the_host_kernel_points_to_host_trace() {
    if !kvm_available(KRATE, "an_event_of_the_host_kernel_points_to_host_trace") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("host-event-hint");
    let record = |e: &str, tracefs: Option<&Path>| {
        let mut c = Command::new(BIN);
        c.args([
            "record",
            "-o",
            &dir.file("t.dat"),
            "--events",
            "10",
            "-e",
            e,
        ]);
        if let Some(t) = tracefs {
            c.env("HYPTRACE_TRACEFS", t);
        }
        c.output().expect("run")
    };
    // No available_events there: the well-known systems.
    let out = record("sched", Some(dir.path()));
    env::assert_usage_error(
        &out,
        "-e sched",
        "unknown event \"sched\" (the guest registered: ",
    );
    let err = env::stderr(&out);
    assert!(
        err.contains("\"sched\" is a host kernel event system: record it with --host-trace sched"),
        "{err}"
    );
    let out = record("nope", Some(dir.path()));
    env::assert_usage_error(&out, "-e nope", "unknown event \"nope\"");
    assert!(
        !env::stderr(&out).contains("--host-trace"),
        "{}",
        env::stderr(&out)
    );
    // The real tracefs's list, where it can be read: an event by its name.
    if std::fs::read("/sys/kernel/tracing/available_events").is_ok() {
        let out = record("sched_switch", None);
        env::assert_usage_error(
            &out,
            "-e sched_switch",
            "\"sched_switch\" is the host kernel event sched:sched_switch: record it with --host-trace sched_switch",
        );
    }
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
}

/// `--format json -o t.dat`: JSON is written, as asked, with a one-line warning that
/// the extension names another format; an extension that agrees (or names none) gets
/// none.
#[test]
fn an_extension_that_disagrees_with_format_is_warned() {
    let kernel = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("crates/output/tests/fixtures/kernel-v7-zstd.dat");
    let kernel = kernel.to_str().expect("utf-8");
    let dir = TempDir::new("ext-warning");
    for (fmt, name, warned) in [
        ("json", "t.dat", true),
        ("text", "t.json", true),
        ("json", "t.json", false),
        ("dat6", "t.dat", false),
        ("perfetto", "t.trace", false),
    ] {
        let out = dir.file(name);
        let o = env::run(BIN, &["convert", "-i", kernel, "-o", &out, "--format", fmt]);
        let err = env::stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{fmt} {name}: {err}");
        let warning =
            format!("hyptrace: warning: {out} (-o) is written as --format {fmt}, though `.");
        assert_eq!(err.contains(&warning), warned, "{fmt} {name}: {err}");
        assert_eq!(
            err.lines().filter(|l| l.contains("warning")).count(),
            usize::from(warned),
            "{err}"
        );
        if fmt == "json" {
            let text = std::fs::read_to_string(&out).expect("output");
            serde_json::from_str::<serde_json::Value>(&text).expect("JSON, as asked");
        }
    }
    if !kvm_available(KRATE, "an_extension_that_disagrees_with_format_is_warned") {
        return;
    }
    let _vm = vm_lock();
    let out = dir.file("r.dat");
    let o = env::run(
        BIN,
        &["record", "--format", "json", "-o", &out, "--events", "10"],
    );
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.starts_with(&format!("hyptrace: warning: {out} (-o) is written as --format json, though `.dat` names --format dat\n")),
        "{err}"
    );
    let text = std::fs::read_to_string(&out).expect("output");
    serde_json::from_str::<serde_json::Value>(&text).expect("JSON, as asked");
}

/// Exit 2, the first line `hyptrace: error: ...`, every needle somewhere.
fn assert_arg_error(args: &[&str], needles: &[&str]) {
    let o = env::run(BIN, args);
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.starts_with("hyptrace: error: "), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: {err:?} lacks {n:?}");
    }
    assert!(!err.contains("panicked"), "{args:?}: {err}");
}

#[test]
fn argument_errors_are_whole_and_name_the_limit() {
    for cmd in ["run", "record"] {
        let a = |extra: &[&'static str]| {
            let mut v = vec![cmd];
            v.extend_from_slice(extra);
            v
        };
        assert_arg_error(
            &a(&["--workload", "nope"]),
            &[
                "'--workload <WORKLOAD>'",
                "[possible values: steady, mixed, burst, panic, fault, align]",
                "For more information, try '--help'.",
            ],
        );
        assert_arg_error(
            &a(&["--vcpu", "2"]),
            &[
                "unexpected argument '--vcpu'",
                "tip: a similar argument exists: '--vcpus'",
            ],
        );
        assert_arg_error(&a(&["--vcpus", "-1"]), &["--vcpus", "1..=256"]);
        assert_arg_error(&a(&["--vcpus", "0"]), &["--vcpus", "1..=256"]);
        assert_arg_error(
            &a(&["--buffer-kb", "99999999999"]),
            &["--buffer-kb 99999999999", "3145728 KiB"],
        );
        assert_arg_error(
            &a(&["--vcpus", "256", "--buffer-kb", "65536"]),
            &["--buffer-kb", "KiB per vCPU fits", "guest memory"],
        );
        assert_arg_error(&a(&["--duration", "inf"]), &["--duration", "finite"]);
        assert_arg_error(&a(&["--duration", "nan"]), &["--duration", "not a number"]);
        assert_arg_error(&a(&["--duration", "-2"]), &["--duration", "more than 0"]);
        // --events is a count here; an event name points at -e.
        assert_arg_error(
            &a(&["--events", "guest:*"]),
            &["--events", "to select events use -e/--event guest:*"],
        );
        assert_arg_error(
            &a(&["--events", "-5"]),
            &["--events", "not a count of events"],
        );
    }
}

#[test]
fn help_defines_the_counters_and_exit_codes() {
    for cmd in ["run", "record"] {
        let o = env::run(BIN, &[cmd, "--help"]);
        let out = env::stdout(&o);
        assert_eq!(o.status.code(), Some(0));
        for n in [
            "attempted",
            "skipped",
            "written    events the writer took in",
            "dropped",
            "read ",
            "lost       events written but never read",
            "written = read + lost",
            "Exit status: 0",
            "130",
        ] {
            assert!(out.contains(n), "{cmd} --help lacks {n:?}: {out}");
        }
    }
}

/// "1 vCPU", the format's name, "written to" only for a complete file.
#[test]
fn summary_wording() {
    if !kvm_available(KRATE, "summary_wording") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("words");
    for (name, what) in [
        ("t.json", "JSON written to"),
        ("t.dat", "trace.dat (v7) written to"),
        ("t.txt", "text written to"),
    ] {
        let out = dir.file(name);
        let o = env::run(
            BIN,
            &["record", "-o", &out, "--vcpus", "1", "--events", "10"],
        );
        let err = env::stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.contains("hyptrace: 1 vCPU: written 10 = read 10 + lost 0"),
            "{err}"
        );
        assert!(last.ends_with(&format!("{what} {out}")), "{err}");
        assert!(!err.contains("hint"), "a lossless run: {err}");
    }
    let o = env::run(BIN, &["run", "--vcpus", "2", "--events", "10"]);
    let err = env::stderr(&o);
    assert!(err.contains("hyptrace: 2 vCPUs: written 20"), "{err}");
    assert!(err.contains(", 20 lines printed"), "{err}");
}

// ---- 8: bench --quick ---------------------------------------------------------------

#[test]
fn bench_quick_reports_the_rate_honestly() {
    if !kvm_available(KRATE, "bench_quick_reports_the_rate_honestly") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("bench");
    let json = dir.file("b.json");
    let o = env::run(BIN, &["bench", "--quick", "--json", &json]);
    let out = env::stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    assert!(!out.replace("null sink", "").contains("null"), "{out}");
    let rate = out
        .lines()
        .find(|l| l.trim_start().starts_with("1 vCPU:"))
        .unwrap_or_else(|| panic!("no rate line: {out}"));
    assert!(
        rate.contains("(--quick: one run, no search)") || rate.contains("not measured"),
        "{rate}"
    );
    let v = stats(&json);
    let r = &v["max_rate"][0];
    assert_eq!(r["searched"], false, "{r}");
    // The one run wrote more than its ring holds: a loss-free result means something.
    let run = &r["runs"][0];
    let bytes_per_event = 28;
    let ring = r["buffer_kb"].as_u64().unwrap_or(u64::MAX / 2048) * 1024;
    assert!(
        run["events_per_vcpu"].as_u64().unwrap_or(0) * bytes_per_event > ring,
        "{run}"
    );
}

// ---- 9: README ----------------------------------------------------------------------

#[test]
fn readme_tells_a_new_user_what_they_need() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    for n in [
        "/dev/kvm",
        "kvm group",
        "target/release/hyptrace",
        "cargo install --locked --path .",
        "trace-cmd",
        "SKIP",
        "Exit status:",
        "130",
    ] {
        assert!(readme.contains(n), "README lacks {n:?}");
    }
    // The first command shown that prints events does not flood the terminal: it is
    // paged, or asks for a few events.
    let first = readme
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .flat_map(str::lines)
        .find(|l| l.contains("hyptrace run") || l.contains("-- run"))
        .expect("a run command in a sh block");
    let events = first
        .split("--events ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok());
    assert!(
        first.contains("| less") || first.contains("| head") || events.is_some_and(|n| n <= 1000),
        "{first}"
    );
}

// ---- 10: stdout output, exit codes, crash detail, heartbeat, hints --------------------

/// `record -o -`: the trace on stdout, the summary on stderr, no file named `-`.
#[test]

fn record_to_stdout() {
    if !kvm_available(KRATE, "record_to_stdout") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("stdout");
    let o = Command::new(BIN)
        .args(["record", "-o", "-", "--events", "1000"])
        .current_dir(dir.path())
        .output()
        .expect("run");
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(o.stdout.starts_with(b"\x17\x08\x44tracing"), "{err}");
    assert!(err.contains("written to stdout"), "{err}");
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
}

/// How a run ended, in `--stats`, and its exit code: 0 for a finished guest and for a
/// stop the user asked for.
#[test]
fn exit_codes_and_end() {
    if !kvm_available(KRATE, "exit_codes_and_end") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("end");
    let st = dir.file("s.json");
    let out = dir.file("t.dat");
    for (args, code, end) in [
        (&["--events", "1000"][..], 0, "guest_finished"),
        (
            &["--events", "100000000", "--duration", "0.3"],
            0,
            "duration",
        ),
        (&["--workload", "panic"], 3, "guest_crashed"),
    ] {
        let mut all = vec!["record", "-o", &out, "--stats", &st];
        all.extend_from_slice(args);
        let o = env::run(BIN, &all);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {}", env::stderr(&o));
        let s = stats(&st);
        assert_eq!(s["end"], end, "{args:?}: {s}");
        assert_eq!(s["exit_code"], code, "{s}");
    }
}

/// A crash is in `--stats`: which vCPU, panic or fault, the message (JSON-escaped), the
/// instruction pointer of a fault.
#[test]
fn crash_detail_in_stats() {
    if !kvm_available(KRATE, "crash_detail_in_stats") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("crash");
    let st = dir.file("s.json");
    for (w, kind) in [("panic", "panic"), ("fault", "fault")] {
        let o = env::run(
            BIN,
            &["run", "--workload", w, "--vcpus", "1", "--stats", &st],
        );
        assert_eq!(o.status.code(), Some(3), "{}", env::stderr(&o));
        let s = stats(&st);
        let c = &s["crash"];
        assert_eq!(c["kind"], kind, "{s}");
        assert_eq!(c["cpu"], 0, "{s}");
        assert!(c["message"].as_str().is_some_and(|m| !m.is_empty()), "{s}");
        assert_eq!(&s["cpus"][0]["crash"], c, "{s}");
        if kind == "fault" {
            let rip = c["rip"].as_str().unwrap_or_else(|| panic!("no rip: {s}"));
            assert!(rip.starts_with("0x"), "{s}");
        }
    }
}

/// A recording whose stderr is not a terminal says every 5 s that it is alive.
#[test]
fn long_record_has_a_heartbeat() {
    if !kvm_available(KRATE, "long_record_has_a_heartbeat") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("beat");
    let out = dir.file("t.dat");
    let o = env::run(
        BIN,
        &[
            "record",
            "-o",
            &out,
            "--events",
            "1000000000",
            "--rate",
            "1000",
            // The heartbeat's 5 s count from the drain loop's start, after boot and
            // registration: a margin for a loaded machine.
            "--duration",
            "8",
        ],
    );
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("hyptrace: recording: ") && l.contains("events read")),
        "{err}"
    );
}

/// An output that does not take pages holds the reader back: the run then says so
/// (its hint names the wait for the output) and `--stats` counts the waits. The output
/// is a FIFO nobody reads until the guest has written everything — far more than the
/// reader can hand over meanwhile (its 32 MiB of chunks, the ring, the pipe) — so the
/// reader had to wait, whatever the timing, and the ring filled (stop mode drops).
#[test]
fn a_stalled_output_is_named_as_the_cause_of_the_loss() {
    if !kvm_available(KRATE, "a_stalled_output_is_named_as_the_cause_of_the_loss") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("stall");
    let fifo = dir.file("pipe");
    let stats = dir.file("stats.json");
    mkfifo(&fifo);
    // The read side first, without blocking: the run's open of the FIFO then does not
    // wait, and nothing is read from it yet.
    let mut r = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(0o4000) // O_NONBLOCK
        .open(&fifo)
        .expect("open fifo");
    // 10 M events of 28 bytes: 280 MB, flat out (a few hundred ms of guest time).
    let mut child = Command::new(BIN)
        .args([
            "record", "-o", &fifo, "--format", "raw", "--vcpus", "1", "--events", "10000000",
            "--rate", "0", "--mode", "stop", "--stats", &stats,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    // The guest has written everything once its vCPU thread has come and gone.
    let task = format!("/proc/{}/task", child.id());
    let vcpu_thread = || {
        std::fs::read_dir(&task).is_ok_and(|d| {
            d.flatten().any(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "vcpu0")
            })
        })
    };
    let seen = std::cell::Cell::new(false);
    env::wait_until(
        &mut child,
        "the vCPU thread to finish",
        Duration::from_secs(60),
        || {
            let now = vcpu_thread();
            seen.set(seen.get() || now);
            seen.get() && !now
        },
        || format!("vcpu0 seen: {}", seen.get()),
    );
    // Now read everything (the writer closes at the end: EOF).
    let mut raw = Vec::new();
    let t0 = Instant::now();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match r.read(&mut buf) {
            Ok(0) if !raw.is_empty() => break,
            Ok(n) if n > 0 => raw.extend_from_slice(&buf[..n]),
            // Nothing yet (no writer yet also reads as 0 bytes): wait, bounded.
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("read fifo: {e}"),
        }
        assert!(t0.elapsed() < LIMIT, "the run never closed its output");
        std::thread::sleep(Duration::from_micros(200));
    }
    let (code, err) = stderr_and_exit(&mut child, "record into a stalled FIFO");
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("hyptrace: hint: the reader waited ")
                && l.contains("ms for the output to take pages")),
        "{err}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("json");
    assert!(
        s["cpus"][0]["dropped"].as_u64().expect("dropped") > 0,
        "{s}"
    );
    assert!(
        s["reader"]["output_waits"].as_u64().expect("waits") >= 1,
        "{s}"
    );
    assert_balanced(&s);
}

/// Lost events come with a hint fitting the mode.
#[test]
fn lost_events_come_with_a_hint() {
    if !kvm_available(KRATE, "lost_events_come_with_a_hint") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("hint");
    let out = dir.file("t.dat");
    let lossy = [
        "--vcpus",
        "1",
        "--events",
        "300000",
        "--rate",
        "0",
        "--buffer-kb",
        "64",
        // Read only at the end: a 64 KiB ring loses whatever the scheduling (a live
        // reader with a core to itself can keep up with one vCPU).
        "--drain",
        "none",
    ];
    for (mode, needle) in [
        ("stop", "use --mode overwrite"),
        ("overwrite", "overwritten before they were read"),
    ] {
        let mut a = vec!["record", "-o", &out, "--mode", mode];
        a.extend_from_slice(&lossy);
        let o = env::run(BIN, &a);
        let err = env::stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{err}");
        let hint = err
            .lines()
            .find(|l| l.starts_with("hyptrace: hint: "))
            .unwrap_or_else(|| panic!("{mode}: no hint: {err}"));
        assert!(
            hint.contains("raise --buffer-kb") && hint.contains(needle),
            "{hint}"
        );
    }
}

/// Issue 26: every command that takes `--format` names each format in its `--help`
/// (the commands and the formats both from the code: clap's command tree and
/// `FormatArg`'s value names), and `dump`'s usage shows both of its sources.
#[test]
fn every_format_command_help_names_every_format() {
    use clap::{CommandFactory, ValueEnum};
    let formats: Vec<String> = hyptrace_host::pipeline::options::FormatArg::value_variants()
        .iter()
        .filter_map(|f| f.to_possible_value())
        .map(|v| v.get_name().to_string())
        .collect();
    assert!(formats.len() >= 6, "{formats:?}");
    let cli = hyptrace_host::cli::Cli::command();
    let takers: Vec<String> = cli
        .get_subcommands()
        .filter(|c| c.get_arguments().any(|a| a.get_id() == "format"))
        .map(|c| c.get_name().to_string())
        .collect();
    for want in ["record", "convert", "dump"] {
        assert!(takers.iter().any(|t| t == want), "{want}: {takers:?}");
    }
    for cmd in &takers {
        let out = env::run(BIN, &[cmd.as_str(), "--help"]);
        assert_eq!(out.status.code(), Some(0), "{cmd}");
        let help = env::stdout(&out);
        for f in &formats {
            assert!(
                help.contains(&format!("- {f}:")),
                "{cmd} --help lacks {f}:\n{help}"
            );
        }
    }
    let out = env::run(BIN, &["dump"]);
    assert_eq!(out.status.code(), Some(2));
    let err = env::stderr(&out);
    assert!(
        err.contains("--trace-mem <PATH>|--attach <SOCKET>"),
        "dump's usage: {err}"
    );
}
