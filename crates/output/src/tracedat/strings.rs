//! Guest strings in trace.dat pages (invariant G2 of docs/design.md): trace-cmd and
//! KernelShark print `%s` of a char array or a `__data_loc char[]` string as the bytes
//! are, so a guest writing a newline, ESC or a bidirectional control into one would
//! print lines it forged. Before a page goes into a trace.dat, every byte of such a
//! string (up to its first NUL) that hyptrace's text output would escape
//! ([`crate::text::escape_guest_bytes`]: C0/C1 controls, DEL, line separators,
//! bidirectional controls, bytes that are not UTF-8) is replaced by `?`, byte for byte:
//! the record's length, layout and every other byte stay as the guest wrote them. Two
//! lies of a `__data_loc` string are undone too, in place: a string without a NUL gets
//! one as its last byte, and a location outside the record is pointed at an empty
//! string inside its own word ([`empty_data_loc`]). The changed bytes are counted
//! ([`super::TraceDatSink`] warns with the count).
//!
//! What is a string field is decided once per event type ([`StringFields::new`]); a
//! page's records are walked only when some format has one, and a record of an event
//! without one costs its decode and one indexed load ([`IdTable`]), nothing more.

use hyptrace_abi::page::{decode_record, Record, PAGE_HEADER_SIZE};

use crate::export::commit_len;
use crate::idtable::IdTable;
use hyptrace_format::must_escape;
use hyptrace_format::printfmt::FieldRef;
use hyptrace_format::EventFormat;

/// What replaces an unsafe byte.
pub const REPLACEMENT: u8 = b'?';

/// The string fields of each event id of a trace (events without one have no entry).
#[derive(Clone, Debug, Default)]
pub(crate) struct StringFields {
    by_id: IdTable<Vec<FieldRef>>,
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

    /// Makes the guest strings of the exported pages `buf` (whole pages of `page_size`)
    /// safe (G2); returns how many bytes were replaced.
    pub(crate) fn sanitize_pages(&self, buf: &mut [u8], page_size: usize) -> u64 {
        buf.chunks_exact_mut(page_size)
            .map(|p| self.sanitize_page(p))
            .sum()
    }

    /// Makes the strings of every event of the exported page `page` safe (G2); returns
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
        loop {
            // The common record first, read as `decode_record` reads it: a data event
            // whose length is in its header (type_len 1..=28, `type_len × 4` bytes of
            // payload after the 4-byte header; running past the data ends the walk).
            let head = data.get(offset..offset + 4);
            let type_len = head.map_or(0, |h| h[0] & 0x1f);
            if (1..=28).contains(&type_len) {
                let start = offset + 4;
                let end = start + usize::from(type_len) * 4;
                let Some(p) = data.get_mut(start..end) else {
                    break;
                };
                // Most records are of events without strings: one indexed load.
                if let Some(fields) = self.by_id.get(u16::from_le_bytes([p[0], p[1]])) {
                    replaced += sanitize_fields(fields, p);
                }
                offset = end;
                continue;
            }
            let Ok(Some((rec, next))) = decode_record(data, offset) else {
                break;
            };
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
        match self.by_id.get(id) {
            Some(fields) => sanitize_fields(fields, p),
            None => 0,
        }
    }
}

/// Makes the string `fields` of one record (`p`: its payload) safe; returns the bytes
/// changed.
fn sanitize_fields(fields: &[FieldRef], p: &mut [u8]) -> u64 {
    let mut replaced = 0;
    for f in fields {
        match (f.range(p), f.data_loc_word()) {
            (Some(r), loc) => {
                let s = &mut p[r];
                replaced += sanitize(s);
                // A dynamic string without its NUL: readers that print up to a NUL
                // (libtraceevent) would run on into the bytes after it.
                if loc.is_some() && !s.contains(&0) {
                    if let Some(last) = s.last_mut() {
                        *last = 0;
                        replaced += 1;
                    }
                }
            }
            (None, Some(w)) => replaced += empty_data_loc(p, w),
            (None, None) => {}
        }
    }
    replaced
}

/// Points the `__data_loc` word at `p[w..w + 4]`, whose string lies outside the record,
/// at an empty string: offset `w + 3`, length 1 — the word's own last byte, which is
/// then the length's high byte, 0. Returns the bytes changed (0 when the word itself is
/// outside the record).
fn empty_data_loc(p: &mut [u8], w: usize) -> u64 {
    let Some(word) = w.checked_add(4).and_then(|end| p.get_mut(w..end)) else {
        return 0;
    };
    let Ok(off) = u16::try_from(w + 3) else {
        return 0; // past 64 KiB: no record is that long
    };
    let new = u32::from(off) | 1 << 16;
    let old = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
    word.copy_from_slice(&new.to_le_bytes());
    let (old, new) = (old.to_le_bytes(), new.to_le_bytes());
    old.iter().zip(&new).filter(|(a, b)| a != b).count() as u64
}

/// Replaces, in the string `b` up to its first NUL, every byte that
/// [`crate::text::escape_guest_bytes`] would escape with `REPLACEMENT` (`?`); returns how
/// many.
pub fn sanitize(b: &mut [u8]) -> u64 {
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

    /// The walk finds the records `decode_record` finds, whatever the bytes: a page of
    /// random words sanitized equals the same page sanitized record by record.
    #[test]
    fn walk_matches_decode_record() {
        let sf = StringFields::new(&hyptrace_format::format::guest_formats());
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut total = 0;
        for round in 0..2000 {
            let mut page = vec![0u8; 512];
            for b in page.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Mostly small type_lens and the text event's id, so strings are met.
                *b = match x % 7 {
                    0 => 0x02,
                    1 => 0xea, // 1002 = 0x03ea
                    2 => 0x03,
                    _ => (x >> 8) as u8,
                };
            }
            let commit = 16 + (round * 37) % 480;
            page[8..16].copy_from_slice(&(commit as u64).to_le_bytes());
            let mut slow = page.clone();
            let data = &mut slow[16..16 + commit];
            let mut want = 0;
            let mut off = 0;
            while let Ok(Some((rec, next))) = decode_record(data, off) {
                off = next;
                if let Record::Data { start, len, .. } = rec {
                    if let Some(p) = data.get_mut(start..start + len) {
                        want += sf.sanitize_record(p);
                    }
                }
            }
            let got = sf.sanitize_page(&mut page);
            assert_eq!((got, &page), (want, &slow), "round {round}");
            total += got;
        }
        // Not vacuous: text events were met and made safe.
        assert!(total > 100, "{total}");
    }

    /// A record with `char tag[4]` at 8 and `__data_loc char[] msg` at 12: the string's
    /// bytes, a missing NUL and a location outside the record are all made safe.
    #[test]
    fn records_are_made_safe_in_place() {
        let fmt = EventFormat {
            system: "s".into(),
            name: "e".into(),
            id: 7,
            common_fields: hyptrace_format::format::common_fields(),
            fields: vec![
                hyptrace_format::format::Field {
                    type_name: "char[4]".into(),
                    name: "tag".into(),
                    offset: 8,
                    size: 4,
                    signed: true,
                },
                hyptrace_format::format::Field {
                    type_name: "__data_loc char[]".into(),
                    name: "msg".into(),
                    offset: 12,
                    size: 4,
                    signed: false,
                },
            ],
            print_fmt: String::new(),
        };
        let sf = StringFields::new(&[fmt]);
        let mut rec = vec![7u8, 0, 0, 0, 1, 0, 0, 0, b'a', b'\n', 0, 0];
        rec.extend_from_slice(&(16u32 | 3 << 16).to_le_bytes());
        rec.extend_from_slice(b"x\x1bz!");
        assert_eq!(sf.sanitize_record(&mut rec), 3);
        assert_eq!(&rec[8..12], b"a?\0\0");
        assert_eq!(&rec[16..], b"x?\0!");
        // Outside the record: pointed at the word's own last byte (0).
        rec[12..16].copy_from_slice(&(0xfff0u32 | 8 << 16).to_le_bytes());
        assert!(sf.sanitize_record(&mut rec) > 0);
        let w = u32::from_le_bytes([rec[12], rec[13], rec[14], rec[15]]);
        assert_eq!((w & 0xffff, w >> 16, rec[15]), (15, 1, 0));
        // Now valid and empty: nothing more to change.
        assert_eq!(sf.sanitize_record(&mut rec), 0);
    }
}
