"""AsyncLLMEngine: a failing step fails only its requests (500) and the loop keeps serving; a dead loop
makes /health answer 503; --batch-wait-ms coalesces arrivals; leaving a stream early aborts it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_utils import in_process_server, metrics, wait_idle

from minivllm import EngineArgs, SamplingParams
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.api_server import build_app
from minivllm.entrypoints.server_args import ServerArgs

KV = "64MiB"  # these engines live in pytest's memory: a small pool (the default is 2 GiB)
POISON = 777  # a prompt holding this token id makes the forward raise (fault injection)


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("tiny-llama")


def _inject_fault(engine: AsyncLLMEngine) -> None:
    real = engine.engine.runner.execute

    def execute(seqs):
        if any(POISON in s.token_ids for s in seqs):
            raise RuntimeError("injected fault in the forward pass")
        return real(seqs)

    engine.engine.runner.execute = execute


def test_step_error_fails_its_requests_and_the_loop_keeps_serving(model):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model, num_threads=1, kv_cache_memory=KV),
                                             stat_loggers=[])
    _inject_fault(engine)
    with in_process_server(build_app(engine, ServerArgs())) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, POISON, 9], "max_tokens": 4}, timeout=60)
        assert r.status_code == 500
        # A foreign exception reaches the client as its type only (its text stays in the log: issue 33)
        message = r.json()["error"]["message"]
        assert "RuntimeError" in message and "injected fault" not in message
        events = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": [POISON, 3], "max_tokens": 4, "stream": True}) as resp:
            assert resp.status_code == 200  # headers went out before the step failed
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert len(events) == 1 and "RuntimeError" in events[0] and '"code": 500' in events[0]
        # Everyone else is served, nothing leaked, and the loop is alive.
        ok = httpx.post(url + "/generate", json={"prompt": "def f(x):", "max_new_tokens": 5}, timeout=60)
        assert ok.status_code == 200 and ok.json()["tokens_generated"] <= 5
        assert httpx.get(url + "/health").status_code == 200
        m = wait_idle(url)
        assert m["minivllm:kv_cache_usage_perc"] == 0
        assert m['inference_requests_total{endpoint="/v1/completions",status="server_error"}'] == 2


def test_dead_engine_loop_answers_503(model):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model, num_threads=1, kv_cache_memory=KV),
                                             stat_loggers=[])

    def broken_schedule():
        raise RuntimeError("scheduler state corrupted")

    with in_process_server(build_app(engine, ServerArgs())) as url:
        assert httpx.get(url + "/health").status_code == 200
        engine.engine.scheduler.schedule = broken_schedule  # not tied to a request: the loop cannot go on
        r = httpx.post(url + "/generate", json={"prompt": "hello", "max_new_tokens": 4}, timeout=60)
        assert r.status_code == 503 and "engine loop" in r.json()["error"]["message"]
        h = httpx.get(url + "/health")
        assert h.status_code == 503 and "RuntimeError" in h.json()["error"]["message"]
        assert "scheduler state corrupted" not in h.json()["error"]["message"]  # /health is open: the type only
        r = httpx.post(url + "/generate", json={"prompt": "hello", "max_new_tokens": 4}, timeout=60)
        assert r.status_code == 503
        assert metrics(url)['inference_requests_total{endpoint="/generate",status="server_error"}'] == 2


class Recorder:
    """A StatLogger that keeps the token count of every step."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def record(self, stats, snapshot) -> None:
        if stats is not None:
            self.steps.extend(stats.num_iteration_tokens)


def test_batch_wait_coalesces_arrivals(model):
    llm_engine = LLMEngine(EngineArgs(model=model, num_threads=1, kv_cache_memory=KV))
    prompts = [[10 + i] * 12 for i in range(4)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def scenario(wait_ms: float) -> list[int]:
        rec = Recorder()
        eng = AsyncLLMEngine(llm_engine, [rec], batch_wait_ms=wait_ms, num_threads=1)
        eng.start()
        streams = []
        for i, p in enumerate(prompts):  # four arrivals 30 ms apart
            streams.append(await eng.add_request(f"w{wait_ms}-{i}", {"prompt_token_ids": p}, params))
            await asyncio.sleep(0.03)
        for s in streams:
            async for _ in s:
                pass
        await asyncio.to_thread(eng.shutdown)
        return rec.steps

    coalesced = asyncio.run(scenario(400))
    assert coalesced[0] == 4 * 12 and len(coalesced) == 3  # one prefill step for all, then 2 decode steps
    llm_engine.block_manager.reset_prefix_cache()
    immediate = asyncio.run(scenario(0))
    assert immediate[0] == 12  # the first request started alone


def test_leaving_a_stream_early_aborts_it(model):
    llm_engine = LLMEngine(EngineArgs(model=model, num_threads=1, kv_cache_memory=KV))

    async def scenario() -> None:
        eng = AsyncLLMEngine(llm_engine, num_threads=1)
        eng.start()
        agen = eng.generate("hello there", SamplingParams(max_tokens=500, ignore_eos=True), "early")
        async for _ in agen:
            break
        await agen.aclose()
        deadline = time.time() + 10
        while eng.snapshot.kv_cache_usage > 0 or eng.snapshot.num_running:
            assert time.time() < deadline, eng.snapshot
            await asyncio.sleep(0.01)
        await asyncio.to_thread(eng.shutdown)

    asyncio.run(scenario())
    assert not llm_engine.has_unfinished_requests()
    assert llm_engine.block_manager.num_used == 0


def test_periodic_log_line(caplog):
    from minivllm.engine.stats import IterationStats, LoggingStatLogger, SchedulerSnapshot

    logger = LoggingStatLogger(interval_s=0.0)
    with caplog.at_level("INFO", logger="minivllm.stats"):
        logger.record(IterationStats(num_steps=1, num_iteration_tokens=[40], num_prefill_tokens=36,
                                     num_generation_tokens=4, prefix_cache_queries=40, prefix_cache_hits=16),
                      SchedulerSnapshot(num_running=4, num_waiting=2, kv_cache_usage=0.25))
    (line,) = [r.getMessage() for r in caplog.records]
    assert "Running: 4 reqs, Waiting: 2 reqs" in line and "KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 40.0%" in line


def test_stats_are_recorded_on_the_event_loop_not_the_engine_thread(model):
    """The engine thread hands stats objects over; the front end's loggers run on its own (event-loop) thread."""
    import threading

    threads, steps = set(), []

    class Recorder:
        def record(self, stats, snapshot):
            threads.add(threading.current_thread().name)
            if stats is not None:
                steps.append(stats.num_steps)

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model, num_threads=1, kv_cache_memory=KV),
                                             stat_loggers=[Recorder()])

    async def main():
        engine.start()
        try:
            stream = await engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
            async for _ in stream:
                pass
            await asyncio.sleep(0.05)  # an idle tick or two may record too
        finally:
            engine.shutdown()
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert threads == {loop_thread} and "minivllm-engine" not in threads
    assert sum(steps) >= 4  # a prefill and three decodes at least
