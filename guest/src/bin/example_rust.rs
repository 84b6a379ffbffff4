//! Example Rust guest: declares its own events with `hyptrace_writer::event!` (events the
//! host has never heard of), registers them, and emits them. Built by the tests
//! (`--features examples --bin example_rust`, tests/events.rs) and run with
//! `hyptrace run --guest PATH`; `trace-cmd report` prints its events with their fields.
//!
//! Run parameters used: `events` (per vCPU) and `rate`: 0 registers only the valid
//! events; 1 also registers malformed ones (overlapping fields, a size that does not
//! match its type, an enable bit out of range, an unknown C type, a duplicate name), which
//! the host rejects one by one while the valid ones are traced.
//!
//! Only the guest runtime (`hyptrace-guest-rt`) and the writer: the same code as the
//! template to copy out of the repository, guest/template/.
#![no_std]
#![no_main]

use hyptrace_abi::guest::RunParamBlock;
use hyptrace_abi::layout::pack as pack_hdr;
use hyptrace_abi::registry::PORT_REGISTER;
use hyptrace_abi::RawMem;
use hyptrace_guest_rt::notify;
use hyptrace_writer::events::{register, wait_registered, Event, Field};
use hyptrace_writer::{event, Writer};

hyptrace_guest_rt::entry!(guest_main);

event! {
    /// A packet went by.
    pub struct Packet {
        system: "demo",
        name: "packet",
        slot: 3,
        id: 0,
        print: "\"len=%u proto=%d flags=%u ok=%u\", REC->len, REC->proto, REC->flags, REC->ok",
        fields: { len: u32, proto: i32, flags: u8, ok: bool },
    }
}

event! {
    /// A counter ticked.
    pub struct Tick {
        system: "demo",
        name: "tick",
        slot: 4,
        id: 0,
        print: "\"n=%llu delta=%lld\", REC->n, REC->delta",
        fields: { n: u64, delta: i64 },
    }
}

const U64_AT_8: Field<'static> = Field {
    name: "a",
    ctype: "u64",
    offset: 8,
    size: 8,
    signed: false,
};

/// Overlapping fields (b at 12..16 inside a at 8..16).
static BAD_OVERLAP: Event<'static> = Event::new(
    "demo",
    "bad_overlap",
    &[
        U64_AT_8,
        Field {
            name: "b",
            ctype: "u32",
            offset: 12,
            size: 4,
            signed: false,
        },
    ],
    "\"a=%llu b=%u\", REC->a, REC->b",
    16,
    10,
    0,
);
/// `u32` declared 8 bytes long.
static BAD_SIZE: Event<'static> = Event::new(
    "demo",
    "bad_size",
    &[Field {
        name: "a",
        ctype: "u32",
        offset: 8,
        size: 8,
        signed: false,
    }],
    "\"a=%u\", REC->a",
    16,
    11,
    0,
);
/// Enable bit 64 (the word has 0..63).
static BAD_SLOT: Event<'static> = Event::new(
    "demo",
    "bad_slot",
    &[U64_AT_8],
    "\"a=%llu\", REC->a",
    16,
    64,
    0,
);
/// A C type the host does not know.
static BAD_TYPE: Event<'static> = Event::new(
    "demo",
    "bad_type",
    &[Field {
        name: "a",
        ctype: "struct foo",
        offset: 8,
        size: 8,
        signed: false,
    }],
    "\"a=%llu\", REC->a",
    16,
    12,
    0,
);
/// The same name as `demo:packet`.
static BAD_DUP: Event<'static> = Event::new(
    "demo",
    "packet",
    &[U64_AT_8],
    "\"a=%llu\", REC->a",
    16,
    13,
    0,
);

/// Entry from `_start` (`entry!`): rdi = pack GPA, rsi = vCPU id, rdx = RunParams GPA.
#[no_mangle]
pub extern "C" fn guest_main(pack: u64, cpu: u64, params_gpa: u64) -> ! {
    hyptrace_guest_rt::mark_start();
    // SAFETY: the VMM placed the run-parameter block at `params_gpa` (identity-mapped,
    // aligned) before any vCPU ran; plain integers, valid for any bytes.
    let p = unsafe { (params_gpa as usize as *const RunParamBlock).read_volatile() };
    if !p.header_ok() || cpu >= u64::from(p.nr_vcpus) {
        panic!("bad run parameter block");
    }
    let cpu = cpu as u32;
    // SAFETY: the trace region starts with its pack header, which says how long it is.
    let region = unsafe { ((pack as usize + pack_hdr::REGION_SIZE) as *const u64).read_volatile() };
    // SAFETY: the host placed the trace region at `pack`, identity-mapped, `region`
    // bytes long (its own pack says so), for the life of the VM; all accesses are
    // atomics or volatile copies.
    let mem = unsafe { RawMem::new(pack as *mut u8, region as usize) };

    let good: [&Event<'static>; 2] = [Packet::event(), Tick::event()];
    let all: [&Event<'static>; 7] = [
        Packet::event(),
        &BAD_OVERLAP,
        &BAD_SIZE,
        Tick::event(),
        &BAD_SLOT,
        &BAD_TYPE,
        &BAD_DUP,
    ];
    let events: &[&Event<'static>] = if p.rate == 1 { &all } else { &good };
    let r = if cpu == 0 {
        register(&mem, events, || notify(PORT_REGISTER, cpu))
    } else {
        wait_registered(&mem, events, 1 << 32)
    };
    if let Err(e) = r {
        panic!("cannot register: {e}");
    }

    let mut w = match Writer::attach(mem, cpu) {
        Ok(w) => w,
        Err(e) => panic!("cannot attach the trace writer: {e}"),
    };
    for i in 0..p.events {
        Packet::emit(
            &mut w,
            (i * 3) as u32,
            -(i as i32),
            (i & 0xff) as u8,
            i % 2 == 0,
        );
        Tick::emit(&mut w, i, 5 - i as i64);
    }
    // The writer has published its attempts all along (attempted, skipped: R3).
    w.finish();
    hyptrace_guest_rt::exit(cpu)
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    hyptrace_guest_rt::report_panic(info)
}
