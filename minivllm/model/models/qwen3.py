"""Qwen3: Llama's layer with an RMSNorm per head on q and k before rotary, no qkv bias, and a head_dim of its
own (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024)."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import DecoderForCausalLM, DecoderSpec, require
from minivllm.model.models.llama import llama_layer_types


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3ForCausalLM (the dense models: 0.6B to 32B)."""

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        require(mc, "hidden_act", ("silu",), "silu")
        types, window = llama_layer_types(mc)
        bias = bool(mc.hf_config.get("attention_bias", False))
        return DecoderSpec(norms=("input_layernorm", None, "post_attention_layernorm", None), layer_types=types,
                           sliding_window=window, qk_norm="head", qkv_bias=bias, o_bias=bias)
