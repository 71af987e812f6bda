"""The gRPC service (SPEC §5) on the real server (`minivllm serve --grpc-port`, one process, one engine
shared with HTTP), driven by a real grpc.aio client: the same greedy text as HTTP /generate, one engine
batch for BatchGenerate, cancellation and deadlines freeing KV blocks, INVALID_ARGUMENT for bad input,
RESOURCE_EXHAUSTED past the waiting queue, grpc.health.v1 and Health following the engine loop, and
server reflection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
from conftest import PROMPTS
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_utils import ServerProcess, free_port, in_process_server, metrics, wait_idle

from minivllm import EngineArgs
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.entrypoints.api_server import build_app
from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc
from minivllm.entrypoints.server_args import ServerArgs

MAX_NEW = 12
SERVICE = "minivllm.v1.InferenceService"
ABORTS = 'minivllm:request_success_total{finished_reason="abort"}'


class Server:
    """A real `minivllm serve` with HTTP on .url and gRPC on .target."""

    def __init__(self, proc: ServerProcess, grpc_port: int) -> None:
        self.url, self.target = proc.url, f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def server(model_factory):
    port = free_port()
    proc = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--grpc-port", str(port))
    yield Server(proc, port)
    proc.stop()


def small_engine(model_factory, **kw: Any) -> AsyncLLMEngine:
    """An engine for an in-process server; its KV pool is small, as it lives in pytest's memory."""
    args = EngineArgs(model=model_factory("tiny-llama"), num_threads=1, kv_cache_memory="64MiB", **kw)
    return AsyncLLMEngine.from_engine_args(args, stat_loggers=[])


def run(target: str, body: Callable[[pb_grpc.InferenceServiceStub, grpc.aio.Channel], Awaitable[Any]]) -> Any:
    """Run body(stub, channel) on a fresh grpc.aio channel."""
    async def main() -> Any:
        async with grpc.aio.insecure_channel(target) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            return await body(pb_grpc.InferenceServiceStub(channel), channel)

    return asyncio.run(main())


def greedy(prompt: str, max_new: int = MAX_NEW, **kw: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new, temperature=0, ignore_eos=True, **kw)


def test_generate_and_stream_equal_http_generate(server):
    http = {p: httpx.post(server.url + "/generate", json={"prompt": p, "max_new_tokens": MAX_NEW, "temperature": 0,
                                                          "ignore_eos": True}, timeout=60).json() for p in PROMPTS}

    async def body(stub, _):
        unary = await asyncio.gather(*(stub.Generate(greedy(p)) for p in PROMPTS))
        streams = []
        for p in PROMPTS:
            streams.append([m async for m in stub.GenerateStream(greedy(p))])
        return unary, streams

    unary, streams = run(server.target, body)
    for p, u, msgs in zip(PROMPTS, unary, streams, strict=True):
        assert u.generated_text == http[p]["generated_text"]
        assert u.tokens_generated == http[p]["tokens_generated"] == MAX_NEW == len(u.token_ids)
        assert u.finish_reason == "length" and u.latency_ms > 0
        assert u.usage.completion_tokens == MAX_NEW and u.usage.total_tokens == u.usage.prompt_tokens + MAX_NEW
        # The stream: token deltas that add up to the same text and ids; only the last one is final.
        assert "".join(m.text for m in msgs) == u.generated_text
        assert [t for m in msgs for t in m.token_ids] == list(u.token_ids)
        assert [m.tokens_generated for m in msgs] == sorted(m.tokens_generated for m in msgs)
        assert all(not m.finish_reason and not m.HasField("usage") for m in msgs[:-1])
        last = msgs[-1]
        assert last.finish_reason == "length" and last.tokens_generated == MAX_NEW
        assert last.usage == u.usage and last.latency_ms > 0


def test_generate_logprobs_and_token_prompts(server, model_factory):
    from minivllm.engine.tokenizer import get_tokenizer

    ids = get_tokenizer(model_factory("tiny-llama")).encode(PROMPTS[0])

    async def body(stub, _):
        by_text = await stub.Generate(greedy(PROMPTS[0], 4, logprobs=3))
        by_ids = await stub.Generate(pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=4, temperature=0,
                                                        ignore_eos=True))
        return by_text, by_ids

    out, by_ids = run(server.target, body)
    assert len(out.logprobs) == 4
    for tid, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tid and lp.rank == 1  # greedy: the chosen token is the most likely
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token_id == tid
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob >= lp.top_logprobs[2].logprob
    # The same prompt as token ids gives the same continuation.
    assert list(by_ids.token_ids) == list(out.token_ids) and by_ids.usage.prompt_tokens == len(ids)


def test_batch_generate_runs_as_one_batch(server):
    prompts = PROMPTS[:6]
    before = metrics(server.url)

    async def body(stub, _):
        return await stub.BatchGenerate(pb.BatchGenerateRequest(prompts=prompts, max_new_tokens=MAX_NEW,
                                                                temperature=0, ignore_eos=True))

    out = run(server.target, body)
    after = metrics(server.url)
    assert len(out.generated_texts) == len(out.results) == 6
    assert list(out.tokens_generated) == [MAX_NEW] * 6 and list(out.finish_reasons) == ["length"] * 6
    assert out.usage.completion_tokens == 6 * MAX_NEW
    assert out.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in out.results)
    solo = run(server.target, lambda stub, _: asyncio.gather(*(stub.Generate(greedy(p)) for p in prompts)))
    assert list(out.generated_texts) == [s.generated_text for s in solo]
    # One batch: one step prefills all six prompts, then MAX_NEW - 1 steps decode them together.
    steps = after["minivllm:iteration_tokens_total_count"] - before["minivllm:iteration_tokens_total_count"]
    tokens = after["minivllm:iteration_tokens_total_sum"] - before["minivllm:iteration_tokens_total_sum"]
    assert steps == MAX_NEW
    cached = after["minivllm:prefix_cache_hits_total"] - before["minivllm:prefix_cache_hits_total"]
    assert tokens == out.usage.prompt_tokens - cached + 6 * (MAX_NEW - 1)  # earlier tests cached some prompts
    ok = f'inference_requests_total{{endpoint="/{SERVICE}/BatchGenerate",status="success"}}'
    assert after[ok] - before.get(ok, 0) == 1


def test_cancelling_10_of_30_streams(server):
    max_new = 40
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(30)]
    before = metrics(server.url)

    async def body(stub, _):
        solo = {p: (await stub.Generate(greedy(p, max_new))).generated_text for p in set(prompts)}

        async def consume(i: int) -> str | None:
            # The ones to cancel ask for 900 tokens: they cannot finish on their own before the cancel lands.
            call = stub.GenerateStream(greedy(prompts[i], 900 if i % 3 == 0 else max_new))
            text, seen = [], 0
            async for m in call:
                text.append(m.text)
                seen += 1
                if i % 3 == 0 and seen == 3:  # 10 of the 30 hang up mid-way
                    call.cancel()
                    return None
            return "".join(text)

        results = await asyncio.gather(*(consume(i) for i in range(30)))
        return solo, results

    solo, results = run(server.target, body)
    assert sum(r is None for r in results) == 10
    for p, r in zip(prompts, results, strict=True):
        if r is not None:
            assert r == solo[p]
    after = wait_idle(server.url)
    assert after["minivllm:kv_cache_usage_perc"] == 0
    assert after["minivllm:num_requests_running"] == 0 and after["minivllm:num_requests_waiting"] == 0
    assert after[ABORTS] - before[ABORTS] == 10
    health = run(server.target, lambda stub, _: stub.Health(pb.HealthRequest()))
    assert health.status == pb.SERVING and health.kv_cache_usage == 0 and health.num_requests_running == 0


def test_deadline_exceeded_aborts_the_request(model_factory):
    """In process, with every engine step slowed to 5 ms, so 1000 tokens surely outlast a 0.5 s deadline."""
    engine = small_engine(model_factory)
    real = engine.engine.runner.execute

    def slow_execute(seqs):
        time.sleep(0.005)
        return real(seqs)

    engine.engine.runner.execute = slow_execute
    port = free_port()
    with in_process_server(build_app(engine, ServerArgs(grpc_port=port))) as url:
        async def body(stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(greedy("count", 1000), timeout=0.5)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.GenerateStream(greedy("count", 1000), timeout=0.5):
                    pass
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

        run(f"127.0.0.1:{port}", body)
        # (the abort's count may land a moment after the scheduler has let the request go: once failed in a loaded
        # suite with the server idle and 1 abort counted)
        deadline = time.time() + 20
        while metrics(url)[ABORTS] < 2 and time.time() < deadline:
            time.sleep(0.05)
        after = wait_idle(url)  # aborted: had they run to the end (≥ 5 s), they would finish by "length"
    assert after["minivllm:kv_cache_usage_perc"] == 0
    assert after[ABORTS] == 2 and after['minivllm:request_success_total{finished_reason="length"}'] == 0


BAD = [
    (pb.GenerateRequest(prompt=""), "prompt"),
    (pb.GenerateRequest(prompt="x", temperature=-1), "temperature"),
    (pb.GenerateRequest(prompt="x", top_p=1.5), "top_p"),
    (pb.GenerateRequest(prompt="x", max_new_tokens=-5), "max_new_tokens"),
    (pb.GenerateRequest(prompt="x", max_new_tokens=100_000), "max_model_len"),
    (pb.GenerateRequest(prompt="word " * 2000, max_new_tokens=4), "max_model_len"),
    (pb.GenerateRequest(prompt="x", logprobs=1000), "logprobs"),
    (pb.GenerateRequest(prompt="x", repetition_penalty=0), "repetition_penalty"),
    (pb.GenerateRequest(prompt_token_ids=[5, 1_000_000], max_new_tokens=4), "position 1 holds 1000000"),
    (pb.GenerateRequest(prompt="x", prompt_token_ids=[5, 6]), "not both"),
    (pb.GenerateRequest(prompt="x", stop_token_ids=[-3]), "stop_token_ids"),
    (pb.BatchGenerateRequest(), "prompts"),
    (pb.BatchGenerateRequest(prompts=["ok", ""], max_new_tokens=2), "prompt"),
]


@pytest.mark.parametrize("request_msg,needle", BAD, ids=[f"{type(r).__name__}-{n}-{i}" for i, (r, n) in
                                                          enumerate(BAD)])
def test_bad_input_gets_invalid_argument(server, request_msg, needle):
    async def body(stub, _):
        calls = ([stub.BatchGenerate] if isinstance(request_msg, pb.BatchGenerateRequest)
                 else [stub.Generate, lambda r: _drain(stub.GenerateStream(r))])
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(request_msg)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert needle in e.value.details(), e.value.details()
        # The server keeps serving.
        ok = await stub.Generate(greedy("def f(x):", 3))
        assert ok.tokens_generated == 3
        assert (await stub.Health(pb.HealthRequest())).status == pb.SERVING

    run(server.target, body)


async def _drain(call: Any) -> list[Any]:
    return [m async for m in call]


def test_reflection_lists_the_services(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        from google.protobuf.descriptor_pool import DescriptorPool

        methods = {m.name for m in DescriptorPool(db).FindServiceByName(SERVICE).methods}
        assert methods == {"Generate", "BatchGenerate", "GenerateStream", "Health", "Tokenize", "Embed"}


def test_grpc_and_http_share_one_engine(server):
    """A request in flight over gRPC shows in HTTP's /metrics gauges: there is one engine."""
    before = metrics(server.url)

    async def body(stub, _):
        call = stub.GenerateStream(greedy("count", 1000))
        async for _ in call:
            break
        running = metrics(server.url)["minivllm:num_requests_running"]
        health = await stub.Health(pb.HealthRequest())
        call.cancel()
        return running, health

    running, health = run(server.target, body)
    assert running == 1 and health.num_requests_running == 1 and health.kv_cache_usage > 0
    after = wait_idle(server.url)
    assert after["minivllm:kv_cache_usage_perc"] == 0 and after[ABORTS] - before[ABORTS] == 1
    cancelled = f'inference_requests_total{{endpoint="/{SERVICE}/GenerateStream",status="aborted"}}'
    assert after[cancelled] - before[cancelled] == 1


def test_grpc_endpoints_are_in_the_metrics():
    from minivllm.entrypoints import grpc_server
    from minivllm.entrypoints import metrics as metrics_module

    assert grpc_server.ENDPOINTS == metrics_module.GRPC_ENDPOINTS


def test_api_key_and_message_size_in_process(model_factory):
    """--api-key guards the generation calls (health and reflection stay open); --max-body-size bounds
    a gRPC message as it bounds an HTTP body."""
    engine = small_engine(model_factory)
    port = free_port()
    app = build_app(engine, ServerArgs(grpc_port=port, api_key="sk-1", max_body_size="64KiB"))
    with in_process_server(app):
        async def body(stub, channel):
            good = (("authorization", "Bearer sk-1"),)
            for bad in ((), (("authorization", "Bearer nope"),)):
                for call in (lambda m: stub.Generate(greedy("x", 2), metadata=m),
                             lambda m: _drain(stub.GenerateStream(greedy("x", 2), metadata=m)),
                             lambda m: stub.BatchGenerate(pb.BatchGenerateRequest(prompts=["x"]), metadata=m)):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call(bad)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
            assert (await stub.Generate(greedy("x", 2), metadata=good)).tokens_generated == 2
            assert len(await _drain(stub.GenerateStream(greedy("x", 2), metadata=good))) == 2
            assert (await stub.Health(pb.HealthRequest())).status == pb.SERVING  # open, as HTTP /health
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert (await check).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(greedy("word " * 20_000, 2), metadata=good)  # ~100 KB > 64 KiB
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        run(f"127.0.0.1:{port}", body)


def test_overload_and_dead_loop_in_process(model_factory):
    """RESOURCE_EXHAUSTED past --max-waiting; then the engine loop dies: grpc.health.v1 (Check and Watch)
    and Health say NOT_SERVING, and calls get UNAVAILABLE."""
    engine = small_engine(model_factory, max_num_seqs=1, max_waiting=2)
    port = free_port()
    with in_process_server(build_app(engine, ServerArgs(grpc_port=port))) as url:
        target = f"127.0.0.1:{port}"

        async def overload(stub, channel):
            first = stub.Generate(greedy("count", 1000))
            while metrics(url)["minivllm:num_requests_running"] < 1:
                await asyncio.sleep(0.02)
            rest = [stub.Generate(greedy("count", 1000)) for _ in range(6)]
            codes = []
            for call in rest:
                try:
                    await asyncio.wait_for(asyncio.shield(call), 3)
                    codes.append("OK")
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        assert "max_waiting" in e.details()
                        assert dict(e.trailing_metadata())["retry-after"] == "1"
                except TimeoutError:
                    codes.append("waiting")
            for call in [first, *rest]:
                call.cancel()
            return codes

        codes = run(target, overload)
        # 1 running + 2 waiting (served, or still queued after 3 s); the other 4 are refused at once.
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4, codes
        assert sorted(c for c in codes if c != grpc.StatusCode.RESOURCE_EXHAUSTED) in (
            ["OK", "OK"], ["OK", "waiting"], ["waiting", "waiting"]), codes
        assert wait_idle(url)["minivllm:kv_cache_usage_perc"] == 0

        async def dies(stub, channel):
            hstub = health_pb2_grpc.HealthStub(channel)
            check = lambda s: hstub.Check(health_pb2.HealthCheckRequest(service=s))  # noqa: E731
            assert (await check("")).status == health_pb2.HealthCheckResponse.SERVING
            assert (await check(SERVICE)).status == health_pb2.HealthCheckResponse.SERVING
            assert (await stub.Health(pb.HealthRequest())).status == pb.SERVING
            watch = hstub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

            def broken_schedule():
                raise RuntimeError("scheduler state corrupted")

            engine.engine.scheduler.schedule = broken_schedule  # not tied to a request: the loop cannot go on
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(greedy("hello", 4))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "engine loop" in e.value.details()
            assert (await check("")).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await check(SERVICE)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            h = await stub.Health(pb.HealthRequest())
            # Health is open: the dead loop's exception type, never its text (issue 33)
            assert h.status == pb.NOT_SERVING and "RuntimeError" in h.message and "corrupted" not in h.message
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _drain(stub.GenerateStream(greedy("hello", 4)))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        run(target, dies)
        assert httpx.get(url + "/health").status_code == 503  # HTTP agrees: one engine
