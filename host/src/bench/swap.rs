//! `swap`: `swap_reader` latency, no exits either way. *Alone* ([`swap_pingpong`]): one
//! swap every 150 µs against a steady writer, host-executed (`Direct`) or a mailbox
//! round trip served by the guest. *Live drain* ([`swap_live`]): every `swap_reader`
//! call of a real `record`-style drain, timed inside the callbacks.

use std::time::{Duration, Instant};

use hyptrace_reader::{Callbacks, MailboxOp, MailboxPort, MailboxStatus, SwapReply, SwapStatus};
use serde::Serialize;

use super::harness::{swapper, vm_run, SwapLog, VmSpec};
use super::stats::{Quantiles, Tsc};
use super::{plan, BenchError, Cfg, Measured, DEFAULT_PAGES};
use crate::vmm::time::host_tsc;
use crate::vmm::vm::Vm;

/// The `swap` JSON object; a section not run is `{}` in each.
#[derive(Clone, Debug, Serialize)]
pub(super) struct SwapReport {
    /// Host-executed, alone.
    pub(super) host: Measured<PingPongRow>,
    /// Guest-executed (mailbox round trip), alone.
    pub(super) guest: Measured<PingPongRow>,
    pub(super) host_live_drain: Measured<LiveSwapRow>,
    pub(super) guest_live_drain: Measured<LiveSwapRow>,
}

impl SwapReport {
    /// The rows of the table, in order, with their names.
    pub(super) fn latencies(&self) -> [(&'static str, Option<&SwapLatency>); 4] {
        [
            ("host", self.host.get().map(|r| &r.latency)),
            ("guest", self.guest.get().map(|r| &r.latency)),
            (
                "host_live_drain",
                self.host_live_drain.get().map(|r| &r.latency),
            ),
            (
                "guest_live_drain",
                self.guest_live_drain.get().map(|r| &r.latency),
            ),
        ]
    }
}

/// What every swap row reports: the latency of the swaps that moved a page, ns.
#[derive(Clone, Debug, Serialize)]
pub(super) struct SwapLatency {
    /// `host` or `guest`.
    pub(super) mode: String,
    /// Swaps that moved a page (the timed ones).
    pub(super) swapped: usize,
    pub(super) median_ns: f64,
    pub(super) p10_ns: f64,
    pub(super) p90_ns: f64,
    pub(super) p99_ns: f64,
    pub(super) max_ns: f64,
    /// Requests not answered: alone, within 50 ms (the run stops there); live, within
    /// the mailbox's spin (`MAILBOX_SPIN`, 3 µs) (picked up at a later call).
    pub(super) pending: u64,
}

impl SwapLatency {
    fn new(guest_swap: bool, ns: &Quantiles, pending: u64) -> Self {
        Self {
            mode: swapper(guest_swap).into(),
            swapped: ns.len(),
            median_ns: ns.median(),
            p10_ns: ns.quantile(0.10),
            p90_ns: ns.quantile(0.90),
            p99_ns: ns.quantile(0.99),
            max_ns: ns.max().unwrap_or(0.0).max(0.0),
            pending,
        }
    }
}

/// A swap every 150 µs, measured alone.
#[derive(Clone, Debug, Serialize)]
pub(super) struct PingPongRow {
    #[serde(flatten)]
    pub(super) latency: SwapLatency,
    /// Answered busy (nothing to swap yet).
    pub(super) busy: u64,
    /// Lost every attempt to the writer (`Contended`): not timed.
    pub(super) transient_failures: u64,
    pub(super) workload: PingPongWorkload,
}

/// The writer of [`PingPongRow`].
#[derive(Clone, Debug, Serialize)]
pub(super) struct PingPongWorkload {
    pub(super) rate: u64,
    pub(super) ring_pages: u64,
    pub(super) interval_us: u64,
}

/// Every swap of a live drain.
#[derive(Clone, Debug, Serialize)]
pub(super) struct LiveSwapRow {
    #[serde(flatten)]
    pub(super) latency: SwapLatency,
    /// Fastest swap (`f64::MAX` when none).
    pub(super) min_ns: f64,
    /// Calls that changed nothing (busy or contended), timed apart.
    pub(super) busy: usize,
    pub(super) busy_median_ns: f64,
    /// Calls that only picked up the answer to an earlier pending request (not timed).
    pub(super) answered_after_pending: u64,
    pub(super) errors: u64,
    pub(super) wall_seconds: f64,
    pub(super) workload: LiveWorkload,
}

/// The writer of [`LiveSwapRow`].
#[derive(Clone, Debug, Serialize)]
pub(super) struct LiveWorkload {
    pub(super) rate: u64,
    pub(super) events: u64,
    pub(super) ring_pages: u64,
}

/// Both modes, alone and live.
pub(super) fn swap_section(cfg: &Cfg, tsc: Tsc) -> Result<SwapReport, BenchError> {
    Ok(SwapReport {
        host: Measured::Ran(swap_pingpong(cfg, tsc, false)?),
        guest: Measured::Ran(swap_pingpong(cfg, tsc, true)?),
        host_live_drain: Measured::Ran(swap_live(cfg, tsc, false)?),
        guest_live_drain: Measured::Ran(swap_live(cfg, tsc, true)?),
    })
}

/// Every `swap_reader` call of a `record`-style drain of a steady writer, timed.
fn swap_live(cfg: &Cfg, tsc: Tsc, guest_swap: bool) -> Result<LiveSwapRow, BenchError> {
    let mut log = SwapLog::default();
    let mut wall = 0.0;
    for _ in 0..cfg.reps.min(3) {
        // A steady writer the reader keeps up with: every swap takes one full page the
        // reader has just been waiting for (the common case; the head search is the
        // longest then).
        let o = vm_run(&VmSpec {
            events: cfg.swap_events,
            rate: cfg.swap_rate,
            guest_swap,
            time_swaps: true,
            ..VmSpec::default()
        })?;
        wall += o.wall.as_secs_f64();
        let s = o.swaps;
        log.swapped.extend(s.swapped);
        log.busy.extend(s.busy);
        log.pending += s.pending;
        log.after_pending += s.after_pending;
        log.errors += s.errors;
    }
    let ns: Vec<f64> = log.swapped.iter().map(|&c| tsc.ns(c as f64)).collect();
    let busy: Vec<f64> = log.busy.iter().map(|&c| tsc.ns(c as f64)).collect();
    let q = Quantiles::new(&ns);
    eprintln!(
        "  {:?}: {} swaps, median {:.0} ns, p99 {:.0} ns, {} pending",
        guest_swap,
        q.len(),
        q.median(),
        q.quantile(0.99),
        log.pending
    );
    Ok(LiveSwapRow {
        latency: SwapLatency::new(guest_swap, &q, log.pending),
        min_ns: q.min().unwrap_or(f64::MAX),
        busy: busy.len(),
        busy_median_ns: Quantiles::new(&busy).median(),
        answered_after_pending: log.after_pending,
        errors: log.errors,
        wall_seconds: wall,
        workload: LiveWorkload {
            rate: cfg.swap_rate,
            events: cfg.swap_events,
            ring_pages: DEFAULT_PAGES,
        },
    })
}

/// How one swap of [`swap_pingpong`] ended.
enum Alone {
    Swapped,
    Busy,
    /// The writer won every attempt: nothing changed.
    Contended,
    /// The guest did not answer within 50 ms.
    Unanswered,
}

/// Spins until the guest answers request `seq` or 50 ms passed.
fn await_answer(
    port: &MailboxPort<impl hyptrace_abi::SharedMem>,
    seq: hyptrace_reader::MailboxSeq,
) -> Result<Option<MailboxStatus>, BenchError> {
    let deadline = Instant::now() + Duration::from_millis(50);
    loop {
        if let Some(status) = port.poll(0, seq).map_err(BenchError::Swap)? {
            return Ok(Some(status));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        std::hint::spin_loop();
    }
}

/// One swap at a time, measured alone: a steady writer in a VM fills pages; every
/// ~150 µs the host swaps — itself on guest memory (`Direct`, the reader's own
/// callbacks), or by posting a request in the mailbox ([`MailboxPort`]) and spinning
/// until the guest's acknowledgement (without `Mailbox`'s give-up after its spin, so a round
/// trip is timed even when the vCPU thread was descheduled). No exits either way.
fn swap_pingpong(cfg: &Cfg, tsc: Tsc, guest_swap: bool) -> Result<PingPongRow, BenchError> {
    let mut plan = plan(&VmSpec {
        events: 1,
        rate: cfg.swap_rate,
        guest_swap,
        ..VmSpec::default()
    })?;
    plan.params.events = u64::MAX;
    let layout = plan.ring;
    // Its own VM start, not `Run`: the benchmark drives the swaps itself (no session).
    let vm = Vm::new(plan.cfg)?;
    let reader = crate::vmm::guest_mem::alloc_reader(
        vm.trace_region(),
        layout,
        vm.tsc_khz(),
        1,
        plan.mailbox_timeout,
    )
    .map_err(BenchError::TraceBuffers)?;
    let samples = if cfg.quick { 200 } else { 3000 };
    let running = vm.start(&plan.params)?;
    let port = MailboxPort::new(reader.mem().clone(), layout);
    let (mut swapped, mut busy, mut timeouts, mut transient) = (Vec::new(), 0u64, 0u64, 0u64);
    // Let the guest attach its writer first.
    std::thread::sleep(Duration::from_millis(20));
    let mut tries = 0;
    while swapped.len() < samples && tries < samples * 4 && !running.is_finished() {
        tries += 1;
        let until = Instant::now() + Duration::from_micros(150);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
        let t = host_tsc();
        let outcome = match guest_swap {
            false => match reader.callbacks().swap_reader(0) {
                Ok(SwapReply::Done(SwapStatus::Swapped { .. })) => Alone::Swapped,
                // The overwriting writer kept pushing the head under every attempt.
                Ok(SwapReply::Done(SwapStatus::Contended)) => {
                    transient += 1;
                    continue;
                }
                Ok(SwapReply::Done(SwapStatus::Busy) | SwapReply::Pending) => Alone::Busy,
                Err(e) => return Err(BenchError::Swap(e)),
            },
            true => {
                let seq = port.post(0, MailboxOp::Swap).map_err(BenchError::Swap)?;
                match await_answer(&port, seq)? {
                    Some(MailboxStatus::Ok) => Alone::Swapped,
                    Some(MailboxStatus::Busy) => Alone::Busy,
                    Some(MailboxStatus::Contended) => Alone::Contended,
                    Some(MailboxStatus::Failed(s)) => return Err(BenchError::GuestSwap(s)),
                    None => Alone::Unanswered,
                }
            }
        };
        let dt = host_tsc().wrapping_sub(t);
        match outcome {
            Alone::Swapped => swapped.push(tsc.ns(dt as f64)),
            Alone::Busy => busy += 1,
            Alone::Contended => transient += 1,
            Alone::Unanswered => {
                timeouts += 1;
                break;
            }
        }
    }
    running.stop();
    let _ = running.wait();
    let q = Quantiles::new(&swapped);
    eprintln!(
        "  {} alone: {} swaps, median {:.0} ns, p99 {:.0} ns",
        swapper(guest_swap),
        q.len(),
        q.median(),
        q.quantile(0.99)
    );
    Ok(PingPongRow {
        latency: SwapLatency::new(guest_swap, &q, timeouts),
        busy,
        transient_failures: transient,
        workload: PingPongWorkload {
            rate: cfg.swap_rate,
            ring_pages: DEFAULT_PAGES,
            interval_us: 150,
        },
    })
}
