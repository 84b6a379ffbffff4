//! The guest's registered events in the CLI: [`EventTable`] is the engine's one
//! registration state machine ([`hyptrace_embed::Events`]: the answer to the
//! registration exit, the wait for it, L1, the enable bits) with the CLI's policy on top —
//! the command line's selection (`-e`, `--disable`), the host TSC of the answer for the
//! report, the vCPU threads' [`RegisterHook`]; the `--control` socket calls
//! [`Events::enable`], [`Events::disable`] and [`Events::list`] through it. Also the
//! formats a trace memory file's table gives ([`region_formats`]).

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::SharedMem;
use hyptrace_embed::{Events, Exit};
use hyptrace_output::EventFormat;
use hyptrace_reader::registry::TableError;

pub use hyptrace_embed::{
    matches, to_format, EventInfo, EventsError, LateRegistration, Selection, Settled,
    ANSWER_HOLD_MAX,
};

/// The registration table of a run: the engine's [`Events`] (every method through
/// `Deref`) and the host TSC of its answer.
pub struct EventTable<M> {
    events: Events<M>,
    /// Host TSC when the registration was answered (0: not answered).
    answered_tsc: AtomicU64,
}

impl<M> std::fmt::Debug for EventTable<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventTable").finish_non_exhaustive()
    }
}

impl<M> std::ops::Deref for EventTable<M> {
    type Target = Events<M>;
    fn deref(&self) -> &Events<M> {
        &self.events
    }
}

/// What a vCPU thread calls when the guest writes to
/// [`hyptrace_abi::registry::PORT_REGISTER`].
pub trait RegisterHook: Send + Sync {
    /// Answers the registration (synchronously: the vCPU resumes after this returns).
    fn on_register(&self, vcpu: u32);

    /// The VM is stopping ([`crate::vmm::vm::RunningVm::stop`]): a vCPU waiting in
    /// [`RegisterHook::on_register`] must not keep it from ending (a held answer is
    /// released), whatever the order in which the caller drops what it holds.
    fn on_stop(&self) {}
}

impl<M: SharedMem + Send + Sync> RegisterHook for EventTable<M> {
    fn on_register(&self, vcpu: u32) {
        self.register(vcpu);
    }

    fn on_stop(&self) {
        self.release_answers();
    }
}

impl<M: SharedMem> EventTable<M> {
    /// The table of the region `mem` laid out as `geometry` (the host's, not the pack's),
    /// answered with `selection`.
    pub fn new(mem: M, geometry: RingGeometry, selection: Selection) -> Self {
        Self {
            events: Events::with_selection(mem, geometry, selection),
            answered_tsc: AtomicU64::new(0),
        }
    }

    /// Host TSC when the guest's registration was answered, if it was: the guest writes
    /// no event before (its workload starts there, [`crate::pipeline::report::Timing::workload_start`]).
    pub fn answered_tsc(&self) -> Option<u64> {
        Some(self.answered_tsc.load(SeqCst)).filter(|&t| t != 0)
    }

    /// The registration exit ([`Events::on_register`]), the answer's host TSC noted
    /// before the vCPU resumes.
    pub fn register(&self, vcpu: u32) -> Exit {
        let exit = self.events.on_register(vcpu);
        if exit == Exit::Answered {
            self.answered_tsc
                .store(crate::vmm::time::host_tsc(), SeqCst);
        }
        exit
    }
}

/// Why a region's registration table gives no formats ([`region_formats`]).
#[derive(Debug, thiserror::Error)]
pub enum RegionTableError {
    /// The table is shorter than its header.
    #[error("too short")]
    TooShort,
    /// The host never answered it.
    #[error("state {0}: never answered")]
    NeverAnswered(u64),
    /// Its contents do not parse.
    #[error(transparent)]
    Table(#[from] TableError),
}

/// The formats of the events the guest registered, rebuilt from the region's
/// registration table as the host accepted it (`None`: the pack has no table; the
/// built-in formats apply). The table is hostile: parsed from a private copy.
pub fn region_formats<M: SharedMem + ?Sized>(
    mem: &M,
    l: &RingGeometry,
) -> Result<Option<Vec<EventFormat>>, RegionTableError> {
    use hyptrace_abi::registry::{MAX_TABLE_SIZE, STATE_DONE, STATE_OFF, STATE_READY};
    if l.events_size == 0 {
        return Ok(None);
    }
    let mut bytes = vec![0u8; l.events_size.min(MAX_TABLE_SIZE)];
    mem.read_bytes(l.events_off, &mut bytes);
    let Some(state) = bytes.get_mut(STATE_OFF..STATE_OFF + 8) else {
        return Err(RegionTableError::TooShort);
    };
    let st = u64::from_le_bytes(state.try_into().unwrap_or([0; 8]));
    if st != STATE_DONE && st != STATE_READY {
        return Err(RegionTableError::NeverAnswered(st));
    }
    // The host answered this table (DONE): parse it as it was when READY.
    state.copy_from_slice(&STATE_READY.to_le_bytes());
    let reg = hyptrace_reader::registry::parse_table(&bytes)?;
    Ok(Some(reg.events.iter().map(to_format).collect()))
}

/// An [`EventTable`] over a VM's trace region, shared with the vCPU threads.
pub type VmEventTable = Arc<EventTable<Arc<crate::vmm::guest_mem::GuestTraceMem>>>;

/// The registration cases the embed library's path runs too (one table for both).
#[cfg(test)]
#[path = "../../../crates/embed/tests/support/registration_cases.rs"]
mod registration_cases;

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_abi::layout::ctl;
    use hyptrace_abi::layout::Mode;
    use hyptrace_abi::registry::DEFAULT_TABLE_SIZE;
    use hyptrace_abi::HeapMem;
    use hyptrace_embed::MAX_EARLY_EXITS;
    use hyptrace_writer::events::{
        read_answer, wait_registered, write_table, Event, Field as WField, RegisterError,
    };
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::{Duration, Instant};

    static F: &[WField<'static>] = &[WField {
        name: "v",
        ctype: "u64",
        offset: 8,
        size: 8,
        signed: false,
    }];

    fn region() -> (Arc<HeapMem>, RingGeometry) {
        let l = RingGeometry::new(2, 3, 4096, Mode::Stop, false)
            .unwrap()
            .with_events(DEFAULT_TABLE_SIZE)
            .unwrap();
        let m = Arc::new(HeapMem::new(l.region_size));
        l.init_region(&*m, 0, 1);
        (m, l)
    }

    fn word(m: &HeapMem, l: &RingGeometry, cpu: u32) -> u64 {
        m.load(l.ctl(cpu) + ctl::ENABLE, Relaxed)
    }

    /// The registration answer sets exactly the selected bits on every CPU; enable and
    /// disable flip one event's bit with the others kept; unknown names are errors.
    #[test]
    fn selection_and_flips() {
        static A: Event<'static> = Event::new("g", "a", F, "\"%llu\", REC->v", 16, 0, 0);
        static B: Event<'static> = Event::new("g", "b", F, "\"%llu\", REC->v", 16, 5, 0);
        static C: Event<'static> = Event::new("h", "c", F, "\"%llu\", REC->v", 16, 9, 0);
        let (m, l) = region();
        let evs = [&A, &B, &C];
        write_table(&*m, &evs).unwrap();
        let sel = Selection {
            enable: vec!["g:*".into()],
            disable: vec!["b".into()],
        };
        let t = EventTable::new(m.clone(), l, sel);
        assert_eq!(t.enable("a"), Err(EventsError::NotRegistered));
        t.register(0);
        assert_eq!(read_answer(&*m, &evs), Ok(3));
        assert_eq!((word(&m, &l, 0), word(&m, &l, 1)), (1, 1));
        assert_eq!(t.enable("h:c").unwrap(), ["h:c"]);
        assert_eq!((word(&m, &l, 0), word(&m, &l, 1)), (1 | 1 << 9, 1 | 1 << 9));
        assert_eq!(t.disable("a").unwrap(), ["g:a"]);
        assert_eq!(word(&m, &l, 1), 1 << 9);
        let e = t.enable("nope").unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown event \"nope\" (the guest registered: g:a, g:b, h:c)"
        );
        let list = t.list().unwrap();
        let on: Vec<(String, bool)> = list
            .iter()
            .map(|i| (i.reg.full_name(), i.enabled))
            .collect();
        assert_eq!(
            on,
            [
                ("g:a".into(), false),
                ("g:b".into(), false),
                ("h:c".into(), true)
            ]
        );
        assert_eq!(
            list[0].describe(),
            "g:a\n\tfield:u64 v;\toffset:8;\tsize:8;\tsigned:0;\n"
        );
        assert_eq!(
            t.formats()[2].to_format_text(),
            to_format(&list[2].reg).to_format_text()
        );
        // A second exit changes nothing.
        t.register(0);
        assert_eq!(word(&m, &l, 0), 1 << 9);
    }

    static HELD: Event<'static> = Event::new("g", "a", F, "\"%llu\", REC->v", 16, 0, 0);

    /// A table of one event, its answer held, vCPU 0's exit waiting in a thread, and the
    /// run's settle seen to end with the registration.
    fn held_exit() -> (
        Arc<HeapMem>,
        Arc<EventTable<Arc<HeapMem>>>,
        std::thread::JoinHandle<Exit>,
    ) {
        let (m, l) = region();
        write_table(&*m, &[&HELD]).unwrap();
        let t = Arc::new(EventTable::new(m.clone(), l, Selection::default()));
        t.hold_answers();
        let exit = {
            let t = Arc::clone(&t);
            std::thread::spawn(move || t.register(0))
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        assert_eq!(
            t.settle(Duration::from_millis(1), || Instant::now() > deadline),
            Settled::Registered
        );
        (m, t, exit)
    }

    /// A held answer: the registering exit waits, the run meanwhile sees the
    /// registration (settle, formats) while the guest's table is not answered yet; the
    /// release answers it and ends the exit. Unheld, the exit answers at once.
    #[test]
    fn a_held_answer_waits_for_the_release() {
        let (m, t, exit) = held_exit();
        assert_eq!(t.formats().len(), 1);
        // The guest's view: no answer yet, however long the exit is held.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!exit.is_finished(), "the exit returned before the release");
        assert_eq!(
            wait_registered(&*m, &[&HELD], 10),
            Err(RegisterError::NotAnswered)
        );
        t.release_answers();
        exit.join().expect("exit thread");
        assert_eq!(read_answer(&*m, &[&HELD]), Ok(1));
        // Not held: answered during the exit.
        let (m, l) = region();
        write_table(&*m, &[&HELD]).unwrap();
        let t = EventTable::new(m.clone(), l, Selection::default());
        t.register(0);
        assert_eq!(read_answer(&*m, &[&HELD]), Ok(1));
    }

    /// A VM stopped while vCPU 0's answer is held (an early return of the run: a bad
    /// `-e`, a failed output) ends the held exit at once: `RunningVm::stop` calls
    /// `on_stop`, so joining the vCPU never waits out the hold (review, issue 38).
    #[test]
    fn stopping_releases_a_held_answer() {
        let (_m, t, exit) = held_exit();
        RegisterHook::on_stop(&*t);
        // Well within the hold: without `on_stop` the exit would return only after it.
        let bound = Instant::now() + hyptrace_embed::ANSWER_HOLD_MAX / 2;
        while !exit.is_finished() {
            assert!(Instant::now() < bound, "the held exit outlived the stop");
            std::thread::sleep(Duration::from_millis(1));
        }
        exit.join().expect("exit thread");
    }

    #[test]
    fn unknown_selection_enables_nothing_and_is_reported() {
        static A: Event<'static> = Event::new("g", "a", F, "\"%llu\", REC->v", 16, 0, 0);
        let (m, l) = region();
        write_table(&*m, &[&A]).unwrap();
        let t = EventTable::new(
            m.clone(),
            l,
            Selection {
                enable: vec!["g:zz".into()],
                disable: vec![],
            },
        );
        t.register(0);
        assert_eq!(word(&m, &l, 0), 0);
        assert!(matches!(
            t.selection_error(),
            Some(EventsError::Unknown { .. })
        ));
        assert_eq!(
            t.settle(Duration::from_millis(1), || false),
            Settled::Registered
        );
    }

    #[test]
    fn early_exits_and_bad_headers_refuse_the_table() {
        let (m, l) = region();
        let t = EventTable::new(m.clone(), l, Selection::default());
        for _ in 0..MAX_EARLY_EXITS - 1 {
            t.register(0);
        }
        let state = || m.load(l.events_off + 8, Relaxed);
        assert_ne!(state(), hyptrace_abi::registry::STATE_REFUSED);
        t.register(0);
        assert!(matches!(
            t.settle(Duration::from_millis(1), || false),
            Settled::Refused(_)
        ));
        // A ready table with a bad version: refused, state REFUSED for the guest.
        let (m, l) = region();
        m.store(l.events_off, hyptrace_abi::registry::TABLE_MAGIC, Relaxed);
        m.store(l.events_off + 16, 9, Relaxed);
        m.store(
            l.events_off + 8,
            hyptrace_abi::registry::STATE_READY,
            Relaxed,
        );
        let t = EventTable::new(m.clone(), l, Selection::default());
        t.register(0);
        assert!(matches!(
            t.settle(Duration::from_millis(1), || false),
            Settled::Refused(e) if crate::exit::chain(&e).contains("version 9")
        ));
        assert_eq!(
            m.load(l.events_off + 8, Relaxed),
            hyptrace_abi::registry::STATE_REFUSED
        );
    }

    /// Attached writers that write nothing do not end the wait (no grace period): only
    /// the caller does. A registration after the run went on without one is refused to
    /// the guest and kept for the run's exit (L1), the formats stay empty; a write without
    /// a registration ends the wait at once, the caller not asked.
    #[test]
    fn a_registration_after_the_run_went_on_without_one_is_refused() {
        static A: Event<'static> = Event::new("g", "a", F, "\"%llu\", REC->v", 16, 0, 0);
        let (m, l) = region();
        for cpu in 0..2 {
            m.store(l.ctl(cpu) + ctl::WRITER_STATE, 1, Relaxed);
        }
        let t = EventTable::new(m.clone(), l, Selection::default());
        let mut polls = 0;
        let settled = t.settle(Duration::ZERO, || {
            polls += 1;
            polls == 100
        });
        assert_eq!((settled, polls), (Settled::None, 100));
        write_table(&*m, &[&A]).unwrap();
        t.register(1);
        assert_eq!(read_answer(&*m, &[&A]), Err(RegisterError::Refused));
        assert!(t.formats().is_empty() && t.list().is_err());
        let late = t.late_registration().expect("late registration kept");
        assert_eq!((late.vcpu, late.why), (1, Settled::None.why()));
        assert!(
            late.to_string()
                .starts_with("vcpu 1 registered its events ")
                && late
                    .to_string()
                    .contains(" ms after the run started without them ("),
            "{late}"
        );
        // A settled table stays settled.
        assert_eq!(t.settle(Duration::ZERO, || true), Settled::None);

        let (m, l) = region();
        m.store(l.ctl(1) + ctl::ENTRIES, 1, Relaxed);
        let t = EventTable::new(m.clone(), l, Selection::default());
        let settled = t.settle(Duration::ZERO, || panic!("asked to give up"));
        assert_eq!(settled, Settled::Unregistered);
        write_table(&*m, &[&A]).unwrap();
        t.register(0);
        assert_eq!(read_answer(&*m, &[&A]), Err(RegisterError::Refused));
        let late = t.late_registration().expect("late registration kept");
        assert_eq!((late.vcpu, late.why), (0, Settled::Unregistered.why()));
    }

    /// The CLI's path as its vCPU threads (`RegisterHook::on_register`) and its run
    /// pipeline (`EventTable::settle`, giving up when told) drive it.
    struct Cli(Arc<EventTable<Arc<HeapMem>>>);

    impl super::registration_cases::RegistrationPath for Cli {
        fn new(mem: Arc<HeapMem>, geometry: RingGeometry) -> Self {
            Self(Arc::new(EventTable::new(
                mem,
                geometry,
                Selection::default(),
            )))
        }
        fn exit(&self, vcpu: u32) {
            let hook: Arc<dyn RegisterHook> = self.0.clone();
            hook.on_register(vcpu);
        }
        fn settle(&self) -> super::registration_cases::Outcome {
            use super::registration_cases::Outcome;
            match self.0.settle(Duration::ZERO, || true) {
                Settled::Registered => Outcome::Registered(self.0.formats().len()),
                Settled::Refused(_) => Outcome::Refused,
                Settled::NoTable => Outcome::NoTable,
                Settled::Unregistered => Outcome::Unregistered,
                Settled::None => Outcome::GaveUp,
            }
        }
        fn late(&self) -> Option<u32> {
            self.0.late_registration().map(|l| l.vcpu)
        }
        fn formats(&self) -> usize {
            self.0.formats().len()
        }
    }

    /// The CLI answers every shared registration case as the embed library does
    /// (crates/embed/tests/registration.rs runs the same table).
    #[test]
    fn cli_registration_runs_the_shared_cases() {
        super::registration_cases::run_cases::<Cli>();
    }
}
