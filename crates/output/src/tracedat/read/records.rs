//! A CPU's records, page by page, as the kernel and trace-cmd read them.

use hyptrace_abi::page::{
    decode_record, fix_abs_ts, page_header, DecodeError, Record, PAGE_HEADER_SIZE,
    RB_MISSED_EVENTS, RB_MISSED_STORED,
};

use crate::clock::TscConversion;
use crate::export::Missed;
use crate::DatError;

use super::pages::CpuPages;
use super::{CpuBuffer, TraceFile};

/// trace-cmd masks `commit` with 27 bits when reading.
pub(super) const READ_COMMIT_MASK: u64 = (1 << 27) - 1;

/// One event read from a trace.dat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceRecord<'a> {
    /// CPU.
    pub cpu: u32,
    /// Buffer: 0 the top level, `i + 1` the file's instance `i`
    /// ([`super::TraceFile::instance_name`]).
    pub instance: u16,
    /// Raw timestamp from the page.
    pub ts_raw: u64,
    /// Timestamp in ns (as trace-cmd prints it).
    pub ts_ns: u64,
    /// Event payload (common header + fields, padded to 4 bytes).
    pub payload: &'a [u8],
}

/// What [`super::Records::next_item`] yields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceItem<'a> {
    /// An event.
    Event(TraceRecord<'a>),
    /// Events lost on `cpu` before the next event of that CPU.
    Dropped {
        /// CPU.
        cpu: u32,
        /// Buffer, as [`TraceRecord::instance`].
        instance: u16,
        /// How many.
        missed: Missed,
    },
    /// A page that could not be decoded (rest of it skipped).
    BadPage {
        /// CPU.
        cpu: u32,
        /// Buffer, as [`TraceRecord::instance`].
        instance: u16,
        /// Page index within the CPU's data.
        page: usize,
        /// Why.
        error: String,
    },
}

/// Why a page read from a trace.dat does not decode as [`super::Records`] reads it (commit
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
    let (data, commit) = (&page[PAGE_HEADER_SIZE..], end - PAGE_HEADER_SIZE);
    let mut off = 0;
    // Bounded: each record decoded consumes at least 4 bytes of the page.
    loop {
        if let Some(next) = short_data_record(data, commit, off) {
            off = next;
            continue;
        }
        match decode_like_kbuffer(data, commit, off) {
            Ok(None) => return None,
            Ok(Some((_, next))) => off = next,
            Err(e) => return Some(e.to_string()),
        }
    }
}

/// Where the record after the one at `off` starts when that one is the common record,
/// decoded as [`decode_like_kbuffer`] decodes it: an aligned data event whose length is
/// in its header (type_len 1..=28: `type_len × 4` bytes of payload after the 4-byte
/// header) that ends within the `commit` bytes of `data`; `None` for any other record
/// (left to [`decode_like_kbuffer`]).
fn short_data_record(data: &[u8], commit: usize, off: usize) -> Option<usize> {
    let type_len = data.get(..commit)?.get(off)? & 0x1f;
    let next = off + 4 + usize::from(type_len) * 4;
    ((1..=28).contains(&type_len) && off.is_multiple_of(4) && next <= commit).then_some(next)
}

/// `page` with its `commit` word as a trace.dat reader takes it: the length in trace-cmd's
/// 27 bits, cut to the page, the two loss flags kept (bits 27-29 cleared). A copy only
/// where that differs from the page: the page `convert` writes for a damaged one, so
/// that the output's own checks take it and its reader reads what `report` read in the
/// input (where the length ran past the page, both read to the page's end; a stored
/// loss count that no longer fits reads as an unknown count, as it did).
pub fn page_as_read(page: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    use hyptrace_abi::page::{COMMIT_OFFSET, RB_MISSED_FLAGS};
    let Some((_, commit)) = page_header(page) else {
        return page.into();
    };
    let room = (page.len() - PAGE_HEADER_SIZE) as u64;
    let word = (commit & READ_COMMIT_MASK).min(room) | (commit & RB_MISSED_FLAGS);
    if word == commit {
        return page.into();
    }
    let mut out = page.to_vec();
    out[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&word.to_le_bytes());
    out.into()
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
pub(super) fn kbuffer_record(data: &[u8], commit: usize, off: usize) -> Option<(Record, usize)> {
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
pub(super) fn decode_like_kbuffer(
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
pub(super) enum Slot {
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

pub(super) struct CpuCursor {
    pub(super) cpu: u32,
    /// Its buffer ([`TraceRecord::instance`]).
    pub(super) instance: u16,
    pub(super) pages: CpuPages,
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
    /// A cursor over the pages of `b` (one of `readers` CPUs with data) of `f`'s buffer
    /// `instance`.
    pub(super) fn new(f: &TraceFile, b: &CpuBuffer, instance: u16, readers: usize) -> Self {
        Self {
            cpu: b.cpu,
            instance,
            pages: CpuPages::new(f, b, readers),
            tsc: f.tsc2nsec,
            ts_offset: f.ts_offset,
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
        }
    }

    fn ns(&self, raw: u64) -> u64 {
        let ns = match &self.tsc {
            Some(t) => t.trace_cmd_ns(raw),
            None => raw,
        };
        ns.wrapping_add_signed(self.ts_offset)
    }

    /// Pushes the next unit to `q` (drop marker + event, or a bad page; reversed: pop
    /// from the end). Returns its sort key, or None when the CPU is done.
    pub(super) fn fill(&mut self, q: &mut Vec<Slot>) -> Result<Option<u64>, DatError> {
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
        let data = &self.pages.page()[PAGE_HEADER_SIZE..];
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
        let data = &self.pages.page()[PAGE_HEADER_SIZE..];
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
pub(super) fn first_visit(bits: &mut [u64], off: usize) -> bool {
    let (w, b) = (off / 64, 1u64 << (off % 64));
    let first = bits[w] & b == 0;
    bits[w] |= b;
    first
}
