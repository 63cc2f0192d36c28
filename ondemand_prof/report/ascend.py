"""torch_npu's output: {host}_{pid}_{ts}_ascend_pt/ASCEND_PROFILER_OUTPUT/ at level0/1/2, text or db export.

Text export (column names as torch_npu writes them), each used when present:
  * trace_view.json (JSON Array Format): operators, steps and device tasks, analysed like any trace;
  * step_trace_time.csv: torch_npu's own split of each step (it replaces ours: same definitions, more data);
  * op_statistic.csv, else kernel_details.csv: device kernels (level0 leaves kernel_details' Type as "N/A":
    kernels are then named by their Name, HCCL's per-call numbers dropped); communication is the HCCL /
    COMMUNICATION core type or a known collective name;
  * memory_record.csv: one series per component (PTA: torch_npu's caching allocator, GE: the graph engine,
    PTA+GE: their sum, APP: the whole process on the device), kept apart; PTA's is drawn, the others are listed.
    An empty column (APP has no Total Allocated) is "not recorded", never 0.
Db export (ascend_pytorch_profiler_{rank}.db, tables as torch_npu's TableColumnsManager names them): STEP_TIME,
PYTORCH_API (its operators: the `op` rows of ENUM_API_TYPE; Enqueue/Dequeue and Python frames are left out),
TASK + COMPUTE_TASK_INFO, COMMUNICATION_OP, CANN_API (launches), MEMORY_RECORD, STRING_IDS, RANK_DEVICE_MAP;
nanoseconds (torch_npu writes PYTORCH_API's as text, to keep 64 bits) and bytes. analysis.db beside it holds
StepTraceTime, the db twin of step_trace_time.csv. CANN's own msprof_*.db (TASK + COMPUTE_TASK_INFO, no steps)
reads the same way.

A file that cannot be read becomes one warning naming it and why; the rank is reported from the others.
"""

from __future__ import annotations

import csv
import json
import logging
import sqlite3
from array import array
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import quote

from ..core.options import LEVELS
from .analyze import RankAnalyzer, StepRow, analyze_trace_file, peak_downsample, step_summary
from .checks import MAX_DEVICE, one_line
from .classify import COMM_CORE_TYPES, HCCL_TASKS, NPU_LISTED_TASKS, RANK_IN_NAME, is_comm, kernel_group

log = logging.getLogger("ondemand_prof.report")

ASCEND_DIR = "ASCEND_PROFILER_OUTPUT"
NPU_DB_GLOB = "ascend_pytorch_profiler*.db"
ANALYSIS_DB = "analysis.db"
ALLOCATOR = "PTA"  # torch_npu's caching allocator: the memory users manage from PyTorch
KNOWN_FILES = ("trace_view.json", NPU_DB_GLOB, "step_trace_time.csv", ANALYSIS_DB, "op_statistic.csv",
               "kernel_details.csv", "memory_record.csv")
_MB = 2 ** 20
# the split columns torch_npu writes (step_trace_time.csv headers -> analysis.db StepTraceTime columns)
_SPLIT_COLUMNS = {"Step": "step", "Computing": "computing", "Communication(Not Overlapped)":
                  "communication_not_overlapped", "Overlapped": "overlapped", "Communication": "communication",
                  "Free": "free"}
TableRow = dict[str, Any]


def read_ascend(path: Path, top: int) -> dict[str, Any]:
    """One rank's report from a *_ascend_pt directory or its ASCEND_PROFILER_OUTPUT."""
    root = path if path.name == ASCEND_DIR else path / ASCEND_DIR
    out: dict[str, Any] = {"path": str(root.parent), "kind": "ascend", "rank": _rank(root.parent), "warnings": [],
                           "world_size": _world_size(root.parent), "level": npu_level(root.parent)}
    used: list[str] = []
    problems: list[str] = []

    def attempt(name: str, read: Callable[[], None]) -> None:
        try:
            read()
            used.append(name)
        except Exception as exc:  # noqa: BLE001 - one unreadable file never hides the others
            log.debug("cannot read %s", root / name, exc_info=True)
            problems.append(f"{name}: {_why(exc)}")

    dbs = sorted(root.glob(NPU_DB_GLOB))
    view = next((root / n for n in ("trace_view.json", "trace_view.json.gz") if (root / n).exists()), None)
    if view is not None:  # (a capture kept compressed: the reader opens gzip as it opens any trace)
        attempt("trace_view.json", lambda: analyze_trace_file(view, out, top))
    if dbs and "trace_view.json" not in used:
        attempt(dbs[0].name, lambda: out.update(npu_db_result(dbs[0], top)))
    if (root / "step_trace_time.csv").exists():
        attempt("step_trace_time.csv", lambda: _use_split(root, out, _csv_rows(root / "step_trace_time.csv"),
                                                          "step_trace_time.csv"))
    elif (root / ANALYSIS_DB).exists():
        attempt(ANALYSIS_DB, lambda: _use_split(root, out, _analysis_db_rows(root / ANALYSIS_DB),
                                                f"{ANALYSIS_DB} StepTraceTime"))
    for name, reader in (("op_statistic.csv", _op_statistic), ("kernel_details.csv", _kernel_details)):
        if (root / name).exists():
            attempt(name, lambda: out.__setitem__("top_kernels", sorted(reader(root / name),
                                                                        key=lambda r: -r["total_us"])[:top]))
            if name in used:
                break
    if (root / "memory_record.csv").exists():
        attempt("memory_record.csv", lambda: out.__setitem__(
            "memory", npu_memory(_memory_csv_rows(root / "memory_record.csv"))))
    out.setdefault("basis", "device")
    out["files_used"] = used
    if not used:
        present = ", ".join(sorted(p.name for p in root.iterdir())[:8]) if root.is_dir() else "nothing"
        out["error"] = "; ".join(problems) if problems else (
            f"{root} holds {present or 'nothing'}: none of {', '.join(KNOWN_FILES)}")
    else:
        out["warnings"].extend(f"skipped {p}" for p in problems)
    log.debug("%s: read %s", root, ", ".join(used) or "nothing")
    return out


def _why(exc: Exception) -> str:
    if isinstance(exc, sqlite3.Error):
        return f"not a readable SQLite database ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _small_int(value: Any) -> int | None:
    """A rank or world size written as a number or a numeric string ("rank_id": "2")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value) if 0 <= int(value) < 1 << 24 else None
    return None


def _world_size(top_dir: Path) -> int | None:
    """torch_npu's profiler_metadata.json names the job's world size (distributed_args) when Megatron set it."""
    args = _json_object(top_dir / "profiler_metadata.json").get("distributed_args")
    return _small_int(args.get("world_size")) if isinstance(args, dict) else None


def npu_level(top_dir: Path) -> str | None:
    """The level torch_npu recorded at (profiler_info_N.json: experimental_config._profiler_level, "Level1"), as
    our options name it ("level1"): a comparison of Level1 with Level2 says so (their operators and tasks differ by
    what each level records). None where no profiler_info says."""
    for info in (top_dir / "profiler_info.json", *sorted(top_dir.glob("profiler_info_*.json"))):
        config = _json_object(info).get("config") if info.exists() else None
        level = ((config or {}).get("experimental_config") or {}).get("_profiler_level") \
            if isinstance(config, dict) else None
        if isinstance(level, str) and level.lower() in LEVELS:  # (torch_npu's Level0 ... Level_none, lowercased)
            return level.lower()
    return None


def _rank(top_dir: Path) -> int | None:
    for info in (top_dir / "profiler_info.json", *sorted(top_dir.glob("profiler_info_*.json"))):
        rank = _small_int(_json_object(info).get("rank_id")) if info.exists() else None
        if rank is not None:
            return rank
    for f in sorted(top_dir.glob("profiler_info_*.json")):
        suffix = f.stem.rsplit("_", 1)[1]
        if suffix.isdigit():
            return int(suffix)
    m = RANK_IN_NAME.search(top_dir.name)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------------------
# CSVs

def _csv_rows(path: Path) -> Iterator[dict[str, str]]:
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as fh:
        yield from csv.DictReader(fh)


def _num(value: Any) -> float:
    v = _opt_num(value)
    return 0.0 if v is None else v


def _opt_num(value: Any) -> float | None:
    """A number from a CSV cell or a db column, None when empty (kernel_details' times end with a tab)."""
    if value is None:
        return None
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def _analysis_db_rows(db: Path) -> Iterator[dict[str, Any]]:
    """analysis.db's StepTraceTime, as step_trace_time.csv's rows (the same columns, snake_cased)."""
    con = _connect(db)
    try:
        if "StepTraceTime" not in sqlite_tables(con):
            raise ValueError(f"no StepTraceTime table (its tables: {', '.join(sorted(sqlite_tables(con))) or 'none'})")
        cur = con.execute("SELECT * FROM StepTraceTime")
        cols = [c[0] for c in cur.description]
        rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()
    for row in rows:
        yield {csv_name: row.get(col) for csv_name, col in _SPLIT_COLUMNS.items()}


def _use_split(root: Path, out: dict[str, Any], table: Iterable[TableRow], source: str) -> None:
    """torch_npu's split of each step replaces ours; start times come from the trace's steps or kernel_details."""
    starts = {s["step"]: s["start_us"] for s in out.get("steps") or []}
    if not starts and (root / "kernel_details.csv").exists():
        starts = _kernel_step_starts(root / "kernel_details.csv")
    rows = []
    for i, row in enumerate(table):
        step = _opt_num(row.get("Step"))
        compute, exposed = _num(row.get("Computing")), _num(row.get("Communication(Not Overlapped)"))
        overlap, free = _num(row.get("Overlapped")), _num(row.get("Free"))
        total = compute + exposed + free  # torch_npu's step: Computing (overlap included) + exposed comm + Free
        number = int(step) if step is not None else i
        rows.append(StepRow(number, starts.get(number), total, total, compute - overlap, exposed, overlap, free,
                            _num(row.get("Communication"))))
    if not rows:
        raise ValueError("no step rows")
    out["steps"] = [r.as_dict() for r in rows]
    out["basis"] = "device"
    out["split_from"] = source
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


MemoryRow = tuple[str, float, "float | None", "float | None", str]


def _memory_csv_rows(path: Path) -> Iterator[MemoryRow]:
    for row in _csv_rows(path):
        alloc, reserved = _opt_num(row.get("Total Allocated(MB)")), _opt_num(row.get("Total Reserved(MB)"))
        yield ((row.get("Component") or ALLOCATOR).strip(), _num(row.get("Timestamp(us)")),
               None if alloc is None else alloc * _MB, None if reserved is None else reserved * _MB,
               (row.get("Device Type") or row.get("Device") or "NPU").strip())


def npu_memory(rows: Iterable[MemoryRow]) -> dict[str, Any] | None:
    """Memory per (device, component) from (component, ts_us, allocated B, reserved B, device) rows; an empty
    allocated or reserved value is "not recorded" (None), never 0.

    Components are separate series (mixing them made a zig-zag and an inflated peak); the series drawn is the
    allocator's (PTA) on the device where it peaks, or the largest component with allocated values."""
    stats: dict[tuple[str, str], dict[str, Any]] = {}
    series: dict[tuple[str, str], tuple[array, array]] = {}
    for component, ts, alloc, reserved, device in rows:
        key = (device, component)
        s = stats.get(key)
        if s is None:
            s = stats[key] = {"device": device, "component": component, "peak_allocated": None,
                              "peak_reserved": None, "samples": 0, "allocs": None, "alloc_bytes": None,
                              "frees": None, "freed_bytes": None}
            series[key] = (array("d"), array("d"))
        s["samples"] += 1
        if alloc is not None:
            s["peak_allocated"] = max(s["peak_allocated"] or 0.0, alloc)
            series[key][0].append(ts)
            series[key][1].append(alloc)
        if reserved is not None:
            s["peak_reserved"] = max(s["peak_reserved"] or 0.0, reserved)
    if not stats:
        return None
    devices = sorted(stats.values(), key=lambda s: (s["peak_allocated"] is None, s["component"] != ALLOCATOR,
                                                    -(s["peak_allocated"] or 0.0)))
    main = (devices[0]["device"], devices[0]["component"])
    times, allocated = series[main]
    points = sorted(zip(times, allocated))
    return {"devices": devices, "series_device": f"{main[0]} ({main[1]})", "series": peak_downsample(points)}


# ----------------------------------------------------------------------------------------------------------
# db export

def _connect(db: Path) -> sqlite3.Connection:
    return connect_read_only(db)


def connect_read_only(db: Path) -> sqlite3.Connection:
    """A database opened to be read, never written: read-only and immutable, so that SQLite neither creates the
    -shm and -wal files beside a WAL database (torch_npu's are: each report left both in the capture folder) nor
    fails on a read-only mount ("unable to open database file": the rank's operators and kernels were lost). The
    path is quoted into the URI (a '?' or '#' in a folder name is part of the path)."""
    return sqlite3.connect(f"file:{quote(str(db.absolute()))}?mode=ro&immutable=1", uri=True)


def sqlite_tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}  # table names come from NPU_TABLES only


def is_npu_db(path: Path) -> bool:
    """torch_npu's db export or CANN's msprof db (as opposed to our profile.db or any other SQLite file)."""
    try:
        con = _connect(path)
        try:
            tables = sqlite_tables(con)
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return "STRING_IDS" in tables and bool(tables & {"STEP_TIME", "TASK", "PYTORCH_API", "MEMORY_RECORD"})


def npu_db_result(db: Path, top: int) -> dict[str, Any]:
    """torch_npu's db replayed through the same analysis as a trace (ns -> us)."""
    con = _connect(db)
    try:
        tables = sqlite_tables(con)
        strings = {_int(k): str(v) for k, v in con.execute("SELECT id, value FROM STRING_IDS")}
        an = RankAnalyzer()
        _db_steps_and_ops(con, tables, strings, an)
        _db_device(con, tables, strings, an)
        out = an.result(top)
        out["db"] = str(db)
        out["memory"] = _db_memory(con, tables, strings)
        if "NPU_INFO" in tables:  # the device type ("Ascend910B"): a comparison says where the two differ
            row = con.execute("SELECT name FROM NPU_INFO LIMIT 1").fetchone()
            if row and isinstance(row[0], str) and row[0].strip():
                out["device"] = one_line(row[0].strip())[:MAX_DEVICE]
        if "RANK_DEVICE_MAP" in tables:
            row = con.execute("SELECT rankId FROM RANK_DEVICE_MAP LIMIT 1").fetchone()
            if row and _int(row[0]) >= 0:
                out["rank"] = _int(row[0])
        return out
    finally:
        con.close()


def _ns(value: Any) -> int | None:
    """A nanosecond time from an INTEGER or TEXT column (torch_npu writes PYTORCH_API's as text)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError):
            return None


def _span(start: Any, end: Any) -> tuple[float, float] | None:
    """(ts_us, dur_us) from two nanosecond columns; None for a row without them."""
    a, b = _ns(start), _ns(end)
    if a is None or b is None or b < a:
        return None
    return a / 1000, (b - a) / 1000


def _api_types(con: sqlite3.Connection, tables: set[str]) -> tuple[set[int], set[int]] | None:
    """PYTORCH_API's type ids of operators and of mstx ranges (ENUM_API_TYPE); None when the db has no enum."""
    if "ENUM_API_TYPE" not in tables:
        return None
    names = {str(n): _int(i) for i, n in con.execute("SELECT id, name FROM ENUM_API_TYPE")}
    return {names[n] for n in ("op",) if n in names}, {names[n] for n in ("mstx",) if n in names}


def _db_steps_and_ops(con: sqlite3.Connection, tables: set[str], strings: dict[int, str],
                      an: RankAnalyzer) -> None:
    events: list[dict[str, Any]] = []
    has_steps = "STEP_TIME" in tables and con.execute("SELECT COUNT(*) FROM STEP_TIME").fetchone()[0] > 0
    if has_steps:
        for sid, start, end in con.execute("SELECT id, startNs, endNs FROM STEP_TIME"):
            span = _span(start, end)
            if span is not None and _ns(sid) is not None:
                events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{_ns(sid)}",
                               "pid": "steps", "tid": "steps", "ts": span[0], "dur": span[1]})
    an.feed(events)
    if "PYTORCH_API" not in tables:
        return
    types = _api_types(con, tables)
    typed = types is not None and "type" in _columns(con, "PYTORCH_API")
    query = "SELECT startNs, endNs, globalTid, name" + (", type" if typed else ", NULL") + " FROM PYTORCH_API"

    def ops() -> Iterator[dict[str, Any]]:
        for start, end, tid, name, kind in con.execute(query):
            if typed and types is not None:
                if _int(kind) in types[0]:
                    cat = "cpu_op"
                elif _int(kind) in types[1]:
                    cat = "user_annotation"
                else:  # the task queue's Enqueue/Dequeue, Python frames (with_stack): not operators
                    continue
            else:
                cat = "cpu_op"
            text = strings.get(_int(name), str(name))
            span = _span(start, end)
            if span is None or (has_steps and text.startswith("ProfilerStep#")):
                continue  # STEP_TIME has the steps
            yield {"ph": "X", "cat": cat, "name": text, "pid": "host", "tid": tid, "ts": span[0], "dur": span[1]}
    an.feed(ops())


def _db_device(con: sqlite3.Connection, tables: set[str], strings: dict[int, str], an: RankAnalyzer) -> None:
    if "TASK" in tables:
        _db_tasks(con, tables, strings, an)
    if "COMMUNICATION_OP" in tables:
        for name, start, end, conn in con.execute("SELECT opName, startNs, endNs, connectionId FROM COMMUNICATION_OP"):
            span = _span(start, end)
            if span is not None:
                text = strings.get(_int(name), str(name))
                an.device_event(span[0], span[1], text, _int(conn), True)
                an.set_library(text, "HCCL")
    if "CANN_API" in tables:
        for start, conn in con.execute("SELECT startNs, connectionId FROM CANN_API"):
            t = _ns(start)
            if t is not None:
                an.launch_event(t / 1000, _int(conn))


def _db_tasks(con: sqlite3.Connection, tables: set[str], strings: dict[int, str], an: RankAnalyzer) -> None:
    """The device tasks as the text export's trace_view.json has them (one capture exported both ways holds the
    same tasks under the same names): a compute task by its operator's name (COMPUTE_TASK_INFO); an HCCL task by
    its type (COMMUNICATION_TASK_INFO: Notify_Wait, Memcpy, Reduce_Inline ..., communication); a task known only
    by its type (EVENT_WAIT, MEMCPY_ASYNC, ...) by that type, listed in neither compute nor communication. A
    kernel-type task with neither is not in the text export (rank 0 of MindStudio Insight's level1 job has 17
    AI_CORE and KERNEL_AICORE ones; four are the parents of its hcom_ operations' HCCL tasks, each lasting its
    whole operation: counted as compute they would hide the communication): left out."""
    hccl: dict[int, str] = {}
    if "COMMUNICATION_TASK_INFO" in tables:  # (a type we do not know, or an id no string names: its operation,
        # COMMUNICATION_OP, holds its time; CANN's msprof_0.db in MindStudio Insight's tests has such ids)
        hccl = {_int(g): strings[_int(t)] for g, t in
                con.execute("SELECT globalTaskId, taskType FROM COMMUNICATION_TASK_INFO")
                if strings.get(_int(t)) in HCCL_TASKS}
    named = "COMPUTE_TASK_INFO" in tables
    query = ("SELECT c.name, t.startNs, t.endNs, t.connectionId, t.globalTaskId, t.taskType FROM TASK t "
             "LEFT JOIN COMPUTE_TASK_INFO c ON c.globalTaskId = t.globalTaskId" if named else
             "SELECT NULL, startNs, endNs, connectionId, globalTaskId, taskType FROM TASK")
    for name, start, end, conn, task, kind in con.execute(query):
        span = _span(start, end)
        if span is None:
            continue
        if name is not None:
            text = strings.get(_int(name), str(name))
            an.device_event(span[0], span[1], text, _int(conn), is_comm(text))
        elif _int(task) in hccl:
            an.device_event(span[0], span[1], hccl[_int(task)], _int(conn), True)
        elif strings.get(_int(kind)) in NPU_LISTED_TASKS:
            an.device_event(span[0], span[1], strings[_int(kind)], _int(conn), False, listed=True)


def _db_memory(con: sqlite3.Connection, tables: set[str], strings: dict[int, str]) -> dict[str, Any] | None:
    if "MEMORY_RECORD" not in tables:
        return None
    rows = con.execute("SELECT component, timestamp, totalAllocated, totalReserved, deviceId FROM MEMORY_RECORD")
    return npu_memory((strings.get(_int(c), str(c)), (_ns(ts) or 0) / 1000, _opt_num(a), _opt_num(r), f"NPU:{d}")
                      for c, ts, a, r, d in rows)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
