//! Native Perfetto trace sink (`--format perfetto`): a stream of protobuf `TracePacket`s
//! (each written as field 1 of `perfetto.protos.Trace`, so the file is a `Trace`), made
//! with prost from the upstream proto subset in `proto/perfetto_trace.proto`.
//!
//! Layout (every packet on trusted sequence [`SEQUENCE_ID`]):
//! 1. a `ClockSnapshot`: clock [`CLOCK_ID`] (hyptrace's trace clock in ns: the times
//!    `trace-cmd report -t`, text and JSON show) equal to `BUILTIN_CLOCK_BOOTTIME` at 0,
//!    the trace's primary clock — the UI's timeline is those same ns; the same packet
//!    clears the incremental state and interns every event name, category and field
//!    name of the formats (known up front), which the events refer to by iid
//!    (`SEQ_NEEDS_INCREMENTAL_STATE`);
//! 2. a process track [`PROCESS_UUID`] [`PROCESS_NAME`] (pid [`JSON_PID`]) and one thread
//!    track per vCPU ([`vcpu_track_uuid`], tid = the vCPU's pid, named from the cmdlines);
//!    with several VMs ([`TraceMeta::groups`], `hyptrace collect`) a process track per
//!    VM instead ([`group_uuid`], named after the VM, pid = its first vCPU's tid), each
//!    of its vCPUs' thread tracks its child;
//! 3. per event, on its vCPU's track (`--host-trace`: the host kernel's
//!    `sched:sched_switch` / `sched_wakeup` instead go out as an `FtraceEventBundle`
//!    of their CPU, so the trace processor builds the threads' scheduling states, and
//!    each vCPU's track takes its host thread's tid: the vCPU's guest events and its
//!    thread's host scheduling are one thread in the UI): `guest:span` as a slice (`SLICE_BEGIN` at
//!    `ts − dur`, `SLICE_END` at `ts`: the guest writes a span when it ends), every
//!    other event as an instant; the event's fields as debug annotations (integers as
//!    int/uint, strings as strings, arrays as arrays of uint); lost events as an instant
//!    `lost N events` (annotation `count`; `lost events` without one when only the flag
//!    is known) before the page's first event, and a trailing loss after the CPU's last
//!    event.
//!
//! Packets go out as pages arrive (memory: one packet and a write buffer); the trace
//! processor sorts them by time.

use crate::error::PageProblem;
use std::collections::BTreeMap;

use hyptrace_format::EventFormat;
use prost::Message;

pub use super::stream::PROCESS_NAME;
use super::stream::{page_events, StreamOut, StreamSink, JSON_PID};
use crate::export::{export_page_into, page_missed, Missed};
use crate::sink::{PageSink, RunSummary, TraceMeta};
use crate::text::{field_bytes, field_int};
use crate::OutputError;

/// The generated Perfetto protos (package `perfetto.protos`, the subset we write).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod protos {
    include!(concat!(env!("OUT_DIR"), "/perfetto.protos.rs"));
}

use protos::{
    clock_snapshot, debug_annotation, ftrace_event, trace_packet, track_descriptor, track_event,
    BuiltinClock, ClockSnapshot, DebugAnnotation, DebugAnnotationName, EventCategory, EventName,
    FtraceEvent, FtraceEventBundle, InternedData, ProcessDescriptor, SchedSwitchFtraceEvent,
    SchedWakeupFtraceEvent, ThreadDescriptor, TracePacket, TrackDescriptor, TrackEvent,
};

/// `trusted_packet_sequence_id` of every packet.
pub const SEQUENCE_ID: u32 = 1;
/// The sequence-scoped clock of the packets' timestamps (ns of hyptrace's trace clock).
pub const CLOCK_ID: u32 = 64;
/// uuid of the process track ([`PROCESS_NAME`]).
pub const PROCESS_UUID: u64 = 1;

/// uuid of the process track of VM `i` of [`TraceMeta::groups`] (its pid: its first
/// vCPU's tid).
pub fn group_uuid(i: usize) -> u64 {
    0x100 + i as u64
}

/// uuid of vCPU `cpu`'s thread track.
pub fn vcpu_track_uuid(cpu: u32) -> u64 {
    0x1000 + u64::from(cpu)
}

/// Perfetto sink: see the module documentation.
///
/// ```
/// use hyptrace_output::{Clock, PageSink, PerfettoSink, RunSummary, StreamSink, TraceMeta};
/// let dir = tempfile::tempdir()?;
/// let meta = TraceMeta::guest(4096, 2, Clock::nanoseconds());
/// let sink = PerfettoSink::create(dir.path().join("t.pftrace"), meta)?;
/// // ... sink.page(cpu, page, missed) for every ring page ...
/// Box::new(sink).finish(&RunSummary::default())?; // ui.perfetto.dev opens the file
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PerfettoSink {
    meta: TraceMeta,
    out: Option<StreamOut>,
    scratch: Vec<u8>,
    /// Encoded packets waiting for a write.
    buf: Vec<u8>,
    /// Per CPU: ns of its last event (or lossy page).
    last: Vec<u64>,
    /// Interned strings: event id → (name iid, category iid); category and field name
    /// → iid. Fixed at the start (from the formats).
    event_iids: BTreeMap<u16, (u64, u64)>,
    category_iids: BTreeMap<String, u64>,
    arg_iids: BTreeMap<String, u64>,
}

/// Categories of hyptrace's own instants.
const CAT_LOSS: &str = "hyptrace";
const CAT_UNKNOWN: &str = "unknown";
/// The annotation of a loss count.
const ARG_COUNT: &str = "count";

/// A Perfetto trace: the first packet (clock, interned names) and the tracks.
impl StreamSink for PerfettoSink {
    fn from_output(out: StreamOut, meta: TraceMeta) -> Result<Self, OutputError> {
        meta.validate()?;
        let Interned {
            data,
            event_iids,
            category_iids,
            arg_iids,
        } = Interned::of(&meta);
        let mut s = Self {
            scratch: vec![0; meta.page_size],
            last: vec![0; meta.nr_cpus as usize],
            meta,
            out: Some(out),
            buf: Vec::with_capacity(1 << 16),
            event_iids,
            category_iids,
            arg_iids,
        };
        s.push(first_packet(data));
        // The VM's process; with groups (several VMs), one per VM, and the VM's only
        // for the CPUs of no group.
        if (0..s.meta.nr_cpus).any(|c| s.meta.group_of(c).is_none()) {
            s.push(process_track(PROCESS_UUID, JSON_PID, PROCESS_NAME));
        }
        let vms: Vec<TracePacket> = (s.meta.groups.iter().enumerate())
            .map(|(i, g)| {
                let pid = hyptrace_abi::events::vcpu_pid(g.first) as u32;
                process_track(group_uuid(i), pid, &g.name)
            })
            .collect();
        vms.into_iter().for_each(|p| s.push(p));
        for cpu in 0..s.meta.nr_cpus {
            let track = vcpu_track(&s.meta, cpu);
            s.push(track);
        }
        s.flush()?;
        Ok(s)
    }
}

impl PerfettoSink {
    /// Encodes `p` as one `Trace.packet` (field 1, length-delimited).
    fn push(&mut self, mut p: TracePacket) {
        p.optional_trusted_packet_sequence_id = Some(
            trace_packet::OptionalTrustedPacketSequenceId::TrustedPacketSequenceId(SEQUENCE_ID),
        );
        prost::encoding::message::encode(1, &p, &mut self.buf);
    }

    fn flush(&mut self) -> Result<(), OutputError> {
        let r = match self.out.as_mut() {
            Some(o) => o.write_all(&self.buf),
            None => Ok(()),
        };
        self.buf.clear();
        r
    }

    /// A track event packet on vCPU `cpu`'s track at `ns` (it may use the interned
    /// strings).
    fn event(&mut self, cpu: u32, ns: u64, mut e: TrackEvent) {
        e.track_uuid = Some(vcpu_track_uuid(cpu));
        self.push(TracePacket {
            timestamp: Some(ns),
            timestamp_clock_id: Some(CLOCK_ID),
            sequence_flags: Some(trace_packet::SequenceFlags::SeqNeedsIncrementalState as u32),
            data: Some(trace_packet::Data::TrackEvent(e)),
            ..Default::default()
        });
    }

    /// The interned category `name` (one of those interned at the start).
    fn category(&self, name: &str) -> Vec<u64> {
        self.category_iids.get(name).copied().into_iter().collect()
    }

    /// The `lost N events` instant (`lost events` when the count is unknown).
    fn lost(&mut self, cpu: u32, ns: u64, count: Option<u64>) {
        let (name, args) = match count {
            Some(n) => (
                format!("lost {n} events"),
                vec![annotation(
                    self.arg_iids.get(ARG_COUNT).copied(),
                    ARG_COUNT,
                    debug_annotation::Value::UintValue(n),
                )],
            ),
            None => ("lost events".to_string(), Vec::new()),
        };
        self.event(
            cpu,
            ns,
            TrackEvent {
                r#type: Some(track_event::Type::Instant as i32),
                category_iids: self.category(CAT_LOSS),
                name_field: Some(track_event::NameField::Name(name)),
                debug_annotations: args,
                ..Default::default()
            },
        );
    }

    fn page_inner(&mut self, cpu: u32, page: &[u8]) -> Result<(), OutputError> {
        let (page_ts, events, _err) = page_events(page);
        let clock = self.meta.clock.clone();
        let c = cpu as usize;
        let missed = page_missed(page);
        if missed != Missed::None {
            let ts = events.first().map_or(page_ts, |e| e.0);
            let count = match missed {
                Missed::Count(n) => Some(n),
                _ => None,
            };
            self.lost(cpu, clock.to_ns(ts), count);
            if events.is_empty() {
                self.last[c] = clock.to_ns(page_ts);
            }
        }
        let mut bundle = Vec::new();
        for (ts, payload) in events {
            let ns = clock.to_ns(ts);
            self.last[c] = ns;
            let id = payload
                .get(..2)
                .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
            if let Some(e) = self
                .meta
                .format(id)
                .and_then(|f| host_sched(f, ns, payload))
            {
                bundle.push(e);
                continue;
            }
            let (Some(f), Some(&(name_iid, cat_iid))) =
                (self.meta.format(id), self.event_iids.get(&id))
            else {
                self.event(
                    cpu,
                    ns,
                    TrackEvent {
                        r#type: Some(track_event::Type::Instant as i32),
                        category_iids: self.category(CAT_UNKNOWN),
                        name_field: Some(track_event::NameField::Name(format!("event_{id}"))),
                        ..Default::default()
                    },
                );
                continue;
            };
            let is_span =
                id == hyptrace_abi::events::SPAN_ID && f.system == hyptrace_abi::events::SYSTEM;
            let e = TrackEvent {
                category_iids: vec![cat_iid],
                name_field: Some(track_event::NameField::NameIid(name_iid)),
                debug_annotations: annotations(f, payload, &self.arg_iids),
                ..Default::default()
            };
            if is_span {
                let dur = f
                    .fields
                    .iter()
                    .find(|fd| fd.name == "dur")
                    .and_then(|fd| field_int(fd, payload))
                    .unwrap_or(0);
                let begin = ns.saturating_sub(clock.duration_ns(dur));
                self.event(
                    cpu,
                    begin,
                    TrackEvent {
                        r#type: Some(track_event::Type::SliceBegin as i32),
                        ..e
                    },
                );
                self.event(
                    cpu,
                    ns,
                    TrackEvent {
                        r#type: Some(track_event::Type::SliceEnd as i32),
                        ..Default::default()
                    },
                );
            } else {
                self.event(
                    cpu,
                    ns,
                    TrackEvent {
                        r#type: Some(track_event::Type::Instant as i32),
                        ..e
                    },
                );
            }
        }
        if !bundle.is_empty() {
            self.push(TracePacket {
                data: Some(trace_packet::Data::FtraceEvents(FtraceEventBundle {
                    cpu: Some(cpu),
                    event: bundle,
                })),
                ..Default::default()
            });
        }
        self.flush()
    }
}

/// The process track `uuid`: process `pid` named `name`.
fn process_track(uuid: u64, pid: u32, name: &str) -> TracePacket {
    descriptor(TrackDescriptor {
        uuid: Some(uuid),
        process: Some(ProcessDescriptor {
            pid: Some(pid as i32),
            process_name: Some(name.into()),
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn descriptor(d: TrackDescriptor) -> TracePacket {
    TracePacket {
        timestamp: Some(0),
        timestamp_clock_id: Some(CLOCK_ID),
        data: Some(trace_packet::Data::TrackDescriptor(d)),
        ..Default::default()
    }
}

/// The strings interned once at the start (from the formats): event names, categories
/// (systems, and hyptrace's own) and annotation names (fields, and the loss count).
struct Interned {
    data: InternedData,
    /// Event id → (name iid, category iid).
    event_iids: BTreeMap<u16, (u64, u64)>,
    category_iids: BTreeMap<String, u64>,
    arg_iids: BTreeMap<String, u64>,
}

impl Interned {
    fn of(meta: &TraceMeta) -> Self {
        let mut s = Self {
            data: InternedData::default(),
            event_iids: BTreeMap::new(),
            category_iids: BTreeMap::new(),
            arg_iids: BTreeMap::new(),
        };
        s.category(CAT_LOSS);
        s.category(CAT_UNKNOWN);
        s.arg(ARG_COUNT);
        for (i, f) in meta.formats.iter().enumerate() {
            let name = i as u64 + 1;
            s.data.event_names.push(EventName {
                iid: Some(name),
                name: Some(f.name.clone()),
            });
            let category = s.category(&f.system);
            s.event_iids.insert(f.id, (name, category));
            for fd in &f.fields {
                s.arg(&fd.name);
            }
        }
        s
    }

    /// The iid of category `name` (interned on first use).
    fn category(&mut self, name: &str) -> u64 {
        let n = self.category_iids.len() as u64 + 1;
        let data = &mut self.data;
        *self
            .category_iids
            .entry(name.to_string())
            .or_insert_with(|| {
                data.event_categories.push(EventCategory {
                    iid: Some(n),
                    name: Some(name.to_string()),
                });
                n
            })
    }

    /// Interns annotation name `name` (once).
    fn arg(&mut self, name: &str) {
        let n = self.arg_iids.len() as u64 + 1;
        let data = &mut self.data;
        self.arg_iids.entry(name.to_string()).or_insert_with(|| {
            data.debug_annotation_names.push(DebugAnnotationName {
                iid: Some(n),
                name: Some(name.to_string()),
            });
            n
        });
    }
}

/// The first packet of the sequence: the interned strings, and the clock snapshot
/// tying the trace clock to boottime at 0.
fn first_packet(interned: InternedData) -> TracePacket {
    TracePacket {
        timestamp: Some(0),
        timestamp_clock_id: Some(BuiltinClock::Boottime as u32),
        sequence_flags: Some(trace_packet::SequenceFlags::SeqIncrementalStateCleared as u32),
        incremental_state_cleared: Some(true),
        first_packet_on_sequence: Some(true),
        interned_data: Some(interned),
        data: Some(trace_packet::Data::ClockSnapshot(ClockSnapshot {
            clocks: vec![
                clock_snapshot::Clock {
                    clock_id: Some(CLOCK_ID),
                    timestamp: Some(0),
                    ..Default::default()
                },
                clock_snapshot::Clock {
                    clock_id: Some(BuiltinClock::Boottime as u32),
                    timestamp: Some(0),
                    ..Default::default()
                },
            ],
            primary_trace_clock: Some(BuiltinClock::Boottime as i32),
        })),
        ..Default::default()
    }
}

/// Whether `f` is a host kernel event (`--host-trace`: ids renumbered from
/// `FIRST_HOST_KERNEL_ID`, below the VMM's; or a trace of before issue 40).
fn is_host_kernel(f: &EventFormat) -> bool {
    hyptrace_abi::registry::is_host_kernel_id(f.id)
}

/// A host kernel `sched_switch` / `sched_wakeup` (`--host-trace`) as the ftrace event
/// the trace processor builds thread states from; `None` for every other event.
fn host_sched(f: &EventFormat, ns: u64, payload: &[u8]) -> Option<FtraceEvent> {
    if !is_host_kernel(f) || f.system != "sched" {
        return None;
    }
    let int = |n: &str| f.field(n).and_then(|fd| field_int(fd, payload));
    let i32f = |n: &str| int(n).map(|v| v as i32);
    let comm = |n: &str| {
        f.field(n).and_then(|fd| field_bytes(fd, payload)).map(|b| {
            let end = b.iter().position(|&x| x == 0).unwrap_or(b.len());
            String::from_utf8_lossy(&b[..end]).into_owned()
        })
    };
    let event = match f.name.as_str() {
        "sched_switch" => ftrace_event::Event::SchedSwitch(SchedSwitchFtraceEvent {
            prev_comm: comm("prev_comm"),
            prev_pid: i32f("prev_pid"),
            prev_prio: i32f("prev_prio"),
            prev_state: int("prev_state").map(|v| v as i64),
            next_comm: comm("next_comm"),
            next_pid: i32f("next_pid"),
            next_prio: i32f("next_prio"),
        }),
        "sched_wakeup" => ftrace_event::Event::SchedWakeup(SchedWakeupFtraceEvent {
            comm: comm("comm"),
            pid: i32f("pid"),
            prio: i32f("prio"),
            success: i32f("success"),
            target_cpu: i32f("target_cpu"),
        }),
        _ => return None,
    };
    Some(FtraceEvent {
        timestamp: Some(ns),
        pid: int("common_pid").map(|v| v as u32),
        event: Some(event),
    })
}

/// The host thread id of vCPU `cpu` (`--host-trace`: the cmdlines name it `vcpuN`
/// besides the guest's pid), so its track is the thread the host's sched_switch
/// events describe.
fn host_tid(meta: &TraceMeta, cpu: u32) -> Option<i32> {
    if !meta.formats.iter().any(is_host_kernel) {
        return None;
    }
    let name = format!("vcpu{cpu}");
    let guest = hyptrace_abi::events::vcpu_pid(cpu);
    meta.cmdlines
        .iter()
        .find(|&(&pid, n)| *n == name && pid != guest && pid > meta.nr_cpus as i32 + 1)
        .map(|(&pid, _)| pid)
}

/// The thread track of vCPU `cpu`, named by its cmdline (else `vcpuN`); its tid is the
/// vCPU thread's host tid when the host's scheduling is recorded ([`host_tid`]).
fn vcpu_track(meta: &TraceMeta, cpu: u32) -> TracePacket {
    let pid = hyptrace_abi::events::vcpu_pid(cpu);
    if let Some(k) = meta.host_cpu(cpu) {
        // A host CPU (`--host-trace`): a named track, not a thread (its number could be
        // a real host tid in the host's sched events).
        return descriptor(TrackDescriptor {
            uuid: Some(vcpu_track_uuid(cpu)),
            parent_uuid: Some(PROCESS_UUID),
            static_or_dynamic_name: Some(track_descriptor::StaticOrDynamicName::Name(format!(
                "host cpu{k}"
            ))),
            ..Default::default()
        });
    }
    let name = meta
        .cmdlines
        .get(&pid)
        .cloned()
        .unwrap_or_else(|| format!("vcpu{cpu}"));
    // Its VM's process: of its group (several VMs), else the one.
    let (parent, process) = match meta.group_of(cpu) {
        Some((i, g)) => (group_uuid(i), hyptrace_abi::events::vcpu_pid(g.first)),
        None => (PROCESS_UUID, JSON_PID as i32),
    };
    descriptor(TrackDescriptor {
        uuid: Some(vcpu_track_uuid(cpu)),
        parent_uuid: Some(parent),
        thread: Some(ThreadDescriptor {
            pid: Some(process),
            tid: Some(host_tid(meta, cpu).unwrap_or(pid)),
            thread_name: Some(name),
        }),
        ..Default::default()
    })
}

/// The annotation `name` (by its iid when interned) = `value`.
fn annotation(iid: Option<u64>, name: &str, value: debug_annotation::Value) -> DebugAnnotation {
    DebugAnnotation {
        name_field: Some(annotation_name(iid, name)),
        value: Some(value),
        ..Default::default()
    }
}

fn annotation_name(iid: Option<u64>, name: &str) -> debug_annotation::NameField {
    match iid {
        Some(i) => debug_annotation::NameField::NameIid(i),
        None => debug_annotation::NameField::Name(name.into()),
    }
}

/// The event's fields as debug annotations (names interned in `iids`).
fn annotations(
    f: &EventFormat,
    payload: &[u8],
    iids: &BTreeMap<String, u64>,
) -> Vec<DebugAnnotation> {
    use debug_annotation::Value;
    f.fields
        .iter()
        .filter_map(|fd| {
            let iid = iids.get(&fd.name).copied();
            if fd.is_string() {
                let b = field_bytes(fd, payload)?;
                Some(annotation(
                    iid,
                    &fd.name,
                    Value::StringValue(String::from_utf8_lossy(b).into_owned()),
                ))
            } else if fd.is_array() || fd.is_data_loc() || fd.is_rel_loc() {
                let b = field_bytes(fd, payload)?;
                Some(DebugAnnotation {
                    name_field: Some(annotation_name(iid, &fd.name)),
                    array_values: b
                        .iter()
                        .map(|&x| DebugAnnotation {
                            value: Some(Value::UintValue(u64::from(x))),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                })
            } else {
                let v = field_int(fd, payload)?;
                Some(annotation(
                    iid,
                    &fd.name,
                    if fd.signed {
                        Value::IntValue(v as i64)
                    } else {
                        Value::UintValue(v)
                    },
                ))
            }
        })
        .collect()
}

impl PageSink for PerfettoSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        self.meta.check_page(cpu, page)?;
        export_page_into(cpu, page, missed, &mut self.scratch)?;
        let scratch = std::mem::take(&mut self.scratch);
        let r = self.page_inner(cpu, &scratch);
        self.scratch = scratch;
        r
    }

    /// A `lost N events` instant at the time of the CPU's last event.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        let Some(&ns) = self.last.get(cpu as usize) else {
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
        self.lost(cpu, ns, Some(lost));
        self.flush()
    }

    fn finish(mut self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        self.flush()?;
        match self.out.take() {
            Some(o) => o.close(),
            None => Ok(()),
        }
    }
}

/// Decodes a whole Perfetto trace written by [`PerfettoSink`] (tests, `convert`).
pub fn decode_trace(bytes: &[u8]) -> Result<protos::Trace, OutputError> {
    protos::Trace::decode(bytes).map_err(OutputError::Perfetto)
}
