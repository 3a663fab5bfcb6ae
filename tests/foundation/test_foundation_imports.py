"""The import graph of the four parts has no cycles, and the pure core never reaches torch.

An import cycle marks a room holding two ideas (issue 23, item 3). The graph is read from the
source (``ast``), over every module of ``slotserve/``, ``engine/``, ``gateway/`` and ``operator/``,
in two ways:

- import time: module-level imports only (``if TYPE_CHECKING:`` blocks left out), what Python
  runs when a module loads. No cycle is allowed here at all.
- design: every import, including those inside functions and ``TYPE_CHECKING`` blocks (a lazy
  import only hides a cycle; the two modules still need each other). A cycle here fails unless
  it is in ``KNOWN_CYCLES`` below, each entry naming the issue item that removes it; an entry
  that no longer occurs fails too, so the list only shrinks.

The pure core (the scheduler and cache bookkeeping that DESIGN.md keeps testable without torch)
must not reach torch through any chain of import-time imports, nor in a real interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each part's folder and the import name of the package in it.
PARTS = {
    "slotserve": ROOT / "slotserve",
    "slotserve.engine": ROOT / "engine" / "slotserve" / "engine",
    "slotserve.gateway": ROOT / "gateway" / "slotserve" / "gateway",
    "slotserve.operator": ROOT / "operator" / "slotserve" / "operator",
}

# Cycles still to cut, each a strongly connected set of modules of the design graph, with the
# issue item that removes it. Remove an entry when its cycle goes (the test below fails while a
# listed cycle no longer occurs). None is left: the last, the gateway's admission front and its
# recovery, went when a ledger took the waiter and lease tables (issue 23, item 3).
KNOWN_CYCLES: dict[frozenset[str], str] = {}

# The pure core: scheduling and cache bookkeeping, and what the step loop holds instead of the
# torch classes (DESIGN.md: "pure Python and testable without torch").
PURE_CORE = [
    "slotserve.engine.core.scheduler",
    "slotserve.engine.core.kv_cache",
    "slotserve.engine.core.prefix_cache",
    "slotserve.engine.core.sequence",
    "slotserve.engine.core.params",
    "slotserve.engine.core.stats",
    "slotserve.engine.core.memory",
    "slotserve.engine.core.logprobs",
    "slotserve.engine.core.protocols",
    "slotserve.engine.core.engine",
]
FORBIDDEN_IN_PURE_CORE = "torch"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


@cache
def modules() -> dict[str, Module]:
    found = {}
    for prefix, folder in PARTS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            found[name] = Module(name, path)
    return found


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(tree: ast.Module, *, design: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements: all of them (design), or those that run when the module loads."""
    if design:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
        return

    def module_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
            elif isinstance(node, ast.If):
                if not is_type_checking(node):
                    yield from module_level(node.body)
                yield from module_level(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody):
                    yield from module_level(block)
                for handler in node.handlers:
                    yield from module_level(handler.body)

    yield from module_level(tree.body)


def imported_names(module: Module, tree: ast.Module, *, design: bool) -> Iterator[str]:
    """Absolute names of what ``module`` imports: ``from a import b`` yields ``a.b`` when that is
    a module, else ``a``."""
    for node in import_nodes(tree, design=design):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            package = module.name.split(".")
            if not module.is_package:
                package.pop()
            anchor = ".".join(package[: len(package) - (node.level - 1)])
            base = f"{anchor}.{base}" if base else anchor
        for alias in node.names:
            yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base


def owning_module(name: str) -> str | None:
    """The module of the four parts that ``name`` is, or lies in; None outside them."""
    while name:
        if name in modules():
            return name
        name = name.rpartition(".")[0]
    return None


@cache
def graph(*, design: bool) -> dict[str, frozenset[str]]:
    edges = {}
    for name, module in modules().items():
        tree = ast.parse(module.path.read_text(), filename=str(module.path))
        targets = {
            owning_module(imported) for imported in imported_names(module, tree, design=design)
        }
        edges[name] = frozenset(target for target in targets if target and target != name)
    return edges


def cycles(edges: dict[str, frozenset[str]]) -> list[frozenset[str]]:
    """Strongly connected sets of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(frozenset(members))
    return found


def describe(cycle: frozenset[str], edges: dict[str, frozenset[str]]) -> str:
    inside = [f"{a} -> {b}" for a in sorted(cycle) for b in sorted(edges[a] & cycle)]
    return "{" + ", ".join(inside) + "}"


def test_every_part_is_read() -> None:
    names = set(modules())
    for expected in (
        "slotserve.cli",
        "slotserve.contracts.pool_spec",
        "slotserve.engine.core.scheduler",
        "slotserve.gateway.admission.front",
        "slotserve.operator.handlers",
    ):
        assert expected in names
    # Edges are found, across parts too (the engine's settings take the contracts' types).
    assert "slotserve.engine.core.scheduler" in graph(design=False)["slotserve.engine.core.engine"]
    assert any(
        target.startswith("slotserve.contracts")
        for target in graph(design=False)["slotserve.engine.settings"]
    )


def test_no_import_cycle_when_modules_load() -> None:
    edges = graph(design=False)
    found = [describe(cycle, edges) for cycle in cycles(edges)]
    assert found == [], f"import cycles among module-level imports: {found}"


def test_no_import_cycle_beyond_the_known_ones() -> None:
    edges = graph(design=True)
    new = [describe(cycle, edges) for cycle in cycles(edges) if cycle not in KNOWN_CYCLES]
    assert new == [], f"new import cycles (imports in functions and TYPE_CHECKING count): {new}"


def test_every_known_cycle_still_occurs() -> None:
    found = set(cycles(graph(design=True)))
    gone = [sorted(cycle) for cycle in KNOWN_CYCLES if cycle not in found]
    assert gone == [], f"cut: remove these from KNOWN_CYCLES: {gone}"


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}}, [{"a", "b"}]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [{"a", "b", "c"}]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [{"a", "b"}, {"c", "d"}]),
    ],
)
def test_the_cycle_finder(edges: dict[str, set[str]], expected: list[set[str]]) -> None:
    found = cycles({name: frozenset(targets) for name, targets in edges.items()})
    assert sorted(map(sorted, found)) == sorted(map(sorted, expected))


def parse_for(source: str, name: str = "slotserve.engine.core.engine") -> set[str]:
    module = Module(name, Path("engine.py"))
    tree = ast.parse(source)
    return {
        f"{kind}:{imported}"
        for kind, design in (("load", False), ("design", True))
        for imported in imported_names(module, tree, design=design)
    }


def test_the_reader_tells_load_time_from_deferred_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import scheduler\n"
        "from .runner import ModelRunner\n"
        "if TYPE_CHECKING:\n"
        "    from slotserve.engine.core.sequence import Sequence\n"
        "def load():\n"
        "    import slotserve.engine.core.kv_cache\n"
    )
    found = parse_for(source)
    assert "load:slotserve.engine.core.scheduler" in found
    assert "load:slotserve.engine.core.runner" in found
    assert "load:slotserve.engine.core.sequence" not in found
    assert "design:slotserve.engine.core.sequence" in found
    assert "load:slotserve.engine.core.kv_cache" not in found
    assert "design:slotserve.engine.core.kv_cache" in found


def torch_chain(start: str) -> list[str] | None:
    """A chain of import-time imports from ``start`` to torch, or None when there is none.
    Importing a module runs its packages' ``__init__`` too, so those are followed as well."""
    edges = graph(design=False)
    parents: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        name = queue.pop(0)
        module = modules()[name]
        tree = ast.parse(module.path.read_text())
        for imported in imported_names(module, tree, design=False):
            top = imported.split(".")[0]
            if top == FORBIDDEN_IN_PURE_CORE:
                chain = [imported, name]
                while (previous := parents[chain[-1]]) is not None:
                    chain.append(previous)
                return chain[::-1]
        packages = [name.rsplit(".", depth)[0] for depth in range(1, name.count("."))]
        for target in [*edges[name], *(p for p in packages if p in modules())]:
            if target not in parents:
                parents[target] = name
                queue.append(target)
    return None


@pytest.mark.parametrize("name", PURE_CORE)
def test_the_pure_core_reaches_no_torch(name: str) -> None:
    assert name in modules()
    chain = torch_chain(name)
    assert chain is None, " -> ".join(chain or [])


def test_the_torch_check_finds_a_real_chain() -> None:
    chain = torch_chain("slotserve.engine.core.model.runner")
    assert chain is not None and chain[0] == "slotserve.engine.core.model.runner"
    assert chain[-1].split(".")[0] == "torch"


def test_importing_the_pure_core_loads_no_torch() -> None:
    code = (
        "import sys\n"
        + "".join(f"import {name}\n" for name in PURE_CORE)
        + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
