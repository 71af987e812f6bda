"""Shared by the fuzzing suites (test_fuzz_schema.py, test_fuzz_inputs.py): the server's small limits, a timeout
on every call, and the check that a fuzzed server is still whole (nothing running, no KV block in use, /health
200, and a good request answered exactly as before the fuzzing)."""

from __future__ import annotations

import httpx
from server_utils import wait_idle

MAX_MODEL_LEN = 64
# Small limits keep every generation short (a prompt and its tokens fit in 64), so thousands of cases run in a
# minute or two on two cores.
SERVER_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--kv-cache-memory", "16MiB")
TIMEOUT = 30.0  # seconds, for every request a fuzz test sends: a hang is a failure, not a stuck test
GOOD = {"prompt": "def fibonacci(n):", "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def good_answer(url: str) -> str:
    """A greedy /generate (the same text every time on a healthy server)."""
    r = httpx.post(url + "/generate", json=GOOD, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens_generated"] == GOOD["max_new_tokens"] and body["finish_reason"] == "length", body
    return body["generated_text"]


def assert_server_whole(url: str, expected_text: str) -> None:
    """After fuzzing: idle (0 KV blocks in use, nothing running or waiting), /health 200, and a good request
    still gets the greedy answer it got before."""
    m = wait_idle(url, timeout=TIMEOUT)
    assert m["minivllm:kv_cache_usage_perc"] == 0 and m["minivllm:num_requests_running"] == 0
    assert m["minivllm:num_requests_waiting"] == 0
    health = httpx.get(url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
    assert good_answer(url) == expected_text
    assert wait_idle(url, timeout=TIMEOUT)["minivllm:kv_cache_usage_perc"] == 0


def assert_error_shape(body: object, status: int) -> str:
    """An OpenAI-shaped error body of this status with a non-empty message; returns the message."""
    assert isinstance(body, dict) and set(body) >= {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    return err["message"]
