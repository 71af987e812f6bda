"""The APIs agents and tools speak beside chat completions, on a real server with the official clients: /tokenize
and /detokenize (vLLM's shapes), OpenAI's Responses API (`openai` client: responses.create whole and streamed, the
stream helper, a function-tool round trip, previous_response_id and store, text.format) and Anthropic's Messages
API (`anthropic` client: messages.create, messages.stream, a tool_use / tool_result round trip, count_tokens,
x-api-key, errors in Anthropic's shape). Each translation is checked against the chat pipeline it shares: the same
conversation gives the same prompt tokens as /tokenize's and the same greedy reply as /v1/chat/completions'."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import make_scripted_model
from server_utils import ServerProcess

from minivllm.engine.tokenizer import get_tokenizer
from minivllm.entrypoints.chat_utils import chat_prompt

KEY = "sk-agent-test"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": WEATHER}}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(model_factory):
    proc = ServerProcess(model_factory("tiny-llama"), "--num-threads", "1", "--api-key", KEY,
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def _post(server, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def _count(server, messages: list[dict], tools: list[dict] | None = None) -> int:
    """The prompt tokens of a chat-completions conversation, by /tokenize."""
    r = _post(server, "/tokenize", {"messages": messages, **({"tools": tools} if tools else {})})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _called(call_id: str, name: str, arguments: str) -> dict:
    """An assistant turn that made one call, as /v1/chat/completions takes it."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def _greedy_chat(oai, model, messages: list[dict], max_tokens: int) -> str:
    return oai.chat.completions.create(model=model, messages=messages, temperature=0,
                                       max_tokens=max_tokens).choices[0].message.content


# ---- /tokenize, /detokenize ------------------------------------------------------------------------------
def test_tokenize_and_detokenize(server, model_factory):
    tok = get_tokenizer(model_factory("tiny-llama"))
    r = _post(server, "/tokenize", {"prompt": "def fibonacci(n):", "return_token_strs": True}).json()
    ids = tok.encode("def fibonacci(n):")
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] > 0
    assert r["token_strs"] == tok.convert_ids_to_tokens(ids)
    raw = _post(server, "/tokenize", {"prompt": "def fibonacci(n):", "add_special_tokens": False}).json()
    assert raw["tokens"] == tok.encode("def fibonacci(n):", add_special_tokens=False) and raw["token_strs"] is None
    messages = [{"role": "user", "content": QUESTION}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == chat_prompt(tok, messages)["prompt_token_ids"]
    with_tools = _post(server, "/tokenize", {"messages": messages, "tools": CHAT_TOOLS}).json()
    assert with_tools["count"] > chat["count"]  # the template shows the tools
    back = _post(server, "/detokenize", {"tokens": ids}).json()
    assert back["prompt"] == tok.decode(ids)
    for path, body, words in [("/tokenize", {}, "exactly one of prompt"),
                              ("/tokenize", {"prompt": "x", "messages": messages}, "exactly one of prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/detokenize", {"tokens": [1, 10**9]}, "position 1"),
                              ("/detokenize", {"tokens": [1, -2]}, "position 1"),
                              ("/tokenize", {"prompt": "x", "model": "nope"}, "does not exist")]:
        r = _post(server, path, body)
        assert 400 <= r.status_code < 500 and words in r.json()["error"]["message"], (body, r.text)
    assert _post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401  # behind the key, unlike vLLM
    r = _post(server, "/v1/embeddings", {"input": "x"})  # a generating server: embeddings need --runner pooling
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]


# ---- OpenAI Responses ------------------------------------------------------------------------------------
def test_responses_text_whole_streamed_and_chained(server, oai, model):
    r = oai.responses.create(model=model, input=QUESTION, instructions="Answer briefly.", max_output_tokens=12,
                             temperature=0)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text == _greedy_chat(oai, model, messages, 12)
    assert r.usage.input_tokens == _count(server, messages)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(oai.responses.create(model=model, input=QUESTION, instructions="Answer briefly.",
                                       max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    # The next turn continues the stored conversation; instructions are not carried over.
    follow = oai.responses.create(model=model, input="And in Rome?", previous_response_id=r.id, max_output_tokens=8,
                                  temperature=0)
    chained = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": r.output_text},
               {"role": "user", "content": "And in Rome?"}]
    assert follow.usage.input_tokens == _count(server, chained)
    assert follow.output_text == _greedy_chat(oai, model, chained, 8)
    assert oai.responses.retrieve(r.id).output_text == r.output_text
    # store false keeps nothing; a deleted response is gone
    unstored = oai.responses.create(model=model, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="no stored response"):
        oai.responses.create(model=model, input="x", previous_response_id=unstored.id, max_output_tokens=2)
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


def test_responses_function_tool_round_trip(server, oai, model):
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": WEATHER, "strict": True}]
    r = oai.responses.create(model=model, input=QUESTION, tools=tools, tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # Streamed, the same call arrives as argument deltas.
    events = list(oai.responses.create(model=model, input=QUESTION, tools=tools, tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=60, temperature=0, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(call.arguments)
    done = [e for e in events if e.type == "response.output_item.done"]
    assert len(done) == 1 and done[0].item.name == "get_weather" and done[0].item.arguments == args
    # The function's output goes back, by previous_response_id or as explicit items: the same prompt either way,
    # and the one chat completions renders for the same conversation.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    chained = oai.responses.create(model=model, previous_response_id=r.id, input=[output], tools=tools,
                                   tool_choice="none", max_output_tokens=8, temperature=0)
    explicit = oai.responses.create(model=model, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, output],
        tools=tools, tool_choice="none", max_output_tokens=8, temperature=0, store=False)
    chat = [{"role": "user", "content": QUESTION},
            _called(call.call_id, call.name, call.arguments),
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]
    # (tool_choice none hides the tools from the template, as on /v1/chat/completions)
    assert chained.usage.input_tokens == explicit.usage.input_tokens == _count(server, chat)
    assert chained.output_text == explicit.output_text
    named = oai.responses.create(model=model, input=QUESTION, tools=tools,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    jsonschema.validate(json.loads(named.output[0].arguments), WEATHER)


def test_responses_text_format_and_bad_input(oai, model):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    r = oai.responses.create(model=model, input=QUESTION, text={"format": fmt}, max_output_tokens=60, temperature=1.0)
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    with oai.responses.stream(model=model, input=QUESTION, text={"format": fmt}, max_output_tokens=60) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), WEATHER)
    cases = [({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
             ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
             ({"input": "x", "max_output_tokens": -1}, "max_tokens"),
             ({"input": "x", "temperature": "hot"}, "temperature"),
             ({"input": "x", "tool_choice": "required"}, "tool_choice")]
    for extra, words in cases:
        with pytest.raises(openai.BadRequestError, match=words):
            oai.responses.create(model=model, **extra)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.responses.create(model="nope", input="x")


# ---- Anthropic Messages ----------------------------------------------------------------------------------
GREEDY = {"temperature": 0}  # (Anthropic's client no longer names sampling fields: local servers read them)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_anthropic_messages_whole_and_streamed(server, oai, claude, model):
    m = claude.messages.create(model=model, max_tokens=12, system="Answer briefly.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": QUESTION}])
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    assert m.type == "message" and m.role == "assistant" and m.model == model
    assert _text(m) == _greedy_chat(oai, model, messages, 12)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens == _count(server, messages)
    assert m.usage.output_tokens <= 12
    with claude.messages.stream(model=model, max_tokens=12, system="Answer briefly.", extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(m) == _text(final) and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    # stop_sequences: the reply stops at the first one and says which
    stop = _text(m)[3:5] if len(_text(m)) > 5 else None
    if stop and stop.strip():
        cut = claude.messages.create(model=model, max_tokens=12, system="Answer briefly.", extra_body=GREEDY,
                                     messages=[{"role": "user", "content": QUESTION}], stop_sequences=[stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop and stop not in _text(cut)
    counted = claude.messages.count_tokens(model=model, system="Answer briefly.",
                                           messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == m.usage.input_tokens


def test_anthropic_tool_round_trip(server, oai, claude, model):
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": QUESTION}]
    m = claude.messages.create(model=model, max_tokens=60, extra_body=GREEDY, messages=ask, tools=tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (use,) = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with claude.messages.stream(model=model, max_tokens=60, extra_body=GREEDY, messages=ask, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        streamed = stream.get_final_message()
    (named,) = streamed.content
    assert named.type == "tool_use" and streamed.stop_reason == "tool_use"
    jsonschema.validate(named.input, WEATHER)
    # The result goes back as a tool_result block: the prompt is the one chat completions renders for it.
    turn = [*ask, {"role": "assistant", "content": m.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}]}]
    reply = claude.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=turn, tools=tools,
                                   tool_choice={"type": "none"})
    chat = [*ask, _called(use.id, use.name, json.dumps(use.input)),
            {"role": "tool", "tool_call_id": use.id, "content": "21 C, sunny"}]
    assert reply.usage.input_tokens == _count(server, chat)  # tool_choice none: the template is not shown them
    assert claude.messages.count_tokens(model=model, messages=turn, tools=tools,
                                        tool_choice={"type": "none"}).input_tokens == reply.usage.input_tokens
    # without tool_choice none the tools are shown, and counted
    assert claude.messages.count_tokens(model=model, messages=turn, tools=tools).input_tokens == \
        _count(server, chat, CHAT_TOOLS)
    assert all(b.type == "text" for b in reply.content)
    # output_config.format: Anthropic's structured outputs, as a constraint
    fmt = {"format": {"type": "json_schema", "schema": WEATHER}}
    out = claude.messages.create(model=model, max_tokens=60, messages=ask, extra_body={"output_config": fmt})
    jsonschema.validate(json.loads(_text(out)), WEATHER)


def test_anthropic_errors_and_key(server, claude, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AA=="}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "image blocks are not supported" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model=model, max_tokens=10**9, messages=[{"role": "user", "content": "hi"}])
    anonymous = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        anonymous.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   json={"model": model, "max_tokens": "8", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


# ---- thinking models -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinker(model_factory, tmp_path_factory):
    """tiny-qwen3 scripted to answer QUESTION with a thinking block, served with --reasoning-parser qwen3."""
    base = model_factory("tiny-qwen3")
    tok = get_tokenizer(base)
    prompt = chat_prompt(tok, [{"role": "user", "content": "Add two and two."}])["prompt_token_ids"]
    pieces = ["<think>", "Let me add", "</think>", "It is four."]
    chain = [prompt[-1]] + [t for p in pieces for t in tok.encode(p, add_special_tokens=False)] + [tok.eos_token_id]
    path = make_scripted_model(base, str(tmp_path_factory.mktemp("agent-think") / "m"), chain)
    proc = ServerProcess(path, "--num-threads", "1", "--reasoning-parser", "qwen3")
    yield proc
    proc.stop()


def test_thinking_becomes_reasoning_items_and_thinking_blocks(thinker):
    oai = openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    name = oai.models.list().data[0].id
    r = oai.responses.create(model=name, input="Add two and two.", max_output_tokens=30, temperature=0)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text.strip() == "Let me add" and r.output_text.strip() == "It is four."
    events = list(oai.responses.create(model=name, input="Add two and two.", max_output_tokens=30, temperature=0,
                                       stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought.strip() == "Let me add" and events[-1].response.output_text.strip() == "It is four."
    claude = anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0, timeout=120)
    m = claude.messages.create(model=name, max_tokens=30, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Add two and two."}])
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    assert m.content[0].thinking.strip() == "Let me add" and m.content[1].text.strip() == "It is four."
    with claude.messages.stream(model=m.model, max_tokens=30, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Add two and two."}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == m.content[0].thinking and final.content[1].text == m.content[1].text
