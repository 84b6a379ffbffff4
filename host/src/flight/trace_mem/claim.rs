//! F1-F3 (docs/design.md, "Trace-memory file ownership"): how a starting VMM gives its
//! new trace memory file the path's name without any lock another user can hold. No
//! directory lock: a starter renames its new file (already locked, F1) over the path
//! only
//!
//! - where nothing is, with `renameat2(RENAME_NOREPLACE)` (one of two starters wins,
//!   the other finds the winner's file and looks again), or
//! - over the file it found there while it holds that file's exclusive `flock`, after
//!   checking — with the lock held — that the path still names it (a starter that got
//!   the lock once an earlier one had replaced the file sees the path changed and
//!   looks again).
//!
//! A running VMM holds its file's lock until it ends and the lock of a new file is
//! taken before it has the name, so neither way replaces a live file, and two starters
//! never both own the path (the argument is in the design; `tests` below replays the
//! interleavings step by step).

use std::ffi::{CString, OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use super::{header_pid, kind_name, open_regular, try_flock, FileProblem};

/// How often a starter looks at a path that other processes keep changing before it
/// gives up (each look that fails means another process renamed or removed the name).
const CLAIM_LOOKS: usize = 64;
/// How long a starter waits on an old file another process holds exclusively while the
/// path still names it, before it names that process as the owner: a starter replacing
/// the file holds it for a few system calls, a running VMM until it ends.
const EXCLUSIVE_WAIT: Duration = Duration::from_millis(20);
/// How long a starter waits on an old file that only shared locks hold (a dump's brief
/// test, F6) before it refuses.
const SHARED_WAIT: Duration = Duration::from_secs(2);

/// The points of a claim where the tests' hook runs (nothing in production).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// The path named nothing; the no-replace rename comes next.
    Vacant,
    /// An old file was opened; its lock comes next.
    Opened,
    /// The old file is held and the path names it; the replacing rename comes next.
    Held,
    /// Another process holds the old file; this starter waits a moment.
    Waiting,
}

/// What a starter found at the path.
enum At {
    /// Nothing.
    Vacant,
    /// A finished file (no VMM holds it): held with `LOCK_EX` by this starter, named by
    /// the path when the lock was held, one name (F3).
    Finished(File),
    /// The path changed while the starter looked: look again.
    Changed,
    /// A regular file with one name that only shared locks hold (after the wait).
    Readers,
}

/// Whether `path` names `file` now (same device and inode; a missing path does not).
fn path_names(path: &Path, file: &File) -> Result<bool, FileProblem> {
    let at = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(FileProblem::io("lstat")(e)),
    };
    let ours = file.metadata().map_err(FileProblem::io("fstat"))?;
    Ok(at.dev() == ours.dev() && at.ino() == ours.ino())
}

/// What [`hold`] got.
enum Hold {
    /// The lock, and the path names the file.
    Held,
    /// The path no longer names the file.
    Changed,
    /// Only shared locks hold it, still after the wait.
    Readers,
}

/// F1: takes `old`'s exclusive lock and checks, with it held, that `path` still names
/// it. Another holder: waits [`EXCLUSIVE_WAIT`] (a starter replacing it lets go; the
/// path then changes), or `readers_wait` for shared holders only.
fn hold(
    path: &Path,
    old: &File,
    readers_wait: Duration,
    hook: &mut dyn FnMut(Step),
) -> Result<Hold, FileProblem> {
    let start = Instant::now();
    // Bounded by the waits (1 ms steps).
    loop {
        let got = try_flock(old, libc::LOCK_EX).map_err(FileProblem::io("flock"))?;
        // With the lock held this is the check F1 rests on; without, an early way out.
        if !path_names(path, old)? {
            return Ok(Hold::Changed);
        }
        if got {
            return Ok(Hold::Held);
        }
        let shared_only = try_flock(old, libc::LOCK_SH).map_err(FileProblem::io("flock"))?;
        if shared_only {
            let _ = try_flock(old, libc::LOCK_UN);
        }
        let limit = if shared_only {
            readers_wait
        } else {
            EXCLUSIVE_WAIT
        };
        if start.elapsed() >= limit {
            return if shared_only {
                Ok(Hold::Readers)
            } else {
                Err(FileProblem::Locked {
                    pid: header_pid(old),
                })
            };
        }
        hook(Step::Waiting);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// F1, F3: what is at `path`. It is examined with `lstat` first, so a FIFO or a
/// device is never opened.
fn look(
    path: &Path,
    readers_wait: Duration,
    hook: &mut dyn FnMut(Step),
) -> Result<At, FileProblem> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(At::Vacant),
        Err(e) => return Err(FileProblem::io("lstat")(e)),
    };
    if !md.file_type().is_file() {
        return Err(FileProblem::NotRegular(kind_name(md.file_type())));
    }
    let old = match open_regular(path) {
        Ok((f, _)) => f,
        Err(FileProblem::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(At::Changed)
        }
        Err(e) => return Err(e),
    };
    hook(Step::Opened);
    let held = match hold(path, &old, readers_wait, hook)? {
        Hold::Changed => return Ok(At::Changed),
        Hold::Readers => false,
        Hold::Held => true,
    };
    let nlink = old.metadata().map_err(FileProblem::io("fstat"))?.nlink();
    if nlink > 1 {
        return Err(FileProblem::HardLinks(nlink));
    }
    Ok(if held { At::Finished(old) } else { At::Readers })
}

/// F1, F3: refuses what [`install`] would refuse at `path` now, before anything is
/// made (the old file's lock, taken to look, is let go at once; shared locks are left
/// to `install` to wait for).
pub(super) fn precheck(path: &Path) -> Result<(), FileProblem> {
    look(path, Duration::ZERO, &mut |_| {}).map(drop)
}

fn cstr(p: &Path) -> Result<CString, FileProblem> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| FileProblem::Io {
        what: "a path with a NUL byte",
        source: io::ErrorKind::InvalidInput.into(),
    })
}

/// Gives `from` the name `to` only if `to` names nothing: `renameat2(RENAME_NOREPLACE)`;
/// on a file system without it, `link` (which never replaces), then `from` is removed.
/// `Ok(false)`: `to` exists.
fn rename_noreplace(from: &Path, to: &Path) -> Result<bool, FileProblem> {
    let (f, t) = (cstr(from)?, cstr(to)?);
    // SAFETY: two NUL-terminated paths that live across the call; AT_FDCWD directories.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    let e = io::Error::last_os_error();
    match (r, e.raw_os_error()) {
        (0, _) => Ok(true),
        (_, Some(libc::EEXIST)) => Ok(false),
        (_, Some(libc::EINVAL | libc::ENOSYS)) => match std::fs::hard_link(from, to) {
            Ok(()) => {
                let _ = std::fs::remove_file(from);
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(FileProblem::io("link")(e)),
        },
        _ => Err(FileProblem::io("rename")(e)),
    }
}

/// F1, F2: gives the new file at `tmp` (locked, sized, stamped) the name `path`, as
/// the module says. Refused: a file a VMM holds (F1), anything but a regular file with
/// one name (F3). Every error leaves `tmp` to be removed by its guard.
pub(super) fn install(
    path: &Path,
    tmp: TempName,
    hook: &mut dyn FnMut(Step),
) -> Result<(), FileProblem> {
    for _ in 0..CLAIM_LOOKS {
        match look(path, SHARED_WAIT, hook)? {
            At::Changed => {}
            At::Readers => return Err(FileProblem::SharedLock),
            At::Vacant => {
                hook(Step::Vacant);
                if rename_noreplace(&tmp.0, path)? {
                    tmp.keep();
                    return Ok(());
                }
            }
            At::Finished(old) => {
                hook(Step::Held);
                std::fs::rename(&tmp.0, path).map_err(FileProblem::io("rename"))?;
                tmp.keep();
                // The old file's lock goes only now, after the rename (F1).
                drop(old);
                return Ok(());
            }
        }
    }
    Err(FileProblem::Unsettled(CLAIM_LOOKS))
}

/// F2: the name of a new file next to the path (`O_CREAT|O_EXCL`, 0600), removed on
/// drop unless [`TempName::keep`] was called: every error path of
/// [`super::TraceMemFile::create`] removes it.
pub(super) struct TempName(pub(super) PathBuf);

impl TempName {
    pub(super) fn create(dir: &Path, name: &OsStr) -> Result<(Self, File), FileProblem> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        loop {
            let mut tmp = OsString::from(".");
            tmp.push(name);
            tmp.push(format!(
                ".{}-{}.tmp",
                std::process::id(),
                N.fetch_add(1, Relaxed)
            ));
            let path = dir.join(tmp);
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&path)
            {
                Ok(f) => return Ok((Self(path), f)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(FileProblem::io("cannot create a file next to it")(e)),
            }
        }
    }

    /// The name is no longer removed on drop (it was renamed).
    fn keep(mut self) {
        self.0 = PathBuf::new();
    }
}

impl Drop for TempName {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// The directory and the name of `path` (a path without a file name is refused).
pub(super) fn split_path(path: &Path) -> Result<(PathBuf, OsString), FileProblem> {
    let name = path
        .file_name()
        .ok_or(FileProblem::NotRegular("a directory"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((dir, name.to_os_string()))
}

/// F1: the path names `file` after the rename (a process that is not hyptrace may have
/// renamed over it meanwhile).
pub(super) fn names(path: &Path, file: &File) -> Result<bool, FileProblem> {
    path_names(path, file)
}

/// Two starters on one path, replayed step by step (one thread: each `flock` is taken
/// through its own open file, so the two conflict as two processes' would). Each test
/// fails if the step it names is left out of the claim: without the check after the
/// lock, the first case replaces a live file; without `RENAME_NOREPLACE`, the second.
#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::super::tests::{dir, entries, ring};
    use super::super::{TraceMemError, TraceMemFile};
    use super::*;

    fn ino(p: &Path) -> u64 {
        std::fs::symlink_metadata(p).expect("lstat").ino()
    }

    fn refused_locked(r: Result<TraceMemFile, TraceMemError>) -> String {
        match r {
            Err(e) if matches!(e.why, FileProblem::Locked { .. }) => crate::exit::chain(&e),
            other => panic!("not refused as locked: {other:?}"),
        }
    }

    /// A starts on a path holding `old` (or nothing); at A's `step`, B starts and owns
    /// the path. A is refused as locked, the path names B's file, nothing is left
    /// behind. Returns A's error.
    fn b_starts_at(step: Step, old: Option<&[u8]>, tag: &str) -> String {
        let d = dir(tag);
        let f = d.join("vm.trace");
        if let Some(bytes) = old {
            std::fs::write(&f, bytes).expect("write");
        }
        let mut b = None;
        let r = TraceMemFile::create_with(&f, &ring(), &mut |s| {
            if s == step && b.is_none() {
                b = Some(TraceMemFile::create(&f, &ring()).expect("B owns the path"));
            }
        });
        let e = refused_locked(r);
        let b = b.expect("B ran");
        assert_eq!(ino(&f), b.file.metadata().expect("fstat").ino(), "B's file");
        drop(b);
        assert_eq!(entries(&d), ["vm.trace"], "no temporary file left");
        let _ = std::fs::remove_dir_all(&d);
        e
    }

    /// A opened the finished file; B replaces it meanwhile and runs. A's lock is then
    /// granted (B let go of the old file), but the path names B's file: A looks again
    /// and is refused naming B.
    #[test]
    fn a_lock_granted_late_is_checked_against_the_path() {
        let e = b_starts_at(Step::Opened, Some(b"finished"), "claim-late");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
    }

    /// A found nothing at the path; B creates its file there meanwhile. A's rename
    /// does not replace it (RENAME_NOREPLACE): A looks again and is refused.
    #[test]
    fn a_vacant_path_taken_meanwhile_is_not_replaced() {
        b_starts_at(Step::Vacant, None, "claim-vacant");
    }

    /// A holds the finished file (the path names it); B starting then waits, finds it
    /// still held and is refused; A's rename replaces exactly the file it holds.
    #[test]
    fn the_holder_of_the_old_file_replaces_it_alone() {
        let d = dir("claim-held");
        let f = d.join("vm.trace");
        std::fs::write(&f, b"finished").expect("write");
        let old = ino(&f);
        let mut refused = None;
        let a = TraceMemFile::create_with(&f, &ring(), &mut |step| {
            if step == Step::Held && refused.is_none() {
                refused = Some(TraceMemFile::create(&f, &ring()).is_err());
                assert_eq!(ino(&f), old, "B changed nothing");
            }
        })
        .expect("A owns the path");
        assert_eq!(refused, Some(true), "B was refused");
        assert_eq!(ino(&f), a.file.metadata().expect("fstat").ino(), "A's file");
        drop(a);
        assert_eq!(entries(&d), ["vm.trace"], "no temporary file left");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Free-running: four starters at once on one path, 40 rounds, a finished file
    /// there or nothing: exactly one owns it each round, its inode is at the path, the
    /// others are refused as locked.
    #[test]
    fn concurrent_starters_one_owner() {
        let d = dir("claim-race");
        let f = d.join("vm.trace");
        for round in 0..40 {
            if round % 2 == 0 {
                std::fs::write(&f, b"finished").expect("write");
            } else {
                let _ = std::fs::remove_file(&f);
            }
            let go = std::sync::Barrier::new(4);
            let results: Vec<Result<TraceMemFile, TraceMemError>> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..4)
                    .map(|_| {
                        s.spawn(|| {
                            go.wait();
                            TraceMemFile::create(&f, &ring())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("join")).collect()
            });
            let owners: Vec<&TraceMemFile> = results.iter().flatten().collect();
            assert_eq!(owners.len(), 1, "round {round}: {results:?}");
            let owner = owners[0].file.metadata().expect("fstat").ino();
            assert_eq!(ino(&f), owner, "round {round}");
            for e in results.iter().filter_map(|r| r.as_ref().err()) {
                assert!(matches!(e.why, FileProblem::Locked { .. }), "{e}");
            }
        }
        assert_eq!(entries(&d), ["vm.trace"], "no temporary file left");
        let _ = std::fs::remove_dir_all(&d);
    }
}
