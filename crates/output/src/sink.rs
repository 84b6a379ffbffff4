//! The page-sink interface: ring pages are copied out through a callback into a sink
//! (the perf-AUX idea), which writes them in its format.

use crate::error::{MetaError, PageProblem};
use std::collections::BTreeMap;

use crate::clock::Clock;
use crate::{Missed, OutputError};
use hyptrace_format::{guest_formats, EventFormat};

/// Most CPUs a trace holds ([`TraceMeta::nr_cpus`]).
pub const MAX_CPUS: u32 = 4096;

/// Longest instance name (trace-cmd takes a tracefs instance name: a file name).
pub const MAX_INSTANCE_NAME: usize = 64;

/// Whether `name` can name an instance (a buffer instance of a trace.dat, a group of a sink).
pub fn valid_instance_name(name: &str) -> bool {
    (1..=MAX_INSTANCE_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Most groups ([`TraceMeta::groups`]) a trace holds: as many as a trace.dat's buffer
/// instances (`tracedat::MAX_INSTANCES` is this).
pub const MAX_GROUPS: usize = 256;

/// What a sink needs to know before the first page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceMeta {
    /// Page size (power of two ≥ 4096); every page handed to the sink has this length.
    pub page_size: usize,
    /// Number of CPUs (vCPUs); `cpu` arguments are below it.
    pub nr_cpus: u32,
    /// pid → comm (saved cmdlines).
    pub cmdlines: BTreeMap<i32, String>,
    /// Clock of the page timestamps.
    pub clock: Clock,
    /// Event formats (the guest events by default).
    pub formats: Vec<EventFormat>,
    /// The VMs of a trace of several (`hyptrace collect`, a multi-buffer trace.dat
    /// converted): each a named range of the CPUs, in order, disjoint. Empty: one VM
    /// owns every CPU. The Perfetto and JSON sinks make a process of each; the others
    /// take no groups ([`TraceMeta::check_one_vm`]).
    pub groups: Vec<CpuGroup>,
}

/// One VM of a trace of several ([`TraceMeta::groups`]): its name and its CPUs
/// `first..first + count` of the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuGroup {
    /// The VM's name (a buffer instance's: 1 to 64 of `[A-Za-z0-9_.-]`).
    pub name: String,
    /// Its first CPU in the output.
    pub first: u32,
    /// How many CPUs it has.
    pub count: u32,
}

impl TraceMeta {
    /// Metadata of a hyptrace guest: the built-in guest events, and the pid of vCPU `n`
    /// (`n + 1`) named `vcpu<n>`.
    pub fn guest(page_size: usize, nr_cpus: u32, clock: Clock) -> Self {
        let cmdlines = (0..nr_cpus)
            .map(|n| (hyptrace_abi::events::vcpu_pid(n), format!("vcpu{n}")))
            .collect();
        Self {
            page_size,
            nr_cpus,
            cmdlines,
            clock,
            formats: guest_formats(),
            groups: Vec::new(),
        }
    }

    /// With host kernel events (`--host-trace`), the host CPU number of output CPU
    /// `cpu`: the host CPUs are the last ones, after every CPU the cmdlines name (the
    /// vCPUs, the VMM's).
    pub fn host_cpu(&self, cpu: u32) -> Option<u32> {
        if !self
            .formats
            .iter()
            .any(|f| hyptrace_abi::registry::is_host_kernel_id(f.id))
        {
            return None;
        }
        let first = (0..self.nr_cpus).find(|&c| {
            !self
                .cmdlines
                .contains_key(&hyptrace_abi::events::vcpu_pid(c))
        })?;
        cpu.checked_sub(first)
    }

    /// The group of CPU `cpu` and its index ([`TraceMeta::groups`]; `None`: none, or a
    /// CPU of no group).
    pub fn group_of(&self, cpu: u32) -> Option<(usize, &CpuGroup)> {
        self.groups
            .iter()
            .enumerate()
            .find(|(_, g)| cpu >= g.first && cpu - g.first < g.count)
    }

    /// Appends a group ([`TraceMeta::groups`]) of `count` CPUs named `name` after the
    /// CPUs there are: vCPU `c` of it is named as `cmdlines` name pid `c + 1` (its
    /// buffer's own), else `vcpuC`; host CPUs (`cmdlines` `None`, a group that must come
    /// last) get no name here: the sinks call them host CPUs ([`TraceMeta::host_cpu`]).
    /// Checked by [`TraceMeta::validate`].
    pub fn push_group(
        &mut self,
        name: &str,
        count: u32,
        cmdlines: Option<&BTreeMap<i32, String>>,
    ) -> Result<(), OutputError> {
        let first = self.nr_cpus;
        let end = first
            .checked_add(count)
            .filter(|&e| e <= MAX_CPUS)
            .ok_or(OutputError::Meta(MetaError::Cpus(
                first.saturating_add(count),
            )))?;
        if let Some(cmdlines) = cmdlines {
            for c in 0..count {
                let pid = hyptrace_abi::events::vcpu_pid(c);
                let comm = cmdlines
                    .get(&pid)
                    .cloned()
                    .unwrap_or_else(|| format!("vcpu{c}"));
                self.cmdlines
                    .insert(hyptrace_abi::events::vcpu_pid(first + c), comm);
            }
        }
        self.groups.push(CpuGroup {
            name: name.to_string(),
            first,
            count,
        });
        self.nr_cpus = end;
        Ok(())
    }

    /// Refuses groups ([`TraceMeta::groups`]) for a sink of `what` that cannot name
    /// them.
    pub fn check_one_vm(&self, what: &'static str) -> Result<(), OutputError> {
        if self.groups.is_empty() {
            return Ok(());
        }
        Err(OutputError::Meta(MetaError::OneVm {
            sink: what,
            vms: self.groups.len(),
        }))
    }

    /// Checks page size, CPU count and format ids (unique).
    pub fn validate(&self) -> Result<(), OutputError> {
        crate::export::check_page_size(self.page_size)?;
        if self.nr_cpus == 0 || self.nr_cpus > MAX_CPUS {
            return Err(OutputError::Meta(MetaError::Cpus(self.nr_cpus)));
        }
        let mut ids: Vec<u16> = self.formats.iter().map(|f| f.id).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(OutputError::Meta(MetaError::DuplicateEventId(w[0])));
        }
        self.validate_groups()
    }

    /// Groups: at most [`MAX_GROUPS`], valid names, each non-empty and within the CPUs,
    /// in order without overlap.
    fn validate_groups(&self) -> Result<(), OutputError> {
        if self.groups.len() > MAX_GROUPS {
            return Err(OutputError::Meta(MetaError::Groups {
                count: self.groups.len(),
                max: MAX_GROUPS,
            }));
        }
        let mut next = 0u32;
        for g in &self.groups {
            let end = g.first.checked_add(g.count);
            if !valid_instance_name(&g.name)
                || g.count == 0
                || g.first < next
                || end.is_none_or(|e| e > self.nr_cpus)
            {
                return Err(OutputError::Meta(MetaError::Group {
                    name: g.name.clone(),
                    first: g.first,
                    count: g.count,
                    nr_cpus: self.nr_cpus,
                }));
            }
            next = g.first + g.count;
        }
        Ok(())
    }

    /// The format of event `id`.
    pub fn format(&self, id: u16) -> Option<&EventFormat> {
        self.formats.iter().find(|f| f.id == id)
    }

    /// The page step of the file sinks (raw, trace.dat): checks ring page `page` of
    /// `cpu`, exports it into `out` (see [`crate::export_page_into`]) and, when `retime`,
    /// converts its times to the clock's ns in place (K1: every format a file carries
    /// gets the one conversion). Ring pages are retimed; a page built from a time already
    /// converted (`trailing_lost`) is not.
    pub(crate) fn file_page(
        &self,
        cpu: u32,
        page: &[u8],
        missed: Missed,
        retime: bool,
        out: &mut [u8],
    ) -> Result<(), OutputError> {
        self.check_page(cpu, page)?;
        crate::export::export_page_into(cpu, page, missed, out)?;
        if retime {
            self.clock.retime_page(out);
        }
        Ok(())
    }

    /// Checks that `page` can be a page of CPU `cpu` of this trace (its CPU is below
    /// `nr_cpus`, its length the page size): every sink's first step.
    pub fn check_page(&self, cpu: u32, page: &[u8]) -> Result<(), OutputError> {
        if cpu >= self.nr_cpus {
            return Err(OutputError::BadPage {
                cpu,
                problem: PageProblem::NoSuchCpu {
                    cpu,
                    nr_cpus: self.nr_cpus,
                },
            });
        }
        if page.len() != self.page_size {
            return Err(OutputError::BadPage {
                cpu,
                problem: PageProblem::Size {
                    len: page.len(),
                    page_size: self.page_size,
                },
            });
        }
        Ok(())
    }
}

/// The kernel's per-CPU ring statistics, as in `per_cpu/cpuN/stats` (one trace.dat
/// CPUSTAT option per CPU; not the reader's accounting, `hyptrace_reader::CpuStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCpuStat {
    /// Events still in the ring (not read).
    pub entries: u64,
    /// Events overwritten (lost) in the ring.
    pub overrun: u64,
    /// Events lost because a commit was interrupted (0 for us).
    pub commit_overrun: u64,
    /// Bytes of event data still in the ring.
    pub bytes: u64,
    /// Timestamp of the oldest event, ns.
    pub oldest_event_ts: u64,
    /// Timestamp at the time of the stats, ns.
    pub now_ts: u64,
    /// Events dropped (ring full, no overwrite).
    pub dropped_events: u64,
    /// Events read out of the ring.
    pub read_events: u64,
}

impl KernelCpuStat {
    /// The CPUSTAT text for CPU `cpu`, exactly as the kernel's `stats` file plus the
    /// leading `CPU: N` line trace-cmd adds.
    pub fn to_cpustat_text(&self, cpu: u32) -> String {
        let ts = |ns: u64| {
            format!(
                "{:5}.{:06}",
                ns / 1_000_000_000,
                (ns % 1_000_000_000) / 1000
            )
        };
        format!(
            "CPU: {cpu}\nentries: {}\noverrun: {}\ncommit overrun: {}\nbytes: {}\noldest event ts: {}\nnow ts: {}\ndropped events: {}\nread events: {}\n",
            self.entries,
            self.overrun,
            self.commit_overrun,
            self.bytes,
            ts(self.oldest_event_ts),
            ts(self.now_ts),
            self.dropped_events,
            self.read_events
        )
    }
}

/// What a sink learns at the end of a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Stats per CPU (index = cpu); missing CPUs count as all zero.
    pub cpus: Vec<KernelCpuStat>,
}

/// How long the producer of a sink's pages waited for the sink to take them: the
/// back-pressure of an output slower than the rings fill ([`crate::ThreadedSink`]
/// counts it; a sink that writes in the caller's thread reports nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OutputWaits {
    /// Waits.
    pub count: u64,
    /// Their total.
    pub total: std::time::Duration,
    /// The longest one.
    pub longest: std::time::Duration,
}

impl OutputWaits {
    /// Counts one wait of `d`.
    pub fn add(&mut self, d: std::time::Duration) {
        self.count = self.count.saturating_add(1);
        self.total = self.total.saturating_add(d);
        self.longest = self.longest.max(d);
    }
}

/// A consumer of exported ring pages.
///
/// `page` receives the raw page as it is in the ring (header + data + private footer,
/// exactly `TraceMeta::page_size` bytes); the sink makes the exported copy itself
/// ([`crate::export_page`]): tail zeroed, `missed` (the loss before this page:
/// [`Missed::Count`] `(n)`, `n > 0`, `n` events lost; [`Missed::Unknown`], some events
/// lost, count unknown) stored the Linux way. Pages of one CPU arrive in order.
pub trait PageSink {
    /// One page of CPU `cpu`.
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError>;
    /// `lost` (> 0) events of CPU `cpu` were lost after its last page (stop mode: the
    /// ring was full when the writer stopped). Called at most once per CPU, after its
    /// last `page`. Each sink shows the loss in its format.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        let _ = (cpu, lost);
        Ok(())
    }
    /// CPU `cpu` delivers nothing more: no page, no `trailing_lost` (a later one is an
    /// error). Optional: a sink that writes each CPU's data in one piece (trace.dat)
    /// can then write the next CPU's straight to its place (`convert` feeds a trace.dat
    /// CPU by CPU and says so).
    fn end_cpu(&mut self, cpu: u32) -> Result<(), OutputError> {
        let _ = cpu;
        Ok(())
    }
    /// CPU `cpu` will deliver no event with a raw timestamp older than `ts` (a CPU
    /// that had nothing to deliver when it was looked at: the host kernel's CPUs of
    /// `--host-trace`). A sink that merges CPUs by time ([`crate::TextSink`]) stops
    /// holding the others' events back for it. May come late (after more pages of that
    /// CPU): it only ever says less than it could.
    fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
        let _ = (cpu, ts);
        Ok(())
    }
    /// The producer has nothing more for now (the end of a drain round): a sink that
    /// holds pages back ([`crate::ThreadedSink`]) hands over what it holds once it is
    /// old enough, so output keeps flowing at low rates.
    fn idle(&mut self) -> Result<(), OutputError> {
        Ok(())
    }
    /// The pages come from live rings, which lose events while the sink falls behind
    /// ([`crate::ThreadedSink`] says so of the sink it runs; `convert` does not): a sink
    /// may then trade output size for pace — the trace.dat sink stores a zstd chunk
    /// nearly uncompressed when its compression workers are behind.
    fn set_live(&mut self) {}
    /// The run is aborted: stop writing as soon as possible (what is queued is not
    /// written); the sink is dropped next, unfinished.
    fn abandon(&mut self) {}
    /// End of the run: write what is left and close. A sink dropped without `finish`
    /// leaves no output that looks complete.
    fn finish(self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError>;
    /// How long the caller has waited so far for this sink to take pages
    /// ([`OutputWaits`]); nothing for a sink that never makes its caller wait for room.
    fn waits(&self) -> OutputWaits {
        OutputWaits::default()
    }
}
