//! The VM: creation (memory, page tables, vCPUs), start (one thread per vCPU), stop and
//! outcomes.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hyptrace_abi::guest::{RunParamBlock, Workload};
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::signal::Killable;

use crate::vmm::arch;
use crate::vmm::elf::GuestImage;
use crate::vmm::error::{Error, Result};
use crate::vmm::guest_mem::TraceRegion;
use crate::vmm::memory_map::{GuestMemoryMap, KVM_TSS_ADDR};
use crate::vmm::overlap;
use crate::vmm::registration::{EventTable, RegisterHook, Selection};
use crate::vmm::time::host_tsc;
use crate::vmm::vcpu::{self, Shared, Stamp, VcpuOutcome};

/// What to build.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Number of vCPUs (1..=[`crate::vmm::memory_map::MAX_VCPUS`] and KVM's limit).
    pub vcpus: u32,
    /// Guest memory size: a multiple of 2 MiB, at most 3 GiB.
    pub mem_bytes: u64,
    /// The guest payload (a static x86-64 ELF executable), e.g. [`crate::GUEST_ELF`].
    pub guest_elf: Cow<'static, [u8]>,
    /// Size of the trace region (rdi at entry).
    pub trace_region_bytes: u64,
    /// Alignment of the trace region: a power of two (e.g. the ring page size); the
    /// region is at least 2 MiB-aligned anyway, so 0 or 4096 mean 2 MiB.
    pub trace_region_align: u64,
    /// Where the guest rings the VMM (`--doorbell`; docs/abi.md, "Doorbell").
    pub doorbell: DoorbellKind,
}

/// Which doorbell the VM serves (docs/abi.md, "Doorbell"). The guest learns it from its
/// entry `rcx`: 0 for ports, the page's address
/// ([`crate::vmm::memory_map::DOORBELL_GPA`]) for MMIO. The VM serves that one only: a
/// ring at the other is a guest fault.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DoorbellKind {
    /// Port I/O (`PORT_REGISTER`, `PORT_EXIT`): every guest's, `rcx` = 0.
    #[default]
    Port,
    /// Stores to the unbacked MMIO doorbell page at `DOORBELL_GPA`, `rcx` = that address.
    Mmio,
}

impl DoorbellKind {
    /// The entry's `rcx` (what the guest is told).
    pub fn entry_rcx(self) -> u64 {
        match self {
            Self::Port => 0,
            Self::Mmio => crate::vmm::memory_map::DOORBELL_GPA,
        }
    }

    /// What maps the vCPUs' doorbell exits to rings.
    fn doorbell(self) -> Box<dyn hyptrace_embed::Doorbell> {
        match self {
            Self::Port => Box::new(hyptrace_embed::PortDoorbell::default()),
            Self::Mmio => Box::new(hyptrace_embed::MmioDoorbell::new(
                crate::vmm::memory_map::DOORBELL_GPA,
            )),
        }
    }
}

/// What the guest runs (the host side of the RunParams block). `nr_vcpus` and
/// `tsc_khz` are filled in by the VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunParams {
    /// Workload.
    pub workload: Workload,
    /// Events per vCPU.
    pub events: u64,
    /// Events per second per vCPU, 0 = as fast as possible.
    pub rate: u64,
    /// Seed of the pseudo-random choices.
    pub seed: u64,
    /// `RUN_FLAG_*` of `hyptrace_abi::guest`.
    pub flags: u32,
    /// Events per burst for the burst workload (0 = the guest's default, 1024).
    pub burst: u32,
    /// Payload bytes of each event of the bench workload.
    pub payload: u32,
    /// The clock the VMM stamps `PORT_ALIGN` exits with (the run's `--clock`).
    pub clock: crate::vmm::time::ClockKind,
}

/// Default seed of [`RunParams`].
pub const DEFAULT_SEED: u64 = 0x6879_7074_7261_6365;

impl Default for RunParams {
    fn default() -> Self {
        Self {
            workload: Workload::Steady,
            events: 0,
            rate: 0,
            seed: DEFAULT_SEED,
            flags: 0,
            burst: 0,
            payload: 0,
            clock: crate::vmm::time::ClockKind::Mono,
        }
    }
}

/// A created VM, ready to start.
pub struct Vm {
    _kvm: Kvm,
    vm_fd: VmFd,
    memory: GuestMemoryMmap,
    layout: GuestMemoryMap,
    vcpus: Vec<VcpuFd>,
    tsc_khz: u64,
    tsc_offset: Option<i64>,
    entry: u64,
    doorbell: DoorbellKind,
    host_events: Option<Arc<crate::vmm::host_events::HostEvents>>,
}

/// Environment variable naming the KVM device instead of `/dev/kvm` (for tests).
pub const KVM_DEVICE_ENV: &str = "HYPTRACE_KVM_DEVICE";

fn open_kvm() -> Result<Kvm> {
    let path = std::env::var(KVM_DEVICE_ENV).unwrap_or_else(|_| "/dev/kvm".to_string());
    let cpath = std::ffi::CString::new(path.clone()).map_err(|_| Error::KvmUnavailable {
        path: path.clone(),
        source: None,
    })?;
    Kvm::new_with_path(&cpath).map_err(|e| Error::KvmUnavailable {
        path,
        source: Some(e),
    })
}

/// Guest memory: anonymous, or (`--trace-mem`) three regions — below the trace region,
/// the trace region rounded up to 4 KiB in `backing`'s file, and the rest.
fn guest_memory(
    cfg: &VmConfig,
    layout: &GuestMemoryMap,
    backing: Option<vm_memory::FileOffset>,
) -> Result<GuestMemoryMmap> {
    let memory = match backing {
        None => GuestMemoryMmap::from_ranges(&[(GuestAddress(0), cfg.mem_bytes as usize)]),
        Some(file) => {
            let (gpa, len) = (
                layout.trace_gpa,
                hyptrace_reader::trace_file::mapped_len(layout.trace_len as usize) as u64,
            );
            let end = gpa.saturating_add(len).min(cfg.mem_bytes);
            let mut ranges = vec![
                (GuestAddress(0), gpa as usize, None),
                (GuestAddress(gpa), (end - gpa) as usize, Some(file)),
            ];
            if end < cfg.mem_bytes {
                ranges.push((GuestAddress(end), (cfg.mem_bytes - end) as usize, None));
            }
            GuestMemoryMmap::from_ranges_with_files(&ranges)
        }
    }
    .map_err(Error::MemoryMmap)?;
    Ok(memory)
}

/// Registers every region of `memory` with KVM, each in a slot of its own.
fn register_memory(vm_fd: &VmFd, memory: &GuestMemoryMmap) -> Result<()> {
    for (slot, region) in memory.iter().enumerate() {
        let host = region.get_host_address(vm_memory::MemoryRegionAddress(0))?;
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host as u64,
        };
        // SAFETY: the region is a live mmap owned by `memory`, which the VM keeps
        // (and the trace region clones) for at least as long as the VM fd exists; it
        // is registered once, in a slot of its own.
        unsafe { vm_fd.set_user_memory_region(r) }
            .map_err(Error::kvm("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(())
}

/// Guest TSC = host TSC where KVM lets us; returns the offset KVM reports (`None`: it
/// cannot say, guest TSC = host TSC assumed).
fn sync_tsc(vcpus: &[VcpuFd]) -> Option<i64> {
    // Guest TSC = host TSC: the reader can then put host and guest times on one
    // clock. Best effort (older kernels lack the attribute, PVM refuses or ignores
    // it); read back to check, and say which case this is.
    let set = vcpus
        .iter()
        .map(|fd| arch::set_tsc_offset(fd, 0))
        .find(|r| r.is_err())
        .unwrap_or(Ok(()));
    let tsc_offset = match (set, arch::tsc_offset(&vcpus[0])) {
        (Ok(()), Ok(v)) => {
            log::info!("TSC offset set to 0, read back {v}");
            Some(v)
        }
        (Err(e), Ok(v)) => {
            log::info!("TSC offset cannot be set ({e}); KVM reports {v}: using it");
            Some(v)
        }
        (Ok(()), Err(e)) => {
            log::info!("TSC offset set to 0 but cannot be read back ({e}): assuming 0");
            None
        }
        (Err(e), Err(_)) => {
            log::info!("TSC offset not supported by this KVM ({e}): assuming guest TSC = host TSC");
            None
        }
    };
    tsc_offset
}

/// TSC frequency measured against the monotonic clock (when KVM cannot say).
fn calibrate_tsc_khz() -> u64 {
    let t0 = Instant::now();
    let c0 = host_tsc();
    std::thread::sleep(Duration::from_millis(20));
    let c1 = host_tsc();
    let ns = t0.elapsed().as_nanos().max(1) as u64;
    c1.wrapping_sub(c0).saturating_mul(1_000_000) / ns
}

impl Vm {
    /// Creates the VM: checks the image and layout, opens KVM, creates and fills guest
    /// memory (tables, image), and the vCPUs at their entry state.
    pub fn new(cfg: VmConfig) -> Result<Self> {
        Self::with_trace_backing(cfg, None)
    }

    /// [`Vm::new`] with the trace region in a shared mapping of a file (`--trace-mem`,
    /// [`crate::flight::trace_mem`]) instead of anonymous memory: guest memory is then three
    /// regions — below the trace region, the trace region rounded up to 4 KiB (from
    /// `backing`), and the rest — each in its own KVM memory slot.
    pub fn with_trace_backing(
        cfg: VmConfig,
        backing: Option<vm_memory::FileOffset>,
    ) -> Result<Self> {
        let image = GuestImage::parse(&cfg.guest_elf)?;
        let layout = GuestMemoryMap::new(
            &image,
            cfg.vcpus,
            cfg.mem_bytes,
            cfg.trace_region_bytes,
            cfg.trace_region_align.max(1),
        )?;
        if image.end > cfg.mem_bytes {
            return Err(Error::ImageOutsideMemory {
                start: image.start,
                end: image.end,
                mem_bytes: cfg.mem_bytes,
            });
        }

        log::debug!(
            "memory map: {:#x} bytes of guest memory, image [{:#x}, {:#x}), entry {:#x}, run parameters at {:#x} (results at {:#x}), stacks at {:#x}, trace region [{:#x}, +{:#x})",
            layout.mem_bytes,
            layout.image.0,
            layout.image.1,
            image.entry,
            layout.params_gpa,
            layout.results_gpa,
            layout.stacks_gpa,
            layout.trace_gpa,
            layout.trace_len
        );
        // First: the trace region is faulted in while the VM is made (crate::vmm::overlap).
        let memory = guest_memory(&cfg, &layout, backing)?;
        let prefault = overlap::prefault(&memory, &layout);
        let kvm = open_kvm()?;
        let max = kvm.get_max_vcpus() as u32;
        if cfg.vcpus > max {
            return Err(Error::TooManyVcpus {
                want: cfg.vcpus,
                max,
            });
        }
        let vm_fd = kvm.create_vm().map_err(Error::kvm("KVM_CREATE_VM"))?;
        vm_fd
            .set_tss_address(KVM_TSS_ADDR as usize)
            .map_err(Error::kvm("KVM_SET_TSS_ADDR"))?;

        register_memory(&vm_fd, &memory)?;

        arch::setup_memory(&memory, &layout)?;
        // Fresh anonymous memory is zero already: .bss needs nothing.
        hyptrace_payload::boot::load_image(&memory, &cfg.guest_elf, &image)?;

        let mut vcpus = Vec::with_capacity(cfg.vcpus as usize);
        for id in 0..cfg.vcpus {
            let fd = vm_fd
                .create_vcpu(u64::from(id))
                .map_err(Error::kvm("KVM_CREATE_VCPU"))?;
            arch::setup_vcpu(&fd, id, &layout, image.entry, cfg.doorbell.entry_rcx())
                .map_err(Error::kvm("vCPU set-up"))?;
            vcpus.push(fd);
        }
        let tsc_offset = sync_tsc(&vcpus);
        // The rings are written next (Booted::rings): the region faulted in by now, or
        // here if its thread never got to it.
        prefault.finish();
        let tsc_khz = match vcpus[0].get_tsc_khz() {
            Ok(k) if k > 0 => u64::from(k),
            _ => calibrate_tsc_khz(),
        };
        log::debug!(
            "created {} vCPUs (KVM allows {max}); TSC {tsc_khz} kHz, guest - host TSC offset {tsc_offset:?}",
            vcpus.len()
        );

        Ok(Self {
            _kvm: kvm,
            vm_fd,
            memory,
            layout,
            vcpus,
            tsc_khz,
            tsc_offset,
            entry: image.entry,
            doorbell: cfg.doorbell,
            host_events: None,
        })
    }

    /// The memory map.
    pub fn layout(&self) -> &GuestMemoryMap {
        &self.layout
    }

    /// Guest memory.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// The trace region (see [`TraceRegion`] for lifetime and aliasing rules).
    pub fn trace_region(&self) -> TraceRegion {
        TraceRegion::new(
            self.memory.clone(),
            self.layout.trace_gpa,
            self.layout.trace_len as usize,
        )
    }

    /// GPA of the RunParams block (rdx at entry); result slots follow at +128.
    pub fn params_gpa(&self) -> u64 {
        self.layout.params_gpa
    }

    /// TSC frequency of the vCPUs in kHz (`KVM_GET_TSC_KHZ`, else measured).
    pub fn tsc_khz(&self) -> u64 {
        self.tsc_khz
    }

    /// vCPU TSC offset (guest TSC − host TSC) after setting it to 0, or `None` when the
    /// kernel cannot tell (then assume nothing about guest vs host TSC).
    pub fn tsc_offset(&self) -> Option<i64> {
        self.tsc_offset
    }

    /// The vCPU threads record their exits into `events` (`--host-events`).
    pub fn record_exits(&mut self, events: Arc<crate::vmm::host_events::HostEvents>) {
        self.host_events = Some(events);
    }

    /// Entry point of the guest image.
    pub fn entry(&self) -> u64 {
        self.entry
    }

    /// Number of vCPUs.
    pub fn vcpu_count(&self) -> u32 {
        self.layout.vcpus
    }

    fn write_params(&self, p: &RunParams) -> Result<()> {
        let block = RunParamBlock {
            events: p.events,
            rate: p.rate,
            tsc_khz: self.tsc_khz,
            seed: p.seed,
            flags: p.flags,
            burst: p.burst,
            payload: p.payload,
            ..RunParamBlock::new(p.workload, self.layout.vcpus)
        };
        // The block and zeroed result slots, in one write before any vCPU runs.
        hyptrace_payload::boot::write_params(&self.memory, &self.layout, &block)
            .map_err(Error::from)
    }

    /// Writes the run parameters and starts one thread per vCPU. The guest's event
    /// registration is answered with every valid event accepted and enabled (the
    /// geometry is the pack's, read back from the trace region).
    pub fn start(self, p: &RunParams) -> Result<RunningVm> {
        let region = self.trace_region();
        let mem = Arc::new(crate::vmm::guest_mem::GuestTraceMem::new(region));
        let hook: Arc<dyn RegisterHook> = match hyptrace_abi::RingGeometry::parse(&*mem) {
            Ok(l) => Arc::new(EventTable::new(mem, l, Selection::default())),
            Err(_) => Arc::new(NoTable),
        };
        self.start_with_events(p, hook)
    }

    /// [`Vm::start`] with the guest's event registration answered by `events` (e.g. an
    /// [`EventTable`] with the command line's selection).
    pub fn start_with_events(
        self,
        p: &RunParams,
        events: Arc<dyn RegisterHook>,
    ) -> Result<RunningVm> {
        self.write_params(p)?;
        vcpu::install_kick_handler()?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            crashed: AtomicBool::new(false),
            reason: Mutex::new(None),
            stamp: Stamp {
                clock: p.clock,
                tsc_offset: self.tsc_offset.unwrap_or(0),
            },
            host_events: self.host_events.clone(),
            done: Mutex::new(0),
            cv: Condvar::new(),
            wake: AtomicBool::new(false),
            events,
            doorbell: self.doorbell.doorbell(),
        });
        let started_at = Instant::now();
        let start_tsc = host_tsc();
        let n = self.vcpus.len();
        let mut running = RunningVm {
            _vm_fd: self.vm_fd,
            memory: self.memory,
            layout: self.layout,
            tsc_khz: self.tsc_khz,
            tsc_offset: self.tsc_offset,
            threads: Vec::with_capacity(n),
            shared,
            started_at,
            start_tsc,
        };
        for (id, fd) in self.vcpus.into_iter().enumerate() {
            let id = id as u32;
            let mem = running.memory.clone();
            let slot = running.layout.result_slot(id);
            let shared = Arc::clone(&running.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || {
                    let out = vcpu::run(id, fd, mem, slot, &shared);
                    if out.is_crash() || matches!(out, VcpuOutcome::Error(_)) {
                        shared
                            .reason
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert_with(|| crash_reason(id, &out));
                        shared.crashed.store(true, Ordering::SeqCst);
                    }
                    *shared.done.lock().unwrap_or_else(|e| e.into_inner()) += 1;
                    shared.cv.notify_all();
                    out
                });
            match spawned {
                Ok(h) => {
                    log::debug!("vcpu {id}: thread started");
                    running.threads.push(h);
                }
                Err(e) => {
                    // Dropping `running` stops and joins the threads started so far.
                    return Err(Error::VcpuThread { id, source: e });
                }
            }
        }
        Ok(running)
    }
}

/// One line saying how vCPU `id` crashed or failed.
fn crash_reason(id: u32, out: &VcpuOutcome) -> String {
    match out {
        VcpuOutcome::Panicked(m) => format!(
            "vcpu {id}: guest panic: {}",
            hyptrace_output::escape_guest_str(m)
        ),
        VcpuOutcome::Faulted(m) => format!("vcpu {id}: {m}"),
        VcpuOutcome::Error(e) => format!("vcpu {id}: {}", crate::exit::chain(e)),
        other => format!("vcpu {id}: {other:?}"),
    }
}

/// The answer when the trace region has no valid pack: nothing (the guest reads no
/// answer and goes on without ids).
struct NoTable;

impl RegisterHook for NoTable {
    fn on_register(&self, vcpu: u32) {
        log::warn!("vcpu {vcpu}: registration exit, but the trace region has no valid pack");
    }
}

/// Wakes the run loop's wait ([`RunningVm::waker`]); cheap to call from any thread.
#[derive(Clone)]
pub struct Waker(Arc<Shared>);

impl Waker {
    /// Ends the current (or next) wait of the run loop.
    pub fn wake(&self) {
        self.0.wake.store(true, Ordering::Release);
        // Under the lock: the waiter is either before its predicate check (sees the
        // flag) or waiting (gets the notification), never in between.
        let _g = self.0.done.lock().unwrap_or_else(|e| e.into_inner());
        self.0.cv.notify_all();
    }
}

/// Whether every vCPU still runs as started ([`RunningVm::watch`]); cheap to ask from
/// any thread.
#[derive(Clone)]
pub struct VcpuWatch(Arc<Shared>);

impl VcpuWatch {
    /// No vCPU crashed or ended, and no stop was asked for.
    pub fn all_running(&self) -> bool {
        !self.0.stop.load(Ordering::SeqCst)
            && !self.0.crashed.load(Ordering::SeqCst)
            && *self.0.done.lock().unwrap_or_else(|e| e.into_inner()) == 0
    }
}

/// A started VM: its vCPU threads are running.
pub struct RunningVm {
    _vm_fd: VmFd,
    memory: GuestMemoryMmap,
    layout: GuestMemoryMap,
    tsc_khz: u64,
    tsc_offset: Option<i64>,
    threads: Vec<JoinHandle<VcpuOutcome>>,
    shared: Arc<Shared>,
    started_at: Instant,
    start_tsc: u64,
}

impl RunningVm {
    /// Whether every vCPU thread has ended.
    pub fn is_finished(&self) -> bool {
        *self.shared.done.lock().unwrap_or_else(|e| e.into_inner()) >= self.threads.len()
    }

    /// Waits up to `timeout` for every vCPU to end, or for a [`Waker`] to wake it;
    /// returns [`Self::is_finished`].
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let n = self.threads.len();
        let done = self.shared.done.lock().unwrap_or_else(|e| e.into_inner());
        // AcqRel: the waker's store comes before its notify (under the lock); the wait
        // ends once per wake.
        let (done, _) = self
            .shared
            .cv
            .wait_timeout_while(done, timeout, |d| {
                *d < n && !self.shared.wake.swap(false, Ordering::AcqRel)
            })
            .unwrap_or_else(|e| e.into_inner());
        *done >= n
    }

    /// Something that ends the run loop's current [`Self::wait_timeout`] early (the
    /// control socket: a queued command is served at once, not at the next poll).
    pub fn waker(&self) -> Waker {
        Waker(Arc::clone(&self.shared))
    }

    /// A handle that tells from any thread whether every vCPU still runs.
    pub fn watch(&self) -> VcpuWatch {
        VcpuWatch(Arc::clone(&self.shared))
    }

    /// Whether vCPU `id`'s thread has ended (finished, crashed or stopped).
    pub fn vcpu_finished(&self, id: u32) -> bool {
        self.threads
            .get(id as usize)
            .is_none_or(|h| h.is_finished())
    }

    /// Whether a vCPU has crashed (panic, fault) or failed.
    pub fn any_crashed(&self) -> bool {
        self.shared.crashed.load(Ordering::SeqCst)
    }

    /// What the first vCPU that crashed or failed did (one line; the guest's panic
    /// message escaped), once [`Self::any_crashed`].
    pub fn crash_reason(&self) -> Option<String> {
        self.shared
            .reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Asks every vCPU to stop: each leaves `KVM_RUN` promptly, even if the guest spins.
    /// Idempotent; vCPUs that already ended keep their outcome.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // A vCPU whose registration answer is held waits in the hook, where no kick
        // reaches it: release it, or joining it would wait out the hold.
        self.shared.events.on_stop();
        for h in &self.threads {
            if !h.is_finished() {
                // An error only means the thread has just exited.
                let _ = h.kill(vcpu::kick_signal());
            }
        }
    }

    /// Waits for every vCPU thread and returns the outcomes, by vCPU id.
    pub fn wait(mut self) -> Vec<VcpuOutcome> {
        std::mem::take(&mut self.threads)
            .into_iter()
            .map(|h| {
                h.join().unwrap_or(VcpuOutcome::Error(
                    crate::vmm::vcpu::VcpuError::ThreadPanicked,
                ))
            })
            .collect()
    }

    /// The trace region (see [`TraceRegion`]).
    pub fn trace_region(&self) -> TraceRegion {
        TraceRegion::new(
            self.memory.clone(),
            self.layout.trace_gpa,
            self.layout.trace_len as usize,
        )
    }

    /// Guest memory.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    /// The memory map.
    pub fn layout(&self) -> &GuestMemoryMap {
        &self.layout
    }

    /// TSC frequency in kHz.
    pub fn tsc_khz(&self) -> u64 {
        self.tsc_khz
    }

    /// See [`Vm::tsc_offset`].
    pub fn tsc_offset(&self) -> Option<i64> {
        self.tsc_offset
    }

    /// When [`Vm::start`] started the threads.
    pub fn started_at(&self) -> Instant {
        self.started_at
    }

    /// Host TSC just before the threads started. A vCPU's [`vcpu::VcpuStats::tsc_start`]
    /// minus [`Self::tsc_offset`] minus this is the start latency.
    pub fn start_tsc(&self) -> u64 {
        self.start_tsc
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop();
            for h in self.threads.drain(..) {
                let _ = h.join();
            }
        }
    }
}
