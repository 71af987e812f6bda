"""Bad input of every kind gets the expected 4xx and a message naming the problem; the server keeps
serving. Also: the API key, the body-size limit and the bounded waiting queue (429 + Retry-After)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_utils import metrics, wait_idle
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN = 256


@pytest.fixture(scope="module")
def url(model_factory, serve):
    return serve(model_factory("tiny-llama"), "--api-key", KEY, "--max-model-len", str(MAX_LEN),
                 "--max-body-size", "64KiB", "--max-num-seqs", "8")


G, B, C, CH = "/generate", "/batch_generate", "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# (name, method, path, json body or raw bytes, headers, status, words the message must hold)
CASES = [
    ("prompt of the wrong type", "POST", G, {"prompt": 5}, AUTH, 400, ["prompt", "string"]),
    ("missing prompt", "POST", G, {"max_new_tokens": 4}, AUTH, 400, ["prompt", "required"]),
    ("negative max tokens", "POST", G, {"prompt": "a", "max_new_tokens": -1}, AUTH, 400, ["max_tokens", ">= 1"]),
    ("huge max tokens", "POST", G, {"prompt": "a", "max_new_tokens": 10**9}, AUTH, 400, ["max_tokens",
                                                                                          "max_model_len"]),
    ("max tokens not a number", "POST", G, {"prompt": "a", "max_new_tokens": "many"}, AUTH, 400, ["max_new_tokens"]),
    ("prompt over max_model_len", "POST", G, {"prompt": "word " * 2000}, AUTH, 400, ["prompt", "max_model_len"]),
    ("empty prompt", "POST", G, {"prompt": ""}, AUTH, 400, ["prompt", "empty"]),
    ("empty prompt list", "POST", B, {"prompts": []}, AUTH, 400, ["prompts"]),
    ("invalid JSON", "POST", G, b'{"prompt": "a",', AUTH, 400, ["invalid JSON"]),
    ("bad UTF-8", "POST", G, b'{"prompt": "\xff\xfe"}', AUTH, 400, ["UTF-8"]),
    ("body not an object", "POST", G, b'["a"]', AUTH, 400, ["dictionary"]),
    ("oversized body", "POST", G, {"prompt": "x" * 100_000}, AUTH, 413, ["exceeds the limit", "max-body-size"]),
    ("unknown model", "POST", C, {"model": "gpt-4", "prompt": "a"}, AUTH, 404, ["gpt-4", "does not exist"]),
    ("negative temperature", "POST", C, {"prompt": "a", "temperature": -1}, AUTH, 400, ["temperature"]),
    ("top_p of zero", "POST", G, {"prompt": "a", "top_p": 0}, AUTH, 400, ["top_p"]),
    ("too many logprobs", "POST", C, {"prompt": "a", "logprobs": 1000}, AUTH, 400, ["logprobs"]),
    ("n over the limit", "POST", C, {"prompt": "a", "n": 1000}, AUTH, 400, ["n"]),
    ("negative stop token id", "POST", G, {"prompt": "a", "stop_token_ids": [-3]}, AUTH, 400, ["stop_token_ids"]),
    ("token id outside the vocabulary", "POST", C, {"prompt": [10**7]}, AUTH, 400, ["token ids", "position 0"]),
    ("min_tokens over max_tokens", "POST", C, {"prompt": "a", "max_tokens": 2, "min_tokens": 5}, AUTH, 400,
     ["min_tokens"]),
    ("misspelt field", "POST", G, {"prompt": "a", "max_new_token": 4}, AUTH, 400, ["max_new_token"]),
    ("no messages", "POST", CH, {"messages": []}, AUTH, 400, ["messages"]),
    ("top_logprobs without logprobs", "POST", CH, {"messages": MSG, "top_logprobs": 2}, AUTH, 400,
     ["top_logprobs"]),
    ("stream_options without stream", "POST", CH, {"messages": MSG, "stream_options": {"include_usage": True}},
     AUTH, 400, ["stream_options"]),
    ("logit_bias", "POST", C, {"prompt": "a", "logit_bias": {"5": 1.0}}, AUTH, 400, ["logit_bias"]),
    ("huge top_k", "POST", G, {"prompt": "a", "top_k": 10**30}, AUTH, 400, ["top_k"]),
    ("batch over max_waiting", "POST", B, {"prompts": ["a"] * 600}, AUTH, 400, ["max_waiting"]),
    ("chat template in the request", "POST", CH, {"messages": MSG, "chat_template": "{{ 1 }}"}, AUTH, 400,
     ["chat_template"]),
    ("missing API key", "POST", G, {"prompt": "a"}, {}, 401, ["API key"]),
    ("wrong API key", "POST", C, {"prompt": "a"}, {"Authorization": "Bearer nope"}, 401, ["API key"]),
    ("wrong method", "GET", G, None, AUTH, 405, ["GET", "not allowed"]),
    ("unknown route", "POST", "/v2/generate", {"prompt": "a"}, AUTH, 404, ["/v2/generate"]),
]


@pytest.mark.parametrize("name,method,path,body,headers,status,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(url, name, method, path, body, headers, status, words):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    if isinstance(body, bytes):
        headers = {**headers, "Content-Type": "application/json"}
    r = httpx.request(method, url + path, headers=headers, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    for w in words:
        assert w in err["message"], (w, err["message"])
    assert httpx.get(url + "/health").status_code == 200


def test_server_fine_after_bad_input(url):
    """After the whole table: nothing leaked, and a good request works."""
    m = wait_idle(url)
    assert m["minivllm:kv_cache_usage_perc"] == 0 and m["minivllm:num_requests_waiting"] == 0
    r = httpx.post(url + "/generate", json={"prompt": "def f():", "max_new_tokens": 3}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_generated"] <= 3


def test_api_key(url):
    assert httpx.get(url + "/health").status_code == 200  # monitoring stays open
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    ws_url = url.replace("http", "ws") + "/ws/generate"
    with pytest.raises(InvalidStatus):
        connect(ws_url).close()
    with connect(ws_url, additional_headers=AUTH) as ws:
        ws.send(json.dumps({"prompt": "a", "max_new_tokens": 2}))
        while "finish_reason" not in (msg := json.loads(ws.recv(timeout=60))):
            pass
        assert msg["usage"]["completion_tokens"] <= 2


def test_overload_gets_429_with_retry_after(model_factory, serve):
    url = serve(model_factory("tiny-llama"), "--max-num-seqs", "1", "--max-waiting", "2")
    body = {"prompt": "count", "max_new_tokens": 1000, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as http:
            first = asyncio.ensure_future(http.post(url + "/generate", json=body))
            while metrics(url)["minivllm:num_requests_running"] < 1:  # the first one is running
                assert not first.done(), first.result().text  # (a failed first request ends the wait)
                await asyncio.sleep(0.02)
            rest = await asyncio.gather(*(http.post(url + "/generate", json=body) for _ in range(6)))
            return [await first, *rest]

    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) == 3 and codes.count(429) == 4, codes  # 1 running + 2 waiting
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["Retry-After"] == "1"
    assert "max_waiting" in rejected.json()["error"]["message"]
    assert wait_idle(url)["minivllm:kv_cache_usage_perc"] == 0
