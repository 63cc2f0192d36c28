"""Fitting the training stacks people run: identity settling when torch.distributed comes up after the
profiler, the start-up line, zero-code activation, and the examples (plain, torchrun DDP, Lightning, Hugging
Face Trainer, Megatron-style, zero-code), each run for real against a live daemon and the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ROOT, base_env, captures, ctl, ctl_json, free_port, live_ranks, short_dir, start_daemon, \
    trace_steps, wait_for

SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, Any]]:
    run_dir, state_dir = short_dir("odp"), short_dir("odps")
    procs: list[subprocess.Popen] = []
    daemons: list[subprocess.Popen] = []
    yield {"run": run_dir, "state": state_dir, "save": tmp_path / "profile", "tmp": tmp_path, "procs": procs,
           "daemons": daemons}
    for p in procs:
        if p.poll() is None:  # each in a session of its own (examples start children: torchrun, Lightning)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for p in daemons:
        p.kill()
        p.wait()
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(state_dir, ignore_errors=True)


def daemon(env: dict[str, Any]) -> subprocess.Popen:
    proc = start_daemon(env["run"], env["state"])
    env["daemons"].append(proc)
    return proc


def spawn(env: dict[str, Any], argv: list[str], **extra: str) -> subprocess.Popen:
    """A process in its own session (so the fixture can end it and its children), talking to the test daemon."""
    penv = base_env(ONDEMAND_PROF_RUNTIME_DIR=str(env["run"]), **extra)
    proc = subprocess.Popen(argv, env=penv, cwd=env["tmp"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    env["procs"].append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{err[-4000:]}"
    return out, err


def wait_registered(env: dict[str, Any], world: int, timeout: float = 90) -> tuple[str, list[dict[str, Any]]]:
    """Until `world` ranks of one job, ranks 0..world-1, each reporting world size `world`, are registered."""

    def settled() -> Any:
        ranks = live_ranks(env["run"])
        jobs = {r["job"] for r in ranks}
        if len(jobs) == 1 and sorted(r["rank"] for r in ranks) == list(range(world)) and \
                all(r["world_size"] == world and r["step_time_s"] for r in ranks):
            return jobs.pop(), ranks
        return None

    return wait_for(settled, timeout, f"{world} rank(s) of one job registered and stepping")


def capture_rank(env: dict[str, Any], job: str, rank: int, steps: int = 2) -> dict[str, Any]:
    """`ondemandctl capture --ranks R` and the one rank directory it wrote."""
    res = ctl(env["run"], "capture", "--job", job, "--ranks", str(rank), "--steps", str(steps), "--wait", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    done = json.loads(res.stdout)
    cid = done["capture_id"]
    caps = [c for c in captures(env["save"]) if c["capture_id"] == cid]
    assert [c["rank"] for c in caps] == [rank], caps
    assert len(trace_steps(caps[0])) == steps
    return caps[0]


# ----------------------------------------------------------------------------------------------------------
# Rank and job settle when torch.distributed does


def test_profiler_made_before_the_process_group_settles_into_one_job(env: dict[str, Any]) -> None:
    daemon(env)
    stop = env["tmp"] / "stop"
    port = str(free_port())
    procs = [spawn(env, [sys.executable, str(SCRIPTS / "late_dist.py"), str(r), "2", port, str(stop),
                         "--profile-save-path", str(env["save"]), "--profile-min-free-mb", "0"]) for r in range(2)]
    job, ranks = wait_registered(env, 2)
    assert not job.startswith("pid") or len({r["pid"] for r in ranks}) == 2
    trigger_dirs = {r["trigger_dir"] for r in ranks}
    assert len(trigger_dirs) == 1 and trigger_dirs.pop().endswith(job)
    cap = capture_rank(env, job, 1)
    assert cap["job_id"] == job and cap["world_size"] == 2
    status = ctl(env["run"], "status")
    assert f"job {job}: 2 of 2 rank(s)" in status.stdout and str(env["save"]) in status.stdout
    stop.touch()
    errs = [finish(p)[1] for p in procs]
    for rank, err in enumerate(errs):
        # the start-up line, on stderr without any logging set up, and again once the job settled
        assert f"now rank {rank} of 2, job {job}: capture with 'ondemandctl capture --job {job}" in err, err


# ----------------------------------------------------------------------------------------------------------
# The examples, each run for real against a live daemon: one job with the right ranks registered, the static
# window (from ONDEMAND_PROF_* variables) recorded on every rank, and `ondemandctl capture --ranks <last>`

STATIC = {"ONDEMAND_PROF_ENABLE": "1", "ONDEMAND_PROF_STEP_START": "2", "ONDEMAND_PROF_STEP_END": "4",
          "ONDEMAND_PROF_RANKS": "-1", "ONDEMAND_PROF_MIN_FREE_MB": "0"}
LONG = "100000"  # steps: the example outlives the checks, then the fixture ends it


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port())]


def check_example(env: dict[str, Any], argv: list[str], world: int, static_steps: list[int] | None = None,
                  python: str = sys.executable, **extra: str) -> str:
    """Run an example; return the job it registered under (after checking ranks, static window, capture)."""
    proc = spawn(env, argv if argv[0] != sys.executable else [python, *argv[1:]],
                 ONDEMAND_PROF_SAVE_PATH=str(env["save"]), **STATIC, **extra)
    try:
        job, ranks = wait_registered(env, world, timeout=120)
    except AssertionError:
        proc.kill()
        raise AssertionError(f"example did not register:\n{proc.communicate()[1][-4000:]}") from None
    static = wait_for(lambda: (lambda cs: cs if len(cs) == world else None)(
        [c for c in captures(env["save"]) if c["trigger"]["source"] == "static"]), 60, "the static window")
    assert sorted(c["rank"] for c in static) == list(range(world))
    for cap in static:
        assert trace_steps(cap) == (static_steps or [2, 3]) and cap["job_id"] == job and cap["world_size"] == world
    cap = capture_rank(env, job, world - 1)
    assert cap["job_id"] == job
    return job


def test_example_plain_loop(env: dict[str, Any]) -> None:
    daemon(env)
    job = check_example(env, [sys.executable, str(EXAMPLES / "plain_loop.py"), "--steps", LONG], 1)
    assert job.startswith("pid")


def test_example_ddp_torchrun(env: dict[str, Any]) -> None:
    daemon(env)
    check_example(env, [*torchrun(2), str(EXAMPLES / "ddp_torchrun.py"), "--steps", LONG], 2)


def test_example_megatron_style_resumed(env: dict[str, Any]) -> None:
    """Megatron's own --profile flags drive the static window; a run resumed at iteration 100 numbers its
    steps from there (the ONDEMAND_PROF_* window variables are not set: the flags decide)."""
    daemon(env)
    argv = [sys.executable, str(EXAMPLES / "megatron_style.py"), "--train-iters", LONG, "--resume-iteration", "100",
            "--profile", "--profile-step-start", "103", "--profile-step-end", "105", "--profile-ranks", "0"]
    proc = spawn(env, argv, ONDEMAND_PROF_SAVE_PATH=str(env["save"]), ONDEMAND_PROF_MIN_FREE_MB="0")
    job, _ = wait_registered(env, 1)
    static = wait_for(lambda: [c for c in captures(env["save"]) if c["trigger"]["source"] == "static"], 60,
                      "the static window")
    assert trace_steps(static[0]) == [103, 104]
    cap = capture_rank(env, job, 0)
    assert min(trace_steps(cap)) > 104
    assert proc.poll() is None


def test_example_lightning_ddp(env: dict[str, Any]) -> None:
    pytest.importorskip("lightning")
    daemon(env)
    check_example(env, [sys.executable, str(EXAMPLES / "lightning_ddp.py"), "--steps", LONG], 2)


def test_example_hf_trainer_under_torchrun(env: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    daemon(env)
    check_example(env, [*torchrun(2), str(EXAMPLES / "hf_trainer.py"), "--steps", LONG], 2)
