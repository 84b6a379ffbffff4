//! trace.dat reader (v6, v7 uncompressed, v7 zstd), streaming and hostile-input safe.
//!
//! [`TraceFile::open`] reads only the metadata (headers, formats, cmdlines, options, the
//! CPU table) with positional reads; the event pages stay in the file. [`Records`] reads
//! each CPU's pages (or decompresses its v7 zstd chunks) one at a time: memory is bounded
//! by the CPU count times the page size (plus one compression chunk per CPU, at most
//! [`max_chunk`]), not by the file size. Every length and offset is checked against the
//! file, every loop is bounded by the bytes it consumes or by a fixed limit, and errors
//! are returned, never panics.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hyptrace_abi::page::{
    decode_record, fix_abs_ts, page_header, DecodeError, Record, PAGE_HEADER_SIZE,
    RB_MISSED_EVENTS, RB_MISSED_STORED,
};

use super::{option, MAGIC};
use crate::clock::TscConversion;
use crate::export::{check_page_size, Missed};
use crate::format::{glob, EventFormat, HeaderPage};
use crate::merge::{Merged, Merger};
use crate::text::{format_drop, format_guest_line, EventPrinter};
use crate::OutputError;

/// trace-cmd masks `commit` with 27 bits when reading.
const READ_COMMIT_MASK: u64 = (1 << 27) - 1;
/// Most options sections followed through DONE links.
const MAX_OPTION_SECTIONS: usize = 1024;
/// Largest decompressed metadata section accepted.
const MAX_DECOMPRESSED: usize = 64 << 20;
/// Longest `\0`-terminated name (system, compression, buffer) accepted.
const MAX_NAME: usize = 4096;
/// Bytes of uncompressed CPU data read at a time, for all CPUs together (each CPU reads
/// at least one page at a time).
const READ_BUDGET: usize = 1 << 20;
/// Most bytes a CPU reads at a time.
const MAX_BATCH: usize = 128 << 10;
/// Decompressed chunk budget for all CPUs together (see [`max_chunk`]).
const CHUNK_BUDGET: usize = 256 << 20;
/// How many bytes the report collects before writing them out.
const WRITE_CHUNK: usize = 64 << 10;

/// Most buffer memory the readers of all CPUs may need together (see
/// [`read_memory`]); a file that would need more is refused at `open`.
pub const MAX_READ_MEMORY: u64 = 4 << 30;

/// The most buffer memory reading `readers` CPUs of data takes: per CPU a page buffer
/// and a read batch (uncompressed) or a decompressed chunk and its compressed input.
pub fn read_memory(readers: usize, page_size: usize, compressed: bool) -> u64 {
    let per = if compressed {
        let cap = max_chunk(readers, page_size);
        page_size + cap + zstd_bound(cap)
    } else {
        page_size + plain_batch(readers, page_size)
    };
    (readers as u64).saturating_mul(per as u64)
}

/// Bytes of uncompressed CPU data read at a time when `readers` CPUs are read: whole
/// pages, at least one, at most [`MAX_BATCH`], [`READ_BUDGET`] for all CPUs together.
fn plain_batch(readers: usize, page_size: usize) -> usize {
    let pages = (READ_BUDGET / readers.max(1)).min(MAX_BATCH) / page_size.max(1);
    pages.max(1) * page_size
}

/// The largest decompressed v7 chunk accepted from a file with `cpus` CPUs of data and
/// pages of `page_size` bytes: at least 16 pages (trace-cmd writes 10), at most 16 MiB,
/// and `CHUNK_BUDGET` (256 MiB) for all CPUs together when that is more than 16 pages each.
pub fn max_chunk(cpus: usize, page_size: usize) -> usize {
    let share = CHUNK_BUDGET / cpus.max(1);
    share.min(16 << 20).max(page_size.saturating_mul(16))
}

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

/// A damaged part of a trace.dat that reading went past (docs/output.md "Damaged
/// files"): a section that could not be read, a compressed chunk that did not
/// decompress, CPU data cut short by the end of the file, a page that did not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Damage {
    /// The CPU whose data it is (`None`: metadata).
    pub cpu: Option<u32>,
    /// File offset where it was found (`None`: not known, e.g. a page of a
    /// decompressed chunk).
    pub offset: Option<u64>,
    /// What is damaged and what was skipped.
    pub what: String,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(cpu) = self.cpu {
            write!(f, "cpu {cpu}: ")?;
        }
        if let Some(at) = self.offset {
            write!(f, "offset {at}: ")?;
        }
        f.write_str(&self.what)
    }
}

impl Damage {
    /// Metadata damage: `what` (a section, an option) and the error that ended it.
    fn meta(what: &str, e: &OutputError, fallback: &str) -> Self {
        let offset = match e {
            OutputError::Format { offset, .. } => Some(*offset),
            _ => None,
        };
        Self {
            cpu: None,
            offset,
            what: match e {
                OutputError::Format { reason, .. } => {
                    format!("{what} damaged ({reason}); {fallback}")
                }
                e => format!("{what} damaged ({e}); {fallback}"),
            },
        }
    }
}

/// Most damage records kept at `open` (each names a section or an option list; more
/// cannot happen, the bound only caps memory on principle).
const MAX_META_DAMAGE: usize = 64;

/// The bytes of a trace.dat: a file read with positional reads, or a copy in memory.
#[derive(Clone)]
enum Source {
    File {
        file: Arc<File>,
        path: PathBuf,
        len: u64,
    },
    Mem(Arc<[u8]>),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::File { path, len, .. } => write!(f, "File({}, {len} bytes)", path.display()),
            Self::Mem(d) => write!(f, "Mem({} bytes)", d.len()),
        }
    }
}

impl Source {
    fn len(&self) -> u64 {
        match self {
            Self::File { len, .. } => *len,
            Self::Mem(d) => d.len() as u64,
        }
    }

    /// Fills `buf` from offset `off`; an error if that runs past the end of the file.
    fn read_at(&self, off: u64, buf: &mut [u8], what: &str) -> Result<(), OutputError> {
        let end = off
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.len())
            .ok_or_else(|| OutputError::format(off, format!("{what} runs past the end")))?;
        match self {
            Self::File { file, path, .. } => file
                .read_exact_at(buf, off)
                .map_err(|e| OutputError::io(path, e)),
            Self::Mem(d) => {
                // In range: end <= len checked above.
                buf.copy_from_slice(&d[off as usize..end as usize]);
                Ok(())
            }
        }
    }

    /// Reads `n` bytes at `off` into a new vector (checked against the file length
    /// before allocating).
    fn read_vec(&self, off: u64, n: usize, what: &str) -> Result<Vec<u8>, OutputError> {
        if off.checked_add(n as u64).is_none_or(|e| e > self.len()) {
            return Err(OutputError::format(
                off,
                format!("{what} runs past the end"),
            ));
        }
        let mut v = vec![0u8; n];
        self.read_at(off, &mut v, what)?;
        Ok(v)
    }
}

/// Sequential reading of metadata, from memory ([`Cur`]) or from the file ([`FileCur`]).
trait Input {
    /// The next `n` bytes.
    fn bytes(&mut self, n: usize, what: &str) -> Result<&[u8], OutputError>;
    /// Bytes left.
    fn remaining(&self) -> u64;
    /// An error at the current position.
    fn err(&self, what: &str) -> OutputError;

    /// Skips `n` bytes.
    fn skip(&mut self, n: u64, what: &str) -> Result<(), OutputError>;

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

    /// A u64 length that must fit in what is left.
    fn len64(&mut self, what: &str) -> Result<usize, OutputError> {
        let n = self.u64(what)?;
        if n > self.remaining() {
            return Err(self.err(what));
        }
        usize::try_from(n).map_err(|_| self.err(what))
    }

    /// A `\0`-terminated string of at most [`MAX_NAME`] bytes.
    fn cstr(&mut self, what: &str) -> Result<String, OutputError> {
        let mut s = Vec::new();
        for _ in 0..=MAX_NAME {
            match self.u8(what)? {
                0 => return Ok(String::from_utf8_lossy(&s).into_owned()),
                b => s.push(b),
            }
        }
        Err(self.err(what))
    }

    fn text(&mut self, n: usize, what: &str) -> Result<String, OutputError> {
        Ok(String::from_utf8_lossy(self.bytes(n, what)?).into_owned())
    }
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
}

impl Input for Cur<'_> {
    fn err(&self, what: &str) -> OutputError {
        OutputError::format(self.base + self.pos as u64, what.to_string())
    }

    fn remaining(&self) -> u64 {
        self.buf.len().saturating_sub(self.pos) as u64
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&[u8], OutputError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err(what))?;
        let b = &self.buf[self.pos..end];
        self.pos = end;
        Ok(b)
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<(), OutputError> {
        let n = usize::try_from(n).map_err(|_| self.err(what))?;
        self.bytes(n, what).map(|_| ())
    }
}

/// Sequential reads from the file through a small window.
struct FileCur<'s> {
    src: &'s Source,
    pos: u64,
    win: Vec<u8>,
    win_off: u64,
}

impl<'s> FileCur<'s> {
    fn new(src: &'s Source, pos: u64) -> Self {
        Self {
            src,
            pos,
            win: Vec::new(),
            win_off: 0,
        }
    }
}

impl Input for FileCur<'_> {
    fn err(&self, what: &str) -> OutputError {
        OutputError::format(self.pos, what.to_string())
    }

    fn remaining(&self) -> u64 {
        self.src.len().saturating_sub(self.pos)
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<&[u8], OutputError> {
        let end = self
            .pos
            .checked_add(n as u64)
            .filter(|&e| e <= self.src.len())
            .ok_or_else(|| self.err(what))?;
        let win_end = self.win_off + self.win.len() as u64;
        if self.pos < self.win_off || end > win_end {
            // Refill: at least 64 KiB, never past the end of the file.
            let want = (n as u64).max(64 << 10).min(self.src.len() - self.pos);
            self.win.resize(want as usize, 0);
            self.src.read_at(self.pos, &mut self.win, what)?;
            self.win_off = self.pos;
        }
        let s = (self.pos - self.win_off) as usize;
        self.pos = end;
        Ok(&self.win[s..s + n])
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<(), OutputError> {
        if n > self.remaining() {
            return Err(self.err(what));
        }
        self.pos += n;
        Ok(())
    }
}

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
    /// All options, in file order.
    pub options: Vec<TraceOption>,
    /// Where each CPU's pages are, in file order.
    pub cpus: Vec<CpuBuffer>,
    /// Damaged metadata `open` read past (a fallback or an omission for each; CPU data
    /// damage is found while reading, see [`Records::take_damage`]).
    pub damage: Vec<Damage>,
    /// Whether the CPU data is zstd-compressed (v7).
    compressed: bool,
    src: Source,
    /// Kernel symbols (kallsyms and printk formats sections) for `%pS` and plugins.
    pub symbols: std::sync::Arc<crate::symbols::KernelSymbols>,
    printers: BTreeMap<u16, EventPrinter>,
}

/// zstd-decompresses `input` into `out` (resized to exactly `size` bytes): libzstd's
/// one-shot decompression into a fixed buffer (no window allocated; a frame that would
/// need more than `size` bytes is an error).
fn unzstd_into(
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
fn unzstd(input: &[u8], size: usize, at: u64) -> Result<Vec<u8>, OutputError> {
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

fn decompressor(at: u64) -> Result<zstd::bulk::Decompressor<'static>, OutputError> {
    zstd::bulk::Decompressor::new().map_err(|e| OutputError::format(at, format!("zstd: {e}")))
}

/// The header info: `header_page` (tag, size, text) then `header_event`. The outer
/// error is a structure that cannot be walked; the inner one a `header_page` text that
/// does not parse (the caller falls back to the kernel's layout).
fn parse_header_info(c: &mut impl Input) -> Result<Result<HeaderPage, OutputError>, OutputError> {
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
fn kernel_header_page(page_size: usize) -> HeaderPage {
    HeaderPage {
        commit_size: 8,
        data_offset: PAGE_HEADER_SIZE,
        data_size: page_size - PAGE_HEADER_SIZE,
    }
}

fn parse_ftrace_events(c: &mut impl Input, out: &mut Vec<EventFormat>) -> Result<(), OutputError> {
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

fn parse_event_formats(c: &mut impl Input, out: &mut Vec<EventFormat>) -> Result<(), OutputError> {
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
fn u32_sized_text(c: &mut impl Input, what: &str) -> Result<Option<Vec<u8>>, OutputError> {
    let n = c.u32(what)?;
    if n as usize > MAX_DECOMPRESSED {
        c.skip(u64::from(n), what)?;
        return Ok(None);
    }
    Ok(Some(c.bytes(n as usize, what)?.to_vec()))
}

fn parse_cmdlines(c: &mut impl Input, out: &mut BTreeMap<i32, String>) -> Result<(), OutputError> {
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

/// The integer `strtoll(text, NULL, 0)` reads (sign, `0x` hex, `0` octal or decimal;
/// stops at the first other byte); `None` without digits or when it overflows.
fn parse_c_integer(data: &[u8]) -> Option<i64> {
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

struct Parser {
    compressed: bool,
    f: TraceFile,
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

    fn parse_v6(&mut self, c: &mut FileCur<'_>) -> Result<(), OutputError> {
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

    fn parse_v7(&mut self, c: &mut FileCur<'_>) -> Result<(), OutputError> {
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
struct V7Options {
    /// Section id → offset of the section.
    sections: BTreeMap<u16, u64>,
    /// The buffer options' data, in file order.
    buffers: Vec<Vec<u8>>,
}

/// An error at an offset within the (possibly decompressed) body of the section at file
/// offset `section`: placed at the section, the offset within it kept in the reason.
fn in_section(e: OutputError, section: u64) -> OutputError {
    match e {
        OutputError::Format { offset, reason } => OutputError::Format {
            offset: section,
            reason: format!("{reason} at byte {offset} of the section"),
        },
        e => e,
    }
}

/// The next option of an options section: id and data.
fn next_option(o: &mut Cur<'_>) -> Result<(u16, Vec<u8>), OutputError> {
    let id = o.u16("option id")?;
    let n = o.u32("option size")? as usize;
    Ok((id, o.bytes(n, "option data")?.to_vec()))
}

/// The little-endian u64 at the start of `d`, if it has 8 bytes.
fn le64(d: &[u8]) -> Option<u64> {
    d.get(..8)?.try_into().ok().map(u64::from_le_bytes)
}

/// The most a zstd frame of `n` bytes of content can take (zstd's ZSTD_COMPRESSBOUND).
fn zstd_bound(n: usize) -> usize {
    n.saturating_add(n >> 8).saturating_add(64 << 10)
}

impl TraceFile {
    /// Opens a trace.dat file and parses its metadata (the pages are read later, a few
    /// at a time, by [`TraceFile::records`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OutputError> {
        let p = path.as_ref();
        let file = File::open(p).map_err(|e| OutputError::io(p, e))?;
        let len = file.metadata().map_err(|e| OutputError::io(p, e))?.len();
        Self::from_source(Source::File {
            file: Arc::new(file),
            path: p.to_path_buf(),
            len,
        })
    }

    /// Parses a trace.dat held in memory (copied).
    pub fn parse(data: &[u8]) -> Result<Self, OutputError> {
        Self::from_source(Source::Mem(Arc::from(data)))
    }

    fn from_source(src: Source) -> Result<Self, OutputError> {
        let mut c = FileCur::new(&src, 0);
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
            .map_err(|_| OutputError::format(c.pos.saturating_sub(4), "bad page size"))?;
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
            cpus: Vec::new(),
            damage: Vec::new(),
            compressed: false,
            src: src.clone(),
            symbols: Default::default(),
            printers: BTreeMap::new(),
        };
        let mut p = Parser {
            compressed: false,
            f,
        };
        let mut c = FileCur::new(&src, pos);
        match version {
            6 => p.parse_v6(&mut c)?,
            7 => p.parse_v7(&mut c)?,
            v => return Err(OutputError::Unsupported(format!("trace.dat version {v}"))),
        }
        let mut f = p.f;
        f.compressed = p.compressed;
        if f.header_page.commit_size != 8 || f.header_page.data_offset != 16 {
            return Err(OutputError::Unsupported(format!(
                "header_page {:?}",
                f.header_page
            )));
        }
        let readers = f.cpus.iter().filter(|b| b.size > 0).count();
        let need = read_memory(readers, f.page_size, f.compressed);
        if need > MAX_READ_MEMORY {
            return Err(OutputError::Unsupported(format!(
                "{readers} CPUs of {}-byte pages would need {} MiB of read buffers",
                f.page_size,
                need >> 20
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
        let readers = self.cpus.iter().filter(|b| b.size > 0).count();
        Some(CpuPages::new(self, b, readers))
    }

    /// Events (and drop markers) of all CPUs merged by timestamp, ties to the lower CPU,
    /// as trace-cmd orders them (the one [`Merger`] of `run` and the text sink, pulled one
    /// item at a time: it holds the next record or two of each CPU). Pull items with
    /// [`Records::next_item`]; a read error (I/O, a corrupt compressed chunk) ends the
    /// items and is then in [`Records::error`].
    pub fn records(&self) -> Records<'_> {
        self.records_of(|_| true)
    }

    /// [`TraceFile::records`] of the CPUs `want` accepts (by CPU number); the others'
    /// pages are not read.
    pub fn records_of(&self, want: impl Fn(u32) -> bool) -> Records<'_> {
        let readers = self.cpus.iter().filter(|b| b.size > 0).count();
        let mut cpus: Vec<CpuCursor> = self
            .cpus
            .iter()
            .filter(|b| want(b.cpu))
            .map(|b| CpuCursor {
                cpu: b.cpu,
                pages: CpuPages::new(self, b, readers),
                tsc: self.tsc2nsec,
                ts_offset: self.ts_offset,
                live: false,
                area_end: 0,
                off: 0,
                clock: 0,
                page_ts: 0,
                page_missed: Missed::None,
                first_on_page: false,
                last_ns: 0,
                lenient: false,
                visited: Vec::new(),
            })
            .collect();
        cpus.sort_by_key(|c| c.cpu);
        Records {
            merger: Merger::new(cpus.len()),
            cpus,
            scratch: Vec::with_capacity(2),
            error: None,
            damage: Vec::new(),
            _file: std::marker::PhantomData,
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

    /// Writes the `trace-cmd report -t` text (`cpus=N` then one line per item, as
    /// [`TraceFile::format_item`] formats it) of the items `filter` selects to `out`,
    /// streaming: lines are collected in a small buffer and written out in chunks. With
    /// more than one thread ([`ReportFilter::threads`]), this thread reads and merges
    /// while the others format batches of items, written in order (memory: a few
    /// batches). Returns how many events were printed.
    ///
    /// Damage in the CPU data (see [`TraceFile::write_report_with`]) is read past and
    /// not reported.
    pub fn write_report(
        &self,
        out: &mut dyn Write,
        filter: &ReportFilter,
    ) -> Result<u64, OutputError> {
        self.write_report_with(out, filter, &mut |_| {})
    }

    /// [`TraceFile::write_report`], handing every damaged part of the CPU data that
    /// reading went past (a compressed chunk skipped, data cut short, a page that did not
    /// decode) to `on_damage` when it is found; every readable event is printed.
    pub fn write_report_with(
        &self,
        out: &mut dyn Write,
        filter: &ReportFilter,
        on_damage: &mut dyn FnMut(Damage),
    ) -> Result<u64, OutputError> {
        let threads = match filter.threads {
            // The reading thread plus one formatting thread per core: reading takes about
            // a third of the work, so one formatter per core keeps every core busy.
            0 => std::thread::available_parallelism().map_or(1, |n| (n.get() + 1).min(MAX_THREADS)),
            n => n.min(MAX_THREADS),
        };
        let head = format!("cpus={}\n", self.nr_cpus);
        out.write_all(head.as_bytes())?;
        let printed = if threads <= 1 {
            let mut s = String::with_capacity(WRITE_CHUNK + 4096);
            let n = self.select(filter, on_damage, |item| {
                if self.format_item(&mut s, item) {
                    s.push('\n');
                }
                if s.len() >= WRITE_CHUNK {
                    out.write_all(s.as_bytes())?;
                    s.clear();
                }
                Ok(())
            })?;
            out.write_all(s.as_bytes())?;
            n
        } else {
            std::thread::scope(|sc| {
                let mut p = Pipeline::start(self, sc, threads - 1);
                let n = self.select(filter, on_damage, |item| p.push(item, out))?;
                p.finish(out)?;
                Ok::<u64, OutputError>(n)
            })?
        };
        out.flush()?;
        Ok(printed)
    }

    /// Pulls the items `filter` selects, in order, into `emit`; returns how many events
    /// were selected (a read error is returned after the items before it).
    fn select(
        &self,
        filter: &ReportFilter,
        on_damage: &mut dyn FnMut(Damage),
        mut emit: impl FnMut(&TraceItem<'_>) -> Result<(), OutputError>,
    ) -> Result<u64, OutputError> {
        let ids = filter.event_ids(self);
        let mut recs = self.records_of(|c| filter.wants_cpu(c));
        let mut printed = 0u64;
        let mut skip = filter.skip;
        // Bounded: every item consumes the CPUs' data.
        loop {
            for d in recs.take_damage() {
                on_damage(d);
            }
            let Some(item) = recs.next_item() else {
                break;
            };
            if let TraceItem::BadPage { cpu, page, error } = &item {
                on_damage(Damage {
                    cpu: Some(*cpu),
                    offset: None,
                    what: format!(
                        "page {page} does not decode ({error}): the rest of it is skipped"
                    ),
                });
            }
            if let TraceItem::Event(r) = &item {
                if let Some(ids) = &ids {
                    let id = r
                        .payload
                        .get(..2)
                        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
                    if !ids.contains(id) {
                        continue;
                    }
                }
                if skip > 0 {
                    skip -= 1;
                    continue;
                }
                if filter.limit.is_some_and(|l| printed >= l) {
                    break;
                }
                printed += 1;
            } else if skip > 0 {
                continue;
            }
            emit(&item)?;
        }
        for d in recs.take_damage() {
            on_damage(d);
        }
        match recs.take_error() {
            Some(e) => Err(e),
            None => Ok(printed),
        }
    }

    /// The whole `trace-cmd report -t` text, in memory (tests; a read error ends it
    /// early: use [`TraceFile::write_report`] to see it).
    pub fn report(&self) -> String {
        let mut v = Vec::new();
        let _ = self.write_report(&mut v, &ReportFilter::default());
        String::from_utf8_lossy(&v).into_owned()
    }
}

/// What `report` prints: CPUs, events (by `SYSTEM:EVENT` globs), how many.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReportFilter {
    /// CPUs to print (`None`: all).
    pub cpus: Option<BTreeSet<u32>>,
    /// Event patterns `[SYSTEM:]EVENT`, `*` and `?` globs (empty: all). An event
    /// matches if any pattern does.
    pub events: Vec<String>,
    /// Events (of those selected) to skip first.
    pub skip: u64,
    /// Most events to print.
    pub limit: Option<u64>,
    /// Threads (this one and formatting threads); 0: one per core, at most 8.
    pub threads: usize,
}

/// Most threads `report` uses.
const MAX_THREADS: usize = 8;
/// Items per batch handed to a formatting thread (small in unit tests: many batches).
const BATCH_ITEMS: usize = if cfg!(test) { 61 } else { 4096 };
/// Payload bytes per batch (a batch is sent when it holds this much, whatever the
/// item count: big pages with big events do not make big batches).
const BATCH_BYTES: usize = 1 << 20;

/// An item copied out of its page for a formatting thread.
enum BatchItem {
    Event {
        cpu: u32,
        ts_ns: u64,
        start: usize,
        len: usize,
    },
    Dropped {
        cpu: u32,
        missed: Missed,
    },
}

/// Items (their payloads in `bytes`) and, once formatted, their text.
#[derive(Default)]
struct Batch {
    items: Vec<BatchItem>,
    bytes: Vec<u8>,
    text: String,
}

impl Batch {
    fn format(&mut self, f: &TraceFile) {
        self.text.clear();
        for it in &self.items {
            let item = match *it {
                BatchItem::Event {
                    cpu,
                    ts_ns,
                    start,
                    len,
                } => TraceItem::Event(TraceRecord {
                    cpu,
                    ts_raw: 0,
                    ts_ns,
                    payload: self.bytes.get(start..start + len).unwrap_or_default(),
                }),
                BatchItem::Dropped { cpu, missed } => TraceItem::Dropped { cpu, missed },
            };
            if f.format_item(&mut self.text, &item) {
                self.text.push('\n');
            }
        }
    }
}

/// Formatting threads fed batches round-robin; their texts are taken back in the same
/// order, so the output keeps the merged order. At most two batches per thread are in
/// flight.
struct Pipeline {
    to: Vec<std::sync::mpsc::Sender<Batch>>,
    from: Vec<std::sync::mpsc::Receiver<Batch>>,
    sent: usize,
    written: usize,
    cur: Batch,
    spare: Vec<Batch>,
}

impl Pipeline {
    fn start<'s, 'e: 's>(
        f: &'e TraceFile,
        sc: &'s std::thread::Scope<'s, 'e>,
        workers: usize,
    ) -> Self {
        let workers = workers.max(1);
        let (mut to, mut from) = (Vec::new(), Vec::new());
        for _ in 0..workers {
            let (tx, rx) = std::sync::mpsc::channel::<Batch>();
            let (rtx, rrx) = std::sync::mpsc::channel::<Batch>();
            sc.spawn(move || {
                // Ends when the pipeline drops its sender (or stops taking results).
                for mut b in rx {
                    b.format(f);
                    if rtx.send(b).is_err() {
                        break;
                    }
                }
            });
            to.push(tx);
            from.push(rrx);
        }
        Self {
            to,
            from,
            sent: 0,
            written: 0,
            cur: Batch::default(),
            spare: Vec::new(),
        }
    }

    fn push(&mut self, item: &TraceItem<'_>, out: &mut dyn Write) -> Result<(), OutputError> {
        match item {
            TraceItem::Event(r) => {
                let start = self.cur.bytes.len();
                self.cur.bytes.extend_from_slice(r.payload);
                self.cur.items.push(BatchItem::Event {
                    cpu: r.cpu,
                    ts_ns: r.ts_ns,
                    start,
                    len: r.payload.len(),
                });
            }
            TraceItem::Dropped { cpu, missed } => self.cur.items.push(BatchItem::Dropped {
                cpu: *cpu,
                missed: *missed,
            }),
            TraceItem::BadPage { .. } => {}
        }
        if self.cur.items.len() >= BATCH_ITEMS || self.cur.bytes.len() >= BATCH_BYTES {
            self.send(out)?;
        }
        Ok(())
    }

    fn send(&mut self, out: &mut dyn Write) -> Result<(), OutputError> {
        if self.sent - self.written >= 2 * self.to.len() {
            self.write_one(out)?;
        }
        let mut next = self.spare.pop().unwrap_or_default();
        next.items.clear();
        next.bytes.clear();
        let b = std::mem::replace(&mut self.cur, next);
        self.to[self.sent % self.to.len()]
            .send(b)
            .map_err(|_| OutputError::Closed)?;
        self.sent += 1;
        Ok(())
    }

    /// Writes the oldest batch in flight.
    fn write_one(&mut self, out: &mut dyn Write) -> Result<(), OutputError> {
        let b = self.from[self.written % self.from.len()]
            .recv()
            .map_err(|_| OutputError::Closed)?;
        self.written += 1;
        out.write_all(b.text.as_bytes())?;
        self.spare.push(b);
        Ok(())
    }

    fn finish(mut self, out: &mut dyn Write) -> Result<(), OutputError> {
        if !self.cur.items.is_empty() {
            self.send(out)?;
        }
        while self.written < self.sent {
            self.write_one(out)?;
        }
        Ok(())
    }
}

/// A set of event ids.
struct IdSet(Vec<u64>);

impl IdSet {
    fn contains(&self, id: u16) -> bool {
        self.0
            .get(usize::from(id) / 64)
            .is_some_and(|w| w & (1 << (id % 64)) != 0)
    }
}

impl ReportFilter {
    fn wants_cpu(&self, cpu: u32) -> bool {
        self.cpus.as_ref().is_none_or(|s| s.contains(&cpu))
    }

    /// Whether `system:name` matches a pattern (`[SYSTEM:]EVENT`, globs).
    pub fn matches_event(&self, system: &str, name: &str) -> bool {
        self.events.iter().any(|p| match p.split_once(':') {
            Some((s, e)) => glob(s, system) && glob(e, name),
            None => glob(p, name),
        })
    }

    /// The ids of the formats the patterns select; `None` when there are no patterns.
    fn event_ids(&self, f: &TraceFile) -> Option<IdSet> {
        if self.events.is_empty() {
            return None;
        }
        let mut set = IdSet(vec![0; 1024]);
        for fmt in &f.formats {
            if self.matches_event(&fmt.system, &fmt.name) {
                set.0[usize::from(fmt.id) / 64] |= 1 << (fmt.id % 64);
            }
        }
        Some(set)
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

/// What [`Records::next_item`] yields.
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

/// Reads one CPU's pages: uncompressed data a batch of pages at a time, or v7 zstd
/// chunks one at a time; each page is copied into one page buffer. A chunk that does
/// not decompress is skipped and data cut short by the end of the file ends the CPU,
/// each noted as a [`Damage`] ([`CpuPages::take_damage`]).
pub struct CpuPages {
    cpu: u32,
    /// Damage found and not taken yet (at most one per chunk read: taken after each
    /// page by [`Records`], bounded by [`MAX_META_DAMAGE`] for other callers).
    damage: Vec<Damage>,
    src: Source,
    page_size: usize,
    /// Read or decompressed bytes not consumed yet: `buf[pos..]`.
    buf: Vec<u8>,
    pos: usize,
    kind: StreamKind,
    page: Vec<u8>,
    /// Pages handed out so far.
    count: usize,
}

enum StreamKind {
    Plain {
        next: u64,
        end: u64,
        batch: usize,
    },
    Zstd {
        /// File offset of the next chunk header, or of the chunk count before it is
        /// read (`None`: no more chunks).
        next: Option<u64>,
        counted: bool,
        left: u32,
        /// Chunks read so far (for the damage notes).
        index: u32,
        cap: usize,
        cbuf: Vec<u8>,
        /// Made at the first chunk.
        dec: Option<Box<zstd::bulk::Decompressor<'static>>>,
    },
}

impl CpuPages {
    fn new(f: &TraceFile, b: &CpuBuffer, readers: usize) -> Self {
        let ps = f.page_size;
        let kind = if f.compressed {
            StreamKind::Zstd {
                next: (b.size > 0).then_some(b.offset),
                counted: false,
                left: 0,
                index: 0,
                cap: max_chunk(readers, ps),
                cbuf: Vec::new(),
                dec: None,
            }
        } else {
            StreamKind::Plain {
                next: b.offset,
                end: b.offset.saturating_add(b.size),
                batch: plain_batch(readers, ps),
            }
        };
        Self {
            cpu: b.cpu,
            damage: Vec::new(),
            src: f.src.clone(),
            page_size: ps,
            buf: Vec::new(),
            pos: 0,
            kind,
            page: Vec::new(),
            count: 0,
        }
    }

    /// Reads more bytes into `buf`; false at the end of the CPU's data.
    fn refill(&mut self) -> Result<bool, OutputError> {
        self.pos = 0;
        match &mut self.kind {
            StreamKind::Plain { next, end, batch } => {
                let n = (*end - *next).min(*batch as u64) as usize;
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

    /// Decompresses the next good chunk into `buf`; false when there is none. A chunk
    /// that does not decompress is skipped (noted), reading goes on with the next one;
    /// a chunk count, chunk header or chunk cut short by the end of the file, or a
    /// header with impossible sizes (the next chunk cannot be found), ends the CPU
    /// (noted). Bounded: each chunk consumes at least its 8-byte header.
    fn next_chunk(&mut self) -> Result<bool, OutputError> {
        let file_len = self.src.len();
        let StreamKind::Zstd {
            next,
            counted,
            left,
            index,
            cap,
            cbuf,
            dec,
        } = &mut self.kind
        else {
            return Ok(false);
        };
        self.buf.clear();
        let mut note = None;
        let mut notes = Vec::new();
        let mut skipped = 0u64;
        while let Some(mut at) = *next {
            if !*counted {
                let mut w = [0u8; 4];
                if at.checked_add(4).is_none_or(|e| e > file_len) {
                    note = Some((
                        at,
                        if at >= file_len {
                            format!("cpu data at offset {at}, past the end of the file ({file_len} bytes): none of it is read")
                        } else {
                            "chunk count cut short by the end of the file".to_string()
                        },
                    ));
                    *next = None;
                    break;
                }
                self.src.read_at(at, &mut w, "chunk count")?;
                *left = u32::from_le_bytes(w);
                *counted = true;
                at += 4;
                *next = Some(at);
            }
            if *left == 0 {
                *next = None;
                break;
            }
            let cut = |n: u64| at.checked_add(n).is_none_or(|e| e > file_len);
            if cut(8) {
                note = Some((at, format!("cut short by the end of the file: chunk {index} header and {left} chunks missing")));
                *next = None;
                break;
            }
            let mut h = [0u8; 8];
            self.src.read_at(at, &mut h, "chunk header")?;
            let cs = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let us = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
            if us > *cap || cs > zstd_bound(*cap) {
                note = Some((at, format!("chunk {index} header damaged ({cs} bytes compressed, {us} uncompressed): it and the {} chunks after it are skipped", *left - 1)));
                *next = None;
                break;
            }
            if cut(8 + cs as u64) {
                note = Some((at, format!("chunk {index} ({us} bytes, {} pages) cut short by the end of the file: it and the {} chunks after it are missing", us / self.page_size, *left - 1)));
                *next = None;
                break;
            }
            cbuf.resize(cs, 0);
            self.src.read_at(at + 8, cbuf, "chunk data")?;
            let d = match dec {
                Some(d) => d,
                None => dec.insert(Box::new(decompressor(at)?)),
            };
            let r = unzstd_into(d, cbuf, us, &mut self.buf, at + 8);
            *left -= 1;
            *index += 1;
            *next = Some(at + 8 + cs as u64);
            if let Err(e) = r {
                self.buf.clear();
                let what = format!(
                    "chunk {} damaged ({e}): skipped its {us} bytes ({} pages), reading goes on with the next chunk",
                    *index - 1,
                    us / self.page_size
                );
                if notes.len() < MAX_META_DAMAGE {
                    notes.push((at, what));
                } else {
                    skipped += 1;
                }
                continue;
            }
            break;
        }
        let more = !self.buf.is_empty();
        if skipped > 0 {
            let at = next.unwrap_or(0);
            notes.push((at, format!("{skipped} more damaged chunks skipped")));
        }
        for (at, what) in notes.into_iter().chain(note) {
            self.damaged(at, what);
        }
        Ok(more)
    }

    /// The next whole page, or `None` at the end (a trailing partial page is ignored).
    pub fn next_page(&mut self) -> Result<Option<&[u8]>, OutputError> {
        let ps = self.page_size;
        self.page.resize(ps, 0);
        let mut have = 0;
        // Bounded: every refill consumes file bytes (a batch, or a chunk header).
        while have < ps {
            if self.pos >= self.buf.len() {
                if !self.refill()? {
                    return Ok(None);
                }
                continue;
            }
            let n = (ps - have).min(self.buf.len() - self.pos);
            self.page[have..have + n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
            have += n;
            self.pos += n;
        }
        self.count += 1;
        Ok(Some(&self.page))
    }
}

/// Why a page read from a trace.dat does not decode as [`Records`] reads it (commit
/// past the page, a record running past the commit...), or `None` for a good page:
/// `convert` names the pages `report` would find damaged.
pub fn page_damage(page: &[u8]) -> Option<String> {
    let Some((_, commit)) = page_header(page) else {
        return Some("page shorter than its header".into());
    };
    let end = PAGE_HEADER_SIZE + (commit & READ_COMMIT_MASK) as usize;
    if page.len() < end {
        return Some(format!("commit {} past the page", end - PAGE_HEADER_SIZE));
    }
    let mut off = 0;
    // Bounded: each record decoded consumes at least 4 bytes of the page.
    loop {
        match decode_like_kbuffer(&page[PAGE_HEADER_SIZE..], end - PAGE_HEADER_SIZE, off) {
            Ok(None) => return None,
            Ok(Some((_, next))) => off = next,
            Err(e) => return Some(e.to_string()),
        }
    }
}

/// The record at `off` of a damaged page's data area `data` (the whole page after its
/// header) as trace-cmd's kbuffer (libtraceevent) reads it, with its arithmetic: a data
/// length word `w` is the signed 32-bit `(w - 4 + 3) & !3`, a padding's word is taken as
/// is, and the next record starts at the payload's offset plus that length in unsigned
/// 32-bit arithmetic: returned as is, so it may lie before `off` (kbuffer steps back) or
/// past the page (kbuffer ends the page). A length word below 4 is an event without
/// payload followed by a record 4 or 8 bytes on. Records are read while they start
/// before `commit`: `None` at the end and where a record's words lie past the page. An
/// event gets what the page holds of its payload, never a byte outside (trace-cmd reads
/// on past the page there). [`CpuCursor::next_record`] ends the page where kbuffer
/// comes back to an offset it read (it loops there for ever).
fn kbuffer_record(data: &[u8], commit: usize, off: usize) -> Option<(Record, usize)> {
    use hyptrace_abi::page::{DELTA_BITS, TYPE_PADDING, TYPE_TIME_EXTEND, TYPE_TIME_STAMP};
    if off >= commit {
        return None;
    }
    let word = |at: usize| {
        data.get(at..at.checked_add(4)?)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let hdr = word(off)?;
    let delta = u64::from(hdr >> 5);
    let arr = off + 4;
    let data_rec = Record::Data {
        delta,
        start: 0,
        len: 0,
    };
    // (the record, where its payload starts, kbuffer's signed length)
    let (rec, index, length) = match hdr & 0x1f {
        TYPE_PADDING => (Record::Padding { delta }, arr, word(arr)? as i32),
        t @ (TYPE_TIME_EXTEND | TYPE_TIME_STAMP) => {
            let v = (u64::from(word(arr)?) << DELTA_BITS).wrapping_add(delta);
            let rec = if t == TYPE_TIME_EXTEND {
                Record::TimeExtend { delta: v }
            } else {
                Record::TimeStamp { ts: v }
            };
            (rec, off + 8, 0)
        }
        0 => {
            let len = (word(arr)?.wrapping_sub(4) as i32).wrapping_add(3) & !3;
            (data_rec, arr + 4, len)
        }
        n => (data_rec, arr, n as i32 * 4),
    };
    let next = u32::try_from(index).ok()?.wrapping_add(length as u32) as usize;
    let rec = match rec {
        // In the page: the header (and a length word) were read from it.
        Record::Data { delta, .. } => Record::Data {
            delta,
            start: index,
            len: usize::try_from(length).map_or(0, |l| l.min(data.len() - index)),
        },
        other => other,
    };
    Some((rec, next))
}

/// The record at `off` of a page's data area `data` (the whole page after its header)
/// as the kernel reads it ([`decode_record`] over `data[..commit]`), or `BadLength`
/// where trace-cmd's kbuffer reads on elsewhere: a length word that is not a multiple
/// of 4 (the kernel's extent goes unaligned, kbuffer rounds a data length up and takes a
/// padding's as is), or a null padding (delta 0) that ends the page for the kernel while
/// kbuffer skips it to more records. Neither the kernel nor our writer writes these: the
/// page is damaged there, and read on as kbuffer reads it ([`kbuffer_record`]), so
/// `report` prints what trace-cmd prints. Only a padding needs a second decode (`off` is
/// aligned: data parts iff the next offset is not).
fn decode_like_kbuffer(
    data: &[u8],
    commit: usize,
    off: usize,
) -> Result<Option<(Record, usize)>, DecodeError> {
    let r = decode_record(&data[..commit], off)?;
    let kbuffer_next = || kbuffer_record(data, commit, off).map(|(_, n)| n);
    let parts = match &r {
        None => off < commit && kbuffer_next().is_some_and(|n| n < commit),
        Some((Record::Data { .. }, next)) => !next.is_multiple_of(4),
        Some((Record::Padding { .. }, next)) => kbuffer_next() != Some(*next),
        Some(_) => false,
    };
    if parts {
        Err(DecodeError::BadLength { offset: off })
    } else {
        Ok(r)
    }
}

/// What the merger holds for a CPU: its next event (as a range of the CPU's current
/// page), a drop marker or a bad page.
#[derive(Clone, Debug)]
enum Slot {
    Event {
        ts_raw: u64,
        ts_ns: u64,
        start: usize,
        len: usize,
    },
    Dropped(Missed),
    Bad {
        page: usize,
        error: String,
    },
}

struct CpuCursor {
    cpu: u32,
    pages: CpuPages,
    tsc: Option<TscConversion>,
    /// The OFFSET options' sum, added after TSC2NSEC (as trace-cmd does).
    ts_offset: i64,
    /// A page is being decoded: its data area is `page[16..area_end]`, the next record
    /// at `off` within it.
    live: bool,
    area_end: usize,
    off: usize,
    clock: u64,
    page_ts: u64,
    page_missed: Missed,
    first_on_page: bool,
    last_ns: u64,
    /// The page is damaged: its records are read on as trace-cmd's kbuffer reads them
    /// ([`kbuffer_record`]).
    lenient: bool,
    /// On a damaged page, one bit per byte offset of its data area: kbuffer read a
    /// record there (it loops for ever if it comes back to one).
    visited: Vec<u64>,
}

impl CpuCursor {
    fn ns(&self, raw: u64) -> u64 {
        let ns = match &self.tsc {
            Some(t) => t.trace_cmd_ns(raw),
            None => raw,
        };
        ns.wrapping_add_signed(self.ts_offset)
    }

    /// Pushes the next unit to `q` (drop marker + event, or a bad page; reversed: pop
    /// from the end). Returns its sort key, or None when the CPU is done.
    fn fill(&mut self, q: &mut Vec<Slot>) -> Result<Option<u64>, OutputError> {
        // Bounded: a record decoded strictly consumes at least 8 bytes of the page, one
        // read as kbuffer reads it a new offset of it (`visited`), each page read
        // consumes the CPU's data.
        loop {
            if self.live {
                match self.next_record() {
                    Ok(None) => self.live = false,
                    Err(err) => {
                        // Damaged page: named once, then read on as trace-cmd does.
                        self.go_lenient();
                        q.push(Slot::Bad {
                            page: self.pages.count.saturating_sub(1),
                            error: err.to_string(),
                        });
                        return Ok(Some(self.last_ns));
                    }
                    Ok(Some((rec, next))) => {
                        let at = self.off;
                        self.off = next;
                        match rec {
                            Record::Data { delta, start, len } => {
                                self.clock = self.clock.wrapping_add(delta);
                                let ts_ns = self.ns(self.clock);
                                self.last_ns = ts_ns;
                                q.push(Slot::Event {
                                    ts_raw: self.clock,
                                    ts_ns,
                                    start: PAGE_HEADER_SIZE + start,
                                    len,
                                });
                                // trace-cmd reports a loss only when the page's first
                                // record is at offset 0 (a leading TIME_EXTEND hides it).
                                if self.first_on_page && at == 0 && self.page_missed != Missed::None
                                {
                                    q.push(Slot::Dropped(self.page_missed));
                                }
                                self.first_on_page = false;
                                return Ok(Some(ts_ns));
                            }
                            other => self.advance_clock(&other),
                        }
                    }
                }
                continue;
            }
            let Some(page) = self.pages.next_page()? else {
                return Ok(None);
            };
            let Some((ts, commit)) = page_header(page) else {
                return Ok(None);
            };
            let len = (commit & READ_COMMIT_MASK) as usize;
            let end = PAGE_HEADER_SIZE + len;
            let plen = page.len();
            let fits = end <= plen;
            let stored = page.get(end..end.saturating_add(8)).map(|b| {
                let mut w = [0u8; 8];
                w.copy_from_slice(b);
                u64::from_le_bytes(w)
            });
            self.lenient = false;
            self.page_missed = if commit & RB_MISSED_EVENTS == 0 {
                Missed::None
            } else if commit & RB_MISSED_STORED != 0 {
                stored.map_or(Missed::Unknown, Missed::Count)
            } else {
                Missed::Unknown
            };
            self.first_on_page = true;
            self.live = true;
            self.area_end = end.min(plen);
            self.off = 0;
            self.clock = ts;
            self.page_ts = ts;
            if !fits {
                // Read as kbuffer reads it, with its loss word, header and time as above.
                q.push(Slot::Bad {
                    page: self.pages.count.saturating_sub(1),
                    error: format!("commit {len} past the page"),
                });
                self.go_lenient();
            }
        }
    }

    /// The next record of the live page: as the kernel reads it ([`decode_like_kbuffer`])
    /// until the page is damaged, then as kbuffer reads it ([`kbuffer_record`]), back
    /// steps included; `None` where kbuffer comes back to an offset it read (it loops
    /// there for ever; we end the page).
    fn next_record(&mut self) -> Result<Option<(Record, usize)>, DecodeError> {
        let data = &self.pages.page[PAGE_HEADER_SIZE..];
        let commit = self.area_end - PAGE_HEADER_SIZE;
        if !self.lenient {
            return decode_like_kbuffer(data, commit, self.off);
        }
        if self.off >= commit || !first_visit(&mut self.visited, self.off) {
            return Ok(None);
        }
        Ok(kbuffer_record(data, commit, self.off))
    }

    /// The live page is damaged from `off` on: its later records are read as kbuffer
    /// reads them. The offsets read before `off` are kbuffer's too (where the kernel's
    /// reading and kbuffer's part is damage, [`decode_like_kbuffer`]): marked visited.
    fn go_lenient(&mut self) {
        self.lenient = true;
        let data = &self.pages.page[PAGE_HEADER_SIZE..];
        let commit = self.area_end - PAGE_HEADER_SIZE;
        self.visited.clear();
        self.visited.resize(data.len().div_ceil(64), 0);
        let mut off = 0;
        // Bounded: each record decoded consumes at least 8 bytes of the page.
        while off < self.off {
            first_visit(&mut self.visited, off);
            match decode_like_kbuffer(data, commit, off) {
                Ok(Some((_, next))) => off = next,
                _ => break,
            }
        }
    }

    /// The clock after a record that is not an event: on a damaged page as kbuffer keeps
    /// it (a padding's delta counts, a TIME_STAMP takes the clock's top 5 bits), else as
    /// the kernel does (a padding's delta is ignored, `rb_fix_abs_ts`).
    fn advance_clock(&mut self, rec: &Record) {
        /// kbuffer's TS_MSB: the bits an absolute time stamp lacks.
        const TS_MSB: u64 = 0xf8 << 56;
        match *rec {
            Record::TimeExtend { delta } => self.clock = self.clock.wrapping_add(delta),
            Record::TimeStamp { ts } if self.lenient => self.clock = ts | (self.clock & TS_MSB),
            Record::TimeStamp { ts } => self.clock = fix_abs_ts(ts, self.page_ts),
            Record::Padding { delta } if self.lenient => {
                self.clock = self.clock.wrapping_add(delta)
            }
            Record::Padding { .. } | Record::Data { .. } => {}
        }
    }
}

/// Sets bit `off` of `bits`; whether it was clear (`off` is within the bits).
fn first_visit(bits: &mut [u64], off: usize) -> bool {
    let (w, b) = (off / 64, 1u64 << (off % 64));
    let first = bits[w] & b == 0;
    bits[w] |= b;
    first
}

/// The merged events of a [`TraceFile`], pulled one at a time with
/// [`Records::next_item`] (each item borrows the CPU's current page).
pub struct Records<'a> {
    cpus: Vec<CpuCursor>,
    /// Holds the next unit (drop marker + event, or a bad page) of every CPU not done.
    merger: Merger<Slot>,
    scratch: Vec<Slot>,
    error: Option<OutputError>,
    /// Damage the CPUs' readers found, not taken yet.
    damage: Vec<Damage>,
    _file: std::marker::PhantomData<&'a TraceFile>,
}

impl Records<'_> {
    /// The next item in merged order; `None` at the end or after a read error
    /// ([`Records::error`]).
    pub fn next_item(&mut self) -> Option<TraceItem<'_>> {
        if self.error.is_some() {
            return None;
        }
        for (i, c) in self.cpus.iter_mut().enumerate() {
            if self.merger.queued(i) > 0 || self.merger.is_finished(i) {
                continue;
            }
            let r = c.fill(&mut self.scratch);
            self.damage.append(&mut c.pages.damage);
            match r {
                Ok(Some(key)) => {
                    while let Some(slot) = self.scratch.pop() {
                        self.merger.push(i, key, Merged::Event(slot));
                    }
                }
                Ok(None) => self.merger.finish(i),
                Err(e) => {
                    self.error = Some(e);
                    return None;
                }
            }
        }
        // Every CPU not done has its next unit queued: the oldest is always released.
        let (i, _, m) = self.merger.next_ready()?;
        let c = &self.cpus[i];
        Some(match m {
            Merged::Event(Slot::Event {
                ts_raw,
                ts_ns,
                start,
                len,
            }) => TraceItem::Event(TraceRecord {
                cpu: c.cpu,
                ts_raw,
                ts_ns,
                // In range: decode_record checked it against the page's data area
                // (or, for an event running past the commit, the whole page).
                payload: &c.pages.page[start..start + len],
            }),
            Merged::Event(Slot::Dropped(missed)) => TraceItem::Dropped { cpu: c.cpu, missed },
            Merged::Event(Slot::Bad { page, error }) => TraceItem::BadPage {
                cpu: c.cpu,
                page,
                error,
            },
            Merged::Lost(n) => TraceItem::Dropped {
                cpu: c.cpu,
                missed: Missed::Count(n),
            },
        })
    }

    /// The read error that ended the items, if any.
    pub fn error(&self) -> Option<&OutputError> {
        self.error.as_ref()
    }

    /// Takes the read error that ended the items, if any.
    pub fn take_error(&mut self) -> Option<OutputError> {
        self.error.take()
    }

    /// Takes the damage the CPUs' readers went past since the last call (a chunk
    /// skipped, data cut short; docs/output.md "Damaged files"). Each item pulled
    /// reads at most a chunk per CPU: taken after every item, this stays small.
    pub fn take_damage(&mut self) -> Vec<Damage> {
        std::mem::take(&mut self.damage)
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

    /// The times (ns) of the first and the last event of CPU `cpu` (`None` without
    /// events), for `report --first-event/--last-event`; a read error is returned.
    pub fn cpu_span(&self, cpu: u32) -> Result<Option<(u64, u64)>, OutputError> {
        let mut span: Option<(u64, u64)> = None;
        let mut r = self.records_of(|c| c == cpu);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A damaged page's data record that runs past the page: trace-cmd prints it (it
    /// reads on past the page), so it is one event here too, cut at the page's end
    /// (with no payload when none of it is in the page), and kbuffer's next offset is
    /// past the page, which ends it; a record whose length word is past the page is none.
    #[test]
    fn kbuffer_record_past_the_page_is_cut_at_its_end() {
        let mut data = vec![0u8; 4080];
        // Long form at 3300: length word 2000 (payload 1996 bytes from 3308).
        data[3300..3304].copy_from_slice(&(5u32 << 5).to_le_bytes());
        data[3304..3308].copy_from_slice(&2000u32.to_le_bytes());
        let (rec, next) = kbuffer_record(&data, 3400, 3300).expect("an event");
        assert_eq!(
            rec,
            Record::Data {
                delta: 5,
                start: 3308,
                len: 4080 - 3308
            }
        );
        // kbuffer's next is past the page: the page ends.
        assert_eq!(next, 3308 + 1996);
        assert!(kbuffer_record(&data, 3400, next).is_none());
        // Short form at 4072: 3 words from 4076, 4 bytes of them in the page.
        data[4072..4076].copy_from_slice(&3u32.to_le_bytes());
        let (rec, next) = kbuffer_record(&data, 4078, 4072).expect("an event");
        assert_eq!(
            rec,
            Record::Data {
                delta: 0,
                start: 4076,
                len: 4
            }
        );
        assert_eq!(next, 4088);
        // Long form at 4072: its length word is the page's last 4 bytes, no payload.
        data[4072..4076].copy_from_slice(&0u32.to_le_bytes());
        data[4076..4080].copy_from_slice(&100u32.to_le_bytes());
        let (rec, next) = kbuffer_record(&data, 4078, 4072).expect("an event");
        let empty = |start| Record::Data {
            delta: 0,
            start,
            len: 0,
        };
        assert_eq!((rec, next), (empty(4080), 4080 + 96));
        // Long form at 4076: its length word is past the page.
        data[4076..4080].copy_from_slice(&0u32.to_le_bytes());
        assert!(kbuffer_record(&data, 4078, 4076).is_none());
    }

    /// A length word that is not a multiple of 4 is where the strict decoder (the
    /// kernel's extent) and kbuffer (rounded up, a padding's as is) part: the page is
    /// damaged there, for `report` and for `convert` alike.
    #[test]
    fn unaligned_length_words_are_damage() {
        let page = |records: &[u32]| {
            let mut p = vec![0u8; 4096];
            let commit = records.len() as u64 * 4;
            p[8..16].copy_from_slice(&commit.to_le_bytes());
            for (i, w) in records.iter().enumerate() {
                p[16 + i * 4..20 + i * 4].copy_from_slice(&w.to_le_bytes());
            }
            p
        };
        // Long form, length word 16 (12 bytes of payload), then a 1-word event.
        assert_eq!(page_damage(&page(&[0, 16, 7, 7, 7, 1, 7])), None);
        // Length word 13: the kernel reads on at 17, kbuffer at 20.
        let bad = page(&[0, 13, 7, 7, 7, 1, 7]);
        assert_eq!(
            page_damage(&bad).as_deref(),
            Some("event at data offset 0 has a bad length word")
        );
        assert_eq!(kbuffer_record(&bad[16..], 28, 0).map(|(_, n)| n), Some(20));
        // Padding (delta 1) with length 8, then a 1-word event; with length 9 the next
        // record is at 16 strictly (aligned), at 13 for kbuffer.
        let pad = hyptrace_abi::page::TYPE_PADDING | 1 << 5;
        assert_eq!(page_damage(&page(&[pad, 8, 7, 1, 7])), None);
        assert_eq!(
            page_damage(&page(&[pad, 9, 7, 1, 7])).as_deref(),
            Some("event at data offset 0 has a bad length word")
        );
    }

    /// kbuffer's signed 32-bit arithmetic on a damaged page: a length word below 4 is an
    /// event without payload and the walk goes on 4 or 8 bytes later (trace-cmd prints the
    /// records after it); a negative length steps back (or stands still), or wraps past
    /// the page; a padding's length is taken as is, and may wrap 1..3 bytes on.
    #[test]
    fn kbuffer_record_follows_kbuffer_arithmetic() {
        let mut data = vec![0u8; 4080];
        let put = |data: &mut Vec<u8>, at: usize, w: u32| {
            data[at..at + 4].copy_from_slice(&w.to_le_bytes());
        };
        let empty = |start| Record::Data {
            delta: 0,
            start,
            len: 0,
        };
        // Length word 0: the next record starts at the length word itself.
        put(&mut data, 100, 0);
        put(&mut data, 104, 0);
        assert_eq!(kbuffer_record(&data, 4000, 100), Some((empty(108), 104)));
        // Length words 1..=3: no payload, the next record right after the word.
        for w in 1..=3 {
            put(&mut data, 104, w);
            assert_eq!(kbuffer_record(&data, 4000, 100), Some((empty(108), 108)));
        }
        // 0xffff_fffd..=0xffff_ffff round like 0: 4 bytes on.
        for w in 0xffff_fffd..=u32::MAX {
            put(&mut data, 104, w);
            assert_eq!(kbuffer_record(&data, 4000, 100), Some((empty(108), 104)));
        }
        // 0xffff_fffc: kbuffer stands on this record (for ever: the caller stops);
        // 0xffff_ffec: 16 bytes back; 0x8000_0004 and 0xffff_0000 wrap past the page.
        for (w, next) in [
            (0xffff_fffc, 100),
            (0xffff_ffec, 84),
            (0x8000_0004, 108 + (1 << 31)),
            (0xffff_0000, (108u32.wrapping_sub(65540)) as usize),
        ] {
            put(&mut data, 104, w);
            assert_eq!(kbuffer_record(&data, 4000, 100), Some((empty(108), next)));
        }
        // A padding's length as is: it stands still, steps back, or wraps 3 bytes on.
        put(&mut data, 200, hyptrace_abi::page::TYPE_PADDING);
        for (w, next) in [(u32::MAX - 3, 200), (u32::MAX - 100, 103), (u32::MAX, 203)] {
            put(&mut data, 204, w);
            assert_eq!(
                kbuffer_record(&data, 4000, 200),
                Some((Record::Padding { delta: 0 }, next))
            );
        }
    }

    fn fixture(name: &str) -> TraceFile {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        TraceFile::open(p).unwrap()
    }

    fn report_with(f: &TraceFile, filter: &ReportFilter) -> String {
        let mut v = Vec::new();
        f.write_report(&mut v, filter).unwrap();
        String::from_utf8(v).unwrap()
    }

    /// The formatting threads print exactly what one thread prints (many batches of 61
    /// items, drop markers among them), with and without filters.
    #[test]
    fn report_filter_matches_events() {
        let f = ReportFilter {
            events: vec!["sched:*".into(), "*:marker".into(), "irq_*".into()],
            ..Default::default()
        };
        assert!(f.matches_event("sched", "sched_wakeup"));
        assert!(f.matches_event("guest", "marker"));
        assert!(f.matches_event("irq", "irq_handler_entry"));
        assert!(!f.matches_event("guest", "span"));
    }

    #[test]
    fn threads_print_what_one_thread_prints() {
        for name in ["kernel-v6.dat", "kernel-v7.dat", "kernel-v7-zstd.dat"] {
            let f = fixture(name);
            let want = std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures")
                    .join(name.replace(".dat", ".report-t.txt")),
            )
            .unwrap();
            for filter in [
                ReportFilter::default(),
                ReportFilter {
                    events: vec!["sched:*".into()],
                    skip: 7,
                    limit: Some(300),
                    ..Default::default()
                },
                ReportFilter {
                    cpus: Some([1].into()),
                    ..Default::default()
                },
            ] {
                let one = report_with(
                    &f,
                    &ReportFilter {
                        threads: 1,
                        ..filter.clone()
                    },
                );
                assert!(one.lines().count() > 100, "{name} {filter:?}");
                for threads in [2, 3, 8] {
                    let many = report_with(
                        &f,
                        &ReportFilter {
                            threads,
                            ..filter.clone()
                        },
                    );
                    assert_eq!(one, many, "{name} {filter:?} threads {threads}");
                }
                if filter == ReportFilter::default() {
                    assert_eq!(one.lines().count(), want.lines().count(), "{name}");
                }
            }
        }
    }

    /// Pages come out whole, one at a time, through a bounded buffer.
    #[test]
    fn pages_stream_through_bounded_buffers() {
        for name in ["kernel-v6.dat", "kernel-v7.dat", "kernel-v7-zstd.dat"] {
            let f = fixture(name);
            for i in 0..f.cpus.len() {
                let mut p = f.pages(i).unwrap();
                let mut n = 0;
                while let Some(page) = p.next_page().unwrap() {
                    assert_eq!(page.len(), f.page_size);
                    n += 1;
                }
                assert!(p.buf.capacity() <= MAX_BATCH.max(max_chunk(1, f.page_size)));
                if !f.is_compressed() {
                    assert_eq!(n as u64, f.cpus[i].size / f.page_size as u64, "{name}");
                }
            }
        }
    }

    /// Read buffers grow with the CPU count and the page size, not the file; past
    /// [`MAX_READ_MEMORY`] a file is refused.
    #[test]
    fn read_memory_bound() {
        assert!(read_memory(2, 4096, true) < 80 << 20);
        assert!(read_memory(2, 4096, false) < 1 << 20);
        assert!(read_memory(1024, 4096, true) < MAX_READ_MEMORY);
        assert!(read_memory(65536, 4096, false) < MAX_READ_MEMORY);
        assert!(read_memory(65536, 4096, true) > MAX_READ_MEMORY);
        assert!(read_memory(65536, 1 << 26, false) > MAX_READ_MEMORY);
    }

    /// Events per CPU and the damage noted, reading `f` through [`Records`].
    fn per_cpu(f: &TraceFile) -> (BTreeMap<u32, usize>, Vec<Damage>) {
        let mut n = BTreeMap::new();
        let mut r = f.records();
        let mut damage = Vec::new();
        while let Some(i) = r.next_item() {
            if let TraceItem::Event(e) = i {
                *n.entry(e.cpu).or_insert(0) += 1;
            }
            damage.extend(r.take_damage());
        }
        damage.extend(r.take_damage());
        assert!(r.error().is_none());
        (n, damage)
    }

    fn le32_at(d: &[u8], at: u64) -> usize {
        let at = at as usize;
        u32::from_le_bytes(d[at..at + 4].try_into().unwrap()) as usize
    }

    /// Pages per CPU of [`zstd_file`].
    const PAGES: [usize; 3] = [95, 40, 31];

    /// A v7 zstd trace.dat of 3 CPUs, [`PAGES`] pages each of one event.
    fn zstd_file() -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.dat");
        let meta = crate::TraceMeta::guest(4096, 3, crate::Clock::nanoseconds());
        let mut s = crate::TraceDatSink::create_with(
            &path,
            meta,
            crate::TraceDatVersion::V7,
            crate::Compression::Zstd,
        )
        .unwrap();
        for (cpu, &n) in PAGES.iter().enumerate() {
            for i in 0..n {
                let mut p = vec![0u8; 4096];
                p[..8].copy_from_slice(&(1_000 + i as u64 * 10_000).to_le_bytes());
                let pid = hyptrace_abi::events::vcpu_pid(cpu as u32);
                let payload = hyptrace_abi::events::marker(pid, i as u64, 7);
                let mut hdr = [0u8; 8];
                let k = hyptrace_abi::page::encode_data_header(&mut hdr, payload.len(), 0);
                p[16..16 + k].copy_from_slice(&hdr[..k]);
                p[16 + k..16 + k + payload.len()].copy_from_slice(&payload);
                p[8..16].copy_from_slice(&((k + payload.len()) as u64).to_le_bytes());
                crate::PageSink::page(&mut s, cpu as u32, &p, None).unwrap();
            }
        }
        crate::PageSink::finish(Box::new(s), &crate::RunSummary::default()).unwrap();
        std::fs::read(&path).unwrap()
    }

    /// A chunk that does not decompress (its frame magic overwritten) is skipped with a
    /// note naming the CPU and the chunk; exactly its pages are missing: the CPU's later
    /// chunks and the other CPUs are read in full.
    #[test]
    fn damaged_chunk_is_skipped() {
        let mut data = zstd_file();
        let good = TraceFile::parse(&data).unwrap();
        let b = good.cpus.iter().find(|b| b.cpu == 0).unwrap().clone();
        assert!(le32_at(&data, b.offset) >= 2);
        let pages = le32_at(&data, b.offset + 8) / 4096;
        let frame = b.offset as usize + 4 + 8;
        data[frame..frame + 4].copy_from_slice(b"XXXX");
        let f = TraceFile::parse(&data).unwrap();
        assert!(f.damage.is_empty());
        let (got, damage) = per_cpu(&f);
        assert_eq!(damage.len(), 1, "{damage:?}");
        assert_eq!(damage[0].cpu, Some(0));
        assert!(
            damage[0].what.starts_with("chunk 0 damaged"),
            "{}",
            damage[0]
        );
        assert_eq!(got[&0], PAGES[0] - pages);
        assert_eq!((got[&1], got[&2]), (PAGES[1], PAGES[2]));
    }

    /// A file cut inside its last chunk reads every chunk before the cut, noting the
    /// cut once; a file cut inside a chunk header likewise.
    #[test]
    fn truncated_file_reads_up_to_the_cut() {
        let data = zstd_file();
        let good = TraceFile::parse(&data).unwrap();
        let last = good.cpus.iter().max_by_key(|b| b.offset).unwrap().clone();
        let mut at = last.offset + 4;
        for _ in 1..le32_at(&data, last.offset) {
            at += 8 + le32_at(&data, at) as u64;
        }
        let in_last = le32_at(&data, at + 4) / 4096;
        for cut in [at as usize + 20, at as usize + 3] {
            let f = TraceFile::parse(&data[..cut]).unwrap();
            let (got, damage) = per_cpu(&f);
            assert_eq!(damage.len(), 1, "{damage:?}");
            assert!(damage[0].what.contains("cut short"), "{}", damage[0]);
            for (cpu, &n) in PAGES.iter().enumerate() {
                let want = if cpu as u32 == last.cpu {
                    n - in_last
                } else {
                    n
                };
                assert_eq!(
                    got.get(&(cpu as u32)).copied().unwrap_or(0),
                    want,
                    "cpu {cpu}"
                );
            }
        }
    }

    /// A `header_page` whose text does not parse falls back to the kernel's layout
    /// with a note; every event is still read.
    #[test]
    fn damaged_header_page_falls_back() {
        let p =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kernel-v6.dat");
        let mut data = std::fs::read(p).unwrap();
        let good = TraceFile::parse(&data).unwrap();
        let at = data
            .windows(11)
            .position(|w| w == b"field: char")
            .expect("data field");
        data[at..at + 11].copy_from_slice(b"XXXXXXXXXXX");
        let f = TraceFile::parse(&data).unwrap();
        assert_eq!(f.damage.len(), 1, "{:?}", f.damage);
        assert!(f.damage[0].what.starts_with("header_page damaged"));
        assert_eq!(f.header_page, good.header_page);
        assert_eq!(f.event_count(), good.event_count());
    }

    #[test]
    fn chunk_caps() {
        assert_eq!(max_chunk(1, 4096), 16 << 20);
        assert_eq!(max_chunk(64, 4096), 4 << 20);
        assert_eq!(max_chunk(65536, 4096), 16 * 4096);
        assert_eq!(max_chunk(0, 4096), 16 << 20);
    }
}

#[cfg(test)]
mod offset_tests {
    use super::parse_c_integer;

    /// The OFFSET option is read as trace-cmd reads it (`strtoll(buf, NULL, 0)`).
    #[test]
    fn offset_text_as_strtoll() {
        assert_eq!(parse_c_integer(b"-80251194\0"), Some(-80_251_194));
        assert_eq!(parse_c_integer(b"12345"), Some(12_345));
        assert_eq!(parse_c_integer(b"+7 junk"), Some(7));
        assert_eq!(parse_c_integer(b"0x10\0"), Some(16));
        assert_eq!(parse_c_integer(b"010"), Some(8));
        assert_eq!(parse_c_integer(b"0"), Some(0));
        assert_eq!(parse_c_integer(b"  42"), Some(42));
        assert_eq!(parse_c_integer(b""), None);
        assert_eq!(parse_c_integer(b"x"), None);
        assert_eq!(parse_c_integer(b"99999999999999999999999"), None);
        assert_eq!(parse_c_integer(&[0xff, 0xfe]), None);
    }
}
