"""Merging rank summaries across hosts: what `ondemandctl --hosts ... report <capture id>` does after the
fan-out, for 4096 ranks (64 hosts x 64 ranks). Goal: under 10 s.

One real summary.json is made by the post-processing code (rank/postprocess.py write_rank_summary) from a
synthetic trace (10 steps, 300 operator names, device kernels, memory events); 4096 copies with each rank's
own step times stand for the ranks. Timed: decoding the 64 daemons' `summaries` replies from their wire
frames, merging (host/summaries.py merge_summaries, i.e. the report's own summarize_group), and rendering
the across-ranks text and the full per-rank text.

    .venv/bin/python bench/bench_merge.py [--hosts 64] [--ranks-per 64]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_daemon import print_table  # noqa: E402
from ondemand_prof.core.protocol import MAX_REPLY_BYTES, decode, reply_ok  # noqa: E402
from ondemand_prof.host.client import REPLIES  # noqa: E402
from ondemand_prof.host.summaries import merge_summaries  # noqa: E402
from ondemand_prof.core.tracedefs import SUMMARY_FILE  # noqa: E402
from ondemand_prof.rank.postprocess import write_rank_summary  # noqa: E402
from ondemand_prof.report.text import render_text  # noqa: E402


def synthetic_trace(steps: int = 10, ops: int = 300) -> dict[str, Any]:
    rnd = random.Random(1)
    events: list[dict[str, Any]] = []
    ts = 0.0
    for s in range(100, 100 + steps):
        step_dur = 50_000.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "ts": ts, "dur": step_dur,
                       "pid": 1, "tid": 1})
        t = ts + 10
        for k in range(200):
            name = f"aten::op{rnd.randrange(ops)}"
            dur = rnd.uniform(5, 200)
            events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": t, "dur": dur, "pid": 1, "tid": 1})
            events.append({"ph": "X", "cat": "kernel", "name": f"kernel_{name[6:]}", "ts": t + 5, "dur": dur / 2,
                           "pid": 0, "tid": 7})
            t += dur + 1
        events.append({"ph": "X", "cat": "kernel", "name": "ncclKernel_AllReduce", "ts": t, "dur": 3000.0, "pid": 0,
                       "tid": 7})
        events.append({"ph": "i", "name": "[memory]", "ts": t, "pid": 1, "tid": 1,
                       "args": {"Device Type": 1, "Device Id": 0, "Bytes": 1 << 20, "Total Allocated": 1 << 30,
                                "Total Reserved": 2 << 30}})
        ts += step_dur + 100
    return {"traceEvents": events, "distributedInfo": {"rank": 0}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--ranks-per", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"rank": 0, "world_size": args.hosts * args.ranks_per,
                "meta": {"job_id": "bench", "capture_id": "20260101-000000-abcdef"}}
        write_rank_summary(Path(tmp), synthetic_trace(), spec)
        base = json.loads((Path(tmp) / SUMMARY_FILE).read_text())
    size = len(json.dumps(base, separators=(",", ":")))
    rnd = random.Random(2)
    frames = []
    for h in range(args.hosts):
        parts = []
        for i in range(args.ranks_per):
            rank = h * args.ranks_per + i
            summary = copy.deepcopy(base)
            summary["rank"] = rank
            slow = 1.0 + rnd.random() * 0.05 + (0.3 if rank == 777 else 0.0)
            for step in summary["steps"]:
                step["dur_ms"] *= slow
            summary["step_ms_mean"] *= slow
            parts.append({"rank": rank, "host": f"node{h:03d}", "pid": 1000 + i, "state": "done",
                          "path": f"/data/profile/x/node{h:03d}_{1000 + i}_pt", "late_by": None, "summary": summary})
        data = {"capture_id": base["capture_id"], "job": "bench", "window": [100, 110], "status": "done",
                "options": {}, "parts": parts}
        frames.append((f"node{h:03d}", reply_ok(1, data)))
    wire = sum(len(f) for _, f in frames)

    t0 = time.perf_counter()
    replies = [(name, decode(frame, REPLIES, MAX_REPLY_BYTES)["data"]) for name, frame in frames]
    t1 = time.perf_counter()
    data = merge_summaries(replies)
    t2 = time.perf_counter()
    across = render_text(data, top=10, per_rank=False)
    t3 = time.perf_counter()
    full = render_text(data, top=10, per_rank=True)
    t4 = time.perf_counter()
    n = args.hosts * args.ranks_per
    assert data["ranks_read"] == n and data["captures"][0]["slowest"]["rank"] == 777, data["captures"][0]["slowest"]
    rows = [("one rank's summary.json", f"{size / 1024:.1f} KiB"),
            (f"{args.hosts} replies on the wire ({n} summaries)", f"{wire / 2**20:.1f} MiB"),
            ("decode the replies", f"{t1 - t0:.2f} s"),
            (f"merge {n} summaries (summarize_group)", f"{t2 - t1:.2f} s"),
            ("render across-ranks text", f"{t3 - t2:.2f} s ({len(across.splitlines())} lines)"),
            ("render per-rank text", f"{t4 - t3:.2f} s ({len(full.splitlines())} lines)"),
            ("total (decode + merge + across-ranks text)", f"{t3 - t0:.2f} s   (goal < 10 s)")]
    print_table(rows)


if __name__ == "__main__":
    main()
