//! The consuming read of a CPU: its events one by one ([`RingBuffer::next_event`]) or
//! its pages whole ([`RingBuffer::next_page`], [`RingBuffer::next_piece`]).

use hyptrace_abi::page::{self, Record, COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_abi::SharedMem;

use crate::{
    seeded, Callbacks, CpuState, Item, PageOut, ReadError, RingBuffer, MAX_SWAPS_PER_CALL,
};

impl<M: SharedMem, C: Callbacks> RingBuffer<M, C> {
    /// The next item of `cpu`'s consuming read: an event, or the count of events lost
    /// right here. `Ok(None)` when nothing more is committed now.
    pub fn next_event(&mut self, cpu: u32) -> Result<Option<Item<'_>>, ReadError> {
        self.check_cpu(cpu)?;
        let mut swaps = 0;
        loop {
            let st = &mut self.cpus[cpu as usize];
            if st.pending_lost > 0 {
                let n = std::mem::take(&mut st.pending_lost);
                st.stats.lost = st.stats.lost.saturating_add(n);
                return Ok(Some(Item::Lost(n)));
            }
            // Decode what is already copied (each record advances `read`; bounded by the page).
            while st.read < st.copied {
                let data = &st.buf[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + st.copied];
                let (rec, next) = match page::decode_record(data, st.read) {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        st.read = st.copied;
                        break;
                    }
                    Err(err) => {
                        return Err(ReadError::Decode {
                            cpu,
                            page: st.reader,
                            err,
                        })
                    }
                };
                let size = next - st.read;
                st.read = next;
                st.stats.bytes += size as u64;
                match rec {
                    Record::Data { delta, start, len } => {
                        st.clock = st.clock.wrapping_add(delta);
                        st.page_events += 1;
                        st.expected = st.expected.saturating_add(1);
                        st.stats.read += 1;
                        let ts = st.clock;
                        let st = &self.cpus[cpu as usize];
                        let a = PAGE_HEADER_SIZE + start;
                        return Ok(Some(Item::Event {
                            ts,
                            payload: &st.buf[a..a + len],
                        }));
                    }
                    Record::TimeExtend { delta } => st.clock = st.clock.wrapping_add(delta),
                    Record::TimeStamp { ts } => st.clock = ts,
                    Record::Padding { .. } => {}
                }
            }
            if self.cpus[cpu as usize].swap_in_flight {
                if swaps >= MAX_SWAPS_PER_CALL || !self.advance(cpu)? {
                    return Ok(None);
                }
                swaps += 1;
                continue;
            }
            // Order: the tail is loaded before the commit, so if the writer has left
            // the page, the commit loaded after is final.
            let writer_here = self.writer_on_reader(cpu)?;
            let st = &mut self.cpus[cpu as usize];
            Self::refresh(&self.mem, &self.layout, st)?;
            if st.read < st.copied {
                continue;
            }
            if writer_here || swaps >= MAX_SWAPS_PER_CALL {
                return Ok(None);
            }
            if !self.advance(cpu)? {
                let n = self.take_trailing_loss(cpu);
                return Ok((n > 0).then_some(Item::Lost(n)));
            }
            swaps += 1;
        }
    }

    /// The next complete page of `cpu` (consuming), for page-at-a-time output: what
    /// [`RingBuffer::next_piece`] hands out with `partial` false. A page is handed out
    /// once the writer has left it (or, in the final walk, as it is). `Ok(None)` when no
    /// complete page is available now.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use hyptrace_abi::{events, HeapMem, Mode, RingGeometry};
    /// # use hyptrace_reader::{Direct, RingBuffer};
    /// let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
    /// let mem = Arc::new(HeapMem::new(l.region_size));
    /// let mut reader = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 1_000_000, 1)?;
    /// let mut w = hyptrace_writer::Writer::attach(mem.clone(), 0)?;
    /// for seq in 0..200 { // 24-byte markers: more than one page
    ///     w.write_enabled(seq, &events::marker(events::vcpu_pid(0), seq, 0));
    /// }
    /// let page = reader.next_page(0)?.expect("a full page"); // swapped out of the ring
    /// assert_eq!((page.bytes.len(), page.missed, page.first_ts), (4096, 0, Some(0)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn next_page(&mut self, cpu: u32) -> Result<Option<PageOut<'_>>, ReadError> {
        self.next_piece(cpu, false)
    }

    /// The next piece of `cpu`'s consuming read (invariant C1, docs/design.md "One
    /// reader"): the committed part of the reader page not handed out yet, from the
    /// reading position (a record boundary) to the commit, as a page of its own — time
    /// stamp the clock at that position, commit its length — so every sink takes it. From
    /// the start of a page it is the page itself. With `partial` false only once the
    /// writer has left the page (its commit is final, W1; in the final walk at once);
    /// with `partial` true also the part of the writer's page committed so far.
    /// Events, pieces and pages of one CPU may be read in any mix: each starts where the
    /// last one stopped. `Ok(None)` when nothing is available now.
    pub fn next_piece(
        &mut self,
        cpu: u32,
        partial: bool,
    ) -> Result<Option<PageOut<'_>>, ReadError> {
        self.check_cpu(cpu)?;
        if !self.piece_ready(cpu, partial)? {
            return Ok(None);
        }
        Self::hand_out(&mut self.cpus[cpu as usize]).map(Some)
    }

    /// Moves `cpu`'s reader (swaps, bounded) until it stands before a piece
    /// [`RingBuffer::next_piece`] may hand out; false when there is none now.
    fn piece_ready(&mut self, cpu: u32, partial: bool) -> Result<bool, ReadError> {
        for _ in 0..=MAX_SWAPS_PER_CALL {
            if self.cpus[cpu as usize].swap_in_flight {
                if !self.advance(cpu)? {
                    return Ok(false);
                }
                continue;
            }
            let writer_here = self.writer_on_reader(cpu)?;
            let st = &mut self.cpus[cpu as usize];
            Self::refresh(&self.mem, &self.layout, st)?;
            if st.read < st.copied && (partial || !writer_here) {
                return Ok(true);
            }
            if writer_here || !self.advance(cpu)? {
                return Ok(false);
            }
        }
        Ok(false)
    }

    /// Hands out `st`'s reader page from its reading position to what is copied (C1):
    /// validates and counts the events first (a page that does not decode is an error,
    /// nothing of it is counted), then moves the position to the end.
    fn hand_out(st: &mut CpuState) -> Result<PageOut<'_>, ReadError> {
        // (Seeded bug `piece_from_start`, docs/fuzzing.md: the reading position ignored.)
        let from = if seeded::on("piece_from_start") {
            0
        } else {
            st.read
        };
        let to = st.copied;
        let data = &st.buf[PAGE_HEADER_SIZE + from..PAGE_HEADER_SIZE + to];
        let start_clock = st.clock;
        let mut events = page::Events::new(data, start_clock);
        let (mut first_ts, mut last_ts, mut n) = (None, None, 0u64);
        for ev in events.by_ref() {
            let ev = ev.map_err(|err| ReadError::Decode {
                cpu: st.cpu,
                page: st.reader,
                err,
            })?;
            first_ts.get_or_insert(ev.ts);
            last_ts = Some(ev.ts);
            n += 1;
        }
        st.clock = events.clock();
        st.read = to;
        st.page_events += n;
        let first_index = st.expected;
        st.expected = st.expected.saturating_add(n);
        st.stats.read += n;
        st.stats.bytes += (to - from) as u64;
        let missed = std::mem::take(&mut st.pending_lost);
        st.stats.lost = st.stats.lost.saturating_add(missed);
        let len = to - from;
        let bytes = if from == 0 {
            // The local copy carries the length without flags; sinks add their own.
            st.buf[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&(len as u64).to_le_bytes());
            &st.buf[..]
        } else {
            // Mid-page: the rest rebuilt as a page that starts at the reading position.
            let piece = &mut st.piece;
            piece.resize(st.buf.len(), 0);
            piece[..8].copy_from_slice(&start_clock.to_le_bytes());
            piece[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&(len as u64).to_le_bytes());
            piece[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len]
                .copy_from_slice(&st.buf[PAGE_HEADER_SIZE + from..PAGE_HEADER_SIZE + to]);
            &piece[..]
        };
        Ok(PageOut {
            bytes,
            commit_len: len,
            missed,
            events: n,
            first_index,
            first_ts,
            last_ts,
        })
    }
}
