"""A pipeline-parallel rank's schedule, step by step: each microbatch's forward and backward on its stage, and the
bubble (the time inside the schedule that the stage computes nothing: it waits for its neighbours' activations or
gradients). What torch.distributed.pipelining labels in the trace (record_function, on the thread that runs the
schedule):
  * `Forward 3`, `Backward 3`: ScheduleGPipe and _ScheduleForwardOnly, one stage a rank (the label names no stage);
  * `PP:1F3`, `PP:1B3`, `PP:1I3`, `PP:1W3`: the schedules of several stages a rank (Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: _PipelineScheduleRuntime's actions): stage, forward / backward /
    backward for the input / backward for the weights, microbatch. Their SEND_F, RECV_B, UNSHARD, REDUCE_GRAD ...
    actions are not computation and are not shown.
Schedule1F1B (torch 2.13) labels nothing: a rank that runs it has no schedule here.

Per action: its start (from the step's start: the CPU step, or on the device its window), its time (the label; on
the device, from the first to the last kernel launched inside it) and the time the stage computes in it (CPU: the
thread inside an operator that is not communication, as the step's split counts work; device: compute kernels).
Per step: the *span*, from the first action's start to the last's end, what the stage computes in it, and the
bubble = span - computing (its share of the span in %). Communication inside an action (a recv that waits for the
previous stage) is bubble: the stage computes nothing then. Point-to-point calls inside the forwards name the stage's
place when the labels do not: a stage whose forwards receive nothing is the first, one whose forwards send nothing
the last.

Bounded for a rank's summary: the actions are the means over the steps (at most MAX_ACTIONS, the earliest kept),
the per-step figures at most MAX_STEPS. Pure: no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

MAX_ACTIONS = 128  # (stage, kind, microbatch) rows a rank's summary keeps: 64 microbatches' forward and backward
MAX_STEPS = 64  # steps whose span and bubble a summary keeps one by one
KINDS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}
_SINGLE = re.compile(r"^(Forward|Backward) (\d{1,6})$")
_MULTI = re.compile(r"^PP:(\d{1,6})([FBIW])(\d{1,6})$")
LABELS = {"single": "Forward i / Backward i (ScheduleGPipe)", "multi": "PP:<stage><F|B|I|W><microbatch>"}


def action_of(name: str) -> tuple[int | None, str, int] | None:
    """(stage, kind, microbatch) of a pipelining label (`Forward 3` -> (None, "F", 3), `PP:1W3` -> (1, "W", 3)), or
    None for any other name."""
    m = _SINGLE.match(name)
    if m:
        return None, "F" if m.group(1) == "Forward" else "B", int(m.group(2))
    m = _MULTI.match(name)
    if m:
        return int(m.group(1)), m.group(2), int(m.group(3))
    return None


@dataclass(frozen=True)
class Action:
    step: int  # index into the steps given to schedule()
    stage: int | None  # None: the label names none (one stage a rank)
    kind: str  # F, B, I, W
    microbatch: int
    start: float  # us, the rank's clock
    end: float
    sends: bool = False  # a send / recv was issued inside it (its stage's place, where the label does not say it)
    recvs: bool = False


def schedule(actions: Sequence[Action], steps: Sequence[tuple[int, float, float]], work: Callable[[float, float], float],
             basis: str = "cpu") -> dict[str, Any] | None:
    """The schedule of one rank (see the module docstring), or None when no step holds an action.

    steps: (step number, origin us, length us) of each step (the CPU step, or its device window); work(lo, hi): the
    time (us) the stage computes between lo and hi."""
    by_step: dict[int, list[Action]] = {}
    for a in actions:
        if 0 <= a.step < len(steps) and a.end >= a.start:
            by_step.setdefault(a.step, []).append(a)
    if not by_step:
        return None
    rows: dict[tuple[int, str, int], list[float]] = {}  # -> [steps seen, start, time, computing] (sums)
    spans = []
    for k in sorted(by_step):
        number, origin, _ = steps[k]
        mine = sorted(by_step[k], key=lambda a: a.start)
        lo, hi = mine[0].start, max(a.end for a in mine)
        spans.append((number, hi - lo, min(work(lo, hi), hi - lo)))
        seen: set[tuple[int, str, int]] = set()
        for a in mine:
            key = (-1 if a.stage is None else a.stage, a.kind, a.microbatch)
            row = rows.setdefault(key, [0, 0.0, 0.0, 0.0])
            if key not in seen:  # (an action twice in a step: its first start, both times)
                row[0] += 1
                row[1] += a.start - origin
                seen.add(key)
            row[2] += a.end - a.start
            row[3] += min(work(a.start, a.end), a.end - a.start)
    n = len(spans)
    order = sorted(rows, key=lambda key: rows[key][1] / rows[key][0])
    listed = [[None if key[0] < 0 else key[0], key[1], key[2], _ms(rows[key][1] / rows[key][0]),
               _ms(rows[key][2] / rows[key][0]), _ms(rows[key][3] / rows[key][0])] for key in order[:MAX_ACTIONS]]
    span = sum(s[1] for s in spans) / n
    busy = sum(s[2] for s in spans) / n
    stages = sorted({a.stage for a in actions if a.stage is not None})
    return {"labels": LABELS["multi" if stages else "single"], "basis": basis, "steps": n, "stages": stages,
            "role": None if stages else _role(actions), "microbatches": len({a.microbatch for a in actions}),
            "actions": listed, "dropped_actions": max(0, len(order) - MAX_ACTIONS),
            "span_ms": _ms(span), "busy_ms": _ms(busy), "bubble_ms": _ms(span - busy),
            "bubble_pct": round(100 * (span - busy) / span, 2) if span > 0 else 0.0,
            "by_step": [[number, _ms(s), _ms(b)] for number, s, b in spans[:MAX_STEPS]]}


def _role(actions: Sequence[Action]) -> str | None:
    """first, middle, last or only, from the point-to-point calls inside the forwards; None without forwards."""
    forwards = [a for a in actions if a.kind == "F"]
    if not forwards:
        return None
    recvs, sends = any(a.recvs for a in forwards), any(a.sends for a in forwards)
    return {(False, True): "first", (True, True): "middle", (True, False): "last", (False, False): "only"}[
        (recvs, sends)]


def _ms(us: float) -> float:
    return round(us / 1000, 3)


def stage_label(p: dict[str, Any]) -> str:
    """How a rank's stage is said: `stage 0, 2` (labels that name them), `first stage` (its place, from its
    point-to-point calls), or `stage ?`."""
    if p.get("stages"):
        return "stage " + ", ".join(str(s) for s in p["stages"])
    return f"{p['role']} stage" if p.get("role") in ("first", "middle", "last", "only") else "stage ?"
