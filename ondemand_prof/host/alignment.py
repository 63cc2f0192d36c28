"""Whether the ranks of one capture record the same steps. Pure: records and plans in, verdicts out.

Two checks, one on each side of a capture:
- before: a window shared with ranks on other hosts (ondemandctl across hosts sends the same `start_step`
  to every daemon) that reaches a daemon after its start has passed on that daemon's ranks is refused
  there, with the reason in the capture record. On one host a late rank starts late and says so; across
  hosts the daemon that got the window late (a partition, a pause) would record other steps than the rest,
  after the CLI may have given up on it, so it records nothing instead.
- after: a record whose ranks recorded different steps is `misaligned`, settled once on the record when its last
  part is final (host/records.py CaptureRecord._settle), so that list, show, capture --wait, --json and the
  metrics say the same; across hosts the merge of one capture's records applies the same rule to all its ranks
  (host/merge.py), and `list` compares the steps each host's ranks recorded (`recorded`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol

from ..core.ranks import spans
from .recordtypes import Misaligned, RecordData

MISALIGNED = "misaligned"  # a record's status when its ranks recorded different steps


class Planned(Protocol):
    """What the check before a window reads of its plan (records.Plan; this module imports no record)."""

    @property
    def start_step(self) -> int: ...

    @property
    def current_steps(self) -> Mapping[int, int]: ...

    @property
    def past_ranks(self) -> tuple[int, ...]: ...


def late_refusal(plan: Planned) -> str | None:
    """Why a window shared with other hosts cannot be recorded here: the ranks (the plan's `past_ranks`, the
    ranks whose current step is at or after the start) that would begin it late. None when every target can
    still begin it on its first step."""
    past = sorted(plan.past_ranks)
    if not past:
        return None
    current = plan.current_steps
    at = [current[r] for r in past if r in current]
    where = f" (at step {min(at)}" + (f"-{max(at)}" if max(at) != min(at) else "") + ")" if at else ""
    return (f"refused: this window is shared with ranks on other hosts and reached this host after its start: "
            f"rank(s) {spans(past)} were already past step {plan.start_step}{where}; recording it late would "
            "record other steps than the other hosts' ranks")


def refuse_parts(record: Any, reason: str, wall: float) -> None:
    """Mark every part of a new CaptureRecord rejected with `reason` (its status becomes failed)."""
    for key in list(record.data["parts"]):
        record.update(int(key), "rejected", {"error": reason}, wall)


Steps = tuple[int, int, int]  # what a rank recorded: its first and last step, and how many


def recorded_steps(part: Mapping[str, Any]) -> Steps | None:
    """The steps a finished part recorded, (first, last, count); None for a part that did not finish, or was
    cancelled (stopped early on purpose), or said no steps."""
    steps = part.get("steps")
    if part.get("state") != "done" or part.get("cancelled") or not isinstance(steps, list) or not steps:
        return None
    if not all(type(s) is int for s in steps):
        return None
    return (steps[0], steps[-1], len(steps))


def step_groups(parts: Iterable[Mapping[str, Any]]) -> dict[Steps, list[int]]:
    """The distinct steps that finished parts recorded (recorded_steps) -> their ranks."""
    groups: dict[Steps, list[int]] = {}
    for p in parts:
        steps = recorded_steps(p)
        if steps is not None:
            groups.setdefault(steps, []).append(p["rank"])
    for ranks in groups.values():
        ranks.sort()
    return groups


def recorded(parts: Iterable[Mapping[str, Any]]) -> list[list[int]]:
    """The distinct steps the finished parts recorded, [first, last, count] each, in order (what `list` merges
    across hosts: two of them, on one host or across hosts, is a misaligned capture)."""
    distinct: set[Steps] = set()
    for p in parts:
        steps = recorded_steps(p)
        if steps is not None:
            distinct.add(steps)
    return [list(s) for s in sorted(distinct)]


def misalignment(record: Mapping[str, Any]) -> Misaligned | None:
    """None when every rank that finished recorded the same steps; else what each group of ranks recorded,
    largest group first: {"groups": [{"steps": [a, b], "count": n, "ranks": [..]}, ...], "text": "..."}."""
    groups = step_groups((record.get("parts") or {}).values())
    if len(groups) < 2:
        return None
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    out: list[dict[str, Any]] = [{"steps": [s[0], s[1]], "count": s[2], "ranks": ranks} for s, ranks in ordered]
    text = "; ".join(f"rank(s) {spans(g['ranks'])} recorded steps {g['steps'][0]}..{g['steps'][1]}" for g in out)
    return {"groups": out, "text": f"ranks recorded different steps: {text}"}


def merge_recorded(recorded_on_hosts: Iterable[Any]) -> list[list[int]]:
    """The hosts' `recorded` lists (of one capture's summaries, as replies carry them: checked; a host's may be
    missing, an older daemon) as one: two or more entries, and the capture is misaligned."""
    seen = {(s[0], s[1], s[2]) for steps in recorded_on_hosts if isinstance(steps, list) for s in steps
            if isinstance(s, list) and len(s) == 3 and all(type(x) is int for x in s)}
    return [list(s) for s in sorted(seen)]


def mark_misaligned(record: RecordData) -> bool:
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
