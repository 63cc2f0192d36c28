"""Find what can be reported on under a path, and read each kind:

  * our capture directories ({host}_{pid}_{ts}_pt/ with metadata.json): the trace (.json or .json.gz, plain or
    simplified), or profile.db when the trace is gone (export_type db);
  * torch_npu's output ({host}_{pid}_{ts}_ascend_pt/ASCEND_PROFILER_OUTPUT/), text or db export (ascend.py);
  * a bare Chrome/Kineto trace file (torch.profiler's export_chrome_trace, tensorboard_trace_handler, any Kineto
    version, JSON Object or Array Format), our profile.db, or torch_npu's ascend_pytorch_profiler_{rank}.db.

Each source becomes one rank report, or a problem saying what could not be read. Nothing here raises for bad
input: a report covers everything that can be read.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any, Iterator

from .analyze import RankAnalyzer, analyze_trace_file
from .ascend import ASCEND_DIR, is_npu_db, npu_db_result, read_ascend, sqlite_tables
from .classify import RANK_IN_NAME

log = logging.getLogger("ondemand_prof.report")

TRACE_GLOBS = ("trace/*.json", "trace/*.json.gz", "*.pt.trace.json", "*.pt.trace.json.gz")


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
    # a capture folder holds its ranks' traces beside their directories (rank/layout.py): those are read through
    # their rank directory, with its metadata, not a second time as loose files
    owned = {t for k, d in found if k == "capture" and (t := _trace_of(d)) is not None}
    loose = sorted(p for pattern in ("*.json", "*.json.gz") for p in path.glob(pattern)
                   if p.name != "metadata.json" and p.resolve() not in owned)
    found.extend(("trace", p) for p in loose)
    if not found:
        return [], [{"path": str(path), "error": "no captures here (expected capture directories with "
                                                 "metadata.json, *_ascend_pt directories or trace files)"}]
    found.sort(key=lambda kp: kp[1].stat().st_mtime, reverse=True)
    return found, []


def _trace_of(rank_dir: Path) -> Path | None:
    try:
        name = json.loads((rank_dir / "metadata.json").read_text()).get("trace_file")
    except (OSError, ValueError, AttributeError):
        return None
    return (rank_dir / name).resolve() if isinstance(name, str) and name else None


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
    reader = {"capture": _read_capture, "trace": _read_trace_file, "db": _read_db_file, "ascend": read_ascend}[kind]
    try:
        return reader(path, top)
    except Exception as exc:  # noqa: BLE001 - one unreadable capture never stops the report
        log.debug("cannot read %s", path, exc_info=True)
        return {"path": str(path), "kind": kind, "rank": None, "error": f"{type(exc).__name__}: {exc}"}


def _base(path: Path, kind: str) -> dict[str, Any]:
    return {"path": str(path), "kind": kind, "rank": None, "warnings": []}


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
        analyze_trace_file(trace, out, top)
    elif (path / "profile.db").exists():
        out.update(_db_result(path / "profile.db", top))
    else:
        out["error"] = "no trace file and no profile.db in this capture"
    return out


def _read_trace_file(path: Path, top: int) -> dict[str, Any]:
    out = _base(path, "trace")
    m = RANK_IN_NAME.search(path.name)
    if m:
        out["rank"] = int(m.group(1))
    analyze_trace_file(path, out, top)
    return out


def _read_db_file(path: Path, top: int) -> dict[str, Any]:
    out = _base(path, "db")
    if is_npu_db(path):
        out["kind"] = "ascend"
        out.update(npu_db_result(path, top))
        return out
    out.update(_db_result(path, top))
    return out


def _db_result(db: Path, top: int) -> dict[str, Any]:
    """Our SQLite export (postprocess.DB_SCHEMA) replayed as events through the same analysis."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = sqlite_tables(con)
        if not {"events", "meta"} <= tables:
            raise ValueError(f"{db.name} is neither our profile.db nor torch_npu's ascend_pytorch_profiler db "
                             f"(its tables: {', '.join(sorted(tables)[:8]) or 'none'})")

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
