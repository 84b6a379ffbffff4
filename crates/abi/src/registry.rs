//! The event-registration table: how a guest describes the events it can emit (system,
//! name, fields, print format, enable bit) so that the host can assign their ids, write
//! their `format` files and flip their enable bits. Byte layout in `docs/abi.md`
//! ("Event registration"); the structs below are that layout (compile-time checks pin
//! every offset).
//!
//! ```text
//!  table (pack events_off, events_size bytes; 64-aligned, inside the trace region)
//!  +---------------------------+ 0
//!  | TableHeader (64 bytes)    |  magic, state word, version, sizes, counts, offsets
//!  +---------------------------+ entries_off
//!  | nr_events x EventEntry    |  64 bytes each: strings, fields, size, slot, result
//!  +---------------------------+ fields_off
//!  | nr_fields x FieldEntry    |  32 bytes each: name, C type, offset, size, signed
//!  +---------------------------+ strings_off
//!  | string area (strings_size)|  bytes referenced by (offset, len) pairs
//!  +---------------------------+
//! ```
//!
//! Handshake: the host reserves the table (zeroed) and puts its offset and size in the
//! pack. The guest (one vCPU) writes header, entries, fields and strings, then stores
//! [`STATE_READY`] into the header's state word with Release, then writes anything to
//! [`PORT_REGISTER`] (one port exit, once per run). The host, on that exit, loads the state
//! with Acquire, copies the table, validates every entry on its own (hostile input), writes
//! each entry's [`EventEntry::result`] (assigned id and status) and the header's
//! `accepted` count, sets the enable bits it wants, and stores [`STATE_DONE`] (Release)
//! before resuming the vCPU ([`STATE_REFUSED`] if the header itself is unusable). Other
//! vCPUs wait for a final state (Acquire) before their first event. No event is written
//! before the host answered, so the enable bits the host sets apply to every event.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Port the guest writes to (any value, 32-bit `out`) once its table is [`STATE_READY`].
pub const PORT_REGISTER: u16 = 0x0512;

/// Magic of the table header: `"HTEVTAB1"`.
pub const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"HTEVTAB1");
/// Version of the table layout.
pub const TABLE_VERSION: u32 = 1;
/// Size of [`TableHeader`].
pub const HEADER_SIZE: usize = 64;
/// Size of one [`EventEntry`].
pub const ENTRY_SIZE: usize = 64;
/// Size of one [`FieldEntry`].
pub const FIELD_SIZE: usize = 32;
/// Size of the table the host reserves by default.
pub const DEFAULT_TABLE_SIZE: usize = 64 * 1024;
/// Largest table a pack may declare.
pub const MAX_TABLE_SIZE: usize = 1 << 20;
/// Most events a table registers (one enable bit each in the 64-bit enable word).
pub const MAX_EVENTS: usize = 64;
/// Most fields of one event (common header not counted).
pub const MAX_FIELDS_PER_EVENT: usize = 32;
/// Most fields of the whole table.
pub const MAX_FIELDS: usize = 1024;
/// Longest system, event or field name (bytes; `[A-Za-z_][A-Za-z0-9_]*`).
pub const MAX_NAME: usize = 63;
/// Longest C type string.
pub const MAX_TYPE: usize = 63;
/// Longest print format (bytes, printable ASCII).
pub const MAX_PRINT_FMT: usize = 1024;
/// Largest fixed record size (common header included); `__data_loc` offsets are 16 bits.
pub const MAX_RECORD: usize = 4096;
/// Number of enable bits (slots) in a control block's enable word.
pub const NR_SLOTS: u32 = 64;
/// First id the host assigns to an event that requested none (or a taken one).
pub const FIRST_DYNAMIC_ID: u16 = 2000;
/// Largest event id in a trace hyptrace writes (invariant H3, docs/design.md): every id
/// stays below 0x8000, because KernelShark (2.2) keeps event ids in a signed 16-bit field
/// — an event of id ≥ 0x8000 shows as a row without name and fields (issue 40). Guest ids
/// are below [`FIRST_HOST_KERNEL_ID`], then come the host kernel's and the VMM's.
pub const MAX_EVENT_ID: u16 = 0x7fff;
/// Ids from here up to [`MAX_EVENT_ID`] belong to the VMM's own events
/// (`--host-events`): a guest that requests one gets an assigned id instead.
pub const FIRST_VMM_ID: u16 = 0x7f00;
/// Ids from here up to [`FIRST_VMM_ID`] are the host kernel's events (`--host-trace`,
/// renumbered by the host): a guest that requests one — or any id from here up — gets
/// an assigned id instead.
pub const FIRST_HOST_KERNEL_ID: u16 = 0x7e00;
/// Where hyptrace put the host kernel's events before issue 40 (0xfe00..0xff00, the VMM's
/// from 0xff00): traces written then are still read as such ([`is_host_kernel_id`]).
pub const LEGACY_HOST_KERNEL_IDS: core::ops::Range<u16> = 0xfe00..0xff00;

/// Whether `id` is a host kernel event's (`--host-trace`): in
/// [`FIRST_HOST_KERNEL_ID`]..[`FIRST_VMM_ID`], or in [`LEGACY_HOST_KERNEL_IDS`] (a trace
/// written before issue 40; no guest event ever had such an id).
pub const fn is_host_kernel_id(id: u16) -> bool {
    (id >= FIRST_HOST_KERNEL_ID && id < FIRST_VMM_ID)
        || (id >= LEGACY_HOST_KERNEL_IDS.start && id < LEGACY_HOST_KERNEL_IDS.end)
}

/// State word: the table is not written yet (what the host reserved: zeros).
pub const STATE_EMPTY: u64 = 0;
/// State word (guest, Release, last): the table is complete.
pub const STATE_READY: u64 = 1;
/// State word (host, Release, last): entries' results and enable bits are final.
pub const STATE_DONE: u64 = 2;
/// State word (host): the header is unusable, no entry was looked at.
pub const STATE_REFUSED: u64 = 3;

/// Entry status (high 32 bits of [`EventEntry::result`]): not answered yet.
pub const STATUS_PENDING: u32 = 0;
/// Entry status: accepted; the low 16 bits of the result are its id.
pub const STATUS_ACCEPTED: u32 = 1;
/// Entry status: rejected (the host's log says why, naming the entry).
pub const STATUS_REJECTED: u32 = 2;

/// A string in the table: `len` bytes at `off` from the start of the string area (no
/// terminating NUL needed).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct StrRef {
    /// Offset from the string area's start.
    pub off: u32,
    /// Length in bytes.
    pub len: u32,
}

/// The table header (64 bytes at the table's start).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct TableHeader {
    /// [`TABLE_MAGIC`].
    pub magic: u64,
    /// `STATE_*`, accessed atomically: the guest stores READY last (Release), the host
    /// DONE/REFUSED last (Release).
    pub state: u64,
    /// [`TABLE_VERSION`].
    pub version: u32,
    /// [`HEADER_SIZE`].
    pub header_size: u32,
    /// [`ENTRY_SIZE`].
    pub entry_size: u32,
    /// [`FIELD_SIZE`].
    pub field_size: u32,
    /// Number of event entries.
    pub nr_events: u32,
    /// Number of field entries (all events).
    pub nr_fields: u32,
    /// Offset of the entries from the table start (8-aligned).
    pub entries_off: u32,
    /// Offset of the field entries from the table start (8-aligned).
    pub fields_off: u32,
    /// Offset of the string area from the table start.
    pub strings_off: u32,
    /// Size of the string area.
    pub strings_size: u32,
    /// Host: number of entries accepted.
    pub accepted: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

/// One registered event (64 bytes).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct EventEntry {
    /// Trace-event system (`guest`, `myfw`...).
    pub system: StrRef,
    /// Event name, unique within its system.
    pub name: StrRef,
    /// Print format as in a `format` file after `print fmt: ` (quoted format, arguments).
    pub print_fmt: StrRef,
    /// Index of its first field entry.
    pub first_field: u32,
    /// Number of its field entries.
    pub nr_fields: u32,
    /// Fixed record size in bytes, common header included (a `__data_loc` string
    /// follows it).
    pub size: u32,
    /// Enable bit (slot) the writer tests: `0..NR_SLOTS`, one event per slot.
    pub slot: u32,
    /// Id the guest would like (0: any). The host grants it when free.
    pub requested_id: u32,
    /// Reserved, zero.
    pub flags: u32,
    /// Host: low 16 bits the assigned id, high 32 bits `STATUS_*`. A u64 word, read
    /// atomically by the guest after the state is DONE.
    pub result: u64,
    /// Reserved, zero.
    pub reserved: u64,
}

impl EventEntry {
    /// Offset of [`EventEntry::result`] in the entry.
    pub const RESULT_OFF: usize = 48;

    /// Packs a result word.
    pub const fn result_word(id: u16, status: u32) -> u64 {
        id as u64 | ((status as u64) << 32)
    }

    /// Splits a result word into (id, status).
    pub const fn split_result(word: u64) -> (u16, u32) {
        (word as u16, (word >> 32) as u32)
    }
}

/// One field of an event (32 bytes).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct FieldEntry {
    /// Field name.
    pub name: StrRef,
    /// C type as a `format` file writes it: `u8`..`u64`, `s8`..`s64`, `char`, `short`,
    /// `int`, `long`, `long long` and their `unsigned` forms, `bool`, `pid_t`, an array
    /// of one of these (`u8[16]`, `char[16]`), or `__data_loc char[]` (a u32
    /// `offset | len << 16` pointing at a NUL-terminated string after the fixed record).
    pub ctype: StrRef,
    /// Offset in the record (≥ 8: the common header comes first).
    pub offset: u32,
    /// Size in bytes (must match the type).
    pub size: u32,
    /// 1 if signed, else 0 (must match the type).
    pub signed: u32,
    /// Reserved, zero.
    pub reserved: u32,
}

/// Offset of the state word in the header.
pub const STATE_OFF: usize = 8;
/// Offset of `accepted` in the header.
pub const ACCEPTED_OFF: usize = 56;

// The documented byte layout (docs/abi.md "Event registration").
const _: () = {
    use core::mem::{offset_of, size_of};
    assert!(size_of::<StrRef>() == 8);
    assert!(size_of::<TableHeader>() == HEADER_SIZE);
    assert!(offset_of!(TableHeader, state) == STATE_OFF);
    assert!(offset_of!(TableHeader, version) == 16);
    assert!(offset_of!(TableHeader, nr_events) == 32);
    assert!(offset_of!(TableHeader, entries_off) == 40);
    assert!(offset_of!(TableHeader, strings_size) == 52);
    assert!(offset_of!(TableHeader, accepted) == ACCEPTED_OFF);
    assert!(size_of::<EventEntry>() == ENTRY_SIZE);
    assert!(offset_of!(EventEntry, print_fmt) == 16);
    assert!(offset_of!(EventEntry, first_field) == 24);
    assert!(offset_of!(EventEntry, size) == 32);
    assert!(offset_of!(EventEntry, slot) == 36);
    assert!(offset_of!(EventEntry, requested_id) == 40);
    assert!(offset_of!(EventEntry, result) == EventEntry::RESULT_OFF);
    assert!(size_of::<FieldEntry>() == FIELD_SIZE);
    assert!(offset_of!(FieldEntry, offset) == 16);
    assert!(offset_of!(FieldEntry, signed) == 24);
    assert!(MAX_EVENTS as u32 == NR_SLOTS);
    // Id ranges: guests, then the host kernel's, then the VMM's, all below 0x8000.
    assert!(FIRST_DYNAMIC_ID as usize + MAX_EVENTS <= FIRST_HOST_KERNEL_ID as usize);
    assert!(FIRST_HOST_KERNEL_ID < FIRST_VMM_ID && FIRST_VMM_ID <= MAX_EVENT_ID);
    assert!(MAX_EVENT_ID < 0x8000);
};

/// Known C types of a field: `(type, size, signed)`. Arrays of these (`T[N]`, size
/// `N * size`) and `__data_loc char[]` (size 4) are accepted too.
pub const C_TYPES: &[(&str, u32, bool)] = &[
    ("u8", 1, false),
    ("s8", 1, true),
    ("u16", 2, false),
    ("s16", 2, true),
    ("u32", 4, false),
    ("s32", 4, true),
    ("u64", 8, false),
    ("s64", 8, true),
    ("char", 1, true),
    ("unsigned char", 1, false),
    ("signed char", 1, true),
    ("short", 2, true),
    ("unsigned short", 2, false),
    ("int", 4, true),
    ("unsigned int", 4, false),
    ("long", 8, true),
    ("unsigned long", 8, false),
    ("long long", 8, true),
    ("unsigned long long", 8, false),
    ("bool", 1, false),
    ("pid_t", 4, true),
];

/// The C type string of a `__data_loc` string field.
pub const DATA_LOC_STR: &str = "__data_loc char[]";

/// Size and signedness of a known scalar C type.
pub fn scalar_type(t: &str) -> Option<(u32, bool)> {
    C_TYPES
        .iter()
        .find(|(n, _, _)| *n == t)
        .map(|&(_, s, sg)| (s, sg))
}
