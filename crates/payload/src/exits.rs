//! What the stock guest asks of its VMM: the port writes it makes (ports in
//! `hyptrace_abi::guest` and `hyptrace_abi::registry`) and the result slot it fills.
//!
//! | port | data (32-bit `out`) | the VMM |
//! |---|---|---|
//! | `PORT_REGISTER` | — | answers the event registration before resuming the vCPU (`hyptrace_embed::Events::on_register`; the port doorbell: `hyptrace_embed::PortDoorbell`) |
//! | `PORT_SLEEP` | µs | sleeps that long (at most `SLEEP_MAX_US`), then resumes |
//! | `PORT_ALIGN` | vCPU id | (`align` workload only) stores its clock at `result::ALIGN_HOST`, resumes |
//! | `PORT_EXIT` | vCPU id | the vCPU finished: [`read_stats`] |
//! | `PORT_PANIC` | message length | the guest panicked: [`read_panic`] |
//!
//! Anything else (another port, a port read, MMIO, `hlt`, a shutdown) is a guest fault.
//! Guest values (the vCPU id, the length, the slot's bytes) are untrusted: bounded here.

use std::time::Duration;

use hyptrace_abi::guest::{
    result, PANIC_MSG_MAX, PORT_ALIGN, PORT_EXIT, PORT_PANIC, PORT_SLEEP, SLEEP_MAX_US,
};
use hyptrace_abi::registry::PORT_REGISTER;
use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

/// One port write of the guest, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// The vCPU finished (it says it is vCPU `0`); its counters are in its result slot.
    Exit(u32),
    /// The guest panicked; the message (this many bytes, unchecked) is in its result slot.
    Panic(u32),
    /// Answer the event registration.
    Register,
    /// Sleep this long (already bounded by `SLEEP_MAX_US`).
    Sleep(Duration),
    /// `align` workload: stamp the host clock.
    Align,
}

/// The low 32 bits of a port write's data (shorter writes zero-extended).
fn le_u32(data: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    let n = data.len().min(4);
    b[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(b)
}

/// Decodes a guest `out` to `port` with `data`; `None` for a port the stock guest never
/// writes (a fault).
///
/// ```
/// use hyptrace_abi::guest::PORT_EXIT;
/// use hyptrace_payload::exits::{decode_out, Request};
/// assert_eq!(decode_out(PORT_EXIT, &1u32.to_le_bytes()), Some(Request::Exit(1)));
/// assert_eq!(decode_out(0x80, &[0]), None);
/// ```
pub fn decode_out(port: u16, data: &[u8]) -> Option<Request> {
    Some(match port {
        PORT_EXIT => Request::Exit(le_u32(data)),
        PORT_PANIC => Request::Panic(le_u32(data)),
        PORT_REGISTER => Request::Register,
        PORT_SLEEP => Request::Sleep(Duration::from_micros(u64::from(
            le_u32(data).min(SLEEP_MAX_US),
        ))),
        PORT_ALIGN => Request::Align,
        _ => return None,
    })
}

/// Counters a finished vCPU reported in its result slot (as the guest wrote them:
/// statistics, not trusted for anything).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VcpuStats {
    /// Guest TSC when the workload started (right after entry).
    pub tsc_start: u64,
    /// Guest TSC when it ended.
    pub tsc_end: u64,
    /// Mailbox requests the guest served.
    pub mailbox_served: u64,
}

/// Reads the counters of the result slot at `slot` (an unreadable word reads 0).
pub fn read_stats<M>(mem: &M, slot: u64) -> VcpuStats
where
    M: Bytes<GuestAddress, E = GuestMemoryError> + ?Sized,
{
    let at = |off: usize| {
        slot.checked_add(off as u64)
            .and_then(|a| mem.read_obj::<u64>(GuestAddress(a)).ok())
            .unwrap_or(0)
    };
    VcpuStats {
        tsc_start: at(result::TSC_START),
        tsc_end: at(result::TSC_END),
        mailbox_served: at(result::MAILBOX_SERVED),
    }
}

/// The panic message of the result slot at `slot`: `len` bytes (at most
/// `PANIC_MSG_MAX`), invalid UTF-8 replaced. Escape it before printing it to a terminal.
pub fn read_panic<M>(mem: &M, slot: u64, len: u32) -> String
where
    M: Bytes<GuestAddress, E = GuestMemoryError> + ?Sized,
{
    let len = (len as usize).min(PANIC_MSG_MAX);
    let mut buf = vec![0u8; len];
    match slot.checked_add(result::MSG as u64) {
        Some(a) if mem.read_slice(&mut buf, GuestAddress(a)).is_ok() => {
            String::from_utf8_lossy(&buf).into_owned()
        }
        _ => String::from("<unreadable panic message>"),
    }
}
