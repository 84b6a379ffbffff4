//! Guest side of event registration: describe events ([`Event`], [`Field`]), write them
//! into the pack's registration table ([`register`]), learn the ids the host assigned, and
//! emit them ([`Event::emit`]: the enable test, one load, then [`Writer::write_enabled`]).
//! The table layout and the handshake are in [`hyptrace_abi::registry`] and
//! `docs/abi.md` ("Event registration").
//!
//! ```text
//! vCPU 0:  register(mem, &EVENTS, || out(PORT_REGISTER))   // table, READY, exit, ids
//! others:  wait_registered(mem, &EVENTS, spins)            // until DONE, then ids
//! all:     EVENT.emit(&mut writer, ts, &payload)           // or the macro's typed emit
//! ```

use core::sync::atomic::AtomicU64;
use core::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use hyptrace_abi::layout::{pack, RingGeometry};
use hyptrace_abi::registry::{
    EventEntry, FieldEntry, StrRef, TableHeader, ENTRY_SIZE, FIELD_SIZE, HEADER_SIZE, MAX_EVENTS,
    MAX_FIELDS, STATE_DONE, STATE_EMPTY, STATE_OFF, STATE_READY, STATE_REFUSED, STATUS_ACCEPTED,
    TABLE_MAGIC, TABLE_VERSION,
};
use hyptrace_abi::SharedMem;
use zerocopy::IntoBytes;

use crate::{WriteOutcome, Writer};

/// One field of an event (the common header's fields are implicit, at 0..8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field<'a> {
    /// Field name.
    pub name: &'a str,
    /// C type (see [`hyptrace_abi::registry::FieldEntry::ctype`]).
    pub ctype: &'a str,
    /// Offset in the record (≥ 8).
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
    /// Signedness.
    pub signed: bool,
}

/// An event a guest can emit: its description (what goes into the registration table)
/// and, once registered, the id the host assigned.
#[derive(Debug)]
pub struct Event<'a> {
    /// Trace-event system.
    pub system: &'a str,
    /// Event name.
    pub name: &'a str,
    /// Its fields, in record order.
    pub fields: &'a [Field<'a>],
    /// Print format (`"fmt", REC->a, ...` as in a `format` file).
    pub print_fmt: &'a str,
    /// Fixed record size, common header included.
    pub size: u32,
    /// Enable bit tested before every write (`0..64`, one event per bit).
    pub slot: u32,
    /// Id asked for (0: any).
    pub requested_id: u16,
    /// The host's answer: `EventEntry::result_word` (0 until registered).
    result: AtomicU64,
}

impl<'a> Event<'a> {
    /// An unregistered event.
    pub const fn new(
        system: &'a str,
        name: &'a str,
        fields: &'a [Field<'a>],
        print_fmt: &'a str,
        size: u32,
        slot: u32,
        requested_id: u16,
    ) -> Self {
        Self {
            system,
            name,
            fields,
            print_fmt,
            size,
            slot,
            requested_id,
            result: AtomicU64::new(0),
        }
    }

    /// The id the host assigned, if it accepted the event.
    pub fn id(&self) -> Option<u16> {
        let (id, status) = EventEntry::split_result(self.result.load(Relaxed));
        (status == STATUS_ACCEPTED).then_some(id)
    }

    /// The raw result word (`id | status << 32`).
    pub fn result(&self) -> u64 {
        self.result.load(Relaxed)
    }

    fn set_result(&self, word: u64) {
        self.result.store(word, Relaxed);
    }

    /// Writes `record` (common header included: its first two bytes are replaced by the
    /// assigned id) if the event's slot is enabled; a disabled event costs the one load
    /// of the enable word and is counted as skipped. An event the host rejected is
    /// disabled by the host (its bit stays clear); should the bit be set anyway, the
    /// record is not written ([`WriteOutcome::Disabled`], skipped).
    #[inline(always)]
    pub fn emit<M: SharedMem>(
        &self,
        w: &mut Writer<M>,
        ts: u64,
        record: &mut [u8],
    ) -> WriteOutcome {
        if !w.enabled(self.slot) {
            w.skip();
            return WriteOutcome::Disabled;
        }
        let Some(id) = self.id() else {
            w.skip();
            return WriteOutcome::Disabled;
        };
        if let Some(h) = record.get_mut(..2) {
            h.copy_from_slice(&id.to_le_bytes());
        }
        w.write_enabled(ts, record)
    }
}

/// Why a registration did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterError {
    /// The pack has no registration table (an older host): every event was given its
    /// requested id, nothing was sent.
    NoTable,
    /// The pack is not valid.
    BadPack,
    /// More events than [`MAX_EVENTS`] or fields than [`MAX_FIELDS`].
    TooMany,
    /// The table needs more bytes than the host reserved.
    TooLarge {
        /// Bytes needed.
        needed: usize,
        /// Bytes reserved.
        available: usize,
    },
    /// The table was already written (one registration per run).
    AlreadyRegistered,
    /// The host refused the table: a bad header, or a registration after the run went
    /// on without one (docs/abi.md); the events get no id.
    Refused,
    /// The host has not answered (the state is still READY).
    NotAnswered,
}

impl core::fmt::Display for RegisterError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NoTable => write!(f, "the pack has no event registration table"),
            Self::BadPack => write!(f, "the pack is not valid"),
            Self::TooMany => write!(
                f,
                "more than {MAX_EVENTS} events or {MAX_FIELDS} fields to register"
            ),
            Self::TooLarge { needed, available } => write!(
                f,
                "the registration table needs {needed} bytes, the host reserved {available}"
            ),
            Self::AlreadyRegistered => write!(f, "the registration table was already written"),
            Self::Refused => write!(f, "the host refused the registration table"),
            Self::NotAnswered => write!(f, "the host did not answer the registration"),
        }
    }
}

impl core::error::Error for RegisterError {}

/// Where the pack's registration table is: `(offset, size)`, `None` if it has none.
pub fn table<M: SharedMem + ?Sized>(mem: &M) -> Result<Option<(usize, usize)>, RegisterError> {
    let l = RingGeometry::parse(mem).map_err(|_| RegisterError::BadPack)?;
    debug_assert_eq!(mem.load(pack::EVENTS_OFF, Relaxed), l.events_off as u64);
    Ok((l.events_size != 0).then_some((l.events_off, l.events_size)))
}

/// Bytes the table for `events` needs.
pub fn table_size(events: &[&Event<'_>]) -> usize {
    let fields: usize = events.iter().map(|e| e.fields.len()).sum();
    let strings: usize = events
        .iter()
        .map(|e| {
            e.system.len()
                + e.name.len()
                + e.print_fmt.len()
                + e.fields
                    .iter()
                    .map(|f| f.name.len() + f.ctype.len())
                    .sum::<usize>()
        })
        .sum();
    HEADER_SIZE + events.len() * ENTRY_SIZE + fields * FIELD_SIZE + strings
}

/// Writes the registration table for `events` and marks it [`STATE_READY`] (Release),
/// without telling the host (see [`register`]). With no table in the pack, every event
/// gets its requested id and the result is [`RegisterError::NoTable`].
pub fn write_table<M: SharedMem + ?Sized>(
    mem: &M,
    events: &[&Event<'_>],
) -> Result<(), RegisterError> {
    let Some((base, size)) = table(mem)? else {
        for e in events {
            e.set_result(EventEntry::result_word(e.requested_id, STATUS_ACCEPTED));
        }
        return Err(RegisterError::NoTable);
    };
    let nr_fields: usize = events.iter().map(|e| e.fields.len()).sum();
    if events.len() > MAX_EVENTS || nr_fields > MAX_FIELDS {
        return Err(RegisterError::TooMany);
    }
    let needed = table_size(events);
    if needed > size {
        return Err(RegisterError::TooLarge {
            needed,
            available: size,
        });
    }
    // Acquire: pairs with the host's Release store of DONE/REFUSED (a table already
    // answered is never written again).
    if mem.load(base + STATE_OFF, Acquire) != STATE_EMPTY {
        return Err(RegisterError::AlreadyRegistered);
    }
    let entries_off = HEADER_SIZE;
    let fields_off = entries_off + events.len() * ENTRY_SIZE;
    let strings_off = fields_off + nr_fields * FIELD_SIZE;
    let strings_size = needed - strings_off;
    // Every size below was bounded by `needed <= size <= MAX_TABLE_SIZE` (u32 range).
    let mut s = strings_off;
    let mut put = |text: &str| {
        mem.write_bytes(base + s, text.as_bytes());
        let r = StrRef {
            off: (s - strings_off) as u32,
            len: text.len() as u32,
        };
        s += text.len();
        r
    };
    let mut field_index = 0usize;
    for (i, e) in events.iter().enumerate() {
        let first_field = field_index;
        for f in e.fields {
            let fe = FieldEntry {
                name: put(f.name),
                ctype: put(f.ctype),
                offset: f.offset,
                size: f.size,
                signed: u32::from(f.signed),
                reserved: 0,
            };
            mem.write_bytes(base + fields_off + field_index * FIELD_SIZE, fe.as_bytes());
            field_index += 1;
        }
        let entry = EventEntry {
            system: put(e.system),
            name: put(e.name),
            print_fmt: put(e.print_fmt),
            first_field: first_field as u32,
            nr_fields: e.fields.len() as u32,
            size: e.size,
            slot: e.slot,
            requested_id: u32::from(e.requested_id),
            flags: 0,
            result: 0,
            reserved: 0,
        };
        mem.write_bytes(base + entries_off + i * ENTRY_SIZE, entry.as_bytes());
        e.set_result(0);
    }
    let header = TableHeader {
        magic: TABLE_MAGIC,
        state: STATE_EMPTY,
        version: TABLE_VERSION,
        header_size: HEADER_SIZE as u32,
        entry_size: ENTRY_SIZE as u32,
        field_size: FIELD_SIZE as u32,
        nr_events: events.len() as u32,
        nr_fields: nr_fields as u32,
        entries_off: entries_off as u32,
        fields_off: fields_off as u32,
        strings_off: strings_off as u32,
        strings_size: strings_size as u32,
        accepted: 0,
        reserved: 0,
    };
    mem.write_bytes(base, header.as_bytes());
    // Release: paired with the Acquire load of the state in the host's registry reader:
    // everything written above is visible to a host that sees READY.
    mem.store(base + STATE_OFF, STATE_READY, Release);
    Ok(())
}

/// Reads the host's answer into `events` (which must be the slice given to
/// [`write_table`]): the number of events accepted.
pub fn read_answer<M: SharedMem + ?Sized>(
    mem: &M,
    events: &[&Event<'_>],
) -> Result<usize, RegisterError> {
    let Some((base, _)) = table(mem)? else {
        return Err(RegisterError::NoTable);
    };
    // Acquire: paired with the host's Release store of DONE after the results.
    match mem.load(base + STATE_OFF, Acquire) {
        STATE_DONE => {}
        STATE_REFUSED => return Err(RegisterError::Refused),
        _ => return Err(RegisterError::NotAnswered),
    }
    let mut accepted = 0;
    for (i, e) in events.iter().enumerate().take(MAX_EVENTS) {
        let word = mem.load(
            base + HEADER_SIZE + i * ENTRY_SIZE + EventEntry::RESULT_OFF,
            Relaxed,
        );
        e.set_result(word);
        if e.id().is_some() {
            accepted += 1;
        }
    }
    Ok(accepted)
}

/// Registers `events`: writes the table ([`write_table`]), calls `notify` (the guest's
/// register bell, an exit: [`hyptrace_abi::registry::PORT_REGISTER`], or the MMIO
/// doorbell page's `DOORBELL_REGISTER_OFF` — docs/abi.md, "Doorbell"; the host answers
/// during it) and
/// reads the answer ([`read_answer`]). Returns the number of events accepted; each
/// event's [`Event::id`] is set. Run it on one CPU, before the first event.
pub fn register<M: SharedMem + ?Sized>(
    mem: &M,
    events: &[&Event<'_>],
    notify: impl FnOnce(),
) -> Result<usize, RegisterError> {
    write_table(mem, events)?;
    notify();
    read_answer(mem, events)
}

/// On the CPUs that do not register: waits (at most `spins` polls) until the host
/// answered the registration another CPU made, then reads the answer into `events`.
/// With no table, every event gets its requested id ([`RegisterError::NoTable`]).
pub fn wait_registered<M: SharedMem + ?Sized>(
    mem: &M,
    events: &[&Event<'_>],
    spins: u64,
) -> Result<usize, RegisterError> {
    let Some((base, _)) = table(mem)? else {
        for e in events {
            e.set_result(EventEntry::result_word(e.requested_id, STATUS_ACCEPTED));
        }
        return Err(RegisterError::NoTable);
    };
    let mut n = 0u64;
    loop {
        // Acquire: paired with the host's Release store of DONE/REFUSED in
        // hyptrace_reader::registry::answer / refuse: the results are visible after it.
        let st = mem.load(base + STATE_OFF, Acquire);
        if st == STATE_DONE || st == STATE_REFUSED || n >= spins {
            break;
        }
        n += 1;
        core::hint::spin_loop();
    }
    read_answer(mem, events)
}

/// A field type the [`event!`](crate::event) macro lays out: its C type, size and
/// signedness, and how it is stored (little-endian).
pub trait EventField: Copy {
    /// C type as a `format` file writes it.
    const CTYPE: &'static str;
    /// Size in bytes.
    const SIZE: usize;
    /// Signedness.
    const SIGNED: bool;
    /// Stores the value into `out` (exactly [`EventField::SIZE`] bytes).
    fn put(self, out: &mut [u8]);
}

macro_rules! event_field {
    ($($t:ty => $c:literal, $signed:literal;)*) => {$(
        impl EventField for $t {
            const CTYPE: &'static str = $c;
            const SIZE: usize = core::mem::size_of::<$t>();
            const SIGNED: bool = $signed;
            #[inline(always)]
            fn put(self, out: &mut [u8]) {
                out.copy_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}

event_field! {
    u8 => "u8", false;
    i8 => "s8", true;
    u16 => "u16", false;
    i16 => "s16", true;
    u32 => "u32", false;
    i32 => "s32", true;
    u64 => "u64", false;
    i64 => "s64", true;
}

impl EventField for bool {
    const CTYPE: &'static str = "bool";
    const SIZE: usize = 1;
    const SIGNED: bool = false;
    #[inline(always)]
    fn put(self, out: &mut [u8]) {
        out[0] = u8::from(self);
    }
}

/// Lays out `N` fields back to back from offset 8 (after the common header): what the
/// [`event!`](crate::event) macro registers.
pub const fn layout<const N: usize>(
    names: [&'static str; N],
    ctypes: [&'static str; N],
    sizes: [usize; N],
    signed: [bool; N],
) -> [Field<'static>; N] {
    let mut out = [Field {
        name: "",
        ctype: "",
        offset: 0,
        size: 0,
        signed: false,
    }; N];
    let mut off = hyptrace_abi::events::COMMON_HEADER_SIZE;
    let mut i = 0;
    while i < N {
        out[i] = Field {
            name: names[i],
            ctype: ctypes[i],
            offset: off as u32,
            size: sizes[i] as u32,
            signed: signed[i],
        };
        off += sizes[i];
        i += 1;
    }
    out
}

/// Record size of fields of `sizes` after the common header.
pub const fn record_size(sizes: &[usize]) -> usize {
    let mut n = hyptrace_abi::events::COMMON_HEADER_SIZE;
    let mut i = 0;
    while i < sizes.len() {
        n += sizes[i];
        i += 1;
    }
    n
}

/// The guest clock the typed `emit` stamps events with: the TSC.
#[inline(always)]
pub fn now() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: RDTSC has no preconditions (it only reads the time-stamp counter)
        // and exists on every x86_64 CPU.
        #[allow(unused_unsafe)]
        unsafe {
            core::arch::x86_64::_rdtsc()
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// The common header of a record of event `id` written on `cpu`'s writer.
#[inline(always)]
pub fn header(id: u16, cpu: u32) -> [u8; 8] {
    hyptrace_abi::events::CommonHeader {
        common_type: id,
        flags: 0,
        preempt_count: 0,
        pid: hyptrace_abi::events::vcpu_pid(cpu),
    }
    .to_bytes()
}

/// Declares a guest event once: its registration entry and a typed `emit`.
///
/// ```
/// hyptrace_writer::event! {
///     /// A packet went by.
///     pub struct Packet {
///         system: "demo",
///         name: "packet",
///         slot: 5,
///         id: 0,
///         print: "\"len=%u proto=%d\", REC->len, REC->proto",
///         fields: { len: u32, proto: i32 },
///     }
/// }
/// assert_eq!(Packet::SIZE, 16);
/// assert_eq!(Packet::event().fields[1].offset, 12);
/// ```
///
/// generates a unit struct `Packet` with
/// - `Packet::event() -> &'static Event` (register it with [`register`]; its id is set
///   from the host's answer),
/// - `Packet::emit(&mut writer, len, proto) -> WriteOutcome`: the enable test (one
///   load of the enable word; disabled: counted as skipped, nothing else), then the
///   record built on the stack (common header with the assigned id and the vCPU's pid,
///   the fields packed from offset 8, little-endian) and [`Writer::write_enabled`]
///   stamped with [`now`]; `Packet::emit_at(&mut writer, ts, ...)` with a given stamp.
///
/// Field types: `u8 i8 u16 i16 u32 i32 u64 i64 bool` ([`EventField`]), laid out back to
/// back (no padding) in declaration order.
#[macro_export]
macro_rules! event {
    (
        $(#[$meta:meta])*
        $vis:vis struct $ty:ident {
            system: $system:expr,
            name: $name:expr,
            slot: $slot:expr,
            id: $id:expr,
            print: $print:expr,
            fields: { $($field:ident : $fty:ty),* $(,)? } $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug)]
        $vis struct $ty;

        #[allow(dead_code)]
        impl $ty {
            const SIZES: &'static [usize] = &[$(<$fty as $crate::events::EventField>::SIZE),*];
            /// Record size, common header included.
            pub const SIZE: usize = $crate::events::record_size(Self::SIZES);
            /// The enable bit.
            pub const SLOT: u32 = $slot;
            const FIELDS: &'static [$crate::events::Field<'static>] = &$crate::events::layout(
                [$(stringify!($field)),*],
                [$(<$fty as $crate::events::EventField>::CTYPE),*],
                [$(<$fty as $crate::events::EventField>::SIZE),*],
                [$(<$fty as $crate::events::EventField>::SIGNED),*],
            );

            /// The event's registration entry (and, once registered, its id).
            #[inline(always)]
            pub fn event() -> &'static $crate::events::Event<'static> {
                static EVENT: $crate::events::Event<'static> = $crate::events::Event::new(
                    $system,
                    $name,
                    $ty::FIELDS,
                    $print,
                    $ty::SIZE as u32,
                    $ty::SLOT,
                    $id,
                );
                &EVENT
            }

            /// Writes the event stamped now, if enabled (else counted as skipped).
            #[inline(always)]
            pub fn emit<M: $crate::SharedMem>(
                w: &mut $crate::Writer<M>,
                $($field: $fty),*
            ) -> $crate::WriteOutcome {
                if !w.enabled(Self::SLOT) {
                    w.skip();
                    return $crate::WriteOutcome::Disabled;
                }
                Self::fill_and_write(w, $crate::events::now(), $($field),*)
            }

            /// Writes the event stamped `ts`, if enabled (else counted as skipped).
            #[inline(always)]
            pub fn emit_at<M: $crate::SharedMem>(
                w: &mut $crate::Writer<M>,
                ts: u64,
                $($field: $fty),*
            ) -> $crate::WriteOutcome {
                if !w.enabled(Self::SLOT) {
                    w.skip();
                    return $crate::WriteOutcome::Disabled;
                }
                Self::fill_and_write(w, ts, $($field),*)
            }

            #[inline(always)]
            fn fill_and_write<M: $crate::SharedMem>(
                w: &mut $crate::Writer<M>,
                ts: u64,
                $($field: $fty),*
            ) -> $crate::WriteOutcome {
                let Some(id) = Self::event().id() else {
                    w.skip();
                    return $crate::WriteOutcome::Disabled;
                };
                let mut rec = [0u8; Self::SIZE];
                rec[..8].copy_from_slice(&$crate::events::header(id, w.cpu()));
                let mut _off = 8usize;
                $(
                    let n = <$fty as $crate::events::EventField>::SIZE;
                    $crate::events::EventField::put($field, &mut rec[_off.._off + n]);
                    _off += n;
                )*
                w.write_enabled(ts, &rec)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_abi::layout::{ctl, Mode};
    use hyptrace_abi::registry::{DEFAULT_TABLE_SIZE, STATUS_REJECTED};
    use hyptrace_abi::HeapMem;
    use zerocopy::FromBytes;

    const FIELDS: &[Field<'static>] = &[Field {
        name: "v",
        ctype: "u64",
        offset: 8,
        size: 8,
        signed: false,
    }];
    static A: Event<'static> = Event::new("sys", "a", FIELDS, "\"v=%llu\", REC->v", 16, 3, 0);
    static B: Event<'static> = Event::new("sys", "b", FIELDS, "\"v=%llu\", REC->v", 16, 4, 77);

    fn region(table: usize) -> (HeapMem, RingGeometry) {
        let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)
            .unwrap()
            .with_events(table)
            .unwrap();
        let m = HeapMem::new(l.region_size);
        l.init_region(&m, 0, 1);
        (m, l)
    }

    /// The table the writer writes is the documented layout, READY last; the host's
    /// answer (written here by hand) gives each event its id, and `emit` tests the slot.
    #[test]
    fn write_table_then_answer_then_emit() {
        let (m, l) = region(DEFAULT_TABLE_SIZE);
        let evs: [&Event; 2] = [&A, &B];
        write_table(&m, &evs).unwrap();
        assert_eq!(write_table(&m, &evs), Err(RegisterError::AlreadyRegistered));
        let mut bytes = std::vec![0u8; l.events_size];
        m.read_bytes(l.events_off, &mut bytes);
        let h = TableHeader::read_from_prefix(&bytes).unwrap().0;
        assert_eq!(
            (h.magic, h.state, h.nr_events, h.nr_fields),
            (TABLE_MAGIC, STATE_READY, 2, 2)
        );
        let e1 = EventEntry::read_from_prefix(&bytes[h.entries_off as usize + ENTRY_SIZE..])
            .unwrap()
            .0;
        let s = h.strings_off as usize + e1.name.off as usize;
        assert_eq!(&bytes[s..s + e1.name.len as usize], b"b");
        assert_eq!((e1.first_field, e1.slot, e1.requested_id), (1, 4, 77));
        assert_eq!(read_answer(&m, &evs), Err(RegisterError::NotAnswered));
        // The host: accept a with id 2000, reject b.
        let r = |i: usize| l.events_off + HEADER_SIZE + i * ENTRY_SIZE + EventEntry::RESULT_OFF;
        m.store(
            r(0),
            EventEntry::result_word(2000, STATUS_ACCEPTED),
            Relaxed,
        );
        m.store(r(1), EventEntry::result_word(0, STATUS_REJECTED), Relaxed);
        m.store(l.events_off + STATE_OFF, STATE_DONE, Release);
        assert_eq!(wait_registered(&m, &evs, 10), Ok(1));
        assert_eq!((A.id(), B.id()), (Some(2000), None));

        let mut w = Writer::attach(&m, 0).unwrap();
        let mut rec = [0u8; 16];
        assert_eq!(A.emit(&mut w, 5, &mut rec), WriteOutcome::Written);
        assert_eq!(&rec[..2], &2000u16.to_le_bytes());
        // b is rejected: never written even with its bit set.
        assert_eq!(B.emit(&mut w, 6, &mut rec), WriteOutcome::Disabled);
        w.mem()
            .fetch_and(l.ctl(0) + ctl::ENABLE, !(1 << 3), Relaxed);
        assert_eq!(A.emit(&mut w, 7, &mut rec), WriteOutcome::Disabled);
        assert_eq!((w.entries(), w.skipped()), (1, 2));
    }

    crate::event! {
        /// A test event.
        pub struct Probe {
            system: "t",
            name: "probe",
            slot: 7,
            id: 3000,
            print: "\"a=%u b=%d c=%llu\", REC->a, REC->b, REC->c",
            fields: { a: u8, b: i32, c: u64, d: bool },
        }
    }

    /// The macro's layout and its typed emit: one record with the assigned id, the pid
    /// and the fields packed from 8; disabled: skipped, nothing written.
    #[test]
    fn macro_event_layout_and_emit() {
        assert_eq!(Probe::SIZE, 8 + 1 + 4 + 8 + 1);
        let e = Probe::event();
        let got: std::vec::Vec<(&str, &str, u32, u32, bool)> = e
            .fields
            .iter()
            .map(|f| (f.name, f.ctype, f.offset, f.size, f.signed))
            .collect();
        assert_eq!(
            got,
            [
                ("a", "u8", 8, 1, false),
                ("b", "s32", 9, 4, true),
                ("c", "u64", 13, 8, false),
                ("d", "bool", 21, 1, false)
            ]
        );
        let (m, l) = region(0);
        // No table: the requested id.
        assert_eq!(write_table(&m, &[e]), Err(RegisterError::NoTable));
        let mut w = Writer::attach(&m, 0).unwrap();
        assert_eq!(
            Probe::emit_at(&mut w, 10, 1, -2, 3, true),
            WriteOutcome::Written
        );
        m.fetch_and(l.ctl(0) + ctl::ENABLE, !(1 << 7), Relaxed);
        assert_eq!(Probe::emit(&mut w, 1, -2, 3, true), WriteOutcome::Disabled);
        assert_eq!((w.entries(), w.skipped()), (1, 1));
        let page = l.page_off(l.first_page(0) + 1);
        let mut rec = [0u8; 22];
        m.read_bytes(page + 16 + 4, &mut rec);
        let mut want = std::vec::Vec::new();
        want.extend_from_slice(&3000u16.to_le_bytes());
        want.extend_from_slice(&[0, 0]);
        want.extend_from_slice(&1i32.to_le_bytes()); // pid of vCPU 0
        want.push(1);
        want.extend_from_slice(&(-2i32).to_le_bytes());
        want.extend_from_slice(&3u64.to_le_bytes());
        want.push(1);
        assert_eq!(&rec[..], &want[..]);
    }

    #[test]
    fn no_table_and_too_small_table() {
        let (m, _) = region(0);
        static C: Event<'static> = Event::new("sys", "c", &[], "\"\"", 8, 0, 1234);
        assert_eq!(write_table(&m, &[&C]), Err(RegisterError::NoTable));
        assert_eq!(C.id(), Some(1234));
        let (m, _) = region(128);
        assert!(matches!(
            write_table(&m, &[&A, &B]),
            Err(RegisterError::TooLarge { available: 128, .. })
        ));
    }
}
