"""What one rank's trace says: step times, the compute / communication / other split, top operators, memory.

Fed one event at a time (see tracefile.py). What must outlive the pass (the CPU operator tree, device kernels,
memory samples) is kept in typed arrays, about 24 bytes an event, not as dicts.

Definitions (the README's "Reports" section repeats them):
  * self time of a CPU operator: its duration minus its direct children's, over the tree of cpu_op and
    user_annotation events of its thread (what torch's key_averages() calls self CPU time);
  * per step, with device kernels in the trace: compute = time some compute kernel or memcpy runs,
    communication = time some collective kernel (NCCL/HCCL) runs, overlap = both, other = neither (idle);
  * per step, CPU only: communication = time inside a collective call (gloo/NCCL/c10d), compute = time inside
    any other operator, other = the rest of the step (Python, data loading, sleeping).
"""

from __future__ import annotations

import bisect
import re
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..rank.postprocess import CPU_TREE_CATS, DEVICE_CATS, STEP_RE, thread_self_times

# collectives: NCCL kernels, gloo/NCCL/HCCL ranges torch records, c10d ops, and the ranges around them
COMM_RE = re.compile(r"nccl|gloo|hccl|hcom|c10d::|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|"
                     r"all_?to_?all|broadcast|barrier", re.IGNORECASE)
MEMORY_POINTS = 1000


def is_comm(name: str) -> bool:
    return COMM_RE.search(name) is not None


@dataclass
class StepRow:
    step: int
    ts: float
    dur_us: float
    compute_us: float = 0.0
    comm_us: float = 0.0
    overlap_us: float = 0.0
    other_us: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "start_us": self.ts, "dur_ms": self.dur_us / 1000, "compute_ms": self.compute_us / 1000,
                "comm_ms": self.comm_us / 1000, "overlap_ms": self.overlap_us / 1000, "other_ms": self.other_us / 1000}


@dataclass
class _Thread:
    ts: array = field(default_factory=lambda: array("d"))
    dur: array = field(default_factory=lambda: array("d"))
    name: array = field(default_factory=lambda: array("i"))
    is_op: array = field(default_factory=lambda: array("b"))


class RankAnalyzer:
    def __init__(self) -> None:
        self.names: dict[str, int] = {}
        self.name_list: list[str] = []
        self.threads: dict[tuple[Any, Any], _Thread] = defaultdict(_Thread)
        self.steps: list[tuple[int, float, float, Any]] = []  # (step, ts, dur, thread key)
        self.dev_ts, self.dev_dur, self.dev_name = array("d"), array("d"), array("i")
        self.dev_comm = array("b")
        self.mem: dict[tuple[Any, Any], dict[str, Any]] = {}
        self.mem_ts, self.mem_alloc, self.mem_dev = array("d"), array("d"), array("i")
        self.mem_devices: list[tuple[Any, Any]] = []
        self.events = 0
        self.distributed: dict[str, Any] = {}

    def _name_id(self, name: str) -> int:
        i = self.names.get(name)
        if i is None:
            i = self.names[name] = len(self.name_list)
            self.name_list.append(name)
        return i

    def feed(self, events: Iterable[dict[str, Any]]) -> None:
        threads, name_id = self.threads, self._name_id
        for ev in events:
            self.events += 1
            ph = ev.get("ph")
            cat = ev.get("cat")
            if ph == "X":
                name = ev.get("name")
                if not isinstance(name, str):
                    name = str(name)
                try:
                    ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
                except (KeyError, TypeError, ValueError):
                    continue
                if cat in CPU_TREE_CATS:
                    key = (ev.get("pid"), ev.get("tid"))
                    t = threads[key]
                    t.ts.append(ts)
                    t.dur.append(dur)
                    t.name.append(name_id(name))
                    t.is_op.append(cat == "cpu_op")
                    if name.startswith("ProfilerStep#"):
                        m = STEP_RE.match(name)
                        if m:
                            self.steps.append((int(m.group(1)), ts, dur, key))
                elif cat in DEVICE_CATS:
                    self.dev_ts.append(ts)
                    self.dev_dur.append(dur)
                    self.dev_name.append(name_id(name))
                    self.dev_comm.append(cat == "kernel" and is_comm(name))
            elif ph in ("i", "I") and ev.get("name") == "[memory]":
                self._memory(ev)

    def _memory(self, ev: dict[str, Any]) -> None:
        a = ev.get("args") or {}
        key = (a.get("Device Type"), a.get("Device Id"))
        m = self.mem.get(key)
        if m is None:
            m = self.mem[key] = {"device_type": key[0], "device_id": key[1], "peak_allocated": 0, "peak_reserved": 0,
                                 "allocs": 0, "alloc_bytes": 0, "frees": 0, "freed_bytes": 0}
            self.mem_devices.append(key)
        nbytes = a.get("Bytes") or 0
        if nbytes > 0:
            m["allocs"] += 1
            m["alloc_bytes"] += nbytes
        elif nbytes < 0:
            m["frees"] += 1
            m["freed_bytes"] -= nbytes
        alloc = a.get("Total Allocated") or 0
        m["peak_allocated"] = max(m["peak_allocated"], alloc)
        m["peak_reserved"] = max(m["peak_reserved"], a.get("Total Reserved") or 0)
        self.mem_ts.append(float(ev.get("ts", 0.0)))
        self.mem_alloc.append(float(alloc))
        self.mem_dev.append(self.mem_devices.index(key))

    # ------------------------------------------------------------------------------------------------------

    def result(self, top: int = 15) -> dict[str, Any]:
        ops, annotations = self._operators()
        steps = self._step_rows()
        kernels = self._kernels()
        out: dict[str, Any] = {
            "events": self.events,
            "steps": [s.as_dict() for s in steps],
            "top_self": sorted(ops, key=lambda r: -r["self_us"])[:top],
            "top_total": sorted(ops, key=lambda r: -r["total_us"])[:top],
            "top_kernels": sorted(kernels, key=lambda r: -r["total_us"])[:top],
            "operators": len(ops),
            "cpu_self_total_us": sum(r["self_us"] for r in ops),
            "annotations": sorted(annotations, key=lambda r: -r["total_us"])[:top],
            "basis": "device" if len(self.dev_ts) else "cpu",
            "memory": self._memory_result(),
        }
        total = sum(s.dur_us for s in steps)
        if steps and total > 0:
            out["step_ms_mean"] = total / len(steps) / 1000
            out["step_ms_max"] = max(s.dur_us for s in steps) / 1000
            out["compute_pct"] = 100 * sum(s.compute_us for s in steps) / total
            out["comm_pct"] = 100 * sum(s.comm_us for s in steps) / total
            out["overlap_pct"] = 100 * sum(s.overlap_us for s in steps) / total
            out["other_pct"] = 100 * sum(s.other_us for s in steps) / total
        return out

    def operator_self_times(self) -> dict[str, float]:
        """name -> total self time (us) of cpu_op events; what the correctness test compares to key_averages()."""
        ops, _ = self._operators()
        return {r["name"]: r["self_us"] for r in ops}

    def _operators(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        agg: dict[tuple[int, bool], list[float]] = {}
        for t in self.threads.values():
            selfs = thread_self_times(t.ts, t.dur)
            for i in range(len(t.ts)):
                row = agg.get((t.name[i], bool(t.is_op[i])))
                if row is None:
                    row = agg[(t.name[i], bool(t.is_op[i]))] = [0, 0.0, 0.0]
                row[0] += 1
                row[1] += t.dur[i]
                row[2] += selfs[i]
        ops: list[dict[str, Any]] = []
        annotations: list[dict[str, Any]] = []
        for (nid, is_op), (calls, total, self_us) in agg.items():
            name = self.name_list[nid]
            entry = {"name": name, "calls": int(calls), "total_us": total, "self_us": self_us,
                     "avg_us": total / calls, "comm": is_comm(name)}
            if is_op:
                ops.append(entry)
            elif not name.startswith("ProfilerStep#"):
                annotations.append(entry)
        return ops, annotations

    def _kernels(self) -> list[dict[str, Any]]:
        agg: dict[int, list[float]] = {}
        for i in range(len(self.dev_ts)):
            row = agg.get(self.dev_name[i])
            if row is None:
                row = agg[self.dev_name[i]] = [0, 0.0, bool(self.dev_comm[i])]
            row[0] += 1
            row[1] += self.dev_dur[i]
        return [{"name": self.name_list[nid], "calls": int(c), "total_us": tot, "avg_us": tot / c, "comm": bool(comm)}
                for nid, (c, tot, comm) in agg.items()]

    def _step_rows(self) -> list[StepRow]:
        rows: list[StepRow] = []
        by_step: dict[int, tuple[int, float, float, Any]] = {}
        for s in self.steps:  # one row per step number (several threads may label it: keep the longest)
            if s[0] not in by_step or s[2] > by_step[s[0]][2]:
                by_step[s[0]] = s
        steps = sorted(by_step.values(), key=lambda s: s[1])
        if not steps:
            return rows
        device = len(self.dev_ts) > 0
        if device:
            compute = _merge((self.dev_ts[i], self.dev_ts[i] + self.dev_dur[i]) for i in range(len(self.dev_ts))
                             if not self.dev_comm[i])
            comm = _merge((self.dev_ts[i], self.dev_ts[i] + self.dev_dur[i]) for i in range(len(self.dev_ts))
                          if self.dev_comm[i])
        cpu_parts = {} if device else self._cpu_step_intervals(steps)
        for number, ts, dur, key in steps:
            end = ts + dur
            if not device:
                busy_iv, comm_iv = cpu_parts.get(number, ([], []))
                busy, comm_m = _merge(busy_iv), _merge(comm_iv)
                comm_us = _length(comm_m)
                compute_us = max(0.0, _length(busy) - comm_us)
                rows.append(StepRow(number, ts, dur, compute_us, comm_us, 0.0, max(0.0, dur - _length(busy))))
            else:
                c = _clip(compute, ts, end)
                m = _clip(comm, ts, end)
                both = _length(_intersect(c, m))
                union = _length(c) + _length(m) - both
                rows.append(StepRow(number, ts, dur, _length(c), _length(m), both, max(0.0, dur - union)))
        return rows

    def _cpu_step_intervals(self, steps: list[tuple[int, float, float, Any]]
                            ) -> dict[int, tuple[list[tuple[float, float]], list[tuple[float, float]]]]:
        """Per step: the intervals of operators on the step's thread, and of the collectives among them."""
        out: dict[int, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = {}
        by_thread: dict[Any, list[tuple[float, float, int]]] = defaultdict(list)
        for number, ts, dur, key in steps:
            by_thread[key].append((ts, ts + dur, number))
        comm_names = {i for i, n in enumerate(self.name_list) if is_comm(n)}
        step_names = {i for i, n in enumerate(self.name_list) if n.startswith("ProfilerStep#")}
        for key, spans in by_thread.items():
            spans.sort()
            starts = [a for a, _, _ in spans]
            t = self.threads[key]
            for i in range(len(t.ts)):
                a = t.ts[i]
                k = bisect.bisect_right(starts, a) - 1
                if k < 0 or a >= spans[k][1] or t.name[i] in step_names:
                    continue
                busy, comm = out.setdefault(spans[k][2], ([], []))
                iv = (a, min(spans[k][1], a + t.dur[i]))
                busy.append(iv)
                if t.name[i] in comm_names:
                    comm.append(iv)
        return out

    def _memory_result(self) -> dict[str, Any] | None:
        if not self.mem:
            return None
        devices = sorted(self.mem.values(), key=lambda m: -m["peak_allocated"])
        main = self.mem_devices.index((devices[0]["device_type"], devices[0]["device_id"]))
        idx = [i for i in range(len(self.mem_ts)) if self.mem_dev[i] == main]
        idx.sort(key=lambda i: self.mem_ts[i])
        series = peak_downsample([(self.mem_ts[i], self.mem_alloc[i]) for i in idx])
        return {"devices": devices, "series_device": devices[0]["device_type"], "series": series}


def peak_downsample(series: list[tuple[float, float]], points: int = MEMORY_POINTS) -> list[tuple[float, float]]:
    """At most `points` (time, value) samples, keeping each bucket's peak so that a chart never hides one."""
    if len(series) <= points:
        return series
    size = len(series) / points
    return [max(series[int(k * size):int((k + 1) * size)] or [series[-1]], key=lambda p: p[1])
            for k in range(points)]


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    i = max(0, bisect.bisect_left(intervals, (lo, lo)) - 1)
    out = []
    while i < len(intervals) and intervals[i][0] < hi:
        a, b = intervals[i]
        a, b = max(a, lo), min(b, hi)
        if b > a:
            out.append((a, b))
        i += 1
    return out


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out
