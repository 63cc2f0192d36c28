"""Comparing two 1 GB Kineto traces (a capture against its baseline), against reporting on one, and against HTA's
TraceDiff on the same pair: time and peak memory of each.

The pair: HTA's own real trace_diff pair (tests/fixtures/real/hta_trace_diff_{control,test}.json.gz: rank 3 of an
8-GPU A100 job, and the same model changed), each one's steps repeated until the file holds --mb MB, as
bench_report_1gb.py does (shifted in time, steps renumbered, correlation ids offset). Written to --dir and deleted
at the end.

Each run is a process of its own; wall time is measured there, and its peak RSS and CPU time summed over it and
every process under it (sampled every 20 ms: the comparison reads its two traces in worker processes at once).
  report:    build_report() on the capture alone, one worker (what `ondemandctl report NOW` costs)
  compare:   build_reports() of both + compare_groups() (what `ondemandctl report NOW --baseline BASE` costs),
             with the default workers (one per core) and with one
  HTA:       LabeledTrace of both + TraceDiff.compare_traces over every step, CPU and GPU (--hta-mb: HTA's
             parse of a 1 GB trace takes ~20 minutes and ~6 GB here, so it runs on a smaller pair, and ours is run
             on that pair too for the ratio), under an address-space limit (--hta-gb)

    .venv/bin/python bench/bench_compare_1gb.py [--mb 1024] [--hta-mb 64] [--hta-gb 12] [--no-hta]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report_1gb import enlarge, run  # noqa: E402  (the same enlargement and measurement)

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "tests" / "fixtures" / "real"
PAIR = (REAL / "hta_trace_diff_control.json.gz", REAL / "hta_trace_diff_test.json.gz")

SAMPLER = r"""
import threading, psutil
_peak, _cpu, _stop = [0.0], {}, threading.Event()
def _sample():
    me = psutil.Process()
    while not _stop.is_set():
        total = 0.0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
                t = p.cpu_times()
                _cpu[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        _peak[0] = max(_peak[0], total)
        _stop.wait(0.02)
threading.Thread(target=_sample, daemon=True).start()
def tree():  # (peak RSS of this process and every process under it, MB; their CPU seconds, as last sampled)
    _stop.set()
    return _peak[0] / 2**20, sum(_cpu.values())
"""

REPORT = SAMPLER + r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[2])
t = time.perf_counter()
from pathlib import Path
from ondemand_prof.report import build_report
r = build_report([Path(sys.argv[1])], workers=1)
s = time.perf_counter() - t
rss, cpu = tree()
print(json.dumps({"s": s, "cpu_s": cpu, "rss_mb": rss, "steps": len(r["captures"][0]["ranks"][0]["steps"])}))
"""

COMPARE = SAMPLER + r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[4])
t = time.perf_counter()
from pathlib import Path
from ondemand_prof.report import build_reports, compare_groups
workers = int(sys.argv[3]) or None
now, base = build_reports([[Path(sys.argv[1])], [Path(sys.argv[2])]], workers=workers)
c = compare_groups(base["captures"][0], now["captures"][0])
s = time.perf_counter() - t
rss, cpu = tree()
print(json.dumps({"s": s, "cpu_s": cpu, "rss_mb": rss, "cause": c["cause"], "steps": c["ranks"][0]["steps"]["now"]}))
"""

HTA = r"""
import json, resource, sys, time, logging
limit = int(float(sys.argv[3]) * 2**30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
logging.disable(logging.WARNING)
t = time.perf_counter()
from hta.trace_diff import DeviceType, LabeledTrace, TraceDiff
c, n = LabeledTrace("control", trace_dir=sys.argv[1]), LabeledTrace("test", trace_dir=sys.argv[2])
for device in (DeviceType.CPU, DeviceType.GPU):
    TraceDiff.compare_traces(c, n, control_iteration=c.iterations(), test_iteration=n.iterations(),
                             device_type=device)
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"s": time.perf_counter() - t, "cpu_s": u.ru_utime + u.ru_stime, "rss_mb": u.ru_maxrss / 1024}))
"""


def pair(work: Path, mb: float) -> tuple[Path, Path]:
    """The enlarged baseline and capture, each in a folder of its own (HTA reads folders)."""
    out = []
    for label, src in zip(("base", "now"), PAIR):
        d = work / f"{label}-{mb:g}"
        d.mkdir()
        enlarge(src, d / "rank3.pt.trace.json", mb)
        out.append(d / "rank3.pt.trace.json")
    return out[0], out[1]


def row(name: str, r: dict) -> str:
    if "s" not in r:
        return f"{name:<44} {r['error']}"
    return f"{name:<44} {r['s']:>8.1f} {r['cpu_s']:>8.1f} {r['rss_mb']:>13.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=1024, help="size of each trace of the pair")
    ap.add_argument("--hta-mb", type=float, default=64, help="size of each trace of HTA's pair")
    ap.add_argument("--hta-gb", type=float, default=12, help="HTA's address-space limit, GB")
    ap.add_argument("--hta-timeout", type=float, default=3600)
    ap.add_argument("--no-hta", action="store_true")
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="odp-bench-cmp-", dir=args.dir))
    rows = []
    try:
        t0 = time.monotonic()
        base, now = pair(work, args.mb)
        print(f"pair: {base.stat().st_size / 2**20:.0f} + {now.stat().st_size / 2**20:.0f} MB (written in "
              f"{time.monotonic() - t0:.0f} s)", flush=True)
        one = run([sys.executable, "-c", REPORT, str(now), str(ROOT)], 3600)
        rows.append((f"report of one ({args.mb:g} MB), 1 worker", one))
        both = run([sys.executable, "-c", COMPARE, str(now), str(base), "0", str(ROOT)], 3600)
        rows.append((f"compare ({args.mb:g} MB each), 1 worker a core", both))
        serial = run([sys.executable, "-c", COMPARE, str(now), str(base), "1", str(ROOT)], 3600)
        rows.append((f"compare ({args.mb:g} MB each), 1 worker", serial))
        for p in (base, now):
            p.unlink()
        if not args.no_hta:
            hbase, hnow = pair(work, args.hta_mb)
            rows.append((f"compare ({args.hta_mb:g} MB each), 1 worker a core",
                         run([sys.executable, "-c", COMPARE, str(hnow), str(hbase), "0", str(ROOT)], 3600)))
            rows.append((f"HTA TraceDiff ({args.hta_mb:g} MB each)",
                         run([sys.executable, "-c", HTA, str(hbase.parent), str(hnow.parent), str(args.hta_gb)],
                             args.hta_timeout)))
        load = os.getloadavg()[0]
        print(f"{'what':<44} {'wall s':>8} {'CPU s':>8} {'peak RSS MB':>13}   (all its processes; load average "
              f"{load:.1f}, {os.cpu_count()} cores)")
        for name, r in rows:
            print(row(name, r))
        if "s" in one and "s" in both:
            print(f"compare / report of one: {both['s'] / one['s']:.2f}x the time (goal <= 2); peak RSS "
                  f"{both['rss_mb']:.0f} MB (goal < 2048); cause: {both['cause']}")
        if len(rows) == 5 and "s" in rows[3][1] and "s" in rows[4][1]:
            print(f"HTA / ours on the {args.hta_mb:g} MB pair: {rows[4][1]['s'] / rows[3][1]['s']:.1f}x the time, "
                  f"{rows[4][1]['rss_mb'] / rows[3][1]['rss_mb']:.1f}x the memory")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
