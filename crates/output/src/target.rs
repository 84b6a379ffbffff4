//! Output destinations: where a sink (or the host's `--stats`/`--json` writer) writes,
//! checked before any work is done.
//!
//! - a regular file or a new path: written to a temporary file in the same directory
//!   and renamed over the path at `finish` (nothing that looks complete appears before;
//!   a previous file stays untouched if the run fails). The file is created owner-only
//!   ([`OutputTarget::PRIVATE`], 0600: it holds trace data, which may be private)
//!   unless [`OutputTarget::with_mode`] asks for another mode; spill files always are;
//!   this module is where every output file is created;
//! - a symlink: followed (chains too); its target is written that way;
//! - a character or block device, a FIFO, or `-` (stdout): written in place, streaming
//!   (never replaced by a regular file);
//! - a directory, a socket, a missing directory or one we cannot write to: refused by
//!   [`OutputTarget::check`], so the caller can refuse before starting.
//!
//! Stdout whose reader went away (`| head`) is no error: the rest of the output is
//! discarded and [`stdout_closed`] says so, for the caller to stop its work and end
//! quietly (exit 0), as a command in a pipeline does.
//!
//! On a write error the temporary file is removed at once and the error (path and OS
//! error as its source) is returned; every later call returns [`OutputError::Closed`].
//! Dropped without `finish`, an [`OutputFile`] removes its temporary file.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

use crate::blockwrite::{BlockWriter, HasFile};
use crate::error::Marker;
use crate::OutputError;

/// Most symlinks followed (Linux's own limit).
const MAX_SYMLINKS: usize = 40;
/// `O_NONBLOCK` (Linux, every architecture we build for): opening a FIFO without a reader
/// for writing fails with ENXIO instead of waiting.
const O_NONBLOCK: i32 = 0o4000;
/// Buffer of an output file.
const BUF: usize = 1 << 20;

/// What kind of destination a path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetKind {
    /// A regular file or a new path: temporary file + rename at `finish`.
    File,
    /// A character/block device or a FIFO: written in place, streaming.
    Stream,
    /// Standard output (`-`).
    Stdout,
}

/// A checked output destination ([`OutputTarget::check`]), opened with
/// [`OutputTarget::open`] or handed to a sink's `open`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputTarget {
    /// The path as the user gave it (for messages).
    path: PathBuf,
    /// The path written: the symlink target for a symlink.
    dest: PathBuf,
    kind: TargetKind,
    /// Where spill files go (None: see [`OutputTarget::spill_dir`]).
    spill_dir: Option<PathBuf>,
    /// The permission bits a new file is created with (less the umask).
    mode: u32,
    /// Whether a regular file's (and its spill files') whole blocks are written past
    /// the page cache ([`OutputTarget::with_direct_io`]).
    direct_io: bool,
}

fn refuse(path: &Path, kind: io::ErrorKind, msg: &str) -> OutputError {
    OutputError::io(path, io::Error::new(kind, msg.to_string()))
}

/// Follows `path` through symlinks to the path that will be written.
fn resolve(path: &Path) -> Result<(PathBuf, Option<fs::Metadata>), OutputError> {
    let mut p = path.to_path_buf();
    for _ in 0..MAX_SYMLINKS {
        match fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                let t = fs::read_link(&p).map_err(|e| OutputError::io(&p, e))?;
                p = match p.parent() {
                    Some(dir) if t.is_relative() => dir.join(t),
                    _ => t,
                };
            }
            Ok(m) => return Ok((p, Some(m))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((p, None)),
            Err(e) => return Err(OutputError::io(&p, e)),
        }
    }
    Err(refuse(
        path,
        io::ErrorKind::InvalidInput,
        "too many levels of symbolic links",
    ))
}

/// The directory a new file `p` goes in (`.` for a bare name).
fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// A temporary file `.NAME.XXXXXX<suffix>` in `dir`, created with `mode` (less the
/// umask, as `open(2)` applies it): the one place output files are created.
fn temp_in(dir: &Path, dest: &Path, suffix: &str, mode: u32) -> io::Result<NamedTempFile> {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(suffix)
        .permissions(fs::Permissions::from_mode(mode))
        .tempfile_in(dir)
}

impl OutputTarget {
    /// The mode output files are created with unless [`OutputTarget::with_mode`] says
    /// otherwise: owner-only, as the trace data they hold may be (a 0600 trace memory
    /// file, a guest's secrets).
    pub const PRIVATE: u32 = 0o600;

    /// Standard output.
    pub fn stdout() -> Self {
        Self {
            path: PathBuf::from("-"),
            dest: PathBuf::from("-"),
            kind: TargetKind::Stdout,
            spill_dir: None,
            mode: Self::PRIVATE,
            direct_io: false,
        }
    }

    /// Creates the file with the permission bits `mode` (`& 0o777`; less the umask, as
    /// `open(2)` applies it) instead of [`OutputTarget::PRIVATE`]. A device, a FIFO or
    /// stdout is written in place, its mode untouched.
    pub fn with_mode(mut self, mode: u32) -> Self {
        self.mode = mode & 0o777;
        self
    }

    /// The permission bits a new file gets (before the umask).
    pub fn mode(&self) -> u32 {
        self.mode
    }

    /// Classifies `path` and checks that it can be written, creating nothing that stays:
    /// `-` is stdout; a directory, a socket, a path in a missing or read-only directory,
    /// a read-only file or device are refused (the error names the path, the OS error is
    /// its source). Call it before starting work; errors are the user's (bad input).
    ///
    /// ```
    /// use hyptrace_output::{OutputTarget, TargetKind};
    /// let dir = tempfile::tempdir()?;
    /// let t = OutputTarget::check(dir.path().join("t.dat"))?;
    /// assert_eq!(t.kind(), TargetKind::File); // written to a temporary file, then renamed
    /// assert!(OutputTarget::check(dir.path()).is_err()); // a directory
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn check(path: impl AsRef<Path>) -> Result<Self, OutputError> {
        let path = path.as_ref();
        if path.as_os_str() == "-" {
            return Ok(Self::stdout());
        }
        if path.as_os_str().is_empty() {
            return Err(refuse(path, io::ErrorKind::InvalidInput, "empty path"));
        }
        // `name/` names a directory (existing or not): never a file we could rename to.
        if path.as_os_str().as_encoded_bytes().ends_with(b"/") {
            return Err(refuse(
                path,
                io::ErrorKind::IsADirectory,
                "names a directory, not a file",
            ));
        }
        let (dest, meta) = resolve(path)?;
        let kind = match &meta {
            None => TargetKind::File,
            Some(m) => {
                let t = m.file_type();
                if t.is_dir() {
                    return Err(refuse(path, io::ErrorKind::IsADirectory, "is a directory"));
                } else if t.is_file() {
                    TargetKind::File
                } else if t.is_char_device() || t.is_block_device() || t.is_fifo() {
                    TargetKind::Stream
                } else {
                    return Err(refuse(
                        path,
                        io::ErrorKind::InvalidInput,
                        "not a regular file, device or FIFO",
                    ));
                }
            }
        };
        match kind {
            TargetKind::File => {
                if meta.is_some() {
                    // An existing file we may not write is refused, as `>` would.
                    OpenOptions::new()
                        .write(true)
                        .open(&dest)
                        .map_err(|e| OutputError::io(path, e))?;
                }
                let dir = parent_dir(&dest);
                match fs::metadata(&dir) {
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        let msg = format!("directory {} does not exist", dir.display());
                        return Err(refuse(path, io::ErrorKind::NotFound, &msg));
                    }
                    Ok(m) if !m.is_dir() => {
                        let msg = format!("{} is not a directory", dir.display());
                        return Err(refuse(path, io::ErrorKind::NotADirectory, &msg));
                    }
                    _ => {}
                }
                // The definitive check: a temporary file can be made next to it. The
                // OS error alone (tempfile adds the temporary name, which means nothing
                // to the user).
                drop(temp_in(&dir, &dest, ".check", Self::PRIVATE).map_err(|e| {
                    let e = e.raw_os_error().map_or(e, io::Error::from_raw_os_error);
                    OutputError::io(path, e)
                })?);
            }
            TargetKind::Stream => {
                match OpenOptions::new()
                    .write(true)
                    .custom_flags(O_NONBLOCK)
                    .open(&dest)
                {
                    Ok(_) => {}
                    // A FIFO without a reader yet: writable, `open` waits for the reader.
                    Err(e) if e.raw_os_error() == Some(ENXIO) => {}
                    Err(e) => return Err(OutputError::io(path, e)),
                }
            }
            TargetKind::Stdout => {}
        }
        Ok(Self {
            path: path.to_path_buf(),
            dest,
            kind,
            spill_dir: None,
            mode: Self::PRIVATE,
            direct_io: false,
        })
    }

    /// The path as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path written (a symlink's target).
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// What kind of destination this is.
    pub fn kind(&self) -> TargetKind {
        self.kind
    }

    /// Opens the destination for writing: a temporary file next to it (renamed at
    /// [`OutputFile::finish`]), the device or FIFO itself (a FIFO's open waits for a
    /// reader), or stdout.
    pub fn open(&self) -> Result<OutputFile, OutputError> {
        let inner = match self.kind {
            TargetKind::File => {
                let t = temp_in(&parent_dir(&self.dest), &self.dest, ".tmp", self.mode)
                    .map_err(|e| OutputError::io(&self.path, e))?;
                Inner::Temp(BlockWriter::new(Temp(t), 0, self.direct_io))
            }
            TargetKind::Stream => {
                let f = open_stream(&self.dest).map_err(|e| OutputError::io(&self.path, e))?;
                Inner::Stream(BufWriter::with_capacity(BUF, f))
            }
            TargetKind::Stdout => {
                Inner::Stdout(BufWriter::with_capacity(BUF, QuietStdout::default()))
            }
        };
        Ok(OutputFile {
            target: self.clone(),
            inner,
        })
    }

    /// Writes a regular file, the trace.dat CPU data written straight into it and its
    /// spill files in 4 MiB blocks past the page cache (`O_DIRECT`, where the file
    /// system allows it; docs/output.md). Where copying into fresh page-cache pages is
    /// slow (a virtual machine whose hypervisor takes freed memory back) this keeps
    /// pace where the page cache does not, and leaves no dirty pages to write back; the
    /// output then goes at the disk's pace, where the page cache takes a burst as long
    /// as the kernel's dirty-page limits allow.
    pub fn with_direct_io(mut self) -> Self {
        self.direct_io = true;
        self
    }

    /// Whether whole blocks are written past the page cache
    /// ([`OutputTarget::with_direct_io`]).
    pub fn is_direct_io(&self) -> bool {
        self.direct_io
    }

    /// Keeps spill files (trace.dat's per-CPU page files) in `dir` instead.
    pub fn with_spill_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.spill_dir = Some(dir.into());
        self
    }

    /// Where a sink writing here keeps its spill files: the directory given with
    /// [`OutputTarget::with_spill_dir`], else next to a regular file (same file system
    /// as the output), else the system's temporary directory (`TMPDIR`).
    pub fn spill_dir(&self) -> PathBuf {
        match (&self.spill_dir, self.kind) {
            (Some(d), _) => d.clone(),
            (None, TargetKind::File) => parent_dir(&self.dest),
            (None, _) => std::env::temp_dir(),
        }
    }

    /// A spill file for this output (removed when dropped).
    pub(crate) fn spill(&self, suffix: &str) -> Result<Temp, OutputError> {
        let dir = self.spill_dir();
        let name = match self.kind {
            TargetKind::File if self.spill_dir.is_none() => self.dest.clone(),
            _ => PathBuf::from("hyptrace-spill"),
        };
        temp_in(&dir, &name, suffix, Self::PRIVATE)
            .map(Temp)
            .map_err(|e| OutputError::io(&dir, e))
    }
}

/// The process's count of interrupting signals ([`set_wait_interrupt`]).
static WAIT_INTERRUPT: std::sync::OnceLock<WaitHooks> = std::sync::OnceLock::new();

/// [`set_wait_interrupt`]'s signal count and its "waiting" notice.
type WaitHooks = (fn() -> u64, fn(&Path));

/// How often [`OutputTarget::open`] of a FIFO without a reader checks again.
const FIFO_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Lets a signal end the wait of [`OutputTarget::open`] for a FIFO's reader: `count`
/// returns how many interrupting signals (e.g. Ctrl-C) the process has seen; when it
/// changes during the wait, the open fails with [`io::ErrorKind::Interrupted`];
/// `waiting(path)` is called once when a wait begins (to tell the user). Set once per
/// process (later calls are ignored); without it the wait lasts until a reader comes.
pub fn set_wait_interrupt(count: fn() -> u64, waiting: fn(&Path)) {
    let _ = WAIT_INTERRUPT.set((count, waiting));
}

/// Opens a device or FIFO for writing. A FIFO is opened without blocking, again
/// every [`FIFO_POLL`] while it has no reader (ENXIO), so a signal
/// ([`set_wait_interrupt`]) ends the wait; once a reader is there it is opened for
/// blocking writes.
fn open_stream(dest: &Path) -> io::Result<File> {
    let signals = || WAIT_INTERRUPT.get().map_or(0, |f| f.0());
    let before = signals();
    let mut told = false;
    // Bounded by the reader's coming or a signal (waiting for the reader is the point).
    loop {
        match OpenOptions::new()
            .write(true)
            .custom_flags(O_NONBLOCK)
            .open(dest)
        {
            // A device, or a FIFO with a reader: the blocking open returns at once
            // (the probe keeps the FIFO open meanwhile).
            Ok(probe) => {
                let f = OpenOptions::new().write(true).open(dest);
                drop(probe);
                return f;
            }
            Err(e) if e.raw_os_error() == Some(ENXIO) => {
                if !std::mem::replace(&mut told, true) {
                    if let Some((_, waiting)) = WAIT_INTERRUPT.get() {
                        waiting(dest);
                    }
                }
                if signals() != before {
                    return Err(io::Error::new(
                        io::ErrorKind::Interrupted,
                        "interrupted while waiting for a reader of the FIFO",
                    ));
                }
                std::thread::sleep(FIFO_POLL);
            }
            Err(e) => return Err(e),
        }
    }
}

/// ENXIO: a FIFO opened for writing without blocking has no reader.
const ENXIO: i32 = 6;

/// Set once a write to stdout met a closed pipe (process-wide, as stdout is).
static STDOUT_CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a write to stdout (an [`OutputFile`] of `-`) found its reader gone: the
/// output since then was discarded.
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Stdout, its reader's going away no error: from the first broken pipe on, writes
/// are discarded and [`stdout_closed`] is true — the one stdout-closed mechanism of
/// every command (an [`OutputFile`] of `-` writes through it; `hyptrace run` writes its
/// lines through it).
pub struct QuietStdout(io::Stdout);

impl Default for QuietStdout {
    fn default() -> Self {
        Self(io::stdout())
    }
}

impl QuietStdout {
    fn quiet<T>(r: io::Result<T>, or: T) -> io::Result<T> {
        match r {
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {
                STDOUT_CLOSED.store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(or)
            }
            r => r,
        }
    }
}

impl Write for QuietStdout {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if stdout_closed() {
            return Ok(buf.len());
        }
        Self::quiet(self.0.write(buf), buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        if stdout_closed() {
            return Ok(());
        }
        Self::quiet(self.0.flush(), ())
    }
}

/// A temporary file written through its `File` (NamedTempFile's own `Write` wraps errors
/// in a second layer that hides the OS error code); removed when dropped.
pub(crate) struct Temp(pub(crate) NamedTempFile);

impl Temp {
    pub(crate) fn path(&self) -> &Path {
        self.0.path()
    }

    pub(crate) fn file_mut(&mut self) -> &mut File {
        self.0.as_file_mut()
    }
}

impl HasFile for Temp {
    fn file(&self) -> &File {
        self.0.as_file()
    }
}

enum Inner {
    Temp(BlockWriter<Temp>),
    Stream(BufWriter<File>),
    Stdout(BufWriter<QuietStdout>),
    /// Failed or finished: nothing more is written.
    Closed,
}

/// An open output ([`OutputTarget::open`]): `Write` into it, then [`OutputFile::finish`].
/// A write error removes the temporary file at once; dropped unfinished, it removes it.
pub struct OutputFile {
    target: OutputTarget,
    inner: Inner,
}

impl OutputFile {
    /// The target.
    pub fn target(&self) -> &OutputTarget {
        &self.target
    }

    /// Whether a write failed or the file was finished.
    pub fn is_closed(&self) -> bool {
        matches!(self.inner, Inner::Closed)
    }

    /// The error for an `io::Error` from writing this output: the path as the user gave
    /// it with the OS error as source, or [`OutputError::Closed`] for writes after a
    /// failure (the first error already said why).
    pub fn error(&self, e: io::Error) -> OutputError {
        if Marker::Closed.is(&e) {
            OutputError::Closed
        } else {
            OutputError::io(&self.target.path, e)
        }
    }

    /// A second handle on the file for positioned writes (`write_at`), when the output
    /// is a temporary file (a regular file's): `None` for a device, FIFO or stdout,
    /// which are written in order. Bytes written through this `OutputFile` (buffered)
    /// and through the handle must not overlap.
    pub(crate) fn positioned(&self) -> Option<io::Result<File>> {
        match &self.inner {
            Inner::Temp(w) => Some(w.get_ref().file().try_clone()),
            _ => None,
        }
    }

    /// Stops writing: the temporary file is removed, buffered bytes are discarded.
    fn abort(&mut self) {
        match std::mem::replace(&mut self.inner, Inner::Closed) {
            Inner::Temp(w) => {
                let t = w.into_discarded();
                let _ = t.0.close();
            }
            Inner::Stream(w) => drop(w.into_parts()),
            Inner::Stdout(w) => drop(w.into_parts()),
            Inner::Closed => {}
        }
    }

    /// Flushes, syncs and (regular file) renames the temporary file over the target.
    /// On any error the temporary file is removed and the error returned.
    pub fn finish(mut self) -> Result<(), OutputError> {
        let path = self.target.path.clone();
        let io = |e: io::Error| OutputError::io(&path, e);
        match std::mem::replace(&mut self.inner, Inner::Closed) {
            Inner::Temp(w) => {
                // An error drops the temporary file (NamedTempFile removes it).
                let t = w.into_inner().map_err(io)?;
                t.file().sync_all().map_err(io)?;
                t.0.persist(&self.target.dest)
                    .map_err(|e| OutputError::io(&self.target.dest, e.error))?;
                Ok(())
            }
            Inner::Stream(w) => {
                w.into_inner().map_err(|e| io(e.into_error()))?;
                Ok(())
            }
            Inner::Stdout(mut w) => w.flush().map_err(io),
            Inner::Closed => Err(OutputError::Closed),
        }
    }
}

impl OutputFile {
    /// `call` on the open writer; after a failure or `finish` every call fails with the
    /// output's "closed" error ([`Marker::Closed`]), and a failure of its own stops the
    /// output ([`OutputFile::abort`]: the temporary file removed).
    fn guarded<R>(&mut self, call: impl FnOnce(&mut dyn Write) -> io::Result<R>) -> io::Result<R> {
        let w: &mut dyn Write = match &mut self.inner {
            Inner::Temp(w) => w,
            Inner::Stream(w) => w,
            Inner::Stdout(w) => w,
            Inner::Closed => return Err(Marker::Closed.error()),
        };
        let r = call(w);
        if r.as_ref().is_err_and(|e| !Marker::Closed.is(e)) {
            self.abort();
        }
        r
    }
}

impl Write for OutputFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.guarded(|w| w.write(buf))
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.guarded(|w| w.write_all(buf))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.guarded(|w| w.flush())
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        // A temporary file never replaces the target unless finished.
        self.abort();
    }
}
