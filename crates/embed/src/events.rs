//! The guest's event registration, answered by the VMM: every valid event accepted and
//! enabled, its trace-event format kept for the output (so trace-cmd prints its fields).

use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyptrace_abi::layout::{ctl, RingGeometry};
use hyptrace_abi::SharedMem;
use hyptrace_output::EventFormat;
use hyptrace_reader::registry::{answer, read_table, refuse, Registration, Rejection, TableError};

/// Registration exits with the table not ready before the table counts as refused.
const MAX_EARLY_EXITS: u32 = 16;

/// The trace-event format of a registered event (what trace.dat and the text formatter
/// need to print its fields).
///
/// ```
/// use hyptrace_reader::registry::Registration;
/// let r = Registration {
///     index: 0, system: "demo".into(), name: "packet".into(), fields: vec![],
///     print_fmt: "\"x\"".into(), size: 8, slot: 3, id: 42,
/// };
/// let f = hyptrace_embed::to_format(&r);
/// assert_eq!((f.system.as_str(), f.name.as_str(), f.id), ("demo", "packet", 42));
/// ```
pub fn to_format(r: &Registration) -> EventFormat {
    hyptrace_reader::registry::event_format((&r.system, &r.name, r.id), &r.fields, &r.print_fmt)
}

/// What the guest registered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registered {
    /// The formats of the accepted events (all enabled).
    pub formats: Vec<EventFormat>,
    /// The entries rejected (each with its reason); the others work.
    pub rejected: Vec<Rejection>,
}

/// Why no events were registered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// The guest's table was refused as a whole.
    #[error("the guest's event registration table was refused")]
    Refused(#[source] TableError),
    /// The pack has no registration table (`RingGeometry::with_events` was not used).
    #[error("the trace region has no event registration table")]
    NoTable,
    /// No registration came within the wait; a later one is refused (the output was
    /// opened without its formats).
    #[error("the guest registered no events within {0:?}")]
    TimedOut(Duration),
}

#[derive(Debug)]
enum State {
    Waiting { early: u32 },
    Done(Result<Registered, RegisterError>),
}

/// Answers the guest's registration exit (`PORT_REGISTER`) on a vCPU thread, and hands
/// the formats to the thread that opens the output ([`Events::wait`]). Share it in an
/// `Arc`. Only the first table is answered; an exit after [`Events::wait`] gave up is
/// refused, so the guest never writes events whose formats are nowhere.
#[derive(Debug)]
pub struct Events<M> {
    mem: M,
    geometry: RingGeometry,
    state: Mutex<State>,
    cv: Condvar,
}

impl<M: SharedMem> Events<M> {
    /// The registration of the rings `geometry` describes in `mem`.
    pub fn new(mem: M, geometry: RingGeometry) -> Self {
        Self {
            mem,
            geometry,
            state: Mutex::new(State::Waiting { early: 0 }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The registration exit of `vcpu`: reads and validates the table (bounded), enables
    /// every accepted event on every CPU, writes the answer. Call it before resuming the
    /// vCPU. Bounded work whatever the guest wrote.
    pub fn on_register(&self, vcpu: u32) {
        let mut st = self.lock();
        let early = match &*st {
            State::Waiting { early } => *early,
            State::Done(Err(RegisterError::TimedOut(_))) => {
                log::warn!("vcpu {vcpu}: registration after the output was opened: refused");
                refuse(&self.mem, &self.geometry);
                return;
            }
            State::Done(_) => return,
        };
        let done = match read_table(&self.mem, &self.geometry) {
            Ok(None) => Err(RegisterError::NoTable),
            Err(TableError::NotReady(s)) if early + 1 < MAX_EARLY_EXITS => {
                log::warn!("vcpu {vcpu}: registration exit with the table in state {s}");
                *st = State::Waiting { early: early + 1 };
                return;
            }
            Err(e) => {
                refuse(&self.mem, &self.geometry);
                Err(RegisterError::Refused(e))
            }
            Ok(Some(reg)) => {
                // Exactly the accepted events' bits, on every CPU (clear, then set).
                let mask = reg.events.iter().fold(0u64, |m, e| m | bit(e.slot));
                for cpu in 0..self.geometry.nr_cpus {
                    let word = self.geometry.ctl(cpu) + ctl::ENABLE;
                    self.mem.fetch_and(word, mask, SeqCst);
                    self.mem.fetch_or(word, mask, SeqCst);
                }
                answer(&self.mem, &self.geometry, &reg);
                Ok(Registered {
                    formats: reg.events.iter().map(to_format).collect(),
                    rejected: reg.rejected,
                })
            }
        };
        *st = State::Done(done);
        self.cv.notify_all();
    }

    /// Waits up to `timeout` for the registration; on timeout, later registrations are
    /// refused.
    pub fn wait(&self, timeout: Duration) -> Result<Registered, RegisterError> {
        let until = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            if let State::Done(r) = &*st {
                return r.clone();
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                *st = State::Done(Err(RegisterError::TimedOut(timeout)));
                return Err(RegisterError::TimedOut(timeout));
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// The enable bit of `slot` (0 for a slot past the word: never enabled).
fn bit(slot: u32) -> u64 {
    1u64.checked_shl(slot).unwrap_or(0)
}

#[cfg(test)]
mod tests {
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
        ev.on_register(0);
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
        ev.on_register(1);
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
        ev.on_register(0);
        assert_eq!(m.load(l.events_off + STATE_OFF, Acquire), STATE_REFUSED);
        assert_eq!(m.load(l.ctl(0) + ctl::ENABLE, Acquire), 0);

        let (m, l) = region();
        let ev = Events::new(m.clone(), l);
        for _ in 0..MAX_EARLY_EXITS {
            ev.on_register(0);
        }
        assert!(matches!(
            ev.wait(Duration::ZERO),
            Err(RegisterError::Refused(TableError::NotReady(_)))
        ));
    }
}
