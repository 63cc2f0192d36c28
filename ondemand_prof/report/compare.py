"""What changed between a healthy baseline capture and a capture now, whether it is more than noise, and which
rank caused it.

    compare_rank(base, now) -> one rank's figures, baseline against now: per step means, each with its per-step
                               values tested (stats.py), the operators and kernels that changed most, its hiccups,
                               the per-call speed of its operators, its thread's CPU, and its collectives' timeline
    conclude(ranks, ...)    -> the job's: the step time and its test, who made whom wait on each side (waits.py),
                               each rank's share of the growth (replay.py), the cause line (cause.py), notes

Both take what a rank's report holds (report.analyze's result, or the summary.json a rank writes with the same
fields), so a comparison reads the same on one host and across hosts: each daemon compares its ranks' summaries
(host/commands/report.py `compare`), the CLI concludes over all of them; no trace crosses the network. Pure: no
I/O, nothing heavy imported (the daemon uses it for an automatic capture's comparison).

Figures are per recorded step, so captures of different lengths compare; a figure's per-step values are what its
test uses. Ranks are matched by rank number; operators and kernels by name (an operator's time is its self time,
what adds up; a kernel's its time inside the steps)."""

from __future__ import annotations

import statistics
from typing import Any, cast

from .cause import DISPATCH_US, RULE, change_text, decide
from .checks import Unusable, rank_number
from .classify import is_comm
from .figures import SPLIT, rank_figures
from .model import Comparison, Pair, RankComparison, Test
from .stats import Change, change, hiccups
from .timeline import decode

CHANGES = 10  # operators and kernels listed per rank
MIN_MS = 0.5  # a change smaller than this per step is not worth naming, whatever its significance
BASE_SHARE = 0.03  # ... nor, for a step's time and a rank's own work, one below this share of the baseline step
ROW_MIN_MS = 0.05  # ... nor, for one operator or kernel, one below this
SAME_MODEL = 0.3  # operator time matching by name (and calls: MODEL_CALLS) below this share: two models, said so
MODEL_CALLS = 0.25  # ... calls a step within this share of each other
COLLECTIVE_HOST_US = 500.0  # ... and one collective call: its Python and its wait() for the peers, outside its
# operator (CI under load: 20 more barriers a step grew one rank's host time 4.69 ms, ~235 us a call, x2)
SAME_CALLS = 0.02  # an operator's calls per step within this share: the same calls
PER_CALL_MIN_SHARE = 0.5  # the operators of unchanged calls hold at least this share of the operator time ...

__all__ = ["compare_rank", "conclude", "rank_figures", "rank_number", "CHANGES", "Unusable", "SPLIT", "change_text"]


def _pair(a: float | None, b: float | None, digits: int = 3) -> Pair:
    return {"baseline": None if a is None else round(a, digits), "now": None if b is None else round(b, digits)}


def compare_rank(base: dict[str, Any], now: dict[str, Any]) -> RankComparison:
    """One rank (module docstring). `base`, `now`: a rank's report (RankResult or summary.json)."""
    b, n = (_figures(r, side) for r, side in ((base, "baseline"), (now, "capture")))
    split = {key: _pair(b["split"][key], n["split"][key]) for key, _ in SPLIT}
    d = {key: (n["split"][key] or 0.0) - (b["split"][key] or 0.0) for key, _ in SPLIT}
    own = max(0.0, d["compute"]) + max(0.0, d["overlap"]) + max(0.0, d["idle"])
    changes, matched = _changes(b, n, kernels=not _other_device(b["device"], n["device"]))
    kinds = _kinds(b, n)
    added = sum(max(0.0, k["calls_now"] - k["calls_baseline"]) for k in kinds)
    # on the CPU, a collective's wait for its peers runs outside its operator: host time growth that the added
    # collective calls explain (all of it, as cause.py judges operator calls) is communication
    idle = max(0.0, d["idle"])
    in_calls = idle if n["basis"] != "device" and idle <= added * COLLECTIVE_HOST_US / 1000 else 0.0
    floor = max(MIN_MS, BASE_SHARE * (b["step_ms"] or 0.0))
    tests = {"step": change(b["series"]["step"], n["series"]["step"], floor),
             "own": change(_own(b), _own(n), floor)}
    for key, _ in SPLIT:
        tests[key] = change(b["series"][key], n["series"][key], MIN_MS)
    for key, column in (("cpu", "cpu_ms"), ("cpu_wait", "wait_ms"), ("proc_cpu", "proc_cpu_ms"),
                        ("proc_wait", "proc_wait_ms")):
        if b["cpu"] and n["cpu"] and column in b["cpu"] and column in n["cpu"]:
            tests[key] = change(b["cpu"][column], n["cpu"][column], MIN_MS)
    return {"rank": n["rank"] if n["rank"] is not None else b["rank"],
            "host": {"baseline": b["host"], "now": n["host"]},
            "step_ms": _pair(b["step_ms"], n["step_ms"]), "split": split,
            "step_ms_by_step": {"baseline": [round(x, 3) for x in b["series"]["step"]],
                                "now": [round(x, 3) for x in n["series"]["step"]]},
            "tests": {k: cast(Test, v.as_dict()) for k, v in tests.items()},
            "hiccups": {"baseline": _hiccups(b), "now": _hiccups(n)},
            "communication": {"libraries": [{"library": lib, **_pair(b["libraries"].get(lib, 0.0),
                                                                      n["libraries"].get(lib, 0.0))}
                                             for lib in sorted(set(b["libraries"]) | set(n["libraries"]))],
                              "collectives": kinds},
            "changes": changes, "per_call": _per_call(b, n),
            "own_growth_ms": round(own, 3), "wait_growth_ms": round(d["communication"], 3),
            "collective_host_ms": round(in_calls, 3),
            "matched_share": round(matched, 3),
            "world_size": {"baseline": b["world_size"], "now": n["world_size"]},
            "level": {"baseline": b["level"], "now": n["level"]}, "basis": {"baseline": b["basis"], "now": n["basis"]},
            "device": {"baseline": b["device"], "now": n["device"]},
            "steps": {"baseline": b["steps"], "now": n["steps"]},
            "timeline": {"baseline": b["timeline"], "now": n["timeline"]}}


def _own(f: dict[str, Any]) -> list[float]:
    """A rank's own work per step: what it did itself (compute, overlap, idle: host work outside operators),
    not its exposed communication (waiting for the others, or the transfer)."""
    s = f["series"]
    return [a + b + c for a, b, c in zip(s["compute"], s["overlap"], s["idle"])]


def _figures(r: dict[str, Any], side: str) -> dict[str, Any]:
    try:
        return rank_figures(r)
    except Unusable as exc:
        raise Unusable(f"the {side}'s {exc}") from None


def _kinds(b: dict[str, Any], n: dict[str, Any]) -> list[dict[str, Any]]:
    """Per collective kind: calls and exposed-or-not time per step, both sides, tested where both have it."""
    kinds = []
    for kind in sorted(set(b["collectives"]) | set(n["collectives"])):
        (bc, bm, bs), (nc, nm, ns) = b["collectives"].get(kind, (0.0, 0.0, None)), \
            n["collectives"].get(kind, (0.0, 0.0, None))
        row = {"kind": kind, "baseline_ms": round(bm, 3), "now_ms": round(nm, 3),
               "calls_baseline": round(bc, 3), "calls_now": round(nc, 3)}
        if kind not in b["collectives"]:
            bs = [0.0] * b["steps"]
        if kind not in n["collectives"]:
            ns = [0.0] * n["steps"]
        if bs is not None and ns is not None:
            row["test"] = change(bs, ns, MIN_MS).as_dict()
        kinds.append(row)
    kinds.sort(key=lambda k: -(k["now_ms"] - k["baseline_ms"]))
    return kinds


def _hiccups(f: dict[str, Any]) -> dict[str, Any] | None:
    """The steps far above the rank's others (stats.hiccups): which, how much more, and in what: waiting for a CPU
    (its threads' run-queue wait in them explains at least half), else the split's part that grew most in them,
    and the operator or kernel."""
    values = f["series"]["step"]
    out = hiccups(values)
    if not out:
        return None
    rest = [i for i in range(len(values)) if i not in out]
    typical = statistics.median(values[i] for i in rest)
    extra = statistics.fmean(values[i] for i in out) - typical

    def grown(series: list[float]) -> float:
        return statistics.fmean(series[i] for i in out) - statistics.median(series[i] for i in rest)

    parts = {key: grown(f["series"][key]) for key, _ in SPLIT}
    part = max(parts, key=lambda k: parts[k])
    what = {"compute": "compute", "communication": "communication", "overlap": "compute",
            "idle": "device idle" if f["basis"] == "device" else "host time outside operators"}[part]
    waited = _cpu_wait_in(f, out, rest)
    if waited is not None and waited >= 0.5 * extra:
        what, part = "waiting for a CPU", "cpu"
    table = f["kernels_series"] if f["basis"] == "device" and part != "idle" else f["ops_series"]
    top = max(table.items(), key=lambda kv: grown(kv[1]) if len(kv[1]) == len(values) else 0.0, default=None) \
        if part in ("compute", "overlap", "communication") else None
    return {"steps": [f["step_numbers"][i] for i in out], "of": len(values), "extra_ms": round(extra, 3),
            "typical_ms": round(typical, 3), "in": what, "name": top[0] if top else None}


def _cpu_wait_in(f: dict[str, Any], out: list[int], rest: list[int]) -> float | None:
    """How much longer the rank's threads waited for a CPU in steps `out` than in the others (ms, the larger of
    the training thread's and all threads' run-queue wait); None without those figures."""
    cpu = f["cpu"]
    if not cpu:
        return None
    at = {s: i for i, s in enumerate(cpu["steps"])}
    numbers = f["step_numbers"]
    best = None
    for key in ("wait_ms", "proc_wait_ms"):
        if key not in cpu:
            continue
        hot = [cpu[key][at[numbers[i]]] for i in out if numbers[i] in at]
        cold = [cpu[key][at[numbers[i]]] for i in rest if numbers[i] in at]
        if hot and cold:
            d = statistics.fmean(hot) - statistics.median(cold)
            best = d if best is None else max(best, d)
    return best


def _per_call(b: dict[str, Any], n: dict[str, Any]) -> dict[str, Any] | None:
    """The operators whose calls per step did not change: their mean time a call, now over baseline (median,
    weighted by the baseline's time), and the share of the operator time they hold. Every operator slower by
    about the same factor with the same calls: the rank ran slower (CPU contention, a lower clock), not more."""
    ratios: list[tuple[float, float]] = []
    total = sum(v[1] for v in b["ops"].values())
    same = 0.0
    for name, bv in b["ops"].items():
        nv = n["ops"].get(name)
        if nv is None or bv[0] <= 0 or bv[1] <= 0 or abs(nv[0] - bv[0]) > SAME_CALLS * bv[0]:
            continue
        ratios.append(((nv[1] / nv[0]) / (bv[1] / bv[0]), bv[1]))
        same += bv[1]
    if not ratios or total <= 0:
        return None
    ratios.sort()
    half, acc, median = same / 2, 0.0, ratios[-1][0]
    for ratio, weight in ratios:
        acc += weight
        if acc >= half:
            median = ratio
            break
    slower = sum(w for r, w in ratios if r >= 1.2) / same
    broad = sum(1 for r, _ in ratios if r >= 1.2) / len(ratios)
    added = sum(max(0.0, n["ops"][k][0] - v[0]) for k, v in b["ops"].items() if k in n["ops"]) + \
        sum(v[0] for k, v in n["ops"].items() if k not in b["ops"])
    return {"ratio": round(median, 3), "share": round(same / total, 3), "ops": len(ratios),
            "slower_share": round(slower, 3), "slower_ops": round(broad, 3), "calls_added": round(added, 1)}


def _changes(b: dict[str, Any], n: dict[str, Any], kernels: bool = True) -> tuple[list[dict[str, Any]], float]:
    """The CHANGES names whose per-step time moved most, sorted by growth, each tested where both sides hold its
    per-step values; and the share of time spent in names both sides have (the mean of each side's share: 1.0
    for the same operators, however much slower they run; near 0 for two different models). `kernels`: False
    where the two sides ran on different devices (a kernel's name is the device's: they do not match by name)."""
    rows = []
    shared = {"b": 0.0, "n": 0.0}
    total = {"b": 0.0, "n": 0.0}
    for table, category in (("ops", "operator"), ("kernels", "kernel"))[:2 if kernels else 1]:
        bt, nt = b[table], n[table]
        bs, ns = b[f"{table}_series"], n[f"{table}_series"]
        b_full, n_full = b["complete"].get(table, True), n["complete"].get(table, True)
        b_floor = min((v[1] for v in bt.values()), default=0.0)  # what a name left out had at most
        n_floor = min((v[1] for v in nt.values()), default=0.0)
        for name in set(bt) | set(nt):
            bv, nv = bt.get(name), nt.get(name)
            b_ms = bv[1] / 1000 if bv else (0.0 if b_full else None)
            n_ms = nv[1] / 1000 if nv else (0.0 if n_full else None)
            total["b"] += b_ms or 0.0
            total["n"] += n_ms or 0.0
            if bv is not None and nv is not None and _same_calls(bv[0], nv[0]):
                shared["b"] += b_ms or 0.0
                shared["n"] += n_ms or 0.0
            status = "new" if bv is None and b_full else "vanished" if nv is None and n_full else "changed"
            grown = (n_ms if n_ms is not None else n_floor / 1000) - (b_ms if b_ms is not None else b_floor / 1000)
            rows.append((grown, name, category, status, bv, nv, b_ms, n_ms, bs, ns, b_full, n_full, b, n))
    rows.sort(key=lambda r: -abs(r[0]))
    top = [r for r in rows[:CHANGES] if abs(r[0]) >= 1e-4]
    top.sort(key=lambda r: -r[0])
    sides = [shared[k] / total[k] for k in ("b", "n") if total[k] > 0]
    return [_change_row(*r[1:]) for r in top], (sum(sides) / len(sides) if sides else 1.0)


def _same_calls(a: float, b: float) -> bool:
    """One model's operator or kernel is called about as often a step on both sides (a generic name such as
    aten::add_ is in any two models, at other counts): what says two captures are of one model."""
    return abs(a - b) <= max(1.0, MODEL_CALLS * max(a, b))


def _change_row(name: str, category: str, status: str, bv: list[float] | None, nv: list[float] | None,
                b_ms: float | None, n_ms: float | None, bs: dict[str, list[float]], ns: dict[str, list[float]],
                b_full: bool, n_full: bool, b: dict[str, Any], n: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": name, "category": "communication" if is_comm(name) else category, "status": status,
        "baseline_ms": None if b_ms is None else round(b_ms, 4), "now_ms": None if n_ms is None else round(n_ms, 4),
        "calls_baseline": round(bv[0], 3) if bv else (0 if b_full else None),
        "calls_now": round(nv[0], 3) if nv else (0 if n_full else None),
        "mean_us_baseline": round(bv[-1] / bv[0], 2) if bv and bv[0] else None,
        "mean_us_now": round(nv[-1] / nv[0], 2) if nv and nv[0] else None}
    before = bs.get(name) if bv else ([0.0] * b["steps"] if b_full else None)
    after = ns.get(name) if nv else ([0.0] * n["steps"] if n_full else None)
    if before is not None and after is not None:
        row["test"] = change([x / 1000 for x in before], [x / 1000 for x in after], ROW_MIN_MS).as_dict()
    return row


# ----------------------------------------------------------------------------------------------------------


def conclude(ranks: list[RankComparison] | list[dict[str, Any]], baseline: Any, capture: Any, *, unmatched: dict[str, list[int]] | None = None,
             jobs: tuple[Any, Any] = (None, None)) -> Comparison:
    """The comparison (module docstring). `ranks`: compare_rank's rows (any order); `unmatched`: ranks found on
    one side only ({"baseline": [...], "now": [...]})."""

    rows = sorted((cast(dict[str, Any], r) for r in ranks), key=lambda r: (r["rank"] is None, r["rank"] or 0))
    return _conclude(rows, baseline, capture, unmatched or {}, jobs)


def _conclude(ranks: list[dict[str, Any]], baseline: Any, capture: Any, unmatched: dict[str, list[int]],
              jobs: tuple[Any, Any]) -> Comparison:
    from .replay import analyze, growth
    from .waits import match, summary

    timelines = {side: _timelines(ranks, side) for side in ("baseline", "now")}
    for r in ranks:
        r.pop("timeline", None)  # (read above; the rows stay small in --json)
    notes = _notes(ranks, unmatched, jobs)
    matched = {side: match(timelines[side]) if timelines[side] else None for side in timelines}
    waits = {side: summary(m) if m else None for side, m in matched.items()}
    replayed = {"now": analyze(matched["now"]) if matched["now"] else None}  # (the baseline's: in growth's)
    shares = growth(matched["now"], matched["baseline"]) if matched["now"] and matched["baseline"] else None
    job = _job_steps(ranks)
    step = {"baseline": job["mean"]["baseline"], "now": job["mean"]["now"]}
    if step["baseline"] is not None and step["now"] is not None:
        step["delta"] = round(step["now"] - step["baseline"], 3)
        step["pct"] = round(100 * step["delta"] / step["baseline"], 1) if step["baseline"] > 0 else None
        step["test"] = job["test"].as_dict()
    verdict = decide(ranks, job, waits, shares, replayed["now"]) if ranks and step.get("delta") is not None else \
        {"cause": "nothing to compare: no rank has timed steps on both sides", "culprits": [], "waiting": [],
         "category": None, "verdict": "none"}
    if _devices(ranks):  # read knowing that: its kernels were not matched by name, so it names no vendor's kernel
        verdict["cause"] += f"; {_devices(ranks)[0]}: kernels not compared by name"
    return cast(Comparison, {"baseline": baseline, "capture": capture, "job": {"baseline": jobs[0], "now": jobs[1]},
                             "step_ms": step, "ranks": ranks, **verdict, "notes": notes + _wait_notes(waits, matched),
                             "communication": _job_kinds(ranks), "collectives": waits, "replay": replayed,
                             "shares": shares, "rule": RULE})


def _timelines(ranks: list[dict[str, Any]], side: str) -> list[tuple[int, str | None, Any]]:
    out = []
    for r in ranks:
        raw = (r.get("timeline") or {}).get(side)
        if raw is not None and r["rank"] is not None:
            out.append((r["rank"], (r.get("host") or {}).get(side), decode(raw)))
    return out


def _job_steps(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's step time per step on each side (the mean over the ranks of each step: in a synchronous job every
    rank's step is about the same), its mean, its test, and its hiccups (steps far above the others)."""
    per: dict[str, list[float]] = {}
    for side, key in (("baseline", "before"), ("now", "after")):
        cols: list[list[float]] = []
        for r in ranks:
            for i, v in enumerate(r["step_ms_by_step"][side]):
                if i == len(cols):
                    cols.append([])
                cols[i].append(v)
        per[side] = [statistics.fmean(c) for c in cols]
    base = statistics.fmean(per["baseline"]) if per["baseline"] else None
    floor = max(MIN_MS, BASE_SHARE * (base or 0.0))
    test = change(per["baseline"], per["now"], floor)
    steady = {side: [v for i, v in enumerate(vals) if i not in hiccups(vals)] for side, vals in per.items()}
    return {"series": per, "mean": {side: round(statistics.fmean(v), 3) if v else None for side, v in per.items()},
            "test": test, "steady": change(steady["baseline"], steady["now"], floor), "floor": floor}


def _wait_notes(waits: dict[str, Any], matched: dict[str, Any]) -> list[str]:
    from .waits import clock_text

    out = []
    for side, label in (("baseline", "the baseline"), ("now", "the capture")):
        w = waits.get(side)
        if w is None:
            continue
        if w["clock"].get("hosts", 1) > 1:
            out.append(f"{label}: {clock_text(w['clock'])}")
        out += [f"{label}: {n}" for n in w["notes"]]
    return out


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
    from .cause import ranks_list

    notes = []
    sizes = {(r["world_size"]["baseline"], r["world_size"]["now"]) for r in ranks}
    for b, n in sorted(sizes, key=str):
        if b is not None and n is not None and b != n:
            notes.append(f"different world sizes: {b} ranks in the baseline, {n} now; ranks are matched by number")
    for side, label in (("baseline", "only in the baseline"), ("now", "only in the capture")):
        if unmatched.get(side):
            notes.append(f"{ranks_list(unmatched[side])} {label}: not compared")
    levels = {(r["level"]["baseline"], r["level"]["now"]) for r in ranks}
    for b, n in sorted(levels, key=str):
        if b and n and b != n:
            notes.append(f"different levels ({b} in the baseline, {n} now): operator and kernel counts differ by "
                         "what each level records, not only by what ran")
    notes += [f"{text}: a kernel's name is the device's (its vendor's libraries pick kernels per architecture), so "
              "kernels are not compared by name (the device time is, in the split); operators are"
              for text in _devices(ranks)]
    bases = {(r["basis"]["baseline"], r["basis"]["now"]) for r in ranks}
    for b, n in sorted(bases, key=str):
        if b and n and b != n:
            notes.append(f"the split is measured differently ({b} in the baseline, {n} now): shares do not compare")
    matched = [r["matched_share"] for r in ranks]
    if matched and statistics.median(matched) < SAME_MODEL:
        notes.append(f"different models? only {100 * statistics.median(matched):.0f}% of the operator and kernel time "
                     "matches by name and calls a step between the two captures")
    if jobs[0] and jobs[1] and jobs[0] != jobs[1]:
        notes.append(f"two jobs: baseline of job {jobs[0]}, capture of job {jobs[1]}")
    one = [r["rank"] for r in ranks if min(r["steps"]["baseline"], r["steps"]["now"]) == 1]
    if one:
        notes.append(f"one step on a side ({_ranks_said(one)}): no noise estimate, so no change is called significant "
                     "or within noise")
    return notes


def _ranks_said(numbers: list[Any]) -> str:
    """Ranks as a note names them; a trace that names no rank (no distributedInfo) is `rank ?`, not `no rank`."""
    from .cause import ranks_list

    known = [x for x in numbers if x is not None]
    unknown = "rank ? (no distributedInfo)" if len(known) < len(numbers) else ""
    return ", ".join(t for t in (ranks_list(known) if known else "", unknown) if t)


def _other_device(b: str | None, n: str | None) -> bool:
    return b is not None and n is not None and b != n


def _devices(ranks: list[dict[str, Any]]) -> list[str]:
    """`different devices (X in the baseline, Y now)` for each pair of devices the ranks ran on (a trace's
    deviceProperties, torch_npu's NPU_INFO), where the two sides differ."""
    pairs = {(r["device"]["baseline"], r["device"]["now"]) for r in ranks if "device" in r}
    return [f"different devices ({b} in the baseline, {n} now)" for b, n in sorted(pairs, key=str)
            if _other_device(b, n)]


__all__ += ["Change", "DISPATCH_US"]
