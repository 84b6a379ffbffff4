//! The text table `hyptrace bench` prints (the JSON's figures, rounded; a section not
//! run shows `-` and zeros).

use std::fmt::Write as _;

use hyptrace_abi::guest::BENCH_CHUNK;

use super::stats::Summary;
use super::BenchReport;

/// `12.34 ± 5%`: a summary's median and spread.
fn cell(s: &Summary) -> String {
    format!("{:.2} ±{:>3.0}%", s.median, s.spread * 100.0)
}

/// A count, `-` when not measured.
fn count(v: Option<impl ToString>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

/// The table of a report.
pub(super) fn table(v: &BenchReport) -> String {
    let mut s = String::new();
    let m = &v.machine;
    let _ = writeln!(
        s,
        "hyptrace bench: {} ({} CPUs), kernel {}, {}, TSC {} kHz{}",
        m.cpu,
        m.cpus,
        m.kernel,
        m.kvm,
        m.tsc_khz,
        if v.quick { " (--quick)" } else { "" }
    );
    if let Some(note) = m.busy_note() {
        let _ = writeln!(s, "{note}");
    }
    writer(&mut s, v);
    typed(&mut s, v);
    swap(&mut s, v);
    drain(&mut s, v);
    max_rate(&mut s, v);
    sinks(&mut s, v);
    sustained(&mut s, v);
    startup(&mut s, v);
    for f in &v.failed {
        let _ = writeln!(s, "\n{} FAILED: {}", f.section, f.error);
    }
    s
}

/// The table's section of each sink's throughput.
fn sinks(s: &mut String, v: &BenchReport) {
    let Some(r) = v.sinks.get() else { return };
    let _ = writeln!(
        s,
        "
sinks (reader → each format's file, {} pages of {} markers, until finish returned)",
        r.pages, r.events
    );
    for row in &r.rows {
        let _ = writeln!(
            s,
            "  {:<16} {:>8.0} MB/s ±{:>3.0}%  {:>6.2} M events/s  {:>5.2}× the reader alone  file {:>6.1} MB",
            row.sink,
            row.mb_per_s.median,
            row.mb_per_s.spread * 100.0,
            row.events_per_s.median / 1e6,
            row.vs_null,
            row.file_bytes as f64 / 1e6,
        );
    }
}

/// The table's section of the sustained records.
fn sustained(s: &mut String, v: &BenchReport) {
    let Some(r) = v.sustained.get() else { return };
    let _ = writeln!(
        s,
        "
sustained records ({} M events, 1 vCPU, stop mode; flat out {:.1} M events/s, the fastest of {:?})",
        r.events / 1_000_000,
        r.flat_out / 1e6,
        r.flat_out_runs
            .iter()
            .map(|x| format!("{:.1}", x / 1e6))
            .collect::<Vec<_>>(),
    );
    for row in &r.rows {
        let _ = writeln!(
            s,
            "  {:<16} at {:>3.0} % ({:>5.1} M/s asked, {:>5.1} reached at the least): {}, lost {:?}",
            row.sink,
            row.fraction * 100.0,
            row.rate as f64 / 1e6,
            row.achieved.iter().copied().fold(f64::INFINITY, f64::min) / 1e6,
            if row.lossless { "lossless" } else { "LOSSY" },
            row.lost,
        );
    }
}

/// The table's section of the writer rows.
fn writer(s: &mut String, v: &BenchReport) {
    let _ = writeln!(
        s,
        "\nwriter, ns/event (median of the fastest {}-event chunk per run; spread = (max-min)/median)",
        BENCH_CHUNK
    );
    let _ = writeln!(
        s,
        "{:>5} {:>7} {:>15} {:>15} {:>15} {:>15} {:>7} {:>12} {:>11} {:>10} {:>11} {:>11}",
        "vcpus",
        "payload",
        "guest",
        "unread",
        "native",
        "rdtsc+store",
        "rdtsc",
        "native/guest",
        "guest/bound",
        "guest mean",
        "unread mean",
        "native mean"
    );
    for r in &v.writer {
        let _ = writeln!(
            s,
            "{:>5} {:>7} {:>15} {:>15} {:>15} {:>15} {:>7.2} {:>12.2} {:>11.2} {:>10.2} {:>11.2} {:>11.2}",
            r.vcpus,
            r.payload,
            cell(&r.slices.guest_ns),
            cell(&r.guest_unread_ns),
            cell(&r.slices.native_ns),
            cell(&r.slices.bound_ns),
            r.rdtsc_ns.median,
            r.guest_rate_vs_native,
            r.slices.guest_vs_bound,
            r.slices.guest_mean_ns.median,
            r.guest_unread_mean_ns.median,
            r.slices.native_mean_ns.median,
        );
    }
    let _ = writeln!(
        s,
        "(up to guest/bound: the fastest chunk; then the whole loop's mean per event; guest: under a live reader, unread: the same guest loop with no reader while it writes, native: no reader)"
    );
}

/// The table's section of the typed writer rows (when measured).
fn typed(s: &mut String, v: &BenchReport) {
    if v.writer.iter().any(|r| r.typed.is_some()) {
        let _ = writeln!(
            s,
            "\ntyped writer, ns/event (the payload's length a compile-time constant, as a typed event's; bound: the same constant-length copy)"
        );
        let _ = writeln!(
            s,
            "{:>5} {:>7} {:>15} {:>15} {:>15} {:>11} {:>12} {:>10} {:>11}",
            "vcpus",
            "payload",
            "guest",
            "native",
            "rdtsc+store",
            "guest/bound",
            "native/bound",
            "guest mean",
            "native mean"
        );
        for r in &v.writer {
            let Some(t) = &r.typed else { continue };
            let _ = writeln!(
                s,
                "{:>5} {:>7} {:>15} {:>15} {:>15} {:>11.2} {:>12.2} {:>10.2} {:>11.2}",
                r.vcpus,
                r.payload,
                cell(&t.guest_ns),
                cell(&t.native_ns),
                cell(&t.bound_ns),
                t.guest_vs_bound,
                t.native_vs_bound,
                t.guest_mean_ns.median,
                t.native_mean_ns.median,
            );
        }
    }
}

/// The table's section of the swap latencies.
fn swap(s: &mut String, v: &BenchReport) {
    let _ = writeln!(
        s,
        "\nswap_reader latency, ns (alone: one swap every 150 µs; live: every swap of a drain, pending = mailbox not answered within its 3 µs spin)"
    );
    let _ = writeln!(
        s,
        "{:>17} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "swap", "swaps", "median", "p10", "p90", "p99", "pending"
    );
    for (k, r) in v.swap.latencies() {
        let _ = writeln!(
            s,
            "{:>17} {:>8} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>8}",
            k,
            count(r.map(|r| r.swapped)),
            r.map_or(0.0, |r| r.median_ns),
            r.map_or(0.0, |r| r.p10_ns),
            r.map_or(0.0, |r| r.p90_ns),
            r.map_or(0.0, |r| r.p99_ns),
            count(r.map(|r| r.pending)),
        );
    }
}

/// The table's section of the drain throughputs.
fn drain(s: &mut String, v: &BenchReport) {
    let _ = writeln!(
        s,
        "\ndrain (4 KiB pages; raw file incl. its final fsync: {:.0} MB/s)",
        v.drain
            .reader_to_file
            .get()
            .map_or(0.0, |r| r.mb_per_s_incl_fsync.median)
    );
    for (what, r) in v.drain.throughputs() {
        let _ = writeln!(
            s,
            "  {what:<32} {:>8.0} MB/s ±{:>3.0}%  {:>9.0} pages/s",
            r.map_or(0.0, |r| r.mb_per_s.median),
            r.map_or(0.0, |r| r.mb_per_s.spread) * 100.0,
            r.map_or(0.0, |r| r.pages_per_s.median),
        );
    }
}

/// The table's section of the highest loss-free rates.
fn max_rate(s: &mut String, v: &BenchReport) {
    let _ = writeln!(
        s,
        "\nhighest --rate with zero loss (stop mode, idle poll {} ms, {} KiB/vCPU, record to {}; every run of a step loss-free)",
        super::POLL_MS,
        v.max_rate.first().map_or(0, |r| r.buffer_kb),
        v.max_rate.first().map_or("trace.dat", |r| r.sink.as_str()),
    );
    for r in &v.max_rate {
        let who = format!("{} vCPU{}:", r.vcpus, if r.vcpus == 1 { "" } else { "s" });
        let swap = format!("--swap {}:", r.swap);
        let _ = writeln!(s, "  {who:<10} {swap:<14} {}", r.text());
    }
    // The writer flat out (1 vCPU, whole-loop mean of the payload closest to a marker's
    // 24 bytes) against the loss-free rates of 1 vCPU.
    let flat = v
        .writer
        .iter()
        .filter(|r| r.vcpus == 1 && r.slices.guest_mean_ns.median > 0.0)
        .min_by_key(|r| r.payload.abs_diff(24))
        .map(|r| (r.payload, 1e9 / r.slices.guest_mean_ns.median));
    if let Some((payload, flat)) = flat {
        for r in v.max_rate.iter().filter(|r| r.vcpus == 1) {
            let _ = writeln!(
                s,
                "  1 vCPU, --swap {}: {:.1} % of the writer flat out ({:.1} M events/s, {payload}-byte payload, whole-loop mean); reached {:.2} M events/s, {:.1} %",
                r.swap,
                100.0 * r.max_rate_zero_loss as f64 / flat,
                flat / 1e6,
                r.achieved_zero_loss / 1e6,
                100.0 * r.achieved_zero_loss / flat,
            );
        }
    }
}

/// The table's section of the start-up times.
fn startup(s: &mut String, v: &BenchReport) {
    let st = &v.startup;
    let _ = writeln!(
        s,
        "\nstart-up: VMM start → first event {:.2} ms (VM creation {:.2} ms, vCPU start → first instruction {:.2} ms)",
        st.first_event_ms.median,
        st.vm_create_ms.median,
        st.start_to_first_instruction_ms.median,
    );
}

#[cfg(test)]
mod tests {
    use super::super::rate::{RateRow, RateRun};
    use super::super::swap::{PingPongRow, PingPongWorkload, SwapLatency, SwapReport};
    use super::super::writer::{Loops, WriterRow};
    use super::super::{BenchConfig, DrainReport, Machine, Measured};
    use super::*;

    fn rate_row(vcpus: u32, good: u64, bad: Option<u64>, searched: bool) -> RateRow {
        RateRow {
            vcpus,
            swap: "host",
            repeats: 3,
            first_lossy_lost: bad.map_or_else(Vec::new, |_| vec![0, 5, 9]),
            max_rate_zero_loss: good,
            achieved_zero_loss: good as f64,
            first_lossy_rate: bad,
            lower_bound: bad.is_none(),
            searched,
            confirm_lost: match (searched, bad) {
                (false, _) => Vec::new(),
                (true, None) => vec![0, 0, 0],
                (true, Some(_)) => vec![0, 12, 0],
            },
            confirm_lossless: bad.is_none(),
            confirm_events: 60_000_000,
            runs: std::iter::once((200_000, 0.0, 0.0))
                .chain(bad.map(|b| (b, 12.5, 3.0)))
                .map(|(rate, output_wait_ms, longest_late_ms)| RateRun {
                    rate,
                    events_per_vcpu: 1,
                    lost: u64::from(rate != 200_000),
                    read: 1,
                    achieved_rate: 1.0,
                    ok: rate == 200_000,
                    output_wait_ms,
                    longest_late_ms,
                    standby_turns: 0,
                })
                .collect(),
            mode: "stop",
            poll_ms: crate::bench::POLL_MS as u32,
            buffer_kb: 1024,
            sink: "trace.dat v7 file in /tmp".into(),
        }
    }

    /// A report with one writer row, one swap row, three rate rows; the rest not run.
    fn sample() -> BenchReport {
        let sum = |x: f64| Summary::of(&[x]);
        BenchReport {
            version: 1,
            quick: true,
            machine: Machine {
                cpu: "X".into(),
                cpus: 2,
                kernel: "k".into(),
                kvm: "kvm",
                tsc_khz: 1000,
                loadavg_at_start: "9.50 4.00 2.00".into(),
                loadavg_at_end: String::new(),
            },
            config: BenchConfig::default(),
            startup: Default::default(),
            writer: vec![WriterRow {
                vcpus: 1,
                payload: 16,
                event_bytes: 24,
                slices: Loops {
                    guest_ns: sum(12.5),
                    guest_mean_ns: sum(12.5),
                    native_ns: sum(10.0),
                    native_mean_ns: sum(10.0),
                    bound_ns: sum(9.0),
                    bound_mean_ns: sum(9.0),
                    guest_vs_bound: 1.4,
                    native_vs_bound: 1.1,
                },
                guest_unread_ns: sum(11.5),
                guest_unread_mean_ns: sum(11.75),
                rdtsc_ns: sum(8.0),
                typed: Some(Loops {
                    guest_ns: sum(10.5),
                    guest_mean_ns: sum(11.25),
                    native_ns: sum(9.5),
                    native_mean_ns: sum(9.75),
                    bound_ns: sum(8.5),
                    bound_mean_ns: sum(8.75),
                    guest_vs_bound: 1.24,
                    native_vs_bound: 1.12,
                }),
                guest_rate_vs_native: 0.8,
            }],
            swap: SwapReport {
                host: Measured::Ran(PingPongRow {
                    latency: SwapLatency {
                        mode: "host".into(),
                        swapped: 200,
                        median_ns: 70.0,
                        p10_ns: 40.0,
                        p90_ns: 300.0,
                        p99_ns: 900.0,
                        max_ns: 1000.0,
                        pending: 0,
                    },
                    busy: 0,
                    transient_failures: 0,
                    workload: PingPongWorkload {
                        rate: 1,
                        ring_pages: 256,
                        interval_us: 150,
                    },
                }),
                guest: Measured::NotRun {},
                host_live_drain: Measured::NotRun {},
                guest_live_drain: Measured::NotRun {},
            },
            drain: DrainReport::not_run(),
            sinks: Measured::NotRun {},
            sustained: Measured::NotRun {},
            max_rate: vec![
                rate_row(1, 200_000, None, false),
                rate_row(2, 400_000, None, true),
                rate_row(4, 300_000, Some(350_000), true),
            ],
            criterion: None,
            failed: Vec::new(),
            wall_seconds: 0.0,
        }
    }

    /// The table: numbers right-aligned under their headers, no JSON `null` in the
    /// text, sections not run shown as `-`, a --quick rate reported as a lower bound.
    /// A failed section is named with its error at the end of the table and in the
    /// JSON; the sections that ran keep their results.
    #[test]
    fn failed_sections_are_named() {
        let mut v = sample();
        assert!(!table(&v).contains("FAILED"));
        v.failed.push(super::super::FailedSection {
            section: "sustained".into(),
            error: "no flat-out rate".into(),
        });
        let t = table(&v);
        assert!(t.ends_with("\nsustained FAILED: no flat-out rate\n"), "{t}");
        assert!(t.contains("2 vCPUs:   --swap host:"), "{t}");
        let j: serde_json::Value = serde_json::from_str(&v.json()).expect("json");
        assert_eq!(j["failed"][0]["section"], "sustained");
    }

    #[test]
    fn table_aligned_without_nulls() {
        let t = table(&sample());
        assert!(!t.replace("null sink", "").contains("null"), "{t}");
        // Busy at the start (9.5 on 2 CPUs): said under the header; quiet: nothing.
        assert!(
            t.lines().nth(1).is_some_and(|l| l.starts_with(
                "note: the machine was busy (load average 9.50 4.00 2.00 at the start"
            )),
            "{t}"
        );
        let mut quiet = sample();
        quiet.machine.loadavg_at_start = "0.40 0.30 0.20".into();
        quiet.machine.loadavg_at_end = "1.10 0.50 0.20".into();
        assert!(!table(&quiet).contains("busy"));
        assert!(
            t.contains("1 vCPU:    --swap host:   at least 200000 events/s per vCPU (--quick"),
            "{t}"
        );
        assert!(
            t.contains("2 vCPUs:   --swap host:   at least 400000 events/s per vCPU; 60 M-event records: lossless 3 of 3"),
            "{t}"
        );
        assert!(
            t.contains(
                "300000 events/s per vCPU; 60 M-event records at it: NOT lossless, lost [0, 12, 0] (first lossy rate: 350000, lost [0, 5, 9] in 3 runs; there the reader waited for the output up to 12.5 ms in a run and woke up to 3.0 ms late)"
            ),
            "{t}"
        );
        assert!(
            t.contains("            guest        -        0        0        0        0        -"),
            "{t}"
        );
        let lines: Vec<&str> = t.lines().collect();
        let at = |needle: &str| {
            lines
                .iter()
                .position(|l| l.starts_with(needle))
                .unwrap_or_else(|| panic!("no line {needle:?} in {t}"))
        };
        // Every column ends where its header ends.
        let ends = |l: &str| -> Vec<usize> {
            let b: Vec<char> = l.chars().collect();
            (0..b.len())
                .filter(|&i| b[i] != ' ' && (i + 1 == b.len() || b[i + 1] == ' '))
                .collect()
        };
        let h = at("vcpus payload");
        let row = lines[h + 1];
        assert_eq!(ends(lines[h]).first(), ends(row).first(), "{t}");
        assert_eq!(ends(lines[h]).last(), ends(row).last(), "{t}");
        assert_eq!(lines[h].chars().count(), row.chars().count(), "{t}");
        // guest mean, unread mean, native mean: in that order.
        let means: Vec<&str> = row.split_whitespace().rev().take(3).collect();
        assert_eq!(means, ["10.00", "11.75", "12.50"], "{t}");
        // The typed table: aligned too, its ratios and means in order.
        let h = at("typed writer");
        assert!(
            lines[h + 1].trim_start().starts_with("vcpus payload"),
            "{t}"
        );
        let (head, row) = (lines[h + 1], lines[h + 2]);
        assert_eq!(ends(head).first(), ends(row).first(), "{t}");
        assert_eq!(ends(head).last(), ends(row).last(), "{t}");
        assert_eq!(head.chars().count(), row.chars().count(), "{t}");
        let last: Vec<&str> = row.split_whitespace().rev().take(4).collect();
        assert_eq!(last, ["9.75", "11.25", "1.12", "1.24"], "{t}");
        let h = lines
            .iter()
            .position(|l| l.trim_start().starts_with("swap "))
            .expect("swap");
        assert_eq!(ends(lines[h]), ends(lines[h + 1]), "{t}");
    }

    /// Sections not run are `{}` in the JSON, as before the report was typed.
    #[test]
    fn sections_not_run_are_empty_objects() {
        let v = serde_json::to_value(sample()).expect("json");
        assert_eq!(v["swap"]["guest"], serde_json::json!({}));
        assert_eq!(v["drain"]["vm_record_raw"], serde_json::json!({}));
        assert_eq!(v["swap"]["host"]["swapped"], 200);
        assert_eq!(v["swap"]["host"]["workload"]["interval_us"], 150);
        assert!(v["criterion"].is_null());
        assert_eq!(
            v["writer"][0]["guest_ns"]["samples"],
            serde_json::json!([12.5])
        );
        assert_eq!(v["writer"][0]["typed"]["bound_ns"]["median"], 8.5);
    }
}
