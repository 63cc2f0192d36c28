"""Triage on demand: stacks of every rank (one blocked in a collective, one holding the GIL), memory and
flight-recorder replies, automatic captures, stragglers in status. Real gloo ranks, a real daemon, the real CLI;
the CUDA snapshot and the flight-recorder dump of other backends are synthetic fixtures, named so."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import captures, ctl, ctl_json, live_ranks, run_ranks, short_dir, start_daemon, start_ranks, wait_for

TRAIN = ["--profile-min-free-mb", "0", "--profile-ranks", "-1"]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, Any]]:
    run_dir, state_dir = short_dir("odp"), short_dir("odps")
    procs: list[subprocess.Popen] = []
    yield {"run": run_dir, "state": state_dir, "save": tmp_path / "profile", "procs": procs, "tmp": tmp_path}
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(state_dir, ignore_errors=True)


def daemon(env: dict[str, Any]) -> None:
    env["procs"].append(start_daemon(env["run"], env["state"]))


def ranks(env: dict[str, Any], world: int, *extra: str, job: str = "tri") -> list[subprocess.Popen]:
    procs = start_ranks(["--profile-save-path", str(env["save"]), "--profile-job-id", job, *TRAIN, *extra],
                        world=world, env={"ONDEMAND_PROF_RUNTIME_DIR": str(env["run"])})
    env["procs"].extend(procs)
    return procs


def status_lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def stalled(env: dict[str, Any], status: Path, n: int) -> None:
    """Until the stalling rank said it stalls and n ranks are registered."""
    wait_for(lambda: any("stall" in x for x in status_lines(status)) and len(live_ranks(env["run"])) == n, 90,
             "the stall to begin")


def test_stacks_show_the_rank_blocked_in_the_collective(env: dict[str, Any]) -> None:
    daemon(env)
    status = env["tmp"] / "steps.jsonl"
    procs = ranks(env, 2, "--steps", "40", "--step-sleep", "0.01", "--stall-rank", "0", "--stall-at-step", "5",
                  "--stall-s", "25", "--status-file", str(status))
    stalled(env, status, 2)
    time.sleep(0.5)  # rank 1 reaches its all_reduce
    res = ctl(env["run"], "stacks", "--ranks", "-1")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "2 answered in-process (Python), 0 by native dump" in out, out
    assert "=== thread MainThread (main): 2 different stacks" in out, out
    # rank 1's main thread waits in the all_reduce; rank 0's sleeps in the stall; each stack is labelled
    blocks = out.split("--- rank(s) ")
    rank1 = next(b for b in blocks if b.startswith("1 (1)"))
    rank0 = next(b for b in blocks if b.startswith("0 (1)"))
    assert "all_reduce" in rank1 and "in main" in rank1, out
    assert "in _stall" in rank0 and "all_reduce" not in rank0, out
    data = ctl_json(env["run"], "stacks", "--ranks", "1")
    assert data["answered_python"] == [1] and data["ranks"]["1"]["method"] == "python"
    for p in procs:
        p.kill()
