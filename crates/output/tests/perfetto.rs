//! `PerfettoSink` output decoded with Perfetto's official schema (perfetto_trace_pb2,
//! through tests/perfetto_decode.py) and with our own generated types: tracks, slices,
//! instants, args, losses, clock.

mod common;

use common::*;
use hyptrace_output::perfetto::{decode_trace, vcpu_track_uuid, CLOCK_ID, PROCESS_UUID};
use hyptrace_output::*;
use serde_json::json;

const NR: u32 = 2;

/// Two vCPUs: markers (one with u64::MAX), spans, texts, a loss before a page, and a
/// trailing loss on CPU 1. Returns the pages and what the trace must show.
struct Fixture {
    pages: Vec<Vec<(Vec<u8>, Missed)>>,
    markers: [u64; 2],
    spans: [u64; 2],
    texts: [u64; 2],
    lost: [u64; 2],
}

fn fixture() -> Fixture {
    let mut f = Fixture {
        pages: Vec::new(),
        markers: [0; 2],
        spans: [0; 2],
        texts: [0; 2],
        lost: [0; 2],
    };
    for cpu in 0..NR {
        let c = cpu as usize;
        let mut b = PageBuilder::new(4096);
        let mut ts = 1_000_000u64 + u64::from(cpu);
        for i in 0..300u64 {
            ts += 2_000;
            if i == 150 {
                b.lose(7 + u64::from(cpu));
                f.lost[c] += 7 + u64::from(cpu);
            }
            match i % 3 {
                0 => {
                    let v = if i == 0 { u64::MAX } else { i };
                    b.push(ts, &marker(cpu, i, v));
                    f.markers[c] += 1;
                }
                1 => {
                    b.push(ts, &span(cpu, i, 100 + i, 1_000));
                    f.spans[c] += 1;
                }
                _ => {
                    b.push(ts, &text(cpu, i, &format!("hello {i} \"q\"")));
                    f.texts[c] += 1;
                }
            }
        }
        f.pages.push(b.finish());
    }
    f
}

fn write(f: &Fixture, path: &std::path::Path, clock: Clock) {
    let meta = TraceMeta::guest(4096, NR, clock);
    let mut sink: Box<dyn PageSink> = Box::new(PerfettoSink::create(path, meta).unwrap());
    let max = f.pages.iter().map(Vec::len).max().unwrap();
    for i in 0..max {
        for (cpu, p) in f.pages.iter().enumerate() {
            if let Some((page, missed)) = p.get(i) {
                sink.page(cpu as u32, page, *missed).unwrap();
            }
        }
    }
    sink.trailing_lost(1, 42).unwrap();
    sink.trailing_lost(0, 0).unwrap();
    assert!(sink.trailing_lost(NR, 1).is_err());
    sink.finish(&RunSummary::default()).unwrap();
}

#[test]
fn perfetto_decodes_with_the_official_schema() {
    let f = fixture();
    let dir = scratch_dir("perfetto");
    let path = dir.join("t.pftrace");
    // 2 cycles per ns.
    write(&f, &path, Clock::guest_tsc(2_000_000).unwrap());
    let lost = [f.lost[0], f.lost[1] + 42];

    // Our own types read it back (a Trace of packets).
    let t = decode_trace(&std::fs::read(&path).unwrap()).unwrap();
    let total: u64 = (0..2)
        .map(|c| f.markers[c] + 2 * f.spans[c] + f.texts[c])
        .sum();
    // clock + process + 2 threads + events + 2 loss instants + 1 trailing.
    assert_eq!(t.packet.len() as u64, 1 + 1 + 2 + total + 3);

    let Some(v) = perfetto_decode(&path, true) else {
        return;
    };
    assert_eq!(v["packets"], json!(t.packet.len()));
    assert_eq!(v["clocks"], json!([[CLOCK_ID, 0], [6, 0]]));
    assert_eq!(v["primary_clock"], json!(6));
    assert_eq!(
        v["process"],
        json!({"uuid": PROCESS_UUID, "pid": 1, "name": "hyptrace guest"})
    );
    for cpu in 0..NR {
        let c = cpu as usize;
        let uuid = vcpu_track_uuid(cpu).to_string();
        assert_eq!(
            v["threads"][&uuid],
            json!({"pid": 1, "tid": cpu + 1, "name": format!("vcpu{cpu}"), "parent": PROCESS_UUID})
        );
        let tr = &v["tracks"][&uuid];
        assert_eq!(tr["instants"]["marker"], json!(f.markers[c]), "{tr}");
        assert_eq!(tr["instants"]["text"], json!(f.texts[c]), "{tr}");
        assert_eq!(tr["begins"], json!(f.spans[c]));
        assert_eq!(tr["lost"], json!(lost[c]));
        assert_eq!(tr["lost_unknown"], json!(0));
    }
    let evs = v["events"].as_array().unwrap();
    // Slices: begin at ts − dur (1000 cycles = 500 ns), end at the event's time.
    let begin = evs
        .iter()
        .position(|e| e[2] == "TYPE_SLICE_BEGIN" && e[0] == vcpu_track_uuid(0))
        .unwrap();
    let (b, e) = (&evs[begin], &evs[begin + 1]);
    assert_eq!(e[2], "TYPE_SLICE_END");
    assert_eq!(b[3], "span");
    assert_eq!(b[4], json!(["guest"]));
    assert_eq!(b[5]["dur"], json!(1000));
    assert_eq!(b[5]["id"], json!(101));
    // span i=1 at 1_000_000 + 2 × 2_000 cycles = 502_000 ns.
    assert_eq!(e[1], json!(502_000));
    assert_eq!(b[1], json!(502_000 - 500));
    // Args keep u64 exact, strings as written.
    let m0 = evs.iter().find(|e| e[3] == "marker").unwrap();
    assert_eq!(m0[5]["value"], json!(u64::MAX));
    assert_eq!(m0[5]["seq"], json!(0));
    let t0 = evs.iter().find(|e| e[3] == "text").unwrap();
    assert_eq!(t0[5]["msg"], json!("hello 2 \"q\""));
    // The loss instant is named with its count, right before the page's first event.
    let l = evs
        .iter()
        .position(|e| e[3] == "lost 8 events")
        .expect("loss instant of CPU 1");
    assert_eq!(evs[l][0], json!(vcpu_track_uuid(1)));
    assert_eq!(evs[l][5]["count"], json!(8));
    assert_eq!(evs[l][4], json!(["hyptrace"]));
    assert_eq!(evs[l + 1][0], json!(vcpu_track_uuid(1)));
    assert_eq!(evs[l][1], evs[l + 1][1]);
    // The trailing loss: last packet, at CPU 1's last event.
    let last = evs.last().unwrap();
    assert_eq!(last[3], "lost 42 events");
    let last_ev = evs
        .iter()
        .rev()
        .skip(1)
        .find(|e| e[0] == vcpu_track_uuid(1))
        .unwrap();
    assert_eq!(last[1], last_ev[1]);
}

/// Through `to_writer` (convert, pipes): the same bytes as a file.
#[test]
fn perfetto_to_writer_matches_file() {
    use std::sync::{Arc, Mutex};
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let f = fixture();
    let dir = scratch_dir("perfetto-writer");
    let path = dir.join("t.pftrace");
    write(&f, &path, Clock::nanoseconds());
    let buf = Arc::new(Mutex::new(Vec::new()));
    let meta = TraceMeta::guest(4096, NR, Clock::nanoseconds());
    let mut sink: Box<dyn PageSink> =
        Box::new(PerfettoSink::to_writer(Box::new(Shared(Arc::clone(&buf))), meta).unwrap());
    let max = f.pages.iter().map(Vec::len).max().unwrap();
    for i in 0..max {
        for (cpu, p) in f.pages.iter().enumerate() {
            if let Some((page, missed)) = p.get(i) {
                sink.page(cpu as u32, page, *missed).unwrap();
            }
        }
    }
    sink.trailing_lost(1, 42).unwrap();
    sink.finish(&RunSummary::default()).unwrap();
    assert_eq!(*buf.lock().unwrap(), std::fs::read(&path).unwrap());
}
