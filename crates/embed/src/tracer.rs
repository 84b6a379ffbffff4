//! [`Tracer`]: the reader of a VMM's rings with its drain loop, made of the engine
//! ([`CpuReads`]) and [`drain_pages`] into one page sink.

use hyptrace_abi::layout::RingGeometry;
use hyptrace_abi::SharedMem;
use hyptrace_output::{Clock, EventFormat, OutputError, PageSink, TraceMeta};
use hyptrace_reader::{Callbacks, ReadError, RingBuffer};

use crate::drain::{drain_pages, DrainError, ROUND_MAX_BYTES, ROUND_MAX_TIME};
use crate::reads::{run_summary, CpuAccount, CpuReads};

/// The reader of a VMM's trace rings with its drain loop: see the crate documentation.
pub struct Tracer<M, C> {
    reader: RingBuffer<M, C>,
    reads: CpuReads<DrainError>,
}

impl<M: SharedMem, C: Callbacks> Tracer<M, C> {
    /// Allocates the rings `geometry` describes in `mem` (writes the pack, the control
    /// blocks and every page: the guest gets `mem`'s address), with swap callbacks `cb`
    /// (`hyptrace_reader::callbacks::for_geometry`). `tsc_khz`: the guest TSC frequency.
    /// # Errors
    ///
    /// [`ReadError`] when `mem` is smaller than `geometry.region_size` or the geometry is not
    /// one the reader takes.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_embed::Tracer;
    /// # use hyptrace_output::{Clock, TraceDatSink, TraceDatVersion};
    /// let geometry = RingGeometry::new(2, 4, 4096, Mode::Stop, false)?;
    /// let mem = Arc::new(HeapMem::new(geometry.region_size)); // a VMM: GuestRegionMem
    /// let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # #[allow(unused_mut)]
    /// let mut tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// // Give the guest the region's guest-physical address (docs/abi.md, "Entry").
    /// assert_eq!(tracer.reader().nr_cpus(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc(mem: M, geometry: RingGeometry, cb: C, tsc_khz: u64) -> Result<Self, ReadError> {
        let reader = RingBuffer::alloc(mem, geometry, cb, tsc_khz, 1)?;
        let reads = CpuReads::new(geometry.nr_cpus);
        Ok(Self { reader, reads })
    }

    /// The reader underneath (stats, positions, enable words).
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_embed::Tracer;
    /// # use hyptrace_output::{Clock, TraceDatSink, TraceDatVersion};
    /// let geometry = RingGeometry::new(2, 4, 4096, Mode::Stop, false)?;
    /// let mem = Arc::new(HeapMem::new(geometry.region_size)); // a VMM: GuestRegionMem
    /// let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # #[allow(unused_mut)]
    /// let mut tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// let stats = tracer.reader().stats(0);
    /// assert_eq!((stats.read, stats.lost), (0, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reader(&self) -> &RingBuffer<M, C> {
        &self.reader
    }

    /// What a sink needs before the first page: page size, CPUs (`vcpuN`, pid N+1), the
    /// clock, the registered `formats`.
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_embed::Tracer;
    /// # use hyptrace_output::{Clock, TraceDatSink, TraceDatVersion};
    /// let geometry = RingGeometry::new(2, 4, 4096, Mode::Stop, false)?;
    /// let mem = Arc::new(HeapMem::new(geometry.region_size)); // a VMM: GuestRegionMem
    /// let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # #[allow(unused_mut)]
    /// let mut tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// let meta = tracer.trace_meta(Clock::guest_tsc(1_000_000)?, Vec::new() /* Events::wait's formats */);
    /// assert_eq!(meta.page_size, 4096);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn trace_meta(&self, clock: Clock, formats: Vec<EventFormat>) -> TraceMeta {
        let l = self.reader.layout();
        TraceMeta {
            formats,
            ..TraceMeta::guest(l.page_size, l.nr_cpus, clock)
        }
    }

    /// One bounded drain round over every CPU while the guest runs: full pages go to
    /// `sink`. A CPU whose ring fails is not read again (its error is in its
    /// [`CpuAccount`]); an output failure is returned. Returns whether a CPU stopped at
    /// a bound (call again soon) rather than being caught up.
    /// # Errors
    ///
    /// The sink's [`OutputError`] (the run should stop). A ring that fails is no error here:
    /// that CPU is not read again and its [`CpuAccount::error`] says why.
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_embed::Tracer;
    /// # use hyptrace_output::{Clock, TraceDatSink, TraceDatVersion};
    /// let geometry = RingGeometry::new(2, 4, 4096, Mode::Stop, false)?;
    /// let mem = Arc::new(HeapMem::new(geometry.region_size)); // a VMM: GuestRegionMem
    /// let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # #[allow(unused_mut)]
    /// let mut tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let dir = tempfile::tempdir()?;
    /// let meta = tracer.trace_meta(Clock::guest_tsc(1_000_000)?, Vec::new());
    /// let mut sink = TraceDatSink::create(dir.path().join("t.dat"), meta, TraceDatVersion::V7)?;
    /// let vcpus_running = || false; // the VMM's own state
    /// while vcpus_running() {
    ///     if !tracer.drain(&mut sink)? {
    ///         std::thread::sleep(Duration::from_millis(1)); // caught up: a poll period
    ///     }
    /// }
    /// assert!(!tracer.drain(&mut sink)?); // nothing written: caught up
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn drain(&mut self, sink: &mut (impl PageSink + ?Sized)) -> Result<bool, OutputError> {
        let mut more = false;
        for cpu in 0..self.reader.nr_cpus() {
            if !self.reads.polls(cpu) {
                continue;
            }
            match drain_pages(
                &mut self.reader,
                cpu,
                cpu,
                sink,
                ROUND_MAX_BYTES,
                ROUND_MAX_TIME,
            ) {
                Ok(m) => more |= m,
                Err(DrainError::Sink(e)) => return Err(e),
                // The guest writer finished (mailbox callbacks): the rest is read by
                // the final walk.
                Err(DrainError::Read(ReadError::WriterStopped { .. })) => {}
                Err(e) => {
                    self.reads.fail(cpu, e);
                }
            }
        }
        Ok(more)
    }

    /// Every vCPU has stopped: the final read-only walk of each CPU (what is left in its
    /// ring, no swaps), the losses after the last page, the per-CPU accounts, and the
    /// sink finished with the summary. Returns the accounts (index = CPU).
    /// # Errors
    ///
    /// The sink's [`OutputError`] (writing the last pages, the losses or its end).
    ///
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, HeapMem};
    /// # use hyptrace_embed::Tracer;
    /// # use hyptrace_output::{Clock, TraceDatSink, TraceDatVersion};
    /// let geometry = RingGeometry::new(2, 4, 4096, Mode::Stop, false)?;
    /// let mem = Arc::new(HeapMem::new(geometry.region_size)); // a VMM: GuestRegionMem
    /// let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # #[allow(unused_mut)]
    /// let mut tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let dir = tempfile::tempdir()?;
    /// let meta = tracer.trace_meta(Clock::guest_tsc(1_000_000)?, Vec::new());
    /// let mut sink = TraceDatSink::create(dir.path().join("t.dat"), meta, TraceDatVersion::V7)?;
    /// // Once every vCPU stopped:
    /// let accounts = tracer.finish(Box::new(sink))?;
    /// assert_eq!(accounts.len(), 2);
    /// assert!(accounts.iter().all(|a| a.consistent()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn finish(
        mut self,
        mut sink: Box<dyn PageSink + '_>,
    ) -> Result<Vec<CpuAccount>, OutputError> {
        for cpu in 0..self.reader.nr_cpus() {
            match self.reads.walk(&mut self.reader, cpu, sink.as_mut()) {
                Ok(()) => {}
                Err(DrainError::Sink(e)) => return Err(e),
                Err(e) => {
                    self.reads.record(cpu, || e);
                }
            }
        }
        let accounts = self.reads.into_accounts(&mut self.reader);
        sink.finish(&run_summary(&accounts))?;
        Ok(accounts)
    }
}
