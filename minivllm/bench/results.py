"""Where every bench puts its results: JSON, and a PNG plot next to it."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from typing import Any


def save(result: dict[str, Any], out: str | None, plot: Callable[[dict[str, Any], str], None] | None) -> None:
    """Write result as JSON to out and plot(result, png) to the same name with .png (nothing if out is None;
    no PNG if plot is None)."""
    if not out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    if plot is None:
        print(f"wrote {out}")
        return
    png = os.path.splitext(out)[0] + ".png"
    if importlib.util.find_spec("matplotlib") is None:
        print(f"wrote {out}; no PNG: matplotlib is not installed (pip install -e \".[bench]\")")
        return
    plot(result, png)
    print(f"wrote {out} and {png}")
