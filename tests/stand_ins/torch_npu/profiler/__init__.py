"""Stand-in for torch_npu.profiler (see the package docstring)."""

from __future__ import annotations

import enum
import json
import os
import socket
import time
from typing import Any, Callable, Iterable, Optional

from torch.autograd import profiler as _prof

CALLS: list[tuple[str, Any]] = []


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


class ProfilerAction(enum.Enum):
    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3


class ProfilerLevel:
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"
    Level_none = "Level_none"


class AiCMetrics:
    PipeUtilization = "ACL_AICORE_PIPE_UTILIZATION"
    ArithmeticUtilization = "ACL_AICORE_ARITHMETIC_UTILIZATION"
    Memory = "ACL_AICORE_MEMORY_BANDWIDTH"
    MemoryL0 = "ACL_AICORE_L0B_AND_WIDTH"
    MemoryUB = "ACL_AICORE_MEMORY_UB"
    ResourceConflictRatio = "ACL_AICORE_RESOURCE_CONFLICT_RATIO"
    L2Cache = "ACL_AICORE_L2_CACHE"
    AiCoreNone = "ACL_AICORE_NONE"


class ExportType:
    Db = "db"
    Text = "text"


class _ExperimentalConfig:
    def __init__(self, profiler_level: str = ProfilerLevel.Level0, aic_metrics: str = AiCMetrics.AiCoreNone,
                 l2_cache: bool = False, msprof_tx: bool = False, data_simplification: bool = True,
                 record_op_args: bool = False, op_attr: bool = False, gc_detect_threshold: float = None,
                 export_type: str = ExportType.Text):
        self.warnings: list[str] = []
        if profiler_level in (ProfilerLevel.Level0, ProfilerLevel.Level_none) and aic_metrics != AiCMetrics.AiCoreNone:
            # the real class prints this warning and resets the metric
            self.warnings.append("Please use level1 or level2 if you want to collect aic metrics, reset aic "
                                 "metrics to None!")
            aic_metrics = AiCMetrics.AiCoreNone
        self.kwargs = dict(profiler_level=profiler_level, aic_metrics=aic_metrics, l2_cache=l2_cache,
                           msprof_tx=msprof_tx, data_simplification=data_simplification,
                           record_op_args=record_op_args, op_attr=op_attr, gc_detect_threshold=gc_detect_threshold,
                           export_type=export_type)
        CALLS.append(("_ExperimentalConfig", self.kwargs))


_HANDLER_DIR: dict[str, str] = {}


def tensorboard_trace_handler(dir_name: str = None, worker_name: str = None, analyse_flag: bool = True,
                              async_mode: bool = False):
    CALLS.append(("tensorboard_trace_handler", dict(dir_name=dir_name, worker_name=worker_name,
                                                    analyse_flag=analyse_flag, async_mode=async_mode)))
    worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"

    def handler_fn(prof_inst) -> None:
        ts = time.strftime("%Y%m%d%H%M%S") + "000"
        out = os.path.join(dir_name, f"{worker}_{ts}_ascend_pt")
        os.makedirs(os.path.join(out, "FRAMEWORK"), exist_ok=True)
        with open(os.path.join(out, "FRAMEWORK", "steps.json"), "w") as fh:
            json.dump(prof_inst.recorded_steps, fh)
        if analyse_flag:
            analyse(out)

    return handler_fn


def supported_activities():
    return {ProfilerActivity.CPU, ProfilerActivity.NPU}


def _default_schedule_fn(_: int) -> ProfilerAction:
    return ProfilerAction.RECORD


class profile:
    def __init__(self, *, activities: Optional[Iterable[ProfilerActivity]] = None,
                 schedule: Optional[Callable[[int], ProfilerAction]] = None,
                 on_trace_ready: Optional[Callable[..., Any]] = None, record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False, with_flops: bool = False,
                 with_modules: bool = False, experimental_config: Optional[_ExperimentalConfig] = None,
                 use_cuda: Optional[bool] = None):
        CALLS.append(("profile", dict(activities=list(activities or []), record_shapes=record_shapes,
                                      profile_memory=profile_memory, with_stack=with_stack, with_flops=with_flops,
                                      with_modules=with_modules, experimental_config=experimental_config)))
        self.schedule = schedule or _default_schedule_fn
        self.record_steps = schedule is not None
        self.on_trace_ready = on_trace_ready
        self.step_num = 0
        self.current_action = self.schedule(self.step_num)
        self.step_rec_fn = None
        self.recorded_steps: list[int] = []
        self.stopped = False

    def _transit(self, prev, cur) -> None:
        CALLS.append(("transit", (getattr(prev, "name", prev), getattr(cur, "name", cur), self.step_num)))
        if prev == ProfilerAction.RECORD_AND_SAVE or (cur is None and prev in (ProfilerAction.RECORD,)):
            if self.on_trace_ready:
                self.on_trace_ready(self)

    def _enter_step(self) -> None:
        if self.record_steps and self.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self.recorded_steps.append(self.step_num)
        if self.record_steps:
            self.step_rec_fn = _prof.record_function("ProfilerStep#" + str(self.step_num))
            self.step_rec_fn.__enter__()

    def start(self):
        self.stopped = False
        self._transit(ProfilerAction.NONE, self.current_action)
        self._enter_step()

    def stop(self):
        if self.record_steps and self.step_rec_fn:
            self.step_rec_fn.__exit__(None, None, None)
        self._transit(self.current_action, None)
        self.stopped = True

    def step(self):
        if self.record_steps and self.step_rec_fn:
            self.step_rec_fn.__exit__(None, None, None)
        prev_action = self.current_action
        self.step_num += 1
        self.current_action = self.schedule(self.step_num)
        self._transit(prev_action, self.current_action)
        self._enter_step()


def analyse(profiler_path: str, max_process_number: int = 1):
    CALLS.append(("analyse", dict(profiler_path=profiler_path, max_process_number=max_process_number)))
    out = os.path.join(profiler_path, "ASCEND_PROFILER_OUTPUT")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(profiler_path, "FRAMEWORK", "steps.json")) as fh:
        steps = json.load(fh)
    with open(os.path.join(out, "step_trace_time.csv"), "w") as fh:
        fh.write("Step,Computing,Communication(Not Overlapped),Overlapped,Communication,Free,Stage,Bubble\n")
        for s in steps:
            fh.write(f"{s},1.0,0.0,0.0,0.0,0.0,0.0,0.0\n")
    with open(os.path.join(out, "trace_view.json"), "w") as fh:
        json.dump([{"name": f"ProfilerStep#{s}", "ph": "X", "ts": s, "dur": 1} for s in steps], fh)


class _Profiler:  # torch_npu.profiler.profiler module attribute access used by some versions
    analyse = staticmethod(analyse)


profiler = _Profiler()
