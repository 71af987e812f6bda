"""Where every bench puts its results: JSON, and a PNG plot next to it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
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


def run_worker(verb: str, spec: dict[str, Any], label: str) -> dict[str, Any] | None:
    """One configuration of a bench in a fresh process (`minivllm bench VERB --worker SPEC`, printing its result as
    JSON on its last line); None, the error printed under `label`, when it failed."""
    proc = subprocess.run([sys.executable, "-m", "minivllm", "bench", verb, "--worker", json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {label} failed: {proc.stderr.strip()[-800:]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratio_bars(png: str, labels: list[str], series: dict[str, list[float]], ylabel: str, fontsize: int = 6) -> None:
    """Two series of ratios side by side per label, a line at 1.0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(labels)), 4))
    x = range(len(labels))
    for (name, values), shift in zip(series.items(), (-0.2, 0.2), strict=True):
        ax.bar([i + shift for i in x], values, width=0.4, label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), labels, fontsize=fontsize)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
