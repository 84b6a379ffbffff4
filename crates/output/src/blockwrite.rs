//! Sequential writes into a file past the page cache ([`BlockWriter`]): whole aligned
//! blocks go through a second descriptor of the file opened with `O_DIRECT`, the
//! unaligned edges (a start inside a block, the tail) through the page cache.
//!
//! Why (issue 37, docs/benchmarks.md "Output past the page cache"): a buffered write
//! copies every byte into page-cache pages, and on the machines this project runs on —
//! virtual machines themselves — fresh page-cache memory is faulted in by the
//! hypervisor below: that copy ran at 0.6–0.9 GB/s, on the core the reader needs, and a
//! record at a quarter of the writer's rate waited seconds for its output. A direct
//! write hands the buffer to the device (1.4–1.7 GB/s here) with no copy and no dirty
//! pages for the kernel's flusher threads to write back later.
//!
//! Where the file system refuses `O_DIRECT` (the reopen fails, or a write returns
//! `EINVAL`), every write goes through the page cache instead: only the speed differs.
//! Every byte is written once at its offset, or rewritten with the same bytes (a tail
//! written by [`BlockWriter::flush`] is written again with the block it begins), so a
//! fallback in the middle of a block never changes what the file holds.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

/// Alignment of a direct write's memory, length and file offset: the page size, a
/// multiple of the logical block size of the devices Linux runs on.
const ALIGN: usize = 4096;

/// Bytes buffered past the page cache: one direct write when full (4 MiB wrote 1.4 GB/s
/// here where 1 MiB wrote 1.1–1.4, one write at a time).
const BLOCK: usize = 4 << 20;
/// Bytes buffered through the page cache (`BufWriter`'s size before).
const CACHED_BLOCK: usize = 1 << 20;

/// What a [`BlockWriter`] writes into: something holding an open file.
pub(crate) trait HasFile {
    /// The file (opened for writing).
    fn file(&self) -> &File;
}

impl HasFile for File {
    fn file(&self) -> &File {
        self
    }
}

/// A buffered writer of a byte stream into a file from an offset on, whole aligned
/// blocks past the page cache. [`Write::flush`] writes everything buffered (the tail
/// through the page cache) and keeps the tail, so writing on after it keeps the blocks
/// aligned.
pub(crate) struct BlockWriter<T> {
    inner: T,
    /// The file again, opened with `O_DIRECT`; `None` where that is refused.
    direct: Option<File>,
    /// `cap + ALIGN` bytes: the buffer is `mem[base..base + cap]`, aligned.
    mem: Vec<u8>,
    base: usize,
    cap: usize,
    /// File offset of the buffer's first byte.
    pos: u64,
    /// Bytes buffered.
    len: usize,
}

impl<T: HasFile> BlockWriter<T> {
    /// Writes into `inner`'s file from offset `start` on; whole blocks past the page
    /// cache if `direct` and the file system allows it.
    pub(crate) fn new(inner: T, start: u64, direct: bool) -> Self {
        let direct = direct.then(|| reopen_direct(inner.file())).flatten();
        let cap = if direct.is_some() {
            BLOCK
        } else {
            CACHED_BLOCK
        };
        let mem = vec![0u8; cap + ALIGN];
        // `align_offset` of a u8 pointer to a power of two is always computable.
        let base = mem.as_ptr().align_offset(ALIGN);
        Self {
            inner,
            direct,
            mem,
            base,
            cap,
            pos: start,
            len: 0,
        }
    }

    /// What is written into.
    pub(crate) fn get_ref(&self) -> &T {
        &self.inner
    }

    /// What is written into (writing through it must not overlap this stream).
    pub(crate) fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// Writes out everything buffered and gives back what was written into.
    pub(crate) fn into_inner(mut self) -> io::Result<T> {
        self.flush()?;
        Ok(self.inner)
    }

    /// What was written into, the buffered bytes dropped (a failed output).
    pub(crate) fn into_discarded(self) -> T {
        self.inner
    }

    /// Whether whole blocks go past the page cache (for tests and diagnostics).
    #[cfg(test)]
    fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Writes out what can go in aligned pieces: the head up to an aligned offset
    /// through the page cache (once: the start), then every whole aligned piece past
    /// it; less than `ALIGN` bytes stay buffered.
    fn drain(&mut self) -> io::Result<()> {
        let mis = (self.pos % ALIGN as u64) as usize;
        if mis != 0 {
            let head = (ALIGN - mis).min(self.len);
            self.inner
                .file()
                .write_all_at(&self.mem[self.base..self.base + head], self.pos)?;
            self.consume(head);
        }
        let whole = self.len / ALIGN * ALIGN;
        if whole > 0 {
            self.write_aligned(whole)?;
            self.consume(whole);
        }
        Ok(())
    }

    /// Writes the first `n` buffered bytes (`pos` and `n` aligned): past the page cache
    /// if it can, else — from the first refusal on — through it.
    fn write_aligned(&mut self, n: usize) -> io::Result<()> {
        let bytes = &self.mem[self.base..self.base + n];
        if let Some(d) = &self.direct {
            match d.write_all_at(bytes, self.pos) {
                Ok(()) => return Ok(()),
                // The file system's refusal (alignment, no O_DIRECT): the same bytes
                // through the page cache, from the block's start.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.direct = None,
                Err(e) => return Err(e),
            }
        }
        self.inner.file().write_all_at(bytes, self.pos)
    }

    /// Drops the first `n` buffered bytes (written), moving the rest to the start.
    fn consume(&mut self, n: usize) {
        let (b, len) = (self.base, self.len);
        self.mem.copy_within(b + n..b + len, b);
        self.pos += n as u64;
        self.len -= n;
    }
}

impl<T: HasFile> Write for BlockWriter<T> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.len == self.cap {
            self.drain()?;
        }
        // Through the page cache, a write as large as the buffer goes straight through
        // (as `BufWriter` does: no copy of a batch of pages).
        if self.direct.is_none() && self.len == 0 && buf.len() >= self.cap {
            self.inner.file().write_all_at(buf, self.pos)?;
            self.pos += buf.len() as u64;
            return Ok(buf.len());
        }
        let n = (self.cap - self.len).min(buf.len());
        let at = self.base + self.len;
        self.mem[at..at + n].copy_from_slice(&buf[..n]);
        self.len += n;
        Ok(n)
    }

    /// Writes everything buffered; the unaligned tail (through the page cache) stays
    /// buffered too, to be written again with the block it begins.
    fn flush(&mut self) -> io::Result<()> {
        self.drain()?;
        if self.len > 0 {
            self.inner
                .file()
                .write_all_at(&self.mem[self.base..self.base + self.len], self.pos)?;
        }
        Ok(())
    }
}

/// `file` opened again for writing with `O_DIRECT` (through `/proc/self/fd`: the same
/// file, whatever its name now); `None` if that is refused.
fn reopen_direct(file: &File) -> Option<File> {
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// Pseudo-random bytes (xorshift), reproducible from `seed`.
    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn contents(f: &mut File) -> Vec<u8> {
        let mut v = Vec::new();
        io::Seek::seek(f, io::SeekFrom::Start(0)).unwrap();
        f.read_to_end(&mut v).unwrap();
        v
    }

    /// Whatever the start, the write sizes and the flushes between them, the file holds
    /// the stream at its offset, bytes before it untouched — past the page cache or not.
    #[test]
    fn the_file_holds_the_stream_at_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (0u64, 3 * BLOCK + 17, 4096usize),
            (13, 2 * BLOCK + 5000, 777),
            (4095, BLOCK, BLOCK + 3),
            (4096, 3 * BLOCK, 1 << 16),
            (BLOCK as u64 + 100, 5 * 4096 + 1, 1),
            (7, 10, 3),
        ];
        for (i, &(start, total, step)) in cases.iter().enumerate() {
            for direct in [true, false] {
                let path = dir.path().join(format!("f{i}{direct}"));
                let mut f = File::options()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&path)
                    .unwrap();
                let before = bytes(99, start as usize);
                f.write_all_at(&before, 0).unwrap();
                let data = bytes(i as u64 + 1, total);
                let mut w = BlockWriter::new(f.try_clone().unwrap(), start, direct);
                assert!(direct || !w.is_direct());
                for (k, piece) in data.chunks(step).enumerate() {
                    w.write_all(piece).unwrap();
                    if k % 97 == 5 {
                        w.flush().unwrap();
                    }
                }
                drop(w.into_inner().unwrap());
                let got = contents(&mut f);
                assert_eq!(got.len(), before.len() + data.len(), "case {i}");
                assert!(got[..before.len()] == before[..], "case {i}: head");
                assert!(got[before.len()..] == data[..], "case {i}: stream");
            }
        }
    }

    /// On a file system that takes `O_DIRECT` (the build's, as here), whole blocks go
    /// past the page cache: the reopen succeeds and survives a stream's writes.
    #[test]
    fn whole_blocks_go_direct_where_the_file_system_allows() {
        let dir = tempfile::tempdir().unwrap();
        let f = tempfile::tempfile_in(dir.path()).unwrap();
        let mut w = BlockWriter::new(f, 0, true);
        if !w.is_direct() {
            eprintln!("SKIP: this file system refuses O_DIRECT");
            return;
        }
        w.write_all(&bytes(5, 2 * BLOCK)).unwrap();
        assert!(w.is_direct(), "a direct write was refused");
    }
}
