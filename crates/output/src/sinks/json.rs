//! The Chrome trace-event JSON sink (chrome://tracing, Perfetto's legacy importer).

use crate::error::PageProblem;
use hyptrace_format::EventFormat;

use super::merged::{release_merged, Piece};
use super::stream::{page_events, StreamOut, StreamSink, JSON_PID, PROCESS_NAME};
use crate::export::{export_page_into, page_missed, Missed};
use crate::merge::{MergeWindow, Merged, Merger};
use crate::sink::{PageSink, RunSummary, TraceMeta};
use crate::text::{field_bytes, field_int};
use crate::OutputError;

/// Formats `ns` as µs with 3 decimals (a JSON number).
fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1000, ns % 1000)
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// JavaScript's `Number.MAX_SAFE_INTEGER` (2^53 − 1): larger integers lose precision in
/// a JSON viewer.
pub const JSON_MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// An integer field as JSON: a number when a JavaScript viewer holds it exactly
/// (|v| ≤ 2^53 − 1), else its decimal digits as a string.
fn json_int(v: u64, signed: bool) -> serde_json::Value {
    if signed {
        let i = v as i64;
        if i.unsigned_abs() <= JSON_MAX_SAFE_INTEGER {
            serde_json::Value::from(i)
        } else {
            serde_json::Value::from(i.to_string())
        }
    } else if v <= JSON_MAX_SAFE_INTEGER {
        serde_json::Value::from(v)
    } else {
        serde_json::Value::from(v.to_string())
    }
}

/// Event fields as a JSON object (integers as numbers — as strings above 2^53 − 1, see
/// [`JSON_MAX_SAFE_INTEGER`] — strings as strings).
fn json_args(f: &EventFormat, payload: &[u8]) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    for fd in &f.fields {
        let v = if fd.is_string() {
            field_bytes(fd, payload)
                .map(|b| serde_json::Value::from(String::from_utf8_lossy(b).into_owned()))
        } else if fd.is_array() || fd.is_data_loc() || fd.is_rel_loc() {
            field_bytes(fd, payload).map(|b| serde_json::Value::from(b.to_vec()))
        } else {
            field_int(fd, payload).map(|v| json_int(v, fd.signed))
        };
        m.insert(fd.name.clone(), v.unwrap_or(serde_json::Value::Null));
    }
    m
}

/// Chrome trace-event JSON sink (chrome://tracing, Perfetto): `pid` 1 (the VM), one
/// track per vCPU (`tid` = vCPU number, `thread_name` metadata `vcpu<n>`), instant
/// events (`ph: "i"`) for markers/text/other events, complete events (`ph: "X"`) for
/// `guest:span` (the span event is written when the span ends: `ts = event − dur`,
/// `dur` converted from TSC cycles), instant `lost events` markers (args `count`),
/// timestamps in µs with 3 decimals (ns precision).
///
/// Entries are written in time order across CPUs (`ts` non-decreasing in file order;
/// a `guest:span` sorts at its end, `ts + dur`), with the one [`Merger`] of the text
/// sink and `hyptrace run`, under the same bound ([`MergeWindow::DEFAULT`]): past it,
/// a `merge window exceeded` instant (args `held`, `lagging_cpu`) and the oldest
/// entries are written, as [`TextSink`](crate::TextSink) does.
pub struct JsonSink {
    meta: TraceMeta,
    out: Option<StreamOut>,
    scratch: Vec<u8>,
    first: bool,
    /// Per CPU: raw time of its last event (or lossy page).
    last: Vec<u64>,
    /// Formatted entries waiting for the watermark, keyed by their time in ns.
    merger: Merger<String>,
    /// Where released entries are gathered before a write.
    buf: String,
    /// Time of the last entry released (where a window marker goes).
    released_ns: u64,
    /// Per CPU: where its entries go.
    places: Vec<Place>,
}

/// Where a CPU's entries go: its process and thread, and its VM's name when the trace
/// holds several ([`TraceMeta::groups`]).
struct Place {
    /// `"pid":P,"tid":T`, and `,"vm":NAME` with a VM's name.
    ids: String,
    /// Whether the CPU is a VM's of several.
    grouped: bool,
}

/// The pid of a VM of several: its first vCPU's (as in Perfetto).
fn group_pid(g: &crate::sink::CpuGroup) -> u32 {
    hyptrace_abi::events::vcpu_pid(g.first) as u32
}

impl Place {
    /// CPU `cpu`'s: of its VM (pid: the VM's, tid: the vCPU's number in the VM, the VM
    /// named), else of the one VM ([`JSON_PID`], tid: the CPU).
    fn of(meta: &TraceMeta, cpu: u32) -> Self {
        match meta.group_of(cpu) {
            Some((_, g)) => Self {
                ids: format!(
                    "\"pid\":{},\"tid\":{},\"vm\":{}",
                    group_pid(g),
                    cpu - g.first,
                    json_str(&g.name)
                ),
                grouped: true,
            },
            None => Self {
                ids: format!("\"pid\":{JSON_PID},\"tid\":{cpu}"),
                grouped: false,
            },
        }
    }
}

/// Chrome JSON: the `traceEvents` array opened, the process and thread names.
impl StreamSink for JsonSink {
    fn from_output(out: StreamOut, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        let places = (0..meta.nr_cpus).map(|c| Place::of(&meta, c)).collect();
        let mut s = Self {
            places,
            scratch: vec![0; meta.page_size],
            last: vec![0; meta.nr_cpus as usize],
            merger: Merger::with_window(meta.nr_cpus as usize, MergeWindow::DEFAULT),
            buf: String::new(),
            released_ns: 0,
            meta,
            out: Some(out),
            first: true,
        };
        s.raw("{\"traceEvents\":[\n")?;
        // The VM's process; with groups (several VMs), one per VM, and the VM's only
        // for the CPUs of no group.
        let mut processes: Vec<(u32, &str)> = Vec::new();
        if s.places.iter().any(|p| !p.grouped) {
            processes.push((JSON_PID, PROCESS_NAME));
        }
        for g in &s.meta.groups {
            processes.push((group_pid(g), &g.name));
        }
        let mut head = Vec::new();
        for (pid, name) in processes {
            head.push(format!(
                "{{\"name\":\"process_name\",\"ph\":\"M\",\"ts\":0,\"pid\":{pid},\"tid\":0,\"args\":{{\"name\":{}}}}}",
                json_str(name)
            ));
        }
        for cpu in 0..s.meta.nr_cpus {
            let name = s
                .meta
                .cmdlines
                .get(&hyptrace_abi::events::vcpu_pid(cpu))
                .cloned()
                .or_else(|| s.meta.host_cpu(cpu).map(|k| format!("host cpu{k}")))
                .unwrap_or_else(|| format!("vcpu{cpu}"));
            head.push(format!(
                "{{\"name\":\"thread_name\",\"ph\":\"M\",\"ts\":0,{},\"args\":{{\"name\":{}}}}}",
                s.places[cpu as usize].ids,
                json_str(&name)
            ));
        }
        for e in head {
            s.entry(&e)?;
        }
        Ok(s)
    }
}

impl JsonSink {
    fn raw(&mut self, s: &str) -> Result<(), OutputError> {
        match self.out.as_mut() {
            Some(o) => o.write_all(s.as_bytes()),
            None => Ok(()),
        }
    }

    fn entry(&mut self, e: &str) -> Result<(), OutputError> {
        let sep = if self.first { "" } else { ",\n" };
        self.first = false;
        self.raw(sep)?;
        self.raw(e)
    }

    /// Writes, in time order, every queued entry the merger releases (all of them when
    /// `all`), and the window marker if it is exceeded.
    fn release(&mut self, all: bool) -> Result<(), OutputError> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        let first = &mut self.first;
        let released = &mut self.released_ns;
        release_merged(&mut self.merger, out, &mut self.buf, all, |buf, piece| {
            if !std::mem::replace(first, false) {
                buf.push_str(",\n");
            }
            match piece {
                Piece::Item { ts, text } => {
                    *released = ts;
                    buf.push_str(text);
                }
                Piece::WindowExceeded { held, lagging } => {
                    let lagging = lagging.map_or_else(|| "null".to_string(), |c| c.to_string());
                    buf.push_str(&format!(
                        "{{\"name\":\"merge window exceeded\",\"cat\":\"hyptrace\",\"ph\":\"i\",\"s\":\"g\",\"ts\":{},\"pid\":{JSON_PID},\"tid\":0,\"args\":{{\"held\":{held},\"lagging_cpu\":{lagging}}}}}",
                        us(*released)
                    ));
                }
            }
        })
    }

    /// Queues entry `e` of `cpu` at `ns` (its length counts against the window).
    fn queue(&mut self, cpu: u32, ns: u64, e: String) {
        let n = e.len();
        self.merger
            .push_sized(cpu as usize, ns, Merged::Event(e), n);
    }
}

impl PageSink for JsonSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        self.meta.check_page(cpu, page)?;
        export_page_into(cpu, page, missed, &mut self.scratch)?;
        let scratch = std::mem::take(&mut self.scratch);
        self.page_inner(cpu, &scratch);
        self.scratch = scratch;
        if self.merger.last(cpu as usize).is_none() {
            // A page without events still tells that this CPU delivers.
            self.merger.advance(cpu as usize, 0);
        }
        self.release(false)
    }

    /// Entries of other CPUs up to `ts` no longer wait for `cpu`.
    fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
        if self.out.is_none() || cpu >= self.meta.nr_cpus {
            return Ok(());
        }
        self.merger.advance(cpu as usize, self.meta.clock.to_ns(ts));
        self.release(false)
    }

    /// A `lost events` instant (args `count`) at the time of the CPU's last event.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        let Some(&ts) = self.last.get(cpu as usize) else {
            return Err(OutputError::BadPage {
                cpu,
                problem: PageProblem::NoSuchCpu {
                    cpu,
                    nr_cpus: self.meta.nr_cpus,
                },
            });
        };
        if lost == 0 {
            return Ok(());
        }
        self.lost_entry(cpu, ts, &format!("{{\"count\":{lost}}}"));
        self.release(false)
    }

    fn finish(mut self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        self.release(true)?;
        self.raw("\n],\"displayTimeUnit\":\"ns\"}\n")?;
        match self.out.take() {
            Some(o) => o.close(),
            None => Ok(()),
        }
    }
}

impl JsonSink {
    fn lost_entry(&mut self, cpu: u32, ts: u64, args: &str) {
        let ns = self.meta.clock.to_ns(ts);
        // Never before the CPU's last queued entry (a trailing loss at its last event).
        let ns = ns.max(self.merger.last(cpu as usize).unwrap_or(0));
        let e = format!(
            "{{\"name\":\"lost events\",\"cat\":\"hyptrace\",\"ph\":\"i\",\"s\":\"t\",\"ts\":{},{},\"args\":{args}}}",
            us(ns),
            self.places[cpu as usize].ids
        );
        self.queue(cpu, ns, e);
    }

    /// Queues the entries of one exported page.
    fn page_inner(&mut self, cpu: u32, page: &[u8]) {
        let (page_ts, events, _err) = page_events(page);
        let clock = self.meta.clock.clone();
        match page_missed(page) {
            Missed::None => {}
            m => {
                let args = match m {
                    Missed::Count(n) => format!("{{\"count\":{n}}}"),
                    _ => "{\"count\":null}".into(),
                };
                let ts = events.first().map_or(page_ts, |e| e.0);
                self.lost_entry(cpu, ts, &args);
            }
        }
        if let Some(&(ts, _)) = events.last() {
            self.last[cpu as usize] = ts;
        } else if page_missed(page) != Missed::None {
            self.last[cpu as usize] = page_ts;
        }
        for (ts, payload) in events {
            let ts_ns = clock.to_ns(ts);
            let id = payload
                .get(..2)
                .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
            let format = self.meta.format(id);
            let (name, cat, args) = match format {
                Some(f) => (f.name.clone(), f.system.clone(), json_args(f, payload)),
                None => (
                    format!("event_{id}"),
                    "unknown".to_string(),
                    serde_json::Map::new(),
                ),
            };
            // The duration from the field itself (the arg is a string above 2^53).
            let dur_cyc = format
                .and_then(|f| f.fields.iter().find(|fd| fd.name == "dur"))
                .and_then(|fd| field_int(fd, payload))
                .unwrap_or(0);
            let is_span =
                id == hyptrace_abi::events::SPAN_ID && cat == hyptrace_abi::events::SYSTEM;
            let args_s = serde_json::to_string(&args).unwrap_or_else(|_| "{}".into());
            let e = if is_span {
                let dur_ns = clock.duration_ns(dur_cyc);
                format!(
                    "{{\"name\":{},\"cat\":{},\"ph\":\"X\",\"ts\":{},\"dur\":{},{},\"args\":{args_s}}}",
                    json_str(&name),
                    json_str(&cat),
                    us(ts_ns.saturating_sub(dur_ns)),
                    us(dur_ns),
                    self.places[cpu as usize].ids
                )
            } else {
                format!(
                    "{{\"name\":{},\"cat\":{},\"ph\":\"i\",\"s\":\"t\",\"ts\":{},{},\"args\":{args_s}}}",
                    json_str(&name),
                    json_str(&cat),
                    us(ts_ns),
                    self.places[cpu as usize].ids
                )
            };
            self.queue(cpu, ts_ns, e);
        }
    }
}
