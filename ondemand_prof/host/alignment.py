"""Whether the ranks of one capture record the same steps. Pure: records and plans in, verdicts out.

Two checks, one on each side of a capture:
- before: a window shared with ranks on other hosts (ondemandctl across hosts sends the same `start_step`
  to every daemon) that reaches a daemon after its start has passed on that daemon's ranks is refused
  there, with the reason in the capture record. On one host a late rank starts late and says so; across
  hosts the daemon that got the window late (a partition, a pause) would record other steps than the rest,
  after the CLI may have given up on it, so it records nothing instead.
- after: a record whose ranks recorded different steps is `misaligned` (`ondemandctl show` and
  `capture --wait` say so and exit non-zero), on one host or across hosts.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..core.ranks import spans

MISALIGNED = "misaligned"  # a record's status when its ranks recorded different steps


def late_refusal(plan: Mapping[str, Any]) -> str | None:
    """Why a window shared with other hosts cannot be recorded here: the ranks (from `plan_window`'s
    `past_ranks`, the ranks whose current step is at or after the start) that would begin it late. None when
    every target can still begin it on its first step."""
    past = sorted(plan.get("past_ranks") or [])
    if not past:
        return None
    current = plan.get("current_steps") or {}
    at = [current[r] for r in past if r in current]
    where = f" (at step {min(at)}" + (f"-{max(at)}" if max(at) != min(at) else "") + ")" if at else ""
    return (f"refused: this window is shared with ranks on other hosts and reached this host after its start: "
            f"rank(s) {spans(past)} were already past step {plan['start_step']}{where}; recording it late would "
            "record other steps than the other hosts' ranks")


def refuse_parts(record: Any, reason: str, wall: float) -> None:
    """Mark every part of a new CaptureRecord rejected with `reason` (its status becomes failed)."""
    for key in list(record.data["parts"]):
        record.update(int(key), "rejected", {"error": reason}, wall)


def step_groups(parts: Iterable[Mapping[str, Any]]) -> dict[tuple[int, ...], list[int]]:
    """The distinct step lists that finished parts recorded -> their ranks. A cancelled part (stopped
    early on purpose) and a part that did not finish are left out."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for p in parts:
        steps = p.get("steps")
        if p.get("state") != "done" or p.get("cancelled") or not isinstance(steps, list) or not steps:
            continue
        if not all(type(s) is int for s in steps):
            continue
        groups.setdefault(tuple(steps), []).append(p["rank"])
    for ranks in groups.values():
        ranks.sort()
    return groups


def misalignment(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """None when every rank that finished recorded the same steps; else what each group of ranks recorded,
    largest group first: {"groups": [{"steps": [a, b], "ranks": [..]}, ...], "text": "..."}."""
    groups = step_groups((record.get("parts") or {}).values())
    if len(groups) < 2:
        return None
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    out: list[dict[str, Any]] = [{"steps": [s[0], s[-1]], "count": len(s), "ranks": ranks} for s, ranks in ordered]
    text = "; ".join(f"rank(s) {spans(g['ranks'])} recorded steps {g['steps'][0]}..{g['steps'][1]}" for g in out)
    return {"groups": out, "text": f"ranks recorded different steps: {text}"}


def mark_misaligned(record: dict[str, Any]) -> bool:
    """Set `misaligned` (the groups) and the status `misaligned` on a finished record whose ranks recorded
    different steps; True when it did. A running or cancelled record is left as it is."""
    if record.get("status") not in ("done", "partial"):
        return False
    found = misalignment(record)
    if found is None:
        return False
    record["misaligned"] = found
    record["status"] = MISALIGNED
    return True
