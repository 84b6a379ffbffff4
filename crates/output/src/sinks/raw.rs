//! Raw page streams (`--format raw`): the sink, and the reader that replays a stream
//! into another sink.

use crate::error::{RawError, RawProblem};
use std::collections::BTreeMap;
use std::path::Path;

use super::stream::{StreamOut, StreamSink};
use crate::clock::{Clock, TscConversion};
use crate::export::{commit_len, page_missed, Missed};
use crate::sink::{KernelCpuStat, PageSink, RunSummary, TraceMeta};
use crate::OutputError;

/// Magic of a raw page stream.
pub const RAW_MAGIC: &[u8; 8] = b"HTRAWPG2";
/// Magic of the previous raw stream (no `offset_ns`), still read.
pub const RAW_MAGIC_V1: &[u8; 8] = b"HTRAWPG1";

/// Whether `head` starts like a raw page stream (either version).
pub fn is_raw_stream(head: &[u8]) -> bool {
    head.starts_with(RAW_MAGIC) || head.starts_with(RAW_MAGIC_V1)
}
const RAW_TAG_PAGE: u32 = 1;
const RAW_TAG_END: u32 = 2;

/// Raw sink (`--format raw`): the exported pages as they arrive, in a simple stream
/// (all little-endian):
///
/// ```text
/// header:  "HTRAWPG2" | u32 page_size | u32 nr_cpus | u32 mult | u32 shift | u64 offset
///          | u32 clock_name_len | clock name bytes | i64 offset_ns
///          (mult = 0: timestamps are ns; else ns = ((ts - offset) * mult) >> shift;
///          then + offset_ns, see `Clock`; "HTRAWPG1" streams lack offset_ns: 0)
/// page:    u32 1 | u32 cpu | page_size bytes (exported copy: Linux buffer_data_page,
///          tail zeroed, losses as RB_MISSED_* flags + count after the data)
/// end:     u32 2 | u32 n | n × 8 u64 stats (entries, overrun, commit_overrun, bytes,
///          oldest_event_ts, now_ts, dropped_events, read_events)
/// ```
///
/// A stream without the end record was cut short; its pages are still readable.
pub struct RawSink {
    meta: TraceMeta,
    out: Option<StreamOut>,
    scratch: Vec<u8>,
}

/// A raw stream: its header written.
impl StreamSink for RawSink {
    fn from_output(mut out: StreamOut, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        meta.check_one_vm("a raw page stream")?;
        let mut h = RAW_MAGIC.to_vec();
        h.extend_from_slice(&(meta.page_size as u32).to_le_bytes());
        h.extend_from_slice(&meta.nr_cpus.to_le_bytes());
        // With a map: the host clock's name, pages in ns (see `RawSink::page`).
        let clock = meta.clock.file_clock();
        let t = clock.tsc.unwrap_or(TscConversion {
            mult: 0,
            shift: 0,
            offset: 0,
        });
        h.extend_from_slice(&t.mult.to_le_bytes());
        h.extend_from_slice(&t.shift.to_le_bytes());
        h.extend_from_slice(&t.offset.to_le_bytes());
        h.extend_from_slice(&(clock.name.len() as u32).to_le_bytes());
        h.extend_from_slice(clock.name.as_bytes());
        h.extend_from_slice(&clock.offset_ns.to_le_bytes());
        out.write_all(&h)?;
        Ok(Self {
            scratch: vec![0; meta.page_size],
            meta,
            out: Some(out),
        })
    }
}

impl RawSink {
    /// Writes one page record; ring pages are retimed to the clock's map (if any), the
    /// empty `trailing_lost` page is not.
    fn store_page(
        &mut self,
        cpu: u32,
        page: &[u8],
        missed: Missed,
        retime: bool,
    ) -> Result<(), OutputError> {
        self.meta
            .file_page(cpu, page, missed, retime, &mut self.scratch)?;
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        out.write_all(&RAW_TAG_PAGE.to_le_bytes())?;
        out.write_all(&cpu.to_le_bytes())?;
        out.write_all(&self.scratch)?;
        Ok(())
    }
}

impl PageSink for RawSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        self.store_page(cpu, page, missed, true)
    }

    /// An event-less page record carrying the count (`commit` 0 with `RB_MISSED_EVENTS |
    /// RB_MISSED_STORED`, the u64 count right after the header), timestamped like the
    /// CPU's last page: [`RawTrace::replay`] turns a CPU's last page of that kind back
    /// into `trailing_lost`.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        let empty = vec![0u8; self.meta.page_size];
        self.meta.check_page(cpu, &empty)?;
        if lost == 0 {
            return Ok(());
        }
        self.store_page(cpu, &empty, Missed::Count(lost), false)
    }

    fn finish(mut self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        let Some(mut out) = self.out.take() else {
            return Ok(());
        };
        let mut e = RAW_TAG_END.to_le_bytes().to_vec();
        e.extend_from_slice(&(summary.cpus.len() as u32).to_le_bytes());
        for s in &summary.cpus {
            for v in [
                s.entries,
                s.overrun,
                s.commit_overrun,
                s.bytes,
                s.oldest_event_ts,
                s.now_ts,
                s.dropped_events,
                s.read_events,
            ] {
                e.extend_from_slice(&v.to_le_bytes());
            }
        }
        out.write_all(&e)?;
        out.close()
    }
}

/// A parsed raw page stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawTrace {
    /// Page size.
    pub page_size: usize,
    /// CPU count.
    pub nr_cpus: u32,
    /// Clock.
    pub clock: Clock,
    /// Exported pages `(cpu, page)` in stream order.
    pub pages: Vec<(u32, Vec<u8>)>,
    /// Stats from the end record; `None` if the stream was cut short.
    pub summary: Option<RunSummary>,
}

/// One record of a raw page stream.
enum RawRecord<'a> {
    Page(u32, &'a [u8]),
    End(RunSummary),
}

/// Most CPUs a raw stream may declare (what [`TraceMeta::validate`] accepts).
const RAW_MAX_CPUS: u32 = 4096;

/// Reads the records of a raw page stream (hostile-safe: every length is checked, a
/// stream cut short at a record boundary simply ends, one cut inside a record is an
/// error).
struct RawStream<R> {
    r: R,
    page_size: usize,
    nr_cpus: u32,
    clock: Clock,
    page: Vec<u8>,
    done: bool,
}

fn raw_bad(problem: RawProblem) -> RawError {
    RawError::Malformed {
        path: None,
        problem,
    }
}

/// An I/O error of a stream whose file is not known (yet).
fn raw_io(source: std::io::Error) -> RawError {
    RawError::Io { path: None, source }
}

/// `read_exact`, with a short read as "truncated" (other I/O errors kept).
fn raw_read(r: &mut impl std::io::Read, buf: &mut [u8]) -> Result<(), RawError> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            raw_bad(RawProblem::Truncated)
        } else {
            raw_io(e)
        }
    })
}

fn raw_u32(r: &mut impl std::io::Read) -> Result<u32, RawError> {
    let mut w = [0u8; 4];
    raw_read(r, &mut w)?;
    Ok(u32::from_le_bytes(w))
}

impl<R: std::io::Read> RawStream<R> {
    /// Reads the header.
    fn new(mut r: R) -> Result<Self, RawError> {
        let mut magic = [0u8; 8];
        raw_read(&mut r, &mut magic)?;
        let v1 = &magic == RAW_MAGIC_V1;
        if &magic != RAW_MAGIC && !v1 {
            return Err(raw_bad(RawProblem::Magic));
        }
        let page_size = raw_u32(&mut r)? as usize;
        crate::export::check_page_size(page_size).map_err(|_| raw_bad(RawProblem::PageSize))?;
        let nr_cpus = raw_u32(&mut r)?;
        if nr_cpus == 0 || nr_cpus > RAW_MAX_CPUS {
            return Err(raw_bad(RawProblem::CpuCount));
        }
        let mult = raw_u32(&mut r)?;
        let shift = raw_u32(&mut r)?;
        let mut o = [0u8; 8];
        raw_read(&mut r, &mut o)?;
        let offset = u64::from_le_bytes(o);
        let n = raw_u32(&mut r)? as usize;
        if n > 4096 {
            return Err(raw_bad(RawProblem::ClockName));
        }
        let mut name = vec![0u8; n];
        raw_read(&mut r, &mut name)?;
        let offset_ns = if v1 {
            0
        } else {
            let mut o = [0u8; 8];
            raw_read(&mut r, &mut o)?;
            i64::from_le_bytes(o)
        };
        let tsc = (mult != 0).then_some(TscConversion {
            mult,
            shift,
            offset,
        });
        Ok(Self {
            r,
            page_size,
            nr_cpus,
            clock: Clock {
                name: String::from_utf8_lossy(&name).into_owned(),
                tsc,
                map: None,
                offset_ns,
            },
            page: vec![0u8; page_size],
            done: false,
        })
    }

    /// The next record; `None` after the end record or at the end of the stream.
    fn next(&mut self) -> Result<Option<RawRecord<'_>>, RawError> {
        if self.done {
            return Ok(None);
        }
        let mut t = [0u8; 4];
        // A stream cut short at a record boundary simply ends.
        let mut got = 0;
        while got < 4 {
            match self.r.read(&mut t[got..]) {
                Ok(0) if got == 0 => {
                    self.done = true;
                    return Ok(None);
                }
                Ok(0) => return Err(raw_bad(RawProblem::Truncated)),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(raw_io(e)),
            }
        }
        match u32::from_le_bytes(t) {
            RAW_TAG_PAGE => {
                let cpu = raw_u32(&mut self.r)?;
                if cpu >= self.nr_cpus {
                    return Err(raw_bad(RawProblem::Cpu));
                }
                raw_read(&mut self.r, &mut self.page)?;
                Ok(Some(RawRecord::Page(cpu, &self.page)))
            }
            RAW_TAG_END => {
                self.done = true;
                let n = raw_u32(&mut self.r)?;
                if n > RAW_MAX_CPUS {
                    return Err(raw_bad(RawProblem::EndCpuCount));
                }
                let mut cpus = Vec::new();
                for _ in 0..n {
                    let mut s = [0u8; 64];
                    raw_read(&mut self.r, &mut s)?;
                    let v = |i: usize| {
                        let mut w = [0u8; 8];
                        w.copy_from_slice(&s[i * 8..i * 8 + 8]);
                        u64::from_le_bytes(w)
                    };
                    cpus.push(KernelCpuStat {
                        entries: v(0),
                        overrun: v(1),
                        commit_overrun: v(2),
                        bytes: v(3),
                        oldest_event_ts: v(4),
                        now_ts: v(5),
                        dropped_events: v(6),
                        read_events: v(7),
                    });
                }
                Ok(Some(RawRecord::End(RunSummary { cpus })))
            }
            _ => Err(raw_bad(RawProblem::Tag)),
        }
    }
}

/// A raw page stream read from a file, streaming: [`RawReader::replay`] holds one page
/// per CPU, whatever the file size.
pub struct RawReader {
    stream: RawStream<std::io::BufReader<Box<dyn std::io::Read + Send>>>,
    path: std::path::PathBuf,
}

impl RawReader {
    /// Opens a raw page stream and reads its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, RawError> {
        let p = path.as_ref();
        let f = std::fs::File::open(p).map_err(|e| RawError::Io {
            path: Some(p.to_path_buf()),
            source: e,
        })?;
        Self::from_reader(Box::new(f), p)
    }

    /// Reads a raw page stream from any reader (a pipe, stdin), streaming as
    /// [`RawReader::open`]; `name` names it in errors.
    pub fn from_reader(
        r: Box<dyn std::io::Read + Send>,
        name: impl Into<std::path::PathBuf>,
    ) -> Result<Self, RawError> {
        let stream = RawStream::new(std::io::BufReader::with_capacity(1 << 17, r))?;
        Ok(Self {
            stream,
            path: name.into(),
        })
    }

    /// Page size.
    pub fn page_size(&self) -> usize {
        self.stream.page_size
    }

    /// CPU count.
    pub fn nr_cpus(&self) -> u32 {
        self.stream.nr_cpus
    }

    /// Clock of the page timestamps.
    pub fn clock(&self) -> &Clock {
        &self.stream.clock
    }

    /// The metadata of the run that wrote the stream (the built-in guest events).
    pub fn meta(&self) -> TraceMeta {
        TraceMeta::guest(self.page_size(), self.nr_cpus(), self.clock().clone())
    }

    /// Feeds the pages of the CPUs `want` accepts into `sink`, losses preserved, then
    /// finishes it (with the end record's stats). Each CPU's page is handed over when
    /// the CPU's next page arrives (at most one page per CPU is held): a CPU's last page
    /// that holds no event but a loss count (what [`RawSink`]'s `trailing_lost` writes)
    /// is replayed as `trailing_lost`.
    pub fn replay(
        mut self,
        mut sink: Box<dyn PageSink>,
        want: impl Fn(u32) -> bool,
    ) -> Result<(), OutputError> {
        let ps = self.stream.page_size;
        let mut held: Vec<Option<Vec<u8>>> = vec![None; self.stream.nr_cpus as usize];
        let mut summary = RunSummary::default();
        let path = self.path.clone();
        let named = |e: RawError| match e {
            RawError::Malformed {
                path: None,
                problem,
            } => RawError::Malformed {
                path: Some(path.clone()),
                problem,
            },
            RawError::Io { path: None, source } => RawError::Io {
                path: Some(path.clone()),
                source,
            },
            e => e,
        };
        // Bounded: every record consumes bytes of the file.
        loop {
            match self.stream.next().map_err(named)? {
                None => break,
                Some(RawRecord::End(s)) => {
                    summary = s;
                    break;
                }
                Some(RawRecord::Page(cpu, page)) => {
                    if !want(cpu) {
                        continue;
                    }
                    let slot = &mut held[cpu as usize];
                    if let Some(prev) = slot.as_mut() {
                        sink.page(cpu, prev, page_missed(prev))?;
                        prev.copy_from_slice(page);
                    } else {
                        let mut v = vec![0u8; ps];
                        v.copy_from_slice(page);
                        *slot = Some(v);
                    }
                }
            }
        }
        for (cpu, p) in held.iter().enumerate() {
            let Some(p) = p else { continue };
            let cpu = cpu as u32;
            match (page_missed(p), commit_len(p)) {
                (Missed::Count(n), Some(0)) => sink.trailing_lost(cpu, n)?,
                (m, _) => sink.page(cpu, p, m)?,
            }
        }
        sink.finish(&summary)
    }
}

impl RawTrace {
    /// Parses a raw page stream held in memory (hostile-safe).
    pub fn parse(b: &[u8]) -> Result<Self, RawError> {
        let mut st = RawStream::new(b)?;
        let mut pages = Vec::new();
        let mut summary = None;
        // Bounded: every record consumes bytes of `b`.
        while let Some(r) = st.next()? {
            match r {
                RawRecord::Page(cpu, p) => pages.push((cpu, p.to_vec())),
                RawRecord::End(s) => summary = Some(s),
            }
        }
        Ok(Self {
            page_size: st.page_size,
            nr_cpus: st.nr_cpus,
            clock: st.clock,
            pages,
            summary,
        })
    }

    /// Feeds the pages into another sink (e.g. a [`crate::TraceDatSink`]), losses
    /// preserved, then finishes it.
    /// A CPU's last page that holds no event but a loss count (what
    /// [`RawSink`]'s `trailing_lost` writes) is replayed as `trailing_lost`.
    pub fn replay(&self, mut sink: Box<dyn PageSink>) -> Result<(), OutputError> {
        let mut last_of_cpu = BTreeMap::new();
        for (i, (cpu, _)) in self.pages.iter().enumerate() {
            last_of_cpu.insert(*cpu, i);
        }
        for (i, (cpu, p)) in self.pages.iter().enumerate() {
            let missed = page_missed(p);
            if let (Missed::Count(n), Some(0)) = (missed, commit_len(p)) {
                if last_of_cpu.get(cpu) == Some(&i) {
                    sink.trailing_lost(*cpu, n)?;
                    continue;
                }
            }
            sink.page(*cpu, p, missed)?;
        }
        sink.finish(&self.summary.clone().unwrap_or_default())
    }
}
