//! Compression workers of the zstd trace.dat writer: the sink's thread hands each full
//! chunk of pages to a worker thread, which makes its guest strings safe (G2),
//! compresses it and appends the chunk record to the CPU's spill file itself (CPU `c`'s chunks always go to worker `c % workers`,
//! which owns that CPU's spill file: each CPU's chunks are written in order, and no
//! compression and no `write(2)` of CPU data runs on the sink's thread). At most
//! [`ZPool::limit`] chunks are in flight (memory: that many chunks, buffers recycled).
//!
//! The level of each chunk is chosen when it is handed over ([`ZPool::submit`]): the
//! sink's level, or — for a sink fed by live rings ([`crate::PageSink::set_live`]) whose
//! workers are behind by half the limit — the catch-up level, which stores at about
//! memory speed: the workers catch up instead of making the rings wait (a larger file,
//! no lost events).

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::Duration;

use std::sync::Arc;

use super::cpudata::sanitize_pages;
use super::cpuout::{CpuOut, Zstd};
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

/// A chunk (`data[..len]`) to compress at `level`; its buffer comes back in [`Done`].
struct Job {
    cpu: usize,
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

/// What a worker gives back when it ends: its CPUs' data.
type Spills = Vec<(usize, CpuOut)>;

pub(super) struct ZPool {
    jobs: Vec<SyncSender<Job>>,
    done: Receiver<Done>,
    handles: Vec<JoinHandle<Spills>>,
    in_flight: usize,
    limit: usize,
    /// Recycled chunk buffers (at most `limit`).
    free: Vec<Vec<u8>>,
    /// Chunks handed over at the catch-up level.
    pub(super) caught_up: u64,
    /// Bytes of guest strings the workers replaced, in the chunks finished so far.
    pub(super) replaced: u64,
    /// Each CPU's bytes written, as of the chunks finished so far.
    bytes: Vec<u64>,
}

impl ZPool {
    /// `workers` threads (at least one) compressing the chunks (pages of `page_size`,
    /// their string fields `strings`) of the CPUs whose spill files `spills` holds
    /// (index = CPU) with copies of `zstd`; if a thread or a compressor cannot be made,
    /// the spill files come back untouched (the caller compresses on its own thread).
    pub(super) fn new(
        spills: Vec<CpuOut>,
        workers: usize,
        zstd: &Zstd,
        strings: Arc<StringFields>,
        page_size: usize,
    ) -> Result<Self, Vec<CpuOut>> {
        let workers = workers.clamp(1, spills.len().max(1));
        let limit = 4 * workers;
        let (done_tx, done) = mpsc::channel::<Done>();
        let mut pool = Self {
            jobs: Vec::new(),
            done,
            handles: Vec::new(),
            in_flight: 0,
            limit,
            free: Vec::new(),
            caught_up: 0,
            replaced: 0,
            bytes: vec![0; spills.len()],
        };
        // Every thread first, each waiting for its spill files: a failure before they
        // are handed over gives them all back.
        let mut inits = Vec::new();
        for i in 0..workers {
            let Ok(z) = zstd.fresh() else {
                drop(inits);
                pool.join();
                return Err(spills);
            };
            // A worker never has more than `limit` jobs queued (the pool's bound).
            let (tx, rx) = mpsc::sync_channel::<Job>(limit);
            let (init_tx, init_rx) = mpsc::sync_channel::<Spills>(1);
            let done_tx = done_tx.clone();
            let w = Worker {
                workers,
                z,
                strings: Arc::clone(&strings),
                page_size,
            };
            let spawned = std::thread::Builder::new()
                .name(format!("hyptrace-zstd{i}"))
                .spawn(move || match init_rx.recv() {
                    Ok(mine) => w.work(&rx, &done_tx, mine),
                    Err(_) => Vec::new(),
                });
            let Ok(h) = spawned else {
                drop(inits);
                pool.join();
                return Err(spills);
            };
            pool.jobs.push(tx);
            pool.handles.push(h);
            inits.push(init_tx);
        }
        let mut per: Vec<Spills> = (0..workers).map(|_| Vec::new()).collect();
        for (cpu, s) in spills.into_iter().enumerate() {
            per[cpu % workers].push((cpu, s));
        }
        for (init, mine) in inits.iter().zip(per) {
            // Only a thread that panicked before its first line is not waiting: its CPUs'
            // chunks then fail ("worker died").
            let _ = init.send(mine);
        }
        Ok(pool)
    }

    /// Closes the queues and joins the workers; their spill files (a panicked worker's
    /// are lost: dropped, removed).
    fn join(&mut self) -> Spills {
        self.jobs.clear();
        self.handles
            .drain(..)
            .filter_map(|h| h.join().ok())
            .flatten()
            .collect()
    }

    /// A buffer for the next chunk: a recycled one (its old bytes kept: the caller
    /// overwrites what it uses), else an empty one.
    pub(super) fn buffer(&mut self) -> Vec<u8> {
        self.free.pop().unwrap_or_default()
    }

    /// Queues CPU `cpu`'s chunk `data[..len]` at `level` — at `catch_up` instead, if
    /// given, when half the limit is in flight —, waiting for a chunk to finish while
    /// `limit` are in flight; `direct` with the CPU's first chunk, if its data goes
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
        let level = match catch_up {
            Some(fast) if 2 * self.in_flight >= self.limit => {
                self.caught_up += 1;
                fast
            }
            _ => level,
        };
        while self.in_flight >= self.limit {
            self.wait_one()?;
        }
        let w = cpu % self.jobs.len().max(1);
        self.jobs
            .get(w)
            .ok_or_else(dead)?
            .send(Job {
                cpu,
                data,
                len,
                level,
                direct,
            })
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

    /// Waits for every chunk in flight, ends the workers and returns every CPU's data
    /// (index = CPU).
    pub(super) fn finish(mut self) -> Result<Vec<CpuOut>, OutputError> {
        while self.in_flight > 0 {
            self.wait_one()?;
        }
        let mut all = self.join();
        all.sort_by_key(|(cpu, _)| *cpu);
        if all.iter().enumerate().any(|(i, (cpu, _))| i != *cpu) {
            return Err(dead());
        }
        Ok(all.into_iter().map(|(_, s)| s).collect())
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
            *b = d.bytes;
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
    /// Number of workers (CPU `cpu` is in the spill files of worker `cpu % workers`).
    workers: usize,
    z: Zstd,
    strings: Arc<StringFields>,
    page_size: usize,
}

impl Worker {
    /// Makes each job's chunk safe (G2), compresses it and appends it to its CPU's spill
    /// file (CPU `cpu` is at `mine[cpu / workers]`), until the queue closes; returns the
    /// spill files.
    fn work(mut self, rx: &Receiver<Job>, done: &mpsc::Sender<Done>, mut mine: Spills) -> Spills {
        while let Ok(mut j) = rx.recv() {
            let (mut replaced, mut bytes) = (0, 0);
            let err = match (mine.get_mut(j.cpu / self.workers), j.data.get_mut(..j.len)) {
                (Some((cpu, o)), Some(chunk)) if *cpu == j.cpu => {
                    replaced = sanitize_pages(&self.strings, chunk, self.page_size);
                    let r = match j.direct.take() {
                        Some(d) => o.go_direct(d.file, &d.path, d.start, d.prefix),
                        None => Ok(()),
                    };
                    let r = r.and_then(|()| self.z.chunk(chunk, j.level, o));
                    bytes = o.bytes;
                    r.err()
                }
                _ => Some(dead()),
            };
            let d = Done {
                cpu: j.cpu,
                bytes,
                data: j.data,
                err,
                replaced,
            };
            if done.send(d).is_err() {
                break;
            }
        }
        mine
    }
}

fn dead() -> OutputError {
    OutputError::from(std::io::Error::other("zstd compression worker died"))
}

impl Drop for ZPool {
    /// Closes the queues and joins the workers (each finishes at most its queued chunks);
    /// their spill files are dropped (removed).
    fn drop(&mut self) {
        drop(self.join());
    }
}
