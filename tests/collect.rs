//! `hyptrace collect` (issue 40): one process subscribes to several running VMMs
//! (`run --vcpus 1 --drain none --trace-mem F --control S`) and writes one trace.dat v7
//! with one buffer instance per VM, every VM on host CLOCK_MONOTONIC. VM tests are
//! skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1; the trace-cmd checks without
//! trace-cmd unless HYPTRACE_REQUIRE_TRACE_CMD=1.
//!
//! Every child runs under a bound ([`WALL`]) and is killed past it or when the test
//! fails: a test fails, never hangs. It waits for states (a socket exists, the VMM read
//! pages), never for a time.

use std::os::unix::fs::FileTypeExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// Longest any child may run (boot, run, collect on a loaded machine).
const WALL: Duration = Duration::from_secs(120);

/// A child killed when dropped (a failing test leaves no VM behind).
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Kid {
    /// `hyptrace args`, stdout and stderr into `DIR/TAG.out`, `DIR/TAG.err`.
    fn spawn(dir: &TempDir, tag: &str, args: &[&str]) -> Self {
        let file = |ext: &str| {
            Stdio::from(std::fs::File::create(dir.file(&format!("{tag}.{ext}"))).expect("file"))
        };
        let c = Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file("out"))
            .stderr(file("err"))
            .spawn()
            .expect("spawn hyptrace");
        Self(c)
    }

    /// Waits (bounded) for the exit; its code.
    fn wait(&mut self, what: &str) -> Option<i32> {
        env::wait_exit(&mut self.0, what, WALL).code()
    }
}

fn read(dir: &TempDir, name: &str) -> String {
    std::fs::read_to_string(dir.file(name)).unwrap_or_default()
}

/// Starts a VMM writing `events` markers at 5000/s into a 8 MiB ring (stop mode: none
/// lost), socket `DIR/NAME.sock`; waits (bounded) until the socket exists.
fn start_vm(dir: &TempDir, name: &str, events: u64) -> Kid {
    start_vm_with(dir, name, events, &[])
}

/// [`start_vm`] with `extra` arguments to its `run`.
fn start_vm_with(dir: &TempDir, name: &str, events: u64, extra: &[&str]) -> Kid {
    let (mut args, sock) = env::subscribed_vm_args(dir, name, events);
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut vm = Kid::spawn(dir, name, &args);
    env::wait_until(
        &mut vm.0,
        &format!("the socket of {name}"),
        WALL,
        || std::fs::symlink_metadata(&sock).is_ok_and(|m| m.file_type().is_socket()),
        || read(dir, &format!("{name}.err")),
    );
    vm
}

fn sock(dir: &TempDir, name: &str) -> String {
    dir.file(&format!("{name}.sock"))
}

/// Waits (bounded) until the VMM behind `sock` swapped pages for `col` (its stats).
fn wait_read(dir: &TempDir, sock: &str, col: &mut Kid) {
    let t = Instant::now();
    loop {
        let o = Command::new(BIN)
            .args(["ctl", sock, "stats"])
            .output()
            .expect("ctl");
        let v: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or(serde_json::Value::Null);
        if v["cpus"][0]["swaps"].as_u64().unwrap_or(0) >= 2 {
            return;
        }
        assert!(
            col.0.try_wait().expect("try_wait").is_none(),
            "collect ended early: {}",
            read(dir, "collect.err")
        );
        assert!(t.elapsed() < WALL, "{sock} never read: {v}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `trace-cmd report` of `dat`: per line (VM name, seq, time in ns) of every marker.
fn report(dat: &str) -> Vec<(String, u64, u64)> {
    let o = Command::new("trace-cmd")
        .args(["report", "-i", dat])
        .output()
        .expect("trace-cmd");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    markers(&String::from_utf8_lossy(&o.stdout))
}

/// An event line of a report (trace-cmd's, or collect's text): its instance and its
/// time in ns. ` vm1:            vcpu0-1     [000] 26843.796473: marker:   seq=0 value=0`
fn timed(l: &str) -> (String, u64) {
    let (vm, rest) = l.trim_start().split_once(':').expect("a VM name");
    let time = rest
        .split_whitespace()
        .find_map(|w| w.strip_suffix(':').filter(|t| t.contains('.')))
        .expect("a time");
    let (s, us) = time.split_once('.').expect("s.us");
    let ns = s.parse::<u64>().expect("s") * 1_000_000_000
        + us.parse::<u64>().expect("us") * 10u64.pow(9 - us.len() as u32);
    (vm.to_string(), ns)
}

/// Per marker line of a report (trace-cmd's, or collect's text): (VM name, seq, ns).
fn markers(text: &str) -> Vec<(String, u64, u64)> {
    let mut v = Vec::new();
    for l in text.lines().filter(|l| l.contains(" marker: ")) {
        let (vm, ns) = timed(l);
        let seq = l
            .split("seq=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .expect("seq");
        v.push((vm, seq, ns));
    }
    v
}

/// Per VM of `lines`: its seqs are 0.. in order, `n` of them.
fn check_vm(lines: &[(String, u64, u64)], vm: &str, n: u64) {
    let seqs: Vec<u64> = lines
        .iter()
        .filter(|(v, ..)| v == vm)
        .map(|(_, s, _)| *s)
        .collect();
    assert_eq!(seqs.len() as u64, n, "{vm}");
    assert!(
        seqs.iter().copied().eq(0..n),
        "{vm}: seqs not 0..{n} in order"
    );
}

/// The acceptance run's VMs: name, events.
const THREE: [(&str, u64); 3] = [("vma", 30_000), ("vmb", 40_000), ("vmc", 50_000)];

/// Three VMMs of 30 000, 40 000 and 50 000 events collected with `--follow` into
/// `DIR/out`: exit 0, "3 of 3 VMs complete", and the accounting per VM exact (each
/// VMM read what collect received). Returns the output's path.
fn collect_three(dir: &TempDir, out: &str) -> String {
    let mut kids: Vec<Kid> = THREE.iter().map(|(n, e)| start_vm(dir, n, *e)).collect();
    let path = dir.file(out);
    let names: Vec<String> = THREE
        .iter()
        .map(|(n, _)| format!("{n}={}", sock(dir, n)))
        .collect();
    let mut args = vec!["collect", "--follow", "-o", &path];
    args.extend(names.iter().map(String::as_str));
    let mut c = Kid::spawn(dir, "collect", &args);
    let code = c.wait("collect");
    let err = read(dir, "collect.err");
    for (k, (n, e)) in kids.iter_mut().zip(&THREE) {
        assert_eq!(k.wait(n), Some(0), "{}", read(dir, &format!("{n}.err")));
        let want = format!("{n}: cpu 0: {e} events read, 0 lost");
        assert!(err.contains(&want), "{want}:\n{err}");
        // One reader: what collect received is what the VMM read.
        let vmm = read(dir, &format!("{n}.err"));
        assert!(vmm.contains(&format!(" read {e} lost 0")), "{vmm}");
    }
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("3 of 3 VMs complete"), "{err}");
    path
}

/// The acceptance run: three VMMs of 30 000, 40 000 and 50 000 events collected with
/// `--follow` into one trace.dat: exit 0, the accounting per VM exact, and trace-cmd
/// prints 120 000 events, each line naming its VM, in one time order (the VMs ran at
/// once: their lines interleave).
#[test]
fn collect_three_vms_into_one_trace() {
    if !kvm_available(KRATE, "collect_three_vms_into_one_trace") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collect3");
    let dat = collect_three(&dir, "all.dat");
    if !env::trace_cmd_available() {
        return;
    }
    let lines = report(&dat);
    assert_eq!(lines.len(), 120_000);
    for (n, e) in &THREE {
        check_vm(&lines, n, *e);
    }
    assert!(
        lines.windows(2).all(|w| w[0].2 <= w[1].2),
        "the lines are not in one time order"
    );
    let switches = lines.windows(2).filter(|w| w[0].0 != w[1].0).count();
    assert!(
        switches > 100,
        "the VMs' lines do not interleave: {switches}"
    );
}

/// The acceptance run into Perfetto (`-o all.pftrace`): decoded with Perfetto's
/// official protos (every packet valid, every thread under its declared process, no
/// tid twice), one process per VM named after it, its vCPU a thread of it, and 30 000,
/// 40 000, 50 000 markers on the VMs' threads: 120 000 in all, each VM's seqs 0.. in
/// time order, the VMs' events interleaved on one time line.
#[test]
fn collect_three_vms_into_perfetto() {
    if !kvm_available(KRATE, "collect_three_vms_into_perfetto") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collect3pf");
    let out = collect_three(&dir, "all.pftrace");
    if !env::perfetto_available() {
        return;
    }
    let v: serde_json::Value =
        serde_json::from_slice(&env::perfetto_decode(&out, true)).expect("decoder JSON");
    let processes = v["processes"].as_object().expect("processes");
    assert_eq!(processes.len(), 3, "{}", v["processes"]);
    let mut all: Vec<(String, u64, u64)> = Vec::new();
    for (n, e) in &THREE {
        let (uuid, p) = processes
            .iter()
            .find(|(_, p)| p["name"] == *n)
            .unwrap_or_else(|| panic!("no process {n}: {}", v["processes"]));
        let threads: Vec<u64> = v["threads"]
            .as_object()
            .expect("threads")
            .iter()
            .filter(|(_, t)| t["parent"].as_u64().map(|p| p.to_string()).as_ref() == Some(uuid))
            .map(|(u, t)| {
                assert_eq!(t["pid"], p["pid"], "{n}");
                assert_eq!(t["name"], "vcpu0", "{n}");
                u.parse().expect("uuid")
            })
            .collect();
        assert_eq!(threads.len(), 1, "{n}: {}", v["threads"]);
        let mine: Vec<(String, u64, u64)> = v["events"]
            .as_array()
            .expect("events")
            .iter()
            .filter(|ev| ev[0].as_u64() == Some(threads[0]))
            .map(|ev| {
                assert_eq!(ev[3], "marker", "{n}: {ev}");
                let seq = ev[5]["seq"].as_u64().expect("seq");
                (n.to_string(), seq, ev[1].as_u64().expect("ts"))
            })
            .collect();
        check_vm(&mine, n, *e);
        assert!(mine.windows(2).all(|w| w[0].2 <= w[1].2), "{n}: time order");
        all.extend(mine);
    }
    assert_eq!(all.len(), 120_000);
    assert_eq!(v["events"].as_array().map(Vec::len), Some(120_000));
    all.sort_by_key(|x| x.2);
    let switches = all.windows(2).filter(|w| w[0].0 != w[1].0).count();
    assert!(
        switches > 100,
        "the VMs' events do not interleave: {switches}"
    );
}

/// The acceptance run into JSON (`-o all.json`): every entry names its VM (`vm`,
/// and its pid is the VM's process, named after it), 30 000, 40 000, 50 000 markers per
/// VM, each VM's seqs 0.. in order, the whole file in one time order.
#[test]
fn collect_three_vms_into_json() {
    if !kvm_available(KRATE, "collect_three_vms_into_json") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collect3json");
    let out = collect_three(&dir, "all.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).expect("json")).expect("JSON");
    let entries = v["traceEvents"].as_array().expect("traceEvents");
    let pids: std::collections::BTreeMap<u64, String> = entries
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| {
            (
                e["pid"].as_u64().expect("pid"),
                e["args"]["name"].as_str().expect("name").to_string(),
            )
        })
        .collect();
    assert_eq!(pids.len(), 3, "{pids:?}");
    let mut lines = Vec::new();
    for e in entries.iter().filter(|e| e["ph"] != "M") {
        assert_eq!(e["name"], "marker", "{e}");
        let vm = e["vm"].as_str().expect("vm").to_string();
        assert_eq!(pids.get(&e["pid"].as_u64().expect("pid")), Some(&vm), "{e}");
        assert_eq!(e["tid"], 0, "{e}");
        let ts = e["ts"].as_f64().expect("ts");
        lines.push((
            vm,
            e["args"]["seq"].as_u64().expect("seq"),
            (ts * 1000.0).round() as u64,
        ));
    }
    assert_eq!(lines.len(), 120_000);
    for (n, e) in &THREE {
        check_vm(&lines, n, *e);
    }
    assert!(
        lines.windows(2).all(|w| w[0].2 <= w[1].2),
        "not in one time order"
    );
}

/// One VM of three killed during `collect --follow`: named on stderr, the others
/// complete, exit 1; the file holds every event of the two and what was read of it.
#[test]
fn collect_names_a_killed_vm() {
    if !kvm_available(KRATE, "collect_names_a_killed_vm") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collectkill");
    let mut a = start_vm(&dir, "a", 20_000);
    let mut b = start_vm(&dir, "b", 10_000_000);
    let mut c = start_vm(&dir, "c", 20_000);
    let dat = dir.file("all.dat");
    let (sa, sb, sc) = (sock(&dir, "a"), sock(&dir, "b"), sock(&dir, "c"));
    let mut col = Kid::spawn(
        &dir,
        "collect",
        &["collect", "--follow", "-o", &dat, &sa, &sb, &sc],
    );
    // Once b's VMM read pages for collect (its stats), kill it.
    wait_read(&dir, &sb, &mut col);
    b.0.kill().expect("kill b");
    let _ = b.0.wait();
    let code = col.wait("collect");
    let err = read(&dir, "collect.err");
    assert_eq!(a.wait("a"), Some(0), "{}", read(&dir, "a.err"));
    assert_eq!(c.wait("c"), Some(0), "{}", read(&dir, "c.err"));
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in ["a", "c"] {
        let want = format!("{n}: cpu 0: 20000 events read, 0 lost");
        assert!(err.contains(&want), "{want}:\n{err}");
    }
    assert!(err.contains("b: error: "), "{err}");
    assert!(
        err.lines()
            .any(|l| l.contains(" b: ") && l.contains("INCOMPLETE")),
        "{err}"
    );
    assert!(err.contains("2 of 3 VMs complete"), "{err}");
    let b_read: u64 = err
        .lines()
        .find_map(|l| l.split("collect: b: cpu 0: ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("b's count");
    if !env::trace_cmd_available() {
        return;
    }
    let lines = report(&dat);
    check_vm(&lines, "a", 20_000);
    check_vm(&lines, "c", 20_000);
    check_vm(&lines, "b", b_read);
}

/// Text (`-o all.txt`): every event of two VMs, each line prefixed with its VM, in
/// one time order.
#[test]
fn collect_text_names_every_line() {
    if !kvm_available(KRATE, "collect_text_names_every_line") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collecttxt");
    let mut a = start_vm(&dir, "a", 10_000);
    let mut b = start_vm(&dir, "bb", 15_000);
    let txt = dir.file("all.txt");
    let (sa, sb) = (sock(&dir, "a"), sock(&dir, "bb"));
    let mut col = Kid::spawn(
        &dir,
        "collect",
        &["collect", "--follow", "-o", &txt, &sa, &sb],
    );
    let code = col.wait("collect");
    let err = read(&dir, "collect.err");
    assert_eq!(a.wait("a"), Some(0), "{}", read(&dir, "a.err"));
    assert_eq!(b.wait("bb"), Some(0), "{}", read(&dir, "bb.err"));
    assert_eq!(code, Some(0), "{err}");
    let text = read(&dir, "all.txt");
    // Names right-aligned to the longest, as trace-cmd prints instances.
    assert!(text
        .lines()
        .all(|l| l.starts_with(" a: ") || l.starts_with("bb: ")));
    let lines = markers(&text);
    assert_eq!(lines.len(), 25_000);
    check_vm(&lines, "a", 10_000);
    check_vm(&lines, "bb", 15_000);
    assert!(
        lines.windows(2).all(|w| w[0].2 <= w[1].2),
        "not in time order"
    );
}

/// A VMM stopped (SIGSTOP) during `collect --follow`: after the reply timeout it is
/// named as no longer answering, the other VM completes, exit 1; the file holds what was
/// read of the stopped one.
#[test]
fn collect_names_a_vm_that_stops_answering() {
    if !kvm_available(KRATE, "collect_names_a_vm_that_stops_answering") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collectstop");
    let mut a = start_vm(&dir, "a", 20_000);
    let b = start_vm(&dir, "b", 10_000_000);
    let dat = dir.file("all.dat");
    let (sa, sb) = (sock(&dir, "a"), sock(&dir, "b"));
    let mut col = Kid::spawn(
        &dir,
        "collect",
        &["collect", "--follow", "-o", &dat, &sa, &sb],
    );
    wait_read(&dir, &sb, &mut col);
    env::signal(&b.0, "-STOP");
    let code = col.wait("collect");
    let err = read(&dir, "collect.err");
    assert_eq!(a.wait("a"), Some(0), "{}", read(&dir, "a.err"));
    drop(b);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("a: cpu 0: 20000 events read, 0 lost"), "{err}");
    assert!(
        err.contains("b: error: ") && err.contains("stopped answering"),
        "{err}"
    );
    assert!(err.contains("1 of 2 VMs complete"), "{err}");
    if env::trace_cmd_available() {
        check_vm(&report(&dat), "a", 20_000);
    }
}

/// A VM on another clock (`--clock tsc`) cannot share the time line: it is named and
/// left out, the other VM is collected (one shot), exit 1.
#[test]
fn collect_leaves_out_a_vm_on_another_clock() {
    if !kvm_available(KRATE, "collect_leaves_out_a_vm_on_another_clock") {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collectclock");
    let mut a = start_vm_with(&dir, "a", 20_000, &["--clock", "tsc"]);
    let sa = sock(&dir, "a");
    let mut b = start_vm(&dir, "b", 20_000);
    let dat = dir.file("all.dat");
    let sb = sock(&dir, "b");
    let mut col = Kid::spawn(&dir, "collect", &["collect", "-o", &dat, &sa, &sb]);
    let code = col.wait("collect");
    let err = read(&dir, "collect.err");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("a: error: ") && err.contains("on clock x86-tsc"),
        "{err}"
    );
    assert!(
        err.contains("b: ") && err.contains("1 of 2 VMs complete"),
        "{err}"
    );
    assert_eq!(a.wait("a"), Some(0), "{}", read(&dir, "a.err"));
    assert_eq!(b.wait("b"), Some(0), "{}", read(&dir, "b.err"));
    assert!(std::path::Path::new(&dat).exists());
}

/// Bad command lines: exit 2 with one line naming the problem, nothing written.
#[test]
fn collect_refuses_bad_arguments() {
    let dir = TempDir::new("collectargs");
    let dat = dir.file("x.dat");
    for (args, needle) in [
        (
            vec!["collect", "-o", &dat, "a=/x", "a=/y"],
            "a second VM named a",
        ),
        (vec!["collect", "-o", &dat, "a b=/x"], "a VM's name"),
        (
            vec!["collect", "-o", "x.raw", "a=/x"],
            "collect writes trace.dat v7, text, JSON or Perfetto",
        ),
        (
            vec!["collect", "--host-trace", "sched:*", "-o", &dat, "host=/x"],
            "a VM named host",
        ),
        (
            vec![
                "collect",
                "--host-trace",
                "sched:*",
                "-o",
                "clickhouse://127.0.0.1:1/db",
                "a=/x",
            ],
            "collect stores no host events in ClickHouse",
        ),
    ] {
        let o = env::run(BIN, &args);
        env::assert_usage_error(&o, &format!("{args:?}"), needle);
    }
    assert!(!std::path::Path::new(&dat).exists());
}

/// `HOST: cpu N: R events read, ...` lines of collect's stderr: R summed.
fn host_read(err: &str) -> u64 {
    err.lines()
        .filter_map(|l| l.split("collect: host: cpu ").nth(1))
        .map(|r| {
            let n = r
                .split(": ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next());
            n.and_then(|n| n.parse::<u64>().ok()).expect("a count")
        })
        .sum()
}

/// Two VMMs (`a`: 10 000 markers, `b`: 15 000) collected with `--follow --host-trace
/// sched:sched_switch` into `DIR/out`: exit 0, each VM's accounting exact, the host's per
/// host CPU and complete; collect's tracefs instance exists while it runs and is gone
/// after. Returns the output's path and how many host events collect counted.
fn collect_with_host(dir: &TempDir, out: &str) -> (String, u64) {
    let mut a = start_vm(dir, "a", 10_000);
    let mut b = start_vm(dir, "b", 15_000);
    let path = dir.file(out);
    let (sa, sb) = (sock(dir, "a"), sock(dir, "b"));
    let args = [
        "collect",
        "--follow",
        "--host-trace",
        "sched:sched_switch",
        "-o",
        &path,
        &sa,
        &sb,
    ];
    let mut col = Kid::spawn(dir, "collect", &args);
    let pid = col.0.id();
    // The VMs write for seconds, and collect follows them to their end.
    env::wait_until(
        &mut col.0,
        "collect's tracefs instance",
        WALL,
        || env::tracefs_instance(pid).is_some(),
        || read(dir, "collect.err"),
    );
    let code = col.wait("collect");
    let err = read(dir, "collect.err");
    assert_eq!(env::tracefs_instance(pid), None, "instance left: {err}");
    assert_eq!(a.wait("a"), Some(0), "{}", read(dir, "a.err"));
    assert_eq!(b.wait("b"), Some(0), "{}", read(dir, "b.err"));
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("a: cpu 0: 10000 events read, 0 lost"), "{err}");
    assert!(err.contains("b: cpu 0: 15000 events read, 0 lost"), "{err}");
    assert!(err.contains("collect: host: cpu 0: "), "{err}");
    assert!(
        err.lines()
            .any(|l| l.contains("collect: host: ") && l.ends_with(": complete")),
        "{err}"
    );
    assert!(
        err.contains("2 of 2 VMs complete, the host's events complete"),
        "{err}"
    );
    let host_events = host_read(&err);
    assert!(host_events > 0, "{err}");
    (path, host_events)
}

/// [`collect_with_host`] into trace.dat: `trace-cmd report` prints every marker of each
/// VM (seqs 0.. in order) and exactly the host events collect counted, as sched_switch
/// lines of the instance `host`, all in one time order, the host's time range
/// overlapping the VMs' (one clock), its tasks named; `trace-cmd dump --events` lists
/// no id >= 0x8000.
#[test]
fn collect_host_trace_on_the_vms_time_line() {
    let test = "collect_host_trace_on_the_vms_time_line";
    if !kvm_available(KRATE, test) || !env::tracefs_available(KRATE, test) {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collecthost");
    let (dat, host_events) = collect_with_host(&dir, "all.dat");
    if !env::trace_cmd_available() {
        return;
    }
    let o = Command::new("trace-cmd")
        .args(["report", "-i", &dat])
        .output()
        .expect("trace-cmd");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let lines = markers(&text);
    check_vm(&lines, "a", 10_000);
    check_vm(&lines, "b", 15_000);
    let all: Vec<(String, u64)> = text
        .lines()
        .filter(|l| !l.starts_with("cpus="))
        .map(timed)
        .collect();
    let host: Vec<u64> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("host:"))
        .map(|l| {
            assert!(l.contains(" sched_switch: "), "{l}");
            timed(l).1
        })
        .collect();
    assert_eq!(host.len() as u64, host_events);
    // The host's comms are in the file's command lines (the kernel's saved_cmdlines):
    // trace-cmd names the tasks (a task whose entry the kernel reused is `<...>`).
    let unnamed = text
        .lines()
        .filter(|l| l.trim_start().starts_with("host:") && l.contains("<...>-"))
        .count();
    assert!(
        unnamed * 10 < host.len(),
        "{unnamed} of {} unnamed",
        host.len()
    );
    assert_eq!(all.len(), 25_000 + host.len());
    assert!(
        all.windows(2).all(|w| w[0].1 <= w[1].1),
        "not in one time order"
    );
    let vm = lines.iter().map(|l| l.2);
    let (vm_min, vm_max) = (vm.clone().min().expect("VM"), vm.max().expect("VM"));
    let (h_min, h_max) = (host[0], host[host.len() - 1]);
    assert!(
        h_min < vm_max && vm_min < h_max,
        "host {h_min}..{h_max} does not overlap the VMs' {vm_min}..{vm_max}"
    );
    let o = Command::new("trace-cmd")
        .args(["dump", "--events", &dat])
        .output()
        .expect("trace-cmd dump");
    let dump = String::from_utf8_lossy(&o.stdout);
    let ids: Vec<u32> = dump
        .lines()
        .filter_map(|l| l.strip_prefix("ID: "))
        .map(|n| n.trim().parse().expect("an id"))
        .collect();
    assert!(ids.len() > 1, "{dump}");
    assert!(ids.iter().all(|&id| id < 0x8000), "{ids:?}");
}

/// `collect --host-trace` with an event no kernel has: exit 2, one line naming it,
/// no instance left, nothing written.
#[test]
fn collect_host_trace_refuses_an_unknown_event() {
    let test = "collect_host_trace_refuses_an_unknown_event";
    if !env::tracefs_available(KRATE, test) {
        return;
    }
    let dir = TempDir::new("collecthostev");
    let dat = dir.file("x.dat");
    let args = [
        "collect",
        "--host-trace",
        "nosuch:event",
        "-o",
        &dat,
        "a=/nonexistent.sock",
    ];
    let mut col = Kid::spawn(&dir, "collect", &args);
    let pid = col.0.id();
    let code = col.wait("collect");
    let err = read(&dir, "collect.err");
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("no host kernel event matches 'nosuch:event'"),
        "{err}"
    );
    assert_eq!(env::tracefs_instance(pid), None);
    assert!(!std::path::Path::new(&dat).exists());
}

/// A host part that does not fit the VMs' (they run with 8 KiB pages, the kernel's are
/// 4 KiB): the host is named, left out, the VMs' parts are written complete, exit 1;
/// the instance is gone.
#[test]
fn collect_names_a_host_part_that_does_not_fit() {
    let test = "collect_names_a_host_part_that_does_not_fit";
    if !kvm_available(KRATE, test) || !env::tracefs_available(KRATE, test) {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collecthostpage");
    let mut a = start_vm_with(&dir, "a", 2_000, &["--page-size", "8192"]);
    let sa = sock(&dir, "a");
    let dat = dir.file("all.dat");
    let args = [
        "collect",
        "--follow",
        "--host-trace",
        "sched",
        "-o",
        &dat,
        &sa,
    ];
    let mut col = Kid::spawn(&dir, "collect", &args);
    let pid = col.0.id();
    let code = col.wait("collect");
    let err = read(&dir, "collect.err");
    assert_eq!(a.wait("a"), Some(0), "{}", read(&dir, "a.err"));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("a: cpu 0: 2000 events read, 0 lost"), "{err}");
    assert!(
        err.contains("1 of 1 VMs complete, the host's events INCOMPLETE"),
        "{err}"
    );
    assert!(
        err.contains("host: error: left out of the trace: "),
        "{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.contains("collect: host: ") && l.ends_with(": INCOMPLETE")),
        "{err}"
    );
    assert_eq!(env::tracefs_instance(pid), None);
    if env::trace_cmd_available() {
        check_vm(&report(&dat), "a", 2_000);
    }
}

/// [`collect_with_host`] into Perfetto: valid against Perfetto's protos, a process per
/// VM and one named `host`; the host's sched_switch events are ftrace events of the CPUs
/// after the VMs' (2, 3...), exactly as many as collect counted, in the VMs' time range.
#[test]
fn collect_host_trace_into_perfetto() {
    let test = "collect_host_trace_into_perfetto";
    if !kvm_available(KRATE, test) || !env::tracefs_available(KRATE, test) {
        return;
    }
    let _l = vm_lock();
    let dir = TempDir::new("collecthostpf");
    let (out, host_events) = collect_with_host(&dir, "all.pftrace");
    if !env::perfetto_available() {
        return;
    }
    let v: serde_json::Value =
        serde_json::from_slice(&env::perfetto_decode(&out, true)).expect("decoder JSON");
    let mut names: Vec<&str> = v["processes"]
        .as_object()
        .expect("processes")
        .values()
        .filter_map(|p| p["name"].as_str())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["a", "b", "host"], "{}", v["processes"]);
    // The host's CPUs are named tracks `host cpuN`, not vCPU threads.
    let mut host_tracks: Vec<&str> = v["tracks"]
        .as_object()
        .expect("tracks")
        .values()
        .filter_map(|t| t["name"].as_str())
        .collect();
    host_tracks.sort_unstable();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let want: Vec<String> = (0..cpus).map(|k| format!("host cpu{k}")).collect();
    assert_eq!(host_tracks, want, "{}", v["tracks"]);
    let threads = v["threads"].as_object().expect("threads");
    assert_eq!(threads.len(), 2, "one vCPU thread per VM: {}", v["threads"]);
    let ftrace = v["ftrace"].as_array().expect("ftrace");
    assert_eq!(ftrace.len() as u64, host_events);
    assert!(ftrace
        .iter()
        .all(|e| e[0].as_u64().is_some_and(|c| c >= 2) && e[3] == "sched_switch"));
    let ts = |e: &serde_json::Value| e[1].as_u64().expect("ts");
    let vm: Vec<u64> = v["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e[3] == "marker")
        .map(ts)
        .collect();
    assert_eq!(vm.len(), 25_000);
    let (vm_min, vm_max) = (vm.iter().min().expect("VM"), vm.iter().max().expect("VM"));
    let h_min = ftrace.iter().map(ts).min().expect("host");
    let h_max = ftrace.iter().map(ts).max().expect("host");
    assert!(
        h_min < *vm_max && *vm_min < h_max,
        "host {h_min}..{h_max} does not overlap the VMs' {vm_min}..{vm_max}"
    );
}
