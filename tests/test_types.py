"""The type checker over the package (issue 32): mypy, configured in pyproject.toml ([tool.mypy]), finds nothing.

Strictness: every function is annotated (so mypy checks every body), Optional is never implicit, redundant casts
and unused `type: ignore`s are errors, comparisons between unrelated types are errors; third-party packages
without stubs are Any."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
from typing import IO

ROOT = pathlib.Path(__file__).resolve().parent.parent
_mypy: tuple[subprocess.Popen[bytes], IO[bytes]] | None = None


def start_mypy() -> None:
    """Start mypy in the background at the lowest CPU priority (conftest.py does once this test is collected): a cold
    run is ~65 s of one core, and at nice 19 it takes the cycles the tests before this one leave idle (waits on
    servers, subprocesses and sockets) instead of 65 s of the suite's wall time, while taking next to none from them."""
    global _mypy
    if _mypy is None:
        out = tempfile.TemporaryFile()  # (not a pipe: nobody reads it until the test, and a full pipe would block mypy)
        proc = subprocess.Popen([sys.executable, "-m", "mypy"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=lambda: os.nice(19))
        _mypy = (proc, out)


def test_mypy_finds_no_errors():
    start_mypy()
    assert _mypy is not None
    proc, out = _mypy
    try:
        code = proc.wait(900)
    finally:
        if proc.poll() is None:
            proc.kill()
    out.seek(0)
    text = out.read().decode(errors="replace")
    assert code == 0, text[-8000:]
    assert "Success: no issues found" in text
