"""OnDemandProfiler: the hook inside each training rank.

Threads: the training thread calls step(); with no window due, that is an integer add and one attribute
compare. Everything that needs attention at a step boundary (a window to begin, advance or finish, a request
handed over by the agent thread) is signalled by lowering `_wake`, so the idle path never takes a lock.
The profiler is started and stopped on the training thread only; files are written by the Exporter thread.
Nothing raised by the profiler, the disk or a trigger reaches the training loop.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as _dt
import functools
import itertools
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from . import __version__
from .backends import Backend, Identity, Session, select_backend
from .config import ConfigError, ProfileConfig, config_from_args, config_from_env, config_from_mapping, \
    default_job_id
from .output import ExportJob, Exporter, capture_dir_name, disk_problem, iso_time, remove_stale_staging, \
    staging_path, writable_problem
from .window import Phase, Window, WindowOptions, plan_begin, recorded_steps

log = logging.getLogger("ondemand_prof")

IDLE = sys.maxsize
MAX_CONSECUTIVE_FAILURES = 3

# A listener hears what happens to one window: ("scheduled"|"recording"|"writing"|"done"|"failed"|
# "rejected"|"skipped", info). Used by the trigger status files and the daemon agent.
Listener = Callable[[str, dict[str, Any]], None]


@dataclass
class _Active:
    window: Window
    session: Session
    final_name: str
    state: str  # "warmup" | "recording"
    began_at: str
    first_step: int = -1
    late_by: int = 0
    moved_by: int = 0  # an on-demand window that arrived after its end was moved this many steps
    listener: Listener | None = None
    t_begin: float = field(default_factory=time.monotonic)


@dataclass
class _Queued:
    window: Window
    listener: Listener | None = None
    late_by: int = 0  # steps the window was moved because it arrived after its end


class OnDemandProfiler:
    """Profile static windows from the configuration and on-demand windows from triggers.

    Call step() once at the end of every training step. Steps are numbered from `first_step` (0 by
    default: the first step after construction is step 0). A loop with its own counter (resumed or 1-based
    runs) passes `first_step=` and may call step(n) with the number of the step that just ended.
    """

    def __init__(self, config: ProfileConfig | None = None, *, first_step: int = 0, backend: str | Backend = "auto",
                 start_agent: bool = True) -> None:
        self.config = config or ProfileConfig()
        self._step = first_step
        self._wake = IDLE
        self._counter: itertools.count | None = None
        self._closed = False
        self._disabled = False
        self._failures = 0
        self._queue: list[_Queued] = []  # touched on the training thread only
        # work other threads (agent, signal handler) hand to the training thread; deque.append/popleft are
        # atomic, so no lock is needed, and a signal handler may append safely
        self._inbox: collections.deque[Callable[[int], None]] = collections.deque()
        self._active: _Active | None = None
        self._backend_name = backend if isinstance(backend, str) else "given"
        self._backend: Backend | None = None if isinstance(backend, str) else backend
        self._identity: Identity | None = None
        self._exporter = Exporter()
        self._save_root = Path(self.config.save_path).expanduser()
        self.job_id = self.config.job_id or default_job_id()
        self.agent: Any = None
        self.signal_trigger: Any = None

        if self.config.enabled or self.config.ondemand:
            problem = writable_problem(self._save_root)
            if problem:
                raise ConfigError(f"invalid --profile-save-path {self.config.save_path!r}: {problem}")
        remove_stale_staging(self._save_root, socket.gethostname())
        if self.config.enabled:
            end = None if self.config.step_end == -1 else self.config.step_end
            static = Window(self.config.step_start, end, WindowOptions.from_config(self.config), source="static",
                            capture_id=f"static-{self.config.step_start}-{self.config.step_end}",
                            requested={"start_step": self.config.step_start, "end_step": self.config.step_end})
            self._queue.append(_Queued(static))
            if end is None:
                log.warning("ondemand_prof: static window from step %d has no end (--profile-step-end -1): it "
                            "records until close()", self.config.step_start)
        self._boundary()
        if start_agent and self.config.ondemand:
            self._start_agent()
        if self.config.signal:
            from .signals import SignalTrigger, parse_signal

            self.signal_trigger = SignalTrigger(self, parse_signal(self.config.signal))
            self.signal_trigger.install()

    # ------------------------------------------------------------------------------------------------------
    # Construction helpers

    @classmethod
    def from_args(cls, args: argparse.Namespace, **kwargs: Any) -> "OnDemandProfiler":
        return cls(config_from_args(args), **kwargs)

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
        """End of a training step. `step`, when given, is the number of the step that just ended.

        While nothing is scheduled, an instance attribute `step` (a C-level counter, no Python frame)
        shadows this method; lowering `_wake` and removing that attribute brings this method back.
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
        # Nothing is due: count steps with itertools.count's C __next__ (next(counter, n) also accepts the
        # loop's own number, which is then ignored until a window is pending). See README "Idle cost".
        self._counter = itertools.count(self._step + 1)
        self.step = functools.partial(next, self._counter)  # type: ignore[method-assign]
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
        """Queue a window (called on the training thread, usually through call_at_next_step).

        Returns (accepted, reason). A window that overlaps the running window or one already queued from
        a trigger is refused as busy; a static window it overlaps is skipped when its time comes.
        """
        if self._disabled or self._closed:
            return False, "profiler disabled" if self._disabled else "profiler closed"
        blocking = self._blocking_window(window)
        if blocking is not None:
            return False, f"busy: window {blocking.describe()} ({blocking.source}, {blocking.capture_id}) " \
                          f"holds the profiler"
        self._queue.append(_Queued(window, listener))
        self._queue.sort(key=lambda q: q.window.start)
        self._wake_up()
        return True, "scheduled"

    def _blocking_window(self, window: Window) -> Window | None:
        if self._active and self._active.window.overlaps(window.start, window.end):
            return self._active.window
        for q in self._queue:
            if q.window.source != "static" and q.window.overlaps(window.start, window.end):
                return q.window
        return None

    @property
    def active_window(self) -> Window | None:
        return self._active.window if self._active else None

    @property
    def queued_windows(self) -> list[Window]:
        return [q.window for q in self._queue]

    @property
    def state(self) -> str:
        """What the profiler is doing, for heartbeats: idle, scheduled, warmup, recording, disabled, closed."""
        if self._closed or self._disabled:
            return "closed" if self._closed else "disabled"
        active = self._active
        if active is not None:
            return active.state
        return "scheduled" if any(q.window.source != "static" for q in list(self._queue)) else "idle"

    # ------------------------------------------------------------------------------------------------------
    # Step boundaries (training thread)

    def _boundary(self) -> None:
        if self._disabled:
            # requests still get their answer ("profiler disabled") instead of keeping us off the idle path
            self._drain_inbox(self._step)
            self._wake = IDLE
            self._enter_idle()
            return
        step = self._step
        try:
            self._drain_inbox(step)
            if self._active is not None:
                self._advance(step)
            if self._active is None:
                self._maybe_begin(step)
            else:
                self._skip_due_static(step)
        except Exception as exc:  # noqa: BLE001 - training never notices the profiler failing
            self._on_failure(exc)
        self._wake = self._next_wake(step)
        if self._inbox:  # the agent may have lowered _wake while we computed it: keep its request
            self._wake = 0
        elif self._wake == IDLE and not self._closed:
            self._enter_idle()

    def _drain_inbox(self, step: int) -> None:
        while self._inbox:
            fn = self._inbox.popleft()
            try:
                fn(step)
            except Exception:  # noqa: BLE001 - a bad request must not stop the others
                log.exception("ondemand_prof: handling a request failed")

    def _next_wake(self, step: int) -> int:
        if self._disabled or self._closed:
            return IDLE
        if self._inbox:
            return 0
        if self._active is not None:
            return step + 1
        if not self._queue:
            return IDLE
        return plan_begin(self._queue[0].window, step, self._warmup()).wake

    def _warmup(self) -> int:
        return self.config.warmup_steps

    def _maybe_begin(self, step: int) -> None:
        while self._queue:
            queued = self._queue[0]
            window = queued.window
            plan = plan_begin(window, step, self._warmup())
            if plan.phase is Phase.WAIT:
                return
            self._queue.pop(0)
            if plan.phase is Phase.MISSED:
                if window.source == "static" or window.end is None:
                    log.warning("ondemand_prof: window %s missed: already at step %d", window.describe(), step)
                    continue
                # an on-demand window that arrived too late still records its length, from now, and says so
                late = dataclasses.replace(window, start=step, end=step + (window.end - window.start))
                queued = _Queued(late, queued.listener, late_by=step - window.start)
                window, plan = late, plan_begin(late, step, self._warmup())
            ident = self.identity()
            if window.source == "static":
                if not self.config.selects_rank(ident.rank):
                    log.debug("ondemand_prof: rank %d not in --profile-ranks %s", ident.rank, self.config.ranks)
                    continue
                other = next((q.window for q in self._queue if q.window.overlaps(window.start, window.end)), None)
                if other is not None:
                    log.info("ondemand_prof: static window %s skipped: on-demand window %s (%s) holds the "
                             "profiler", window.describe(), other.describe(), other.capture_id)
                    continue
            problem = disk_problem(self._save_root, self.config.min_free_mb)
            if problem:
                log.error("ondemand_prof: skipping window %s on rank %d: %s", window.describe(), ident.rank, problem)
                self._tell(queued.listener, "failed", window, error=f"disk: {problem}")
                continue
            self._begin(queued, step, plan.phase)
            return

    def _skip_due_static(self, step: int) -> None:
        """A static window whose time comes while another window holds the profiler is skipped, loudly."""
        assert self._active is not None
        holder = self._active.window
        for queued in [q for q in self._queue if q.window.source == "static"]:
            if plan_begin(queued.window, step, self._warmup()).phase is Phase.WAIT:
                continue
            self._queue.remove(queued)
            log.info("ondemand_prof: static window %s skipped: %s window %s (%s) holds the profiler",
                     queued.window.describe(), "on-demand" if holder.source != "static" else "static",
                     holder.describe(), holder.capture_id)

    def _begin(self, queued: _Queued, step: int, phase: Phase) -> None:
        window = queued.window
        ident = self.identity()
        backend = self.backend()
        final_name = capture_dir_name(ident.host, ident.pid, _dt.datetime.now())
        staging = staging_path(self._save_root, final_name)
        self._save_root.mkdir(parents=True, exist_ok=True)
        session = backend.open(window, ident, staging)
        active = _Active(window, session, final_name, "warmup", iso_time(), listener=queued.listener,
                         moved_by=queued.late_by)
        self._active = active
        self._tell(active.listener, "started", window, step=step,
                   phase="warmup" if phase is Phase.WARMUP else "recording")
        if phase is Phase.WARMUP:
            session.warmup(step)
        else:
            self._start_recording(active, step)

    def _start_recording(self, active: _Active, step: int) -> None:
        active.session.record(step)
        active.state = "recording"
        active.first_step = step
        active.late_by = max(0, step - active.window.start) + active.moved_by
        if active.late_by:
            log.warning("ondemand_prof: window %s began %d step(s) late, at step %d", active.window.describe(),
                        active.late_by, step)
        self._tell(active.listener, "recording", active.window, step=step, late_by=active.late_by)

    def _advance(self, step: int) -> None:
        active = self._active
        assert active is not None
        window = active.window
        if window.end is not None and step >= window.end:
            self._finish(step)
        elif active.state == "warmup":
            if step >= window.start:
                self._start_recording(active, step)
        else:
            active.session.record(step)

    def _finish(self, step: int) -> None:
        active = self._active
        assert active is not None
        self._active = None
        if active.state == "warmup":
            active.session.abort()
            return
        t0 = time.monotonic()
        export = active.session.finish()  # collection: must stay on this thread
        collect_s = time.monotonic() - t0
        steps = recorded_steps(active.window, active.first_step, step)
        self._tell(active.listener, "writing", active.window, steps=steps)
        job = ExportJob(
            export=export, window=active.window, identity=self.identity(), save_root=self._save_root,
            final_name=active.final_name, recorded_steps=steps, gzip=self.config.gzip,
            metadata=self._metadata(active, steps, collect_s, export.info),
            on_done=lambda result, a=active: self._on_published(a, result),
        )
        self._exporter.submit(job)
        self._failures = 0

    def _on_published(self, active: _Active, result: dict[str, Any]) -> None:
        event = "done" if result.get("status") in ("ok", "partial") else "failed"
        self._tell(active.listener, event, active.window, path=result.get("path"), status=result.get("status"),
                   error=result.get("error"), steps=result.get("steps_in_trace"))

    def _metadata(self, active: _Active, steps: list[int], collect_s: float, info: dict[str, Any]) -> dict[str, Any]:
        window = active.window
        ident = self.identity()
        backend = self.backend()
        return {
            "schema_version": 1,
            "tool": {"name": "ondemand_prof", "version": __version__},
            **ident.as_dict(),
            "capture_id": window.capture_id,
            "trigger": {"source": window.source, "request": dict(window.requested)},
            "window": {"start": window.start, "end": window.end, "recorded_steps": steps, "late_by": active.late_by,
                       "warmup_steps": self.config.warmup_steps},
            "options": window.options.as_dict(),
            "backend": {"name": backend.name, **backend.versions(), **info},
            "timings": {"window_began_at": active.began_at, "window_ended_at": iso_time(),
                        "collect_s": round(collect_s, 4)},
        }

    def _on_failure(self, exc: BaseException) -> None:
        self._failures += 1
        active, self._active = self._active, None
        if active is not None:
            active.session.abort()
            self._tell(active.listener, "failed", active.window, error=f"{type(exc).__name__}: {exc}")
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._disabled = True
            log.error("ondemand_prof: disabled after %d consecutive failures; training continues unprofiled. "
                      "Last error: %s: %s", self._failures, type(exc).__name__, exc)
        else:
            log.error("ondemand_prof: profiling window failed (training continues): %s: %s", type(exc).__name__,
                      exc, exc_info=exc)

    @staticmethod
    def _tell(listener: Listener | None, event: str, window: Window, **info: Any) -> None:
        if listener is None:
            return
        try:
            listener(event, {"capture_id": window.capture_id, "window": [window.start, window.end], **info})
        except Exception:  # noqa: BLE001 - feedback is best effort
            log.debug("ondemand_prof: listener failed", exc_info=True)

    # ------------------------------------------------------------------------------------------------------
    # Identity and backend (lazy: torch.distributed may be initialised after the profiler is created)

    def identity(self) -> Identity:
        if self._identity is not None:
            return self._identity
        rank, world, dist_up = _rank_and_world()
        ident = Identity(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                         host=socket.gethostname(), pid=os.getpid(), job_id=self.job_id, dist_initialized=dist_up)
        if dist_up or "RANK" in os.environ:
            self._identity = ident  # final; before that, re-check next time
        return ident

    def backend(self) -> Backend:
        if self._backend is None:
            self._backend = select_backend(self._backend_name)
        return self._backend

    # ------------------------------------------------------------------------------------------------------

    def _start_agent(self) -> None:
        try:
            from .agent import Agent
        except ImportError:  # the on-demand side is optional at this layer
            return
        try:
            self.agent = Agent(self)
            self.agent.start()
        except Exception as exc:  # noqa: BLE001 - no trigger listening is not a reason to stop training
            log.error("ondemand_prof: on-demand listening disabled: %s", exc)
            self.agent = None

    def close(self, timeout: float | None = None) -> bool:
        """Finish any open window, stop listening and wait (bounded) for pending exports. Never raises."""
        if self._closed:
            return True
        if self._counter is not None:
            self._leave_idle()
        try:
            self._drain_inbox(self._step)
            if self._active is not None:
                self._finish(self._step)
        except Exception as exc:  # noqa: BLE001
            self._on_failure(exc)
        self._closed = True
        self._wake = IDLE
        for queued in self._queue:
            if queued.window.source != "static":
                self._tell(queued.listener, "failed", queued.window, error="training ended before the window")
        self._queue.clear()
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


def _counter_value(counter: itertools.count) -> int:
    return int(repr(counter)[6:-1])  # "count(N)": the value the next __next__ returns


def _rank_and_world() -> tuple[int, int, bool]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size(), True
    except Exception:  # noqa: BLE001 - fall back to the launcher's environment
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), False
