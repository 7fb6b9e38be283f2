"""The code's house holds: no Python file over 400 lines, no import circle between modules of specpd/ or
evals/ (imports inside functions count: they hide a circle, they do not remove it), and none between specpd's
packages (docs/architecture.md, "Layers of the code")."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(top: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py under `top`."""
    out = {}
    for base, _, files in os.walk(os.path.join(ROOT, top)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(base, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(base, f)
    return out


def _imports(path: str, package: str, known: dict[str, str]) -> set[str]:
    """The modules of `known` that the file imports anywhere in it (`from a.b import c` counts a.b.c when that
    is a module, else a.b; a bare `import x` of an evals script run from evals/ counts evals.x)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            for candidate in (name, f"{package}.{name}"):
                if candidate in known:
                    found.add(candidate)
                    break
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _graph(top: str) -> dict[str, set[str]]:
    known = _modules(top)
    return {m: _imports(path, top, known) - {m} for m, path in known.items()}


def test_no_module_import_circles():
    for top in ("specpd", "evals"):
        assert _cycles(_graph(top)) == [], f"import circles in {top}/"


def _package_graph() -> dict[str, set[str]]:
    """specpd's packages (and top-level modules) -> the others they import."""
    packages: dict[str, set[str]] = {}
    for module, imported in _graph("specpd").items():
        mine = module.split(".")[1] if "." in module else module
        packages.setdefault(mine, set()).update(m.split(".")[1] for m in imported if "." in m)
    for name, deps in packages.items():
        deps.discard(name)
    return packages


def test_no_package_import_circles():
    assert _cycles(_package_graph()) == [], "specpd's packages import each other in a circle"


# specpd's layers, top first (docs/architecture.md, "Layers of the code"): a package imports only from layers below
# its own, never beside it (engine/ and disagg/ stay apart: a worker is handed the engine object)
LAYERS = [
    {"__main__"},
    {"server"},
    {"train"},  # specpd train-draft: a server subcommand, beside the serving stack
    {"disagg", "engine"},
    {"spec"},  # speculation: drafting, trees, verify, commit, the adaptive policy
    {"model"},
    {"attention"},
    {"kernels", "kv"},
    {"admission", "config", "grammar"},
    {"core", "machine"},
]


def test_every_package_imports_only_from_layers_below_it():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    packages = _package_graph()
    packages.pop("specpd", None)  # specpd/__init__.py
    assert set(packages) <= set(layer), f"give these a layer in LAYERS: {sorted(set(packages) - set(layer))}"
    upward = {f"{name} -> {dep}" for name, deps in packages.items() for dep in deps if layer[dep] <= layer[name]}
    assert not upward, f"imports from a layer not below the importer's: {sorted(upward)}"


def test_the_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_python_file_over_400_lines():
    """Files split by responsibility stay readable whole (issue 35): specpd/, tests/ and evals/."""
    long = {}
    for top in ("specpd", "tests", "evals"):
        for base, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(base, f)) as fh:
                        n = sum(1 for _ in fh)
                    if n > 400:
                        long[os.path.relpath(os.path.join(base, f), ROOT)] = n
    assert not long, f"split these by responsibility: {long}"
