//! The guest's doorbell: how it tells the VMM to answer its event registration and that
//! a vCPU finished. The VMM traps a guest write (a port `out`, or a write to an unbacked
//! guest-physical page) and asks its [`Doorbell`] what the write rang; it then calls
//! [`crate::Events::on_register`] (before resuming the vCPU) or ends the vCPU. Port I/O
//! ([`PortDoorbell`], the stock guest's, x86 only) and MMIO ([`MmioDoorbell`], any
//! architecture) ring the same two bells (docs/abi.md, "Doorbell"). Guest data is
//! hostile: decoding is bounded and never fails, a write that rings nothing is `None`.

use hyptrace_abi::guest::{DOORBELL_EXIT_OFF, DOORBELL_REGISTER_OFF, DOORBELL_SIZE, PORT_EXIT};
use hyptrace_abi::registry::PORT_REGISTER;

/// A guest write the VMM trapped, as its hypervisor reports it (for KVM:
/// `VcpuExit::IoOut(port, data)` and `VcpuExit::MmioWrite(addr, data)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// # Examples
///
/// ```
/// use hyptrace_embed::Access;
/// // From KVM: VcpuExit::IoOut(port, data) / VcpuExit::MmioWrite(addr, data).
/// let (port, data) = (0x512u16, [0u8; 4]);
/// let access = Access::Pio { port, data: &data };
/// assert!(matches!(access, Access::Pio { port: 0x512, .. }));
/// ```
pub enum Access<'a> {
    /// A port write (`out`) of `data` to `port`.
    Pio {
        /// The port.
        port: u16,
        /// The bytes written (1, 2 or 4).
        data: &'a [u8],
    },
    /// A write of `data` to guest-physical address `addr` that no memory backs.
    Mmio {
        /// The guest-physical address.
        addr: u64,
        /// The bytes written (1 to 8).
        data: &'a [u8],
    },
}

/// What a doorbell write asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// # Examples
///
/// ```
/// use hyptrace_embed::{Access, Doorbell, PortDoorbell, Ring};
/// match PortDoorbell::default().ring(Access::Pio { port: 0x512, data: &[0; 4] }) {
///     Some(Ring::Register) => { /* events.on_register(vcpu_id), then resume */ }
///     Some(Ring::Exit { vcpu }) => { /* end the vCPU (check `vcpu` is the one that exited) */ let _ = vcpu; }
///     None => { /* not a doorbell write: the VMM's own device, or a guest fault */ }
/// }
/// ```
pub enum Ring {
    /// Answer the event registration ([`crate::Events::on_register`]) before resuming.
    Register,
    /// The vCPU finished; it says it is `vcpu` (untrusted: a VMM compares it with the
    /// vCPU that exited; `u32::MAX` for a value past 32 bits).
    Exit {
        /// The vCPU id the guest wrote.
        vcpu: u32,
    },
}

/// Where a guest rings its VMM: maps a trapped write to what it rang.
///
/// # Examples
///
/// ```
/// use hyptrace_embed::{Access, Doorbell, MmioDoorbell, PortDoorbell, Ring};
/// let pio = PortDoorbell::default();
/// assert_eq!(pio.ring(Access::Pio { port: 0x512, data: &[0; 4] }), Some(Ring::Register));
/// let mmio = MmioDoorbell::new(0xfe00_0000);
/// let exit = Access::Mmio { addr: 0xfe00_0008, data: &1u32.to_le_bytes() };
/// assert_eq!(mmio.ring(exit), Some(Ring::Exit { vcpu: 1 }));
/// assert_eq!(mmio.ring(Access::Pio { port: 0x512, data: &[0] }), None);
/// ```
pub trait Doorbell: Send + Sync {
    /// What `access` rang, or `None` when it is not a write to this doorbell (the VMM
    /// handles it otherwise, or calls it a guest fault).
    fn ring(&self, access: Access<'_>) -> Option<Ring>;
}

/// The vCPU id of an exit write: the little-endian value of up to 8 bytes, `u32::MAX`
/// when it does not fit (no vCPU has that id).
fn vcpu_id(data: &[u8]) -> u32 {
    let mut b = [0u8; 8];
    let n = data.len().min(8);
    b[..n].copy_from_slice(&data[..n]);
    u32::try_from(u64::from_le_bytes(b)).unwrap_or(u32::MAX)
}

/// The port-I/O doorbell (x86 `out`): the stock guest's, at `PORT_REGISTER` and
/// `PORT_EXIT` by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// # Examples
///
/// ```
/// use hyptrace_embed::{Access, Doorbell, PortDoorbell, Ring};
/// let own = PortDoorbell { register: 0x600, exit: 0x601 }; // a guest told other ports
/// let exit = Access::Pio { port: 0x601, data: &2u32.to_le_bytes() };
/// assert_eq!(own.ring(exit), Some(Ring::Exit { vcpu: 2 }));
/// ```
pub struct PortDoorbell {
    /// The port of the registration bell.
    pub register: u16,
    /// The port of the exit bell.
    pub exit: u16,
}

impl Default for PortDoorbell {
    fn default() -> Self {
        Self {
            register: PORT_REGISTER,
            exit: PORT_EXIT,
        }
    }
}

impl Doorbell for PortDoorbell {
    fn ring(&self, access: Access<'_>) -> Option<Ring> {
        match access {
            Access::Pio { port, .. } if port == self.register => Some(Ring::Register),
            Access::Pio { port, data } if port == self.exit => Some(Ring::Exit {
                vcpu: vcpu_id(data),
            }),
            _ => None,
        }
    }
}

/// The MMIO doorbell: a guest-physical page the VMM leaves unbacked (`DOORBELL_SIZE`
/// bytes at `base`), the registration bell at `DOORBELL_REGISTER_OFF`, the exit bell at
/// `DOORBELL_EXIT_OFF`; other offsets ring nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmioDoorbell {
    base: u64,
}

impl MmioDoorbell {
    /// The doorbell page at guest-physical `base`.
    /// # Examples
    ///
    /// ```
    /// use hyptrace_embed::{Access, Doorbell, MmioDoorbell, Ring};
    /// use hyptrace_abi::guest::DOORBELL_REGISTER_OFF;
    /// let bell = MmioDoorbell::new(0xfe00_0000); // leave this page unbacked
    /// let access = Access::Mmio { addr: 0xfe00_0000 + DOORBELL_REGISTER_OFF, data: &[1] };
    /// assert_eq!(bell.ring(access), Some(Ring::Register));
    /// ```
    pub fn new(base: u64) -> Self {
        Self { base }
    }

    /// Its guest-physical address (what the guest is told: docs/abi.md, "Doorbell").
    /// # Examples
    ///
    /// ```
    /// let bell = hyptrace_embed::MmioDoorbell::new(0xfe00_0000);
    /// assert_eq!(bell.base(), 0xfe00_0000); // tell the guest (docs/abi.md, "Doorbell")
    /// ```
    pub fn base(&self) -> u64 {
        self.base
    }
}

impl Doorbell for MmioDoorbell {
    fn ring(&self, access: Access<'_>) -> Option<Ring> {
        let Access::Mmio { addr, data } = access else {
            return None;
        };
        match addr.checked_sub(self.base).filter(|&o| o < DOORBELL_SIZE)? {
            DOORBELL_REGISTER_OFF => Some(Ring::Register),
            DOORBELL_EXIT_OFF => Some(Ring::Exit {
                vcpu: vcpu_id(data),
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both doorbells ring the same bells; anything else, hostile values included,
    /// rings nothing or a vCPU id no vCPU has.
    #[test]
    fn port_and_mmio_ring_the_same_bells() {
        let (pio, mmio) = (PortDoorbell::default(), MmioDoorbell::new(0x1000));
        let reg = [
            pio.ring(Access::Pio {
                port: PORT_REGISTER,
                data: &[7],
            }),
            mmio.ring(Access::Mmio {
                addr: 0x1000,
                data: &[7; 8],
            }),
        ];
        assert_eq!(reg, [Some(Ring::Register); 2]);
        let two = 2u32.to_le_bytes();
        let exit = [
            pio.ring(Access::Pio {
                port: PORT_EXIT,
                data: &two,
            }),
            mmio.ring(Access::Mmio {
                addr: 0x1008,
                data: &2u64.to_le_bytes(),
            }),
        ];
        assert_eq!(exit, [Some(Ring::Exit { vcpu: 2 }); 2]);
        let big = mmio.ring(Access::Mmio {
            addr: 0x1008,
            data: &u64::MAX.to_le_bytes(),
        });
        assert_eq!(big, Some(Ring::Exit { vcpu: u32::MAX }));
        assert_eq!(
            mmio.ring(Access::Mmio {
                addr: 0x1010,
                data: &two
            }),
            None
        );
        assert_eq!(
            mmio.ring(Access::Mmio {
                addr: 0x0fff,
                data: &two
            }),
            None
        );
        assert_eq!(
            mmio.ring(Access::Mmio {
                addr: 0x2000,
                data: &two
            }),
            None
        );
        assert_eq!(
            MmioDoorbell::new(u64::MAX).ring(Access::Mmio { addr: 0, data: &[] }),
            None
        );
        assert_eq!(
            pio.ring(Access::Pio {
                port: 0x511,
                data: &two
            }),
            None
        );
        assert_eq!(
            pio.ring(Access::Mmio {
                addr: 0x512,
                data: &two
            }),
            None
        );
        assert_eq!(
            mmio.ring(Access::Pio {
                port: PORT_REGISTER,
                data: &two
            }),
            None
        );
    }
}
