"""A rank's collectives, step by step: what "who made whom wait" (waits.py) and the what-if replay (replay.py)
read, carried in every rank's summary.json so that ranks on different hosts are matched without their traces.

One entry per collective the rank took part in, in the order it arrived: its kind and process group, its
*arrival* (the rank was ready to communicate) and its *end* (the transfer finished on this rank):
  * CPU (gloo): arrival = the c10d operator that issued it began on the issuing thread; end = gloo's range for it
    ended on its worker thread (matched first in, first out, as analyze.py matches them);
  * GPU (NCCL/RCCL): arrival = the collective kernel began on its stream (it begins when the stream reaches it,
    then waits inside for the peers); end = the kernel ended;
  * torch_npu (HCCL): the hcom_* operation on the HCCL plane began / ended (its Notify_Wait tasks are the wait).
Point-to-point transfers (send/recv: pairs, not groups) and waits are left out: the replay counts them as work.

The encoded form (`encode`, what a summary holds; 200 collectives a step for 20 steps is about 40 KB):
    {"clock": "cpu" | "device", "keys": [[kind, group], ...], "groups": {group: [ranks]},
     "steps": [[step, t0, len, key, da, d, key, da, d, ...], ...], "dropped_steps": n}
t0 is the step's origin in microseconds on the rank's clock (the CPU step's start, or its device window's start;
since the epoch where the trace says its base), len the step's length; per collective `da` is its arrival minus
the previous collective's (the first's: minus t0) and `d` its end minus its arrival, all whole microseconds.
Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

MAX_ENTRIES = 8192  # collectives a summary keeps (20 steps of 200 fit twice): later steps are dropped, and said
MAX_KEYS = 256  # (kind, group) pairs
MAX_GROUP_RANKS = 4096
MATCHED_KINDS = frozenset({"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "barrier",
                           "reduce", "gather", "scatter"})
DEFAULT_GROUP = "0"  # a trace that does not name the group: the default group, every rank of the capture


@dataclass(frozen=True)
class Collective:
    kind: str
    group: str
    arrival: float  # us, the rank's clock
    end: float


@dataclass(frozen=True)
class Step:
    step: int
    t0: float  # us, the rank's clock
    length: float  # us
    collectives: tuple[Collective, ...]


@dataclass(frozen=True)
class Timeline:
    clock: str
    steps: tuple[Step, ...]
    groups: dict[str, tuple[int, ...]]
    dropped_steps: int = 0


def encode(clock: str, steps: Sequence[tuple[int, float, float, Sequence[tuple[str, str, float, float]]]],
           groups: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """steps: (step number, t0 us, length us, [(kind, group, arrival us, end us) in arrival order]) -> the form
    a summary holds (module docstring), bounded by MAX_ENTRIES and MAX_KEYS (steps past them are dropped)."""
    keys: dict[tuple[str, str], int] = {}
    rows: list[list[int]] = []
    used = dropped = 0
    for number, t0, length, entries in steps:
        wanted = {(k, g) for k, g, _, _ in entries} - set(keys)
        if used + len(entries) > MAX_ENTRIES or len(keys) + len(wanted) > MAX_KEYS:
            dropped = len(steps) - len(rows)
            break
        origin = round(t0)
        row = [int(number), origin, max(0, round(length))]
        prev = origin
        for kind, group, arrival, end in entries:
            key = keys.setdefault((kind, group), len(keys))
            at = round(arrival)
            row += [key, at - prev, max(0, round(end) - at)]
            prev = at
        used += len(entries)
        rows.append(row)
    out: dict[str, Any] = {"clock": clock, "keys": [list(k) for k in keys], "steps": rows}
    named = {g: sorted(set(r))[:MAX_GROUP_RANKS] for g, r in (groups or {}).items() if any(g == k[1] for k in keys)}
    if named:
        out["groups"] = named
    if dropped:
        out["dropped_steps"] = dropped
    return out


class Unreadable(ValueError):
    """An encoded timeline that is not what encode writes; the message names the field."""


def decode(data: Any) -> Timeline:
    """The encoded form (a rank's summary: anything) -> a Timeline; Unreadable says what is wrong."""
    if not isinstance(data, dict):
        raise Unreadable("timeline is not an object")
    clock = data.get("clock")
    if clock not in ("cpu", "device"):
        raise Unreadable(f"timeline.clock is {clock!r}, not cpu or device")
    keys = data.get("keys")
    if not isinstance(keys, list) or len(keys) > MAX_KEYS or not all(
            isinstance(k, list) and len(k) == 2 and all(isinstance(x, str) and len(x) <= 256 for x in k)
            for k in keys):
        raise Unreadable("timeline.keys is not a list of [kind, group] names")
    rows = data.get("steps")
    if not isinstance(rows, list):
        raise Unreadable("timeline.steps is not a list")
    steps, seen = [], 0
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) < 3 or (len(row) - 3) % 3 or \
                not all(type(x) is int and abs(x) < 2**62 for x in row):
            raise Unreadable(f"timeline.steps[{i}] is not [step, t0, len, key, da, d, ...] in whole numbers")
        seen += (len(row) - 3) // 3
        if seen > MAX_ENTRIES:
            raise Unreadable(f"timeline holds more than {MAX_ENTRIES} collectives")
        steps.append(_step(row, keys, i))
    groups: dict[str, tuple[int, ...]] = {}
    for name, ranks in (data.get("groups") or {}).items() if isinstance(data.get("groups"), dict) else ():
        if isinstance(ranks, list) and len(ranks) <= MAX_GROUP_RANKS and all(type(r) is int and r >= 0 for r in ranks):
            groups[str(name)] = tuple(ranks)
    dropped = data.get("dropped_steps", 0)
    return Timeline(clock, tuple(steps), groups, dropped if type(dropped) is int and dropped >= 0 else 0)


def _step(row: list[int], keys: list[list[str]], i: int) -> Step:
    number, t0, length = row[0], row[1], row[2]
    if length < 0:
        raise Unreadable(f"timeline.steps[{i}] has a negative length")
    out, at = [], t0
    for j in range(3, len(row), 3):
        key, da, d = row[j], row[j + 1], row[j + 2]
        if not 0 <= key < len(keys) or da < 0 or d < 0:
            raise Unreadable(f"timeline.steps[{i}] has a collective out of order or of an unknown kind")
        at += da
        kind, group = keys[key]
        out.append(Collective(kind, group, float(at), float(at + d)))
    return Step(number, float(t0), float(length), tuple(out))


def shifted(data: dict[str, Any], by_us: float) -> dict[str, Any]:
    """The encoded timeline with every time moved by `by_us` (a trace's base time, so that times are since the
    epoch, as a report's step starts are)."""
    rows = [[r[0], r[1] + round(by_us), *r[2:]] for r in data["steps"]]
    return {**data, "steps": rows}


def in_steps(entries: Iterable[tuple[int, str, str, float, float]], steps: Sequence[tuple[int, float, float]]
             ) -> list[tuple[int, float, float, list[tuple[str, str, float, float]]]]:
    """(step index, kind, group, arrival, end) collectives and the steps' (number, t0, length) -> encode's input:
    per step, the collectives of matched kinds in arrival order."""
    per: list[list[tuple[str, str, float, float]]] = [[] for _ in steps]
    for k, kind, group, arrival, end in entries:
        if 0 <= k < len(steps) and kind in MATCHED_KINDS:
            per[k].append((kind, group, arrival, end))
    return [(number, t0, length, sorted(per[k], key=lambda c: c[2]))
            for k, (number, t0, length) in enumerate(steps)]


def group_of_args(args: Any) -> tuple[str, list[int] | None] | None:
    """The process group a collective's args name, and its ranks where they are listed: newer torch writes
    "Process Group Name" and "Process Group Ranks" (a list, or its text "[0, 1]") on record_param_comms and on
    NCCL kernels; older traces name none (None)."""
    if not isinstance(args, dict):
        return None
    name = args.get("Process Group Name", args.get("pg_name"))
    if not isinstance(name, (str, int)) or isinstance(name, bool) or len(str(name)) > 256:
        return None
    ranks: Any = args.get("Process Group Ranks")
    if isinstance(ranks, str):
        try:
            ranks = [int(x) for x in ranks.strip("[] ").split(",") if x.strip()]
        except ValueError:
            ranks = None
    if not (isinstance(ranks, list) and 0 < len(ranks) <= MAX_GROUP_RANKS
            and all(type(r) is int and r >= 0 for r in ranks)):
        ranks = None
    return str(name), ranks
