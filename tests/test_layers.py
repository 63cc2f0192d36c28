"""The package's layers, read from its source (the AST of every module, nothing imported): `core` imports
nothing of ours; `rank` (inside training processes) and `host` (the daemon and ondemandctl) never import each
other, nor name each other's modules in a string (`python -m ...`, importlib); neither imports the package
root, whose __init__ imports the rank's hook (a hidden loop: __version__ lives in core/version.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "ondemand_prof"
MODULE_PATH = re.compile(r"ondemand_prof(\.[A-Za-z_][A-Za-z0-9_]*)+")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def references(path: Path, source: str | None = None) -> set[str]:
    """Every module of ours that `path` imports (relative imports resolved; `from X import y` counts as X.y
    too, for a submodule), and every string constant that is a dotted name in the package (`-m` argv, importlib;
    logger names too, which name their own layer)."""
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"), str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.fullmatch(node.value):
            found.add(node.value)
    return {name for name in found if name == "ondemand_prof" or name.startswith("ondemand_prof.")}


def crossings(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    """The imports (and module names) of `layer` that reach a `forbidden` layer or the package root."""
    out = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for name in sorted(references(path)):
            crossing = name.startswith(tuple(f"ondemand_prof.{f}" for f in forbidden))
            if crossing or name == "ondemand_prof":
                out.append(f"{path.relative_to(ROOT)} -> {name}")
    return out


def test_rank_and_host_never_import_each_other_nor_the_package_root() -> None:
    assert crossings("host", ("rank",)) == []
    assert crossings("rank", ("host",)) == []


def test_core_imports_nothing_of_ours_outside_core() -> None:
    assert crossings("core", ("rank", "host", "report", "integrations", "demo")) == []


def test_the_check_sees_every_way_of_crossing() -> None:
    """The checker on sources that cross (it would pass anything if it read nothing)."""
    host_module = PACKAGE / "host" / "commands" / "triage.py"
    for source, crossing in [("from ...rank.triage import check_args", "ondemand_prof.rank.triage"),
                             ("from ... import rank", "ondemand_prof.rank"),
                             ("import ondemand_prof.rank.hook", "ondemand_prof.rank.hook"),
                             ("def f():\n    from ...rank import triage", "ondemand_prof.rank.triage"),
                             ("ARGV = ['-m', 'ondemand_prof.rank.postprocess']", "ondemand_prof.rank.postprocess"),
                             ("from ... import __version__", "ondemand_prof")]:
        assert crossing in references(host_module, source), source
    assert references(PACKAGE / "rank" / "hook.py", "from ..core.version import __version__") == {
        "ondemand_prof.core.version", "ondemand_prof.core.version.__version__"}
