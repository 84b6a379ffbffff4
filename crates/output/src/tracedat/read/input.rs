//! Positional and sequential reads of a trace.dat's bytes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use crate::{DatError, DatProblem};

/// Longest `\0`-terminated name (system, compression, buffer) accepted.
const MAX_NAME: usize = 4096;

/// The bytes of a trace.dat: a file read with positional reads, or a copy in memory.
#[derive(Clone)]
pub(super) enum Source {
    File {
        file: Arc<File>,
        path: PathBuf,
        len: u64,
    },
    Mem(Arc<[u8]>),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File { path, len, .. } => write!(f, "File({}, {len} bytes)", path.display()),
            Self::Mem(d) => write!(f, "Mem({} bytes)", d.len()),
        }
    }
}

impl Source {
    pub(super) fn len(&self) -> u64 {
        match self {
            Self::File { len, .. } => *len,
            Self::Mem(d) => d.len() as u64,
        }
    }

    /// Fills `buf` from offset `off`; an error if that runs past the end of the file.
    pub(super) fn read_at(
        &self,
        off: u64,
        buf: &mut [u8],
        what: &'static str,
    ) -> Result<(), DatError> {
        let end = off
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| DatError::format(off, DatProblem::PastEnd(what)))?;
        match self {
            Self::File { file, path, .. } => file
                .read_exact_at(buf, off)
                .map_err(|e| DatError::io(path, e)),
            Self::Mem(d) => {
                // In range: end <= len checked above.
                buf.copy_from_slice(&d[off as usize..end as usize]);
                Ok(())
            }
        }
    }

    /// Reads `n` bytes at `off` into a new vector (checked against the file length
    /// before allocating).
    pub(super) fn read_vec(
        &self,
        off: u64,
        n: usize,
        what: &'static str,
    ) -> Result<Vec<u8>, DatError> {
        if off.checked_add(n as u64).is_none_or(|e| e > self.len()) {
            return Err(DatError::format(off, DatProblem::PastEnd(what)));
        }
        let mut v = vec![0u8; n];
        self.read_at(off, &mut v, what)?;
        Ok(v)
    }
}

/// Sequential reading of metadata, from memory ([`Cur`]) or from the file ([`FileCur`]).
pub(super) trait Input {
    /// The next `n` bytes.
    fn bytes(&mut self, n: usize, what: &'static str) -> Result<&[u8], DatError>;
    /// Bytes left.
    fn remaining(&self) -> u64;
    /// An error at the current position.
    fn err(&self, problem: DatProblem) -> DatError;

    /// Skips `n` bytes.
    fn skip(&mut self, n: u64, what: &'static str) -> Result<(), DatError>;

    fn u8(&mut self, what: &'static str) -> Result<u8, DatError> {
        Ok(self.bytes(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, DatError> {
        let b = self.bytes(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DatError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DatError> {
        let b = self.bytes(8, what)?;
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        Ok(u64::from_le_bytes(w))
    }

    /// A u64 length that must fit in what is left.
    fn len64(&mut self, what: &'static str) -> Result<usize, DatError> {
        let n = self.u64(what)?;
        let left = self.remaining();
        let too_long = || DatProblem::Length { what, len: n, left };
        if n > left {
            return Err(self.err(too_long()));
        }
        usize::try_from(n).map_err(|_| self.err(too_long()))
    }

    /// A `\0`-terminated string of at most [`MAX_NAME`] bytes.
    fn cstr(&mut self, what: &'static str) -> Result<String, DatError> {
        let mut s = Vec::new();
        for _ in 0..=MAX_NAME {
            match self.u8(what)? {
                0 => return Ok(String::from_utf8_lossy(&s).into_owned()),
                b => s.push(b),
            }
        }
        Err(self.err(DatProblem::LongName {
            what,
            max: MAX_NAME,
        }))
    }

    fn text(&mut self, n: usize, what: &'static str) -> Result<String, DatError> {
        Ok(String::from_utf8_lossy(self.bytes(n, what)?).into_owned())
    }
}

pub(super) struct Cur<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Offset of `buf` in the file, for error messages.
    base: u64,
}

impl<'a> Cur<'a> {
    pub(super) fn new(buf: &'a [u8], pos: usize, base: u64) -> Self {
        Self { buf, pos, base }
    }

    /// The next `n` bytes, borrowed from the buffer (not from the cursor).
    pub(super) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DatError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err(DatProblem::PastEnd(what)))?;
        let b = &self.buf[self.pos..end];
        self.pos = end;
        Ok(b)
    }
}

impl Input for Cur<'_> {
    fn err(&self, problem: DatProblem) -> DatError {
        DatError::format(self.base + self.pos as u64, problem)
    }

    fn remaining(&self) -> u64 {
        self.buf.len().saturating_sub(self.pos) as u64
    }

    fn bytes(&mut self, n: usize, what: &'static str) -> Result<&[u8], DatError> {
        self.take(n, what)
    }

    fn skip(&mut self, n: u64, what: &'static str) -> Result<(), DatError> {
        let n = usize::try_from(n).map_err(|_| self.err(DatProblem::PastEnd(what)))?;
        self.bytes(n, what).map(|_| ())
    }
}

/// Sequential reads from the file through a small window.
pub(super) struct FileCur<'s> {
    src: &'s Source,
    pub(super) pos: u64,
    win: Vec<u8>,
    win_off: u64,
}

impl<'s> FileCur<'s> {
    pub(super) fn new(src: &'s Source, pos: u64) -> Self {
        Self {
            src,
            pos,
            win: Vec::new(),
            win_off: 0,
        }
    }
}

impl Input for FileCur<'_> {
    fn err(&self, problem: DatProblem) -> DatError {
        DatError::format(self.pos, problem)
    }

    fn remaining(&self) -> u64 {
        self.src.len().saturating_sub(self.pos)
    }

    fn bytes(&mut self, n: usize, what: &'static str) -> Result<&[u8], DatError> {
        let end = self
            .pos
            .checked_add(n as u64)
            .filter(|&e| e <= self.src.len())
            .ok_or_else(|| self.err(DatProblem::PastEnd(what)))?;
        let win_end = self.win_off + self.win.len() as u64;
        if self.pos < self.win_off || end > win_end {
            // Refill: at least 64 KiB, never past the end of the file.
            let want = (n as u64).max(64 << 10).min(self.src.len() - self.pos);
            self.win.resize(want as usize, 0);
            self.src.read_at(self.pos, &mut self.win, what)?;
            self.win_off = self.pos;
        }
        let s = (self.pos - self.win_off) as usize;
        self.pos = end;
        Ok(&self.win[s..s + n])
    }

    fn skip(&mut self, n: u64, what: &'static str) -> Result<(), DatError> {
        if n > self.remaining() {
            return Err(self.err(DatProblem::PastEnd(what)));
        }
        self.pos += n;
        Ok(())
    }
}
