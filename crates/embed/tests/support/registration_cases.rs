//! The registration cases every VMM path must agree on, as one table: the embed library's
//! `Events` (crates/embed/tests/registration.rs) and the `hyptrace` CLI's `EventTable`
//! as its vCPU threads and run pipeline drive it (host/src/vmm/registration.rs, which
//! includes this file by path) run the same steps and must see the same outcomes. A
//! change on either side that makes it answer a case differently fails that side's test.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Arc;

use hyptrace_abi::layout::{ctl, Mode, RingGeometry};
use hyptrace_abi::registry::{
    DEFAULT_TABLE_SIZE, STATE_DONE, STATE_EMPTY, STATE_OFF, STATE_READY, STATE_REFUSED,
};
use hyptrace_abi::{HeapMem, SharedMem};
use hyptrace_embed::MAX_EARLY_EXITS;
use hyptrace_writer::events::{write_table, Event, Field};

static F: &[Field<'static>] = &[Field {
    name: "v",
    ctype: "u64",
    offset: 8,
    size: 8,
    signed: false,
}];
static A: Event<'static> = Event::new("g", "a", F, "\"%llu\", REC->v", 16, 2, 0);

/// How the wait for the registration ended, as both paths report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Registered, with this many formats.
    Registered(usize),
    /// The table was refused as a whole.
    Refused,
    /// The pack has no table.
    NoTable,
    /// A vCPU wrote before any registration.
    Unregistered,
    /// The caller gave up waiting (the embedder's timeout, the CLI's stop conditions).
    GaveUp,
}

/// One registration path: what the VMM calls on a registration exit and before it opens
/// its output.
pub trait RegistrationPath {
    /// The path over the rings `geometry` describes in `mem`, every event selected.
    fn new(mem: Arc<HeapMem>, geometry: RingGeometry) -> Self;
    /// The registration exit of `vcpu` (on its thread, before it resumes).
    fn exit(&self, vcpu: u32);
    /// The wait before the output opens, giving up at once if it would have to wait.
    fn settle(&self) -> Outcome;
    /// The vCPU of the late registration kept for the run's end (L1), if any.
    fn late(&self) -> Option<u32>;
    /// How many formats the output gets now.
    fn formats(&self) -> usize;
}

/// One step of a case, with what it must show.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// The guest writes a valid table (one event) and marks it READY.
    WriteTable,
    /// The guest writes garbage and marks it READY.
    WriteGarbage,
    /// A writer on `cpu` took in an event (no registration).
    Wrote(u32),
    /// `n` registration exits of vCPU `vcpu`.
    Exits(u32, u32),
    /// The wait before the output opens, and how it must end.
    Settle(Outcome),
    /// The table's state word as the guest reads it.
    Guest(u64),
    /// The late registration kept (its vCPU).
    Late(Option<u32>),
    /// The formats the output gets.
    Formats(usize),
}

/// One case: its name, whether the pack has a table, its steps.
pub struct Case {
    /// What it shows.
    pub name: &'static str,
    /// Whether the pack has a registration table.
    pub table: bool,
    /// The steps, in order.
    pub steps: &'static [Step],
}

use Outcome as O;
use Step as S;

/// The cases. The expected outcome of each is the one behaviour (docs/design.md, L1).
pub const CASES: &[Case] = &[
    Case {
        name: "missing table: nothing to wait for, an exit is ignored, never late",
        table: false,
        steps: &[
            S::Exits(0, 1),
            S::Settle(O::NoTable),
            S::Exits(0, 2),
            S::Late(None),
            S::Formats(0),
            S::Settle(O::NoTable),
        ],
    },
    Case {
        name: "table not ready, then ready: answered; later exits change nothing",
        table: true,
        steps: &[
            S::Exits(0, 3),
            S::Guest(STATE_EMPTY),
            S::WriteTable,
            S::Guest(STATE_READY),
            S::Exits(0, 1),
            S::Guest(STATE_DONE),
            S::Settle(O::Registered(1)),
            S::Exits(1, 2),
            S::Guest(STATE_DONE),
            S::Late(None),
            S::Formats(1),
        ],
    },
    Case {
        name: "table never ready: refused at the bound of early exits",
        table: true,
        steps: &[
            S::Exits(0, MAX_EARLY_EXITS - 1),
            S::Guest(STATE_EMPTY),
            S::Exits(0, 1),
            S::Guest(STATE_REFUSED),
            S::Settle(O::Refused),
            S::Late(None),
            S::Formats(0),
        ],
    },
    Case {
        name: "bad table: refused as a whole",
        table: true,
        steps: &[
            S::WriteGarbage,
            S::Exits(0, 1),
            S::Guest(STATE_REFUSED),
            S::Settle(O::Refused),
            S::Late(None),
        ],
    },
    Case {
        name: "late registration after the output was opened: refused and kept (L1)",
        table: true,
        steps: &[
            S::Settle(O::GaveUp),
            S::WriteTable,
            S::Exits(1, 1),
            S::Guest(STATE_REFUSED),
            S::Late(Some(1)),
            S::Formats(0),
            S::Exits(0, 1),
            S::Late(Some(1)),
            S::Settle(O::GaveUp),
        ],
    },
    Case {
        name: "a write before any registration: the wait ends, a later one is late (L1)",
        table: true,
        steps: &[
            S::Wrote(1),
            S::Settle(O::Unregistered),
            S::WriteTable,
            S::Exits(0, 1),
            S::Guest(STATE_REFUSED),
            S::Late(Some(0)),
            S::Formats(0),
        ],
    },
];

fn region(table: bool) -> (Arc<HeapMem>, RingGeometry) {
    let l = RingGeometry::new(2, 3, 4096, Mode::Stop, false).expect("geometry");
    let l = if table {
        l.with_events(DEFAULT_TABLE_SIZE).expect("table")
    } else {
        l
    };
    let m = Arc::new(HeapMem::new(l.region_size));
    l.init_region(&*m, 0, 1);
    (m, l)
}

/// Runs every case through path `P`, panicking with the case and step that differ.
pub fn run_cases<P: RegistrationPath>() {
    for case in CASES {
        let (m, l) = region(case.table);
        let path = P::new(m.clone(), l);
        for (i, step) in case.steps.iter().enumerate() {
            let at = format!("case {:?}, step {i} ({step:?})", case.name);
            match *step {
                S::WriteTable => write_table(&*m, &[&A]).expect("table"),
                S::WriteGarbage => {
                    m.write_bytes(l.events_off, &[0xa5; 256]);
                    m.store(l.events_off + STATE_OFF, STATE_READY, Release);
                }
                S::Wrote(cpu) => m.store(l.ctl(cpu) + ctl::ENTRIES, 1, Relaxed),
                S::Exits(vcpu, n) => (0..n).for_each(|_| path.exit(vcpu)),
                S::Settle(want) => assert_eq!(path.settle(), want, "{at}"),
                S::Guest(want) => {
                    assert_eq!(m.load(l.events_off + STATE_OFF, Acquire), want, "{at}")
                }
                S::Late(want) => assert_eq!(path.late(), want, "{at}"),
                S::Formats(want) => assert_eq!(path.formats(), want, "{at}"),
            }
        }
    }
}
