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
    ENTRY_SIZE, FIELD_SIZE, FIRST_DYNAMIC_ID, FIRST_VMM_ID, HEADER_SIZE, MAX_EVENTS, MAX_FIELDS,
    MAX_FIELDS_PER_EVENT, MAX_NAME, MAX_PRINT_FMT, MAX_RECORD, MAX_TABLE_SIZE, MAX_TYPE, NR_SLOTS,
    STATE_DONE, STATE_OFF, STATE_READY, STATE_REFUSED, STATUS_ACCEPTED, STATUS_REJECTED,
    TABLE_MAGIC, TABLE_VERSION,
};
use hyptrace_abi::SharedMem;
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
    let nr_entries = h.nr_events.min(MAX_EVENTS as u32);
    if !h.entries_off.is_multiple_of(8) || !h.fields_off.is_multiple_of(8) {
        return Err(bad(format!(
            "entries at {} or fields at {} not 8-aligned",
            h.entries_off, h.fields_off
        )));
    }
    area(
        "entries",
        h.entries_off,
        nr_entries,
        ENTRY_SIZE,
        bytes.len(),
    )?;
    area("fields", h.fields_off, h.nr_fields, FIELD_SIZE, bytes.len())?;
    area("strings", h.strings_off, h.strings_size, 1, bytes.len())?;
    let strings = &bytes[h.strings_off as usize..][..h.strings_size as usize];
    let fields: Vec<FieldEntry> = (0..h.nr_fields as usize)
        .filter_map(|i| {
            FieldEntry::read_from_prefix(&bytes[h.fields_off as usize + i * FIELD_SIZE..])
                .ok()
                .map(|(f, _)| f)
        })
        .collect();

    let mut reg = Registry {
        nr_entries,
        entries_off: h.entries_off,
        ..Registry::default()
    };
    let mut names: BTreeMap<(String, String), u32> = BTreeMap::new();
    let mut slots: BTreeMap<u32, u32> = BTreeMap::new();
    let mut ids: BTreeSet<u16> = BTreeSet::new();
    let mut want: Vec<(usize, u32)> = Vec::new();
    for i in 0..nr_entries {
        let off = h.entries_off as usize + i as usize * ENTRY_SIZE;
        let Ok((e, _)) = EventEntry::read_from_prefix(&bytes[off..]) else {
            continue; // unreachable: the area check covered it
        };
        let system = ident(strings, e.system, "system");
        let name = ident(strings, e.name, "name");
        let label = match (&system, &name) {
            (Ok(s), Ok(n)) => format!("{s}:{n}"),
            _ => "?".into(),
        };
        let checked = system.and_then(|system| {
            let name = name?;
            if RESERVED_SYSTEMS.contains(&system.as_str()) {
                return Err(format!(
                    "system {system} is reserved for the VMM's own events"
                ));
            }
            let r = check_entry(&e, strings, &fields)?;
            if let Some(&prev) = names.get(&(system.clone(), name.clone())) {
                return Err(format!(
                    "{system}:{name} is already registered by event {prev}"
                ));
            }
            if let Some(&prev) = slots.get(&e.slot) {
                return Err(format!(
                    "enable bit {} is already used by event {prev}",
                    e.slot
                ));
            }
            Ok((system, name, r))
        });
        match checked {
            Ok((system, name, (fields, print_fmt))) => {
                names.insert((system.clone(), name.clone()), i);
                slots.insert(e.slot, i);
                let requested = e.requested_id as u16;
                if requested != 0 && requested < FIRST_VMM_ID && !ids.contains(&requested) {
                    ids.insert(requested);
                    want.push((reg.events.len(), u32::from(requested)));
                } else {
                    want.push((reg.events.len(), 0));
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
                reason,
            }),
        }
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
    // Entries that asked for no id, or for one an earlier entry got: the next free id.
    let mut next = FIRST_DYNAMIC_ID;
    for (k, requested) in want {
        if requested != 0 {
            continue;
        }
        while ids.contains(&next) {
            next += 1; // at most MAX_EVENTS ids are taken: no overflow from 2000
        }
        ids.insert(next);
        reg.events[k].id = next;
    }
    Ok(reg)
}

fn string(strings: &[u8], r: StrRef, what: &str, max: usize) -> Result<String, String> {
    let len = r.len as usize;
    if len == 0 || len > max {
        return Err(format!("{what} length {len} is not in 1..={max}"));
    }
    let b = (r.off as usize)
        .checked_add(len)
        .and_then(|end| strings.get(r.off as usize..end))
        .ok_or_else(|| {
            format!(
                "{what} ({len} bytes at {}) lies outside the {}-byte string area",
                r.off,
                strings.len()
            )
        })?;
    if !b.iter().all(|c| (0x20..0x7f).contains(c)) {
        return Err(format!("{what} has bytes that are not printable ASCII"));
    }
    Ok(String::from_utf8_lossy(b).into_owned())
}

fn ident(strings: &[u8], r: StrRef, what: &str) -> Result<String, String> {
    let s = string(strings, r, what, MAX_NAME)?;
    let ok = s
        .bytes()
        .enumerate()
        .all(|(i, c)| c == b'_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()));
    if !ok {
        return Err(format!(
            "{what} {s:?} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)"
        ));
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

fn check_entry(e: &EventEntry, strings: &[u8], fields: &[FieldEntry]) -> Result<Checked, String> {
    if e.flags != 0 || e.reserved != 0 {
        return Err(format!("reserved flags {:#x} are not zero", e.flags));
    }
    if e.slot >= NR_SLOTS {
        return Err(format!(
            "enable bit {} is out of range (0..{NR_SLOTS})",
            e.slot
        ));
    }
    if e.requested_id > u32::from(u16::MAX) {
        return Err(format!(
            "requested id {} is not a 16-bit id",
            e.requested_id
        ));
    }
    let size = e.size as usize;
    if !(COMMON_HEADER_SIZE..=MAX_RECORD).contains(&size) {
        return Err(format!(
            "record size {size} is not in {COMMON_HEADER_SIZE}..={MAX_RECORD}"
        ));
    }
    let print_fmt = string(strings, e.print_fmt, "print fmt", MAX_PRINT_FMT)?;
    if !print_fmt.starts_with('"') {
        return Err("print fmt does not start with a quoted format string".into());
    }
    if e.nr_fields as usize > MAX_FIELDS_PER_EVENT {
        return Err(format!(
            "{} fields is over the limit of {MAX_FIELDS_PER_EVENT} per event",
            e.nr_fields
        ));
    }
    let range = (e.first_field as usize)
        .checked_add(e.nr_fields as usize)
        .and_then(|end| fields.get(e.first_field as usize..end))
        .ok_or_else(|| {
            format!(
                "fields {}..+{} lie outside the table's {} field entries",
                e.first_field,
                e.nr_fields,
                fields.len()
            )
        })?;
    let mut out: Vec<RegField> = Vec::with_capacity(range.len());
    for (k, f) in range.iter().enumerate() {
        let name = ident(strings, f.name, "name").map_err(|r| format!("field {k}: {r}"))?;
        let ctype = string(strings, f.ctype, "C type", MAX_TYPE)
            .map_err(|r| format!("field {k} ({name}): {r}"))?;
        if name.starts_with("common_") {
            return Err(format!(
                "field {k} ({name}): names starting with common_ are the common header's"
            ));
        }
        if let Some(prev) = out.iter().position(|o| o.name == name) {
            return Err(format!("field {k} ({name}): same name as field {prev}"));
        }
        let Some((tsize, tsigned)) = type_size(&ctype) else {
            return Err(format!("field {k} ({name}): unknown C type {ctype:?}"));
        };
        if f.size != tsize {
            return Err(format!(
                "field {k} ({name}): size {} does not match {ctype} ({tsize} bytes)",
                f.size
            ));
        }
        if f.signed > 1 || (f.signed == 1) != tsigned {
            return Err(format!(
                "field {k} ({name}): signed {} does not match {ctype} ({})",
                f.signed,
                u8::from(tsigned)
            ));
        }
        if f.reserved != 0 {
            return Err(format!("field {k} ({name}): reserved word is not zero"));
        }
        let end = u64::from(f.offset) + u64::from(f.size);
        if (f.offset as usize) < COMMON_HEADER_SIZE || end > size as u64 {
            return Err(format!(
                "field {k} ({name}): bytes {}..{end} lie outside the record's fields ({COMMON_HEADER_SIZE}..{size})",
                f.offset
            ));
        }
        if let Some((j, o)) = out.iter().enumerate().find(|(_, o)| {
            u64::from(o.offset) < end && u64::from(f.offset) < u64::from(o.offset + o.size)
        }) {
            return Err(format!(
                "field {k} ({name}): bytes {}..{end} overlap field {j} ({})",
                f.offset, o.name
            ));
        }
        out.push(RegField {
            name,
            ctype,
            offset: f.offset,
            size: f.size,
            signed: tsigned,
        });
    }
    out.sort_by_key(|f| f.offset);
    Ok((out, print_fmt))
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
