//! Exactly-once accounting of a killed run's live output plus its `hyptrace dump
//! --trace-mem` (issue 23): every event of a CPU, by its index (`seq` of the marker
//! workload), is printed once by the live output or the dump, or counted lost by a drop
//! line — except the events the dump *marks*:
//!
//! ```text
//! hyptrace: dump: cpu N: events A..B (K) may repeat the live output (the VMM was killed between printing them and recording it)
//! ```
//!
//! (`A..B` inclusive, `K = B - A + 1`): the dump's events in such a range may also be
//! in the live output. A line of the same shape with another reason (`hyptrace: dump:
//! cpu N: events A..B (K) <why>`, e.g. events consumed after the last record and no
//! longer in the rings: unplaceable) counts and marks a range that may be in neither
//! output: it explains a gap, never a duplicate.
//!
//! [`CpuStream`] checks one output's lines of one CPU as they come (seq increasing, every
//! gap equal to the drops printed since the previous event, every field what the
//! workload wrote); [`cross_check`] compares the live stream, the dump stream and the
//! dump's marks of a CPU.

use crate::model::Model;
use crate::text::{Event, Line};

/// The reason text of a "may repeat" line, exactly.
pub const MAY_REPEAT: &str =
    "may repeat the live output (the VMM was killed between printing them and recording it)";

/// A range of event indexes a dump's stderr marks on one CPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkedRange {
    /// The CPU.
    pub cpu: u32,
    /// First index of the range.
    pub first: u64,
    /// Last index of the range (inclusive).
    pub last: u64,
    /// The reason is [`MAY_REPEAT`] (else the range only counts events, e.g.
    /// unplaceable ones).
    pub repeat: bool,
}

impl MarkedRange {
    /// Whether `seq` lies in the range.
    pub fn contains(&self, seq: u64) -> bool {
        (self.first..=self.last).contains(&seq)
    }

    /// Number of indexes in the range.
    pub fn len(&self) -> u64 {
        self.last - self.first + 1
    }

    /// Never empty (a parsed range has `first <= last`); for clippy's `len` rule.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Parses one line of a dump's stderr: `Ok(Some)` a marked range, `Ok(None)` another
/// line, `Err` a line that looks like a marked range (`hyptrace: dump: cpu N: events ...`
/// or any line saying `may repeat`) but is malformed.
pub fn parse_marked(line: &str) -> Result<Option<MarkedRange>, String> {
    let bad = |why: &str| Err(format!("malformed marked range ({why}): {line:?}"));
    let Some(rest) = line.strip_prefix("hyptrace: dump: cpu ") else {
        return if line.contains("may repeat") {
            bad("not `hyptrace: dump: cpu N: ...`")
        } else {
            Ok(None)
        };
    };
    let Some((cpu, rest)) = rest.split_once(": ") else {
        return if line.contains("may repeat") {
            bad("no `cpu N: `")
        } else {
            Ok(None)
        };
    };
    let Some(rest) = rest.strip_prefix("events ") else {
        // The per-CPU summary (`cpu N: E events, ...`) and warnings.
        return if line.contains("may repeat") {
            bad("no `events A..B`")
        } else {
            Ok(None)
        };
    };
    let Ok(cpu) = cpu.parse::<u32>() else {
        return bad("cpu");
    };
    let Some((range, rest)) = rest.split_once(' ') else {
        return bad("no count");
    };
    let Some((a, b)) = range.split_once("..") else {
        return bad("range not A..B");
    };
    let (Ok(first), Ok(last)) = (a.parse::<u64>(), b.parse::<u64>()) else {
        return bad("range bounds");
    };
    if first > last {
        return bad("A > B");
    }
    let Some((k, why)) = rest.strip_prefix('(').and_then(|r| r.split_once(") ")) else {
        return bad("no `(K) `");
    };
    let Ok(k) = k.parse::<u64>() else {
        return bad("K");
    };
    if k != last - first + 1 {
        return bad("K is not B - A + 1");
    }
    let repeat = why == MAY_REPEAT;
    if why.is_empty() || (!repeat && why.contains("may repeat")) {
        return bad("reason");
    }
    Ok(Some(MarkedRange {
        cpu,
        first,
        last,
        repeat,
    }))
}

/// The per-CPU summary line of a dump's stderr:
/// `hyptrace: dump: cpu N: E events, X lost before them, Y lost after the last page
/// (writer index W)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DumpSummary {
    /// The CPU.
    pub cpu: u32,
    /// Events dumped.
    pub events: u64,
    /// Lost before or between them.
    pub lost: u64,
    /// Lost after the last page.
    pub trailing: u64,
    /// The writer's index (the control block's `entries`: may lag the pages by one).
    pub writer_index: u64,
}

/// Parses a per-CPU summary line of a dump's stderr (None: another line).
pub fn parse_summary(line: &str) -> Option<DumpSummary> {
    let rest = line.strip_prefix("hyptrace: dump: cpu ")?;
    let (cpu, rest) = rest.split_once(": ")?;
    let (events, rest) = rest.split_once(" events, ")?;
    let (lost, rest) = rest.split_once(" lost before them, ")?;
    let (trailing, rest) = rest.split_once(" lost after the last page (writer index ")?;
    let w = rest.strip_suffix(')')?;
    Some(DumpSummary {
        cpu: cpu.parse().ok()?,
        events: events.parse().ok()?,
        lost: lost.parse().ok()?,
        trailing: trailing.parse().ok()?,
        writer_index: w.parse().ok()?,
    })
}

/// One output's stream of one CPU, checked as its lines come.
#[derive(Debug, Clone)]
pub struct CpuStream {
    cpu: u32,
    /// The first event must be preceded by drops summing to its seq (a stream from the
    /// run's start: the live output); else its start is free (a dump).
    from_zero: bool,
    model: Model,
    /// Event lines.
    pub events: u64,
    /// The first event's seq.
    pub first: Option<u64>,
    /// Drops printed before the first event.
    pub drops_before_first: u64,
    /// The last event's seq.
    pub last: Option<u64>,
    /// Drops printed since the last event (all of them while there is none).
    pub pending: u64,
    /// Sum of the drop counts.
    pub dropped: u64,
    /// Index ranges `[start, end)` the drop lines count (for a dump, those before its
    /// first event start at its implied start: `first - drops_before_first`).
    pub drop_ranges: Vec<(u64, u64)>,
    /// Every event's seq, if kept (a dump: at most a ring of them).
    pub seqs: Option<Vec<u64>>,
    /// Rule violations (at most [`MAX_ERRORS`] kept), and how many in all.
    pub errors: Vec<String>,
    /// Number of rule violations.
    pub error_count: u64,
}

/// Violations kept per stream.
pub const MAX_ERRORS: usize = 5;

impl CpuStream {
    /// A new stream of `cpu` for the marker workload; `keep_seqs` keeps every seq.
    pub fn new(cpu: u32, from_zero: bool, keep_seqs: bool) -> Self {
        Self {
            cpu,
            from_zero,
            model: Model::new("steady", cpu),
            events: 0,
            first: None,
            drops_before_first: 0,
            last: None,
            pending: 0,
            dropped: 0,
            drop_ranges: Vec::new(),
            seqs: keep_seqs.then(Vec::new),
            errors: Vec::new(),
            error_count: 0,
        }
    }

    fn error(&mut self, e: String) {
        self.error_count += 1;
        if self.errors.len() < MAX_ERRORS {
            self.errors.push(format!("cpu {}: {e}", self.cpu));
        }
    }

    /// Whether `e` is exactly an event the workload wrote on this CPU (name, fields,
    /// comm, pid): a line cut by a kill is not (its last field is short or missing).
    pub fn is_whole(&mut self, e: &Event) -> bool {
        let Some(seq) = e.seq() else { return false };
        let want = self.model.at(seq);
        e.name == want.name
            && e.fields == want.fields
            && e.comm == format!("vcpu{}", self.cpu)
            && e.pid == i64::from(self.cpu) + 1
    }

    /// A drop line of this CPU (`count` None: without a count, a violation).
    pub fn drop_line(&mut self, count: Option<u64>) {
        match count {
            Some(0) => self.error("a drop line with a count of 0".into()),
            Some(k) => {
                self.pending += k;
                self.dropped += k;
            }
            None => self.error("a drop line without a count".into()),
        }
    }

    /// An event line of this CPU.
    pub fn event(&mut self, e: &Event) {
        let Some(seq) = e.seq() else {
            self.error(format!("an event without seq: {e:?}"));
            return;
        };
        if !self.is_whole(e) {
            self.error(format!("not what the workload wrote: {e:?}"));
        }
        let pending = std::mem::take(&mut self.pending);
        match self.last {
            Some(last) => {
                if seq != last + 1 + pending {
                    self.error(format!(
                        "seq {seq} after {last} with {pending} dropped between (expected {})",
                        last + 1 + pending
                    ));
                }
            }
            None if self.from_zero => {
                if seq != pending {
                    self.error(format!(
                        "first seq {seq}, but {pending} dropped before it (expected {pending})"
                    ));
                }
                self.first = Some(seq);
                self.drops_before_first = pending;
            }
            None => {
                self.first = Some(seq);
                self.drops_before_first = pending;
            }
        }
        if pending > 0 {
            self.drop_ranges.push((seq.saturating_sub(pending), seq));
        }
        self.last = Some(seq);
        self.events += 1;
        if let Some(v) = self.seqs.as_mut() {
            v.push(seq);
        }
    }

    /// The index after everything this stream accounts for: after its last event and
    /// the drops printed after it (for a stream from the run's start: the drops alone
    /// when it has no event).
    pub fn end(&self) -> u64 {
        self.last.map_or(0, |l| l + 1) + self.pending
    }

    /// Where a dump's stream starts: its first event less the drops printed before it;
    /// None without an event.
    pub fn start(&self) -> Option<u64> {
        self.first.map(|f| f - self.drops_before_first.min(f))
    }
}

/// Feeds one parsed line to the streams of its CPU (lines of other CPUs than
/// `streams.len()` are violations of stream 0, `cpus=` and merge-window lines pass).
pub fn feed(streams: &mut [CpuStream], line: &Line) {
    match line {
        Line::Cpus(n) => {
            if *n as usize != streams.len() {
                streams[0].error(format!("cpus={n}, the run has {}", streams.len()));
            }
        }
        Line::WindowExceeded => {}
        Line::Drop { cpu, count } => match streams.get_mut(*cpu as usize) {
            Some(s) => s.drop_line(*count),
            None => streams[0].error(format!("a drop line of cpu {cpu}")),
        },
        Line::Event(e) => match streams.get_mut(e.cpu as usize) {
            Some(s) => s.event(e),
            None => streams[0].error(format!("an event of cpu {}: {e:?}", e.cpu)),
        },
    }
}

/// What [`cross_check`] found on one CPU.
#[derive(Debug, Clone, Default)]
pub struct CpuVerdict {
    /// Dumped events that the live output also accounts for (printed or counted
    /// lost) and no "may repeat" range marks: each with its seq.
    pub unmarked_duplicates: Vec<u64>,
    /// Dumped events in a "may repeat" range that the live output printed too.
    pub marked_repeats_seen: u64,
    /// Indexes in neither output nor counted lost by either, nor in a marked range:
    /// ranges `[start, end)`.
    pub unexplained_gaps: Vec<(u64, u64)>,
    /// Indexes the live output printed or counted and the dump counts lost too
    /// (a miscount, not a duplicate event).
    pub overcounted: u64,
    /// The live output's end and the dump's start (as used).
    pub live_end: u64,
    /// The dump's start: its first event less the drops printed before it, or (no
    /// event) the writer index less the losses its summary counts.
    pub dump_start: u64,
}

impl CpuVerdict {
    /// Events in neither output, unexplained.
    pub fn gap_events(&self) -> u64 {
        self.unexplained_gaps.iter().map(|(a, b)| b - a).sum()
    }
}

/// Overlap of `[a, b)` with `[c, d)`.
fn overlap(a: u64, b: u64, c: u64, d: u64) -> u64 {
    b.min(d).saturating_sub(a.max(c))
}

/// Compares one CPU's live stream (from the run's start) with its dump stream and the
/// dump's marks of that CPU. `summary` is the dump's per-CPU summary (its writer index
/// gives the dump's start when it has no event).
pub fn cross_check(
    live: &CpuStream,
    dump: &CpuStream,
    marks: &[MarkedRange],
    summary: Option<&DumpSummary>,
) -> CpuVerdict {
    let live_end = live.end();
    let dump_start = dump.start().unwrap_or_else(|| {
        summary.map_or(live_end, |s| {
            s.writer_index
                .saturating_sub(s.lost.saturating_add(s.trailing))
        })
    });
    let mut v = CpuVerdict {
        live_end,
        dump_start,
        ..CpuVerdict::default()
    };
    // The dump's events the live output accounts for.
    for &seq in dump.seqs.as_deref().unwrap_or(&[]) {
        if seq >= live_end {
            continue;
        }
        let printed_live = !live.drop_ranges.iter().any(|&(a, b)| (a..b).contains(&seq));
        if marks.iter().any(|m| m.repeat && m.contains(seq)) {
            if printed_live {
                v.marked_repeats_seen += 1;
            }
        } else {
            v.unmarked_duplicates.push(seq);
        }
    }
    // The dump's drop counts of indexes the live output accounts for. Those before the
    // first event start at the dump's implied start (`drop_ranges` holds them).
    v.overcounted = dump
        .drop_ranges
        .iter()
        .map(|&(a, b)| overlap(a, b, 0, live_end))
        .sum();
    // Between the live output's end and the dump's start: nothing, or marked.
    if dump_start > live_end {
        let mut at = live_end;
        while at < dump_start {
            if let Some(m) = marks.iter().find(|m| m.contains(at)) {
                at = m.last + 1;
                continue;
            }
            // The next marked start, or the dump's start.
            let next = marks
                .iter()
                .filter(|m| m.first > at)
                .map(|m| m.first)
                .min()
                .unwrap_or(dump_start)
                .min(dump_start);
            v.unexplained_gaps.push((at, next));
            at = next;
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marked_lines() {
        let ok = format!("hyptrace: dump: cpu 1: events 10..12 (3) {MAY_REPEAT}");
        assert_eq!(
            parse_marked(&ok),
            Ok(Some(MarkedRange {
                cpu: 1,
                first: 10,
                last: 12,
                repeat: true
            }))
        );
        let other =
            "hyptrace: dump: cpu 0: events 5..5 (1) unplaceable: consumed after the last record";
        assert!(matches!(
            parse_marked(other),
            Ok(Some(MarkedRange { repeat: false, .. }))
        ));
        let summary = "hyptrace: dump: cpu 0: 81 events, 0 lost before them, 0 lost after the last page (writer index 11012)";
        assert_eq!(parse_marked(summary), Ok(None));
        assert_eq!(parse_summary(summary).map(|s| s.writer_index), Some(11012));
        for bad in [
            format!("hyptrace: dump: cpu 1: events 10..12 (4) {MAY_REPEAT}"),
            format!("hyptrace: dump: cpu 1: events 12..10 (3) {MAY_REPEAT}"),
            format!("hyptrace: dump: cpu x: events 10..12 (3) {MAY_REPEAT}"),
            format!("hyptrace: dump: cpu 1: events 10-12 (3) {MAY_REPEAT}"),
            "hyptrace: dump: cpu 1: events 10..12 (3) may repeat".to_string(),
            "hyptrace: dump: cpu 1: 3 events may repeat".to_string(),
        ] {
            assert!(parse_marked(&bad).is_err(), "{bad}");
        }
    }

    fn ev(cpu: u32, seq: u64) -> Line {
        Line::Event(Event {
            comm: format!("vcpu{cpu}"),
            pid: i64::from(cpu) + 1,
            cpu,
            ts_ns: seq as u128,
            name: "marker".into(),
            fields: format!("seq={seq} value={seq}"),
        })
    }

    fn streams(lines: &[Line], from_zero: bool) -> CpuStream {
        let mut s = [CpuStream::new(0, from_zero, !from_zero)];
        for l in lines {
            feed(&mut s, l);
        }
        let [s] = s;
        s
    }

    #[test]
    fn cross_check_finds_duplicates_and_gaps() {
        // Live: 0..=9, 5 dropped, 15..=19.
        let mut live: Vec<Line> = (0..10).map(|i| ev(0, i)).collect();
        live.push(Line::Drop {
            cpu: 0,
            count: Some(5),
        });
        live.extend((15..20).map(|i| ev(0, i)));
        let live = streams(&live, true);
        assert!(live.errors.is_empty(), "{:?}", live.errors);
        assert_eq!(live.end(), 20);
        // Exactly once: the dump starts at 20.
        let dump = streams(&(20..25).map(|i| ev(0, i)).collect::<Vec<_>>(), false);
        let v = cross_check(&live, &dump, &[], None);
        assert!(v.unmarked_duplicates.is_empty() && v.unexplained_gaps.is_empty());
        // Repeats 18, 19: unmarked, then marked.
        let dump = streams(&(18..25).map(|i| ev(0, i)).collect::<Vec<_>>(), false);
        let v = cross_check(&live, &dump, &[], None);
        assert_eq!(v.unmarked_duplicates, vec![18, 19]);
        let mark = MarkedRange {
            cpu: 0,
            first: 18,
            last: 19,
            repeat: true,
        };
        let v = cross_check(&live, &dump, std::slice::from_ref(&mark), None);
        assert!(v.unmarked_duplicates.is_empty());
        assert_eq!(v.marked_repeats_seen, 2);
        // A gap 20..=22: unexplained; explained by drops before the first event, or by
        // a marked range.
        let dump = streams(&(23..25).map(|i| ev(0, i)).collect::<Vec<_>>(), false);
        let v = cross_check(&live, &dump, &[], None);
        assert_eq!(v.unexplained_gaps, vec![(20, 23)]);
        let mut with_drop = vec![Line::Drop {
            cpu: 0,
            count: Some(3),
        }];
        with_drop.extend((23..25).map(|i| ev(0, i)));
        let v = cross_check(&live, &streams(&with_drop, false), &[], None);
        assert!(v.unexplained_gaps.is_empty());
        let other = MarkedRange {
            cpu: 0,
            first: 21,
            last: 22,
            repeat: false,
        };
        let v = cross_check(&live, &dump, &[other], None);
        assert_eq!(v.unexplained_gaps, vec![(20, 21)]);
        // An empty dump starts at the writer index less its losses.
        let empty = streams(&[], false);
        let s = DumpSummary {
            cpu: 0,
            events: 0,
            lost: 0,
            trailing: 2,
            writer_index: 24,
        };
        let v = cross_check(&live, &empty, &[], Some(&s));
        assert_eq!(v.unexplained_gaps, vec![(20, 22)]);
        // A stream whose seq does not follow its drops breaks its own rule.
        let bad = streams(&[ev(0, 0), ev(0, 2)], true);
        assert_eq!(bad.error_count, 1);
    }
}
