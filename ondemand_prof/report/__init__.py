"""Reports on captures: per rank (steps, compute/communication split, operators, memory) and across ranks
(step time and communication share per rank, the slowest rank against the median).

    build_report([Path("./profile")]) -> dict   (what --json prints; text.py and html.py render it)

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

from .sources import find_sources, read_source

log = logging.getLogger("ondemand_prof.report")

__all__ = ["build_report", "summarize_group"]


def build_report(paths: Iterable[Path], top: int = 15, workers: int | None = None) -> dict[str, Any]:
    """Everything under `paths`, grouped by capture; `workers` processes read the ranks (default: one per core)."""
    t0 = time.monotonic()
    problems: list[dict[str, str]] = []
    todo: list[tuple[str, Path]] = []
    seen: set[Path] = set()
    for path in paths:
        sources, missing = find_sources(Path(path))
        problems.extend(missing)
        for kind, src in sources:
            if src.resolve() not in seen:
                seen.add(src.resolve())
                todo.append((kind, src))
    ranks = read_all(todo, top, workers)
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in ranks:
        key = (r.get("job_id"), r.get("capture_id")) if r.get("capture_id") else (None, r["kind"])
        groups.setdefault(key, []).append(r)
    captures = [summarize_group(key, members) for key, members in groups.items()]
    captures.sort(key=lambda c: c.get("newest") or "", reverse=True)
    return {"captures": captures, "problems": problems, "ranks_read": sum(len(c["ranks"]) for c in captures),
            "seconds": round(time.monotonic() - t0, 3)}


def read_all(todo: list[tuple[str, Path]], top: int, workers: int | None = None) -> list[dict[str, Any]]:
    """read_source for each (kind, path), in a process pool when there is more than one and more than one core."""
    n = min(len(todo), workers or usable_cores())
    if n <= 1:
        return [read_source(kind, src, top) for kind, src in todo]
    # forkserver: workers start from a clean process, not a fork of a caller that may hold threads and locks
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    try:
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context(method)) as pool:
            return list(pool.map(read_source, *zip(*todo), [top] * len(todo)))
    except (OSError, RuntimeError) as exc:  # no semaphores or no processes here: read them one by one
        log.warning("reading %d ranks in this process (no process pool: %s)", len(todo), exc)
        return [read_source(kind, src, top) for kind, src in todo]


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset), not the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def summarize_group(key: tuple[Any, Any], members: list[dict[str, Any]]) -> dict[str, Any]:
    ok = sorted((m for m in members if not m.get("error")), key=lambda m: (m.get("rank") is None, m.get("rank") or 0))
    failed = [{"rank": m.get("rank"), "path": m["path"], "error": m["error"]} for m in members if m.get("error")]
    group: dict[str, Any] = {"job_id": key[0], "capture_id": key[1] if members[0].get("capture_id") else None,
                             "ranks": ok, "failed": failed,
                             "newest": max((m.get("published_at") or "") for m in members) or None}
    first = ok[0] if ok else members[0]
    group["window"] = first.get("window")
    group["source"] = first.get("source")
    group["options"] = first.get("options")
    timed = [m for m in ok if m.get("step_ms_mean")]
    if timed:
        median = statistics.median(m["step_ms_mean"] for m in timed)
        slowest = max(timed, key=lambda m: m["step_ms_mean"])
        group["median_step_ms"] = median
        group["slowest"] = {"rank": slowest.get("rank"), "step_ms": slowest["step_ms_mean"],
                            "vs_median_ms": slowest["step_ms_mean"] - median,
                            "vs_median_pct": 100 * (slowest["step_ms_mean"] - median) / median if median else 0.0}
    return group
