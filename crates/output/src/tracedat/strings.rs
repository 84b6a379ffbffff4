//! Guest strings in trace.dat pages (invariant R2 of docs/design.md): trace-cmd and
//! KernelShark print `%s` of a char array or a `__data_loc char[]` string as the bytes
//! are, so a guest writing a newline, ESC or a bidirectional control into one would
//! print lines it forged. Before a page goes into a trace.dat, every byte of such a
//! string (up to its first NUL) that hyptrace's text output would escape
//! ([`crate::text::escape_guest_bytes`]: C0/C1 controls, DEL, line separators,
//! bidirectional controls, bytes that are not UTF-8) is replaced by `?`, byte for byte:
//! the record's length, layout and every other byte stay as the guest wrote them. The
//! replaced bytes are counted ([`super::TraceDatSink`] warns with the count).

use std::collections::HashMap;

use hyptrace_abi::page::{decode_record, Record, PAGE_HEADER_SIZE};

use crate::export::commit_len;
use crate::format::EventFormat;
use crate::printfmt::FieldRef;
use crate::text::must_escape;

/// What replaces an unsafe byte.
pub const REPLACEMENT: u8 = b'?';

/// The string fields of each event id of a trace.
#[derive(Clone, Debug, Default)]
pub(crate) struct StringFields {
    by_id: HashMap<u16, Vec<FieldRef>>,
}

impl StringFields {
    /// The string fields of `formats` (events without one are left out).
    pub(crate) fn new(formats: &[EventFormat]) -> Self {
        let by_id = formats
            .iter()
            .filter_map(|f| {
                let fields: Vec<FieldRef> = f
                    .fields
                    .iter()
                    .map(FieldRef::new)
                    .filter(FieldRef::is_string)
                    .collect();
                (!fields.is_empty()).then_some((f.id, fields))
            })
            .collect();
        Self { by_id }
    }

    /// Makes the strings of every event of the exported page `page` safe (R2); returns
    /// how many bytes were replaced. A page whose data does not decode is left as it is
    /// from the first bad record on (readers stop there too).
    pub(crate) fn sanitize_page(&self, page: &mut [u8]) -> u64 {
        if self.by_id.is_empty() {
            return 0;
        }
        let Some(commit) = commit_len(page) else {
            return 0;
        };
        let Some(data) = PAGE_HEADER_SIZE
            .checked_add(commit)
            .and_then(|end| page.get_mut(PAGE_HEADER_SIZE..end))
        else {
            return 0;
        };
        let mut replaced = 0u64;
        let mut offset = 0;
        // Bounded: every record advances `offset` by at least 4 bytes.
        while let Ok(Some((rec, next))) = decode_record(data, offset) {
            offset = next;
            if let Record::Data { start, len, .. } = rec {
                if let Some(p) = data.get_mut(start..start.saturating_add(len)) {
                    replaced += self.sanitize_record(p);
                }
            }
        }
        replaced
    }

    /// Makes the strings of one record (`p`: its payload, common header first) safe.
    fn sanitize_record(&self, p: &mut [u8]) -> u64 {
        let Some(id) = p.get(..2).map(|b| u16::from_le_bytes([b[0], b[1]])) else {
            return 0;
        };
        let Some(fields) = self.by_id.get(&id) else {
            return 0;
        };
        let mut replaced = 0;
        for f in fields {
            if let Some(r) = f.range(p) {
                replaced += sanitize(&mut p[r]);
            }
        }
        replaced
    }
}

/// Replaces, in the string `b` up to its first NUL, every byte that
/// [`crate::text::escape_guest_bytes`] would escape with [`REPLACEMENT`]; returns how
/// many.
pub(crate) fn sanitize(b: &mut [u8]) -> u64 {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    let b = &mut b[..end];
    if b.iter().all(|c| (0x20..0x7f).contains(c)) {
        return 0; // the common case: printable ASCII
    }
    let mut bad = Vec::new();
    let mut at = 0;
    for chunk in b.utf8_chunks() {
        for (i, c) in chunk.valid().char_indices() {
            if must_escape(c) {
                bad.push(at + i..at + i + c.len_utf8());
            }
        }
        at += chunk.valid().len();
        bad.push(at..at + chunk.invalid().len());
        at += chunk.invalid().len();
    }
    let mut n = 0;
    for r in bad {
        n += r.len() as u64;
        b[r].fill(REPLACEMENT);
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bad_utf8_are_replaced_byte_for_byte() {
        let mut s = *b"ok\n[001] forged\x1b[2J caf\xc3\xa9 \xe2\x80\xae\xff\0\n";
        let n = sanitize(&mut s);
        assert_eq!(&s, b"ok?[001] forged?[2J caf\xc3\xa9 ????\0\n");
        assert_eq!(n, 6);
        let mut plain = *b"hello";
        assert_eq!(sanitize(&mut plain), 0);
        assert_eq!(&plain, b"hello");
    }
}
