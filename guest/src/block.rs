//! Guest-physical memory the VMM placed for this guest (the run-parameter block, the
//! result slots, the pack), read and written with volatile accesses. Shared by the
//! guest payload and the adversarial test guest (`src/bin/adversary.rs`).

use hyptrace_abi::guest::RunParamBlock;

/// A guest-physical (= virtual, identity-mapped) block read and written with volatile
/// accesses at byte offsets.
#[derive(Clone, Copy)]
pub struct Block(pub u64);

impl Block {
    /// The run parameter block at this address, copied at once.
    pub fn read_params(self) -> RunParamBlock {
        // SAFETY: the VMM placed the block in mapped guest memory at a 2 MiB-aligned
        // address (contract; more than the struct's 8) and wrote it before any vCPU ran;
        // `RunParamBlock` is plain integers, valid for any bytes.
        unsafe { (self.0 as usize as *const RunParamBlock).read_volatile() }
    }

    /// The u64 at `off`.
    pub fn read_u64(self, off: usize) -> u64 {
        // SAFETY: the VMM placed this block in mapped guest memory (contract); offsets
        // are the ABI's, inside the block, and naturally aligned.
        unsafe { ((self.0 as usize + off) as *const u64).read_volatile() }
    }

    /// Stores `v` at `off`.
    pub fn write_u64(self, off: usize, v: u64) {
        // SAFETY: as in `read_u64`; this vCPU is the only writer of its result slot.
        unsafe { ((self.0 as usize + off) as *mut u64).write_volatile(v) }
    }

    /// Stores the byte `v` at `off` (the adversary's panic message).
    #[allow(dead_code)]
    pub fn write_u8(self, off: usize, v: u8) {
        // SAFETY: as in `write_u64`.
        unsafe { ((self.0 as usize + off) as *mut u8).write_volatile(v) }
    }
}
