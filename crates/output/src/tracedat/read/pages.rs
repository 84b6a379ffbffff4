//! One CPU's pages, read a batch at a time or decompressed a chunk at a time.

use crate::OutputError;

use super::input::Source;
use super::parse::{decompressor, unzstd_into};
use super::{CpuBuffer, Damage, TraceFile, MAX_META_DAMAGE};

/// Bytes of uncompressed CPU data read at a time, for all CPUs together (each CPU reads
/// at least one page at a time).
pub(super) const READ_BUDGET: usize = 1 << 20;
/// Most bytes a CPU reads at a time.
pub(super) const MAX_BATCH: usize = 128 << 10;
/// Decompressed chunk budget for all CPUs together (see [`max_chunk`]).
pub(super) const CHUNK_BUDGET: usize = 256 << 20;

/// Most buffer memory the readers of all CPUs may need together (see
/// [`read_memory`]); a file that would need more is refused at `open`.
pub const MAX_READ_MEMORY: u64 = 4 << 30;

/// The most buffer memory reading `readers` CPUs of data takes: per CPU a page buffer
/// and a read batch (uncompressed) or a decompressed chunk and its compressed input.
pub fn read_memory(readers: usize, page_size: usize, compressed: bool) -> u64 {
    let per = if compressed {
        let cap = max_chunk(readers, page_size);
        page_size + cap + zstd_bound(cap)
    } else {
        page_size + plain_batch(readers, page_size)
    };
    (readers as u64).saturating_mul(per as u64)
}

/// Bytes of uncompressed CPU data read at a time when `readers` CPUs are read: whole
/// pages, at least one, at most [`MAX_BATCH`], [`READ_BUDGET`] for all CPUs together.
pub(super) fn plain_batch(readers: usize, page_size: usize) -> usize {
    let pages = (READ_BUDGET / readers.max(1)).min(MAX_BATCH) / page_size.max(1);
    pages.max(1) * page_size
}

/// The largest decompressed v7 chunk accepted from a file with `cpus` CPUs of data and
/// pages of `page_size` bytes: at least 16 pages (trace-cmd writes 10), at most 16 MiB,
/// and `CHUNK_BUDGET` (256 MiB) for all CPUs together when that is more than 16 pages each.
pub fn max_chunk(cpus: usize, page_size: usize) -> usize {
    let share = CHUNK_BUDGET / cpus.max(1);
    share.min(16 << 20).max(page_size.saturating_mul(16))
}

/// The most a zstd frame of `n` bytes of content can take (zstd's ZSTD_COMPRESSBOUND).
pub(super) fn zstd_bound(n: usize) -> usize {
    n.saturating_add(n >> 8).saturating_add(64 << 10)
}

/// Reads one CPU's pages: uncompressed data a batch of pages at a time, or v7 zstd
/// chunks one at a time; each page is copied into one page buffer. A chunk that does
/// not decompress is skipped and data cut short by the end of the file ends the CPU,
/// each noted as a [`Damage`] ([`CpuPages::take_damage`]).
pub struct CpuPages {
    cpu: u32,
    /// Damage found and not taken yet (at most one per chunk read: taken after each
    /// page by [`Records`], bounded by [`MAX_META_DAMAGE`] for other callers).
    pub(super) damage: Vec<Damage>,
    src: Source,
    page_size: usize,
    /// Read or decompressed bytes not consumed yet: `buf[pos..]`.
    pub(super) buf: Vec<u8>,
    pos: usize,
    kind: StreamKind,
    pub(super) page: Vec<u8>,
    /// Pages handed out so far.
    pub(super) count: usize,
}

pub(super) enum StreamKind {
    Plain {
        next: u64,
        end: u64,
        batch: usize,
    },
    Zstd {
        /// File offset of the next chunk header, or of the chunk count before it is
        /// read (`None`: no more chunks).
        next: Option<u64>,
        counted: bool,
        left: u32,
        /// Chunks read so far (for the damage notes).
        index: u32,
        cap: usize,
        cbuf: Vec<u8>,
        /// Made at the first chunk.
        dec: Option<Box<zstd::bulk::Decompressor<'static>>>,
    },
}

impl CpuPages {
    pub(super) fn new(f: &TraceFile, b: &CpuBuffer, readers: usize) -> Self {
        let ps = f.page_size;
        let kind = if f.compressed {
            StreamKind::Zstd {
                next: (b.size > 0).then_some(b.offset),
                counted: false,
                left: 0,
                index: 0,
                cap: max_chunk(readers, ps),
                cbuf: Vec::new(),
                dec: None,
            }
        } else {
            StreamKind::Plain {
                next: b.offset,
                end: b.offset.saturating_add(b.size),
                batch: plain_batch(readers, ps),
            }
        };
        Self {
            cpu: b.cpu,
            damage: Vec::new(),
            src: f.src.clone(),
            page_size: ps,
            buf: Vec::new(),
            pos: 0,
            kind,
            page: Vec::new(),
            count: 0,
        }
    }

    /// Reads more bytes into `buf`; false at the end of the CPU's data.
    fn refill(&mut self) -> Result<bool, OutputError> {
        self.pos = 0;
        match &mut self.kind {
            StreamKind::Plain { next, end, batch } => {
                let n = (*end - *next).min(*batch as u64) as usize;
                if n == 0 {
                    self.buf.clear();
                    return Ok(false);
                }
                self.buf.resize(n, 0);
                self.src.read_at(*next, &mut self.buf, "cpu data")?;
                *next += n as u64;
                Ok(true)
            }
            StreamKind::Zstd { .. } => self.next_chunk(),
        }
    }

    /// Notes damage (bounded: past [`MAX_META_DAMAGE`] notes not taken, the oldest
    /// are kept).
    fn damaged(&mut self, offset: u64, what: String) {
        if self.damage.len() < MAX_META_DAMAGE {
            self.damage.push(Damage {
                cpu: Some(self.cpu),
                offset: Some(offset),
                what,
            });
        }
    }

    /// The damage found since the last call.
    pub fn take_damage(&mut self) -> Vec<Damage> {
        std::mem::take(&mut self.damage)
    }

    /// Decompresses the next good chunk into `buf`; false when there is none. A chunk
    /// that does not decompress is skipped (noted), reading goes on with the next one;
    /// a chunk count, chunk header or chunk cut short by the end of the file, or a
    /// header with impossible sizes (the next chunk cannot be found), ends the CPU
    /// (noted). Bounded: each chunk consumes at least its 8-byte header.
    fn next_chunk(&mut self) -> Result<bool, OutputError> {
        let file_len = self.src.len();
        let StreamKind::Zstd {
            next,
            counted,
            left,
            index,
            cap,
            cbuf,
            dec,
        } = &mut self.kind
        else {
            return Ok(false);
        };
        self.buf.clear();
        let mut note = None;
        let mut notes = Vec::new();
        let mut skipped = 0u64;
        while let Some(mut at) = *next {
            if !*counted {
                let mut w = [0u8; 4];
                if at.checked_add(4).is_none_or(|e| e > file_len) {
                    note = Some((
                        at,
                        if at >= file_len {
                            format!("cpu data at offset {at}, past the end of the file ({file_len} bytes): none of it is read")
                        } else {
                            "chunk count cut short by the end of the file".to_string()
                        },
                    ));
                    *next = None;
                    break;
                }
                self.src.read_at(at, &mut w, "chunk count")?;
                *left = u32::from_le_bytes(w);
                *counted = true;
                at += 4;
                *next = Some(at);
            }
            if *left == 0 {
                *next = None;
                break;
            }
            let cut = |n: u64| at.checked_add(n).is_none_or(|e| e > file_len);
            if cut(8) {
                note = Some((at, format!("cut short by the end of the file: chunk {index} header and {left} chunks missing")));
                *next = None;
                break;
            }
            let mut h = [0u8; 8];
            self.src.read_at(at, &mut h, "chunk header")?;
            let cs = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let us = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
            if us > *cap || cs > zstd_bound(*cap) {
                note = Some((at, format!("chunk {index} header damaged ({cs} bytes compressed, {us} uncompressed): it and the {} chunks after it are skipped", *left - 1)));
                *next = None;
                break;
            }
            if cut(8 + cs as u64) {
                note = Some((at, format!("chunk {index} ({us} bytes, {} pages) cut short by the end of the file: it and the {} chunks after it are missing", us / self.page_size, *left - 1)));
                *next = None;
                break;
            }
            cbuf.resize(cs, 0);
            self.src.read_at(at + 8, cbuf, "chunk data")?;
            let d = match dec {
                Some(d) => d,
                None => dec.insert(Box::new(decompressor(at)?)),
            };
            let r = unzstd_into(d, cbuf, us, &mut self.buf, at + 8);
            *left -= 1;
            *index += 1;
            *next = Some(at + 8 + cs as u64);
            if let Err(e) = r {
                self.buf.clear();
                let what = format!(
                    "chunk {} damaged ({e}): skipped its {us} bytes ({} pages), reading goes on with the next chunk",
                    *index - 1,
                    us / self.page_size
                );
                if notes.len() < MAX_META_DAMAGE {
                    notes.push((at, what));
                } else {
                    skipped += 1;
                }
                continue;
            }
            break;
        }
        let more = !self.buf.is_empty();
        if skipped > 0 {
            let at = next.unwrap_or(0);
            notes.push((at, format!("{skipped} more damaged chunks skipped")));
        }
        for (at, what) in notes.into_iter().chain(note) {
            self.damaged(at, what);
        }
        Ok(more)
    }

    /// The next whole page, or `None` at the end (a trailing partial page is ignored).
    pub fn next_page(&mut self) -> Result<Option<&[u8]>, OutputError> {
        let ps = self.page_size;
        self.page.resize(ps, 0);
        let mut have = 0;
        // Bounded: every refill consumes file bytes (a batch, or a chunk header).
        while have < ps {
            if self.pos >= self.buf.len() {
                if !self.refill()? {
                    return Ok(None);
                }
                continue;
            }
            let n = (ps - have).min(self.buf.len() - self.pos);
            self.page[have..have + n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            have += n;
            self.pos += n;
        }
        self.count += 1;
        Ok(Some(&self.page))
    }
}
