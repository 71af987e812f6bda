"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms, its own head size) with
expert MLPs (model/moe.py) on the layers decoder_sparse_step and mlp_only_layers leave sparse."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import DecoderForCausalLM, DecoderSpec, require
from minivllm.model.models.llama import llama_layer_types
from minivllm.model.moe import moe_spec


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3MoeForCausalLM."""

    config_defaults = {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "norm_topk_prob": False}

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        require(mc, "hidden_act", ("silu",), "silu")
        types, window = llama_layer_types(mc)
        bias = bool(mc.hf_config.get("attention_bias", False))
        moe = moe_spec(mc.hf_config, mc.num_layers, bool(mc.hf_config["norm_topk_prob"]))
        return DecoderSpec(norms=("input_layernorm", None, "post_attention_layernorm", None), layer_types=types,
                           sliding_window=window, qk_norm="head", qkv_bias=bias, o_bias=bias, moe=moe)
