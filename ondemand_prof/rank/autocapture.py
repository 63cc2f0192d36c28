"""Captures on condition (--profile-auto RATIO): a rank compares each step's time with its rolling median; when
--profile-auto-steps consecutive steps are RATIO times slower, it opens a window on itself (source "auto", the
reason in its metadata) and asks the daemon for the same window on a median-speed reference rank of its job.
A cooldown and an hourly budget bound how many captures a slow phase can start.

A baseline first (--profile-baseline-at): one window of the healthy job, what the automatic captures are compared
with (ondemandctl show/report AUTO print the comparison; the daemon logs its cause line). By default it is taken
once step times are steady after warm-up: at least BASELINE_WARMUP steps in, the slowest tenth of the last
HISTORY steps within STEADY_SPREAD times the fastest tenth (checked as the median is, every EVERY steps); STEP
takes it at that step (or as soon as it can after it); -1 takes none. With a daemon, the rank with local rank 0
asks it, and the daemon records the same window on every rank of the job on its host (the job's baseline there);
without one, each rank takes its own.

Threads: SlowStepMonitor's step function runs on the training thread as the idle step() (a small Python
function around the C counter instead of the counter alone: about 0.3 us more per step, bench/bench_hook.py);
deciding, planning and scheduling happen on the agent thread (AutoCapture.poll). Off (the default), nothing
here is loaded and step() is the C counter.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from ..core.requests import CaptureRequest, WindowDefaults, resolve
from ..core.ids import capture_id as make_capture_id, id_stamp
from ..core.protocol import encode
from ..core.window import Window
from .extension import Extension

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger("ondemand_prof.rank.autocapture")

HISTORY = 64  # (a power of two) step times the rolling median is taken over
EVERY = 16  # the median is recomputed every this many steps (sorting 64 floats each step would cost ~2 us)
MIN_SAMPLES = 16  # no judgement before this many steps


BASELINE_WARMUP = 64  # steps before a baseline may be called steady (compilation, caches, the first allocations)
STEADY_SPREAD = 1.25  # the slowest tenth of the last HISTORY steps within this many times the fastest tenth
MIN_EXTRA_S = 0.001  # a step must also be this much longer than the median to count as slow (sub-ms jitter
                     # of a tiny loop, a GIL hand-over to another thread, is not a slowdown)


class SlowStepMonitor:
    """Training thread. step_fn(counter) is the idle step(): the C counter, then this step's time against the
    rolling median; fire(slow_times, median) when `steps` consecutive steps took more than `ratio` times the
    median. The per-step state lives in the closure's cells (cheaper than attributes); the rare path (a slow
    step, a recovery, every EVERY-th step's median update) is a second function. See bench/bench_hook.py."""

    def __init__(self, ratio: float, steps: int, fire: Callable[[list[float], float], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.ratio, self.steps, self.fire, self.clock = ratio, steps, fire, clock
        self.durations = [0.0] * HISTORY  # a ring, written at n % HISTORY; kept across windows
        self.n = 0  # intervals seen (synchronised from the closure on the rare path)
        self.median: float | None = None
        self.threshold = float("inf")  # no judgement until a median exists
        self.on_median: Callable[[int, list[float]], None] | None = None  # (steps seen, sorted durations)


    def _update_median(self, n: int) -> None:
        ordered = sorted(self.durations[:n] if n < HISTORY else self.durations)
        self.median = median = ordered[len(ordered) // 2]
        self.threshold = max(self.ratio * median, median + MIN_EXTRA_S)
        if self.on_median is not None:
            self.on_median(n, ordered)

    def step_fn(self, counter: Any) -> Callable[..., Any]:
        """A fresh idle step() (after a window the first interval is not a step: the clock starts again)."""
        nxt, perf, durations, mask = next, self.clock, self.durations, HISTORY - 1
        me = self
        last: float | None = None
        n = self.n
        threshold = self.threshold
        slow: list[float] = []

        def rare(dt: float) -> None:
            nonlocal n, threshold, slow
            if dt > threshold:
                slow.append(dt)
                if len(slow) >= me.steps:
                    fired, slow = slow, []
                    me.fire(fired, me.median or 0.0)
            elif slow:
                slow = []
            durations[n & mask] = dt
            n += 1
            me.n = n
            if not n % EVERY and n >= MIN_SAMPLES:
                me._update_median(n)
                threshold = me.threshold

        def step(step: Any = None) -> None:  # the method's signature: step(n) and step(step=n)
            nonlocal last, n
            nxt(counter)
            now = perf()
            if last is not None:
                dt = now - last
                if dt > threshold or slow or not (n + 1) % EVERY:
                    rare(dt)
                else:
                    durations[n & mask] = dt
                    n += 1
            last = now

        return step


class AutoCapture(Extension):
    """The policy (cooldown, hourly budget) and the window, on the agent thread."""

    def __init__(self, prof: Any, clock: Callable[[], float] = time.monotonic) -> None:
        config = prof.config
        self.prof = prof
        self.ratio, self.steps = float(config.auto_ratio), int(config.auto_steps)
        self.cooldown_s, self.per_hour = float(config.auto_cooldown_s), int(config.auto_per_hour)
        self.monitor = SlowStepMonitor(self.ratio, self.steps, self._fired)
        self.clock = clock
        self.agent: Agent | None = None
        # bounded: without an agent to drain it (start_agent=False), slowdowns are dropped, not hoarded
        self._fired_q: collections.deque[tuple[list[float], float, int]] = collections.deque(maxlen=16)
        self.started: list[float] = []  # when automatic captures started (the budget's hour)
        self.held = 0  # slowdowns not captured because of the cooldown or the budget
        self.baseline_at = int(getattr(config, "auto_baseline_at", 0))
        self.baseline_id: str | None = None  # the baseline this rank took or asked for
        self._baseline_due: tuple[int, float] | None = None  # (step, median) once it is time (training thread)
        if self.baseline_at != -1:
            self.monitor.on_median = self._baseline_check
        # True while a window of ours is still being written: its helpers share the cores, and steps they slow
        # are not the job slowing down (a baseline's own export opened an automatic capture of itself)
        exporter = getattr(prof, "_exporter", None)  # the hook's
        self.busy: Callable[[], bool] = (lambda: exporter.pending() > 0) if exporter is not None else (lambda: False)

    def idle_step(self, counter: Any) -> Callable[..., Any]:
        return self.monitor.step_fn(counter)

    def attach(self, agent: Agent) -> None:
        self.agent = agent
        agent.extensions.append(self)
        log.info("ondemand_prof: automatic captures when %d consecutive steps are %gx slower than the rolling "
                 "median (cooldown %g s, at most %d per hour), compared with a baseline %s", self.steps, self.ratio,
                 self.cooldown_s, self.per_hour, self.baseline_text())

    def startup_note(self) -> str:
        return (f"automatic captures when {self.steps} steps in a row are {self.ratio:g}x the median, compared with "
                f"a baseline {self.baseline_text()}")

    def baseline_text(self) -> str:
        """When the baseline is taken, as the start-up line says it."""
        if self.baseline_at == -1:
            return "none (--profile-baseline-at -1)"
        if self.baseline_at > 0:
            return f"at step {self.baseline_at} (--profile-baseline-at)"
        return (f"once step times are steady after {BASELINE_WARMUP} steps (the slowest tenth within "
                f"{STEADY_SPREAD:g}x the fastest; --profile-baseline-at STEP to choose)")

    def _baseline_check(self, n: int, ordered: list[float]) -> None:  # training thread, every EVERY steps
        if self._baseline_due is not None or self.baseline_id is not None:
            return
        step = self.prof.current_step
        if self.baseline_at > 0:
            due = step + 2 * EVERY >= self.baseline_at  # scheduled at baseline_at, ahead of time
        else:
            due = n >= BASELINE_WARMUP and len(ordered) >= HISTORY and \
                ordered[HISTORY * 9 // 10] <= STEADY_SPREAD * ordered[HISTORY // 10]
        if due:
            self._baseline_due = (step, ordered[len(ordered) // 2])
            if self.agent is not None:
                self.agent.wake()

    def _fired(self, slow: list[float], median: float) -> None:  # training thread: hand over, nothing more
        self._fired_q.append((slow, median, self.prof.current_step))
        if self.agent is not None:
            self.agent.wake()

    # agent thread ------------------------------------------------------------------------------------------

    def poll(self, now: float) -> None:
        if self._baseline_due is not None and self.baseline_id is None:
            self._take_baseline(*self._baseline_due)
        while self._fired_q:
            slow, median, step = self._fired_q.popleft()
            self._decide(slow, median, step)

    def allowed(self, now: float) -> str:
        """'' when a capture may start now, else why not."""
        self.started = [t for t in self.started if now - t < 3600]
        if self.started and now - self.started[-1] < self.cooldown_s:
            return f"cooldown ({self.cooldown_s - (now - self.started[-1]):.0f} s left)"
        if len(self.started) >= self.per_hour:
            return f"hourly budget of {self.per_hour} capture(s) spent"
        return ""

    def _decide(self, slow: list[float], median: float, step: int) -> None:
        now = self.clock()
        reason = {"why": f"{len(slow)} consecutive steps over {self.ratio:g}x the rolling median step time",
                  "ratio": self.ratio, "median_step_s": round(median, 6),
                  "slow_steps_s": [round(s, 6) for s in slow], "detected_at_step": step}
        held = self.allowed(now) or ("a window of ours is still being written (its save shares the cores)"
                                     if self.busy() else "")
        if held:
            self.held += 1
            log.info("ondemand_prof: steps are %.1fx slower than the median (%.1f ms) at step %d; no automatic "
                     "capture: %s", max(slow) / median, median * 1000, step, held)
            return
        agent = self.agent
        assert agent is not None  # poll() runs on the agent thread, so attach() came first
        self.started.append(now)
        window = self._window(reason, agent.files.lead_steps() + 1)
        log.warning("ondemand_prof: steps are %.1fx slower than the median (%.1f ms) at step %d: automatic capture "
                    "%s of steps [%d, %d)", max(slow) / median, median * 1000, step, window.capture_id, window.start,
                    window.end)
        link = agent.link
        listener = link.listener_for(window.capture_id) if link is not None else _log_listener(window.capture_id)
        agent.schedule(window, listener)
        if link is not None:  # the daemon opens the same window on a median-speed rank of this job
            link.post(encode("auto_capture", window=window.to_wire()))

    def _take_baseline(self, step: int, median: float) -> None:
        """The baseline window (module docstring): on this rank, and through the daemon on the job's ranks of
        this host; with a daemon, only the rank of local rank 0 asks."""
        agent = self.agent
        assert agent is not None
        link = agent.link
        ident = self.prof.identity()
        with_daemon = link is not None and link.registered
        if with_daemon and (ident.local_rank if ident.local_rank is not None else ident.rank) != 0:
            self.baseline_id = ""  # the local rank 0 asks for this host's ranks
            return
        reason = {"why": self.baseline_text(), "median_step_s": round(median, 6), "decided_at_step": step}
        lead = agent.files.lead_steps() + 1
        start = max(self.baseline_at, self.prof.current_step + lead) if self.baseline_at > 0 else None
        window = self._window(reason, lead, kind="baseline", start=start)
        self.baseline_id = window.capture_id
        log.warning("ondemand_prof: baseline %s of steps [%d, %d) (%s)%s", window.capture_id, window.start,
                    window.end, reason["why"], "; the daemon records it on this host's ranks of the job"
                    if with_daemon else "")
        listener = link.listener_for(window.capture_id) if link is not None else _log_listener(window.capture_id)
        agent.schedule(window, listener)
        if with_daemon:
            assert link is not None
            link.post(encode("auto_capture", window=window.to_wire()))

    def _window(self, reason: dict[str, Any], lead: int, kind: str = "auto", start: int | None = None) -> Window:
        """An automatic window on this rank: `kind` auto (a slowdown, compared with this rank's baseline when it
        took one) or baseline; from `start`, else `lead` steps ahead (enough for the daemon to reach other ranks)."""
        prof, config = self.prof, self.prof.config
        start = prof.current_step + lead if start is None else start
        cid = make_capture_id(kind, id_stamp(), f"r{prof.identity().rank}", os.getpid())
        defaults = WindowDefaults.from_config(config)
        extra: dict[str, Any] = {}
        if kind == "baseline":
            extra["auto_baseline"] = reason
        else:
            extra["auto"] = reason
            if self.baseline_id:
                extra["baseline"] = self.baseline_id  # report AUTO without a daemon finds it by this
        # the configured length within the cap, asked for as such (requested: {"steps": N, ...} as before)
        request = CaptureRequest(steps=min(defaults.steps, defaults.max_steps))
        return resolve(request, defaults, start, source="auto", capture_id=cid, extra=extra)


def _log_listener(capture_id: str) -> Callable[[str, dict[str, Any]], None]:
    def listen(event: str, info: dict[str, Any]) -> None:
        if event in ("done", "failed", "rejected"):
            log.info("ondemand_prof: automatic capture %s %s: %s", capture_id, event,
                     info.get("path") or info.get("error"))

    return listen
