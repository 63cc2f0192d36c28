"""Issue 28: a capture against a healthy baseline. Real paired traces (HTA's own), checked against HTA's TraceDiff
where both compute the same thing; a live 2-rank gloo job with slowdowns switched on while it runs, each of which
must be blamed on the right rank and category; the CLI as a user runs it (text, --json, --html)."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from html import escape as html_escape

from conftest import ctl, end_test_env, short_dir, start_daemon, start_ranks, status_lines, wait_for

REAL = Path(__file__).parent / "fixtures" / "real"


def report_json(*args: str, cwd: Path | None = None, run: Path | None = None) -> dict[str, Any]:
    res = ctl(run or Path("/nonexistent"), "report", *args, "--json", cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)["comparison"]


def _ours(path: Path) -> dict[str, Any]:
    from ondemand_prof.report.analyze import RankAnalyzer

    an = RankAnalyzer()
    an.feed(json.load(gzip.open(path))["traceEvents"])
    return an.result()


def _hta_diff(tmp_path: Path, control: Path, test: Path, *devices: str) -> list[Any]:
    """HTA's TraceDiff over every step of both traces (its default is the first step of the first rank), one
    table per device type (HTA parses each trace once)."""
    pytest.importorskip("hta")
    from hta.trace_diff import DeviceType, LabeledTrace, TraceDiff

    labeled = []
    for label, src in (("control", control), ("test", test)):
        d = tmp_path / label
        d.mkdir(parents=True)
        shutil.copy(src, d / src.name)
        labeled.append(LabeledTrace(label, trace_dir=str(d)))
    c, t = labeled
    return [TraceDiff.compare_traces(c, t, control_iteration=c.iterations(), test_iteration=t.iterations(),
                                     device_type=getattr(DeviceType, device)) for device in devices]


@pytest.mark.quick
def test_operators_and_kernels_match_htas_tracediff_on_its_real_pair(tmp_path: Path) -> None:
    """HTA's trace_diff pair (real A100 traces): our per-step tables, times the steps, are HTA's counts and total
    durations for every CPU operator on both sides and every kernel of the control. The test side has 614
    kernels whose launch is not in the file: HTA drops them, we place them in the step their start falls in (as
    our report does), so there we count exactly those 614 more."""
    control, test = REAL / "hta_trace_diff_control.json.gz", REAL / "hta_trace_diff_test.json.gz"
    cpu, gpu = _hta_diff(tmp_path, control, test, "CPU", "GPU")
    for side, path in (("control", control), ("test", test)):
        ours = _ours(path)
        table = ours["step_ops"]
        assert table["complete"] == {"ops": True, "kernels": True}
        for name, calls, _self, total in table["ops"]:
            assert cpu.loc[name, f"{side}_counts"] == calls, name
            assert abs(cpu.loc[name, f"{side}_total_duration"] - total) <= 1 + calls, name  # HTA's integer us
        extra = 0
        for name, calls, total in table["kernels"]:
            hta_calls = gpu.loc[name, f"{side}_counts"]
            assert calls >= hta_calls, name
            extra += calls - hta_calls
        assert extra == ours["kernel_steps"]["by_time"], (side, extra, ours["kernel_steps"])
    assert extra == 614


def test_the_real_pairs_compare_through_the_cli(tmp_path: Path) -> None:
    """`report NOW --baseline BASE` on files, as a user gives them: what HTA's TraceDiff calls '+' (a name the
    control lacks) we flag new; the trace_diff pair's cause names the device's compute, and its two captures are
    of different ranks, which is said."""
    for name in ("hta_trace_compare_base.json.gz", "hta_trace_compare_test.json.gz", "hta_trace_diff_control.json.gz",
                 "hta_trace_diff_test.json.gz"):
        shutil.copy(REAL / name, tmp_path / name)
    small = report_json("hta_trace_compare_test.json.gz", "--baseline", "hta_trace_compare_base.json.gz", cwd=tmp_path)
    (rank,) = small["ranks"]
    new = {c["name"] for c in rank["changes"] if c["status"] == "new"}
    (diff,) = _hta_diff(tmp_path / "hta", REAL / "hta_trace_compare_base.json.gz",
                        REAL / "hta_trace_compare_test.json.gz", "ALL")
    hta_new = {n for n in diff.index if diff.loc[n, "control_counts"] == 0 and diff.loc[n, "test_counts"] > 0}
    assert new == hta_new == {"All2All_Pooled_Req", "CatBackward0", "AddmmBackward0"}
    assert small["cause"].startswith("no change")  # the same steps: only operators were added

    big = report_json("hta_trace_diff_test.json.gz", "--baseline", "hta_trace_diff_control.json.gz", cwd=tmp_path)
    assert big["step_ms"]["baseline"] == pytest.approx(77.49, abs=0.01)
    assert big["step_ms"]["now"] == pytest.approx(124.07, abs=0.01)
    assert big["category"] == "compute" and "compute grew" in big["cause"]
    assert any("rank 3 of the baseline compared with rank 1" in n for n in big["notes"]), big["notes"]
    kinds = {k["kind"]: k for k in big["communication"]}
    assert kinds["all_reduce"]["calls_baseline"] == 3 and kinds["all_reduce"]["calls_now"] == 3.5
    text = ctl(Path("/nonexistent"), "report", "hta_trace_diff_test.json.gz", "--baseline",
               "hta_trace_diff_control.json.gz", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "step time 77.49 -> 124.07 ms (+46.58 ms, +60.1%)" in text.stdout
    assert "cause: rank 1: compute grew" in text.stdout, text.stdout


def test_a_baseline_that_is_not_there_is_an_error_that_says_so(tmp_path: Path) -> None:
    shutil.copy(REAL / "hta_trace_compare_base.json.gz", tmp_path / "base.json.gz")
    res = ctl(Path("/nonexistent"), "report", "base.json.gz", "--baseline", "nope", cwd=tmp_path)
    assert res.returncode != 0 and "'nope' is not a file or directory here" in res.stderr, res.stderr
    res = ctl(Path("/nonexistent"), "report", "base.json.gz", "base.json.gz", "--baseline", "base.json.gz",
              cwd=tmp_path)
    assert res.returncode == 2 and "compares one capture with one baseline" in res.stderr, res.stderr
    (tmp_path / "empty").mkdir()
    res = ctl(Path("/nonexistent"), "report", "base.json.gz", "--baseline", "empty", cwd=tmp_path)
    assert res.returncode == 1 and "nothing to compare in empty" in res.stderr, res.stderr


# ----------------------------------------------------------------------------------------------------------
# A live job: baseline, then a slowdown switched on while it runs, then a capture; the cause must name the rank


# conftest's live_job: a daemon and 2 ranks saving to the default ./profile of the job's directory
LIVE_JOB = {"world": 2, "args": ["--inject-file", "{work}/inject.json"], "files": {"inject.json": "{}"},
            "warm_steps": 60}


@pytest.fixture(scope="module")
def job(live_job: dict[str, Any]) -> dict[str, Any]:
    env = {"run": live_job["run"], "work": live_job["work"], "inject": live_job["work"] / "inject.json",
           "procs": live_job["procs"]}
    env["baseline"] = capture(env)
    return env


def inject(env: dict[str, Any], spec: dict[str, Any]) -> None:
    """Switch a slowdown on ({} off) from 10 steps after the latest a rank finished, on every rank at that step
    (a switch two ranks read at different steps had one do barriers the other did not: the job hung), as a whole
    file (the ranks never read half of it)."""
    done = [s["step"] for s in status_lines(env["work"] / "steps.jsonl") if "step" in s]
    path = env["inject"]
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(json.dumps({**spec, "at_step": max(done, default=0) + 10}))
    tmp.replace(path)


def steps_done(env: dict[str, Any]) -> int:
    return len(status_lines(env["work"] / "steps.jsonl"))


def capture(env: dict[str, Any], *extra: str) -> str:
    res = ctl(env["run"], "capture", "--steps", "6", "--wait", "--timeout", "90", "--json", *extra)
    if res.returncode != 0:
        try:
            parts = {k: (p["state"], p.get("error")) for k, p in json.loads(res.stdout)["parts"].items()}
        except (ValueError, KeyError):
            parts = {}
        raise AssertionError(f"capture exited {res.returncode}: {parts} {res.stderr[-2000:]}")
    return json.loads(res.stdout)["capture_id"]


def slowed(env: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Switch the slowdown on, let it run (45 status lines: 2 ranks, from 10 steps on), capture, switch it off;
    the comparison with the baseline."""
    inject(env, spec)
    n = steps_done(env)
    wait_for(lambda: steps_done(env) > n + 45, 120, "steps with the slowdown")  # (it begins 10 steps on)
    try:
        now = capture(env)
    finally:
        inject(env, {})
    return report_json(now, "--baseline", env["baseline"], cwd=env["work"], run=env["run"])


# Live, the path: a slowdown switched on, captures, the comparison printed. What the cause rule concludes from such
# captures is tested on recorded ones (tests/test_answers.py), which no load can change; here, what holds under any
# load: the calls the slowdown added, the figures' tests, who waited for whom on both sides, a cause line.


def assert_tested(c: dict[str, Any]) -> None:
    """Every rank's figures carry their per-step values' test, the job's step time its interval, and both sides
    who made whom wait; a cause line and a rule."""
    assert c["step_ms"]["test"]["n_before"] == c["step_ms"]["test"]["n_after"] == 6
    assert c["step_ms"]["test"]["lo"] is not None and c["cause"] and c["rule"]
    for r in c["ranks"]:
        assert {"step", "own", "compute", "communication", "idle"} <= set(r["tests"]), r["tests"]
        assert len(r["step_ms_by_step"]["baseline"]) == len(r["step_ms_by_step"]["now"]) == 6
    for side in ("baseline", "now"):
        w = c["collectives"][side]
        assert w is not None and w["matched"] >= 6 * 4 and {x["rank"] for x in w["ranks"]} == {0, 1}, side


def test_a_straggler_is_compared_and_its_extra_matmuls_are_on_its_rank(job: dict[str, Any]) -> None:
    c = slowed(job, {"kind": "straggler", "rank": 1, "amount": 12})
    assert_tested(c)
    r1 = next(r for r in c["ranks"] if r["rank"] == 1)
    mm = next(x for x in r1["changes"] if x["name"] == "aten::mm")
    assert mm["calls_baseline"] == 3 and mm["calls_now"] == 15  # 3 linear-layer matmuls + the 12 injected
    assert "test" in mm and mm["test"]["n_after"] == 6
    r0 = next(r for r in c["ranks"] if r["rank"] == 0)
    assert all(x["name"] != "aten::mm" or x["calls_now"] == 3 for x in r0["changes"])


def test_slow_input_is_compared(job: dict[str, Any]) -> None:
    c = slowed(job, {"kind": "input", "rank": 0, "amount": 30})
    assert_tested(c)
    r0 = next(r for r in c["ranks"] if r["rank"] == 0)
    assert r0["split"]["idle"]["now"] > r0["split"]["idle"]["baseline"]  # 30 ms of sleep a step: under any load


def test_more_communication_on_every_rank_is_compared(job: dict[str, Any]) -> None:
    c = slowed(job, {"kind": "comm", "amount": 8})
    assert_tested(c)
    kinds = {k["kind"]: k for k in c["communication"]}
    assert kinds["all_reduce"]["calls_now"] == kinds["all_reduce"]["calls_baseline"] + 1
    assert c["collectives"]["now"]["kinds"][0]["calls_per_step"] == 5  # matched across the ranks, 5 a step


def test_an_extra_synchronisation_each_step_is_compared(job: dict[str, Any]) -> None:
    c = slowed(job, {"kind": "sync", "amount": 20})
    assert_tested(c)
    kinds = {k["kind"]: k for k in c["communication"]}
    assert kinds["barrier"]["calls_baseline"] == 0 and kinds["barrier"]["calls_now"] == 20


def test_more_small_operators_on_every_rank_are_compared(job: dict[str, Any]) -> None:
    c = slowed(job, {"kind": "small_ops", "amount": 3000})
    assert_tested(c)
    for r in c["ranks"]:
        add = next(x for x in r["changes"] if x["name"] == "aten::add")
        assert add["status"] == "new" and add["calls_now"] == 3000


def test_the_comparison_as_text_and_html(job: dict[str, Any], tmp_path: Path) -> None:
    """What the engineer paged at 3 a.m. reads: the cause line first, the per-rank table; and the HTML page,
    rendered by a real browser, names both captures and shows the cause."""
    inject(job, {"kind": "straggler", "rank": 1, "amount": 12})
    n = steps_done(job)
    wait_for(lambda: steps_done(job) > n + 45, 120, "steps with the slowdown")
    try:
        now = capture(job)
    finally:
        inject(job, {})
    page = tmp_path / "cmp.html"
    res = ctl(job["run"], "report", now, "--baseline", job["baseline"], "--html", str(page), cwd=job["work"])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"capture {now} (job {lines[0].split('(job ')[1].split(')')[0]}) against baseline " \
                       f"{job['baseline']} (job {lines[0].split('(job ')[1].split(')')[0]})"
    assert "95 % CI" in lines[1] and lines[2].startswith("  cause: "), res.stdout
    assert "per rank, ms per step (baseline -> now; * a significant change" in res.stdout
    assert "who made whom wait, inside each capture" in res.stdout
    html = page.read_text()
    cause = lines[2].removeprefix("  cause: ")[:40]
    assert now in html and job["baseline"] in html and html_escape(cause) in html
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium here (.ci/run installs it)")
    shot = tmp_path / "cmp.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'chrome'}", f"--screenshot={shot}", "--window-size=1200,1600",
                    page.as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000


# ----------------------------------------------------------------------------------------------------------
# The automatic baseline: --profile-auto takes one, the automatic capture of a slowdown is compared with it


def test_an_automatic_capture_is_compared_with_the_automatic_baseline(tmp_path: Path) -> None:
    """A 2-rank job with --profile-auto 1.5 --profile-baseline-at 40: the start-up line says when the baseline is
    taken and what the trigger is, the daemon records the baseline on both ranks and `list` marks it; a straggler
    switched on later opens an automatic capture on both ranks, which the daemon compares with the baseline once
    it settles and keeps (its log carries the cause line), `list` shows as `vs <baseline>`, and `show` and `report`
    print that comparison without --baseline. A second baseline by hand (capture --baseline) then replaces it, and
    a restarted daemon still knows it."""
    run, state, work = short_dir("odpab"), short_dir("odpabs"), Path(short_dir("odpabw"))
    inject_path = work / "inject.json"
    inject_path.write_text("{}")
    daemon = start_daemon(run, state)
    procs = start_ranks(["--steps", "1000000", "--step-sleep", "0.02", "--status-file", str(work / "steps.jsonl"),
                         "--inject-file", str(inject_path), "--profile-auto", "1.5", "--profile-auto-steps", "4",
                         "--profile-auto-confirm", "2",
                         "--profile-baseline-at", "40", "--profile-auto-cooldown", "0", "--profile-auto-budget", "100"],
                        world=2,
                        env={"ONDEMAND_PROF_RUNTIME_DIR": str(run), "ONDEMAND_PROF_LOG": "INFO"}, cwd=work)
    try:
        def listed() -> list[dict[str, Any]]:
            res = ctl(run, "list", "--json")
            return json.loads(res.stdout)["captures"] if res.returncode == 0 else []

        base = wait_for(lambda: next((c for c in listed() if c.get("baseline")), None), 180, "the automatic baseline",
                        pause=0.5)
        assert base["capture_id"].startswith("baseline-") and base["ranks"] == 2, base
        assert "BASELINE" in ctl(run, "list").stdout
        inject({"inject": inject_path, "work": work}, {"kind": "straggler", "rank": 1, "amount": 40})
        # (a loaded host may slow the job on its own first: such a capture is compared too; the straggler's shows
        # rank 1's 40 extra matmuls a step, whatever the load)
        def straggler_capture() -> dict[str, Any] | None:
            for c in listed():
                if c["capture_id"].startswith("auto-") and c["status"] != "running" and c.get("cause"):
                    shown = json.loads(ctl(run, "show", c["capture_id"], "--json").stdout or "{}")
                    ranks = (shown.get("comparison") or {}).get("ranks") or []
                    if any(x["name"] == "aten::mm" and x["calls_now"] == 43 for r in ranks if r["rank"] == 1
                           for x in r["changes"]):
                        return c
            return None

        auto = wait_for(straggler_capture, 180, "an automatic capture of the straggler compared with the baseline",
                        pause=1.0)
        inject({"inject": inject_path, "work": work}, {})
        assert auto["compare_with"] == base["capture_id"] and auto["ranks"] == 2, auto
        assert f"vs {base['capture_id']}" in ctl(run, "list").stdout
        shown = ctl(run, "show", auto["capture_id"])
        assert f"against baseline {base['capture_id']}" in shown.stdout and f"cause: {auto['cause'][:40]}" in \
            shown.stdout, shown.stdout
        reported = ctl(run, "report", auto["capture_id"], cwd=work)
        assert reported.returncode == 0, reported.stderr
        assert f"against baseline {base['capture_id']}" in reported.stdout, reported.stdout
        assert auto["cause"][:40] in reported.stdout  # the comparison kept on the record, not another one

        manual = json.loads(ctl(run, "capture", "--steps", "3", "--baseline", "--wait", "--json").stdout)
        assert manual["baseline"] is True
        daemon.terminate()
        daemon.communicate(timeout=30)
        daemon = start_daemon(run, state)
        marked = [c["capture_id"] for c in listed() if c.get("baseline")]
        assert marked == [manual["capture_id"]], marked  # one a job, the newest wins, kept across restarts
    finally:
        end_test_env([*procs, daemon], run, state, work)
    logs = [p.communicate()[1] for p in procs]
    for rank, log in enumerate(logs):  # every rank's start-up line says when the baseline is taken
        line = next((x for x in log.splitlines() if f"ondemand_prof: rank {rank} of 2, job" in x), "")
        assert "automatic captures on a 1.5x shift of the step time from the baseline's (a CUSUM of the steps over " \
               "1.22x its median; at most one false alarm per 1,000,000 steps of an unchanged job; held 2 s before it " \
               "counts, so a burst of the host's load does not), none before the baseline, compared with a baseline " \
               "at step 40 (--profile-baseline-at)" in line, log[-3000:]


def test_two_different_models_or_world_sizes_are_said_never_silently_compared(tmp_path: Path) -> None:
    """ResNet-50 on one GPU against a recommendation model's rank: the operators barely overlap, which the
    comparison says in one line (and the world sizes differ, and so do the ranks compared)."""
    shutil.copy(REAL / "kineto_resnet50_2021-06.pt.trace.json.gz", tmp_path / "resnet.json.gz")
    shutil.copy(REAL / "hta_trace_diff_control.json.gz", tmp_path / "dlrm.json.gz")
    c = report_json("resnet.json.gz", "--baseline", "dlrm.json.gz", cwd=tmp_path)
    assert any(n.startswith("different models? only ") for n in c["notes"]), c["notes"]
    shutil.copy(REAL / "hta_trace_diff_control.json.gz", tmp_path / "dlrm_again.json.gz")  # (itself is refused)
    same = report_json("dlrm_again.json.gz", "--baseline", "dlrm.json.gz", cwd=tmp_path)
    assert same["notes"] == [] and same["cause"].startswith("no change"), same


# ----------------------------------------------------------------------------------------------------------
# From test_hardening4.py (issue 41): summaries parsed once until they change; a partial baseline's empty rank


@pytest.mark.quick
def test_summaries_are_parsed_once_until_the_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41, 3: parsed summaries are kept by the file's identity (device, inode, mtime, ctime, size). Before,
    every compare read and parsed every summary again; a rewritten file is read again."""
    from ondemand_prof.core import safejson
    from ondemand_prof.host.summaries import compare_records

    parsed: list[int] = []
    real = safejson.loads
    monkeypatch.setattr(safejson, "loads", lambda raw, *a, **k: parsed.append(len(raw)) or real(raw, *a, **k))
    records = {}
    for side in ("base", "now"):
        d = tmp_path / side / "rank0"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"rank": 0, "steps": [{"dur_ms": 2.0 + (side == "now")}] * 4}))
        records[side] = {"capture_id": side, "job": "j", "parts": {
            "0": {"rank": 0, "host": "h", "pid": 1, "state": "done", "path": str(d)}}}
    first = compare_records(records["now"], records["base"])
    assert len(parsed) == 2 and len(first["ranks"]) == 1, (parsed, first)
    assert compare_records(records["now"], records["base"]) == first and len(parsed) == 2, parsed
    time.sleep(0.01)
    (tmp_path / "now" / "rank0" / "summary.json").write_text(json.dumps({"rank": 0, "steps": [{"dur_ms": 5.0}] * 4}))
    again = compare_records(records["now"], records["base"])
    assert len(parsed) == 3 and again["ranks"][0]["step_ms"]["now"] == 5.0, (parsed, again["ranks"][0]["step_ms"])


@pytest.mark.quick
def test_a_partial_baselines_rank_is_said_to_have_recorded_nothing(tmp_path: Path) -> None:
    """Issue 41, 12: a baseline whose rank 1 failed, against a capture where it recorded: the note says rank 1
    recorded nothing in the baseline, and why (before: "baseline: <its error>", as if the baseline's summary were
    unreadable)."""
    from ondemand_prof.host.summaries import compare_records, conclude_replies

    def part(rank: int, side: str, done: bool = True) -> dict[str, Any]:
        d = tmp_path / side / f"rank{rank}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"rank": rank, "steps": [{"dur_ms": 2.0}] * 4}))
        if done:
            return {"rank": rank, "host": "h", "pid": 1, "state": "done", "path": str(d)}
        return {"rank": rank, "host": "h", "pid": 1, "state": "failed", "error": "rank 1 is gone: process 7 exited"}

    base = {"capture_id": "b", "job": "j", "parts": {"0": part(0, "b"), "1": part(1, "b", done=False)}}
    now = {"capture_id": "n", "job": "j", "parts": {"0": part(0, "n"), "1": part(1, "n")}}
    notes = conclude_replies([("h", compare_records(now, base))])["notes"]
    assert "rank 1 (h): not compared: recorded nothing in the baseline (failed: rank 1 is gone: process 7 " \
           "exited)" in notes, notes
