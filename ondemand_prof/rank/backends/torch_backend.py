"""torch.profiler on CPU and CUDA.

We drive torch.profiler.profile's public prepare_trace/start_trace/stop_trace ourselves instead of giving it a
schedule: the window is in the loop's own step numbers, the step labels are ProfilerStep#<loop step>, and the
trace export runs on our background worker rather than inside on_trace_ready on the training thread.

Level mapping (README "Levels"):
    level_none  CPU activity; the exported trace keeps only annotations (ProfilerStep#N, record_function ranges)
    level0      CPU operators + device kernels (CUDA when available)
    level1      level0 + input shapes (collective sizes); with_flops (torch 2.13 exports no counts in the trace)
    level2      level1 + memory events
User flags (with_stack, with_memory, record_shapes) add to whatever the level turns on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from ...core.processes import proc_stat_fields
from ...core.options import OPTIONS, Option, window_options
from ...core.window import Window
from ..helpers import note_training_cpu
from ..trace_save import save_trace
from .base import Export, Identity, Written

log = logging.getLogger(__name__)

# what each level turns on for torch.profiler (README "Levels"); user flags add to it through the options table.
# No with_modules: torch ignores it in eager mode (and warns).
LEVEL_KWARGS: dict[str, dict[str, bool]] = {
    "level_none": {},
    "level0": {},
    "level1": {"record_shapes": True, "with_flops": True},
    "level2": {"record_shapes": True, "with_flops": True, "profile_memory": True},
}


def torch_profile_kwargs(options: Any, cuda: bool, table: Sequence[Option] = OPTIONS) -> dict[str, Any]:
    """The torch.profiler.profile arguments a window's options map to (pure, tested directly): the level's,
    plus each window option whose `torch` mapping is "kwarg:NAME"."""
    from torch.profiler import ProfilerActivity

    # CPU activity is always on: it carries the ProfilerStep#N labels and the op -> kernel links, and on a
    # machine without an accelerator nothing else would be recorded.
    activities = [ProfilerActivity.CPU]
    if cuda and options.level != "level_none":
        activities.append(ProfilerActivity.CUDA)
    kwargs = {"record_shapes": False, "profile_memory": False, "with_stack": False, "with_flops": False,
              **LEVEL_KWARGS[options.level]}
    for opt in window_options(table):
        kind, _, target = opt.torch.partition(":")
        if kind == "kwarg" and getattr(options, opt.name):
            kwargs[target] = True
    return {"activities": activities, **kwargs}


@contextlib.contextmanager
def _without_importing_inductor() -> Iterator[None]:
    """torch.profiler's prepare_trace asks `hasattr(torch, "_inductor")` to read one inductor setting
    (triton.cudagraphs, off by default), and torch's lazy module attribute makes that question import
    torch._inductor and torch._dynamo: 2-3 s of CPU on the training thread, in the step before the first window of
    every process that never compiled anything (measured 2.3 s on the 2-core VM, torch 2.13). Where nothing has
    imported inductor, nothing can have changed that setting, so for the length of the call the question is
    answered "no" (what torch's own default then yields); a process that imported inductor is not touched. Only
    a `torch._inductor` attribute read by another thread in that instant, before any import of it, would see the
    same answer."""
    import torch

    lazy = torch.__dict__.get("__getattr__")
    if "torch._inductor" in sys.modules or not callable(lazy):
        yield
        return

    def lazy_but_inductor(name: str) -> Any:
        if name == "_inductor" and "torch._inductor" not in sys.modules:
            raise AttributeError(name)
        return lazy(name)

    setattr(torch, "__getattr__", lazy_but_inductor)
    try:
        yield
    finally:
        if torch.__dict__.get("__getattr__") is lazy_but_inductor:
            setattr(torch, "__getattr__", lazy)


# torch.distributed's gloo backend ends a collective's profiler range on its own worker thread *after* it has
# completed the work's future (ProcessGroupGloo's AsyncWork::execute: finishWorkGloo marks the future completed,
# then Work::finish runs the RecordFunction end callback, with the training thread's profiler state propagated).
# The training thread, woken by that future, can reach the window's end and stop the profiler while the callback
# still runs: it then writes the range's end into profiler storage the stop has just freed (docs/faults.md, "torch's
# gloo race"; bench/bench_gloo_race.py reproduces it with plain torch.profiler). Before stopping, a rank that uses
# gloo waits until every gloo worker thread (torch names them pt_gloo_runloop) is back waiting for its next work
# item: blocked in a futex wait with no deadline (the work queue's condition variable), which a worker enters only
# once the work before, its end callbacks included, is over. A worker running or runnable, or blocked on a lock
# (a futex wait without a bitset), is finishing a work item: waited for up to GLOO_BUSY_S (it needs only a turn on
# a CPU; under load that took over 200 ms). A worker in a collective (gloo's waits carry the group's timeout) is
# waited for up to GLOO_SETTLE_S: a collective left running across the window's end (issued async, waited for
# later) is still exposed to the race, and the capture's metadata says so (gloo_settled: false). Where no worker
# thread carries the name (an older torch, an architecture not listed), the wait falls back to "no other thread of
# the process is running", for GLOO_SETTLE_S.
GLOO_SETTLE_S = 0.2
GLOO_BUSY_S = 2.0  # a worker finishing a work item (running, runnable, on a lock) is waited for longer
GLOO_WORKER = "pt_gloo_runloop"
# the futex system call's number, as /proc/<tid>/syscall shows it (elsewhere: the fallback below)
_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())
_FUTEX_WAIT_BITSET = 9


def _uses_gloo() -> bool:
    """Whether a torch.distributed group of this process runs on gloo (the default group, or any other)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return False
        if "gloo" in str(dist.get_backend()).lower():
            return True
        pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {})  # torch's registry of groups
        return any("gloo" in str(entry[0] if isinstance(entry, tuple) else entry).lower() for entry in pg_map.values())
    except Exception:  # noqa: BLE001 - a torch without these: no wait
        return False


def _others_running(me: str) -> bool:
    """Whether a thread of this process other than `me` (a native thread id, as /proc names it) is running or
    waiting for a CPU (state R)."""
    for task in os.listdir("/proc/self/task"):
        if task == me:
            continue
        try:
            if proc_stat_fields(f"/proc/self/task/{task}/stat")[0] == b"R":
                return True
        except (OSError, IndexError):
            continue  # the thread ended
    return False


def gloo_workers() -> list[str]:
    """The native thread ids of this process's gloo worker threads (by the name torch gives them)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", "rb") as fh:
                if fh.read().strip() == GLOO_WORKER.encode():
                    found.append(task)
        except OSError:
            continue  # the thread ended
    return found


def gloo_worker_state(tid: str) -> str:
    """What gloo worker `tid` does, from /proc/self/task/TID/syscall (number, uaddr, op, val, timeout, ...):
    "idle" (a futex wait on a bitset, a condition variable, with no deadline: its work queue's; or the thread
    ended), "collective" (a wait with a deadline, or another system call: gloo waits for its peers with the group's
    timeout) or "busy" (running or runnable, or blocked on a lock: finishing a work item, end callbacks included)."""
    try:
        with open(f"/proc/self/task/{tid}/syscall", "rb") as fh:
            fields = fh.read().split()
    except FileNotFoundError:
        return "idle"
    if len(fields) < 5 or fields[0] != str(_FUTEX).encode():
        return "busy" if not fields or fields[0] in (b"running", b"-1") else "collective"
    op, timeout = int(fields[2], 16) & 0x7F, int(fields[4], 16)
    if op != _FUTEX_WAIT_BITSET:
        return "busy"  # a mutex (FUTEX_WAIT, or a PI lock)
    return "idle" if timeout == 0 else "collective"


def settle_gloo_threads(max_s: float = GLOO_SETTLE_S, max_busy_s: float = GLOO_BUSY_S) -> tuple[float, bool]:
    """On the training thread, before the profiler stops: with gloo in use, wait (sleeping 1 ms at a time) until
    every gloo worker waits for its next work item (module comment above): at most `max_s` while workers are only
    in collectives, at most `max_busy_s` while one is finishing a work item (it needs only a turn on a CPU).
    Returns (seconds waited, settled); never raises."""
    if not _uses_gloo():
        return 0.0, True
    started = time.monotonic()
    settled = False
    try:
        workers = gloo_workers() if _FUTEX is not None else []
        me = str(threading.get_native_id())
        while True:
            if workers:
                states = {gloo_worker_state(t) for t in workers}
                settled, limit = states == {"idle"}, max_busy_s if "busy" in states else max_s
            else:
                settled, limit = not _others_running(me), max_s
            if settled or time.monotonic() - started >= limit:
                break
            time.sleep(0.001)
    except OSError:  # no /proc: a plain pause instead
        time.sleep(0.002)
    return time.monotonic() - started, settled


def _prepare(prof: Any) -> None:
    with _without_importing_inductor():
        prof.prepare_trace()


class TorchSession:
    def __init__(self, window: Window, identity: Identity, cuda: bool) -> None:
        import torch.profiler

        self._window = window
        self._identity = identity
        self.kwargs = torch_profile_kwargs(window.options, cuda)
        self._prof = torch.profiler.profile(**self.kwargs)
        self._state = "idle"
        self._step_range: Any = None

    def warmup(self, step: int) -> None:
        _prepare(self._prof)
        self._state = "warmup"

    def record(self, step: int) -> None:
        from torch.autograd.profiler import record_function

        if self._state == "recording":
            self._close_step()
        else:
            if self._state == "idle":
                _prepare(self._prof)
            self._prof.start_trace()
            self._state = "recording"
            self._add_distributed_info()
        # the same label and mechanism torch.profiler's own schedule uses, with the loop's step number
        self._step_range = record_function(f"ProfilerStep#{step}")
        self._step_range.__enter__()

    def finish(self) -> Export:
        self._close_step()
        if self._state == "idle":
            raise RuntimeError("finish() before the window began")
        if self._state == "warmup":
            self._prof.start_trace()  # torch has no way to leave warmup other than through a trace
        waited, settled = settle_gloo_threads()
        self._prof.stop_trace()
        note_training_cpu()  # the helpers that write and post-process this trace keep off its core
        self._state = "done"
        prof = self._prof
        info: dict[str, Any] = {"torch_profile_kwargs": _describe(self.kwargs)}
        if waited:
            info["gloo_settle_ms"] = round(waited * 1e3, 1)
        if not settled:
            info["gloo_settled"] = False
            log.info("ondemand_prof: a gloo collective was still running %.0f ms after the window's end; the "
                     "profiler stopped anyway (torch's gloo race: docs/faults.md)", waited * 1e3)

        def kineto_results() -> Any:
            # prof.profiler is set by start_trace, which ran above (were it None, trace_save gives the error and
            # falls back to torch's own save)
            return prof.profiler.kineto_results  # type: ignore[union-attr]

        def write(staging: Path) -> Written:
            path = staging / "raw.pt.trace.json"
            # kineto's own save holds the GIL throughout: trace_save writes it without (rank/native_save.py)
            info["trace_save"] = save_trace(prof.export_chrome_trace, path, kineto_result=kineto_results)
            return Written(staging, raw_trace=path)

        return Export(write=write, info=info)

    def abort(self) -> None:
        try:
            self._close_step()
            if self._state in ("warmup", "recording"):
                if self._state == "warmup":
                    self._prof.start_trace()
                settle_gloo_threads()
                self._prof.stop_trace()
        except Exception:  # noqa: BLE001 - abort is the last resort; the cause was logged by the caller
            log.debug("abort: profiler stop failed", exc_info=True)
        self._state = "done"

    def _close_step(self) -> None:
        if self._step_range is not None:
            rng, self._step_range = self._step_range, None
            rng.__exit__(None, None, None)

    def _add_distributed_info(self) -> None:
        # torch adds distributedInfo only when torch.distributed is initialised; HTA and TensorBoard need the
        # rank in every trace, so supply it from the identity (RANK/WORLD_SIZE) otherwise.
        if self._identity.dist_initialized:
            return
        info = {"backend": "none", "rank": self._identity.rank, "world_size": self._identity.world_size}
        self._prof.add_metadata_json("distributedInfo", json.dumps(info))


def _describe(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    out["activities"] = [str(a).split(".")[-1] for a in kwargs["activities"]]
    return out


class TorchBackend:
    name = "torch"

    def __init__(self) -> None:
        import torch

        self._cuda = bool(torch.cuda.is_available())

    def open(self, window: Window, identity: Identity, staging: Path | None = None) -> TorchSession:
        return TorchSession(window, identity, self._cuda)

    def versions(self) -> dict[str, str]:
        import torch

        out = {"torch": torch.__version__, "device": "cuda" if self._cuda else "cpu"}
        if self._cuda and torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
        return out
