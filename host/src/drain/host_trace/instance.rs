//! H1 (docs/design.md, "Host kernel events"): the run's tracefs instance. Its name says
//! who made it — `hyptrace-NS-PID-START`: the maker's pid namespace (the inode of its
//! `/proc/PID/ns/pid`), its pid there and its start time (clock ticks after boot) — so
//! no two live processes share a name, in any pid namespaces. The run removes only the
//! instance it made; a leftover is removed only when its name proves its maker dead:
//! the maker's namespace is this process's, /proc shows that namespace, and the pid
//! there is gone or started at another time. Anything else is left alone.

use std::io;
use std::path::{Path, PathBuf};

use super::procfs::{nspid_depth, pid_ns, start_time};
use super::{io_err, HostTraceError, INSTANCE_PREFIX};

/// Who made an instance, as its name says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Maker {
    /// The pid namespace (inode of `/proc/PID/ns/pid`).
    pub ns: u64,
    /// The pid in that namespace.
    pub pid: u32,
    /// The start time, clock ticks after boot (`/proc/PID/stat` field 22).
    pub start: u64,
}

impl Maker {
    /// This process.
    pub fn me() -> io::Result<Self> {
        Ok(Self {
            ns: pid_ns("self")?,
            pid: std::process::id(),
            start: start_time("self")?,
        })
    }

    /// The instance's name.
    pub fn name(&self) -> String {
        format!("{INSTANCE_PREFIX}{}-{}-{}", self.ns, self.pid, self.start)
    }

    /// The maker an instance's name gives, if the name is one [`Maker::name`] makes
    /// (exactly: `hyptrace-123` of an older hyptrace, or `hyptrace-01-2-3`, is not).
    pub fn parse(name: &str) -> Option<Self> {
        let mut f = name.strip_prefix(INSTANCE_PREFIX)?.split('-');
        let m = Self {
            ns: f.next()?.parse().ok()?,
            pid: f.next()?.parse().ok()?,
            start: f.next()?.parse().ok()?,
        };
        (f.next().is_none() && m.name() == name).then_some(m)
    }

    /// Whether this maker is provably dead, seen by `me` through a /proc of `me`'s own
    /// pid namespace: same namespace, not `me`, and its pid is gone or now a process
    /// that started at another time. An unreadable /proc entry proves nothing.
    pub fn dead(&self, me: &Maker) -> bool {
        if self.ns != me.ns || self == me {
            return false;
        }
        match start_time(&self.pid.to_string()) {
            Ok(start) => start != self.start,
            Err(e) => e.kind() == io::ErrorKind::NotFound,
        }
    }
}

/// Removes the instances under `root` whose makers are provably dead (H1: a VMM killed
/// by SIGKILL), seen by `me`; nothing when /proc is not `me`'s namespace's (its pids
/// would not be `me`'s). Returns how many went.
pub fn remove_stale(root: &Path, me: &Maker) -> usize {
    if !matches!(nspid_depth("self"), Ok(1)) {
        log::debug!("host trace: /proc is not this pid namespace's: no leftover removed");
        return 0;
    }
    let Ok(dir) = std::fs::read_dir(root.join("instances")) else {
        return 0;
    };
    let mut n = 0;
    for e in dir.flatten() {
        let Some(maker) = e.file_name().to_str().and_then(Maker::parse) else {
            continue;
        };
        if !maker.dead(me) {
            continue;
        }
        match std::fs::remove_dir(e.path()) {
            Ok(()) => {
                log::info!("host trace: removed the instance of dead process {maker:?}");
                n += 1;
            }
            Err(err) => log::warn!("host trace: cannot remove {}: {err}", e.path().display()),
        }
    }
    n
}

/// Our tracefs instance; removed on drop (H1). It exists only once this process made
/// the directory, so drop never removes another's.
#[derive(Debug)]
pub(super) struct Instance {
    dir: PathBuf,
}

/// Whether `e` is the kernel refusing this user (EACCES or EPERM: Rust maps both to
/// `PermissionDenied`), not a missing file.
fn denied(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::PermissionDenied
}

impl Instance {
    pub(super) fn create(root: &Path) -> Result<Self, HostTraceError> {
        let instances = root.join("instances");
        match std::fs::metadata(&instances) {
            Ok(m) if m.is_dir() => {}
            Err(e) if denied(&e) => {
                return Err(HostTraceError::PermissionDenied {
                    path: root.to_path_buf(),
                    source: e,
                })
            }
            _ => return Err(HostTraceError::NotMounted(root.to_path_buf())),
        }
        let me = Maker::me().map_err(io_err(Path::new("/proc/self")))?;
        remove_stale(root, &me);
        let dir = root.join("instances").join(me.name());
        match std::fs::create_dir(&dir) {
            Ok(()) => Ok(Self { dir }),
            // Not made by this process: not ours to use or remove.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(HostTraceError::Exists(dir)),
            Err(e) if denied(&e) => Err(HostTraceError::PermissionDenied {
                path: instances,
                source: e,
            }),
            Err(e) => Err(io_err(&dir)(e)),
        }
    }

    pub(super) fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    /// A file of the tracefs mount the instance is in (`instances/NAME` under it).
    pub(super) fn root_path(&self, rel: &str) -> PathBuf {
        self.dir.join("../..").join(rel)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path("tracing_on"), "0");
        match std::fs::remove_dir(&self.dir) {
            Ok(()) => log::debug!("host trace: removed {}", self.dir.display()),
            Err(e) => log::warn!("host trace: cannot remove {}: {e}", self.dir.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names: made and parsed back exactly; an older `hyptrace-PID`, a probe, a name
    /// with other digits are no maker's.
    #[test]
    fn names() {
        let m = Maker {
            ns: 4026531836,
            pid: 42,
            start: 777,
        };
        assert_eq!(m.name(), "hyptrace-4026531836-42-777");
        assert_eq!(Maker::parse(&m.name()), Some(m));
        for other in [
            "hyptrace-42",
            "hyptrace-probe-1-2",
            "hyptrace-1-2-3-4",
            "hyptrace-01-2-3",
            "hyptrace-1-+2-3",
            "hyptrace-1-2-",
            "other-1-2-3",
        ] {
            assert_eq!(Maker::parse(other), None, "{other}");
        }
    }

    /// Dead: a pid of this namespace that is gone, or now started at another time.
    /// Not dead: this process, a live one, another namespace's.
    #[test]
    fn provably_dead() {
        let me = Maker::me().expect("me");
        let mut c = std::process::Command::new("true").spawn().expect("true");
        let pid = c.id();
        let start = start_time(&pid.to_string()).unwrap_or(1);
        c.wait().expect("wait");
        let gone = Maker { pid, start, ..me };
        assert!(gone.dead(&me));
        assert!(!me.dead(&me));
        assert!(
            Maker {
                start: me.start + 1,
                ..me
            }
            .dead(&me),
            "pid reused"
        );
        assert!(
            !Maker {
                ns: me.ns + 1,
                ..gone
            }
            .dead(&me),
            "another namespace"
        );
        let parent = std::os::unix::process::parent_id();
        let live = Maker {
            pid: parent,
            start: start_time(&parent.to_string()).expect("start"),
            ..me
        };
        assert!(!live.dead(&me));
    }
}
