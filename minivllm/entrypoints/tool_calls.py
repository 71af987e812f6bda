"""OpenAI tool calling on /v1/chat/completions: the request's tools and tool_choice, the constraint that makes a
forced call's arguments parse, and reading calls back out of the generated text (OpenAI's `tool_calls` shape).

- tool_choice "none" (or no tools): a plain reply; the template is not shown the tools.
- a named function: guided JSON with that function's parameters schema; the whole output is its arguments.
- "required": guided JSON, an array of {"name", "parameters"} objects (one of the tools each), vLLM's schema.
- "auto": the model decides; with `--enable-auto-tool-choice --tool-call-parser NAME` the calls the reply writes
  in that model's format (tool_parsers.py: hermes, llama3_json, mistral, pythonic) become tool_calls and the rest
  stays content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from minivllm.entrypoints.tool_parsers import TOOL_PARSERS, tool_call
from minivllm.sampling_params import GuidedDecodingParams

TOOL_CALL_PARSERS = tuple(TOOL_PARSERS)


class FunctionDefinition(BaseModel):
    """A function the model may call."""

    model_config = ConfigDict(strict=True)

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments object
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of `tools`."""

    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    """tool_choice's function: which one."""

    model_config = ConfigDict(strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """tool_choice forcing one function."""

    model_config = ConfigDict(strict=True)

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(slots=True)
class ToolPlan:
    """How one request uses its tools: its mode, the constraint it generates under, and what the template sees."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None  # passed to the chat template
    constraint: GuidedDecodingParams | None = None
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the format the calls are read in (tool_parsers.py)

    @property
    def calls_tools(self) -> bool:
        """Whether the reply is read for tool calls."""
        return self.mode != "none"


def plan_tools(tools: list[ChatTool] | None, choice: ToolChoice | None, parallel: bool | None,
               auto_parser: str | None) -> ToolPlan:
    """The request's ToolPlan; ValueError naming the field when tools and tool_choice do not fit together."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
        return ToolPlan("none", None)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    as_dicts = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan("none", None)
    if choice == "auto":
        if auto_parser is None:
            raise ValueError('tool_choice: "auto" needs the server started with --enable-auto-tool-choice and '
                             '--tool-call-parser; use "required" or a named function, or tool_choice "none"')
        return ToolPlan("auto", as_dicts, parser=auto_parser)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolPlan("required", as_dicts, GuidedDecodingParams(json=schema))
    assert isinstance(choice, NamedToolChoice)
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise ValueError(f"tool_choice: function {choice.function.name!r} is not among tools ({', '.join(names)})")
    return ToolPlan("named", as_dicts, GuidedDecodingParams(json=_parameters(tool)), tool.function.name)


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's earlier calls carry their arguments as objects
    (OpenAI sends them as JSON text; templates render them with tojson)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = dict(m, tool_calls=[_call_for_template(c) for c in calls])
        out.append(m)
    return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("messages: an assistant tool call needs function.name and function.arguments")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ValueError(f"messages: tool call {fn['name']!r} has arguments that are not JSON") from None
    return dict(call, function=dict(fn, arguments=args))


def parse_reply(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished reply."""
    if plan.mode == "named":
        assert plan.name is not None
        return None, [tool_call(plan.name, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
        except ValueError:  # cut off by max_tokens: what there is stays content
            return text, []
        return None, [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    if plan.mode == "auto":
        assert plan.parser is not None
        return TOOL_PARSERS[plan.parser]().parse(text)
    return text, []


class ToolStream:
    """One streamed choice's tool-call deltas (OpenAI's chunk shape: delta.tool_calls[i] with an index; the first
    delta of a call carries its id, type and name)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # required: the array so far (sent whole once it parses, at the end)
        self.calls = 0  # tool calls sent
        self._named_open = False
        self.parser = TOOL_PARSERS[plan.parser]() if plan.mode == "auto" and plan.parser else None

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The chunk deltas a piece of generated text makes ({"content": ...} or {"tool_calls": [...]})."""
        if self.plan.mode == "named":
            out = []
            if not self._named_open:
                self._named_open = True
                call = tool_call(self.plan.name or "", "")
                out.append({"tool_calls": [{"index": 0, **call}]})
                self.calls = 1
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if self.plan.mode == "required":
            self.text += delta
            return []
        if self.parser is not None:
            out = self.parser.feed(delta)
            self.calls = self.parser.calls
            return out
        return [{"content": delta}] if delta else []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was held back, at the end of the reply."""
        if self.plan.mode == "required":
            text, self.text = self.text, ""
            content, calls = parse_reply(self.plan, text)
            self.calls = len(calls)
            deltas = [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]
            return deltas if calls else ([{"content": content}] if content else [])
        if self.parser is not None:
            out = self.parser.finish()
            self.calls = self.parser.calls
            return out
        return []

    def finish_reason(self, reason: str | None) -> str | None:
        """The stream's finish reason (see finish_reason)."""
        return finish_reason(self.plan, reason, self.calls)


def finish_reason(plan: ToolPlan, reason: str | None, num_calls: int) -> str | None:
    """OpenAI's: "tool_calls" when the reply made calls (a named choice keeps "stop", as OpenAI's does)."""
    return "tool_calls" if reason == "stop" and num_calls and plan.mode in ("auto", "required") else reason
