"""Zero-code activation: a training step is counted at each optimizer step.

    import ondemand_prof
    prof = ondemand_prof.enable(save_path="./profile")   # nothing else in the loop

or, with no edit at all, `ONDEMAND_PROF_AUTO=1 python train.py` (options from ONDEMAND_PROF_* variables; see
ondemand_prof_auto.py for the start-up hook).

What counts as a step (docs/training-stacks.md, "Zero-code"):
- one step per `step()` of the *lead* optimizer: the first optimizer that steps in the process. A loop with
  several optimizers (a GAN's generator and discriminator, an optimizer per parameter group family) counts one
  step per iteration, at the lead's step; the others are ignored. When the lead is garbage-collected, the next
  optimizer to step becomes the lead.
- gradient accumulation: micro-batches that do not step the optimizer are part of the step that does, so a
  step is one optimizer update (what Lightning's and Hugging Face's global_step count).
- an optimizer stepped twice in one iteration counts twice (nothing tells the two calls apart); a step that
  GradScaler skips (inf/NaN gradients) does not call the optimizer and is not counted.
- wrappers that step an inner optimizer (ZeroRedundancyOptimizer, Lightning's LightningOptimizer) count once:
  the inner optimizer steps first and becomes the lead.
While a window is due, the boundary is taken at the next module forward rather than inside the optimizer's
own record_function range (see StepCounter.__call__). Steps are numbered from 0. In ONDEMAND_PROF_AUTO mode,
ondemand_prof_auto.py watches torch's import and says when the profiler is made (auto_appeared: at torch's import
in a rank its launcher started, else when the process shows it trains; auto_step at the latest), so a process
that never trains (a launcher, a DataLoader worker) never registers with the daemon.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Any, Callable

from ..core.options import ConfigError, ProfileConfig, config_from_env
from ..rank.hook import OnDemandProfiler
from . import config_from_options

log = logging.getLogger("ondemand_prof")

# no optimizer step this long after the profiler was made: say what zero-code counts (env: a test's shorter wait)
NO_STEP_ENV = "ONDEMAND_PROF_AUTO_NO_STEP_S"


class StepCounter:
    """Counts the lead optimizer's steps into a profiler made on first use (torch's global post-step hook)."""

    def __init__(self, make: Callable[[], OnDemandProfiler]) -> None:
        self._make = make
        self.profiler: OnDemandProfiler | None = None
        self._lead: weakref.ref[Any] | None = None
        self._broken = False
        self.handle: Any = None
        self._pending = False  # a step ended whose boundary waits for the next module forward
        self._forward: Any = None  # the global forward pre-hook, registered only while a window is due
        self.counted = False  # an optimizer step came
        self._no_step_timer: threading.Timer | None = None

    def __call__(self, optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
        lead = self._lead() if self._lead is not None else None
        if lead is None:
            self._lead = weakref.ref(optimizer)
        elif optimizer is not lead:
            return
        self.counted = True
        prof = self.profiler if self.profiler is not None else self.make_profiler()
        if prof is None:
            return
        if self._forward is not None:  # removed here, never while torch iterates the module hooks
            self._forward.remove()
            self._forward = None
        if self._pending:  # no module forward came since the last step (a functional model): end it here
            self._pending = False
            prof.step()
        if "step" in prof.__dict__:  # the hook's idle counter: nothing starts or stops at this boundary
            prof.step()
            return
        # A window is due. This hook runs inside the optimizer's record_function("Optimizer.step#..."); starting
        # or stopping the profiler there leaves that range half inside the trace (a step can go missing). So the
        # step ends at the next module forward, outside it: the same boundary, zero_grad aside.
        from torch.nn.modules.module import register_module_forward_pre_hook

        self._pending = True
        self._forward = register_module_forward_pre_hook(self._on_forward)

    def _on_forward(self, module: Any, args: Any) -> None:
        if self._pending and self.profiler is not None:
            self._pending = False
            self.profiler.step()

    def make_profiler(self) -> OnDemandProfiler | None:
        if self.profiler is None and not self._broken:
            try:
                self.profiler = self._make()
            except Exception as exc:  # noqa: BLE001 - a bad option must not stop training: say it once
                self._broken = True
                log.error("ondemand_prof: zero-code profiling off: %s", exc)
                return None
            atexit.register(self.profiler.close_at_exit)  # windows in progress are written at exit
        return self.profiler

    def expect_steps(self) -> None:
        """Say once, if no optimizer step came within 60 s, that zero-code counts optimizer steps only."""
        try:
            within = float(os.environ.get(NO_STEP_ENV, "60"))
        except ValueError:
            within = 60.0
        if self._no_step_timer is None:
            self._no_step_timer = threading.Timer(within, self._no_step, (within,))
            self._no_step_timer.name = "ondemand-prof-no-step-timer"  # ours (stacks fold it)
            self._no_step_timer.daemon = True
            self._no_step_timer.start()

    def _no_step(self, within: float) -> None:
        if self.counted or self.profiler is None:
            return
        agent = self.profiler.agent
        if agent is not None and agent.rendezvous_since is not None:  # still waiting for its peers: not a loop
            self._no_step_timer = None  # that updates weights by hand; look again later
            self.expect_steps()
            return
        from ..rank.announce import say

        say(log, self.profiler.config.quiet, f"ondemand_prof: rank {self.profiler.identity().rank}: no "
            f"optimizer.step() in {within:g} s; zero-code counts optimizer.step(): call prof.step() in loops that "
            "update weights by hand (prof = ondemand_prof.OnDemandProfiler.from_env(), docs/getting-started.md)")

    def register(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.handle = register_optimizer_step_post_hook(self)

    def remove(self) -> None:
        """Stop counting (the profiler, if any, is closed)."""
        if self._no_step_timer is not None:
            self._no_step_timer.cancel()
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self._forward is not None:
            self._forward.remove()
            self._forward = None
        if self.profiler is not None:
            self.profiler.close()
            atexit.unregister(self.profiler.close_at_exit)


_lock = threading.Lock()
_counter: StepCounter | None = None  # the process's one counter (enable() or ONDEMAND_PROF_AUTO)
_auto_config: Callable[[], Any] = config_from_env


def enable(config: ProfileConfig | None = None, **options: Any) -> OnDemandProfiler:
    """Profile this process with a step counted at each optimizer step; returns the profiler.

    Options are the profiler options by name (`save_path=`, `ranks=`, ...); ONDEMAND_PROF_* variables override
    them. Bad options raise ConfigError here, before training starts. A second call returns the same profiler.
    """
    global _counter
    with _lock:
        if _counter is not None and _counter.profiler is not None:
            if config is not None or options:
                log.warning("ondemand_prof: enable() was already called; these options are ignored: %s",
                            sorted(options) or "config")
            return _counter.profiler
        cfg = config_from_options(options, config)
        prof = OnDemandProfiler(cfg)
        if _counter is None:
            _counter = StepCounter(lambda: prof)
            _counter.register()
        _counter.profiler = prof  # ONDEMAND_PROF_AUTO armed the hook before this call: its profiler is this one
        atexit.register(prof.close_at_exit)
        return prof


def disable() -> None:
    """Undo enable(): stop counting and close the profiler."""
    global _counter
    with _lock:
        counter, _counter = _counter, None
    if counter is not None:
        counter.remove()


def _auto_counter() -> StepCounter:
    global _counter
    counter = _counter
    if counter is None:
        with _lock:
            if _counter is None:
                _counter = StepCounter(lambda: OnDemandProfiler(_auto_config()))
            counter = _counter
    return counter


def auto_step(optimizer: Any) -> None:
    """The ONDEMAND_PROF_AUTO hook's step (ondemand_prof_auto registers the one global hook and calls this)."""
    counter = _auto_counter()
    if counter.handle is None:  # enable() also registered its own hook: that one counts
        counter(optimizer)


def auto_appeared(what: str) -> None:
    """ONDEMAND_PROF_AUTO: a training process showed itself (`what`: torch.distributed came up, an optimizer was
    made) before its first optimizer step: make the profiler now, so the start-up line comes now, and say so if
    no optimizer step follows (a loop that updates weights by hand)."""
    counter = _auto_counter()
    if counter.profiler is None and counter.make_profiler() is not None:
        log.debug("ondemand_prof: zero-code profiler made when %s appeared", what)
        counter.expect_steps()


__all__ = ["ConfigError", "StepCounter", "auto_appeared", "auto_step", "disable", "enable"]
