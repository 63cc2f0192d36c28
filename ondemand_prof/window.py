"""Profiling windows and the step arithmetic around them. Pure: no torch, no I/O, no clocks.

Steps are the training loop's own numbers. A window [start, end) records steps start .. end-1; `end is None`
means "until close()". The boundary "before step s" is the moment prof.step() returns from step s-1 (or the
profiler's construction, for the first step): that is where a backend begins, advances and finishes.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .config import ProfileConfig

OPTION_FIELDS = ("level", "export_type", "data_simplification", "with_cpu", "with_stack", "with_memory",
                 "record_shapes")


@dataclass(frozen=True)
class WindowOptions:
    """The profiler options a window records with; a request may override any of them."""

    level: str = "level0"
    export_type: str = "text"
    data_simplification: bool = False
    with_cpu: bool = False
    with_stack: bool = False
    with_memory: bool = False
    record_shapes: bool = False

    @classmethod
    def from_config(cls, config: ProfileConfig, **overrides: Any) -> "WindowOptions":
        values = {name: getattr(config, name) for name in OPTION_FIELDS}
        values.update(overrides)
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Window:
    start: int
    end: int | None
    options: WindowOptions = field(default_factory=WindowOptions)
    source: str = "static"
    capture_id: str = ""
    requested: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"window start {self.start} < 0")
        if self.end is not None and self.end <= self.start:
            raise ValueError(f"window end {self.end} <= start {self.start}")

    @property
    def steps(self) -> int | None:
        return None if self.end is None else self.end - self.start

    def describe(self) -> str:
        return f"[{self.start}, {'close' if self.end is None else self.end})"

    def overlaps(self, start: int, end: int | None) -> bool:
        """Whether this window shares a step with [start, end)."""
        a_end = float("inf") if self.end is None else self.end
        b_end = float("inf") if end is None else end
        return self.start < b_end and start < a_end


class Phase(enum.Enum):
    WAIT = "wait"  # nothing to do yet
    WARMUP = "warmup"  # begin the backend, discard this step
    RECORD = "record"  # begin recording at this step
    MISSED = "missed"  # the whole window is in the past


@dataclass(frozen=True)
class Plan:
    phase: Phase
    wake: int  # the next step whose boundary needs attention
    late_by: int = 0  # steps of the window already gone when recording begins


def plan_begin(window: Window, step: int, warmup: int) -> Plan:
    """What to do for a window not yet begun, at the boundary before `step`."""
    if window.end is not None and step >= window.end:
        return Plan(Phase.MISSED, step)
    if step >= window.start:
        return Plan(Phase.RECORD, step + 1, late_by=step - window.start)
    if step >= window.start - warmup:
        return Plan(Phase.WARMUP, step + 1)
    return Plan(Phase.WAIT, window.start - warmup)


def recorded_steps(window: Window, first: int, last_exclusive: int) -> list[int]:
    """The steps a window actually recorded, given where recording began and stopped."""
    stop = last_exclusive if window.end is None else min(window.end, last_exclusive)
    return list(range(max(first, window.start), stop))


def cap_window(start: int, steps: int, cap: int) -> tuple[int, int, bool]:
    """(start, end, capped): a window of `steps` steps from `start`, no longer than `cap`."""
    capped = steps > cap
    return start, start + min(steps, cap), capped


# ----------------------------------------------------------------------------------------------------------
# Anchoring a request in time: which step was running at wall-clock time t.


@dataclass
class StepClock:
    """A small ring of (step, time the step began), fed by whoever samples the training loop."""

    capacity: int = 256
    steps: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def record(self, step: int, began_at: float) -> None:
        if self.steps and step <= self.steps[-1]:
            if step == self.steps[-1]:
                return
            # the loop's counter went backwards (passed explicitly): start the ring afresh
            self.steps.clear()
            self.times.clear()
        self.steps.append(step)
        self.times.append(began_at)
        if len(self.steps) > self.capacity:
            del self.steps[0]
            del self.times[0]

    def step_at(self, t: float) -> int | None:
        """The step running at time t, or None when t is before the oldest sample."""
        i = bisect.bisect_right(self.times, t)
        if i == 0:
            return None
        return self.steps[i - 1]

    def mean_step_time(self, last: int = 16) -> float | None:
        """Median time per step over the last samples (robust to a slow first step or a checkpoint)."""
        if len(self.times) < 2:
            return None
        rates = []
        for i in range(max(1, len(self.times) - last), len(self.times)):
            span = self.steps[i] - self.steps[i - 1]
            if span > 0:
                rates.append((self.times[i] - self.times[i - 1]) / span)
        if not rates:
            return None
        rates.sort()
        return rates[len(rates) // 2]


def parse_rank_spec(spec: str | int | Iterable[Any]) -> tuple[int, ...]:
    """'0-3,7' / [0, 1] / -1 -> ranks; -1 means all. Raises ValueError with the bad part."""
    if isinstance(spec, bool):
        raise ValueError(f"bad rank {spec!r}")
    if isinstance(spec, int):
        items: Sequence[Any] = [spec]
    elif isinstance(spec, str):
        items = [p for p in spec.replace(" ", ",").split(",") if p]
    else:
        items = list(spec)
    ranks: list[int] = []
    for item in items:
        if isinstance(item, bool):
            raise ValueError(f"bad rank {item!r}")
        if isinstance(item, int):
            ranks.append(item)
            continue
        if not isinstance(item, str):
            raise ValueError(f"bad rank {item!r}")
        text = item.strip()
        if "-" in text[1:]:
            lo, hi = text.split("-", 1) if not text.startswith("-") else (text, "")
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad rank range {text!r}: expected LOW-HIGH with LOW <= HIGH")
            ranks.extend(range(int(lo), int(hi) + 1))
            continue
        try:
            ranks.append(int(text))
        except ValueError:
            raise ValueError(f"bad rank {text!r}: expected an integer, a range like 0-7, or -1 for all") from None
    if not ranks:
        raise ValueError("no ranks given")
    for rank in ranks:
        if rank < -1:
            raise ValueError(f"bad rank {rank}: expected >= 0, or -1 for all")
    return tuple(dict.fromkeys(ranks))


def selects(ranks: Sequence[int], rank: int) -> bool:
    return -1 in ranks or rank in ranks
