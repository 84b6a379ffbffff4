//! The hyptrace guest SDK for C: the Rust writer (`hyptrace-writer`) behind a C ABI.
//!
//! One implementation of the protocol: every function here forwards to the writer
//! crate (`Writer::attach`, `hyptrace_writer::events::{register, wait_registered}`,
//! `Event::emit`, `Writer::serve_mailbox`, `Writer::finish`); this file only converts C
//! descriptors and keeps the per-vCPU writers and the registered events in static
//! storage (no allocator). The header, `include/hyptrace.h`, is generated from this file
//! by cbindgen (build.rs). Usage: docs/sdk-c.md; example: guest/examples/c/.
//!
//! Contract with the C program: it runs as the VMM's guest (entry `rdi` = pack GPA,
//! `rsi` = vCPU id, `rdx` = run-parameter block GPA, `rcx` = MMIO doorbell page or 0,
//! CPL3, GS base = its result slot; `hyptrace_abi::guest`), calls `ht_attach_doorbell`
//! (or `ht_attach`, which rings by port) once per vCPU on that vCPU, and uses a
//! writer only on its own vCPU. Event descriptors and their strings live as long as the
//! program (static storage).
#![no_std]

use core::cell::UnsafeCell;
use core::ffi::{c_char, c_void};
use core::mem::MaybeUninit;
use core::panic::PanicInfo;
use core::sync::atomic::{AtomicU32, Ordering};

use hyptrace_abi::guest::{result, RunParamBlock, RUN_FLAG_SERVE_MAILBOX, VCPU_RESULT_SIZE};
use hyptrace_abi::layout::pack as pack_hdr;
// The TSC, port I/O, the panic report and the C memory functions (there is no libc):
// the guest images' shared runtime, which the embedded payload links too.
use hyptrace_abi::registry::{MAX_EVENTS, MAX_FIELDS};
use hyptrace_abi::RawMem;
use hyptrace_guest_rt::Doorbell;
use hyptrace_writer::events::{self, Event, Field, RegisterError};
use hyptrace_writer::{WriteOutcome, Writer};

/// Most vCPUs (the VMM's limit).
pub const HT_MAX_CPUS: u32 = 256;
/// Most events one registration describes.
pub const HT_MAX_EVENTS: u32 = 64;
/// Most fields of all events together.
pub const HT_MAX_FIELDS: u32 = 1024;
// Literals for the header (cbindgen cannot evaluate another crate's constants).
const _: () = assert!(HT_MAX_EVENTS as usize == MAX_EVENTS && HT_MAX_FIELDS as usize == MAX_FIELDS);
/// Longest string of a descriptor (names, types, print format), NUL excluded.
pub const HT_MAX_STRING: u32 = 4096;

/// `ht_emit`: the record was committed to the ring.
pub const HT_WRITTEN: i32 = 0;
/// `ht_emit`: not written, the event is disabled (or not registered): counted as
/// skipped.
pub const HT_DISABLED: i32 = 1;
/// `ht_emit`: not written, the ring is full in stop mode (counted as dropped).
pub const HT_DROPPED: i32 = 2;
/// `ht_emit`: not written, the record can never fit a page.
pub const HT_TOO_LARGE: i32 = 3;
/// `ht_emit`: not written, the ring is corrupt (the writer stopped writing).
pub const HT_CORRUPT: i32 = 4;

/// Registration: the pack has no registration table (an older host); every event got
/// its requested id.
pub const HT_ERR_NO_TABLE: i32 = -1;
/// Registration: the pack is not valid.
pub const HT_ERR_BAD_PACK: i32 = -2;
/// Registration: more than `HT_MAX_EVENTS` events or `HT_MAX_FIELDS` fields.
pub const HT_ERR_TOO_MANY: i32 = -3;
/// Registration: the table needs more bytes than the host reserved.
pub const HT_ERR_TOO_LARGE: i32 = -4;
/// Registration: the table was already written (one registration per run).
pub const HT_ERR_ALREADY_REGISTERED: i32 = -5;
/// Registration: the host refused the table: a bad header, or a registration after
/// the run went on without one (docs/abi.md); the events get no id.
pub const HT_ERR_REFUSED: i32 = -6;
/// Registration: the host has not answered.
pub const HT_ERR_NOT_ANSWERED: i32 = -7;
/// Registration: a descriptor is unusable (a NULL or non-UTF-8 string, one longer than
/// `HT_MAX_STRING`, NULL fields with `nr_fields > 0`), or differs in number from the
/// events another vCPU registered.
pub const HT_ERR_BAD_EVENT: i32 = -8;
/// A NULL writer or event.
pub const HT_ERR_NULL: i32 = -9;

/// One field of an event record (the 8-byte common header at 0..8 is implicit).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HtField {
    /// Field name (NUL-terminated).
    pub name: *const c_char,
    /// C type as trace-cmd knows it: `u64`, `s32`, `char[16]`, `__data_loc char[]`, ...
    /// (docs/abi.md, "Event registration").
    pub ctype: *const c_char,
    /// Offset in the record (at least 8).
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
    /// Whether the type is signed.
    pub is_signed: bool,
}

/// An event the guest can emit: its description for the registration table and, once
/// registered, the SDK's handle to it.
#[repr(C)]
#[derive(Debug)]
pub struct HtEvent {
    /// Trace-event system (`guest`, `myfw`, ...).
    pub system: *const c_char,
    /// Event name.
    pub name: *const c_char,
    /// Print format as after `print fmt: ` in a format file: `"\"a=%llu\", REC->a"`.
    pub print_fmt: *const c_char,
    /// The fields, in record order.
    pub fields: *const HtField,
    /// Number of fields.
    pub nr_fields: u32,
    /// Fixed record size, the 8-byte common header included.
    pub size: u32,
    /// The enable bit the writer tests (0..63, one event per bit).
    pub slot: u32,
    /// Id asked for (0: any).
    pub requested_id: u16,
    /// Set by `ht_register`/`ht_wait_registered` (0 before): the SDK's handle. Leave 0.
    pub handle: u16,
}

/// The run parameters the VMM passes (`ht_read_params`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HtRunParams {
    /// Workload number (`run --workload`).
    pub workload: u32,
    /// Number of vCPUs.
    pub nr_vcpus: u32,
    /// Events each vCPU should attempt (`--events`).
    pub events: u64,
    /// Events per second per vCPU, 0 = as fast as possible (`--rate`).
    pub rate: u64,
    /// TSC frequency in kHz (0 = unknown).
    pub tsc_khz: u64,
    /// Seed of pseudo-random choices.
    pub seed: u64,
    /// `RUN_FLAG_*` (bit 0: serve the mailbox, `--swap guest`; `ht_emit` does).
    pub flags: u32,
    /// `--burst`.
    pub burst: u32,
}

/// One vCPU's writer (opaque to C).
pub struct HtWriter {
    w: Writer<RawMem>,
    cpu: u32,
    params: u64,
    serve: bool,
    /// Where `ht_register` and `ht_exit` ring the VMM.
    bell: Doorbell,
}

/// Static storage written once per slot by its owner, then read.
struct Pool<T, const N: usize>([UnsafeCell<MaybeUninit<T>>; N]);

// SAFETY: each element is written by one vCPU before it is published (a writer slot by
// its own vCPU; the event pool by the one vCPU that won `POOL_STATE`, before its Release
// store of POOL_BUILT) and only read by others after an Acquire load that sees it.
unsafe impl<T, const N: usize> Sync for Pool<T, N> {}

impl<T, const N: usize> Pool<T, N> {
    const fn new() -> Self {
        Self([const { UnsafeCell::new(MaybeUninit::uninit()) }; N])
    }

    fn ptr(&self, i: usize) -> *mut T {
        self.0[i].get().cast()
    }
}

static WRITERS: Pool<HtWriter, { HT_MAX_CPUS as usize }> = Pool::new();
static FIELDS: Pool<Field<'static>, MAX_FIELDS> = Pool::new();
static EVENTS: Pool<Event<'static>, MAX_EVENTS> = Pool::new();
/// Events in `EVENTS` (valid once POOL_BUILT).
static NR_EVENTS: AtomicU32 = AtomicU32::new(0);
/// 0 empty, 1 being built, 2 built, 3 the descriptors were bad.
static POOL_STATE: AtomicU32 = AtomicU32::new(0);
const POOL_EMPTY: u32 = 0;
const POOL_BUILDING: u32 = 1;
const POOL_BUILT: u32 = 2;
const POOL_BAD: u32 = 3;
/// Spins a vCPU waits for another one building the pool (it only copies descriptors).
const POOL_SPINS: u64 = 1 << 32;
/// A placeholder for the unused entries of the reference array.
static NO_EVENT: Event<'static> = Event::new("", "", &[], "", 0, 0, 0);

/// A NUL-terminated string of at most [`HT_MAX_STRING`] bytes as UTF-8.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that lives for the program.
unsafe fn c_str(p: *const c_char) -> Option<&'static str> {
    if p.is_null() {
        return None;
    }
    let mut n = 0usize;
    // SAFETY: the caller guarantees a NUL-terminated string: every byte up to the NUL
    // is readable; we stop at the NUL or at the bound.
    while unsafe { p.add(n).read() } != 0 {
        n += 1;
        if n > HT_MAX_STRING as usize {
            return None;
        }
    }
    // SAFETY: the `n` bytes before the NUL were just read; static per the contract.
    let bytes = unsafe { core::slice::from_raw_parts(p.cast::<u8>(), n) };
    core::str::from_utf8(bytes).ok()
}

/// Copies the C descriptors into the pool; `false` if one is unusable.
///
/// # Safety
/// Only the vCPU that won `POOL_STATE` calls it; `events` holds `n` valid pointers.
unsafe fn build_pool(events: *const *mut HtEvent, n: usize) -> bool {
    if n > MAX_EVENTS {
        return false;
    }
    let mut nf = 0usize;
    for i in 0..n {
        // SAFETY: the caller guarantees `n` pointers.
        let ev = unsafe { *events.add(i) };
        if ev.is_null() {
            return false;
        }
        // SAFETY: a valid descriptor per the contract.
        let d = unsafe { &*ev };
        let k = d.nr_fields as usize;
        if (k > 0 && d.fields.is_null()) || k > MAX_FIELDS - nf {
            return false;
        }
        let first = nf;
        for j in 0..k {
            // SAFETY: `fields` holds `nr_fields` entries (contract).
            let f = unsafe { *d.fields.add(j) };
            // SAFETY: descriptor strings per the contract.
            let (Some(name), Some(ctype)) = (unsafe { c_str(f.name) }, unsafe { c_str(f.ctype) })
            else {
                return false;
            };
            // SAFETY: nf < MAX_FIELDS; this vCPU builds the pool alone (caller).
            unsafe {
                FIELDS.ptr(nf).write(Field {
                    name,
                    ctype,
                    offset: f.offset,
                    size: f.size,
                    signed: f.is_signed,
                })
            };
            nf += 1;
        }
        // SAFETY: the fields first..nf were initialised above and are never written
        // again (the pool is built once).
        let fields: &'static [Field<'static>] =
            unsafe { core::slice::from_raw_parts(FIELDS.ptr(first), k) };
        // SAFETY: descriptor strings per the contract.
        let (Some(system), Some(name), Some(fmt)) = (
            unsafe { c_str(d.system) },
            unsafe { c_str(d.name) },
            unsafe { c_str(d.print_fmt) },
        ) else {
            return false;
        };
        // SAFETY: i < MAX_EVENTS; built alone (caller).
        unsafe {
            EVENTS.ptr(i).write(Event::new(
                system,
                name,
                fields,
                fmt,
                d.size,
                d.slot,
                d.requested_id,
            ))
        };
        // SAFETY: the descriptor is the C program's; only this vCPU writes `handle`,
        // before the Release store that publishes the pool.
        unsafe { (*ev).handle = (i + 1) as u16 };
    }
    NR_EVENTS.store(n as u32, Ordering::Relaxed);
    true
}

/// Builds the pool once (whichever vCPU comes first), or waits for it; returns the
/// registered events (`None`: bad descriptors).
///
/// # Safety
/// `events` holds `n` valid descriptor pointers.
unsafe fn pool(events: *const *mut HtEvent, n: u32) -> Option<&'static [Event<'static>]> {
    let n = n as usize;
    if events.is_null() && n > 0 {
        return None;
    }
    match POOL_STATE.compare_exchange(
        POOL_EMPTY,
        POOL_BUILDING,
        Ordering::Acquire,
        Ordering::Acquire,
    ) {
        Ok(_) => {
            // SAFETY: we won the state: we build alone; `events` per the caller.
            let ok = unsafe { build_pool(events, n) };
            // Release: publishes the pool (and the descriptors' handles) to the Acquire
            // loads below on the other vCPUs.
            POOL_STATE.store(if ok { POOL_BUILT } else { POOL_BAD }, Ordering::Release);
        }
        Err(_) => {
            let mut spins = 0u64;
            // Acquire: pairs with the Release store above.
            while POOL_STATE.load(Ordering::Acquire) == POOL_BUILDING {
                spins += 1;
                if spins > POOL_SPINS {
                    return None;
                }
                core::hint::spin_loop();
            }
        }
    }
    if POOL_STATE.load(Ordering::Acquire) != POOL_BUILT {
        return None;
    }
    let built = NR_EVENTS.load(Ordering::Relaxed) as usize;
    if built != n {
        return None;
    }
    // SAFETY: the first `built` events were initialised before POOL_BUILT was published
    // (Acquire above) and are only read (their result words are atomics) from now on.
    Some(unsafe { core::slice::from_raw_parts(EVENTS.ptr(0), built) })
}

/// The pool event behind a descriptor's handle.
fn pool_event(ev: &HtEvent) -> Option<&'static Event<'static>> {
    let h = usize::from(ev.handle);
    // Acquire: pairs with the Release store that published the pool.
    if h == 0 || POOL_STATE.load(Ordering::Acquire) != POOL_BUILT {
        return None;
    }
    if h > NR_EVENTS.load(Ordering::Relaxed) as usize {
        return None;
    }
    // SAFETY: h - 1 < NR_EVENTS: initialised before POOL_BUILT; read-only since.
    Some(unsafe { &*EVENTS.ptr(h - 1) })
}

fn register_error(e: RegisterError) -> i32 {
    match e {
        RegisterError::NoTable => HT_ERR_NO_TABLE,
        RegisterError::BadPack => HT_ERR_BAD_PACK,
        RegisterError::TooMany => HT_ERR_TOO_MANY,
        RegisterError::TooLarge { .. } => HT_ERR_TOO_LARGE,
        RegisterError::AlreadyRegistered => HT_ERR_ALREADY_REGISTERED,
        RegisterError::Refused => HT_ERR_REFUSED,
        RegisterError::NotAnswered => HT_ERR_NOT_ANSWERED,
    }
}

/// Runs `f` on the writer and the registered events, with the events as the
/// writer crate wants them (`&[&Event]`).
///
/// # Safety
/// `w` is NULL or from `ht_attach` on this vCPU; `events` holds `n` valid descriptors.
unsafe fn with_events(
    w: *mut HtWriter,
    events: *const *mut HtEvent,
    n: u32,
    f: impl FnOnce(&RawMem, &[&Event<'static>]) -> Result<usize, RegisterError>,
) -> i32 {
    // SAFETY: per the caller.
    let Some(w) = (unsafe { w.as_mut() }) else {
        return HT_ERR_NULL;
    };
    // SAFETY: per the caller.
    let Some(evs) = (unsafe { pool(events, n) }) else {
        return HT_ERR_BAD_EVENT;
    };
    let mut refs: [&Event<'static>; MAX_EVENTS] = [&NO_EVENT; MAX_EVENTS];
    for (r, e) in refs.iter_mut().zip(evs) {
        *r = e;
    }
    match f(w.w.mem(), &refs[..evs.len()]) {
        Ok(n) => i32::try_from(n).unwrap_or(i32::MAX),
        Err(e) => register_error(e),
    }
}

/// Attaches vCPU `cpu`'s writer to the rings in the pack at `pack_gpa` (the entry's
/// `rdi`); `params_gpa` (the entry's `rdx`, or 0) gives the run flags and the result
/// slot `ht_exit` fills. Returns NULL if `cpu` is out of range or the pack is not valid.
/// Call once per vCPU, on that vCPU. `ht_register` and `ht_exit` ring the VMM by port;
/// `ht_attach_doorbell` rings where the VMM says.
///
/// # Safety
/// `pack_gpa` and `params_gpa` are the addresses the VMM passed at entry.
#[no_mangle]
pub unsafe extern "C" fn ht_attach(pack_gpa: u64, cpu: u32, params_gpa: u64) -> *mut HtWriter {
    // SAFETY: per the caller.
    unsafe { ht_attach_doorbell(pack_gpa, cpu, params_gpa, 0) }
}

/// `ht_attach`, with `doorbell_gpa` the entry's `rcx` (entry ABI version 2,
/// docs/abi.md "Doorbell"): 0 — ring the VMM by port (`ht_attach`), else the MMIO
/// doorbell page `ht_register` and `ht_exit` store to.
///
/// # Safety
/// `pack_gpa`, `params_gpa` and `doorbell_gpa` are the values the VMM passed at entry.
#[no_mangle]
pub unsafe extern "C" fn ht_attach_doorbell(
    pack_gpa: u64,
    cpu: u32,
    params_gpa: u64,
    doorbell_gpa: u64,
) -> *mut HtWriter {
    let tsc = ht_rdtsc();
    if cpu >= HT_MAX_CPUS || pack_gpa == 0 {
        return core::ptr::null_mut();
    }
    let mut serve = false;
    if params_gpa != 0 {
        let p = read_block(params_gpa);
        if !p.header_ok() || cpu >= p.nr_vcpus {
            return core::ptr::null_mut();
        }
        serve = p.flags & RUN_FLAG_SERVE_MAILBOX != 0;
        // SAFETY: the result slot of this vCPU (VMM contract), 8-aligned.
        unsafe { slot_store(params_gpa, &p, cpu, result::TSC_START, tsc) };
    }
    // SAFETY: the VMM placed the pack at `pack_gpa`, identity-mapped; its header says
    // how long the trace region is.
    let region =
        unsafe { ((pack_gpa as usize + pack_hdr::REGION_SIZE) as *const u64).read_volatile() };
    // SAFETY: the trace region is `region` bytes at `pack_gpa` for the life of the VM;
    // the host accesses it only through atomics and volatile copies (as in the Rust
    // payload); the writer validates the pack against it.
    let mem = unsafe { RawMem::new(pack_gpa as *mut u8, region as usize) };
    let Ok(w) = Writer::attach(mem, cpu) else {
        return core::ptr::null_mut();
    };
    let p = WRITERS.ptr(cpu as usize);
    // SAFETY: slot `cpu` belongs to this vCPU (contract: one attach per vCPU, on it).
    unsafe {
        p.write(HtWriter {
            w,
            cpu,
            params: params_gpa,
            serve,
            bell: Doorbell::from_entry(doorbell_gpa),
        })
    };
    p
}

/// Registers `events` (an array of `n` descriptor pointers) with the host: writes the
/// registration table, exits to the VMM once (its doorbell: port 0x512, or the MMIO
/// page's register bell), reads the ids. Call it on one
/// vCPU (vCPU 0) before its first event; the others call `ht_wait_registered` with the
/// same array. Returns the number of events accepted, or a negative `HT_ERR_*`
/// (`HT_ERR_NO_TABLE`: an older host; every event got its requested id).
///
/// # Safety
/// `w` from `ht_attach` on this vCPU; `events` holds `n` pointers to descriptors that
/// live for the program.
#[no_mangle]
pub unsafe extern "C" fn ht_register(w: *mut HtWriter, events: *const *mut HtEvent, n: u32) -> i32 {
    // SAFETY: per the caller (NULL: `with_events` answers HT_ERR_NULL).
    let bell = unsafe { w.as_ref() }.map_or(Doorbell::Port, |w| w.bell);
    // SAFETY: per the caller.
    unsafe {
        with_events(w, events, n, |mem, evs| {
            events::register(mem, evs, || bell.register())
        })
    }
}

/// On the vCPUs that do not register: waits (at most `spins` polls) until the host has
/// answered vCPU 0's registration of the same `events`, and reads the ids. Returns as
/// `ht_register`.
///
/// # Safety
/// As `ht_register`.
#[no_mangle]
pub unsafe extern "C" fn ht_wait_registered(
    w: *mut HtWriter,
    events: *const *mut HtEvent,
    n: u32,
    spins: u64,
) -> i32 {
    // SAFETY: per the caller.
    unsafe {
        with_events(w, events, n, |mem, evs| {
            events::wait_registered(mem, evs, spins)
        })
    }
}

/// The id the host gave `ev`, or -1 if it is not registered (or was rejected).
///
/// # Safety
/// `ev` is NULL or a descriptor.
#[no_mangle]
pub unsafe extern "C" fn ht_event_id(ev: *const HtEvent) -> i32 {
    // SAFETY: per the caller.
    let Some(ev) = (unsafe { ev.as_ref() }) else {
        return -1;
    };
    pool_event(ev).and_then(Event::id).map_or(-1, i32::from)
}

/// Whether `ev` is registered and enabled on this vCPU now (one load of the enable
/// word): test it before building an expensive record.
///
/// # Safety
/// `w` from `ht_attach` on this vCPU; `ev` a descriptor.
#[no_mangle]
pub unsafe extern "C" fn ht_enabled(w: *const HtWriter, ev: *const HtEvent) -> bool {
    // SAFETY: per the caller.
    let (Some(w), Some(ev)) = (unsafe { w.as_ref() }, unsafe { ev.as_ref() }) else {
        return false;
    };
    pool_event(ev).is_some_and(|e| e.id().is_some() && w.w.enabled(e.slot))
}

/// Writes `record` (`len` bytes, starting with the 8-byte common header, whose first two
/// bytes become the event's id) with timestamp `ts` (raw TSC: `ht_rdtsc()`), if `ev` is
/// registered and enabled; a disabled event costs one load and counts as skipped. In
/// `--swap guest` runs it then serves the host's mailbox. Returns `HT_WRITTEN`,
/// `HT_DISABLED`, `HT_DROPPED`, `HT_TOO_LARGE`, `HT_CORRUPT` or `HT_ERR_NULL`.
///
/// # Safety
/// `w` from `ht_attach` on this vCPU; `ev` a descriptor; `record` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ht_emit(
    w: *mut HtWriter,
    ev: *const HtEvent,
    ts: u64,
    record: *mut c_void,
    len: usize,
) -> i32 {
    // SAFETY: per the caller.
    let (Some(w), Some(ev)) = (unsafe { w.as_mut() }, unsafe { ev.as_ref() }) else {
        return HT_ERR_NULL;
    };
    if record.is_null() && len != 0 {
        return HT_ERR_NULL;
    }
    let out = match pool_event(ev) {
        Some(e) => {
            let rec: &mut [u8] = if len == 0 {
                &mut []
            } else {
                // SAFETY: `record` is valid for `len` bytes (caller).
                unsafe { core::slice::from_raw_parts_mut(record.cast::<u8>(), len) }
            };
            e.emit(&mut w.w, ts, rec)
        }
        None => {
            w.w.skip();
            WriteOutcome::Disabled
        }
    };
    if w.serve {
        w.w.serve_mailbox();
    }
    match out {
        WriteOutcome::Written => HT_WRITTEN,
        WriteOutcome::Disabled => HT_DISABLED,
        WriteOutcome::Dropped => HT_DROPPED,
        WriteOutcome::TooLarge => HT_TOO_LARGE,
        WriteOutcome::Corrupt => HT_CORRUPT,
    }
}

/// Serves the host's mailbox (`--swap guest`) from an idle loop; a no-op otherwise.
///
/// # Safety
/// `w` from `ht_attach` on this vCPU (or NULL).
#[no_mangle]
pub unsafe extern "C" fn ht_idle(w: *mut HtWriter) {
    // SAFETY: per the caller.
    if let Some(w) = unsafe { w.as_mut() } {
        if w.serve {
            w.w.serve_mailbox();
        }
    }
}

/// Marks this vCPU's writer finished (`Writer::finish`): it writes no more, and the
/// host reads the rest without swapping. `ht_exit` does it; for programs with their own
/// exit path.
///
/// # Safety
/// `w` from `ht_attach` on this vCPU (or NULL: nothing).
#[no_mangle]
pub unsafe extern "C" fn ht_finish(w: *mut HtWriter) {
    // SAFETY: per the caller.
    if let Some(w) = unsafe { w.as_mut() } {
        w.w.finish();
    }
}

/// Events this vCPU's writer skipped because they were disabled.
///
/// # Safety
/// `w` from `ht_attach` on this vCPU (or NULL: 0).
#[no_mangle]
pub unsafe extern "C" fn ht_skipped(w: *const HtWriter) -> u64 {
    // SAFETY: per the caller.
    unsafe { w.as_ref() }.map_or(0, |w| w.w.skipped())
}

/// Events this vCPU's writer was given (every `ht_emit`: written, dropped, skipped or
/// refused). The writer publishes it and `ht_skipped`'s count in its control block as
/// it goes; the host reads them at any moment.
///
/// # Safety
/// `w` from `ht_attach` on this vCPU (or NULL: 0).
#[no_mangle]
pub unsafe extern "C" fn ht_attempted(w: *const HtWriter) -> u64 {
    // SAFETY: per the caller.
    unsafe { w.as_ref() }.map_or(0, |w| w.w.attempted())
}

/// The time-stamp counter (the timestamps the host converts).
#[no_mangle]
pub extern "C" fn ht_rdtsc() -> u64 {
    hyptrace_guest_rt::rdtsc()
}

/// Copies the run parameters at `params_gpa` (the entry's `rdx`) into `out`; `false`
/// if the block's header is not the one this SDK knows.
///
/// # Safety
/// `params_gpa` as the VMM passed it; `out` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn ht_read_params(params_gpa: u64, out: *mut HtRunParams) -> bool {
    if params_gpa == 0 || out.is_null() {
        return false;
    }
    let p = read_block(params_gpa);
    if !p.header_ok() {
        return false;
    }
    // SAFETY: `out` valid (caller).
    unsafe {
        out.write(HtRunParams {
            workload: p.workload,
            nr_vcpus: p.nr_vcpus,
            events: p.events,
            rate: p.rate,
            tsc_khz: p.tsc_khz,
            seed: p.seed,
            flags: p.flags,
            burst: p.burst,
        })
    };
    true
}

/// Ends this vCPU's run: marks the writer finished, fills the result slot (end TSC,
/// mailbox requests served, status) and exits to the VMM. Never returns. (The
/// attempted and skipped counts are the writer's, published as it goes.)
///
/// # Safety
/// `w` from `ht_attach` on this vCPU, attached with its `params_gpa`.
#[no_mangle]
pub unsafe extern "C" fn ht_exit(w: *mut HtWriter) -> ! {
    // SAFETY: per the caller.
    let Some(w) = (unsafe { w.as_mut() }) else {
        panic!("ht_exit: NULL writer");
    };
    w.w.finish();
    if w.params == 0 {
        panic!("ht_exit: the writer was attached without run parameters");
    }
    let p = read_block(w.params);
    let served = w.w.mailbox_served();
    // SAFETY: this vCPU's result slot (checked at attach: cpu < nr_vcpus).
    unsafe {
        slot_store(w.params, &p, w.cpu, result::MAILBOX_SERVED, served);
        slot_store(w.params, &p, w.cpu, result::TSC_END, ht_rdtsc());
        slot_store(w.params, &p, w.cpu, result::STATUS, 1);
    }
    w.bell.exit(w.cpu);
    loop {
        core::hint::spin_loop();
    }
}

/// Panics with `msg` (NUL-terminated, or NULL): the VMM reports it and the run exits 3.
///
/// # Safety
/// `msg` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn ht_panic(msg: *const c_char) -> ! {
    // The C program's own message, without a place in this library.
    // SAFETY: per the caller.
    match unsafe { c_str(msg) } {
        Some(m) => hyptrace_guest_rt::report(format_args!("{m}"), None),
        None => hyptrace_guest_rt::report(format_args!("ht_panic"), None),
    }
}

fn read_block(gpa: u64) -> RunParamBlock {
    // SAFETY: the VMM placed the block at `gpa` in mapped guest memory, 8-aligned, and
    // wrote it before any vCPU ran; plain integers, valid for any bytes.
    unsafe { (gpa as usize as *const RunParamBlock).read_volatile() }
}

/// Stores `v` at `off` of vCPU `cpu`'s result slot.
///
/// # Safety
/// `params` is the VMM's block with `p` its contents and `cpu < p.nr_vcpus`.
unsafe fn slot_store(params: u64, p: &RunParamBlock, cpu: u32, off: usize, v: u64) {
    let slot = params
        .wrapping_add(p.results_off)
        .wrapping_add(u64::from(cpu) * VCPU_RESULT_SIZE as u64);
    // SAFETY: per the caller: inside this vCPU's slot, 8-aligned offsets.
    unsafe { ((slot as usize + off) as *mut u64).write_volatile(v) }
}

#[panic_handler]
fn panic(info: &PanicInfo<'_>) -> ! {
    hyptrace_guest_rt::report_panic(info)
}
