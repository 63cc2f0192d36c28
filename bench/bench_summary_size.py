"""What the answers add to a rank's summary.json: the collectives' timeline (each step's collectives, arrival and
end), the operators' and kernels' per-step times, the collective kinds' per-step times. Issue 43's bound: at most
64 KiB more for 20 steps of 200 collectives.

Synthetic traces (named so), built here as a rank's trace is: 20 ProfilerSteps, each with 200 collectives and 300
distinct operators (and, for the GPU one, 300 distinct kernels, 200 of them NCCL's):
  cpu: c10d::allreduce_ on the training thread, gloo:all_reduce on a worker thread (gloo's way)
  gpu: the same operators launching kernels, NCCL kernels on their own stream

    .venv/bin/python bench/bench_summary_size.py [--steps 20] [--collectives 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ondemand_prof.report.analyze import RankAnalyzer  # noqa: E402

ADDED = ("timeline", "ops_by_step", "kernels_by_step", "ms_by_step")  # what the answers added


def synthetic_trace(steps: int, collectives: int, gpu: bool, ops: int = 300) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    t = 1_000_000.0
    corr = 1
    for s in range(steps):
        step_start = t
        for i in range(ops):  # one call each of 300 operators
            events.append({"ph": "X", "cat": "cpu_op", "name": f"aten::op{i}", "pid": 1, "tid": 1, "ts": t,
                           "dur": 20.0})
            if gpu:
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                               "ts": t + 1, "dur": 5.0, "args": {"correlation": corr}})
                events.append({"ph": "X", "cat": "kernel", "name": f"kernel_{i}", "pid": 0, "tid": 7, "ts": t + 30,
                               "dur": 15.0, "args": {"correlation": corr}})
                corr += 1
            t += 25
        for c in range(collectives):
            events.append({"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 1, "ts": t,
                           "dur": 10.0})
            if gpu:
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                               "ts": t + 1, "dur": 5.0, "args": {"correlation": corr}})
                events.append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_AllReduce_Sum_f32_RING_LL_{c}",
                               "pid": 0, "tid": 9, "ts": t + 40, "dur": 90.0 + c % 7, "args": {"correlation": corr}})
                corr += 1
            else:
                events.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2,
                               "ts": t + 12, "dur": 80.0 + c % 7})
            t += 110
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                       "ts": step_start, "dur": t - step_start})
        t += 5
    return events


def sizes(events: list[dict[str, Any]]) -> tuple[int, int, float]:
    """(summary bytes as written, bytes without what the answers added, seconds to analyse)."""
    t0 = time.perf_counter()
    an = RankAnalyzer()
    an.feed(events)
    summary = an.result(15)
    took = time.perf_counter() - t0
    full = len(json.dumps(summary, separators=(",", ":"), default=str))
    without = json.loads(json.dumps(summary, default=str))
    without.pop("timeline", None)
    for key in ("ops_by_step", "kernels_by_step"):
        without["step_ops"].pop(key, None)
    for row in without.get("collectives") or []:
        row.pop("ms_by_step", None)
    return full, len(json.dumps(without, separators=(",", ":"))), took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--collectives", type=int, default=200)
    args = ap.parse_args()
    print(f"{args.steps} steps of {args.collectives} collectives and 300 operators (synthetic traces)")
    print(f"{'trace':<6} {'summary KiB':>12} {'without the answers':>20} {'added KiB':>10} {'bound':>7} {'analysed s':>11}")
    for gpu in (False, True):
        full, without, took = sizes(synthetic_trace(args.steps, args.collectives, gpu))
        added = (full - without) / 1024
        print(f"{'gpu' if gpu else 'cpu':<6} {full / 1024:>12.1f} {without / 1024:>20.1f} {added:>10.1f} "
              f"{'64':>7} {took:>11.2f}")


if __name__ == "__main__":
    main()
