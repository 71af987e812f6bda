"""500 requests over HTTP streaming (SSE), WebSocket and gRPC streaming, 30% of whose clients hang up at a random
moment (before the first token or mid-stream): afterwards no request is left running or waiting and every KV
block is back in the pool; every client that stayed got its whole answer."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import httpx
import pytest
from server_utils import ServerProcess, free_port, wait_idle
from websockets.asyncio.client import connect

from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc

N_REQUESTS = 500
HANG_UP = 0.3
MAX_TOKENS = 24
CONCURRENCY = 48


@pytest.fixture(scope="module")
def server(model_factory):
    grpc_port = free_port()
    proc = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                         "--grpc-port", str(grpc_port), "--max-waiting", "1000")
    proc.grpc_target = f"127.0.0.1:{grpc_port}"
    yield proc
    proc.stop()


def _body(i: int) -> dict:
    return {"prompt": f"def f{i}(x):\n    return x * {i}", "max_new_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}


async def _sse(http: httpx.AsyncClient, url: str, i: int, cut: int | None) -> int:
    tokens = 0
    async with http.stream("POST", url + "/generate", json={**_body(i), "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if cut is not None and tokens >= cut:
                return -1  # leaving the block closes the connection mid-stream
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += 1
    return tokens


async def _ws(url: str, i: int, cut: int | None) -> int:
    async with connect(url.replace("http", "ws") + "/ws/generate") as ws:
        await ws.send(json.dumps(_body(i)))
        tokens = 0
        while True:
            if cut is not None and tokens >= cut:
                return -1
            msg = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if "finish_reason" in msg:
                return msg["usage"]["completion_tokens"]
            tokens += 1


async def _grpc(stub: pb_grpc.InferenceServiceStub, i: int, cut: int | None) -> int:
    call = stub.GenerateStream(pb.GenerateRequest(prompt=_body(i)["prompt"], max_new_tokens=MAX_TOKENS,
                                                  temperature=0.0, ignore_eos=True), timeout=120)
    n = 0
    async for msg in call:
        if cut is not None and n >= cut:
            call.cancel()
            return -1
        n = msg.tokens_generated
    return n


def test_500_requests_30_percent_hang_up(server):
    rng = random.Random(20)
    plan = [(rng.choice(("sse", "ws", "grpc")), rng.randint(0, 6) if rng.random() < HANG_UP else None)
            for _ in range(N_REQUESTS)]

    async def run() -> list[int | BaseException]:
        sem = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http, \
                grpc.aio.insecure_channel(server.grpc_target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)

            async def one(i: int) -> int:
                kind, cut = plan[i]
                async with sem:
                    if kind == "sse":
                        return await _sse(http, server.url, i, cut)
                    if kind == "ws":
                        return await _ws(server.url, i, cut)
                    return await _grpc(stub, i, cut)

            return await asyncio.gather(*(one(i) for i in range(N_REQUESTS)), return_exceptions=True)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    hung_up = sum(1 for _, cut in plan if cut is not None)
    assert 0.25 * N_REQUESTS < hung_up < 0.35 * N_REQUESTS
    for (kind, cut), got in zip(plan, results, strict=True):
        if cut is None:
            assert got == MAX_TOKENS, (kind, got)  # whoever stayed got the whole answer
    after = wait_idle(server.url, timeout=30)
    assert after["minivllm:num_requests_running"] == 0 and after["minivllm:num_requests_waiting"] == 0
    assert after["minivllm:kv_cache_usage_perc"] == 0
    # A hang-up before the server submitted the request (a WebSocket closed right after sending) never reached
    # the engine; one after its last token finished it normally; the rest were aborted.
    completed = after['minivllm:request_success_total{finished_reason="length"}']
    aborted = after['minivllm:request_success_total{finished_reason="abort"}']
    assert completed >= N_REQUESTS - hung_up and 0 < aborted <= hung_up, (completed, aborted, hung_up)
    assert completed + aborted <= N_REQUESTS
    assert httpx.get(server.url + "/health").status_code == 200
