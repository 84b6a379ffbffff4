//! One CPU's pages, read a batch at a time or decompressed a chunk at a time, each
//! page handed out in place (no copy).

use std::sync::{Arc, Mutex};

use crate::DatError;

use super::budget::{check_block, decompressor, max_chunk, plain_batch, unzstd_into};
use super::input::Source;
use super::{CpuBuffer, Damage, TraceFile, MAX_META_DAMAGE};

/// What the CPUs of a file share to decompress their chunks, one at a time: one zstd
/// context and the compressed input of the chunk being decompressed.
#[derive(Default)]
pub(super) struct Unzstd {
    dec: Option<zstd::bulk::Decompressor<'static>>,
    input: Vec<u8>,
}

impl Unzstd {
    /// Decompresses chunk `i` at `at` of `cs` bytes (its header says `us` bytes,
    /// [`check_block`] accepted them) into `out`, whole `ps`-byte pages; returns the note
    /// when it is damaged (skipped: `out` is empty) or loses a partial last page.
    fn chunk(
        &mut self,
        src: &Source,
        at: u64,
        i: u32,
        (cs, us): (usize, usize),
        ps: usize,
        out: &mut Vec<u8>,
    ) -> Result<Option<String>, DatError> {
        self.input.resize(cs, 0);
        src.read_at(at + 8, &mut self.input, "chunk data")?;
        let d = match &mut self.dec {
            Some(d) => d,
            None => self.dec.insert(decompressor(at)?),
        };
        if let Err(e) = unzstd_into(d, &self.input, us, out, at + 8) {
            out.clear();
            let e = crate::error_chain(&e);
            return Ok(Some(format!("chunk {i} damaged ({e}): skipped its {us} bytes ({} pages), reading goes on with the next chunk", us / ps)));
        }
        if us.is_multiple_of(ps) {
            return Ok(None);
        }
        out.truncate(us - us % ps);
        Ok(Some(format!(
            "chunk {i} of {us} bytes is not whole {ps}-byte pages: its last {} bytes are skipped",
            us % ps
        )))
    }
}

impl std::fmt::Debug for Unzstd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Unzstd({} bytes of input)", self.input.capacity())
    }
}

/// Reads one CPU's pages: uncompressed data a batch of whole pages at a time, or v7
/// zstd chunks one at a time (one decompression context shared by the file's CPUs),
/// each page handed out where it lies in the batch or chunk. A chunk that is refused or
/// does not decompress is skipped, and data cut short ends the CPU, each noted as a
/// [`Damage`] ([`CpuPages::take_damage`]). Memory: one batch or one chunk (at most
/// [`max_chunk`]).
pub struct CpuPages {
    cpu: u32,
    /// Damage found and not taken yet (at most one per chunk read: taken after each
    /// page by [`super::Records`], bounded by [`MAX_META_DAMAGE`] for other callers).
    pub(super) damage: Vec<Damage>,
    src: Source,
    page_size: usize,
    /// Read or decompressed whole pages: the current one at `buf[cur..cur + page_size]`,
    /// the next at `pos`.
    pub(super) buf: Vec<u8>,
    pos: usize,
    cur: Option<usize>,
    kind: StreamKind,
    /// Pages handed out so far.
    pub(super) count: usize,
}

enum StreamKind {
    Plain {
        next: u64,
        /// End of the CPU's whole pages.
        end: u64,
        batch: usize,
    },
    Zstd {
        /// File offset of the next chunk header, or of the chunk count before it is
        /// read (`None`: no more chunks).
        next: Option<u64>,
        /// Where the CPU's data ends: its declared size, or the end of the file.
        end: u64,
        counted: bool,
        left: u32,
        /// Chunks read so far (for the damage notes).
        index: u32,
        cap: usize,
        unzstd: Arc<Mutex<Unzstd>>,
    },
}

impl CpuPages {
    pub(super) fn new(f: &TraceFile, b: &CpuBuffer, readers: usize) -> Self {
        let ps = f.page_size as u64;
        let kind = if f.compressed {
            StreamKind::Zstd {
                next: (b.size > 0).then_some(b.offset),
                end: b.end(true, f.src.len()),
                counted: false,
                left: 0,
                index: 0,
                cap: max_chunk(readers),
                unzstd: f.unzstd.clone(),
            }
        } else {
            StreamKind::Plain {
                next: b.offset,
                end: b.offset.saturating_add(b.size - b.size % ps),
                batch: plain_batch(readers, f.page_size),
            }
        };
        Self {
            cpu: b.cpu,
            damage: Vec::new(),
            src: f.src.clone(),
            page_size: f.page_size,
            buf: Vec::new(),
            pos: 0,
            cur: None,
            kind,
            count: 0,
        }
    }

    /// Reads more whole pages into `buf`; false at the end of the CPU's data.
    fn refill(&mut self) -> Result<bool, DatError> {
        self.pos = 0;
        self.cur = None;
        match &mut self.kind {
            StreamKind::Plain { next, end, batch } => {
                let n = end.saturating_sub(*next).min(*batch as u64) as usize;
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

    /// Decompresses the next good chunk's whole pages into `buf`; false when there is
    /// none. A chunk refused by [`check_block`] (more than [`max_chunk`], or a ratio no
    /// real trace reaches) or that does not decompress is skipped (noted), reading goes
    /// on with the next one; a chunk count, chunk header or chunk cut short by the end
    /// of the CPU's data or of the file ends the CPU (noted). A chunk that is not whole
    /// pages loses its partial last page (noted). Bounded: each chunk consumes at least
    /// its 8-byte header of the CPU's data.
    fn next_chunk(&mut self) -> Result<bool, DatError> {
        let (ps, file_len) = (self.page_size, self.src.len());
        let StreamKind::Zstd {
            next,
            end,
            counted,
            left,
            index,
            cap,
            unzstd,
        } = &mut self.kind
        else {
            return Ok(false);
        };
        self.buf.clear();
        let mut z = unzstd.lock().unwrap_or_else(|e| e.into_inner());
        let by = if *end == file_len {
            "the end of the file"
        } else {
            "the end of the cpu data the buffer option gives"
        };
        let (mut notes, mut skipped, mut more) = (Vec::new(), 0u64, false);
        // One note kept for the count of the rest.
        let mut note = |at: u64, what: String| {
            if notes.len() + 1 < MAX_META_DAMAGE {
                notes.push((at, what));
            } else {
                skipped += 1;
            }
        };
        while let Some(mut at) = *next {
            let end = *end;
            let cut = |at: u64, n: u64| at.checked_add(n).is_none_or(|e| e > end);
            if !*counted {
                if cut(at, 4) {
                    note(
                        at,
                        if at >= file_len {
                            format!("cpu data at offset {at}, past the end of the file ({file_len} bytes): none of it is read")
                        } else {
                            format!("chunk count cut short by {by}")
                        },
                    );
                    *next = None;
                    break;
                }
                let mut w = [0u8; 4];
                self.src.read_at(at, &mut w, "chunk count")?;
                (*left, *counted) = (u32::from_le_bytes(w), true);
                at += 4;
                *next = Some(at);
            }
            if *left == 0 {
                *next = None;
                break;
            }
            if cut(at, 8) {
                note(
                    at,
                    format!("cut short by {by}: chunk {index} header and {left} chunks missing"),
                );
                *next = None;
                break;
            }
            let mut h = [0u8; 8];
            self.src.read_at(at, &mut h, "chunk header")?;
            let cs = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let us = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
            if cut(at, 8 + cs as u64) {
                note(at, format!("chunk {index} ({us} bytes, {} pages) cut short by {by}: it and the {} chunks after it are missing", us / ps, *left - 1));
                *next = None;
                break;
            }
            let i = *index;
            (*left, *index, *next) = (*left - 1, i + 1, Some(at + 8 + cs as u64));
            if let Some(why) = check_block(cs, us, *cap) {
                note(
                    at,
                    format!("chunk {i} {why}: skipped, reading goes on with the next chunk"),
                );
                continue;
            }
            if let Some(what) = z.chunk(&self.src, at, i, (cs, us), ps, &mut self.buf)? {
                note(at, what);
            }
            if !self.buf.is_empty() {
                more = true;
                break;
            }
        }
        if skipped > 0 {
            notes.push((
                next.unwrap_or(0),
                format!("{skipped} more damaged chunks skipped"),
            ));
        }
        drop(z);
        for (at, what) in notes {
            self.damaged(at, what);
        }
        Ok(more)
    }

    /// The CPU whose pages these are (its number in its buffer).
    pub fn cpu(&self) -> u32 {
        self.cpu
    }

    /// The next whole page, or `None` at the end.
    pub fn next_page(&mut self) -> Result<Option<&[u8]>, DatError> {
        // Bounded: every refill consumes file bytes (a batch, or a chunk header).
        while self.pos + self.page_size > self.buf.len() {
            if !self.refill()? {
                return Ok(None);
            }
        }
        self.cur = Some(self.pos);
        self.pos += self.page_size;
        self.count += 1;
        Ok(Some(self.page()))
    }

    /// The page [`CpuPages::next_page`] handed out last (empty before the first and
    /// after the end).
    pub fn page(&self) -> &[u8] {
        match self.cur {
            Some(at) => &self.buf[at..at + self.page_size],
            None => &[],
        }
    }
}
