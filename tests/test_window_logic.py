"""The pure parts, without processes: window planning, the step clock, rank specs, request validation."""

from __future__ import annotations

import pytest

from ondemand_prof import ProfileConfig
from ondemand_prof.requests import RequestError, absolute_start, parse_request
from ondemand_prof.window import Phase, StepClock, Window, parse_rank_spec, plan_begin, recorded_steps


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


def test_rank_specs():
    assert parse_rank_spec("0-3,7") == (0, 1, 2, 3, 7)
    assert parse_rank_spec(-1) == (-1,) and parse_rank_spec([1, "2"]) == (1, 2)
    for bad in ("3-1", "x", "", [True], "-5"):
        with pytest.raises(ValueError):
            parse_rank_spec(bad)


def test_requests():
    cfg = ProfileConfig(ondemand_steps=2, max_window_steps=50)
    empty = parse_request({}, cfg)
    assert (empty.start, empty.steps, empty.ranks, empty.options) == (1, 2, None, {})
    assert absolute_start(empty, 40) == 41
    req = parse_request({"start_step": 100, "steps": 500, "ranks": "0-1", "with_stack": True}, cfg)
    assert (req.steps, req.capped_from, req.ranks, absolute_start(req, 40)) == (50, 500, (0, 1), 100)
    assert req.window_options(cfg).with_stack is True
    for bad, msg in [({"start": 1, "start_step": 3}, "not both"), ({"steps": 2.5}, "must be an integer"),
                     ({"with_stack": "yes"}, "true or false"), ({"ranks": "a"}, "field 'ranks'"),
                     ({"id": 5}, "field 'id'")]:
        with pytest.raises(RequestError, match=msg):
            parse_request(bad, cfg)
