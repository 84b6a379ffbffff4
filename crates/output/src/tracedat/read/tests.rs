use std::collections::BTreeMap;

use hyptrace_abi::page::Record;

use super::budget::MAX_BATCH;
use super::records::kbuffer_record;
use super::*;
use crate::tracedat::option;

/// A damaged page's data record that runs past the page: trace-cmd prints it (it
/// reads on past the page), so it is one event here too, cut at the page's end
/// (with no payload when none of it is in the page), and kbuffer's next offset is
/// past the page, which ends it; a record whose length word is past the page is none.
#[test]
fn kbuffer_record_past_the_page_is_cut_at_its_end() {
    let mut data = vec![0u8; 4080];
    // Long form at 3300: length word 2000 (payload 1996 bytes from 3308).
    data[3300..3304].copy_from_slice(&(5u32 << 5).to_le_bytes());
    data[3304..3308].copy_from_slice(&2000u32.to_le_bytes());
    let (rec, next) = kbuffer_record(&data, 3400, 3300).expect("an event");
    assert_eq!(
        rec,
        Record::Data {
            delta: 5,
            start: 3308,
            len: 4080 - 3308
        }
    );
    // kbuffer's next is past the page: the page ends.
    assert_eq!(next, 3308 + 1996);
    assert!(kbuffer_record(&data, 3400, next).is_none());
    // Short form at 4072: 3 words from 4076, 4 bytes of them in the page.
    data[4072..4076].copy_from_slice(&3u32.to_le_bytes());
    let (rec, next) = kbuffer_record(&data, 4078, 4072).expect("an event");
    assert_eq!(
        rec,
        Record::Data {
            delta: 0,
            start: 4076,
            len: 4
        }
    );
    assert_eq!(next, 4088);
    // Long form at 4072: its length word is the page's last 4 bytes, no payload.
    data[4072..4076].copy_from_slice(&0u32.to_le_bytes());
    data[4076..4080].copy_from_slice(&100u32.to_le_bytes());
    let (rec, next) = kbuffer_record(&data, 4078, 4072).expect("an event");
    let empty = |start| Record::Data {
        delta: 0,
        start,
        len: 0,
    };
    assert_eq!((rec, next), (empty(4080), 4080 + 96));
    // Long form at 4076: its length word is past the page.
    data[4076..4080].copy_from_slice(&0u32.to_le_bytes());
    assert!(kbuffer_record(&data, 4078, 4076).is_none());
}

/// A length word that is not a multiple of 4 is where the strict decoder (the
/// kernel's extent) and kbuffer (rounded up, a padding's as is) part: the page is
/// damaged there, for `report` and for `convert` alike.
#[test]
fn unaligned_length_words_are_damage() {
    let page = |records: &[u32]| {
        let mut p = vec![0u8; 4096];
        let commit = records.len() as u64 * 4;
        p[8..16].copy_from_slice(&commit.to_le_bytes());
        for (i, w) in records.iter().enumerate() {
            p[16 + i * 4..20 + i * 4].copy_from_slice(&w.to_le_bytes());
        }
        p
    };
    // Long form, length word 16 (12 bytes of payload), then a 1-word event.
    assert_eq!(page_damage(&page(&[0, 16, 7, 7, 7, 1, 7])), None);
    // Length word 13: the kernel reads on at 17, kbuffer at 20.
    let bad = page(&[0, 13, 7, 7, 7, 1, 7]);
    assert_eq!(
        page_damage(&bad).as_deref(),
        Some("event at data offset 0 has a bad length word")
    );
    assert_eq!(kbuffer_record(&bad[16..], 28, 0).map(|(_, n)| n), Some(20));
    // Padding (delta 1) with length 8, then a 1-word event; with length 9 the next
    // record is at 16 strictly (aligned), at 13 for kbuffer.
    let pad = hyptrace_abi::page::TYPE_PADDING | 1 << 5;
    assert_eq!(page_damage(&page(&[pad, 8, 7, 1, 7])), None);
    assert_eq!(
        page_damage(&page(&[pad, 9, 7, 1, 7])).as_deref(),
        Some("event at data offset 0 has a bad length word")
    );
}

/// `page_damage`'s short cut for the common record decides as the general walk does:
/// on random pages (records of every type, lengths that run past the commit, unaligned
/// length words), the same verdict as a walk of `decode_like_kbuffer` alone.
#[test]
fn page_damage_short_cut_agrees_with_the_walk() {
    use super::records::decode_like_kbuffer;
    let walk = |page: &[u8]| {
        let commit = u64::from_le_bytes(page[8..16].try_into().unwrap());
        let end = 16 + (commit & super::records::READ_COMMIT_MASK) as usize;
        if page.len() < end {
            return Some(format!("commit {} past the page", end - 16));
        }
        let mut off = 0;
        loop {
            match decode_like_kbuffer(&page[16..], end - 16, off) {
                Ok(None) => return None,
                Ok(Some((_, next))) => off = next,
                Err(e) => return Some(e.to_string()),
            }
        }
    };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let (mut good, mut bad) = (0, 0);
    for _ in 0..4000 {
        let mut p = vec![0u8; 512];
        let (mut at, mut ends) = (16, Vec::new());
        // Mostly short data records, now and then any header word or length word.
        while at + 4 <= p.len() {
            let r = rand();
            let w = match r % 256 {
                0 => r as u32 >> 8,
                1 => (r >> 8) as u32 % 64,
                _ => (1 + (r >> 8) % 28) as u32 | ((r >> 40) as u32) << 5,
            };
            p[at..at + 4].copy_from_slice(&w.to_le_bytes());
            at += 4 + if w & 0x1f <= 28 {
                (w & 0x1f) as usize * 4
            } else {
                4
            };
            ends.push(at as u64 - 16);
        }
        // The commit at a record's end, or anywhere.
        let r = rand();
        let commit = match ends.get((r >> 8) as usize % 64) {
            Some(&e) if r % 2 == 0 => e,
            _ => r % 520,
        };
        p[8..16].copy_from_slice(&commit.to_le_bytes());
        let want = walk(&p);
        assert_eq!(page_damage(&p), want, "{p:?}");
        if want.is_some() {
            bad += 1
        } else {
            good += 1
        }
    }
    assert!(good > 100 && bad > 100, "{good} good, {bad} damaged pages");
}

/// kbuffer's signed 32-bit arithmetic on a damaged page: a length word below 4 is an
/// event without payload and the walk goes on 4 or 8 bytes later (trace-cmd prints the
/// records after it); a negative length steps back (or stands still), or wraps past
/// the page; a padding's length is taken as is, and may wrap 1..3 bytes on.
#[test]
fn kbuffer_record_follows_kbuffer_arithmetic() {
    let mut data = vec![0u8; 4080];
    let put = |data: &mut Vec<u8>, at: usize, w: u32| {
        data[at..at + 4].copy_from_slice(&w.to_le_bytes());
    };
    let empty = |start| Record::Data {
        delta: 0,
        start,
        len: 0,
    };
    // Length word 0: the next record starts at the length word itself.
    put(&mut data, 100, 0);
    put(&mut data, 104, 0);
    assert_eq!(kbuffer_record(&data, 4000, 100), Some((empty(108), 104)));
    // Length words 1..=3: no payload, the next record right after the word.
    for w in 1..=3 {
        put(&mut data, 104, w);
        assert_eq!(kbuffer_record(&data, 4000, 100), Some((empty(108), 108)));
    }
    // 0xffff_fffd..=0xffff_ffff round like 0: 4 bytes on.
    for w in 0xffff_fffd..=u32::MAX {
        put(&mut data, 104, w);
        assert_eq!(kbuffer_record(&data, 4000, 100), Some((empty(108), 104)));
    }
    // 0xffff_fffc: kbuffer stands on this record (for ever: the caller stops);
    // 0xffff_ffec: 16 bytes back; 0x8000_0004 and 0xffff_0000 wrap past the page.
    for (w, next) in [
        (0xffff_fffc, 100),
        (0xffff_ffec, 84),
        (0x8000_0004, 108 + (1 << 31)),
        (0xffff_0000, (108u32.wrapping_sub(65540)) as usize),
    ] {
        put(&mut data, 104, w);
        assert_eq!(kbuffer_record(&data, 4000, 100), Some((empty(108), next)));
    }
    // A padding's length as is: it stands still, steps back, or wraps 3 bytes on.
    put(&mut data, 200, hyptrace_abi::page::TYPE_PADDING);
    for (w, next) in [(u32::MAX - 3, 200), (u32::MAX - 100, 103), (u32::MAX, 203)] {
        put(&mut data, 204, w);
        assert_eq!(
            kbuffer_record(&data, 4000, 200),
            Some((Record::Padding { delta: 0 }, next))
        );
    }
}

fn fixture(name: &str) -> TraceFile {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    TraceFile::open(p).unwrap()
}

fn report_with(f: &TraceFile, filter: &ReportFilter) -> String {
    let mut v = Vec::new();
    f.write_report(&mut v, filter).unwrap();
    String::from_utf8(v).unwrap()
}

/// The formatting threads print exactly what one thread prints (many batches of 61
/// items, drop markers among them), with and without filters.
#[test]
fn threads_print_what_one_thread_prints() {
    for name in ["kernel-v6.dat", "kernel-v7.dat", "kernel-v7-zstd.dat"] {
        let f = fixture(name);
        let want = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(name.replace(".dat", ".report-t.txt")),
        )
        .unwrap();
        for filter in [
            ReportFilter::default(),
            ReportFilter {
                events: vec!["sched:*".into()],
                skip: 7,
                limit: Some(300),
                ..Default::default()
            },
            ReportFilter {
                cpus: Some([1].into()),
                ..Default::default()
            },
        ] {
            let one = report_with(
                &f,
                &ReportFilter {
                    threads: 1,
                    ..filter.clone()
                },
            );
            assert!(one.lines().count() > 100, "{name} {filter:?}");
            for threads in [2, 3, 8] {
                let many = report_with(
                    &f,
                    &ReportFilter {
                        threads,
                        ..filter.clone()
                    },
                );
                assert_eq!(one, many, "{name} {filter:?} threads {threads}");
            }
            if filter == ReportFilter::default() {
                assert_eq!(one.lines().count(), want.lines().count(), "{name}");
            }
        }
    }
}

/// Pages come out whole, one at a time, through a bounded buffer.
#[test]
fn pages_stream_through_bounded_buffers() {
    for name in ["kernel-v6.dat", "kernel-v7.dat", "kernel-v7-zstd.dat"] {
        let f = fixture(name);
        for i in 0..f.cpus.len() {
            let mut p = f.pages(i).unwrap();
            let mut n = 0;
            while let Some(page) = p.next_page().unwrap() {
                assert_eq!(page.len(), f.page_size);
                n += 1;
            }
            // A batch, or a chunk of trace-cmd's 10 pages.
            assert!(p.buf.capacity() <= MAX_BATCH.max(10 * f.page_size));
            if !f.is_compressed() {
                assert_eq!(n as u64, f.cpus[i].size / f.page_size as u64, "{name}");
            }
        }
    }
}

/// Events per CPU and the damage noted, reading `f` through [`Records`].
fn per_cpu(f: &TraceFile) -> (BTreeMap<u32, usize>, Vec<Damage>) {
    let mut n = BTreeMap::new();
    let mut r = f.records();
    let mut damage = Vec::new();
    while let Some(i) = r.next_item() {
        if let TraceItem::Event(e) = i {
            *n.entry(e.cpu).or_insert(0) += 1;
        }
        damage.extend(r.take_damage());
    }
    damage.extend(r.take_damage());
    assert!(r.error().is_none());
    (n, damage)
}

fn le32_at(d: &[u8], at: u64) -> usize {
    let at = at as usize;
    u32::from_le_bytes(d[at..at + 4].try_into().unwrap()) as usize
}

/// Pages per CPU of [`zstd_file`].
const PAGES: [usize; 3] = [95, 40, 31];

/// A v7 zstd trace.dat of 3 CPUs, [`PAGES`] pages each of one event.
fn zstd_file() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z.dat");
    let meta = crate::TraceMeta::guest(4096, 3, crate::Clock::nanoseconds());
    let mut s = crate::TraceDatSink::create_with(
        &path,
        meta,
        crate::TraceDatVersion::V7,
        crate::Compression::Zstd,
    )
    .unwrap();
    for (cpu, &n) in PAGES.iter().enumerate() {
        for i in 0..n {
            let mut p = vec![0u8; 4096];
            p[..8].copy_from_slice(&(1_000 + i as u64 * 10_000).to_le_bytes());
            let pid = hyptrace_abi::events::vcpu_pid(cpu as u32);
            let payload = hyptrace_abi::events::marker(pid, i as u64, 7);
            let mut hdr = [0u8; 8];
            let k = hyptrace_abi::page::encode_data_header(&mut hdr, payload.len(), 0);
            p[16..16 + k].copy_from_slice(&hdr[..k]);
            p[16 + k..16 + k + payload.len()].copy_from_slice(&payload);
            p[8..16].copy_from_slice(&((k + payload.len()) as u64).to_le_bytes());
            crate::PageSink::page(&mut s, cpu as u32, &p, Missed::None).unwrap();
        }
    }
    crate::PageSink::finish(Box::new(s), &crate::RunSummary::default()).unwrap();
    std::fs::read(&path).unwrap()
}

/// The offset of the data of the DONE option of a v7 file's first options section.
fn options_done(d: &[u8]) -> usize {
    let mut at = 18;
    for _ in 0..2 {
        at += d[at..].iter().position(|&b| b == 0).unwrap() + 1;
    }
    let sec = u64::from_le_bytes(d[at..at + 8].try_into().unwrap()) as usize;
    let mut o = sec + 16;
    loop {
        let id = u16::from_le_bytes([d[o], d[o + 1]]);
        let n = le32_at(d, o as u64 + 2);
        if id == option::DONE {
            return o + 6;
        }
        o += 6 + n;
    }
}

/// Options the reader does not use and buffer options after the first top-level one
/// (an instance, a second top-level buffer naming another CPU) are counted, not kept;
/// the CPU table is the first top-level buffer's. The instance (its CPU's data inside
/// the top level's) reads nothing, noted.
#[test]
fn options_the_reader_does_not_use_are_counted() {
    let mut d = zstd_file();
    let good = TraceFile::parse(&d).unwrap();
    let opt = |id: u16, data: &[u8]| {
        let mut v = id.to_le_bytes().to_vec();
        v.extend_from_slice(&(data.len() as u32).to_le_bytes());
        v.extend_from_slice(data);
        v
    };
    let buffer = |name: &[u8]| {
        let mut b = 0u64.to_le_bytes().to_vec();
        b.extend_from_slice(name);
        b.extend_from_slice(b"\0local\0");
        b.extend_from_slice(&4096u32.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&4096u64.to_le_bytes());
        opt(option::BUFFER, &b)
    };
    let mut body = Vec::new();
    for _ in 0..3 {
        body.extend_from_slice(&opt(option::UNAME, b"Linux x 6.18\0"));
    }
    body.extend_from_slice(&buffer(b"instance"));
    body.extend_from_slice(&buffer(b""));
    body.extend_from_slice(&opt(option::CPUSTAT, b"CPU: 9\n\0"));
    body.extend_from_slice(&opt(option::DONE, &0u64.to_le_bytes()));
    let at = d.len() as u64;
    d.extend_from_slice(&0u16.to_le_bytes());
    d.extend_from_slice(&0u16.to_le_bytes());
    d.extend_from_slice(&0u32.to_le_bytes());
    d.extend_from_slice(&(body.len() as u64).to_le_bytes());
    d.extend_from_slice(&body);
    let done = options_done(&d);
    d[done..done + 8].copy_from_slice(&at.to_le_bytes());
    let f = TraceFile::parse(&d).unwrap();
    assert_eq!(f.damage.len(), 1, "{:?}", f.damage);
    assert!(f.damage[0].what.contains("buffer instances"));
    assert_eq!(f.instances.len(), 1);
    assert_eq!(f.options_skipped, good.options_skipped + 5);
    assert_eq!(f.options.len(), good.options.len() + 1);
    assert!(f.options.iter().all(|o| o.id != option::BUFFER));
    assert_eq!(f.cpus, good.cpus);
    assert_eq!(f.cpu_stats().last().map(String::as_str), Some("CPU: 9\n"));
    assert_eq!(f.event_count(), good.event_count());
}

/// A chunk that does not decompress (its frame magic overwritten) is skipped with a
/// note naming the CPU and the chunk; exactly its pages are missing: the CPU's later
/// chunks and the other CPUs are read in full.
#[test]
fn damaged_chunk_is_skipped() {
    let mut data = zstd_file();
    let good = TraceFile::parse(&data).unwrap();
    let b = good.cpus.iter().find(|b| b.cpu == 0).unwrap().clone();
    assert!(le32_at(&data, b.offset) >= 2);
    let pages = le32_at(&data, b.offset + 8) / 4096;
    let frame = b.offset as usize + 4 + 8;
    data[frame..frame + 4].copy_from_slice(b"XXXX");
    let f = TraceFile::parse(&data).unwrap();
    assert!(f.damage.is_empty());
    let (got, damage) = per_cpu(&f);
    assert_eq!(damage.len(), 1, "{damage:?}");
    assert_eq!(damage[0].cpu, Some(0));
    assert!(
        damage[0].what.starts_with("chunk 0 damaged"),
        "{}",
        damage[0]
    );
    assert_eq!(got[&0], PAGES[0] - pages);
    assert_eq!((got[&1], got[&2]), (PAGES[1], PAGES[2]));
}

/// A file cut inside its last chunk reads every chunk before the cut, noting the
/// cut once; a file cut inside a chunk header likewise.
#[test]
fn truncated_file_reads_up_to_the_cut() {
    let data = zstd_file();
    let good = TraceFile::parse(&data).unwrap();
    let last = good.cpus.iter().max_by_key(|b| b.offset).unwrap().clone();
    let mut at = last.offset + 4;
    for _ in 1..le32_at(&data, last.offset) {
        at += 8 + le32_at(&data, at) as u64;
    }
    let in_last = le32_at(&data, at + 4) / 4096;
    for cut in [at as usize + 20, at as usize + 3] {
        let f = TraceFile::parse(&data[..cut]).unwrap();
        let (got, damage) = per_cpu(&f);
        assert_eq!(damage.len(), 1, "{damage:?}");
        assert!(damage[0].what.contains("cut short"), "{}", damage[0]);
        for (cpu, &n) in PAGES.iter().enumerate() {
            let want = if cpu as u32 == last.cpu {
                n - in_last
            } else {
                n
            };
            assert_eq!(
                got.get(&(cpu as u32)).copied().unwrap_or(0),
                want,
                "cpu {cpu}"
            );
        }
    }
}

/// A `header_page` whose text does not parse falls back to the kernel's layout
/// with a note; every event is still read.
#[test]
fn damaged_header_page_falls_back() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kernel-v6.dat");
    let mut data = std::fs::read(p).unwrap();
    let good = TraceFile::parse(&data).unwrap();
    let at = data
        .windows(11)
        .position(|w| w == b"field: char")
        .expect("data field");
    data[at..at + 11].copy_from_slice(b"XXXXXXXXXXX");
    let f = TraceFile::parse(&data).unwrap();
    assert_eq!(f.damage.len(), 1, "{:?}", f.damage);
    assert!(f.damage[0].what.starts_with("header_page damaged"));
    assert_eq!(f.header_page, good.header_page);
    assert_eq!(f.event_count(), good.event_count());
}

mod offset_tests {
    use super::super::meta::parse_c_integer;

    /// The OFFSET option is read as trace-cmd reads it (`strtoll(buf, NULL, 0)`).
    #[test]
    fn offset_text_as_strtoll() {
        assert_eq!(parse_c_integer(b"-80251194\0"), Some(-80_251_194));
        assert_eq!(parse_c_integer(b"12345"), Some(12_345));
        assert_eq!(parse_c_integer(b"+7 junk"), Some(7));
        assert_eq!(parse_c_integer(b"0x10\0"), Some(16));
        assert_eq!(parse_c_integer(b"010"), Some(8));
        assert_eq!(parse_c_integer(b"0"), Some(0));
        assert_eq!(parse_c_integer(b"  42"), Some(42));
        assert_eq!(parse_c_integer(b""), None);
        assert_eq!(parse_c_integer(b"x"), None);
        assert_eq!(parse_c_integer(b"99999999999999999999999"), None);
        assert_eq!(parse_c_integer(&[0xff, 0xfe]), None);
    }
}
