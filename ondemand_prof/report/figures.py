"""What a comparison reads of one rank's report (report.analyze's result, or the summary.json a rank writes with
the same fields), every value checked before use: a summary.json holds what its rank wrote, so Unusable names
the first field that is not what a report of ours writes, and the rank is then not compared.

    rank_figures(report) -> per step means (step time, split, communication by library and by collective kind,
                            operators and kernels) and each figure's per-step values, the thread's CPU, the
                            collectives' timeline (timeline.py), the level and the device it recorded on
Pure: no I/O."""

from __future__ import annotations

from typing import Any

from ..core.ranks import MAX_RANK
from .checks import (MAX_CALLS, MAX_DEVICE, MAX_KINDS, MAX_MS, MAX_ROWS, MAX_TABLE_STEPS, Unusable, bounded_name,
                     column_sum, one_line, rank_number)
from .checks import a_list as _list
from .checks import entry as _entry
from .checks import number as _ms
from .checks import shown as _shown
from .checks import word as _word
from .timeline import Unreadable, decode

SPLIT = (("compute", "compute_ms"), ("communication", "comm_ms"), ("overlap", "overlap_ms"), ("idle", "idle_ms"))


def _table(rows: Any, where: str, width: int, m: int) -> dict[str, list[float]]:
    """An operator ([name, calls, self us, total us]) or kernel ([name, calls, us]) table, per step (m steps)."""
    out: dict[str, list[float]] = {}
    for i, row in enumerate(_list(rows, where, MAX_ROWS)):
        if not isinstance(row, list) or len(row) != width:
            raise Unusable(f"{where}[{i}] is {_shown(row)}, not [name{', a number' * (width - 1)}]")
        if not isinstance(row[0], str):
            raise Unusable(f"{where}[{i}][0] is {_shown(row[0])}, not a name")
        name = bounded_name(row[0])  # (a long name is shortened, never a reason not to compare the rank)
        values = [_ms(x, f"{where}[{i}][{j + 1}]", MAX_CALLS if j == 0 else MAX_MS * 1000)
                  for j, x in enumerate(row[1:])]
        if m:
            out[name] = [x / m for x in values]
    return out


def _series(rows: Any, names: list[str], where: str, m: int) -> dict[str, list[float]]:
    """The per-step times (us) of a table's first rows (analyze.PER_STEP_SERIES of them), name -> values."""
    out: dict[str, list[float]] = {}
    for i, row in enumerate(_list(rows, where, MAX_ROWS)):
        if i >= len(names) or not isinstance(row, list) or len(row) != m:
            raise Unusable(f"{where}[{i}] is {_shown(row)}, not {m} times (one per step) of a row of its table")
        out[names[i]] = [_ms(x, f"{where}[{i}]", MAX_MS * 1000) for x in row]
    return out


def _cpu(value: Any, numbers: list[int]) -> dict[str, Any] | None:
    """The training thread's and the process's CPU and run-queue wait per step (rank/cpuclock.py), for the
    report's steps that have them (None: none)."""
    if value is None:
        return None
    c = _entry(value, "cpu_by_step")
    steps = _list(c.get("steps"), "cpu_by_step.steps", MAX_TABLE_STEPS)
    columns = {}
    for key in CPU_COLUMNS:
        if key in c or key in ("cpu_ms", "wait_ms"):
            column = _list(c.get(key), f"cpu_by_step.{key}", MAX_TABLE_STEPS)
            if len(column) != len(steps):
                raise Unusable(f"cpu_by_step.{key} is not one value per step")
            columns[key] = {s: _ms(x, f"cpu_by_step.{key}") for s, x in zip(steps, column)}
    kept = [n for n in numbers if n in columns["cpu_ms"]]
    if not kept:
        return None
    return {"steps": kept, **{key: [col[n] for n in kept] for key, col in columns.items()}}


CPU_COLUMNS = ("cpu_ms", "wait_ms", "proc_cpu_ms", "proc_wait_ms")


def rank_figures(r: dict[str, Any]) -> dict[str, Any]:
    """What a comparison needs of one rank's report (module docstring)."""
    if not isinstance(r, dict):
        raise Unusable(f"the rank's report is {_shown(r)}, not an object")
    steps = _list(r.get("steps"), "steps", MAX_TABLE_STEPS)
    if set(map(type, steps)) - {dict}:
        steps = [_entry(s, f"steps[{i}]") for i, s in enumerate(steps)]  # (raises, naming the first)
    n = len(steps)
    per = _entry(r.get("step_ops") or {}, "step_ops")
    m = per.get("steps") or 0  # the operator tables' steps (those of the split, unless a format lacks one)
    if type(m) is not int or not 0 <= m <= MAX_TABLE_STEPS:
        raise Unusable(f"step_ops.steps is {_shown(m)}, not a number of steps")
    column_sum(steps, "dur_ms")  # (checks the column, naming a bad value)
    series = {"step": [max(0.0, float(s.get("dur_ms") or 0.0)) for s in steps]}  # (a hair below 0 is 0)
    for key, field in SPLIT:
        column_sum(steps, field)
        series[key] = [max(0.0, float(s.get(field) or 0.0)) for s in steps]
    split = {key: (sum(series[key]) / n if n else None) for key, _ in SPLIT}
    step_ms = sum(series["step"]) / n if n else \
        (None if r.get("step_ms_mean") is None else _ms(r["step_ms_mean"], "step_ms_mean"))
    libraries: dict[str, float] = {}
    for i, lib in enumerate(_list(r.get("comm_libraries"), "comm_libraries", MAX_KINDS)):
        lib = _entry(lib, f"comm_libraries[{i}]")
        name = _word(lib.get("library"), f"comm_libraries[{i}].library", optional=False)
        ms = _ms(lib.get("ms"), f"comm_libraries[{i}].ms")
        if n:
            libraries[name] = ms / n
    collectives: dict[str, tuple[float, float, list[float] | None]] = {}
    for i, c in enumerate(_list(r.get("collectives"), "collectives", MAX_KINDS)):
        c = _entry(c, f"collectives[{i}]")
        by_step = c.get("ms_by_step")
        if by_step is not None:
            by_step = [_ms(x, f"collectives[{i}].ms_by_step") for x in _list(by_step, "ms_by_step", MAX_TABLE_STEPS)]
            if len(by_step) != n:
                by_step = None  # (another format's steps): the mean is still compared
        collectives[_word(c.get("kind"), f"collectives[{i}].kind", optional=False)] = (
            _ms(c.get("count_per_step"), f"collectives[{i}].count_per_step", MAX_CALLS),
            _ms(c.get("ms_per_step"), f"collectives[{i}].ms_per_step"), by_step)
    complete = per.get("complete") or {"ops": True, "kernels": True}
    if not isinstance(complete, dict) or any(type(complete.get(k, True)) is not bool for k in ("ops", "kernels")):
        raise Unusable(f"step_ops.complete is {_shown(complete)}, not {{ops, kernels: true or false}}")
    options = r.get("options")
    world = r.get("world_size")
    if world is not None and not (type(world) is int and 1 <= world <= MAX_RANK):
        raise Unusable(f"world_size is {_shown(world)}, not a number of ranks")
    ops = _table(per.get("ops"), "step_ops.ops", 4, m)
    kernels = _table(per.get("kernels"), "step_ops.kernels", 3, m)
    numbers = [s.get("step") for s in steps]
    return {
        "rank": rank_number(r.get("rank")), "world_size": world, "steps": n, "step_ms": step_ms, "split": split,
        "series": series, "step_numbers": numbers,
        "basis": _word(r.get("basis"), "basis"),
        "level": _level(r, options),
        "device": _device(r.get("device")),
        "libraries": libraries, "collectives": collectives,
        "ops": ops, "kernels": kernels,
        "ops_series": _series(per.get("ops_by_step"), list(ops), "step_ops.ops_by_step", m) if m else {},
        "kernels_series": _series(per.get("kernels_by_step"), list(kernels), "step_ops.kernels_by_step", m)
        if m else {},
        "complete": {"ops": complete.get("ops", True), "kernels": complete.get("kernels", True)},
        "cpu": _cpu(r.get("cpu_by_step"), numbers),
        "timeline": _timeline(r.get("timeline")),
        "host": r.get("host") if isinstance(r.get("host"), str) and len(r["host"]) <= 255 else None,
        "capture_id": r.get("capture_id") if isinstance(r.get("capture_id"), str) else None,
        "job_id": r.get("job_id") if isinstance(r.get("job_id"), str) else None,
    }


def _level(r: dict[str, Any], options: Any) -> Any:
    """The level the rank recorded at: our capture's options, else torch_npu's own (its profiler_info, read into
    the rank's report by ascend.py)."""
    if isinstance(options, dict) and options.get("level") is not None:
        return _word(options.get("level"), "options.level")
    return _word(r.get("level"), "level")


def _device(value: Any) -> str | None:
    """The device the rank ran on (a trace's deviceProperties, torch_npu's NPU_INFO), one line; None: not said."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise Unusable(f"device is {_shown(value)}, not a name")
    return one_line(value)[:MAX_DEVICE] or None


def _timeline(value: Any) -> Any:
    """The encoded timeline as the rank wrote it, when it reads (else None: that rank's waits are not known;
    the comparison says so rather than dropping the rank)."""
    if value is None:
        return None
    try:
        decode(value)
    except Unreadable:
        return None
    return value


__all__ = ["rank_figures", "rank_number", "SPLIT", "Unusable"]
