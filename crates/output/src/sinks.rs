//! Sinks besides trace.dat: text (`trace-cmd report -t` lines), Chrome trace-event
//! JSON, and raw page streams (`--format raw`).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use hyptrace_abi::page::{page_header, Events, PAGE_HEADER_SIZE};

use crate::clock::{Clock, TscConversion};
use crate::export::{commit_len, export_page_into, page_missed, Missed};
use crate::format::EventFormat;
use crate::merge::{MergeWindow, Merged, Merger, Released};
use crate::sink::{KernelCpuStat, PageSink, RunSummary, TraceMeta};
use crate::target::{OutputFile, OutputTarget};
use crate::text::{
    field_bytes, field_int, format_drop, format_guest_line, format_window_exceeded, EventPrinter,
};
use crate::OutputError;

/// Where a streaming sink writes.
pub(crate) enum Out {
    File(OutputFile),
    Writer(Box<dyn Write + Send>),
}

impl Out {
    /// Writes `b`; an error names the output (a file's path) and closes a file output
    /// (its temporary file removed).
    pub(crate) fn write_all(&mut self, b: &[u8]) -> Result<(), OutputError> {
        match self {
            Out::File(f) => f.write_all(b).map_err(|e| f.error(e)),
            Out::Writer(w) => w.write_all(b).map_err(OutputError::from),
        }
    }

    pub(crate) fn close(self) -> Result<(), OutputError> {
        match self {
            Out::File(f) => f.finish(),
            Out::Writer(mut w) => w.flush().map_err(OutputError::from),
        }
    }
}

/// Decodes the events of an exported page: `(raw ts, payload)`; stops at the first
/// decode error (returned as `Err` with the events before it).
/// `(page time_stamp, [(raw ts, payload)], decode error)`.
type PageEvents<'a> = (u64, Vec<(u64, &'a [u8])>, Option<String>);

pub(crate) fn page_events(page: &[u8]) -> PageEvents<'_> {
    let Some((ts, _)) = page_header(page) else {
        return (0, Vec::new(), Some("short page".into()));
    };
    let len = commit_len(page).unwrap_or(0);
    let Some(area) = page.get(PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len) else {
        return (ts, Vec::new(), Some("commit past the page".into()));
    };
    let mut out = Vec::new();
    for e in Events::new(area, ts) {
        match e {
            Ok(e) => out.push((e.ts, e.payload)),
            Err(err) => return (ts, out, Some(err.to_string())),
        }
    }
    (ts, out, None)
}

/// Text sink: `cpus=N`, then every event as `trace-cmd report -t` prints it, merged
/// across CPUs by time (ties: lower CPU first), each page's drop marker right before
/// its first event — with the one [`Merger`] of `hyptrace run` and `report`: pages of
/// one CPU arrive in time order, so a line is written once every CPU that may still
/// deliver pages has delivered one at or after its time; the rest at `finish`. Memory is
/// bounded by [`MergeWindow::DEFAULT`] (lines, and their bytes): a CPU that delivers no
/// page never holds the others' lines beyond it — past it, the line
/// [`crate::format_window_exceeded`] and the oldest lines down to half the window are
/// written, as `hyptrace run` does.
pub struct TextSink {
    meta: TraceMeta,
    printers: BTreeMap<u16, EventPrinter>,
    out: Option<Out>,
    scratch: Vec<u8>,
    /// Formatted lines waiting for the watermark (each with its newline).
    merger: Merger<String>,
    /// Where released lines are gathered before a write.
    buf: String,
}

/// Queues a formatted line of `cpu` at `ns`, the time it shows (its length counts
/// against the window). Lines merge by that time, as trace-cmd orders a trace.dat's
/// events: two CPUs' events in the same nanosecond go lower CPU first, whatever the
/// order of their raw timestamps.
fn queue_line(merger: &mut Merger<String>, cpu: usize, ns: u64, line: String) {
    let n = line.len();
    merger.push_sized(cpu, ns, Merged::Event(line), n);
}

/// What the merger releases, for a sink to render: a queued string at its time, or the
/// window-exceeded marker.
enum Piece<'a> {
    Item { ts: u64, text: &'a str },
    WindowExceeded { held: usize, lagging: Option<usize> },
}

/// Writes to `out`, in time order, every string queued in `merger` that it releases (all
/// of them when `all`), each rendered by `render` into a 64 KiB batch — the one release
/// path of the merged sinks (text and JSON).
fn release_merged(
    merger: &mut Merger<String>,
    out: &mut Out,
    buf: &mut String,
    all: bool,
    mut render: impl FnMut(&mut String, Piece<'_>),
) -> Result<(), OutputError> {
    buf.clear();
    let mut err = None;
    let mut put = |piece: Piece<'_>, buf: &mut String| {
        render(buf, piece);
        if buf.len() >= 1 << 16 && err.is_none() {
            err = out.write_all(buf.as_bytes()).err();
            buf.clear();
        }
    };
    if all {
        merger.drain(|_, ts, item| {
            if let Merged::Event(text) = item {
                put(Piece::Item { ts, text: &text }, buf);
            }
        });
    } else {
        merger.release(|r| match r {
            Released::Item {
                ts,
                item: Merged::Event(text),
                ..
            } => put(Piece::Item { ts, text: &text }, buf),
            Released::Item { .. } => {}
            Released::WindowExceeded { held, lagging } => {
                put(Piece::WindowExceeded { held, lagging }, buf);
            }
        });
    }
    if let Some(e) = err {
        return Err(e);
    }
    out.write_all(buf.as_bytes())
}

impl TextSink {
    /// Writes, in time order, every queued line the merger releases (all of them when
    /// `all`), and the window marker if it is exceeded.
    fn release(&mut self, all: bool) -> Result<(), OutputError> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        release_merged(
            &mut self.merger,
            out,
            &mut self.buf,
            all,
            |buf, piece| match piece {
                Piece::Item { text, .. } => buf.push_str(text),
                Piece::WindowExceeded { held, lagging } => {
                    format_window_exceeded(buf, held, lagging);
                    buf.push('\n');
                }
            },
        )
    }
}

impl TextSink {
    /// Text into `path` (checked and opened as [`OutputTarget`] does: `-` is
    /// stdout, a regular file is written under a temporary name and renamed at `finish`,
    /// a device or FIFO is written in place).
    pub fn create(path: impl AsRef<Path>, meta: TraceMeta) -> Result<Self, OutputError> {
        Self::open(&OutputTarget::check(path)?, meta)
    }

    /// Text into a checked target.
    pub fn open(target: &OutputTarget, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        Self::new(Out::File(target.open()?), meta)
    }

    /// Text into any writer (stdout...).
    pub fn to_writer(w: Box<dyn Write + Send>, meta: TraceMeta) -> Result<Self, OutputError> {
        Self::new(Out::Writer(w), meta)
    }

    fn new(mut out: Out, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        out.write_all(format!("cpus={}\n", meta.nr_cpus).as_bytes())?;
        let printers = meta
            .formats
            .iter()
            .map(|f| (f.id, EventPrinter::new(f.clone())))
            .collect();
        let n = meta.nr_cpus as usize;
        Ok(Self {
            scratch: vec![0; meta.page_size],
            meta,
            printers,
            out: Some(out),
            merger: Merger::with_window(n, MergeWindow::DEFAULT),
            buf: String::new(),
        })
    }
}

impl PageSink for TextSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Option<u64>) -> Result<(), OutputError> {
        self.meta.check_page(cpu, page)?;
        export_page_into(cpu, page, missed, &mut self.scratch)?;
        let missed = page_missed(&self.scratch);
        let (_, events, _err) = page_events(&self.scratch);
        if self.out.is_none() {
            return Ok(());
        }
        let c = cpu as usize;
        if missed != Missed::None {
            let mut s = String::new();
            format_drop(&mut s, cpu, missed);
            s.push('\n');
            // The marker goes right before the page's first event (same time, same CPU).
            let t = events
                .first()
                .map_or(self.merger.last(c).unwrap_or(0), |e| {
                    self.meta.clock.to_ns(e.0)
                });
            queue_line(&mut self.merger, c, t, s);
        }
        for (ts, payload) in events {
            let mut s = String::new();
            let ns = self.meta.clock.to_ns(ts);
            format_guest_line(
                &mut s,
                &self.printers,
                &self.meta.cmdlines,
                cpu,
                ns,
                payload,
            );
            s.push('\n');
            queue_line(&mut self.merger, c, ns, s);
        }
        if self.merger.last(c).is_none() {
            // A page without events still tells that this CPU delivers.
            self.merger.advance(c, 0);
        }
        self.release(false)
    }

    /// Lines of other CPUs up to `ts` no longer wait for `cpu`.
    fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
        if self.out.is_none() || cpu >= self.meta.nr_cpus {
            return Ok(());
        }
        self.merger.advance(cpu as usize, self.meta.clock.to_ns(ts));
        self.release(false)
    }

    /// A `CPU:N [lost EVENTS DROPPED]` line after the CPU's last event.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        if cpu >= self.meta.nr_cpus {
            return Err(OutputError::BadPage {
                cpu,
                reason: format!("cpu {cpu} ≥ nr_cpus {}", self.meta.nr_cpus),
            });
        }
        if lost == 0 || self.out.is_none() {
            return Ok(());
        }
        let c = cpu as usize;
        let mut s = String::new();
        format_drop(&mut s, cpu, Missed::Count(lost));
        s.push('\n');
        let t = self.merger.last(c).unwrap_or(0);
        queue_line(&mut self.merger, c, t, s);
        self.release(false)
    }

    fn finish(mut self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        self.release(true)?;
        match self.out.take() {
            Some(o) => o.close(),
            None => Ok(()),
        }
    }
}

/// Formats `ns` as µs with 3 decimals (a JSON number).
fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// JavaScript's `Number.MAX_SAFE_INTEGER` (2^53 − 1): larger integers lose precision in
/// a JSON viewer.
pub const JSON_MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// An integer field as JSON: a number when a JavaScript viewer holds it exactly
/// (|v| ≤ 2^53 − 1), else its decimal digits as a string.
fn json_int(v: u64, signed: bool) -> serde_json::Value {
    if signed {
        let i = v as i64;
        if i.unsigned_abs() <= JSON_MAX_SAFE_INTEGER {
            serde_json::Value::from(i)
        } else {
            serde_json::Value::from(i.to_string())
        }
    } else if v <= JSON_MAX_SAFE_INTEGER {
        serde_json::Value::from(v)
    } else {
        serde_json::Value::from(v.to_string())
    }
}

/// Event fields as a JSON object (integers as numbers — as strings above 2^53 − 1, see
/// [`JSON_MAX_SAFE_INTEGER`] — strings as strings).
fn json_args(f: &EventFormat, payload: &[u8]) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    for fd in &f.fields {
        let v = if fd.is_string() {
            field_bytes(fd, payload)
                .map(|b| serde_json::Value::from(String::from_utf8_lossy(b).into_owned()))
        } else if fd.is_array() || fd.is_data_loc() || fd.is_rel_loc() {
            field_bytes(fd, payload).map(|b| serde_json::Value::from(b.to_vec()))
        } else {
            field_int(fd, payload).map(|v| json_int(v, fd.signed))
        };
        m.insert(fd.name.clone(), v.unwrap_or(serde_json::Value::Null));
    }
    m
}

/// Chrome trace-event JSON sink (chrome://tracing, Perfetto): `pid` 1 (the VM), one
/// track per vCPU (`tid` = vCPU number, `thread_name` metadata `vcpu<n>`), instant
/// events (`ph: "i"`) for markers/text/other events, complete events (`ph: "X"`) for
/// `guest:span` (the span event is written when the span ends: `ts = event − dur`,
/// `dur` converted from TSC cycles), instant `lost events` markers (args `count`),
/// timestamps in µs with 3 decimals (ns precision).
///
/// Entries are written in time order across CPUs (`ts` non-decreasing in file order;
/// a `guest:span` sorts at its end, `ts + dur`), with the one [`Merger`] of the text
/// sink and `hyptrace run`, under the same bound ([`MergeWindow::DEFAULT`]): past it,
/// a `merge window exceeded` instant (args `held`, `lagging_cpu`) and the oldest
/// entries are written, as [`TextSink`] does.
pub struct JsonSink {
    meta: TraceMeta,
    out: Option<Out>,
    scratch: Vec<u8>,
    first: bool,
    /// Per CPU: raw time of its last event (or lossy page).
    last: Vec<u64>,
    /// Formatted entries waiting for the watermark, keyed by their time in ns.
    merger: Merger<String>,
    /// Where released entries are gathered before a write.
    buf: String,
    /// Time of the last entry released (where a window marker goes).
    released_ns: u64,
}

/// The JSON `pid` of the VM.
pub const JSON_PID: u32 = 1;

impl JsonSink {
    /// JSON into `path` (checked and opened as [`OutputTarget`] does: `-` is
    /// stdout, a regular file is written under a temporary name and renamed at `finish`,
    /// a device or FIFO is written in place).
    pub fn create(path: impl AsRef<Path>, meta: TraceMeta) -> Result<Self, OutputError> {
        Self::open(&OutputTarget::check(path)?, meta)
    }

    /// JSON into a checked target.
    pub fn open(target: &OutputTarget, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        Self::new(Out::File(target.open()?), meta)
    }

    /// JSON into any writer.
    pub fn to_writer(w: Box<dyn Write + Send>, meta: TraceMeta) -> Result<Self, OutputError> {
        Self::new(Out::Writer(w), meta)
    }

    fn new(out: Out, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        let mut s = Self {
            scratch: vec![0; meta.page_size],
            last: vec![0; meta.nr_cpus as usize],
            merger: Merger::with_window(meta.nr_cpus as usize, MergeWindow::DEFAULT),
            buf: String::new(),
            released_ns: 0,
            meta,
            out: Some(out),
            first: true,
        };
        s.raw("{\"traceEvents\":[\n")?;
        s.entry(&format!(
            "{{\"name\":\"process_name\",\"ph\":\"M\",\"ts\":0,\"pid\":{JSON_PID},\"tid\":0,\"args\":{{\"name\":{}}}}}",
            json_str(crate::perfetto::PROCESS_NAME)
        ))?;
        for cpu in 0..s.meta.nr_cpus {
            let name = s
                .meta
                .cmdlines
                .get(&hyptrace_abi::events::vcpu_pid(cpu))
                .cloned()
                .unwrap_or_else(|| format!("vcpu{cpu}"));
            s.entry(&format!(
                "{{\"name\":\"thread_name\",\"ph\":\"M\",\"ts\":0,\"pid\":{JSON_PID},\"tid\":{cpu},\"args\":{{\"name\":{}}}}}",
                json_str(&name)
            ))?;
        }
        Ok(s)
    }

    fn raw(&mut self, s: &str) -> Result<(), OutputError> {
        match self.out.as_mut() {
            Some(o) => o.write_all(s.as_bytes()),
            None => Ok(()),
        }
    }

    fn entry(&mut self, e: &str) -> Result<(), OutputError> {
        let sep = if self.first { "" } else { ",\n" };
        self.first = false;
        self.raw(sep)?;
        self.raw(e)
    }

    /// Writes, in time order, every queued entry the merger releases (all of them when
    /// `all`), and the window marker if it is exceeded.
    fn release(&mut self, all: bool) -> Result<(), OutputError> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        let first = &mut self.first;
        let released = &mut self.released_ns;
        release_merged(&mut self.merger, out, &mut self.buf, all, |buf, piece| {
            if !std::mem::replace(first, false) {
                buf.push_str(",\n");
            }
            match piece {
                Piece::Item { ts, text } => {
                    *released = ts;
                    buf.push_str(text);
                }
                Piece::WindowExceeded { held, lagging } => {
                    let lagging = lagging.map_or_else(|| "null".to_string(), |c| c.to_string());
                    buf.push_str(&format!(
                        "{{\"name\":\"merge window exceeded\",\"cat\":\"hyptrace\",\"ph\":\"i\",\"s\":\"g\",\"ts\":{},\"pid\":{JSON_PID},\"tid\":0,\"args\":{{\"held\":{held},\"lagging_cpu\":{lagging}}}}}",
                        us(*released)
                    ));
                }
            }
        })
    }

    /// Queues entry `e` of `cpu` at `ns` (its length counts against the window).
    fn queue(&mut self, cpu: u32, ns: u64, e: String) {
        let n = e.len();
        self.merger
            .push_sized(cpu as usize, ns, Merged::Event(e), n);
    }
}

impl PageSink for JsonSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Option<u64>) -> Result<(), OutputError> {
        self.meta.check_page(cpu, page)?;
        export_page_into(cpu, page, missed, &mut self.scratch)?;
        let scratch = std::mem::take(&mut self.scratch);
        self.page_inner(cpu, &scratch);
        self.scratch = scratch;
        if self.merger.last(cpu as usize).is_none() {
            // A page without events still tells that this CPU delivers.
            self.merger.advance(cpu as usize, 0);
        }
        self.release(false)
    }

    /// Entries of other CPUs up to `ts` no longer wait for `cpu`.
    fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
        if self.out.is_none() || cpu >= self.meta.nr_cpus {
            return Ok(());
        }
        self.merger.advance(cpu as usize, self.meta.clock.to_ns(ts));
        self.release(false)
    }

    /// A `lost events` instant (args `count`) at the time of the CPU's last event.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        let Some(&ts) = self.last.get(cpu as usize) else {
            return Err(OutputError::BadPage {
                cpu,
                reason: format!("cpu {cpu} ≥ nr_cpus {}", self.meta.nr_cpus),
            });
        };
        if lost == 0 {
            return Ok(());
        }
        self.lost_entry(cpu, ts, &format!("{{\"count\":{lost}}}"));
        self.release(false)
    }

    fn finish(mut self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        self.release(true)?;
        self.raw("\n],\"displayTimeUnit\":\"ns\"}\n")?;
        match self.out.take() {
            Some(o) => o.close(),
            None => Ok(()),
        }
    }
}

impl JsonSink {
    fn lost_entry(&mut self, cpu: u32, ts: u64, args: &str) {
        let ns = self.meta.clock.to_ns(ts);
        // Never before the CPU's last queued entry (a trailing loss at its last event).
        let ns = ns.max(self.merger.last(cpu as usize).unwrap_or(0));
        let e = format!(
            "{{\"name\":\"lost events\",\"cat\":\"hyptrace\",\"ph\":\"i\",\"s\":\"t\",\"ts\":{},\"pid\":{JSON_PID},\"tid\":{cpu},\"args\":{args}}}",
            us(ns)
        );
        self.queue(cpu, ns, e);
    }

    /// Queues the entries of one exported page.
    fn page_inner(&mut self, cpu: u32, page: &[u8]) {
        let (page_ts, events, _err) = page_events(page);
        let clock = self.meta.clock.clone();
        match page_missed(page) {
            Missed::None => {}
            m => {
                let args = match m {
                    Missed::Count(n) => format!("{{\"count\":{n}}}"),
                    _ => "{\"count\":null}".into(),
                };
                let ts = events.first().map_or(page_ts, |e| e.0);
                self.lost_entry(cpu, ts, &args);
            }
        }
        if let Some(&(ts, _)) = events.last() {
            self.last[cpu as usize] = ts;
        } else if page_missed(page) != Missed::None {
            self.last[cpu as usize] = page_ts;
        }
        for (ts, payload) in events {
            let ts_ns = clock.to_ns(ts);
            let id = payload
                .get(..2)
                .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
            let format = self.meta.format(id);
            let (name, cat, args) = match format {
                Some(f) => (f.name.clone(), f.system.clone(), json_args(f, payload)),
                None => (
                    format!("event_{id}"),
                    "unknown".to_string(),
                    serde_json::Map::new(),
                ),
            };
            // The duration from the field itself (the arg is a string above 2^53).
            let dur_cyc = format
                .and_then(|f| f.fields.iter().find(|fd| fd.name == "dur"))
                .and_then(|fd| field_int(fd, payload))
                .unwrap_or(0);
            let is_span =
                id == hyptrace_abi::events::SPAN_ID && cat == hyptrace_abi::events::SYSTEM;
            let args_s = serde_json::to_string(&args).unwrap_or_else(|_| "{}".into());
            let e = if is_span {
                let dur_ns = clock.duration_ns(dur_cyc);
                format!(
                    "{{\"name\":{},\"cat\":{},\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{JSON_PID},\"tid\":{cpu},\"args\":{args_s}}}",
                    json_str(&name),
                    json_str(&cat),
                    us(ts_ns.saturating_sub(dur_ns)),
                    us(dur_ns)
                )
            } else {
                format!(
                    "{{\"name\":{},\"cat\":{},\"ph\":\"i\",\"s\":\"t\",\"ts\":{},\"pid\":{JSON_PID},\"tid\":{cpu},\"args\":{args_s}}}",
                    json_str(&name),
                    json_str(&cat),
                    us(ts_ns)
                )
            };
            self.queue(cpu, ts_ns, e);
        }
    }
}

/// Magic of a raw page stream.
pub const RAW_MAGIC: &[u8; 8] = b"HTRAWPG2";
/// Magic of the previous raw stream (no `offset_ns`), still read.
pub const RAW_MAGIC_V1: &[u8; 8] = b"HTRAWPG1";

/// Whether `head` starts like a raw page stream (either version).
pub fn is_raw_stream(head: &[u8]) -> bool {
    head.starts_with(RAW_MAGIC) || head.starts_with(RAW_MAGIC_V1)
}
const RAW_TAG_PAGE: u32 = 1;
const RAW_TAG_END: u32 = 2;

/// Raw sink (`--format raw`): the exported pages as they arrive, in a simple stream
/// (all little-endian):
///
/// ```text
/// header:  "HTRAWPG2" | u32 page_size | u32 nr_cpus | u32 mult | u32 shift | u64 offset
///          | u32 clock_name_len | clock name bytes | i64 offset_ns
///          (mult = 0: timestamps are ns; else ns = ((ts - offset) * mult) >> shift;
///          then + offset_ns, see `Clock`; "HTRAWPG1" streams lack offset_ns: 0)
/// page:    u32 1 | u32 cpu | page_size bytes (exported copy: Linux buffer_data_page,
///          tail zeroed, losses as RB_MISSED_* flags + count after the data)
/// end:     u32 2 | u32 n | n × 8 u64 stats (entries, overrun, commit_overrun, bytes,
///          oldest_event_ts, now_ts, dropped_events, read_events)
/// ```
///
/// A stream without the end record was cut short; its pages are still readable.
pub struct RawSink {
    meta: TraceMeta,
    out: Option<Out>,
    scratch: Vec<u8>,
}

impl RawSink {
    /// Raw stream into `path` (checked and opened as [`OutputTarget`] does: `-` is
    /// stdout, a regular file is written under a temporary name and renamed at `finish`,
    /// a device or FIFO is written in place).
    pub fn create(path: impl AsRef<Path>, meta: TraceMeta) -> Result<Self, OutputError> {
        Self::open(&OutputTarget::check(path)?, meta)
    }

    /// Raw stream into a checked target.
    pub fn open(target: &OutputTarget, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        Self::new(Out::File(target.open()?), meta)
    }

    /// Raw stream into any writer.
    pub fn to_writer(w: Box<dyn Write + Send>, meta: TraceMeta) -> Result<Self, OutputError> {
        Self::new(Out::Writer(w), meta)
    }

    fn new(mut out: Out, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        let mut h = RAW_MAGIC.to_vec();
        h.extend_from_slice(&(meta.page_size as u32).to_le_bytes());
        h.extend_from_slice(&meta.nr_cpus.to_le_bytes());
        // With a map: the host clock's name, pages in ns (see `RawSink::page`).
        let clock = meta.clock.file_clock();
        let t = clock.tsc.unwrap_or(TscConversion {
            mult: 0,
            shift: 0,
            offset: 0,
        });
        h.extend_from_slice(&t.mult.to_le_bytes());
        h.extend_from_slice(&t.shift.to_le_bytes());
        h.extend_from_slice(&t.offset.to_le_bytes());
        h.extend_from_slice(&(clock.name.len() as u32).to_le_bytes());
        h.extend_from_slice(clock.name.as_bytes());
        h.extend_from_slice(&clock.offset_ns.to_le_bytes());
        out.write_all(&h)?;
        Ok(Self {
            scratch: vec![0; meta.page_size],
            meta,
            out: Some(out),
        })
    }
}

impl RawSink {
    /// Writes one page record; ring pages are retimed to the clock's map (if any), the
    /// empty `trailing_lost` page is not.
    fn store_page(
        &mut self,
        cpu: u32,
        page: &[u8],
        missed: Option<u64>,
        retime: bool,
    ) -> Result<(), OutputError> {
        self.meta
            .file_page(cpu, page, missed, retime, &mut self.scratch)?;
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        out.write_all(&RAW_TAG_PAGE.to_le_bytes())?;
        out.write_all(&cpu.to_le_bytes())?;
        out.write_all(&self.scratch)?;
        Ok(())
    }
}

impl PageSink for RawSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Option<u64>) -> Result<(), OutputError> {
        self.store_page(cpu, page, missed, true)
    }

    /// An event-less page record carrying the count (`commit` 0 with `RB_MISSED_EVENTS |
    /// RB_MISSED_STORED`, the u64 count right after the header), timestamped like the
    /// CPU's last page: [`RawTrace::replay`] turns a CPU's last page of that kind back
    /// into `trailing_lost`.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        let empty = vec![0u8; self.meta.page_size];
        self.meta.check_page(cpu, &empty)?;
        if lost == 0 {
            return Ok(());
        }
        self.store_page(cpu, &empty, Some(lost), false)
    }

    fn finish(mut self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        let Some(mut out) = self.out.take() else {
            return Ok(());
        };
        let mut e = RAW_TAG_END.to_le_bytes().to_vec();
        e.extend_from_slice(&(summary.cpus.len() as u32).to_le_bytes());
        for s in &summary.cpus {
            for v in [
                s.entries,
                s.overrun,
                s.commit_overrun,
                s.bytes,
                s.oldest_event_ts,
                s.now_ts,
                s.dropped_events,
                s.read_events,
            ] {
                e.extend_from_slice(&v.to_le_bytes());
            }
        }
        out.write_all(&e)?;
        out.close()
    }
}

/// A parsed raw page stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawTrace {
    /// Page size.
    pub page_size: usize,
    /// CPU count.
    pub nr_cpus: u32,
    /// Clock.
    pub clock: Clock,
    /// Exported pages `(cpu, page)` in stream order.
    pub pages: Vec<(u32, Vec<u8>)>,
    /// Stats from the end record; `None` if the stream was cut short.
    pub summary: Option<RunSummary>,
}

/// One record of a raw page stream.
enum RawRecord<'a> {
    Page(u32, &'a [u8]),
    End(RunSummary),
}

/// Most CPUs a raw stream may declare (what [`TraceMeta::validate`] accepts).
const RAW_MAX_CPUS: u32 = 4096;

/// Reads the records of a raw page stream (hostile-safe: every length is checked, a
/// stream cut short at a record boundary simply ends, one cut inside a record is an
/// error).
struct RawStream<R> {
    r: R,
    page_size: usize,
    nr_cpus: u32,
    clock: Clock,
    page: Vec<u8>,
    done: bool,
}

fn raw_bad(m: &str) -> OutputError {
    OutputError::Raw(m.to_string())
}

/// `read_exact`, with a short read as "truncated" (other I/O errors kept).
fn raw_read(r: &mut impl std::io::Read, buf: &mut [u8]) -> Result<(), OutputError> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            raw_bad("truncated")
        } else {
            OutputError::from(e)
        }
    })
}

fn raw_u32(r: &mut impl std::io::Read) -> Result<u32, OutputError> {
    let mut w = [0u8; 4];
    raw_read(r, &mut w)?;
    Ok(u32::from_le_bytes(w))
}

impl<R: std::io::Read> RawStream<R> {
    /// Reads the header.
    fn new(mut r: R) -> Result<Self, OutputError> {
        let mut magic = [0u8; 8];
        raw_read(&mut r, &mut magic)?;
        let v1 = &magic == RAW_MAGIC_V1;
        if &magic != RAW_MAGIC && !v1 {
            return Err(raw_bad("bad magic"));
        }
        let page_size = raw_u32(&mut r)? as usize;
        crate::export::check_page_size(page_size).map_err(|_| raw_bad("bad page size"))?;
        let nr_cpus = raw_u32(&mut r)?;
        if nr_cpus == 0 || nr_cpus > RAW_MAX_CPUS {
            return Err(raw_bad("bad cpu count"));
        }
        let mult = raw_u32(&mut r)?;
        let shift = raw_u32(&mut r)?;
        let mut o = [0u8; 8];
        raw_read(&mut r, &mut o)?;
        let offset = u64::from_le_bytes(o);
        let n = raw_u32(&mut r)? as usize;
        if n > 4096 {
            return Err(raw_bad("clock name too long"));
        }
        let mut name = vec![0u8; n];
        raw_read(&mut r, &mut name)?;
        let offset_ns = if v1 {
            0
        } else {
            let mut o = [0u8; 8];
            raw_read(&mut r, &mut o)?;
            i64::from_le_bytes(o)
        };
        let tsc = (mult != 0).then_some(TscConversion {
            mult,
            shift,
            offset,
        });
        Ok(Self {
            r,
            page_size,
            nr_cpus,
            clock: Clock {
                name: String::from_utf8_lossy(&name).into_owned(),
                tsc,
                map: None,
                offset_ns,
            },
            page: vec![0u8; page_size],
            done: false,
        })
    }

    /// The next record; `None` after the end record or at the end of the stream.
    fn next(&mut self) -> Result<Option<RawRecord<'_>>, OutputError> {
        if self.done {
            return Ok(None);
        }
        let mut t = [0u8; 4];
        // A stream cut short at a record boundary simply ends.
        let mut got = 0;
        while got < 4 {
            match self.r.read(&mut t[got..]) {
                Ok(0) if got == 0 => {
                    self.done = true;
                    return Ok(None);
                }
                Ok(0) => return Err(raw_bad("truncated")),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        match u32::from_le_bytes(t) {
            RAW_TAG_PAGE => {
                let cpu = raw_u32(&mut self.r)?;
                if cpu >= self.nr_cpus {
                    return Err(raw_bad("cpu out of range"));
                }
                raw_read(&mut self.r, &mut self.page)?;
                Ok(Some(RawRecord::Page(cpu, &self.page)))
            }
            RAW_TAG_END => {
                self.done = true;
                let n = raw_u32(&mut self.r)?;
                if n > RAW_MAX_CPUS {
                    return Err(raw_bad("bad cpu count in the end record"));
                }
                let mut cpus = Vec::new();
                for _ in 0..n {
                    let mut s = [0u8; 64];
                    raw_read(&mut self.r, &mut s)?;
                    let v = |i: usize| {
                        let mut w = [0u8; 8];
                        w.copy_from_slice(&s[i * 8..i * 8 + 8]);
                        u64::from_le_bytes(w)
                    };
                    cpus.push(KernelCpuStat {
                        entries: v(0),
                        overrun: v(1),
                        commit_overrun: v(2),
                        bytes: v(3),
                        oldest_event_ts: v(4),
                        now_ts: v(5),
                        dropped_events: v(6),
                        read_events: v(7),
                    });
                }
                Ok(Some(RawRecord::End(RunSummary { cpus })))
            }
            _ => Err(raw_bad("bad record tag")),
        }
    }
}

/// The losses a page carries, as a sink takes them (a flag-only loss, count unknown,
/// is not carried over: hyptrace never writes one).
fn raw_missed(p: &[u8]) -> Option<u64> {
    match page_missed(p) {
        Missed::Count(n) => Some(n),
        Missed::Unknown | Missed::None => None,
    }
}

/// A raw page stream read from a file, streaming: [`RawReader::replay`] holds one page
/// per CPU, whatever the file size.
pub struct RawReader {
    stream: RawStream<std::io::BufReader<Box<dyn std::io::Read + Send>>>,
    path: std::path::PathBuf,
}

impl RawReader {
    /// Opens a raw page stream and reads its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OutputError> {
        let p = path.as_ref();
        let f = std::fs::File::open(p).map_err(|e| OutputError::Io {
            path: Some(p.to_path_buf()),
            source: e,
        })?;
        Self::from_reader(Box::new(f), p)
    }

    /// Reads a raw page stream from any reader (a pipe, stdin), streaming as
    /// [`RawReader::open`]; `name` names it in errors.
    pub fn from_reader(
        r: Box<dyn std::io::Read + Send>,
        name: impl Into<std::path::PathBuf>,
    ) -> Result<Self, OutputError> {
        let stream = RawStream::new(std::io::BufReader::with_capacity(1 << 17, r))?;
        Ok(Self {
            stream,
            path: name.into(),
        })
    }

    /// Page size.
    pub fn page_size(&self) -> usize {
        self.stream.page_size
    }

    /// CPU count.
    pub fn nr_cpus(&self) -> u32 {
        self.stream.nr_cpus
    }

    /// Clock of the page timestamps.
    pub fn clock(&self) -> &Clock {
        &self.stream.clock
    }

    /// The metadata of the run that wrote the stream (the built-in guest events).
    pub fn meta(&self) -> TraceMeta {
        TraceMeta::guest(self.page_size(), self.nr_cpus(), self.clock().clone())
    }

    /// Feeds the pages of the CPUs `want` accepts into `sink`, losses preserved, then
    /// finishes it (with the end record's stats). Each CPU's page is handed over when
    /// the CPU's next page arrives (at most one page per CPU is held): a CPU's last page
    /// that holds no event but a loss count (what [`RawSink`]'s `trailing_lost` writes)
    /// is replayed as `trailing_lost`.
    pub fn replay(
        mut self,
        mut sink: Box<dyn PageSink>,
        want: impl Fn(u32) -> bool,
    ) -> Result<(), OutputError> {
        let ps = self.stream.page_size;
        let mut held: Vec<Option<Vec<u8>>> = vec![None; self.stream.nr_cpus as usize];
        let mut summary = RunSummary::default();
        let path = self.path.clone();
        let named = |e: OutputError| match e {
            OutputError::Raw(m) => OutputError::Raw(format!("{}: {m}", path.display())),
            e => e,
        };
        // Bounded: every record consumes bytes of the file.
        loop {
            match self.stream.next().map_err(named)? {
                None => break,
                Some(RawRecord::End(s)) => {
                    summary = s;
                    break;
                }
                Some(RawRecord::Page(cpu, page)) => {
                    if !want(cpu) {
                        continue;
                    }
                    let slot = &mut held[cpu as usize];
                    if let Some(prev) = slot.as_mut() {
                        sink.page(cpu, prev, raw_missed(prev))?;
                        prev.copy_from_slice(page);
                    } else {
                        let mut v = vec![0u8; ps];
                        v.copy_from_slice(page);
                        *slot = Some(v);
                    }
                }
            }
        }
        for (cpu, p) in held.iter().enumerate() {
            let Some(p) = p else { continue };
            let cpu = cpu as u32;
            match (raw_missed(p), commit_len(p)) {
                (Some(n), Some(0)) => sink.trailing_lost(cpu, n)?,
                (m, _) => sink.page(cpu, p, m)?,
            }
        }
        sink.finish(&summary)
    }
}

impl RawTrace {
    /// Parses a raw page stream held in memory (hostile-safe).
    pub fn parse(b: &[u8]) -> Result<Self, OutputError> {
        let mut st = RawStream::new(b)?;
        let mut pages = Vec::new();
        let mut summary = None;
        // Bounded: every record consumes bytes of `b`.
        while let Some(r) = st.next()? {
            match r {
                RawRecord::Page(cpu, p) => pages.push((cpu, p.to_vec())),
                RawRecord::End(s) => summary = Some(s),
            }
        }
        Ok(Self {
            page_size: st.page_size,
            nr_cpus: st.nr_cpus,
            clock: st.clock,
            pages,
            summary,
        })
    }

    /// Feeds the pages into another sink (e.g. a [`crate::TraceDatSink`]), losses
    /// preserved, then finishes it.
    /// A CPU's last page that holds no event but a loss count (what
    /// [`RawSink`]'s `trailing_lost` writes) is replayed as `trailing_lost`.
    pub fn replay(&self, mut sink: Box<dyn PageSink>) -> Result<(), OutputError> {
        let mut last_of_cpu = BTreeMap::new();
        for (i, (cpu, _)) in self.pages.iter().enumerate() {
            last_of_cpu.insert(*cpu, i);
        }
        for (i, (cpu, p)) in self.pages.iter().enumerate() {
            let missed = raw_missed(p);
            if let (Some(n), Some(0)) = (missed, commit_len(p)) {
                if last_of_cpu.get(cpu) == Some(&i) {
                    sink.trailing_lost(*cpu, n)?;
                    continue;
                }
            }
            sink.page(*cpu, p, missed)?;
        }
        sink.finish(&self.summary.clone().unwrap_or_default())
    }
}
