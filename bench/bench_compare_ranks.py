"""A comparison across 4,096 ranks: what each daemon computes from its ranks' summaries (compare_rank), what
crosses the network (each host's reply, as JSON), and what the CLI concludes over all of them (conclude_replies).

The ranks: the summary of a real rank (tests/fixtures/real/hta_sampled_rank-0.json.gz, a 128-rank NCCL job: 162
operators and 100 kernels in its step tables, 5 collectives a step in its timeline), copied to every rank of the
baseline and, for the capture, with every time scaled by a random 0.97-1.03, one straggler rank whose compute grew
by 40 ms a step and arrives 40 ms late at each step's first collective, and every other rank waiting as long in it.
8 ranks a host. The CLI's part matches every collective across the 4,096 ranks on both sides and replays them.

    .venv/bin/python bench/bench_compare_ranks.py [--ranks 4096] [--per-host 8]
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondemand_prof.report.analyze import RankAnalyzer  # noqa: E402
from ondemand_prof.report.compare import compare_rank  # noqa: E402
from ondemand_prof.host.summaries import conclude_replies  # noqa: E402

BASE = ROOT / "tests" / "fixtures" / "real" / "hta_sampled_rank-0.json.gz"


def summary() -> dict[str, Any]:
    an = RankAnalyzer()
    an.feed(json.loads(gzip.decompress(BASE.read_bytes()))["traceEvents"])
    return an.result(15)


def scaled(s: dict[str, Any], rank: int, factor: float, compute_extra_ms: float = 0.0, wait_ms: float = 0.0
           ) -> dict[str, Any]:
    out = copy.deepcopy(s)
    out["rank"] = rank
    for step in out["steps"]:
        for key in ("dur_ms", "window_ms", "compute_ms", "comm_ms", "overlap_ms", "idle_ms"):
            step[key] *= factor
        step["compute_ms"] += compute_extra_ms
        step["comm_ms"] += wait_ms
        step["dur_ms"] += compute_extra_ms + wait_ms
    for table in ("ops", "kernels"):
        for row in out["step_ops"][table]:
            for i in range(2, len(row)):
                row[i] *= factor
    if compute_extra_ms:
        out["step_ops"]["kernels"][0][2] += compute_extra_ms * 1000 * out["step_ops"]["steps"]
        series = out["step_ops"].get("kernels_by_step") or []
        if series:
            series[0] = [x + compute_extra_ms * 1000 for x in series[0]]
    timeline = out.get("timeline")
    if timeline and (compute_extra_ms or wait_ms):  # the straggler arrives late, the others wait as long
        for row in timeline["steps"]:
            if len(row) > 3:
                row[4] += round(compute_extra_ms * 1000)
                row[5] += round(wait_ms * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--per-host", type=int, default=8)
    args = ap.parse_args()
    rng = random.Random(1)
    t0 = time.perf_counter()
    s = summary()
    summary_kb = len(json.dumps(s, separators=(",", ":"))) / 1024
    straggler = args.ranks // 3
    base = [scaled(s, r, 1.0) for r in range(args.ranks)]
    now = [scaled(s, r, rng.uniform(0.97, 1.03), *((40.0, 0.0) if r == straggler else (0.0, 40.0)))
           for r in range(args.ranks)]  # the others wait for it in their collectives
    made = time.perf_counter() - t0

    t0, c0 = time.perf_counter(), time.process_time()
    per_rank, slowest = [], 0.0
    for h in range(0, args.ranks, args.per_host):  # a daemon's share: its host's ranks
        t1 = time.process_time()
        per_rank += [compare_rank(b, n) for b, n in zip(base[h:h + args.per_host], now[h:h + args.per_host])]
        slowest = max(slowest, time.process_time() - t1)
    compared, compared_cpu = time.perf_counter() - t0, time.process_time() - c0

    t0 = time.perf_counter()
    replies = []
    for h in range(0, args.ranks, args.per_host):
        reply = {"capture_id": "now", "baseline_id": "base", "job": "j", "baseline_job": "j",
                 "ranks": per_rank[h:h + args.per_host], "problems": {}, "unmatched": {"baseline": [], "now": []}}
        replies.append((f"host{h // args.per_host}", json.dumps(reply, separators=(",", ":"))))
    encoded = time.perf_counter() - t0
    wire_mb = sum(len(r) for _, r in replies) / 2**20

    t0, c0 = time.perf_counter(), time.process_time()
    result = conclude_replies((name, json.loads(text)) for name, text in replies)
    concluded, concluded_cpu = time.perf_counter() - t0, time.process_time() - c0

    hosts = len(replies)
    print(f"{args.ranks} ranks on {hosts} hosts; one rank's summary {summary_kb:.0f} KB (made in {made:.1f} s)")
    print(f"{'what':<58} {'seconds':>8} {'CPU s':>8}")  # (CPU: what it costs on an idle core, whatever the load)
    print(f"{'compare_rank, every rank (the daemons: in parallel, 8 each)':<58} {compared:>8.2f} {compared_cpu:>8.2f}")
    print(f"{'  the slowest daemon (its 8 ranks), CPU':<58} {'':>8} {slowest:>8.3f}")
    print(f"{'replies as JSON (' + f'{wire_mb:.1f} MB over the network, all hosts)':<58} {encoded:>8.2f}")
    print(f"{'conclude_replies in the CLI (JSON decode + the cause)':<58} {concluded:>8.2f} {concluded_cpu:>8.2f}")
    print(f"load average while it ran: {os.getloadavg()[0]:.1f}")
    print(f"cause: {result['cause'][:160]}")
    assert result["culprits"] == [straggler], result["culprits"]


if __name__ == "__main__":
    main()
