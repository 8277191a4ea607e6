"""The import graph of ndif_celery, workers and web, and the rules it must keep.

Why: the layering (web and workers sit on ndif_celery; the web never loads
torch or the worker's code; no module circle) is what lets a newcomer change
one module without reading the rest, and a circle held together by imports
hidden inside functions only shows up as an ImportError at run time. This
script reads the source with ``ast`` (nothing is imported, so it is fast and
safe to run anywhere), takes every import, top-level and function-local
(those under ``if TYPE_CHECKING:`` never run: they count for the layers
only), and checks:

* no cycle between modules (each one found is named, module by module);
* ``web`` imports neither ``workers`` nor ``torch``, directly or through the
  modules it imports (every import counts, even one inside a function that
  the web may never call: if it is there, one day it will be called);
* ``ndif_celery`` (the shared core) imports neither ``workers`` nor ``web``,
  and ``workers`` does not import ``web``;
* inside ``ndif_celery`` and ``workers``, each subpackage or top module sits
  on a layer (``LAYERS``, bottom first) and imports only its own layer or
  those below it, for type checking too: an annotation naming a class of a
  layer above sends a reader up as surely as an import that runs.

Usage: ``python tools/import_graph.py [--root DIR] [--quiet]``. It prints the
module graph (each module and the project modules it imports) and the
package-level edges, then the problems; the exit status is 1 when there is a
problem, else 0. tests/unit/tools/test_import_graph.py runs it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGES = ("ndif_celery", "workers", "web")

# package -> what it must never reach (a project package or an outside top-level module)
FORBIDDEN = {
    "web": ("workers", "torch"),
    "ndif_celery": ("workers", "web"),
    "workers": ("web",),
}

# Each package's layers, bottom first. A module belongs to the layer naming
# its first part below the package (ndif_celery.state.jobs is in "state");
# it may import modules of its own layer or of the layers below, never above.
LAYERS = {
    "ndif_celery": (
        ("errors", "exit_codes", "output_bounds", "notices", "log_limits"),  # leaves
        ("wire", "socketio_wire", "messages", "policy"),  # the protocols and pure rules
        ("config", "celery_app"),  # settings and the broker app
        ("state",),  # what every process reads and writes in Redis
        ("store",),  # result bytes
        ("accounts",),  # who may do what, and what they used
        ("monitoring",),  # metrics and probes
        ("statuses",),  # the one writer of job statuses
        ("intake", "farm", "beat"),  # the web's door, the farm's control, the beat
        ("host",),  # this host's processes
        ("cli",),  # the command line
    ),
    "workers": (
        ("adapters",),  # what differs per nnsight version
        ("execute", "baseline", "results", "cuda", "metrics", "quantized"),  # leaves shared by the worker and the child
        ("isolation",),  # untrusted jobs' processes and the jail
        ("models",),  # resident models
        ("cobatch",),  # shared forwards
        ("job",),  # a job's life on a worker
        ("startup",),
        ("worker",),
        ("tasks",),  # the Celery entry point
    ),
}

# Edges that break a rule on purpose, each with its reason (printed with the graph).
ALLOWED = {
    ("ndif_celery.host.doctor", "workers.isolation.jail"):
        "`ndif-celery doctor` probes the jail layers with the very code a job's child runs "
        "(jail.probe), so that what it reports is what a job gets; imported inside check_jail only",
}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Every module of the packages: dotted name -> file."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(root, path)] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): never runs, so no edge at run time."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _runtime_nodes(tree: ast.AST, typing: bool = False):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (its ``else`` runs, and counts);
    with ``typing``, those too."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if _type_checking_only(node) and not typing:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, typing: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """Every import in ``path``, anywhere in the file, made absolute:
    ``(module, names)`` for ``from module import names``, ``(module, ())``
    for ``import module``."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in _runtime_nodes(tree, typing):
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = name.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                source = ".".join(base + ([node.module] if node.module else []))
            found.append((source, tuple(alias.name for alias in node.names)))
    return found


def build_graph(root: Path, packages=PACKAGES, typing: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> project modules it imports, module -> outside top-level modules it imports).

    ``from ndif_celery import config`` is an edge to ``ndif_celery.config``
    (not to the package): a package's own ``__init__`` is only an edge when
    a name is taken from it."""
    modules = find_modules(root, packages)

    def longest_module(dotted: str) -> str:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts)

    graph: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps, other = set(), set()
        for source, names in imports_of(name, path, typing):
            top = source.split(".")[0]
            if top not in packages:
                if top:
                    other.add(top)
                continue
            targets = [f"{source}.{n}" if f"{source}.{n}" in modules else source for n in names] or [source]
            deps.update(longest_module(t) for t in targets)
        deps.discard(name)
        deps.discard("")
        graph[name], outside[name] = deps, other
    return graph, outside


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's
    algorithm, iterative): each is a set of modules that all reach each other."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _a_cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    members, first = set(component), component[0]
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == first:
                    return paths[node] + [first]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    return component  # not reached: a component of several modules holds a cycle through each


def reach(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module reachable from ``start``, with the import path to it
    (not through an ALLOWED edge)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in paths and (node, child) not in ALLOWED:
                    paths[child] = paths[node] + [child]
                    nxt.append(child)
        frontier = nxt
    return paths


def layer_violations(graph, outside) -> list[str]:
    """Each forbidden import, with the chain of imports that leads to it."""
    problems = set()
    for name in sorted(graph):
        package = name.split(".")[0]
        banned = FORBIDDEN.get(package, ())
        if not banned:
            continue
        for target, path in reach(graph, name).items():
            if target.split(".")[0] in banned:
                problems.add(f"{package} must not import {target.split('.')[0]}: {' -> '.join(path)}")
            for top in sorted(outside[target] & set(banned)):
                problems.add(f"{package} must not import {top}: {' -> '.join(path + [top])}")
    # one line per (rule, first module on the chain) is enough to act on
    return sorted(problems)


def layer_of(name: str) -> tuple[str, int] | None:
    """(package, layer index) of a module, or None when its package has no layers."""
    parts = name.split(".")
    layers = LAYERS.get(parts[0])
    if not layers or len(parts) < 2:
        return None
    for index, members in enumerate(layers):
        if parts[1] in members:
            return parts[0], index
    return parts[0], -1


def upward_imports(graph) -> list[str]:
    """Each import of a module from a layer above its own (or from no layer)."""
    problems = []
    for name in sorted(graph):
        mine = layer_of(name)
        if mine is None:
            continue
        if mine[1] < 0:
            problems.append(f"{name} is on no layer of {mine[0]} (add it to LAYERS)")
            continue
        for dep in sorted(graph[name]):
            theirs = layer_of(dep)
            if theirs is None or theirs[0] != mine[0] or (name, dep) in ALLOWED:
                continue
            if theirs[1] > mine[1]:
                problems.append(f"{name} imports {dep} from a layer above its own")
    return problems


def package_edges(graph) -> dict[tuple[str, str], int]:
    edges: dict[tuple[str, str], int] = defaultdict(int)
    for name, deps in graph.items():
        for dep in deps:
            a, b = name.split(".")[0], dep.split(".")[0]
            if a != b:
                edges[a, b] += 1
    return dict(edges)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository root (default: this script's)")
    parser.add_argument("--quiet", action="store_true", help="print only the problems")
    args = parser.parse_args(argv)
    graph, outside = build_graph(args.root)
    if not args.quiet:
        print("# modules (each with the project modules it imports)")
        for name in sorted(graph):
            print(f"{name} -> {', '.join(sorted(graph[name])) or '-'}")
        print("\n# packages (import count)")
        for (a, b), count in sorted(package_edges(graph).items()):
            print(f"{a} -> {b} ({count})")
        print("\n# allowed on purpose")
        for (a, b), why in sorted(ALLOWED.items()):
            print(f"{a} -> {b}: {why}")
    problems = [f"cycle: {' -> '.join(_a_cycle_in(members, graph))} (circle of {len(members)} modules: "
                f"{', '.join(members)})" for members in circles(graph)]
    problems += layer_violations(graph, outside)
    problems += upward_imports(build_graph(args.root, typing=True)[0])  # annotations count for the layers
    for problem in problems:
        print(problem, file=sys.stderr)
    if not args.quiet:
        print("\n" + (f"{len(problems)} problem(s)" if problems else "no cycles, layers kept"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
