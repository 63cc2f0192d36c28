"""What ONDEMAND_PROF_AUTO=1 costs a Python process that never imports torch: `python -c pass` with the variable
unset and set, interleaved, many times; medians of the child's CPU time (user + system: wall time on a shared
machine mostly measures the run queue). With --before FILE, also the same with FILE (an
older ondemand_prof_auto.py) found first on PYTHONPATH, so a change of the start-up hook is compared in one run.

    .venv/bin/python bench/bench_zero_code_start.py [--runs 60] [--before /tmp/old/ondemand_prof_auto.py]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def one(env: dict[str, str]) -> float:
    """CPU time (user + system) of one `python -c pass`: on a shared machine wall time mostly measures the queue."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--before", type=Path, help="an older ondemand_prof_auto.py to compare with")
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if not k.startswith("ONDEMAND_PROF_")}
    variants = {"variable unset": base, "ONDEMAND_PROF_AUTO=1": {**base, "ONDEMAND_PROF_AUTO": "1"}}
    tmp = None
    if args.before is not None:
        tmp = Path(tempfile.mkdtemp(prefix="odpauto"))
        shutil.copy(args.before, tmp / "ondemand_prof_auto.py")
        variants["ONDEMAND_PROF_AUTO=1, the --before hook"] = {**base, "ONDEMAND_PROF_AUTO": "1",
                                                              "PYTHONPATH": str(tmp)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(3):  # warm the page cache and the .pyc files
            for env in variants.values():
                one(env)
        for _ in range(args.runs):
            for name, env in variants.items():
                times[name].append(one(env))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    unset = statistics.median(times["variable unset"])
    print(f"python -c pass, {args.runs} runs each, interleaved (median CPU time of the child; 2-core machine, "
          f"load {os.getloadavg()[0]:.1f})")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name:<40} | {med * 1000:6.1f} ms | {(med - unset) * 1000:+6.1f} ms |")


if __name__ == "__main__":
    main()
