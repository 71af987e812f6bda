"""`minivllm profile --pid PID --seconds S`: over the same window, `perf stat` counters of the process
(IPC, cache misses, context switches, migrations, page faults) and a py-spy flame graph (SVG) of its
Python stacks. Each part either produces its output or says exactly why it could not: perf missing,
the kernel's perf_event_paranoid, or a VM that exposes no hardware counters (perf's "<not supported>").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import psutil

EVENTS = ("instructions", "cycles", "cache-references", "cache-misses", "context-switches", "cpu-migrations",
          "page-faults")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm profile`."""
    p.add_argument("--pid", type=int, required=True, help="process to profile (e.g. a running `minivllm serve`)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the window")
    p.add_argument("--out-dir", default=".", help="where perf_stat.json and flamegraph.svg go")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")


def _paranoid() -> str:
    try:
        with open("/proc/sys/kernel/perf_event_paranoid") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def parse_perf_csv(text: str) -> dict[str, float | None]:
    """`perf stat -x,` lines → event → count (None where perf says <not supported> / <not counted>)."""
    out: dict[str, float | None] = {}
    for line in text.splitlines():
        parts = line.split(",")
        if len(parts) < 3 or parts[2] not in EVENTS:
            continue
        try:
            out[parts[2]] = float(parts[0])
        except ValueError:
            out[parts[2]] = None
    return out


def summarize_perf(counts: dict[str, float | None]) -> tuple[dict[str, float], list[str]]:
    """Derived figures (IPC, cache-miss rate, the software counts) and why any is missing."""
    figures: dict[str, float] = {k: v for k, v in counts.items() if v is not None}
    missing = sorted(k for k, v in counts.items() if v is None)
    notes = []
    if counts.get("instructions") and counts.get("cycles"):
        figures["ipc"] = counts["instructions"] / counts["cycles"]  # type: ignore[operator]
    else:
        notes.append("IPC: perf reports instructions/cycles as <not supported>: this machine (a VM) exposes no "
                     "hardware performance counters to the guest")
    if counts.get("cache-misses") is not None and counts.get("cache-references"):
        figures["cache_miss_rate"] = counts["cache-misses"] / counts["cache-references"]  # type: ignore[operator]
    elif "cache-misses" in missing:
        notes.append("cache misses: <not supported> (no hardware counters here)")
    return figures, notes


def _start_perf(pid: int, seconds: float) -> tuple[subprocess.Popen[str] | None, str | None]:
    perf = shutil.which("perf")
    if perf is None:
        return None, "perf is not installed (Debian: apt-get install linux-perf)"
    cmd = [perf, "stat", "-x,", "-e", ",".join(EVENTS), "-p", str(pid), "--", "sleep", str(seconds)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), None


def _start_pyspy(pid: int, seconds: float, rate: int, svg: str) -> tuple[subprocess.Popen[str] | None, str | None]:
    spy = shutil.which("py-spy")
    if spy is None:
        return None, "py-spy is not installed: pip install -e '.[profile]'"
    cmd = [spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
           "--format", "flamegraph", "--output", svg, "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), None


def profile(pid: int, seconds: float, out_dir: str, rate: int = 100) -> dict[str, Any]:
    """Run both tools over one window; the result says what each produced, or why not."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if not psutil.pid_exists(pid):
        raise ValueError(f"pid: no process {pid}")
    os.makedirs(out_dir, exist_ok=True)
    svg = os.path.join(out_dir, "flamegraph.svg")
    perf, perf_why = _start_perf(pid, seconds)
    spy, spy_why = _start_pyspy(pid, seconds, rate, svg)
    result: dict[str, Any] = {"pid": pid, "seconds": seconds, "perf": None, "flamegraph": None}
    if perf is not None:
        _, err = perf.communicate(timeout=seconds + 60)
        counts = parse_perf_csv(err)
        if perf.returncode != 0 or not counts:
            perf_why = (f"perf stat failed (exit {perf.returncode}; kernel.perf_event_paranoid="
                        f"{_paranoid()}): {err.strip()[-400:]}")
        else:
            figures, notes = summarize_perf(counts)
            result["perf"] = {"counts": counts, "figures": figures, "notes": notes}
    if spy is not None:
        _, err = spy.communicate(timeout=seconds + 120)
        if spy.returncode == 0 and os.path.isfile(svg):
            result["flamegraph"] = svg
        else:
            spy_why = f"py-spy failed (exit {spy.returncode}; it needs ptrace rights on the pid): {err.strip()[-400:]}"
    result["perf_unavailable"] = perf_why
    result["flamegraph_unavailable"] = spy_why
    with open(os.path.join(out_dir, "perf_stat.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def run_profile(ns: argparse.Namespace) -> int:
    """`minivllm profile`: 0 when at least one of the two produced its output."""
    r = profile(ns.pid, ns.seconds, ns.out_dir, ns.rate)
    if r["perf"]:
        figs = r["perf"]["figures"]
        print("perf stat: " + ", ".join(f"{k} {v:.3g}" for k, v in figs.items()))
        for note in r["perf"]["notes"]:
            print(f"perf stat: {note}")
    else:
        print(f"perf stat: unavailable: {r['perf_unavailable']}")
    print(f"flame graph: {r['flamegraph']}" if r["flamegraph"] else f"flame graph: unavailable: "
          f"{r['flamegraph_unavailable']}")
    print(f"wrote {os.path.join(ns.out_dir, 'perf_stat.json')}", file=sys.stderr)
    return 0 if r["perf"] or r["flamegraph"] else 1
