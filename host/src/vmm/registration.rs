//! The guest's registered events on the host: the answer to its registration exit
//! (validation in [`hyptrace_reader::registry`], ids, the enable bits the command line
//! asks for), their trace-event formats, and enabling / disabling them while the guest
//! runs (`-e`, `--disable`; the `--control` socket calls [`EventTable::enable`],
//! [`EventTable::disable`] and [`EventTable::list`]).
//!
//! Enable bits live in every CPU's control block (`ctl::ENABLE`, host-owned): the host
//! changes them only with atomic `fetch_or` / `fetch_and`, so the other bits stay; the
//! writer loads the word once per event and counts a disabled event as skipped.

use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyptrace_abi::layout::{ctl, RingGeometry};
use hyptrace_abi::SharedMem;
use hyptrace_output::format::glob;
use hyptrace_output::EventFormat;
use hyptrace_reader::registry::{
    answer, read_table, refuse, RegField, Registration, Registry, Rejection, TableError,
};

/// Registration exits with the table not ready a guest may make before the table counts
/// as refused (each costs a bounded look at one word).
const MAX_EARLY_EXITS: u32 = 16;

/// Which events a run records: `-e PATTERN` (repeatable; none = every registered event)
/// then `--disable PATTERN` (repeatable).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// `-e` patterns; empty = all.
    pub enable: Vec<String>,
    /// `--disable` patterns.
    pub disable: Vec<String>,
}

/// Errors of event selection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventsError {
    /// A pattern matches no registered event.
    #[error("unknown event {pattern:?} (the guest registered: {known}){elsewhere}")]
    Unknown {
        /// The pattern.
        pattern: String,
        /// The registered events, comma-separated (or "none").
        known: String,
        /// Where the pattern names events instead, as the end of the message (`; ...`),
        /// or empty: `record`/`run` add the host kernel's
        /// ([`crate::cli::host_events::hint`]).
        elsewhere: String,
    },
    /// The guest has not registered its events (yet, or it never does).
    #[error("the guest has not registered any events")]
    NotRegistered,
}

/// One registered event, as `list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventInfo {
    /// The registration.
    pub reg: Registration,
    /// Whether its bit is set on every CPU.
    pub enabled: bool,
}

impl EventInfo {
    /// `system:name` and its fields, as `trace-cmd list -e -F` prints an event (the
    /// common fields left out).
    pub fn describe(&self) -> String {
        let mut s = format!("{}\n", self.reg.full_name());
        for f in &self.reg.fields {
            s.push_str(&format!(
                "\tfield:{};\toffset:{};\tsize:{};\tsigned:{};\n",
                decl(f),
                f.offset,
                f.size,
                u8::from(f.signed)
            ));
        }
        s
    }
}

fn decl(f: &RegField) -> String {
    let arr = f.ctype.ends_with(']') && !f.ctype.starts_with("__data_loc");
    match (arr, f.ctype.find('[')) {
        (true, Some(i)) => format!("{} {}{}", &f.ctype[..i], f.name, &f.ctype[i..]),
        _ => format!("{} {}", f.ctype, f.name),
    }
}

/// The trace-event format of a registered event ([`hyptrace_embed::to_format`]).
pub use hyptrace_embed::to_format;

/// Whether pattern `pat` names event `system:name`: `all`, `SYSTEM:EVENT` (globs in
/// either part), or a bare word that is the system or the event name (as trace-cmd's
/// `-e`).
pub fn matches(pat: &str, system: &str, name: &str) -> bool {
    if pat == "all" {
        return true;
    }
    match pat.split_once(':') {
        Some((s, n)) => glob(s, system) && glob(n, name),
        None => glob(pat, system) || glob(pat, name),
    }
}

/// What the registration exit handler knows.
#[derive(Debug, Default)]
enum State {
    /// No answered registration yet.
    #[default]
    Waiting,
    /// The table was answered.
    Registered {
        reg: Registry,
        /// The selection named an unknown event: nothing is enabled, the run must stop.
        error: Option<EventsError>,
    },
    /// The table's header was refused.
    Refused(String),
    /// The run went on without a registration ([`EventTable::settle`] returned
    /// `settled`, [`Settled::Unregistered`] or [`Settled::None`], at `since`): its output
    /// has no formats, so a later registration is refused and kept as `late` (L1).
    Closed {
        settled: Settled,
        since: Instant,
        late: Option<LateRegistration>,
    },
}

/// A registration exit that came after the run had gone on without one (L1): it was
/// answered REFUSED, and the run ends with exit 1 naming it.
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

/// Longest a registration's answer is held for the run to get ready to read
/// ([`EventTable::hold_answers`]); past it the guest goes on regardless.
pub const ANSWER_HOLD_MAX: Duration = Duration::from_secs(10);

/// How the wait for the registration ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settled {
    /// The guest registered (some entries may have been rejected).
    Registered,
    /// The guest's table was refused as a whole (the message says why).
    Refused(String),
    /// The guest registers nothing: a writer took in an event without a registration
    /// (by the handshake no vCPU writes before the answer), or the pack has no table.
    Unregistered,
    /// The caller gave up waiting (vCPU 0 ended, a signal, `--duration`,
    /// `--hang-timeout`, a timeout).
    None,
}

impl Settled {
    /// Why a run went on without a registration, for [`LateRegistration`].
    fn why(&self) -> &'static str {
        match self {
            Self::Unregistered => "a vCPU had written an event before any registration",
            _ => "the run had stopped waiting for it: vcpu 0 ended, a signal, --duration or --hang-timeout",
        }
    }
}

/// What [`EventTable::settle`] makes of the state (L1), given whether a writer took in
/// an event (`wrote`) and whether the caller gives up (`gave_up`); `None`: wait on.
/// Nothing here depends on wall time: the wait ends on what the vCPUs do (vCPU 0
/// registers or ends, a writer writes) or on the caller.
fn decide(st: &State, no_table: bool, wrote: bool, gave_up: bool) -> Option<Settled> {
    match st {
        State::Registered { .. } => Some(Settled::Registered),
        State::Refused(why) => Some(Settled::Refused(why.clone())),
        State::Closed { settled, .. } => Some(settled.clone()),
        State::Waiting if no_table || wrote => Some(Settled::Unregistered),
        State::Waiting if gave_up => Some(Settled::None),
        State::Waiting => None,
    }
}

/// The registration table of a run, its answer and the enable bits.
pub struct EventTable<M> {
    mem: M,
    geometry: RingGeometry,
    selection: Selection,
    state: Mutex<State>,
    cv: Condvar,
    early_exits: std::sync::atomic::AtomicU32,
    /// Answers wait for [`EventTable::release_answers`] (see [`EventTable::hold_answers`]).
    held: std::sync::atomic::AtomicBool,
    /// Host TSC when the registration was answered (0: not answered).
    answered_tsc: std::sync::atomic::AtomicU64,
}

impl<M> std::fmt::Debug for EventTable<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventTable")
            .field("selection", &self.selection)
            .finish_non_exhaustive()
    }
}

/// What a vCPU thread calls when the guest writes to
/// [`hyptrace_abi::registry::PORT_REGISTER`].
pub trait RegisterHook: Send + Sync {
    /// Answers the registration (synchronously: the vCPU resumes after this returns).
    fn on_register(&self, vcpu: u32);
}

impl<M: SharedMem + Send + Sync> RegisterHook for EventTable<M> {
    fn on_register(&self, vcpu: u32) {
        self.register(vcpu);
    }
}

impl<M: SharedMem> EventTable<M> {
    /// The table of the region `mem` laid out as `geometry` (the host's, not the pack's),
    /// answered with `selection`.
    pub fn new(mem: M, geometry: RingGeometry, selection: Selection) -> Self {
        Self {
            mem,
            geometry,
            selection,
            state: Mutex::new(State::Waiting),
            cv: Condvar::new(),
            early_exits: Default::default(),
            held: Default::default(),
            answered_tsc: Default::default(),
        }
    }

    /// From now on a registration is answered only once [`EventTable::release_answers`]
    /// is called (or [`ANSWER_HOLD_MAX`] passed): the registering vCPU waits in its exit,
    /// the others for the answer in the table, so no guest writes an event before the
    /// run reads — its output open, its drain loop about to start. Without it a guest
    /// writing at 16 M events/s filled its ring in the milliseconds between the answer
    /// and the loop's first round, and lost events at the start of every such run. The
    /// run learns the formats from the registration before it answers (the table is
    /// read and checked first), so it can open the output meanwhile.
    pub fn hold_answers(&self) {
        self.held.store(true, SeqCst);
    }

    /// Host TSC when the guest's registration was answered, if it was: the guest writes
    /// no event before (its workload starts there, [`crate::pipeline::report::Timing::workload_start`]).
    pub fn answered_tsc(&self) -> Option<u64> {
        Some(self.answered_tsc.load(SeqCst)).filter(|&t| t != 0)
    }

    /// Answers a registration held by [`EventTable::hold_answers`], and every later one
    /// at once.
    pub fn release_answers(&self) {
        let _st = self.lock();
        self.held.store(false, SeqCst);
        self.cv.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The registration exit: reads and validates the table, assigns ids, sets every
    /// CPU's enable bits to the selected accepted events, writes the answer (DONE last).
    /// Only the first ready table is answered; later exits change nothing. An exit after
    /// the run went on without a registration is answered REFUSED and kept (L1).
    pub fn register(&self, vcpu: u32) {
        let mut st = self.lock();
        if let State::Closed {
            settled,
            since,
            late,
        } = &mut *st
        {
            // L1: the output was opened without formats; answering now would let the
            // guest write events whose formats are nowhere.
            refuse(&self.mem, &self.geometry);
            let l = LateRegistration {
                vcpu,
                after: since.elapsed(),
                why: settled.why(),
            };
            log::warn!("{l}");
            late.get_or_insert(l);
            return;
        }
        if !matches!(*st, State::Waiting) {
            log::debug!("vcpu {vcpu}: registration exit after the answer: ignored");
            return;
        }
        match read_table(&self.mem, &self.geometry) {
            Ok(None) => {
                log::warn!("vcpu {vcpu}: registration exit, but the region has no table");
            }
            Err(TableError::NotReady(state)) => {
                let n = self.early_exits.fetch_add(1, Relaxed) + 1;
                log::warn!("vcpu {vcpu}: registration exit with the table in state {state}");
                if n >= MAX_EARLY_EXITS {
                    let why = format!("{n} registration exits without a ready table");
                    refuse(&self.mem, &self.geometry);
                    *st = State::Refused(why);
                    self.cv.notify_all();
                }
            }
            Err(e) => {
                log::warn!("vcpu {vcpu}: {e}");
                refuse(&self.mem, &self.geometry);
                *st = State::Refused(crate::exit::chain(&e));
                self.cv.notify_all();
            }
            Ok(Some(reg)) => {
                for r in &reg.rejected {
                    log::warn!("{r}");
                }
                let (mask, error) = match self.selected(&reg) {
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
                    self.answered_tsc
                        .store(crate::vmm::time::host_tsc(), SeqCst);
                }
                log::debug!(
                    "vcpu {vcpu}: registration answered after {:.3} ms",
                    held.elapsed().as_secs_f64() * 1e3
                );
            }
        }
    }

    /// The enable mask of the selection over `reg`.
    fn selected(&self, reg: &Registry) -> Result<u64, EventsError> {
        let mut mask = if self.selection.enable.is_empty() {
            reg.events.iter().fold(0u64, |m, e| m | bit(e.slot))
        } else {
            let mut m = 0;
            for p in &self.selection.enable {
                m |= mask_of(reg, p)?;
            }
            m
        };
        for p in &self.selection.disable {
            mask &= !mask_of(reg, p)?;
        }
        Ok(mask)
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

    fn registry(&self) -> Result<Registry, EventsError> {
        match &*self.lock() {
            State::Registered { reg, .. } => Ok(reg.clone()),
            _ => Err(EventsError::NotRegistered),
        }
    }

    /// The accepted events (after the registration).
    pub fn registrations(&self) -> Vec<Registration> {
        self.registry().map(|r| r.events).unwrap_or_default()
    }

    /// The rejected entries (after the registration).
    pub fn rejections(&self) -> Vec<Rejection> {
        self.registry().map(|r| r.rejected).unwrap_or_default()
    }

    /// The selection error of the registration (an unknown `-e`/`--disable` name).
    pub fn selection_error(&self) -> Option<EventsError> {
        match &*self.lock() {
            State::Registered { error, .. } => error.clone(),
            _ => None,
        }
    }

    /// The formats of the accepted events (none before the registration).
    pub fn formats(&self) -> Vec<EventFormat> {
        self.registrations().iter().map(to_format).collect()
    }

    /// Sets the enable bit of every event `pattern` matches, on every CPU (other bits
    /// stay); returns their names.
    pub fn enable(&self, pattern: &str) -> Result<Vec<String>, EventsError> {
        self.flip(pattern, true)
    }

    /// Clears the enable bit of every event `pattern` matches, on every CPU (other bits
    /// stay); returns their names. The writer skips them from its next event on.
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

    /// Whether some CPU's writer took in an event (committed or dropped). By the
    /// handshake no vCPU does before the registration is answered (docs/abi.md), so one
    /// that did means the guest registers nothing. (An attached writer alone means
    /// nothing: the SDKs attach first, then register or wait for the registration.)
    fn writer_wrote(&self) -> bool {
        (0..self.geometry.nr_cpus)
            .any(|c| hyptrace_reader::ctl_writer_index(&self.mem, &self.geometry, c) != 0)
    }

    /// Waits until the guest's registration is answered, the guest shows it registers
    /// nothing ([`Settled::Unregistered`]), or `give_up()` says so (vCPU 0 ended, a
    /// signal, `--duration`, `--hang-timeout`), checking every `step`. No fixed grace:
    /// by the SDK protocol vCPU 0 registers and the others wait for the answer, however
    /// late vCPU 0 starts. A run that goes on without a registration closes the table
    /// (L1): a later registration exit is refused ([`EventTable::late_registration`]).
    pub fn settle(&self, step: Duration, mut give_up: impl FnMut() -> bool) -> Settled {
        let no_table = self.geometry.events_size == 0;
        let mut st = self.lock();
        loop {
            let waiting = matches!(*st, State::Waiting);
            let wrote = waiting && self.writer_wrote();
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

    /// The registration exit that came after the run went on without one (L1), if any:
    /// the run ends with exit 1 naming it.
    pub fn late_registration(&self) -> Option<LateRegistration> {
        match &*self.lock() {
            State::Closed { late, .. } => late.clone(),
            _ => None,
        }
    }
}

const fn bit(slot: u32) -> u64 {
    1u64 << (slot & 63)
}

fn mask_of(reg: &Registry, pattern: &str) -> Result<u64, EventsError> {
    let mask = reg
        .events
        .iter()
        .filter(|e| matches(pattern, &e.system, &e.name))
        .fold(0u64, |m, e| m | bit(e.slot));
    if mask == 0 {
        let known: Vec<String> = reg.events.iter().map(Registration::full_name).collect();
        return Err(EventsError::Unknown {
            pattern: pattern.to_string(),
            known: if known.is_empty() {
                "none".into()
            } else {
                known.join(", ")
            },
            elsewhere: String::new(),
        });
    }
    Ok(mask)
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

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_abi::layout::Mode;
    use hyptrace_abi::registry::DEFAULT_TABLE_SIZE;
    use hyptrace_abi::HeapMem;
    use hyptrace_writer::events::{
        read_answer, wait_registered, write_table, Event, Field as WField, RegisterError,
    };

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

    #[test]
    fn globs() {
        assert!(matches("all", "a", "b"));
        assert!(matches("guest:*", "guest", "marker"));
        assert!(!matches("guest:*", "other", "marker"));
        assert!(matches("guest", "guest", "marker"));
        assert!(matches("marker", "guest", "marker"));
        assert!(matches("*:mark*", "guest", "marker"));
        assert!(matches("g?est:m*r", "guest", "marker"));
        assert!(!matches("mark", "guest", "marker"));
        assert!(!matches("guest:span", "guest", "marker"));
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

    /// A held answer: the registering exit waits, the run meanwhile sees the
    /// registration (settle, formats) while the guest's table is not answered yet; the
    /// release answers it and ends the exit. Unheld, the exit answers at once.
    #[test]
    fn a_held_answer_waits_for_the_release() {
        static A: Event<'static> = Event::new("g", "a", F, "\"%llu\", REC->v", 16, 0, 0);
        let (m, l) = region();
        write_table(&*m, &[&A]).unwrap();
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
        assert_eq!(t.formats().len(), 1);
        // The guest's view: no answer yet, however long the exit is held.
        std::thread::sleep(Duration::from_millis(50));
        assert!(!exit.is_finished(), "the exit returned before the release");
        assert_eq!(
            wait_registered(&*m, &[&A], 10),
            Err(RegisterError::NotAnswered)
        );
        t.release_answers();
        exit.join().expect("exit thread");
        assert_eq!(read_answer(&*m, &[&A]), Ok(1));
        // Not held: answered during the exit.
        let (m, l) = region();
        write_table(&*m, &[&A]).unwrap();
        let t = EventTable::new(m.clone(), l, Selection::default());
        t.register(0);
        assert_eq!(read_answer(&*m, &[&A]), Ok(1));
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
            Settled::Refused(w) if w.contains("version 9")
        ));
        assert_eq!(
            m.load(l.events_off + 8, Relaxed),
            hyptrace_abi::registry::STATE_REFUSED
        );
    }

    /// The settle decision (L1) on injected states, no wall time: a waiting table waits
    /// on however long writers stayed attached; a write without a registration, a pack
    /// without a table or the caller giving up end the wait; an answer wins over both.
    #[test]
    fn settle_decides_on_what_the_vcpus_do() {
        let w = State::Waiting;
        assert_eq!(decide(&w, false, false, false), None);
        assert_eq!(decide(&w, false, true, false), Some(Settled::Unregistered));
        assert_eq!(decide(&w, true, false, false), Some(Settled::Unregistered));
        assert_eq!(decide(&w, false, false, true), Some(Settled::None));
        let r = State::Registered {
            reg: Registry::default(),
            error: None,
        };
        assert_eq!(decide(&r, false, true, true), Some(Settled::Registered));
        let f = State::Refused("bad".into());
        assert_eq!(
            decide(&f, false, true, true),
            Some(Settled::Refused("bad".into()))
        );
        let c = State::Closed {
            settled: Settled::Unregistered,
            since: Instant::now(),
            late: None,
        };
        assert_eq!(decide(&c, false, false, false), Some(Settled::Unregistered));
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
}
