"""Gemma 2 and Gemma 3: embeddings scaled by sqrt(hidden), RMSNorm scaling by (1 + w), norms before and after
attention and the MLP, a GeLU-tanh gated MLP, attention scaled by query_pre_attn_scalar, local (sliding-window)
and global layers (Gemma 2: alternating; Gemma 3: five local to one global, local layers on their own rope,
rope_local_base_freq), Gemma 2's attention and final logit soft-capping, Gemma 3's q/k norms."""

from __future__ import annotations

import math

from minivllm.config import ModelConfig
from minivllm.model.models.decoder import FULL, SLIDING, DecoderForCausalLM, DecoderSpec, layer_types_from, require

# HF's Gemma config defaults for fields a checkpoint may leave out (gemma-3-1b's config.json omits the tie).
_DEFAULTS = {"tie_word_embeddings": True, "rms_norm_eps": 1e-6, "sliding_window": 4096, "query_pre_attn_scalar": 256}
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _gemma_spec(mc: ModelConfig, default_types: list[str], **kw: object) -> DecoderSpec:
    cfg = mc.hf_config
    require(mc, "use_bidirectional_attention", (None, False))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{mc.architecture}: config field hidden_activation={act!r} is not supported; supported: "
                         "'gelu_pytorch_tanh'")
    window = cfg.get("sliding_window")
    types = layer_types_from(cfg, mc.num_layers, default_types)
    if SLIDING in types and not window:
        raise ValueError(f"{mc.architecture}: layer_types has sliding layers but sliding_window is {window!r}")
    bias = bool(cfg.get("attention_bias", False))
    return DecoderSpec(norms=_NORMS, layer_types=types, sliding_window=int(window) if window else None,
                       unit_offset_norms=True, act="gelu_pytorch_tanh", qkv_bias=bias, o_bias=bias,
                       attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
                       embed_scale=math.sqrt(mc.hidden_size), final_softcap=cfg.get("final_logit_softcapping"),
                       **kw)  # type: ignore[arg-type]


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma2ForCausalLM (gemma-2-2b/9b/27b)."""

    config_defaults = {**_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        default = [SLIDING if (i + 1) % 2 else FULL for i in range(mc.num_layers)]
        return _gemma_spec(mc, default, attn_softcap=mc.hf_config.get("attn_logit_softcapping"))


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma3ForCausalLM (gemma-3-1b and the text models), and the language model of a
    Gemma3ForConditionalGeneration checkpoint served for text (its vision tower is not loaded)."""

    config_defaults = _DEFAULTS

    @staticmethod
    def decoder_spec(mc: ModelConfig) -> DecoderSpec:
        # HF's Gemma 3 attention ignores attn_logit_softcapping; a checkpoint that sets it is ambiguous.
        require(mc, "attn_logit_softcapping", (None,))
        pattern = int(mc.hf_config.get("sliding_window_pattern", 6))
        default = [SLIDING if (i + 1) % pattern else FULL for i in range(mc.num_layers)]
        return _gemma_spec(mc, default, qk_norm="head", rope_per_layer_type=True)

    def checkpoint_name(self, name: str) -> str | None:
        for prefix in ("model.language_model.", "language_model.model.", "model."):
            if name.startswith(prefix):
                return name[len(prefix):]
        if name.startswith("language_model.lm_head."):
            return name.removeprefix("language_model.")
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector.")):
            return None  # images are not served: the language model is all a text request needs
        return name
