"""No two modules of the package import each other, directly or round a circle of any length (read from the source,
nothing imported; what counts as an import is test_layers.py's import graph: every import statement, lazy and
type-only ones too, a package counting as its __init__)."""

from __future__ import annotations

import pytest

from test_layers import import_graph

pytestmark = pytest.mark.quick  # in-process: the quick tier (conftest.py)


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
