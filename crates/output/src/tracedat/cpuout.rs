//! Where one CPU's data of a trace.dat goes while the run goes on ([`CpuOut`]): its
//! spill file, or — for the CPU that holds the output's tail (`cpudata`) — straight
//! into the output file, at its final place; and the zstd compressor that turns a
//! buffer of pages into one of trace-cmd's chunk records ([`Zstd`]).

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::blockwrite::BlockWriter;
use crate::target::{OutputTarget, Temp};
use crate::OutputError;

/// zstd level of the CPU data and the metadata sections: trace-cmd's (libzstd's default,
/// 3 — trace-cmd sets no level). On trace pages it costs no more CPU than the fast
/// levels (-1 to -15 compress marker pages at the same ~600 MB/s on this project's
/// machines, docs/benchmarks.md "trace.dat sink") and writes the smallest file of them.
pub(super) const ZSTD_LEVEL: i32 = 3;
/// zstd level of a chunk handed over while the workers are behind on a live run
/// (`zpool`): stores at several GB/s (ratio about 1.0).
pub(super) const ZSTD_CATCH_UP_LEVEL: i32 = -1000;

/// Where a CPU's bytes go.
enum Dest {
    /// Its spill file, copied into the output at the end.
    Spill(BlockWriter<Temp>),
    /// The output itself, from `start` (`path`: the output's, for errors).
    Direct {
        w: BlockWriter<File>,
        start: u64,
        path: PathBuf,
    },
}

/// One CPU's data as it will be in the trace.dat (pages, or chunk records), without the
/// zstd chunk count.
pub(super) struct CpuOut {
    dest: Dest,
    /// Bytes written.
    pub(super) bytes: u64,
    /// zstd: chunk records written.
    pub(super) chunks: u32,
    /// The CPU (for errors).
    cpu: u32,
    /// Whole blocks past the page cache ([`OutputTarget::is_direct_io`]).
    direct_io: bool,
}

impl CpuOut {
    /// CPU `cpu`'s spill file for `target` (its data goes there unless it is sent
    /// straight into the output before its first byte, [`CpuOut::go_direct`]).
    pub(super) fn new(target: &OutputTarget, cpu: u32) -> Result<Self, OutputError> {
        let f = target.spill(&format!(".cpu{cpu}"))?;
        Ok(Self {
            dest: Dest::Spill(BlockWriter::new(f, 0, target.is_direct_io())),
            bytes: 0,
            chunks: 0,
            cpu,
            direct_io: target.is_direct_io(),
        })
    }

    /// Sends the CPU's data straight into the output file `file` (`path`), from `start`
    /// on, after `prefix` zero bytes (room for the zstd chunk count); its spill file is
    /// removed. Only before its first byte.
    pub(super) fn go_direct(
        &mut self,
        file: File,
        path: &Path,
        start: u64,
        prefix: usize,
    ) -> Result<(), OutputError> {
        if self.bytes != 0 {
            return Err(OutputError::Moved(self.cpu));
        }
        let mut w = BlockWriter::new(file, start, self.direct_io);
        w.write_all(&[0u8; 8][..prefix.min(8)])
            .map_err(|e| OutputError::io(path, e))?;
        self.dest = Dest::Direct {
            w,
            start,
            path: path.to_path_buf(),
        };
        Ok(())
    }

    /// Where the data starts in the output, when it goes straight there.
    pub(super) fn direct_start(&self) -> Option<u64> {
        match &self.dest {
            Dest::Direct { start, .. } => Some(*start),
            Dest::Spill(_) => None,
        }
    }

    /// The file written (the spill file, or the output), for errors.
    pub(super) fn path(&self) -> &Path {
        match &self.dest {
            Dest::Spill(w) => w.get_ref().path(),
            Dest::Direct { path, .. } => path,
        }
    }

    pub(super) fn err(&self, e: io::Error) -> OutputError {
        OutputError::io(self.path(), e)
    }

    /// A zstd error compressing this CPU's data.
    pub(super) fn zstd_err(&self, e: io::Error) -> OutputError {
        zstd_error(Some(self.cpu), e)
    }

    /// Appends `b` (whole pages, or one chunk record).
    pub(super) fn append(&mut self, b: &[u8]) -> Result<(), OutputError> {
        let r = match &mut self.dest {
            Dest::Spill(w) => w.write_all(b),
            Dest::Direct { w, .. } => w.write_all(b),
        };
        r.map_err(|e| self.err(e))?;
        self.bytes += b.len() as u64;
        Ok(())
    }

    /// Writes out what is buffered.
    pub(super) fn flush(&mut self) -> Result<(), OutputError> {
        let r = match &mut self.dest {
            Dest::Spill(w) => w.flush(),
            Dest::Direct { w, .. } => w.flush(),
        };
        r.map_err(|e| self.err(e))
    }

    /// The spill file, from its start (after [`CpuOut::flush`]); `None` when the data
    /// went straight into the output.
    pub(super) fn spill(&mut self) -> Option<Result<&mut File, OutputError>> {
        let Dest::Spill(w) = &mut self.dest else {
            return None;
        };
        let path = w.get_ref().path().to_path_buf();
        let f = w.get_mut().file_mut();
        Some(
            io::Seek::seek(f, io::SeekFrom::Start(0))
                .map(|_| f)
                .map_err(|e| OutputError::io(path, e)),
        )
    }
}

impl Zstd {
    /// Most bytes of pages one batch holds.
    pub(super) fn batch_bytes(&self) -> usize {
        self.chunk.saturating_mul(self.per_batch)
    }
}

/// A zstd compressor as trace-cmd configures its own (frames without the content size:
/// the chunk record carries it), with its output buffer.
pub(super) struct Zstd {
    c: zstd::bulk::Compressor<'static>,
    /// The chunk records of one batch ([`Zstd::compress`]): per chunk 8 bytes of sizes,
    /// then room for the bound of its frame (allocated on first use, then reused).
    out: Vec<u8>,
    level: i32,
    /// Largest chunk (bytes).
    chunk: usize,
    /// Most chunks of one batch.
    per_batch: usize,
}

/// A zstd error as the writer reports it: compressing CPU `cpu`'s data (`None`: not
/// one CPU's), zstd's error its source.
pub(super) fn zstd_error(cpu: Option<u32>, source: io::Error) -> OutputError {
    OutputError::Compress { cpu, source }
}

/// A compressor as trace-cmd's: [`ZSTD_LEVEL`], frames without the content size (for
/// CPU `cpu`'s data or not one CPU's: what its errors name).
pub(super) fn compressor(cpu: Option<u32>) -> Result<zstd::bulk::Compressor<'static>, OutputError> {
    let mut c = zstd::bulk::Compressor::new(ZSTD_LEVEL).map_err(|e| zstd_error(cpu, e))?;
    c.include_contentsize(false)
        .map_err(|e| zstd_error(cpu, e))?;
    Ok(c)
}

impl Zstd {
    /// A compressor for batches of at most `per_batch` chunks of at most `chunk` bytes.
    pub(super) fn new(chunk: usize, per_batch: usize) -> Result<Self, OutputError> {
        let per_batch = per_batch.max(1);
        Ok(Self {
            c: compressor(None)?,
            out: Vec::new(),
            level: ZSTD_LEVEL,
            chunk,
            per_batch,
        })
    }

    /// Another compressor like this one (a worker's).
    pub(super) fn fresh(&self) -> Result<Self, OutputError> {
        Self::new(self.chunk, self.per_batch)
    }

    /// Compresses `data` (at most one batch), chunk after chunk, at `level` into chunk
    /// records (each: u32 compressed size, u32 uncompressed size, the zstd frame);
    /// returns them and how many.
    pub(super) fn compress(&mut self, data: &[u8], level: i32) -> io::Result<(&[u8], u32)> {
        let mut out = std::mem::take(&mut self.out);
        let r = self.compress_into(data, level, &mut out);
        self.out = out;
        let (used, n) = r?;
        Ok((&self.out[..used], n))
    }

    /// [`Zstd::compress`] into `out` (grown to the batch's bound once, then reused):
    /// the records are `out[..used]`; returns `used` and how many.
    pub(super) fn compress_into(
        &mut self,
        data: &[u8],
        level: i32,
        out: &mut Vec<u8>,
    ) -> io::Result<(usize, u32)> {
        if data.len() > self.chunk * self.per_batch {
            return Err(io::Error::other(format!(
                "batch of {} bytes, more than the {} a batch holds",
                data.len(),
                self.chunk * self.per_batch
            )));
        }
        if level != self.level {
            self.c.set_compression_level(level)?;
            self.level = level;
        }
        let bound = zstd::zstd_safe::compress_bound(self.chunk);
        let need = self.per_batch * (8 + bound);
        if out.len() < need {
            out.resize(need, 0);
        }
        let (mut used, mut n) = (0, 0u32);
        for c in data.chunks(self.chunk) {
            let frame = &mut out[used + 8..used + 8 + bound];
            let z = self.c.compress_to_buffer(c, frame)?;
            // Both fit: a chunk is at most ZSTD_CHUNK_PAGES pages (fewer of large pages) of
            // at most MAX_PAGE_SIZE.
            out[used..used + 4].copy_from_slice(&(z as u32).to_le_bytes());
            out[used + 4..used + 8].copy_from_slice(&(c.len() as u32).to_le_bytes());
            used += 8 + z;
            n += 1;
        }
        Ok((used, n))
    }

    /// [`Zstd::compress`], the records appended to `s`.
    pub(super) fn chunks(
        &mut self,
        data: &[u8],
        level: i32,
        s: &mut CpuOut,
    ) -> Result<(), OutputError> {
        let (records, n) = self.compress(data, level).map_err(|e| s.zstd_err(e))?;
        s.append(records)?;
        s.chunks += n;
        Ok(())
    }
}
