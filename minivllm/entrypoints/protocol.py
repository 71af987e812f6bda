"""Request bodies of the HTTP API (pydantic validates types; SamplingParams validates values)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from minivllm.entrypoints.tool_calls import ChatTool, ToolChoice
from minivllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

# chat_template_kwargs: a few variables, none of those apply_chat_template takes from the request itself.
MAX_TEMPLATE_KWARGS = 16
RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template",
                            "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
                            "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                            "tokenizer_kwargs"}

class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` object: one of its constraint fields."""

    model_config = ConfigDict(strict=True, extra="forbid")

    # `json` is a BaseModel method's name: the attribute is json_, the field "json".
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema."""

    model_config = ConfigDict(strict=True)

    name: str
    description: str | None = None
    # `schema` is pydantic's own attribute name: kept under an alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, Any]:
        """GuidedDecodingParams fields of a json_object / json_schema format."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a json_schema object")
        # OpenAI's strict mode is what guided decoding always gives (the output follows the schema); a schema-less
        # json_schema means any JSON value.
        return {"json": self.json_schema.json_schema if self.json_schema.json_schema is not None else {}}


class SamplingFields(BaseModel):
    """Sampling fields shared by every endpoint (None: SamplingParams' default)."""

    # Types are strict (SPEC §4): `false` is not a number, `0` is not a boolean, "2" is not an integer. Lax
    # coercion would run a request the client did not mean (max_tokens=true as 1); subclasses inherit this.
    model_config = ConfigDict(strict=True)

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Scheduling, not sampling: an int (lower is served sooner) or a class name (interactive, batch, background),
    # and a TTFT SLO overriding the class's (slo.py; values are checked where every API's are, InputProcessor).
    priority: StrictInt | StrictStr = 0
    ttft_slo_ms: StrictFloat | None = None
    # Seconds the request may wait to start; past it, it is dropped before any prefill (503 with Retry-After).
    timeout: StrictFloat | None = None
    # Guided decoding, vLLM's fields (structured_output/manager.py): one constraint per request.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's newer spelling of the same

    def guided_decoding(self, response_format: ResponseFormat | None = None) -> GuidedDecodingParams | None:
        """The request's constraint from whichever spelling it used; ValueError naming the field when several
        are given or the backend is not ours."""
        found: list[tuple[str, dict[str, Any]]] = []
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.model_dump(exclude_none=True, by_alias=True)))
        if response_format is not None and response_format.type != "text":
            found.append(("response_format", response_format.constraint()))
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise ValueError(f"guided_decoding_backend: {self.guided_decoding_backend!r} is not available; this "
                             "server's guided decoding runs on llguidance ('guidance')")
        if not found:
            if self.guided_whitespace_pattern is not None:
                raise ValueError("guided_whitespace_pattern: applies only together with a JSON constraint")
            return None
        if len(found) > 1:
            raise ValueError(f"{found[1][0]}: give one guided-decoding constraint per request (also got "
                             f"{found[0][0]})")
        name, fields = found[0]
        if self.guided_whitespace_pattern is not None:
            fields.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        try:
            return GuidedDecodingParams(**fields)
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith(name) else f"{name}: {e}") from None

    def sampling_params(self, max_tokens: int | None, kind: RequestOutputKind, **extra: Any) -> SamplingParams:
        """Build SamplingParams (raises ValueError naming a bad value)."""
        fields = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                                 "frequency_penalty", "repetition_penalty", "stop_token_ids",
                                                 "ignore_eos", "min_tokens", "skip_special_tokens",
                                                 "include_stop_str_in_output")}
        fields = {k: v for k, v in fields.items() if v is not None}
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        fields.update({k: v for k, v in extra.items() if v is not None})
        if "guided_decoding" not in fields:
            fields["guided_decoding"] = self.guided_decoding()
        return SamplingParams(max_tokens=max_tokens, output_kind=kind, **fields)


def beam_search_fields(width: int, length_penalty: float | None, early_stopping: bool | str | None
                       ) -> dict[str, Any]:
    """The SamplingParams fields of a beam search with `width` beams, as every route spells it (HF's
    deterministic algorithm: temperature 0; None keeps SamplingParams' default)."""
    return {"use_beam_search": True, "beam_width": width, "temperature": 0.0, "length_penalty": length_penalty,
            "early_stopping": early_stopping}


# ---- the seed's endpoints -----------------------------------------------------------------------------
class _SeedRequest(SamplingFields):
    # A misspelt field would otherwise be silently ignored.
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(None, validation_alias=AliasChoices("max_new_tokens", "max_tokens"))


class GenerateRequest(_SeedRequest):
    """POST /generate and WS /ws/generate."""

    prompt: str
    stream: bool = False
    # Beam search with this many beams (not streamed): the answer lists every beam, best first.
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    prompt_logprobs: int | None = None


class BatchGenerateRequest(_SeedRequest):
    """POST /batch_generate."""

    prompts: list[str] = Field(min_length=1)


# ---- OpenAI-compatible ----------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    """stream_options of a streaming request."""

    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _OpenAIRequest(SamplingFields):
    # OpenAI's clients send fields we have no use for (user, store, metadata, ...): ignored, as vLLM does.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extra parameters (the openai client sends them in extra_body): beam search with n beams
    # (HF's algorithm, deterministic), and the prompt's own logprobs (completions only).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    def guided_decoding(self, response_format: ResponseFormat | None = None) -> GuidedDecodingParams | None:
        """As SamplingFields', with OpenAI's response_format too."""
        return super().guided_decoding(response_format or self.response_format)


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    """One part of a message's content (text only)."""

    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[ContentPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The dict a chat template reads (text parts joined)."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        return d


class ChatCompletionRequest(_OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template (vLLM's field): Qwen3's enable_thinking, for one.
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=MAX_TEMPLATE_KWARGS)

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, without the names the server itself passes to the template (400 naming them)."""
        return checked_template_kwargs(self.chat_template_kwargs)


def checked_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs; ValueError naming those the server itself passes to the template."""
    taken = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise ValueError(f"chat_template_kwargs: {', '.join(taken)} cannot be set here (the server sets them)")
    return dict(kwargs or {})
