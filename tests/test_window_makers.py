"""One place a request becomes a window: only core/requests.py constructs a Window (read from the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT
from test_layers import PACKAGE

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


def window_makers(sources: dict[Path, str] | None = None) -> list[str]:
    """The modules that construct a Window themselves (a call to the class, by its name)."""
    if sources is None:
        sources = {p: p.read_text(encoding="utf-8") for p in sorted(PACKAGE.rglob("*.py"))}
    return sorted({str(p.relative_to(ROOT)) for p, source in sources.items() for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Window"})


def test_every_window_is_made_by_resolve_or_read_from_the_wire() -> None:
    """Issue 30 item 2: every entry (CLI, trigger file, signal, automatic, static window) goes through
    core/requests.py resolve; the static window was built in rank/hook.py. The check sees one built elsewhere."""
    assert window_makers() == ["ondemand_prof/core/requests.py"]
    hook = PACKAGE / "rank" / "hook.py"
    assert "ondemand_prof/rank/hook.py" in window_makers({hook: "w = Window(0, 2, options)\n"})
