"""The official `openai` client against the real server's /v1 routes."""

from __future__ import annotations

import math

import openai
import pytest
from conftest import PROMPTS

MAX = 10


@pytest.fixture(scope="module")
def client(model_factory, serve):
    url = serve(model_factory("tiny-llama"))
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_list(client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.startswith("tiny-llama")  # the directory name
    assert models[0].owned_by == "minivllm"


def test_completion_greedy_stream_matches_non_stream(client, model):
    full = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX, temperature=0)
    assert full.object == "text_completion" and len(full.choices) == 1
    assert full.usage.completion_tokens == MAX or full.choices[0].finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_completion_n2_seed_logprobs(client, model):
    kw = dict(model=model, prompt=PROMPTS[2], max_tokens=MAX, temperature=1.0, n=2, seed=1234, logprobs=3,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed → same samples
    assert a.choices[0].text != a.choices[1].text  # two different samples (seed + i)
    assert a.usage.completion_tokens == 2 * MAX
    for choice in a.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
            assert chosen <= 0 and len(top) == 3
            assert max(top.values()) >= chosen - 1e-6  # the top-3 include the best token
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(MAX)]
    c = client.completions.create(**{**kw, "seed": 999})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_completion_stream_n2(client, model):
    stream = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=MAX, temperature=0.8, n=2,
                                       seed=7, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
        usage = chunk.usage or usage
    ref = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=MAX, temperature=0.8, n=2, seed=7,
                                    extra_body={"ignore_eos": True})
    assert texts == {c.index: c.text for c in ref.choices}
    assert usage.completion_tokens == 2 * MAX


def test_completion_stop_string(client, model):
    base = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    assert stop.strip(), base
    cut = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == cut.text


def test_completion_list_of_prompts(client, model):
    out = client.completions.create(model=model, prompt=PROMPTS[:3], max_tokens=4, temperature=0, n=2)
    assert sorted(c.index for c in out.choices) == list(range(6))
    single = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    assert out.choices[2].text == single.choices[0].text  # prompt 1, sample 0 → index 2


def test_chat_non_stream_and_stream(client, model):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX, temperature=0, n=2,
                                          logprobs=True, top_logprobs=2)
    assert full.object == "chat.completion" and len(full.choices) == 2
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy: n copies agree
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens // 2
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 2
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob
        assert math.isclose(tok.top_logprobs[0].logprob, tok.logprob, abs_tol=1e-5)  # greedy takes the best
        assert bytes(tok.bytes).decode("utf-8", "replace") == tok.token
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=MAX, temperature=0,
                                                 n=2, stream=True, stream_options={"include_usage": True}))
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant", "assistant"]
    text = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            text[ch.index] += ch.delta.content or ""
    assert text[0] == text[1] == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_seed_and_stop(client, model):
    messages = [{"role": "user", "content": "Tell me about foxes."}]
    kw = dict(model=model, messages=messages, max_completion_tokens=16, temperature=1.0, seed=42,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw).choices[0].message.content == a
    stop = a[4:7]
    if stop.strip():
        cut = client.chat.completions.create(**kw, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.message.content == a[:a.index(stop)]


def test_bad_request_raises_with_our_message(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=4, temperature=-1)
    assert "temperature" in str(e.value) and e.value.status_code == 400
    assert e.value.body["message"].startswith("temperature")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=10**9)
    assert "max_model_len" in str(e.value)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert "gpt-4" in str(e.value)
