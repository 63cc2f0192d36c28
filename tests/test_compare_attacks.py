"""Issue 28's comparisons attacked: a hostile or broken rank's summary.json (the daemon reads it on its loop), a
member of a --group daemon and another user's job, and bad input to `ondemandctl report --baseline`. Each test
failed on the code before its fix (docs/security.md, "Comparisons (issue 28)")."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import ctl, make_service, wait_for
from test_security import MEMBER_CTL, as_user, group_daemon, other_user, stop, train  # noqa: F401 - fixtures

from ondemand_prof.core import safejson
from ondemand_prof.host.records import CaptureRecord
from ondemand_prof.host.summaries import compare_records, conclude_replies


def summary(rank: int, compute: float = 6.0, **more: Any) -> dict[str, Any]:
    """A rank's summary.json as post-processing writes it (the fields a comparison reads): 4 steps."""
    steps = [{"dur_ms": compute + 4, "compute_ms": compute, "comm_ms": 2.0, "overlap_ms": 0.0, "idle_ms": 2.0}] * 4
    return {"rank": rank, "world_size": 16, "basis": "cpu", "steps": steps,
            "step_ops": {"steps": 4, "ops": [["aten::mm", 4, compute * 4000, compute * 4000]], "kernels": [],
                         "complete": {"ops": True, "kernels": True}},
            "collectives": [{"kind": "all_reduce", "count_per_step": 1, "ms_per_step": 2.0}],
            "comm_libraries": [{"library": "gloo", "ms": 8.0}], **more}


def capture(tmp: Path, cid: str, texts: dict[int, str]) -> CaptureRecord:
    """A finished capture record whose rank r wrote texts[r] as its summary.json."""
    wall = time.time()
    record = CaptureRecord.new(cid, "j", {}, {"start_step": 1, "end_step": 5}, {},
                               [{"rank": r, "host": "h", "pid": 10 + r} for r in texts], wall)
    for r, text in texts.items():
        d = tmp / cid / f"r{r}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(text)
        record.update(r, "done", {"path": str(d)}, wall)
    return record


def _steps(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return summary(1, steps=rows)


HOSTILE = {  # rank -> what its post-processing wrote on the capture's side, and what the problem must name
    1: (json.dumps(_steps([{"dur_ms": "12"}])), "steps[0].dur_ms is '12'"),
    2: ('{"steps": [{"dur_ms": NaN}]}', "non-finite number NaN"),
    3: (json.dumps(_steps([{"dur_ms": 1e308}, {"dur_ms": 1e308}])), "steps[0].dur_ms is 1e+308"),  # sum: inf
    4: (json.dumps(_steps([{"dur_ms": -50}])), "steps[0].dur_ms is -50"),
    5: ("[" * 100_000, "nested deeper than"),
    6: (json.dumps(summary(6, step_ops={"steps": 4, "ops": [["aten::mm"]]})), "step_ops.ops[0] is ['aten::mm']"),
    7: (json.dumps(summary(7, step_ops={"steps": 4, "ops": [[f"o{i}", 1, 1, 1] for i in range(25_000)]})),
        "step_ops.ops has 25000 entries"),
    8: (json.dumps(summary(8, collectives=[{"kind": f"k{i}", "count_per_step": 1, "ms_per_step": 1}
                                           for i in range(5_000)])), "collectives has 5000 entries"),
    9: (json.dumps(summary(9, options={"level": [1]})), "options.level is [1]"),
    10: (json.dumps(summary(10, step_ops={"steps": 1e-300})), "step_ops.steps is 1e-300"),
}


@pytest.mark.quick
def test_a_hostile_summary_is_its_ranks_problem_never_the_daemons(tmp_path: Path) -> None:
    """What a rank writes into its summary.json cannot fail `compare`, `show` of an automatic capture or its cause
    line for the other ranks: each such rank is 'not compared' with the field named, and every reply is what the
    CLI's bounded reader takes. Before: each of these raised in compare_rank (an 'internal error' for the whole
    host, `show AUTO` failing), NaN and overflowing sums went out as Infinity (a reply the CLI refuses), 25,000
    operators kept the daemon's loop 0.45 s a rank, and 5,000 collective kinds made a 6 MB reply of 8 ranks."""
    service = make_service(tmp_path / "state")
    good = {0: json.dumps(summary(0))}
    base = capture(tmp_path, "base", {**good, **{r: json.dumps(summary(r)) for r in HOSTILE}})
    now = capture(tmp_path, "now", {0: json.dumps(summary(0, compute=30.0)), **{r: t for r, (t, _) in HOSTILE.items()}})
    auto = capture(tmp_path, "auto-now", {0: json.dumps(summary(0, compute=30.0)), **{r: t for r, (t, _) in
                                                                                  HOSTILE.items()}})
    auto.data["compare_with"] = "base"
    for record in (base, now, auto):
        service.store.add(record)

    def ask(**msg: Any) -> Any:
        return safejson.loads(service.handle(b"c", {"id": 1, **msg}), 1 << 28)  # as the CLI reads the reply

    reply = ask(type="compare", capture_id="now", baseline_id="base")
    assert reply["type"] == "ok", reply
    data = reply["data"]
    assert [r["rank"] for r in data["ranks"]] == [0]
    for rank, (_, said) in HOSTILE.items():
        assert said in data["problems"][str(rank)], (rank, data["problems"][str(rank)])
    assert conclude_replies([("h", data)])["cause"].startswith("rank 0: ")  # (its one operator ran 5x slower)
    shown = ask(type="show", capture_id="auto-now")
    assert shown["type"] == "ok" and [r["rank"] for r in shown["data"]["comparison"]["ranks"]] == [0], shown
    service.changed(auto)  # done: the daemon's log line and the record's cause
    assert auto.data["cause"].startswith("rank 0: compute grew"), auto.data["cause"]


@pytest.mark.quick
def test_a_summary_cannot_take_another_ranks_place(tmp_path: Path) -> None:
    """A rank is its record's part: rank 1's summary saying "rank": 0 took rank 0's place in the comparison, so
    rank 0 was named the cause of rank 1's slowdown and rank 1 was not in it."""
    base = capture(tmp_path, "base", {0: json.dumps(summary(0)), 1: json.dumps(summary(1))})
    now = capture(tmp_path, "now", {0: json.dumps(summary(0)), 1: json.dumps(summary(0, compute=40.0))})
    result = conclude_replies([("h", compare_records(now.data, base.data))])
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert result["cause"].startswith("rank 1: compute grew") and result["culprits"] == [1], result["cause"]


@pytest.mark.quick
def test_an_automatic_baseline_is_of_every_rank_of_its_job_beside_another_users_job_of_the_same_id(
        tmp_path: Path) -> None:
    """Another user registering a rank with this job's id (jobs are then shown owner:id) made this job's automatic
    baseline the asking rank's alone (the daemon looked the job up by its bare id and found no rank), and its
    automatic captures had no reference rank."""
    from ondemand_prof.core.options import WindowOptions, make_config_class
    from ondemand_prof.core.window import Window

    service = make_service(tmp_path)
    alive = lambda pid, thorough: True  # noqa: E731
    msg = {"job": "port29500", "world_size": 2, "host": "h", "step": 100}
    for route, rank, pid, uid in ((b"a0", 0, 10, 1000), (b"a1", 1, 11, 1000), (b"o0", 0, 20, 4242)):
        service.registry.register(route, {**msg, "rank": rank, "pid": pid}, time.monotonic(), time.time(), alive,
                                  uid=uid)
    window = Window(200, 205, WindowOptions.from_config(make_config_class()()), source="auto",
                    requested={"auto_baseline": {"why": "steady"}}).to_wire()
    service.handle(b"a0", {"type": "auto_capture", "window": {**window, "capture_id": "baseline-x-r0-10"}})
    record = service.store.records["baseline-x-r0-10"]
    assert sorted(record.data["parts"]) == ["0", "1"], record.data["parts"]
    assert [route for route, _ in service.outbox] == [b"a1"]  # the same window to its rank 1, not the other's
    assert service.store.baseline_of("port29500", 1000) is None  # (until it records something)


def test_a_member_cannot_mark_another_users_job_baseline(group_daemon: dict[str, Any], tmp_path: Path) -> None:
    """A member may capture every job on a --group daemon, but `capture --baseline` of another user's job made
    that capture the job's baseline: the owner's automatic captures were then compared with a window the member
    chose (taken while the job was slow, every later slowdown read 'no change'). Now only the job's owner (or
    root) marks it; the member is told so and nothing is captured."""
    env = group_daemon
    owner = train(tmp_path, "victim", env={"ONDEMAND_PROF_RUNTIME_DIR": str(env["run"])}, steps=100000,
                  log=tmp_path / "owner.log")
    try:
        wait_for(lambda: "victim" in ctl(env["run"], "status").stdout, 120, "the owner's rank")
        member = as_user(env["user"], MEMBER_CTL, str(env["run"]), "capture", "--job", "victim", "--steps", "1",
                         "--baseline", "--no-wait")
        out, err = member.communicate(timeout=60)
        assert member.returncode != 0, out + err
        assert "only its owner (or root) marks its baseline" in err, out + err
        listed = json.loads(ctl(env["run"], "list", "--json").stdout)["captures"]
        assert not [c for c in listed if c.get("baseline")], listed
        mine = ctl(env["run"], "capture", "--job", "victim", "--steps", "1", "--baseline", "--no-wait", "--json")
        assert mine.returncode == 0 and json.loads(mine.stdout)["baseline"] is True, mine.stdout + mine.stderr
    finally:
        stop(owner)


def _trace(path: Path, step_ms: float = 9.0) -> Path:
    events = []
    for s in range(4):
        t = 1000 + s * 10_000
        events += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": t,
                    "dur": step_ms * 1000},
                   {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t + 10, "dur": 3000}]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_report_baseline_says_which_rank_it_cannot_compare(tmp_path: Path) -> None:
    """A folder whose metadata.json names a rank that is not a number made `report --baseline` say 'the daemon's
    reply is malformed (TypeError: unhashable type ...)', with no daemon involved; a trace whose steps have a
    negative length compared as 'step time 9.00 -> -9.00 ms', 'faster'. Now each such rank is not compared, with
    the field named."""
    for name, rank in (("a", [1]), ("b", 0)):
        (tmp_path / name / "r0").mkdir(parents=True)
        _trace(tmp_path / name / "r0" / "t.pt.trace.json")
        (tmp_path / name / "r0" / "metadata.json").write_text(json.dumps(
            {"rank": rank, "capture_id": name, "job_id": "j", "trace_file": "t.pt.trace.json"}))
    res = ctl(tmp_path / "no-daemon", "report", "a", "--baseline", "b", cwd=tmp_path)
    assert "Traceback" not in res.stderr and "malformed" not in res.stderr, res.stderr
    assert "a/r0 (capture): not compared: rank is [1], not a rank number" in res.stdout, res.stdout
    ok = _trace(tmp_path / "ok.json")
    bad = json.loads(ok.read_text())
    for e in bad["traceEvents"]:
        e["dur"] = -abs(e["dur"]) if e["name"].startswith("ProfilerStep") else e["dur"]
    (tmp_path / "neg.json").write_text(json.dumps(bad))
    res = ctl(tmp_path / "no-daemon", "report", "neg.json", "--baseline", "ok.json", cwd=tmp_path)
    assert "-9.00 ms" not in res.stdout and "faster" not in res.stdout, res.stdout
    assert "not compared: the capture's steps[0].dur_ms is -9.0" in res.stdout, res.stdout


def test_the_capture_itself_is_no_baseline_and_nothing_compared_is_a_failure(tmp_path: Path) -> None:
    """The capture given as its own baseline (a prefix or path that names it again) printed 'no change', exit 0;
    so did two captures without a timed step ('nothing to compare'). Now the first is refused, here and by the
    daemon's `compare`, and the second exits 1."""
    ok = _trace(tmp_path / "ok.json")
    res = ctl(tmp_path / "no-daemon", "report", "ok.json", "--baseline", "./ok.json", cwd=tmp_path)
    assert res.returncode == 2 and f"the baseline is the capture itself ({ok.name})" in res.stderr, res.stderr
    for name in ("e1.json", "e2.json"):
        (tmp_path / name).write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                                                  "pid": 1, "tid": 1, "ts": 1, "dur": 5}]}))
    res = ctl(tmp_path / "no-daemon", "report", "e1.json", "--baseline", "e2.json", cwd=tmp_path)
    assert res.returncode == 1 and "nothing to compare" in res.stdout, res.stdout + res.stderr
    service = make_service(tmp_path / "state")
    service.store.add(capture(tmp_path, "now", {0: json.dumps(summary(0))}))
    same = safejson.loads(service.handle(b"c", {"type": "compare", "id": 1, "capture_id": "no",
                                                "baseline_id": "now"}), 1 << 20)
    assert same["type"] == "error" and "the baseline is the capture itself (now)" in same["error"], same


@pytest.mark.quick
def test_every_step_value_is_checked_on_the_fast_path_too() -> None:
    """A column of step times is checked by builtins over the whole column (a value a call held a host's loop
    90 ms a rank of 7,000 steps): min and max skip a NaN, so it must still be refused, as must everything _ms
    refuses; a hair below 0 (float sums of intervals) still reads as 0."""
    from ondemand_prof.report.compare import Unusable, rank_figures

    for bad in (float("nan"), float("inf"), True, -1, "1", [1]):
        with pytest.raises(Unusable, match=r"steps\[1\]\.dur_ms is"):
            rank_figures({"steps": [{"dur_ms": 1.0}, {"dur_ms": bad}, {"dur_ms": 2.0}]})
    assert rank_figures({"steps": [{"dur_ms": -1e-9}, {"dur_ms": 2}, {}]})["step_ms"] == 2 / 3


def test_a_captures_metadata_json_is_read_bounded(tmp_path: Path) -> None:
    """`report DIR` now looks in DIR's metadata.json for the baseline an automatic capture names: a deeply nested
    one was a RecursionError traceback (there and in the report's own reader), and one of 300 MB took 600 MB.
    Now both are read by the bounded reader: that rank fails with the reason, here and as a baseline."""
    for name, text in (("deep", "[" * 100_000), ("huge", json.dumps({"rank": 0, "pad": "x" * (2 << 20)}))):
        (tmp_path / name / "r0").mkdir(parents=True)
        _trace(tmp_path / name / "r0" / "t.pt.trace.json")
        (tmp_path / name / "r0" / "metadata.json").write_text(text)
    _trace(tmp_path / "ok.json")
    for name, why in (("deep", "nested deeper than 64 levels"), ("huge", "1048577 bytes is over the limit of 1048576")):
        res = ctl(tmp_path / "no-daemon", "report", name, cwd=tmp_path)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert f"unreadable metadata.json: {why}" in res.stdout, res.stdout
        res = ctl(tmp_path / "no-daemon", "report", "ok.json", "--baseline", name, cwd=tmp_path)
        assert res.returncode == 1 and f"nothing to compare in {name}: {name}/r0: unreadable metadata.json: {why}" \
            in res.stderr, res.stderr[-2000:]


@pytest.mark.quick
def test_a_name_from_a_summary_cannot_forge_a_line_of_the_daemons_log(tmp_path: Path) -> None:
    """The cause line, which the daemon logs for an automatic capture and list and show print, names the operator
    that grew: a summary's operator named 'aten::mm\\nondemand-profd: ...' wrote a line of its choosing into the
    daemon's (root's) log. Now the name is one line, its newline an escape; a collective kind, library, level or
    basis with a control character is not a word of ours, and that rank is not compared."""
    service = make_service(tmp_path / "state")
    forged = "aten::mm\nondemand-profd: rank 0 of job j registered"
    grown = summary(0, compute=30.0, step_ops={"steps": 4, "ops": [[forged, 40, 120_000, 120_000]], "kernels": []})
    base = capture(tmp_path, "base", {0: json.dumps(summary(0)), 1: json.dumps(summary(1))})
    auto = capture(tmp_path, "auto-x", {0: json.dumps(grown), 1: json.dumps(summary(
        1, collectives=[{"kind": "all_reduce\nx", "count_per_step": 1, "ms_per_step": 2.0}]))})
    auto.data["compare_with"] = "base"
    for record in (base, auto):
        service.store.add(record)
    service.changed(auto)
    cause = auto.data["cause"]
    assert "\n" not in cause and "aten::mm\\nondemand-profd: rank 0" in cause, cause
    problems = compare_records(auto.data, base.data)["problems"]
    assert "collectives[0].kind is 'all_reduce\\nx'" in problems["1"], problems
