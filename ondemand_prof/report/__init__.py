"""Reports on captures: per rank (steps, compute/communication split, operators, memory) and across ranks
(step time and communication share per rank, the slowest rank against the median).

    build_report([Path("./profile")]) -> dict   (what --json prints; text.py and html.py render it)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Iterable

from .sources import find_sources, read_source

__all__ = ["build_report", "summarize_group"]


def build_report(paths: Iterable[Path], top: int = 15) -> dict[str, Any]:
    t0 = time.monotonic()
    problems: list[dict[str, str]] = []
    ranks: list[dict[str, Any]] = []
    seen: set[Path] = set()
    for path in paths:
        sources, missing = find_sources(Path(path))
        problems.extend(missing)
        for kind, src in sources:
            if src.resolve() in seen:
                continue
            seen.add(src.resolve())
            ranks.append(read_source(kind, src, top))
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in ranks:
        key = (r.get("job_id"), r.get("capture_id")) if r.get("capture_id") else (None, r["kind"])
        groups.setdefault(key, []).append(r)
    captures = [summarize_group(key, members) for key, members in groups.items()]
    captures.sort(key=lambda c: c.get("newest") or "", reverse=True)
    return {"captures": captures, "problems": problems, "ranks_read": sum(len(c["ranks"]) for c in captures),
            "seconds": round(time.monotonic() - t0, 3)}


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
