//! The metadata of a trace.dat: the v6 sequence, the v7 options chain and the sections
//! it names, the CPU table; everything within the metadata [`Budget`].

use crate::error::{DatProblem, UnsupportedDat};
use std::collections::{BTreeMap, BTreeSet};

use crate::clock::TscConversion;
use crate::format::HeaderPage;
use crate::DatError;

use super::budget::{
    check_block, decompressor, option_cost, unzstd_into, Budget, MAX_SECTION, METADATA_BUDGET,
};
use super::input::{Cur, FileCur, Input, Source};
use super::meta::{
    kernel_header_page, parse_c_integer, parse_cmdlines, parse_event_formats, parse_ftrace_events,
    parse_header_info, parse_symbols, selected_clock, u32_sized_text,
};
use super::option;
use super::{CpuBuffer, Damage, Instance, TraceFile, TraceOption, MAX_META_DAMAGE};

/// Most options sections followed through DONE links.
const MAX_OPTION_SECTIONS: usize = 1024;
/// Most CPUs a CPU table may list.
const MAX_CPUS: u32 = 65536;

/// Whether [`TraceFile::options`] keeps options of `id`: the ones the reader uses (the
/// others are counted in [`TraceFile::options_skipped`]; the top buffer's is read into
/// [`TraceFile::cpus`]).
fn kept_option(id: u16) -> bool {
    matches!(
        id,
        option::CPUSTAT
            | option::TRACECLOCK
            | option::OFFSET
            | option::CPUCOUNT
            | option::TSC2NSEC
            | option::HEADER_INFO..=option::CMDLINES
    )
}

/// Items not read because they were past the metadata budget, by kind (one damage
/// note each at the end).
#[derive(Default)]
struct Over {
    options: u64,
    formats: u64,
    cmdlines: u64,
    symbols: u64,
    /// Buffer instances past [`MAX_INSTANCES`], and ones of a name read before.
    instances: u64,
    renamed: u64,
}

/// A v7 section read: its (decompressed) body, or the bytes it would take past the
/// metadata budget.
enum Section {
    Body(Vec<u8>),
    OverBudget(u64),
}

/// The top buffer of a v7 file: its clock and CPU table.
type TopBuffer = (String, Vec<CpuBuffer>);

pub(super) struct Parser {
    pub(super) compressed: bool,
    pub(super) f: TraceFile,
    budget: Budget,
    over: Over,
}

impl Parser {
    pub(super) fn new(f: TraceFile) -> Self {
        Self {
            compressed: false,
            f,
            budget: Budget::default(),
            over: Over::default(),
        }
    }

    fn src(&self) -> &Source {
        &self.f.src
    }

    /// Applies option `id` (clock, TSC2NSEC, OFFSET, CPU count) and keeps it if the
    /// reader uses it and it fits in the budget.
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
        if !kept_option(id) {
            self.f.options_skipped += 1;
        } else if self.budget.take(option_cost(data.len())) {
            self.f.options.push(TraceOption {
                id,
                data: data.to_vec(),
            });
        } else {
            self.over.options += 1;
        }
    }

    /// Reads the v7 section at `off`: checks its id, decompresses it if flagged (the
    /// block checked by [`check_block`]), within the budget.
    fn section(&mut self, off: u64, want: u16) -> Result<Section, DatError> {
        if off >= self.src().len() {
            return Err(DatError::format(off, DatProblem::SectionPastEnd));
        }
        let mut c = FileCur::new(self.src(), off);
        let id = c.u16("section id")?;
        let flags = c.u16("section flags")?;
        let _string = c.u32("section name")?;
        let size = c.len64("section size")?;
        if id != want {
            return Err(DatError::format(off, DatProblem::SectionId { id, want }));
        }
        if flags & 1 == 0 {
            if !self.take(want, size as u64) {
                return Ok(Section::OverBudget(size as u64));
            }
            let body = self.src().read_vec(off + 16, size, "section body")?;
            return Ok(Section::Body(body));
        }
        if !self.compressed {
            return Err(DatError::format(off, DatProblem::CompressedSection));
        }
        let csize = c.u32("compressed size")? as usize;
        let usize_ = c.u32("uncompressed size")? as usize;
        if csize > size.saturating_sub(8) {
            return Err(c.err(DatProblem::CompressedSize { csize, size }));
        }
        if let Some(why) = check_block(csize, usize_, MAX_SECTION) {
            return Err(DatError::format(off + 16, DatProblem::Block(why)));
        }
        if !self.take(want, (csize + usize_) as u64) {
            return Ok(Section::OverBudget((csize + usize_) as u64));
        }
        let data = self.src().read_vec(off + 24, csize, "compressed data")?;
        let mut out = Vec::new();
        unzstd_into(&mut decompressor(off)?, &data, usize_, &mut out, off + 16)?;
        Ok(Section::Body(out))
    }

    /// Takes `n` bytes of section `id` from the budget (options sections: within their
    /// share).
    fn take(&mut self, id: u16, n: u64) -> bool {
        if id == 0 {
            self.budget.take_options(n)
        } else {
            self.budget.take(n)
        }
    }

    /// Notes that `what` (at `at`), `n` bytes, is past the budget: not read.
    fn not_read(&mut self, what: &str, at: Option<u64>, n: u64) {
        let d = Damage {
            cpu: None,
            offset: at,
            what: format!("{what} of {}: not read", self.budget.over(n)),
        };
        self.damaged(d);
    }

    /// Notes damaged metadata (bounded by [`MAX_META_DAMAGE`]).
    fn damaged(&mut self, d: Damage) {
        if self.f.damage.len() < MAX_META_DAMAGE {
            self.f.damage.push(d);
        }
    }

    /// The body of the section at `off`, or `None` with a note that `what` (its id
    /// `want`) is damaged or past the metadata budget (`then`: what is lost with it).
    fn section_body(&mut self, off: u64, want: u16, what: &str, then: &str) -> Option<Vec<u8>> {
        let d = match self.section(off, want) {
            Ok(Section::Body(b)) => return Some(b),
            Ok(Section::OverBudget(n)) => Damage {
                cpu: None,
                offset: Some(off),
                what: format!("{what} of {}: {then}", self.budget.over(n)),
            },
            Err(e) => Damage::meta(what, &e, then),
        };
        self.damaged(d);
        None
    }

    /// A parsed `header_page`, or the kernel's layout with a damage note.
    fn header_page(&mut self, hp: Result<HeaderPage, DatError>) {
        match hp {
            Ok(hp) => self.f.header_page = hp,
            Err(e) => {
                let d = Damage::meta("header_page", &e, "using the kernel's page layout");
                self.damaged(d);
                self.f.header_page = kernel_header_page(self.f.page_size);
            }
        }
    }

    /// Parses kallsyms or printk text into the file's symbols, within the budget.
    fn symbols(&mut self, text: &[u8], kallsyms: bool) {
        let syms = std::sync::Arc::make_mut(&mut self.f.symbols);
        self.over.symbols += parse_symbols(syms, text, kallsyms, &mut self.budget);
    }

    pub(super) fn parse_v6(&mut self, c: &mut FileCur<'_>) -> Result<(), DatError> {
        // The header_page text starts after the 18-byte file header, its tag and size.
        let hp = parse_header_info(c, &mut self.budget)?.map_err(|e| in_section(e, 18));
        self.header_page(hp);
        self.over.formats += parse_ftrace_events(c, &mut self.f.formats, &mut self.budget)?;
        self.over.formats += parse_event_formats(c, &mut self.f.formats, &mut self.budget)?;
        for (kallsyms, what) in [(true, "kallsyms"), (false, "printk formats")] {
            match u32_sized_text(c, what, &mut self.budget)? {
                Ok(t) => self.symbols(&t, kallsyms),
                Err(n) => self.not_read(what, None, n),
            }
        }
        self.over.cmdlines += parse_cmdlines(c, &mut self.f.cmdlines, &mut self.budget)?;
        self.f.nr_cpus = c.u32("cpu count")?;
        let mut has_clock = false;
        // Blocks: "options  ", "latency  ", "flyrecord"; each iteration consumes bytes.
        loop {
            let tag = c.bytes(10, "data kind")?;
            match tag {
                b"options  \0" => has_clock |= self.v6_options(c)?,
                b"latency  \0" => return Err(DatError::Unsupported(UnsupportedDat::Latency)),
                b"flyrecord\0" => break,
                _ => return Err(c.err(DatProblem::Expected("options or flyrecord"))),
            }
        }
        if self.f.nr_cpus > MAX_CPUS {
            return Err(c.err(DatProblem::Cpus {
                cpus: self.f.nr_cpus,
                max: MAX_CPUS,
            }));
        }
        let mut table = Vec::new();
        for _ in 0..self.f.nr_cpus {
            let off = c.u64("cpu data offset")?;
            let size = c.u64("cpu data size")?;
            table.push((off, size));
        }
        if has_clock {
            let n = c.len64("trace clock size")?;
            if self.budget.take(n as u64) {
                if let Some(s) = selected_clock(&c.text(n, "trace clock")?) {
                    self.f.clock = Some(s);
                }
            } else {
                self.over.options += 1;
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

    /// A v6 options block, up to its DONE; whether it held a TRACECLOCK. Options the
    /// reader does not keep, or past the budget, are walked over, not read.
    fn v6_options(&mut self, c: &mut FileCur<'_>) -> Result<bool, DatError> {
        let mut has_clock = false;
        // Bounded: each option consumes at least its 6-byte header.
        loop {
            let id = c.u16("option id")?;
            if id == option::DONE {
                return Ok(has_clock);
            }
            let n = c.u32("option size")? as usize;
            has_clock |= id == option::TRACECLOCK;
            if !kept_option(id) {
                self.f.options_skipped += 1;
                c.skip(n as u64, "option data")?;
            } else if !self.budget.take(n as u64) {
                self.over.options += 1;
                c.skip(n as u64, "option data")?;
            } else {
                let d = c.bytes(n, "option data")?.to_vec();
                self.option(id, &d);
            }
        }
    }

    /// The size of uncompressed CPU data that lies within the file: data cut short by
    /// the end of the file is read up to the cut (its whole pages), with a damage note.
    fn check_plain(&mut self, cpu: u32, off: u64, size: u64) -> u64 {
        let len = self.src().len();
        let ps = self.f.page_size as u64;
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
                    have / ps
                ),
            });
        }
        have
    }

    pub(super) fn parse_v7(&mut self, c: &mut FileCur<'_>) -> Result<(), DatError> {
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
                return Err(c.err(DatProblem::CompressionName))
            }
            other => {
                return Err(DatError::Unsupported(UnsupportedDat::Compression(
                    other.to_string(),
                )))
            }
        };
        self.f.compression = Some((name, ver));
        let first = c.u64("options offset")?;
        let (sections, top) = self.v7_options(first);
        self.v7_sections(&sections);
        match top {
            None => {}
            Some(Ok((clock, mut table))) => {
                if self.f.clock.is_none() && !clock.is_empty() {
                    self.f.clock = Some(clock);
                }
                // Compressed data is checked chunk by chunk as it is read (a damaged or
                // missing chunk is skipped then).
                if !self.compressed {
                    for b in &mut table {
                        b.size = self.check_plain(b.cpu, b.offset, b.size);
                    }
                }
                self.f.cpus = table;
            }
            Some(Err(e @ DatError::Format { .. })) => {
                self.damaged(Damage::meta("buffer option", &e, "no CPU data is read"));
            }
            Some(Err(e)) => return Err(e),
        }
        Ok(())
    }

    /// Walks the chain of options sections from `first` (each option handed to
    /// [`Self::option`]); returns the section offsets the options name and the top
    /// buffer (the first buffer option with an empty name; the others are counted).
    /// Bounded: a section is read once, at most [`MAX_OPTION_SECTIONS`] of them, within
    /// the budget. A damaged options section (or one past the budget) keeps the options
    /// before the damage (noted in [`TraceFile::damage`]); the ones after it are lost.
    fn v7_options(
        &mut self,
        first: u64,
    ) -> (BTreeMap<u16, u64>, Option<Result<TopBuffer, DatError>>) {
        let mut next = first;
        let mut seen = BTreeSet::new();
        let mut sections: BTreeMap<u16, u64> = BTreeMap::new();
        let mut top = None;
        while next != 0 {
            if !seen.insert(next) || seen.len() > MAX_OPTION_SECTIONS {
                let e = DatError::format(next, DatProblem::OptionsLoop);
                self.damaged(Damage::meta("options", &e, "the loop is not followed"));
                break;
            }
            let at = next;
            let lost = "the options in it and after it are lost";
            let Some(body) = self.section_body(at, 0, "options section", lost) else {
                break;
            };
            let mut o = Cur::new(&body, 0, at + 16);
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
                match (id, le64(d)) {
                    (option::DONE, n) => {
                        next = n.unwrap_or(0);
                        break;
                    }
                    (option::HEADER_INFO..=option::CMDLINES, Some(off)) => {
                        sections.insert(id, off);
                    }
                    (option::BUFFER, _) => {
                        if let Some(name) = instance_name(d) {
                            self.instance(name, d);
                            continue;
                        }
                        match top {
                            None => top = top_buffer(d, self.f.page_size),
                            Some(_) => self.f.options_skipped += 1,
                        }
                        continue;
                    }
                    _ => {}
                }
                self.option(id, d);
            }
        }
        (sections, top)
    }

    /// The metadata sections the options named: header info, ftrace and event formats,
    /// symbols, command lines. A damaged one is noted in [`TraceFile::damage`]: the
    /// header info falls back to the kernel's page layout, the others keep what they
    /// held before the damage.
    fn v7_sections(&mut self, sections: &BTreeMap<u16, u64>) {
        let fallback = "using the kernel's page layout";
        let hp = match sections.get(&option::HEADER_INFO) {
            None => Some(Err(DatError::format(0u64, DatProblem::NoHeaderPage))),
            Some(&off) => self
                .section_body(off, option::HEADER_INFO, "header_page", fallback)
                .map(|s| {
                    parse_header_info(&mut Cur::new(&s, 0, 0), &mut self.budget)
                        .and_then(|hp| hp)
                        .map_err(|e| in_section(e, off))
                }),
        };
        match hp {
            Some(hp) => self.header_page(hp),
            // Noted already.
            None => self.f.header_page = kernel_header_page(self.f.page_size),
        }
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
            let Some(s) = self.section_body(off, id, what, "none of it is read") else {
                continue;
            };
            let mut c = Cur::new(&s, 0, 0);
            let (f, b) = (&mut self.f, &mut self.budget);
            let r = match id {
                option::FTRACE_EVENTS => parse_ftrace_events(&mut c, &mut f.formats, b),
                option::EVENT_FORMATS => parse_event_formats(&mut c, &mut f.formats, b),
                _ => parse_cmdlines(&mut c, &mut f.cmdlines, b),
            };
            match r.map_err(|e| in_section(e, off)) {
                Ok(n) if id == option::CMDLINES => self.over.cmdlines += n,
                Ok(n) => self.over.formats += n,
                Err(e) => self.damaged(Damage::meta(what, &e, "the rest of it is skipped")),
            }
        }
        self.v7_symbols(sections);
    }

    /// The kallsyms and printk sections. Symbols only improve the text: a damaged
    /// section is ignored (one past the budget is noted).
    fn v7_symbols(&mut self, sections: &BTreeMap<u16, u64>) {
        for (id, what) in [(option::KALLSYMS, "kallsyms"), (option::PRINTK, "printk")] {
            let Some(&off) = sections.get(&id) else {
                continue;
            };
            let s = match self.section(off, id) {
                Ok(Section::Body(s)) => s,
                Ok(Section::OverBudget(n)) => {
                    self.not_read(what, Some(off), n);
                    continue;
                }
                Err(_) => continue,
            };
            let mut c = Cur::new(&s, 0, 0);
            let Ok(n) = c.u32(what) else {
                continue;
            };
            let Ok(text) = c.take(n as usize, what) else {
                continue;
            };
            self.symbols(text, id == option::KALLSYMS);
        }
    }

    /// Ends the parse: one damage note per kind of item past the budget, and CPU data
    /// that overlaps another CPU's dropped ([`drop_overlaps`]).
    pub(super) fn finish(&mut self) {
        for (n, what) in [
            (self.over.options, "options"),
            (self.over.formats, "event formats"),
            (self.over.cmdlines, "cmdlines"),
            (self.over.symbols, "kallsyms/printk lines"),
        ] {
            if n > 0 {
                let d = Damage {
                    cpu: None,
                    offset: None,
                    what: format!(
                        "{n} {what} past the metadata budget ({} MiB for all metadata) are not read",
                        METADATA_BUDGET >> 20
                    ),
                };
                self.damaged(d);
            }
        }
        for (n, what) in [
            (
                self.over.instances,
                format!("buffer instances past the first {MAX_INSTANCES}"),
            ),
            (
                self.over.renamed,
                "buffer instances of a name an earlier instance has".into(),
            ),
        ] {
            if n > 0 {
                let what = format!("{n} {what} are not read");
                self.damaged(Damage {
                    cpu: None,
                    offset: None,
                    what,
                });
            }
        }
        let len = self.src().len();
        if let Some(d) = drop_overlaps(&mut self.f.cpus, len) {
            self.damaged(d);
        }
        if let Some(d) = drop_shared(&self.f.cpus, &mut self.f.instances, len) {
            self.damaged(d);
        }
    }

    /// A named buffer instance's BUFFER option (`d`, named `name`): kept in
    /// [`TraceFile::instances`] with its CPU table (each CPU's data checked against the
    /// file as the top buffer's is). At most [`MAX_INSTANCES`] are read, a name once; a
    /// table that does not parse leaves that instance out. Each of these is noted in
    /// [`TraceFile::damage`].
    fn instance(&mut self, name: String, d: &[u8]) {
        self.f.options_skipped += 1;
        if self.f.instances.len() >= MAX_INSTANCES {
            self.over.instances += 1;
            return;
        }
        if self.f.instances.iter().any(|i| i.name == name) {
            self.over.renamed += 1;
            return;
        }
        let shown: String = name.chars().take(64).collect();
        let mut o = Cur::new(d, 0, 0);
        let table = o
            .u64("buffer offset")
            .and_then(|_| o.cstr("buffer name"))
            .and_then(|_| buffer_table(&mut o, self.f.page_size));
        let mut cpus = match table {
            Ok((_clock, cpus)) => cpus,
            Err(e) => {
                let what = format!("buffer instance {shown:?}");
                self.damaged(Damage::meta(&what, &e, "its data is not read"));
                return;
            }
        };
        if !self.compressed {
            for b in &mut cpus {
                b.size = self.check_plain(b.cpu, b.offset, b.size);
            }
        }
        self.f.instances.push(Instance { name, cpus });
    }
}

/// A buffer option: `None` for a named buffer (an instance: not read), else the top
/// buffer's clock and CPU table, or why it cannot be read.
/// The name of a named buffer instance's BUFFER option (none for the top level's, or
/// one that does not parse: that one is the top buffer's to refuse).
fn instance_name(d: &[u8]) -> Option<String> {
    let mut o = Cur::new(d, 0, 0);
    let name = o
        .u64("buffer offset")
        .and_then(|_| o.cstr("buffer name"))
        .ok()?;
    (!name.is_empty()).then_some(name)
}

/// Most buffer instances [`TraceFile::instances`] reads (the others are noted as damage).
pub const MAX_INSTANCES: usize = crate::MAX_GROUPS;

fn top_buffer(d: &[u8], page_size: usize) -> Option<Result<TopBuffer, DatError>> {
    let mut o = Cur::new(d, 0, 0);
    let name = o
        .u64("buffer offset")
        .and_then(|_section| o.cstr("buffer name"));
    match name {
        Ok(name) if !name.is_empty() => None,
        Ok(_) => Some(buffer_table(&mut o, page_size)),
        Err(e) => Some(Err(e)),
    }
}

/// The rest of the top buffer's option after its name: clock and CPU table.
fn buffer_table(o: &mut Cur<'_>, page_size: usize) -> Result<TopBuffer, DatError> {
    let clock = o.cstr("buffer clock")?;
    let ps = o.u32("buffer page size")? as usize;
    if ps != page_size {
        return Err(DatError::Unsupported(UnsupportedDat::BufferPageSize(ps)));
    }
    let n = o.u32("buffer cpu count")?;
    if n > MAX_CPUS {
        return Err(o.err(DatProblem::Cpus {
            cpus: n,
            max: MAX_CPUS,
        }));
    }
    let mut table = Vec::new();
    for _ in 0..n {
        let cpu = o.u32("cpu id")?;
        let offset = o.u64("cpu data offset")?;
        let size = o.u64("cpu data size")?;
        table.push(CpuBuffer { cpu, offset, size });
    }
    Ok((clock, table))
}

/// Drops (size 0) the data of every CPU whose data starts inside another CPU's (by
/// offset, the first one is kept): a file's CPUs never share data, and a table naming
/// the same data for many CPUs would make the reader read it once per CPU. Returns the
/// note naming them, if any.
fn drop_overlaps(cpus: &mut [CpuBuffer], file_len: u64) -> Option<Damage> {
    let mut order: Vec<usize> = (0..cpus.len())
        .filter(|&i| cpus[i].size > 0 && cpus[i].offset < file_len)
        .collect();
    order.sort_by_key(|&i| (cpus[i].offset, cpus[i].cpu));
    let (mut end, mut dropped) = (0u64, Vec::new());
    for i in order {
        let b = &cpus[i];
        if b.offset < end {
            dropped.push(i);
        } else {
            // The declared size (a compressed CPU's chunk count may lie 4 bytes past it,
            // [`CpuBuffer::end`]: never more than that is shared).
            end = b.end(false, file_len);
        }
    }
    let first = *dropped.first()?;
    let mut names: Vec<String> = dropped
        .iter()
        .take(8)
        .map(|&i| cpus[i].cpu.to_string())
        .collect();
    if dropped.len() > 8 {
        names.push("...".into());
    }
    let d = Damage {
        cpu: None,
        offset: Some(cpus[first].offset),
        what: format!(
            "the data of {} CPUs (cpu {}) lies inside other CPUs' data: not read",
            dropped.len(),
            names.join(", ")
        ),
    };
    for i in dropped {
        cpus[i].size = 0;
    }
    Some(d)
}

/// Drops (size 0) the data of every instance's CPU whose data overlaps data read
/// before it: the top level's (`top`), an earlier instance's or an earlier CPU's of the
/// same instance. Instances naming the same data would read it once per instance, and
/// one could hide the top level's data. Returns the note naming how many, if any.
fn drop_shared(top: &[CpuBuffer], instances: &mut [Instance], file_len: u64) -> Option<Damage> {
    // Kept ranges, start -> end, disjoint.
    let mut kept: BTreeMap<u64, u64> = BTreeMap::new();
    let mut keep = |b: &CpuBuffer| {
        let (start, end) = (b.offset, b.end(false, file_len));
        if b.size == 0 || start >= end {
            return true;
        }
        let clash = kept
            .range(..end)
            .next_back()
            .is_some_and(|(_, &e)| e > start);
        if !clash {
            kept.insert(start, end);
        }
        !clash
    };
    for b in top {
        keep(b);
    }
    let (mut n, mut first) = (0usize, None);
    for i in instances.iter_mut() {
        for b in &mut i.cpus {
            if !keep(b) {
                n += 1;
                first.get_or_insert(b.offset);
                b.size = 0;
            }
        }
    }
    (n > 0).then(|| Damage {
        cpu: None,
        offset: first,
        what: format!(
            "the data of {n} CPUs of buffer instances lies inside data read before it: not read"
        ),
    })
}

/// An error at an offset within the (possibly decompressed) body of the section at file
/// offset `section`: placed at the section, the offset within it kept in the reason.
pub(super) fn in_section(e: DatError, section: u64) -> DatError {
    match e {
        DatError::Format {
            offset, problem, ..
        } => DatError::Format {
            offset: section,
            within: Some(offset),
            problem,
        },
        e => e,
    }
}

/// The next option of an options section: id and data.
fn next_option<'a>(o: &mut Cur<'a>) -> Result<(u16, &'a [u8]), DatError> {
    let id = o.u16("option id")?;
    let n = o.u32("option size")? as usize;
    o.take(n, "option data").map(|d| (id, d))
}

/// The little-endian u64 at the start of `d`, if it has 8 bytes.
fn le64(d: &[u8]) -> Option<u64> {
    d.get(..8)?.try_into().ok().map(u64::from_le_bytes)
}
