"""vLLM's `--speculative-config` JSON for speculative decoding, turned into EngineArgs' own fields."""

from __future__ import annotations

import json
from typing import Any

# vLLM's keys this engine understands, with the EngineArgs field each one sets ("method" and "model" together
# set speculative_model).
_FIELDS = {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_max": "prompt_lookup_max",
           "prompt_lookup_min": "prompt_lookup_min", "adaptive": "speculative_adaptive",
           "suffix_decoding_max_tree_depth": "suffix_decoding_max_tree_depth",
           "suffix_decoding_max_cached_requests": "suffix_decoding_max_cached_requests",
           "suffix_decoding_max_spec_factor": "suffix_decoding_max_spec_factor",
           "suffix_decoding_min_token_prob": "suffix_decoding_min_token_prob"}
_FLOATS = ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
_METHODS = ("ngram", "suffix", "draft_model")


def parse_speculative_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """A JSON object (or dict) such as {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    {"method": "suffix", "num_speculative_tokens": 8} or {"model": "DIR", "num_speculative_tokens": 3}
    → EngineArgs fields (speculative_model and the rest).
    Every mistake is a ValueError that names the key."""
    if isinstance(value, str):
        try:
            cfg = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not valid JSON ({e})") from None
    else:
        cfg = value
    if not isinstance(cfg, dict):
        raise ValueError(f"speculative_config: expected a JSON object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(_FIELDS) - {"method", "model"})
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; this engine takes "
                         f"method, model, {', '.join(_FIELDS)}")
    method, model = cfg.get("method"), cfg.get("model")
    if method is None:
        method = ("ngram" if model in (None, "ngram", "[ngram]") else "suffix" if model == "suffix"
                  else "draft_model")  # vLLM infers it from model
    if method not in _METHODS:
        raise ValueError(f"speculative_config: method {method!r} is not supported here; choose "
                         f"{' or '.join(_METHODS)} (a draft model directory in 'model')")
    if method == "draft_model" and not isinstance(model, str):
        raise ValueError("speculative_config: method 'draft_model' needs 'model': a draft model directory "
                         "(or default-draft)")
    k = cfg.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
    out: dict[str, Any] = {"speculative_model": model if method == "draft_model" else method}
    for key, name in _FIELDS.items():
        if key in cfg:
            want: tuple[type, ...] = (bool,) if key == "adaptive" else (int, float) if key in _FLOATS else (int,)
            if not isinstance(cfg[key], want) or (bool not in want and isinstance(cfg[key], bool)):
                raise ValueError(f"speculative_config: {key} must be {want[-1].__name__}, got {cfg[key]!r}")
            out[name] = cfg[key]
    return out
