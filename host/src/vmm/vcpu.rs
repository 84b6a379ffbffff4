//! The vCPU run loop (one host thread per vCPU), its outcome, and the kick that makes
//! a vCPU leave `KVM_RUN` when a stop is requested.
//!
//! Stop protocol: the stopper sets the shared stop flag, then sends [`kick_signal`] to
//! every vCPU thread. The signal's handler sets `immediate_exit` in the thread's own
//! `kvm_run` (found through a thread-local pointer), so `KVM_RUN` returns `EINTR` whether
//! the signal lands during the ioctl (it interrupts it) or just before it (the next
//! entry returns at once); the loop then sees the flag and returns `Stopped`.

use std::cell::Cell;
use std::ops::ControlFlow;
use std::ptr;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use hyptrace_abi::guest::result;
use hyptrace_embed::{Access, Doorbell, Ring};
use hyptrace_payload::exits::{decode_out, Request};
use kvm_ioctls::{VcpuExit, VcpuFd};
use libc::{c_int, c_void, siginfo_t};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::vmm::registration::RegisterHook;
use crate::vmm::time::host_tsc;

pub use hyptrace_payload::exits::VcpuStats;

/// How a vCPU ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VcpuOutcome {
    /// The workload completed and reported through `PORT_EXIT`.
    Finished(VcpuStats),
    /// The guest panicked (message from its result slot).
    Panicked(String),
    /// The guest crashed: triple fault (`KVM_EXIT_SHUTDOWN`), KVM internal error, failed
    /// entry, access to unbacked memory, or an unexpected exit.
    Faulted(String),
    /// Stopped on request before it finished.
    Stopped,
    /// A host-side failure (an ioctl failed, the thread died).
    Error(VcpuError),
}

/// A host-side failure of a vCPU thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VcpuError {
    /// `KVM_RUN` failed (other than EINTR/EAGAIN).
    #[error("KVM_RUN failed")]
    Run(#[source] kvm_ioctls::Error),
    /// The vCPU thread panicked.
    #[error("vCPU thread panicked")]
    ThreadPanicked,
}

impl VcpuOutcome {
    /// Whether the guest crashed (panic or fault).
    pub fn is_crash(&self) -> bool {
        matches!(self, Self::Panicked(_) | Self::Faulted(_))
    }
}

thread_local! {
    /// `&kvm_run.immediate_exit` of the vCPU this thread runs, or null.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(ptr::null_mut()) };
}

extern "C" fn kick_handler(_: c_int, _: *mut siginfo_t, _: *mut c_void) {
    let p = IMMEDIATE_EXIT.with(Cell::get);
    if !p.is_null() {
        // SAFETY: the pointer was set by this very thread from its `VcpuFd`'s mmapped
        // `kvm_run` and is cleared before that `VcpuFd` is dropped, so it is valid here;
        // `immediate_exit` is a byte userspace may set at any time (KVM API).
        unsafe { p.write_volatile(1) };
    }
}

/// The real-time signal used to kick vCPU threads out of `KVM_RUN`.
pub fn kick_signal() -> c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Installs the kick handler (once per process).
pub(crate) fn install_kick_handler() -> crate::vmm::error::Result<()> {
    static DONE: OnceLock<Result<(), vmm_sys_util::errno::Error>> = OnceLock::new();
    (*DONE
        .get_or_init(|| vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)))
    .map_err(crate::vmm::error::Error::KickSignal)
}

fn read_stats(mem: &GuestMemoryMmap, slot: u64) -> VcpuStats {
    hyptrace_payload::exits::read_stats(mem, slot)
}

fn read_panic(mem: &GuestMemoryMmap, slot: u64, len: u32) -> String {
    hyptrace_payload::exits::read_panic(mem, slot, len)
}

/// Where the guest was when it crashed, for the message.
fn where_(fd: &VcpuFd) -> String {
    match (fd.get_regs(), fd.get_sregs()) {
        (Ok(r), Ok(s)) => format!(
            " (rip {:#x}, rsp {:#x}, rflags {:#x}, cs {:#x}, cr2 {:#x})",
            r.rip, r.rsp, r.rflags, s.cs.selector, s.cr2
        ),
        _ => String::new(),
    }
}

fn internal_suberror(fd: &mut VcpuFd) -> u32 {
    let run = fd.get_kvm_run();
    // SAFETY: called right after KVM_RUN returned KVM_EXIT_INTERNAL_ERROR, for which the
    // kernel fills the `internal` member of the union; it is plain data.
    unsafe { run.__bindgen_anon_1.internal.suberror }
}

/// `KVM_EXIT_*` and the I/O port (0 for other exits) of an exit, for `vmm:vcpu_exit`.
fn exit_reason(exit: &VcpuExit<'_>) -> (u32, u32) {
    use crate::vmm::host_events as h;
    match exit {
        VcpuExit::IoOut(port, _) | VcpuExit::IoIn(port, _) => (h::KVM_EXIT_IO, u32::from(*port)),
        VcpuExit::Intr => (h::KVM_EXIT_INTR, 0),
        VcpuExit::Hlt => (h::KVM_EXIT_HLT, 0),
        VcpuExit::MmioRead(..) | VcpuExit::MmioWrite(..) => (h::KVM_EXIT_MMIO, 0),
        VcpuExit::Shutdown => (h::KVM_EXIT_SHUTDOWN, 0),
        VcpuExit::FailEntry(..) => (h::KVM_EXIT_FAIL_ENTRY, 0),
        VcpuExit::InternalError => (h::KVM_EXIT_INTERNAL_ERROR, 0),
        _ => (h::KVM_EXIT_UNKNOWN, 0),
    }
}

/// What the guest's doorbell write in `exit` asks for (`None`: it rang nothing): the
/// registration's answer, written before the vCPU resumes (once per run; later exits are
/// ignored, each bounded), or the vCPU's end.
fn doorbell(
    id: u32,
    exit: &VcpuExit<'_>,
    mem: &GuestMemoryMmap,
    slot: u64,
    shared: &Shared,
) -> Option<ControlFlow<VcpuOutcome>> {
    let access = match exit {
        VcpuExit::IoOut(port, data) => Access::Pio { port: *port, data },
        VcpuExit::MmioWrite(addr, data) => Access::Mmio { addr: *addr, data },
        _ => return None,
    };
    Some(match shared.doorbell.ring(access)? {
        Ring::Register => {
            shared.events.on_register(id);
            ControlFlow::Continue(())
        }
        Ring::Exit { vcpu } if vcpu != id => ControlFlow::Break(VcpuOutcome::Faulted(format!(
            "vCPU {id} reported exit as vCPU {vcpu}"
        ))),
        Ring::Exit { .. } => ControlFlow::Break(VcpuOutcome::Finished(read_stats(mem, slot))),
    })
}

/// Runs vCPU `id` until it finishes, crashes or is stopped.
pub(crate) fn run(
    id: u32,
    mut fd: VcpuFd,
    mem: GuestMemoryMmap,
    slot: u64,
    shared: &Shared,
) -> VcpuOutcome {
    IMMEDIATE_EXIT.with(|p| p.set(ptr::addr_of_mut!(fd.get_kvm_run().immediate_exit)));
    log::debug!("vcpu {id}: running");
    let outcome = run_loop(id, &mut fd, &mem, slot, shared);
    IMMEDIATE_EXIT.with(|p| p.set(ptr::null_mut()));
    log::debug!("vcpu {id}: exit: {outcome:?}");
    outcome
}

fn run_loop(
    id: u32,
    fd: &mut VcpuFd,
    mem: &GuestMemoryMmap,
    slot: u64,
    shared: &Shared,
) -> VcpuOutcome {
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return VcpuOutcome::Stopped;
        }
        let exit = match fd.run() {
            Ok(exit) => exit,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                if let Some(ev) = &shared.host_events {
                    ev.vcpu_exit(id, crate::vmm::host_events::KVM_EXIT_INTR, 0);
                }
                fd.set_kvm_immediate_exit(0);
                continue;
            }
            Err(e) => return VcpuOutcome::Error(VcpuError::Run(e)),
        };
        if let Some(ev) = &shared.host_events {
            let (reason, port) = exit_reason(&exit);
            ev.vcpu_exit(id, reason, port);
        }
        match doorbell(id, &exit, mem, slot, shared) {
            Some(ControlFlow::Continue(())) => continue,
            Some(ControlFlow::Break(outcome)) => return outcome,
            None => {}
        }
        match exit {
            VcpuExit::IoOut(port, data) => match decode_out(port, data) {
                Some(Request::Align) => {
                    // The `align` workload: the host clock at this exit, for the guest to
                    // record next to its own TSC stamps around it.
                    let now = shared.stamp.now();
                    if mem
                        .write_obj(now, GuestAddress(slot + result::ALIGN_HOST as u64))
                        .is_err()
                    {
                        return VcpuOutcome::Faulted("result slot not writable".into());
                    }
                }
                Some(Request::Sleep(d)) => {
                    // A pacing guest with nothing to do for a while (bounded by
                    // SLEEP_MAX_US: a stop request is seen at the top of the loop).
                    std::thread::sleep(d);
                    continue;
                }
                Some(Request::Panic(len)) => {
                    return VcpuOutcome::Panicked(read_panic(mem, slot, len));
                }
                // Exit and Register ring the doorbell (above) when it is the port one.
                Some(Request::Exit(_) | Request::Register) => {
                    return VcpuOutcome::Faulted(format!(
                        "write to I/O port {port:#x}, a port doorbell, but this run serves the MMIO doorbell (the guest does not take its doorbell from its entry rcx)"
                    ));
                }
                None => {
                    return VcpuOutcome::Faulted(format!("unexpected write to I/O port {port:#x}"));
                }
            },
            VcpuExit::IoIn(port, _) => {
                return VcpuOutcome::Faulted(format!("unexpected read of I/O port {port:#x}"));
            }
            VcpuExit::Intr => continue,
            VcpuExit::Shutdown => {
                return VcpuOutcome::Faulted(format!(
                    "triple fault (KVM_EXIT_SHUTDOWN): CPU exception with no IDT{}",
                    where_(fd)
                ));
            }
            VcpuExit::InternalError => {
                let sub = internal_suberror(fd);
                return VcpuOutcome::Faulted(format!(
                    "KVM internal error (suberror {sub}){}",
                    where_(fd)
                ));
            }
            VcpuExit::FailEntry(reason, cpu) => {
                return VcpuOutcome::Faulted(format!(
                    "VM entry failed (hardware reason {reason:#x}, host cpu {cpu})"
                ));
            }
            VcpuExit::MmioRead(addr, _) | VcpuExit::MmioWrite(addr, _) => {
                return VcpuOutcome::Faulted(format!(
                    "access to unbacked guest-physical address {addr:#x}{}",
                    where_(fd)
                ));
            }
            VcpuExit::Hlt => return VcpuOutcome::Faulted(format!("guest halted{}", where_(fd))),
            other => {
                let what = format!("{other:?}");
                return VcpuOutcome::Faulted(format!("unexpected exit {what}{}", where_(fd)));
            }
        }
    }
}

/// State shared by the vCPU threads and the [`crate::vmm::vm::RunningVm`].
pub(crate) struct Shared {
    pub(crate) stop: AtomicBool,
    pub(crate) crashed: AtomicBool,
    /// What the first vCPU that crashed or failed did (set before `crashed`).
    pub(crate) reason: Mutex<Option<String>>,
    /// How the vCPUs stamp `PORT_ALIGN` exits.
    pub(crate) stamp: Stamp,
    /// `--host-events`: where the vCPUs record their exits.
    pub(crate) host_events: Option<Arc<crate::vmm::host_events::HostEvents>>,
    pub(crate) done: Mutex<usize>,
    pub(crate) cv: Condvar,
    /// Set by a [`Waker`]: the run loop's wait ends early once.
    pub(crate) wake: AtomicBool,
    /// Answers the guest's registration exit.
    pub(crate) events: Arc<dyn RegisterHook>,
    /// Where the guest rings for its registration and its end (the stock guest: ports).
    pub(crate) doorbell: Box<dyn Doorbell>,
}

/// The host clock a vCPU thread stamps exits with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stamp {
    pub(crate) clock: crate::vmm::time::ClockKind,
    pub(crate) tsc_offset: i64,
}

impl Stamp {
    /// Now, on the run's clock: `clock_gettime` for `mono`/`boot`, the guest-equivalent
    /// TSC (host TSC + offset) for `tsc`.
    pub(crate) fn now(&self) -> u64 {
        use crate::vmm::time::ClockKind;
        match self.clock {
            ClockKind::Mono => crate::vmm::time::clock_ns(libc::CLOCK_MONOTONIC),
            ClockKind::Boot => crate::vmm::time::clock_ns(libc::CLOCK_BOOTTIME),
            ClockKind::Tsc => host_tsc().wrapping_add_signed(self.tsc_offset),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_abi::guest::{DOORBELL_EXIT_OFF, DOORBELL_REGISTER_OFF, PORT_EXIT};
    use hyptrace_abi::registry::PORT_REGISTER;
    use hyptrace_embed::{MmioDoorbell, PortDoorbell};
    use std::sync::atomic::AtomicU32;

    /// Counts registration exits (the vCPU that made the last one + 1).
    #[derive(Default)]
    struct Count(AtomicU32);

    impl RegisterHook for Count {
        fn on_register(&self, vcpu: u32) {
            self.0.store(vcpu + 1, Ordering::SeqCst);
        }
    }

    fn shared(doorbell: Box<dyn Doorbell>, hook: Arc<Count>) -> Shared {
        Shared {
            stop: AtomicBool::new(false),
            crashed: AtomicBool::new(false),
            reason: Mutex::new(None),
            stamp: Stamp {
                clock: crate::vmm::time::ClockKind::Mono,
                tsc_offset: 0,
            },
            host_events: None,
            done: Mutex::new(0),
            cv: Condvar::new(),
            wake: AtomicBool::new(false),
            events: hook,
            doorbell,
        }
    }

    /// The vCPU exits the CLI maps to its doorbell: a port write or an MMIO write rings
    /// the registration (answered, the vCPU goes on) or the exit (its own id: finished;
    /// another: a fault); a write the doorbell does not know rings nothing.
    #[test]
    fn kvm_exits_ring_the_doorbell() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 4096)]).unwrap();
        let hook = Arc::new(Count::default());
        let pio = shared(Box::new(PortDoorbell::default()), hook.clone());
        let one = 1u32.to_le_bytes();
        let ring = |s: &Shared, exit: VcpuExit<'_>| doorbell(1, &exit, &mem, 0, s);
        let r = ring(&pio, VcpuExit::IoOut(PORT_REGISTER, &one));
        assert!(matches!(r, Some(ControlFlow::Continue(()))));
        assert_eq!(hook.0.load(Ordering::SeqCst), 2);
        let r = ring(&pio, VcpuExit::IoOut(PORT_EXIT, &one));
        assert!(matches!(
            r,
            Some(ControlFlow::Break(VcpuOutcome::Finished(_)))
        ));
        let r = ring(&pio, VcpuExit::IoOut(PORT_EXIT, &[7, 0, 0, 0]));
        assert!(matches!(
            r,
            Some(ControlFlow::Break(VcpuOutcome::Faulted(_)))
        ));
        assert!(ring(&pio, VcpuExit::MmioWrite(DOORBELL_REGISTER_OFF, &one)).is_none());
        assert!(ring(&pio, VcpuExit::IoOut(0x80, &one)).is_none());

        let base = 0xfe00_0000;
        let hook = Arc::new(Count::default());
        let mmio = shared(Box::new(MmioDoorbell::new(base)), hook.clone());
        let r = ring(
            &mmio,
            VcpuExit::MmioWrite(base + DOORBELL_REGISTER_OFF, &one),
        );
        assert!(matches!(r, Some(ControlFlow::Continue(()))));
        assert_eq!(hook.0.load(Ordering::SeqCst), 2);
        let r = ring(&mmio, VcpuExit::MmioWrite(base + DOORBELL_EXIT_OFF, &one));
        assert!(matches!(
            r,
            Some(ControlFlow::Break(VcpuOutcome::Finished(_)))
        ));
        assert!(ring(&mmio, VcpuExit::IoOut(PORT_REGISTER, &one)).is_none());
    }
}
