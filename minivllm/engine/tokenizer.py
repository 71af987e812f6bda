"""Tokenizer loading (HF tokenizers through transformers' AutoTokenizer), offline only."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a model directory (or built from a GGUF file's metadata); a clear error when the
    directory has none."""
    from minivllm.model.gguf_checkpoint import find_gguf, load_tokenizer

    gguf = find_gguf(path)
    if gguf is not None:
        return load_tokenizer(gguf)
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"tokenizer: no tokenizer.json / tokenizer.model / vocab.json in {path!r}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"tokenizer: cannot load the tokenizer of {path!r}: {e}") from None
    except Exception as e:  # transformers validates config.json on the way (a strict-dataclass error, say)
        raise ValueError(f"model: {path}/config.json is refused by transformers: {e}") from None
