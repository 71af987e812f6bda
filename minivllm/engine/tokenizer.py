"""Tokenizer loading (HF tokenizers through transformers' AutoTokenizer), offline only."""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a model directory; a clear error when the directory has none."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"tokenizer: no tokenizer.json / tokenizer.model / vocab.json in {path!r}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, chat_template: str | None = None) -> dict[str, Any]:
    """A conversation → {"prompt", "prompt_token_ids"} through the tokenizer's chat template."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template)
    except Exception as e:  # no template, or the template rejects the conversation (raise_exception in jinja)
        raise ValueError(f"messages: cannot apply the chat template: {e}") from None
    # The template already holds any BOS it wants: do not add special tokens again.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
