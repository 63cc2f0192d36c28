"""How the trace leaves the training process. Issue 14: from a forked child, the same trace as an in-process
save, and every way the child can fail ends in an in-process save, never in a lost trace or an exception in
training. Issue 20: the GIL-free native save (rank/native_save.py) writes the same bytes with the GIL free, is
loaded only from a cache of ours built for this torch, and a failed build leaves the in-process save."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.autograd.profiler import record_function

from conftest import ROOT, assert_ok, captures, free_port, load_trace, run_ranks, trace_steps, wait_for
from ondemand_prof.rank import helpers, native_save, trace_save

STEPS = [0, 1, 2]


@pytest.fixture(scope="module")
def stopped_profile() -> Any:
    """A collected (stopped) torch profile of a few steps, with stacks and shapes, not yet saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
                                  record_shapes=True)
    prof.prepare_trace()
    prof.start_trace()
    for step in STEPS:
        with record_function(f"ProfilerStep#{step}"):
            model(torch.randn(16, 64)).sum().backward()
    prof.stop_trace()
    return prof


def saved_bytes(path: Path) -> bytes:
    # kineto writes the file's own path into the trace ("traceName"); everything else must be identical
    return path.read_bytes().replace(str(path).encode(), b"<path>")


def events(path: Path) -> list[tuple[str, str, Any]]:
    return [(e.get("ph"), e.get("name"), e.get("ts")) for e in json.loads(path.read_text())["traceEvents"]]


def steps_of(path: Path) -> list[int]:
    return sorted(int(n.split("#")[1]) for ph, n, _ in events(path) if ph == "X" and n.startswith("ProfilerStep#"))


@pytest.fixture
def in_process_trace(stopped_profile: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same profile written the old way. kineto saves a result once per process, so the
    in-process save of the module's profile happens in a fork (its memory is the parent's, as in-process)."""
    path = tmp_path_factory.getbasetemp() / "reference" / "raw.pt.trace.json"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        pid = os.fork()
        if pid == 0:
            try:
                stopped_profile.export_chrome_trace(str(path))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    return path


@pytest.fixture(autouse=True)
def fork_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork is opt-in (ONDEMAND_PROF_FORK_SAVE=1); these tests are about it."""
    monkeypatch.setenv(trace_save.FORK_ENV, "1")


def test_forked_save_writes_the_same_trace_as_in_process(stopped_profile: Any, in_process_trace: Path,
                                                         tmp_path: Path) -> None:
    path = tmp_path / "raw.pt.trace.json"
    assert trace_save.save_trace(stopped_profile.export_chrome_trace, path) == "fork"
    assert steps_of(path) == STEPS
    assert events(path) == events(in_process_trace)  # same events, same order, same timestamps
    assert saved_bytes(path) == saved_bytes(in_process_trace)


def _exit_3() -> None:
    os._exit(3)


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _raise() -> None:
    raise RuntimeError("boom")


def _hang() -> None:
    time.sleep(600)


@pytest.mark.parametrize("failure", [_exit_3, _sigkill, _raise, _hang], ids=["exit3", "sigkill", "raises", "hangs"])
def test_a_failing_child_falls_back_to_an_in_process_save(failure: Any, stopped_profile: Any, in_process_trace: Path,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # each parametrisation saves in-process in a fork of its own: kineto allows one save per result and process
    monkeypatch.setattr(trace_save, "_child_prepare", failure)
    path = tmp_path / "raw.pt.trace.json"
    pid = os.fork()
    if pid == 0:
        try:
            how = trace_save.save_trace(stopped_profile.export_chrome_trace, path, timeout_s=2)
            os._exit(0 if how == "in-process" else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert saved_bytes(path) == saved_bytes(in_process_trace)


def test_fallback_is_logged_with_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(trace_save, "_child_prepare", _exit_3)
    written: list[str] = []
    with caplog.at_level(logging.WARNING, logger=trace_save.__name__):
        how = trace_save.save_trace(written.append, tmp_path / "t.json")
    assert how == "in-process" and written == [str(tmp_path / "t.json")]
    assert "exit status 3" in caplog.text


def test_no_fork_when_turned_off_or_failing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    forks: list[int] = []

    def failing_fork() -> int:
        forks.append(1)
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", failing_fork)
    written: list[str] = []
    assert trace_save.save_trace(written.append, tmp_path / "t.json") == "in-process"
    assert forks == [1] and len(written) == 1
    monkeypatch.setenv(trace_save.FORK_ENV, "0")
    assert trace_save.save_trace(written.append, tmp_path / "t.json") == "in-process"
    assert forks == [1] and len(written) == 2


def test_an_in_process_save_error_reaches_the_exporter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # what the exporter records as the capture's error, as before the fork existed
    monkeypatch.setenv(trace_save.FORK_ENV, "0")

    def broken(path: str) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        trace_save.save_trace(broken, tmp_path / "t.json")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
@pytest.mark.parametrize("sched", ["idle", "nice"])
def test_background_helpers_run_at_low_priority(sched: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(helpers.SCHED_ENV, sched)
    monkeypatch.setattr(helpers, "RAISE_AFTER_S", 600)  # never raised here, however starved (its own test: below)
    # the child reports after a pause: its priority is set by the parent right after exec
    code = "import os, time; time.sleep(0.5); print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))"
    proc = helpers.spawn_background([sys.executable, "-c", code], dict(os.environ), timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    policy, nice = map(int, proc.stdout.split())
    if sched == "idle":
        assert policy == os.SCHED_IDLE
    else:
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert policy == os.SCHED_OTHER and nice == min(19, ours + helpers.FALLBACK_NICE)


def test_a_helper_left_idle_too_long_is_raised_to_a_share_of_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every core busy at normal priority starves SCHED_IDLE: a helper not done after RAISE_AFTER_S moves to the
    normal policy, FALLBACK_NICE levels down (it reports its priority after that point)."""
    monkeypatch.setenv(helpers.SCHED_ENV, "idle")
    monkeypatch.setattr(helpers, "RAISE_AFTER_S", 0.5)
    code = "import os, time; time.sleep(2.5); print(os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))"
    proc = helpers.spawn_background([sys.executable, "-c", code], dict(os.environ), timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    assert list(map(int, proc.stdout.split())) == [os.SCHED_OTHER, helpers.FALLBACK_NICE]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to keep one for training")
def test_background_helpers_keep_off_the_training_threads_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    training_cpu = min(os.sched_getaffinity(0))
    monkeypatch.setattr(helpers, "_training_cpu", training_cpu)
    code = "import os, time; time.sleep(0.5); print(sorted(os.sched_getaffinity(0)))"
    proc = helpers.spawn_background([sys.executable, "-c", code], dict(os.environ), timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == sorted(os.sched_getaffinity(0) - {training_cpu})
    monkeypatch.setenv(helpers.CPUS_ENV, "all")  # the way to let them anywhere
    proc = helpers.spawn_background([sys.executable, "-c", code], dict(os.environ), timeout_s=60)
    assert json.loads(proc.stdout) == sorted(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------------------------------------
# Real training processes


COMMON = ["--no-profile-ondemand", "--profile-min-free-mb", "0", "--profile-with-stack", "--profile-record-shapes"]

CHILD_DIES = """
import os, runpy, signal
from ondemand_prof.rank import helpers, native_save, trace_save

def die():
    if os.environ["TEST_CHILD_FAILURE"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)

trace_save._child_prepare = die
runpy.run_module("ondemand_prof.demo.toy_train", run_name="__main__", alter_sys=True)
"""


def run_window(save_path: Path, env: dict[str, str] | None = None, module: str = "ondemand_prof.demo.toy_train"
               ) -> tuple[dict[str, Any], str]:
    args = ["--steps", "10", "--profile", "--profile-step-start", "3", "--profile-step-end", "7",
            "--profile-save-path", str(save_path), *COMMON]
    results = run_ranks(args, env={trace_save.FORK_ENV: "1", **(env or {})}, module=module)
    assert_ok(results)  # the training loop never saw an exception
    (cap,) = captures(save_path)
    return cap, results[0][2]


def event_names(cap: dict[str, Any]) -> list[str]:
    # Python stack events name objects by address, which differs between two processes
    return sorted(re.sub(r"0x[0-9a-f]+", "0x", str(e.get("name"))) for e in load_trace(cap)["traceEvents"])


def test_training_run_publishes_the_same_trace_either_way(tmp_path: Path) -> None:
    forked, _ = run_window(tmp_path / "fork")
    inproc, _ = run_window(tmp_path / "inproc", env={trace_save.FORK_ENV: "0"})
    for cap in (forked, inproc):
        assert cap["status"] == "ok" and trace_steps(cap) == [3, 4, 5, 6]
    # two runs of the same loop: the same operators, annotations and steps, whichever way the trace left
    assert event_names(forked) == event_names(inproc)


@pytest.mark.parametrize("failure", ["kill", "exit"])
def test_training_run_whose_saver_child_dies_still_publishes(failure: str, tmp_path: Path) -> None:
    (tmp_path / "child_dies.py").write_text(CHILD_DIES)
    env = {"TEST_CHILD_FAILURE": failure, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    cap, log = run_window(tmp_path / "profile", env=env, module="child_dies")
    assert cap["status"] == "ok" and trace_steps(cap) == [3, 4, 5, 6]
    reason = "killed by signal 9" if failure == "kill" else "exit status 3"
    assert f"writing the trace in a child process failed ({reason}); writing it in-process" in log


# ----------------------------------------------------------------------------------------------------------
# The GIL-free native save (issue 20)


@pytest.fixture(scope="module")
def native_module() -> Any:
    """The native module, built into the user's cache as `python -m ondemand_prof.rank.native_save build` does
    (once per torch version: 15-60 s on 2 cores; nothing when it is there)."""
    if not native_save.compiler_present():
        pytest.skip("no C++ compiler: the native save cannot be built here (traces are written in-process)")
    ok, message = native_save.build()
    assert ok, message
    module, why = native_save.load()
    assert module is not None, why
    return module


@pytest.fixture
def auto_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(trace_save.FORK_ENV)
    monkeypatch.delenv(trace_save.SAVE_ENV, raising=False)


def test_native_save_writes_the_same_trace_while_python_runs(native_module: Any, auto_mode: None,
                                                             stopped_profile: Any, in_process_trace: Path,
                                                             tmp_path: Path) -> None:
    """kineto writes `{path}.tmp` and renames it; a FIFO there makes the save wait for a reader, and the reader is
    Python code on another thread, which can run only if the save let go of the GIL (else the child hangs until
    its alarm kills it). Afterwards the result holds no events: its contents were freed on the saver thread."""
    assert native_save.SAVER.module(build_missing=False) is not None, native_save.SAVER.reason
    path, copy = tmp_path / "raw.pt.trace.json", tmp_path / "read-through-the-fifo.json"
    os.mkfifo(f"{path}.tmp")
    pid = os.fork()
    if pid == 0:  # kineto saves a result once per process
        code = 1
        try:
            signal.alarm(60)
            ways: list[str] = []
            saver = threading.Thread(target=lambda: ways.append(trace_save.save_trace(
                stopped_profile.export_chrome_trace, path, kineto_result=lambda: stopped_profile.profiler.kineto_results)))
            saver.start()
            with open(f"{path}.tmp", "rb") as fh:
                copy.write_bytes(fh.read())
            saver.join()
            # and the result's contents were freed there too, not later under the GIL
            left = len(stopped_profile.profiler.kineto_results.events())
            code = 2 if ways != ["native"] else 3 if native_module.frees_result and left else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code != -signal.SIGALRM, "the save held the GIL: the reading thread never ran"
    assert code != 2, "the trace was not written by the native save"
    assert code != 3, "the native save left the result's events to be freed by Python"
    assert code == 0
    assert copy.read_bytes().replace(str(path).encode(), b"<path>") == saved_bytes(in_process_trace)


def _cached_copy(root: Path, key: str) -> Path:
    root.mkdir(mode=0o700, exist_ok=True)
    target = native_save.module_path(root, key)
    shutil.copyfile(native_save.module_path(native_save.cache_root(), native_save.build_key()), target)
    os.chmod(target, 0o700)
    return target


FLAWS = {
    "directory writable by its group": lambda root, so: os.chmod(root, 0o770),
    "directory is a symbolic link": lambda root, so: (os.rename(root, f"{root}.real"), os.symlink(f"{root}.real", root)),
    "file writable by others": lambda root, so: os.chmod(so, 0o722),
    "file of another user": lambda root, so: os.chown(so, 65534, 65534),
}


@pytest.mark.parametrize("flaw", FLAWS)
def test_a_cached_module_is_refused_unless_it_is_ours(flaw: str, native_module: Any, tmp_path: Path) -> None:
    if flaw == "file of another user" and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    root = tmp_path / "native"
    so = _cached_copy(root, native_save.build_key())
    FLAWS[flaw](root, so)
    module, why = native_save.load(root)
    assert module is None
    expected = {"directory writable by its group": "writable by its group", "directory is a symbolic link":
                "symbolic link", "file writable by others": "writable by others", "file of another user":
                "belongs to uid 65534"}[flaw]
    assert expected in why


def test_a_module_built_for_another_torch_or_source_is_not_used(native_module: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "native"
    _cached_copy(root, "0" * 20)  # the file a different source or torch build would be looked up under
    monkeypatch.setattr(native_save, "build_key", lambda: "0" * 20)
    module, why = native_save.load(root)
    assert module is None and f"built for torch {torch.__version__} (key {native_module.source_key})" in why


def test_training_run_with_the_native_save_publishes_the_same_trace(native_module: Any, tmp_path: Path) -> None:
    native, _ = run_window(tmp_path / "native", env={trace_save.FORK_ENV: "0"})
    inproc, _ = run_window(tmp_path / "inproc", env={trace_save.FORK_ENV: "0", trace_save.SAVE_ENV: "in-process"})
    assert native["backend"]["trace_save"] == "native" and inproc["backend"]["trace_save"] == "in-process"
    for cap in (native, inproc):
        assert cap["status"] == "ok" and trace_steps(cap) == [3, 4, 5, 6]
    assert event_names(native) == event_names(inproc)


def test_a_failed_build_is_remembered_and_the_trace_written_in_process(tmp_path: Path) -> None:
    # a rank with no module in its cache builds one in the background; this compiler fails
    env = {trace_save.FORK_ENV: "0", "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": "false"}
    first, _ = run_window(tmp_path / "first", env=env)
    assert first["status"] == "ok" and trace_steps(first) == [3, 4, 5, 6]
    assert first["backend"]["trace_save"] == "in-process"
    root = tmp_path / "cache" / "ondemand_prof" / "native"
    failed = wait_for(lambda: next(root.glob("*.failed"), None), timeout=120, what="the failed build's note")
    assert "compile failed" in failed.read_text()
    assert (root.stat().st_mode & 0o777) == 0o700
    noted = failed.stat().st_mtime_ns
    second, log = run_window(tmp_path / "second", env=env)  # not built again: the failure is remembered
    assert second["status"] == "ok" and second["backend"]["trace_save"] == "in-process"
    assert "the build failed before: compile failed" in log
    assert failed.stat().st_mtime_ns == noted


def test_an_unknown_save_mode_is_named_and_auto_used(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(trace_save.FORK_ENV)
    monkeypatch.setenv(trace_save.SAVE_ENV, "forked")
    with caplog.at_level(logging.WARNING, logger=trace_save.__name__):
        assert trace_save.save_mode() == "auto"
    assert "ONDEMAND_PROF_TRACE_SAVE=forked is not one of auto, in-process, fork" in caplog.text


def test_a_gloo_rank_lets_other_threads_finish_before_the_profiler_stops() -> None:
    """torch's gloo worker threads end their profiler ranges after completing the collective (torch_backend.py
    GLOO_SETTLE_S): with a gloo group, the stop waits while another thread runs, at most the bound; without one,
    or once the other threads sleep, it does not wait."""
    import torch.distributed as dist

    from ondemand_prof.rank.backends.torch_backend import settle_gloo_threads

    assert settle_gloo_threads(0.3) == 0.0  # no process group: nothing to wait for
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        spinner.start()
        assert settle_gloo_threads(0.3) >= 0.3  # a thread that keeps running: waited for, up to the bound
        stop.set()
        spinner.join()
        assert settle_gloo_threads(5.0) < 5.0  # everything else asleep: no wait to the bound
    finally:
        stop.set()
        dist.destroy_process_group()


def test_the_native_build_is_stopped_while_a_capture_is_post_processed() -> None:
    """The build a first capture starts (its own process group, the compiler in it) is stopped while a trace is
    post-processed and continued after: both at SCHED_IDLE, they shared the leftover CPU (issue 32)."""
    import subprocess

    def state(pid: int) -> str:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]

    saver = native_save.NativeSaver()
    build = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)  # a group of two
    try:
        saver._build = build
        wait_for(lambda: state(build.pid) == "S", 10, "the stand-in asleep")
        with saver.paused():
            wait_for(lambda: state(build.pid) == "T", 10, "the build stopped")
        wait_for(lambda: state(build.pid) == "S", 10, "the build continued")
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    with saver.paused():  # a build that has ended: nothing to stop, nothing raised
        pass
