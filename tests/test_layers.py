"""The package's layers, read from its source (the AST of every module, nothing imported): `core` imports
nothing of ours; `rank` (inside training processes) and `host` (the daemon and ondemandctl) never import each
other, nor name each other's modules in a string (`python -m ...`, importlib); neither imports the package
root, whose __init__ imports the rank's hook (a hidden loop: __version__ lives in core/version.py). And no two
modules import each other, directly or round a circle of any length.

What counts as an import, for circles: every import statement in the module, at its top, inside a function
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
# No import circles

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


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's, without recursion): each is
    a set of modules every one of which imports every other, round some circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                else:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = import_graph()
    found = circles(graph)
    said = ["; ".join(f"{a} -> {', '.join(sorted(graph[a] & set(c)))}" for a in c) for c in found]
    assert found == [], "import circles:\n" + "\n".join(said)


def test_the_circle_check_sees_lazy_and_type_only_imports() -> None:
    """The checker on sources that close circles (it would pass anything if it read nothing)."""
    lazy = {"ondemand_prof.host.metrics": "def f():\n    from .transport import is_loopback\n",
            "ondemand_prof.host.transport": "from .metrics import MetricsServer\n"}
    assert circles(import_graph(lazy)) == [["ondemand_prof.host.metrics", "ondemand_prof.host.transport"]]
    typed = {"ondemand_prof.rank.file_trigger": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from .agent import Agent\n",
             "ondemand_prof.rank.agent": "from .file_trigger import FileTrigger\n"}
    assert circles(import_graph(typed)) == [["ondemand_prof.rank.agent", "ondemand_prof.rank.file_trigger"]]
    # a package is its __init__: naming a class of the package closes a circle through it
    via_package = {"ondemand_prof.host.multihost": "from .commands import Command\n",
                   "ondemand_prof.host.commands.capture": "from ..multihost import launch\n"}
    assert any({"ondemand_prof.host.commands", "ondemand_prof.host.commands.capture",
                "ondemand_prof.host.multihost"} <= set(c) for c in circles(import_graph(via_package)))
    # so does a submodule of it, from outside: its package's __init__ runs first (and imports every command)
    via_module = {**via_package, "ondemand_prof.host.multihost": "from .commands.base import Command\n",
                  "ondemand_prof.host.commands.base": "class Command: ...\n"}
    assert any({"ondemand_prof.host.commands", "ondemand_prof.host.commands.capture",
                "ondemand_prof.host.multihost"} <= set(c) for c in circles(import_graph(via_module)))
    # the audit's case: commands/__init__ -> capture -> rendering -> report.text -> (base, so) commands/__init__
    parent = {"ondemand_prof.report.text": "from ..host.commands.base import table\n",
              "ondemand_prof.host.commands.capture": "from .rendering import print_report\n",
              "ondemand_prof.host.commands.rendering": "def f():\n    from ...report.text import render_text\n"}
    assert any({"ondemand_prof.host.commands", "ondemand_prof.host.commands.capture",
                "ondemand_prof.host.commands.rendering", "ondemand_prof.report.text"} <= set(c)
               for c in circles(import_graph(parent)))
    # from inside the package it is no circle: capture importing its sibling base does not run commands/__init__
    inside = {"ondemand_prof.host.commands.capture": "from .base import Command\n",
              "ondemand_prof.host.commands.base": "from ..client import dumps\n"}
    assert circles(import_graph(inside)) == []
    three = {"ondemand_prof.core.a": "from . import b\n", "ondemand_prof.core.b": "import ondemand_prof.core.c\n",
             "ondemand_prof.core.c": "from .a import x\n"}
    assert circles(import_graph(three)) == [["ondemand_prof.core.a", "ondemand_prof.core.b", "ondemand_prof.core.c"]]


# ----------------------------------------------------------------------------------------------------------
# The quick tier holds what runs in this process

STARTS_PROCESSES = re.compile(r"\b(subprocess|Popen|start_ranks|run_ranks|start_daemon|daemon\(|ctl\(|ctl_json|"
                              r"live_ranks|cluster|multiprocessing|os\.fork|mp\.spawn)\b")


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


def quick_module(source: str) -> bool:
    """Whether a test module puts all its tests in the quick tier (a top-level `pytestmark` naming it)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return "quick" in ast.unparse(node.value)
    return False


def test_a_test_module_that_starts_no_process_is_in_the_quick_tier() -> None:
    """`scripts/test.sh --quick` runs the tests marked quick (conftest.py): a module that starts no process (no
    rank, daemon, CLI or child of its own) marks itself, so a new one cannot be left out as the hand-kept list
    of file names left test_planning.py and this module out."""
    unmarked = [p.name for p in sorted((ROOT / "tests").glob("test_*.py"))
                if not STARTS_PROCESSES.search(text := p.read_text(encoding="utf-8")) and not quick_module(text)]
    assert unmarked == []
    assert quick_module("import pytest\npytestmark = pytest.mark.quick\n")
    assert not quick_module("import pytest\npytestmark = [pytest.mark.slow]\n") and not quick_module("x = 1\n")


ARCHITECTURE = ROOT / "docs" / "architecture.md"
SECTION = re.compile(r"^  ([a-z_]+)/")  # a package's line in the tree: two spaces, its name, a slash


def _architecture_sections() -> dict[str, str]:
    """docs/architecture.md's module tree: each package's text (its lines, descriptions included)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    tree = text.split("```", 2)[1]
    sections: dict[str, list[str]] = {}
    current = None
    for line in tree.splitlines():
        m = SECTION.match(line)
        if m:
            current = m.group(1)
        elif line and not line.startswith(" "):  # examples/, tests/, bench/ ...: outside the package
            current = None
        if current is not None:
            sections.setdefault(current, []).append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def test_the_architecture_page_lists_every_module_and_no_other() -> None:
    """Issue 30, item 6: docs/architecture.md is checked against the code, as the options reference is: every
    module of each package (subpackages included) is named in its package's part of the tree, and every module
    named there exists."""
    sections = _architecture_sections()
    packages = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(sections) == packages, (sorted(sections), packages)
    problems = []
    for package in packages:
        actual = {p.name for p in (PACKAGE / package).rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
        named = set(re.findall(r"\b([a-z_][a-z0-9_]*\.py)\b", sections[package]))
        problems += [f"{package}/: {name} is not on the page" for name in sorted(actual - named)]
        problems += [f"{package}/: {name} is on the page but not in the package" for name in sorted(named - actual)]
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------------------------------
# One place a request becomes a window

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
