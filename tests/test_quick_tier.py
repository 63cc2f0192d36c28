"""The quick tier (`scripts/test.sh --quick`, conftest.py) holds what runs in this process: a test module that starts
no process marks itself, and in a module that does, a test naming nothing that starts one (its code, fixtures and
helpers) is marked one by one. Read from the tests' source (the AST), nothing run."""

from __future__ import annotations

import ast
import re

import pytest

from conftest import ROOT

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


STARTS_PROCESSES = re.compile(r"\b(subprocess|Popen|start_ranks|run_ranks|start_daemon|daemon\(|ctl\(|ctl_json|"
                              r"live_ranks|cluster|multiprocessing|os\.fork|mp\.spawn)\b")


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
