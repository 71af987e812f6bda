"""`minivllm bench serve`: a closed-loop load generator against the real server (`minivllm serve` in a
subprocess), and the offline engine on the same requests in the same run.

Reports req/s, output tok/s, TTFT / ITL / end-to-end percentiles, errors, the server's event-loop lag
(its own timer probe, read from /metrics), and server throughput as a fraction of the offline engine's
at the same concurrency. The offline engine runs before and after the server and its mean is used,
since the machine's speed drifts over minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from minivllm.bench.throughput import greedy, random_prompts, resolve_model, run_engine
from minivllm.config import EngineArgs, ModelConfig, cpu_count
from minivllm.engine.llm_engine import LLMEngine


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench serve`."""
    p.add_argument("--model", default=None, help="model directory (default: make --preset in a cache dir)")
    p.add_argument("--preset", default="smollm2-135m", help="preset to make when --model is not given")
    p.add_argument("--concurrency", type=int, default=32, help="clients, each with one request in flight")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--input-len-min", type=int, default=32)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="offline engine threads (default: all cores)")
    p.add_argument("--server-threads", type=int, default=None, help="the server engine's threads (default: all)")
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--no-offline", action="store_true", help="skip the offline engine baseline")
    p.add_argument("--out", default=None, help="write the results as JSON here")


@dataclass
class RequestResult:
    """Client-side timings of one streamed request."""

    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


async def _one(http: httpx.AsyncClient, url: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last, res = t0, RequestResult(ok=False)
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return RequestResult(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=chunk["error"]["message"])
                now = time.perf_counter()
                # Every chunk is one engine step's tokens, text or not (a partial UTF-8 character
                # streams as an empty delta), as in vLLM's benchmark.
                if chunk["choices"]:
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return RequestResult(False, error=repr(e))
    res.e2e = time.perf_counter() - t0
    res.ok = res.output_tokens == output_len
    if not res.ok:
        res.error = f"{res.output_tokens} tokens instead of {output_len}"
    return res


async def run_load(url: str, prompts: list[list[int]], output_len: int, concurrency: int
                   ) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` clients, each sending its next request when the last one ends."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def client() -> None:
            while not queue.empty():
                results.append(await _one(http, url, queue.get_nowait(), output_len))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith("minivllm:event_loop_lag"):
                out[s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else "")] = s.value
    return out


def _lag(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Event-loop lag over the measured window from the probe histogram: count, mean, p99 and max bucket."""
    name = "minivllm:event_loop_lag_seconds"
    n = after[name + "_count"] - before[name + "_count"]
    mean = (after[name + "_sum"] - before[name + "_sum"]) / n if n else 0.0
    buckets = sorted((float(k.split("le=")[1].rstrip("}")), after[k] - before[k])
                     for k in after if k.startswith(name + "_bucket"))
    p99 = next((le for le, c in buckets if c >= 0.99 * n), float("inf"))
    worst = next((le for le, c in buckets if c >= n), float("inf"))
    return {"probes": n, "mean_s": mean, "p99_le_s": p99, "max_le_s": worst,
            "max_since_start_s": after["minivllm:event_loop_lag_max_seconds"]}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def _start_server(path: str, port: int, ns: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "minivllm", "serve", path, "--port", str(port), "--kv-cache-memory",
           ns.kv_cache_memory, "--max-num-seqs", str(max(ns.concurrency, 1)), "--log-level", "warning",
           "--max-waiting", str(ns.num_requests + 16)]
    if ns.server_threads:
        cmd += ["--num-threads", str(ns.server_threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy in 300 s")


def _offline(path: str, prompts: list[list[int]], ns: argparse.Namespace) -> float:
    engine = LLMEngine(EngineArgs(model=path, num_threads=ns.threads, kv_cache_memory=ns.kv_cache_memory,
                                  max_num_seqs=ns.concurrency))
    run_engine(engine, prompts[:2], greedy(4))  # warm-up
    r = run_engine(engine, prompts, greedy(ns.output_len))
    del engine
    return len(prompts) * ns.output_len / r["elapsed"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(ns: argparse.Namespace) -> int:
    """`minivllm bench serve`."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report
    path = resolve_model(ns.model, ns.preset)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts = random_prompts(ns.num_requests, ns.input_len_min, ns.input_len_max, vocab, seed=0)
    threads = ns.threads or cpu_count()
    result: dict[str, Any] = {"model": path, "concurrency": ns.concurrency, "num_requests": ns.num_requests,
                              "input_len": [ns.input_len_min, ns.input_len_max], "output_len": ns.output_len,
                              "threads": threads, "server_threads": ns.server_threads or cpu_count()}
    offline = []
    if not ns.no_offline:
        offline.append(_offline(path, prompts, ns))
        print(f"offline engine: {offline[-1]:.1f} tok/s", flush=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_server(path, port, ns)
    try:
        asyncio.run(run_load(url, prompts[:4], 8, 4))  # warm-up
        before = _scrape(url)
        results, elapsed = asyncio.run(run_load(url, prompts, ns.output_len, ns.concurrency))
        after = _scrape(url)
    finally:
        proc.terminate()
        proc.wait(30)
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    server = {
        "elapsed_s": elapsed, "requests_ok": len(ok), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), ""),
        "req_per_s": len(ok) / elapsed, "output_tok_per_s": tokens / elapsed,
        "ttft_ms": {f"p{q}": 1000 * _pct([r.ttft for r in ok], q) for q in (50, 95, 99)},
        "itl_ms": {f"p{q}": 1000 * _pct(itls, q) for q in (50, 95, 99)},
        "e2e_s": {f"p{q}": _pct([r.e2e for r in ok], q) for q in (50, 95, 99)},
        "event_loop_lag": _lag(before, after),
    }
    result["server"] = server
    print(f"server: {server['output_tok_per_s']:.1f} tok/s", flush=True)
    if not ns.no_offline:
        offline.append(_offline(path, prompts, ns))
        print(f"offline engine (again): {offline[-1]:.1f} tok/s", flush=True)
        result["offline_tok_per_s"] = offline
        result["server_vs_offline"] = server["output_tok_per_s"] / statistics.mean(offline)
    print(report(result))
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if not server["errors"] else 1


def report(r: dict[str, Any]) -> str:
    """A markdown summary."""
    s = r["server"]
    lag = s["event_loop_lag"]
    lines = [
        f"closed loop, {r['concurrency']} streaming clients, {r['num_requests']} requests, prompts "
        f"{r['input_len'][0]}–{r['input_len'][1]} tokens, {r['output_len']} tokens out (ignore_eos), "
        f"engine threads: server {r['server_threads']}, offline {r['threads']}",
        "",
        "| | value |", "|---|---|",
        f"| server output throughput | {s['output_tok_per_s']:.1f} tok/s ({s['req_per_s']:.2f} req/s) |",
    ]
    if "server_vs_offline" in r:
        off = r["offline_tok_per_s"]
        lines.append(f"| offline engine, same requests, max_num_seqs={r['concurrency']} | "
                     f"{statistics.mean(off):.1f} tok/s (runs: {', '.join(f'{x:.1f}' for x in off)}) |")
        lines.append(f"| **server / offline** | **{r['server_vs_offline']:.2f}** |")
    lines += [
        f"| TTFT p50 / p95 / p99 | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p95']:.0f} / "
        f"{s['ttft_ms']['p99']:.0f} ms |",
        f"| ITL p50 / p95 / p99 | {s['itl_ms']['p50']:.1f} / {s['itl_ms']['p95']:.1f} / {s['itl_ms']['p99']:.1f} ms |",
        f"| end-to-end p50 / p99 | {s['e2e_s']['p50']:.1f} / {s['e2e_s']['p99']:.1f} s |",
        f"| errors | {s['errors']} {s['first_error']} |",
        f"| event-loop lag (10 ms timer probe, {lag['probes']:.0f} probes) | mean {1000 * lag['mean_s']:.2f} ms, "
        f"p99 ≤ {1000 * lag['p99_le_s']:.0f} ms, max ≤ {1000 * lag['max_le_s']:.0f} ms "
        f"(max since start {1000 * lag['max_since_start_s']:.1f} ms) |",
    ]
    return "\n".join(lines)
