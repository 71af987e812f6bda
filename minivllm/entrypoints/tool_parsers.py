"""Tool calls in the formats models write them (`--tool-call-parser`), read from a whole reply or as it streams.

- hermes (Qwen2.5/Qwen3, Hermes, SmolLM3): <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks
  anywhere in the reply; the rest is content.
- llama3_json (Llama 3.x): the reply is one or more JSON objects {"name": ..., "parameters": {...}} (or
  "arguments"), separated by ";", optionally after <|python_tag|>; a reply that does not start so is content.
- mistral: content, then [TOOL_CALLS] and a JSON array of {"name", "arguments"} (v3-v7 tokenizers) or, from v11,
  [TOOL_CALLS]name[ARGS]{...} per call.
- pythonic (Llama 3.2 / 4): the reply is a Python list of calls, [get_weather(city="Paris"), add(a=1, b=2)],
  optionally inside <|python_start|> ... <|python_end|>; keyword arguments must be literals.

Every call comes out in OpenAI's shape, its arguments a JSON string (never an object); streamed, each call is one
delta {"tool_calls": [{"index": i, "id", "type", "function": {"name", "arguments"}}]} with i counting the reply's
calls from 0, sent once the call is complete. Text that looks like a call but does not parse stays content, as
written: a malformed call from the model is the client's to see, never an error.
"""

from __future__ import annotations

import ast
import json
import uuid
from typing import Any

Delta = dict[str, Any]


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of a message's tool_calls."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_from_obj(obj: Any) -> dict[str, Any] | None:
    """{"name", "arguments" | "parameters"} → a tool call; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return tool_call(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return tool_call(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back while streaming: it may
    become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolParser:
    """One reply's tool-call reader. `parse` takes a whole reply; `feed`/`finish` take it as it streams and return
    the chunk deltas to send (content, or a complete call with its index)."""

    name = ""
    # Its markers may be special tokens (Mistral's [TOOL_CALLS], Llama's <|python_tag|>): replies read for tool
    # calls are detokenized with special tokens kept (vLLM's adjust_request).
    keeps_special_tokens = True

    def __init__(self) -> None:
        self.calls = 0  # calls sent so far (the next call's index)
        self.buffer = ""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole reply."""
        raise NotImplementedError

    def feed(self, delta: str) -> list[Delta]:
        """The deltas a piece of the reply makes (by default held until the end: see the subclasses)."""
        self.buffer += delta
        return []

    def finish(self) -> list[Delta]:
        """The deltas of what was held back, at the end of the reply."""
        text, self.buffer = self.buffer, ""
        content, calls = self.parse(text)
        return self._deltas(content, calls)

    def _deltas(self, content: str | None, calls: list[dict[str, Any]]) -> list[Delta]:
        out: list[Delta] = [{"content": content}] if content else []
        for call in calls:
            out.append({"tool_calls": [{"index": self.calls, **call}]})
            self.calls += 1
        return out


class HermesToolParser(ToolParser):
    """<tool_call>{...}</tool_call> blocks: content streams as it comes, each block goes out when it closes."""

    name = "hermes"
    keeps_special_tokens = False  # <tool_call> is plain text in the tokenizers that use it (Qwen, Hermes)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        content, calls, rest = [], [], text
        while (start := rest.find(self.OPEN)) >= 0:
            end = rest.find(self.CLOSE, start)
            if end < 0:
                break
            call = self._block(rest[start + len(self.OPEN):end])
            content.append(rest[:start] if call is not None else rest[:end + len(self.CLOSE)])
            if call is not None:
                calls.append(call)
            rest = rest[end + len(self.CLOSE):]
        content.append(rest)
        joined = "".join(content)
        if calls:
            return joined.strip() or None, calls
        return joined, calls

    @staticmethod
    def _block(body: str) -> dict[str, Any] | None:
        try:
            return _call_from_obj(json.loads(body))
        except ValueError:
            return None

    def feed(self, delta: str) -> list[Delta]:
        self.buffer += delta
        out: list[Delta] = []
        while True:
            start = self.buffer.find(self.OPEN)
            if start < 0:
                keep = partial_suffix(self.buffer, self.OPEN)  # maybe the start of "<tool_call>"
                if len(self.buffer) > keep:
                    out.append({"content": self.buffer[:len(self.buffer) - keep]})
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            if start:
                out.append({"content": self.buffer[:start]})
                self.buffer = self.buffer[start:]
            end = self.buffer.find(self.CLOSE)
            if end < 0:
                return out
            block = self.buffer[:end + len(self.CLOSE)]
            self.buffer = self.buffer[end + len(self.CLOSE):]
            call = self._block(block[len(self.OPEN):-len(self.CLOSE)])
            out += self._deltas(None, [call]) if call is not None else [{"content": block}]

    def finish(self) -> list[Delta]:
        text, self.buffer = self.buffer, ""
        return [{"content": text}] if text else []


class _LeadingCallsParser(ToolParser):
    """A reply that is either tool calls from its first character (after whitespace and an optional tag) or plain
    content: streamed content as soon as it cannot be calls; calls held until the reply ends."""

    starts: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.mode: str | None = None  # None (undecided), "content" or "calls"

    def feed(self, delta: str) -> list[Delta]:
        self.buffer += delta
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head or any(s.startswith(head) for s in self.starts):
                return []  # could still become a call
            self.mode = "calls" if head.startswith(self.starts) else "content"
        if self.mode == "content":
            text, self.buffer = self.buffer, ""
            return [{"content": text}] if text else []
        return []

    def finish(self) -> list[Delta]:
        text, self.buffer = self.buffer, ""
        if self.mode == "content":
            return [{"content": text}] if text else []
        return self._deltas(*self.parse(text))


class Llama3JsonToolParser(_LeadingCallsParser):
    """Llama 3.x's JSON tool calls."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    starts = ("{", TAG)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip()
        body = body.removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_from_obj(obj)
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls


class PythonicToolParser(_LeadingCallsParser):
    """Llama 3.2 / 4's pythonic tool calls: a Python list of calls with literal keyword arguments."""

    name = "pythonic"
    OPEN, CLOSE = "<|python_start|>", "<|python_end|>"
    starts = ("[", OPEN)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        body = text.strip().removeprefix(self.OPEN).removesuffix(self.CLOSE).strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, SyntaxError, TypeError):
                return text, []
            if len(args) != len(node.keywords):
                return text, []  # **kwargs
            try:
                calls.append(tool_call(node.func.id, json.dumps(args, ensure_ascii=False)))
            except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, a complex number)
                return text, []
        return None, calls


class MistralToolParser(ToolParser):
    """Mistral's [TOOL_CALLS]: content streams until the marker, calls are read at the end."""

    name = "mistral"
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self.in_calls = False

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        start = text.find(self.MARK)
        if start < 0:
            return text, []
        calls = self._calls(text[start:])
        if calls is None:
            return text, []
        return text[:start].strip() or None, calls

    def _calls(self, text: str) -> list[dict[str, Any]] | None:
        parts = [p.strip() for p in text.split(self.MARK) if p.strip()]
        if not parts:
            return None
        calls: list[dict[str, Any]] = []
        for part in parts:
            if self.ARGS in part:  # v11+: name[ARGS]{...}
                name, _, args = part.partition(self.ARGS)
                call = _call_from_obj({"name": name.strip(), "arguments": args.strip()})
                if call is None:
                    return None
                calls.append(call)
                continue
            try:
                value, end = json.JSONDecoder().raw_decode(part)
            except ValueError:
                return None
            if part[end:].strip():
                return None
            for obj in value if isinstance(value, list) else [value]:
                call = _call_from_obj(obj)
                if call is None:
                    return None
                calls.append(call)
        return calls or None

    def feed(self, delta: str) -> list[Delta]:
        self.buffer += delta
        if self.in_calls:
            return []
        start = self.buffer.find(self.MARK)
        if start >= 0:
            self.in_calls = True
            head, self.buffer = self.buffer[:start], self.buffer[start:]
            return [{"content": head}] if head else []
        keep = partial_suffix(self.buffer, self.MARK)
        text, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return [{"content": text}] if text else []

    def finish(self) -> list[Delta]:
        text, self.buffer = self.buffer, ""
        if not self.in_calls:
            return [{"content": text}] if text else []
        calls = self._calls(text)
        return self._deltas(None, calls) if calls is not None else [{"content": text}]


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}
