"""A 1 GB Kineto trace reported on, against HTA on the same file: time and peak memory of each.

The trace: a real rank of a 128-rank NCCL job (tests/fixtures/real/hta_sampled_rank-0.json.gz: steps 551-552,
CPU operators, CUDA launches, kernels, NCCL kernels), its steps repeated until the file holds --mb MB: every copy
shifted in time after the previous one, its steps renumbered, its correlation and external ids offset so that each
kernel still joins its own launch. Written to --dir (default /tmp) one event per line, as Kineto writes, and
deleted at the end (never committed: 1 GB).

Each tool runs in its own process; wall time and peak RSS (ru_maxrss of that process) are measured there.
  ours: build_report() on the file, one worker: steps, split, operators, kernels, everything `report` prints.
  HTA:  TraceAnalysis(trace_dir=...): parsing the trace into its DataFrames, before any analysis; run with a
        memory limit (--hta-gb, as RLIMIT_AS) and a time limit (--hta-timeout) so that a shared machine survives.

    .venv/bin/python bench/bench_report_1gb.py [--mb 1024] [--hta-python PY] [--hta-gb 12] [--hta-timeout 1800]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "tests" / "fixtures" / "real" / "hta_sampled_rank-0.json.gz"

OURS = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[2])
t = time.perf_counter()
from pathlib import Path
from ondemand_prof.report import build_report
r = build_report([Path(sys.argv[1])], workers=1)
rank = r["captures"][0]["ranks"][0]
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": time.perf_counter() - t, "cpu_s": u.ru_utime + u.ru_stime, "rss_mb": u.ru_maxrss / 1024,
                  "steps": len(rank["steps"]), "events": rank["events"], "comm_pct": rank.get("comm_pct"),
                  "kernels": sum(k["calls"] for k in rank["top_kernels"])}))
"""

HTA = r"""
import json, resource, sys, time, logging
limit = int(float(sys.argv[2]) * 2**30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
logging.disable(logging.WARNING)
t = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
df = a.t.get_trace(next(iter(a.t.traces)))
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": time.perf_counter() - t, "cpu_s": u.ru_utime + u.ru_stime, "rss_mb": u.ru_maxrss / 1024,
                  "events": len(df)}))
"""


def _shifted(e: dict[str, Any], copy: int, span: float, id_stride: int, steps: int) -> dict[str, Any]:
    e2 = dict(e)
    if "ts" in e2:
        e2["ts"] = float(e2["ts"]) + copy * span
    name = str(e2.get("name", ""))
    if name.startswith("ProfilerStep#"):
        e2["name"] = f"ProfilerStep#{int(name.split('#')[1]) + copy * steps}"
    if "id" in e2 and isinstance(e2["id"], int):
        e2["id"] = e2["id"] + copy * id_stride
    args = e2.get("args")
    if isinstance(args, dict) and ("correlation" in args or "External id" in args):
        args = dict(args)
        for key in ("correlation", "External id"):
            if isinstance(args.get(key), int):
                args[key] += copy * id_stride
        e2["args"] = args
    return e2


def enlarge(base: Path, out: Path, target_mb: float) -> tuple[int, int]:
    """Write `base`'s events repeated to `out` until it holds target_mb MB; (events, steps) written."""
    trace = json.loads(gzip.decompress(base.read_bytes()))
    events = trace.pop("traceEvents")
    meta = [e for e in events if e.get("ph") == "M"]  # process and thread names: once
    timed = [e for e in events if e.get("ph") != "M"]
    steps = len({e["name"] for e in timed if str(e.get("name", "")).startswith("ProfilerStep#")})
    ts = [float(e["ts"]) for e in timed if "ts" in e]
    span = max(float(e["ts"]) + float(e.get("dur", 0)) for e in timed if "ts" in e) - min(ts) + 1000.0
    ids = [v for e in timed for v in ((e.get("args") or {}).get("correlation"), (e.get("args") or {}).get("External id"),
                                     e.get("id")) if isinstance(v, int)]
    id_stride = max(ids) + 1
    n_events = copies = 0
    with open(out, "w") as fh:
        fh.write(json.dumps(trace)[:-1] + ', "traceEvents": [\n')
        fh.write(",\n".join(json.dumps(e) for e in meta))
        n_events += len(meta)
        while fh.tell() < target_mb * 2**20:
            fh.write(",\n" + ",\n".join(json.dumps(_shifted(e, copies, span, id_stride, steps)) for e in timed))
            n_events += len(timed)
            copies += 1
        fh.write("\n]}\n")
    return n_events, copies * steps


def run(cmd: list[str], timeout: float) -> dict[str, Any]:
    """The tool's own figures, or, when it fails or runs out of time, what it had used by then (the CPU time and
    peak RSS of this process's waited-for children, which grew by this one)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        p = None
    if p is not None and p.returncode == 0:
        return json.loads(p.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = (f"{after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime:.0f} s of CPU, peak RSS "
            f"{after.ru_maxrss / 1024:.0f} MB" + (" (or less)" if after.ru_maxrss == before.ru_maxrss else ""))
    if p is None:
        return {"error": f"did not finish in {timeout:.0f} s ({used})"}
    last = (p.stderr.strip().splitlines() or ["?"])[-1]
    return {"error": f"exit {p.returncode} after {time.monotonic() - t0:.0f} s ({used}): {last[:200]}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=1024)
    ap.add_argument("--dir", default="/tmp", help="where the trace is written (and deleted)")
    ap.add_argument("--hta-python", help="a python with HolisticTraceAnalysis (the test extra installs it)")
    ap.add_argument("--hta-gb", type=float, default=12, help="HTA's address-space limit, GB")
    ap.add_argument("--hta-timeout", type=float, default=1800)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="odp-bench-1gb-", dir=args.dir))
    try:
        trace = work / "rank0.pt.trace.json"
        t0 = time.monotonic()
        n_events, n_steps = enlarge(BASE, trace, args.mb)
        size = trace.stat().st_size / 2**20
        print(f"trace: {size:.0f} MB, {n_events} events, {n_steps} steps ({BASE.name} repeated; written in "
              f"{time.monotonic() - t0:.0f} s)", flush=True)
        ours = run([sys.executable, "-c", OURS, str(trace), str(ROOT)], 3600)
        rows = [("ondemandctl report (build_report)", ours)]
        if args.hta_python:
            rows.append(("HTA TraceAnalysis (parse only)",
                         run([args.hta_python, "-c", HTA, str(work), str(args.hta_gb)], args.hta_timeout)))
        load = os.getloadavg()[0]
        print(f"{'tool':<36} {'wall s':>8} {'CPU s':>8} {'peak RSS MB':>12}   (1-min load average {load:.1f})")
        for name, r in rows:
            print(f"{name:<36} {r['s']:>8.1f} {r['cpu_s']:>8.1f} {r['rss_mb']:>12.0f}" if "s" in r
                  else f"{name:<36} {r['error']}")
        if len(rows) == 2 and "s" in rows[1][1] and "s" in ours:
            print(f"HTA / ours: {rows[1][1]['s'] / ours['s']:.2f}x the time, {rows[1][1]['cpu_s'] / ours['cpu_s']:.2f}x "
                  f"the CPU time, {rows[1][1]['rss_mb'] / ours['rss_mb']:.2f}x the memory")
        if "s" in ours:
            print(f"ours: {ours['steps']} steps, {ours['kernels']} kernels, communication {ours['comm_pct']:.1f} %; "
                  f"goal < 60 s and < 1536 MB: {'met' if ours['s'] < 60 and ours['rss_mb'] < 1536 else 'MISSED'}")
            assert ours["steps"] == n_steps, (ours["steps"], n_steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
