"""How an embedding model (`--runner pooling`) turns a prompt's final hidden states into one vector: the pooling type
(the last token's state, the mean over every token, or the first token's) and whether the vector is L2-normalized.

Read from the checkpoint's sentence-transformers config, as sentence-transformers itself builds the model: modules.json
lists the modules (a Pooling module's directory holds its config.json, pooling_mode_lasttoken / _mean_tokens /
_cls_token; a Normalize module means unit vectors). `--pooler-config` (vLLM's JSON: {"pooling_type": "LAST" | "MEAN" |
"CLS", "normalize": true}) overrides it; with neither, decoder embedding models' convention: the last token, normalized
(Qwen3-Embedding, e5-mistral). Matryoshka checkpoints (config.json `matryoshka_dimensions` or `is_matryoshka`) allow a
request's `dimensions`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' pooling modes (`pooling_mode` in v6 configs, a pooling_mode_* flag each before) we pool by
_ST_MODES = {"lasttoken": "LAST", "mean": "MEAN", "mean_tokens": "MEAN", "cls": "CLS", "cls_token": "CLS"}


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """The model's pooling, resolved once at start-up."""

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka: tuple[int, ...] | bool = False  # the dimensions a request may ask for (True: any up to the size)
    source: str = "default"  # where it came from, for the start-up log
    size: int = 0  # the vectors' length: the model's hidden size

    @property
    def every_row(self) -> bool:
        """Whether the pooling reads every token's hidden state (MEAN, CLS), not only the last one's."""
        return self.pooling_type != "LAST"

    def check_dimensions(self, dimensions: int, hidden_size: int) -> None:
        """ValueError naming `dimensions` when this model cannot give vectors of that size."""
        if not self.matryoshka:
            raise ValueError(f"dimensions: this model gives {hidden_size}-dimensional embeddings only (its config "
                             "declares no matryoshka_dimensions)")
        allowed = self.matryoshka if isinstance(self.matryoshka, tuple) else None
        if allowed is not None and dimensions not in allowed:
            raise ValueError(f"dimensions: {dimensions} is not one of the model's matryoshka_dimensions "
                             f"{list(allowed)}")
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(f"dimensions: must be in [1, {hidden_size}], got {dimensions}")


def _read(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"pooler: cannot read {path}: {e}") from None


def _from_sentence_transformers(model_dir: str) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from modules.json and its Pooling module's config (None where it says nothing)."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None, None
    modules = _read(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"pooler: {modules_path} must hold a list of modules")
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else ""  # (v6 moved the modules)
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            cfg = _read(os.path.join(model_dir, str(m.get("path", "")), "config.json"))
            mode = cfg.get("pooling_mode")
            modes = [mode] if isinstance(mode, str) else \
                [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
            if len(modes) != 1 or modes[0] not in _ST_MODES:
                raise ValueError(f"pooler: {model_dir}'s Pooling module pools by {modes or 'no mode'}; this server "
                                 f"pools by exactly one of lasttoken, mean, cls")
            pooling = _ST_MODES[modes[0]]
            if cfg.get("include_prompt") is False and pooling != "LAST":
                raise ValueError(f"pooler: {model_dir}'s Pooling module leaves the prompt out of the {modes[0]} "
                                 "(include_prompt false), which this server does not")
    return pooling, normalize


def resolve_pooler_config(model_dir: str, hf_config: dict[str, Any], hidden_size: int,
                          override: str | dict[str, Any] | None) -> PoolerConfig:
    """The model's pooling: --pooler-config over the sentence-transformers config over the default (ValueError
    naming a bad field)."""
    given: dict[str, Any] = {}
    if override is not None:
        try:
            given = json.loads(override) if isinstance(override, str) else dict(override)
        except ValueError as e:
            raise ValueError(f"pooler_config: not valid JSON ({e})") from None
        if not isinstance(given, dict):
            raise ValueError("pooler_config: expected a JSON object such as {\"pooling_type\": \"MEAN\"}")
        unknown = sorted(set(given) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler_config: unknown field(s) {unknown}; known: pooling_type, normalize")
    st_type, st_norm = _from_sentence_transformers(model_dir) if os.path.isdir(model_dir) else (None, None)
    pooling = given.get("pooling_type", st_type or "LAST")
    if not isinstance(pooling, str) or pooling.upper() not in POOLING_TYPES:
        raise ValueError(f"pooler_config: pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling!r}")
    normalize = given.get("normalize", st_norm if st_norm is not None else True)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config: normalize must be true or false, got {normalize!r}")
    dims = hf_config.get("matryoshka_dimensions")
    matryoshka: tuple[int, ...] | bool = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else \
        bool(hf_config.get("is_matryoshka"))
    source = "pooler_config" if given else "sentence-transformers config" if st_type is not None else "default"
    return PoolerConfig(pooling.upper(), normalize, matryoshka, source, hidden_size)
