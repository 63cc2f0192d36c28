"""Reading N ranks in parallel: `ondemandctl report` on 16 ranks of 50 MB traces, against one rank, with one
worker process and with one per core.

The traces: a real CPU training profile recorded here with torch.profiler, enlarged to --mb by repeating its
events shifted in time (bench_report.enlarge: synthetic enlargement), then copied once per rank with that rank in
distributedInfo. Each measurement runs build_report() in a fresh process: wall time, the CPU time of that process
itself (small when the workers do the reading), its peak RSS, and the machine's load average at the start (the
2-core machines here are shared: other work makes the numbers noisy).

    .venv/bin/python bench/bench_report_parallel.py [--ranks 16] [--mb 50]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import RECORD, ROOT, enlarge  # noqa: E402  (a sibling script, not a package)

MEASURE = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from ondemand_prof.report import build_report
t, cpu = time.perf_counter(), time.process_time()
r = build_report([Path(p) for p in sys.argv[3:]], workers=int(sys.argv[2]))
ranks = [x for g in r["captures"] for x in g["ranks"]]
print(json.dumps({"s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu, "ranks": len(ranks),
                  "steps": sum(len(x["steps"]) for x in ranks),
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def make_ranks(work: Path, ranks: int, mb: float) -> list[Path]:
    base = work / "base.json"
    subprocess.run([sys.executable, "-c", RECORD, str(base)], check=True, capture_output=True, timeout=600)
    first = work / "rank0.pt.trace.json"
    enlarge(base, first, mb)
    text = first.read_text()
    out = [first]
    for rank in range(1, ranks):  # the same events, another rank: what differs between real ranks does not matter here
        path = work / f"rank{rank}.pt.trace.json"
        path.write_text(text.replace('"rank": 0', f'"rank": {rank}', 1))
        out.append(path)
    return out


def measure(paths: list[Path], workers: int) -> dict:
    load = os.getloadavg()[0]
    p = subprocess.run([sys.executable, "-c", MEASURE, str(ROOT), str(workers), *map(str, paths)],
                       capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "load": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--make", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make:
        make_ranks(Path(args.make), args.ranks, args.mb)
        return
    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="odp-bench-parallel-"))
    try:
        # the traces are made in another process: Linux carries a process's peak RSS over to the children it
        # starts, so a bench process that held a trace would inflate every measured RSS
        subprocess.run([sys.executable, __file__, "--make", str(work), "--ranks", str(args.ranks), "--mb",
                        str(args.mb)], check=True, timeout=1800)
        paths = sorted(work.glob("rank*.pt.trace.json"), key=lambda p: int(p.name[4:].split(".")[0]))
        size = paths[0].stat().st_size / 2**20
        rows = [("1 rank, 1 process", measure(paths[:1], 1)),
                (f"{args.ranks} ranks, 1 process", measure(paths, 1)),
                (f"{args.ranks} ranks, {cores} workers (one per core)", measure(paths, cores))]
        print(f"{args.ranks} traces of {size:.0f} MB each; this machine has {cores} core(s)")
        print(f"{'run':<40} {'seconds':>8} {'per rank':>9} {'own CPU s':>10} {'RSS MB':>7} {'load avg':>9}")
        for name, r in rows:
            print(f"{name:<40} {r['s']:>8.1f} {r['s'] / r['ranks']:>9.2f} {r['cpu_s']:>10.1f} {r['rss_mb']:>7.0f} "
                  f"{r['load']:>9.1f}")
        one, serial, pooled = (r["s"] for _, r in rows)
        print(f"{args.ranks} ranks take {pooled / one:.1f}x one rank's time with the pool "
              f"({serial / one:.1f}x without); speed-up of the pool: {serial / pooled:.2f}x on {cores} core(s)")
        assert rows[2][1]["ranks"] == args.ranks and rows[2][1]["steps"] == rows[1][1]["steps"]
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
