"""ondemandctl across hosts, the pure part (host/planning.py): which job and ranks a capture means, one window
for every host, and one answer from many hosts' replies. No process, no socket: the status replies are shaped
by the daemon's own code (RankInfo.as_dict, as `status` sends each rank); they are synthetic in what the
ranks report. The same planning under real daemons and faults: tests/test_hosts.py, tests/test_netns.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from ondemand_prof.core.options import ProfileConfig
from ondemand_prof.core.requests import WindowDefaults
from ondemand_prof.host.client import EXIT_FAILED, EXIT_NO_DAEMON, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, CtlError, Reply
from ondemand_prof.host.planning import common_cap, pick_job, plan_capture, rank_infos, stalled_refusal
from ondemand_prof.host.merge import (Launched, capture_record, exit_across, fail_host, merge_lists, merge_status,
                                     merged_record, nothing_found, one_capture)
from ondemand_prof.host.records import Plan
from ondemand_prof.host.registry import RankInfo

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)

NOW = 1_800_000_000.0


def _rank(rank: int, step: int, *, world: int = 4, cap: int = 200, ranks: tuple[int, ...] = (-1,),
          stalled_for: float = 0.0) -> dict[str, Any]:
    """One rank as a daemon's status shows it: stepping every 0.1 s, its step begun now (or `stalled_for` ago)."""
    defaults = WindowDefaults.from_config(ProfileConfig(max_window_steps=cap, ondemand_ranks=ranks))
    info = RankInfo(b"", "j", rank, world, f"n{rank}", 100 + rank, step, step_time=0.1,
                    step_began_at=NOW - stalled_for, defaults=defaults, last_seen=0.0)
    return info.as_dict(0.0, NOW)


def _status(*ranks: dict[str, Any], delivery: float | None = None, job: str = "j",
            received_at: float = NOW) -> Reply:
    data = {"jobs": {job: list(ranks)} if ranks else {}, "delivery_s": {job: delivery} if delivery else {}}
    return Reply("ok", data=data, seconds=0.002, received_at=received_at)


def _statuses(**extra: Reply) -> dict[str, Reply]:
    """Host a has ranks 0-1 at step 100, host b rank 2 at step 104, host c none of the job (world size 4)."""
    return {"a": _status(_rank(0, 100), _rank(1, 100)), "b": _status(_rank(2, 104)), "c": _status(), **extra}


# ----------------------------------------------------------------------------------------------------------
# One window for every host

def test_one_window_after_the_furthest_rank_with_each_host_told_its_own_ranks() -> None:
    plan = plan_capture(_statuses(), {"steps": 3, "start": 1, "level": "level1"}, None, now=NOW)
    assert plan.job == "j" and {n: [i.rank for i in r] for n, r in plan.targets.items()} == {"a": [0, 1], "b": [2]}
    # delivery 0.05 s + the round trip twice (0.004) + the slowest step (0.1) = 0.154 s of 0.1 s steps: lead 4,
    # counted from rank 2, the furthest ahead (104)
    assert (plan.plan.start_step, plan.plan.end_step, plan.plan.lead_steps) == (108, 111, 4)
    assert plan.per_host() == {"a": {"request": {"steps": 3, "level": "level1", "start_step": 108, "ranks": [0, 1]}},
                               "b": {"request": {"steps": 3, "level": "level1", "start_step": 108, "ranks": [2]}}}
    assert plan.missing == [3] and plan.plan.note == ""


def test_default_ranks_are_what_a_touched_trigger_file_captures_on_each_host() -> None:
    statuses = _statuses(a=_status(_rank(0, 100, ranks=(0, 2)), _rank(1, 100, ranks=(0, 2))))
    assert {n: [i.rank for i in r] for n, r in plan_capture(statuses, {"steps": 2}, None, now=NOW).targets.items()} \
        == {"a": [0], "b": [2]}
    every = plan_capture(statuses, {"steps": 2, "ranks": [-1]}, None, now=NOW)
    assert {n: [i.rank for i in r] for n, r in every.targets.items()} == {"a": [0, 1], "b": [2]}
    named = plan_capture(statuses, {"steps": 2, "ranks": [1]}, None, now=NOW)
    assert list(named.targets) == ["a"] and named.missing == []  # ranks named: none is "missing"


def test_the_smallest_length_cap_of_the_target_ranks_holds_everywhere_and_is_said() -> None:
    statuses = _statuses(b=_status(_rank(2, 104, cap=2)), c=_status(_rank(3, 90, cap=1, ranks=(0,))))
    plan = plan_capture(statuses, {"steps": 3}, None, now=NOW)  # rank 3 (cap 1) is not a target by default
    assert plan.plan.end_step - plan.plan.start_step == 2 and plan.request["steps"] == 2
    assert plan.plan.note == "steps capped from 3 to 2 (the smallest --profile-max-window-steps of the target ranks)"
    assert common_cap([None, 200, 160, 0]) == 160 and common_cap([None]) is None


def test_a_hosts_learned_delivery_lengthens_the_lead_within_bounds() -> None:
    slow = plan_capture(_statuses(b=_status(_rank(2, 104), delivery=0.5)), {"steps": 2}, None, now=NOW)
    assert slow.plan.lead_steps == 9  # 0.5 + 0.004 + 0.1 s of 0.1 s steps, plus two
    # a host with no target rank, and a number no daemon would learn (at most 5 s), change nothing
    for statuses in (_statuses(c=_status(delivery=4.0)), _statuses(b=_status(_rank(2, 104), delivery=1e9))):
        assert plan_capture(statuses, {"steps": 2}, None, now=NOW).plan.lead_steps == 4


@pytest.mark.parametrize("request_, job, message, code", [
    ({"steps": 2, "start_step": 101}, None, "--start-step 101: rank(s) 2 are already past it (the ranks are at steps "
     "100-104); across hosts a window starts on the same step on every rank or not at all: give a later step, or "
     "--start N", EXIT_FAILED),
    ({"steps": 2, "ranks": [0, 7]}, None, "rank(s) 7 are not registered with any daemon that answered; live ranks: "
     "0-2", EXIT_FAILED),
    ({"steps": 2}, "x", "--job: no live job 'x'; live jobs: j (on the hosts that answered)", EXIT_FAILED),
])
def test_a_window_that_cannot_be_aligned_is_refused_with_the_reason(request_: dict[str, Any], job: str | None,
                                                                     message: str, code: int) -> None:
    with pytest.raises(CtlError) as err:
        plan_capture(_statuses(), request_, job, now=NOW)
    assert str(err.value) == message and err.value.code == code


def test_a_stalled_target_gets_no_window() -> None:
    statuses = _statuses(b=_status(_rank(2, 104, stalled_for=42.0)))
    with pytest.raises(CtlError, match=r"job j is STALLED: rank\(s\) 2 on b have not finished a step for 42 s"):
        plan_capture(statuses, {"steps": 2}, None, now=NOW)
    assert plan_capture(statuses, {"steps": 2, "ranks": [0, 1]}, None, now=NOW).plan.start_step == 104


def test_the_job_is_found_by_its_slurm_id_its_step_or_a_prefix() -> None:
    live = ["4242.0", "e595abed-da99-4f2e-9d1b-2a0c7c1c7f00", "port29500"]
    assert pick_job(live, None, "4242") == "4242.0"  # --slurm 4242 finds its step while other jobs are live
    assert pick_job(["4242", "port1"], None, "4242") == "4242"
    assert pick_job(["42.0", "4242.0"], None, "42") == "42.0"  # 4242.0 is not a step of job 42
    assert pick_job(live, "e595abed", None) == live[1]  # a torchrun UUID by its first characters
    assert pick_job(live, "4242.0", "4242") == "4242.0"
    with pytest.raises(CtlError, match=r"SLURM job 4242 has 2 live steps \(4242.0, 4242.1\)"):
        pick_job(["4242.0", "4242.1"], None, "4242")
    with pytest.raises(CtlError, match="3 jobs are live"):
        pick_job(live, None, "999")  # none of them is that SLURM job: as without --slurm
    with pytest.raises(CtlError, match="'port' begins 2 live jobs") as err:
        pick_job(["port1", "port2"], "port", None)
    assert err.value.code == EXIT_USAGE
    with pytest.raises(CtlError, match="no live job 'x'"):
        pick_job(live, "x", None)
    with pytest.raises(CtlError, match="no ranks are registered with any of the daemons that answered"):
        pick_job([], None, None)


def test_each_hosts_steps_are_anchored_at_its_own_answer() -> None:
    """Host a answered at once; host b's answer came 5 s later (the round ended after a dead host's timeout).
    Planned 5 s after a's answer, a's rank has gone on 50 steps; b's has not moved."""
    t0 = NOW - 5
    statuses = {"a": _status(_rank(0, 1000), received_at=t0), "b": _status(_rank(1, 1050), received_at=NOW)}
    job, infos = rank_infos(statuses, None)
    a, b = infos["a"][0], infos["b"][0]
    assert job == "j" and (a.step, b.step) == (1000, 1050)
    assert a.estimated_step(NOW) == 1050 and b.estimated_step(NOW) == 1050
    plan = plan_capture(statuses, {"steps": 2}, None, now=NOW)
    assert plan.plan.current_steps == {0: 1050, 1: 1050}  # not 1000: rank 0 would begin 50 steps late


def test_stalled_ranks_say_since_when_and_where_to_look() -> None:
    statuses = {"a": _status(_rank(0, 1074)), "b": _status(_rank(1, 1074, stalled_for=42.0))}
    job, infos = rank_infos(statuses, None)
    text = stalled_refusal(statuses, job, infos, now=NOW)
    since = time.strftime("%H:%M:%S", time.localtime(NOW - 42))
    assert text is not None and "job j is STALLED: rank(s) 1 on b have not finished a step for 42 s" in text, text
    assert f"(since {since}, at step 1074)" in text and "ondemandctl stacks --job j" in text
    assert text.endswith("No window can start until they step again")
    assert stalled_refusal(statuses, job, {"a": infos["a"]}, now=NOW) is None  # rank 0 alone is not stalled


# ----------------------------------------------------------------------------------------------------------
# One answer from many hosts

def _part(rank: int, state: str, **kw: Any) -> dict[str, Any]:
    return {"rank": rank, "host": f"n{rank}", "pid": 100 + rank, "state": state, "history": [{"state": state}], **kw}


def _record(status: str, *parts: dict[str, Any]) -> dict[str, Any]:
    return {"capture_id": "c1", "job": "j", "created_at": "2026-12-01T00:00:00", "window": [108, 111],
            "status": status, "version": 7, "parts": {str(p["rank"]): p for p in parts}}


def test_records_of_many_hosts_merge_into_one_that_says_what_each_host_did() -> None:
    done = {"path": "/p", "steps": [108, 109, 110]}
    found = {"a": _record("done", _part(0, "done", **done), _part(1, "done", **done)),
             "b": _record("running", _part(2, "recording"))}
    infos = {"c": [RankInfo(b"", "j", 3, 4, "n3", 103, 100)]}
    record = merged_record(found, {"c": "capture c1 already exists on this host"}, {"b": "b does not respond"},
                           targets={**infos, "a": []})
    assert {k: (p["state"], p["daemon"]) for k, p in record["parts"].items()} == {
        "0": ("done", "a"), "1": ("done", "a"), "2": ("unreachable", "b"), "3": ("failed", "c")}
    assert record["parts"]["2"]["last_state"] == "recording"
    assert record["parts"]["2"]["error"] == "host b stopped answering: b does not respond"
    assert record["parts"]["3"]["error"] == "host c: capture c1 already exists on this host"
    assert record["hosts"] == {"a": {"status": "done"}, "b": {"status": "unreachable", "error": "b does not respond"},
                               "c": {"status": "failed", "error": "capture c1 already exists on this host"}}
    assert record["status"] == "partial" and "version" not in record  # a version belongs to one host's record


def test_ranks_of_different_hosts_that_recorded_different_steps_are_misaligned() -> None:
    found = {"a": _record("done", _part(0, "done", path="/p", steps=[108, 109])),
             "b": _record("done", _part(1, "done", path="/q", steps=[122, 123]))}
    record = merged_record(found, {})
    assert record["status"] == "misaligned"
    assert record["misaligned"]["text"] == ("ranks recorded different steps: rank(s) 0 recorded steps 108..109; "
                                            "rank(s) 1 recorded steps 122..123")


def test_a_capture_whose_status_round_missed_ranks_is_partial_even_when_all_it_had_wrote() -> None:
    run = Launched("c1", "j", {"a": []}, Plan(108, 111, {0: 100}),
                   {"a": _record("done", _part(0, "done", path="/p", steps=[108, 109, 110]))}, {}, 0.0421,
                   unanswered={"d": "d did not answer within 5 s"}, missing=[3])
    record = capture_record(run, {})
    assert record["status"] == "partial" and record["missing_ranks"] == [3]
    assert record["unanswered"] == {"d": "d did not answer within 5 s"}
    assert record["plan"]["current_steps"] == {"0": 100} and record["plan"]["sent_s"] == 0.0421
    run.missing = []  # every rank of the job answered on another host: whole
    assert capture_record(run, {})["status"] == "done"


def test_merged_status_of_the_hosts_records() -> None:
    assert merge_status(["done", "done"]) == "done" and merge_status(["done", "misaligned"]) == "done"
    assert merge_status(["done", "failed"]) == "partial" and merge_status(["running", "done"]) == "running"
    assert merge_status(["failed", "cancelled"]) == "failed" and merge_status(["cancelled"] * 2) == "cancelled"
    assert merge_status(["done", "unreachable"]) == "partial"


def test_lists_merge_by_capture_id_newest_first() -> None:
    def listed(*caps: tuple[str, str, int, str]) -> Reply:
        return Reply("ok", data={"captures": [{"capture_id": c, "created_at": t, "job": "j", "window": [1, 3],
                                               "ranks": n, "states": {"done": n} if s == "done" else {"sent": n},
                                               "status": s} for c, t, n, s in caps]})

    replies = {"a": listed(("c2", "2026-12-01T00:02", 2, "done"), ("c1", "2026-12-01T00:01", 2, "done")),
               "b": listed(("c2", "2026-12-01T00:02", 1, "running")), "d": Reply("timeout", error="d is down")}
    caps = merge_lists(replies, 10)
    assert [(c["capture_id"], c["ranks"], c["hosts"], c["status"]) for c in caps] == [
        ("c2", 3, ["a", "b"], "running"), ("c1", 2, ["a"], "done")]
    assert caps[0]["states"] == {"done": 2, "sent": 1} and len(merge_lists(replies, 1)) == 1


def test_list_across_hosts_says_misaligned_where_show_does() -> None:
    """A host's misaligned record, or hosts whose ranks each recorded alike but other steps than the other
    host's: `list` merged says misaligned, as `show` merged does (before, list said done). A host that sends no
    `recorded` (an older daemon) leaves the steps unjudged."""
    def listed(status: str, *recorded: list[int]) -> Reply:
        cap = {"capture_id": "c1", "created_at": "2026-12-01T00:01", "job": "j", "window": [108, 110], "ranks": 1,
               "states": {"done": 1}, "status": status}
        return Reply("ok", data={"captures": [{**cap, "recorded": list(recorded)} if recorded else cap]})

    def status(**replies: Reply) -> str:
        return merge_lists(replies, 10)[0]["status"]

    assert status(a=listed("done", [108, 109, 2]), b=listed("done", [108, 109, 2])) == "done"
    assert status(a=listed("done", [108, 109, 2]), b=listed("done", [122, 123, 2])) == "misaligned"
    assert status(a=listed("misaligned", [108, 109, 2], [111, 112, 2]), b=listed("failed")) == "misaligned"
    assert status(a=listed("done", [108, 109, 2]), b=listed("done")) == "done"
    assert merge_lists({"a": listed("done", [108, 109, 2]), "b": listed("partial", [122, 123, 2], ["x"])},
                       10)[0]["recorded"] == [[108, 109, 2], [122, 123, 2]]


def test_a_partial_id_must_mean_one_capture_and_nothing_found_says_why() -> None:
    shown = {"a": Reply("ok", data={"capture_id": "c1"}), "b": Reply("ok", data={"capture_id": "c2"})}
    with pytest.raises(CtlError, match=r"the id matches different captures on different hosts \(c1, c2\)") as err:
        one_capture(shown)
    assert err.value.code == EXIT_USAGE
    assert one_capture({"a": shown["a"], "b": Reply("error", error="no capture 'c'")}) == {"a": shown["a"]}
    said = {"a": Reply("error", error="no capture 'c1' (ondemandctl list shows them)"),
            "b": Reply("error", error="capture c1 is already done")}
    none = nothing_found(said)
    assert str(none) == "capture c1 is already done" and none.code == EXIT_FAILED  # "no capture" said only if alone
    none = nothing_found({**said, "c": Reply("timeout", error="c did not answer")})
    assert none.code == EXIT_PARTIAL  # the capture may be on the host that did not answer
    assert str(nothing_found({"a": said["a"]})) == "no capture 'c1' (ondemandctl list shows them)"


def test_exit_status_across_hosts() -> None:
    replies = {"a": Reply("ok"), "b": Reply("timeout", error="b is down")}
    assert exit_across({}, replies) == EXIT_OK
    assert exit_across({"b": "b is down"}, replies) == EXIT_PARTIAL
    assert exit_across({"a": "x", "b": "b is down"}, replies) == EXIT_NO_DAEMON


def test_a_host_that_stops_knowing_the_capture_fails_its_unfinished_ranks() -> None:
    data = _record("running", _part(0, "done", path="/p"), _part(1, "recording"))
    fail_host(data, "host b: no capture 'c1'")
    assert data["status"] == "failed"
    assert [(p["state"], p.get("error")) for p in data["parts"].values()] == [
        ("done", None), ("failed", "host b: no capture 'c1'")]


# ----------------------------------------------------------------------------------------------------------
# From test_security.py: a capture far ahead


@pytest.mark.quick
def test_a_capture_far_ahead_does_not_make_later_captures_wait_for_it() -> None:
    """One capture with --start 100000 made every later relative capture plan after it (busy for days)."""
    from ondemand_prof.host.planning import plan_window
    from ondemand_prof.host.registry import RankInfo

    far = {"capture_id": "far", "start": 100_010, "end": 100_012, "source": "daemon", "state": "queued"}
    near = {"capture_id": "near", "start": 12, "end": 20, "source": "file", "state": "queued"}
    rank = RankInfo(route=b"r", job="j", rank=0, world_size=1, host="h", pid=1, step=10, windows=[far])
    plan = plan_window([rank], 0.0, start=None, start_step=None, steps=2)
    assert (plan.start_step, plan.end_step) == (12, 14) and plan.after is None
    rank.windows = [near, far]
    plan = plan_window([rank], 0.0, start=None, start_step=None, steps=2)
    assert plan.start_step == 20 and plan.after is not None and plan.after["capture_ids"] == ["near"]
    plan = plan_window([rank], 0.0, start=100_000, start_step=None, steps=2)  # [100010, 100012): after the far one
    assert plan.start_step == 100_012
