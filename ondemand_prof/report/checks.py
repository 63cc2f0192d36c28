"""What a rank wrote, checked before a report or a comparison uses it: a summary.json is written by the rank's own
post-processing, so a rank (or a damaged file, or another version) can put anything there. Each value is checked
where it is read: Unusable names the first field that is not what a report of ours writes.

    summary_problem(summary, rank=, capture_id=, job_id=) -> why a rank's summary cannot stand for its trace in a
                                                            report (None: it can)
    bounded_name(name) -> an operator's or kernel's name within MAX_NAME: a longer one keeps its start and a
                          hash of the whole (two long names that share a start stay apart)

The checks of single values (a time, a name, a list, an object, a rank number) are shared with compare.py. Pure."""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from ..core.bounds import MAX_STEP
from ..core.ranks import MAX_RANK
from .pipeline import KINDS as PIPELINE_KINDS, MAX_ACTIONS, MAX_STEPS as PIPELINE_STEPS

# What a rank's report may hold to be compared (a summary.json is written by the rank's own post-processing, so a
# rank can write anything there): more, or another type, and the rank is not compared (Unusable says where)
MAX_MS = 1e9  # a time, ms (per step or in all): about 11 days; none measured is near it
MAX_CALLS = 1e12  # calls of one operator or collective kind
MAX_TABLE_STEPS = 10**6  # the steps an operator table covers, and the steps of a rank's report
MAX_ROWS = 1000  # operators or kernels a table: a report of ours writes 300 of each (analyze.PER_STEP_OPS)
MAX_KINDS = 64  # collective kinds, communication libraries: a dozen of each exist
MAX_NAME = 4096  # characters of an operator's or kernel's name (a long demangled signature is 1-2 thousand)
MAX_WORD = 64  # a kind's, library's, level's or basis's name
MAX_DEVICE = 256  # a device's name as the trace gives it (deviceProperties: "AMD Instinct MI300X VF")


class Unusable(ValueError):
    """A rank's report that does not hold what a comparison reads; the message names the field."""


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def number(value: Any, where: str, hi: float = MAX_MS) -> float:
    """A time (or count, with `hi`) from a rank's report: a finite number from 0 to `hi` (None: 0); a hair below
    0 (float sums of intervals) is 0."""
    if value is None:
        return 0.0
    if type(value) not in (int, float) or not math.isfinite(value) or not -1e-3 <= value <= hi:
        raise Unusable(f"{where} is {shown(value)}, not a number from 0 to {hi:g}")
    return max(0.0, float(value))


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # (a newline too: a word is one line of the cause)


def word(value: Any, where: str, limit: int = MAX_WORD, optional: bool = True) -> Any:
    """A name: a string of at most `limit` characters; a kind's, library's, level's or basis's (limit MAX_WORD,
    a word of a small vocabulary) without control characters, newlines included."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > limit or (limit <= MAX_WORD and _CONTROL.search(value)):
        raise Unusable(f"{where} is {shown(value)}, not a name of at most {limit} characters"
                       + (" without control characters" if limit <= MAX_WORD else ""))
    return value


def bounded_name(name: str, limit: int = MAX_NAME) -> str:
    """`name` when it fits `limit`; else its start, an ellipsis and 16 hex digits of its SHA-1, `limit` characters
    in all. ROCm's normal_ kernel (any torch.randn on the GPU) has a 5,160-character name: a bound on names is
    never a reason to drop a rank, and the same long name shortens alike in every trace (a comparison matches it)."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    tail = f"…#{digest}"
    return name[:limit - len(tail)] + tail


def one_line(text: str) -> str:
    """An operator's or kernel's name (a trace's or a summary's: anything) as one line of the cause, which the
    daemon logs and list and show print: control characters, newlines and tabs shown as escapes (a name holding
    a newline forged a line of the daemon's log)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def a_list(value: Any, where: str, limit: int) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise Unusable(f"{where} is {shown(value)}, not a list")
    if len(value) > limit:
        raise Unusable(f"{where} has {len(value)} entries, more than the {limit} a report of ours holds")
    return value


def entry(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Unusable(f"{where} is {shown(value)}, not an object")
    return value


def rank_number(value: Any, where: str = "rank") -> int | None:
    """A rank number from a rank's report or metadata (None: not known); Unusable for anything else."""
    if value is None or (type(value) is int and 0 <= value <= MAX_RANK):
        return value
    raise Unusable(f"{where} is {shown(value)}, not a rank number")


# ----------------------------------------------------------------------------------------------------------
# A rank's summary.json (rank/postprocess.py write_rank_summary: report/analyze.py's result for its trace), as the
# report reads it

SUMMARY_VERSION = 1
MAX_US = MAX_MS * 1000  # a time in microseconds, or a count of bytes, calls or events in a table row
STEP_TIMES = ("dur_ms", "window_ms", "compute_ms", "comm_ms", "overlap_ms", "idle_ms")  # what every step row holds
MORE_STEP_TIMES = ("comm_total_ms", "kernel_ms")
SHARES = ("compute_pct", "comm_pct", "overlap_pct", "idle_pct")
NAMED_TABLES = ("top_self", "top_total", "top_kernels", "annotations")  # rows: a name and its figures
KIND_TABLES = ("collectives", "comm_libraries")
# what the text and HTML reports read of each table's rows (report/text.py, html.py): a summary whose rows lack one
# failed the whole report with a KeyError (issue 41, item 10); a row of ours always has them
_OPS = {"calls": "number", "self_us": "number", "total_us": "number", "avg_us": "number", "comm": "flag"}
RENDERED = {"top_self": _OPS, "top_total": _OPS,
            "top_kernels": {"calls": "number", "total_us": "number", "avg_us": "number", "comm": "flag"},
            "annotations": {},
            "collectives": {"kind": "word", "count_per_step": "number", "ms_per_step": "number", "via": "words"},
            "comm_libraries": {"library": "word", "ms": "number", "count": "number", "unit": "word"}}


def summary_problem(summary: Any, *, rank: Any, capture_id: Any, job_id: Any) -> str | None:
    """Why a rank's summary.json cannot stand for its trace in a report (None: it can): not of this version, of
    another rank, capture or job, or a field that is not what a report of ours writes (a type, a number out of
    its range, a name too long, a table too long). The report then says so for that rank, or reads its trace."""
    try:
        _check_summary(entry(summary, "the summary"), rank, capture_id, job_id)
    except Unusable as exc:
        return str(exc)
    return None


def _check_summary(s: dict[str, Any], rank: Any, capture_id: Any, job_id: Any) -> None:
    if s.get("summary_version") != SUMMARY_VERSION:
        raise Unusable(f"summary_version is {shown(s.get('summary_version'))}, not {SUMMARY_VERSION}: written by "
                       "another version of ondemand_prof")
    for key, want in (("rank", rank), ("capture_id", capture_id), ("job_id", job_id)):
        if key in s and s[key] != want:
            raise Unusable(f"{key} is {shown(s[key])}, not {shown(want)}: another rank's or capture's summary")
    if "steps" not in s:
        raise Unusable("steps is missing")
    steps = a_list(s["steps"], "steps", MAX_TABLE_STEPS)
    for i, step in enumerate(steps):
        entry(step, f"steps[{i}]")
        if type(step.get("step")) is not int or not 0 <= step["step"] <= MAX_STEP:
            raise Unusable(f"steps[{i}].step is {shown(step.get('step'))}, not a step number")
        for key in STEP_TIMES:
            if key not in step:
                raise Unusable(f"steps[{i}].{key} is missing")
    for key in (*STEP_TIMES, *MORE_STEP_TIMES):
        column_sum(steps, key)
    column_sum(steps, "start_us", hi=1e18)  # (microseconds since the epoch)
    for key in ("step_ms_mean", "step_ms_max"):
        number(s.get(key), key)
    for key in SHARES:
        number(s.get(key), key, hi=100.001)
    for key in ("events", "operators", "cpu_self_total_us"):
        number(s.get(key), key, hi=MAX_US)
    word(s.get("basis"), "basis")
    for table in NAMED_TABLES:
        for i, row in enumerate(a_list(s.get(table), table, MAX_ROWS)):
            name = entry(row, f"{table}[{i}]").get("name")
            if not isinstance(name, str):  # (a long one is shown shortened: the file's size bounds it)
                raise Unusable(f"{table}[{i}].name is {shown(name)}, not a name")
            _plain(row, f"{table}[{i}]")
            _rendered(row, RENDERED[table], f"{table}[{i}]")
    for table in KIND_TABLES:
        for i, row in enumerate(a_list(s.get(table), table, MAX_KINDS)):
            _plain(entry(row, f"{table}[{i}]"), f"{table}[{i}]")
            _rendered(row, RENDERED[table], f"{table}[{i}]")
    if s.get("device") is not None:
        word(s["device"], "device", MAX_DEVICE)
    memory = s.get("memory")
    if memory is not None:
        for i, device in enumerate(a_list(entry(memory, "memory").get("devices"), "memory.devices", MAX_KINDS)):
            _plain(entry(device, f"memory.devices[{i}]"), f"memory.devices[{i}]")
    for key in ("kernel_steps", "options"):
        if s.get(key) is not None:
            _plain(entry(s[key], key), key)
    if s.get("pipeline") is not None:
        _check_pipeline(entry(s["pipeline"], "pipeline"))


def _check_pipeline(p: dict[str, Any]) -> None:
    """A rank's pipeline schedule (report/pipeline.py), as the reports read it: its words, its counts, each action
    [stage or null, kind, microbatch, start ms, time ms, computing ms] and each step [step, span ms, computing ms],
    within the bounds pipeline.py keeps."""
    for key in ("labels", "basis", "role"):
        word(p.get(key), f"pipeline.{key}")
    for key in ("steps", "microbatches", "dropped_actions"):
        number(p.get(key), f"pipeline.{key}", hi=MAX_TABLE_STEPS)
    for key in ("span_ms", "busy_ms", "bubble_ms"):
        number(p.get(key), f"pipeline.{key}")
    number(p.get("bubble_pct"), "pipeline.bubble_pct", hi=100.001)
    for i, stage in enumerate(a_list(p.get("stages"), "pipeline.stages", MAX_ROWS)):
        if type(stage) is not int or not 0 <= stage <= MAX_STEP:
            raise Unusable(f"pipeline.stages[{i}] is {shown(stage)}, not a stage number")
    for i, row in enumerate(a_list(p.get("actions"), "pipeline.actions", MAX_ACTIONS)):
        where = f"pipeline.actions[{i}]"
        if not isinstance(row, list) or len(row) != 6:
            raise Unusable(f"{where} is {shown(row)}, not [stage, kind, microbatch, start, time, computing]")
        stage, kind, microbatch = row[:3]
        if stage is not None and (type(stage) is not int or not 0 <= stage <= MAX_STEP):
            raise Unusable(f"{where} stage is {shown(stage)}, not a stage number")
        if kind not in PIPELINE_KINDS:
            raise Unusable(f"{where} kind is {shown(kind)}, not one of {', '.join(PIPELINE_KINDS)}")
        if type(microbatch) is not int or not 0 <= microbatch <= MAX_STEP:
            raise Unusable(f"{where} microbatch is {shown(microbatch)}, not a microbatch number")
        for value in row[3:]:
            number(value, where)
    for i, row in enumerate(a_list(p.get("by_step"), "pipeline.by_step", PIPELINE_STEPS)):
        where = f"pipeline.by_step[{i}]"
        if not isinstance(row, list) or len(row) != 3 or type(row[0]) is not int:
            raise Unusable(f"{where} is {shown(row)}, not [step, span, computing]")
        for value in row[1:]:
            number(value, where)


def column_sum(steps: list[dict[str, Any]], key: str, hi: float = MAX_MS) -> float:
    """The sum of one field over a rank's steps, each checked as `number` checks it (absent: 0). A summary holds
    up to ~7,000 steps: the types and the range are checked by builtins over the column, each value by `number`
    only where one fails (for its message) or a hair below 0 is to be clamped (a call a value held a host's loop
    90 ms a rank)."""
    values = [v for v in (s.get(key) for s in steps) if v is not None]
    if not values:
        return 0.0
    if set(map(type, values)) <= {int, float}:
        total = float(sum(values))
        if min(values) >= 0 and max(values) <= hi and math.isfinite(total):  # (min and max skip a NaN)
            return total
    return sum(number(x.get(key), f"steps[{i}].{key}", hi) for i, x in enumerate(steps))


def _rendered(row: dict[str, Any], fields: dict[str, str], where: str) -> None:
    """The fields of a table's row that the reports read, each of the kind they read it as."""
    for key, kind in fields.items():
        value = row.get(key)
        ok = {"number": type(value) in (int, float), "flag": type(value) is bool,
              "word": isinstance(value, str) and len(value) <= MAX_WORD,
              "words": isinstance(value, list) and all(isinstance(v, str) for v in value)}[kind]
        if not ok:
            what = {"number": "a number", "flag": "true or false", "word": "a name", "words": "a list of names"}[kind]
            raise Unusable(f"{where}.{key} is {'missing' if key not in row else shown(value)}, not {what}")


def _plain(row: dict[str, Any], where: str) -> None:
    """A table row's values as a report of ours writes them: names, numbers (finite, within +-MAX_US: a device id
    may be -1), flags, nothing; a list of names or numbers; an object of names to names or numbers (a collective's
    `issued_by`). Nothing nested deeper, no more than MAX_ROWS of anything."""
    if len(row) > MAX_ROWS:
        raise Unusable(f"{where} has {len(row)} fields, more than the {MAX_ROWS} a report of ours writes")
    for key, value in row.items():
        word(key, f"{where} key", MAX_NAME, optional=False)
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
        if len(inner) > MAX_ROWS:
            raise Unusable(f"{where}.{key} has {len(inner)} entries, more than the {MAX_ROWS} a report of ours holds")
        for v in inner:
            if v is None or isinstance(v, bool) or (isinstance(v, str) and (len(v) <= MAX_NAME or key == "name")):
                continue
            if type(v) in (int, float) and math.isfinite(v) and -MAX_US <= v <= MAX_US:
                continue
            raise Unusable(f"{where}.{key} is {shown(value)}, not a name, a number or a list or object of them")
