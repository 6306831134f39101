"""The seams between modules (STYLE.md habit 13), read from the source with ``ast``.

- No import cycle: the graph of every import in ``stream_persia`` and ``api`` (the package
  ``stream_persia.api``), module-level and function-level alike (a function-level import
  only postpones a cycle to the first call), has no strongly connected component. Only
  imports under ``if TYPE_CHECKING:`` are left out: they never run.
- No private access across modules: ``x._name`` in module A, where ``_name`` is a private
  name that some other module of the package defines (a method or attribute of one of its
  classes, or a module-level name) and A does not, is reaching into another module's
  internals. ``self._x``, ``cls._x`` and ``super()._x`` are the class's own. A private name
  that no module of the package defines belongs to the standard library or a third party:
  it is allowed only when :data:`FOREIGN_PRIVATE` lists it with the reason.
  (``getattr``/``setattr``/``hasattr`` with a constant name count as access too.) The rule
  goes by name, not by type: a private name that A defines as well passes in A (it may
  be A's own class), unless the receiver was imported from outside the package.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (("stream_persia", "stream_persia"), ("api", "stream_persia.api"))

#: Private names of the standard library and third parties that the package uses, with
#: why: ``(module, name) -> reason``.
FOREIGN_PRIVATE: dict[tuple[str, str], str] = {
    ("stream_persia.kafka._client", "_client"):
        "aiokafka's consumer has no public way to its cluster metadata client "
        "(fetch_all_metadata for the partitions of a topic)",
    ("stream_persia.kafka.consumer", "_client"):
        "aiokafka's consumer: its metadata client tells the broker watch whether the "
        "topic's brokers answer (no public API says so)",
    ("stream_persia.kafka.liveness", "_client"):
        "aiokafka offers no public liveness signal; the client's connections are read to "
        "tell a dead broker from an idle one",
    ("stream_persia.kafka.liveness", "_sender"):
        "aiokafka's producer: its sender task is the only sign that the producer died",
    ("stream_persia.kafka.liveness", "_message_accumulator"):
        "aiokafka's producer: pending sends are failed at once when the broker is gone "
        "(aiokafka would wait for its request timeout)",
    ("stream_persia.testing.kafka_mock", "_exit"):
        "os._exit: the forked broker process must not run the parent's atexit handlers",
    ("stream_persia.core.logger", "_stream_persia"):
        "a marker this module sets on the logging handlers it installs, so that it "
        "recognises them again (logging.Handler has no slot for it)",
    ("stream_persia.core.watermarks", "_fields"):
        "typing.NamedTuple's public field list (underscored only to avoid field clashes)",
    ("stream_persia.core.watermarks", "_replace"):
        "typing.NamedTuple's public copy-with-changes (underscored only to avoid field "
        "clashes)",
    ("stream_persia.api.metrics", "_replace"):
        "typing.NamedTuple's public copy-with-changes (prometheus_client's Sample)",
}


def _modules(root: Path) -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, package in PACKAGES:
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            if folder == "stream_persia" and rel.parts[0] == "api":
                continue   # a developer's link to api/ (git ignores it): counted once
            name = ".".join((package, *rel.parts))
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            mods[name] = path
    return mods


def _parse(path: Path) -> ast.Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):   # imports for the type checker only never run
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            node.body = []
    return tree


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


# ---------------------------------------------------------------------- import graph
def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """``module -> {imported module of the package: line of the first such import}``."""
    mods = _modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(_parse(path)):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = mod.split(".")
                    keep = len(parts) - node.level + (1 if is_pkg else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                targets = [resolve(f"{base}.{a.name}") or resolve(base) for a in node.names]
            for target in targets:
                if target is not None and target != mod:
                    graph[mod].setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph.get(w, {}))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, dict[str, int]], mods: dict[str, Path]
              ) -> str:
    inside = set(component)
    edges = [f"    {a} -> {b}  ({mods[a].relative_to(ROOT)}:{line})"
             for a in component for b, line in sorted(graph[a].items()) if b in inside]
    return f"import cycle among {', '.join(component)}:\n" + "\n".join(edges)


def test_import_graph_has_no_cycle():
    graph = import_graph()
    # The graph is really read: these modules and this edge exist.
    assert len(graph) > 100
    assert "stream_persia.api.app" in graph
    assert "stream_persia.nn.cluster" in graph["stream_persia.nn.embedding_ctx"]
    found = cycles(graph)
    mods = _modules(ROOT)
    assert not found, "\n".join(_describe(c, graph, mods) for c in found)


def test_cycle_finder_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "stream_persia"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from stream_persia.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    import stream_persia.sub.a\n")
    (pkg / "sub" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from stream_persia.sub "
        "import a\nfrom stream_persia.sub import e\n")
    (pkg / "sub" / "e.py").write_text("import typing\nif typing.TYPE_CHECKING:\n"
                                      "    from stream_persia.sub import d\n")
    graph = import_graph(tmp_path)
    assert cycles(graph) == [["stream_persia.sub.a", "stream_persia.sub.b",
                              "stream_persia.sub.c"]]


# ---------------------------------------------------------------------- private access
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private(tree: ast.Module) -> set[str]:
    """Private names this module defines: module level, in class bodies, and as
    ``self._x = ...`` / ``cls._x = ...`` attributes."""
    names: set[str] = set()

    def bound(node: ast.AST) -> Iterator[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        yield n.id

    for node in tree.body:
        names.update(n for n in bound(node) if _private(n))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                names.update(n for n in bound(item) if _private(n))
                if isinstance(item, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets):
                    names.update(c.value for c in ast.walk(item.value)
                                 if isinstance(c, ast.Constant) and isinstance(c.value, str)
                                 and _private(c.value))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
              and _private(node.attr)):
            names.add(node.attr)
    return names


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names this module binds by importing from outside the package (``os``, ...)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names
                         if a.name.partition(".")[0] != "stream_persia")
        elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
              and node.module.partition(".")[0] != "stream_persia"):
            names.update(a.asname or a.name for a in node.names)
    return names


def _own(receiver: ast.expr) -> bool:
    if isinstance(receiver, ast.Name):
        return receiver.id in ("self", "cls")
    return (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
            and receiver.func.id == "super")


def _accesses(tree: ast.Module) -> Iterator[tuple[ast.expr, str, int]]:
    """``(receiver, private name, line)`` of every ``x._name`` and ``getattr(x, "_name")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.value, node.attr, node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            yield node.args[0], node.args[1].value, node.lineno


def private_access_violations(root: Path = ROOT) -> list[str]:
    mods = _modules(root)
    trees = {m: _parse(p) for m, p in mods.items()}
    defined = {m: _defined_private(t) for m, t in trees.items()}
    owners: dict[str, list[str]] = defaultdict(list)
    for m, names in defined.items():
        for n in names:
            owners[n].append(m)
    found = []
    for mod, tree in trees.items():
        where = mods[mod].relative_to(root)
        foreign = _foreign_names(tree)
        for receiver, name, line in _accesses(tree):
            if _own(receiver):
                continue
            outside = isinstance(receiver, ast.Name) and receiver.id in foreign
            if not outside and name in defined[mod]:
                continue
            if not outside and owners.get(name):
                found.append(f"{where}:{line}: {ast.unparse(receiver)}.{name} reaches into "
                             f"{', '.join(sorted(owners[name]))}")
            elif (mod, name) not in FOREIGN_PRIVATE:
                found.append(f"{where}:{line}: {ast.unparse(receiver)}.{name}: a private "
                             f"name of the standard library or a third party; use a public "
                             f"API, or list it in FOREIGN_PRIVATE with the reason")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_no_private_access_across_modules():
    found = private_access_violations()
    assert not found, "private access across modules:\n" + "\n".join(found)


def test_foreign_private_list_is_current():
    """Every allowance is still used (a stale one would hide the next real use)."""
    mods = _modules(ROOT)
    used = {(m, name) for m, p in mods.items() for _, name, _ in _accesses(_parse(p))}
    assert set(FOREIGN_PRIVATE) <= used, set(FOREIGN_PRIVATE) - used


def test_private_access_finder_sees_cross_module_use(tmp_path):
    pkg = tmp_path / "stream_persia"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "class A:\n    _limit = 1\n    def __init__(self):\n        self._n = 0\n"
        "    def _step(self):\n        return self._n\n"
        "    def same(self, other: 'A'):\n        return other._n + A._limit\n")
    (pkg / "b.py").write_text(
        "import os\nfrom stream_persia.a import A\n"
        "def use(a: A):\n    a._step()\n    return getattr(a, '_n')\n"
        "def out():\n    os._exit(0)\n")
    found = private_access_violations(tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == ["stream_persia/b.py:4",
                                                    "stream_persia/b.py:5",
                                                    "stream_persia/b.py:7"], found


if __name__ == "__main__":   # a quick report: python3 tests/test_seams.py
    g = import_graph()
    for c in cycles(g):
        print(_describe(c, g, _modules(ROOT)))
    print("\n".join(private_access_violations()))
    sys.exit(0)
