//! What a run produced ([`RunReport`]): per-CPU accounting (invariant R1: written =
//! read + lost, lost = overrun + dropped), the vCPUs' outcomes, timings, how the run
//! stopped and what failed. It renders the summary on stderr (`Display`), the
//! `--stats` JSON ([`RunReport::stats_json`], typed serde structs) and the exit code.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::drain::session::SessionError;
use crate::drain::sink::{shown_path, FormatArg};
use crate::exit::{EXIT_CRASH, EXIT_OK, EXIT_RUNTIME};
use crate::pipeline::options::ModeArg;
use crate::pipeline::plan::OptionsEcho;
use crate::vmm::vcpu::VcpuOutcome;

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
        format: FormatArg,
    },
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
    pub mode: ModeArg,
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

/// The sum of `v`, saturating at `u64::MAX`.
fn sat_sum(v: impl IntoIterator<Item = u64>) -> u64 {
    v.into_iter().fold(0, u64::saturating_add)
}

/// What a file of `format` is called in messages.
fn format_name(format: FormatArg) -> &'static str {
    match format {
        FormatArg::Dat => "trace.dat (v7)",
        FormatArg::Dat6 => "trace.dat (v6)",
        FormatArg::Json => "JSON",
        FormatArg::Perfetto => "Perfetto trace",
        FormatArg::Text => "text",
        FormatArg::Raw => "raw pages",
    }
}

/// What to do about lost events, for the mode that lost them.
fn loss_hint(mode: ModeArg) -> &'static str {
    match mode {
        ModeArg::Stop => {
            "events were lost (dropped while a ring was full): raise --buffer-kb or lower --rate, or use --mode overwrite to keep the newest events"
        }
        ModeArg::Overwrite => {
            "events were lost (overwritten before they were read): raise --buffer-kb or lower --rate"
        }
    }
}

/// `ok`, `panic`, `fault`, `stopped`, `error` (or `unknown` without an outcome).
fn outcome_name(o: Option<&VcpuOutcome>) -> &'static str {
    match o {
        Some(VcpuOutcome::Finished(_)) => "ok",
        Some(VcpuOutcome::Panicked(_)) => "panic",
        Some(VcpuOutcome::Faulted(_)) => "fault",
        Some(VcpuOutcome::Stopped) => "stopped",
        Some(VcpuOutcome::Error(_)) => "error",
        None => "unknown",
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

    /// How far a paced vCPU whose workload took `ms` (from [`Timing::workload_start`]:
    /// the wait for its registration's answer is no lateness) ran behind its `--rate`
    /// schedule, and that schedule, in ms: the guest catches up at most
    /// `PACE_MAX_LAG_US`, so a vCPU held off its core for longer ends later. `None`
    /// unless it is more than 1 ms and 1 % late, or without a schedule (no `--rate`, a
    /// burst workload, or one too short to show: never a "0.0 ms" schedule).
    fn behind(&self, ms: f64) -> Option<(f64, f64)> {
        let e = &self.echo;
        if e.rate == 0 || e.events == 0 || !matches!(e.workload.as_str(), "steady" | "mixed") {
            return None;
        }
        let schedule = e.events as f64 * 1e3 / e.rate as f64;
        let behind = ms - schedule;
        if schedule < 0.1 || behind <= 1.0 || behind <= schedule / 100.0 {
            return None;
        }
        Some((behind, schedule))
    }

    /// [`Self::behind`] of vCPU outcome `o` (finished ones only).
    fn lateness(&self, o: &VcpuOutcome) -> Option<(f64, f64)> {
        let VcpuOutcome::Finished(st) = o else {
            return None;
        };
        let t = &self.timing;
        self.behind(t.ms(st.tsc_end.wrapping_sub(t.workload_start(st.tsc_start))))
    }

    /// The one line on lateness, shown when it explains a loss: how many paced vCPUs
    /// ran behind their `--rate` schedule, and the most (each one's with `-v`).
    fn lateness_hint(&self) -> Option<String> {
        let late: Vec<f64> = self
            .outcomes
            .iter()
            .filter_map(|o| self.lateness(o).map(|(behind, _)| behind))
            .collect();
        let most = late.iter().copied().fold(0.0, f64::max);
        (!late.is_empty()).then(|| {
            format!(
                "{} of {} vCPUs ran behind their --rate schedule (up to {most:.1} ms): held off their cores (a pacing guest catches up at most {} µs), the reader likely was too; -v shows each",
                late.len(),
                self.outcomes.len(),
                hyptrace_abi::guest::PACE_MAX_LAG_US
            )
        })
    }

    fn fmt_outcome(&self, f: &mut fmt::Formatter<'_>, id: usize, o: &VcpuOutcome) -> fmt::Result {
        let t = &self.timing;
        let outcome = match o {
            VcpuOutcome::Finished(st) => {
                let ms = t.ms(st.tsc_end.wrapping_sub(st.tsc_start));
                let work = t.ms(st.tsc_end.wrapping_sub(t.workload_start(st.tsc_start)));
                let started = match t.tsc_offset {
                    Some(off) => format!(
                        ", first instruction {:.3} ms after start",
                        t.ms(st
                            .tsc_start
                            .wrapping_sub(off as u64)
                            .wrapping_sub(t.start_tsc))
                    ),
                    None => String::new(),
                };
                // Lateness per vCPU only with `-v` (else one line, when it explains a loss).
                let behind = match self.behind(work) {
                    Some((behind, schedule)) if self.verbose => format!(
                        ", {behind:.1} ms behind its --rate schedule of {schedule:.1} ms (held off its core: a pacing guest catches up at most {} µs, then goes on at --rate)",
                        hyptrace_abi::guest::PACE_MAX_LAG_US
                    ),
                    _ => String::new(),
                };
                format!("finished in {ms:.3} ms{started}{behind}")
            }
            VcpuOutcome::Panicked(msg) => {
                format!("guest panicked: {}", hyptrace_output::escape_guest_str(msg))
            }
            VcpuOutcome::Faulted(msg) => {
                format!("guest crashed: {}", hyptrace_output::escape_guest_str(msg))
            }
            VcpuOutcome::Stopped => "stopped".to_string(),
            VcpuOutcome::Error(msg) => format!("error: {msg}"),
        };
        writeln!(f, "hyptrace: vcpu {id}: {outcome}")
    }

    /// The last line of the summary: totals (saturating: a hostile guest's counters can
    /// be anything) and where the events went.
    fn fmt_totals(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.cpus;
        let read = sat_sum(r.iter().map(|r| r.stats.read));
        let lost = sat_sum(r.iter().map(|r| r.stats.lost));
        let written = sat_sum(r.iter().map(|r| r.written));
        let secs = self.timing.wall.as_secs_f64();
        let mb = sat_sum(r.iter().map(|r| r.stats.bytes)) as f64 / 1e6;
        let overrun = sat_sum(r.iter().map(|r| r.stats.overrun));
        let dropped = sat_sum(r.iter().map(|r| r.stats.dropped));
        let n = self.outcomes.len();
        // After a failure the reading stopped with events unread (INCOMPLETE on their
        // CPUs): counted here, so the line is true arithmetic.
        let unread = sat_sum(r.iter().map(|r| {
            r.written
                .saturating_sub(r.stats.read.saturating_add(r.stats.lost))
        }));
        let unread = if self.failures.any() && unread > 0 {
            format!(" + unread {unread}")
        } else {
            String::new()
        };
        let to = match &self.destination {
            Destination::Stdout { lines } => {
                format!("{lines} line{} printed", if *lines == 1 { "" } else { "s" })
            }
            Destination::File { path, .. } if self.failures.output_failed() => {
                format!("{} not written", shown_path(path))
            }
            Destination::File { path, format }
                if path.as_os_str() == "-" && hyptrace_output::stdout_closed() =>
            {
                format!(
                    "stdout closed early: {} output incomplete",
                    format_name(*format)
                )
            }
            Destination::File { path, format } => {
                format!("{} written to {}", format_name(*format), shown_path(path))
            }
            Destination::Sink => "pages handed to the sink".to_string(),
        };
        write!(
            f,
            "hyptrace: {n} vCPU{}: written {written} = read {read} + lost {lost}{unread} (overrun {overrun}, dropped {dropped}); {secs:.3} s, {mb:.1} MB of events ({:.1} MB/s), {to}",
            if n == 1 { "" } else { "s" },
            if secs > 0.0 { mb / secs } else { 0.0 },
        )
    }

    /// Event bytes per second one vCPU offered its ring, the busiest one: its committed
    /// bytes scaled to every event it wrote (dropped ones too) over the run's wall time.
    /// Guest numbers: computed in floating point, never overflowing.
    fn offered_rate(&self) -> f64 {
        let secs = self.timing.wall.as_secs_f64();
        if secs <= 0.0 {
            return 0.0;
        }
        self.cpus
            .iter()
            .map(|c| {
                let committed = c.written.saturating_sub(c.stats.dropped);
                if committed == 0 {
                    return 0.0;
                }
                c.stats.bytes as f64 / committed as f64 * c.written as f64 / secs
            })
            .fold(0.0, f64::max)
    }

    /// Why a live reader lost events, from what it measured of itself: it waited for
    /// the output to take pages (the output is slower than the guest writes), or it
    /// was held off its core longer than half of what a ring lasts at this run's rate.
    /// Facts with the option that helps, one line each; none when the reader kept no
    /// record (`--drain none`) or neither happened.
    fn loss_causes(&self) -> Vec<String> {
        let r = &self.timing.reader;
        let mut out = Vec::new();
        if !r.live {
            return out;
        }
        let rate = self.offered_rate();
        let w = &r.output_waits;
        if w.count > 0 {
            out.push(format!(
                "the reader waited {:.1} ms for the output to take pages ({} time{}, the longest {:.1} ms): the output was slower than the guest wrote ({:.0} MB/s of events on the busiest vCPU); write to a faster file system or lower --rate",
                ms(w.total),
                w.count,
                if w.count == 1 { "" } else { "s" },
                ms(w.longest),
                rate / 1e6,
            ));
        }
        if rate > 0.0 && r.ring_bytes > 0 {
            let lasts = r.ring_bytes as f64 / rate;
            let late = r.longest_late.as_secs_f64();
            if late > lasts / 2.0 {
                // A ring that lasts twice the longest absence, in the option's units
                // (rounded up to a power of two KiB).
                // Guest numbers: a hostile `bytes` makes this huge, never a panic.
                let want = ((r.buffer_kb as f64 * 2.0 * late / lasts).ceil() as u64)
                    .max(1)
                    .checked_next_power_of_two()
                    .unwrap_or(u64::MAX);
                out.push(format!(
                    "the reader thread was held off its core for up to {:.1} ms, while a {} KiB ring lasts {:.1} ms at this run's rate: --buffer-kb {} holds twice that",
                    late * 1e3,
                    r.buffer_kb,
                    lasts * 1e3,
                    want,
                ));
            }
        }
        out
    }

    /// The summary proper: a line per vCPU's outcome and one per CPU's counters, then
    /// the totals (no newline after them).
    pub fn summary(&self) -> Summary<'_> {
        Summary(self)
    }

    /// The `--stats` JSON (pretty, keys in alphabetical order, ending in a newline),
    /// with the run's exit code `code`.
    pub fn stats_json(&self, code: i32) -> String {
        let stats = Stats::new(self, code);
        let mut s = serde_json::to_string_pretty(&stats).unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    }
}

/// The summary lines of a [`RunReport`] (see [`RunReport::summary`]).
pub struct Summary<'a>(&'a RunReport);

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.0;
        let failed = r.failures.any();
        for (id, o) in r.outcomes.iter().enumerate() {
            r.fmt_outcome(f, id, o)?;
            if let Some(c) = r.cpus.get(id) {
                c.fmt_line(f, id, failed)?;
            }
        }
        r.fmt_totals(f)
    }
}

/// Everything a run says on stderr at its end, in order: how it stopped, the summary,
/// the hint about lost events, the accounting mismatch, then the failures (the last
/// lines). Each line ends in a newline.
impl fmt::Display for RunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.stop {
            Some(Stop::Failed(_)) | None => {}
            Some(r) => writeln!(f, "hyptrace: stopped: {r}")?,
        }
        writeln!(f, "{}", self.summary())?;
        if let Some(h) = &self.host_trace {
            writeln!(
                f,
                "hyptrace: host trace: {} host CPUs (output CPUs {}..{}): read {} events in {} pages, lost {} (+{} pages with an unknown count; kernel overrun {}, dropped {})",
                h.cpus,
                h.first_cpu,
                h.first_cpu + h.cpus,
                h.events,
                h.pages,
                h.lost,
                h.lost_pages_unknown,
                h.overrun,
                h.dropped
            )?;
        }
        if self.failures.output_failed() {
            // The output's failure is the cause of what was lost or left unread, not
            // the ring size or the rate.
            if self
                .cpus
                .iter()
                .any(|r| r.stats.lost > 0 || !r.consistent())
            {
                writeln!(f, "hyptrace: hint: events were lost or left unread because the output failed (below): fix the output (space, permissions, reader) and record again")?;
            }
        } else if self.cpus.iter().any(|r| r.stats.lost > 0) {
            writeln!(f, "hyptrace: hint: {}", loss_hint(self.mode))?;
            for why in self.loss_causes().into_iter().chain(self.lateness_hint()) {
                writeln!(f, "hyptrace: hint: {why}")?;
            }
        }
        let failed = self.failures.any();
        if self
            .cpus
            .iter()
            .any(|r| r.flag(failed).contains("MISMATCH"))
        {
            writeln!(f, "hyptrace: error: accounting mismatch on a vCPU marked MISMATCH: written != read + lost, lost != overrun + dropped, or written != attempted - skipped")?;
        }
        for (cpu, r) in self.cpus.iter().enumerate() {
            if let Some(p) = &r.attempts_problem {
                writeln!(f, "hyptrace: error: cpu {cpu}: {p}")?;
            }
        }
        self.failures.fmt_lines(f, &self.destination)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn report(cpus: Vec<CpuReport>, outcomes: Vec<VcpuOutcome>) -> RunReport {
        RunReport {
            outcomes,
            cpus,
            timing: Timing {
                tsc_khz: 1_000_000,
                wall: Duration::from_secs(1),
                ..Default::default()
            },
            stop: None,
            failures: Failures::default(),
            destination: Destination::Stdout { lines: 0 },
            echo: OptionsEcho {
                workload: "steady".into(),
                mode: "overwrite".into(),
                swap: "host".into(),
                vcpus: 2,
                events: 10,
                rate: 0,
            },
            mode: ModeArg::Overwrite,
            guest: None,
            clock: None,
            host_events: None,
            host_trace: None,
            verbose: true,
        }
    }

    /// A paced vCPU that ended later than its `--rate` schedule says how much; one on
    /// schedule, an unpaced one and a burst workload say nothing.
    #[test]
    fn a_paced_vcpu_behind_its_schedule_says_so() {
        let fin = |ms: u64| {
            VcpuOutcome::Finished(crate::vmm::vcpu::VcpuStats {
                tsc_start: 5,
                tsc_end: 5 + ms * 1_000_000,
                mailbox_served: 0,
            })
        };
        let line = |workload: &str, rate: u64, ms: u64| {
            let mut r = report(Vec::new(), vec![fin(ms)]);
            r.echo.workload = workload.into();
            r.echo.rate = rate;
            r.summary().to_string()
        };
        // 10 events at 1000/s: a 10 ms schedule.
        let late = line("steady", 1000, 13);
        assert!(
            late.contains("finished in 13.000 ms, 3.0 ms behind its --rate schedule of 10.0 ms"),
            "{late}"
        );
        assert!(late.contains("catches up at most 200 µs"), "{late}");
        assert!(line("mixed", 1000, 13).contains("3.0 ms behind"));
        for (workload, rate, ms) in [
            ("steady", 1000, 10),
            ("steady", 1000, 11),
            ("steady", 0, 50),
            ("burst", 1000, 50),
        ] {
            let text = line(workload, rate, ms);
            assert!(!text.contains("behind"), "{workload} {rate} {ms}: {text}");
        }
    }

    /// The wait for the registration's answer — the run holds it until it reads, which
    /// took 3–4 ms of every short run — is no lateness: the schedule is counted from the
    /// answer. (Every `run --vcpus 2 --events 10` said "held off its core" before.)
    #[test]
    fn the_wait_for_the_registration_answer_is_not_lateness() {
        let (tsc_start, answered) = (5u64, 4_000_005u64); // the answer 4 ms after entry
        let fin = VcpuOutcome::Finished(crate::vmm::vcpu::VcpuStats {
            tsc_start,
            tsc_end: answered + 10_500_000, // 10.5 ms after the answer
            mailbox_served: 0,
        });
        let mut r = report(Vec::new(), vec![fin]);
        r.echo.rate = 1000; // 10 events: a 10 ms schedule
        let late = r.summary().to_string();
        assert!(late.contains("4.5 ms behind"), "without the answer: {late}");
        r.timing.answered_tsc = Some(answered + 7); // host TSC; guest = host - 7
        r.timing.tsc_offset = Some(-7);
        let text = r.summary().to_string();
        assert!(text.contains("finished in 14.500 ms"), "{text}");
        assert!(!text.contains("behind"), "{text}");
        // 2 ms late after the answer is late.
        r.timing.answered_tsc = Some(answered + 7 - 2_000_000);
        let text = r.summary().to_string();
        assert!(text.contains("2.5 ms behind"), "{text}");
        // An answer before the vCPU entered changes nothing.
        assert_eq!(r.timing.workload_start(answered), answered);
    }

    /// Issue 26: lateness is one hint line, only when a CPU lost events; each vCPU's
    /// with `-v`; never a "0.0 ms" schedule (a run too short to have one).
    #[test]
    fn lateness_is_one_hint_and_only_with_a_loss() {
        let late = VcpuOutcome::Finished(crate::vmm::vcpu::VcpuStats {
            tsc_start: 5,
            tsc_end: 5 + 13_000_000, // 13 ms: 3 ms behind a 10 ms schedule
            mailbox_served: 0,
        });
        let cpu = |lost: u64| CpuReport {
            finished: true,
            attempted: Some(10),
            skipped: Some(0),
            attempts_problem: None,
            written: 10,
            stats: hyptrace_reader::CpuStats {
                written: 10,
                read: 10 - lost,
                overrun: lost,
                lost,
                ..Default::default()
            },
            error: None,
            page_events: 510,
        };
        let run = |lost: u64, verbose: bool| {
            let mut r = report(vec![cpu(0), cpu(lost)], vec![late.clone(), late.clone()]);
            r.echo.rate = 1000; // 10 events: a 10 ms schedule
            r.verbose = verbose;
            r.to_string()
        };
        let quiet = run(0, false);
        assert!(!quiet.contains("behind"), "a loss-free run: {quiet}");
        let lossy = run(2, false);
        let lines: Vec<&str> = lossy.lines().filter(|l| l.contains("behind")).collect();
        assert_eq!(
            lines,
            ["hyptrace: hint: 2 of 2 vCPUs ran behind their --rate schedule (up to 3.0 ms): held off their cores (a pacing guest catches up at most 200 µs), the reader likely was too; -v shows each"],
            "{lossy}"
        );
        let verbose = run(0, true);
        assert_eq!(
            verbose
                .matches("3.0 ms behind its --rate schedule of 10.0 ms")
                .count(),
            2,
            "{verbose}"
        );
        assert!(!verbose.contains("hint"), "{verbose}");
        // 1 event at 1 000 000/s: a 1 µs schedule is none to show.
        let mut r = report(vec![cpu(2)], vec![late.clone()]);
        r.echo.events = 1;
        r.echo.rate = 1_000_000;
        let text = r.to_string();
        assert!(
            !text.contains("behind") && !text.contains("0.0 ms"),
            "{text}"
        );
    }

    /// Issue 8 defect 4: guest counters at the top of u64 made the summary's sums
    /// overflow (a panic in debug builds, wrapped garbage in release builds).
    #[test]
    fn summary_of_hostile_counters_saturates() {
        let hostile = hyptrace_reader::CpuStats {
            written: u64::MAX,
            read: 3,
            overrun: u64::MAX,
            dropped: u64::MAX,
            lost: u64::MAX - 3,
            pages_touched: u64::MAX,
            bytes: u64::MAX,
            ..Default::default()
        };
        let cpu = CpuReport {
            finished: true,
            attempted: Some(u64::MAX),
            skipped: Some(u64::MAX),
            attempts_problem: None,
            written: u64::MAX,
            stats: hostile,
            error: None,
            page_events: 510,
        };
        // read + lost == written per CPU, but overrun + dropped overflows.
        assert!(!cpu.consistent());
        let r = report(
            vec![cpu.clone(), cpu],
            vec![VcpuOutcome::Stopped, VcpuOutcome::Stopped],
        );
        let text = r.summary().to_string();
        let m = u64::MAX;
        assert!(
            text.contains(&format!("written {m} = read 6 + lost {m}")),
            "{text}"
        );
        // The whole report too (the loss hint and the mismatch line).
        let all = r.to_string();
        assert!(all.contains("hint:") && all.contains("MISMATCH"), "{all}");
        assert_eq!(r.exit_code(), EXIT_RUNTIME);
    }

    /// R1's one exemption: a writer that did not finish may have counted one page's
    /// events as overrun that the reader read — at most one page's, and named; past a
    /// page, the other way round, or for a writer that finished, it is a mismatch.
    #[test]
    fn overrun_ahead_is_bounded_and_named() {
        let cpu = |finished: bool, overrun: u64, lost: u64| CpuReport {
            finished,
            attempted: Some(1000),
            skipped: Some(0),
            attempts_problem: None,
            written: 1000,
            stats: hyptrace_reader::CpuStats {
                written: 1000,
                read: 1000 - lost,
                overrun,
                lost,
                ..Default::default()
            },
            error: None,
            page_events: 510,
        };
        let ahead = cpu(false, 300 + 510, 300);
        assert!(ahead.consistent());
        assert_eq!(ahead.overrun_ahead(), Some(510));
        assert!(
            ahead.flag(false).contains("overrun counts 510 events read"),
            "{}",
            ahead.flag(false)
        );
        for bad in [
            cpu(false, 300 + 511, 300),
            cpu(false, 299, 300),
            cpu(true, 301, 300),
        ] {
            assert!(!bad.consistent(), "{:?}", bad.stats);
            assert!(bad.flag(false).contains("MISMATCH"));
        }
        assert!(cpu(true, 300, 300).flag(false).is_empty());
    }

    #[test]
    fn crash_detail() {
        let f = VcpuOutcome::Faulted("triple fault (rip 0x1f00a, rsp 0x10)".into());
        let c = CrashStats::new(1, &f).expect("crash");
        let v = serde_json::to_value(&c).expect("json");
        assert_eq!(v["rip"], "0x1f00a");
        assert_eq!(v["kind"], "fault");
        assert_eq!(v["cpu"], 1);
        let p = VcpuOutcome::Panicked("boom \"quoted\"\x07".into());
        let c = CrashStats::new(0, &p).expect("crash");
        let v = serde_json::to_value(&c).expect("json");
        assert_eq!(v["message"], "boom \"quoted\"\x07");
        assert!(v["rip"].is_null());
        let text = serde_json::to_string(&v).expect("json");
        assert!(
            text.contains("\\u0007") && text.contains("\\\"quoted"),
            "{text}"
        );
        assert!(CrashStats::new(0, &VcpuOutcome::Stopped).is_none());
    }

    /// The stats JSON keeps the keys and their (alphabetical) order of the `json!`
    /// document it replaced.
    #[test]
    fn stats_keys_in_order() {
        let r = report(vec![CpuReport::default()], vec![VcpuOutcome::Stopped]);
        let s = r.stats_json(0);
        let keys: Vec<&str> = s
            .lines()
            .filter(|l| l.starts_with("  \"") || l.starts_with("      \""))
            .map(|l| l.trim().split('"').nth(1).unwrap_or(""))
            .collect();
        let want = [
            "clock",
            "cpus",
            "attempted",
            "attempts_problem",
            "bytes",
            "cpu",
            "crash",
            "dropped",
            "error",
            "lost",
            "outcome",
            "overrun",
            "pages_read",
            "pages_touched",
            "read",
            "skipped",
            "swaps",
            "written",
            "crash",
            "end",
            "events_per_vcpu",
            "exit_code",
            "guest_exit",
            "mode",
            "rate",
            "reader",
            "stop_reason",
            "swap",
            "tsc_khz",
            "vcpus",
            "wall_seconds",
            "workload",
        ];
        assert_eq!(keys, want, "{s}");
        assert!(s.ends_with("}\n"));
    }

    /// A lossy stop-mode run of one vCPU: 1 000 000 events of 100 bytes offered over
    /// 1 s (100 MB/s), 1 000 of them dropped; a ring of 1 024 KiB that holds 1 MB of
    /// events, so it lasts 10 ms at that rate.
    fn lossy(reader: ReaderTimes) -> RunReport {
        let cpu = CpuReport {
            finished: true,
            attempted: Some(1_000_000),
            skipped: Some(0),
            attempts_problem: None,
            written: 1_000_000,
            stats: hyptrace_reader::CpuStats {
                written: 1_000_000,
                read: 999_000,
                dropped: 1_000,
                lost: 1_000,
                bytes: 999_000 * 100,
                ..Default::default()
            },
            error: None,
            page_events: 510,
        };
        let mut r = report(vec![cpu], vec![VcpuOutcome::Finished(Default::default())]);
        r.mode = ModeArg::Stop;
        r.timing.reader = ReaderTimes {
            buffer_kb: 1024,
            ring_bytes: 1_000_000,
            ..reader
        };
        r
    }

    fn hints(r: &RunReport) -> Vec<String> {
        r.to_string()
            .lines()
            .filter_map(|l| l.strip_prefix("hyptrace: hint: "))
            .map(str::to_string)
            .collect()
    }

    /// A live reader that lost events says why: its waits for the output, and an
    /// absence from its core longer than half of what the ring lasts, with the
    /// --buffer-kb that holds twice that absence (a power of two KiB).
    #[test]
    fn loss_causes_name_the_output_and_the_absence() {
        let mut waits = hyptrace_output::OutputWaits::default();
        waits.add(Duration::from_millis(30));
        waits.add(Duration::from_millis(12));
        let r = lossy(ReaderTimes {
            live: true,
            longest_late: Duration::from_millis(12),
            output_waits: waits,
            standby: crate::drain::standby::StandbyTimes {
                turns: 3,
                rounds: 5,
                cpu: Duration::from_micros(1500),
            },
            ..Default::default()
        });
        let h = hints(&r);
        assert_eq!(h.len(), 3, "{h:?}");
        assert!(h[0].contains("raise --buffer-kb"), "{h:?}");
        assert!(
            h[1].starts_with("the reader waited 42.0 ms for the output to take pages (2 times, the longest 30.0 ms)")
                && h[1].contains("(100 MB/s of events"),
            "{h:?}"
        );
        // 12 ms away, the ring lasts 10 ms: 2 × 12 / 10 × 1024 KiB = 2458 → 4096.
        assert!(
            h[2].contains("up to 12.0 ms, while a 1024 KiB ring lasts 10.0 ms")
                && h[2].ends_with("--buffer-kb 4096 holds twice that"),
            "{h:?}"
        );
        let v: serde_json::Value = serde_json::from_str(&r.stats_json(0)).expect("json");
        assert_eq!(v["reader"]["output_waits"], 2);
        assert_eq!(v["reader"]["output_wait_longest_ms"], 30.0);
        assert_eq!(v["reader"]["standby_turns"], 3);
        assert_eq!(v["reader"]["standby_cpu_ms"], 1.5);
    }

    /// No cause is named without a live reader (`--drain none`: the ring was read at
    /// the end), nor when the reader neither waited nor was away for long.
    #[test]
    fn loss_causes_only_from_what_a_live_reader_saw() {
        let away = ReaderTimes {
            longest_late: Duration::from_millis(50),
            ..Default::default()
        };
        let r = lossy(away);
        assert_eq!(hints(&r).len(), 1, "{:?}", hints(&r));
        assert!(
            serde_json::from_str::<serde_json::Value>(&r.stats_json(0)).expect("json")["reader"]
                .is_null()
        );
        let r = lossy(ReaderTimes {
            live: true,
            longest_late: Duration::from_millis(4),
            ..Default::default()
        });
        assert_eq!(hints(&r).len(), 1, "{:?}", hints(&r));
        // Hostile counters: a guest claiming u64::MAX bytes gets an absurd suggestion,
        // not a panic (debug builds check the arithmetic).
        let mut r = lossy(ReaderTimes {
            live: true,
            longest_late: Duration::from_secs(3600),
            ..Default::default()
        });
        r.cpus[0].stats.bytes = u64::MAX;
        r.cpus[0].written = u64::MAX;
        let h = hints(&r);
        assert!(h.iter().any(|l| l.contains("holds twice that")), "{h:?}");
    }
}
