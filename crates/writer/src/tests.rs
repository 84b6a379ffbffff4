//! Unit tests of the writer on a heap region (single-threaded; the concurrent and
//! model-checked suites live in the workspace tests and `tests/loom.rs`).
use super::*;
use core::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use hyptrace_abi::layout::{
    ctl, footer, link, Mode, MBOX_OP_SWAP, MBOX_OP_UPDATE_FOOTERS, MBOX_STATUS_BUSY, MBOX_STATUS_OK,
};
use hyptrace_abi::layout::{FT_COMMIT, FT_HEAD, FT_READER};
use hyptrace_abi::page::COMMIT_OFFSET;
use hyptrace_abi::page::{Events, COMMIT_LEN_MASK, RB_MISSED_EVENTS};
use hyptrace_abi::HeapMem;
use std::vec::Vec;

fn region(pages: u32, mode: Mode) -> (HeapMem, RingGeometry) {
    let l = RingGeometry::new(1, pages, 4096, mode, false).unwrap();
    let m = HeapMem::new(l.region_size);
    l.init_region(&m, 0, 1);
    (m, l)
}

/// Decodes a page's events as (ts, first u64 of payload).
fn page_events(m: &HeapMem, l: &RingGeometry, id: u32) -> Vec<(u64, u64)> {
    let off = l.page_off(id);
    let mut page = std::vec![0u8; l.page_size];
    m.read_bytes(off, &mut page);
    let (ts, commit) = hyptrace_abi::page::page_header(&page).unwrap();
    let len = (commit & COMMIT_LEN_MASK) as usize;
    Events::new(&page[16..16 + len], ts)
        .map(|e| {
            let e = e.unwrap();
            (e.ts, u64::from_le_bytes(e.payload[..8].try_into().unwrap()))
        })
        .collect()
}

fn reader_page(m: &HeapMem, l: &RingGeometry) -> u32 {
    m.load(l.ctl(0) + ctl::READER_PAGE, Relaxed) as u32
}

fn count_flag(m: &HeapMem, l: &RingGeometry, off: usize, flag: u64) -> usize {
    (0..l.pages_per_cpu)
        .filter(|&p| m.load(l.footer_off(p) + off, Relaxed) & flag != 0)
        .count()
}

fn assert_one_each(m: &HeapMem, l: &RingGeometry) {
    assert_eq!(
        count_flag(m, l, footer::READER_STATUS, FT_READER),
        1,
        "READER"
    );
    assert_eq!(
        count_flag(m, l, footer::WRITER_STATUS, FT_COMMIT),
        1,
        "COMMIT"
    );
    assert_eq!(count_flag(m, l, footer::WRITER_STATUS, FT_HEAD), 1, "HEAD");
}

#[test]
fn writes_decode_back_with_timestamps() {
    let (m, l) = region(4, Mode::Stop);
    let mut w = Writer::attach(&m, 0).unwrap();
    for i in 0..10u64 {
        assert_eq!(
            w.write(0, 1000 + i * 7, &i.to_le_bytes()),
            WriteOutcome::Written
        );
    }
    let tail = m.load(l.ctl(0) + ctl::TAIL_PAGE, Relaxed) as u32;
    let ev = page_events(&m, &l, tail);
    assert_eq!(
        ev,
        (0..10u64).map(|i| (1000 + i * 7, i)).collect::<Vec<_>>()
    );
    assert_eq!(m.load(l.ctl(0) + ctl::ENTRIES, Relaxed), 10);
}

#[test]
fn time_extend_and_backwards_clock() {
    let (m, l) = region(4, Mode::Stop);
    let mut w = Writer::attach(&m, 0).unwrap();
    let big = 1u64 << 40;
    w.write(0, 5, &1u64.to_le_bytes());
    w.write(0, 5 + big, &2u64.to_le_bytes());
    w.write(0, 3, &3u64.to_le_bytes()); // goes backwards: clamped
    w.write(0, 5 + big + (1 << 27), &4u64.to_le_bytes()); // exactly 2^27: extend
    let tail = m.load(l.ctl(0) + ctl::TAIL_PAGE, Relaxed) as u32;
    let ev = page_events(&m, &l, tail);
    assert_eq!(
        ev,
        std::vec![(5, 1), (5 + big, 2), (5 + big, 3), (5 + big + (1 << 27), 4)]
    );
}

#[test]
fn disabled_costs_nothing_and_counts_skipped() {
    let (m, l) = region(4, Mode::Stop);
    let mut w = Writer::attach(&m, 0).unwrap();
    m.store(l.ctl(0) + ctl::ENABLE, !1u64, Relaxed);
    assert_eq!(w.write(0, 1, &[1; 8]), WriteOutcome::Disabled);
    assert_eq!(w.write(1, 1, &[1; 8]), WriteOutcome::Written);
    assert_eq!((w.skipped(), w.entries()), (1, 1));
}

/// R3: every write call, `write_enabled` and `skip` is one attempt, published in the
/// control block as it happens (written, disabled, dropped or refused alike); skipped
/// counts the disabled ones; a writer attaching again goes on from the published counts.
#[test]
fn attempts_are_published_as_they_happen() {
    let (m, l) = region(3, Mode::Stop);
    let c = l.ctl(0);
    let published = || {
        (
            m.load(c + ctl::ATTEMPTED, Relaxed),
            m.load(c + ctl::SKIPPED, Relaxed),
        )
    };
    let mut w = Writer::attach(&m, 0).unwrap();
    assert_eq!(published(), (0, 0));
    m.store(c + ctl::ENABLE, !1u64, Relaxed);
    assert_eq!(w.write(0, 1, &[1; 8]), WriteOutcome::Disabled);
    assert_eq!(published(), (1, 1));
    assert_eq!(w.write(1, 1, &[1; 8]), WriteOutcome::Written);
    assert_eq!(published(), (2, 1));
    w.skip();
    assert_eq!(w.write_enabled(2, &[1; 8]), WriteOutcome::Written);
    assert_eq!(published(), (4, 2));
    let big = std::vec![7u8; w.max_payload() + 1];
    assert_eq!(w.write(1, 3, &big), WriteOutcome::TooLarge);
    assert_eq!(published(), (5, 2));
    // Fill the two ring pages (stop mode, nobody reads): the rest is dropped.
    let mut dropped = 0;
    for i in 0..1000 {
        if w.write(1, 4 + i, &[2; 64]) == WriteOutcome::Dropped {
            dropped += 1;
        }
    }
    assert!(dropped > 0);
    assert_eq!(published(), (1005, 2));
    assert_eq!((w.attempted(), w.skipped()), (1005, 2));
    // Taken in: written or dropped; the too-large one is attempted and neither.
    assert_eq!(w.entries() + w.dropped() + w.skipped() + 1, w.attempted());
    let _ = w;
    let mut again = Writer::attach(&m, 0).unwrap();
    assert_eq!((again.attempted(), again.skipped()), (1005, 2));
    again.skip();
    assert_eq!(published(), (1006, 3));
}

#[test]
fn too_large_rejected_max_accepted() {
    let (m, _l) = region(4, Mode::Stop);
    let mut w = Writer::attach(&m, 0).unwrap();
    let max = w.max_payload();
    assert_eq!(
        w.write(0, 1, &std::vec![7u8; max + 1]),
        WriteOutcome::TooLarge
    );
    assert_eq!(w.write(0, 1, &std::vec![7u8; max]), WriteOutcome::Written);
    // The same after an event on the page (the write path's fast case): a payload
    // over the maximum is refused, never written across the page's end.
    assert_eq!(w.write(0, 2, &[1u8; 8]), WriteOutcome::Written);
    for len in [max + 1, max + 4, max + 5, 1 << 20] {
        let out = w.write(0, 3, &std::vec![7u8; len]);
        assert_eq!(out, WriteOutcome::TooLarge, "{len}");
    }
    assert_eq!(w.entries(), 2);
}

#[test]
fn stop_mode_drops_then_marks_the_next_page() {
    let (m, l) = region(3, Mode::Stop);
    let mut w = Writer::attach(&m, 0).unwrap();
    let payload = [0u8; 1000];
    let mut written = 0;
    let mut dropped = 0;
    for i in 0..20u64 {
        match w.write(0, i, &payload) {
            WriteOutcome::Written => written += 1,
            WriteOutcome::Dropped => dropped += 1,
            o => panic!("{o:?}"),
        }
    }
    // 2 ring pages x 3 events of 1004 bytes (3984-byte data area).
    assert_eq!((written, dropped), (6, 14));
    assert_one_each(&m, &l);
    // Reader page is empty and the writer is not on it: swap gets the head.
    let first = match swap_reader_page(&m, &l, 0).unwrap() {
        SwapStatus::Swapped { page } => page,
        s => panic!("{s:?}"),
    };
    assert_eq!(page_events(&m, &l, first).len(), 3);
    assert_one_each(&m, &l);
    // Now there is room again: the next page carries the drop marker and count.
    assert_eq!(w.write(0, 100, &payload), WriteOutcome::Written);
    let tail = m.load(l.ctl(0) + ctl::TAIL_PAGE, Relaxed) as u32;
    let tf = l.footer_off(tail);
    assert_eq!(m.load(tf + footer::MISSED, Relaxed), 14);
    assert_eq!(m.load(tf + footer::FIRST_INDEX, Relaxed), 20);
    assert_ne!(
        m.load(l.page_off(tail) + COMMIT_OFFSET, Relaxed) & RB_MISSED_EVENTS,
        0
    );
    assert_one_each(&m, &l);
}

#[test]
fn overwrite_counts_overrun_and_keeps_index_gaps_exact() {
    let (m, l) = region(4, Mode::Overwrite);
    let mut w = Writer::attach(&m, 0).unwrap();
    let payload = [0u8; 1000];
    for i in 0..40u64 {
        let mut p = payload;
        p[..8].copy_from_slice(&i.to_le_bytes());
        assert_eq!(w.write(0, i, &p), WriteOutcome::Written);
        assert_one_each(&m, &l);
    }
    // 3 ring pages: the last 3 pages hold the newest events; the rest were overwritten
    // (page by page: a full page holds 3 events).
    let overrun = w.overrun();
    assert!(overrun > 0);
    // Read everything the ring still has, through swaps, and check the gaps.
    let mut expected = 0u64;
    let mut read = 0u64;
    let mut lost = 0u64;
    while let SwapStatus::Swapped { page } = swap_reader_page(&m, &l, 0).unwrap() {
        assert_one_each(&m, &l);
        let first = m.load(l.footer_off(page) + footer::FIRST_INDEX, Relaxed);
        lost += first - expected;
        let ev = page_events(&m, &l, page);
        for (k, (_, seq)) in ev.iter().enumerate() {
            assert_eq!(*seq, first + k as u64);
        }
        read += ev.len() as u64;
        expected = first + ev.len() as u64;
        if reader_page(&m, &l) == m.load(l.ctl(0) + ctl::TAIL_PAGE, Relaxed) as u32 {
            break;
        }
    }
    assert_eq!(lost, overrun);
    assert_eq!(read + lost, 40);
}

#[test]
fn swap_is_busy_while_writer_on_reader_page() {
    let (m, l) = region(3, Mode::Stop);
    let mut w = Writer::attach(&m, 0).unwrap();
    w.write(0, 1, &[1; 8]);
    assert!(matches!(
        swap_reader_page(&m, &l, 0).unwrap(),
        SwapStatus::Swapped { .. }
    ));
    assert_eq!(swap_reader_page(&m, &l, 0).unwrap(), SwapStatus::Busy);
}

#[test]
fn mailbox_serves_swap_and_update() {
    let (m, l) = region(3, Mode::Stop);
    let mut w = Writer::attach(&m, 0).unwrap();
    w.write(0, 1, &[1; 8]);
    assert!(!w.serve_mailbox());
    m.store(l.ctl(0) + ctl::MBOX_REQ, (1 << 8) | MBOX_OP_SWAP, Release);
    assert!(w.serve_mailbox());
    assert_eq!(
        m.load(l.ctl(0) + ctl::MBOX_ACK, Acquire),
        (1 << 8) | MBOX_STATUS_OK
    );
    m.store(
        l.ctl(0) + ctl::MBOX_REQ,
        (2 << 8) | MBOX_OP_UPDATE_FOOTERS,
        Release,
    );
    assert!(w.serve_mailbox());
    assert_eq!(
        m.load(l.ctl(0) + ctl::MBOX_ACK, Acquire),
        (2 << 8) | MBOX_STATUS_OK
    );
    let f = l.footer_off(reader_page(&m, &l));
    assert_eq!(m.load(f + footer::ENTRIES, Relaxed), 1);
    m.store(l.ctl(0) + ctl::MBOX_REQ, (3 << 8) | MBOX_OP_SWAP, Release);
    assert!(w.serve_mailbox());
    assert_eq!(
        m.load(l.ctl(0) + ctl::MBOX_ACK, Acquire),
        (3 << 8) | MBOX_STATUS_BUSY
    );
}

#[test]
fn corrupt_links_are_errors_not_panics() {
    let (m, l) = region(3, Mode::Overwrite);
    let mut w = Writer::attach(&m, 0).unwrap();
    // Point the tail's link outside the CPU's pages.
    let tail = m.load(l.ctl(0) + ctl::TAIL_PAGE, Relaxed) as u32;
    m.store(l.footer_off(tail) + footer::NEXT, link(77, 0), Relaxed);
    let mut out = WriteOutcome::Written;
    for i in 0..10 {
        out = w.write(0, i, &[0u8; 1000]);
    }
    assert_eq!(out, WriteOutcome::Corrupt);
    // And stays so, small events too (they would fit the tail page).
    assert_eq!(w.write(0, 11, &[0u8; 8]), WriteOutcome::Corrupt);
    assert_eq!(swap_reader_page(&m, &l, 0), Err(RingError::BadPageId(77)));
    m.store(l.ctl(0) + ctl::READER_PAGE, 99, Relaxed);
    assert_eq!(swap_reader_page(&m, &l, 0), Err(RingError::BadPageId(99)));
    assert_eq!(update_footers(&m, &l, 0), Err(RingError::BadPageId(99)));
}
