"""Captures on condition (--profile-auto RATIO): a change test on the step-time series. Once the job's baseline is
taken, its steps are the reference (their median, and the spread of their log times); a one-sided CUSUM on each
step's log time then watches for a shift of RATIO times (SlowStepMonitor), its threshold set for a stated mean run
between false alarms of an unchanged job (--profile-auto-false-alarm, 1,000,000 steps by default; printed in the
start-up line). Nothing fires before the baseline: warm-up, compilation and a host settling are not slowdowns.
With a daemon, the rank asks it, and the daemon opens the capture on every rank of the job on its host (one
capture when several ranks slow down at once: a second request while one runs is covered by it); without one, the
rank captures itself. A cooldown and an hourly budget bound how many captures a slow phase can start; the
cooldown ends early once the steps are back to the baseline's (a median of HISTORY steps, all taken after the
capture began, under the CUSUM's threshold): a new slowdown after a short one is another episode, captured, while
one that goes on is captured once per cooldown.

The baseline first (--profile-baseline-at): one window of the healthy job, what the automatic captures are compared
with (the daemon compares each once it settles and keeps the comparison on its record: ondemandctl show/report AUTO
print it, its log has the cause line). By default it is taken once step times are steady after warm-up: at least
BASELINE_WARMUP steps in, the slowest tenth of the last HISTORY steps within STEADY_SPREAD times the fastest tenth
and no drift between their two halves (checked every EVERY steps), or, steady or not, BASELINE_PATIENCE steps
later (said in the log and the baseline's reason); STEP takes it at that step (or as soon as it can after it); -1
takes none (the reference is then taken as the baseline would be, without a capture). With a daemon, the rank with
local rank 0 asks it, and the daemon records the same window on every rank of the job on its host (the job's
baseline there); without one, each rank takes its own.

Threads: SlowStepMonitor's step function runs on the training thread as the idle step() (a small Python
function around the C counter instead of the counter alone: about 0.3 us more per step, bench/bench_hook.py; a
step that cannot raise the CUSUM takes the same path as before); deciding, planning and scheduling happen on the
agent thread (AutoCapture.poll). Off (the default), nothing here is loaded and step() is the C counter.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from ..core.requests import CaptureRequest, WindowDefaults, resolve
from ..core.ids import automatic_id
from ..core.protocol import encode
from ..core.window import Window
from .extension import Extension

if TYPE_CHECKING:
    from .extension import AgentLike

log = logging.getLogger("ondemand_prof.rank.autocapture")

HISTORY = 64  # (a power of two) step times kept: the baseline's readiness and the reference are taken over them
EVERY = 16  # the history is looked at every this many steps (sorting 64 floats each step would cost ~2 us)
MIN_SAMPLES = 16  # no judgement before this many steps

BASELINE_WARMUP = 64  # steps before a baseline may be called steady (compilation, caches, the first allocations)
STEADY_SPREAD = 1.5  # the slowest tenth of the last HISTORY steps within this many times the fastest tenth ...
STEADY_DRIFT = 0.1  # ... and the two halves' medians within this share of each other: steady
BASELINE_PATIENCE = 256  # steps after the warm-up at most: then the baseline is taken steady or not, and said so
MIN_EXTRA_S = 0.001  # a step must also be this much longer than the reference to count (sub-ms jitter of a tiny
                     # loop, a GIL hand-over to another thread, is not a slowdown)
P_MIN = 0.02  # how often a step is over the threshold, before or after a shift, is kept within [P_MIN, 1 - P_MIN]
FALSE_ALARM_STEPS = 10 ** 6  # the default mean steps between false alarms of an unchanged job
# The CUSUM's false-alarm rate holds for independent steps; a host's bursts are not (another process's second of CPU
# slows every step in it: 20 steps of 30 ms over the threshold in a row). A shift must keep the sum over its
# threshold this long before it fires: a burst's sum falls back to 0 within a second of its end, a slowdown's does
# not. bench/bench_auto_capture.py: two yes loops and an ondemandctl call every 10 s beside 30 ms steps opened 8
# captures in 15 minutes with none.
CONFIRM_S = 10.0


class SlowStepMonitor:
    """Training thread. step_fn(counter) is the idle step(): the C counter, then this step's time. Once a reference
    is set (the baseline's steps, set_reference), a CUSUM of the log-likelihood ratio of "this step is over the
    threshold" watches for a shift of `ratio` times: the threshold T is the baseline's median times sqrt(ratio); p0
    is the share of the baseline's steps over T, p1 the share that would be after a shift of `ratio` (each moved two
    standard errors towards fewer alarms: a reference of 64 steps is an estimate); each step over
    T adds ln(p1/p0), each other step ln((1-p1)/(1-p0)) (the sum never below 0); fire(slow_times, median) when the
    sum passes h = ln(arl): an unchanged job raises a false alarm once in `arl` steps at most (Lorden's bound), how
    long its long steps are does not matter (a step counts as over T or not: a host's long tail of steps cannot
    add up to a slowdown), and a shift of `ratio` fires within a few dozen steps. At least `steps` steps over T
    raised it, and the sum has stayed over h (never back to 0) for `confirm_s` seconds (CONFIRM_S: correlated
    slow steps of a burst of the host's load are not a shift). Nothing fires before a reference. The per-step state
    lives in the closure's cells (cheaper than attributes); a step under T with the sum at 0 touches nothing else.
    See bench/bench_hook.py."""

    def __init__(self, ratio: float, steps: int, fire: Callable[[list[float], float], None],
                 clock: Callable[[], float] = time.perf_counter, arl: float = FALSE_ALARM_STEPS,
                 confirm_s: float = CONFIRM_S) -> None:
        self.ratio, self.steps, self.fire, self.clock, self.arl = ratio, steps, fire, clock, arl
        self.confirm_s = confirm_s
        self.durations = [0.0] * HISTORY  # a ring, written at n % HISTORY; kept across windows
        self.n = 0  # intervals seen (synchronised from the closure on the rare path)
        self.median: float | None = None  # of the history (every EVERY steps)
        self.reference: tuple[float, float, float] | None = None  # (median s, p0, p1) once set
        self.up = self.down = 0.0
        self.h = math.log(arl)
        self.threshold = float("inf")  # T: a step over it raises the sum (none before a reference)
        self.on_median: Callable[[int, list[float]], None] | None = None  # (steps seen, sorted durations)
        self.version = 0  # bumped by set_reference: the closure picks the new reference up

    def set_reference(self, ordered: list[float]) -> tuple[float, float, float]:
        """Steps of the baseline (sorted durations, s) become the reference: their median, and how often a step
        is over T now (p0) and would be after a shift of `ratio` (p1), each kept from the extremes."""
        median = ordered[len(ordered) // 2]
        t = max(median * math.sqrt(self.ratio), median + MIN_EXTRA_S)
        n = len(ordered)

        def share(x: float, sign: int) -> float:  # moved two standard errors the safe way: fewer false alarms
            return x + sign * 2 * math.sqrt(max(x * (1 - x), 1 / n) / n)

        p0 = min(max(share(sum(d > t for d in ordered) / n, +1), P_MIN), 0.45)
        p1 = min(max(share(sum(d * self.ratio > t for d in ordered) / n, -1), 0.55), 1 - P_MIN)
        self.reference = (median, p0, p1)
        self.up, self.down = math.log(p1 / p0), math.log((1 - p1) / (1 - p0))
        self.threshold = t
        self.version += 1
        return self.reference

    def _update_median(self, n: int) -> None:
        ordered = sorted(self.durations[:n] if n < HISTORY else self.durations)
        self.median = ordered[len(ordered) // 2]
        if self.on_median is not None:
            self.on_median(n, ordered)

    def step_fn(self, counter: Any) -> Callable[..., Any]:
        """A fresh idle step() (after a window the first interval is not a step: the clock starts again)."""
        nxt, perf, durations, mask = next, self.clock, self.durations, HISTORY - 1
        me = self
        last: float | None = None
        n = self.n
        threshold = self.threshold
        version = self.version
        total = 0.0  # the CUSUM
        slow: list[float] = []  # the steps that raised it since it was last 0
        over_since: float | None = None  # when the sum last went over h (since it was last 0)

        def rare(dt: float, now: float) -> None:
            nonlocal n, threshold, total, slow, version, over_since
            if version != me.version:  # a new reference: start over
                version, threshold, total, slow, over_since = me.version, me.threshold, 0.0, [], None
            if me.reference is not None and (dt > threshold or total > 0):
                total = max(0.0, total + (me.up if dt > threshold else me.down))
                if total <= 0:
                    slow, over_since = [], None
                elif dt > threshold:
                    slow.append(dt)
                    del slow[:-256]  # (a long confirmation of a slowdown of short steps)
                if total > me.h and len(slow) >= me.steps:
                    if over_since is None:
                        over_since = now
                    if now - over_since >= me.confirm_s:
                        fired, slow, total, over_since = slow[-32:], [], 0.0, None
                        me.fire(fired, me.reference[0])
            durations[n & mask] = dt
            n += 1
            me.n = n
            if not n % EVERY and n >= MIN_SAMPLES:
                me._update_median(n)
                threshold = me.threshold if version == me.version else threshold

        def step(step: Any = None) -> None:  # the method's signature: step(n) and step(step=n)
            nonlocal last, n
            nxt(counter)
            now = perf()
            if last is not None:
                dt = now - last
                if dt > threshold or total or not (n + 1) % EVERY or version != me.version:
                    rare(dt, now)
                else:
                    durations[n & mask] = dt
                    n += 1
            last = now

        return step

    def describe(self) -> str:
        return (f"a {self.ratio:g}x shift of the step time from the baseline's (a CUSUM of the steps over "
                f"{math.sqrt(self.ratio):.2f}x its median; at most one false alarm per {self.arl:,.0f} steps of an "
                f"unchanged job; held {self.confirm_s:g} s before it counts, so a burst of the host's load does not)")


class AutoCapture(Extension):
    """The policy (cooldown, hourly budget) and the window, on the agent thread."""

    def __init__(self, prof: Any, clock: Callable[[], float] = time.monotonic) -> None:
        config = prof.config
        self.prof = prof
        self.ratio, self.steps = float(config.auto_ratio), int(config.auto_steps)
        self.cooldown_s, self.per_hour = float(config.auto_cooldown_s), int(config.auto_per_hour)
        self.monitor = SlowStepMonitor(self.ratio, self.steps, self._fired,
                                       arl=float(getattr(config, "auto_false_alarm_steps", FALSE_ALARM_STEPS)),
                                       confirm_s=float(getattr(config, "auto_confirm_s", CONFIRM_S)))
        self.clock = clock
        self.agent: AgentLike | None = None
        # bounded: without an agent to drain it (start_agent=False), slowdowns are dropped, not hoarded
        self._fired_q: collections.deque[tuple[list[float], float, int]] = collections.deque(maxlen=16)
        self.started: list[float] = []  # when automatic captures started (the budget's hour)
        self.held = 0  # slowdowns not captured because of the cooldown or the budget
        # the monitor's step count when the last automatic capture began, and whether the steps have been back to
        # the baseline's since (which ends its cooldown): set on the agent thread, read and set on the training one
        self.capture_n: int | None = None
        self.recovered = False
        self.baseline_at = int(getattr(config, "auto_baseline_at", 0))
        self.baseline_id: str | None = None  # the baseline this rank took or asked for
        self._baseline_due: tuple[int, float] | None = None  # (step, median) once it is time (training thread)
        self.not_steady = ""  # why the baseline was taken though the steps were not steady (said with it)
        self.monitor.on_median = self._on_median
        # True while a window of ours is still being written: its helpers share the cores, and steps they slow
        # are not the job slowing down (a baseline's own export opened an automatic capture of itself)
        exporter = getattr(prof, "_exporter", None)  # the hook's
        self.busy: Callable[[], bool] = (lambda: exporter.pending() > 0) if exporter is not None else (lambda: False)

    def idle_step(self, counter: Any) -> Callable[..., Any]:
        return self.monitor.step_fn(counter)

    def attach(self, agent: AgentLike) -> None:
        self.agent = agent
        agent.add_extension(self)
        log.info("ondemand_prof: automatic captures on %s (cooldown %g s, at most %d per hour), none before the "
                 "baseline; compared with a baseline %s", self.monitor.describe(), self.cooldown_s, self.per_hour,
                 self.baseline_text())

    def startup_note(self) -> str:
        return (f"automatic captures on {self.monitor.describe()}, none before the baseline, compared with a "
                f"baseline {self.baseline_text()}")

    def baseline_text(self) -> str:
        """When the baseline is taken, as the start-up line says it."""
        if self.baseline_at == -1:
            return "none (--profile-baseline-at -1)"
        if self.baseline_at > 0:
            return f"at step {self.baseline_at} (--profile-baseline-at)"
        return (f"once step times are steady after {BASELINE_WARMUP} steps (the slowest tenth within "
                f"{STEADY_SPREAD:g}x the fastest, no drift; at most {BASELINE_PATIENCE} steps later, steady or not; "
                "--profile-baseline-at STEP to choose)")

    def _on_median(self, n: int, ordered: list[float]) -> None:  # training thread, every EVERY steps
        self._baseline_check(n, ordered)
        since, median = self.capture_n, self.monitor.median  # (the median of `ordered`, set before this call)
        if since is not None and not self.recovered and n - since >= HISTORY and median is not None and \
                median < self.monitor.threshold:
            self.recovered = True  # every step in the history came after the capture began, most of them normal
            log.info("ondemand_prof: steps are back to the baseline's (median %.1f ms): the automatic captures' "
                     "cooldown is over", median * 1000)

    def _baseline_check(self, n: int, ordered: list[float]) -> None:
        """Is it time for the baseline (and the monitor's reference: its steps)? Without a baseline
        (--profile-baseline-at -1), the reference is taken alone, as the baseline would be."""
        if self._baseline_due is not None or self.baseline_id is not None or self.monitor.reference is not None:
            return
        step = self.prof.current_step
        if self.baseline_at > 0:
            due = step + 2 * EVERY >= self.baseline_at  # scheduled at baseline_at, ahead of time
        else:
            why = unsteady(self.monitor.durations, n)
            due = n >= BASELINE_WARMUP and (not why or n >= BASELINE_WARMUP + BASELINE_PATIENCE)
            if due and why:
                self.not_steady = why
                log.warning("ondemand_prof: the steps were not steady after %d steps (%s): the baseline is taken "
                            "all the same", n, why)
        if not due:
            return
        self.monitor.set_reference(ordered)
        if self.baseline_at == -1:
            return
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
        if self.started and now - self.started[-1] < self.cooldown_s and not self.recovered:
            return (f"cooldown ({self.cooldown_s - (now - self.started[-1]):.0f} s left, or until the steps are "
                    "back to the baseline's)")
        if len(self.started) >= self.per_hour:
            return f"hourly budget of {self.per_hour} capture(s) spent"
        return ""

    def _decide(self, slow: list[float], median: float, step: int) -> None:
        now = self.clock()
        reason = {"why": f"the step time shifted to {self.ratio:g}x the baseline's or more (CUSUM over "
                         f"{len(slow)} slow steps)",
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
        self.capture_n, self.recovered = self.monitor.n, False
        window = self._window(reason, agent.lead_steps() + 1)
        link = agent.link
        with_daemon = link is not None and link.registered
        log.warning("ondemand_prof: steps are %.1fx the baseline's (%.1f ms) at step %d: automatic capture %s of "
                    "steps [%d, %d)%s", max(slow) / median, median * 1000, step, window.capture_id, window.start,
                    window.end, " asked of the daemon (every rank of the job on this host; a capture another rank "
                    "of the job opened meanwhile is that one)" if with_daemon else "")
        if with_daemon:  # the daemon opens it on the job's ranks here, this one included: one capture, not one each
            assert link is not None
            link.post(encode("auto_capture", window=window.to_wire()))
            return
        agent.schedule(window, link.listener_for(window.capture_id) if link is not None else
                       _log_listener(window.capture_id))

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
        reason = {"why": self.baseline_text() + (f"; not steady: {self.not_steady}" if self.not_steady else ""),
                  "median_step_s": round(median, 6), "decided_at_step": step}
        lead = agent.lead_steps() + 1
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
        cid = automatic_id(kind, prof.identity().rank, os.getpid())  # (a random part: issue 41, 5)
        defaults = WindowDefaults.from_config(config)
        extra: dict[str, Any] = {}
        if kind == "baseline":
            extra["auto_baseline"] = reason
        else:
            extra["auto"] = reason
            if self.baseline_id:
                extra["compare_with"] = self.baseline_id  # report AUTO without a daemon finds it by this
        # the configured length within the cap, asked for as such (requested: {"steps": N, ...} as before)
        request = CaptureRequest(steps=min(defaults.steps, defaults.max_steps))
        return resolve(request, defaults, start, source="auto", capture_id=cid, extra=extra)


def unsteady(durations: list[float], n: int) -> str:
    """Why the last HISTORY step times are not steady ('' when they are): the slowest tenth over STEADY_SPREAD
    times the fastest, or the two halves' medians more than STEADY_DRIFT apart (a trend)."""
    if n < HISTORY:
        return f"{n} steps seen"
    at = n % HISTORY  # the ring in time order: the oldest first
    ordered_in_time = durations[at:] + durations[:at]
    ordered = sorted(ordered_in_time)
    spread = ordered[HISTORY * 9 // 10] / max(ordered[HISTORY // 10], 1e-9)
    if spread > STEADY_SPREAD:
        return f"the slowest tenth {spread:.2f}x the fastest"
    first, second = (sorted(ordered_in_time[:HISTORY // 2]), sorted(ordered_in_time[HISTORY // 2:]))
    a, b = first[len(first) // 2], second[len(second) // 2]
    if abs(b - a) > STEADY_DRIFT * min(a, b):
        return f"the median step moved from {a * 1000:.1f} to {b * 1000:.1f} ms"
    return ""


def _log_listener(capture_id: str) -> Callable[[str, dict[str, Any]], None]:
    def listen(event: str, info: dict[str, Any]) -> None:
        if event in ("done", "failed", "rejected"):
            log.info("ondemand_prof: automatic capture %s %s: %s", capture_id, event,
                     info.get("path") or info.get("error"))

    return listen
