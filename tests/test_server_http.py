"""The seed endpoints on the real server: /generate (JSON and SSE), /batch_generate, WS /ws/generate, /health."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import PROMPTS
from server_utils import metrics
from websockets.sync.client import connect

MAX_NEW = 12


@pytest.fixture(scope="module")
def url(model_factory, serve):
    return serve(model_factory("tiny-llama"))


@pytest.fixture(scope="module")
def offline(model_factory):
    """The offline engine's greedy answers on the same model (the reference for the server's)."""
    from minivllm import LLM, SamplingParams

    llm = LLM(model_factory("tiny-llama"), num_threads=1)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    return {o.prompt: o.outputs[0] for o in outs}


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


def test_health(url):
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_generate_json_and_sse_agree_with_offline_engine(url, offline):
    for prompt in PROMPTS[:4]:
        body = {"prompt": prompt, "max_new_tokens": MAX_NEW, "temperature": 0}
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert set(answer) >= {"generated_text", "tokens_generated", "latency_ms"}
        assert answer["tokens_generated"] == len(offline[prompt].token_ids)
        assert answer["generated_text"] == offline[prompt].text
        assert answer["latency_ms"] > 0
        with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp)
        assert events[-1] == "[DONE]"
        deltas = [json.loads(e) for e in events[:-1]]
        assert "".join(d["text"] for d in deltas) == answer["generated_text"]
        assert deltas[-1]["tokens_generated"] == answer["tokens_generated"]
        assert deltas[-1]["finish_reason"] == "length" and all(d["finish_reason"] is None for d in deltas[:-1])
        # Really streamed: one event per decode step, each one token more than the last.
        assert [d["tokens_generated"] for d in deltas] == list(range(1, answer["tokens_generated"] + 1))


def test_max_tokens_alias(url):
    r = httpx.post(url + "/generate", json={"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["tokens_generated"] == 3


def test_batch_generate_runs_as_one_batch(url, offline):
    prompts = PROMPTS[:6]
    before = metrics(url)
    r = httpx.post(url + "/batch_generate", json={"prompts": prompts, "max_new_tokens": MAX_NEW, "temperature": 0,
                                                  "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    texts = r.json()["generated_texts"]
    assert len(texts) == len(prompts)
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == offline[prompt].text or len(offline[prompt].token_ids) < MAX_NEW  # EOS ignored here
    after = metrics(url)
    steps = after["minivllm:iteration_tokens_total_count"] - before["minivllm:iteration_tokens_total_count"]
    tokens = after["minivllm:iteration_tokens_total_sum"] - before["minivllm:iteration_tokens_total_sum"]
    # One batch: one step prefills all six prompts, then MAX_NEW - 1 steps decode all six together.
    # Six requests one after another would take 6 * MAX_NEW steps.
    assert steps == MAX_NEW
    assert after["minivllm:generation_tokens_total"] - before["minivllm:generation_tokens_total"] == 6 * MAX_NEW
    prefill = tokens - 6 * (MAX_NEW - 1)
    assert prefill > 6  # every prompt's tokens went through the first step
    # The largest step held all the prefill tokens: the histogram's count below that size stayed put.
    bucket = next(b for b in (8, 16, 32, 64, 128, 256, 512) if b >= prefill)
    lower = max(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < prefill)
    key = 'minivllm:iteration_tokens_total_bucket{{le="{}"}}'
    assert after[key.format(float(bucket))] - before[key.format(float(bucket))] == steps
    assert after[key.format(float(lower))] - before[key.format(float(lower))] == steps - 1


def test_websocket_streams_deltas_then_final(url, offline):
    with connect(url.replace("http", "ws") + "/ws/generate") as ws:
        for prompt in PROMPTS[:2]:
            ws.send(json.dumps({"prompt": prompt, "max_new_tokens": MAX_NEW, "temperature": 0}))
            deltas = []
            while True:
                msg = json.loads(ws.recv(timeout=60))
                if "finish_reason" in msg:
                    break
                deltas.append(msg)
            assert [d["tokens_generated"] for d in deltas] == list(range(1, len(offline[prompt].token_ids) + 1))
            assert "".join(d["text"] for d in deltas) == msg["generated_text"] == offline[prompt].text
            assert msg["finish_reason"] == offline[prompt].finish_reason
            usage = msg["usage"]
            assert usage["completion_tokens"] == len(offline[prompt].token_ids)
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        # A bad request on the socket gets an error message; the connection keeps working.
        ws.send(json.dumps({"prompt": "x", "max_new_tokens": -1}))
        err = json.loads(ws.recv(timeout=30))
        assert err["error"]["code"] == 400 and "max_tokens" in err["error"]["message"]
        ws.send("{not json")
        assert "invalid JSON" in json.loads(ws.recv(timeout=30))["error"]["message"]
        ws.send(json.dumps({"prompt": PROMPTS[0], "max_new_tokens": 2}))
        while "finish_reason" not in (msg := json.loads(ws.recv(timeout=60))):
            pass
        assert msg["usage"]["completion_tokens"] == 2
