//! What the VMM's one reader read for a subscriber and nobody has taken yet (docs/design.md,
//! "One reader, subscribers", C1–C4).
//!
//! Per CPU, a queue of **pieces** in reading order: each a page of its own (a whole ring
//! page, or the part of one from the reading position on, [`RingBuffer::next_piece`]),
//! with the index of its first event and the events lost right before it; the last item
//! of a CPU whose reading ended is its **end** (the events lost after its last piece).
//! Every item has a sequence number, per CPU, from 1 up. A subscriber is sent items
//! ([`Outbox::send`]) and acknowledges them by sequence number ([`Outbox::ack`]): only a
//! number the VMM sent (C2: a position the VMM delivered). What it acknowledged is its
//! own and is dropped here; what was sent and not acknowledged when it leaves goes back
//! to the front, unsent ([`Outbox::unsend`]), for the next subscriber or the VMM's own
//! output ([`Outbox::pop`]), which take items only from the front (C1: one order).
//!
//! Bounded: a CPU's queue holds at most [`OUTBOX_BYTES`] of pieces (plus the one being
//! added); the reader reads no more of that CPU until the subscriber acknowledged some
//! ([`Outbox::full`]) — the ring, not host memory, takes the backlog.
//!
//! [`RingBuffer::next_piece`]: hyptrace_reader::RingBuffer::next_piece

use std::collections::VecDeque;

use hyptrace_abi::page::PAGE_HEADER_SIZE;
use hyptrace_reader::{seeded, PageOut};

/// Bytes of pieces a CPU's queue holds at most before its reading waits.
pub const OUTBOX_BYTES: usize = 4 << 20;

/// One item of a CPU's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// A page of events.
    Piece(Piece),
    /// The CPU's reading ended: `lost` events were lost after its last piece.
    End {
        /// Events lost after the last piece (stop mode: dropped while the ring was full).
        lost: u64,
    },
}

/// A page of events read from a ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The index of its first event.
    pub first: u64,
    /// Its events.
    pub events: u64,
    /// Events lost right before it.
    pub missed: u64,
    /// The page header (time stamp, commit = the data's length) and the data (shared
    /// with the batches that send it: [`Outbox::send`] copies nothing).
    pub bytes: bytes::Bytes,
}

impl Piece {
    /// The piece `p` as the reader handed it out: its header and committed data only.
    pub fn of(p: &PageOut<'_>) -> Self {
        let len = (PAGE_HEADER_SIZE + p.commit_len).min(p.bytes.len());
        Self {
            first: p.first_index,
            events: p.events,
            missed: p.missed,
            bytes: bytes::Bytes::copy_from_slice(&p.bytes[..len]),
        }
    }
}

/// A sequenced item.
#[derive(Debug, Clone)]
struct Queued {
    seq: u64,
    item: Item,
}

impl Queued {
    /// Bytes of its piece (an end has none).
    fn len(&self) -> usize {
        match &self.item {
            Item::Piece(p) => p.bytes.len(),
            Item::End { .. } => 0,
        }
    }
}

/// One CPU's queue.
#[derive(Debug, Default)]
struct CpuBox {
    /// In order; the first `sent` were sent to the subscriber and not acknowledged.
    items: VecDeque<Queued>,
    sent: usize,
    /// Bytes of the pieces in `items`.
    bytes: usize,
    /// Bytes of the pieces among the first `sent` items.
    sent_bytes: usize,
    /// The sequence number of the last item queued (0: none yet).
    last_seq: u64,
    /// The sequence number of the last item acknowledged (0: none yet).
    acked: u64,
    /// The CPU's end was queued.
    ended: bool,
}

/// What a subscriber acknowledged on one CPU ([`Outbox::ack`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Acked {
    /// The index after the last event acknowledged (0: no piece).
    pub through: Option<u64>,
    /// The end was acknowledged: everything of the CPU is the subscriber's.
    pub end: bool,
}

/// Why an acknowledgement is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    /// No such CPU.
    #[error("no CPU {0}")]
    Cpu(u32),
    /// Not a sequence number sent, or one before the last acknowledged (C2).
    #[error(
        "cpu {cpu}: item {seq} was not delivered (acknowledged through {from}, sent through {to})"
    )]
    NotSent {
        /// The CPU.
        cpu: u32,
        /// The number named.
        seq: u64,
        /// The last number acknowledged.
        from: u64,
        /// The last number sent.
        to: u64,
    },
}

/// A batch sent to a subscriber ([`Outbox::send`]).
#[derive(Debug, Default)]
pub struct Batch {
    /// Per item: its CPU, sequence number and the item (pieces' bytes in `data`).
    pub items: Vec<(u32, u64, BatchItem)>,
    /// The pieces' bytes, in the items' order (the queued pieces themselves, shared).
    pub data: Vec<bytes::Bytes>,
    /// Their length in all.
    pub len: usize,
}

/// An item of a [`Batch`] (on the wire: `{"piece":{...}}` or `{"end":{"lost":N}}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchItem {
    /// A piece: its first index, events, losses before it, its length in `data`.
    Piece {
        /// The index of its first event.
        first: u64,
        /// Its events.
        events: u64,
        /// Events lost right before it.
        missed: u64,
        /// Its length (header and data) in the batch's `data`.
        len: usize,
    },
    /// The CPU's end.
    End {
        /// Events lost after its last piece.
        lost: u64,
    },
}

/// Events sent to a subscriber that left without acknowledging them (they go out again).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsent {
    /// The CPU.
    pub cpu: u32,
    /// The first event's index.
    pub first: u64,
    /// Events.
    pub events: u64,
}

/// The queues of every CPU.
#[derive(Debug)]
pub struct Outbox {
    cpus: Vec<CpuBox>,
    /// Bytes of pieces a CPU's queue holds before its reading waits.
    cap: usize,
    /// The CPU [`Outbox::send`] starts at (rotates: no CPU starves the others).
    next_cpu: usize,
}

impl Outbox {
    /// Empty queues for `nr` CPUs, each holding up to [`OUTBOX_BYTES`].
    pub fn new(nr: u32) -> Self {
        Self::with_capacity(nr, OUTBOX_BYTES)
    }

    /// Empty queues for `nr` CPUs, each holding up to `cap` bytes of pieces (the models
    /// take a few pages, so that a subscriber holds the reading back).
    pub fn with_capacity(nr: u32, cap: usize) -> Self {
        Self {
            cpus: (0..nr).map(|_| CpuBox::default()).collect(),
            cap,
            next_cpu: 0,
        }
    }

    /// Whether `cpu`'s queue is at its capacity or past it: read no more of it now.
    pub fn full(&self, cpu: u32) -> bool {
        self.cpus
            .get(cpu as usize)
            .is_none_or(|b| b.bytes >= self.cap)
    }

    /// Bytes of pieces queued and not sent, over every CPU (what a `send` could take).
    pub fn unsent_bytes(&self) -> usize {
        self.cpus
            .iter()
            .map(|b| b.bytes.saturating_sub(b.sent_bytes))
            .sum()
    }

    /// Whether `cpu`'s end was queued (its reading is over).
    pub fn ended(&self, cpu: u32) -> bool {
        self.cpus.get(cpu as usize).is_some_and(|b| b.ended)
    }

    fn queue(&mut self, cpu: u32, item: Item) {
        let Some(b) = self.cpus.get_mut(cpu as usize) else {
            return;
        };
        if let Item::Piece(p) = &item {
            b.bytes += p.bytes.len();
        }
        b.last_seq += 1;
        b.items.push_back(Queued {
            seq: b.last_seq,
            item,
        });
    }

    /// Queues a piece of `cpu` (one with neither events nor a loss says nothing: dropped).
    pub fn push(&mut self, cpu: u32, piece: Piece) {
        if piece.events > 0 || piece.missed > 0 {
            self.queue(cpu, Item::Piece(piece));
        }
    }

    /// Queues `cpu`'s end, after its last piece (once).
    pub fn end(&mut self, cpu: u32, lost: u64) {
        if self.cpus.get(cpu as usize).is_some_and(|b| !b.ended) {
            self.queue(cpu, Item::End { lost });
            self.cpus[cpu as usize].ended = true;
        }
    }

    /// Sends the unsent items, every CPU in turn, up to `max_bytes` of pieces and
    /// `max_items` items (at least one item when there is one): they are the
    /// subscriber's to acknowledge from now on.
    pub fn send(&mut self, max_bytes: usize, max_items: usize) -> Batch {
        let mut batch = Batch::default();
        let nr = self.cpus.len();
        let start = self.next_cpu;
        self.next_cpu = if nr == 0 { 0 } else { (start + 1) % nr };
        for k in 0..nr {
            let cpu = (start + k) % nr;
            let b = &mut self.cpus[cpu];
            while let Some(q) = b.items.get(b.sent) {
                let len = q.len();
                let room = batch.len + len <= max_bytes && batch.items.len() < max_items;
                if !room && !batch.items.is_empty() {
                    return batch;
                }
                let item = match &q.item {
                    Item::Piece(p) => {
                        batch.data.push(p.bytes.clone());
                        batch.len += len;
                        BatchItem::Piece {
                            first: p.first,
                            events: p.events,
                            missed: p.missed,
                            len,
                        }
                    }
                    Item::End { lost } => BatchItem::End { lost: *lost },
                };
                batch.items.push((cpu as u32, q.seq, item));
                b.sent += 1;
                b.sent_bytes += len;
            }
        }
        batch
    }

    /// The subscriber took `cpu`'s items through sequence number `seq` (C2: one it was
    /// sent, at or after the last it acknowledged — the same again is no news). They
    /// are dropped here.
    pub fn ack(&mut self, cpu: u32, seq: u64) -> Result<Acked, AckError> {
        let b = self.cpus.get_mut(cpu as usize).ok_or(AckError::Cpu(cpu))?;
        let from = b.acked;
        let to = if b.sent == 0 {
            b.acked
        } else {
            b.items[b.sent - 1].seq
        };
        // (Seeded bug `ack_unchecked`, docs/fuzzing.md: any number taken.)
        if (seq < from || seq > to) && !seeded::on("ack_unchecked") {
            return Err(AckError::NotSent { cpu, seq, from, to });
        }
        b.acked = seq;
        let mut acked = Acked::default();
        while b.items.front().is_some_and(|q| q.seq <= seq) {
            let Some(q) = b.items.pop_front() else { break };
            b.sent = b.sent.saturating_sub(1);
            // Every item through `seq` was sent (checked above).
            b.sent_bytes = b.sent_bytes.saturating_sub(q.len());
            match q.item {
                Item::Piece(p) => {
                    b.bytes -= p.bytes.len();
                    acked.through = Some(p.first.saturating_add(p.events));
                }
                Item::End { .. } => acked.end = true,
            }
        }
        Ok(acked)
    }

    /// The subscriber left: what it was sent and did not acknowledge is unsent again (at
    /// the front, in order). Returns those pieces' events per CPU (they may be in the
    /// subscriber's output as well: C4 names them).
    pub fn unsend(&mut self) -> Vec<Unsent> {
        let mut out = Vec::new();
        for (cpu, b) in (0u32..).zip(&mut self.cpus) {
            let pieces = b.items.iter().take(b.sent).filter_map(|q| match &q.item {
                Item::Piece(p) if p.events > 0 => Some((p.first, p.events)),
                _ => None,
            });
            let mut span: Option<Unsent> = None;
            for (first, events) in pieces {
                let s = span.get_or_insert(Unsent {
                    cpu,
                    first,
                    events: 0,
                });
                s.events = first.saturating_add(events).saturating_sub(s.first);
            }
            out.extend(span);
            // (Seeded bug `unsend_dropped`, docs/fuzzing.md: the unacknowledged dropped.)
            if seeded::on("unsend_dropped") {
                for q in b.items.drain(..b.sent) {
                    if let Item::Piece(p) = q.item {
                        b.bytes -= p.bytes.len();
                    }
                }
            }
            b.sent = 0;
            b.sent_bytes = 0;
        }
        out
    }

    /// The front item of `cpu` for the VMM's own output (only while nothing is sent).
    pub fn pop(&mut self, cpu: u32) -> Option<Item> {
        let b = self.cpus.get_mut(cpu as usize)?;
        if b.sent != 0 {
            return None;
        }
        let q = b.items.pop_front()?;
        if let Item::Piece(p) = &q.item {
            b.bytes -= p.bytes.len();
        }
        Some(q.item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(first: u64, events: u64, len: usize) -> Piece {
        Piece {
            first,
            events,
            missed: 0,
            bytes: vec![0; len].into(),
        }
    }

    /// Items go out in order, every CPU in turn, within the byte bound; only what was
    /// sent can be acknowledged; what is not acknowledged goes out again, first.
    #[test]
    fn send_ack_unsend() {
        let mut o = Outbox::new(2);
        for i in 0..4 {
            o.push(0, piece(i * 10, 10, 100));
        }
        o.push(1, piece(0, 5, 100));
        o.push(1, piece(5, 0, 100)); // nothing in it: dropped
        o.end(1, 3);
        let b = o.send(250, 100);
        let seqs: Vec<(u32, u64)> = b.items.iter().map(|i| (i.0, i.1)).collect();
        assert_eq!(seqs, vec![(0, 1), (0, 2)]);
        assert_eq!((b.data.len(), b.len), (2, 200));
        assert_eq!(o.unsent_bytes(), 3 * 100);
        // Never sent, or already acknowledged: refused.
        assert!(o.ack(0, 3).is_err());
        assert!(o.ack(1, 1).is_err());
        assert!(o.ack(0, 0).is_ok(), "nothing acknowledged yet");
        assert_eq!(
            o.ack(0, 1),
            Ok(Acked {
                through: Some(10),
                end: false
            })
        );
        assert!(o.ack(0, 1).is_ok(), "the same again is no news");
        assert!(o.ack(0, 0).is_err(), "going back");
        assert_eq!(o.unsent_bytes(), 3 * 100, "an ack changes nothing unsent");
        let b = o.send(1 << 20, 100);
        assert_eq!(o.unsent_bytes(), 0);
        let seqs: Vec<(u32, u64)> = b.items.iter().map(|i| (i.0, i.1)).collect();
        assert_eq!(seqs, vec![(1, 1), (1, 2), (0, 3), (0, 4)]);
        assert_eq!(b.items[1].2, BatchItem::End { lost: 3 });
        assert_eq!(o.ack(1, 2).map(|a| a.end), Ok(true));
        // The subscriber leaves with 0's pieces 2..=4 unacknowledged.
        let u = o.unsend();
        assert_eq!(
            u,
            vec![Unsent {
                cpu: 0,
                first: 10,
                events: 30
            }]
        );
        assert_eq!(o.unsent_bytes(), 3 * 100, "unsent again");
        assert!(matches!(o.pop(0), Some(Item::Piece(p)) if p.first == 10));
        let b = o.send(1 << 20, 100);
        assert_eq!(b.items.len(), 2);
        assert_eq!(o.unsent_bytes(), 0);
        assert!(o.pop(0).is_none(), "sent items are the subscriber's");
        assert!(o.ack(0, 4).is_ok());
        assert!(o.cpus.iter().all(|b| b.items.is_empty() && b.bytes == 0));
    }

    /// The byte bound: a CPU's queue is full at OUTBOX_BYTES; one item always goes out.
    #[test]
    fn bounds() {
        let mut o = Outbox::new(1);
        while !o.full(0) {
            o.push(0, piece(0, 1, 4096));
        }
        assert_eq!(o.cpus[0].bytes, OUTBOX_BYTES);
        assert_eq!(
            o.send(1, 100).items.len(),
            1,
            "one item even past the bound"
        );
        assert_eq!(o.send(1 << 30, 3).items.len(), 3);
        assert!(o.full(7) && o.pop(7).is_none() && o.ack(7, 1).is_err());
    }
}
