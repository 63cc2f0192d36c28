"""Setuptools hooks: ship ondemand_prof_auto.pth (the zero-code start-up hook, see ondemand_prof_auto.py) into
site-packages, from a wheel (`pip install .`) and from an editable install (`pip install -e .`).

A .pth file must sit directly in site-packages, which no pyproject key can express for both kinds of install
(data-files go under the prefix, not site-packages), so: build_py copies it to the top of the wheel, and the
editable wheel (PEP 660) gets it written beside setuptools' own __editable__ .pth file. The .pth does nothing
unless ONDEMAND_PROF_AUTO is set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "ondemand_prof_auto.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(HERE / PTH), str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class _StrategyWithPth:
    """Wraps setuptools' editable strategy: its files, plus our .pth."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, wheel: Any, files: list[str], mapping: Any) -> None:
        self.inner(wheel, files, mapping)
        wheel.writestr(PTH, (HERE / PTH).read_bytes())

    def __enter__(self) -> "_StrategyWithPth":
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


cmdclass: dict[str, Any] = {"build_py": BuildPyWithPth}
try:
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:  # setuptools older than 64: no PEP 660 editable installs to hook
    pass

setup(cmdclass=cmdclass)
