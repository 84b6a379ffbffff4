//! Fuzz target `registration`: the host's validation of a guest's event-registration
//! table (`hyptrace_reader::registry::parse_table`, `answer`) on hostile bytes.
//!
//! ```text
//! byte 0     config: bit 0 repair the header's constants (magic, state READY, version,
//!            header/entry/field sizes), bit 1 also lay the areas out consistently from
//!            the counts (entries at 64, fields after them, strings after the fields up
//!            to the end), bits 2-7 ignored
//! byte 1..   the table's bytes (at most 64 KiB)
//! ```
//!
//! Without the repairs the fuzzer would seldom get past the header. Oracle: no panic; on
//! `Ok`, the registry keeps the guarantees the host relies on: at most 64 events, every
//! entry index below the declared count answered once (accepted or rejected), unique
//! `system:name`, unique slots below 64, unique non-zero ids, every field a known type
//! inside `[8, size)` with no overlap, strings bounded; `answer` into a real region
//! stays inside the table and the writer reads back exactly the accepted count.
#![no_main]

use std::collections::BTreeSet;

use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::registry::{
    EventEntry, DEFAULT_TABLE_SIZE, ENTRY_SIZE, FIELD_SIZE, HEADER_SIZE, MAX_EVENTS,
    MAX_FIELDS_PER_EVENT, MAX_NAME, MAX_PRINT_FMT, MAX_RECORD, NR_SLOTS, STATE_READY,
    STATUS_ACCEPTED, TABLE_MAGIC, TABLE_VERSION,
};
use hyptrace_abi::{SharedMem, WordMem};
use hyptrace_reader::registry::{answer, parse_table, read_table};
use libfuzzer_sys::fuzz_target;

fn put32(b: &mut [u8], off: usize, v: u32) {
    if let Some(s) = b.get_mut(off..off + 4) {
        s.copy_from_slice(&v.to_le_bytes());
    }
}

fn get32(b: &[u8], off: usize) -> u32 {
    b.get(off..off + 4)
        .map_or(0, |s| u32::from_le_bytes(s.try_into().unwrap()))
}

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, rest)) = data.split_first() else {
        return;
    };
    let mut t = rest[..rest.len().min(DEFAULT_TABLE_SIZE)].to_vec();
    if cfg & 1 != 0 && t.len() >= HEADER_SIZE {
        t[..8].copy_from_slice(&TABLE_MAGIC.to_le_bytes());
        t[8..16].copy_from_slice(&STATE_READY.to_le_bytes());
        put32(&mut t, 16, TABLE_VERSION);
        put32(&mut t, 20, HEADER_SIZE as u32);
        put32(&mut t, 24, ENTRY_SIZE as u32);
        put32(&mut t, 28, FIELD_SIZE as u32);
        if cfg & 2 != 0 {
            let ne = get32(&t, 32) % (MAX_EVENTS as u32 + 8);
            let nf = get32(&t, 36) % 80;
            let fo = HEADER_SIZE as u32 + ne * ENTRY_SIZE as u32;
            let so = fo + nf * FIELD_SIZE as u32;
            put32(&mut t, 32, ne);
            put32(&mut t, 36, nf);
            put32(&mut t, 40, HEADER_SIZE as u32);
            put32(&mut t, 44, fo);
            put32(&mut t, 48, so);
            let len = t.len() as u32;
            put32(&mut t, 52, len.saturating_sub(so));
        }
    }
    let Ok(reg) = parse_table(&t) else {
        return;
    };
    assert!(reg.events.len() <= MAX_EVENTS);
    assert!(reg.nr_entries as usize <= MAX_EVENTS);
    let mut seen = BTreeSet::new();
    for i in reg
        .events
        .iter()
        .map(|e| e.index)
        .chain(reg.rejected.iter().map(|r| r.index))
    {
        assert!(seen.insert(i), "entry {i} answered twice");
    }
    // Every declared entry is answered; the excess shares one rejection at index 64.
    assert!((0..reg.nr_entries).all(|i| seen.contains(&i)));
    assert!(seen.iter().all(|&i| i <= MAX_EVENTS as u32));
    let mut names = BTreeSet::new();
    let mut slots = BTreeSet::new();
    let mut ids = BTreeSet::new();
    for e in &reg.events {
        assert!(names.insert((e.system.clone(), e.name.clone())));
        assert!(e.slot < NR_SLOTS && slots.insert(e.slot));
        assert!(e.id != 0 && ids.insert(e.id));
        assert!(e.system.len() <= MAX_NAME && e.name.len() <= MAX_NAME);
        assert!(e.print_fmt.len() <= MAX_PRINT_FMT);
        assert!((8..=MAX_RECORD as u32).contains(&e.size));
        assert!(e.fields.len() <= MAX_FIELDS_PER_EVENT);
        let mut end = 8u32;
        for f in &e.fields {
            assert!(f.offset >= end, "fields overlap or sit in the header");
            end = f.offset + f.size;
            assert!(end <= e.size);
        }
    }
    for r in &reg.rejected {
        assert!(r.to_string().len() < 4096);
    }

    // The answer lands inside the table of a real region, and the writer's reader of
    // it counts exactly the accepted entries.
    let l = RingGeometry::new(1, 3, 4096, Mode::Stop, false)
        .unwrap()
        .with_events(DEFAULT_TABLE_SIZE)
        .unwrap();
    let m = WordMem::new(l.region_size);
    l.init_region(&m, 0, 1);
    m.write_bytes(l.events_off, &t);
    m.store(l.events_off + 8, STATE_READY, std::sync::atomic::Ordering::Release);
    let again = read_table(&m, &l).unwrap().unwrap();
    assert_eq!(again, reg);
    let before = m.to_vec();
    answer(&m, &l, &reg);
    let after = m.to_vec();
    let table = l.events_off..l.events_off + l.events_size;
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        assert!(a == b || table.contains(&i), "answer wrote outside the table at {i}");
    }
    let accepted = (0..reg.nr_entries as usize)
        .filter(|i| {
            let off = l.events_off
                + reg.entries_off as usize
                + i * ENTRY_SIZE
                + EventEntry::RESULT_OFF;
            EventEntry::split_result(m.load(off, std::sync::atomic::Ordering::Acquire)).1
                == STATUS_ACCEPTED
        })
        .count();
    assert_eq!(accepted, reg.events.len());
});
