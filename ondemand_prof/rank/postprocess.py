"""Turn a raw Kineto trace into what we publish: the final trace, CSV summaries or a SQLite database.

Runs in a child process (``python -m ondemand_prof.rank.postprocess``) started by the background exporter, so the
JSON parse neither holds the training process's GIL nor grows its memory. Imports no torch.

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

import argparse
import bisect
import csv
import gzip
import json
import os
import re
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from ..core.tracedefs import CPU_TREE_CATS, DEVICE_CATS, STEP_RE, SUMMARY_FILE, SUMMARY_TOP, thread_self_times


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
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:  # type: ignore[operator]
        return json.load(fh)


def dump_trace(trace: dict[str, Any], path: str | os.PathLike[str]) -> None:
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
    ordered = sorted(steps, key=lambda s: s["ts_us"])
    starts = [s["ts_us"] for s in ordered]
    out: list[int | None] = []
    for ts in ts_list:
        i = bisect.bisect_right(starts, ts) - 1
        hit = i >= 0 and ts < ordered[i]["ts_us"] + ordered[i]["dur_us"]
        out.append(ordered[i]["step"] if hit else None)
    return out


def write_text_summaries(out_dir: Path, steps: list[dict[str, Any]], ops: list[dict[str, Any]]) -> list[str]:
    with open(out_dir / "step_summary.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["step", "start_us", "duration_ms"])
        for s in steps:
            w.writerow([s["step"], f"{s['ts_us']:.3f}", f"{s['dur_us'] / 1000.0:.3f}"])
    with open(out_dir / "operator_summary.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["name", "category", "calls", "total_us", "self_us", "avg_us", "self_pct"])
        for r in ops:
            pct = "" if r["self_pct"] is None else f"{r['self_pct']:.2f}"
            w.writerow([r["name"], r["category"], r["calls"], f"{r['total_us']:.3f}", f"{r['self_us']:.3f}",
                        f"{r['avg_us']:.3f}", pct])
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




def write_rank_summary(out_dir: Path, trace: dict[str, Any], spec: dict[str, Any]) -> str:
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
    with open(out_dir / SUMMARY_FILE, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, separators=(",", ":"), default=str)
    return SUMMARY_FILE


# ----------------------------------------------------------------------------------------------------------


def process(spec: dict[str, Any]) -> dict[str, Any]:
    """spec: raw, out_dir, trace_name, keep_steps, level, simplify, gzip, rank, world_size, export_type, meta."""
    raw = Path(spec["raw"])
    out_dir = Path(spec["out_dir"])
    trace = load_trace(raw)
    dropped = rewrite(trace, keep_steps=spec.get("keep_steps"), level=spec["level"], simplify=spec["simplify"],
                      rank=spec["rank"], world_size=spec["world_size"])
    trace_path = out_dir / (spec["trace_name"] + (".gz" if spec["gzip"] else ""))
    # kineto wrote the raw staging file's name, deleted below; the trace is then moved into the capture folder
    # (rank/layout.py), beside the other ranks' traces, where its name is its path
    trace["traceName"] = trace_path.name
    dump_trace(trace, trace_path)
    raw.unlink()
    events = trace["traceEvents"]
    steps = steps_table(events)
    selfs = self_times(events)
    ops = operators_table(events, selfs)
    files = [str(trace_path.relative_to(out_dir))]
    if spec["export_type"] == "db":
        write_db(out_dir / "profile.db", events, steps, ops, selfs, spec.get("meta", {}))
        files.append("profile.db")
    else:
        files += write_text_summaries(out_dir, steps, ops)
    files.append(write_rank_summary(out_dir, trace, spec))
    return {"files": files, "steps_in_trace": [s["step"] for s in steps], "dropped": dropped,
            "events": len(events), "trace": files[0]}


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ondemand_prof.rank.postprocess")
    parser.add_argument("spec", help="JSON file with the post-processing spec")
    parser.add_argument("--nice", type=int, default=0, help="lower this process's priority by N")
    parser.add_argument("--parent", type=int, default=0, help="exit when this process (the rank) is gone")
    args = parser.parse_args(argv)
    if args.parent:
        die_with_parent(args.parent)
    if args.nice:
        try:
            os.nice(args.nice)  # leave the cores to the training run
        except OSError:
            pass
    with open(args.spec, encoding="utf-8") as fh:
        spec = json.load(fh)
    result = process(spec)
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
