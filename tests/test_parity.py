"""Our model code equals HF transformers on the same weights (float32): every layer, logits, greedy."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, TINY_FAMILIES, hf_greedy, hf_model

from minivllm import LLM, SamplingParams
from minivllm.config import ModelConfig
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model.runner import SequenceInput
from minivllm.modelgen.presets import MOE_FAMILIES, NEW_FAMILIES
from tests.conftest import make_runner

LAYER_ATTR = {"tiny-gpt2": ("transformer", "h")}


def _hf_layers(model, preset: str):
    outer, inner = LAYER_ATTR.get(preset, ("model", "layers"))
    return getattr(getattr(model, outer), inner)


@pytest.mark.parametrize("preset", TINY_FAMILIES + ["tiny-llama3", "tiny-qwen2-yarn", *NEW_FAMILIES, *MOE_FAMILIES])
def test_hidden_states_and_logits_match_hf(model_factory, preset):
    path = model_factory(preset)
    mc = ModelConfig.from_pretrained(path)
    # Long enough to cross several KV blocks and tiny-mistral's 8-token sliding window.
    ids = get_tokenizer(path).encode(PROMPTS[1] + PROMPTS[3])
    assert len(ids) > 40

    hf = hf_model(path)
    hf_layer_out = []
    for layer in _hf_layers(hf, preset):
        layer.register_forward_hook(lambda m, i, o: hf_layer_out.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)

    runner = make_runner(mc, 16)
    ours = []
    decoder_layers = [m for m in runner.model.modules() if type(m).__name__ in ("DecoderLayer", "GPT2Block")]
    assert len(decoder_layers) == mc.num_layers
    for layer in decoder_layers:
        # A Llama layer returns (output, residual): the hidden state is their sum (summed now: the next
        # layer updates the residual in place).
        layer.register_forward_hook(lambda m, i, o: ours.append(o[0] + o[1] if isinstance(o, tuple) else o))
    final_hidden = []
    runner.model.register_forward_hook(lambda m, i, o: final_hidden.append(o))
    # Prefill in two chunks so the second one attends through the paged cache.
    split = 19
    logits_a = runner.execute([SequenceInput(ids[:split], 0, list(range(16)), True)])
    logits_b = runner.execute([SequenceInput(ids[split:], split, list(range(16)), True)])

    for i in range(mc.num_layers):
        got = torch.cat([ours[i], ours[mc.num_layers + i]])
        torch.testing.assert_close(got, hf_layer_out[i][0].reshape(got.shape), atol=1e-4, rtol=0,
                                   msg=lambda m, i=i: f"layer {i}: {m}")
    final = torch.cat(final_hidden)
    torch.testing.assert_close(final, ref.hidden_states[-1][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits_a[0], ref.logits[0, split - 1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits_b[0], ref.logits[0, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("backends", [("auto", "auto"), ("torch", "torch")], ids=["native", "portable"])
@pytest.mark.parametrize("preset", TINY_FAMILIES + list(NEW_FAMILIES) + MOE_FAMILIES)
def test_greedy_32_tokens_match_hf_generate(model_factory, preset, backends):
    """Both the CPU fast paths (compiled attention, oneDNN GEMMs) and the portable torch paths (what CUDA
    runs) reproduce HF; tiny-mistral's 8-token sliding window is exercised in decode."""
    path = model_factory(preset)
    llm = LLM(path, check_invariants=True, num_kv_blocks=256, attention_backend=backends[0],
              linear_backend=backends[1])
    # min_tokens: HF's min_new_tokens masks EOS until then (the reference), and so does ours.
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32),
                        use_tqdm=False)
    hf = hf_model(path)
    for out in outs:
        assert len(out.outputs[0].token_ids) == 32
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 32), out.prompt
    assert llm.llm_engine.block_manager.num_used == 0
