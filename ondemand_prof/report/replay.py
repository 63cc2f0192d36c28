"""How much of a slowdown each rank explains: the captured steps replayed as a dependency model, with ranks'
work swapped (the what-if analysis of ByteDance-Seed/StragglerAnalysis, OSDI'25, on our step-aligned captures).

The model, per rank, in the order it ran (waits.py matches the collectives):
  * its *work* before each collective: from the end of the collective before it when it waited for that one (it
    arrived after that end: a blocking collective), else from its previous arrival (an asynchronous one, issued
    while the previous was still running), else from the step's start; and its work after the step's last
    collective to the step's end;
  * a collective ends, on every rank of it, at its last arrival plus its transfer (waits.py: the median over its
    ranks of end minus last arrival); the next step begins where the rank's step ended (plus the gap measured).
Replayed with the measured work, the model gives back the measured steps up to its error (printed: how far the
replayed mean step is from the measured one). Then:
  * ideal: every rank's work replaced by the median over the ranks of the same collective's work (the tail by
    the median tail); a rank's *share* is how much longer the step is with its own work put back alone;
  * with a baseline: a rank's share of the growth is how much shorter the step now would be with its work as in
    the baseline (the median over the baseline's steps of the same collective's work); with every rank's work as
    in the baseline, what remains of the growth is the collectives' (transfer, dependencies: the network).
Shares do not add up exactly (two slow ranks at one collective: the step waits for the slower). Above
SHARE_RANKS ranks, shares are computed for the SHARE_RANKS whose work exceeds the median most. Pure: no I/O."""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from .waits import Matched

SHARE_RANKS = 16
BLOCKING_TOL_US = 1.0  # an arrival this close after the previous collective's end waited for it


@dataclass
class Node:
    """One step of one rank's replay: arriving at a collective (key: its instance), or the end of a step."""

    key: tuple[Any, ...]  # an instance key (step, group, kind, order), or ("end", step)
    work: float  # us
    after: str  # "end": the previous collective's end; "arrival": the previous node's time; "start": the step's start
    step: int
    typical: tuple[Any, ...]  # the key without the step: the same collective in another step (the baseline's)


AFTER = {"start": 0, "end": 1, "arrival": 2}


class Replayer:
    """The replay of one capture's matched steps (waits.match's). The nodes are compiled once into flat lists per
    rank (the instance each arrives at, as an index, or -1 for a step's end; how it depends on what came before;
    its step's gap), and a replay takes the work of each node as a list per rank: swapping one rank's work is
    swapping one list."""

    def __init__(self, m: Matched) -> None:
        self.m = m
        self.steps = m.steps
        self.ranks = sorted(m.ranks)
        self.nodes: dict[int, list[Node]] = {r: _nodes(m, r) for r in self.ranks}
        self.start = [m.ranks[r].steps[m.steps[0]][0] for r in self.ranks]
        index = {k: i for i, k in enumerate(m.instances)}
        self.members = [len(inst.arrivals) for inst in m.instances.values()]
        self.transfer = [inst.transfer for inst in m.instances.values()]
        self._inst = [[index[n.key] if n.key[0] != "end" else -1 for n in self.nodes[r]] for r in self.ranks]
        self._after = [[AFTER[n.after] for n in self.nodes[r]] for r in self.ranks]
        self._gap = [[_gap(m, r, n.step) if n.key[0] == "end" else 0.0 for n in self.nodes[r]] for r in self.ranks]
        self.real = [[n.work for n in self.nodes[r]] for r in self.ranks]
        self.measured = [statistics.fmean(m.ranks[r].steps[s][1] for r in self.ranks) for s in m.steps]
        self._median = self._medians()
        self.ideal_work = [[self._median[n.key] for n in self.nodes[r]] for r in self.ranks]

    def _medians(self) -> dict[tuple[Any, ...], float]:
        acc: dict[tuple[Any, ...], list[float]] = defaultdict(list)
        for nodes in self.nodes.values():
            for node in nodes:
                acc[node.key].append(node.work)
        return {k: statistics.median(v) for k, v in acc.items()}

    def run(self, work: list[list[float]] | None = None) -> list[float] | None:
        """The replayed step times (us, mean over the ranks, one per step); `work`: each rank's nodes' work, in
        rank order (default: as measured). None: the ranks' collectives cannot be ordered (a cycle)."""
        work = work or self.real
        nranks = len(self.ranks)
        pos = [0] * nranks
        now = list(self.start)  # time of the rank's previous node
        step_start = list(self.start)
        prev = [-1] * nranks  # the rank's previous collective (an instance index), -1: none in this step
        count = [0] * len(self.members)
        latest = [float("-inf")] * len(self.members)
        ends: list[float | None] = [None] * len(self.members)
        blocked: dict[int, list[int]] = {}
        durations: list[list[float]] = [[] for _ in range(nranks)]
        members, transfer = self.members, self.transfer
        queue = deque(range(nranks))
        while queue:
            r = queue.popleft()
            inst, after, gap, w = self._inst[r], self._after[r], self._gap[r], work[r]
            j, n = pos[r], len(inst)
            while j < n:
                a = after[j]
                if a == 1:
                    pk = prev[r]
                    if pk >= 0:
                        e = ends[pk]
                        if e is None:
                            blocked.setdefault(pk, []).append(r)
                            break
                        base = e
                    else:
                        base = now[r]
                elif a == 0:
                    base = step_start[r]
                else:
                    base = now[r]
                t = base + w[j]
                now[r] = t
                i = inst[j]
                j += 1
                if i < 0:  # a step's end
                    durations[r].append(t - step_start[r])
                    step_start[r] = t + gap[j - 1]
                    prev[r] = -1
                    continue
                prev[r] = i
                count[i] += 1
                if t > latest[i]:
                    latest[i] = t
                if count[i] == members[i]:
                    ends[i] = latest[i] + transfer[i]
                    queue.extend(blocked.pop(i, ()))
            pos[r] = j
        if any(pos[r] < len(self._inst[r]) for r in range(nranks)):
            return None
        return [statistics.fmean(d[i] for d in durations) for i in range(len(self.steps))]

    def alone(self, rank: int, work: list[list[float]], own: list[float]) -> list[list[float]]:
        """`work` with one rank's list swapped for `own`."""
        k = self.ranks.index(rank)
        return work[:k] + [own] + work[k + 1:]

    def ideal(self, keep: int | None = None) -> list[float] | None:
        """Every rank's work the median of the ranks' (rank `keep` with its own)."""
        if keep is None:
            return self.run(self.ideal_work)
        return self.run(self.alone(keep, self.ideal_work, self.real[self.ranks.index(keep)]))

    def excess(self) -> dict[int, float]:
        """Per rank, how much work it did above the median over the window (us): who to replay alone first."""
        med = self._median
        return {r: sum(max(0.0, n.work - med[n.key]) for n in nodes) for r, nodes in self.nodes.items()}

    def typical_work(self) -> dict[int, dict[tuple[Any, ...], float]]:
        """Per rank, the median over the steps of the work before each collective (and of the tail)."""
        out: dict[int, dict[tuple[Any, ...], float]] = {}
        for r, nodes in self.nodes.items():
            acc: dict[tuple[Any, ...], list[float]] = defaultdict(list)
            for node in nodes:
                acc[node.typical].append(node.work)
            out[r] = {k: statistics.median(v) for k, v in acc.items()}
        return out

    def reverted_work(self, rank: int, typical: dict[tuple[Any, ...], float]) -> list[float]:
        """A rank's nodes' work as in another capture (`typical`: typical_work's of that rank), where it has them."""
        return [typical.get(n.typical, n.work) for n in self.nodes[rank]]


def _gap(m: Matched, r: int, step: int) -> float:
    """From the end of the rank's `step` to the start of its next step (0 after the last)."""
    steps = m.steps
    i = steps.index(step)
    if i + 1 >= len(steps):
        return 0.0
    t0, length, _ = m.ranks[r].steps[step]
    return max(0.0, m.ranks[r].steps[steps[i + 1]][0] - (t0 + length))


def _nodes(m: Matched, r: int) -> list[Node]:
    out: list[Node] = []
    rs = m.ranks[r]
    for s in m.steps:
        t0, length, entries = rs.steps[s]
        prev = None
        for e in entries:
            if e.key not in m.instances:
                continue  # not matched: its time is work
            if prev is None:
                out.append(Node(e.key, max(0.0, e.arrival - t0), "start", s, e.key[1:]))
            elif e.arrival >= prev.end - BLOCKING_TOL_US:
                out.append(Node(e.key, e.arrival - prev.end, "end", s, e.key[1:]))
            else:
                out.append(Node(e.key, max(0.0, e.arrival - prev.arrival), "arrival", s, e.key[1:]))
            prev = e
        end = t0 + length
        if prev is None:
            out.append(Node(("end", s), length, "start", s, ("end",)))
        elif end >= prev.end - BLOCKING_TOL_US:
            out.append(Node(("end", s), end - prev.end, "end", s, ("end",)))
        else:
            out.append(Node(("end", s), max(0.0, end - prev.arrival), "arrival", s, ("end",)))
    return out


# ----------------------------------------------------------------------------------------------------------


def analyze(m: Matched) -> dict[str, Any] | None:
    """One capture: the replay's error, the ideal step, and each rank's share of the time above it (ms per step,
    each step's value). None where the model cannot be replayed."""
    rp = Replayer(m)
    real, ideal = rp.run(), rp.ideal()
    if real is None or ideal is None:
        return None
    shares = {}
    for r in _candidates(rp):
        alone = rp.ideal(keep=r)
        if alone is not None:
            shares[r] = [a - i for a, i in zip(alone, ideal)]
    return {"measured_ms": _ms_mean(rp.measured), "replayed_ms": _ms_mean(real), "ideal_ms": _ms_mean(ideal),
            "error_pct": _error(real, rp.measured), "above_ideal_ms_by_step": _ms([a - b for a, b in zip(real, ideal)]),
            "shares": [{"rank": r, "ms": _ms_mean(v), "ms_by_step": _ms(v)} for r, v in sorted(shares.items())],
            "ranks_replayed_alone": len(shares), "ranks": len(rp.nodes)}


def growth(now: Matched, base: Matched) -> dict[str, Any] | None:
    """A capture against its baseline: how much shorter each step now would be with one rank's work as in the
    baseline (its share of the growth), and with every rank's (what remains is the collectives': the network)."""
    rp, rb = Replayer(now), Replayer(base)
    real, base_real = rp.run(), rb.run()
    if real is None or base_real is None:
        return None
    typical = rb.typical_work()
    back = {r: rp.reverted_work(r, typical[r]) for r in rp.ranks if r in typical}

    shares = {}
    for r in _candidates(rp, typical):
        alone = rp.run(rp.alone(r, rp.real, back[r])) if r in back else None
        if alone is not None:
            shares[r] = [a - b for a, b in zip(real, alone)]
    every = rp.run([back.get(r, own) for r, own in zip(rp.ranks, rp.real)])
    out: dict[str, Any] = {"replayed_ms": _ms_mean(real), "baseline_replayed_ms": _ms_mean(base_real),
                           "error_pct": _error(real, rp.measured), "baseline_error_pct": _error(base_real, rb.measured),
                           "shares": [{"rank": r, "ms": _ms_mean(v), "ms_by_step": _ms(v)}
                                      for r, v in sorted(shares.items())],
                           "ranks_replayed_alone": len(shares)}
    if every is not None:
        out["all_reverted_ms"] = _ms_mean(every)
        out["collectives_ms"] = round(_ms_mean(every) - _ms_mean(base_real), 3)
    return out


def _candidates(rp: Replayer, typical: dict[int, dict[tuple[Any, ...], float]] | None = None) -> list[int]:
    """Every rank up to SHARE_RANKS; beyond, those whose work exceeds the median (or, with a baseline, grew) most."""
    if len(rp.nodes) <= SHARE_RANKS:
        return sorted(rp.nodes)
    if typical is None:
        score = rp.excess()
    else:
        score = {r: sum(n.work - typical.get(r, {}).get(n.typical, n.work) for n in nodes)
                 for r, nodes in rp.nodes.items()}
    return sorted(sorted(score, key=lambda r: -score[r])[:SHARE_RANKS])


def _error(replayed: list[float], measured: list[float]) -> float | None:
    total = sum(measured)
    return round(100 * (sum(replayed) - total) / total, 2) if total > 0 else None


def _ms(values: list[float]) -> list[float]:
    return [round(v / 1000, 3) for v in values]


def _ms_mean(values: list[float]) -> float:
    return round(statistics.fmean(values) / 1000, 3) if values else 0.0
