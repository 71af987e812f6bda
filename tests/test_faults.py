"""Fault injection (MINIVLLM_FAULT_INJECTION, engine/fault_injection.py): each fault fails only the requests it
touches, with a clear reason; the rest of the batch completes with the outputs it has without the fault; no KV
block leaks. On the real server: 500s naming the fault for the faulted requests only, and a killed engine loop
turns /health to 503 and makes the process exit non-zero. A client that stops reading is dropped."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_utils import ServerProcess, in_process_server, metrics, wait_idle

from minivllm import EngineArgs, SamplingParams
from minivllm.engine.async_engine import AsyncLLMEngine
from minivllm.engine.async_stream import ClientStalledError
from minivllm.engine.fault_injection import ENV_VAR, FaultInjector
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.api_server import build_app
from minivllm.entrypoints.server_args import ServerArgs

SPEC = "step_raise=<<raise>>,nan_logits=<<nan>>,detokenize=<<detok>>,kill_loop=<<kill>>,slow_step=<<slow>>"
GOOD = ["def add(a, b):\n    return", "import os\nimport sys\n", "class Foo:\n    def", "for i in range(10):",
        "x = [1, 2, 3]\nprint(", "while True:\n    if"]
FAULTY = {"r-raise": "<<raise>> def f():", "r-nan": "<<nan>> x = 1", "r-detok": "<<detok>> print("}


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("tiny-llama")


def _run_batch(model: str, prompts: dict[str, str], **kw) -> tuple[dict[str, list[int]], dict[str, str], LLMEngine]:
    engine = LLMEngine(EngineArgs(model=model, num_kv_blocks=64, check_invariants=True, num_threads=1, **kw))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    outs, failed = {}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        failed.update(engine.take_failed_requests())
    return outs, failed, engine


def test_spec_parsing_and_production_refusal():
    assert FaultInjector.from_env({}) is None
    inj = FaultInjector.from_env({ENV_VAR: "step_raise=AAA,nan_logits=BBB"})
    assert inj is not None and inj.faults_for("x AAA y", str) == {"step_raise"}
    with pytest.raises(ValueError, match="not KIND=MARKER"):
        FaultInjector.from_env({ENV_VAR: "explode=AAA"})
    with pytest.raises(ValueError, match="refused in production"):
        FaultInjector.from_env({ENV_VAR: "step_raise=AAA", "MINIVLLM_ENV": "production"})


def test_the_guard_fails_rows_with_nan_or_plus_inf_logits_and_keeps_masked_ones():
    """StepGuard's check of a step's logits (one sum over every row, the rows looked at only when it is NaN or +inf):
    a row holding NaN or +inf fails its request and only that one; -inf logits (masked tokens) fail none, whole rows
    of them neither; finite rows whose sum over the step overflows fail none."""
    import torch

    from minivllm.engine.sequence import Sequence
    from minivllm.engine.step_guard import StepGuard

    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(), i) for i in range(4)]
    spans = [(i, i + 1, i, i + 1) for i in range(4)]

    def check(cells: dict[tuple[int, int], float], fill: float = 0.5) -> tuple[set[str], torch.Tensor]:
        logits = torch.full((4, 6), fill)
        for (r, c), v in cells.items():
            logits[r, c] = v
        out = StepGuard(lambda scheduled, inputs: logits).forward([(s, 1) for s in seqs], list("abcd"), spans)
        return set(out.failed), out.logits

    inf, nan = float("inf"), float("nan")
    failed, kept = check({(1, 2): -inf, (3, 0): -inf})
    assert not failed and kept.shape == (4, 6)
    failed, kept = check({(1, 0): inf, (2, 5): nan, (3, 1): -inf})
    assert failed == {"r1", "r2"} and kept.shape == (2, 6) and torch.isinf(kept[1, 1])
    assert check({(0, 3): inf})[0] == {"r0"}  # the step's sum +inf, not NaN
    assert check({(2, c): -inf for c in range(6)} | {(0, 1): inf})[0] == {"r0"}  # +inf beside -inf: the sum NaN
    assert not check({}, fill=1.6e37)[0]  # each row's sum ~1e38, the step's overflows float32 to +inf


def test_each_fault_fails_only_its_request_and_the_rest_match(model, monkeypatch):
    prompts = {f"g{i}": p for i, p in enumerate(GOOD)} | FAULTY
    reference, none_failed, _ = _run_batch(model, prompts)  # hook off: every request completes
    assert not none_failed and len(reference) == len(prompts)
    monkeypatch.setenv(ENV_VAR, SPEC)
    outs, failed, engine = _run_batch(model, prompts)
    assert set(failed) == set(FAULTY), failed
    assert "forward pass raised" in failed["r-raise"]
    assert "non-finite logits" in failed["r-nan"]
    assert "detokeniz" in failed["r-detok"]
    assert set(outs) == {f"g{i}" for i in range(len(GOOD))}
    for rid, ids in outs.items():
        assert ids == reference[rid], rid  # the same greedy tokens as without the faults
    assert engine.block_manager.num_used == 0 and not engine.groups


def test_bisection_isolates_a_raising_request_in_a_chunked_prefill_batch(model, monkeypatch):
    monkeypatch.setenv(ENV_VAR, SPEC)
    prompts = {f"g{i}": p * 8 for i, p in enumerate(GOOD)} | {"r-raise": "<<raise>>" + GOOD[0] * 8}
    outs, failed, engine = _run_batch(model, prompts, max_num_batched_tokens=64)
    assert set(failed) == {"r-raise"} and len(outs) == len(GOOD)
    assert engine.block_manager.num_used == 0


def test_slow_step_paces_the_steps_of_its_request_and_changes_no_token(model, monkeypatch):
    """slow_step: every step holding the marked request sleeps SLOW_STEP_S (a prefill and 11 decode steps for its 12
    tokens), a step without it never does, and its tokens are those of the same prompt without the fault."""
    from minivllm.engine import fault_injection

    prompts = {"r-slow": "<<slow>>" + GOOD[0], "g0": GOOD[1]}
    reference, _, _ = _run_batch(model, prompts)
    monkeypatch.setenv(ENV_VAR, SPEC)
    sleeps: list[float] = []
    monkeypatch.setattr(fault_injection, "time", type("Clock", (), {"sleep": staticmethod(sleeps.append)}))
    outs, failed, engine = _run_batch(model, prompts)
    assert not failed and outs == reference and engine.block_manager.num_used == 0
    assert sleeps == [fault_injection.SLOW_STEP_S] * 12
    sleeps.clear()
    _run_batch(model, {"g0": GOOD[1]})
    assert sleeps == []


def test_offline_llm_names_the_failed_request(model, monkeypatch):
    from minivllm import LLM

    monkeypatch.setenv(ENV_VAR, SPEC)
    llm = LLM(model=model, num_kv_blocks=64, num_threads=1)
    with pytest.raises(RuntimeError, match=r"1 of 3 requests failed: .*non-finite logits"):
        llm.generate(["a b c", "<<nan>> d", "e f"], SamplingParams(max_tokens=4))
    assert llm.llm_engine.block_manager.num_used == 0


def test_timeout_drops_a_waiting_request_before_prefill(model):
    engine = LLMEngine(EngineArgs(model=model, num_kv_blocks=64, max_num_seqs=1, num_threads=1,
                                  check_invariants=True))
    clock = [1000.0]
    engine.scheduler.clock = lambda: clock[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("busy", "a b c", params, arrival_time=clock[0])
    engine.add_request("late", "d e f", params, arrival_time=clock[0], timeout_s=2.5)
    engine.add_request("patient", "g h", params, arrival_time=clock[0], timeout_s=100.0)
    failed, prefilled = {}, set()
    while engine.has_unfinished_requests():
        engine.step()
        prefilled |= {seq.request_id for seq, _ in engine.last_schedule.scheduled} if engine.last_schedule else set()
        failed.update(engine.take_failed_requests())
        clock[0] += 1.0  # one second per step
    assert set(failed) == {"late"} and failed["late"].startswith("request timed out")
    assert "late" not in prefilled and {"busy", "patient"} <= prefilled
    with pytest.raises(ValueError, match="timeout: must be a positive number"):
        engine.add_request("bad", "x", params, timeout_s=0)


def test_client_that_stops_reading_is_dropped(model):
    """The engine side of back-pressure: a stream nobody reads is aborted once outputs pile up past the stall
    timeout, and its KV blocks are freed; a reading client of the same engine is unaffected."""
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=model, kv_cache_memory="64MiB", num_threads=1)),
                            client_stall_timeout_s=0.05)

    async def run() -> tuple[BaseException | None, int]:
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        stalled = await engine.add_request("stalled", "a b c", params)
        tokens = 0
        async for out in engine.generate("d e f", SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
                                         "reader"):
            tokens = len(out.outputs[0].token_ids)  # cumulative outputs
        error = None
        try:
            async for _ in stalled:  # the client comes back much later: its request was dropped
                pass
        except ClientStalledError as e:
            error = e
        return error, tokens

    error, tokens = asyncio.run(run())
    engine.shutdown()
    assert isinstance(error, ClientStalledError) and "did not read its stream" in str(error)
    assert tokens == 300
    assert engine.engine.block_manager.num_used == 0 and not engine.engine.groups


# ---- the real server ------------------------------------------------------------------------------------
@pytest.fixture
def faulty_server(model, monkeypatch):
    monkeypatch.setenv(ENV_VAR, SPEC)
    server = ServerProcess(model, "--num-threads", "1", "--kv-cache-memory", "64MiB", "--client-stall-timeout", "2")
    yield server
    server.stop()


def test_server_faults_fail_only_their_requests(model, faulty_server):
    url = faulty_server.url
    assert "FAULT INJECTION IS ON" in faulty_server.log_text()

    async def one(http: httpx.AsyncClient, prompt: str, stream: bool) -> tuple[int, str]:
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": stream}
        if not stream:
            r = await http.post(url + "/v1/completions", json=body)
            return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        text, err = [], ""
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        err = json.dumps(event)
                    else:
                        text.append(event["choices"][0]["text"])
        return (500, err) if err else (200, "".join(text))

    async def run() -> list[tuple[int, str]]:
        prompts = GOOD + list(FAULTY.values())
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, p, i % 2 == 0) for i, p in enumerate(prompts)))

    results = asyncio.run(run())
    good, faulty = results[:len(GOOD)], results[len(GOOD):]
    assert all(code == 200 for code, _ in good), good
    for (code, msg), word in zip(faulty, ("forward pass raised", "non-finite logits", "detokeniz"), strict=True):
        assert code == 500 and word in msg, msg
    for prompt, (_, text) in zip(GOOD, good, strict=True):  # the same text as each alone
        solo = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                         "ignore_eos": True}, timeout=60).json()
        assert solo["choices"][0]["text"] == text
    m = wait_idle(url)
    assert m["minivllm:kv_cache_usage_perc"] == 0 and httpx.get(url + "/health").status_code == 200


def test_server_drops_a_client_that_stops_reading(faulty_server):
    """A real socket that never reads (small receive buffer) on a big stream: once the transport's buffers are full
    the server's write waits; after --client-stall-timeout (2 s) the request is aborted and its KV freed while the
    socket is still open, and everyone else is served. The request runs at slow_step's pace (>= 10 ms a step, so
    >= 10 s in all): at the tiny model's own pace a fast machine generated all 16,000 tokens in the 2 s."""
    url = faulty_server.url
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", faulty_server.port))
    body = json.dumps({"prompt": "<<slow>> hello", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                       "logprobs": 20, "n": 16}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    try:
        deadline = time.time() + 60
        while metrics(url).get('minivllm:request_success_total{finished_reason="abort"}', 0) < 1:
            assert time.time() < deadline, "the stalled request was not dropped"
            time.sleep(0.2)
        m = wait_idle(url)
        assert m["minivllm:kv_cache_usage_perc"] == 0
        assert m["minivllm:generation_tokens_total"] < 16 * 1000  # stopped well before the end
        ok = httpx.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 4}, timeout=60)
        assert ok.status_code == 200
        assert "read nothing of its stream" in faulty_server.log_text()
    finally:
        sock.close()


def test_killed_engine_loop_answers_503_and_exits_nonzero(faulty_server):
    url = faulty_server.url
    r = httpx.post(url + "/generate", json={"prompt": "<<kill>> now", "max_new_tokens": 4}, timeout=60)
    assert r.status_code == 503 and "engine loop" in r.json()["error"]["message"]
    health = httpx.get(url + "/health", timeout=10)
    # /health is open: the dead loop's exception type, never its text (which names another client's request)
    message = health.json()["error"]["message"]
    assert health.status_code == 503 and "EngineLoopKilled" in message and "<<kill>>" not in message
    code = faulty_server.proc.wait(30)
    assert code != 0
    assert "engine loop died" in faulty_server.log_text()


def test_fault_injection_is_refused_in_production(model):
    env = {ENV_VAR: SPEC, "MINIVLLM_ENV": "production", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "minivllm", "serve", model, "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "refused in production" in proc.stderr


def test_step_error_without_a_fault_hook_in_process(model):
    """The hook is off by default: a plain server has no faults and reports none."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model, num_threads=1, kv_cache_memory="64MiB"),
                                             stat_loggers=[])
    assert engine.engine.faults is None
    with in_process_server(build_app(engine, ServerArgs())) as url:
        r = httpx.post(url + "/generate", json={"prompt": "<<raise>> x", "max_new_tokens": 3}, timeout=60)
        assert r.status_code == 200
        assert wait_idle(url)["minivllm:kv_cache_usage_perc"] == 0
