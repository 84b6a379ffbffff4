//! Why `hyptrace bench` failed: one variant per failing operation, the source kept.

use hyptrace_abi::LayoutError;
use hyptrace_output::OutputError;
use hyptrace_reader::ReadError;
use hyptrace_writer::RingError;

use super::MAX_BENCH_PAYLOAD;
use crate::plan::PlanError;
use crate::report::RunReport;
use crate::run::RunError;
use crate::vcpu::VcpuOutcome;
use hyptrace_abi::guest::BENCH_CHUNK;

/// A failure of `hyptrace bench` (its options, or a measurement).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// `--vcpus` outside 1..=64.
    #[error("--vcpus {0}: must be 1..=64")]
    Vcpus(u32),
    /// `--payloads` above the bench workload's largest payload.
    #[error("--payloads {0}: at most {MAX_BENCH_PAYLOAD} bytes")]
    Payload(u32),
    /// `--events` below one chunk of the bench workload.
    #[error("--events {0}: at least {BENCH_CHUNK}")]
    Events(u64),
    /// `--reps 0`.
    #[error("--reps must be at least 1")]
    Reps,
    /// A run's options (ring geometry, guest memory) are refused.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The options of a VM run do not parse (`hyptrace run`'s, built by bench).
    #[error("run options: {0}")]
    RunArgs(#[source] clap::Error),
    /// A VM run could not start.
    #[error(transparent)]
    Run(#[from] RunError),
    /// A VM run failed while it ran (reading a ring, the output): the report's failures.
    #[error("{}", failures(.0))]
    RunFailed(Box<RunReport>),
    /// Creating or starting a VM failed.
    #[error(transparent)]
    Vm(#[from] crate::Error),
    /// The rings could not be set up in a VM's trace region.
    #[error("trace buffers: {0}")]
    TraceBuffers(#[source] ReadError),
    /// A vCPU did not finish its workload.
    #[error("vcpu {cpu}: {outcome:?}")]
    Vcpu {
        /// The vCPU.
        cpu: usize,
        /// How it ended.
        outcome: VcpuOutcome,
    },
    /// A host ring's geometry is refused (drain and native writer baselines).
    #[error(transparent)]
    Geometry(#[from] LayoutError),
    /// Attaching a writer to a host ring failed.
    #[error(transparent)]
    Writer(#[from] RingError),
    /// Reading a host ring failed (drain baseline).
    #[error(transparent)]
    Reader(#[from] ReadError),
    /// A page sink (file) failed.
    #[error(transparent)]
    Sink(#[from] OutputError),
    /// A swap of the `swap` section failed: an inconsistent ring.
    #[error("swap: {0}")]
    Swap(#[source] ReadError),
    /// The guest answered a mailbox swap with a failure.
    #[error("guest swap failed (status {0})")]
    GuestSwap(u64),
}

/// The failure lines of a run's report (`reading vcpu N: …`, `writing to the sink:
/// …`), without their `hyptrace: error: ` prefix, joined by `; `.
fn failures(r: &RunReport) -> String {
    let text = r.to_string();
    let lines: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("hyptrace: error: "))
        .collect();
    if lines.is_empty() {
        "the run failed".into()
    } else {
        lines.join("; ")
    }
}

/// `e`'s text followed by every source whose text it does not already carry.
pub(super) fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    // Bounded: error chains are finite, but a cycle would not be.
    for _ in 0..16 {
        let Some(src) = next else { break };
        let s = src.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        next = src.source();
    }
    text
}
