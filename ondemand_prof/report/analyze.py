"""What one rank's trace says: step times, the compute / communication / overlap / idle split, top operators,
top device kernels, memory.

Fed one event at a time (see tracefile.py). What must outlive the pass (the CPU operator tree, device kernels,
launches, memory samples) is kept in typed arrays, a few dozen bytes an event, not as dicts.

Definitions (docs/reports.md repeats them):
  * self time of a CPU operator: its duration minus its direct children's, over the tree of cpu_op and
    user_annotation events of its thread (what torch's key_averages() calls self CPU time);
  * a device kernel belongs to the step whose CPU op launched it (its runtime call's correlation id, or torch_npu's
    connection id), as HTA attributes kernels; a kernel whose launch is not in the file belongs to the CPU step
    its start falls in. A step's device window runs from its first kernel's start to the next step's first
    kernel's start (the last: to its last kernel's end), so windows tile the device timeline and a GPU that waits
    for the CPU shows as idle in the step it waits in;
  * per step with device kernels, over the window: compute = some compute kernel or memcpy runs and no collective,
    communication = a collective runs and no compute (exposed), overlap = both, idle = neither; the four add up to
    the window;
  * per step, CPU only (gloo, CPU training): a collective runs = a collective operator or range is open on ANY
    thread of the trace (gloo runs its all_reduce on its own worker threads while the training thread goes on);
    the step's thread works = it is inside an operator (cpu_op; a record_function label is not work: the thread
    may wait inside one) that is not (inside) a collective. compute = works and no
    collective, communication = a collective and the thread does not work (exposed: it waits), overlap = both,
    idle = neither (Python, data loading, sleeping); the four add up to the step;
  * communication is what classify.COMM_LIBRARIES names; per library, the time some of its kernels (device) or
    collectives (CPU) run inside the steps is reported too, so the split says what it counted. Libraries nest
    (c10d's operator issues gloo's range; record_param_comms encloses both): their times are not additive;
  * per collective kind (all_gather, reduce_scatter, all_reduce ...: classify.collective_kind), the calls and the
    time some transfer of that kind runs inside the steps, from the library that runs it (a backend: NCCL kernels,
    gloo's ranges, HCCL tasks ...), each taking the kind of the c10d or functional operator that issued it where
    one did (FSDP's reduce_scatter, which gloo runs as an all_reduce, is a reduce_scatter): on the device, the
    operator around the kernel's launch; on the CPU, gloo's ranges are matched to the c10d operators in the order
    they were issued (its work queue is first in, first out). Nested ranges of one kind count once; different
    kinds can overlap one another (a prefetched all_gather beside a reduce_scatter);
  * step_ops: the operators (self and total time, calls) and kernels (time, calls) of the events inside the
    steps, summed over them (operators by the step their start falls in, on any thread; kernels by the step that launched
    them): what a comparison with a baseline (compare.py) matches by name.
"""

from __future__ import annotations

import bisect
import collections
import math
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from ..core.tracedefs import ASYNC, CPU_TREE_CATS, DEVICE_CATS, STEP_RE, thread_tree
from .checks import MAX_DEVICE, bounded_name, one_line
from . import pipeline
from .classify import (BACKEND_LIBRARIES, CATEGORY_ALIASES, DEVICE_PROCESSES, LAUNCH_CATS, LAUNCH_FLOWS,
                       NPU_LISTED_TASKS, P2P_KINDS, collective_kind, comm_library, device_name, is_comm, kernel_group)
from .timeline import DEFAULT_GROUP, encode, group_of_args, in_steps, shifted
from .tracefile import TraceError, TraceReader

MEMORY_POINTS = 1000
SHARES = ("compute", "comm", "overlap", "idle")
# per_step's tables (what a comparison with a baseline matches by name): the operators with the most self time and
# the kernels with the most time inside the steps; a table this long holds every name of most training steps
PER_STEP_OPS, PER_STEP_KERNELS = 300, 300
# ... of which the first rows carry their time in each step (a comparison's significance needs the spread)
PER_STEP_SERIES = 64
# what a device event is: compute (a kernel, a copy), communication, or a task only listed in the kernel tables and
# counted in neither (torch_npu's event records and waits, async copies: what torch_npu's own split leaves out)
COMPUTE, COMM, LISTED = 0, 1, 2

__all__ = ["RankAnalyzer", "StepRow", "analyze_trace_file", "is_comm", "peak_downsample", "round_shares", "SHARES"]


@dataclass
class StepRow:
    step: int
    ts: float | None         # None: torch_npu's step table without a start (ascend.py)
    dur_us: float            # the ProfilerStep#N event's duration (CPU)
    window_us: float = 0.0   # what the split covers: the device window, or the CPU step
    compute_us: float = 0.0
    comm_us: float = 0.0     # exposed: not overlapped by compute
    overlap_us: float = 0.0
    idle_us: float = 0.0
    comm_total_us: float = 0.0
    kernel_us: float = 0.0   # summed durations of the device events that belong to the step

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "start_us": self.ts, "dur_ms": self.dur_us / 1000,
                "window_ms": self.window_us / 1000, "compute_ms": self.compute_us / 1000,
                "comm_ms": self.comm_us / 1000, "overlap_ms": self.overlap_us / 1000, "idle_ms": self.idle_us / 1000,
                "comm_total_ms": self.comm_total_us / 1000, "kernel_ms": self.kernel_us / 1000}


@dataclass
class _Thread:
    ts: array = field(default_factory=lambda: array("d"))
    dur: array = field(default_factory=lambda: array("d"))
    name: array = field(default_factory=lambda: array("i"))
    is_op: array = field(default_factory=lambda: array("b"))


@dataclass
class _Timed:
    """Complete events of one kind: start, duration, name id, a correlation key (-1: none), a pid index."""
    ts: array = field(default_factory=lambda: array("d"))
    dur: array = field(default_factory=lambda: array("d"))
    name: array = field(default_factory=lambda: array("i"))
    corr: array = field(default_factory=lambda: array("q"))
    pid: array = field(default_factory=lambda: array("i"))
    comm: array = field(default_factory=lambda: array("b"))

    def add(self, ts: float, dur: float, name: int, corr: int, pid: int = 0, comm: int = COMPUTE) -> None:
        """`comm`: COMPUTE, COMM or LISTED (a bool is COMPUTE or COMM)."""
        self.ts.append(ts)
        self.dur.append(dur)
        self.name.append(name)
        self.corr.append(corr)
        self.pid.append(pid)
        self.comm.append(int(comm))


def _corr(args: Any, key: str) -> int:
    if not isinstance(args, dict):
        return -1
    value = args.get(key)
    try:
        return int(value) if value is not None else -1
    except (TypeError, ValueError):
        return -1


class RankAnalyzer:
    def __init__(self) -> None:
        self.names: dict[str, int] = {}
        self.name_list: list[str] = []
        self.threads: dict[tuple[Any, Any], _Thread] = defaultdict(_Thread)
        self.steps: list[tuple[int, float, float, Any]] = []  # (step, ts, dur, thread key)
        self.dev = _Timed()        # kernels, memcpy, memset
        self.launches = _Timed()   # runtime calls that launch them (correlation id -> CPU time; pid: the thread)
        self.loose = _Timed()      # complete events without a category (torch_npu): sorted out by process name
        # torch_npu's operator -> device task flows: id, time, and whether this end is the task's (else the op's)
        self.flow_id, self.flow_ts, self.flow_at_task = array("q"), array("d"), array("b")
        self.pids: dict[Any, int] = {}
        self.thread_ids: dict[Any, int] = {}  # (pid, tid) -> an index (what a launch records of its thread)
        self.process_names: dict[Any, str] = {}
        self.mem: dict[tuple[Any, Any], dict[str, Any]] = {}
        self.mem_running: dict[tuple[Any, Any], float] = {}
        self.mem_ts, self.mem_alloc, self.mem_dev = array("d"), array("d"), array("i")
        self.mem_devices: list[tuple[Any, Any]] = []
        self.events = 0
        # name id -> library, for communication known by where it runs rather than by name (torch_npu's HCCL tasks)
        self.library_of: dict[int, str] = {}
        # the process group of a collective, where the trace names it (timeline.py): a device event's index, or a
        # record_param_comms event's (thread, start) -> group name; group name -> its ranks
        self.group_of: dict[Any, str] = {}
        self.group_ranks: dict[str, list[int]] = {}
        # each thread's tree and self times (core/tracedefs.thread_tree: an event's parent, or ASYNC), made when a
        # result is
        self._trees: dict[tuple[Any, Any], tuple[array, array]] = {}

    def _name_id(self, name: str) -> int:
        i = self.names.get(name)
        if i is None:
            i = self.names[name] = len(self.name_list)
            self.name_list.append(bounded_name(name))  # (a summary's and a comparison's bound on names)
        return i

    def _pid(self, pid: Any) -> int:
        i = self.pids.get(pid)
        if i is None:
            i = self.pids[pid] = len(self.pids)
        return i

    def feed(self, events: Iterable[dict[str, Any]]) -> None:
        for ev in events:
            self.events += 1
            ph = ev.get("ph")
            if ph == "X":
                self._complete(ev)
            elif ph in ("i", "I") and ev.get("name") == "[memory]":
                self._memory(ev)
            elif ph == "M" and ev.get("name") == "process_name":
                self.process_names[ev.get("pid")] = str((ev.get("args") or {}).get("name"))
            elif ph in ("s", "f") and ev.get("cat") in LAUNCH_FLOWS:
                self._flow(ev, ph)

    def _complete(self, ev: dict[str, Any]) -> None:
        name = ev.get("name")
        if not isinstance(name, str):
            name = str(name)
        try:  # torch_npu writes ts as a string ("1704161511420306.491")
            ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            return
        cat: Any = ev.get("cat")  # whatever JSON value the file has; the aliases map the strings they know
        cat = CATEGORY_ALIASES.get(cat, cat)
        if cat in CPU_TREE_CATS:
            key = (ev.get("pid"), ev.get("tid"))
            t = self.threads[key]
            t.ts.append(ts)
            t.dur.append(dur)
            t.name.append(self._name_id(name))
            step = STEP_RE.match(name) if name.startswith("ProfilerStep#") else None
            t.is_op.append(cat == "cpu_op" and step is None)  # torch_npu and old Kineto: steps are cpu_op/Operator
            if step:
                self.steps.append((int(step.group(1)), ts, dur, key))
            elif name == "record_param_comms":
                self._note_group(ev.get("args"), (key, ts))
        elif cat in DEVICE_CATS:
            comm = cat == "kernel" and is_comm(name)
            self.device_event(ts, dur, name, _corr(ev.get("args"), "correlation"), comm)
            if comm:
                self._note_group(ev.get("args"), len(self.dev.ts) - 1)
        elif cat in LAUNCH_CATS:
            self.launch_event(ts, _corr(ev.get("args"), "correlation"), (ev.get("pid"), ev.get("tid")))
        elif cat is None:
            self.loose.add(ts, dur, self._name_id(kernel_group(name)), -1, self._pid(ev.get("pid")), is_comm(name))

    def device_event(self, ts: float, dur: float, name: str, correlation: int, comm: bool,
                     listed: bool = False) -> None:
        """A kernel, memcpy or collective on the device; `correlation` joins it to its launch (-1: unknown);
        `listed`: a task in the kernel tables that the split counts in neither compute nor communication."""
        kind = LISTED if listed else COMM if comm else COMPUTE
        self.dev.add(ts, dur, self._name_id(kernel_group(name)), correlation, comm=kind)

    def _note_group(self, args: Any, where: Any) -> None:
        """Record the process group a collective's args name (newer torch: "Process Group Name" and "Process Group
        Ranks" on record_param_comms and on NCCL kernels)."""
        found = group_of_args(args)
        if found is not None:
            name, ranks = found
            self.group_of[where] = name
            if ranks is not None:
                self.group_ranks.setdefault(name, ranks)

    def set_library(self, name: str, library: str) -> None:
        """Count device events named `name` as `library`'s communication (torch_npu's COMMUNICATION_OP names)."""
        self.library_of.setdefault(self._name_id(kernel_group(name)), library)

    def launch_event(self, ts: float, correlation: int, thread: Any = None) -> None:
        """A CPU-side call that launched device work, at `ts`, on `thread` (a (pid, tid) key, when known)."""
        if correlation >= 0:
            self.launches.add(ts, 0.0, 0, correlation, self._thread_index(thread) if thread is not None else -1)

    def _thread_index(self, key: Any) -> int:
        i = self.thread_ids.get(key)
        if i is None:
            i = self.thread_ids[key] = len(self.thread_ids)
        return i

    def _flow(self, ev: dict[str, Any], ph: str) -> None:
        """torch_npu links an operator to each device task it launched by a flow: it starts at the op and finishes
        at the task."""
        try:
            fid, ts = int(ev["id"]), float(ev["ts"])
        except (KeyError, TypeError, ValueError):
            return
        self.flow_id.append(fid)
        self.flow_ts.append(ts)
        self.flow_at_task.append(ph == "f")

    def _memory(self, ev: dict[str, Any]) -> None:
        a = ev.get("args") or {}
        key = (a.get("Device Type"), a.get("Device Id"))
        m = self.mem.get(key)
        if m is None:
            m = self.mem[key] = {"device": device_name(*key), "device_type": key[0], "device_id": key[1],
                                 "peak_allocated": 0, "peak_reserved": None, "allocs": 0, "alloc_bytes": 0,
                                 "frees": 0, "freed_bytes": 0, "derived": False}
            self.mem_devices.append(key)
            self.mem_running[key] = 0.0
        nbytes = _number(a.get("Bytes"))
        if nbytes > 0:
            m["allocs"] += 1
            m["alloc_bytes"] += nbytes
        elif nbytes < 0:
            m["frees"] += 1
            m["freed_bytes"] -= nbytes
        self.mem_running[key] += nbytes
        if "Total Allocated" in a:
            alloc = _number(a.get("Total Allocated"))
        else:  # Kineto before torch 1.10 records only the change: the total is the running sum since the start
            alloc = self.mem_running[key]
            m["derived"] = True
        m["peak_allocated"] = max(m["peak_allocated"], alloc)
        if "Total Reserved" in a:
            m["peak_reserved"] = max(m["peak_reserved"] or 0, _number(a.get("Total Reserved")))
        self.mem_ts.append(_number(ev.get("ts")))
        self.mem_alloc.append(float(alloc))
        self.mem_dev.append(self.mem_devices.index(key))

    # ------------------------------------------------------------------------------------------------------

    def result(self, top: int = 15) -> dict[str, Any]:
        self._sort_loose()
        self._trees = {key: thread_tree(t.ts, t.dur) for key, t in self.threads.items()}
        ordered = self._ordered_steps()
        ops, annotations, in_steps, by_step = self._operators(ordered)
        steps, attribution, libraries, member, bounds = self._step_rows(ordered)
        kernels = self._kernels()
        transfers = list(self._device_transfers(ordered, member) if member is not None else
                         self._cpu_transfers(ordered)) if ordered else []
        out: dict[str, Any] = {
            "events": self.events,
            "steps": [s.as_dict() for s in steps],
            "top_self": sorted(ops, key=lambda r: -r["self_us"])[:top],
            "top_total": sorted(ops, key=lambda r: -r["total_us"])[:top],
            "top_kernels": sorted(kernels, key=lambda r: -r["total_us"])[:top],
            "operators": len(ops),
            "cpu_self_total_us": sum(r["self_us"] for r in ops),
            "annotations": sorted(annotations, key=lambda r: -r["total_us"])[:top],
            "basis": "device" if len(self.dev.ts) else "cpu",
            "kernel_steps": attribution,
            "comm_libraries": libraries,
            "collectives": self._collectives(ordered, member, transfers),
            "step_ops": self._step_ops(ordered, in_steps, member, by_step),
            "timeline": self._timeline(ordered, bounds, transfers),
            "pipeline": self._pipeline(ordered, bounds),
            "memory": self._memory_result(),
        }
        out.update(step_summary(steps))
        return out

    def operator_self_times(self) -> dict[str, float]:
        """name -> total self time (us) of cpu_op events; what the correctness test compares to key_averages()."""
        self._trees = {key: thread_tree(t.ts, t.dur) for key, t in self.threads.items()}
        ops, _, _, _ = self._operators(self._ordered_steps())
        return {r["name"]: r["self_us"] for r in ops}

    def _sort_loose(self) -> None:
        """Uncategorised events (torch_npu) become device tasks or launches by the process they are in."""
        if not len(self.loose.ts):
            return
        by_index = {i: self.process_names.get(pid, "") for pid, i in self.pids.items()}
        ids, times, at_task = self.flow_id, self.flow_ts, self.flow_at_task
        flow_at = {times[i]: ids[i] for i in range(len(ids)) if at_task[i]}  # a task's start -> its flow's id
        for i in range(len(ids)):
            if not at_task[i]:  # the operator's end of the flow: the launch
                self.launches.add(times[i], 0.0, 0, ids[i])
        lo = self.loose
        hccl = {(lo.ts[i], lo.dur[i]) for i in range(len(lo.ts)) if by_index.get(lo.pid[i]) == "HCCL"}
        for i in range(len(lo.ts)):
            process = by_index.get(lo.pid[i], "")
            if process not in DEVICE_PROCESSES:
                continue
            if process != "HCCL" and (lo.ts[i], lo.dur[i]) in hccl:
                continue  # the hardware track's copy of an HCCL task ("Notify Wait" of Notify_Wait): counted once
            comm = DEVICE_PROCESSES[process] or bool(lo.comm[i])
            if comm and not lo.comm[i]:  # Notify_Wait, Memcpy ... under the HCCL process
                self.library_of[lo.name[i]] = "HCCL"
            kind = COMM if comm else LISTED if self.name_list[lo.name[i]] in NPU_LISTED_TASKS else COMPUTE
            # (the task's flow id is found by its start: a copy dropped above passes its launch to the HCCL task)
            self.dev.add(lo.ts[i], lo.dur[i], lo.name[i], flow_at.get(lo.ts[i], -1), comm=kind)
        self.loose = _Timed()
        self.flow_id, self.flow_ts, self.flow_at_task = array("q"), array("d"), array("b")

    def _operators(self, steps: list[tuple[int, float, float, Any]]
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[int, list[float]],
                              dict[int, dict[int, float]]]:
        """Every operator and annotation of the trace (calls, total, self); of the operators whose start falls
        inside a step, name id -> [calls, total, self] (per_step); and name id -> {step index: self time}."""
        agg: dict[tuple[int, bool], list[float]] = {}
        in_steps: dict[int, list[float]] = {}
        by_step: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        step_of = _step_finder(steps)
        for key, t in self.threads.items():
            selfs = self._trees[key][1]
            for i in range(len(t.ts)):
                row = agg.get((t.name[i], bool(t.is_op[i])))
                if row is None:
                    row = agg[(t.name[i], bool(t.is_op[i]))] = [0, 0.0, 0.0]
                row[0] += 1
                row[1] += t.dur[i]
                row[2] += selfs[i]
                k = step_of(t.ts[i]) if t.is_op[i] else -1
                if k >= 0:
                    mine = in_steps.get(t.name[i])
                    if mine is None:
                        mine = in_steps[t.name[i]] = [0, 0.0, 0.0]
                    mine[0] += 1
                    mine[1] += t.dur[i]
                    mine[2] += selfs[i]
                    by_step[t.name[i]][k] += selfs[i]
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
        return ops, annotations, in_steps, by_step

    def _kernels(self) -> list[dict[str, Any]]:
        agg: dict[int, list[float]] = {}
        d = self.dev
        for i in range(len(d.ts)):
            row = agg.get(d.name[i])
            if row is None:
                row = agg[d.name[i]] = [0, 0.0, d.comm[i] == COMM]
            row[0] += 1
            row[1] += d.dur[i]
        return [{"name": self.name_list[nid], "calls": int(c), "total_us": tot, "avg_us": tot / c, "comm": bool(comm)}
                for nid, (c, tot, comm) in agg.items()]

    def _ordered_steps(self) -> list[tuple[int, float, float, Any]]:
        by_step: dict[int, tuple[int, float, float, Any]] = {}
        for s in self.steps:  # one row per step number (several threads may label it: keep the longest)
            if s[0] not in by_step or s[2] > by_step[s[0]][2]:
                by_step[s[0]] = s
        return sorted(by_step.values(), key=lambda s: s[1])

    def _step_rows(self, steps: list[tuple[int, float, float, Any]]
                   ) -> tuple[list[StepRow], dict[str, int], list[dict[str, Any]], array | None,
                              dict[int, tuple[float, float]] | None]:
        """The steps' split, how kernels were placed in steps, the libraries' times, each device event's step
        (an index into `steps`, -1: none; None without device events), and each step's device window."""
        if not steps:
            return [], {}, [], None, None
        if not len(self.dev.ts):
            rows, libraries = self._cpu_rows(steps)
            return rows, {}, libraries, None, None
        member, attribution = self._kernel_steps(steps)
        rows, bounds = _device_rows(steps, self.dev, member)
        return rows, attribution, self._device_libraries(member, bounds), member, bounds

    def _library(self, nid: int) -> str:
        return self.library_of.get(nid) or comm_library(self.name_list[nid]) or "other"

    def _device_libraries(self, member: array, bounds: dict[int, tuple[float, float]]) -> list[dict[str, Any]]:
        """Per communication library: kernels in the steps, and the time some of them run inside the windows."""
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        d = self.dev
        for i in range(len(d.ts)):
            if d.comm[i] == COMM and member[i] >= 0:
                spans[self._library(d.name[i])].append((d.ts[i], d.ts[i] + d.dur[i]))
        windows = sorted(bounds.values())
        return _library_rows(spans, windows, "kernels")

    def _kernel_steps(self, steps: list[tuple[int, float, float, Any]]) -> tuple[array, dict[str, int]]:
        """Index (into `steps`) of the step each device event belongs to, -1 for none; and how it was decided."""
        launched_at: dict[int, float] = {}
        la = self.launches
        for i in range(len(la.ts)):
            launched_at.setdefault(la.corr[i], la.ts[i])
        starts = [s[1] for s in steps]

        def step_at(t: float) -> int:
            k = bisect.bisect_right(starts, t) - 1
            return k if k >= 0 and t < steps[k][1] + steps[k][2] else -1

        d = self.dev
        member = array("i", [-1]) * len(d.ts)
        counts = {"by_launch": 0, "by_time": 0, "outside_steps": 0}
        for i in range(len(d.ts)):
            t = launched_at.get(d.corr[i]) if d.corr[i] >= 0 else None
            counts["by_time" if t is None else "by_launch"] += 1
            member[i] = step_at(d.ts[i] if t is None else t)
            counts["outside_steps"] += member[i] < 0
        return member, counts

    def _cpu_rows(self, steps: list[tuple[int, float, float, Any]]) -> tuple[list[StepRow], list[dict[str, Any]]]:
        """The CPU-only split of each step (module docstring): collectives on every thread, work on the step's."""
        comm_ids = {i for i, n in enumerate(self.name_list) if is_comm(n)}
        step_ids = {i for i, n in enumerate(self.name_list) if n.startswith("ProfilerStep#")}
        by_library: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for t in self.threads.values():
            for i in range(len(t.ts)):
                if t.name[i] in comm_ids:
                    by_library[self._library(t.name[i])].append((t.ts[i], t.ts[i] + t.dur[i]))
        comm_any = _merge(iv for spans in by_library.values() for iv in spans)
        ordered: dict[Any, tuple[list[int], list[float]]] = {}
        rows = []
        for number, ts, dur, key in steps:
            if key not in ordered:  # the thread's events by start time, once per thread
                t = self.threads[key]
                order = sorted(range(len(t.ts)), key=t.ts.__getitem__)
                ordered[key] = (order, [t.ts[i] for i in order])
            order, starts = ordered[key]
            t = self.threads[key]
            parents = self._trees[key][0]
            lo, hi = ts, ts + dur
            busy, own_comm = [], []
            for j in range(bisect.bisect_left(starts, lo), bisect.bisect_left(starts, hi)):
                i = order[j]
                if t.name[i] in step_ids:
                    continue
                iv = (t.ts[i], min(hi, t.ts[i] + t.dur[i]))
                if t.name[i] in comm_ids:
                    if parents[i] != ASYNC:  # (an asynchronous send's range: the thread goes on working inside it)
                        own_comm.append(iv)
                elif t.is_op[i]:  # a record_function label is not work: the thread may wait inside one
                    busy.append(iv)
            work = _subtract(_merge(busy), _merge(own_comm))  # inside an operator, not (inside) a collective
            comm = _clip(comm_any, lo, hi)
            lw, lc = _length(work), _length(comm)
            both = _length(_intersect(work, comm))
            rows.append(StepRow(number, ts, dur, dur, lw - both, lc - both, both, max(0.0, dur - (lw + lc - both)), lc))
        spans = sorted((ts, ts + dur) for _, ts, dur, _ in steps)
        return rows, _library_rows(by_library, _merge(spans), "operators")

    def _step_ops(self, steps: list[tuple[int, float, float, Any]], in_steps: dict[int, list[float]],
                  member: array | None, by_step: dict[int, dict[int, float]]) -> dict[str, Any]:
        """The operators and kernels inside the `steps` recorded steps (module docstring), longest first, summed
        over them: [name, calls, self us, total us] and [name, calls, us], the first PER_STEP_OPS /
        PER_STEP_KERNELS of each (`complete` says whether that is all of them); and of the first PER_STEP_SERIES
        rows of each, their time in each step (whole us: `ops_by_step`, `kernels_by_step`, row for row)."""
        n = len(steps)
        if not n:
            return {"steps": 0, "ops": [], "kernels": [], "complete": {"ops": True, "kernels": True}}
        order = sorted(in_steps, key=lambda k: -in_steps[k][2])
        ops = [[self.name_list[k], int(in_steps[k][0]), in_steps[k][2], in_steps[k][1]] for k in order]
        kernels: dict[int, list[float]] = {}
        kernel_steps: dict[int, list[float]] = {}
        d = self.dev
        for i in range(len(d.ts)):
            if member is not None and member[i] >= 0:
                row = kernels.get(d.name[i])
                if row is None:
                    row = kernels[d.name[i]] = [0, 0.0]
                    kernel_steps[d.name[i]] = [0.0] * n
                row[0] += 1
                row[1] += d.dur[i]
                kernel_steps[d.name[i]][member[i]] += d.dur[i]
        korder = sorted(kernels, key=lambda k: -kernels[k][1])
        krows = [[self.name_list[k], int(kernels[k][0]), kernels[k][1]] for k in korder]
        return {"steps": n, "ops": [_rounded(r) for r in ops[:PER_STEP_OPS]],
                "kernels": [_rounded(r) for r in krows[:PER_STEP_KERNELS]],
                "complete": {"ops": len(ops) <= PER_STEP_OPS, "kernels": len(krows) <= PER_STEP_KERNELS},
                "ops_by_step": [[round(by_step[k].get(j, 0.0)) for j in range(n)] for k in order[:PER_STEP_SERIES]],
                "kernels_by_step": [[round(x) for x in kernel_steps[k]] for k in korder[:PER_STEP_SERIES]]}

    def _collectives(self, steps: list[tuple[int, float, float, Any]], member: array | None,
                     transfers: list[Transfer]) -> list[dict[str, Any]]:
        """Per collective kind (module docstring): {kind, via, count, ms, count_per_step, ms_per_step,
        issued_by, ms_by_step}, longest first."""
        if not steps:
            return []
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        via: dict[str, set[str]] = defaultdict(set)
        issued: dict[str, dict[str, int]] = defaultdict(dict)
        for t in transfers:
            spans[t.kind].append((t.ts, t.end))
            via[t.kind].add(t.library)
            if t.issuer:
                issued[t.kind][t.issuer] = issued[t.kind].get(t.issuer, 0) + 1
        windows = _merge((ts, ts + dur) for _, ts, dur, _ in steps)
        n = len(steps)
        out = []
        for kind, ivs in spans.items():
            inside = [iv for iv in ivs if _clip(windows, iv[0], max(iv[1], iv[0] + 1e-9))] if member is None else ivs
            if not inside:
                continue
            merged = _merge(inside)
            per = [_length(_clip(merged, ts, ts + dur)) for _, ts, dur, _ in steps]
            us = sum(per)
            out.append({"kind": kind, "via": sorted(via[kind]), "count": len(inside), "ms": us / 1000,
                        "count_per_step": len(inside) / n, "ms_per_step": us / 1000 / n,
                        "issued_by": dict(sorted(issued[kind].items(), key=lambda kv: -kv[1])[:4]),
                        "ms_by_step": [round(x / 1000, 3) for x in per]})
        return sorted(out, key=lambda r: -r["ms"])

    def _timeline(self, steps: list[tuple[int, float, float, Any]], bounds: dict[int, tuple[float, float]] | None,
                  transfers: list[Transfer]) -> dict[str, Any] | None:
        """Each step's collectives, arrival and end (timeline.py), on the device's clock where the split is."""
        if not steps:
            return None
        origin = []
        for k, (number, ts, dur, _) in enumerate(steps):
            lo, hi = (ts, ts + dur) if bounds is None else bounds.get(k, (ts, ts))
            origin.append((number, lo, hi - lo))
        entries = ((t.step, t.kind, t.group, t.arrival, t.end) for t in transfers)
        return encode("cpu" if bounds is None else "device", in_steps(entries, origin), self.group_ranks)

    def _pipeline(self, steps: list[tuple[int, float, float, Any]], bounds: dict[int, tuple[float, float]] | None
                  ) -> dict[str, Any] | None:
        """The pipeline schedule (pipeline.py) from torch.distributed.pipelining's labels inside the steps: on the
        CPU, each label's time on its thread and the thread's work in it (an operator, not communication, as the
        split counts it); with device kernels, the kernels launched inside each label (by their launch's time, on
        any thread: CUDA's backward launches from the autograd engine's) and the compute kernels' time."""
        labels: dict[int, tuple[int | None, str, int]] = {}
        for nid, name in enumerate(self.name_list):
            if (act := pipeline.action_of(name)) is not None:
                labels[nid] = act
        if not labels or not steps:
            return None
        step_of = _step_finder(steps)
        p2p = {nid: collective_kind(name) for nid, name in enumerate(self.name_list)
               if comm_library(name) == "c10d" and collective_kind(name) in P2P_KINDS}
        found: list[tuple[Any, int, float, float, tuple[int | None, str, int]]] = []
        works: dict[Any, list[tuple[float, float]]] = {}
        issued: dict[Any, dict[str, list[float]]] = {}
        for key, t in self.threads.items():
            mine = [(step_of(t.ts[i]), t.ts[i], t.ts[i] + t.dur[i], labels[t.name[i]]) for i in range(len(t.ts))
                    if not t.is_op[i] and t.name[i] in labels]
            mine = [m for m in mine if m[0] >= 0]
            if not mine:
                continue
            found += [(key, *m) for m in mine]
            parents = self._trees[key][0]
            busy, own_comm = [], []
            sent: dict[str, list[float]] = {"send": [], "recv": [], "send/recv": []}
            for i in range(len(t.ts)):
                if t.name[i] in p2p:
                    sent[p2p[t.name[i]]].append(t.ts[i])
                if is_comm(self.name_list[t.name[i]]):
                    if parents[i] != ASYNC:  # (gloo's send in flight: the thread works on inside it)
                        own_comm.append((t.ts[i], t.ts[i] + t.dur[i]))
                elif t.is_op[i]:
                    busy.append((t.ts[i], t.ts[i] + t.dur[i]))
            works[key] = _subtract(_merge(busy), _merge(own_comm))
            issued[key] = {kind: sorted(v) for kind, v in sent.items()}
        if not found:
            return None

        def inside(times: list[float], lo: float, hi: float) -> bool:
            return bisect.bisect_left(times, lo) < bisect.bisect_right(times, hi)

        def flags(key: Any, lo: float, hi: float) -> tuple[bool, bool]:
            got = issued[key]
            both = inside(got["send/recv"], lo, hi)
            return both or inside(got["send"], lo, hi), both or inside(got["recv"], lo, hi)

        if bounds is None:  # the CPU: the labels of the thread that has most, and that thread's work
            main = max(works, key=lambda key: sum(1 for f in found if f[0] == key))
            actions = [pipeline.Action(k, stage, kind, mb, lo, hi, *flags(key, lo, hi))
                       for key, k, lo, hi, (stage, kind, mb) in found if key == main]
            work = works[main]
            origin = [(number, ts, dur) for number, ts, dur, _ in steps]
            return pipeline.schedule(actions, origin, lambda lo, hi: _length(_clip(work, lo, hi)), "cpu")
        # the device: each label's compute kernels (launched inside it), on the step's device window
        launched_at: dict[int, float] = {}
        la, d = self.launches, self.dev
        for i in range(len(la.ts)):
            launched_at.setdefault(la.corr[i], la.ts[i])
        kernels = sorted((launched_at[d.corr[i]], i) for i in range(len(d.ts))
                         if d.comm[i] == COMPUTE and d.corr[i] in launched_at)
        times = [x[0] for x in kernels]
        compute = _merge((d.ts[i], d.ts[i] + d.dur[i]) for i in range(len(d.ts)) if d.comm[i] == COMPUTE)
        device_actions = []
        for key, k, lo, hi, (stage, kind, mb) in found:
            own = [i for _, i in kernels[bisect.bisect_left(times, lo):bisect.bisect_right(times, hi)]]
            if own:
                device_actions.append(pipeline.Action(k, stage, kind, mb, min(d.ts[i] for i in own),
                                                      max(d.ts[i] + d.dur[i] for i in own), *flags(key, lo, hi)))
        windows = [(number, *bounds.get(k, (ts, ts))) for k, (number, ts, _, _) in enumerate(steps)]
        return pipeline.schedule(device_actions, [(number, lo, hi - lo) for number, lo, hi in windows],
                                 lambda lo, hi: _length(_clip(compute, lo, hi)), "device")

    def _device_transfers(self, steps: list[tuple[int, float, float, Any]], member: array) -> Iterable[Transfer]:
        """The communication kernels inside the steps: the kind of the c10d/functional operator around the
        kernel's launch on its thread, else the kernel's own; each arrives when it begins on its stream. torch_npu's
        HCCL tasks (Notify_Wait, Memcpy, Reduce_Inline on the HCCL planes) run inside their hcom_* operation: where
        the trace has those operations, the operations are the transfers (a task is not another collective)."""
        ops = {i for i, n in enumerate(self.name_list) if n.startswith("hcom_")}
        launched: dict[int, tuple[float, int]] = {}
        la = self.launches
        for i in range(len(la.ts)):
            launched.setdefault(la.corr[i], (la.ts[i], la.pid[i]))
        issuers = _Issuers(self, {i: k for k, i in self.thread_ids.items()})
        d = self.dev
        for i in range(len(d.ts)):
            if d.comm[i] != COMM or member[i] < 0:
                continue
            if ops and d.name[i] not in ops and self._library(d.name[i]) == "HCCL":
                continue  # an HCCL task of an operation counted as its operation
            name = self.name_list[d.name[i]]
            at = launched.get(d.corr[i]) if d.corr[i] >= 0 else None
            issuer = issuers.around(*at) if at is not None else None
            kind = collective_kind(issuer) if issuer else "other"
            if kind in ("other", "wait"):
                kind = collective_kind(name)
            yield Transfer(d.ts[i], d.ts[i] + d.dur[i], kind, self._library(d.name[i]), issuer, d.ts[i],
                           self.group_of.get(i, DEFAULT_GROUP), member[i])

    def _cpu_transfers(self, steps: list[tuple[int, float, float, Any]]) -> Iterable[Transfer]:
        """The collectives on the CPU: each backend range (gloo's, on its worker threads; one inside another backend
        range of its thread's tree once; an asynchronous one, such as gloo's send/recv work on the training thread,
        each), matched to the c10d operators first in, first out (each range takes the earliest unmatched operator
        issued before it started): a point-to-point range takes an operator of its own direction (a send's range
        never a recv, nor a collective), a collective's range a collective's operator (its kind may differ: gloo
        runs FSDP's reduce_scatter as an all_reduce); where no backend range is in the trace, the outermost c10d
        operators themselves. A collective arrives when its c10d operator began (the rank was ready), in the step
        that holds that."""
        backend: list[tuple[float, float, int]] = []
        issuing: list[tuple[float, float, int, str]] = []
        for key, t in self.threads.items():
            parents = self._trees[key][0]
            groups = _Groups(self.group_of, key)
            in_backend = array("b", [0]) * len(t.ts)  # inside a backend range of this thread (parents come first)
            for i in sorted(range(len(t.ts)), key=lambda i: (t.ts[i], -t.dur[i])):
                name = self.name_list[t.name[i]]
                library = comm_library(name)
                p = parents[i]
                inside = p >= 0 and bool(in_backend[p])
                if library in BACKEND_LIBRARIES:
                    in_backend[i] = 1
                    if not inside:
                        backend.append((t.ts[i], t.ts[i] + t.dur[i], t.name[i]))
                else:
                    in_backend[i] = inside
                    if library == "c10d" and collective_kind(name) not in ("other", "wait"):
                        issuing.append((t.ts[i], t.ts[i] + t.dur[i], t.name[i],
                                        groups.within(t.ts[i], t.ts[i] + t.dur[i])))
        if not backend:  # (an older torch, or a backend we do not know): the operators are all there is
            backend, issuing = [(a, b, n) for a, b, n, _ in issuing], [(a, b, n, g) for a, b, n, g in issuing]
        backend.sort()
        issuing.sort()
        queues: dict[str, collections.deque[tuple[float, float, int, str]]] = defaultdict(collections.deque)
        step_of = _step_finder(steps)
        j = 0
        for ts, end, nid in backend:
            while j < len(issuing) and issuing[j][0] <= ts:
                kind = collective_kind(self.name_list[issuing[j][2]])
                queues[kind if kind in P2P_KINDS else ""].append(issuing[j])
                j += 1
            name = self.name_list[nid]
            own = collective_kind(name)
            queue = queues[own] if own in P2P_KINDS and queues[own] else queues["send/recv"] if own in P2P_KINDS \
                else queues[""]
            op = queue.popleft() if queue else None
            issuer = self.name_list[op[2]] if op else None
            kind = collective_kind(issuer) if issuer else own
            arrival = op[0] if op else ts
            yield Transfer(ts, end, kind, self._library(nid), issuer, arrival, op[3] if op else DEFAULT_GROUP,
                           step_of(arrival))

    def _memory_result(self) -> dict[str, Any] | None:
        if not self.mem:
            return None
        devices = sorted(self.mem.values(), key=lambda m: -m["peak_allocated"])
        main = self.mem_devices.index((devices[0]["device_type"], devices[0]["device_id"]))
        idx = [i for i in range(len(self.mem_ts)) if self.mem_dev[i] == main]
        idx.sort(key=lambda i: self.mem_ts[i])
        series = peak_downsample([(self.mem_ts[i], self.mem_alloc[i]) for i in idx])
        return {"devices": devices, "series_device": devices[0]["device"], "series": series}


def analyze_trace_file(trace: Path, out: dict[str, Any], top: int) -> None:
    """Fill `out` with one trace's analysis; a trace cut short adds a warning, one with no event raises."""
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
    shift_to_epoch(out, reader.header.get("baseTimeNanoseconds"))
    info = reader.header.get("distributedInfo")
    info = info if isinstance(info, dict) else {}
    if out.get("rank") is None and isinstance(info.get("rank"), int):
        out["rank"] = info["rank"]
    if out.get("world_size") is None and isinstance(info.get("world_size"), int):
        out["world_size"] = info["world_size"]
    device = device_of(reader.header.get("deviceProperties"))
    if device and out.get("device") is None:
        out["device"] = device


def device_of(properties: Any) -> str | None:
    """The device a Kineto trace ran on, from its header's deviceProperties ("NVIDIA H100 80GB HBM3"; the distinct
    names joined where a host mixes them), one line of at most MAX_DEVICE characters; None where it names none.
    A comparison says so where the two sides ran on different devices (their kernels do not match by name)."""
    if not isinstance(properties, list):
        return None
    names = sorted({p["name"].strip() for p in properties if isinstance(p, dict) and isinstance(p.get("name"), str)
                    and p["name"].strip()})
    return one_line(", ".join(names))[:MAX_DEVICE] if names else None


def shift_to_epoch(result: dict[str, Any], base_ns: Any) -> None:
    """A trace whose ts are relative to a base (baseTimeNanoseconds): its steps' starts and its timeline moved to
    wall-clock time, so that ranks' times compare."""
    if not isinstance(base_ns, (int, float)) or isinstance(base_ns, bool) or not 0 < base_ns < 1e20:
        return
    for step in result.get("steps") or []:
        step["start_us"] += base_ns / 1000
    if result.get("timeline"):
        result["timeline"] = shifted(result["timeline"], base_ns / 1000)


def _rounded(row: list[Any]) -> list[Any]:
    return [row[0], row[1], *(round(x, 3) for x in row[2:])]


def _step_finder(steps: list[tuple[int, float, float, Any]]) -> Any:
    """t -> the index (into `steps`, ordered by start) of the step whose time range holds t, or -1."""
    starts = [s[1] for s in steps]

    def step_at(t: float) -> int:
        k = bisect.bisect_right(starts, t) - 1
        return k if k >= 0 and t < steps[k][1] + steps[k][2] else -1

    return step_at


class Transfer(NamedTuple):
    """One collective's transfer (a backend range, kernel or task) inside the steps."""

    ts: float
    end: float
    kind: str
    library: str
    issuer: str | None  # the c10d/functional operator that issued it
    arrival: float  # when the rank was ready (timeline.py)
    group: str
    step: int  # index into the ordered steps, -1: none


class _Groups:
    """The process group of the record_param_comms events of one thread, by start time."""

    def __init__(self, group_of: dict[Any, str], thread: Any) -> None:
        found = sorted((where[1], name) for where, name in group_of.items()
                       if isinstance(where, tuple) and where[0] == thread)
        self.starts, self.names = [t for t, _ in found], [n for _, n in found]

    def within(self, lo: float, hi: float) -> str:
        k = bisect.bisect_left(self.starts, lo)
        return self.names[k] if k < len(self.starts) and self.starts[k] <= hi else DEFAULT_GROUP


class _Issuers:
    """The innermost c10d/functional collective operator open at a time on a thread (a kernel's launch)."""

    def __init__(self, an: RankAnalyzer, thread_keys: dict[int, Any]) -> None:
        self.an, self.keys = an, thread_keys
        self._by_thread: dict[int, tuple[list[float], list[tuple[float, float, str]]]] = {}

    def around(self, ts: float, thread: int) -> str | None:
        if thread not in self._by_thread:
            key = self.keys.get(thread)
            t = self.an.threads.get(key) if key is not None else None
            ops = []
            if t is not None:
                for i in range(len(t.ts)):
                    name = self.an.name_list[t.name[i]]
                    if comm_library(name) == "c10d" and collective_kind(name) not in ("other", "wait"):
                        ops.append((t.ts[i], t.ts[i] + t.dur[i], name))
            ops.sort()
            self._by_thread[thread] = ([o[0] for o in ops], ops)
        starts, ops = self._by_thread[thread]
        k = bisect.bisect_right(starts, ts) - 1
        best = None
        while k >= 0:  # the innermost: the latest start whose range still holds ts
            if ops[k][1] >= ts:
                best = ops[k][2]
                break
            k -= 1
            if k >= 0 and ts - ops[k][0] > 60e6:  # nothing opened a minute before is still open
                break
        return best


def _number(value: Any) -> float:
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def _device_rows(steps: list[tuple[int, float, float, Any]], dev: _Timed, member: array
                 ) -> tuple[list[StepRow], dict[int, tuple[float, float]]]:
    """The split of each step's device window (see the module docstring) into compute, comm, overlap, idle."""
    first: dict[int, float] = {}
    last_end: dict[int, float] = {}
    summed: dict[int, float] = defaultdict(float)
    for i in range(len(dev.ts)):
        k = member[i]
        if k >= 0 and dev.comm[i] != LISTED:  # (a listed task neither opens nor closes a step's window)
            first[k] = min(first.get(k, dev.ts[i]), dev.ts[i])
            last_end[k] = max(last_end.get(k, 0.0), dev.ts[i] + dev.dur[i])
            summed[k] += dev.dur[i]
    bounds: dict[int, tuple[float, float]] = {}
    present = sorted(first)
    for j, k in enumerate(present):
        lo = max(first[k], bounds[present[j - 1]][1]) if j else first[k]  # windows never overlap
        hi = max(lo, first[present[j + 1]]) if j + 1 < len(present) else max(lo, last_end[k])
        bounds[k] = (lo, hi)
    compute = _merge((dev.ts[i], dev.ts[i] + dev.dur[i]) for i in range(len(dev.ts)) if dev.comm[i] == COMPUTE)
    comm = _merge((dev.ts[i], dev.ts[i] + dev.dur[i]) for i in range(len(dev.ts)) if dev.comm[i] == COMM)
    rows = []
    for k, (number, ts, dur, _) in enumerate(steps):
        lo, hi = bounds.get(k, (0.0, 0.0))
        c, m = _clip(compute, lo, hi), _clip(comm, lo, hi)
        both = _length(_intersect(c, m))
        lc, lm = _length(c), _length(m)
        idle = max(0.0, (hi - lo) - (lc + lm - both))
        rows.append(StepRow(number, ts, dur, hi - lo, lc - both, lm - both, both, idle, lm, summed.get(k, 0.0)))
    return rows, bounds


def _library_rows(spans: dict[str, list[tuple[float, float]]], windows: list[tuple[float, float]],
                  unit: str) -> list[dict[str, Any]]:
    """[{library, ms, count, unit}]: the time some of the library's events run inside `windows` (merged, sorted),
    longest first. Different libraries can overlap one another (c10d::allreduce_ around gloo:all_reduce)."""
    out = []
    for library, ivs in spans.items():
        merged = _merge(ivs)
        inside = sum(_length(_clip(merged, lo, hi)) for lo, hi in windows)
        out.append({"library": library, "ms": inside / 1000, "count": len(ivs), "unit": unit})
    return sorted(out, key=lambda r: -r["ms"])


def step_summary(steps: list[StepRow]) -> dict[str, float]:
    """Mean and max step time, and each share of the time the splits cover (they add up to 100)."""
    out: dict[str, float] = {}
    if not steps:
        return out
    total = sum(s.dur_us for s in steps)
    if total > 0:
        out["step_ms_mean"] = total / len(steps) / 1000
        out["step_ms_max"] = max(s.dur_us for s in steps) / 1000
    window = sum(s.window_us for s in steps)
    if window > 0:
        for key in SHARES:
            out[f"{key}_pct"] = 100 * sum(getattr(s, f"{key}_us") for s in steps) / window
    return out


def round_shares(values: list[float], digits: int = 1) -> list[float]:
    """Round percentages that add up to 100 so that the rounded ones do too (largest remainder)."""
    scale = 10 ** digits
    total = sum(values)
    if not values or abs(total - 100) > 1e-6 * max(1.0, total):
        return [round(v, digits) for v in values]
    floors = [int(v * scale) for v in values]
    short = round(100 * scale) - sum(floors)
    order = sorted(range(len(values)), key=lambda i: -(values[i] * scale - floors[i]))
    for i in order[:short]:
        floors[i] += 1
    return [f / scale for f in floors]


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


def _subtract(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of merged intervals `x` outside merged intervals `y`."""
    out, j = [], 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k = j
        while a < b and k < len(y) and y[k][0] < b:
            if y[k][0] > a:
                out.append((a, y[k][0]))
            a = max(a, y[k][1])
            k += 1
        if a < b:
            out.append((a, b))
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
