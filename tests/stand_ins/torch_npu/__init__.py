"""STAND-IN for torch_npu, which cannot be imported without Ascend hardware and CANN.

It mirrors the signatures of the real torch_npu.profiler (Ascend/pytorch, torch_npu/profiler/profiler.py and
experimental_config.py): profile(*, activities, schedule, on_trace_ready, record_shapes, profile_memory,
with_stack, with_flops, with_modules, experimental_config), its step_num/current_action/start/step/stop
protocol, tensorboard_trace_handler(dir_name, worker_name, analyse_flag, async_mode), _ExperimentalConfig's
keyword arguments and constants, and analyse(profiler_path, max_process_number). It records what it was
called with (CALLS) and writes a skeleton of the real output layout so the hook's mapping and publishing can
be tested. Used only by tests/test_npu_backend.py.
"""

__version__ = "2.1.0.standin"

from . import npu, profiler  # noqa: F401,E402
