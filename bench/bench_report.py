"""Report speed and memory on a large trace, against HTA (HolisticTraceAnalysis) loading the same trace.

The trace: a real CPU training profile (record_shapes, with_stack, profile_memory) recorded here with
torch.profiler, then enlarged to --mb by repeating its events shifted in time, with new step numbers (a
synthetic enlargement: a real capture of that size takes minutes to record on 2 cores). Written one event per
line, as Kineto writes them.

Each side runs in its own process; wall time and peak RSS (ru_maxrss) are measured there.
  ours: build_report() on the trace's directory: steps, split, operators, memory, everything the report prints.
  HTA:  TraceAnalysis(trace_dir=...) - parsing the trace into its DataFrames, before any analysis.

    .venv/bin/python bench/bench_report.py [--mb 300] [--hta-python /path/to/venv-with-hta/bin/python]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RECORD = r"""
import sys, torch
from torch.profiler import profile, ProfilerActivity, schedule
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True, profile_memory=True,
             schedule=schedule(wait=0, warmup=1, active=20, repeat=1)) as prof:
    for _ in range(21):
        loss = model(torch.randn(64, 256)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        prof.step()
prof.export_chrome_trace(sys.argv[1])
"""

OURS = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[2])
t = time.perf_counter()
from pathlib import Path
from ondemand_prof.report import build_report
r = build_report([Path(sys.argv[1])])
rank = r["captures"][0]["ranks"][0]
print(json.dumps({"s": time.perf_counter() - t, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "steps": len(rank["steps"]), "events": rank["events"]}))
"""

HTA = r"""
import json, resource, sys, time, logging
logging.disable(logging.WARNING)
t = time.perf_counter()
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
df = a.t.get_trace(0)
print(json.dumps({"s": time.perf_counter() - t, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "events": len(df)}))
"""


def enlarge(base: Path, out: Path, target_mb: float) -> tuple[int, int]:
    trace = json.loads(base.read_text())
    events = trace.pop("traceEvents")
    steps = sorted({int(e["name"].split("#")[1]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})
    ts = [float(e["ts"]) for e in events if "ts" in e]
    span = max(ts) - min(ts) + 1000.0
    trace.setdefault("distributedInfo", {"rank": 0, "world_size": 1, "backend": "gloo"})
    n_events = copies = 0
    with open(out, "w") as fh:
        head = json.dumps(trace)[:-1]
        fh.write(head + ', "traceEvents": [\n')
        first = True
        while fh.tell() < target_mb * 2**20:
            for e in events:
                e2 = dict(e)
                if "ts" in e2:
                    e2["ts"] = float(e2["ts"]) + copies * span
                name = str(e2.get("name", ""))
                if name.startswith("ProfilerStep#"):
                    e2["name"] = f"ProfilerStep#{int(name.split('#')[1]) + copies * len(steps)}"
                fh.write(("" if first else ",\n") + json.dumps(e2))
                first = False
                n_events += 1
            copies += 1
        fh.write("\n]}\n")
    return n_events, copies * len(steps)


def run(cmd: list[str]) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=300)
    ap.add_argument("--hta-python", help="a python with HolisticTraceAnalysis installed (not a dependency of ours)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="odp-bench-report-"))
    try:
        base = work / "base.json"
        subprocess.run([sys.executable, "-c", RECORD, str(base)], check=True, capture_output=True, timeout=600)
        trace_dir = work / "traces"
        trace_dir.mkdir()
        n_events, n_steps = enlarge(base, trace_dir / "rank0.pt.trace.json", args.mb)
        size = (trace_dir / "rank0.pt.trace.json").stat().st_size / 2**20
        ours = run([sys.executable, "-c", OURS, str(trace_dir), str(ROOT)])
        rows = [("ondemandctl report (build_report)", ours["s"], ours["rss_mb"])]
        if args.hta_python:
            hta = run([args.hta_python, "-c", HTA, str(trace_dir)])
            rows.append(("HTA TraceAnalysis (parse only)", hta["s"], hta["rss_mb"]))
        print(f"trace: {size:.0f} MB, {n_events} events, {n_steps} steps (a real CPU profile, enlarged)")
        print(f"{'tool':<36} {'seconds':>8} {'peak RSS MB':>12}")
        for name, s, rss in rows:
            print(f"{name:<36} {s:>8.1f} {rss:>12.0f}")
        if len(rows) == 2:
            print(f"HTA / ours: {rows[1][1] / rows[0][1]:.2f}x the time, {rows[1][2] / rows[0][2]:.2f}x the memory")
        assert ours["steps"] == n_steps, (ours["steps"], n_steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
