//! `hyptrace bench report --input FILE`: `hyptrace report FILE` against `trace-cmd
//! report -t FILE`, side by side in one run, both writing to /dev/null as child
//! processes (start-up included), alternating, each repeated; medians of wall time and
//! CPU time (user + sys), events/s and the ratio, and each one's peak RSS (from
//! `wait4`'s rusage).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::exit::{EXIT_RUNTIME, EXIT_USAGE};

/// Why `hyptrace bench report` failed.
#[derive(Debug, thiserror::Error)]
pub enum ReportBenchError {
    /// The input trace cannot be read (exit 2).
    #[error(transparent)]
    Input(hyptrace_output::DatError),
    /// This program's own path is unknown.
    #[error("cannot find this program")]
    CurrentExe(#[source] std::io::Error),
    /// A child could not be started.
    #[error("{0}")]
    Spawn(String, #[source] std::io::Error),
    /// Waiting for a child failed.
    #[error("{0}: wait4")]
    Wait(String, #[source] std::io::Error),
    /// A child did not exit 0.
    #[error("{0} failed (status {1:#x})")]
    Failed(String, i32),
}

impl ReportBenchError {
    /// 2 for an unreadable input, else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Input(_) => EXIT_USAGE,
            _ => EXIT_RUNTIME,
        }
    }
}

/// One timed run of a child.
#[derive(Clone, Copy, Debug)]
struct Sample {
    wall: f64,
    cpu: f64,
    rss_kb: i64,
}

/// Runs `cmd` with stdout and stderr on /dev/null; its wall time, CPU time and peak RSS.
fn timed(cmd: &mut Command) -> Result<Sample, ReportBenchError> {
    let t0 = Instant::now();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| ReportBenchError::Spawn(format!("{cmd:?}"), e))?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // Reap the child ourselves (std's Child is not waited on after this; dropping it
    // does not wait). EINTR is retried; the loop ends when the child is reaped.
    loop {
        // SAFETY: `pid` is our child; `status` and `ru` are valid for writes.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(ReportBenchError::Wait(format!("{cmd:?}"), e));
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    drop(child);
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Err(ReportBenchError::Failed(format!("{cmd:?}"), status));
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(Sample {
        wall,
        cpu: tv(ru.ru_utime) + tv(ru.ru_stime),
        rss_kb: ru.ru_maxrss,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The events `hyptrace report` prints for `path` (drop markers not counted).
fn count_events(path: &Path) -> Result<u64, ReportBenchError> {
    let f = hyptrace_output::TraceFile::open(path).map_err(ReportBenchError::Input)?;
    let mut n = 0u64;
    let mut r = f.records();
    while let Some(i) = r.next_item() {
        n += u64::from(matches!(i, hyptrace_output::TraceItem::Event(_)));
    }
    match r.take_error() {
        Some(e) => Err(ReportBenchError::Input(e)),
        None => Ok(n),
    }
}

/// What `hyptrace bench report` compares: `input` read by both, `reps` times each, with
/// the `trace_cmd` program.
#[derive(Clone, Debug)]
pub struct ReportBench<'a> {
    /// The trace.dat both read.
    pub input: &'a Path,
    /// Repetitions of each command.
    pub reps: u32,
    /// The trace-cmd to compare with.
    pub trace_cmd: &'a Path,
}

/// `hyptrace bench report`.
pub fn bench_report(a: &ReportBench<'_>) -> Result<(), ReportBenchError> {
    run(a)
}

fn run(a: &ReportBench<'_>) -> Result<(), ReportBenchError> {
    let events = count_events(a.input)?;
    let me = std::env::current_exe().map_err(ReportBenchError::CurrentExe)?;
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for rep in 0..a.reps {
        let mut tc = Command::new(a.trace_cmd);
        tc.arg("report").arg("-t").arg(a.input);
        let mut hy = Command::new(&me);
        hy.arg("report").arg(a.input);
        // Alternate which goes first: a load change hits both alike.
        if rep % 2 == 0 {
            theirs.push(timed(&mut tc)?);
            ours.push(timed(&mut hy)?);
        } else {
            ours.push(timed(&mut hy)?);
            theirs.push(timed(&mut tc)?);
        }
    }
    let summary = |s: &[Sample]| {
        (
            median(s.iter().map(|x| x.wall).collect()),
            median(s.iter().map(|x| x.cpu).collect()),
            s.iter().map(|x| x.rss_kb).max().unwrap_or(0),
        )
    };
    let (tw, tcpu, trss) = summary(&theirs);
    let (hw, hcpu, hrss) = summary(&ours);
    let rate = |t: f64| if t > 0.0 { events as f64 / t } else { 0.0 };
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    println!(
        "report of {} ({events} events), median of {} runs each, output to /dev/null:",
        a.input.display(),
        a.reps
    );
    println!(
        "  {:<26} {:>9} {:>13} {:>9} {:>13} {:>10}",
        "", "wall s", "events/s", "cpu s", "events/cpu-s", "peak RSS"
    );
    for (name, w, c, rss) in [
        ("trace-cmd report -t", tw, tcpu, trss),
        ("hyptrace report", hw, hcpu, hrss),
    ] {
        println!(
            "  {name:<26} {w:>9.3} {:>13.0} {c:>9.3} {:>13.0} {:>7} MB",
            rate(w),
            rate(c),
            rss / 1024
        );
    }
    println!(
        "  hyptrace / trace-cmd: {:.2}x events/s (wall), {:.2}x events/cpu-s",
        ratio(tw, hw),
        ratio(tcpu, hcpu)
    );
    Ok(())
}
