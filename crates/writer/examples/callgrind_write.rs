//! Instruction counts of the write path against the bound, for callgrind (stable where
//! time is not):
//!
//! ```text
//! cargo build --release -p hyptrace-writer --example callgrind_write
//! valgrind --tool=callgrind --toggle-collect='*write_loop*' \
//!     target/release/examples/callgrind_write 16        # or 256
//! valgrind --tool=callgrind --toggle-collect='*bound_loop*' \
//!     target/release/examples/callgrind_write 16
//! ```
//!
//! Both loops run [`EVENTS`] events: `rdtsc` + `Writer::write` on a `HeapMem` ring
//! (overwrite mode, 256 × 4 KiB pages, as `hyptrace bench` uses), and the bound: `rdtsc`
//! and a raw store of the 8-byte timestamp and the payload at a moving offset of a 1 MiB
//! buffer. Instructions per event = the collected total / [`EVENTS`].

use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::HeapMem;
use hyptrace_writer::Writer;
use std::hint::black_box;

/// Events per loop.
const EVENTS: u64 = 100_000;

fn rdtsc() -> u64 {
    // SAFETY: rdtsc has no preconditions on x86_64.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[inline(never)]
fn write_loop(w: &mut Writer<&HeapMem>, payload: &[u8]) {
    for _ in 0..EVENTS {
        let ts = rdtsc();
        black_box(w.write(0, ts, black_box(payload)));
    }
}

#[inline(never)]
fn bound_loop(buf: &mut [u8], payload: &[u8]) {
    let mut off = 0usize;
    let n = 8 + payload.len();
    for _ in 0..EVENTS {
        let ts = rdtsc();
        if off + n > buf.len() {
            off = 0;
        }
        buf[off..off + 8].copy_from_slice(&ts.to_le_bytes());
        buf[off + 8..off + n].copy_from_slice(black_box(payload));
        off += n;
    }
    black_box(buf);
}

fn main() {
    let size: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(16);
    let payload = vec![0x5au8; size];
    let l = RingGeometry::new(1, 256, 4096, Mode::Overwrite, false).expect("geometry");
    let mem = HeapMem::new(l.region_size);
    l.init_region(&mem, 1_000_000, 1);
    let mut w = Writer::attach(&mem, 0).expect("attach");
    write_loop(&mut w, &payload);
    let mut buf = vec![0u8; 1 << 20];
    bound_loop(&mut buf, &payload);
    println!("{} events written", w.entries());
}
