//! The runtime the guest images share — the payload the VMM embeds (guest/src), the C
//! SDK's `libhyptrace.a` (guest/c-sdk) and Rust guests of users (guest/template, a crate
//! to copy out): the entry stub ([`entry!`]), the C memory functions ([`mem`]), the TSC,
//! port I/O, the doorbell ([`Doorbell`]: port or MMIO, as the VMM says at entry), the end
//! of a vCPU's run ([`exit`], [`exit_by`]) and the report of a panic to the VMM. One copy,
//! linked by all.
//!
//! A guest runs at CPL3 with IOPL=3 (so `in`/`out` work, `hlt` does not), with no
//! interrupts and no IDT, and its GS base at its vCPU's result slot (the VMM's contract,
//! `hyptrace_abi::guest`).
#![no_std]

use core::arch::asm;
use core::fmt::{self, Write};
use core::panic::{Location, PanicInfo};

use hyptrace_abi::guest::{
    result, DOORBELL_EXIT_OFF, DOORBELL_REGISTER_OFF, PANIC_MSG_MAX, PORT_EXIT, PORT_PANIC,
};
use hyptrace_abi::registry::PORT_REGISTER;

pub mod mem;

/// Defines the image's entry point `_start` (put first by the linker script, section
/// `.text.entry`): aligns the stack and calls `$main(pack_gpa, vcpu, params_gpa,
/// doorbell)`, an `extern "C" fn(u64, u64, u64, u64) -> !` — the VMM's entry registers
/// `rdi`, `rsi`, `rdx`, `rcx` (docs/abi.md, "Entry"; `rcx` since entry ABI version 2:
/// [`Doorbell::from_entry`]). A `main` of three arguments ignores `rcx` and must ring by
/// port.
///
/// ```ignore
/// hyptrace_guest_rt::entry!(guest_main);
/// #[no_mangle]
/// pub extern "C" fn guest_main(pack: u64, cpu: u64, params: u64, bell: u64) -> ! {
///     let bell = hyptrace_guest_rt::Doorbell::from_entry(bell);
///     ...
/// }
/// ```
#[macro_export]
macro_rules! entry {
    ($main:path) => {
        ::core::arch::global_asm!(
            ".section .text.entry,\"ax\",@progbits",
            ".global _start",
            "_start:",
            "    and rsp, -16",
            "    xor ebp, ebp",
            "    call {main}",
            "2:  pause",
            "    jmp 2b",
            main = sym $main,
        );
    };
}

/// Reads the time-stamp counter.
#[inline(always)]
pub fn rdtsc() -> u64 {
    let lo: u32;
    let hi: u32;
    // SAFETY: `rdtsc` only reads the TSC into edx:eax (CR4.TSD is clear, so it is
    // allowed at CPL3); no memory is touched.
    unsafe {
        asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Writes a 32-bit value to an I/O port (an exit to the VMM).
#[inline(always)]
pub fn out32(port: u16, value: u32) {
    // SAFETY: port I/O is allowed at CPL3 with IOPL=3; the VMM handles the exit. No
    // guest memory is touched.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") value, options(nomem, nostack, preserves_flags))
    };
}

/// Writes a 32-bit value to an I/O port, as [`out32`], and is a compiler barrier too:
/// memory accesses stay on their side of it (for a port whose exit the VMM answers in
/// memory, e.g. the registration port).
#[inline(always)]
pub fn notify(port: u16, value: u32) {
    // SAFETY: port I/O is allowed at CPL3 with IOPL=3; the VMM handles the exit. Without
    // `nomem` the compiler keeps memory accesses on their side of it.
    unsafe {
        asm!("out dx, eax", in("dx") port, in("eax") value, options(nostack, preserves_flags))
    };
}

/// Where this guest rings its VMM (docs/abi.md, "Doorbell"): the registration bell and
/// the exit bell, by port or by a store to the MMIO doorbell page, as the VMM said in the
/// entry's `rcx`. The other exits (panic, sleep, align) are port writes either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Doorbell {
    /// Port I/O: `PORT_REGISTER`, `PORT_EXIT` (entry `rcx` = 0, every VMM before entry
    /// ABI version 2).
    Port,
    /// The MMIO doorbell page at this guest-physical (= virtual) address.
    Mmio(u64),
}

impl Doorbell {
    /// The doorbell the VMM handed over in the entry's `rcx` (0: ports).
    pub fn from_entry(rcx: u64) -> Self {
        match rcx {
            0 => Self::Port,
            page => Self::Mmio(page),
        }
    }

    /// Rings the registration bell (the registration table is READY): the VMM answers
    /// before the vCPU resumes. A compiler barrier: memory accesses stay on their side.
    #[inline(always)]
    pub fn register(self) {
        match self {
            Self::Port => notify(PORT_REGISTER, 0),
            Self::Mmio(page) => mmio_store(page.wrapping_add(DOORBELL_REGISTER_OFF), 0),
        }
    }

    /// Rings the exit bell with this vCPU's id (the VMM does not resume the vCPU).
    #[inline(always)]
    pub fn exit(self, cpu: u32) {
        match self {
            Self::Port => notify(PORT_EXIT, cpu),
            Self::Mmio(page) => mmio_store(page.wrapping_add(DOORBELL_EXIT_OFF), cpu),
        }
    }
}

/// A 32-bit store to the MMIO doorbell page (an exit to the VMM), a compiler barrier.
/// One plain `mov`, which every hypervisor's instruction decoder knows.
#[inline(always)]
pub fn mmio_store(addr: u64, value: u32) {
    // SAFETY: `addr` is in the doorbell page the VMM handed over at entry: mapped by its
    // page tables, backed by no memory, so the store exits to the VMM and touches no
    // memory of this program. Without `nomem` the compiler keeps memory accesses on
    // their side of it.
    unsafe {
        asm!("mov dword ptr [{a}], {v:e}", a = in(reg) addr, v = in(reg) value, options(nostack, preserves_flags))
    };
}

/// Stamps this vCPU's start (the TSC, into its result slot's `tsc_start`): the VMM
/// reports when each vCPU ran its first instruction and how long it took from there.
/// Call it first thing at entry.
#[inline(always)]
pub fn mark_start() {
    gs_store_u64(result::TSC_START, rdtsc());
}

/// Ends this vCPU's run as the VMM expects (docs/abi.md): the end TSC and status 1
/// (finished) into its result slot, then its vCPU id to the exit port. Call
/// `Writer::finish` first. Never returns (the VMM does not resume the vCPU).
pub fn exit(cpu: u32) -> ! {
    exit_by(Doorbell::Port, cpu)
}

/// [`exit`] through `bell` (the entry's [`Doorbell::from_entry`]).
pub fn exit_by(bell: Doorbell, cpu: u32) -> ! {
    gs_store_u64(result::TSC_END, rdtsc());
    gs_store_u64(result::STATUS, 1);
    bell.exit(cpu);
    loop {
        core::hint::spin_loop();
    }
}

/// Stores a byte at `gs:[off]`. The VMM sets every vCPU's GS base to the GPA of its
/// result slot, so a panic can reach the slot without any other context.
#[inline(always)]
fn gs_store_u8(off: usize, value: u8) {
    // SAFETY: GS base is this vCPU's result slot (VMM contract) and callers keep `off`
    // inside the slot; the slot is guest memory owned by this vCPU.
    unsafe {
        asm!("mov byte ptr gs:[{off}], {v}", off = in(reg) off, v = in(reg_byte) value, options(nostack, preserves_flags))
    };
}

/// Stores a u64 at `gs:[off]` (see [`gs_store_u8`]).
#[inline(always)]
fn gs_store_u64(off: usize, value: u64) {
    // SAFETY: as in `gs_store_u8`: `off + 8` stays inside this vCPU's result slot.
    unsafe {
        asm!("mov qword ptr gs:[{off}], {v}", off = in(reg) off, v = in(reg) value, options(nostack, preserves_flags))
    };
}

/// Writes the panic message into the result slot, truncated to [`PANIC_MSG_MAX`].
struct SlotMsg {
    len: usize,
}

impl Write for SlotMsg {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for &b in s.as_bytes() {
            if self.len == PANIC_MSG_MAX {
                break;
            }
            gs_store_u8(result::MSG + self.len, b);
            self.len += 1;
        }
        Ok(())
    }
}

/// Reports a panic to the VMM and stops this vCPU ([`report`] with the panic's message
/// and where it happened). What a guest image's `#[panic_handler]` calls.
pub fn report_panic(info: &PanicInfo<'_>) -> ! {
    report(format_args!("{}", info.message()), info.location())
}

/// Reports `msg` (and `at`, if given) to the VMM as this vCPU's panic and stops the vCPU:
/// the message into the result slot (truncated to [`PANIC_MSG_MAX`]), status 2
/// (panicked), then the panic port's exit with the message's length. The VMM stops the
/// vCPU there (the run ends with exit code 3); it is never resumed.
pub fn report(msg: fmt::Arguments<'_>, at: Option<&Location<'_>>) -> ! {
    let mut slot = SlotMsg { len: 0 };
    let _ = slot.write_fmt(msg);
    if let Some(loc) = at {
        let _ = write!(slot, " ({}:{})", loc.file(), loc.line());
    }
    gs_store_u64(result::STATUS, 2);
    out32(PORT_PANIC, slot.len as u32);
    loop {
        core::hint::spin_loop();
    }
}
