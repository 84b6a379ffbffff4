//! The host side of tracing a run: the trace region as shared memory, the reader with
//! its callbacks (host-executed or guest mailbox), and the drain loop that turns pages
//! into text lines or hands them to an output sink.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use hyptrace_abi::layout::Layout;
use hyptrace_abi::{RawMem, SharedMem};
use hyptrace_output::{
    format_drop, format_guest_line, guest_printers, Clock, EventPrinter, Missed, PageSink,
};
use hyptrace_reader::{
    Callbacks, CpuStats, Direct, Item, Mailbox, Merged, Merger, ReadError, RingBuffer,
};

use crate::vm::TraceRegion;

/// How long the host waits for the guest writer to answer a mailbox request before it
/// reports a stuck writer (2 host cores are shared by every vCPU and the reader).
pub const MAILBOX_TIMEOUT: Duration = Duration::from_millis(500);

/// The trace region of a VM as [`SharedMem`]: atomics and volatile copies on the guest
/// memory, which the guest's vCPUs write concurrently.
#[derive(Debug)]
pub struct GuestTraceMem {
    // Keeps the guest memory mapped for as long as `raw` is used.
    _region: TraceRegion,
    raw: RawMem,
}

impl GuestTraceMem {
    /// Wraps a VM's trace region.
    pub fn new(region: TraceRegion) -> Self {
        let (_, ptr, len) = region.raw_parts();
        // SAFETY: `ptr` is the host mapping of `len` bytes of guest memory that `region`
        // keeps mapped (it holds a clone of the GuestMemoryMmap) for as long as `self`
        // lives; the region starts page-aligned, so 8-byte aligned. The guest accesses
        // it only through its own atomics and stores (another domain), and the host only
        // through this RawMem (atomics and volatile byte copies) — never through Rust
        // references to the bytes.
        let raw = unsafe { RawMem::new(ptr, len) };
        Self {
            _region: region,
            raw,
        }
    }
}

impl SharedMem for GuestTraceMem {
    hyptrace_abi::forward_shared_mem!(self => self.raw);
}

/// The reader over a VM's trace region.
pub type Reader = RingBuffer<Arc<GuestTraceMem>, Box<dyn Callbacks + Send>>;

/// Allocates the rings in the trace region (pack, control blocks, linked pages) and
/// returns the reader, with host-executed (`Direct`) or guest-executed (`Mailbox`)
/// callbacks.
pub fn alloc_reader(
    region: TraceRegion,
    layout: Layout,
    tsc_khz: u64,
    generation: u64,
) -> Result<Reader, ReadError> {
    let mem = Arc::new(GuestTraceMem::new(region));
    let cb: Box<dyn Callbacks + Send> = if layout.guest_swap {
        Box::new(Mailbox::new(mem.clone(), layout, MAILBOX_TIMEOUT))
    } else {
        Box::new(Direct::new(mem.clone(), layout))
    };
    RingBuffer::alloc(mem, layout, cb, tsc_khz, generation)
}

/// Where the events go.
pub enum Output {
    /// Text lines (`trace-cmd report -t` format), merged across CPUs by time.
    Text {
        /// The destination.
        out: Box<dyn Write>,
        /// Merges the CPUs' streams (events carry their payload length; the bytes wait
        /// in `payloads`, one FIFO per CPU, so no event costs an allocation).
        merger: Merger<usize>,
        /// Payload bytes of the queued events, per CPU, in order.
        payloads: Vec<std::collections::VecDeque<u8>>,
    },
    /// Whole pages into a sink (trace.dat, JSON, text file, raw).
    Pages(Box<dyn PageSink>),
}

/// Per-CPU state of a session.
#[derive(Debug, Default, Clone)]
struct CpuRun {
    live: bool,
    last_ts: u64,
    pending_lost: u64,
    error: Option<String>,
}

/// Drains a VM's rings while it runs and after it stopped.
pub struct Session {
    reader: Reader,
    output: Output,
    cpus: Vec<CpuRun>,
    clock: Clock,
    printers: BTreeMap<u16, EventPrinter>,
    cmdlines: BTreeMap<i32, String>,
    line: String,
    lines: u64,
}

/// What went wrong while draining a CPU.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The ring is inconsistent or the writer did not answer.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// Writing the output failed.
    #[error("output: {0}")]
    Output(String),
}

impl Session {
    /// A session over `reader` writing to `output`; timestamps convert with `clock`.
    pub fn new(reader: Reader, output: Output, clock: Clock) -> Self {
        let n = reader.nr_cpus();
        let cmdlines = (0..n)
            .map(|c| (hyptrace_abi::events::vcpu_pid(c), format!("vcpu{c}")))
            .collect();
        Self {
            reader,
            output,
            cpus: vec![
                CpuRun {
                    live: true,
                    ..CpuRun::default()
                };
                n as usize
            ],
            clock,
            printers: guest_printers(),
            cmdlines,
            line: String::new(),
            lines: 0,
        }
    }

    /// The reader.
    pub fn reader(&self) -> &Reader {
        &self.reader
    }

    /// Text lines printed so far (events and drop markers).
    pub fn lines(&self) -> u64 {
        self.lines
    }

    /// Whether `cpu` is still being read live.
    pub fn is_live(&self, cpu: u32) -> bool {
        self.cpus.get(cpu as usize).is_some_and(|c| c.live)
    }

    /// The first error seen on `cpu`, if any.
    pub fn error(&self, cpu: u32) -> Option<&str> {
        self.cpus.get(cpu as usize).and_then(|c| c.error.as_deref())
    }

    /// One poll of a live CPU: poke (update_footers), then drain what is committed,
    /// swapping pages away from the writer.
    pub fn poll(&mut self, cpu: u32) -> Result<(), SessionError> {
        if !self.is_live(cpu) {
            return Ok(());
        }
        // Drain first (swaps), then poke: with the mailbox, one request is in flight
        // per CPU at a time, and a page swap matters more than refreshed stats.
        let r = self.drain(cpu).and_then(|()| {
            if self.reader.request_in_flight(cpu) {
                Ok(())
            } else {
                self.reader
                    .poke(cpu)
                    .map(|_| ())
                    .map_err(SessionError::from)
            }
        });
        match r {
            // The guest writer finished (mailbox mode): nothing more to ask it; the rest
            // is read by `end_cpu` once its vCPU has stopped.
            Err(SessionError::Read(ReadError::WriterStopped { .. })) => Ok(()),
            r => r,
        }
    }

    /// The writer of `cpu` has stopped (finished, crashed or stopped): switch to the
    /// read-only walk of what is left and read it all. Never swaps.
    pub fn end_cpu(&mut self, cpu: u32) -> Result<(), SessionError> {
        let Some(st) = self.cpus.get_mut(cpu as usize) else {
            return Ok(());
        };
        if !st.live {
            return Ok(());
        }
        st.live = false;
        self.reader.sync_writer_counters(cpu)?;
        self.reader.finalize(cpu)?;
        let r = self.drain(cpu);
        let trailing = self.reader.take_trailing_loss(cpu);
        let st = &mut self.cpus[cpu as usize];
        st.pending_lost += trailing;
        if st.pending_lost > 0 {
            let (n, ts) = (std::mem::take(&mut st.pending_lost), st.last_ts);
            if let Output::Text { merger, .. } = &mut self.output {
                merger.push(cpu as usize, ts, Merged::Lost(n));
            }
        }
        if let Output::Text { merger, .. } = &mut self.output {
            merger.finish(cpu as usize);
        }
        r
    }

    /// Records the first error seen on `cpu` (reported by [`Session::error`]).
    pub fn fail_cpu(&mut self, cpu: u32, e: &SessionError) {
        if let Some(st) = self.cpus.get_mut(cpu as usize) {
            st.error.get_or_insert_with(|| e.to_string());
        }
    }

    /// One round over the CPUs still read live: a CPU whose vCPU has stopped
    /// (`vcpu_stopped`) gets the final read-only walk, the others a poll. A poll that
    /// failed because its vCPU stopped meanwhile (a mailbox request it could no longer
    /// answer) is no error: that CPU gets the final walk instead. Every other failure is
    /// recorded ([`Session::fail_cpu`]), the CPU is walked anyway once its vCPU has
    /// stopped, and the failures are returned for the caller to report.
    pub fn service(&mut self, vcpu_stopped: impl Fn(u32) -> bool) -> Vec<(u32, SessionError)> {
        let mut failed = Vec::new();
        for cpu in 0..self.reader.nr_cpus() {
            if !self.is_live(cpu) {
                continue;
            }
            let r = if vcpu_stopped(cpu) {
                self.end_cpu(cpu)
            } else {
                self.poll(cpu)
            };
            let r = match r {
                Err(_) if vcpu_stopped(cpu) => self.end_cpu(cpu),
                r => r,
            };
            if let Err(e) = r {
                self.fail_cpu(cpu, &e);
                if vcpu_stopped(cpu) {
                    let _ = self.end_cpu(cpu);
                }
                failed.push((cpu, e));
            }
        }
        failed
    }

    fn drain(&mut self, cpu: u32) -> Result<(), SessionError> {
        match &mut self.output {
            Output::Text {
                merger, payloads, ..
            } => {
                let st = &mut self.cpus[cpu as usize];
                let fifo = &mut payloads[cpu as usize];
                // Bounded: every item consumes committed bytes or a page.
                while let Some(item) = self.reader.next_event(cpu)? {
                    match item {
                        Item::Event { ts, payload } => {
                            if st.pending_lost > 0 {
                                merger.push(
                                    cpu as usize,
                                    ts,
                                    Merged::Lost(std::mem::take(&mut st.pending_lost)),
                                );
                            }
                            st.last_ts = ts;
                            fifo.extend(payload);
                            merger.push(cpu as usize, ts, Merged::Event(payload.len()));
                        }
                        Item::Lost(n) => st.pending_lost += n,
                    }
                }
                Ok(())
            }
            Output::Pages(sink) => {
                while let Some(page) = self.reader.next_page(cpu)? {
                    let missed = (page.missed > 0).then_some(page.missed);
                    sink.page(cpu, page.bytes, missed)
                        .map_err(|e| SessionError::Output(e.to_string()))?;
                }
                Ok(())
            }
        }
    }

    /// Prints the merged events that are ready (all of them once every CPU ended).
    pub fn flush(&mut self) -> Result<(), SessionError> {
        let Output::Text {
            out,
            merger,
            payloads,
        } = &mut self.output
        else {
            return Ok(());
        };
        let mut payload = Vec::new();
        let (clock, printers, cmdlines, line, lines) = (
            &self.clock,
            &self.printers,
            &self.cmdlines,
            &mut self.line,
            &mut self.lines,
        );
        let mut err = None;
        merger.pop_ready(|cpu, ts, item| {
            line.clear();
            match item {
                Merged::Event(len) => {
                    payload.clear();
                    payload.extend(payloads[cpu].drain(..len));
                    format_guest_line(
                        line,
                        printers,
                        cmdlines,
                        cpu as u32,
                        clock.to_ns(ts),
                        &payload,
                    )
                }
                Merged::Lost(n) => format_drop(line, cpu as u32, Missed::Count(n)),
            }
            line.push('\n');
            *lines += 1;
            if err.is_none() {
                if let Err(e) = out.write_all(line.as_bytes()) {
                    err = Some(e);
                }
            }
        });
        if let Some(e) = err {
            return Err(SessionError::Output(e.to_string()));
        }
        Ok(())
    }

    /// Per-CPU statistics (reader's view, with the writer's counters once it stopped).
    pub fn stats(&self, cpu: u32) -> CpuStats {
        self.reader.stats(cpu)
    }

    /// Whether the writer of `cpu` said it finished (rather than being stopped or
    /// crashing in the middle of a write).
    pub fn writer_finished(&self, cpu: u32) -> bool {
        self.reader.writer_finished(cpu)
    }

    /// Events the writer of `cpu` took in (committed or dropped), from its control block.
    ///
    /// The writer publishes an event's `commit` before it stores `entries`: a vCPU
    /// stopped (`--duration`, Ctrl-C) or crashed between the two leaves the control
    /// block one event behind its pages. Once such a CPU has been read to the end, the
    /// one committed event the reader found beyond `entries + dropped` counts as written.
    pub fn writer_index(&self, cpu: u32) -> u64 {
        let index = self.reader.writer_index(cpu);
        if !self.reader.writer_finished(cpu) && !self.is_live(cpu) {
            let st = self.reader.stats(cpu);
            let seen = st.read.saturating_add(st.lost);
            if seen == index.saturating_add(1) {
                return seen;
            }
        }
        index
    }

    /// Finishes the output: flushes text, or closes the sink with the summary.
    pub fn finish(self, summary: &hyptrace_output::RunSummary) -> Result<u64, SessionError> {
        match self.output {
            Output::Text { mut out, .. } => {
                out.flush()
                    .map_err(|e| SessionError::Output(e.to_string()))?;
            }
            Output::Pages(sink) => sink
                .finish(summary)
                .map_err(|e| SessionError::Output(e.to_string()))?,
        }
        Ok(self.lines)
    }
}
