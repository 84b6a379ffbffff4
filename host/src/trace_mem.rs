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

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
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
#[error("--trace-mem {path}: {source}", path = .path.display())]
pub struct TraceMemError {
    /// The file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
}

/// The trace memory file of a running VMM: the file (mapped into guest memory by
/// [`crate::vm::Vm::new`] through [`TraceMemFile::region_backing`]) and a shared mapping of
/// its header.
pub struct TraceMemFile {
    path: PathBuf,
    file: Arc<File>,
    header: RawMem,
    header_len: usize,
    nr_cpus: u32,
    /// The per-CPU meta pages (`trace_buffer_meta`, one page per CPU after the region).
    meta: RawMem,
    meta_off: u64,
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
    /// Creates (or truncates) `path`, owner-only (0600, no symlink followed), sized for
    /// the header and `ring`'s region, and maps its header.
    pub fn create(path: &Path, ring: &RingGeometry) -> Result<Self, TraceMemError> {
        let err = |source| TraceMemError {
            path: path.to_path_buf(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(err)?;
        let meta = file.metadata().map_err(err)?;
        if !meta.file_type().is_file() {
            return Err(err(io::Error::other("not a regular file")));
        }
        // An existing file keeps its mode on open: make it owner-only.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(err)?;
        let header_len = header_size(ring.nr_cpus);
        let meta_off = header_len as u64 + mapped_len(ring.region_size) as u64;
        let meta_len = ring.nr_cpus as usize * meta::PAGE_SIZE;
        let total = meta_off + meta_len as u64;
        file.set_len(total).map_err(err)?;
        // SAFETY: a fresh shared mapping of the file's first `header_len` bytes (the file
        // is at least that long); no address hint, so nothing existing is replaced.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                header_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(err(io::Error::last_os_error()));
        }
        // SAFETY: `ptr` is a page-aligned mapping of `header_len` bytes that this value
        // owns until Drop; only this process writes it, through this RawMem's atomics
        // (other processes read the file).
        let header = unsafe { RawMem::new(ptr.cast(), header_len) };
        let meta_ptr = if meta_len == 0 {
            libc::MAP_FAILED
        } else {
            // SAFETY: a fresh shared mapping of the file's last `meta_len` bytes (the
            // file was sized to hold them; `meta_off` is 4 KiB aligned); no address hint.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    meta_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    meta_off as libc::off_t,
                )
            }
        };
        if meta_ptr == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            // SAFETY: the header mapping made above, unmapped once; `header` is dropped
            // unused.
            unsafe { libc::munmap(header.as_ptr().cast(), header_len) };
            return Err(err(e));
        }
        // SAFETY: a page-aligned mapping of `meta_len` bytes owned by this value until
        // Drop; this process writes it only through this RawMem (atomics), other
        // processes map the file read-only.
        let meta = unsafe { RawMem::new(meta_ptr.cast(), meta_len) };
        Ok(Self {
            path: path.to_path_buf(),
            file: Arc::new(file),
            header,
            header_len,
            nr_cpus: ring.nr_cpus,
            meta,
            meta_off,
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
        for off in (0..HEADER_FIXED).step_by(8) {
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
        let w = |off: usize, x: u64| self.meta.store(m + off, x, Relaxed);
        w(meta::READER_LOST_EVENTS, v.lost_events);
        w(meta::ENTRIES, v.entries);
        w(meta::OVERRUN, v.overrun);
        w(meta::READ, v.read);
        w(meta::PAGES_LOST, v.lost_total);
        w(meta::PAGES_TOUCHED, v.pages_touched);
        self.meta
            .store(m + meta::READER_ID, u64::from(v.reader_id), Release);
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
        h.store(slot, u64::from(p.reader), Relaxed);
        h.store(slot + 8, p.consumed, Relaxed);
        h.store(slot + 16, p.expected, Relaxed);
        // Release: the slot's words before the switch (a reader in another process
        // reads the file after this process is gone; order still matters for a live one).
        h.store(base + pos::ACTIVE, next, Release);
    }
}

impl Drop for TraceMemFile {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `create`, of `header_len` bytes, unmapped once;
        // nothing uses `self.header` after this.
        unsafe {
            libc::munmap(self.header.as_ptr().cast(), self.header_len);
        }
        // SAFETY: the meta mapping made in `create`, unmapped once; unused after this.
        unsafe {
            libc::munmap(self.meta.as_ptr().cast(), self.meta.size());
        }
    }
}
