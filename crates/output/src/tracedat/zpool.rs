//! Compression workers of the zstd trace.dat writer: the drain thread hands each full
//! chunk of pages to a worker thread (CPU `c`'s chunks always to worker `c % workers`,
//! so each CPU's chunks come back in order) and writes the compressed chunks it gets
//! back; at most [`ZPool::limit`] chunks are in flight (memory: that many chunks and
//! their compressed copies, buffers recycled).

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::OutputError;

/// A chunk to compress; its buffers come back in [`Done`].
struct Job {
    cpu: usize,
    data: Vec<u8>,
    z: Vec<u8>,
}

/// A compressed chunk: `z` holds the zstd frame of `data` (or the error).
struct Done {
    cpu: usize,
    data: Vec<u8>,
    z: Vec<u8>,
    err: Option<String>,
}

/// Where finished chunks go: `(cpu, compressed frame, uncompressed length)`.
pub(super) type Sink<'a> = dyn FnMut(usize, &[u8], usize) -> Result<(), OutputError> + 'a;

pub(super) struct ZPool {
    jobs: Vec<SyncSender<Job>>,
    done: Receiver<Done>,
    handles: Vec<JoinHandle<()>>,
    in_flight: usize,
    limit: usize,
    /// Recycled buffers (at most `limit` of each).
    free_data: Vec<Vec<u8>>,
    free_z: Vec<Vec<u8>>,
    bound: usize,
}

impl ZPool {
    /// `workers` threads compressing at `level` chunks of at most `chunk` bytes; `None`
    /// if a thread or a compressor cannot be made (the caller compresses inline).
    pub(super) fn new(workers: usize, level: i32, chunk: usize) -> Option<Self> {
        let workers = workers.max(1);
        let limit = 4 * workers;
        let (done_tx, done) = mpsc::channel::<Done>();
        let mut jobs = Vec::new();
        let mut handles = Vec::new();
        for i in 0..workers {
            let mut c = zstd::bulk::Compressor::new(level).ok()?;
            // A worker never has more than `limit` jobs queued (the pool's bound).
            let (tx, rx) = mpsc::sync_channel::<Job>(limit);
            let done_tx = done_tx.clone();
            let h = std::thread::Builder::new()
                .name(format!("hyptrace-zstd{i}"))
                .spawn(move || {
                    while let Ok(mut j) = rx.recv() {
                        j.z.clear();
                        j.z.reserve(zstd::zstd_safe::compress_bound(j.data.len()));
                        let err = c.compress_to_buffer(&j.data, &mut j.z).err();
                        let d = Done {
                            cpu: j.cpu,
                            data: j.data,
                            z: j.z,
                            err: err.map(|e| e.to_string()),
                        };
                        if done_tx.send(d).is_err() {
                            break;
                        }
                    }
                })
                .ok()?;
            jobs.push(tx);
            handles.push(h);
        }
        Some(Self {
            jobs,
            done,
            handles,
            in_flight: 0,
            limit,
            free_data: Vec::new(),
            free_z: Vec::new(),
            bound: zstd::zstd_safe::compress_bound(chunk),
        })
    }

    /// An empty buffer for the next chunk (recycled when one is free).
    pub(super) fn buffer(&mut self) -> Vec<u8> {
        self.free_data.pop().unwrap_or_default()
    }

    /// Queues CPU `cpu`'s chunk `data`; hands every chunk finished meanwhile to `sink`,
    /// waiting for one while `limit` chunks are in flight.
    pub(super) fn submit(
        &mut self,
        cpu: usize,
        data: Vec<u8>,
        sink: &mut Sink<'_>,
    ) -> Result<(), OutputError> {
        while self.in_flight >= self.limit {
            self.wait_one(sink)?;
        }
        let z = self
            .free_z
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.bound));
        let w = cpu % self.jobs.len();
        self.jobs[w]
            .send(Job { cpu, data, z })
            .map_err(|_| dead())?;
        self.in_flight += 1;
        while let Ok(d) = self.done.try_recv() {
            self.finished(d, sink)?;
        }
        Ok(())
    }

    /// Waits for every chunk in flight.
    pub(super) fn wait_all(&mut self, sink: &mut Sink<'_>) -> Result<(), OutputError> {
        while self.in_flight > 0 {
            self.wait_one(sink)?;
        }
        Ok(())
    }

    fn wait_one(&mut self, sink: &mut Sink<'_>) -> Result<(), OutputError> {
        loop {
            match self.done.recv_timeout(Duration::from_millis(100)) {
                Ok(d) => return self.finished(d, sink),
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

    fn finished(&mut self, mut d: Done, sink: &mut Sink<'_>) -> Result<(), OutputError> {
        self.in_flight -= 1;
        if let Some(e) = d.err {
            return Err(OutputError::from(std::io::Error::other(format!(
                "zstd: {e}"
            ))));
        }
        let r = sink(d.cpu, &d.z, d.data.len());
        if self.free_data.len() < self.limit {
            d.data.clear();
            self.free_data.push(d.data);
        }
        if self.free_z.len() < self.limit {
            self.free_z.push(d.z);
        }
        r
    }
}

fn dead() -> OutputError {
    OutputError::from(std::io::Error::other("zstd compression worker died"))
}

impl Drop for ZPool {
    /// Closes the queues and joins the workers (each finishes at most its queued chunks).
    fn drop(&mut self) {
        self.jobs.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
