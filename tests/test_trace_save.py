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
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.autograd.profiler import record_function

from conftest import ROOT, assert_ok, base_env, captures, free_port, load_trace, run_ranks, trace_steps, wait_for
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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or helpers.system_tool("chrt") is None,
                    reason="Linux scheduling classes and util-linux's chrt")
def test_a_background_helper_runs_no_instruction_at_normal_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child is at SCHED_IDLE from its first instruction (chrt --idle execs it), not once this process has
    lowered it after exec: here the parent's lowering is switched off, and `cat` reads its own policy at once
    (field 41 of /proc/self/stat; 5 is SCHED_IDLE). Before, this read 0 (SCHED_OTHER)."""
    monkeypatch.setenv(helpers.SCHED_ENV, "idle")
    monkeypatch.setattr(helpers, "lower_priority", lambda pid: None)
    proc = helpers.spawn_background(["cat", "/proc/self/stat"], dict(os.environ), timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.rsplit(")", 1)[1].split()[38]) == os.SCHED_IDLE, proc.stdout
    assert proc.args == ["cat", "/proc/self/stat"]  # what the caller asked for, as subprocess.run says it
    monkeypatch.setenv(helpers.SCHED_ENV, "nice")  # nice mode: no launcher (the parent lowers it by nice levels)
    assert helpers.idle_launcher() == []


@pytest.mark.quick
def test_a_system_tool_is_only_a_root_owned_file_nobody_else_can_write(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Never a PATH lookup: a `chrt` planted in the job's directory or first on its PATH is not run."""
    planted = tmp_path / "chrt"
    planted.write_text("#!/bin/sh\necho planted\n")
    planted.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
    monkeypatch.chdir(tmp_path)
    found = helpers.system_tool("chrt")
    assert found is None or (found in ("/usr/bin/chrt", "/bin/chrt") and os.stat(found).st_uid == 0)
    assert helpers.system_tool("no-such-tool-here") is None


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
            # and the result's contents were freed there too, not later under the GIL (after the save: paced)
            assert trace_save.wait_for_native_frees(30)
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


@pytest.mark.quick
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


@pytest.mark.quick
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


@pytest.mark.quick
def test_an_unknown_save_mode_is_named_and_auto_used(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(trace_save.FORK_ENV)
    monkeypatch.setenv(trace_save.SAVE_ENV, "forked")
    with caplog.at_level(logging.WARNING, logger=trace_save.__name__):
        assert trace_save.save_mode() == "auto"
    assert "ONDEMAND_PROF_TRACE_SAVE=forked is not one of auto, in-process, fork" in caplog.text


@pytest.mark.quick
def test_a_gloo_rank_stops_the_profiler_once_no_gloo_collective_runs() -> None:
    """torch's gloo workers end a collective's profiler range after completing its future (torch_backend.py): the
    stop waits until every gloo worker waits for its next work item, at most the bound. A collective still
    running (rank 0 of an in-process pair whose rank 1 has not joined yet) is waited for, to the bound, and
    reported unsettled; before, a worker blocked in the collective was not running, so it passed as settled.
    Other threads of the process (a Python thread spinning) are not waited for; before, they held the stop to
    the bound."""
    import datetime

    import torch.distributed as dist

    from ondemand_prof.rank.backends.torch_backend import settle_gloo_threads

    assert settle_gloo_threads(0.3) == (0.0, True)  # no process group: nothing to wait for
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        spinner.start()
        waited, settled = settle_gloo_threads(5.0)
        assert settled and waited < 5.0  # a busy thread that is no gloo worker: not waited for
        store, pair = dist.HashStore(), {}
        makers = [threading.Thread(target=lambda r=r: pair.update({r: dist.ProcessGroupGloo(
            store, r, 2, datetime.timedelta(seconds=60))})) for r in (0, 1)]
        for t in makers:
            t.start()
        for t in makers:
            t.join()
        first = pair[0].allreduce([torch.ones(8)])  # runs on a gloo worker until rank 1 joins in
        waited, settled = settle_gloo_threads(0.3)
        assert not settled and waited >= 0.3
        second = pair[1].allreduce([torch.ones(8)])
        first.wait()
        second.wait()
        waited, settled = settle_gloo_threads(5.0)
        assert settled and waited < 5.0
    finally:
        stop.set()
        dist.destroy_process_group()


def test_a_capture_is_post_processed_while_the_native_build_is_stopped(in_process_trace: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's first capture starts the native save's build in the background (its own session, the compiler in
    its group, SCHED_IDLE), and the capture's post-processing child runs at the same priority: they shared what
    CPU training left, and the first capture took seconds longer than later ones (issue 32). publish stops the
    build's whole group while the real post-processing child works and continues it once the capture is out.
    The raw trace here is a named pipe, so the child waits reading it for as long as the test looks; the build is
    a stand-in group of two (a shell and its 'compiler'). Fails if publish does not pause the build."""
    import datetime

    import psutil

    from ondemand_prof.core.options import ProfileConfig, WindowOptions
    from ondemand_prof.core.window import Window
    from ondemand_prof.rank.backends.base import Export, Identity, Written
    from ondemand_prof.rank.layout import CaptureLayout
    from ondemand_prof.rank.output import ExportJob, publish

    def group_states() -> list[str]:  # each process of the build's group: 'stopped' or not
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getpgid(proc.pid) == build.pid:
                    found.append(proc.status())
            except (OSError, psutil.Error):
                continue
        return found

    def postprocessing_child() -> Any:  # among this process's children (zombies of other tests' too)
        for proc in psutil.Process().children():
            try:
                if "ondemand_prof.rank.postprocess" in " ".join(proc.cmdline()):
                    return proc
            except psutil.Error:
                continue
        return None

    def write(staging: Path) -> Written:  # what the torch backend hands over: a raw trace in the staging dir
        staging.mkdir(parents=True, exist_ok=True)
        os.mkfifo(staging / "raw.pt.trace.json")
        return Written(staging, staging / "raw.pt.trace.json")

    def pipe_reader() -> int | None:  # open for writing once the child has opened the raw trace to read it
        try:
            return os.open(out.staging / "raw.pt.trace.json", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return None

    build = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
    monkeypatch.setattr(native_save.SAVER, "_build", build)  # what NativeSaver._load keeps of the build it starts
    out = CaptureLayout(tmp_path / "save", "h", os.getpid()).plan("c1", 0, datetime.datetime.now())
    window = Window(0, 3, WindowOptions.from_config(ProfileConfig()), capture_id="c1")
    job = ExportJob(export=Export(write), window=window, identity=Identity(0, 1, 0, "h", os.getpid(), "job"),
                    out=out, metadata={}, recorded_steps=STEPS, gzip=False)
    results: list[dict[str, Any]] = []
    publisher = threading.Thread(target=lambda: results.append(publish(job)), daemon=True)
    try:
        wait_for(lambda: len(group_states()) == 2 and psutil.STATUS_STOPPED not in group_states(), 30,
                 "the stand-in build running")
        publisher.start()
        child = wait_for(postprocessing_child, 300, "the post-processing child")
        wait_for(lambda: group_states() == [psutil.STATUS_STOPPED] * 2, 30,
                 "the build stopped while the capture is post-processed")
        fd = wait_for(pipe_reader, 300, "the child to open the raw trace")
        assert child.status() != psutil.STATUS_STOPPED
        assert group_states() == [psutil.STATUS_STOPPED] * 2  # still, with the child reading the trace
        os.set_blocking(fd, True)
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(in_process_trace.read_bytes())
        publisher.join(300)
        assert results and results[0]["status"] == "ok", results
        assert results[0]["steps_in_trace"] == STEPS and steps_of(out.folder / out.trace_name) == STEPS
        wait_for(lambda: psutil.STATUS_STOPPED not in group_states(), 30, "the build continued once published")
        assert len(group_states()) == 2
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
        if publisher.is_alive():  # a failure above: the child still waits for the trace; end of file ends it
            fd = pipe_reader()
            if fd is not None:
                os.close(fd)
            publisher.join(60)
    with native_save.SAVER.paused():  # a build that has ended: nothing to stop, nothing raised
        pass


# ----------------------------------------------------------------------------------------------------------
# Issue 31: a capture never harms the run (the native save's hazards)


@pytest.mark.quick
def test_a_result_the_native_module_cannot_take_is_saved_in_process(native_module: Any, auto_mode: None,
                                                                    tmp_path: Path) -> None:
    """pybind11 answers a failed cast with cast_error, a RuntimeError in Python (not TypeError): the module says
    it did nothing and the trace is written in-process, not lost."""
    written: list[str] = []
    how = trace_save.save_trace(written.append, tmp_path / "t.json", kineto_result=lambda: object())
    assert how == "in-process" and written == [str(tmp_path / "t.json")]


def test_a_failed_native_save_is_raised_and_the_emptied_result_never_saved_again(
        native_module: Any, auto_mode: None, stopped_profile: Any, tmp_path: Path) -> None:
    """Once the module has the result it frees its contents whatever the outcome: a failure is raised to the
    exporter (which records it), never answered with export_chrome_trace, and a second save of the emptied result
    is refused (before, it dereferenced the missing trace: the process died of SIGSEGV)."""
    pid = os.fork()
    if pid == 0:  # kineto saves a result once per process
        code = 1
        try:
            signal.alarm(60)
            result = stopped_profile.profiler.kineto_results
            stopped_profile.export_chrome_trace(str(tmp_path / "first.json"))  # kineto marks the trace saved
            fallback: list[str] = []
            for attempt, expected in (("saved", "Trace is already saved"), ("emptied", "holds no trace")):
                try:
                    trace_save.save_trace(fallback.append, tmp_path / f"{attempt}.json", kineto_result=lambda: result)
                    code = 2
                except RuntimeError as exc:
                    code = 0 if expected in str(exc) else 3
                assert trace_save.wait_for_native_frees(30)  # the contents are freed after the save's outcome
                if code or fallback or len(result.events()):
                    code = code or 4
                    break
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code != -signal.SIGSEGV, "a save of the emptied result dereferenced its missing trace"
    assert code not in (2, 3, 4), {2: "no error raised", 3: "another error than kineto's",
                                   4: "fell back to export_chrome_trace, or left the contents"}.get(code)
    assert code == 0


INVERSION_CHILD = r"""
import json, os, resource, signal, subprocess, sys, threading, time
from pathlib import Path
import torch
from torch.autograd.profiler import record_function
from ondemand_prof.rank import helpers, native_save, trace_save

out = Path(sys.argv[1])
training_cpu, helper_cpu = sorted(os.sched_getaffinity(0))[:2]
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True, record_shapes=True)
prof.prepare_trace()
prof.start_trace()
for step in range(20):
    with record_function(f"ProfilerStep#{step}"):
        model(torch.randn(16, 64)).sum().backward()
prof.stop_trace()
helpers._training_cpu = training_cpu  # what note_training_cpu() records at a window's end
assert helpers.helper_cpus() == [helper_cpu], helpers.helper_cpus()
assert native_save.SAVER.module(build_missing=False) is not None, native_save.SAVER.reason
hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
os.sched_setaffinity(hog.pid, {helper_cpu})  # the helper's core is busy for the whole save: the frees compete for it
trace_save.RAISE_AFTER_S = 0.5  # the writer leaves idle priority after 0.5 s, not 10 (it competes with the hog)
how, caller, started = [], {}, threading.Event()

def save():
    if len(sys.argv) > 2 and sys.argv[2] == "idle-caller":  # the frees at idle priority, as before (a check of the check)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    caller.update(policy=os.sched_getscheduler(0), nice=os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    started.wait()  # once the training thread measures: the whole save is seen, however long it is descheduled
    how.append(trace_save.save_trace(prof.export_chrome_trace, out, kineto_result=lambda: prof.profiler.kineto_results))
    trace_save.wait_for_native_frees(60)  # the frees come after the save: measured until they are over

def freeing_thread():
    # the module's job thread (it writes through a lowered thread of its own, then frees the contents itself):
    # policy, nice, CPUs; None before it starts and after it ends
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if fh.read().strip() == "odp_save_job":
                    return {"policy": os.sched_getscheduler(int(tid)), "nice": os.getpriority(os.PRIO_PROCESS, int(tid)),
                            "cpus": sorted(os.sched_getaffinity(int(tid)))}
        except OSError:
            continue
    return None

# This thread's time asleep, not its time off the CPU: /proc's schedstat gives the time it ran and the time it
# waited runnable for its core, so a wait for the core (another process on the training core, however loaded the
# host) is not a wait for the lock. Read with pread: no allocation from malloc's arena while measuring it
stat_fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)

def ran_and_waited():
    ran, waited = os.pread(stat_fd, 100, 0).split()[:2]
    return int(ran) / 1e9, int(waited) / 1e9

saver = threading.Thread(target=save)
longest, off_cpu, deadline, windows, job = 0.0, 0.0, time.monotonic() + 90, 0, None
saver.start()
os.sched_setaffinity(0, {training_cpu})  # this thread, the training thread, keeps its core
started.set()
try:
    while saver.is_alive() and time.monotonic() < deadline and longest < 1.0:
        job = job or freeing_thread()
        (r0, q0), v0 = ran_and_waited(), resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        w0 = time.perf_counter()
        for _ in range(20):
            chunks = [bytearray(1500) for _ in range(20)]  # over 512 bytes: malloc's, not pymalloc's
            del chunks
        w1 = time.perf_counter()
        (r1, q1), v1 = ran_and_waited(), resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        windows += 1
        if v1 > v0:  # this thread slept: it waited for a lock (malloc's arena)
            longest = max(longest, (w1 - w0) - (r1 - r0) - (q1 - q0))
            off_cpu = max(off_cpu, (w1 - w0) - (r1 - r0))  # what was measured before: asleep or not
finally:
    hog.kill()
saver.join()
print(json.dumps({"how": how, "longest_wait_ms": round(longest * 1e3, 1), "longest_off_cpu_ms": round(off_cpu * 1e3, 1),
                  "freed": out.exists(), "windows": windows, "caller": caller, "job": job,
                  "training_cpu": training_cpu, "idle": os.SCHED_IDLE}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for training and one for the saver")
def test_freeing_a_saved_trace_never_holds_the_training_threads_allocations(native_module: Any,
                                                                             tmp_path: Path) -> None:
    """The trace's chunks belong to the training thread's malloc arena, and each free takes that arena's lock.
    Freed at idle priority on a busy core (before), the freeing thread was preempted holding the lock and the
    training thread's next allocation waited until SCHED_IDLE got the core again: 1.2-3.0 s here, with one hog
    on the helper's core. The frees now run at the caller's priority, so a wait lasts at most a scheduling turn
    of the helper's core (12-16 ms measured at load average 10).

    Under load (issue 44: the suite beside two `yes` hogs failed the old 250 ms bound on the training thread's
    time off the CPU) what holds is what the fix is: the thread that frees (the module's job thread, found while
    it runs) has the caller's policy and nice level, never SCHED_IDLE, and the helper's CPUs, not the training
    thread's. The time is then the training thread's time asleep (waiting for the lock), not off the CPU (a wait
    for its own core is not the frees' doing), and bounded only by what idle frees cost: 1 s, below their
    1.2-3.0 s and far above a scheduling turn on a loaded core (up to 215 ms measured beside four hogs at load
    16). The helper's core is busy from the start and the save begins once the training thread measures: a quick
    save done while the training thread waited for its core was seen by nobody ("freed": False, also issue 44)."""
    script = tmp_path / "inversion.py"
    script.write_text(INVERSION_CHILD)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "raw.json")], env=base_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["how"] == ["native"] and res["freed"] and res["windows"] > 0, res
    job, caller = res["job"], res["caller"]
    assert job is not None, f"the job thread that frees the contents was never seen: {res}"
    assert job["policy"] == caller["policy"] != res["idle"] and job["nice"] == caller["nice"], res
    assert res["training_cpu"] not in job["cpus"], res
    assert res["longest_wait_ms"] < 1000, f"the training thread slept {res['longest_wait_ms']} ms to allocate"


PACED_CHILD = r"""
import json, sys
from pathlib import Path
import torch
from torch.autograd.profiler import record_function
from ondemand_prof.rank import native_save, trace_save

torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True, record_shapes=True)
prof.prepare_trace()
prof.start_trace()
for step in range(int(sys.argv[2])):
    with record_function(f"ProfilerStep#{step}"):
        model(torch.randn(16, 64)).sum().backward()
prof.stop_trace()
module = native_save.SAVER.module(build_missing=False)
assert module is not None, native_save.SAVER.reason
out = Path(sys.argv[1])
how = trace_save.save_trace(prof.export_chrome_trace, out, kineto_result=lambda: prof.profiler.kineto_results)
steps = sum(1 for e in json.loads(out.read_text())["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
freed = trace_save.wait_for_native_frees(120)
cpu, wall, rests = module.last_free()
print(json.dumps({"how": how, "steps": steps, "freed": freed, "pending": trace_save.native_frees_pending(),
                  "events_left": len(prof.profiler.kineto_results.events()), "cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3,
                  "rests": rests}))
"""


def test_a_saved_trace_is_there_before_its_result_is_freed_and_the_frees_are_paced(native_module: Any,
                                                                                   tmp_path: Path) -> None:
    """Issue 44 item 7: freed in one burst on a core beside the training thread, the result's contents cost its
    next steps about their own CPU time again (8 x Linear(512), one thread: +13 ms of its CPU over the 10 steps
    after a window, against +3 ms paced; bench_window_cost.py ours-atonce). The module now says the trace saved
    first (save_trace returns with the whole trace written: every step is in it) and then frees the events and the
    event tree in slices with rests three times as long (kineto's trace, which torch gives no way into, at once):
    the module counts the rests, and they are real: the frees' wall time holds at least 1.5 ms a rest (measured:
    125 ms of CPU in 212 ms, 60-odd rests; before, none). Then the result is empty and let go of."""
    script = tmp_path / "paced.py"
    script.write_text(PACED_CHILD)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "raw.json"), "120"], env=base_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["how"] == "native" and res["steps"] == 120, res
    assert res["freed"] and res["pending"] == 0 and res["events_left"] == 0, res
    assert res["rests"] >= 5, f"the frees ran in one burst: {res}"
    assert res["wall_ms"] >= 1.5 * res["rests"], res


EXIT_CHILD = r"""
import os, sys, threading
from pathlib import Path
import torch
from torch.autograd.profiler import record_function
from ondemand_prof.rank import native_save, trace_save

path = Path(sys.argv[1])
trace_save.EXIT_WAIT_S = float(sys.argv[2])
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True, record_shapes=True)
prof.prepare_trace()
prof.start_trace()
model = torch.nn.Linear(64, 64)
for step in range(3):
    with record_function(f"ProfilerStep#{step}"):
        model(torch.randn(16, 64)).sum().backward()
prof.stop_trace()
assert native_save.SAVER.module(build_missing=False) is not None, native_save.SAVER.reason
threading.Thread(target=trace_save.save_trace, args=(prof.export_chrome_trace, path), daemon=True,
                 kwargs={"kineto_result": lambda: prof.profiler.kineto_results}).start()
print("saving", flush=True)
sys.stdin.readline()  # the test says when: the save is writing (its FIFO is full)
sys.exit(3)  # as a training script ends while the exporter still writes (close() gave up, or was never called)
"""


@pytest.mark.parametrize("reader", ["finishes", "never-finishes"])
def test_a_process_exiting_mid_save_waits_for_it_and_keeps_its_exit_status(reader: str, native_module: Any,
                                                                           tmp_path: Path) -> None:
    """The save writes through a FIFO the test reads; the process exits while the save is blocked on it. Before,
    the exit tore down the interpreter and C++ statics under the running saver thread (which was killed with the
    process mid-write, or crashed in what was destroyed). Now the exit waits for it: the trace is complete and the
    exit status is the program's; a save that does not end within the exit wait (here 2 s) ends the process with
    the program's status, saying so, without destroying what the save uses."""
    script, path = tmp_path / "exit_mid_save.py", tmp_path / "raw.pt.trace.json"
    script.write_text(EXIT_CHILD)
    os.mkfifo(f"{path}.tmp")
    fifo = os.open(f"{path}.tmp", os.O_RDONLY | os.O_NONBLOCK)  # kineto's open for writing then succeeds
    proc = subprocess.Popen([sys.executable, str(script), str(path), "2" if reader == "never-finishes" else "60"],
                            env=base_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    err: list[str] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == "saving", proc.stderr.read()[-3000:]
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        data = bytearray()
        wait_for(lambda: select.select([fifo], [], [], 0.1)[0] and data.extend(os.read(fifo, 1 << 16)) is None
                 and data, timeout=60, what="the save's first bytes")
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        waiting = "the process is exiting while 1 trace save(s) still run"
        wait_for(lambda: proc.poll() is not None or any(waiting in line for line in err), timeout=60,
                 what="the exit to wait for the save, or the process to end")
        if reader == "finishes":
            os.set_blocking(fifo, True)
            while chunk := os.read(fifo, 1 << 20):
                data.extend(chunk)
        code = proc.wait(timeout=60)
    finally:
        os.close(fifo)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(err)
    assert waiting in text, f"the exit did not wait for the save (exit {code}): {text[-2000:]}"
    assert code == 3, text[-2000:]
    if reader == "finishes":
        trace = json.loads(bytes(data))  # complete: the whole trace came through
        assert sorted(int(e["name"].split("#")[1]) for e in trace["traceEvents"]
                      if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep#")) == [0, 1, 2]
        assert "the process ends now" not in text
    else:
        assert "a trace save still runs after 2 s; the process ends now (exit status 3)" in text
