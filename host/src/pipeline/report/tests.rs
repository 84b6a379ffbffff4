use super::*;

fn report(cpus: Vec<CpuReport>, outcomes: Vec<VcpuOutcome>) -> RunReport {
    RunReport {
        outcomes,
        cpus,
        timing: Timing {
            tsc_khz: 1_000_000,
            wall: Duration::from_secs(1),
            ..Default::default()
        },
        stop: None,
        failures: Failures::default(),
        destination: Destination::Stdout { lines: 0 },
        echo: OptionsEcho {
            workload: "steady".into(),
            mode: "overwrite".into(),
            swap: "host".into(),
            vcpus: 2,
            events: 10,
            rate: 0,
        },
        mode: Mode::Overwrite,
        guest: None,
        clock: None,
        host_events: None,
        host_trace: None,
        verbose: true,
    }
}

/// A paced vCPU that ended later than its `--rate` schedule says how much; one on
/// schedule, an unpaced one and a burst workload say nothing.
#[test]
fn a_paced_vcpu_behind_its_schedule_says_so() {
    let fin = |ms: u64| {
        VcpuOutcome::Finished(crate::vmm::vcpu::VcpuStats {
            tsc_start: 5,
            tsc_end: 5 + ms * 1_000_000,
            mailbox_served: 0,
        })
    };
    let line = |workload: &str, rate: u64, ms: u64| {
        let mut r = report(Vec::new(), vec![fin(ms)]);
        r.echo.workload = workload.into();
        r.echo.rate = rate;
        r.summary().to_string()
    };
    // 10 events at 1000/s: a 10 ms schedule.
    let late = line("steady", 1000, 13);
    assert!(
        late.contains("finished in 13.000 ms, 3.0 ms behind its --rate schedule of 10.0 ms"),
        "{late}"
    );
    assert!(late.contains("catches up at most 200 µs"), "{late}");
    assert!(line("mixed", 1000, 13).contains("3.0 ms behind"));
    for (workload, rate, ms) in [
        ("steady", 1000, 10),
        ("steady", 1000, 11),
        ("steady", 0, 50),
        ("burst", 1000, 50),
    ] {
        let text = line(workload, rate, ms);
        assert!(!text.contains("behind"), "{workload} {rate} {ms}: {text}");
    }
}

/// The wait for the registration's answer — the run holds it until it reads, which
/// took 3–4 ms of every short run — is no lateness: the schedule is counted from the
/// answer. (Every `run --vcpus 2 --events 10` said "held off its core" before.)
#[test]
fn the_wait_for_the_registration_answer_is_not_lateness() {
    let (tsc_start, answered) = (5u64, 4_000_005u64); // the answer 4 ms after entry
    let fin = VcpuOutcome::Finished(crate::vmm::vcpu::VcpuStats {
        tsc_start,
        tsc_end: answered + 10_500_000, // 10.5 ms after the answer
        mailbox_served: 0,
    });
    let mut r = report(Vec::new(), vec![fin]);
    r.echo.rate = 1000; // 10 events: a 10 ms schedule
    let late = r.summary().to_string();
    assert!(late.contains("4.5 ms behind"), "without the answer: {late}");
    r.timing.answered_tsc = Some(answered + 7); // host TSC; guest = host - 7
    r.timing.tsc_offset = Some(-7);
    let text = r.summary().to_string();
    assert!(text.contains("finished in 14.500 ms"), "{text}");
    assert!(!text.contains("behind"), "{text}");
    // 2 ms late after the answer is late.
    r.timing.answered_tsc = Some(answered + 7 - 2_000_000);
    let text = r.summary().to_string();
    assert!(text.contains("2.5 ms behind"), "{text}");
    // An answer before the vCPU entered changes nothing.
    assert_eq!(r.timing.workload_start(answered), answered);
}

/// Issue 26: lateness is one hint line, only when a CPU lost events; each vCPU's
/// with `-v`; never a "0.0 ms" schedule (a run too short to have one).
#[test]
fn lateness_is_one_hint_and_only_with_a_loss() {
    let late = VcpuOutcome::Finished(crate::vmm::vcpu::VcpuStats {
        tsc_start: 5,
        tsc_end: 5 + 13_000_000, // 13 ms: 3 ms behind a 10 ms schedule
        mailbox_served: 0,
    });
    let cpu = |lost: u64| CpuReport {
        finished: true,
        attempted: Some(10),
        skipped: Some(0),
        attempts_problem: None,
        written: 10,
        stats: hyptrace_reader::CpuStats {
            written: 10,
            read: 10 - lost,
            overrun: lost,
            lost,
            ..Default::default()
        },
        error: None,
        page_events: 510,
    };
    let run = |lost: u64, verbose: bool| {
        let mut r = report(vec![cpu(0), cpu(lost)], vec![late.clone(), late.clone()]);
        r.echo.rate = 1000; // 10 events: a 10 ms schedule
        r.verbose = verbose;
        r.to_string()
    };
    let quiet = run(0, false);
    assert!(!quiet.contains("behind"), "a loss-free run: {quiet}");
    let lossy = run(2, false);
    let lines: Vec<&str> = lossy.lines().filter(|l| l.contains("behind")).collect();
    assert_eq!(
        lines,
        ["hyptrace: hint: 2 of 2 vCPUs ran behind their --rate schedule (up to 3.0 ms): held off their cores (a pacing guest catches up at most 200 µs), the reader likely was too; -v shows each"],
        "{lossy}"
    );
    let verbose = run(0, true);
    assert_eq!(
        verbose
            .matches("3.0 ms behind its --rate schedule of 10.0 ms")
            .count(),
        2,
        "{verbose}"
    );
    assert!(!verbose.contains("hint"), "{verbose}");
    // 1 event at 1 000 000/s: a 1 µs schedule is none to show.
    let mut r = report(vec![cpu(2)], vec![late.clone()]);
    r.echo.events = 1;
    r.echo.rate = 1_000_000;
    let text = r.to_string();
    assert!(
        !text.contains("behind") && !text.contains("0.0 ms"),
        "{text}"
    );
}

/// Issue 8 defect 4: guest counters at the top of u64 made the summary's sums
/// overflow (a panic in debug builds, wrapped garbage in release builds).
#[test]
fn summary_of_hostile_counters_saturates() {
    let hostile = hyptrace_reader::CpuStats {
        written: u64::MAX,
        read: 3,
        overrun: u64::MAX,
        dropped: u64::MAX,
        lost: u64::MAX - 3,
        pages_touched: u64::MAX,
        bytes: u64::MAX,
        ..Default::default()
    };
    let cpu = CpuReport {
        finished: true,
        attempted: Some(u64::MAX),
        skipped: Some(u64::MAX),
        attempts_problem: None,
        written: u64::MAX,
        stats: hostile,
        error: None,
        page_events: 510,
    };
    // read + lost == written per CPU, but overrun + dropped overflows.
    assert!(!cpu.consistent());
    let r = report(
        vec![cpu.clone(), cpu],
        vec![VcpuOutcome::Stopped, VcpuOutcome::Stopped],
    );
    let text = r.summary().to_string();
    let m = u64::MAX;
    assert!(
        text.contains(&format!("written {m} = read 6 + lost {m}")),
        "{text}"
    );
    // The whole report too (the loss hint and the mismatch line).
    let all = r.to_string();
    assert!(all.contains("hint:") && all.contains("MISMATCH"), "{all}");
    assert_eq!(r.exit_code(), EXIT_RUNTIME);
}

/// R1's one exemption: a writer that did not finish may have counted one page's
/// events as overrun that the reader read — at most one page's, and named; past a
/// page, the other way round, or for a writer that finished, it is a mismatch.
#[test]
fn overrun_ahead_is_bounded_and_named() {
    let cpu = |finished: bool, overrun: u64, lost: u64| CpuReport {
        finished,
        attempted: Some(1000),
        skipped: Some(0),
        attempts_problem: None,
        written: 1000,
        stats: hyptrace_reader::CpuStats {
            written: 1000,
            read: 1000 - lost,
            overrun,
            lost,
            ..Default::default()
        },
        error: None,
        page_events: 510,
    };
    let ahead = cpu(false, 300 + 510, 300);
    assert!(ahead.consistent());
    assert_eq!(ahead.overrun_ahead(), Some(510));
    assert!(
        ahead.flag(false).contains("overrun counts 510 events read"),
        "{}",
        ahead.flag(false)
    );
    for bad in [
        cpu(false, 300 + 511, 300),
        cpu(false, 299, 300),
        cpu(true, 301, 300),
    ] {
        assert!(!bad.consistent(), "{:?}", bad.stats);
        assert!(bad.flag(false).contains("MISMATCH"));
    }
    assert!(cpu(true, 300, 300).flag(false).is_empty());
}

#[test]
fn crash_detail() {
    let f = VcpuOutcome::Faulted("triple fault (rip 0x1f00a, rsp 0x10)".into());
    let c = CrashStats::new(1, &f).expect("crash");
    let v = serde_json::to_value(&c).expect("json");
    assert_eq!(v["rip"], "0x1f00a");
    assert_eq!(v["kind"], "fault");
    assert_eq!(v["cpu"], 1);
    let p = VcpuOutcome::Panicked("boom \"quoted\"\x07".into());
    let c = CrashStats::new(0, &p).expect("crash");
    let v = serde_json::to_value(&c).expect("json");
    assert_eq!(v["message"], "boom \"quoted\"\x07");
    assert!(v["rip"].is_null());
    let text = serde_json::to_string(&v).expect("json");
    assert!(
        text.contains("\\u0007") && text.contains("\\\"quoted"),
        "{text}"
    );
    assert!(CrashStats::new(0, &VcpuOutcome::Stopped).is_none());
}

/// The stats JSON keeps the keys and their (alphabetical) order of the `json!`
/// document it replaced.
#[test]
fn stats_keys_in_order() {
    let r = report(vec![CpuReport::default()], vec![VcpuOutcome::Stopped]);
    let s = r.stats_json(0);
    let keys: Vec<&str> = s
        .lines()
        .filter(|l| l.starts_with("  \"") || l.starts_with("      \""))
        .map(|l| l.trim().split('"').nth(1).unwrap_or(""))
        .collect();
    let want = [
        "clock",
        "cpus",
        "attempted",
        "attempts_problem",
        "bytes",
        "cpu",
        "crash",
        "dropped",
        "error",
        "lost",
        "outcome",
        "overrun",
        "pages_read",
        "pages_touched",
        "read",
        "skipped",
        "swaps",
        "written",
        "crash",
        "end",
        "events_per_vcpu",
        "exit_code",
        "guest_exit",
        "mode",
        "rate",
        "reader",
        "stop_reason",
        "swap",
        "tsc_khz",
        "vcpus",
        "wall_seconds",
        "workload",
    ];
    assert_eq!(keys, want, "{s}");
    assert!(s.ends_with("}\n"));
}

/// A lossy stop-mode run of one vCPU: 1 000 000 events of 100 bytes offered over
/// 1 s (100 MB/s), 1 000 of them dropped; a ring of 1 024 KiB that holds 1 MB of
/// events, so it lasts 10 ms at that rate.
fn lossy(reader: ReaderTimes) -> RunReport {
    let cpu = CpuReport {
        finished: true,
        attempted: Some(1_000_000),
        skipped: Some(0),
        attempts_problem: None,
        written: 1_000_000,
        stats: hyptrace_reader::CpuStats {
            written: 1_000_000,
            read: 999_000,
            dropped: 1_000,
            lost: 1_000,
            bytes: 999_000 * 100,
            ..Default::default()
        },
        error: None,
        page_events: 510,
    };
    let mut r = report(vec![cpu], vec![VcpuOutcome::Finished(Default::default())]);
    r.mode = Mode::Stop;
    r.timing.reader = ReaderTimes {
        buffer_kb: 1024,
        ring_bytes: 1_000_000,
        ..reader
    };
    r
}

fn hints(r: &RunReport) -> Vec<String> {
    r.to_string()
        .lines()
        .filter_map(|l| l.strip_prefix("hyptrace: hint: "))
        .map(str::to_string)
        .collect()
}

/// A live reader that lost events says why: its waits for the output, and an
/// absence from its core longer than half of what the ring lasts, with the
/// --buffer-kb that holds twice that absence (a power of two KiB).
#[test]
fn loss_causes_name_the_output_and_the_absence() {
    let mut waits = hyptrace_output::OutputWaits::default();
    waits.add(Duration::from_millis(30));
    waits.add(Duration::from_millis(12));
    let r = lossy(ReaderTimes {
        live: true,
        longest_late: Duration::from_millis(12),
        output_waits: waits,
        standby: crate::drain::standby::StandbyTimes {
            turns: 3,
            rounds: 5,
            cpu: Duration::from_micros(1500),
        },
        ..Default::default()
    });
    let h = hints(&r);
    assert_eq!(h.len(), 3, "{h:?}");
    assert!(h[0].contains("raise --buffer-kb"), "{h:?}");
    assert!(
        h[1].starts_with(
            "the reader waited 42.0 ms for the output to take pages (2 times, the longest 30.0 ms)"
        ) && h[1].contains("(100 MB/s of events"),
        "{h:?}"
    );
    // Not a regular file through the page cache (the test's report): no --direct-io.
    assert!(!h[1].contains("--direct-io"), "{h:?}");
    let mut r = r;
    r.destination = Destination::File {
        path: "t.dat".into(),
        format: crate::drain::sink::Format::Dat,
        filter: None,
        page_cache: true,
    };
    let h = hints(&r);
    assert!(
        h[1].contains("every block past the page cache (--direct-io)"),
        "{h:?}"
    );
    // 12 ms away, the ring lasts 10 ms: 2 × 12 / 10 × 1024 KiB = 2458 → 4096.
    assert!(
        h[2].contains("up to 12.0 ms, while a 1024 KiB ring lasts 10.0 ms")
            && h[2].ends_with("--buffer-kb 4096 holds twice that"),
        "{h:?}"
    );
    let v: serde_json::Value = serde_json::from_str(&r.stats_json(0)).expect("json");
    assert_eq!(v["reader"]["output_waits"], 2);
    assert_eq!(v["reader"]["output_wait_longest_ms"], 30.0);
    assert_eq!(v["reader"]["standby_turns"], 3);
    assert_eq!(v["reader"]["standby_cpu_ms"], 1.5);
}

/// No cause is named without a live reader (`--drain none`: the ring was read at
/// the end), nor when the reader neither waited nor was away for long.
#[test]
fn loss_causes_only_from_what_a_live_reader_saw() {
    let away = ReaderTimes {
        longest_late: Duration::from_millis(50),
        ..Default::default()
    };
    let r = lossy(away);
    assert_eq!(hints(&r).len(), 1, "{:?}", hints(&r));
    assert!(
        serde_json::from_str::<serde_json::Value>(&r.stats_json(0)).expect("json")["reader"]
            .is_null()
    );
    let r = lossy(ReaderTimes {
        live: true,
        longest_late: Duration::from_millis(4),
        ..Default::default()
    });
    assert_eq!(hints(&r).len(), 1, "{:?}", hints(&r));
    // Hostile counters: a guest claiming u64::MAX bytes gets an absurd suggestion,
    // not a panic (debug builds check the arithmetic).
    let mut r = lossy(ReaderTimes {
        live: true,
        longest_late: Duration::from_secs(3600),
        ..Default::default()
    });
    r.cpus[0].stats.bytes = u64::MAX;
    r.cpus[0].written = u64::MAX;
    let h = hints(&r);
    assert!(h.iter().any(|l| l.contains("holds twice that")), "{h:?}");
}

/// Issue 39: the host trace's output CPUs are named inclusively (2 host CPUs after 2
/// vCPUs are CPUs 2-3, not "2..4"); `record -F` says what it kept and dropped, after
/// the unchanged `written = read + lost` line, and names a filter that matched nothing.
#[test]
fn host_trace_cpus_and_filter_counts_read_as_meant() {
    let mut r = report(Vec::new(), Vec::new());
    r.host_trace = Some(crate::drain::session::HostTraceStats {
        cpus: 2,
        first_cpu: 2,
        ..Default::default()
    });
    r.destination = Destination::File {
        path: "t.dat".into(),
        format: crate::drain::sink::Format::Dat,
        page_cache: true,
        filter: Some(FilterReport {
            kept: 7,
            dropped: 5,
            unmatched: vec!["marker: seq > 9".into()],
        }),
    };
    let text = r.to_string();
    assert!(text.contains("(output CPUs 2-3)"), "{text}");
    assert!(
        text.contains("hyptrace: -F kept 7 of the 12 events read (5 dropped by the filter, not lost)\nhyptrace: -F 'marker: seq > 9' matched no event of the run\n"),
        "{text}"
    );
    let json = r.stats_json(0);
    assert!(
        json.contains("\"filter\": {\n    \"kept\": 7,\n    \"dropped\": 5,"),
        "{json}"
    );
}
