"""The daemon's pure parts, without processes: window planning, the rank registry, capture records, the
message schema."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import inprocess_daemon, make_service, register_msg
from ondemand_prof.host.records import CaptureRecord
from ondemand_prof.host.planning import plan_window
from ondemand_prof.host.registry import RankConflict, RankInfo, Registry
from ondemand_prof.host.stalls import stall_text, stalls
from ondemand_prof.core.protocol import ProtocolError, decode, encode
from ondemand_prof.host.commands import CLI_MESSAGES

pytestmark = pytest.mark.quick


def rank(r: int, step: int, step_time: float | None = 0.1, began: float = 100.0) -> RankInfo:
    return RankInfo(route=f"r{r}".encode(), job="j", rank=r, world_size=4, host="h", pid=1000 + r, step=step,
                    step_time=step_time, step_began_at=began)


def test_plan_starts_after_the_furthest_rank_with_lead_for_delivery() -> None:
    # rank 1 reported step 12 at t=100 with 0.1 s steps; at t=100.35 it is running step 15
    ranks = [rank(0, 10), rank(1, 12), rank(2, 11, step_time=None)]
    plan = plan_window(ranks, 100.35, start=None, start_step=None, steps=3)
    assert plan.current_steps == {0: 13, 1: 15, 2: 11}
    # delivery (0.05 s) may spill into the next step; the boundary after it begins the warmup step
    assert plan.lead_steps == 3
    assert (plan.start_step, plan.end_step) == (18, 21)
    # fast steps need more lead: 5 ms steps -> ceil(0.05 / 0.005) + 2
    fast = plan_window([rank(0, 10, step_time=0.005)], 100.0, start=None, start_step=None, steps=1)
    assert fast.lead_steps == 12 and fast.start_step == 22
    # a larger requested offset wins over the lead
    later = plan_window(ranks, 100.35, start=30, start_step=None, steps=2)
    assert later.start_step == 45


def test_heartbeat_progress_corrects_a_median_still_weighed_by_slow_first_steps() -> None:
    reg = Registry()
    msg = {"job": "j", "rank": 0, "world_size": 1, "host": "h", "pid": 1}
    reg.register(b"r0", {**msg, "step": 2, "step_time": 0.5, "began": 100.0}, 0.0, 0.0, lambda pid, t: True)
    # a second later the rank is 50 steps on (20 ms steps) but its median still says 0.5 s
    info = reg.heartbeat(b"r0", {"step": 52, "step_time": 0.5, "began": 101.0}, 1.0)
    assert info is not None and info.observed_step_time == pytest.approx(0.02)
    assert info.estimated_step(101.2) == 62  # not 52: the faster of the two rates


def test_a_hung_rank_is_stalled_not_extrapolated() -> None:
    """Rank 1 asleep before a collective: its agent still sends heartbeats (step 40, began at 100.0). Status
    shows the step it reported, STALLED after max(10 s, 20 median steps), and planning does not count on it."""
    reg = Registry()
    msg = {"job": "j", "world_size": 2, "host": "h", "step": 40, "step_time": 0.05, "began": 100.0}
    reg.register(b"r1", {**msg, "rank": 1, "pid": 11}, 0.0, 100.0, lambda pid, t: True)
    info = reg.heartbeat(b"r1", msg, 60.0, 160.0)  # a minute later, still in step 40
    assert info is not None
    assert info.estimated_step(160.5) == 40  # was 40 + 60.5 / 0.05 = 1250 before
    row = info.as_dict(60.5, 160.5)
    assert (row["step"], row["stalled_s"], row["step_estimate"]) == (40, 60.5, 40)
    assert info.stalled_s(109.0) is None  # 9 s: under the 10 s floor
    slow = RankInfo(b"", "j", 0, 1, "h", 1, 7, step_time=2.0, step_began_at=100.0)
    assert slow.stalled_s(139.0) is None and slow.stalled_s(141.0) == 41.0  # 20 steps of 2 s
    starting = RankInfo(b"", "j", 0, 1, "h", 1, 0, step_began_at=100.0)  # no step finished yet: starting up
    assert starting.stalled_s(400.0) is None
    stall = stalls([row, {"rank": 0, "step": 41, "stalled_s": None}], 160.5)
    assert stall is not None and stall["ranks"] == [1] and stall["steps"] == {"1": 40} and not stall["all"]
    assert "job j is STALLED: rank(s) 1 have not finished a step for 60 s" in stall_text("j", stall)
    assert "ondemandctl stacks --job j" in stall_text("j", stall)


def test_a_heartbeat_read_late_is_not_a_stall() -> None:
    """A daemon starved of CPU reads a heartbeat 13 s after the rank sent it (the step had run 0.1 s then):
    the rank is not stalled; its time in the step is what it measured plus the time since we read it."""
    reg = Registry()
    msg = {"job": "j", "world_size": 1, "host": "h", "rank": 0, "pid": 1, "step": 500, "step_time": 0.05,
           "began": 100.0, "at": 100.1}
    reg.register(b"r0", msg, 0.0, 113.1, lambda pid, t: True)
    info = reg.heartbeat(b"r0", msg, 1.0, 113.1)
    assert info is not None and info.in_step_s(113.3) == pytest.approx(0.3) and info.stalled_s(113.3) is None
    reg.heartbeat(b"r0", {**msg, "at": 112.0}, 2.0, 113.2)  # the same step, sent at 112: stalled for 12 s
    assert info.stalled_s(113.2) == pytest.approx(12.0)


def test_a_long_step_is_not_extrapolated_past_the_last_heartbeat() -> None:
    """A step that has run 3 s (median 0.1 s) is not 30 steps on: the rank said step 50 0.2 s ago, so now it is
    at most the step after 50 plus what 0.2 s of steps adds."""
    info = RankInfo(b"", "j", 0, 1, "h", 1, 50, step_time=0.1, step_began_at=100.0, heard_at=102.8)
    assert info.estimated_step(103.0) == 53
    info.heard_at = None  # a caller that does not know when it heard the rank: the old estimate
    assert info.estimated_step(103.0) == 80


def test_plan_goes_after_windows_already_on_the_ranks() -> None:
    busy = rank(1, 12)
    busy.windows = [{"capture_id": "file-abc", "start": 14, "end": 40, "source": "file", "state": "scheduled"}]
    plan = plan_window([rank(0, 10), busy], 100.0, start=None, start_step=None, steps=2)
    assert (plan.start_step, plan.end_step) == (40, 42)
    assert plan.note == ("planned after window(s) file-abc already scheduled or running on rank(s) 1 "
                            "(from step 15 to 40)")
    busy.windows[0]["end"] = None
    with pytest.raises(ValueError, match=r"rank 1 records an open-ended window \[14, close\)"):
        plan_window([busy], 100.0, start=None, start_step=None, steps=2)


def test_absolute_start_names_the_ranks_that_will_be_late() -> None:
    plan = plan_window([rank(0, 10), rank(1, 20)], 100.0, start=None, start_step=21, steps=2)
    assert (plan.start_step, plan.end_step) == (21, 23)
    assert plan.late_ranks == (1,) and plan.past_ranks == ()  # close to it: may be late, not past it
    assert plan_window([rank(0, 10), rank(1, 20)], 100.0, start=None, start_step=15, steps=2).past_ranks == (1,)


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
    # a second live process claiming rank 1 is refused, the first keeps it, and the conflict is kept for status
    with pytest.raises(RankConflict, match=r"rank 1 of job 'j' is held by pid 101 on h, which is alive; pid 999"):
        reg.register(b"new", {**msg, "rank": 1, "pid": 999}, 0.0, 0.0, lambda pid, thorough: True)
    assert [r.pid for r in reg.select("j", (1,))] == [101]
    assert [(c["pid"], c["refused_pid"], c["attempts"]) for c in reg.conflicts_of("j", 1.0)] == [(101, 999, 1)]
    # a rank restarted in a new process (the old one gone) replaces its old entry; the conflict is over
    reg.register(b"new", {**msg, "rank": 1, "pid": 999}, 0.0, 0.0, lambda pid, thorough: pid != 101)
    assert [r.pid for r in reg.select("j", (1,))] == [999] and reg.conflicts_of("j", 1.0) == []
    # heartbeats stop: gone after the timeout; a pid that exits: gone at the check after the one that saw it
    # (its bye, if it said one, is read in between)
    reg.heartbeat(b"r0", {"step": 5}, 3.0)
    reg.heartbeat(b"r5", {"step": 5}, 3.0)
    dead = {105}
    gone = reg.expire(4.0, lambda pid, thorough: pid not in dead)
    assert sorted((g.rank, reason.split(" ")[0]) for g, reason in gone) == [(1, "no"), (2, "no")]
    assert [r.rank for r in reg.select("j", (-1,))] == [0, 5]
    assert reg.expire(4.0, lambda pid, thorough: pid not in dead) == []  # no time has passed: nothing was read
    gone = reg.expire(4.5, lambda pid, thorough: pid not in dead)
    assert [(g.rank, reason) for g, reason in gone] == [(5, "process 105 on h exited")]
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


def test_a_record_whose_ranks_recorded_different_steps_settles_misaligned_once(tmp_path: Path) -> None:
    """The outcome is the record's: misaligned when its last part is final (not judged again by each reader), in
    its summary (list) with the steps each group recorded; a record an older daemon settled `done` is settled
    again when read back."""
    from ondemand_prof.host.records import RecordStore

    plan = {"start_step": 5, "end_step": 7}
    rec = CaptureRecord.new("20260101-000000-aaaaaa", "j", {"steps": 2}, plan, {},
                            [{"rank": r, "host": "h", "pid": r} for r in (0, 1)], 0.0)
    rec.update(0, "done", {"path": "/p0", "steps": [5, 6]}, 1.0)
    assert rec.status == "running"
    rec.update(1, "done", {"path": "/p1", "steps": [9, 10]}, 2.0)
    assert rec.status == "misaligned" and rec.data["misaligned"]["text"] == (
        "ranks recorded different steps: rank(s) 0 recorded steps 5..6; rank(s) 1 recorded steps 9..10")
    assert rec.summary()["status"] == "misaligned" and rec.summary()["recorded"] == [[5, 6, 2], [9, 10, 2]]
    older = {**rec.data, "capture_id": "20260101-000000-bbbbbb", "status": "done"}
    older.pop("misaligned")
    store = RecordStore(tmp_path)
    (store.dir / f"{older['capture_id']}.json").write_text(json.dumps(older))
    again = RecordStore(tmp_path).records[older["capture_id"]]
    assert again.status == "misaligned" and "misaligned" in json.loads((store.dir / f"{older['capture_id']}.json")
                                                                       .read_text())


def test_messages_are_versioned_and_checked() -> None:
    assert decode(encode("show", id=1, capture_id="x"), CLI_MESSAGES)["capture_id"] == "x"
    for body, text in [(b"{}", "protocol version None"),
                       (json.dumps({"v": 1, "type": "watch", "capture_id": "x", "seen": True}).encode(),
                        "field 'seen' must be int"),
                       (b"\xff\xfe", "not a JSON message")]:
        with pytest.raises(ProtocolError, match=text):
            decode(body, CLI_MESSAGES)


def test_service_handlers_without_sockets(tmp_path) -> None:
    """The daemon's service is driven directly: register, capture (resolved once, capped and said), progress
    from heartbeats ("recording step k of N"), cancel, and typed errors for bad requests."""
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.requests import WindowDefaults, window_from_wire
    from ondemand_prof.host.commands.follow import recording_step

    svc = make_service(tmp_path)
    defaults = WindowDefaults.from_config(ProfileConfig(max_window_steps=5, with_stack=True)).to_wire()
    for r in (0, 1):
        reply = svc.handle(f"r{r}".encode(), register_msg(r, 2, defaults=defaults))
        assert reply is not None and json.loads(reply)["type"] == "registered"
    reply = json.loads(svc.handle(b"cli", {"type": "capture", "id": 1, "request": {"steps": 50, "ranks": "0-1"}}))
    assert reply["type"] == "ok", reply
    record = reply["data"]
    start, end = record["window"]
    assert end - start == 5 and record["options"]["with_stack"] is True  # the ranks' cap and defaults, once
    assert "steps capped from 50 to 5" in record["plan"]["note"]
    sent = {route: json.loads(body) for route, body in svc.outbox}
    assert set(sent) == {b"r0", b"r1"}
    window = window_from_wire(sent[b"r0"]["window"])
    assert (window.start, window.end, window.options.with_stack) == (start, end, True)
    cid = record["capture_id"]
    svc.handle(b"r0", {"type": "event", "capture_id": cid, "event": "recording", "info": {"late_by": 0}})
    svc.handle(b"r0", {"type": "hb", "step": start + 2, "state": "recording",
                       "windows": [{"capture_id": cid, "start": start, "end": end, "source": "daemon",
                                    "state": "recording"}]})
    shown = svc.store.records[cid].data
    assert recording_step(shown, shown["parts"]["0"]) == "recording step 3 of 5"
    svc.outbox.clear()
    cancel = json.loads(svc.handle(b"cli", {"type": "cancel", "id": 2, "capture_id": cid[-6:]}))
    assert cancel["data"]["ranks"] == [0, 1] and {json.loads(b)["type"] for _, b in svc.outbox} == {"cancel"}
    for body, text in [({"type": "capture", "id": 3, "request": {"steps": 2, "ranks": "0-9"}}, "out of range"),
                       ({"type": "capture", "id": 4, "request": {"save_path": "/etc"}}, "unknown field"),
                       ({"type": "show", "id": 5, "capture_id": "zzz"}, "no capture 'zzz'"),
                       ({"type": "status", "id": 6, "job": "nope"}, "no live job 'nope'")]:
        err = json.loads(svc.handle(b"cli", body))
        assert err["type"] == "error" and text in err["error"], err


def test_a_capture_refused_for_a_window_the_daemon_did_not_know_is_planned_again_once(tmp_path: Path) -> None:
    """Rank 0 refuses the daemon's window as busy with a trigger file's window the daemon had not heard of: the
    refusal is held until rank 1 has answered, then the capture is planned after the file's window and both
    ranks get the new one; rank 1's late refusal of the old window is dropped. Planned again once: a refusal of
    the new window stands. An absolute --start-step is never moved."""
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.requests import WindowDefaults, window_from_wire
    svc = make_service(tmp_path)
    defaults = WindowDefaults.from_config(ProfileConfig()).to_wire()
    for r in (0, 1):
        svc.handle(b"r%d" % r, register_msg(r, 2, step_time=0.1, defaults=defaults))
    record = json.loads(svc.handle(b"cli", {"type": "capture", "id": 1, "request": {"steps": 2}}))["data"]
    cid, (start, end) = record["capture_id"], record["window"]
    sent = [window_from_wire(json.loads(b)["window"]) for _, b in svc.outbox]
    assert {(w.start, w.end) for w in sent} == {(start, end)}
    svc.outbox.clear()

    def event(r: int, state: str, window: list[int], **info: Any) -> None:
        svc.handle(b"r%d" % r, {"type": "event", "capture_id": cid, "event": state,
                                "info": {"window": window, **info}})

    def busy(a: int, b: int, source: str, holder: str) -> dict[str, Any]:
        """A rank's busy refusal as rank/agent.py sends it: the text, and the window in the way as a field."""
        return {"error": f"busy: window [{a}, {b}) ({source}, {holder}) holds the profiler",
                "busy": {"capture_id": holder, "start": a, "end": b, "source": source, "state": "busy"}}

    for r in (0, 1):
        event(r, "received", [start, end])
    event(0, "rejected", [start, end], **busy(start - 1, start + 149, "file", "file-1"))
    held = svc.store.records[cid]
    assert held.part(0)["state"] == "received" and held.status == "running" and not svc.outbox  # rank 1 to answer
    event(1, "scheduled", [start, end])
    replanned = svc.store.records[cid].data
    assert replanned["window"] == [start + 149, start + 151], replanned["window"]
    assert replanned["plan"]["replanned"] == {"from": [start, end], "why": (
        f"replanned after window [{start - 1}, {start + 149}) (file, file-1), which held rank(s) 0 and the daemon "
        f"had not heard of (from step {start} to {start + 149})")}
    again = {route: window_from_wire(json.loads(b)["window"]) for route, b in svc.outbox}
    assert {r: (w.start, w.end, w.capture_id) for r, w in again.items()} == {
        b"r0": (start + 149, start + 151, cid), b"r1": (start + 149, start + 151, cid)}
    assert again[b"r0"].note.startswith("replanned after window")
    event(1, "rejected", [start, end], **busy(start - 1, start + 149, "file", "file-1"))  # the old window: dropped
    assert held.part(1)["state"] == "scheduled"
    new = replanned["window"]
    event(0, "scheduled", new)
    event(1, "rejected", new, **busy(new[0], new[0] + 50, "signal", "s-1"))
    assert held.part(1)["state"] == "rejected" and held.part(0)["state"] == "scheduled"  # once only

    absolute = json.loads(svc.handle(b"cli", {"type": "capture", "id": 2, "request": {"steps": 2, "ranks": [0],
                                                                                     "start_step": 1000}}))["data"]
    cid = absolute["capture_id"]
    event(0, "received", [1000, 1002])
    event(0, "rejected", [1000, 1002], **busy(990, 1100, "file", "file-2"))
    assert svc.store.records[cid].status == "failed"


def test_a_rank_reports_several_events_in_one_message(tmp_path: Path) -> None:
    """The daemon says at registration how many events a message may carry; a batch is applied in order, and a
    batch with one bad item (or too many) is refused whole, with the reason."""
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.requests import WindowDefaults
    from ondemand_prof.host.transport import SCHEMA

    defaults = WindowDefaults.from_config(ProfileConfig()).to_wire()
    svc = make_service(tmp_path)
    for r in (0, 1):
        reply = json.loads(svc.handle(f"r{r}".encode(), register_msg(r, 2, defaults=defaults)))
        assert reply["type"] == "registered" and reply["events_batch"] == 32
    cid = json.loads(svc.handle(b"cli", {"type": "capture", "id": 1, "request": {"steps": 2}}))["data"]["capture_id"]

    def events(*items: tuple[str, str, dict]) -> dict:
        frame = encode("events", events=[{"capture_id": c, "event": e, "info": i} for c, e, i in items])
        return decode(frame, SCHEMA)  # what the transport hands the service

    assert svc.handle(b"r0", events((cid, "received", {"current_step": 101}), (cid, "scheduled", {}))) is None
    part = svc.store.records[cid].data["parts"]["0"]
    assert part["state"] == "scheduled" and [h["state"] for h in part["history"]] == ["sent", "received", "scheduled"]
    for msg, text in [(events((cid, "recording", {}), ("../x", "done", {})), "item 1 is not"),
                      (events(*[(cid, "recording", {})] * 33), "1 to 32 events a message, got 33"),
                      ({"type": "events", "events": []}, "got 0")]:
        err = json.loads(svc.handle(b"r1", msg))
        assert err["type"] == "error" and text in err["error"], err
    assert svc.store.records[cid].data["parts"]["1"]["state"] == "sent"  # nothing of a refused batch applied


def test_the_lead_grows_when_windows_reached_ranks_late(tmp_path) -> None:
    """A rank that took a window five steps after the plan had it (a loaded host) makes the next plan start
    far enough ahead for that; `status` says so. A stalled rank cannot push windows out beyond 5 s."""
    import time

    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.requests import WindowDefaults
    from ondemand_prof.host.commands import DAEMON_COMMANDS
    from ondemand_prof.host.planning import DeliveryTimes

    svc = make_service(tmp_path)
    defaults = WindowDefaults.from_config(ProfileConfig()).to_wire()
    svc.handle(b"r0", register_msg(0, step_time=0.1, defaults=defaults))

    def capture() -> dict:
        reply = json.loads(svc.handle(b"cli", {"type": "capture", "id": 1, "request": {"steps": 2}}))
        assert reply["type"] == "ok", reply
        return reply["data"]

    first = capture()
    assert first["plan"]["lead_steps"] == 3  # 50 ms of delivery within a 100 ms step, plus two
    planned = first["plan"]["current_steps"]["0"]  # (the reply is JSON: keys are strings)
    # another process claiming rank 0 of the job (from another "host") is not the one the window went to
    svc.handle(b"x0", register_msg(0, pid=30, host="x", step_time=0.1, defaults=defaults))
    svc.handle(b"x0", {"type": "event", "capture_id": first["capture_id"], "event": "scheduled",
                       "info": {"current_step": planned + 10**6, "window": first["window"]}})
    assert svc.delivery.estimate("j") == 0.05
    svc.registry.remove(b"x0")
    svc.handle(b"r0", {"type": "event", "capture_id": first["capture_id"], "event": "scheduled",
                       "info": {"current_step": planned + 6, "window": first["window"]}})
    assert capture()["plan"]["lead_steps"] == 7  # 0.5 s of delivery at 0.1 s a step, plus two
    status = json.loads(svc.handle(b"cli", {"type": "status", "id": 3}))["data"]
    assert status["delivery_s"] == {"j": pytest.approx(0.5)}
    assert "windows took up to 500 ms to reach this job's ranks lately" in \
        DAEMON_COMMANDS["status"].console(status, None)
    # another job's ranks (another user's, perhaps) do not lengthen this job's lead, and the other way round;
    # a job with no live rank left is forgotten (names like port29500 come back with the next run)
    assert svc.delivery.estimate("other") == 0.05
    svc.delivery.keep_only(["other"])
    assert svc.delivery.estimate("j") == 0.05
    stalled = DeliveryTimes(keep=2)
    stalled.learn("a", 100, 10**6, 0.1)
    stalled.learn("b", 100, 200, None)  # no step time: nothing learned
    assert stalled.estimate() == 5.0 and list(stalled.slowest) == ["a"]
    stalled.learn("b", 100, 101, 0.1)
    stalled.learn("c", 100, 103, 0.1)  # "a" is the oldest of three captures: forgotten
    assert list(stalled.slowest) == ["b", "c"] and stalled.estimate() == pytest.approx(0.2)


def test_a_reported_output_path_with_a_nul_is_refused_not_raised(tmp_path: Path) -> None:
    """The fuzz test found it: a done event whose path held a NUL byte raised ValueError inside the daemon's
    handler (os.open refuses it) and logged a traceback; it is refused like any other bad path."""
    from ondemand_prof.host.service import output_path_problem

    (tmp_path / "trace.json").write_text("{}")
    assert output_path_problem(str(tmp_path / "trace.json"), str(tmp_path), os.getuid()) is None
    assert output_path_problem(str(tmp_path) + "/tr\0ace.json", str(tmp_path), os.getuid()) == "not a path"


def test_a_watch_answers_with_the_parts_changed_since_the_callers_version(tmp_path: Path) -> None:
    """watch with changed_only: the reply carries only the parts that moved after the version the caller holds,
    and merged into the caller's copy it equals the whole record; a version from before the daemon read the
    record back (a restart), or one it never gave out, gets the whole record."""
    from ondemand_prof.host.commands.follow import merge_watched
    from ondemand_prof.host.commands.watch import Watch
    from ondemand_prof.host.records import RecordStore

    store = RecordStore(tmp_path)
    record = CaptureRecord.new("20260101-000000-aaaaaa", "j", {"steps": 1}, {"start_step": 5, "end_step": 6},
                               {}, [{"rank": r, "host": "h", "pid": 10 + r} for r in range(4)], 0.0)
    store.add(record)
    held = record.view()
    assert record.update(2, "received", {"current_step": 3}, 1.0) and record.update(3, "received", {}, 1.0)
    svc = type("S", (), {"find": lambda self, cid: store.records[cid]})()
    reply = Watch().execute(svc, b"cli", {"capture_id": record.capture_id, "seen": held["version"],
                                          "changed_only": True})
    assert reply["changed_only"] and sorted(reply["parts"]) == ["2", "3"] and reply["version"] == 2
    assert merge_watched(held, reply) == record.view()
    assert "changed_only" not in Watch().execute(svc, b"cli", {"capture_id": record.capture_id, "seen": 1})
    assert "changed_only" not in record.view(since=99)  # a version this daemon never gave out
    store.save(record)
    again = RecordStore(tmp_path).records[record.capture_id]  # read back, as after a restart
    assert again.version > 10**12 and len(again.view(since=held["version"])["parts"]) == 4
    assert again.view(since=again.version)["parts"] == {}


def test_the_rank_link_batches_events_only_for_a_daemon_that_takes_them(tmp_path: Path) -> None:
    """The rank's real DaemonLink against a bare ROUTER socket standing for the daemon: a window's "received" and
    "scheduled" leave in one "events" message when the daemon's "registered" reply allows it, and as two "event"
    messages for a daemon that does not say so (an older one)."""
    from types import SimpleNamespace

    import zmq

    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.protocol import endpoint
    from ondemand_prof.rank.backends import Identity
    from ondemand_prof.rank.daemon_link import DaemonLink

    ident = Identity(rank=0, world_size=1, local_rank=0, host="h", pid=os.getpid(), job_id="j", dist_initialized=True)
    prof = SimpleNamespace(config=ProfileConfig(save_path=str(tmp_path)), identity=lambda: ident, current_step=5,
                           state="idle")
    agent = SimpleNamespace(config=prof.config, prof=prof, trigger_dir="", wake=lambda: None,
                            step_time=lambda: 0.1, step_began=lambda: (5, time.time()),
                            triage=SimpleNamespace(native=SimpleNamespace(announce=lambda: None)))
    ctx = zmq.Context()
    try:
        for announced, expected in (({"events_batch": 32}, ["events"]), ({}, ["event", "event"])):
            run = tmp_path / f"run{len(announced)}"
            run.mkdir(mode=0o700)
            router = ctx.socket(zmq.ROUTER)
            router.bind(endpoint(run))
            link = DaemonLink(agent, run, context=ctx)  # type: ignore[arg-type]

            def received(timeout_ms: int = 5000) -> list[dict]:
                out = []
                while router.poll(timeout_ms if not out else 200):
                    route, body = router.recv_multipart()
                    out.append(json.loads(body))
                    link_route[0] = route
                return out

            link_route = [b""]
            deadline = time.monotonic() + 10
            while not router.poll(50) and time.monotonic() < deadline:  # until the connection is made
                if not link.registered:
                    link._next_beat = 0.0  # noqa: SLF001 - register at once, not a second later
                link.poll(time.monotonic())
            # a heartbeat may follow the registration when the loop went round again before it arrived
            assert [m["type"] for m in received() if m["type"] != "hb"] == ["register"]
            router.send_multipart([link_route[0], encode("registered", **announced)])
            deadline = time.monotonic() + 5
            while not link.acknowledged and time.monotonic() < deadline:
                link.poll(time.monotonic())
                time.sleep(0.01)
            listen = link.listener_for("CID1")
            listen("received", {"current_step": 5})
            listen("scheduled", {"window": [7, 9], "current_step": 5})
            link.poll(time.monotonic())
            msgs = [m for m in received() if m["type"] != "hb"]
            assert [m["type"] for m in msgs] == expected
            items = msgs[0]["events"] if expected == ["events"] else msgs
            assert [(i["capture_id"], i["event"]) for i in items] == [("CID1", "received"), ("CID1", "scheduled")]
            if announced:  # a window the rank opened itself: its "opened" is told again at a registration, before
                # where it is now (a daemon that took the rank for gone had dropped it: no record was made)
                from ondemand_prof.core.requests import CaptureRequest, WindowDefaults, resolve

                cid = "file-00000000000000ab"
                window = resolve(CaptureRequest(steps=2), WindowDefaults.from_config(prof.config), 20, source="file",
                                 capture_id=cid)
                link.opened(window, lambda event, info: None)("scheduled", {"window": [20, 22]})
                link.poll(time.monotonic())
                received()
                link.reregister()
                link.poll(time.monotonic())
                (reg,) = [m for m in received() if m["type"] == "register"]
                assert [(r["capture_id"], r["event"]) for r in reg["recent"] if r["capture_id"] == cid] == [
                    (cid, "opened"), (cid, "scheduled")]
            link.close()
            router.close(linger=0)
    finally:
        ctx.destroy(linger=0)  # closes whatever a failed assertion left open


def test_record_times_are_local_with_offset_across_a_dst_fold_and_a_rounding_carry(monkeypatch) -> None:
    """What `show` prints beside each state: local time with its offset, to the millisecond. iso_time keeps each
    second's text; the repeated hour when clocks go back (same local second, two offsets) and a fraction that
    rounds up into the next second must still read as datetime reads them."""
    import datetime as dt
    from ondemand_prof.core import files

    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        fold = 1792887600.25  # 2026-10-25 00:20 UTC: 02:20 CEST (+02:00); an hour later 02:20 again, CET (+01:00)
        for t, want in [(fold, "2026-10-25T02:20:00.250+02:00"), (fold + 3600, "2026-10-25T02:20:00.250+01:00"),
                        (fold + 0.7499996, "2026-10-25T02:20:01.000+02:00")]:
            assert files.iso_time(t) == want
            local = dt.datetime.fromtimestamp(t).astimezone()
            assert want == local.replace(microsecond=0).isoformat()[:19] + f".{local.microsecond // 1000:03d}" + \
                local.isoformat()[-6:]
        record = CaptureRecord.new("c1", "j", {}, {"start_step": 1, "end_step": 2}, {},
                                   [{"rank": 0, "host": "h", "pid": 1}], fold + 3600)
        assert record.data["created_at"] == "2026-10-25T02:20:00.250+01:00"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_records_are_ordered_by_time_not_text_across_a_dst_fold(tmp_path: Path, monkeypatch) -> None:
    """Clocks go back: 02:50 CEST is older than the 02:10 CET that follows it, though its text sorts later.
    `list` (one host, and merged from two), the order read back from disk and so what is evicted first follow
    time; a record whose created_at is no time is skipped when read back, and says why."""
    from ondemand_prof.host.client import Reply
    from ondemand_prof.host.merge import merge_lists
    from ondemand_prof.host.records import RecordStore

    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        fold = 1792887600.0  # 2026-10-25 00:20 UTC, 02:20 CEST
        store = RecordStore(tmp_path)
        older, newer = (CaptureRecord.new(cid, "j", {}, {"start_step": 1, "end_step": 2}, {},
                                          [{"rank": 0, "host": "h", "pid": 1}], wall)
                        for cid, wall in (("older", fold + 1800), ("newer", fold + 3000)))
        assert (older.data["created_at"][11:16], newer.data["created_at"][11:16]) == ("02:50", "02:10")
        for record in (older, newer):
            record.data["status"] = "done"
            store.add(record)
        assert [r.capture_id for r in store.newest(10)] == ["newer", "older"]
        (tmp_path / "captures" / "bad.json").write_text(json.dumps({**older.data, "capture_id": "bad",
                                                                     "created_at": "yesterday"}))
        again = RecordStore(tmp_path)
        assert list(again.records) == ["older", "newer"]  # oldest first: the one eviction takes first
        assert again._evict(None) and list(again.records) == ["newer"]  # noqa: SLF001
        summaries = [older.summary(), newer.summary()]
        replies = {"h1": Reply("ok", {"captures": summaries[:1]}), "h2": Reply("ok", {"captures": summaries[1:]})}
        assert [c["capture_id"] for c in merge_lists(replies, 10)] == ["newer", "older"]
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_watch_holding_a_version_from_before_a_restart_gets_the_whole_record(tmp_path: Path, monkeypatch) -> None:
    """Two restarts with the clock stepped back between them: the CLI holds a version the first daemon gave out,
    the second has made as many changes; it must get every part, not the changes since a number it never gave."""
    from ondemand_prof.host.records import RecordStore

    record = CaptureRecord.new("c1", "j", {}, {"start_step": 1, "end_step": 2}, {},
                               [{"rank": r, "host": "h", "pid": 1} for r in range(2)], 1792887600.0)
    RecordStore(tmp_path).add(record)
    clock = iter([10_000_000, 9_000_000])  # microseconds x 1000: the second start's clock is 1 ms behind
    monkeypatch.setattr(time, "time_ns", lambda: next(clock))
    first = RecordStore(tmp_path).records["c1"]
    for _ in range(2000):
        first.part_changed(1)
    held = first.version
    second = RecordStore(tmp_path).records["c1"]
    for _ in range(4000):  # past the version held
        second.part_changed(1)
    view = second.view(held)
    assert "changed_only" not in view and sorted(view["parts"]) == ["0", "1"]


def test_a_record_whose_created_at_is_no_time_is_refused_with_the_reason() -> None:
    from ondemand_prof.host.records import record_problem

    good = CaptureRecord.new("c1", "j", {}, {"start_step": 1, "end_step": 2}, {}, [{"rank": 0, "host": "h", "pid": 1}],
                             1792887600.0).data
    assert record_problem(good) is None
    assert record_problem({**good, "created_at": "yesterday"}) == "created_at 'yesterday' is not a time"


def test_text_no_terminal_prints_never_reaches_status(tmp_path: Path) -> None:
    """A rank's heartbeat or registration with a lone surrogate (a JSON escape; the heartbeat's own fast path
    took it) is refused, so `ondemandctl status` still prints for every user of the daemon."""
    import argparse

    from ondemand_prof.host.commands import DAEMON_COMMANDS

    d, sent = inprocess_daemon(tmp_path)
    try:
        d.dispatch(b"r/0", b'{"v":1,"type":"hb","step":5,"state":"idle\\ud800","windows":[{"capture_id":"x",'
                           b'"start":1,"end":2,"source":"s\\udfff","state":"w"}]}')
        d.dispatch(b"r/9", b'{"v":1,"type":"register","job":"j","rank":1,"world_size":2,"host":"h","pid":%d,'
                           b'"step":0,"save_root":"/tmp/evil\\ud800"}' % os.getpid())
        errors = [json.loads(body)["error"] for _, body in sent if b'"error"' in body]
        assert len(errors) == 2 and all("lone UTF-16 surrogate" in e for e in errors), errors
        info = d.service.registry.by_route[b"r/0"]
        assert info.state == "idle" and info.step == 0 and b"r/9" not in d.service.registry.by_route
        sent.clear()
        d.dispatch(b"cli", encode("status", id=3))
        reply = json.loads(sent[-1][1])
        text = DAEMON_COMMANDS["status"].console(reply["data"], argparse.Namespace(
            json=False, job=None, brief=False, verbose=False, watch=None, all=False))
        text.encode("utf-8")
        assert "idle" in text
    finally:
        d.close()


def test_a_watch_on_a_record_dropped_to_make_room_is_answered(tmp_path: Path, monkeypatch) -> None:
    """The store drops its oldest finished record for a new one; a CLI still watching it gets an answer saying
    so, and the daemon's watches go on being answered (a KeyError there once left them unanswered for good)."""
    from ondemand_prof.host import records

    monkeypatch.setattr(records, "KEEP_RECORDS", 2)
    d, sent = inprocess_daemon(tmp_path)
    try:
        (tmp_path / "out").mkdir()
        ids = []
        for i in range(2):
            sent.clear()
            d.dispatch(b"cli", encode("capture", id=i, job="j", request={"ranks": [0], "steps": 1}))
            ids.append(json.loads([b for r, b in sent if r == b"cli"][-1])["data"]["capture_id"])
        d.dispatch(b"cli", encode("watch", id=10, capture_id=ids[0], seen=0, timeout_s=30))
        d.dispatch(b"cli2", encode("watch", id=11, capture_id=ids[1], seen=0, timeout_s=30))
        # in one batch of messages: the watched capture finishes, and a third capture pushes it out of the store
        d.dispatch(b"r/0", encode("event", capture_id=ids[0], event="done", info={"path": str(tmp_path / "out")}))
        d.dispatch(b"r/0", encode("event", capture_id=ids[1], event="received", info={}))
        sent.clear()
        d.dispatch(b"cli3", encode("capture", id=3, job="j", request={"ranks": [0], "steps": 1}))
        assert ids[0] not in d.service.store.records
        d._guarded(d.service.answer_due_watches)  # noqa: SLF001 - as the loop runs it after the batch
        answers = {route: json.loads(body) for route, body in sent if route in (b"cli", b"cli2")}
        assert "was dropped" in answers[b"cli"]["error"] and answers[b"cli2"]["data"]["capture_id"] == ids[1]
        assert d.service.watches == []
    finally:
        d.close()


def test_stacks_ask_the_ranks_in_waves_and_every_rank_is_answered(monkeypatch, tmp_path: Path) -> None:
    """`ondemandctl stacks` of many ranks: at most TRIAGE_WAVE ranks are asked at once (each answer of up to
    56 KiB is allocated by libzmq's I/O thread and freed by the loop: 4096 asked at once raised the daemon's peak
    by ~500 MiB, in waves ~220), each answer lets the next rank be asked, a rank that stays silent gives up its
    place after SLOT_S, and the reply still has every rank."""
    from ondemand_prof.host import triage

    monkeypatch.setattr(triage, "TRIAGE_WAVE", 3)
    d, sent = inprocess_daemon(tmp_path, ranks=8)
    routes = [b"r/%d" % r for r in range(8)]
    try:
        sent.clear()
        d.dispatch(b"cli", encode("stacks", id=7, ranks=[-1], timeout_s=60, args={}))

        def asked() -> list[bytes]:
            out = [route for route, body in sent if json.loads(body)["type"] == "triage"]
            sent[:] = [(route, body) for route, body in sent if route == b"cli"]
            return out

        assert asked() == routes[:3]  # the first wave, in rank order
        triage_id = next(iter(d.service.triage.pending))

        def answer(route: bytes) -> None:
            d.dispatch(route, encode("triage_result", triage_id=triage_id, result={
                "ok": True, "method": "python", "current_step": 5,
                "threads": [{"name": "MainThread", "frames": [["train.py", 10, "step", ""]]}]}))

        answer(routes[0])
        assert asked() == [routes[3]]  # one answer, one more rank asked
        answer(routes[1])
        assert asked() == [routes[4]]
        # ranks 2, 3, 4 are waited on and stay silent: nothing more leaves until their places are given up
        d._guarded(d.service.triage.tick, time.monotonic())  # noqa: SLF001 - as the loop runs it
        assert asked() == []
        monkeypatch.setattr(triage, "SLOT_S", 0.0)
        d._guarded(d.service.triage.tick, time.monotonic())  # noqa: SLF001
        assert asked() == routes[5:8]
        for route in routes[2:]:  # late answers are still taken
            answer(route)
        reply = [json.loads(body) for route, body in sent if route == b"cli"]
        assert len(reply) == 1 and reply[0]["id"] == 7
        ranks = reply[0]["data"]["ranks"]
        assert sorted(ranks, key=int) == [str(r) for r in range(8)] and all(v["ok"] for v in ranks.values())
    finally:
        d.close()


def test_report_finds_a_capture_folder_under_the_default_save_path_by_its_id(tmp_path: Path, monkeypatch) -> None:
    """Without a daemon, `ondemandctl report ID` reads ./profile/ID (a unique prefix, as the daemon takes ids);
    several matches are an error that says so; what is not an id (a path) never reaches the folder lookup."""
    from ondemand_prof.host.client import CtlError
    from ondemand_prof.host.commands.report import saved_here

    monkeypatch.chdir(tmp_path)
    assert saved_here("20261202-010101-abcdef") is None  # no ./profile at all
    for name in ("20261202-010101-abcdef", "20261202-010101-abc999"):
        (tmp_path / "profile" / name).mkdir(parents=True)
    assert saved_here("20261202-010101-abcd") == Path("profile/20261202-010101-abcdef")
    with pytest.raises(CtlError, match=r"^'20261202-010101-abc' begins 2 capture folders under profile "
                                       r"\(20261202-010101-abc999, 20261202-010101-abcdef\): give more of it$"):
        saved_here("20261202-010101-abc")
    assert saved_here("../profile") is None and saved_here("20261203") is None


def test_a_registration_takes_the_kernels_pid_and_keeps_the_pods_beside_it() -> None:
    """Issue 34 F1 and issue 29: a peer whose connector has exited registers nothing; a rank in a pod (its pid 1 is
    the daemon's pid 4242) is kept as pid 4242 with ns_pid 1; a non-root rank cannot name another process."""
    from ondemand_prof.host.listener import Peer
    from ondemand_prof.host.service import BadRequest, check_registration, with_kernel_pid

    msg = {"job": "j", "rank": 0, "world_size": 1, "host": "h", "pid": 1, "step": 0}
    with pytest.raises(BadRequest, match="has exited"):
        check_registration(Peer(0, 0, 4242, alive=False), msg, Registry())
    pod = Peer(0, 0, 4242, alive=True, nspids=(4242, 1))
    kept, ns_pid = with_kernel_pid(pod, msg)
    assert kept["pid"] == 4242 and ns_pid == 1
    assert with_kernel_pid(Peer(0, 0, 4242, alive=True, nspids=(4242,)), {**msg, "pid": 4242}) == \
        ({**msg, "pid": 4242}, None)
    me = Peer(os.getuid() or 1, 0, os.getpid(), alive=True, nspids=(os.getpid(),))
    with pytest.raises(BadRequest, match="is not the connecting process"):
        check_registration(me, {**msg, "pid": 1}, Registry())


def test_jobs_are_keyed_by_owner_and_id() -> None:
    """Issue 34 F3: another uid's job with the same id is another job: both live, shown as owner:id, a conflict is
    only between processes of one (uid, id, rank), and a bare id means the asker's own job."""
    from ondemand_prof.host.registry import owner_name

    reg = Registry()
    alive = lambda pid, thorough: True  # noqa: E731
    msg = {"job": "port29500", "rank": 0, "world_size": 1, "host": "h", "step": 0}
    reg.register(b"a", {**msg, "pid": 10}, 0.0, 0.0, alive, uid=0)
    assert list(reg.jobs()) == ["port29500"]
    reg.register(b"b", {**msg, "pid": 11}, 0.0, 0.0, alive, uid=4242)  # the same id and rank, another uid
    other = f"{owner_name(4242)}:port29500"
    assert sorted(reg.jobs()) == sorted([f"{owner_name(0)}:port29500", other])
    assert reg.conflicts_of("port29500", 0.0) == []
    assert reg.resolve_job("port29500", asker=4242) == other and reg.resolve_job("port2", asker=4242) == other
    assert reg.resolve_job(other) == other and reg.resolve_job("4242:port29500") == other
    with pytest.raises(ValueError, match="is run by 2 users on this host"):
        reg.resolve_job("port29500", asker=7)
    # a second live process of the same uid for the same rank: refused, shown for that uid's job only
    with pytest.raises(RankConflict, match="--profile-job-id or ONDEMAND_PROF_JOB_ID"):
        reg.register(b"c", {**msg, "pid": 12}, 0.0, 0.0, alive, uid=4242)
    assert [c["refused_pid"] for c in reg.conflicts_of("port29500", 1.0, 4242)] == [12]
    assert reg.conflicts_of("port29500", 1.0, 0) == []
    assert [r.pid for r in reg.jobs()[other]] == [11]
    from ondemand_prof.host.metrics import rank_rows

    # the metrics label each job by that name too: two users' rank 0 are never one label set
    names = {key: name for name, key in reg.job_keys().items()}
    assert sorted(row.job for row in rank_rows(reg.by_route.values(), names)) == sorted(reg.jobs())
    reg.remove(b"a")  # one owner left: the bare id again
    assert list(reg.jobs()) == ["port29500"] and reg.name_of(4242, "port29500") == "port29500"


def test_a_jobs_baseline_is_its_owners(tmp_path: Path) -> None:
    """Issue 28 with jobs keyed by (uid, id): two users' jobs of one id have a baseline each; the newest marked
    capture that recorded something wins, and one that failed leaves the one before it."""
    from ondemand_prof.host.records import RecordStore

    store = RecordStore(tmp_path)

    def record(cid: str, uid: int, wall: float, ok: bool = True) -> CaptureRecord:
        r = CaptureRecord.new(cid, "port29500@h", {}, {"start_step": 1, "end_step": 2}, {},
                              [{"rank": 0, "host": "h", "pid": 10, "uid": uid}], wall)
        r.data["baseline"] = True
        store.add(r)
        r.update(0, "done" if ok else "failed", {}, wall)
        store.save(r)  # (the service saves a record once it settles)
        return r

    a1, b1 = record("a1", 1000, 1.0), record("b1", 1001, 2.0)
    assert store.baseline_of("port29500@h", 1000) is a1 and store.baseline_of("port29500@h", 1001) is b1
    a2 = record("a2", 1000, 3.0)
    record("a3", 1000, 4.0, ok=False)
    assert store.baseline_of("port29500@h", 1000) is a2 and store.baseline_of("port29500@h", 1001) is b1
    assert RecordStore(tmp_path).baseline_of("port29500@h", 1000).capture_id == "a2"  # read back after a restart


def test_a_rank_signalled_as_another_dies_is_failed_with_its_own_words(tmp_path: Path) -> None:
    """torchrun's way when a worker dies: rank 1 SIGKILLed, rank 0 SIGTERMed at once. The sweep that finds rank
    1 gone also finds rank 0's process gone, before rank 0's bye ("terminated by SIGTERM") is read: a gone process
    is judged at the next sweep, so rank 0's part says what it said, and rank 1's that its process exited. On a
    quiet machine rank 0's part read "is gone: process ... exited" (test_field's never-reached window)."""
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.requests import WindowDefaults
    svc = make_service(tmp_path)
    defaults = WindowDefaults.from_config(ProfileConfig()).to_wire()
    for r in (0, 1):
        svc.handle(b"r%d" % r, register_msg(r, 2, step_time=0.1, defaults=defaults))
    reply = json.loads(svc.handle(b"cli", {"type": "capture", "id": 1, "request": {"steps": 2, "start_step": 900}}))
    record = reply["data"]
    cid = record["capture_id"]
    for r in (0, 1):
        svc.handle(b"r%d" % r, {"type": "event", "capture_id": cid, "event": "scheduled",
                                "info": {"window": [900, 902]}})
    svc.pid_check = lambda pid, thorough: False  # both processes are gone
    now = time.monotonic()
    svc.housekeeping(now)
    assert svc.store.records[cid].status == "running" and len(svc.registry.by_route) == 2  # not judged yet
    svc.handle(b"r0", {"type": "bye", "why": "terminated by SIGTERM", "step": 120})  # read after that sweep
    svc.housekeeping(now + 0.6)
    parts = svc.store.records[cid].data["parts"]
    assert parts["0"]["error"] == "rank 0 terminated by SIGTERM (at step 120, before the window [900, 902) began)"
    assert parts["1"]["error"].startswith("rank 1 is gone: process 11 on h exited"), parts["1"]
    assert not svc.registry.by_route


def test_an_opened_window_is_checked_before_it_is_recorded(tmp_path: Path) -> None:
    """A rank's "opened" event (a trigger file's or signal's window, recorded for list and show) from a hostile
    or broken rank, as the attack review of issue 30 sent them: a request nested 60 deep (it made `list`'s reply
    too deep for the CLI, for every user), a signal name carrying a forged log line, a signal id of another pid,
    a file id that is not a trigger version, a second part for other steps, and a flood of records: each is
    refused or cleaned; the record of a good one holds only plain request fields."""
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.protocol import decode, encode
    from ondemand_prof.core.requests import CaptureRequest, WindowDefaults, resolve
    from ondemand_prof.host import rank_captures
    from ondemand_prof.host.transport import SCHEMA

    svc = make_service(tmp_path)
    defaults = WindowDefaults.from_config(ProfileConfig())
    for r in (0, 1):
        svc.handle(b"r%d" % r, register_msg(r, 2, defaults=defaults.to_wire()))

    def opened(rank: int, cid: str, source: str = "file", start: int = 200, **extra: Any) -> None:
        window = resolve(CaptureRequest(steps=3), defaults, start, source=source, capture_id=cid, extra=extra)
        frame = encode("event", capture_id=cid, event="opened", info={"window": window.to_wire()})
        svc.handle(b"r%d" % rank, decode(frame, SCHEMA))  # as the daemon's decoder hands it on

    def listed() -> dict[str, Any]:
        reply = json.loads(svc.handle(b"cli", {"type": "list", "id": 1, "limit": 1000}))
        assert reply["type"] == "ok", reply
        return {c["capture_id"]: c for c in reply["data"]["captures"]}

    deep: Any = 1
    for _ in range(60):
        deep = [deep]
    opened(0, "file-00000000000000aa", x=deep, id="mine")
    opened(0, "signal-10-1700000000000", source="signal", signal="X)\n2026-12-04 WARNING ondemand-profd: FORGED")
    opened(0, "signal-999-1700000000000", source="signal", signal="SIGUSR2")  # not rank 0's pid (10)
    opened(0, "file-", source="file")
    caps = listed()
    assert sorted(caps) == ["file-00000000000000aa", "signal-10-1700000000000"], sorted(caps)
    record = svc.store.records["file-00000000000000aa"].data
    assert record["request"] == {"steps": 3, "id": "mine"} and record["kind"] == "file", record["request"]
    signalled = svc.store.records["signal-10-1700000000000"].data
    assert "signal" not in signalled["request"] and "\n" not in signalled["plan"]["note"], signalled
    opened(1, "file-00000000000000aa", start=900)  # other steps: not a part of it
    opened(1, "file-00000000000000aa")
    assert sorted(svc.store.records["file-00000000000000aa"].data["parts"]) == ["0", "1"]
    # a flood of new records: the hourly budget holds it, once a minute said
    for n in range(rank_captures.OPENED_PER_JOB_HOUR + 50):
        opened(1, f"file-{n:016x}")
    assert len(listed()) == rank_captures.OPENED_PER_JOB_HOUR  # the two above counted


def test_an_adopted_capture_id_follows_the_one_id_rule(tmp_path: Path) -> None:
    """ondemandctl across hosts names one capture id on every host: the daemon takes it by core/ids.py's rule
    (it kept a stricter copy of its own), and refuses one that could name a path or an option."""
    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.requests import WindowDefaults
    svc = make_service(tmp_path)
    svc.handle(b"r0", register_msg(0, 1, step_time=0.1, defaults=WindowDefaults.from_config(ProfileConfig()).to_wire()))

    def capture(cid: Any) -> dict[str, Any]:
        return json.loads(svc.handle(b"cli", {"type": "capture", "id": 1, "request": {"steps": 2}, "capture_id": cid}))

    for bad in ("../x", "-x", ".hidden", "a/b", "x" * 129, 7):
        reply = capture(bad)
        assert reply["type"] == "error" and "capture_id" in reply["error"] and "expected 1-128" in reply["error"], reply
    assert capture("20261206-000000-abcdef")["data"]["capture_id"] == "20261206-000000-abcdef"
    assert "already exists on this host" in capture("20261206-000000-abcdef")["error"]


def test_the_daemon_acknowledges_a_bye_that_asks_and_no_other(tmp_path: Path) -> None:
    """Issue 44, 1: a rank that is ending waits for the daemon to say it read its bye. The daemon answers a bye
    that asks (ack) with "bye_ok" to that route, after the rank's parts took its words; a bye that does not ask
    (an older rank, which would not know the message) gets nothing."""
    d, sent = inprocess_daemon(tmp_path, ranks=2)
    try:
        sent.clear()
        d.dispatch(b"r/0", encode("bye", why="terminated by SIGTERM", step=3, ack=True))
        assert [(route, json.loads(body)["type"]) for route, body in sent] == [(b"r/0", "bye_ok")]
        assert b"r/0" not in d.service.registry.by_route
        sent.clear()
        d.dispatch(b"r/1", encode("bye", why="closed the profiler", step=3))
        assert sent == [] and b"r/1" not in d.service.registry.by_route
    finally:
        d.close()


def test_a_rank_that_is_ending_waits_for_its_bye_to_be_read(tmp_path: Path) -> None:
    """Issue 44, 1: the rank's real DaemonLink against a bare ROUTER standing for the daemon. Its last words (a
    SIGTERM, the end of the interpreter) ask for an acknowledgement and do not return, so the process does not
    die, until the daemon says it read them; a daemon that never answers (stopped, or older) holds the end for
    LAST_WORDS_S at most. Before, the bye was handed to ZMQ's I/O thread and the process died: a rank SIGTERMed as
    another was SIGKILLed read "process exited, killed by SIGTERM" (the daemon's pid sweep saw the death first)."""
    import threading
    from types import SimpleNamespace

    import zmq

    from ondemand_prof.core.options import ProfileConfig
    from ondemand_prof.core.protocol import endpoint
    from ondemand_prof.rank import daemon_link
    from ondemand_prof.rank.backends import Identity
    from ondemand_prof.rank.daemon_link import DaemonLink

    assert 1.0 <= daemon_link.LAST_WORDS_S <= 5.0  # long enough for a loaded host, well within torchrun's 30 s
    ident = Identity(rank=0, world_size=1, local_rank=0, host="h", pid=os.getpid(), job_id="j", dist_initialized=True)
    prof = SimpleNamespace(config=ProfileConfig(save_path=str(tmp_path)), identity=lambda: ident, current_step=5,
                           state="idle")
    agent = SimpleNamespace(config=prof.config, prof=prof, trigger_dir="", wake=lambda: None,
                            step_time=lambda: 0.1, step_began=lambda: (5, time.time()),
                            triage=SimpleNamespace(native=SimpleNamespace(announce=lambda: None)))
    ctx = zmq.Context()
    try:
        for answer in (True, False):
            run = tmp_path / f"run{int(answer)}"
            run.mkdir(mode=0o700)
            router = ctx.socket(zmq.ROUTER)
            router.bind(endpoint(run))
            link = DaemonLink(agent, run, context=ctx)  # type: ignore[arg-type]
            deadline = time.monotonic() + 30
            while not router.poll(50) and time.monotonic() < deadline:  # until the registration arrives
                link._next_beat = 0.0  # noqa: SLF001 - register at once
                link.poll(time.monotonic())
            route, body = router.recv_multipart()
            assert json.loads(body)["type"] == "register"
            router.send_multipart([route, encode("registered", events_batch=32)])
            while not link.acknowledged and time.monotonic() < deadline:
                link.poll(time.monotonic())
                time.sleep(0.01)
            ending = threading.Thread(target=link.last_words, args=("terminated by SIGTERM", 7, True),
                                      kwargs={"wait_s": 60.0 if answer else 0.5})
            ending.start()
            bye: dict[str, Any] = {}
            while not bye and router.poll(30_000):
                msg = json.loads(router.recv_multipart()[1])
                bye = msg if msg["type"] == "bye" else {}
            assert bye == {**bye, "why": "terminated by SIGTERM", "step": 7, "ack": True}, bye
            if answer:
                ending.join(0.5)
                assert ending.is_alive(), "the last words returned before the daemon read them"
                router.send_multipart([route, encode("bye_ok")])
            ending.join(30)  # not answered: LAST_WORDS_S (here 0.5 s) and the linger
            assert not ending.is_alive() and link._closed  # noqa: SLF001
            router.close(linger=0)
    finally:
        ctx.destroy(linger=0)
