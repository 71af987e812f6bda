"""Paired bursts (`bench peers --pairs N`): our engine and llama.cpp on the same file, both loaded at once in two
long-lived processes, decoding one sequence in alternating bursts (ABBA), the ratio taken within each adjacent pair.

The rounds of `bench peers` start a fresh process per configuration and measure each one once a round, minutes
apart from its peer. On the 2-vCPU VMs this project runs on, the memory's rate moves by up to 1.8x from one minute
to the next (the bandwidth probe's passes spread 13-48 GB/s within runs; llama.cpp's own b=1 decode moved
24-38 tok/s in one run), so a ratio of medians over 2-3 rounds is the machine's phase as much as either engine
(round ratios of one run 0.76-1.44x). Here each burst lasts about a second and its peer's runs right beside it, so
both meet the same phase: the median of many pairs' ratios is the engines', and its quartiles say how much the
pairs disagree. Between bursts each side rests SETTLE_S, so the other process's threads, which spin a while after
their work, have stopped competing for the cores."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

MARK = "BURST "  # prefixes the protocol's lines on a worker's stdout (a native library may print there too)
SETTLE_S = 0.1


def serve_bursts(burst: Callable[[], float]) -> int:
    """A worker's loop: `burst` (a warm engine's one burst, returning its tok/s) for each "burst" line on stdin."""
    print(MARK + "ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "burst":
            break
        print(MARK + json.dumps(burst()), flush=True)
    return 0


class BurstWorker:
    """One engine in its own process (`minivllm bench peers --burst-worker SPEC`), loaded and warm, running a burst
    each time it is asked."""

    def __init__(self, spec: dict[str, Any], label: str) -> None:
        self.label = label
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "minivllm", "bench", "peers", "--burst-worker",
                                      json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self._read()  # "ready": loaded and warmed up

    def _read(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return line[len(MARK):].strip()
        self.log.seek(0)
        raise RuntimeError(f"{self.label} worker ended: {self.log.read()[-800:]}")

    def burst(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("burst\n")
        self.proc.stdin.flush()
        return float(json.loads(self._read()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def paired_bursts(ours: dict[str, Any], peer: dict[str, Any], pairs: int) -> dict[str, Any]:
    """Our worker's and the peer's tok/s in `pairs` adjacent pairs (the first of each pair alternating), after one
    burst each that is not counted; the median of the pairs' ratios (ours / peer) and its quartiles. The pairs come
    in two halves, each with its own two workers, started ours first and then the peer first: one engine paired with
    itself read 0.91x in three runs of four (12-16 pairs; 0.98x in the fourth), the worker started first the slower,
    a bias the two halves cancel."""
    rates: list[list[float]] = [[], []]
    for half, n in enumerate((pairs - pairs // 2, pairs // 2)):
        order = (0, 1) if half == 0 else (1, 0)  # which side's worker starts first
        started: dict[int, BurstWorker] = {}
        try:
            for side in order:
                started[side] = BurstWorker(*((ours, "ours"), (peer, "llama.cpp"))[side])
            for w in started.values():
                w.burst()
            for i in range(n):
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    time.sleep(SETTLE_S)
                    rates[side].append(started[side].burst())
        finally:
            for w in started.values():
                w.close()
    ratios = sorted(a / b for a, b in zip(*rates, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2], "pairs": pairs,
            "ours": rates[0], "peer": rates[1]}
