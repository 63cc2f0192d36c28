"""What `report` does with what users bring: folders of folders, several jobs at once, torch_npu output beside
Kineto traces, files that are not profiles. Real files from public repositories (tests/fixtures/real/README.md)
laid out as users keep them, the real CLI as a subprocess; the grouping and "slowest" rules also alone."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import base_env, ctl
from ondemand_prof.report import build_report
from ondemand_prof.report.grouping import SLOW_MIN_PCT, group_ranks, slowest_rank

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)

REAL = Path(__file__).resolve().parent / "fixtures" / "real"
NCCL_RANKS = ("hta_sampled_rank-0.json.gz", "hta_sampled_rank-1.json.gz")  # 2 ranks of a 128-rank NCCL job


def runs_folder(root: Path) -> Path:
    """runs/: a job's two NCCL ranks one level down, another job's rank 0 two levels down, a 2-rank torch_npu
    capture (MindStudio Insight's test data) beside them, and what else sits in such folders."""
    runs = root / "runs"
    (runs / "dlrm").mkdir(parents=True)
    for name in NCCL_RANKS:
        shutil.copy(REAL / name, runs / "dlrm" / name)
    (runs / "resnet" / "2021-06").mkdir(parents=True)
    shutil.copy(REAL / "kineto_resnet50_2021-06.pt.trace.json.gz", runs / "resnet" / "2021-06" / "worker0.pt.trace.json.gz")
    shutil.copytree(REAL / "msinsight_server", runs / "npu")
    (runs / "dlrm" / "config.json").write_text(json.dumps({"lr": 0.1, "layers": [512, 256]}))
    (runs / "dlrm" / "train.log").write_text("step 1\n")
    (runs / "node3_4242_20250101000000000_ascend_pt").mkdir()  # torch_npu ran with analyse_flag=False
    (runs / "node3_4242_20250101000000000_ascend_pt" / "FRAMEWORK").mkdir()
    (runs / "memscope.db").write_bytes(gzip.decompress((REAL / "msinsight_memscope_dump.db.gz").read_bytes()))
    return runs


def test_a_folder_of_folders_is_searched_and_every_candidate_listed(tmp_path: Path) -> None:
    runs = runs_folder(tmp_path)
    res = ctl(tmp_path, "report", str(runs), "--summary")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "sources: 5 found, 3 skipped" in out
    assert f"skipped  {runs}/dlrm/config.json: JSON without a \"traceEvents\" array" in out
    assert f"skipped  {runs}/memscope.db: a SQLite database of another kind (tables: memory_allocation" in out
    assert f"skipped  {runs}/node3_4242_20250101000000000_ascend_pt: torch_npu output without " \
           "ASCEND_PROFILER_OUTPUT: not analysed yet" in out
    assert "(1 other file(s), no profile format: .log 1)" in out
    data = json.loads(ctl(tmp_path, "report", str(runs), "--json").stdout)
    found = {Path(e["path"]).relative_to(runs).as_posix(): e for e in data["sources"] if e["status"] == "found"}
    assert sorted(found) == ["dlrm/hta_sampled_rank-0.json.gz", "dlrm/hta_sampled_rank-1.json.gz", "npu/test_rank_0",
                             "npu/test_rank_1", "resnet/2021-06/worker0.pt.trace.json.gz"]
    # three captures: the NCCL job's two ranks, the torch_npu pair, the ResNet rank alone; never mixed
    groups = {tuple(sorted(Path(r["path"]).name for r in g["ranks"])): g for g in data["captures"]}
    assert set(groups) == {NCCL_RANKS, ("test_rank_0", "test_rank_1"), ("worker0.pt.trace.json.gz",)}
    assert "world size 128" in groups[NCCL_RANKS]["grouped_by"] and "steps 551..552" in groups[NCCL_RANKS]["grouped_by"]
    for g, number in zip(data["captures"], range(1, 4)):  # each listed source names the capture it went to
        for r in g["ranks"]:
            assert found[Path(r["path"]).relative_to(runs).as_posix()]["capture"] == number


def test_two_jobs_are_never_one_capture(tmp_path: Path) -> None:
    """`report DIR_A DIR_B` on two jobs: two captures, each rank once, and no "slowest" between jobs."""
    job_a, job_b = tmp_path / "job_a", tmp_path / "job_b"
    for job in (job_a, job_b):
        job.mkdir()
    for name in NCCL_RANKS:
        shutil.copy(REAL / name, job_a / name)
    shutil.copy(REAL / NCCL_RANKS[0], job_b / "rank0.json.gz")  # another job's rank 0
    shutil.copy(REAL / "hta_mi250_rocm6_2.json.gz", job_b / "mi250.json.gz")
    data = json.loads(ctl(tmp_path, "report", str(job_a), str(job_b), "--json").stdout)
    ranks = {(tuple(r["rank"] for r in g["ranks"]), Path(g["ranks"][0]["path"]).parent.name) for g in data["captures"]}
    assert ranks == {((0, 1), "job_a"), ((0,), "job_b"), ((None,), "job_b")} and len(data["captures"]) == 3
    assert not any((g.get("slowest") or {}).get("stands_out") for g in data["captures"])


RECORD_CYCLES = r"""
import sys, torch
from torch.profiler import profile, ProfilerActivity, schedule, tensorboard_trace_handler
model = torch.nn.Linear(32, 32)
with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2, repeat=2),
             on_trace_ready=tensorboard_trace_handler(sys.argv[1], worker_name="worker0")) as prof:
    for _ in range(8):
        model(torch.randn(16, 32)).sum().backward()
        prof.step()
"""


def test_repeated_cycles_in_one_log_dir_are_separate_captures(tmp_path: Path) -> None:
    """tensorboard_trace_handler writes every cycle of a schedule (repeat=2) into one folder, as
    worker0.<time>.pt.trace.json: the same worker twice, different steps, two captures."""
    logdir = tmp_path / "tb"
    subprocess.run([sys.executable, "-c", RECORD_CYCLES, str(logdir)], check=True, env=base_env(), timeout=300)
    traces = sorted(logdir.glob("worker0.*.pt.trace.json"))
    assert len(traces) == 2
    data = build_report([tmp_path], workers=1)
    steps = sorted([s["step"] for s in g["ranks"][0]["steps"]] for g in data["captures"])
    assert [len(g["ranks"]) for g in data["captures"]] == [1, 1] and steps == [[2, 3], [6, 7]]


def test_nothing_found_below_a_folder_says_so_once(tmp_path: Path) -> None:
    empty = tmp_path / "empty" / "deeper"
    empty.mkdir(parents=True)
    (empty / "notes.txt").write_text("x")
    res = ctl(tmp_path, "report", str(tmp_path / "empty"))
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr
    assert f"cannot report on {tmp_path / 'empty'}: no captures here (searched below" in res.stdout


# ----------------------------------------------------------------------------------------------------------
# The rules alone

def member(rank: Any, steps: list[int], start: float = 1.7e15, folder: str = "/runs/a", **kw: Any) -> dict[str, Any]:
    return {"rank": rank, "kind": "trace", "folder": folder, "path": f"{folder}/r{rank}-{start}.json",
            "steps": [{"step": s, "start_us": start + 1000 * k, "dur_ms": 1.0} for k, s in enumerate(steps)], **kw}


def test_grouping_rules() -> None:
    def shape(members: list[dict[str, Any]]) -> list[list[Any]]:
        return sorted(sorted(m["rank"] for m in ms) for _, _, ms in group_ranks(members))

    # one folder, same steps, ranks 0..3: one capture
    assert shape([member(r, [5, 6]) for r in range(4)]) == [[0, 1, 2, 3]]
    # rank 0 twice (two cycles written to one folder): two captures
    assert shape([member(0, [5, 6]), member(1, [5, 6]), member(0, [9, 10]), member(1, [9, 10])]) == [[0, 1], [0, 1]]
    # the same steps recorded two hours apart: two runs
    assert shape([member(0, [5], start=1.7e15), member(1, [5], start=1.7e15 + 7.2e9)]) == [[0], [1]]
    # another folder, another world size: never together
    assert shape([member(0, [5]), member(1, [5], folder="/runs/b")]) == [[0], [1]]
    assert shape([member(0, [5], world_size=8), member(1, [5], world_size=16)]) == [[0], [1]]
    # our captures: one per (job, capture id), across folders; another job with the same id stays apart
    ours = [member(0, [5], folder="/h1", capture_id="c1", job_id="j1"), member(1, [5], folder="/h2", capture_id="c1",
            job_id="j1"), member(0, [5], folder="/h1", capture_id="c1", job_id="j2")]
    assert sorted((key, sorted(m["rank"] for m in ms)) for key, _, ms in group_ranks(ours)) == [
        (("j1", "c1"), [0, 1]), (("j2", "c1"), [0])]
    # a trace naming no rank is alone
    assert shape([member(None, [5]), member(None, [5])]) == [[None], [None]]


@pytest.mark.parametrize("steps, marked", [
    ([10.0, 11.82], False),                                  # two ranks: no spread to judge (the case)
    ([10.0, 10.1, 9.9, 10.05, 10.0, 9.95, 10.02, 12.0], True),  # one rank 20 % above seven within 1 %
    ([10.0, 8.5, 11.5, 9.0, 11.0, 8.8, 11.2, 12.0], False),     # 12.0 is within the others' spread
    ([10.0, 10.0, 10.0, 10.3], False),                         # 3 % above identical ranks: under 5 %
])
def test_slowest_is_marked_only_when_it_stands_out(steps: list[float], marked: bool) -> None:
    s = slowest_rank(list(enumerate(steps)))
    assert s is not None and s["rank"] == steps.index(max(steps))
    assert s["stands_out"] is marked, s
    assert marked or s["why_not"]
    assert f"{SLOW_MIN_PCT:g} %" in s["rule"]
