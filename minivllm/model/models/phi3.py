"""Phi-3 / Phi-3.5-mini / Phi-4-mini: Llama's layer with q/k/v and gate/up already fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, loaded as they are), partial rotary (partial_rotary_factor: Phi-4-mini rotates
0.75 of each head) and LongRoPE (model/rotary.py); one window for every layer when sliding_window is set."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import DecoderForCausalLM, DecoderSpec, require
from minivllm.model.models.llama import llama_layer_types


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi3ForCausalLM."""

    config_defaults = {"tie_word_embeddings": False, "rms_norm_eps": 1e-5}

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        require(mc, "hidden_act", ("silu",), "silu")
        types, window = llama_layer_types(mc)
        return DecoderSpec(norms=("input_layernorm", None, "post_attention_layernorm", None), layer_types=types,
                           sliding_window=window)
