//! Test environment: skips, CI log, serialisation, temporary directories.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The target directory of the `hyptrace` binary `bin` (`env!("CARGO_BIN_EXE_hyptrace")`,
/// in `<target>/<profile>/`): where the guests built for tests go.
pub fn target_dir(bin: &str) -> PathBuf {
    Path::new(bin)
        .parent()
        .and_then(Path::parent)
        .expect("the hyptrace binary lives in <target>/<profile>/")
        .to_path_buf()
}

/// Whether KVM-backed tests can run. Prints `SKIP: /dev/kvm not available` when not;
/// with `HYPTRACE_REQUIRE_KVM=1` a missing /dev/kvm fails the test instead. When it
/// can, logs `crate: test` to `$HYPTRACE_VM_TEST_LOG` (CI checks that VM tests ran).
pub fn kvm_available(krate: &str, test: &str) -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    if !ok {
        if std::env::var("HYPTRACE_REQUIRE_KVM").is_ok_and(|v| v == "1") {
            panic!("/dev/kvm not available (or not accessible) and HYPTRACE_REQUIRE_KVM=1");
        }
        println!("SKIP: /dev/kvm not available");
        return false;
    }
    log_vm_test(krate, test);
    true
}

/// Appends `krate: test` to `$HYPTRACE_VM_TEST_LOG`.
pub fn log_vm_test(krate: &str, test: &str) {
    use std::io::Write as _;
    if let Some(path) = std::env::var_os("HYPTRACE_VM_TEST_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{krate}: {test}");
        }
    }
}

/// Whether `trace-cmd` can be run. Prints `SKIP: trace-cmd not installed` when not;
/// with `HYPTRACE_REQUIRE_TRACE_CMD=1` a missing trace-cmd fails the test instead.
pub fn trace_cmd_available() -> bool {
    let ok = Command::new("trace-cmd").arg("--help").output().is_ok();
    if !ok {
        if std::env::var("HYPTRACE_REQUIRE_TRACE_CMD").is_ok_and(|v| v == "1") {
            panic!("trace-cmd not installed and HYPTRACE_REQUIRE_TRACE_CMD=1");
        }
        println!("SKIP: trace-cmd not installed");
    }
    ok
}

/// Whether python3 with Perfetto's official schema (`pip install perfetto`:
/// perfetto_trace_pb2) can be run. Prints `SKIP: ...` when not; with
/// `HYPTRACE_REQUIRE_PERFETTO=1` a missing one fails the test instead.
pub fn perfetto_available() -> bool {
    let ok = Command::new("python3")
        .args([
            "-c",
            "import perfetto.protos.perfetto.trace.perfetto_trace_pb2",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        if std::env::var("HYPTRACE_REQUIRE_PERFETTO").is_ok_and(|v| v == "1") {
            panic!("python3 with the perfetto package missing and HYPTRACE_REQUIRE_PERFETTO=1");
        }
        println!("SKIP: python3 with the perfetto package (pip install perfetto) not available");
    }
    ok
}

/// Perfetto's official protos' reading of the trace `path` (the JSON summary of
/// crates/output/tests/perfetto_decode.py; with `events`, every track event too).
/// Fails the test when the decoder rejects the file (a packet that breaks the schema
/// or what hyptrace promises).
pub fn perfetto_decode(path: &str, events: bool) -> Vec<u8> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/crates/output/tests/perfetto_decode.py"
    );
    let mut args = vec![script, path];
    if events {
        args.push("--events");
    }
    let o = run("python3", &args);
    assert!(
        o.status.success(),
        "perfetto_decode.py rejected {path}: {}",
        stderr(&o)
    );
    o.stdout
}

/// Serialises the VM-booting tests of one test binary: the host has few cores, and
/// the vCPU threads and the reader compete for them, so two VMs at once would change
/// what a run loses (the tests that need a lossless run pick rates for one VM).
pub fn vm_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The arguments of a VMM that `collect` (or `dump --attach`) reads: `run` of one vCPU
/// writing `events` at 5000/s into big stop-mode rings (nothing lost) that only the
/// subscriber drains (`--drain none`), trace memory `DIR/NAME.trace`, control socket
/// `DIR/NAME.sock` (the second item returned).
pub fn subscribed_vm_args(dir: &TempDir, name: &str, events: u64) -> (Vec<String>, String) {
    let (mem, sock) = (
        dir.file(&format!("{name}.trace")),
        dir.file(&format!("{name}.sock")),
    );
    let args = [
        "run",
        "--vcpus",
        "1",
        "--drain",
        "none",
        "--trace-mem",
        &mem,
        "--control",
        &sock,
        "--events",
        &events.to_string(),
        "--rate",
        "5000",
        "--buffer-kb",
        "8192",
        "--mode",
        "stop",
    ];
    (args.iter().map(|a| a.to_string()).collect(), sock)
}

/// Runs `bin` with `args`, capturing stdout and stderr.
pub fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}"))
}

/// Waits until `ready()` holds, checking every 10 ms: fails if `child` exits first or
/// `timeout` passes, naming `what` and adding `detail()` (e.g. the child's stderr so
/// far). A test waits for a state of the run this way, never for a fixed time.
pub fn wait_until(
    child: &mut Child,
    what: &str,
    timeout: Duration,
    mut ready: impl FnMut() -> bool,
    detail: impl Fn() -> String,
) {
    let start = Instant::now();
    while !ready() {
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "the run ended while waiting for {what}: {}",
            detail()
        );
        assert!(
            start.elapsed() < timeout,
            "timed out waiting for {what}: {}",
            detail()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for `child` to exit, at most `timeout`; past it kills the child and fails,
/// naming `what`. A test that waits for a run to end waits this way.
pub fn wait_exit(child: &mut Child, what: &str, timeout: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return st,
            Ok(None) if start.elapsed() < timeout => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what}: still running after {timeout:?}");
            }
            Err(e) => panic!("{what}: wait: {e}"),
        }
    }
}

/// Sends signal `sig` (as `kill` takes it: `-INT`, `-STOP`, ...) to `child`.
pub fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(st.success(), "kill {sig}");
}

/// stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// stdout as text.
pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts a usage error: exit 2, exactly one line `hyptrace: ...` on stderr, first,
/// `hyptrace: error: ...` (argument errors add clap's hints after it: valid values, tips,
/// usage), `needle` in the message, nothing on stdout, no Rust panic.
pub fn assert_usage_error(o: &Output, what: &str, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{what}: stderr: {err}");
    let ours = err.lines().filter(|l| l.starts_with("hyptrace:")).count();
    assert_eq!(ours, 1, "{what}: not one hyptrace line: {err}");
    assert!(err.starts_with("hyptrace: error: "), "{what}: {err}");
    assert!(err.contains(needle), "{what}: {err:?} lacks {needle:?}");
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(o.stdout.is_empty(), "{what}: stdout: {}", stdout(o));
}

/// A temporary directory, removed (with its contents) when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new empty directory under the system temporary directory.
    pub fn new(tag: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "hyptrace-it-{}-{}-{tag}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
        Self(p)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// A path inside it, as a string.
    pub fn file(&self, name: &str) -> String {
        self.0
            .join(name)
            .to_str()
            .expect("utf-8 temp path")
            .to_string()
    }

    /// Names of the entries in the directory, sorted.
    pub fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Where the host-trace tests expect tracefs.
pub const TRACEFS: &str = "/sys/kernel/tracing";

/// Whether tracefs instances can be made here (else the test is skipped, or fails with
/// HYPTRACE_REQUIRE_TRACEFS=1).
pub fn tracefs_available(krate: &str, test: &str) -> bool {
    static PROBES: AtomicU32 = AtomicU32::new(0);
    let n = PROBES.fetch_add(1, Ordering::Relaxed);
    let probe = Path::new(TRACEFS)
        .join("instances")
        .join(format!("hyptrace-probe-{}-{n}", std::process::id()));
    let ok = std::fs::create_dir(&probe).is_ok();
    if ok {
        std::fs::remove_dir(&probe).expect("remove the probe instance");
    } else {
        assert!(
            std::env::var("HYPTRACE_REQUIRE_TRACEFS").as_deref() != Ok("1"),
            "{test}: no writable {TRACEFS}/instances"
        );
        eprintln!("{krate}::{test}: skipped: no writable {TRACEFS}/instances");
    }
    ok
}

/// The tracefs instance process `pid` made (`hyptrace-NS-PID-START`), if there is one.
pub fn tracefs_instance(pid: u32) -> Option<PathBuf> {
    let pid = pid.to_string();
    std::fs::read_dir(Path::new(TRACEFS).join("instances"))
        .ok()?
        .flatten()
        .find(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("hyptrace-"))
                .is_some_and(|r| r.split('-').nth(1) == Some(pid.as_str()))
        })
        .map(|e| e.path())
}
