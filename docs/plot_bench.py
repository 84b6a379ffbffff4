#!/usr/bin/env python3
"""Plots ns/event by payload size from `hyptrace bench --json` output as an SVG.

    python3 docs/plot_bench.py docs/bench.json docs/bench-writer.svg

Series (1 vCPU; medians, with min..max whiskers over the repetitions):
  guest        the writer in the VM, guest TSC   (writer[].guest_ns)
  guest typed  the same, the payload's length a compile-time constant, as a typed
               event's (writer[].typed.guest_ns, where every payload has a typed loop)
  native       the same loop in a host thread    (writer[].native_ns)
  rdtsc+store  the bound: rdtsc + raw store      (writer[].bound_ns)
  rtrb         rtrb SPSC push of ts+payload      (criterion baseline/rtrb/N, if imported
               with `hyptrace bench --criterion DIR`)
Standard library only.
"""
import json
import sys

W, H = 760, 440
L, R, T, B = 70, 190, 40, 60
COLORS = {
    "guest": "#d62728",
    "guest typed": "#ff7f0e",
    "native": "#1f77b4",
    "rdtsc+store": "#2ca02c",
    "rtrb": "#9467bd",
}


def esc(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    data = json.load(open(sys.argv[1]))
    rows = sorted(
        (r for r in data["writer"] if r["vcpus"] == 1), key=lambda r: r["payload"]
    )
    if not rows:
        sys.exit("no 1-vCPU writer rows in the JSON")
    payloads = [r["payload"] for r in rows]
    series = {}
    for name, key in [
        ("guest", "guest_ns"),
        ("native", "native_ns"),
        ("rdtsc+store", "bound_ns"),
    ]:
        series[name] = [
            (r[key]["median"], r[key]["min"], r[key]["max"]) for r in rows
        ]
    if all(r.get("typed") for r in rows):
        series["guest typed"] = [
            (t["median"], t["min"], t["max"])
            for t in (r["typed"]["guest_ns"] for r in rows)
        ]
    crit = data.get("criterion") or {}
    rtrb = []
    for p in payloads:
        c = crit.get("baseline/rtrb/%d" % p)
        if c is None:
            rtrb = []
            break
        rtrb.append((c["median_ns"], c["ci_low_ns"], c["ci_high_ns"]))
    if rtrb:
        series["rtrb"] = rtrb

    ymax = max(v[2] for s in series.values() for v in s)
    step = 5 if ymax <= 40 else 10
    ytop = (int(ymax / step) + 1) * step
    pw, ph = W - L - R, H - T - B

    def x(i):
        return L + (pw * (i + 0.5) / len(payloads))

    def y(v):
        return T + ph - ph * v / ytop

    out = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" '
        'font-family="sans-serif" font-size="12">' % (W, H),
        '<rect width="100%" height="100%" fill="white"/>',
        '<text x="%d" y="22" font-size="15" font-weight="bold">'
        "hyptrace writer: ns per event by payload size (1 vCPU)</text>" % L,
    ]
    # Grid and y axis.
    v = 0
    while v <= ytop:
        out.append(
            '<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>'
            % (L, y(v), L + pw, y(v))
        )
        out.append(
            '<text x="%d" y="%.1f" text-anchor="end">%d</text>' % (L - 6, y(v) + 4, v)
        )
        v += step
    out.append(
        '<text x="18" y="%d" transform="rotate(-90 18 %d)" text-anchor="middle">'
        "ns / event (median, whiskers min..max)</text>" % (T + ph // 2, T + ph // 2)
    )
    # X axis.
    for i, p in enumerate(payloads):
        out.append(
            '<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (x(i), T + ph + 18, p)
        )
    out.append(
        '<text x="%d" y="%d" text-anchor="middle">payload bytes</text>'
        % (L + pw // 2, T + ph + 42)
    )
    out.append(
        '<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>'
        % (L, T, pw, ph)
    )
    # Series.
    n = len(series)
    for k, (name, pts) in enumerate(series.items()):
        col = COLORS[name]
        dx = (k - (n - 1) / 2) * 5
        path = " ".join(
            "%s%.1f,%.1f" % ("M" if i == 0 else "L", x(i) + dx, y(m))
            for i, (m, _, _) in enumerate(pts)
        )
        out.append('<path d="%s" fill="none" stroke="%s" stroke-width="2"/>' % (path, col))
        for i, (m, lo, hi) in enumerate(pts):
            out.append(
                '<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s"/>'
                % (x(i) + dx, y(lo), x(i) + dx, y(hi), col)
            )
            out.append(
                '<circle cx="%.1f" cy="%.1f" r="3.5" fill="%s"><title>%s %d B: %.2f ns'
                "</title></circle>" % (x(i) + dx, y(m), col, esc(name), payloads[i], m)
            )
        ly = T + 10 + 22 * k
        out.append(
            '<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/>'
            % (L + pw + 15, ly, L + pw + 40, ly, col)
        )
        out.append('<text x="%d" y="%d">%s</text>' % (L + pw + 46, ly + 4, esc(name)))
    m = data.get("machine", {})
    out.append(
        '<text x="%d" y="%d" font-size="10" fill="#555">%s, kernel %s, %s, TSC %s kHz'
        "</text>"
        % (L, H - 8, esc(str(m.get("cpu", ""))), esc(str(m.get("kernel", ""))),
           esc(str(m.get("kvm", ""))), m.get("tsc_khz", ""))
    )
    out.append("</svg>")
    with open(sys.argv[2], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
