//! trace.dat writer: the CPU data written as the run goes on (`cpudata`), the
//! metadata (`head`) and the file assembled at the end, v6 or v7.

use crate::error::{MetaError, PageProblem};
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::cpudata::{CpuData, Finished, Tail};
use super::cpuout::CpuOut;
use super::head::{align_up, bound, metadata, Layout, Place};
use super::params::{Compression, TraceDatVersion, ZSTD_CHUNK_PAGES};
use crate::blockwrite::BlockWriter;
use crate::sink::{PageSink, RunSummary, TraceMeta};
use crate::target::{OutputFile, OutputTarget};
use crate::{Missed, OutputError};
use hyptrace_format::EventFormat;

/// Preferred event id of `hyptrace:trailing_lost` (the highest free one below
/// [`hyptrace_abi::registry::MAX_EVENT_ID`] if a format already uses it).
pub const TRAILING_LOST_ID: u16 = 999;

/// A [`PageSink`] writing a trace.dat (v6, or v7 uncompressed or zstd-compressed as
/// trace-cmd writes it) to an [`OutputTarget`]: a temporary file renamed over a regular
/// file, or streamed to a device/FIFO/stdout.
///
/// A page costs, on the caller's thread, its export straight into the CPU's pending
/// buffer (one copy); the guest strings of its events with string fields are made safe
/// (G2) and, with [`Compression::Zstd`] (v7 only), each chunk of [`ZSTD_CHUNK_PAGES`]
/// pages compressed, by worker threads as buffers fill (`cpudata`, `zpool`). Into a
/// regular file, one CPU at a time writes its data straight to its final place; the
/// others — every CPU for a device, FIFO or stdout — go to spill files (next to a
/// regular output file, else in the temporary directory). `finish` writes the spilled
/// CPUs' data after the rest, each CPU's data contiguous from a page boundary, and the
/// metadata before it all.
///
/// On an error every temporary and spill file is removed at once, the error is returned
/// (path and OS error), and later calls return [`OutputError::Closed`]. Dropped without
/// `finish`, it removes them too: nothing that looks like a complete trace appears.
pub struct TraceDatSink {
    target: OutputTarget,
    /// None once failed or finished.
    out: Option<OutputFile>,
    meta: TraceMeta,
    version: TraceDatVersion,
    compression: Compression,
    /// The CPU data (None once failed or finished).
    data: Option<CpuData>,
    /// Where the CPU data starts when written straight into the output (room for the
    /// largest metadata the trace can have before it).
    reserve: u64,
    /// Bytes of guest strings replaced, and zstd chunks stored at the catch-up level
    /// (known once the CPU data is complete).
    replaced: u64,
    caught_up: u64,
}

impl TraceDatSink {
    /// Creates the sink for output `path` (checked as [`OutputTarget::check`] does).
    pub fn create(
        path: impl AsRef<Path>,
        meta: TraceMeta,
        version: TraceDatVersion,
    ) -> Result<Self, OutputError> {
        Self::open(&OutputTarget::check(path)?, meta, version)
    }

    /// Creates the sink (output and spill files) for a checked target, uncompressed.
    pub fn open(
        target: &OutputTarget,
        meta: TraceMeta,
        version: TraceDatVersion,
    ) -> Result<Self, OutputError> {
        Self::open_with(target, meta, version, Compression::None)
    }

    /// Creates the sink for a checked target with `compression` (ignored for v6,
    /// which has none).
    pub fn open_with(
        target: &OutputTarget,
        meta: TraceMeta,
        version: TraceDatVersion,
        compression: Compression,
    ) -> Result<Self, OutputError> {
        meta.validate()?;
        meta.check_one_vm("a trace.dat sink")?;
        let compression = match version {
            TraceDatVersion::V6 => Compression::None,
            TraceDatVersion::V7 => compression,
        };
        if let Some(t) = &meta.clock.file_clock().tsc {
            // trace-cmd 3.1.6 ignores the offset and sign-extends mult ≥ 2^31: refuse what it
            // would print differently from our own conversion.
            if t.offset != 0 || t.mult > i32::MAX as u32 || t.mult == 0 || t.shift > 32 {
                return Err(OutputError::Meta(MetaError::Tsc2Nsec {
                    mult: t.mult,
                    shift: t.shift,
                    offset: t.offset,
                }));
            }
        }
        let trailing =
            hyptrace_format::format::trailing_lost_format(trailing_lost_id(&meta.formats));
        let reserve = bound(&meta, &trailing, version, compression)?;
        let out = target.open()?;
        let tail = match out.positioned() {
            Some(f) => {
                let f = f.map_err(|e| out.error(e))?;
                Some(Tail::new(f, target.path().to_path_buf(), reserve))
            }
            None => None,
        };
        let strings = super::strings::StringFields::new(&meta.formats);
        let data = CpuData::new(
            target,
            meta.nr_cpus,
            meta.page_size,
            compression,
            strings,
            tail,
        )?;
        Ok(Self {
            target: target.clone(),
            out: Some(out),
            meta,
            version,
            compression,
            data: Some(data),
            reserve,
            replaced: 0,
            caught_up: 0,
        })
    }

    /// Creates the sink for output `path` with `compression`.
    pub fn create_with(
        path: impl AsRef<Path>,
        meta: TraceMeta,
        version: TraceDatVersion,
        compression: Compression,
    ) -> Result<Self, OutputError> {
        Self::open_with(&OutputTarget::check(path)?, meta, version, compression)
    }

    /// Size of a CPU's data in the file: zstd adds the u32 chunk count (a CPU without
    /// pages has no data at all).
    fn data_size(&self, o: &CpuOut) -> u64 {
        match self.compression {
            Compression::Zstd if o.chunks > 0 => 4 + o.bytes,
            _ => o.bytes,
        }
    }

    /// Output path (as given).
    pub fn path(&self) -> &Path {
        self.target.path()
    }

    fn assemble(&mut self, summary: &RunSummary) -> Result<(), OutputError> {
        let (Some(out), Some(data)) = (self.out.take(), self.data.take()) else {
            return Err(OutputError::Closed);
        };
        let done = data.finish()?;
        (self.replaced, self.caught_up) = (done.replaced, done.caught_up);
        match done.tail {
            Some((file, end)) => self.assemble_in_place(out, done.outs, file, end, summary),
            None => self.assemble_in_order(out, done, summary),
        }
    }

    /// Writes an output written in order: the metadata, then each CPU's spilled data.
    fn assemble_in_order(
        &self,
        mut out: OutputFile,
        mut done: Finished,
        summary: &RunSummary,
    ) -> Result<(), OutputError> {
        let sizes: Vec<u64> = done.outs.iter().map(|o| self.data_size(o)).collect();
        let (head, layout) = metadata(
            &self.meta,
            &summary.cpus,
            self.version,
            self.compression,
            Place::After(&sizes),
        )?;
        out.write_all(&head).map_err(|e| out.error(e))?;
        let mut at = head.len() as u64;
        let mut buf = vec![0u8; COPY_BUF];
        let spans = layout.offsets.iter().zip(&sizes);
        for (o, (&off, &size)) in done.outs.iter_mut().zip(spans) {
            io::copy(&mut io::Read::take(io::repeat(0), off - at), &mut out)
                .map_err(|e| out.error(e))?;
            at = off + size;
            if size == 0 {
                continue;
            }
            if self.compression == Compression::Zstd {
                out.write_all(&o.chunks.to_le_bytes())
                    .map_err(|e| out.error(e))?;
            }
            copy_spill(o, &mut out, &mut buf).map_err(|e| named(e, &out))?;
        }
        out.finish()
    }

    /// Completes an output written at any offset (`file`, whose CPU data written
    /// straight into it ends at `end`): the spilled CPUs' data after `end`, the zstd
    /// chunk counts, and the metadata at the start.
    fn assemble_in_place(
        &self,
        out: OutputFile,
        mut outs: Vec<CpuOut>,
        file: File,
        mut end: u64,
        summary: &RunSummary,
    ) -> Result<(), OutputError> {
        let page = self.meta.page_size as u64;
        let zstd = self.compression == Compression::Zstd;
        let sizes: Vec<u64> = outs.iter().map(|o| self.data_size(o)).collect();
        let mut offsets = vec![0u64; outs.len()];
        let mut buf = vec![0u8; COPY_BUF];
        let put = |at: u64, b: &[u8]| file.write_all_at(b, at).map_err(|e| out.error(e));
        for (c, o) in outs.iter_mut().enumerate() {
            let size = sizes[c];
            if let Some(start) = o.direct_start() {
                offsets[c] = start;
                if zstd {
                    put(start, &o.chunks.to_le_bytes())?;
                }
                continue;
            }
            if size == 0 {
                continue;
            }
            offsets[c] = end;
            let f = file.try_clone().map_err(|e| out.error(e))?;
            // As the CPU data was written (past the page cache with --direct-io).
            let mut w = BlockWriter::new(f, end, self.target.is_direct_io());
            if zstd {
                w.write_all(&o.chunks.to_le_bytes())
                    .map_err(|e| out.error(e))?;
            }
            copy_spill(o, &mut w, &mut buf).map_err(|e| named(e, &out))?;
            w.into_inner().map_err(|e| out.error(e))?;
            end = align_up(end + size, page);
        }
        for (c, o) in outs.iter().enumerate() {
            if o.direct_start().is_none() && sizes[c] == 0 {
                offsets[c] = end;
            }
        }
        let layout = Layout { offsets, sizes };
        let place = Place::At {
            data_start: self.reserve,
            layout: &layout,
        };
        let (head, _) = metadata(
            &self.meta,
            &summary.cpus,
            self.version,
            self.compression,
            place,
        )?;
        put(0, &head)?;
        // The file reaches the data's end (the padding of a trace without pages too).
        let len = layout.end(self.reserve);
        let have = file.metadata().map_err(|e| out.error(e))?.len();
        if have < len {
            file.set_len(len).map_err(|e| out.error(e))?;
        }
        out.finish()
    }

    /// Removes every spill and temporary file.
    fn cleanup(&mut self) {
        self.data = None;
        self.out = None;
    }

    /// The id of `hyptrace:trailing_lost`, its format added to the metadata on first use
    /// (files without trailing losses do not carry it).
    fn trailing_lost_id(&mut self) -> u16 {
        if let Some(f) = self.meta.formats.iter().find(|f| f.is_trailing_lost()) {
            return f.id;
        }
        let id = trailing_lost_id(&self.meta.formats);
        self.meta
            .formats
            .push(hyptrace_format::format::trailing_lost_format(id));
        id
    }

    /// Raw timestamp of the last event of `cpu` (its last page's time if it has no
    /// event, 0 without pages), read from the CPU's last page (always in memory).
    fn last_time(&self, cpu: u32) -> u64 {
        let page = self.data.as_ref().and_then(|d| d.last_page(cpu as usize));
        let Some((ts, commit)) = page.and_then(hyptrace_abi::page::page_header) else {
            return 0;
        };
        let len = (commit & hyptrace_abi::page::COMMIT_LEN_MASK) as usize;
        let area = page
            .and_then(|p| p.get(16..16usize.saturating_add(len)))
            .unwrap_or(&[]);
        let mut last = ts;
        for e in hyptrace_abi::page::Events::new(area, ts).flatten() {
            last = e.ts;
        }
        last
    }

    /// Closes the sink after an error: every temporary file removed.
    fn fail<T>(&mut self, e: OutputError) -> Result<T, OutputError> {
        self.cleanup();
        Err(e)
    }

    /// Stores one page of `cpu`: exported, and retimed when `retime` (ring pages are;
    /// the `trailing_lost` page is built from a stored, already converted time).
    fn store_page(
        &mut self,
        cpu: u32,
        page: &[u8],
        missed: Missed,
        retime: bool,
    ) -> Result<(), OutputError> {
        let (Some(data), Some(_)) = (self.data.as_mut(), self.out.as_ref()) else {
            return Err(OutputError::Closed);
        };
        // A bad page is refused (the sink goes on); a failing write ends it.
        self.meta.check_page(cpu, page)?;
        let c = cpu as usize;
        if data.ended(c) {
            return Err(OutputError::BadPage {
                cpu,
                problem: PageProblem::Ended,
            });
        }
        let slot = match data.slot(c) {
            Ok(s) => s,
            Err(e) => return self.fail(e),
        };
        // The one page-writing path of every buffer this file gets: exported straight
        // into the CPU's pending pages.
        self.meta.file_page(cpu, page, missed, retime, slot)?;
        data.commit(c);
        Ok(())
    }
}

/// The id `hyptrace:trailing_lost` gets among `formats`: [`TRAILING_LOST_ID`], else the
/// highest free id up to [`hyptrace_abi::registry::MAX_EVENT_ID`].
fn trailing_lost_id(formats: &[EventFormat]) -> u16 {
    let used = |id: u16| formats.iter().any(|f| f.id == id);
    std::iter::once(TRAILING_LOST_ID)
        .chain((1..=hyptrace_abi::registry::MAX_EVENT_ID).rev())
        .find(|&id| !used(id))
        .unwrap_or(TRAILING_LOST_ID)
}

/// An error of a write to the output, named as the output's.
fn named(e: OutputError, out: &OutputFile) -> OutputError {
    match e {
        OutputError::Io { path: None, source } => out.error(source),
        e => e,
    }
}

/// Bytes of each read of a spill file while the output is assembled (as large as the
/// output's own buffer: a write of it goes straight to the file).
const COPY_BUF: usize = 1 << 20;

/// Copies CPU data `o`'s spill file (its `o.bytes`) to `out` through `buf`: a read
/// error names the spill file, a write error the output (`OutputFile`) or nothing (a
/// positioned writer: the caller names it).
fn copy_spill(o: &mut CpuOut, out: &mut dyn Write, buf: &mut [u8]) -> Result<(), OutputError> {
    let want = o.bytes;
    let Some(f) = o.spill() else {
        return Ok(());
    };
    let f = f?;
    let mut src = io::Read::take(f, want);
    let mut n = 0u64;
    loop {
        let k = match io::Read::read(&mut src, buf) {
            Ok(0) => break,
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(o.err(e)),
        };
        out.write_all(&buf[..k]).map_err(write_error)?;
        n += k as u64;
    }
    if n != want {
        return Err(o.err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "spill file shrank",
        )));
    }
    Ok(())
}

/// A write error of [`copy_spill`]: an [`OutputFile`]'s names the output already
/// (its `Closed` marker kept).
fn write_error(e: io::Error) -> OutputError {
    if crate::error::Marker::Closed.is(&e) {
        OutputError::Closed
    } else {
        OutputError::Io {
            path: None,
            source: e,
        }
    }
}

impl PageSink for TraceDatSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        self.store_page(cpu, page, missed, true)
    }

    /// Appends a page to CPU `cpu` holding one `hyptrace:trailing_lost` event (field
    /// `count` = `lost`) at the time of the CPU's last event, with `RB_MISSED_EVENTS |
    /// RB_MISSED_STORED` and the count: trace-cmd prints `CPU:N [lost EVENTS DROPPED]`
    /// before that event, after the CPU's last event (it shows a loss only before a
    /// record: an empty page carrying a count prints nothing).
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        if self.out.is_none() {
            return Err(OutputError::Closed);
        }
        if lost == 0 {
            return Ok(());
        }
        let ps = self.meta.page_size;
        let mut raw = vec![0u8; ps];
        self.meta.check_page(cpu, &raw)?;
        let ts = self.last_time(cpu);
        let id = self.trailing_lost_id();
        let mut payload = [0u8; hyptrace_format::format::TRAILING_LOST_SIZE];
        payload[..2].copy_from_slice(&id.to_le_bytes());
        payload[4..8].copy_from_slice(&hyptrace_abi::events::vcpu_pid(cpu).to_le_bytes());
        payload[8..16].copy_from_slice(&lost.to_le_bytes());
        let mut hdr = [0u8; 8];
        let n = hyptrace_abi::page::encode_data_header(&mut hdr, payload.len(), 0);
        let len = n + payload.len();
        raw[..8].copy_from_slice(&ts.to_le_bytes());
        raw[8..16].copy_from_slice(&(len as u64).to_le_bytes());
        raw[16..16 + n].copy_from_slice(&hdr[..n]);
        raw[16 + n..16 + len].copy_from_slice(&payload);
        self.store_page(cpu, &raw, Missed::Count(lost), false)
    }

    /// CPU `cpu` is complete: the next CPU to start may write straight into the output
    /// after it (a file is written once instead of spilled and copied).
    fn end_cpu(&mut self, cpu: u32) -> Result<(), OutputError> {
        let Some(data) = self.data.as_mut() else {
            return Err(OutputError::Closed);
        };
        if cpu >= self.meta.nr_cpus {
            return Err(OutputError::BadPage {
                cpu,
                problem: PageProblem::NoSuchCpu {
                    cpu,
                    nr_cpus: self.meta.nr_cpus,
                },
            });
        }
        if let Err(e) = data.end_cpu(cpu as usize) {
            return self.fail(e);
        }
        Ok(())
    }

    /// Live rings feed this sink: when the zstd workers fall behind, chunks are stored
    /// at the catch-up level rather than making the rings wait (docs/output.md).
    fn set_live(&mut self) {
        if let Some(d) = self.data.as_mut() {
            d.set_live();
        }
    }

    fn finish(mut self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        let r = self.assemble(summary);
        if self.replaced > 0 {
            // Shown as the text sink shows its one warning: the host prints no sink notes.
            eprintln!(
                "hyptrace: warning: {}: {} control or non-UTF-8 bytes in guest strings written as '?' (trace-cmd prints strings raw)",
                self.target.path().display(),
                self.replaced
            );
        }
        if r.is_ok() && self.caught_up > 0 {
            eprintln!(
                "hyptrace: note: {}: {} chunks of {ZSTD_CHUNK_PAGES} pages stored nearly uncompressed: zstd fell behind the rings",
                self.target.path().display(),
                self.caught_up
            );
        }
        self.cleanup();
        r
    }
}

impl Drop for TraceDatSink {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// Writes a whole trace.dat at once: `pages` are `(cpu, raw ring page, missed)` in order
/// per CPU (see [`PageSink::page`]).
pub fn write_trace_dat<'a>(
    path: impl AsRef<Path>,
    meta: TraceMeta,
    version: TraceDatVersion,
    pages: impl IntoIterator<Item = (u32, &'a [u8], Missed)>,
    summary: &RunSummary,
) -> Result<(), OutputError> {
    write_trace_dat_with(path, meta, version, Compression::None, pages, summary)
}

/// [`write_trace_dat`] with a compression.
pub fn write_trace_dat_with<'a>(
    path: impl AsRef<Path>,
    meta: TraceMeta,
    version: TraceDatVersion,
    compression: Compression,
    pages: impl IntoIterator<Item = (u32, &'a [u8], Missed)>,
    summary: &RunSummary,
) -> Result<(), OutputError> {
    let mut sink = Box::new(TraceDatSink::create_with(path, meta, version, compression)?);
    for (cpu, page, missed) in pages {
        sink.page(cpu, page, missed)?;
    }
    sink.finish(summary)
}

#[cfg(test)]
mod tests {
    use super::super::head::{clock_text, Strings};
    use super::*;

    #[test]
    fn clock_text_brackets_the_clock() {
        assert_eq!(
            clock_text("x86-tsc"),
            "local global counter uptime perf mono mono_raw boot tai [x86-tsc]\n"
        );
        assert_eq!(
            clock_text("mine"),
            "local global counter uptime perf mono mono_raw boot tai x86-tsc [mine]\n"
        );
    }

    /// Pages of `cpu` with `n` small events each (valid for `check_page`/export).
    fn test_pages(cpu: u32, count: usize) -> Vec<Vec<u8>> {
        (0..count)
            .map(|i| {
                let mut p = vec![0u8; 4096];
                p[..8].copy_from_slice(&(1_000 + i as u64 * 10_000).to_le_bytes());
                let payload = hyptrace_abi::events::marker(
                    hyptrace_abi::events::vcpu_pid(cpu),
                    i as u64,
                    (i * 7919) as u64,
                );
                let mut hdr = [0u8; 8];
                let n = hyptrace_abi::page::encode_data_header(&mut hdr, payload.len(), 0);
                p[16..16 + n].copy_from_slice(&hdr[..n]);
                p[16 + n..16 + n + payload.len()].copy_from_slice(&payload);
                p[8..16].copy_from_slice(&((n + payload.len()) as u64).to_le_bytes());
                p
            })
            .collect()
    }

    fn write_zstd(dir: &Path, name: &str, inline: bool) -> Vec<u8> {
        let path = dir.join(name);
        let meta = TraceMeta::guest(4096, 3, crate::Clock::nanoseconds());
        let mut s =
            TraceDatSink::create_with(&path, meta, TraceDatVersion::V7, Compression::Zstd).unwrap();
        // The workers, or none: chunks compressed on this thread.
        if inline {
            s.data.as_mut().unwrap().without_workers().unwrap();
        }
        // CPU 2 gets no page; CPU 1 ends mid-chunk; losses and a trailing loss.
        let (a, b) = (test_pages(0, 95), test_pages(1, 23));
        for (i, p) in a.iter().enumerate() {
            s.page(0, p, Missed::count(if i == 40 { 3 } else { 0 }))
                .unwrap();
            if let Some(p) = b.get(i) {
                s.page(1, p, Missed::None).unwrap();
            }
        }
        s.trailing_lost(1, 9).unwrap();
        Box::new(s).finish(&RunSummary::default()).unwrap();
        std::fs::read(&path).unwrap()
    }

    /// The worker threads write exactly what compressing on the caller's thread writes,
    /// and the file reads back page for page.
    #[test]
    fn zstd_workers_match_inline() {
        let dir = tempfile::tempdir().unwrap();
        let pooled = write_zstd(dir.path(), "pool.dat", false);
        let inline = write_zstd(dir.path(), "inline.dat", true);
        assert!(pooled == inline, "worker and inline files differ");
        let f = crate::TraceFile::parse(&pooled).unwrap();
        assert_eq!(f.cpus.len(), 3);
        let pages = |i: usize| {
            let mut p = f.pages(i).unwrap();
            let mut n = 0;
            while let Some(page) = p.next_page().unwrap() {
                assert_eq!(page.len(), 4096);
                n += 1;
            }
            n
        };
        assert_eq!(pages(0), 95);
        assert_eq!(pages(1), 24);
        assert_eq!(pages(2), 0);
        assert_eq!(f.event_count(), 95 + 23);
        assert_eq!(f.dropped().0, 3 + 9);
        // Only the spill files' leftovers would remain: none.
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2);
    }

    /// A zstd v7 sink of 2 CPUs into `t.dat` of a new temporary directory.
    fn zstd_sink() -> (tempfile::TempDir, std::path::PathBuf, TraceDatSink) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.dat");
        let meta = TraceMeta::guest(4096, 2, crate::Clock::nanoseconds());
        let s =
            TraceDatSink::create_with(&path, meta, TraceDatVersion::V7, Compression::Zstd).unwrap();
        (dir, path, s)
    }

    /// A zstd sink dropped mid-run (chunks in flight) joins its workers and leaves no file.
    #[test]
    fn zstd_dropped_leaves_nothing() {
        let (dir, _, mut s) = zstd_sink();
        for p in test_pages(0, 200) {
            s.page(0, &p, Missed::None).unwrap();
        }
        drop(s);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    /// A CPU ended takes no more pages (the sink goes on); the file holds what came.
    #[test]
    fn ended_cpu_takes_no_more_pages() {
        let (dir, path, mut s) = zstd_sink();
        let (a, b) = (test_pages(0, 25), test_pages(1, 5));
        for p in &a {
            s.page(0, p, Missed::None).unwrap();
        }
        s.end_cpu(0).unwrap();
        assert!(matches!(
            s.page(0, &a[0], Missed::None),
            Err(OutputError::BadPage { cpu: 0, .. })
        ));
        assert!(s.trailing_lost(0, 3).is_err());
        for p in &b {
            s.page(1, p, Missed::None).unwrap();
        }
        s.end_cpu(1).unwrap();
        Box::new(s).finish(&RunSummary::default()).unwrap();
        let f = crate::TraceFile::open(&path).unwrap();
        assert_eq!(f.event_count(), 30);
        assert_eq!(f.dropped().0, 0);
        // Both CPUs went straight into the file, one after the other.
        assert!(f.cpus[0].offset < f.cpus[1].offset);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1);
    }

    /// A trace without pages: metadata and padding to where the data would start, read
    /// back as empty by our reader (and by trace-cmd: `tests/trace_cmd.rs`).
    #[test]
    fn empty_trace_in_place() {
        let (dir, path, mut s) = zstd_sink();
        s.end_cpu(1).unwrap();
        s.end_cpu(1).unwrap();
        assert!(s.end_cpu(2).is_err());
        Box::new(s).finish(&RunSummary::default()).unwrap();
        let f = crate::TraceFile::open(&path).unwrap();
        assert_eq!((f.cpus.len(), f.event_count()), (2, 0));
        let len = std::fs::metadata(&path).unwrap().len();
        assert_eq!(len % 4096, 0, "{len}");
        drop(dir);
    }

    /// The bytes of guest strings replaced are all counted, the last batches' (still
    /// with the workers when the sink finishes) too, with workers or without.
    #[test]
    fn replaced_strings_are_all_counted() {
        for inline in [true, false] {
            let (_dir, _path, mut s) = zstd_sink();
            if inline {
                s.data.as_mut().unwrap().without_workers().unwrap();
            }
            let mut page = vec![0u8; 4096];
            page[..8].copy_from_slice(&1000u64.to_le_bytes());
            let mut ev = [0u8; 64];
            let n = hyptrace_abi::events::text(&mut ev, 1, 1, b"bad\x1bbyte").unwrap();
            let mut hdr = [0u8; 8];
            let h = hyptrace_abi::page::encode_data_header(&mut hdr, n, 0);
            page[16..16 + h].copy_from_slice(&hdr[..h]);
            page[16 + h..16 + h + n].copy_from_slice(&ev[..n]);
            let size = hyptrace_abi::page::data_event_size(n);
            page[8..16].copy_from_slice(&(size as u64).to_le_bytes());
            for _ in 0..3 {
                s.page(0, &page, Missed::None).unwrap();
            }
            s.assemble(&RunSummary::default()).unwrap();
            assert_eq!(s.replaced, 3, "inline {inline}");
        }
    }

    /// A zstd failure is a compression error naming the CPU, zstd's error its source
    /// (not metadata, not an I/O error of the spill file).
    #[test]
    fn zstd_failure_is_compress_with_its_source() {
        let dir = tempfile::tempdir().unwrap();
        let target = crate::OutputTarget::check(dir.path().join("x.dat")).unwrap();
        let pages: Vec<u8> = test_pages(5, 2).concat();
        // Room for one page per batch: two pages are more than the compressor holds.
        let mut z = super::super::cpuout::Zstd::new(pages.len() / 2, 1).unwrap();
        let mut o = CpuOut::new(&target, 5).unwrap();
        let e = z
            .chunks(&pages, super::super::cpuout::ZSTD_LEVEL, &mut o)
            .expect_err("over the batch");
        assert!(
            matches!(&e, OutputError::Compress { cpu: Some(5), .. }),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "zstd compression of cpu 5's data");
        let source = std::error::Error::source(&e).expect("zstd's error kept");
        assert!(
            !e.to_string().contains(&source.to_string()),
            "{e}: {source}"
        );
    }

    /// A chunk at the catch-up level reads back as the pages it holds.
    #[test]
    fn catch_up_chunks_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let target = crate::OutputTarget::check(dir.path().join("x.dat")).unwrap();
        let pages: Vec<u8> = test_pages(0, 10).concat();
        let mut z = super::super::cpuout::Zstd::new(pages.len(), 1).unwrap();
        let mut sizes = Vec::new();
        for level in [
            super::super::cpuout::ZSTD_LEVEL,
            super::super::cpuout::ZSTD_CATCH_UP_LEVEL,
        ] {
            let mut o = CpuOut::new(&target, 0).unwrap();
            z.chunks(&pages, level, &mut o).unwrap();
            o.flush().unwrap();
            let mut rec = Vec::new();
            io::Read::read_to_end(o.spill().unwrap().unwrap(), &mut rec).unwrap();
            let n = u32::from_le_bytes(rec[..4].try_into().unwrap()) as usize;
            let m = u32::from_le_bytes(rec[4..8].try_into().unwrap()) as usize;
            assert_eq!((n + 8, m), (rec.len(), pages.len()));
            let back = zstd::bulk::decompress(&rec[8..], m).unwrap();
            assert!(back == pages);
            sizes.push(n);
        }
        // Stored, near enough: the catch-up level does not compress these pages much.
        assert!(sizes[1] > 4 * sizes[0], "{sizes:?}");
    }

    #[test]
    fn strings_dedup() {
        let mut s = Strings(Vec::new());
        assert_eq!(s.id("options"), 0);
        assert_eq!(s.id("headers"), 8);
        assert_eq!(s.id("options"), 0);
    }
}
