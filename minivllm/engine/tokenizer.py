"""Tokenizer loading (HF tokenizers through transformers' AutoTokenizer), offline only."""

from __future__ import annotations

import os
from typing import Any, cast

import torch._dynamo  # noqa: F401
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minivllm.engine.input_processor import check_unicode

# torch._dynamo imported here, at module import, rather than lazily by the first AutoTokenizer load (via
# transformers' torch.compiler.disable): its import runs torch.fx.wrap, whose frame holds itself, so every
# frame on the stack at that moment stays alive in a reference cycle. Reached lazily, those frames
# included LLMEngine.__init__'s, and the first engine of a process (weights, KV pool) outlived `del` until
# the cyclic collector happened to run.


def get_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a model directory; a clear error when the directory has none."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"tokenizer: no tokenizer.json / tokenizer.model / vocab.json in {path!r}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"tokenizer: cannot load the tokenizer of {path!r}: {e}") from None
    except Exception as e:  # transformers validates config.json on the way (a strict-dataclass error, say)
        raise ValueError(f"model: {path}/config.json is refused by transformers: {e}") from None


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, chat_template: str | None = None,
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """A conversation → {"prompt", "prompt_token_ids"} through the tokenizer's chat template (shown `tools`, the
    OpenAI tool definitions, when given; `template_kwargs` are extra template variables, as Qwen3's
    enable_thinking)."""
    try:
        # tokenize=False: the rendered text (transformers types the result as every form the call can return, and
        # `tools` as a list of schemas or functions, which a list of schemas is not to mypy: lists are invariant)
        text = cast(str, tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            tools=cast(list[Any] | None, tools), **(template_kwargs or {})))
    except Exception as e:  # no template, or the template rejects the conversation (raise_exception in jinja)
        raise ValueError(f"messages: cannot apply the chat template: {e}") from None
    check_unicode(text, "messages")  # a lone surrogate is no text the tokenizer can take
    # The template already holds any BOS it wants: do not add special tokens again.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
