"""Answers a loaded machine cannot change: the comparison's significance, who made whom wait, the replay and the
cause rule, replayed on captures recorded once (tests/fixtures/recorded/: real gloo jobs with real slowdowns,
scripts/record_captures.py, how.json in each says how), on real multi-rank traces from public repositories
(tests/fixtures/real/: an 8-rank NCCL job, a 2-rank HCCL job; checked against a plain recount from the files'
JSON written here), and on timelines built here (named synthetic)."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from ondemand_prof.report import build_report, build_reports, compare_groups
from ondemand_prof.report.stats import change, hiccups, t_quantile
from ondemand_prof.report.timeline import decode, encode
from ondemand_prof.report.waits import match, summary
from ondemand_prof.report.replay import analyze, growth

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "fixtures" / "recorded"
REAL = HERE / "fixtures" / "real"


def compared(name: str) -> dict[str, Any]:
    """`report now --baseline baseline` of a recorded pair, as the CLI computes it (from the ranks' summaries)."""
    now, base = build_reports([[RECORDED / name / "now"], [RECORDED / name / "baseline"]], summaries=True, workers=1)
    return compare_groups(base["captures"][0], now["captures"][0])


# ----------------------------------------------------------------------------------------------------------
# Recorded slowdowns: each names its cause


def test_a_straggler_is_the_cause_and_its_share_of_the_growth_is_said() -> None:
    c = compared("straggler")
    assert c["kind"] == "job" and c["culprits"] == [1] and c["waiting"] == [0], c["cause"]
    assert c["category"] == "compute" and "aten::mm" in c["cause"] and "3 -> 15 calls/step" in c["cause"], c["cause"]
    assert "(95 % CI" in c["cause"] and "rank 1 explains" in c["cause"], c["cause"]
    assert c["step_ms"]["test"]["verdict"] == "grew"
    now = {r["rank"]: r for r in c["collectives"]["now"]["ranks"]}
    assert now[1]["caused_ms"] > now[0]["caused_ms"] and now[1]["last_share"] > 0.5  # inside the capture
    share = {s["rank"]: s["ms"] for s in c["shares"]["shares"]}
    assert share[1] > 5 * max(share[0], 0.1), share  # the what-if replay puts the growth on rank 1
    assert abs(c["shares"]["error_pct"]) < 5  # the model gives back the measured steps


def test_slow_input_is_host_time_on_its_rank() -> None:
    c = compared("input")
    assert c["culprits"] == [1] and c["waiting"] == [0], c["cause"]
    assert c["category"] == "host time outside operators (input, Python, sleeping)", c["cause"]


def test_a_straggler_among_four_ranks_is_named_even_where_the_host_blurs_the_step_times() -> None:
    """4 ranks on 2 cores: the job's step time is too noisy to call a change, but inside the capture the others
    waited for rank 2 (which did not happen in the baseline): it is named, the others waited for it."""
    c = compared("straggler_4ranks")
    assert c["culprits"] == [2] and c["waiting"] == [0, 1, 3], c["cause"]
    assert "aten::mm" in c["cause"] and "ranks 0, 1, 3 only waited for it" in c["cause"], c["cause"]


def test_an_extra_all_reduce_on_a_loaded_host_is_communication() -> None:
    c = compared("comm_loaded")
    assert c["category"] == "communication", c["cause"]
    assert "all_reduce" in c["cause"] and "4 -> 5 calls/step" in c["cause"], c["cause"]


def test_extra_barriers_are_communication() -> None:
    c = compared("sync")
    assert c["category"] == "communication", c["cause"]
    assert "barrier (new)" in c["cause"] and "0 -> 20 calls/step" in c["cause"], c["cause"]


def test_more_small_operators_on_every_rank_is_every_rank_slower_alike() -> None:
    c = compared("small_ops")
    assert c["kind"] == "job" and c["verdict"] == "alike" and c["culprits"] == [0, 1], c["cause"]
    assert c["cause"].startswith("every rank got slower alike") and "aten::add (new)" in c["cause"], c["cause"]


def test_a_periodic_hiccup_is_said_as_such() -> None:
    """Rank 0 spends 100 ms more every tenth step (a synchronous checkpoint): the steps are named, on rank 0,
    outside operators; the other rank's long steps were its wait for them (communication), not its own."""
    c = compared("hiccup")
    assert "in 20: +" in c["cause"] and "ms on rank 0 (host time outside operators" in c["cause"], c["cause"]
    assert "on rank 1 (" not in c["cause"], c["cause"]


def test_a_rank_starved_of_cpu_is_said_to_wait_for_a_cpu_not_to_compute_more() -> None:
    c = compared("cpu_starved")
    assert c["kind"] == "host" and c["culprits"] == [1], c["cause"]
    assert c["category"] == "CPU (run-queue wait)" and "waited" in c["cause"] and "for a CPU" in c["cause"], c["cause"]
    assert "aten::mm" not in c["cause"]


def test_a_slower_link_between_two_hosts_is_the_network_not_a_rank() -> None:
    """Two hosts (network namespaces) whose link was capped with tc: the all_reduce's transfer grew on both ranks,
    no rank arrived later, no rank's own work grew: the network; the clocks of the two hosts were aligned."""
    c = compared("network")
    assert c["category"] == "network" and c["kind"] == "job", c["cause"]
    assert "all_reduce transfer +" in c["cause"] and "no rank arrived later" in c["cause"], c["cause"]
    for r in c["ranks"]:
        assert r["tests"]["own"]["verdict"] != "grew", r["tests"]["own"]
    assert c["collectives"]["now"]["clock"]["hosts"] == 2
    assert any("the clocks of 2 hosts aligned on" in n for n in c["notes"]), c["notes"]


def test_healthy_pairs_of_one_job_name_no_cause_in_the_job() -> None:
    """Ten pairs of healthy captures of one unchanged job, the host's load different between the two (two busy
    loops during one of them): at least nine name nothing in the job (no change, faster, or the host: a rank
    waiting for a CPU); none blames a rank's work or an operator."""
    verdicts = {p.name: compared(p.name) for p in sorted(RECORDED.glob("healthy_*"))}
    assert len(verdicts) == 10
    job = {name: c["cause"] for name, c in verdicts.items() if c["kind"] == "job"}
    assert len(job) <= 1, job
    for c in verdicts.values():
        assert c["verdict"] != "one_step" and "(95 % CI" in c["cause"] or c["verdict"] == "hiccup", c["cause"]


def test_every_compared_figure_carries_its_per_step_values_and_test() -> None:
    c = compared("straggler")
    for r in c["ranks"]:
        assert len(r["step_ms_by_step"]["baseline"]) == len(r["step_ms_by_step"]["now"]) == 6
        for key in ("step", "own", "compute", "communication", "overlap", "idle", "cpu", "cpu_wait"):
            t = r["tests"][key]
            assert t["n_before"] == t["n_after"] == 6 and t["verdict"] in ("grew", "shrank", "same"), (key, t)
            assert (t["lo"] <= t["delta"] <= t["hi"]), (key, t)
        tested = [x for x in r["changes"] if "test" in x]
        assert tested, r["changes"]
    kinds = c["ranks"][0]["communication"]["collectives"]
    assert all("test" in k for k in kinds)


# ----------------------------------------------------------------------------------------------------------
# Real multi-rank traces: waits recounted from the files


def _recount_nccl(folder: Path) -> tuple[list[int], list[float]]:
    """From the raw files: per collective (the i-th NCCL kernel of each rank), which rank's kernel began last, and
    how long the others waited for it on average (us)."""
    starts: dict[int, list[float]] = {}
    for path in sorted(folder.glob("*.json.gz")):
        data = json.loads(gzip.decompress(path.read_bytes()))
        rank = data["distributedInfo"]["rank"]
        starts[rank] = sorted(float(e["ts"]) for e in data["traceEvents"] if e.get("ph") == "X" and
                              e.get("cat") == "kernel" and str(e.get("name", "")).startswith("ncclKernel"))
    n = {len(v) for v in starts.values()}
    assert len(n) == 1, n
    last, waited = [], []
    for i in range(n.pop()):
        at = {r: v[i] for r, v in starts.items()}
        lr = max(at, key=at.__getitem__)
        last.append(lr)
        waited.append(statistics.fmean(at[lr] - a for r, a in at.items() if r != lr))
    return last, waited


def test_an_eight_rank_nccl_job_says_who_made_whom_wait() -> None:
    """param's DLRM job on 8 V100s (one step, 8 NCCL collectives on every rank): which rank's kernel began last at
    each collective and how long the others waited for it, as a recount from the files has it; rank 7 held the
    others up most, and is named the slowest though its own step is the shortest."""
    group = build_report([REAL / "param_dlrm_kineto_8rank"], workers=1)["captures"][0]
    w = group["collectives"]
    assert w["matched"] == 8 and w["steps"] == [10]
    last, waited = _recount_nccl(REAL / "param_dlrm_kineto_8rank")
    counts = {r: last.count(r) for r in range(8)}
    ours = {r["rank"]: r for r in w["ranks"]}
    for r in range(8):
        assert ours[r]["arrived_last"] == counts[r], (r, ours[r], counts)
        caused = sum(wt for lr, wt in zip(last, waited) if lr == r) / 1000
        assert ours[r]["caused_ms"] == pytest.approx(caused, abs=0.02), r  # (the clocks' alignment moves it by us)
    assert counts[7] == 5 and group["slowest"]["rank"] == 7 and group["slowest"]["stands_out"]
    steps = {r["rank"]: r["step_ms_mean"] for r in group["ranks"]}
    assert steps[7] == min(steps.values())  # the longest step is not the slowest rank
    replay = w["replay"]
    assert abs(replay["error_pct"]) < 5 and replay["ideal_ms"] < replay["replayed_ms"]
    assert w["clock"]["skew_us"] < 20  # every collective ends within a few us on every rank
    assert len(w["matrix"]["ranks"]) == 8 and w["matrix"]["ms_per_step"][0][7] > 0


def test_a_two_rank_hccl_job_matches_its_hcom_operations() -> None:
    """MindStudio Insight's 2-rank torch_npu capture (step 50, four hcom_allReduce_ on each rank): the four matched,
    not the HCCL tasks inside them; rank 0 began the first 5.6 ms before rank 1 and waited for it, as the raw
    trace_view.json says."""
    group = build_report([REAL / "msinsight_text_level1_2rank"], workers=1)["captures"][0]
    w = group["collectives"]
    assert w["matched"] == 4 and [k["kind"] for k in w["kinds"]] == ["all_reduce"]
    ops = {}
    for r in (0, 1):
        events = json.loads(gzip.decompress((REAL / "msinsight_text_level1_2rank" / f"rank{r}_ascend_pt" /
                                            "ASCEND_PROFILER_OUTPUT" / "trace_view.json.gz").read_bytes()))
        ops[r] = sorted(float(e["ts"]) for e in events if e.get("ph") == "X" and
                        str(e.get("name", "")).startswith("hcom_allReduce_"))
    waits = [max(ops[0][i], ops[1][i]) - ops[0][i] for i in range(4)]
    assert waits[0] == pytest.approx(5608.3, abs=1)
    ours = {r["rank"]: r for r in w["ranks"]}
    assert ours[0]["wait_ms"] == pytest.approx(sum(waits) / 1000, abs=0.03)
    assert ours[1]["arrived_last"] >= 1 and ours[0]["caused_ms"] < ours[1]["caused_ms"]


# ----------------------------------------------------------------------------------------------------------
# The parts, on timelines and values built here (synthetic)


def synthetic_timeline(late_us: float, steps: int = 5, n: int = 4, offset: float = 0.0,
                       slowest: float = 0.0) -> dict[str, Any]:
    """One rank of a synthetic job: each step 10 ms of work, then `n` blocking all_reduces of 100 us transfer each,
    1 ms of work between them; this rank begins each step's first collective `late_us` later, the job's latest
    rank `slowest` later. Clock moved by `offset` us."""
    rows = []
    t = 1e6 + offset
    for s in range(steps):
        entries = []
        at = t + 10_000 + late_us
        for _ in range(n):
            end = max(at, t + 10_000 + slowest) + 100
            entries.append(("all_reduce", "0", at, end))
            at = end + 1000
        rows.append((s, t, (at - 1000 + 2000) - t, entries))
        t = at - 1000 + 2000
    return encode("cpu", rows)


SLOWEST = 3000.0  # the latest rank's extra work in the synthetic job


def test_the_waits_and_the_replay_of_a_synthetic_straggler() -> None:
    """Rank 2 of 3 begins each step's collectives 3 ms late (synthetic): it arrived last at every first collective,
    the others waited 3 ms a step for it, the transfer is the 100 us put in, and the replay gives back the steps
    with rank 2 explaining all of the time above the ideal."""
    ranks = [(r, "h", decode(synthetic_timeline(SLOWEST if r == 2 else 0, slowest=SLOWEST))) for r in range(3)]
    m = match(ranks)
    assert m is not None
    w = summary(m)
    by = {r["rank"]: r for r in w["ranks"]}
    assert by[2]["arrived_last"] == 5 and by[2]["caused_ms"] == pytest.approx(3.0, abs=0.01)
    assert by[0]["wait_ms"] == pytest.approx(3.0, abs=0.01) and by[2]["wait_ms"] == pytest.approx(0.0, abs=0.01)
    assert w["kinds"][0]["transfer_ms"] == pytest.approx(0.4, abs=0.01)  # 4 of 100 us a step
    r = analyze(m)
    assert r is not None and abs(r["error_pct"]) < 0.5
    shares = {s["rank"]: s["ms"] for s in r["shares"]}
    assert shares[2] == pytest.approx(r["replayed_ms"] - r["ideal_ms"], rel=0.05) and shares[0] == pytest.approx(0)


def test_clocks_of_another_host_are_aligned_on_collective_ends() -> None:
    """Rank 1 on host b whose clock is 700 us ahead (synthetic): aligned on the collectives' ends, its waits are
    the ones of one clock; the offset and a residual skew near zero are said."""
    ranks = [(0, "a", decode(synthetic_timeline(0, slowest=SLOWEST))),
             (1, "b", decode(synthetic_timeline(SLOWEST, offset=700, slowest=SLOWEST)))]
    w = summary(match(ranks))
    assert w["clock"]["hosts"] == 2 and w["clock"]["offsets_us"]["b"] == pytest.approx(-700, abs=1)
    assert w["clock"]["skew_us"] < 1
    by = {r["rank"]: r for r in w["ranks"]}
    assert by[1]["caused_ms"] == pytest.approx(3.0, abs=0.01)


def test_growth_shares_put_a_new_straggler_first() -> None:
    base = match([(r, "h", decode(synthetic_timeline(0))) for r in range(3)])
    now = match([(r, "h", decode(synthetic_timeline(SLOWEST if r == 2 else 0, slowest=SLOWEST))) for r in range(3)])
    g = growth(now, base)
    assert g is not None
    shares = {s["rank"]: s["ms"] for s in g["shares"]}
    assert shares[2] == pytest.approx(3.0, abs=0.1) and abs(shares[0]) < 0.05
    assert abs(g["collectives_ms"]) < 0.1  # the transfers did not change


def test_welch_interval_and_one_step() -> None:
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-3)
    assert t_quantile(0.975, 10) == pytest.approx(2.2281, abs=1e-3)
    c = change([10, 11, 9, 10, 10], [15, 16, 14, 15, 15])  # equal variances 0.5: t(8) = 2.306, se = sqrt(0.2)
    assert c.delta == pytest.approx(5) and c.hi - c.delta == pytest.approx(2.306 * 0.2 ** 0.5, abs=1e-3)
    assert c.verdict == "grew" and c.text() == "+5.00 ms/step (95 % CI +3.97 to +6.03)"
    one = change([77.49], [124.07])
    assert one.verdict == "one_step" and "one step: no noise estimate" in one.text()
    assert change([10, 11, 9], [10.2, 11.1, 9.1]).verdict == "same"
    assert change([10, 10, 10], [10.2, 10.2, 10.2], floor=0.5).verdict == "same"  # below the floor


def test_hiccups_are_the_steps_far_above_the_others() -> None:
    assert hiccups([20, 21, 20, 120, 20, 21, 20, 19, 20, 21]) == [3]
    assert hiccups([20, 21, 20, 22, 20]) == []
    assert hiccups([20, 120, 120, 20]) == []  # half the steps: the series, not a hiccup


def test_one_step_on_each_side_names_no_cause_and_says_why(tmp_path: Path) -> None:
    """A real pair with one step each (HTA's sampled ranks 0 and 1, steps 551-552 cut to one): the change is said
    with its direction, never 'within noise'."""
    import shutil

    for side, name in (("b", "hta_trace_compare_base.json.gz"), ("n", "hta_trace_compare_test.json.gz")):
        (tmp_path / side).mkdir()
        shutil.copy(REAL / name, tmp_path / side / name)
    now, base = build_reports([[tmp_path / "n"], [tmp_path / "b"]], workers=1)
    c = compare_groups(base["captures"][0], now["captures"][0])
    steps = {len(r["step_ms_by_step"]["now"]) for r in c["ranks"]} | {len(r["step_ms_by_step"]["baseline"]) for r
                                                                     in c["ranks"]}
    if steps == {1}:
        assert c["verdict"] == "one_step" and "no noise estimate" in c["cause"] and "within noise" not in c["cause"]
    else:
        assert "within noise" not in c["cause"] or c["step_ms"]["test"]["lo"] is not None


def test_a_capture_against_itself_is_no_change_and_says_how_its_clocks_were_aligned(tmp_path: Path) -> None:
    """The 8-rank NCCL capture against a copy of itself (traces name no host: each rank's clock aligned alone):
    no change, and the alignment said in a note on both sides."""
    import shutil

    shutil.copytree(REAL / "param_dlrm_kineto_8rank", tmp_path / "again")
    now, base = build_reports([[tmp_path / "again"], [REAL / "param_dlrm_kineto_8rank"]], workers=1)
    c = compare_groups(base["captures"][0], now["captures"][0])
    assert c["verdict"] == "one_step" and c["culprits"] == [], c["cause"]
    assert any("8 clocks (the traces name no host" in n for n in c["notes"]), c["notes"]
    assert c["collectives"]["now"]["matched"] == c["collectives"]["baseline"]["matched"] == 8


def test_what_the_answers_add_to_a_summary_is_bounded() -> None:
    """Issue 43's cost bound: 20 steps of 200 collectives (and 300 operators, 300 kernels on a GPU) add at most
    64 KiB to a rank's summary (synthetic traces: bench/bench_summary_size.py)."""
    import sys

    sys.path.insert(0, str(HERE.parent / "bench"))
    from bench_summary_size import sizes, synthetic_trace

    for gpu in (False, True):
        full, without, _ = sizes(synthetic_trace(20, 200, gpu))
        assert full - without <= 64 * 1024, (gpu, full - without)


def test_the_comparison_as_text_and_html_says_the_tests_and_the_waits() -> None:
    """What the engineer reads: the step time's interval, the starred significant changes, who made whom wait on
    both sides, the replay; in the terminal and in the HTML page."""
    from ondemand_prof.report.html import render_comparison_html
    from ondemand_prof.report.text import render_comparison

    c = compared("straggler")
    text = render_comparison(c)
    assert "95 % CI" in text.splitlines()[1] and "(significant)" in text.splitlines()[1]
    assert "who made whom wait, inside each capture" in text and "what-if replay (error" in text
    assert "*" in text  # the significant changes are starred
    page = render_comparison_html(c)
    assert "Who made whom wait, inside each capture" in page and "95 % CI" in page and "Share of the growth" in page
