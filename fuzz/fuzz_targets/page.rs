//! Fuzz target `page`: the Linux data-page codec (`page::decode_record`, `page::Events`,
//! `page::page_header`) on raw, hostile bytes.
//!
//! Input: a whole data page as the reader copies it out — `u64 time_stamp`, `u64 commit`,
//! then data. The committed length is taken from `commit` (clamped to the bytes present,
//! as the reader clamps it to the data capacity), so the fuzzer controls both the
//! length and the records.
//!
//! Checked, besides "never panics":
//! - `Events` and a manual `decode_record` walk agree record by record;
//! - every record advances by at least 4 bytes and stays inside the data;
//! - every payload range lies inside the data (its length is the kernel's
//!   `array[0] - 4` for the long form, so not always a multiple of 4);
//! - the clock is the page time_stamp plus the deltas (wrapping), TIME_STAMP resets it
//!   (its bits above 59 from the page time_stamp, as the kernel does);
//! - at most one error, and nothing after it;
//! - `decode_record` at any offset (also unaligned, past the end) never panics.
#![no_main]

use hyptrace_abi::page::{self, Events, Record, COMMIT_LEN_MASK, PAGE_HEADER_SIZE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((ts0, commit)) = page::page_header(input) else {
        return;
    };
    let rest = &input[PAGE_HEADER_SIZE..];
    let len = ((commit & COMMIT_LEN_MASK) as usize).min(rest.len());
    let data = &rest[..len];

    // Manual walk with decode_record: the reference for the iterator.
    let mut expected = Vec::new();
    let mut off = 0usize;
    let mut clock = ts0;
    let mut err = None;
    let mut steps = 0usize;
    loop {
        steps += 1;
        assert!(
            steps <= data.len() / 4 + 2,
            "decode_record does not progress"
        );
        match page::decode_record(data, off) {
            Ok(None) => break,
            Err(e) => {
                err = Some(e);
                break;
            }
            Ok(Some((rec, next))) => {
                assert!(next >= off + 4, "record at {off} advances to {next}");
                match rec {
                    Record::Data { delta, start, len } => {
                        assert!(next <= data.len(), "data record ends past the data");
                        assert!(delta <= page::MAX_DELTA);
                        assert!(start > off && start + len <= next);
                        clock = clock.wrapping_add(delta);
                        expected.push((clock, start, len, off));
                    }
                    Record::TimeExtend { delta } => {
                        assert!(delta <= page::MAX_EXTENDED_DELTA);
                        clock = clock.wrapping_add(delta);
                    }
                    Record::TimeStamp { ts } => {
                        assert!(ts <= page::MAX_EXTENDED_DELTA);
                        clock = page::fix_abs_ts(ts, ts0);
                    }
                    Record::Padding { delta } => assert!(delta > 0),
                }
                off = next;
            }
        }
    }

    // The iterator yields the same events, then the same error (once), then nothing.
    let mut it = Events::new(data, ts0);
    for &(ts, start, len, at) in &expected {
        let ev = it
            .next()
            .expect("iterator ended early")
            .expect("iterator error early");
        assert_eq!(ev.ts, ts);
        assert_eq!(ev.offset, at);
        assert_eq!(ev.payload, &data[start..start + len]);
    }
    match (err, it.next()) {
        (None, None) => assert_eq!(it.offset(), data.len()),
        (Some(e), Some(Err(got))) => assert_eq!(e, got),
        (e, got) => panic!("walk ended with {e:?}, iterator with {got:?}"),
    }
    assert!(it.next().is_none(), "iterator yields after its end");
    assert!(it.next().is_none(), "iterator yields after its end");
    if err.is_none() {
        assert_eq!(it.clock(), clock);
    }

    // Random-offset decoding: any offset, aligned or not, inside or past the data.
    for &b in input.iter().take(8) {
        let o = usize::from(b) * 7 % (data.len() + 16);
        if let Ok(Some((_, next))) = page::decode_record(data, o) {
            assert!(next > o);
        }
    }
    let _ = page::decode_record(data, usize::MAX - 2);
    let _ = page::decode_record(data, usize::MAX);
});
