"""Lightning: a Callback that drives the hook, with trainer.global_step as the step number.

    from ondemand_prof.integrations.lightning import OnDemandCallback
    trainer = L.Trainer(..., callbacks=[OnDemandCallback(save_path="./profile")])

Step N is the optimizer step taken while `trainer.global_step == N` (what training_step sees), so
ProfilerStep#N in a trace and `--profile-step-start N` mean that step. With gradient accumulation a step spans
all the micro-batches of one optimizer update: the hook is told only when global_step moves. A resumed run
continues from the restored global_step.

The callback may be built anywhere, before Trainer(...) too: the profiler itself is made in on_train_start, in
each training process (after Lightning has launched the ranks and set up torch.distributed, and after a
checkpoint has been restored), so every rank registers once, under one job, with its real rank. A launcher
process that does not train (ddp_spawn's parent) makes none.
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback  # type: ignore[assignment,no-redef]  # its own copy of the class

from ..rank.hook import OnDemandProfiler
from . import config_from_options

log = logging.getLogger("ondemand_prof")


class OnDemandCallback(Callback):
    """Profile on demand (and the configured static window) in a Lightning Trainer.

    Options are the profiler options by name (save_path=, ranks=, enabled=, step_start=, ...); ONDEMAND_PROF_*
    variables override them. Bad options raise ConfigError here, in the script, before the Trainer starts.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.config = config_from_options(options)
        self.profiler: OnDemandProfiler | None = None
        self._seen_step: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.profiler is None:
            self._seen_step = int(trainer.global_step)
            self.profiler = OnDemandProfiler(self.config, first_step=self._seen_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        prof = self.profiler
        step = int(trainer.global_step)
        if prof is None or step == self._seen_step:
            return  # an accumulating micro-batch: the optimizer has not stepped
        self._seen_step = step
        prof.step(step - 1)  # the step that ran while global_step was step - 1 has ended

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        prof, self.profiler = self.profiler, None
        if prof is not None:
            prof.close()

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing to checkpoint: the step number comes from the trainer

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the callbacks into its workers: a profiler (threads, sockets) never travels
        state = dict(self.__dict__)
        state["profiler"] = None
        return state


__all__ = ["OnDemandCallback"]
