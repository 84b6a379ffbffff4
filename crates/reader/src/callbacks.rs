//! The reader's callbacks (`ring_buffer_ext_cb`): how the writer-domain operations
//! `swap_reader_page` and `update_footers` get run for a CPU.
//!
//! - [`Direct`]: run them here, on the shared memory, lock-free against the writer
//!   (`--swap host`; also the in-process backend of tests and benchmarks).
//! - [`Mailbox`]: post a request in the CPU's control block for the writer to run and
//!   acknowledge (`--swap guest`: only the writer touches its metadata); the reader
//!   does not wait for a descheduled writer but comes back for the answer. The wire
//!   format (`seq << 8 | op`, `seq << 8 | status`) is [`MailboxPort`]'s alone.
//!
//! [`for_geometry`] picks the backend a ring geometry asks for.

use crate::ReadError;
use hyptrace_abi::layout::{
    ctl, Mode, RingGeometry, MBOX_OP_SWAP, MBOX_OP_UPDATE_FOOTERS, MBOX_STATUS_BUSY,
    MBOX_STATUS_CONTENDED, MBOX_STATUS_OK, WRITER_FINISHED, WRITER_IDLE,
};
use hyptrace_abi::SharedMem;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The writer's own swap outcome (`Swapped`, `Busy`, `Contended`): one type for both
/// backends, re-exported here.
pub use hyptrace_writer::SwapStatus;

/// Answer of [`Callbacks::swap_reader`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwapReply {
    /// The swap was done (or not needed): the writer's outcome.
    Done(SwapStatus),
    /// The request is in flight (mailbox): ask again later.
    Pending,
}

impl From<SwapStatus> for SwapReply {
    fn from(s: SwapStatus) -> Self {
        Self::Done(s)
    }
}

/// How the reader gets the writer-domain operations done for a CPU.
pub trait Callbacks {
    /// Swap the CPU's reader page with its head page.
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError>;
    /// Refresh the stats in the CPU's reader page footer. `Ok(false)`: the request is
    /// still in flight (mailbox); the footer is refreshed later.
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError>;
    /// Whether the reader reads the ring pages in place, following the writer, and
    /// releases each one it has read with one store (`ctl::RELEASED`) instead of
    /// asking for swaps: the writer then swaps released pages back by itself when its
    /// tail meets them (released pages: `Mailbox` in stop mode, where every swap would
    /// be a round trip to the writer; docs/design.md "Released pages"). No default: a
    /// wrapper that forgot to pass it on would silently fall back to a swap per page.
    fn releases(&self, cpu: u32) -> bool;
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
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
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
        r.map(SwapReply::Done)
            .map_err(|e| ReadError::Ring { cpu, err: e })
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        hyptrace_writer::update_footers(&self.mem, &self.layout, cpu)
            .map(|()| true)
            .map_err(|e| ReadError::Ring { cpu, err: e })
    }
    fn releases(&self, _cpu: u32) -> bool {
        // The host runs the swaps itself (`--swap host`).
        false
    }
}

/// How long a mailbox request is spun on before the reader moves on and comes back.
pub const MAILBOX_SPIN: Duration = Duration::from_micros(3);

/// An operation the writer runs for the reader through its mailbox (`MBOX_OP_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MailboxOp {
    /// `swap_reader_page` ([`MBOX_OP_SWAP`]).
    Swap,
    /// `update_footers` ([`MBOX_OP_UPDATE_FOOTERS`]).
    UpdateFooters,
}

impl MailboxOp {
    /// Whether the op moves pages (a swap): its answer must reach the reader (M1).
    pub const fn moves_pages(self) -> bool {
        matches!(self, Self::Swap)
    }
}

impl MailboxOp {
    /// The op's code in `MBOX_REQ`.
    pub const fn wire(self) -> u64 {
        match self {
            Self::Swap => MBOX_OP_SWAP,
            Self::UpdateFooters => MBOX_OP_UPDATE_FOOTERS,
        }
    }
}

/// The writer's answer to a mailbox request (`MBOX_STATUS_*` in `MBOX_ACK`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MailboxStatus {
    /// [`MBOX_STATUS_OK`]: done (a swap moved a page to the reader).
    Ok,
    /// [`MBOX_STATUS_BUSY`]: the writer is on the reader page, nothing to swap yet.
    Busy,
    /// [`MBOX_STATUS_CONTENDED`]: the swap lost every attempt to the writer.
    Contended,
    /// Any other code ([`hyptrace_abi::layout::MBOX_STATUS_ERROR`] or a value no writer
    /// sends: the guest's word, reported as such).
    Failed(u64),
}

impl MailboxStatus {
    /// Decodes the status byte of an acknowledgement.
    pub const fn from_wire(code: u64) -> Self {
        match code {
            MBOX_STATUS_OK => Self::Ok,
            MBOX_STATUS_BUSY => Self::Busy,
            MBOX_STATUS_CONTENDED => Self::Contended,
            other => Self::Failed(other),
        }
    }

    /// The status byte on the wire.
    pub const fn wire(self) -> u64 {
        match self {
            Self::Ok => MBOX_STATUS_OK,
            Self::Busy => MBOX_STATUS_BUSY,
            Self::Contended => MBOX_STATUS_CONTENDED,
            Self::Failed(code) => code,
        }
    }
}

/// The sequence number of a posted mailbox request (56 bits on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MailboxSeq(u64);

/// Bits of `MBOX_REQ`/`MBOX_ACK` below the sequence number: the op or the status.
const SEQ_SHIFT: u32 = 8;
const CODE_MASK: u64 = (1 << SEQ_SHIFT) - 1;

/// The mailbox wire protocol over the shared memory: the one place that encodes
/// `MBOX_REQ = seq << 8 | op` and decodes `MBOX_ACK = seq << 8 | status`
/// (docs/abi.md). [`Mailbox`] builds its callbacks on it; benchmarks and tools post
/// and poll through it. One request per CPU at a time: the writer serves only the
/// latest request it sees.
#[derive(Debug)]
pub struct MailboxPort<M> {
    mem: M,
    layout: RingGeometry,
    /// Per CPU, the last sequence number posted (host-side: `MBOX_REQ` lives in guest
    /// memory and is only ever written here, never read back after construction).
    seqs: Vec<AtomicU64>,
}

impl<M: SharedMem> MailboxPort<M> {
    /// A port over `mem`, whose pack describes `layout`; the sequence numbers continue
    /// from what each CPU's `MBOX_REQ` holds now (a fresh region: 0, so seq starts at 1).
    pub fn new(mem: M, layout: RingGeometry) -> Self {
        let seqs = (0..layout.nr_cpus)
            .map(|c| {
                // Acquire: paired with the Release store of mbox_req in MailboxPort::post
                // (an earlier port on this region): go on from its last seq.
                let req = mem.load(layout.ctl(c) + ctl::MBOX_REQ, Acquire);
                AtomicU64::new(req >> SEQ_SHIFT)
            })
            .collect();
        Self { mem, layout, seqs }
    }

    /// The shared memory.
    pub fn mem(&self) -> &M {
        &self.mem
    }

    /// Posts `op` for `cpu`'s writer; returns the request's sequence number to
    /// [`poll`](Self::poll) with. Replaces any request still in flight for that CPU.
    pub fn post(&self, cpu: u32, op: MailboxOp) -> Result<MailboxSeq, ReadError> {
        let slot = self.seqs.get(cpu as usize).ok_or(ReadError::BadCpu(cpu))?;
        // Posts for one CPU are serialised by the caller; the counter is host memory.
        let seq = slot.load(Relaxed).wrapping_add(1) & (u64::MAX >> SEQ_SHIFT);
        slot.store(seq, Relaxed);
        // Release: paired with the Acquire load of mbox_req in Writer::serve_mailbox (M1).
        self.mem.store(
            self.layout.ctl(cpu) + ctl::MBOX_REQ,
            (seq << SEQ_SHIFT) | op.wire(),
            Release,
        );
        Ok(MailboxSeq(seq))
    }

    /// The writer's answer to request `seq` of `cpu`, if it has answered it yet.
    pub fn poll(&self, cpu: u32, seq: MailboxSeq) -> Result<Option<MailboxStatus>, ReadError> {
        if cpu >= self.layout.nr_cpus {
            return Err(ReadError::BadCpu(cpu));
        }
        // Acquire: paired with the Release store of mbox_ack in Writer::serve_request: the
        // swap's reader_page and footers are visible once its answer is (M1).
        let ack = self.mem.load(self.layout.ctl(cpu) + ctl::MBOX_ACK, Acquire);
        Ok((ack >> SEQ_SHIFT == seq.0).then(|| MailboxStatus::from_wire(ack & CODE_MASK)))
    }

    /// Whether a writer attached to `cpu`'s ring (its state is no longer `WRITER_IDLE`;
    /// finished counts as attached).
    pub fn writer_attached(&self, cpu: u32) -> bool {
        // Acquire: paired with the Release swap of writer_state in Writer::attach (M2).
        cpu < self.layout.nr_cpus
            && self
                .mem
                .load(self.layout.ctl(cpu) + ctl::WRITER_STATE, Acquire)
                != WRITER_IDLE
    }

    /// Whether `cpu`'s writer said it will write no more (it serves no more requests
    /// either).
    pub fn writer_finished(&self, cpu: u32) -> bool {
        // Acquire: paired with the Release swap of writer_state in Writer::finish.
        cpu < self.layout.nr_cpus
            && self
                .mem
                .load(self.layout.ctl(cpu) + ctl::WRITER_STATE, Acquire)
                == WRITER_FINISHED
    }

    /// A swap's answer as a [`SwapStatus`] (`Ok`: the page the writer made the reader
    /// page, as it published it in the control block).
    pub fn swap_status(&self, cpu: u32, status: MailboxStatus) -> Result<SwapStatus, ReadError> {
        match status {
            MailboxStatus::Ok => {
                // Acquire: paired with the Release store of reader_page in
                // swap_reader_page_hinted, ordered before the answer seen (M1).
                let page = self
                    .mem
                    .load(self.layout.ctl(cpu) + ctl::READER_PAGE, Acquire);
                // A word out of range names no page: valid_page refuses it.
                Ok(SwapStatus::Swapped {
                    page: u32::try_from(page).unwrap_or(u32::MAX),
                })
            }
            MailboxStatus::Busy => Ok(SwapStatus::Busy),
            MailboxStatus::Contended => Ok(SwapStatus::Contended),
            MailboxStatus::Failed(status) => Err(ReadError::MailboxFailed { cpu, status }),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    /// The request in flight: its sequence number, op, and when it was posted.
    pending: Option<(MailboxSeq, MailboxOp, Instant)>,
    /// A swap's answer that arrived while another op was asked for: pages moved, so
    /// the reader must learn of it at its next swap call (never dropped).
    swap_answer: Option<MailboxStatus>,
}

/// Posts requests to the writer's mailbox; never blocks for long. A request not
/// answered within [`MAILBOX_SPIN`] (or the budget set with [`Mailbox::with_spin`])
/// stays in flight and the call reports it pending; the next call for that CPU picks up
/// the answer (one request per CPU at a time). The reader thus serves all CPUs while a
/// descheduled vCPU gets to its mailbox.
#[derive(Debug)]
pub struct Mailbox<M> {
    port: MailboxPort<M>,
    timeout: Duration,
    /// How long a new request is spun on before it is reported pending.
    spin: Duration,
    slots: Mutex<Vec<Slot>>,
}

/// Result of one mailbox exchange.
enum Reply {
    Done(MailboxStatus),
    Pending,
}

impl<M: SharedMem> Mailbox<M> {
    /// Mailbox callbacks over `mem`; a request not acknowledged within `timeout` is an
    /// error ([`ReadError::MailboxTimeout`]: a stuck or dead writer).
    pub fn new(mem: M, layout: RingGeometry, timeout: Duration) -> Self {
        Self {
            port: MailboxPort::new(mem, layout),
            timeout,
            spin: MAILBOX_SPIN,
            slots: Mutex::new(vec![Slot::default(); layout.nr_cpus as usize]),
        }
    }

    /// The same callbacks spinning `spin` (instead of [`MAILBOX_SPIN`]) on the answer
    /// to a new request before reporting it pending. With [`Duration::ZERO`] a request
    /// is polled exactly once after it is posted, so whether it is reported pending
    /// depends on the writer alone, not on wall time (a controlled scheduler's tests).
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    fn request(&self, cpu: u32, op: MailboxOp) -> Result<Reply, ReadError> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let slot = slots.get_mut(cpu as usize).ok_or(ReadError::BadCpu(cpu))?;
        if op.moves_pages() {
            if let Some(status) = slot.swap_answer.take() {
                return Ok(Reply::Done(status));
            }
        }
        if let Some((seq, pop, posted)) = slot.pending {
            match self.port.poll(cpu, seq)? {
                Some(status) => {
                    slot.pending = None;
                    if pop == op {
                        return Ok(Reply::Done(status));
                    }
                    // The answer to another op. A swap's is kept for the next swap
                    // call (the reader page changed); an update's needs nothing more.
                    // M1: a swap's answer is never dropped.
                    if pop.moves_pages() {
                        slot.swap_answer = Some(status);
                    }
                }
                None => {
                    if self.port.writer_finished(cpu) {
                        return Err(ReadError::WriterStopped { cpu });
                    }
                    // M2: the timeout runs from when a writer is attached. Before, no
                    // one can answer and nothing is stuck: its vCPU may not have run
                    // yet (on a loaded host vCPUs start up to seconds late), and a ring
                    // no writer attached to has nothing to swap.
                    if !self.port.writer_attached(cpu) {
                        slot.pending = Some((seq, pop, Instant::now()));
                        return Ok(Reply::Pending);
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
        let seq = self.port.post(cpu, op)?;
        let start = Instant::now();
        loop {
            if let Some(status) = self.port.poll(cpu, seq)? {
                return Ok(Reply::Done(status));
            }
            // A writer that said it will write no more serves no more requests either.
            if self.port.writer_finished(cpu) {
                return Err(ReadError::WriterStopped { cpu });
            }
            if start.elapsed() >= self.spin {
                slot.pending = Some((seq, op, start));
                return Ok(Reply::Pending);
            }
            std::hint::spin_loop();
        }
    }
}

impl<M: SharedMem> Callbacks for Mailbox<M> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        match self.request(cpu, MailboxOp::Swap)? {
            Reply::Pending => Ok(SwapReply::Pending),
            Reply::Done(status) => self.port.swap_status(cpu, status).map(SwapReply::Done),
        }
    }
    fn releases(&self, _cpu: u32) -> bool {
        // In stop mode the writer never moves onto a page between the head and its
        // tail, so the reader may read them in place; in overwrite mode it may.
        self.port.layout.mode == Mode::Stop
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        match self.request(cpu, MailboxOp::UpdateFooters)? {
            Reply::Pending => Ok(false),
            Reply::Done(MailboxStatus::Ok) => Ok(true),
            Reply::Done(s) => Err(ReadError::MailboxFailed {
                cpu,
                status: s.wire(),
            }),
        }
    }
}

/// The callbacks a geometry asks for: [`Mailbox`] (requests time out after
/// `mailbox_timeout`) when the writer runs its own swaps (`guest_swap`), [`Direct`]
/// otherwise. The one place that makes this choice.
pub fn for_geometry<M>(
    mem: M,
    layout: RingGeometry,
    mailbox_timeout: Duration,
) -> Box<dyn Callbacks + Send>
where
    M: SharedMem + Send + 'static,
{
    if layout.guest_swap {
        Box::new(Mailbox::new(mem, layout, mailbox_timeout))
    } else {
        Box::new(Direct::new(mem, layout))
    }
}

impl<T: Callbacks + ?Sized> Callbacks for &T {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        (**self).swap_reader(cpu)
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        (**self).update_footers(cpu)
    }
    fn releases(&self, cpu: u32) -> bool {
        (**self).releases(cpu)
    }
}

impl<T: Callbacks + ?Sized> Callbacks for Box<T> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        (**self).swap_reader(cpu)
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        (**self).update_footers(cpu)
    }
    fn releases(&self, cpu: u32) -> bool {
        (**self).releases(cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_abi::layout::Mode;
    use hyptrace_abi::HeapMem;
    use hyptrace_writer::Writer;
    use std::sync::Arc;

    fn region() -> (Arc<HeapMem>, RingGeometry) {
        let l = RingGeometry::new(1, 3, 4096, Mode::Stop, true).unwrap();
        let mem = Arc::new(HeapMem::new(l.region_size));
        l.init_region(&*mem, 1_000_000, 1);
        (mem, l)
    }

    /// Post, the writer serves, poll: the answer belongs to its request only, a swap's
    /// `Ok` names the page the writer published, an op for a CPU that is not there is
    /// refused, and a port made later continues the sequence numbers.
    #[test]
    fn port_post_poll_round_trip() {
        let (mem, l) = region();
        let port = MailboxPort::new(mem.clone(), l);
        let mut w = Writer::attach(mem.clone(), 0).unwrap();
        // More than a page of events: a full page waits for the swap.
        for ts in 1..100 {
            w.write(0, ts, &[0u8; 64]);
        }
        let seq = port.post(0, MailboxOp::Swap).unwrap();
        assert_eq!(port.poll(0, seq).unwrap(), None, "answered before served");
        assert!(w.serve_mailbox());
        let status = port.poll(0, seq).unwrap().expect("served");
        assert_eq!(status, MailboxStatus::Ok);
        let page = mem.load(l.ctl(0) + ctl::READER_PAGE, Acquire) as u32;
        assert_eq!(
            port.swap_status(0, status).unwrap(),
            SwapStatus::Swapped { page }
        );

        let next = port.post(0, MailboxOp::UpdateFooters).unwrap();
        assert_ne!(next, seq);
        assert_eq!(
            port.poll(0, next).unwrap(),
            None,
            "an old answer for a new seq"
        );
        assert!(w.serve_mailbox());
        assert_eq!(port.poll(0, next).unwrap(), Some(MailboxStatus::Ok));
        assert_eq!(
            port.poll(0, seq).unwrap(),
            None,
            "a new answer for an old seq"
        );

        assert!(matches!(
            port.post(1, MailboxOp::Swap),
            Err(ReadError::BadCpu(1))
        ));
        assert!(matches!(port.poll(1, next), Err(ReadError::BadCpu(1))));
        let later = MailboxPort::new(mem.clone(), l);
        let third = later.post(0, MailboxOp::Swap).unwrap();
        assert!(third != seq && third != next);
        assert!(!later.writer_finished(0));
    }

    /// A status byte no writer sends is the guest's word, reported as a failure (never
    /// taken for a swap), and the wire codes round-trip.
    #[test]
    fn port_foreign_status_is_a_failure() {
        let (mem, l) = region();
        let port = MailboxPort::new(mem.clone(), l);
        let seq = port.post(0, MailboxOp::Swap).unwrap();
        let req = mem.load(l.ctl(0) + ctl::MBOX_REQ, Acquire);
        assert_eq!(req & CODE_MASK, MBOX_OP_SWAP);
        mem.store(l.ctl(0) + ctl::MBOX_ACK, (req & !CODE_MASK) | 7, Release);
        let status = port.poll(0, seq).unwrap().expect("acked");
        assert_eq!(status, MailboxStatus::Failed(7));
        assert!(matches!(
            port.swap_status(0, status),
            Err(ReadError::MailboxFailed { cpu: 0, status: 7 })
        ));
        for code in 0..8 {
            assert_eq!(MailboxStatus::from_wire(code).wire(), code);
        }
    }

    /// With a spin budget of zero a request is polled once after it is posted: it is
    /// reported pending, whatever the wall time, until the writer served it; the next
    /// call then picks up the answer.
    #[test]
    fn zero_spin_is_pending_until_served() {
        let (mem, l) = region();
        let mb = Mailbox::new(mem.clone(), l, Duration::from_secs(60)).with_spin(Duration::ZERO);
        let mut w = Writer::attach(mem.clone(), 0).unwrap();
        for ts in 1..100 {
            w.write(0, ts, &[0u8; 64]);
        }
        assert_eq!(mb.swap_reader(0).unwrap(), SwapReply::Pending);
        assert_eq!(
            mb.swap_reader(0).unwrap(),
            SwapReply::Pending,
            "answered unserved"
        );
        assert!(w.serve_mailbox());
        let page = mem.load(l.ctl(0) + ctl::READER_PAGE, Acquire) as u32;
        assert_eq!(
            mb.swap_reader(0).unwrap(),
            SwapReply::Done(SwapStatus::Swapped { page })
        );
    }

    /// The geometry picks the backend: guest swap → the mailbox (a request stays in
    /// flight without a writer to serve it), host swap → direct (done at once).
    #[test]
    fn for_geometry_picks_the_backend() {
        let (mem, l) = region();
        let cb = for_geometry(mem.clone(), l, Duration::from_secs(10));
        assert_eq!(cb.swap_reader(0).unwrap(), SwapReply::Pending);
        let l = RingGeometry::new(1, 3, 4096, Mode::Stop, false).unwrap();
        let mem = Arc::new(HeapMem::new(l.region_size));
        l.init_region(&*mem, 1_000_000, 1);
        let cb = for_geometry(mem, l, Duration::from_secs(10));
        assert!(matches!(cb.swap_reader(0), Ok(SwapReply::Done(_))));
    }
}
