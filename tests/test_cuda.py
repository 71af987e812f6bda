"""The portable paths on CUDA (skipped where no GPU is present): same greedy output as HF on the GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from minivllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_cuda_greedy_matches_hf(model_factory, preset):
    from transformers import AutoModelForCausalLM

    path = model_factory(preset)
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=128, check_invariants=True)
    assert llm.llm_engine.runner.kv_cache.is_cuda
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8", "w4a8"])
def test_cuda_quantized_modes_plan_and_generate(model_factory, method):
    # No native kernels on CUDA: the planner times the portable path and torch._int_mm, which CUDA refuses below 17
    # rows (that class then takes the portable path); greedy output close to the same mode's portable path on CPU.
    path = model_factory("tiny-llama")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    gpu = LLM(path, device="cuda", dtype="float32", quantization=method, num_kv_blocks=128, check_invariants=True)
    plan = gpu.llm_engine.runner.quant_kernels
    assert set(plan.values()) <= {"reference", "int_mm"} and plan["m<=1"] == "reference", plan
    cpu = LLM(path, dtype="float32", quantization=method, quantization_kernel="reference", num_kv_blocks=128)
    a = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, sp, use_tqdm=False)]
    assert all(len(t) == 8 for t in a)
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= len(PROMPTS) // 2, (a, b)
