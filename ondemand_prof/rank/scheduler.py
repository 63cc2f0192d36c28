"""The rank's window policy, pure: which window runs when, what is refused as busy, what is skipped or moved,
and what each window's listener hears. No threads, no clocks of its own, no I/O: the hook calls it at step
boundaries on the training thread, and it drives backend sessions and exports through a Driver. Tested with a
fake driver and fake sessions (tests/test_scheduler.py).

A listener hears what happens to one window: "started", "recording", "writing", then "done"/"failed" (from the
exporter), or "failed"/"skipped"/"cancelled" here.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from ..core.window import Phase, Window, busy_reason, plan_begin, recorded_steps
from .backends.base import Session

log = logging.getLogger("ondemand_prof")

IDLE = 1 << 62  # "no step needs attention"
MAX_CONSECUTIVE_FAILURES = 3

Listener = Callable[[str, dict[str, Any]], None]


class Driver(Protocol):
    """What the scheduler needs from the hook: sessions, exports, and two facts about this rank."""

    def open(self, window: Window) -> tuple[Session, Any]: ...
    def collect(self, active: "Active") -> Any: ...
    def export(self, active: "Active", steps: list[int], export: Any) -> None: ...
    def static_selected(self) -> bool: ...
    def disk_problem(self) -> str | None: ...
    def who(self) -> str: ...


@dataclass
class Active:
    window: Window
    session: Session
    context: Any  # the driver's (output paths, timestamps)
    state: str  # "warmup" | "recording"
    listener: Listener | None = None
    first_step: int = -1
    late_by: int = 0
    moved_by: int = 0  # an on-demand window that arrived after its start was moved this many steps
    cancelled: bool = False
    planned_end: int | None = None  # a moved window's end as planned (what it holds against new requests)


@dataclass
class Queued:
    window: Window
    listener: Listener | None = None
    moved_by: int = 0
    planned_end: int | None = None
    arrived_at: int | None = None  # the step at which it was submitted (None: not known)


@dataclass
class Scheduler:
    driver: Driver
    warmup_steps: int = 1
    queue: list[Queued] = field(default_factory=list)
    active: Active | None = None
    failures: int = 0
    disabled: bool = False
    closed: bool = False

    # ------------------------------------------------------------------------------------------------------
    # Requests (training thread)

    def submit(self, window: Window, listener: Listener | None = None, step: int | None = None) -> tuple[bool, str]:
        """Queue a window (`step`: the step now beginning, when known): place() without the busy window."""
        ok, reason, _ = self.place(window, listener, step)
        return ok, reason

    def place(self, window: Window, listener: Listener | None = None,
              step: int | None = None) -> tuple[bool, str, Window | None]:
        """Queue a window, or say why not and, when refused as busy, which window holds the profiler then (the
        daemon plans the capture again after it). Busy: it overlaps the running window or an on-demand one already
        queued, as they were planned; a static window it overlaps is skipped when its time comes."""
        if self.disabled or self.closed:
            return False, "profiler disabled" if self.disabled else "profiler closed", None
        if window.source == "daemon" and window.capture_id:
            if self.active is not None and self.active.window.capture_id == window.capture_id:
                return False, f"capture {window.capture_id} is already recording here", None
            # the daemon planned this capture again (after a window it had not heard of): the new plan replaces
            # the one queued
            self.queue = [q for q in self.queue if q.window.capture_id != window.capture_id]
        blocking = self.blocking(window)
        if blocking is not None:
            return False, busy_reason(blocking), blocking
        self.queue.append(Queued(window, listener, arrived_at=step))
        self.queue.sort(key=lambda q: q.window.start)
        return True, "scheduled", None

    def blocking(self, window: Window) -> Window | None:
        active = self.active
        if active and window.overlaps(*_held(active.window, active.moved_by, active.planned_end)):
            return active.window
        return next((q.window for q in self.queue if q.window.source != "static" and
                     window.overlaps(*_held(q.window, q.moved_by, q.planned_end))), None)

    def cancel(self, capture_id: str, step: int) -> bool:
        """Stop a queued or running window: a running one is finished now and written, marked cancelled."""
        for queued in [q for q in self.queue if q.window.capture_id == capture_id]:
            self.queue.remove(queued)
            tell(queued.listener, "cancelled", queued.window, error="cancelled before it began")
            return True
        active = self.active
        if active is None or active.window.capture_id != capture_id:
            return False
        active.cancelled = True
        if active.state == "warmup":
            self.active = None
            active.session.abort()
            tell(active.listener, "cancelled", active.window, error="cancelled before it began")
        else:
            self._finish(step)
        return True

    # ------------------------------------------------------------------------------------------------------
    # Step boundaries (training thread)

    def boundary(self, step: int) -> int:
        """Do what is due before `step`; returns the next step that needs attention (IDLE: none)."""
        if self.disabled or self.closed:
            return IDLE
        try:
            if self.active is not None:
                self._advance(step)
            if self.active is None:
                self._maybe_begin(step)
            else:
                self._skip_due_static(step)
        except Exception as exc:  # noqa: BLE001 - training never notices the profiler failing
            self.on_failure(exc)
        return self.next_wake(step)

    def next_wake(self, step: int) -> int:
        if self.disabled or self.closed:
            return IDLE
        if self.active is not None:
            return step + 1
        if not self.queue:
            return IDLE
        return plan_begin(self.queue[0].window, step, self.warmup_steps).wake

    def close(self, step: int, why: str = "") -> None:
        """Finish the running window (a window still in its warmup step recorded nothing: it says so) and fail
        the ones that never began, saying at which step and `why` training ended (rank/terminate.exit_reason)."""
        try:
            if self.active is not None:
                self._finish(step, ending="training ended (close()) during the warmup step, before the window began")
        except Exception as exc:  # noqa: BLE001
            self.on_failure(exc)
        self.closed = True
        for queued in self.queue:
            if queued.window.source != "static":
                tell(queued.listener, "failed", queued.window, error=f"training ended at step {step}, before the "
                     f"window{f' ({why})' if why else ''}")
        self.queue.clear()

    def _maybe_begin(self, step: int) -> None:
        while self.queue:
            queued = self.queue[0]
            plan = plan_begin(queued.window, step, self.warmup_steps)
            if plan.phase is Phase.WAIT:
                return
            self.queue.pop(0)
            if plan.phase is Phase.MISSED or (plan.late_by and queued.window.source != "static"):
                moved = self._move_late(queued, step)
                if moved is None:
                    continue
                queued, plan = moved, plan_begin(moved.window, step, self.warmup_steps)
            if not self._may_begin(queued):
                continue
            self._begin(queued, step, plan.phase)
            return

    def _move_late(self, queued: Queued, step: int) -> Queued | None:
        """An on-demand window that arrived after its start still records the steps asked for, from now, and
        says so (the user asked for N steps: a late rank records N, not what is left of them). A static window
        names exact steps: one already over is skipped (one under way records what is left, and is not moved)."""
        window = queued.window
        if window.end is None:
            return queued  # open-ended: it begins now, late
        if window.source == "static":
            log.warning("ondemand_prof: window %s missed: already at step %d", window.describe(), step)
            tell(queued.listener, "skipped", window, error=f"missed: already at step {step}")
            return None
        length = window.end - window.start
        start = step + self.warmup_steps  # its warmup step now, as an on-time window has (no start-up skew)
        arrived = queued.arrived_at
        if arrived is not None and arrived <= window.start:
            why = f"it arrived at step {arrived}, in time, but the profiler was busy until step {step}"
        else:
            why = f"it arrived at step {step if arrived is None else arrived}, after its " + \
                  ("end" if step >= window.end else "start")
        note = "; ".join(filter(None, [window.note, f"moved from {window.describe()} to [{start}, {start + length})"
                                                    f": {why}"]))
        late = dataclasses.replace(window, start=start, end=start + length, note=note)
        return Queued(late, queued.listener, moved_by=start - window.start, planned_end=window.end)

    def _may_begin(self, queued: Queued) -> bool:
        window = queued.window
        if window.source == "static":
            if not self.driver.static_selected():
                return False
            other = next((q.window for q in self.queue if q.window.overlaps(window.start, window.end)), None)
            if other is not None:
                log.info("ondemand_prof: static window %s skipped: on-demand window %s (%s) holds the profiler",
                         window.describe(), other.describe(), other.capture_id)
                return False
        problem = self.driver.disk_problem()
        if problem:
            log.error("ondemand_prof: skipping window %s on %s: %s", window.describe(), self.driver.who(), problem)
            tell(queued.listener, "failed", window, error=f"disk: {problem}")
            return False
        return True

    def _skip_due_static(self, step: int) -> None:
        """A static window whose time comes while another window holds the profiler is skipped, loudly."""
        assert self.active is not None
        holder = self.active.window
        for queued in [q for q in self.queue if q.window.source == "static"]:
            if plan_begin(queued.window, step, self.warmup_steps).phase is Phase.WAIT:
                continue
            self.queue.remove(queued)
            log.info("ondemand_prof: static window %s skipped: %s window %s (%s) holds the profiler",
                     queued.window.describe(), "on-demand" if holder.source != "static" else "static",
                     holder.describe(), holder.capture_id)

    def _begin(self, queued: Queued, step: int, phase: Phase) -> None:
        session, context = self.driver.open(queued.window)
        active = Active(queued.window, session, context, "warmup", queued.listener, moved_by=queued.moved_by,
                        planned_end=queued.planned_end)
        self.active = active
        tell(active.listener, "started", active.window, step=step,
             phase="warmup" if phase is Phase.WARMUP else "recording")
        if phase is Phase.WARMUP:
            session.warmup(step)
        else:
            self._start_recording(active, step)

    def _start_recording(self, active: Active, step: int) -> None:
        active.session.record(step)
        active.state = "recording"
        active.first_step = step
        active.late_by = max(0, step - active.window.start) + active.moved_by
        if active.late_by:
            log.warning("ondemand_prof: window %s began %d step(s) late, at step %d", active.window.describe(),
                        active.late_by, step)
        tell(active.listener, "recording", active.window, step=step, late_by=active.late_by,
             note=active.window.note or None)

    def _advance(self, step: int) -> None:
        active = self.active
        assert active is not None
        window = active.window
        if window.end is not None and step >= window.end:
            self._finish(step, ending=f"the window ended at step {step} during its warmup step (the loop's step "
                                      "numbers jumped past it); nothing was recorded")
        elif active.state == "warmup":
            if step >= window.start:
                self._start_recording(active, step)
        else:
            active.session.record(step)

    def _finish(self, step: int, ending: str = "") -> None:
        active = self.active
        assert active is not None
        self.active = None
        if active.state == "warmup":
            active.session.abort()
            tell(active.listener, "failed", active.window, error=ending or "ended during the warmup step")
            return
        export = self.driver.collect(active)  # session.finish(): collection stays on the training thread
        steps = recorded_steps(active.window, active.first_step, step)
        tell(active.listener, "writing", active.window, steps=steps, cancelled=active.cancelled or None)
        self.driver.export(active, steps, export)
        self.failures = 0

    def on_failure(self, exc: BaseException) -> None:
        self.failures += 1
        active, self.active = self.active, None
        if active is not None:
            active.session.abort()
            tell(active.listener, "failed", active.window, error=f"{type(exc).__name__}: {exc}")
        if self.failures >= MAX_CONSECUTIVE_FAILURES:
            self.disabled = True
            log.error("ondemand_prof: disabled after %d consecutive failures; training continues unprofiled. "
                      "Last error: %s: %s", self.failures, type(exc).__name__, exc)
        else:
            log.error("ondemand_prof: profiling window failed (training continues): %s: %s", type(exc).__name__,
                      exc, exc_info=exc)

    # ------------------------------------------------------------------------------------------------------
    # Views (any thread: copies of lists the training thread replaces, read under the GIL)

    @property
    def state(self) -> str:
        """idle, scheduled, warmup, recording, disabled, closed."""
        if self.closed or self.disabled:
            return "closed" if self.closed else "disabled"
        active = self.active
        if active is not None:
            return active.state
        return "scheduled" if any(q.window.source != "static" for q in list(self.queue)) else "idle"

    def windows(self) -> list[dict[str, Any]]:
        """The running window and the on-demand ones queued: the daemon plans new captures after them."""
        out = []
        active = self.active
        if active is not None:
            out.append(active.window.listed(active.state))
        out.extend(q.window.listed("scheduled") for q in list(self.queue) if q.window.source != "static")
        return out


def _held(window: Window, moved_by: int, planned_end: int | None) -> tuple[int, int | None]:
    """The steps a window holds against new requests: as planned. The daemon plans the next capture after the
    previous one's planned end; that one is accepted, and waits (then moves, saying why) if a moved window
    still records."""
    return (window.start - moved_by, planned_end) if moved_by else (window.start, window.end)


def tell(listener: Listener | None, event: str, window: Window, **info: Any) -> None:
    """Best effort: a listener that fails never affects the window."""
    if listener is None:
        return
    try:
        listener(event, {"capture_id": window.capture_id, "window": [window.start, window.end],
                         **{k: v for k, v in info.items() if v is not None}})
    except Exception:  # noqa: BLE001
        log.debug("ondemand_prof: listener failed", exc_info=True)
