//! The reader's callbacks (`ring_buffer_ext_cb`): how the writer-domain operations
//! `swap_reader_page` and `update_footers` get run for a CPU.
//!
//! - [`Direct`]: run them here, on the shared memory, lock-free against the writer
//!   (`--swap host`; also the in-process backend of tests and benchmarks).
//! - [`Mailbox`]: post a request in the CPU's control block and wait for the writer to
//!   run it and acknowledge (`--swap guest`: only the writer touches its metadata).

use crate::ReadError;
use hyptrace_abi::layout::{
    ctl, Layout, MBOX_OP_SWAP, MBOX_OP_UPDATE_FOOTERS, MBOX_STATUS_BUSY, MBOX_STATUS_OK,
};
use hyptrace_abi::SharedMem;
pub use hyptrace_writer::SwapStatus;
use std::sync::atomic::Ordering::{Acquire, Release};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How the reader gets the writer-domain operations done for a CPU.
pub trait Callbacks {
    /// Swap the CPU's reader page with its head page.
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError>;
    /// Refresh the stats in the CPU's reader page footer.
    fn update_footers(&self, cpu: u32) -> Result<(), ReadError>;
}

/// Runs the writer-domain operations directly on the shared memory.
#[derive(Debug)]
pub struct Direct<M> {
    mem: M,
    layout: Layout,
}

impl<M: SharedMem> Direct<M> {
    /// Callbacks over `mem`, whose pack describes `layout`.
    pub fn new(mem: M, layout: Layout) -> Self {
        Self { mem, layout }
    }
}

impl<M: SharedMem> Callbacks for Direct<M> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError> {
        hyptrace_writer::swap_reader_page(&self.mem, &self.layout, cpu)
            .map_err(|e| ReadError::Ring { cpu, err: e })
    }
    fn update_footers(&self, cpu: u32) -> Result<(), ReadError> {
        hyptrace_writer::update_footers(&self.mem, &self.layout, cpu)
            .map_err(|e| ReadError::Ring { cpu, err: e })
    }
}

/// Posts requests to the writer's mailbox and waits for the acknowledgement.
#[derive(Debug)]
pub struct Mailbox<M> {
    mem: M,
    layout: Layout,
    timeout: Duration,
    seq: Mutex<Vec<u64>>,
}

impl<M: SharedMem> Mailbox<M> {
    /// Mailbox callbacks over `mem`; a request not acknowledged within `timeout` is an
    /// error ([`ReadError::MailboxTimeout`]: a stuck or dead writer).
    pub fn new(mem: M, layout: Layout, timeout: Duration) -> Self {
        let seq = (0..layout.nr_cpus)
            .map(|c| mem.load(layout.ctl(c) + ctl::MBOX_REQ, Acquire) >> 8)
            .collect();
        Self {
            mem,
            layout,
            timeout,
            seq: Mutex::new(seq),
        }
    }

    fn request(&self, cpu: u32, op: u64) -> Result<u64, ReadError> {
        if cpu >= self.layout.nr_cpus {
            return Err(ReadError::BadCpu(cpu));
        }
        let seq = {
            let mut s = self.seq.lock().unwrap_or_else(|p| p.into_inner());
            s[cpu as usize] += 1;
            s[cpu as usize]
        };
        let c = self.layout.ctl(cpu);
        self.mem.store(c + ctl::MBOX_REQ, (seq << 8) | op, Release);
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let ack = self.mem.load(c + ctl::MBOX_ACK, Acquire);
            if ack >> 8 == seq & (u64::MAX >> 8) {
                return Ok(ack & 0xff);
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 256 {
                std::thread::yield_now();
            } else {
                if start.elapsed() > self.timeout {
                    return Err(ReadError::MailboxTimeout {
                        cpu,
                        timeout: self.timeout,
                    });
                }
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

impl<M: SharedMem> Callbacks for Mailbox<M> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError> {
        match self.request(cpu, MBOX_OP_SWAP)? {
            MBOX_STATUS_OK => {
                let page = self
                    .mem
                    .load(self.layout.ctl(cpu) + ctl::READER_PAGE, Acquire);
                Ok(SwapStatus::Swapped { page: page as u32 })
            }
            MBOX_STATUS_BUSY => Ok(SwapStatus::Busy),
            s => Err(ReadError::MailboxFailed { cpu, status: s }),
        }
    }
    fn update_footers(&self, cpu: u32) -> Result<(), ReadError> {
        match self.request(cpu, MBOX_OP_UPDATE_FOOTERS)? {
            MBOX_STATUS_OK => Ok(()),
            s => Err(ReadError::MailboxFailed { cpu, status: s }),
        }
    }
}

impl<T: Callbacks + ?Sized> Callbacks for &T {
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError> {
        (**self).swap_reader(cpu)
    }
    fn update_footers(&self, cpu: u32) -> Result<(), ReadError> {
        (**self).update_footers(cpu)
    }
}

impl<T: Callbacks + ?Sized> Callbacks for Box<T> {
    fn swap_reader(&self, cpu: u32) -> Result<SwapStatus, ReadError> {
        (**self).swap_reader(cpu)
    }
    fn update_footers(&self, cpu: u32) -> Result<(), ReadError> {
        (**self).update_footers(cpu)
    }
}
