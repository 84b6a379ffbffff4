//! Logging of the VMM's steps (issue 10): `RUST_LOG=debug` and `-v`/`-vv` show the
//! memory map, the vCPUs starting and exiting and the final walks on stderr; without
//! either, stderr holds the summary alone and stdout the events, as before.

use std::process::{Command, Output};

use hyptrace::env::{self, kvm_available, vm_lock};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// `hyptrace` with `args`, `RUST_LOG` set to `rust_log` (or removed).
fn hyptrace(args: &[&str], rust_log: Option<&str>) -> Output {
    let mut c = Command::new(BIN);
    c.args(args);
    match rust_log {
        Some(v) => c.env("RUST_LOG", v),
        None => c.env_remove("RUST_LOG"),
    };
    c.output()
        .unwrap_or_else(|e| panic!("cannot run {BIN}: {e}"))
}

/// The log lines (env_logger's `[LEVEL target] message`) of stderr.
fn log_lines(o: &Output) -> Vec<String> {
    env::stderr(o)
        .lines()
        .filter(|l| l.starts_with('['))
        .map(str::to_string)
        .collect()
}

fn assert_steps(o: &Output, what: &str) {
    let err = env::stderr(o);
    assert_eq!(o.status.code(), Some(0), "{what}: {err}");
    let logs = log_lines(o);
    for step in [
        "memory map:",
        "created 2 vCPUs",
        "vcpu 0: running",
        "vcpu 1: exit: Finished",
        "final read-only walk",
    ] {
        assert!(
            logs.iter().any(|l| l.contains(step)),
            "{what}: no {step:?} in the log: {err}"
        );
    }
    // The events stay on stdout, the summary on stderr, both unchanged.
    assert_eq!(env::stdout(o).lines().count(), 20, "{what}");
    assert!(
        err.lines()
            .last()
            .is_some_and(|l| l.starts_with("hyptrace: 2 vCPUs: written 20 = read 20")),
        "{what}: {err}"
    );
}

#[test]
fn rust_log_and_verbose_show_the_vmm_steps() {
    if !kvm_available(KRATE, "rust_log_and_verbose_show_the_vmm_steps") {
        return;
    }
    let _vm = vm_lock();
    let run = ["run", "--vcpus", "2", "--events", "10"];
    assert_steps(&hyptrace(&run, Some("debug")), "RUST_LOG=debug");
    let mut vv = run.to_vec();
    vv.push("-vv");
    assert_steps(&hyptrace(&vv, None), "-vv");
    // -v is info: the start and stop of the run, not the per-vCPU debug steps.
    let mut v = run.to_vec();
    v.push("-v");
    let o = hyptrace(&v, None);
    let logs = log_lines(&o);
    assert!(
        logs.iter().any(|l| l.contains("started 2 vCPUs")),
        "-v: {logs:?}"
    );
    assert!(
        !logs.iter().any(|l| l.starts_with("[DEBUG")),
        "-v: {logs:?}"
    );
    // Neither: no log line at all.
    let o = hyptrace(&run, None);
    assert_eq!(o.status.code(), Some(0), "{}", env::stderr(&o));
    assert!(log_lines(&o).is_empty(), "{}", env::stderr(&o));
    assert!(env::stderr(&o).lines().all(|l| l.starts_with("hyptrace: ")));
}
