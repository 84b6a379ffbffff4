//! End-to-end tests of `hyptrace run`: boots the guest on KVM (skipped without
//! /dev/kvm unless HYPTRACE_REQUIRE_KVM=1) and checks every bad-input path.
//! Checks counts and exit codes, never durations.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");

/// Whether KVM-backed tests can run (prints `SKIP` or fails under
/// `HYPTRACE_REQUIRE_KVM=1`; logs the test for CI): see `tests/support/env.rs`.
fn kvm_available(test: &str) -> bool {
    hyptrace::env::kvm_available("vm_boot", test)
}

fn hyptrace(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run hyptrace")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn temp_path(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "hyptrace-test-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Runs `hyptrace run` with --stats and returns (output, stats JSON).
fn run_with_stats(args: &[&str]) -> (Output, serde_json::Value) {
    let stats = temp_path("stats.json");
    let mut all = vec!["run", "--stats", stats.to_str().expect("utf-8 temp path")];
    all.extend_from_slice(args);
    let out = hyptrace(&all);
    let text = std::fs::read_to_string(&stats)
        .unwrap_or_else(|e| panic!("no stats file ({e}); stderr: {}", stderr(&out)));
    let _ = std::fs::remove_file(&stats);
    (out, serde_json::from_str(&text).expect("stats are JSON"))
}

fn assert_all_finished(vcpus: usize, events: u64, args: &[&str]) {
    let (out, stats) = run_with_stats(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
    let per = stats["cpus"].as_array().expect("cpus");
    assert_eq!(per.len(), vcpus, "{stats}");
    assert_eq!(stats["guest_exit"], "ok", "{stats}");
    for (i, v) in per.iter().enumerate() {
        assert_eq!(v["cpu"], i as u64);
        assert_eq!(v["outcome"], "ok", "{stats}");
        assert_eq!(v["attempted"], events, "{stats}");
        assert_eq!(v["skipped"], 0, "{stats}");
        assert!(err.contains(&format!("vcpu {i}: finished in ")), "{err}");
        assert!(
            err.contains(&format!("cpu {i}: attempted {events} skipped 0")),
            "{err}"
        );
    }
}

#[test]
fn steady_on_1_2_4_vcpus() {
    if !kvm_available("steady_on_1_2_4_vcpus") {
        return;
    }
    for vcpus in [1usize, 2, 4] {
        let n = vcpus.to_string();
        assert_all_finished(
            vcpus,
            3000,
            &["--vcpus", &n, "--events", "3000", "--rate", "0"],
        );
    }
}

#[test]
fn steady_paced() {
    if !kvm_available("steady_paced") {
        return;
    }
    assert_all_finished(
        2,
        500,
        &["--vcpus", "2", "--events", "500", "--rate", "100000"],
    );
}

#[test]
fn mixed_and_burst_finish() {
    if !kvm_available("mixed_and_burst_finish") {
        return;
    }
    assert_all_finished(
        2,
        5000,
        &[
            "--vcpus",
            "2",
            "--events",
            "5000",
            "--rate",
            "0",
            "--workload",
            "mixed",
        ],
    );
    assert_all_finished(
        2,
        5000,
        &[
            "--vcpus",
            "2",
            "--events",
            "5000",
            "--rate",
            "1000000",
            "--workload",
            "burst",
        ],
    );
}

#[test]
fn guest_swap_and_page_size_options_boot() {
    if !kvm_available("guest_swap_and_page_size_options_boot") {
        return;
    }
    assert_all_finished(
        1,
        100,
        &[
            "--vcpus",
            "1",
            "--events",
            "100",
            "--swap",
            "guest",
            "--mode",
            "stop",
            "--page-size",
            "65536",
            "--buffer-kb",
            "256",
        ],
    );
}

#[test]
fn panic_workload_exits_3_with_message() {
    if !kvm_available("panic_workload_exits_3_with_message") {
        return;
    }
    let out = hyptrace(&["run", "--vcpus", "2", "--workload", "panic"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "stderr: {err}");
    assert!(
        err.contains("guest panicked: guest workload panic on vcpu"),
        "{err}"
    );
    assert!(!err.contains("panicked at"), "{err}");
}

#[test]
fn fault_workload_exits_3_with_shutdown() {
    if !kvm_available("fault_workload_exits_3_with_shutdown") {
        return;
    }
    let out = hyptrace(&["run", "--vcpus", "2", "--workload", "fault"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "stderr: {err}");
    assert!(err.contains("triple fault (KVM_EXIT_SHUTDOWN)"), "{err}");
}

#[test]
fn duration_stops_cleanly() {
    if !kvm_available("duration_stops_cleanly") {
        return;
    }
    let (out, stats) = run_with_stats(&[
        "--vcpus",
        "2",
        "--events",
        "1000000000000",
        "--rate",
        "1000000000",
        "--duration",
        "1",
    ]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
    assert!(err.contains("stopped: --duration elapsed"), "{err}");
    assert_eq!(stats["stop_reason"], "--duration elapsed");
    for v in stats["cpus"].as_array().expect("cpus") {
        assert_eq!(v["outcome"], "stopped", "{stats}");
    }
}

#[test]
fn sigterm_stops_cleanly() {
    if !kvm_available("sigterm_stops_cleanly") {
        return;
    }
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--vcpus",
            "2",
            "--events",
            "1000000000000",
            "--rate",
            "0",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    // Signal only once events flow: the handlers are installed before the VM boots, but
    // on a loaded machine a fixed sleep can end before that, and the default action
    // would kill the process (no exit code). `wait_with_output` drains the rest.
    let mut stdout = child.stdout.take().expect("stdout");
    let mut byte = [0u8; 1];
    std::io::Read::read_exact(&mut stdout, &mut byte).expect("first byte of output");
    child.stdout = Some(stdout);
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(st.success());
    let out = child.wait_with_output().expect("wait");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "stderr: {err}");
    assert!(err.contains("stopped: interrupted"), "{err}");
}

/// Every bad input: exit 2, one `hyptrace: error:` line (first; argument errors add
/// clap's hints after it), no Rust panic.
fn assert_usage_error(args: &[&str], needle: &str) {
    let out = hyptrace(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: stderr: {err}");
    let ours = err.lines().filter(|l| l.starts_with("hyptrace:")).count();
    assert_eq!(ours, 1, "{args:?}: not one hyptrace line: {err}");
    assert!(err.starts_with("hyptrace: error: "), "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err:?} lacks {needle:?}");
    assert!(!err.contains("panicked at"), "{args:?}: {err}");
}

#[test]
fn bad_numbers_exit_2() {
    assert_usage_error(&["run", "--vcpus", "0"], "--vcpus");
    assert_usage_error(&["run", "--vcpus", "100000"], "--vcpus");
    assert_usage_error(&["run", "--vcpus", "two"], "--vcpus");
    assert_usage_error(
        &["run", "--vcpus", "256", "--buffer-kb", "65536"],
        "guest memory",
    );
    assert_usage_error(&["run", "--page-size", "5000"], "--page-size");
    assert_usage_error(&["run", "--page-size", "2048"], "--page-size");
    assert_usage_error(&["run", "--page-size", "0"], "--page-size");
    assert_usage_error(&["run", "--buffer-kb", "8"], "--buffer-kb");
    assert_usage_error(&["run", "--buffer-kb", "0"], "--buffer-kb");
    assert_usage_error(
        &["run", "--page-size", "65536", "--buffer-kb", "128"],
        "--buffer-kb",
    );
    assert_usage_error(&["run", "--mem-mb", "2"], "--mem-mb");
    assert_usage_error(
        &["run", "--mem-mb", "16", "--buffer-kb", "16384"],
        "--mem-mb",
    );
    assert_usage_error(&["run", "--mem-mb", "1000000"], "--mem-mb");
    assert_usage_error(&["run", "--poll-ms", "0"], "--poll-ms");
    assert_usage_error(&["run", "--duration", "0"], "--duration");
    assert_usage_error(&["run", "--duration", "-3"], "--duration");
    assert_usage_error(&["run", "--workload", "nope"], "--workload");
    assert_usage_error(&["run", "--mode", "sometimes"], "--mode");
    assert_usage_error(&["run", "--swap", "both"], "--swap");
    assert_usage_error(&["run", "--no-such-option"], "--no-such-option");
}

#[test]
fn bad_guest_images_exit_2() {
    assert_usage_error(
        &["run", "--guest", "/nonexistent/hyptrace-guest.elf"],
        "cannot read guest image",
    );

    let write = |tag: &str, bytes: &[u8]| {
        let p = temp_path(tag);
        std::fs::write(&p, bytes).expect("write temp guest");
        p
    };
    let check = |tag: &str, bytes: &[u8], needle: &str| {
        let p = write(tag, bytes);
        assert_usage_error(&["run", "--guest", p.to_str().expect("utf-8")], needle);
        let _ = std::fs::remove_file(&p);
    };
    let elf = hyptrace_host::GUEST_ELF;
    check("text", b"#!/bin/sh\necho not an elf\n", "not an ELF");
    check("short", &elf[..40], "not an ELF");
    check("truncated", &elf[..200], "bad guest image");
    let mut e = elf.to_vec();
    e[4] = 1; // ELFCLASS32
    check("elf32", &e, "64-bit");
    let mut e = elf.to_vec();
    e[18] = 183; // EM_AARCH64
    check("arm", &e, "x86-64");
    let mut e = elf.to_vec();
    e[16] = 3; // ET_DYN
    check("dyn", &e, "EXEC");
    // Move every segment (and the entry) by `delta`.
    let shifted = |delta: i64| {
        let mut e = elf.to_vec();
        let rd = |e: &[u8], o: usize| u64::from_le_bytes(e[o..o + 8].try_into().unwrap());
        let entry = rd(&e, 24).wrapping_add(delta as u64);
        e[24..32].copy_from_slice(&entry.to_le_bytes());
        let phoff = rd(&e, 32) as usize;
        let phnum = u16::from_le_bytes([e[56], e[57]]) as usize;
        for i in 0..phnum {
            let ph = phoff + i * 56;
            for f in [16, 24] {
                let v = rd(&e, ph + f).wrapping_add(delta as u64);
                e[ph + f..ph + f + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        e
    };
    check("low", &shifted(-0x1f_0000), "below");
    check("high", &shifted(0x1_0000_0000), "guest memory");
}

#[test]
fn missing_kvm_device_exits_2() {
    let out = Command::new(BIN)
        .args(["run", "--events", "10"])
        .env("HYPTRACE_KVM_DEVICE", "/nonexistent/kvm")
        .output()
        .expect("run hyptrace");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("hyptrace: error: cannot open the KVM device /nonexistent/kvm"),
        "{err}"
    );
}

#[test]
fn help_and_version_exit_0() {
    let out = hyptrace(&["run", "--help"]);
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for opt in [
        "--vcpus",
        "--events",
        "--rate",
        "--workload",
        "--buffer-kb",
        "--page-size",
        "--mem-mb",
        "--mode",
        "--swap",
        "--poll-ms",
        "--duration",
        "--stats",
        "--guest",
    ] {
        assert!(help.contains(opt), "--help lacks {opt}");
    }
    assert_eq!(hyptrace(&["--version"]).status.code(), Some(0));
}
