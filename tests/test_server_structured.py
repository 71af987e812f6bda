"""Structured outputs and tool calls through a real server: the official `openai` client's response_format and
tools paths (streamed and not), vLLM's guided_* and structured_outputs fields, /generate, WebSocket and gRPC, and
400s naming the problem."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pytest
from server_utils import ServerProcess, free_port

from minivllm.entrypoints.proto import inference_pb2 as pb
from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc

SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string", "maxLength": 16}, "year": {"type": "integer", "minimum": 1900,
                                                                                "maximum": 2030},
                         "genre": {"enum": ["drama", "comedy", "horror"]},
                         "cast": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
                             "type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                              "lead": {"type": "boolean"}},
                             "required": ["name", "lead"], "additionalProperties": False}}},
          "required": ["title", "year", "genre", "cast"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
HERMES = r'Sure\. <tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]{1,3}, "b": [0-9]{1,3}\}\}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(model_factory):
    port = free_port()
    proc = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--grpc-port", str(port),
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    proc.grpc_target = f"127.0.0.1:{port}"
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _stream_text(stream) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def test_response_format_json_schema_streamed_and_not(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt, temperature=1.0, n=4,
                                       seed=3, max_tokens=150)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    text, reason = _stream_text(client.chat.completions.create(
        model=model, messages=MESSAGES, response_format=fmt, temperature=1.0, seed=4, max_tokens=150, stream=True))
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    # The SDK's parse helper: a pydantic model → json_schema, and the reply parsed back into it.
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=10)
        legs: int = Field(ge=0, le=8)

    parsed = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pet, temperature=0.0,
                                           max_tokens=150).choices[0].message
    assert isinstance(parsed.parsed, Pet) and Pet.model_validate_json(parsed.content) == parsed.parsed


def test_response_format_json_object(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, response_format={"type": "json_object"},
                                       temperature=1.0, seed=5, max_tokens=200, n=3)
    for c in r.choices:
        assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)
    assert any(c.finish_reason == "stop" for c in r.choices)


def test_vllm_guided_fields_on_completions(client, model):
    regex = r"[a-z]{2,8}@[a-z]{2,8}\.(com|net)"
    r = client.completions.create(model=model, prompt="email: ", max_tokens=40, temperature=1.0, n=4, seed=1,
                                  extra_body={"guided_regex": regex})
    assert all(re.fullmatch(regex, c.text) for c in r.choices), [c.text for c in r.choices]
    chunks = client.completions.create(model=model, prompt="mood: ", max_tokens=10, temperature=1.0, stream=True,
                                       extra_body={"guided_choice": ["happy", "sad"]})
    assert "".join(c.choices[0].text for c in chunks if c.choices) in ("happy", "sad")
    r = client.completions.create(model=model, prompt="x", max_tokens=120, temperature=1.0, seed=2,
                                  extra_body={"guided_json": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=model, prompt="x", max_tokens=20, temperature=1.0,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "v" [0-9] "." [0-9]'}})
    assert re.fullmatch(r"v[0-9]\.[0-9]", r.choices[0].text)


def test_generate_websocket_and_grpc_take_guided_fields(server):
    r = httpx.post(server.url + "/generate", json={"prompt": "x", "max_new_tokens": 120, "temperature": 1.0,
                                                   "guided_json": SCHEMA}, timeout=120).json()
    jsonschema.validate(json.loads(r["generated_text"]), SCHEMA)
    from websockets.sync.client import connect

    with connect(server.url.replace("http", "ws") + "/ws/generate") as ws:
        ws.send(json.dumps({"prompt": "x", "max_new_tokens": 10, "guided_choice": ["alpha", "beta"]}))
        text, msg = "", {}
        while "finish_reason" not in msg or msg.get("finish_reason") is None:
            msg = json.loads(ws.recv())
            text += msg.get("text", "")
    assert text in ("alpha", "beta")
    with grpc.insecure_channel(server.grpc_target) as ch:
        stub = pb_grpc.InferenceServiceStub(ch)
        out = stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=30, temperature=1.0,
                                               guided_regex=r"[0-9]{3}-[0-9]{4}"), timeout=60)
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.generated_text)
        out = stub.Generate(pb.GenerateRequest(prompt="x", max_new_tokens=120, temperature=1.0,
                                               guided_json=json.dumps(SCHEMA)), timeout=60)
        jsonschema.validate(json.loads(out.generated_text), SCHEMA)
        batch = stub.BatchGenerate(pb.BatchGenerateRequest(prompts=["a", "b"], max_new_tokens=60, temperature=1.0,
                                                           guided_json_object=True), timeout=60)
        for r in batch.results:  # any JSON object: keys are free text, so a long one may meet max_new_tokens
            assert r.generated_text.startswith("{")
            assert r.finish_reason == "length" or isinstance(json.loads(r.generated_text), dict)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt="x", guided_regex="(abc"), timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "guided_regex" in e.value.details()


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_named_tool_choice_streamed_and_not(client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       temperature=1.0, n=3, seed=7, max_tokens=80)
    for c in r.choices:
        assert c.finish_reason == "stop" and c.message.content is None  # OpenAI's for a forced function
        ((name, args),) = _calls(c.message)
        assert name == "get_weather" and c.message.tool_calls[0].id.startswith("call_")
        jsonschema.validate(args, WEATHER)
    calls: dict[int, dict] = {}
    reason = None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                temperature=1.0, seed=8, max_tokens=80, stream=True):
        for c in chunk.choices:
            reason = c.finish_reason or reason
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": None, "arguments": "", "id": None})
                entry["name"] = tc.function.name or entry["name"]
                entry["id"] = tc.id or entry["id"]
                entry["arguments"] += tc.function.arguments or ""
    assert reason == "stop" and list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_required_tool_choice_streamed_and_not(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, n=4, seed=9, max_tokens=150)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        found = _calls(c.message)
        assert found
        for name, args in found:
            jsonschema.validate(args, SCHEMAS[name])
    one = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=1.0, seed=10, max_tokens=150)
    assert len(one.choices[0].message.tool_calls) == 1
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                 temperature=1.0, seed=11, max_tokens=150, stream=True))
    deltas = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
    for d in deltas:
        jsonschema.validate(json.loads(d.function.arguments), SCHEMAS[d.function.name])
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


def test_auto_tool_choice_reads_hermes_calls(client, model):
    """tool_choice auto: the reply's <tool_call> blocks become tool_calls and the rest stays content (the random
    model is steered into writing one with a regex, so the parser sees a real generated reply)."""
    r = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=12,
                                       max_tokens=80, extra_body={"guided_regex": HERMES})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    ((name, args),) = _calls(c.message)
    assert name == "add" and set(args) == {"a", "b"}
    content, deltas, reasons = "", [], []
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                                seed=12, max_tokens=80, stream=True,
                                                extra_body={"guided_regex": HERMES}):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            deltas += ch.delta.tool_calls or []
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert content.strip() == "Sure." and "<tool" not in content and reasons == ["tool_calls"]
    assert len(deltas) == 1 and json.loads(deltas[0].function.arguments) == args  # same seed, same call
    plain = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0.0,
                                           max_tokens=8)
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].finish_reason in ("stop", "length")


def test_tool_results_in_the_history_render(client, model):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       temperature=0.0)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens > 20


def test_auto_needs_the_server_flags(model_factory, serve):
    url = serve(model_factory("tiny-llama"))  # no --enable-auto-tool-choice
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS}, timeout=60)
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 150,
                                                        "tool_choice": "required", "parallel_tool_calls": False},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"]


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"guided_json": {"type": "strung"}}, "guided_json", "Invalid type: strung"),
    ("/v1/completions", {"guided_json": {"properties": {"a": {"$ref": "#/nope"}}}}, "guided_json", "nope"),
    ("/v1/completions", {"guided_regex": "(abc"}, "guided_regex", "unclosed group"),
    ("/v1/completions", {"guided_regex": "a(?=b)"}, "guided_regex", "guided_regex"),
    ("/v1/completions", {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("/v1/completions", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one guided-decoding"),
    ("/v1/completions", {"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "llguidance"),
    ("/v1/completions", {"guided_json": 5}, "guided_json", "guided_json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema object"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not among tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "unique"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "already constrained"),
    ("/v1/chat/completions", {"use_beam_search": True, "n": 2, "response_format": {"type": "json_object"}},
     "guided_decoding", "use_beam_search"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "bogus"}}}}}], "tool_choice": "required"},
     "guided_json", "bogus"),
])
def test_bad_constraints_are_400_naming_the_field(server, path, body, param, message):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES}
    r = httpx.post(server.url + path, json={**base, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_logprobs_of_masked_tokens_are_finite(client, model):
    """A choice of one token leaves every alternative masked (-inf): reported as -9999.0, vLLM's floor, since JSON
    has no infinity (the fuzzer found this as a 500)."""
    r = client.completions.create(model=model, prompt="x", max_tokens=5, logprobs=3, temperature=1.0,
                                  extra_body={"guided_choice": ["a"]})
    top = r.choices[0].logprobs.top_logprobs[0]
    assert r.choices[0].text == "a" and len(top) == 3 and min(top.values()) == -9999.0
