"""Hugging Face Transformers: a TrainerCallback that drives the hook with the Trainer's own step numbers.

    from ondemand_prof.integrations.transformers import OnDemandCallback
    trainer = Trainer(..., callbacks=[OnDemandCallback(save_path="./profile")])

Step N is the optimizer step after which `state.global_step == N`, the step the Trainer logs as N ("step": N
in its log lines, checkpoint-N): ProfilerStep#N in a trace and `--profile-step-start N` mean that step. The
first step of a fresh run is 1. Gradient accumulation is honoured (on_step_end fires once per optimizer
update), and a resumed run continues from the restored global_step. The profiler is made in on_train_begin, in
each training process, after Accelerate has set up torch.distributed.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..rank.hook import OnDemandProfiler
from . import config_from_options


class OnDemandCallback(TrainerCallback):
    """Profile on demand (and the configured static window) in a transformers.Trainer.

    Options are the profiler options by name (save_path=, ranks=, enabled=, step_start=, ...); ONDEMAND_PROF_*
    variables override them. Bad options raise ConfigError here, before the Trainer starts.
    """

    def __init__(self, **options: Any) -> None:
        self.config = config_from_options(options)
        self.profiler: OnDemandProfiler | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is None:
            self.profiler = OnDemandProfiler(self.config, first_step=int(state.global_step) + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is not None:
            self.profiler.step(int(state.global_step))  # the step the Trainer now logs as global_step ended

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        prof, self.profiler = self.profiler, None
        if prof is not None:
            prof.close()


__all__ = ["OnDemandCallback"]
