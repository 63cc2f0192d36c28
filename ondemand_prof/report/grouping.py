"""Which rank reports make one capture, and when the slowest rank stands out. Pure policy: rank reports in, groups
out (no files, no threads).

Grouping, by what the traces say, never across jobs:
  1. our captures name their job and capture id in metadata.json: one capture per (job, capture id), wherever its
     ranks' directories are;
  2. anything else is grouped within one folder, one format (Kineto traces; torch_npu output) and one world size
     (distributedInfo, torch_npu's profiler_metadata.json); within that, ranks go together when they recorded the
     same step numbers at the same time. A rank number seen twice starts another capture (tensorboard_trace_handler
     writes every cycle of a schedule into one folder), as do the same steps recorded more than a minute apart
     (two runs of one script); a trace that names no rank is a capture of its own. Traces in different folders are
     never merged: nothing in a Kineto trace names its job.

The slowest rank is marked only when it stands out from the spread of the others: with at least SLOW_MIN_RANKS
ranks, its mean step exceeds the median of the other ranks by more than SLOW_MIN_PCT % of that median and by more
than SLOW_SPREADS robust standard deviations of the others (1.4826 x their median absolute deviation). The
others' spread, not all ranks', so that the straggler does not widen its own yardstick.
"""

from __future__ import annotations

import statistics
from typing import Any

from .model import RankResult, Slowest

SLOW_MIN_RANKS = 3
SLOW_MIN_PCT = 5.0
SLOW_SPREADS = 3.0
MAD_TO_SD = 1.4826     # a normal distribution's standard deviation per median absolute deviation
APART_US = 60e6        # the same steps recorded this far apart are two runs
EPOCH_US = 1e14        # step starts above this are wall-clock (µs since 1970), comparable across files
SLOW_RULE = (f"marked when at least {SLOW_MIN_RANKS} ranks have steps and its mean step exceeds the other ranks' "
             f"median by more than {SLOW_MIN_PCT:g} % and by more than {SLOW_SPREADS:g} robust standard deviations "
             f"of the other ranks ({MAD_TO_SD} x their median absolute deviation)")

Group = tuple[tuple[Any, Any], str, list[RankResult]]  # (job id, capture id), why these ranks, the ranks


def by_capture_id(job: Any, capture_id: Any, read_from: str) -> str:
    """Why ranks are one capture: their capture id (and job), as `read_from` gives it (metadata.json, the
    daemon's record)."""
    return f"capture id {capture_id}" + (f" of job {job}" if job else "") + f" ({read_from})"


def group_ranks(members: list[RankResult]) -> list[Group]:
    """The rank reports grouped into captures (module docstring), each with a sentence saying why."""
    ours: dict[tuple[Any, Any], list[RankResult]] = {}
    rest: dict[tuple[Any, ...], list[RankResult]] = {}
    for m in members:
        if m.get("capture_id"):
            ours.setdefault((m.get("job_id"), m["capture_id"]), []).append(m)
        else:
            family = "torch_npu" if m.get("kind") == "ascend" else "Kineto"
            rest.setdefault((m.get("folder") or "", family, _world(m), m.get("job_id")), []).append(m)
    groups: list[Group] = []
    for (job, cid), ms in ours.items():
        groups.append(((job, cid), by_capture_id(job, cid, "metadata.json"), ms))
    for (folder, family, world, job), ms in rest.items():
        buckets = _split(ms)
        for k, bucket in enumerate(buckets):
            why = f"{family} output in {folder or 'the same folder'}"
            if world:
                why += f", world size {world}"
            steps = _steps(bucket[0])
            if steps:
                why += f", steps {steps[0]}..{steps[-1]}" if len(steps) > 1 else f", step {steps[0]}"
            if len(buckets) > 1:
                why += f" (set {k + 1} of {len(buckets)} there: " + _why_split(bucket) + ")"
            groups.append(((job, None), why, bucket))
    return groups


def _world(m: RankResult) -> int | None:
    w = m.get("world_size")
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None


def _steps(m: RankResult) -> tuple[int, ...]:
    return tuple(s["step"] for s in m.get("steps") or [] if isinstance(s.get("step"), int))


def _span(m: RankResult) -> tuple[float, float] | None:
    """When the rank's steps ran, in wall-clock µs; None when the file's times are not wall-clock."""
    starts = [(s["start_us"], s["start_us"] + 1000 * (s.get("dur_ms") or 0)) for s in m.get("steps") or []
              if isinstance(s.get("start_us"), (int, float))]
    if not starts or min(a for a, _ in starts) < EPOCH_US:
        return None
    return min(a for a, _ in starts), max(b for _, b in starts)


def _apart(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool:
    if a is None or b is None:
        return False
    gap = max(a[0], b[0]) - min(a[1], b[1])
    return gap > max(APART_US, 2 * max(a[1] - a[0], b[1] - b[0]))


def _split(members: list[RankResult]) -> list[list[RankResult]]:
    """Ranks of one folder into captures: same steps, no rank twice, not apart in time; earliest first."""
    ordered = sorted(members, key=lambda m: ((_span(m) or (0.0, 0.0))[0], m.get("path") or ""))
    buckets: list[list[RankResult]] = []
    for m in ordered:
        for bucket in buckets:
            head = bucket[0]
            if (m.get("rank") is not None and all(o.get("rank") != m.get("rank") for o in bucket)
                    and _steps(head) == _steps(m) and not _apart(_span(head), _span(m))):
                bucket.append(m)
                break
        else:
            buckets.append([m])
    return buckets


def _why_split(bucket: list[RankResult]) -> str:
    if len(bucket) == 1 and bucket[0].get("rank") is None:
        return "the trace names no rank"
    return "ranks " + ", ".join(str(m.get("rank")) for m in bucket)


# ----------------------------------------------------------------------------------------------------------

def vs_median_pct(ms: float | None, median: float | None) -> float | None:
    """How far a mean step time is from the capture's median, in % of the median (the report's "vs median"
    column and the slowest rank's distance); None when either is unknown or zero."""
    if not ms or not median:
        return None
    return 100 * (ms - median) / median


def slowest_rank(timed: list[tuple[Any, float]]) -> Slowest | None:
    """(rank, mean step ms) pairs -> the slowest rank, its distance from the median of all ranks, and whether it
    stands out from the spread of the others (SLOW_RULE)."""
    if not timed:
        return None
    median = statistics.median(ms for _, ms in timed)
    k = max(range(len(timed)), key=lambda i: timed[i][1])
    rank, ms = timed[k]
    out: Slowest = {"rank": rank, "step_ms": ms, "vs_median_ms": ms - median,
                    "vs_median_pct": vs_median_pct(ms, median) or 0.0, "stands_out": False, "rule": SLOW_RULE}
    others = [v for i, (_, v) in enumerate(timed) if i != k]
    if len(timed) < SLOW_MIN_RANKS:
        out["why_not"] = f"fewer than {SLOW_MIN_RANKS} ranks: no spread to judge against"
        return out
    centre = statistics.median(others)
    spread = MAD_TO_SD * statistics.median(abs(v - centre) for v in others)
    threshold = max(centre * SLOW_MIN_PCT / 100, SLOW_SPREADS * spread)
    out["others_median_ms"] = centre  # new keys in this order after "rule" (--json prints them as set)
    out["others_spread_ms"] = spread
    out["threshold_ms"] = threshold
    out["stands_out"] = ms - centre > threshold
    if not out["stands_out"]:
        out["why_not"] = (f"{ms - centre:+.2f} ms from the other ranks' median is within {threshold:.2f} ms "
                          f"(the larger of {SLOW_MIN_PCT:g} % and {SLOW_SPREADS:g} x their spread {spread:.2f} ms)")
    return out
