//! trace.dat reader (v6, v7 uncompressed, v7 zstd), hostile-input safe: every length
//! and offset is checked, every loop is bounded by the bytes it consumes or by a fixed
//! limit, and errors are returned, never panics.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use hyptrace_abi::page::{page_header, Events, RB_MISSED_EVENTS, RB_MISSED_STORED};

use super::{option, MAGIC};
use crate::clock::TscConversion;
use crate::export::{check_page_size, Missed};
use crate::format::{EventFormat, HeaderPage};
use crate::merge::{Merged, Merger};
use crate::text::{format_drop, format_guest_line, EventPrinter};
use crate::OutputError;

/// trace-cmd masks `commit` with 27 bits when reading.
const READ_COMMIT_MASK: u64 = (1 << 27) - 1;
/// Most options sections followed through DONE links.
const MAX_OPTION_SECTIONS: usize = 1024;
/// Largest decompressed chunk/section accepted.
const MAX_DECOMPRESSED: usize = 64 << 20;

/// One option as stored in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceOption {
    /// Option id (see [`super::option`]).
    pub id: u16,
    /// Raw option data.
    pub data: Vec<u8>,
}

/// The pages of one CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuBuffer {
    /// CPU number.
    pub cpu: u32,
    /// Page data (whole pages; a trailing partial page is ignored).
    pub data: Vec<u8>,
}

/// A parsed trace.dat.
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
    /// All options, in file order.
    pub options: Vec<TraceOption>,
    /// Pages per CPU, by CPU number.
    pub cpus: Vec<CpuBuffer>,
    /// Kernel symbols (kallsyms and printk formats sections) for `%pS` and plugins.
    pub symbols: std::sync::Arc<crate::symbols::KernelSymbols>,
    printers: BTreeMap<u16, EventPrinter>,
}

struct Cur<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Offset of `buf` in the file, for error messages.
    base: u64,
}

impl<'a> Cur<'a> {
    fn new(buf: &'a [u8], pos: usize, base: u64) -> Self {
        Self { buf, pos, base }
    }

    fn err(&self, what: &str) -> OutputError {
        OutputError::format(self.base + self.pos as u64, what.to_string())
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], OutputError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err(what))?;
        let b = &self.buf[self.pos..end];
        self.pos = end;
        Ok(b)
    }

    fn u8(&mut self, what: &str) -> Result<u8, OutputError> {
        Ok(self.bytes(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, OutputError> {
        let b = self.bytes(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, OutputError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, OutputError> {
        let b = self.bytes(8, what)?;
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        Ok(u64::from_le_bytes(w))
    }

    fn len64(&mut self, what: &str) -> Result<usize, OutputError> {
        let n = self.u64(what)?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len())
            .ok_or_else(|| self.err(what))
    }

    fn cstr(&mut self, what: &str) -> Result<String, OutputError> {
        let rest = &self.buf[self.pos.min(self.buf.len())..];
        let n = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.err(what))?;
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(s)
    }

    fn text(&mut self, n: usize, what: &str) -> Result<String, OutputError> {
        Ok(String::from_utf8_lossy(self.bytes(n, what)?).into_owned())
    }
}

/// zstd-decompresses `input` into exactly `size` bytes.
fn unzstd(input: &[u8], size: usize, at: u64) -> Result<Vec<u8>, OutputError> {
    if size > MAX_DECOMPRESSED {
        return Err(OutputError::format(
            at,
            format!("compressed block claims {size} bytes"),
        ));
    }
    let mut out = vec![0u8; size];
    let mut dec = ruzstd::decoding::FrameDecoder::new();
    let n = dec
        .decode_all(input, &mut out)
        .map_err(|e| OutputError::format(at, format!("zstd: {e}")))?;
    if n != size {
        return Err(OutputError::format(
            at,
            format!("zstd: {n} bytes, expected {size}"),
        ));
    }
    Ok(out)
}

struct Parser<'a> {
    file: &'a [u8],
    compressed: bool,
    f: TraceFile,
}

fn parse_header_info(c: &mut Cur<'_>) -> Result<HeaderPage, OutputError> {
    if c.bytes(12, "header_page tag")? != b"header_page\0" {
        return Err(c.err("expected header_page"));
    }
    let n = c.len64("header_page size")?;
    let hp = HeaderPage::parse(&c.text(n, "header_page text")?)?;
    if c.bytes(13, "header_event tag")? != b"header_event\0" {
        return Err(c.err("expected header_event"));
    }
    let n = c.len64("header_event size")?;
    c.bytes(n, "header_event text")?;
    Ok(hp)
}

fn parse_ftrace_events(c: &mut Cur<'_>, out: &mut Vec<EventFormat>) -> Result<(), OutputError> {
    let n = c.u32("ftrace event count")?;
    for _ in 0..n {
        let len = c.len64("ftrace event size")?;
        let t = c.text(len, "ftrace event format")?;
        if let Ok(f) = EventFormat::parse("ftrace", &t) {
            out.push(f);
        }
    }
    Ok(())
}

fn parse_event_formats(c: &mut Cur<'_>, out: &mut Vec<EventFormat>) -> Result<(), OutputError> {
    let systems = c.u32("system count")?;
    for _ in 0..systems {
        let sys = c.cstr("system name")?;
        let n = c.u32("event count")?;
        for _ in 0..n {
            let len = c.len64("event format size")?;
            let t = c.text(len, "event format")?;
            if let Ok(f) = EventFormat::parse(&sys, &t) {
                out.push(f);
            }
        }
    }
    Ok(())
}

fn u32_sized<'a>(c: &mut Cur<'a>, what: &str) -> Result<&'a [u8], OutputError> {
    let n = c.u32(what)? as usize;
    c.bytes(n, what)
}

fn parse_cmdlines(c: &mut Cur<'_>, out: &mut BTreeMap<i32, String>) -> Result<(), OutputError> {
    let n = c.len64("cmdlines size")?;
    let t = c.text(n, "cmdlines")?;
    for line in t.lines() {
        if let Some((pid, comm)) = line.split_once(' ') {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                out.insert(pid, comm.to_string());
            }
        }
    }
    Ok(())
}

fn selected_clock(text: &str) -> Option<String> {
    let s = text.find('[')?;
    let e = text[s..].find(']')? + s;
    Some(text[s + 1..e].to_string())
}

impl<'a> Parser<'a> {
    fn symbols(&mut self) -> &mut crate::symbols::KernelSymbols {
        std::sync::Arc::make_mut(&mut self.f.symbols)
    }

    fn option(&mut self, id: u16, data: &[u8]) {
        match id {
            option::TRACECLOCK => {
                let t = String::from_utf8_lossy(data);
                if let Some(c) = selected_clock(&t) {
                    self.f.clock = Some(c);
                }
            }
            option::TSC2NSEC if data.len() >= 16 => {
                let mut c = Cur::new(data, 0, 0);
                if let (Ok(mult), Ok(shift), Ok(offset)) = (c.u32(""), c.u32(""), c.u64("")) {
                    self.f.tsc2nsec = Some(TscConversion {
                        mult,
                        shift,
                        offset,
                    });
                }
            }
            option::CPUCOUNT if data.len() >= 4 => {
                self.f.nr_cpus = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
            }
            _ => {}
        }
        self.f.options.push(TraceOption {
            id,
            data: data.to_vec(),
        });
    }

    /// Reads a v7 section at `off`: checks its id, decompresses it if flagged.
    fn section(&self, off: u64, want: u16) -> Result<Vec<u8>, OutputError> {
        let start = usize::try_from(off).map_err(|_| OutputError::format(off, "section offset"))?;
        let mut c = Cur::new(self.file, start, 0);
        if start >= self.file.len() {
            return Err(OutputError::format(
                off,
                "section offset past the end of the file",
            ));
        }
        let id = c.u16("section id")?;
        let flags = c.u16("section flags")?;
        let _string = c.u32("section name")?;
        let size = c.len64("section size")?;
        if id != want {
            return Err(OutputError::format(
                off,
                format!("section id {id}, expected {want}"),
            ));
        }
        let body = c.bytes(size, "section body")?;
        if flags & 1 != 0 {
            if !self.compressed {
                return Err(OutputError::format(
                    off,
                    "compressed section in an uncompressed file",
                ));
            }
            let mut b = Cur::new(body, 0, off + 16);
            let csize = b.u32("compressed size")? as usize;
            let usize_ = b.u32("uncompressed size")? as usize;
            let data = b.bytes(csize, "compressed data")?;
            unzstd(data, usize_, off + 16)
        } else {
            Ok(body.to_vec())
        }
    }

    fn parse_v6(&mut self, c: &mut Cur<'a>) -> Result<(), OutputError> {
        self.f.header_page = parse_header_info(c)?;
        parse_ftrace_events(c, &mut self.f.formats)?;
        parse_event_formats(c, &mut self.f.formats)?;
        let syms = self.symbols();
        syms.parse_kallsyms(u32_sized(c, "kallsyms")?);
        syms.parse_printk(u32_sized(c, "printk formats")?);
        parse_cmdlines(c, &mut self.f.cmdlines)?;
        self.f.nr_cpus = c.u32("cpu count")?;
        let mut has_clock = false;
        // Blocks: "options  ", "latency  ", "flyrecord"; each iteration consumes bytes.
        loop {
            let tag = c.bytes(10, "data kind")?;
            match tag {
                b"options  \0" => loop {
                    let id = c.u16("option id")?;
                    if id == option::DONE {
                        break;
                    }
                    let n = c.u32("option size")? as usize;
                    let d = c.bytes(n, "option data")?;
                    has_clock |= id == option::TRACECLOCK;
                    self.option(id, d);
                },
                b"latency  \0" => {
                    return Err(OutputError::Unsupported("latency (text) trace.dat".into()))
                }
                b"flyrecord\0" => break,
                _ => return Err(c.err("expected options or flyrecord")),
            }
        }
        if self.f.nr_cpus > 65536 {
            return Err(c.err("too many CPUs"));
        }
        let mut table = Vec::new();
        for _ in 0..self.f.nr_cpus {
            let off = c.u64("cpu data offset")?;
            let size = c.u64("cpu data size")?;
            table.push((off, size));
        }
        if has_clock {
            let n = c.len64("trace clock size")?;
            let t = c.text(n, "trace clock")?;
            if let Some(s) = selected_clock(&t) {
                self.f.clock = Some(s);
            }
        }
        for (cpu, (off, size)) in table.into_iter().enumerate() {
            let data = self.slice(off, size)?.to_vec();
            self.f.cpus.push(CpuBuffer {
                cpu: cpu as u32,
                data,
            });
        }
        Ok(())
    }

    fn slice(&self, off: u64, size: u64) -> Result<&'a [u8], OutputError> {
        let s = usize::try_from(off).ok();
        let n = usize::try_from(size).ok();
        match (s, n) {
            (Some(s), Some(n)) if s.checked_add(n).is_some_and(|e| e <= self.file.len()) => {
                Ok(&self.file[s..s + n])
            }
            _ => Err(OutputError::format(
                off,
                format!("cpu data of {size} bytes runs past the end of the file"),
            )),
        }
    }

    fn parse_v7(&mut self, c: &mut Cur<'a>) -> Result<(), OutputError> {
        let name = c.cstr("compression name")?;
        let ver = c.cstr("compression version")?;
        self.compressed = match name.as_str() {
            "none" | "" => false,
            "zstd" => true,
            other => return Err(OutputError::Unsupported(format!("compression {other}"))),
        };
        self.f.compression = Some((name, ver));
        let mut next = c.u64("options offset")?;
        let mut seen = BTreeSet::new();
        let mut sections: BTreeMap<u16, u64> = BTreeMap::new();
        let mut buffers = Vec::new();
        while next != 0 {
            if !seen.insert(next) || seen.len() > MAX_OPTION_SECTIONS {
                return Err(OutputError::format(next, "options sections loop"));
            }
            let body = self.section(next, 0)?;
            let mut o = Cur::new(&body, 0, next + 16);
            next = 0;
            loop {
                let id = o.u16("option id")?;
                let n = o.u32("option size")? as usize;
                let d = o.bytes(n, "option data")?;
                if id == option::DONE {
                    if d.len() >= 8 {
                        let mut w = [0u8; 8];
                        w.copy_from_slice(&d[..8]);
                        next = u64::from_le_bytes(w);
                    }
                    break;
                }
                match id {
                    option::HEADER_INFO..=option::CMDLINES if d.len() >= 8 => {
                        let mut w = [0u8; 8];
                        w.copy_from_slice(&d[..8]);
                        sections.insert(id, u64::from_le_bytes(w));
                    }
                    option::BUFFER => buffers.push(d.to_vec()),
                    _ => {}
                }
                self.option(id, d);
            }
        }
        let need = |id: u16| {
            sections
                .get(&id)
                .copied()
                .ok_or_else(|| OutputError::format(0u64, format!("no section {id}")))
        };
        let hi = self.section(need(option::HEADER_INFO)?, option::HEADER_INFO)?;
        self.f.header_page = parse_header_info(&mut Cur::new(&hi, 0, 0))?;
        if let Some(&off) = sections.get(&option::FTRACE_EVENTS) {
            let s = self.section(off, option::FTRACE_EVENTS)?;
            parse_ftrace_events(&mut Cur::new(&s, 0, 0), &mut self.f.formats)?;
        }
        if let Some(&off) = sections.get(&option::EVENT_FORMATS) {
            let s = self.section(off, option::EVENT_FORMATS)?;
            parse_event_formats(&mut Cur::new(&s, 0, 0), &mut self.f.formats)?;
        }
        // Symbols only improve the text: a damaged section is ignored.
        for (id, what) in [(option::KALLSYMS, "kallsyms"), (option::PRINTK, "printk")] {
            if let Some(&off) = sections.get(&id) {
                let Ok(s) = self.section(off, id) else {
                    continue;
                };
                let Ok(text) = u32_sized(&mut Cur::new(&s, 0, 0), what) else {
                    continue;
                };
                let syms = self.symbols();
                if id == option::KALLSYMS {
                    syms.parse_kallsyms(text);
                } else {
                    syms.parse_printk(text);
                }
            }
        }
        if let Some(&off) = sections.get(&option::CMDLINES) {
            let s = self.section(off, option::CMDLINES)?;
            parse_cmdlines(&mut Cur::new(&s, 0, 0), &mut self.f.cmdlines)?;
        }
        // The top-level buffer (empty name).
        for b in buffers {
            let mut o = Cur::new(&b, 0, 0);
            let _section = o.u64("buffer offset")?;
            let name = o.cstr("buffer name")?;
            let clock = o.cstr("buffer clock")?;
            if !name.is_empty() {
                continue;
            }
            if self.f.clock.is_none() && !clock.is_empty() {
                self.f.clock = Some(clock);
            }
            let ps = o.u32("buffer page size")? as usize;
            if ps != self.f.page_size {
                return Err(OutputError::Unsupported(format!(
                    "buffer page size {ps} != file page size"
                )));
            }
            let n = o.u32("buffer cpu count")?;
            if n > 65536 {
                return Err(o.err("too many CPUs"));
            }
            for _ in 0..n {
                let cpu = o.u32("cpu id")?;
                let off = o.u64("cpu data offset")?;
                let size = o.u64("cpu data size")?;
                let data = if self.compressed {
                    self.chunks(off, size)?
                } else {
                    self.slice(off, size)?.to_vec()
                };
                self.f.cpus.push(CpuBuffer { cpu, data });
            }
            break;
        }
        Ok(())
    }

    /// Compressed CPU data: u32 chunk count, then (u32 compressed, u32 uncompressed, data).
    fn chunks(&self, off: u64, size: u64) -> Result<Vec<u8>, OutputError> {
        if size == 0 {
            return Ok(Vec::new());
        }
        let start = usize::try_from(off).ok().filter(|&s| s < self.file.len());
        let start =
            start.ok_or_else(|| OutputError::format(off, "cpu data offset past the end"))?;
        let mut c = Cur::new(self.file, start, 0);
        let n = c.u32("chunk count")?;
        let mut out = Vec::new();
        for _ in 0..n {
            let cs = c.u32("chunk compressed size")? as usize;
            let us = c.u32("chunk size")? as usize;
            let at = c.pos as u64;
            let d = c.bytes(cs, "chunk data")?;
            if out.len().saturating_add(us) > MAX_DECOMPRESSED * 64 {
                return Err(OutputError::format(at, "cpu data too large"));
            }
            out.extend_from_slice(&unzstd(d, us, at)?);
        }
        Ok(out)
    }
}

impl TraceFile {
    /// Reads and parses a trace.dat file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OutputError> {
        let p = path.as_ref();
        let data = std::fs::read(p).map_err(|e| OutputError::io(p, e))?;
        Self::parse(&data)
    }

    /// Parses a trace.dat held in memory.
    pub fn parse(data: &[u8]) -> Result<Self, OutputError> {
        let mut c = Cur::new(data, 0, 0);
        if c.bytes(10, "magic")? != MAGIC {
            return Err(OutputError::format(0u64, "not a trace.dat (bad magic)"));
        }
        let ver = c.cstr("version")?;
        let version: u32 = ver
            .parse()
            .map_err(|_| OutputError::format(10u64, "bad version"))?;
        if c.u8("endianness")? != 0 {
            return Err(OutputError::Unsupported("big-endian trace".into()));
        }
        let long_size = c.u8("long size")?;
        let page_size = c.u32("page size")? as usize;
        check_page_size(page_size)
            .map_err(|_| OutputError::format(c.pos as u64 - 4, "bad page size"))?;
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
            options: Vec::new(),
            cpus: Vec::new(),
            symbols: Default::default(),
            printers: BTreeMap::new(),
        };
        let mut p = Parser {
            file: data,
            compressed: false,
            f,
        };
        match version {
            6 => p.parse_v6(&mut c)?,
            7 => p.parse_v7(&mut c)?,
            v => return Err(OutputError::Unsupported(format!("trace.dat version {v}"))),
        }
        let mut f = p.f;
        if f.header_page.commit_size != 8 || f.header_page.data_offset != 16 {
            return Err(OutputError::Unsupported(format!(
                "header_page {:?}",
                f.header_page
            )));
        }
        if f.nr_cpus == 0 {
            f.nr_cpus = f
                .cpus
                .iter()
                .map(|c| c.cpu.saturating_add(1))
                .max()
                .unwrap_or(0);
        }
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

    /// Converts a raw page timestamp to ns the way trace-cmd does (TSC2NSEC, if present).
    pub fn ts_ns(&self, raw: u64) -> u64 {
        match &self.tsc2nsec {
            Some(t) => t.trace_cmd_ns(raw),
            None => raw,
        }
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

    /// Events (and drop markers) of all CPUs merged by timestamp, ties to the lower CPU,
    /// as trace-cmd orders them (the one [`Merger`] of `run` and the text sink, pulled one
    /// item at a time: it holds the next record or two of each CPU).
    pub fn records(&self) -> Records<'_> {
        let mut cpus: Vec<CpuCursor<'_>> =
            self.cpus.iter().map(|b| CpuCursor::new(self, b)).collect();
        cpus.sort_by_key(|c| c.cpu);
        Records {
            merger: Merger::new(cpus.len()),
            cpus,
        }
    }

    /// Formats one item the way `trace-cmd report -t` does (no newline). Returns false
    /// for items trace-cmd would not print (bad pages).
    pub fn format_item(&self, out: &mut String, item: &TraceItem<'_>) -> bool {
        match item {
            TraceItem::Dropped { cpu, missed } => {
                format_drop(out, *cpu, *missed);
                true
            }
            TraceItem::BadPage { .. } => false,
            TraceItem::Event(r) => {
                format_guest_line(
                    out,
                    &self.printers,
                    &self.cmdlines,
                    r.cpu,
                    r.ts_ns,
                    r.payload,
                );
                true
            }
        }
    }

    /// The whole `trace-cmd report -t` text: `cpus=N` then one line per item.
    pub fn report(&self) -> String {
        let mut s = format!("cpus={}\n", self.nr_cpus);
        for item in self.records() {
            if self.format_item(&mut s, &item) {
                s.push('\n');
            }
        }
        s
    }
}

/// One event read from a trace.dat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRecord<'a> {
    /// CPU.
    pub cpu: u32,
    /// Raw timestamp from the page.
    pub ts_raw: u64,
    /// Timestamp in ns (as trace-cmd prints it).
    pub ts_ns: u64,
    /// Event payload (common header + fields, padded to 4 bytes).
    pub payload: &'a [u8],
}

/// What [`TraceFile::records`] yields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceItem<'a> {
    /// An event.
    Event(TraceRecord<'a>),
    /// Events lost on `cpu` before the next event of that CPU.
    Dropped {
        /// CPU.
        cpu: u32,
        /// How many.
        missed: Missed,
    },
    /// A page that could not be decoded (rest of it skipped).
    BadPage {
        /// CPU.
        cpu: u32,
        /// Page index within the CPU's data.
        page: usize,
        /// Why.
        error: String,
    },
}

struct CpuCursor<'a> {
    file: &'a TraceFile,
    cpu: u32,
    data: &'a [u8],
    next_page: usize,
    events: Option<Events<'a>>,
    page_missed: Missed,
    first_on_page: bool,
    last_ns: u64,
    queue: Vec<TraceItem<'a>>,
}

impl<'a> CpuCursor<'a> {
    fn new(file: &'a TraceFile, b: &'a CpuBuffer) -> Self {
        Self {
            file,
            cpu: b.cpu,
            data: &b.data,
            next_page: 0,
            events: None,
            page_missed: Missed::None,
            first_on_page: false,
            last_ns: 0,
            queue: Vec::new(),
        }
    }

    /// Fills `queue` (reversed: pop from the end) with the next unit: optional drop
    /// marker + event, or a bad-page item. Returns the sort key, or None when done.
    fn fill(&mut self) -> Option<u64> {
        if let Some(item) = self.queue.first() {
            return Some(match item {
                TraceItem::Event(r) => r.ts_ns,
                _ => self.last_ns,
            });
        }
        let ps = self.file.page_size;
        loop {
            if let Some(ev) = self.events.as_mut() {
                match ev.next() {
                    Some(Ok(e)) => {
                        let ts_ns = self.file.ts_ns(e.ts);
                        self.last_ns = ts_ns;
                        let rec = TraceItem::Event(TraceRecord {
                            cpu: self.cpu,
                            ts_raw: e.ts,
                            ts_ns,
                            payload: e.payload,
                        });
                        self.queue.push(rec);
                        // trace-cmd reports a loss only when the page's first record is at
                        // offset 0 (a leading TIME_EXTEND hides it).
                        if self.first_on_page && e.offset == 0 && self.page_missed != Missed::None {
                            self.queue.push(TraceItem::Dropped {
                                cpu: self.cpu,
                                missed: self.page_missed,
                            });
                        }
                        self.first_on_page = false;
                        return Some(ts_ns);
                    }
                    Some(Err(err)) => {
                        self.events = None;
                        self.queue.push(TraceItem::BadPage {
                            cpu: self.cpu,
                            page: self.next_page - 1,
                            error: err.to_string(),
                        });
                        return Some(self.last_ns);
                    }
                    None => self.events = None,
                }
            }
            let start = self.next_page.checked_mul(ps)?;
            let page = self.data.get(start..start.checked_add(ps)?)?;
            self.next_page += 1;
            let (ts, commit) = page_header(page)?;
            let len = (commit & READ_COMMIT_MASK) as usize;
            let Some(area) = page.get(16..16 + len) else {
                self.queue.push(TraceItem::BadPage {
                    cpu: self.cpu,
                    page: self.next_page - 1,
                    error: format!("commit {len} past the page"),
                });
                return Some(self.last_ns);
            };
            self.page_missed = if commit & RB_MISSED_EVENTS == 0 {
                Missed::None
            } else if commit & RB_MISSED_STORED != 0 {
                match page.get(16 + len..24 + len) {
                    Some(b) => {
                        let mut w = [0u8; 8];
                        w.copy_from_slice(b);
                        Missed::Count(u64::from_le_bytes(w))
                    }
                    None => Missed::Unknown,
                }
            } else {
                Missed::Unknown
            };
            self.first_on_page = true;
            self.events = Some(Events::new(area, ts));
        }
    }
}

/// Iterator over the merged events of a [`TraceFile`].
pub struct Records<'a> {
    cpus: Vec<CpuCursor<'a>>,
    /// Holds the next unit (drop marker + event, or a bad page) of every CPU not done.
    merger: Merger<TraceItem<'a>>,
}

impl<'a> Iterator for Records<'a> {
    type Item = TraceItem<'a>;

    fn next(&mut self) -> Option<Self::Item> {
        for (i, c) in self.cpus.iter_mut().enumerate() {
            if self.merger.queued(i) > 0 || self.merger.is_finished(i) {
                continue;
            }
            match c.fill() {
                Some(key) => {
                    while let Some(item) = c.queue.pop() {
                        self.merger.push(i, key, Merged::Event(item));
                    }
                }
                None => self.merger.finish(i),
            }
        }
        // Every CPU not done has its next unit queued: the oldest is always released.
        match self.merger.next_ready()? {
            (_, _, Merged::Event(item)) => Some(item),
            (cpu, _, Merged::Lost(n)) => Some(TraceItem::Dropped {
                cpu: self.cpus.get(cpu).map_or(0, |c| c.cpu),
                missed: Missed::Count(n),
            }),
        }
    }
}

impl TraceFile {
    /// Number of events (drop markers, bad pages and hyptrace's own `trailing_lost`
    /// events not counted).
    pub fn event_count(&self) -> usize {
        self.records()
            .filter(|i| matches!(i, TraceItem::Event(r) if !self.is_trailing_lost(r)))
            .count()
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

    /// Sum of the drop markers' counts and the number of markers without a count.
    pub fn dropped(&self) -> (u64, usize) {
        let (mut n, mut unknown) = (0u64, 0usize);
        for i in self.records() {
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
        for f in &self.formats {
            let _ = writeln!(s, "event: {}:{} id={}", f.system, f.name, f.id);
        }
        s
    }
}
