"""Thinking models and tool-call formats through a real server and the official openai client: --reasoning-parser
qwen3 / deepseek_r1 put the thinking in reasoning_content (and reasoning) and the answer in content, whole and
streamed, also when </think> arrives split across tokens; guided decoding (and so forced tool calls) constrains
the answer only; chat_template_kwargs reach the template (Qwen3's enable_thinking); --tool-call-parser
llama3_json / mistral / pythonic read calls with per-call indexes and JSON-string arguments, streamed and whole;
malformed calls stay content.

The replies come from scripted models (conftest.make_scripted_model: a real model whose greedy continuation of
each token is the next one of a chain) or from a random model steered by a guided regex."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import make_scripted_model
from server_utils import ServerProcess

from minivllm import LLM, GuidedDecodingParams, SamplingParams
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.entrypoints.chat_utils import chat_prompt

QUESTION = [{"role": "user", "content": "What is two and two?"}]
SMALL = ("--num-threads", "1", "--kv-cache-memory", "64MiB")  # servers of tiny models need no 2 GiB KV pool


def _script(tok, prompt_messages, pieces: list[str], **template_kwargs) -> list[int]:
    """The chain: the prompt's last token, then each piece's tokens (encoded piece by piece, so the test decides
    where tokens split), then EOS."""
    prompt = chat_prompt(tok, prompt_messages, template_kwargs=template_kwargs)["prompt_token_ids"]
    chain = [prompt[-1]] + [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]
    chain.append(tok.eos_token_id)
    assert len(set(chain)) == len(chain), [tok.decode([t]) for t in chain]
    return chain


@pytest.fixture(scope="module")
def qwen3_thinker(model_factory, tmp_path_factory):
    """tiny-qwen3 (its <think> tokens are plain added tokens, as Qwen3's) answering with a thinking block."""
    base = model_factory("tiny-qwen3")
    tok = get_tokenizer(base)
    chain = _script(tok, QUESTION, ["<think>", "Let me add", "</think>", "It is four."])
    return make_scripted_model(base, str(tmp_path_factory.mktemp("qwen3-think") / "m"), chain)


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(client: openai.OpenAI, **kw) -> tuple[str, str, list, str | None]:
    """(reasoning, content, tool-call deltas, finish reason) of a streamed chat completion."""
    reasoning, content, calls, reason = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            reasoning += extra.get("reasoning_content") or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    return reasoning, content, calls, reason


def test_qwen3_reasoning_whole_and_streamed(qwen3_thinker, serve):
    server = ServerProcess(qwen3_thinker, *SMALL, "--reasoning-parser", "qwen3")
    try:
        client = _client(server)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32, temperature=0.0)
        msg = r.choices[0].message
        assert msg.content == "It is four." and r.choices[0].finish_reason == "stop"
        assert msg.model_extra["reasoning_content"] == "Let me add" == msg.model_extra["reasoning"]
        assert _streamed(client, model=model, messages=QUESTION, max_tokens=32, temperature=0.0) == (
            "Let me add", "It is four.", [], "stop")
        # enable_thinking=false reaches the template: an empty thinking block closes the prompt (more tokens).
        off = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, temperature=0.0,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.usage.prompt_tokens > r.usage.prompt_tokens
        bad = httpx_post(server, {"model": model, "messages": QUESTION, "chat_template_kwargs": {"tools": []}})
        assert bad.status_code == 400 and "chat_template_kwargs" in bad.json()["error"]["message"]
    finally:
        server.stop()


def httpx_post(server: ServerProcess, body: dict):
    import httpx

    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def test_deepseek_r1_think_end_split_across_tokens(model_factory, tmp_path_factory):
    """tiny-llama's tokenizer has no <think> token: "</think>" arrives as five tokens, streamed one by one."""
    base = model_factory("tiny-llama")
    tok = get_tokenizer(base)
    end = [tok.decode([t]) for t in tok.encode("</think>", add_special_tokens=False)]
    assert len(end) >= 3  # really split
    chain = _script(tok, QUESTION, ["Plus", *end, "Yes!"])
    path = make_scripted_model(base, str(tmp_path_factory.mktemp("r1") / "m"), chain)
    server = ServerProcess(path, *SMALL, "--reasoning-parser", "deepseek_r1")
    try:
        client = _client(server)
        model = client.models.list().data[0].id
        msg = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=32,
                                             temperature=0.0).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == ("Plus", "Yes!")
        reasoning, content, _, reason = _streamed(client, model=model, messages=QUESTION, max_tokens=32,
                                                  temperature=0.0)
        assert (reasoning, content, reason) == ("Plus", "Yes!", "stop")
        assert "<" not in reasoning + content  # no piece of the tag leaked into either
    finally:
        server.stop()


def test_guided_decoding_constrains_the_answer_only(qwen3_thinker):
    """The thinking is free (its tokens are nothing the grammar allows), the answer after </think> is one of the
    choices; with the thinking closed in the prompt the grammar applies from the first token."""
    llm = LLM(qwen3_thinker, num_kv_blocks=64, reasoning_parser="qwen3")
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=24, guided_decoding=GuidedDecodingParams(
        choice=["yes", "no"]))
    prompt = chat_prompt(tok, QUESTION)
    text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith("<think>Let me add</think>") and text.removeprefix("<think>Let me add</think>") in (
        "yes", "no"), text
    closed = chat_prompt(tok, QUESTION, template_kwargs={"enable_thinking": False})
    assert "</think>" in closed["prompt"]
    assert llm.generate([closed], params, use_tqdm=False)[0].outputs[0].text in ("yes", "no")
    # Without a reasoning parser the grammar starts at once, so the model cannot think at all.
    plain = LLM(qwen3_thinker, num_kv_blocks=64)
    assert plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_tool_call_after_thinking_is_read_from_the_answer(qwen3_thinker):
    """Thinking, then (guided into the hermes format once the thinking ends) a tool call: the call is read from
    the answer, the thinking is reasoning_content, streamed and whole."""
    server = ServerProcess(qwen3_thinker, *SMALL, "--reasoning-parser", "qwen3",
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    regex = r'<tool_call>\{"name": "add", "arguments": \{"a": 2, "b": 2\}\}</tool_call>'
    kw = dict(messages=QUESTION, tools=TOOLS, max_tokens=120, temperature=0.0, extra_body={"guided_regex": regex})
    try:
        client = _client(server)
        model = client.models.list().data[0].id
        c = client.chat.completions.create(model=model, **kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.model_extra["reasoning_content"] == "Let me add"
        assert not c.message.content
        ((call,),) = [c.message.tool_calls]
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 2}
        reasoning, content, calls, reason = _streamed(client, model=model, **kw)
        assert (reasoning, content.strip(), reason) == ("Let me add", "", "tool_calls")
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in calls] == [
            (0, "add", {"a": 2, "b": 2})]
    finally:
        server.stop()


ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
# Two calls in each model's format (the random model is steered by the regex; its numbers and city are its own).
FORMATS = {
    "llama3_json": r'<\|python_tag\|>\{"name": "add", "parameters": \{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}; '
                   r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{2,6}"\}\}',
    "mistral": r'Calling\.\[TOOL_CALLS\]\[\{"name": "add", "arguments": \{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}, '
               r'\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}"\}\}\]',
    "pythonic": r'\[add\(a=[0-9]{1,2}, b=[0-9]{1,2}\), get_weather\(city="[a-z]{2,6}"\)\]',
}
MALFORMED = {
    "llama3_json": r'\{"name": "add", "parameters": \{"a": oops\}\}',
    "mistral": r'\[TOOL_CALLS\]\[\{"name": add\}\]',
    "pythonic": r'\[add\(a=1, b=\)\]',
}


@pytest.mark.parametrize("parser", list(FORMATS))
def test_tool_call_parsers_whole_and_streamed(model_factory, serve, parser):
    url = serve(model_factory("tiny-llama"), "--kv-cache-memory", "64MiB", "--enable-auto-tool-choice",
                "--tool-call-parser", parser)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=QUESTION, tools=TOOLS, max_tokens=120, temperature=1.0, seed=5,
              extra_body={"guided_regex": FORMATS[parser]})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert [call.function.name for call in c.message.tool_calls] == ["add", "get_weather"]
    args = [json.loads(call.function.arguments) for call in c.message.tool_calls]  # JSON text, never an object
    assert set(args[0]) == {"a", "b"} and set(args[1]) == {"city"}
    assert all(isinstance(call.function.arguments, str) for call in c.message.tool_calls)
    assert (c.message.content or "") in ("", "Calling.")
    _, content, calls, reason = _streamed(client, **kw)  # same seed: the same reply
    assert reason == "tool_calls" and content in ("", "Calling.")
    assert [d.index for d in calls] == [0, 1] and all(d.id and d.type == "function" for d in calls)
    assert [json.loads(d.function.arguments) for d in calls] == args


@pytest.mark.parametrize("parser", list(MALFORMED))
def test_malformed_tool_call_text_stays_content(model_factory, serve, parser):
    url = serve(model_factory("tiny-llama"), "--kv-cache-memory", "64MiB", "--enable-auto-tool-choice",
                "--tool-call-parser", parser)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=QUESTION, tools=TOOLS, max_tokens=60, temperature=0.0,
              extra_body={"guided_regex": MALFORMED[parser]})
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content and ("oops" in c.message.content or "add" in c.message.content)
    _, content, calls, reason = _streamed(client, **kw)
    assert content == c.message.content and not calls and reason == "stop"
