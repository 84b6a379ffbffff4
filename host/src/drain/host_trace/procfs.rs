//! What /proc says about pid namespaces, for H1 (docs/design.md, "Host kernel events"):
//! who made a tracefs instance, and whether the thread ids /proc shows are the ones the
//! kernel's `set_event_pid` filter takes.

use std::io;
use std::os::unix::fs::MetadataExt;

/// The inode of `/proc/PID/ns/pid` in the initial pid namespace (`PROC_PID_INIT_INO`,
/// include/linux/proc_ns.h, fixed since Linux 3.8). `set_event_pid` takes the ids of
/// that namespace (the kernel compares them with `task->pid`).
pub const PROC_PID_INIT_INO: u64 = 0xEFFF_FFFC;
/// Most ancestors [`kernel_ids`] walks up looking for a process of /proc's namespace.
const MAX_ANCESTORS: usize = 1024;

/// The inode of `/proc/<who>/ns/pid` (`who`: `self` or a pid): which pid namespace
/// the process is in.
pub fn pid_ns(who: &str) -> io::Result<u64> {
    std::fs::metadata(format!("/proc/{who}/ns/pid")).map(|m| m.ino())
}

/// A `Key:` line of `/proc/<who>/status`.
fn status_line(who: &str, key: &str) -> io::Result<String> {
    let text = std::fs::read_to_string(format!("/proc/{who}/status"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim().to_string())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no {key} line")))
}

/// How many pid namespaces, from /proc's own down to the process's, the process has an
/// id in (`NSpid:` of its status): 1 when the process is in /proc's namespace.
pub fn nspid_depth(who: &str) -> io::Result<usize> {
    Ok(status_line(who, "NSpid:")?.split_whitespace().count())
}

/// The parent's pid as /proc names it (0: none visible).
fn ppid(who: &str) -> io::Result<u32> {
    status_line(who, "PPid:")?
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "PPid"))
}

/// When `/proc/<who>` started, in clock ticks after boot (`stat` field 22); with the
/// pid, it names one process for the machine's uptime (a pid reused later has another
/// start time).
pub fn start_time(who: &str) -> io::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{who}/stat"))?;
    // The command name (field 2) is in parentheses and may hold anything: fields
    // after the last ')' start with field 3.
    let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
    after
        .split_whitespace()
        .nth(22 - 3)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "stat starttime"))
}

/// This process's id as /proc names it (`/proc/self`).
pub fn self_pid() -> io::Result<u32> {
    std::fs::read_link("/proc/self")?
        .to_str()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "/proc/self"))
}

/// Whether /proc names tasks by the kernel's own ids (those of the initial pid
/// namespace), so that `/proc/self/task/*` are ids `set_event_pid` takes; `Err` says
/// why not. /proc's namespace is this process's when its `NSpid` has one entry (then
/// its `ns/pid` inode tells), else an ancestor namespace: the nearest ancestor process
/// with one entry is in it and its `ns/pid` tells (unreadable: cannot tell, refused).
/// Comparing `/proc/self/ns/pid` with `/proc/1/ns/pid` would not do: with a /proc of
/// its own namespace, pid 1 is that namespace's init.
pub fn kernel_ids() -> Result<(), String> {
    let proc_err = |what: &str, e: io::Error| format!("cannot read /proc ({what}: {e})");
    // No NSpid line (Linux before 4.1): only a process of the initial namespace can
    // tell, by its own `ns/pid` (/proc/self resolves, so /proc is an ancestor's).
    let depth = match nspid_depth("self") {
        Err(e) if e.kind() == io::ErrorKind::InvalidData => 1,
        d => d.map_err(|e| proc_err("NSpid", e))?,
    };
    let in_proc_ns = |who: &str| -> Result<(), String> {
        match pid_ns(who) {
            Ok(PROC_PID_INIT_INO) => Ok(()),
            Ok(_) => Err(
                "the /proc this process sees is a pid namespace's other than the \
                 initial one, so the thread ids it shows are not the kernel's"
                    .into(),
            ),
            Err(e) => Err(format!(
                "cannot tell whether /proc shows the kernel's thread ids ({who}/ns/pid: {e})"
            )),
        }
    };
    if depth == 1 {
        return in_proc_ns("self");
    }
    let mut who = ppid("self").map_err(|e| proc_err("PPid", e))?;
    for _ in 0..MAX_ANCESTORS {
        if who == 0 {
            break;
        }
        let w = who.to_string();
        if nspid_depth(&w).map_err(|e| proc_err("NSpid", e))? == 1 {
            return in_proc_ns(&w);
        }
        who = ppid(&w).map_err(|e| proc_err("PPid", e))?;
    }
    Err("cannot tell whether /proc shows the kernel's thread ids (no ancestor in its pid namespace)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process: its start time and /proc id read back; a process that ended has
    /// no /proc entry (NotFound); the test runs in the namespace /proc shows.
    #[test]
    fn this_process() {
        let me = start_time("self").expect("start");
        assert_eq!(
            start_time(&self_pid().expect("pid").to_string()).expect("start"),
            me
        );
        let mut c = std::process::Command::new("true").spawn().expect("true");
        let pid = c.id();
        c.wait().expect("wait");
        assert_eq!(
            start_time(&pid.to_string()).map_err(|e| e.kind()),
            Err(io::ErrorKind::NotFound)
        );
        assert!(nspid_depth("self").expect("NSpid") >= 1);
        if pid_ns("self").expect("ns") == PROC_PID_INIT_INO {
            assert_eq!(kernel_ids(), Ok(()));
        }
    }
}
