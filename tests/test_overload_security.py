"""Overload and security basics on the real server: 429 + Retry-After past --max-waiting without waiting for the
engine; a request whose timeout (the `timeout` field, the client's own timeout, a gRPC deadline) passes while it
waits is dropped before any prefill; per-request limits with clear errors; the API key never logged; 127.0.0.1
by default; CORS off unless asked for; a model name is never a path."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import openai
import psutil
import pytest
from server_utils import ServerProcess, free_port, metrics, wait_idle

from minivllm.engine.fault_injection import ENV_VAR
from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc
from minivllm.entrypoints.server_args import ServerArgs

# The long request holding the seat runs at the slow_step fault's pace (>= 10 ms a step, >= 10 s in all; its client
# hangs up long before): at the tiny model's own pace it took ~0.35 s, and the waits below raced it on fast machines.
LONG = {"prompt": "<<slow>> count", "max_new_tokens": 1000, "ignore_eos": True}
SECRET = "sk-test-9f8e7d6c5b4a"


@pytest.fixture(scope="module")
def busy_server(model_factory):
    """One sequence at a time, two may wait: easy to saturate."""
    grpc_port = free_port()
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--max-num-seqs", "1",
                           "--max-waiting", "2", "--kv-cache-memory", "64MiB", "--grpc-port", str(grpc_port),
                           env={ENV_VAR: "slow_step=<<slow>>"})
    server.grpc_target = f"127.0.0.1:{grpc_port}"
    yield server
    server.stop()


async def _while_busy(url: str, work):
    """Run work() while a long request occupies the only running seat (the last call's long request gone first: its
    cancelled client is aborted a moment later, and counted running meanwhile, that one let work() in before the new
    long request had even been sent, so work's request could take the seat)."""
    wait_idle(url)
    async with httpx.AsyncClient(timeout=300) as http:
        first = asyncio.ensure_future(http.post(url + "/generate", json=LONG))
        while metrics(url)["minivllm:num_requests_running"] < 1:
            await asyncio.sleep(0.02)
        try:
            return await work(http)
        finally:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)


def test_429_comes_at_once_with_retry_after(busy_server):
    url = busy_server.url

    async def work(http: httpx.AsyncClient):
        waiting = [asyncio.ensure_future(http.post(url + "/generate", json=LONG)) for _ in range(2)]
        while metrics(url)["minivllm:num_requests_waiting"] < 2:
            await asyncio.sleep(0.02)
        times, responses = [], []
        for _ in range(20):
            t = time.perf_counter()
            responses.append(await http.post(url + "/generate", json=LONG))
            times.append(time.perf_counter() - t)
        # A guided request is refused before its constraint is compiled (an invalid one would be a 400).
        guided = await http.post(url + "/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"})
        running = metrics(url)["minivllm:num_requests_running"]
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return responses, times, running, guided

    responses, times, running, guided = asyncio.run(_while_busy(url, work))
    assert all(r.status_code == 429 and r.headers["Retry-After"] == "1" for r in responses)
    assert guided.status_code == 429 and guided.headers["Retry-After"] == "1", guided.text
    assert "max_waiting" in responses[0].json()["error"]["message"]
    assert running == 1  # answered while the long request still ran: nobody waited for the engine
    times.sort()
    print(f"429 round trip over loopback: p50 {1000 * times[len(times) // 2]:.1f} ms, max {1000 * times[-1]:.1f} ms")
    assert wait_idle(url)["minivllm:kv_cache_usage_perc"] == 0


def test_timeouts_drop_waiting_requests_before_prefill(busy_server):
    url = busy_server.url
    before = metrics(url)

    # Timeouts of 0.1 s (at the tiny model's own pace the long request's 1000 tokens took ~0.35 s, and timeouts of
    # 0.3 s sometimes outlived it; LONG now runs for >= 10 s).
    async def field(http: httpx.AsyncClient) -> httpx.Response:
        # The `timeout` field: 503 with Retry-After once it passes, never prefilled.
        return await http.post(url + "/generate", json={"prompt": "a b c d e f g", "max_new_tokens": 4,
                                                        "timeout": 0.1})

    async def client_side(http: httpx.AsyncClient) -> None:
        # The client's own timeout: it gives up and disconnects; the server drops the waiting request.
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            await client.completions.create(model="tiny-llama0", prompt="h i j k", max_tokens=4, timeout=0.1)

    async def grpc_deadline(http: httpx.AsyncClient) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(busy_server.grpc_target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(prompt="l m n", max_new_tokens=4), timeout=0.1)
        return err.value

    r = asyncio.run(_while_busy(url, field))
    asyncio.run(_while_busy(url, client_side))
    grpc_err = asyncio.run(_while_busy(url, grpc_deadline))
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert "timed out" in r.json()["error"]["message"] and r.json()["error"]["param"] == "timeout"
    assert grpc_err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    after = wait_idle(url)
    # Only the three long requests were prefilled: the three that timed out cost no prompt tokens.
    usage = httpx.post(url + "/v1/completions", json={"prompt": LONG["prompt"], "max_tokens": 1}).json()["usage"]
    prefilled = after["minivllm:prompt_tokens_total"] - before["minivllm:prompt_tokens_total"]
    assert prefilled == 3 * usage["prompt_tokens"], (prefilled, usage)
    assert after["minivllm:kv_cache_usage_perc"] == 0
    bad = httpx.post(url + "/generate", json={"prompt": "x", "timeout": -1})
    assert bad.status_code == 400 and "timeout" in bad.json()["error"]["message"]


def test_websocket_input_is_bounded(busy_server):
    """Issue 33, item 3: a WebSocket holds at most WS_MAX_QUEUED requests behind its running one (each further
    message gets a 429 and is dropped, not buffered), and a message over --max-body-size (4 MiB) ends the
    connection with 1009 before it is buffered; the server keeps serving."""
    import json

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from minivllm.entrypoints.server_args import WS_MAX_QUEUED

    url = busy_server.url
    ws_url = url.replace("http", "ws") + "/ws/generate"
    with connect(ws_url, max_size=None) as ws:
        ws.send(json.dumps(LONG))
        deadline = time.time() + 60
        while metrics(url)["minivllm:num_requests_running"] < 1:  # taken off the connection's queue
            assert time.time() < deadline
            time.sleep(0.02)
        for i in range(WS_MAX_QUEUED + 6):
            ws.send(json.dumps({"prompt": f"q{i}", "max_new_tokens": 2}))
        refused = []
        while len(refused) < 6:
            msg = json.loads(ws.recv(timeout=60))
            assert "error" in msg or "finish_reason" not in msg, msg  # the long request's deltas, and the 429s
            if "error" in msg:
                refused.append(msg["error"])
        assert all(e["code"] == 429 and "already wait on this connection" in e["message"] for e in refused), refused
    # (closing the socket aborted the running request and dropped the queued ones)
    with connect(ws_url, max_size=None) as ws:
        ws.send("x" * (4 * 1024 * 1024 + 1))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value
    wait_idle(url)
    with connect(ws_url) as ws:  # the server serves the next connection as before
        ws.send(json.dumps({"prompt": "hi", "max_new_tokens": 2}))
        msgs = [json.loads(ws.recv(timeout=60))]
        while "finish_reason" not in msgs[-1]:
            msgs.append(json.loads(ws.recv(timeout=60)))
        assert msgs[-1]["usage"]["completion_tokens"] == 2


def test_request_limits_name_their_flag(model_factory):
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                           "--max-prompt-tokens", "8", "--max-n", "2", "--max-logprobs", "3")
    try:
        url = server.url
        cases = [({"prompt": "one two three four five six seven eight nine ten eleven twelve"}, "--max-prompt-tokens"),
                 ({"prompt": "hi", "n": 3}, "--max-n"),
                 ({"prompt": "hi", "logprobs": 4}, "--max-logprobs"),
                 ({"prompt": "hi", "prompt_logprobs": 4}, "--max-logprobs")]
        for body, flag in cases:
            r = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
            assert r.status_code == 400 and flag in r.json()["error"]["message"], r.text
        ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "n": 2, "logprobs": 3, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        for model in ("/etc/passwd", "../../tiny-llama0", "tiny-llama0/../../x"):  # a name, never a path to load
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_stop_strings_are_bounded(model_factory):
    """Issue 33, item 2 (the bound): stop strings are matched against every sequence's new text each step, so their
    number and length are bounded per request (400 naming the flag), on each route; within the bounds they work."""
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                           "--max-stop-strings", "4", "--max-stop-string-length", "16")
    try:
        url = server.url
        many, long = [f"zz{i}" for i in range(5)], ["z" * 17]
        for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                            ("/generate", {"prompt": "hi", "max_new_tokens": 2})):
            for stop, flag in ((many, "--max-stop-strings"), (long, "--max-stop-string-length")):
                r = httpx.post(url + route, json={**body, "stop": stop}, timeout=30)
                assert r.status_code == 400 and flag in r.text, r.text
            ok = httpx.post(url + route, json={**body, "stop": many[:4]}, timeout=30)
            assert ok.status_code == 200, ok.text
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": ["y" * 16]},
                          timeout=30).status_code == 200
    finally:
        server.stop()


def test_api_key_never_logged_and_defaults_are_safe(model_factory, monkeypatch):
    assert ServerArgs().host == "127.0.0.1" and SECRET not in repr(ServerArgs(api_key=SECRET))
    monkeypatch.setenv("MINIVLLM_API_KEY", SECRET)  # from the environment: not in the process list either
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                           "--log-level", "debug")
    try:
        url = server.url
        assert httpx.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 2}).status_code == 401
        wrong = httpx.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 2},
                           headers={"Authorization": f"Bearer {SECRET[:-1]}"})
        assert wrong.status_code == 401
        good = httpx.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 2},
                          headers={"Authorization": f"Bearer {SECRET}"})
        assert good.status_code == 200
        assert SECRET not in server.log_text() and SECRET[:-1] not in server.log_text()
        proc = psutil.Process(server.proc.pid)
        assert SECRET not in " ".join(proc.cmdline())
        listening = {c.laddr.ip for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}, listening
        # CORS is off: a browser's preflight gets no Access-Control-Allow-Origin.
        pre = httpx.options(url + "/v1/completions", headers={"Origin": "http://evil.example",
                                                              "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers
    finally:
        server.stop()


def test_cors_when_asked_for(model_factory):
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                           "--allowed-origins", "http://app.example")
    try:
        ask = {"Access-Control-Request-Method": "POST"}
        ok = httpx.options(server.url + "/v1/completions", headers={"Origin": "http://app.example", **ask})
        assert ok.headers.get("access-control-allow-origin") == "http://app.example"
        other = httpx.options(server.url + "/v1/completions", headers={"Origin": "http://evil.example", **ask})
        assert "access-control-allow-origin" not in other.headers
    finally:
        server.stop()
