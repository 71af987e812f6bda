"""SmolLM3: Llama's layer, with no rotary on the layers `no_rope_layers` marks 0 (every fourth, NoPE); with
use_sliding_window those NoPE layers are the windowed ones, as HF's config derives it."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import FULL, SLIDING, DecoderForCausalLM, DecoderSpec, layer_types_from, require


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """SmolLM3ForCausalLM (SmolLM3-3B)."""

    config_defaults = {"tie_word_embeddings": True, "rms_norm_eps": 1e-6, "no_rope_layer_interval": 4}

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        cfg, n = mc.hf_config, mc.num_layers
        require(mc, "hidden_act", ("silu",), "silu")
        interval = int(cfg.get("no_rope_layer_interval", 4))
        rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        if len(rope) != n:
            raise ValueError(f"SmolLM3ForCausalLM: no_rope_layers lists {len(rope)} layers; num_hidden_layers is {n}")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        types = layer_types_from(cfg, n, [SLIDING if window and not r else FULL for r in rope]) if window \
            else (FULL,) * n
        bias = bool(cfg.get("attention_bias", False))
        return DecoderSpec(norms=("input_layernorm", None, "post_attention_layernorm", None), layer_types=types,
                           sliding_window=int(window) if window else None, rope_layers=tuple(bool(r) for r in rope),
                           qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
