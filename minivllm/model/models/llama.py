"""Llama family: Llama (1-3.x), Mistral (one window for every layer) and Qwen2 (qkv bias; windows on the layers
from max_window_layers on when use_sliding_window is set), with GQA, tied or untied embeddings, rope scaling."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import FULL, SLIDING, DecoderForCausalLM, DecoderSpec, layer_types_from, require


def llama_layer_types(mc: ModelConfig) -> tuple[tuple[str, ...], int | None]:
    """Per-layer attention types and the window, as the Llama-style configs state them."""
    cfg, n = mc.hf_config, mc.num_layers
    window = cfg.get("sliding_window")
    if mc.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM", "Qwen2MoeForCausalLM",
                           "Qwen3MoeForCausalLM"):
        # These configs carry a window that only applies with use_sliding_window.
        if not cfg.get("use_sliding_window") or not window:
            return (FULL,) * n, None
        first = int(cfg.get("max_window_layers", n))
        default = [SLIDING if i >= first else FULL for i in range(n)]
        return layer_types_from(cfg, n, default), int(window)
    if not window:
        return (FULL,) * n, None
    return layer_types_from(cfg, n, [SLIDING] * n), int(window)


class LlamaForCausalLM(DecoderForCausalLM):
    """LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM on the paged KV cache."""

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        cfg = mc.hf_config
        require(mc, "hidden_act", ("silu",), "silu")
        require(mc, "partial_rotary_factor", (None, 1.0))
        types, window = llama_layer_types(mc)
        attention_bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(
            norms=("input_layernorm", None, "post_attention_layernorm", None), layer_types=types,
            sliding_window=window,
            # Llama's attention_bias covers o_proj too; Qwen2's qkv bias does not.
            qkv_bias=attention_bias or mc.architecture == "Qwen2ForCausalLM", o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)))
