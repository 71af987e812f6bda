"""Issue 33, items 4 and 6: the live view and the admin routes behind keys on a real server. With --api-key the
page and its feed need the key (a browser gives it as ?token= on the page and as a WebSocket subprotocol); with
--admin-api-key they and runtime LoRA loading need that key and refuse the user key; a bounded number of feeds;
a token in a URL never reaches the log; a step record that cannot be built never stops the engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_utils import ServerProcess
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

USER, ADMIN = "sk-user-5f4e3d2c1b", "sk-admin-a1b2c3d4e5"


def _hello(ws_url: str, **kw) -> dict:
    with connect(ws_url, open_timeout=30, **kw) as ws:
        return json.loads(ws.recv(timeout=30))


def _refused(ws_url: str, **kw) -> int:
    """How the server refuses a connection: a close before the handshake is an HTTP 403 under uvicorn."""
    try:
        with connect(ws_url, open_timeout=30, **kw) as ws:
            ws.recv(timeout=30)
    except ConnectionClosed as e:
        return e.rcvd.code if e.rcvd is not None else -1
    except InvalidStatus as e:  # (a refusal before the handshake completes)
        return e.response.status_code
    return 0


@pytest.fixture(scope="module")
def keyed(model_factory):
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                           "--api-key", USER, "--max-live-viewers", "1", "--log-level", "info")
    yield server
    server.stop()


def test_live_view_needs_the_key_and_takes_it_as_a_browser_can(keyed):
    url, ws = keyed.url, keyed.url.replace("http", "ws") + "/ws/events"
    assert httpx.get(url + "/dashboard", timeout=30).status_code == 401
    assert "token=<key>" in httpx.get(url + "/dashboard", timeout=30).json()["error"]["message"]
    assert httpx.get(url + "/dashboard?token=wrong", timeout=30).status_code == 401
    page = httpx.get(url + f"/dashboard?token={USER}", timeout=30)
    assert page.status_code == 200 and "<html" in page.text.lower()
    # The page opened with its token sets a cookie good for the page (a reload), not for the API or the feed.
    cookie = page.cookies["minivllm_dashboard"]
    assert cookie and USER not in cookie and "HttpOnly" in page.headers["set-cookie"]
    assert httpx.get(url + "/dashboard", cookies={"minivllm_dashboard": cookie}, timeout=30).status_code == 200
    assert httpx.get(url + "/dashboard", cookies={"minivllm_dashboard": "x" + cookie}, timeout=30).status_code == 401
    assert httpx.post(url + "/generate", json={"prompt": "hi"}, cookies={"minivllm_dashboard": cookie},
                      timeout=30).status_code == 401
    assert httpx.get(url + "/dashboard/dashboard.js", timeout=30).status_code == 200  # code, no data
    assert httpx.get(url + "/dashboard", headers={"Authorization": f"Bearer {USER}"}, timeout=30).status_code == 200
    assert _refused(ws) == 403
    assert _refused(ws + "?token=wrong") == 403
    assert _refused(ws, subprotocols=["minivllm-key.wrong"]) == 403
    assert _hello(ws, subprotocols=[f"minivllm-key.{USER}"])["type"] == "hello"
    assert _hello(ws + f"?token={USER}")["type"] == "hello"
    assert _hello(ws, additional_headers={"Authorization": f"Bearer {USER}"})["type"] == "hello"
    # /ws/generate takes the key the same ways (a browser client can use it too).
    gen = url.replace("http", "ws") + "/ws/generate"
    assert _refused(gen) == 403
    with connect(gen, subprotocols=[f"minivllm-key.{USER}"], open_timeout=30) as sock:
        assert sock.subprotocol == f"minivllm-key.{USER}"
        sock.send(json.dumps({"prompt": "hi", "max_new_tokens": 2}))
        while "finish_reason" not in (msg := json.loads(sock.recv(timeout=30))):
            pass
        assert msg["usage"]["completion_tokens"] == 2
    # The token never reaches the log (uvicorn logs each path with its query string).
    log = keyed.log_text()
    assert "token=***" in log and USER not in log


def test_live_viewers_are_bounded(keyed):
    ws = keyed.url.replace("http", "ws") + "/ws/events"
    with connect(ws, subprotocols=[f"minivllm-key.{USER}"], open_timeout=30) as first:
        assert json.loads(first.recv(timeout=30))["type"] == "hello"
        with connect(ws, subprotocols=[f"minivllm-key.{USER}"], open_timeout=30) as second:
            msg = json.loads(second.recv(timeout=30))
            assert msg["type"] == "error" and "--max-live-viewers" in msg["message"]
            with pytest.raises(ConnectionClosed) as closed:
                second.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
    assert _hello(ws, subprotocols=[f"minivllm-key.{USER}"])["type"] == "hello"  # the seat is free again


def test_admin_key_guards_the_live_view_and_lora_loading(model_factory, tmp_path):
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                           "--api-key", USER, "--admin-api-key", ADMIN, "--enable-lora",
                           "--allow-runtime-lora-updating")
    try:
        url, ws = server.url, server.url.replace("http", "ws") + "/ws/events"
        user, admin = {"Authorization": f"Bearer {USER}"}, {"Authorization": f"Bearer {ADMIN}"}
        body = {"lora_name": "x", "lora_path": str(tmp_path / "none")}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = httpx.post(url + path, json=body, headers=user, timeout=30)
            assert r.status_code == 401 and "--admin-api-key" in r.json()["error"]["message"], r.text
            assert httpx.post(url + path, json=body, headers=admin, timeout=30).status_code in (400, 404)
        assert httpx.get(url + "/dashboard", headers=user, timeout=30).status_code == 401
        assert httpx.get(url + f"/dashboard?token={ADMIN}", timeout=30).status_code == 200
        assert _refused(ws, subprotocols=[f"minivllm-key.{USER}"]) == 403
        assert _hello(ws, subprotocols=[f"minivllm-key.{ADMIN}"])["type"] == "hello"
        # Generation takes the user key (the admin key is for the admin routes only).
        gen = {"prompt": "hi", "max_new_tokens": 2}
        assert httpx.post(url + "/generate", json=gen, headers=user, timeout=60).status_code == 200
        assert httpx.post(url + "/generate", json=gen, headers=admin, timeout=60).status_code == 401
    finally:
        server.stop()


def test_a_record_that_cannot_be_built_never_stops_the_engine(model_factory):
    from minivllm.config import EngineArgs
    from minivllm.engine.async_engine import AsyncLLMEngine
    from minivllm.sampling_params import SamplingParams

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model_factory("tiny-llama"), num_kv_blocks=64))

    def broken(eng, stats):
        raise KeyError("r")

    engine.tracer.build = broken

    async def run():
        engine.start()
        sub = engine.tracer.subscribe()
        try:
            outs = [o async for o in engine.generate("hi", SamplingParams(max_tokens=4, ignore_eos=True), "r1")]
            record = await asyncio.wait_for(sub.queue.get(), 30)
            return outs[-1], record
        finally:
            engine.tracer.unsubscribe(sub)
            engine.shutdown()

    final, record = asyncio.run(run())
    assert final.finished and len(final.outputs[0].token_ids) == 4
    assert record["type"] == "error" and "KeyError" in record["message"]


def test_low_items_models_metrics_and_internal_errors(keyed, model_factory):
    """Issue 33, low items: /v1/models shows names, never the server's paths; /metrics takes the key with
    --metrics-need-key (open by default); a bug's exception reaches the client as its type only."""
    from minivllm.entrypoints.serving import internal_error

    models = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {USER}"}, timeout=30).json()
    assert models["data"][0]["root"] == models["data"][0]["id"] and "/" not in json.dumps(models["data"][0]["root"])
    assert httpx.get(keyed.url + "/metrics", timeout=30).status_code == 200
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                           "--api-key", USER, "--metrics-need-key")
    try:
        assert httpx.get(server.url + "/metrics", timeout=30).status_code == 401
        r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {USER}"}, timeout=30)
        assert r.status_code == 200 and "minivllm:num_requests_running" in r.text
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        server.stop()
    err = internal_error(KeyError("/srv/models/secret-path"))
    assert err.status == 500 and "KeyError" in err.message and "secret-path" not in err.message
