"""The rank's window policy, case by case, with a fake driver and fake sessions: no threads, no torch, no files.
The fake clock is the step number itself: the scheduler is only ever called at step boundaries."""

from __future__ import annotations

from typing import Any

import pytest

from ondemand_prof.core.options import WindowOptions
from ondemand_prof.core.window import Window
from ondemand_prof.rank.scheduler import IDLE, MAX_CONSECUTIVE_FAILURES, Active, Scheduler

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


class FakeSession:
    def __init__(self, log: list[tuple[Any, ...]], window: Window, fail_on: str = "") -> None:
        self.log, self.window, self.fail_on = log, window, fail_on

    def _call(self, what: str, *args: Any) -> None:
        if what == self.fail_on:
            raise RuntimeError(f"{what} failed")
        self.log.append((what, self.window.capture_id, *args))

    def warmup(self, step: int) -> None:
        self._call("warmup", step)

    def record(self, step: int) -> None:
        self._call("record", step)

    def finish(self) -> str:
        self._call("finish")
        return "export"

    def abort(self) -> None:
        self.log.append(("abort", self.window.capture_id))


class FakeDriver:
    def __init__(self, selected: bool = True, disk: str | None = None, fail_on: str = "") -> None:
        self.log: list[tuple[Any, ...]] = []
        self.exports: list[tuple[str, list[int]]] = []
        self.selected, self.disk, self.fail_on = selected, disk, fail_on

    def open(self, window: Window) -> tuple[FakeSession, Any]:
        return FakeSession(self.log, window, self.fail_on), {}

    def collect(self, active: Active) -> Any:
        return active.session.finish()

    def export(self, active: Active, steps: list[int], export: Any) -> None:
        self.exports.append((active.window.capture_id, steps))

    def static_selected(self) -> bool:
        return self.selected

    def disk_problem(self) -> str | None:
        return self.disk

    def who(self) -> str:
        return "rank 0"


def window(start: int, end: int | None, cid: str = "w", source: str = "daemon") -> Window:
    return Window(start, end, WindowOptions(), source=source, capture_id=cid)


def run(sched: Scheduler, first: int, last: int) -> None:
    for step in range(first, last + 1):
        sched.boundary(step)


def heard() -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    events: list[tuple[str, dict[str, Any]]] = []
    return events, lambda event, info: events.append((event, info))


def test_window_with_warmup_records_exactly_its_steps() -> None:
    driver = FakeDriver()
    sched = Scheduler(driver, warmup_steps=1)
    events, listener = heard()
    assert sched.submit(window(5, 8), listener) == (True, "scheduled")
    assert sched.next_wake(0) == 4  # nothing to do before the warmup step
    run(sched, 0, 9)
    assert driver.log == [("warmup", "w", 4), ("record", "w", 5), ("record", "w", 6), ("record", "w", 7),
                          ("finish", "w")]
    assert driver.exports == [("w", [5, 6, 7])]
    assert [e for e, _ in events] == ["started", "recording", "writing"]
    assert sched.next_wake(9) == IDLE and sched.state == "idle"


def test_overlapping_request_is_busy_and_names_the_blocker() -> None:
    sched = Scheduler(FakeDriver())
    assert sched.submit(window(5, 8, "a"))[0]
    ok, reason = sched.submit(window(7, 9, "b"))
    assert not ok and reason == "busy: window [5, 8) (daemon, a) holds the profiler"
    assert sched.submit(window(8, 9, "c"))[0]  # adjacent is fine
    assert [w["capture_id"] for w in sched.windows()] == ["a", "c"]


def test_the_daemon_planning_a_capture_again_replaces_its_queued_window() -> None:
    """A daemon window with the capture id of one queued replaces it (the daemon planned the capture again after
    a window it had not heard of); one with the id of the window recording is refused. A busy refusal names the
    window in the way as a field (Window.listed("busy")), which the daemon checks before use (busy_window)."""
    from ondemand_prof.core.window import busy_window

    sched = Scheduler(FakeDriver())
    assert sched.submit(window(10, 160, "file-1", source="file"))[0]
    ok, reason, busy = sched.place(window(12, 14, "c"))
    assert not ok and reason == "busy: window [10, 160) (file, file-1) holds the profiler"
    assert busy_window(busy.listed("busy")) == {"capture_id": "file-1", "start": 10, "end": 160, "source": "file",
                                              "state": "busy"}
    assert sched.submit(window(170, 172, "d"))[0] and sched.submit(window(180, 182, "d"))[0]
    assert [(w["capture_id"], w["start"]) for w in sched.windows()] == [("file-1", 10), ("d", 180)]
    run(sched, 0, 11)  # file-1 records
    assert sched.place(window(300, 302, "file-1", source="daemon")) == (
        False, "capture file-1 is already recording here", None)  # not busy: nothing to plan after
    until_close = {"capture_id": "x", "start": 5, "end": None, "source": "file", "state": "busy"}
    assert busy_window(until_close) == until_close
    for bad in ("busy: window [5, 8) (file, x) holds the profiler", None, {**until_close, "end": 3},
                {**until_close, "state": "recording"}, {**until_close, "start": -1}, {**until_close, "source": 5},
                {**until_close, "capture_id": "x" * 129}, {**until_close, "start": True}):
        assert busy_window(bad) is None, bad


def test_late_on_demand_window_is_moved_and_says_so() -> None:
    driver = FakeDriver()
    sched = Scheduler(driver, warmup_steps=1)
    events, listener = heard()
    sched.submit(window(5, 7), listener)
    run(sched, 20, 24)  # the request arrived after its end: it records its length, after a warmup step now
    assert driver.exports == [("w", [21, 22])]
    recording = dict(events)["recording"]
    assert recording["late_by"] == 16 and "moved from [5, 7) to [21, 23)" in recording["note"]


def test_on_demand_window_begun_late_still_records_the_steps_asked_for() -> None:
    """A request that reaches the rank inside its window (delivery slower than the daemon planned for) records
    its full length from there; a static window under way keeps its exact steps."""
    driver = FakeDriver()
    sched = Scheduler(driver, warmup_steps=1)
    events, listener = heard()
    sched.submit(window(5, 8), listener)
    run(sched, 6, 12)
    assert driver.exports == [("w", [7, 8, 9])]
    assert ("warmup", "w", 6) in driver.log  # its warmup step, as an on-time window has
    recording = dict(events)["recording"]
    assert recording["late_by"] == 2
    assert "moved from [5, 8) to [7, 10): it arrived at step 6, after its start" in recording["note"]
    static = FakeDriver()
    late_static = Scheduler(static, warmup_steps=0)
    late_static.submit(window(5, 8, "s", source="static"))
    run(late_static, 6, 12)
    assert static.exports == [("s", [6, 7])]


def test_the_window_planned_after_a_moved_one_is_accepted_and_says_why_it_waited() -> None:
    """The daemon plans a capture after the previous one's planned end. When the previous one was moved (it
    reached the rank late), the next is still accepted; it waits for the moved one to record its steps, then
    records its own, and its note says it arrived in time and waited (not that it arrived late)."""
    driver = FakeDriver()
    sched = Scheduler(driver, warmup_steps=1)
    sched.submit(window(10, 12, "a"), step=11)
    run(sched, 11, 12)  # "a" arrived at step 11, inside its window: warmup now, moved to [12, 14)
    assert sched.active is not None and (sched.active.window.start, sched.active.window.end) == (12, 14)
    events, listener = heard()
    assert sched.submit(window(12, 14, "b"), listener, step=12)[0]  # after a's planned end: not busy
    assert not sched.submit(window(11, 12, "c"), step=12)[0]  # within a's planned steps: busy
    run(sched, 12, 20)
    assert driver.exports == [("a", [12, 13]), ("b", [15, 16])]
    recording = dict(events)["recording"]
    assert recording["late_by"] == 3 and recording["note"] == (
        "moved from [12, 14) to [15, 17): it arrived at step 12, in time, but the profiler was busy until step 14")


def test_static_window_is_skipped_for_an_on_demand_one_and_when_missed() -> None:
    driver = FakeDriver()
    sched = Scheduler(driver, warmup_steps=0)
    sched.submit(window(10, 12, "static", source="static"))
    sched.submit(window(11, 13, "od"))
    run(sched, 0, 14)
    assert driver.exports == [("od", [11, 12])]  # the static one overlapping it was skipped
    missed = Scheduler(FakeDriver(), warmup_steps=0)
    events, listener = heard()
    missed.submit(window(2, 4, "s", source="static"), listener)
    run(missed, 10, 11)  # a resumed run already past the static window
    assert events[0][0] == "skipped" and "missed" in events[0][1]["error"]


def test_static_window_on_an_unselected_rank_and_full_disk() -> None:
    driver = FakeDriver(selected=False)
    sched = Scheduler(driver)
    sched.submit(window(1, 2, source="static"))
    run(sched, 0, 3)
    assert driver.log == []
    full = FakeDriver(disk="only 1 MB free")
    sched = Scheduler(full)
    events, listener = heard()
    sched.submit(window(1, 3), listener)
    run(sched, 0, 4)
    assert events == [("failed", {"capture_id": "w", "window": [1, 3], "error": "disk: only 1 MB free"})]


@pytest.mark.parametrize("ending", ["close", "jump"])
def test_a_window_that_ends_in_its_warmup_step_tells_its_listener(ending: str) -> None:
    driver = FakeDriver()
    sched = Scheduler(driver, warmup_steps=1)
    events, listener = heard()
    sched.submit(window(5, 8), listener)
    sched.boundary(4)  # warmup begins
    if ending == "close":
        sched.close(4)
    else:
        sched.boundary(9)  # the loop's numbers jumped past the window
    assert [e for e, _ in events] == ["started", "failed"]
    assert ("abort", "w") in driver.log and driver.exports == []
    assert "nothing was recorded" in events[-1][1]["error"] or "before the window began" in events[-1][1]["error"]


def test_cancel_writes_what_was_recorded_and_drops_queued_ones() -> None:
    driver = FakeDriver()
    sched = Scheduler(driver, warmup_steps=0)
    events, listener = heard()
    sched.submit(window(1, 10, "run"), listener)
    q_events, q_listener = heard()
    sched.submit(window(20, 22, "queued"), q_listener)
    run(sched, 0, 3)
    assert sched.cancel("run", 4) and sched.cancel("queued", 4)
    assert driver.exports == [("run", [1, 2, 3])]
    assert dict(events)["writing"]["cancelled"] is True
    assert q_events[0][0] == "cancelled" and not sched.cancel("nope", 4)


def test_close_fails_windows_that_never_began() -> None:
    sched = Scheduler(FakeDriver())
    events, listener = heard()
    sched.submit(window(50, 52), listener)
    sched.close(3)
    assert events == [("failed", {"capture_id": "w", "window": [50, 52],
                                  "error": "training ended at step 3, before the window"})]
    assert sched.submit(window(60, 61)) == (False, "profiler closed")


def test_repeated_failures_disable_the_scheduler() -> None:
    driver = FakeDriver(fail_on="record")
    sched = Scheduler(driver, warmup_steps=0)
    for i in range(MAX_CONSECUTIVE_FAILURES):
        events, listener = heard()
        assert sched.submit(window(10 * i + 1, 10 * i + 3, f"w{i}"), listener)[0]
        run(sched, 10 * i, 10 * i + 4)
        assert events[-1][0] == "failed" and "record failed" in events[-1][1]["error"]
    assert sched.disabled and sched.state == "disabled"
    assert sched.submit(window(100, 101)) == (False, "profiler disabled")
