"""Thinking models (`reasoning_parser`): where a reply's reasoning ends, for the features that apply to the answer
only. Guided decoding (and so forced tool calls) constrains what follows </think>: a guided sequence of a thinking
request gets its grammar's matcher once </think> is in its output text (the tag may arrive split across tokens),
or at once when the prompt already closed the thinking (Qwen3's template with enable_thinking=false writes an
empty <think></think> block). Until then its rows are sampled unmasked, as vLLM's reasoning-aware structured
output does."""

from __future__ import annotations

REASONING_PARSER_NAMES = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the prompt ends inside a thinking block (its template opened <think> for the model)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def prompt_closes_thinking(prompt: str) -> bool:
    """Whether the prompt's last thinking block is closed, so the reply starts with the answer."""
    return prompt.rfind(THINK_END) > prompt.rfind(THINK_START)


def reasoning_ended(output_text: str) -> bool:
    """Whether a reply's reasoning is over."""
    return THINK_END in output_text
