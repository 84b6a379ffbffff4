//! Live attach (issues 13, 35): `hyptrace dump --attach SOCKET [--follow]` subscribes to a
//! running VMM (`--drain none --control SOCKET`): the VMM, the only reader of its rings,
//! sends it what it reads. VM tests are skipped without /dev/kvm unless
//! HYPTRACE_REQUIRE_KVM=1.
//!
//! Every child runs under a bound ([`WALL`]) and is killed past it: a test fails, never
//! hangs. No timed assertions: "the output grows while the VM runs" is checked as an
//! order of observations (the output file had events while the VMM had not exited).
//!
//! `MEASURE` lines (attach throughput and latency against the in-process reader):
//! `cargo test --release --test attach -- --nocapture --test-threads 1`.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};
use hyptrace::text::{check_stream, parse_all, CpuTally, StreamRules};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// Longest any child may run (boot, run, attach on a loaded machine).
const WALL: Duration = Duration::from_secs(90);

fn spawn(args: &[&str], stdout: &str, stderr: &str) -> Child {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    spawn_cmd(&mut cmd, stdout, stderr)
}

/// Starts `cmd` with no stdin, its stdout and stderr into the files named.
fn spawn_cmd(cmd: &mut Command, stdout: &str, stderr: &str) -> Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(
            std::fs::File::create(stdout).expect("stdout file"),
        ))
        .stderr(Stdio::from(
            std::fs::File::create(stderr).expect("stderr file"),
        ))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Kills the child when dropped (a failing test leaves no VM behind).
struct Guard(Option<Child>);

impl Guard {
    fn running(&mut self) -> bool {
        match self.0.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Waits at most until `deadline`; kills and fails past it. Returns the exit code.
    fn wait(&mut self, deadline: Instant, stderr: &str) -> Option<i32> {
        let mut c = self.0.take().expect("child");
        loop {
            match c.try_wait().expect("try_wait") {
                Some(st) => return st.code(),
                None if Instant::now() > deadline => {
                    let _ = c.kill();
                    let _ = c.wait();
                    panic!(
                        "hyptrace ran past its bound: {}",
                        std::fs::read_to_string(stderr).unwrap_or_default()
                    );
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `hyptrace args` to the end (bounded); returns (code, stderr).
fn run_bounded(args: &[&str], dir: &TempDir, tag: &str) -> (Option<i32>, String) {
    let (out, err) = (
        dir.file(&format!("{tag}.out")),
        dir.file(&format!("{tag}.err")),
    );
    let mut g = Guard(Some(spawn(args, &out, &err)));
    let code = g.wait(Instant::now() + WALL, &err);
    (code, std::fs::read_to_string(&err).unwrap_or_default())
}

/// Waits (bounded) until `path` is a socket.
fn wait_socket(path: &str, vm: &mut Guard, vm_err: &str) {
    env::wait_until(
        vm.0.as_mut().expect("child"),
        &format!("the VMM's socket at {path}"),
        WALL,
        || std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()),
        || std::fs::read_to_string(vm_err).unwrap_or_default(),
    );
}

fn mode(path: &str) -> u32 {
    std::fs::symlink_metadata(path)
        .expect("metadata")
        .permissions()
        .mode()
        & 0o777
}

fn no_panic(stderr: &str, what: &str) {
    assert!(
        !stderr.contains("panicked at"),
        "{what}: the host panicked:\n{stderr}"
    );
}

/// Checks a text output: per CPU, seq contiguous except where a drop line says how
/// many were lost (and the first seq is the losses before it).
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

/// The VMM args of an attachable run.
fn vm_args<'a>(mem: &'a str, sock: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "run",
        "--drain",
        "none",
        "--trace-mem",
        mem,
        "--control",
        sock,
    ];
    a.extend_from_slice(extra);
    a
}

/// attach + follow on a running VM: the output grows while the VM runs; a second
/// attach is refused "busy"; at the end every event of every CPU is there exactly once
/// (seq contiguous, no loss with a paced guest); socket and trace file owner-only.
#[test]
fn attach_follow_reads_while_the_vm_runs() {
    if !kvm_available(KRATE, "attach_follow_reads_while_the_vm_runs") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("attach");
    let (mem, sock) = (dir.file("vm.trace"), dir.file("vm.sock"));
    let (vm_out, vm_err) = (dir.file("vm.out"), dir.file("vm.err"));
    // 6 s at 5000/s: room to attach, grow and ask `stats` on a loaded machine.
    let n: u64 = 30_000;
    let ns = n.to_string();
    let args = vm_args(
        &mem,
        &sock,
        &["--vcpus", "2", "--events", &ns, "--rate", "5000"],
    );
    let mut vm = Guard(Some(spawn(&args, &vm_out, &vm_err)));
    wait_socket(&sock, &mut vm, &vm_err);
    assert_eq!(mode(&sock), 0o600, "socket mode");
    // The socket is bound before the run creates its trace memory file: wait for it.
    env::wait_until(
        vm.0.as_mut().expect("child"),
        "the trace memory file",
        WALL,
        || std::fs::symlink_metadata(&mem).is_ok(),
        || std::fs::read_to_string(&vm_err).unwrap_or_default(),
    );
    assert_eq!(mode(&mem), 0o600, "trace memory file mode");
    // Text on stdout streams: the file the attach's stdout goes to grows as it reads.
    let (a_txt, a_err) = (dir.file("a.txt"), dir.file("a.err"));
    let mut att = Guard(Some(spawn(
        &[
            "dump", "--attach", &sock, "--follow", "-o", "-", "--format", "text",
        ],
        &a_txt,
        &a_err,
    )));
    // The attached reader's output has events, and after that the VMM says its
    // vCPUs still run (an order of observations, not a timing).
    let t = Instant::now();
    let mut grew_while_running = false;
    while t.elapsed() < WALL && vm.running() {
        let len = std::fs::metadata(&a_txt).map_or(0, |m| m.len());
        if len > 4096 {
            let o = Command::new(BIN)
                .args(["ctl", &sock, "stats"])
                .output()
                .expect("ctl");
            let stats = String::from_utf8_lossy(&o.stdout);
            grew_while_running = stats.contains("\"running\":true");
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // A second consumer is refused while the first one holds the role.
    let (code, err2) = run_bounded(
        &["dump", "--attach", &sock, "-o", &dir.file("b.txt")],
        &dir,
        "second",
    );
    let vm_ran_on = vm.running();
    let deadline = Instant::now() + WALL;
    let vm_code = vm.wait(deadline, &vm_err);
    let a_code = att.wait(deadline, &a_err);
    let a_stderr = std::fs::read_to_string(&a_err).unwrap_or_default();
    let v_stderr = std::fs::read_to_string(&vm_err).unwrap_or_default();
    no_panic(&a_stderr, "attach");
    no_panic(&v_stderr, "vmm");
    assert!(
        grew_while_running,
        "the attached output never grew while the VM ran\n{a_stderr}\n{v_stderr}"
    );
    if vm_ran_on {
        assert_eq!(code, Some(2), "second attach: {err2}");
        assert!(err2.contains("busy"), "second attach: {err2}");
    }
    assert_eq!(vm_code, Some(0), "{v_stderr}");
    assert_eq!(a_code, Some(0), "{a_stderr}");
    let t = check_text(&a_txt, 2);
    for (c, tc) in t.iter().enumerate() {
        // Paced (5000/s), 64 pages per CPU by default: the attached reader keeps up;
        // whatever it lost is reported, and every event is accounted for.
        assert_eq!(tc.events + tc.dropped, n, "cpu {c}: {tc:?}\n{a_stderr}");
        assert_eq!(tc.last_seq, Some(n - 1), "cpu {c}: {tc:?}");
    }
    // One reader: what the subscriber received is what the VMM read.
    assert_eq!(
        received(&a_stderr),
        vmm_read(&v_stderr),
        "{a_stderr}\n{v_stderr}"
    );
    assert!(
        std::fs::symlink_metadata(&sock).is_err(),
        "the socket is removed at exit"
    );
}

/// A fast guest in overwrite mode with a small ring: the attached reader loses events
/// when the writer laps it; every loss is reported exactly (seq contiguous except at
/// drop lines whose counts fill the gaps), and events + lost = written.
#[test]
fn attach_follow_counts_losses_exactly() {
    if !kvm_available(KRATE, "attach_follow_counts_losses_exactly") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("attachloss");
    let (mem, sock) = (dir.file("vm.trace"), dir.file("vm.sock"));
    let (vm_out, vm_err) = (dir.file("vm.out"), dir.file("vm.err"));
    let args = vm_args(
        &mem,
        &sock,
        &[
            "--vcpus",
            "2",
            "--events",
            "100000000",
            "--rate",
            "0",
            "--buffer-kb",
            "16",
            "--mode",
            "overwrite",
            "--duration",
            "3",
        ],
    );
    let mut vm = Guard(Some(spawn(&args, &vm_out, &vm_err)));
    wait_socket(&sock, &mut vm, &vm_err);
    let (a_txt, a_err) = (dir.file("a.txt"), dir.file("a.err"));
    let mut att = Guard(Some(spawn(
        &[
            "dump", "--attach", &sock, "--follow", "-o", &a_txt, "--format", "text",
        ],
        &dir.file("a.stdout"),
        &a_err,
    )));
    let deadline = Instant::now() + WALL;
    let vm_code = vm.wait(deadline, &vm_err);
    let a_code = att.wait(deadline, &a_err);
    let a_stderr = std::fs::read_to_string(&a_err).unwrap_or_default();
    let v_stderr = std::fs::read_to_string(&vm_err).unwrap_or_default();
    no_panic(&a_stderr, "attach");
    assert_eq!(vm_code, Some(0), "{v_stderr}");
    assert_eq!(a_code, Some(0), "{a_stderr}");
    assert_eq!(
        received(&a_stderr),
        vmm_read(&v_stderr),
        "{a_stderr}\n{v_stderr}"
    );
    let t = check_text(&a_txt, 2);
    for (c, tc) in t.iter().enumerate() {
        let last = tc.last_seq.expect("events");
        // check_stream: every gap equals the drops printed before it.
        assert_eq!(tc.events + tc.dropped, last + 1, "cpu {c}: {tc:?}");
        assert!(tc.events > 0, "cpu {c}: {tc:?}");
    }
    println!(
        "MEASURE attach overwrite 16 KiB, rate 0: per CPU (events, lost) {:?}",
        t.iter().map(|c| (c.events, c.dropped)).collect::<Vec<_>>()
    );
}

/// `--swap guest` (the VMM's swaps go through the guest's mailbox) and trace.dat output:
/// every event of a run that fits in the ring, and trace-cmd reads the file.
#[test]
fn attach_follow_swap_guest_trace_dat() {
    if !kvm_available(KRATE, "attach_follow_swap_guest_trace_dat") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("attachdat");
    let (mem, sock) = (dir.file("vm.trace"), dir.file("vm.sock"));
    let (vm_out, vm_err) = (dir.file("vm.out"), dir.file("vm.err"));
    let args = vm_args(
        &mem,
        &sock,
        &[
            "--vcpus", "1", "--events", "10000", "--rate", "5000", "--swap", "guest",
        ],
    );
    let mut vm = Guard(Some(spawn(&args, &vm_out, &vm_err)));
    wait_socket(&sock, &mut vm, &vm_err);
    let (dat, a_err) = (dir.file("a.dat"), dir.file("a.err"));
    let mut att = Guard(Some(spawn(
        &["dump", "--attach", &sock, "--follow", "-o", &dat],
        &dir.file("a.stdout"),
        &a_err,
    )));
    let deadline = Instant::now() + WALL;
    let vm_code = vm.wait(deadline, &vm_err);
    let a_code = att.wait(deadline, &a_err);
    let a_stderr = std::fs::read_to_string(&a_err).unwrap_or_default();
    no_panic(&a_stderr, "attach");
    assert_eq!(vm_code, Some(0));
    assert_eq!(a_code, Some(0), "{a_stderr}");
    assert!(
        a_stderr.contains("cpu 0: 10000 events received, 0 lost"),
        "{a_stderr}"
    );
    if hyptrace::env::trace_cmd_available() {
        let o = Command::new("trace-cmd")
            .args(["report", "-i", &dat])
            .output()
            .expect("trace-cmd");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let n = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.contains("marker:"))
            .count();
        assert_eq!(n, 10_000);
    }
}

/// `--follow` stopped by SIGINT while the VM runs on: exit 0, the output finished (a
/// complete trace.dat under its name, every event read in it).
#[test]
fn attach_follow_sigint_finishes_the_output() {
    if !kvm_available(KRATE, "attach_follow_sigint_finishes_the_output") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("attachint");
    let (mem, sock) = (dir.file("vm.trace"), dir.file("vm.sock"));
    let (vm_out, vm_err) = (dir.file("vm.out"), dir.file("vm.err"));
    let args = vm_args(
        &mem,
        &sock,
        &[
            "--vcpus",
            "2",
            "--events",
            "1000000",
            "--rate",
            "2000",
            "--duration",
            "60",
        ],
    );
    let mut vm = Guard(Some(spawn(&args, &vm_out, &vm_err)));
    wait_socket(&sock, &mut vm, &vm_err);
    let (dat, a_err) = (dir.file("a.dat"), dir.file("a.err"));
    let mut att = Guard(Some(spawn(
        &["dump", "--attach", &sock, "--follow", "-o", &dat],
        &dir.file("a.stdout"),
        &a_err,
    )));
    // Once the VMM has read a few pages for the subscriber (its stats), interrupt it.
    let t = Instant::now();
    loop {
        let o = Command::new(BIN)
            .args(["ctl", &sock, "stats"])
            .output()
            .expect("ctl");
        let v: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
        let swaps = v["cpus"][0]["swaps"].as_u64().unwrap_or(0);
        if swaps >= 2 {
            break;
        }
        assert!(att.running(), "the attach ended early");
        assert!(t.elapsed() < WALL, "no swaps: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = att.0.as_ref().expect("child").id().to_string();
    let k = Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .expect("kill");
    assert!(k.success());
    let code = att.wait(Instant::now() + WALL, &a_err);
    let a_stderr = std::fs::read_to_string(&a_err).unwrap_or_default();
    no_panic(&a_stderr, "attach");
    assert_eq!(code, Some(0), "{a_stderr}");
    assert!(a_stderr.contains("interrupted"), "{a_stderr}");
    assert!(vm.running(), "the VM runs on");
    let read: u64 = (0..2)
        .map(|c| {
            a_stderr
                .lines()
                .find_map(|l| l.strip_prefix(&format!("hyptrace: attach: cpu {c}: ")))
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no count: {a_stderr}"))
        })
        .sum();
    assert!(read > 0, "{a_stderr}");
    if hyptrace::env::trace_cmd_available() {
        let o = Command::new("trace-cmd")
            .args(["report", "-i", &dat])
            .output()
            .expect("trace-cmd");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let n = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| l.contains("marker:"))
            .count() as u64;
        assert_eq!(n, read, "{a_stderr}");
    } else {
        assert!(std::fs::metadata(&dat).is_ok_and(|m| m.len() > 0));
    }
}

/// Without --follow the attach drains what is there and exits while the VM runs on;
/// the subscriber role is released at detach (a second attach then succeeds and goes on
/// exactly after the first: C1); an attach to a `--drain live` VMM is refused (exit 2);
/// a VMM without --trace-mem takes subscribers (nothing is mapped).
#[test]
fn attach_one_shot_release_and_refusals() {
    if !kvm_available(KRATE, "attach_one_shot_release_and_refusals") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("attachref");
    let (mem, sock) = (dir.file("vm.trace"), dir.file("vm.sock"));
    let (vm_out, vm_err) = (dir.file("vm.out"), dir.file("vm.err"));
    let args = vm_args(
        &mem,
        &sock,
        &[
            "--vcpus",
            "2",
            "--events",
            "1000000",
            "--rate",
            "2000",
            "--duration",
            "60",
        ],
    );
    let mut vm = Guard(Some(spawn(&args, &vm_out, &vm_err)));
    wait_socket(&sock, &mut vm, &vm_err);
    // Let the guest fill a few pages first (not an assertion: fewer events on a busy
    // machine only make the checks below weaker).
    std::thread::sleep(Duration::from_millis(300));
    // Round 0 to a file (page sink), round 1 to stdout (streamed text lines): both hold
    // every event the attach read, none held back at the end, seq contiguous. The
    // second consumer starts right after the first (paced: nothing lost between).
    let mut seqs: Vec<Vec<u64>> = Vec::new();
    for round in 0..2 {
        let tag = format!("one{round}");
        let file = dir.file(&format!("{tag}.txt"));
        let o = if round == 0 { file.as_str() } else { "-" };
        let (code, err) = run_bounded(
            &["dump", "--attach", &sock, "-o", o, "--format", "text"],
            &dir,
            &tag,
        );
        no_panic(&err, "one-shot attach");
        assert_eq!(code, Some(0), "round {round}: {err}");
        let out = if round == 0 {
            file
        } else {
            dir.file(&format!("{tag}.out"))
        };
        let text = std::fs::read_to_string(&out).expect("output");
        // CPU 0's events (its lines carry `[000]`); both CPUs' counts checked.
        let seq_of = |cpu: &str| -> Vec<u64> {
            text.lines()
                .filter(|l| l.contains(cpu))
                .filter_map(|l| l.split("seq=").nth(1))
                .filter_map(|r| r.split(' ').next()?.parse().ok())
                .collect()
        };
        let read = |cpu: u32| -> u64 {
            err.lines()
                .find_map(|l| l.strip_prefix(&format!("hyptrace: attach: cpu {cpu}: ")))
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no count: {err}"))
        };
        let s = seq_of("[000]");
        let s1 = seq_of("[001]");
        assert_eq!(s.len() as u64, read(0), "round {round}: {err}");
        assert_eq!(s1.len() as u64, read(1), "round {round}: {err}");
        for v in [&s, &s1] {
            assert!(
                v.windows(2).all(|w| w[1] == w[0] + 1),
                "round {round}: not contiguous"
            );
        }
        seqs.push(s);
    }
    assert!(vm.running(), "the VM runs on after one-shot attaches");
    if let (Some(a_last), Some(b_first), Some(b_last)) =
        (seqs[0].last(), seqs[1].first(), seqs[1].last())
    {
        assert_eq!(
            *b_first,
            a_last + 1,
            "the second subscriber goes on after the first"
        );
        assert!(b_last >= a_last, "second attach went backwards");
    }
    drop(vm);

    // --drain live: the VMM consumes itself; no attach.
    let sock2 = dir.file("live.sock");
    let mem2 = dir.file("live.trace");
    let mut live = Guard(Some(spawn(
        &[
            "run",
            "--drain",
            "live",
            "--trace-mem",
            &mem2,
            "--control",
            &sock2,
            "--events",
            "1000000",
            "--rate",
            "1000",
            "--duration",
            "60",
        ],
        &dir.file("live.out"),
        &dir.file("live.err"),
    )));
    wait_socket(&sock2, &mut live, &dir.file("live.err"));
    let (code, err) = run_bounded(
        &["dump", "--attach", &sock2, "-o", &dir.file("x.txt")],
        &dir,
        "live",
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--drain none"), "{err}");
    drop(live);

    // No --trace-mem: the VMM reads for the subscriber all the same.
    let sock3 = dir.file("nomem.sock");
    let mut nomem = Guard(Some(spawn(
        &[
            "run",
            "--drain",
            "none",
            "--control",
            &sock3,
            "--events",
            "1000000",
            "--rate",
            "1000",
            "--duration",
            "60",
        ],
        &dir.file("nomem.out"),
        &dir.file("nomem.err"),
    )));
    wait_socket(&sock3, &mut nomem, &dir.file("nomem.err"));
    let (code, err) = run_bounded(
        &["dump", "--attach", &sock3, "-o", &dir.file("y.txt")],
        &dir,
        "nomem",
    );
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("events received"), "{err}");
}

/// Rough throughput and latency: an attached `--follow` reader against the in-process
/// reader (`--drain live`), text on stdout of one vCPU at a fixed rate. Latency is the
/// spread of (arrival time of a line at this process - its guest timestamp) above its
/// minimum: delivery delay beyond the fastest line (buffering, polling, swaps).
#[test]
fn attach_measure() {
    if !kvm_available(KRATE, "attach_measure") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("attachmeasure");
    for (rate, n, dur) in [("20000", "200000", "60"), ("0", "100000000", "2")] {
        // In-process reader.
        let t0 = Instant::now();
        let lat_live = follow_lines(Command::new(BIN).args([
            "run",
            "--events",
            n,
            "--rate",
            rate,
            "--vcpus",
            "1",
            "--duration",
            dur,
        ]));
        let live_wall = t0.elapsed();
        // Attached reader.
        // Names per round: a previous round's socket or file must never satisfy a wait.
        let (mem, sock) = (
            dir.file(&format!("m{rate}.trace")),
            dir.file(&format!("m{rate}.sock")),
        );
        let vm_err = dir.file(&format!("m{rate}.err"));
        let args = vm_args(
            &mem,
            &sock,
            &[
                "--events",
                n,
                "--rate",
                rate,
                "--vcpus",
                "1",
                "--duration",
                dur,
            ],
        );
        let mut vm = Guard(Some(spawn(
            &args,
            &dir.file(&format!("m{rate}.out")),
            &vm_err,
        )));
        wait_socket(&sock, &mut vm, &vm_err);
        let t1 = Instant::now();
        let lat_att = follow_lines(Command::new(BIN).args([
            "dump", "--attach", &sock, "--follow", "-o", "-", "--format", "text",
        ]));
        let att_wall = t1.elapsed();
        let _ = vm.wait(Instant::now() + WALL, &vm_err);
        for (what, (lines, lat), wall) in [
            ("in-process", lat_live, live_wall),
            ("attach --follow", lat_att, att_wall),
        ] {
            println!(
                "MEASURE attach rate {rate}: {what}: {lines} events in {:.2} s ({:.0} events/s); delivery delay above the fastest line: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                wall.as_secs_f64(),
                lines as f64 / wall.as_secs_f64(),
                lat.0,
                lat.1,
                lat.2
            );
        }
    }
}

/// Runs `cmd` with stdout piped, timestamps every event line's arrival; returns the
/// events and (p50, p99, max) of arrival - guest timestamp above its minimum, in ms.
fn follow_lines(cmd: &mut Command) -> (u64, (f64, f64, f64)) {
    let mut child = Guard(Some(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn"),
    ));
    let out = child
        .0
        .as_mut()
        .and_then(|c| c.stdout.take())
        .expect("stdout");
    let start = Instant::now();
    let mut d: Vec<f64> = Vec::new();
    let mut lines = 0u64;
    for line in BufReader::new(out).lines() {
        let Ok(line) = line else { break };
        if start.elapsed() > WALL {
            break;
        }
        let Some(ts) = line
            .split_whitespace()
            .find(|w| w.ends_with(':') && w.contains('.'))
            .and_then(|w| w.trim_end_matches(':').parse::<f64>().ok())
        else {
            continue;
        };
        lines += 1;
        d.push(start.elapsed().as_secs_f64() - ts);
    }
    let _ = child.wait(Instant::now() + WALL, "/dev/null");
    if d.is_empty() {
        return (0, (0.0, 0.0, 0.0));
    }
    let min = d.iter().copied().fold(f64::INFINITY, f64::min);
    let mut v: Vec<f64> = d.iter().map(|x| (x - min) * 1e3).collect();
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p) as usize];
    (lines, (q(0.5), q(0.99), q(1.0)))
}

/// CPU 0's event seqs of a text output, checking that inside it every gap between two
/// events is exactly the drops printed between them (C1: one reader, every loss
/// counted where it is found).
fn seqs_with_drops_covered(path: &str) -> Vec<u64> {
    use hyptrace::text::Line;
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut seqs = Vec::new();
    let mut pending = 0u64;
    for (i, line) in parse_all(&text, path).iter().enumerate() {
        match line {
            Line::Drop { cpu: 0, count } => pending += count.expect("a drop line with a count"),
            Line::Event(e) if e.cpu == 0 => {
                let seq = e
                    .seq()
                    .unwrap_or_else(|| panic!("{path}:{}: no seq", i + 1));
                if let Some(&prev) = seqs.last() {
                    assert_eq!(
                        seq,
                        prev + 1 + pending,
                        "{path}:{}: seq {seq} after {prev}: a gap not covered by the drops printed ({pending})",
                        i + 1
                    );
                }
                pending = 0;
                seqs.push(seq);
            }
            _ => {}
        }
    }
    seqs
}

/// Issue 23's consumers in a row: one-shot `dump --attach` after one-shot on a running
/// 1-vCPU VM, in both swap modes, in stop mode at 100 k events/s and in overwrite mode at
/// 2 k events/s. Each exits 0; across the consumers' outputs no event appears twice
/// (C1: each goes on where the last one's acknowledgements end), and inside each output
/// every gap is covered by a drop line.
#[test]
fn consumers_in_a_row_repeat_nothing() {
    if !kvm_available(KRATE, "consumers_in_a_row_repeat_nothing") {
        return;
    }
    let _l = vm_lock();
    // 8 consumers per combination in the test command; HYPTRACE_INAROW_ROUNDS for more
    // (the acceptance: 15).
    let rounds = rounds_from_env("HYPTRACE_INAROW_ROUNDS", 8);
    for swap in ["guest", "host"] {
        for (mode, rate) in [("stop", "100000"), ("overwrite", "2000")] {
            let tag = format!("{swap}-{mode}");
            let dir = TempDir::new(&format!("inarow-{tag}"));
            let (mem, sock) = (dir.file("vm.trace"), dir.file("vm.sock"));
            let vm_err = dir.file("vm.err");
            let extra = [
                "--vcpus",
                "1",
                "--swap",
                swap,
                "--mode",
                mode,
                "--rate",
                rate,
                "--events",
                "100000000",
                "--duration",
                "120",
                "--buffer-kb",
                "64",
            ];
            let args = vm_args(&mem, &sock, &extra);
            let mut vm = Guard(Some(spawn(&args, "/dev/null", &vm_err)));
            wait_socket(&sock, &mut vm, &vm_err);
            let mut seen = std::collections::HashSet::new();
            let mut events = 0usize;
            let mut last = 0;
            for round in 0..rounds {
                // Something new for every consumer (a condition, not a sleep): the
                // writer took in at least 50 events (a page holds about 145) since the
                // last one, so consumers end mid-page as often as on a page's end.
                last = wait_written(&sock, &mut vm, &vm_err, last + 50);
                let out = dir.file(&format!("c{round}.txt"));
                let (code, err) = run_bounded(
                    &["dump", "--attach", &sock, "-o", &out, "--format", "text"],
                    &dir,
                    &format!("c{round}"),
                );
                no_panic(&err, &tag);
                assert_eq!(code, Some(0), "{tag} consumer {round}: {err}");
                assert!(vm.running(), "{tag}: the VM runs on");
                let seqs = seqs_with_drops_covered(&out);
                events += seqs.len();
                for s in seqs {
                    assert!(
                        seen.insert(s),
                        "{tag}: consumer {round} printed seq {s}, which an earlier consumer printed: {err}"
                    );
                }
            }
            assert!(events > 0, "{tag}: no consumer read anything");
            println!("{tag}: {rounds} consumers, {events} events");
            let vmerr = std::fs::read_to_string(&vm_err).unwrap_or_default();
            no_panic(&vmerr, &tag);
        }
    }
}

/// Rounds of a test: `var` in the environment, else `default`.
fn rounds_from_env(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The events CPU 0's writer took in so far, as the VMM behind `sock` says (`ctl stats`;
/// 0 when it does not answer).
fn cpu0_written(sock: &str) -> u64 {
    let o = Command::new(BIN)
        .args(["ctl", sock, "stats"])
        .output()
        .expect("ctl");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
    v["cpus"][0]["written"].as_u64().unwrap_or(0)
}

/// Waits (bounded) until CPU 0's writer behind `sock` took in `at_least` events; returns
/// how many it had then.
fn wait_written(sock: &str, vm: &mut Guard, vm_err: &str, at_least: u64) -> u64 {
    env::wait_until(
        vm.0.as_mut().expect("child"),
        &format!("{at_least} events written"),
        WALL,
        || cpu0_written(sock) >= at_least,
        || std::fs::read_to_string(vm_err).unwrap_or_default(),
    );
    cpu0_written(sock)
}

/// Per CPU, (events, lost) as `dump --attach` reports them on stderr (`hyptrace: attach:
/// cpu 0: 30000 events received, 0 lost`).
fn received(stderr: &str) -> Vec<(u64, u64)> {
    counts(stderr, "hyptrace: attach: cpu ", ": ", "received, ")
}

/// Per CPU, (read, lost) as the VMM's summary reports them on stderr (`hyptrace: cpu 0:
/// attempted .. read N lost M (...`).
fn vmm_read(stderr: &str) -> Vec<(u64, u64)> {
    counts(stderr, "hyptrace: cpu ", " read ", " lost ")
}

/// Per CPU (in order of the lines `prefix` starts), the numbers right after `a` and `b`.
fn counts(stderr: &str, prefix: &str, a: &str, b: &str) -> Vec<(u64, u64)> {
    let num =
        |s: &str| -> Option<u64> { s.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok() };
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|l| Some((num(l.split(a).nth(1)?)?, num(l.split(b).nth(1)?)?)))
        .collect()
}

/// Waits (bounded) until the VMM behind `sock` says a subscriber holds the claim.
fn wait_subscribed(sock: &str, vm: &mut Guard, vm_err: &str) {
    env::wait_until(
        vm.0.as_mut().expect("child"),
        "the subscriber's claim",
        WALL,
        || {
            let o = Command::new(BIN).args(["ctl", sock, "stats"]).output();
            o.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("\"subscribed\":true"))
        },
        || std::fs::read_to_string(vm_err).unwrap_or_default(),
    );
}

/// Issue 35, acceptance 1: a `--swap guest` VM (flat out or at 100 k/s, a 16 KiB ring: a
/// swap is in flight most of the time) ends — its writer finishing, or `--duration` stopping
/// its vCPU — while a `--follow` subscriber reads; the VMM and the subscriber share one
/// CPU (`taskset -c 0`); stop and overwrite; the reader's priority raised and `normal`.
/// In every run both exit 0, the subscriber received exactly the VMM's read and lost
/// counts, and every gap in its output is covered by a drop line. Runs per setting:
/// 3, or `HYPTRACE_ATTACH_ROUNDS` (the acceptance: 20).
#[test]
fn guest_swap_vm_ends_under_a_follow_subscriber() {
    if !kvm_available(KRATE, "guest_swap_vm_ends_under_a_follow_subscriber") {
        return;
    }
    if !Command::new("taskset")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        println!("SKIP: taskset not installed");
        return;
    }
    let _l = vm_lock();
    let rounds = rounds_from_env("HYPTRACE_ATTACH_ROUNDS", 3);
    let dir = TempDir::new("attachend");
    let mut n = 0;
    for mode in ["overwrite", "stop"] {
        for prio in ["raised", "normal"] {
            for round in 0..rounds {
                n += 1;
                let tag = format!("{mode}-{prio}-{round}");
                // Even rounds: the writer finishes by itself (2 s on its schedule; a
                // paced guest pinned with its reader runs late, not lost); odd: flat out
                // until --duration stops the vCPU.
                let ending: &[&str] = if round % 2 == 0 {
                    &["--rate", "100000", "--events", "200000"]
                } else {
                    &["--rate", "0", "--events", "1000000000", "--duration", "1.5"]
                };
                let sock = dir.file(&format!("{tag}.sock"));
                let (vm_err, a_txt, a_err) = (
                    dir.file(&format!("{tag}.vm.err")),
                    dir.file(&format!("{tag}.txt")),
                    dir.file(&format!("{tag}.a.err")),
                );
                let mut vm_cmd = Command::new("taskset");
                vm_cmd.args(["-c", "0", BIN, "run", "--drain", "none", "--control", &sock]);
                vm_cmd.args([
                    "--vcpus",
                    "1",
                    "--swap",
                    "guest",
                    "--mode",
                    mode,
                    "--buffer-kb",
                    "16",
                ]);
                vm_cmd.args(ending);
                if prio == "normal" {
                    vm_cmd.env("HYPTRACE_READER_PRIORITY", "normal");
                }
                let mut vm = Guard(Some(spawn_cmd(&mut vm_cmd, "/dev/null", &vm_err)));
                wait_socket(&sock, &mut vm, &vm_err);
                let mut att_cmd = Command::new("taskset");
                att_cmd.args(["-c", "0", BIN, "dump", "--attach", &sock, "--follow"]);
                att_cmd.args(["-o", &a_txt, "--format", "text"]);
                let mut att = Guard(Some(spawn_cmd(&mut att_cmd, "/dev/null", &a_err)));
                // The claim is taken while the VM runs (its run is long for that).
                wait_subscribed(&sock, &mut vm, &vm_err);
                let deadline = Instant::now() + WALL;
                let vm_code = vm.wait(deadline, &vm_err);
                let a_code = att.wait(deadline, &a_err);
                let a_stderr = std::fs::read_to_string(&a_err).unwrap_or_default();
                let v_stderr = std::fs::read_to_string(&vm_err).unwrap_or_default();
                no_panic(&a_stderr, &tag);
                no_panic(&v_stderr, &tag);
                assert_eq!(vm_code, Some(0), "{tag}: VMM\n{v_stderr}");
                assert_eq!(a_code, Some(0), "{tag}: subscriber\n{a_stderr}\n{v_stderr}");
                let (got, read) = (received(&a_stderr), vmm_read(&v_stderr));
                assert_eq!(got.len(), 1, "{tag}: {a_stderr}");
                assert_eq!(got, read, "{tag}: received != read\n{a_stderr}\n{v_stderr}");
                let t = check_text(&a_txt, 1);
                assert_eq!(t[0].events, got[0].0, "{tag}: {:?}", t[0]);
                assert_eq!(t[0].dropped, got[0].1, "{tag}: {:?}", t[0]);
            }
        }
    }
    println!("{n} runs: every subscriber received what its VMM read");
}

/// Issue 35, acceptance 2: on one running VM a one-shot text-to-stdout subscriber
/// (partial pieces: it leaves mid-page), then a one-shot page-sink subscriber (`-o
/// FILE`), then the VMM's own output (its final walk after SIGINT): stop at 2 000/s and
/// overwrite at 20 000/s, both swap modes. Across the three outputs no event appears
/// twice; inside each every gap is covered by a drop line; together they hold every
/// event the writer took in or count it lost; all three exit 0. Rounds per setting: 1, or
/// `HYPTRACE_ATTACH_ROUNDS` (the acceptance: 10).
#[test]
fn text_then_page_subscriber_then_the_vmm() {
    if !kvm_available(KRATE, "text_then_page_subscriber_then_the_vmm") {
        return;
    }
    let _l = vm_lock();
    let rounds = rounds_from_env("HYPTRACE_ATTACH_ROUNDS", 1);
    let dir = TempDir::new("attach3");
    for (mode, rate) in [("stop", "2000"), ("overwrite", "20000")] {
        for swap in ["guest", "host"] {
            for round in 0..rounds {
                let tag = format!("{mode}-{swap}-{round}");
                three_readers(
                    &dir,
                    &tag,
                    &["--mode", mode, "--rate", rate, "--swap", swap],
                );
            }
        }
    }
}

/// One round of [`text_then_page_subscriber_then_the_vmm`].
fn three_readers(dir: &TempDir, tag: &str, extra: &[&str]) {
    let sock = dir.file(&format!("{tag}.sock"));
    let (vm_out, vm_err) = (
        dir.file(&format!("{tag}.vm.txt")),
        dir.file(&format!("{tag}.vm.err")),
    );
    let mut args = vec!["run", "--drain", "none", "--control", &sock, "--vcpus", "1"];
    args.extend_from_slice(&[
        "--events",
        "100000000",
        "--duration",
        "120",
        "--buffer-kb",
        "64",
    ]);
    args.extend_from_slice(extra);
    let mut vm = Guard(Some(spawn(&args, &vm_out, &vm_err)));
    wait_socket(&sock, &mut vm, &vm_err);
    let mut outs = Vec::new();
    let mut last = 0;
    for (i, o) in ["-", "file"].iter().enumerate() {
        // Something new for each subscriber (a condition, not a sleep).
        last = wait_written(&sock, &mut vm, &vm_err, last + 300);
        let file = dir.file(&format!("{tag}.c{i}.txt"));
        let target = if *o == "-" { "-" } else { file.as_str() };
        let (code, err) = run_bounded(
            &["dump", "--attach", &sock, "-o", target, "--format", "text"],
            dir,
            &format!("{tag}.c{i}"),
        );
        no_panic(&err, tag);
        assert_eq!(code, Some(0), "{tag}: subscriber {i}: {err}");
        outs.push(if *o == "-" {
            dir.file(&format!("{tag}.c{i}.out"))
        } else {
            file
        });
    }
    assert!(vm.running(), "{tag}: the VM runs on");
    let pid = vm.0.as_ref().expect("child").id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .expect("kill")
        .success());
    let vm_code = vm.wait(Instant::now() + WALL, &vm_err);
    let v_stderr = std::fs::read_to_string(&vm_err).unwrap_or_default();
    no_panic(&v_stderr, tag);
    assert_eq!(vm_code, Some(0), "{tag}: VMM\n{v_stderr}");
    outs.push(vm_out);
    let mut seen = std::collections::BTreeSet::new();
    let mut drops = 0u64;
    for o in &outs {
        let seqs = seqs_with_drops_covered(o);
        let text = std::fs::read_to_string(o).unwrap_or_default();
        drops += parse_all(&text, o)
            .iter()
            .map(|l| match l {
                hyptrace::text::Line::Drop { cpu: 0, count } => count.unwrap_or(0),
                _ => 0,
            })
            .sum::<u64>();
        for s in seqs {
            assert!(seen.insert(s), "{tag}: event {s} in two outputs ({o})");
        }
    }
    let (read, lost) = vmm_read(&v_stderr)[0];
    assert_eq!(
        seen.len() as u64,
        read,
        "{tag}: the outputs hold what the VMM read\n{v_stderr}"
    );
    assert_eq!(
        drops, lost,
        "{tag}: the outputs' drop lines are the VMM's losses\n{v_stderr}"
    );
}
