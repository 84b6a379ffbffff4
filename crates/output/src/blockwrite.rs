//! Sequential writes into a file in blocks ([`BlockWriter`]): where the file system takes
//! `O_DIRECT`, whole aligned blocks go on a thread of the file's own, each through the
//! page cache or through a second descriptor of the file opened with `O_DIRECT` — the
//! way measured faster ([`Pick`]), or always past the cache with `--direct-io`; the
//! unaligned edges (a start inside a block, the tail) go through the page cache.
//!
//! Why (issue 37, docs/benchmarks.md "Fifth session", "Sixth session"): a buffered
//! write copies every byte into page-cache pages, and on the machines this project runs
//! on — virtual machines themselves — fresh page-cache memory is faulted in by the
//! hypervisor below: that copy ran at 0.3–0.9 GB/s, on the core the reader needs, and a
//! record at a quarter of the writer's rate waited seconds for its output. A direct
//! write hands the buffer to the device (1.4–1.7 GB/s here) with no copy and no dirty
//! pages for the kernel's flusher threads to write back later; where memory is warm the
//! page cache is faster.
//!
//! Where the file system refuses `O_DIRECT` (the reopen fails, or a write returns
//! `EINVAL`), every write goes through the page cache instead: only the speed differs.
//! Every byte is written once at its offset, or rewritten with the same bytes (a tail
//! written by [`BlockWriter::flush`] is written again with the block it begins), so a
//! fallback in the middle of a block never changes what the file holds.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::Marker;

/// Alignment of a direct write's memory, length and file offset: x86_64's page size
/// (the one target), a multiple of the logical block size of the devices Linux runs
/// on. A direct write covering only whole pages of its own stream rests on it.
const ALIGN: usize = 4096;

/// Bytes buffered with `--direct-io`: one direct write when full (4 MiB wrote 1.4 GB/s
/// here where 1 MiB wrote 1.1–1.4, one write at a time).
const BLOCK: usize = 4 << 20;
/// Bytes buffered otherwise (`BufWriter`'s size before): each full block goes the way
/// [`Pick`] chooses.
const CACHED_BLOCK: usize = 1 << 20;

/// What a [`BlockWriter`] writes into: something holding an open file.
pub(crate) trait HasFile {
    /// The file (opened for writing).
    fn file(&self) -> &File;
}

impl HasFile for File {
    fn file(&self) -> &File {
        self
    }
}

/// An aligned buffer: `mem[base..base + cap]` (`mem` holds `cap + ALIGN` bytes).
pub(crate) struct Block {
    mem: Vec<u8>,
    base: usize,
}

impl Block {
    fn new(cap: usize) -> Self {
        let mem = vec![0u8; cap + ALIGN];
        // `align_offset` of a u8 pointer to a power of two is always computable.
        let base = mem.as_ptr().align_offset(ALIGN);
        Self { mem, base }
    }

    /// The first `n` bytes.
    fn get(&self, n: usize) -> &[u8] {
        &self.mem[self.base..self.base + n]
    }

    /// Bytes `from..to`, for writing.
    fn get_mut(&mut self, from: usize, to: usize) -> &mut [u8] {
        &mut self.mem[self.base + from..self.base + to]
    }
}

/// Blocks queued for the writer thread at most (the queue's bound); with the one it
/// writes and the one filling, a writer holds at most `IN_FLIGHT + 2` blocks (3 MiB,
/// 12 MiB with `--direct-io`):
/// the writer goes on filling while the device writes (a writer that waited for each
/// write — a compression worker — made a 50 % record wait seconds for the disk).
const IN_FLIGHT: usize = 1;

/// A job for the writer thread: a block, how many of its bytes to write, and where.
pub(crate) type Job = (Block, usize, u64);
/// A block back from the writer thread, with its write's result.
pub(crate) type Done = (Block, io::Result<()>);

/// The writer thread is gone (it panicked); see [`gone`].
pub(crate) struct Gone;

/// The hand-off between a [`BlockWriter`] and the thread writing its blocks (B1 in
/// docs/design.md): jobs go over in order, at most [`IN_FLIGHT`] waiting; each block
/// comes back with its write's result. [`Thread`] is the real one; the model in the
/// tests steps a thread of its own choosing.
pub(crate) trait Courier: Sized {
    /// The thread, writing the `ways` given (its handles on the file; `cached` the page
    /// cache's); `None` if no thread can be made.
    fn start(ways: Ways, cached: File) -> Option<Self>;
    /// Hands `job` over, waiting while [`IN_FLIGHT`] are waiting.
    fn send(&mut self, job: Job) -> Result<(), Gone>;
    /// A block back, waiting for one if `wait` (`None`: none is back yet).
    fn recv(&mut self, wait: bool) -> Result<Option<Done>, Gone>;
}

/// What the writer thread does with a job: writes it (see [`Ways::write`]) and gives
/// the block back.
fn write_job(ways: &mut Ways, cached: &File, (block, n, pos): Job) -> Done {
    let r = ways.write(cached, block.get(n), pos);
    (block, r)
}

/// The real writer thread ("hyptrace-io"): a bounded queue in, a queue of blocks back.
/// Ends (joined, after the write it is in; a job still queued is not written) when
/// dropped.
pub(crate) struct Thread {
    jobs: Option<SyncSender<Job>>,
    done: Option<Receiver<Done>>,
    thread: Option<JoinHandle<()>>,
}

impl Courier for Thread {
    fn start(mut ways: Ways, cached: File) -> Option<Self> {
        let (jobs, rx) = mpsc::sync_channel::<Job>(IN_FLIGHT);
        let (tx, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("hyptrace-io".into())
            .spawn(move || {
                for job in rx {
                    if tx.send(write_job(&mut ways, &cached, job)).is_err() {
                        return;
                    }
                }
            })
            .ok()?;
        Some(Self {
            jobs: Some(jobs),
            done: Some(done),
            thread: Some(thread),
        })
    }

    fn send(&mut self, job: Job) -> Result<(), Gone> {
        let jobs = self.jobs.as_ref().ok_or(Gone)?;
        jobs.send(job).map_err(|_| Gone)
    }

    fn recv(&mut self, wait: bool) -> Result<Option<Done>, Gone> {
        let done = self.done.as_ref().ok_or(Gone)?;
        if wait {
            return done.recv().map(Some).map_err(|_| Gone);
        }
        match done.try_recv() {
            Ok(d) => Ok(Some(d)),
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(Gone),
        }
    }
}

impl Drop for Thread {
    /// Closes both queues and waits for the thread: it finishes the write it is in,
    /// then finds no one to give the block back to and ends.
    fn drop(&mut self) {
        self.jobs = None;
        self.done = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Blocks written by a thread of their own (through `C`), one after the other, while
/// the caller fills the next (B1: the blocks a caller holds are
/// bounded, every block handed over is written before [`Flight::settle`] returns, and
/// every write's error reaches the caller).
struct Flight<C> {
    courier: C,
    in_flight: usize,
    /// Blocks back from the thread, and how many were ever made.
    spare: Vec<Block>,
    made: usize,
}

impl<C: Courier> Flight<C> {
    /// The thread writing the `ways` given and through a handle of its own on `cached`
    /// (the same file); `None` if no thread or no second handle can be made.
    fn start(ways: Ways, cached: &File) -> Option<Self> {
        let cached = cached.try_clone().ok()?;
        C::start(ways, cached).map(|courier| Self {
            courier,
            in_flight: 0,
            spare: Vec::new(),
            made: 0,
        })
    }

    /// Takes a block back from the thread (`wait`: waiting for one); its write's error.
    fn take_back(&mut self, wait: bool) -> io::Result<bool> {
        let Some((block, r)) = self.courier.recv(wait).map_err(|Gone| gone())? else {
            return Ok(false);
        };
        self.in_flight -= 1;
        self.spare.push(block);
        r.map(|()| true)
    }

    /// A block to fill next: one back from the thread, a new one while fewer than
    /// `IN_FLIGHT + 1` were made (besides the first), else the first the thread gives
    /// back.
    fn next_block(&mut self, cap: usize) -> io::Result<Block> {
        while self.in_flight > 0 && self.take_back(false)? {}
        if let Some(b) = self.spare.pop() {
            return Ok(b);
        }
        if self.made <= IN_FLIGHT {
            self.made += 1;
            return Ok(Block::new(cap));
        }
        self.take_back(true)?;
        self.spare.pop().ok_or_else(gone)
    }

    /// Hands over the first `n` bytes of `block`, for file offset `pos`.
    fn send(&mut self, block: Block, n: usize, pos: u64) -> io::Result<()> {
        self.courier.send((block, n, pos)).map_err(|Gone| gone())?;
        self.in_flight += 1;
        Ok(())
    }

    /// Waits for every block in flight; the first error among them.
    fn settle(&mut self) -> io::Result<()> {
        let mut first = Ok(());
        // Seeded bug (docs/fuzzing.md): one block left in flight; the model catches it.
        let left = usize::from(cfg!(hyptrace_seeded_bug_flush_early));
        while self.in_flight > left {
            if let Err(e) = self.take_back(true) {
                if Marker::ThreadGone.is(&e) {
                    return Err(e);
                }
                first = first.and(Err(e));
            }
        }
        first
    }
}

/// The error of a writer thread that is gone (it panicked), told from a write's own
/// `EPIPE` by [`Marker::is`].
fn gone() -> io::Error {
    Marker::ThreadGone.error()
}

/// Of every `PROBE` blocks [`Pick`] writes one the way it did not choose, so a change of
/// either way's speed is seen.
const PROBE: u64 = 16;

/// The way whole blocks go when `--direct-io` does not say: the faster of the page cache
/// and past it, as the last writes each way measured (bytes over seconds of the write
/// calls, both sums halved at each new write, so a block weighs by its size and the
/// latest count most), trying each once first and the
/// slower one block in [`PROBE`] (docs/benchmarks.md, "Sixth session": on a VM whose
/// freed memory the hypervisor takes back, writes into fresh page-cache pages went 0.3–0.5
/// GB/s under load and past it 1.4 GB/s; on a host with warm memory the page cache takes
/// several GB/s, and a slow disk throttles it no more than a direct write waits).
#[derive(Clone, Debug, Default)]
pub(crate) struct Pick {
    /// Bytes and seconds through the page cache (`[0]`) and past it (`[1]`), decayed.
    sums: [Option<(f64, f64)>; 2],
    /// Blocks written.
    blocks: u64,
}

impl Pick {
    /// Whether the next block goes past the page cache.
    fn past_cache(&mut self) -> bool {
        self.blocks += 1;
        match self.sums {
            [None, _] => false,
            [_, None] => true,
            [Some((cb, cs)), Some((pb, ps))] => {
                // past faster: pb / ps > cb / cs (every sum > 0)
                (pb * cs > cb * ps) != self.blocks.is_multiple_of(PROBE)
            }
        }
    }

    /// A block of `bytes` written (`past`: past the page cache) in `took`.
    fn took(&mut self, past: bool, bytes: usize, took: Duration) {
        let (b, t) = (bytes as f64, took.as_secs_f64().max(1e-9));
        let e = &mut self.sums[usize::from(past)];
        *e = Some(e.map_or((b, t), |(ob, ot)| (ob / 2.0 + b, ot / 2.0 + t)));
    }
}

/// How whole blocks are written: past the page cache through `direct` (a descriptor of
/// the file opened with `O_DIRECT`, `None` once refused) — always (`--direct-io`), or
/// where `pick` chooses it.
pub(crate) struct Ways {
    direct: Option<File>,
    pick: Option<Pick>,
}

impl Ways {
    /// Writes the block `bytes` at `pos`, past the page cache or through `cached`.
    fn write(&mut self, cached: &File, bytes: &[u8], pos: u64) -> io::Result<()> {
        let past = self.direct.is_some() && self.pick.as_mut().is_none_or(Pick::past_cache);
        let t = Instant::now();
        if past {
            write_past_cache(&mut self.direct, cached, bytes, pos)?;
        } else {
            cached.write_all_at(bytes, pos)?;
        }
        if let Some(p) = &mut self.pick {
            // A refused direct write went through the page cache: measured as that.
            p.took(past && self.direct.is_some(), bytes.len(), t.elapsed());
        }
        Ok(())
    }
}

/// Writes `bytes` at `pos` through `direct`, or — once the file system refused it
/// (`EINVAL`: alignment, no `O_DIRECT`), this write and every later one — through
/// `cached`, from the block's start.
fn write_past_cache(
    direct: &mut Option<File>,
    cached: &File,
    bytes: &[u8],
    pos: u64,
) -> io::Result<()> {
    if let Some(d) = direct {
        match d.write_all_at(bytes, pos) {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => *direct = None,
            Err(e) => return Err(e),
        }
    }
    cached.write_all_at(bytes, pos)
}

/// How whole blocks are written.
enum Way<C> {
    /// Through the page cache, on the caller's thread (`O_DIRECT` refused, no thread).
    Cached,
    /// Before the first whole block (`forced`: `--direct-io`); then the `O_DIRECT`
    /// descriptor and the thread are made.
    Pending { forced: bool },
    /// The ways made, the thread not yet (the model starts here).
    Ready(Box<Ways>),
    /// As [`Ways`] says, on a thread of its own.
    Flight(Box<Flight<C>>),
}

/// A buffered writer of a byte stream into a file from an offset on, whole aligned
/// blocks on a thread of its own (each through the page cache or past it, the next
/// block filling meanwhile). [`Write::flush`] writes everything buffered (the tail
/// through the page cache) and keeps the tail, so writing on after it keeps the blocks
/// aligned. After an error every call fails: the stream has a hole.
pub(crate) struct BlockWriter<T, C = Thread> {
    inner: T,
    way: Way<C>,
    failed: bool,
    /// The block filling.
    cur: Block,
    cap: usize,
    /// File offset of the block's first byte.
    pos: u64,
    /// Bytes in it.
    len: usize,
}

impl<T: HasFile> BlockWriter<T> {
    /// Writes into `inner`'s file from offset `start` on; where the file system allows
    /// `O_DIRECT`, whole blocks past the page cache — always if `direct`
    /// (`--direct-io`), else where [`Pick`] measures that faster.
    pub(crate) fn new(inner: T, start: u64, direct: bool) -> Self {
        let cap = if direct { BLOCK } else { CACHED_BLOCK };
        Self::with(inner, start, Way::Pending { forced: direct }, cap)
    }
}

impl<T: HasFile, C: Courier> BlockWriter<T, C> {
    /// Writes into `inner`'s file from offset `start` on, whole blocks the `way` given,
    /// `cap` bytes buffered.
    fn with(inner: T, start: u64, way: Way<C>, cap: usize) -> Self {
        Self {
            inner,
            way,
            failed: false,
            cur: Block::new(cap),
            cap,
            pos: start,
            len: 0,
        }
    }

    /// What is written into.
    pub(crate) fn get_ref(&self) -> &T {
        &self.inner
    }

    /// What is written into (writing through it must not overlap this stream).
    pub(crate) fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// Writes out everything buffered and gives back what was written into.
    pub(crate) fn into_inner(mut self) -> io::Result<T> {
        self.flush()?;
        // The thread, if any, is joined.
        self.way = Way::Cached;
        Ok(self.inner)
    }

    /// What was written into, the buffered bytes dropped (a failed output; a write in
    /// flight is waited for).
    pub(crate) fn into_discarded(mut self) -> T {
        self.way = Way::Cached;
        self.inner
    }

    /// Whether whole blocks may go past the page cache (the `O_DIRECT` descriptor and
    /// the thread were made; for tests).
    #[cfg(test)]
    fn is_direct(&self) -> bool {
        match &self.way {
            Way::Flight(_) => true,
            Way::Ready(w) => w.direct.is_some(),
            Way::Cached | Way::Pending { .. } => false,
        }
    }

    /// Writes out what can go in aligned pieces: the head up to an aligned offset
    /// through the page cache (once: the start), then every whole aligned piece past
    /// it; less than `ALIGN` bytes stay buffered.
    fn drain(&mut self) -> io::Result<()> {
        let mis = (self.pos % ALIGN as u64) as usize;
        if mis != 0 {
            let head = (ALIGN - mis).min(self.len);
            self.inner
                .file()
                .write_all_at(self.cur.get(head), self.pos)?;
            self.consume(head);
        }
        let whole = self.len / ALIGN * ALIGN;
        if whole == 0 {
            return Ok(());
        }
        self.start_flight();
        match &mut self.way {
            Way::Flight(f) => {
                let mut next = f.next_block(self.cap)?;
                let tail = self.len - whole;
                next.get_mut(0, tail)
                    .copy_from_slice(&self.cur.get(self.len)[whole..]);
                let full = std::mem::replace(&mut self.cur, next);
                f.send(full, whole, self.pos)?;
                self.pos += whole as u64;
                self.len = tail;
            }
            Way::Cached | Way::Pending { .. } | Way::Ready(_) => {
                self.inner
                    .file()
                    .write_all_at(self.cur.get(whole), self.pos)?;
                self.consume(whole);
            }
        }
        Ok(())
    }

    /// At the first whole block: the `O_DIRECT` descriptor and the thread that writes
    /// the blocks; if either cannot be made (refused, out of descriptors or threads),
    /// every block goes through the page cache on this thread, from then on.
    fn start_flight(&mut self) {
        if let Way::Pending { forced } = self.way {
            self.way = match reopen_direct(self.inner.file()) {
                Some(f) => Way::Ready(Box::new(Ways {
                    direct: Some(f),
                    pick: (!forced).then(Pick::default),
                })),
                None => Way::Cached,
            };
        }
        match std::mem::replace(&mut self.way, Way::Cached) {
            Way::Ready(ways) => {
                if let Some(f) = Flight::start(*ways, self.inner.file()) {
                    self.way = Way::Flight(Box::new(f));
                }
            }
            way => self.way = way,
        }
    }

    /// Drops the first `n` buffered bytes (written), moving the rest to the start.
    fn consume(&mut self, n: usize) {
        let (b, len) = (self.cur.base, self.len);
        self.cur.mem.copy_within(b + n..b + len, b);
        self.pos += n as u64;
        self.len -= n;
    }
}

impl<T: HasFile, C: Courier> Write for BlockWriter<T, C> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.unless_failed(|w| w.put(buf))
    }

    /// Writes everything buffered (and waits for the blocks in flight); the unaligned
    /// tail (through the page cache) stays buffered too, to be written again with the
    /// block it begins.
    fn flush(&mut self) -> io::Result<()> {
        self.unless_failed(Self::write_out)
    }
}

impl<T: HasFile, C: Courier> BlockWriter<T, C> {
    /// `call`, unless an earlier call failed (then the stream has a hole: every later
    /// call fails, with the output's "closed" error, [`Marker::Closed`]).
    fn unless_failed<R>(&mut self, call: impl FnOnce(&mut Self) -> io::Result<R>) -> io::Result<R> {
        if self.failed {
            return Err(Marker::Closed.error());
        }
        let r = call(self);
        self.failed = r.is_err();
        r
    }

    /// [`Write::write`], before the check for an earlier error.
    fn put(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.len == self.cap {
            self.drain()?;
        }
        // Through the page cache, a write as large as the buffer goes straight through
        // (as `BufWriter` does: no copy of a batch of pages).
        if matches!(self.way, Way::Cached) && self.len == 0 && buf.len() >= self.cap {
            self.inner.file().write_all_at(buf, self.pos)?;
            self.pos += buf.len() as u64;
            return Ok(buf.len());
        }
        let n = (self.cap - self.len).min(buf.len());
        self.cur
            .get_mut(self.len, self.len + n)
            .copy_from_slice(&buf[..n]);
        self.len += n;
        Ok(n)
    }

    /// [`Write::flush`], before the check for an earlier error.
    fn write_out(&mut self) -> io::Result<()> {
        self.drain()?;
        if let Way::Flight(f) = &mut self.way {
            f.settle()?;
        }
        if self.len > 0 {
            self.inner
                .file()
                .write_all_at(self.cur.get(self.len), self.pos)?;
        }
        Ok(())
    }
}

/// `file` opened again for writing with `O_DIRECT` (through `/proc/self/fd`: the same
/// file, whatever its name now); `None` if that is refused.
fn reopen_direct(file: &File) -> Option<File> {
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// Pseudo-random bytes (xorshift), reproducible from `seed`.
    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn contents(f: &mut File) -> Vec<u8> {
        let mut v = Vec::new();
        io::Seek::seek(f, io::SeekFrom::Start(0)).unwrap();
        f.read_to_end(&mut v).unwrap();
        v
    }

    /// Whatever the start, the write sizes and the flushes between them, the file holds
    /// the stream at its offset, bytes before it untouched — past the page cache or not.
    #[test]
    fn the_file_holds_the_stream_at_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            (0u64, 3 * BLOCK + 17, 4096usize),
            (13, 2 * BLOCK + 5000, 777),
            (4095, BLOCK, BLOCK + 3),
            (4096, 3 * BLOCK, 1 << 16),
            (BLOCK as u64 + 100, 5 * 4096 + 1, 1),
            (7, 10, 3),
        ];
        for (i, &(start, total, step)) in cases.iter().enumerate() {
            for direct in [true, false] {
                let path = dir.path().join(format!("f{i}{direct}"));
                let mut f = File::options()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&path)
                    .unwrap();
                let before = bytes(99, start as usize);
                f.write_all_at(&before, 0).unwrap();
                let data = bytes(i as u64 + 1, total);
                let mut w = BlockWriter::new(f.try_clone().unwrap(), start, direct);
                // Where the file system takes O_DIRECT (checked on its own), it is used.
                let takes = reopen_direct(&f).is_some();
                for (k, piece) in data.chunks(step).enumerate() {
                    w.write_all(piece).unwrap();
                    if k % 97 == 5 {
                        w.flush().unwrap();
                    }
                }
                // Where the file system takes O_DIRECT, blocks may go past the cache
                // (always with `direct`, else as measured faster) from the first whole
                // block on.
                w.flush().unwrap();
                let head = (ALIGN - start as usize % ALIGN) % ALIGN;
                let blocks = total >= head + ALIGN;
                assert_eq!(w.is_direct(), takes && blocks, "case {i}");
                drop(w.into_inner().unwrap());
                let got = contents(&mut f);
                assert_eq!(got.len(), before.len() + data.len(), "case {i}");
                assert!(got[..before.len()] == before[..], "case {i}: head");
                assert!(got[before.len()..] == data[..], "case {i}: stream");
            }
        }
    }

    /// After a failed write every later call fails: the stream has a hole, and a retry
    /// that succeeded would make the file look whole.
    #[test]
    fn an_error_is_for_good() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ro");
        std::fs::write(&path, b"").unwrap();
        // Read-only: every write fails (EBADF), whichever way.
        let f = File::open(&path).unwrap();
        let mut w = BlockWriter::new(f, 0, false);
        let data = bytes(3, 3 * CACHED_BLOCK);
        let first = w.write_all(&data).and_then(|()| w.flush());
        assert!(first.is_err(), "a read-only file took the writes");
        let again = w.write(b"x").expect_err("a write after the error");
        assert!(Marker::Closed.is(&again), "{again}");
        assert!(w.flush().is_err());
        assert!(w.into_inner().is_err());
    }

    /// Without `--direct-io` each block goes the faster way: each tried once first,
    /// then the faster, and the slower again one block in `PROBE`; a way that slows
    /// down loses its place.
    #[test]
    fn the_faster_way_is_picked_and_the_other_probed() {
        let ms = Duration::from_millis;
        let mut p = Pick::default();
        assert!(!p.past_cache(), "the page cache first");
        p.took(false, 4 << 20, ms(10));
        assert!(p.past_cache(), "then past it");
        p.took(true, 4 << 20, ms(3));
        let ways: Vec<bool> = (2..=2 * PROBE).map(|_| p.past_cache()).collect();
        let cached = ways.iter().filter(|&&w| !w).count();
        assert_eq!(cached, 2, "the slower way once in {PROBE}: {ways:?}");
        // Past the cache slows down (a disk that fills its cache): the page cache wins.
        for _ in 0..4 {
            p.took(true, 4 << 20, ms(40));
        }
        let ways: Vec<bool> = (0..PROBE).map(|_| p.past_cache()).collect();
        assert_eq!(ways.iter().filter(|&&w| w).count(), 1, "{ways:?}");
    }

    /// On a file system that takes `O_DIRECT` (the build's, as here), whole blocks go
    /// past the page cache: the reopen succeeds and survives a stream's writes.
    #[test]
    fn whole_blocks_go_direct_where_the_file_system_allows() {
        let dir = tempfile::tempdir().unwrap();
        let f = tempfile::tempfile_in(dir.path()).unwrap();
        if reopen_direct(&f).is_none() {
            eprintln!("SKIP: this file system refuses O_DIRECT");
            return;
        }
        let mut w = BlockWriter::new(f, 0, true);
        assert!(!w.is_direct(), "made at the first whole block");
        w.write_all(&bytes(5, 2 * BLOCK)).unwrap();
        w.flush().unwrap();
        assert!(w.is_direct(), "the thread and the O_DIRECT descriptor");
    }

    /// A direct write the file system refuses (`EINVAL`: here a misaligned buffer) is
    /// written whole through the page cache, and so is every later one.
    #[test]
    fn a_refused_direct_write_goes_through_the_page_cache() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = tempfile::tempfile_in(dir.path()).unwrap();
        let Some(d) = reopen_direct(&f) else {
            eprintln!("SKIP: this file system refuses O_DIRECT");
            return;
        };
        let data = bytes(7, 3 * ALIGN + 1);
        let mut direct = Some(d);
        // One byte in: not aligned in memory, refused past the cache.
        write_past_cache(&mut direct, &f, &data[1..=2 * ALIGN], 0).unwrap();
        assert!(
            direct.is_none(),
            "refused once, the page cache from then on"
        );
        write_past_cache(&mut direct, &f, &data[..ALIGN], 2 * ALIGN as u64).unwrap();
        let got = contents(&mut f);
        assert!(got[..2 * ALIGN] == data[1..=2 * ALIGN]);
        assert!(got[2 * ALIGN..] == data[..ALIGN]);
    }
}
