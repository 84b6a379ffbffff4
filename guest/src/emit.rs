//! How workloads emit events. Everything goes through [`Sink::write`]: today
//! [`ScratchSink`] stores the payload into a scratch buffer (a plain memory store, no
//! exit); the ring-buffer integration swaps in a sink backed by the writer's
//! `write(slot, ts, payload)`.

use hyptrace_abi::events;

use crate::rt::rdtsc;

/// Where events go.
pub trait Sink {
    /// Writes one event of enable-slot `slot` with timestamp `ts` (TSC). Returns `false`
    /// if it was not written because the event is disabled (counted as skipped).
    fn write(&mut self, slot: u32, ts: u64, payload: &[u8]) -> bool;
}

/// Stand-in sink until the writer lands: copies the payload into a scratch buffer.
pub struct ScratchSink {
    buf: [u8; 512],
    last_ts: u64,
    last_slot: u32,
}

impl ScratchSink {
    /// A sink with an empty scratch buffer.
    pub const fn new() -> Self {
        Self {
            buf: [0; 512],
            last_ts: 0,
            last_slot: 0,
        }
    }
}

impl Sink for ScratchSink {
    #[inline]
    fn write(&mut self, slot: u32, ts: u64, payload: &[u8]) -> bool {
        let n = payload.len().min(self.buf.len());
        self.buf[..n].copy_from_slice(&payload[..n]);
        self.last_ts = ts;
        self.last_slot = slot;
        // Keep the stores: the optimiser must not drop an unobserved buffer.
        core::hint::black_box(&mut *self);
        true
    }
}

/// Builds the built-in events of one vCPU (one `seq` counter across all types) and
/// counts them.
pub struct Emitter<S: Sink> {
    sink: S,
    pid: i32,
    seq: u64,
    /// Events attempted (written or skipped).
    pub attempted: u64,
    /// Events not written because they were disabled.
    pub skipped: u64,
}

impl<S: Sink> Emitter<S> {
    /// An emitter for vCPU `cpu` writing into `sink`.
    pub fn new(sink: S, cpu: u32) -> Self {
        Self {
            sink,
            pid: events::vcpu_pid(cpu),
            seq: 0,
            attempted: 0,
            skipped: 0,
        }
    }

    /// The one place an event is written.
    #[inline(always)]
    pub fn emit(&mut self, slot: u32, payload: &[u8]) {
        self.attempted += 1;
        let ts = rdtsc();
        if !self.sink.write(slot, ts, payload) {
            self.skipped += 1;
        }
    }

    fn next_seq(&mut self) -> u64 {
        let s = self.seq;
        self.seq += 1;
        s
    }

    /// `guest:marker`.
    pub fn marker(&mut self, value: u64) {
        let seq = self.next_seq();
        let p = events::marker(self.pid, seq, value);
        self.emit(events::MARKER_SLOT, &p);
    }

    /// `guest:span`.
    pub fn span(&mut self, id: u64, dur: u64) {
        let seq = self.next_seq();
        let p = events::span(self.pid, seq, id, dur);
        self.emit(events::SPAN_SLOT, &p);
    }

    /// `guest:text`; `msg` (no NUL) is truncated to [`events::TEXT_MAX_MSG`] bytes.
    pub fn text(&mut self, msg: &[u8]) {
        let seq = self.next_seq();
        let msg = &msg[..msg.len().min(events::TEXT_MAX_MSG)];
        let mut buf = [0u8; events::TEXT_STR_OFFSET + events::TEXT_MAX_MSG + 1];
        if let Some(len) = events::text(&mut buf, self.pid, seq, msg) {
            self.emit(events::TEXT_SLOT, &buf[..len]);
        }
    }
}
