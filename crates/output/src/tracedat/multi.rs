//! Multi-buffer trace.dat v7 (`hyptrace collect`): one named buffer instance per
//! source, as trace-cmd writes `record -B NAME` instances, assembled from single-buffer
//! v7 files that [`super::TraceDatSink`] wrote (one per source).
//!
//! Layout: the metadata (every source's event formats, once; a BUFFER option per
//! instance), the top-level buffer's flyrecord section (its CPUs without data), then
//! per instance its flyrecord section header and its CPUs' data, each from a page
//! boundary, copied byte for byte (zstd chunks included) from the source's file.
//! `trace-cmd report` reads every instance and merges them by time, each line prefixed
//! with its instance's name; KernelShark opens each instance as a stream.

use crate::error::{PartError, PartProblem};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;

use super::head::{align_up, flyrecord_header, v7_instances_metadata, Instance, Layout};
use super::ids::option;
use super::params::Compression;
use super::read::{TraceFile, TraceItem};
use crate::sink::TraceMeta;
use crate::target::{OutputFile, OutputTarget};
use crate::OutputError;
use hyptrace_format::EventFormat;

pub use crate::sink::{valid_instance_name, MAX_INSTANCE_NAME};

/// One buffer instance of a multi-buffer file: its name and the single-buffer v7
/// trace.dat (ours) holding its data.
#[derive(Clone, Debug)]
pub struct BufferPart {
    /// Instance name: 1 to [`MAX_INSTANCE_NAME`] bytes of `[A-Za-z0-9_.-]`, unique.
    pub name: String,
    /// The part's trace.dat.
    pub path: PathBuf,
}

/// A part opened: its metadata, and where its CPUs' data are in it.
struct Opened {
    name: String,
    path: PathBuf,
    file: TraceFile,
}

fn bad(part: &BufferPart, problem: PartProblem) -> OutputError {
    OutputError::Part(Box::new(PartError {
        name: part.name.clone(),
        path: part.path.clone(),
        problem,
    }))
}

/// Opens a part and checks that it can be an instance of a file with `meta`'s page
/// size and clock: v7, undamaged, the clock's name, no TSC2NSEC or OFFSET (its pages
/// carry that clock's nanoseconds).
fn open_part(part: &BufferPart, meta: &TraceMeta) -> Result<Opened, OutputError> {
    if !valid_instance_name(&part.name) {
        return Err(bad(part, PartProblem::Name));
    }
    let file = TraceFile::open(&part.path)?;
    let clock = meta.clock.file_clock();
    let offsets = file
        .options
        .iter()
        .any(|o| o.id == option::TSC2NSEC || o.id == option::OFFSET);
    if file.version != 7 || file.page_size != meta.page_size {
        return Err(bad(
            part,
            PartProblem::Version {
                version: file.version,
                page_size: file.page_size,
            },
        ));
    }
    if !file.damage.is_empty() {
        return Err(bad(part, PartProblem::Damaged(file.damage[0].clone())));
    }
    if file.clock.as_deref() != Some(clock.name.as_str()) || offsets || clock.tsc.is_some() {
        return Err(bad(
            part,
            PartProblem::Clock {
                found: file.clock.clone(),
                want: clock.name.clone(),
            },
        ));
    }
    Ok(Opened {
        name: part.name.clone(),
        path: part.path.clone(),
        file,
    })
}

/// The parts of a multi-buffer file, each checked as it is added: a part that does not
/// fit (a name twice, another page size, clock or compression, an event id whose format
/// differs from an earlier part's) is refused and the set stays as it was, so a caller
/// can leave one source out and write the others.
pub struct BufferSet {
    meta: TraceMeta,
    opened: Vec<Opened>,
    /// Every added part's formats, once, with the first part that gave each.
    formats: Vec<(EventFormat, String)>,
}

impl BufferSet {
    /// An empty set for a file with `meta`'s page size, clock and command lines (its
    /// formats are the parts').
    pub fn new(meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        Ok(Self {
            meta,
            opened: Vec::new(),
            formats: Vec::new(),
        })
    }

    /// How many parts the set holds.
    pub fn len(&self) -> usize {
        self.opened.len()
    }

    /// Whether the set holds no part.
    pub fn is_empty(&self) -> bool {
        self.opened.is_empty()
    }

    /// Adds a part after checking that it fits the set (see [`BufferSet`]).
    pub fn add(&mut self, part: &BufferPart) -> Result<(), OutputError> {
        if self.opened.iter().any(|o| o.name == part.name) {
            return Err(bad(part, PartProblem::SecondName));
        }
        let o = open_part(part, &self.meta)?;
        if let Some(first) = self.opened.first() {
            if first.file.is_compressed() != o.file.is_compressed() {
                return Err(bad(part, PartProblem::Compression(first.name.clone())));
            }
        }
        let mut new = Vec::new();
        for f in &o.file.formats {
            match self.formats.iter().find(|(g, _)| g.id == f.id) {
                Some((g, _)) if g == f => {}
                Some((g, first)) => {
                    let why = PartProblem::EventId {
                        id: f.id,
                        here: format!("{}:{}", f.system, f.name),
                        there: format!("{}:{}", g.system, g.name),
                        first: first.clone(),
                    };
                    return Err(bad(part, why));
                }
                None if new.iter().any(|g: &EventFormat| g.id == f.id) => {
                    return Err(bad(part, PartProblem::EventIdTwice(f.id)));
                }
                None => new.push(f.clone()),
            }
        }
        self.formats
            .extend(new.into_iter().map(|f| (f, part.name.clone())));
        self.opened.push(o);
        Ok(())
    }

    /// Writes the file to `target` (see [`write_buffers`]); returns the events per
    /// instance.
    pub fn write(self, target: &OutputTarget) -> Result<Vec<usize>, OutputError> {
        let Self {
            mut meta,
            opened,
            formats,
        } = self;
        meta.formats = formats.into_iter().map(|(f, _)| f).collect();
        write_opened(target, &meta, &opened)
    }
}

impl BufferSet {
    /// The parts, in order: each its instance name and its file (its pages for a sink
    /// of [`BufferSet::sink_meta`], its CPUs after the earlier parts').
    pub fn parts(&self) -> impl Iterator<Item = (&str, &TraceFile)> {
        self.opened.iter().map(|o| (o.name.as_str(), &o.file))
    }

    /// The metadata of one sink taking every part ([`TraceMeta::groups`]): the parts'
    /// CPUs one after the other, each part a group of its name, the parts' formats, the
    /// set's clock and page size; vCPU `c` of a part is named as in its part.
    pub fn sink_meta(&self) -> Result<TraceMeta, OutputError> {
        let mut meta = self.meta.clone();
        meta.formats = self.formats.iter().map(|(f, _)| f.clone()).collect();
        meta.cmdlines.clear();
        meta.groups.clear();
        meta.nr_cpus = 0;
        for o in &self.opened {
            // A part of host kernel events only (`collect --host-trace`) holds host
            // CPUs, not vCPUs: its pids are the host's, no vCPU's name.
            let host = !o.file.formats.is_empty()
                && o.file
                    .formats
                    .iter()
                    .all(|f| hyptrace_abi::registry::is_host_kernel_id(f.id));
            meta.push_group(&o.name, o.file.nr_cpus, (!host).then_some(&o.file.cmdlines))?;
        }
        meta.validate()?;
        Ok(meta)
    }

    /// Writes every part's events as `trace-cmd report -t` text to `target`, merged by
    /// time across the parts (ties: the earlier part; in a part, as [`TraceFile::records`]
    /// merges its CPUs), each line prefixed with its instance's name right-aligned to the
    /// longest, as `trace-cmd report` prints a multi-buffer file's lines. Memory: one
    /// reader and one pending line per part. Returns how many events were written.
    pub fn write_text(&self, target: &OutputTarget) -> Result<u64, OutputError> {
        use std::cmp::Reverse;
        let width = self.opened.iter().map(|o| o.name.len()).max().unwrap_or(0);
        let mut recs: Vec<_> = self.opened.iter().map(|o| o.file.records()).collect();
        let mut last = vec![0u64; recs.len()];
        // The next line of part `i`, keyed by its time (a loss line: the time of the
        // part's last event, so it stays right before the event it precedes).
        let mut next = |i: usize, recs: &mut Vec<super::read::Records<'_>>| {
            let o = &self.opened[i];
            // Bounded: each turn takes an item of the part's finite CPU data.
            loop {
                let item = recs[i].next_item()?;
                if let TraceItem::Event(r) = &item {
                    last[i] = r.ts_ns;
                }
                let mut line = format!("{:>width$}: ", o.name);
                if o.file.format_item(&mut line, &item) {
                    line.push('\n');
                    return Some((last[i], line, matches!(item, TraceItem::Event(_))));
                }
            }
        };
        let mut heap = std::collections::BinaryHeap::new();
        let mut pending: Vec<Option<(String, bool)>> = vec![None; recs.len()];
        let mut out = std::io::BufWriter::with_capacity(1 << 16, target.open()?);
        let mut events = 0u64;
        // The parts whose next line is to be read: all at first, then the one written.
        let mut advance: Vec<usize> = (0..recs.len()).collect();
        loop {
            for i in advance.drain(..) {
                if let Some((ts, line, ev)) = next(i, &mut recs) {
                    heap.push(Reverse((ts, i)));
                    pending[i] = Some((line, ev));
                }
            }
            let Some(Reverse((_, i))) = heap.pop() else {
                break;
            };
            if let Some((line, ev)) = pending[i].take() {
                out.write_all(line.as_bytes())
                    .map_err(|e| out.get_ref().error(e))?;
                events += u64::from(ev);
            }
            advance.push(i);
        }
        if let Some(e) = recs.iter_mut().find_map(|r| r.take_error()) {
            return Err(OutputError::ReadPart(Box::new(e)));
        }
        let out = out.into_inner().map_err(|e| {
            let (err, f) = e.into_parts();
            f.get_ref().error(err)
        })?;
        out.finish()?;
        Ok(events)
    }
}

/// Writes a multi-buffer v7 trace.dat to `target`: the top level with `meta` (page
/// size, clock, command lines; its `nr_cpus` CPUs have no data) and one instance per
/// part, in order, its data copied from the part's file. Every part must be a v7 file
/// of `meta`'s page size and clock with the same compression; their formats are
/// merged (an id with two formats is refused). Returns the events per instance.
pub fn write_buffers(
    target: &OutputTarget,
    meta: TraceMeta,
    parts: &[BufferPart],
) -> Result<Vec<usize>, OutputError> {
    let mut set = BufferSet::new(meta)?;
    for p in parts {
        set.add(p)?;
    }
    set.write(target)
}

/// [`BufferSet::write`] of parts checked already, with `meta.formats` their union.
fn write_opened(
    target: &OutputTarget,
    meta: &TraceMeta,
    opened: &[Opened],
) -> Result<Vec<usize>, OutputError> {
    let compression = match opened.first() {
        Some(o) if o.file.is_compressed() => Compression::Zstd,
        _ => Compression::None,
    };
    let page = meta.page_size as u64;
    let instances = |at: &[(u64, Layout)]| -> Vec<Instance<'_>> {
        opened
            .iter()
            .zip(at)
            .map(|(o, (f, l))| Instance {
                name: &o.name,
                flyrecord_at: *f,
                layout: l.clone(),
            })
            .collect()
    };
    let top_n = meta.nr_cpus as usize;
    let empty = |start: u64| Layout {
        offsets: vec![start; top_n],
        sizes: vec![0; top_n],
    };
    // The offsets do not change the metadata's length: a first build gives it.
    let zero: Vec<(u64, Layout)> = opened
        .iter()
        .map(|o| (0, part_layout(&o.file, 0, page)))
        .collect();
    let (first, _) = v7_instances_metadata(meta, &empty(0), 0, compression, &instances(&zero))?;
    let data_start = align_up(first.len() as u64, page);
    let mut at = data_start;
    let mut places = Vec::with_capacity(opened.len());
    for o in opened {
        let l = part_layout(&o.file, align_up(at + 16, page), page);
        places.push((at, l.clone()));
        at = align_up(l.end(at + 16), page);
    }
    let (head, name_id) = v7_instances_metadata(
        meta,
        &empty(data_start),
        data_start,
        compression,
        &instances(&places),
    )?;
    let mut out = target.open()?;
    out.write_all(&head).map_err(|e| out.error(e))?;
    let mut pos = head.len() as u64;
    let mut buf = vec![0u8; 1 << 20];
    let mut events = Vec::with_capacity(opened.len());
    for (o, (fly, l)) in opened.iter().zip(&places) {
        pad(&mut out, &mut pos, *fly)?;
        let size = l.end(fly + 16) - (fly + 16);
        let h = flyrecord_header(name_id, compression, size);
        out.write_all(&h).map_err(|e| out.error(e))?;
        pos += 16;
        let mut src = File::open(&o.path).map_err(|e| OutputError::io(&o.path, e))?;
        for (c, (&off, &n)) in o.file.cpus.iter().zip(l.offsets.iter().zip(&l.sizes)) {
            pad(&mut out, &mut pos, off)?;
            copy_range(&mut src, &o.path, c.offset, n, &mut out, &mut buf)?;
            pos += n;
        }
        events.push(o.file.event_count());
    }
    pad(&mut out, &mut pos, at)?;
    out.finish()?;
    Ok(events)
}

/// Where a part's CPUs' data go from `start`: each from a page boundary, contiguous.
fn part_layout(f: &TraceFile, start: u64, page: u64) -> Layout {
    let sizes: Vec<u64> = f.cpus.iter().map(|c| c.size).collect();
    Layout::contiguous(start, &sizes, page)
}

/// Writes zeros from `*pos` to `to`.
fn pad(out: &mut OutputFile, pos: &mut u64, to: u64) -> Result<(), OutputError> {
    let n = to.saturating_sub(*pos);
    io::copy(&mut io::repeat(0).take(n), out).map_err(|e| out.error(e))?;
    *pos += n;
    Ok(())
}

/// Copies `n` bytes at `offset` of `src` (a part's file) to `out`.
fn copy_range(
    src: &mut File,
    path: &std::path::Path,
    offset: u64,
    n: u64,
    out: &mut OutputFile,
    buf: &mut [u8],
) -> Result<(), OutputError> {
    let rd = |e| OutputError::io(path, e);
    src.seek(SeekFrom::Start(offset)).map_err(rd)?;
    let mut left = n;
    while left > 0 {
        let want = usize::try_from(left).map_or(buf.len(), |l| l.min(buf.len()));
        let k = match src.read(&mut buf[..want]) {
            Ok(0) => {
                let e = io::Error::new(io::ErrorKind::UnexpectedEof, "CPU data cut short");
                return Err(rd(e));
            }
            Ok(k) => k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(rd(e)),
        };
        out.write_all(&buf[..k]).map_err(|e| out.error(e))?;
        left -= k as u64;
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::sink::{PageSink, RunSummary};
    use crate::TraceDatVersion;

    /// A page of `cpu` with one marker at `ts`.
    fn page(cpu: u32, ts: u64, seq: u64) -> Vec<u8> {
        let mut p = vec![0u8; 4096];
        p[..8].copy_from_slice(&ts.to_le_bytes());
        let payload =
            hyptrace_abi::events::marker(hyptrace_abi::events::vcpu_pid(cpu), seq, seq * 3);
        let mut hdr = [0u8; 8];
        let n = hyptrace_abi::page::encode_data_header(&mut hdr, payload.len(), 0);
        p[16..16 + n].copy_from_slice(&hdr[..n]);
        p[16 + n..16 + n + payload.len()].copy_from_slice(&payload);
        p[8..16].copy_from_slice(&((n + payload.len()) as u64).to_le_bytes());
        p
    }

    pub(in crate::tracedat) fn part(
        dir: &std::path::Path,
        name: &str,
        cpus: u32,
        pages: u64,
        z: Compression,
    ) -> BufferPart {
        let meta = TraceMeta::guest(4096, cpus, crate::Clock::nanoseconds());
        part_of(dir, name, meta, pages, z)
    }

    fn part_of(
        dir: &std::path::Path,
        name: &str,
        meta: TraceMeta,
        pages: u64,
        z: Compression,
    ) -> BufferPart {
        part_with(dir, name, meta, pages, z, &|_, _| crate::Missed::None)
    }

    /// [`part`] of `meta`'s CPUs, with `missed(cpu, i)` events lost before page `i` of
    /// CPU `cpu`.
    pub(in crate::tracedat) fn part_with(
        dir: &std::path::Path,
        name: &str,
        meta: TraceMeta,
        pages: u64,
        z: Compression,
        missed: &dyn Fn(u32, u64) -> crate::Missed,
    ) -> BufferPart {
        let path = dir.join(format!("{name}.dat"));
        let cpus = meta.nr_cpus;
        let mut s = crate::TraceDatSink::create_with(&path, meta, TraceDatVersion::V7, z).unwrap();
        for i in 0..pages {
            for c in 0..cpus {
                let p = page(c, 1000 + i * 100 + u64::from(c), i);
                s.page(c, &p, missed(c, i)).unwrap();
            }
        }
        Box::new(s).finish(&RunSummary::default()).unwrap();
        BufferPart {
            name: name.into(),
            path,
        }
    }

    /// Two instances (1 and 2 CPUs), compressed or not: the file parses, its top level
    /// is empty, and each instance's BUFFER option names CPU data that reads back as
    /// the part's pages.
    #[test]
    fn instances_read_back() {
        for z in [Compression::None, Compression::Zstd] {
            let dir = tempfile::tempdir().unwrap();
            let parts = vec![
                part(dir.path(), "vm-a", 1, 30, z),
                part(dir.path(), "vm.b", 2, 7, z),
            ];
            let out = dir.path().join("all.dat");
            let target = OutputTarget::check(&out).unwrap();
            let meta = TraceMeta::guest(4096, 2, crate::Clock::nanoseconds());
            let n = write_buffers(&target, meta, &parts).unwrap();
            assert_eq!(n, vec![30, 14]);
            let f = TraceFile::open(&out).unwrap();
            assert!(f.damage.is_empty(), "{:?}", f.damage);
            assert_eq!(f.event_count(), 44);
            assert_eq!(f.options_skipped, 2);
            let names: Vec<&str> = f.instances.iter().map(|i| i.name.as_str()).collect();
            assert_eq!(names, ["vm-a", "vm.b"]);
            let bytes = std::fs::read(&out).unwrap();
            for p in &parts {
                let src = TraceFile::open(&p.path).unwrap();
                let want = std::fs::read(&p.path).unwrap();
                // The part's CPU data is somewhere in the file, byte for byte.
                for c in &src.cpus {
                    let d = &want[c.offset as usize..(c.offset + c.size) as usize];
                    assert!(
                        bytes.windows(d.len()).any(|w| w == d),
                        "{} cpu {}",
                        p.name,
                        c.cpu
                    );
                }
            }
        }
    }

    /// Names outside `[A-Za-z0-9_.-]`, twice the same name and mixed compression are
    /// refused; no output is left.
    #[test]
    fn bad_parts_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a = part(dir.path(), "a", 1, 2, Compression::None);
        let b = part(dir.path(), "b", 1, 2, Compression::Zstd);
        let out = dir.path().join("all.dat");
        let meta = TraceMeta::guest(4096, 1, crate::Clock::nanoseconds());
        let try_write = |parts: &[BufferPart]| {
            write_buffers(&OutputTarget::check(&out).unwrap(), meta.clone(), parts)
        };
        let mut evil = a.clone();
        evil.name = "a b\n".into();
        assert!(try_write(&[evil]).is_err());
        assert!(try_write(&[a.clone(), a.clone()]).is_err());
        assert!(try_write(&[a.clone(), b]).is_err());
        assert!(!out.exists());
        // A part whose event id has another format is left out; the set writes the rest.
        let mut other = TraceMeta::guest(4096, 1, crate::Clock::nanoseconds());
        other.formats[0].name = "renamed".into();
        let c = part_of(dir.path(), "c", other, 2, Compression::None);
        let mut set = BufferSet::new(meta.clone()).unwrap();
        set.add(&a).unwrap();
        let e = set.add(&c).unwrap_err().to_string();
        assert!(e.contains("buffer c") && e.contains("renamed"), "{e}");
        assert_eq!(set.len(), 1);
        let n = set.write(&OutputTarget::check(&out).unwrap()).unwrap();
        assert_eq!(n, vec![2]);
        assert!(!valid_instance_name(""));
        assert!(!valid_instance_name(&"x".repeat(65)));
        assert!(valid_instance_name("vm-1.a_b"));
    }
}

#[cfg(test)]
mod trace_cmd_tests {
    use super::*;

    /// trace-cmd (when installed) reads every instance: each event once, its line
    /// prefixed with its instance's name, all merged in one time order.
    #[test]
    fn trace_cmd_reports_every_instance() {
        let Ok(o) = std::process::Command::new("trace-cmd")
            .arg("--help")
            .output()
        else {
            println!("SKIP: trace-cmd not installed");
            return;
        };
        drop(o);
        let dir = tempfile::tempdir().unwrap();
        let parts = vec![
            super::tests::part(dir.path(), "vm-a", 1, 30, Compression::Zstd),
            super::tests::part(dir.path(), "vmb", 2, 7, Compression::Zstd),
        ];
        let out = dir.path().join("all.dat");
        let meta = TraceMeta::guest(4096, 2, crate::Clock::nanoseconds());
        write_buffers(&OutputTarget::check(&out).unwrap(), meta, &parts).unwrap();
        let o = std::process::Command::new("trace-cmd")
            .args(["report", "-i"])
            .arg(&out)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        // Our text of the same parts is trace-cmd's `report -t`, line for line (its
        // `cpus=N` line of the empty top level aside).
        let mut set =
            BufferSet::new(TraceMeta::guest(4096, 2, crate::Clock::nanoseconds())).unwrap();
        for p in &parts {
            set.add(p).unwrap();
        }
        let txt = dir.path().join("all.txt");
        assert_eq!(
            set.write_text(&OutputTarget::check(&txt).unwrap()).unwrap(),
            44
        );
        let t = std::process::Command::new("trace-cmd")
            .args(["report", "-t", "-i"])
            .arg(&out)
            .output()
            .unwrap();
        let theirs = String::from_utf8_lossy(&t.stdout);
        let theirs: Vec<&str> = theirs.lines().filter(|l| !l.starts_with("cpus=")).collect();
        let ours = std::fs::read_to_string(&txt).unwrap();
        assert_eq!(ours.lines().collect::<Vec<_>>(), theirs);
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("marker")).collect();
        let count = |p: &str| {
            lines
                .iter()
                .filter(|l| l.trim_start().starts_with(p))
                .count()
        };
        assert_eq!((count("vm-a:"), count("vmb:")), (30, 14), "{text}");
    }
}
