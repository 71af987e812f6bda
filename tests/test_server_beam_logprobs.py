"""What the engine can do, served: beam search and prompt logprobs over the official `openai` client (vLLM's
extra parameters in extra_body) against the real server, equal to the offline `LLM` on the same model."""

from __future__ import annotations

import openai
import pytest
from conftest import PROMPTS

from minivllm import LLM, SamplingParams
from minivllm.sampling_params import BeamSearchParams


@pytest.fixture(scope="module")
def path(model_factory):
    return model_factory("tiny-llama")


@pytest.fixture(scope="module")
def client(path, serve):
    return openai.OpenAI(base_url=serve(path) + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(path):
    return LLM(path, num_threads=1)


def test_beam_search_equals_llm_beam_search(client, offline):
    model = client.models.list().data[0].id
    for prompt in PROMPTS[:2]:
        got = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=8,
                                        extra_body={"use_beam_search": True, "ignore_eos": True,
                                                    "length_penalty": 0.5})
        (ref,) = offline.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True,
                                                                length_penalty=0.5))
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert [c.text for c in got.choices] == [b.text for b in ref.outputs]
        assert len({c.text for c in got.choices}) == 3  # three different beams, not one answer thrice
        scores = [c.model_extra["cumulative_logprob"] for c in got.choices]
        assert scores == pytest.approx([b.cumulative_logprob for b in ref.outputs], abs=1e-4)
        assert got.usage.completion_tokens == sum(len(b.token_ids) for b in ref.outputs)


def test_prompt_logprobs_equal_offline(client, offline):
    model = client.models.list().data[0].id
    prompt = PROMPTS[1]
    got = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    (ref,) = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                              use_tqdm=False)
    served = got.choices[0].model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(ref.prompt_token_ids) == len(ref.prompt_logprobs)
    for pos, want in zip(served[1:], ref.prompt_logprobs[1:], strict=True):
        assert {int(t) for t in pos} == set(want)  # the prompt's token and the top 2
        for t, lp in want.items():
            assert pos[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert pos[str(t)]["rank"] == lp.rank and pos[str(t)]["decoded_token"] == lp.decoded_token


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    model = client.models.list().data[0].id
    prompt = PROMPTS[2]
    got = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                    logprobs=1).choices[0]
    (ref,) = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, logprobs=1),
                              use_tqdm=False)
    n_prompt = len(ref.prompt_token_ids)
    lps = got.logprobs
    assert got.text == prompt + ref.outputs[0].text
    assert len(lps.tokens) == n_prompt + len(ref.outputs[0].token_ids)
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    want = [pos[t].logprob for t, pos in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:], strict=True)]
    assert lps.token_logprobs[1:n_prompt] == pytest.approx(want, abs=1e-4)
    # Each offset is where its token starts in the concatenated tokens.
    assert lps.text_offset == [sum(len(t) for t in lps.tokens[:i]) for i in range(len(lps.tokens))]


def test_beam_search_bad_combinations_are_clear_errors(client):
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="use_beam_search / beam_width: beam search is not supported with "
                       "stream=true"):
        client.completions.create(model=model, prompt="x", n=2, max_tokens=2, stream=True,
                                  extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="logprobs is not supported with use_beam_search"):
        client.completions.create(model=model, prompt="x", n=2, max_tokens=2, logprobs=1,
                                  extra_body={"use_beam_search": True})
    with pytest.raises(openai.BadRequestError, match="echo together with logprobs is not supported with stream"):
        client.completions.create(model=model, prompt="x", max_tokens=2, logprobs=1, echo=True, stream=True)
    # The server goes on serving.
    assert client.completions.create(model=model, prompt="x", max_tokens=2).choices[0].finish_reason


@pytest.fixture(scope="module")
def grpc_target(path):
    from server_utils import ServerProcess, free_port

    port = free_port()
    proc = ServerProcess(path, "--num-threads", "1", "--grpc-port", str(port))
    yield f"127.0.0.1:{port}"
    proc.stop()


def test_grpc_beam_search_and_prompt_logprobs_equal_offline(grpc_target, offline):
    import grpc

    from minivllm.entrypoints.proto import inference_pb2 as pb
    from minivllm.entrypoints.proto import inference_pb2_grpc as pb_grpc

    prompt = PROMPTS[0]
    (ref,) = offline.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    (lp_ref,) = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                 use_tqdm=False)
    with grpc.insecure_channel(grpc_target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        got = stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=6, ignore_eos=True, beam_width=3),
                            timeout=120)
        lp = stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=1, temperature=0, prompt_logprobs=1),
                           timeout=120)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.GenerateStream(pb.GenerateRequest(prompt=prompt, max_new_tokens=2, beam_width=2), timeout=60))
    assert [b.text for b in got.beams] == [b.text for b in ref.outputs] and got.generated_text == ref.outputs[0].text
    assert [b.cumulative_logprob for b in got.beams] == pytest.approx([b.cumulative_logprob for b in ref.outputs],
                                                                      abs=1e-4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GenerateStream" in err.value.details()
    want = [pos[t] for t, pos in zip(lp_ref.prompt_token_ids[1:], lp_ref.prompt_logprobs[1:], strict=True)]
    assert [p.token_id for p in lp.prompt_logprobs] == lp_ref.prompt_token_ids[1:]
    assert [p.logprob for p in lp.prompt_logprobs] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [p.rank for p in lp.prompt_logprobs] == [w.rank for w in want]


def test_seed_generate_beams_and_prompt_logprobs(path, serve, offline):
    import httpx

    url = serve(path)
    prompt = PROMPTS[3]
    (ref,) = offline.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True))
    r = httpx.post(url + "/generate", json={"prompt": prompt, "max_new_tokens": 5, "ignore_eos": True,
                                            "beam_width": 2, "prompt_logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    assert [b["text"] for b in got["beams"]] == [b.text for b in ref.outputs] == [got["generated_text"],
                                                                                   ref.outputs[1].text]
    assert [b["cumulative_logprob"] for b in got["beams"]] == pytest.approx(
        [b.cumulative_logprob for b in ref.outputs], abs=1e-4)
    (lp_ref,) = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                                 use_tqdm=False)
    served = got["prompt_logprobs"]
    assert served[0] is None and len(served) == len(lp_ref.prompt_token_ids)
    for tid, pos, want in zip(lp_ref.prompt_token_ids[1:], served[1:], lp_ref.prompt_logprobs[1:], strict=True):
        assert pos[str(tid)]["logprob"] == pytest.approx(want[tid].logprob, abs=1e-4)
    bad = httpx.post(url + "/generate", json={"prompt": prompt, "beam_width": 2, "stream": True}, timeout=60)
    assert bad.status_code == 400 and "beam search is not supported with stream=true" in bad.text
