//! The summary a run prints on stderr at its end: how it stopped, a line per vCPU and
//! per CPU, the totals, the hints about lost events and lateness, the failures.

use std::fmt;

use crate::drain::sink::{shown_path, Format};
use crate::vmm::vcpu::VcpuOutcome;
use hyptrace_abi::layout::Mode;

use super::{ms, Destination, RunReport, Stop};

impl RunReport {
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
            Destination::File { path, format, .. }
                if path.as_os_str() == "-" && hyptrace_output::stdout_closed() =>
            {
                format!(
                    "stdout closed early: {} output incomplete",
                    format_name(*format)
                )
            }
            Destination::File { path, format, .. } => {
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
            // A regular file through the page cache: past it may keep pace (where the
            // copy into fresh page-cache memory is the slow part, docs/output.md).
            let page_cache = matches!(
                self.destination,
                Destination::File {
                    page_cache: true,
                    ..
                }
            );
            out.push(format!(
                "the reader waited {:.1} ms for the output to take pages ({} time{}, the longest {:.1} ms): the output was slower than the guest wrote ({:.0} MB/s of events on the busiest vCPU); write to a faster file system{} or at a lower --rate",
                ms(w.total),
                w.count,
                if w.count == 1 { "" } else { "s" },
                ms(w.longest),
                rate / 1e6,
                if page_cache { ", every block past the page cache (--direct-io)" } else { "" },
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
}

impl RunReport {
    /// The summary proper: a line per vCPU's outcome and one per CPU's counters, then
    /// the totals (no newline after them).
    pub fn summary(&self) -> Summary<'_> {
        Summary(self)
    }
}

/// The sum of `v`, saturating at `u64::MAX`.
pub(super) fn sat_sum(v: impl IntoIterator<Item = u64>) -> u64 {
    v.into_iter().fold(0, u64::saturating_add)
}

/// What a file of `format` is called in messages.
pub(super) fn format_name(format: Format) -> &'static str {
    match format {
        Format::Dat => "trace.dat (v7)",
        Format::Dat6 => "trace.dat (v6)",
        Format::Json => "JSON",
        Format::Perfetto => "Perfetto trace",
        Format::Text => "text",
        Format::Raw => "raw pages",
    }
}

/// What to do about lost events, for the mode that lost them.
pub(super) fn loss_hint(mode: Mode) -> &'static str {
    match mode {
        Mode::Stop => {
            "events were lost (dropped while a ring was full): raise --buffer-kb or lower --rate, or use --mode overwrite to keep the newest events"
        }
        Mode::Overwrite => {
            "events were lost (overwritten before they were read): raise --buffer-kb or lower --rate"
        }
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
        if let Destination::File {
            filter: Some(fr), ..
        } = &self.destination
        {
            writeln!(
                f,
                "hyptrace: -F kept {} of the {} events read ({} dropped by the filter, not lost)",
                fr.kept,
                fr.kept.saturating_add(fr.dropped),
                fr.dropped
            )?;
            for spec in &fr.unmatched {
                let line = format!("-F '{spec}' matched no event of the run");
                writeln!(f, "hyptrace: {}", crate::exit::printable(&line))?;
            }
        }
        if let Some(h) = &self.host_trace {
            writeln!(
                f,
                "hyptrace: host trace: {} host CPUs (output CPUs {}-{}): read {} events in {} pages, lost {} (+{} pages with an unknown count; kernel overrun {}, dropped {})",
                h.cpus,
                h.first_cpu,
                (h.first_cpu + h.cpus).saturating_sub(1),
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
