//! One owner per trace-memory file (issue 23, part 3; docs/design.md, "Trace-memory
//! file ownership", F1-F6): a second VMM on a running VMM's `--trace-mem` path is
//! refused naming the owner's pid; a finished file is replaced by rename, so a dump
//! reading it is undisturbed; hard-linked, symlinked, FIFO and directory paths are
//! refused; `dump` refuses a FIFO at once and reads only what the header declares.
//! VM tests are skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1. Every wait is
//! bounded; no test sleeps for luck.
//!
//! `MEASURE` lines (the sparse dump's peak RSS):
//! `cargo test --release --test trace_mem_owner -- --nocapture`.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hyptrace::adversary::{run_watched, Limits};
use hyptrace::env::{kvm_available, signal, vm_lock, wait_exit, wait_until, TempDir};
use hyptrace_reader::trace_file;

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// Longest any child may run (boot, run, dump on a loaded machine).
const WALL: Duration = Duration::from_secs(60);

/// Spawns `hyptrace args`, stdout discarded, stderr to `dir/tag.stderr`.
fn spawn(args: &[&str], dir: &TempDir, tag: &str) -> Child {
    let err = std::fs::File::create(dir.file(&format!("{tag}.stderr"))).expect("stderr file");
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(err))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {BIN}: {e}"))
}

fn stderr_of(dir: &TempDir, tag: &str) -> String {
    std::fs::read_to_string(dir.file(&format!("{tag}.stderr"))).unwrap_or_default()
}

/// Runs `hyptrace args` to its end (bounded): its exit code (`None`: a signal, with
/// the status) and stderr. Never a panic of the host.
fn run(args: &[&str], dir: &TempDir, tag: &str) -> (Option<i32>, String) {
    let mut c = spawn(args, dir, tag);
    let st = wait_exit(&mut c, tag, WALL);
    let err = stderr_of(dir, tag);
    assert!(!err.contains("panicked"), "{tag}: {err}");
    assert!(
        st.signal().is_none(),
        "{tag}: killed by a signal: {st}\n{err}"
    );
    (st.code(), err)
}

/// Whether the file at `path` is a trace memory file whose VMM set the state RUNNING.
fn running(path: &str) -> bool {
    let Ok(b) = std::fs::read(path) else {
        return false;
    };
    let w = |off: usize| {
        b.get(off..off + 8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
    };
    w(trace_file::hdr::MAGIC) == Some(trace_file::MAGIC)
        && w(trace_file::hdr::STATE) == Some(trace_file::STATE_RUNNING)
}

/// `written N = read R + lost L` of a run's summary line, checked: N = R + L.
fn accounting(err: &str) -> (u64, u64, u64) {
    let line = err
        .lines()
        .find(|l| l.contains(" vCPU") && l.contains("written ") && l.contains(" = read "))
        .unwrap_or_else(|| panic!("no summary line: {err}"));
    let num = |key: &str| -> u64 {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("{key}: {line}")) + key.len()..];
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{key}: {line}"))
    };
    let (w, r, l) = (num("written "), num("= read "), num("+ lost "));
    assert_eq!(w, r + l, "{line}");
    (w, r, l)
}

/// No temporary file (the VMM's `.NAME.PID-N.tmp`, a dump output's) is left.
fn no_tmp_left(dir: &TempDir) {
    let left: Vec<String> = dir
        .entries()
        .into_iter()
        .filter(|e| e.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

/// A finished run's trace memory file at `mem` (`--drain none`: the rings hold the
/// newest events at the end, a dump of it has something to write).
fn finished(mem: &str, dir: &TempDir, tag: &str, buffer_kb: &str) {
    let (code, err) = run(
        &[
            "run",
            "--events",
            "200000",
            "--rate",
            "0",
            "--vcpus",
            "2",
            "--buffer-kb",
            buffer_kb,
            "--drain",
            "none",
            "--trace-mem",
            mem,
        ],
        dir,
        tag,
    );
    assert_eq!(code, Some(0), "{tag}: {err}");
}

/// (a) F1: a second `run --trace-mem F` while the first runs is refused (exit 2, one
/// line naming the first's pid) and touches nothing; the first ends with exit 0 and
/// exact accounting; once it ended, a new run replaces the file (a new inode).
#[test]
fn second_run_on_a_live_file_is_refused() {
    if !kvm_available(KRATE, "second_run_on_a_live_file_is_refused") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("owner-live");
    let mem = dir.file("vm.trace");
    let args = [
        "run",
        "--events",
        "3000",
        "--rate",
        "1000",
        "--vcpus",
        "2",
        "--trace-mem",
        &mem,
    ];
    let mut first = spawn(&args, &dir, "first");
    wait_until(
        &mut first,
        "the first run's file in state RUNNING",
        WALL,
        || running(&mem),
        || stderr_of(&dir, "first"),
    );
    let ino = std::fs::metadata(&mem).expect("meta").ino();
    let (code, err) = run(
        &["run", "--events", "1", "--trace-mem", &mem],
        &dir,
        "second",
    );
    assert_eq!(code, Some(2), "{err}");
    let ours: Vec<&str> = err.lines().filter(|l| l.starts_with("hyptrace:")).collect();
    assert_eq!(ours.len(), 1, "one line: {err}");
    assert!(
        ours[0].starts_with("hyptrace: error: --trace-mem ")
            && ours[0].contains(&format!("pid {}", first.id())),
        "{err}"
    );
    assert_eq!(std::fs::metadata(&mem).expect("meta").ino(), ino);
    assert!(running(&mem), "the live file is untouched");
    let st = wait_exit(&mut first, "the first run", WALL);
    let err = stderr_of(&dir, "first");
    assert_eq!(st.code(), Some(0), "{err}");
    let (written, _, _) = accounting(&err);
    assert_eq!(written, 6000, "{err}");
    // Finished: the next run replaces the file.
    let (code, err) = run(
        &["run", "--events", "1", "--trace-mem", &mem],
        &dir,
        "third",
    );
    assert_eq!(code, Some(0), "{err}");
    assert_ne!(std::fs::metadata(&mem).expect("meta").ino(), ino);
    no_tmp_left(&dir);
}

/// F1: two runs started together on one path: exactly one owns it, the other is
/// refused (exit 2) naming the owner's pid while the owner still runs (the runs are
/// endless: the owner is stopped with SIGINT after the refusal, exit 0).
#[test]
fn two_runs_started_together_one_owner() {
    if !kvm_available(KRATE, "two_runs_started_together_one_owner") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("owner-race");
    for round in 0..3 {
        let mem = dir.file(&format!("r{round}.trace"));
        let args = [
            "run",
            "--events",
            "1000000000",
            "--rate",
            "1000",
            "--vcpus",
            "1",
            "--trace-mem",
            &mem,
        ];
        let (ta, tb) = (format!("a{round}"), format!("b{round}"));
        let mut a = spawn(&args, &dir, &ta);
        let mut b = spawn(&args, &dir, &tb);
        let (pa, pb) = (a.id(), b.id());
        // Bounded: the loser exits as soon as it sees the owner's lock.
        let t = std::time::Instant::now();
        let (mut owner, loser_tag, loser_code, owner_pid) = loop {
            if let Some(st) = a.try_wait().expect("try_wait") {
                break (b, ta, st.code(), pb);
            }
            if let Some(st) = b.try_wait().expect("try_wait") {
                break (a, tb, st.code(), pa);
            }
            if t.elapsed() > WALL {
                let _ = (a.kill(), b.kill(), a.wait(), b.wait());
                panic!("round {round}: neither run was refused within {WALL:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let err = stderr_of(&dir, &loser_tag);
        let owner_runs = owner.try_wait().expect("try_wait").is_none();
        if loser_code != Some(2) || !err.contains(&format!("pid {owner_pid}")) || !owner_runs {
            let _ = (owner.kill(), owner.wait());
            panic!(
                "round {round}: loser exit {loser_code:?}, owner still runs: {owner_runs}: {err}"
            );
        }
        signal(&owner, "-INT");
        let st = wait_exit(&mut owner, "the owner", WALL);
        assert_eq!(st.code(), Some(0), "round {round}: {st}");
    }
    no_tmp_left(&dir);
}

/// (b) F2, F5: a dump of a finished file while new runs replace the path: every dump
/// ends by itself (exit 0 — it reads the old inode, which the rename leaves intact —
/// or 2), never by a signal (a truncate in place made it die of SIGBUS), and no
/// temporary output is left.
#[test]
fn dump_survives_a_new_run_on_its_path() {
    if !kvm_available(KRATE, "dump_survives_a_new_run_on_its_path") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("owner-dump");
    let mem = dir.file("big.trace");
    finished(&mem, &dir, "big0", "4096");
    let mut ok = 0;
    for i in 0..5 {
        let out = dir.file(&format!("d{i}.txt"));
        let mut dump = spawn(&["dump", "--trace-mem", &mem, "-o", &out], &dir, "dump");
        finished(&mem, &dir, &format!("big{}", i + 1), "4096");
        let st = wait_exit(&mut dump, "dump", WALL);
        let err = stderr_of(&dir, "dump");
        assert!(st.signal().is_none(), "round {i}: dump killed: {st}\n{err}");
        assert!(
            matches!(st.code(), Some(0) | Some(2)),
            "round {i}: {st} {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        ok += usize::from(st.code() == Some(0));
    }
    println!("MEASURE dump during a new run on its path: {ok} of 5 exit 0, the rest exit 2");
    no_tmp_left(&dir);
}

/// (c) F3: a path with a second hard link is refused (exit 2, the link count named);
/// the other name's bytes and mode are unchanged.
#[test]
fn hard_linked_path_is_refused() {
    if !kvm_available(KRATE, "hard_linked_path_is_refused") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("owner-link");
    let mem = dir.file("vm.trace");
    finished(&mem, &dir, "fin", "32");
    let other = dir.file("other.trace");
    std::fs::hard_link(&mem, &other).expect("link");
    std::fs::set_permissions(&other, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    let before = std::fs::read(&other).expect("read");
    for path in [&mem, &other] {
        let (code, err) = run(&["run", "--events", "1", "--trace-mem", path], &dir, "link");
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("has 2 hard links"), "{err}");
    }
    assert_eq!(std::fs::read(&other).expect("read"), before);
    let md = std::fs::metadata(&other).expect("meta");
    assert_eq!(md.permissions().mode() & 0o777, 0o640);
    assert_eq!(md.nlink(), 2);
    no_tmp_left(&dir);
}

fn mkfifo(path: &str) {
    let st = Command::new("mkfifo").arg(path).status().expect("mkfifo");
    assert!(st.success(), "mkfifo {path}");
}

/// (d) F4: `dump --trace-mem FIFO` (no writer: a blocking open would wait for ever) is
/// refused at once, exit 2 — bounded by the watchdog of `run`, not timed.
#[test]
fn dump_of_a_fifo_is_refused() {
    let dir = TempDir::new("owner-fifo");
    let fifo = dir.file("fifo");
    mkfifo(&fifo);
    let (code, err) = run(
        &["dump", "--trace-mem", &fifo, "-o", &dir.file("x.txt")],
        &dir,
        "dump",
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is a FIFO, not a regular file"), "{err}");
    no_tmp_left(&dir);
}

/// (f) F3: a symlink (to a regular file), a directory, a FIFO at `run --trace-mem` are
/// refused (exit 2) before anything is created; the symlink's target is untouched.
#[test]
fn run_refuses_non_regular_paths() {
    let dir = TempDir::new("owner-types");
    let target = dir.file("target");
    std::fs::write(&target, b"keep").expect("write");
    let link = dir.file("link");
    std::os::unix::fs::symlink(&target, &link).expect("symlink");
    let fifo = dir.file("fifo");
    mkfifo(&fifo);
    let sub = dir.file("sub");
    std::fs::create_dir(&sub).expect("mkdir");
    for (path, what) in [
        (&link, "a symbolic link"),
        (&fifo, "a FIFO"),
        (&sub, "a directory"),
    ] {
        let (code, err) = run(&["run", "--events", "1", "--trace-mem", path], &dir, "run");
        assert_eq!(code, Some(2), "{what}: {err}");
        assert!(
            err.contains(&format!("is {what}, not a regular file")),
            "{err}"
        );
    }
    assert_eq!(std::fs::read(&target).expect("read"), b"keep");
    let mut names = dir.entries();
    names.retain(|n| !n.ends_with(".stderr"));
    assert_eq!(names, ["fifo", "link", "sub", "target"]);
}

/// (e) F5: a small finished file made 4 GiB long (sparse) dumps with exit 0, reading
/// only what its header declares: the dump's peak RSS (`ru_maxrss` of the child, from
/// `wait4`) stays under 64 MiB (it was the whole 4 GiB).
#[test]
fn sparse_file_dump_reads_only_the_declared_size() {
    if !kvm_available(KRATE, "sparse_file_dump_reads_only_the_declared_size") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("owner-sparse");
    let mem = dir.file("vm.trace");
    finished(&mem, &dir, "fin", "32");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&mem)
        .expect("open");
    f.set_len(4 << 30).expect("sparse 4 GiB");
    drop(f);
    let out = dir.file("sparse.txt");
    let w = run_watched(
        BIN,
        &["dump", "--trace-mem", &mem, "-o", &out],
        &Limits {
            wall: WALL,
            rss_kib: 64 * 1024,
            sigterm_after: None,
            file: None,
        },
    );
    assert!(w.killed.is_none(), "{:?}: {}", w.killed, w.measurements());
    assert_eq!(w.code, Some(0), "{}", w.measurements());
    assert!(w.maxrss_kib <= 64 * 1024, "{}", w.measurements());
    assert!(std::fs::metadata(&out).expect("output").len() > 0);
    println!(
        "MEASURE sparse 4 GiB trace-mem dump: peak RSS {} KiB, {:.1} ms",
        w.maxrss_kib,
        w.wall.as_secs_f64() * 1e3
    );
}
