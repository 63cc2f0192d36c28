"""Reports on captures: per rank (steps, compute/communication split, operators, memory) and across ranks
(step time and communication share per rank, the slowest rank against the median).

    build_report([Path("./profile")]) -> Report   (model.py: a typed dict; what --json prints, text.py and html.py
                                                   render)

The paths are searched below (sources.discover: every capture found, and every candidate skipped with the
reason, is in the report's "sources"), the ranks read, then grouped into captures (grouping.group_ranks: by job and
capture id, or folder, format, world size and steps; never two jobs in one).

Ranks are read in parallel, one process per core (each rank's analysis is streaming and bounded, so N workers
hold N ranks' worth of arrays at most).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from .grouping import group_ranks, slowest_rank
from .model import CaptureGroup, Comparison, FailedRank, RankComparison, RankResult, Report, Slowest
from .sources import Discovery, discover, read_source

log = logging.getLogger("ondemand_prof.report")

__all__ = ["build_report", "build_reports", "compare_groups", "summarize_group", "discover", "CaptureGroup",
           "RankResult", "Report"]


def build_report(paths: Iterable[Path], top: int = 15, workers: int | None = None) -> Report:
    """Everything under `paths`, grouped by capture; `workers` processes read the ranks (default: one per core)."""
    return build_reports([paths], top, workers)[0]


def build_reports(path_sets: list[Iterable[Path]], top: int = 15, workers: int | None = None,
                  summaries: bool = False) -> list[Report]:
    """A report for each set of paths, their ranks read in one pool (a comparison reads its two captures at once:
    two large traces take the time of one on two cores). `summaries`: a capture directory's summary.json stands
    for its trace where it can (a comparison: the figures the daemon compares across hosts)."""
    t0 = time.monotonic()
    found = [discover(Path(p) for p in paths) for paths in path_sets]
    ranks = read_all([src for f in found for src in f.sources], top, workers, summaries)
    reports, at = [], 0
    for f in found:
        mine, at = ranks[at:at + len(f.sources)], at + len(f.sources)
        reports.append(_assemble(f, mine, t0))
    return reports


def _assemble(found: Discovery, ranks: list[RankResult], t0: float) -> Report:
    captures = [summarize_group(key, members, why) for key, why, members in group_ranks(ranks)]
    captures.sort(key=lambda c: (c.get("newest") or "", c.get("title_path") or ""), reverse=True)
    where = {}  # which capture each source landed in, for the listing
    for i, c in enumerate(captures):
        for m in c["ranks"] + c["failed"]:
            where[m["path"]] = i + 1
    for entry in found.listing:
        if entry["status"] == "found":
            entry["capture"] = where.get(entry["path"])
    return {"captures": captures, "problems": found.problems, "sources": found.listing,
            "other_files": dict(found.others.most_common()),
            "ranks_read": sum(len(c["ranks"]) for c in captures), "seconds": round(time.monotonic() - t0, 3)}


def read_all(todo: list[tuple[str, Path]], top: int, workers: int | None = None,
             summaries: bool = False) -> list[RankResult]:
    """read_source for each (kind, path), in a process pool when there is more than one and more than one core
    (not for summaries: reading one is a small file)."""
    n = 1 if summaries and all(kind == "capture" for kind, _ in todo) else min(len(todo), workers or usable_cores())
    if n <= 1:
        return [read_source(kind, src, top, summaries) for kind, src in todo]
    # forkserver: workers start from a clean process, not a fork of a caller that may hold threads and locks
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    try:
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context(method)) as pool:
            return list(pool.map(read_source, *zip(*todo), [top] * len(todo), [summaries] * len(todo)))
    except (OSError, RuntimeError) as exc:  # no semaphores or no processes here: read them one by one
        log.warning("reading %d ranks in this process (no process pool: %s)", len(todo), exc)
        return [read_source(kind, src, top, summaries) for kind, src in todo]


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset), not the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def summarize_group(key: tuple[Any, Any], members: list[RankResult], why: str | None = None) -> CaptureGroup:
    """One capture's figures across ranks: its ranks in rank order, the failed ones, the median step and the
    slowest rank (grouping.slowest_rank: marked only when it stands out); `why` says what grouped them."""
    ok = sorted((m for m in members if not m.get("error")), key=lambda m: (m.get("rank") is None, m.get("rank") or 0))
    failed: list[FailedRank] = [{"rank": m.get("rank"), "path": m["path"], "error": m["error"]}
                                for m in members if m.get("error")]
    group: CaptureGroup = {"job_id": key[0], "capture_id": key[1] if members[0].get("capture_id") else None,
                             "ranks": ok, "failed": failed, "grouped_by": why,
                             "newest": max((m.get("published_at") or "") for m in members) or None,
                             "title_path": min((m.get("path") or "") for m in members)}
    first = ok[0] if ok else members[0]
    group["window"] = first.get("window")
    group["source"] = first.get("source")
    group["options"] = first.get("options")
    timed = [m for m in ok if m.get("step_ms_mean")]
    if timed:
        group["median_step_ms"] = statistics.median(m["step_ms_mean"] for m in timed)
        group["slowest"] = slowest_rank([(m.get("rank"), m["step_ms_mean"]) for m in timed])
    waits = collectives(ok)
    if waits is not None:
        group["collectives"] = waits
        held = held_up(waits)
        if held:  # synchronous ranks' steps are about equal: the slowest is the one the others waited for
            group["slowest"] = held
    return group


def held_up(waits: dict[str, Any]) -> Slowest | None:
    """The rank the others waited for most at the collectives (ms per step), against the other ranks' spread as
    slowest_rank judges step times; with how often it arrived last and its own wait."""
    caused = [(r["rank"], r["caused_ms"]) for r in waits["ranks"]]
    out = slowest_rank(caused)
    if out is None or out["step_ms"] <= 0:
        return None
    mine = next(r for r in waits["ranks"] if r["rank"] == out["rank"])
    out["by"], out["last_share"], out["wait_ms"] = "wait caused", mine["last_share"], mine["wait_ms"]
    if out["stands_out"] and out["step_ms"] < 0.5:
        out["stands_out"], out["why_not"] = False, "the others waited less than 0.5 ms per step for it"
    return out


def collectives(ranks: list[RankResult]) -> dict[str, Any] | None:
    """Who made whom wait in one capture (waits.py) and the what-if replay of its steps (replay.py), from the
    ranks' timelines; None with fewer than two ranks that have one, or no collective matched."""
    from .replay import analyze
    from .timeline import Unreadable, decode
    from .waits import match, summary

    timelines = []
    for m in ranks:
        rank = m.get("rank")
        if m.get("timeline") and isinstance(rank, int):
            try:
                timelines.append((rank, m.get("host"), decode(m["timeline"])))
            except Unreadable:
                continue
    matched = match(timelines) if len(timelines) > 1 else None
    if matched is None:
        return None
    out = summary(matched)
    out["replay"] = analyze(matched)
    return out





def compare_groups(base: CaptureGroup, now: CaptureGroup) -> Comparison:
    """The comparison of two captures (compare.py): their ranks matched by rank number. A rank whose report does
    not hold what a comparison reads (compare.Unusable: its metadata's rank is not a number, a trace's step has a
    negative length) is not compared, said in a note."""
    from .compare import Unusable, compare_rank, conclude, rank_number

    notes: list[str] = []

    def by_rank(group: CaptureGroup, side: str) -> dict[Any, RankResult]:
        out = {}
        for r in group["ranks"]:
            try:
                out[rank_number(r.get("rank"))] = r
            except Unusable as exc:
                notes.append(f"{r.get('path')} ({side}): not compared: {exc}")
        return out

    def compared(rb: RankResult, rn: RankResult, rank: Any) -> list[RankComparison]:
        try:
            return [compare_rank(dict(rb), dict(rn))]
        except Unusable as exc:
            notes.append(f"{'rank ' + str(rank) if rank is not None else rn.get('path')}: not compared: {exc}")
            return []

    b, n = by_rank(base, "baseline"), by_rank(now, "capture")
    names, jobs = (_capture_name(base), _capture_name(now)), (base.get("job_id"), now.get("job_id"))
    if len(b) == len(n) == 1 and set(b) != set(n):  # one rank each, of different numbers: those two, said so
        (kb, rb), (kn, rn) = next(iter(b.items())), next(iter(n.items()))
        result = conclude(compared(rb, rn, kn), *names, jobs=jobs)
        label = {k: f"rank {k}" if k is not None else "rank ? (no distributedInfo)" for k in (kb, kn)}
        result["notes"][:0] = [f"one rank on each side: {label[kb]} of the baseline compared with {label[kn]} now"] + notes
        return result
    ranks = [row for k in n if k in b for row in compared(b[k], n[k], k)]
    unmatched = {"baseline": sorted(k for k in b if k not in n and k is not None),
                 "now": sorted(k for k in n if k not in b and k is not None)}
    result = conclude(ranks, *names, unmatched=unmatched, jobs=jobs)
    result["notes"][:0] = notes
    return result


def _capture_name(group: CaptureGroup) -> str:
    return str(group.get("capture_id") or group.get("title_path") or "?")
