//! The drain and final-walk cases every VMM path must agree on, as one table: the embed
//! library's `Tracer` (crates/embed/tests/drain.rs) and the `hyptrace` CLI's `Session`
//! as its run loop and run end drive it (host/src/pipeline/run/finish.rs, which includes
//! this file by path) read the same rings into the same counting sink and must give the
//! same accounts. A change on either side that reads, counts or hands on a case
//! differently fails that side's test.

use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::{Arc, Mutex, PoisonError};

use hyptrace_abi::events::{marker, vcpu_pid};
use hyptrace_abi::layout::{ctl, Mode, RingGeometry};
use hyptrace_abi::page::{self, COMMIT_LEN_MASK, PAGE_HEADER_SIZE};
use hyptrace_abi::{HeapMem, SharedMem};
use hyptrace_output::{Missed, OutputError, PageSink, RunSummary};
use hyptrace_reader::CpuStats;
use hyptrace_writer::Writer;

/// CPUs of every case.
pub const CPUS: u32 = 2;

/// One CPU's account, as a path reports it at the run's end.
#[derive(Clone, Debug, Default)]
pub struct Account {
    /// Events the writer took in.
    pub written: u64,
    /// The reader's counters.
    pub stats: CpuStats,
    /// Whether an error stopped the reading of the CPU.
    pub error: bool,
    /// The path's own verdict on the counts (R1, R3), errors aside.
    pub balanced: bool,
}

/// What a path's page sink was given, per CPU.
#[derive(Clone, Debug, Default)]
pub struct Tallied {
    /// Events in the pages.
    pub events: Vec<u64>,
    /// The pages' missed counts.
    pub missed: Vec<u64>,
    /// The losses after the last page (`trailing_lost`).
    pub trailing: Vec<u64>,
    /// What the sink's end was told.
    pub summary: Option<RunSummary>,
}

/// A page sink that counts what it is given (shared: the path owns one handle).
#[derive(Clone)]
pub struct Tally(pub Arc<Mutex<Tallied>>);

impl Tally {
    fn new() -> Self {
        let n = CPUS as usize;
        Self(Arc::new(Mutex::new(Tallied {
            events: vec![0; n],
            missed: vec![0; n],
            trailing: vec![0; n],
            summary: None,
        })))
    }

    fn get(&self) -> Tallied {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl PageSink for Tally {
    fn page(&mut self, cpu: u32, bytes: &[u8], missed: Missed) -> Result<(), OutputError> {
        let (ts, commit) = page::page_header(bytes).expect("a whole page");
        let len = (commit & COMMIT_LEN_MASK) as usize;
        let data = &bytes[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len];
        let mut n = 0u64;
        for e in page::Events::new(data, ts) {
            e.expect("a valid page");
            n += 1;
        }
        let mut t = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        t.events[cpu as usize] += n;
        t.missed[cpu as usize] += match missed {
            Missed::Count(n) => n,
            Missed::None => 0,
            Missed::Unknown => panic!("the reader counts every loss"),
        };
        Ok(())
    }
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .trailing[cpu as usize] += lost;
        Ok(())
    }
    fn finish(self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .summary = Some(summary.clone());
        Ok(())
    }
}

/// One drain path: what the VMM calls while its vCPUs run and once they stopped.
pub trait DrainPath: Sized {
    /// The path over the rings `geometry` describes in `mem` (allocated by it), its
    /// output `sink`.
    fn new(mem: Arc<HeapMem>, geometry: RingGeometry, sink: Tally) -> Self;
    /// One live drain round over every CPU (the vCPUs run).
    fn drain(&mut self);
    /// Every vCPU stopped: the final walks, the sink finished; each CPU's account.
    fn finish(self) -> Vec<Account>;
}

/// One step of a case.
#[derive(Clone, Copy, Debug)]
pub enum Step {
    /// The writer of `cpu` writes `n` markers.
    Write {
        /// The CPU.
        cpu: u32,
        /// How many.
        n: u64,
    },
    /// One live drain round.
    Drain,
    /// The writer of the CPU finishes.
    Finish(u32),
    /// The guest scribbles on the CPU's control block (tail and reader page out of range).
    Scribble(u32),
    /// The writer of the CPU stopped between an event's commit and its `entries` store:
    /// the control block is one event behind its pages.
    EntriesBehind(u32),
}

/// What a case must show of one CPU.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    /// Events the writer took in.
    pub written: u64,
    /// Whether its reading failed.
    pub error: bool,
    /// Whether events were lost (then exactly `overrun + dropped`).
    pub lost: bool,
    /// Whether some were lost after the last page (stop mode, ring full at the end).
    pub trailing: bool,
}

const fn ok(written: u64, lost: bool, trailing: bool) -> Expect {
    Expect {
        written,
        error: false,
        lost,
        trailing,
    }
}

/// A case: a ring mode, steps, and per CPU what it must show.
pub struct Case {
    /// Its name.
    pub name: &'static str,
    /// Stop or overwrite.
    pub mode: Mode,
    /// The steps, in order.
    pub steps: &'static [Step],
    /// Per CPU (index = cpu).
    pub expect: [Expect; CPUS as usize],
}

/// The table.
pub const CASES: &[Case] = &[
    Case {
        name: "stop mode: the drops are counted exactly, where they happened",
        mode: Mode::Stop,
        steps: &[
            Step::Write { cpu: 0, n: 1000 },
            Step::Drain,
            Step::Write { cpu: 0, n: 1000 },
            Step::Finish(0),
        ],
        expect: [ok(2000, true, true), ok(0, false, false)],
    },
    Case {
        name: "overwrite mode: the overruns are counted exactly",
        mode: Mode::Overwrite,
        steps: &[
            Step::Write { cpu: 0, n: 1000 },
            Step::Drain,
            Step::Write { cpu: 1, n: 1500 },
            Step::Write { cpu: 0, n: 1000 },
            Step::Drain,
            Step::Finish(0),
            Step::Finish(1),
        ],
        expect: [ok(2000, true, false), ok(1500, true, false)],
    },
    Case {
        name: "a scribbled ring is an error of its CPU only; the other CPU completes",
        mode: Mode::Overwrite,
        steps: &[
            Step::Write { cpu: 1, n: 10 },
            Step::Scribble(0),
            Step::Drain,
            Step::Finish(1),
        ],
        expect: [
            Expect {
                written: 0,
                error: true,
                lost: false,
                trailing: false,
            },
            ok(10, false, false),
        ],
    },
    Case {
        name: "a writer stopped between commit and entries: the one event beyond counts",
        mode: Mode::Stop,
        steps: &[
            Step::Write { cpu: 0, n: 10 },
            Step::Drain,
            Step::Write { cpu: 0, n: 5 },
            Step::EntriesBehind(0),
            Step::Write { cpu: 1, n: 3 },
            Step::Finish(1),
        ],
        expect: [ok(15, false, false), ok(3, false, false)],
    },
    Case {
        name: "a trailing loss: the ring full at the end, never drained live",
        mode: Mode::Stop,
        steps: &[Step::Write { cpu: 1, n: 2000 }, Step::Finish(1)],
        expect: [ok(0, false, false), ok(2000, true, true)],
    },
    Case {
        name: "vCPUs that never wrote (nor attached): empty, consistent accounts",
        mode: Mode::Stop,
        steps: &[Step::Drain],
        expect: [ok(0, false, false), ok(0, false, false)],
    },
];

/// Runs `steps` over a fresh region with path `P`: the accounts and what its sink got.
fn run<P: DrainPath>(case: &Case) -> (Vec<Account>, Tallied) {
    let l = RingGeometry::new(CPUS, 3, 4096, case.mode, false).expect("geometry");
    let mem = Arc::new(HeapMem::new(l.region_size));
    let tally = Tally::new();
    let mut path = P::new(mem.clone(), l, tally.clone());
    let mut writers: Vec<Option<Writer<Arc<HeapMem>>>> = (0..CPUS).map(|_| None).collect();
    for step in case.steps {
        match *step {
            Step::Write { cpu, n } => {
                let w = writers[cpu as usize]
                    .get_or_insert_with(|| Writer::attach(mem.clone(), cpu).expect("attach"));
                for seq in 0..n {
                    let _ = w.write_enabled(seq, &marker(vcpu_pid(cpu), seq, 0));
                }
            }
            Step::Drain => path.drain(),
            Step::Finish(cpu) => writers[cpu as usize].as_mut().expect("a writer").finish(),
            Step::Scribble(cpu) => {
                mem.store(l.ctl(cpu) + ctl::TAIL_PAGE, u64::MAX, Release);
                mem.store(l.ctl(cpu) + ctl::READER_PAGE, 12345, Release);
            }
            Step::EntriesBehind(cpu) => {
                let at = l.ctl(cpu) + ctl::ENTRIES;
                mem.store(at, mem.load(at, Relaxed) - 1, Release);
            }
        }
    }
    (path.finish(), tally.get())
}

/// Runs every case with path `P`, checking what each must show.
pub fn run_cases<P: DrainPath>() {
    for case in CASES {
        let (accounts, sink) = run::<P>(case);
        let name = case.name;
        assert_eq!(accounts.len(), CPUS as usize, "{name}");
        let summary = sink.summary.as_ref().expect("the sink finished");
        for (cpu, (a, e)) in accounts.iter().zip(&case.expect).enumerate() {
            let what = format!("{name}: cpu {cpu}: {a:?} {sink:?}");
            assert_eq!(a.error, e.error, "{what}");
            if e.error {
                continue;
            }
            let s = &a.stats;
            assert_eq!(a.written, e.written, "{what}");
            assert!(a.balanced, "{what}");
            assert_eq!(s.read + s.lost, a.written, "{what}");
            assert_eq!(s.lost > 0, e.lost, "{what}");
            assert_eq!(s.lost, s.overrun + s.dropped, "{what}");
            // The output holds what was read, and every loss, where it happened or
            // after the last page.
            assert_eq!(sink.events[cpu], s.read, "{what}");
            assert_eq!(sink.missed[cpu] + sink.trailing[cpu], s.lost, "{what}");
            assert_eq!(sink.trailing[cpu] > 0, e.trailing, "{what}");
            let k = &summary.cpus[cpu];
            assert_eq!((k.entries, k.read_events), (0, s.read), "{what}");
        }
    }
}
