"""Chat rendering in the front end (vLLM's entrypoints/chat_utils.py): a conversation becomes a prompt through the
checkpoint's chat template, as transformers renders it, before any request reaches the engine."""

from __future__ import annotations

from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from minivllm.engine.input_processor import check_unicode


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
