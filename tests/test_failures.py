"""The training run never notices the profiler failing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from conftest import captures
from ondemand_prof import OnDemandProfiler, ProfileConfig
from ondemand_prof.rank.backends.torch_backend import TorchBackend

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


class ExplodingBackend(TorchBackend):
    """A real torch backend whose sessions fail at a chosen call, like a profiler bug or a driver error."""

    def __init__(self, fail_in: str) -> None:
        super().__init__()
        self.fail_in = fail_in
        self.opened = 0

    def open(self, window, identity, staging=None):
        self.opened += 1
        session = super().open(window, identity, staging)
        original = getattr(session, self.fail_in)

        def boom(*args, **kwargs):
            original(*args, **kwargs)
            raise RuntimeError(f"injected failure in {self.fail_in}")

        setattr(session, self.fail_in, boom)
        return session


def train(prof: OnDemandProfiler, steps: int) -> int:
    model = torch.nn.Linear(16, 16)
    done = 0
    for _ in range(steps):
        model(torch.randn(4, 16)).sum().backward()
        prof.step()
        done += 1
    return done


def test_backend_failure_is_logged_and_training_continues(tmp_path: Path, caplog) -> None:
    cfg = ProfileConfig(enabled=True, step_start=2, step_end=4, save_path=str(tmp_path), ondemand=False,
                        min_free_mb=0)
    backend = ExplodingBackend("record")
    prof = OnDemandProfiler(cfg, backend=backend)
    with caplog.at_level(logging.ERROR, logger="ondemand_prof"):
        train(prof, 8)  # raising here would fail the test too
    # the window was tried (and failed inside it), and the hook went on counting the loop's steps after it
    assert backend.opened == 1 and prof.current_step == 8 and prof.state != "disabled"
    assert prof.close()
    assert "profiling window failed (training continues): RuntimeError: injected failure in record" in caplog.text
    assert captures(tmp_path) == []
    assert prof.active_window is None


def test_repeated_failures_disable_the_hook_with_one_line(tmp_path: Path, caplog) -> None:
    backend = ExplodingBackend("warmup")
    cfg = ProfileConfig(save_path=str(tmp_path), ondemand=False, min_free_mb=0)
    prof = OnDemandProfiler(cfg, backend=backend)
    from ondemand_prof.core.window import Window

    with caplog.at_level(logging.ERROR, logger="ondemand_prof"):
        for i in range(5):
            prof.call_at_next_step(lambda step, i=i: prof.submit(Window(step + 2 + 10 * i, step + 3 + 10 * i,
                                                                       source="test", capture_id=f"t{i}")))
            train(prof, 12)
    assert backend.opened == 3  # the fourth and fifth requests find the hook disabled
    disabled = [r for r in caplog.records if "disabled after 3 consecutive failures" in r.getMessage()]
    assert len(disabled) == 1
    # the refused requests were answered, and the disabled hook is back on the idle counter
    assert "step" in prof.__dict__
    assert prof.close()


class FailingWriteBackend(TorchBackend):
    """Collection works; writing the trace fails in the background (as on a disk that fills mid-export)."""

    def open(self, window, identity, staging=None):
        session = super().open(window, identity, staging)
        finish = session.finish

        def finish_then_fail_write():
            export = finish()

            def write(staging_dir):
                raise OSError(28, "No space left on device")

            export.write = write
            return export

        session.finish = finish_then_fail_write
        return session


def test_export_failure_is_recorded_in_metadata(tmp_path: Path) -> None:
    cfg = ProfileConfig(enabled=True, step_start=1, step_end=3, save_path=str(tmp_path), ondemand=False,
                        min_free_mb=0)
    prof = OnDemandProfiler(cfg, backend=FailingWriteBackend())
    assert train(prof, 5) == 5
    assert prof.close()
    (cap,) = captures(tmp_path)
    assert cap["status"] == "failed"
    assert cap["error"] == "OSError: [Errno 28] No space left on device"
    assert cap["window"]["recorded_steps"] == [1, 2]
