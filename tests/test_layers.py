"""The package's layers, read from its source (the AST of every module, nothing imported): `core` imports
nothing of ours; `rank` (inside training processes) and `host` (the daemon and ondemandctl) never import each
other, nor name each other's modules in a string (`python -m ...`, importlib); neither imports the package
root, whose __init__ imports the rank's hook (a hidden loop: __version__ lives in core/version.py). A command
imports only its base and the shared console helpers. The import graph built here is also what
test_import_circles.py reads (no two modules import each other, directly or round a circle of any length).

What counts as an import, in that graph: every import statement in the module, at its top, inside a function
(run when it is called: a lazy import that closes a circle is a circle that waits) and under `if TYPE_CHECKING:`
(a loop only the type checker follows is still two modules that cannot be read, changed or tested apart). A
package counts as its __init__: `from .commands import Command` imports the package's __init__, which imports
every command. Importing a submodule runs every package above it first: `from ..host.commands.base import table`
in report/text.py imports base and commands/__init__ (every command) and host/__init__; a module inside a
package does not import that package again (commands/capture.py importing .base runs no commands/__init__: it
is already running)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)

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


# ----------------------------------------------------------------------------------------------------------
# The import graph (test_import_circles.py checks it has no circle; the commands' check is below)

def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, known: set[str], source: str | None = None) -> set[str]:
    """The modules of ours that `path` imports, anywhere in it (see the module's docstring): `from X import y` is
    X.y when that is a module, else X (a name in X); a name that is no module of ours is dropped."""
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"), str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            names.extend(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    out = set()
    for name in names:
        parts = name.split(".")
        found = next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in known), None)
        if found is not None:
            out.add(found)
    # importing a.b.c runs a/__init__ and a/b/__init__ first: the packages above every module imported, except
    # those above the importer (already running when it is read; an edge to them would make every package that
    # imports its own submodules a circle)
    own = _ancestors(_module_name(path)) | {_module_name(path)}
    out |= {a for m in out for a in _ancestors(m) if a in known and a not in own}
    out.discard(_module_name(path))
    return out


def _ancestors(module: str) -> set[str]:
    """The packages above `module`: ondemand_prof.host.commands.base -> ondemand_prof.host.commands,
    ondemand_prof.host, ondemand_prof."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the modules it imports; `sources` (module -> text) stands in for files (the checker's test)."""
    found = modules()
    known = set(found) | set(sources or {})
    path = {name: found[name] if name in found else ROOT / (name.replace(".", "/") + ".py") for name in known}
    return {name: imported(path[name], known, (sources or {}).get(name)) for name in sorted(known)}


# ----------------------------------------------------------------------------------------------------------
# A command imports only its base and the shared console helpers


COMMANDS = "ondemand_prof.host.commands"
SHARED_CONSOLE = {f"{COMMANDS}.base", f"{COMMANDS}.follow", f"{COMMANDS}.rendering"}  # what every command may use


def sibling_imports(graph: dict[str, set[str]]) -> list[str]:
    """A command module importing another command's module (not the base or a shared console helper)."""
    return sorted(f"{mod} imports {dep}" for mod, deps in graph.items()
                  if mod.startswith(f"{COMMANDS}.") and mod not in SHARED_CONSOLE
                  for dep in deps if dep.startswith(f"{COMMANDS}.") and dep not in SHARED_CONSOLE)


def test_a_command_imports_only_its_base_and_the_shared_console_helpers() -> None:
    """Issue 30 item 5: capture imported report's rendering; commands are written against their base and the
    shared console modules (follow, rendering), never each other. The check sees a sibling import (synthetic)."""
    assert sibling_imports(import_graph()) == []
    fake = {f"{COMMANDS}.capture": "from .report import Report\n"}
    assert sibling_imports(import_graph(fake)) == [f"{COMMANDS}.capture imports {COMMANDS}.report"]


def test_the_shared_console_helpers_hold_no_command() -> None:
    """A command in a shared helper (watch was in follow.py) would let any command import it as a sibling."""
    from ondemand_prof.host.commands import COMMANDS as ALL

    assert not [type(c).__name__ for c in ALL if type(c).__module__ in SHARED_CONSOLE - {f"{COMMANDS}.base"}]
