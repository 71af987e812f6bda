"""bfloat16 / float16 engines load (from float32 or bf16 checkpoints) and stay close to float32."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model.runner import SequenceInput
from tests.conftest import make_runner


def _prefill_logits(path: str, dtype: torch.dtype) -> torch.Tensor:
    mc = ModelConfig.from_pretrained(path)
    runner = make_runner(mc, 16, dtype)
    assert all(p.dtype == dtype for p in runner.model.parameters())
    assert runner.kv_cache.dtype == dtype
    ids = get_tokenizer(path).encode(PROMPTS[1])
    return runner.execute([SequenceInput(ids, 0, list(range(16)), True)])[0]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_close_to_float32(model_factory, preset, dtype):
    path = model_factory(preset)
    ref = _prefill_logits(path, torch.float32)
    got = _prefill_logits(path, dtype)
    assert got.dtype == torch.float32  # logits are always returned in float32
    # bf16 keeps 8 bits of mantissa: a few hundredths on logits of order 1.
    assert (got - ref).abs().max().item() < 0.1
    assert (got - ref).abs().max().item() > 0  # really ran in reduced precision


def test_bf16_checkpoint_generates(model_factory):
    path = model_factory("tiny-qwen2", dtype="bfloat16")
    assert ModelConfig.from_pretrained(path).checkpoint_dtype == "bfloat16"
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=64)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    assert llm.llm_engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.skipif(not __import__("minivllm.model.cpu_kernels", fromlist=["x"]).available(), reason="no C compiler")
def test_bf16_decode_through_the_native_attention_kernel_matches_the_portable_backend(model_factory):
    """bf16 KV pools are read by the compiled kernel (widened as read); its decode logits agree with the
    torch backend's (gather + SDPA) on the same bf16 pool within bf16's rounding."""
    path = model_factory("tiny-llama")
    mc = ModelConfig.from_pretrained(path)
    ids = get_tokenizer(path).encode(PROMPTS[1])
    decode_logits = {}
    for backend in ("cpu_native", "torch"):
        runner = make_runner(mc, 16, torch.bfloat16, attention_backend=backend)
        assert type(runner.attention_backend).__name__ == {"cpu_native": "CpuNativePagedAttention",
                                                           "torch": "TorchPagedAttention"}[backend]
        runner.execute([SequenceInput(ids, 0, list(range(16)), True)])
        steps = [runner.execute([SequenceInput([t], len(ids) + i, list(range(16)), True)])[0]
                 for i, t in enumerate([5, 17, 300])]
        decode_logits[backend] = torch.stack(steps)
    diff = (decode_logits["cpu_native"] - decode_logits["torch"]).abs().max().item()
    assert 0 <= diff < 0.1
