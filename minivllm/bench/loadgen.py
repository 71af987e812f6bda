"""The load generator behind `minivllm bench serve`: requests with given length distributions sent to a
running server over HTTP /generate, OpenAI /v1/completions or gRPC, in a closed loop (C clients) or an
open loop (Poisson arrivals at a rate).

Honest by construction: a request counts as a success only if its status is OK, the stream ended
cleanly and the server reported how many tokens it generated (its own `usage` / `tokens_generated`; the
client never assumes a count). Failures are counted by cause and kept out of every latency and
throughput figure.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

ENDPOINTS = ("openai", "http", "grpc")
ENDPOINT_NAMES = {"openai": "OpenAI /v1/completions", "http": "seed /generate", "grpc": "gRPC InferenceService"}
PERCENTILES = (50, 95, 99)
_CORPUS_MODULES = ("argparse", "asyncio.base_events", "json.decoder", "logging", "statistics", "subprocess")


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload."""

    prompt: str
    max_tokens: int


@dataclass
class RequestResult:
    """What the client saw of one request. output_tokens is the server's own count."""

    ok: bool
    output_tokens: int = 0
    ttft: float | None = None  # None when not streamed
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def text_prompts(tokenizer: Any, n: int, lo: int, hi: int, seed: int) -> list[str]:
    """n prompts of real text (the standard library's own source, present on every machine), each a
    window of lo–hi tokens (uniform); text, so every endpoint (including /generate, which takes no
    token ids) sends exactly the same requests."""
    import importlib
    import inspect

    sources = [inspect.getsource(importlib.import_module(m)) for m in _CORPUS_MODULES]
    ids = tokenizer("\n".join(sources), add_special_tokens=False, verbose=False)["input_ids"]  # no length warning
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(tokenizer.decode(ids[start:start + length]))
    return out


def make_workload(tokenizer: Any, n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0
                  ) -> list[RequestSpec]:
    """n requests: prompt lengths and output lengths each uniform in their [min, max]."""
    prompts = text_prompts(tokenizer, n, *input_len, seed=seed)
    rng = random.Random(seed + 1)
    return [RequestSpec(p, rng.randint(*output_len)) for p in prompts]


class _Timer:
    """TTFT and inter-token gaps from the arrival times of messages that carry tokens."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.ttft: float | None = None
        self.itls: list[float] = []

    def tokens_arrived(self) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.t0
        else:
            self.itls.append(now - self.last)
        self.last = now

    def result(self, output_tokens: int | None, spec: RequestSpec, ignore_eos: bool) -> RequestResult:
        e2e = time.perf_counter() - self.t0
        if output_tokens is None:
            return RequestResult(False, e2e=e2e, error="the server did not report its token count")
        if ignore_eos and output_tokens != spec.max_tokens:
            return RequestResult(False, output_tokens, e2e=e2e,
                                 error=f"{output_tokens} tokens generated, {spec.max_tokens} asked with ignore_eos")
        return RequestResult(True, output_tokens, self.ttft, e2e, self.itls)


class Client(Protocol):
    """Sends one request and reports what it saw."""

    async def one(self, spec: RequestSpec) -> RequestResult: ...

    async def aclose(self) -> None: ...


class HTTPClient:
    """/generate or /v1/completions, streamed (SSE) or not, on one aiohttp session.

    aiohttp rather than httpx: the load generator shares the server's cores when both run on one machine, and its
    CPU time is taken from the engine's step (a 2-thread GEMM split statically waits for its slower thread).
    Measured against the gpt2 server here: httpx 1.7-2.2 ms of client CPU a request (3.3-3.9 ms streamed), aiohttp
    0.15 ms (0.9 ms streamed), and the same 300 requests finished 7-17% sooner (BENCHMARKS.md, item 5)."""

    def __init__(self, base_url: str, endpoint: str, stream: bool, ignore_eos: bool, max_connections: int,
                 api_key: str | None = None) -> None:
        self.base_url, self.endpoint, self.stream, self.ignore_eos = base_url.rstrip("/"), endpoint, stream, ignore_eos
        self.max_connections = max_connections
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: Any = None  # made on the running loop by the first request (aiohttp binds it to that loop)

    def _http(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=600, sock_connect=30), headers=self.headers,
                read_bufsize=2 ** 20)  # a stream's line may be a long step's text: the reader's limit is its double
        return self._session

    def _request(self, spec: RequestSpec) -> tuple[str, dict[str, Any]]:
        common = {"prompt": spec.prompt, "temperature": 0, "ignore_eos": self.ignore_eos, "stream": self.stream}
        if self.endpoint == "openai":
            body = {**common, "max_tokens": spec.max_tokens}
            if self.stream:
                body["stream_options"] = {"include_usage": True}
            return "/v1/completions", body
        return "/generate", {**common, "max_new_tokens": spec.max_tokens}

    async def one(self, spec: RequestSpec) -> RequestResult:
        import aiohttp

        path, body = self._request(spec)
        timer = _Timer()
        try:
            async with self._http().post(self.base_url + path, json=body) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    return _failed(timer, f"HTTP {resp.status}: {_message(text)}")
                if not self.stream:
                    data = json.loads(await resp.read())
                    tokens = data.get("usage", {}).get("completion_tokens") if self.endpoint == "openai" \
                        else data.get("tokens_generated")
                    return timer.result(tokens, spec, self.ignore_eos)
                tokens, done = await self._read_stream(resp.content, timer)
            if not done:
                return _failed(timer, "the stream ended without [DONE]")
            return timer.result(tokens, spec, self.ignore_eos)
        except _StreamError as e:
            return _failed(timer, str(e))
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:  # ValueError: bad JSON, an endless line
            return _failed(timer, f"{type(e).__name__}: {e}")

    async def _read_stream(self, content: Any, timer: _Timer) -> tuple[int | None, bool]:
        tokens: int | None = None
        async for raw in content:  # one SSE line at a time, its newline kept
            if not raw.startswith(b"data: "):
                continue
            line = raw.rstrip(b"\r\n")
            if line == b"data: [DONE]":
                return tokens, True
            event = json.loads(line[6:])
            if "error" in event:
                raise _StreamError(f"error event: {event['error'].get('message', event['error'])}")
            if self.endpoint == "openai":
                if event.get("choices"):  # every chunk is one engine step's tokens, text or not
                    timer.tokens_arrived()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            else:  # /generate: an event per step with new tokens, each with the running count
                if event["tokens_generated"] > (tokens or 0):
                    timer.tokens_arrived()
                tokens = event["tokens_generated"]
        return tokens, False

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class GRPCClient:
    """InferenceService on one grpc.aio channel (HTTP/2 multiplexes the calls): Generate or GenerateStream."""

    def __init__(self, target: str, stream: bool, ignore_eos: bool) -> None:
        import grpc

        from minivllm.entrypoints.proto import inference_pb2, inference_pb2_grpc

        self.grpc, self.pb, self.stream, self.ignore_eos = grpc, inference_pb2, stream, ignore_eos
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    async def one(self, spec: RequestSpec) -> RequestResult:
        req = self.pb.GenerateRequest(prompt=spec.prompt, max_new_tokens=spec.max_tokens, temperature=0,
                                      ignore_eos=self.ignore_eos)
        timer = _Timer()
        try:
            if not self.stream:
                out = await self.stub.Generate(req, timeout=600)
                return timer.result(out.usage.completion_tokens if out.HasField("usage") else None, spec,
                                    self.ignore_eos)
            tokens = None
            async for msg in self.stub.GenerateStream(req, timeout=600):
                if msg.token_ids:
                    timer.tokens_arrived()
                if msg.finish_reason:
                    tokens = msg.usage.completion_tokens if msg.HasField("usage") else None
            return timer.result(tokens, spec, self.ignore_eos)
        except self.grpc.aio.AioRpcError as e:
            return _failed(timer, f"gRPC {e.code().name}: {e.details()}")

    async def aclose(self) -> None:
        await self.channel.close()


class _StreamError(Exception):
    pass


def _failed(timer: _Timer, error: str) -> RequestResult:
    return RequestResult(False, e2e=time.perf_counter() - timer.t0, error=error)


def _message(text: str) -> str:
    """The message of an error body in OpenAI's shape, else the start of the body."""
    try:
        return json.loads(text)["error"]["message"][:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]


def make_client(endpoint: str, base_url: str, grpc_target: str | None, stream: bool, ignore_eos: bool,
                max_connections: int, api_key: str | None = None) -> Client:
    """A client for one of ENDPOINTS."""
    if endpoint == "grpc":
        if not grpc_target:
            raise ValueError("grpc: give the server's gRPC address (--grpc-target host:port)")
        return GRPCClient(grpc_target, stream, ignore_eos)
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint: expected one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    return HTTPClient(base_url, endpoint, stream, ignore_eos, max_connections, api_key)


async def run_closed(client: Client, requests: Sequence[RequestSpec], concurrency: int, progress: Any = None
                     ) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` clients, each sending its next request when its last one ends."""
    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    results: list[RequestResult] = []

    async def worker() -> None:
        while not queue.empty():
            results.append(await client.one(queue.get_nowait()))
            if progress is not None:
                progress.update(1)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


async def run_open(client: Client, requests: Sequence[RequestSpec], rate: float, seed: int = 0,
                   progress: Any = None) -> tuple[list[RequestResult], float]:
    """Open loop: requests arrive as a Poisson process at `rate` per second, whatever the server's pace."""
    rng = random.Random(seed)
    results: list[RequestResult] = []

    async def send(spec: RequestSpec) -> None:
        results.append(await client.one(spec))
        if progress is not None:
            progress.update(1)

    t0 = time.perf_counter()
    tasks, due = [], t0
    for spec in requests:
        due += rng.expovariate(rate)
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.ensure_future(send(spec)))
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile, linearly interpolated (numpy's default); 0 for no data."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _dist(xs: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    out = {f"p{q}": scale * percentile(xs, q) for q in PERCENTILES}
    out["mean"] = scale * sum(xs) / len(xs) if xs else 0.0
    return out


def summarize(results: Sequence[RequestResult], elapsed: float) -> dict[str, Any]:
    """Counts, failures by cause, and the figures of the successful requests only."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    causes = Counter(_cause(r.error) for r in failed)
    tokens = sum(r.output_tokens for r in ok)
    streamed = [(r, r.ttft) for r in ok if r.ttft is not None]
    # Time per output token after the first: independent of how a transport groups tokens into messages.
    tpots = [(r.e2e - ttft) / (r.output_tokens - 1) for r, ttft in streamed if r.output_tokens > 1]
    return {
        "requests": len(results), "successes": len(ok), "failures": len(failed),
        "failure_causes": dict(causes.most_common()), "first_failure": failed[0].error if failed else "",
        "elapsed_s": elapsed, "req_per_s": len(ok) / elapsed if elapsed else 0.0,
        "output_tokens": tokens, "output_tok_per_s": tokens / elapsed if elapsed else 0.0,
        "ttft_ms": _dist([ttft for _, ttft in streamed], 1000), "tpot_ms": _dist(tpots, 1000),
        "itl_ms": _dist([x for r, _ in streamed for x in r.itls], 1000), "e2e_ms": _dist([r.e2e for r in ok], 1000),
    }


def _cause(error: str) -> str:
    """A failure's kind (its status, or the first words of its message) for the failure table."""
    head = error.split(":", 1)[0]
    return head if len(head) <= 40 else head[:40] + "…"


async def run_load(client: Client, requests: Sequence[RequestSpec], concurrency: int | None = None,
                   rate: float | None = None, seed: int = 0, desc: str | None = None) -> dict[str, Any]:
    """Run the workload closed-loop (concurrency) or open-loop (rate) with a progress bar; its summary."""
    from tqdm.auto import tqdm

    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency (closed loop) and rate (open loop)")
    with tqdm(total=len(requests), desc=desc, unit="req", disable=desc is None, leave=False) as progress:
        if rate is not None:
            results, elapsed = await run_open(client, requests, rate, seed, progress)
        else:
            assert concurrency is not None  # exactly one of the two is given (checked above)
            results, elapsed = await run_closed(client, requests, concurrency, progress)
    return summarize(results, elapsed)
