//! Text output exactly like `trace-cmd report -t` (trace-cmd 3.1.6, verified by
//! experiment): one formatter for `run` (live events), `report` and the text sink.
//!
//! Line layout: `{comm:>16}-{pid:<5} [{cpu:03}] {sec:>5}.{nsec:09}: {name+":":<21} {fields}`,
//! drop markers `CPU:{cpu} [{n} EVENTS DROPPED]` (or `CPU:{cpu} [EVENTS DROPPED]` when
//! the count is unknown), and a first line `cpus={n}`. Fields follow the event's
//! compiled `print fmt` ([`hyptrace_format::printfmt`]) or the output of the trace-cmd plugin
//! for the event (the `plugins` module); what neither supports is printed raw as
//! `name=value ...` with one warning per event on stderr.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub use hyptrace_format::{escape_guest_bytes, escape_guest_str, escaped_guest_bytes};
use hyptrace_format::{must_escape, EventFormat, Field, KernelSymbols, Program};

use crate::export::Missed;
use crate::plugins::Plugin;

/// Appends one event line (no newline) as `trace-cmd report -t` prints it:
/// `{comm:>16}-{pid:<5} [{cpu:03}] {sec:>5}.{nsec:09}: {event+":":<21} {fields}`.
/// Written by hand (no `format!`): `run` prints hundreds of thousands of lines a second.
pub fn format_event(
    out: &mut String,
    comm: &str,
    pid: i32,
    cpu: u32,
    ts_ns: u64,
    event: &str,
    fields: &str,
) {
    let mut num = itoa::Buffer::new();
    push_padded_left(out, comm, 16);
    out.push('-');
    let p = num.format(pid);
    out.push_str(p);
    spaces(out, 5usize.saturating_sub(p.len()));
    out.push_str(" [");
    let c = num.format(cpu);
    zeros(out, 3usize.saturating_sub(c.len()));
    out.push_str(c);
    out.push_str("] ");
    push_ts(out, ts_ns);
    out.push_str(": ");
    let width = push_escaped_width(out, event);
    out.push(':');
    spaces(out, 20usize.saturating_sub(width));
    out.push(' ');
    out.push_str(fields);
}

/// Whether `s` is printable ASCII (nothing to escape, one column per byte): the
/// common case, checked without decoding characters.
fn plain_ascii(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// Appends `s` (escaped) right-aligned in `width` columns.
fn push_padded_left(out: &mut String, s: &str, width: usize) {
    if plain_ascii(s) {
        spaces(out, width.saturating_sub(s.len()));
        out.push_str(s);
    } else {
        let e = escape_guest_str(s);
        spaces(out, width.saturating_sub(e.chars().count()));
        out.push_str(&e);
    }
}

/// Appends `s` escaped; returns its width in characters.
fn push_escaped_width(out: &mut String, s: &str) -> usize {
    if plain_ascii(s) {
        out.push_str(s);
        s.len()
    } else {
        let e = escape_guest_str(s);
        out.push_str(&e);
        e.chars().count()
    }
}

/// Appends `{sec:>5}.{nsec:09}` with two itoa conversions and no formatter.
fn push_ts(out: &mut String, ts_ns: u64) {
    let mut num = itoa::Buffer::new();
    let sec = num.format(ts_ns / 1_000_000_000);
    spaces(out, 5usize.saturating_sub(sec.len()));
    out.push_str(sec);
    out.push('.');
    let ns = num.format(ts_ns % 1_000_000_000);
    zeros(out, 9 - ns.len());
    out.push_str(ns);
}

fn spaces(out: &mut String, n: usize) {
    const SPACES: &str = "                                ";
    let mut n = n;
    while n > 0 {
        let k = n.min(SPACES.len());
        out.push_str(&SPACES[..k]);
        n -= k;
    }
}

fn zeros(out: &mut String, n: usize) {
    const ZEROS: &str = "000000000";
    out.push_str(&ZEROS[..n.min(ZEROS.len())]);
    for _ in ZEROS.len()..n {
        out.push('0');
    }
}

/// Fields of the built-in `marker` and `span` events, printed directly (their print
/// fmts are `seq=%llu value=%llu` and `seq=%llu id=%llu dur=%llu`); `None` for other
/// events or short payloads. A test checks it against the print-fmt interpreter.
fn guest_fast_fields(out: &mut String, id: u16, payload: &[u8]) -> bool {
    use hyptrace_abi::events::{MARKER_ID, MARKER_SIZE, SPAN_ID, SPAN_SIZE};
    let word = |off: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&payload[off..off + 8]);
        u64::from_le_bytes(b)
    };
    let mut num = itoa::Buffer::new();
    let names: &[&str] = match id {
        MARKER_ID if payload.len() >= MARKER_SIZE => &["seq=", " value="],
        SPAN_ID if payload.len() >= SPAN_SIZE => &["seq=", " id=", " dur="],
        _ => return false,
    };
    for (i, name) in names.iter().enumerate() {
        out.push_str(name);
        out.push_str(num.format(word(8 + 8 * i)));
    }
    true
}

/// Appends `s` escaped if it needs it (names and comms read from a trace.dat).
fn push_safe(out: &mut String, s: &str) {
    if s.chars().any(must_escape) {
        escape_guest_bytes(out, s.as_bytes());
    } else {
        out.push_str(s);
    }
}

/// Appends a drop-marker line (no newline).
pub fn format_drop(out: &mut String, cpu: u32, missed: Missed) {
    let _ = match missed {
        Missed::Count(n) => write!(out, "CPU:{cpu} [{n} EVENTS DROPPED]"),
        _ => write!(out, "CPU:{cpu} [EVENTS DROPPED]"),
    };
}

/// Appends the line (no newline) a merger prints when its window is exceeded: `held`
/// events wait for CPU `lagging` and the oldest are printed ahead of it (see
/// [`crate::Merger::release`]).
pub fn format_window_exceeded(out: &mut String, held: usize, lagging: Option<usize>) {
    let _ = match lagging {
        Some(c) => write!(
            out,
            "hyptrace: merge window exceeded: {held} events wait for cpu {c}; printing the oldest ahead of it (order across CPUs is not exact from here)"
        ),
        None => write!(
            out,
            "hyptrace: merge window exceeded: {held} events wait for a CPU; printing the oldest ahead of it (order across CPUs is not exact from here)"
        ),
    };
}

/// The comm trace-cmd shows for `pid`: `<idle>` for 0, the saved cmdline, else `<...>`.
pub fn comm_of(cmdlines: &BTreeMap<i32, String>, pid: i32) -> &str {
    if pid == 0 {
        return "<idle>";
    }
    cmdlines.get(&pid).map(String::as_str).unwrap_or("<...>")
}

/// Reads an integer field (1, 2, 4 or 8 bytes; sign-extended when signed). `None` for
/// other sizes or when it runs past the payload.
pub fn field_int(f: &Field, payload: &[u8]) -> Option<u64> {
    let b = payload.get(f.offset..f.offset.checked_add(f.size)?)?;
    let mut w = [0u8; 8];
    match f.size {
        1 | 2 | 4 | 8 => w[..f.size].copy_from_slice(b),
        _ => return None,
    }
    let v = u64::from_le_bytes(w);
    Some(if f.signed && f.size < 8 {
        let sh = 64 - 8 * f.size as u32;
        (((v << sh) as i64) >> sh) as u64
    } else {
        v
    })
}

/// The bytes of a string / dynamic field: char arrays, `__data_loc` and `__rel_loc`.
/// Strings stop at the first NUL.
pub fn field_bytes<'a>(f: &Field, payload: &'a [u8]) -> Option<&'a [u8]> {
    let b = if f.is_data_loc() || f.is_rel_loc() {
        let w = payload.get(f.offset..f.offset.checked_add(4)?)?;
        let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        let mut off = (w & 0xffff) as usize;
        if f.is_rel_loc() {
            off = off.checked_add(f.offset)?.checked_add(f.size)?;
        }
        let len = (w >> 16) as usize;
        payload.get(off..off.checked_add(len)?)?
    } else if f.is_array() {
        payload.get(f.offset..f.offset.checked_add(f.size)?)?
    } else {
        return None;
    };
    Some(if f.is_string() {
        b.split(|&c| c == 0).next().unwrap_or(b)
    } else {
        b
    })
}

/// Raw field printing (`name=value` for every non-common field), used when the print
/// fmt is not interpreted.
pub fn format_fields_raw(out: &mut String, fmt: &EventFormat, payload: &[u8]) {
    let mut first = true;
    for f in &fmt.fields {
        if !first {
            out.push(' ');
        }
        first = false;
        push_safe(out, &f.name);
        out.push('=');
        if f.is_string() {
            match field_bytes(f, payload) {
                Some(b) => escape_guest_bytes(out, b),
                None => out.push_str("<bad>"),
            }
        } else if f.is_array() || f.is_data_loc() || f.is_rel_loc() {
            match field_bytes(f, payload) {
                Some(b) => {
                    out.push_str("ARRAY[");
                    for (i, x) in b.iter().enumerate() {
                        let _ = write!(out, "{}{x:02x}", if i == 0 { "" } else { ", " });
                    }
                    out.push(']');
                }
                None => out.push_str("<bad>"),
            }
        } else {
            match field_int(f, payload) {
                Some(v) if f.signed => {
                    let _ = write!(out, "{}", v as i64);
                }
                Some(v) => {
                    let _ = write!(out, "{v}");
                }
                None => out.push_str("<bad>"),
            }
        }
    }
}

/// How an event's fields are printed.
#[derive(Clone, Debug)]
enum Handler {
    /// The compiled print fmt.
    Program(Program),
    /// A trace-cmd plugin's output and the compiled print fmt (printed after a prefix
    /// plugin's output, or instead of what a plugin does not handle).
    Plugin(Plugin, Option<Program>),
    /// Raw fields (`name=value`), with why.
    Raw(String),
}

/// A format with its compiled print fmt (or plugin), ready to print events.
#[derive(Clone, Debug)]
pub struct EventPrinter {
    /// The format.
    pub format: EventFormat,
    handler: Handler,
    /// Kernel symbols for `%pS`, plugins and printk strings.
    syms: Arc<KernelSymbols>,
    /// The format is one of the built-in guest events: print it without the interpreter.
    guest_fast: bool,
    /// Whether the one warning about raw printing was given.
    warned: Arc<AtomicBool>,
}

impl EventPrinter {
    /// Compiles the print fmt of `format` once (no kernel symbols, 8-byte longs).
    pub fn new(format: EventFormat) -> Self {
        Self::with_symbols(format, Arc::default(), 8)
    }

    /// Compiles the print fmt of `format` once, for a trace whose kernel has
    /// `long_size`-byte longs and the symbols `syms`; selects trace-cmd's plugin output
    /// for the events it has one for.
    pub fn with_symbols(format: EventFormat, syms: Arc<KernelSymbols>, long_size: u8) -> Self {
        let guest_fast = hyptrace_format::guest_formats().contains(&format);
        let program = if format.system == "ftrace" && format.name == "bprint" {
            // Its arguments are binary (vbin_printf), not the fields the fmt names.
            Err(hyptrace_format::Unsupported(
                "binary trace_printk arguments are not decoded".into(),
            ))
        } else {
            Program::compile(&format, &format.print_fmt, long_size)
        };
        let handler = match (Plugin::for_format(&format), program) {
            (Some(pl), Ok(p)) => Handler::Plugin(pl, Some(p)),
            (Some(pl), Err(_)) if !pl.then_print_fmt() => Handler::Plugin(pl, None),
            (_, Ok(p)) => Handler::Program(p),
            (_, Err(e)) => Handler::Raw(e.0),
        };
        Self {
            format,
            handler,
            syms,
            guest_fast,
            warned: Arc::default(),
        }
    }

    /// Whether the fields are printed as trace-cmd prints them (print fmt or plugin),
    /// else raw.
    pub fn print_fmt_supported(&self) -> bool {
        !matches!(self.handler, Handler::Raw(_))
    }

    /// Why the fields are printed raw (`None` when they are not).
    pub fn unsupported_reason(&self) -> Option<&str> {
        match &self.handler {
            Handler::Raw(why) => Some(why),
            _ => None,
        }
    }

    /// Appends the fields of `payload`; returns true if they were printed as trace-cmd
    /// prints them, false if raw (then a warning is printed on stderr, once per event).
    pub fn format_fields(&self, out: &mut String, payload: &[u8]) -> bool {
        let start = out.len();
        let ok = match &self.handler {
            Handler::Program(p) => p.run(out, payload, &self.syms).is_some(),
            // A prefix plugin (kmem) then the print fmt; a plugin that prints the
            // fields instead, or the print fmt for what it does not handle.
            Handler::Plugin(pl, prog) if pl.then_print_fmt() => {
                pl.run(out, payload, &self.syms).is_some()
                    && prog
                        .as_ref()
                        .is_some_and(|p| p.run(out, payload, &self.syms).is_some())
            }
            Handler::Plugin(pl, prog) => {
                pl.run(out, payload, &self.syms).is_some()
                    || prog
                        .as_ref()
                        .is_some_and(|p| p.run(out, payload, &self.syms).is_some())
            }
            Handler::Raw(_) => false,
        };
        if ok {
            return true;
        }
        out.truncate(start);
        format_fields_raw(out, &self.format, payload);
        if !self.warned.swap(true, Ordering::Relaxed) {
            let why = match &self.handler {
                Handler::Raw(why) => why.as_str(),
                _ => "a payload does not match its format",
            };
            eprintln!(
                "hyptrace: {}:{}: fields printed raw ({})",
                escape_guest_str(&self.format.system),
                escape_guest_str(&self.format.name),
                escape_guest_str(why)
            );
        }
        false
    }
}

/// Printers for the built-in guest events, by id.
pub fn guest_printers() -> BTreeMap<u16, EventPrinter> {
    hyptrace_format::guest_formats()
        .into_iter()
        .map(|f| (f.id, EventPrinter::new(f)))
        .collect()
}

/// Formats one event payload (common header + fields) into a full line the way
/// `trace-cmd report -t` prints it: the one formatter of `run` (live events), the text
/// sink and `report`. `printers` are the event formats by id, `cmdlines` maps pids to
/// comms (see [`crate::TraceMeta::cmdlines`]). An event whose id has no format prints
/// as `[UNKNOWN EVENT]` with `id=N` in the usual columns (trace-cmd 3.1.6 prints
/// `[UNKNOWN EVENT][UNKNOWN EVENT] (NULL): [UNKNOWN EVENT]` without CPU or time);
/// a payload shorter than its id counts as id 0, shorter than its pid as pid -1.
pub fn format_guest_line(
    out: &mut String,
    printers: &BTreeMap<u16, EventPrinter>,
    cmdlines: &BTreeMap<i32, String>,
    cpu: u32,
    ts_ns: u64,
    payload: &[u8],
) {
    let id = payload
        .get(..2)
        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
    let pid = payload
        .get(4..8)
        .map_or(-1, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let comm = comm_of(cmdlines, pid);
    match printers.get(&id) {
        Some(p) => {
            // The fields end the line: append them right after the prefix.
            format_event(out, comm, pid, cpu, ts_ns, &p.format.name, "");
            if !(p.guest_fast && guest_fast_fields(out, id, payload)) {
                p.format_fields(out, payload);
            }
        }
        None => {
            format_event(out, comm, pid, cpu, ts_ns, "[UNKNOWN EVENT]", "id=");
            out.push_str(itoa::Buffer::new().format(id));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_format::format::guest_formats;

    #[test]
    fn line_layout() {
        let mut s = String::new();
        format_event(
            &mut s,
            "vcpu0",
            1,
            0,
            1_000_000_000,
            "marker",
            "seq=1 value=10",
        );
        assert_eq!(
            s,
            "           vcpu0-1     [000]     1.000000000: marker:               seq=1 value=10"
        );
        let mut s = String::new();
        format_event(
            &mut s,
            "<...>",
            123456,
            1100,
            1004,
            "eeeeeeeeeeeeeeeeeeeee",
            "x",
        );
        assert_eq!(
            s,
            "           <...>-123456 [1100]     0.000001004: eeeeeeeeeeeeeeeeeeeee: x"
        );
        let mut s = String::new();
        format_drop(&mut s, 3, Missed::Count(7));
        assert_eq!(s, "CPU:3 [7 EVENTS DROPPED]");
    }

    #[test]
    fn print_fmt_subset() {
        let text = "name: sched_waking\nID: 375\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n\n\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;\n\tfield:int target_cpu;\toffset:32;\tsize:4;\tsigned:1;\n\nprint fmt: \"comm=%s pid=%d prio=%d target_cpu=%03d\", REC->comm, REC->pid, REC->prio, REC->target_cpu\n";
        let f = EventFormat::parse("sched", text).unwrap();
        let mut payload = vec![0u8; 36];
        payload[8..12].copy_from_slice(b"bash");
        payload[24..28].copy_from_slice(&(-5i32).to_le_bytes());
        payload[28..32].copy_from_slice(&120i32.to_le_bytes());
        payload[32..36].copy_from_slice(&1i32.to_le_bytes());
        let p = EventPrinter::new(f.clone());
        let mut s = String::new();
        assert!(p.format_fields(&mut s, &payload));
        assert_eq!(s, "comm=bash pid=-5 prio=120 target_cpu=001");
        // Unsupported: raw fields, never a partial line.
        let mut g = f;
        g.print_fmt = "\"%pU x\", REC->pid".into();
        let p = EventPrinter::new(g);
        assert!(!p.print_fmt_supported());
        let mut s = String::new();
        assert!(!p.format_fields(&mut s, &payload));
        assert_eq!(s, "comm=bash pid=-5 prio=120 target_cpu=1");
    }

    #[test]
    fn bprint_is_raw() {
        let mut f = guest_formats().remove(0);
        f.system = "ftrace".into();
        f.name = "bprint".into();
        let p = EventPrinter::new(f);
        assert!(!p.print_fmt_supported());
        assert!(p.unsupported_reason().unwrap().contains("trace_printk"));
    }

    #[test]
    fn guest_lines() {
        let printers = guest_printers();
        assert!(printers.values().all(EventPrinter::print_fmt_supported));
        let cmd: BTreeMap<i32, String> = [(1, "vcpu0".to_string())].into();
        let mut s = String::new();
        let mut buf = [0u8; 64];
        let n = hyptrace_abi::events::text(&mut buf, 1, 3, b"hi \"x\"").unwrap();
        format_guest_line(&mut s, &printers, &cmd, 0, 5, &buf[..n]);
        assert_eq!(
            norm(&s),
            "vcpu0-1 [000] 0.000000005: text: seq=3 msg=hi \"x\""
        );
        let mut s = String::new();
        format_guest_line(
            &mut s,
            &printers,
            &cmd,
            0,
            5,
            &hyptrace_abi::events::span(2, 1, 2, 3),
        );
        assert_eq!(
            norm(&s),
            "<...>-2 [000] 0.000000005: span: seq=1 id=2 dur=3"
        );
        // A truncated payload falls back to raw printing, never panics.
        let p = &printers[&1000];
        let mut s = String::new();
        assert!(!p.format_fields(&mut s, &hyptrace_abi::events::marker(1, 1, 1)[..12]));
        assert_eq!(s, "seq=<bad> value=<bad>");
        let _ = guest_formats();
    }

    fn norm(s: &str) -> String {
        s.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

#[cfg(test)]
mod hostile_tests {
    use super::*;

    #[test]
    fn huge_field_offsets_do_not_panic() {
        let f = Field {
            type_name: "__rel_loc char[]".into(),
            name: "x".into(),
            offset: usize::MAX - 1,
            size: 4,
            signed: false,
        };
        assert_eq!(field_bytes(&f, &[0u8; 16]), None);
        let f = Field {
            type_name: "u64".into(),
            name: "x".into(),
            offset: usize::MAX,
            size: 8,
            signed: false,
        };
        assert_eq!(field_int(&f, &[0u8; 16]), None);
        let f = Field {
            type_name: "char[4]".into(),
            name: "x".into(),
            offset: usize::MAX,
            size: 4,
            signed: false,
        };
        assert_eq!(field_bytes(&f, &[0u8; 16]), None);
    }

    #[test]
    fn fast_guest_fields_match_the_print_fmt() {
        let printers = guest_printers();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..2000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let vals = [i, x, x.rotate_left(17), u64::MAX - i];
            for (id, size) in [
                (
                    hyptrace_abi::events::MARKER_ID,
                    hyptrace_abi::events::MARKER_SIZE,
                ),
                (
                    hyptrace_abi::events::SPAN_ID,
                    hyptrace_abi::events::SPAN_SIZE,
                ),
            ] {
                let mut p = vec![0u8; size];
                p[..2].copy_from_slice(&id.to_le_bytes());
                for (k, v) in vals.iter().take((size - 8) / 8).enumerate() {
                    p[8 + 8 * k..16 + 8 * k].copy_from_slice(&v.to_le_bytes());
                }
                let (mut fast, mut slow) = (String::new(), String::new());
                assert!(guest_fast_fields(&mut fast, id, &p));
                assert!(printers[&id].format_fields(&mut slow, &p));
                assert_eq!(fast, slow);
            }
        }
    }
}
