"""Turn a raw Kineto trace into what we publish: the final trace, then CSV summaries or a SQLite database and
summary.json.

Runs in a child process (``python -m ondemand_prof.rank.postprocess``) started by the background exporter, so the
JSON parse neither holds the training process's GIL nor grows its memory. Imports no torch. A spec's "phase" says
which part (issue 44: the trace is published and "done" said before any summary is written):

  trace    the rewrite below, for a raw trace that needs one (the exporter publishes a raw trace that needs none
           as is, without a child: raw_trace_plan, set_trace_name)
  gzip     a raw trace that needs no rewrite, compressed as it streams (no JSON parse)
  summary  the published trace's summaries (CSV or SQLite, summary.json), written into its published rank
           directory, each file atomically, at idle priority and within a CPU-time limit
  all      trace then summaries (what one child did before; bench/bench_first_capture.py times it)

What the rewrite does, in order:
  1. keeps exactly the ProfilerStep#N annotations of the recorded steps (a window closed by close() has an
     empty annotation for the step that never ran),
  2. at level_none keeps only annotations (ProfilerStep#N, record_function ranges, gpu_user_annotation),
  3. with data simplification drops per-event bookkeeping args and flow arrows (see SIMPLIFY_* below),
  4. makes sure distributedInfo.rank is present (with the backend the trace's collectives show),
  5. writes compact JSON (gzipped when asked), distributedInfo first and spaced as torch writes it: HTA finds a
     file's rank with the regex `"rank":\\s+(\\d+)` on its first matching line, and reads `"rank":1` as rank 0.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

from ..core.tracedefs import CPU_TREE_CATS, DEVICE_CATS, STEP_RE, SUMMARY_FILE, SUMMARY_TOP, thread_self_times

# (gzip, csv, sqlite3 and bisect are imported where they are used: a child that needs none of them starts sooner)


# Data simplification: args that only serve torch's internal bookkeeping, or duplicate what the event
# already says, and flow events (fwd->bwd and cpu->gpu arrows) which viewers draw but no analysis needs.
# "External id" and "correlation" stay: HTA and our reports join operators to kernels with them.
SIMPLIFY_DROP_ARGS = frozenset({
    "Record function id", "Ev Idx", "Sequence number", "Fwd thread id", "Python parent id", "Python id",
    "Python thread", "Input Strides", "Concrete Inputs", "Trace name", "Trace iteration",
})
SIMPLIFY_DROP_PHASES = frozenset({"s", "f", "t"})
ANNOTATION_CATS = frozenset({"user_annotation", "gpu_user_annotation"})
OPERATOR_CATS = frozenset({"cpu_op"}) | DEVICE_CATS


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    if str(path).endswith(".gz"):
        import gzip

        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return json.load(fh)
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def dump_trace(trace: dict[str, Any], path: str | os.PathLike[str]) -> None:
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    info = trace.get("distributedInfo")
    rest = {k: v for k, v in trace.items() if k != "distributedInfo"}
    with opener(path, "wt", encoding="utf-8") as fh:  # type: ignore[operator]
        if isinstance(info, dict):  # see step 5 of the module docstring
            fh.write('{"distributedInfo": ' + json.dumps(info, separators=(", ", ": ")) + ("," if rest else ""))
            fh.write(json.dumps(rest, separators=(",", ":"))[1:])
        else:
            json.dump(trace, fh, separators=(",", ":"))


def step_of(event: dict[str, Any]) -> int | None:
    match = STEP_RE.match(str(event.get("name", "")))
    return int(match.group(1)) if match and event.get("ph") == "X" else None


def rewrite(trace: dict[str, Any], *, keep_steps: Iterable[int] | None, level: str, simplify: bool,
            rank: int, world_size: int) -> dict[str, int]:
    """Apply steps 1-4 of the module docstring in place; returns counts of what was dropped."""
    keep = None if keep_steps is None else set(keep_steps)
    dropped: defaultdict[str, int] = defaultdict(int)
    out = []
    for ev in trace.get("traceEvents", []):
        step = step_of(ev)
        if step is not None and keep is not None and step not in keep:
            dropped["step_annotations"] += 1
            continue
        if level == "level_none" and ev.get("ph") in ("X", "i", "s", "f") and ev.get("cat") not in ANNOTATION_CATS:
            dropped["level_none"] += 1
            continue
        if simplify:
            if ev.get("ph") in SIMPLIFY_DROP_PHASES:
                dropped["flows"] += 1
                continue
            args = ev.get("args")
            if args:
                for key in SIMPLIFY_DROP_ARGS.intersection(args):
                    del args[key]
                    dropped["args"] += 1
        out.append(ev)
    trace["traceEvents"] = out
    info = trace.get("distributedInfo")
    if not isinstance(info, dict) or "rank" not in info:
        trace["distributedInfo"] = {"backend": collective_backend(out), "rank": rank, "world_size": world_size}
    elif info.get("backend") in (None, "none"):  # the placeholder written before torch.distributed was up
        info["backend"] = collective_backend(out)
    return dict(dropped)


_BACKENDS = (("nccl", re.compile(r"nccl", re.IGNORECASE)), ("gloo", re.compile(r"gloo:")),
             ("hccl", re.compile(r"hcom_|hccl", re.IGNORECASE)))


def collective_backend(events: list[dict[str, Any]]) -> str:
    """The process group backend the trace's collectives name (gloo:all_reduce, nccl kernels, hcom_*); "none"
    when the window holds no collective (torch only writes distributedInfo itself when it knows)."""
    for ev in events:
        name = ev.get("name")
        if ev.get("ph") == "X" and isinstance(name, str):
            for backend, pattern in _BACKENDS:
                if pattern.match(name):
                    return backend
    return "none"


# ----------------------------------------------------------------------------------------------------------
# Summaries


def steps_table(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for ev in events:
        step = step_of(ev)
        if step is not None:
            rows.append({"step": step, "ts_us": float(ev["ts"]), "dur_us": float(ev.get("dur", 0.0))})
    rows.sort(key=lambda r: r["step"])
    return rows


def self_times(events: list[dict[str, Any]]) -> dict[int, float]:
    """Self time of each CPU-tree event (by index), per thread."""
    by_thread: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for i, ev in enumerate(events):
        if ev.get("ph") == "X" and ev.get("cat") in CPU_TREE_CATS:
            by_thread[(ev.get("pid"), ev.get("tid"))].append(i)
    result: dict[int, float] = {}
    for idxs in by_thread.values():
        selfs = thread_self_times([float(events[i]["ts"]) for i in idxs],
                                  [float(events[i].get("dur", 0.0)) for i in idxs])
        result.update(zip(idxs, selfs))
    return result


def operators_table(events: list[dict[str, Any]], selfs: dict[int, float]) -> list[dict[str, Any]]:
    agg: dict[tuple[str, str], dict[str, Any]] = {}
    for i, ev in enumerate(events):
        cat = ev.get("cat")
        if ev.get("ph") != "X" or cat not in OPERATOR_CATS:
            continue
        key = (str(ev.get("name")), str(cat))
        row = agg.setdefault(key, {"name": key[0], "category": key[1], "calls": 0, "total_us": 0.0, "self_us": 0.0})
        dur = float(ev.get("dur", 0.0))
        row["calls"] += 1
        row["total_us"] += dur
        row["self_us"] += selfs.get(i, dur)
    rows = sorted(agg.values(), key=lambda r: (-r["self_us"], r["name"]))
    cpu_self = sum(r["self_us"] for r in rows if r["category"] == "cpu_op") or 1.0
    for row in rows:
        row["avg_us"] = row["total_us"] / row["calls"]
        row["self_pct"] = 100.0 * row["self_us"] / cpu_self if row["category"] == "cpu_op" else None
    return rows


def memory_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for ev in events:
        if ev.get("name") == "[memory]":
            a = ev.get("args", {})
            rows.append({
                "ts_us": float(ev.get("ts", 0.0)), "device_type": a.get("Device Type"), "device_id": a.get("Device Id"),
                "addr": a.get("Addr"), "bytes": a.get("Bytes"), "total_allocated": a.get("Total Allocated"),
                "total_reserved": a.get("Total Reserved"),
            })
    return rows


def assign_steps(ts_list: list[float], steps: list[dict[str, Any]]) -> list[int | None]:
    """The recorded step containing each timestamp (None outside every step)."""
    import bisect

    ordered = sorted(steps, key=lambda s: s["ts_us"])
    starts = [s["ts_us"] for s in ordered]
    out: list[int | None] = []
    for ts in ts_list:
        i = bisect.bisect_right(starts, ts) - 1
        hit = i >= 0 and ts < ordered[i]["ts_us"] + ordered[i]["dur_us"]
        out.append(ordered[i]["step"] if hit else None)
    return out


def write_text_summaries(out_dir: Path, steps: list[dict[str, Any]], ops: list[dict[str, Any]],
                         mode: int | None = None) -> list[str]:
    import csv

    def step_rows(path: str) -> None:
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["step", "start_us", "duration_ms"])
            for s in steps:
                w.writerow([s["step"], f"{s['ts_us']:.3f}", f"{s['dur_us'] / 1000.0:.3f}"])

    def operator_rows(path: str) -> None:
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["name", "category", "calls", "total_us", "self_us", "avg_us", "self_pct"])
            for r in ops:
                pct = "" if r["self_pct"] is None else f"{r['self_pct']:.2f}"
                w.writerow([r["name"], r["category"], r["calls"], f"{r['total_us']:.3f}", f"{r['self_us']:.3f}",
                            f"{r['avg_us']:.3f}", pct])

    write_file_atomic(out_dir, "step_summary.csv", step_rows, mode)
    write_file_atomic(out_dir, "operator_summary.csv", operator_rows, mode)
    return ["step_summary.csv", "operator_summary.csv"]


DB_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE steps (step INTEGER PRIMARY KEY, start_us REAL NOT NULL, dur_us REAL NOT NULL);
CREATE TABLE events (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT, pid TEXT, tid TEXT,
    ts_us REAL NOT NULL, dur_us REAL NOT NULL, self_us REAL, step INTEGER, input_dims TEXT, external_id INTEGER
);
CREATE TABLE operators (
    name TEXT NOT NULL, category TEXT NOT NULL, calls INTEGER NOT NULL, total_us REAL NOT NULL,
    self_us REAL NOT NULL, avg_us REAL NOT NULL, PRIMARY KEY (name, category)
);
CREATE TABLE memory_events (
    ts_us REAL NOT NULL, step INTEGER, device_type INTEGER, device_id INTEGER, addr INTEGER, bytes INTEGER,
    total_allocated INTEGER, total_reserved INTEGER
);
CREATE INDEX events_by_step ON events (step);
CREATE INDEX events_by_name ON events (name);
"""


def write_db(path: Path, events: list[dict[str, Any]], steps: list[dict[str, Any]], ops: list[dict[str, Any]],
             selfs: dict[int, float], meta: dict[str, Any]) -> None:
    import sqlite3

    con = sqlite3.connect(path)
    try:
        con.executescript(DB_SCHEMA)
        con.executemany("INSERT INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
        con.executemany("INSERT INTO steps VALUES (?, ?, ?)", [(s["step"], s["ts_us"], s["dur_us"]) for s in steps])
        complete = [(i, ev) for i, ev in enumerate(events) if ev.get("ph") == "X"]
        step_ids = assign_steps([float(ev["ts"]) for _, ev in complete], steps)
        con.executemany(
            "INSERT INTO events (name, category, pid, tid, ts_us, dur_us, self_us, step, input_dims, external_id)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (str(ev.get("name")), ev.get("cat"), str(ev.get("pid")), str(ev.get("tid")), float(ev["ts"]),
                 float(ev.get("dur", 0.0)), selfs.get(i), step,
                 json.dumps(ev["args"]["Input Dims"]) if "Input Dims" in ev.get("args", {}) else None,
                 ev.get("args", {}).get("External id"))
                for (i, ev), step in zip(complete, step_ids)
            ],
        )
        con.executemany(
            "INSERT INTO operators VALUES (?, ?, ?, ?, ?, ?)",
            [(r["name"], r["category"], r["calls"], r["total_us"], r["self_us"], r["avg_us"]) for r in ops],
        )
        mem = memory_rows(events)
        mem_steps = assign_steps([m["ts_us"] for m in mem], steps)
        con.executemany(
            "INSERT INTO memory_events VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(m["ts_us"], st, m["device_type"], m["device_id"], m["addr"], m["bytes"], m["total_allocated"],
              m["total_reserved"]) for m, st in zip(mem, mem_steps)],
        )
        con.commit()
    finally:
        con.close()




def write_rank_summary(out_dir: Path, trace: dict[str, Any], spec: dict[str, Any], mode: int | None = None) -> str:
    """summary.json: this rank's report (step split, top operators and kernels, memory peaks), computed here
    where the trace is written, so that a report across hosts merges these instead of reading traces."""
    from ..report.analyze import RankAnalyzer, device_of, shift_to_epoch  # the report's definitions: summaries agree

    analyzer = RankAnalyzer()
    analyzer.feed(trace["traceEvents"])
    summary = analyzer.result(SUMMARY_TOP)
    if summary.get("memory"):
        summary["memory"] = {"devices": summary["memory"]["devices"]}  # the series stays in the trace
    shift_to_epoch(summary, trace.get("baseTimeNanoseconds"))  # as the report does: wall-clock comparable times
    device = device_of(trace.get("deviceProperties"))
    if device:  # a comparison across hosts (summaries only) says where two sides ran on different devices
        summary["device"] = device
    summary.update({k: v for k, v in (spec.get("meta") or {}).items() if k != "window"})
    summary.update(rank=spec["rank"], world_size=spec["world_size"], summary_version=1)

    def dump(path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, separators=(",", ":"), default=str)

    write_file_atomic(out_dir, SUMMARY_FILE, dump, mode)
    return SUMMARY_FILE


def write_file_atomic(out_dir: Path, name: str, write: Callable[[str], None], mode: int | None = None) -> None:
    """`write(path)` fills a new file of `out_dir` that is then renamed to `name`: a reader sees the whole file or
    none (a summary is written into a rank directory already published). The temporary name is created exclusively
    and without following a link (O_EXCL, O_NOFOLLOW), 0600 until written, then given `mode` (default: 0644 less
    the umask)."""
    tmp = str(out_dir / f".{name}.{os.getpid()}.tmp")
    for _ in range(2):
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:  # left by a child of the same pid that was killed: ours to remove
            os.unlink(tmp)
    else:
        raise FileExistsError(tmp)
    try:
        os.close(fd)
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # the file written (sqlite makes its own)
        try:
            os.fchmod(fd, mode if mode is not None else 0o644 & ~_umask())
        finally:
            os.close(fd)
        os.replace(tmp, out_dir / name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ----------------------------------------------------------------------------------------------------------
# A raw trace published as it is (issue 44): the checks the exporter makes without a JSON parse, and the one field
# it changes in place (traceName, kineto's last key: the raw file's own staging path otherwise)

HEAD_BYTES = 64 << 10  # a raw trace names distributedInfo in its header, before "traceEvents"
TAIL_BYTES = 64 << 10  # and traceName after the events' "]"
SCAN_CHUNK = 1 << 20
SCAN_CARRY = 40  # bytes of a piece kept in front of the next one: more than a step name is long
_STEP_NAME = re.compile(rb'ProfilerStep#(\d+)"')
_TRACE_NAME = re.compile(rb'"traceName"\s*:\s*"((?:[^"\\]|\\.)*)"\s*\}\s*$')


def raw_trace_plan(raw: Path, *, keep_steps: Iterable[int] | None, level: str, simplify: bool,
                   dist_initialized: bool) -> tuple[str | None, list[int]]:
    """Whether the raw trace at `raw` needs the rewrite (the module docstring's steps 1-5) before it is published:
    (why it does, or None: it can be published as it is; the steps its ProfilerStep#N names hold). Reads its first
    HEAD_BYTES (distributedInfo, with the rank, before the events), every byte once in SCAN_CHUNK pieces for the
    step names (a bytes search, no parse: 2.4 MB in about a millisecond; the GIL is free while each piece is read)
    and its last TAIL_BYTES (traceName, last, as kineto writes it). Never raises: an unreadable file is 'rewrite'."""
    try:
        fd = os.open(raw, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"unreadable ({exc.strerror})", []
    try:
        import stat

        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file", []
        if level == "level_none":
            return "level_none keeps only annotations", []
        if simplify:
            return "data simplification", []
        head = os.pread(fd, HEAD_BYTES, 0)
        events_at = head.find(b'"traceEvents"')
        if events_at < 0:
            return f"no traceEvents in its first {HEAD_BYTES >> 10} KB", []
        why = _distributed_info_problem(head[:events_at], dist_initialized)
        if why:
            return why, []
        tail = os.pread(fd, TAIL_BYTES, max(0, st.st_size - TAIL_BYTES))
        if not _TRACE_NAME.search(tail):
            return f"no traceName at its end (last {TAIL_BYTES >> 10} KB)", []
        steps = _step_names(fd, st.st_size)
    except OSError as exc:
        return f"unreadable ({exc.strerror})", []
    finally:
        os.close(fd)
    keep = None if keep_steps is None else set(keep_steps)
    extra = sorted(steps - keep) if keep is not None else []
    if extra:
        return f"holds step(s) {extra} not recorded (an annotation of a step that never ran)", sorted(steps)
    return None, sorted(steps)


def _distributed_info_problem(head: bytes, dist_initialized: bool) -> str | None:
    """Why the header's distributedInfo would be rewritten (step 4), or None: present with an integer rank and a
    backend (the placeholder's "none" only where torch.distributed is still not initialised, so that no collective
    of the trace can name another)."""
    at = head.find(b'"distributedInfo"')
    if at < 0:
        return "no distributedInfo"
    text = head[at + len(b'"distributedInfo"'):].decode("utf-8", "replace").lstrip()
    if not text.startswith(":"):
        return "distributedInfo unreadable"
    try:
        info, _ = json.JSONDecoder().raw_decode(text[1:].lstrip())
    except ValueError:
        return "distributedInfo unreadable"
    if not isinstance(info, dict) or not isinstance(info.get("rank"), int) or isinstance(info.get("rank"), bool):
        return "distributedInfo without a rank"
    backend = info.get("backend")
    if not isinstance(backend, str) or (backend == "none" and dist_initialized):
        return "distributedInfo's backend to be read from the trace's collectives"
    return None


def _step_names(fd: int, size: int) -> set[int]:
    """The N of every `ProfilerStep#N"` in the file (kineto writes "name": "ProfilerStep#N"). The exporter calls
    this on a rank, beside its training thread: the search runs in libc's memmem with the GIL released
    (_step_names_gil_free; a regex over the 5.7 MB trace of a 20-step window held the GIL for 6-7 ms, a training
    step's worth, issue 44 item 7); the regex is the fallback where memmem is not found."""
    memmem = _libc_memmem()
    if memmem is not None:
        return _step_names_gil_free(fd, size, memmem)
    found: set[int] = set()
    offset, carry = 0, b""
    while offset < size:
        piece = os.pread(fd, SCAN_CHUNK, offset)
        if not piece:
            break
        offset += len(piece)
        data = carry + piece
        found.update(int(m) for m in _STEP_NAME.findall(data))
        carry = data[-SCAN_CARRY:]  # a name cut at a piece's end is whole in the next one (one found twice is one)
    return found


@functools.cache
def _libc_memmem() -> Any | None:
    """libc's memmem through ctypes (a foreign call releases the GIL), or None where it cannot be had."""
    try:
        import ctypes

        fn = ctypes.CDLL(None).memmem
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
        return fn
    except (ImportError, OSError, AttributeError):
        return None


_NEEDLE = b"ProfilerStep#"


def _step_names_gil_free(fd: int, size: int, memmem: Any) -> set[int]:
    """_step_names with memmem over a ctypes buffer that os.preadv fills (the GIL is free during the read too):
    Python runs once a match (_STEP_NAME at it), not once a byte. The last SCAN_CARRY bytes of a piece are kept in
    front of the next one: a name cut there is whole then (one found twice is one)."""
    import ctypes

    buf = ctypes.create_string_buffer(SCAN_CHUNK + SCAN_CARRY)
    base, view = ctypes.addressof(buf), memoryview(buf).cast("B")
    found: set[int] = set()
    offset, kept = 0, 0
    while offset < size:
        got = os.preadv(fd, [view[kept:kept + SCAN_CHUNK]], offset)
        if got <= 0:
            break
        offset += got
        end = kept + got
        at = 0
        while hit := memmem(base + at, end - at, _NEEDLE, len(_NEEDLE)):
            name_at = hit - base
            match = _STEP_NAME.match(bytes(view[name_at:min(end, name_at + SCAN_CARRY)]))
            if match:
                found.add(int(match.group(1)))
            at = name_at + len(_NEEDLE)
        kept = min(SCAN_CARRY, end)
        view[:kept] = view[end - kept:end]
    return found


def set_trace_name(path: Path, name: str) -> None:
    """The trace's traceName (kineto writes the file's own path there: the raw staging file's) made `name`, in
    place: its last TAIL_BYTES rewritten, nothing else read. The file must end with traceName (raw_trace_plan
    checked it); a file that does not is left as it is."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - TAIL_BYTES)
        tail = os.pread(fd, TAIL_BYTES, start)
        match = _TRACE_NAME.search(tail)
        if not match:
            return
        new = tail[:match.start(1) - 1] + json.dumps(name).encode() + tail[match.end(1) + 1:]
        os.pwrite(fd, new, start)
        os.ftruncate(fd, start + len(new))
    finally:
        os.close(fd)


def gzip_as_is(raw: Path, dest: Path, name: str) -> None:
    """The raw trace compressed into `dest` as it streams, its traceName made `name` (the gzip phase: no parse)."""
    import gzip

    size = os.path.getsize(raw)
    start = max(0, size - TAIL_BYTES)
    with open(raw, "rb") as src, gzip.open(dest, "wb", compresslevel=6) as out:
        left = start
        while left > 0:
            piece = src.read(min(SCAN_CHUNK, left))
            if not piece:
                break
            out.write(piece)
            left -= len(piece)
        tail = src.read()
        match = _TRACE_NAME.search(tail)
        if match:
            tail = tail[:match.start(1) - 1] + json.dumps(name).encode() + tail[match.end(1) + 1:]
        out.write(tail)


# ----------------------------------------------------------------------------------------------------------


def process(spec: dict[str, Any]) -> dict[str, Any]:
    """spec (module docstring): phase; trace and gzip: raw, out_dir, trace_name, keep_steps, level, simplify, gzip,
    rank, world_size; summary: trace, out_dir, export_type, rank, world_size, meta, file_mode; all: both."""
    phase = spec.get("phase", "all")
    if phase == "summary":
        return summarise(spec)
    raw = Path(spec["raw"])
    out_dir = Path(spec["out_dir"])
    trace_path = out_dir / (spec["trace_name"] + (".gz" if spec["gzip"] else ""))
    if phase == "gzip":
        gzip_as_is(raw, trace_path, trace_path.name)
        raw.unlink()
        return {"trace": trace_path.name}
    trace = load_trace(raw)
    dropped = rewrite(trace, keep_steps=spec.get("keep_steps"), level=spec["level"], simplify=spec["simplify"],
                      rank=spec["rank"], world_size=spec["world_size"])
    # kineto wrote the raw staging file's name, deleted below; the trace is then moved into the capture folder
    # (rank/layout.py), beside the other ranks' traces, where its name is its path
    trace["traceName"] = trace_path.name
    dump_trace(trace, trace_path)
    raw.unlink()
    events = trace["traceEvents"]
    steps = steps_table(events)
    result = {"steps_in_trace": [s["step"] for s in steps], "dropped": dropped, "events": len(events),
              "trace": trace_path.name}
    if phase == "trace":
        return result
    files = [trace_path.name, *write_summaries(out_dir, trace, spec)]
    return {**result, "files": files}


def write_summaries(out_dir: Path, trace: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """The CSV summaries or profile.db, then summary.json, into `out_dir`, each file atomically."""
    mode = spec.get("file_mode")
    events = trace["traceEvents"]
    steps = steps_table(events)
    selfs = self_times(events)
    ops = operators_table(events, selfs)
    if spec["export_type"] == "db":
        def db(path: str) -> None:
            os.unlink(path)  # sqlite makes its own file (and journal) at this exclusive name
            write_db(Path(path), events, steps, ops, selfs, spec.get("meta", {}))

        write_file_atomic(out_dir, "profile.db", db, mode)
        files = ["profile.db"]
    else:
        files = write_text_summaries(out_dir, steps, ops, mode)
    return [*files, write_rank_summary(out_dir, trace, spec, mode)]


def summarise(spec: dict[str, Any]) -> dict[str, Any]:
    """The summary phase: the published trace (spec["trace"], in the capture folder) read, its summaries written
    into the published rank directory spec["out_dir"] (a directory, not a link to one)."""
    out_dir = Path(spec["out_dir"])
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a directory of ours
    os.close(fd)
    trace_fd = os.open(spec["trace"], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # the trace itself, no link
    os.close(trace_fd)
    trace = load_trace(spec["trace"])
    files = write_summaries(out_dir, trace, spec)
    events = trace["traceEvents"]
    return {"files": files, "events": len(events), "steps_in_trace": [s["step"] for s in steps_table(events)]}


def summary_cpu_limit(trace_bytes: int) -> int:
    """The CPU seconds a summary child may use (RLIMIT_CPU): 120 s and 1 s a MB of trace (about 0.15 s a MB is
    needed), so that no trace, however made, holds a core for longer."""
    return 120 + trace_bytes // (1 << 20)


def die_with_parent(parent: int) -> None:
    """Be killed when the rank that started us dies (PR_SET_PDEATHSIG): a rank killed during post-processing
    leaves no child writing on for seconds. If the rank died before we got here, exit now."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: the rank's staging directory is still removed at its next start
    if os.getppid() != parent:
        sys.exit(3)


def limit_cpu(seconds: int) -> None:
    """RLIMIT_CPU: SIGXCPU at `seconds` of CPU time (the exporter says the summary took too long), SIGKILL after."""
    import resource

    try:
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 5))
    except (ValueError, OSError):
        pass


USAGE = "usage: python -m ondemand_prof.rank.postprocess [--parent PID] [--nice N] SPEC"


def main(argv: list[str] | None = None) -> int:
    """SPEC: a JSON file with the post-processing spec; --parent PID: exit when that process (the rank) is gone;
    --nice N: lower this process's priority by N. (No argparse: 10 ms of a child's start-up.)"""
    args = list(sys.argv[1:] if argv is None else argv)
    parent = nice = 0
    try:
        while args and args[0].startswith("--"):
            flag, value = args.pop(0), args.pop(0)
            if flag == "--parent":
                parent = int(value)
            elif flag == "--nice":
                nice = int(value)
            else:
                raise ValueError(flag)
        (spec_path,) = args
    except (ValueError, IndexError):
        sys.stderr.write(USAGE + "\n")
        return 2
    if parent:
        die_with_parent(parent)
    if nice:
        try:
            os.nice(nice)  # leave the cores to the training run
        except OSError:
            pass
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    if spec.get("cpu_limit_s"):
        limit_cpu(int(spec["cpu_limit_s"]))
    result = process(spec)
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
