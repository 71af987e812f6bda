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


def serve_bursts(burst: Callable[[], float], info: dict[str, Any] | None = None) -> int:
    """A worker's loop: `burst` (a warm engine's one burst, returning its tok/s; the probe's GB/s) for each "burst"
    line on stdin, after a ready line carrying `info` (an engine's bytes a decode step reads)."""
    print(MARK + json.dumps(info or {}), flush=True)
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
        self.info: dict[str, Any] = json.loads(self._read())  # ready: loaded and warmed up

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


def paired_bursts(ours: dict[str, Any], peer: dict[str, Any], pairs: int, probe: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """Our worker's and the peer's tok/s in `pairs` adjacent pairs (the first of each pair alternating), after one
    burst each that is not counted; the median of the pairs' ratios (ours / peer) and its quartiles. The pairs come
    in two halves, each with its own two workers, started ours first and then the peer first: one engine paired with
    itself read 0.91x in three runs of four (12-16 pairs; 0.98x in the fourth), the worker started first the slower,
    a bias the two halves cancel.

    With `probe` (a probe worker's spec), the bandwidth probe reads memory in a third process before each pair and
    after the last, and each burst's stream (tok/s x the bytes its step reads) is taken against the mean of the
    two probe readings around its pair: the share of the memory's rate in the same seconds, where a probe run
    minutes before a round reads another phase of this machine (passes 44-83 GB/s within one run)."""
    rates: list[list[float]] = [[], []]
    around: list[float] = []  # per pair: the mean of the probe readings before and after it
    nbytes = [0.0, 0.0]
    prober = BurstWorker(probe, "probe") if probe else None
    try:
        for half, n in enumerate((pairs - pairs // 2, pairs // 2)):
            order = (0, 1) if half == 0 else (1, 0)  # which side's worker starts first
            started: dict[int, BurstWorker] = {}
            try:
                for side in order:
                    started[side] = BurstWorker(*((ours, "ours"), (peer, "llama.cpp"))[side])
                    nbytes[side] = float(started[side].info.get("bytes", 0.0))
                for w in started.values():
                    w.burst()
                before = _probe_reading(prober)
                for i in range(n):
                    for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                        time.sleep(SETTLE_S)
                        rates[side].append(started[side].burst())
                    after = _probe_reading(prober)
                    if prober is not None:
                        around.append((before + after) / 2)
                    before = after
            finally:
                for w in started.values():
                    w.close()
    finally:
        if prober is not None:
            prober.close()
    ratios = sorted(a / b for a, b in zip(*rates, strict=True))
    out = {**_quartiles(ratios, "ratio"), "pairs": pairs, "ours": rates[0], "peer": rates[1]}
    if around and all(nbytes):
        out.update(probe=around, ours_bytes=nbytes[0], peer_bytes=nbytes[1],
                   ours_of_probe=_quartiles([r * nbytes[0] / p for r, p in zip(rates[0], around, strict=True)]),
                   peer_of_probe=_quartiles([r * nbytes[1] / p for r, p in zip(rates[1], around, strict=True)]))
    return out


def _probe_reading(prober: BurstWorker | None) -> float:
    if prober is None:
        return 0.0
    time.sleep(SETTLE_S)
    return prober.burst()


def _quartiles(values: list[float], name: str = "median") -> dict[str, float]:
    """{name: median, "q1", "q3"} of values."""
    v = sorted(values)
    q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
    return {name: statistics.median(v), "q1": q[0], "q3": q[2]}
