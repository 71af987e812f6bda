"""Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`): the text a thinking model writes inside
<think> ... </think> goes to the message's `reasoning_content` (and `reasoning`, the name vLLM uses now), the rest
to `content`; streamed, each as its own deltas, with tags split across tokens held back until they are whole.

- qwen3: the reply thinks when it opens with <think> (Qwen3 with enable_thinking), or when the prompt left a
  <think> open (templates that start the thinking for the model); otherwise it is all content.
- deepseek_r1: the reply always starts in the thinking (R1's template opens it); a leading <think> is dropped.
Both: everything before </think> is reasoning (a reply cut off inside it has no content); the newlines that
separate </think> from the answer are dropped.
"""

from __future__ import annotations

from typing import Any

from minivllm.entrypoints.tool_parsers import partial_suffix
from minivllm.structured_output.reasoning import THINK_END, THINK_START, prompt_opens_thinking

Delta = dict[str, Any]


def reasoning_delta(text: str) -> Delta:
    """A delta (or message fields) carrying reasoning text under both names clients read."""
    return {"reasoning_content": text, "reasoning": text}


class ReasoningParser:
    """One reply's split into reasoning and content, whole (`split`) or streamed (`feed`/`finish`)."""

    name = ""
    always_thinks = False

    def __init__(self, prompt: str | None = None) -> None:
        thinking = self.always_thinks or prompt_opens_thinking(prompt or "")
        self.state = "reasoning" if thinking else "start"  # start: undecided, it may still open with <think>
        self.buffer = ""
        self.strip_newlines = False  # just after </think>: the separating newlines are dropped

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply."""
        deltas = self.feed(text) + self.finish()
        reasoning = "".join(d["reasoning_content"] for d in deltas if "reasoning_content" in d)
        content = "".join(d["content"] for d in deltas if "content" in d)
        return reasoning or None, content or None

    def feed(self, delta: str) -> list[Delta]:
        """The deltas a piece of the reply makes: reasoning text, then (after </think>) content."""
        self.buffer += delta
        out: list[Delta] = []
        if self.state == "start":
            head = self.buffer.lstrip()
            if not head or THINK_START.startswith(head):
                return out  # may still be "<think>"
            if head.startswith(THINK_START):
                self.buffer = head[len(THINK_START):]
                self.state = "reasoning"
            else:
                self.state = "content"
        if self.state == "reasoning":
            if self.always_thinks and self.buffer.lstrip().startswith(THINK_START):
                self.buffer = self.buffer.lstrip()[len(THINK_START):]
            end = self.buffer.find(THINK_END)
            if end < 0:
                keep = partial_suffix(self.buffer, THINK_END)
                if len(self.buffer) > keep:
                    out.append(reasoning_delta(self.buffer[:len(self.buffer) - keep]))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            if end:
                out.append(reasoning_delta(self.buffer[:end]))
            self.buffer = self.buffer[end + len(THINK_END):]
            self.state, self.strip_newlines = "content", True
        if self.strip_newlines:
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return out
            self.strip_newlines = False
        if self.buffer:
            out.append({"content": self.buffer})
            self.buffer = ""
        return out

    def finish(self) -> list[Delta]:
        """What was held back (a partial tag that never completed), at the end of the reply."""
        text, self.buffer = self.buffer, ""
        if not text:
            return []
        if self.state == "reasoning":
            return [reasoning_delta(text)]
        self.state = "content"
        return [{"content": text}]


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and SmolLM3): <think> ... </think> when the model thinks."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: the reply is reasoning until </think>."""

    name = "deepseek_r1"
    always_thinks = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3ReasoningParser,
                                                                           DeepSeekR1ReasoningParser)}
