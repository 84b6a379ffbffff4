//! The `hyptrace` command line.
//!
//! Exit codes: [`EXIT_OK`] 0 (the run completed: the guest finished, or was stopped as
//! asked by `--duration` or a first Ctrl-C / SIGTERM, and every event is accounted for),
//! [`EXIT_RUNTIME`] 1 (a host-side failure), [`EXIT_USAGE`] 2 (bad input, an unusable
//! output path, no usable /dev/kvm), [`EXIT_CRASH`](crate::exit::EXIT_CRASH) 3 (the guest panicked or faulted),
//! [`EXIT_ABORT`] 130 (a second Ctrl-C aborted the run; no output file is left).
//! An error is one line on stderr, `hyptrace: error: ...` (argument errors are followed
//! by clap's hints: valid values, tips, usage).

pub mod docs;
pub mod host_events;
pub mod logging;

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use hyptrace_output::OutputError;

use crate::drain::signals::{Interrupts, SignalError};
use crate::drain::sink::{
    compression_for, format_for, write_destination, DestinationError, Format,
};
use crate::exit::{chain, EXIT_ABORT, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE};
use crate::pipeline::options::{
    self, CollectArgs, ConvertArgs, CtlArgs, ListArgs, ModeArg, RecordArgs, ReportArgs, RunArgs,
};
use crate::pipeline::plan::{Plan, PlanError};
use crate::pipeline::run::{Run, RunError, Target};

/// What the counters of the summary and of `--stats` mean (`run --help`, `record --help`).
const COUNTERS_HELP: &str = "\
Counters (per vCPU, in the summary on stderr and in --stats):
  attempted  events the guest workload tried to emit
  skipped    of those, events whose tracepoint was disabled (never reach the writer)
  written    events the writer took in: attempted - skipped. Each one was either
             committed to the ring or, in --mode stop while the ring was full, dropped
  read       events the host read from the ring (printed or recorded)
  lost       events written but never read: overrun + dropped
  overrun    committed events overwritten before the reader got them (--mode overwrite)
  dropped    events refused because the ring was full (--mode stop)
Every vCPU must satisfy written = read + lost (else MISMATCH, exit 1).

Exit status: 0 the run completed (the guest finished, or was stopped by --duration or a
first Ctrl-C/SIGTERM; --stats says which in \"end\"); 1 runtime error; 2 bad input or an
unusable output path (checked before the VM starts); 3 the guest crashed; 130 aborted by
a second Ctrl-C (temporary files removed, no output file).";

/// hyptrace: per-vCPU tracing ring buffers in guest memory, read by the host.
#[derive(Debug, Parser)]
#[command(
    name = "hyptrace",
    version,
    about = "hyptrace: per-vCPU tracing ring buffers in guest memory, written by the guest, read by the host",
    propagate_version = true
)]
pub struct Cli {
    /// Log what hyptrace does on stderr (-v: info, -vv: debug, -vvv: trace; RUST_LOG
    /// overrides, e.g. RUST_LOG=hyptrace_host=debug).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Boot the guest on KVM, run a workload on every vCPU, print every event (merged
    /// by time, as `trace-cmd report -t` prints them) and a per-CPU summary.
    #[command(after_help = COUNTERS_HELP)]
    Run(RunArgs),
    /// Like `run`, but stream the ring pages into a file: trace.dat (v7 or v6) that
    /// trace-cmd and KernelShark read, Chrome trace-event JSON, a native Perfetto trace,
    /// text, or raw pages.
    #[command(after_help = COUNTERS_HELP)]
    Record(RecordArgs),
    /// Print a trace.dat (ours or one trace-cmd wrote, v6, v7, v7 zstd) or a raw page
    /// stream (`record --format raw`) as `trace-cmd report -t` does, streaming.
    Report(ReportArgs),
    /// Boot the guest until it registers its events, print them (system, name, id,
    /// fields, print fmt, as `trace-cmd list -e -F`) and exit.
    List(ListArgs),
    /// Write the events left in a trace memory file (`--trace-mem`) — of a VMM killed,
    /// crashed or finished — to a file in any `record` format: every committed event
    /// no reader consumed, with the exact losses. With `--attach SOCKET`: read a running
    /// VMM's rings live (`--drain none --trace-mem --control`), once or `--follow`.
    Dump(crate::pipeline::options::DumpArgs),
    /// Subscribe to several running VMMs (each `run --drain none --control SOCKET`)
    /// and write one trace.dat v7 with one buffer instance per VM (or text, or Perfetto
    /// or JSON with a process per VM), every VM on host CLOCK_MONOTONIC: `trace-cmd
    /// report` names each event's VM and prints one time order. Once, or `--follow` until every VM ended. Exit 0 only when every VM's
    /// part is complete; 1 when one failed (named; the others are written); 130 after
    /// Ctrl-C (the file holds what was read). `--host-trace EVENTS`: the host kernel's
    /// events too, once, on the same clock, as the instance `host`.
    Collect(CollectArgs),
    /// Convert a trace (trace.dat v6/v7/zstd, ours or the kernel's, or a raw page
    /// stream) into any output format of `record`; a trace.dat with buffer instances
    /// (`collect`'s) into trace.dat v7 (the instances kept), text, JSON or Perfetto
    /// (each event's instance named).
    Convert(ConvertArgs),
    /// Measure the writer in the guest and natively, drain throughput, swap latency in
    /// both modes, the highest loss-free rate, each output format's throughput, sustained
    /// 60 M-event records and start-up time; print a table and optionally write JSON (see
    /// docs/benchmarks.md).
    Bench(crate::bench::BenchArgs),
    /// Send one command to a running `run`/`record --control PATH` and print the reply:
    /// `enable EVENT`, `disable EVENT`, `stats` (JSON), `list` (JSON). Exit 0 on `ok`,
    /// 1 on an `err` reply or when the socket cannot be reached, 2 on bad usage.
    Ctl(CtlArgs),
    /// Print the shell completion script for SHELL on stdout.
    ///
    /// For bash: `hyptrace completions bash >
    /// ~/.local/share/bash-completion/completions/hyptrace`; for zsh, a file `_hyptrace`
    /// in a directory of `$fpath`; for fish, `~/.config/fish/completions/hyptrace.fish`.
    Completions(CompletionsArgs),
}

/// Options of `hyptrace completions`.
#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Why a command failed, mapped to the exit code in one place ([`CliError::exit_code`]).
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The command line does not parse (clap's message and hints).
    #[error("{0}")]
    Args(String),
    /// The options of a run do not fit (a flag and its limit).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// An output path is unusable.
    #[error(transparent)]
    Destination(#[from] DestinationError),
    /// The signal handlers could not be installed.
    #[error(transparent)]
    Signals(#[from] SignalError),
    /// The run could not start, or was aborted.
    #[error(transparent)]
    Run(#[from] RunError),
    /// `--stats` could not be written.
    #[error("cannot write stats")]
    Stats(#[source] OutputError),
    /// `report`/`convert` failed.
    #[error(transparent)]
    Convert(#[from] crate::pipeline::convert::ConvertError),
    /// `report`: writing the report to stdout failed.
    #[error("writing the report")]
    ReportWrite(#[source] std::io::Error),
    /// `--control`: the socket cannot be created at the path.
    #[error(transparent)]
    Control(#[from] crate::control::server::ControlError),
    /// `ctl`: the command cannot be sent.
    #[error("ctl: {0}")]
    CtlUsage(String),
    /// `ctl`: the socket cannot be reached, or its reply is not one.
    #[error("ctl")]
    Ctl(#[source] crate::control::server::CtlError),
    /// `bench` failed.
    #[error(transparent)]
    Bench(#[from] crate::bench::BenchCmdError),
    /// `dump` failed.
    #[error(transparent)]
    Dump(#[from] crate::flight::dump::DumpCmdError),
    /// `collect` wrote no trace.
    #[error("collect")]
    Collect(#[source] crate::flight::collect::CollectError),
    /// `list`: the guest's events could not be read.
    #[error(transparent)]
    List(#[from] crate::pipeline::list::ListError),
    /// `completions`: writing the script to stdout failed.
    #[error("writing the completion script")]
    Completions(#[source] std::io::Error),
    /// `-o clickhouse://...`: a bad URL (exit 2) or a server that cannot be used.
    #[error(transparent)]
    ClickHouse(#[from] crate::drain::sink::ServerOutputError),
}

impl CliError {
    /// The exit code: 2 for bad input or environment, 130 for an abort, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Args(_)
            | Self::Plan(_)
            | Self::Destination(_)
            | Self::Control(_)
            | Self::CtlUsage(_) => EXIT_USAGE,
            Self::Run(RunError::Aborted) => EXIT_ABORT,
            Self::Run(e) if e.is_input_error() => EXIT_USAGE,
            Self::List(e) => e.exit_code(),
            Self::Dump(e) => e.exit_code(),
            Self::Bench(e) => e.exit_code(),
            Self::Signals(_)
            | Self::Collect(_)
            | Self::Run(_)
            | Self::Stats(_)
            | Self::ReportWrite(_)
            | Self::Completions(_)
            | Self::Ctl(_) => EXIT_RUNTIME,
            Self::Convert(e) => e.exit_code(),
            Self::ClickHouse(e) if e.is_usage() => EXIT_USAGE,
            Self::ClickHouse(_) => EXIT_RUNTIME,
        }
    }

    /// Says so on stderr through [`chain`] (one line naming each cause once; an abort is
    /// no error) and returns the exit code.
    fn report(&self) -> i32 {
        match self {
            Self::Run(RunError::Aborted) => note!("hyptrace: {}", chain(self)),
            // clap's lines (the error, then its hints), each escaped: they echo the
            // user's arguments.
            Self::Args(text) => {
                let lines: Vec<_> = text.lines().map(crate::exit::printable).collect();
                note!("hyptrace: error: {}", lines.join("\n"));
            }
            _ => note!("hyptrace: error: {}", chain(self)),
        }
        self.exit_code()
    }
}

/// Runs the command line of this process; returns the exit code.
pub fn main() -> i32 {
    raise_open_files_limit();
    main_with(std::env::args_os())
}

/// Raises the soft limit on open files to the hard one: every output file takes up to
/// three descriptors while it writes (the file's, its writer thread's and an `O_DIRECT`
/// one: docs/output.md), and `record --vcpus 256` to a trace.dat has a spill file per
/// vCPU beside the vCPUs' own descriptors, past a soft limit of 1024. Nothing here uses
/// `select(2)`, the one reason to keep the soft limit low (Go's runtime raises it too).
/// A failure leaves the limit as it was (a file that then cannot get its `O_DIRECT`
/// descriptor is written through the page cache).
fn raise_open_files_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into `l`, a valid rlimit of ours.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 || l.rlim_cur >= l.rlim_max {
        return;
    }
    l.rlim_cur = l.rlim_max;
    // SAFETY: setrlimit only reads `l`; raising the soft limit up to the hard one needs
    // no privilege and touches nothing else of the process.
    let _ = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) };
}

/// Runs a command line; returns the exit code.
pub fn main_with<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return args_error(&e),
    };
    crate::cli::logging::init(cli.verbose);
    let r = match cli.command {
        Command::Run(args) => run(&args),
        Command::Record(args) => record(&args),
        Command::List(args) => list(&args),
        Command::Report(args) => crate::pipeline::convert::report(&args)
            .map(|()| EXIT_OK)
            .map_err(CliError::from),
        Command::Convert(args) => crate::pipeline::convert::convert(&args)
            .map(|()| EXIT_OK)
            .map_err(CliError::from),
        Command::Bench(args) => crate::bench::bench(&args)
            .map(|()| EXIT_OK)
            .map_err(CliError::from),
        Command::Dump(args) => crate::flight::dump::dump(&args.plan()).map_err(CliError::from),
        Command::Ctl(args) => ctl(&args),
        Command::Collect(args) => collect(&args),
        Command::Completions(args) => {
            use std::io::Write as _;
            let script = docs::completions(args.shell);
            let mut out = std::io::stdout().lock();
            out.write_all(&script)
                .and_then(|()| out.flush())
                .map(|()| EXIT_OK)
                .map_err(CliError::Completions)
        }
    };
    match r {
        Ok(code) => code,
        Err(e) => e.report(),
    }
}

/// Help and version (exit 0), or a command line that does not parse (exit 2).
fn args_error(e: &clap::Error) -> i32 {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return EXIT_OK;
    }
    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        let _ = e.print();
        return EXIT_USAGE;
    }
    // clap's message whole: the error line, then its hints (valid values, tips,
    // usage), which a user needs to fix the command line.
    let text = e.render().to_string();
    let text = text.trim_end();
    let text = text.strip_prefix("error: ").unwrap_or(text);
    CliError::Args(if text.is_empty() {
        "invalid arguments".into()
    } else {
        text.into()
    })
    .report()
}

/// `hyptrace run`.
pub fn run(a: &RunArgs) -> Result<i32, CliError> {
    execute(a, None)
}

/// `hyptrace record`.
pub fn record(a: &RecordArgs) -> Result<i32, CliError> {
    if let Some(url) = a
        .output
        .to_str()
        .filter(|s| hyptrace_clickhouse::is_clickhouse_url(s))
    {
        let (url, client) = crate::drain::sink::clickhouse_output(
            url,
            a.format.is_some() || a.compression.is_some(),
        )?;
        return execute(
            &a.run,
            Some(RecordOut::ClickHouse(url, client, &a.filters.filter[..])),
        );
    }
    let format = format_for(options::format(a.format), &a.output, "-o")?;
    let compression = compression_for(format, a.compression.map(Into::into))
        .map_err(|e| CliError::Args(e.to_string()))?;
    execute(
        &a.run,
        Some(RecordOut::File(
            &a.output,
            format,
            compression,
            &a.filters.filter[..],
        )),
    )
}

/// Where `record` writes.
enum RecordOut<'a> {
    /// A file: its path, format, compression and `-F` filters.
    File(
        &'a PathBuf,
        Format,
        hyptrace_output::Compression,
        &'a [String],
    ),
    /// A ClickHouse server, reached, and the `-F` filters.
    ClickHouse(
        hyptrace_clickhouse::ClickHouseUrl,
        hyptrace_clickhouse::Client,
        &'a [String],
    ),
}

/// `hyptrace list`: the guest's registered events on stdout, its rejected entries as
/// warnings on stderr.
pub fn list(a: &ListArgs) -> Result<i32, CliError> {
    let plan = Plan::new(&RunArgs {
        vcpus: 1,
        events: 0,
        guest: a.guest.clone(),
        ..RunArgs::default()
    })?;
    let (events, rejected) = crate::pipeline::list::list_guest(plan)?;
    for r in rejected {
        note!("hyptrace: warning: {r}");
    }
    let mut text = String::new();
    for e in &events {
        text.push_str(&format!("system: {}\n", e.reg.system));
        text.push_str(&crate::vmm::registration::to_format(&e.reg).to_format_text());
        text.push('\n');
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(CliError::ReportWrite(e)),
        _ => Ok(EXIT_OK),
    }
}

/// `hyptrace collect`: follows every VM, writes one trace, prints the accounting per
/// VM per CPU on stderr; the exit code says whether every VM's part is complete.
pub fn collect(a: &CollectArgs) -> Result<i32, CliError> {
    use crate::flight::collect::{parse_vms, CollectOpts};
    let vms = parse_vms(&a.vms).map_err(CliError::Args)?;
    let url = a
        .output
        .to_str()
        .filter(|u| hyptrace_clickhouse::is_clickhouse_url(u));
    let host_spec = crate::drain::host_trace::HostTraceSpec::parse(&a.host_trace, true);
    if let Some(spec) = &host_spec {
        collect_host_args(spec, &vms, url.is_some())?;
    }
    let ch = url
        .map(|u| crate::drain::sink::clickhouse_output(u, a.format.is_some()))
        .transpose()?;
    let (format, target) = match &ch {
        // The parts are kept in the system's temporary directory, then stored.
        Some(_) => (Format::Dat, hyptrace_output::OutputTarget::stdout()),
        None => {
            let format = format_for(options::format(a.format), &a.output, "-o")?;
            if !matches!(
                format,
                Format::Dat | Format::Text | Format::Json | Format::Perfetto
            ) {
                return Err(CliError::Args(format!(
                    "-o {}: collect writes trace.dat v7, text, JSON or Perfetto (.dat, .txt, .json, .pftrace, --format dat|text|json|perfetto), or rows of a ClickHouse server (clickhouse://...)",
                    crate::drain::sink::shown_path(&a.output)
                )));
            }
            (format, a.files.check(&a.output, "-o")?)
        }
    };
    // tracefs checked, the instance made (exit 2 when it cannot work), before any VM is
    // subscribed to.
    let host = host_spec
        .map(|spec| {
            use crate::drain::host_trace::{tracefs_root, HostTrace, TraceClock};
            HostTrace::prepare(&tracefs_root(), &spec, TraceClock::Mono)
                .map_err(|e| CliError::Run(RunError::HostTrace(e)))
        })
        .transpose()?;
    let interrupts = Interrupts::install()?;
    let stop = || interrupts.stop_requested();
    let started = std::time::Instant::now();
    let o = CollectOpts {
        vms: &vms,
        follow: a.follow,
        format,
        target: &target,
        out_path: &a.output,
        stop: &stop,
        interrupts: Some(interrupts),
        clickhouse: ch.as_ref().map(|(u, c)| (u, c)),
    };
    let report = crate::flight::collect::collect(&o, host).map_err(CliError::Collect)?;
    for l in report.lines() {
        note!("hyptrace: collect: {l}");
    }
    let done = report.vms.iter().filter(|v| v.complete).count();
    let host = match &report.host {
        Some(h) if h.complete() && !report.interrupted => ", the host's events complete",
        Some(_) => ", the host's events INCOMPLETE",
        None => "",
    };
    note!(
        "hyptrace: collect: {} of {} VMs complete{host}, written to {} in {:.1} ms{}",
        done,
        report.vms.len(),
        crate::drain::sink::shown_path(&a.output),
        started.elapsed().as_secs_f64() * 1e3,
        if report.interrupted {
            " (interrupted)"
        } else {
            ""
        }
    );
    Ok(report.exit_code())
}

/// `collect --host-trace`'s refusals (exit 2): an empty EVENTS, a ClickHouse output, a
/// VM named as the host's instance.
fn collect_host_args(
    spec: &crate::drain::host_trace::HostTraceSpec,
    vms: &[(String, std::path::PathBuf)],
    clickhouse: bool,
) -> Result<(), CliError> {
    use crate::flight::collect::HOST_PART;
    if spec.patterns.is_empty() {
        return Err(CliError::Args("--host-trace: no event named".into()));
    }
    if clickhouse {
        return Err(CliError::Args(
            "--host-trace: collect stores no host events in ClickHouse (write a file)".into(),
        ));
    }
    if vms.iter().any(|(n, _)| n == HOST_PART) {
        return Err(CliError::Args(format!(
            "a VM named {HOST_PART}: with --host-trace that is the host's instance (give it another NAME=)"
        )));
    }
    Ok(())
}

/// `hyptrace ctl`: prints an `ok` reply's payload on stdout (exit 0), an `err` reply on
/// stderr (exit 1).
pub fn ctl(a: &CtlArgs) -> Result<i32, CliError> {
    use crate::control::server::{CtlError, CtlOutcome};
    match crate::control::server::ctl(&a.path, &a.command) {
        Ok(CtlOutcome::Ok(answer)) => {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", answer.text()).and_then(|()| out.flush());
            Ok(EXIT_OK)
        }
        Ok(CtlOutcome::Err(why)) => {
            note!("hyptrace: ctl: err {why}");
            Ok(EXIT_RUNTIME)
        }
        Err(CtlError::Usage(u)) => Err(CliError::CtlUsage(u.0)),
        Err(e) => Err(CliError::Ctl(e)),
    }
}

/// `run` and `record`: checks the options and every output path before the VM boots
/// (a bad one costs nothing), runs the pipeline, prints the report, writes `--stats`.
/// Returns the run's exit code (its causes are on stderr already).
fn execute(a: &RunArgs, file: Option<RecordOut<'_>>) -> Result<i32, CliError> {
    let mut plan = Plan::new(a)?;
    if file.is_some() {
        plan.flight.for_record(&a.flight);
    }
    let crash_dump = plan
        .flight
        .crash_dump
        .as_deref()
        .map(|p| {
            format_for(None, p, "--crash-dump")?;
            a.files.check(p, "--crash-dump")
        })
        .transpose()?;
    if !plan.flight.drain_live && a.mode == ModeArg::Stop {
        note!("hyptrace: note: --drain none with --mode stop keeps the first ring-full of events of each vCPU and drops the rest");
    }
    let to_stdout = matches!(&file, Some(RecordOut::File(p, ..)) if p.as_os_str() == "-");
    let target = match file {
        None => Target::Stdout,
        Some(RecordOut::File(path, format, compression, filters)) => Target::File {
            target: a.files.check(path, "-o")?,
            path: path.clone(),
            format,
            compression,
            filters: filters.to_vec(),
        },
        Some(RecordOut::ClickHouse(url, client, filters)) => Target::ClickHouse {
            url,
            client,
            filters: filters.to_vec(),
        },
    };
    let stats = a
        .stats
        .as_deref()
        .map(|p| a.files.check(p, "--stats"))
        .transpose()?;
    // Before any temporary file exists: a signal from now on stops or aborts cleanly.
    let interrupts = Interrupts::install()?;
    // A signal ends a wait for a FIFO's reader (-o, --stats, --crash-dump).
    hyptrace_output::set_wait_interrupt(
        || Interrupts::install().map_or(0, |i| i.signals()),
        |p| {
            note!(
                "hyptrace: waiting for a reader of the FIFO {} (Ctrl-C gives up)",
                p.display()
            )
        },
    );
    // Last of the checks (a refused path costs nothing); removed when dropped, on every
    // way out of this function.
    // (The socket itself is bound by the run, once the trace memory file exists.)
    if let Some(p) = a.control.as_deref() {
        crate::control::server::ControlServer::check(p)?;
    }
    let mut run = Run::new(plan, target)
        .interrupts(interrupts)
        .crash_dump(crash_dump);
    if let Some(c) = a.control.as_deref() {
        run = run.control(c);
    }
    let mut report = run.execute().map_err(|e| match e {
        RunError::Events(e) => RunError::Events(host_events::with_hint(e)),
        e => e,
    })?;
    // A format written at the end (trace.dat, Perfetto) meets a closed stdout after
    // the run: a run that ended as asked (the guest finished, --duration, a first
    // Ctrl-C) ends as a closed stdout; a crash, a hang or a failure stays what it was.
    // Either way the summary never calls the output written.
    use crate::pipeline::report::Stop;
    let as_asked = matches!(report.stop, None | Some(Stop::Duration | Stop::Signal(_)));
    if to_stdout && as_asked && hyptrace_output::stdout_closed() {
        report.stop = Some(Stop::StdoutClosed);
    }
    if !report.quiet_end() {
        let _ = write!(std::io::stderr(), "{report}");
    }
    let code = report.exit_code();
    if let Some(st) = &stats {
        match write_destination(st, &report.stats_json(code)) {
            Err(e) if interrupted(&e) => {
                note!("hyptrace: no reader opened the --stats FIFO before the signal: stats not written");
                return Err(CliError::Run(RunError::Aborted));
            }
            r => r.map_err(CliError::Stats)?,
        }
    }
    Ok(code)
}

/// Whether `e` is a wait for a FIFO's reader that a signal ended.
fn interrupted(e: &OutputError) -> bool {
    matches!(e, OutputError::Io { source, .. } if source.kind() == std::io::ErrorKind::Interrupted)
}

#[cfg(test)]
mod error_chains;

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn guest_text_escaped() {
        assert_eq!(
            hyptrace_output::escape_guest_str("plain text"),
            "plain text"
        );
        assert_eq!(
            hyptrace_output::escape_guest_str("a\x1b[2Jb\n"),
            "a\\x1b[2Jb\\n"
        );
    }

    /// The OS error under a message, found by walking `source()`.
    fn os_error(e: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
        let mut cur = Some(e);
        while let Some(e) = cur {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                return Some(io.kind());
            }
            cur = e.source();
        }
        None
    }

    /// Errors keep their sources: the I/O error under "cannot read guest image" and
    /// under "cannot write ... (-o)" is reachable through `source()`.
    #[test]
    fn errors_keep_their_sources() {
        let a = match Cli::try_parse_from(["hyptrace", "run", "--guest", "/nonexistent/g.elf"])
            .expect("parses")
            .command
        {
            Command::Run(a) => a,
            c => panic!("not run: {c:?}"),
        };
        let e = CliError::from(Plan::new(&a).expect_err("no such guest"));
        assert!(e.to_string().contains("cannot read guest image"), "{e}");
        assert_eq!(os_error(&e), Some(std::io::ErrorKind::NotFound), "{e:?}");
        assert_eq!(e.exit_code(), EXIT_USAGE);
        let e = CliError::from(
            crate::drain::sink::check_destination(Path::new("/nonexistent/dir/x.dat"), "-o")
                .expect_err("no dir"),
        );
        assert!(os_error(&e).is_some(), "{e:?}");
    }

    /// Each kind of failure maps to its exit code.
    #[test]
    fn exit_codes() {
        assert_eq!(CliError::Args("x".into()).exit_code(), EXIT_USAGE);
        assert_eq!(CliError::Plan(PlanError::PollMs).exit_code(), EXIT_USAGE);
        assert_eq!(CliError::Run(RunError::Aborted).exit_code(), EXIT_ABORT);
        let kvm = crate::vmm::error::Error::KvmUnavailable {
            path: "/dev/kvm".into(),
            source: None,
        };
        assert_eq!(CliError::Run(RunError::Vm(kvm)).exit_code(), EXIT_USAGE);
        let io = std::io::Error::other("x");
        assert_eq!(CliError::ReportWrite(io).exit_code(), EXIT_RUNTIME);
    }
}
