"""A real-size checkpoint shape (SmolLM2-135M) loads from sharded safetensors and matches HF greedy."""

from __future__ import annotations

import json
import os

from conftest import PROMPTS, hf_greedy, hf_model

from minivllm import LLM, SamplingParams


def test_smollm2_135m_sharded_matches_hf(model_factory):
    path = model_factory("smollm2-135m", max_shard_size="200MB")
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) >= 3 and not os.path.exists(os.path.join(path, "model.safetensors"))

    llm = LLM(path, kv_cache_memory="256MiB", check_invariants=True)
    prompts = PROMPTS[:2]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    hf = hf_model(path)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 32)
