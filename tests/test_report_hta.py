"""Our published traces in HTA (HolisticTraceAnalysis, the `test` extra): two real gloo ranks through our own
export, their capture folder read by HTA's TraceAnalysis, which finds each file's rank with a regex on the raw
text, and by TensorBoard's profiler plugin, whose step breakdown our CPU-only split is checked against."""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

import pytest

from conftest import assert_ok, captures, run_ranks
from ondemand_prof.report import build_report

REAL = Path(__file__).resolve().parent / "fixtures" / "real"


@pytest.fixture(scope="module")
def two_rank_capture(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One static window (steps 3 and 4) on two real gloo ranks; both tools read the same capture."""
    save = tmp_path_factory.mktemp("hta") / "profile"
    assert_ok(run_ranks(["--steps", "8", "--profile", "--profile-step-start", "3", "--profile-step-end", "5",
                         "--profile-ranks", "-1", "--profile-save-path", str(save), "--profile-min-free-mb", "0"],
                        world=2))
    return captures(save)


def test_hta_sees_each_rank_of_our_traces(two_rank_capture: list[dict]) -> None:
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis is in the test extra")
    caps = two_rank_capture
    (folder,) = {cap["folder"] for cap in caps}  # one capture folder: the ranks' traces side by side
    for cap in caps:
        trace = (cap["dir"] / cap["trace_file"]).resolve()
        text = (gzip.decompress(trace.read_bytes()) if trace.name.endswith(".gz") else trace.read_bytes()).decode()
        assert re.search(r'"rank":\s+(\d+)', text).group(1) == str(cap["rank"])  # HTA's own regex
        data = json.loads(text)
        assert data["distributedInfo"]["backend"] == "gloo"  # the job's collectives are gloo:*
        assert (folder / data["traceName"]).resolve() == trace  # not the deleted staging file
    logging.getLogger("hta").setLevel(logging.ERROR)
    analysis = hta.TraceAnalysis(trace_dir=str(folder))
    assert sorted(analysis.t.traces) == [0, 1]


def test_tensorboard_profiler_plugin_shows_one_run_with_a_worker_per_rank(two_rank_capture: list[dict],
                                                                         tmp_path: Path) -> None:
    """TensorBoard's profiler plugin (torch-tb-profiler, the `test` extra) loads our capture folder as one run:
    its own RunLoader, as the plugin runs it for a run directory, finds a worker per rank with the window's steps
    in its overview."""
    loader = pytest.importorskip("torch_tb_profiler.profiler.loader", reason="torch-tb-profiler is in the test extra")
    from torch_tb_profiler import io as tb_io

    caps = two_rank_capture
    (folder,) = {cap["folder"] for cap in caps}
    logging.getLogger("torch.profiler").setLevel(logging.ERROR)
    run = loader.RunLoader(folder.name, str(folder), tb_io.Cache(str(tmp_path / "tb-cache"))).load()
    workers = {Path(cap["trace_file"]).name.split(".pt.trace.json")[0]: cap["rank"] for cap in caps}
    # one worker per rank, plus "All": the Distributed view, built when every rank's gloo collectives match up
    assert run.workers == sorted(["All", *workers]), run.workers
    assert run.get_workers("Distributed") == ["All"], [v.display_name for v in run.views]
    for worker in workers:
        (profile,) = run.get_profiles(worker=worker)
        steps = [row[0] for row in profile.overview["steps"]["rows"]]
        assert steps == ["3", "4"], (worker, steps)
        assert "Overview" in [v.display_name for v in profile.views]


def tensorboard_steps(folder: Path, cache: Path) -> dict[str, dict[int, dict[str, float]]]:
    """worker -> step -> {Communication, CPU Exec, Other, ...} microseconds, from the plugin's own overview."""
    from torch_tb_profiler import io as tb_io
    from torch_tb_profiler.profiler import loader

    logging.getLogger("torch.profiler").setLevel(logging.ERROR)
    run = loader.RunLoader(folder.name, str(folder), tb_io.Cache(str(cache))).load()
    out: dict[str, dict[int, dict[str, float]]] = {}
    for worker in run.workers:
        if worker == "All":
            continue
        (profile,) = run.get_profiles(worker=worker)
        table = profile.overview["steps"]
        names = [c.get("name") if c.get("role") != "tooltip" else None for c in table["columns"]]
        out[worker] = {int(row[0]): {n: float(v) for n, v in zip(names[1:], row[1:]) if n}
                       for row in table["rows"]}
    return out


def c10d_outside_gloo_us(events: list[dict], step: dict) -> float:
    """Time in the step where a c10d::* operator (or record_param_comms) runs and no gloo:* range does, on any
    thread: what we count as communication and the plugin counts as CPU Exec."""
    lo, hi = float(step["ts"]), float(step["ts"]) + float(step["dur"])
    spans = [(max(lo, float(e["ts"])), min(hi, float(e["ts"]) + float(e["dur"])), str(e["name"])) for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith(("c10d::", "record_param_comms", "gloo:"))]
    cuts = sorted({lo, hi, *(x for a, b, _ in spans if b > a for x in (a, b))})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        open_names = [n for x, y, n in spans if x <= mid < y]
        if open_names and not any(n.startswith("gloo:") for n in open_names):
            total += b - a
    return total


def test_cpu_split_against_tensorboards_profiler_plugin(two_rank_capture: list[dict], tmp_path: Path) -> None:
    """The same 2-rank gloo capture in the plugin and in our report. The plugin's Communication is the time some
    gloo:* range runs on any thread of the step: our gloo figure, to the microsecond. Our communication (exposed +
    overlap) adds the time the training thread spends in c10d::allreduce_ before gloo's worker starts, which the
    plugin files under CPU Exec: exactly that difference, step by step (README, "Reports")."""
    pytest.importorskip("torch_tb_profiler.profiler.loader", reason="torch-tb-profiler is in the test extra")
    caps = two_rank_capture
    (folder,) = {cap["folder"] for cap in caps}
    tb = tensorboard_steps(folder, tmp_path / "tb-cache")
    (group,) = build_report([folder], workers=1)["captures"]
    for cap in caps:
        worker = Path(cap["trace_file"]).name.split(".pt.trace.json")[0]
        (ours,) = [r for r in group["ranks"] if r["rank"] == cap["rank"]]
        events = json.loads((folder / Path(cap["trace_file"]).name).read_text())["traceEvents"]
        steps = {int(e["name"].split("#")[1]): e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
        gloo = {lib["library"]: lib["ms"] for lib in ours["comm_libraries"]}["gloo"]
        assert gloo * 1000 == pytest.approx(sum(s["Communication"] for s in tb[worker].values()), abs=2.0)
        for row in ours["steps"]:
            theirs = tb[worker][row["step"]]
            extra = c10d_outside_gloo_us(events, steps[row["step"]])
            assert row["comm_total_ms"] * 1000 - theirs["Communication"] == pytest.approx(extra, abs=1.0), (row, theirs)
            assert row["dur_ms"] * 1000 == pytest.approx(sum(theirs.values()), abs=1.0)  # the same step
        tb_pct = 100 * sum(s["Communication"] for s in tb[worker].values()) / sum(
            sum(s.values()) for s in tb[worker].values())
        logging.getLogger(__name__).info("rank %s: communication %.1f %% (ours, exposed + overlap) vs %.1f %% "
                                         "(TensorBoard)", cap["rank"], ours["comm_pct"] + ours["overlap_pct"], tb_pct)


@pytest.mark.quick
def test_hta_runs_its_critical_path_analysis(tmp_path: Path) -> None:
    """HTA 0.5's critical path analysis on a real ROCm trace: under pandas 3 it raises ValueError ("Cannot specify
    both 'axis' and 'index'/'columns'"), which is why the test extra pins pandas<3."""
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis is in the test extra")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "rank0.json.gz").write_bytes((REAL / "hta_mi250_rocm6_2.json.gz").read_bytes())
    logging.getLogger("hta").setLevel(logging.ERROR)
    analysis = hta.TraceAnalysis(trace_dir=str(tmp_path / "t"))
    (rank,) = analysis.t.traces
    graph, ok = analysis.critical_path_analysis(rank=rank, annotation="ProfilerStep", instance_id=None)
    assert ok and graph.number_of_nodes() > 100


def test_hta_keeps_every_captured_step_only_when_asked(two_rank_capture: list[dict]) -> None:
    """What the capture summary, the HTML report and the docs tell HTA users: by default HTA leaves out a trace's
    last ProfilerStep, so our 2-step capture is one step there; include_last_profiler_step=True keeps both."""
    hta = pytest.importorskip("hta.trace_analysis", reason="HolisticTraceAnalysis is in the test extra")
    logging.getLogger("hta").setLevel(logging.ERROR)
    (folder,) = {cap["folder"] for cap in two_rank_capture}

    def steps(**kw: bool) -> list[str]:
        t = hta.TraceAnalysis(trace_dir=str(folder), **kw).t
        names = t.symbol_table.sym_table
        return sorted({names[i] for i in t.traces[0]["name"].unique() if names[i].startswith("ProfilerStep#")})

    assert steps() == ["ProfilerStep#3"]
    assert steps(include_last_profiler_step=True) == ["ProfilerStep#3", "ProfilerStep#4"]
