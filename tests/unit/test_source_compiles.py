"""Every Python file of the project compiles without a warning.

Python 3.12 (the GPU machine's) reports an invalid escape in a string as SyntaxWarning, which pytest's
`filterwarnings = error` turns into a SyntaxError at import; 3.11 (this machine's) reports it as the
DeprecationWarning that pytest.ini ignores, so the fast tier did not see it (tests/gpu failed on import).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("predictor", "elastic_launcher", "slurm_plugin", "bench", "tests", "sbatch_templates")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def test_sources_found():
    assert len(_sources()) > 100


@pytest.mark.parametrize("package", PACKAGES)
def test_compiles_without_warnings(package):
    bad = []
    for path in (p for p in _sources() if p.relative_to(ROOT).parts[0] == package):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # DeprecationWarning (3.11) and SyntaxWarning (3.12) both raise
            try:
                compile(path.read_text(), str(path), "exec", dont_inherit=True)
            except (SyntaxError, SyntaxWarning, DeprecationWarning) as e:
                bad.append(f"{path.relative_to(ROOT)}: {e}")
    assert not bad, "\n".join(bad)
