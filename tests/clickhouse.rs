//! `-o clickhouse://...` against a real server (tests/support/clickhouse: Debian's
//! clickhouse-server 18.16, data in a temporary directory): exact accounting, no
//! duplicate row, a server killed and restarted in the middle of a run, the queries of
//! docs/fleet.md, bad URLs and an absent server.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hyptrace::clickhouse::{clickhouse_available, ClickHouse};
use hyptrace::env::{self, assert_usage_error, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// `/dev/kvm` and clickhouse-server are there (else SKIP): the VM lock of this binary.
fn ready(test: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    (kvm_available(KRATE, test) && clickhouse_available()).then(vm_lock)
}

/// Per CPU: (written, read, lost) from a `--stats` file.
fn stats_per_cpu(path: &str) -> BTreeMap<u64, (u64, u64, u64)> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("stats")).expect("JSON");
    v["cpus"]
        .as_array()
        .expect("cpus")
        .iter()
        .map(|c| {
            let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("{k} in {c}"));
            (n("cpu"), (n("written"), n("read"), n("lost")))
        })
        .collect()
}

/// `cpu\tcount` lines of a query as a map.
fn per_cpu(answer: &str) -> BTreeMap<u64, u64> {
    answer
        .lines()
        .map(|l| {
            let (c, n) = l.split_once('\t').unwrap_or_else(|| panic!("line {l:?}"));
            (c.parse().expect("cpu"), n.parse().expect("count"))
        })
        .collect()
}

/// No (run, cpu, ts) twice in `db.events` (every event of a CPU has its own time).
fn assert_no_duplicates(ch: &ClickHouse, db: &str) {
    let d = ch.query(&format!(
        "SELECT count() - uniqExact(run, cpu, ts) FROM {db}.events"
    ));
    assert_eq!(d.trim(), "0", "duplicate rows in {db}.events");
}

#[test]
fn record_rows_equal_read_per_cpu() {
    let Some(_g) = ready("record_rows_equal_read_per_cpu") else {
        return;
    };
    let ch = ClickHouse::start();
    let dir = TempDir::new("ch-record");
    let stats = dir.file("s.json");
    let url = ch.url("db");
    let o = env::run(
        BIN,
        &[
            "record", "-o", &url, "--vcpus", "2", "--events", "100000", "--stats", &stats,
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let st = stats_per_cpu(&stats);
    let rows = per_cpu(&ch.query("SELECT cpu, count() FROM db.events GROUP BY cpu ORDER BY cpu"));
    let read: BTreeMap<u64, u64> = st.iter().map(|(&c, &(_, r, _))| (c, r)).collect();
    assert_eq!(rows, read, "rows per CPU against the run's read");
    assert_eq!(
        read.values().sum::<u64>() + st.values().map(|s| s.2).sum::<u64>(),
        200_000
    );
    assert_no_duplicates(&ch, "db");
    // Every row names the run's host, a VM, a run; wall time near now.
    let who = ch.query("SELECT uniqExact(run), min(length(host)), min(length(vm)), min(time_unix_ns) FROM db.events");
    let f: Vec<&str> = who.trim().split('\t').collect();
    assert_eq!(f[0], "1", "{who}");
    assert!(f[1] != "0" && f[2] != "0", "{who}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let t: u64 = f[3].parse().unwrap();
    assert!(now - t < 600_000_000_000, "time_unix_ns {t}, now {now}");
}

/// The record's stderr so far.
fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Stop mode, `events` per vCPU at `rate`, the server killed (SIGKILL: a crash, not a
/// pause) once rows are in and started again on the same data and port once the sink
/// has met the dead server and `down` has passed: every event is a row or a counted
/// loss, no row twice. Returns the run's losses.
fn kill_and_restart(test: &str, events: &str, rate: &str, down: Duration) -> u64 {
    let mut ch = ClickHouse::start();
    let dir = TempDir::new(test);
    let (stats, err) = (dir.file("s.json"), dir.file("stderr"));
    let url = ch.url("db");
    let mut child = Command::new(BIN)
        .args(["record", "-o", &url, "--vcpus", "2", "--events", events])
        .args(["--rate", rate, "--mode", "stop", "--stats", &stats])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("record");
    // (The table exists once the record has created it.)
    let rows_in = |ch: &ClickHouse| match ch.try_query("SELECT count() FROM db.events") {
        Some((200, n)) => n.trim() != "0",
        _ => false,
    };
    env::wait_until(
        &mut child,
        "the first rows",
        Duration::from_secs(60),
        || rows_in(&ch),
        || read(&err),
    );
    ch.kill();
    let killed = Instant::now();
    env::wait_until(
        &mut child,
        "a failed insert, and the outage's length",
        Duration::from_secs(60),
        || read(&err).contains("checking and retrying") && killed.elapsed() >= down,
        || read(&err),
    );
    let down = killed.elapsed();
    ch.restart();
    let st = env::wait_exit(&mut child, "record", Duration::from_secs(180));
    let text = read(&err);
    println!("server down {down:?}; the run said:\n{text}");
    assert_eq!(st.code(), Some(0), "{text}");
    assert!(
        text.contains("stored"),
        "no batch stored after the restart: {text}"
    );
    let s = stats_per_cpu(&stats);
    let rows = per_cpu(&ch.query("SELECT cpu, count() FROM db.events GROUP BY cpu ORDER BY cpu"));
    for (&cpu, &(written, read_n, lost)) in &s {
        let r = rows.get(&cpu).copied().unwrap_or(0);
        assert_eq!(r, read_n, "cpu {cpu}: rows against read");
        assert_eq!(r + lost, written, "cpu {cpu}: rows + lost against written");
    }
    let lost: u64 = s.values().map(|v| v.2).sum();
    let in_table: u64 = ch
        .query("SELECT sum(lost) FROM db.losses")
        .trim()
        .parse()
        .unwrap();
    assert_eq!(in_table, lost, "losses table against the run's losses");
    assert_no_duplicates(&ch, "db");
    lost
}

/// A 2 s outage in a run of a few seconds: the threaded sink's queue holds what comes
/// meanwhile; every event is a row or a counted loss.
#[test]
fn server_killed_and_restarted_mid_run() {
    let Some(_g) = ready("server_killed_and_restarted_mid_run") else {
        return;
    };
    kill_and_restart("ch-kill", "100000", "15000", Duration::from_secs(2));
}

/// An outage longer than the queue and the rings hold (8 s at 2 × 5.6 MB/s of events,
/// 32 MiB of queue, 2 × 4 MiB of rings): the reader waits, stop mode drops — counted,
/// in the losses table — and the rest is stored exactly once.
#[test]
fn a_long_outage_back_pressures_into_counted_drops() {
    let Some(_g) = ready("a_long_outage_back_pressures_into_counted_drops") else {
        return;
    };
    let lost = kill_and_restart("ch-long", "1000000", "200000", Duration::from_secs(8));
    assert!(lost > 0, "an 8 s outage lost nothing: no back-pressure");
}

/// The SQL blocks of docs/fleet.md, database `fleet`.
fn doc_queries() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/fleet.md"))
        .expect("docs/fleet.md");
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for l in doc.lines() {
        match (&mut cur, l.trim()) {
            (None, "```sql") => cur = Some(String::new()),
            (Some(q), "```") => {
                out.push(std::mem::take(q));
                cur = None;
            }
            (Some(q), _) => {
                q.push_str(l);
                q.push('\n');
            }
            _ => {}
        }
    }
    out
}

/// Two VMs (mixed workloads: spans, texts) into one database; every query of
/// docs/fleet.md answers rows.
#[test]
fn fleet_doc_queries_answer() {
    let Some(_g) = ready("fleet_doc_queries_answer") else {
        return;
    };
    let ch = ClickHouse::start();
    // db1 keeps only its first ring-full (stop mode, never drained live): losses.
    let lossy = ["--buffer-kb", "64", "--drain", "none", "--mode", "stop"];
    for (vm, extra) in [("web1", &[][..]), ("db1", &lossy[..])] {
        let url = format!("{}?vm={vm}", ch.url("fleet"));
        let o = Command::new(BIN)
            .args(["record", "-o", &url, "--vcpus", "2", "--events", "20000"])
            .args(["--workload", "mixed"])
            .args(extra)
            .output()
            .expect("record");
        assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    }
    let queries = doc_queries();
    assert!(
        queries.len() >= 5,
        "{} SQL blocks in docs/fleet.md",
        queries.len()
    );
    for q in &queries {
        let a = ch.query(q);
        assert!(!a.trim().is_empty(), "no rows from\n{q}");
    }
    let vms = ch.query("SELECT vm, count() FROM fleet.events GROUP BY vm ORDER BY vm");
    assert!(
        vms.starts_with("db1\t") && vms.contains("\nweb1\t"),
        "{vms}"
    );
}

/// `convert` of a trace.dat: one row per event of the file.
#[test]
fn convert_trace_dat_into_rows() {
    let Some(_g) = ready("convert_trace_dat_into_rows") else {
        return;
    };
    let ch = ClickHouse::start();
    let dir = TempDir::new("ch-convert");
    let (dat, stats) = (dir.file("t.dat"), dir.file("s.json"));
    let o = env::run(
        BIN,
        &[
            "record",
            "-o",
            &dat,
            "--vcpus",
            "2",
            "--events",
            "20000",
            "--workload",
            "mixed",
            "--stats",
            &stats,
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let o = env::run(BIN, &["convert", "-i", &dat, "-o", &ch.url("conv")]);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let rows = per_cpu(&ch.query("SELECT cpu, count() FROM conv.events GROUP BY cpu ORDER BY cpu"));
    let read: BTreeMap<u64, u64> = stats_per_cpu(&stats)
        .iter()
        .map(|(&c, &(_, r, _))| (c, r))
        .collect();
    assert_eq!(rows, read);
    assert_eq!(ch.query("SELECT DISTINCT vm FROM conv.events").trim(), "t");
    // Texts keep their bytes; spans carry dur_ns.
    let spans =
        ch.query("SELECT count() FROM conv.events WHERE name = 'span' AND has(int_keys, 'dur_ns')");
    assert_ne!(spans.trim(), "0");
    assert_no_duplicates(&ch, "conv");
}

#[test]
fn bad_urls_exit_2_and_an_absent_server_exits_1() {
    for (url, needle) in [
        ("clickhouse://", "no /DATABASE"),
        ("clickhouse://:8123/db", "no host"),
        ("clickhouse://127.0.0.1:99999/db", "port"),
        ("clickhouse://127.0.0.1:8123/no-dashes", "database name"),
        ("clickhouse://127.0.0.1:8123/db?vm=a'b", "vm=NAME"),
    ] {
        for cmd in [
            &["record", "-o", url][..],
            &["convert", "-i", "x.dat", "-o", url],
        ] {
            let o = env::run(BIN, cmd);
            assert_usage_error(&o, url, needle);
        }
    }
    // A port nothing listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("clickhouse://127.0.0.1:{port}/db");
    let o = env::run(BIN, &["record", "-o", &url]);
    let err = env::stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("127.0.0.1:{port} is unreachable")),
        "{err}"
    );
}

/// A VMM of `events` markers waiting for a subscriber (`env::subscribed_vm_args`), once
/// its control socket is there; the socket.
fn subscribed_vm(dir: &TempDir, name: &str, events: u64) -> (std::process::Child, String) {
    use std::os::unix::fs::FileTypeExt;
    let (args, sock) = env::subscribed_vm_args(dir, name, events);
    let mut vm = Command::new(BIN)
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("run");
    let is_socket = || std::fs::symlink_metadata(&sock).is_ok_and(|m| m.file_type().is_socket());
    env::wait_until(
        &mut vm,
        "the socket",
        Duration::from_secs(60),
        is_socket,
        String::new,
    );
    (vm, sock)
}

/// `collect --follow -o clickhouse://...` of two VMMs: each VM's events are rows named
/// by its VM, all of them.
#[test]
fn collect_two_vms_into_rows() {
    let Some(_g) = ready("collect_two_vms_into_rows") else {
        return;
    };
    let ch = ClickHouse::start();
    let dir = TempDir::new("ch-collect");
    let mut vms = Vec::new();
    for (name, events) in [("web", 3000), ("db", 4000)] {
        let (vm, sock) = subscribed_vm(&dir, name, events);
        vms.push((vm, format!("{name}={sock}")));
    }
    let mut args = vec![
        "collect".to_string(),
        "--follow".into(),
        "-o".into(),
        ch.url("coll"),
    ];
    args.extend(vms.iter().map(|(_, a)| a.clone()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = env::run(BIN, &args);
    for (mut vm, _) in vms {
        env::wait_exit(&mut vm, "run", Duration::from_secs(60));
    }
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    let per_vm =
        ch.query("SELECT vm, count(), uniqExact(run) FROM coll.events GROUP BY vm ORDER BY vm");
    assert_eq!(per_vm, "db\t4000\t1\nweb\t3000\t1\n");
    assert_no_duplicates(&ch, "coll");
}

/// `collect --follow -o clickhouse://...` streams: a VM's rows are on the server while
/// that VM still runs (60 000 events at 5 000/s: at least 12 s), and at the end all of
/// them are, once.
#[test]
fn collect_streams_rows_while_the_vm_runs() {
    let Some(_g) = ready("collect_streams_rows_while_the_vm_runs") else {
        return;
    };
    let ch = ClickHouse::start();
    let dir = TempDir::new("ch-collect-stream");
    let (mut vm, sock) = subscribed_vm(&dir, "long", 60_000);
    let url = ch.url("stream");
    let target = format!("long={sock}");
    let mut coll = Command::new(BIN)
        .args(["collect", "--follow", "-o", &url, &target])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("collect");
    let rows = || {
        ch.try_query("SELECT count() FROM stream.events WHERE vm = 'long'")
            .is_some_and(|(code, n)| code == 200 && n.trim().parse::<u64>().is_ok_and(|n| n > 0))
    };
    env::wait_until(
        &mut vm,
        "rows while the VM runs",
        Duration::from_secs(60),
        rows,
        String::new,
    );
    env::wait_exit(&mut vm, "run", Duration::from_secs(120));
    let st = env::wait_exit(&mut coll, "collect", Duration::from_secs(120));
    let mut err = String::new();
    std::io::Read::read_to_string(&mut coll.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(st.code(), Some(0), "{err}");
    let n = ch.query("SELECT count(), uniqExact(run) FROM stream.events WHERE vm = 'long'");
    assert_eq!(n, "60000\t1\n", "{err}");
    assert_no_duplicates(&ch, "stream");
}
