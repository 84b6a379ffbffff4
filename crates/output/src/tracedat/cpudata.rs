//! The CPU data of a trace.dat being written, while the run goes on.
//!
//! Each CPU's pages are exported straight into the CPU's pending buffer (the one copy of
//! a page on the sink's thread, [`CpuData::slot`]), and a full buffer is handed on —
//! uncompressed in one `write(2)` of [`BATCH_BYTES`], or as
//! [`BATCH_CHUNKS`](super::params::BATCH_CHUNKS) zstd chunk records of
//! [`ZSTD_CHUNK_PAGES`](super::params::ZSTD_CHUNK_PAGES) pages compressed by a worker
//! thread ([`super::zpool`]) that writes them too. A buffer's guest strings are made safe
//! (G2, [`StringFields::sanitize_pages`]) as it is handed on — by the worker that
//! compresses it, for zstd. A buffer is handed on only when the CPU's next page arrives,
//! so the CPU's last page is always in memory
//! ([`CpuData::last_page`], for `trailing_lost`; its timestamps are all it is read for).
//!
//! Where a buffer goes ([`CpuOut`]): when the output is a regular file (written under a
//! temporary name, so it can be written at any offset), one CPU at a time — the first
//! to hand a buffer on, then, once it has ended ([`CpuData::end_cpu`]), the next one to
//! start — writes straight into the output at its final place: the data is written
//! once, not spilled and copied. The CPU data starts after room for the largest
//! metadata the trace can have (`head::bound`), which is written last. Every other CPU
//! goes to its spill file, copied after the others at the end; so does every CPU of an
//! output written in order (a device, a FIFO, stdout). Which CPU goes where is decided
//! on the sink's thread, in page order: the file is the same whatever the threads do.

use crate::error::PageProblem;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use super::cpuout::{CpuOut, Zstd, ZSTD_CATCH_UP_LEVEL, ZSTD_LEVEL};
use super::head::align_up;
use super::params::{batch_chunks, chunk_pages, Compression};
use super::strings::StringFields;
use super::zpool::{DirectTo, ZPool};
use crate::target::OutputTarget;
use crate::OutputError;

/// Most compression worker threads of one sink (also at most one per core).
const ZSTD_MAX_WORKERS: usize = 8;
/// Bytes of pages an uncompressed CPU gathers before one `write(2)`.
const BATCH_BYTES: usize = 1 << 20;
/// Where full buffers go.
enum Sink {
    /// Written on the sink's thread: uncompressed pages, or zstd chunks compressed here
    /// (no worker thread could be made).
    Here {
        outs: Vec<CpuOut>,
        zstd: Option<Zstd>,
    },
    /// zstd chunks handed to the workers, which write them.
    Pool(ZPool),
}

/// A CPU's pages not handed on yet: `buf[..len]` (`buf` is allocated once at its full
/// size and reused: a page costs no allocation and no zeroing).
#[derive(Default)]
struct Pending {
    buf: Vec<u8>,
    len: usize,
    /// Where its data goes is decided (its first buffer was handed on).
    placed: bool,
    /// No more pages come ([`CpuData::end_cpu`]).
    ended: bool,
}

/// The output file's tail, written by one CPU at a time (see the module).
pub(super) struct Tail {
    file: File,
    path: PathBuf,
    /// Where the next CPU to write here starts (page aligned).
    next: u64,
    /// The CPU writing here now, and where its data starts.
    owner: Option<(usize, u64)>,
}

impl Tail {
    /// The tail of output `file` (`path`), the CPU data from `data_start` on.
    pub(super) fn new(file: File, path: PathBuf, data_start: u64) -> Self {
        Self {
            file,
            path,
            next: data_start,
            owner: None,
        }
    }
}

/// The CPU data of a trace.dat being written (see the module).
pub(super) struct CpuData {
    page_size: usize,
    /// zstd: each CPU's data starts with its chunk count (u32).
    prefix: usize,
    /// The string fields made safe in every page (G2), and the bytes replaced on this
    /// thread.
    strings: Arc<StringFields>,
    replaced: u64,
    /// Bytes a pending buffer holds before it is handed on (whole pages).
    cap: usize,
    pending: Vec<Pending>,
    sink: Sink,
    tail: Option<Tail>,
    /// Live rings feed the sink: a chunk may go at the catch-up level.
    live: bool,
}

/// The CPU data once every page is written.
pub(super) struct Finished {
    /// Each CPU's data (index = CPU), flushed.
    pub(super) outs: Vec<CpuOut>,
    /// The output file (positioned writes) and where the data written straight into it
    /// ends (page aligned); `None` for an output written in order.
    pub(super) tail: Option<(File, u64)>,
    /// zstd chunks that went at the catch-up level.
    pub(super) caught_up: u64,
    /// Bytes of guest strings replaced (G2).
    pub(super) replaced: u64,
}

impl CpuData {
    /// The CPU data of `nr_cpus` CPUs for `target`: spill files, the output's `tail`
    /// when it can be written at any offset, and for zstd the workers (one per core, at
    /// most [`ZSTD_MAX_WORKERS`]); `strings` are the string fields of the trace's
    /// events.
    pub(super) fn new(
        target: &OutputTarget,
        nr_cpus: u32,
        page_size: usize,
        compression: Compression,
        strings: StringFields,
        tail: Option<Tail>,
    ) -> Result<Self, OutputError> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = cores.min(ZSTD_MAX_WORKERS);
        let strings = Arc::new(strings);
        let outs = (0..nr_cpus)
            .map(|cpu| CpuOut::new(target, cpu))
            .collect::<Result<Vec<_>, _>>()?;
        let (cap, sink) = match compression {
            Compression::None => (
                BATCH_BYTES.max(page_size) / page_size * page_size,
                Sink::Here { outs, zstd: None },
            ),
            Compression::Zstd => {
                let chunk = page_size * chunk_pages(page_size);
                let z = Zstd::new(chunk, batch_chunks(chunk))?;
                let pool = match workers {
                    0 => Err(outs),
                    n => ZPool::new(outs, n, &z, Arc::clone(&strings), page_size),
                };
                let sink = match pool {
                    Ok(p) => Sink::Pool(p),
                    Err(outs) => Sink::Here {
                        outs,
                        zstd: Some(z),
                    },
                };
                (chunk * batch_chunks(chunk), sink)
            }
        };
        Ok(Self {
            page_size,
            prefix: if compression == Compression::Zstd {
                4
            } else {
                0
            },
            strings,
            replaced: 0,
            cap,
            pending: (0..nr_cpus).map(|_| Pending::default()).collect(),
            sink,
            tail,
            live: false,
        })
    }

    /// Compresses on the caller's thread from now on (before the first page; tests).
    #[cfg(test)]
    pub(super) fn without_workers(&mut self) -> Result<(), OutputError> {
        if let Sink::Pool(_) = self.sink {
            let Sink::Pool(pool) = std::mem::replace(
                &mut self.sink,
                Sink::Here {
                    outs: Vec::new(),
                    zstd: None,
                },
            ) else {
                return Ok(());
            };
            let (outs, _) = pool.finish()?;
            let chunk = self.page_size * chunk_pages(self.page_size);
            let zstd = Some(Zstd::new(chunk, batch_chunks(chunk))?);
            self.sink = Sink::Here { outs, zstd };
        }
        Ok(())
    }

    /// Live rings feed the sink: when the workers fall behind, chunks go at the
    /// catch-up level (`zpool`).
    pub(super) fn set_live(&mut self) {
        self.live = true;
    }

    /// Whether CPU `cpu` has ended ([`CpuData::end_cpu`]).
    pub(super) fn ended(&self, cpu: usize) -> bool {
        self.pending.get(cpu).is_some_and(|p| p.ended)
    }

    /// CPU `cpu`'s pending pages, if it may still get pages.
    fn open_cpu(&mut self, cpu: usize) -> Result<&mut Pending, OutputError> {
        match self.pending.get_mut(cpu) {
            Some(p) if !p.ended => Ok(p),
            Some(_) => Err(bad_cpu(cpu, PageProblem::Ended)),
            None => Err(bad_cpu(cpu, PageProblem::NoData)),
        }
    }

    /// Room for CPU `cpu`'s next page after its pending pages (which are handed on
    /// first if the buffer is full); [`CpuData::commit`] keeps what was written there.
    pub(super) fn slot(&mut self, cpu: usize) -> Result<&mut [u8], OutputError> {
        let (ps, cap) = (self.page_size, self.cap);
        if self.open_cpu(cpu)?.len + ps > cap {
            self.hand_on(cpu)?;
        }
        let p = self.open_cpu(cpu)?;
        if p.buf.len() < cap {
            p.buf.resize(cap, 0);
        }
        Ok(&mut p.buf[p.len..p.len + ps])
    }

    /// Keeps the page written into CPU `cpu`'s [`CpuData::slot`].
    pub(super) fn commit(&mut self, cpu: usize) {
        if let Some(p) = self.pending.get_mut(cpu) {
            p.len = (p.len + self.page_size).min(p.buf.len());
        }
    }

    /// CPU `cpu`'s last page (`None` before its first, or once it has ended).
    pub(super) fn last_page(&self, cpu: usize) -> Option<&[u8]> {
        let p = self.pending.get(cpu)?;
        p.buf.get(p.len.checked_sub(self.page_size)?..p.len)
    }

    /// Where CPU `cpu`'s data goes, decided as its first buffer is handed on: straight
    /// into the output if no other CPU writes there now.
    fn place(&mut self, cpu: usize) -> Result<Option<DirectTo>, OutputError> {
        let Some(t) = self.tail.as_mut() else {
            return Ok(None);
        };
        if t.owner.is_some() {
            return Ok(None);
        }
        let file = t
            .file
            .try_clone()
            .map_err(|e| OutputError::io(&t.path, e))?;
        t.owner = Some((cpu, t.next));
        Ok(Some(DirectTo {
            file,
            path: t.path.clone(),
            start: t.next,
            prefix: self.prefix,
        }))
    }

    /// Hands CPU `cpu`'s pending pages on.
    fn hand_on(&mut self, cpu: usize) -> Result<(), OutputError> {
        let Some(p) = self.pending.get_mut(cpu) else {
            return Ok(());
        };
        if p.len == 0 {
            return Ok(());
        }
        let first = !std::mem::replace(&mut p.placed, true);
        let direct = if first { self.place(cpu)? } else { None };
        let p = &mut self.pending[cpu];
        let len = std::mem::take(&mut p.len);
        match &mut self.sink {
            Sink::Here { outs, zstd } => {
                let Some(o) = outs.get_mut(cpu) else {
                    return Ok(());
                };
                if let Some(d) = direct {
                    o.go_direct(d.file, &d.path, d.start, d.prefix)?;
                }
                let page_size = self.page_size;
                self.replaced += self.strings.sanitize_pages(&mut p.buf[..len], page_size);
                match zstd {
                    Some(z) => z.chunks(&p.buf[..len], ZSTD_LEVEL, o),
                    None => o.append(&p.buf[..len]),
                }
            }
            Sink::Pool(pool) => {
                let data = std::mem::replace(&mut p.buf, pool.buffer());
                let catch_up = self.live.then_some(ZSTD_CATCH_UP_LEVEL);
                pool.submit(cpu, data, len, ZSTD_LEVEL, catch_up, direct)
            }
        }
    }

    /// CPU `cpu` gets no more pages: its pending pages are handed on, and if it wrote
    /// straight into the output, the next CPU to start may write there after it (again:
    /// nothing more).
    pub(super) fn end_cpu(&mut self, cpu: usize) -> Result<(), OutputError> {
        if self.ended(cpu) {
            return Ok(());
        }
        self.open_cpu(cpu)?;
        self.hand_on(cpu)?;
        self.pending[cpu].ended = true;
        let Some((owner, start)) = self.tail.as_ref().and_then(|t| t.owner) else {
            return Ok(());
        };
        if owner != cpu {
            return Ok(());
        }
        let bytes = match &mut self.sink {
            Sink::Here { outs, .. } => outs.get(cpu).map_or(0, |o| o.bytes),
            Sink::Pool(pool) => pool.settle_cpu(cpu)?,
        };
        if let Some(t) = self.tail.as_mut() {
            let end = start + self.prefix as u64 + bytes;
            t.next = align_up(end, self.page_size as u64);
            t.owner = None;
        }
        Ok(())
    }

    /// Hands on every pending page and waits for the workers: every CPU's data,
    /// complete.
    pub(super) fn finish(mut self) -> Result<Finished, OutputError> {
        for cpu in 0..self.pending.len() {
            self.hand_on(cpu)?;
        }
        let (mut outs, caught_up, replaced) = match self.sink {
            Sink::Here { outs, .. } => (outs, 0, self.replaced),
            Sink::Pool(pool) => {
                let caught_up = pool.caught_up;
                let (outs, replaced) = pool.finish()?;
                (outs, caught_up, replaced)
            }
        };
        for o in &mut outs {
            o.flush()?;
        }
        let page = self.page_size as u64;
        let prefix = self.prefix as u64;
        let tail = self.tail.map(|t| {
            let end = match t.owner {
                Some((cpu, start)) => {
                    let bytes = outs.get(cpu).map_or(0, |o| o.bytes);
                    align_up(start + prefix + bytes, page)
                }
                None => t.next,
            };
            (t.file, end)
        });
        Ok(Finished {
            outs,
            tail,
            caught_up,
            replaced,
        })
    }
}

/// A page CPU `cpu` cannot take.
fn bad_cpu(cpu: usize, problem: PageProblem) -> OutputError {
    OutputError::BadPage {
        cpu: u32::try_from(cpu).unwrap_or(u32::MAX),
        problem,
    }
}
