"""docs/architecture.md names every package and module of ondemand_prof where it is, and no other."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT
from test_layers import PACKAGE

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


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
