//! Linux `buffer_data_page` layout and the ring-buffer event encoding.
//!
//! A data page is `{ u64 time_stamp; u64 commit; u8 data[] }` (little-endian). `commit`
//! counts the bytes of committed event data after the 16-byte header; its bits 31
//! ([`RB_MISSED_EVENTS`]) and 30 ([`RB_MISSED_STORED`]) are flags. With
//! `RB_MISSED_STORED` the number of missed events is a `u64` at `data + commit`.
//!
//! An event is a `u32` header word (`type_len:5`, `time_delta:27`) followed by
//! `array[]` words:
//! - `type_len` 1..=28: data, payload of `type_len * 4` bytes at `array[0]`;
//! - `type_len` 0: data, `array[0]` = payload length + 4, payload at `array[1]`; the event
//!   takes `array[0] + 4` bytes (the kernel's `rb_event_data_length`, not rounded up);
//! - 29: padding (delta 0: the rest of the page is empty; else `array[0] + 4` bytes, its
//!   delta ignored);
//! - 30: TIME_EXTEND, delta = `(array[0] << 27) + time_delta`;
//! - 31: TIME_STAMP, absolute time with the same split.
//!
//! Decoding here treats its input as hostile: every length is checked against the
//! slice, nothing panics.

/// Size of the page header (`time_stamp` + `commit`).
pub const PAGE_HEADER_SIZE: usize = 16;
/// Offset of `time_stamp` in a data page.
pub const TIME_STAMP_OFFSET: usize = 0;
/// Offset of `commit` in a data page.
pub const COMMIT_OFFSET: usize = 8;
/// `commit` flag: events were lost before this page.
pub const RB_MISSED_EVENTS: u64 = 1 << 31;
/// `commit` flag: the number of lost events is stored as a u64 at `data + commit`.
pub const RB_MISSED_STORED: u64 = 1 << 30;
/// Mask of the `commit` flags.
pub const RB_MISSED_FLAGS: u64 = RB_MISSED_EVENTS | RB_MISSED_STORED;
/// Mask of the committed length in `commit` (bits below the flags).
pub const COMMIT_LEN_MASK: u64 = (1 << 30) - 1;

/// Largest `type_len` of a small data event.
pub const TYPE_DATA_MAX: u32 = 28;
/// `type_len` of a padding event.
pub const TYPE_PADDING: u32 = 29;
/// `type_len` of a TIME_EXTEND event.
pub const TYPE_TIME_EXTEND: u32 = 30;
/// `type_len` of an absolute TIME_STAMP event.
pub const TYPE_TIME_STAMP: u32 = 31;
/// Largest payload stored in the small (type_len) form.
pub const MAX_SMALL_PAYLOAD: usize = TYPE_DATA_MAX as usize * 4;
/// Bits of the delta in the event header.
pub const DELTA_BITS: u32 = 27;
/// Largest delta that fits the event header.
pub const MAX_DELTA: u64 = (1 << DELTA_BITS) - 1;
/// Largest delta a TIME_EXTEND carries (59 bits).
pub const MAX_EXTENDED_DELTA: u64 = (1 << (DELTA_BITS + 32)) - 1;
/// Size of a TIME_EXTEND / TIME_STAMP event.
pub const TIME_EXTEND_SIZE: usize = 8;

/// Rounds up to the 4-byte event alignment.
#[inline]
pub const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// Total encoded size (header words + padded payload) of a data event with a payload
/// of `payload_len` bytes. Payloads of 1..=112 bytes use the small form; 0 and longer
/// ones use the `type_len == 0` form with a length word.
#[inline]
pub const fn data_event_size(payload_len: usize) -> usize {
    let p = align4(payload_len);
    if p == 0 || p > MAX_SMALL_PAYLOAD {
        8 + p
    } else {
        4 + p
    }
}

/// Header word of an event.
#[inline]
pub const fn header_word(type_len: u32, delta: u32) -> u32 {
    (type_len & 0x1f) | (delta << 5)
}

/// Writes the header words of a data event of `payload_len` bytes with time delta
/// `delta` (≤ [`MAX_DELTA`]) into `out`, returning how many bytes they take (4 or 8).
/// The payload goes right after them.
#[inline]
pub fn encode_data_header(out: &mut [u8; 8], payload_len: usize, delta: u32) -> usize {
    let p = align4(payload_len);
    if p == 0 || p > MAX_SMALL_PAYLOAD {
        out[..4].copy_from_slice(&header_word(0, delta).to_le_bytes());
        out[4..8].copy_from_slice(&((p as u32) + 4).to_le_bytes());
        8
    } else {
        out[..4].copy_from_slice(&header_word((p / 4) as u32, delta).to_le_bytes());
        4
    }
}

/// Encodes a TIME_EXTEND event carrying `delta` (≤ [`MAX_EXTENDED_DELTA`]).
#[inline]
pub const fn encode_time_extend(delta: u64) -> [u8; 8] {
    let lo = header_word(TYPE_TIME_EXTEND, (delta & MAX_DELTA) as u32).to_le_bytes();
    let hi = ((delta >> DELTA_BITS) as u32).to_le_bytes();
    [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]]
}

/// One decoded record of a data page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// A data event: its delta, and the byte range of its payload within the data area
    /// (the encoded, 4-byte padded length).
    Data {
        /// Time delta from the previous event.
        delta: u64,
        /// Start of the payload in the data area.
        start: usize,
        /// Payload length: `type_len * 4`, or `array[0] - 4` for the long form (a
        /// multiple of 4 unless the length word is not).
        len: usize,
    },
    /// A TIME_EXTEND: add `delta` to the clock.
    TimeExtend {
        /// The 59-bit delta.
        delta: u64,
    },
    /// An absolute TIME_STAMP.
    TimeStamp {
        /// The absolute timestamp (59 bits).
        ts: u64,
    },
    /// A padding event (discarded data), with its delta.
    Padding {
        /// Delta carried by the padding (readers disagree on it; we emit only 0).
        delta: u64,
    },
}

/// Why a data area could not be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// An event header or payload runs past the committed length.
    Truncated {
        /// Offset of the offending event in the data area.
        offset: usize,
    },
    /// A `type_len == 0` length word is smaller than 4.
    BadLength {
        /// Offset of the offending event in the data area.
        offset: usize,
    },
}

impl core::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Truncated { offset } => {
                write!(f, "event at data offset {offset} runs past commit")
            }
            Self::BadLength { offset } => {
                write!(f, "event at data offset {offset} has a bad length word")
            }
        }
    }
}

fn word(data: &[u8], off: usize) -> Option<u32> {
    let b = data.get(off..off.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Decodes the record at `offset` of a committed data area `data` (exactly `commit`
/// bytes long). Returns the record and the offset of the next one, or `Ok(None)` at the
/// end (the end of `data`, or padding with delta 0, which ends the page).
#[inline]
pub fn decode_record(data: &[u8], offset: usize) -> Result<Option<(Record, usize)>, DecodeError> {
    if offset >= data.len() {
        return Ok(None);
    }
    let hdr = word(data, offset).ok_or(DecodeError::Truncated { offset })?;
    let type_len = hdr & 0x1f;
    let delta = u64::from(hdr >> 5);
    let arr = offset + 4;
    let trunc = DecodeError::Truncated { offset };
    match type_len {
        TYPE_PADDING => {
            if delta == 0 {
                return Ok(None);
            }
            let len = word(data, arr).ok_or(trunc)? as usize;
            let next = arr.checked_add(len).ok_or(trunc)?;
            if next > data.len() || len < 4 {
                return Err(trunc);
            }
            Ok(Some((Record::Padding { delta }, align4(next))))
        }
        TYPE_TIME_EXTEND | TYPE_TIME_STAMP => {
            let hi = u64::from(word(data, arr).ok_or(trunc)?);
            let v = (hi << DELTA_BITS) + delta;
            let rec = if type_len == TYPE_TIME_EXTEND {
                Record::TimeExtend { delta: v }
            } else {
                Record::TimeStamp { ts: v }
            };
            Ok(Some((rec, offset + TIME_EXTEND_SIZE)))
        }
        0 => {
            // The kernel's extent (rb_event_data_length): `array[0] + 4` bytes in all, not
            // rounded up — a length word that is not a multiple of 4 puts the next record
            // at an unaligned offset, as the kernel would read it (trace-cmd rounds up).
            let len_word = word(data, arr).ok_or(trunc)? as usize;
            if len_word < 4 {
                return Err(DecodeError::BadLength { offset });
            }
            let start = arr + 4;
            let len = len_word - 4;
            let end = start.checked_add(len).ok_or(trunc)?;
            if end > data.len() {
                return Err(trunc);
            }
            Ok(Some((Record::Data { delta, start, len }, end)))
        }
        n => {
            let len = n as usize * 4;
            let end = arr + len;
            if end > data.len() {
                return Err(trunc);
            }
            Ok(Some((
                Record::Data {
                    delta,
                    start: arr,
                    len,
                },
                end,
            )))
        }
    }
}

/// Iterator over the data events of a committed data area, with absolute timestamps.
/// Stops at the first decode error, which it yields once.
#[derive(Clone, Debug)]
pub struct Events<'a> {
    data: &'a [u8],
    offset: usize,
    ts: u64,
    page_ts: u64,
    done: bool,
}

/// One data event of a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageEvent<'a> {
    /// Absolute timestamp (page time_stamp plus the deltas so far, wrapping).
    pub ts: u64,
    /// Payload, padded to its encoded length.
    pub payload: &'a [u8],
    /// Offset of the event header in the data area.
    pub offset: usize,
}

impl<'a> Events<'a> {
    /// Iterates over `data` (the committed bytes after the page header), starting from the
    /// page's `time_stamp`.
    pub fn new(data: &'a [u8], time_stamp: u64) -> Self {
        Self {
            data,
            offset: 0,
            ts: time_stamp,
            page_ts: time_stamp,
            done: false,
        }
    }

    /// Offset of the next record in the data area.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The clock after the last record decoded.
    pub fn clock(&self) -> u64 {
        self.ts
    }
}

impl<'a> Iterator for Events<'a> {
    type Item = Result<PageEvent<'a>, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        // Every record advances by at least 4 bytes, so this terminates.
        while !self.done {
            match decode_record(self.data, self.offset) {
                Ok(None) => {
                    self.done = true;
                    self.offset = self.data.len();
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
                Ok(Some((rec, next))) => {
                    let at = self.offset;
                    self.offset = next;
                    match rec {
                        Record::Data { delta, start, len } => {
                            self.ts = self.ts.wrapping_add(delta);
                            return Some(Ok(PageEvent {
                                ts: self.ts,
                                payload: &self.data[start..start + len],
                                offset: at,
                            }));
                        }
                        Record::TimeExtend { delta } => self.ts = self.ts.wrapping_add(delta),
                        Record::TimeStamp { ts } => self.ts = fix_abs_ts(ts, self.page_ts),
                        // Padding deltas are ignored (the kernel's reading); we never write them.
                        Record::Padding { .. } => {}
                    }
                }
            }
        }
        None
    }
}

/// Bits of a timestamp above the 59 a TIME_STAMP record carries.
pub const TS_MSB: u64 = !MAX_EXTENDED_DELTA;

/// The absolute time of a TIME_STAMP record carrying `abs` (59 bits) on a page whose
/// `time_stamp` is `page_ts`, as the kernel's reader computes it (`rb_fix_abs_ts`): the
/// bits above 59 come from the page time, plus one 2^59 step if that would go back.
pub const fn fix_abs_ts(abs: u64, page_ts: u64) -> u64 {
    if page_ts & TS_MSB == 0 {
        return abs;
    }
    let t = abs | (page_ts & TS_MSB);
    if t < page_ts {
        t.wrapping_add(1 << 59)
    } else {
        t
    }
}

/// Splits a data page (at least [`PAGE_HEADER_SIZE`] bytes) into `(time_stamp, commit
/// word)`. `None` if the slice is too short.
pub fn page_header(page: &[u8]) -> Option<(u64, u64)> {
    let h = page.get(..PAGE_HEADER_SIZE)?;
    let mut ts = [0u8; 8];
    let mut c = [0u8; 8];
    ts.copy_from_slice(&h[..8]);
    c.copy_from_slice(&h[8..16]);
    Some((u64::from_le_bytes(ts), u64::from_le_bytes(c)))
}
impl core::error::Error for DecodeError {}

#[cfg(test)]
mod tests {
    use super::*;
    extern crate std;
    use std::vec::Vec;

    fn hdr(type_len: u32, delta: u32) -> [u8; 4] {
        header_word(type_len, delta).to_le_bytes()
    }

    fn events(data: &[u8], ts: u64) -> Vec<(u64, Vec<u8>)> {
        Events::new(data, ts)
            .map(|e| {
                let e = e.unwrap();
                (e.ts, e.payload.to_vec())
            })
            .collect()
    }

    /// A padding record with delta 0 ends the page's data even inside `commit`: the
    /// kernel's reader (rb_iter_peek: rb_null_event → next page; rb_event_length:
    /// undefined) never reads past it. trace-cmd 3.1.6 reads on (docs/output.md).
    #[test]
    fn null_padding_ends_the_page() {
        let mut d = Vec::new();
        d.extend_from_slice(&hdr(2, 0));
        d.extend_from_slice(&[1u8; 8]);
        d.extend_from_slice(&hdr(TYPE_PADDING, 0));
        d.extend_from_slice(&8u32.to_le_bytes());
        d.extend_from_slice(&[0u8; 4]);
        d.extend_from_slice(&hdr(2, 5));
        d.extend_from_slice(&[2u8; 8]);
        assert_eq!(events(&d, 100), [(100, [1u8; 8].to_vec())]);
        assert_eq!(decode_record(&d, 12), Ok(None));
    }

    /// A padding record with a delta is a discarded event of `array[0] + 4` bytes whose
    /// delta the kernel ignores (rb_update_read_stamp); trace-cmd adds it.
    #[test]
    fn padding_delta_is_ignored() {
        let mut d = Vec::new();
        d.extend_from_slice(&hdr(2, 0));
        d.extend_from_slice(&[1u8; 8]);
        d.extend_from_slice(&hdr(TYPE_PADDING, 7));
        d.extend_from_slice(&8u32.to_le_bytes());
        d.extend_from_slice(&[0u8; 4]);
        d.extend_from_slice(&hdr(2, 5));
        d.extend_from_slice(&[2u8; 8]);
        assert_eq!(
            events(&d, 100),
            [(100, [1u8; 8].to_vec()), (105, [2u8; 8].to_vec())]
        );
    }

    /// The long form takes `array[0] + 4` bytes, the kernel's rb_event_data_length, even
    /// when `array[0]` is not a multiple of 4 (trace-cmd rounds up); the largest event
    /// fills the page.
    #[test]
    fn long_form_extent_is_the_kernels() {
        // array[0] = 4 + 6: a 6-byte payload, the next record right after it.
        let mut d = Vec::new();
        d.extend_from_slice(&hdr(0, 0));
        d.extend_from_slice(&10u32.to_le_bytes());
        d.extend_from_slice(&[7u8; 6]);
        d.extend_from_slice(&hdr(1, 3));
        d.extend_from_slice(&[9u8; 4]);
        assert_eq!(
            decode_record(&d, 0),
            Ok(Some((
                Record::Data {
                    delta: 0,
                    start: 8,
                    len: 6
                },
                14
            )))
        );
        assert_eq!(
            events(&d, 10),
            [(10, [7u8; 6].to_vec()), (13, [9u8; 4].to_vec())]
        );
        // A maximum-size event: the whole data area of a 4 KiB page.
        let mut d = Vec::new();
        d.extend_from_slice(&hdr(0, 0));
        d.extend_from_slice(&4076u32.to_le_bytes());
        d.resize(4080, 0xab);
        let e = events(&d, 1);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].1.len(), 4072);
        // One byte more runs past commit; a length word below 4 is refused.
        d[4..8].copy_from_slice(&4077u32.to_le_bytes());
        assert_eq!(
            decode_record(&d, 0),
            Err(DecodeError::Truncated { offset: 0 })
        );
        d[4..8].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(
            decode_record(&d, 0),
            Err(DecodeError::BadLength { offset: 0 })
        );
    }

    /// TIME_STAMP carries 59 bits; the bits above come from the page time_stamp
    /// (rb_fix_abs_ts).
    #[test]
    fn time_stamp_takes_the_page_msb() {
        let page_ts = (3u64 << 59) + 1000;
        let abs = 2000u64;
        let mut d = Vec::new();
        d.extend_from_slice(&hdr(TYPE_TIME_STAMP, (abs & MAX_DELTA) as u32));
        d.extend_from_slice(&((abs >> DELTA_BITS) as u32).to_le_bytes());
        d.extend_from_slice(&hdr(1, 0));
        d.extend_from_slice(&[1u8; 4]);
        assert_eq!(events(&d, page_ts)[0].0, (3u64 << 59) + 2000);
        // Smaller than the page time: the next 2^59 step.
        assert_eq!(fix_abs_ts(500, page_ts), (4u64 << 59) + 500);
        assert_eq!(fix_abs_ts(500, 1000), 500);
    }
}
