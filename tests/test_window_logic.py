"""The pure parts, without processes: window planning, the step clock, rank specs, request validation."""

from __future__ import annotations

import pytest

from ondemand_prof import ProfileConfig
from ondemand_prof.core.ranks import RankSpecError, parse_ranks, spans
from ondemand_prof.core.requests import RequestError, WindowDefaults, absolute_start, parse_request, resolve, \
    window_from_wire
from ondemand_prof.core.window import Phase, StepClock, Window, plan_begin, recorded_steps

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


@pytest.mark.parametrize("step,phase,wake,late", [
    (0, Phase.WAIT, 4, 0), (3, Phase.WAIT, 4, 0), (4, Phase.WARMUP, 5, 0), (5, Phase.RECORD, 6, 0),
    (7, Phase.RECORD, 8, 2), (8, Phase.MISSED, 8, 0),
])
def test_plan_begin(step, phase, wake, late):
    plan = plan_begin(Window(5, 8), step, warmup=1)
    assert (plan.phase, plan.wake, plan.late_by) == (phase, wake, late)


def test_window_until_close_is_never_missed():
    assert plan_begin(Window(2, None), 1000, 1).phase is Phase.RECORD
    assert recorded_steps(Window(2, None), 2, 6) == [2, 3, 4, 5]
    assert recorded_steps(Window(2, 5), 3, 9) == [3, 4]


def test_overlap():
    assert Window(5, 8).overlaps(7, 9) and not Window(5, 8).overlaps(8, 9)
    assert Window(5, None).overlaps(100, 101)


def test_step_clock_maps_time_to_step():
    clock = StepClock()
    for step, t in [(10, 100.0), (11, 100.5), (12, 101.0), (14, 102.0)]:
        clock.record(step, t)
    assert clock.step_at(99.0) is None
    assert clock.step_at(100.7) == 11 and clock.step_at(101.99) == 12 and clock.step_at(500) == 14
    assert clock.mean_step_time() == pytest.approx(0.5)
    clock.record(3, 103.0)  # the loop's counter went backwards: start afresh
    assert clock.step_at(102.5) is None and clock.step_at(103.5) == 3


def test_one_rank_grammar():
    assert parse_ranks("0-3,7") == (0, 1, 2, 3, 7) and parse_ranks(["0-1", 5]) == (0, 1, 5)
    assert parse_ranks(-1) == (-1,) and parse_ranks("0,-1") == (-1,) and parse_ranks([1, "2"]) == (1, 2)
    assert parse_ranks("0 3") == (0, 3) and spans((0, 1, 2, 5)) == "0-2,5" and spans((-1,)) == "all"
    for bad in ("3-1", "x", "", [True], "-5", "1.5", "0-99999999999"):
        with pytest.raises(RankSpecError):
            parse_ranks(bad)
    # bounded before expansion: a huge range is an error naming the limit, not gigabytes of integers
    with pytest.raises(RankSpecError, match="out of range"):
        parse_ranks("0-20000000")
    with pytest.raises(RankSpecError, match="world size 4"):
        parse_ranks("0-7", world_size=4)


def test_requests_are_checked_then_resolved_once():
    defaults = WindowDefaults.from_config(ProfileConfig(ondemand_steps=2, max_window_steps=50, level="level1"))
    empty = parse_request({})
    assert (empty.start, empty.steps, empty.ranks, empty.options) == (1, None, None, {})
    assert absolute_start(empty, 40) == 41
    window = resolve(empty, defaults, 41, source="file", capture_id="c")
    assert (window.start, window.end, window.options.level, window.note) == (41, 43, "level1", "")
    req = parse_request({"start_step": 100, "steps": 500, "ranks": "0-1", "with_stack": True})
    assert (req.steps, req.ranks, absolute_start(req, 40)) == (500, (0, 1), 100)
    capped = resolve(req, defaults, 100, source="daemon", capture_id="c")
    # the cap is applied once, where the window is planned, and said
    assert (capped.start, capped.end, capped.options.with_stack) == (100, 150, True)
    assert capped.note == "steps capped from 500 to 50 (--profile-max-window-steps)"
    # the wire form is what the daemon sends; the rank takes it as it is
    assert window_from_wire(capped.to_wire()) == capped
    for bad, msg in [({"start": 1, "start_step": 3}, "not both"), ({"steps": 2.5}, "must be an integer"),
                     ({"with_stack": "yes"}, "field 'with_stack' must be true or false"),
                     ({"level": "max"}, "field 'level' must be one of level_none"),
                     ({"ranks": "a"}, "field 'ranks'"), ({"id": 5}, "field 'id'"),
                     ({"save_path": "/etc"}, "unknown field")]:
        with pytest.raises(RequestError, match=msg):
            parse_request(bad)
    for bad_wire in [{"start_step": -1, "end_step": 3}, {"start_step": 1, "end_step": 3, "options": {}},
                     {**capped.to_wire(), "options": {**capped.to_wire()["options"], "level": "x"}}]:
        with pytest.raises(ValueError):
            window_from_wire(bad_wire)
