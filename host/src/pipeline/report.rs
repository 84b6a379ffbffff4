//! What a run produced ([`RunReport`]): per-CPU accounting (invariant R1: written =
//! read + lost, lost = overrun + dropped), the vCPUs' outcomes, timings, how the run
//! stopped and what failed. It renders the summary on stderr (`Display`), the
//! `--stats` JSON ([`RunReport::stats_json`], typed serde structs) and the exit code.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::drain::session::SessionError;
use crate::drain::sink::Format;
use crate::exit::{EXIT_CRASH, EXIT_OK, EXIT_RUNTIME};
use crate::pipeline::plan::OptionsEcho;
use crate::vmm::vcpu::VcpuOutcome;
use hyptrace_abi::layout::Mode;

mod stats;
mod summary;

pub use stats::{CpuStatsJson, CrashStats, HostEventsStats, ReaderJson, Stats};
pub use summary::Summary;

/// Why a run stopped before its guest finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The first Ctrl-C (SIGINT) or SIGTERM.
    Signal(&'static str),
    /// `--duration` elapsed.
    Duration,
    /// A vCPU crashed; the others were stopped.
    Crash,
    /// Stdout was closed by its reader (`| head`).
    StdoutClosed,
    /// Reading a ring or writing the output failed (reported on its own).
    Failed(String),
    /// No vCPU made progress for `--hang-timeout` (counts as a crash: exit 3).
    Hang(Duration),
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Signal(sig) => write!(f, "interrupted by {sig}"),
            Self::Duration => f.write_str("--duration elapsed"),
            Self::Crash => f.write_str("a vCPU crashed"),
            Self::StdoutClosed => f.write_str("stdout closed"),
            Self::Failed(what) => f.write_str(what),
            Self::Hang(t) => write!(
                f,
                "the guest hung: no progress for {:.1} s (--hang-timeout)",
                t.as_secs_f64()
            ),
        }
    }
}

/// Failures of a run, reported once each after the summary (the last lines on stderr):
/// the first output failure (later ones are its consequences), the first read failure
/// of each vCPU.
#[derive(Debug, Default)]
pub struct Failures {
    output: Option<String>,
    read: Vec<(u32, String)>,
    other: Vec<String>,
}

impl Failures {
    /// Records a failure of the session (on `cpu`, or of the output as a whole).
    pub fn session(&mut self, cpu: Option<u32>, e: &SessionError) {
        match (e, cpu) {
            (e, _) if e.is_output() => {
                self.output.get_or_insert_with(|| crate::exit::chain(e));
            }
            (e, Some(cpu)) => {
                if !self.read.iter().any(|(c, _)| *c == cpu) {
                    self.read.push((cpu, crate::exit::chain(e)));
                }
            }
            (e, None) => self.other.push(crate::exit::chain(e)),
        }
    }

    /// Records a failure outside the session (e.g. writing the crash dump).
    pub fn other(&mut self, what: String) {
        self.other.push(what);
    }

    /// Whether anything failed.
    pub fn any(&self) -> bool {
        self.output.is_some() || !self.read.is_empty() || !self.other.is_empty()
    }

    /// Whether the output failed.
    pub fn output_failed(&self) -> bool {
        self.output.is_some()
    }

    fn fmt_lines(&self, f: &mut fmt::Formatter<'_>, to: &Destination) -> fmt::Result {
        for (cpu, e) in &self.read {
            writeln!(f, "hyptrace: error: reading vcpu {cpu}: {e}")?;
        }
        for e in &self.other {
            writeln!(f, "hyptrace: error: {e}")?;
        }
        if let Some(e) = &self.output {
            // The output error's chain is `output: ` and then the path (a file's): this
            // line names the path once, itself.
            let e = e.strip_prefix("output: ").unwrap_or(e);
            match to {
                Destination::Stdout { .. } => {
                    writeln!(f, "hyptrace: error: writing to stdout: {e}")?
                }
                Destination::Sink => writeln!(f, "hyptrace: error: writing to the sink: {e}")?,
                Destination::File { path, .. } => {
                    let p = path.display().to_string();
                    let e = e.strip_prefix(&format!("{p}: ")).unwrap_or(e);
                    writeln!(f, "hyptrace: error: writing {p}: {e}")?
                }
            }
        }
        Ok(())
    }
}

/// Per-CPU result of a run, as printed and written to `--stats`.
#[derive(Debug, Clone, Default)]
pub struct CpuReport {
    /// The writer finished (not stopped or crashed mid-write).
    pub finished: bool,
    /// Events the guest tried to emit, as its writer published them (R3).
    pub attempted: Option<u64>,
    /// Of those, events whose tracepoint was disabled.
    pub skipped: Option<u64>,
    /// Why the published attempted/skipped cannot be true, if they cannot (R3).
    pub attempts_problem: Option<hyptrace_reader::AttemptsProblem>,
    /// Events the writer took in.
    pub written: u64,
    /// The reader's counters.
    pub stats: hyptrace_reader::CpuStats,
    /// The first error on this CPU.
    pub error: Option<String>,
    /// Most events one page of the ring holds (its data area / the smallest record, 8
    /// bytes): the bound of the one exemption from `lost == overrun + dropped`.
    pub page_events: u64,
}

impl CpuReport {
    /// The report of a CPU the engine accounted (`a`, with its error as a line);
    /// `page_events`: most events one page of its ring holds.
    pub fn from_account(a: hyptrace_embed::CpuAccount<String>, page_events: u64) -> Self {
        Self {
            finished: a.finished,
            attempted: Some(a.attempts.attempted),
            skipped: Some(a.attempts.skipped),
            attempts_problem: a.attempts.problem,
            written: a.written,
            stats: a.stats,
            error: a.error,
            page_events,
        }
    }

    /// The one exemption from `lost == overrun + dropped` (R1): a writer that did not
    /// finish — its vCPU stopped or crashed while it overwrote a page — counted that
    /// page's events as overrun before it wrote over them, and the reader read them.
    /// Returns by how many events the writer's counters are ahead, when it is that case:
    /// a writer that did not finish, ahead by at most one page's events.
    pub fn overrun_ahead(&self) -> Option<u64> {
        let s = &self.stats;
        let counted = s.overrun.checked_add(s.dropped)?;
        let ahead = counted.checked_sub(s.lost)?;
        (!self.finished && ahead > 0 && ahead <= self.page_events).then_some(ahead)
    }

    /// `written == read + lost`, `lost == overrun + dropped` (invariant R1), and the
    /// guest's published attempts agree with `written` (invariant R3:
    /// `hyptrace_embed::attempts_consistent`).
    pub fn consistent(&self) -> bool {
        let s = &self.stats;
        // The reader's count of lost events (gaps in the event index) is exact. The
        // writer's own overrun counter can be one page ahead of it, and only so
        // (`overrun_ahead`). A failure on the CPU (read or output) is reported on its
        // own; it is no accounting mismatch when the counts balance. Guest numbers: sums
        // that overflow match nothing.
        s.read.checked_add(s.lost) == Some(self.written)
            && (s.overrun.checked_add(s.dropped) == Some(s.lost) || self.overrun_ahead().is_some())
            && match (self.attempted, self.skipped) {
                (Some(attempted), Some(skipped)) => hyptrace_embed::attempts_consistent(
                    &hyptrace_reader::Attempts {
                        attempted,
                        skipped,
                        problem: self.attempts_problem,
                    },
                    self.written,
                    self.finished,
                ),
                _ => true,
            }
    }

    /// The mark after the CPU's summary line: none when the counts balance;
    /// `INCOMPLETE` when a failure (`failed`: reading or writing) stopped the reading
    /// with events still unread — the failure is the cause, reported on its own;
    /// `MISMATCH` otherwise.
    fn flag(&self, failed: bool) -> String {
        let seen = self.stats.read.saturating_add(self.stats.lost);
        if let (true, Some(ahead)) = (self.consistent(), self.overrun_ahead()) {
            format!("  (overrun counts {ahead} events read: the vCPU stopped while its writer overwrote a page)")
        } else if self.consistent() {
            String::new()
        } else if failed && self.written > seen {
            format!(
                "  INCOMPLETE: {} events not read after the failure",
                self.written - seen
            )
        } else {
            "  MISMATCH".into()
        }
    }

    fn fmt_line(&self, f: &mut fmt::Formatter<'_>, id: usize, failed: bool) -> fmt::Result {
        let st = &self.stats;
        let opt = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
        writeln!(
            f,
            "hyptrace: cpu {id}: attempted {} skipped {} written {} read {} lost {} (overrun {} dropped {}) swaps {} pages_touched {} bytes {}{}",
            opt(self.attempted),
            opt(self.skipped),
            self.written,
            st.read,
            st.lost,
            st.overrun,
            st.dropped,
            st.swaps,
            st.pages_touched,
            st.bytes,
            self.flag(failed)
        )
    }
}

/// Where the events of a run went.
#[derive(Debug, Clone)]
pub enum Destination {
    /// Text lines on stdout: how many reached it.
    Stdout {
        /// Lines that reached stdout.
        lines: u64,
    },
    /// The caller's page sink.
    Sink,
    /// A file in a format.
    File {
        /// The path given.
        path: PathBuf,
        /// Its format.
        format: Format,
        /// `-F`: what the filters kept and dropped.
        filter: Option<FilterReport>,
        /// A regular file whose blocks may go through the page cache (no `--direct-io`):
        /// the loss hint names the option.
        page_cache: bool,
    },
}

/// What `record -F` kept and dropped of the events read (dropped events are read, not
/// lost: they are left out of the output on purpose).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct FilterReport {
    /// Events written.
    pub kept: u64,
    /// Events the filters rejected.
    pub dropped: u64,
    /// The filters that passed no event.
    pub unmatched: Vec<String>,
}

/// Clocks and times of a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    /// Host TSC before the VM was created.
    pub created_tsc: u64,
    /// TSC frequency of the vCPUs.
    pub tsc_khz: u64,
    /// Host TSC when the vCPUs were started.
    pub start_tsc: u64,
    /// Guest TSC − host TSC, when known.
    pub tsc_offset: Option<i64>,
    /// Host TSC when the guest's event registration was answered, if it registered:
    /// before it the guest wrote nothing, only waited for the run to start reading.
    pub answered_tsc: Option<u64>,
    /// From start until every vCPU stopped.
    pub wall: Duration,
    /// What the drain loop measured of itself.
    pub reader: ReaderTimes,
}

/// `d` in milliseconds (the unit of the reader's figures in hints, `--stats` and `bench`).
pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What the drain loop (the reader thread) measured of itself while the vCPUs ran —
/// where the time went when it fell behind — and the rings it drained.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReaderTimes {
    /// The loop drained the rings while the vCPUs ran (`--drain live`); without it
    /// nothing below says why events were lost.
    pub live: bool,
    /// CPU time the thread used (`RUSAGE_THREAD`).
    pub cpu: Duration,
    /// The longest it woke up later than it asked to (held off its core).
    pub longest_late: Duration,
    /// Its longest round over the CPUs.
    pub longest_round: Duration,
    /// Its waits for the output to take pages (back-pressure of a slow output).
    pub output_waits: hyptrace_output::OutputWaits,
    /// `--buffer-kb`: one CPU's pages, the reader page included.
    pub buffer_kb: u64,
    /// Event bytes one CPU's ring holds while its reader is away (its ring pages' data).
    pub ring_bytes: u64,
    /// What the standby drainer did ([`crate::drain::standby`]; nothing without one).
    pub standby: crate::drain::standby::StandbyTimes,
}

impl Timing {
    /// Guest TSC at which a vCPU that entered at `tsc_start` began its workload: when its
    /// registration was answered, if that was later (every vCPU waits for the answer
    /// before its first event; the run holds it until it reads). The guest's `--rate`
    /// schedule starts there too.
    pub fn workload_start(&self, tsc_start: u64) -> u64 {
        match (self.answered_tsc, self.tsc_offset) {
            (Some(at), Some(off)) => {
                let guest = at.wrapping_add(off as u64);
                // Guest numbers: a start after the answer stays as it is.
                if guest.wrapping_sub(tsc_start) as i64 > 0 {
                    guest
                } else {
                    tsc_start
                }
            }
            _ => tsc_start,
        }
    }

    fn ms(&self, cycles: u64) -> f64 {
        if self.tsc_khz == 0 {
            0.0
        } else {
            cycles as f64 / self.tsc_khz as f64
        }
    }
}

/// What a run produced.
#[derive(Debug)]
pub struct RunReport {
    /// How each vCPU ended.
    pub outcomes: Vec<VcpuOutcome>,
    /// Accounting per CPU.
    pub cpus: Vec<CpuReport>,
    /// Clocks and times.
    pub timing: Timing,
    /// Why the run stopped before the guest finished, if it did.
    pub stop: Option<Stop>,
    /// What failed.
    pub failures: Failures,
    /// Where the events went.
    pub destination: Destination,
    /// The options `--stats` repeats.
    pub echo: OptionsEcho,
    /// The clock of every output (`--clock`) and how its map held, if one was made.
    pub clock: Option<crate::drain::clock::ClockStats>,
    /// `--host-events`: what the VMM's ring held (absent without the flag).
    pub host_events: Option<HostEventsStats>,
    /// `--host-trace`: what the host kernel's instance gave and lost.
    pub host_trace: Option<crate::drain::session::HostTraceStats>,
    /// `--mode` (the loss hint depends on it).
    pub mode: Mode,
    /// The guest's memory after the run (result slots, for `bench`).
    pub guest: Option<GuestView>,
    /// `-v` (or `RUST_LOG` at info): each paced vCPU's lateness on its line.
    pub verbose: bool,
}

/// The guest memory of a run that ended, and where things are in it.
#[derive(Debug, Clone)]
pub struct GuestView {
    /// Guest memory.
    pub memory: vm_memory::GuestMemoryMmap,
    /// The guest-physical map (result slots: [`crate::vmm::memory_map::GuestMemoryMap::result_slot`]).
    pub map: crate::vmm::memory_map::GuestMemoryMap,
}

/// 1 if a vCPU failed on the host side, else 3 if the guest crashed, else 0.
pub fn exit_code(outcomes: &[VcpuOutcome]) -> i32 {
    if outcomes.iter().any(|o| matches!(o, VcpuOutcome::Error(_))) {
        EXIT_RUNTIME
    } else if outcomes.iter().any(VcpuOutcome::is_crash) {
        EXIT_CRASH
    } else {
        EXIT_OK
    }
}

impl RunReport {
    /// A closed stdout (`| head`) that ended a complete run ends it quietly: nothing on
    /// stderr (like `trace-cmd report | head`), unless `-v`; `--stats` still has it all.
    pub fn quiet_end(&self) -> bool {
        matches!(self.stop, Some(Stop::StdoutClosed)) && !self.verbose && self.exit_code() == 0
    }

    /// The exit code: 1 if a vCPU failed on the host side, a read or the output failed,
    /// or the accounting does not balance; else 3 if the guest crashed; else 0.
    pub fn exit_code(&self) -> i32 {
        let code = exit_code(&self.outcomes);
        let consistent = self.cpus.iter().all(CpuReport::consistent);
        if code == EXIT_OK && (self.failures.any() || !consistent) {
            EXIT_RUNTIME
        } else if code == EXIT_OK && matches!(self.stop, Some(Stop::Hang(_))) {
            EXIT_CRASH
        } else {
            code
        }
    }

    /// `end` of `--stats`: how the run ended. `guest_finished`, `duration`, `signal`,
    /// `stdout_closed` (exit 0 when every event is accounted for), `guest_crashed` (3),
    /// `error` (1).
    pub fn end(&self) -> &'static str {
        let outcomes = &self.outcomes;
        if outcomes.iter().any(|o| matches!(o, VcpuOutcome::Error(_))) || self.failures.any() {
            return "error";
        }
        if outcomes.iter().any(VcpuOutcome::is_crash) {
            return "guest_crashed";
        }
        match &self.stop {
            None => "guest_finished",
            Some(Stop::Signal(_)) => "signal",
            Some(Stop::Duration) => "duration",
            Some(Stop::StdoutClosed) => "stdout_closed",
            Some(Stop::Crash) => "guest_crashed",
            Some(Stop::Hang(_)) => "guest_hung",
            Some(Stop::Failed(_)) => "error",
        }
    }
}

#[cfg(test)]
mod tests;
