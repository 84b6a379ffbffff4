//! The reader's callbacks (`ring_buffer_ext_cb`): how the writer-domain operations
//! `swap_reader_page` and `update_footers` get run for a CPU.
//!
//! - [`Direct`]: run them here, on the shared memory, lock-free against the writer
//!   (`--swap host`; also the in-process backend of tests and benchmarks).
//! - [`Mailbox`]: post a request in the CPU's control block for the writer to run and
//!   acknowledge (`--swap guest`: only the writer touches its metadata); the reader
//!   does not wait for a descheduled writer but comes back for the answer.

use crate::ReadError;
use hyptrace_abi::layout::{
    ctl, RingGeometry, MBOX_OP_SWAP, MBOX_OP_UPDATE_FOOTERS, MBOX_STATUS_BUSY,
    MBOX_STATUS_CONTENDED, MBOX_STATUS_OK, WRITER_FINISHED,
};
use hyptrace_abi::SharedMem;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Outcome of a swap request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwapStatus {
    /// The head page became the reader page.
    Swapped {
        /// The new reader page.
        page: u32,
    },
    /// The writer is on the reader page: nothing to swap yet.
    Busy,
    /// The request is in flight (mailbox): ask again later.
    Pending,
    /// The swap lost every attempt to the writer moving the head (overwrite mode):
    /// nothing changed, ask again later. A lost race, never an error.
    Contended,
}

impl From<hyptrace_writer::SwapStatus> for SwapStatus {
    fn from(s: hyptrace_writer::SwapStatus) -> Self {
        match s {
            hyptrace_writer::SwapStatus::Swapped { page } => Self::Swapped { page },
            hyptrace_writer::SwapStatus::Busy => Self::Busy,
            hyptrace_writer::SwapStatus::Contended => Self::Contended,
        }
    }
}

/// How the reader gets the writer-domain operations done for a CPU.
pub trait Callbacks {
    /// Swap the CPU's reader page with its head page.
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError>;
    /// Refresh the stats in the CPU's reader page footer. `Ok(false)`: the request is
    /// still in flight (mailbox); the footer is refreshed later.
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError>;
}

/// Runs the writer-domain operations directly on the shared memory.
#[derive(Debug)]
pub struct Direct<M> {
    mem: M,
    layout: RingGeometry,
    /// Per CPU, where its last swap left the HEAD link (`hyptrace_writer::SwapHint`):
    /// page id + 1, 0 for none. Only a starting point for the head search.
    hints: Vec<AtomicU64>,
}

impl<M: SharedMem> Direct<M> {
    /// Callbacks over `mem`, whose pack describes `layout`.
    pub fn new(mem: M, layout: RingGeometry) -> Self {
        Self {
            mem,
            layout,
            hints: (0..layout.nr_cpus).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl<M: SharedMem> Callbacks for Direct<M> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError> {
        let slot = self.hints.get(cpu as usize);
        // Swaps of one CPU are serialised by the reader: a plain load/store suffices.
        let stored = slot.map_or(0, |h| h.load(Relaxed));
        let mut hint = hyptrace_writer::SwapHint::default();
        if let Some(page) = stored.checked_sub(1).and_then(|p| u32::try_from(p).ok()) {
            hint = hyptrace_writer::SwapHint::at(page);
        }
        let r = hyptrace_writer::swap_reader_page_hinted(&self.mem, &self.layout, cpu, &mut hint);
        if let (Some(h), Some(page)) = (slot, hint.page()) {
            h.store(u64::from(page) + 1, Relaxed);
        }
        r.map(SwapStatus::from)
            .map_err(|e| ReadError::Ring { cpu, err: e })
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        hyptrace_writer::update_footers(&self.mem, &self.layout, cpu)
            .map(|()| true)
            .map_err(|e| ReadError::Ring { cpu, err: e })
    }
}

/// How long a mailbox request is spun on before the reader moves on and comes back.
pub const MAILBOX_SPIN: Duration = Duration::from_micros(30);

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// Last sequence number posted.
    seq: u64,
    /// The request in flight: op and when it was posted.
    pending: Option<(u64, Instant)>,
    /// A swap's answer that arrived while another op was asked for: the swap happened,
    /// so the reader must learn of it at its next swap call (never dropped).
    swap_answer: Option<u64>,
}

/// Posts requests to the writer's mailbox; never blocks for long. A request not
/// answered within [`MAILBOX_SPIN`] stays in flight and the call reports it pending;
/// the next call for that CPU picks up the answer (one request per CPU at a time).
/// The reader thus serves all CPUs while a descheduled vCPU gets to its mailbox.
#[derive(Debug)]
pub struct Mailbox<M> {
    mem: M,
    layout: RingGeometry,
    timeout: Duration,
    slots: Mutex<Vec<Slot>>,
}

/// Result of one mailbox exchange.
enum Reply {
    Done(u64),
    Pending,
}

impl<M: SharedMem> Mailbox<M> {
    /// Mailbox callbacks over `mem`; a request not acknowledged within `timeout` is an
    /// error ([`ReadError::MailboxTimeout`]: a stuck or dead writer).
    pub fn new(mem: M, layout: RingGeometry, timeout: Duration) -> Self {
        let slots = (0..layout.nr_cpus)
            .map(|c| Slot {
                // Acquire: paired with the Release store of mbox_req in Mailbox::request
                // (an earlier Mailbox on this region): go on from its last seq.
                seq: mem.load(layout.ctl(c) + ctl::MBOX_REQ, Acquire) >> 8,
                pending: None,
                swap_answer: None,
            })
            .collect();
        Self {
            mem,
            layout,
            timeout,
            slots: Mutex::new(slots),
        }
    }

    fn acked(&self, c: usize, seq: u64) -> Option<u64> {
        // Acquire: paired with the Release store of mbox_ack in Writer::serve_request: the
        // swap's reader_page and footers are visible once its answer is (M1).
        let ack = self.mem.load(c + ctl::MBOX_ACK, Acquire);
        (ack >> 8 == seq & (u64::MAX >> 8)).then_some(ack & 0xff)
    }

    fn request(&self, cpu: u32, op: u64) -> Result<Reply, ReadError> {
        if cpu >= self.layout.nr_cpus {
            return Err(ReadError::BadCpu(cpu));
        }
        let c = self.layout.ctl(cpu);
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut slots[cpu as usize];
        if op == MBOX_OP_SWAP {
            if let Some(status) = slot.swap_answer.take() {
                return Ok(Reply::Done(status));
            }
        }
        if let Some((pop, posted)) = slot.pending {
            match self.acked(c, slot.seq) {
                Some(status) => {
                    slot.pending = None;
                    if pop == op {
                        return Ok(Reply::Done(status));
                    }
                    // The answer to another op. A swap's is kept for the next swap
                    // call (the reader page changed); an update's needs nothing more.
                    if pop == MBOX_OP_SWAP {
                        // M1: a swap's answer is never dropped.
                        slot.swap_answer = Some(status);
                    }
                }
                None => {
                    // Acquire: paired with the Release swap of writer_state in Writer::finish.
                    if self.mem.load(c + ctl::WRITER_STATE, Acquire) == WRITER_FINISHED {
                        return Err(ReadError::WriterStopped { cpu });
                    }
                    if posted.elapsed() > self.timeout {
                        return Err(ReadError::MailboxTimeout {
                            cpu,
                            timeout: self.timeout,
                        });
                    }
                    return Ok(Reply::Pending);
                }
            }
        }
        slot.seq += 1;
        let seq = slot.seq;
        // Release: paired with the Acquire load of mbox_req in Writer::serve_mailbox (M1).
        self.mem.store(c + ctl::MBOX_REQ, (seq << 8) | op, Release);
        let start = Instant::now();
        loop {
            if let Some(status) = self.acked(c, seq) {
                return Ok(Reply::Done(status));
            }
            // A writer that said it will write no more serves no more requests either.
            // Acquire: paired with the Release swap of writer_state in Writer::finish.
            if self.mem.load(c + ctl::WRITER_STATE, Acquire) == WRITER_FINISHED {
                return Err(ReadError::WriterStopped { cpu });
            }
            if start.elapsed() > MAILBOX_SPIN {
                slot.pending = Some((op, start));
                return Ok(Reply::Pending);
            }
            std::hint::spin_loop();
        }
    }
}

impl<M: SharedMem> Callbacks for Mailbox<M> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError> {
        match self.request(cpu, MBOX_OP_SWAP)? {
            Reply::Pending => Ok(SwapStatus::Pending),
            Reply::Done(MBOX_STATUS_OK) => {
                // Acquire: paired with the Release store of reader_page in swap_reader_page_hinted,
                // ordered before the answer we saw (Mailbox::acked, M1).
                let page = self
                    .mem
                    .load(self.layout.ctl(cpu) + ctl::READER_PAGE, Acquire);
                Ok(SwapStatus::Swapped { page: page as u32 })
            }
            Reply::Done(MBOX_STATUS_BUSY) => Ok(SwapStatus::Busy),
            Reply::Done(MBOX_STATUS_CONTENDED) => Ok(SwapStatus::Contended),
            Reply::Done(s) => Err(ReadError::MailboxFailed { cpu, status: s }),
        }
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        match self.request(cpu, MBOX_OP_UPDATE_FOOTERS)? {
            Reply::Pending => Ok(false),
            Reply::Done(MBOX_STATUS_OK) => Ok(true),
            Reply::Done(s) => Err(ReadError::MailboxFailed { cpu, status: s }),
        }
    }
}

impl<T: Callbacks + ?Sized> Callbacks for &T {
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError> {
        (**self).swap_reader(cpu)
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        (**self).update_footers(cpu)
    }
}

impl<T: Callbacks + ?Sized> Callbacks for Box<T> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError> {
        (**self).swap_reader(cpu)
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        (**self).update_footers(cpu)
    }
}
