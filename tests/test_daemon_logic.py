"""The daemon's pure parts, without processes: window planning, the rank registry, capture records, the
message schema."""

from __future__ import annotations

import json

import pytest

from ondemand_prof.host.records import CaptureRecord
from ondemand_prof.host.registry import RankInfo, Registry, plan_window
from ondemand_prof.core.protocol import ProtocolError, decode, encode
from ondemand_prof.host.commands import CLI_MESSAGES


def rank(r: int, step: int, step_time: float | None = 0.1, began: float = 100.0) -> RankInfo:
    return RankInfo(route=f"r{r}".encode(), job="j", rank=r, world_size=4, host="h", pid=1000 + r, step=step,
                    step_time=step_time, step_began_at=began)


def test_plan_starts_after_the_furthest_rank_with_lead_for_delivery() -> None:
    # rank 1 reported step 12 at t=100 with 0.1 s steps; at t=100.35 it is running step 15
    ranks = [rank(0, 10), rank(1, 12), rank(2, 11, step_time=None)]
    plan = plan_window(ranks, 100.35, start=None, start_step=None, steps=3)
    assert plan["current_steps"] == {0: 13, 1: 15, 2: 11}
    # delivery (0.05 s) may spill into the next step; the boundary after it begins the warmup step
    assert plan["lead_steps"] == 3
    assert (plan["start_step"], plan["end_step"]) == (18, 21)
    # fast steps need more lead: 5 ms steps -> ceil(0.05 / 0.005) + 2
    fast = plan_window([rank(0, 10, step_time=0.005)], 100.0, start=None, start_step=None, steps=1)
    assert fast["lead_steps"] == 12 and fast["start_step"] == 22
    # a larger requested offset wins over the lead
    later = plan_window(ranks, 100.35, start=30, start_step=None, steps=2)
    assert later["start_step"] == 45


def test_heartbeat_progress_corrects_a_median_still_weighed_by_slow_first_steps() -> None:
    reg = Registry()
    msg = {"job": "j", "rank": 0, "world_size": 1, "host": "h", "pid": 1}
    reg.register(b"r0", {**msg, "step": 2, "step_time": 0.5, "began": 100.0}, 0.0, 0.0, lambda pid, t: True)
    # a second later the rank is 50 steps on (20 ms steps) but its median still says 0.5 s
    info = reg.heartbeat(b"r0", {"step": 52, "step_time": 0.5, "began": 101.0}, 1.0)
    assert info is not None and info.observed_step_time == pytest.approx(0.02)
    assert info.estimated_step(101.2) == 62  # not 52: the faster of the two rates


def test_plan_goes_after_windows_already_on_the_ranks() -> None:
    busy = rank(1, 12)
    busy.windows = [{"capture_id": "file-abc", "start": 14, "end": 40, "source": "file", "state": "scheduled"}]
    plan = plan_window([rank(0, 10), busy], 100.0, start=None, start_step=None, steps=2)
    assert (plan["start_step"], plan["end_step"]) == (40, 42)
    assert plan["note"] == ("planned after window(s) file-abc already scheduled or running on rank(s) 1 "
                            "(from step 15 to 40)")
    busy.windows[0]["end"] = None
    with pytest.raises(ValueError, match=r"rank 1 records an open-ended window \[14, close\)"):
        plan_window([busy], 100.0, start=None, start_step=None, steps=2)


def test_absolute_start_names_the_ranks_that_will_be_late() -> None:
    plan = plan_window([rank(0, 10), rank(1, 20)], 100.0, start=None, start_step=21, steps=2)
    assert (plan["start_step"], plan["end_step"]) == (21, 23)
    assert plan["late_ranks"] == [1]


def test_registry_selects_live_ranks_and_names_missing_ones() -> None:
    reg = Registry()
    msg = {"job": "j", "world_size": 8, "host": "h", "pid": 1, "step": 0}
    for r in (0, 1, 2, 5):
        reg.register(f"r{r}".encode(), {**msg, "rank": r, "pid": 100 + r}, 0.0, 0.0, lambda pid, thorough: True)
    assert [r.rank for r in reg.select("j", (-1,))] == [0, 1, 2, 5]
    with pytest.raises(ValueError, match=r"rank\(s\) 3-4,7 of job 'j' are not registered; live ranks: 0-2,5 "
                                         r"\(world size 8\)"):
        reg.select("j", (0, 3, 4, 7))
    assert reg.resolve_job(None) == "j"
    with pytest.raises(ValueError, match="no live job 'k'"):
        reg.resolve_job("k")
    # a rank restarted in a new process replaces its old entry
    reg.register(b"new", {**msg, "rank": 1, "pid": 999}, 0.0, 0.0, lambda pid, thorough: True)
    assert [r.pid for r in reg.select("j", (1,))] == [999]
    # heartbeats stop: gone after the timeout; a pid that exits: gone at the next check
    reg.heartbeat(b"r0", {"step": 5}, 3.0)
    reg.heartbeat(b"r5", {"step": 5}, 3.0)
    dead = {105}
    gone = reg.expire(4.0, lambda pid, thorough: pid not in dead)
    assert sorted((g.rank, reason.split(" ")[0]) for g, reason in gone) == [(1, "no"), (2, "no"), (5, "process")]
    assert [r.rank for r in reg.select("j", (-1,))] == [0]


def test_record_settles_to_done_partial_or_failed_and_never_moves_back() -> None:
    plan = {"start_step": 5, "end_step": 7}
    rec = CaptureRecord.new("c1", "j", {"steps": 2}, plan, {}, [{"rank": r, "host": "h", "pid": r} for r in (0, 1)], 0.0)
    assert rec.update(0, "recording", {"late_by": 1}, 1.0)
    assert not rec.update(0, "scheduled", {}, 2.0)  # a late "scheduled" after "recording" is ignored
    assert rec.update(0, "done", {"path": "/p0"}, 3.0) and rec.status == "running"
    assert rec.fail_rank(1, "rank 1 is gone", 4.0)
    assert rec.status == "partial" and rec.part(0)["late_by"] == 1
    assert not rec.update(1, "done", {}, 5.0)  # final is final
    all_failed = CaptureRecord.new("c2", "j", {}, plan, {}, [{"rank": 0, "host": "h", "pid": 0}], 0.0)
    all_failed.update(0, "rejected", {"error": "busy"}, 1.0)
    assert all_failed.status == "failed"


def test_messages_are_versioned_and_checked() -> None:
    assert decode(encode("show", id=1, capture_id="x"), CLI_MESSAGES)["capture_id"] == "x"
    for body, text in [(b"{}", "protocol version None"),
                       (json.dumps({"v": 1, "type": "watch", "capture_id": "x", "seen": True}).encode(),
                        "field 'seen' must be int"),
                       (b"\xff\xfe", "not a JSON message")]:
        with pytest.raises(ProtocolError, match=text):
            decode(body, CLI_MESSAGES)
