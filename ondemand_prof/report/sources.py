"""Find what can be reported on under the paths a user gives, and read each kind:

  * our capture directories ({host}_{pid}_{ts}_pt/ with metadata.json): the trace (.json or .json.gz, plain or
    simplified), or profile.db when the trace is gone (export_type db);
  * torch_npu's output ({host}_{pid}_{ts}_ascend_pt/ASCEND_PROFILER_OUTPUT/), text or db export (ascend.py);
  * a Chrome/Kineto trace file (torch.profiler's export_chrome_trace, tensorboard_trace_handler, any Kineto
    version, JSON Object or Array Format), our profile.db, torch_npu's ascend_pytorch_profiler_{rank}.db, CANN's
    msprof_*.db.

A folder is searched below (discover()): every directory down to MAX_DEPTH levels, symbolic links followed once;
hidden entries (our staging directories, .git) are not searched. Each capture found is listed, and so is each
candidate that is not read, with the reason (a JSON file that is not a trace, another kind of SQLite database, a
torch_npu directory not analysed yet); other files are counted by extension on one line. Nothing here raises for
bad input: a report covers everything that can be read.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, cast

from ..core import safejson
from ..core.tracedefs import SUMMARY_FILE
from .analyze import RankAnalyzer, analyze_trace_file, device_of
from .ascend import ASCEND_DIR, connect_read_only, is_npu_db, npu_db_result, npu_level, read_ascend, sqlite_tables
from .classify import RANK_IN_NAME
from .model import RankResult
from .tracefile import open_binary

log = logging.getLogger("ondemand_prof.report")

TRACE_GLOBS = ("trace/*.json", "trace/*.json.gz", "*.pt.trace.json", "*.pt.trace.json.gz")
MAX_DEPTH = 12          # levels below a given folder: deeper than any save-path layout we know
MAX_ENTRIES = 200_000   # directory entries looked at in one search, so that `report /` ends
SNIFF_BYTES = 64 << 10  # a Kineto trace names "traceEvents" after its header: schema, devices, distributedInfo
MAX_METADATA_BYTES = 1 << 20  # a rank's metadata.json is a few KB; read no more (300 MB of it took 600 MB here)
SQLITE_MAGIC = b"SQLite format 3\x00"
# JSON files torch_npu and we write beside traces, which are not traces
NOT_TRACES = {"metadata.json": "capture metadata without its capture directory",
              "summary.json": "a rank summary (ondemand_prof), not a trace",
              "profiler_info.json": "torch_npu's profiler settings", "profiler_metadata.json": "torch_npu's metadata",
              "communication.json": "torch_npu's communication statistics",
              "communication_matrix.json": "torch_npu's communication matrix"}
FORMATS = {"capture": "capture directory", "trace": "Kineto/Chrome trace", "db": "profile database",
           "ascend": "torch_npu output"}


@dataclass
class Discovery:
    """What a search found: (kind, path) to read, and one listing entry per candidate, found or skipped."""
    sources: list[tuple[str, Path]] = field(default_factory=list)
    listing: list[dict[str, Any]] = field(default_factory=list)
    problems: list[dict[str, str]] = field(default_factory=list)  # a given path with nothing to report on
    others: Counter = field(default_factory=Counter)  # files that are no profile format, by extension
    seen: set[Path] = field(default_factory=set)
    entries: int = 0

    def found(self, kind: str, path: Path) -> None:
        real = path.resolve()
        if real in self.seen:
            return
        self.seen.add(real)
        self.sources.append((kind, path))
        self.listing.append({"path": str(path), "status": "found", "format": FORMATS[kind]})

    def skipped(self, path: Path, reason: str) -> None:
        self.listing.append({"path": str(path), "status": "skipped", "reason": reason})


def discover(paths: Iterable[Path]) -> Discovery:
    """Everything reportable under `paths` (files, capture or torch_npu directories, folders searched below)."""
    d = Discovery()
    for path in paths:
        path = Path(path)
        before = len(d.sources)
        if not path.exists():
            d.problems.append({"path": str(path), "error": "does not exist"})
            continue
        if path.is_file():
            _given_file(d, path)
            continue
        listed = len(d.listing)
        _directory(d, path, 0, frozenset())
        if len(d.sources) == before:
            skipped = len(d.listing) - listed
            d.problems.append({"path": str(path), "error": "no captures here (searched below for capture "
                               "directories with metadata.json, *_ascend_pt directories, trace files and profile "
                               "databases" + (f"; {skipped} skipped, listed with the reason" if skipped else "") + ")"})
    # a capture folder holds its ranks' traces beside their directories (rank/layout.py): those are read through
    # their rank directory, with its metadata, not a second time as loose files
    owned = {t for kind, p in d.sources if kind == "capture" and (t := _trace_of(p)) is not None}
    if owned:
        d.sources = [(k, p) for k, p in d.sources if not (k == "trace" and p.resolve() in owned)]
        d.listing = [e for e in d.listing if Path(e["path"]).resolve() not in owned or e["status"] != "found"]
    return d


def _given_file(d: Discovery, path: Path) -> None:
    """A file named by the user is read as what it claims to be; only a file of no known format is refused."""
    if path.name.endswith((".json", ".json.gz")):
        d.found("trace", path)
    elif _is_sqlite(path):
        d.found("db", path)
    else:
        d.problems.append({"path": str(path), "error": "not a trace (.json, .json.gz), a profile database, or a "
                                                       "capture directory"})


def _directory(d: Discovery, path: Path, depth: int, visiting: frozenset[Path]) -> None:
    """Search `path` and below; `visiting` holds the real paths above it (a symbolic link back up is not taken)."""
    kind = _dir_kind(path)
    if kind:
        d.found(kind, path)
        return
    if path.name.endswith("_ascend_pt"):
        d.skipped(path, f"torch_npu output without {ASCEND_DIR}: not analysed yet (run "
                        "torch_npu.profiler.profiler.analyse on it, or profile with analyse_flag=True)")
        return
    if path.name.endswith("_ascend_ms"):
        d.skipped(path, "MindSpore's profiler output: not read")
        return
    real = path.resolve()
    if real in visiting:
        return
    if depth > MAX_DEPTH:
        d.skipped(path, f"more than {MAX_DEPTH} levels below the folder given: not searched")
        return
    try:
        children = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError as exc:
        d.skipped(path, f"cannot list: {exc.strerror}")
        return
    d.entries += len(children)
    if d.entries > MAX_ENTRIES:
        d.skipped(path, f"search stopped after {MAX_ENTRIES} entries: give a smaller folder")
        return
    for entry in children:
        if entry.name.startswith("."):  # our staging directories, .git, editors' files
            continue
        child = Path(entry.path)
        try:
            if entry.is_dir():
                _directory(d, child, depth + 1, visiting | {real})
            elif entry.is_file():
                _file(d, child)
        except OSError as exc:
            d.skipped(child, f"cannot read: {exc.strerror}")


def _file(d: Discovery, path: Path) -> None:
    name = path.name
    if name.endswith((".json", ".json.gz")):
        base = name[:-3] if name.endswith(".gz") else name
        if base in NOT_TRACES or base.startswith(("profiler_info_", "profiler_info.")):
            d.skipped(path, NOT_TRACES.get(base, "torch_npu's profiler settings") + ": not a trace")
        elif base.endswith(".pt.trace.json") or (why := _not_a_trace(path)) is None:
            d.found("trace", path)
        else:
            d.skipped(path, why)
    elif name.endswith((".db", ".sqlite", ".sqlite3")):
        why = _not_a_profile_db(path)
        if why is None:
            d.found("db", path)
        else:
            d.skipped(path, why)
    else:
        d.others[Path(name).suffix or "(no extension)"] += 1


def _not_a_trace(path: Path) -> str | None:
    """None when the file's start looks like a Chrome/Kineto trace, else why not."""
    try:
        with open_binary(path)[0] as fh:  # (without blocking, a regular file: a FIFO is none)
            head = fh.read(SNIFF_BYTES)
    except (OSError, EOFError) as exc:
        return f"cannot read: {exc}"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if not text:
        return "empty file"
    if b'"traceEvents"' in head:
        return None
    if text.startswith(b"[") and b'"ph"' in head:  # JSON Array Format (torch_npu's trace_view.json)
        return None
    return f'JSON without a "traceEvents" array in its first {SNIFF_BYTES >> 10} KiB: not a Chrome/Kineto trace'


def trace_device(path: Path) -> str | None:
    """The device a Kineto trace names in its header (deviceProperties, written before "traceEvents"), from its
    first SNIFF_BYTES only: a comparison of capture folders reads their summaries, which do not say it."""
    try:
        with open_binary(path)[0] as fh:
            head = fh.read(SNIFF_BYTES).decode("utf-8", "replace")
    except (OSError, EOFError):
        return None
    at = head.find('"traceEvents"')
    if at < 0:
        return None
    try:
        header = json.loads(head[:at].strip().rstrip(",") + "}")
    except ValueError:
        return None
    return device_of(header.get("deviceProperties")) if isinstance(header, dict) else None


def _is_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


def _not_a_profile_db(path: Path) -> str | None:
    if not _is_sqlite(path):
        return "not a SQLite database"
    if is_npu_db(path):
        return None
    try:
        con = connect_read_only(path)
        try:
            tables = sqlite_tables(con)
        finally:
            con.close()
    except sqlite3.Error as exc:
        return f"unreadable SQLite database ({exc})"
    if {"events", "meta"} <= tables:
        return None
    return f"a SQLite database of another kind (tables: {', '.join(sorted(tables)[:6]) or 'none'})"


def read_metadata(rank_dir: Path) -> Any:
    """A capture directory's metadata.json, read by the bounded JSON reader (at most MAX_METADATA_BYTES, 64
    levels: json.loads recursed on "[[[...", a RecursionError that no caller took for a bad file); OSError or
    ValueError says why not."""
    with open_binary(rank_dir / "metadata.json", nofollow=True)[0] as fh:  # (a regular file, never a FIFO)
        return safejson.loads(fh.read(MAX_METADATA_BYTES + 1), MAX_METADATA_BYTES)


def trace_name_problem(name: Any) -> str | None:
    """Why a metadata.json's `trace_file` is not a file of its capture (None: it is): a bare name in the rank's
    directory, or in the capture folder above it (`../NAME`, where rank/layout.py puts a Kineto trace) (issue 41,
    7: "/dev/zero", a path out of the folder, or a FIFO's name in a hostile folder hung whoever reported it)."""
    if not isinstance(name, str) or not name:
        return "no trace_file"
    base = name[3:] if name.startswith("../") else name
    if "/" in base or "\0" in base or base in (".", "..", "") or len(base) > 255:
        return f"trace_file {name[:80]!r} is not a file name of the capture folder"
    return None


def _in_folder(path: Path) -> tuple[Path | None, str | None]:
    """`path`, a file in a capture folder, when it is a regular file there, not a link (lstat: the reader opens it
    without blocking and checks it again), else why not (None: it does not exist)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None, None
    if st.st_mode & 0o170000 == 0o100000:
        return path, None
    return None, f"{path.name} is not a regular file of the capture folder ({stat.filemode(st.st_mode)})"


def _trace_of(rank_dir: Path) -> Path | None:
    try:
        name = read_metadata(rank_dir).get("trace_file")
    except (OSError, ValueError, AttributeError):
        return None
    return (rank_dir / name).resolve() if trace_name_problem(name) is None else None


def _dir_kind(path: Path) -> str | None:
    if (path / "metadata.json").is_file():
        return "capture"
    if path.name == ASCEND_DIR or (path / ASCEND_DIR).is_dir():
        return "ascend"
    return None


# ----------------------------------------------------------------------------------------------------------

def read_source(kind: str, path: Path, top: int, summaries: bool = False) -> RankResult:
    """One rank's report; "error" is set when nothing could be read, "warnings" when only part could. With
    `summaries`, a capture directory's summary.json stands for its trace where it can (what a comparison reads:
    the same figures the daemon compares across hosts), and the trace is read only where it cannot."""
    reader = {"capture": _read_capture, "trace": _read_trace_file, "db": _read_db_file, "ascend": read_ascend}[kind]
    try:  # the readers fill an open dict (the analyzer's figures among them) whose keys are RankResult's
        out = cast(RankResult, _read_capture(path, top, summaries) if kind == "capture" else reader(path, top))
    except Exception as exc:  # noqa: BLE001 - one unreadable capture never stops the report
        log.debug("cannot read %s", path, exc_info=True)
        out = {"path": str(path), "kind": kind, "rank": None, "error": f"{type(exc).__name__}: {exc}"}
    out.setdefault("folder", str(_folder(kind, path)))
    return out


def _folder(kind: str, path: Path) -> Path:
    """The folder a source sits in, as grouping sees it: a rank directory's or torch_npu directory's parent."""
    if kind == "ascend" and path.name == ASCEND_DIR:
        return path.parent.parent
    if kind == "db" and path.parent.name == ASCEND_DIR:
        return path.parent.parent.parent
    return path.parent


def _base(path: Path, kind: str) -> dict[str, Any]:
    return {"path": str(path), "kind": kind, "rank": None, "warnings": []}


def _read_capture(path: Path, top: int, summaries: bool = False) -> dict[str, Any]:
    out = _base(path, "capture")
    try:
        meta = read_metadata(path)
    except (OSError, ValueError) as exc:
        out["error"] = f"unreadable metadata.json: {exc}"
        return out
    if not isinstance(meta, dict):
        out["error"] = "metadata.json is not a JSON object"
        return out
    out.update({"rank": meta.get("rank"), "host": meta.get("host"), "pid": meta.get("pid"),
                "capture_id": meta.get("capture_id"), "status": meta.get("status"), "window": meta.get("window"),
                "options": meta.get("options"), "source": (meta.get("trigger") or {}).get("source"),
                "published_at": meta.get("published_at"), "job_id": meta.get("job_id"),
                "world_size": meta.get("world_size"), "cpu_by_step": meta.get("cpu_by_step")})
    if meta.get("status") == "failed":
        out["error"] = meta.get("error") or "the capture failed"
        return out
    named = meta.get("trace_file")
    why = trace_name_problem(named) if named is not None else None
    trace = None
    if named is not None and why is None:
        trace, why = _in_folder(path / named)
    if why:  # said, and the trace looked for as when none is named
        out["warnings"].append(f"metadata.json: {why}: not read")
    if trace is None:
        found = [q for pattern in TRACE_GLOBS for p in sorted(path.glob(pattern)) if (q := _in_folder(p)[0])]
        trace = found[0] if found else None
    if summaries and (path / SUMMARY_FILE).is_file():
        why = _from_summary(path, out)
        if why is None:
            if out.get("device") is None and trace is not None:  # (the summary does not say: the trace's header)
                out["device"] = trace_device(trace)
            return out
        out["warnings"].append(f"{SUMMARY_FILE} not used ({why}): the trace is read")
    if trace is not None:
        analyze_trace_file(trace, out, top)
    elif (path / "profile.db").exists():
        out.update(_db_result(path / "profile.db", top))
    else:
        out["error"] = (f"metadata.json: {why}; " if why else "") + "no trace file and no profile.db in this capture"
    return out


def _from_summary(path: Path, out: dict[str, Any]) -> str | None:
    """Fill `out` from the rank's summary.json, checked as the report across hosts checks it; None when done, else
    why it cannot stand for the trace."""
    from ..core.summaryfile import read_summary
    from .checks import summary_problem

    try:
        summary = read_summary(str(path.absolute()))
    except (OSError, ValueError) as exc:
        return str(exc)
    why = summary_problem(summary, rank=out.get("rank"), capture_id=out.get("capture_id"), job_id=out.get("job_id"))
    if why:
        return why
    out.update({k: v for k, v in summary.items() if out.get(k) is None})
    out["read_from"] = SUMMARY_FILE
    return None


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
        m = RANK_IN_NAME.search(path.name)
        out.update(npu_db_result(path, top))
        if out.get("rank") is None and m:
            out["rank"] = int(m.group(1))
        if path.parent.name == ASCEND_DIR:  # torch_npu's own folder: its profiler_info says the level
            out["level"] = npu_level(path.parent.parent)
        return out
    out.update(_db_result(path, top))
    return out


def _db_result(db: Path, top: int) -> dict[str, Any]:
    """Our SQLite export (postprocess.DB_SCHEMA) replayed as events through the same analysis."""
    con = connect_read_only(db)
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
            if key in ("rank", "world_size"):
                try:
                    out[key] = json.loads(value)
                except (TypeError, ValueError):
                    pass
        return out
    finally:
        con.close()
