//! `trace-cmd report` / `hyptrace run` text lines and the rules of the event stream.
//!
//! ```text
//!            vcpu0-1     [000]  2024.546790718: marker:               seq=0 value=0
//! CPU:0 [12 EVENTS DROPPED]
//! ```

use crate::model::Model;

/// One event line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The comm (`vcpuN`).
    pub comm: String,
    /// The pid (vCPU + 1).
    pub pid: i64,
    /// The CPU column.
    pub cpu: u32,
    /// The timestamp in ns (`report -t` prints ns, `report` µs).
    pub ts_ns: u128,
    /// The event name (without the system).
    pub name: String,
    /// Everything after the name column.
    pub fields: String,
}

impl Event {
    /// The value of `key=` (up to the next space; `msg` takes the rest of the line).
    pub fn field(&self, key: &str) -> Option<&str> {
        let pat = format!("{key}=");
        let start = if self.fields.starts_with(&pat) {
            0
        } else {
            self.fields.find(&format!(" {pat}"))? + 1
        };
        let v = &self.fields[start + pat.len()..];
        if key == "msg" {
            Some(v)
        } else {
            Some(v.split(' ').next().unwrap_or(""))
        }
    }

    /// The `seq` field.
    pub fn seq(&self) -> Option<u64> {
        self.field("seq")?.parse().ok()
    }
}

/// One line of a report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// `cpus=N`.
    Cpus(u32),
    /// An event.
    Event(Event),
    /// `CPU:N [K EVENTS DROPPED]` (`count` None: `[EVENTS DROPPED]`, count unknown).
    Drop {
        /// The CPU.
        cpu: u32,
        /// The count.
        count: Option<u64>,
    },
    /// `hyptrace: merge window exceeded: ...`: a merger printed the oldest events ahead
    /// of a lagging CPU; order across CPUs is not exact after it (per CPU it still is).
    WindowExceeded,
}

fn parse_ts(s: &str) -> Option<u128> {
    let (sec, frac) = s.split_once('.')?;
    if frac.is_empty() || frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let sec: u128 = sec.parse().ok()?;
    let f: u128 = frac.parse().ok()?;
    Some(sec * 1_000_000_000 + f * 10u128.pow(9 - frac.len() as u32))
}

/// Parses one line; `Err` says why it is not a line of ours.
pub fn parse_line(line: &str) -> Result<Line, String> {
    let bad = |why: &str| format!("{why}: {line:?}");
    if let Some(n) = line.strip_prefix("cpus=") {
        return n.parse().map(Line::Cpus).map_err(|_| bad("bad cpus= line"));
    }
    if let Some(rest) = line.strip_prefix("CPU:") {
        let (cpu, rest) = rest.split_once(' ').ok_or_else(|| bad("bad drop line"))?;
        let cpu = cpu.parse().map_err(|_| bad("bad drop cpu"))?;
        if rest == "[EVENTS DROPPED]" {
            return Ok(Line::Drop { cpu, count: None });
        }
        let n = rest
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(" EVENTS DROPPED]"))
            .ok_or_else(|| bad("bad drop line"))?;
        let count = Some(n.parse().map_err(|_| bad("bad drop count"))?);
        return Ok(Line::Drop { cpu, count });
    }
    if line.starts_with("hyptrace: merge window exceeded: ") {
        return Ok(Line::WindowExceeded);
    }
    let (head, rest) = line.split_once(" [").ok_or_else(|| bad("no cpu column"))?;
    let (comm, pid) = head
        .trim_start()
        .rsplit_once('-')
        .ok_or_else(|| bad("no comm-pid"))?;
    let pid = pid.trim_end().parse().map_err(|_| bad("bad pid"))?;
    let (cpu, rest) = rest.split_once(']').ok_or_else(|| bad("no ]"))?;
    let cpu = cpu.parse().map_err(|_| bad("bad cpu"))?;
    let (ts, rest) = rest
        .trim_start()
        .split_once(": ")
        .ok_or_else(|| bad("no ts"))?;
    let ts_ns = parse_ts(ts).ok_or_else(|| bad("bad timestamp"))?;
    let (name, fields) = rest.split_once(':').ok_or_else(|| bad("no event name"))?;
    Ok(Line::Event(Event {
        comm: comm.to_string(),
        pid,
        cpu,
        ts_ns,
        name: name.to_string(),
        fields: fields.trim_start().to_string(),
    }))
}

/// Parses every line; panics on a line that is not ours (with `what` in the message).
pub fn parse_all(text: &str, what: &str) -> Vec<Line> {
    text.lines()
        .enumerate()
        .map(|(i, l)| parse_line(l).unwrap_or_else(|e| panic!("{what}: line {}: {e}", i + 1)))
        .collect()
}

/// Collapses runs of spaces (to compare our lines with trace-cmd's).
pub fn collapse_spaces(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut space = false;
    for c in s.chars() {
        if c == ' ' {
            if !space {
                out.push(' ');
            }
            space = true;
        } else {
            out.push(c);
            space = false;
        }
    }
    out
}

/// What one CPU's stream held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuTally {
    /// Event lines.
    pub events: u64,
    /// Sum of the printed drop counts.
    pub dropped: u64,
    /// Drop lines.
    pub drop_lines: u64,
    /// Drop counts printed after the CPU's last event (losses at the end of the run).
    pub trailing: u64,
    /// The last seq seen.
    pub last_seq: Option<u64>,
}

/// How [`check_stream`] checks the event lines.
#[derive(Debug, Clone)]
pub struct StreamRules {
    /// The vCPUs of the run.
    pub cpus: u32,
    /// The workload (`steady`, `mixed`, ...) whose fields every event must carry, or
    /// `None` to check only the seq rule.
    pub workload: Option<String>,
    /// The CPUs are merged by time (`report`, `run`): timestamps never go back over
    /// the whole stream. `false` (the text sink writes pages as they arrive): only
    /// per CPU.
    pub merged: bool,
}

/// Checks a parsed report:
/// - at most one `cpus=` line, first, equal to the number of vCPUs;
/// - every event: CPU in range, comm `vcpuN`, pid N+1, a `seq` field; per CPU, `seq`
///   strictly increasing and every gap equal to the sum of the drop counts printed
///   (for that CPU) since its previous event; the first gap from 0 too;
/// - no drop line without a count; no zero count;
/// - with a workload: every event's name and fields are exactly what it writes;
/// - timestamps non-decreasing over the merged stream (per CPU if not merged); after a
///   merge-window line only per CPU (the merger says order across CPUs is lost).
///
/// Returns the per-CPU tallies.
pub fn check_stream(lines: &[Line], rules: &StreamRules) -> Vec<CpuTally> {
    let n = rules.cpus as usize;
    let mut tally = vec![CpuTally::default(); n];
    let mut next = vec![0u64; n];
    let mut pending = vec![0u64; n];
    let mut models: Vec<Option<Model>> = (0..rules.cpus)
        .map(|c| rules.workload.as_deref().map(|w| Model::new(w, c)))
        .collect();
    let mut last_ts = 0u128;
    let mut exact_merge = rules.merged;
    let mut cpu_ts = vec![0u128; n];
    for (i, line) in lines.iter().enumerate() {
        let at = format!("line {}: {line:?}", i + 1);
        match line {
            Line::Cpus(c) => {
                assert_eq!(i, 0, "{at}: cpus= not first");
                assert_eq!(*c, rules.cpus, "{at}");
            }
            Line::WindowExceeded => exact_merge = false,
            Line::Drop { cpu, count } => {
                let c = *cpu as usize;
                assert!(c < n, "{at}: cpu out of range");
                let count = count.unwrap_or_else(|| panic!("{at}: drop without a count"));
                assert!(count > 0, "{at}: zero drop count");
                pending[c] += count;
                tally[c].dropped += count;
                tally[c].drop_lines += 1;
            }
            // The trace.dat carrier of a trailing loss (the drop line before it counts).
            Line::Event(e) if e.name == "trailing_lost" => {}
            Line::Event(e) => {
                let c = e.cpu as usize;
                assert!(c < n, "{at}: cpu out of range");
                assert_eq!(e.comm, format!("vcpu{c}"), "{at}");
                assert_eq!(e.pid, c as i64 + 1, "{at}");
                let seq = e.seq().unwrap_or_else(|| panic!("{at}: no seq"));
                assert_eq!(
                    seq,
                    next[c] + pending[c],
                    "{at}: cpu {c}: seq gap does not match the drops printed before it \
                     (expected {} + dropped {})",
                    next[c],
                    pending[c]
                );
                pending[c] = 0;
                next[c] = seq + 1;
                tally[c].events += 1;
                tally[c].last_seq = Some(seq);
                if let Some(m) = models[c].as_mut() {
                    let want = m.at(seq);
                    assert_eq!(e.name, want.name, "{at}");
                    assert_eq!(e.fields, want.fields, "{at}");
                }
                assert!(
                    e.ts_ns >= cpu_ts[c],
                    "{at}: cpu {c}: timestamp goes back ({} < {})",
                    e.ts_ns,
                    cpu_ts[c]
                );
                cpu_ts[c] = e.ts_ns;
                if exact_merge {
                    assert!(
                        e.ts_ns >= last_ts,
                        "{at}: timestamp goes back ({} < {last_ts})",
                        e.ts_ns
                    );
                    last_ts = e.ts_ns;
                }
            }
        }
    }
    for (c, t) in tally.iter_mut().enumerate() {
        t.trailing = pending[c];
    }
    tally
}
