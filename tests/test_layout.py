"""The package layout (docs/DESIGN.md, "Layers"): no import cycles, no module
importing a layer above its own (least of all the front door), small files
(in launch/ and bench/ too).

Every module under xla_fsdp/ is parsed with `ast`, so imports inside functions
count as much as those at the top of a file; nothing is imported.
"""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "xla_fsdp"
FRONT_DOOR = "xla_fsdp.api"
MAX_LINES = 400
SCRIPT_FOLDERS = ("launch", "bench")  # entry points and benchmarks: the same line limit as the package
MAX_ROOT_FILES = 12  # .py files directly in xla_fsdp/, __init__.py included: each concern has its folder

# Every module belongs to a room; a name covers the module and, for a folder,
# everything under it. A new top-level file fails `test_every_module_has_a_room`
# until it is given one here (and in docs/DESIGN.md).
ROOMS: Dict[str, str] = {
    # layer 1: base
    "xla_fsdp.options": "base",
    "xla_fsdp.class_swap": "base",
    "xla_fsdp.runtime": "base",  # where the program runs: the declared TPU runtime, the mesh, the hosts of a slice
    "xla_fsdp.memory": "base",
    "xla_fsdp.deferred": "base",
    "xla_fsdp.metrics": "base",
    "xla_fsdp.abstract": "base",  # placeholders for the ahead-of-time trace
    "xla_fsdp.tpu": "base",  # libtpu's compiler, topologies, chip facts: nothing of ours below it
    "xla_fsdp.unit_state": "base",  # which modules are units, and each unit's engine state
    "xla_fsdp.data": "base",  # per-host batches under SPMD: this host's rows of a global batch, the global tensor from them  # the slice's hosts: this one's devices, the gloo group, virtual hosts
    # layer 2: mechanisms both engines share
    "xla_fsdp.wrap": "shared",
    "xla_fsdp.activation_checkpoint": "shared",
    "xla_fsdp.recompute_context": "shared",
    "xla_fsdp.forward_overrides": "shared",
    "xla_fsdp.layer_scan": "shared",  # scan_layers' ModuleList and keyed dropout; each engine brings its loop
    "xla_fsdp.keywords": "base",
    # layer 3: the engines, one folder each
    "xla_fsdp.collective_engine": "collective_engine",
    "xla_fsdp.gspmd_engine": "gspmd_engine",
    # scan over layers keeps each engine's loop beside the shared part; each belongs to its engine
    "xla_fsdp.layer_scan.collective": "collective_engine",
    "xla_fsdp.layer_scan.gspmd": "gspmd_engine",
    # layer 4: the front door
    "xla_fsdp.api": "front_door",
    "xla_fsdp.fsdpv2": "front_door",  # torch_xla's FSDPv2 name on the GSPMD engine
    "xla_fsdp.fsdp": "on_top",
    "xla_fsdp.attention": "on_top",  # the Pallas attention kernel for transformers models (run_clm, Trainer)
    "xla_fsdp.loss": "shared",  # the causal-LM loss fused with the output projection (run_clm)
    "xla_fsdp.attention.rules": "base",  # what the kernel accepts: the step-time model reads it too  # PyTorch FSDP2's API (fully_shard) on the collective engine
    # layer 5: on top
    "xla_fsdp.checkpoint": "checkpoint",
    "xla_fsdp.config": "config",
    "xla_fsdp.train": "on_top",
    "xla_fsdp.integrations": "on_top",
    "xla_fsdp.aot": "on_top",  # the ahead-of-time check traces whole jobs
    "xla_fsdp.profiling": "on_top",  # profiler traces of chosen steps (run_clm's --profile_steps, users' loops)
    "xla_fsdp.launcher": "on_top",  # launch/xla_spawn.py's launcher (it imports only runtime/ and tpu/)
    "xla_fsdp": "on_top",  # the package root re-exports the front door
}
LAYER = {"base": 1, "shared": 2, "collective_engine": 3, "gspmd_engine": 3, "front_door": 4,
         "checkpoint": 5, "config": 5, "on_top": 5}
_BELOW_ENGINES = {"base", "shared"}
_ENGINES = {"collective_engine", "gspmd_engine"}
# which rooms a room may import (its own included)
ALLOWED: Dict[str, set] = {
    "base": {"base"},
    "shared": _BELOW_ENGINES,
    "collective_engine": _BELOW_ENGINES | {"collective_engine"},
    "gspmd_engine": _BELOW_ENGINES | {"gspmd_engine"},
    "front_door": _BELOW_ENGINES | _ENGINES | {"front_door"},
    "checkpoint": _BELOW_ENGINES | _ENGINES | {"checkpoint"},
    "config": _BELOW_ENGINES | _ENGINES | {"front_door", "config"},
    "on_top": set(LAYER),
}
# rooms whose module-level imports stay inside the room: loading a config must
# not pull in the engines or torch_xla (they are imported inside functions)
LAZY_OUTSIDE = {"config"}
# modules that import nothing but the standard library: config may read them at load
IMPORT_FREE = {"xla_fsdp.keywords", "xla_fsdp.keywords.table"}


# ----------------------------------------------------------------- the graph
def package_sources(root: str = ROOT) -> Dict[str, Tuple[str, bool]]:
    """module name -> (source, is_package) for every .py under xla_fsdp/."""
    out = {}
    for folder, _, files in os.walk(os.path.join(root, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, root)[:-len(".py")].split(os.sep)
                is_package = rel[-1] == "__init__"
                with open(path, encoding="utf-8") as f:
                    out[".".join(rel[:-1] if is_package else rel)] = (f.read(), is_package)
    return out


class Import:
    """One `import` statement's target inside the package."""

    def __init__(self, target: str, line: int, lazy: bool):
        self.target, self.line, self.lazy = target, line, lazy


def _statements(tree: ast.Module):
    """(node, inside a function or class body?) for every import statement."""
    def visit(node, nested):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, nested
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from visit(child, inner)

    yield from visit(tree, False)


def imports_of(module: str, source: str, is_package: bool, known: Iterable[str]) -> List[Import]:
    """The package modules `module` imports (relative imports resolved); `from pkg
    import name` is `pkg.name` when that is a module in `known`, else `pkg`."""
    known = set(known)
    here = module if is_package else module.rpartition(".")[0]
    out = []
    for node, lazy in _statements(ast.parse(source, filename=module)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            if node.level:
                base = here.split(".")
                base = ".".join(base[:len(base) - node.level + 1])
                origin = f"{base}.{node.module}" if node.module else base
            else:
                origin = node.module or ""
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                out.append(Import(target, node.lineno, lazy))
    return out


def import_graph(sources: Mapping[str, Tuple[str, bool]]) -> Dict[str, List[Import]]:
    """module -> its imports of modules that exist (see `test_every_import_resolves`)."""
    return {m: [i for i in imports_of(m, src, pkg, sources) if i.target in sources]
            for m, (src, pkg) in sources.items()}


def find_cycles(graph: Mapping[str, List[Import]]) -> List[Tuple[List[str], List[str]]]:
    """(modules, one cycle through them) per strongly connected component: every
    module of a component reaches every other, so each is on some cycle."""
    edges = {m: sorted({i.target for i in imps}) for m, imps in graph.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    components = []

    def connect(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                components.append(set(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return [(sorted(c), _cycle_in(sorted(c)[0], c, edges)) for c in components]


def _cycle_in(start: str, component: set, edges) -> List[str]:
    """A shortest path start -> ... -> start inside the component (breadth first)."""
    parent: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return list(reversed(path)) + [start]
                if w in component and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle")


def room_of(module: str) -> Optional[str]:
    name = module
    while name:
        if name in ROOMS and (name != PACKAGE or module == PACKAGE):
            return ROOMS[name]
        name = name.rpartition(".")[0]
    return None


# ----------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def sources():
    return package_sources()


@pytest.fixture(scope="module")
def graph(sources):
    return import_graph(sources)


def test_every_import_resolves(sources):
    # a lazy import of a moved module fails only when its function runs
    missing = [f"{m} (line {i.line}) imports {i.target}" for m, (src, pkg) in sorted(sources.items())
               for i in imports_of(m, src, pkg, sources) if i.target not in sources]
    assert not missing, "imports of modules that do not exist: " + "; ".join(missing)


def test_every_module_has_a_room(sources):
    unclassified = sorted(m for m in sources if room_of(m) is None)
    assert not unclassified, (f"modules without a layer: {unclassified}; add them to ROOMS in "
                              "tests/test_layout.py and to the layer table in docs/DESIGN.md")


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(
        f"{len(mods)} modules {mods}, e.g. {' -> '.join(path)}" for mods, path in cycles)


def test_front_door_is_imported_only_from_above(graph):
    bad = [f"{m} (line {i.line}) imports {i.target}"
           for m, imps in sorted(graph.items()) for i in imps
           if i.target in (FRONT_DOOR, PACKAGE) and LAYER.get(room_of(m)) is not None
           and (LAYER[room_of(m)] < LAYER["front_door"] or room_of(m) == "checkpoint")]
    assert not bad, ("below the front door, pass the wrapper class or a callable instead: "
                     + "; ".join(bad))


def test_layers(graph):
    bad = []
    for m, imps in sorted(graph.items()):
        room = room_of(m)
        for i in imps:
            if room is not None and room_of(i.target) not in ALLOWED[room]:
                bad.append(f"{m} ({room}, line {i.line}) imports {i.target} ({room_of(i.target)})")
    assert not bad, "imports against the layer table: " + "; ".join(bad)


def test_config_imports_the_rest_lazily(graph):
    bad = [f"{m} (line {i.line}) imports {i.target} at module level"
           for m, imps in sorted(graph.items()) if room_of(m) in LAZY_OUTSIDE for i in imps
           if not i.lazy and room_of(i.target) != room_of(m) and i.target not in IMPORT_FREE]
    assert not bad, "loading a config must not load the engines: " + "; ".join(bad)


def test_import_free_modules_import_only_the_standard_library(sources):
    allowed = {"__future__", "dataclasses", "typing"}
    for module in IMPORT_FREE:
        tree = ast.parse(sources[module][0])
        found = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        found |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert found <= allowed, f"{module} imports {sorted(found - allowed)}: config reads it at load"


def test_no_module_over_the_line_limit(sources):
    long = sorted((len(src.splitlines()), m) for m, (src, _) in sources.items()
                  if len(src.splitlines()) > MAX_LINES)
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): " + ", ".join(
        f"{m} ({n})" for n, m in long)


def test_no_script_over_the_line_limit():
    """launch/ and bench/ hold entry points and benchmarks; what grows there moves into the package
    (launch/xla_spawn.py -> xla_fsdp/launcher/) or bench/common/."""
    long = []
    for folder in SCRIPT_FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        lines = len(f.read().splitlines())
                    if lines > MAX_LINES:
                        long.append(f"{os.path.relpath(path, ROOT)} ({lines})")
    assert not long, f"scripts over {MAX_LINES} lines (split them by concern): " + ", ".join(sorted(long))


def test_the_package_root_stays_small():
    """A concern with more than one file gets a folder; the root keeps the front door and the few
    modules every layer shares (docs/DESIGN.md)."""
    root = sorted(n for n in os.listdir(os.path.join(ROOT, PACKAGE)) if n.endswith(".py"))
    assert len(root) <= MAX_ROOT_FILES, (
        f"xla_fsdp/ has {len(root)} .py files at its root (at most {MAX_ROOT_FILES}): {', '.join(root)}; "
        "move a concern into its folder, and keep its old import path in xla_fsdp/__init__.py")


def test_the_design_docs_layout_table_names_every_module():
    """docs/DESIGN.md's "Layout" table against the tree: a row for every folder and root module
    of xla_fsdp/, and each folder's row names each of its modules (`name.py`), so a reader finds
    every file there; no row names a file that is gone."""
    root = Path(ROOT)
    text = (root / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    table = text.split("## Layout", 1)[1].split("\n### ", 1)[0]
    rows = dict(re.findall(r"^\| `(xla_fsdp/[^`]*)` \| (.*) \|$", table, flags=re.M))
    package = root / "xla_fsdp"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if path.parent == package:
            if rel not in rows:
                missing.append(rel)
            continue
        folder = path.relative_to(package).parts[0]
        row = rows.get(f"xla_fsdp/{folder}/")
        name = path.relative_to(package / folder).as_posix()
        if path.name in ("__init__.py", "__main__.py"):
            inner = path.parent.relative_to(package / folder).as_posix()
            if row is None or inner != "." and f"`{inner}/`" not in row:
                missing.append(f"xla_fsdp/{folder}/" + ("" if inner == "." else f"{inner}/"))
            continue
        if row is None or f"`{name}`" not in row and f"`{path.name}`" not in row:
            if rel not in rows:
                missing.append(rel)
    assert not missing, f"docs/DESIGN.md's layout table does not name: {missing}"
    gone = [p for p in rows if not (root / p).exists()]
    assert not gone, f"docs/DESIGN.md's layout table names paths that do not exist: {gone}"
    for path, row in rows.items():
        if path.endswith("/"):
            stale = [n for n in re.findall(r"`(\w+\.py)`", row) if not any((root / path).rglob(n))]
            assert not stale, f"docs/DESIGN.md's row {path} names files it does not hold: {stale}"


MAX_FUNCTION_LINES = 80  # issue 80: a function a reader takes in at once
MAX_RUN_LINES = 60  # run_clm's `run` (train/job.py): one call per stage, read top to bottom


def test_no_function_is_longer_than_a_reader_takes_in_at_once():
    long = []
    for path in sorted(Path(ROOT, "xla_fsdp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                limit = MAX_RUN_LINES if (path.name, node.name) == ("job.py", "run") else MAX_FUNCTION_LINES
                if lines > limit:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines, at most {limit})")
    assert not long, "split these into one function per step: " + "; ".join(long)
