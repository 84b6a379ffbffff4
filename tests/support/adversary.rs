//! Adversarial guests: building the `adversary` guest ELF (guest/src/bin/adversary.rs)
//! once per test binary, and running `hyptrace` under a watchdog that measures the
//! child's peak RSS and wall time, sends SIGTERM on request, and kills it (reporting
//! why) when it runs past its time, memory or output-file bound — a test fails, it
//! never hangs or takes the machine down.
//!
//! The child's stdout and stderr are read as they come (never kept whole: a flat-out
//! run prints millions of lines) into [`StreamSummary`]s: line counts per CPU, drop
//! markers, forged lines, raw control characters.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

// `strip_var`: which variables a nested guest build must not inherit (one list, shared
// with crates/payload/build.rs, which builds the embedded guest the same way).
include!("../../crates/payload/guest_build_env.rs");

/// Builds the adversary guest (`cargo build --release --features adversary --bin
/// adversary`, run from guest/ so its .cargo/config.toml applies) into
/// `<target_dir>/adversary-guest` and returns the ELF's path. Built once per test
/// binary (later calls return the cached result); cargo's own caching makes a rebuild
/// in another test binary a no-op when nothing changed.
///
/// `target_dir` is the root package's target directory (the parent of the directory
/// holding the `hyptrace` binary).
pub fn adversary_guest(target_dir: &Path) -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build(target_dir, "adversary", "adversary", "adversary-guest"))
        .clone()
}

/// Builds the example Rust guest (`--features examples --bin example_rust`, the Rust
/// SDK's example: guest/src/bin/example_rust.rs) into `<target_dir>/example-guests`, once
/// per test binary, like [`adversary_guest`].
pub fn example_rust_guest(target_dir: &Path) -> Result<PathBuf, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| build(target_dir, "examples", "example_rust", "example-guests"))
        .clone()
}

fn build(target_dir: &Path, feature: &str, bin: &str, dir: &str) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let guest = root.join("guest");
    let out = target_dir.join(dir);
    let cargo = std::env::var_os("CARGO")
        .or_else(|| option_env!("CARGO").map(Into::into))
        .unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&guest)
        .args([
            "build",
            "--release",
            "--features",
            feature,
            "--bin",
            bin,
            "--target-dir",
        ])
        .arg(&out)
        .stdin(Stdio::null());
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(strip_var) {
            cmd.env_remove(&name);
        }
    }
    let o = cmd
        .output()
        .map_err(|e| format!("cannot run {cargo:?} for the {bin} guest: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "building the {bin} guest failed ({}):\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    let elf = out.join("x86_64-unknown-linux-gnu/release").join(bin);
    if !elf.is_file() {
        return Err(format!("the {bin} guest build left no {}", elf.display()));
    }
    Ok(elf)
}

/// Bounds a watched run must stay within (the watchdog kills it otherwise).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Kill after this long from the start.
    pub wall: Duration,
    /// Kill when the child's peak RSS (VmHWM) goes above this many KiB.
    pub rss_kib: u64,
    /// Send one SIGTERM this long after the start.
    pub sigterm_after: Option<Duration>,
    /// Kill when this file grows past this many bytes (an output file).
    pub file: Option<(PathBuf, u64)>,
}

/// What was seen on one output stream (bytes, lines and a few facts about them).
#[derive(Debug, Clone, Default)]
pub struct StreamSummary {
    /// Bytes read.
    pub bytes: u64,
    /// Lines read.
    pub lines: u64,
    /// Event lines per CPU column (`[NNN]`), index = CPU.
    pub events: Vec<u64>,
    /// Drop-marker counts per CPU (`CPU:N [K EVENTS DROPPED]`, K summed), index = CPU.
    pub dropped: Vec<u64>,
    /// Drop-marker lines per CPU.
    pub drop_lines: Vec<u64>,
    /// Lines that start (after blanks) with a forged marker the adversary writes.
    pub forged: Vec<String>,
    /// Bytes below 0x20 other than `\n`, and 0x7f (raw control characters).
    pub control_bytes: u64,
    /// The first lines (at most [`KEEP_LINES`], each cut to 300 bytes), for messages.
    pub head: Vec<String>,
    /// Every line of a stream up to [`KEEP_BYTES`] bytes in all (stderr), else empty.
    pub text: String,
}

/// Lines kept in [`StreamSummary::head`].
pub const KEEP_LINES: usize = 40;
/// Bytes of a stream kept whole in [`StreamSummary::text`] when asked.
pub const KEEP_BYTES: usize = 1 << 20;
/// Longest line looked at (longer ones are cut: the rest still counts as bytes).
const MAX_LINE: usize = 1 << 20;
/// The drop marker the adversary tries to forge. Its CPU is one no adversarial run has
/// (they have at most a few vCPUs), so hyptrace's own drop lines never match it: a
/// genuine `CPU:0 [999 EVENTS DROPPED]` of a flat-out stop-mode run once did.
pub const FORGED_MARKER: &str = "CPU:999 [999 EVENTS DROPPED]";

fn bump(v: &mut Vec<u64>, i: usize, by: u64) {
    if i < 4096 {
        if v.len() <= i {
            v.resize(i + 1, 0);
        }
        v[i] = v[i].saturating_add(by);
    }
}

impl StreamSummary {
    fn line(&mut self, raw: &[u8], keep_text: bool) {
        self.lines += 1;
        self.control_bytes += raw
            .iter()
            .filter(|&&b| (b < 0x20 && b != b'\n') || b == 0x7f)
            .count() as u64;
        let line = String::from_utf8_lossy(raw);
        let line = line.trim_end_matches('\n');
        if keep_text && self.text.len() + line.len() < KEEP_BYTES {
            self.text.push_str(line);
            self.text.push('\n');
        }
        if self.head.len() < KEEP_LINES {
            self.head.push(line.chars().take(300).collect());
        }
        let t = line.trim_start();
        if t.starts_with(FORGED_MARKER) {
            self.forged.push(line.chars().take(300).collect());
        }
        if let Some(rest) = t.strip_prefix("CPU:") {
            // `CPU:N [K EVENTS DROPPED]` or `CPU:N [EVENTS DROPPED]`.
            if let Some((n, rest)) = rest.split_once(' ') {
                if let Ok(cpu) = n.parse::<usize>() {
                    let k = rest
                        .strip_prefix('[')
                        .and_then(|r| r.split_once(' '))
                        .and_then(|(k, _)| k.parse::<u64>().ok())
                        .unwrap_or(0);
                    bump(&mut self.dropped, cpu, k);
                    bump(&mut self.drop_lines, cpu, 1);
                }
            }
            return;
        }
        // Event line: `comm-pid [CCC] ts: name: fields`.
        if let Some(open) = t.find(" [") {
            let rest = &t[open + 2..];
            if let Some((c, after)) = rest.split_once(']') {
                if c.len() == 3 && c.bytes().all(|b| b.is_ascii_digit()) && after.contains(':') {
                    if let Ok(cpu) = c.parse::<usize>() {
                        bump(&mut self.events, cpu, 1);
                    }
                }
            }
        }
    }

    /// Event lines of `cpu`.
    pub fn events_of(&self, cpu: usize) -> u64 {
        self.events.get(cpu).copied().unwrap_or(0)
    }

    /// Events reported dropped on `cpu` by drop markers.
    pub fn dropped_of(&self, cpu: usize) -> u64 {
        self.dropped.get(cpu).copied().unwrap_or(0)
    }
}

/// Reads a stream to its end, line by line, into a summary.
fn summarize(mut r: impl Read, keep_text: bool) -> StreamSummary {
    let mut s = StreamSummary::default();
    let mut buf = vec![0u8; 1 << 16];
    let mut line: Vec<u8> = Vec::new();
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        s.bytes += n as u64;
        let mut chunk = &buf[..n];
        while let Some(i) = chunk.iter().position(|&b| b == b'\n') {
            if line.len() < MAX_LINE {
                let take = (i + 1).min(MAX_LINE - line.len());
                line.extend_from_slice(&chunk[..take]);
            }
            s.line(&line, keep_text);
            line.clear();
            chunk = &chunk[i + 1..];
        }
        if line.len() < MAX_LINE {
            let take = chunk.len().min(MAX_LINE - line.len());
            line.extend_from_slice(&chunk[..take]);
        }
    }
    if !line.is_empty() {
        s.line(&line, keep_text);
    }
    s
}

/// The outcome of a watched run.
#[derive(Debug, Clone)]
pub struct Watched {
    /// Exit code (None: killed by a signal).
    pub code: Option<i32>,
    /// How it ended, as the OS said.
    pub status: String,
    /// Why the watchdog killed it (None: it ended by itself).
    pub killed: Option<String>,
    /// Peak RSS, KiB: the highest of the VmHWM polled while it ran and the kernel's
    /// `ru_maxrss` at exit (an upper bound: it also counts the test process's image
    /// the child was spawned from, before its exec).
    pub peak_rss_kib: u64,
    /// Highest VmHWM polled while it ran, KiB (0: it ended before the first poll).
    pub polled_rss_kib: u64,
    /// `ru_maxrss` from `wait4`, KiB.
    pub maxrss_kib: u64,
    /// From spawn to exit.
    pub wall: Duration,
    /// From the SIGTERM to exit, if one was sent.
    pub after_sigterm: Option<Duration>,
    /// stdout.
    pub out: StreamSummary,
    /// stderr (with its text kept).
    pub err: StreamSummary,
}

impl Watched {
    /// One line of measurements for the test log.
    pub fn measurements(&self) -> String {
        format!(
            "exit {:?}, wall {:.2} s{}, peak RSS {:.1} MiB (VmHWM polled {:.1} MiB, ru_maxrss {:.1} MiB), stdout {} lines / {:.1} MB",
            self.code,
            self.wall.as_secs_f64(),
            self.after_sigterm
                .map(|d| format!(" ({:.2} s after SIGTERM)", d.as_secs_f64()))
                .unwrap_or_default(),
            self.peak_rss_kib as f64 / 1024.0,
            self.polled_rss_kib as f64 / 1024.0,
            self.maxrss_kib as f64 / 1024.0,
            self.out.lines,
            self.out.bytes as f64 / 1e6,
        )
    }
}

/// Peak RSS (VmHWM, KiB) of a live process, None once it is gone or a zombie.
fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// `struct rusage` of Linux x86-64 (two timevals, then 14 longs; `ru_maxrss` first).
#[repr(C)]
#[derive(Default)]
struct Rusage {
    _utime: [i64; 2],
    _stime: [i64; 2],
    maxrss: i64,
    _rest: [i64; 13],
}

extern "C" {
    // pid_t wait4(pid_t pid, int *wstatus, int options, struct rusage *rusage);
    fn wait4(pid: i32, status: *mut i32, options: i32, rusage: *mut Rusage) -> i32;
}

/// `WNOHANG`.
const WNOHANG: i32 = 1;

/// How a reaped child ended: `(exit code, signal)`.
fn decode_status(st: i32) -> (Option<i32>, Option<i32>) {
    if st & 0x7f == 0 {
        (Some((st >> 8) & 0xff), None)
    } else {
        (None, Some(st & 0x7f))
    }
}

/// Reaps `pid` if it has ended: its wait status and peak RSS (KiB) from the kernel's
/// own accounting (exact, unlike polling). `Ok(None)`: still running.
fn try_reap(pid: u32) -> std::io::Result<Option<(i32, u64)>> {
    let mut st = 0i32;
    let mut ru = Rusage::default();
    // SAFETY: `st` and `ru` are valid, writable, and `ru` has the layout of the
    // platform's `struct rusage`; `pid` is our own child, not reaped yet (we are its
    // only waiter: std's `Child` is never waited on).
    let r = unsafe { wait4(pid as i32, &mut st, WNOHANG, &mut ru) };
    match r {
        0 => Ok(None),
        r if r == pid as i32 => Ok(Some((st, ru.maxrss.max(0) as u64))),
        _ => {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                Ok(None)
            } else {
                Err(e)
            }
        }
    }
}

/// Runs `bin args` under the watchdog: polls every 10 ms for the exit, the peak RSS,
/// the wall time, the output file's size; sends the SIGTERM; kills (SIGKILL) on a
/// bound. Never waits unboundedly: the stream readers end when the child's pipes close
/// (the child is dead by then). The peak RSS is the kernel's `ru_maxrss` of the child
/// (`wait4`), so short runs are measured too.
// The child is reaped with `wait4` (for its rusage), which clippy cannot see.
#[allow(clippy::zombie_processes)]
pub fn run_watched(bin: &str, args: &[&str], limits: &Limits) -> Watched {
    let start = Instant::now();
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}"));
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    std::thread::scope(|s| {
        let out = s.spawn(move || summarize(stdout, false));
        let err = s.spawn(move || summarize(stderr, true));
        let mut peak = 0u64;
        let mut killed = None;
        let mut sigterm_at: Option<Instant> = None;
        let (status, maxrss) = loop {
            if let Some(kib) = vm_hwm_kib(pid) {
                peak = peak.max(kib);
            }
            match try_reap(pid) {
                Ok(Some((st, kib))) => break (st, kib),
                Ok(None) => {}
                Err(e) => {
                    let _ = child.kill();
                    panic!("waiting for {bin}: {e}");
                }
            }
            // Not reaped yet: the pid is still our child's, signals reach it.
            let now = Instant::now();
            if killed.is_none() {
                let el = now - start;
                let file_size = limits
                    .file
                    .as_ref()
                    .and_then(|(p, _)| std::fs::metadata(p).ok())
                    .map_or(0, |m| m.len());
                if el > limits.wall {
                    killed = Some(format!("still running after {:.1} s", el.as_secs_f64()));
                } else if peak > limits.rss_kib {
                    killed = Some(format!(
                        "peak RSS {:.1} MiB above the bound of {:.1} MiB",
                        peak as f64 / 1024.0,
                        limits.rss_kib as f64 / 1024.0
                    ));
                } else if let Some((p, max)) = limits.file.as_ref().filter(|(_, m)| file_size > *m)
                {
                    killed = Some(format!(
                        "{} grew to {file_size} bytes, above {max}",
                        p.display()
                    ));
                }
                if killed.is_some() {
                    let _ = child.kill();
                }
            }
            if let (Some(after), None) = (limits.sigterm_after, sigterm_at) {
                if now - start >= after {
                    sigterm_at = Some(Instant::now());
                    let _ = Command::new("kill")
                        .args(["-TERM", &pid.to_string()])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status();
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let end = Instant::now();
        let out = out.join().expect("stdout reader thread panicked");
        let err = err.join().expect("stderr reader thread panicked");
        let (code, signal) = decode_status(status);
        Watched {
            code,
            status: match (code, signal) {
                (Some(c), _) => format!("exit status {c}"),
                (_, Some(sig)) => format!("killed by signal {sig}"),
                _ => "unknown".into(),
            },
            killed,
            peak_rss_kib: peak.max(maxrss),
            polled_rss_kib: peak,
            maxrss_kib: maxrss,
            wall: end - start,
            after_sigterm: sigterm_at.map(|t| end - t),
            out,
            err,
        }
    })
}
