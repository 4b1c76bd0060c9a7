"""The packages import each other in one direction only (docs/design.md, "Import order").

Read from the source with `ast` (nothing is imported): every `import` / `from ... import`, at module level or
inside a function, is an edge between the layers of the two modules:

    slurm_plugin (core: client, directives, hostlist, errors, installer, templates)
      <- predictor <- elastic_launcher <- slurm_plugin.lab (demo, testbed) <- slurm_plugin.cli (`elastic-slurm`)

The layer graph must have no cycle; a failure names each cycle with the import lines that close it.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("slurm_plugin", "predictor", "elastic_launcher")
ENTRY_POINT = "slurm_plugin.cli"      # the `elastic-slurm` console script: above the lab, imported by nothing
LAB = "slurm_plugin.lab"


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


def import_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(from layer, to layer) -> the import lines (`path:line`) that make the edge, for every cross-layer import."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            module = _module_name(path, root)
            source = layer(module)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                targets = {layer(name) for name in _imported(node, module, path.name == "__init__.py")}
                for target in targets - {None, source}:
                    edges[(source, target)].append(f"{path.relative_to(root)}:{node.lineno}")
    return dict(edges)


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


def test_layers_import_in_one_direction():
    edges = import_edges()
    problems = []
    for cycle in cycles(edges):
        hops = list(zip(cycle, cycle[1:] + cycle[:1]))
        where = "; ".join(f"{a} -> {b} at {', '.join(edges[(a, b)][:3])}" for a, b in hops)
        problems.append(f"cycle {' -> '.join(cycle + cycle[:1])} ({where})")
    assert not problems, "\n".join(problems)


def test_entry_point_and_lab_sit_on_top():
    """Nothing below the lab imports it, and nothing imports the console entry point."""
    edges = import_edges()
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
