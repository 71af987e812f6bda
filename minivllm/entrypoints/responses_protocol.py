"""Request bodies of OpenAI's Responses API (POST /v1/responses), and their translation into the chat-template
messages, tools and tool choice of the shared chat pipeline (chat_serving.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from minivllm.entrypoints.tool_calls import ChatTool, FunctionDefinition, NamedFunction, NamedToolChoice, ToolChoice
from minivllm.sampling_params import GuidedDecodingParams


class _Item(BaseModel):
    # The official client sends ids, statuses and fields of features we do not serve: ignored, as vLLM does.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Item):
    """A message's text: input_text (user, system) or output_text (an earlier assistant reply)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class OtherPart(_Item):
    """input_image, input_file, ...: refused by name (this server's models read text only)."""

    type: Literal["input_image", "input_file", "input_audio", "refusal"]


Part = Annotated[TextPart | OtherPart, Field(discriminator="type")]


class MessageItem(_Item):
    """{"role", "content"} with or without "type": "message"."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]

    def text(self, where: str) -> str:
        """The message's text (ValueError naming a part it cannot take)."""
        if isinstance(self.content, str):
            return self.content
        for j, p in enumerate(self.content):
            if isinstance(p, OtherPart):
                raise ValueError(f"{where}.content.{j}: {p.type} parts are not supported (this server's model reads "
                                 "text only)")
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


class FunctionCallItem(_Item):
    """An earlier call the model made: {"type": "function_call", "call_id", "name", "arguments"}."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    """What the client's function returned: {"type": "function_call_output", "call_id", "output"}."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningItem(_Item):
    """An earlier reply's reasoning: dropped from the history (the chat templates drop earlier thinking too)."""

    type: Literal["reasoning"]


def _item_type(v: Any) -> str:
    return v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(_Item):
    """{"type": "function", "name", "description", "parameters", "strict"}."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Item):
    """tool_choice naming one function."""

    type: Literal["function"]
    name: str


class TextFormat(_Item):
    """text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema"}."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` is pydantic's own attribute name: kept under an alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Item):
    """The request's `text`: its output format."""

    format: TextFormat | None = None


class ResponsesRequest(_Item):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)

    def chat_messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as chat-template messages: this request's instructions as the system turn, the earlier
        responses' turns (`history`; their instructions are not carried over, as OpenAI's are not), then the input
        (ValueError naming an item this server cannot take)."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        out += history
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text(f"input.{i}")})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":  # the reply that made the call, or its siblings
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        return out

    def chat_tools(self) -> tuple[list[ChatTool] | None, ToolChoice | None]:
        """(tools, tool_choice) in chat completions' terms."""
        tools = [ChatTool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
            for t in self.tools or ()] or None
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return tools, NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        return tools, ("auto" if choice is None and tools else choice)

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """text.format as a constraint (None for plain text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return GuidedDecodingParams(json_object=True)
        return GuidedDecodingParams(json=fmt.json_schema if fmt.json_schema is not None else {})
