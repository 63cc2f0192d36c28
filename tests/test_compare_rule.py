"""The cause rule of report/compare.py on rank summaries built here (synthetic: the fields a summary.json holds),
for what the live tests (tests/test_compare.py) cannot pin down under load: which category a growth of host
time outside operators on the CPU belongs to."""

from __future__ import annotations

from typing import Any

import pytest

from ondemand_prof.report.compare import compare_rank, conclude

pytestmark = pytest.mark.quick


def summary(rank: int, idle: float = 2.0, compute: float = 6.0, adds: int = 0, barriers: int = 0,
            barrier_ms: float = 0.0) -> dict[str, Any]:
    """A CPU rank's summary of 4 steps: aten::mm once a step, `adds` aten::add calls a step (2 us each), one
    all_reduce (2 ms) and `barriers` barriers (`barrier_ms` in all) a step."""
    steps = [{"dur_ms": compute + idle + 2 + barrier_ms, "compute_ms": compute, "comm_ms": 2.0 + barrier_ms,
              "overlap_ms": 0.0, "idle_ms": idle}] * 4
    ops = [["aten::mm", 4, (compute - adds * 0.002) * 4000, (compute - adds * 0.002) * 4000]]
    if adds:
        ops.append(["aten::add", 4 * adds, adds * 8.0, adds * 8.0])
    return {"rank": rank, "world_size": 2, "basis": "cpu", "steps": steps,
            "step_ops": {"steps": 4, "ops": ops, "kernels": [], "complete": {"ops": True, "kernels": True}},
            "collectives": [{"kind": "all_reduce", "count_per_step": 1, "ms_per_step": 2.0}]
            + ([{"kind": "barrier", "count_per_step": barriers, "ms_per_step": barrier_ms}] if barriers else []),
            "comm_libraries": [{"library": "gloo", "ms": 8.0}]}


def cause(**now: Any) -> dict[str, Any]:
    return conclude([compare_rank(summary(r), summary(r, **now)) for r in (0, 1)], "b", "n")


def test_host_time_that_the_added_operator_calls_explain_is_their_work() -> None:
    # 3,000 tiny additions a step: their own time is 6 ms, the Python and dispatch between them 30 ms more
    c = cause(idle=32.0, compute=12.0, adds=3000)
    assert c["category"] == "compute" and c["culprits"] == [0, 1], c["cause"]
    assert "aten::add (new)" in c["cause"] and "0 -> 3000 calls/step" in c["cause"], c["cause"]


def test_host_time_with_no_operator_added_is_input_or_sleeping() -> None:
    c = cause(idle=32.0)  # a slower data loader: 30 ms more outside operators, the same operators
    assert c["category"] == "host time outside operators (input, Python, sleeping)", c["cause"]
    few = cause(idle=32.0, compute=6.2, adds=100)  # 100 more calls do not explain 30 ms
    assert few["category"] == "host time outside operators (input, Python, sleeping)", few["cause"]


def test_communication_that_grew_more_than_every_ranks_work_is_the_cause() -> None:
    """20 more barriers a step (live, tests/test_compare.py; CI under load): every rank's host time outside
    operators grew 3.8-4.3 ms (the Python of dist.barrier), its communication 11 ms: the cause is communication,
    and the smaller own growth is said; had every rank's work grown more than its communication, it is the work."""
    c = cause(idle=6.0, barriers=20, barrier_ms=11.0)
    assert c["category"] == "communication" and c["culprits"] == [0, 1], c["cause"]
    # the 4 ms of host time that the 20 calls explain are communication too: 11 + 4 ms a step, none of it own work
    assert c["cause"].startswith("every rank: communication grew (+15.0 ms/step), no rank's own work did: barrier "
                                 "(new)"), c["cause"]
    assert "0 -> 20 calls/step" in c["cause"], c["cause"]
    work = cause(idle=14.0, barriers=20, barrier_ms=11.0)  # 12 ms more outside operators: the work grew more
    assert work["category"] == "host time outside operators (input, Python, sleeping)", work["cause"]



def test_host_time_the_added_collective_calls_explain_is_communication() -> None:
    """20 more barriers a step (live, tests/test_compare.py; CI under load): on the CPU a collective's wait for its
    peers runs outside its operator, so rank 1's share of the barriers showed as 4.69 ms more host time outside
    operators while rank 0's showed as 8.02 ms more communication, and the rule named rank 1's 'host time' with
    rank 0 waiting for it. Host time that the collective calls added a step explain (COLLECTIVE_HOST_US each) is
    communication; the same host time with no call added is still rank 1's, and rank 0 only waited."""
    base = [summary(r) for r in (0, 1)]
    now = [summary(0, barriers=20, barrier_ms=8.0), summary(1, idle=6.69, barriers=20, barrier_ms=3.3)]
    c = conclude([compare_rank(b, n) for b, n in zip(base, now)], "b", "n")
    assert c["category"] == "communication", c["cause"]
    assert "barrier (new)" in c["cause"] and "0 -> 20 calls/step" in c["cause"], c["cause"]
    alone = conclude([compare_rank(b, n) for b, n in zip(base, [summary(0, barrier_ms=4.7), summary(1, idle=6.69)])],
                     "b", "n")
    assert alone["category"] == "host time outside operators (input, Python, sleeping)", alone["cause"]
    assert alone["culprits"] == [1] and alone["waiting"] == [0], alone["cause"]

def test_the_slowdown_switch_is_read_again_when_its_bytes_land_under_the_same_time(tmp_path: Any) -> None:
    """The live comparisons switch slowdowns on through toy_train's --inject-file. A write stamps the file's time
    before its bytes land: a rank that reads in between finds it empty under the final time, and reading again only
    when the time changes lost the slowdown for the rest of the run (CI: 'rank 1: compute grew' for 20 barriers that
    never ran, both ranks having read in step)."""
    import os

    from ondemand_prof.demo.toy_train import Injection

    path = tmp_path / "inject.json"
    path.write_text("")
    injection = Injection(str(path))
    injection.refresh()
    assert injection.spec == {}
    stamp = path.stat().st_mtime_ns
    path.write_text('{"kind": "sync", "amount": 20}')
    os.utime(path, ns=(stamp, stamp))  # the bytes landed, the time is the one already read
    injection.refresh()
    assert injection.applies("sync", 1) == 20
    path.write_text('{"kind": "sync", "amo')  # half written: not taken, and read again at the next step
    injection.refresh()
    assert injection.applies("sync", 1) == 20
    path.write_text('{"kind": "sync", "amount": 4}')
    injection.refresh()
    assert injection.applies("sync", 1) == 4
    path.write_text('{"kind": "sync", "amount": 8, "at_step": 50}')  # from step 50 on every rank, 4 until then
    injection.refresh(49)
    assert injection.applies("sync", 1) == 4
    injection.refresh(50)
    assert injection.applies("sync", 1) == 8


def test_a_rank_whose_own_work_shrank_is_never_the_cause_while_anothers_grew() -> None:
    """The HF Trainer case of issue 43 (figures as reported; synthetic summaries): the baseline was taken while
    rank 0 was slowed, so now rank 0's own compute is 155 ms a step shorter and its wait 280 ms longer, while rank
    1 (two hogs on its core) did 111 ms more of its own: rank 1 is the cause, rank 0 waited, whatever the ratio of
    the two growths."""
    def rank(r: int, compute: float, comm: float, jitter: float) -> dict[str, Any]:
        s = summary(r)
        s["steps"] = [{"dur_ms": compute + comm + 2.0 + jitter * k, "compute_ms": compute + jitter * k,
                       "comm_ms": comm, "overlap_ms": 0.0, "idle_ms": 2.0} for k in range(4)]
        return s

    base = [rank(0, 400.0, 50.0, 1.0), rank(1, 250.0, 200.0, 1.0)]
    now = [rank(0, 245.0, 330.0, 1.5), rank(1, 361.0, 214.0, 1.5)]
    c = conclude([compare_rank(b, n) for b, n in zip(base, now)], "b", "n")
    assert c["culprits"] == [1] and c["waiting"] == [0], c["cause"]
    assert c["cause"].startswith("rank 1: compute grew"), c["cause"]
