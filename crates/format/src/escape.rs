//! Escaping of guest-controlled bytes for one line of text output: the one rule the
//! text formatter, the print-format evaluator and the host's messages share.

use std::fmt::Write as _;

/// Whether `c` is written escaped in text output: C0 controls, DEL, C1 controls, the
/// line/paragraph separators and the bidirectional-text controls (which reorder what a
/// terminal shows).
pub fn must_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{061c}'
        )
        || ('\u{202a}'..='\u{202e}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

fn push_escaped_char(out: &mut String, c: char) {
    match c {
        '\n' => out.push_str("\\n"),
        '\t' => out.push_str("\\t"),
        '\r' => out.push_str("\\r"),
        c if (c as u32) < 0x100 => {
            let _ = write!(out, "\\x{:02x}", c as u32);
        }
        c => {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
    }
}

/// Appends guest-controlled bytes `b` (a `%s` field, a panic message) to a text line so
/// that they can neither end the line nor drive the terminal: control characters are
/// written as C escapes (`\n`, `\t`, `\r`, `\xNN` for the other C0/C1 controls and DEL,
/// `\u{NNNN}` for line separators and bidirectional controls), bytes that are not UTF-8
/// as `\xNN`; everything else, backslashes included, is copied as is (so printable
/// strings stay byte-identical to what `trace-cmd report` prints; trace-cmd prints `%s`
/// raw).
pub fn escape_guest_bytes(out: &mut String, b: &[u8]) {
    for chunk in b.utf8_chunks() {
        let valid = chunk.valid();
        if !valid.chars().any(must_escape) {
            out.push_str(valid);
        } else {
            for c in valid.chars() {
                if must_escape(c) {
                    push_escaped_char(out, c);
                } else {
                    out.push(c);
                }
            }
        }
        for &x in chunk.invalid() {
            let _ = write!(out, "\\x{x:02x}");
        }
    }
}

/// A guest string made safe for one line of text output (see [`escape_guest_bytes`]);
/// borrowed when nothing needs escaping. The host uses it for the guest's panic message.
pub fn escape_guest_str(s: &str) -> std::borrow::Cow<'_, str> {
    if s.chars().any(must_escape) {
        let mut out = String::with_capacity(s.len() + 8);
        escape_guest_bytes(&mut out, s.as_bytes());
        std::borrow::Cow::Owned(out)
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

/// [`escape_guest_bytes`] into a new string.
pub fn escaped_guest_bytes(b: &[u8]) -> String {
    let mut out = String::with_capacity(b.len());
    escape_guest_bytes(&mut out, b);
    out
}
