"""OLMoE (OLMoE-1B-7B): Llama's norms before attention and the MLP, an RMSNorm over the whole q and the whole k
projection (as OLMo 2's), and 64 experts, top-8, whose routing weights are renormalised only if the config says
so (norm_topk_prob, off by default)."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import FULL, DecoderForCausalLM, DecoderSpec, require
from minivllm.model.models.olmo2 import Olmo2ForCausalLM
from minivllm.model.moe import moe_spec


class OlmoeForCausalLM(DecoderForCausalLM):
    """OlmoeForCausalLM."""

    tensor_parallel_refusal = Olmo2ForCausalLM.tensor_parallel_refusal  # (the same whole-projection q/k norms)
    config_defaults = {"tie_word_embeddings": False, "rms_norm_eps": 1e-5, "norm_topk_prob": False}

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        require(mc, "hidden_act", ("silu",), "silu")
        require(mc, "clip_qkv", (None,))
        bias = bool(mc.hf_config.get("attention_bias", False))
        moe = moe_spec(mc.hf_config, mc.num_layers, bool(mc.hf_config["norm_topk_prob"]))
        return DecoderSpec(norms=("input_layernorm", None, "post_attention_layernorm", None),
                           layer_types=(FULL,) * mc.num_layers, qk_norm="proj", qkv_bias=bias, o_bias=bias, moe=moe)
