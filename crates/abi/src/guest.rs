//! The contract between the VMM and the guest payload: entry registers, the run
//! parameter block, per-vCPU result slots and the I/O ports.
//!
//! Entry (every vCPU; entry ABI version 2, docs/abi.md): `rdi` = guest-physical address
//! of the trace pack (the start of the trace region, see [`crate::layout::pack`]), `rsi` =
//! vCPU id, `rdx` = guest-physical address of the [`RunParamBlock`], `rcx` = the doorbell
//! (0: ring by port; else the guest-physical address of the MMIO doorbell page, see
//! [`DOORBELL_REGISTER_OFF`]), `rsp` = top of this vCPU's stack, GS base = the address of
//! this vCPU's result slot. Guest memory is identity-mapped, so these addresses are also
//! the guest's virtual addresses.
//!
//! Exit: the guest fills its result slot (offsets in [`result`]), then writes its vCPU id to
//! [`PORT_EXIT`] (32-bit `out`), or at [`DOORBELL_EXIT_OFF`] of the MMIO doorbell page. A panic writes the message into the slot's `msg` bytes
//! and its length to [`PORT_PANIC`]. Any CPU exception triple-faults (the IDT is empty),
//! which the VMM sees as `KVM_EXIT_SHUTDOWN`.
//!
//! All fields are little-endian; every block starts with a magic, a version and a size.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Port the guest writes its vCPU id to when it has finished (after filling its result slot).
pub const PORT_EXIT: u16 = 0x0510;
/// Port the guest writes a panic message length to (message in its result slot).
pub const PORT_PANIC: u16 = 0x0511;
/// `align` workload: the guest writes its vCPU id here (32-bit `out`); the VMM stamps
/// the exit with the run's host clock and stores it (u64) at [`result::ALIGN_HOST`] of
/// the vCPU's result slot before resuming it.
pub const PORT_ALIGN: u16 = 0x0513;
/// Port a pacing guest writes a number of microseconds to: the VMM puts the vCPU's
/// thread to sleep that long (at most [`SLEEP_MAX_US`]) instead of letting it spin
/// (at CPL3 there is no `hlt`). One exit (~30 µs here), so the guest asks only when its
/// next deadline is much further away.
pub const PORT_SLEEP: u16 = 0x0514;
/// MMIO doorbell (docs/abi.md, "Doorbell"): a guest whose VMM gives it a doorbell page
/// (its entry `rcx`, entry ABI version 2) instead of ports writes anything at this offset of the page to ask for its event
/// registration's answer (the MMIO form of `registry::PORT_REGISTER`).
pub const DOORBELL_REGISTER_OFF: u64 = 0;
/// MMIO doorbell: the guest writes its vCPU id (32 or 64 bits) at this offset of the
/// page when it has finished (the MMIO form of [`PORT_EXIT`]).
pub const DOORBELL_EXIT_OFF: u64 = 8;
/// MMIO doorbell: bytes of the doorbell page the VMM leaves unbacked (so writes exit).
pub const DOORBELL_SIZE: u64 = 4096;
/// Longest sleep one [`PORT_SLEEP`] write gets (a stop request is seen within it).
pub const SLEEP_MAX_US: u32 = 1000;
/// How far behind its `--rate` schedule a pacing guest workload may fall and still catch
/// up (writing its overdue events back to back). A vCPU held off its core for longer
/// resumes at the rate from where it stands: the run ends later instead of turning the
/// absence into a burst at the writer's full speed, which no reader could absorb and
/// which is not the rate asked for.
pub const PACE_MAX_LAG_US: u64 = 200;

/// Magic of the run parameter block: `"HTRUNPRM"` as little-endian bytes.
pub const RUN_PARAMS_MAGIC: u64 = u64::from_le_bytes(*b"HTRUNPRM");
/// Version of the run parameter block layout.
pub const RUN_PARAMS_VERSION: u32 = 1;
/// Size of the fixed part of the run parameter block; result slots follow it.
pub const RUN_PARAMS_SIZE: usize = 128;
/// Size of one vCPU result slot.
pub const VCPU_RESULT_SIZE: usize = 256;
/// Longest panic message stored in a result slot.
pub const PANIC_MSG_MAX: usize = VCPU_RESULT_SIZE - 64;

/// The run parameter block (`HTRUNPRM`, version 1, [`RUN_PARAMS_SIZE`] bytes), as the host
/// writes it and the guest reads it: each side copies the whole block at once (the host
/// before any vCPU runs, the guest once at entry), never field by field. Byte layout in
/// `docs/abi.md`; the compile-time checks below keep this struct at those offsets. Result
/// slots follow at [`RunParamBlock::results_off`].
///
/// ```
/// use hyptrace_abi::guest::{RunParamBlock, Workload, RUN_PARAMS_SIZE};
/// use zerocopy::{FromBytes, IntoBytes};
///
/// let block = RunParamBlock { events: 1000, ..RunParamBlock::new(Workload::Steady, 2) };
/// let bytes = block.as_bytes();
/// assert_eq!(bytes.len(), RUN_PARAMS_SIZE);
/// let back = RunParamBlock::read_from_bytes(bytes).unwrap();
/// assert!(back.header_ok());
/// assert_eq!((back.nr_vcpus, back.events), (2, 1000));
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct RunParamBlock {
    /// [`RUN_PARAMS_MAGIC`].
    pub magic: u64,
    /// [`RUN_PARAMS_VERSION`].
    pub version: u32,
    /// Size of the fixed part ([`RUN_PARAMS_SIZE`]).
    pub size: u32,
    /// Workload number ([`Workload`]; decode with [`Workload::from_u32`]).
    pub workload: u32,
    /// Number of vCPUs (and result slots).
    pub nr_vcpus: u32,
    /// Events each vCPU attempts.
    pub events: u64,
    /// Events per second per vCPU; 0 = as fast as possible.
    pub rate: u64,
    /// TSC frequency in kHz (for pacing; 0 = unknown).
    pub tsc_khz: u64,
    /// Seed of the workload's pseudo-random choices.
    pub seed: u64,
    /// `RUN_FLAG_*` ([`RUN_FLAG_SERVE_MAILBOX`]).
    pub flags: u32,
    /// Burst length (events per burst) for the `burst` workload.
    pub burst: u32,
    /// Offset (from the block) of the first result slot.
    pub results_off: u64,
    /// Payload size in bytes for the `bench` workload (0 is a valid size). Older hosts
    /// left it zero (it was reserved).
    pub payload: u32,
    /// Reserved, zero.
    pub reserved: [u32; 13],
}

impl RunParamBlock {
    /// A block with the header (magic, version, size), `workload`, `nr_vcpus` and the
    /// result slots right after the block; every other field zero.
    pub const fn new(workload: Workload, nr_vcpus: u32) -> Self {
        Self {
            magic: RUN_PARAMS_MAGIC,
            version: RUN_PARAMS_VERSION,
            size: RUN_PARAMS_SIZE as u32,
            workload: workload as u32,
            nr_vcpus,
            events: 0,
            rate: 0,
            tsc_khz: 0,
            seed: 0,
            flags: 0,
            burst: 0,
            results_off: RUN_PARAMS_SIZE as u64,
            payload: 0,
            reserved: [0; 13],
        }
    }

    /// The block's bytes, as they go into guest memory (for callers without zerocopy;
    /// [`IntoBytes::as_bytes`] gives the same bytes by reference).
    pub fn to_bytes(&self) -> [u8; RUN_PARAMS_SIZE] {
        zerocopy::transmute!(*self)
    }

    /// Whether magic, version and size are this crate's.
    pub const fn header_ok(&self) -> bool {
        self.magic == RUN_PARAMS_MAGIC
            && self.version == RUN_PARAMS_VERSION
            && self.size as usize == RUN_PARAMS_SIZE
    }
}

// The documented byte layout (docs/abi.md, "Run-parameter block"): these are the ABI, the
// struct must not move a field (a change here is a version bump, not an edit).
const _: () = {
    use core::mem::{align_of, offset_of, size_of};
    assert!(size_of::<RunParamBlock>() == RUN_PARAMS_SIZE);
    assert!(RUN_PARAMS_SIZE == 128);
    assert!(align_of::<RunParamBlock>() == 8);
    assert!(offset_of!(RunParamBlock, magic) == 0);
    assert!(offset_of!(RunParamBlock, version) == 8);
    assert!(offset_of!(RunParamBlock, size) == 12);
    assert!(offset_of!(RunParamBlock, workload) == 16);
    assert!(offset_of!(RunParamBlock, nr_vcpus) == 20);
    assert!(offset_of!(RunParamBlock, events) == 24);
    assert!(offset_of!(RunParamBlock, rate) == 32);
    assert!(offset_of!(RunParamBlock, tsc_khz) == 40);
    assert!(offset_of!(RunParamBlock, seed) == 48);
    assert!(offset_of!(RunParamBlock, flags) == 56);
    assert!(offset_of!(RunParamBlock, burst) == 60);
    assert!(offset_of!(RunParamBlock, results_off) == 64);
    assert!(offset_of!(RunParamBlock, payload) == 72);
    assert!(offset_of!(RunParamBlock, reserved) == 76);
};

/// Flag: the guest serves the host's swap/update requests from its mailbox.
pub const RUN_FLAG_SERVE_MAILBOX: u32 = 1 << 0;
/// Flag (`align` workload): after its exits, the guest answers the host's memory pings
/// (see [`result::PING_REQ`]) until the host writes [`PING_STOP`] (or
/// [`PING_IDLE_SECONDS`] pass without a new request).
pub const RUN_FLAG_ALIGN_PING: u32 = 1 << 1;
/// Flag (`bench` workload): write the payload with a length known at compile time, as
/// a typed event (`event!`) does, instead of a slice whose length the writer learns at
/// run time. Only for the sizes in [`BENCH_TYPED_SIZES`]; the guest panics on another.
pub const RUN_FLAG_BENCH_TYPED: u32 = 1 << 2;
/// Payload sizes the `bench` workload has a typed loop for ([`RUN_FLAG_BENCH_TYPED`]).
pub const BENCH_TYPED_SIZES: [u32; 8] = [0, 8, 16, 24, 32, 64, 128, 256];
/// [`result::PING_REQ`] value that ends the ping phase.
pub const PING_STOP: u64 = u64::MAX;
/// The ping phase ends after this long without a new request.
pub const PING_IDLE_SECONDS: u64 = 10;

/// Offsets of the fields of a vCPU result slot. The guest writes them one at a time
/// (`tsc_start` at entry, `status` last), so they stay offsets rather than a struct.
///
/// Bytes 0..16 are reserved: they held `attempted` and `skipped`, written once at the
/// end, until the writer published both live in its control block
/// ([`crate::layout::ctl::ATTEMPTED`], PACK_VERSION 5).
pub mod result {
    /// u64 TSC when the workload started.
    pub const TSC_START: usize = 16;
    /// u64 TSC when the workload ended.
    pub const TSC_END: usize = 24;
    /// u64 status: 0 running, 1 finished, 2 panicked.
    pub const STATUS: usize = 32;
    /// u64 requests served from the mailbox.
    pub const MAILBOX_SERVED: usize = 40;
    /// u64 `bench` workload: TSC cycles of the whole timed write loop.
    pub const BENCH_CYCLES: usize = 48;
    /// u64 `bench` workload: TSC cycles of the fastest chunk of
    /// [`super::BENCH_CHUNK`] events (the undisturbed rate: a chunk the host never
    /// preempted).
    pub const BENCH_MIN_CHUNK: usize = 56;
    /// u64 `align` workload: the host clock (the run's `--clock`) the VMM stamped at the
    /// last [`super::PORT_ALIGN`] exit (shares the `bench` workload's bytes).
    pub const ALIGN_HOST: usize = 48;
    /// Panic message bytes (up to [`super::PANIC_MSG_MAX`]).
    pub const MSG: usize = 64;
    /// u64 `align` ping phase (host → guest): request number (non-zero, new each time),
    /// or [`super::PING_STOP`]. Shares the panic message bytes.
    pub const PING_REQ: usize = 64;
    /// u64 `align` ping phase (guest → host): the guest TSC read when it saw request
    /// number [`PING_ACK`]'s value; written before the ack.
    pub const PING_TSC: usize = 72;
    /// u64 `align` ping phase (guest → host): the request number answered (a Release
    /// store after [`PING_TSC`]).
    pub const PING_ACK: usize = 80;
}

/// Events per timed chunk of the `bench` workload.
pub const BENCH_CHUNK: u64 = 1024;

/// Workloads the guest payload runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Workload {
    /// Fixed-size `marker` events at the configured rate.
    Steady = 0,
    /// Events of several types and sizes, including strings longer than 112 bytes.
    Mixed = 1,
    /// Bursts far above the drain rate, to exercise loss.
    Burst = 2,
    /// Writes some events, then panics (tests the panic path).
    Panic = 3,
    /// Writes some events, then faults (tests the triple-fault path).
    Fault = 4,
    /// `hyptrace bench`: writes `events` events of `payload` bytes back to back (no
    /// pacing) and reports the TSC cycles they took in its result slot.
    Bench = 5,
    /// Clock alignment: per pair of `marker` events, the guest stamps the TSC, exits on
    /// [`PORT_ALIGN`] (the VMM stamps its host clock), stamps the TSC again, then writes
    /// `marker(seq 2i, value i)` at the first stamp and `marker(seq 2i+1, value = the
    /// VMM's stamp)` at the second. `events / 2` exits.
    Align = 6,
}

impl Workload {
    /// Decodes a workload number.
    pub const fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Steady,
            1 => Self::Mixed,
            2 => Self::Burst,
            3 => Self::Panic,
            4 => Self::Fault,
            5 => Self::Bench,
            6 => Self::Align,
            _ => return None,
        })
    }
}

/// The workloads' pseudo-random generator (xorshift64*), seeded from the run's seed and
/// the vCPU id: shared by the guest payload and by tests that replay what it wrote.
#[derive(Clone, Debug)]
pub struct WorkloadRng(u64);

impl WorkloadRng {
    /// The generator of vCPU `cpu` for `seed`.
    pub const fn new(seed: u64, cpu: u32) -> Self {
        let s = seed ^ (cpu as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        Self(if s == 0 { 0x2545_f491_4f6c_dd1d } else { s })
    }

    /// The next value.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The struct's bytes are the documented version-1 block (docs/abi.md): what the
    /// host wrote field by field at these offsets before the struct existed.
    #[test]
    fn run_param_block_bytes_are_the_documented_layout() {
        let b = RunParamBlock {
            events: 0x1122_3344_5566_7788,
            rate: 2,
            tsc_khz: 3,
            seed: 4,
            flags: RUN_FLAG_SERVE_MAILBOX,
            burst: 6,
            payload: 7,
            ..RunParamBlock::new(Workload::Bench, 9)
        };
        let bytes = b.to_bytes();
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
        assert_eq!(&bytes[..8], b"HTRUNPRM");
        assert_eq!((u32_at(8), u32_at(12)), (1, 128));
        assert_eq!((u32_at(16), u32_at(20)), (5, 9));
        assert_eq!(u64_at(24), 0x1122_3344_5566_7788);
        assert_eq!((u64_at(32), u64_at(40), u64_at(48)), (2, 3, 4));
        assert_eq!((u32_at(56), u32_at(60)), (1, 6));
        assert_eq!((u64_at(64), u32_at(72)), (128, 7));
        assert!(bytes[76..].iter().all(|&x| x == 0));
        assert!(RunParamBlock::read_from_bytes(&bytes[..])
            .unwrap()
            .header_ok());
        let mut bad = bytes;
        bad[8] = 2;
        assert!(!RunParamBlock::read_from_bytes(&bad[..])
            .unwrap()
            .header_ok());
    }
}
