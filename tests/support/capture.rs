//! Text output captured in memory: what a `Session` or a sink wrote, kept or only
//! counted in lines.

use std::io::Write;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

/// A `Write` into a shared buffer (clones share it), counting the lines written.
#[derive(Clone)]
pub struct Captured {
    bytes: Arc<Mutex<Vec<u8>>>,
    lines: Arc<AtomicU64>,
    keep: bool,
}

impl Captured {
    /// Keeps every byte written.
    pub fn keeping() -> Self {
        Self::new(true)
    }

    /// Only counts the lines (for outputs too large to keep).
    pub fn counting() -> Self {
        Self::new(false)
    }

    fn new(keep: bool) -> Self {
        Self {
            bytes: Arc::default(),
            lines: Arc::default(),
            keep,
        }
    }

    /// Lines written so far.
    pub fn lines(&self) -> u64 {
        self.lines.load(Relaxed)
    }

    /// What was kept, as UTF-8 (every text output of ours is).
    pub fn text(&self) -> String {
        String::from_utf8(self.bytes.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .expect("text output is UTF-8")
    }

    /// What was kept, invalid UTF-8 replaced.
    pub fn text_lossy(&self) -> String {
        String::from_utf8_lossy(&self.bytes.lock().unwrap_or_else(|p| p.into_inner())).into()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.iter().filter(|&&b| b == b'\n').count() as u64;
        self.lines.fetch_add(n, Relaxed);
        if self.keep {
            self.bytes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
