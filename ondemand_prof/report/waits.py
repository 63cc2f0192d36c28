"""Who made whom wait, inside one capture: each collective matched across the ranks that ran it, every rank's
arrival, the last arrival, each rank's wait and the transfer.

    match(ranks)  -> Matched: the collectives of a capture's ranks matched, on one clock
    summary(m)    -> what a report prints and --json holds under `collectives`

A collective is identified inside a step by its process group, its kind and its order among the collectives of
that group and kind in the step (the k-th all_reduce of group 0 in step 12): ranks whose streams interleave two
groups differently still match. For each one:
    last arrival  L = the latest arrival of its ranks
    wait of rank r = L - its arrival (it was ready, the others were not)
    transfer       = the median over its ranks of (its end - L): what the transfer itself took once all were there
The rank that arrived last by more than the clocks' residual skew *caused* the others' wait at that collective.
`matrix[i][j]` is how long rank i waited for rank j per step (j arrived after i; DeepXTrace's M[i][j]).

Clocks: ranks on one host share a clock. Another host's clock is moved by the median difference of the
collectives' ends (all ranks of a collective finish together), the residual skew (p90 of what is left) stated.
Pure: no I/O."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .timeline import DEFAULT_GROUP, Timeline

MATRIX_RANKS = 64  # the rank x rank wait matrix in full up to this many ranks; beyond, its heaviest cells
MATRIX_CELLS = 256
MIN_MARGIN_US = 2.0  # a last arrival by less than this (or the residual skew) is a tie: nobody caused the wait


@dataclass
class Entry:
    """One rank's part in one collective (times on the common clock, us)."""

    key: tuple[int, str, str, int]  # (step, group, kind, order in the step among its group and kind)
    arrival: float
    end: float


@dataclass
class RankSteps:
    rank: int
    host: str | None
    steps: dict[int, tuple[float, float, list[Entry]]]  # step -> (t0, length, entries in arrival order)


@dataclass
class Instance:
    key: tuple[int, str, str, int]
    arrivals: dict[int, float]  # rank -> arrival
    ends: dict[int, float]
    last: float = 0.0
    last_rank: int | None = None  # None: a tie (within the margin)
    transfer: float = 0.0
    complete: bool = True  # every rank of its group was captured


@dataclass
class Matched:
    ranks: dict[int, RankSteps]
    instances: dict[tuple[int, str, str, int], Instance]
    steps: list[int]  # the steps every rank recorded
    clock: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    device: bool = False


def match(ranks: Iterable[tuple[int, str | None, Timeline]]) -> Matched | None:
    """(rank, host, timeline) of each rank of a capture -> its collectives matched (None: fewer than two ranks
    with a timeline, or no collective)."""
    given = sorted(ranks, key=lambda r: r[0])
    if len(given) < 2:
        return None
    notes: list[str] = []
    common = set.intersection(*(set(s.step for s in t.steps) for _, _, t in given))
    if not common:
        return None
    offsets, clock = _align(given, common)
    out: dict[int, RankSteps] = {}
    for rank, host, tl in given:
        off = offsets.get(_host(rank, host), 0.0)
        steps = {}
        for s in tl.steps:
            if s.step not in common:
                continue
            counts: dict[tuple[str, str], int] = defaultdict(int)
            entries = []
            for c in s.collectives:
                counts[(c.group, c.kind)] += 1
                entries.append(Entry((s.step, c.group, c.kind, counts[(c.group, c.kind)] - 1), c.arrival + off,
                                     c.end + off))
            steps[s.step] = (s.t0 + off, s.length, entries)
        out[rank] = RankSteps(rank, host, steps)
    instances = _instances(out, {g: set(r) for _, _, t in given for g, r in t.groups.items()}, notes)
    if not instances:
        return None
    skew = clock.get("skew_us") or 0.0
    for inst in instances.values():
        _settle(inst, max(MIN_MARGIN_US, skew))
    dropped = sum(t.dropped_steps for _, _, t in given)
    if dropped:
        notes.append(f"{dropped} step(s) of the ranks' timelines were left out of their summaries (the bound on "
                     "collectives a summary holds): waits are of the steps kept")
    return Matched(out, instances, sorted(common), clock, notes, device=given[0][2].clock == "device")


def _host(rank: int, host: str | None) -> str:
    return host if host else f"rank {rank}"  # a rank of unknown host keeps its own clock


def _instances(ranks: dict[int, RankSteps], groups: dict[str, set[int]], notes: list[str]
               ) -> dict[tuple[int, str, str, int], Instance]:
    found: dict[tuple[int, str, str, int], Instance] = {}
    for r in ranks.values():
        for _, _, entries in r.steps.values():
            for e in entries:
                inst = found.get(e.key)
                if inst is None:
                    inst = found[e.key] = Instance(e.key, {}, {})
                inst.arrivals[r.rank] = e.arrival
                inst.ends[r.rank] = e.end
    present = set(ranks)
    single = [k for k, inst in found.items() if len(inst.arrivals) < 2]
    for k in single:
        del found[k]
    partial = 0
    for inst in found.values():
        members = groups.get(inst.key[1])
        if members is None and inst.key[1] == DEFAULT_GROUP and len(inst.arrivals) < len(present):
            partial += 1
        inst.complete = members is None or members <= present
    if single:
        notes.append(f"{len(single)} collective(s) ran on one captured rank only (another group, or ranks that "
                     "issued different collectives): not matched")
    if partial:
        notes.append(f"{partial} collective(s) of the default group were not run by every captured rank: the "
                     "ranks issued different collectives in those steps")
    if any(not inst.complete for inst in found.values()):
        notes.append("some collectives' groups hold ranks that were not captured: their waits are among the "
                     "captured ranks only")
    return found


def _settle(inst: Instance, margin: float) -> None:
    order = sorted(inst.arrivals.items(), key=lambda kv: kv[1])
    inst.last = order[-1][1]
    inst.last_rank = order[-1][0] if order[-1][1] - order[-2][1] > margin else None
    inst.transfer = max(0.0, statistics.median(inst.ends[r] - inst.last for r in inst.ends))


def _align(given: Sequence[tuple[int, str | None, Timeline]], common: set[int]
           ) -> tuple[dict[str, float], dict[str, Any]]:
    """Per host, what to add to its times to put them on the clock of the lowest rank's host: the median over
    collectives of the difference of their ends (each collective's median end per host)."""
    ends: dict[str, dict[tuple[int, str, str, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    for rank, host, tl in given:
        for s in tl.steps:
            if s.step not in common:
                continue
            counts: dict[tuple[str, str], int] = defaultdict(int)
            for c in s.collectives:
                counts[(c.group, c.kind)] += 1
                ends[_host(rank, host)][(s.step, c.group, c.kind, counts[(c.group, c.kind)] - 1)].append(c.end)
    hosts = list(dict.fromkeys(_host(r, h) for r, h, _ in given))
    if len(hosts) < 2:
        return {}, {"hosts": 1}
    ref = hosts[0]
    offsets = {ref: 0.0}
    residual: list[float] = []
    pending = hosts[1:]
    for _ in range(len(hosts)):  # hosts sharing no collective with the reference go through another host
        for h in list(pending):
            for known in list(offsets):
                diffs = [statistics.median(ends[known][k]) + offsets[known] - statistics.median(v)
                         for k, v in ends[h].items() if k in ends[known]]
                if diffs:
                    offsets[h] = statistics.median(diffs)
                    residual += [abs(d - offsets[h]) for d in diffs]
                    pending.remove(h)
                    break
    skew = _p90(residual) if residual else None
    clock: dict[str, Any] = {"hosts": len(hosts), "aligned_on": len(residual), "skew_us": None if skew is None else round(skew, 1),
             "offsets_us": {h: round(v, 1) for h, v in offsets.items()},
             "unnamed": sum(1 for _, h, _ in given if not h)}
    if pending:
        clock["unaligned"] = pending
    return offsets, clock


def clock_text(clock: dict[str, Any]) -> str:
    """How the ranks' clocks were put on one (waits.py)."""
    skew = clock.get("skew_us")
    whose = f"the clocks of {clock['hosts']} hosts" if not clock.get("unnamed") else \
        f"{clock['hosts']} clocks (the traces name no host: each rank's its own)"
    return (f"{whose} aligned on {clock.get('aligned_on', 0)} collective ends"
            + (f", residual skew {skew:.0f} us (p90)" if skew is not None else ""))


def _p90(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


# ----------------------------------------------------------------------------------------------------------


def summary(m: Matched) -> dict[str, Any]:
    """Per rank: how often it arrived last, its wait and the wait it caused the others (ms per step, each step's
    value); per collective kind: the transfer and the wait (mean over its ranks, per step); the rank x rank wait
    matrix (bounded); the clocks; notes."""
    steps = m.steps
    index = {s: i for i, s in enumerate(steps)}
    ranks = sorted(m.ranks)
    n = len(steps)
    wait = {r: [0.0] * n for r in ranks}
    caused = {r: [0.0] * n for r in ranks}
    last = {r: 0 for r in ranks}
    kinds: dict[str, dict[str, Any]] = {}
    pair: dict[tuple[int, int], float] = defaultdict(float)
    for inst in m.instances.values():
        i = index[inst.key[0]]
        k = kinds.setdefault(inst.key[2], {"transfer": [0.0] * n, "wait": [0.0] * n, "calls": 0})
        k["transfer"][i] += inst.transfer
        k["calls"] += 1
        others = len(inst.arrivals) - 1
        for r, a in inst.arrivals.items():
            w = inst.last - a
            wait[r][i] += w
            k["wait"][i] += w / len(inst.arrivals)
        if inst.last_rank is not None:
            last[inst.last_rank] += 1
            caused[inst.last_rank][i] += sum(inst.last - a for r, a in inst.arrivals.items()
                                             if r != inst.last_rank) / max(1, others)
        if len(ranks) <= MATRIX_RANKS:
            order = sorted(inst.arrivals.items(), key=lambda kv: kv[1])
            for x, (ri, ai) in enumerate(order):
                for rj, aj in order[x + 1:]:
                    pair[(ri, rj)] += aj - ai
    total = len(m.instances)
    per_rank = [{"rank": r, "arrived_last": last[r], "last_share": round(last[r] / total, 3) if total else 0.0,
                 "wait_ms": _ms_mean(wait[r]), "wait_ms_by_step": _ms(wait[r]),
                 "caused_ms": _ms_mean(caused[r]), "caused_ms_by_step": _ms(caused[r])} for r in ranks]
    per_kind = [{"kind": kind, "calls_per_step": round(k["calls"] / n, 3), "transfer_ms": _ms_mean(k["transfer"]),
                 "transfer_ms_by_step": _ms(k["transfer"]), "wait_ms": _ms_mean(k["wait"]),
                 "wait_ms_by_step": _ms(k["wait"])} for kind, k in sorted(kinds.items())]
    out: dict[str, Any] = {"ranks": per_rank, "kinds": per_kind, "matched": total, "steps": steps,
                           "clock": m.clock, "notes": list(m.notes),
                           "arrival": "collective kernel start" if m.device else "c10d operator issued",
                           "matrix": _matrix(pair, ranks, n)}
    return out


def _matrix(pair: dict[tuple[int, int], float], ranks: list[int], n: int) -> dict[str, Any]:
    """How long rank i waited for rank j, ms per step: in full for up to MATRIX_RANKS ranks (rows: who waited);
    else not computed (the per-rank figures say who made the others wait)."""
    if len(ranks) > MATRIX_RANKS:
        return {"ranks": [], "ms_per_step": [], "left_out": f"{len(ranks)} ranks: over {MATRIX_RANKS}"}
    return {"ranks": ranks, "ms_per_step": [[round(pair.get((i, j), 0.0) / 1000 / n, 3) for j in ranks]
                                            for i in ranks]}


def _ms(values: list[float]) -> list[float]:
    return [round(v / 1000, 3) for v in values]


def _ms_mean(values: list[float]) -> float:
    return round(statistics.fmean(values) / 1000, 3) if values else 0.0
