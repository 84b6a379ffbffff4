//! The CPUID table a hyptrace guest's vCPU gets: what its environment provides, built from
//! five leaves of the host's own `cpuid` instead of the hypervisor's whole supported
//! table (on KVM, `KVM_GET_SUPPORTED_CPUID` asks the host CPU for some 60 leaves; under a
//! nested hypervisor each is an exit, ~0.45 ms of a ~2.5 ms start-up, measured in
//! docs/benchmarks.md).
//!
//! The guest runs in long mode with `CR4.OSFXSR` and without `CR4.OSXSAVE`
//! ([`crate::boot::vcpu_boot`]): SSE to SSE4.2 work, AVX and anything needing XSAVE
//! state do not. The table says exactly that — the host's vendor, family and model, its
//! SSE-family and other user-mode features masked to those the environment lets run,
//! long mode, `rdtscp` where the host has it, the hypervisor bit, the host's address sizes — so a guest that does ask
//! `cpuid` learns what it can use, and a hypervisor that checks the guest's state
//! against its CPUID (KVM refuses `EFER.LME` without the LM bit) accepts it.

/// One leaf of the guest's CPUID table (sub-leaf 0; no leaf here has sub-leaves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaf {
    /// The leaf (`eax` on input).
    pub function: u32,
    /// Output registers.
    pub eax: u32,
    /// Output registers.
    pub ebx: u32,
    /// Output registers.
    pub ecx: u32,
    /// Output registers.
    pub edx: u32,
}

/// Leaf 1 EDX: FPU, PSE, TSC, PAE, CX8, CMOV, CLFSH, MMX, FXSR, SSE, SSE2.
const LEAF1_EDX: u32 = 1
    | 1 << 3
    | 1 << 4
    | 1 << 6
    | 1 << 8
    | 1 << 15
    | 1 << 19
    | 1 << 23
    | 1 << 24
    | 1 << 25
    | 1 << 26;
/// Leaf 1 ECX: SSE3, PCLMULQDQ, SSSE3, CX16, SSE4.1, SSE4.2, MOVBE, POPCNT, AES, RDRAND
/// (not XSAVE, OSXSAVE, AVX, F16C or FMA: they need `CR4.OSXSAVE`).
const LEAF1_ECX: u32 =
    1 | 1 << 1 | 1 << 9 | 1 << 13 | 1 << 19 | 1 << 20 | 1 << 22 | 1 << 23 | 1 << 25 | 1 << 30;
/// Leaf 1 ECX bit 31: running under a hypervisor.
const HYPERVISOR: u32 = 1 << 31;
/// Leaf 0x8000_0001 EDX: long mode (KVM checks it against `EFER.LME`).
const EXT1_EDX_LM: u32 = 1 << 29;
/// Leaf 0x8000_0001 EDX: `rdtscp` (a user-mode instruction KVM enables by this bit).
const EXT1_EDX_RDTSCP: u32 = 1 << 27;
/// Leaf 0x8000_0001 ECX: LAHF/SAHF in long mode, LZCNT, PREFETCHW.
const EXT1_ECX: u32 = 1 | 1 << 5 | 1 << 8;

/// The host CPU's `cpuid` leaf `function`, sub-leaf 0, as `[eax, ebx, ecx, edx]`.
pub fn host_cpuid(function: u32) -> [u32; 4] {
    let r = core::arch::x86_64::__cpuid(function);
    [r.eax, r.ebx, r.ecx, r.edx]
}

/// The CPUID table of vCPU `vcpu` (its initial APIC id), from `host` (a host leaf as
/// `[eax, ebx, ecx, edx]`: [`host_cpuid`], or fixed values in a test).
///
/// # Examples
///
/// ```
/// use hyptrace_payload::cpuid::{guest_cpuid, host_cpuid};
/// let table = guest_cpuid(1, host_cpuid);
/// let ext1 = table.iter().find(|l| l.function == 0x8000_0001).unwrap();
/// assert_ne!(ext1.edx & 1 << 29, 0); // long mode
/// let leaf1 = table.iter().find(|l| l.function == 1).unwrap();
/// assert_eq!(leaf1.ebx >> 24, 1); // its APIC id
/// assert_eq!(leaf1.ecx & 1 << 28, 0); // no AVX: the guest has no XSAVE state
/// ```
pub fn guest_cpuid(vcpu: u32, host: impl Fn(u32) -> [u32; 4]) -> [Leaf; 5] {
    let [_, vb, vc, vd] = host(0);
    let [sig, misc, c1, d1] = host(1);
    let [max_ext, ..] = host(0x8000_0000);
    let [_, _, ec1, ed1] = host(0x8000_0001);
    // Address sizes: the host's where it reports them, else the architecture's default.
    let sizes = if max_ext >= 0x8000_0008 {
        host(0x8000_0008)[0] & 0xffff
    } else {
        0x3024 // 36-bit physical, 48-bit virtual
    };
    // EBX: brand index 0, the host's CLFLUSH line size, one logical processor, the APIC id.
    let ebx = (misc & 0xff00) | 1 << 16 | (vcpu & 0xff) << 24;
    let leaf = |function, eax, ebx, ecx, edx| Leaf {
        function,
        eax,
        ebx,
        ecx,
        edx,
    };
    [
        leaf(0, 1, vb, vc, vd),
        leaf(1, sig, ebx, (c1 & LEAF1_ECX) | HYPERVISOR, d1 & LEAF1_EDX),
        leaf(0x8000_0000, 0x8000_0008, vb, vc, vd),
        leaf(
            0x8000_0001,
            0,
            0,
            ec1 & EXT1_ECX,
            EXT1_EDX_LM | (ed1 & EXT1_EDX_RDTSCP),
        ),
        leaf(0x8000_0008, sizes, 0, 0, 0),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host with every feature bit set and an old extended range.
    fn all_set(function: u32) -> [u32; 4] {
        match function {
            0x8000_0000 => [0x8000_0004, 0, 0, 0],
            _ => [u32::MAX; 4],
        }
    }

    #[test]
    fn only_what_the_environment_runs_is_advertised() {
        let t = guest_cpuid(3, all_set);
        let l1 = t[1];
        assert_eq!(
            l1.ecx & (1 << 26 | 1 << 27 | 1 << 28 | 1 << 29 | 1 << 12),
            0
        );
        assert_eq!(l1.ecx & LEAF1_ECX, LEAF1_ECX);
        assert_eq!(l1.edx, LEAF1_EDX);
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!(t[0].eax, 1);
        assert_eq!(
            t[4].eax, 0x3024,
            "no 0x8000_0008 on the host: the default sizes"
        );
        assert_eq!(t[3].edx, EXT1_EDX_LM | EXT1_EDX_RDTSCP);
    }

    #[test]
    fn long_mode_is_always_advertised() {
        let t = guest_cpuid(0, |_| [0; 4]);
        assert_eq!(t[3].edx, EXT1_EDX_LM);
        assert_eq!(t[1].ecx, HYPERVISOR);
    }
}
