//! `examples/embed.rs`, the minimal VMM built on the library crates: it boots the stock
//! guest on KVM and writes a trace.dat, which the real `trace-cmd report` must read with
//! every guest event and its fields, as many per CPU as the example says it read.
//! Skipped without /dev/kvm or trace-cmd (unless HYPTRACE_REQUIRE_KVM=1 /
//! HYPTRACE_REQUIRE_TRACE_CMD=1). Counts and contents, never durations.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use hyptrace::env::{self, kvm_available, trace_cmd_available, vm_lock, wait_exit, TempDir};
use hyptrace::text::{parse_all, Line};

const KRATE: &str = env!("CARGO_CRATE_NAME");

/// The example binary cargo built next to this test (`cargo test` builds the examples):
/// `target/<profile>/examples/embed`, this test being `target/<profile>/deps/embed-*`.
fn example_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary is in target/<profile>/deps");
    let bin = profile_dir.join("examples").join("embed");
    assert!(
        bin.is_file(),
        "{} is missing: `cargo test` builds it; with a target filter such as `--test embed`, run `cargo build --release --example embed` first",
        bin.display()
    );
    bin
}

/// One CPU of the example's summary line
/// `cpu N: attempted A written W read R lost L (overrun O dropped D)`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Account {
    attempted: u64,
    written: u64,
    read: u64,
    lost: u64,
    overrun: u64,
    dropped: u64,
}

fn parse_account(line: &str) -> Account {
    let num = |key: &str| -> u64 {
        let at = line
            .find(&format!("{key} "))
            .unwrap_or_else(|| panic!("no {key} in {line:?}"));
        let rest = &line[at + key.len() + 1..];
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        rest[..end]
            .parse()
            .unwrap_or_else(|_| panic!("bad {key} in {line:?}"))
    };
    Account {
        attempted: num("attempted"),
        written: num("written"),
        read: num("read"),
        lost: num("lost"),
        overrun: num("overrun"),
        dropped: num("dropped"),
    }
}

/// The fields each registered event of the stock guest prints.
fn fields_of(name: &str) -> &'static [&'static str] {
    match name {
        "marker" => &["seq", "value"],
        "span" => &["seq", "id", "dur"],
        "text" => &["seq", "msg"],
        other => panic!("unexpected event {other:?} in the report"),
    }
}

#[test]
fn embed_example_writes_a_trace_dat_trace_cmd_reads() {
    check_example("embed_example_writes_a_trace_dat_trace_cmd_reads", "port");
}

/// The same with `--mmio`: the stock guest is handed the MMIO doorbell page in its entry
/// `rcx` and the example serves only that page; one registration and one exit per vCPU
/// ring it, and the trace is as complete.
#[test]
fn embed_example_serves_the_mmio_doorbell() {
    check_example("embed_example_serves_the_mmio_doorbell", "mmio");
}

/// Runs the example with `doorbell` (`port`, or `mmio`: `--mmio`) and checks its
/// accounts, its doorbell's rings and what trace-cmd reads of its trace.dat.
fn check_example(name: &str, doorbell: &str) {
    if !kvm_available(KRATE, name) || !trace_cmd_available() {
        return;
    }
    let bin = example_bin();
    let _vm = vm_lock();
    let dir = TempDir::new("embed");
    let out = dir.file("out.dat");
    let mut child = Command::new(&bin)
        .arg(&out)
        .args(if doorbell == "mmio" {
            &["--mmio"][..]
        } else {
            &[]
        })
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    let status = wait_exit(&mut child, "examples/embed", Duration::from_secs(120));
    let o = child.wait_with_output().expect("example output");
    let (stdout, stderr) = (env::stdout(&o), env::stderr(&o));
    assert!(
        status.success(),
        "embed: {status}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );

    // The example's own account: per CPU written = read + lost, the guest's attempts.
    let accounts: Vec<Account> = stdout
        .lines()
        .filter(|l| l.starts_with("cpu "))
        .map(parse_account)
        .collect();
    assert_eq!(accounts.len(), 2, "{stdout}");
    for (cpu, a) in accounts.iter().enumerate() {
        assert_eq!(a.written, a.read + a.lost, "cpu {cpu}: {a:?}");
        assert_eq!(a.lost, a.overrun + a.dropped, "cpu {cpu}: {a:?}");
        assert_eq!(
            a.attempted, a.written,
            "cpu {cpu}: every event enabled: {a:?}"
        );
        assert!(a.read > 0, "cpu {cpu}: {a:?}");
    }
    // vCPU 0's registration and each vCPU's exit, at the doorbell asked for.
    assert!(
        stdout.contains(&format!("\ndoorbell {doorbell}: 3 rings\n")),
        "{stdout}"
    );
    let total_read: u64 = accounts.iter().map(|a| a.read).sum();
    let total_lost: u64 = accounts.iter().map(|a| a.lost).sum();
    assert!(
        stdout.contains(&format!(": {total_read} events, {total_lost} lost")),
        "{stdout}"
    );

    // trace-cmd reads it: every event with its fields, per CPU as many as were read, in
    // seq order, never more drops than the example counted lost.
    let report = env::run("trace-cmd", &["report", &out]);
    let text = env::stdout(&report);
    assert!(
        report.status.success(),
        "trace-cmd report: {}",
        env::stderr(&report)
    );
    assert!(!text.contains("UNKNOWN"), "unknown events in:\n{text}");
    let mut per_cpu = [0u64; 2];
    let mut last_seq: [Option<u64>; 2] = [None; 2];
    let mut drops = [0u64; 2];
    for line in parse_all(&text, "trace-cmd report") {
        match line {
            Line::Event(e) => {
                let cpu = e.cpu as usize;
                assert!(cpu < 2, "{e:?}");
                assert_eq!(e.comm, format!("vcpu{cpu}"), "{e:?}");
                for f in fields_of(&e.name) {
                    assert!(e.field(f).is_some(), "no {f}= in {e:?}");
                }
                let seq = e.seq().expect("seq");
                assert!(seq < accounts[cpu].attempted, "{e:?}");
                assert!(
                    last_seq[cpu].is_none_or(|s| seq > s),
                    "{e:?} after seq {last_seq:?}"
                );
                last_seq[cpu] = Some(seq);
                per_cpu[cpu] += 1;
            }
            Line::Drop { cpu, count } => drops[cpu as usize] += count.unwrap_or(0),
            Line::Cpus(n) => assert_eq!(n, 2),
            Line::WindowExceeded => panic!("trace-cmd printed a hyptrace merge line"),
        }
    }
    for cpu in 0..2 {
        assert_eq!(
            per_cpu[cpu], accounts[cpu].read,
            "cpu {cpu}: events in the report"
        );
        assert!(
            drops[cpu] <= accounts[cpu].lost,
            "cpu {cpu}: drops {drops:?}"
        );
    }
}
