//! `startup`: VMM start (before the VM is created) → the first event's timestamp, and
//! its parts. Always runs: it also measures the TSC frequency the other sections use.

use serde::Serialize;

use super::harness::{vm_run, VmSpec};
use super::stats::{Summary, Tsc};
use super::{BenchError, Cfg};

/// The `startup` JSON object (ms).
#[derive(Clone, Debug, Default, Serialize)]
pub(super) struct StartupReport {
    /// Host TSC before `Vm::new` → the first page's `time_stamp`.
    pub(super) first_event_ms: Summary,
    /// `Vm::new` → the vCPU threads started.
    pub(super) vm_create_ms: Summary,
    /// vCPU threads started → the guest's first TSC read.
    pub(super) start_to_first_instruction_ms: Summary,
}

/// Boots a 1-vCPU VM writing 1000 markers `max(reps, 3)` times.
pub(super) fn startup(cfg: &Cfg) -> Result<(StartupReport, Tsc), BenchError> {
    let mut first_event = Vec::new();
    let mut vm_new = Vec::new();
    let mut first_insn = Vec::new();
    let mut khz = 0;
    for _ in 0..cfg.reps.max(3) {
        let o = vm_run(&VmSpec {
            events: 1000,
            ..VmSpec::default()
        })?;
        khz = o.tsc_khz;
        let tsc = Tsc { khz };
        let host = |guest: u64| guest.wrapping_sub(o.tsc_offset as u64);
        if let Some(ts) = o.first_ts {
            first_event.push(tsc.ns(host(ts).wrapping_sub(o.t_new) as i64 as f64) / 1e6);
        }
        vm_new.push(tsc.ns(o.t_start.wrapping_sub(o.t_new) as f64) / 1e6);
        if let Some(&e) = o.tsc_entry.first() {
            first_insn.push(tsc.ns(host(e).wrapping_sub(o.t_start) as i64 as f64) / 1e6);
        }
    }
    Ok((
        StartupReport {
            first_event_ms: Summary::of(&first_event),
            vm_create_ms: Summary::of(&vm_new),
            start_to_first_instruction_ms: Summary::of(&first_insn),
        },
        Tsc { khz },
    ))
}
