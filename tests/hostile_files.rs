//! Hostile inputs, round 3 (issue 36), the files: a lock any local user can take on a
//! shared directory stops no `--trace-mem` start (F1, docs/design.md); the files made
//! from trace data are owner-only unless `--output-mode` says otherwise; an error
//! echoing a path escapes its control bytes (X1). VM tests are skipped without
//! /dev/kvm unless HYPTRACE_REQUIRE_KVM=1; every child runs under a bound.
//!
//! `MEASURE` lines (a start next to a locked directory):
//! `cargo test --release --test hostile_files -- --nocapture`.

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hyptrace::env::{kvm_available, vm_lock, wait_exit, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// Longest any child may run (boot, run, dump on a loaded machine).
const WALL: Duration = Duration::from_secs(60);

/// Runs `hyptrace args` under umask 022 to its end (bounded): its exit code and stderr.
/// Never a signal, never a panic of the host.
fn hyptrace(args: &[&str], dir: &TempDir, tag: &str) -> (Option<i32>, String) {
    let err_path = dir.file(&format!("{tag}.stderr"));
    let err = std::fs::File::create(&err_path).expect("stderr file");
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(err));
    // SAFETY: umask is async-signal-safe and touches no memory: fine between fork and
    // exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0o022);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("hyptrace");
    let st = wait_exit(&mut child, tag, WALL);
    let err = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(!err.contains("panicked at"), "{tag}: {err}");
    assert!(st.signal().is_none(), "{tag}: {st}\n{err}");
    (st.code(), err)
}

/// The permission bits of `path`.
fn mode(path: &str) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .permissions()
        .mode()
        & 0o777
}

/// Under umask 022, every file made from trace data is 0600: `record` outputs of each
/// format and `--stats`, a crash dump and the stats of that run, `dump` of a trace
/// memory file, `convert`. `--output-mode 0644`/`0640` gives that mode; a mode that is
/// not permission bits is refused (exit 2).
#[test]
fn files_from_trace_data_are_owner_only() {
    if !kvm_available(KRATE, "files_from_trace_data_are_owner_only") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("owner-only");
    let quick = ["--vcpus", "1", "--events", "200"];
    for ext in ["dat", "json", "txt", "raw", "pftrace"] {
        let (out, stats) = (
            dir.file(&format!("x.{ext}")),
            dir.file(&format!("{ext}.json")),
        );
        let args = [&["record", "-o", &out, "--stats", &stats][..], &quick].concat();
        let (code, err) = hyptrace(&args, &dir, ext);
        assert_eq!(code, Some(0), "{ext}: {err}");
        assert_eq!((mode(&out), mode(&stats)), (0o600, 0o600), "{ext}");
    }
    let (out, stats) = (dir.file("shared.dat"), dir.file("shared.json"));
    let args = [
        &[
            "record",
            "-o",
            &out,
            "--stats",
            &stats,
            "--output-mode",
            "0644",
        ][..],
        &quick,
    ]
    .concat();
    let (code, err) = hyptrace(&args, &dir, "shared");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!((mode(&out), mode(&stats)), (0o644, 0o644));

    let (crash, stats) = (dir.file("crash.dat"), dir.file("crash.json"));
    let args = [
        "run",
        "--workload",
        "panic",
        "--vcpus",
        "1",
        "--crash-dump",
        &crash,
        "--stats",
        &stats,
    ];
    let (code, err) = hyptrace(&args, &dir, "crash");
    assert_eq!(code, Some(3), "{err}");
    assert_eq!((mode(&crash), mode(&stats)), (0o600, 0o600));

    let mem = dir.file("vm.trace");
    let args = [&["run", "--drain", "none", "--trace-mem", &mem][..], &quick].concat();
    let (code, err) = hyptrace(&args, &dir, "mem");
    assert_eq!(code, Some(0), "{err}");
    let dumped = dir.file("dump.txt");
    let (code, err) = hyptrace(&["dump", "--trace-mem", &mem, "-o", &dumped], &dir, "dump");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(mode(&dumped), 0o600);
    let args = [
        "dump",
        "--trace-mem",
        &mem,
        "-o",
        &dumped,
        "--output-mode",
        "640",
    ];
    let (code, err) = hyptrace(&args, &dir, "dump640");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(mode(&dumped), 0o640);

    let converted = dir.file("converted.json");
    let args = ["convert", "-i", &out, "-o", &converted];
    let (code, err) = hyptrace(&args, &dir, "convert");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(mode(&converted), 0o600);

    for bad in ["4755", "0888", "rw-r--r--"] {
        let (code, err) = hyptrace(&["run", "--output-mode", bad], &dir, "bad");
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(err.contains("--output-mode"), "{bad}: {err}");
    }
}

/// A directory under /dev/shm, world-writable and sticky like /dev/shm itself, removed
/// when dropped.
struct SharedDir(PathBuf);

impl SharedDir {
    fn new(tag: &str) -> Self {
        let p = Path::new("/dev/shm").join(format!("hyptrace-it-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir(&p).expect("mkdir /dev/shm/...");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        Self(p)
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether this process can take `flock(LOCK_EX|LOCK_NB)` on `dir` now (and lets go).
fn can_lock(dir: &Path) -> bool {
    let d = std::fs::File::open(dir).expect("open dir");
    // SAFETY: flock on a descriptor `d` owns; no memory is passed.
    unsafe { libc::flock(d.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// F1: a user that is not the VMM's (`nobody`) holds an exclusive flock on the
/// directory of `--trace-mem` (which any local user can do on /dev/shm); the run
/// starts and completes all the same (it waited 5 s for the directory and exited 2),
/// its file owner-only.
#[test]
fn a_directory_lock_of_another_user_delays_nothing() {
    if !kvm_available(KRATE, "a_directory_lock_of_another_user_delays_nothing") {
        return;
    }
    // SAFETY: geteuid reads the caller's credentials; no memory is passed.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP: not root (cannot run a holder as nobody)");
        return;
    }
    let _l = vm_lock();
    let shared = SharedDir::new("dirlock");
    let dir = TempDir::new("dirlock");
    let mut holder = Command::new("flock")
        .args(["-o", "-x"])
        .arg(&shared.0)
        .args(["-c", "echo locked; read x; exit 0"])
        .uid(65534)
        .gid(65534)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("flock(1) as nobody");
    let mut line = String::new();
    // Bounded: flock(1) prints once it holds the lock, or exits (EOF).
    BufReader::new(holder.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    assert_eq!(line.trim(), "locked", "the holder did not get the lock");
    assert!(!can_lock(&shared.0), "the directory is locked by nobody");
    let mem = shared.0.join("vm.trace");
    let mem = mem.to_str().expect("utf-8");
    let t = Instant::now();
    let (code, err) = hyptrace(
        &["run", "--vcpus", "1", "--events", "100", "--trace-mem", mem],
        &dir,
        "run",
    );
    let took = t.elapsed();
    println!("MEASURE a_directory_lock_of_another_user_delays_nothing: run --trace-mem next to a locked directory: exit {code:?} in {took:?}");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(mode(mem), 0o600);
    assert!(!can_lock(&shared.0), "the holder held the lock throughout");
    drop(holder.stdin.take());
    let st = wait_exit(&mut holder, "the holder", WALL);
    assert!(st.success(), "holder: {st}");
}

/// X1: an error echoing a path escapes its control bytes (no raw ESC reaches the
/// terminal) and stays one line.
#[test]
fn an_error_echoing_a_path_escapes_it() {
    let dir = TempDir::new("escape");
    let bad = "/nonexistent\x1b[2J\n/x.dat";
    let (code, err) = hyptrace(&["record", "-o", bad], &dir, "esc");
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(err.contains("/nonexistent\\x1b[2J\\n/x.dat"), "{err:?}");
    assert!(!err.contains('\x1b'), "a raw ESC: {err:?}");
}
