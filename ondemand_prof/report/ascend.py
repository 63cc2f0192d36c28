"""torch_npu's output: {host}_{pid}_{ts}_ascend_pt/ASCEND_PROFILER_OUTPUT/ at level0/1/2, text or db export.

Text export (column names as torch_npu writes them), each used when present:
  * trace_view.json (JSON Array Format): operators, steps and device tasks, analysed like any trace;
  * step_trace_time.csv: torch_npu's own split of each step (it replaces ours: same definitions, more data);
  * op_statistic.csv, else kernel_details.csv: device kernels (level0 leaves kernel_details' Type as "N/A":
    kernels are then named by their Name, HCCL's per-call numbers dropped); communication is the HCCL /
    COMMUNICATION core type or a known collective name;
  * memory_record.csv: one series per component (PTA: torch_npu's caching allocator, GE: the graph engine,
    PTA+GE: their sum, APP: the whole process on the device), kept apart; PTA's is drawn, the others are listed.
Db export (ascend_pytorch_profiler_{rank}.db, tables as torch_npu's TableColumnsManager names them): STEP_TIME,
PYTORCH_API, TASK + COMPUTE_TASK_INFO, COMMUNICATION_OP, CANN_API (launches), MEMORY_RECORD, STRING_IDS,
RANK_DEVICE_MAP; nanoseconds and bytes.
"""

from __future__ import annotations

import csv
import json
import logging
import sqlite3
from array import array
from pathlib import Path
from typing import Any, Iterable, Iterator

from .analyze import RankAnalyzer, StepRow, analyze_trace_file, peak_downsample, step_summary
from .classify import COMM_CORE_TYPES, RANK_IN_NAME, is_comm, kernel_group

log = logging.getLogger("ondemand_prof.report")

ASCEND_DIR = "ASCEND_PROFILER_OUTPUT"
NPU_DB_GLOB = "ascend_pytorch_profiler*.db"
ALLOCATOR = "PTA"  # torch_npu's caching allocator: the memory users manage from PyTorch
_MB = 2 ** 20


def read_ascend(path: Path, top: int) -> dict[str, Any]:
    """One rank's report from a *_ascend_pt directory or its ASCEND_PROFILER_OUTPUT."""
    root = path if path.name == ASCEND_DIR else path / ASCEND_DIR
    out: dict[str, Any] = {"path": str(root.parent), "kind": "ascend", "rank": _rank(root.parent), "warnings": []}
    used: list[str] = []
    dbs = sorted(root.glob(NPU_DB_GLOB))
    if (root / "trace_view.json").exists():
        used.append("trace_view.json")
        analyze_trace_file(root / "trace_view.json", out, top)
    elif dbs:
        used.append(dbs[0].name)
        out.update(npu_db_result(dbs[0], top))
    _step_trace(root, out, used)
    _kernel_tables(root, out, used, top)
    if (root / "memory_record.csv").exists():
        used.append("memory_record.csv")
        out["memory"] = npu_memory(_memory_csv_rows(root / "memory_record.csv"))
    out.setdefault("basis", "device")
    if not used:
        out["error"] = (f"{root} has none of trace_view.json, {NPU_DB_GLOB}, step_trace_time.csv, op_statistic.csv, "
                        "kernel_details.csv, memory_record.csv")
    out["files_used"] = used
    log.debug("%s: read %s", root, ", ".join(used) or "nothing")
    return out


def _rank(top_dir: Path) -> int | None:
    info = top_dir / "profiler_info.json"
    if info.exists():
        try:
            data = json.loads(info.read_text())
            if isinstance(data, dict) and isinstance(data.get("rank_id"), int):
                return data["rank_id"]
        except ValueError:
            pass
    for f in sorted(top_dir.glob("profiler_info_*.json")):
        suffix = f.stem.rsplit("_", 1)[1]
        if suffix.isdigit():
            return int(suffix)
    m = RANK_IN_NAME.search(str(top_dir))
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------------------
# CSVs

def _csv_rows(path: Path) -> Iterator[dict[str, str]]:
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as fh:
        yield from csv.DictReader(fh)


def _num(value: Any) -> float:
    try:
        return float(str(value).strip())  # kernel_details' times end with a tab
    except (TypeError, ValueError):
        return 0.0


def _step_trace(root: Path, out: dict[str, Any], used: list[str]) -> None:
    """step_trace_time.csv's split replaces ours; start times come from the trace's steps or kernel_details."""
    path = root / "step_trace_time.csv"
    if not path.exists():
        return
    used.append("step_trace_time.csv")
    starts = {s["step"]: s["start_us"] for s in out.get("steps") or []}
    if not starts and (root / "kernel_details.csv").exists():
        starts = _kernel_step_starts(root / "kernel_details.csv")
    rows = []
    for i, row in enumerate(_csv_rows(path)):
        step = int(_num(row.get("Step"))) if str(row.get("Step") or "").strip() else i
        compute, exposed = _num(row.get("Computing")), _num(row.get("Communication(Not Overlapped)"))
        overlap, free = _num(row.get("Overlapped")), _num(row.get("Free"))
        total = compute + exposed + free  # torch_npu's step: Computing (overlap included) + exposed comm + Free
        rows.append(StepRow(step, starts.get(step), total, total, compute - overlap, exposed, overlap, free,
                            _num(row.get("Communication"))))
    out["steps"] = [r.as_dict() for r in rows]
    out["basis"] = "device"
    out["split_from"] = "step_trace_time.csv"
    for key in ("step_ms_mean", "step_ms_max", "compute_pct", "comm_pct", "overlap_pct", "idle_pct"):
        out.pop(key, None)
    out.update(step_summary(rows))


def _kernel_step_starts(path: Path) -> dict[int, float]:
    starts: dict[int, float] = {}
    for row in _csv_rows(path):
        step = str(row.get("Step Id") or "").strip()
        if step.isdigit():
            t = _num(row.get("Start Time(us)"))
            starts[int(step)] = min(starts.get(int(step), t), t)
    return starts


def _kernel_tables(root: Path, out: dict[str, Any], used: list[str], top: int) -> None:
    if (root / "op_statistic.csv").exists():
        used.append("op_statistic.csv")
        kernels = _op_statistic(root / "op_statistic.csv")
    elif (root / "kernel_details.csv").exists():
        used.append("kernel_details.csv")
        kernels = _kernel_details(root / "kernel_details.csv")
    else:
        return
    out["top_kernels"] = sorted(kernels, key=lambda r: -r["total_us"])[:top]


def _op_statistic(path: Path) -> list[dict[str, Any]]:
    kernels = []
    for row in _csv_rows(path):
        name = row.get("OP Type") or row.get("Name") or "?"
        calls = int(_num(row.get("Count"))) or 1
        total = _num(row.get("Total Time(us)"))
        core = row.get("Core Type") or ""
        kernels.append({"name": name, "calls": calls, "total_us": total, "avg_us": total / calls,
                        "comm": core in COMM_CORE_TYPES or is_comm(name), "core": core})
    return kernels


def _kernel_details(path: Path) -> list[dict[str, Any]]:
    agg: dict[str, list[Any]] = {}
    for row in _csv_rows(path):
        kind = (row.get("Type") or "").strip()
        name = kind if kind and kind != "N/A" else kernel_group((row.get("Name") or "?").strip())
        core = (row.get("Accelerator Core") or "").strip()
        a = agg.setdefault(name, [0, 0.0, False, core])
        a[0] += 1
        a[1] += _num(row.get("Duration(us)"))
        a[2] = a[2] or core in COMM_CORE_TYPES or is_comm(name)
    return [{"name": n, "calls": c, "total_us": t, "avg_us": t / c, "comm": comm, "core": core}
            for n, (c, t, comm, core) in agg.items()]


def _memory_csv_rows(path: Path) -> Iterator[tuple[str, float, float, float, str]]:
    for row in _csv_rows(path):
        yield ((row.get("Component") or ALLOCATOR).strip(), _num(row.get("Timestamp(us)")),
               _num(row.get("Total Allocated(MB)")) * _MB, _num(row.get("Total Reserved(MB)")) * _MB,
               (row.get("Device Type") or row.get("Device") or "NPU").strip())


def npu_memory(rows: Iterable[tuple[str, float, float, float, str]]) -> dict[str, Any] | None:
    """Memory per (device, component) from (component, ts_us, allocated B, reserved B, device) rows.

    Components are separate series (mixing them made a zig-zag and an inflated peak); the series drawn is the
    allocator's (PTA) on the device where it peaks, or the largest component when PTA is absent."""
    stats: dict[tuple[str, str], dict[str, Any]] = {}
    series: dict[tuple[str, str], tuple[array, array]] = {}
    for component, ts, alloc, reserved, device in rows:
        key = (device, component)
        s = stats.get(key)
        if s is None:
            s = stats[key] = {"device": device, "component": component, "peak_allocated": 0.0, "peak_reserved": 0.0,
                              "samples": 0, "allocs": None, "alloc_bytes": None, "frees": None, "freed_bytes": None}
            series[key] = (array("d"), array("d"))
        s["samples"] += 1
        s["peak_allocated"] = max(s["peak_allocated"], alloc)
        s["peak_reserved"] = max(s["peak_reserved"], reserved)
        series[key][0].append(ts)
        series[key][1].append(alloc)
    if not stats:
        return None
    devices = sorted(stats.values(), key=lambda s: (s["component"] != ALLOCATOR, -s["peak_allocated"]))
    main = (devices[0]["device"], devices[0]["component"])
    ts, alloc = series[main]
    points = sorted(zip(ts, alloc))
    return {"devices": devices, "series_device": f"{main[0]} ({main[1]})", "series": peak_downsample(points)}


# ----------------------------------------------------------------------------------------------------------
# db export

def sqlite_tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def is_npu_db(path: Path) -> bool:
    """torch_npu's db export (as opposed to our profile.db or any other SQLite file)."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = sqlite_tables(con)
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return "STRING_IDS" in tables and bool(tables & {"STEP_TIME", "TASK", "PYTORCH_API", "MEMORY_RECORD"})


def npu_db_result(db: Path, top: int) -> dict[str, Any]:
    """torch_npu's db replayed through the same analysis as a trace (ns -> us)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = sqlite_tables(con)
        strings = dict(con.execute("SELECT id, value FROM STRING_IDS"))
        an = RankAnalyzer()
        _db_steps_and_ops(con, tables, strings, an)
        _db_device(con, tables, strings, an)
        out = an.result(top)
        out["db"] = str(db)
        out["memory"] = _db_memory(con, tables, strings)
        if "RANK_DEVICE_MAP" in tables:
            row = con.execute("SELECT rankId FROM RANK_DEVICE_MAP LIMIT 1").fetchone()
            if row and isinstance(row[0], int) and row[0] >= 0:
                out["rank"] = row[0]
        return out
    finally:
        con.close()


def _db_steps_and_ops(con: sqlite3.Connection, tables: set[str], strings: dict[int, str],
                      an: RankAnalyzer) -> None:
    events: list[dict[str, Any]] = []
    has_steps = "STEP_TIME" in tables and con.execute("SELECT COUNT(*) FROM STEP_TIME").fetchone()[0] > 0
    if has_steps:
        for sid, start, end in con.execute("SELECT id, startNs, endNs FROM STEP_TIME"):
            events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{sid}", "pid": "steps",
                           "tid": "steps", "ts": start / 1000, "dur": (end - start) / 1000})
    an.feed(events)
    if "PYTORCH_API" not in tables:
        return

    def ops() -> Iterator[dict[str, Any]]:
        for start, end, tid, name in con.execute("SELECT startNs, endNs, globalTid, name FROM PYTORCH_API"):
            text = strings.get(name, str(name))
            if has_steps and text.startswith("ProfilerStep#"):
                continue  # STEP_TIME has them
            yield {"ph": "X", "cat": "cpu_op", "name": text, "pid": "host", "tid": tid, "ts": start / 1000,
                   "dur": (end - start) / 1000}
    an.feed(ops())


def _db_device(con: sqlite3.Connection, tables: set[str], strings: dict[int, str], an: RankAnalyzer) -> None:
    if {"TASK", "COMPUTE_TASK_INFO"} <= tables:
        for name, start, end, conn in con.execute(
                "SELECT c.name, t.startNs, t.endNs, t.connectionId FROM COMPUTE_TASK_INFO c "
                "JOIN TASK t ON t.globalTaskId = c.globalTaskId"):
            text = strings.get(name, str(name))
            an.device_event(start / 1000, (end - start) / 1000, text, _int(conn), is_comm(text))
    if "COMMUNICATION_OP" in tables:
        for name, start, end, conn in con.execute("SELECT opName, startNs, endNs, connectionId FROM COMMUNICATION_OP"):
            an.device_event(start / 1000, (end - start) / 1000, strings.get(name, str(name)), _int(conn), True)
    if "CANN_API" in tables:
        for start, conn in con.execute("SELECT startNs, connectionId FROM CANN_API"):
            an.launch_event(start / 1000, _int(conn))


def _db_memory(con: sqlite3.Connection, tables: set[str], strings: dict[int, str]) -> dict[str, Any] | None:
    if "MEMORY_RECORD" not in tables:
        return None
    rows = con.execute("SELECT component, timestamp, totalAllocated, totalReserved, deviceId FROM MEMORY_RECORD")
    return npu_memory((strings.get(c, str(c)), ts / 1000, float(a or 0), float(r or 0), f"NPU:{d}")
                      for c, ts, a, r, d in rows)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
