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

from minivllm.bench.throughput import greedy, resolve_model, run_engine
from minivllm.config import EngineArgs, cpu_count
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.tokenizer import get_tokenizer

TRANSPORTS = ("openai", "http", "grpc")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench serve`."""
    p.add_argument("--model", default=None, help="model directory (default: make --preset in a cache dir)")
    p.add_argument("--preset", default="smollm2-135m", help="preset to make when --model is not given")
    p.add_argument("--transport", default="openai",
                   help="comma-separated, each run on the same server and requests: openai (/v1/completions SSE), "
                        "http (the seed's /generate SSE), grpc (GenerateStream)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measured runs per transport, in ABBA order against drift (default: 1, or 2 when "
                        "comparing transports)")
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
    """Client-side timings of one streamed request; output_tokens as the server reported them."""

    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


class _Timer:
    """TTFT and inter-token gaps from the arrival times of messages carrying tokens."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.res = RequestResult(ok=False)

    def tokens_arrived(self) -> None:
        now = time.perf_counter()
        if self.res.ttft == 0.0:
            self.res.ttft = now - self.t0
        else:
            self.res.itls.append(now - self.last)
        self.last = now

    def done(self, output_tokens: int, expected: int) -> RequestResult:
        res = self.res
        res.e2e = time.perf_counter() - self.t0
        res.output_tokens = output_tokens
        res.ok = output_tokens == expected
        if not res.ok:
            res.error = f"{output_tokens} tokens instead of {expected}"
        return res


class _HTTPClient:
    """Streaming over HTTP: OpenAI /v1/completions or the seed's /generate, both SSE."""

    def __init__(self, url: str, transport: str, concurrency: int) -> None:
        self.url, self.transport = url, transport
        limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
        self.http = httpx.AsyncClient(timeout=600, limits=limits)

    async def one(self, prompt: str, output_len: int) -> RequestResult:
        if self.transport == "openai":
            path = "/v1/completions"
            body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
        else:
            path = "/generate"
            body = {"prompt": prompt, "max_new_tokens": output_len, "temperature": 0, "ignore_eos": True,
                    "stream": True}
        timer, tokens = _Timer(), 0
        try:
            async with self.http.stream("POST", self.url + path, json=body) as resp:
                if resp.status_code != 200:
                    return RequestResult(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return RequestResult(False, error=event["error"]["message"])
                    if self.transport == "openai":
                        # Every chunk is one engine step's tokens, text or not (a partial UTF-8 character
                        # streams as an empty delta), as in vLLM's benchmark.
                        if event["choices"]:
                            timer.tokens_arrived()
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
                    else:  # /generate: an event per text delta, each with the running token count
                        if event["tokens_generated"] > tokens:
                            timer.tokens_arrived()
                        tokens = event["tokens_generated"]
        except httpx.HTTPError as e:
            return RequestResult(False, error=repr(e))
        return timer.done(tokens, output_len)

    async def aclose(self) -> None:
        await self.http.aclose()


class _GRPCClient:
    """Streaming over gRPC: GenerateStream on one grpc.aio channel (HTTP/2 multiplexes the calls)."""

    def __init__(self, target: str) -> None:
        import grpc

        from minivllm.entrypoints.proto import inference_pb2, inference_pb2_grpc

        self.grpc, self.pb = grpc, inference_pb2
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    async def one(self, prompt: str, output_len: int) -> RequestResult:
        req = self.pb.GenerateRequest(prompt=prompt, max_new_tokens=output_len, temperature=0, ignore_eos=True)
        timer, tokens = _Timer(), 0
        try:
            async for msg in self.stub.GenerateStream(req, timeout=600):
                if msg.token_ids:
                    timer.tokens_arrived()
                if msg.finish_reason:
                    tokens = msg.usage.completion_tokens
        except self.grpc.aio.AioRpcError as e:
            return RequestResult(False, error=f"{e.code().name}: {e.details()}")
        return timer.done(tokens, output_len)

    async def aclose(self) -> None:
        await self.channel.close()


async def run_load(transport: str, url: str, grpc_target: str | None, prompts: list[str], output_len: int,
                   concurrency: int) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` clients, each sending its next request when the last one ends."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    client = _GRPCClient(grpc_target) if transport == "grpc" else _HTTPClient(url, transport, concurrency)
    try:
        async def worker() -> None:
            while not queue.empty():
                results.append(await client.one(queue.get_nowait(), output_len))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0
    finally:
        await client.aclose()


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


_CORPUS_MODULES = ("argparse", "asyncio.base_events", "json.decoder", "logging", "statistics", "subprocess")


def text_prompts(tokenizer: Any, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """n prompts of real text (the standard library's own source, present on every machine), each a
    window of about lo–hi tokens; text, so that every transport (including /generate, which takes no
    token ids) sends exactly the same requests."""
    import importlib
    import inspect
    import random

    sources = [inspect.getsource(importlib.import_module(m)) for m in _CORPUS_MODULES]
    ids = tokenizer("\n".join(sources), add_special_tokens=False, verbose=False)["input_ids"]  # no length warning
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(tokenizer.decode(ids[start:start + length]))
    return out


def _start_server(path: str, port: int, grpc_port: int | None, ns: argparse.Namespace) -> subprocess.Popen[bytes]:
    # Prefix caching off: the transports replay the same prompts, and the second would find them cached.
    cmd = [sys.executable, "-m", "minivllm", "serve", path, "--port", str(port), "--kv-cache-memory",
           ns.kv_cache_memory, "--max-num-seqs", str(max(ns.concurrency, 1)), "--log-level", "warning",
           "--max-waiting", str(ns.num_requests + 16), "--no-enable-prefix-caching"]
    if grpc_port is not None:
        cmd += ["--grpc-port", str(grpc_port)]
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
                                  max_num_seqs=ns.concurrency, enable_prefix_caching=False))
    run_engine(engine, prompts[:2], greedy(4))  # warm-up
    r = run_engine(engine, prompts, greedy(ns.output_len))
    del engine
    return len(prompts) * ns.output_len / r["elapsed"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(results: list[RequestResult], elapsed: float, lag: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    # Time per output token after the first: independent of how the transport groups tokens into messages.
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "elapsed_s": elapsed, "requests_ok": len(ok), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), ""),
        "req_per_s": len(ok) / elapsed, "output_tok_per_s": tokens / elapsed,
        "ttft_ms": {f"p{q}": 1000 * _pct([r.ttft for r in ok], q) for q in (50, 95, 99)},
        "itl_ms": {f"p{q}": 1000 * _pct(itls, q) for q in (50, 95, 99)},
        "tpot_ms": {f"p{q}": 1000 * _pct(tpots, q) for q in (50, 95, 99)},
        "e2e_s": {f"p{q}": _pct([r.e2e for r in ok], q) for q in (50, 95, 99)},
        "event_loop_lag": lag,
    }


def _order(transports: list[str], rounds: int) -> list[str]:
    """ABBA…: each transport runs early and late as often as the others, so drift cancels in the means."""
    out: list[str] = []
    for r in range(rounds):
        out += transports if r % 2 == 0 else transports[::-1]
    return out


def run_serve(ns: argparse.Namespace) -> int:
    """`minivllm bench serve`."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the report
    transports = [t.strip() for t in ns.transport.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad or not transports or len(set(transports)) != len(transports):
        raise ValueError(f"--transport: expected distinct names among {', '.join(TRANSPORTS)}, got {ns.transport!r}")
    rounds = ns.rounds or (2 if len(transports) > 1 else 1)
    path = resolve_model(ns.model, ns.preset)
    tokenizer = get_tokenizer(path)
    prompts = text_prompts(tokenizer, ns.num_requests, ns.input_len_min, ns.input_len_max, seed=0)
    threads = ns.threads or cpu_count()
    result: dict[str, Any] = {"model": path, "concurrency": ns.concurrency, "num_requests": ns.num_requests,
                              "input_len": [ns.input_len_min, ns.input_len_max], "output_len": ns.output_len,
                              "threads": threads, "server_threads": ns.server_threads or cpu_count(),
                              "transports": transports, "order": _order(transports, rounds)}
    offline = []
    token_prompts = [tokenizer.encode(p) for p in prompts]
    if not ns.no_offline:
        offline.append(_offline(path, token_prompts, ns))
        print(f"offline engine: {offline[-1]:.1f} tok/s", flush=True)
    port = _free_port()
    grpc_port = _free_port() if "grpc" in transports else None
    url, target = f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    proc = _start_server(path, port, grpc_port, ns)
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
    try:
        for t in transports:  # warm-up, every client path once
            asyncio.run(run_load(t, url, target, prompts[:4], 8, 4))
        for t in result["order"]:
            before = _scrape(url)
            results, elapsed = asyncio.run(run_load(t, url, target, prompts, ns.output_len, ns.concurrency))
            runs[t].append(_summary(results, elapsed, _lag(before, _scrape(url))))
            print(f"{t}: {runs[t][-1]['output_tok_per_s']:.1f} tok/s, {runs[t][-1]['errors']} errors", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    result["runs"] = runs
    result["server"] = {t: _merge(rs) for t, rs in runs.items()}
    if not ns.no_offline:
        offline.append(_offline(path, token_prompts, ns))
        print(f"offline engine (again): {offline[-1]:.1f} tok/s", flush=True)
        result["offline_tok_per_s"] = offline
        result["server_vs_offline"] = {t: s["output_tok_per_s"] / statistics.mean(offline)
                                       for t, s in result["server"].items()}
    print(report(result))
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if not any(s["errors"] for s in result["server"].values()) else 1


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One transport's runs: throughput and percentiles averaged, errors summed, worst lag kept."""
    if len(runs) == 1:
        return runs[0]
    mean = statistics.mean
    out: dict[str, Any] = {k: mean(r[k] for r in runs) for k in ("elapsed_s", "req_per_s", "output_tok_per_s")}
    out.update({k: sum(r[k] for r in runs) for k in ("requests_ok", "errors")})
    out["first_error"] = next((r["first_error"] for r in runs if r["first_error"]), "")
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_s"):
        out[k] = {q: mean(r[k][q] for r in runs) for q in runs[0][k]}
    lags = [r["event_loop_lag"] for r in runs]
    out["event_loop_lag"] = {"probes": sum(x["probes"] for x in lags),
                             "mean_s": mean(x["mean_s"] for x in lags),
                             "p99_le_s": max(x["p99_le_s"] for x in lags), "max_le_s": max(x["max_le_s"] for x in lags),
                             "max_since_start_s": max(x["max_since_start_s"] for x in lags)}
    out["runs_tok_per_s"] = [r["output_tok_per_s"] for r in runs]
    return out


_NAMES = {"openai": "OpenAI /v1/completions (SSE)", "http": "seed /generate (SSE)", "grpc": "gRPC GenerateStream"}


def report(r: dict[str, Any]) -> str:
    """A markdown summary: one column per transport."""
    ts = r["transports"]
    ss = [r["server"][t] for t in ts]
    rounds = len(r["order"]) // len(ts)
    lines = [
        f"closed loop, {r['concurrency']} streaming clients, {r['num_requests']} requests of stdlib-source text, "
        f"prompts {r['input_len'][0]}–{r['input_len'][1]} tokens, {r['output_len']} tokens out (ignore_eos), "
        f"engine threads: server {r['server_threads']}, offline {r['threads']}; prefix caching off; "
        f"{rounds} run(s) per transport, order {' '.join(r['order'])}",
        "",
        "| | " + " | ".join(_NAMES[t] for t in ts) + " |",
        "|---|" + "---|" * len(ts),
    ]

    def row(name: str, cell: Any) -> None:
        lines.append(f"| {name} | " + " | ".join(cell(s) for s in ss) + " |")

    row("output throughput", lambda s: f"{s['output_tok_per_s']:.1f} tok/s ({s['req_per_s']:.2f} req/s)"
        + (f"; runs {', '.join(f'{x:.1f}' for x in s['runs_tok_per_s'])}" if "runs_tok_per_s" in s else ""))
    if len(ts) > 1:
        base = ss[0]["output_tok_per_s"]
        row(f"throughput / {ts[0]}", lambda s: f"{s['output_tok_per_s'] / base:.3f}")
    if "server_vs_offline" in r:
        off = r["offline_tok_per_s"]
        lines.append(f"| offline engine, same requests, max_num_seqs={r['concurrency']} | "
                     + " | ".join(f"{statistics.mean(off):.1f} tok/s (runs: {', '.join(f'{x:.1f}' for x in off)})"
                                  for _ in ts) + " |")
        row("**server / offline**", lambda s: "")
        lines[-1] = "| **server / offline** | " + " | ".join(f"**{r['server_vs_offline'][t]:.2f}**" for t in ts) + " |"
    row("TTFT p50 / p95 / p99", lambda s: f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p95']:.0f} / "
        f"{s['ttft_ms']['p99']:.0f} ms")
    row("ITL p50 / p95 / p99", lambda s: f"{s['itl_ms']['p50']:.1f} / {s['itl_ms']['p95']:.1f} / "
        f"{s['itl_ms']['p99']:.1f} ms")
    row("TPOT p50 / p95 / p99", lambda s: f"{s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p95']:.1f} / "
        f"{s['tpot_ms']['p99']:.1f} ms")
    row("end-to-end p50 / p95 / p99", lambda s: f"{s['e2e_s']['p50']:.2f} / {s['e2e_s']['p95']:.2f} / "
        f"{s['e2e_s']['p99']:.2f} s")
    row("errors", lambda s: f"{s['errors']} {s['first_error']}".strip())
    row("event-loop lag (10 ms timer probe)", lambda s: f"mean {1000 * s['event_loop_lag']['mean_s']:.2f} ms, "
        f"p99 ≤ {1000 * s['event_loop_lag']['p99_le_s']:.0f} ms, max ≤ {1000 * s['event_loop_lag']['max_le_s']:.0f} ms")
    return "\n".join(lines)
