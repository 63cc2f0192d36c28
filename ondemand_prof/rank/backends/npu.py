"""torch_npu.profiler on Ascend. Imported only when torch_npu is installed.

torch_npu's profile() runs its own schedule; we give it one written in the loop's step numbers and set its
step counter to the window's first step, so its ProfilerStep#N labels are the loop's. Collection at window
end stays on the training thread (torch_npu segfaults when started or stopped from another thread) with
analyse_flag=False; the slow parse into ASCEND_PROFILER_OUTPUT runs on our background worker through
torch_npu.profiler.profiler.analyse().
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from pathlib import Path
from typing import Any, Sequence

from ...core.options import OPTIONS, Option, window_options
from ...core.window import Window
from .base import Export, Identity, Written

log = logging.getLogger(__name__)

_LEVEL_ATTR = {"level_none": "Level_none", "level0": "Level0", "level1": "Level1", "level2": "Level2"}


def npu_profile_kwargs(npu_profiler: Any, options: Any, table: Sequence[Option] = OPTIONS
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(profile() kwargs without schedule/on_trace_ready, _ExperimentalConfig kwargs) for a window's options,
    from each option's `npu` mapping in the options table.

    AiCoreNone at level_none/level0: any other AI Core metric there makes torch_npu print a warning and reset
    it (MindSpeed hard-codes PipeUtilization and gets that warning at level0).
    """
    aic = "AiCoreNone" if options.level in ("level_none", "level0") else "PipeUtilization"
    experimental: dict[str, Any] = {"aic_metrics": getattr(npu_profiler.AiCMetrics, aic)}
    activities = [npu_profiler.ProfilerActivity.NPU]
    profile: dict[str, Any] = {"record_shapes": False, "profile_memory": False, "with_stack": False,
                               "with_flops": False, "with_modules": options.level == "level2"}
    for opt in window_options(table):
        value = getattr(options, opt.name)
        kind, _, target = opt.npu.partition(":")
        if kind == "kwarg":
            profile[target] = bool(profile.get(target)) or bool(value)
        elif kind == "experimental":
            experimental[target] = _npu_value(npu_profiler, opt.name, value)
        elif kind == "activity" and value:
            activities.insert(0, getattr(npu_profiler.ProfilerActivity, target))
    return {"activities": activities, **profile}, experimental


def _npu_value(npu_profiler: Any, name: str, value: Any) -> Any:
    if name == "level":
        return getattr(npu_profiler.ProfilerLevel, _LEVEL_ATTR[value])
    if name == "export_type":
        return npu_profiler.ExportType.Db if value == "db" else npu_profiler.ExportType.Text
    return value


class NpuSession:
    def __init__(self, window: Window, identity: Identity, staging: Path) -> None:
        self._torch_npu = importlib.import_module("torch_npu")
        profiler = self._torch_npu.profiler
        self._window = window
        self.staging = staging
        profile_kwargs, exp_kwargs = npu_profile_kwargs(profiler, window.options)
        self.profile_kwargs, self.experimental_kwargs = profile_kwargs, exp_kwargs
        staging.mkdir(parents=True, exist_ok=True)
        handler = profiler.tensorboard_trace_handler(
            str(staging), worker_name=f"{identity.host}_{identity.pid}", analyse_flag=False
        )
        self._prof = profiler.profile(
            schedule=self._schedule,
            on_trace_ready=handler,
            experimental_config=profiler._ExperimentalConfig(**exp_kwargs),  # noqa: SLF001 - torch_npu's public name
            **profile_kwargs,
        )
        self._started = False

    def _schedule(self, step: int) -> Any:
        action = self._torch_npu.profiler.ProfilerAction
        window = self._window
        if step < window.start:
            return action.WARMUP
        if window.end is None or step < window.end - 1:
            return action.RECORD
        if step == window.end - 1:
            return action.RECORD_AND_SAVE
        return action.NONE

    def _begin(self, step: int) -> None:
        self._prof.step_num = step
        self._prof.current_action = self._schedule(step)
        self._prof.start()
        self._started = True

    def warmup(self, step: int) -> None:
        self._begin(step)

    def record(self, step: int) -> None:
        if not self._started:
            self._begin(step)
        else:
            self._prof.step()

    def finish(self) -> Export:
        self._prof.stop()
        torch_npu = self._torch_npu
        staging = self.staging

        def write(_staging: Path) -> Written:
            outputs = sorted(staging.glob("*_ascend_pt"))
            if not outputs:
                raise RuntimeError(f"torch_npu wrote no *_ascend_pt directory under {staging}")
            analyse = getattr(torch_npu.profiler, "analyse", None) or torch_npu.profiler.profiler.analyse
            analyse(str(outputs[-1]), max_process_number=max(1, min(4, (os.cpu_count() or 2) // 2)))
            return Written(outputs[-1])

        return Export(write=write, info={
            "npu_profile_kwargs": {k: _plain(v) for k, v in self.profile_kwargs.items()},
            "npu_experimental_config": {k: _plain(v) for k, v in self.experimental_kwargs.items()},
        })

    def abort(self) -> None:
        try:
            if self._started:
                self._prof.stop()
        except Exception:  # noqa: BLE001 - last resort, the caller logged the cause
            log.debug("abort: torch_npu stop failed", exc_info=True)


def _plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class NpuBackend:
    name = "torch_npu"

    def __init__(self) -> None:
        self._torch_npu = importlib.import_module("torch_npu")

    def open(self, window: Window, identity: Identity, staging: Path | None = None) -> NpuSession:
        if staging is None:
            raise ValueError("the NPU backend needs a staging directory")
        return NpuSession(window, identity, staging)

    def versions(self) -> dict[str, str]:
        import torch

        return {"torch": torch.__version__, "torch_npu": str(getattr(self._torch_npu, "__version__", "unknown")),
                "device": "npu", "host": socket.gethostname()}
