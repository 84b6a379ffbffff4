//! The registration state machine's unit tests.
use super::*;
use hyptrace_abi::layout::Mode;
use hyptrace_abi::registry::{DEFAULT_TABLE_SIZE, STATE_OFF, STATE_READY, STATE_REFUSED};
use hyptrace_abi::HeapMem;
use hyptrace_writer::events::{read_answer, write_table, Event, Field};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;

static F: &[Field<'static>] = &[Field {
    name: "v",
    ctype: "u64",
    offset: 8,
    size: 8,
    signed: false,
}];
static A: Event<'static> = Event::new("g", "a", F, "\"%llu\", REC->v", 16, 2, 0);

fn region() -> (Arc<HeapMem>, RingGeometry) {
    let l = RingGeometry::new(2, 3, 4096, Mode::Stop, false)
        .and_then(|l| l.with_events(DEFAULT_TABLE_SIZE))
        .expect("geometry");
    let m = Arc::new(HeapMem::new(l.region_size));
    l.init_region(&*m, 0, 1);
    for cpu in 0..2 {
        m.store(l.ctl(cpu) + ctl::ENABLE, 0, Relaxed);
    }
    (m, l)
}

/// A valid table: answered, its event enabled on every CPU, its format kept; a
/// second exit changes nothing.
#[test]
fn answers_enables_and_keeps_the_format() {
    let (m, l) = region();
    write_table(&*m, &[&A]).expect("table");
    m.store(l.ctl(1) + ctl::ENABLE, u64::MAX, Relaxed);
    let ev = Events::new(m.clone(), l);
    assert_eq!(ev.on_register(0), Exit::Answered);
    assert_eq!(read_answer(&*m, &[&A]), Ok(1));
    for cpu in 0..2 {
        assert_eq!(m.load(l.ctl(cpu) + ctl::ENABLE, Acquire), 1 << 2);
    }
    let r = ev.wait(Duration::ZERO).expect("registered");
    assert_eq!(r.formats.len(), 1);
    assert_eq!(
        (r.formats[0].name.as_str(), r.formats[0].fields.len()),
        ("a", 1)
    );
    assert_eq!(ev.on_register(1), Exit::Ignored);
    assert_eq!(ev.wait(Duration::ZERO), Ok(r));
}

/// Garbage marked READY is refused as a whole (the guest reads REFUSED), bounded.
#[test]
fn a_hostile_table_is_refused() {
    let (m, l) = region();
    m.write_bytes(l.events_off, &[0xa5; 256]);
    m.store(l.events_off + STATE_OFF, STATE_READY, Release);
    let ev = Events::new(m.clone(), l);
    ev.on_register(0);
    assert!(matches!(
        ev.wait(Duration::ZERO),
        Err(RegisterError::Refused(_))
    ));
    assert_eq!(m.load(l.events_off + STATE_OFF, Acquire), STATE_REFUSED);
}

/// After the wait gave up (the output was opened without formats), a registration
/// is refused, never answered (L1); a table never READY counts as refused after
/// MAX_EARLY_EXITS exits.
#[test]
fn late_and_never_ready_registrations_are_refused() {
    let (m, l) = region();
    let ev = Events::new(m.clone(), l);
    assert_eq!(
        ev.wait(Duration::from_millis(1)),
        Err(RegisterError::TimedOut(Duration::from_millis(1)))
    );
    write_table(&*m, &[&A]).expect("table");
    assert_eq!(ev.on_register(0), Exit::Late);
    assert_eq!(m.load(l.events_off + STATE_OFF, Acquire), STATE_REFUSED);
    assert_eq!(m.load(l.ctl(0) + ctl::ENABLE, Acquire), 0);

    let (m, l) = region();
    let ev = Events::new(m.clone(), l);
    for _ in 0..MAX_EARLY_EXITS - 1 {
        assert_eq!(ev.on_register(0), Exit::NotReady);
    }
    assert_eq!(ev.on_register(0), Exit::Refused);
    assert!(matches!(
        ev.wait(Duration::ZERO),
        Err(RegisterError::Refused(TableError::NotReady(_)))
    ));
}

/// The settle decision (L1) on injected states, no wall time: a waiting table waits
/// on however long writers stayed attached; a pack without a table, a write without
/// a registration or the caller giving up end the wait; an answer wins over all.
#[test]
fn settle_decides_on_what_the_vcpus_do() {
    let w = State::Waiting { early: 3 };
    assert_eq!(decide(&w, false, false, false), None);
    assert_eq!(decide(&w, false, true, false), Some(Settled::Unregistered));
    assert_eq!(decide(&w, true, true, true), Some(Settled::NoTable));
    assert_eq!(decide(&w, false, false, true), Some(Settled::None));
    let r = State::Registered {
        reg: Registry::default(),
        error: None,
    };
    assert_eq!(decide(&r, false, true, true), Some(Settled::Registered));
    let f = State::Refused(TableError::NotReady(0));
    assert_eq!(
        decide(&f, false, true, true),
        Some(Settled::Refused(TableError::NotReady(0)))
    );
    let c = State::Closed {
        settled: Settled::Unregistered,
        since: Instant::now(),
        late: None,
    };
    assert_eq!(decide(&c, false, false, false), Some(Settled::Unregistered));
}
