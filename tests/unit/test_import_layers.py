"""The packages import each other in one direction only (docs/design.md, "Import order").

Read from the source with `ast` (nothing is imported): every `import` / `from ... import`, at module level or
inside a function, is an edge between the layers of the two modules:

    slurm_plugin (core: contracts, client, hostlist, errors, installer, templates)
      <- predictor <- elastic_launcher <- slurm_plugin.lab (demo, testbed) <- slurm_plugin.cli (`elastic-slurm`)

The layer graph must have no cycle; a failure names each cycle with the import lines that close it.

Inside each package the same imports (function-level ones included: `# noqa: PLC0415` hides nothing here)
make a graph of modules, which must have no cycle either: a module-level import and a function-level one
close a circle just the same, it only shows later, at run time. And the runtime (`elastic_launcher`) does not
import the service (`predictor`) at all: what both need is in slurm_plugin.contracts, below both (issue #26.1).
"""
from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("slurm_plugin", "predictor", "elastic_launcher")
ENTRY_POINT = "slurm_plugin.cli"      # the `elastic-slurm` console script: above the lab, imported by nothing
LAB = "slurm_plugin.lab"
RUNTIME = "elastic_launcher"
SERVICE = "predictor"


def layer(module: str) -> str | None:
    """The layer a dotted module name belongs to; None outside our packages (stdlib, third party)."""
    if module == ENTRY_POINT or module.startswith(ENTRY_POINT + "."):
        return ENTRY_POINT
    if module == LAB or module.startswith(LAB + "."):
        return LAB
    top = module.split(".")[0]
    return top if top in PACKAGES else None


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement brings in (`from a import b` counts as `a.b`, which may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        return [f"{base}.{alias.name}" for alias in node.names] + [base]
    return []


@functools.lru_cache(maxsize=None)
def _import_nodes(source: str, filename: str) -> tuple[ast.Import | ast.ImportFrom, ...]:
    tree = ast.parse(source, filename=filename)
    return tuple(node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def imports_of(path: Path) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """Every import statement of one file, at module level or inside a function; a text is parsed once for all the
    checks that read it (the layer graph and the module graph of this checkout both read every module)."""
    return _import_nodes(path.read_text(encoding="utf-8"), str(path))


def import_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(from layer, to layer) -> the import lines (`path:line`) that make the edge, for every cross-layer import."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = _module_name(path, root)
            source = layer(module)
            for node in imports_of(path):
                targets = {layer(name) for name in _imported(node, module, path.name == "__init__.py")}
                for target in targets - {None, source}:
                    edges[(source, target)].append(f"{path.relative_to(root)}:{node.lineno}")
    return dict(edges)


def _modules(root: Path) -> dict[str, Path]:
    """Every module of our packages, by dotted name (packages by their `__init__`)."""
    return {_module_name(path, root): path
            for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}


def _targets(name: str, importer: str, known: dict[str, Path]) -> set[str]:
    """The modules of ours that importing `name` runs: the longest known prefix of the dotted name (`from a
    import b` is `a.b` when that is a module, else `a`) and the packages above it, except the importer's own
    packages (always initialised before it)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    found = set()
    for end in range(len(parts), 0, -1):
        target = ".".join(parts[:end])
        if target in known and target != importer and not importer.startswith(target + "."):
            found.add(target)
    return found


def module_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importing module, imported module) -> the import lines (`path:line`), for every import between two
    modules of ours, at module level or inside a function."""
    known = _modules(root)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in known.items():
        for node in imports_of(path):
            targets: set[str] = set()
            for name in _imported(node, module, path.name == "__init__.py"):
                targets |= _targets(name, module, known)
            for target in sorted(targets):
                edges[(module, target)].append(f"{path.relative_to(root)}:{node.lineno}")
    return dict(edges)


def _package_graph(edges) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        if a.split(".")[0] == b.split(".")[0]:
            graph[a].add(b)
    return graph


def package_circles(edges) -> list[list[str]]:
    """The circles of modules inside one package: each strongly connected set of two or more modules (Tarjan),
    sorted."""
    graph = _package_graph(edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:   # recursion depth is bounded by the module count (a few hundred)
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                component.append(stack.pop())
                if component[-1] == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components)


def package_cycles(edges) -> list[list[str]]:
    """For each circle, its shortest cycle through its smallest module (breadth first, inside the circle)."""
    graph = _package_graph(edges)
    found = []
    for component in package_circles(edges):
        start = component[0]
        parents: dict[str, str | None] = {start: None}
        queue = [start]
        while queue:
            node = queue.pop(0)
            if start in graph[node]:   # no self-loops: _targets leaves the importer out
                break
            for nxt in sorted(graph[node] & set(component)):
                if nxt not in parents:
                    parents[nxt] = node
                    queue.append(nxt)
        path: list[str] = []
        while node is not None:
            path.append(node)
            node = parents[node]
        found.append(path[::-1])
    return found


def cycles(edges) -> list[list[str]]:
    """Every elementary cycle of the layer graph (a handful of nodes: a depth-first walk from each is enough)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    found: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == path[0]:
                found.add(tuple(path))
            elif nxt not in path and nxt > path[0]:   # each cycle once, from its smallest node
                walk(path + [nxt])

    for start in sorted(graph):
        walk([start])
    return [list(c) for c in sorted(found)]


@functools.lru_cache(maxsize=1)
def repo_import_edges() -> dict[tuple[str, str], list[str]]:
    """import_edges of this checkout, parsed once for every test here (read only)."""
    return import_edges(ROOT)


@functools.lru_cache(maxsize=1)
def repo_module_edges() -> dict[tuple[str, str], list[str]]:
    return module_edges(ROOT)


def test_layers_import_in_one_direction():
    edges = repo_import_edges()
    problems = []
    for cycle in cycles(edges):
        hops = list(zip(cycle, cycle[1:] + cycle[:1]))
        where = "; ".join(f"{a} -> {b} at {', '.join(edges[(a, b)][:3])}" for a, b in hops)
        problems.append(f"cycle {' -> '.join(cycle + cycle[:1])} ({where})")
    assert not problems, "\n".join(problems)


def test_entry_point_and_lab_sit_on_top():
    """Nothing below the lab imports it, and nothing imports the console entry point."""
    edges = repo_import_edges()
    into_lab = {a: lines for (a, b), lines in edges.items() if b == LAB and a != ENTRY_POINT}
    assert not into_lab, f"{LAB} imported from below: {into_lab}"
    into_cli = {a: lines for (a, b), lines in edges.items() if b == ENTRY_POINT}
    assert not into_cli, f"{ENTRY_POINT} imported: {into_cli}"


def test_cycle_finder_sees_a_cycle(tmp_path):
    """The check itself: a two-package cycle in a scratch tree is found, with its import lines."""
    (tmp_path / "predictor").mkdir()
    (tmp_path / "elastic_launcher").mkdir()
    (tmp_path / "slurm_plugin").mkdir()
    (tmp_path / "predictor" / "a.py").write_text("def f():\n    from elastic_launcher import b\n")
    (tmp_path / "elastic_launcher" / "b.py").write_text("import predictor.a\n")
    (tmp_path / "slurm_plugin" / "c.py").write_text("from . import d\nimport os\n")
    edges = import_edges(tmp_path)
    assert edges == {("predictor", "elastic_launcher"): ["predictor/a.py:2"],
                     ("elastic_launcher", "predictor"): ["elastic_launcher/b.py:1"]}
    assert cycles(edges) == [["elastic_launcher", "predictor"]]


def test_no_cycle_inside_a_package():
    """No circle of modules inside predictor, elastic_launcher or slurm_plugin, function-level imports included."""
    edges = repo_module_edges()
    problems = []
    for circle, cycle in zip(package_circles(edges), package_cycles(edges)):
        hops = list(zip(cycle, cycle[1:] + cycle[:1]))
        where = "; ".join(f"{a} -> {b} at {', '.join(edges[(a, b)][:3])}" for a, b in hops)
        problems.append(f"circle of {len(circle)} modules ({', '.join(circle)}), e.g. "
                        f"cycle {' -> '.join(cycle + cycle[:1])} ({where})")
    assert not problems, "\n".join(problems)


def test_runtime_does_not_import_the_service():
    """elastic_launcher imports nothing of predictor, at module level or inside a function: what both need is in
    slurm_plugin.contracts (issue #26.1)."""
    edges = repo_module_edges()
    runtime_to_service = {(a, b): lines for (a, b), lines in edges.items() if layer(a) == RUNTIME and layer(b) == SERVICE}
    assert not runtime_to_service, f"the runtime imports the service: {runtime_to_service}"


def scratch_tree(root: Path, files: dict[str, str]) -> None:
    """Our three packages as empty packages under `root`, then `files` (path -> source) with their folders."""
    for package in PACKAGES:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_package_cycle_finder_sees_function_level_imports(tmp_path):
    """The check itself: a circle closed by an import inside a function, through a subpackage, is found."""
    scratch_tree(tmp_path, {})
    (tmp_path / "predictor" / "sub").mkdir()
    (tmp_path / "predictor" / "sub" / "__init__.py").write_text("from predictor import base\n")
    (tmp_path / "predictor" / "sub" / "view.py").write_text("from predictor.sub import base\n")
    (tmp_path / "predictor" / "tables.py").write_text("def f():\n    from predictor.cli import g  # noqa\n")
    (tmp_path / "predictor" / "cli.py").write_text("import os\nfrom predictor.sub.view import x\n")
    (tmp_path / "predictor" / "base.py").write_text("from . import tables\n")
    (tmp_path / "elastic_launcher" / "a.py").write_text("from . import b\n")
    (tmp_path / "elastic_launcher" / "b.py").write_text("import predictor\n")
    edges = module_edges(tmp_path)
    assert edges[("predictor.tables", "predictor.cli")] == ["predictor/tables.py:2"]
    assert ("predictor.cli", "predictor.sub") in edges          # importing sub.view runs sub/__init__ first
    assert ("predictor.sub.view", "predictor.sub") not in edges  # its own package: initialised before it
    assert package_circles(edges) == [["predictor.base", "predictor.cli", "predictor.sub", "predictor.tables"]]
    assert package_cycles(edges) == [["predictor.base", "predictor.tables", "predictor.cli", "predictor.sub"]]
    (tmp_path / "predictor" / "tables.py").write_text("def f():\n    import predictor.base\n")
    assert package_cycles(module_edges(tmp_path)) == [["predictor.base", "predictor.tables"]]


CONTRACTS = "slurm_plugin.contracts"
LEAVES = ("slurm_plugin.errors", "slurm_plugin.hostlist")   # the core's modules that import nothing of ours


def contracts_imports(edges) -> dict[tuple[str, str], list[str]]:
    """Imports that break the contracts layer's rule: a contracts module imports only other contracts modules and
    the leaves, and a leaf imports nothing of the project (issue #26.1)."""
    bad = {}
    for (a, b), lines in edges.items():
        if a == CONTRACTS or a.startswith(CONTRACTS + "."):
            if not (b == CONTRACTS or b.startswith(CONTRACTS + ".") or b in LEAVES):
                bad[(a, b)] = lines
        elif a in LEAVES:
            bad[(a, b)] = lines
    return bad


def test_contracts_import_only_contracts_and_the_core_leaves():
    bad = contracts_imports(repo_module_edges())
    assert not bad, f"the contracts layer imports above itself: {bad}"


def test_contracts_check_sees_an_import_of_the_client(tmp_path):
    """The check itself: a contracts module importing the Slurm client, and a leaf importing anything, are named."""
    scratch_tree(tmp_path, {
        "slurm_plugin/contracts/__init__.py": "",
        "slurm_plugin/contracts/tres.py": ("from slurm_plugin.hostlist import split_top\n"
                                           "from slurm_plugin.contracts import batch\n"
                                           "def f():\n    from slurm_plugin.client import Node  # noqa\n"),
        "slurm_plugin/contracts/batch.py": "import math\n",
        "slurm_plugin/hostlist.py": "import re\n",
        "slurm_plugin/errors.py": "from slurm_plugin import client\n",
        "slurm_plugin/client.py": "from slurm_plugin.contracts.tres import f\n"})
    assert contracts_imports(module_edges(tmp_path)) == {
        ("slurm_plugin.contracts.tres", "slurm_plugin.client"): ["slurm_plugin/contracts/tres.py:4"],
        ("slurm_plugin.errors", "slurm_plugin.client"): ["slurm_plugin/errors.py:1"]}
