//! Why `hyptrace bench` failed: one variant per failing operation, the source kept.

use hyptrace_abi::LayoutError;
use hyptrace_output::OutputError;
use hyptrace_reader::ReadError;
use hyptrace_writer::RingError;

use super::MAX_BENCH_PAYLOAD;
use crate::control::server::CtlError;
use crate::drain::session::SessionError;
use crate::pipeline::plan::PlanError;
use crate::pipeline::report::RunReport;
use crate::pipeline::run::RunError;
use crate::vmm::vcpu::VcpuOutcome;
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
    /// `--criterion DIR` holds no results.
    #[error("--criterion {}: no criterion results under it (no */new/estimates.json; run `cargo bench` with the same CARGO_TARGET_DIR first)", .0.display())]
    NoCriterion(std::path::PathBuf),
    /// `--reps 0`.
    #[error("--reps must be at least 1")]
    Reps,
    /// A run's options (ring geometry, guest memory) are refused.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A VM run could not start.
    #[error(transparent)]
    Run(#[from] RunError),
    /// A VM run failed while it ran (reading a ring, the output): the report's failures.
    #[error("{}", failures(.0))]
    RunFailed(Box<RunReport>),
    /// Creating or starting a VM failed.
    #[error(transparent)]
    Vm(#[from] crate::vmm::error::Error),
    /// The rings could not be set up in a VM's trace region.
    #[error("trace buffers")]
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
    #[error("swap")]
    Swap(#[source] ReadError),
    /// A temporary file for a run's output could not be created.
    #[error("temporary file")]
    TempFile(#[source] std::io::Error),
    /// A temporary output path refused.
    #[error(transparent)]
    Destination(#[from] crate::drain::sink::DestinationError),
    /// The guest answered a mailbox swap with a failure.
    #[error("guest swap failed (status {0})")]
    GuestSwap(u64),
    /// The subscriber row's control socket could not be set up.
    #[error(transparent)]
    Control(#[from] crate::control::server::ControlError),
    /// The sustained section's flat-out runs measured no guest rate (no guest cycles).
    #[error("sustained records: the flat-out runs measured no guest rate")]
    NoFlatOut,
    /// The subscriber row failed.
    #[error("the bench's subscriber")]
    Subscriber(#[source] SubscriberError),
}

/// Why the subscriber row's run failed: its client, or the session serving it.
#[derive(Debug, thiserror::Error)]
pub enum SubscriberError {
    /// The client thread could not start.
    #[error("cannot start its thread")]
    Thread(#[source] std::io::Error),
    /// The client thread panicked.
    #[error("its thread panicked")]
    Panicked,
    /// A request to the bench's control socket failed.
    #[error("{request}")]
    Control {
        /// Which request.
        request: &'static str,
        /// Why.
        #[source]
        source: CtlError,
    },
    /// An answer of another kind than its request asks for.
    #[error("{request}: answered {got}")]
    Answer {
        /// Which request.
        request: &'static str,
        /// What came instead (its debug form).
        got: String,
    },
    /// A piece that runs past its batch's bytes.
    #[error("a piece past its batch")]
    PiecePastBatch,
    /// A piece whose events are not as many as it says.
    #[error("a piece of {counted} events says {said}")]
    PieceCount {
        /// Events counted in it.
        counted: u64,
        /// Events it says.
        said: u64,
    },
    /// The session serving the subscriber failed on a CPU.
    #[error("cpu {cpu}")]
    Session {
        /// The CPU.
        cpu: u32,
        /// Why.
        #[source]
        source: SessionError,
    },
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A wrapper whose text does not carry its source.
    #[derive(Debug, thiserror::Error)]
    #[error("cannot write --json")]
    struct Bare(#[source] OutputError);

    #[test]
    fn sources_appear_once_in_the_text() {
        let io = || std::io::Error::from_raw_os_error(28); // ENOSPC
        let e = BenchError::Sink(OutputError::Io {
            path: Some("/tmp/x.raw".into()),
            source: io(),
        });
        // The variant's text names the path; the chain adds the OS error, once each.
        let text = crate::exit::chain(&e);
        assert_eq!(text, format!("/tmp/x.raw: {}", io()));
        // A text without its source gets the chain appended, down to the OS error.
        let b = Bare(OutputError::Io {
            path: None,
            source: io(),
        });
        let text = crate::exit::chain(&b);
        assert!(text.starts_with("cannot write --json: "), "{text}");
        assert!(text.contains(&io().to_string()), "{text}");
        assert_eq!(text.matches(&io().to_string()).count(), 1, "{text}");
    }

    #[test]
    fn option_errors_name_the_flag_and_the_limit() {
        assert_eq!(
            BenchError::Vcpus(0).to_string(),
            "--vcpus 0: must be 1..=64"
        );
        assert_eq!(
            BenchError::Payload(4096).to_string(),
            format!("--payloads 4096: at most {MAX_BENCH_PAYLOAD} bytes")
        );
        assert_eq!(
            BenchError::Events(1).to_string(),
            format!("--events 1: at least {BENCH_CHUNK}")
        );
        assert_eq!(BenchError::Reps.to_string(), "--reps must be at least 1");
        assert_eq!(
            BenchError::GuestSwap(7).to_string(),
            "guest swap failed (status 7)"
        );
    }
}
