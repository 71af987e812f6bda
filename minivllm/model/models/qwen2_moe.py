"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (qkv bias) with expert MLPs and a shared
expert beside them (a dense gated MLP scaled by sigmoid(shared_expert_gate(x)), model/moe.py)."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import DecoderForCausalLM, DecoderSpec, require
from minivllm.model.models.llama import llama_layer_types
from minivllm.model.moe import moe_spec


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen2MoeForCausalLM."""

    config_defaults = {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "norm_topk_prob": False}

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        require(mc, "hidden_act", ("silu",), "silu")
        types, window = llama_layer_types(mc)
        moe = moe_spec(mc.hf_config, mc.num_layers, bool(mc.hf_config["norm_topk_prob"]), shared=True)
        return DecoderSpec(norms=("input_layernorm", None, "post_attention_layernorm", None), layer_types=types,
                           sliding_window=window, qkv_bias=True, moe=moe)
