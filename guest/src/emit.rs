//! How workloads emit events. Everything goes through [`Sink::write`]: the vCPU's
//! ring-buffer writer ([`WriterSink`]): a plain memory write and a Release store of
//! `commit`, never an exit.

use hyptrace_abi::events;
use hyptrace_abi::RawMem;
use hyptrace_writer::Writer;

use crate::builtin::{MARKER, SPAN, TEXT};
use crate::rt::rdtsc;

/// Where events go.
pub trait Sink {
    /// Writes one event of enable-slot `slot` with timestamp `ts` (TSC): counted as
    /// attempted, and as skipped if its enable bit is clear (the writer's published
    /// counters, invariant R3).
    fn write(&mut self, slot: u32, ts: u64, payload: &[u8]);
    /// Counts one event as attempted and skipped without writing it (an event the host
    /// rejected).
    fn skip(&mut self);
    /// Called from idle (busy-wait) loops: serve the host's mailbox.
    fn idle(&mut self) {}
    /// While `hold`, [`Sink::write`] does not serve the mailbox (a guest writing in a
    /// section it will not interrupt); idle loops still do, and the release serves once.
    fn hold_mailbox(&mut self, _hold: bool) {}
}

/// The ring-buffer writer of this vCPU. In `--swap guest` mode it serves the host's
/// mailbox between events (one relaxed load each; not while held) and in idle loops.
pub struct WriterSink {
    w: Writer<RawMem>,
    serve: bool,
    held: bool,
}

impl WriterSink {
    /// Wraps the attached writer.
    pub fn new(w: Writer<RawMem>, serve: bool) -> Self {
        Self {
            w,
            serve,
            held: false,
        }
    }

    /// The writer.
    pub fn writer(&mut self) -> &mut Writer<RawMem> {
        &mut self.w
    }
}

impl Sink for WriterSink {
    #[inline(always)]
    fn write(&mut self, slot: u32, ts: u64, payload: &[u8]) {
        // The writer counts the attempt, and a disabled event as skipped; dropped (ring
        // full) and the rest are attempted-and-enabled (dropped / corrupt).
        self.w.write(slot, ts, payload);
        if self.serve && !self.held {
            self.w.serve_mailbox();
        }
    }

    #[inline(always)]
    fn skip(&mut self) {
        self.w.skip();
    }

    #[inline(always)]
    fn idle(&mut self) {
        if self.serve {
            self.w.serve_mailbox();
        }
    }

    fn hold_mailbox(&mut self, hold: bool) {
        self.held = hold;
        // Released: serve what waited (a late pacer may go on with no idle loop).
        if !hold && self.serve {
            self.w.serve_mailbox();
        }
    }
}

/// Builds the built-in events of one vCPU (one `seq` counter across all types); the
/// writer counts them (attempted, skipped). Their ids are the ones the host assigned at registration
/// ([`crate::builtin`]); an event the host rejected is never written (skipped).
pub struct Emitter<S: Sink> {
    sink: S,
    pid: i32,
    seq: u64,
    /// Assigned ids of marker, span, text (`None`: rejected).
    ids: [Option<u16>; 3],
}

impl<S: Sink> Emitter<S> {
    /// An emitter for vCPU `cpu` writing into `sink`, once the built-in events are
    /// registered.
    pub fn new(sink: S, cpu: u32) -> Self {
        Self {
            sink,
            pid: events::vcpu_pid(cpu),
            seq: 0,
            ids: [MARKER.id(), SPAN.id(), TEXT.id()],
        }
    }

    /// The one place an event is written.
    #[inline(always)]
    pub fn emit(&mut self, slot: u32, payload: &[u8]) {
        let ts = rdtsc();
        self.sink.write(slot, ts, payload);
    }

    /// Idle hook (serves the mailbox in `--swap guest` mode).
    #[inline(always)]
    pub fn idle(&mut self) {
        self.sink.idle();
    }

    /// See [`Sink::hold_mailbox`].
    pub fn hold_mailbox(&mut self, hold: bool) {
        self.sink.hold_mailbox(hold);
    }

    /// The sink.
    pub fn sink(&mut self) -> &mut S {
        &mut self.sink
    }

    fn next_seq(&mut self) -> u64 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    /// Writes a built-in event whose common header says id `id` (the assigned one, or
    /// skipped if the host rejected the event).
    #[inline(always)]
    fn emit_builtin(&mut self, id: Option<u16>, slot: u32, payload: &mut [u8]) {
        match id {
            Some(id) => {
                payload[..2].copy_from_slice(&id.to_le_bytes());
                self.emit(slot, payload);
            }
            None => self.sink.skip(),
        }
    }

    /// `guest:marker`.
    pub fn marker(&mut self, value: u64) {
        let seq = self.next_seq();
        let mut p = events::marker(self.pid, seq, value);
        self.emit_builtin(self.ids[0], events::MARKER_SLOT, &mut p);
    }

    /// `guest:span`.
    pub fn span(&mut self, id: u64, dur: u64) {
        let seq = self.next_seq();
        let mut p = events::span(self.pid, seq, id, dur);
        self.emit_builtin(self.ids[1], events::SPAN_SLOT, &mut p);
    }

    /// `guest:text`; `msg` (no NUL) is truncated to [`events::TEXT_MAX_MSG`] bytes.
    pub fn text(&mut self, msg: &[u8]) {
        let seq = self.next_seq();
        let msg = &msg[..msg.len().min(events::TEXT_MAX_MSG)];
        let mut buf = [0u8; events::TEXT_STR_OFFSET + events::TEXT_MAX_MSG + 1];
        if let Some(len) = events::text(&mut buf, self.pid, seq, msg) {
            self.emit_builtin(self.ids[2], events::TEXT_SLOT, &mut buf[..len]);
        }
    }
}
