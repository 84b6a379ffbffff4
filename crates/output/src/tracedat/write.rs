//! trace.dat writer: streaming per-CPU spill files, assembled into v6 or v7 at the end.

use std::io::{self, BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use super::{option, MAGIC};
use crate::format::{header_page_text, EventFormat, HEADER_EVENT_TEXT};
use crate::sink::{KernelCpuStat, PageSink, RunSummary, TraceMeta};
use crate::target::{OutputFile, OutputTarget, Temp};
use crate::OutputError;

/// Preferred event id of `hyptrace:trailing_lost` (the next free one below 65536 if a
/// format already uses it).
pub const TRAILING_LOST_ID: u16 = 999;

/// Which trace.dat version to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceDatVersion {
    /// Version 6 (flat metadata, flyrecord table).
    V6,
    /// Version 7 (sections and options; written uncompressed).
    V7,
}

/// How the CPU data and the metadata sections of a v7 trace.dat are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    /// Uncompressed (pages copied verbatim, page aligned).
    None,
    /// zstd, as `trace-cmd record` writes by default: each CPU's pages in chunks of
    /// [`ZSTD_CHUNK_PAGES`] pages (one zstd frame each), the metadata sections (headers,
    /// formats, kallsyms, printk, cmdlines, strings) compressed; options uncompressed.
    /// Version 6 has no compression: a v6 file is always written uncompressed.
    #[default]
    Zstd,
}

/// Pages per compressed chunk (trace-cmd's own chunk: 10 pages).
pub const ZSTD_CHUNK_PAGES: usize = 10;
/// zstd level: -1, zstd's first fast level: about twice the speed of level 1 at 6.4× on
/// marker pages instead of 7.5× (`cargo bench -p hyptrace-output --bench tracedat --
/// zstd`).
const ZSTD_LEVEL: i32 = -1;
/// Most compression worker threads of one sink (also at most one per CPU and per core).
const ZSTD_MAX_WORKERS: usize = 8;

/// Trace clocks the kernel lists in `trace_clock`; the TRACECLOCK text brackets ours.
const CLOCKS: &[&str] = &[
    "local", "global", "counter", "uptime", "perf", "mono", "mono_raw", "boot", "tai", "x86-tsc",
];

fn clock_text(name: &str) -> String {
    let mut list: Vec<String> = CLOCKS.iter().map(|c| c.to_string()).collect();
    if !CLOCKS.contains(&name) {
        list.push(name.to_string());
    }
    let items: Vec<String> = list
        .into_iter()
        .map(|c| if c == name { format!("[{c}]") } else { c })
        .collect();
    format!("{}\n", items.join(" "))
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

fn push_opt(out: &mut Vec<u8>, id: u16, data: &[u8]) {
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(data);
}

fn header_info(page_size: usize) -> Vec<u8> {
    let mut v = Vec::new();
    let hp = header_page_text(page_size);
    v.extend_from_slice(b"header_page\0");
    v.extend_from_slice(&(hp.len() as u64).to_le_bytes());
    v.extend_from_slice(hp.as_bytes());
    v.extend_from_slice(b"header_event\0");
    v.extend_from_slice(&(HEADER_EVENT_TEXT.len() as u64).to_le_bytes());
    v.extend_from_slice(HEADER_EVENT_TEXT.as_bytes());
    v
}

fn event_formats(formats: &[EventFormat]) -> Vec<u8> {
    let mut systems: Vec<&str> = Vec::new();
    for f in formats {
        if !systems.contains(&f.system.as_str()) {
            systems.push(&f.system);
        }
    }
    let mut v = Vec::new();
    v.extend_from_slice(&(systems.len() as u32).to_le_bytes());
    for s in systems {
        v.extend_from_slice(&cstr(s));
        let evs: Vec<&EventFormat> = formats.iter().filter(|f| f.system == s).collect();
        v.extend_from_slice(&(evs.len() as u32).to_le_bytes());
        for e in evs {
            let t = e.to_format_text();
            v.extend_from_slice(&(t.len() as u64).to_le_bytes());
            v.extend_from_slice(t.as_bytes());
        }
    }
    v
}

fn cmdlines(meta: &TraceMeta) -> Vec<u8> {
    let text: String = meta
        .cmdlines
        .iter()
        .map(|(pid, comm)| format!("{pid} {comm}\n"))
        .collect();
    let mut v = (text.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(text.as_bytes());
    v
}

/// Options common to v6 and v7 (clock, TSC2NSEC, CPUSTAT per CPU).
/// A clock with a map declares its host clock and no TSC2NSEC/OFFSET: the pages carry
/// its ns ([`crate::Clock::retime_page`] in [`TraceDatSink::page`]).
fn common_options(meta: &TraceMeta, stats: &[KernelCpuStat], out: &mut Vec<u8>) {
    let clock = meta.clock.file_clock();
    push_opt(out, option::TRACECLOCK, &cstr(&clock_text(&clock.name)));
    if let Some(t) = &clock.tsc {
        let mut d = Vec::with_capacity(16);
        d.extend_from_slice(&t.mult.to_le_bytes());
        d.extend_from_slice(&t.shift.to_le_bytes());
        d.extend_from_slice(&t.offset.to_le_bytes());
        push_opt(out, option::TSC2NSEC, &d);
    }
    if clock.offset_ns != 0 {
        // trace-cmd adds it after TSC2NSEC (Clock::trace_cmd_ns).
        push_opt(out, option::OFFSET, &cstr(&clock.offset_ns.to_string()));
    }
    for cpu in 0..meta.nr_cpus {
        let s = stats.get(cpu as usize).copied().unwrap_or_default();
        push_opt(out, option::CPUSTAT, &cstr(&s.to_cpustat_text(cpu)));
    }
}

fn file_start(version: u8, page_size: usize) -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.push(b'0' + version);
    v.push(0);
    v.push(0); // little endian
    v.push(8); // sizeof(long)
    v.extend_from_slice(&(page_size as u32).to_le_bytes());
    v
}

/// Builds the v6 metadata (everything before the first page) for CPU data starting at
/// `data_start` with the given per-CPU sizes.
fn v6_metadata(
    meta: &TraceMeta,
    stats: &[KernelCpuStat],
    sizes: &[u64],
    data_start: u64,
) -> Vec<u8> {
    let mut v = file_start(6, meta.page_size);
    v.extend_from_slice(&header_info(meta.page_size));
    v.extend_from_slice(&0u32.to_le_bytes()); // ftrace event formats
    v.extend_from_slice(&event_formats(&meta.formats));
    v.extend_from_slice(&0u32.to_le_bytes()); // kallsyms
    v.extend_from_slice(&0u32.to_le_bytes()); // printk formats
    v.extend_from_slice(&cmdlines(meta));
    v.extend_from_slice(&meta.nr_cpus.to_le_bytes());
    v.extend_from_slice(b"options  \0");
    common_options(meta, stats, &mut v);
    v.extend_from_slice(&option::DONE.to_le_bytes());
    v.extend_from_slice(b"flyrecord\0");
    let mut off = data_start;
    for &s in sizes {
        v.extend_from_slice(&off.to_le_bytes());
        v.extend_from_slice(&s.to_le_bytes());
        off += s;
    }
    let clock = clock_text(&meta.clock.name);
    v.extend_from_slice(&(clock.len() as u64).to_le_bytes());
    v.extend_from_slice(clock.as_bytes());
    v
}

struct Strings(Vec<u8>);

impl Strings {
    fn id(&mut self, s: &str) -> u32 {
        let needle = cstr(s);
        // Look for an existing copy at a string start.
        let mut at = 0;
        while at < self.0.len() {
            let end = self.0[at..]
                .iter()
                .position(|&b| b == 0)
                .map_or(self.0.len(), |p| at + p + 1);
            if self.0[at..end] == needle[..] {
                return at as u32;
            }
            at = end;
        }
        let id = self.0.len() as u32;
        self.0.extend_from_slice(&needle);
        id
    }
}

/// Section flag: the content is compressed (`TRACECMD_SEC_FL_COMPRESS`).
const SEC_FL_COMPRESS: u16 = 1;

/// zstd-compresses `content` as trace-cmd stores a compressed block: u32 compressed
/// size, u32 uncompressed size, the zstd frame.
fn zstd_block(content: &[u8]) -> Result<Vec<u8>, OutputError> {
    let z = zstd::bulk::compress(content, ZSTD_LEVEL)
        .map_err(|e| OutputError::BadMeta(format!("zstd: {e}")))?;
    let too_big = |_| OutputError::BadMeta("section too large to compress".into());
    let mut v = Vec::with_capacity(8 + z.len());
    v.extend_from_slice(&u32::try_from(z.len()).map_err(too_big)?.to_le_bytes());
    v.extend_from_slice(&u32::try_from(content.len()).map_err(too_big)?.to_le_bytes());
    v.extend_from_slice(&z);
    Ok(v)
}

/// Appends a v7 section (compressed when `compress`); returns its offset.
fn section(
    out: &mut Vec<u8>,
    strings: &mut Strings,
    id: u16,
    name: &str,
    content: &[u8],
    compress: bool,
) -> Result<u64, OutputError> {
    let at = out.len() as u64;
    let packed;
    let (flags, content) = if compress {
        packed = zstd_block(content)?;
        (SEC_FL_COMPRESS, &packed[..])
    } else {
        (0, content)
    };
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&strings.id(name).to_le_bytes());
    out.extend_from_slice(&(content.len() as u64).to_le_bytes());
    out.extend_from_slice(content);
    Ok(at)
}

/// Where each CPU's data starts: the first at `data_start`, each next one on the
/// first page boundary after the previous one's end (as trace-cmd lays them out;
/// uncompressed data is whole pages, so the starts are contiguous).
fn cpu_offsets(data_start: u64, sizes: &[u64], page: u64) -> Vec<u64> {
    let mut off = data_start;
    sizes
        .iter()
        .map(|&s| {
            let at = off;
            off = align_up(off + s, page);
            at
        })
        .collect()
}

/// End of the CPU data (the last CPU's end).
fn data_end(data_start: u64, sizes: &[u64], page: u64) -> u64 {
    match (cpu_offsets(data_start, sizes, page).last(), sizes.last()) {
        (Some(o), Some(s)) => o + s,
        _ => data_start,
    }
}

/// Builds the v7 metadata: header, sections, options, strings, and the flyrecord section
/// header; returns it with the offset where CPU data starts (page aligned).
fn v7_metadata(
    meta: &TraceMeta,
    stats: &[KernelCpuStat],
    sizes: &[u64],
    compression: Compression,
) -> Result<(Vec<u8>, u64), OutputError> {
    let v7 = V7Metadata {
        meta,
        stats,
        sizes,
        z: compression == Compression::Zstd,
    };
    // Built twice: the first build (offsets 0) gives the length, which the offsets do
    // not change (fixed-size words), hence where the flyrecord header and the data are.
    let first = v7.build(0, 0)?;
    let flyrecord_at = first.len() as u64 - 16;
    let data_start = align_up(first.len() as u64, meta.page_size as u64);
    let v = v7.build(flyrecord_at, data_start)?;
    debug_assert_eq!(v.len(), first.len());
    Ok((v, data_start))
}

/// What the v7 metadata is built from.
struct V7Metadata<'a> {
    meta: &'a TraceMeta,
    stats: &'a [KernelCpuStat],
    sizes: &'a [u64],
    /// zstd-compressed sections.
    z: bool,
}

impl V7Metadata<'_> {
    /// The metadata with the flyrecord section header at `flyrecord_at` and the CPU data
    /// from `data_start`.
    fn build(&self, flyrecord_at: u64, data_start: u64) -> Result<Vec<u8>, OutputError> {
        let (meta, z) = (self.meta, self.z);
        let mut strings = Strings(Vec::new());
        let mut v = file_start(7, meta.page_size);
        if z {
            v.extend_from_slice(b"zstd\0");
            v.extend_from_slice(&cstr(zstd::zstd_safe::version_string()));
        } else {
            v.extend_from_slice(b"none\0\0");
        }
        let opt_ptr = v.len();
        v.extend_from_slice(&0u64.to_le_bytes());
        let sections = self.sections(&mut v, &mut strings)?;
        let opts = self.options(&sections, flyrecord_at, data_start);
        // Names used below must be in the strings before the strings section is written.
        strings.id("strings");
        strings.id("buffer flyrecord");
        // Options stay uncompressed (as trace-cmd writes them).
        let options_at = section(&mut v, &mut strings, 0, "options", &opts, false)?;
        v[opt_ptr..opt_ptr + 8].copy_from_slice(&options_at.to_le_bytes());
        let s = strings.0.clone();
        section(&mut v, &mut strings, option::STRINGS, "strings", &s, z)?;
        // Flyrecord section header: its content is the padding plus all CPU data.
        let at = v.len() as u64;
        let end = data_end(data_start, self.sizes, meta.page_size as u64);
        v.extend_from_slice(&option::BUFFER.to_le_bytes());
        let flags = if z { SEC_FL_COMPRESS } else { 0 };
        v.extend_from_slice(&flags.to_le_bytes());
        v.extend_from_slice(&strings.id("buffer flyrecord").to_le_bytes());
        v.extend_from_slice(&end.saturating_sub(at + 16).to_le_bytes());
        Ok(v)
    }

    /// Appends the metadata sections to `v`, in trace-cmd's order; returns each one's id
    /// and offset.
    fn sections(
        &self,
        v: &mut Vec<u8>,
        strings: &mut Strings,
    ) -> Result<[(u16, u64); 6], OutputError> {
        let empty = 0u32.to_le_bytes();
        let headers = header_info(self.meta.page_size);
        let formats = event_formats(&self.meta.formats);
        let cmds = cmdlines(self.meta);
        let table: [(u16, &str, &[u8]); 6] = [
            (option::HEADER_INFO, "headers", &headers),
            (option::FTRACE_EVENTS, "ftrace events", &empty),
            (option::EVENT_FORMATS, "events format", &formats),
            (option::KALLSYMS, "kallsyms", &empty),
            (option::PRINTK, "printk", &empty),
            (option::CMDLINES, "command lines", &cmds),
        ];
        let mut at = [(0u16, 0u64); 6];
        for (slot, (id, name, content)) in at.iter_mut().zip(table) {
            *slot = (id, section(v, strings, id, name, content, self.z)?);
        }
        Ok(at)
    }

    /// The options: the common ones, the CPU count, where each section is, the
    /// top-level buffer (its CPU data from `data_start`), and the end.
    fn options(&self, sections: &[(u16, u64)], flyrecord_at: u64, data_start: u64) -> Vec<u8> {
        let meta = self.meta;
        let mut opts = Vec::new();
        common_options(meta, self.stats, &mut opts);
        push_opt(&mut opts, option::CPUCOUNT, &meta.nr_cpus.to_le_bytes());
        for &(id, off) in sections {
            push_opt(&mut opts, id, &off.to_le_bytes());
        }
        let mut buf = Vec::new();
        buf.extend_from_slice(&flyrecord_at.to_le_bytes());
        buf.extend_from_slice(b"\0"); // top-level buffer: empty name
        buf.extend_from_slice(&cstr(&meta.clock.name));
        buf.extend_from_slice(&(meta.page_size as u32).to_le_bytes());
        buf.extend_from_slice(&meta.nr_cpus.to_le_bytes());
        let offsets = cpu_offsets(data_start, self.sizes, meta.page_size as u64);
        for (cpu, (&s, &off)) in self.sizes.iter().zip(&offsets).enumerate() {
            buf.extend_from_slice(&(cpu as u32).to_le_bytes());
            buf.extend_from_slice(&off.to_le_bytes());
            buf.extend_from_slice(&s.to_le_bytes());
        }
        push_opt(&mut opts, option::BUFFER, &buf);
        push_opt(&mut opts, option::DONE, &0u64.to_le_bytes());
        opts
    }
}

/// Builds the complete metadata for `version`; returns it and where CPU data starts.
fn metadata(
    meta: &TraceMeta,
    stats: &[KernelCpuStat],
    sizes: &[u64],
    version: TraceDatVersion,
    compression: Compression,
) -> Result<(Vec<u8>, u64), OutputError> {
    match version {
        TraceDatVersion::V6 => {
            let len = v6_metadata(meta, stats, sizes, 0).len() as u64;
            let start = align_up(len, meta.page_size as u64);
            Ok((v6_metadata(meta, stats, sizes, start), start))
        }
        TraceDatVersion::V7 => v7_metadata(meta, stats, sizes, compression),
    }
}

struct Spill {
    file: BufWriter<Temp>,
    bytes: u64,
    /// Offset of the last page written (None: no page yet; uncompressed only).
    last_page: Option<u64>,
    /// zstd: exported pages not compressed yet (at most [`ZSTD_CHUNK_PAGES`]; the last
    /// page of the CPU is always here once it has one).
    chunk: Vec<u8>,
    /// zstd: chunks written to the spill file.
    chunks: u32,
}

impl Spill {
    fn path(&self) -> &Path {
        self.file.get_ref().path()
    }

    fn err(&self, e: io::Error) -> OutputError {
        OutputError::io(self.path(), e)
    }
}

/// A [`PageSink`] writing a trace.dat: pages go to per-CPU spill files while the run goes
/// on (next to a regular output file, in the temporary directory for a device, FIFO or
/// stdout); `finish` writes the metadata and each CPU's pages (contiguous, page aligned,
/// copied verbatim) to the output ([`OutputTarget`]: a temporary file renamed over a
/// regular file, or streamed to a device/FIFO/stdout).
///
/// With [`Compression::Zstd`] (v7 only) each CPU's pages are gathered in chunks of
/// [`ZSTD_CHUNK_PAGES`] pages, each compressed into the spill file as it fills (memory:
/// one chunk per CPU), and the spill files hold trace-cmd's chunk records.
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
    spills: Vec<Spill>,
    scratch: Vec<u8>,
    /// zstd: the compressor (context reused) and its output buffer, when compressing on
    /// the caller's thread (no worker threads could be made).
    zstd: Option<(zstd::bulk::Compressor<'static>, Vec<u8>)>,
    /// zstd: the compression worker threads.
    pool: Option<super::zpool::ZPool>,
    /// The string fields made safe in every page (G2), and the bytes replaced so far.
    strings: super::strings::StringFields,
    replaced: u64,
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
        let compression = match version {
            TraceDatVersion::V6 => Compression::None,
            TraceDatVersion::V7 => compression,
        };
        let chunk = meta.page_size * ZSTD_CHUNK_PAGES;
        let pool = match compression {
            Compression::None => None,
            Compression::Zstd => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                let workers = cores.min(meta.nr_cpus as usize).min(ZSTD_MAX_WORKERS);
                super::zpool::ZPool::new(workers, ZSTD_LEVEL, chunk)
            }
        };
        let zstd = match compression {
            Compression::Zstd if pool.is_none() => {
                let c = zstd::bulk::Compressor::new(ZSTD_LEVEL)
                    .map_err(|e| OutputError::BadMeta(format!("zstd: {e}")))?;
                Some((
                    c,
                    Vec::with_capacity(zstd::zstd_safe::compress_bound(chunk)),
                ))
            }
            _ => None,
        };
        if let Some(t) = &meta.clock.file_clock().tsc {
            // trace-cmd 3.1.6 ignores the offset and sign-extends mult ≥ 2^31: refuse what it
            // would print differently from our own conversion.
            if t.offset != 0 || t.mult > i32::MAX as u32 || t.mult == 0 || t.shift > 32 {
                return Err(OutputError::BadMeta(format!(
                    "TSC2NSEC {t:?}: trace-cmd needs offset 0, 0 < mult < 2^31, shift <= 32"
                )));
            }
        }
        let mut spills = Vec::new();
        for cpu in 0..meta.nr_cpus {
            let f = target.spill(&format!(".cpu{cpu}"))?;
            spills.push(Spill {
                file: BufWriter::with_capacity(1 << 20, f),
                bytes: 0,
                last_page: None,
                chunk: Vec::new(),
                chunks: 0,
            });
        }
        let out = target.open()?;
        Ok(Self {
            target: target.clone(),
            out: Some(out),
            scratch: vec![0; meta.page_size],
            strings: super::strings::StringFields::new(&meta.formats),
            replaced: 0,
            meta,
            version,
            compression,
            spills,
            zstd,
            pool,
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

    /// Compresses CPU `cpu`'s pending pages into one chunk record of its spill file
    /// (u32 compressed size, u32 uncompressed size, the zstd frame): handed to the
    /// workers, or compressed here without them.
    fn flush_chunk(&mut self, cpu: usize) -> Result<(), OutputError> {
        let Self {
            pool, spills, zstd, ..
        } = self;
        let Some(s) = spills.get_mut(cpu) else {
            return Ok(());
        };
        if s.chunk.is_empty() {
            return Ok(());
        }
        if let Some(pool) = pool.as_mut() {
            let data = std::mem::replace(&mut s.chunk, pool.buffer());
            return pool.submit(cpu, data, &mut |c, z, n| write_chunk(spills, c, z, n));
        }
        let Some((c, zbuf)) = zstd.as_mut() else {
            return Ok(());
        };
        zbuf.clear();
        zbuf.reserve(zstd::zstd_safe::compress_bound(s.chunk.len()));
        c.compress_to_buffer(&s.chunk, zbuf)
            .map_err(|e| s.err(io::Error::other(format!("zstd: {e}"))))?;
        let n = s.chunk.len();
        s.chunk.clear();
        write_chunk(spills, cpu, zbuf, n)
    }

    /// Waits for the chunks the workers still compress (all written to the spill files).
    fn wait_chunks(&mut self) -> Result<(), OutputError> {
        let Self { pool, spills, .. } = self;
        match pool.as_mut() {
            Some(pool) => pool.wait_all(&mut |c, z, n| write_chunk(spills, c, z, n)),
            None => Ok(()),
        }
    }

    /// Size of CPU `cpu`'s data in the file: zstd adds the u32 chunk count (a CPU
    /// without pages has no data at all).
    fn data_size(&self, s: &Spill) -> u64 {
        match self.compression {
            Compression::Zstd if s.chunks > 0 => 4 + s.bytes,
            _ => s.bytes,
        }
    }

    /// Output path (as given).
    pub fn path(&self) -> &Path {
        self.target.path()
    }

    fn assemble(&mut self, summary: &RunSummary) -> Result<(), OutputError> {
        let Some(mut out) = self.out.take() else {
            return Err(OutputError::Closed);
        };
        for cpu in 0..self.spills.len() {
            self.flush_chunk(cpu)?;
        }
        self.wait_chunks()?;
        self.pool = None;
        let sizes: Vec<u64> = self.spills.iter().map(|s| self.data_size(s)).collect();
        let (head, data_start) = metadata(
            &self.meta,
            &summary.cpus,
            &sizes,
            self.version,
            self.compression,
        )?;
        out.write_all(&head).map_err(|e| out.error(e))?;
        let offsets = cpu_offsets(data_start, &sizes, self.meta.page_size as u64);
        let mut at = head.len() as u64;
        for ((s, &size), &off) in self.spills.iter_mut().zip(&sizes).zip(&offsets) {
            let pad = off - at;
            io::copy(&mut io::Read::take(io::repeat(0), pad), &mut out)
                .map_err(|e| out.error(e))?;
            at = off + size;
            if size == 0 {
                continue;
            }
            if self.compression == Compression::Zstd {
                out.write_all(&s.chunks.to_le_bytes())
                    .map_err(|e| out.error(e))?;
            }
            s.file
                .flush()
                .map_err(|e| OutputError::io(s.file.get_ref().path(), e))?;
            let f = s.file.get_mut().file_mut();
            f.seek(SeekFrom::Start(0))
                .map_err(|e| OutputError::io(s.file.get_ref().path(), e))?;
            let f = s.file.get_mut().file_mut();
            let mut src = io::Read::take(&mut *f, s.bytes);
            // Copy by hand: a read error names the spill file, a write error the output.
            let mut buf = vec![0u8; 1 << 16];
            let mut n = 0u64;
            loop {
                let k = match io::Read::read(&mut src, &mut buf) {
                    Ok(0) => break,
                    Ok(k) => k,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(OutputError::io(s.file.get_ref().path(), e)),
                };
                out.write_all(&buf[..k]).map_err(|e| out.error(e))?;
                n += k as u64;
            }
            if n != s.bytes {
                return Err(s.err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "spill file shrank",
                )));
            }
        }
        out.finish()
    }

    /// Removes every spill and temporary file.
    fn cleanup(&mut self) {
        self.pool = None;
        self.spills.clear();
        self.out = None;
    }

    /// The id of `hyptrace:trailing_lost`, its format added to the metadata on first use
    /// (files without trailing losses do not carry it).
    fn trailing_lost_id(&mut self) -> u16 {
        if let Some(f) = self.meta.formats.iter().find(|f| f.is_trailing_lost()) {
            return f.id;
        }
        let used = |id: u16| self.meta.formats.iter().any(|f| f.id == id);
        let id = std::iter::once(TRAILING_LOST_ID)
            .chain((1..=u16::MAX).rev())
            .find(|&id| !used(id))
            .unwrap_or(TRAILING_LOST_ID);
        self.meta
            .formats
            .push(crate::format::trailing_lost_format(id));
        id
    }

    /// Raw timestamp of the last event of `cpu` (its last page's time if it has no
    /// event, 0 without pages), read back from the spill file: the page path stays a
    /// plain copy.
    fn last_time(&mut self, cpu: u32) -> Result<u64, OutputError> {
        use std::os::unix::fs::FileExt;
        let ps = self.meta.page_size;
        let s = &mut self.spills[cpu as usize];
        let page = if self.compression == Compression::Zstd {
            // The last page is still in the pending chunk (see `page`).
            match s.chunk.len().checked_sub(ps) {
                Some(at) => s.chunk[at..].to_vec(),
                None => return Ok(0),
            }
        } else {
            let Some(at) = s.last_page else {
                return Ok(0);
            };
            s.file
                .flush()
                .map_err(|e| OutputError::io(s.file.get_ref().path(), e))?;
            let mut page = vec![0u8; ps];
            s.file
                .get_ref()
                .file()
                .read_exact_at(&mut page, at)
                .map_err(|e| s.err(e))?;
            page
        };
        let Some((ts, commit)) = hyptrace_abi::page::page_header(&page) else {
            return Ok(0);
        };
        let len = (commit & hyptrace_abi::page::COMMIT_LEN_MASK) as usize;
        let area = page.get(16..16usize.saturating_add(len)).unwrap_or(&[]);
        let mut last = ts;
        for e in hyptrace_abi::page::Events::new(area, ts).flatten() {
            last = e.ts;
        }
        Ok(last)
    }

    /// Closes the sink after an error: every temporary file removed.
    fn fail<T>(&mut self, e: OutputError) -> Result<T, OutputError> {
        self.cleanup();
        Err(e)
    }
}

impl TraceDatSink {
    /// Stores one page of `cpu`: exported, and retimed when `retime` (ring pages are;
    /// the `trailing_lost` page is built from a stored, already converted time).
    fn store_page(
        &mut self,
        cpu: u32,
        page: &[u8],
        missed: Option<u64>,
        retime: bool,
    ) -> Result<(), OutputError> {
        if self.out.is_none() {
            return Err(OutputError::Closed);
        }
        // The one page-writing path of every buffer this file gets.
        self.meta
            .file_page(cpu, page, missed, retime, &mut self.scratch)?;
        self.replaced += self.strings.sanitize_page(&mut self.scratch);
        if self.compression == Compression::Zstd {
            let c = cpu as usize;
            // Compress a full chunk only when the next page arrives: the CPU's last page
            // stays in memory for `trailing_lost`.
            if self.spills[c].chunk.len() >= ZSTD_CHUNK_PAGES * self.meta.page_size {
                if let Err(e) = self.flush_chunk(c) {
                    return self.fail(e);
                }
            }
            self.spills[c].chunk.extend_from_slice(&self.scratch);
            return Ok(());
        }
        let s = &mut self.spills[cpu as usize];
        if let Err(e) = s.file.write_all(&self.scratch) {
            let e = s.err(e);
            return self.fail(e);
        }
        s.last_page = Some(s.bytes);
        s.bytes += self.scratch.len() as u64;
        Ok(())
    }
}

impl PageSink for TraceDatSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Option<u64>) -> Result<(), OutputError> {
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
        self.meta.check_page(cpu, &self.scratch)?;
        let ts = match self.last_time(cpu) {
            Ok(t) => t,
            Err(e) => return self.fail(e),
        };
        let id = self.trailing_lost_id();
        let ps = self.meta.page_size;
        let mut raw = vec![0u8; ps];
        let mut payload = [0u8; crate::format::TRAILING_LOST_SIZE];
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
        self.store_page(cpu, &raw, Some(lost), false)
    }

    fn finish(mut self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        if self.replaced > 0 {
            // Shown as the text sink shows its one warning: the host prints no sink notes.
            eprintln!(
                "hyptrace: warning: {}: {} control or non-UTF-8 bytes in guest strings written as '?' (trace-cmd prints strings raw)",
                self.target.path().display(),
                self.replaced
            );
        }
        let r = self.assemble(summary);
        self.cleanup();
        r
    }
}

impl Drop for TraceDatSink {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// Appends one chunk record (u32 compressed size, u32 uncompressed size, the zstd frame
/// `z` of `n` bytes of pages) to CPU `cpu`'s spill file.
fn write_chunk(spills: &mut [Spill], cpu: usize, z: &[u8], n: usize) -> Result<(), OutputError> {
    let Some(s) = spills.get_mut(cpu) else {
        return Ok(());
    };
    // Both fit: a chunk is at most ZSTD_CHUNK_PAGES pages of at most MAX_PAGE_SIZE.
    let mut rec = [0u8; 8];
    rec[..4].copy_from_slice(&(z.len() as u32).to_le_bytes());
    rec[4..].copy_from_slice(&(n as u32).to_le_bytes());
    s.file.write_all(&rec).map_err(|e| s.err(e))?;
    s.file.write_all(z).map_err(|e| s.err(e))?;
    s.bytes += 8 + z.len() as u64;
    s.chunks += 1;
    Ok(())
}

/// Writes a whole trace.dat at once: `pages` are `(cpu, raw ring page, missed)` in order
/// per CPU (see [`PageSink::page`]).
pub fn write_trace_dat<'a>(
    path: impl AsRef<Path>,
    meta: TraceMeta,
    version: TraceDatVersion,
    pages: impl IntoIterator<Item = (u32, &'a [u8], Option<u64>)>,
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
    pages: impl IntoIterator<Item = (u32, &'a [u8], Option<u64>)>,
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
        if inline {
            s.pool = None;
            s.zstd = Some((zstd::bulk::Compressor::new(ZSTD_LEVEL).unwrap(), Vec::new()));
        } else {
            assert!(s.pool.is_some());
        }
        // CPU 2 gets no page; CPU 1 ends mid-chunk; losses and a trailing loss.
        let (a, b) = (test_pages(0, 95), test_pages(1, 23));
        for (i, p) in a.iter().enumerate() {
            s.page(0, p, (i == 40).then_some(3)).unwrap();
            if let Some(p) = b.get(i) {
                s.page(1, p, None).unwrap();
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

    /// A zstd sink dropped mid-run (chunks in flight) joins its workers and leaves no file.
    #[test]
    fn zstd_dropped_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.dat");
        let meta = TraceMeta::guest(4096, 2, crate::Clock::nanoseconds());
        let mut s =
            TraceDatSink::create_with(&path, meta, TraceDatVersion::V7, Compression::Zstd).unwrap();
        for p in test_pages(0, 200) {
            s.page(0, &p, None).unwrap();
        }
        drop(s);
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn strings_dedup() {
        let mut s = Strings(Vec::new());
        assert_eq!(s.id("options"), 0);
        assert_eq!(s.id("headers"), 8);
        assert_eq!(s.id("options"), 0);
    }
}
