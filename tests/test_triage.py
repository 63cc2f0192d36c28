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


def test_a_rank_holding_the_gil_gets_a_native_dump_said_as_such(env: dict[str, Any]) -> None:
    daemon(env)
    status = env["tmp"] / "steps.jsonl"
    ranks(env, 1, "--no-dist", "--steps", "200", "--step-sleep", "0.01", "--stall-rank", "0", "--stall-at-step", "5",
          "--stall-s", "30", "--stall-holding-gil", "--status-file", str(status))
    stalled(env, status, 1)  # the rank's heartbeats stop now: ask before the daemon gives up on it (3.5 s)
    res = ctl(env["run"], "stacks", "--timeout", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "0 answered in-process (Python), 1 by native dump (faulthandler)" in out, out
    assert "NATIVE DUMP" in out and "holds the GIL" in out, out
    assert "in _stall" in out, out  # faulthandler's own format: "File ..., line N in _stall"


def test_trigger_file_stacks_write_a_status_file(tmp_path: Path) -> None:
    trig = tmp_path / "trig"
    status = tmp_path / "steps.jsonl"
    procs = start_ranks(["--steps", "400", "--step-sleep", "0.02", "--profile-trigger-dir", str(trig),
                         "--profile-save-path", str(tmp_path / "p"), "--status-file", str(status), *TRAIN])
    try:
        wait_for(lambda: len(status_lines(status)) > 3, 60, "steps")
        (trig / "capture").write_text('{"action": "stacks"}')
        out = wait_for(lambda: (trig / "capture.status" / "stacks-rank0.txt").exists() and
                       (trig / "capture.status" / "stacks-rank0.txt").read_text(), 30, "the stacks file")
        assert "collected in-process (python)" in out and 'Thread "MainThread" (main)' in out, out
        assert "toy_train.py" in out
        st = wait_for(lambda: (lambda s: s if s.get("latest", {}).get("state") == "done" else None)(
            json.loads((trig / "capture.status" / "rank0.json").read_text())), 30, "the status")
        assert st["latest"]["request"] == {"action": "stacks", "start": 1}
        (trig / "capture").write_text('{"action": "dance"}')
        st = wait_for(lambda: (lambda s: s if s.get("latest", {}).get("state") == "rejected" else None)(
            json.loads((trig / "capture.status" / "rank0.json").read_text())), 30, "the rejection")
        assert "field 'action' must be one of" in st["latest"]["error"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_memory_and_flight_recorder_on_cpu_say_so(env: dict[str, Any]) -> None:
    daemon(env)
    procs = ranks(env, 2, "--steps", "3000", "--step-sleep", "0.01")
    wait_for(lambda: (lambda rs: len(rs) == 2 and all(r["step"] > 3 for r in rs))(live_ranks(env["run"])), 60,
             "2 ranks stepping")
    res = ctl(env["run"], "memory", "--ranks", "0", "--steps", "2")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "rank(s) 0: not available on this backend (CPU)" in res.stdout, res.stdout
    res = ctl(env["run"], "memory", "--ranks", "-1", "--json")
    assert res.returncode == 1, res.stderr
    data = json.loads(res.stdout)
    assert [r["unavailable"] for r in data["ranks"].values()] == [True, True]
    assert not list(env["save"].glob("memory-*/*.pickle"))
    # gloo on this torch keeps a flight recorder: a real dump per rank, and both ranks entered the same collectives
    res = ctl(env["run"], "flight-recorder")
    assert res.returncode == 0, res.stdout + res.stderr
    files = sorted(env["save"].glob("flight-recorder-*/*.fr_trace.pickle"))
    assert len(files) == 2 and all(f.name.endswith(f"_rank{i}.fr_trace.pickle") for i, f in enumerate(files)), files
    dump = pickle.loads(files[0].read_bytes())
    assert any(e["profiling_name"] == "gloo:all_reduce" for e in dump["entries"])
    assert "process group 0 (default_pg), rank(s) 0-1" in res.stdout, res.stdout
    for p in procs:
        p.kill()


def test_flight_recorder_without_a_process_group_says_how(env: dict[str, Any]) -> None:
    daemon(env)
    ranks(env, 1, "--no-dist", "--steps", "3000", "--step-sleep", "0.01")
    wait_for(lambda: len(live_ranks(env["run"])) == 1, 60, "1 rank")
    res = ctl(env["run"], "flight-recorder")
    assert res.returncode == 1 and "no process group in this rank" in res.stdout, res.stdout + res.stderr
