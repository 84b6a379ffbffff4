//! The built-in events (system `guest`: `marker`, `span`, `text`) as the guest registers
//! them: the host knows nothing of them but what this table says (formats, enable bits,
//! requested ids). Shared by the payload and the adversary guest.

use hyptrace_abi::events::{
    MARKER_ID, MARKER_SIZE, MARKER_SLOT, SPAN_ID, SPAN_SIZE, SPAN_SLOT, SYSTEM, TEXT_ID, TEXT_SLOT,
    TEXT_STR_OFFSET,
};
use hyptrace_abi::registry::DATA_LOC_STR;
use hyptrace_abi::RawMem;
use hyptrace_guest_rt::Doorbell;
use hyptrace_writer::events::{register, wait_registered, Event, Field, RegisterError};

const fn u64_field(name: &'static str, offset: u32) -> Field<'static> {
    Field {
        name,
        ctype: "u64",
        offset,
        size: 8,
        signed: false,
    }
}

/// `guest:marker`: `u64 seq @8, u64 value @16`.
pub static MARKER: Event<'static> = Event::new(
    SYSTEM,
    "marker",
    &[u64_field("seq", 8), u64_field("value", 16)],
    "\"seq=%llu value=%llu\", REC->seq, REC->value",
    MARKER_SIZE as u32,
    MARKER_SLOT,
    MARKER_ID,
);

/// `guest:span`: `u64 seq @8, u64 id @16, u64 dur @24`.
pub static SPAN: Event<'static> = Event::new(
    SYSTEM,
    "span",
    &[
        u64_field("seq", 8),
        u64_field("id", 16),
        u64_field("dur", 24),
    ],
    "\"seq=%llu id=%llu dur=%llu\", REC->seq, REC->id, REC->dur",
    SPAN_SIZE as u32,
    SPAN_SLOT,
    SPAN_ID,
);

/// `guest:text`: `u64 seq @8, __data_loc char[] msg @16`, the string after the fixed
/// record.
pub static TEXT: Event<'static> = Event::new(
    SYSTEM,
    "text",
    &[
        u64_field("seq", 8),
        Field {
            name: "msg",
            ctype: DATA_LOC_STR,
            offset: 16,
            size: 4,
            signed: false,
        },
    ],
    "\"seq=%llu msg=%s\", REC->seq, __get_str(msg)",
    TEXT_STR_OFFSET as u32,
    TEXT_SLOT,
    TEXT_ID,
);

/// The built-in events, in registration order.
pub static BUILTINS: [&Event<'static>; 3] = [&MARKER, &SPAN, &TEXT];

/// Polls of the table a vCPU other than 0 makes while vCPU 0 registers. The host may
/// hold vCPU 0's answer until its drain loop starts (at most 10 s, `ANSWER_HOLD_MAX`,
/// docs/abi.md); 2^32 polls, each with a spin-loop hint, outlast that by far and only
/// bound a host that never answers.
const WAIT_SPINS: u64 = 1 << 32;

/// Registers [`BUILTINS`] (vCPU 0) or waits for vCPU 0's registration to be answered
/// (the others), before any event is written. Panics if the host refused the table (a
/// bug on one side or the other); a pack without a table (an older host) leaves each
/// event its requested id. vCPU 0 rings `bell` (the entry's doorbell), a compiler
/// barrier: the table's stores stay before it and the loads of the answer after it.
pub fn register_builtins(mem: &RawMem, cpu: u32, bell: Doorbell) {
    let r = if cpu == 0 {
        register(mem, &BUILTINS, || bell.register())
    } else {
        wait_registered(mem, &BUILTINS, WAIT_SPINS)
    };
    match r {
        Ok(_) | Err(RegisterError::NoTable) => {}
        Err(e) => panic!("cannot register the built-in events: {e}"),
    }
}
