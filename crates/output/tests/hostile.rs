//! Hostile input: truncated and corrupted trace.dat files and raw streams give errors,
//! damage notes with what is readable (docs/output.md "Damaged files") or garbage
//! events, never panics or hangs.

mod common;

use std::path::PathBuf;

use common::*;
use hyptrace_output::*;

fn small_file(version: TraceDatVersion) -> Vec<u8> {
    // A fresh directory per call (tests run in parallel), removed on return.
    let dir = scratch_dir(&format!("hostile-{version:?}"));
    let path = dir.join("t.dat");
    let mut pages = Vec::new();
    for cpu in 0..2u32 {
        let mut b = PageBuilder::new(4096);
        b.push(100, &marker(cpu, 1, 2));
        b.push(100 + (1 << 30), &text(cpu, 2, "a \"quoted\" string that is long enough to need the length word form...........................!"));
        b.lose(3);
        b.push(200 + (1 << 30), &span(cpu, 3, 4, 5));
        for (p, m) in b.finish() {
            pages.push((cpu, p, m));
        }
    }
    write_trace_dat(
        &path,
        TraceMeta::guest(4096, 2, Clock::guest_tsc(3_000_000).unwrap()),
        version,
        pages.iter().map(|(c, p, m)| (*c, p.as_slice(), *m)),
        &RunSummary::default(),
    )
    .unwrap();
    std::fs::read(&path).unwrap()
}

/// Parses and, if that works, reads every event and formats the report.
fn exercise(data: &[u8]) -> bool {
    match TraceFile::parse(data) {
        Ok(f) => {
            let r = f.report();
            assert!(r.starts_with("cpus="));
            true
        }
        Err(e) => {
            let _ = e.to_string();
            false
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn every_prefix_v6_v7() {
    for v in [TraceDatVersion::V6, TraceDatVersion::V7] {
        let data = small_file(v);
        assert!(exercise(&data));
        assert_eq!(TraceFile::parse(&data).unwrap().event_count(), 6);
        // A prefix either fails (the metadata before the CPU data is cut) or reads
        // with damage noted and at most the events before the cut: once the pages
        // are reached, every prefix reads.
        let mut opened = false;
        for n in 0..data.len() {
            let p = &data[..n];
            match TraceFile::parse(p) {
                Err(_) => assert!(!opened, "{v:?}: prefix {n} failed after a shorter one read"),
                Ok(f) => {
                    opened = true;
                    assert!(exercise(p));
                    let mut damage = f.damage.len();
                    let mut r = f.records();
                    let mut events = 0;
                    while let Some(i) = r.next_item() {
                        events += usize::from(matches!(i, TraceItem::Event(_)));
                    }
                    damage += r.take_damage().len();
                    assert!(r.error().is_none(), "{v:?}: prefix {n}");
                    assert!(damage > 0, "{v:?}: prefix {n}: no damage noted");
                    assert!(events <= 6, "{v:?}: prefix {n}: {events} events");
                }
            }
        }
        assert!(opened, "{v:?}: no prefix read");
    }
}

#[test]
fn every_prefix_zstd_fixture() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kernel-v7-zstd.dat");
    let data = std::fs::read(p).unwrap();
    assert!(exercise(&data));
    for n in (0..data.len()).step_by(7) {
        exercise(&data[..n]);
    }
}

#[test]
fn random_byte_flips() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let inputs = [
        small_file(TraceDatVersion::V6),
        small_file(TraceDatVersion::V7),
        std::fs::read(fixtures.join("kernel-v7-zstd.dat")).unwrap(),
        std::fs::read(fixtures.join("kernel-v6.dat")).unwrap(),
    ];
    for base in &inputs {
        for _ in 0..1500 {
            let mut d = base.clone();
            let flips = 1 + rng.next() % 8;
            for _ in 0..flips {
                let i = (rng.next() % d.len() as u64) as usize;
                let v = rng.next();
                d[i] = match v % 4 {
                    0 => d[i] ^ (1 << (v % 8)),
                    1 => 0xff,
                    2 => 0,
                    _ => v as u8,
                };
            }
            exercise(&d);
        }
    }
}

#[test]
fn garbage_and_lengths() {
    for d in [&b""[..], b"\x17\x08\x44tracing", b"\x17\x08\x44tracing6\0"] {
        assert!(!exercise(d));
    }
    // Options offset past the end: read as damaged, nothing in it.
    let d = b"\x17\x08\x44tracing7\0\0\x08\0\x10\0\0none\0\0\xff\xff\xff\xff\xff\xff\xff\xff";
    let f = TraceFile::parse(d).unwrap();
    assert!(!f.damage.is_empty() && f.cpus.is_empty());
    assert_eq!(f.event_count(), 0);
    // Huge lengths in the header_page size field.
    let mut d = small_file(TraceDatVersion::V6);
    let at = 10 + 2 + 2 + 4 + 12;
    d[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(!exercise(&d));
}

#[test]
fn raw_stream_prefixes_and_flips() {
    let dir = scratch_dir("raw-hostile");
    let path = dir.join("t.raw");
    let mut sink: Box<dyn PageSink> =
        Box::new(RawSink::create(&path, TraceMeta::guest(4096, 2, Clock::nanoseconds())).unwrap());
    let mut b = PageBuilder::new(4096);
    b.push(1, &marker(0, 1, 1));
    b.lose(4);
    b.push(2, &marker(0, 2, 2));
    for (p, m) in b.finish() {
        sink.page(0, &p, m).unwrap();
    }
    sink.finish(&RunSummary {
        cpus: vec![KernelCpuStat::default(); 2],
    })
    .unwrap();
    let data = std::fs::read(&path).unwrap();
    let full = RawTrace::parse(&data).unwrap();
    assert_eq!(full.pages.len(), 2);
    assert!(full.summary.is_some());
    for n in 0..data.len() {
        if let Ok(t) = RawTrace::parse(&data[..n]) {
            assert!(t.summary.is_none() || n == data.len());
        }
    }
    let mut rng = Rng(77);
    for _ in 0..2000 {
        let mut d = data.clone();
        let i = (rng.next() % d.len() as u64) as usize;
        d[i] = rng.next() as u8;
        let _ = RawTrace::parse(&d);
    }
}

/// The print fmts and payloads of real kernel traces, mutated (bytes flipped, cut,
/// spliced): compiling and running them never panics, a failed run leaves the line as
/// it was, and an event's text is one line (kernel stacks aside).
#[test]
fn mutated_kernel_print_fmts() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kernel");
    let mut formats = Vec::new();
    let mut payloads = Vec::new();
    for name in ["kernel", "kmem", "kvm", "misc", "net", "stack"] {
        let f = TraceFile::open(dir.join(format!("{name}-v7zstd.dat"))).unwrap();
        formats.extend(f.formats.iter().cloned());
        let mut records = f.records();
        let mut k = 0usize;
        while let Some(item) = records.next_item() {
            if let TraceItem::Event(r) = item {
                if k.is_multiple_of(7) {
                    payloads.push(r.payload.to_vec());
                }
                k += 1;
            }
        }
    }
    let syms = std::sync::Arc::new({
        let mut k = KernelSymbols::new();
        k.parse_kallsyms(b"ffffffff81000000 T a\nffffffff81000100 T b\n");
        k
    });
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n.max(1) as u64) as usize
    };
    let specials = b"(){}[],?:\"'%*-+!~&|<>REC->0x1234567890";
    for round in 0..3000 {
        let mut f = formats[rnd(formats.len())].clone();
        let mut b = f.print_fmt.clone().into_bytes();
        for _ in 0..1 + rnd(4) {
            if b.is_empty() {
                break;
            }
            let i = rnd(b.len());
            match rnd(4) {
                0 => b[i] = specials[rnd(specials.len())],
                1 => b.truncate(i),
                2 => {
                    let j = rnd(b.len());
                    let piece = b[i.min(j)..i.max(j)].to_vec();
                    b.splice(i..i, piece);
                }
                _ => {
                    b.remove(i);
                }
            }
        }
        f.print_fmt = String::from_utf8_lossy(&b).into_owned();
        let multi_line = f.name == "kernel_stack";
        let p = EventPrinter::with_symbols(f, syms.clone(), 8);
        let mut payload = payloads[rnd(payloads.len())].clone();
        if round % 3 == 0 {
            let i = rnd(payload.len());
            payload[i] ^= 1 << rnd(8);
        }
        if round % 5 == 0 {
            payload.truncate(rnd(payload.len()));
        }
        let mut line = String::from("prefix ");
        p.format_fields(&mut line, &payload);
        assert!(line.starts_with("prefix "));
        // One line per event, but for kernel stacks (several, as trace-cmd prints them).
        assert!(multi_line || !line.contains('\n'), "{line}");
    }
}

/// A v7 file whose kallsyms section is damaged (its inner length runs past the
/// section) still reads: the symbols are only for the text, addresses print in hex.
#[test]
fn damaged_kallsyms_section_is_ignored() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kernel");
    let mut data = std::fs::read(dir.join("kmem-v7.dat")).unwrap();
    let hex = |b: &u8| b.is_ascii_digit() || (b'a'..=b'f').contains(b);
    let start = (4..data.len() - 20)
        .find(|&i| {
            data[i..i + 16].iter().all(hex)
                && data[i + 16] == b' '
                && data[i + 18] == b' '
                && !hex(&data[i - 1])
        })
        .unwrap();
    let good = TraceFile::parse(&data).unwrap();
    assert!(!good.symbols.is_empty());
    data[start - 4..start].copy_from_slice(&u32::MAX.to_le_bytes());
    let f = TraceFile::parse(&data).unwrap();
    assert!(f.symbols.is_empty());
    let report = f.report();
    assert_eq!(report.lines().count(), good.report().lines().count());
    assert!(report.contains("call_site=0xffffffff"));
}
