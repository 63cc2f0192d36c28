"""Profiling windows and the step arithmetic around them. Pure: no torch, no I/O, no clocks.

Steps are the training loop's own numbers. A window [start, end) records steps start .. end-1; `end is None`
means "until close()". The boundary "before step s" is the moment prof.step() returns from step s-1 (or the
profiler's construction, for the first step): that is where a backend begins, advances and finishes.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, TypeGuard

from .bounds import MAX_STEP, bounded_int
from .options import WindowOptions

@dataclass(frozen=True)
class Window:
    """A resolved window: absolute steps, the options it records with, and where it came from.

    `requested` is what was asked (for metadata); `note` says what the planner changed (a capped length, a
    start moved because the request came late), so that status files, `ondemandctl show` and metadata tell
    the truth about what was recorded rather than repeat the request."""

    start: int
    end: int | None
    options: Any = field(default_factory=WindowOptions)
    source: str = "static"
    capture_id: str = ""
    requested: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""

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

    def listed(self, state: str) -> dict[str, Any]:
        """The window as a rank lists it to the daemon (end None: until close): its heartbeats' running and queued
        windows, and the `busy` field of a refusal (state "busy"), which the daemon plans a capture after."""
        return {"capture_id": self.capture_id, "start": self.start, "end": self.end, "source": self.source,
                "state": state}

    def to_wire(self) -> dict[str, Any]:
        """The window as the daemon sends it to a rank (JSON); core.requests.window_from_wire is its only reader."""
        return {"capture_id": self.capture_id, "start_step": self.start, "end_step": self.end,
                "options": asdict(self.options), "source": self.source, "note": self.note,
                "requested": dict(self.requested)}


def busy_reason(blocking: Window) -> str:
    """Why a rank refuses a window: `blocking` holds the profiler then (the text people read; the daemon reads the
    window itself from the refusal's `busy` field, blocking.listed("busy"), sent beside it)."""
    return f"busy: window {blocking.describe()} ({blocking.source}, {blocking.capture_id}) holds the profiler"


def busy_window(value: Any) -> dict[str, Any] | None:
    """A rank's `busy` field (Window.listed("busy")) checked, as heartbeats list windows, or None when it is no such window
    (absent, or not what listed() writes: a rank's report is bounded before use)."""
    if not isinstance(value, dict) or value.get("state") != "busy":
        return None
    start, end, source, cid = (value.get(k) for k in ("start", "end", "source", "capture_id"))
    if not _step(start) or (end is not None and (not _step(end) or end <= start)):
        return None
    if not (isinstance(source, str) and len(source) <= 32 and isinstance(cid, str) and len(cid) <= 128):
        return None
    return {"capture_id": cid, "start": start, "end": end, "source": source, "state": "busy"}


def _step(value: Any) -> TypeGuard[int]:
    return bounded_int(value, 0, MAX_STEP)


class Phase(enum.Enum):
    WAIT = "wait"  # nothing to do yet
    WARMUP = "warmup"  # begin the backend, discard this step
    RECORD = "record"  # begin recording at this step
    MISSED = "missed"  # the whole window is in the past


@dataclass(frozen=True)
class Begin:
    """What plan_begin decides for a window at a step boundary (not a capture's plan: host/records.py Plan)."""

    phase: Phase
    wake: int  # the next step whose boundary needs attention
    late_by: int = 0  # steps of the window already gone when recording begins


def plan_begin(window: Window, step: int, warmup: int) -> Begin:
    """What to do for a window not yet begun, at the boundary before `step`."""
    if window.end is not None and step >= window.end:
        return Begin(Phase.MISSED, step)
    if step >= window.start:
        return Begin(Phase.RECORD, step + 1, late_by=step - window.start)
    if step >= window.start - warmup:
        return Begin(Phase.WARMUP, step + 1)
    return Begin(Phase.WAIT, window.start - warmup)


def recorded_steps(window: Window, first: int, last_exclusive: int) -> list[int]:
    """The steps a window actually recorded, given where recording began and stopped."""
    stop = last_exclusive if window.end is None else min(window.end, last_exclusive)
    return list(range(max(first, window.start), stop))


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
