"""`minivllm bench fairness`: a light client's latency beside two heavy ones, with one shared key and with named keys.

A real server (`minivllm serve` in a subprocess, the embedded model by default) per mode, in turn:

- shared: every client uses the one --api-key (the server cannot tell them apart: admission is first come,
  first served over everyone's backlog);
- named: --api-keys-file gives each client its own key; the heavy ones get `max_concurrency` seats each.

In each mode the light client sends one request at a time (a 32-token prompt, 32 tokens out, greedy) and its
end-to-end latency is measured, first alone, then while two heavy clients keep sending /batch_generate calls of
256 such prompts (each sends its next call when its last one is answered; a 429 is retried after a short pause).
Reported: the light client's p50 and p99 alone and under load, their ratio (target: named keys ≤ 10x alone), and
the heavy clients' output tokens per second (what the seats cost them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np

from minivllm.bench.results import save
from minivllm.bench.serve import _start_server, _stop_servers
from minivllm.utils import free_port

KEYS = {"light": "sk-bench-light-0123456789", "heavy1": "sk-bench-heavy1-012345678",
        "heavy2": "sk-bench-heavy2-012345678"}


def add_fairness_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench fairness`."""
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--light-requests", type=int, default=40, help="light requests measured per phase (named keys)")
    p.add_argument("--shared-light-requests", type=int, default=10,
                   help="light requests measured under load with one shared key (each takes seconds)")
    p.add_argument("--batch", type=int, default=256, help="prompts per heavy /batch_generate call")
    p.add_argument("--tokens", type=int, default=32, help="output tokens of every request")
    p.add_argument("--heavy-concurrency", type=int, default=16, help="max_concurrency of each heavy key")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    # (_start_server's knobs)
    p.set_defaults(max_num_seqs=256, concurrency=1, num_requests=1024, server_arg=[], server_threads=None)


async def _light(url: str, key: str, n: int, tokens: int, prompt: str) -> list[float]:
    lat = []
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {key}"}) as http:
        for i in range(n):
            t0 = time.perf_counter()
            r = await http.post(url + "/generate", json={"prompt": f"{prompt} {i}", "max_new_tokens": tokens,
                                                          "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            lat.append(time.perf_counter() - t0)
    return lat


async def _heavy(url: str, key: str, batch: int, tokens: int, prompt: str, stop: asyncio.Event,
                 done: list[int]) -> None:
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {key}"}) as http:
        while not stop.is_set():
            r = await http.post(url + "/batch_generate", json={
                "prompts": [f"{prompt} {i}" for i in range(batch)], "max_new_tokens": tokens, "ignore_eos": True})
            if r.status_code == 429:
                await asyncio.sleep(0.1)
                continue
            r.raise_for_status()
            done[0] += sum(r.json()["tokens_generated"])


async def _phase(url: str, keys: dict[str, str], ns: argparse.Namespace, n: int, load: bool) -> dict[str, Any]:
    prompt = "def handler(request):\n    data = request.json()\n    return"  # ~32 tokens with its number
    stop, done = asyncio.Event(), [0]
    heavy = [asyncio.ensure_future(_heavy(url, keys[h], ns.batch, ns.tokens, prompt, stop, done))
             for h in ("heavy1", "heavy2")] if load else []
    if heavy:
        await asyncio.sleep(3.0)  # the heavy backlog is in place before the light client starts
    t0 = time.perf_counter()
    lat = await _light(url, keys["light"], n, ns.tokens, prompt)
    span = time.perf_counter() - t0
    stop.set()
    for h in heavy:
        h.cancel()
    await asyncio.gather(*heavy, return_exceptions=True)
    a = np.array(lat) * 1000
    return {"n": n, "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "heavy_tok_s": done[0] / span if load else 0.0}


def _mode(ns: argparse.Namespace, named: bool) -> dict[str, Any]:
    procs: list[Any] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        if named:
            path = os.path.join(tmp, "keys.json")
            with open(path, "w") as f:
                json.dump({"clients": [{"name": "light", "key": KEYS["light"]}, *(
                    {"name": h, "key": KEYS[h], "max_concurrency": ns.heavy_concurrency,
                     "max_queued": 4 * ns.batch} for h in ("heavy1", "heavy2"))]}, f)
            os.chmod(path, 0o600)
            extra, keys = ["--api-keys-file", path], KEYS
        else:
            extra, keys = ["--api-key", "sk-bench-shared-012345678"], dict.fromkeys(KEYS, "sk-bench-shared-012345678")
        try:
            _start_server(ns.model, port, None, ns, [*extra, "--max-waiting", str(4 * ns.batch + 64)], procs)
            asyncio.run(_light(url, keys["light"], 3, ns.tokens, "warm up"))
            alone = asyncio.run(_phase(url, keys, ns, ns.light_requests, load=False))
            loaded = asyncio.run(_phase(url, keys, ns, ns.light_requests if named else ns.shared_light_requests,
                                        load=True))
        finally:
            _stop_servers(procs)
    return {"alone": alone, "load": loaded, "p99_ratio": loaded["p99_ms"] / alone["p99_ms"]}


def run_fairness(ns: argparse.Namespace) -> int:
    """Run both modes; print the report; JSON with --out."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per request otherwise)
    if ns.model is None:
        from minivllm.default_model import default_model_path

        ns.model = default_model_path()
    result: dict[str, Any] = {"command": ["fairness", *sys.argv[3:]], "model": ns.model,
                              "batch": ns.batch, "tokens": ns.tokens, "heavy_concurrency": ns.heavy_concurrency,
                              "modes": {}}
    for mode in ("shared", "named"):
        result["modes"][mode] = _mode(ns, mode == "named")
        print(f"{mode}: {result['modes'][mode]}", flush=True)
    print(report(result))
    save(result, ns.out, None)
    return 0


def report(r: dict[str, Any]) -> str:
    """The light client's latency alone and beside the heavy ones, per mode, and the target."""
    lines = [f"A light client (one {r['tokens']}-token request at a time) beside two heavy ones (/batch_generate "
             f"of {r['batch']} prompts, back to back); named keys give each heavy key {r['heavy_concurrency']} "
             "seats.", "", "| keys | light p50 alone | p99 alone | p50 under load | p99 under load | p99 ratio | "
             "heavy output tok/s |", "|---|---|---|---|---|---|---|"]
    for mode, m in r["modes"].items():
        a, b = m["alone"], m["load"]
        lines.append(f"| {mode} | {a['p50_ms']:.0f} ms | {a['p99_ms']:.0f} ms | {b['p50_ms']:.0f} ms | "
                     f"{b['p99_ms']:.0f} ms | **{m['p99_ratio']:.1f}x** | {b['heavy_tok_s']:.0f} |")
    named = r["modes"].get("named")
    if named:
        met = named["p99_ratio"] <= 10
        lines += ["", f"Target (named keys: the light client's p99 under load ≤ 10x alone): "
                      f"**{'met' if met else 'not met'}** ({named['p99_ratio']:.1f}x)."]
    return "\n".join(lines)
