//! The embed library's registration (`Events`: `on_register` on the vCPU thread, `wait`
//! before the output opens) through the cases the CLI's path runs too
//! (support/registration_cases.rs).

mod support {
    pub mod registration_cases;
}

use std::sync::Arc;
use std::time::Duration;

use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::HeapMem;
use hyptrace_embed::{Events, RegisterError};
use support::registration_cases::{run_cases, Outcome, RegistrationPath};

struct Embed(Events<Arc<HeapMem>>);

impl RegistrationPath for Embed {
    fn new(mem: Arc<HeapMem>, geometry: RingGeometry) -> Self {
        Self(Events::new(mem, geometry))
    }
    fn exit(&self, vcpu: u32) {
        self.0.on_register(vcpu);
    }
    fn settle(&self) -> Outcome {
        match self.0.wait(Duration::ZERO) {
            Ok(r) => Outcome::Registered(r.formats.len()),
            Err(RegisterError::Refused(_)) => Outcome::Refused,
            Err(RegisterError::NoTable) => Outcome::NoTable,
            Err(RegisterError::Unregistered) => Outcome::Unregistered,
            Err(RegisterError::TimedOut(_)) => Outcome::GaveUp,
        }
    }
    fn late(&self) -> Option<u32> {
        self.0.late_registration().map(|l| l.vcpu)
    }
    fn formats(&self) -> usize {
        self.0.formats().len()
    }
}

#[test]
fn embed_registration_runs_the_shared_cases() {
    run_cases::<Embed>();
}
