//! The session's side of subscribers (docs/design.md, "One reader, subscribers", C1–C4):
//! while a subscriber holds the claim this session — the one reader of every ring —
//! reads into the [`Outbox`] instead of its own output; the subscriber takes what it was
//! sent by acknowledging it; what nobody took goes to the own output first, in order,
//! once nobody subscribes.

use hyptrace_abi::page::{page_header, Events, PAGE_HEADER_SIZE};

use super::print::merge_event;
use super::{Output, Session, SessionError, ROUND_MAX_TIME};

/// Most bytes one round reads of one CPU into the outbox: a `fetch` that comes meanwhile
/// waits for the round (the run loop serves between rounds), so a round is a fraction of
/// a fetch ([`crate::control::protocol::MAX_FETCH_BYTES`]); the loop comes back at once
/// while there is more ([`Session::backlog`]).
const PIECES_ROUND_BYTES: usize = 256 << 10;
use crate::drain::outbox::{AckError, Batch, Item, Outbox, Piece, Unsent};
use hyptrace_abi::SharedMem;
use hyptrace_output::Missed;
use hyptrace_reader::{Callbacks, ReadError};

impl<M: SharedMem, C: Callbacks> Session<M, C> {
    /// Whether the CPUs whose vCPU runs are read now: `--drain live`, or while a
    /// subscriber holds the claim (with `--drain none` nobody reads otherwise).
    pub(super) fn reads_live(&self) -> bool {
        self.live_drain || self.subscriber.is_some()
    }

    /// A subscriber took the claim: from now on every ring is read into the outbox
    /// (C1), in `partial` pieces (the writer's page as far as it is committed: a text
    /// stream) or whole pages only.
    pub fn subscribe(&mut self, partial: bool) {
        self.subscriber = Some(partial);
    }

    /// Subscribers' pieces wait in queues of `bytes` per CPU instead of
    /// [`crate::drain::outbox::OUTBOX_BYTES`] (the models: a few pages, so that a
    /// subscriber holds the reading back).
    pub fn with_outbox_bytes(mut self, bytes: usize) -> Self {
        self.outbox = Outbox::with_capacity(self.reader.nr_cpus(), bytes);
        self
    }

    /// Whether the reading of `cpu` waits for the subscriber (its queue is full).
    pub fn held(&self, cpu: u32) -> bool {
        self.subscriber.is_some() && self.outbox.full(cpu)
    }

    /// The subscriber left (detached, disconnected, or timed out): reading goes to the
    /// own output again (with `--drain none`: only once a vCPU stopped). What it was
    /// sent and did not acknowledge goes out again first (C1); returned, for the caller
    /// to name (C4: it may also be in the subscriber's output).
    pub fn unsubscribe(&mut self) -> Vec<Unsent> {
        self.subscriber = None;
        self.outbox.unsend()
    }

    /// A read round for a `fetch` (C1): what the run loop's round ([`Session::service`])
    /// does — a bounded poll of each live CPU, the final walk of those whose vCPU stopped
    /// (`vcpu_stopped`) — so that the answer holds what was committed when it came; the
    /// failures go to the loop's next round, which reports them.
    pub fn read_for_fetch(&mut self, vcpu_stopped: &dyn Fn(u32) -> bool, max_bytes: usize) {
        // What is read already fills the answer: it goes out at once, and the loop's
        // next round reads on meanwhile (reading first kept the subscriber waiting for
        // it, one side working at a time).
        if self.outbox.unsent_bytes() >= max_bytes {
            return;
        }
        let failed = self.service(vcpu_stopped);
        self.deferred.extend(failed);
    }

    /// The next batch for the subscriber: at most `max_bytes` of pieces and `max_items`
    /// items, every CPU in turn ([`crate::drain::outbox::Outbox::send`]).
    pub fn send(&mut self, max_bytes: usize, max_items: usize) -> Batch {
        self.outbox.send(max_bytes, max_items)
    }

    /// The subscriber took `cpu`'s items through `seq` (C2: a number it was sent). Its
    /// events count as output (P2); an end taken ends the CPU here (C4: the own output
    /// writes nothing of it).
    pub fn ack(&mut self, cpu: u32, seq: u64) -> Result<(), AckError> {
        let a = self.outbox.ack(cpu, seq)?;
        if let (Some(t), Some(p)) = (a.through, self.printed.get_mut(cpu as usize)) {
            *p = (*p).max(t);
        }
        if a.end && self.mark_ended(cpu) {
            if let Output::Text { merger, .. } = &mut self.output {
                merger.finish(cpu as usize);
            }
        }
        Ok(())
    }

    /// One bounded round of reading `cpu` into the outbox: returns whether it stopped at
    /// a bound (more may be there); not while the outbox of `cpu` is full (the
    /// subscriber takes first; the ring holds the rest meanwhile).
    pub(super) fn drain_pieces(&mut self, cpu: u32, partial: bool) -> Result<bool, SessionError> {
        let started = std::time::Instant::now();
        let mut bytes = 0usize;
        loop {
            if self.outbox.full(cpu) {
                return Ok(false);
            }
            if bytes >= PIECES_ROUND_BYTES || (bytes > 0 && started.elapsed() >= ROUND_MAX_TIME) {
                return Ok(true);
            }
            let Some(p) = self.reader.next_piece(cpu, partial)? else {
                return Ok(false);
            };
            bytes = bytes.saturating_add(p.commit_len.max(1));
            let piece = Piece::of(&p);
            self.outbox.push(cpu, piece);
        }
    }

    /// C1: what a subscriber left of `cpu` (read, not taken) goes to the own output
    /// before anything read after it; its end's losses wait for the CPU's end.
    pub(super) fn output_outbox(&mut self, cpu: u32) -> Result<(), SessionError> {
        while let Some(item) = self.outbox.pop(cpu) {
            match item {
                Item::End { lost } => {
                    let st = &mut self.cpus[cpu as usize];
                    st.pending_lost = st.pending_lost.saturating_add(lost);
                }
                Item::Piece(p) => self.output_piece(cpu, &p)?,
            }
        }
        Ok(())
    }

    /// Writes the piece `p` of `cpu` to the own output: a page (padded to the page size)
    /// into a page sink, its events into the text merger.
    fn output_piece(&mut self, cpu: u32, p: &Piece) -> Result<(), SessionError> {
        let st = &mut self.cpus[cpu as usize];
        match &mut self.output {
            Output::Pages(sink) => {
                let size = self.reader.layout().page_size;
                self.scratch.clear();
                self.scratch.resize(size, 0);
                let n = p.bytes.len().min(size);
                self.scratch[..n].copy_from_slice(&p.bytes[..n]);
                let missed = std::mem::take(&mut st.pending_lost).saturating_add(p.missed);
                sink.page(cpu, &self.scratch, Missed::count(missed))?;
            }
            Output::Text {
                merger, payloads, ..
            } => {
                st.pending_lost = st.pending_lost.saturating_add(p.missed);
                let (ts, _) = page_header(&p.bytes).unwrap_or((0, 0));
                let data = p.bytes.get(PAGE_HEADER_SIZE..).unwrap_or(&[]);
                let fifo = &mut payloads[cpu as usize];
                for ev in Events::new(data, ts) {
                    // Validated when it was read (RingBuffer::next_piece).
                    let ev = ev.map_err(|err| ReadError::Decode { cpu, page: 0, err })?;
                    merge_event(merger, fifo, st, cpu, self.clock.to_ns(ev.ts), ev.payload);
                }
            }
        }
        Ok(())
    }
}
