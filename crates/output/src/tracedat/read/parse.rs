//! The metadata of a trace.dat: headers, formats, cmdlines, options, the CPU table.

use std::collections::{BTreeMap, BTreeSet};

use crate::clock::TscConversion;
use crate::format::{EventFormat, HeaderPage};
use crate::OutputError;
use hyptrace_abi::page::PAGE_HEADER_SIZE;

use super::input::{Cur, FileCur, Input, Source};
use super::option;
use super::{CpuBuffer, Damage, TraceFile, TraceOption, MAX_META_DAMAGE};

/// Most options sections followed through DONE links.
pub(super) const MAX_OPTION_SECTIONS: usize = 1024;
/// Largest decompressed metadata section accepted.
pub(super) const MAX_DECOMPRESSED: usize = 64 << 20;

/// zstd-decompresses `input` into `out` (resized to exactly `size` bytes): libzstd's
/// one-shot decompression into a fixed buffer (no window allocated; a frame that would
/// need more than `size` bytes is an error).
pub(super) fn unzstd_into(
    dec: &mut zstd::bulk::Decompressor<'static>,
    input: &[u8],
    size: usize,
    out: &mut Vec<u8>,
    at: u64,
) -> Result<(), OutputError> {
    out.resize(size, 0);
    let n = dec
        .decompress_to_buffer(input, out.as_mut_slice())
        .map_err(|e| OutputError::format(at, format!("zstd: {e}")))?;
    if n != size {
        return Err(OutputError::format(
            at,
            format!("zstd: {n} bytes, expected {size}"),
        ));
    }
    Ok(())
}

/// zstd-decompresses a metadata section of `size` bytes.
pub(super) fn unzstd(input: &[u8], size: usize, at: u64) -> Result<Vec<u8>, OutputError> {
    if size > MAX_DECOMPRESSED {
        return Err(OutputError::format(
            at,
            format!("compressed block claims {size} bytes"),
        ));
    }
    let mut out = Vec::new();
    let mut dec = decompressor(at)?;
    unzstd_into(&mut dec, input, size, &mut out, at)?;
    Ok(out)
}

pub(super) fn decompressor(at: u64) -> Result<zstd::bulk::Decompressor<'static>, OutputError> {
    zstd::bulk::Decompressor::new().map_err(|e| OutputError::format(at, format!("zstd: {e}")))
}

/// The header info: `header_page` (tag, size, text) then `header_event`. The outer
/// error is a structure that cannot be walked; the inner one a `header_page` text that
/// does not parse (the caller falls back to the kernel's layout).
pub(super) fn parse_header_info(
    c: &mut impl Input,
) -> Result<Result<HeaderPage, OutputError>, OutputError> {
    if c.bytes(12, "header_page tag")? != b"header_page\0" {
        return Err(c.err("expected header_page"));
    }
    let n = c.len64("header_page size")?;
    let hp = HeaderPage::parse(&c.text(n, "header_page text")?);
    if c.bytes(13, "header_event tag")? != b"header_event\0" {
        return Err(c.err("expected header_event"));
    }
    let n = c.len64("header_event size")?;
    c.skip(n as u64, "header_event text")?;
    Ok(hp)
}

/// The kernel's `buffer_data_page` layout (`header_page` of every kernel since 2.6.31,
/// 64-bit commit): what a damaged `header_page` falls back to.
pub(super) fn kernel_header_page(page_size: usize) -> HeaderPage {
    HeaderPage {
        commit_size: 8,
        data_offset: PAGE_HEADER_SIZE,
        data_size: page_size - PAGE_HEADER_SIZE,
    }
}

pub(super) fn parse_ftrace_events(
    c: &mut impl Input,
    out: &mut Vec<EventFormat>,
) -> Result<(), OutputError> {
    let n = c.u32("ftrace event count")?;
    // Bounded: each format consumes at least its 8-byte length.
    for _ in 0..n {
        let len = c.len64("ftrace event size")?;
        let t = c.text(len, "ftrace event format")?;
        if let Ok(f) = EventFormat::parse("ftrace", &t) {
            out.push(f);
        }
    }
    Ok(())
}

pub(super) fn parse_event_formats(
    c: &mut impl Input,
    out: &mut Vec<EventFormat>,
) -> Result<(), OutputError> {
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

/// A u32-sized blob (kallsyms, printk formats): its bytes when at most
/// [`MAX_DECOMPRESSED`] (symbols only improve the text: a larger one is skipped).
pub(super) fn u32_sized_text(
    c: &mut impl Input,
    what: &str,
) -> Result<Option<Vec<u8>>, OutputError> {
    let n = c.u32(what)?;
    if n as usize > MAX_DECOMPRESSED {
        c.skip(u64::from(n), what)?;
        return Ok(None);
    }
    Ok(Some(c.bytes(n as usize, what)?.to_vec()))
}

pub(super) fn parse_cmdlines(
    c: &mut impl Input,
    out: &mut BTreeMap<i32, String>,
) -> Result<(), OutputError> {
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

pub(super) fn selected_clock(text: &str) -> Option<String> {
    let s = text.find('[')?;
    let e = text[s..].find(']')? + s;
    Some(text[s + 1..e].to_string())
}

/// The integer `strtoll(text, NULL, 0)` reads (sign, `0x` hex, `0` octal or decimal;
/// stops at the first other byte); `None` without digits or when it overflows.
pub(super) fn parse_c_integer(data: &[u8]) -> Option<i64> {
    let text = data.split(|&b| b == 0).next().unwrap_or(&[]);
    let text = std::str::from_utf8(text).ok()?.trim_start();
    let (neg, rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let (radix, digits) =
        if let Some(h) = rest.strip_prefix("0x").or_else(|| rest.strip_prefix("0X")) {
            (16, h)
        } else if rest.len() > 1 && rest.starts_with('0') {
            (8, &rest[1..])
        } else {
            (10, rest)
        };
    let end = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    let digits = &digits[..end];
    if digits.is_empty() {
        return (radix == 8).then_some(0);
    }
    let v = i128::from_str_radix(digits, radix).ok()?;
    i64::try_from(if neg { -v } else { v }).ok()
}

pub(super) struct Parser {
    pub(super) compressed: bool,
    pub(super) f: TraceFile,
}

impl Parser {
    fn symbols(&mut self) -> &mut crate::symbols::KernelSymbols {
        std::sync::Arc::make_mut(&mut self.f.symbols)
    }

    fn src(&self) -> &Source {
        &self.f.src
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
            option::OFFSET => {
                // trace-cmd: `ts_offset += strtoll(buf, NULL, 0)`.
                if let Some(v) = parse_c_integer(data) {
                    self.f.ts_offset = self.f.ts_offset.wrapping_add(v);
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
        if off >= self.src().len() {
            return Err(OutputError::format(
                off,
                "section offset past the end of the file",
            ));
        }
        let mut c = FileCur::new(self.src(), off);
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
        let body = self.src().read_vec(off + 16, size, "section body")?;
        if flags & 1 != 0 {
            if !self.compressed {
                return Err(OutputError::format(
                    off,
                    "compressed section in an uncompressed file",
                ));
            }
            let mut b = Cur::new(&body, 0, off + 16);
            let csize = b.u32("compressed size")? as usize;
            let usize_ = b.u32("uncompressed size")? as usize;
            let data = b.bytes(csize, "compressed data")?;
            unzstd(data, usize_, off + 16)
        } else {
            Ok(body)
        }
    }

    /// Notes damaged metadata (bounded by [`MAX_META_DAMAGE`]).
    fn damaged(&mut self, d: Damage) {
        if self.f.damage.len() < MAX_META_DAMAGE {
            self.f.damage.push(d);
        }
    }

    /// A parsed `header_page`, or the kernel's layout with a damage note.
    fn header_page(&mut self, hp: Result<HeaderPage, OutputError>) {
        match hp {
            Ok(hp) => self.f.header_page = hp,
            Err(e) => {
                let d = Damage::meta("header_page", &e, "using the kernel's page layout");
                self.damaged(d);
                self.f.header_page = kernel_header_page(self.f.page_size);
            }
        }
    }

    pub(super) fn parse_v6(&mut self, c: &mut FileCur<'_>) -> Result<(), OutputError> {
        // The header_page text starts after the 18-byte file header, its tag and size.
        let hp = parse_header_info(c)?.map_err(|e| in_section(e, 18));
        self.header_page(hp);
        parse_ftrace_events(c, &mut self.f.formats)?;
        parse_event_formats(c, &mut self.f.formats)?;
        if let Some(t) = u32_sized_text(c, "kallsyms")? {
            self.symbols().parse_kallsyms(&t);
        }
        if let Some(t) = u32_sized_text(c, "printk formats")? {
            self.symbols().parse_printk(&t);
        }
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
                    let d = c.bytes(n, "option data")?.to_vec();
                    has_clock |= id == option::TRACECLOCK;
                    self.option(id, &d);
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
        for (cpu, (offset, size)) in table.into_iter().enumerate() {
            let size = self.check_plain(cpu as u32, offset, size);
            self.f.cpus.push(CpuBuffer {
                cpu: cpu as u32,
                offset,
                size,
            });
        }
        Ok(())
    }

    /// The size of uncompressed CPU data that lies within the file: data cut short by
    /// the end of the file is read up to the cut (its whole pages), with a damage note.
    fn check_plain(&mut self, cpu: u32, off: u64, size: u64) -> u64 {
        let len = self.src().len();
        if off.checked_add(size).is_some_and(|e| e <= len) {
            return size;
        }
        let have = len.saturating_sub(off);
        if self.f.damage.len() < MAX_META_DAMAGE {
            self.f.damage.push(Damage {
                cpu: Some(cpu),
                offset: Some(off),
                what: format!(
                    "cpu data of {size} bytes cut short by the end of the file: {} bytes missing, the {} whole pages before the cut are read",
                    size - have,
                    have / self.f.page_size as u64
                ),
            });
        }
        have
    }

    pub(super) fn parse_v7(&mut self, c: &mut FileCur<'_>) -> Result<(), OutputError> {
        let name = c.cstr("compression name")?;
        let ver = c.cstr("compression version")?;
        self.compressed = match name.as_str() {
            "none" | "" => false,
            "zstd" => true,
            // A name no compressor has: damaged (not an unsupported compression).
            other
                if !other
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-') =>
            {
                return Err(c.err("compression name damaged"))
            }
            other => return Err(OutputError::Unsupported(format!("compression {other}"))),
        };
        self.f.compression = Some((name, ver));
        let first = c.u64("options offset")?;
        let opts = self.v7_options(first);
        self.v7_sections(&opts.sections);
        match self.v7_top_buffer(&opts.buffers) {
            Err(e @ OutputError::Format { .. }) => {
                self.damaged(Damage::meta("buffer option", &e, "no CPU data is read"));
                Ok(())
            }
            r => r,
        }
    }

    /// Walks the chain of options sections from `first` (each option handed to
    /// [`Self::option`]); returns the section offsets the options name and the buffer
    /// options. Bounded: a section is read once, at most [`MAX_OPTION_SECTIONS`] of them.
    /// A damaged options section keeps the options before the damage (noted in
    /// [`TraceFile::damage`]); the ones after it are lost.
    fn v7_options(&mut self, first: u64) -> V7Options {
        let mut next = first;
        let mut seen = BTreeSet::new();
        let mut sections: BTreeMap<u16, u64> = BTreeMap::new();
        let mut buffers = Vec::new();
        while next != 0 {
            if !seen.insert(next) || seen.len() > MAX_OPTION_SECTIONS {
                let e = OutputError::format(next, "options sections loop");
                self.damaged(Damage::meta("options", &e, "the loop is not followed"));
                break;
            }
            let body = match self.section(next, 0) {
                Ok(b) => b,
                Err(e) => {
                    let d = Damage::meta("options section", &e, "the options in it are lost");
                    self.damaged(d);
                    break;
                }
            };
            let mut o = Cur::new(&body, 0, next + 16);
            next = 0;
            // Bounded: each option consumes at least its 6-byte header.
            loop {
                let (id, d) = match next_option(&mut o) {
                    Ok(x) => x,
                    Err(e) => {
                        let d =
                            Damage::meta("options section", &e, "the options after it are lost");
                        self.damaged(d);
                        break;
                    }
                };
                let d = d.as_slice();
                if id == option::DONE {
                    if let Some(n) = le64(d) {
                        next = n;
                    }
                    break;
                }
                match (id, le64(d)) {
                    (option::HEADER_INFO..=option::CMDLINES, Some(off)) => {
                        sections.insert(id, off);
                    }
                    (option::BUFFER, _) => buffers.push(d.to_vec()),
                    _ => {}
                }
                self.option(id, d);
            }
        }
        V7Options { sections, buffers }
    }

    /// The metadata sections the options named: header info, ftrace and event formats,
    /// symbols, command lines. A damaged one is noted in [`TraceFile::damage`]: the
    /// header info falls back to the kernel's page layout, the others keep what they
    /// held before the damage.
    fn v7_sections(&mut self, sections: &BTreeMap<u16, u64>) {
        let need = |id: u16| {
            sections
                .get(&id)
                .copied()
                .ok_or_else(|| OutputError::format(0u64, format!("no section {id}")))
        };
        let hi = need(option::HEADER_INFO).and_then(|off| {
            let hi = self.section(off, option::HEADER_INFO)?;
            parse_header_info(&mut Cur::new(&hi, 0, 0)).map_err(|e| in_section(e, off))
        });
        let hp = hi.and_then(|hp| hp);
        self.header_page(hp);
        // Formats and command lines: what a damaged section held before the damage is
        // kept (events without a format print as trace-cmd prints unknown events).
        for (id, what) in [
            (option::FTRACE_EVENTS, "ftrace event formats"),
            (option::EVENT_FORMATS, "event formats"),
            (option::CMDLINES, "cmdlines"),
        ] {
            let Some(&off) = sections.get(&id) else {
                continue;
            };
            let r = self.section(off, id).and_then(|s| {
                let mut c = Cur::new(&s, 0, 0);
                match id {
                    option::FTRACE_EVENTS => parse_ftrace_events(&mut c, &mut self.f.formats),
                    option::EVENT_FORMATS => parse_event_formats(&mut c, &mut self.f.formats),
                    _ => parse_cmdlines(&mut c, &mut self.f.cmdlines),
                }
                .map_err(|e| in_section(e, off))
            });
            if let Err(e) = r {
                self.damaged(Damage::meta(what, &e, "the rest of it is skipped"));
            }
        }
        self.v7_symbols(sections);
    }

    /// The kallsyms and printk sections. Symbols only improve the text: a damaged
    /// section is ignored.
    fn v7_symbols(&mut self, sections: &BTreeMap<u16, u64>) {
        for (id, what) in [(option::KALLSYMS, "kallsyms"), (option::PRINTK, "printk")] {
            let Some(&off) = sections.get(&id) else {
                continue;
            };
            let Ok(s) = self.section(off, id) else {
                continue;
            };
            let mut c = Cur::new(&s, 0, 0);
            let Ok(n) = c.u32(what) else {
                continue;
            };
            let Ok(text) = c.bytes(n as usize, what) else {
                continue;
            };
            let text = text.to_vec();
            let syms = self.symbols();
            if id == option::KALLSYMS {
                syms.parse_kallsyms(&text);
            } else {
                syms.parse_printk(&text);
            }
        }
    }

    /// The CPU data of the top-level buffer (the first buffer option with an empty
    /// name), checked against the file; its clock when the file named none.
    fn v7_top_buffer(&mut self, buffers: &[Vec<u8>]) -> Result<(), OutputError> {
        for b in buffers {
            let mut o = Cur::new(b, 0, 0);
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
            let mut table: Vec<CpuBuffer> = Vec::new();
            for _ in 0..n {
                let cpu = o.u32("cpu id")?;
                let offset = o.u64("cpu data offset")?;
                let size = o.u64("cpu data size")?;
                table.push(CpuBuffer { cpu, offset, size });
            }
            // Compressed data is checked chunk by chunk as it is read (a damaged or
            // missing chunk is skipped then).
            if !self.compressed {
                for b in &mut table {
                    b.size = self.check_plain(b.cpu, b.offset, b.size);
                }
            }
            self.f.cpus = table;
            break;
        }
        Ok(())
    }
}

/// What the options of a v7 file point at.
pub(super) struct V7Options {
    /// Section id → offset of the section.
    sections: BTreeMap<u16, u64>,
    /// The buffer options' data, in file order.
    buffers: Vec<Vec<u8>>,
}

/// An error at an offset within the (possibly decompressed) body of the section at file
/// offset `section`: placed at the section, the offset within it kept in the reason.
pub(super) fn in_section(e: OutputError, section: u64) -> OutputError {
    match e {
        OutputError::Format { offset, reason } => OutputError::Format {
            offset: section,
            reason: format!("{reason} at byte {offset} of the section"),
        },
        e => e,
    }
}

/// The next option of an options section: id and data.
pub(super) fn next_option(o: &mut Cur<'_>) -> Result<(u16, Vec<u8>), OutputError> {
    let id = o.u16("option id")?;
    let n = o.u32("option size")? as usize;
    Ok((id, o.bytes(n, "option data")?.to_vec()))
}

/// The little-endian u64 at the start of `d`, if it has 8 bytes.
pub(super) fn le64(d: &[u8]) -> Option<u64> {
    d.get(..8)?.try_into().ok().map(u64::from_le_bytes)
}
