//! trace.dat reader (v6, v7 uncompressed, v7 zstd), streaming and hostile-input safe.
//!
//! [`TraceFile::open`] reads only the metadata (headers, formats, cmdlines, options, the
//! CPU table) with positional reads; the event pages stay in the file. [`Records`] reads
//! each CPU's pages (or decompresses its v7 zstd chunks) one at a time: memory is bounded
//! by the CPU count times the page size (plus one compression chunk per CPU, at most
//! [`max_chunk`]), not by the file size. Every length and offset is checked against the
//! file, every loop is bounded by the bytes it consumes or by a fixed limit, and errors
//! are returned, never panics.

use crate::error::{DatError, DatProblem, UnsupportedDat};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use crate::clock::TscConversion;
use crate::export::{check_page_size, Missed};
use crate::format::{EventFormat, HeaderPage};
use crate::text::EventPrinter;

use super::{option, MAGIC};
use input::{FileCur, Input, Source};
use parse::Parser;

mod budget;
mod filter;
mod input;
#[cfg(test)]
mod instance_tests;
mod merge;
mod meta;
mod pages;
mod parse;
mod records;
mod report;
#[cfg(test)]
mod tests;

pub use budget::{max_chunk, MAX_CHUNK, MAX_RATIO, METADATA_BUDGET, OPTIONS_SHARE, READ_BUDGET};
pub use filter::{
    FilterCounts, FilterError, FilterErrorKind, FilterSet, FilteredSink, PageFilterError,
    PageFiltered, PageSource, ReportOutcome,
};
pub use merge::Records;
pub use pages::CpuPages;
pub use parse::MAX_INSTANCES;
pub use records::{page_as_read, page_damage, TraceItem, TraceRecord};
pub use report::ReportFilter;

/// One option as stored in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceOption {
    /// Option id (see [`super::option`]).
    pub id: u16,
    /// Raw option data.
    pub data: Vec<u8>,
}

/// Where the pages of one CPU lie in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuBuffer {
    /// CPU number.
    pub cpu: u32,
    /// File offset of the data (v7 zstd: of the chunk count).
    pub offset: u64,
    /// Size of the data in the file (compressed size for v7 zstd).
    pub size: u64,
}

impl CpuBuffer {
    /// Where the data ends in the file (not past `file_len`): `offset + size`, plus the
    /// u32 chunk count of compressed data, which trace-cmd leaves out of the size it
    /// writes (our writer counts it: 4 bytes of slack).
    fn end(&self, compressed: bool, file_len: u64) -> u64 {
        let count = if compressed { 4 } else { 0 };
        self.offset
            .saturating_add(self.size)
            .saturating_add(count)
            .min(file_len)
    }
}

/// A named buffer instance of a trace.dat (v7 BUFFER option with a name).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// Its name, as `trace-cmd report` prints it before each of its lines.
    pub name: String,
    /// Where each of its CPUs' pages are, in file order.
    pub cpus: Vec<CpuBuffer>,
}

pub use crate::damage::Damage;

impl Damage {
    /// Metadata damage: `what` (a section, an option) and the error that ended it.
    fn meta(what: &str, e: &DatError, fallback: &str) -> Self {
        let (offset, why) = match e {
            DatError::Format {
                offset,
                within,
                problem,
            } => {
                let at =
                    within.map_or_else(String::new, |b| format!(" at byte {b} of the section"));
                (
                    Some(*offset),
                    format!("{}{at}", crate::error_chain(problem)),
                )
            }
            e => (None, crate::error_chain(e)),
        };
        Self {
            cpu: None,
            offset,
            what: format!("{what} damaged ({why}); {fallback}"),
        }
    }
}

/// Most damage records kept at `open` (each names a section or an option list; more
/// cannot happen, the bound only caps memory on principle).
const MAX_META_DAMAGE: usize = 64;

/// A parsed trace.dat: its metadata in memory, its pages read from the file on demand
/// ([`TraceFile::records`]).
#[derive(Clone, Debug)]
pub struct TraceFile {
    /// File version (6 or 7).
    pub version: u32,
    /// Page size.
    pub page_size: usize,
    /// `sizeof(long)` of the traced kernel.
    pub long_size: u8,
    /// v7 compression `(name, version)` (`("none", "")` when uncompressed).
    pub compression: Option<(String, String)>,
    /// What header_page says.
    pub header_page: HeaderPage,
    /// Event formats (ftrace and others).
    pub formats: Vec<EventFormat>,
    /// Saved cmdlines, pid → comm.
    pub cmdlines: BTreeMap<i32, String>,
    /// CPU count from the file.
    pub nr_cpus: u32,
    /// Selected trace clock (the bracketed name of TRACECLOCK), if any.
    pub clock: Option<String>,
    /// TSC2NSEC option, if any.
    pub tsc2nsec: Option<TscConversion>,
    /// Sum of the OFFSET options (ns added after TSC2NSEC, as trace-cmd does).
    pub ts_offset: i64,
    /// The options the reader uses (clock, TSC2NSEC, OFFSET, CPU count, CPUSTAT, the v7
    /// section offsets), in file order; the others are counted in
    /// [`TraceFile::options_skipped`] (the top buffer's CPU table is [`TraceFile::cpus`]).
    pub options: Vec<TraceOption>,
    /// How many options were not kept in [`TraceFile::options`] (ids the reader does not
    /// use, buffers other than the top one).
    pub options_skipped: u64,
    /// The file's named buffer instances (trace-cmd's `-B NAME`, `hyptrace collect`'s
    /// VMs), in file order, at most [`MAX_INSTANCES`]: [`TraceFile::records`] merges
    /// their events with the top-level buffer's ([`TraceRecord::instance`]).
    pub instances: Vec<Instance>,
    /// Where each CPU's pages are, in file order.
    pub cpus: Vec<CpuBuffer>,
    /// Damaged metadata `open` read past (a fallback or an omission for each; CPU data
    /// damage is found while reading, see [`Records::take_damage`]).
    pub damage: Vec<Damage>,
    /// Whether the CPU data is zstd-compressed (v7).
    compressed: bool,
    src: Source,
    /// What the CPUs' readers share to decompress chunks.
    unzstd: Arc<std::sync::Mutex<pages::Unzstd>>,
    /// Kernel symbols (kallsyms and printk formats sections) for `%pS` and plugins.
    pub symbols: std::sync::Arc<crate::symbols::KernelSymbols>,
    printers: BTreeMap<u16, EventPrinter>,
    /// The longest instance name, in bytes (the width `report` aligns names to).
    name_width: usize,
}

impl TraceFile {
    /// Opens a trace.dat file and parses its metadata (the pages are read later, a few
    /// at a time, by [`TraceFile::records`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, DatError> {
        let p = path.as_ref();
        let file = File::open(p).map_err(|e| DatError::io(p, e))?;
        let len = file.metadata().map_err(|e| DatError::io(p, e))?.len();
        Self::from_source(Source::File {
            file: Arc::new(file),
            path: p.to_path_buf(),
            len,
        })
    }

    /// Parses a trace.dat held in memory (copied).
    pub fn parse(data: &[u8]) -> Result<Self, DatError> {
        Self::from_source(Source::Mem(Arc::from(data)))
    }

    fn from_source(src: Source) -> Result<Self, DatError> {
        let mut c = FileCur::new(&src, 0);
        if c.bytes(10, "magic")? != MAGIC {
            return Err(DatError::format(0u64, DatProblem::Magic));
        }
        let ver = c.cstr("version")?;
        let version: u32 = ver
            .parse()
            .map_err(|_| DatError::format(10u64, DatProblem::Version(ver.clone())))?;
        if c.u8("endianness")? != 0 {
            return Err(DatError::Unsupported(UnsupportedDat::BigEndian));
        }
        let long_size = c.u8("long size")?;
        let page_size = c.u32("page size")? as usize;
        check_page_size(page_size).map_err(|_| {
            DatError::format(c.pos.saturating_sub(4), DatProblem::PageSize(page_size))
        })?;
        let pos = c.pos;
        let f = TraceFile {
            version,
            page_size,
            long_size,
            compression: None,
            header_page: HeaderPage {
                commit_size: 8,
                data_offset: 16,
                data_size: page_size - 16,
            },
            formats: Vec::new(),
            cmdlines: BTreeMap::new(),
            nr_cpus: 0,
            clock: None,
            tsc2nsec: None,
            ts_offset: 0,
            options: Vec::new(),
            options_skipped: 0,
            instances: Vec::new(),
            cpus: Vec::new(),
            damage: Vec::new(),
            compressed: false,
            src: src.clone(),
            unzstd: Default::default(),
            symbols: Default::default(),
            printers: BTreeMap::new(),
            name_width: 0,
        };
        let mut p = Parser::new(f);
        let mut c = FileCur::new(&src, pos);
        match version {
            6 => p.parse_v6(&mut c)?,
            7 => p.parse_v7(&mut c)?,
            v => return Err(DatError::Unsupported(UnsupportedDat::Version(v))),
        }
        p.finish();
        let mut f = p.f;
        f.compressed = p.compressed;
        if f.header_page.commit_size != 8 || f.header_page.data_offset != 16 {
            return Err(DatError::Unsupported(UnsupportedDat::HeaderPage(
                f.header_page,
            )));
        }
        if let Some(why) = budget::check_read_memory(f.readers(), f.page_size) {
            return Err(DatError::Unsupported(why));
        }
        if f.nr_cpus == 0 {
            f.nr_cpus = f
                .cpus
                .iter()
                .map(|c| c.cpu.saturating_add(1))
                .max()
                .unwrap_or(0);
        }
        f.name_width = f.instances.iter().map(|i| i.name.len()).max().unwrap_or(0);
        // The printers of every event format, by id (the formatter of `report`).
        f.printers = f
            .formats
            .iter()
            .map(|e| {
                let p = EventPrinter::with_symbols(e.clone(), f.symbols.clone(), f.long_size);
                (e.id, p)
            })
            .collect();
        Ok(f)
    }

    /// Whether the CPU data is zstd-compressed (v7).
    pub fn is_compressed(&self) -> bool {
        self.compressed
    }

    /// Converts a raw page timestamp to ns the way trace-cmd does (TSC2NSEC, if
    /// present, then the OFFSET options).
    pub fn ts_ns(&self, raw: u64) -> u64 {
        let ns = match &self.tsc2nsec {
            Some(t) => t.trace_cmd_ns(raw),
            None => raw,
        };
        ns.wrapping_add_signed(self.ts_offset)
    }

    /// The format of event `id`.
    pub fn format(&self, id: u16) -> Option<&EventFormat> {
        self.printers.get(&id).map(|p| &p.format)
    }

    /// The printer (format + parsed print fmt) of event `id`.
    pub fn printer(&self, id: u16) -> Option<&EventPrinter> {
        self.printers.get(&id)
    }

    /// CPUSTAT texts, in file order.
    pub fn cpu_stats(&self) -> Vec<String> {
        self.options
            .iter()
            .filter(|o| o.id == option::CPUSTAT)
            .map(|o| {
                String::from_utf8_lossy(&o.data)
                    .trim_end_matches('\0')
                    .to_string()
            })
            .collect()
    }

    /// The per-CPU stats block `trace-cmd report --stat` prints (after the `cpus=` line).
    pub fn stat_text(&self) -> String {
        let mut s = String::from(
            "\nKernel buffer statistics:\n  Note: \"entries\" are the entries left in the kernel ring buffer and are not\n        recorded in the trace data. They should all be zero.\n\n",
        );
        for t in self.cpu_stats() {
            s.push_str(&t);
            if !t.ends_with('\n') {
                s.push('\n');
            }
            s.push('\n');
        }
        s
    }

    /// The pages of `self.cpus[index]`, one at a time (decompressed).
    pub fn pages(&self, index: usize) -> Option<CpuPages> {
        let b = self.cpus.get(index)?;
        Some(CpuPages::new(self, b, self.readers()))
    }

    /// The pages of every CPU of `self.cpus`, in order ([`TraceFile::pages`] of each).
    pub fn all_pages(&self) -> Vec<CpuPages> {
        let readers = self.readers();
        self.cpus
            .iter()
            .map(|b| CpuPages::new(self, b, readers))
            .collect()
    }

    /// The pages of every CPU of instance `i` ([`TraceFile::instances`]), in order.
    pub fn instance_pages(&self, i: usize) -> Option<Vec<CpuPages>> {
        let readers = self.readers();
        let inst = self.instances.get(i)?;
        Some(
            inst.cpus
                .iter()
                .map(|b| CpuPages::new(self, b, readers))
                .collect(),
        )
    }

    /// How many CPUs have data, of every buffer (each reads within its share of the
    /// read budget).
    fn readers(&self) -> usize {
        self.buffers()
            .map(|(_, cpus)| cpus.iter().filter(|b| b.size > 0).count())
            .sum()
    }

    /// Every buffer's CPU table with its instance number: 0 the top level, `i + 1`
    /// [`TraceFile::instances`]`[i]`.
    fn buffers(&self) -> impl Iterator<Item = (u16, &[CpuBuffer])> {
        let named = self.instances.iter().map(|i| i.cpus.as_slice());
        (0u16..).zip(std::iter::once(self.cpus.as_slice()).chain(named))
    }

    /// The name of instance number `instance` ([`TraceRecord::instance`]; `None`: the
    /// top level).
    pub fn instance_name(&self, instance: u16) -> Option<&str> {
        let i = usize::from(instance).checked_sub(1)?;
        self.instances.get(i).map(|i| i.name.as_str())
    }
}

impl TraceFile {
    /// Number of events (drop markers, bad pages and hyptrace's own `trailing_lost`
    /// events not counted; a read error ends the count).
    pub fn event_count(&self) -> usize {
        let mut n = 0;
        let mut r = self.records();
        while let Some(i) = r.next_item() {
            if matches!(&i, TraceItem::Event(r) if !self.is_trailing_lost(r)) {
                n += 1;
            }
        }
        n
    }

    /// Whether `r` is hyptrace's `trailing_lost` event (the record that carries the drop
    /// marker of events lost after a CPU's last page; see `TraceDatSink`).
    pub fn is_trailing_lost(&self, r: &TraceRecord<'_>) -> bool {
        r.payload
            .get(..2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .and_then(|id| self.format(id))
            .is_some_and(EventFormat::is_trailing_lost)
    }

    /// The times (ns) of the first and the last event of the top-level buffer's CPU
    /// `cpu` (`None` without events), for `report --first-event/--last-event` (as
    /// trace-cmd, of the top level only); a read error is returned.
    pub fn cpu_span(&self, cpu: u32) -> Result<Option<(u64, u64)>, DatError> {
        let mut span: Option<(u64, u64)> = None;
        let mut r = self.records_where(|i, c| i == 0 && c == cpu);
        while let Some(i) = r.next_item() {
            if let TraceItem::Event(e) = i {
                span = Some(span.map_or((e.ts_ns, e.ts_ns), |(f, _)| (f, e.ts_ns)));
            }
        }
        match r.take_error() {
            Some(e) => Err(e),
            None => Ok(span),
        }
    }

    /// Sum of the drop markers' counts and the number of markers without a count.
    pub fn dropped(&self) -> (u64, usize) {
        let (mut n, mut unknown) = (0u64, 0usize);
        let mut r = self.records();
        while let Some(i) = r.next_item() {
            match i {
                TraceItem::Dropped {
                    missed: Missed::Count(c),
                    ..
                } => n = n.saturating_add(c),
                TraceItem::Dropped { .. } => unknown += 1,
                _ => {}
            }
        }
        (n, unknown)
    }

    /// Debug summary (version, page size, CPUs, formats), one `key: value` per line.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "version: {}", self.version);
        let _ = writeln!(s, "page size: {}", self.page_size);
        let _ = writeln!(s, "cpus: {}", self.nr_cpus);
        let _ = writeln!(s, "clock: {}", self.clock.as_deref().unwrap_or("-"));
        if let Some(t) = &self.tsc2nsec {
            let _ = writeln!(
                s,
                "tsc2nsec: mult={} shift={} offset={}",
                t.mult, t.shift, t.offset
            );
        }
        if self.ts_offset != 0 {
            let _ = writeln!(s, "offset: {}", self.ts_offset);
        }
        for f in &self.formats {
            let _ = writeln!(s, "event: {}:{} id={}", f.system, f.name, f.id);
        }
        s
    }
}
