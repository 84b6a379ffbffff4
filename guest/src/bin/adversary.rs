//! Adversarial guest payload for the host's tests (`tests/vm_adversarial.rs`): a guest
//! that lies. Built only with `--features adversary`; never embedded in the host.
//!
//! It runs on the same runtime as the real payload (entry stub, memory functions, panic
//! handler: `../rt.rs`) and takes the same run-parameter block. The **scenario** is the
//! block's `rate` field (`hyptrace run --rate N --guest adversary`), `events` is the
//! number of honest events written before the lie (and by the honest vCPUs; 0 = write
//! for ever). vCPU 0 is the adversary; every other vCPU is an honest writer (serving
//! the mailbox in `--swap guest` mode) unless the scenario says otherwise.
//!
//! Scenarios (see [`Scenario`]): lying control-block counters (decreasing, huge),
//! lying `first_index` (backwards, huge), page ids out of range in the control block
//! and in every link, HEAD/UPDATE flags on many links with cycles that skip pages, bad
//! footer magics, duplicate and decreasing `page_seq`, random byte flips while writing
//! flat out, port abuse (unknown port, exit port with another vCPU's id, panic port
//! with a huge length and a message full of control characters and a forged drop
//! marker), MMIO doorbell abuse (a store at an offset that rings nothing, the exit bell
//! with another vCPU's id: run with `--doorbell mmio`), mailbox lies (wrong seq, unknown status, "done" without swapping, no
//! answer at all), hand-made pages with hostile-but-legal encodings, text events that
//! try to forge output lines, a vCPU that stays silent while the others write, and
//! crashes after N events (fault, panic, invalid opcode, hang) for the flight recorder.
#![no_std]
#![no_main]

#[path = "../block.rs"]
mod block;
#[path = "../builtin.rs"]
mod builtin;
#[path = "../rt.rs"]
mod rt;

use block::Block;

use core::sync::atomic::Ordering::{Relaxed, Release};

use hyptrace_abi::events::{self, CommonHeader};
use hyptrace_abi::guest::{
    result, WorkloadRng, PANIC_MSG_MAX, PORT_EXIT, PORT_PANIC, RUN_FLAG_SERVE_MAILBOX,
    RUN_PARAMS_MAGIC, VCPU_RESULT_SIZE,
};
use hyptrace_abi::layout::{
    ctl, footer, link, pack as pack_hdr, RingGeometry, FOOTER_MAGIC, LINK_HEAD, LINK_UPDATE,
    MBOX_STATUS_OK, WRITER_FINISHED,
};
use hyptrace_abi::page::{
    encode_time_extend, header_word, COMMIT_OFFSET, MAX_EXTENDED_DELTA, PAGE_HEADER_SIZE,
    TYPE_PADDING,
};
use hyptrace_abi::{RawMem, SharedMem};
use hyptrace_guest_rt::{mmio_store, Doorbell};
use hyptrace_writer::{WriteOutcome, Writer};
use rt::{out32, rdtsc};

/// What vCPU 0 does (the run parameters' `rate` field).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// Every vCPU writes `events` honest markers (0: for ever) and finishes.
    Honest = 0,
    /// vCPU 0 attaches and then never writes and never exits; the others write.
    Silent = 1,
    /// After `events` events and a pause, the counters go down; then silent, live.
    CountersBackwards = 2,
    /// After `events` events the counters become huge; then the writer finishes.
    CountersHuge = 3,
    /// Every page from the third on claims `first_index` 1.
    FirstIndexBackwards = 4,
    /// Every page from the third on claims `first_index` + 2^62.
    FirstIndexHuge = 5,
    /// After `events` events: tail/reader page ids and every link out of range; live.
    BadIds = 6,
    /// Halfway: every link skips a page, many carry HEAD, some UPDATE; keeps writing.
    LinkChaos = 7,
    /// After `events` events and the other vCPUs' writers finished: every footer
    /// magic is wrong; the writer finishes.
    FooterMagic = 8,
    /// After `events` events: every page but the reader page gets a duplicated,
    /// decreasing `page_seq`; the writer finishes.
    PageSeqDup = 9,
    /// Writes flat out for ever, flipping a random byte of its pages (data and
    /// footers) every 64 events, and one of its control block every 4096 flips.
    FlipBytes = 10,
    /// Writes to an unknown I/O port.
    PortUnknown = 11,
    /// Reports its exit as vCPU 0xffff_ffff.
    PortExitLie = 12,
    /// Panics with a length of 0xffff_ffff and a message full of control characters
    /// and forged output lines.
    PortPanicForgery = 13,
    /// Two hand-made pages: padding mid-page, a TIME_EXTEND of the largest delta,
    /// maximum-size events of an unknown id. Legal: nothing is wrong.
    Encodings = 14,
    /// Honest text events whose messages hold newlines, control characters and a
    /// forged drop marker. Legal: nothing is wrong.
    TextForgery = 15,
    /// Mailbox: acknowledges with a wrong sequence number.
    MboxWrongSeq = 16,
    /// Mailbox: acknowledges with an unknown status.
    MboxBadStatus = 17,
    /// Mailbox: says "done" without doing anything.
    MboxAckNoSwap = 18,
    /// Mailbox: never answers.
    MboxNever = 19,
    /// Crash (flight recorder tests): after `events` markers, a store to unmapped
    /// memory — a page fault with no IDT, a triple fault (`KVM_EXIT_SHUTDOWN`).
    CrashFault = 20,
    /// Crash: after `events` markers, a guest panic (the panic port).
    CrashPanic = 21,
    /// Crash: after `events` markers, `ud2` — an invalid opcode with no IDT, a triple
    /// fault.
    CrashUd = 22,
    /// Hang: after `events` markers, spins for ever: no event, no exit.
    CrashHang = 23,
    /// After `events` markers: publishes more skipped than attempted events (R3), then
    /// the writer finishes.
    AttemptsHostile = 24,
    /// With the MMIO doorbell (`--doorbell mmio`): after 16 markers, a store at offset
    /// 0x10 of the doorbell page, which rings nothing (an unbacked access).
    MmioWrongOffset = 25,
    /// With the MMIO doorbell: after 16 markers, the exit bell with vCPU id 0xffff_ffff.
    MmioExitLie = 26,
}

impl Scenario {
    fn from_u64(v: u64) -> Option<Self> {
        use Scenario::*;
        Some(match v {
            0 => Honest,
            1 => Silent,
            2 => CountersBackwards,
            3 => CountersHuge,
            4 => FirstIndexBackwards,
            5 => FirstIndexHuge,
            6 => BadIds,
            7 => LinkChaos,
            8 => FooterMagic,
            9 => PageSeqDup,
            10 => FlipBytes,
            11 => PortUnknown,
            12 => PortExitLie,
            13 => PortPanicForgery,
            14 => Encodings,
            15 => TextForgery,
            16 => MboxWrongSeq,
            17 => MboxBadStatus,
            18 => MboxAckNoSwap,
            19 => MboxNever,
            20 => CrashFault,
            21 => CrashPanic,
            22 => CrashUd,
            23 => CrashHang,
            24 => AttemptsHostile,
            25 => MmioWrongOffset,
            26 => MmioExitLie,
            _ => return None,
        })
    }
}

/// Unknown event id of the hand-made events (not a built-in one).
const UNKNOWN_ID: u16 = 0xbeef;
/// A guest-virtual address outside guest memory and unmapped (`CrashFault`).
const UNMAPPED: u64 = 0x0000_7f00_dead_0000;
/// TSC frequency assumed when the host does not say.
const DEFAULT_TSC_KHZ: u64 = 2_000_000;

/// This vCPU's view of the run.
struct Ctx {
    /// The trace region, for the lies (the writer has its own handle).
    mem: RawMem,
    l: RingGeometry,
    cpu: u32,
    ctl: usize,
    first: u32,
    nr_pages: u32,
    tsc_khz: u64,
    slot: Block,
    serve: bool,
    events: u64,
    seed: u64,
    /// Where it rings the VMM (the entry's `rcx`).
    bell: Doorbell,
}

/// An honest writer of `guest:marker` / `guest:text` events (one seq per vCPU).
struct Honest {
    w: Writer<RawMem>,
    pid: i32,
    seq: u64,
    serve: bool,
}

impl Honest {
    fn write(&mut self, slot: u32, payload: &[u8]) -> WriteOutcome {
        let out = self.w.write(slot, rdtsc(), payload);
        if self.serve {
            self.w.serve_mailbox();
        }
        out
    }

    fn marker(&mut self) -> WriteOutcome {
        let seq = self.seq;
        self.seq += 1;
        let p = events::marker(self.pid, seq, seq);
        self.write(events::MARKER_SLOT, &p)
    }

    fn text(&mut self, msg: &[u8]) -> WriteOutcome {
        let seq = self.seq;
        self.seq += 1;
        let mut buf = [0u8; events::TEXT_STR_OFFSET + events::TEXT_MAX_MSG + 1];
        match events::text(&mut buf, self.pid, seq, msg) {
            Some(len) => self.write(events::TEXT_SLOT, &buf[..len]),
            None => WriteOutcome::TooLarge,
        }
    }

    fn idle(&mut self) {
        if self.serve {
            self.w.serve_mailbox();
        }
    }
}

impl Ctx {
    fn c(&self, off: usize) -> u64 {
        self.mem.load(self.ctl + off, Relaxed)
    }
    fn set_c(&self, off: usize, v: u64) {
        self.mem.store(self.ctl + off, v, Release);
    }
    fn f(&self, id: u32, off: usize) -> u64 {
        self.mem.load(self.l.footer_off(id) + off, Relaxed)
    }
    fn set_f(&self, id: u32, off: usize, v: u64) {
        self.mem.store(self.l.footer_off(id) + off, v, Release);
    }
    fn pages(&self) -> core::ops::Range<u32> {
        self.first..self.first + self.nr_pages
    }

    fn ms_cycles(&self, ms: u64) -> u64 {
        ms.saturating_mul(self.tsc_khz)
    }

    /// Busy-waits `ms` milliseconds, serving the mailbox if `h` is given.
    fn wait_ms(&self, ms: u64, mut h: Option<&mut Honest>) {
        let end = rdtsc().wrapping_add(self.ms_cycles(ms));
        while (end.wrapping_sub(rdtsc()) as i64) > 0 {
            if let Some(h) = h.as_mut() {
                h.idle();
            }
            core::hint::spin_loop();
        }
    }

    /// Exits through the exit port (never returns); the writer published its attempts.
    fn exit(&self) -> ! {
        self.slot.write_u64(result::TSC_END, rdtsc());
        self.slot.write_u64(result::STATUS, 1);
        self.bell.exit(self.cpu);
        spin_forever()
    }

    /// Writes `n` markers (0: for ever), then finishes and exits.
    fn honest_run(&self, mut h: Honest, n: u64) -> ! {
        if n == 0 {
            loop {
                h.marker();
            }
        }
        for _ in 0..n {
            h.marker();
        }
        h.w.finish();
        self.exit()
    }

    /// Stays live for ever: never writes again, never exits (serves the mailbox if
    /// `h` is given and the run asks for it).
    fn stay(&self, mut h: Option<&mut Honest>) -> ! {
        loop {
            if let Some(h) = h.as_mut() {
                h.idle();
            }
            core::hint::spin_loop();
        }
    }
}

fn spin_forever() -> ! {
    loop {
        core::hint::spin_loop();
    }
}

/// Entry from `_start` (rt.rs): rdi = pack GPA, rsi = vCPU id, rdx = RunParams GPA, rcx
/// = the MMIO doorbell page or 0 (ports).
#[no_mangle]
pub extern "C" fn guest_main(pack: u64, cpu: u64, params_gpa: u64, bell: u64) -> ! {
    let p = Block(params_gpa).read_params();
    if p.magic != RUN_PARAMS_MAGIC {
        panic!("bad run parameter block");
    }
    let slot = Block(params_gpa + p.results_off + cpu * VCPU_RESULT_SIZE as u64);
    slot.write_u64(result::TSC_START, rdtsc());
    let cpu = cpu as u32;
    let Some(scenario) = Scenario::from_u64(p.rate) else {
        panic!("unknown adversary scenario {}", p.rate);
    };
    let region = Block(pack).read_u64(pack_hdr::REGION_SIZE) as usize;
    // SAFETY: the host placed the trace region at `pack`, identity-mapped, `region`
    // bytes long (its own pack says so), for the life of the VM. Two handles on it are
    // fine: all accesses are atomics or volatile copies.
    let (mem, wmem) = unsafe {
        (
            RawMem::new(pack as *mut u8, region),
            RawMem::new(pack as *mut u8, region),
        )
    };
    let l = match RingGeometry::parse(&mem) {
        Ok(l) => l,
        Err(e) => panic!("bad pack: {e}"),
    };
    let tsc_khz = match p.tsc_khz {
        0 => DEFAULT_TSC_KHZ,
        k => k,
    };
    let cx = Ctx {
        mem,
        l,
        cpu,
        ctl: l.ctl(cpu),
        first: l.first_page(cpu),
        nr_pages: l.pages_per_cpu,
        tsc_khz,
        slot,
        serve: p.flags & RUN_FLAG_SERVE_MAILBOX != 0,
        events: p.events,
        seed: p.seed,
        bell: Doorbell::from_entry(bell),
    };
    // The built-in events it writes, registered as the payload does.
    builtin::register_builtins(&cx.mem, cpu, cx.bell);
    if scenario == Scenario::Encodings && cpu == 0 {
        // Hand-made pages: no writer.
        encodings(&cx);
    }
    let w = match Writer::attach(wmem, cpu) {
        Ok(w) => w,
        Err(e) => panic!("cannot attach the trace writer: {e}"),
    };
    let h = Honest {
        w,
        pid: events::vcpu_pid(cpu),
        seq: 0,
        serve: cx.serve,
    };
    if cpu != 0 {
        cx.honest_run(h, cx.events)
    } else {
        adversary(&cx, scenario, h)
    }
}

/// Default count of honest events before a lie when the run says 0.
fn or_default(n: u64) -> u64 {
    if n == 0 {
        20_000
    } else {
        n
    }
}

/// vCPU 0.
fn adversary(cx: &Ctx, s: Scenario, mut h: Honest) -> ! {
    use Scenario::*;
    match s {
        Honest | Encodings => cx.honest_run(h, cx.events),
        Silent => cx.stay(None),
        CountersBackwards => {
            for _ in 0..or_default(cx.events) {
                h.marker();
            }
            // Let the host's polls see the true counters first.
            cx.wait_ms(300, None);
            let e = cx.c(ctl::ENTRIES);
            cx.set_c(ctl::ENTRIES, e / 2);
            cx.set_c(ctl::PAGES_TOUCHED, 1);
            cx.set_c(ctl::OVERRUN, 0);
            cx.set_c(ctl::DROPPED, 0);
            cx.stay(None)
        }
        AttemptsHostile => {
            for _ in 0..or_default(cx.events) {
                h.marker();
            }
            let a = cx.c(ctl::ATTEMPTED);
            cx.set_c(ctl::SKIPPED, a.wrapping_add(5));
            h.w.finish();
            cx.exit()
        }
        CountersHuge => {
            for _ in 0..or_default(cx.events) {
                h.marker();
            }
            cx.set_c(ctl::ENTRIES, u64::MAX - 5);
            cx.set_c(ctl::DROPPED, u64::MAX - 7);
            cx.set_c(ctl::OVERRUN, 3);
            cx.set_c(ctl::PAGES_TOUCHED, u64::MAX);
            cx.set_c(ctl::BYTES, u64::MAX);
            cx.set_c(ctl::LOST_PENDING, u64::MAX);
            cx.set_c(ctl::WRITE_STAMP, u64::MAX);
            h.w.finish();
            cx.exit()
        }
        FirstIndexBackwards | FirstIndexHuge => {
            let mut tail = cx.c(ctl::TAIL_PAGE);
            let mut moves = 0u64;
            for _ in 0..or_default(cx.events) {
                h.marker();
                let t = cx.c(ctl::TAIL_PAGE);
                if t != tail {
                    tail = t;
                    moves += 1;
                    if moves >= 2 && cx.l.owns(cx.cpu, t) {
                        let id = t as u32;
                        let lie = if s == FirstIndexBackwards {
                            1
                        } else {
                            cx.f(id, footer::FIRST_INDEX).wrapping_add(1 << 62)
                        };
                        cx.set_f(id, footer::FIRST_INDEX, lie);
                    }
                }
            }
            h.w.finish();
            cx.exit()
        }
        BadIds => {
            for _ in 0..or_default(cx.events) {
                h.marker();
            }
            cx.set_c(ctl::TAIL_PAGE, 0xdead_beef);
            cx.set_c(ctl::READER_PAGE, u64::MAX);
            for id in cx.pages() {
                cx.set_f(id, footer::NEXT, link(0xffff_fff0, LINK_HEAD));
            }
            cx.stay(None)
        }
        LinkChaos => {
            let n = or_default(cx.events);
            for _ in 0..n / 2 {
                h.marker();
            }
            for (k, id) in cx.pages().enumerate() {
                // Two pages on: skips one page, and sometimes names the reader page.
                let target = cx.first + (id - cx.first + 2) % cx.nr_pages;
                let flags = match k % 3 {
                    0 => LINK_HEAD,
                    1 => LINK_UPDATE,
                    _ => 0,
                };
                cx.set_f(id, footer::NEXT, link(target, flags));
            }
            for _ in 0..n / 2 {
                h.marker();
            }
            cx.wait_ms(300, None);
            h.w.finish();
            cx.exit()
        }
        FooterMagic => {
            for _ in 0..or_default(cx.events) {
                h.marker();
            }
            // Lie only once the honest vCPUs are done (bounded wait): the host stops
            // every vCPU when it finds the lie, and the test checks that all of their
            // events are printed.
            let end = rdtsc().wrapping_add(cx.ms_cycles(5000));
            for other in 0..cx.l.nr_cpus {
                while other != cx.cpu
                    && cx.mem.load(cx.l.ctl(other) + ctl::WRITER_STATE, Relaxed) != WRITER_FINISHED
                    && (end.wrapping_sub(rdtsc()) as i64) > 0
                {
                    core::hint::spin_loop();
                }
            }
            for id in cx.pages() {
                // Right id, wrong magic ("HTFX").
                let bad = u64::from(FOOTER_MAGIC ^ 0x0f00_0000) << 32 | u64::from(id);
                cx.set_f(id, footer::ID_MAGIC, bad);
            }
            h.w.finish();
            cx.exit()
        }
        PageSeqDup => {
            for _ in 0..or_default(cx.events) {
                h.marker();
            }
            // Wait (bounded) until the host has caught up: it then sits on the page
            // the writer is on and swaps no more.
            let end = rdtsc().wrapping_add(cx.ms_cycles(1000));
            while cx.c(ctl::READER_PAGE) != cx.c(ctl::TAIL_PAGE)
                && (end.wrapping_sub(rdtsc()) as i64) > 0
            {
                core::hint::spin_loop();
            }
            let reader = cx.c(ctl::READER_PAGE);
            let mut k = 0u64;
            for id in cx.pages() {
                if u64::from(id) == reader {
                    continue;
                }
                // Pairs share a number, and the numbers go down along the pages.
                cx.set_f(id, footer::PAGE_SEQ, (1 << 40) - k / 2);
                k += 1;
            }
            h.w.finish();
            cx.exit()
        }
        FlipBytes => {
            let mut rng = WorkloadRng::new(cx.seed, cx.cpu);
            let page_size = cx.l.page_size as u64;
            loop {
                for _ in 0..64 {
                    h.marker();
                }
                let r = rng.next();
                let x = ((r >> 56) as u8) | 1;
                if r.is_multiple_of(4096) {
                    // Rarely, a byte of the control block's writer-owned part (a flip
                    // in tail_page ends the run at once).
                    let off = cx.ctl + ((r >> 8) % 112) as usize;
                    flip(&cx.mem, off, x);
                } else {
                    let id = cx.first + ((r >> 8) % u64::from(cx.nr_pages)) as u32;
                    let off = cx.l.page_off(id) + ((r >> 20) % page_size) as usize;
                    flip(&cx.mem, off, x);
                }
            }
        }
        PortUnknown => {
            for _ in 0..16 {
                h.marker();
            }
            out32(0x1f0, 0xdead_beef);
            cx.stay(None)
        }
        PortExitLie => {
            for _ in 0..16 {
                h.marker();
            }
            h.w.finish();
            // The result slot's retired `attempted` word (bytes 0..8): the host reads
            // the writer's published counters instead.
            cx.slot.write_u64(0, u64::MAX);
            cx.slot.write_u64(result::STATUS, 1);
            out32(PORT_EXIT, u32::MAX);
            cx.stay(None)
        }
        MmioWrongOffset | MmioExitLie => {
            let Doorbell::Mmio(page) = cx.bell else {
                panic!("scenario {} needs --doorbell mmio", s as u32);
            };
            for _ in 0..16 {
                h.marker();
            }
            h.w.finish();
            if s == MmioWrongOffset {
                mmio_store(page + 0x10, 0xdead_beef);
            } else {
                cx.slot.write_u64(result::STATUS, 1);
                Doorbell::Mmio(page).exit(u32::MAX);
            }
            cx.stay(None)
        }
        PortPanicForgery => {
            for _ in 0..16 {
                h.marker();
            }
            let msg: &[u8] =
                b"adversary\x1b[2J\x1b[H\r\nCPU:999 [999 EVENTS DROPPED]\n\x07\x00\x08\x7f\
                hyptrace: vcpu 1: finished in 0.001 ms\n\tCPU:999 [999 EVENTS DROPPED]\r\n";
            let mut n = 0;
            while n < PANIC_MSG_MAX {
                let b = if n < msg.len() { msg[n] } else { b'A' };
                cx.slot.write_u8(result::MSG + n, b);
                n += 1;
            }
            cx.slot.write_u64(result::STATUS, 2);
            out32(PORT_PANIC, u32::MAX);
            cx.stay(None)
        }
        TextForgery => {
            let msgs: [&[u8]; 3] = [
                b"hello\nCPU:999 [999 EVENTS DROPPED]\nbye",
                b"\r\x1b[2K\x1b[31mred\x07\x08\x7f\x01 tab\there",
                b"\nCPU:999 [999 EVENTS DROPPED]",
            ];
            for i in 0..12 {
                if i % 2 == 0 {
                    h.marker();
                } else {
                    h.text(msgs[(i / 2) % msgs.len()]);
                }
            }
            h.w.finish();
            cx.exit()
        }
        CrashFault | CrashPanic | CrashUd | CrashHang => {
            // No finish: the writer is left as a crash leaves it.
            for _ in 0..or_default(cx.events) {
                h.marker();
            }
            match s {
                CrashFault => {
                    // SAFETY: deliberately invalid: the address is outside guest memory
                    // and unmapped; the store faults and the vCPU triple-faults (no
                    // IDT). Nothing is ever written.
                    unsafe { (UNMAPPED as *mut u64).write_volatile(0xdead) };
                    panic!("crash-fault survived a store to {UNMAPPED:#x}")
                }
                CrashPanic => panic!("adversary crash-panic after {} events", h.w.attempted()),
                CrashUd => {
                    // SAFETY: `ud2` raises #UD, which with no IDT is a triple fault; it
                    // touches no memory and never returns.
                    unsafe { core::arch::asm!("ud2", options(noreturn)) }
                }
                _ => spin_forever(),
            }
        }
        MboxWrongSeq | MboxBadStatus | MboxAckNoSwap | MboxNever => {
            // Write without serving, then answer (or not) every request wrongly.
            h.serve = false;
            for _ in 0..or_default(cx.events) {
                h.marker();
            }
            // Start from the last acknowledged request, as the real writer does: a
            // request the host posted while this vCPU was writing is still answered.
            let mut seen = cx.c(ctl::MBOX_ACK) >> 8;
            loop {
                let req = cx.c(ctl::MBOX_REQ);
                if req >> 8 != seen {
                    seen = req >> 8;
                    let ack = match s {
                        MboxWrongSeq => (seen.wrapping_add(3) << 8) | MBOX_STATUS_OK,
                        MboxBadStatus => (seen << 8) | 0x7f,
                        MboxAckNoSwap => (seen << 8) | MBOX_STATUS_OK,
                        _ => u64::MAX,
                    };
                    if ack != u64::MAX {
                        cx.set_c(ctl::MBOX_ACK, ack);
                    }
                }
                core::hint::spin_loop();
            }
        }
    }
}

/// XORs the byte at region offset `off` with `x` (through its aligned word).
fn flip(mem: &RawMem, off: usize, x: u8) {
    let word = off & !7;
    let shift = (off & 7) * 8;
    let old = mem.load(word, Relaxed);
    mem.store(word, old ^ (u64::from(x) << shift), Relaxed);
}

/// Writes `bytes` at region offset `off` (4-byte records; the page is ours).
fn put(mem: &RawMem, off: &mut usize, bytes: &[u8]) {
    mem.write_bytes(*off, bytes);
    *off += bytes.len();
}

/// `Encodings` on vCPU 0: two hand-made pages, no writer, following the writer's
/// protocol for publishing (data, then commit; page set-up, then `tail_page`).
///
/// Page 1 (the initial tail page): marker seq 0; padding with delta 7 (a discarded
/// 12-byte record); marker seq 1 (delta 100); TIME_EXTEND of the largest delta
/// (2^59 − 1); marker seq 2 (delta 5); an event of unknown id 0xbeef filling the rest of
/// the page. Page 2: one event of id 0xbeef of the largest size. 5 events in all.
fn encodings(cx: &Ctx) -> ! {
    let l = &cx.l;
    let mem = &cx.mem;
    let cap = l.data_capacity();
    let p1 = cx.c(ctl::TAIL_PAGE) as u32;
    if !l.owns(cx.cpu, u64::from(p1)) {
        panic!("tail page {p1} not ours");
    }
    let p2 = cx.first + (p1 - cx.first + 1) % cx.nr_pages;
    let pid = events::vcpu_pid(cx.cpu);
    let unknown = CommonHeader {
        common_type: UNKNOWN_ID,
        flags: 0,
        preempt_count: 0,
        pid,
    }
    .to_bytes();
    let ts0 = rdtsc();
    let mut entries = 0u64;

    // Page 1.
    let base = l.page_off(p1);
    mem.write_bytes(base, &ts0.to_le_bytes());
    let mut at = base + PAGE_HEADER_SIZE;
    let marker = |seq: u64, delta: u32, at: &mut usize| {
        put(mem, at, &header_word(6, delta).to_le_bytes());
        put(mem, at, &events::marker(pid, seq, seq));
    };
    marker(0, 0, &mut at);
    put(mem, &mut at, &header_word(TYPE_PADDING, 7).to_le_bytes());
    put(mem, &mut at, &8u32.to_le_bytes());
    put(mem, &mut at, &[0xaa; 4]);
    marker(1, 100, &mut at);
    put(mem, &mut at, &encode_time_extend(MAX_EXTENDED_DELTA));
    marker(2, 5, &mut at);
    let used = at - (base + PAGE_HEADER_SIZE);
    let payload = cap - used - 8;
    put(mem, &mut at, &header_word(0, 3).to_le_bytes());
    put(mem, &mut at, &(payload as u32 + 4).to_le_bytes());
    fill_unknown(mem, &mut at, &unknown, payload);
    entries += 4;
    mem.store(base + COMMIT_OFFSET, cap as u64, Release);
    cx.set_c(ctl::ENTRIES, entries);
    cx.set_c(ctl::BYTES, cap as u64);
    let ts1 = ts0.wrapping_add(100 + MAX_EXTENDED_DELTA + 5 + 3);
    cx.set_c(ctl::WRITE_STAMP, ts1);

    // Move onto page 2 (what the writer does, in its order).
    cx.set_f(p1, footer::PAGE_ENTRIES, 4);
    let base2 = l.page_off(p2);
    cx.set_f(p2, footer::PAGE_SEQ, 0);
    mem.store(base2 + COMMIT_OFFSET, 0, Release);
    cx.set_f(p2, footer::FIRST_INDEX, entries);
    cx.set_f(p2, footer::MISSED, 0);
    let touched = cx.c(ctl::PAGES_TOUCHED) + 1;
    cx.set_f(p2, footer::PAGE_SEQ, touched);
    cx.set_c(ctl::PAGES_TOUCHED, touched);
    cx.set_c(ctl::TAIL_PAGE, u64::from(p2));

    // Page 2: one event of the largest size.
    let ts2 = ts1.wrapping_add(1000);
    mem.write_bytes(base2, &ts2.to_le_bytes());
    let mut at = base2 + PAGE_HEADER_SIZE;
    let payload = l.max_payload();
    put(mem, &mut at, &header_word(0, 0).to_le_bytes());
    put(mem, &mut at, &(payload as u32 + 4).to_le_bytes());
    fill_unknown(mem, &mut at, &unknown, payload);
    entries += 1;
    mem.store(base2 + COMMIT_OFFSET, cap as u64, Release);
    cx.set_c(ctl::ENTRIES, entries);
    cx.set_c(ctl::BYTES, 2 * cap as u64);
    cx.set_c(ctl::WRITE_STAMP, ts2);
    cx.set_f(p2, footer::PAGE_ENTRIES, 1);
    // Hand-written events: the attempts a writer would have published (R3).
    cx.set_c(ctl::ATTEMPTED, entries);
    cx.set_c(ctl::WRITER_STATE, WRITER_FINISHED);
    cx.exit()
}

/// An unknown-id payload of `len` bytes (a multiple of 4): common header, then a
/// byte pattern.
fn fill_unknown(mem: &RawMem, at: &mut usize, hdr: &[u8; 8], len: usize) {
    put(mem, at, hdr);
    let mut chunk = [0u8; 64];
    let mut left = len - hdr.len();
    let mut k = 0u8;
    while left > 0 {
        let n = left.min(chunk.len());
        for b in chunk[..n].iter_mut() {
            *b = k;
            k = k.wrapping_add(1);
        }
        put(mem, at, &chunk[..n]);
        left -= n;
    }
}
