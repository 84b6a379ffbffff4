//! `hyptrace collect [--follow] -o FILE NAME=SOCKET...`: one process subscribes to
//! several running VMMs (each `run --drain none --control SOCKET`) and writes one
//! trace: a trace.dat v7 with one buffer instance per VM, text, JSON or Perfetto (docs/design.md "Collecting several
//! VMs").
//!
//! Each VM is followed by its own thread exactly as `dump --attach` follows one
//! (`crate::flight::attach`: the VMM is a hostile peer, every batch checked), into a
//! single-buffer trace.dat of its own in a temporary directory; at the end the parts
//! become the instances of one file (`hyptrace_output::write_buffers`). Every VM must run
//! on the host's CLOCK_MONOTONIC (`--clock mono`, the default): each part's pages carry
//! that clock's nanoseconds through the VM's own clock map, so the instances share one
//! time line and a reader merging them (trace-cmd report) prints one time order. A VM
//! whose reading fails (it ends early, crashes, stops answering, lies) is named; the
//! others go on, and the file holds what was read of it. With text, the parts are
//! written as text instead (`BufferSet::write_text`: merged by time, each line prefixed
//! with its VM); with JSON or Perfetto, into one sink of that format with a process per
//! VM (`BufferSet::sink_meta`, the pages merged by time as `convert` merges a file's).
//! With `-o clickhouse://`, no part: each VM's thread streams its rows into a sink of
//! its own (`AttachOpts::sink`), so rows arrive while the VMs run. With `--host-trace`,
//! the host kernel's events are one more part, the instance `host` ([`host`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use hyptrace_output::{
    BufferPart, BufferSet, Clock, OutputError, OutputTarget, PageSink, TraceMeta,
};

use crate::drain::host_trace::HostTrace;
use crate::drain::sink::Format;
use crate::exit::chain;
use crate::flight::attach::{attach, AttachError, AttachOpts, AttachReport, SinkMaker};

pub mod host;

pub use host::{HostOutcome, HOST_PART};

/// Most VMs one `collect` follows (a thread each).
pub const MAX_VMS: usize = 64;

/// The clock every collected VM must run on.
pub const COLLECT_CLOCK: &str = "mono";

/// What `collect` does.
pub struct CollectOpts<'a> {
    /// The VMs: instance name, control socket.
    pub vms: &'a [(String, PathBuf)],
    /// Until every VM's vCPUs ended (or `stop`), instead of what is there now.
    pub follow: bool,
    /// The output's format: trace.dat (an instance per VM), text (`trace-cmd report
    /// -t` lines, each prefixed with its VM), JSON or Perfetto (a process per VM).
    pub format: Format,
    /// The output.
    pub target: &'a OutputTarget,
    /// The output as given (messages).
    pub out_path: &'a Path,
    /// Polled between fetches: stop (SIGINT).
    pub stop: &'a (dyn Fn() -> bool + Sync),
    /// The process's signals, if installed: a second Ctrl-C (an abort) also ends a
    /// ClickHouse batch's retries (`ClickHouseSink::cancel_on`).
    pub interrupts: Option<&'static crate::drain::signals::Interrupts>,
    /// `-o clickhouse://...`: each VM's events become rows of this server as they are
    /// read (its `vm` the VM's name) instead of an instance of one file.
    pub clickhouse: Option<(
        &'a hyptrace_clickhouse::ClickHouseUrl,
        &'a hyptrace_clickhouse::Client,
    )>,
}

/// Why `collect` wrote no trace.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    /// The temporary directory of the parts cannot be made.
    #[error("cannot make a temporary directory in {dir}", dir = .dir.display())]
    TempDir {
        /// Where.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No VM gave a part.
    #[error("no VM could be read: nothing written to {path}", path = .path.display())]
    Nothing {
        /// The output.
        path: PathBuf,
    },
    /// A VM's part (this run's own file) read back damaged.
    #[error("{path}: a VM's part is damaged: {damage}", path = .path.display())]
    DamagedPart {
        /// The output.
        path: PathBuf,
        /// What was damaged.
        damage: hyptrace_output::tracedat::Damage,
    },
    /// The parts could not be written as one trace.
    #[error("cannot write {path}", path = .path.display())]
    Output {
        /// The output.
        path: PathBuf,
        /// Why.
        #[source]
        source: OutputError,
    },
}

/// One VM's outcome.
#[derive(Debug)]
pub struct VmOutcome {
    /// Its instance name.
    pub name: String,
    /// What was read (none: the subscription failed, the VM has no part).
    pub report: Result<AttachReport, AttachError>,
    /// Whether its part is complete: with `--follow`, every vCPU's end came; without,
    /// what was there was read; and no error.
    pub complete: bool,
    /// Why its part was left out of the trace (it does not fit the others: another
    /// page size, an event id with another format).
    pub left_out: Option<OutputError>,
}

/// What `collect` did.
#[derive(Debug)]
pub struct CollectReport {
    /// Per VM, in the order given.
    pub vms: Vec<VmOutcome>,
    /// The host kernel's events (`--host-trace`).
    pub host: Option<HostOutcome>,
    /// Whether a stop (SIGINT) ended it.
    pub interrupted: bool,
}

impl CollectReport {
    /// The accounting on stderr's lines: per VM per CPU what was read and lost, each
    /// VM's state, and the causes of an incomplete one.
    pub fn lines(&self) -> Vec<String> {
        let mut v = Vec::new();
        for vm in &self.vms {
            let r = match &vm.report {
                Ok(r) => r,
                Err(e) => {
                    v.push(format!("{}: error: {}", vm.name, chain(e)));
                    continue;
                }
            };
            for (cpu, (read, lost)) in r.cpus.iter().enumerate() {
                v.push(format!(
                    "{}: cpu {cpu}: {read} events read, {lost} lost",
                    vm.name
                ));
            }
            let (read, lost) = r.cpus.iter().fold((0u64, 0u64), |(a, b), c| {
                (a.saturating_add(c.0), b.saturating_add(c.1))
            });
            let state = if vm.complete {
                "complete"
            } else {
                "INCOMPLETE"
            };
            v.push(format!(
                "{}: {read} events read, {lost} lost, {} fetches: {state} ({})",
                vm.name, r.fetches, r.ended
            ));
            for (cpu, e) in &r.errors {
                v.push(format!("{}: error: cpu {cpu}: {e}", vm.name));
            }
            if let Some(e) = &r.failed {
                v.push(format!("{}: error: {}", vm.name, chain(e)));
            }
            if let Some(e) = &vm.left_out {
                v.push(format!(
                    "{}: error: left out of the trace: {}",
                    vm.name,
                    chain(e)
                ));
            }
        }
        if let Some(h) = &self.host {
            v.extend(h.lines(self.interrupted));
        }
        v
    }

    /// 0 when every VM's part is complete, 130 after a stop, else 1.
    pub fn exit_code(&self) -> i32 {
        if self.interrupted {
            crate::exit::EXIT_ABORT
        } else if self.vms.iter().all(|v| v.complete)
            && self.host.as_ref().is_none_or(HostOutcome::complete)
        {
            crate::exit::EXIT_OK
        } else {
            crate::exit::EXIT_RUNTIME
        }
    }
}

/// Follows one VM into its part (a thread of [`collect`]), or with `-o clickhouse://`
/// into rows of its own run (`vm` = its name), streamed as they are read: a slow or
/// absent server back-pressures this VM's reading only (its VMM counts what its rings
/// then drop).
fn follow_vm(
    o: &CollectOpts<'_>,
    name: &str,
    socket: &Path,
    part: &Path,
) -> Result<AttachReport, AttachError> {
    let target = OutputTarget::check(part).map_err(|why| AttachError::Output {
        path: part.to_path_buf(),
        why,
    })?;
    let stop = || (o.stop)();
    let rows = o.clickhouse.map(|(url, client)| {
        move |meta: TraceMeta| -> Result<Box<dyn PageSink + Send>, OutputError> {
            use hyptrace_clickhouse::{ClickHouseSink, Options, RunIdentity};
            let who = RunIdentity::new(Some(name));
            let interrupts = o.interrupts;
            let sink =
                ClickHouseSink::new(client.clone(), &url.database, who, meta, Options::default())?
                    .cancel_on(move || interrupts.is_some_and(|i| i.aborted()));
            Ok(Box::new(sink))
        }
    });
    attach(&AttachOpts {
        socket,
        follow: o.follow,
        target: &target,
        out_path: part,
        format: Format::Dat,
        stop: &stop,
        clock: Some(COLLECT_CLOCK),
        keep_on_error: true,
        sink: rows.as_ref().map(|r| r as SinkMaker<'_>),
    })
}

/// Whether a VM's reading is complete.
fn complete(r: &Result<AttachReport, AttachError>, follow: bool) -> bool {
    match r {
        Ok(r) => {
            r.errors.is_empty()
                && r.failed.is_none()
                && (!follow || r.ended == "every vCPU's events ended")
        }
        Err(_) => false,
    }
}

/// Subscribes to every VM (a thread each), then writes their parts as one trace.dat
/// with an instance per VM. A VM that fails is in the report; the trace holds the
/// others (and what was read of it). With `host` (prepared on the `mono` trace clock,
/// not recording yet), the host kernel's events are recorded from before the first
/// subscription until every VM's thread ended, into the instance [`HOST_PART`].
pub fn collect(
    o: &CollectOpts<'_>,
    host: Option<HostTrace>,
) -> Result<CollectReport, CollectError> {
    let dir = o.target.spill_dir();
    let tmp = tempfile::Builder::new()
        .prefix(".hyptrace-collect.")
        .tempdir_in(&dir)
        .map_err(|source| CollectError::TempDir { dir, source })?;
    let parts: Vec<PathBuf> = (0..o.vms.len())
        .map(|i| tmp.path().join(format!("vm{i}.dat")))
        .collect();
    let host_part = tmp.path().join("host.dat");
    let host = host.map(host::start);
    let vms_done = AtomicBool::new(false);
    let (results, mut host): (Vec<Result<AttachReport, AttachError>>, _) =
        std::thread::scope(|s| {
            let host = host.map(|h| {
                let (part, done) = (&host_part, &vms_done);
                s.spawn(move || match h {
                    Ok(rec) => host::follow_host(rec, part, done, o.stop),
                    Err(failed) => HostOutcome {
                        failed: Some(failed),
                        ..HostOutcome::default()
                    },
                })
            });
            let handles: Vec<_> = o
                .vms
                .iter()
                .zip(&parts)
                .map(|((name, socket), part)| s.spawn(move || follow_vm(o, name, socket, part)))
                .collect();
            let results = handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect();
            vms_done.store(true, Ordering::Release);
            let host = host.map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
            (results, host)
        });
    let interrupted = (o.stop)();
    let mut vms: Vec<VmOutcome> = o
        .vms
        .iter()
        .zip(results)
        .map(|((name, _), report)| VmOutcome {
            name: name.clone(),
            complete: complete(&report, o.follow) && !interrupted,
            report,
            left_out: None,
        })
        .collect();
    if o.clickhouse.is_some() {
        // Each VM's rows went to the server as they were read (`follow_vm`).
        if vms.iter().all(|v| v.report.is_err()) {
            return Err(CollectError::Nothing {
                path: o.out_path.to_path_buf(),
            });
        }
        return Ok(CollectReport {
            vms,
            host,
            interrupted,
        });
    }
    let host_cmdlines = host.as_ref().map_or(&[][..], |h| &h.cmdlines[..]);
    let mut set =
        assemble(&mut vms, &parts, host_cmdlines).map_err(|source| CollectError::Output {
            path: o.out_path.to_path_buf(),
            source,
        })?;
    if let Some(h) = host.as_mut().filter(|h| h.has_part) {
        let part = BufferPart {
            name: HOST_PART.into(),
            path: host_part.clone(),
        };
        if let Err(e) = set.add(&part) {
            h.left_out = Some(e);
        }
    }
    if set.is_empty() {
        return Err(CollectError::Nothing {
            path: o.out_path.to_path_buf(),
        });
    }
    let output = |source| CollectError::Output {
        path: o.out_path.to_path_buf(),
        source,
    };
    match o.format {
        Format::Text => set.write_text(o.target).map(drop).map_err(output)?,
        Format::Json | Format::Perfetto => write_sink(&set, o)?,
        _ => set.write(o.target).map(drop).map_err(output)?,
    }
    Ok(CollectReport {
        vms,
        host,
        interrupted,
    })
}

/// Writes every part into one sink of `o.format` (JSON, Perfetto), each VM a process
/// of its name ([`BufferSet::sink_meta`]), the pages merged by time across the VMs as
/// `convert` merges a file's CPUs.
fn write_sink(set: &BufferSet, o: &CollectOpts<'_>) -> Result<(), CollectError> {
    let output = |source| CollectError::Output {
        path: o.out_path.to_path_buf(),
        source,
    };
    let meta = set.sink_meta().map_err(output)?;
    let groups = meta.groups.clone();
    let sink =
        crate::drain::sink::make_sink(o.target, o.format, hyptrace_output::Compression::None, meta)
            .map_err(output)?;
    let mut cursors = Vec::new();
    for ((_, file), g) in set.parts().zip(&groups) {
        cursors.extend(file.all_pages().into_iter().map(|c| (g.first + c.cpu(), c)));
    }
    let mut damage = None;
    hyptrace_output::tracedat::pump_cursors(
        cursors,
        sink,
        &mut |d| {
            damage.get_or_insert(d);
        },
        false,
    )
    .map_err(output)?;
    match damage {
        // The parts are this run's own files: damage in one is a fault here.
        Some(damage) => Err(CollectError::DamagedPart {
            path: o.out_path.to_path_buf(),
            damage,
        }),
        None => Ok(()),
    }
}

/// The parts of the VMs that have one, as one set: a part that does not fit those
/// before it is left out (its VM incomplete, the cause kept), the others go on. The
/// file's page size is the first part's; its top level has as many CPUs as the
/// largest VM. Its command lines (one table for every instance) name the vCPUs, then
/// the host's tasks of `host_cmdlines` whose pid no vCPU has.
fn assemble(
    vms: &mut [VmOutcome],
    parts: &[PathBuf],
    host_cmdlines: &[(i32, String)],
) -> Result<BufferSet, OutputError> {
    let has_part = |v: &VmOutcome, p: &PathBuf| v.report.is_ok() && p.exists();
    let clock = Clock {
        name: COLLECT_CLOCK.into(),
        ..Clock::nanoseconds()
    };
    let Some(first) = vms.iter().zip(parts).find(|(v, p)| has_part(v, p)) else {
        // No VM's part: the host's alone, if there is one (its pages are the kernel's).
        let mut meta = TraceMeta::guest(4096, 1, clock);
        meta.cmdlines = host_cmdlines.iter().cloned().collect();
        return BufferSet::new(meta);
    };
    let page_size = hyptrace_output::TraceFile::open(first.1)?.page_size;
    let nr_cpus = vms
        .iter()
        .filter_map(|v| v.report.as_ref().ok().map(|r| r.cpus.len()))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut meta = TraceMeta::guest(page_size, nr_cpus as u32, clock);
    for (pid, comm) in host_cmdlines {
        meta.cmdlines.entry(*pid).or_insert_with(|| comm.clone());
    }
    let mut set = BufferSet::new(meta)?;
    for (v, path) in vms.iter_mut().zip(parts) {
        if !has_part(v, path) {
            continue;
        }
        let part = BufferPart {
            name: v.name.clone(),
            path: path.clone(),
        };
        if let Err(e) = set.add(&part) {
            v.complete = false;
            v.left_out = Some(e);
        }
    }
    Ok(set)
}

/// `NAME=SOCKET` or `SOCKET` (named by its file stem): the instance name and the
/// socket; names must be valid instance names, once each; at most [`MAX_VMS`].
pub fn parse_vms(args: &[String]) -> Result<Vec<(String, PathBuf)>, String> {
    if args.len() > MAX_VMS {
        return Err(format!("{} VMs: at most {MAX_VMS}", args.len()));
    }
    let mut vms: Vec<(String, PathBuf)> = Vec::with_capacity(args.len());
    for a in args {
        let (name, socket) = match a.split_once('=') {
            Some((n, s)) if !n.contains('/') => (n.to_string(), PathBuf::from(s)),
            _ => {
                let p = PathBuf::from(a);
                let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("");
                (stem.to_string(), p)
            }
        };
        let shown = crate::exit::printable(a);
        if !hyptrace_output::tracedat::valid_instance_name(&name) {
            return Err(format!(
                "{shown}: a VM's name is 1 to 64 of [A-Za-z0-9_.-] (give it as NAME=SOCKET)"
            ));
        }
        if socket.as_os_str().is_empty() {
            return Err(format!("{shown}: no socket"));
        }
        if vms.iter().any(|(n, _)| *n == name) {
            return Err(format!("{shown}: a second VM named {name}"));
        }
        vms.push((name, socket));
    }
    Ok(vms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn vms_are_named() {
        let v = parse_vms(&s(&["a=/tmp/x.sock", "/run/vm-2.sock", "b=rel/c"])).unwrap();
        assert_eq!(v[0], ("a".into(), "/tmp/x.sock".into()));
        assert_eq!(v[1], ("vm-2".into(), "/run/vm-2.sock".into()));
        assert_eq!(v[2], ("b".into(), "rel/c".into()));
        // A path with '=' after a '/' is a socket named by its stem.
        let v = parse_vms(&s(&["/tmp/a=b/vm.sock"])).unwrap();
        assert_eq!(v[0].0, "vm");
        assert!(parse_vms(&s(&["x=/a", "x=/b"])).is_err());
        assert!(parse_vms(&s(&["a b=/a"])).is_err());
        assert!(parse_vms(&s(&["a="])).is_err());
        assert!(parse_vms(&s(&["/tmp/.sock"])).is_ok());
        assert!(parse_vms(&s(&["/tmp/\u{e9}.sock"])).is_err());
        let many: Vec<String> = (0..=MAX_VMS).map(|i| format!("v{i}=/s")).collect();
        assert!(parse_vms(&many).is_err());
    }
}
