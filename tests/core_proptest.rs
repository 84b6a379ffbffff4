//! Event codec and writer encoding properties.
//!
//! - every payload length 0..=max_payload (page sizes 4096 and 16384), exhaustively:
//!   the codec's encoding decodes back to the payload zero-padded to its encoded
//!   length, in `data_event_size(len)` bytes, in the small form for 1..=112 bytes and
//!   the long form otherwise; and the same through `Writer::write`;
//! - time deltas around the 27-bit (TIME_EXTEND) and 59-bit boundaries round-trip
//!   exactly; a clock going backwards is clamped (delta 0);
//! - random sequences of payload lengths and time deltas written by the writer decode
//!   (page by page, in page_seq order, and through the reader) to exactly the events
//!   written, with page_entries and first_index matching.

use hyptrace_abi::layout::{ctl, footer, Mode, RingGeometry};
use hyptrace_abi::page::{
    self, data_event_size, decode_record, encode_data_header, encode_time_extend, Events, Record,
    COMMIT_LEN_MASK, COMMIT_OFFSET, MAX_DELTA, MAX_EXTENDED_DELTA, MAX_SMALL_PAYLOAD,
    PAGE_HEADER_SIZE,
};
use hyptrace_abi::{HeapMem, SharedMem};
use hyptrace_reader::{Direct, Item, RingBuffer};
use hyptrace_writer::{WriteOutcome, Writer};
use proptest::prelude::*;
use std::sync::atomic::Ordering::Acquire;
use std::sync::Arc;

fn padded(p: &[u8]) -> Vec<u8> {
    let mut v = p.to_vec();
    v.resize(page::align4(p.len()), 0);
    v
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (i % 57)) as u8 ^ i as u8)
        .collect()
}

/// The codec alone: header + payload + zero padding decodes back.
#[test]
fn codec_every_payload_length_round_trips() {
    for page_size in [4096usize, 16384] {
        let l = RingGeometry::new(1, 3, page_size, Mode::Stop, false).unwrap();
        let max = l.max_payload();
        assert_eq!(data_event_size(max), l.data_capacity(), "max fills a page");
        for len in 0..=max {
            let p = bytes(len as u64, len);
            let mut data = vec![0xeeu8; data_event_size(len) + 8];
            let mut hdr = [0u8; 8];
            let delta = (len as u32 * 7919) & MAX_DELTA as u32;
            let h = encode_data_header(&mut hdr, len, delta);
            let small = (1..=MAX_SMALL_PAYLOAD).contains(&len);
            assert_eq!(h, if small { 4 } else { 8 }, "len {len}");
            data[..h].copy_from_slice(&hdr[..h]);
            data[h..h + len].copy_from_slice(&p);
            data[h + len..data_event_size(len)].fill(0);
            let size = data_event_size(len);
            let rec = decode_record(&data[..size], 0).unwrap().unwrap();
            match rec {
                (
                    Record::Data {
                        delta: d,
                        start,
                        len: n,
                    },
                    next,
                ) => {
                    assert_eq!(
                        (d, start, n, next),
                        (u64::from(delta), h, page::align4(len), size)
                    );
                    assert_eq!(&data[start..start + n], &padded(&p)[..], "len {len}");
                }
                r => panic!("len {len}: {r:?}"),
            }
            // Truncated by a byte: an error, never a panic or a wrong event.
            assert!(decode_record(&data[..size - 1], 0).is_err() || size == 0);
        }
    }
}

/// Through the writer: every payload length, decoded from the page where it landed.
#[test]
fn writer_every_payload_length_round_trips() {
    for page_size in [4096usize, 16384] {
        let l = RingGeometry::new(1, 3, page_size, Mode::Overwrite, false).unwrap();
        let m = HeapMem::new(l.region_size);
        l.init_region(&m, 0, 1);
        let mut w = Writer::attach(&m, 0).unwrap();
        let c = l.ctl(0);
        for len in 0..=w.max_payload() {
            let p = bytes(len as u64 + 1, len);
            let tail = m.load(c + ctl::TAIL_PAGE, Acquire) as u32;
            let before =
                (m.load(l.page_off(tail) + COMMIT_OFFSET, Acquire) & COMMIT_LEN_MASK) as usize;
            let ts = 1000 + len as u64;
            assert_eq!(w.write(0, ts, &p), WriteOutcome::Written, "len {len}");
            let now = m.load(c + ctl::TAIL_PAGE, Acquire) as u32;
            let at = if now == tail { before } else { 0 };
            let off = l.page_off(now);
            let commit = (m.load(off + COMMIT_OFFSET, Acquire) & COMMIT_LEN_MASK) as usize;
            assert_eq!(commit - at, data_event_size(len), "len {len}: bytes used");
            let mut data = vec![0u8; commit];
            m.read_bytes(off + PAGE_HEADER_SIZE, &mut data);
            let mut stamp = [0u8; 8];
            m.read_bytes(off, &mut stamp);
            let mut ev = Events::new(&data, u64::from_le_bytes(stamp));
            let last = ev.by_ref().last().unwrap().unwrap();
            assert_eq!(last.offset, at, "len {len}");
            assert_eq!(last.ts, ts, "len {len}");
            assert_eq!(last.payload, &padded(&p)[..], "len {len}");
        }
    }
}

/// Writes `events` ((payload, ts)) into a fresh stop-mode region large enough for all,
/// and returns everything decoded (page by page in page_seq order) plus the reader's
/// view of the same region.
type Decoded = Vec<(u64, Vec<u8>)>;

fn write_and_decode(page_size: usize, events: &[(Vec<u8>, u64)]) -> (Decoded, Decoded) {
    let pages = events.len() as u32 + 3;
    let l = RingGeometry::new(1, pages, page_size, Mode::Stop, false).unwrap();
    let m = Arc::new(HeapMem::new(l.region_size));
    l.init_region(&*m, 0, 1);
    let mut w = Writer::attach(m.clone(), 0).unwrap();
    for (p, ts) in events {
        assert_eq!(w.write(0, *ts, p), WriteOutcome::Written);
    }
    let touched = m.load(l.ctl(0) + ctl::PAGES_TOUCHED, Acquire);
    let tail = m.load(l.ctl(0) + ctl::TAIL_PAGE, Acquire) as u32;
    let mut by_seq: Vec<(u64, u32)> = (0..pages)
        .map(|p| (m.load(l.footer_off(p) + footer::PAGE_SEQ, Acquire), p))
        .filter(|&(s, _)| s != 0)
        .collect();
    by_seq.sort_unstable();
    assert_eq!(by_seq.len() as u64, touched, "one page per page_seq");
    let mut out = vec![];
    for (k, &(s, p)) in by_seq.iter().enumerate() {
        assert_eq!(s, k as u64 + 1);
        let off = l.page_off(p);
        let commit = (m.load(off + COMMIT_OFFSET, Acquire) & COMMIT_LEN_MASK) as usize;
        let mut page = vec![0u8; PAGE_HEADER_SIZE + commit];
        m.read_bytes(off, &mut page);
        let ts = u64::from_le_bytes(page[..8].try_into().unwrap());
        let f = l.footer_off(p);
        assert_eq!(m.load(f + footer::FIRST_INDEX, Acquire), out.len() as u64);
        let before = out.len();
        for e in Events::new(&page[PAGE_HEADER_SIZE..], ts) {
            let e = e.unwrap();
            out.push((e.ts, e.payload.to_vec()));
        }
        if p != tail {
            assert_eq!(
                m.load(f + footer::PAGE_ENTRIES, Acquire),
                (out.len() - before) as u64
            );
        }
    }
    let mut rb = RingBuffer::attach(m.clone(), Direct::new(m.clone(), l)).unwrap();
    let mut via_reader = vec![];
    while let Some(it) = rb.next_event(0).unwrap() {
        match it {
            Item::Event { ts, payload } => via_reader.push((ts, payload.to_vec())),
            Item::Lost(n) => panic!("lost {n}"),
        }
    }
    rb.finalize(0).unwrap();
    while let Some(it) = rb.next_event(0).unwrap() {
        match it {
            Item::Event { ts, payload } => via_reader.push((ts, payload.to_vec())),
            Item::Lost(n) => panic!("lost {n}"),
        }
    }
    (out, via_reader)
}

fn delta_strategy() -> impl Strategy<Value = i128> {
    prop_oneof![
        4 => 0i128..2000,
        2 => (MAX_DELTA as i128 - 3)..=(MAX_DELTA as i128 + 3),
        1 => (MAX_EXTENDED_DELTA as i128 - 3)..=(MAX_EXTENDED_DELTA as i128),
        1 => (MAX_DELTA as i128)..=(MAX_EXTENDED_DELTA as i128),
        1 => -5000i128..0, // clock going backwards
    ]
}

fn len_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0usize..=16,
        3 => 100usize..=130, // around the small/long form boundary (112)
        2 => 0usize..=600,
        1 => 1000usize..=4000,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random lengths and deltas (27- and 59-bit boundaries, backwards clock) decode to
    /// exactly the events written: timestamps exact (clamped when going backwards),
    /// payloads zero-padded.
    #[test]
    fn writer_pages_decode_to_the_events_written(
        big in any::<bool>(),
        start in 0u64..(1 << 40),
        evs in prop::collection::vec((len_strategy(), delta_strategy(), any::<u8>()), 1..80),
    ) {
        let page_size = if big { 16384 } else { 4096 };
        let mut ts = start;
        // The writer's last timestamp (a fresh ring starts at 0).
        let mut last = 0u64;
        let mut written = vec![];
        let mut expect = vec![];
        for &(len, d, b) in &evs {
            let len = len.min(page_size - 112 - 8);
            let t = (i128::from(ts) + d).max(0) as u64;
            // The writer clamps a clock going backwards to the last timestamp.
            last = last.max(t);
            ts = last;
            let p: Vec<u8> = (0..len).map(|k| b.wrapping_add(k as u8)).collect();
            expect.push((last, padded(&p)));
            written.push((p, t));
        }
        let (pages, reader) = write_and_decode(page_size, &written);
        prop_assert_eq!(&pages, &expect);
        prop_assert_eq!(&reader, &expect);
    }

    /// A TIME_EXTEND carries any delta up to 59 bits and decodes back exactly.
    #[test]
    fn time_extend_round_trips(delta in 0u64..=MAX_EXTENDED_DELTA) {
        let te = encode_time_extend(delta);
        let (rec, next) = decode_record(&te, 0).unwrap().unwrap();
        prop_assert_eq!(rec, Record::TimeExtend { delta });
        prop_assert_eq!(next, 8);
    }
}

/// Deltas exactly at the boundaries, in one page: 2^27 - 1 fits the header, 2^27 needs a
/// TIME_EXTEND, 2^59 - 1 is the largest a TIME_EXTEND carries.
#[test]
fn delta_boundaries_exact() {
    let deltas = [
        0,
        1,
        MAX_DELTA - 1,
        MAX_DELTA,
        MAX_DELTA + 1,
        MAX_DELTA + 2,
        MAX_EXTENDED_DELTA - 1,
        MAX_EXTENDED_DELTA,
        3,
    ];
    let mut ts = 5u64;
    let mut events = vec![(vec![1u8; 8], ts)];
    for (i, d) in deltas.iter().enumerate() {
        ts += d;
        events.push((vec![i as u8; 8], ts));
    }
    let (pages, reader) = write_and_decode(4096, &events);
    let expect: Decoded = events.iter().map(|(p, t)| (*t, p.clone())).collect();
    assert_eq!(pages, expect);
    assert_eq!(reader, expect);
}

/// A clock going backwards is clamped: delta 0, the previous timestamp.
#[test]
fn backwards_clock_clamps_to_delta_zero() {
    let events = vec![
        (vec![1u8; 4], 1000),
        (vec![2u8; 4], 10),
        (vec![3u8; 4], 999),
        (vec![4u8; 4], 1001),
    ];
    let (pages, _) = write_and_decode(4096, &events);
    let ts: Vec<u64> = pages.iter().map(|e| e.0).collect();
    assert_eq!(ts, vec![1000, 1000, 1000, 1001]);
}

/// Deltas beyond 59 bits cannot be encoded: the timestamps decoded stay monotonic and
/// never pass the real ones (the writer clamps the delta to 2^59 - 1).
#[test]
fn delta_beyond_59_bits_stays_monotonic() {
    let events = vec![
        (vec![1u8; 8], 1),
        (vec![2u8; 8], 1 + (1 << 60)),
        (vec![3u8; 8], 2 + (1 << 60)),
        (vec![4u8; 8], u64::MAX),
    ];
    let (pages, _) = write_and_decode(4096, &events);
    let mut last = 0;
    for (i, (t, _)) in pages.iter().enumerate() {
        assert!(*t >= last && *t <= events[i].1, "event {i}: {t}");
        last = *t;
    }
    assert_eq!(pages[1].0, 1 + MAX_EXTENDED_DELTA);
}
