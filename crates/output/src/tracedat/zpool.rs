//! Compression workers of the zstd trace.dat writer: the sink's thread hands each full
//! batch of chunks of a CPU to the next worker thread in turn (whatever its CPU: one CPU
//! fed alone, as `convert` feeds a trace.dat, keeps every worker busy), which makes its
//! guest strings safe (G2), compresses it chunk by chunk, and appends the chunk records
//! to its CPU's data itself — in the CPU's order: a batch numbered `n` of its CPU is
//! written once batch `n - 1` is ([`Shared`]). No compression and no `write(2)` of CPU data runs on the
//! sink's thread. At most [`ZPool::limit`] chunks are in flight (memory: that many
//! chunks, buffers recycled).
//!
//! The level of each batch is chosen when it is handed over ([`ZPool::submit`]): the
//! sink's level, or — for a sink fed by live rings ([`crate::PageSink::set_live`]) whose
//! workers are behind (half of `limit` batches in flight) — the catch-up level, which
//! stores at about memory speed, up to twice `limit` batches in flight: the workers
//! catch up instead of making the rings wait (a larger file, no lost events).
//!
//! No wait is for ever: a worker waiting for its turn gives up when the chunk before
//! failed or the pool is dropped ([`Shared::abandon`]); a worker that panicked is seen
//! by the sink's thread (its chunks never come back) within 100 ms.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
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

/// Chunk `seq` of CPU `cpu` (`data[..len]`) to compress at `level`; its buffer comes
/// back in [`Done`].
struct Job {
    cpu: usize,
    seq: u64,
    data: Vec<u8>,
    len: usize,
    level: i32,
    direct: Option<DirectTo>,
}

/// A chunk compressed and written (or the error): its CPU's bytes written so far, and
/// the string bytes it replaced.
struct Done {
    cpu: usize,
    bytes: u64,
    data: Vec<u8>,
    err: Option<OutputError>,
    replaced: u64,
}

/// One CPU's data, and the number of the next chunk to write into it (`None` once a
/// chunk failed: the chunks after it are not written).
struct Slot {
    next: Option<u64>,
    out: CpuOut,
}

/// What the workers share: every CPU's data, each behind its own lock.
struct Shared {
    slots: Vec<Mutex<Slot>>,
    /// Signalled when a chunk was written (or failed), and when the pool is dropped.
    turn: Condvar,
    /// The pool is dropped: waiting workers give up.
    abandoned: AtomicBool,
}

/// How often a worker waiting for its turn looks whether the pool was dropped.
const TURN_POLL: Duration = Duration::from_millis(100);

impl Shared {
    fn lock(&self, cpu: usize) -> Option<MutexGuard<'_, Slot>> {
        // A worker that panicked while writing leaves a slot poisoned: its CPU's data
        // is not trusted after that (later chunks fail, "worker died").
        self.slots.get(cpu)?.lock().ok()
    }

    /// Waits until chunk `seq` of CPU `cpu` is next; the slot, or `None` if a chunk
    /// before failed, a worker died or the pool was dropped.
    fn turn(&self, cpu: usize, seq: u64) -> Option<MutexGuard<'_, Slot>> {
        let mut s = self.lock(cpu)?;
        loop {
            match s.next {
                Some(n) if n == seq => return Some(s),
                None => return None,
                Some(_) if self.abandoned.load(Ordering::Relaxed) => return None,
                Some(_) => {}
            }
            s = self.turn.wait_timeout(s, TURN_POLL).ok()?.0;
        }
    }

    /// Wakes every waiting worker to give up.
    fn abandon(&self) {
        self.abandoned.store(true, Ordering::Relaxed);
        self.turn.notify_all();
    }
}

pub(super) struct ZPool {
    jobs: Vec<SyncSender<Job>>,
    done: Receiver<Done>,
    handles: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
    /// Worker the next chunk goes to.
    next_worker: usize,
    /// Per CPU, the number of its next chunk.
    seqs: Vec<u64>,
    in_flight: usize,
    /// Batches in flight before the sink waits (or, live, goes on at the catch-up level).
    limit: usize,
    /// Recycled chunk buffers (at most `limit`).
    free: Vec<Vec<u8>>,
    /// Chunks handed over at the catch-up level.
    pub(super) caught_up: u64,
    /// Bytes of guest strings the workers replaced, in the batches finished so far.
    replaced: u64,
    /// Each CPU's bytes written, as of the chunks finished so far.
    bytes: Vec<u64>,
}

impl ZPool {
    /// `workers` threads (at least one) compressing the chunks (pages of `page_size`,
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
        let shared = Arc::new(Shared {
            slots: outs
                .into_iter()
                .map(|out| Mutex::new(Slot { next: Some(0), out }))
                .collect(),
            turn: Condvar::new(),
            abandoned: AtomicBool::new(false),
        });
        let (done_tx, done) = mpsc::channel::<Done>();
        let mut pool = Self {
            jobs: Vec::new(),
            done,
            handles: Vec::new(),
            shared,
            next_worker: 0,
            seqs: vec![0; n],
            in_flight: 0,
            limit,
            free: Vec::new(),
            caught_up: 0,
            replaced: 0,
            bytes: vec![0; n],
        };
        for i in 0..workers {
            let Ok(z) = zstd.fresh() else {
                return Err(pool.into_outs());
            };
            // A worker never has more than `2 × limit` jobs queued (the pool's bound).
            let (tx, rx) = mpsc::sync_channel::<Job>(2 * limit);
            let w = Worker {
                z,
                strings: Arc::clone(&strings),
                page_size,
                shared: Arc::clone(&pool.shared),
                done: done_tx.clone(),
            };
            let spawned = std::thread::Builder::new()
                .name(format!("hyptrace-zstd{i}"))
                .spawn(move || w.work(&rx));
            let Ok(h) = spawned else {
                return Err(pool.into_outs());
            };
            pool.jobs.push(tx);
            pool.handles.push(h);
        }
        Ok(pool)
    }

    /// Closes the queues and joins the workers.
    fn join(&mut self) {
        self.jobs.clear();
        self.shared.abandon();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }

    /// Ends the workers; every CPU's data (index = CPU; a slot a panicking worker
    /// poisoned is taken as it is: the caller only uses it after an error, to drop it).
    fn into_outs(mut self) -> Vec<CpuOut> {
        self.join();
        let shared = std::mem::replace(
            &mut self.shared,
            Arc::new(Shared {
                slots: Vec::new(),
                turn: Condvar::new(),
                abandoned: AtomicBool::new(true),
            }),
        );
        match Arc::try_unwrap(shared) {
            Ok(s) => s
                .slots
                .into_iter()
                .map(|m| m.into_inner().unwrap_or_else(PoisonError::into_inner).out)
                .collect(),
            // Every worker is joined: no other reference is left.
            Err(_) => Vec::new(),
        }
    }

    /// A buffer for the next chunk: a recycled one (its old bytes kept: the caller
    /// overwrites what it uses), else an empty one.
    pub(super) fn buffer(&mut self) -> Vec<u8> {
        self.free.pop().unwrap_or_default()
    }

    /// Queues CPU `cpu`'s next batch `data[..len]` at `level`, waiting for a batch to
    /// finish while `limit` are in flight — or, with `catch_up`, at that level while
    /// `limit` to `2 × limit` are; `direct` with the CPU's first batch, if its data goes
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
        // the workers little) up to twice the limit; otherwise it waits at the limit.
        let (level, most) = match catch_up {
            Some(fast) if 2 * self.in_flight >= self.limit => {
                self.caught_up += 1;
                (fast, 2 * self.limit)
            }
            _ => (level, self.limit),
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
        };
        *seq += 1;
        let w = self.next_worker % self.jobs.len().max(1);
        self.next_worker = w + 1;
        self.jobs
            .get(w)
            .ok_or_else(dead)?
            .send(job)
            .map_err(|_| dead())?;
        self.in_flight += 1;
        Ok(())
    }

    /// Takes every chunk finished meanwhile (their errors first).
    fn collect(&mut self) -> Result<(), OutputError> {
        while let Ok(d) = self.done.try_recv() {
            self.finished(d)?;
        }
        Ok(())
    }

    /// Waits for every chunk in flight; CPU `cpu`'s bytes written then.
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
                // Workers only end when the pool drops their queue: one that ended has
                // panicked, and its chunks will never come.
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
        if self.free.len() < self.limit {
            self.free.push(d.data);
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
    /// Makes each job's chunk safe (G2), compresses it and, in its CPU's turn, appends
    /// it to the CPU's data; until the queue closes.
    fn work(mut self, rx: &Receiver<Job>) {
        while let Ok(mut j) = rx.recv() {
            let (mut replaced, mut bytes) = (0, 0);
            let err = match j.data.get_mut(..j.len) {
                Some(chunk) => {
                    replaced = self.strings.sanitize_pages(chunk, self.page_size);
                    let r = self.write(&mut j, &mut bytes);
                    r.err()
                }
                None => Some(dead()),
            };
            let d = Done {
                cpu: j.cpu,
                bytes,
                data: j.data,
                err,
                replaced,
            };
            if self.done.send(d).is_err() {
                break;
            }
        }
    }

    /// Compresses job `j`'s chunk and writes it into its CPU's data in its turn; sets
    /// `bytes` to the CPU's bytes written then.
    fn write(&mut self, j: &mut Job, bytes: &mut u64) -> Result<(), OutputError> {
        let chunk = j.data.get(..j.len).ok_or_else(dead)?;
        let records = self.z.compress(chunk, j.level);
        let shared = Arc::clone(&self.shared);
        let mut slot = shared.turn(j.cpu, j.seq).ok_or_else(dead)?;
        let r = (|| {
            let (records, n) = records.map_err(|e| slot.out.zstd_err(e))?;
            if let Some(d) = j.direct.take() {
                slot.out.go_direct(d.file, &d.path, d.start, d.prefix)?;
            }
            slot.out.append(records)?;
            slot.out.chunks += n;
            Ok(())
        })();
        slot.next = match r {
            Ok(()) => Some(j.seq + 1),
            Err(_) => None,
        };
        *bytes = slot.out.bytes;
        drop(slot);
        shared.turn.notify_all();
        r
    }
}

fn dead() -> OutputError {
    OutputError::from(std::io::Error::other("zstd compression worker died"))
}

impl Drop for ZPool {
    /// Closes the queues and joins the workers (each finishes at most its queued chunks,
    /// or gives up waiting for its turn); the CPU data is dropped (spill files removed).
    fn drop(&mut self) {
        self.join();
    }
}
