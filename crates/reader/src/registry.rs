//! Host side of event registration: reads the guest's registration table (hostile input),
//! validates every entry on its own, assigns ids and writes the answer back (layout and
//! handshake: [`hyptrace_abi::registry`], `docs/abi.md` "Event registration").
//!
//! [`parse_table`] works on a snapshot of the table's bytes (never on live guest memory,
//! so the guest cannot change an entry between its check and its use) and is not
//! KVM-specific: the `registration` fuzz target drives it directly. A bad header refuses
//! the whole table ([`TableError`]); a bad entry is rejected alone ([`Rejection`], naming
//! the entry and the reason) and the others are accepted.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use hyptrace_abi::events::COMMON_HEADER_SIZE;
use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::registry::{
    scalar_type, EventEntry, FieldEntry, StrRef, TableHeader, ACCEPTED_OFF, DATA_LOC_STR,
    ENTRY_SIZE, FIELD_SIZE, FIRST_DYNAMIC_ID, FIRST_HOST_KERNEL_ID, HEADER_SIZE, MAX_EVENTS,
    MAX_FIELDS, MAX_FIELDS_PER_EVENT, MAX_NAME, MAX_PRINT_FMT, MAX_RECORD, MAX_TABLE_SIZE,
    MAX_TYPE, NR_SLOTS, STATE_DONE, STATE_OFF, STATE_READY, STATE_REFUSED, STATUS_ACCEPTED,
    STATUS_REJECTED, TABLE_MAGIC, TABLE_VERSION,
};
use hyptrace_abi::SharedMem;
use hyptrace_format::{check_guest_format, common_fields, EventFormat, Field, GuestFormatError};
use zerocopy::FromBytes;

/// The systems of the VMM's own events (`hyptrace:trailing_lost`, `vmm:vcpu_exit`...):
/// no guest's.
pub const RESERVED_SYSTEMS: [&str; 2] = ["hyptrace", "vmm"];

/// Longest array a field may declare (elements).
pub const MAX_ARRAY_LEN: u32 = 4096;

/// One field of an accepted event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegField {
    /// Field name.
    pub name: String,
    /// C type as a `format` file writes it (`u64`, `char[16]`, `__data_loc char[]`).
    pub ctype: String,
    /// Offset in the record.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
    /// Signedness.
    pub signed: bool,
}

/// An accepted event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Its index in the table.
    pub index: u32,
    /// System.
    pub system: String,
    /// Name.
    pub name: String,
    /// Fields in offset order.
    pub fields: Vec<RegField>,
    /// Print format (after `print fmt: `).
    pub print_fmt: String,
    /// Fixed record size, common header included.
    pub size: u32,
    /// Enable bit.
    pub slot: u32,
    /// Assigned id.
    pub id: u16,
}

impl Registration {
    /// `system:name`.
    pub fn full_name(&self) -> String {
        format!("{}:{}", self.system, self.name)
    }
}

/// A rejected entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// Its index in the table.
    pub index: u32,
    /// `system:name` when those strings were readable, else `?`.
    pub label: String,
    /// Why.
    pub reason: String,
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "event {} ({}) rejected: {}",
            self.index, self.label, self.reason
        )
    }
}

/// The outcome of a table: accepted events (in table order) and rejections.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registry {
    /// Accepted events.
    pub events: Vec<Registration>,
    /// Rejected entries, one each (entries past [`MAX_EVENTS`] share one rejection).
    pub rejected: Vec<Rejection>,
    /// Entries the table declared, up to [`MAX_EVENTS`] (the ones answered).
    pub nr_entries: u32,
    /// Where the entries are (from the table start), as the snapshot said.
    pub entries_off: u32,
}

impl Registry {
    /// The accepted event named `system:name`.
    pub fn by_name(&self, system: &str, name: &str) -> Option<&Registration> {
        self.events
            .iter()
            .find(|e| e.system == system && e.name == name)
    }

    /// Result word of entry `index` (what the guest reads back).
    pub fn result_word(&self, index: u32) -> u64 {
        match self.events.iter().find(|e| e.index == index) {
            Some(e) => EventEntry::result_word(e.id, STATUS_ACCEPTED),
            None => EventEntry::result_word(0, STATUS_REJECTED),
        }
    }
}

/// Why a whole table was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// The guest did not mark the table ready.
    #[error("the event registration table is not ready (state {0})")]
    NotReady(u64),
    /// The header is unusable.
    #[error("the event registration table's header is invalid: {0}")]
    BadHeader(String),
}

fn bad(s: impl Into<String>) -> TableError {
    TableError::BadHeader(s.into())
}

/// Checks that `[off, off + count * size)` lies inside a table of `len` bytes.
fn area(name: &str, off: u32, count: u32, size: usize, len: usize) -> Result<(), TableError> {
    let end = u64::from(count)
        .checked_mul(size as u64)
        .and_then(|b| b.checked_add(u64::from(off)));
    match end {
        Some(e) if e <= len as u64 && u64::from(off) >= HEADER_SIZE as u64 => Ok(()),
        _ => Err(bad(format!(
            "{name} ({count} x {size} bytes at {off}) do not lie inside the {len}-byte table after its header"
        ))),
    }
}

/// Parses and validates a snapshot of the table (`bytes`: the whole table as the guest
/// left it, state READY). Bounded: at most [`MAX_EVENTS`] entries and [`MAX_FIELDS`]
/// fields are looked at, every string is at most [`MAX_PRINT_FMT`] bytes.
pub fn parse_table(bytes: &[u8]) -> Result<Registry, TableError> {
    let h = check_header(bytes)?;
    let nr_entries = h.nr_events.min(MAX_EVENTS as u32);
    check_areas(&h, nr_entries, bytes.len())?;
    let strings = &bytes[h.strings_off as usize..][..h.strings_size as usize];
    let fields: Vec<FieldEntry> = (0..h.nr_fields as usize)
        .filter_map(|i| {
            FieldEntry::read_from_prefix(&bytes[h.fields_off as usize + i * FIELD_SIZE..])
                .ok()
                .map(|(f, _)| f)
        })
        .collect();

    let mut t = Taken::default();
    let mut reg = Registry {
        nr_entries,
        entries_off: h.entries_off,
        ..Registry::default()
    };
    for i in 0..nr_entries {
        let off = h.entries_off as usize + i as usize * ENTRY_SIZE;
        let Ok((e, _)) = EventEntry::read_from_prefix(&bytes[off..]) else {
            continue; // unreachable: the area check covered it
        };
        t.entry(&mut reg, i, &e, strings, &fields);
    }
    if h.nr_events > nr_entries {
        reg.rejected.push(Rejection {
            index: nr_entries,
            label: "?".into(),
            reason: format!(
                "this entry and the {} after it: more than {MAX_EVENTS} events",
                h.nr_events - nr_entries - 1
            ),
        });
    }
    t.assign_dynamic_ids(&mut reg);
    Ok(reg)
}

/// The header of a table, checked: size limit, magic, state, version and sizes, field
/// count.
fn check_header(bytes: &[u8]) -> Result<TableHeader, TableError> {
    if bytes.len() > MAX_TABLE_SIZE {
        return Err(bad(format!(
            "{} bytes is over the {MAX_TABLE_SIZE}-byte limit",
            bytes.len()
        )));
    }
    let Ok((h, _)) = TableHeader::read_from_prefix(bytes) else {
        return Err(bad(format!(
            "{} bytes is shorter than the header",
            bytes.len()
        )));
    };
    if h.magic != TABLE_MAGIC {
        return Err(bad(format!("bad magic {:#x}", h.magic)));
    }
    if h.state != STATE_READY {
        return Err(TableError::NotReady(h.state));
    }
    if h.version != TABLE_VERSION
        || h.header_size as usize != HEADER_SIZE
        || h.entry_size as usize != ENTRY_SIZE
        || h.field_size as usize != FIELD_SIZE
    {
        return Err(bad(format!(
            "version {} with header/entry/field sizes {}/{}/{} (expected {TABLE_VERSION} with {HEADER_SIZE}/{ENTRY_SIZE}/{FIELD_SIZE})",
            h.version, h.header_size, h.entry_size, h.field_size
        )));
    }
    if h.nr_fields as usize > MAX_FIELDS {
        return Err(bad(format!(
            "{} fields is over the limit of {MAX_FIELDS}",
            h.nr_fields
        )));
    }
    Ok(h)
}

/// The entries (the first `nr_entries`), fields and strings of header `h` lie 8-aligned
/// inside the `len`-byte table, after its header: every later slice of them is in bounds.
fn check_areas(h: &TableHeader, nr_entries: u32, len: usize) -> Result<(), TableError> {
    if !h.entries_off.is_multiple_of(8) || !h.fields_off.is_multiple_of(8) {
        return Err(bad(format!(
            "entries at {} or fields at {} not 8-aligned",
            h.entries_off, h.fields_off
        )));
    }
    area("entries", h.entries_off, nr_entries, ENTRY_SIZE, len)?;
    area("fields", h.fields_off, h.nr_fields, FIELD_SIZE, len)?;
    area("strings", h.strings_off, h.strings_size, 1, len)
}

/// What the entries accepted so far hold: their names, enable bits and requested ids,
/// and which accepted events still need an id.
#[derive(Default)]
struct Taken {
    names: BTreeMap<(String, String), u32>,
    slots: BTreeMap<u32, u32>,
    ids: BTreeSet<u16>,
    /// Per accepted event (index in `Registry::events`): the id it asked for and got, or
    /// 0 when it gets the next free one.
    want: Vec<(usize, u32)>,
}

impl Taken {
    /// Checks entry `i` on its own and against the accepted ones; accepts it into `reg`
    /// or records its rejection.
    fn entry(
        &mut self,
        reg: &mut Registry,
        i: u32,
        e: &EventEntry,
        strings: &[u8],
        fields: &[FieldEntry],
    ) {
        let system = ident(strings, e.system, "system");
        let name = ident(strings, e.name, "name");
        let label = match (&system, &name) {
            (Ok(s), Ok(n)) => format!("{s}:{n}"),
            _ => "?".into(),
        };
        let checked = system
            .map_err(EntryError::from)
            .and_then(|system| self.check(e, system, name?, strings, fields));
        match checked {
            Ok((system, name, (fields, print_fmt))) => {
                self.names.insert((system.clone(), name.clone()), i);
                self.slots.insert(e.slot, i);
                let requested = e.requested_id as u16;
                if requested != 0
                    && requested < FIRST_HOST_KERNEL_ID
                    && !self.ids.contains(&requested)
                {
                    self.ids.insert(requested);
                    self.want.push((reg.events.len(), u32::from(requested)));
                } else {
                    self.want.push((reg.events.len(), 0));
                }
                reg.events.push(Registration {
                    index: i,
                    system,
                    name,
                    fields,
                    print_fmt,
                    size: e.size,
                    slot: e.slot,
                    id: requested,
                });
            }
            Err(reason) => reg.rejected.push(Rejection {
                index: i,
                label,
                reason: reason.to_string(),
            }),
        }
    }

    /// An entry whose system and name are identifiers: not reserved, valid on its own
    /// ([`check_entry`]), its name and enable bit not taken by an accepted entry.
    fn check(
        &self,
        e: &EventEntry,
        system: String,
        name: String,
        strings: &[u8],
        fields: &[FieldEntry],
    ) -> Result<(String, String, Checked), EntryError> {
        if RESERVED_SYSTEMS.contains(&system.as_str()) {
            return Err(EntryError::ReservedSystem(system));
        }
        let r = check_entry(e, strings, fields)?;
        if let Some(&prev) = self.names.get(&(system.clone(), name.clone())) {
            return Err(EntryError::NameTaken { system, name, prev });
        }
        if let Some(&prev) = self.slots.get(&e.slot) {
            return Err(EntryError::SlotTaken { slot: e.slot, prev });
        }
        Ok((system, name, r))
    }

    /// Entries that asked for no id, or for one an earlier entry got: the next free id.
    fn assign_dynamic_ids(&mut self, reg: &mut Registry) {
        let mut next = FIRST_DYNAMIC_ID;
        for &(k, requested) in &self.want {
            if requested != 0 {
                continue;
            }
            while self.ids.contains(&next) {
                next += 1; // at most MAX_EVENTS ids are taken: no overflow from 2000
            }
            self.ids.insert(next);
            reg.events[k].id = next;
        }
    }
}

/// Why a string of the table (a name, a C type, a print fmt) is unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum StrError {
    #[error("{what} length {len} is not in 1..={max}")]
    Length {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{what} ({len} bytes at {off}) lies outside the {area}-byte string area")]
    Outside {
        what: &'static str,
        len: usize,
        off: u32,
        area: usize,
    },
    #[error("{what} has bytes that are not printable ASCII")]
    NotPrintable { what: &'static str },
    #[error("{what} {text:?} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)")]
    NotIdentifier { what: &'static str, text: String },
}

/// Why one entry is rejected (its [`Rejection::reason`] is this error's text).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum EntryError {
    #[error(transparent)]
    Str(#[from] StrError),
    #[error("system {0} is reserved for the VMM's own events")]
    ReservedSystem(String),
    #[error("{system}:{name} is already registered by event {prev}")]
    NameTaken {
        system: String,
        name: String,
        prev: u32,
    },
    #[error("enable bit {slot} is already used by event {prev}")]
    SlotTaken { slot: u32, prev: u32 },
    #[error("reserved flags {0:#x} are not zero")]
    ReservedFlags(u32),
    #[error("enable bit {0} is out of range (0..{NR_SLOTS})")]
    SlotRange(u32),
    #[error("requested id {0} is not a 16-bit id")]
    RequestedId(u32),
    #[error("record size {0} is not in {COMMON_HEADER_SIZE}..={MAX_RECORD}")]
    RecordSize(usize),
    #[error("print fmt does not start with a quoted format string")]
    PrintFmtUnquoted,
    /// The print fmt is outside the subset every reader evaluates safely (G1).
    #[error(transparent)]
    PrintFmt(#[from] GuestFormatError),
    #[error("{0} fields is over the limit of {MAX_FIELDS_PER_EVENT} per event")]
    TooManyFields(u32),
    #[error("fields {first}..+{count} lie outside the table's {total} field entries")]
    FieldsOutside {
        first: u32,
        count: u32,
        total: usize,
    },
    /// A field's name is unusable (the problem is printed, not kept as a source: it is
    /// part of this text).
    #[error("field {index}: {problem}")]
    FieldName { index: usize, problem: StrError },
    #[error("field {index} ({name}): {problem}")]
    Field {
        index: usize,
        name: String,
        problem: FieldProblem,
    },
}

/// What is wrong with a field whose name is an identifier.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum FieldProblem {
    #[error("{0}")]
    CType(StrError),
    #[error("names starting with common_ are the common header's")]
    CommonName,
    #[error("same name as field {0}")]
    SameName(usize),
    #[error("unknown C type {0:?}")]
    UnknownType(String),
    #[error("size {size} does not match {ctype} ({want} bytes)")]
    Size { size: u32, ctype: String, want: u32 },
    #[error("signed {signed} does not match {ctype} ({want})")]
    Signed {
        signed: u32,
        ctype: String,
        want: u8,
    },
    #[error("reserved word is not zero")]
    Reserved,
    #[error("bytes {from}..{end} lie outside the record's fields ({COMMON_HEADER_SIZE}..{size})")]
    OutsideRecord { from: u32, end: u64, size: usize },
    #[error("bytes {from}..{end} overlap field {other} ({other_name})")]
    Overlap {
        from: u32,
        end: u64,
        other: usize,
        other_name: String,
    },
}

fn string(strings: &[u8], r: StrRef, what: &'static str, max: usize) -> Result<String, StrError> {
    let len = r.len as usize;
    if len == 0 || len > max {
        return Err(StrError::Length { what, len, max });
    }
    let b = (r.off as usize)
        .checked_add(len)
        .and_then(|end| strings.get(r.off as usize..end))
        .ok_or(StrError::Outside {
            what,
            len,
            off: r.off,
            area: strings.len(),
        })?;
    if !b.iter().all(|c| (0x20..0x7f).contains(c)) {
        return Err(StrError::NotPrintable { what });
    }
    Ok(String::from_utf8_lossy(b).into_owned())
}

fn ident(strings: &[u8], r: StrRef, what: &'static str) -> Result<String, StrError> {
    let s = string(strings, r, what, MAX_NAME)?;
    let ok = s
        .bytes()
        .enumerate()
        .all(|(i, c)| c == b'_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()));
    if !ok {
        return Err(StrError::NotIdentifier { what, text: s });
    }
    Ok(s)
}

/// Size and signedness a field's C type requires.
fn type_size(ctype: &str) -> Option<(u32, bool)> {
    if ctype == DATA_LOC_STR {
        return Some((4, false));
    }
    if let Some(open) = ctype.strip_suffix(']').and_then(|t| t.find('[')) {
        let elem = &ctype[..open];
        let n: u32 = ctype[open + 1..ctype.len() - 1].parse().ok()?;
        if !(1..=MAX_ARRAY_LEN).contains(&n) || ctype[open + 1..].starts_with('0') {
            return None;
        }
        let (s, signed) = scalar_type(elem)?;
        return Some((s * n, signed));
    }
    scalar_type(ctype)
}

type Checked = (Vec<RegField>, String);

fn check_entry(
    e: &EventEntry,
    strings: &[u8],
    fields: &[FieldEntry],
) -> Result<Checked, EntryError> {
    if e.flags != 0 || e.reserved != 0 {
        return Err(EntryError::ReservedFlags(e.flags));
    }
    if e.slot >= NR_SLOTS {
        return Err(EntryError::SlotRange(e.slot));
    }
    if e.requested_id > u32::from(u16::MAX) {
        return Err(EntryError::RequestedId(e.requested_id));
    }
    let size = e.size as usize;
    if !(COMMON_HEADER_SIZE..=MAX_RECORD).contains(&size) {
        return Err(EntryError::RecordSize(size));
    }
    let print_fmt = string(strings, e.print_fmt, "print fmt", MAX_PRINT_FMT)?;
    if !print_fmt.starts_with('"') {
        return Err(EntryError::PrintFmtUnquoted);
    }
    if e.nr_fields as usize > MAX_FIELDS_PER_EVENT {
        return Err(EntryError::TooManyFields(e.nr_fields));
    }
    let range = (e.first_field as usize)
        .checked_add(e.nr_fields as usize)
        .and_then(|end| fields.get(e.first_field as usize..end))
        .ok_or(EntryError::FieldsOutside {
            first: e.first_field,
            count: e.nr_fields,
            total: fields.len(),
        })?;
    let mut out: Vec<RegField> = Vec::with_capacity(range.len());
    for (k, f) in range.iter().enumerate() {
        let name = ident(strings, f.name, "name")
            .map_err(|problem| EntryError::FieldName { index: k, problem })?;
        let field =
            check_field(f, &name, strings, &out, size).map_err(|problem| EntryError::Field {
                index: k,
                name: name.clone(),
                problem,
            })?;
        out.push(field);
    }
    out.sort_by_key(|f| f.offset);
    check_guest_format(&event_format(("", "", 0), &out, &print_fmt))?;
    Ok((out, print_fmt))
}

/// The trace-event format of a registration: `system:name` with id `id`, the common
/// fields, `fields` and `print_fmt`. The one conversion: the entry check
/// ([`check_guest_format`], G1: the guest's print fmt is in the subset trace-cmd
/// evaluates safely) and every output's formats (`hyptrace_embed::to_format`) use it.
pub fn event_format(
    (system, name, id): (&str, &str, u16),
    fields: &[RegField],
    print_fmt: &str,
) -> EventFormat {
    EventFormat {
        system: system.to_string(),
        name: name.to_string(),
        id,
        common_fields: common_fields(),
        fields: fields
            .iter()
            .map(|f| Field {
                type_name: f.ctype.clone(),
                name: f.name.clone(),
                offset: f.offset as usize,
                size: f.size as usize,
                signed: f.signed,
            })
            .collect(),
        print_fmt: print_fmt.to_string(),
    }
}

/// Field `f` named `name` (an identifier) of a record of `size` bytes, against the
/// fields before it (`prev`, in table order).
fn check_field(
    f: &FieldEntry,
    name: &str,
    strings: &[u8],
    prev: &[RegField],
    size: usize,
) -> Result<RegField, FieldProblem> {
    let ctype = string(strings, f.ctype, "C type", MAX_TYPE).map_err(FieldProblem::CType)?;
    if name.starts_with("common_") {
        return Err(FieldProblem::CommonName);
    }
    if let Some(other) = prev.iter().position(|o| o.name == name) {
        return Err(FieldProblem::SameName(other));
    }
    let Some((tsize, tsigned)) = type_size(&ctype) else {
        return Err(FieldProblem::UnknownType(ctype));
    };
    if f.size != tsize {
        return Err(FieldProblem::Size {
            size: f.size,
            ctype,
            want: tsize,
        });
    }
    if f.signed > 1 || (f.signed == 1) != tsigned {
        return Err(FieldProblem::Signed {
            signed: f.signed,
            ctype,
            want: u8::from(tsigned),
        });
    }
    if f.reserved != 0 {
        return Err(FieldProblem::Reserved);
    }
    let end = u64::from(f.offset) + u64::from(f.size);
    if (f.offset as usize) < COMMON_HEADER_SIZE || end > size as u64 {
        return Err(FieldProblem::OutsideRecord {
            from: f.offset,
            end,
            size,
        });
    }
    if let Some((j, o)) = prev.iter().enumerate().find(|(_, o)| {
        u64::from(o.offset) < end && u64::from(f.offset) < u64::from(o.offset + o.size)
    }) {
        return Err(FieldProblem::Overlap {
            from: f.offset,
            end,
            other: j,
            other_name: o.name.clone(),
        });
    }
    Ok(RegField {
        name: name.to_string(),
        ctype,
        offset: f.offset,
        size: f.size,
        signed: tsigned,
    })
}

/// Reads the table of the region described by `l` from `mem` (one snapshot) and parses
/// it. `Ok(None)` if the pack has no table.
pub fn read_table<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
) -> Result<Option<Registry>, TableError> {
    if l.events_size == 0 {
        return Ok(None);
    }
    // Acquire: paired with the guest's Release store of READY in
    // hyptrace_writer::events::write_table: the snapshot below sees the whole table.
    let state = mem.load(l.events_off + STATE_OFF, Acquire);
    if state != STATE_READY {
        return Err(TableError::NotReady(state));
    }
    let mut bytes = vec![0u8; l.events_size.min(MAX_TABLE_SIZE)];
    mem.read_bytes(l.events_off, &mut bytes);
    parse_table(&bytes).map(Some)
}

/// Writes the answer for `reg` into the table (each entry's result, `accepted`) and
/// marks it DONE (Release, last). Enable bits are the caller's, set before this.
pub fn answer<M: SharedMem + ?Sized>(mem: &M, l: &RingGeometry, reg: &Registry) {
    if l.events_size == 0 {
        return;
    }
    let base = l.events_off;
    // Where the snapshot said the entries are (parse_table checked they fit the table);
    // live memory may have changed since, so each store is bounded again.
    let entries_off = reg.entries_off as usize;
    for i in 0..reg.nr_entries {
        let off = entries_off + i as usize * ENTRY_SIZE + EventEntry::RESULT_OFF;
        if off.is_multiple_of(8) && off + 8 <= l.events_size {
            mem.store(base + off, reg.result_word(i), Relaxed);
        }
    }
    // accepted (u32 at 56) shares its word with the reserved u32 at 60 (zero).
    mem.store(base + ACCEPTED_OFF, reg.events.len() as u64, Relaxed);
    // Release: paired with the guest's Acquire load of the state in read_answer.
    mem.store(base + STATE_OFF, STATE_DONE, Release);
}

/// Marks the table REFUSED (Release): the header was unusable, nothing is accepted.
pub fn refuse<M: SharedMem + ?Sized>(mem: &M, l: &RingGeometry) {
    if l.events_size != 0 {
        // Release: paired with the guest's Acquire load of the state (read_answer,
        // wait_registered); nothing else was written.
        mem.store(l.events_off + STATE_OFF, STATE_REFUSED, Release);
    }
}

#[cfg(test)]
#[path = "registry_tests.rs"]
mod tests;
