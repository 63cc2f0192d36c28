"""OnDemandProfiler: the hook inside each training rank.

Threads: the training thread calls step(); with no window due, that is one small function around a C-level
counter (docs/benchmarks.md, "Idle cost"). Everything that needs attention at a step boundary (a window to begin, advance or finish, a request
handed over by another thread) is signalled by lowering `_wake` and removing the idle counter, so the idle path
never takes a lock. Which window runs when is the Scheduler's (rank/scheduler.py); this module keeps the idle
fast path, the inbox from other threads, and the calls into backends, the layout and the exporter.
Nothing raised by the profiler, the disk or a trigger reaches the training loop.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import dataclasses
import datetime as _dt
import logging
import operator
import os
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping

from ..core.version import __version__
from ..core.files import iso_time
from ..core.ids import capture_id as make_capture_id
from ..core.options import ConfigError, ProfileConfig, config_from_args, config_from_env, \
    config_from_mapping, default_job_id
from ..core.requests import CaptureRequest, WindowDefaults, resolve
from ..core.window import Window
from .backends import Backend, Identity, Session, select_backend
from .cpuclock import ClockedSession
from .layout import CaptureLayout, trace_path
from ..core.safedir import make_dirs, safe_save_root
from .output import ExportJob, Exporter, dir_mode, disk_problem, writable_problem
from .scheduler import IDLE, Active, Listener, Scheduler, tell

log = logging.getLogger("ondemand_prof")

_COUNTER_END = IDLE  # the idle counter counts up to here; its position is read through length_hint


class OnDemandProfiler:
    """Profile static windows from the configuration and on-demand windows from triggers.

    Call step() once at the end of every training step. Steps are numbered from `first_step` (0 by
    default: the first step after construction is step 0). A loop with its own counter (resumed or 1-based
    runs) passes `first_step=` and may call step(n) with the number of the step that just ended.
    """

    def __init__(self, config: ProfileConfig | None = None, *, first_step: int = 0, backend: str | Backend = "auto",
                 start_agent: bool = True) -> None:
        config = config or ProfileConfig()
        # A relative save path means the rank's working directory, now: made absolute here, once, so the rank
        # reports, prints and records one path that the daemon (another working directory) can check.
        self._save_root = Path(os.path.abspath(Path(config.save_path).expanduser()))
        self.config = dataclasses.replace(config, save_path=str(self._save_root))
        self._step = first_step
        self._wake = IDLE
        self._counter: Any = None
        # work other threads (agent, signal handler) hand to the training thread; deque.append/popleft are
        # atomic, so no lock is needed, and a signal handler may append safely
        self._inbox: collections.deque[Callable[[int], None]] = collections.deque()
        self._backend_name = backend if isinstance(backend, str) else "given"
        self._backend: Backend | None = None if isinstance(backend, str) else backend
        self._identity: Identity | None = None
        self._exporter = Exporter()
        self.layout = CaptureLayout(self._save_root, socket.gethostname(), os.getpid())
        self.job_id = self.config.job_id or default_job_id()
        self.scheduler = Scheduler(self, warmup_steps=self.config.warmup_steps)
        self.agent: Any = None
        self._agent_settles = False  # the agent agrees the job with the other ranks once torch.distributed is up
        self._at_exit = False  # close() runs at interpreter exit (close_at_exit)
        self.training_thread = threading.get_ident()  # where step() is called: the agent watches its rendezvous
        self.signal_trigger: Any = None
        self._auto: Any = None  # --profile-auto: the idle step also times itself (rank/autocapture.py)
        if self.config.auto_ratio and self.config.ondemand:
            from .autocapture import AutoCapture

            self._auto = AutoCapture(self)

        if self.config.enabled or self.config.ondemand:
            problem = writable_problem(self._save_root)
            if problem:
                raise ConfigError(f"invalid --profile-save-path {config.save_path!r}: {problem}")
            self._secure_save_root()
        self.layout.remove_stale_staging()
        if self.config.enabled:
            self._queue_static()
        self._boundary()
        if start_agent and self.config.ondemand:
            self._start_agent()
        if self._auto is not None:
            if self.agent is not None:
                self._auto.attach(self.agent)
        if self.config.auto_ratio and self._auto is None:
            log.warning("ondemand_prof: --profile-auto needs on-demand listening (--profile-ondemand); it is off")
        if self.config.signal:
            from .signals import SignalTrigger

            self.signal_trigger = SignalTrigger(self, self.config.signal)
            self.signal_trigger.install()

    def _secure_save_root(self) -> None:
        """Traces go only where nobody else controls the way to them (docs/security.md)."""
        root, why = safe_save_root(self._save_root, dir_mode(self.config.file_mode))
        if why:
            log.warning("%s", why)
            self.config = self.config.replace(save_path=str(root))
            self._save_root = root
            self.layout = CaptureLayout(root, self.layout.host, self.layout.pid)

    def _queue_static(self) -> None:
        config = self.config
        end = None if config.step_end == -1 else config.step_end
        request = CaptureRequest(steps=None if end is None else end - config.step_start, start_step=config.step_start)
        static = resolve(request, WindowDefaults.from_config(config), config.step_start, source="static",
                         capture_id=make_capture_id("static", self.job_id, config.step_start, config.step_end),
                         extra={"start_step": config.step_start, "end_step": config.step_end}, configured=True)
        self.scheduler.submit(static)
        if end is None:
            log.warning("ondemand_prof: static window from step %d has no end (--profile-step-end -1): it "
                        "records until close()", config.step_start)

    # ------------------------------------------------------------------------------------------------------
    # Construction helpers

    @classmethod
    def from_args(cls, args: argparse.Namespace, parser: argparse.ArgumentParser | None = None,
                  **kwargs: Any) -> "OnDemandProfiler":
        """From add_profile_args flags; with `parser`, bad values end the program as argparse errors do."""
        return cls(config_from_args(args, parser), **kwargs)

    @classmethod
    def from_config(cls, data: Mapping[str, Any] | str | os.PathLike[str], **kwargs: Any) -> "OnDemandProfiler":
        return cls(config_from_mapping(data), **kwargs)

    @classmethod
    def from_env(cls, **kwargs: Any) -> "OnDemandProfiler":
        return cls(config_from_env(), **kwargs)

    def __enter__(self) -> "OnDemandProfiler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------------
    # The hot path

    def step(self, step: int | None = None) -> None:
        """End of a training step. `step`, when given (`prof.step(n)` or `prof.step(step=n)`), is the number of
        the step that just ended.

        While nothing is scheduled, an instance attribute `step` (a small function around a C-level counter)
        shadows this method, with the same signature; lowering `_wake` and removing that attribute brings this
        method back.
        """
        if self._counter is not None:
            self._leave_idle()
        if step is None:
            self._step += 1
        else:
            self._step = step + 1
        if self._step >= self._wake:
            self._boundary()

    @property
    def current_step(self) -> int:
        """The step now running (the next one to end). Safe to read from any thread."""
        counter = self._counter
        if counter is not None:
            return _counter_value(counter) - 1
        return self._step

    def _enter_idle(self) -> None:
        # Nothing is due: count steps with a range iterator's C __next__ (its position is readable through
        # length_hint). next(counter, n) also accepts the loop's own number (prof.step(n)), which is then ignored
        # until a window is pending. See docs/benchmarks.md, "Idle cost".
        self._counter = iter(range(self._step + 1, _COUNTER_END))
        self.step = (  # type: ignore[method-assign]  # on purpose: the instance's step is the idle fast path
            _idle_step(self._counter) if self._auto is None else self._auto.idle_step(self._counter))
        if self._inbox:  # a request arrived meanwhile: take the checked path at the next step
            self._wake_up()

    def _leave_idle(self) -> None:
        # _step before _counter: the agent thread reads current_step at any moment, and must never see the
        # stale _step of when idling began (its step clock would take that for the loop going backwards)
        counter = self._counter
        assert counter is not None
        self._step = _counter_value(counter) - 1
        self._counter = None
        self.__dict__.pop("step", None)

    def _wake_up(self) -> None:
        """Make the next step() call take the boundary path (any thread; atomic under the GIL)."""
        self._wake = 0
        self.__dict__.pop("step", None)

    # ------------------------------------------------------------------------------------------------------
    # Requests from other threads (agent, triggers, signal handler)

    def call_at_next_step(self, fn: Callable[[int], None]) -> None:
        """Run fn(step) on the training thread at the next step boundary (thread-safe, never blocks long)."""
        self._inbox.append(fn)
        self._wake_up()

    def submit(self, window: Window, listener: Listener | None = None) -> tuple[bool, str]:
        """Queue a window (on the training thread, usually through call_at_next_step)."""
        ok, reason, _ = self.place(window, listener)
        return ok, reason

    def place(self, window: Window, listener: Listener | None = None) -> tuple[bool, str, Window | None]:
        """submit(), and the window that holds the profiler where it is refused as busy (rank/scheduler.py)."""
        ok, reason, busy = self.scheduler.place(window, listener, self._step)
        if ok:
            self._wake_up()
        return ok, reason, busy

    def cancel(self, capture_id: str, step: int) -> bool:
        """Stop a queued or running window (training thread): what was recorded is written, marked cancelled."""
        return self.scheduler.cancel(capture_id, step)

    @property
    def active_window(self) -> Window | None:
        active = self.scheduler.active
        return active.window if active else None

    @property
    def state(self) -> str:
        """What the profiler is doing, for heartbeats: idle, scheduled, warmup, recording, disabled, closed; or
        rendezvous while the training thread is in init_process_group before its first step (rank/agent.py)."""
        state = self.scheduler.state
        if state == "idle" and self.agent is not None and self.agent.rendezvous_since is not None:
            return "rendezvous"
        return state

    # ------------------------------------------------------------------------------------------------------
    # Step boundaries (training thread)

    def _boundary(self) -> None:
        step = self._step
        self._drain_inbox(step)
        self._wake = self.scheduler.boundary(step)
        if self._inbox:  # another thread lowered _wake while we computed it: keep its request
            self._wake = 0
        elif self._wake == IDLE and not self.scheduler.closed:
            self._enter_idle()

    def _drain_inbox(self, step: int) -> None:
        while self._inbox:
            fn = self._inbox.popleft()
            try:
                fn(step)
            except Exception:  # noqa: BLE001 - a bad request must not stop the others
                log.exception("ondemand_prof: handling a request failed")

    # ------------------------------------------------------------------------------------------------------
    # The scheduler's Driver: sessions, exports, facts about this rank

    def open(self, window: Window) -> tuple[Session, Any]:
        ident = self.identity()
        backend = self.backend()
        out = self.layout.plan(window.capture_id, ident.rank, _dt.datetime.now())
        make_dirs(out.folder, dir_mode(self.config.file_mode))  # whatever the umask
        session = ClockedSession(backend.open(window, ident, out.staging))  # the thread's CPU, step by step
        return session, {"out": out, "began_at": iso_time()}

    def collect(self, active: Active) -> Any:
        t0 = time.monotonic()
        export = active.session.finish()
        active.context["collect_s"] = time.monotonic() - t0
        return export

    def export(self, active: Active, steps: list[int], export: Any) -> None:
        collect_s = active.context.get("collect_s", 0.0)
        out = active.context["out"]
        job = ExportJob(
            export=export, window=active.window, identity=self.identity(), out=out, recorded_steps=steps,
            gzip=self.config.gzip, metadata=self._metadata(active, steps, collect_s, export.info),
            file_mode=self.config.file_mode,
            on_done=lambda result: self._on_published(active, result),
        )
        self._exporter.submit(job)

    def static_selected(self) -> bool:
        ident = self.identity()
        if not self.config.selects_rank(ident.rank):
            log.debug("ondemand_prof: rank %d not in --profile-ranks %s", ident.rank, self.config.ranks)
            return False
        return True

    def who(self) -> str:
        return f"rank {self.identity().rank}"

    def disk_problem(self) -> str | None:
        return disk_problem(self._save_root, self.config.min_free_mb)

    def _on_published(self, active: Active, result: dict[str, Any]) -> None:
        event = "done" if result.get("status") in ("ok", "partial") else "failed"
        if result.get("path"):  # logged, and said on stderr too when logging would not show it
            from .announce import say, written_line

            say(logging.getLogger("ondemand_prof.rank.output"), self.config.quiet, written_line(self.identity(), result))
        tell(active.listener, event, active.window, path=result.get("path"), trace=trace_path(result),
             status=result.get("status"), error=result.get("error"), steps=result.get("steps_in_trace"),
             cancelled=active.cancelled or None)

    def _metadata(self, active: Active, steps: list[int], collect_s: float, info: dict[str, Any]) -> dict[str, Any]:
        window = active.window
        backend = self.backend()
        return {
            "schema_version": 1,
            "tool": {"name": "ondemand_prof", "version": __version__},
            **self.identity().as_dict(),
            "capture_id": window.capture_id,
            "save_path": self.config.save_path,  # absolute: a relative one was resolved when the profiler was made
            "trigger": {"source": window.source, "request": dict(window.requested)},
            "window": {"start": window.start, "end": window.end, "recorded_steps": steps, "late_by": active.late_by,
                       "warmup_steps": self.config.warmup_steps, "note": window.note or None,
                       "cancelled": active.cancelled},
            "options": _recorded_options(window.options.as_dict(), info),
            "backend": {"name": backend.name, **backend.versions(), **info},
            "timings": {"window_began_at": active.context["began_at"], "window_ended_at": iso_time(),
                        "collect_s": round(collect_s, 4)},
            "cpu_by_step": active.session.clock.per_step(steps) if isinstance(active.session, ClockedSession)
            else None,
        }

    # ------------------------------------------------------------------------------------------------------
    # Identity and backend (lazy: torch.distributed may be initialised after the profiler is created)

    def identity(self) -> Identity:
        """Who this rank is: final once torch.distributed is up (see settle_identity); until then re-read
        from the launcher's environment at each call."""
        if self._identity is not None:
            return self._identity
        rank, world, dist_up = _rank_and_world()
        if dist_up and not self._agent_settles:
            # no agent to agree a job id with the other ranks: take the launcher's, complete by now
            return self.settle_identity(self.config.job_id or default_job_id())
        return Identity(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                        host=socket.gethostname(), pid=os.getpid(), job_id=self.job_id, dist_initialized=dist_up)

    def settle_identity(self, job_id: str) -> Identity:
        """Fix rank, world size and job (torch.distributed is up; `job_id` is the one the ranks agreed)."""
        self.job_id = job_id
        rank, world, dist_up = _rank_and_world()
        self._identity = Identity(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                                  host=socket.gethostname(), pid=os.getpid(), job_id=job_id,
                                  dist_initialized=dist_up)
        return self._identity

    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = select_backend(self._backend_name)
        return self._backend

    # ------------------------------------------------------------------------------------------------------

    def _start_agent(self) -> None:
        from .agent import Agent

        self._agent_settles = True
        try:
            self.agent = Agent(self)
            self.agent.start()
        except Exception as exc:  # noqa: BLE001 - no trigger listening is not a reason to stop training
            log.error("ondemand_prof: on-demand listening disabled: %s", exc)
            self.agent = None
            self._agent_settles = False
            return
        atexit.register(_last_words_at_exit, weakref.ref(self))

    def close_at_exit(self) -> bool:
        """close(), registered with atexit (zero-code): a window it fails says what ended the program."""
        self._at_exit = True
        return self.close()

    def ending_why(self, at_exit: bool = False) -> str:
        """Why training ends, in the words a failed window gives (rank/terminate.exit_reason)."""
        from .terminate import exit_reason

        return exit_reason(at_exit)

    def close(self, timeout: float | None = None) -> bool:
        """Finish any open window, stop listening and wait (bounded) for pending exports. Never raises."""
        if self.scheduler.closed:
            return True
        if self._counter is not None:
            self._leave_idle()
        self._drain_inbox(self._step)
        why = self.ending_why(at_exit=self._at_exit)
        self.scheduler.close(self._step, why)
        if self.agent is not None:
            self.agent.closing_why = "closed the profiler" + (f" ({why})" if why else "")
        self._wake = IDLE
        if self.signal_trigger is not None:
            self.signal_trigger.uninstall()
        limit = self.config.export_timeout_s if timeout is None else timeout
        done = self._exporter.wait(limit)
        if not done:
            log.error("ondemand_prof: %d export(s) still running after %.0f s; giving up waiting",
                      self._exporter.pending(), limit)
        if self.agent is not None:  # after the exports, so their results still reach status files and the daemon
            try:
                self.agent.stop()
            except Exception:  # noqa: BLE001
                log.debug("agent stop failed", exc_info=True)
        return done


def _recorded_options(options: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """The window's options as recorded: with_cpu says whether CPU activity was recorded, which torch always does
    (the option adds it on NPU only); it read with_cpu=False on every CPU capture."""
    activities = (info.get("torch_profile_kwargs") or {}).get("activities") or ()
    return {**options, "with_cpu": True} if "CPU" in activities else options


def _last_words_at_exit(ref: "weakref.ReferenceType[OnDemandProfiler]") -> None:
    """At interpreter exit, for a profiler never closed: tell the daemon the process is ending and why (normally,
    or after the exception that ended it), so its windows do not read as a rank that vanished."""
    prof = ref()
    if prof is None or prof.scheduler.closed or prof.agent is None or prof.layout.pid != os.getpid():
        return  # (a forked child that exits through Python has the rank's profiler, not its agent)
    try:
        why = prof.ending_why(at_exit=True)
        prof.agent.ending("exited " + (why if why.startswith("after") else f"({why})" if why else
                                                   "normally, without closing the profiler"))
    except Exception:  # noqa: BLE001 - nothing of ours delays or breaks an exit
        log.debug("last words at exit failed", exc_info=True)


def _idle_step(counter: Any) -> Callable[..., None]:
    """The idle step(): one C call counts it. The loop's own number (`step(n)`, `step(step=n)`) is not read
    while idle; it takes keywords like the method, so no call fails only when a window happens to be pending."""
    nxt = next

    def step(step: int | None = None) -> None:
        nxt(counter)

    return step


def _counter_value(counter: Any) -> int:
    """The value the idle counter's next __next__ returns (a range iterator's remaining length, PEP 424)."""
    return _COUNTER_END - operator.length_hint(counter)


def _rank_and_world() -> tuple[int, int, bool]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), True
    except Exception:  # noqa: BLE001 - fall back to the launcher's environment
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), False
