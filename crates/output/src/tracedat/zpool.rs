//! Compression workers of the zstd trace.dat writer: the sink's thread queues each full
//! batch of chunks of a CPU on one queue that every worker thread takes from (whichever
//! is free: one CPU fed alone, as `convert` feeds a trace.dat, keeps every worker busy,
//! and a worker held off its core by the sink's thread holds up no other), which makes
//! its guest strings safe (G2), compresses it chunk by chunk, and appends the chunk
//! records to its CPU's data itself — in the CPU's order: a batch numbered `n` of its
//! CPU is written once batch `n - 1` is. A batch compressed before its turn is parked
//! with its CPU ([`Slot::hand_in`]) and the worker goes on with the next batch; the
//! worker that finds no other writing the CPU's data becomes its writer and writes
//! every batch whose turn has come, telling the sink's thread of each as it is written.
//! The hand-off ([`Turns`]) is locked only for a look, never during a write: a worker
//! parking a batch never waits for another's writes (issue 37: writing a run of parked
//! batches under that lock and telling them after the last made the sink's thread, and
//! the other worker, wait for the whole run). No compression and no `write(2)` of CPU
//! data runs on the sink's thread. At most twice [`ZPool::limit`]
//! batches are in flight (memory: that many batches and their records, buffers
//! recycled; parked batches are in flight); a sink fed by live rings waits at `limit`
//! (below).
//!
//! The level of each batch is chosen when it is handed over ([`ZPool::submit`]): the
//! sink's level, or — for a sink fed by live rings ([`crate::PageSink::set_live`]) whose
//! workers are behind (half of `limit` batches in flight) — the catch-up level, which
//! stores at about memory speed, up to twice `limit` batches in flight: the workers
//! catch up instead of making the rings wait (a larger file, no lost events).
//!
//! No wait is for ever: workers wait only for the queue, which closes when the pool is
//! dropped; a worker that panicked is seen by the sink's thread (its batches never come
//! back) within 100 ms.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use super::cpuout::{CpuOut, Zstd};
use super::params::{batch_chunks, ZSTD_CHUNK_BYTES};
use super::strings::StringFields;
use crate::OutputError;

/// Where a CPU's data goes straight into the output ([`CpuOut::go_direct`]), told
/// with its first chunk.
pub(super) struct DirectTo {
    pub(super) file: std::fs::File,
    pub(super) path: std::path::PathBuf,
    pub(super) start: u64,
    pub(super) prefix: usize,
}

/// Batch `seq` of CPU `cpu` (`data[..len]`) to compress at `level` into `out`; both
/// buffers come back in [`Done`].
struct Job {
    cpu: usize,
    seq: u64,
    data: Vec<u8>,
    len: usize,
    level: i32,
    direct: Option<DirectTo>,
    out: Vec<u8>,
}

/// A job compressed, waiting for its turn at its CPU's data: its records
/// `job.out[..used]` (`n` chunks), or zstd's error; the string bytes it replaced.
struct Ready {
    job: Job,
    records: Result<(usize, u32), std::io::Error>,
    replaced: u64,
}

/// A batch written (or the error): its CPU's bytes written so far, the string bytes it
/// replaced, and its buffers.
struct Done {
    cpu: usize,
    bytes: u64,
    data: Vec<u8>,
    out: Vec<u8>,
    err: Option<OutputError>,
    replaced: u64,
}

/// The hand-off of one CPU's compressed batches to its data, in their order: the number
/// of the next batch to write, the batches compressed before their turn (at most the
/// batches in flight), and whether a worker is writing them. Held only for a look, never
/// during a write: a worker that parks a batch does not wait for another's writes.
#[derive(Debug)]
struct Turns<T> {
    next: u64,
    parked: Vec<(u64, T)>,
    writing: bool,
}

impl<T> Turns<T> {
    fn new() -> Self {
        Self {
            next: 0,
            parked: Vec::new(),
            writing: false,
        }
    }

    /// Batch `seq` (`item`) is compressed: parks it; whether the caller is now the
    /// writer (no worker was writing).
    fn arrive(&mut self, seq: u64, item: T) -> bool {
        self.parked.push((seq, item));
        !std::mem::replace(&mut self.writing, true)
    }

    /// The writer's next batch, if it is parked; else `None`, and the caller is no
    /// longer the writer — decided in the same look, so that a batch parked meanwhile is
    /// never left behind (its worker saw a writer, the writer sees the batch).
    fn take(&mut self) -> Option<T> {
        let at = self.parked.iter().position(|(s, _)| *s == self.next);
        let Some(at) = at else {
            self.writing = false;
            return None;
        };
        self.next = self.next.saturating_add(1);
        Some(self.parked.swap_remove(at).1)
    }
}

/// One CPU's data, and whether a batch written into it failed (the batches after it
/// are not written).
struct Written {
    out: CpuOut,
    failed: bool,
}

impl Written {
    /// Writes ready batch `r` (its turn has come) into the CPU's data; what the sink's
    /// thread is told.
    fn write(&mut self, r: Ready) -> Done {
        let Ready {
            mut job,
            records,
            replaced,
        } = r;
        if self.failed {
            return done(job, self.out.bytes, Some(dead()), replaced);
        }
        let res = (|| {
            let (used, n) = records.map_err(|e| self.out.zstd_err(e))?;
            if let Some(d) = job.direct.take() {
                self.out.go_direct(d.file, &d.path, d.start, d.prefix)?;
            }
            self.out.append(job.out.get(..used).ok_or_else(dead)?)?;
            self.out.chunks += n;
            Ok(())
        })();
        self.failed = res.is_err();
        done(job, self.out.bytes, res.err(), replaced)
    }
}

/// One CPU: its hand-off and its data.
struct Slot {
    turns: Mutex<Turns<Ready>>,
    /// Locked only by the worker that is the writer ([`Turns::take`]).
    written: Mutex<Written>,
}

impl Slot {
    fn new(out: CpuOut) -> Self {
        Self {
            turns: Mutex::new(Turns::new()),
            written: Mutex::new(Written { out, failed: false }),
        }
    }

    /// Hands compressed batch `r` to the CPU: parks it and, if no other worker is
    /// writing, writes every batch whose turn has come, each told (`tell`) as soon as
    /// it is written; `false` once `tell` fails (the sink's thread is gone). A slot a
    /// worker poisoned by a panic fails the batch ("worker died").
    fn hand_in(&self, r: Ready, tell: &mut dyn FnMut(Done) -> bool) -> bool {
        let Ok(mut turns) = self.turns.lock() else {
            return tell(lost(r));
        };
        if !turns.arrive(r.job.seq, r) {
            return true;
        }
        drop(turns);
        // Bounded: every step writes a batch in flight (the workers write no more
        // than the sink hands over).
        loop {
            let Some(r) = self.turns.lock().ok().and_then(|mut t| t.take()) else {
                return true;
            };
            let d = match self.written.lock() {
                Ok(mut w) => w.write(r),
                Err(_) => lost(r),
            };
            if !tell(d) {
                return false;
            }
        }
    }
}

/// What the sink's thread is told of a batch that was not written: the worker died.
fn lost(r: Ready) -> Done {
    done(r.job, 0, Some(dead()), r.replaced)
}

/// What the sink's thread is told of `job`.
fn done(job: Job, bytes: u64, err: Option<OutputError>, replaced: u64) -> Done {
    Done {
        cpu: job.cpu,
        bytes,
        data: job.data,
        out: job.out,
        err,
        replaced,
    }
}

/// What the workers share: every CPU's hand-off and data, and the queue.
struct Shared {
    slots: Vec<Slot>,
    jobs: Mutex<Receiver<Job>>,
}

impl Shared {
    /// The next job, or `None` once the queue is closed and empty.
    fn next_job(&self) -> Option<Job> {
        // A worker cannot panic while it holds the queue: a poisoned lock is still sound.
        let rx = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        rx.recv().ok()
    }
}

pub(super) struct ZPool {
    /// The workers' queue (`None` once closed).
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Done>,
    handles: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
    /// Per CPU, the number of its next batch.
    seqs: Vec<u64>,
    in_flight: usize,
    /// Batches in flight before the sink waits (or, live, goes on at the catch-up level).
    limit: usize,
    /// Recycled batch and record buffers (at most `2 × limit`).
    free: Vec<Vec<u8>>,
    free_out: Vec<Vec<u8>>,
    /// Batches handed over at the catch-up level.
    pub(super) caught_up: u64,
    /// Bytes of guest strings the workers replaced, in the batches finished so far.
    replaced: u64,
    /// Each CPU's bytes written, as of the batches finished so far.
    bytes: Vec<u64>,
}

impl ZPool {
    /// `workers` threads (at least one) compressing the batches (pages of `page_size`,
    /// their string fields `strings`) of the CPUs whose data `outs` holds (index = CPU)
    /// with copies of `zstd`; if a thread or a compressor cannot be made, `outs` comes
    /// back untouched (the caller compresses on its own thread).
    pub(super) fn new(
        outs: Vec<CpuOut>,
        workers: usize,
        zstd: &Zstd,
        strings: Arc<StringFields>,
        page_size: usize,
    ) -> Result<Self, Vec<CpuOut>> {
        let workers = workers.max(1);
        // Batches in flight: 4 per worker of small pages' batches, fewer of large ones
        // (the bytes in flight stay those of small pages', at least one batch).
        let batch = zstd.batch_bytes().max(1);
        let small = batch_chunks(1) * ZSTD_CHUNK_BYTES;
        let limit = (4 * workers * small / batch).clamp(1, 4 * workers);
        let n = outs.len();
        // The queue never holds more than the pool's bound, `2 × limit` batches.
        let (tx, rx) = mpsc::sync_channel::<Job>(2 * limit);
        let shared = Arc::new(Shared {
            slots: outs.into_iter().map(Slot::new).collect(),
            jobs: Mutex::new(rx),
        });
        let (done_tx, done) = mpsc::channel::<Done>();
        let mut pool = Self {
            jobs: Some(tx),
            done,
            handles: Vec::new(),
            shared,
            seqs: vec![0; n],
            in_flight: 0,
            limit,
            free: Vec::new(),
            free_out: Vec::new(),
            caught_up: 0,
            replaced: 0,
            bytes: vec![0; n],
        };
        for i in 0..workers {
            let Ok(z) = zstd.fresh() else {
                return Err(pool.into_outs());
            };
            let w = Worker {
                z,
                strings: Arc::clone(&strings),
                page_size,
                shared: Arc::clone(&pool.shared),
                done: done_tx.clone(),
            };
            let spawned = std::thread::Builder::new()
                .name(format!("hyptrace-zstd{i}"))
                .spawn(move || w.work());
            let Ok(h) = spawned else {
                return Err(pool.into_outs());
            };
            pool.handles.push(h);
        }
        Ok(pool)
    }

    /// Closes the queue and joins the workers (each finishes the jobs it took).
    fn join(&mut self) {
        self.jobs = None;
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }

    /// Ends the workers; every CPU's data (index = CPU; a slot a panicking worker
    /// poisoned is taken as it is: the caller only uses it after an error, to drop it).
    fn into_outs(mut self) -> Vec<CpuOut> {
        self.join();
        let (_, rx) = mpsc::sync_channel(0);
        let shared = std::mem::replace(
            &mut self.shared,
            Arc::new(Shared {
                slots: Vec::new(),
                jobs: Mutex::new(rx),
            }),
        );
        match Arc::try_unwrap(shared) {
            Ok(s) => s
                .slots
                .into_iter()
                .map(|s| {
                    let w = s.written.into_inner();
                    w.unwrap_or_else(PoisonError::into_inner).out
                })
                .collect(),
            // Every worker is joined: no other reference is left.
            Err(_) => Vec::new(),
        }
    }

    /// A buffer for the next batch: a recycled one (its old bytes kept: the caller
    /// overwrites what it uses), else an empty one.
    pub(super) fn buffer(&mut self) -> Vec<u8> {
        self.free.pop().unwrap_or_default()
    }

    /// Queues CPU `cpu`'s next batch `data[..len]` at `level`, waiting for a batch to
    /// finish while `2 × limit` are in flight — or, with `catch_up` (live), while `limit`
    /// are, and at the catch-up level while `limit / 2` to `2 × limit` are; `direct` with the CPU's first batch, if its data goes
    /// straight into the output.
    pub(super) fn submit(
        &mut self,
        cpu: usize,
        data: Vec<u8>,
        len: usize,
        level: i32,
        catch_up: Option<i32>,
        direct: Option<DirectTo>,
    ) -> Result<(), OutputError> {
        self.collect()?;
        // Workers behind: a live sink goes on at the catch-up level (its batches cost
        // the workers little) up to twice the limit; otherwise it waits at the limit. A
        // sink fed from a file (no catch-up) waits at twice the limit: a deeper queue
        // keeps the workers fed while the feeding thread waits for a core.
        let (level, most) = match catch_up {
            Some(fast) if 2 * self.in_flight >= self.limit => {
                self.caught_up += 1;
                (fast, 2 * self.limit)
            }
            Some(_) => (level, self.limit),
            None => (level, 2 * self.limit),
        };
        while self.in_flight >= most {
            self.wait_one()?;
        }
        let seq = self.seqs.get_mut(cpu).ok_or_else(dead)?;
        let job = Job {
            cpu,
            seq: *seq,
            data,
            len,
            level,
            direct,
            out: self.free_out.pop().unwrap_or_default(),
        };
        *seq += 1;
        let tx = self.jobs.as_ref().ok_or_else(dead)?;
        tx.send(job).map_err(|_| dead())?;
        self.in_flight += 1;
        Ok(())
    }

    /// Takes every batch finished meanwhile (their errors first).
    fn collect(&mut self) -> Result<(), OutputError> {
        while let Ok(d) = self.done.try_recv() {
            self.finished(d)?;
        }
        Ok(())
    }

    /// Waits for every batch in flight; CPU `cpu`'s bytes written then.
    pub(super) fn settle_cpu(&mut self, cpu: usize) -> Result<u64, OutputError> {
        while self.in_flight > 0 {
            self.wait_one()?;
        }
        Ok(self.bytes.get(cpu).copied().unwrap_or(0))
    }

    /// Waits for every batch in flight, ends the workers and returns every CPU's data
    /// (index = CPU) and the bytes of guest strings they replaced in all.
    pub(super) fn finish(mut self) -> Result<(Vec<CpuOut>, u64), OutputError> {
        while self.in_flight > 0 {
            self.wait_one()?;
        }
        let (n, replaced) = (self.seqs.len(), self.replaced);
        let outs = self.into_outs();
        if outs.len() != n {
            return Err(dead());
        }
        Ok((outs, replaced))
    }

    fn wait_one(&mut self) -> Result<(), OutputError> {
        loop {
            match self.done.recv_timeout(Duration::from_millis(100)) {
                Ok(d) => return self.finished(d),
                // Workers only end when the pool closes their queue: one that ended has
                // panicked, and its batches will never come.
                Err(RecvTimeoutError::Timeout) if self.handles.iter().any(|h| h.is_finished()) => {
                    return Err(dead())
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(dead()),
            }
        }
    }

    fn finished(&mut self, d: Done) -> Result<(), OutputError> {
        self.in_flight -= 1;
        self.replaced += d.replaced;
        if let Some(b) = self.bytes.get_mut(d.cpu) {
            *b = (*b).max(d.bytes);
        }
        if self.free.len() < 2 * self.limit {
            self.free.push(d.data);
            self.free_out.push(d.out);
        }
        match d.err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// What a worker thread works with.
struct Worker {
    z: Zstd,
    strings: Arc<StringFields>,
    page_size: usize,
    shared: Arc<Shared>,
    done: mpsc::Sender<Done>,
}

impl Worker {
    /// Makes each job's batch safe (G2), compresses it and hands it to its CPU's data
    /// (written in its turn, [`Slot::take`]); until the queue closes.
    fn work(mut self) {
        while let Some(mut j) = self.shared.next_job() {
            let (replaced, records) = match j.data.get_mut(..j.len) {
                Some(batch) => {
                    let replaced = self.strings.sanitize_pages(batch, self.page_size);
                    let records = self.z.compress_into(batch, j.level, &mut j.out);
                    (replaced, records)
                }
                None => (0, Err(std::io::Error::other("batch past its buffer"))),
            };
            let cpu = j.cpu;
            let r = Ready {
                job: j,
                records,
                replaced,
            };
            let done = &self.done;
            let told = match self.shared.slots.get(cpu) {
                Some(slot) => slot.hand_in(r, &mut |d| done.send(d).is_ok()),
                None => done.send(lost(r)).is_ok(),
            };
            if !told {
                return;
            }
        }
    }
}

fn dead() -> OutputError {
    OutputError::from(std::io::Error::other("zstd compression worker died"))
}

impl Drop for ZPool {
    /// Closes the queue and joins the workers (they finish the jobs queued: at most
    /// `2 × limit`); the CPU data is dropped (spill files removed).
    fn drop(&mut self) {
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use super::super::cpuout::ZSTD_LEVEL;
    use super::super::params::chunk_pages;
    use super::*;
    use std::io::Read;

    const PS: usize = 4096;

    /// A pool of `workers` over `cpus` CPUs' spill files in `dir`, and a compressor like
    /// its workers'.
    fn pool(dir: &std::path::Path, workers: usize, cpus: u32) -> (ZPool, Zstd) {
        let target = crate::OutputTarget::check(dir.join("x.dat")).unwrap();
        let outs = (0..cpus)
            .map(|c| CpuOut::new(&target, c).unwrap())
            .collect();
        let chunk = PS * chunk_pages(PS);
        let z = Zstd::new(chunk, batch_chunks(chunk)).unwrap();
        let strings = Arc::new(StringFields::new(&[]));
        let p = ZPool::new(outs, workers, &z, strings, PS).unwrap_or_else(|_| panic!("pool"));
        (p, z)
    }

    /// Batch `i`: its own bytes (so that batches out of order would show), of a length
    /// that varies (whole pages, at most one batch).
    fn batch(i: usize, most: usize) -> Vec<u8> {
        let pages = (1 + i * 7 % (most / PS)).min(most / PS);
        (0..pages * PS)
            .map(|b| ((b / 64 + i * 31) % 251) as u8)
            .collect()
    }

    fn spilled(o: &mut CpuOut) -> Vec<u8> {
        o.flush().unwrap();
        let mut v = Vec::new();
        o.spill().unwrap().unwrap().read_to_end(&mut v).unwrap();
        v
    }

    /// Batches taken by whichever worker is free and compressed out of order are written
    /// in each CPU's order: each CPU's data is what one compressor writes batch after
    /// batch.
    #[test]
    fn batches_are_written_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (mut p, mut z) = pool(dir.path(), 4, 2);
        let most = z.batch_bytes();
        let mut want = [Vec::new(), Vec::new()];
        for i in 0..96 {
            let (cpu, b) = (i % 3 / 2, batch(i, most));
            let (records, _) = z.compress(&b, ZSTD_LEVEL).unwrap();
            want[cpu].extend_from_slice(records);
            let mut data = p.buffer();
            data.clear();
            data.extend_from_slice(&b);
            p.submit(cpu, data, b.len(), ZSTD_LEVEL, None, None)
                .unwrap();
        }
        let (mut outs, replaced) = p.finish().unwrap();
        assert_eq!(replaced, 0);
        for (cpu, o) in outs.iter_mut().enumerate() {
            assert_eq!(o.bytes, want[cpu].len() as u64, "cpu {cpu}");
            assert!(spilled(o) == want[cpu], "cpu {cpu}'s data out of order");
        }
    }

    /// A ready batch of CPU 0 numbered `seq` whose records are `records`.
    fn ready(seq: u64, records: &[u8]) -> Ready {
        let job = Job {
            cpu: 0,
            seq,
            data: Vec::new(),
            len: 0,
            level: ZSTD_LEVEL,
            direct: None,
            out: records.to_vec(),
        };
        Ready {
            job,
            records: Ok((records.len(), 1)),
            replaced: 0,
        }
    }

    /// A slot over CPU 0's spill file in `dir`.
    fn slot(dir: &std::path::Path) -> Slot {
        let target = crate::OutputTarget::check(dir.join("x.dat")).unwrap();
        Slot::new(CpuOut::new(&target, 0).unwrap())
    }

    /// Hands `r` in; what the sink's thread is told meanwhile (bytes, failed).
    fn hand_in(s: &Slot, r: Ready) -> Vec<(u64, bool)> {
        let mut told = Vec::new();
        assert!(s.hand_in(r, &mut |d| {
            told.push((d.bytes, d.err.is_some()));
            true
        }));
        told
    }

    /// A batch before its turn is parked; the batch whose turn it is is written with
    /// the parked ones that follow it, in order; a batch after a failed one is told
    /// as not written.
    #[test]
    fn slot_parks_until_the_turn() {
        let dir = tempfile::tempdir().unwrap();
        let s = slot(dir.path());
        assert_eq!(hand_in(&s, ready(2, b"cc")), []);
        assert_eq!(hand_in(&s, ready(3, b"ddd")), []);
        assert_eq!(hand_in(&s, ready(0, b"a")), [(1, false)]);
        assert_eq!(
            hand_in(&s, ready(1, b"bb")),
            [(3, false), (5, false), (8, false)]
        );
        let t = s.turns.lock().unwrap();
        assert_eq!((t.next, t.parked.len(), t.writing), (4, 0, false));
        drop(t);
        let mut w = s.written.lock().unwrap();
        assert_eq!(w.out.chunks, 4);
        assert_eq!(spilled(&mut w.out), b"abbccddd");
        drop(w);
        // Batch 4's records cannot be written (more than its buffer): it fails, and
        // batch 5, parked before, is told as not written.
        let mut bad = ready(4, b"e");
        bad.records = Ok((2, 1));
        assert_eq!(hand_in(&s, ready(5, b"f")), []);
        assert_eq!(hand_in(&s, bad), [(8, true), (8, true)]);
        assert_eq!(hand_in(&s, ready(6, b"g")), [(8, true)]);
    }

    /// Issue 37: the batches parked behind a late one are told one by one, each as it
    /// is written, and the hand-off is free while they are written (a worker parking a
    /// batch does not wait for the writes). Writing the parked batches under the
    /// hand-off's lock and telling them all after the last (the first shared queue) made
    /// the sink's thread wait for the whole run of writes, and the other worker with it.
    #[test]
    fn a_run_of_parked_batches_is_told_batch_by_batch() {
        let dir = tempfile::tempdir().unwrap();
        let s = slot(dir.path());
        for (i, r) in [b"bb" as &[u8], b"ccc", b"dddd"].iter().enumerate() {
            assert_eq!(hand_in(&s, ready(i as u64 + 1, r)), []);
        }
        let mut told = Vec::new();
        assert!(s.hand_in(ready(0, b"a"), &mut |d| {
            // Told before the next batch is written: the CPU's data is as this batch left it.
            let now = s.written.try_lock().map(|w| w.out.bytes);
            assert_eq!(
                now.ok(),
                Some(d.bytes),
                "told after a later batch was written"
            );
            // The hand-off is not held: another worker would park its batch now.
            assert!(
                s.turns.try_lock().is_ok(),
                "the hand-off is held while writing"
            );
            told.push(d.bytes);
            true
        }));
        assert_eq!(told, [1, 3, 6, 10]);
    }

    /// One worker of the hand-off model: where it is in [`Slot::hand_in`].
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum At {
        /// To park its batch.
        Arrive(u64),
        /// The writer, to look for the next batch.
        Take,
        /// The writer, to write a batch.
        Write(u64),
        /// Seeded bug: the writer found no batch and leaves in a look of its own.
        Leave,
        Gone,
    }

    /// A state of the model: the hand-off (next, parked, writing), the workers, the
    /// batches written.
    type State = (u64, Vec<u64>, bool, Vec<At>, Vec<u64>);

    /// Every interleaving of workers each bringing one batch (`seqs`) through the real
    /// [`Turns`], one look (one lock) a step; `leave_apart` seeds the bug of a writer
    /// that stops being the writer in a look after the one that found no batch. An
    /// error names a state where two workers write, or where every worker is gone and
    /// a batch is left parked (never written: the sink would wait for it for ever).
    fn explore(seqs: &[u64], leave_apart: bool) -> Result<usize, String> {
        let start: State = (
            0,
            Vec::new(),
            false,
            seqs.iter().map(|&s| At::Arrive(s)).collect(),
            Vec::new(),
        );
        let (mut todo, mut seen) = (vec![start], std::collections::HashSet::new());
        // Bounded: finitely many states (each worker moves forward), each visited once.
        while let Some(st) = todo.pop() {
            if !seen.insert(st.clone()) {
                continue;
            }
            let (next, parked, writing, at, written) = &st;
            let writers = at
                .iter()
                .filter(|a| matches!(a, At::Take | At::Write(_) | At::Leave));
            if writers.count() > 1 {
                return Err(format!("two writers: {st:?}"));
            }
            if at.iter().all(|a| *a == At::Gone) && written.len() != seqs.len() {
                return Err(format!("a batch left parked: {st:?}"));
            }
            for i in 0..at.len() {
                let mut t = Turns {
                    next: *next,
                    parked: parked.iter().map(|&s| (s, s)).collect(),
                    writing: *writing,
                };
                let (mut a, mut w) = (at.clone(), written.clone());
                a[i] = match at[i] {
                    At::Gone => continue,
                    At::Arrive(s) if t.arrive(s, s) => At::Take,
                    At::Arrive(_) => At::Gone,
                    At::Take => match t.take() {
                        Some(s) => At::Write(s),
                        None if leave_apart => {
                            t.writing = true;
                            At::Leave
                        }
                        None => At::Gone,
                    },
                    At::Leave => {
                        t.writing = false;
                        At::Gone
                    }
                    At::Write(s) => {
                        w.push(s);
                        At::Take
                    }
                };
                let mut p: Vec<u64> = t.parked.iter().map(|p| p.0).collect();
                p.sort_unstable();
                todo.push((t.next, p, t.writing, a, w));
            }
        }
        Ok(seen.len())
    }

    /// The hand-off model: three workers with batches 0, 1, 2 taken in every order; no
    /// interleaving leaves a batch parked or lets two workers write (the batches are
    /// written in order by construction of [`Turns::take`]). The seeded bug (the writer
    /// leaving in a look of its own) is caught: a batch parked in between is stranded.
    #[test]
    fn hand_off_model() {
        for seqs in [
            [0, 1, 2],
            [0, 2, 1],
            [1, 0, 2],
            [1, 2, 0],
            [2, 0, 1],
            [2, 1, 0],
        ] {
            let states = explore(&seqs, false).unwrap_or_else(|e| panic!("{seqs:?}: {e}"));
            assert!(states > 20, "{seqs:?}: only {states} states");
        }
        let e = explore(&[1, 0, 2], true).expect_err("the seeded bug is caught");
        assert!(e.contains("left parked"), "{e}");
    }

    /// A batch that fails fails the run with its own error (not a later batch's), and
    /// the pool neither hangs nor writes the batches after it.
    #[test]
    fn a_failed_batch_fails_the_run() {
        let dir = tempfile::tempdir().unwrap();
        let (mut p, z) = pool(dir.path(), 3, 1);
        let most = z.batch_bytes();
        let mut first = None;
        for i in 0..40 {
            let b = batch(i, most);
            // Batch 5 claims more bytes than its buffer holds.
            let len = if i == 5 { b.len() + 1 } else { b.len() };
            if let Err(e) = p.submit(0, b, len, ZSTD_LEVEL, None, None) {
                first = Some(e);
                break;
            }
        }
        let e = match first {
            Some(e) => e,
            None => p.finish().map(|_| ()).expect_err("batch 5 failed"),
        };
        assert!(
            matches!(e, OutputError::Compress { cpu: Some(0), .. }),
            "{e:?}"
        );
    }
}
