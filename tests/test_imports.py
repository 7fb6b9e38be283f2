"""The code's house holds: no Python file over 400 lines, no import circle between modules of specpd/ or
evals/ (imports inside functions count: they hide a circle, they do not remove it), and none between specpd's
packages (docs/architecture.md, "Layers of the code"); and nothing names a file outside the repository (the
design is docs/architecture.md)."""
from __future__ import annotations

import ast
import os
import re

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


# -- nothing points outside the repository (issue 65) ---------------------------------------------------------
# path-like tokens that can only name something outside the checkout: the old design notes, a sibling folder, a
# machine's home or work directory (spelt with character classes so that this file does not name them itself)
OUTSIDE = re.compile(r"DESIGN[.]md|[.][.]/shared\b|(?<![\w.~])/(?:work|home|Users|root)/[\w.-]")
FILE_NAME = re.compile(r"(?<![\w/.-])((?:\.\./)*[\w-][\w.-]*(?:/[\w.-]+)*\.(?:md|py|json))\b(?!\()")
UP_PATH = re.compile(r"(?<![\w.])((?:\.\./)+[\w.-]+(?:/[\w.-]+)*)")
# names that are not the repository's and are allowed: what a model, draft or training directory holds (user
# data), and other projects' sources cited by name beside their project
MODEL_DIR_FILES = {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "model.safetensors.index.json", "args.json", "index.json", "provenance.json"}
CITED = {"cnets.py", "cnets1.py", "modeling_llama_kv.py",  # SafeAILab/EAGLE
         "llama_eagle.py", "llama_eagle3.py", "deepseek_nextn.py", "deepseek_mtp.py",  # SGLang, vLLM
         "convert_hf_to_gguf.py"}  # llama.cpp
SKIP_DIRS = {".git", ".venv", ".peers", "build", ".cache", "runs", "__pycache__", ".pytest_cache", ".gpu_stage"}


def _repo_files() -> list[str]:
    out = []
    for base, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [os.path.relpath(os.path.join(base, f), ROOT) for f in files]
    return out


def outside_pointers(rel: str, text: str, names: set[str]) -> list[str]:
    """What `text` (the file `rel`) names outside the repository: a path token of OUTSIDE; a `../` path that
    leaves the checkout or does not exist; a *.md / *.py / *.json name no file of the repository has (a
    qualified name must match a path's tail), other than MODEL_DIR_FILES, CITED and a user's placeholder
    (`OUT/gpu.json`)."""
    found = [m.group(0) for m in OUTSIDE.finditer(text)]
    here = os.path.dirname(os.path.join(ROOT, rel))
    for m in UP_PATH.finditer(text):
        target = os.path.normpath(os.path.join(here, m.group(1).rstrip(".")))
        if not target.startswith(ROOT + os.sep) or not os.path.exists(target):
            found.append(m.group(1))
    for m in FILE_NAME.finditer(text):
        token = m.group(1)
        if token.startswith("../") or re.match(r"[A-Z][A-Z_]*/", token):
            continue  # UP_PATH's; a placeholder the user fills (OUT/gpu.json)
        base = os.path.basename(token)
        if base in MODEL_DIR_FILES or base in CITED:
            continue
        if "/" in token and not any(n == token or n.endswith("/" + token) for n in names):
            found.append(token)
        elif "/" not in token and base not in {os.path.basename(n) for n in names}:
            found.append(token)
    return list(dict.fromkeys(found))


def _scan(files: list[str]) -> dict[str, list[str]]:
    names, bad = set(_repo_files()), {}
    for rel in files:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            hits = outside_pointers(rel, f.read(), names)
        if hits:
            bad[rel] = sorted(set(hits))
    return bad


def test_nothing_names_a_file_outside_the_repository():
    """specpd/'s modules (docstrings and comments included), docs/ and the README name only files the
    repository holds: the design is docs/architecture.md, not notes beside the checkout."""
    files = [f for f in _repo_files() if f == "README.md" or (f.startswith(("specpd" + os.sep, "docs" + os.sep))
                                                             and f.endswith((".py", ".md")))]
    bad = _scan(files)
    assert not bad, f"these name files outside the repository: {bad}"


def test_no_path_outside_the_repository_anywhere():
    """Tests, benchmarks and the Makefile do not reach outside the checkout either (OUTSIDE's tokens)."""
    files = [f for f in _repo_files() if f.endswith((".py", ".md", ".sh", ".toml")) or f == "Makefile"]
    bad = {}
    for rel in files:
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
            hits = OUTSIDE.findall(f.read())
        if hits:
            bad[rel] = sorted(set(hits))
    assert not bad, f"these point outside the repository: {bad}"


def test_the_outside_check_finds_each_kind():
    design, sibling, home = "DESIGN" + ".md", ".." + "/shared", "/" + "home"  # not named in this file itself
    names = {"docs/architecture.md", "specpd/config.py", "evals/results/peers.json"}
    assert outside_pointers("specpd/x.py", f"see {design} §3", names) == [design]
    assert outside_pointers("docs/a.md", f"the design is `{sibling}/NOTES.md`", names)
    assert outside_pointers("specpd/x.py", "written by bench_nothing.py -> evals/results/gone.json", names) == [
        "bench_nothing.py", "evals/results/gone.json"]
    assert outside_pointers("specpd/x.py", f"cache in {home}/someone/x", names)
    assert outside_pointers("specpd/x.py", "config.json, docs/architecture.md, peers.json, resp.json(), "
                            "SGLang's llama_eagle3.py, ~/.cache/specpd", names) == []
