//! Test helpers: a tiny ring-page builder (using the abi codec), trace-cmd runners.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use hyptrace_abi::events;
use hyptrace_abi::page::{
    data_event_size, encode_data_header, encode_time_extend, MAX_DELTA, PAGE_HEADER_SIZE,
};
use hyptrace_output::Missed;

/// Bytes of private footer our ring pages carry (filled with garbage here).
pub const FOOTER: usize = 64;

/// Builds ring pages (header + data + garbage footer) for one CPU.
pub struct PageBuilder {
    pub page_size: usize,
    pub pages: Vec<(Vec<u8>, Missed)>,
    data: Vec<u8>,
    page_ts: u64,
    last_ts: u64,
    pending_missed: Missed,
}

impl PageBuilder {
    pub fn new(page_size: usize) -> Self {
        Self {
            page_size,
            pages: Vec::new(),
            data: Vec::new(),
            page_ts: 0,
            last_ts: 0,
            pending_missed: Missed::None,
        }
    }

    fn capacity(&self) -> usize {
        self.page_size - PAGE_HEADER_SIZE - FOOTER
    }

    /// Appends an event with absolute timestamp `ts` (non-decreasing).
    pub fn push(&mut self, ts: u64, payload: &[u8]) {
        let size = data_event_size(payload.len());
        if !self.data.is_empty() {
            let delta = ts - self.last_ts;
            let ext = if delta > MAX_DELTA { 8 } else { 0 };
            if self.data.len() + ext + size > self.capacity() {
                self.flush();
            } else {
                if ext != 0 {
                    self.data.extend_from_slice(&encode_time_extend(delta));
                    self.write_event(0, payload);
                } else {
                    self.write_event(delta as u32, payload);
                }
                self.last_ts = ts;
                return;
            }
        }
        assert!(size <= self.capacity());
        self.page_ts = ts;
        self.last_ts = ts;
        self.write_event(0, payload);
    }

    fn write_event(&mut self, delta: u32, payload: &[u8]) {
        let mut hdr = [0u8; 8];
        let n = encode_data_header(&mut hdr, payload.len(), delta);
        self.data.extend_from_slice(&hdr[..n]);
        self.data.extend_from_slice(payload);
        while !self.data.len().is_multiple_of(4) {
            self.data.push(0);
        }
    }

    /// Closes the current page (if it has events).
    pub fn flush(&mut self) {
        if self.data.is_empty() {
            return;
        }
        let mut p = vec![0xEEu8; self.page_size];
        p[..8].copy_from_slice(&self.page_ts.to_le_bytes());
        p[8..16].copy_from_slice(&(self.data.len() as u64).to_le_bytes());
        p[16..16 + self.data.len()].copy_from_slice(&self.data);
        // Garbage between the data and the footer too: the sink must zero it.
        self.pages
            .push((p, std::mem::replace(&mut self.pending_missed, Missed::None)));
        self.data.clear();
    }

    /// Marks `n` events lost before the next page (closes the current one).
    pub fn lose(&mut self, n: u64) {
        self.lose_as(Missed::Count(n));
    }

    /// Marks a loss `missed` (e.g. [`Missed::Unknown`]) before the next page (closes
    /// the current one).
    pub fn lose_as(&mut self, missed: Missed) {
        self.flush();
        self.pending_missed = missed;
    }

    pub fn finish(mut self) -> Vec<(Vec<u8>, Missed)> {
        self.flush();
        self.pages
    }
}

pub fn marker(cpu: u32, seq: u64, value: u64) -> Vec<u8> {
    events::marker(events::vcpu_pid(cpu), seq, value).to_vec()
}

pub fn span(cpu: u32, seq: u64, id: u64, dur: u64) -> Vec<u8> {
    events::span(events::vcpu_pid(cpu), seq, id, dur).to_vec()
}

pub fn text(cpu: u32, seq: u64, msg: &str) -> Vec<u8> {
    let mut b = vec![0u8; 300];
    let n = events::text(&mut b, events::vcpu_pid(cpu), seq, msg.as_bytes()).unwrap();
    b.truncate(n);
    b
}

/// A scratch directory, removed (with everything in it) when dropped: keep it bound
/// for as long as the test uses the directory.
#[derive(Debug)]
pub struct ScratchDir(tempfile::TempDir);

impl ScratchDir {
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.path()
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        self.path()
    }
}

/// A fresh, uniquely named scratch directory `hyptrace-output-{name}-XXXXXX` under the
/// target dir's tmp (`CARGO_TARGET_TMPDIR`, which Cargo sets only while compiling
/// integration tests), else under the system temp dir.
pub fn scratch_dir(name: &str) -> ScratchDir {
    let base = option_env!("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base).unwrap();
    let d = tempfile::Builder::new()
        .prefix(&format!("hyptrace-output-{name}-"))
        .tempdir_in(&base)
        .unwrap_or_else(|e| panic!("scratch dir in {}: {e}", base.display()));
    ScratchDir(d)
}

/// Output of the real trace-cmd, or `None` (after printing SKIP) when it is not
/// installed; panics then if `HYPTRACE_REQUIRE_TRACE_CMD=1`.
pub fn trace_cmd(args: &[&str], file: &Path) -> Option<(String, String, bool)> {
    let mut cmd = Command::new("trace-cmd");
    cmd.args(args).arg("-i").arg(file);
    match cmd.output() {
        Ok(o) => Some((
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
            o.status.success(),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::env::var("HYPTRACE_REQUIRE_TRACE_CMD").as_deref() == Ok("1") {
                panic!("trace-cmd not installed and HYPTRACE_REQUIRE_TRACE_CMD=1");
            }
            println!("SKIP: trace-cmd not installed");
            None
        }
        Err(e) => panic!("running trace-cmd: {e}"),
    }
}

/// Collapses runs of whitespace (trace-cmd pads columns).
pub fn norm(line: &str) -> String {
    line.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Decodes a Perfetto trace with Perfetto's official schema (`perfetto_decode.py`, the
/// `perfetto` PyPI package's perfetto_trace_pb2) and returns its JSON summary; `None`
/// (after printing SKIP) when python3 or the package is missing — panics then if
/// `HYPTRACE_REQUIRE_PERFETTO=1`. Panics if the decoder rejects the file.
#[allow(dead_code)]
pub fn perfetto_decode(file: &Path, events: bool) -> Option<serde_json::Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/perfetto_decode.py");
    perfetto_decode_with(&script, file, events)
}

/// [`perfetto_decode`] with the script's path.
#[allow(dead_code)]
pub fn perfetto_decode_with(script: &Path, file: &Path, events: bool) -> Option<serde_json::Value> {
    let have = Command::new("python3")
        .args([
            "-c",
            "import perfetto.protos.perfetto.trace.perfetto_trace_pb2",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        if std::env::var("HYPTRACE_REQUIRE_PERFETTO").as_deref() == Ok("1") {
            panic!("python3 with the perfetto package missing and HYPTRACE_REQUIRE_PERFETTO=1");
        }
        println!("SKIP: python3 with the perfetto package (pip install perfetto) not available");
        return None;
    }
    let mut cmd = Command::new("python3");
    cmd.arg(script).arg(file);
    if events {
        cmd.arg("--events");
    }
    let o = cmd.output().expect("running python3");
    assert!(
        o.status.success(),
        "perfetto_decode.py rejected {}: {}",
        file.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    Some(serde_json::from_slice(&o.stdout).expect("decoder JSON"))
}
