//! Hostile page encodings: our reader follows the kernel's definition
//! (kernel/trace/ring_buffer.c: rb_event_length, rb_update_read_stamp) where trace-cmd
//! 3.1.6 reads the same records (the test pins down what it prints); where the two would
//! read different records (a null padding inside the commit, a length word that is not a
//! multiple of 4: neither the kernel nor our writer writes them), the page is damaged and
//! read as trace-cmd reads it (docs/output.md).

mod common;

use common::*;
use hyptrace_output::*;

fn page(ts: u64, data: &[u8]) -> Vec<u8> {
    let mut p = vec![0u8; 4096];
    p[..8].copy_from_slice(&ts.to_le_bytes());
    p[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
    p[16..16 + data.len()].copy_from_slice(data);
    p
}

fn hdr(type_len: u32, delta: u32) -> [u8; 4] {
    ((type_len & 31) | (delta << 5)).to_le_bytes()
}

fn small(delta: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = hdr((payload.len() / 4) as u32, delta).to_vec();
    v.extend_from_slice(payload);
    v
}

/// A padding record of 12 bytes (array[0] = 8) with `delta`.
fn padding(delta: u32) -> Vec<u8> {
    let mut v = hdr(29, delta).to_vec();
    v.extend_from_slice(&8u32.to_le_bytes());
    v.extend_from_slice(&[0u8; 4]);
    v
}

/// Our report of a one-page trace.dat holding `data` (event lines only), and the file
/// (in the directory returned, removed on drop).
fn ours(name: &str, data: &[u8]) -> (ScratchDir, std::path::PathBuf, Vec<String>) {
    let dir = scratch_dir(&format!("enc-{name}"));
    let path = dir.join("e.dat");
    let p = page(1_000_000, data);
    write_trace_dat(
        &path,
        TraceMeta::guest(4096, 1, Clock::nanoseconds()),
        TraceDatVersion::V6,
        [(0u32, p.as_slice(), Missed::None)],
        &RunSummary::default(),
    )
    .unwrap();
    let report = TraceFile::open(&path).unwrap().report();
    (dir, path, report_lines(&report))
}

fn report_lines(s: &str) -> Vec<String> {
    s.lines().skip(1).map(norm).collect()
}

/// Our report and trace-cmd's (None when trace-cmd is not installed), event lines only.
fn reports(name: &str, data: &[u8]) -> (Vec<String>, Option<Vec<String>>) {
    let (_dir, path, ours) = ours(name, data);
    let theirs = trace_cmd(&["report", "-t"], &path).map(|(o, e, ok)| {
        assert!(ok && e.is_empty(), "{e}");
        report_lines(&o)
    });
    (ours, theirs)
}

fn m(seq: u64) -> Vec<u8> {
    marker(0, seq, seq)
}

fn line(ns: u64, seq: u64) -> String {
    format!("vcpu0-1 [000] 0.{ns:09}: marker: seq={seq} value={seq}")
}

#[test]
fn null_padding_mid_page_is_damage() {
    // Kernel: a padding with delta 0 is a "null event": the rest of the page is empty.
    // trace-cmd skips it and prints the event after it: the page is damaged, and read as
    // trace-cmd reads it.
    let mut d = small(0, &m(1));
    d.extend(padding(0));
    d.extend(small(5, &m(2)));
    damaged_like_trace_cmd(
        "pad0",
        &d,
        "event at data offset 28 has a bad length word",
        &[line(1_000_000, 1), line(1_000_005, 2)],
    );
}

/// A page holding `data` is damaged (`why`), and we print `expected`, as trace-cmd does.
fn damaged_like_trace_cmd(name: &str, data: &[u8], why: &str, expected: &[String]) {
    assert_damaged(data, why);
    let (ours, theirs) = reports(name, data);
    assert_eq!(ours, expected);
    if let Some(t) = theirs {
        assert_eq!(t, ours);
    }
}

/// `page_damage` (what `convert` warns about, and where `report` switches to trace-cmd's
/// reading) of a page holding `data`.
fn assert_damaged(data: &[u8], why: &str) {
    let p = page(1_000_000, data);
    assert_eq!(
        hyptrace_output::tracedat::page_damage(&p).as_deref(),
        Some(why)
    );
}

#[test]
fn padding_delta_is_not_time() {
    // Kernel: a discarded event's delta is ignored (rb_update_read_stamp).
    let mut d = small(0, &m(1));
    d.extend(padding(7));
    d.extend(small(5, &m(2)));
    let (ours, theirs) = reports("pad7", &d);
    assert_eq!(ours, vec![line(1_000_000, 1), line(1_000_005, 2)]);
    if let Some(t) = theirs {
        // trace-cmd adds it to the clock.
        assert_eq!(t, vec![line(1_000_000, 1), line(1_000_012, 2)]);
    }
}

#[test]
fn long_form_length_not_rounded_is_damage() {
    // type_len 0, array[0] = 4 + 26: a 26-byte marker payload (the format's fields fit).
    // The kernel reads the next event at offset 4 + 30 = 34 (rb_event_data_length =
    // array[0] + 4); trace-cmd rounds the length up to 28 and reads it 2 bytes late. The
    // page is damaged, and read as trace-cmd reads it.
    let mut d = hdr(0, 0).to_vec();
    d.extend_from_slice(&30u32.to_le_bytes());
    let mut p = m(1);
    p.extend_from_slice(&[0, 0]);
    d.extend_from_slice(&p);
    d.extend(small(3, &m(2)));
    d.extend_from_slice(&[0, 0]); // keep commit a multiple of 4
    assert_damaged(&d, "event at data offset 0 has a bad length word");
    let (ours, theirs) = reports("unaligned", &d);
    assert_eq!(ours.len(), 2, "{ours:?}");
    assert_eq!(ours[0], line(1_000_000, 1));
    assert!(ours[1].ends_with("[UNKNOWN EVENT]: id=0"), "{ours:?}");
    if let Some(t) = theirs {
        assert_eq!(t.len(), 2, "{t:?}");
        assert_eq!(t[0], ours[0]);
        assert!(t[1].starts_with("[UNKNOWN EVENT]"), "{t:?}");
    }
}

/// A damaged page whose long-form length steps back to an offset kbuffer has not read
/// (inside the first event's payload): trace-cmd reads on from there, and so do we.
#[test]
fn damaged_page_steps_back_to_an_unread_offset() {
    let mut d = hdr(1, 0).to_vec(); // at 0: one payload word, which at 4 reads as ...
    d.extend_from_slice(&hdr(2, 1)); // ... a 2-word event (payload at 8..16)
    d.extend_from_slice(&hdr(0, 0)); // at 8: long form, length -12: next at 16 - 12 = 4
    d.extend_from_slice(&0xffff_fff8u32.to_le_bytes());
    d.extend(small(5, &m(2))); // at 16
    assert_damaged(&d, "event at data offset 8 runs past commit");
    let (ours, theirs) = reports("back-unread", &d);
    // Records at 0, 8, 4 (the first three: unknown ids), then the marker at 16.
    assert_eq!(ours.len(), 4, "{ours:?}");
    assert_eq!(ours[3], line(1_000_006, 2));
    if let Some(t) = theirs {
        assert_eq!(t.len(), 4, "{t:?}");
        assert_eq!(t[3], ours[3]);
    }
}

/// A damaged page whose length steps back to an offset kbuffer has read: trace-cmd
/// loops there for ever (not run here); we end the page.
#[test]
fn damaged_page_steps_back_to_a_read_offset() {
    let mut d = small(0, &m(1)); // at 0..28
    d.extend_from_slice(&hdr(0, 0)); // at 28: long form, length -36: next at 36 - 36 = 0
    d.extend_from_slice(&0xffff_ffe0u32.to_le_bytes());
    d.extend(small(5, &m(2)));
    assert_damaged(&d, "event at data offset 28 runs past commit");
    let (_, _, ours) = ours("back-read", &d);
    assert_eq!(ours.len(), 2, "{ours:?}");
    assert_eq!(ours[0], line(1_000_000, 1));
    assert!(ours[1].ends_with("[UNKNOWN EVENT]: id=0"), "{ours:?}");
}

/// On a damaged page, time follows kbuffer: a padding's delta counts (the kernel's
/// reading ignores it on a good page, `padding_delta_is_not_time`).
#[test]
fn damaged_page_padding_delta_is_time() {
    // Long form, length word 29 (unaligned: damage): kbuffer rounds to 28 bytes.
    let mut d = hdr(0, 0).to_vec();
    d.extend_from_slice(&29u32.to_le_bytes());
    d.extend(m(1));
    d.extend_from_slice(&[0; 4]);
    d.extend(padding(7));
    d.extend(small(5, &m(2)));
    damaged_like_trace_cmd(
        "damaged-pad7",
        &d,
        "event at data offset 0 has a bad length word",
        &[line(1_000_000, 1), line(1_000_012, 2)],
    );
}

#[test]
fn maximum_size_events() {
    // The largest event fills the data area (4080 bytes of a 4 KiB page): a known id
    // prints the same in both; an unknown id prints in our usual columns.
    let long = |id: u16| {
        let mut pl = vec![0u8; 4072];
        pl[..24].copy_from_slice(&m(9));
        pl[..2].copy_from_slice(&id.to_le_bytes());
        let mut d = hdr(0, 0).to_vec();
        d.extend_from_slice(&4076u32.to_le_bytes());
        d.extend_from_slice(&pl);
        d
    };
    let (ours, theirs) = reports("max-known", &long(1000));
    assert_eq!(ours, vec![line(1_000_000, 9)]);
    if let Some(t) = theirs {
        assert_eq!(t, ours);
    }
    let (ours, theirs) = reports("max-unknown", &long(4242));
    assert_eq!(
        ours,
        vec!["vcpu0-1 [000] 0.001000000: [UNKNOWN EVENT]: id=4242".to_string()]
    );
    if let Some(t) = theirs {
        assert_eq!(
            t,
            vec!["[UNKNOWN EVENT][UNKNOWN EVENT] (NULL): [UNKNOWN EVENT]".to_string()]
        );
    }
    // `run`'s live formatter prints what report prints.
    let mut s = String::new();
    format_guest_line(
        &mut s,
        &guest_printers(),
        &TraceMeta::guest(4096, 1, Clock::nanoseconds()).cmdlines,
        0,
        1_000_000,
        &long(4242)[8..],
    );
    assert_eq!(norm(&s), ours[0]);
}

/// A page whose commit runs past the page (bits 27-29 of it set too, and the loss
/// flags): `report` reads it to the page's end as trace-cmd does, and `convert` writes
/// it with its commit as read (the writer takes no commit past the page), so the
/// converted file reports the same lines. The CI failure of 2026-12-07: a damaged
/// copy's convert refused such a page and wrote nothing.
#[test]
fn commit_past_the_page_converts_as_report_reads_it() {
    use hyptrace_output::tracedat::{cursors_of, meta_of, pump_by_cpu};
    let mut d = small(0, &m(1));
    d.extend(small(5, &m(2)));
    let (dir, path, _) = ours("past", &d);
    let mut file = std::fs::read(&path).unwrap();
    let mut hdr = 1_000_000u64.to_le_bytes().to_vec();
    hdr.extend_from_slice(&(d.len() as u64).to_le_bytes());
    let at = (0..file.len())
        .step_by(4096)
        .find(|&o| file[o..].starts_with(&hdr))
        .expect("the page in the file");
    let commit = 5000u64 | 1 << 28 | 3 << 30;
    file[at + 8..at + 16].copy_from_slice(&commit.to_le_bytes());
    std::fs::write(&path, &file).unwrap();
    let damaged = TraceFile::open(&path).unwrap();
    let want = report_lines(&damaged.report());
    // The loss flag (its count no longer in the page), the two events, then the zeroed
    // rest of the page as kbuffer reads it: events of id 0.
    let head = [
        "CPU:0 [EVENTS DROPPED]".to_string(),
        line(1_000_000, 1),
        line(1_000_005, 2),
    ];
    assert!(want.starts_with(&head), "{:?}", &want[..want.len().min(4)]);
    assert!(want.len() > head.len());
    let out = dir.join("c.dat");
    let sink = TraceDatSink::create(&out, meta_of(&damaged), TraceDatVersion::V6).unwrap();
    let mut named = Vec::new();
    pump_by_cpu(
        cursors_of(&damaged),
        Box::new(sink),
        &mut |d| named.push(d.what),
        false,
    )
    .expect("a damaged page is converted");
    assert_eq!(named.len(), 1, "{named:?}");
    assert!(named[0].contains("commit 5000 past the page"), "{named:?}");
    let converted = TraceFile::open(&out).unwrap();
    // Every line as report read it, the loss flag without its count included (carried
    // as `Missed::Unknown`: `CPU:0 [EVENTS DROPPED]`).
    let got = report_lines(&converted.report());
    assert!(
        got == want,
        "{} lines, {:?}",
        got.len(),
        &got[..got.len().min(4)]
    );
}
