#!/usr/bin/env python3
"""`convert` against `trace-cmd convert`, v6 -> v7 + zstd (issue 37, docs/benchmarks.md).

usage: scripts/bench-convert.py ROUNDS [NAME=]HYPTRACE... (in the directory of big6.dat)

big6.dat is a v6 trace.dat, made once with
  hyptrace record -o big.raw --vcpus 2 --events 10000000 --rate 2000000 --mode stop --buffer-kb 16384
  hyptrace convert -i big.raw -o big6.dat --format dat6
Each round runs `trace-cmd convert -i big6.dat -o tc.dat --file-version 7 --compression zstd`
and `HYPTRACE convert -i big6.dat -o NAME.dat` for each binary, one after the other
(outputs removed first); prints each one's median and minimum wall time, median CPU time
(user + sys), output size and speed ratio to trace-cmd, and the load average before and
after.
"""
import os, resource, subprocess, sys, time, statistics

rounds = int(sys.argv[1])
cmds = {"trace-cmd": ["trace-cmd", "convert", "-i", "big6.dat", "-o", "tc.dat",
                      "--file-version", "7", "--compression", "zstd"]}
for i, a in enumerate(sys.argv[2:]):
    name, hyp = a.split("=", 1) if "=" in a else (f"hyptrace{i or ''}", a)
    cmds[name] = [hyp, "convert", "-i", "big6.dat", "-o", f"{name}.dat"]
res = {k: [] for k in cmds}
loads = [os.getloadavg()[0]]
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
loads.append(os.getloadavg()[0])
tc = statistics.median(x[0] for x in res["trace-cmd"])
for name, v in res.items():
    w = [x[0] for x in v]
    c = [x[1] for x in v]
    m = statistics.median(w)
    print(f"{name:10} wall median {m:.3f} s (min {min(w):.3f}) cpu median "
          f"{statistics.median(c):.3f} s file {v[-1][2]} B  ratio {tc / m:.2f}x")
print(f"load {loads[0]:.1f} -> {loads[1]:.1f}")
