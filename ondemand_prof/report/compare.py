"""What changed between a healthy baseline capture and a capture now, and which rank caused it.

    compare_rank(base, now) -> one rank's figures, baseline against now (per step means)
    conclude(ranks, ...)    -> the job's: step time, the cause line, what cannot be compared

Both take what a rank's report holds (report.analyze's result: a RankResult, or the summary.json a rank writes
with the same fields), so a comparison reads the same on one host (traces read here) and across hosts (each
daemon compares its ranks' summaries, host/commands/report.py, and the CLI concludes over all of them): no trace
crosses the network. Pure: no I/O, nothing heavy imported (the daemon uses it for an automatic capture's log line).

Every figure is a mean per recorded step, so captures of different lengths compare. Ranks are matched by rank
number. Operators and kernels are matched by name: an operator's time is its self time (what adds up), a kernel's
its time inside the steps.

The rule that names the cause (docs/reports.md, "Comparing with a baseline"):
  * a rank's own growth is what its compute, overlap and idle time (host work outside operators: input, Python,
    a device waiting for its host) grew by; its wait growth is what its exposed communication grew by;
  * a change is significant above max(MIN_MS, BASE_SHARE of the baseline step, JOB_SHARE of the job's growth);
  * the cause is the rank(s) whose own growth is significant and at least half the largest; a rank whose
    communication grew while another rank's own work grew by about as much (within a factor of WAIT_FACTOR) only
    waited for it, and is named as waiting, not as a cause; when the others' communication grew by more than
    WAIT_FACTOR times the largest own growth, that work does not explain it and the cause is communication;
  * when no rank's own work grew, the cause is communication itself (every rank, or the ranks whose communication
    grew), named by the collective kind whose time grew most;
  * when every rank's own work grew alike, the cause is that work on every rank, named by the operator or kernel
    that grew most, unless the ranks' communication grew more (on the mean of the ranks): then it is
    communication (20 more barriers a step cost every rank ~3-4 ms of Python outside operators and 11-17 ms of
    communication);
  * on the CPU, host time outside operators that grew by no more than the operator calls added a step explain
    (DISPATCH_US a call: Python and dispatch between operators) is the work of those operators: compute;
  * on the CPU, host time outside operators that grew by no more than the collective calls added a step explain
    (COLLECTIVE_HOST_US a call: a collective's Python and its wait for the peers run outside its operator) is
    communication: it counts as the rank's wait growth, not its own (20 more barriers a step showed on one rank as
    4.7 ms more host time, on the other as 8 ms more communication).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

from ..core.ranks import MAX_RANK
from .checks import (MAX_CALLS, MAX_KINDS, MAX_MS, MAX_NAME, MAX_ROWS, MAX_TABLE_STEPS, Unusable, column_sum,
                     one_line, rank_number)
from .checks import a_list as _list
from .checks import entry as _entry
from .checks import number as _ms
from .checks import shown as _shown
from .checks import word as _word

SPLIT = (("compute", "compute_ms"), ("communication", "comm_ms"), ("overlap", "overlap_ms"), ("idle", "idle_ms"))
CHANGES = 10  # operators and kernels listed per rank
MIN_MS = 0.5  # a change smaller than this per step is noise, whatever the step time
BASE_SHARE = 0.05  # ... or smaller than this share of the baseline step
JOB_SHARE = 0.25  # ... or than this share of the job's growth
WAIT_FACTOR = 2.0  # "about as much": a waiting rank's communication growth within this factor of the cause's
SAME_MODEL = 0.3  # operator time matching by name below this share: two different models, said so
DISPATCH_US = 50.0  # host time outside operators one CPU operator call may cost (~10 us measured, x5 for load)
COLLECTIVE_HOST_US = 500.0  # ... and one collective call: its Python and its wait() for the peers, outside its
# operator (CI under load: 20 more barriers a step grew one rank's host time 4.69 ms, ~235 us a call, x2)
UNCHANGED_SHARE = 0.03  # a job step time within this share (and MIN_MS) of its baseline has not changed

__all__ = ["compare_rank", "conclude", "rank_figures", "rank_number", "CHANGES", "Unusable"]

def _table(rows: Any, where: str, width: int, m: int) -> dict[str, list[float]]:
    """An operator ([name, calls, self us, total us]) or kernel ([name, calls, us]) table, per step (m steps)."""
    out: dict[str, list[float]] = {}
    for i, row in enumerate(_list(rows, where, MAX_ROWS)):
        if not isinstance(row, list) or len(row) != width:
            raise Unusable(f"{where}[{i}] is {_shown(row)}, not [name{', a number' * (width - 1)}]")
        name = _word(row[0], f"{where}[{i}][0]", MAX_NAME, optional=False)
        values = [_ms(x, f"{where}[{i}][{j + 1}]", MAX_CALLS if j == 0 else MAX_MS * 1000)
                  for j, x in enumerate(row[1:])]
        if m:
            out[name] = [x / m for x in values]
    return out


def rank_figures(r: dict[str, Any]) -> dict[str, Any]:
    """What a comparison needs of one rank's report, per step: step time, split, communication by library and
    by collective kind, operators and kernels (name -> [calls, self us, total us] / [calls, us]). Every value is
    checked before use (a summary.json holds what its rank wrote): Unusable names the first that is not what a
    report of ours writes, and the rank is then not compared."""
    if not isinstance(r, dict):
        raise Unusable(f"the rank's report is {_shown(r)}, not an object")
    steps = _list(r.get("steps"), "steps", MAX_TABLE_STEPS)
    if set(map(type, steps)) - {dict}:
        steps = [_entry(s, f"steps[{i}]") for i, s in enumerate(steps)]  # (raises, naming the first)
    n = len(steps)
    per = _entry(r.get("step_ops") or {}, "step_ops")
    m = per.get("steps") or 0  # the operator tables' steps (those of the split, unless a format lacks one)
    if type(m) is not int or not 0 <= m <= MAX_TABLE_STEPS:
        raise Unusable(f"step_ops.steps is {_shown(m)}, not a number of steps")
    split = {key: (column_sum(steps, field) / n if n else None) for key, field in SPLIT}
    step_ms = column_sum(steps, "dur_ms") / n if n else \
        (None if r.get("step_ms_mean") is None else _ms(r["step_ms_mean"], "step_ms_mean"))
    libraries: dict[str, float] = {}
    for i, lib in enumerate(_list(r.get("comm_libraries"), "comm_libraries", MAX_KINDS)):
        lib = _entry(lib, f"comm_libraries[{i}]")
        name = _word(lib.get("library"), f"comm_libraries[{i}].library", optional=False)
        ms = _ms(lib.get("ms"), f"comm_libraries[{i}].ms")
        if n:
            libraries[name] = ms / n
    collectives: dict[str, tuple[float, float]] = {}
    for i, c in enumerate(_list(r.get("collectives"), "collectives", MAX_KINDS)):
        c = _entry(c, f"collectives[{i}]")
        collectives[_word(c.get("kind"), f"collectives[{i}].kind", optional=False)] = (
            _ms(c.get("count_per_step"), f"collectives[{i}].count_per_step", MAX_CALLS),
            _ms(c.get("ms_per_step"), f"collectives[{i}].ms_per_step"))
    complete = per.get("complete") or {"ops": True, "kernels": True}
    if not isinstance(complete, dict) or any(type(complete.get(k, True)) is not bool for k in ("ops", "kernels")):
        raise Unusable(f"step_ops.complete is {_shown(complete)}, not {{ops, kernels: true or false}}")
    options = r.get("options")
    world = r.get("world_size")
    if world is not None and not (type(world) is int and 1 <= world <= MAX_RANK):
        raise Unusable(f"world_size is {_shown(world)}, not a number of ranks")
    return {
        "rank": rank_number(r.get("rank")), "world_size": world, "steps": n, "step_ms": step_ms, "split": split,
        "basis": _word(r.get("basis"), "basis"),
        "level": _word(options.get("level"), "options.level") if isinstance(options, dict) else None,
        "libraries": libraries, "collectives": collectives,
        "ops": _table(per.get("ops"), "step_ops.ops", 4, m),
        "kernels": _table(per.get("kernels"), "step_ops.kernels", 3, m),
        "complete": {"ops": complete.get("ops", True), "kernels": complete.get("kernels", True)},
        "capture_id": r.get("capture_id") if isinstance(r.get("capture_id"), str) else None,
        "job_id": r.get("job_id") if isinstance(r.get("job_id"), str) else None,
    }


def _pair(a: float | None, b: float | None, digits: int = 3) -> dict[str, float | None]:
    return {"baseline": None if a is None else round(a, digits), "now": None if b is None else round(b, digits)}


def compare_rank(base: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """One rank: its step time and split, baseline -> now; communication by library and kind; the operators and
    kernels whose per-step time changed most (sorted by growth); its own and its wait growth (ms per step).
    `base`, `now`: a rank's report (RankResult or summary.json)."""
    b, n = (_figures(r, side) for r, side in ((base, "baseline"), (now, "capture")))
    split = {key: _pair(b["split"][key], n["split"][key]) for key, _ in SPLIT}
    d = {key: (n["split"][key] or 0.0) - (b["split"][key] or 0.0) for key, _ in SPLIT}
    own = max(0.0, d["compute"]) + max(0.0, d["overlap"]) + max(0.0, d["idle"])
    libraries = [{"library": lib, **_pair(b["libraries"].get(lib, 0.0), n["libraries"].get(lib, 0.0))}
                 for lib in sorted(set(b["libraries"]) | set(n["libraries"]))]
    kinds = []
    for kind in sorted(set(b["collectives"]) | set(n["collectives"])):
        (bc, bm), (nc, nm) = b["collectives"].get(kind, (0.0, 0.0)), n["collectives"].get(kind, (0.0, 0.0))
        kinds.append({"kind": kind, "baseline_ms": round(bm, 3), "now_ms": round(nm, 3),
                      "calls_baseline": round(bc, 3), "calls_now": round(nc, 3)})
    kinds.sort(key=lambda k: -(k["now_ms"] - k["baseline_ms"]))
    changes, matched = _changes(b, n)
    added = sum(max(0.0, k["calls_now"] - k["calls_baseline"]) for k in kinds)
    # on the CPU, a collective's wait for its peers runs outside its operator: host time growth that the added
    # collective calls explain (all of it, as _dispatch_explains judges operator calls) is communication
    idle = max(0.0, d["idle"])
    in_calls = idle if n["basis"] != "device" and idle <= added * COLLECTIVE_HOST_US / 1000 else 0.0
    return {"rank": n["rank"] if n["rank"] is not None else b["rank"],
            "step_ms": _pair(b["step_ms"], n["step_ms"]), "split": split,
            "communication": {"libraries": libraries, "collectives": kinds},
            "changes": changes, "own_growth_ms": round(own, 3), "wait_growth_ms": round(d["communication"], 3),
            "collective_host_ms": round(in_calls, 3),
            "matched_share": round(matched, 3),
            "world_size": {"baseline": b["world_size"], "now": n["world_size"]},
            "level": {"baseline": b["level"], "now": n["level"]}, "basis": {"baseline": b["basis"], "now": n["basis"]},
            "steps": {"baseline": b["steps"], "now": n["steps"]}}


def _figures(r: dict[str, Any], side: str) -> dict[str, Any]:
    try:
        return rank_figures(r)
    except Unusable as exc:
        raise Unusable(f"the {side}'s {exc}") from None


def _changes(b: dict[str, Any], n: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """The CHANGES names whose per-step time moved most, sorted by growth; and the share of time spent in names
    that both sides have (the mean of each side's share: 1.0 for the same operators, however much slower they
    run; near 0 for two different models)."""
    rows = []
    shared = {"b": 0.0, "n": 0.0}
    total = {"b": 0.0, "n": 0.0}
    for table, category, time_at in (("ops", "operator", 1), ("kernels", "kernel", 1)):
        bt, nt = b[table], n[table]
        b_full, n_full = b["complete"].get(table, True), n["complete"].get(table, True)
        b_floor = min((v[time_at] for v in bt.values()), default=0.0)  # what a name left out had at most
        n_floor = min((v[time_at] for v in nt.values()), default=0.0)
        for name in set(bt) | set(nt):
            bv, nv = bt.get(name), nt.get(name)
            b_ms = bv[time_at] / 1000 if bv else (0.0 if b_full else None)
            n_ms = nv[time_at] / 1000 if nv else (0.0 if n_full else None)
            total["b"] += b_ms or 0.0
            total["n"] += n_ms or 0.0
            if bv is not None and nv is not None:
                shared["b"] += b_ms or 0.0
                shared["n"] += n_ms or 0.0
            status = "new" if bv is None and b_full else "vanished" if nv is None and n_full else "changed"
            grown = (n_ms if n_ms is not None else n_floor / 1000) - (b_ms if b_ms is not None else b_floor / 1000)
            rows.append((grown, {
                "name": name, "category": "communication" if _is_comm(name) else category, "status": status,
                "baseline_ms": None if b_ms is None else round(b_ms, 4), "now_ms": None if n_ms is None else round(n_ms, 4),
                "calls_baseline": round(bv[0], 3) if bv else (0 if b_full else None),
                "calls_now": round(nv[0], 3) if nv else (0 if n_full else None),
                "mean_us_baseline": round(bv[-1] / bv[0], 2) if bv and bv[0] else None,
                "mean_us_now": round(nv[-1] / nv[0], 2) if nv and nv[0] else None}))
    rows.sort(key=lambda r: -abs(r[0]))
    top = [r for r in rows[:CHANGES] if abs(r[0]) >= 1e-4]
    top.sort(key=lambda r: -r[0])
    sides = [shared[k] / total[k] for k in ("b", "n") if total[k] > 0]
    return [r[1] for r in top], (sum(sides) / len(sides) if sides else 1.0)


def _is_comm(name: str) -> bool:
    from .classify import is_comm

    return is_comm(name)


# ----------------------------------------------------------------------------------------------------------


def conclude(ranks: list[dict[str, Any]], baseline: Any, capture: Any, *, unmatched: dict[str, list[int]] | None = None,
             jobs: tuple[Any, Any] = (None, None)) -> dict[str, Any]:
    """The comparison: the job's mean step time baseline -> now, the ranks (compare_rank's, in rank order), the
    cause line (module docstring), the culprits and the ranks that waited, and what does not compare (notes).
    `unmatched`: ranks found on one side only ({"baseline": [...], "now": [...]})."""
    ranks = sorted(ranks, key=lambda r: (r["rank"] is None, r["rank"] or 0))
    notes = _notes(ranks, unmatched or {}, jobs)
    base_steps = [r["step_ms"]["baseline"] for r in ranks if r["step_ms"]["baseline"] is not None]
    now_steps = [r["step_ms"]["now"] for r in ranks if r["step_ms"]["now"] is not None]
    b = statistics.fmean(base_steps) if base_steps else None
    n = statistics.fmean(now_steps) if now_steps else None
    step = {"baseline": None if b is None else round(b, 3), "now": None if n is None else round(n, 3)}
    if b is not None and n is not None:
        step["delta"] = round(n - b, 3)
        step["pct"] = round(100 * (n - b) / b, 1) if b > 0 else None
    verdict = _cause(ranks, round(b, 3), round(n, 3)) if ranks and b is not None and n is not None else \
        {"cause": "nothing to compare: no rank has timed steps on both sides", "culprits": [], "waiting": [],
         "category": None}
    return {"baseline": baseline, "capture": capture, "job": {"baseline": jobs[0], "now": jobs[1]},
            "step_ms": step, "ranks": ranks, **verdict, "notes": notes,
            "communication": _job_kinds(ranks), "rule": RULE}


RULE = ("cause: the ranks whose own work (compute, overlap, idle) grew most, by at least half the largest; a rank "
        "whose communication grew by about as much (within 2x) only waited for them; no rank's work grew, or "
        "communication grew more than every rank's work: communication itself (on the CPU, idle time that the "
        "collective calls added explain is communication)")


def _threshold(base_step: float, job_delta: float) -> float:
    return max(MIN_MS, BASE_SHARE * base_step, JOB_SHARE * abs(job_delta))


def _cause(ranks: list[dict[str, Any]], base: float, now: float) -> dict[str, Any]:
    delta = now - base
    if abs(delta) < max(MIN_MS, UNCHANGED_SHARE * base):
        return {"cause": f"no change: step time {base:.2f} -> {now:.2f} ms ({_signed(delta)} ms, within noise)",
                "culprits": [], "waiting": [], "category": None}
    if delta < 0:
        return {"cause": f"faster: step time {base:.2f} -> {now:.2f} ms ({_signed(delta)} ms); "
                         + _biggest_change(ranks, shrink=True), "culprits": [], "waiting": [], "category": None}
    t = _threshold(base, delta)
    grew = {r["rank"]: _own(r) for r in ranks}
    largest = max(grew.values(), default=0.0)
    culprits = [r for r in ranks if _own(r) >= max(t, 0.5 * largest)]
    named = {id(r) for r in culprits}  # (by identity: comparing the rows themselves is a deep comparison)
    others_wait = max((_wait(r) for r in ranks if id(r) not in named), default=0.0)
    if culprits and len(culprits) < len(ranks) and largest * WAIT_FACTOR < others_wait:
        culprits = []  # the others' communication grew far more than this work explains: communication is the cause
    if culprits and len(culprits) == len(ranks) and \
            statistics.fmean(_wait(r) for r in ranks) > statistics.fmean(grew.values()):
        culprits = []  # every rank's work grew, and its communication (no rank waited for another) grew more
    if culprits and len(culprits) < len(ranks):
        waiting = [r for r in ranks if id(r) not in named and _wait(r) >= t]
        about = [r for r in waiting if _wait(r) <= WAIT_FACTOR * largest + t]
        beyond = [r for r in waiting if _wait(r) > WAIT_FACTOR * largest + t]
        text = "; ".join(_own_text(r) for r in culprits[:4]) + (f" (+{len(culprits) - 4} more ranks)"
                                                               if len(culprits) > 4 else "")
        if about:
            text += f"; {_ranks(about)} only waited for {'it' if len(culprits) == 1 else 'them'} (communication " \
                    f"{_range(r['wait_growth_ms'] for r in about)} ms/step)"
        if beyond:
            text += f"; {_ranks(beyond)}: communication grew more than that explains " \
                    f"({_range(r['wait_growth_ms'] for r in beyond)} ms/step): " + _kind_text(beyond)
        category = _category(culprits[0])
        return {"cause": f"{_ranks(culprits)}: {category} grew: {text}", "category": category,
                "culprits": [r["rank"] for r in culprits], "waiting": [r["rank"] for r in about]}
    if culprits:  # every rank's own work grew
        category = _category(max(culprits, key=lambda r: r["own_growth_ms"]))
        own = _range(r["own_growth_ms"] for r in culprits)
        change = _top_change(culprits, comm=False, category=category)
        who = "every rank" if len(ranks) > 1 else _ranks(ranks)
        return {"cause": f"{who}: {category} grew ({own} ms/step)" + (f": {change}" if change else ""),
                "category": category, "culprits": [r["rank"] for r in culprits], "waiting": []}
    comm = [r for r in ranks if _wait(r) >= t]
    if comm:
        who = "every rank" if len(comm) == len(ranks) > 1 else _ranks(comm)
        worked = [r for r in ranks if r["own_growth_ms"] >= t]
        listed = ", ".join(f"rank {r['rank']} {_signed(r['own_growth_ms'])}" for r in worked[:4])
        own = f"; own work grew less ({listed} ms/step)" if worked else ", no rank's own work did"
        return {"cause": f"{who}: communication grew ({_range(r['wait_growth_ms'] for r in comm)} ms/step){own}: "
                         + _kind_text(comm), "category": "communication",
                "culprits": [r["rank"] for r in comm], "waiting": []}
    return {"cause": f"step time {base:.2f} -> {now:.2f} ms ({_signed(delta)} ms) with no part of the split growing "
                     f"by more than {t:.2f} ms/step on any rank: " + _biggest_change(ranks),
            "culprits": [], "waiting": [], "category": None}


def _own(r: dict[str, Any]) -> float:
    """A rank's own growth as the rule weighs it: less the host time its added collective calls explain (on the
    CPU a collective's wait for its peers runs outside its operator: compare_rank's collective_host_ms), which is
    communication (a rank's row from an older daemon has none)."""
    return r["own_growth_ms"] - r.get("collective_host_ms", 0.0)


def _wait(r: dict[str, Any]) -> float:
    return r["wait_growth_ms"] + r.get("collective_host_ms", 0.0)


def _category(r: dict[str, Any]) -> str:
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


def _own_text(r: dict[str, Any]) -> str:
    s = r["split"]
    parts = []
    for key, label in (("compute", "compute"), ("overlap", "overlap"), ("idle", "idle")):
        d = (s[key]["now"] or 0.0) - (s[key]["baseline"] or 0.0)
        if d >= MIN_MS:
            parts.append(f"{label} {_signed(d)} ms/step")
    category = _category(r)  # on the CPU, host time is outside every operator: no operator to name for it
    change = _top_change([r], comm=False, category=category) if category == "compute" or \
        r["basis"].get("now") == "device" else ""
    return f"rank {r['rank']} " + ", ".join(parts or [f"own work {_signed(r['own_growth_ms'])} ms/step"]) + \
        (f" ({change})" if change else "")


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


def change_text(c: dict[str, Any]) -> str:
    from .classify import short_name

    grown = (c["now_ms"] or 0.0) - (c["baseline_ms"] or 0.0)
    calls = ""
    if c.get("calls_baseline") is not None and c.get("calls_now") is not None and \
            round(c["calls_baseline"], 1) != round(c["calls_now"], 1):
        calls = f", {_calls(c['calls_baseline'])} -> {_calls(c['calls_now'])} calls/step"
    elif c.get("mean_us_baseline") and c.get("mean_us_now"):
        calls = f", {c['mean_us_baseline']:.0f} -> {c['mean_us_now']:.0f} us a call"
    flag = " (new)" if c["status"] == "new" else " (vanished)" if c["status"] == "vanished" else ""
    return f"{one_line(short_name(c['name'], 48))}{flag} {_signed(grown)} ms/step{calls}"


def _kind_text(ranks: list[dict[str, Any]]) -> str:
    """The collective kind whose time grew most over `ranks` (mean), with its calls per step."""
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
    kind, (d, cb, cn, m) = max(grown.items(), key=lambda kv: kv[1][0])
    calls = f", {_calls(cb / m)} -> {_calls(cn / m)} calls/step" if round(cb / m, 1) != round(cn / m, 1) else ""
    new = " (new)" if cb == 0 else ""
    return f"{kind}{new} {_signed(d / m)} ms/step{calls}"


def _biggest_change(ranks: list[dict[str, Any]], shrink: bool = False) -> str:
    rows = [c for r in ranks for c in r["changes"]]
    if not rows:
        return "no operator or kernel changed"
    pick = min if shrink else max
    c = pick(rows, key=lambda c: (c["now_ms"] or 0.0) - (c["baseline_ms"] or 0.0))
    return ("largest decrease: " if shrink else "largest change: ") + change_text(c)


def _job_kinds(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per collective kind, the mean over ranks per step, baseline and now."""
    acc: dict[str, list[float]] = {}
    for r in ranks:
        for k in r["communication"]["collectives"]:
            a = acc.setdefault(k["kind"], [0.0, 0.0, 0.0, 0.0])
            a[0] += k["baseline_ms"]
            a[1] += k["now_ms"]
            a[2] += k["calls_baseline"]
            a[3] += k["calls_now"]
    m = max(1, len(ranks))
    out = [{"kind": kind, "baseline_ms": round(a[0] / m, 3), "now_ms": round(a[1] / m, 3),
            "calls_baseline": round(a[2] / m, 3), "calls_now": round(a[3] / m, 3)} for kind, a in acc.items()]
    return sorted(out, key=lambda k: -(k["now_ms"] - k["baseline_ms"]))


def _notes(ranks: list[dict[str, Any]], unmatched: dict[str, list[int]], jobs: tuple[Any, Any]) -> list[str]:
    """One line for each thing that makes the two captures not compare like for like."""
    notes = []
    sizes = {(r["world_size"]["baseline"], r["world_size"]["now"]) for r in ranks}
    for b, n in sorted(sizes, key=str):
        if b is not None and n is not None and b != n:
            notes.append(f"different world sizes: {b} ranks in the baseline, {n} now; ranks are matched by number")
    for side, label in (("baseline", "only in the baseline"), ("now", "only in the capture")):
        if unmatched.get(side):
            notes.append(f"{_ranks_list(unmatched[side])} {label}: not compared")
    levels = {(r["level"]["baseline"], r["level"]["now"]) for r in ranks}
    for b, n in sorted(levels, key=str):
        if b and n and b != n:
            notes.append(f"different levels ({b} in the baseline, {n} now): operator and kernel counts differ by "
                         "what each level records, not only by what ran")
    bases = {(r["basis"]["baseline"], r["basis"]["now"]) for r in ranks}
    for b, n in sorted(bases, key=str):
        if b and n and b != n:
            notes.append(f"the split is measured differently ({b} in the baseline, {n} now): shares do not compare")
    matched = [r["matched_share"] for r in ranks]
    if matched and statistics.median(matched) < SAME_MODEL:
        notes.append(f"different models? only {100 * statistics.median(matched):.0f}% of the operator and kernel time "
                     "matches by name between the two captures")
    if jobs[0] and jobs[1] and jobs[0] != jobs[1]:
        notes.append(f"two jobs: baseline of job {jobs[0]}, capture of job {jobs[1]}")
    return notes


def _signed(x: float) -> str:
    return f"{x:+.2f}" if abs(x) < 10 else f"{x:+.1f}"


def _calls(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 0.05 else f"{x:.1f}"


def _range(values: Iterable[float]) -> str:
    vals = sorted(values)
    if not vals:
        return "-"
    lo, hi = vals[0], vals[-1]
    return _signed(lo) if abs(hi - lo) < 0.05 * max(abs(hi), 1e-9) or len(vals) == 1 else \
        f"{_signed(lo)} to {_signed(hi)}"


def _ranks(rows: list[dict[str, Any]]) -> str:
    return _ranks_list([r["rank"] for r in rows])


def _ranks_list(numbers: list[Any]) -> str:
    nums = sorted(x for x in numbers if x is not None)
    if not nums:
        return "no rank"
    if len(nums) == 1:
        return f"rank {nums[0]}"
    spans, start, prev = [], nums[0], nums[0]
    for x in nums[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return "ranks " + ",".join(spans)
