"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), and their translation
into the chat-template messages, tools and tool choice the shared chat pipeline takes (chat_serving.py)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from minivllm.entrypoints.tool_calls import ChatTool, FunctionDefinition, NamedFunction, NamedToolChoice, ToolChoice
from minivllm.sampling_params import GuidedDecodingParams


class _Block(BaseModel):
    # Clients send fields we have no use for (cache_control, citations): ignored, as Anthropic-compatible servers do.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Block):
    """{"type": "text", "text"}."""

    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    """{"type": "image", "source"}: refused by name (this server's models read text only)."""

    type: Literal["image"]
    source: dict[str, Any] | None = None


class ToolUseBlock(_Block):
    """An assistant's earlier call: {"type": "tool_use", "id", "name", "input"}."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """What a call returned: {"type": "tool_result", "tool_use_id", "content", "is_error"}."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    """An assistant's earlier thinking (dropped from the history, as Anthropic's own models drop earlier turns')."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class AnthropicMessage(_Block):
    """One turn of the conversation."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Block):
    """A client tool: {"name", "description", "input_schema"}."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(_Block):
    """{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Block):
    """{"type": "enabled", "budget_tokens"} or {"type": "disabled"}: passed to the chat template (Qwen3's
    enable_thinking)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(_Block):
    """output_config.format: {"type": "json_schema", "schema"} (Anthropic's structured outputs)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    """output_config: the reply's format (effort is a hosted model's setting: ignored)."""

    format: OutputFormat | None = None


# Anthropic's tool_choice types in chat completions' terms ("tool", naming one, is a NamedToolChoice)
_CHOICES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


class CountTokensRequest(_Block):
    """POST /v1/messages/count_tokens."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages (OpenAI's roles; ValueError naming a block we cannot take)."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            text, calls = [], []
            for j, block in enumerate(m.content):
                if isinstance(block, ImageBlock):
                    raise ValueError(f"messages.{i}.content.{j}: image blocks are not supported (this server's "
                                     "model reads text only)")
                if isinstance(block, TextBlock):
                    text.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    if m.role != "assistant":
                        raise ValueError(f"messages.{i}.content.{j}: tool_use blocks belong to assistant turns")
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": json.dumps(block.input)}})
                elif isinstance(block, ToolResultBlock):
                    if m.role != "user":
                        raise ValueError(f"messages.{i}.content.{j}: tool_result blocks belong to user turns")
                    result = block.content if isinstance(block.content, str) else \
                        "".join(b.text for b in block.content or ())
                    # (the chat templates know results as "tool" turns, one per call)
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": f"Error: {result}" if block.is_error else result})
            if text or calls or not m.content:
                turn: dict[str, Any] = {"role": m.role, "content": "".join(text)}
                if calls:
                    turn["tool_calls"] = calls
                out.append(turn)
        return out

    def chat_tools(self) -> tuple[list[ChatTool] | None, ToolChoice | None, bool | None]:
        """(tools, tool_choice, parallel_tool_calls) in OpenAI's terms: auto stays auto, any is required, tool
        names one, none is none."""
        tools = [ChatTool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.input_schema)) for t in self.tools or ()] or None
        c = self.tool_choice
        if c is None:
            return tools, ("auto" if tools else None), None
        parallel = False if c.disable_parallel_tool_use else None
        if c.type == "tool":
            if c.name is None:
                raise ValueError('tool_choice: type "tool" needs the name of the tool')
            return tools, NamedToolChoice(type="function", function=NamedFunction(name=c.name)), parallel
        return tools, _CHOICES[c.type], parallel

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: thinking on or off when the request says."""
        if self.thinking is None or self.thinking.type == "adaptive":
            return {}
        return {"enable_thinking": self.thinking.type == "enabled"}


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """output_config.format as a constraint."""
        fmt = self.output_config.format if self.output_config is not None else None
        return GuidedDecodingParams(json=fmt.json_schema) if fmt is not None else None
