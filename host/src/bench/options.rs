//! The options of `hyptrace bench` and `hyptrace bench report` as the user gives them
//! (clap derives them); `Cfg` (private) turns them into the bench's own configuration.

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

use super::Section;

/// Options of `hyptrace bench`.
#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// A tiny smoke run (one vCPU count, one payload, one repetition, short searches).
    #[arg(long)]
    pub quick: bool,
    /// Write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// vCPU counts of the writer runs [default: 1,2; --quick: 1].
    #[arg(long, value_name = "N,..", value_delimiter = ',')]
    pub vcpus: Vec<u32>,
    /// Payload sizes in bytes of the writer runs [default: 0,8,16,64,256; --quick: 16].
    #[arg(long, value_name = "B,..", value_delimiter = ',')]
    pub payloads: Vec<u32>,
    /// Events per vCPU per writer run [default: 1000000; --quick: 100000].
    #[arg(long, value_name = "N")]
    pub events: Option<u64>,
    /// Repetitions of every measurement [default: 5; --quick: 1].
    #[arg(long, value_name = "N")]
    pub reps: Option<u32>,
    /// Also import criterion's results from DIR (e.g. target/criterion after `cargo
    /// bench`): medians of the rtrb, raw-store and rdtsc baselines etc. go into the JSON.
    #[arg(long, value_name = "DIR")]
    pub criterion: Option<PathBuf>,
    /// Only these sections (startup always runs: it measures the TSC frequency)
    /// [default: all].
    #[arg(long, value_enum, value_name = "S,..", value_delimiter = ',')]
    pub only: Vec<SectionArg>,
    /// A benchmark of its own instead of the sections above.
    #[command(subcommand)]
    pub what: Option<BenchWhat>,
}

/// Benchmarks run on their own.
#[derive(Clone, Debug, Subcommand)]
pub enum BenchWhat {
    /// `hyptrace report FILE` against `trace-cmd report -t FILE`, side by side: events/s,
    /// CPU time, peak RSS, the ratio.
    Report(ReportBenchArgs),
}

/// Sections of `hyptrace bench`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SectionArg {
    /// Guest (under the live reader and with none) vs native vs bound ns/event.
    Writer,
    /// swap_reader latency, both modes.
    Swap,
    /// Drain throughput.
    Drain,
    /// Highest loss-free rate.
    Rate,
    /// Each output format's throughput behind the reader.
    Sinks,
    /// 60 M-event records at fractions of the writer's flat-out rate, per sink.
    Sustained,
}

impl From<SectionArg> for Section {
    fn from(s: SectionArg) -> Self {
        match s {
            SectionArg::Writer => Self::Writer,
            SectionArg::Swap => Self::Swap,
            SectionArg::Drain => Self::Drain,
            SectionArg::Rate => Self::Rate,
            SectionArg::Sinks => Self::Sinks,
            SectionArg::Sustained => Self::Sustained,
        }
    }
}

/// Options of `hyptrace bench report`.
#[derive(Clone, Debug, Args)]
pub struct ReportBenchArgs {
    /// The trace.dat to read (a big kernel trace: `trace-cmd extract`, v7 zstd).
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    pub input: PathBuf,
    /// Repetitions of each command.
    #[arg(long, value_name = "N", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub reps: u32,
    /// The trace-cmd to compare with.
    #[arg(long = "trace-cmd", value_name = "PATH", default_value = "trace-cmd")]
    pub trace_cmd: PathBuf,
}
