#!/usr/bin/env python3
"""Writes the hand-made seed corpus of the `registration` fuzz target.

Run from fuzz/: python3 seeds/gen_registration.py (writes corpus/registration/seed-*).
Input format: one config byte (bit 0 repair the header constants, bit 1 lay the areas out
from the counts), then the table (layout in docs/abi.md "Event registration").
"""
import os
import struct

MAGIC = b"HTEVTAB1"


def table(events, patch=None):
    strings = bytearray()

    def put(s):
        r = (len(strings), len(s))
        strings.extend(s.encode())
        return r

    entries, fields = [], []
    for (system, name, fmt, flds, size, slot, req) in events:
        first = len(fields)
        for (n, t, off, sz, sg) in flds:
            fields.append(struct.pack("<IIIIIIII", *put(n), *put(t), off, sz, sg, 0))
        entries.append(struct.pack("<IIIIIIIIIIIIQQ", *put(system), *put(name), *put(fmt),
                                   first, len(flds), size, slot, req, 0, 0, 0))
    eo = 64
    fo = eo + 64 * len(entries)
    so = fo + 32 * len(fields)
    hdr = MAGIC + struct.pack("<QIIIIIIIIIIII", 1, 1, 64, 64, 32, len(entries), len(fields),
                              eo, fo, so, len(strings), 0, 0)
    b = bytearray(hdr + b"".join(entries) + b"".join(fields) + strings)
    if patch:
        patch(b)
    return bytes(b)


U64 = lambda n, o: (n, "u64", o, 8, 0)
builtins = [
    ("guest", "marker", '"seq=%llu value=%llu", REC->seq, REC->value', [U64("seq", 8), U64("value", 16)], 24, 0, 1000),
    ("guest", "span", '"seq=%llu id=%llu dur=%llu", REC->seq, REC->id, REC->dur',
     [U64("seq", 8), U64("id", 16), U64("dur", 24)], 32, 1, 1001),
    ("guest", "text", '"seq=%llu msg=%s", REC->seq, __get_str(msg)',
     [U64("seq", 8), ("msg", "__data_loc char[]", 16, 4, 0)], 20, 2, 1002),
]
custom = [("demo", "packet", '"len=%u proto=%d name=%s", REC->len, REC->proto, REC->name',
           [("len", "u32", 8, 4, 0), ("proto", "int", 12, 4, 1), ("name", "char[16]", 16, 16, 1)], 32, 7, 0)]
bad = [("x", "overlap", '"a"', [U64("a", 8), ("b", "u32", 12, 4, 0)], 16, 3, 0),
       ("x", "slot", '"a"', [U64("a", 8)], 16, 64, 0),
       ("x", "type", '"a"', [("a", "struct s", 8, 8, 0)], 16, 4, 0)]

seeds = {
    "builtins": (0, table(builtins)),
    "custom": (0, table(builtins + custom)),
    "bad-entries": (0, table(builtins + bad + custom)),
    "repair-builtins": (1, table(builtins)),
    "layout-custom": (3, table(custom)),
}
out = "corpus/registration"
os.makedirs(out, exist_ok=True)
for name, (cfg, t) in seeds.items():
    with open(os.path.join(out, "seed-" + name), "wb") as f:
        f.write(bytes([cfg]) + t)
