"""OLMo 2: norms after attention and after the MLP (none before either: each sublayer reads the residual stream
itself), and an RMSNorm over the whole q and the whole k projection before rotary."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import FULL, DecoderForCausalLM, DecoderSpec, require


class Olmo2ForCausalLM(DecoderForCausalLM):
    """Olmo2ForCausalLM (OLMo-2 1B to 32B)."""

    # Each rank would hold a slice of the heads, and the norm needs all of them (an all-reduce per norm per layer).
    tensor_parallel_refusal = ("q_norm and k_norm normalise over the whole q and k projections, which tensor "
                               "parallelism splits across ranks")

    config_defaults = {"tie_word_embeddings": False, "rms_norm_eps": 1e-5}

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        require(mc, "hidden_act", ("silu",), "silu")
        bias = bool(mc.hf_config.get("attention_bias", False))
        return DecoderSpec(norms=(None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
                           layer_types=(FULL,) * mc.num_layers, qk_norm="proj", qkv_bias=bias, o_bias=bias)
