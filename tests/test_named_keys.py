"""Issue 33, item 5: named API keys (--api-keys-file) on a real server: each key's requests take at most its seats
in the engine (the rest wait for them, bounded: 429 naming the key), a light client is served while a heavy one's
backlog waits, a key may not raise its priority or set its own SLO unless allowed, gRPC takes the
same keys, and a bad keys file is a clear error naming the entry."""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import httpx
import pytest
from server_utils import ServerProcess, free_port, metrics

from minivllm.entrypoints.clients import ClientKey, ClientRegistry, current_client, load_keys_file

LIGHT, HEAVY, BOSS = "sk-light-0123456789ab", "sk-heavy-0123456789ab", "sk-boss-0123456789abcd"
LONG = {"prompt": "count", "max_new_tokens": 1000, "ignore_eos": True}


def _keys_file(path) -> str:
    doc = {"clients": [{"name": "light", "key": LIGHT},
                       {"name": "heavy", "key": HEAVY, "max_concurrency": 2, "max_queued": 3},
                       {"name": "boss", "key": BOSS, "may_prioritize": True}]}
    path.write_text(json.dumps(doc))
    os.chmod(path, 0o600)
    return str(path)


@pytest.fixture(scope="module")
def keyed(model_factory, tmp_path_factory):
    grpc_port = free_port()
    server = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--kv-cache-memory", "64MiB",
                           "--max-num-seqs", "8", "--api-keys-file",
                           _keys_file(tmp_path_factory.mktemp("keys") / "keys.json"), "--grpc-port", str(grpc_port))
    server.grpc_target = f"127.0.0.1:{grpc_port}"
    yield server
    server.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_keys_seats_bound_what_it_has_in_the_engine(keyed):
    url = keyed.url

    async def run():
        async with httpx.AsyncClient(timeout=300) as http:
            heavy = [asyncio.ensure_future(http.post(url + "/generate", json=LONG, headers=_auth(HEAVY)))
                     for _ in range(5)]  # 2 seats + 3 waiting for them
            deadline = time.time() + 60
            while metrics(url)["minivllm:num_requests_running"] < 2:
                assert time.time() < deadline
                await asyncio.sleep(0.02)
            over = await http.post(url + "/generate", json=LONG, headers=_auth(HEAVY))
            t0 = time.perf_counter()
            light = asyncio.ensure_future(http.post(url + "/generate", json={"prompt": "hi", "max_new_tokens": 4},
                                                    headers=_auth(LIGHT)))
            most = in_flight = 0  # the most requests running in the engine, and the most heavy ones in flight
            while not all(h.done() for h in heavy):
                m = metrics(url)
                most = max(most, m["minivllm:num_requests_running"])
                in_flight = max(in_flight, m['minivllm:client_requests_in_flight{client="heavy"}'])
                if light.done() and not hasattr(run, "light_s"):
                    run.light_s = time.perf_counter() - t0
                await asyncio.sleep(0.05)
            return most, in_flight, over, await light, await asyncio.gather(*heavy)

    most, in_flight, over, light, done = asyncio.run(run())
    # 8 seats in the engine, but the key holds 2 (3 with the light request); its other 3 wait for them.
    assert 2 <= most <= 3, most
    assert in_flight == 5
    assert over.status_code == 429 and "client 'heavy'" in over.json()["error"]["message"]
    assert "max_queued=3" in over.json()["error"]["message"] and over.headers["Retry-After"] == "1"
    assert light.status_code == 200 and light.json()["tokens_generated"] == 4
    assert all(r.status_code == 200 and r.json()["tokens_generated"] == 1000 for r in done)
    # The light request did not wait for the heavy backlog (5 x 1000 tokens two at a time).
    assert hasattr(run, "light_s"), "the light request finished only after the heavy backlog"
    print(f"light request beside a full heavy key: {1000 * run.light_s:.0f} ms")
    m = metrics(url)
    assert m["minivllm:num_requests_running"] == 0 and m['minivllm:client_requests_in_flight{client="heavy"}'] == 0


def test_unknown_keys_are_refused_and_grpc_takes_named_keys(keyed):
    from minivllm.entrypoints.proto import inference_pb2 as pb
    from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc

    assert httpx.post(keyed.url + "/generate", json={"prompt": "hi"}, timeout=30).status_code == 401
    assert httpx.post(keyed.url + "/generate", json={"prompt": "hi"}, headers=_auth("sk-nobody-0123456789"),
                      timeout=30).status_code == 401
    with grpc.insecure_channel(keyed.grpc_target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        req = pb.GenerateRequest(prompt="hi", max_new_tokens=3, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        out = stub.Generate(req, metadata=[("authorization", f"Bearer {LIGHT}")], timeout=60)
        assert out.tokens_generated == 3


def test_priority_and_slo_are_clamped_unless_the_key_allows_them():
    registry = ClientRegistry([ClientKey("light", LIGHT), ClientKey("boss", BOSS, may_prioritize=True)])
    token = current_client.set("light")
    try:
        assert registry.clamp(-5, 50.0) == (0, None)  # no jumping the default class's queue, no own deadline
        assert registry.clamp("batch", None) == (1, None)  # lowering is fine
        with pytest.raises(ValueError, match="priority"):
            registry.clamp("urgent", None)
    finally:
        current_client.reset(token)
    token = current_client.set("boss")
    try:
        assert registry.clamp(-5, 50.0) == (-5, 50.0)
    finally:
        current_client.reset(token)
    assert registry.clamp(-5, 50.0) == (-5, 50.0)  # the unnamed --api-key (one operator) is not clamped


@pytest.mark.parametrize(("doc", "message"), [
    ("[]", "needs {\"clients\""), ('{"clients": [{"name": "a"}]}', "client 0: expected name and key"),
    ('{"clients": [{"name": "a b", "key": "k"}]}', "name must be an identifier"),
    ('{"clients": [{"name": "a", "key": "short"}]}', "at least 16 printable characters"),
    ('{"clients": [{"name": "a", "key": "0123456789abcdefg", "max_concurrency": 0}]}', "max_concurrency must be"),
    ('{"clients": [{"name": "a", "key": "0123456789abcdefg", "colour": 1}]}', "only key, max_concurrency"),
    ('{"clients": [{"name": "a", "key": "0123456789abcdefg"}, {"name": "b", "key": "0123456789abcdefg"}]}',
     "two clients share a key"),
    ("{not json", "is not JSON"),
])
def test_a_bad_keys_file_names_the_problem(tmp_path, doc, message):
    path = tmp_path / "keys.json"
    path.write_text(doc)
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("(", r"\(")):
        load_keys_file(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_keys_file(str(tmp_path / "missing.json"))


def test_admission_passes_over_a_client_holding_all_its_seats(model_factory):
    """The scheduler admits past a waiting sequence whose client runs max_running sequences already; the passed-over
    keep their order (first come, first served within the client) and run as seats free."""
    import dataclasses

    from minivllm import SamplingParams
    from minivllm.config import EngineArgs
    from minivllm.engine.client_seats import ClientSeats
    from minivllm.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineArgs(model=model_factory("tiny-llama"), num_kv_blocks=128, max_num_seqs=8,
                               check_invariants=True))
    heavy, light = ClientSeats("heavy", 2), ClientSeats("light", 8)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(6):
        eng.add_engine_request(dataclasses.replace(eng.process_request(f"h{i}", "x y", params), seats=heavy))
    eng.add_engine_request(dataclasses.replace(eng.process_request("l0", "x y", params), seats=light))
    eng.add_request("anon", "x y", params)  # no seats of its own: admitted as ever
    order: list[str] = []
    while eng.has_unfinished_requests():
        eng.step()
        running = [s.request_id for s in eng.scheduler.running]
        assert sum(r.startswith("h") for r in running) <= 2, running
        order += [r for r in running if r not in order]
    assert set(order[:4]) == {"h0", "h1", "l0", "anon"}  # the light and the anonymous requests did not wait
    assert [r for r in order if r.startswith("h")] == [f"h{i}" for i in range(6)]  # first come, first served


def test_per_key_limits_under_random_traffic(keyed):
    """Fuzz (seeded): 120 calls from the three keys, unknown keys and none, of random sizes (some past a key's
    seats and queue), priorities and SLOs, some abandoned mid-flight; every answer is 200, 400, 401 or 429 in
    OpenAI's shape (no 5xx), and afterwards no key has anything in flight and no KV block is held."""
    import random

    from fuzz_utils import assert_error_shape
    from server_utils import wait_idle

    rng = random.Random(7)
    url = keyed.url
    keys = [LIGHT, HEAVY, BOSS, "sk-nobody-0123456789ab", None]

    async def one(http: httpx.AsyncClient, i: int) -> int:
        key = rng.choice(keys)
        headers = _auth(key) if key else {}
        n = rng.choice([1, 1, 2, 5, 9])
        body: dict = {"max_new_tokens": rng.choice([1, 4, 40]), "ignore_eos": True}
        if rng.random() < 0.3:
            body["priority"] = rng.choice([-100, -1, 0, 2, "interactive", "batch", "urgent"])
        if rng.random() < 0.2:
            body["ttft_slo_ms"] = rng.choice([1, 50, 0, -5])
        if n == 1:
            path, body["prompt"] = "/generate", f"p{i}"
        else:
            path, body["prompts"] = "/batch_generate", [f"p{i}-{j}" for j in range(n)]
        call = asyncio.ensure_future(http.post(url + path, json=body, headers=headers))
        if rng.random() < 0.15:  # the client leaves
            await asyncio.sleep(rng.random() * 0.3)
            call.cancel()
            return -1
        r = await call
        if r.status_code != 200:
            assert_error_shape(r.json(), r.status_code)
        return r.status_code

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(one(http, i) for i in range(120)), return_exceptions=True)

    codes = asyncio.run(run())
    statuses = [c for c in codes if isinstance(c, int) and c != -1]
    assert set(statuses) <= {200, 400, 401, 429}, codes
    assert {200, 401, 429} <= set(statuses), statuses  # each path was taken
    m = wait_idle(url, timeout=120)
    assert all(v == 0 for k, v in m.items() if k.startswith("minivllm:client_requests_in_flight")), m
    assert not [k for k, v in m.items() if 'status="server_error"' in k and v]
    log = keyed.log_text()
    assert "Traceback" not in log
