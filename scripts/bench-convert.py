#!/usr/bin/env python3
"""`convert` against `trace-cmd convert`, v6 -> v7 + zstd (issue 37, docs/benchmarks.md).

usage: scripts/bench-convert.py ROUNDS HYPTRACE [INPUT]

INPUT (default big6.dat in the current directory) is a v6 trace.dat, made once with
  hyptrace record -o big.raw --vcpus 2 --events 10000000 --rate 2000000 --mode stop --buffer-kb 16384
  hyptrace convert -i big.raw -o big6.dat --format dat6
Each round runs both conversions one after the other (outputs removed first); prints the
median and minimum wall time, the median CPU time (user + sys), the output sizes and the
speed ratio, with the load average.
"""
import os, resource, subprocess, sys, time, statistics

rounds, hyp = int(sys.argv[1]), sys.argv[2]
src = sys.argv[3] if len(sys.argv) > 3 else "big6.dat"
cmds = {
    "trace-cmd": ["trace-cmd", "convert", "-i", src, "-o", "tc.dat", "--file-version", "7", "--compression", "zstd"],
    "hyptrace": [hyp, "convert", "-i", src, "-o", "hy.dat"],
}
res = {k: [] for k in cmds}
for _ in range(rounds):
    for name, cmd in cmds.items():
        out = cmd[cmd.index("-o") + 1]
        if os.path.exists(out):
            os.remove(out)
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.monotonic() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        res[name].append((wall, cpu, os.path.getsize(out)))
for name, v in res.items():
    w = [x[0] for x in v]
    c = [x[1] for x in v]
    print(f"{name:10} wall median {statistics.median(w):.3f} s (min {min(w):.3f}) cpu median {statistics.median(c):.3f} s file {v[-1][2]} B")
tc = statistics.median(x[0] for x in res["trace-cmd"])
hy = statistics.median(x[0] for x in res["hyptrace"])
print(f"speed ratio hyptrace/trace-cmd (wall): {tc / hy:.2f}x; load {os.getloadavg()[0]:.1f}")
