//! The guest's event registration at the start of a run: its answer held until the
//! drain loop starts, the wait for it, the `-e`/`--disable` names checked.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyptrace_output::EventFormat;

use crate::drain::signals::Interrupts;
use crate::vmm::registration::{EventsError, Selection, Settled, VmEventTable};
use crate::vmm::vm::RunningVm;

use super::RunError;

/// Holds the answer to the guest's event registration ([`Events::hold_answers`](hyptrace_embed::Events::hold_answers))
/// while it lives: the run opens its output meanwhile, and releases the answer right
/// before its drain loop starts — or on any early return, when it is dropped.
pub(super) struct AnswerGate(VmEventTable);

impl AnswerGate {
    pub(super) fn hold(table: &VmEventTable) -> Self {
        table.hold_answers();
        Self(Arc::clone(table))
    }
}

impl Drop for AnswerGate {
    fn drop(&mut self) {
        self.0.release_answers();
    }
}

/// Waits until the guest's event registration is answered (or it writes without one,
/// or the run stops first), says which entries were rejected, and returns the formats
/// of the accepted events. An `-e`/`--disable` name no registered event has is an
/// input error (the VM is stopped).
///
/// The wait follows the SDK protocol (vCPU 0 registers, the others wait for the
/// answer), however late vCPU 0 starts: it ends when vCPU 0 registers or ends, or the
/// run stops (a crash, a signal, `--duration`), or `--hang-timeout` passed since the
/// start with no registration (the hang watch then starts). A run that goes on without
/// a registration refuses a later one (L1, [`Events::settle`](hyptrace_embed::Events::settle)).
pub(super) fn settle_events(
    table: &VmEventTable,
    running: &RunningVm,
    (duration, hang_timeout): (Option<Duration>, Option<Duration>),
    selection: &Selection,
    interrupts: Option<&Interrupts>,
) -> Result<Vec<EventFormat>, RunError> {
    let since_start = |d: Option<Duration>| d.map(|d| running.started_at() + d);
    let (deadline, hang) = (since_start(duration), since_start(hang_timeout));
    let settled = table.settle(Duration::from_millis(1), || {
        running.vcpu_finished(0)
            || running.any_crashed()
            || interrupts.is_some_and(|i| i.stop_requested() || i.aborted())
            || deadline.is_some_and(|d| Instant::now() >= d)
            || hang.is_some_and(|d| Instant::now() >= d)
    });
    log::debug!("event registration: {settled:?}");
    if let Settled::Refused(why) = &settled {
        let why = crate::exit::chain(why);
        note!("hyptrace: warning: the guest's event registration table was refused: {why}");
    }
    for r in table.rejections() {
        note!("hyptrace: warning: {r}");
    }
    let selecting = !selection.enable.is_empty() || !selection.disable.is_empty();
    // A guest that writes without registering, or whose vCPU 0 ended cleanly without it,
    // has none of the events asked for; a crash or a stop while waiting is reported as
    // such instead.
    let unregistered = matches!(settled, Settled::Unregistered | Settled::NoTable)
        || (settled == Settled::None && running.vcpu_finished(0) && !running.any_crashed());
    let error = match table.selection_error() {
        Some(e) => Some(e),
        None if selecting && unregistered => Some(EventsError::NotRegistered),
        None => None,
    };
    if let Some(e) = error {
        running.stop();
        return Err(RunError::Events(e));
    }
    Ok(table.formats())
}
