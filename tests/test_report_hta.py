"""Our published traces in HTA (HolisticTraceAnalysis, the `test` extra): two real gloo ranks through our own
export, their capture folder read by HTA's TraceAnalysis, which finds each file's rank with a regex on the raw
text, and by TensorBoard's profiler plugin."""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

import pytest

from conftest import assert_ok, captures, run_ranks


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
