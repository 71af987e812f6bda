"""What a GGUF file says about its model that transformers' GGUF config mapping leaves out, in HF config terms.

transformers maps the common keys of each architecture it knows (model/gguf_checkpoint.py reads the rest of the
config through it), but drops what llama.cpp reads beyond them, and a model served without it computes other
logits than the file's, silently: Llama 3's rope scaling (the converter stores it as per-dimension frequency
factors, a `rope_freqs` tensor), rope scaling keys (`rope.scaling.type` linear / yarn), Qwen 3's head size
(`attention.key_length`), Gemma 2's logit soft-capping, Gemma 3's local rope base, Phi-3's LongRoPE factors
(`rope_factors_long` / `rope_factors_short` tensors), partial rotary and pretraining length. Each is filled in
here as llama.cpp's loader (llama-model.cpp) reads the file, including where llama.cpp fixes a value the file
does not hold (Gemma's attention scale and Gemma 3's sliding-window pattern). A mixture of experts' expert and
shared-expert widths (`expert_feed_forward_length`, `expert_shared_feed_forward_length`) are dropped too, and
whether the k routing weights are renormalised is fixed per architecture by llama.cpp's graph, not stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# llama.cpp's 27B Gemma 2 / Gemma 3 scale queries by 1 / sqrt(hidden / heads), the others by 1 / sqrt(head size):
# it tells them apart by layer count.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_SWA_PATTERN = 6  # llama.cpp's fixed pattern: every sixth layer attends globally
# Whether llama.cpp's graph renormalises each token's top-k routing weights, per GGUF architecture (it reads no
# key for it): Qwen3-MoE and Mixtral (a `llama` file with experts) do, Qwen2-MoE and OLMoE do not.
_MOE_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False, "llama": True, "olmoe": False}


def complete_config(cfg: dict[str, Any], meta: dict[str, Any], arch: str,
                    tensor: Callable[[str], np.ndarray | None]) -> None:
    """Fill cfg (transformers' parse of the file) in place from the file's metadata `meta` (key -> value) and its
    small tensors (tensor(name): float32 values, or None when the file has none of that name)."""

    def key(name: str) -> Any:
        """The value of `arch.name` (None if absent): a number, checked, since every key read here is one."""
        value = meta.get(f"{arch}.{name}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not np.isfinite(value)):
            raise ValueError(f"metadata {arch}.{name!s} is {value!r}, not a finite number")
        return value

    heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    head_dim = key("attention.key_length")
    if isinstance(head_dim, int) and "head_dim" not in cfg and arch != "gpt2":
        cfg["head_dim"] = head_dim
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads and "hidden_size" in cfg else None)
    _rope_scaling(cfg, key, tensor, meta.get(f"{arch}.rope.scaling.type"))
    if arch in ("gemma2", "gemma3"):
        hidden = cfg["hidden_size"]
        big = cfg.get("num_hidden_layers") == _GEMMA_27B_LAYERS[arch]
        cfg["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        if arch == "gemma2":
            for name in ("attn_logit_softcapping", "final_logit_softcapping"):
                if key(name) is not None:
                    cfg[name] = float(key(name))
        else:
            cfg["sliding_window_pattern"] = int(key("attention.sliding_window_pattern") or _GEMMA3_SWA_PATTERN)
            cfg["rope_local_base_freq"] = float(key("rope.freq_base_swa") or 10000.0)
    if arch == "phi3":
        rotary = key("rope.dimension_count")
        if isinstance(rotary, int) and head_dim and rotary != head_dim:
            cfg["partial_rotary_factor"] = rotary / head_dim
        if not key("attention.sliding_window"):
            cfg["sliding_window"] = None  # llama.cpp's 0: no window
    if key("expert_count"):
        _experts(cfg, key, arch)
    if key("rope.scaling.original_context_length") is not None:
        cfg["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    pad = meta.get("tokenizer.ggml.padding_token_id")
    vocab = cfg.get("vocab_size")
    # A config class's default pad id (Phi-3's 32000) may lie outside a smaller vocabulary: take the file's.
    cfg["pad_token_id"] = pad if isinstance(pad, int) and (vocab is None or 0 <= pad < vocab) else None


def _experts(cfg: dict[str, Any], key: Callable[[str], Any], arch: str) -> None:
    """A mixture of experts' widths and routing (every layer sparse: llama.cpp's converter writes no dense layer
    among expert ones)."""
    if arch not in _MOE_NORM_TOPK:
        raise ValueError(f"{arch}.expert_count: mixture-of-experts GGUF files are read for Mixtral, Qwen2-MoE, "
                         f"Qwen3-MoE and OLMoE (llama, qwen2moe, qwen3moe, olmoe), not {arch}; serve its Hugging Face "
                         "checkpoint")
    cfg["num_experts"] = int(key("expert_count"))
    cfg["num_experts_per_tok"] = int(key("expert_used_count") or 0)
    if arch == "llama":  # Mixtral: a Llama whose MLPs are experts, each of the feed-forward length
        cfg["model_type"], cfg["num_local_experts"] = "mixtral", cfg.pop("num_experts")
        cfg.setdefault("sliding_window", None)
    elif key("expert_feed_forward_length") is not None:
        cfg["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    if key("expert_shared_feed_forward_length") is not None:
        cfg["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length"))
    cfg["norm_topk_prob"] = _MOE_NORM_TOPK[arch]
    cfg["mlp_only_layers"], cfg["decoder_sparse_step"] = [], 1


def _rope_scaling(cfg: dict[str, Any], key: Callable[[str], Any], tensor: Callable[[str], np.ndarray | None],
                  kind: Any) -> None:
    """rope_scaling from the file's rope keys and factor tensors, where transformers gave none."""
    if cfg.get("rope_scaling"):
        return
    long, short = tensor("rope_factors_long.weight"), tensor("rope_factors_short.weight")
    if long is not None and short is not None:  # Phi-3's LongRoPE
        cfg["rope_scaling"] = {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}
        if key("rope.scaling.attn_factor") is not None:
            cfg["rope_scaling"]["attention_factor"] = float(key("rope.scaling.attn_factor"))
        return
    freqs = tensor("rope_freqs.weight")
    if freqs is not None:
        # Llama 3's scaling, stored as what llama.cpp divides each frequency by: the same division is a LongRoPE
        # with one factor set over the whole context and no attention scaling.
        factors = freqs.tolist()
        cfg["rope_scaling"] = {"rope_type": "longrope", "long_factor": factors, "short_factor": factors,
                               "original_max_position_embeddings": int(cfg["max_position_embeddings"]),
                               "attention_factor": 1.0}
        return
    factor = key("rope.scaling.factor")
    if kind in ("linear", "yarn") and factor is not None:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if key("rope.scaling.original_context_length") is not None:
            scaling["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        for gguf_name, hf_name in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                                   ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if key(gguf_name) is not None:
                scaling[hf_name] = float(key(gguf_name))
        cfg["rope_scaling"] = scaling


# Families the engine serves whose GGUF files transformers' reader refuses ("not supported yet"): their config is
# read here from the keys llama.cpp reads (GGUF architecture -> HF model type).
OWN_ARCHITECTURES = {"olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3", "olmoe": "olmoe"}
# Those whose q / k rows llama.cpp's converter reorders for its rope (its LlamaModel subclasses).
PERMUTED_QK = frozenset({"granite", "smollm3"})
_COMMON_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
                "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                "rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
                "vocab_size": "vocab_size", "attention.key_length": "head_dim"}
_FAMILY_KEYS = {"granite": {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                            "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def parse_config(meta: dict[str, Any], arch: str, tensor_names: set[str], vocab_size: int) -> dict[str, Any]:
    """The HF config of a file of one of OWN_ARCHITECTURES, from its metadata (SmolLM3's no-rope layers: every
    fourth, llama.cpp's fixed step and the family's default)."""
    cfg: dict[str, Any] = {"model_type": OWN_ARCHITECTURES[arch]}
    for name, hf_name in {**_COMMON_KEYS, **_FAMILY_KEYS.get(arch, {})}.items():
        value = meta.get(f"{arch}.{name}")
        if value is not None:
            cfg[hf_name] = value
    missing = [f"{arch}.{name}" for name, hf_name in _COMMON_KEYS.items() if hf_name in _REQUIRED
               and hf_name not in cfg]
    if missing:
        raise ValueError(f"metadata {', '.join(missing)} missing")
    cfg.setdefault("vocab_size", vocab_size)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    for name in ("bos", "eos"):
        if isinstance(meta.get(f"tokenizer.ggml.{name}_token_id"), int):
            cfg[f"{name}_token_id"] = meta[f"tokenizer.ggml.{name}_token_id"]
    return cfg
