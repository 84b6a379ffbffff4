#!/usr/bin/env python3
"""Writes the hand-made seed corpus of the `region` and `page` fuzz targets.

Run from fuzz/: python3 seeds/gen.py  (writes corpus/region/seed-* and corpus/page/seed-*).
The formats are described at the top of fuzz_targets/region.rs and page.rs.
"""
import os
import struct

W, WX, POKE, EV, PG, FIN, SWAP, EN, REATT, PBYTES, PFOOT, PCTL, PCOMMIT, PPACK = range(14)
CPU1 = 14  # opcode + 14 selects CPU 1 (2-CPU configs)


def cfg(cpus=1, pages=3, overwrite=False, guest_swap=False, pages0=False, pages1=False):
    return (cpus - 1) | ((pages - 3) << 1) | (overwrite << 3) | (guest_swap << 4) | (pages0 << 5) | (pages1 << 6)


def raw(v):
    return bytes([0x80]) + struct.pack("<Q", v)


region = {
    "stop-fill-drain": [cfg(), W, 255, 140, 1, EV, W, 100, 140, 3, EV, FIN],
    "stop-fill-pages": [cfg(pages=4, pages0=True), W, 255, 200, 1, PG, W, 60, 20, 1, PG, FIN],
    "overwrite-wrap": [cfg(pages=3, overwrite=True), W, 255, 200, 7, W, 255, 200, 7, EV, FIN],
    "overwrite-pages": [cfg(pages=5, overwrite=True, pages0=True), W, 255, 100, 2, POKE, PG, W, 255, 100, 2, PG, FIN],
    "interleaved": [cfg(pages=6), W, 40, 24, 1, EV, POKE, W, 40, 24, 1, EV, W, 200, 60, 1, EV, POKE, FIN],
    "two-cpus": [cfg(cpus=2, pages=4, pages1=True), W, 200, 32, 1, W + CPU1, 200, 48, 2, EV, PG + CPU1, POKE + CPU1, FIN, FIN + CPU1],
    "two-cpus-overwrite": [cfg(cpus=2, overwrite=True), W + CPU1, 255, 255, 9, W, 255, 0, 9, EV + CPU1, EV],
    "time-extend": [cfg(pages=4), WX, 80, 16, 5, EV, WX, 200, 40, 19, FIN],
    "small-payloads": [cfg(), W, 255, 0, 1, W, 255, 1, 1, W, 255, 3, 1, W, 255, 112, 1, W, 255, 113, 1, EV, FIN],
    "enable": [cfg(), EN, 0, 0, EN, 1, 5, W, 10, 30, 1, EN, 0x7f, 0, EV],
    "guest-swap-flag": [cfg(guest_swap=True, overwrite=True), W, 255, 64, 1, SWAP, EV],
    "released-pages": [cfg(pages=4, guest_swap=True), W, 255, 100, 1, EV, W, 255, 100, 1, EV, W, 255, 100, 1, EV, FIN],
    "released-pages-by-page": [cfg(pages=5, guest_swap=True, pages0=True), W, 255, 100, 1, PG, W, 200, 100, 1, PG, W, 255, 60, 2, PG, FIN],
    "patch-link": [cfg(pages=4), W, 255, 100, 1, PFOOT, 1, 6, 0x0b, EV, FIN],
    "patch-footer-seq": [cfg(pages=5), W, 255, 150, 1, PFOOT, 2, 8, 0x7f, FIN],
    "patch-footer-magic": [cfg(pages=3), W, 100, 100, 1, PFOOT, 1, 11, 0x00, FIN],
    "patch-first-index": [cfg(pages=4), W, 255, 100, 1, PFOOT, 2, 7] + list(raw(2**64 - 1)) + [EV, FIN],
    "patch-commit": [cfg(pages=3), W, 30, 16, 1, EV, PCOMMIT, 1, 0, 3, EV, PCOMMIT, 1, 1] + list(raw(0xFFFF)) + [EV],
    "patch-commit-ts": [cfg(pages=3), W, 30, 16, 1, PCOMMIT, 1, 4] + list(raw(2**63)) + [EV],
    "patch-ctl-reader": [cfg(pages=4), W, 255, 100, 1, PCTL, 24, 3, EV, PCTL, 2, 0x40, POKE],
    "patch-ctl-counters": [cfg(pages=4), W, 20, 100, 1, POKE, PCTL, 8, 0, POKE, PCTL, 5] + list(raw(2**64 - 1)) + [POKE],
    "patch-pack": [cfg(), W, 20, 8, 1, PPACK, 2] + list(raw(0x0000100000000002)) + [REATT, EV],
    "patch-bytes-event": [cfg(), W, 20, 24, 1, PBYTES, 0x04, 0x04, 8, 0x1d, 0, 0, 0, 0x3d, 0, 0, 0, EV],
    "reattach": [cfg(pages=4), W, 255, 64, 1, EV, REATT, W, 255, 64, 1, EV, FIN],
}

page = {}


def pg(ts, events, commit_flags=0, trailing=b""):
    data = b"".join(events)
    return struct.pack("<QQ", ts, len(data) | commit_flags) + data + trailing


def ev(type_len, delta, *words):
    return struct.pack("<I", type_len | (delta << 5)) + b"".join(struct.pack("<I", w) for w in words)


def data(delta, payload):
    p = payload + b"\0" * (-len(payload) % 4)
    if 0 < len(p) <= 112:
        return ev(len(p) // 4, delta) + p
    return ev(0, delta, len(p) + 4) + p


page["small"] = pg(1000, [data(0, b"abcd"), data(5, b"12345678"), data(7, b"x" * 112)])
page["long"] = pg(5, [data(0, b""), data(1, b"y" * 113), data(2, b"z" * 300)])
page["extend"] = pg(10, [data(0, b"aaaa"), ev(30, 0x1234, 0x55), data(3, b"bbbb"), ev(31, 7, 1), data(0, b"cccc")])
page["padding"] = pg(1, [data(0, b"aaaa"), ev(29, 1, 8), b"\0" * 4, data(0, b"bbbb"), ev(29, 0)])
page["missed"] = pg(1, [data(0, b"aaaa")], commit_flags=1 << 31)
page["missed-stored"] = pg(1, [data(0, b"aaaa")], commit_flags=3 << 30, trailing=struct.pack("<Q", 42))
page["truncated"] = pg(1, [data(0, b"aaaa"), ev(0, 0, 400)])
page["bad-length"] = pg(1, [ev(0, 0, 2)])

for d, items in (("corpus/region", region), ("corpus/page", page)):
    os.makedirs(d, exist_ok=True)
    for name, v in items.items():
        with open(os.path.join(d, "seed-" + name), "wb") as f:
            f.write(bytes(v))
