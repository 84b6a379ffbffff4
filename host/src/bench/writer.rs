//! `writer`: guest ns/event per payload size and vCPU count, from the guest's TSC (the
//! `bench` workload times its own write loop, chunk by chunk), against the same loop
//! run natively in host threads on a heap region of the same layout, against the bound
//! — one `rdtsc` plus a raw store of the same bytes — and against `rdtsc` alone.

use hyptrace_abi::events::MARKER_SLOT;
use hyptrace_abi::guest::{Workload, BENCH_CHUNK};
use hyptrace_abi::layout as ring;
use hyptrace_abi::{HeapMem, RawMem, SharedMem};
use hyptrace_writer::{WriteOutcome, Writer};
use serde::Serialize;

use super::harness::{vm_run, VmOut, VmSpec};
use super::stats::{Summary, Tsc};
use super::{bench_payload, BenchError, Cfg, DEFAULT_PAGES, PAGE_SIZE};
use crate::vmm::time::host_tsc;

/// The native typed loops ([`native_typed`]) for a `payload`-byte payload, or `None`
/// for a size the guest has no typed loop for (`BENCH_TYPED_SIZES`: a unit test keeps
/// the two lists equal).
fn native_typed_for(payload: u32, vcpus: u32, events: u64) -> Option<NativeTyped> {
    Some(match payload {
        0 => native_typed::<0>(vcpus, events),
        8 => native_typed::<8>(vcpus, events),
        16 => native_typed::<16>(vcpus, events),
        24 => native_typed::<24>(vcpus, events),
        32 => native_typed::<32>(vcpus, events),
        64 => native_typed::<64>(vcpus, events),
        128 => native_typed::<128>(vcpus, events),
        256 => native_typed::<256>(vcpus, events),
        _ => return None,
    })
}

/// What [`native_typed`] measured: the writer on each thread, and the bound.
type NativeTyped = (Vec<Result<Timing, BenchError>>, Timing);

/// One `writer` row: a vCPU count and payload size, ns/event.
#[derive(Clone, Debug, Serialize)]
pub(super) struct WriterRow {
    pub(super) vcpus: u32,
    pub(super) payload: u32,
    /// Bytes one event takes in the ring (header and padding included).
    pub(super) event_bytes: usize,
    /// The loops with the payload a slice whose length the writer learns at run time
    /// (the JSON keeps their fields at the row's top level).
    #[serde(flatten)]
    pub(super) slices: Loops,
    /// The guest's slice loop with no reader draining while it writes (`--drain none`):
    /// the writer alone, without the live reader's cache traffic on the ring.
    pub(super) guest_unread_ns: Summary,
    pub(super) guest_unread_mean_ns: Summary,
    pub(super) rdtsc_ns: Summary,
    /// The typed loops (`RUN_FLAG_BENCH_TYPED`: the payload's length a compile-time
    /// constant, as a typed event's), for the sizes in `BENCH_TYPED_SIZES`.
    pub(super) typed: Option<Loops>,
    /// native / guest (the slice loops' fastest chunks' medians): the guest's rate
    /// against native.
    pub(super) guest_rate_vs_native: f64,
}

/// The guest (under the live reader), native and bound loops of one payload kind,
/// ns/event: the fastest chunk and the whole loop's mean per run and vCPU.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Loops {
    pub(super) guest_ns: Summary,
    pub(super) guest_mean_ns: Summary,
    pub(super) native_ns: Summary,
    pub(super) native_mean_ns: Summary,
    pub(super) bound_ns: Summary,
    pub(super) bound_mean_ns: Summary,
    /// Fastest chunks' medians.
    pub(super) guest_vs_bound: f64,
    pub(super) native_vs_bound: f64,
}

/// `a / b`, 0 when `b` is not positive.
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Per-event ns of one timed loop: whole-loop means and fastest chunks.
#[derive(Default)]
struct Times {
    mean: Vec<f64>,
    best: Vec<f64>,
}

impl Times {
    fn push(&mut self, tsc: Tsc, events: u64, t: Timing) {
        let per_event = |cycles: u64, n: u64| tsc.ns(cycles as f64) / n.max(1) as f64;
        self.mean.push(per_event(t.cycles, events));
        self.best.push(per_event(t.min_chunk, BENCH_CHUNK));
    }

    /// Every vCPU's loop of a guest run.
    fn push_guest(&mut self, tsc: Tsc, events: u64, o: &VmOut) {
        for (&cycles, &min_chunk) in o.bench_cycles.iter().zip(&o.bench_min_chunk) {
            self.push(tsc, events, Timing { cycles, min_chunk });
        }
    }
}

/// The samples of one payload kind's guest, native and bound loops.
#[derive(Default)]
struct LoopSamples {
    guest: Times,
    native: Times,
    bound: Times,
}

impl LoopSamples {
    /// The summaries, with a progress line named `what`.
    fn loops(&self, what: &str) -> Loops {
        let (guest_ns, native_ns, bound_ns) = (
            Summary::of(&self.guest.best),
            Summary::of(&self.native.best),
            Summary::of(&self.bound.best),
        );
        let (g, n, b) = (guest_ns.median, native_ns.median, bound_ns.median);
        eprintln!("  {what}: guest {g:6.2} ns  native {n:6.2} ns  bound {b:6.2} ns");
        Loops {
            guest_ns,
            guest_mean_ns: Summary::of(&self.guest.mean),
            native_ns,
            native_mean_ns: Summary::of(&self.native.mean),
            bound_ns,
            bound_mean_ns: Summary::of(&self.bound.mean),
            guest_vs_bound: ratio(g, b),
            native_vs_bound: ratio(n, b),
        }
    }
}

/// Per-event ns of every measurement of one row.
#[derive(Default)]
struct Samples {
    slices: LoopSamples,
    unread: Times,
    rdtsc: Times,
    typed: LoopSamples,
}

/// The guest's bench loop as the writer rows run it: flat out, overwrite mode (a full
/// ring never stops the writer), host swaps, the default rings, a live reader into no
/// file.
pub(super) fn writer_spec(vcpus: u32, payload: u32) -> VmSpec {
    VmSpec {
        vcpus,
        workload: Workload::Bench,
        payload,
        ..VmSpec::default()
    }
}

/// One repetition of a row: the guest in a VM, then natively on as many threads, the
/// bound and rdtsc; the same for the typed loops where the payload size has one.
fn measure(
    cfg: &Cfg,
    tsc: Tsc,
    vcpus: u32,
    payload: u32,
    s: &mut Samples,
) -> Result<(), BenchError> {
    let n = cfg.events;
    let spec = VmSpec {
        events: n,
        ..writer_spec(vcpus, payload)
    };
    s.slices.guest.push_guest(tsc, n, &vm_run(&spec)?);
    // The same loop with no reader while it runs (the rings are read at the end): what
    // the live reader's own memory traffic costs the writer is the difference.
    let unread = VmSpec {
        drain_live: false,
        ..spec
    };
    s.unread.push_guest(tsc, n, &vm_run(&unread)?);
    for t in on_threads(vcpus, || native_writer(payload, n)) {
        s.slices.native.push(tsc, n, t?);
    }
    s.slices.bound.push(tsc, n, native_bound(payload, n));
    let rdtsc_events = n.min(1 << 20);
    s.rdtsc.push(tsc, rdtsc_events, native_rdtsc(rdtsc_events));
    if let Some((writers, bound)) = native_typed_for(payload, vcpus, n) {
        for t in writers {
            s.typed.native.push(tsc, n, t?);
        }
        s.typed.bound.push(tsc, n, bound);
        let typed = VmSpec {
            typed: true,
            ..spec
        };
        s.typed.guest.push_guest(tsc, n, &vm_run(&typed)?);
    }
    Ok(())
}

/// The `writer` rows: every vCPU count × payload size, `reps` times each.
pub(super) fn writer_section(cfg: &Cfg, tsc: Tsc) -> Result<Vec<WriterRow>, BenchError> {
    let mut rows = Vec::new();
    for &v in &cfg.vcpus {
        for &p in &cfg.payloads {
            let mut s = Samples::default();
            for _ in 0..cfg.reps {
                measure(cfg, tsc, v, p, &mut s)?;
            }
            let what = format!("vcpus {v} payload {p:>4}");
            let slices = s.slices.loops(&what);
            let typed =
                (!s.typed.guest.best.is_empty()).then(|| s.typed.loops(&format!("{what}: typed")));
            rows.push(WriterRow {
                vcpus: v,
                payload: p,
                event_bytes: hyptrace_abi::page::data_event_size(p as usize),
                guest_rate_vs_native: ratio(slices.native_ns.median, slices.guest_ns.median),
                slices,
                guest_unread_ns: Summary::of(&s.unread.best),
                guest_unread_mean_ns: Summary::of(&s.unread.mean),
                rdtsc_ns: Summary::of(&s.rdtsc.best),
                typed,
            });
        }
    }
    Ok(rows)
}

/// Cycles of a timed loop: the whole and the fastest full chunk.
#[derive(Clone, Copy, Debug)]
pub(super) struct Timing {
    pub(super) cycles: u64,
    pub(super) min_chunk: u64,
}

/// Runs `one` `events` times in chunks of [`BENCH_CHUNK`], timed with the TSC, exactly
/// as the guest's bench workload does.
#[inline(always)]
fn timed_loop(events: u64, mut one: impl FnMut()) -> Timing {
    let mut min_chunk = u64::MAX;
    let mut i = 0;
    let t0 = host_tsc();
    while i < events {
        let end = (i + BENCH_CHUNK).min(events);
        let full = end - i == BENCH_CHUNK;
        let c0 = host_tsc();
        while i < end {
            one();
            i += 1;
        }
        let c = host_tsc().wrapping_sub(c0);
        if full && c < min_chunk {
            min_chunk = c;
        }
    }
    Timing {
        cycles: host_tsc().wrapping_sub(t0),
        min_chunk: if min_chunk == u64::MAX { 0 } else { min_chunk },
    }
}

/// The guest's loop run natively: the same `Writer` on raw memory (a heap region of
/// the guest's layout, overwrite mode), with the guest's emit path (rdtsc, write: the
/// writer counts the attempt and a skipped event itself, R3).
pub(super) fn native_writer(payload: u32, events: u64) -> Result<Timing, BenchError> {
    let p = bench_payload(payload);
    native_loop(events, |w, ts| {
        w.write(MARKER_SLOT, ts, std::hint::black_box(p.as_slice()))
    })
}

/// The typed loops natively, with an `N`-byte payload whose length is a constant, as
/// the guest's typed loop (`RUN_FLAG_BENCH_TYPED`) writes it: [`native_writer`]'s loop
/// on `vcpus` threads, then [`native_bound`]'s with the same constant-length copy.
fn native_typed<const N: usize>(vcpus: u32, events: u64) -> NativeTyped {
    let p: [u8; N] = std::array::from_fn(|i| i as u8);
    let writers = on_threads(vcpus, || {
        native_loop(events, |w, ts| {
            w.write(MARKER_SLOT, ts, &std::hint::black_box(&p)[..])
        })
    });
    let bound = bound_loop(events, N, |dst| {
        dst.copy_from_slice(std::hint::black_box(&p))
    });
    (writers, bound)
}

/// The loop of [`native_writer`]: `write(writer, rdtsc)` per event.
#[inline(always)]
fn native_loop(
    events: u64,
    mut write: impl FnMut(&mut Writer<RawMem>, u64) -> WriteOutcome,
) -> Result<Timing, BenchError> {
    let l = ring::RingGeometry::new(
        1,
        DEFAULT_PAGES as u32,
        PAGE_SIZE as usize,
        ring::Mode::Overwrite,
        false,
    )?;
    let heap = HeapMem::new(l.region_size);
    l.init_region(&heap, 1_000_000, 1);
    // SAFETY: `heap` owns `size()` bytes at `as_ptr()`, 8-aligned, and outlives the
    // writer (both are dropped at the end of this function, the writer first); it is
    // only accessed through this RawMem and `heap`'s own atomics/byte copies.
    let raw = unsafe { RawMem::new(heap.as_ptr(), heap.size()) };
    let mut w = Writer::attach(raw, 0)?;
    let t = timed_loop(events, || {
        let ts = host_tsc();
        std::hint::black_box(write(&mut w, ts));
    });
    Ok(t)
}

/// The bound: one rdtsc plus a raw store of the timestamp and the same payload bytes
/// into a buffer of the ring's size, at a moving offset.
pub(super) fn native_bound(payload: u32, events: u64) -> Timing {
    let p = bench_payload(payload);
    bound_loop(events, p.len(), |dst| {
        dst.copy_from_slice(std::hint::black_box(p.as_slice()))
    })
}

/// The loop of [`native_bound`]: the timestamp, then `copy` of the payload into the
/// `payload`-byte slice after it.
#[inline(always)]
fn bound_loop(events: u64, payload: usize, mut copy: impl FnMut(&mut [u8])) -> Timing {
    let len = (DEFAULT_PAGES * PAGE_SIZE) as usize;
    let mut buf = vec![0u8; len];
    let need = 8 + payload;
    let mut off = 0usize;
    let t = timed_loop(events, || {
        if off + need > len {
            off = 0;
        }
        buf[off..off + 8].copy_from_slice(&host_tsc().to_le_bytes());
        copy(&mut buf[off + 8..off + need]);
        off += need;
        std::hint::black_box(&buf);
    });
    std::hint::black_box(&buf);
    t
}

/// `rdtsc` alone.
fn native_rdtsc(events: u64) -> Timing {
    let mut acc = 0u64;
    let t = timed_loop(events, || acc = acc.wrapping_add(host_tsc()));
    std::hint::black_box(acc);
    t
}

/// Runs `f` on `n` threads at once; returns their results.
fn on_threads<T: Send>(n: u32, f: impl Fn() -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n).map(|_| s.spawn(&f)).collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyptrace_abi::guest::BENCH_TYPED_SIZES;

    #[test]
    fn native_loops_run() {
        let t = native_writer(16, 4 * BENCH_CHUNK).expect("native");
        assert!(t.cycles >= t.min_chunk);
        assert!(native_bound(16, BENCH_CHUNK).cycles > 0);
    }

    /// Every size the guest has a typed loop for has a native one and a bound, and no
    /// other size does (the guest panics on one: the host must never ask).
    #[test]
    fn typed_loops_cover_the_guest_sizes() {
        for p in 0..=300u32 {
            let t = native_typed_for(p, 1, BENCH_CHUNK);
            assert_eq!(t.is_some(), BENCH_TYPED_SIZES.contains(&p), "{p}");
            if let Some((w, b)) = t {
                assert_eq!(w.len(), 1, "{p}");
                for w in w {
                    let w = w.expect("typed writer");
                    assert!(w.cycles >= w.min_chunk && w.min_chunk > 0, "{p}");
                }
                assert!(b.cycles > 0, "{p}");
            }
        }
    }
}
