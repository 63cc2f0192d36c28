"""Fitting the training stacks people run: identity settling when torch.distributed comes up after the
profiler, the start-up line, zero-code activation, and the examples (plain, torchrun DDP, Lightning, Hugging
Face Trainer, Megatron-style, zero-code), each run for real against a live daemon and the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from conftest import NO_DAEMON_DIR, ROOT, base_env, captures, ctl, daemon, free_port, kill_tree, live_ranks, load_trace, \
    trace_steps, wait_for

SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"


def spawn(env: dict[str, Any], argv: list[str], **extra: str) -> subprocess.Popen:
    """A process in its own session (so the fixture can end it and its children), talking to the test daemon.
    At nice 10: the examples train flat out (no sleep in their loops), and the checks need only a few of their
    steps; they take what the other tests leave (the suite runs two test modules at once on two cores)."""
    penv = base_env(ONDEMAND_PROF_RUNTIME_DIR=str(env["run"]), **extra)
    proc = subprocess.Popen(["nice", "-n", "10", *argv], env=penv, cwd=env["tmp"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
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
    said = f"trace steps {trace_steps(caps[0])}; window {caps[0]['window']}; trigger {caps[0]['trigger']}"
    assert len(trace_steps(caps[0])) == steps, said
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
    from ondemand_prof.rank.triggers import job_dir_name

    # the job id as one path component (an id like pid4242@node has its "@" made "_")
    assert len(trigger_dirs) == 1 and trigger_dirs.pop().endswith(job_dir_name(job))
    cap = capture_rank(env, job, 1)
    assert cap["job_id"] == job and cap["world_size"] == 2
    status = ctl(env["run"], "status")
    assert f"job {job}: 2 of 2 rank(s)" in status.stdout and str(env["save"]) in status.stdout
    stop.touch()
    errs = [finish(p)[1] for p in procs]
    for rank, err in enumerate(errs):
        # the start-up line, on stderr without any logging set up, and again once the job settled
        assert f"now rank {rank} of 2, job {job}: capture with `ondemandctl capture --job {job}" in err, err


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
        kill_tree(proc)  # (torchrun starts its workers in sessions of their own: the launcher alone is not enough)
        out, err = proc.communicate()
        raise AssertionError(f"example did not register:\n{out[-3000:]}\n{err[-12000:]}") from None
    static = wait_for(lambda: (lambda cs: cs if len(cs) == world else None)(
        [c for c in captures(env["save"]) if c["trigger"]["source"] == "static"]), 300, "the static window")
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
    # gloo: every window's stop first let gloo's worker threads finish their profiler ranges (torch_backend.py)
    assert all("gloo_settle_ms" in c["backend"] for c in captures(env["save"])), captures(env["save"])


def test_example_megatron_style_resumed(env: dict[str, Any]) -> None:
    """Megatron's own --profile flags drive the static window; a run resumed at iteration 100 numbers its
    steps from there (the ONDEMAND_PROF_* window variables are not set: the flags decide)."""
    daemon(env)
    argv = [sys.executable, str(EXAMPLES / "megatron_style.py"), "--train-iters", LONG, "--resume-iteration", "100",
            "--profile", "--profile-step-start", "103", "--profile-step-end", "105", "--profile-ranks", "0"]
    proc = spawn(env, argv, ONDEMAND_PROF_SAVE_PATH=str(env["save"]), ONDEMAND_PROF_MIN_FREE_MB="0")
    job, _ = wait_registered(env, 1)
    static = wait_for(lambda: [c for c in captures(env["save"]) if c["trigger"]["source"] == "static"], 300,
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


# ----------------------------------------------------------------------------------------------------------
# Zero-code


def test_enable_counts_one_step_per_lead_optimizer_step(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(SCRIPTS / "zerocode_steps.py")], env=base_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == {
        "same_profiler": True, "two_optimizers_5_iterations": 5, "accumulate_4_for_3_updates": 8,
        "stepped_twice": 10, "new_lead": 11, "after_disable": 11}


def test_enable_window_steps_hold_their_own_optimizer_step(tmp_path: Path) -> None:
    """The optimizer hook runs inside the optimizer's record_function: the window's boundaries are taken at the
    next module forward instead, so each ProfilerStep holds exactly its own optimizer step."""
    save = tmp_path / "profile"
    res = subprocess.run([sys.executable, str(SCRIPTS / "zerocode_window.py"), str(save)], env=base_env(),
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    [cap] = captures(save)
    assert trace_steps(cap) == [1, 2]
    assert optimizer_steps_per_step(cap) == {1: 1, 2: 1}
    events = [e for e in load_trace(cap)["traceEvents"] if e.get("ph") == "X"]
    optimizer = [(e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name")).startswith("Optimizer.step#")]
    begins = [e["ts"] for e in events if str(e.get("name")).startswith("ProfilerStep#")]
    assert not [b for b in begins for lo, hi in optimizer if lo < b < hi], "a step began inside an optimizer step"


@pytest.mark.quick
def test_enable_refuses_a_bad_option_by_name() -> None:
    from ondemand_prof import ConfigError
    from ondemand_prof.integrations import config_from_options

    with pytest.raises(ConfigError, match="unknown profiler option 'save_pth' \\(did you mean 'save_path'\\?\\)"):
        config_from_options({"save_pth": "x"})
    with pytest.raises(ConfigError, match="invalid level 'level9'"):
        config_from_options({"level": "level9"})
    assert config_from_options({"profile_save_path": "/x", "ranks": [0, 1]}).ranks == (0, 1)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with this checkout installed in editable mode (the shared one's packages,
    torch included, reachable through a .pth), as `pip install -e .` leaves it; its python."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    import site

    Path(purelib, "shared.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                          "--no-build-isolation", "--no-index", "-q", "-e", str(ROOT)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (Path(purelib) / "ondemand_prof_auto.pth").is_file()
    return python


def test_zero_code_under_torchrun_profiles_the_ranks_not_the_launcher(env: dict[str, Any], installed: Path) -> None:
    """ONDEMAND_PROF_AUTO=1 and a script with no profiler code: its two ranks count steps, register as one job
    and take captures; torchrun's agent imports torch too, and neither counts nor registers."""
    daemon(env)
    argv = [str(installed), *torchrun(2)[1:], str(EXAMPLES / "zero_code.py"), "--steps", LONG]
    job = check_example(env, argv, 2, python=str(installed), ONDEMAND_PROF_AUTO="1", PYTHONPATH="")
    assert len(live_ranks(env["run"])) == 2  # not the launcher


def test_zero_code_shows_itself_in_a_loop_that_updates_weights_by_hand(env: dict[str, Any], tmp_path: Path) -> None:
    """No optimizer, no process group, ONDEMAND_PROF_AUTO=1: the first forward with gradients makes the profiler,
    so the start-up line comes and the daemon lists the process; with no optimizer step it says what it counts."""
    daemon(env)
    stop = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "zerocode_by_hand.py"), str(stop)], cwd=tmp_path,
                            env=base_env(ONDEMAND_PROF_AUTO="1", ONDEMAND_PROF_AUTO_NO_STEP_S="1.5",
                                         ONDEMAND_PROF_RUNTIME_DIR=str(env["run"])),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    env["procs"].append(proc)
    try:
        [rank] = wait_for(lambda: live_ranks(env["run"]), 300, "the hand-updating process to register")
        assert rank["pid"] == proc.pid and rank["step"] == 0  # no step counted: nothing calls optimizer.step()
        time.sleep(2.0)  # past the 1.5 s without an optimizer step
    finally:
        stop.touch()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [line for line in err.splitlines() if "ondemand_prof: " in line]
    assert any(f"rank 0 of 1, job " in line and "capture with `ondemandctl capture --job" in line for line in lines), err
    assert any("rank 0: no optimizer.step() in 1.5 s; zero-code counts optimizer.step(): call prof.step() in loops "
               "that update weights by hand" in line for line in lines), err


def test_zero_code_hook_does_nothing_without_the_variable(tmp_path: Path, installed: Path) -> None:
    code = ("import sys; import ondemand_prof_auto; print(any(type(f).__name__ == '_TorchWatcher' "
            "for f in sys.meta_path), 'torch' in sys.modules, 'ondemand_prof' in sys.modules)")
    for value, expected in (("", "False False False"), ("0", "False False False"), ("1", "True False False")):
        res = subprocess.run([str(installed), "-c", code], env=base_env(ONDEMAND_PROF_AUTO=value, PYTHONPATH=""),
                             capture_output=True, text=True, timeout=60)
        assert res.stdout.strip() == expected, (value, res.stdout, res.stderr)


# ----------------------------------------------------------------------------------------------------------
# Step numbers: each trainer's own


def optimizer_steps_per_step(cap: dict[str, Any]) -> dict[int, int]:
    """How many optimizer steps ran inside each ProfilerStep#N of a trace."""
    events = load_trace(cap)["traceEvents"]
    steps = [(int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"]) for e in events
             if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X"]
    opt = [e["ts"] for e in events if str(e.get("name", "")).startswith("Optimizer.step#") and e.get("ph") == "X"]
    return {n: sum(begin <= t < end for t in opt) for n, begin, end in steps}


def run_script(tmp_path: Path, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    save = tmp_path / "profile"
    res = subprocess.run([sys.executable, str(SCRIPTS / name), str(save)], env=base_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    [cap] = captures(save)
    return json.loads(res.stdout.strip().splitlines()[-1]), cap


def test_hf_trainer_steps_are_the_global_steps_it_logs(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out, cap = run_script(tmp_path, "hf_steps.py")
    assert out["logged"] == [1, 2, 3, 4]
    assert trace_steps(cap) == out["logged"]
    assert optimizer_steps_per_step(cap) == {1: 1, 2: 1, 3: 1, 4: 1}  # 2 micro-batches, one update, per step


def test_lightning_steps_are_global_step_with_accumulation(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    out, cap = run_script(tmp_path, "lightning_steps.py")
    assert out["seen"] == [0, 0, 1, 1, 2, 2, 3, 3]  # two micro-batches per optimizer step
    assert trace_steps(cap) == [0, 1, 2, 3]
    assert optimizer_steps_per_step(cap) == {0: 1, 1: 1, 2: 1, 3: 1}


# ----------------------------------------------------------------------------------------------------------
# The hook says where things are


@pytest.mark.parametrize("quiet", [False, True])
def test_start_up_and_written_lines_on_stderr_unless_quiet(tmp_path: Path, quiet: bool) -> None:
    """Logging shows warnings only (the default of a script that configures nothing): the start-up line and
    the line naming the written capture still reach stderr, once each; profile_quiet keeps them out."""
    save = tmp_path / "profile"
    extra = {"ONDEMAND_PROF_LOG": "WARNING", **({"ONDEMAND_PROF_QUIET": "1"} if quiet else {})}
    res = subprocess.run([sys.executable, "-m", "ondemand_prof.demo.toy_train", "--steps", "80", "--step-sleep",
                          "0.05", "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                          "--profile-save-path", str(save), "--profile-min-free-mb", "0"],
                         env=base_env(**extra), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    [cap] = captures(save)
    ours = [line for line in res.stderr.splitlines() if line.startswith("ondemand_prof:")]
    if quiet:
        assert ours == []
        return
    from ondemand_prof.rank.triggers import job_dir_name

    trigger = Path(tempfile.gettempdir()) / f"ondemand_prof-{os.getuid()}" / job_dir_name(cap["job_id"]) / "capture"
    assert ours == [
        f"ondemand_prof: rank 0 of 1, job {cap['job_id']}: capture with `touch {trigger}` (all ranks of the job "
        f"that watch it; no ondemand-profd answered at ipc://{NO_DAEMON_DIR}/profd.sock: start one for "
        f"ondemandctl); traces go to {save}",
        f"ondemand_prof: rank 0 wrote {cap['folder'] / Path(cap['trace_file']).name} (steps 2-3, ok; metadata and "
        f"summaries in {cap['dir']})"], res.stderr
