//! Hostile trace.dat files (issue 36): each test records a small trace in-process with
//! the project's own writer (`TraceDatSink`, no /dev/kvm needed), rewrites it into a
//! bomb — metadata that declares far more than the file holds, CPU data that
//! decompresses to far more, a CPU table naming thousands of CPUs — and runs the built
//! `hyptrace report` and `hyptrace convert` on it under a watchdog: each stays under
//! 512 MiB of peak RSS (`ru_maxrss` of the child, from `wait4`) and under 10 s + 2 s per
//! MB of input, and where the file lies it exits 1 naming what it skipped
//! (docs/output.md "Hostile input").
//!
//! The bombs are generated streaming (compressed as they are made, never held whole):
//! a child's `ru_maxrss` also counts the test process's own peak (its image before the
//! exec), which therefore stays small.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use hyptrace::adversary::{run_watched, Limits, Watched};
use hyptrace::env::TempDir;
use hyptrace::rng::Rng;
use hyptrace_output::tracedat::{option, MAX_CHUNK, MAX_RATIO};
use hyptrace_output::{
    Clock, Compression, PageSink, RunSummary, TraceDatSink, TraceDatVersion, TraceFile, TraceMeta,
};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
/// Peak RSS bound of every run.
const RSS_KIB: u64 = 512 * 1024;
/// Pages per CPU and events per page of the recorded base files.
const PAGES: usize = 24;
const EVENTS: usize = 20;

// ---------------------------------------------------------------------------------
// The base recording.

/// A page of `cpu` at time `ts` holding `EVENTS` markers (the first at `ts`, then one
/// every 1000 ns).
fn page(page_size: usize, cpu: u32, ts: u64, seq: u64) -> Vec<u8> {
    page_of(page_size, cpu, ts, seq, EVENTS)
}

/// A page of `cpu` at time `ts` holding `events` markers.
fn page_of(page_size: usize, cpu: u32, ts: u64, seq: u64, events: usize) -> Vec<u8> {
    use hyptrace_abi::events::{marker, vcpu_pid};
    use hyptrace_abi::page::encode_data_header;
    let mut p = vec![0u8; page_size];
    p[..8].copy_from_slice(&ts.to_le_bytes());
    let mut off = 16;
    for k in 0..events {
        let payload = marker(vcpu_pid(cpu), seq + k as u64, 7);
        let mut hdr = [0u8; 8];
        let n = encode_data_header(&mut hdr, payload.len(), if k == 0 { 0 } else { 1000 });
        p[off..off + n].copy_from_slice(&hdr[..n]);
        p[off + n..off + n + payload.len()].copy_from_slice(&payload);
        off += n + payload.len();
    }
    p[8..16].copy_from_slice(&((off - 16) as u64).to_le_bytes());
    p
}

/// Records `cpus` CPUs of `pages` pages each into a v7 trace.dat at `path` with our
/// writer; returns its bytes.
fn record(path: &Path, cpus: u32, pages: usize, compression: Compression) -> Vec<u8> {
    let meta = TraceMeta::guest(4096, cpus, Clock::nanoseconds());
    let mut s = TraceDatSink::create_with(path, meta, TraceDatVersion::V7, compression)
        .expect("create trace.dat");
    for cpu in 0..cpus {
        for i in 0..pages {
            let ts = 1_000_000 + i as u64 * 100_000 + u64::from(cpu) * 7;
            let p = page(4096, cpu, ts, (i * EVENTS) as u64);
            s.page(cpu, &p, hyptrace_output::Missed::None)
                .expect("page");
        }
    }
    Box::new(s)
        .finish(&RunSummary::default())
        .expect("finish trace.dat");
    std::fs::read(path).expect("read trace.dat")
}

// ---------------------------------------------------------------------------------
// v7 surgery: sections and options appended at the end, pointers patched.

/// Where the parts of a v7 file are.
struct Layout {
    /// Offset of the u64 that points at the first options section.
    opt_ptr: usize,
    /// The options of the first options section: (id, data offset, data length).
    options: Vec<(u16, usize, usize)>,
}

fn le16(d: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(d[at..at + 2].try_into().expect("2 bytes"))
}

fn le32(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(d[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(d: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(d[at..at + 8].try_into().expect("8 bytes"))
}

fn set64(d: &mut [u8], at: usize, v: u64) {
    d[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn layout(d: &[u8]) -> Layout {
    assert_eq!(&d[10..12], b"7\0", "a v7 file");
    // Magic, version, endianness, long size, page size, then two strings.
    let mut at = 18;
    for _ in 0..2 {
        at += d[at..].iter().position(|&b| b == 0).expect("string") + 1;
    }
    let opt_ptr = at;
    let sec = le64(d, opt_ptr) as usize;
    assert_eq!(le16(d, sec), 0, "options section");
    let (start, end) = (sec + 16, sec + 16 + le64(d, sec + 8) as usize);
    let mut options = Vec::new();
    let mut o = start;
    while o < end {
        let (id, n) = (le16(d, o), le32(d, o + 2) as usize);
        options.push((id, o + 6, n));
        o += 6 + n;
        if id == option::DONE {
            break;
        }
    }
    Layout { opt_ptr, options }
}

impl Layout {
    /// Data offset and length of the first option `id`.
    fn option(&self, id: u16) -> (usize, usize) {
        let &(_, at, n) = self
            .options
            .iter()
            .find(|o| o.0 == id)
            .unwrap_or_else(|| panic!("no option {id}"));
        (at, n)
    }
}

fn opt(id: u16, data: &[u8]) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    v.extend_from_slice(&(data.len() as u32).to_le_bytes());
    v.extend_from_slice(data);
    v
}

/// Counts the bytes written into a zstd encoder.
struct Counted {
    enc: zstd::stream::Encoder<'static, Vec<u8>>,
    n: u64,
}

impl Write for Counted {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let k = self.enc.write(b)?;
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.enc.flush()
    }
}

/// A compressed block as trace.dat stores one (compressed size, uncompressed size, the
/// zstd frame) of the bytes `fill` writes, compressed as they come.
fn zblock_with(fill: impl FnOnce(&mut dyn Write)) -> Vec<u8> {
    let enc = zstd::stream::Encoder::new(Vec::new(), 3).expect("zstd");
    let mut c = Counted { enc, n: 0 };
    fill(&mut c);
    let us = u32::try_from(c.n).expect("a block under 4 GiB");
    let z = c.enc.finish().expect("zstd");
    let mut v = (z.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(&us.to_le_bytes());
    v.extend_from_slice(&z);
    v
}

/// [`zblock_with`] of `content`.
fn zblock(content: &[u8]) -> Vec<u8> {
    zblock_with(|w| w.write_all(content).expect("zstd"))
}

/// Writes `fill` as `len` bytes through `w` in 64 KiB pieces: `fill(offset, piece)`.
fn pieces(w: &mut dyn Write, len: usize, mut fill: impl FnMut(usize, &mut [u8])) {
    let mut buf = vec![0u8; 64 << 10];
    let mut at = 0;
    while at < len {
        let n = buf.len().min(len - at);
        buf[..n].fill(0);
        fill(at, &mut buf[..n]);
        w.write_all(&buf[..n]).expect("zstd");
        at += n;
    }
}

/// Appends a v7 section holding `body` (`compressed`: a [`zblock`]); returns its
/// offset.
fn append_section(d: &mut Vec<u8>, id: u16, body: &[u8], compressed: bool) -> u64 {
    let at = d.len() as u64;
    d.extend_from_slice(&id.to_le_bytes());
    d.extend_from_slice(&u16::from(compressed).to_le_bytes());
    d.extend_from_slice(&0u32.to_le_bytes());
    d.extend_from_slice(&(body.len() as u64).to_le_bytes());
    d.extend_from_slice(body);
    at
}

/// Chains `n` compressed options sections after the file's own options section, the
/// options of section `k` written by `fill(k, w)` (each section's DONE added).
fn chain_options(d: &mut Vec<u8>, n: usize, fill: impl Fn(usize, &mut dyn Write)) {
    let l = layout(d);
    // Appended last to first, each pointing at the one appended before it.
    let mut next = 0u64;
    for k in (0..n).rev() {
        let block = zblock_with(|w| {
            fill(k, w);
            w.write_all(&opt(option::DONE, &next.to_le_bytes()))
                .expect("zstd");
        });
        next = append_section(d, 0, &block, true);
    }
    let (done, _) = l.option(option::DONE);
    set64(d, done, next);
}

/// Points the option of section `id` at a new section holding `block` (a [`zblock`]).
fn replace_section(d: &mut Vec<u8>, id: u16, block: &[u8]) {
    let l = layout(d);
    let at = append_section(d, id, block, true);
    let (ptr, _) = l.option(id);
    set64(d, ptr, at);
}

/// The decompressed content of the section the option `id` points at.
fn section_content(d: &[u8], id: u16) -> Vec<u8> {
    let (ptr, _) = layout(d).option(id);
    let at = le64(d, ptr) as usize;
    assert_eq!(le16(d, at + 2), 1, "compressed section");
    let cs = le32(d, at + 16) as usize;
    let us = le32(d, at + 20) as usize;
    zstd::bulk::decompress(&d[at + 24..at + 24 + cs], us).expect("unzstd")
}

/// Replaces the file's options with a new section holding them with the top buffer's
/// CPU table `table` (cpu, offset, size) instead of the old one (and the CPU count
/// that goes with it).
fn replace_cpu_table(d: &mut Vec<u8>, table: &[(u32, u64, u64)]) {
    let l = layout(d);
    let mut body = Vec::new();
    for &(id, at, n) in &l.options {
        match id {
            option::DONE => {}
            option::CPUCOUNT => {
                let n = table.iter().map(|c| c.0 + 1).max().unwrap_or(0);
                body.extend_from_slice(&opt(id, &n.to_le_bytes()));
            }
            option::BUFFER => {
                let old = &d[at..at + n];
                // Flyrecord offset, empty name, clock: kept; then page size and table.
                let clock_end = 9 + old[9..].iter().position(|&b| b == 0).expect("clock") + 1;
                let mut b = old[..clock_end].to_vec();
                b.extend_from_slice(&4096u32.to_le_bytes());
                b.extend_from_slice(&(table.len() as u32).to_le_bytes());
                for &(cpu, off, size) in table {
                    b.extend_from_slice(&cpu.to_le_bytes());
                    b.extend_from_slice(&off.to_le_bytes());
                    b.extend_from_slice(&size.to_le_bytes());
                }
                body.extend_from_slice(&opt(option::BUFFER, &b));
            }
            _ => body.extend_from_slice(&opt(id, &d[at..at + n])),
        }
    }
    body.extend_from_slice(&opt(option::DONE, &0u64.to_le_bytes()));
    let at = append_section(d, 0, &body, false);
    set64(d, l.opt_ptr, at);
}

/// A CPU's compressed data: the chunk count, then each chunk (compressed size,
/// uncompressed size, frame) of `chunks`.
fn cpu_data(chunks: &[Vec<u8>]) -> Vec<u8> {
    let mut v = (chunks.len() as u32).to_le_bytes().to_vec();
    for c in chunks {
        v.extend_from_slice(c);
    }
    v
}

/// Writes `len` bytes that compress about `ratio` times with zstd: zeros with a
/// random byte every `ratio` bytes, none in the 16-byte page headers (pages of no
/// events).
fn sparse(w: &mut dyn Write, len: usize, ratio: usize, rng: &mut Rng) {
    let mut next = 4095;
    pieces(w, len, |at, buf| {
        while next < at + buf.len() {
            buf[next - at] = rng.next() as u8 | 1;
            next += ratio;
            if next % 4096 < 16 {
                next += 16;
            }
        }
    });
}

// ---------------------------------------------------------------------------------
// Running hyptrace on a bomb.

/// What `report` and `convert` of a file did.
struct Runs {
    report: Watched,
    convert: Watched,
}

/// Runs `hyptrace report FILE` and `hyptrace convert FILE -o OUT` under the watchdog:
/// both stay under [`RSS_KIB`] and 10 s + 2 s per MB of input (checked), never hang.
fn run_both(dir: &TempDir, file: &str, out: &str) -> Runs {
    let mb = std::fs::metadata(file).expect("bomb").len() as f64 / 1e6;
    let bound = Duration::from_secs_f64(10.0 + 2.0 * mb);
    let limits = Limits {
        wall: bound,
        rss_kib: RSS_KIB,
        sigterm_after: None,
        file: None,
    };
    let out = dir.file(out);
    let runs = Runs {
        report: run_watched(BIN, &["report", file], &limits),
        convert: run_watched(BIN, &["convert", "-i", file, "-o", &out], &limits),
    };
    for (what, w) in [("report", &runs.report), ("convert", &runs.convert)] {
        println!(
            "MEASURE {} ({mb:.2} MB): {what}: {}",
            Path::new(file).display(),
            w.measurements()
        );
        assert!(w.killed.is_none(), "{what}: {:?}: {}", w.killed, w.err.text);
        assert!(w.peak_rss_kib <= RSS_KIB, "{what}: {}", w.measurements());
        assert!(w.wall <= bound, "{what}: {}", w.measurements());
    }
    runs
}

/// Both runs exit 1 (a damaged file: every readable event printed or converted) with
/// stderr naming `needle`.
fn assert_refused(r: &Runs, needle: &str) {
    for (what, w) in [("report", &r.report), ("convert", &r.convert)] {
        assert_eq!(
            w.code,
            Some(1),
            "{what}: {}\n{}",
            w.measurements(),
            w.err.text
        );
        assert!(
            w.err.text.contains(needle) && w.err.text.contains("damaged trace.dat"),
            "{what}: no {needle:?} in:\n{}",
            w.err.text
        );
    }
}

/// Writes `bytes` to `NAME.dat` in `dir` and runs [`run_both`] on it (the output
/// `NAME.out.EXT`).
fn bomb(dir: &TempDir, name: &str, bytes: &[u8], ext: &str) -> Runs {
    let file = dir.file(&format!("{name}.dat"));
    std::fs::write(&file, bytes).expect("write");
    run_both(dir, &file, &format!("{name}.out.{ext}"))
}

/// Records `cpus` CPUs of `pages` pages each (zstd) into `base.dat` in `dir`: its bytes
/// and path.
fn recorded(dir: &TempDir, cpus: u32, pages: usize) -> (Vec<u8>, String) {
    let base = dir.file("base.dat");
    (
        record(Path::new(&base), cpus, pages, Compression::Zstd),
        base,
    )
}

/// `hyptrace report FILE`'s stdout, whatever its exit code.
fn report_text(file: &str) -> String {
    hyptrace::env::stdout(&hyptrace::env::run(BIN, &["report", file]))
}

/// The report of an intact file, for comparison.
fn report_lines(file: &str) -> u64 {
    let o = hyptrace::env::run(BIN, &["report", file]);
    assert_eq!(o.status.code(), Some(0), "{}", hyptrace::env::stderr(&o));
    hyptrace::env::stdout(&o).lines().count() as u64
}

// ---------------------------------------------------------------------------------
// The bombs.

/// Options sections chained after the file's own: 48 of 16 MiB, each compressed about
/// 300× (CPUSTAT options, which the reader keeps), then, in another file, 16 of 64 MiB
/// of options compressed 10000× and more. Neither is followed past the options
/// sections' share of the metadata budget or the ratio: the formats are still read,
/// every event of the file is printed as before, the rest named.
#[test]
fn options_sections_stop_at_the_budget() {
    let dir = TempDir::new("bombs-options");
    let (d, base) = recorded(&dir, 2, PAGES);
    let want = report_text(&base);
    let mut budget = d.clone();
    chain_options(&mut budget, 48, |k, w| {
        let mut rng = Rng(36 + k as u64);
        let mut data = vec![0u8; 1500];
        for _ in 0..(16 << 20) / 1506 {
            data[..4].copy_from_slice(&(rng.next() as u32).to_le_bytes());
            w.write_all(&opt(option::CPUSTAT, &data)).expect("zstd");
        }
    });
    let r = bomb(&dir, "options-budget", &budget, "dat");
    assert_refused(&r, "options section of");
    assert_refused(&r, "32 MiB of it for options sections");
    let got = report_text(&dir.file("options-budget.dat"));
    assert_eq!(got, want, "every event printed as before");

    let mut ratio = d;
    chain_options(&mut ratio, 16, |_, w| {
        let n = (64 << 20) - 64;
        w.write_all(&option::UNAME.to_le_bytes()).expect("zstd");
        w.write_all(&(n as u32).to_le_bytes()).expect("zstd");
        pieces(w, n, |_, b| b.fill(b'x'));
    });
    let r = bomb(&dir, "options-ratio", &ratio, "dat");
    assert_refused(&r, &format!("more than {MAX_RATIO} times"));
    let got = report_text(&dir.file("options-ratio.dat"));
    assert_eq!(got, want, "every event printed as before");
}

/// A BUFFER option of a buffer named `name` (empty: the top level) listing 52000
/// CPUs, a random offset every 64th.
fn buffer_option(name: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = 0u64.to_le_bytes().to_vec();
    b.extend_from_slice(name);
    b.extend_from_slice(b"\0local\0");
    b.extend_from_slice(&4096u32.to_le_bytes());
    b.extend_from_slice(&52000u32.to_le_bytes());
    for cpu in 0..52000u32 {
        let off = if cpu % 64 == 0 { rng.next() } else { 0 };
        b.extend_from_slice(&cpu.to_le_bytes());
        b.extend_from_slice(&off.to_le_bytes());
        b.extend_from_slice(&4096u64.to_le_bytes());
    }
    opt(option::BUFFER, &b)
}

/// Options sections of BUFFER options (instances of 52000 CPUs, all of one name, and
/// top-level buffers after the first): two of 12 MiB, read (the reader reads the first
/// top-level buffer, the file's own, and the first instance, and counts the others),
/// then six of 40 MiB, past the options sections' share of the budget. The instance's
/// CPUs name no readable data: `report` prints the file's events, each line after the
/// instance column; `convert` refuses a file with instances (exit 2).
#[test]
fn buffer_options_are_counted_not_kept() {
    let dir = TempDir::new("bombs-buffers");
    let (mut d, base) = recorded(&dir, 2, PAGES);
    let want = report_text(&base);
    chain_options(&mut d, 8, |k, w| {
        let mut rng = Rng(37 + k as u64);
        let mut n = 0;
        while n < if k < 2 { 12 << 20 } else { 40 << 20 } {
            for name in [&b"instance"[..], b""] {
                let b = buffer_option(name, &mut rng);
                w.write_all(&b).expect("zstd");
                n += b.len();
            }
        }
    });
    let r = bomb(&dir, "buffers", &d, "dat");
    let err = &r.report.err.text;
    assert_eq!(r.report.code, Some(1), "{}", r.report.measurements());
    assert!(err.contains("options section of"), "{err}");
    assert!(err.contains("buffer instances of a name"), "{err}");
    assert_eq!(r.convert.code, Some(2), "{}", r.convert.measurements());
    assert!(r.convert.err.text.contains("buffer instances (instance)"));
    let got = report_text(&dir.file("buffers.dat"));
    // Top-level lines after the blank column of the name `instance` (8 + 2 spaces).
    let want: String = want
        .lines()
        .map(|l| match l.starts_with("cpus=") {
            true => format!("{l}\n"),
            false => format!("          {l}\n"),
        })
        .collect();
    assert_eq!(got, want, "the first top-level buffer is read");
}

/// Writes `len` bytes of lines `line(i)`, i = 0, 1, ... (the last one cut).
fn lines(w: &mut dyn Write, len: usize, line: impl Fn(u64) -> String) {
    let (mut n, mut i) = (0, 0);
    while n < len {
        let l = line(i);
        let b = &l.as_bytes()[..l.len().min(len - n)];
        w.write_all(b).expect("zstd");
        n += b.len();
        i += 1;
    }
}

/// A cmdlines section of 40 MiB of distinct `PID COMM` lines (4.6 M pids): the ones
/// past the budget are not read.
#[test]
fn distinct_cmdlines_stop_at_the_budget() {
    let dir = TempDir::new("bombs-cmdlines");
    let (mut d, base) = recorded(&dir, 2, PAGES);
    let want = report_lines(&base);
    let len = 40 << 20;
    let block = zblock_with(|w| {
        w.write_all(&(len as u64).to_le_bytes()).expect("zstd");
        lines(w, len, |i| format!("{} c\n", 100_000 + i));
    });
    replace_section(&mut d, option::CMDLINES, &block);
    let r = bomb(&dir, "cmdlines", &d, "dat");
    assert_refused(&r, "cmdlines past the metadata budget");
    assert_eq!(r.report.out.lines, want, "every event printed");
}

/// Writes 40 MiB of small distinct formats (ids 20000.. — none of the file's), their
/// count first (after the system name, if any).
fn bomb_formats(w: &mut dyn Write, system: Option<&str>) {
    let format = |i: u32| {
        format!(
            "name: e{i}\nID: {}\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\tfield:int x{i};\toffset:8;\tsize:4;\tsigned:1;\n\nprint fmt: \"%d\", REC->x{i}\n",
            20000 + i % 45000
        )
    };
    if let Some(s) = system {
        w.write_all(s.as_bytes()).expect("zstd");
        w.write_all(b"\0").expect("zstd");
    }
    let n = (40 << 20) / format(0).len() as u32;
    w.write_all(&n.to_le_bytes()).expect("zstd");
    for i in 0..n {
        let t = format(i);
        w.write_all(&(t.len() as u64).to_le_bytes()).expect("zstd");
        w.write_all(t.as_bytes()).expect("zstd");
    }
}

/// The event formats section with 40 MiB of small distinct formats after the file's
/// own: the formats past the budget are not read (the file's own, first, are: every
/// event prints as before). Then the ftrace formats section with 40 MiB of them (read
/// first, it takes the budget: the file's own formats are not read either, its events
/// print as unknown events).
#[test]
fn event_formats_stop_at_the_budget() {
    let dir = TempDir::new("bombs-formats");
    let (d, base) = recorded(&dir, 2, PAGES);
    let want = report_text(&base);
    // The file's own systems, then one more.
    let own = section_content(&d, option::EVENT_FORMATS);
    let events = zblock_with(|w| {
        w.write_all(&(le32(&own, 0) + 1).to_le_bytes())
            .expect("zstd");
        w.write_all(&own[4..]).expect("zstd");
        bomb_formats(w, Some("bomb"));
    });
    let mut own_first = d.clone();
    replace_section(&mut own_first, option::EVENT_FORMATS, &events);
    let r = bomb(&dir, "formats", &own_first, "dat");
    assert_refused(&r, "event formats past the metadata budget");
    let got = report_text(&dir.file("formats.dat"));
    assert_eq!(got, want, "every event printed as before");

    let mut d = d;
    let ftrace = zblock_with(|w| bomb_formats(w, None));
    replace_section(&mut d, option::FTRACE_EVENTS, &ftrace);
    let r = bomb(&dir, "ftrace", &d, "dat");
    assert_refused(&r, "event formats past the metadata budget");
    assert_refused(&r, "event formats of");
    assert_eq!(r.report.out.lines, want.lines().count() as u64);
}

/// kallsyms and printk sections of 60 MiB of lines each: the lines past the budget are
/// not read.
#[test]
fn symbols_stop_at_the_budget() {
    let dir = TempDir::new("bombs-symbols");
    let (mut d, base) = recorded(&dir, 2, PAGES);
    let want = report_lines(&base);
    let len = 60 << 20;
    let addr = |i: u64| 0xffff_ffff_8100_0000u64 + i * 16;
    let kallsyms = zblock_with(|w| {
        w.write_all(&(len as u32).to_le_bytes()).expect("zstd");
        lines(w, len, |i| format!("{:016x} T f{i}\n", addr(i)));
    });
    let printk = zblock_with(|w| {
        w.write_all(&(len as u32).to_le_bytes()).expect("zstd");
        lines(w, len, |i| format!("0x{:016x} : \"s{i}\"\n", addr(i)));
    });
    replace_section(&mut d, option::KALLSYMS, &kallsyms);
    replace_section(&mut d, option::PRINTK, &printk);
    let r = bomb(&dir, "symbols", &d, "dat");
    assert_refused(&r, "kallsyms/printk lines past the metadata budget");
    assert_eq!(r.report.out.lines, want, "every event printed");
}

/// 64 MiB pages: a chunk claiming 1 GiB (past the absolute cap, whatever the page
/// size), a 64 MiB page of one event (about 30000×: past the ratio), and a chunk of
/// exactly [`MAX_CHUNK`] at about 900× (read: 2.5 pages of no events, the half page
/// named).
#[test]
fn big_pages_and_chunks_are_capped() {
    let dir = TempDir::new("bombs-bigpages");
    let (mut d, _) = recorded(&dir, 1, 1);
    // 64 MiB pages: the file header and the buffer option say so.
    let big: u32 = 64 << 20;
    d[14..18].copy_from_slice(&big.to_le_bytes());
    let small = page(4096, 0, 1_000_000, 0);
    let one_page = zblock_with(|w| {
        w.write_all(&small).expect("zstd");
        pieces(w, big as usize - 4096, |_, _| {});
    });
    let mut claims_1g = one_page.clone();
    claims_1g[4..8].copy_from_slice(&(1u32 << 30).to_le_bytes());
    let at_cap = zblock_with(|w| sparse(w, MAX_CHUNK, 900, &mut Rng(38)));
    let data = cpu_data(&[claims_1g, one_page, at_cap]);
    let at = d.len() as u64;
    d.extend_from_slice(&data);
    replace_cpu_table(&mut d, &[(0, at, data.len() as u64)]);
    let l = layout(&d);
    let (buf, _) = l.option(option::BUFFER);
    let ps_at = buf + 9 + d[buf + 9..].iter().position(|&b| b == 0).expect("clock") + 1;
    d[ps_at..ps_at + 4].copy_from_slice(&big.to_le_bytes());
    let r = bomb(&dir, "bigpages", &d, "dat");
    assert_refused(&r, &format!("more than the {MAX_CHUNK} accepted"));
    assert_refused(&r, &format!("more than {MAX_RATIO} times"));
    assert_refused(&r, "is not whole");
}

/// CPU data of 1000 16 MiB zero chunks (29000× each: past the ratio, skipped unread),
/// then 0.3 MB of 1 MiB chunks of pages of no events at 600–1024× (read: the most
/// such a file holds), then 0.3 MB of trace-cmd's 10-page chunks of one event per page
/// (about 230×, the sparsest pages a live read takes: read, every event printed).
#[test]
fn zero_chunks_are_bounded_by_the_ratio() {
    let dir = TempDir::new("bombs-zero");
    let (mut d, _) = recorded(&dir, 1, 4);
    let zeros = zblock_with(|w| pieces(w, 16 << 20, |_, _| {}));
    let mut chunks = vec![zeros; 1000];
    let dense = zblock_with(|w| sparse(w, 1 << 20, 2300, &mut Rng(39)));
    let ratio = (1 << 20) / (dense.len() - 8);
    assert!((600..=1024).contains(&ratio), "{ratio}x");
    chunks.extend(std::iter::repeat_n(dense.clone(), 300_000 / dense.len()));
    let (mut events, mut bytes) = (0u64, 0);
    while bytes < 300_000 {
        let pages: Vec<Vec<u8>> = (0..10)
            .map(|i| page_of(4096, 0, 1_000_000 + events * 1000 + i * 1000, events + i, 1))
            .collect();
        chunks.push(zblock(&pages.concat()));
        bytes += chunks.last().map_or(0, Vec::len);
        events += 10;
    }
    assert!(events > 10_000, "{events} events");
    let data = cpu_data(&chunks);
    let at = d.len() as u64;
    d.extend_from_slice(&data);
    replace_cpu_table(&mut d, &[(0, at, data.len() as u64)]);
    let r = bomb(&dir, "zero", &d, "dat");
    assert_refused(&r, &format!("more than {MAX_RATIO} times"));
    assert_refused(&r, "more damaged chunks skipped");
    assert_eq!(r.report.out.lines, 1 + events, "every event printed");
}

/// A CPU table of 4096 CPUs, each its own compressed page of events: `report` takes
/// about the time of its events (under 2 s), in merged order; convert (text: the
/// merging sink) likewise. Then 1024 CPUs all naming the same data: read once, the
/// others named and not read.
#[test]
fn many_cpus_read_in_the_time_of_their_events() {
    let dir = TempDir::new("bombs-cpus");
    let (mut d, _) = recorded(&dir, 1, 1);
    let mut table = Vec::new();
    for cpu in 0..4096u32 {
        let p = page(4096, cpu, 1_000_000 + u64::from(cpu % 97) * 10, 0);
        let data = cpu_data(&[zblock(&p)]);
        table.push((cpu, d.len() as u64, data.len() as u64));
        d.extend_from_slice(&data);
    }
    let mut shared = d.clone();
    replace_cpu_table(&mut d, &table);
    let r = bomb(&dir, "cpus", &d, "txt");
    for (what, w) in [("report", &r.report), ("convert", &r.convert)] {
        assert_eq!(w.code, Some(0), "{what}: {}", w.err.text);
        assert!(
            w.wall < Duration::from_secs(2),
            "{what}: {}",
            w.measurements()
        );
    }
    assert_eq!(r.report.out.lines, 1 + 4096 * EVENTS as u64);
    // Merged order: times never go back, ties to the lower CPU.
    let keys: Vec<(f64, u32)> = report_text(&dir.file("cpus.dat"))
        .lines()
        .skip(1)
        .map(|l| {
            let cpu = l.split('[').nth(1).and_then(|s| s.split(']').next());
            let ts = l.split("] ").nth(1).and_then(|s| s.split(':').next());
            (
                ts.and_then(|t| t.trim().parse().ok()).expect("time"),
                cpu.and_then(|c| c.trim().parse().ok()).expect("cpu"),
            )
        })
        .collect();
    assert_eq!(keys.len(), 4096 * EVENTS);
    assert!(keys.windows(2).all(|w| w[0] <= w[1]), "not in merged order");

    let same: Vec<_> = (0..1024).map(|cpu| (cpu, table[0].1, table[0].2)).collect();
    replace_cpu_table(&mut shared, &same);
    let r = bomb(&dir, "shared", &shared, "dat");
    assert_refused(&r, "the data of 1023 CPUs");
    assert_eq!(r.report.out.lines, 1 + EVENTS as u64, "read once");
}

/// The files of the tests above are real trace.dat files before they are rewritten.
#[test]
fn base_files_are_read_whole() {
    let dir = TempDir::new("bombs-base");
    let base = dir.file("base.dat");
    record(Path::new(&base), 3, PAGES, Compression::Zstd);
    let f = TraceFile::open(&base).expect("open");
    assert!(f.damage.is_empty(), "{:?}", f.damage);
    assert_eq!(f.event_count(), 3 * PAGES * EVENTS);
    assert_eq!(report_lines(&base), 1 + (3 * PAGES * EVENTS) as u64);
}
