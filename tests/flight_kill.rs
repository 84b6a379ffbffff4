//! SIGKILL of the VMM at random moments of live runs with `--trace-mem` (issue 23): the
//! live output plus `hyptrace dump --trace-mem` hold every event exactly once, or the
//! dump counts and marks the ones that may repeat the live output (or that it cannot
//! place). The rules are tests/support/once.rs's; VM tests are skipped without /dev/kvm
//! unless HYPTRACE_REQUIRE_KVM=1.
//!
//! The kill moments come from a seeded RNG: the seed is printed and
//! `HYPTRACE_KILL_SEED=N` (decimal or 0x-hex) repeats a schedule;
//! `HYPTRACE_KILL_ROUNDS=N` changes the number of kills (default [`KILLS`]). Every
//! child runs under a bound ([`WALL`]) and is killed past it: the test fails, never
//! hangs. The measurement (per combination, and one line per kill):
//! `cargo test --release --test flight_kill -- --nocapture`.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyptrace::env::{kvm_available, vm_lock, TempDir};
use hyptrace::once::{
    cross_check, feed, parse_marked, parse_summary, CpuStream, DumpSummary, MarkedRange,
};
use hyptrace::rng::Rng;
use hyptrace::text::{parse_all, parse_line, Line};
use hyptrace_abi::layout::ctl;
use hyptrace_abi::SharedMem;
use hyptrace_reader::trace_file;

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// Longest any child may run (boot, wait for the events, dump on a loaded machine).
const WALL: Duration = Duration::from_secs(60);

/// Kills in all, over the four combinations (`HYPTRACE_KILL_ROUNDS` overrides).
const KILLS: usize = 50;

/// The schedule's seed (`HYPTRACE_KILL_SEED` overrides).
const SEED: u64 = 0x6b69_6c6c_0023;

/// Events every CPU must have written (its control block's `entries`) before the
/// random delay starts.
const MIN_EVENTS: u64 = 2000;

/// The random delay after that, 0 to this many ms.
const MAX_DELAY_MS: u64 = 300;

/// vCPUs of every run.
const CPUS: u32 = 2;

/// `--swap` × `--mode`; round `i` runs combination `i % 4`.
const COMBOS: [(&str, &str); 4] = [
    ("host", "overwrite"),
    ("host", "stop"),
    ("guest", "overwrite"),
    ("guest", "stop"),
];

/// `--rate` of round `i`: `RATES[(i / 4) % 2]`. 20000/s per vCPU: the live reader keeps
/// up (a quiet ring); 0, flat out: the 64 KiB ring overflows (losses: overruns or
/// drops).
const RATES: [&str; 2] = ["20000", "0"];

/// Failure examples kept for the message.
const EXAMPLES: usize = 40;

/// An environment override: decimal or `0x` hex; a bad value fails.
fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let t = v.trim().replace('_', "");
    let n = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => t.parse(),
    };
    Some(n.unwrap_or_else(|e| panic!("{name}={v:?}: {e}")))
}

/// Each CPU's `entries` (events committed) in a trace memory file, if it parses.
fn entries(mem: &str) -> Option<Vec<u64>> {
    let bytes = std::fs::read(mem).ok()?;
    let img = trace_file::parse(&bytes).ok()?;
    Some(
        (0..img.layout.nr_cpus)
            .map(|c| {
                img.region.load(
                    img.layout.ctl(c) + ctl::ENTRIES,
                    std::sync::atomic::Ordering::Relaxed,
                )
            })
            .collect(),
    )
}

fn spawn(args: &[&str], stdout: Option<&str>, stderr: &str) -> Child {
    let out = match stdout {
        Some(p) => Stdio::from(File::create(p).expect("stdout file")),
        None => Stdio::null(),
    };
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(Stdio::from(File::create(stderr).expect("stderr file")))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {BIN}: {e}"))
}

/// Waits for `child` at most until `deadline`; kills it and fails past that.
fn wait_bounded(child: &mut Child, what: &str, stderr: &str, deadline: Instant) -> Option<i32> {
    loop {
        match child.try_wait().expect("try_wait") {
            Some(st) => return st.code(),
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{what} ran past its bound of {WALL:?}: {}",
                    std::fs::read_to_string(stderr).unwrap_or_default()
                );
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Starts the run, waits (bounded) until every CPU wrote [`MIN_EVENTS`], sleeps
/// `delay_ms` (the random moment under test), SIGKILLs it and reaps it.
fn run_and_kill(args: &[&str], mem: &str, out: &str, err: &str, delay_ms: u64) {
    let start = Instant::now();
    let mut child = spawn(args, Some(out), err);
    loop {
        if entries(mem)
            .is_some_and(|e| e.len() == CPUS as usize && e.iter().all(|&n| n >= MIN_EVENTS))
        {
            break;
        }
        if let Some(st) = child.try_wait().expect("try_wait") {
            panic!(
                "hyptrace ended before the kill ({st}): {}",
                std::fs::read_to_string(err).unwrap_or_default()
            );
        }
        if start.elapsed() > WALL {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "fewer than {MIN_EVENTS} events per CPU in {mem} within {WALL:?}: {}",
                std::fs::read_to_string(err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(delay_ms));
    child.kill().expect("SIGKILL");
    let killed = Instant::now();
    let code = wait_bounded(&mut child, "the killed run", err, killed + WALL);
    assert_eq!(code, None, "the run exited by itself before the kill");
    let stderr = std::fs::read_to_string(err).unwrap_or_default();
    assert!(
        !stderr.contains("panicked at"),
        "the run panicked:\n{stderr}"
    );
}

/// Reads the live output as it was left by the kill: every complete line must parse;
/// the last line may be cut (no newline): kept only if it is a whole line of ours (an
/// event exactly as the workload wrote it, or a drop line). Returns the streams and
/// whether a cut line was ignored.
fn read_live(path: &str) -> (Vec<CpuStream>, bool) {
    let mut streams: Vec<CpuStream> = (0..CPUS).map(|c| CpuStream::new(c, true, false)).collect();
    let mut r = BufReader::with_capacity(1 << 20, File::open(path).expect("live output"));
    let mut buf = Vec::new();
    let mut n = 0u64;
    let mut cut_ignored = false;
    loop {
        buf.clear();
        if r.read_until(b'\n', &mut buf).expect("read live output") == 0 {
            break;
        }
        n += 1;
        let whole = buf.last() == Some(&b'\n');
        let text = String::from_utf8_lossy(&buf);
        let text = text.trim_end_matches('\n');
        match parse_line(text) {
            Ok(line) if whole => feed(&mut streams, &line),
            Ok(Line::Event(e))
                if streams
                    .get_mut(e.cpu as usize)
                    .is_some_and(|s| s.is_whole(&e)) =>
            {
                feed(&mut streams, &Line::Event(e))
            }
            Ok(l @ Line::Drop { .. }) => feed(&mut streams, &l),
            Ok(_) | Err(_) if !whole => cut_ignored = true,
            Ok(_) => unreachable!("a whole line is fed above"),
            Err(e) => panic!("{path}: line {n}: {e}"),
        }
    }
    (streams, cut_ignored)
}

/// What one kill gave, per CPU and in all.
#[derive(Debug, Default, Clone)]
struct Tally {
    kills: u64,
    /// Kills where either output (or the dump's summary) counted losses.
    lossy_kills: u64,
    live_events: u64,
    dumped: u64,
    /// Indexes in "may repeat" ranges.
    marked: u64,
    /// Of the dump's events in them, those the live output printed too.
    marked_seen: u64,
    /// Indexes in other marked ranges (unplaceable).
    marked_other: u64,
    unmarked_duplicates: u64,
    gap_events: u64,
    overcounted: u64,
    /// Kills with an unmarked duplicate, an unexplained gap, a broken stream rule or a
    /// failed dump.
    failing_kills: u64,
    /// Kills with an unmarked duplicate.
    dup_kills: u64,
    /// Kills with an unexplained gap.
    gap_kills: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.kills += o.kills;
        self.lossy_kills += o.lossy_kills;
        self.live_events += o.live_events;
        self.dumped += o.dumped;
        self.marked += o.marked;
        self.marked_seen += o.marked_seen;
        self.marked_other += o.marked_other;
        self.unmarked_duplicates += o.unmarked_duplicates;
        self.gap_events += o.gap_events;
        self.overcounted += o.overcounted;
        self.failing_kills += o.failing_kills;
        self.dup_kills += o.dup_kills;
        self.gap_kills += o.gap_kills;
    }

    fn line(&self) -> String {
        format!(
            "kills {}, lossy {}, events live {}, events dumped {}, repeats marked {} (seen live {}), other marked {}, duplicates found (unmarked) {} in {} kills, unexplained gap events {} in {} kills, losses over-counted {}, failing kills {}",
            self.kills,
            self.lossy_kills,
            self.live_events,
            self.dumped,
            self.marked,
            self.marked_seen,
            self.marked_other,
            self.unmarked_duplicates,
            self.dup_kills,
            self.gap_events,
            self.gap_kills,
            self.overcounted,
            self.failing_kills
        )
    }
}

/// `seqs` as short ranges (`a..b` inclusive), at most a few.
fn ranges(seqs: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < seqs.len() {
        let mut j = i;
        while j + 1 < seqs.len() && seqs[j + 1] == seqs[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            seqs[i].to_string()
        } else {
            format!("{}..{}", seqs[i], seqs[j])
        });
        i = j + 1;
    }
    if out.len() > 4 {
        let n = out.len();
        out.truncate(4);
        out.push(format!("... ({n} ranges)"));
    }
    out.join(", ")
}

/// One kill: run, kill, dump, check. Returns its tally and its failures (examples).
fn one_kill(
    dir: &TempDir,
    round: usize,
    swap: &str,
    mode: &str,
    rate: &str,
    delay_ms: u64,
) -> (Tally, Vec<String>) {
    let mem = dir.file(&format!("vm{round}.trace"));
    let out = dir.file(&format!("live{round}.txt"));
    let err = dir.file(&format!("run{round}.err"));
    let dump = dir.file(&format!("dump{round}.txt"));
    let dump_err = dir.file(&format!("dump{round}.err"));
    run_and_kill(
        &[
            "run",
            "--vcpus",
            "2",
            "--drain",
            "live",
            "--trace-mem",
            &mem,
            "--events",
            "100000000",
            "--rate",
            rate,
            "--buffer-kb",
            "64",
            "--swap",
            swap,
            "--mode",
            mode,
        ],
        &mem,
        &out,
        &err,
        delay_ms,
    );
    let at = format!("kill {round} (--swap {swap} --mode {mode} --rate {rate}, +{delay_ms} ms)");
    let mut fails = Vec::new();
    let mut t = Tally {
        kills: 1,
        ..Tally::default()
    };
    let (live, cut) = read_live(&out);

    let mut child = spawn(
        &["dump", "--trace-mem", &mem, "-o", &dump, "--format", "text"],
        None,
        &dump_err,
    );
    let code = wait_bounded(&mut child, "dump", &dump_err, Instant::now() + WALL);
    let stderr = std::fs::read_to_string(&dump_err).unwrap_or_default();
    assert!(
        !stderr.contains("panicked at"),
        "{at}: dump panicked:\n{stderr}"
    );
    if code != Some(0) {
        fails.push(format!("{at}: dump exited {code:?}: {stderr}"));
    }
    let mut marks: Vec<MarkedRange> = Vec::new();
    let mut summaries: Vec<Option<DumpSummary>> = vec![None; CPUS as usize];
    for l in stderr.lines() {
        match parse_marked(l) {
            Ok(Some(m)) => {
                assert!(m.cpu < CPUS, "{at}: a marked range of cpu {}: {l}", m.cpu);
                marks.push(m);
            }
            Ok(None) => {}
            // The marking format is the contract: a malformed line fails at once.
            Err(e) => panic!("{at}: {e}"),
        }
        if let Some(s) = parse_summary(l) {
            if let Some(slot) = summaries.get_mut(s.cpu as usize) {
                *slot = Some(s);
            }
        }
    }
    let mut dumped: Vec<CpuStream> = (0..CPUS).map(|c| CpuStream::new(c, false, true)).collect();
    if code == Some(0) {
        let text = std::fs::read_to_string(&dump).unwrap_or_else(|e| panic!("{dump}: {e}"));
        for l in parse_all(&text, &dump) {
            feed(&mut dumped, &l);
        }
    }

    let mut failing = code != Some(0);
    let mut lossy = false;
    let mut per_cpu = Vec::new();
    let (mut dup, mut gap) = (false, false);
    for c in 0..CPUS as usize {
        let (l, d, s) = (&live[c], &dumped[c], summaries[c].as_ref());
        for e in l
            .errors
            .iter()
            .map(|e| format!("{at}: live output: {e}"))
            .chain(d.errors.iter().map(|e| format!("{at}: dump: {e}")))
        {
            fails.push(e);
            failing = true;
        }
        match s {
            Some(s) if s.events != d.events => {
                fails.push(format!(
                    "{at}: cpu {c}: the dump's summary says {} events, its output holds {}",
                    s.events, d.events
                ));
                failing = true;
            }
            None if code == Some(0) => {
                fails.push(format!(
                    "{at}: cpu {c}: no summary line on the dump's stderr"
                ));
                failing = true;
            }
            _ => {}
        }
        let cpu_marks: Vec<MarkedRange> = marks
            .iter()
            .filter(|m| m.cpu as usize == c)
            .cloned()
            .collect();
        let v = cross_check(l, d, &cpu_marks, s);
        lossy |= l.dropped + d.dropped + s.map_or(0, |s| s.lost + s.trailing) > 0;
        t.live_events += l.events;
        t.dumped += d.events;
        for m in &cpu_marks {
            if m.repeat {
                t.marked += m.len();
            } else {
                t.marked_other += m.len();
            }
        }
        t.marked_seen += v.marked_repeats_seen;
        t.unmarked_duplicates += v.unmarked_duplicates.len() as u64;
        t.gap_events += v.gap_events();
        t.overcounted += v.overcounted;
        if !v.unmarked_duplicates.is_empty() {
            dup = true;
            fails.push(format!(
                "{at}: cpu {c}: {} dumped events the live output already holds (printed up to seq {}), unmarked: seq {}",
                v.unmarked_duplicates.len(),
                l.last.map_or("none".into(), |s| s.to_string()),
                ranges(&v.unmarked_duplicates)
            ));
        }
        if !v.unexplained_gaps.is_empty() {
            gap = true;
            let g: Vec<String> = v
                .unexplained_gaps
                .iter()
                .map(|&(a, b)| format!("{a}..{} ({})", b - 1, b - a))
                .collect();
            fails.push(format!(
                "{at}: cpu {c}: events in neither output and counted nowhere: seq {} (live ends at {}, dump starts at {} with {} dropped before its first event)",
                g.join(", "),
                v.live_end,
                v.dump_start,
                d.drops_before_first
            ));
        }
        per_cpu.push(format!(
            "cpu{c} live ..{} ({} ev, {} lost) dump {}..{} ({} ev, {} lost){}{}",
            v.live_end,
            l.events,
            l.dropped,
            v.dump_start,
            d.last.map_or("".into(), |s| (s + 1).to_string()),
            d.events,
            d.dropped + s.map_or(0, |s| s.trailing),
            if v.unmarked_duplicates.is_empty() {
                String::new()
            } else {
                format!(" DUP {}", v.unmarked_duplicates.len())
            },
            if v.unexplained_gaps.is_empty() {
                String::new()
            } else {
                format!(" GAP {}", v.gap_events())
            },
        ));
    }
    failing |= dup || gap;
    t.lossy_kills = u64::from(lossy);
    t.failing_kills = u64::from(failing);
    t.dup_kills = u64::from(dup);
    t.gap_kills = u64::from(gap);
    println!(
        "MEASURE {at}: {}; marked ranges {}, dump warnings {}{}{}",
        per_cpu.join(" | "),
        marks.len(),
        stderr
            .lines()
            .filter(|l| l.starts_with("hyptrace: dump: warning"))
            .count(),
        if cut { "; cut last line ignored" } else { "" },
        if failing { "  <-- FAIL" } else { "" }
    );
    // Keep the disk use of flat-out rounds bounded.
    for f in [&mem, &out, &dump] {
        let _ = std::fs::remove_file(f);
    }
    (t, fails)
}

/// Issue 23's acceptance: SIGKILL at ~50 seeded random moments of live runs with
/// `--trace-mem`, both swap modes × both ring modes, quiet and lossy rings; then
/// `dump --trace-mem`: per CPU, the live output and the dump hold every event once
/// (checked by seq), each output's gaps are its drop lines, the gap between them is
/// counted (drop lines before the dump's first event, or a marked range on the dump's
/// stderr), and a dumped event the live output holds must lie in a "may repeat" range.
#[test]
fn sigkill_at_random_moments_live_plus_dump_exactly_once() {
    if !kvm_available(
        KRATE,
        "sigkill_at_random_moments_live_plus_dump_exactly_once",
    ) {
        return;
    }
    let _l = vm_lock();
    let seed = env_u64("HYPTRACE_KILL_SEED").unwrap_or(SEED);
    let kills = env_u64("HYPTRACE_KILL_ROUNDS").map_or(KILLS, |n| n as usize);
    assert!(kills > 0, "HYPTRACE_KILL_ROUNDS must be at least 1");
    println!(
        "MEASURE seed {seed:#x} (HYPTRACE_KILL_SEED={seed:#x} repeats the schedule), {kills} kills"
    );
    let mut rng = Rng(seed);
    let dir = TempDir::new("kill23");
    let started = Instant::now();
    let mut per_combo = vec![Tally::default(); COMBOS.len()];
    let mut fails: Vec<String> = Vec::new();
    let mut fail_count = 0usize;
    for round in 0..kills {
        let (swap, mode) = COMBOS[round % COMBOS.len()];
        let rate = RATES[(round / COMBOS.len()) % RATES.len()];
        let delay = rng.below(MAX_DELAY_MS + 1);
        let (t, f) = one_kill(&dir, round, swap, mode, rate, delay);
        per_combo[round % COMBOS.len()].add(&t);
        fail_count += f.len();
        fails.extend(f.into_iter().take(EXAMPLES.saturating_sub(fails.len())));
    }
    let mut total = Tally::default();
    for (i, t) in per_combo.iter().enumerate() {
        let (swap, mode) = COMBOS[i];
        println!("MEASURE --swap {swap} --mode {mode}: {}", t.line());
        total.add(t);
    }
    println!(
        "MEASURE all: {} ({:.1} s, seed {seed:#x})",
        total.line(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        fails.is_empty(),
        "{} of {} kills broke exactly-once ({} unmarked duplicates in {} kills, {} unexplained gap events in {} kills; seed {seed:#x}); {fail_count} findings, the first {}:\n{}",
        total.failing_kills,
        total.kills,
        total.unmarked_duplicates,
        total.dup_kills,
        total.gap_events,
        total.gap_kills,
        fails.len(),
        fails.join("\n")
    );
}
