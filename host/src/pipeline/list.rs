//! `hyptrace list`: boots the guest until it registers its events and returns them.

use std::sync::Arc;
use std::time::Duration;

use crate::exit::{EXIT_CRASH, EXIT_RUNTIME, EXIT_USAGE};
use crate::pipeline::plan::Plan;
use crate::vmm::guest_mem::{alloc_reader, GuestTraceMem};
use hyptrace_reader::registry::Rejection;

use crate::vmm::registration::{EventInfo, EventTable, Selection, Settled, VmEventTable};
use crate::vmm::time::host_tsc;
use crate::vmm::vm::Vm;

/// Longest `hyptrace list` waits for the guest to register.
pub const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why `hyptrace list` has nothing to show.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    /// The VM could not be created or started.
    #[error(transparent)]
    Vm(#[from] crate::vmm::error::Error),
    /// The rings could not be set up.
    #[error("trace buffers")]
    TraceBuffers(#[source] hyptrace_reader::ReadError),
    /// The guest's table was refused as a whole.
    #[error("the guest's event registration table was refused: {0}")]
    Refused(String),
    /// The guest crashed before it registered.
    #[error("the guest crashed before it registered its events: {0}")]
    Crashed(String),
    /// The guest ended, wrote events or timed out without registering.
    #[error("the guest registered no events (within {} s)", LIST_TIMEOUT.as_secs())]
    None,
}

impl ListError {
    /// 2 for an unusable KVM device, 3 for a crashed guest, else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Vm(e) if e.is_input_error() => EXIT_USAGE,
            Self::Crashed(_) => EXIT_CRASH,
            _ => EXIT_RUNTIME,
        }
    }
}

/// Boots the guest of `plan` until it registers its events (at most [`LIST_TIMEOUT`]),
/// stops it, and returns its accepted events and rejected entries.
pub fn list_guest(plan: Plan) -> Result<(Vec<EventInfo>, Vec<Rejection>), ListError> {
    let vm = Vm::new(plan.cfg)?;
    let table: VmEventTable = Arc::new(EventTable::new(
        Arc::new(GuestTraceMem::new(vm.trace_region())),
        plan.ring,
        Selection::default(),
    ));
    let _reader = alloc_reader(
        vm.trace_region(),
        plan.ring,
        vm.tsc_khz(),
        host_tsc(),
        plan.mailbox_timeout,
    )
    .map_err(ListError::TraceBuffers)?;
    let running = vm.start_with_events(&plan.params, table.clone())?;
    let until = std::time::Instant::now() + LIST_TIMEOUT;
    let settled = table.settle(Duration::from_millis(1), || {
        running.vcpu_finished(0) || running.any_crashed() || std::time::Instant::now() >= until
    });
    running.stop();
    let crashed = running.any_crashed();
    let outcomes = running.wait();
    match settled {
        Settled::Registered => Ok((table.list().unwrap_or_default(), table.rejections())),
        Settled::Refused(why) => Err(ListError::Refused(crate::exit::chain(&why))),
        Settled::None | Settled::Unregistered | Settled::NoTable if crashed => {
            Err(ListError::Crashed(
                outcomes
                    .iter()
                    .find(|o| o.is_crash())
                    .map(|o| format!("{o:?}"))
                    .unwrap_or_default(),
            ))
        }
        Settled::None | Settled::Unregistered | Settled::NoTable => Err(ListError::None),
    }
}
