"""The package type-checks: mypy, as configured in pyproject.toml ([tool.mypy]: Python 3.10), reports nothing.
ProfileConfig's fields and the report's model (report/model.py) are what editors and mypy see; this keeps them
true. The first run in a checkout takes about 25 s of CPU (torch's own types; [tool.mypy] does not follow
transformers and Lightning); later ones reuse .mypy_cache."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import ROOT


def test_mypy_reports_no_error() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    res = subprocess.run([sys.executable, "-m", "mypy", "ondemand_prof"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, f"mypy found errors:\n{res.stdout}{res.stderr}"
    assert "Success: no issues found" in res.stdout
