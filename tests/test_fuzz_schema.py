"""Schema-driven fuzzing (issue 20): schemathesis generates requests for every operation of the real server's
/openapi.json (the seed endpoints /generate, /batch_generate, /health, /metrics, the OpenAI routes /v1/models,
/v1/completions, /v1/chat/completions, /v1/responses, Anthropic's /v1/messages, /tokenize and /detokenize) and
checks each response: never a 5xx, a declared status code, a declared content type, a body that matches the
declared schema (errors in OpenAI's shape; Anthropic's on its routes), and for invalid input a 4xx. Cases come
in three kinds per operation: schema-valid ("positive"), schema-invalid ("negative"),
and "near-valid" (positive cases with the prompt, the token budget and every sampling value they carry put in
range, so they get past validation and run in the engine with random combinations of settings).
Derandomized: the same cases every run. Afterwards the server must be whole: 0 KV blocks in use, nothing
running, /health 200, and a good request answered as before.

Checks not run, and why:
- positive_data_acceptance (a schema-valid body gets a 2xx): the schema gives the fields' types, but their
  ranges and the rules across fields (max_tokens + prompt within max_model_len, min_tokens <= max_tokens,
  n <= max_num_seqs, token ids inside the vocabulary, ...) are checked by SamplingParams and the input
  processor, so a schema-valid body can rightly get a 400 naming its problem.
- max_response_time: every request has a timeout instead (a hang fails the case).
- use_after_free, ensure_resource_availability, ignored_auth: stateful checks for APIs that create resources
  or declare security schemes; this one does neither (no --api-key on this server).
- unsupported_method runs only in schemathesis' coverage phase: test_undeclared_methods_get_405 below does it
  by hand for every path.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from fuzz_utils import SERVER_FLAGS, TIMEOUT, assert_error_shape, assert_server_whole, good_answer, wait_idle
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

EXAMPLES = {"positive": 90, "negative": 90, "near-valid": 120}  # per operation with a request body
ADMIN_EXAMPLES = {"positive": 40, "negative": 40}
MIN_CASES = 1000
VOCAB = 1024  # tiny-llama's vocabulary (make_model's preset)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def url(model_factory, serve):
    return serve(model_factory("tiny-llama"), *SERVER_FLAGS)


def test_openapi_declares_what_the_server_answers(url):
    """Every operation declares its errors in OpenAI's shape (not FastAPI's default 422 of another shape), and
    the streaming ones their text/event-stream."""
    doc = httpx.get(url + "/openapi.json", timeout=TIMEOUT).json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    paths = doc["paths"]
    assert set(paths) >= {"/generate", "/batch_generate", "/health", "/metrics", "/v1/models", "/v1/completions",
                          "/v1/chat/completions", "/v1/responses", "/v1/responses/{response_id}", "/v1/messages",
                          "/v1/messages/count_tokens", "/tokenize", "/detokenize"}
    for path, ops in paths.items():
        # Anthropic's routes answer errors in Anthropic's shape, every other route in OpenAI's
        shape = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
        for method, op in ops.items():
            for status, resp in op["responses"].items():
                if status.startswith("4"):
                    assert resp["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{shape}", \
                        (method, path, status)
            if method == "post":
                assert {"400", "413", "429", "503"} <= set(op["responses"]), (path, op["responses"])
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert "text/event-stream" in paths[path]["post"]["responses"]["200"]["content"]
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


def _text(max_size: int = 24) -> st.SearchStrategy[str]:
    plain = st.text(st.characters(codec="utf-8"), min_size=1, max_size=max_size)
    # One text in 16 holds a lone surrogate (JSON can carry "\\ud800"): the server must refuse it with a 400.
    surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    return st.one_of(*[plain] * 15, st.builds(lambda a, c, b: a + c + b, plain, surrogate, plain))


_TOKEN_IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
_ANTHROPIC_MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant"]),
    "content": st.one_of(_text(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text()}),
                                           min_size=1, max_size=2))}), min_size=1, max_size=3)
# In-range values of every sampling field: a near-valid case overwrites the ones it carries with these.
_IN_RANGE: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 40),
    "min_p": st.floats(0, 0.5), "seed": st.integers(0, 2**63 - 1), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "stop": st.one_of(_text(4), st.lists(_text(4), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3), "min_tokens": st.integers(0, 3),
    "n": st.integers(1, 3), "beam_width": st.integers(1, 3), "prompt_logprobs": st.integers(0, 3),
    "length_penalty": st.floats(-2, 2), "top_logprobs": st.integers(0, 4),
    "priority": st.one_of(st.integers(-3, 3), st.sampled_from(["interactive", "batch", "background"])),
    "ttft_slo_ms": st.floats(1, 1e5), "timeout": st.floats(10, 60),
}
# Per operation: fields always set (the prompt and a small token budget), and fields dropped (logit_bias, suffix
# and a request's own chat_template are refused whatever their value, best_of unless it equals n, and
# max_completion_tokens would replace the small max_tokens).
_REQUIRED: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "POST /generate": {"prompt": _text(), "max_new_tokens": st.integers(1, 8)},
    "POST /batch_generate": {"prompts": st.lists(_text(), min_size=1, max_size=3), "max_new_tokens": st.integers(1, 8)},
    "POST /v1/completions": {
        "prompt": st.one_of(_text(), st.lists(_text(), min_size=1, max_size=2), _TOKEN_IDS,
                            st.lists(_TOKEN_IDS, min_size=1, max_size=2)),
        "max_tokens": st.integers(1, 8), "logprobs": st.none() | st.integers(0, 4)},
    "POST /v1/chat/completions": {
        "messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["user", "system", "assistant"]),
            "content": st.one_of(_text(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text()}),
                                                   min_size=1, max_size=2))}), min_size=1, max_size=3),
        "max_tokens": st.integers(1, 8), "logprobs": st.booleans()},
    "POST /v1/responses": {"input": st.one_of(_text(), st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": _text()}), min_size=1,
        max_size=3)), "max_output_tokens": st.integers(1, 8)},
    "POST /v1/messages": {"messages": _ANTHROPIC_MESSAGES, "max_tokens": st.integers(1, 8)},
    "POST /v1/messages/count_tokens": {"messages": _ANTHROPIC_MESSAGES},
    "POST /tokenize": {"prompt": _text()},
    "POST /detokenize": {"tokens": _TOKEN_IDS},
    "POST /v1/embeddings": {"input": st.one_of(_text(), st.lists(_text(), min_size=1, max_size=3), _TOKEN_IDS,
                                               st.lists(_TOKEN_IDS, min_size=1, max_size=2))},
}
# The newer routes' cases: fewer per kind (each still reaches the engine through its near-valid cases).
NEWER_EXAMPLES = {"positive": 40, "negative": 40, "near-valid": 60}
NEWER = frozenset({"POST /v1/responses", "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /tokenize",
                   "POST /detokenize", "POST /v1/embeddings"})
_DROPPED = ("logit_bias", "suffix", "chat_template", "best_of", "max_completion_tokens")


def _near_valid(case: Any, draw: st.DrawFn, model: str) -> None:
    body = case.body
    for key in _DROPPED:
        body.pop(key, None)
    for key, strategy in _REQUIRED.get(case.operation.label, {}).items():
        body[key] = draw(strategy)
    for key, strategy in _IN_RANGE.items():
        if body.get(key) is not None:
            body[key] = draw(strategy)
    if "model" in body:
        body["model"] = model


def _strategy(op: Any, kind: str, model: str) -> st.SearchStrategy[Any]:
    if kind != "near-valid":
        return op.as_strategy(generation_mode=GenerationMode(kind))

    @st.composite
    def near_valid(draw: st.DrawFn) -> Any:
        case = draw(op.as_strategy(generation_mode=GenerationMode.POSITIVE))
        if isinstance(case.body, dict):
            _near_valid(case, draw, model)
        return case

    return near_valid()


def _own_timeout(response: Any) -> bool:
    try:
        return response.json()["error"]["param"] == "timeout"
    except (ValueError, KeyError, TypeError):
        return False


class _Run:
    """Counts and failures of a fuzzing run."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.statuses: collections.Counter[int | str] = collections.Counter()
        self.failures: list[str] = []
        self.session = requests.Session()

    def fuzz(self, op: Any, kind: str, examples: int, model: str) -> None:
        """`examples` cases of one kind for one operation, each sent (with a timeout) and checked."""
        checks = CHECKS + [negative_data_rejection] if kind == "negative" else CHECKS

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=_strategy(op, kind, model))
        def run(case: Any) -> None:
            self.counts[op.label, kind] += 1
            try:
                response = case.call(session=self.session, timeout=TIMEOUT)
            except requests.RequestException as e:  # a timeout (hang) or a dropped connection
                self.failures.append(f"{op.label} [{kind}] {case.body!r:.300}: no response: {e!r}")
                return
            status = response.status_code
            here = checks
            if status == 503 and _own_timeout(response):
                # The request's own `timeout` (any positive float: schemathesis draws ~1e-11 s) expired before it
                # started: the declared 503 of that field, not a server fault; the other checks still apply.
                status, here = "503 (its own timeout)", [c for c in checks if c is not not_a_server_error]
            self.statuses[status] += 1
            try:
                case.validate_response(response, checks=here)
            except FailureGroup as e:
                self.failures.append(f"{op.label} [{kind}]: {e}"[:3000])

        run()


def test_schemathesis_fuzz(url, capsys):
    expected = good_answer(url)
    model = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"GET /health", "GET /metrics", "POST /generate", "POST /batch_generate",
                                               "GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions"}
    fuzz = _Run()
    t0 = time.monotonic()
    for op in operations:
        has_input = bool(op.body) or any(True for _ in op.iter_parameters())
        # An operation without a body or parameters has exactly one request (and none that is schema-invalid).
        # Generation routes get every kind; the LoRA admin routes (refused here: the server runs without LoRA)
        # fewer, and no near-valid cases, which only make sense for a request that reaches the engine.
        kinds = NEWER_EXAMPLES if op.label in NEWER else EXAMPLES if op.label in _REQUIRED else ADMIN_EXAMPLES
        if "{response_id}" in op.label:  # any string is a valid id (unknown: 404): there is no schema-invalid case
            kinds = {"positive": 20}
        for kind, examples in (kinds if has_input else {"positive": 1}).items():
            fuzz.fuzz(op, kind, examples, model)
    counts, statuses, failures = fuzz.counts, fuzz.statuses, fuzz.failures
    total = sum(counts.values())
    with capsys.disabled():
        print(f"\nschemathesis: {total} cases in {time.monotonic() - t0:.1f} s; "
              f"statuses {dict(sorted(statuses.items(), key=str))}")
        for (label, kind), n in sorted(counts.items()):
            print(f"  {label:28} {kind:10} {n}")
    assert not failures, f"{len(failures)} failing cases; the first ones:\n\n" + "\n\n".join(failures[:5])
    assert total >= MIN_CASES, counts
    assert not any(isinstance(s, int) and s >= 500 for s in statuses), statuses
    assert statuses[200] >= 100, statuses  # the near-valid cases do reach the engine
    assert_server_whole(url, expected)


def test_schemathesis_fuzz_embeddings(model_factory, serve):
    """/v1/embeddings on a --runner pooling server: schema-valid, schema-invalid and near-valid bodies (inputs that
    reach the engine), never a 5xx, every answer as declared; afterwards nothing held, and the same input embeds
    as before."""
    url = serve(model_factory("tiny-llama"), *SERVER_FLAGS, "--runner", "pooling")
    good = {"input": "def fibonacci(n):", "encoding_format": "float"}
    before = httpx.post(url + "/v1/embeddings", json=good, timeout=TIMEOUT).json()["data"][0]["embedding"]
    model = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    (op,) = [r.ok() for r in schema.get_all_operations() if r.ok().label == "POST /v1/embeddings"]
    fuzz = _Run()
    for kind, examples in NEWER_EXAMPLES.items():
        fuzz.fuzz(op, kind, examples, model)
    assert not fuzz.failures, f"{len(fuzz.failures)} failing cases; the first ones:\n\n" + "\n\n".join(
        fuzz.failures[:5])
    assert not any(isinstance(s, int) and s >= 500 for s in fuzz.statuses), fuzz.statuses
    assert fuzz.statuses[200] >= 30, fuzz.statuses  # the near-valid cases do reach the engine
    m = wait_idle(url, timeout=TIMEOUT)
    assert m["minivllm:kv_cache_usage_perc"] == 0 and m["minivllm:num_requests_running"] == 0
    after = httpx.post(url + "/v1/embeddings", json=good, timeout=TIMEOUT).json()["data"][0]["embedding"]
    assert after == before


def test_undeclared_methods_get_405(url):
    """What schemathesis' unsupported_method check does in its coverage phase: a method a path does not declare
    gets 405 in OpenAI's error shape, with an Allow header naming the declared ones (RFC 9110)."""
    paths = httpx.get(url + "/openapi.json", timeout=TIMEOUT).json()["paths"]
    n = 0
    for path, ops in paths.items():
        declared = {m.upper() for m in ops}
        for method in {"GET", "POST", "PUT", "PATCH", "DELETE"} - declared:
            r = httpx.request(method, url + path, timeout=TIMEOUT)
            assert r.status_code == 405, (method, path, r.status_code, r.text)
            assert set(r.headers["allow"].replace(" ", "").split(",")) >= declared, (method, path, r.headers)
            if path.startswith("/v1/messages"):  # Anthropic's shape on its routes
                body = r.json()
                assert body["type"] == "error" and method in body["error"]["message"], body
            else:
                assert method in assert_error_shape(r.json(), 405)
            n += 1
    assert n >= 20
