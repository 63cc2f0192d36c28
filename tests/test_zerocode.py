"""Zero-code (ONDEMAND_PROF_AUTO=1, no edit to the script) where torch is asked about before it is imported
(Hugging Face's datasets, evaluate and transformers call importlib.util.find_spec("torch") at import, without
importing it) or is imported past zero-code's import hook: real processes, a real 2-rank gloo job under torchrun,
the real daemon and CLI (issue 44 item 3). The other zero-code tests are in test_integrations.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import base_env, captures, ctl, daemon, free_port, kill_tree, live_ranks, trace_steps, wait_for

SCRIPTS = Path(__file__).resolve().parent / "scripts"
LONG = "100000"  # steps: the job outlives the checks, then the test ends its whole process tree
LATE = "ONDEMAND_PROF_AUTO is set but torch was imported past its import hook"


def start_job(env: dict[str, Any], script: str, *args: str, torchrun: bool = True, **extra: str
              ) -> tuple[subprocess.Popen, Path]:
    """`torchrun --nproc-per-node 2 SCRIPT ARGS` (or `python SCRIPT ARGS`, a script that starts its ranks
    itself) with ONDEMAND_PROF_AUTO=1, talking to the test's daemon, in a session of its own (at nice 10: it
    trains flat out); its stdout and stderr go to a file (a pipe nobody reads while the job runs would fill and
    stop it). Ended by the test (kill_tree: torch elastic starts its workers in sessions of their own), or by the
    env fixture if the test fails first."""
    log = env["tmp"] / f"{Path(script).stem}.log"
    penv = base_env(ONDEMAND_PROF_AUTO="1", ONDEMAND_PROF_RUNTIME_DIR=str(env["run"]),
                    ONDEMAND_PROF_SAVE_PATH=str(env["save"]), ONDEMAND_PROF_MIN_FREE_MB="0", **extra)
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    argv = ["nice", "-n", "10", sys.executable, *(launcher if torchrun else []), str(SCRIPTS / script), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=penv, cwd=env["tmp"], stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    env["procs"].append(proc)
    return proc, log


def end(env: dict[str, Any], proc: subprocess.Popen, log: Path) -> str:
    """End the job and everything under it (the agent and both workers); what it printed."""
    kill_tree(proc)
    env["procs"].remove(proc)
    return log.read_text(errors="replace")


def registered(env: dict[str, Any], proc: subprocess.Popen, log: Path, timeout: float = 300) -> str:
    """Until `ondemandctl status` lists ranks 0 and 1 of one job of world size 2, both stepping; the job."""

    def settled() -> Any:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended ({proc.returncode}) before it registered:\n{log.read_text()[-6000:]}")
        ranks = live_ranks(env["run"])
        jobs = {r["job"] for r in ranks}
        if len(jobs) == 1 and sorted(r["rank"] for r in ranks) == [0, 1] and \
                all(r["world_size"] == 2 and r["step_time_s"] for r in ranks):
            return jobs.pop()
        return None

    try:
        return wait_for(settled, timeout, "ranks 0 and 1 of one job registered and stepping", pause=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the job printed:\n{log.read_text(errors='replace')[-6000:]}") from None


def start_up_line(rank: int, job: str) -> str:
    return f"ondemand_prof: rank {rank} of 2, job {job}: capture with "


def test_zero_code_attaches_to_an_unmodified_hugging_face_script_under_torchrun(env: dict[str, Any]) -> None:
    """A run_clm-shaped script (datasets and evaluate imported before torch, then transformers' Trainer on a
    datasets.Dataset), ONDEMAND_PROF_AUTO=1, two gloo ranks under torchrun: both ranks print their start-up line,
    `status` lists them as one job, and `capture` writes rank 1's trace. Before, datasets' probe of torch took
    zero-code's finder out of sys.meta_path: no line, 'no ranks registered' (issue 44 item 3)."""
    for module in ("transformers", "accelerate", "datasets", "evaluate"):
        pytest.importorskip(module)
    daemon(env)
    proc, log = start_job(env, "zerocode_hf_clm.py", "--steps", LONG)
    try:
        job = registered(env, proc, log)
        status = ctl(env["run"], "status")
        assert f"job {job}: 2 of 2 rank(s) registered" in status.stdout, status.stdout + status.stderr
        res = ctl(env["run"], "capture", "--job", job, "--ranks", "1", "--steps", "2", "--wait", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        cid = json.loads(res.stdout)["capture_id"]
        [cap] = [c for c in captures(env["save"]) if c["capture_id"] == cid]
        assert cap["rank"] == 1 and cap["job_id"] == job and len(trace_steps(cap)) == 2
    finally:
        printed = end(env, proc, log)
    for rank in (0, 1):
        assert start_up_line(rank, job) in printed, printed[-6000:]
    assert LATE not in printed  # torch came through the finder: nothing to say


@pytest.mark.parametrize("prelude", ["find_spec", "transformers", "datasets"])
def test_zero_code_attaches_when_torch_is_probed_before_it_is_imported(tmp_path: Path, prelude: str) -> None:
    """One process, ONDEMAND_PROF_AUTO=1 and a static window over steps 1-2: whatever asked
    importlib.util.find_spec("torch") first (a bare probe, transformers, datasets), the start-up line comes and
    the window's trace is written. Before, the probe took the finder away and nothing was profiled."""
    if prelude != "find_spec":
        pytest.importorskip(prelude)
    save = tmp_path / "profile"
    res = subprocess.run([sys.executable, str(SCRIPTS / "zerocode_probed.py"), prelude, "6"], cwd=tmp_path,
                         env=base_env(ONDEMAND_PROF_AUTO="1", ONDEMAND_PROF_ENABLE="1", ONDEMAND_PROF_STEP_START="1",
                                      ONDEMAND_PROF_STEP_END="3", ONDEMAND_PROF_SAVE_PATH=str(save),
                                      ONDEMAND_PROF_MIN_FREE_MB="0"),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    assert re.search(r"^ondemand_prof: rank 0 of 1, job pid\d+@\S+: capture with ", res.stderr, re.M), res.stderr
    [cap] = captures(save)
    assert trace_steps(cap) == [1, 2]
    assert LATE not in res.stderr


def test_zero_code_imported_past_its_hook_hooks_in_late_and_says_so(env: dict[str, Any]) -> None:
    """examples/zero_code.py behind an import hook of its own that finds torch ahead of zero-code's finder, two
    gloo ranks under torchrun: each rank says, in one line, that torch came past the hook and that it hooked in
    late; then its start-up line, and `status` lists both ranks stepping. Before: nothing at all."""
    daemon(env)
    proc, log = start_job(env, "zerocode_past_hook.py", "--steps", LONG)
    try:
        job = registered(env, proc, log)
    finally:
        printed = end(env, proc, log)
    ours = [line for line in printed.splitlines() if "ondemand_prof: " in line]
    for rank in (0, 1):
        late = [line for line in ours if f"ondemand_prof: rank {rank}: {LATE}" in line]
        assert len(late) == 1 and "hooked in late, at the import of " in late[0], ours
        assert start_up_line(rank, job) in printed, ours


def test_zero_code_under_lightning_ddp_each_rank_says_its_own_rank(env: dict[str, Any]) -> None:
    """Lightning's DDP launcher (strategy="ddp", 2 CPU processes, no profiler code): it starts rank 1 with no RANK
    in its environment and passes the rank to init_process_group. Each rank's start-up line names its own rank,
    and `status` lists ranks 0 and 1 of one job. Before, zero-code made rank 1's profiler before that call, as
    'rank 0 of 2': it said another live process was rank 0 of the job ('two jobs with one job id?') and that the
    daemon refused it, until the group came up."""
    pytest.importorskip("lightning")
    daemon(env)
    proc, log = start_job(env, "zerocode_lightning.py", "--steps", LONG, torchrun=False)
    try:
        job = registered(env, proc, log)
    finally:
        printed = end(env, proc, log)
    lines = [line for line in printed.splitlines() if "ondemand_prof: " in line]
    for rank in (0, 1):
        assert len([line for line in lines if start_up_line(rank, job) in line]) == 1, lines
    assert not [line for line in lines if "another live process is rank" in line or "refused" in line], lines
