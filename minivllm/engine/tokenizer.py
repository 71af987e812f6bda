"""Tokenizer loading (HF tokenizers through transformers' AutoTokenizer), offline only."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a model directory; a clear error when the directory has none."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"tokenizer: no tokenizer.json / tokenizer.model / vocab.json in {path!r}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
