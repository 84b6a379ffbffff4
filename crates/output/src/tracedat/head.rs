//! The metadata of a trace.dat (everything but the CPU data): v6's flat header, v7's
//! sections and options, built for a [`Layout`] of the CPU data; and [`bound`], the
//! most bytes it can take for a trace, known before the first page.

use super::cpuout::{compressor, zstd_error};
use super::ids::{option, MAGIC};
use super::params::{Compression, TraceDatVersion};
use crate::error::MetaError;
use crate::sink::{KernelCpuStat, TraceMeta};
use crate::OutputError;
use hyptrace_format::format::{header_page_text, EventFormat, HEADER_EVENT_TEXT};

/// Trace clocks the kernel lists in `trace_clock`; the TRACECLOCK text brackets ours.
const CLOCKS: &[&str] = &[
    "local", "global", "counter", "uptime", "perf", "mono", "mono_raw", "boot", "tai", "x86-tsc",
];

pub(super) fn clock_text(name: &str) -> String {
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

pub(super) fn align_up(v: u64, a: u64) -> u64 {
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

/// Builds the v6 metadata (everything before the first page) for CPU data at `layout`.
fn v6_metadata(meta: &TraceMeta, stats: &[KernelCpuStat], layout: &Layout) -> Vec<u8> {
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
    for (&off, &size) in layout.offsets.iter().zip(&layout.sizes) {
        v.extend_from_slice(&off.to_le_bytes());
        v.extend_from_slice(&size.to_le_bytes());
    }
    let clock = clock_text(&meta.clock.name);
    v.extend_from_slice(&(clock.len() as u64).to_le_bytes());
    v.extend_from_slice(clock.as_bytes());
    v
}

pub(super) struct Strings(pub(super) Vec<u8>);

impl Strings {
    pub(super) fn id(&mut self, s: &str) -> u32 {
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
    // As trace-cmd compresses: its level, no content size in the frame.
    let z = compressor(None)?
        .compress(content)
        .map_err(|e| zstd_error(None, e))?;
    let too_big = |_| OutputError::Meta(MetaError::SectionTooLarge(content.len()));
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

/// Where each CPU's data lies in the file (index = CPU).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Layout {
    pub(super) offsets: Vec<u64>,
    pub(super) sizes: Vec<u64>,
}

impl Layout {
    /// The first CPU at `data_start`, each next one on the first page boundary after the
    /// previous one's end (as trace-cmd lays them out; uncompressed data is whole pages,
    /// so the starts are contiguous).
    pub(super) fn contiguous(data_start: u64, sizes: &[u64], page: u64) -> Self {
        let mut off = data_start;
        let offsets = sizes
            .iter()
            .map(|&s| {
                let at = off;
                off = align_up(off + s, page);
                at
            })
            .collect();
        Self {
            offsets,
            sizes: sizes.to_vec(),
        }
    }

    /// End of the CPU data: the furthest end of a CPU's data (`data_start` without CPUs).
    pub(super) fn end(&self, data_start: u64) -> u64 {
        self.offsets
            .iter()
            .zip(&self.sizes)
            .map(|(o, s)| o + s)
            .max()
            .unwrap_or(data_start)
    }
}

/// Builds the v7 metadata: header, sections, options, strings, and the flyrecord section
/// header, for CPU data at `layout` (from `data_start`).
fn v7_metadata(
    meta: &TraceMeta,
    stats: &[KernelCpuStat],
    layout: &Layout,
    data_start: u64,
    compression: Compression,
) -> Result<Vec<u8>, OutputError> {
    let v7 = V7Metadata {
        meta,
        stats,
        layout,
        data_start,
        z: compression == Compression::Zstd,
        instances: &[],
    };
    // Built twice: the first build gives the length, which the offsets do not change
    // (fixed-size words), hence where the flyrecord header is.
    let (first, _) = v7.build(0)?;
    let (v, _) = v7.build(first.len() as u64 - 16)?;
    debug_assert_eq!(v.len(), first.len());
    Ok(v)
}

/// A named buffer instance of a multi-buffer v7 file (trace-cmd's `-B NAME`): its
/// flyrecord section at `flyrecord_at`, its CPU data at `layout`.
pub(super) struct Instance<'a> {
    pub(super) name: &'a str,
    pub(super) flyrecord_at: u64,
    pub(super) layout: Layout,
}

/// The v7 metadata of a file whose top-level buffer is `top` (from `data_start`) and
/// which has the named `instances` after it; returns it and the string id of "buffer
/// flyrecord" (each instance's flyrecord section header names it). Its length does not
/// depend on the offsets (fixed-size words): a first build with any gives it.
pub(super) fn v7_instances_metadata(
    meta: &TraceMeta,
    top: &Layout,
    data_start: u64,
    compression: Compression,
    instances: &[Instance<'_>],
) -> Result<(Vec<u8>, u32), OutputError> {
    let v7 = V7Metadata {
        meta,
        stats: &[],
        layout: top,
        data_start,
        z: compression == Compression::Zstd,
        instances,
    };
    let (first, _) = v7.build(0)?;
    v7.build(first.len() as u64 - 16)
}

/// A flyrecord section header (`TRACECMD_OPTION_BUFFER`, "buffer flyrecord"): its
/// content (`size` bytes: padding and CPU data) follows it.
pub(super) fn flyrecord_header(name_id: u32, compression: Compression, size: u64) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..2].copy_from_slice(&option::BUFFER.to_le_bytes());
    let flags = if compression == Compression::Zstd {
        SEC_FL_COMPRESS
    } else {
        0
    };
    v[2..4].copy_from_slice(&flags.to_le_bytes());
    v[4..8].copy_from_slice(&name_id.to_le_bytes());
    v[8..].copy_from_slice(&size.to_le_bytes());
    v
}

/// The data of a BUFFER option: the flyrecord section's offset, the buffer's name (""
/// for the top level), clock, page size and CPU table (offset and size of each CPU's
/// data).
fn buffer_option(at: u64, name: &str, clock: &str, page_size: usize, layout: &Layout) -> Vec<u8> {
    let mut buf = Vec::new();
    buf.extend_from_slice(&at.to_le_bytes());
    buf.extend_from_slice(&cstr(name));
    buf.extend_from_slice(&cstr(clock));
    buf.extend_from_slice(&(page_size as u32).to_le_bytes());
    buf.extend_from_slice(&(layout.sizes.len() as u32).to_le_bytes());
    for (cpu, (&s, &off)) in layout.sizes.iter().zip(&layout.offsets).enumerate() {
        buf.extend_from_slice(&(cpu as u32).to_le_bytes());
        buf.extend_from_slice(&off.to_le_bytes());
        buf.extend_from_slice(&s.to_le_bytes());
    }
    buf
}

/// What the v7 metadata is built from.
struct V7Metadata<'a> {
    meta: &'a TraceMeta,
    stats: &'a [KernelCpuStat],
    layout: &'a Layout,
    /// Where the CPU data starts (the end of the padding after the metadata).
    data_start: u64,
    /// zstd-compressed sections.
    z: bool,
    /// Named buffers after the top-level one's data (none but in `collect`'s files).
    instances: &'a [Instance<'a>],
}

impl V7Metadata<'_> {
    /// The metadata with the flyrecord section header at `flyrecord_at`, and the string
    /// id of "buffer flyrecord".
    fn build(&self, flyrecord_at: u64) -> Result<(Vec<u8>, u32), OutputError> {
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
        let opts = self.options(&sections, flyrecord_at);
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
        let end = self.layout.end(self.data_start);
        v.extend_from_slice(&option::BUFFER.to_le_bytes());
        let flags = if z { SEC_FL_COMPRESS } else { 0 };
        v.extend_from_slice(&flags.to_le_bytes());
        let name_id = strings.id("buffer flyrecord");
        v.extend_from_slice(&name_id.to_le_bytes());
        v.extend_from_slice(&end.saturating_sub(at + 16).to_le_bytes());
        Ok((v, name_id))
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
    /// top-level buffer (its CPU data at the layout), and the end.
    fn options(&self, sections: &[(u16, u64)], flyrecord_at: u64) -> Vec<u8> {
        let meta = self.meta;
        let mut opts = Vec::new();
        common_options(meta, self.stats, &mut opts);
        push_opt(&mut opts, option::CPUCOUNT, &meta.nr_cpus.to_le_bytes());
        for &(id, off) in sections {
            push_opt(&mut opts, id, &off.to_le_bytes());
        }
        // The top-level buffer: an empty name.
        let (clock, ps) = (&meta.clock.name, meta.page_size);
        let top = buffer_option(flyrecord_at, "", clock, ps, self.layout);
        push_opt(&mut opts, option::BUFFER, &top);
        for i in self.instances {
            let b = buffer_option(i.flyrecord_at, i.name, clock, ps, &i.layout);
            push_opt(&mut opts, option::BUFFER, &b);
        }
        push_opt(&mut opts, option::DONE, &0u64.to_le_bytes());
        opts
    }
}

/// Where the CPU data goes, for [`metadata`].
pub(super) enum Place<'a> {
    /// Right after the metadata, from the next page boundary, contiguous: the sizes.
    After(&'a [u64]),
    /// At a layout fixed already, the data from `data_start` (the metadata must end
    /// before).
    At { data_start: u64, layout: &'a Layout },
}

/// Builds the complete metadata for `version` with the CPU data at `place`; returns it
/// and the layout.
pub(super) fn metadata(
    meta: &TraceMeta,
    stats: &[KernelCpuStat],
    version: TraceDatVersion,
    compression: Compression,
    place: Place<'_>,
) -> Result<(Vec<u8>, Layout), OutputError> {
    let build = |layout: &Layout, data_start: u64| match version {
        TraceDatVersion::V6 => Ok(v6_metadata(meta, stats, layout)),
        TraceDatVersion::V7 => v7_metadata(meta, stats, layout, data_start, compression),
    };
    let page = meta.page_size as u64;
    match place {
        Place::After(sizes) => {
            // The offsets do not change the length: the first build gives it.
            let len = build(&Layout::contiguous(0, sizes, page), 0)?.len() as u64;
            let start = align_up(len, page);
            let layout = Layout::contiguous(start, sizes, page);
            Ok((build(&layout, start)?, layout))
        }
        Place::At { data_start, layout } => {
            let v = build(layout, data_start)?;
            if v.len() as u64 > data_start {
                return Err(OutputError::Meta(MetaError::PastData {
                    bytes: v.len(),
                    data_start,
                }));
            }
            Ok((v, layout.clone()))
        }
    }
}

/// The most bytes the metadata of a trace with `meta` (its `trailing_lost` format added
/// when `trailing` says which; CPU statistics of any value) can take, rounded up to the
/// page size: where CPU data written before the metadata starts.
pub(super) fn bound(
    meta: &TraceMeta,
    trailing: &EventFormat,
    version: TraceDatVersion,
    compression: Compression,
) -> Result<u64, OutputError> {
    let n = meta.nr_cpus as usize;
    let worst = KernelCpuStat {
        entries: u64::MAX,
        overrun: u64::MAX,
        commit_overrun: u64::MAX,
        bytes: u64::MAX,
        oldest_event_ts: u64::MAX,
        now_ts: u64::MAX,
        dropped_events: u64::MAX,
        read_events: u64::MAX,
    };
    let stats = vec![worst; n];
    let mut with = meta.clone();
    if !with.formats.iter().any(EventFormat::is_trailing_lost) {
        with.formats.push(trailing.clone());
    }
    let layout = Layout {
        offsets: vec![0; n],
        sizes: vec![0; n],
    };
    let mut most = 0;
    for m in [meta, &with] {
        let place = Place::At {
            data_start: u64::MAX,
            layout: &layout,
        };
        let (v, _) = metadata(m, &stats, version, compression, place)?;
        most = most.max(v.len() as u64);
    }
    Ok(align_up(most, meta.page_size as u64))
}
