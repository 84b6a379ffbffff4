#!/usr/bin/env python3
"""Decodes a Perfetto trace with Perfetto's official schema (perfetto_trace_pb2 of the
`perfetto` PyPI package) and prints a JSON summary for the Rust tests:

  packets, clocks ([clock_id, timestamp] of the snapshot), primary_clock, process
  ({uuid, pid, name} of the last process track), processes ({uuid: {pid, name}}: every
  process track, one per VM of `collect`), threads ({uuid: {pid, tid, name, parent}}), tracks ({uuid:
  {instants: {name: n}, begins, ends, lost, lost_unknown, open_at_end}}), events (with
  --events: [track, ts, type, name, categories, {arg: value}] in file order), ftrace
  (the host kernel's sched events, `--host-trace`: [cpu, ts, pid, kind, {field: value}]).

Interned names (event names, categories, debug annotation names) are resolved as the
trace processor does: from the InternedData of packets with incremental state, valid
only after a packet that cleared it.

Exits 1 (message on stderr) on a packet that breaks what hyptrace promises: every packet on
one trusted sequence, track events on clock 64 and on a declared track, ends matching
begins, unknown fields (our bytes not in the official schema), an iid that was not
interned, interned data used without SEQ_NEEDS_INCREMENTAL_STATE or before a clear.
Usage: perfetto_decode.py FILE [--events]
"""
import json
import sys

from google.protobuf import unknown_fields
from google.protobuf.descriptor import FieldDescriptor
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb


def fail(msg):
    print(msg, file=sys.stderr)
    sys.exit(1)


def unknown(msg):
    """Whether `msg` or a message inside it has fields the official schema lacks."""
    if len(unknown_fields.UnknownFieldSet(msg)):
        return True
    for f, v in msg.ListFields():
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            for m in (v if f.is_repeated else [v]):
                if unknown(m):
                    return True
    return False


def value(a):
    kind = a.WhichOneof("value")
    if kind is None:
        return [value(x) for x in a.array_values]
    return getattr(a, kind)


def main():
    path = sys.argv[1]
    want_events = "--events" in sys.argv[2:]
    trace = pb.Trace()
    with open(path, "rb") as f:
        trace.ParseFromString(f.read())
    out = {"packets": len(trace.packet), "clocks": [], "primary_clock": None,
           "process": None, "processes": {}, "threads": {}, "tracks": {}, "events": [], "ftrace": []}
    interned = None  # {"cat": {iid: name}, "name": {...}, "arg": {...}} once cleared
    for i, p in enumerate(trace.packet):
        if unknown(p):
            fail(f"packet {i}: unknown fields")
        if p.trusted_packet_sequence_id != 1:
            fail(f"packet {i}: sequence {p.trusted_packet_sequence_id}")
        if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            interned = {"cat": {}, "name": {}, "arg": {}}
        if p.HasField("interned_data"):
            if interned is None:
                fail(f"packet {i}: interned data before the state was cleared")
            d = p.interned_data
            for key, entries in (("cat", d.event_categories), ("name", d.event_names),
                                 ("arg", d.debug_annotation_names)):
                for e in entries:
                    interned[key][e.iid] = e.name

        def lookup(key, iid):
            if not p.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE:
                fail(f"packet {i}: iid {iid} without SEQ_NEEDS_INCREMENTAL_STATE")
            if interned is None or iid not in interned[key]:
                fail(f"packet {i}: {key} iid {iid} not interned")
            return interned[key][iid]

        def arg_name(a):
            if a.WhichOneof("name_field") == "name_iid":
                return lookup("arg", a.name_iid)
            return a.name

        kind = p.WhichOneof("data")
        if kind == "clock_snapshot":
            out["clocks"] = [[c.clock_id, c.timestamp] for c in p.clock_snapshot.clocks]
            out["primary_clock"] = p.clock_snapshot.primary_trace_clock
        elif kind == "track_descriptor":
            d = p.track_descriptor
            if d.HasField("process"):
                out["process"] = {"uuid": d.uuid, "pid": d.process.pid,
                                  "name": d.process.process_name}
                if str(d.uuid) in out["processes"]:
                    fail(f"packet {i}: process track {d.uuid} twice")
                out["processes"][str(d.uuid)] = {"pid": d.process.pid,
                                                 "name": d.process.process_name}
            elif d.HasField("thread"):
                out["threads"][str(d.uuid)] = {
                    "pid": d.thread.pid, "tid": d.thread.tid,
                    "name": d.thread.thread_name, "parent": d.parent_uuid}
                out["tracks"][str(d.uuid)] = {"instants": {}, "begins": 0, "ends": 0,
                                              "lost": 0, "lost_unknown": 0}
            elif d.name:
                # A named track (a host CPU's, `--host-trace`).
                out["tracks"][str(d.uuid)] = {"name": d.name, "instants": {}, "begins": 0,
                                              "ends": 0, "lost": 0, "lost_unknown": 0}
        elif kind == "track_event":
            e = p.track_event
            if p.timestamp_clock_id != 64:
                fail(f"packet {i}: clock {p.timestamp_clock_id}")
            t = out["tracks"].get(str(e.track_uuid))
            if t is None:
                fail(f"packet {i}: undeclared track {e.track_uuid}")
            args = {arg_name(a): value(a) for a in e.debug_annotations}
            name = lookup("name", e.name_iid) if e.WhichOneof("name_field") == "name_iid" \
                else e.name
            categories = list(e.categories) + [lookup("cat", c) for c in e.category_iids]
            ty = pb.TrackEvent.Type.Name(e.type)
            if e.type == pb.TrackEvent.TYPE_INSTANT:
                t["instants"][name] = t["instants"].get(name, 0) + 1
                if name.startswith("lost"):
                    if "count" in args:
                        t["lost"] += args["count"]
                    else:
                        t["lost_unknown"] += 1
            elif e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
                t["begins"] += 1
            elif e.type == pb.TrackEvent.TYPE_SLICE_END:
                t["ends"] += 1
            else:
                fail(f"packet {i}: type {ty}")
            if want_events:
                out["events"].append([e.track_uuid, p.timestamp, ty, name, categories, args])
        elif kind == "ftrace_events":
            b = p.ftrace_events
            for e in b.event:
                which = e.WhichOneof("event")
                if which is None:
                    fail(f"packet {i}: ftrace event without data")
                fields = {f.name: v for f, v in getattr(e, which).ListFields()}
                out["ftrace"].append([b.cpu, e.timestamp, e.pid, which, fields])
        else:
            fail(f"packet {i}: no data ({kind})")
    tids = {}
    for uuid, th in out["threads"].items():
        parent = out["processes"].get(str(th["parent"]))
        if parent is None or parent["pid"] != th["pid"]:
            fail(f"thread track {uuid}: parent {th['parent']} is not its process {th['pid']}")
        if tids.setdefault(th["tid"], uuid) != uuid:
            fail(f"thread tracks {tids[th['tid']]} and {uuid}: one tid {th['tid']}")
    for uuid, t in out["tracks"].items():
        if t["begins"] != t["ends"]:
            fail(f"track {uuid}: {t['begins']} begins, {t['ends']} ends")
    json.dump(out, sys.stdout)


main()
