//! The metadata items of a trace.dat (headers, formats, cmdlines, symbols, option
//! values), each kept within the metadata [`Budget`]: an item past it is walked over,
//! not kept, and counted.

use std::collections::BTreeMap;

use hyptrace_abi::page::PAGE_HEADER_SIZE;

use crate::format::{EventFormat, HeaderPage};
use crate::symbols::KernelSymbols;
use crate::{DatError, DatProblem};

use super::budget::{cmdline_cost, format_cost, symbol_cost, Budget, MAX_SECTION};
use super::input::Input;

/// The header info: `header_page` (tag, size, text) then `header_event`. The outer
/// error is a structure that cannot be walked; the inner one a `header_page` text that
/// does not parse or does not fit in the budget (the caller falls back to the kernel's
/// layout).
pub(super) fn parse_header_info(
    c: &mut impl Input,
    budget: &mut Budget,
) -> Result<Result<HeaderPage, DatError>, DatError> {
    if c.bytes(12, "header_page tag")? != b"header_page\0" {
        return Err(c.err(DatProblem::Expected("header_page")));
    }
    let n = c.len64("header_page size")?;
    let hp = if budget.take(n as u64) {
        HeaderPage::parse(&c.text(n, "header_page text")?).map_err(DatError::from)
    } else {
        let e = c.err(DatProblem::OverBudget(budget.over(n as u64)));
        c.skip(n as u64, "header_page text")?;
        Err(e)
    };
    if c.bytes(13, "header_event tag")? != b"header_event\0" {
        return Err(c.err(DatProblem::Expected("header_event")));
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

/// One format text of `system` into `out` if its parsed size fits in the budget (else
/// walked over); returns whether it was past the budget.
fn format(
    c: &mut impl Input,
    system: &str,
    out: &mut Vec<EventFormat>,
    budget: &mut Budget,
) -> Result<bool, DatError> {
    let len = c.len64("event format size")?;
    if !budget.take(format_cost(len)) {
        c.skip(len as u64, "event format")?;
        return Ok(true);
    }
    let t = c.text(len, "event format")?;
    if let Ok(f) = EventFormat::parse(system, &t) {
        out.push(f);
    }
    Ok(false)
}

/// The ftrace formats (count, then length-prefixed texts); returns how many were past
/// the budget.
pub(super) fn parse_ftrace_events(
    c: &mut impl Input,
    out: &mut Vec<EventFormat>,
    budget: &mut Budget,
) -> Result<u64, DatError> {
    let n = c.u32("ftrace event count")?;
    let mut over = 0;
    // Bounded: each format consumes at least its 8-byte length.
    for _ in 0..n {
        over += u64::from(format(c, "ftrace", out, budget)?);
    }
    Ok(over)
}

/// The event formats (systems, each with its formats); returns how many were past the
/// budget.
pub(super) fn parse_event_formats(
    c: &mut impl Input,
    out: &mut Vec<EventFormat>,
    budget: &mut Budget,
) -> Result<u64, DatError> {
    let systems = c.u32("system count")?;
    let mut over = 0;
    // Bounded: each system consumes its name and count, each format its length.
    for _ in 0..systems {
        let sys = c.cstr("system name")?;
        let n = c.u32("event count")?;
        for _ in 0..n {
            over += u64::from(format(c, &sys, out, budget)?);
        }
    }
    Ok(over)
}

/// A u32-sized blob (kallsyms, printk formats): its bytes when they fit in
/// [`MAX_SECTION`] and in the budget, else walked over: `Err(its size)`.
pub(super) fn u32_sized_text(
    c: &mut impl Input,
    what: &'static str,
    budget: &mut Budget,
) -> Result<Result<Vec<u8>, u64>, DatError> {
    let n = c.u32(what)?;
    if n as usize > MAX_SECTION || !budget.take(u64::from(n)) {
        c.skip(u64::from(n), what)?;
        return Ok(Err(u64::from(n)));
    }
    Ok(Ok(c.bytes(n as usize, what)?.to_vec()))
}

/// The saved cmdlines (`PID COMM` lines, one text), pid → comm; returns how many lines
/// were past the budget (the whole text when it does not fit).
pub(super) fn parse_cmdlines(
    c: &mut impl Input,
    out: &mut BTreeMap<i32, String>,
    budget: &mut Budget,
) -> Result<u64, DatError> {
    let n = c.len64("cmdlines size")?;
    if !budget.take(n as u64) {
        c.skip(n as u64, "cmdlines")?;
        return Ok(1);
    }
    let t = c.text(n, "cmdlines")?;
    let mut lines = t.lines();
    for line in lines.by_ref() {
        let Some((pid, comm)) = line.split_once(' ') else {
            continue;
        };
        let Ok(pid) = pid.trim().parse::<i32>() else {
            continue;
        };
        if !budget.take(cmdline_cost(comm.len())) {
            return Ok(1 + lines.count() as u64);
        }
        out.insert(pid, comm.to_string());
    }
    Ok(0)
}

/// Parses kallsyms (`kallsyms`) or printk formats text into `syms`, the lines that fit
/// in the budget; returns how many lines were past it.
pub(super) fn parse_symbols(
    syms: &mut KernelSymbols,
    text: &[u8],
    kallsyms: bool,
    budget: &mut Budget,
) -> u64 {
    let (mut end, mut over) = (0, 0);
    // Bounded: one step per line.
    for line in text.split(|&b| b == b'\n') {
        if over > 0 || !budget.take(symbol_cost(line.len())) {
            over += 1;
            continue;
        }
        end += line.len() + 1;
    }
    let text = &text[..end.min(text.len())];
    if kallsyms {
        syms.parse_kallsyms(text);
    } else {
        syms.parse_printk(text);
    }
    over
}

/// The bracketed (selected) clock of a trace_clock text.
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
