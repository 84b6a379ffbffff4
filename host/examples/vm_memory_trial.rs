//! Trial (issue 10, item 6): the host's access to guest memory through vm-memory's
//! volatile/atomic API instead of the hand-made `RawMem` mapping.
//!
//! Both `SharedMem` impls work on the same anonymous `GuestMemoryMmap`:
//! - `RawMem` over the region's host address (what `GuestTraceMem` uses);
//! - `VmMem`: word loads/stores through `Bytes::load/store` (vm-memory's `AtomicAccess`),
//!   read-modify-writes through `VolatileSlice::get_atomic_ref::<AtomicU64>`, byte copies
//!   through `VolatileSlice::copy_to/copy_from`.
//!
//! It runs the workload of `crates/reader/benches/read.rs` (a 64-page stop-mode ring of
//! 4 KiB pages filled with 32-byte events, read to the end with `next_event`, or with
//! `next_page`), the two impls interleaved round by round in one process, and prints the
//! median time of each and the ratio vm-memory / RawMem (> 1: vm-memory slower).
//!
//! `cargo run --release -p hyptrace-host --example vm_memory_trial [ROUNDS]`
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyptrace_abi::layout::{Mode, RingGeometry};
use hyptrace_abi::{RawMem, SharedMem};
use hyptrace_reader::{Direct, Item, RingBuffer};
use hyptrace_writer::{WriteOutcome, Writer};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, VolatileMemory};

const PAGES: u32 = 64;
const PAYLOAD: usize = 32;

/// The trace region through vm-memory: every access is bounds-checked by vm-memory
/// (region lookup, slice) as well as here.
struct VmMem {
    mem: GuestMemoryMmap,
    base: u64,
    size: usize,
}

impl VmMem {
    fn addr(&self, off: usize, len: usize) -> GuestAddress {
        assert!(
            off <= self.size && self.size - off >= len,
            "offset {off:#x}+{len}"
        );
        GuestAddress(self.base + off as u64)
    }

    fn rmw<R>(&self, off: usize, f: impl FnOnce(&AtomicU64) -> R) -> R {
        let s = self
            .mem
            .get_slice(self.addr(off, 8), 8)
            .expect("mapped word");
        f(s.get_atomic_ref::<AtomicU64>(0).expect("aligned word"))
    }
}

impl SharedMem for VmMem {
    fn size(&self) -> usize {
        self.size
    }
    fn load(&self, off: usize, order: Ordering) -> u64 {
        self.mem.load(self.addr(off, 8), order).expect("load")
    }
    fn store(&self, off: usize, val: u64, order: Ordering) {
        self.mem
            .store(val, self.addr(off, 8), order)
            .expect("store")
    }
    fn swap(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.rmw(off, |w| w.swap(val, order))
    }
    fn compare_exchange(
        &self,
        off: usize,
        current: u64,
        new: u64,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u64, u64> {
        self.rmw(off, |w| w.compare_exchange(current, new, success, failure))
    }
    fn fetch_or(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.rmw(off, |w| w.fetch_or(val, order))
    }
    fn fetch_and(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.rmw(off, |w| w.fetch_and(val, order))
    }
    fn fetch_add(&self, off: usize, val: u64, order: Ordering) -> u64 {
        self.rmw(off, |w| w.fetch_add(val, order))
    }
    fn write_bytes(&self, off: usize, src: &[u8]) {
        let s = self
            .mem
            .get_slice(self.addr(off, src.len()), src.len())
            .expect("mapped range");
        s.copy_from(src);
    }
    fn read_bytes(&self, off: usize, dst: &mut [u8]) {
        let s = self
            .mem
            .get_slice(self.addr(off, dst.len()), dst.len())
            .expect("mapped range");
        let n = s.copy_to(dst);
        assert_eq!(n, dst.len());
    }
}

/// Fills a fresh ring in `mem` and reads it to the end; returns the time of the read.
fn round<M: SharedMem + Clone>(mem: M, l: RingGeometry, pages: bool) -> (Duration, u64) {
    let mut rb = RingBuffer::alloc(mem.clone(), l, Direct::new(mem.clone(), l), 1_000_000, 1)
        .expect("alloc");
    let mut w = Writer::attach(mem, 0).expect("attach");
    let mut p = [0u8; PAYLOAD];
    let mut ts = 1_000u64;
    loop {
        ts += 37;
        p[..8].copy_from_slice(&ts.to_le_bytes());
        if w.write(0, ts, &p) != WriteOutcome::Written {
            break;
        }
    }
    let t = Instant::now();
    let mut n = 0u64;
    if pages {
        while let Some(pg) = rb.next_page(0).expect("read") {
            std::hint::black_box(pg.bytes);
            n += 1;
        }
    } else {
        while let Some(it) = rb.next_event(0).expect("read") {
            if let Item::Event { ts, payload } = it {
                std::hint::black_box((ts, payload));
                n += 1;
            }
        }
    }
    (t.elapsed(), n)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(400);
    let l = RingGeometry::new(1, PAGES + 1, 4096, Mode::Stop, false).expect("layout");
    let size = l.region_size.next_multiple_of(4096);
    let base = 0x20_0000u64;
    let gm = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(base), size)]).expect("mmap");
    let host = gm
        .get_host_address(GuestAddress(base))
        .expect("host address");
    // SAFETY: `host` maps `size` bytes of `gm` (one anonymous region), page-aligned;
    // `gm` lives (its clone in `vm`, and `gm` itself) until the end of main, after the
    // last use of `raw`. Both impls access the bytes only through atomics and volatile
    // or plain copies, one round at a time.
    let raw = Arc::new(unsafe { RawMem::new(host, l.region_size) });
    let vm = Arc::new(VmMem {
        mem: gm.clone(),
        base,
        size: l.region_size,
    });
    for (name, pages) in [("next_event", false), ("next_page", true)] {
        let (mut t_raw, mut t_vm) = (Vec::new(), Vec::new());
        let mut items = 0;
        for i in 0..rounds {
            // Interleaved, alternating which goes first.
            let order: [bool; 2] = if i % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for use_vm in order {
                let (t, n) = if use_vm {
                    round(vm.clone(), l, pages)
                } else {
                    round(raw.clone(), l, pages)
                };
                items = n;
                if use_vm {
                    t_vm.push(t);
                } else {
                    t_raw.push(t);
                }
            }
        }
        let (r, v) = (median(t_raw), median(t_vm));
        println!(
            "read/{name}: {items} items/round, {rounds} rounds: RawMem {:.1} ns/item, vm-memory {:.1} ns/item, ratio vm-memory/RawMem {:.2}",
            r.as_nanos() as f64 / items as f64,
            v.as_nanos() as f64 / items as f64,
            v.as_secs_f64() / r.as_secs_f64()
        );
    }
    drop(gm);
}
