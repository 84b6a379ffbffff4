//! Fuzz target `region`: the host reader's page, footer, control-block and pack parsing
//! over the safe `WordMem` backend, driven by a small program.
//!
//! The fuzzer would hardly ever produce a region that passes `RingGeometry::parse` (magics,
//! exact sizes and offsets), so the region is built valid first and the input then
//! drives the real writer, the reader and byte/word patches of the shared memory:
//!
//! ```text
//! byte 0     config: bit 0 cpus-1 (1..2), bits 1-2 pages-3 (3..6), bit 3 overwrite,
//!            bit 4 guest_swap flag (in stop mode: released pages, the reader reading
//!            the ring in place), bits 5/6 CPU 0/1 read by pages instead of events
//! byte 1..   ops, each an opcode byte and its operands (see `Op` below); a missing
//!            operand reads as 0
//! ```
//!
//! Page size is 4096. Every write carries its event index (`entries + dropped` before
//! the write) and timestamp in the payload when it is large enough, so while no patch
//! has touched the region (`patched == false`) the reader is checked against an
//! oracle: no `ReadError`, strictly increasing indexes whose gaps equal the losses
//! reported right before them, timestamps equal to the ones written, and at the end
//! (finalize + drain) read + lost == entries + dropped for every CPU. Once the region
//! is patched, anything but a panic (or an unbounded loop) is acceptable.
#![no_main]

use hyptrace_abi::layout::{RingGeometry, Mode, CTL_SIZE, FOOTER_SIZE};
use hyptrace_abi::page::{self, COMMIT_OFFSET};
use hyptrace_abi::{SharedMem, WordMem};
use hyptrace_reader::{Callbacks, Direct, Item, ReadError, RingBuffer, SwapReply};
use hyptrace_writer::{WriteOutcome, Writer};
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::Ordering::Relaxed;

const PAGE_SIZE: usize = 4096;
/// Most items one `next_event` op drains (a full ring of 6 pages of 12-byte events is
/// under 2000; losses add one item per gap).
const MAX_ITEMS: usize = 4096;
/// Most pages one `next_page` op drains.
const MAX_PAGES: usize = 16;
/// Most ops per input.
const MAX_OPS: usize = 256;
/// Most events a single write op writes.
const MAX_BURST: usize = 128;

type Rb<'m> = RingBuffer<&'m WordMem, Cb<'m>>;

/// The reader's callbacks: `Direct`, with released pages where the VMM uses them
/// (the guest-swap flag in stop mode): the reader then reads the ring in place and
/// releases pages, and the writers swap released pages back by themselves.
struct Cb<'m> {
    direct: Direct<&'m WordMem>,
    releases: bool,
}

impl Callbacks for Cb<'_> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        self.direct.swap_reader(cpu)
    }
    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        self.direct.update_footers(cpu)
    }
    fn releases(&self, _cpu: u32) -> bool {
        self.releases
    }
}

/// Reads the input from the front; past its end every byte reads as 0.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = self.u8();
        }
        u64::from_le_bytes(b)
    }
    /// A word value: one byte `v`; `v < 0x80` is the small value `v` itself (page ids,
    /// flags, link words `id << 2 | flags` of a small ring, small counters); `v >= 0x80`
    /// is followed by the 8 raw little-endian bytes.
    fn value(&mut self) -> u64 {
        let v = self.u8();
        if v < 0x80 {
            u64::from(v)
        } else {
            self.u64()
        }
    }
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What the oracle knows of one CPU's stream.
#[derive(Default)]
struct Stream {
    /// Index expected next (events read + lost so far).
    next: u64,
    /// Losses reported and not yet followed by an event.
    pending: u64,
    read: u64,
    lost: u64,
    last_ts: u64,
    /// The writer was finished (no more writes to this CPU).
    finished: bool,
    finalized: bool,
}

/// A page handed out by `next_page`, copied (header + committed data).
struct CopiedPage {
    missed: u64,
    bytes: Vec<u8>,
    commit_len: usize,
    events: u64,
    first_ts: Option<u64>,
    last_ts: Option<u64>,
}

struct World<'m> {
    mem: &'m WordMem,
    l: RingGeometry,
    writers: Vec<Writer<&'m WordMem>>,
    rb: Option<Rb<'m>>,
    /// The reader could not attach (patched pack): reader ops are no-ops.
    rb_dead: bool,
    /// Some patch touched the region: no oracle any more.
    patched: bool,
    by_pages: [bool; 2],
    streams: Vec<Stream>,
    ts: u64,
}

impl<'m> World<'m> {
    fn reader(&mut self) -> Option<&mut Rb<'m>> {
        if self.rb.is_none() && !self.rb_dead {
            match RingGeometry::parse(self.mem) {
                Ok(l) => match RingBuffer::attach(
                    self.mem,
                    Cb {
                        direct: Direct::new(self.mem, l),
                        releases: l.guest_swap && l.mode == Mode::Stop,
                    },
                ) {
                    Ok(rb) => self.rb = Some(rb),
                    Err(e) => {
                        self.rb_dead = true;
                        self.fail(e);
                    }
                },
                Err(e) => {
                    self.rb_dead = true;
                    self.fail(e.into());
                }
            }
        }
        self.rb.as_mut()
    }

    /// A reader error: a bug unless the region was patched.
    fn fail(&mut self, e: ReadError) {
        assert!(self.patched, "reader error on an unpatched region: {e}");
    }

    fn cpus(&self) -> u32 {
        self.l.nr_cpus
    }

    fn write_burst(&mut self, cpu: u32, n: usize, plen: usize, step: u64, slot: u32) {
        if self.streams[cpu as usize].finished && !self.patched {
            return;
        }
        let w = &mut self.writers[cpu as usize];
        let mut p = [0u8; 256];
        let plen = plen.min(p.len()).min(w.max_payload());
        for _ in 0..n {
            self.ts = self.ts.saturating_add(step);
            let idx = w.entries() + w.dropped();
            if plen >= 16 {
                p[..8].copy_from_slice(&idx.to_le_bytes());
                p[8..16].copy_from_slice(&self.ts.to_le_bytes());
            } else if plen >= 8 {
                p[..8].copy_from_slice(&idx.to_le_bytes());
            }
            match w.write(slot, self.ts, &p[..plen]) {
                WriteOutcome::Written | WriteOutcome::Dropped | WriteOutcome::Disabled => {}
                WriteOutcome::TooLarge => unreachable!("payload clamped to max_payload"),
                WriteOutcome::Corrupt => {
                    assert!(
                        self.patched,
                        "writer reports corruption on an unpatched ring"
                    );
                    return;
                }
            }
        }
    }

    /// The reader reported `n` events lost.
    fn lost(&mut self, cpu: u32, n: u64) {
        if self.patched {
            return;
        }
        self.streams[cpu as usize].pending += n;
    }

    /// Checks one event of `cpu` against the oracle (unpatched regions only).
    fn check_event(&mut self, cpu: u32, ts: u64, payload: &[u8]) {
        if self.patched {
            return;
        }
        let s = &mut self.streams[cpu as usize];
        assert!(ts >= s.last_ts, "cpu {cpu}: time went backwards");
        s.last_ts = ts;
        // Payloads are zero-padded to 4 bytes: a padded length of 12 or more means at
        // least 9 bytes were written (the index is there), 20 or more at least 17 (the
        // timestamp too).
        if payload.len() >= 12 {
            let idx = u64::from_le_bytes(payload[..8].try_into().unwrap());
            assert!(
                idx >= s.next,
                "cpu {cpu}: event {idx} read again (expected {})",
                s.next
            );
            assert_eq!(
                idx - s.next,
                s.pending,
                "cpu {cpu}: event {idx} after {} lost, expected index {}",
                s.pending,
                s.next
            );
            if payload.len() >= 20 {
                let wts = u64::from_le_bytes(payload[8..16].try_into().unwrap());
                assert_eq!(ts, wts, "cpu {cpu}: event {idx} timestamp");
            }
            s.next = idx + 1;
        } else {
            s.next += s.pending + 1;
        }
        s.lost += s.pending;
        s.pending = 0;
        s.read += 1;
    }

    fn drain_events(&mut self, cpu: u32) {
        let by_pages = self.by_pages[cpu as usize & 1];
        if by_pages && !self.patched {
            return self.drain_pages(cpu);
        }
        let Some(rb) = self.reader() else { return };
        let mut got: Vec<Result<(u64, Vec<u8>), u64>> = Vec::new();
        let mut err = None;
        for _ in 0..MAX_ITEMS {
            match rb.next_event(cpu) {
                Ok(Some(Item::Event { ts, payload })) => got.push(Ok((ts, payload.to_vec()))),
                Ok(Some(Item::Lost(n))) => got.push(Err(n)),
                Ok(None) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        for g in got {
            match g {
                Ok((ts, payload)) => self.check_event(cpu, ts, &payload),
                Err(n) => self.lost(cpu, n),
            }
        }
        if let Some(e) = err {
            self.fail(e);
        }
    }

    fn drain_pages(&mut self, cpu: u32) {
        let Some(rb) = self.reader() else { return };
        let mut got: Vec<CopiedPage> = Vec::new();
        let mut err = None;
        for _ in 0..MAX_PAGES {
            match rb.next_page(cpu) {
                Ok(Some(p)) => {
                    let end = page::PAGE_HEADER_SIZE + p.commit_len;
                    assert!(p.bytes.len() >= end, "page copy shorter than its commit");
                    let bytes = p.bytes[..end].to_vec();
                    got.push(CopiedPage {
                        missed: p.missed,
                        bytes,
                        commit_len: p.commit_len,
                        events: p.events,
                        first_ts: p.first_ts,
                        last_ts: p.last_ts,
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        for CopiedPage {
            missed,
            bytes,
            commit_len,
            events,
            first_ts,
            last_ts,
        } in got
        {
            let (ts0, commit) = page::page_header(&bytes).unwrap();
            assert_eq!(
                commit, commit_len as u64,
                "page copy carries its length, no flags"
            );
            self.lost(cpu, missed);
            let data = &bytes[page::PAGE_HEADER_SIZE..];
            let mut n = 0;
            let (mut first, mut last) = (None, None);
            for ev in page::Events::new(data, ts0) {
                let ev = ev.expect("next_page handed out a page that does not decode");
                first.get_or_insert(ev.ts);
                last = Some(ev.ts);
                n += 1;
                let payload = ev.payload.to_vec();
                self.check_event(cpu, ev.ts, &payload);
            }
            assert_eq!(n, events);
            assert_eq!((first, last), (first_ts, last_ts));
        }
        if let Some(e) = err {
            self.fail(e);
        }
    }

    /// Marks the region patched (no oracle from here on).
    fn patch(&mut self) {
        self.patched = true;
    }

    fn patch_word(&mut self, off: usize, v: u64) {
        self.patch();
        self.mem.store(off & !7, v, Relaxed);
    }
}

/// Opcodes (the opcode byte modulo their number; the other bits select a CPU).
#[derive(Clone, Copy)]
enum Op {
    /// count, payload length, timestamp step: writes a burst of events.
    Write,
    /// As `Write`, with a large step (TIME_EXTEND) every few events.
    WriteExtend,
    Poke,
    NextEvent,
    NextPage,
    /// Writer finished, then `finalize` and a drain.
    Finalize,
    /// `swap_reader_page` run directly (a swap the reader does not know of).
    Swap,
    /// Flip enable bits (the writer then skips disabled slots).
    Enable,
    /// Drop the reader and attach a new one (re-parses the pack).
    Reattach,
    /// u16 offset, length, bytes: patch raw bytes anywhere in the region.
    PatchBytes,
    /// page, field, value: patch a footer word.
    PatchFooter,
    /// field, value: patch a control-block word.
    PatchCtl,
    /// page, value: patch a page's commit or time_stamp word.
    PatchCommit,
    /// word index, value: patch a pack header / descriptor word.
    PatchPack,
}

const OPS: [Op; 14] = [
    Op::Write,
    Op::WriteExtend,
    Op::Poke,
    Op::NextEvent,
    Op::NextPage,
    Op::Finalize,
    Op::Swap,
    Op::Enable,
    Op::Reattach,
    Op::PatchBytes,
    Op::PatchFooter,
    Op::PatchCtl,
    Op::PatchCommit,
    Op::PatchPack,
];

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let cfg = inp.u8();
    let nr_cpus = 1 + u32::from(cfg & 1);
    let pages = 3 + u32::from((cfg >> 1) & 3);
    let mode = if cfg & 8 != 0 {
        Mode::Overwrite
    } else {
        Mode::Stop
    };
    let l = RingGeometry::new(nr_cpus, pages, PAGE_SIZE, mode, cfg & 16 != 0).unwrap();
    let mem = WordMem::new(l.region_size);
    l.init_region(&mem, 1_000_000, 1);
    let writers = (0..nr_cpus)
        .map(|c| Writer::attach(&mem, c).expect("writer attach on a fresh region"))
        .collect();
    let mut w = World {
        mem: &mem,
        l,
        writers,
        rb: None,
        rb_dead: false,
        patched: false,
        by_pages: [cfg & 32 != 0, cfg & 64 != 0],
        streams: (0..nr_cpus).map(|_| Stream::default()).collect(),
        ts: 1000,
    };

    let mut ops = 0;
    while !inp.is_empty() && ops < MAX_OPS {
        ops += 1;
        let opb = inp.u8();
        let op = OPS[usize::from(opb) % OPS.len()];
        let cpu = u32::from(opb / OPS.len() as u8) % w.cpus();
        match op {
            Op::Write | Op::WriteExtend => {
                let n = 1 + usize::from(inp.u8() % MAX_BURST as u8);
                let n = n.min(MAX_BURST);
                let plen = usize::from(inp.u8());
                let step = u64::from(inp.u8());
                if matches!(op, Op::Write) {
                    w.write_burst(cpu, n, plen, step, 0);
                } else {
                    // Deltas of 2^27 and more need a TIME_EXTEND before the event.
                    let big = 1u64 << (27 + (step % 20));
                    for _ in 0..n.div_ceil(4) {
                        w.write_burst(cpu, 1, plen, big, 0);
                        w.write_burst(cpu, 3, plen, step, 0);
                    }
                }
            }
            Op::Poke => {
                if let Some(rb) = w.reader() {
                    if let Err(e) = rb.poke(cpu) {
                        w.fail(e);
                    }
                }
            }
            Op::NextEvent => w.drain_events(cpu),
            Op::NextPage => {
                if w.patched {
                    // Mixing page and event reads is outside the contract: only on a
                    // patched (hostile) region, where anything goes.
                    if let Some(rb) = w.reader() {
                        for _ in 0..MAX_PAGES {
                            match rb.next_page(cpu) {
                                Ok(Some(p)) => assert!(
                                    p.bytes.len() >= page::PAGE_HEADER_SIZE + p.commit_len,
                                    "page copy shorter than its commit"
                                ),
                                _ => break,
                            }
                        }
                    }
                } else if w.by_pages[cpu as usize & 1] {
                    w.drain_pages(cpu);
                } else {
                    w.drain_events(cpu);
                }
            }
            Op::Finalize => {
                w.writers[cpu as usize].finish();
                w.streams[cpu as usize].finished = true;
                if let Some(rb) = w.reader() {
                    match rb.finalize(cpu) {
                        Ok(()) => w.streams[cpu as usize].finalized = true,
                        Err(e) => w.fail(e),
                    }
                }
                w.drain_events(cpu);
            }
            Op::Swap => {
                // A swap behind the reader's back: the reader then finds a reader page
                // it did not expect; the protocol allows it only through the reader, so
                // it counts as a patch (hostile host / writer side).
                w.patch();
                let _ = hyptrace_writer::swap_reader_page(w.mem, &w.l, cpu);
            }
            Op::Enable => {
                let bits = inp.value();
                if let Some(rb) = w.reader() {
                    if let Err(e) = rb.set_enable(cpu, bits) {
                        w.fail(e);
                    }
                }
                // Writes to a disabled slot are skipped and not indexed.
                let slot = u32::from(inp.u8() % 64);
                w.write_burst(cpu, 4, 24, 1, slot);
            }
            Op::Reattach => {
                // A fresh reader starts from the current reader page: events read
                // before would count twice, so it ends the oracle.
                w.patch();
                w.rb = None;
                w.rb_dead = false;
            }
            Op::PatchBytes => {
                let off = usize::from(inp.u16()) * 4 % w.l.region_size;
                let len = 1 + usize::from(inp.u8() % 16);
                let mut b = [0u8; 16];
                for x in &mut b[..len] {
                    *x = inp.u8();
                }
                let len = len.min(w.l.region_size - off);
                w.patch();
                w.mem.write_bytes(off, &b[..len]);
            }
            Op::PatchFooter => {
                let id = u32::from(inp.u8()) % (w.l.total_pages() as u32);
                let field = usize::from(inp.u8()) % (FOOTER_SIZE / 8);
                let v = inp.value();
                w.patch_word(w.l.footer_off(id) + field * 8, v);
            }
            Op::PatchCtl => {
                let field = usize::from(inp.u8()) % (CTL_SIZE / 8);
                let v = inp.value();
                w.patch_word(w.l.ctl(cpu) + field * 8, v);
            }
            Op::PatchCommit => {
                let id = u32::from(inp.u8()) % (w.l.total_pages() as u32);
                let sel = inp.u8();
                let v = inp.value();
                let v = match sel % 4 {
                    // A length with or without the missed flags.
                    0 => v & page::COMMIT_LEN_MASK,
                    1 => (v & page::COMMIT_LEN_MASK) | page::RB_MISSED_EVENTS,
                    2 => (v & page::COMMIT_LEN_MASK) | page::RB_MISSED_FLAGS,
                    _ => v,
                };
                let word = if sel & 4 != 0 {
                    page::TIME_STAMP_OFFSET
                } else {
                    COMMIT_OFFSET
                };
                w.patch_word(w.l.page_off(id) + word, v);
            }
            Op::PatchPack => {
                let n_words = (w.l.ctl_off + w.l.nr_cpus as usize * CTL_SIZE) / 8;
                let idx = usize::from(inp.u8()) % n_words;
                let v = inp.value();
                w.patch_word(idx * 8, v);
            }
        }
    }

    // Epilogue: stop every writer, finalize and drain every CPU; on an unpatched region
    // every event must be accounted for.
    for cpu in 0..w.cpus() {
        w.writers[cpu as usize].finish();
        w.streams[cpu as usize].finished = true;
        let finalized = w.streams[cpu as usize].finalized;
        let fin = match w.reader() {
            Some(_) if finalized => Ok(()),
            Some(rb) => rb.finalize(cpu),
            None => continue,
        };
        if let Err(e) = fin {
            w.fail(e);
            continue;
        }
        w.streams[cpu as usize].finalized = true;
        for _ in 0..4 {
            w.drain_events(cpu);
            if w.rb.as_ref().is_none_or(|rb| rb.finished(cpu)) {
                break;
            }
        }
        if w.patched {
            continue;
        }
        let rb = w.rb.as_mut().unwrap();
        assert!(
            rb.finished(cpu),
            "cpu {cpu}: final walk not done after draining"
        );
        let trailing = rb.take_trailing_loss(cpu);
        let st = rb.sync_writer_counters(cpu).unwrap();
        w.lost(cpu, trailing);
        let s = &mut w.streams[cpu as usize];
        s.lost += s.pending;
        s.pending = 0;
        let wr = &w.writers[cpu as usize];
        assert_eq!(
            s.read + s.lost,
            wr.entries() + wr.dropped(),
            "cpu {cpu}: read {} + lost {} != written {} + dropped {}",
            s.read,
            s.lost,
            wr.entries(),
            wr.dropped()
        );
        assert_eq!(st.read, s.read, "cpu {cpu}: reader stats count reads");
        assert_eq!(st.written, wr.entries());
    }
});
