//! A run's set-up before its rings drain: the trace memory file, the VM, the clock map,
//! the VMM's own ring, the event table and the guest's rings, the session over them.

use std::sync::Arc;

use hyptrace_output::EventFormat;

use crate::drain::clock::HostClock;
use crate::drain::session::{Output, Session};
use crate::flight::trace_mem::TraceMemFile;
use crate::pipeline::plan::Plan;
use crate::pipeline::report::GuestView;
use crate::vmm::guest_mem::{alloc_reader_wrapped, GuestTraceMem};
use crate::vmm::host_events::{HostEvents, Recording};
use crate::vmm::registration::{EventTable, VmEventTable};
use crate::vmm::vm::Vm;

use super::{RunError, WrapCallbacks};

/// What a run set up besides the VM before its rings exist: the trace memory file, the
/// clock map and the VMM's own ring.
pub(super) struct Booted {
    pub(super) trace_mem: Option<TraceMemFile>,
    pub(super) guest: GuestView,
    pub(super) tsc_khz: u64,
    pub(super) tsc_offset: Option<i64>,
    pub(super) host_clock: HostClock,
    pub(super) generation: u64,
    /// `--host-events`: the VMM's ring in host memory, fed by the vCPU threads' exits
    /// and the reader's callbacks.
    pub(super) host: Option<(Arc<HostEvents>, crate::vmm::host_events::HostReader)>,
}

impl Booted {
    /// Creates the trace memory file (F1–F6) and the VM on it, calibrates the one map
    /// guest TSC → `--clock` of every output (see [`crate::drain::clock`]) and the
    /// VMM's ring.
    pub(super) fn boot(plan: &Plan) -> Result<(Self, Vm), RunError> {
        log::debug!(
            "plan: {} vCPUs, {} MiB guest memory, trace region {} bytes ({} pages of {} bytes per vCPU, mode {:?}, guest swap {})",
            plan.cfg.vcpus,
            plan.cfg.mem_bytes >> 20,
            plan.ring.region_size,
            plan.ring.pages_per_cpu,
            plan.ring.page_size,
            plan.ring.mode,
            plan.ring.guest_swap
        );
        let trace_mem = match &plan.flight.trace_mem {
            Some(path) => Some(TraceMemFile::create(path, &plan.ring).map_err(RunError::TraceMem)?),
            None => None,
        };
        let mut vm = Vm::with_trace_backing(
            plan.cfg.clone(),
            trace_mem.as_ref().map(TraceMemFile::region_backing),
        )?;
        let guest = GuestView {
            memory: vm.memory().clone(),
            map: vm.layout().clone(),
        };
        let tsc_khz = vm.tsc_khz();
        let tsc_offset = vm.tsc_offset();
        let host_clock = HostClock::calibrate(plan.clock, tsc_khz, tsc_offset.unwrap_or(0))
            .map_err(|source| RunError::Clock { tsc_khz, source })?;
        log::debug!("clock: {:?}", host_clock.stats());
        let generation = crate::vmm::time::host_tsc();
        let host = if plan.host_events {
            let (events, reader) = HostEvents::new(
                plan.cfg.vcpus,
                plan.ring.page_size,
                tsc_khz,
                tsc_offset.unwrap_or(0),
                generation,
            )
            .map_err(RunError::TraceBuffers)?;
            vm.record_exits(Arc::clone(&events));
            Some((events, reader))
        } else {
            None
        };
        let booted = Self {
            trace_mem,
            guest,
            tsc_khz,
            tsc_offset,
            host_clock,
            generation,
            host,
        };
        Ok((booted, vm))
    }

    /// The event table over the trace region and the rings allocated in it, their
    /// callbacks through the caller's `wrap` and the VMM's recording; the trace memory
    /// file's header written.
    pub(super) fn rings(
        &self,
        vm: &Vm,
        plan: &Plan,
        wrap: Option<WrapCallbacks>,
    ) -> Result<(VmEventTable, crate::vmm::guest_mem::Reader), RunError> {
        let user_wrap = wrap.unwrap_or_else(|| Box::new(|cb| cb));
        let recording = self.host.as_ref().map(|(e, _)| Arc::clone(e));
        let wrap: WrapCallbacks = Box::new(move |cb| {
            let cb = user_wrap(cb);
            match recording {
                Some(ev) => Box::new(Recording::new(cb, ev)),
                None => cb,
            }
        });
        let table: VmEventTable = Arc::new(EventTable::new(
            Arc::new(GuestTraceMem::new(vm.trace_region())),
            plan.ring,
            plan.events.clone(),
        ));
        let generation = self.generation;
        let reader = alloc_reader_wrapped(
            vm.trace_region(),
            plan.ring,
            self.tsc_khz,
            generation,
            plan.mailbox_timeout,
            wrap,
        )
        .map_err(RunError::TraceBuffers)?;
        log::debug!(
            "rings allocated in the trace region (generation {generation:#x}); the {} runs the swaps",
            if plan.ring.guest_swap { "guest" } else { "host" }
        );
        if let Some(tm) = &self.trace_mem {
            tm.write_header(&plan.ring, vm.layout().trace_gpa, self.tsc_khz, generation);
            log::info!("trace memory in {}", tm.path().display());
        }
        Ok((table, reader))
    }

    /// The session over the rings: the formats, the trace memory file's recorder (P2:
    /// positions recorded around every flush, printed vs consumed), the VMM's ring.
    pub(super) fn session(
        &mut self,
        reader: crate::vmm::guest_mem::Reader,
        output: Output,
        formats: &[EventFormat],
        plan: &Plan,
        trace_mem: Option<&Arc<TraceMemFile>>,
    ) -> Session {
        let mut session =
            Session::new(reader, output, self.host_clock.clock.clone()).with_formats(formats);
        if let Some(tm) = trace_mem {
            let tm = Arc::clone(tm);
            session = session.with_recorder(Arc::new(move |c, p| tm.record(c, p)));
        }
        if let Some((events, reader_h)) = self.host.take() {
            session = session.with_host_events(reader_h, events);
        }
        session.set_live_drain(plan.flight.drain_live);
        session
    }
}
