"""The type checker over the package (issue 32): mypy, configured in pyproject.toml ([tool.mypy]), finds nothing.

Strictness: every function is annotated (so mypy checks every body), Optional is never implicit, redundant casts
and unused `type: ignore`s are errors, comparisons between unrelated types are errors; third-party packages
without stubs are Any."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_mypy_finds_no_errors():
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
