"""The cause line of a comparison, from what compare.py measured: each figure's test (stats.py), who made whom wait
on each side (waits.py) and each rank's share of the growth (replay.py). Pure policy; docs/reports.md writes the
same rule out ("Comparing with a baseline").

    decide(ranks, job, waits, shares) -> {cause, category, culprits, waiting, verdict, findings}

In order:
 1. one step on a side: no noise estimate; the step times are said, no cause is named;
 2. the job's step time is tested on its steady steps (hiccups, steps far above the others, are said apart:
    "1 step in 10: +100 ms on rank 0 (host time outside operators)");
 3. not significantly slower: "no change" (or "faster"), unless a rank's own work grew significantly anyway;
 4. slower: collectives were added on every rank and communication grew at least as much as any rank's own
    work: communication (the kind, its calls);
 5. slower, some ranks' own work (compute, overlap, host time) grew significantly: if every rank's grew alike
    (within 2x of one another) and nobody held the others up, "every rank got slower alike" (the operator that grew
    most; every operator slower a call with the same calls is the host running the job slower, not the job);
    otherwise the ranks whose share of the growth (the replay) is significant are the cause, and the others
    waited for them. A rank whose own work shrank is never the cause while another's grew. A cause rank whose
    run-queue wait grew by at least half its growth with the same operator calls was starved of CPU; one whose
    every operator got slower a call with the same calls ran slower, not more;
 6. slower, no rank's own work grew: the collectives' transfer grew on every rank with no rank arriving later (the
    network), or communication grew (the kind);
 7. slower with no part growing significantly anywhere: said so, with the largest change, not a cause.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from .checks import one_line
from .classify import short_name
from .stats import Change, change

ALIKE = 2.0  # every rank's own growth within this factor of one another: alike
SHARE_MIN = 0.25  # a rank explaining less than this share of the growth is not named as its cause
CPU_WAIT_SHARE = 0.5  # run-queue wait growth explaining this share of a rank's own growth: starved of CPU
SLOWER_RATIO = 1.25  # every operator this much slower a call, with the same calls ...
SLOWER_SHARE = 0.6  # ... over this share of the operators' time: the rank ran slower, not more
SLOWER_MIN_OPS = 5  # ... of at least this many operators, most of them by count too
ADDED_CALLS = 0.05  # ... and calls added a step below this share of its calls
WAIT_FACTOR = 2.0  # the others' communication grew over this many times the cause's work: communication itself
MIN_MS = 0.5
DISPATCH_US = 50.0  # host time outside operators one CPU operator call may cost (~10 us measured, x5 for load)

RULE = ("a change is called only when significant (Welch's t on the per-step values, 95 %) and over max(0.5 ms, 3 % "
        "of the baseline step); cause: the ranks whose own work (compute, overlap, host time) grew and whose replayed "
        "share of the growth is significant, the others waited; every rank's own work grown alike with nobody late: "
        "every rank got slower alike; collectives added or their transfer grown with no rank late: communication, the "
        "network; a rank whose own work shrank is never the cause")

HOST_CATEGORIES = ("CPU (run-queue wait)", "ran slower", "every rank got slower alike", "hiccup: waiting for a CPU")


def decide(ranks: list[dict[str, Any]], job: dict[str, Any], waits: dict[str, Any],
           shares: dict[str, Any] | None, replay: dict[str, Any] | None = None) -> dict[str, Any]:
    """The verdict (module docstring). `shares`: replay.growth's; `replay`: replay.analyze's of the capture."""
    test: Change = job["test"]
    base, now = job["mean"]["baseline"], job["mean"]["now"]
    head = f"step time {base:.2f} -> {now:.2f} ms ({test.text()})"
    if test.verdict == "one_step":
        return _out(f"one step on a side: no noise estimate, so no cause is named; {head}; "
                    + _biggest_change(ranks, shrink=(test.delta or 0) < 0), None, "one_step")
    hiccup = _hiccup_text(ranks)
    steady: Change = job["steady"]
    if steady.n_before != test.n_before or steady.n_after != test.n_after:
        head = f"step time {base:.2f} -> {now:.2f} ms; without its {_left_out(test, steady)}: {steady.text()}"
    grew = [r for r in ranks if _own_grew(r)]
    late = _late_ranks(ranks, waits)
    if steady.verdict != "grew":
        if grew or late:
            return _rank_cause(ranks, grew, late, steady, waits, None, prefix=f"{head}, but ", replay=replay)
        if hiccup:
            cpu = all(r["hiccups"]["now"]["in"] == "waiting for a CPU" for r in ranks if r["rank"] in
                      _hiccup_ranks(ranks))
            return _out(f"{hiccup}; the other steps: {steady.text()}", "hiccup: waiting for a CPU" if cpu else
                        "hiccup", "hiccup", culprits=_hiccup_ranks(ranks))
        added = _added_kinds(ranks)
        if added:
            return _out(f"no significant change: {head}; but the collectives changed on every rank: "
                        + _kind_text(ranks, prefer=added), "communication", "no_change")
        starved = [r for r in ranks if _starved(r)]
        if starved and steady.verdict != "shrank":
            return _out(f"no significant change: {head}; but " + "; ".join(_own_text(r) for r in starved[:4]),
                        "CPU (run-queue wait)", "host", culprits=[r["rank"] for r in starved])
        if steady.verdict == "shrank":
            return _out(f"faster: {head}; " + _biggest_change(ranks, shrink=True), None, "faster")
        return _out(f"no change: {head}" + _within(steady), None, "no_change")
    out = _slower(ranks, grew, late, steady, waits, shares, replay)
    if hiccup:
        out["cause"] += f"; also {hiccup}"
    return out


def _left_out(test: Change, steady: Change) -> str:
    n = (test.n_before - steady.n_before) + (test.n_after - steady.n_after)
    return f"{n} step{'s' if n > 1 else ''} far above the others"


def _out(cause: str, category: str | None, verdict: str, culprits: list[int] | None = None,
         waiting: list[int] | None = None) -> dict[str, Any]:
    """The verdict, with whose it is (`kind`): "job" (a rank's work, its communication, the network, a hiccup of
    its own work: something in the job to act on), "host" (CPU contention, a host running every rank slower), or
    "none" (no significant change, faster, one step, nothing grew that explains it)."""
    if category is None or verdict in ("no_change", "faster", "one_step"):
        kind = "none"
    elif category in HOST_CATEGORIES or verdict == "host":
        kind = "host"
    else:
        kind = "job"
    return {"cause": cause, "category": category, "verdict": verdict, "kind": kind, "culprits": culprits or [],
            "waiting": waiting or []}


def _within(test: Change) -> str:
    return "" if test.lo is None else ", within noise"


def _t(r: dict[str, Any], key: str) -> Change | None:
    d = r["tests"].get(key)
    return Change(**d) if d else None


def _own_grew(r: dict[str, Any]) -> bool:
    """Its own work grew significantly, less the host time its added collective calls explain (on the CPU a
    collective's wait for its peers runs outside its operator: that is communication)."""
    t = _t(r, "own")
    if t is None or t.verdict != "grew" or t.lo is None:
        return False
    host = r.get("collective_host_ms", 0.0)
    return t.lo - host > 0 and (t.delta or 0.0) - host >= max(MIN_MS, 0.5 * (t.delta or 0.0) - host)


def _own(r: dict[str, Any]) -> float:
    t = _t(r, "own")
    return max(0.0, (t.delta or 0.0) - r.get("collective_host_ms", 0.0)) if t else 0.0


def _shrank(r: dict[str, Any]) -> float:
    """How much a rank's own work shrank (ms a step, 0 if it did not): in a synchronous job its wait grows by that
    too (a baseline taken while it was slowed), which another rank's growth need not explain."""
    t = _t(r, "own")
    return max(0.0, -(t.delta or 0.0)) if t else 0.0


def _wait(r: dict[str, Any]) -> float:
    t = _t(r, "communication")
    return (t.delta or 0.0) + r.get("collective_host_ms", 0.0) if t else 0.0


# ----------------------------------------------------------------------------------------------------------


def _slower(ranks: list[dict[str, Any]], grew: list[dict[str, Any]], late: dict[int, Change], steady: Change,
            waits: dict[str, Any], shares: dict[str, Any] | None, replay: dict[str, Any] | None) -> dict[str, Any]:
    added = _added_kinds(ranks)
    mean_own = statistics.fmean(_own(r) for r in ranks)
    mean_wait = statistics.fmean(_wait(r) for r in ranks)
    if added and mean_wait >= mean_own and mean_wait >= MIN_MS:
        return _communication(ranks, grew, prefer=added)
    if grew or late:
        return _rank_cause(ranks, grew, late, steady, waits, shares, replay=replay)
    starved = _starved_ranks(ranks, steady)
    if starved:
        return _out("; ".join(_own_text(r) for r in starved[:4]), "CPU (run-queue wait)", "slower",
                    culprits=[r["rank"] for r in starved])
    network = _network(waits)
    if network:
        return _out(f"every rank: collective transfer grew: {network}, no rank arrived later: the network (or the "
                    "collectives' sizes)", "network", "slower", culprits=[r["rank"] for r in ranks])
    if any((t := _t(r, "communication")) and t.verdict == "grew" for r in ranks):
        return _communication(ranks, grew)
    return _out(f"step time grew {steady.text()} with no part of it growing significantly on any rank: "
                + _biggest_change(ranks), None, "slower")


def _late_ranks(ranks: list[dict[str, Any]], waits: dict[str, Any]) -> dict[int, Change]:
    """Inside the capture, the ranks the others waited for significantly longer than in the baseline (both
    measured inside one capture each: drift of the host between the two does not make this), and whose own work
    did not shrink."""
    b, n = waits.get("baseline"), waits.get("now")
    if not b or not n:
        return {}
    before = {r["rank"]: r for r in b["ranks"]}
    own = {r["rank"]: r for r in ranks}
    out = {}
    for r in n["ranks"]:
        if r["rank"] not in before or r["rank"] not in own:
            continue
        t = change(before[r["rank"]]["caused_ms_by_step"], r["caused_ms_by_step"], MIN_MS)
        o = _t(own[r["rank"]], "own")
        if t.verdict == "grew" and o is not None and (o.delta or 0.0) > 0:
            out[r["rank"]] = t
    return out


def _starved_ranks(ranks: list[dict[str, Any]], steady: Change) -> list[dict[str, Any]]:
    """The ranks whose threads waited significantly longer for a CPU, by at least CPU_WAIT_SHARE of the step's
    growth, with the same operator calls."""
    growth = max(steady.delta or 0.0, MIN_MS)
    return [r for r in ranks if (t := _starved(r)) and (t.delta or 0.0) >= CPU_WAIT_SHARE * growth]


def _communication(ranks: list[dict[str, Any]], grew: list[dict[str, Any]], prefer: list[str] | None = None
                   ) -> dict[str, Any]:
    comm = [r for r in ranks if _wait(r) >= MIN_MS] or ranks
    who = "every rank" if len(comm) == len(ranks) > 1 else ranks_text(comm)
    worked = [r for r in ranks if _own(r) >= MIN_MS]
    listed = ", ".join(f"{_label(r)} {signed(_own(r))}" for r in worked[:4])
    own = f"; own work grew less ({listed} ms/step)" if worked else ", no rank's own work did"
    return _out(f"{who}: communication grew ({_range(_wait(r) for r in comm)} ms/step){own}: "
                + _kind_text(comm, prefer=prefer), "communication", "slower", culprits=[r["rank"] for r in comm])


def _rank_cause(ranks: list[dict[str, Any]], grew: list[dict[str, Any]], late: dict[int, Change], steady: Change,
                waits: dict[str, Any], shares: dict[str, Any] | None, prefix: str = "",
                replay: dict[str, Any] | None = None) -> dict[str, Any]:
    growth = max(steady.delta or 0.0, 0.0)
    if len(grew) == len(ranks) > 1 and _alike(grew) and not late and not _held_up(shares, growth):
        if statistics.fmean(_wait(r) for r in ranks) > statistics.fmean(_own(r) for r in ranks):
            return _communication(ranks, grew)  # every rank's work grew, and its communication grew more
        return _alike_cause(ranks, prefix)
    candidates = grew + [r for r in ranks if r["rank"] in late and r not in grew]
    culprits = _by_share(candidates, shares, growth) or [r for r in candidates if r["rank"] in late] or \
        _by_size(candidates)
    named = {r["rank"] for r in culprits}
    others = [r for r in ranks if r["rank"] not in named]
    largest = max(_own(r) for r in culprits)
    if others and not late and not _by_share(grew, shares, growth) and \
            any(_wait(r) > WAIT_FACTOR * (largest + _shrank(r)) for r in others):
        return _communication(ranks, grew)  # the others waited far longer than this work explains
    texts = [_own_text(r, late.get(r["rank"]) if r not in grew else None, waits) for r in culprits[:4]] + \
        ([f"+{len(culprits) - 4} more ranks"] if len(culprits) > 4 else [])
    category = _category(culprits[0])
    grew_word = "" if category in HOST_CATEGORIES else " grew"
    text = f"{prefix}{ranks_text(culprits)}: {category}{grew_word}: " + "; ".join(texts)
    share = _share_text(culprits, shares, growth) or _ideal_text(culprits, replay)
    if share:
        text += f"; {share}"
    waiting = [r for r in others if (t := _t(r, "communication")) and t.verdict == "grew"] or \
        [r for r in others if _waited_for(waits, r["rank"], named) >= MIN_MS]
    if waiting:
        text += f"; {ranks_text(waiting)} only waited for {'it' if len(culprits) == 1 else 'them'} (" + \
                _waited_text(waiting, waits, named) + ")"
    verdict = "slower" if not prefix else "rank"
    return _out(text, category, verdict, culprits=[r["rank"] for r in culprits], waiting=[r["rank"] for r in waiting])


def _alike(grew: list[dict[str, Any]]) -> bool:
    sizes = [_own(r) for r in grew]
    return min(sizes) > 0 and max(sizes) <= ALIKE * min(sizes)


def _held_up(shares: dict[str, Any] | None, growth: float) -> bool:
    """Did some rank hold the others up: a rank's replayed share of the growth well above the others'."""
    if not shares or not shares.get("shares") or growth <= 0:
        return False
    ms = sorted(max(0.0, s["ms"]) for s in shares["shares"])
    return ms[-1] >= SHARE_MIN * growth and ms[-1] > ALIKE * (ms[0] + MIN_MS)


def _by_share(grew: list[dict[str, Any]], shares: dict[str, Any] | None, growth: float) -> list[dict[str, Any]]:
    """The ranks (of those whose own work grew) whose replayed share of the growth is significant and large."""
    if not shares or growth <= 0:
        return []
    by_rank = {s["rank"]: s for s in shares.get("shares") or []}
    out = []
    for r in grew:
        s = by_rank.get(r["rank"])
        if s is None:
            continue
        t = change([0.0] * len(s["ms_by_step"]), s["ms_by_step"])
        if s["ms"] >= SHARE_MIN * growth and (t.lo is None or t.lo > 0):
            out.append(r)
    return out


def _by_size(grew: list[dict[str, Any]]) -> list[dict[str, Any]]:
    largest = max(_own(r) for r in grew)
    return [r for r in grew if _own(r) >= 0.5 * largest]


def _share_text(culprits: list[dict[str, Any]], shares: dict[str, Any] | None, growth: float) -> str:
    if not shares or growth <= 0:
        return ""
    by_rank = {s["rank"]: s for s in shares.get("shares") or []}
    parts = [f"{_label(r)} explains {min(100, max(0, round(100 * by_rank[r['rank']]['ms'] / growth)))} %"
             for r in culprits[:4] if r["rank"] in by_rank]
    if not parts:
        return ""
    error = shares.get("error_pct")
    return ", ".join(parts) + f" of the {signed(growth)} ms/step" + \
        (f" (what-if replay, its error {error:+.1f} %)" if error is not None else " (what-if replay)")


def _ideal_text(culprits: list[dict[str, Any]], replay: dict[str, Any] | None) -> str:
    """Inside the capture: each culprit's share of the time its steps took above the ideal (every rank's work the
    ranks' median), from the replay of the capture alone."""
    if not replay or not replay.get("shares"):
        return ""
    above = statistics.fmean(replay["above_ideal_ms_by_step"]) if replay["above_ideal_ms_by_step"] else 0.0
    by_rank = {s["rank"]: s for s in replay["shares"]}
    parts = [f"{_label(r)} explains {min(100, max(0, round(100 * by_rank[r['rank']]['ms'] / above)))} %"
             for r in culprits[:4] if r["rank"] in by_rank and above > 0]
    if not parts:
        return ""
    return ", ".join(parts) + f" of the {above:.2f} ms/step its steps took above the ideal (every rank's work the " \
        f"ranks' median; what-if replay, its error {replay['error_pct']:+.1f} %)"


def _waited_for(waits: dict[str, Any], rank: int, culprits: set[int]) -> float:
    """How long `rank` waited for the culprits a step in the capture (the wait matrix), 0 where unknown."""
    w = waits.get("now")
    if not w or not w["matrix"]["ranks"]:
        return 0.0
    order = w["matrix"]["ranks"]
    if rank not in order:
        return 0.0
    row = w["matrix"]["ms_per_step"][order.index(rank)]
    return max((row[order.index(c)] for c in culprits if c in order), default=0.0)


def _waited_text(waiting: list[dict[str, Any]], waits: dict[str, Any], culprits: set[int]) -> str:
    matrix = [_waited_for(waits, r["rank"], culprits) for r in waiting]
    if any(m > 0 for m in matrix):
        lo, hi = min(matrix), max(matrix)
        span = f"{lo:.1f}" if hi - lo < 0.05 * hi else f"{lo:.1f} to {hi:.1f}"
        return f"waited {span} ms/step for {'it' if len(culprits) == 1 else 'them'} in the capture"
    return f"communication {_range(_wait(r) for r in waiting)} ms/step"


def _alike_cause(ranks: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    category = _category(max(ranks, key=_own))
    slower = [r["per_call"]["ratio"] for r in ranks if _ran_slower(r)]
    if len(slower) == len(ranks):
        how = f"every operator ~{statistics.median(slower):.1f}x slower a call with the same calls: the host ran " \
              "the job slower (CPU contention, a lower clock), not more work"
        category = "every rank got slower alike"
    else:
        how = _top_change(ranks, comm=False, category=category)
    return _out(f"{prefix}every rank got slower alike: own work {_range(_own(r) for r in ranks)} ms/step on every "
                f"rank, no rank held the others up" + (f": {how}" if how else ""), category,
                "alike", culprits=[r["rank"] for r in ranks])


def _ran_slower(r: dict[str, Any]) -> bool:
    """Every operator slower a call with the same calls, and that is where its own work grew (its operators'
    time, not host time outside them)."""
    pc = r.get("per_call")
    if not pc:
        return False
    s = r["split"]
    compute = sum((s[k]["now"] or 0.0) - (s[k]["baseline"] or 0.0) for k in ("compute", "overlap"))
    if compute < 0.5 * max(_own(r), MIN_MS):
        return False
    calls = sum((c.get("calls_baseline") or 0.0) for c in r["changes"]) or 1.0
    # broad: most operators, small ones too, slower (one operator slower a call may be larger shapes, more work)
    return pc["ratio"] >= SLOWER_RATIO and pc["share"] >= 0.5 and pc["slower_share"] >= SLOWER_SHARE and \
        pc["ops"] >= SLOWER_MIN_OPS and pc.get("slower_ops", 0.0) >= SLOWER_SHARE and \
        pc["calls_added"] <= max(ADDED_CALLS * calls, 2.0)


def _starved(r: dict[str, Any]) -> Change | None:
    """The rank waited significantly longer for a CPU: its training thread's run-queue wait, or its most starved
    other thread's (a collective's worker: its wait stretches the transfer), with no more operator calls; the
    larger of the two tests."""
    found = _starved_by(r)
    return found[1] if found else None


def _starved_by(r: dict[str, Any]) -> tuple[str, Change] | None:
    found = [(key, t) for key in ("cpu_wait", "proc_wait") if (t := _t(r, key)) is not None and t.verdict == "grew"]
    if not found:
        return None
    pc = r.get("per_call")
    if pc is not None and pc["calls_added"] > max(ADDED_CALLS * 100, 2.0):
        return None
    return max(found, key=lambda kt: kt[1].delta or 0.0)


def _category(r: dict[str, Any]) -> str:
    starved = _starved(r)
    if starved and (starved.delta or 0.0) >= CPU_WAIT_SHARE * max(_own(r), MIN_MS):
        return "CPU (run-queue wait)"
    if _ran_slower(r):
        return "ran slower"
    s = r["split"]
    grown = {k: (s[k]["now"] or 0.0) - (s[k]["baseline"] or 0.0) for k in ("compute", "overlap", "idle")}
    key = max(grown, key=lambda k: grown[k])
    if key == "idle" and r["basis"].get("now") != "device" and _dispatch_explains(r, grown["idle"]):
        return "compute"
    if key == "idle":
        return "device idle (waiting for the host)" if r["basis"].get("now") == "device" else \
            "host time outside operators (input, Python, sleeping)"
    return "compute"


def _dispatch_explains(r: dict[str, Any], idle_growth: float) -> bool:
    """On the CPU, each operator call costs host time outside every operator too (Python, dispatch, the profiler's
    record): 3,000 more tiny additions a step grow that gap more than the additions' own time, and under load by
    3-5x. Where the calls added a step, at DISPATCH_US each, account for the gap's growth, the cause is the work
    those operators do, not input or sleeping (which add no calls)."""
    added = sum(max(0.0, (c["calls_now"] or 0.0) - (c["calls_baseline"] or 0.0)) for c in r["changes"]
                if c["category"] == "operator" and c["calls_now"] is not None and c["calls_baseline"] is not None)
    return added * DISPATCH_US / 1000 >= idle_growth


def _own_text(r: dict[str, Any], late: Change | None = None, waits: dict[str, Any] | None = None) -> str:
    """What grew in a cause rank's own work; for a rank named because the others waited for it (`late`: its own
    growth is not significant by itself), how often it arrived last and how much longer they waited."""
    starved = _starved(r)
    held = ""
    if late is not None:
        last = next((x["last_share"] for x in ((waits or {}).get("now") or {}).get("ranks", [])
                     if x["rank"] == r["rank"]), None)
        held = (f"; it arrived last at {100 * last:.0f} % of the collectives" if last is not None else "") + \
            f", the others waited {late.text()} longer for it"
    if starved and (_category(r) == "CPU (run-queue wait)" or _own(r) < MIN_MS):
        pc = r.get("per_call")
        slower = f" (~{pc['ratio']:.1f}x slower a call)" if pc and pc["ratio"] >= 1.1 else ""
        which = "its training thread's" if (_starved_by(r) or ("",))[0] == "cpu_wait" else \
            "its most starved other thread's (a collective's worker, a loader)"
        return (f"{_label(r)} waited {starved.text()} longer for a CPU ({which} run-queue wait); its "
                f"operators' calls did not change{slower}: other work on its cores or a CPU quota, not the job's"
                + held)
    if _ran_slower(r):
        return (f"{_label(r)}: every operator ~{r['per_call']['ratio']:.1f}x slower a call with the same calls "
                f"(own work {(_t(r, 'own') or Change(None, None, None, None, None, 'none', 0, 0)).text()}): the rank ran slower, not more (CPU contention, a lower clock)"
                + held)
    parts = []
    for key, label in (("compute", "compute"), ("overlap", "overlap"), ("idle", "idle")):
        t = _t(r, key)
        if t is not None and t.verdict == "grew":
            parts.append(f"{label} {t.text()}")
    if not parts:
        t = _t(r, "own")
        parts.append(f"own work {t.text() if t else signed(r['own_growth_ms'])}")
    category = _category(r)
    change = _top_change([r], comm=False, category=category) if category == "compute" or \
        r["basis"].get("now") == "device" else ""
    return f"{_label(r)} " + ", ".join(parts) + (f" ({change})" if change else "") + held


def _top_change(ranks: Iterable[dict[str, Any]], comm: bool, category: str = "compute") -> str:
    """The operator or kernel (communication or not) that grew most over `ranks`, as text. Where the split is
    measured on the device, compute is the kernels' and host time the operators': the change named is of that."""
    best: tuple[float, dict[str, Any]] | None = None
    for r in ranks:
        device = r["basis"].get("now") == "device"
        want = "kernel" if device and category == "compute" else "operator" if device else None
        for c in r["changes"]:
            if (c["category"] == "communication") != comm or (not comm and want and c["category"] != want):
                continue
            grown = (c["now_ms"] or 0.0) - (c["baseline_ms"] or 0.0)
            if best is None or grown > best[0]:
                best = (grown, c)
    if best is None or best[0] <= 0:
        return ""
    return change_text(best[1])


def _kind_text(ranks: list[dict[str, Any]], prefer: list[str] | None = None) -> str:
    """The collective kind whose time grew most over `ranks` (mean), with its calls per step; of `prefer` (kinds
    whose calls grew) where given."""
    grown: dict[str, list[float]] = {}
    for r in ranks:
        for k in r["communication"]["collectives"]:
            g = grown.setdefault(k["kind"], [0.0, 0.0, 0.0, 0.0])
            g[0] += k["now_ms"] - k["baseline_ms"]
            g[1] += k["calls_baseline"]
            g[2] += k["calls_now"]
            g[3] += 1
    if not grown:
        change = _top_change(ranks, comm=True)
        return change or "no collective kind was recognised"
    pool = {k: v for k, v in grown.items() if k in prefer} if prefer else grown
    kind, (d, cb, cn, m) = max((pool or grown).items(), key=lambda kv: kv[1][0])
    calls = f", {_calls(cb / m)} -> {_calls(cn / m)} calls/step" if round(cb / m, 1) != round(cn / m, 1) else ""
    new = " (new)" if cb == 0 else ""
    return f"{kind}{new} {signed(d / m)} ms/step{calls}"


def _added_kinds(ranks: list[dict[str, Any]]) -> list[str]:
    """Collective kinds whose calls per step grew on every rank (a collective added to the step)."""
    kinds: dict[str, int] = {}
    for r in ranks:
        for k in r["communication"]["collectives"]:
            if k["calls_now"] - k["calls_baseline"] >= 0.5:
                kinds[k["kind"]] = kinds.get(k["kind"], 0) + 1
    return [k for k, n in kinds.items() if n == len(ranks)]


def _network(waits: dict[str, Any]) -> str:
    """A collective kind whose transfer grew significantly (per step, the same kind on both sides), as text."""
    b, n = waits.get("baseline"), waits.get("now")
    if not b or not n:
        return ""
    before = {k["kind"]: k for k in b["kinds"]}
    best: tuple[float, str] | None = None
    for k in n["kinds"]:
        if k["kind"] not in before or abs(k["calls_per_step"] - before[k["kind"]]["calls_per_step"]) > 0.01:
            continue
        t = change(before[k["kind"]]["transfer_ms_by_step"], k["transfer_ms_by_step"], MIN_MS)
        if t.verdict == "grew" and (best is None or (t.delta or 0) > best[0]):
            best = (t.delta or 0.0, f"{k['kind']} transfer {t.text()} on every rank")
    if best is None:
        return ""
    late = [r for r in n["ranks"] if r["last_share"] >= 0.8]
    return "" if late and len(n["ranks"]) > 1 else best[1]


def _hiccup_ranks(ranks: list[dict[str, Any]]) -> list[int]:
    """The ranks whose hiccups are their own (not communication: waiting for another rank's hiccup), and that the
    baseline did not have."""
    out = []
    for r in ranks:
        h = (r.get("hiccups") or {}).get("now")
        if h and h["in"] != "communication" and not (r.get("hiccups") or {}).get("baseline"):
            out.append(r["rank"])
    return out


def _hiccup_text(ranks: list[dict[str, Any]]) -> str:
    named = _hiccup_ranks(ranks)
    texts = []
    for r in ranks:
        if r["rank"] not in named:
            continue
        h = r["hiccups"]["now"]
        k = len(h["steps"])
        where = h["in"] + (f": {one_line(h['name'])}" if h.get("name") else "")
        texts.append(f"{k} step{'s' if k > 1 else ''} in {h['of']}: {signed(h['extra_ms'])} ms on {_label(r)} "
                     f"({where}; step {', '.join(map(str, h['steps'][:4]))})")
    return "; ".join(texts[:3])


def _biggest_change(ranks: list[dict[str, Any]], shrink: bool = False) -> str:
    rows = [c for r in ranks for c in r["changes"]]
    if not rows:
        return "no operator or kernel changed"
    pick = min if shrink else max
    c = pick(rows, key=lambda c: (c["now_ms"] or 0.0) - (c["baseline_ms"] or 0.0))
    grown = (c["now_ms"] or 0.0) - (c["baseline_ms"] or 0.0)
    if shrink and grown >= 0:
        return "no operator or kernel shrank"
    if not shrink and grown <= 0:
        return "no operator or kernel grew"
    return ("largest decrease: " if shrink else "largest change: ") + change_text(c)


def change_text(c: dict[str, Any]) -> str:
    """An operator's or kernel's change as the cause line names it."""
    grown = (c["now_ms"] or 0.0) - (c["baseline_ms"] or 0.0)
    calls = ""
    if c.get("calls_baseline") is not None and c.get("calls_now") is not None and \
            round(c["calls_baseline"], 1) != round(c["calls_now"], 1):
        calls = f", {_calls(c['calls_baseline'])} -> {_calls(c['calls_now'])} calls/step"
    elif c.get("mean_us_baseline") and c.get("mean_us_now"):
        calls = f", {c['mean_us_baseline']:.0f} -> {c['mean_us_now']:.0f} us a call"
    flag = " (new)" if c["status"] == "new" else " (vanished)" if c["status"] == "vanished" else ""
    return f"{one_line(short_name(c['name'], 48))}{flag} {signed(grown)} ms/step{calls}"


# ----------------------------------------------------------------------------------------------------------


def signed(x: float) -> str:
    return f"{x:+.2f}" if abs(x) < 10 else f"{x:+.1f}"


def _calls(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"


def _range(values: Iterable[float]) -> str:
    vals = sorted(values)
    if not vals:
        return "-"
    lo, hi = vals[0], vals[-1]
    return signed(lo) if abs(hi - lo) < 0.05 * max(abs(hi), 1e-9) or len(vals) == 1 else \
        f"{signed(lo)} to {signed(hi)}"


def _label(r: dict[str, Any]) -> str:
    """`rank 3`, or `rank ? (no distributedInfo)` for a trace that names none."""
    return f"rank {r['rank']}" if r.get("rank") is not None else "rank ? (no distributedInfo)"


def ranks_text(rows: list[dict[str, Any]]) -> str:
    return ranks_list([r["rank"] for r in rows])


def ranks_list(numbers: list[Any]) -> str:
    """`rank 3`, `ranks 0, 1, 3`, or spans for many: `ranks 0-63, 65-127`."""
    nums = sorted(x for x in numbers if x is not None)
    if not nums:
        return "rank ? (no distributedInfo)" if numbers else "no rank"
    if len(nums) == 1:
        return f"rank {nums[0]}"
    if len(nums) <= 6:
        return "ranks " + ", ".join(map(str, nums))
    spans, start, prev = [], nums[0], nums[0]
    for x in nums[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return "ranks " + ", ".join(spans)
