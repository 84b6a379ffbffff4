//! A minimal KVM VMM embedding hyptrace: it boots the stock guest payload with one trace
//! ring per vCPU in its own guest memory, drains the rings while the guest runs, and
//! writes a trace.dat that `trace-cmd report` reads.
//!
//! ```sh
//! cargo run --release --example embed -- OUT.dat && trace-cmd report OUT.dat
//! cargo run --release --example embed -- OUT.pftrace   # Perfetto: ui.perfetto.dev
//! cargo run --release --example embed -- OUT.dat --mmio   # the MMIO doorbell
//! ```
//!
//! The guest rings its doorbell (docs/abi.md, "Doorbell") by port, or with `--mmio` by
//! stores to an unbacked page whose address it gets in its entry `rcx`.
//!
//! It uses only library crates: `hyptrace-payload` (the guest and its boot recipe as
//! plain data), `hyptrace-embed` (rings, registration, drain loop), `hyptrace-abi`,
//! `hyptrace-reader`, `hyptrace-output`; KVM through kvm-ioctls, memory through
//! vm-memory. Host-run swaps (the VMM takes full pages on guest memory), stop mode.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyptrace_abi::guest::{RunParamBlock, Workload};
use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::registry::DEFAULT_TABLE_SIZE;
use hyptrace_embed::{
    Access, Doorbell, Events, GuestRegionMem, MmioDoorbell, PortDoorbell, Ring, Tracer,
};
use hyptrace_output::{
    escape_guest_str, Clock, PageSink, PerfettoSink, StreamSink, TraceDatSink, TraceDatVersion,
};
use hyptrace_payload::boot::{Segment, VcpuBoot};
use hyptrace_payload::exits::{decode_out, read_panic, Request};
use hyptrace_payload::memory_map::DOORBELL_GPA;
use hyptrace_payload::{Boot, GUEST_ELF};
use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_userspace_memory_region, CpuId};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

const VCPUS: u32 = 2;
/// Events each vCPU writes, and how fast (events/s; 0 = as fast as it can).
const EVENTS: u64 = 2000;
const RATE: u64 = 200_000;
/// Ring pages per vCPU (reader page included) and their size.
const PAGES: u32 = 64;
const PAGE_SIZE: usize = 4096;
/// The drain loop's poll period, and how long the guest may take in all.
const POLL: Duration = Duration::from_millis(1);
const DEADLINE: Duration = Duration::from_secs(60);
/// Where KVM puts its TSS pages (needed on Intel): above guest memory.
const KVM_TSS_ADDR: usize = 0xfffb_d000;

type Error = Box<dyn std::error::Error + Send + Sync>;
type Rings = Arc<GuestRegionMem>;

/// How a vCPU ended.
#[derive(Debug)]
enum Outcome {
    Finished,
    Crashed(String),
}

/// The doorbell this VMM serves: the stock guest rings where its entry `rcx` says.
fn doorbell(mmio: bool) -> Box<dyn Doorbell> {
    if mmio {
        // The page Boot's page tables map and no memory slot backs.
        Box::new(MmioDoorbell::new(DOORBELL_GPA))
    } else {
        Box::new(PortDoorbell::default())
    }
}

fn main() -> Result<(), Error> {
    let usage = "usage: embed OUT.dat [--mmio]";
    let mut args = std::env::args().skip(1);
    let out = args.next().ok_or(usage)?;
    let mmio = match args.next().as_deref() {
        None => false,
        Some("--mmio") => true,
        Some(_) => return Err(usage.into()),
    };
    // The rings' shape (with a registration table) and the guest's memory map.
    let geometry = RingGeometry::new(VCPUS, PAGES, PAGE_SIZE, Mode::Stop, false)?
        .with_events(DEFAULT_TABLE_SIZE)?;
    let trace_len = geometry.region_size.next_multiple_of(PAGE_SIZE);
    let boot = Boot::new(GUEST_ELF, VCPUS, trace_len as u64, PAGE_SIZE as u64)?;
    let layout = boot.layout().clone();

    // The VM, its memory (one slot), the guest image and tables in it.
    let kvm = Kvm::new()?;
    let vm = kvm.create_vm()?;
    vm.set_tss_address(KVM_TSS_ADDR)?;
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), boot.mem_bytes() as usize)])?;
    for (slot, region) in (0u32..).zip(mem.iter()) {
        let host = region.get_host_address(vm_memory::MemoryRegionAddress(0))?;
        let r = kvm_userspace_memory_region {
            slot,
            flags: 0,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host as u64,
        };
        // SAFETY: the region is a live mmap owned by `mem`, which lives until the end of
        // main (the process exits then), so as long as the VM; one slot per region.
        unsafe { vm.set_user_memory_region(r) }?;
    }
    boot.load(&mem)?;

    // The vCPUs at their entry state; the guest TSC frequency.
    let cpuid = kvm.get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)?;
    let fds = (0..VCPUS)
        .map(|id| {
            let fd = vm.create_vcpu(u64::from(id))?;
            let b = boot.vcpu(id);
            // rcx: 0 (ring by port) or the MMIO doorbell page.
            setup_vcpu(&fd, &cpuid, &if mmio { b.mmio_doorbell() } else { b })?;
            Ok(fd)
        })
        .collect::<Result<Vec<VcpuFd>, Error>>()?;
    let tsc_khz = u64::from(fds[0].get_tsc_khz()?);

    // The rings in guest memory (the pack at layout.trace_gpa: rdi at entry), host-run
    // swaps, and the answer to the guest's event registration.
    let rings: Rings = Arc::new(GuestRegionMem::new(
        &mem,
        GuestAddress(layout.trace_gpa),
        trace_len,
    )?);
    let swaps = hyptrace_reader::Direct::new(rings.clone(), geometry);
    let mut tracer = Tracer::alloc(rings.clone(), geometry, swaps, tsc_khz)?;
    let events = Arc::new(Events::new(rings, geometry));
    // No guest event before the drain loop runs: the answer waits for the release below.
    events.hold_answers();
    let params = RunParamBlock {
        events: EVENTS,
        rate: RATE,
        tsc_khz,
        ..RunParamBlock::new(Workload::Mixed, VCPUS)
    };
    boot.write_params(&mem, &params)?;

    // One thread per vCPU; `rings` counts the doorbell's rings.
    let running = Arc::new(AtomicU32::new(VCPUS));
    let rang = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0u32..)
        .zip(fds)
        .map(|(id, fd)| {
            let (mem, events, running) = (mem.clone(), events.clone(), running.clone());
            let (slot, rang) = (layout.result_slot(id), rang.clone());
            std::thread::spawn(move || {
                let v = Vcpu {
                    id,
                    mem: &mem,
                    slot,
                    ev: &events,
                    bell: doorbell(mmio),
                    rang: &rang,
                };
                let outcome = run_vcpu(&v, fd);
                running.fetch_sub(1, Ordering::AcqRel);
                outcome
            })
        })
        .collect();

    // The registered formats, then the output; drain while the vCPUs run.
    let registered = events.wait(Duration::from_secs(10))?;
    for r in &registered.rejected {
        eprintln!("embed: warning: {r}");
    }
    let meta = tracer.trace_meta(Clock::guest_tsc(tsc_khz)?, registered.formats);
    let mut sink: Box<dyn PageSink> = if out.ends_with(".pftrace") {
        Box::new(PerfettoSink::create(&out, meta)?)
    } else {
        Box::new(TraceDatSink::create(&out, meta, TraceDatVersion::V7)?)
    };
    events.release_answers();
    let started = Instant::now();
    while running.load(Ordering::Acquire) > 0 {
        if started.elapsed() > DEADLINE {
            return Err(format!("the guest did not finish within {DEADLINE:?}").into());
        }
        if !tracer.drain(sink.as_mut())? {
            std::thread::sleep(POLL);
        }
    }
    let outcomes: Vec<Outcome> = threads
        .into_iter()
        .map(|t| {
            t.join()
                .unwrap_or(Outcome::Crashed("vCPU thread panicked".into()))
        })
        .collect();

    // Every vCPU stopped: the final walks, the accounts, the end of trace.dat.
    let accounts = tracer.finish(sink)?;
    let mut ok = true;
    for (cpu, (a, o)) in accounts.iter().zip(&outcomes).enumerate() {
        let s = &a.stats;
        // Published by the guest's writer as it went (R3): known for a crash too.
        let attempted = match o {
            Outcome::Finished => a.attempts.attempted.to_string(),
            Outcome::Crashed(why) => format!("{} (crashed: {why})", a.attempts.attempted),
        };
        println!(
            "cpu {cpu}: attempted {attempted} written {} read {} lost {} (overrun {} dropped {}){}",
            a.written,
            s.read,
            s.lost,
            s.overrun,
            s.dropped,
            a.error
                .as_ref()
                .map(|e| format!(" error: {e}"))
                .unwrap_or_default()
        );
        ok &= a.consistent() && matches!(o, Outcome::Finished);
    }
    let read: u64 = accounts.iter().map(|a| a.stats.read).sum();
    let lost: u64 = accounts.iter().map(|a| a.stats.lost).sum();
    let kind = if mmio { "mmio" } else { "port" };
    println!("doorbell {kind}: {} rings", rang.load(Ordering::Relaxed));
    println!("wrote {out}: {read} events, {lost} lost");
    // L1: a registration after the wait gave up was refused; its events have no formats.
    if let Some(late) = events.late_registration() {
        return Err(late.into());
    }
    if ok {
        Ok(())
    } else {
        Err("a vCPU crashed, or written != read + lost".into())
    }
}

/// Copies the plain entry state into KVM's registers.
fn setup_vcpu(fd: &VcpuFd, cpuid: &CpuId, b: &VcpuBoot) -> Result<(), kvm_ioctls::Error> {
    let seg = |s: Segment| kvm_segment {
        base: s.base,
        limit: s.limit,
        selector: s.selector,
        type_: s.type_,
        present: s.present,
        dpl: s.dpl,
        db: s.db,
        s: s.s,
        l: s.l,
        g: s.g,
        ..Default::default()
    };
    fd.set_cpuid2(cpuid)?;
    let mut sregs = fd.get_sregs()?;
    (sregs.cs, sregs.ds, sregs.es, sregs.fs) = (seg(b.cs), seg(b.ds), seg(b.es), seg(b.fs));
    (sregs.gs, sregs.ss, sregs.tr) = (seg(b.gs), seg(b.ss), seg(b.tr));
    (sregs.gdt.base, sregs.gdt.limit) = (b.gdt.base, b.gdt.limit);
    (sregs.idt.base, sregs.idt.limit) = (b.idt.base, b.idt.limit);
    (sregs.cr0, sregs.cr3, sregs.cr4, sregs.efer) = (b.cr0, b.cr3, b.cr4, b.efer);
    fd.set_sregs(&sregs)?;
    fd.set_fpu(&kvm_fpu {
        fcw: b.fcw,
        mxcsr: b.mxcsr,
        ..Default::default()
    })?;
    fd.set_regs(&kvm_regs {
        rip: b.rip,
        rsp: b.rsp,
        rdi: b.rdi,
        rsi: b.rsi,
        rdx: b.rdx,
        rcx: b.rcx,
        rflags: b.rflags,
        ..Default::default()
    })
}

/// What a vCPU thread answers with.
struct Vcpu<'a> {
    id: u32,
    mem: &'a GuestMemoryMmap,
    /// Its result slot.
    slot: u64,
    ev: &'a Events<Rings>,
    bell: Box<dyn Doorbell>,
    /// Rings of the doorbell, all vCPUs together.
    rang: &'a AtomicU64,
}

/// Runs vCPU `v.id` until the guest finishes or crashes, answering its doorbell and its
/// port writes.
fn run_vcpu(v: &Vcpu<'_>, mut fd: VcpuFd) -> Outcome {
    let id = v.id;
    loop {
        let exit = match fd.run() {
            Ok(exit) => exit,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
            Err(e) => return Outcome::Crashed(format!("KVM_RUN failed: {e}")),
        };
        // The doorbell: what KVM says the guest wrote, mapped to what it rang.
        let access = match exit {
            VcpuExit::IoOut(port, data) => Access::Pio { port, data },
            VcpuExit::MmioWrite(addr, data) => Access::Mmio { addr, data },
            other => return Outcome::Crashed(format!("unexpected exit {other:?}")),
        };
        let ring = v.bell.ring(access);
        if ring.is_some() {
            v.rang.fetch_add(1, Ordering::Relaxed);
        }
        match ring {
            Some(Ring::Register) => {
                v.ev.on_register(id);
                continue;
            }
            Some(Ring::Exit { vcpu }) if vcpu == id => return Outcome::Finished,
            Some(Ring::Exit { vcpu }) => {
                return Outcome::Crashed(format!("vCPU {id} reported exit as vCPU {vcpu}"))
            }
            None => {}
        }
        let (port, data) = match access {
            Access::Pio { port, data } => (port, data),
            Access::Mmio { addr, .. } => {
                return Outcome::Crashed(format!("write to unbacked guest-physical {addr:#x}"))
            }
        };
        // The stock guest's other requests (hyptrace_payload::exits).
        match decode_out(port, data) {
            Some(Request::Sleep(d)) => std::thread::sleep(d),
            Some(Request::Panic(len)) => {
                let msg = read_panic(v.mem, v.slot, len);
                return Outcome::Crashed(format!("guest panic: {}", escape_guest_str(&msg)));
            }
            _ => return Outcome::Crashed(format!("unexpected write to port {port:#x}")),
        }
    }
}
