//! The VMM's own events in the trace (`--host-events`).
//!
//! The VMM writes them with the same writer crate as the guest, into a ring of the same
//! format in **host** memory (a [`HeapMem`] the guest cannot reach), stamped with the host
//! TSC + the guest's TSC offset, so they convert through the run's clock exactly like the
//! guest's events. The session reads that ring as one more CPU, number `nr_vcpus`, comm
//! `vmm`: text and JSON print it as CPU `nr_vcpus`, trace.dat gets it as an extra CPU
//! (hyptrace's trace.dat writer has no second named buffer yet). Without the flag nothing
//! of this exists: the CPUs and counts are exactly the guest's.
//!
//! Several host threads write (every vCPU thread on its exits, the poll thread for
//! swaps and pokes): one writer behind a mutex, the timestamp taken under it, so the
//! ring's timestamps never go backwards and [`HostEvents::watermark`] bounds what is
//! still to come.

use std::sync::{Arc, Mutex};

use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::HeapMem;
use hyptrace_output::{common_fields, EventFormat, Field};
use hyptrace_reader::{Callbacks, Direct, ReadError, RingBuffer, SwapReply};
use hyptrace_writer::Writer;

/// System of the VMM's events.
pub const SYSTEM: &str = "vmm";
/// `vmm:vcpu_exit`: a vCPU left `KVM_RUN` (fields vcpu, reason = `KVM_EXIT_*`, port).
pub const ID_EXIT: u16 = hyptrace_abi::registry::FIRST_VMM_ID;
/// `vmm:swap`: the reader swapped a page of a CPU (fields cpu, status).
pub const ID_SWAP: u16 = hyptrace_abi::registry::FIRST_VMM_ID + 1;
/// `vmm:poke`: the reader refreshed a CPU's footers (fields cpu, done).
pub const ID_POKE: u16 = hyptrace_abi::registry::FIRST_VMM_ID + 2;
/// `vmm:mailbox_timeout`: a mailbox request of a CPU was not answered in time.
pub const ID_MAILBOX_TIMEOUT: u16 = hyptrace_abi::registry::FIRST_VMM_ID + 3;

/// `KVM_EXIT_IO` (linux/kvm.h).
pub const KVM_EXIT_IO: u32 = 2;
/// `KVM_EXIT_HLT`.
pub const KVM_EXIT_HLT: u32 = 5;
/// `KVM_EXIT_MMIO`.
pub const KVM_EXIT_MMIO: u32 = 6;
/// `KVM_EXIT_SHUTDOWN`.
pub const KVM_EXIT_SHUTDOWN: u32 = 8;
/// `KVM_EXIT_FAIL_ENTRY`.
pub const KVM_EXIT_FAIL_ENTRY: u32 = 9;
/// `KVM_EXIT_INTR` (also used here for `KVM_RUN` returning EINTR: a kick).
pub const KVM_EXIT_INTR: u32 = 10;
/// `KVM_EXIT_INTERNAL_ERROR`.
pub const KVM_EXIT_INTERNAL_ERROR: u32 = 17;
/// Any other exit.
pub const KVM_EXIT_UNKNOWN: u32 = 0;

/// The name of each `KVM_EXIT_*` reason `vmm:vcpu_exit` records (its print fmt's
/// `__print_symbolic` table: text output and trace-cmd print the name, the record keeps
/// the number; docs/design.md "Host events").
pub const EXIT_REASONS: [(u32, &str); 8] = [
    (KVM_EXIT_UNKNOWN, "other"),
    (KVM_EXIT_IO, "io"),
    (KVM_EXIT_HLT, "hlt"),
    (KVM_EXIT_MMIO, "mmio"),
    (KVM_EXIT_SHUTDOWN, "shutdown"),
    (KVM_EXIT_FAIL_ENTRY, "fail_entry"),
    (KVM_EXIT_INTR, "intr"),
    (KVM_EXIT_INTERNAL_ERROR, "internal_error"),
];

/// Payload size of every VMM event: common header (8) + three u32 + pad.
const PAYLOAD: usize = 24;
/// Pages of the VMM's ring.
const PAGES: u32 = 64;

/// The formats of the VMM's events (for the text printers and trace.dat).
pub fn formats() -> Vec<EventFormat> {
    let f = |name: &str, off| Field {
        type_name: "u32".into(),
        name: name.into(),
        offset: off,
        size: 4,
        signed: false,
    };
    let ev = |id, name: &str, fields: Vec<Field>, fmt: &str| EventFormat {
        system: SYSTEM.into(),
        name: name.into(),
        id,
        common_fields: common_fields(),
        fields,
        print_fmt: fmt.into(),
    };
    let reasons: Vec<String> = EXIT_REASONS
        .iter()
        .map(|(n, name)| format!("{{ {n}, \"{name}\" }}"))
        .collect();
    let exit_fmt = format!(
        "\"vcpu=%u reason=%s port=0x%x\", REC->vcpu, __print_symbolic(REC->reason, {}), REC->port",
        reasons.join(", ")
    );
    vec![
        ev(
            ID_EXIT,
            "vcpu_exit",
            vec![f("vcpu", 8), f("reason", 12), f("port", 16)],
            &exit_fmt,
        ),
        ev(
            ID_SWAP,
            "swap",
            vec![f("cpu", 8), f("status", 12), f("page", 16)],
            "\"cpu=%u status=%u page=%u\", REC->cpu, REC->status, REC->page",
        ),
        ev(
            ID_POKE,
            "poke",
            vec![f("cpu", 8), f("done", 12)],
            "\"cpu=%u done=%u\", REC->cpu, REC->done",
        ),
        ev(
            ID_MAILBOX_TIMEOUT,
            "mailbox_timeout",
            vec![f("cpu", 8)],
            "\"cpu=%u\", REC->cpu",
        ),
    ]
}

/// The reader side of the VMM's ring (one CPU, index 0 in it).
pub type HostReader = RingBuffer<Arc<HeapMem>, Direct<Arc<HeapMem>>>;

/// The writer side: shared by every host thread that records events.
#[derive(Debug)]
pub struct HostEvents {
    writer: Mutex<Writer<Arc<HeapMem>>>,
    tsc_offset: i64,
    pid: i32,
}

impl HostEvents {
    /// A ring for the VMM of a VM with `nr_vcpus` vCPUs (its pid is the one a vCPU
    /// `nr_vcpus` would have), pages of `page_size`, timestamps = host TSC +
    /// `tsc_offset`.
    pub fn new(
        nr_vcpus: u32,
        page_size: usize,
        tsc_khz: u64,
        tsc_offset: i64,
        generation: u64,
    ) -> Result<(Arc<Self>, HostReader), ReadError> {
        let layout = RingGeometry::new(1, PAGES, page_size, Mode::Overwrite, false)?;
        let mem = Arc::new(HeapMem::new(layout.region_size));
        let reader = RingBuffer::alloc(
            mem.clone(),
            layout,
            Direct::new(mem.clone(), layout),
            tsc_khz,
            generation,
        )?;
        let writer = Writer::attach(mem, 0).map_err(|err| ReadError::Ring { cpu: 0, err })?;
        Ok((
            Arc::new(Self {
                writer: Mutex::new(writer),
                tsc_offset,
                pid: hyptrace_abi::events::vcpu_pid(nr_vcpus),
            }),
            reader,
        ))
    }

    /// The pid the VMM's events carry (comm `vmm`).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    fn stamp(&self) -> u64 {
        crate::vmm::time::host_tsc().wrapping_add_signed(self.tsc_offset)
    }

    fn emit(&self, id: u16, a: u32, b: u32, c: u32) {
        let mut p = [0u8; PAYLOAD];
        p[0..2].copy_from_slice(&id.to_le_bytes());
        p[4..8].copy_from_slice(&self.pid.to_le_bytes());
        p[8..12].copy_from_slice(&a.to_le_bytes());
        p[12..16].copy_from_slice(&b.to_le_bytes());
        p[16..20].copy_from_slice(&c.to_le_bytes());
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        // Stamped under the lock: the ring's times never go backwards.
        let ts = self.stamp();
        let _ = w.write_enabled(ts, &p);
    }

    /// A time no event still to be written can be older than: an event stamped before
    /// it was committed before this returned (stamps are taken under the writer lock).
    pub fn watermark(&self) -> u64 {
        let _w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        self.stamp()
    }

    /// `vmm:vcpu_exit`.
    pub fn vcpu_exit(&self, vcpu: u32, reason: u32, port: u32) {
        self.emit(ID_EXIT, vcpu, reason, port);
    }

    /// Marks the ring finished (no more events).
    pub fn finish(&self) {
        self.writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .finish();
    }
}

/// Callbacks that record every swap, poke and mailbox timeout of the guest's rings as
/// VMM events, then pass through.
pub struct Recording {
    inner: Box<dyn Callbacks + Send>,
    events: Arc<HostEvents>,
}

impl Recording {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn Callbacks + Send>, events: Arc<HostEvents>) -> Self {
        Self { inner, events }
    }
}

fn timeout(events: &HostEvents, cpu: u32, e: &ReadError) {
    if matches!(e, ReadError::MailboxTimeout { .. }) {
        events.emit(ID_MAILBOX_TIMEOUT, cpu, 0, 0);
    }
}

impl Callbacks for Recording {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        let r = self.inner.swap_reader(cpu);
        match &r {
            Ok(SwapReply::Done(s)) => {
                // status: 0 swapped (page = the new reader page), 1 busy, 2 contended.
                let (status, page) = match s {
                    hyptrace_writer::SwapStatus::Swapped { page } => (0, *page),
                    hyptrace_writer::SwapStatus::Busy => (1, 0),
                    hyptrace_writer::SwapStatus::Contended => (2, 0),
                };
                self.events.emit(ID_SWAP, cpu, status, page);
            }
            Ok(SwapReply::Pending) => {}
            Err(e) => timeout(&self.events, cpu, e),
        }
        r
    }

    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        let r = self.inner.update_footers(cpu);
        match &r {
            Ok(done) => self.events.emit(ID_POKE, cpu, u32::from(*done), 0),
            Err(e) => timeout(&self.events, cpu, e),
        }
        r
    }

    fn releases(&self, cpu: u32) -> bool {
        // Recording changes nothing about how pages are freed.
        self.inner.releases(cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_reader::Item;

    #[test]
    fn events_round_trip_in_host_memory() {
        let (ev, mut rb) = HostEvents::new(2, 4096, 1_000_000, 0, 1).expect("ring");
        assert_eq!(ev.pid(), hyptrace_abi::events::vcpu_pid(2));
        for i in 0..10 {
            ev.vcpu_exit(1, KVM_EXIT_IO, 0x510 + i);
        }
        let w = ev.watermark();
        ev.finish();
        rb.sync_writer_counters(0).expect("sync");
        rb.finalize(0).expect("finalize");
        let mut n = 0;
        let mut last = 0;
        while let Some(item) = rb.next_event(0).expect("read") {
            if let Item::Event { ts, payload } = item {
                assert_eq!(u16::from_le_bytes([payload[0], payload[1]]), ID_EXIT);
                assert_eq!(&payload[16..20], &(0x510u32 + n).to_le_bytes());
                assert!(ts >= last && ts <= w);
                last = ts;
                n += 1;
            }
        }
        assert_eq!(n, 10);
        let f = formats();
        assert!(f.iter().all(|e| e.system == SYSTEM));
    }

    /// Issue 26: `vmm:vcpu_exit` prints its reason by name (the record keeps the
    /// number); a reason outside the table prints as hex, as the kernel's would.
    #[test]
    fn exit_reasons_print_by_name() {
        let exit = formats()
            .into_iter()
            .find(|f| f.id == ID_EXIT)
            .expect("vcpu_exit");
        let p = hyptrace_output::EventPrinter::new(exit);
        assert!(p.print_fmt_supported(), "{:?}", p.unsupported_reason());
        let line = |reason: u32| {
            let mut payload = vec![0u8; PAYLOAD];
            payload[8..12].copy_from_slice(&1u32.to_le_bytes());
            payload[12..16].copy_from_slice(&reason.to_le_bytes());
            payload[16..20].copy_from_slice(&0x510u32.to_le_bytes());
            let mut out = String::new();
            assert!(p.format_fields(&mut out, &payload));
            out
        };
        assert_eq!(line(KVM_EXIT_IO), "vcpu=1 reason=io port=0x510");
        assert_eq!(line(KVM_EXIT_INTR), "vcpu=1 reason=intr port=0x510");
        assert_eq!(line(KVM_EXIT_UNKNOWN), "vcpu=1 reason=other port=0x510");
        assert_eq!(line(99), "vcpu=1 reason=0x63 port=0x510");
    }
}
