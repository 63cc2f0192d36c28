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


# One test at a time, in a module that also starts processes: the test, and what it names (its fixtures, the
# module's helpers and classes, those of conftest.py and those imported from another test module, each followed
# through what it names), and the autouse fixtures. What starts a process: the suite's helpers and the standard
# library's ways (STARTS_PROCESSES), and the package's starters a test calls itself (a Python child, the helpers'
# spawn, the forked trace save, a profiler whose windows are post-processed in a child, a report over several
# traces in a process pool, bench/gpu_check.py's child): a child started inside package code is not in the
# test's text, so a test that starts one through a starter not named here reads as in-process. Name it here.
PACKAGE_STARTERS = re.compile(r"\b(sys\.executable|spawn_background|save_trace|OnDemandProfiler|build_report|"
                              r"memory_viz_reads)\b")


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
    return out


def _named(node: ast.AST) -> set[str]:
    """The names a definition uses: variables, parameters (a test's fixtures) and strings (usefixtures)."""
    return {n.id if isinstance(n, ast.Name) else n.arg if isinstance(n, ast.arg) else str(n.value)
            for n in ast.walk(node) if isinstance(n, (ast.Name, ast.arg))
            or isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _marked(node: ast.AST, mark: str) -> bool:
    return any(f"mark.{mark}" in ast.unparse(d) or f"{mark}=True" in ast.unparse(d)
               for d in getattr(node, "decorator_list", ()))


def unmarked_in_process(sources: dict[str, str]) -> list[str]:
    """The tests (module stem -> source; conftest's among them) that name nothing that starts a process and are
    not in the quick tier, outside modules wholly in it."""
    trees = {m: ast.parse(text) for m, text in sources.items()}
    defs = {m: _top_level(t) for m, t in trees.items()}
    imported = {m: {a.asname or a.name: (node.module, a.name) for node in t.body if isinstance(node, ast.ImportFrom)
                    and node.module in sources for a in node.names} for m, t in trees.items()}

    def resolve(module: str, name: str) -> tuple[str, ast.AST] | None:
        if name in defs[module]:
            return module, defs[module][name]
        if name in imported[module]:
            return resolve(*imported[module][name])
        return ("conftest", defs["conftest"][name]) if name in defs.get("conftest", {}) else None

    out = []
    for module in sorted(m for m in sources if m.startswith("test_") and not quick_module(sources[m])):
        autouse = [(m, n) for name in [*defs[module], *imported[module]] if (found := resolve(module, name))
                   for m, n in [found] if _marked(n, "autouse")]
        autouse += [("conftest", n) for n in defs.get("conftest", {}).values() if _marked(n, "autouse")]
        for name, test in defs[module].items():
            if not name.startswith("test_") or not isinstance(test, ast.FunctionDef) or _marked(test, "quick"):
                continue
            seen: set[int] = set()
            text = []
            todo = [(module, test), *autouse]
            while todo:
                where, node = todo.pop()
                if id(node) in seen:
                    continue
                seen.add(id(node))
                text.append(ast.unparse(node))
                todo += [found for used in _named(node) if (found := resolve(where, used)) is not None]
            if not any(pattern.search("\n".join(text)) for pattern in (STARTS_PROCESSES, PACKAGE_STARTERS)):
                out.append(f"{module}.py::{name}")
    return out


def test_a_test_that_starts_no_process_is_in_the_quick_tier() -> None:
    """The quick tier holds every in-process test (issue item 7), in a module of mixed tests too: one that names
    no rank, daemon, CLI or child (none of its fixtures and helpers does) is marked @pytest.mark.quick."""
    sources = {p.stem: p.read_text(encoding="utf-8") for p in sorted((ROOT / "tests").glob("*.py"))}
    assert unmarked_in_process(sources) == []


def test_the_quick_tier_check_follows_fixtures_and_helpers() -> None:
    """The checker on sample modules (it would pass anything if it read nothing)."""
    conftest = (ROOT / "tests" / "conftest.py").read_text(encoding="utf-8")
    sample = """
import subprocess, sys
import pytest
from conftest import inprocess_daemon, run_ranks
from test_b import helper, quiet

@pytest.fixture
def child():
    return subprocess.Popen(["true"])

def _ranks():
    return run_ranks(["--steps", "2"])

def test_pure(): assert 1
@pytest.mark.quick
def test_marked(): assert 1
def test_in_process_daemon(tmp_path): inprocess_daemon(tmp_path)
def test_fixture(child): assert child
def test_helper(): _ranks()
def test_imported(): helper()
def test_imported_quiet(): quiet()
def test_conftest_fixture(env): assert env
def test_python_child(): assert sys.executable
@pytest.mark.usefixtures("child")
def test_used_fixture(): assert 1
"""
    b = "import subprocess\ndef helper():\n    subprocess.run(['true'])\ndef quiet():\n    return 1\n"
    assert unmarked_in_process({"conftest": conftest, "test_a": sample, "test_b": b}) == [
        "test_a.py::test_pure", "test_a.py::test_in_process_daemon", "test_a.py::test_imported_quiet"]
    starting = "import pytest\n@pytest.fixture(autouse=True)\ndef ranks():\n    start_ranks([])\n"
    assert unmarked_in_process({"conftest": conftest, "test_a": starting + sample, "test_b": b}) == []
    assert unmarked_in_process({"conftest": conftest, "test_a": "pytestmark = pytest.mark.quick\n" + sample}) == []


ARCHITECTURE = ROOT / "docs" / "architecture.md"
ENTRY = re.compile(r"[a-z_][a-z0-9_]*(/|\.py,?)")  # a tree line's first word: a directory, or a module (`ctl.py,`)
MODULE_NAME = re.compile(r"(?<![\w/.])((?:[a-z_][a-z0-9_]*/)*[a-z_][a-z0-9_]*\.py)\b")


def page_tree(text: str) -> tuple[set[str], set[str], list[str]]:
    """docs/architecture.md's tree of the package (its first code block, under `ondemand_prof/`): the
    directories and the modules it names, as paths in the package (`host/commands/`, `host/commands/triage.py`),
    and the lines it could not place. A line indented 2, 4 or 6 spaces is an entry: a directory (`commands/`)
    or a module (`triage.py`) in the directory above it; a deeper line continues the entry above. Every `x.py`
    on an entry's lines is in the entry's directory (a directory's own line and its continuation lines list its
    modules: `backends/   torch_backend.py, npu.py`); `a/b.py` is a path from the package. A line at the margin
    ends the package (`examples/`, `tests/`, `bench/`)."""
    tree = text.split("```", 2)[1]
    dirs: set[str] = set()
    named: set[str] = set()
    unread: list[str] = []
    inside = False
    stack: list[str] = []  # the directory of the entry above, from the package down
    here = ""  # where the current entry's modules are
    for line in tree.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        first = line.split()[0]
        if indent == 0:
            inside = first == "ondemand_prof/"
            stack, here = [], ""
            continue
        if not inside:
            continue
        if indent in (2, 4, 6):
            depth = indent // 2 - 1
            if not ENTRY.fullmatch(first) or depth > len(stack):
                unread.append(line)
                continue
            stack = stack[:depth]
            if first.endswith("/"):
                stack.append(first[:-1])
                dirs.add("/".join(stack) + "/")
            here = "/".join(stack)
        elif indent < 8:
            unread.append(line)
            continue
        for name in MODULE_NAME.findall(line):
            named.add(name if "/" in name or not here else f"{here}/{name}")
    return dirs, named, unread


def package_tree() -> tuple[set[str], set[str]]:
    """The package's directories (with an __init__.py) and modules (__init__ and __main__ apart), as paths in it."""
    dirs = {f"{p.parent.relative_to(PACKAGE).as_posix()}/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    return dirs, modules


def page_problems(text: str, actual: tuple[set[str], set[str]] | None = None) -> list[str]:
    """What the page's tree gets wrong against `actual` (directories, modules; the package's own by default)."""
    dirs, named, unread = page_tree(text)
    actual_dirs, modules = actual if actual is not None else package_tree()
    return ([f"{d} is not on the page" for d in sorted(actual_dirs - dirs)]
            + [f"{d} is on the page but not in the package" for d in sorted(dirs - actual_dirs)]
            + [f"{m} is not on the page" for m in sorted(modules - named)]
            + [f"{m} is on the page but not in the package" for m in sorted(named - modules)]
            + [f"cannot read the line {line!r}" for line in unread])


def test_the_architecture_page_lists_every_module_and_no_other() -> None:
    """Issue 30, item 6: docs/architecture.md is checked against the code, as the options reference is: every
    package and module (subpackages included) is named in the tree where it is, by its path in the package
    (host/triage.py and host/commands/triage.py are two modules), and every one named there exists."""
    assert page_problems(ARCHITECTURE.read_text(encoding="utf-8")) == []


SAMPLE_PAGE = """# A page
```
ondemand_prof/
  host/                 the daemon
    triage.py           pending triage requests
    commands/           one class per command: base.py, triage.py (stacks,
                        memory), watch.py
    ctl.py, profd.py    entry points; sdnotify.py
  rank/                 in the rank
    backends/           torch_backend.py, npu.py
    hook.py             the hook (its window: core/window.py)
examples/               not the package: train.py
```
"""


def test_the_page_check_reads_paths_not_names() -> None:
    """The checker on a sample page (it would pass anything if it read nothing): where each module is, from the
    tree; a module named in one package only is missing from the other (host/triage.py was taken for
    host/commands/triage.py when names were compared); a module or directory that does not exist; a line out of
    place."""
    dirs, named, unread = page_tree(SAMPLE_PAGE)
    assert dirs == {"host/", "host/commands/", "rank/", "rank/backends/"} and unread == []
    assert named == {"host/triage.py", "host/commands/base.py", "host/commands/triage.py", "host/commands/watch.py",
                     "host/ctl.py", "host/profd.py", "host/sdnotify.py", "rank/backends/torch_backend.py",
                     "rank/backends/npu.py", "rank/hook.py", "core/window.py"}
    actual = (dirs | {"core/"}, named | {"host/stalls.py"})
    assert page_problems(SAMPLE_PAGE, actual) == ["core/ is not on the page", "host/stalls.py is not on the page"]
    one_triage = SAMPLE_PAGE.replace("triage.py (stacks", "(stacks")
    assert page_problems(one_triage, actual)[1:] == ["host/commands/triage.py is not on the page",
                                                     "host/stalls.py is not on the page"]
    assert page_problems(SAMPLE_PAGE.replace("    triage.py ", "    stalls.py "), actual)[1:] == [
        "host/triage.py is not on the page"]
    assert page_problems(SAMPLE_PAGE.replace("backends/ ", "backend/  "), actual)[1:] == [
        "rank/backends/ is not on the page", "rank/backend/ is on the page but not in the package",
        "host/stalls.py is not on the page", "rank/backends/npu.py is not on the page",
        "rank/backends/torch_backend.py is not on the page",
        "rank/backend/npu.py is on the page but not in the package",
        "rank/backend/torch_backend.py is on the page but not in the package"]
    assert page_problems(SAMPLE_PAGE.replace("    hook.py ", "   hook.py "), actual)[1:] == [
        "core/window.py is not on the page", "host/stalls.py is not on the page", "rank/hook.py is not on the page",
        "cannot read the line '   hook.py             the hook (its window: core/window.py)'"]


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
