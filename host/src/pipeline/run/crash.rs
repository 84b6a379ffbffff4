//! A crash or hang of a run: the hang watch (`--hang-timeout`) and the crash dump
//! (`--crash-dump`), taken before any final walk consumes the rings.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::pipeline::report::Stop;

use super::live::{locked, Live};

impl Live<'_> {
    /// `--hang-timeout`: whether no vCPU made progress for that long. Progress is a
    /// change of any CPU's writer index (`entries + dropped` in its control block: an
    /// event committed or dropped) or of the number of vCPUs that exited.
    pub(super) fn hung(&mut self) -> Option<Duration> {
        let h = self.flight.hang.as_mut()?;
        let session = locked(&self.session);
        let reader = session.reader();
        let index = (0..self.nr).fold(0u64, |a, c| a.wrapping_add(reader.writer_index(c)));
        let exited = (0..self.nr)
            .filter(|&c| self.running.vcpu_finished(c))
            .count();
        if exited == self.nr as usize {
            return None;
        }
        let now = (index, exited);
        if h.last != Some(now) {
            h.last = Some(now);
            h.since = Instant::now();
            return None;
        }
        (h.since.elapsed() >= h.timeout).then_some(h.timeout)
    }

    /// A crash or hang: the vCPUs are stopped (waited for, bounded); every CPU's
    /// committed, unconsumed events are dumped read-only (no swaps) to `--crash-dump`
    /// if there is one; the reason and the last event per vCPU go to stderr. Runs once,
    /// before any final walk consumes the rings.
    pub(super) fn crash_dump(&mut self) {
        if std::mem::replace(&mut self.flight.dumped, true) {
            return;
        }
        let t0 = Instant::now();
        // The vCPUs leave KVM_RUN at the kick; a vCPU thread that does not end within
        // the bound is dumped anyway (reads are atomics and copies: safe, less exact).
        while !self.running.wait_timeout(Duration::from_millis(20))
            && t0.elapsed() < Duration::from_secs(5)
        {}
        let reason = match &self.stop {
            Some(Stop::Hang(_)) => self.stop.as_ref().map(ToString::to_string),
            _ => self.running.crash_reason(),
        }
        .unwrap_or_else(|| "a vCPU crashed".into());
        note!("hyptrace: guest crashed: {reason}");
        let session = locked(&self.session);
        let reader = session.reader();
        let session = &*session;
        let target = self.flight.dump_target.as_ref().map(|(t, f, _)| (t, *f));
        let (report, err) = crate::flight::dump::write_crash_dump(
            &**reader.mem(),
            reader.layout(),
            &|c| reader.position(c),
            &|c| session.is_live(c),
            &self.flight.run_meta.clock,
            &self.flight.run_meta.formats,
            target,
        );
        let _ = std::io::stderr().write_all(
            report
                .last_events(&self.flight.run_meta.clock, &self.flight.run_meta.formats)
                .as_bytes(),
        );
        if let Some((_, _, path)) = &self.flight.dump_target {
            match err {
                None => note!(
                    "hyptrace: crash dump: {} events ({} lost before them) written to {} in {:.1} ms",
                    report.events(),
                    report.cpus.iter().map(|c| c.lost).fold(0, u64::saturating_add),
                    crate::drain::sink::shown_path(path),
                    t0.elapsed().as_secs_f64() * 1e3
                ),
                Some(e) => self.failures.other(format!(
                    "writing the crash dump {}: {}",
                    path.display(),
                    crate::exit::chain(&e)
                )),
            }
            for c in &report.cpus {
                for w in &c.warnings {
                    note!("hyptrace: crash dump: warning: {w}");
                }
            }
        }
    }
}
