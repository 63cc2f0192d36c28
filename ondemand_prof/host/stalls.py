"""Which ranks are stuck or slow, from what their heartbeats said: time in the current step, a STALLED rank
(a hung collective, a deadlock, a rank asleep: its agent thread still answers, so heartbeats alone cannot tell),
the line status and capture print for a stalled job, and each rank's step time against its job's median
(stragglers). Pure: times are passed in; a rank is anything with RankInfo's step fields (host/registry.py, or
the metrics' snapshot rows)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

from ..core.ranks import spans

# A rank is STALLED once its current step has run STALL_STEPS of its median steps, and at least STALL_MIN_S: a hung
# collective, a deadlock, a rank asleep. Its agent thread still answers, so heartbeats alone cannot tell.
STALL_MIN_S = 10.0
STALL_STEPS = 20
SLOW_RATIO = 1.2  # a rank this much slower than its job's median step time is marked slow in status


def time_in_step(rank: Any, wall: float) -> float | None:
    """How long a rank's current step has run at `wall` (a RankInfo, or anything with its step fields: the
    metrics' snapshot rows): as the rank measured it when it sent its last heartbeat, plus the time since we read
    that heartbeat. A daemon that read its queue late (a starved CPU) thus never takes a heartbeat's age for time
    in the step."""
    if rank.step_began_at is None:
        return None
    if rank.sent_at is not None and rank.heard_at is not None:
        return max(0.0, rank.sent_at - rank.step_began_at) + max(0.0, wall - rank.heard_at)
    return max(0.0, wall - rank.step_began_at)


def stalled_for(rank: Any, wall: float) -> float | None:
    """How long the rank has been in its current step, once that is a stall (STALL_STEPS of its median step,
    at least STALL_MIN_S); None while it steps, and before it finished a step (a job starting up: rendezvous,
    loading data, compiling; status says 'starting')."""
    ran = time_in_step(rank, wall)
    if ran is None or not (rank.step_time or rank.observed_step_time):
        return None
    return ran if ran > max(STALL_MIN_S, STALL_STEPS * (rank.step_time or 0.0)) else None


def stalls(ranks: Sequence[dict[str, Any]], wall: float) -> dict[str, Any] | None:
    """Of a job's ranks (as status shows them), those STALLED: which, at which step, since when (the earliest
    of them). None when every rank steps."""
    stalled = [r for r in ranks if r.get("stalled_s") is not None]
    if not stalled:
        return None
    longest = max(r["stalled_s"] for r in stalled)
    return {"ranks": [r["rank"] for r in stalled], "steps": {str(r["rank"]): r["step"] for r in stalled},
            "stalled_s": longest, "since": wall - longest, "all": len(stalled) == len(ranks),
            "hosts": sorted({r["daemon"] for r in stalled if r.get("daemon")})}  # across hosts: whose daemon


def stall_text(job: str, stall: dict[str, Any]) -> str:
    """One line a person in a hurry can act on: who is stuck, where, since when, and what to run next."""
    steps = sorted(set(stall["steps"].values()))
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    since = time.strftime("%H:%M:%S", time.localtime(stall["since"]))
    on = f" on {', '.join(stall['hosts'])}" if stall.get("hosts") else ""
    return (f"job {job} is STALLED: rank(s) {spans(stall['ranks'])}{on} have not finished a step for "
            f"{stall['stalled_s']:.0f} s (since {since}, at {at}); see where they wait: ondemandctl stacks --job "
            f"{job} (and flight-recorder)")


def stragglers(ranks: list[dict[str, Any]], ratio: float = SLOW_RATIO) -> dict[str, Any]:
    """Each rank's step time against its job's median (adds vs_median and slow to each rank dict)."""
    times = [r["step_time_s"] for r in ranks if r.get("step_time_s")]
    median = statistics.median(times) if times else None
    for r in ranks:
        st = r.get("step_time_s")
        r["vs_median"] = round(st / median, 3) if st and median else None
        r["slow"] = bool(st and median and st > ratio * median)
    return {"median_step_time_s": median, "slow_ranks": [r["rank"] for r in ranks if r["slow"]],
            "slow_ratio": ratio}
