#!/usr/bin/env python3
"""Import graph of UCM's own packages (ucm_protocol, ucm_server, ucm_client), read with `ast` only.

Stand-alone: imports nothing of UCM, executes nothing of it, so it runs on any checkout.

Every `import` statement inside the three packages is classified by where it sits:

  runtime   module level (also inside class bodies, try/except, plain `if`): runs at import time
  typing    inside `if TYPE_CHECKING:` (or `if typing.TYPE_CHECKING:`): only the type checker follows it
  deferred  inside a function or method body: runs when that code is first called

Relative imports are resolved. `from a.b import c` counts as an edge to module `a.b.c` when that is a
module of the tree, else to `a.b`. The implicit edge to a parent package's `__init__` (importing
`a.b.c` first runs `a/__init__` and `a/b/__init__`) is NOT counted: every submodule would otherwise
loop with a package `__init__` that re-exports it. Imports by module-path string (`importlib`,
entry points, lazy registries) are not import statements and are not counted.

Cycles are strongly connected components (size > 1, or a module importing itself) of three graphs:
  runtime                 the loops Python itself would meet at import time
  runtime+typing          adds TYPE_CHECKING edges: layering loops a deferred type hides
  all                     adds in-function imports: every loop, however it is hidden
tests/test_layering.py fails on any cycle of the `all` graph: loops such as client -> gpu -> sync ->
client, config <-> store.registry or engine <-> metrics were each closed by a TYPE_CHECKING or
in-function import and would have passed a runtime-only check.

Arrows running back up. Each package is also read as a plan of *rooms*: its own modules, and each of
its sub-packages taken whole (``ucm_server.regions`` is a room of ``ucm_server``, and so is the
folder ``ucm_server.gpu``). A room stands above every room it imports, so the rooms of a package
must import each other without a loop: an import that closes a loop between rooms (``regions.py``
importing from ``gpu/`` while ``gpu/`` imports ``regions.py``) runs back up, from a room below to
one above, even when no two modules import each other. Every edge of such a loop is reported.

Usage:  python import_graph.py [--root DIR] [--json] [--top N] [--check]
  --check  exit 1 if the `all` graph has a cycle, an import runs back up (a loop between rooms), or
           a forbidden cross-package import is found (ucm_client -> ucm_server, ucm_server ->
           ucm_client, ucm_protocol -> anything else of UCM).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGES = ("ucm_protocol", "ucm_server", "ucm_client")
KINDS = ("runtime", "typing", "deferred")
GRAPHS = {"runtime": {"runtime"}, "runtime+typing": {"runtime", "typing"}, "all": set(KINDS)}
# Package -> packages it must not import (any kind).
FORBIDDEN = {
    "ucm_client": {"ucm_server"},
    "ucm_server": {"ucm_client"},
    "ucm_protocol": {"ucm_server", "ucm_client"},
}
GENERATED = ("ucm_server.api.ucm", "ucm_protocol.ucm")  # generated stubs: left out of the size table


@dataclass(frozen=True, slots=True)
class Edge:
    src: str
    dst: str  # resolved module of the tree, or the dotted name as written when outside the tree
    kind: str
    file: str
    line: int
    names: tuple[str, ...]  # names taken by `from X import ...`; () for `import X`


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def collect_modules(root: Path) -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        base = root / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            if any(p.startswith(".") or p == "__pycache__" for p in path.relative_to(root).parts):
                continue
            mods[module_name(root, path)] = path
    return mods


def is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def best_module(name: str, mods: dict[str, Path]) -> str:
    """Longest dotted prefix of `name` that is a module of the tree (else `name` itself)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in mods:
            return cand
    return name


class Collector(ast.NodeVisitor):
    def __init__(self, mod: str, path: Path, root: Path, mods: dict[str, Path]) -> None:
        self.mod, self.path, self.root, self.mods = mod, path, root, mods
        self.is_pkg = path.name == "__init__.py"
        self.func = 0
        self.tc = 0
        self.edges: list[Edge] = []

    def kind(self) -> str:
        return "deferred" if self.func else "typing" if self.tc else "runtime"

    def add(self, dst: str, node: ast.stmt, names: tuple[str, ...]) -> None:
        if dst.partition(".")[0] not in PACKAGES:
            return
        rel = str(self.path.relative_to(self.root))
        self.edges.append(Edge(self.mod, dst, self.kind(), rel, node.lineno, names))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(best_module(alias.name, self.mods), node, ())

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = resolve(self.mod, self.is_pkg, node)
        plain: list[str] = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in self.mods:
                self.add(sub, node, (alias.name,))
            else:
                plain.append(alias.name)
        if plain:
            self.add(best_module(base, self.mods), node, tuple(plain))

    def _func(self, node: ast.AST) -> None:
        self.func += 1
        self.generic_visit(node)
        self.func -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _func

    def visit_If(self, node: ast.If) -> None:
        if is_type_checking(node.test):
            self.tc += 1
            for stmt in node.body:
                self.visit(stmt)
            self.tc -= 1
            for stmt in node.orelse:
                self.visit(stmt)
        else:
            self.generic_visit(node)


def sccs(nodes: list[str], adj: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan, iterative. Returns components that form a cycle (size > 1 or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(adj.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1 or v in adj.get(v, ()):
                        out.append(sorted(comp))
    return sorted(out)


def room_of(package: str, module: str) -> str | None:
    """The room of ``package`` that holds ``module``: a module of it, or a sub-package taken whole."""
    if not module.startswith(package + "."):
        return None
    return f"{package}.{module[len(package) + 1 :].split('.', maxsplit=1)[0]}"


def back_up(mods: dict[str, Path], internal: list[Edge]) -> list[dict[str, object]]:
    """The loops between the rooms of each package (see the module docstring), all import kinds
    counted, with the edges that make them."""
    packages = sorted(m for m, p in mods.items() if p.name == "__init__.py")
    found: list[dict[str, object]] = []
    for package in packages:
        adj: dict[str, set[str]] = {}
        edges: dict[tuple[str, str], list[Edge]] = {}
        for e in internal:
            a, b = room_of(package, e.src), room_of(package, e.dst)
            if a and b and a != b:
                adj.setdefault(a, set()).add(b)
                edges.setdefault((a, b), []).append(e)
        rooms = sorted({r for a, bs in adj.items() for r in (a, *bs)})
        for comp in sccs(rooms, adj):
            members = set(comp)
            closing = sorted(
                f"{e.file}:{e.line} {e.src} -> {e.dst} [{e.kind}]"
                for (a, b), es in edges.items()
                if a in members and b in members
                for e in es
            )
            found.append({"package": package, "rooms": comp, "edges": closing})
    return found


def docline(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except SyntaxError:
        return "?"
    return (doc or "").strip().split("\n")[0][:100]


def analyse(root: Path, top: int) -> dict[str, object]:
    mods = collect_modules(root)
    edges: list[Edge] = []
    for mod, path in mods.items():
        c = Collector(mod, path, root, mods)
        c.visit(ast.parse(path.read_text(), str(path)))
        edges.extend(c.edges)
    internal = [e for e in edges if e.dst in mods]
    cycles: dict[str, list[dict[str, object]]] = {}
    for gname, kinds in GRAPHS.items():
        adj: dict[str, set[str]] = {}
        for e in internal:
            if e.kind in kinds:
                adj.setdefault(e.src, set()).add(e.dst)
        found: list[dict[str, object]] = []
        for comp in sccs(sorted(mods), adj):
            members = set(comp)
            closing = sorted(
                {
                    f"{e.file}:{e.line} {e.src} -> {e.dst} [{e.kind}]"
                    for e in internal
                    if e.kind in kinds and e.src in members and e.dst in members
                }
            )
            found.append({"modules": comp, "edges": closing})
        cycles[gname] = found
    climbs = back_up(mods, internal)
    cross = [
        asdict(e) for e in edges if e.dst.partition(".")[0] in FORBIDDEN.get(e.src.partition(".")[0], set())
    ]
    cross_files = sorted({c["file"] for c in cross})
    sizes = sorted(
        (
            (len(p.read_text().splitlines()), m, docline(p))
            for m, p in mods.items()
            if not m.startswith(GENERATED)
        ),
        reverse=True,
    )[:top]
    return {
        "root": str(root),
        "packages": [p for p in PACKAGES if (root / p).is_dir()],
        "modules": len(mods),
        "edge_counts": {k: sum(1 for e in internal if e.kind == k) for k in KINDS},
        "cycles": cycles,
        "back_up": climbs,
        "forbidden_imports": cross,
        "forbidden_summary": {
            "statements": len({(c["file"], c["line"]) for c in cross}),
            "names": sum(max(1, len(c["names"])) for c in cross),
            "files": len(cross_files),
        },
        "largest": [{"lines": n, "module": m, "doc": d} for n, m, d in sizes],
    }


def render(r: dict[str, object]) -> str:
    out = [
        f"root {r['root']}  packages {', '.join(r['packages'])}  modules {r['modules']}",  # type: ignore[arg-type]
        f"internal import edges by kind: {r['edge_counts']}",
    ]
    for gname, found in r["cycles"].items():  # type: ignore[attr-defined]
        out.append(f"\ncycles in graph '{gname}': {len(found)}")
        for i, comp in enumerate(found, 1):
            out.append(f"  {i}. {' , '.join(comp['modules'])}")
            out.extend(f"       {e}" for e in comp["edges"])
    out.append(f"\nloops between rooms (imports running back up): {len(r['back_up'])}")  # type: ignore[arg-type]
    for i, loop in enumerate(r["back_up"], 1):  # type: ignore[attr-defined]
        out.append(f"  {i}. in {loop['package']}: {' , '.join(loop['rooms'])}")
        out.extend(f"       {e}" for e in loop["edges"])
    s = r["forbidden_summary"]
    out.append(
        f"\nforbidden cross-package imports: {s['statements']} statements, "  # type: ignore[index]
        f"{s['names']} names, {s['files']} files"
    )  # type: ignore[index]
    for c in r["forbidden_imports"]:  # type: ignore[attr-defined]
        names = ", ".join(c["names"]) if c["names"] else "(module)"
        out.append(f"  {c['file']}:{c['line']} [{c['kind']}] {c['dst']}: {names}")
    out.append("\nlargest modules (generated stubs left out): lines module — docstring first line")
    for m in r["largest"]:  # type: ignore[attr-defined]
        out.append(f"  {m['lines']:5d} {m['module']} — {m['doc']}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, default=Path.cwd())
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    r = analyse(a.root.resolve(), a.top)
    print(json.dumps(r, indent=1) if a.json else render(r))
    if a.check and (r["cycles"]["all"] or r["back_up"] or r["forbidden_imports"]):  # type: ignore[index]
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
