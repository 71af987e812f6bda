"""An assistant reply of /v1/chat/completions as OpenAI's message or stream deltas: the thinking split off first
(reasoning.py, with --reasoning-parser), then tool calls read from the answer alone (tool_calls.py)."""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_delta
from minivllm.entrypoints.tool_calls import ToolPlan, ToolStream, parse_reply

Delta = dict[str, Any]


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
    if not plan.calls_tools:
        message["content"] = text if text or reasoner is None else None
        return message
    content, calls = parse_reply(plan, text)
    message.update(content=content, tool_calls=calls)
    return message


class ChoiceStream:
    """One streamed choice: text deltas in, chunk deltas out (reasoning, content, tool calls)."""

    def __init__(self, plan: ToolPlan, reasoning_parser: str | None, prompt: str | None) -> None:
        self.reasoner = _reasoner(reasoning_parser, prompt)
        self.tools = ToolStream(plan) if plan.calls_tools else None

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
