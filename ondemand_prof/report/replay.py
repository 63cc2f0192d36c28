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
from typing import Any, Callable

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


class Replayer:
    """The replay of one capture's matched steps (waits.match's)."""

    def __init__(self, m: Matched) -> None:
        self.m = m
        self.steps = m.steps
        self.nodes: dict[int, list[Node]] = {r: _nodes(m, r) for r in m.ranks}
        self.start: dict[int, float] = {r: m.ranks[r].steps[m.steps[0]][0] for r in m.ranks}
        self.gap: dict[tuple[int, int], float] = {}  # (rank, step) -> from its end to the next step's start
        for r, rs in m.ranks.items():
            for a, b in zip(m.steps, m.steps[1:]):
                t0a, lena, _ = rs.steps[a]
                self.gap[(r, a)] = max(0.0, rs.steps[b][0] - (t0a + lena))
        self.members = {k: sorted(inst.arrivals) for k, inst in m.instances.items()}
        self.transfer = {k: inst.transfer for k, inst in m.instances.items()}
        self.measured = [statistics.fmean(m.ranks[r].steps[s][1] for r in m.ranks) for s in m.steps]
        self._median = self._medians()

    def _medians(self) -> dict[tuple[Any, ...], float]:
        acc: dict[tuple[Any, ...], list[float]] = defaultdict(list)
        for nodes in self.nodes.values():
            for node in nodes:
                acc[node.key].append(node.work)
        return {k: statistics.median(v) for k, v in acc.items()}

    def run(self, work: Callable[[int, Node], float] | None = None) -> list[float] | None:
        """The replayed step times (us, mean over the ranks, one per step); `work(rank, node)` chooses each
        node's work (default: as measured). None: the ranks' collectives cannot be ordered (a cycle)."""
        pick = work or (lambda r, node: node.work)
        pos = {r: 0 for r in self.nodes}
        now = {r: self.start[r] for r in self.nodes}  # time of the rank's previous node
        last_end: dict[int, float] = {}  # the end of the rank's previous collective
        step_start: dict[int, float] = dict(self.start)
        arrived: dict[tuple[Any, ...], list[float]] = defaultdict(list)
        ends: dict[tuple[Any, ...], float] = {}
        blocked: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        prev_key: dict[int, tuple[Any, ...] | None] = {r: None for r in self.nodes}
        durations: dict[int, list[float]] = {r: [] for r in self.nodes}
        queue = deque(self.nodes)
        while queue:
            r = queue.popleft()
            nodes = self.nodes[r]
            while pos[r] < len(nodes):
                node = nodes[pos[r]]
                if node.after == "end":
                    pk = prev_key[r]
                    if pk is not None and pk not in ends:
                        blocked[pk].append(r)
                        break
                    base = ends[pk] if pk is not None else now[r]
                elif node.after == "start":
                    base = step_start[r]
                else:
                    base = now[r]
                t = base + pick(r, node)
                now[r] = t
                pos[r] += 1
                if node.key[0] == "end":
                    durations[r].append(t - step_start[r])
                    step_start[r] = t + self.gap.get((r, node.step), 0.0)
                    prev_key[r] = None
                    continue
                prev_key[r] = node.key
                arrived[node.key].append(t)
                if len(arrived[node.key]) == len(self.members[node.key]):
                    ends[node.key] = max(arrived[node.key]) + self.transfer[node.key]
                    queue.extend(blocked.pop(node.key, []))
        if any(pos[r] < len(self.nodes[r]) for r in self.nodes):
            return None
        n = len(self.steps)
        return [statistics.fmean(durations[r][i] for r in durations) for i in range(n)]

    def ideal(self, keep: int | None = None) -> list[float] | None:
        """Every rank's work the median of the ranks' (rank `keep` with its own)."""
        med = self._median
        return self.run(lambda r, node: node.work if r == keep else med[node.key])

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

    def reverted(ranks: set[int]) -> list[float] | None:
        return rp.run(lambda r, node: typical.get(r, {}).get(node.typical, node.work) if r in ranks else node.work)

    shares = {}
    for r in _candidates(rp, typical):
        alone = reverted({r})
        if alone is not None:
            shares[r] = [a - b for a, b in zip(real, alone)]
    every = reverted(set(rp.nodes))
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
