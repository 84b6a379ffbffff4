//! The write path: an event reserved on the tail page, its bytes put, its commit
//! published; the slow path when the page is full.

use core::sync::atomic::Ordering::Relaxed;

use hyptrace_abi::layout::ctl;
use hyptrace_abi::page::{self, COMMIT_OFFSET, PAGE_HEADER_SIZE};

use hyptrace_abi::SharedMem;

use crate::{WriteOutcome, Writer, COMMIT_ORDER};

impl<M: SharedMem> Writer<M> {
    /// Writes one event of `payload` with timestamp `ts` if slot `slot` is enabled.
    ///
    /// reserve → fill → commit: the event (and a TIME_EXTEND before it when the delta
    /// needs more than 27 bits) is written past the committed bytes of the tail page,
    /// then `commit` is published with Release, so a reader that loads `commit` with
    /// Acquire sees the whole payload. A `ts` below the previous event's is clamped to
    /// it (delta 0), never turned into a huge unsigned delta.
    ///
    /// ```
    /// use core::sync::atomic::Ordering::SeqCst;
    /// use hyptrace_abi::layout::ctl;
    /// use hyptrace_abi::{events, HeapMem, Mode, RingGeometry, SharedMem};
    /// use hyptrace_writer::{WriteOutcome, Writer};
    /// let l = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?;
    /// let mem = HeapMem::new(l.region_size);
    /// l.init_region(&mem, 1_000_000, 1);
    /// let mut w = Writer::attach(&mem, 0)?;
    /// let ev = events::marker(events::vcpu_pid(0), 0, 0);
    /// assert_eq!(w.write(3, 100, &ev), WriteOutcome::Written); // init enables every slot
    /// mem.fetch_and(l.ctl(0) + ctl::ENABLE, !(1 << 3), SeqCst); // the host disables slot 3
    /// assert_eq!(w.write(3, 200, &ev), WriteOutcome::Disabled); // counted as skipped
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline]
    pub fn write(&mut self, slot: u32, ts: u64, payload: &[u8]) -> WriteOutcome {
        if !self.enabled(slot) {
            self.skip();
            return WriteOutcome::Disabled;
        }
        self.write_enabled(ts, payload)
    }

    /// [`Writer::write`] without the enable check (the attempt is counted all the same).
    #[inline]
    pub fn write_enabled(&mut self, ts: u64, payload: &[u8]) -> WriteOutcome {
        // R3: counted before anything of the event is written (the commit's Release
        // keeps this store before it).
        self.count_attempt();
        let ts = ts.max(self.write_stamp);
        let delta = ts - self.write_stamp;
        let size = page::data_event_size(payload.len());
        // The common case, one test each: the event follows others on the tail page,
        // needs no TIME_EXTEND, and fits. `open` is 0 while a drop is pending or the
        // ring is corrupt, and a payload over `max_payload` makes `size > cap`, so
        // those go the slow way too.
        if self.write != 0 && delta <= page::MAX_DELTA && self.write + size <= self.open {
            let at = self.tail_off + PAGE_HEADER_SIZE + self.write;
            // SAFETY: the reservation (see `write_slow`): `write + size <= open <= cap`.
            unsafe { self.put_event(at, delta, payload, size) };
            self.commit(ts, size);
            return WriteOutcome::Written;
        }
        let out = self.write_slow(ts, payload);
        self.refresh_open();
        out
    }

    /// Keeps `open` (see the field) after the slow path and attach.
    #[inline(always)]
    pub(super) fn refresh_open(&mut self) {
        self.open = if self.corrupt || self.lost_pending != 0 {
            0
        } else {
            self.cap
        };
    }

    /// Everything [`Writer::write_enabled`]'s fast case leaves: the first event of a
    /// page, a TIME_EXTEND, a page move, a drop, a payload too large, a corrupt ring.
    /// `ts` is clamped already.
    #[inline(never)]
    fn write_slow(&mut self, mut ts: u64, payload: &[u8]) -> WriteOutcome {
        if payload.len() > self.max_payload {
            return WriteOutcome::TooLarge;
        }
        if self.corrupt {
            return WriteOutcome::Corrupt;
        }
        let size = page::data_event_size(payload.len());
        let mut delta = ts - self.write_stamp;
        let mut need = size
            + if delta > page::MAX_DELTA {
                page::TIME_EXTEND_SIZE
            } else {
                0
            };
        if self.write == 0 {
            need = size;
        }
        // After a drop (stop mode), the tail page is closed: an event written on it now
        // would put the loss inside the page, where no first_index can mark it (W3).
        if self.lost_pending != 0 || self.write + need > self.cap {
            match self.move_tail() {
                Ok(true) => need = size,
                Ok(false) => {
                    self.dropped = self.dropped.wrapping_add(1);
                    self.lost_pending = self.lost_pending.wrapping_add(1);
                    self.ctl_store(ctl::DROPPED, self.dropped, Relaxed);
                    self.ctl_store(ctl::LOST_PENDING, self.lost_pending, Relaxed);
                    return WriteOutcome::Dropped;
                }
                Err(_) => {
                    self.corrupt = true;
                    return WriteOutcome::Corrupt;
                }
            }
        }
        // The writer at the bound: from here to the commit every access goes to the
        // tail page's header and to `[at, data + write + need)`, which lies inside the
        // page's data area — `write + need <= cap` holds here: either the test above
        // said so, or the tail just moved (`write = 0`, `need = size <= cap`, since
        // `payload.len() <= max_payload`) — and the tail page is one of this CPU's pages
        // (`page_id`-checked where `tail` was set: attach, move_tail), inside the region
        // that attach validated (`RingGeometry::parse`: `region_size <= mem.size()`).
        // So the accesses need no check of their own: `*_unchecked`, each with that
        // argument (the SAFETY comments below refer to it as "the reservation"). The
        // fast case of `write_enabled` is this with `write != 0`, no TIME_EXTEND and
        // `write + size <= open <= cap` tested directly.
        debug_assert!(self.write + need <= self.cap);
        let mut at = self.tail_off + PAGE_HEADER_SIZE + self.write;
        if self.write == 0 {
            // First event of the page: the page's time_stamp is its time, delta 0.
            // SAFETY: the page's first 8 bytes (`time_stamp`, plain data) of the tail
            // page, inside the region (the reservation).
            unsafe {
                self.mem
                    .write_bytes_unchecked(self.tail_off, &ts.to_le_bytes())
            };
            delta = 0;
        } else if delta > page::MAX_DELTA {
            // A jump beyond 59 bits (years of TSC) is recorded as the largest extend,
            // and the event's time as what the page then decodes to.
            let d = if delta > page::MAX_EXTENDED_DELTA {
                ts = self.write_stamp + page::MAX_EXTENDED_DELTA;
                page::MAX_EXTENDED_DELTA
            } else {
                delta
            };
            // SAFETY: the TIME_EXTEND's 8 bytes are the first of the `need` reserved
            // (the reservation).
            unsafe {
                self.mem
                    .write_bytes_unchecked(at, &page::encode_time_extend(d))
            };
            at += page::TIME_EXTEND_SIZE;
            delta = 0;
        }
        // SAFETY: the event's `size` bytes end the `need` reserved (the reservation).
        unsafe { self.put_event(at, delta, payload, size) };
        self.commit(ts, need);
        WriteOutcome::Written
    }

    /// Writes a data event (header with `delta`, padded payload: `size` bytes) at `at`.
    ///
    /// # Safety
    /// `[at, at + size)` lies in the tail page's data area (the reservation) and
    /// `size == data_event_size(payload.len())`, `delta <= MAX_DELTA`.
    #[inline(always)]
    unsafe fn put_event(&self, at: usize, delta: u64, payload: &[u8], size: usize) {
        let mut hdr = [0u8; 8];
        let hlen = page::encode_data_header(&mut hdr, payload.len(), delta as u32);
        // Fixed-size stores (one instruction each), never a variable-length copy: a
        // small copy is a call to memcpy, which in the guest is a `rep movsb`.
        // SAFETY: the event's header (4 or 8 bytes, `hlen`) starts its `size` bytes
        // (the caller's reservation).
        unsafe {
            if hlen == 4 {
                self.mem.write_bytes_unchecked(at, &hdr[..4]);
            } else {
                self.mem.write_bytes_unchecked(at, &hdr);
            }
        }
        let at = at + hlen;
        let padded = size - hlen;
        if padded != payload.len() {
            // Zero the event's last word (its 1..=3 padding bytes), then copy the payload
            // over its head: one 4-byte store instead of a memset call.
            // SAFETY: `[at + padded - 4, at + padded)` is the end of the event's bytes
            // (`size = hlen + padded`; padded >= 4 here) (the caller's reservation).
            unsafe { self.mem.write_bytes_unchecked(at + padded - 4, &[0u8; 4]) };
        }
        // SAFETY: the payload's bytes follow the header inside the event's bytes
        // (`payload.len() <= padded`) (the caller's reservation).
        unsafe { self.mem.write_bytes_unchecked(at, payload) };
    }

    /// Publishes the event just written (`need` bytes with its TIME_EXTEND, at time
    /// `ts`) and counts it.
    #[inline(always)]
    fn commit(&mut self, ts: u64, need: usize) {
        self.write += need;
        // Publish: the payload above happens-before any Acquire load that sees this (W1).
        // Release (COMMIT_ORDER): paired with the Acquire load of commit in
        // RingBuffer::refresh (and Writer::resume).
        // SAFETY: the tail page's `commit` word (8-aligned: pages are page-aligned and
        // COMMIT_OFFSET is 8), inside the region (the reservation).
        unsafe {
            self.mem.store_unchecked(
                self.tail_off + COMMIT_OFFSET,
                self.write as u64 | self.commit_flags,
                COMMIT_ORDER,
            )
        };
        self.write_stamp = ts;
        // Counters may have been continued from shared memory (attach): wrap, never
        // overflow-panic.
        self.entries = self.entries.wrapping_add(1);
        self.page_entries += 1;
        self.bytes = self.bytes.wrapping_add(need as u64);
        self.ctl_store(ctl::ENTRIES, self.entries, Relaxed);
        self.ctl_store(ctl::BYTES, self.bytes, Relaxed);
        self.ctl_store(ctl::WRITE_STAMP, ts, Relaxed);
    }
}
