"""`minivllm monitor --pid PID --duration S`: sample a process (a live `minivllm serve`) every --interval
seconds into a CSV: RSS, peak RSS (the kernel's VmHWM), virtual size, CPU%, threads, voluntary and
involuntary context switches, minor and major page faults; optionally a PNG plot next to the CSV.

psutil gives what it has portably; VmHWM and the fault counts come from /proc (Linux), blank elsewhere.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from typing import Any

import psutil

FIELDS = ("t_s", "rss_bytes", "peak_rss_bytes", "vms_bytes", "cpu_percent", "num_threads", "ctx_voluntary",
          "ctx_involuntary", "minor_faults", "major_faults")


def add_monitor_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm monitor`."""
    p.add_argument("--pid", type=int, required=True, help="process to watch (e.g. a running `minivllm serve`)")
    p.add_argument("--duration", type=float, required=True, help="seconds to watch")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--out", default=None, help="CSV path (default: stdout)")
    p.add_argument("--plot", action="store_true", help="also write a PNG next to --out (needs matplotlib)")


def _proc_status_kb(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _faults(pid: int) -> tuple[int | None, int | None]:
    """(minor, major) page faults from /proc/PID/stat (fields 10 and 12, after the command's parentheses)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return int(rest[7]), int(rest[9])
    except (OSError, IndexError, ValueError):
        return None, None


def sample(proc: psutil.Process, t0: float) -> dict[str, Any]:
    """One row of FIELDS for proc now."""
    with proc.oneshot():
        mem = proc.memory_info()
        ctx = proc.num_ctx_switches()
        row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 3), "rss_bytes": mem.rss, "vms_bytes": mem.vms,
                               "cpu_percent": proc.cpu_percent(None), "num_threads": proc.num_threads(),
                               "ctx_voluntary": ctx.voluntary, "ctx_involuntary": ctx.involuntary}
    hwm = _proc_status_kb(proc.pid, "VmHWM")
    row["peak_rss_bytes"] = hwm * 1024 if hwm is not None else None
    row["minor_faults"], row["major_faults"] = _faults(proc.pid)
    return row


def monitor(pid: int, duration: float, interval: float) -> list[dict[str, Any]]:
    """Samples of pid for `duration` seconds (fewer if the process exits)."""
    if interval <= 0 or duration <= 0:
        raise ValueError(f"duration and interval must be positive, got {duration} and {interval}")
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        raise ValueError(f"pid: no process {pid}") from None
    proc.cpu_percent(None)  # the first call only starts the CPU clock
    t0 = time.monotonic()
    rows = []
    while True:
        time.sleep(interval)
        try:
            rows.append(sample(proc, t0))
        except psutil.NoSuchProcess:
            print(f"minivllm monitor: process {pid} exited", file=sys.stderr)
            break
        if time.monotonic() - t0 >= duration:
            break
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """RSS and peak RSS, CPU%, and context switches per second over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t_s"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    axes[0].plot(t, [r["rss_bytes"] / 2**20 for r in rows], label="RSS")
    if rows and rows[0]["peak_rss_bytes"] is not None:
        axes[0].plot(t, [r["peak_rss_bytes"] / 2**20 for r in rows], "--", label="peak RSS (VmHWM)")
    axes[0].set_ylabel("MiB")
    axes[0].legend()
    axes[1].plot(t, [r["cpu_percent"] for r in rows])
    axes[1].set_ylabel("CPU %")
    for key, label in (("ctx_voluntary", "voluntary"), ("ctx_involuntary", "involuntary")):
        rate = [(b[key] - a[key]) / max(b["t_s"] - a["t_s"], 1e-9) for a, b in zip(rows, rows[1:], strict=False)]
        axes[2].plot(t[1:], rate, label=label)
    axes[2].set_ylabel("context switches / s")
    axes[2].set_xlabel("seconds")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_monitor(ns: argparse.Namespace) -> int:
    """`minivllm monitor`."""
    rows = monitor(ns.pid, ns.duration, ns.interval)
    if ns.plot and not ns.out:
        raise ValueError("--plot writes a PNG next to --out: give --out X.csv")
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    f = open(ns.out, "w", newline="") if ns.out else sys.stdout
    try:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    finally:
        if ns.out:
            f.close()
    if rows:
        peak = max((r["peak_rss_bytes"] or r["rss_bytes"]) for r in rows)
        span = max(rows[-1]["t_s"] - rows[0]["t_s"], 1e-9)
        invol = (rows[-1]["ctx_involuntary"] - rows[0]["ctx_involuntary"]) / span
        print(f"minivllm monitor: {len(rows)} samples of pid {ns.pid}; peak RSS {peak / 2**20:.1f} MiB, mean CPU "
              f"{sum(r['cpu_percent'] for r in rows) / len(rows):.0f}%, {invol:.0f} involuntary context switches/s",
              file=sys.stderr)
    if ns.plot and rows:
        png = os.path.splitext(ns.out)[0] + ".png"
        plot(rows, png)
        print(f"minivllm monitor: wrote {ns.out} and {png}", file=sys.stderr)
    return 0 if rows else 1
