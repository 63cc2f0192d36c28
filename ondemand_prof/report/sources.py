"""Find what can be reported on under a path, and read each kind:

  * our capture directories ({host}_{pid}_{ts}_pt/ with metadata.json): the trace (.json or .json.gz, plain or
    simplified), or profile.db when the trace is gone (export_type db);
  * torch_npu's output ({host}_{pid}_{ts}_ascend_pt/ASCEND_PROFILER_OUTPUT/): step_trace_time.csv,
    op_statistic.csv, kernel_details.csv, memory_record.csv, whichever are present;
  * a bare Chrome/Kineto trace file (torch.profiler's export_chrome_trace, tensorboard_trace_handler).

Each source becomes one rank report, or a problem saying what could not be read. Nothing here raises for bad
input: a report covers everything that can be read.
"""

from __future__ import annotations

import csv
import json
import logging
import re
import sqlite3
from pathlib import Path
from typing import Any, Iterator

from .analyze import RankAnalyzer, is_comm, peak_downsample
from .tracefile import TraceError, TraceReader

log = logging.getLogger("ondemand_prof.report")

TRACE_GLOBS = ("trace/*.json", "trace/*.json.gz", "*.pt.trace.json", "*.pt.trace.json.gz")
ASCEND_DIR = "ASCEND_PROFILER_OUTPUT"
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def find_sources(path: Path) -> tuple[list[tuple[str, Path]], list[dict[str, str]]]:
    """(kind, path) for everything reportable under `path`, newest first; problems for what is not."""
    if not path.exists():
        return [], [{"path": str(path), "error": "does not exist"}]
    if path.is_file():
        if path.name.endswith((".json", ".json.gz")):
            return [("trace", path)], []
        if path.suffix == ".db":
            return [("db", path)], []
        return [], [{"path": str(path), "error": "not a trace (.json, .json.gz), a profile.db, or a capture directory"}]
    kind = _kind(path)
    if kind:
        return [(kind, path)], []
    found: list[tuple[str, Path]] = []
    for child in _children(path):
        k = _kind(child)
        if k:
            found.append((k, child))
        elif child.is_dir():  # one more level: a rank directory per host, a job directory...
            found.extend((k2, c2) for c2 in _children(child) if (k2 := _kind(c2)))
    loose = sorted(p for pattern in ("*.json", "*.json.gz") for p in path.glob(pattern) if p.name != "metadata.json")
    found.extend(("trace", p) for p in loose)
    if not found:
        return [], [{"path": str(path), "error": "no captures here (expected capture directories with "
                                                 "metadata.json, *_ascend_pt directories or trace files)"}]
    found.sort(key=lambda kp: kp[1].stat().st_mtime, reverse=True)
    return found, []


def _children(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if not p.name.startswith("."))  # hidden: staging dirs
    except OSError:
        return []


def _kind(path: Path) -> str | None:
    if not path.is_dir():
        return None
    if (path / "metadata.json").is_file():
        return "capture"
    if path.name == ASCEND_DIR:
        return "ascend"
    if (path / ASCEND_DIR).is_dir():
        return "ascend"
    return None


# ----------------------------------------------------------------------------------------------------------

def read_source(kind: str, path: Path, top: int) -> dict[str, Any]:
    """One rank's report; "error" is set when nothing could be read, "warnings" when only part could."""
    reader = {"capture": _read_capture, "trace": _read_trace_file, "db": _read_db_file, "ascend": _read_ascend}[kind]
    try:
        return reader(path, top)
    except Exception as exc:  # noqa: BLE001 - one unreadable capture never stops the report
        log.debug("cannot read %s", path, exc_info=True)
        return {"path": str(path), "kind": kind, "rank": None, "error": f"{type(exc).__name__}: {exc}"}


def _base(path: Path, kind: str) -> dict[str, Any]:
    return {"path": str(path), "kind": kind, "rank": None, "warnings": []}


def _analyze_trace(trace: Path, out: dict[str, Any], top: int) -> None:
    reader = TraceReader(trace)
    an = RankAnalyzer()
    try:
        an.feed(reader.events())
    except TraceError as exc:
        if an.events == 0:
            raise
        out["warnings"].append(str(exc))
    out.update(an.result(top))
    out["trace"] = str(trace)
    base = reader.header.get("baseTimeNanoseconds")
    if isinstance(base, (int, float)) and base > 0:  # ts relative to a base: make them wall-clock comparable
        for step in out.get("steps") or []:
            step["start_us"] += base / 1000
    info = reader.header.get("distributedInfo") or {}
    if out.get("rank") is None and isinstance(info.get("rank"), int):
        out["rank"] = info["rank"]


def _read_capture(path: Path, top: int) -> dict[str, Any]:
    out = _base(path, "capture")
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError) as exc:
        out["error"] = f"unreadable metadata.json: {exc}"
        return out
    out.update({"rank": meta.get("rank"), "host": meta.get("host"), "pid": meta.get("pid"),
                "capture_id": meta.get("capture_id"), "status": meta.get("status"), "window": meta.get("window"),
                "options": meta.get("options"), "source": (meta.get("trigger") or {}).get("source"),
                "published_at": meta.get("published_at"), "job_id": meta.get("job_id")})
    if meta.get("status") == "failed":
        out["error"] = meta.get("error") or "the capture failed"
        return out
    trace = path / meta["trace_file"] if meta.get("trace_file") else None
    if trace is None or not trace.exists():
        found = [p for pattern in TRACE_GLOBS for p in sorted(path.glob(pattern))]
        trace = found[0] if found else None
    if trace is not None:
        _analyze_trace(trace, out, top)
    elif (path / "profile.db").exists():
        out.update(_db_result(path / "profile.db", top))
    else:
        out["error"] = "no trace file and no profile.db in this capture"
    return out


def _read_trace_file(path: Path, top: int) -> dict[str, Any]:
    out = _base(path, "trace")
    m = _RANK_IN_NAME.search(path.name)
    if m:
        out["rank"] = int(m.group(1))
    _analyze_trace(path, out, top)
    return out


def _read_db_file(path: Path, top: int) -> dict[str, Any]:
    out = _base(path, "db")
    out.update(_db_result(path, top))
    return out


def _db_result(db: Path, top: int) -> dict[str, Any]:
    """Our SQLite export (postprocess.DB_SCHEMA) replayed as events through the same analysis."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        def events() -> Iterator[dict[str, Any]]:
            for name, cat, pid, tid, ts, dur in con.execute(
                    "SELECT name, category, pid, tid, ts_us, dur_us FROM events"):
                yield {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
            for ts, dtype, did, nbytes, alloc, reserved in con.execute(
                    "SELECT ts_us, device_type, device_id, bytes, total_allocated, total_reserved FROM memory_events"):
                yield {"ph": "i", "name": "[memory]", "ts": ts, "args": {
                    "Device Type": dtype, "Device Id": did, "Bytes": nbytes, "Total Allocated": alloc,
                    "Total Reserved": reserved}}

        an = RankAnalyzer()
        an.feed(events())
        out = an.result(top)
        out["db"] = str(db)
        for key, value in con.execute("SELECT key, value FROM meta"):
            if key == "rank":
                out["rank"] = json.loads(value)
        return out
    finally:
        con.close()


# ----------------------------------------------------------------------------------------------------------
# torch_npu's ASCEND_PROFILER_OUTPUT (column names as torch_npu writes them)

def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as fh:
        return list(csv.DictReader(fh))


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _read_ascend(path: Path, top: int) -> dict[str, Any]:
    root = path if path.name == ASCEND_DIR else path / ASCEND_DIR
    top_dir = root.parent
    out = _base(top_dir, "ascend")
    m = _RANK_IN_NAME.search(str(top_dir))
    meta_file = top_dir / "profiler_info.json"
    if meta_file.exists():
        try:
            info = json.loads(meta_file.read_text())
            out["rank"] = (info.get("rank_id") if isinstance(info, dict) else None)
        except ValueError:
            pass
    if out["rank"] is None:
        ranks = sorted(top_dir.glob("profiler_info_*.json"))
        if ranks:
            out["rank"] = int(ranks[0].stem.rsplit("_", 1)[1]) if ranks[0].stem.rsplit("_", 1)[1].isdigit() else None
        elif m:
            out["rank"] = int(m.group(1))
    used = []
    steps: list[dict[str, Any]] = []
    if (root / "step_trace_time.csv").exists():
        used.append("step_trace_time.csv")
        for row in _csv_rows(root / "step_trace_time.csv"):
            compute = _num(row.get("Computing"))
            comm = _num(row.get("Communication"))
            exposed = _num(row.get("Communication(Not Overlapped)"))
            free = _num(row.get("Free"))
            total = compute + exposed + free
            try:
                number = int(float(row.get("Step") or len(steps)))
            except ValueError:
                number = len(steps)
            steps.append({"step": number, "start_us": None, "dur_ms": total / 1000, "compute_ms": compute / 1000,
                          "comm_ms": comm / 1000, "overlap_ms": _num(row.get("Overlapped")) / 1000,
                          "other_ms": free / 1000})
    out["steps"] = steps
    out["basis"] = "device"
    if steps:
        total = sum(s["dur_ms"] for s in steps)
        out["step_ms_mean"] = total / len(steps)
        out["step_ms_max"] = max(s["dur_ms"] for s in steps)
        if total > 0:
            for key, col in (("compute_pct", "compute_ms"), ("comm_pct", "comm_ms"), ("overlap_pct", "overlap_ms"),
                             ("other_pct", "other_ms")):
                out[key] = 100 * sum(s[col] for s in steps) / total
    kernels: list[dict[str, Any]] = []
    if (root / "op_statistic.csv").exists():
        used.append("op_statistic.csv")
        for row in _csv_rows(root / "op_statistic.csv"):
            name = row.get("OP Type") or row.get("Name") or "?"
            calls = int(_num(row.get("Count"))) or 1
            total = _num(row.get("Total Time(us)"))
            kernels.append({"name": name, "calls": calls, "total_us": total, "avg_us": total / calls,
                            "comm": is_comm(name), "core": row.get("Core Type")})
    elif (root / "kernel_details.csv").exists():
        used.append("kernel_details.csv")
        agg: dict[str, list[float]] = {}
        for row in _csv_rows(root / "kernel_details.csv"):
            name = row.get("Type") or row.get("Name") or "?"
            a = agg.setdefault(name, [0, 0.0])
            a[0] += 1
            a[1] += _num(row.get("Duration(us)"))
        kernels = [{"name": n, "calls": int(c), "total_us": t, "avg_us": t / c, "comm": is_comm(n)}
                   for n, (c, t) in agg.items()]
    out["top_kernels"] = sorted(kernels, key=lambda r: -r["total_us"])[:top]
    out["top_self"], out["top_total"] = [], []
    out["memory"] = None
    if (root / "memory_record.csv").exists():
        used.append("memory_record.csv")
        series, peak_alloc, peak_res = [], 0.0, 0.0
        for row in _csv_rows(root / "memory_record.csv"):
            if row.get("Component") not in (None, "", "PTA", "PTA+GE"):
                continue  # the torch allocator's view; GE/APP rows are other components
            mb = _num(row.get("Total Allocated(MB)"))
            series.append((_num(row.get("Timestamp(us)")), mb * 2**20))
            peak_alloc = max(peak_alloc, mb)
            peak_res = max(peak_res, _num(row.get("Total Reserved(MB)")))
        series.sort()
        out["memory"] = {"devices": [{"device_type": "npu", "device_id": None, "peak_allocated": peak_alloc * 2**20,
                                      "peak_reserved": peak_res * 2**20, "allocs": None, "alloc_bytes": None,
                                      "frees": None, "freed_bytes": None}],
                         "series_device": "npu", "series": peak_downsample(series)}
    if not used:
        out["error"] = f"{root} has none of step_trace_time.csv, op_statistic.csv, kernel_details.csv, memory_record.csv"
    out["files_used"] = used
    return out
