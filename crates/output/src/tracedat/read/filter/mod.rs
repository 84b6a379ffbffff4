//! `report -F`: trace-cmd's event filters (libtraceevent's parse-filter.c), checked
//! against the formats of a trace.dat and tested on its records.
//!
//! A filter is `EVENTS` or `EVENTS: EXPR` (`'sched_switch: prev_pid != 0 && next_comm
//! =~ "vcpu"'`). EVENTS is a comma-separated list of `[SYSTEM/]EVENT`, each a POSIX
//! basic regular expression matched whole and case-insensitively (`sched_sw.*`), an
//! EVENT without SYSTEM naming an event or a whole system (`sched`); EXPR is tested on
//! each record of those events ([`expr`] has its grammar). hyptrace's own
//! `SYSTEM:EVENT` form (`guest:marker`, `sched:*`, `*:sched_switch`: `*`/`?` globs, a
//! comma list of them, no expression) is kept: trace-cmd refuses it, so it means nothing
//! else.
//!
//! Several filters combine as trace-cmd 3.1.6 combines its `-F` options: a record is
//! printed when any filter passes it (a filter passes the records of the events it
//! names whose expression holds); an `ftrace:kernel_stack` or `ftrace:user_stack` record
//! right after a printed record of its CPU is printed too (trace-cmd's
//! `tracecmd_filter_match`).
//!
//! Checked when compiled: an event pattern no event of the file matches, a field none
//! of the selected events has, a syntax error, a string compared with a number field
//! (or the reverse) are errors naming what is wrong. As libtraceevent, an event
//! without a field the expression uses fails that comparison.
//! Bounded: [`MAX_FILTERS`] filters, each at most [`expr::MAX_EXPR_LEN`] bytes,
//! [`expr::MAX_DEPTH`] levels deep, regular expressions of at most
//! [`bre::MAX_REGEX_LEN`] bytes compiling into at most [`bre::REGEX_SIZE_LIMIT`].

use std::collections::{BTreeMap, BTreeSet};

use crate::format::{glob, EventFormat};

mod bre;
mod eval;
mod expr;
mod page;
#[cfg(test)]
mod tests;

use eval::{Node, Rec};
pub use page::{FilterCounts, FilteredSink, PageFiltered, PageSource};

/// Most filters (`-F` options) of one report.
pub const MAX_FILTERS: usize = 256;
/// Most resolved expressions (filters × the events each selects) of one report.
const MAX_RESOLVED: usize = 1 << 16;

/// Why a filter is refused (with the filter's text: [`FilterError`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterErrorKind {
    /// A syntax error at a byte offset of the expression.
    #[error("syntax error at column {col}: {msg}", col = .0 + 1, msg = .1)]
    Syntax(usize, String),
    /// The expression is longer than the limit.
    #[error("the expression is {0} bytes, more than {1}")]
    TooLong(usize, usize),
    /// Nested deeper than the limit.
    #[error("nested more than {0} deep")]
    TooDeep(usize),
    /// A regular expression that does not compile (or is too big).
    #[error("regular expression \"{0}\": {1}")]
    Regex(String, String),
    /// An event pattern that matches no event of the file.
    #[error("no event of the file matches `{0}`")]
    NoEvent(String),
    /// A field no selected event has.
    #[error("{1} has no field `{0}`")]
    NoField(String, String),
    /// A numeric comparison of a string (or array) field.
    #[error("`{0}` of {1} is not a number: compare it with a quoted string (== != =~ !~)")]
    NotNumber(String, String),
    /// A string comparison of a field that is not a string.
    #[error("`{0}` of {1} is not a string: compare it with a number")]
    NotString(String, String),
    /// Too many filters.
    #[error("more than {0} filters")]
    TooMany(usize),
    /// The filters select too many events.
    #[error("the filters select more than {0} events in all")]
    TooBig(usize),
    /// No event list before the `:`.
    #[error("no event before `:`")]
    NoEvents,
}

/// A refused filter: its text and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("-F '{spec}': {kind}")]
pub struct FilterError {
    /// The filter as given.
    pub spec: String,
    /// What is wrong.
    pub kind: FilterErrorKind,
}

/// Why a page could not be re-encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageFilterError {
    /// Shorter than its header.
    #[error("a page of {0} bytes is shorter than its header")]
    Short(usize),
}

/// One filter: its text and its expression per selected event id.
struct Filter {
    spec: String,
    events: BTreeMap<u16, Node>,
    /// Whether it has passed a record yet.
    matched: bool,
}

/// The filters of a report, compiled against a file's formats, with trace-cmd's state
/// (the CPUs that printed a record).
pub struct FilterSet {
    filters: Vec<Filter>,
    stack_ids: Vec<u16>,
    /// The CPUs that printed a record.
    printed_on: BTreeSet<u32>,
}

/// An event pattern: hyptrace's glob `[SYSTEM:]EVENT`, or libtraceevent's regex
/// `[SYSTEM/]EVENT`.
enum Pattern<'a> {
    Glob(Option<&'a str>, &'a str),
    Regex(bre::Bre, Option<bre::Bre>),
}

impl Pattern<'_> {
    fn matches(&self, f: &EventFormat) -> bool {
        match self {
            Pattern::Glob(Some(s), e) => glob(s, &f.system) && glob(e, &f.name),
            Pattern::Glob(None, e) => glob(e, &f.name),
            Pattern::Regex(e, Some(s)) => {
                s.is_match(f.system.as_bytes()) && e.is_match(f.name.as_bytes())
            }
            Pattern::Regex(e, None) => {
                e.is_match(f.system.as_bytes()) || e.is_match(f.name.as_bytes())
            }
        }
    }
}

/// Whether a glob list part is made only of name and glob characters.
fn glob_word(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'*' | b'?' | b'-' | b'.'))
}

/// hyptrace's `SYSTEM:EVENT` glob list (at least one part with a `:`, no expression),
/// split into (system, event) parts; `None` for a trace-cmd filter.
fn glob_list(spec: &str) -> Option<Vec<(Option<&str>, &str)>> {
    let parts: Vec<&str> = spec.split(',').map(str::trim).collect();
    let mut any_colon = false;
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        match p.split_once(':') {
            Some((s, e)) if glob_word(s) && glob_word(e) => {
                any_colon = true;
                out.push((Some(s), e));
            }
            None if glob_word(p) => out.push((None, p)),
            _ => return None,
        }
    }
    any_colon.then_some(out)
}

/// The event patterns and the expression of a filter.
fn split(spec: &str) -> Result<(Vec<Pattern<'_>>, Option<&str>), FilterErrorKind> {
    if let Some(globs) = glob_list(spec) {
        return Ok((
            globs
                .into_iter()
                .map(|(s, e)| Pattern::Glob(s, e))
                .collect(),
            None,
        ));
    }
    let (events, expr) = match spec.split_once(':') {
        Some((ev, ex)) => (ev, Some(ex)),
        None => (spec, None),
    };
    if events.len() > expr::MAX_EXPR_LEN {
        return Err(FilterErrorKind::TooLong(events.len(), expr::MAX_EXPR_LEN));
    }
    let mut pats = Vec::new();
    for part in events.split(',') {
        // As strtok_r(.., "/"): empty pieces are skipped, a third is ignored.
        let mut it = part.split('/').map(str::trim).filter(|s| !s.is_empty());
        pats.push(match (it.next(), it.next()) {
            (Some(sys), Some(ev)) => Pattern::Regex(
                bre::compile_bre(ev, true)?,
                Some(bre::compile_bre(sys, true)?),
            ),
            (Some(ev), None) => Pattern::Regex(bre::compile_bre(ev, true)?, None),
            _ => return Err(FilterErrorKind::NoEvents),
        });
    }
    Ok((pats, expr))
}

/// Compiles one filter against `formats`.
fn compile_one(
    spec: &str,
    formats: &[EventFormat],
    budget: &mut usize,
) -> Result<Filter, FilterErrorKind> {
    let (pats, expr) = split(spec)?;
    // Syntax errors point into the whole filter, after its `EVENTS:`.
    let shift = spec.len() - expr.map_or(0, str::len);
    let ast = expr.map(expr::parse).transpose().map_err(|e| match e {
        FilterErrorKind::Syntax(at, m) => FilterErrorKind::Syntax(at + shift, m),
        e => e,
    })?;
    let mut selected: Vec<&EventFormat> = Vec::new();
    for (i, p) in pats.iter().enumerate() {
        let mut any = false;
        for f in formats.iter().filter(|f| p.matches(f)) {
            any = true;
            if !selected.iter().any(|s| s.id == f.id) {
                selected.push(f);
            }
        }
        if !any {
            return Err(FilterErrorKind::NoEvent(pattern_text(spec, i)));
        }
    }
    let mut events = BTreeMap::new();
    if let Some(ast) = &ast {
        let mut missing = None;
        ast.fields(&mut |name| {
            if missing.is_none() && !selected.iter().any(|f| eval::has_field(f, name)) {
                missing = Some(name.to_string());
            }
        });
        if let Some(name) = missing {
            return Err(FilterErrorKind::NoField(name, event_list(&selected)));
        }
    }
    for f in selected {
        *budget = budget
            .checked_sub(1)
            .ok_or(FilterErrorKind::TooBig(MAX_RESOLVED))?;
        let node = match &ast {
            Some(a) => eval::resolve(a, f)?,
            None => Node::Const(true),
        };
        events.entry(f.id).or_insert(node);
    }
    Ok(Filter {
        spec: spec.to_string(),
        events,
        matched: false,
    })
}

/// The `i`th event pattern of `spec`, as written.
fn pattern_text(spec: &str, i: usize) -> String {
    let events = match glob_list(spec) {
        Some(_) => spec,
        None => spec.split_once(':').map_or(spec, |(e, _)| e),
    };
    events
        .split(',')
        .nth(i)
        .unwrap_or(events)
        .trim()
        .to_string()
}

/// `sys:a`, or `sys:a, sys:b, ... (N events)`.
fn event_list(sel: &[&EventFormat]) -> String {
    let names: Vec<String> = sel
        .iter()
        .take(3)
        .map(|f| format!("{}:{}", f.system, f.name))
        .collect();
    match sel.len() {
        0..=1 => names.join(""),
        n if n <= 3 => format!("none of {}", names.join(", ")),
        n => format!(
            "none of the {n} events it selects ({}, ...)",
            names.join(", ")
        ),
    }
}

impl FilterSet {
    /// Compiles `specs` (one per `-F`) against `formats`; `None` when there are none.
    pub fn compile(specs: &[String], formats: &[EventFormat]) -> Result<Option<Self>, FilterError> {
        if specs.is_empty() {
            return Ok(None);
        }
        let err = |spec: &str, kind| FilterError {
            spec: spec.to_string(),
            kind,
        };
        if specs.len() > MAX_FILTERS {
            return Err(err(
                &specs[MAX_FILTERS],
                FilterErrorKind::TooMany(MAX_FILTERS),
            ));
        }
        let mut budget = MAX_RESOLVED;
        let filters = specs
            .iter()
            .map(|s| compile_one(s, formats, &mut budget).map_err(|k| err(s, k)))
            .collect::<Result<Vec<_>, _>>()?;
        let stack_ids = formats
            .iter()
            .filter(|f| {
                f.system == "ftrace" && matches!(f.name.as_str(), "kernel_stack" | "user_stack")
            })
            .map(|f| f.id)
            .collect();
        Ok(Some(Self {
            filters,
            stack_ids,
            printed_on: BTreeSet::new(),
        }))
    }

    /// Whether the record is printed (trace-cmd 3.1.6's `tracecmd_filter_match`): some
    /// filter passes it, or it is a stack trace of a CPU that printed a record before
    /// (3.1.6 never clears that mark: every later stack trace of the CPU). Every
    /// filter that has not passed a record yet is tested, so [`FilterSet::unmatched`]
    /// is exact.
    pub fn wants(&mut self, payload: &[u8], cpu: u32, cmdlines: &BTreeMap<i32, String>) -> bool {
        let id = payload
            .get(..2)
            .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
        let rec = Rec {
            payload,
            cpu,
            cmdlines,
        };
        let mut found = false;
        for f in &mut self.filters {
            if found && f.matched {
                continue;
            }
            if f.events.get(&id).is_some_and(|n| n.test(&rec)) {
                f.matched = true;
                found = true;
            }
        }
        let printed_before = self.printed_on.contains(&cpu);
        if found || (printed_before && self.stack_ids.contains(&id)) {
            self.printed_on.insert(cpu);
            return true;
        }
        false
    }

    /// The filters that have passed no record.
    pub fn unmatched(&self) -> Vec<String> {
        self.filters
            .iter()
            .filter(|f| !f.matched)
            .map(|f| f.spec.clone())
            .collect()
    }
}

/// What a report printed and what its selection matched.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReportOutcome {
    /// Events printed.
    pub printed: u64,
    /// Events of the selected CPUs read (before `-F`).
    pub read: u64,
    /// Whether every record of the selected CPUs was read (`--count` did not stop it).
    pub complete: bool,
    /// The `-F` filters that passed no record read.
    pub unmatched: Vec<String>,
}
