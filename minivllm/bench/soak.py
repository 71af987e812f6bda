"""`minivllm bench soak --minutes M`: a real server under a constant open-loop load for M minutes.

Poisson arrivals over every endpoint in turn (the seed's /generate streamed and whole, /batch_generate, the
OpenAI completions and chat routes streamed and whole, WS /ws/generate, gRPC Generate and GenerateStream), with
a fraction of clients hanging up at a random moment (mid-stream, or before a whole answer comes). Sampled every
few seconds: the server's RSS (psutil), KV usage, requests running and waiting. At the end (after the load
stops and the server drains): KV blocks still in use (leaks), requests still running, errors by cause (a
hang-up we caused is not an error), and end-to-end latency p50/p99 per minute of the requests that completed.
Pass: RSS growth after warm-up < 5%, 0 leaked blocks, 0 unexplained errors, per-minute p99 within 20% of
the median minute's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import grpc
import httpx
import psutil

from minivllm.bench.loadgen import percentile, text_prompts
from minivllm.bench.results import save
from minivllm.utils import free_port

KINDS = ("generate", "generate-stream", "batch", "completions", "completions-stream", "chat", "chat-stream",
         "ws", "grpc", "grpc-stream")
HUNG_UP = "hung up (on purpose)"
RUNNING, WAITING = "minivllm:num_requests_running", "minivllm:num_requests_waiting"


def add_soak_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench soak`."""
    p.add_argument("--model", default=None, help="model directory to serve (default: the embedded model)")
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load")
    p.add_argument("--warmup-minutes", type=float, default=1.0, help="RSS growth is measured from the end of this")
    p.add_argument("--request-rate", type=float, default=4.0,
                   help="Poisson arrivals per second (the default keeps the embedded model's server about half busy "
                        "here: a soak looks for drift, not for the saturation point)")
    p.add_argument("--hang-up", type=float, default=0.2, help="fraction of clients that hang up at a random moment")
    p.add_argument("--input-len", default="16-128", help="prompt tokens MIN-MAX")
    p.add_argument("--output-len", default="8-64", help="output tokens MIN-MAX")
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="the server's KV pool (known, to count leaks)")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS / KV samples")
    p.add_argument("--server-arg", action="append", default=[], help="extra `minivllm serve` flag (repeatable)")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG next to it)")


def _span(spec: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in spec.split("-"))
    return lo, hi


class Soak:
    """The load against one server: one task per request, outcomes and samples recorded."""

    def __init__(self, url: str, grpc_target: str, model_name: str, ns: argparse.Namespace) -> None:
        from minivllm.entrypoints.proto import inference_pb2 as pb
        from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc

        self.pb, self.pb_grpc = pb, pb_grpc
        self.url, self.grpc_target, self.model_name, self.ns = url, grpc_target, model_name, ns
        self.results: list[dict[str, Any]] = []
        self.rng = random.Random(0)

    async def request(self, http: httpx.AsyncClient, stub: Any, kind: str, prompt: str, max_tokens: int,
                      t_start: float) -> None:
        """One request; hang up after `cut` streamed messages, or after a random wait for a whole answer."""
        hang = self.rng.random() < self.ns.hang_up
        cut, wait = self.rng.randint(0, 4), self.rng.uniform(0.02, 0.5)
        outcome = "ok"
        try:
            if hang and not kind.endswith("stream") and kind != "ws":
                await asyncio.wait_for(self._call(http, stub, kind, prompt, max_tokens, None), wait)
            else:
                await self._call(http, stub, kind, prompt, max_tokens, cut if hang else None)
        except (TimeoutError, _HungUp):
            outcome = HUNG_UP if hang else "timeout"
        except Exception as e:  # noqa: BLE001 - recorded by cause
            outcome = f"{type(e).__name__}: {str(e)[:120]}"
        self.results.append({"kind": kind, "t": t_start, "latency": time.monotonic() - t_start, "outcome": outcome,
                             "tokens": max_tokens})

    async def _call(self, http: httpx.AsyncClient, stub: Any, kind: str, prompt: str, n: int, cut: int | None
                    ) -> None:
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0.8, "ignore_eos": True}
        if kind in ("generate", "batch", "completions", "chat"):
            route, payload = {
                "generate": ("/generate", body),
                "batch": ("/batch_generate", {**body, "prompts": [prompt, prompt[::-1] or "x"], "prompt": None}),
                "completions": ("/v1/completions", {**body, "model": self.model_name}),
                "chat": ("/v1/chat/completions", {"model": self.model_name, "max_tokens": n, "temperature": 0.8,
                                                  "ignore_eos": True,
                                                  "messages": [{"role": "user", "content": prompt}]}),
            }[kind]
            payload = {k: v for k, v in payload.items() if v is not None}
            r = await http.post(self.url + route, json=payload)
            _check(r.status_code, r.text)
        elif kind in ("generate-stream", "completions-stream", "chat-stream"):
            route = {"generate-stream": "/generate", "completions-stream": "/v1/completions",
                     "chat-stream": "/v1/chat/completions"}[kind]
            payload = {**body, "stream": True}
            if kind == "completions-stream":
                payload["model"] = self.model_name
            elif kind == "chat-stream":
                payload = {"model": self.model_name, "max_tokens": n, "stream": True, "ignore_eos": True,
                           "messages": [{"role": "user", "content": prompt}]}
            async with http.stream("POST", self.url + route, json=payload) as r:
                _check(r.status_code, (await r.aread()).decode() if r.status_code != 200 else "")
                events = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line != "data: [DONE]" and "error" in (event := json.loads(line[6:])):
                        raise RuntimeError(f"stream error: {event['error'].get('message', '')[:160]}")
                    events += 1
                    if cut is not None and events > cut:
                        raise _HungUp()
        elif kind == "ws":
            from websockets.asyncio.client import connect

            async with connect(self.url.replace("http", "ws") + "/ws/generate") as ws:
                await ws.send(json.dumps({"prompt": prompt, "max_new_tokens": n, "temperature": 0.8,
                                          "ignore_eos": True}))
                msgs = 0
                while True:
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 300))
                    if "error" in msg:
                        raise RuntimeError(f"ws error: {msg['error']['message'][:160]}")
                    if "finish_reason" in msg:
                        return
                    msgs += 1
                    if cut is not None and msgs > cut:
                        raise _HungUp()
        else:
            req = self.pb.GenerateRequest(prompt=prompt, max_new_tokens=n, temperature=0.8, ignore_eos=True)
            if kind == "grpc":
                await stub.Generate(req, timeout=300)
                return
            call = stub.GenerateStream(req, timeout=300)
            msgs = 0
            async for _ in call:
                msgs += 1
                if cut is not None and msgs > cut:
                    call.cancel()
                    raise _HungUp()

    async def run(self, proc: psutil.Process) -> list[dict[str, Any]]:
        """Arrivals for ns.minutes, sampling the server meanwhile; returns the samples."""
        ns = self.ns
        samples: list[dict[str, Any]] = []
        tok = _tokenizer(ns.model)
        prompts = text_prompts(tok, 256, *_span(ns.input_len), seed=0)
        out_lo, out_hi = _span(ns.output_len)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http, \
                grpc.aio.insecure_channel(self.grpc_target) as channel:
            stub = self.pb_grpc.InferenceServiceStub(channel)
            t0 = time.monotonic()
            sampler = asyncio.ensure_future(self._sample(http, proc, t0, samples))
            tasks: set[asyncio.Task[None]] = set()
            arrivals = random.Random(1)
            i, next_at = 0, t0
            while (now := time.monotonic()) - t0 < 60 * ns.minutes:
                if now < next_at:
                    await asyncio.sleep(next_at - now)
                    continue
                kind = KINDS[i % len(KINDS)]
                task = asyncio.ensure_future(self.request(http, stub, kind, prompts[i % len(prompts)],
                                                          arrivals.randint(out_lo, out_hi), time.monotonic()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                next_at += arrivals.expovariate(ns.request_rate)
            await asyncio.gather(*tasks, return_exceptions=True)
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            for r in self.results:
                r["t"] -= t0
        return samples

    async def _sample(self, http: httpx.AsyncClient, proc: psutil.Process, t0: float, out: list[dict[str, Any]]
                      ) -> None:
        while True:
            m = await _metrics(http, self.url)
            out.append({"t": time.monotonic() - t0, "rss_mib": proc.memory_info().rss / 2**20,
                        "kv_usage": m.get("minivllm:kv_cache_usage_perc", 0.0),
                        "running": m.get("minivllm:num_requests_running", 0.0),
                        "waiting": m.get("minivllm:num_requests_waiting", 0.0)})
            await asyncio.sleep(self.ns.sample_every)


class _HungUp(Exception):
    """The client hangs up on purpose."""


def _check(status: int, text: str) -> None:
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {text[:160]}")


def _tokenizer(model: str) -> Any:
    from minivllm.engine.tokenizer import get_tokenizer

    return get_tokenizer(model)


async def _metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get(url + "/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels
            or set(s.labels) == {"model_name"}}


def _summarize(results: list[dict[str, Any]], samples: list[dict[str, Any]], final: dict[str, float],
               ns: argparse.Namespace) -> dict[str, Any]:
    causes = Counter(r["outcome"] for r in results if r["outcome"] != "ok")
    hung = causes.pop(HUNG_UP, 0)
    minutes: list[dict[str, Any]] = []
    for m in range(int(ns.minutes + 0.999)):
        lat = [r["latency"] for r in results if r["outcome"] == "ok" and m * 60 <= r["t"] < (m + 1) * 60]
        if lat:
            minutes.append({"minute": m + 1, "requests": len(lat), "p50_s": percentile(lat, 50),
                            "p99_s": percentile(lat, 99)})
    warm = [s for s in samples if s["t"] >= 60 * ns.warmup_minutes]
    rss0 = warm[0]["rss_mib"] if warm else samples[0]["rss_mib"]
    rss1 = statistics.median(s["rss_mib"] for s in samples[-3:])
    steady = [m["p99_s"] for m in minutes if m["minute"] > ns.warmup_minutes]
    med = statistics.median(steady) if steady else 0.0
    spread = max((abs(x - med) / med for x in steady), default=0.0) if med else 0.0
    # A minute's p99 is its ~2nd-slowest request: sampling noise alone moves it by tens of percent. Drift (what a
    # leak or a growing cache would cause) shows in the p99 of each half of the steady part (~1,000 requests
    # each), and in the p99 per output token (outputs are 8-64 tokens: the slowest requests are the longest).
    done = sorted((r for r in results if r["outcome"] == "ok" and r["t"] >= 60 * ns.warmup_minutes),
                  key=lambda r: r["t"])
    halves = [done[:len(done) // 2], done[len(done) // 2:]]
    halves_p99 = [percentile([r["latency"] for r in h], 99) if h else 0.0 for h in halves]
    per_token = [[1000 * r["latency"] / r["tokens"] for r in h] for h in halves]
    halves_tok = [percentile(x, 99) if x else 0.0 for x in per_token]
    leaked = round(final["minivllm:kv_cache_usage_perc"] * ns.num_kv_blocks)
    return {"requests": len(results), "completed": sum(r["outcome"] == "ok" for r in results), "hung_up": hung,
            "errors": dict(causes), "rss_warm_mib": rss0, "rss_end_mib": rss1,
            "rss_growth": (rss1 - rss0) / rss0, "rss_max_mib": max(s["rss_mib"] for s in samples),
            "leaked_blocks": leaked, "left_running": final[RUNNING], "left_waiting": final[WAITING],
            "minutes": minutes, "p99_median_s": med, "p99_max_deviation": spread,
            "halves_p99_s": halves_p99, "halves_p99_ms_per_token": halves_tok,
            "halves_change": halves_p99[1] / halves_p99[0] - 1 if halves_p99[0] else 0.0,
            "halves_change_per_token": halves_tok[1] / halves_tok[0] - 1 if halves_tok[0] else 0.0}


def run_soak(ns: argparse.Namespace) -> int:
    """Start the server, run the load, drain, report."""
    from minivllm.default_model import default_model_path

    ns.model = ns.model or default_model_path()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "minivllm", "serve", ns.model, "--port", str(port), "--grpc-port", str(grpc_port),
           "--num-kv-blocks", str(ns.num_kv_blocks), "--log-level", "warning", *ns.server_arg]
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None or time.time() > deadline:
                log.seek(0)
                raise RuntimeError(f"server did not start: {log.read().decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        soak = Soak(url, f"127.0.0.1:{grpc_port}", name, ns)
        samples = asyncio.run(soak.run(psutil.Process(server.pid)))
        deadline = time.time() + 60
        while True:  # drain: whatever is still running finishes or is aborted
            final = asyncio.run(_final(url))
            if final[RUNNING] == final[WAITING] == 0 or time.time() > deadline:
                break
            time.sleep(0.5)
        alive = httpx.get(url + "/health").status_code == 200
    finally:
        server.terminate()
        server.wait(30)
        log.seek(0)
        server_log = log.read().decode(errors="replace")
        log.close()
    summary = _summarize(soak.results, samples, final, ns)
    summary["healthy_after"] = alive
    summary["server_log_errors"] = [ln for ln in server_log.splitlines() if "ERROR" in ln][:20]
    result = {"bench": "soak", "model": ns.model, "minutes": ns.minutes, "request_rate": ns.request_rate,
              "hang_up": ns.hang_up, "input_len": ns.input_len, "output_len": ns.output_len,
              "num_kv_blocks": ns.num_kv_blocks, "command": ["soak", *sys.argv[3:]], "summary": summary,
              "samples": samples, "requests": soak.results}
    print(report(result))
    save(result, ns.out, plot)
    return 0


async def _final(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as http:
        return await _metrics(http, url)


def report(r: dict[str, Any]) -> str:
    """Markdown: the pass criteria with their figures, and latency per minute."""
    s = r["summary"]
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    lines = [
        f"{r['minutes']:g} minutes at {r['request_rate']:g} req/s (Poisson) over {len(KINDS)} request kinds, "
        f"{100 * r['hang_up']:.0f}% of clients hanging up at a random moment; prompts {r['input_len']} tokens, "
        f"outputs {r['output_len']}.", "",
        "| criterion | target | measured |", "|---|---|---|",
        f"| RSS growth after warm-up | < 5% | {100 * s['rss_growth']:+.2f}% ({s['rss_warm_mib']:.0f} → "
        f"{s['rss_end_mib']:.0f} MiB; peak {s['rss_max_mib']:.0f}) |",
        f"| KV blocks leaked (after the drain) | 0 | {s['leaked_blocks']} (running {s['left_running']:g}, "
        f"waiting {s['left_waiting']:g}) |",
        f"| unexplained errors | 0 | {sum(s['errors'].values())} ({errors}) |",
        f"| per-minute p99 latency vs the median minute | within 20% | max deviation "
        f"{100 * s['p99_max_deviation']:.1f}% (median p99 {s['p99_median_s']:.2f} s) |",
        *([f"| p99 latency, second half of the steady part vs the first | within 20% | "
           f"{100 * s['halves_change']:+.1f}% ({s['halves_p99_s'][0]:.3f} → {s['halves_p99_s'][1]:.3f} s); per "
           f"output token {100 * s['halves_change_per_token']:+.1f}% ({s['halves_p99_ms_per_token'][0]:.1f} → "
           f"{s['halves_p99_ms_per_token'][1]:.1f} ms) |"] if "halves_change" in s else []), "",
        f"{s['requests']} requests: {s['completed']} completed, {s['hung_up']} hung up on purpose; /health after: "
        f"{'ok' if s['healthy_after'] else 'NOT ok'}.", "",
        "| minute | completed | p50 (s) | p99 (s) |", "|---|---|---|---|",
    ]
    lines += [f"| {m['minute']} | {m['requests']} | {m['p50_s']:.3f} | {m['p99_s']:.3f} |" for m in s["minutes"]]
    return "\n".join(lines)


def plot(r: dict[str, Any], png: str) -> None:
    """RSS and KV usage over time; p50/p99 per minute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [s["t"] / 60 for s in r["samples"]]
    a.plot(t, [s["rss_mib"] for s in r["samples"]], label="server RSS (MiB)")
    a.set_ylabel("RSS (MiB)")
    a2 = a.twinx()
    a2.plot(t, [100 * s["kv_usage"] for s in r["samples"]], color="tab:orange", alpha=0.5, label="KV usage %")
    a2.set_ylabel("KV usage %")
    a.set_title(f"soak: {r['minutes']:g} min at {r['request_rate']:g} req/s")
    mins = r["summary"]["minutes"]
    b.plot([m["minute"] - 0.5 for m in mins], [m["p50_s"] for m in mins], "o-", label="p50")
    b.plot([m["minute"] - 0.5 for m in mins], [m["p99_s"] for m in mins], "o-", label="p99")
    b.set_xlabel("minute")
    b.set_ylabel("end-to-end latency (s)")
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
