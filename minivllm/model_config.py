"""ModelConfig: what the engine needs to know of a Hugging Face checkpoint directory (config.json and
generation_config.json), normalised across model families."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"model: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model: {path} must hold a JSON object")
    return data


BASE_MODEL_KEY = "minivllm_base_model"  # in hf_config: the bare-transformer architecture a checkpoint named


def _is_base_model(arch: str) -> bool:
    return arch.endswith("Model") and not arch.endswith(("LMHeadModel", "PreTrainedModel"))


# Multimodal checkpoints whose language model serves text on its own: their text_config is the model's config.
TEXT_MODEL_WRAPPERS = ("Gemma3ForConditionalGeneration",)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know of a Hugging Face checkpoint, normalised across families."""

    path: str
    hf_config: dict[str, Any]
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    checkpoint_dtype: str | None
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def from_pretrained(path: str) -> ModelConfig:
        """Read config.json (and generation_config.json when present) from a model directory, or the metadata
        of a GGUF file (the file, or a directory holding one); mc.path is then the GGUF file."""
        from minivllm.model.gguf_checkpoint import find_gguf, hf_config

        gguf = find_gguf(path)
        if gguf is not None:
            return ModelConfig._from_dicts(gguf, gguf, hf_config(gguf), {})
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model: {path!r} is neither a directory nor a .gguf file")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"model: no config.json in {path!r}; expected a Hugging Face model directory "
                                    "or a GGUF file")
        cfg = _read_json(cfg_path)
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(f"model: config.json in {path!r} names no 'architectures'")
        if archs[0] in TEXT_MODEL_WRAPPERS and isinstance(cfg.get("text_config"), dict):
            top = cfg
            cfg = {**cfg["text_config"], "architectures": archs}
            for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
                if key in top and key not in cfg:
                    cfg[key] = top[key]
        if _is_base_model(archs[0]):
            # A checkpoint of the bare transformer (what sentence-transformers saves: Qwen3Model, LlamaModel, ...): the
            # family's causal-LM class with its head tied to the embeddings, and marked so that only --runner pooling
            # serves it (engine_config.py): the tied head would generate nonsense.
            suffix = "LMHeadModel" if archs[0] == "GPT2Model" else "ForCausalLM"
            cfg = {**cfg, "architectures": [archs[0].removesuffix("Model") + suffix], "tie_word_embeddings": True,
                   BASE_MODEL_KEY: archs[0]}
        gen_path = os.path.join(path, "generation_config.json")
        gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
        return ModelConfig._from_dicts(path, cfg_path, cfg, gen)

    @staticmethod
    def _from_dicts(path: str, cfg_path: str, cfg: dict[str, Any], gen: dict[str, Any]) -> ModelConfig:
        """Normalise an HF config (and generation config) read from cfg_path."""
        archs = cfg.get("architectures") or []

        def need(*keys: str) -> int:
            value = _first(cfg, *keys)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model: {cfg_path} needs a positive integer {' or '.join(map(repr, keys))}, "
                                 f"got {value!r}")
            return value

        hidden, heads = need("hidden_size", "n_embd"), need("num_attention_heads", "n_head")
        eos = _as_id_list(gen.get("eos_token_id")) + _as_id_list(cfg.get("eos_token_id"))
        return ModelConfig(
            path=path,
            hf_config=cfg,
            architecture=archs[0],
            num_layers=need("num_hidden_layers", "n_layer"),
            num_heads=heads,
            num_kv_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
            head_dim=int(_first(cfg, "head_dim", default=hidden // heads)),
            hidden_size=hidden,
            vocab_size=need("vocab_size"),
            max_position_embeddings=int(_first(cfg, "max_position_embeddings", "n_positions", default=2048)),
            checkpoint_dtype=_first(cfg, "torch_dtype", "dtype"),
            eos_token_ids=tuple(dict.fromkeys(eos)),
        )

    def kv_heads_per_rank(self, tensor_parallel_size: int = 1) -> int:
        """KV heads each tensor-parallel rank holds: its share, or with fewer KV heads than ranks the one its
        query heads read (replicated)."""
        return max(self.num_kv_heads // tensor_parallel_size, 1)

    def kv_bytes_per_token(self, dtype: torch.dtype, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto"
                           ) -> int:
        """Bytes of K and V for one token across all layers (in one tensor-parallel rank's cache). An int8 or
        fp8 cache holds one byte per value plus a float16 scale per token and head."""
        per_head = (self.head_dim + 2 if kv_cache_dtype in ("int8", "fp8")
                    else self.head_dim * torch.empty((), dtype=dtype).element_size())
        return 2 * self.num_layers * self.kv_heads_per_rank(tensor_parallel_size) * per_head
