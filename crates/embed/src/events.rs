//! The guest's event registration on the host — the one state machine every VMM runs
//! (the `hyptrace` CLI's `EventTable` is this with its policy on top): the answer to the
//! registration exit (validation in [`hyptrace_reader::registry`], ids, the enable bits
//! of a [`Selection`]), the wait for it before the output opens ([`Events::settle`],
//! [`Events::wait`]), a late registration refused (L1), their trace-event formats, and
//! enabling / disabling events while the guest runs.
//!
//! Enable bits live in every CPU's control block (`ctl::ENABLE`, host-owned): the host
//! changes them only with atomic `fetch_or` / `fetch_and`, so the other bits stay; the
//! writer loads the word once per event and counts a disabled event as skipped (E1).

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyptrace_abi::layout::{ctl, RingGeometry};
use hyptrace_abi::SharedMem;
use hyptrace_output::EventFormat;
use hyptrace_reader::registry::{
    answer, read_table, refuse, Registration, Registry, Rejection, TableError,
};

use crate::select::{bit, mask_of, EventInfo, EventsError, Selection};

/// Registration exits with the table not ready a guest may make before the table counts
/// as refused (each costs a bounded look at one word).
pub const MAX_EARLY_EXITS: u32 = 16;

/// Longest a registration's answer is held for the VMM to get ready to read
/// ([`Events::hold_answers`]); past it the guest goes on regardless.
pub const ANSWER_HOLD_MAX: Duration = Duration::from_secs(10);

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

/// What the guest registered, as [`Events::wait`] returns it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Registered {
    /// The formats of the accepted events.
    pub formats: Vec<EventFormat>,
    /// The entries rejected (each with its reason); the others work.
    pub rejected: Vec<Rejection>,
}

/// Why [`Events::wait`] has no registered events.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// The guest's table was refused as a whole (a bad header, or never ready within
    /// [`MAX_EARLY_EXITS`] registration exits).
    #[error("the guest's event registration table was refused")]
    Refused(#[source] TableError),
    /// The pack has no registration table (`RingGeometry::with_events` was not used).
    #[error("the trace region has no event registration table")]
    NoTable,
    /// A vCPU wrote an event before any registration: the guest registers nothing (by
    /// the handshake no vCPU writes before the answer); a later one is refused.
    #[error("a vCPU wrote an event before the guest registered any")]
    Unregistered,
    /// No registration came within the wait; a later one is refused (the output was
    /// opened without its formats).
    #[error("the guest registered no events within {0:?}")]
    TimedOut(Duration),
}

/// How the wait for the registration ended ([`Events::settle`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settled {
    /// The guest registered (some entries may have been rejected).
    Registered,
    /// The guest's table was refused as a whole.
    Refused(TableError),
    /// The pack has no registration table: nothing to wait for (the guest uses its
    /// requested ids, the output has no formats for them).
    NoTable,
    /// The guest registers nothing: a writer took in an event without a registration
    /// (by the handshake no vCPU writes before the answer).
    Unregistered,
    /// The caller gave up waiting (in the CLI: vCPU 0 ended, a signal, `--duration`,
    /// `--hang-timeout`; in [`Events::wait`]: its timeout).
    None,
}

impl Settled {
    /// Why a run went on without a registration, for [`LateRegistration`].
    /// # Examples
    ///
    /// ```
    /// use hyptrace_embed::Settled;
    /// assert!(Settled::Unregistered.why().contains("before any registration"));
    /// ```
    pub fn why(&self) -> &'static str {
        match self {
            Self::Unregistered => "a vCPU had written an event before any registration",
            _ => "the run had stopped waiting for it: vcpu 0 ended, a signal, --duration or --hang-timeout",
        }
    }
}

/// A registration exit that came after the run had gone on without one (L1): it was
/// answered REFUSED, and the run should fail naming it (the CLI: exit 1).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "vcpu {vcpu} registered its events {} ms after the run started without them ({why}): \
     the registration was refused, the output has no formats for them",
    after.as_millis()
)]
pub struct LateRegistration {
    /// The vCPU that made the registration exit.
    pub vcpu: u32,
    /// How long after the run went on without a registration.
    pub after: Duration,
    /// Why the run had gone on without one.
    pub why: &'static str,
}

/// What one registration exit did ([`Events::on_register`]); the vCPU resumes after it
/// either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// The table was taken in and answered (DONE): the guest writes from now on.
    Answered,
    /// The table is not ready yet (fewer than [`MAX_EARLY_EXITS`] such exits): nothing
    /// written, a later exit may be answered.
    NotReady,
    /// The table was refused as a whole (REFUSED).
    Refused,
    /// The run had gone on without a registration: refused (REFUSED) and kept as a
    /// [`LateRegistration`] (L1).
    Late,
    /// The pack has no table: nothing to answer, nothing let in.
    NoTable,
    /// The registration was already answered or refused: nothing changed.
    Ignored,
}

/// What the registration exit handler knows.
#[derive(Debug)]
enum State {
    /// No answered registration yet; `early` exits found the table not ready.
    Waiting { early: u32 },
    /// The table was answered.
    Registered {
        reg: Registry,
        /// The selection named an unknown event: nothing is enabled, the run must stop.
        error: Option<EventsError>,
    },
    /// The table was refused as a whole.
    Refused(TableError),
    /// The run went on without a registration ([`Events::settle`] returned `settled`,
    /// at `since`): its output has no formats, so a later registration is refused and
    /// kept as `late` (L1).
    Closed {
        settled: Settled,
        since: Instant,
        late: Option<LateRegistration>,
    },
}

/// What [`Events::settle`] makes of the state (L1), given whether the pack has no table,
/// whether a writer took in an event (`wrote`) and whether the caller gives up
/// (`gave_up`); `None`: wait on. Nothing here depends on wall time: the wait ends on
/// what the vCPUs do (vCPU 0 registers or ends, a writer writes) or on the caller.
fn decide(st: &State, no_table: bool, wrote: bool, gave_up: bool) -> Option<Settled> {
    match st {
        State::Registered { .. } => Some(Settled::Registered),
        State::Refused(e) => Some(Settled::Refused(e.clone())),
        State::Closed { settled, .. } => Some(settled.clone()),
        State::Waiting { .. } if no_table => Some(Settled::NoTable),
        State::Waiting { .. } if wrote => Some(Settled::Unregistered),
        State::Waiting { .. } if gave_up => Some(Settled::None),
        State::Waiting { .. } => None,
    }
}

/// The guest's event registration: answers its registration exit on a vCPU thread
/// ([`Events::on_register`]) and hands the formats to the thread that opens the output
/// ([`Events::wait`], or [`Events::settle`] with the caller's own end of the wait).
/// Share it in an `Arc`. Only the first ready table is answered; an exit after the wait
/// ended without a registration is refused and kept ([`Events::late_registration`]),
/// so the guest never writes events whose formats are nowhere (L1).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
/// use hyptrace_embed::{Events, Exit, RegisterError};
///
/// let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
/// let mem = HeapMem::new(geometry.region_size);
/// geometry.init_region(&mem, 0, 1);
/// let events = Events::new(&mem, geometry);
/// assert_eq!(events.on_register(0), Exit::NotReady); // the guest has written no table
/// assert_eq!(events.wait(Duration::ZERO), Err(RegisterError::TimedOut(Duration::ZERO)));
/// assert_eq!(events.on_register(0), Exit::Late); // refused: the output has no formats
/// assert_eq!(events.late_registration().map(|l| l.vcpu), Some(0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Events<M> {
    mem: M,
    geometry: RingGeometry,
    selection: Selection,
    state: Mutex<State>,
    cv: Condvar,
    /// Answers wait for [`Events::release_answers`] (see [`Events::hold_answers`]).
    held: AtomicBool,
    /// A registration exit without a table was logged (once: a guest that loops on
    /// the exit must not flood the log).
    told_no_table: AtomicBool,
}

impl<M: SharedMem> Events<M> {
    /// The registration of the rings `geometry` describes in `mem`, every valid event
    /// enabled.
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Arc::new(Events::new(mem.clone(), geometry)); // shared with the vCPU threads
    /// register(&events)?;
    /// assert_eq!(events.formats()[0].name, "tick");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(mem: M, geometry: RingGeometry) -> Self {
        Self::with_selection(mem, geometry, Selection::default())
    }

    /// [`Events::new`] enabling the events `selection` names (an unknown name enables
    /// nothing and is kept: [`Events::selection_error`]).
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::with_selection(mem.clone(), geometry, Selection {
    ///     enable: vec!["demo:*".into()],
    ///     disable: vec![],
    /// });
    /// register(&events)?; // the guest's registration exit
    /// assert!(events.list()?[0].enabled);
    /// assert!(events.selection_error().is_none());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_selection(mem: M, geometry: RingGeometry, selection: Selection) -> Self {
        Self {
            mem,
            geometry,
            selection,
            state: Mutex::new(State::Waiting { early: 0 }),
            cv: Condvar::new(),
            held: AtomicBool::new(false),
            told_no_table: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now on a registration is answered only once [`Events::release_answers`] is
    /// called (or [`ANSWER_HOLD_MAX`] passed): the registering vCPU waits in its exit,
    /// the others for the answer in the table, so no guest writes an event before the
    /// VMM reads — its output open, its drain loop about to start. The formats are known
    /// before the answer (the table is read and checked first), so the output can open
    /// meanwhile.
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let _register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Arc::new(Events::new(mem.clone(), geometry));
    /// events.hold_answers(); // before the vCPUs start
    /// let (e, m) = (events.clone(), mem.clone());
    /// let vcpu = std::thread::spawn(move || {
    ///     // The guest writes its table and rings; the exit waits for the release.
    ///     let mut exit = Exit::NotReady;
    ///     hyptrace_writer::events::register(&*m, &[Tick::event()], || exit = e.on_register(0))
    ///         .map(|_| exit)
    /// });
    /// // ... open the output with the formats, start the drain loop ...
    /// events.release_answers();
    /// assert_eq!(vcpu.join().expect("vcpu")?, Exit::Answered);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn hold_answers(&self) {
        self.held.store(true, SeqCst);
    }

    /// Answers a registration held by [`Events::hold_answers`], and every later one at
    /// once.
    /// # Examples
    ///
    /// See [`Events::hold_answers`].
    pub fn release_answers(&self) {
        let _st = self.lock();
        self.held.store(false, SeqCst);
        self.cv.notify_all();
    }

    /// The registration exit of `vcpu`: reads and validates the table (bounded),
    /// assigns ids, sets every CPU's enable bits to the selected accepted events, writes
    /// the answer (DONE last). Call it on the vCPU's thread before resuming the vCPU.
    /// Only the first ready table is answered; later exits change nothing; an exit after
    /// the wait ended without a registration is answered REFUSED and kept (L1). Bounded
    /// work whatever the guest wrote (the hold aside: [`ANSWER_HOLD_MAX`]).
    /// # Examples
    ///
    /// In a KVM VMM, on the vCPU thread: `match doorbell.ring(access) { Some(Ring::Register) => { events.on_register(vcpu_id); } ... }`, then resume the vCPU.
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// assert_eq!(events.on_register(0), Exit::NotReady); // no table written yet
    /// register(&events)?; // the guest writes its table, then rings: on_register(0)
    /// assert_eq!(events.on_register(0), Exit::Ignored); // answered: later exits change nothing
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_register(&self, vcpu: u32) -> Exit {
        if self.geometry.events_size == 0 {
            if !self.told_no_table.swap(true, SeqCst) {
                log::warn!("vcpu {vcpu}: registration exit, but the region has no table");
            }
            return Exit::NoTable;
        }
        let mut st = self.lock();
        let early = match &mut *st {
            State::Waiting { early } => *early,
            State::Closed {
                settled,
                since,
                late,
            } => {
                // L1: the output was opened without formats; answering now would let
                // the guest write events whose formats are nowhere.
                refuse(&self.mem, &self.geometry);
                let l = LateRegistration {
                    vcpu,
                    after: since.elapsed(),
                    why: settled.why(),
                };
                // Logged once (the first is kept); a guest that loops on the exit gets
                // the same answer without flooding the log.
                match late {
                    None => log::warn!("{l}"),
                    Some(_) => log::debug!("{l}"),
                }
                late.get_or_insert(l);
                return Exit::Late;
            }
            State::Registered { .. } | State::Refused(_) => {
                log::debug!("vcpu {vcpu}: registration exit after the answer: ignored");
                return Exit::Ignored;
            }
        };
        let refused = match read_table(&self.mem, &self.geometry) {
            Ok(None) => return Exit::NoTable,
            Ok(Some(reg)) => return self.take_in(st, vcpu, reg),
            Err(TableError::NotReady(s)) if early + 1 < MAX_EARLY_EXITS => {
                log::warn!("vcpu {vcpu}: registration exit with the table in state {s}");
                *st = State::Waiting { early: early + 1 };
                return Exit::NotReady;
            }
            Err(e) => e,
        };
        log::warn!("vcpu {vcpu}: the registration table was refused: {refused}");
        refuse(&self.mem, &self.geometry);
        *st = State::Refused(refused);
        self.cv.notify_all();
        Exit::Refused
    }

    /// Takes in a valid table: enable bits, the state, then (after the hold) the answer.
    fn take_in(&self, mut st: MutexGuard<'_, State>, vcpu: u32, reg: Registry) -> Exit {
        for r in &reg.rejected {
            log::warn!("{r}");
        }
        let (mask, error) = match self.selection.mask(&reg) {
            Ok(mask) => (mask, None),
            Err(e) => (0, Some(e)),
        };
        self.set_word(mask);
        log::info!(
            "registered {} events ({} rejected), enable mask {mask:#x}",
            reg.events.len(),
            reg.rejected.len()
        );
        *st = State::Registered { reg, error };
        self.cv.notify_all();
        let held = Instant::now();
        st = self
            .cv
            .wait_timeout_while(st, ANSWER_HOLD_MAX, |_| self.held.load(SeqCst))
            .unwrap_or_else(|e| e.into_inner())
            .0;
        if let State::Registered { reg, .. } = &*st {
            answer(&self.mem, &self.geometry, reg);
        }
        log::debug!(
            "vcpu {vcpu}: registration answered after {:.3} ms",
            held.elapsed().as_secs_f64() * 1e3
        );
        Exit::Answered
    }

    /// Sets every CPU's enable word to `mask` with atomic RMWs (clears, then sets) (E1).
    /// SeqCst like every host-side flip: the word pairs with no other access (the writer
    /// loads it Relaxed; an event racing a flip may go either way).
    fn set_word(&self, mask: u64) {
        for cpu in 0..self.geometry.nr_cpus {
            let w = self.geometry.ctl(cpu) + ctl::ENABLE;
            self.mem.fetch_and(w, mask, SeqCst);
            self.mem.fetch_or(w, mask, SeqCst);
        }
    }

    /// Whether some CPU's writer took in an event (committed or dropped). By the
    /// handshake no vCPU does before the registration is answered (docs/abi.md), so one
    /// that did means the guest registers nothing. (An attached writer alone means
    /// nothing: the SDKs attach first, then register or wait for the registration.)
    fn writer_wrote(&self) -> bool {
        (0..self.geometry.nr_cpus)
            .any(|c| hyptrace_reader::ctl_writer_index(&self.mem, &self.geometry, c) != 0)
    }

    /// Waits until the guest's registration is answered or refused, the pack shows
    /// there is nothing to wait for ([`Settled::NoTable`]), the guest shows it registers
    /// nothing ([`Settled::Unregistered`]), or `give_up()` says so, checking every
    /// `step`. No fixed grace: by the SDK protocol vCPU 0 registers and the others wait
    /// for the answer, however late vCPU 0 starts. A wait that ends without a
    /// registration closes the table (L1): a later registration exit is refused
    /// ([`Events::late_registration`]). A settled table stays settled.
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// register(&events)?;
    /// let settled = events.settle(Duration::from_millis(1), || false /* vCPU 0 ended, a signal... */);
    /// assert_eq!(settled, hyptrace_embed::Settled::Registered);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn settle(&self, step: Duration, mut give_up: impl FnMut() -> bool) -> Settled {
        let no_table = self.geometry.events_size == 0;
        let mut st = self.lock();
        loop {
            let waiting = matches!(*st, State::Waiting { .. });
            let wrote = waiting && !no_table && self.writer_wrote();
            let gave_up = waiting && !no_table && !wrote && give_up();
            if let Some(settled) = decide(&st, no_table, wrote, gave_up) {
                if waiting {
                    *st = State::Closed {
                        settled: settled.clone(),
                        since: Instant::now(),
                        late: None,
                    };
                }
                return settled;
            }
            st = self
                .cv
                .wait_timeout(st, step)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// [`Events::settle`] giving up after `timeout`: the registered formats, or why
    /// there are none.
    ///
    /// # Errors
    ///
    /// [`RegisterError`]: the table was refused, the pack has none, the guest wrote
    /// without registering, or nothing came within `timeout` (a later registration is
    /// then refused: L1).
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// register(&events)?;
    /// let registered = events.wait(Duration::from_secs(10))?;
    /// assert_eq!((registered.formats.len(), registered.rejected.len()), (1, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn wait(&self, timeout: Duration) -> Result<Registered, RegisterError> {
        let until = Instant::now() + timeout;
        let step = Duration::from_millis(1);
        match self.settle(step, || Instant::now() >= until) {
            Settled::Registered => Ok(Registered {
                formats: self.formats(),
                rejected: self.rejections(),
            }),
            Settled::Refused(e) => Err(RegisterError::Refused(e)),
            Settled::NoTable => Err(RegisterError::NoTable),
            Settled::Unregistered => Err(RegisterError::Unregistered),
            Settled::None => Err(RegisterError::TimedOut(timeout)),
        }
    }

    /// The registration exit that came after the wait ended without one (L1), if any:
    /// the run should fail naming it.
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// assert!(events.wait(Duration::ZERO).is_err()); // the run goes on without formats
    /// assert!(register(&events).is_err()); // too late: the guest is answered REFUSED
    /// let late = events.late_registration().expect("kept");
    /// assert_eq!(late.vcpu, 0); // fail the run naming it
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn late_registration(&self) -> Option<LateRegistration> {
        match &*self.lock() {
            State::Closed { late, .. } => late.clone(),
            _ => None,
        }
    }

    /// What the guest registered (accepted and rejected entries).
    ///
    /// # Errors
    ///
    /// [`EventsError::NotRegistered`] before the registration, or without one.
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// assert!(events.registry().is_err()); // not yet
    /// register(&events)?;
    /// assert_eq!(events.registry()?.events.len(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn registry(&self) -> Result<Registry, EventsError> {
        match &*self.lock() {
            State::Registered { reg, .. } => Ok(reg.clone()),
            _ => Err(EventsError::NotRegistered),
        }
    }

    /// The accepted events (after the registration).
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// register(&events)?;
    /// let r = &events.registrations()[0];
    /// assert_eq!((r.system.as_str(), r.name.as_str()), ("demo", "tick"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn registrations(&self) -> Vec<Registration> {
        self.registry().map(|r| r.events).unwrap_or_default()
    }

    /// The rejected entries (after the registration).
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// register(&events)?;
    /// assert!(events.rejections().is_empty()); // every entry was valid
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rejections(&self) -> Vec<Rejection> {
        self.registry().map(|r| r.rejected).unwrap_or_default()
    }

    /// The selection error of the registration (a name no registered event has).
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::with_selection(mem.clone(), geometry, Selection {
    ///     enable: vec!["nosuch".into()],
    ///     disable: vec![],
    /// });
    /// register(&events)?;
    /// assert!(events.selection_error().is_some()); // fail the run, naming the pattern
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn selection_error(&self) -> Option<EventsError> {
        match &*self.lock() {
            State::Registered { error, .. } => error.clone(),
            _ => None,
        }
    }

    /// The formats of the accepted events (none before the registration).
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// assert!(events.formats().is_empty());
    /// register(&events)?;
    /// assert_eq!(events.formats()[0].system, "demo"); // for Tracer::trace_meta
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn formats(&self) -> Vec<EventFormat> {
        self.registrations().iter().map(to_format).collect()
    }

    /// Sets the enable bit of every event `pattern` matches, on every CPU (other bits
    /// stay); returns their names.
    ///
    /// # Errors
    ///
    /// [`EventsError::NotRegistered`] without a registration; [`EventsError::Unknown`]
    /// when `pattern` names no registered event.
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// register(&events)?;
    /// events.disable("tick")?;
    /// assert_eq!(events.enable("demo:*")?, ["demo:tick"]);
    /// assert!(events.enable("nosuch").is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn enable(&self, pattern: &str) -> Result<Vec<String>, EventsError> {
        self.flip(pattern, true)
    }

    /// Clears the enable bit of every event `pattern` matches, on every CPU (other bits
    /// stay); returns their names. The writer skips them from its next event on.
    ///
    /// # Errors
    ///
    /// As [`Events::enable`].
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// register(&events)?;
    /// assert_eq!(events.disable("tick")?, ["demo:tick"]);
    /// assert!(!events.list()?[0].enabled);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn disable(&self, pattern: &str) -> Result<Vec<String>, EventsError> {
        self.flip(pattern, false)
    }

    /// (E1) atomic RMW on every CPU's word, the other bits kept.
    fn flip(&self, pattern: &str, on: bool) -> Result<Vec<String>, EventsError> {
        let reg = self.registry()?;
        let mask = mask_of(&reg, pattern)?;
        for cpu in 0..self.geometry.nr_cpus {
            let w = self.geometry.ctl(cpu) + ctl::ENABLE;
            if on {
                self.mem.fetch_or(w, mask, SeqCst);
            } else {
                self.mem.fetch_and(w, !mask, SeqCst);
            }
        }
        Ok(reg
            .events
            .iter()
            .filter(|e| mask & bit(e.slot) != 0)
            .map(Registration::full_name)
            .collect())
    }

    /// The registered events with their state (enabled: the bit is set on every CPU).
    ///
    /// # Errors
    ///
    /// [`EventsError::NotRegistered`] without a registration.
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// register(&events)?;
    /// for e in events.list()? {
    ///     println!("{} {}", e.describe(), if e.enabled { "on" } else { "off" });
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn list(&self) -> Result<Vec<EventInfo>, EventsError> {
        let reg = self.registry()?;
        let words: Vec<u64> = (0..self.geometry.nr_cpus)
            .map(|c| self.mem.load(self.geometry.ctl(c) + ctl::ENABLE, Relaxed))
            .collect();
        Ok(reg
            .events
            .into_iter()
            .map(|r| EventInfo {
                enabled: words.iter().all(|w| w & bit(r.slot) != 0),
                reg: r,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests;
