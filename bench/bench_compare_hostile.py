"""What a hostile rank's summary.json costs the daemon's loop in `compare` (host/summaries.py compare_records: the
daemon's command, show of an automatic capture, an automatic capture's cause line): the largest summaries a rank
may write (512 KB, MAX_SUMMARY_BYTES) built to be slow, each written for every rank of both captures, then one
compare_records over them, timed, with the reply's size and the process's peak RSS growth. Cases:

    real       the summary of a real rank (hta_sampled_rank-0: 162 operators, 100 kernels), for scale
    rows       the most a rank may hold and be compared: 1,000 operators and 1,000 kernels of 200-character names
    steps      ~7,000 steps (what 512 KB of steps holds)
    refused    25,000 operators: refused by count (what remains is reading the file)

    .venv/bin/python bench/bench_compare_hostile.py [--ranks 64]
"""

from __future__ import annotations

import argparse
import gzip
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondemand_prof.host.summaries import MAX_SUMMARY_BYTES, compare_records  # noqa: E402
from ondemand_prof.report.analyze import RankAnalyzer  # noqa: E402

REAL = ROOT / "tests" / "fixtures" / "real" / "hta_sampled_rank-0.json.gz"


def case(kind: str) -> dict[str, Any]:
    if kind == "real":
        an = RankAnalyzer()
        an.feed(json.loads(gzip.decompress(REAL.read_bytes()))["traceEvents"])
        return json.loads(json.dumps(an.result(15), default=str))
    s: dict[str, Any] = {"rank": 0, "world_size": 64, "basis": "cpu", "steps": [{"dur_ms": 1, "compute_ms": 1}] * 4,
                         "step_ops": {"steps": 4, "ops": [], "kernels": [], "complete": {"ops": True, "kernels": True}},
                         "collectives": [{"kind": f"k{i}", "count_per_step": 1, "ms_per_step": 1} for i in range(64)]}
    if kind == "rows":
        s["step_ops"]["ops"] = [[f"{'n' * 200}{i}", 1, 1, 1] for i in range(1000)]
        s["step_ops"]["kernels"] = [[f"{'k' * 200}{i}", 1, 1] for i in range(1000)]
    elif kind == "steps":
        while len(json.dumps(s)) < MAX_SUMMARY_BYTES - 40_000:
            s["steps"] += [{"dur_ms": 1.5, "compute_ms": 1.25, "comm_ms": 0.5, "idle_ms": 0.25}] * 500
    elif kind == "refused":
        s["step_ops"]["ops"] = [[f"o{i}", 1, 1, 1] for i in range(25_000)]
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64, help="ranks of each capture on the host (default 64)")
    args = ap.parse_args()
    print(f"{'case':<9} {'KB':>5} {'ranks':>5} {'compare s':>9} {'ms/rank':>8} {'reply KB':>8} {'RSS +MB':>7} "
          f"{'compared':>8} {'refused':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("real", "rows", "steps", "refused"):
            raw = json.dumps(case(kind))
            assert len(raw) <= MAX_SUMMARY_BYTES, (kind, len(raw))
            records = {}
            for side in ("base", "now"):
                parts = {}
                for r in range(args.ranks):
                    d = Path(tmp) / kind / side / f"r{r}"
                    d.mkdir(parents=True)
                    (d / "summary.json").write_text(raw)
                    parts[str(r)] = {"rank": r, "host": "h", "pid": 1, "state": "done", "path": str(d)}
                records[side] = {"capture_id": side, "job": "j", "parts": parts}
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t0 = time.perf_counter()
            out = compare_records(records["now"], records["base"])
            took = time.perf_counter() - t0
            grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) // 1024
            print(f"{kind:<9} {len(raw) // 1024:>5} {args.ranks:>5} {took:>9.2f} {1000 * took / args.ranks:>8.1f} "
                  f"{len(json.dumps(out)) // 1024:>8} {grew:>7} {len(out['ranks']):>8} {len(out['problems']):>7}")


if __name__ == "__main__":
    main()
