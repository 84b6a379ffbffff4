//! File-backed trace memory (`--trace-mem PATH`): the trace region (pack, CPU
//! descriptors, control blocks, pages) lives in a shared mapping of a file, after a
//! small self-describing header, so that it survives the VMM (SIGKILL, a crash of the
//! host process) and another process can read it (`hyptrace dump --trace-mem PATH`).
//!
//! File layout (all integers little-endian; docs/abi.md, "Trace memory file"):
//!
//! ```text
//! 0                 header (HEADER_FIXED bytes of fields, then per-CPU reader positions)
//! header_size       the trace region, byte for byte as the guest sees it at region_gpa
//! header_size + region_size (rounded up to 4 KiB)  end of file
//! ```
//!
//! The VMM writes the header once before the guest starts, the reader positions after
//! every drain round, and the state at the end. A position is double-buffered: the
//! two slots alternate and one word (`active`) says which holds the newest, so a
//! VMM killed in the middle of an update leaves the previous one intact.

mod claim;

use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::Arc;

use hyptrace_abi::layout::{meta, RingGeometry};
use hyptrace_abi::{RawMem, SharedMem};
use hyptrace_reader::postmortem::Position;
use vm_memory::FileOffset;

use hyptrace_reader::trace_file::slot_off;
pub use hyptrace_reader::trace_file::{
    hdr, header_size, mapped_len, pos, read_position, EVENTS_BUILTIN_V1, FILE_ALIGN, HEADER_FIXED,
    MAGIC, POS_STRIDE, STATE_CRASHED, STATE_CREATED, STATE_ENDED, STATE_RUNNING, VERSION,
};

/// Why the trace memory file could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("--trace-mem {path}", path = .path.display())]
pub struct TraceMemError {
    /// The file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub why: FileProblem,
}

/// What is wrong with a trace memory file's path (docs/design.md, "Trace-memory file
/// ownership", F1-F7).
#[derive(Debug, thiserror::Error)]
pub enum FileProblem {
    /// F1: a running VMM holds the file's lock.
    #[error(
        "in use by a running VMM (pid {pid}): one VMM per trace memory file; pick another path"
    )]
    Locked {
        /// The holder's pid as its header says ("unknown" if it does not).
        pid: String,
    },
    /// F3/F4: the path names something other than a regular file.
    #[error("is {0}, not a regular file: refused")]
    NotRegular(&'static str),
    /// F3: a regular file with other names.
    #[error(
        "has {0} hard links: refused (replacing it would leave the other names on the old file)"
    )]
    HardLinks(u64),
    /// F1: only shared locks hold the file, for longer than a dump's test takes.
    #[error("another process holds a shared lock on it: refused")]
    SharedLock,
    /// F1: the path was replaced between this VMM's rename and its check.
    #[error("another process replaced the file while this VMM set it up")]
    Replaced,
    /// F1: other processes kept renaming or removing the path while this VMM looked.
    #[error("the path changed each of the {0} times this VMM looked at it: refused")]
    Unsettled(usize),
    /// A system call failed.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
}

impl FileProblem {
    fn io(what: &'static str) -> impl FnOnce(io::Error) -> Self {
        move |source| Self::Io { what, source }
    }
}

/// What a file type is called in messages.
fn kind_name(t: std::fs::FileType) -> &'static str {
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else if t.is_file() {
        "a regular file"
    } else {
        "of an unknown type"
    }
}

/// `flock(file, op | LOCK_NB)`: `Ok(false)` when another open file holds a conflicting
/// lock (`EWOULDBLOCK`).
pub fn try_flock(file: &File, op: libc::c_int) -> io::Result<bool> {
    loop {
        // SAFETY: flock on an open descriptor this `File` owns; no memory is passed.
        let r = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
        if r == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => continue,
            _ => return Err(e),
        }
    }
}

/// F4: opens `path` read-only without blocking and without following a symbolic link
/// (`O_RDONLY|O_NONBLOCK|O_NOFOLLOW|O_CLOEXEC`: opening a FIFO this way returns at once),
/// then refuses anything but a regular file (`fstat`); `O_NONBLOCK` is cleared before
/// the file is returned.
pub fn open_regular(path: &Path) -> Result<(File, Metadata), FileProblem> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => FileProblem::NotRegular("a symbolic link"),
            _ => FileProblem::Io {
                what: "cannot open",
                source: e,
            },
        })?;
    let md = file.metadata().map_err(FileProblem::io("fstat"))?;
    if !md.file_type().is_file() {
        return Err(FileProblem::NotRegular(kind_name(md.file_type())));
    }
    let fd = file.as_raw_fd();
    // SAFETY: fcntl F_GETFL/F_SETFL on a descriptor this `File` owns; no memory passed.
    let cleared = unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        fl >= 0 && libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(FileProblem::Io {
            what: "fcntl",
            source: io::Error::last_os_error(),
        });
    }
    Ok((file, md))
}

/// The pid word of a trace memory file's header, for a message ("unknown": none).
fn header_pid(file: &File) -> String {
    let mut w = [0u8; 8];
    match file.read_exact_at(&mut w, hdr::PID as u64) {
        Ok(()) if u64::from_le_bytes(w) != 0 => u64::from_le_bytes(w).to_string(),
        _ => "unknown".into(),
    }
}

/// The trace memory file of a running VMM: the file (mapped into guest memory by
/// [`crate::vmm::vm::Vm::new`] through [`TraceMemFile::region_backing`]) and a shared mapping of
/// its header. The file is held with an exclusive `flock` (F1) for as long as any of its
/// descriptors is open: this value's and the guest memory's (they share the open file).
pub struct TraceMemFile {
    path: PathBuf,
    file: Arc<File>,
    /// The header's words, over `_header_map`.
    header: RawMem,
    header_len: usize,
    nr_cpus: u32,
    /// The per-CPU meta pages (`trace_buffer_meta`, one page per CPU after the region),
    /// over `_meta_map`.
    meta: RawMem,
    meta_off: u64,
    // The shared mappings `header` and `meta` point into (unmapped when dropped, after
    // them: fields drop in declaration order).
    _header_map: memmap2::MmapRaw,
    _meta_map: memmap2::MmapRaw,
}

/// What a CPU's meta page says (written by [`TraceMemFile::write_meta`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetaValues {
    /// The reader page as an index into the CPU's pages.
    pub reader_id: u32,
    /// Events lost before the reader page.
    pub lost_events: u64,
    /// Writer counters: committed, overwritten, pages moved onto.
    pub entries: u64,
    /// Overwritten events.
    pub overrun: u64,
    /// Pages the writer moved onto.
    pub pages_touched: u64,
    /// Events handed out in swapped-out reader pages.
    pub read: u64,
    /// Events lost in total.
    pub lost_total: u64,
}

impl std::fmt::Debug for TraceMemFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceMemFile")
            .field("path", &self.path)
            .field("header_len", &self.header_len)
            .finish_non_exhaustive()
    }
}

impl TraceMemFile {
    /// Creates the trace memory file at `path` for `ring` (docs/design.md, "Trace-memory
    /// file ownership"): refuses a path a running VMM holds (F1), anything but a regular
    /// file with one name (F3), and otherwise makes a new owner-only file next to it,
    /// locked, sized and stamped with this pid, renamed over the path (F2) — an old file
    /// is replaced, never truncated, so a dump still reading it is undisturbed.
    pub fn create(path: &Path, ring: &RingGeometry) -> Result<Self, TraceMemError> {
        Self::create_with(path, ring, &mut |_| {})
    }

    /// [`TraceMemFile::create`], `hook` called at the claim's steps (the tests replay
    /// interleavings of two starters with it).
    fn create_with(
        path: &Path,
        ring: &RingGeometry,
        hook: &mut dyn FnMut(claim::Step),
    ) -> Result<Self, TraceMemError> {
        let err = |why| TraceMemError {
            path: path.to_path_buf(),
            why,
        };
        let (dir, name) = claim::split_path(path).map_err(err)?;
        // A path a running VMM holds (the usual refusal) is refused before anything is
        // made; `install` checks again, as it gives the name.
        claim::precheck(path).map_err(err)?;
        let (tmp, file) = claim::TempName::create(&dir, &name).map_err(err)?;
        // F1: locked before it has the name, so no one sees it unowned.
        if !try_flock(&file, libc::LOCK_EX)
            .map_err(FileProblem::io("flock"))
            .map_err(err)?
        {
            return Err(err(FileProblem::Io {
                what: "flock of the new file",
                source: io::ErrorKind::WouldBlock.into(),
            }));
        }
        // Owner-only even under a umask that allows more (O_CREAT's mode is masked).
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(FileProblem::io("chmod"))
            .map_err(err)?;
        let tm = Self::map(path, file, ring).map_err(err)?;
        // The pid first, so a VMM refused by the lock can name this one (F1).
        tm.header
            .store(hdr::PID, u64::from(std::process::id()), Relaxed);
        // F1-F3: the name, where nothing is or over a finished file this VMM holds.
        claim::install(path, tmp, hook).map_err(err)?;
        // F1: the path names our inode, which we hold locked; a process that is not
        // hyptrace can still rename over it later (see the design).
        if !claim::names(path, &tm.file).map_err(err)? {
            return Err(err(FileProblem::Replaced));
        }
        Ok(tm)
    }

    /// Sizes `file` for the header, `ring`'s region and the meta pages, and maps the
    /// header and the meta pages.
    fn map(path: &Path, file: File, ring: &RingGeometry) -> Result<Self, FileProblem> {
        let header_len = header_size(ring.nr_cpus);
        let meta_off = header_len as u64 + mapped_len(ring.region_size) as u64;
        let meta_len = ring.nr_cpus as usize * meta::PAGE_SIZE;
        let total = meta_off + meta_len as u64;
        file.set_len(total).map_err(FileProblem::io("set_len"))?;
        let header_map = memmap2::MmapOptions::new()
            .len(header_len)
            .map_raw(&file)
            .map_err(FileProblem::io("mmap"))?;
        // The file was sized to hold the meta pages; `meta_off` is 4 KiB aligned.
        let meta_map = memmap2::MmapOptions::new()
            .offset(meta_off)
            .len(meta_len)
            .map_raw(&file)
            .map_err(FileProblem::io("mmap"))?;
        // SAFETY: a page-aligned shared mapping of `header_len` bytes, kept by the value
        // built below (`_header_map`) for as long as this RawMem; only this process
        // writes it, through this RawMem's atomics (other processes read the file).
        let header = unsafe { RawMem::new(header_map.as_mut_ptr(), header_len) };
        // SAFETY: a page-aligned shared mapping of `meta_len` bytes, kept by the value
        // built below (`_meta_map`); this process writes it only through this RawMem
        // (atomics), other processes map the file read-only.
        let meta = unsafe { RawMem::new(meta_map.as_mut_ptr(), meta_len) };
        Ok(Self {
            path: path.to_path_buf(),
            file: Arc::new(file),
            header,
            header_len,
            nr_cpus: ring.nr_cpus,
            meta,
            meta_off,
            _header_map: header_map,
            _meta_map: meta_map,
        })
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the region lives in the file, for the guest memory's mapping.
    pub fn region_backing(&self) -> FileOffset {
        FileOffset::from_arc(self.file.clone(), self.header_len as u64)
    }

    /// Writes the header fields (before the guest starts).
    pub fn write_header(&self, ring: &RingGeometry, gpa: u64, tsc_khz: u64, generation: u64) {
        let h = &self.header;
        let w = |off: usize, v: u64| h.store(off, v, Relaxed);
        // The pid word stays: `create` wrote it before the file got its name (F1).
        for off in (0..HEADER_FIXED).step_by(8).filter(|&o| o != hdr::PID) {
            w(off, 0);
        }
        w(
            hdr::VERSION_HEADER_SIZE,
            u64::from(VERSION) | ((self.header_len as u64) << 32),
        );
        w(
            hdr::PAGE_SIZE_NR_CPUS,
            ring.page_size as u64 | (u64::from(ring.nr_cpus) << 32),
        );
        w(hdr::REGION_GPA, gpa);
        w(hdr::REGION_SIZE, ring.region_size as u64);
        w(hdr::TSC_KHZ, tsc_khz);
        w(hdr::GENERATION, generation);
        w(hdr::PID, u64::from(std::process::id()));
        w(hdr::STATE, STATE_CREATED);
        w(hdr::EVENTS_ABI, EVENTS_BUILTIN_V1);
        w(hdr::POS_OFF, HEADER_FIXED as u64);
        w(hdr::POS_STRIDE, POS_STRIDE as u64);
        w(hdr::META_OFF, self.meta_off);
        for cpu in 0..self.nr_cpus {
            for off in (0..POS_STRIDE).step_by(8) {
                w(HEADER_FIXED + cpu as usize * POS_STRIDE + off, 0);
            }
            let m = cpu as usize * meta::PAGE_SIZE;
            for off in (0..meta::STRUCT_LEN).step_by(8) {
                self.meta.store(m + off, 0, Relaxed);
            }
            self.meta.store(
                m + meta::META_PAGE_SIZE,
                meta::PAGE_SIZE as u64 | ((meta::STRUCT_LEN as u64) << 32),
                Relaxed,
            );
            self.meta.store(
                m + meta::SUBBUF_SIZE,
                ring.page_size as u64 | (u64::from(ring.pages_per_cpu) << 32),
                Relaxed,
            );
        }
        // Release: the magic last, so a reader that sees it sees the fields.
        h.store(hdr::MAGIC, MAGIC, Release);
    }

    /// The file offset of the meta pages.
    pub fn meta_off(&self) -> u64 {
        self.meta_off
    }

    /// Updates `cpu`'s meta page (words stored one by one: a reader in another process
    /// sees each word whole; the reader id is stored last, with Release).
    pub fn write_meta(&self, cpu: u32, v: &MetaValues) {
        if cpu >= self.nr_cpus {
            return;
        }
        let m = cpu as usize * meta::PAGE_SIZE;
        // The meta page's sequence count: odd while the fields change (one writer, the
        // run loop). The fence orders the odd count before the field stores; the Release
        // store of the even count after them pairs with the Acquire fence of the reader
        // (`attach::read_meta`), which loads the count before and after the fields.
        let seq = self.meta.load(m + meta::SEQ, Relaxed);
        self.meta
            .store(m + meta::SEQ, seq.wrapping_add(1) | 1, Relaxed);
        std::sync::atomic::fence(Release);
        let w = |off: usize, x: u64| self.meta.store(m + off, x, Relaxed);
        w(meta::READER_LOST_EVENTS, v.lost_events);
        w(meta::ENTRIES, v.entries);
        w(meta::OVERRUN, v.overrun);
        w(meta::READ, v.read);
        w(meta::PAGES_LOST, v.lost_total);
        w(meta::PAGES_TOUCHED, v.pages_touched);
        self.meta
            .store(m + meta::READER_ID, u64::from(v.reader_id), Release);
        self.meta
            .store(m + meta::SEQ, (seq | 1).wrapping_add(1), Release);
    }

    /// Sets the state word.
    pub fn set_state(&self, state: u64) {
        self.header.store(hdr::STATE, state, Release);
    }

    /// Records where the reader of `cpu` stands (double-buffered: a VMM killed in the
    /// middle leaves the previous record whole). Unchanged positions are not rewritten.
    pub fn record(&self, cpu: u32, p: Position) {
        if cpu >= self.nr_cpus {
            return;
        }
        let base = HEADER_FIXED + cpu as usize * POS_STRIDE;
        let h = &self.header;
        let n = h.load(base + pos::ACTIVE, Relaxed);
        if n != 0 && read_position(h, HEADER_FIXED, cpu) == Some(p) {
            return;
        }
        let next = n.wrapping_add(1).max(1);
        let slot = base + slot_off(next);
        let words = [
            u64::from(p.reader),
            p.consumed,
            p.expected,
            p.page_seq,
            p.first_index,
            p.printed,
        ];
        for (i, w) in words.into_iter().enumerate() {
            h.store(slot + 8 * i, w, Relaxed);
        }
        // Release: the slot's words before the switch (a reader in another process
        // reads the file after this process is gone; order still matters for a live one).
        h.store(base + pos::ACTIVE, next, Release);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use hyptrace_abi::layout::Mode;
    use std::os::unix::fs::MetadataExt;

    pub(super) fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hyptrace-tm-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    pub(super) fn ring() -> RingGeometry {
        RingGeometry::new(2, 3, 4096, Mode::Overwrite, false).expect("ring")
    }

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).expect("cstr");
        // SAFETY: mkfifo with a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    /// F3/F4: a symlink, a directory, a FIFO at the path are refused by type (the FIFO
    /// without blocking: `lstat` first); a regular file with two names is refused; a
    /// missing path or a lone unlocked regular file may be replaced.
    #[test]
    fn what_may_be_replaced() {
        let d = dir("replace");
        let missing = d.join("missing");
        assert!(claim::precheck(&missing).is_ok());
        let f = d.join("f");
        std::fs::write(&f, b"old").expect("write");
        assert!(claim::precheck(&f).is_ok());
        let l = d.join("link");
        std::os::unix::fs::symlink(&f, &l).expect("symlink");
        assert!(matches!(
            claim::precheck(&l),
            Err(FileProblem::NotRegular("a symbolic link"))
        ));
        assert!(matches!(
            claim::precheck(&d),
            Err(FileProblem::NotRegular("a directory"))
        ));
        let fifo = d.join("fifo");
        mkfifo(&fifo);
        assert!(matches!(
            claim::precheck(&fifo),
            Err(FileProblem::NotRegular("a FIFO"))
        ));
        // open_regular on a FIFO returns at once (O_NONBLOCK), refused by fstat.
        assert!(matches!(
            open_regular(&fifo),
            Err(FileProblem::NotRegular("a FIFO"))
        ));
        assert!(matches!(
            open_regular(&l),
            Err(FileProblem::NotRegular("a symbolic link"))
        ));
        let h = d.join("hard");
        std::fs::hard_link(&f, &h).expect("link");
        assert!(matches!(
            claim::precheck(&f),
            Err(FileProblem::HardLinks(2))
        ));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// F1: a file held with an exclusive flock (another open file description, as a
    /// running VMM's) is refused, naming the pid in its header; a shared lock (a dump's
    /// test) does not stop a replacement.
    #[test]
    fn a_locked_file_is_refused_with_its_pid() {
        let d = dir("locked");
        let f = d.join("f");
        let mut bytes = vec![0u8; 4096];
        bytes[hdr::PID..hdr::PID + 8].copy_from_slice(&4242u64.to_le_bytes());
        std::fs::write(&f, &bytes).expect("write");
        let holder = File::open(&f).expect("open");
        assert!(try_flock(&holder, libc::LOCK_SH).expect("flock"));
        // A shared lock held on is refused once the wait is over (the early check
        // leaves it to the claim); one let go while the starter waits (a dump's brief
        // test, F6) is no owner.
        assert!(claim::precheck(&f).is_ok());
        let e = TraceMemFile::create(&f, &ring()).expect_err("a shared lock held on");
        assert!(matches!(e.why, FileProblem::SharedLock), "{e}");
        assert_eq!(std::fs::read(&f).expect("read"), bytes, "untouched");
        let mut waited = 0;
        let tm = TraceMemFile::create_with(&f, &ring(), &mut |step| {
            if step == claim::Step::Waiting {
                waited += 1;
                assert!(try_flock(&holder, libc::LOCK_UN).expect("unlock"));
            }
        })
        .expect("a shared lock let go is no owner");
        assert!(waited > 0, "the starter waited for the shared lock");
        drop(tm);
        std::fs::write(&f, &bytes).expect("write");
        let holder = File::open(&f).expect("open");
        assert!(try_flock(&holder, libc::LOCK_EX).expect("flock"));
        match claim::precheck(&f) {
            Err(e @ FileProblem::Locked { .. }) => {
                assert!(e.to_string().contains("pid 4242"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        let e = crate::exit::chain(&TraceMemFile::create(&f, &ring()).expect_err("refused"));
        assert!(e.contains("pid 4242"), "{e}");
        assert_eq!(std::fs::read(&f).expect("read"), bytes, "untouched");
        drop(holder);
        assert_eq!(entries(&d), ["f"], "no temporary file left");
        let _ = std::fs::remove_dir_all(&d);
    }

    pub(super) fn entries(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .expect("readdir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// F2: an old file is replaced by a new inode (a reader of the old one keeps its
    /// bytes), owner-only, locked by the new owner, stamped with its pid; a second
    /// create on the path is refused while the first lives, and allowed after it.
    #[test]
    fn create_replaces_by_rename_and_owns_the_file() {
        let d = dir("create");
        let f = d.join("vm.trace");
        std::fs::write(&f, b"old bytes").expect("write");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let old = File::open(&f).expect("open old");
        let tm = TraceMemFile::create(&f, &ring()).expect("create");
        let md = std::fs::metadata(&f).expect("meta");
        assert_eq!(md.permissions().mode() & 0o777, 0o600);
        assert_ne!(md.ino(), old.metadata().expect("old").ino(), "a new inode");
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut &old, &mut b).expect("read old");
        assert_eq!(b, b"old bytes", "the old file is intact");
        let me = File::open(&f).expect("open new");
        assert!(
            !try_flock(&me, libc::LOCK_SH).expect("flock"),
            "held by the VMM"
        );
        assert_eq!(header_pid(&me), std::process::id().to_string());
        let e = TraceMemFile::create(&f, &ring()).expect_err("second owner");
        assert!(matches!(e.why, FileProblem::Locked { .. }), "{e}");
        drop(tm);
        assert!(try_flock(&me, libc::LOCK_SH).expect("flock"), "released");
        drop(me);
        let tm = TraceMemFile::create(&f, &ring()).expect("a finished file is replaced");
        drop(tm);
        assert_eq!(entries(&d), ["vm.trace"], "no temporary file left");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A path without a file name, or naming a directory, is refused before anything is
    /// made; the temporary name's guard removes it on drop (every error path).
    #[test]
    fn failed_create_leaves_nothing() {
        let d = dir("fail");
        assert!(matches!(
            claim::split_path(Path::new("/")),
            Err(FileProblem::NotRegular(_))
        ));
        let sub = d.join("sub");
        std::fs::create_dir(&sub).expect("mkdir");
        let e = TraceMemFile::create(&sub, &ring()).expect_err("a directory");
        assert!(
            matches!(e.why, FileProblem::NotRegular("a directory")),
            "{e}"
        );
        let (t, _f) = claim::TempName::create(&d, std::ffi::OsStr::new("x")).expect("tmp");
        let p = t.0.clone();
        assert!(p.exists());
        drop(t);
        assert!(!p.exists());
        assert_eq!(entries(&d), ["sub"]);
        let _ = std::fs::remove_dir_all(&d);
    }
}
