"""How a window's trace leaves the training process without stalling the training thread.

Two costs follow the window-end step when the export runs on a thread of the training process:
  * kineto's ProfilerResult.save() (behind export_chrome_trace) holds the GIL for its whole duration, so the
    training thread makes almost no progress while the export thread writes the raw trace;
  * the helpers (the saver, the post-processing child) compete with training for the cores.

So save_trace() writes the raw trace, by ONDEMAND_PROF_TRACE_SAVE:
  auto        (default) with the GIL-free native save (rank/native_save.py: the same C++ save, the GIL released,
              on a thread at idle priority; the contents freed after it at the caller's priority) when its module
              is built for this torch; else in-process, as before. A result the module does not take (another
              pybind11 registry) is saved in-process; a failure once it has the result is raised, never retried
              (the module frees the contents either way);
  in-process  export_chrome_trace on the exporter thread (holds the GIL throughout); never builds anything;
  fork        from a forked child of the training process (also ONDEMAND_PROF_FORK_SAVE=1, the older switch): the
              child holds its own copy of the GIL, the parent waits in the kernel. The fork itself holds the GIL
              (about 14 ms per GB of RSS on the 2-core test VM) and the training thread's next writes to memory pay
              copy-on-write faults. If the child cannot be made or fails (exit status, signal, timeout), the trace
              is saved in-process.
The native saver thread and the forked saver run at background priority, as every helper does
(rank/helpers.py): on cores the training run leaves idle.

Nothing here raises into the training loop: these functions run on the exporter thread, and they raise only
what an in-process save raises (the exporter records it in the capture's metadata).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, NoReturn

from .helpers import FALLBACK_NICE, RAISE_AFTER_S, helper_cpus, idle_priority_enabled, lower_priority, \
    raise_priority

log = logging.getLogger(__name__)

FORK_ENV = "ONDEMAND_PROF_FORK_SAVE"
SAVE_ENV = "ONDEMAND_PROF_TRACE_SAVE"
SAVE_MODES = ("auto", "in-process", "fork")
FORK_SAVE_TIMEOUT_S = 300.0  # a SCHED_IDLE child on busy cores is slow, not stuck; this bounds a stuck one
SLOW_FORK_S = 0.1
# A process that exits while a native save runs waits for it (the module's exit handler) at most this long, then
# ends with its own exit status rather than destroy what the save still uses.
EXIT_WAIT_S = 30.0

# Native jobs whose trace is saved while their result's contents are still being freed (paced, off the GIL: the
# module's free_contents): the result stays the job's until then, so the job is kept here and let go of later.
_freeing: list[Any] = []
_freeing_lock = threading.Lock()

# Python 3.12+ warns at every fork of a process with threads; this module forks a threaded process on purpose
# and its child runs no code that needs another thread's locks (see _child_main).
warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning,
                        module=__name__)


def save_mode() -> str:
    """auto, in-process or fork (module docstring). The fork is opt-in (ONDEMAND_PROF_TRACE_SAVE=fork or
    ONDEMAND_PROF_FORK_SAVE=1) where os.fork exists: on the CPU model measured so far it (GIL held ~14 ms/GB RSS,
    then copy-on-write faults in the next step) cost as much as the in-process save it replaces, and a child stuck
    on a lock held at the fork delays that window's trace until the timeout (README "Output")."""
    mode = os.environ.get(SAVE_ENV, "").strip().lower() or "auto"
    if os.environ.get(FORK_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        mode = "fork"
    if mode not in SAVE_MODES:
        log.warning("ondemand_prof: %s=%s is not one of %s; using auto", SAVE_ENV, mode, ", ".join(SAVE_MODES))
        mode = "auto"
    if mode == "fork" and not hasattr(os, "fork"):
        mode = "in-process"
    return mode


def save_trace(save: Callable[[str], None], path: Path, timeout_s: float = FORK_SAVE_TIMEOUT_S,
               kineto_result: Callable[[], Any] | None = None) -> str:
    """Write a trace with `save(path)` (e.g. a torch profile's export_chrome_trace), or, given `kineto_result`
    (returning the profile's torch._C._autograd._ProfilerResult), with the native save when it is loaded.
    Returns how it was written: "native", "fork" or "in-process" (the fallback, or the only way)."""
    mode = save_mode()
    if mode == "fork":
        problem = _save_in_child(save, path, timeout_s)
        if problem is None:
            return "fork"
        log.warning("ondemand_prof: writing the trace in a child process failed (%s); writing it in-process",
                    problem)
    elif mode == "auto" and kineto_result is not None:
        problem = _save_native(kineto_result, path)
        if problem is None:
            return "native"
        log.debug("ondemand_prof: native trace save not used (%s)", problem)
    save(str(path))
    return "in-process"


def _save_native(kineto_result: Callable[[], Any], path: Path) -> str | None:
    """None when the native module wrote `path`; otherwise why not, when nothing was done (the caller saves it
    in-process). A failure once the module has the result is raised, never answered with another save: the
    module frees the result's contents whatever the outcome, and kineto's save of an emptied result dereferences
    a null trace."""
    from .native_save import SAVER

    module = SAVER.module()
    if module is None:
        return SAVER.reason
    try:
        result = kineto_result()
    except Exception as exc:  # noqa: BLE001 - a torch without the attribute: the in-process save
        return f"no kineto result: {type(exc).__name__}: {exc}"
    idle = idle_priority_enabled()
    try:
        module.set_exit_wait(EXIT_WAIT_S)
        job = module.save(result, str(path), idle, 0 if idle else FALLBACK_NICE, helper_cpus(), RAISE_AFTER_S,
                          FALLBACK_NICE)
    except module.Unsaved as exc:  # not a result this module knows (another pybind11 registry), no thread: unsaved
        return f"the native module did not take this result: {exc}"
    except TypeError as exc:  # pybind11 refused the arguments before the call: nothing was done
        return f"the native module cannot take these arguments: {exc}"
    _wait_for(job)
    _keep_until_freed(job)
    job.finish()  # raises what kineto's save raised
    return None


def _wait_for(job: Any) -> None:
    """Until the native job has saved the trace, in select (the GIL is free for the training thread meanwhile)."""
    while not job.saved():
        select.select([job], [], [])


def _keep_until_freed(job: Any) -> None:
    """Hold `job` (and so its result) until its result is freed; let go of the earlier ones that are."""
    with _freeing_lock:
        _freeing.append(job)
    native_frees_pending()


def native_frees_pending() -> int:
    """How many saved results the native module is still freeing; the jobs of those freed are let go of."""
    with _freeing_lock:
        _freeing[:] = [j for j in _freeing if not j.release()]
        return len(_freeing)


def wait_for_native_frees(timeout_s: float) -> bool:
    """Until every saved result is freed (a test or a benchmark about to look at a result or at memory); False on
    timeout. A result may be looked at again only then."""
    deadline = time.monotonic() + timeout_s
    while native_frees_pending():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _save_in_child(save: Callable[[str], None], path: Path, timeout_s: float) -> str | None:
    """None when a child wrote `path` completely; otherwise why not (the caller falls back)."""
    started = time.monotonic()
    try:
        pid = os.fork()
    except OSError as exc:  # EAGAIN, ENOMEM: too many processes, or no memory to copy the page tables
        return f"fork failed: {exc}"
    if pid == 0:
        _child_main(save, path)
    _note_fork_time(time.monotonic() - started)
    status = _wait_child(pid, timeout_s)
    if status is None:
        return f"no result after {timeout_s:.0f} s; killed"
    if status == 0:
        return None
    return f"exit status {status}" if status > 0 else f"killed by signal {-status}"


def _note_fork_time(seconds: float) -> None:
    # the fork holds the GIL while it copies the page tables (time grows with the RSS): say so when it is long
    if seconds > SLOW_FORK_S:
        log.info("ondemand_prof: forking the trace writer took %.0f ms (the training thread waits as long); "
                 "%s=0 writes the trace in-process instead", seconds * 1e3, FORK_ENV)


def _child_main(save: Callable[[str], None], path: Path) -> NoReturn:
    """The forked child. Only the forking thread exists here, and any lock another thread of the training
    process held at the fork stays held forever: so no logging, no imports, no atexit, no cleanup (os._exit)."""
    code = 1
    try:
        _child_prepare()
        save(str(path))
        code = 0
    except BaseException:  # noqa: BLE001 - the exit status is the report; the parent logs and falls back
        pass
    finally:
        os._exit(code)


def _child_prepare() -> None:
    # The training program's Python signal handlers (a SIGTERM handler that checkpoints, say) must not run in
    # this copy of it: a signal sent to the process group ends the child instead.
    for sig in signal.valid_signals():
        try:
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    lower_priority(0)


def _wait_child(pid: int, timeout_s: float) -> int | None:
    """The child's exit code (negative: killed by that signal), or None after killing it at the timeout.
    Waits in the kernel (pidfd + select; else waitpid polls) so that the GIL stays free for the training thread."""
    fd = _pidfd(pid)
    if fd is None:
        return _poll_child(pid, timeout_s)
    try:
        ready, _, _ = select.select([fd], [], [], min(RAISE_AFTER_S, timeout_s))
        if not ready and timeout_s > RAISE_AFTER_S:
            raise_priority(pid)
            ready, _, _ = select.select([fd], [], [], timeout_s - RAISE_AFTER_S)
    finally:
        os.close(fd)
    if ready:
        return _reap(pid)
    _kill(pid)
    return None


def _poll_child(pid: int, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return 1  # someone else reaped it: the outcome is unknown
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            _kill(pid)
            return None
        time.sleep(0.02)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # Linux 5.3+
    except (AttributeError, OSError):
        return None


def _reap(pid: int) -> int:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # someone else reaped it (a SIGCHLD handler): the outcome is unknown
        return 1
    return os.waitstatus_to_exitcode(status)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _reap(pid)
    return None
