//! The run pipeline as a library (`hyptrace_host::pipeline::run::Run`, issue 10): what `run` and
//! `record` use, driven the way `bench` will — a caller's page sink, callbacks wrapped
//! to count swaps, no signal handling — and its `RunReport`: R1 per CPU, the summary,
//! the `--stats` JSON, the guest memory after the run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use clap::Parser;
use hyptrace::env::{kvm_available, vm_lock};
use hyptrace_host::cli::{Cli, Command};
use hyptrace_host::pipeline::plan::Plan;
use hyptrace_host::pipeline::report::Destination;
use hyptrace_host::pipeline::run::{Run, Target};
use hyptrace_output::{Missed, OutputError, PageSink, RunSummary};
use hyptrace_reader::{Callbacks, ReadError, SwapReply, SwapStatus};

const KRATE: &str = env!("CARGO_CRATE_NAME");

/// Counts what the pipeline hands it.
struct CountSink {
    pages: Arc<AtomicU64>,
    finished: Arc<AtomicU64>,
}

impl PageSink for CountSink {
    fn page(&mut self, _cpu: u32, _page: &[u8], _missed: Missed) -> Result<(), OutputError> {
        self.pages.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn finish(self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        self.finished.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Counts the swaps that went through.
struct CountSwaps {
    inner: Box<dyn Callbacks + Send>,
    swaps: Arc<AtomicU64>,
}

impl Callbacks for CountSwaps {
    fn swap_reader(&self, cpu: u32) -> Result<SwapReply, ReadError> {
        let r = self.inner.swap_reader(cpu);
        if matches!(r, Ok(SwapReply::Done(SwapStatus::Swapped { .. }))) {
            self.swaps.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn update_footers(&self, cpu: u32) -> Result<bool, ReadError> {
        self.inner.update_footers(cpu)
    }

    fn releases(&self, cpu: u32) -> bool {
        self.inner.releases(cpu)
    }
}

fn plan(args: &[&str]) -> Plan {
    let mut v = vec!["hyptrace", "run"];
    v.extend_from_slice(args);
    match Cli::try_parse_from(v).expect("parses").command {
        Command::Run(a) => Plan::new(&a).expect("plan"),
        c => panic!("not run: {c:?}"),
    }
}

#[test]
fn pipeline_with_a_callers_sink_and_callbacks() {
    if !kvm_available(KRATE, "pipeline_with_a_callers_sink_and_callbacks") {
        return;
    }
    let _vm = vm_lock();
    for swap in ["host", "guest"] {
        let what = format!("--swap {swap}");
        let pages = Arc::new(AtomicU64::new(0));
        let finished = Arc::new(AtomicU64::new(0));
        let swaps = Arc::new(AtomicU64::new(0));
        let sink = CountSink {
            pages: pages.clone(),
            finished: finished.clone(),
        };
        let counted = swaps.clone();
        let wrapped = Arc::new(AtomicU64::new(0));
        let wraps = wrapped.clone();
        let plan = plan(&[
            "--vcpus",
            "2",
            "--events",
            "3000",
            "--rate",
            "0",
            "--buffer-kb",
            "16",
            "--swap",
            swap,
        ]);
        let report = Run::new(plan, Target::Sink(Box::new(sink)))
            .wrap_callbacks(Box::new(move |inner| {
                wraps.fetch_add(1, Ordering::Relaxed);
                Box::new(CountSwaps {
                    inner,
                    swaps: counted,
                })
            }))
            .execute()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(report.exit_code(), 0, "{what}: {report}");
        assert!(matches!(report.destination, Destination::Sink), "{what}");
        assert_eq!(
            finished.load(Ordering::Relaxed),
            1,
            "{what}: sink finished once"
        );
        let mut read_pages = 0;
        for (cpu, c) in report.cpus.iter().enumerate() {
            assert!(c.consistent(), "{what}: cpu {cpu}: {report}");
            assert_eq!(c.written, 3000, "{what}: cpu {cpu}");
            assert_eq!(c.stats.read + c.stats.lost, c.written, "{what}: R1");
            read_pages += c.stats.pages_read;
        }
        assert_eq!(pages.load(Ordering::Relaxed), read_pages, "{what}");
        let swapped: u64 = report.cpus.iter().map(|c| c.stats.swaps).sum();
        // Every swap the reader made went through the wrapped callbacks; with the
        // mailbox, a swap in flight when the writer stopped is found by the final walk
        // (counted, never answered): at most one per CPU.
        let through = swaps.load(Ordering::Relaxed);
        if swap == "host" {
            assert_eq!(through, swapped, "{what}: wrapped callbacks");
        } else {
            assert!(
                through <= swapped && swapped - through <= 2,
                "{what}: {through} swaps through the callbacks, {swapped} counted"
            );
        }
        assert_eq!(
            wrapped.load(Ordering::Relaxed),
            1,
            "{what}: callbacks wrapped once"
        );
        // The summary and the stats JSON render from the same report.
        let text = report.to_string();
        assert!(
            text.contains("written 6000 = read") && text.contains("pages handed to the sink"),
            "{what}: {text}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&report.stats_json(report.exit_code())).expect("json");
        assert_eq!(json["end"], "guest_finished", "{what}");
        assert_eq!(json["swap"], swap, "{what}");
        // The guest memory stays readable after the run (bench reads its result slots).
        let guest = report.guest.as_ref().expect("guest memory");
        assert!(guest.map.result_slot(1) < guest.map.mem_bytes, "{what}");
    }
}
