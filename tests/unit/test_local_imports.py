"""Every import inside a function says why it is not at the module's top (issue #46).

An import in a function or method of predictor, elastic_launcher or slurm_plugin must carry, on one of its lines,
`# noqa: PLC0415 - <reason>`: a heavy or optional dependency kept off a command's start or the service
("- torch: only `launch`"), or a module that only one subcommand needs ("- only `plan`"). An import that nothing
stops belongs at the top. Read from the source with `ast`; nothing is imported.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("predictor", "elastic_launcher", "slurm_plugin")
REASON = re.compile(r"#\s*noqa:\s*[A-Z0-9, ]*\bPLC0415\b[A-Z0-9, ]*\s+-\s+\S")
# an import that is not at column 0 of its line (indented, or after `def f():` / `;`): only a file with one is
# parsed (parsing every module takes about 0.5 s on a busy 2-core host; these are a quarter of them)
MAYBE_LOCAL = re.compile(r"^(?:[ \t]+|.*[:;][ \t]*)(?:import|from)[ \t]", re.MULTILINE)


def _local_imports(node: ast.AST, in_function: bool = False):
    """The import statements inside a function or method, at any depth (each node visited once)."""
    for child in ast.iter_child_nodes(node):
        if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _local_imports(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def unexplained(root: Path = ROOT) -> list[str]:
    """`path:line` of each function-local import without a `# noqa: PLC0415 - <reason>` on one of its lines."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            if not MAYBE_LOCAL.search(source):
                continue
            lines = source.splitlines()
            for node in _local_imports(ast.parse(source, filename=str(path))):
                if not any(REASON.search(line) for line in lines[node.lineno - 1:node.end_lineno]):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_function_local_import_gives_its_reason():
    bad = unexplained()
    assert not bad, ("function-local imports without `# noqa: PLC0415 - <reason>` (move each to the module's top, "
                     "or say in one line what keeps it inside): " + ", ".join(bad))


def test_the_check_names_each_unexplained_import(tmp_path):
    """The check itself: module-level and explained imports pass; a bare noqa, no comment, a method's and a nested
    function's import are named; a multi-line import may give its reason on any of its lines."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "predictor" / "a.py").write_text(
        "import os\n"
        "if os.name:\n"
        "    import sys\n"
        "def f():\n"
        "    import json  # noqa: PLC0415 - only f\n"
        "    import csv  # noqa: PLC0415\n"
        "    from math import (  # noqa: PLC0415 - only f\n"
        "        pi)\n"
        "    from math import (\n"
        "        tau)  # noqa: F401, PLC0415 - only f\n"
        "    import re  # noqa: PLC0415 -\n")
    (tmp_path / "slurm_plugin" / "b.py").write_text(
        "class C:\n"
        "    import glob\n"
        "    def m(self):\n"
        "        def inner():\n"
        "            import shlex\n"
        "        import time  # PLC0415 - no noqa\n")
    (tmp_path / "elastic_launcher" / "c.py").write_text("import os\ndef f(): import sys\n")
    assert unexplained(tmp_path) == ["predictor/a.py:6", "predictor/a.py:11", "elastic_launcher/c.py:2",
                                     "slurm_plugin/b.py:5", "slurm_plugin/b.py:6"]
