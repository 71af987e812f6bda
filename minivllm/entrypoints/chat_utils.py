"""Chat in the front end (vLLM's entrypoints/chat_utils.py), both ways: a conversation becomes a prompt through the
checkpoint's chat template, as transformers renders it, before any request reaches the engine; an assistant reply
becomes OpenAI's message or stream deltas: the thinking split off first (reasoning.py, with --reasoning-parser), then
tool calls read from the answer alone (tool_calls.py)."""

from __future__ import annotations

from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from minivllm.engine.input_processor import check_unicode
from minivllm.entrypoints.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_delta
from minivllm.entrypoints.tool_calls import ToolPlan, ToolStream, parse_reply

Delta = dict[str, Any]


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


# ---- the reply -------------------------------------------------------------------------------
def _reasoner(name: str | None, prompt: str | None) -> ReasoningParser | None:
    return REASONING_PARSERS[name](prompt) if name is not None else None


def chat_message(plan: ToolPlan, text: str, reasoning_parser: str | None, prompt: str | None) -> dict[str, Any]:
    """The assistant's message of a whole reply: content (and tool_calls with tools; reasoning_content and
    reasoning for a thinking model)."""
    message: dict[str, Any] = {"role": "assistant"}
    reasoner = _reasoner(reasoning_parser, prompt)
    if reasoner is not None:
        reasoning, answer = reasoner.split(text)
        message.update(reasoning_delta(reasoning) if reasoning is not None else {"reasoning_content": None,
                                                                               "reasoning": None})
        text = answer or ""
    if plan.mode == "none":  # (not plan.calls_tools: tool_calls.py stays off a tool-less reply's path)
        message["content"] = text if text or reasoner is None else None
        return message
    content, calls = parse_reply(plan, text)
    message.update(content=content, tool_calls=calls)
    return message


class ChoiceStream:
    """One streamed choice: text deltas in, chunk deltas out (reasoning, content, tool calls)."""

    def __init__(self, plan: ToolPlan, reasoning_parser: str | None, prompt: str | None) -> None:
        self.reasoner = _reasoner(reasoning_parser, prompt)
        self.tools = ToolStream(plan) if plan.mode != "none" else None

    def feed(self, text: str, finished: bool) -> list[Delta]:
        """The deltas of a piece of the reply (and, when it is the last piece, of everything held back)."""
        parts: list[Delta] = [{"content": text}] if text else []
        if self.reasoner is not None:
            parts = self.reasoner.feed(text) + (self.reasoner.finish() if finished else [])
        out: list[Delta] = []
        for d in parts:
            if "content" in d and self.tools is not None:
                out += self.tools.feed(d["content"])
            else:
                out.append(d)
        if finished and self.tools is not None:
            out += self.tools.finish()
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" when the reply made calls (see tool_calls.finish_reason)."""
        return self.tools.finish_reason(reason) if self.tools is not None else reason
