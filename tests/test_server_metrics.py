"""/metrics parses with prometheus_client's parser, carries every name of SPEC §6, and its counters
move by exactly the right amounts after a known workload."""

from __future__ import annotations

import random

import httpx
import pytest
from server_utils import metrics, wait_idle

SPEC_NAMES = [
    "inference_requests_total", "inference_tokens_generated_total", "inference_request_latency_seconds_bucket",
    "minivllm:num_requests_running", "minivllm:num_requests_waiting", "minivllm:kv_cache_usage_perc",
    "minivllm:prompt_tokens_total", "minivllm:generation_tokens_total", "minivllm:num_preemptions_total",
    "minivllm:request_success_total", "minivllm:prefix_cache_queries_total", "minivllm:prefix_cache_hits_total",
    "minivllm:time_to_first_token_seconds_bucket", "minivllm:inter_token_latency_seconds_bucket",
    "minivllm:e2e_request_latency_seconds_bucket", "minivllm:request_queue_time_seconds_bucket",
    "minivllm:iteration_tokens_total_bucket",
]


@pytest.fixture(scope="module")
def url(model_factory, serve):
    return serve(model_factory("tiny-llama"))


def test_every_spec_name_present(url):
    names = {k.split("{")[0] for k in metrics(url)}
    missing = [n for n in SPEC_NAMES if n not in names]
    assert not missing, missing
    assert httpx.post(url + "/generate", json={"prompt": "hello", "max_new_tokens": 2}, timeout=60).status_code == 200
    text = httpx.get(url + "/metrics").text
    # The seed's request-latency histogram, per endpoint, with its 0.1…50 s buckets.
    for le in ("0.1", "50.0"):
        assert f'inference_request_latency_seconds_bucket{{endpoint="/generate",le="{le}"}}' in text, le


def test_counters_move_by_the_right_amounts(url):
    wait_idle(url)
    before = metrics(url)
    rng = random.Random(7)
    # Token-id prompts of known lengths, random so nothing hits the prefix cache; 5 tokens each.
    lengths = [20, 33, 47]
    prompts = [[rng.randrange(300, 1000) for _ in range(n)] for n in lengths]
    for p in prompts:
        r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 5, "ignore_eos": True,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": len(p), "completion_tokens": 5, "total_tokens": len(p) + 5}
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "temperature": -5})
    assert r.status_code == 400
    after = wait_idle(url)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    total = sum(lengths)
    assert d['inference_requests_total{endpoint="/v1/completions",status="success"}'] == 3
    assert d['inference_requests_total{endpoint="/v1/completions",status="client_error"}'] == 1
    assert d['inference_request_latency_seconds_count{endpoint="/v1/completions"}'] == 4
    assert d["inference_tokens_generated_total"] == 15
    assert d["minivllm:generation_tokens_total"] == 15
    assert d["minivllm:prompt_tokens_total"] == total
    assert d['minivllm:request_success_total{finished_reason="length"}'] == 3
    assert d['minivllm:request_success_total{finished_reason="stop"}'] == 0
    assert d["minivllm:time_to_first_token_seconds_count"] == 3
    assert d["minivllm:inter_token_latency_seconds_count"] == 3 * 4
    assert d["minivllm:e2e_request_latency_seconds_count"] == 3
    assert d["minivllm:request_queue_time_seconds_count"] == 3
    assert d["minivllm:prefix_cache_queries_total"] == total
    assert d["minivllm:prefix_cache_hits_total"] == 0
    # Forward tokens: each prompt once, then the 4 generated tokens that are fed back, per request.
    assert d["minivllm:iteration_tokens_total_sum"] == total + 3 * 4
    assert d["minivllm:iteration_tokens_total_count"] == 3 * 5
    assert d["minivllm:num_preemptions_total"] == 0
    # TTFT is measured from arrival, so it is at least the queue time plus the prefill; e2e covers both.
    assert 0 < d["minivllm:time_to_first_token_seconds_sum"] <= d["minivllm:e2e_request_latency_seconds_sum"]


def test_prefix_cache_hits_counted(url):
    wait_idle(url)
    before = metrics(url)
    prompt = [random.Random(11).randrange(300, 1000) for _ in range(40)]  # 2 full blocks of 16 + 8
    for _ in range(2):
        httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    d = {k: v - before.get(k, 0.0) for k, v in wait_idle(url).items()}
    assert d["minivllm:prefix_cache_queries_total"] == 80
    assert d["minivllm:prefix_cache_hits_total"] == 32  # the second request reuses both full blocks
