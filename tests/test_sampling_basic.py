"""Sampling basics the engine core relies on: seeds, min_tokens masking, stop token ids, validation."""

from __future__ import annotations

import math

import pytest
from conftest import PROMPTS

from minivllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("tiny-llama"), num_kv_blocks=128, check_invariants=True)


def test_seed_reproducible_solo_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234, max_tokens=16, ignore_eos=True)
    solo = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5, max_tokens=16, ignore_eos=True)
              for _ in range(8)]
    batch = llm.generate(PROMPTS[1:] + [PROMPTS[0]] + PROMPTS[1:2], others[:7] + [seeded] + others[7:],
                         use_tqdm=False)
    assert batch[7].outputs[0].token_ids == solo
    other_seed = seeded.clone(seed=99)
    assert llm.generate([PROMPTS[0]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != solo


def test_stop_token_ids_and_min_tokens(llm):
    first = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    stopped = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[first]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    # Before min_tokens the stop token is masked, not produced and ignored.
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, stop_token_ids=[first])
    held = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", "0.5"), ("min_tokens", None),
    ("min_tokens", 20), ("stop_token_ids", 5), ("stop_token_ids", [-1]), ("seed", -1),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_ids")[0]):
        SamplingParams(max_tokens=16, **{field: value})


def test_tiny_temperature_is_greedy(llm):
    greedy = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tiny = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True, temperature=1e-7),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in tiny]
