"""Granite (3.x dense): Llama's layer with four scalars: embeddings times embedding_multiplier, attention scaled by
attention_multiplier (not 1/sqrt(head_dim)), each sublayer's output times residual_multiplier before it joins
the residual stream, logits divided by logits_scaling."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import FULL, DecoderForCausalLM, DecoderSpec, require


class GraniteForCausalLM(DecoderForCausalLM):
    """GraniteForCausalLM (granite-3.x-2b/8b)."""

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        cfg = mc.hf_config
        require(mc, "hidden_act", ("silu",), "silu")
        bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(norms=("input_layernorm", None, "post_attention_layernorm", None),
                           layer_types=(FULL,) * mc.num_layers, qkv_bias=bias, o_bias=bias,
                           mlp_bias=bool(cfg.get("mlp_bias", False)),
                           attn_scale=float(cfg.get("attention_multiplier", 1.0)),
                           residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                           embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                           logits_divisor=float(cfg.get("logits_scaling", 1.0)))
