//! POSIX basic regular expressions as libtraceevent compiles them (`regcomp(...,
//! REG_ICASE | REG_NOSUB)`, glibc): translated to the regex crate's syntax and matched
//! case-insensitively on bytes, unanchored unless the expression anchors itself.
//!
//! Basic syntax: `\(` `\)` group, `\{m,n\}` repeat, `*`, `.`, `[...]` (with `[:class:]`),
//! `^` at the start and `$` at the end anchor; glibc's `\|`, `\+`, `\?`, `\<`, `\>`,
//! `\b`, `\w`, `\s` are understood; a plain `(`, `+`, `?`, `|`, `{` is itself.
//! Back-references (`\1`) are refused. Bounded: the expression is at most
//! [`MAX_REGEX_LEN`] bytes and compiles into at most [`REGEX_SIZE_LIMIT`] bytes.

use super::FilterErrorKind as E;

/// Longest regular expression (bytes).
pub const MAX_REGEX_LEN: usize = 1024;
/// Most memory a compiled expression (and its lazy DFA) may take.
pub const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// A compiled expression.
#[derive(Debug)]
pub struct Bre(regex::bytes::Regex);

impl Bre {
    /// Whether the expression matches somewhere in `text`.
    pub fn is_match(&self, text: &[u8]) -> bool {
        self.0.is_match(text)
    }
}

/// Compiles `pat` (anchored at both ends with `whole`, as libtraceevent's `^NAME$` of
/// event names).
pub fn compile_bre(pat: &str, whole: bool) -> Result<Bre, E> {
    if pat.len() > MAX_REGEX_LEN {
        return Err(E::Regex(
            pat.to_string(),
            format!("longer than {MAX_REGEX_LEN} bytes"),
        ));
    }
    let full = if whole {
        format!("^{pat}$")
    } else {
        pat.to_string()
    };
    let translated = translate(&full).map_err(|r| E::Regex(pat.to_string(), r))?;
    regex::bytes::RegexBuilder::new(&translated)
        .case_insensitive(true)
        .unicode(false)
        .dot_matches_new_line(true)
        .size_limit(REGEX_SIZE_LIMIT)
        .dfa_size_limit(REGEX_SIZE_LIMIT)
        .build()
        .map(Bre)
        .map_err(|e| E::Regex(pat.to_string(), first_line(&e.to_string())))
}

fn first_line(s: &str) -> String {
    s.lines().last().unwrap_or(s).trim().to_string()
}

/// Translates basic syntax into the regex crate's.
fn translate(p: &str) -> Result<String, String> {
    let c: Vec<char> = p.chars().collect();
    let mut out = String::with_capacity(p.len() * 2);
    // At the start of an expression (the start, after `\(` or `\|`, after a leading
    // `^`): there `*` is literal and `^` anchors.
    let mut start = true;
    let mut i = 0;
    // Bounded: every round consumes at least one character.
    while i < c.len() {
        let ch = c[i];
        i += 1;
        let was_start = std::mem::replace(&mut start, false);
        match ch {
            '\\' => {
                let Some(&n) = c.get(i) else {
                    return Err("ends with a lone `\\`".into());
                };
                i += 1;
                match n {
                    '(' | '|' => {
                        out.push_str(if n == '(' { "(?:" } else { "|" });
                        start = true;
                    }
                    ')' | '{' | '}' | '+' | '?' => out.push(n),
                    '<' | '>' => out.push_str("\\b"),
                    'b' | 'B' | 'w' | 'W' | 's' | 'S' => {
                        out.push('\\');
                        out.push(n);
                    }
                    '1'..='9' => return Err("back-references are not supported".into()),
                    _ => push_literal(&mut out, n),
                }
            }
            '[' => i = bracket(&c, i, &mut out)?,
            '*' if was_start => out.push_str("\\*"),
            '^' if was_start => {
                out.push('^');
                start = true;
            }
            '$' if i == c.len()
                || c[i..].starts_with(&['\\', ')'])
                || c[i..].starts_with(&['\\', '|']) =>
            {
                out.push('$')
            }
            '*' | '.' => out.push(ch),
            _ => push_literal(&mut out, ch),
        }
    }
    Ok(out)
}

fn push_literal(out: &mut String, ch: char) {
    let mut b = [0u8; 4];
    out.push_str(&regex::escape(ch.encode_utf8(&mut b)));
}

/// Copies the bracket expression starting after its `[` at `c[i]`; returns the index
/// after its `]`. A `]` first is literal, a backslash is literal, `[:class:]` is kept.
fn bracket(c: &[char], mut i: usize, out: &mut String) -> Result<usize, String> {
    out.push('[');
    if c.get(i) == Some(&'^') {
        out.push('^');
        i += 1;
    }
    let mut first = true;
    // Bounded: every round consumes at least one character.
    loop {
        let Some(&ch) = c.get(i) else {
            return Err("`[` without its `]`".into());
        };
        i += 1;
        match ch {
            ']' if !first => {
                out.push(']');
                return Ok(i);
            }
            '[' if matches!(c.get(i), Some(':' | '=' | '.')) => {
                let kind = c[i];
                let close = (i + 1..c.len().saturating_sub(1))
                    .find(|&j| c[j] == kind && c[j + 1] == ']')
                    .ok_or("`[:` without its `:]`")?;
                let name: String = c[i + 1..close].iter().collect();
                if kind == ':' {
                    out.push_str(&format!("[:{name}:]"));
                } else {
                    // `[=c=]` and `[.c.]`: the character itself.
                    for n in name.chars() {
                        push_literal(out, n);
                    }
                }
                i = close + 2;
            }
            '-' => out.push('-'),
            _ => push_literal(out, ch),
        }
        first = false;
    }
}
