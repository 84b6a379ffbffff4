//! The embed library's drain (`Tracer::drain` while the vCPUs run, `Tracer::finish` once
//! they stopped) through the cases the CLI's session runs too
//! (support/drain_cases.rs).

mod support {
    pub mod drain_cases;
}

use std::sync::Arc;

use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::HeapMem;
use hyptrace_embed::Tracer;
use hyptrace_reader::Direct;
use support::drain_cases::{run_cases, Account, DrainPath, Tally};

struct Embed {
    tracer: Tracer<Arc<HeapMem>, Direct<Arc<HeapMem>>>,
    sink: Tally,
}

impl DrainPath for Embed {
    fn new(mem: Arc<HeapMem>, geometry: RingGeometry, sink: Tally) -> Self {
        let cb = Direct::new(mem.clone(), geometry);
        let tracer = Tracer::alloc(mem, geometry, cb, 1_000_000).expect("alloc");
        Self { tracer, sink }
    }
    fn drain(&mut self) {
        // Bounded: every round reads what is committed, the writers do not run now.
        while self.tracer.drain(&mut self.sink).expect("the sink is fine") {}
    }
    fn finish(self) -> Vec<Account> {
        let accounts = self.tracer.finish(Box::new(self.sink)).expect("finish");
        accounts
            .into_iter()
            .map(|a| Account {
                written: a.written,
                balanced: a.balanced(),
                error: a.error.is_some(),
                stats: a.stats,
            })
            .collect()
    }
}

#[test]
fn embed_drain_runs_the_shared_cases() {
    run_cases::<Embed>();
}
