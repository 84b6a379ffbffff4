//! The contract between the VMM and the guest payload: entry registers, the run
//! parameter block, per-vCPU result slots and the I/O ports.
//!
//! Entry (every vCPU): `rdi` = guest-physical address of the trace pack (the start of
//! the trace region, see [`crate::pack`]), `rsi` = vCPU id, `rdx` = guest-physical
//! address of the [`RunParams`] block, `rsp` = top of this vCPU's stack, GS base = the
//! address of this vCPU's result slot. Guest memory is identity-mapped, so these addresses
//! are also the guest's virtual addresses.
//!
//! Exit: the guest fills its [`VcpuResult`] slot, then writes its vCPU id to
//! [`PORT_EXIT`] (32-bit `out`). A panic writes the message into the slot's `msg` bytes
//! and its length to [`PORT_PANIC`]. Any CPU exception triple-faults (the IDT is empty),
//! which the VMM sees as `KVM_EXIT_SHUTDOWN`.
//!
//! All fields are little-endian; every block starts with a magic, a version and a size.

/// Port the guest writes its vCPU id to when it has finished (after filling its result slot).
pub const PORT_EXIT: u16 = 0x0510;
/// Port the guest writes a panic message length to (message in its result slot).
pub const PORT_PANIC: u16 = 0x0511;

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

/// Offsets of the fields of the run parameter block.
pub mod params {
    /// u64 magic ([`super::RUN_PARAMS_MAGIC`]).
    pub const MAGIC: usize = 0;
    /// u32 version.
    pub const VERSION: usize = 8;
    /// u32 size of the fixed part ([`super::RUN_PARAMS_SIZE`]).
    pub const SIZE: usize = 12;
    /// u32 workload ([`super::Workload`]).
    pub const WORKLOAD: usize = 16;
    /// u32 number of vCPUs (and result slots).
    pub const NR_VCPUS: usize = 20;
    /// u64 events each vCPU attempts.
    pub const EVENTS: usize = 24;
    /// u64 events per second per vCPU; 0 = as fast as possible.
    pub const RATE: usize = 32;
    /// u64 TSC frequency in kHz (for pacing).
    pub const TSC_KHZ: usize = 40;
    /// u64 seed of the workload's pseudo-random choices.
    pub const SEED: usize = 48;
    /// u32 flags ([`super::RUN_FLAG_SERVE_MAILBOX`]).
    pub const FLAGS: usize = 56;
    /// u32 burst length (events per burst) for the `burst` workload.
    pub const BURST: usize = 60;
    /// u64 offset (from the block) of the first result slot.
    pub const RESULTS_OFF: usize = 64;
    /// u32 payload size in bytes for the `bench` workload (0 is a valid size). Older
    /// hosts leave it zero (the block's bytes 72..128 are reserved, zero).
    pub const PAYLOAD: usize = 72;
}

/// Flag: the guest serves the host's swap/update requests from its mailbox.
pub const RUN_FLAG_SERVE_MAILBOX: u32 = 1 << 0;

/// Offsets of the fields of a vCPU result slot (written by the guest).
pub mod result {
    /// u64 events the workload attempted (enabled or not).
    pub const ATTEMPTED: usize = 0;
    /// u64 events not written because they were disabled.
    pub const SKIPPED: usize = 8;
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
    /// Panic message bytes (up to [`super::PANIC_MSG_MAX`]).
    pub const MSG: usize = 64;
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
