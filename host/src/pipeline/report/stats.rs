//! The `--stats` JSON of a run: typed serde structs, keys in alphabetical order.

use serde::Serialize;

use crate::vmm::vcpu::VcpuOutcome;

use super::{ms, ReaderTimes, RunReport};

impl RunReport {
    /// The `--stats` JSON (pretty, keys in alphabetical order, ending in a newline),
    /// with the run's exit code `code`.
    pub fn stats_json(&self, code: i32) -> String {
        let stats = Stats::new(self, code);
        let mut s = serde_json::to_string_pretty(&stats).unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    }
}

/// The crash of a vCPU in `--stats`.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct CrashStats {
    /// The vCPU.
    pub cpu: usize,
    /// `panic` or `fault`.
    pub kind: &'static str,
    /// The panic's text (from the guest; JSON escapes it) or the fault.
    pub message: String,
    /// The instruction pointer when the host read it (`0x…`).
    pub rip: Option<String>,
}

impl CrashStats {
    /// The crash of vCPU `cpu`, if its outcome is one.
    pub fn new(cpu: usize, o: &VcpuOutcome) -> Option<Self> {
        let (kind, msg) = match o {
            VcpuOutcome::Panicked(m) => ("panic", m),
            VcpuOutcome::Faulted(m) => ("fault", m),
            _ => return None,
        };
        // `where_` in vcpu.rs appends "(rip 0x…, …)" when the registers could be read.
        let rip = msg.rfind("(rip 0x").and_then(|i| {
            let hex: String = msg[i + 7..]
                .chars()
                .take_while(char::is_ascii_hexdigit)
                .collect();
            u64::from_str_radix(&hex, 16).ok()
        });
        Some(Self {
            cpu,
            kind,
            message: msg.clone(),
            rip: rip.map(|r| format!("{r:#x}")),
        })
    }
}

/// The live reader's [`ReaderTimes`] in `--stats`, in milliseconds (fields in
/// alphabetical order: the JSON's key order).
#[derive(Debug, Serialize, PartialEq)]
pub struct ReaderJson {
    /// CPU time the reader thread used.
    cpu_ms: f64,
    /// The longest it woke up later than it asked to.
    longest_late_ms: f64,
    /// Its longest round over the CPUs.
    longest_round_ms: f64,
    /// The longest of its waits for the output to take pages.
    output_wait_longest_ms: f64,
    /// All of those waits.
    output_wait_ms: f64,
    /// How many there were.
    output_waits: u64,
    /// Times the standby drainer drained while the reader thread was late.
    standby_turns: u64,
    /// CPU time the standby drainer's thread used.
    standby_cpu_ms: f64,
}

impl ReaderJson {
    fn new(r: &ReaderTimes) -> Option<Self> {
        r.live.then(|| Self {
            cpu_ms: ms(r.cpu),
            longest_late_ms: ms(r.longest_late),
            longest_round_ms: ms(r.longest_round),
            output_wait_longest_ms: ms(r.output_waits.longest),
            output_wait_ms: ms(r.output_waits.total),
            output_waits: r.output_waits.count,
            standby_turns: r.standby.turns,
            standby_cpu_ms: ms(r.standby.cpu),
        })
    }
}

/// One CPU in `--stats` (fields in alphabetical order: the JSON's key order).
#[derive(Debug, Serialize)]
pub struct CpuStatsJson {
    attempted: Option<u64>,
    attempts_problem: Option<String>,
    bytes: u64,
    cpu: usize,
    crash: Option<CrashStats>,
    dropped: u64,
    error: Option<String>,
    lost: u64,
    outcome: &'static str,
    overrun: u64,
    pages_read: u64,
    pages_touched: u64,
    read: u64,
    skipped: Option<u64>,
    swaps: u64,
    written: u64,
}

/// The VMM's own events of a run (`--host-events`), in `--stats`.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct HostEventsStats {
    /// Events lost in the VMM's ring (overwritten before they were read).
    pub lost: u64,
    /// Events read from it.
    pub read: u64,
}

/// The `--stats` document (fields in alphabetical order: the JSON's key order).
#[derive(Debug, Serialize)]
pub struct Stats {
    clock: Option<crate::drain::clock::ClockStats>,
    cpus: Vec<CpuStatsJson>,
    crash: Option<CrashStats>,
    end: &'static str,
    events_per_vcpu: u64,
    exit_code: i32,
    /// `record -F`: what the filters kept and dropped (absent without -F).
    #[serde(skip_serializing_if = "Option::is_none")]
    filter: Option<super::FilterReport>,
    guest_exit: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    host_events: Option<HostEventsStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    host_trace: Option<crate::drain::session::HostTraceStats>,
    mode: String,
    rate: u64,
    /// What the live reader measured of itself (`null` with `--drain none`).
    reader: Option<ReaderJson>,
    stop_reason: Option<String>,
    swap: String,
    tsc_khz: u64,
    vcpus: u32,
    wall_seconds: f64,
    workload: String,
}

impl Stats {
    fn new(r: &RunReport, code: i32) -> Self {
        let outcomes = &r.outcomes;
        let cpus = r
            .cpus
            .iter()
            .enumerate()
            .map(|(cpu, c)| {
                let st = &c.stats;
                CpuStatsJson {
                    attempted: c.attempted,
                    attempts_problem: c.attempts_problem.map(|p| p.to_string()),
                    bytes: st.bytes,
                    cpu,
                    crash: outcomes.get(cpu).and_then(|o| CrashStats::new(cpu, o)),
                    dropped: st.dropped,
                    error: c.error.clone(),
                    lost: st.lost,
                    outcome: outcome_name(outcomes.get(cpu)),
                    overrun: st.overrun,
                    pages_read: st.pages_read,
                    pages_touched: st.pages_touched,
                    read: st.read,
                    skipped: c.skipped,
                    swaps: st.swaps,
                    written: c.written,
                }
            })
            .collect();
        // The most telling outcome of any vCPU: a host error, then a crash (the other
        // vCPUs are then `stopped` because of it, whatever their order), then a stop.
        let guest_exit = ["error", "panic", "fault", "stopped"]
            .into_iter()
            .find(|want| outcomes.iter().any(|o| outcome_name(Some(o)) == *want))
            .unwrap_or("ok");
        let e = &r.echo;
        Self {
            clock: r.clock.clone(),
            cpus,
            crash: outcomes
                .iter()
                .enumerate()
                .find_map(|(cpu, o)| CrashStats::new(cpu, o)),
            end: r.end(),
            events_per_vcpu: e.events,
            exit_code: code,
            filter: match &r.destination {
                super::Destination::File { filter, .. } => filter.clone(),
                _ => None,
            },
            guest_exit,
            host_events: r.host_events,
            host_trace: r.host_trace.clone(),
            mode: e.mode.clone(),
            rate: e.rate,
            reader: ReaderJson::new(&r.timing.reader),
            stop_reason: r.stop.as_ref().map(ToString::to_string),
            swap: e.swap.clone(),
            tsc_khz: r.timing.tsc_khz,
            vcpus: e.vcpus,
            wall_seconds: r.timing.wall.as_secs_f64(),
            workload: e.workload.clone(),
        }
    }
}

/// `ok`, `panic`, `fault`, `stopped`, `error` (or `unknown` without an outcome).
pub(super) fn outcome_name(o: Option<&VcpuOutcome>) -> &'static str {
    match o {
        Some(VcpuOutcome::Finished(_)) => "ok",
        Some(VcpuOutcome::Panicked(_)) => "panic",
        Some(VcpuOutcome::Faulted(_)) => "fault",
        Some(VcpuOutcome::Stopped) => "stopped",
        Some(VcpuOutcome::Error(_)) => "error",
        None => "unknown",
    }
}
