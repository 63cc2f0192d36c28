"""The torch_npu backend's mapping, tested against a STAND-IN module (tests/stand_ins/torch_npu).

torch_npu cannot be imported without Ascend hardware and CANN, so this is the one place a stand-in is used:
it mirrors the real torch_npu.profiler signatures (profile, _ExperimentalConfig, ProfilerLevel, AiCMetrics,
ExportType, tensorboard_trace_handler, analyse) and records how it was called.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch

from conftest import STAND_INS
from ondemand_prof import OnDemandProfiler, ProfileConfig
from ondemand_prof.rank.backends import npu_available, select_backend
from ondemand_prof.core.window import WindowOptions

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.syspath_prepend(str(STAND_INS))
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("torch_npu")
    module.profiler.CALLS.clear()
    yield module
    # the stand-in must not outlive the test: find_spec answers from sys.modules, so a left-over torch_npu would make
    # every later in-process profiler in the run select the NPU backend
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]


def test_nothing_imports_torch_npu_when_absent():
    assert not npu_available()
    assert select_backend("auto").name == "torch"
    assert "torch_npu" not in sys.modules


@pytest.mark.parametrize("level,npu_level,aic", [
    ("level_none", "Level_none", "ACL_AICORE_NONE"),
    ("level0", "Level0", "ACL_AICORE_NONE"),  # MindSpeed passes PipeUtilization here and gets a warning
    ("level1", "Level1", "ACL_AICORE_PIPE_UTILIZATION"),
    ("level2", "Level2", "ACL_AICORE_PIPE_UTILIZATION"),
])
def test_level_maps_to_profiler_level_and_aicore_metric(stand_in, level, npu_level, aic):
    from ondemand_prof.rank.backends.npu import npu_profile_kwargs

    profile, exp = npu_profile_kwargs(stand_in.profiler, WindowOptions(level=level))
    assert exp["profiler_level"] == npu_level
    assert exp["aic_metrics"] == aic
    cfg = stand_in.profiler._ExperimentalConfig(**exp)
    assert cfg.warnings == []  # torch_npu would warn (and reset) on a metric at level0/level_none
    assert profile["with_modules"] is (level == "level2")


def test_options_map_onto_profile_and_experimental_config(stand_in):
    from ondemand_prof.rank.backends.npu import npu_profile_kwargs

    opts = WindowOptions(level="level1", export_type="db", data_simplification=True, with_cpu=True,
                         with_stack=True, with_memory=True, record_shapes=True)
    profile, exp = npu_profile_kwargs(stand_in.profiler, opts)
    P = stand_in.profiler
    assert profile["activities"] == [P.ProfilerActivity.CPU, P.ProfilerActivity.NPU]
    assert profile["record_shapes"] and profile["profile_memory"] and profile["with_stack"]
    assert exp["export_type"] == "db" and exp["data_simplification"] is True
    no_cpu, _ = npu_profile_kwargs(P, WindowOptions())
    assert no_cpu["activities"] == [P.ProfilerActivity.NPU]


def test_static_window_through_the_npu_backend(stand_in, tmp_path):
    cfg = ProfileConfig(enabled=True, step_start=3, step_end=6, save_path=str(tmp_path), ondemand=False,
                        min_free_mb=0, level="level1", export_type="db")
    assert select_backend("auto").name == "torch_npu"  # auto-selected once torch_npu is importable
    prof = OnDemandProfiler(cfg)
    model = torch.nn.Linear(8, 8)
    for _ in range(9):
        model(torch.randn(2, 8)).sum().backward()
        prof.step()
    assert prof.close()
    calls = stand_in.profiler.CALLS
    handler = next(kw for name, kw in calls if name == "tensorboard_trace_handler")
    assert handler["analyse_flag"] is False  # the parse runs on our worker, not in stop()
    exp = next(kw for name, kw in calls if name == "_ExperimentalConfig")
    assert exp["profiler_level"] == "Level1" and exp["export_type"] == "db"
    transits = [args for name, args in calls if name == "transit"]
    assert transits[0] == ("NONE", "WARMUP", 2)  # one warmup step before the window
    assert transits[-1] == ("RECORD_AND_SAVE", None, 5)
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # one folder per capture
    (out,) = [p for p in folder.iterdir() if not p.name.startswith(".")]  # MindStudio imports it as a cluster
    assert out.name.endswith("_ascend_pt")
    assert json.loads((out / "FRAMEWORK" / "steps.json").read_text()) == [3, 4, 5]
    assert (out / "ASCEND_PROFILER_OUTPUT" / "step_trace_time.csv").is_file()
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["status"] == "ok" and meta["backend"]["name"] == "torch_npu"
    assert meta["window"]["recorded_steps"] == [3, 4, 5]
    assert meta["backend"]["npu_experimental_config"]["aic_metrics"] == "ACL_AICORE_PIPE_UTILIZATION"
