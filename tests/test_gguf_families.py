"""GGUF files of every family whose file llama.cpp's converter writes: what the file says beyond transformers' GGUF
config mapping (model/gguf_families.py: Llama 3's rope factors, yarn, Qwen 3's head size, Gemma 2's soft-capping,
Gemma 3's local rope base, Phi-3's LongRoPE and partial rotary) is read, and the families transformers' reader
refuses (OLMo 2, Granite, SmolLM3, OLMoE) are read by ours, a mixture of experts' expert widths and routing too, so the
file tokenizes as its checkpoint and computes the checkpoint's logits, and those llama.cpp computes from the same
file."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, make_runner, write_experts_apart

from minivllm.bench import llamacpp
from minivllm.config import ModelConfig
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model.runner import SequenceInput

# (preset, config overrides): where llama.cpp fixes what a checkpoint may choose (Gemma's query scale is
# 1 / sqrt(head size) below 27B; Gemma 3's every sixth layer is global), the checkpoint chooses as llama.cpp does.
FAMILIES = [("tiny-llama3", ()), ("tiny-qwen2-yarn", ()), ("tiny-qwen3", ()),
            ("tiny-gemma2", (("query_pre_attn_scalar", 32),)),
            ("tiny-gemma3", (("query_pre_attn_scalar", 32), ("sliding_window_pattern", 6))),
            ("tiny-phi3", ()), ("tiny-olmo2", ()), ("tiny-granite", ()), ("tiny-smollm3", ()),
            # Mixtures of experts (merged ffn_*_exps tensors): llama.cpp's converter writes no dense layer among
            # Qwen3-MoE's sparse ones; Qwen2-MoE's shared expert and its gate.
            ("tiny-qwen3-moe", (("mlp_only_layers", None),)), ("tiny-qwen2-moe", ())]
IDS = list(range(5, 45))  # past tiny-llama3's original context (64 -> scaled) needs no more: its factors act on all


def _logits(path: str) -> torch.Tensor:
    runner = make_runner(ModelConfig.from_pretrained(path), 16)
    return runner.execute([SequenceInput(IDS, 0, list(range(16)), True)])[0]


@pytest.mark.parametrize("preset,overrides", FAMILIES)
def test_each_family_serves_its_checkpoints_logits_and_llama_cpps(model_factory, tmp_path, preset, overrides):
    hf_dir = model_factory(preset, overrides=overrides)
    mc = ModelConfig.from_pretrained(hf_dir)
    path = llamacpp.convert(hf_dir, str(tmp_path / "m.gguf"), "f32", architecture=mc.architecture)
    ours, ref = _logits(path), _logits(hf_dir)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=0)
    if not preset.startswith("tiny-gemma"):  # (the bench gives Gemma's converter a SentencePiece model of its own)
        tok, ref_tok = get_tokenizer(path), get_tokenizer(hf_dir)
        assert [tok.encode(p) for p in PROMPTS] == [ref_tok.encode(p) for p in PROMPTS]
    gcfg = ModelConfig.from_pretrained(path).hf_config
    if preset == "tiny-llama3":  # the rope_freqs tensor, as a LongRoPE of one factor set
        assert gcfg["rope_scaling"]["rope_type"] == "longrope"
    if preset == "tiny-phi3":  # llama.cpp's vocabulary loader refuses this test tokenizer (unordered_map::at)
        assert gcfg["partial_rotary_factor"] == 0.5 and gcfg["original_max_position_embeddings"] == 256
        return
    _agrees_with_llama_cpp(path, ours)


# (llama.cpp's OLMoE graph sizes the k norm by the hidden size, as the released model's are: as many KV heads as
# query heads)
@pytest.mark.parametrize("preset,architecture,overrides", [
    ("tiny-mixtral", "MixtralForCausalLM", ()), ("tiny-olmoe", "OlmoeForCausalLM", (("num_key_value_heads", 4),))])
def test_a_mixtral_or_olmoe_file_serves_its_checkpoints_logits_and_llama_cpps(model_factory, tmp_path, preset,
                                                                              architecture, overrides):
    """Mixtral's files are `llama` ones with experts (ffn_*_exps, q / k permuted for llama.cpp's rope): read as a
    Mixtral, they compute the checkpoint's logits and llama.cpp's. OLMoE's (`olmoe`: unnormalised routing,
    whole-projection q / k norms) are refused by transformers' GGUF reader: ours reads them. (llama.cpp's converter
    takes these families' experts one tensor each, as released checkpoints store them.)"""
    merged = model_factory(preset, overrides=overrides)
    apart = str(tmp_path / "apart")
    write_experts_apart(merged, apart, preset == "tiny-mixtral")
    path = llamacpp.convert(apart, str(tmp_path / "m.gguf"), "f32", architecture=architecture)
    assert ModelConfig.from_pretrained(path).architecture == architecture
    if preset == "tiny-olmoe":
        tok, ref_tok = get_tokenizer(path), get_tokenizer(merged)
        assert [tok.encode(p) for p in PROMPTS] == [ref_tok.encode(p) for p in PROMPTS]
    ours = _logits(path)
    torch.testing.assert_close(ours, _logits(merged), atol=2e-5, rtol=0)
    _agrees_with_llama_cpp(path, ours)


def _agrees_with_llama_cpp(path: str, ours: torch.Tensor) -> None:
    """llama.cpp's logits of the same file at the last of IDS: within a few thousandths, the same argmax."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed by the test extra")
    # llama.cpp's KV cache in float32, as ours: its default float16 moves a mixture's logits by 2% of their scale
    # where a token's two best experts nearly tie and the rounding flips its routing.
    theirs = torch.from_numpy(llamacpp.prompt_logits(path, IDS, f32_cache=True))
    assert (ours - theirs).abs().max().item() < 5e-3 * ours.abs().max().item() + 2e-3
    assert ours.argmax().item() == theirs.argmax().item()


@pytest.mark.parametrize("key,value", [("qwen3.attention.key_length", "32"),
                                       ("qwen3.rope.scaling.factor", float("nan"))])
def test_a_family_key_of_the_wrong_kind_is_named(model_factory, tmp_path, key, value):
    """A key read beyond transformers' mapping that is not a finite number is a clear error naming it."""
    from gguf import GGUFValueType

    from minivllm.model.gguf_export import rewrite_gguf

    src = llamacpp.convert(model_factory("tiny-qwen3"), str(tmp_path / "m.gguf"), "f32")
    kind = GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.FLOAT32
    rewrite_gguf(src, str(tmp_path / "bad.gguf"), lambda t: None, {key: (value, kind)})
    with pytest.raises(ValueError, match=f"metadata {key} is .*, not a finite number"):
        ModelConfig.from_pretrained(str(tmp_path / "bad.gguf"))


def test_a_mixture_of_experts_of_another_architecture_is_refused_by_name(model_factory, tmp_path):
    """Expert tensors are read for llama (Mixtral) / qwen2moe / qwen3moe files; another architecture claiming experts
    is refused naming the key, not served with its experts silently missing."""
    from gguf import GGUFValueType

    from minivllm.model.gguf_export import rewrite_gguf

    src = llamacpp.convert(model_factory("tiny-qwen3"), str(tmp_path / "m.gguf"), "f32")
    rewrite_gguf(src, str(tmp_path / "moe.gguf"), lambda t: None, {"qwen3.expert_count": (8, GGUFValueType.UINT32)})
    with pytest.raises(ValueError, match="qwen3.expert_count: mixture-of-experts GGUF files are read for Mixtral"):
        ModelConfig.from_pretrained(str(tmp_path / "moe.gguf"))
