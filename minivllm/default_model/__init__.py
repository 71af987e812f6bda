"""The embedded default model: a small Llama of Python source and its draft, trained here by
tools/train_tiny.py and shipped in the package, so that Mini-vLLM answers offline with no model given."""

from __future__ import annotations

import os

# Directory names double as the served model names (the API names a model by its directory).
MAIN_NAME = "minivllm-py-12m"
DRAFT_NAME = "minivllm-py-1m-draft"
_ROOT = os.path.dirname(os.path.abspath(__file__))


def _path(name: str) -> str:
    path = os.path.join(_ROOT, name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model: the embedded default model is missing from {path}; reinstall minivllm "
                                "or give a model directory")
    return path


def default_model_path() -> str:
    """The embedded main model's directory."""
    return _path(MAIN_NAME)


def default_draft_model_path() -> str:
    """The embedded draft model's directory (shares the main model's tokenizer)."""
    return _path(DRAFT_NAME)


def held_out_path() -> str:
    """held_out.safetensors: the held-out token ids and the training unigram counts (corpus.load_held_out)."""
    return os.path.join(_ROOT, "held_out.safetensors")


def training_metrics_path() -> str:
    """metrics.json of the training run: held-out files, perplexities, unigram baseline."""
    return os.path.join(_ROOT, "metrics.json")
