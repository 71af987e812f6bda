"""Mixtral (8x7B, 8x22B): Mistral's layer with every MLP a mixture of experts whose top-k routing weights are
always renormalised; its checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate),
w3 (up) and w2 (down)."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import DecoderForCausalLM, DecoderSpec, require
from minivllm.model.models.llama import llama_layer_types
from minivllm.model.moe import moe_spec

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(DecoderForCausalLM):
    """MixtralForCausalLM."""

    config_defaults = {"tie_word_embeddings": False, "rms_norm_eps": 1e-5}

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        require(mc, "hidden_act", ("silu",), "silu")
        types, window = llama_layer_types(mc)
        return DecoderSpec(norms=("input_layernorm", None, "post_attention_layernorm", None), layer_types=types,
                           sliding_window=window, moe=moe_spec(mc.hf_config, mc.num_layers, True))

    def checkpoint_name(self, name: str) -> str | None:
        parts = name.removeprefix("model.").split(".")
        if len(parts) > 3 and parts[2] == "block_sparse_moe":
            parts[2] = "mlp"
            if len(parts) == 7 and parts[3] == "experts":
                parts[5] = _EXPERT_NAMES.get(parts[5], parts[5])
        return ".".join(parts)
