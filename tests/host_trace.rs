//! `--host-trace`: the host kernel's own events (tracefs, `x86-tsc` clock) on the
//! guest's timeline (skipped without /dev/kvm unless HYPTRACE_REQUIRE_KVM=1, without a
//! writable tracefs unless HYPTRACE_REQUIRE_TRACEFS=1; the trace-cmd and Perfetto parts
//! as the other tests). Order, coverage and cleanup, never durations.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");
const TRACEFS: &str = env::TRACEFS;
const VCPUS: u32 = 2;
/// A short run with `--host-trace` (what the input-error tests refuse).
const RUN_HOST_TRACE: [&str; 5] = [
    "run",
    "--host-trace",
    "sched:sched_switch",
    "--events",
    "10",
];
/// A gap in a vCPU's guest events longer than this must be its thread switched out.
const GAP_NS: u128 = 1_000_000;

/// Whether tracefs instances can be made here ([`env::tracefs_available`]).
fn tracefs_available(test: &str) -> bool {
    env::tracefs_available(KRATE, test)
}

/// The tracefs instance process `pid` made ([`env::tracefs_instance`]).
fn instance(pid: u32) -> Option<std::path::PathBuf> {
    env::tracefs_instance(pid)
}

/// A CPU hog pinned to CPU `cpu`, killed when dropped.
struct Hog(Child);

impl Hog {
    fn pinned(cpu: u32) -> Self {
        let c = Command::new("taskset")
            .args(["-c", &cpu.to_string(), "sh", "-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .expect("taskset sh");
        Self(c)
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One line of `trace-cmd report -t`: CPU, ns, event name, what follows the name.
#[derive(Debug)]
struct Line {
    cpu: u32,
    ts: u128,
    name: String,
    rest: String,
}

/// Parses `COMM-PID [CPU] SEC.NSEC: NAME: REST` (the comm may hold anything but the
/// `[NNN] ` column).
fn parse(line: &str) -> Option<Line> {
    let b = line.as_bytes();
    let at = (0..b.len().saturating_sub(5)).find(|&i| {
        b[i] == b'[' && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) && b[i + 4] == b']'
    })?;
    let cpu = line[at + 1..at + 4].parse().ok()?;
    let after = line[at + 5..].trim_start();
    let (ts, after) = after.split_once(": ")?;
    let (sec, frac) = ts.split_once('.')?;
    if frac.len() != 9 {
        return None;
    }
    let ts = sec.parse::<u128>().ok()? * 1_000_000_000 + frac.parse::<u128>().ok()?;
    let (name, rest) = after.split_once(':')?;
    Some(Line {
        cpu,
        ts,
        name: name.trim().to_string(),
        rest: rest.trim().to_string(),
    })
}

/// The pids of a sched_switch as trace-cmd's plugin prints it:
/// `prev_comm:prev_pid [prio] S ==> next_comm:next_pid [prio]`.
fn switch_pids(rest: &str) -> Option<(i64, i64)> {
    let (prev, next) = rest.split_once(" ==> ")?;
    let pid = |side: &str| -> Option<i64> {
        let (commpid, _) = side.rsplit_once(" [")?;
        commpid.rsplit_once(':')?.1.parse().ok()
    };
    Some((pid(prev)?, pid(next)?))
}

/// The pids the kernel switched to but never reported switching away from: this
/// host's kernel emits no sched_switch at all whose `prev` is certain tasks (seen:
/// a `tokio-rt-worker` at nice -10, switched to 75 times and from 0 times in one run,
/// without `--host-trace-all`'s pid filter too, no loss counted), so a thread switched
/// back in after one of them shows no switch-in.
fn never_left(lines: &[Line]) -> std::collections::BTreeSet<i64> {
    let mut to = std::collections::BTreeSet::new();
    let mut from = std::collections::BTreeSet::new();
    for l in lines.iter().filter(|l| l.name == "sched_switch") {
        if let Some((prev, next)) = switch_pids(&l.rest) {
            from.insert(prev);
            to.insert(next);
        }
    }
    to.difference(&from).copied().collect()
}

/// Steal time of host CPU `cpu` so far, in USER_HZ ticks: what the hypervisor below
/// this machine (itself a VM) took from it — the 8th value of /proc/stat's `cpuN` line.
/// A vCPU thread held off so shows no sched_switch. `None` if unreadable.
fn steal_ticks(cpu: u32) -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let label = format!("cpu{cpu}");
    let line = stat
        .lines()
        .find(|l| l.split_whitespace().next() == Some(label.as_str()))?;
    line.split_whitespace().nth(8)?.parse().ok()
}

/// The most time the hypervisor below can have taken from host CPU `cpu` between two
/// [`steal_ticks`] readings, in ns: their difference, plus one tick as each reading is
/// rounded down — or 0 if the machine accounts no steal time at all (none since boot).
fn steal_bound_ns(before: Option<u64>, after: Option<u64>) -> u128 {
    // SAFETY: sysconf reads a constant of the C library; no pointer is involved.
    let hz = u128::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100);
    match (before, after) {
        (Some(b), Some(a)) if a > 0 => u128::from(a.saturating_sub(b) + 1) * 1_000_000_000 / hz,
        _ => 0,
    }
}

/// What [`check_gaps`] found for one vCPU.
#[derive(Debug, Default)]
struct Gaps {
    /// Gaps over [`GAP_NS`].
    gaps: usize,
    /// The thread's switches out.
    outs: usize,
    /// Gaps whose switch back in the kernel did not report.
    unseen: usize,
    /// Gaps with no switch at all and nothing else on the CPU: held off by the
    /// hypervisor below (their number, their total ns).
    stolen: usize,
    stolen_ns: u128,
}

/// Every gap over [`GAP_NS`] between two guest events of vCPU `v` holds a switch out
/// of its thread `tid` and a switch back in after it — unless the kernel did not report
/// the switch in: the run counted no loss (`lossy` false), the trace has tasks never
/// reported leaving ([`never_left`]), and the thread's next switch after its switch out
/// is another switch out (the host stream itself shows it was back in) — or unless the
/// hypervisor below held the host CPU: no switch of the thread in the gap and no event
/// of another vCPU either (every vCPU thread shares the one host CPU, so another vCPU
/// ran only if this thread was switched out: a missed switch fails), and all such gaps
/// together no longer than `stolen_ns`, the steal time the CPU gained during the run.
fn check_gaps(lines: &[Line], v: u32, tid: i64, lossy: bool, stolen_ns: u128) -> Gaps {
    let guest: Vec<u128> = lines
        .iter()
        .filter(|l| l.cpu == v && l.name == "marker")
        .map(|l| l.ts)
        .collect();
    assert!(!guest.is_empty(), "vCPU {v}: no guest events");
    let silent = never_left(lines);
    // (time, next pid) of the thread's switches out; times of its switches in.
    let mut outs = Vec::new();
    let mut ins = Vec::new();
    for l in lines.iter().filter(|l| l.name == "sched_switch") {
        let (prev, next) =
            switch_pids(&l.rest).unwrap_or_else(|| panic!("sched_switch fields: {l:?}"));
        if prev == tid {
            outs.push((l.ts, next));
        }
        if next == tid {
            ins.push(l.ts);
        }
    }
    let mut r = Gaps {
        outs: outs.len(),
        ..Gaps::default()
    };
    for w in guest.windows(2) {
        let (a, b) = (w[0], w[1]);
        if b - a <= GAP_NS {
            continue;
        }
        r.gaps += 1;
        let out = outs.iter().find(|&&(t, _)| a <= t && t <= b);
        let back = out.and_then(|&(o, _)| ins.iter().find(|&&t| o <= t && t <= b));
        // The thread's next switch after its switch out in the gap is another switch
        // out: it was switched back in unseen — by a task the kernel never reports
        // leaving (there are such here), with no loss counted.
        let unreported = back.is_none()
            && !lossy
            && !silent.is_empty()
            && out.is_some_and(|&(o, _)| {
                let next_out = outs.iter().map(|&(t, _)| t).find(|&t| t > o);
                let next_in = ins.iter().copied().find(|&t| t > o);
                next_out.is_some_and(|no| next_in.is_none_or(|i| no < i))
            });
        // Nothing ran on the CPU in the gap as far as the trace shows: the hypervisor
        // below held it (checked against the steal time after the loop).
        let stolen = out.is_none()
            && !lines
                .iter()
                .any(|l| l.cpu != v && l.name == "marker" && a < l.ts && l.ts < b);
        let near: Vec<&Line> = lines
            .iter()
            .filter(|l| l.name == "sched_switch" && a <= l.ts + GAP_NS && l.ts <= b + GAP_NS)
            .collect();
        assert!(
            back.is_some() || unreported || stolen,
            "vCPU {v} (tid {tid}): guest gap {a}..{b} ({} µs) without its thread switched out and back in (out {out:?}), nor switched in unseen (lossy {lossy}, tasks never reported leaving {silent:?}), nor held by the hypervisor (another vCPU ran in it); host switches around it: {near:#?}",
            (b - a) / 1000
        );
        r.unseen += usize::from(unreported);
        if stolen {
            r.stolen += 1;
            r.stolen_ns += b - a;
        }
    }
    assert!(
        r.stolen_ns <= stolen_ns,
        "vCPU {v} (tid {tid}): {} guest gaps ({} µs in all) without a switch of its thread, more than the steal time its host CPU gained during the run ({} µs): {r:?}",
        r.stolen,
        r.stolen_ns / 1000,
        stolen_ns / 1000
    );
    r
}

/// `record --host-trace sched:sched_switch` next to a CPU hog on the vCPU threads'
/// CPU: trace-cmd prints guest events and the vCPU threads' switches, with their
/// fields, in one time order; every gap over 1 ms in a vCPU's events is its thread
/// switched out and back in ([`check_gaps`]), or, where this machine is itself a VM,
/// time the hypervisor below held the host CPU: such a gap shows no switch (steal
/// time), so a gap with no switch passes only if no other vCPU ran in it and all such
/// gaps together fit in the steal time /proc/stat counted for that CPU during the run
/// (a machine that counts no steal time passes none) — a switch the host trace missed, or guest and host
/// clocks apart, still fails; the Perfetto conversion of the same file decodes with
/// the official schema and puts each vCPU's events and its thread's switches on one
/// thread.
#[test]
fn trace_dat_shows_vcpu_preemption() {
    if !kvm_available(KRATE, "trace_dat_shows_vcpu_preemption")
        || !tracefs_available("trace_dat_shows_vcpu_preemption")
        || !env::trace_cmd_available()
    {
        return;
    }
    let _vm = vm_lock();
    vcpu_preemption_recorded(&[], "host-trace");
}

/// H1 in a pid namespace: with a /proc of its own (`unshare --pid --mount-proc`) the
/// vCPU threads' kernel ids are unknown, and `--host-trace` is refused (exit 2, one line
/// naming why, no output, no instance) — a filter of namespace ids named nobody, and
/// the run exited 0 with no host event; with the host's /proc (`unshare --pid`) the
/// filter takes /proc's ids, the kernel's, and the run records the vCPU threads'
/// scheduling as outside (the checks of `trace_dat_shows_vcpu_preemption`).
#[test]
fn a_run_in_a_pid_namespace_filters_by_kernel_ids() {
    if !kvm_available(KRATE, "a_run_in_a_pid_namespace_filters_by_kernel_ids")
        || !tracefs_available("a_run_in_a_pid_namespace_filters_by_kernel_ids")
        || !env::trace_cmd_available()
        || !unshare_available("a_run_in_a_pid_namespace_filters_by_kernel_ids")
    {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("host-trace-ns-own-proc");
    let dat = dir.file("x.dat");
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", BIN, "record"])
        .args(["--host-trace", "sched:sched_switch", "-o", &dat])
        .args(["--events", "1000"])
        .output()
        .expect("unshare");
    env::assert_usage_error(&out, "own /proc", "pid namespace");
    assert!(!Path::new(&dat).exists(), "no output");
    assert_eq!(instance(1), None, "no instance left");
    vcpu_preemption_recorded(&["unshare", "--pid", "--fork"], "host-trace-ns");
}

/// Whether `unshare --pid --fork` works here (else the test is skipped).
fn unshare_available(test: &str) -> bool {
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("{KRATE}::{test}: skipped: unshare --pid does not work here");
    }
    ok
}

/// Records `--host-trace sched:sched_switch` with two vCPUs pinned next to a CPU hog
/// (through `wrap`, a command that runs hyptrace, e.g. `unshare`) and checks what
/// `trace_dat_shows_vcpu_preemption` says.
fn vcpu_preemption_recorded(wrap: &[&str], tag: &str) {
    let dir = TempDir::new(tag);
    let dat = dir.file("x.dat");
    let stats = dir.file("stats.json");
    // Everything on CPU 0: the hog, both vCPU threads, the reader. The vCPU threads
    // are switched out (the hog never sleeps), so sched_switch events are certain.
    let _hog = Hog::pinned(0);
    let steal_before = steal_ticks(0);
    let child = Command::new("taskset")
        .args(["-c", "0"])
        .args(wrap)
        .args([BIN, "record", "--host-trace", "sched:sched_switch"])
        .args(["-o", &dat, "--stats", &stats, "--vcpus", "2"])
        .args(["--events", "200000", "--rate", "100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("taskset hyptrace");
    // taskset execs hyptrace: same pid; `unshare --fork` makes it pid 1 of its
    // namespace (its instance is named so).
    let pid = if wrap.is_empty() { child.id() } else { 1 };
    let out = child.wait_with_output().expect("wait");
    let stolen_ns = steal_bound_ns(steal_before, steal_ticks(0));
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    assert_eq!(instance(pid), None, "instance left after a normal exit");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("json");
    let h = &s["host_trace"];
    let tids: Vec<i64> = h["vcpu_threads"]
        .as_array()
        .expect("vcpu_threads")
        .iter()
        .map(|t| t.as_i64().expect("tid"))
        .collect();
    assert_eq!(tids.len(), VCPUS as usize, "{s}");
    assert!(h["events"].as_u64() > Some(0), "{s}");

    let tc = env::run("trace-cmd", &["report", "-t", "-i", &dat]);
    assert!(tc.status.success(), "{}", env::stderr(&tc));
    let text = env::stdout(&tc);
    assert!(
        !text.contains("[UNKNOWN EVENT]"),
        "trace-cmd: unknown events"
    );
    let lines: Vec<Line> = text.lines().filter_map(parse).collect();
    for w in lines.windows(2) {
        assert!(w[0].ts <= w[1].ts, "time goes back: {w:?}");
    }
    for (v, &tid) in (0..VCPUS).zip(&tids) {
        eprintln!("host trace stats: {h}");
        let lossy = ["lost", "lost_pages_unknown", "overrun", "dropped"]
            .iter()
            .any(|k| h[k].as_u64() != Some(0));
        let g = check_gaps(&lines, v, tid, lossy, stolen_ns);
        assert!(
            g.outs > 0,
            "vCPU {v}: its thread {tid} was never switched out"
        );
        eprintln!(
            "vCPU {v}: {} gaps over 1 ms, {} switches out, all covered ({} switched back in unseen, {} held by the hypervisor: {} µs of at most {} µs of steal)",
            g.gaps,
            g.outs,
            g.unseen,
            g.stolen,
            g.stolen_ns / 1000,
            stolen_ns / 1000
        );
    }
    check_perfetto(&dir, &dat, &tids, &lines);
}

/// The Perfetto conversion of `dat`: the official schema decodes it; each vCPU's track
/// is its host thread (tid), and that tid's switches are in the ftrace bundles as many
/// times as trace-cmd printed them.
fn check_perfetto(dir: &TempDir, dat: &str, tids: &[i64], lines: &[Line]) {
    if !env::perfetto_available() {
        return;
    }
    let pf = dir.file("x.pftrace");
    let out = env::run(BIN, &["convert", "-i", dat, "-o", &pf]);
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let dec = env::run(
        "python3",
        &[
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/crates/output/tests/perfetto_decode.py"
            ),
            &pf,
        ],
    );
    assert!(dec.status.success(), "{}", env::stderr(&dec));
    let d: serde_json::Value = serde_json::from_slice(&dec.stdout).expect("decoder json");
    let switches = |tid: i64, key: &str| {
        d["ftrace"]
            .as_array()
            .expect("ftrace")
            .iter()
            .filter(|e| e[3] == "sched_switch" && e[4][key] == tid)
            .count()
    };
    for (v, &tid) in tids.iter().enumerate() {
        let track = d["threads"]
            .as_object()
            .expect("threads")
            .values()
            .find(|t| t["name"] == format!("vcpu{v}"))
            .unwrap_or_else(|| panic!("no vcpu{v} track: {d}"));
        assert_eq!(track["tid"], tid, "vcpu{v}'s track is its host thread");
        let tc_outs = lines
            .iter()
            .filter(|l| l.name == "sched_switch")
            .filter(|l| switch_pids(&l.rest).is_some_and(|(p, _)| p == tid))
            .count();
        assert_eq!(switches(tid, "prev_pid"), tc_outs, "vcpu{v}: switches out");
    }
}

/// No instance stays: after a normal run, after Ctrl-C, and after SIGKILL once another
/// run has started (it removes an instance whose name proves its maker dead).
#[test]
fn instances_are_removed() {
    if !kvm_available(KRATE, "instances_are_removed") || !tracefs_available("instances_are_removed")
    {
        return;
    }
    let _vm = vm_lock();
    let long = |dir: &TempDir| {
        Command::new(BIN)
            .args(["record", "--host-trace", "sched:sched_switch,irq:*"])
            .args(["-o", &dir.file("l.dat"), "--vcpus", "2"])
            .args(["--events", "1000000000", "--rate", "100000"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("hyptrace")
    };
    let dir = TempDir::new("host-trace-rm");
    for sig in ["-INT", "-KILL"] {
        let mut child = long(&dir);
        let pid = child.id();
        env::wait_until(
            &mut child,
            "the instance",
            Duration::from_secs(60),
            || instance(pid).is_some_and(|d| d.join("trace_clock").exists()),
            String::new,
        );
        let made = instance(pid).expect("the instance");
        env::signal(&child, sig);
        let st = env::wait_exit(&mut child, sig, Duration::from_secs(60));
        if sig == "-INT" {
            assert_eq!(st.code(), Some(0), "Ctrl-C ends a record normally");
            assert!(!made.exists(), "instance left after Ctrl-C");
        } else {
            assert!(made.exists(), "SIGKILL cannot clean up");
            let out = env::run(
                BIN,
                &[
                    "run",
                    "--host-trace",
                    "sched:sched_switch",
                    "--events",
                    "10",
                ],
            );
            assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
            assert!(!made.exists(), "the next run removes a dead run's instance");
        }
    }
    let out = env::run(
        BIN,
        &[
            "run",
            "--host-trace",
            "sched:*",
            "--vcpus",
            "2",
            "--events",
            "100",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let names: Vec<String> = std::fs::read_dir(Path::new(TRACEFS).join("instances"))
        .expect("instances")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .all(|n| !n.starts_with("hyptrace-") || n.starts_with("hyptrace-probe")),
        "instances left: {names:?}"
    );
}

/// tracefs instances made here (as others' would be), with the `buffer_size_kb` each
/// read back; removed when dropped.
struct Planted(Vec<(std::path::PathBuf, String)>);

impl Planted {
    /// Makes instance `name` with its own setting (`buffer_size_kb` 1028).
    fn add(&mut self, name: &str) {
        let d = Path::new(TRACEFS).join("instances").join(name);
        std::fs::create_dir(&d).unwrap_or_else(|e| panic!("mkdir {}: {e}", d.display()));
        let kb = d.join("buffer_size_kb");
        std::fs::write(&kb, "1028").expect("buffer_size_kb");
        let set = std::fs::read_to_string(&kb).expect("buffer_size_kb");
        self.0.push((d, set));
    }

    /// Instance `name` is there with its setting.
    fn untouched(&self, name: &str) -> bool {
        self.0.iter().any(|(d, set)| {
            d.ends_with(name)
                && std::fs::read_to_string(d.join("buffer_size_kb")).is_ok_and(|v| v == *set)
        })
    }
}

impl Drop for Planted {
    fn drop(&mut self) {
        for (d, _) in &self.0 {
            let _ = std::fs::remove_dir(d);
        }
    }
}

/// H1: instances a run did not make are left alone, settings and all: older names
/// (`hyptrace-1`, `hyptrace-2`: of a VMM in a pid namespace, where a run is pid 1 —
/// a name of only the pid, which a run in another namespace took for its own:
/// removed, recreated and removed), another namespace's, a live process's. A name that
/// proves its maker dead (this namespace, that pid gone) is removed by the next run
/// here, not by a run in another namespace (which cannot prove it).
#[test]
fn instances_of_others_are_left_alone() {
    use hyptrace_host::drain::host_trace::instance::Maker;
    use hyptrace_host::drain::host_trace::procfs::start_time;
    if !kvm_available(KRATE, "instances_of_others_are_left_alone")
        || !tracefs_available("instances_of_others_are_left_alone")
        || !unshare_available("instances_of_others_are_left_alone")
    {
        return;
    }
    let _vm = vm_lock();
    let me = Maker::me().expect("this process");
    let mut sleeper = Command::new("sleep").arg("1000").spawn().expect("sleep");
    let gone = Maker {
        pid: sleeper.id(),
        start: start_time(&sleeper.id().to_string()).expect("start"),
        ..me
    };
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let others = [
        "hyptrace-1".to_string(),
        "hyptrace-2".to_string(),
        Maker {
            ns: me.ns + 1,
            ..gone
        }
        .name(),
        me.name(),
    ];
    let mut planted = Planted(Vec::new());
    for n in others.iter().chain([&gone.name()]) {
        planted.add(n);
    }
    let run = |wrap: &[&str], all: &[&str]| {
        let mut argv = wrap.to_vec();
        argv.push(BIN);
        let out = Command::new(argv[0])
            .args(&argv[1..])
            .args([
                "run",
                "--host-trace",
                "sched:sched_switch",
                "--events",
                "100",
            ])
            .args(all)
            .output()
            .expect("hyptrace");
        assert_eq!(
            out.status.code(),
            Some(0),
            "{wrap:?}: {}",
            env::stderr(&out)
        );
    };
    // A run in a new pid namespace (pid 1 there), its own /proc: no filter (-all).
    run(
        &["unshare", "--pid", "--fork", "--mount-proc"],
        &["--host-trace-all"],
    );
    for n in others.iter().chain([&gone.name()]) {
        assert!(planted.untouched(n), "{n} touched by a run in a namespace");
    }
    // A run here: the dead maker's instance goes, the others stay as they were.
    run(&[], &[]);
    for n in &others {
        assert!(planted.untouched(n), "{n} touched");
    }
    assert!(
        !Path::new(TRACEFS)
            .join("instances")
            .join(gone.name())
            .exists(),
        "the dead maker's instance is removed"
    );
}

/// H1: an instance of the very name a run would make (made by the shell that then
/// execs hyptrace: same pid, same start time, same namespace) is not the run's: the
/// run is refused (exit 2, naming it) and the instance is left as it was — it was
/// removed, recreated and removed when the name was the pid alone.
#[test]
fn an_instance_of_the_runs_name_is_left_alone() {
    if !tracefs_available("an_instance_of_the_runs_name_is_left_alone") {
        return;
    }
    // Field 22 of stat (the start time) is the 20th after the command's ')'.
    let script = format!(
        "set -e; d={TRACEFS}/instances/hyptrace-$(stat -L -c %i /proc/$$/ns/pid)-$$-$(cut -d')' -f2- /proc/$$/stat | awk '{{print $20}}'); \
         mkdir \"$d\"; echo 1028 > \"$d/buffer_size_kb\"; cat \"$d/buffer_size_kb\"; echo \"$d\"; \
         exec \"$0\" run --host-trace sched:sched_switch --events 10"
    );
    let out = Command::new("sh")
        .args(["-c", &script, BIN])
        .output()
        .expect("sh");
    let text = env::stdout(&out);
    let mut lines = text.lines();
    let (set, made) = (lines.next().expect("kb"), lines.next().expect("dir"));
    let made = Path::new(made);
    let kb = std::fs::read_to_string(made.join("buffer_size_kb"));
    let _ = std::fs::remove_dir(made);
    let err = env::stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("exists and this run did not make it: left alone"),
        "{err}"
    );
    assert_eq!(
        kb.ok().as_deref().map(str::trim),
        Some(set),
        "the instance as it was"
    );
}

/// `run --host-trace` prints guest and host lines merged in time order on stdout, and
/// `--stats` counts what it read.
#[test]
fn run_merges_host_events_in_text() {
    if !kvm_available(KRATE, "run_merges_host_events_in_text")
        || !tracefs_available("run_merges_host_events_in_text")
    {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("host-trace-run");
    let stats = dir.file("s.json");
    let out = env::run(
        BIN,
        &[
            "run",
            "--host-trace",
            "sched:sched_switch",
            "--stats",
            &stats,
            "--vcpus",
            "2",
            "--events",
            "20000",
            "--rate",
            "100000",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let lines: Vec<Line> = env::stdout(&out).lines().filter_map(parse).collect();
    for w in lines.windows(2) {
        assert!(w[0].ts <= w[1].ts, "time goes back: {w:?}");
    }
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).expect("stats")).expect("json");
    let host = lines.iter().filter(|l| l.cpu >= VCPUS).count() as u64;
    assert!(host > 0, "no host line");
    assert!(lines
        .iter()
        .filter(|l| l.cpu >= VCPUS)
        .all(|l| l.name == "sched_switch"));
    assert_eq!(s["host_trace"]["events"], host, "{s}");
    assert_eq!(s["host_trace"]["first_cpu"], VCPUS, "{s}");
    assert_eq!(
        lines.iter().filter(|l| l.name == "marker").count(),
        2 * 20000
    );

    // The text sink (`record -o x.txt`): a host CPU with nothing to say does not hold
    // the others' lines (its empty reads reach the sink's merger). Paced: 2 × 100 000
    // events/s fill the merger's window (2^18 items) only if the host-trace thread is
    // held off for over a second — without its empty reads, the 400 000 events of the
    // run would (at full speed a few ms of a hog's time slice would be enough: luck).
    let txt = dir.file("x.txt");
    let out = env::run(
        BIN,
        &[
            "record",
            "--host-trace",
            "sched:sched_switch",
            "-o",
            &txt,
            "--vcpus",
            "2",
            "--events",
            "200000",
            "--rate",
            "100000",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let text = std::fs::read_to_string(&txt).expect("x.txt");
    let held = text
        .lines()
        .filter(|l| l.contains("merge window exceeded"))
        .filter(|l| {
            l.contains(&format!("wait for cpu {VCPUS}"))
                || l.contains(&format!("wait for cpu {}", VCPUS + 1))
        })
        .count();
    assert_eq!(held, 0, "a host CPU held the text sink's lines back");
    assert!(text
        .lines()
        .filter_map(parse)
        .any(|l| l.name == "sched_switch"));
}

/// The time a Chrome JSON entry sorts at, in ns: `ts`, or `ts + dur` for a complete
/// (`X`) event, written when it ends. `ts` and `dur` are µs with 3 decimals.
fn json_sort_ns(e: &serde_json::Value) -> u64 {
    let ns = |v: &serde_json::Value| (v.as_f64().expect("a number") * 1000.0).round() as u64;
    ns(&e["ts"]) + if e["ph"] == "X" { ns(&e["dur"]) } else { 0 }
}

/// `record --host-trace --format json` to stdout: the entries of guest and host CPUs
/// come in time order (`ts` non-decreasing in file order), with both kinds present.
#[test]
fn json_merges_host_events_in_time_order() {
    if !kvm_available(KRATE, "json_merges_host_events_in_time_order")
        || !tracefs_available("json_merges_host_events_in_time_order")
    {
        return;
    }
    let _vm = vm_lock();
    let out = env::run(
        BIN,
        &[
            "record",
            "--host-trace",
            "sched:sched_switch",
            "--format",
            "json",
            "-o",
            "-",
            "--vcpus",
            "2",
            "--events",
            "20000",
            "--rate",
            "100000",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let evs: Vec<&serde_json::Value> = v["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| e["ph"] != "M")
        .collect();
    let host = evs.iter().filter(|e| e["name"] == "sched_switch").count();
    let guest = evs.iter().filter(|e| e["name"] == "marker").count();
    assert!(host > 0, "no host event");
    assert_eq!(guest, 2 * 20000);
    for w in evs.windows(2) {
        assert!(
            json_sort_ns(w[0]) <= json_sort_ns(w[1]),
            "time goes back: {} then {}",
            w[0],
            w[1]
        );
    }
}

/// A user tracefs refuses (not root: the mount is root's, mode 0700) is told so — exit
/// 2, `permission denied on /sys/kernel/tracing... (run as root)` — not that tracefs is
/// not mounted; no VM is needed (tracefs is checked before the VM exists). Runs the
/// binary as `nobody` (setpriv; skipped unless this test runs as root with tracefs
/// mounted).
#[test]
fn tracefs_refused_to_a_user_is_permission_denied() {
    // SAFETY: geteuid reads this process's credentials; it cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root || !Path::new(TRACEFS).join("instances").is_dir() {
        eprintln!("{KRATE}::tracefs_refused_to_a_user_is_permission_denied: skipped: needs root and {TRACEFS} mounted");
        return;
    }
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", BIN])
        .args(RUN_HOST_TRACE)
        .env_remove("HYPTRACE_TRACEFS")
        .output()
        .expect("setpriv");
    env::assert_usage_error(
        &out,
        "--host-trace as nobody",
        "--host-trace: permission denied on /sys/kernel/tracing",
    );
    let err = env::stderr(&out);
    assert!(
        err.contains("(run as root)") && !err.contains("not mounted"),
        "{err}"
    );
}

/// Without tracefs, or with an event the kernel does not have: exit 2, one line naming
/// what is missing (a pattern escaped), no VM started.
#[test]
fn missing_tracefs_or_event_is_an_input_error() {
    let dir = TempDir::new("host-trace-missing");
    let out = Command::new(BIN)
        .args(RUN_HOST_TRACE)
        .env("HYPTRACE_TRACEFS", dir.path())
        .output()
        .expect("hyptrace");
    env::assert_usage_error(&out, "no tracefs", "tracefs is not mounted at");
    if !tracefs_available("missing_tracefs_or_event_is_an_input_error") {
        return;
    }
    let out = env::run(
        BIN,
        &["run", "--host-trace", "nosuch:event", "--events", "10"],
    );
    env::assert_usage_error(
        &out,
        "unknown event",
        "no host kernel event matches 'nosuch:event'",
    );
    // A pattern with control bytes is echoed escaped: it cannot drive the terminal.
    let out = env::run(
        BIN,
        &[
            "run",
            "--host-trace",
            "\x1b]0;title\x07\x1b[2Jx",
            "--events",
            "10",
        ],
    );
    env::assert_usage_error(
        &out,
        "a pattern with an ESC",
        "no host kernel event matches '\\x1b]0;title\\x07\\x1b[2Jx'",
    );
    assert!(
        !out.stderr.iter().any(|&b| b == 0x1b || b == 0x07),
        "a raw control byte: {:?}",
        env::stderr(&out)
    );
}

/// Every event id of a `record --host-trace --host-events` trace.dat is below 0x8000
/// (issue 40: KernelShark keeps event ids in a signed 16-bit field), in the formats as
/// our reader and `trace-cmd dump --events` list them and in the records; the host
/// kernel's events still print by name with their fields.
#[test]
fn host_trace_ids_below_0x8000() {
    if !kvm_available(KRATE, "host_trace_ids_below_0x8000")
        || !tracefs_available("host_trace_ids_below_0x8000")
    {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("host-trace-ids");
    let dat = dir.file("x.dat");
    let run = "record --host-trace sched:sched_switch,sched:sched_wakeup --host-events \
               --workload mixed --vcpus 2 --events 20000 --rate 100000";
    let args: Vec<&str> = run.split_whitespace().chain(["-o", dat.as_str()]).collect();
    let out = env::run(BIN, &args);
    assert_eq!(out.status.code(), Some(0), "{}", env::stderr(&out));
    let f = hyptrace_output::TraceFile::open(&dat).expect("our reader");
    let ids: Vec<(u16, String)> = f
        .formats
        .iter()
        .map(|x| (x.id, format!("{}:{}", x.system, x.name)))
        .collect();
    assert!(
        ids.iter().any(|(_, n)| n == "sched:sched_switch"),
        "{ids:?}"
    );
    assert!(ids.iter().any(|(_, n)| n.starts_with("vmm:")), "{ids:?}");
    assert!(ids.iter().all(|(id, _)| *id < 0x8000), "{ids:?}");
    // Every record's id is a listed one.
    let mut records = f.records();
    let mut n = 0u64;
    while let Some(item) = records.next_item() {
        if let hyptrace_output::TraceItem::Event(r) = item {
            let id = u16::from_le_bytes([r.payload[0], r.payload[1]]);
            assert!(id < 0x8000 && ids.iter().any(|(i, _)| *i == id), "{id}");
            n += 1;
        }
    }
    assert!(n > 0);
    if !env::trace_cmd_available() {
        return;
    }
    let dump = env::run("trace-cmd", &["dump", "--events", "-i", &dat]);
    assert!(dump.status.success(), "{}", env::stderr(&dump));
    let listed: Vec<u32> = env::stdout(&dump)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("ID: "))
        .map(|v| v.trim().parse().expect("ID"))
        .collect();
    assert_eq!(listed.len(), ids.len(), "{}", env::stdout(&dump));
    assert!(listed.iter().all(|&id| id < 0x8000), "{listed:?}");
    let tc = env::run("trace-cmd", &["report", "-i", &dat]);
    assert!(tc.status.success(), "{}", env::stderr(&tc));
    let text = env::stdout(&tc);
    assert!(!text.contains("[UNKNOWN EVENT]"), "unknown events");
    assert!(text.contains("sched_switch:"), "no host sched_switch");
}
