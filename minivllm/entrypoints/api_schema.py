"""What the routes answer, for the OpenAPI schema at /openapi.json (documentation only: the routes build their
JSONResponses themselves, nothing here validates them at run time).

Every error is in OpenAI's shape {"error": {"message", "type", "param", "code"}}, with the statuses the server
really sends (a validation error is a 400, so FastAPI's default 422 with its own shape would be wrong; the 422
kept here is OpenAI's shape too). Fuzzed by tests/test_fuzz_schema.py (schemathesis checks each response's status,
content type and body against these declarations)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    """An error: what is wrong, its OpenAI type, the request field at fault (if one is) and the HTTP status."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer."""

    error: ErrorDetail


class HealthResponse(BaseModel):
    """GET /health: "ok" (200), or "error" with why (503)."""

    status: str
    error: ErrorDetail | None = None


class GenerateResponse(BaseModel):
    """POST /generate (stream=false)."""

    generated_text: str
    tokens_generated: int
    latency_ms: float
    finish_reason: str | None
    prompt_tokens: int
    beams: list[dict[str, Any]] | None = None  # with beam_width
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # with prompt_logprobs


class BatchGenerateResponse(BaseModel):
    """POST /batch_generate."""

    generated_texts: list[str]
    tokens_generated: list[int]
    finish_reasons: list[str | None]
    latency_ms: float


class ModelCard(BaseModel):
    """One served model."""

    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: str
    data: list[ModelCard]


class Usage(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    """One choice of a completion."""

    index: int
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: dict[str, Any] | None


class Completion(BaseModel):
    """POST /v1/completions (stream=false)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(BaseModel):
    """The assistant's reply (with tools: its content and the calls it makes, OpenAI's tool_calls shape)."""

    role: str
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatMessageOut
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: dict[str, Any] | None


class ChatCompletion(BaseModel):
    """POST /v1/chat/completions (stream=false)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# A stream's schema describes one Server-Sent Event (as schemathesis reads text/event-stream): its data is a JSON
# chunk, or [DONE] at the end.
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk of the response, or [DONE] after the last"}}}}}
_ERROR_TEXT = {
    400: "Invalid request: wrong types, bad values, a prompt longer than the context, invalid JSON or UTF-8",
    401: "Missing or wrong API key (--api-key)",
    404: "Unknown model name",
    413: "Request body over --max-body-size",
    422: "Unprocessable request",
    429: "The waiting queue is full (Retry-After)",
    503: "The engine is not running, or the request timed out before it started (Retry-After)",
}


def responses(ok: type[BaseModel] | None, *errors: int, stream: bool = False,
              error_model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` of a route: its 200 (JSON `ok`, and SSE when it can stream) and its error statuses (in
    OpenAI's shape, or `error_model`'s: Anthropic's on its routes)."""
    out: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        out[200] = {"model": ok, **({"content": _SSE} if stream else {})}
    for status in errors:
        out[status] = {"model": error_model, "description": _ERROR_TEXT[status]}
    return out


# ---- the Responses API and Anthropic's Messages API --------------------------------------------------------
class ResponseObject(BaseModel):
    """POST /v1/responses (stream=false), GET /v1/responses/{id}: OpenAI's response object."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any]
    instructions: str | None
    previous_response_id: str | None
    incomplete_details: dict[str, Any] | None


class ResponseDeleted(BaseModel):
    """DELETE /v1/responses/{id}."""

    id: str
    object: str
    deleted: bool


class AnthropicErrorDetail(BaseModel):
    """An error on Anthropic's routes: its type (invalid_request_error, not_found_error, ...) and what is wrong."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every 4xx/5xx answer of /v1/messages and /v1/messages/count_tokens: {"type": "error", "error"}."""

    type: str
    error: AnthropicErrorDetail


class AnthropicMessageOut(BaseModel):
    """POST /v1/messages (stream=false): the reply's content blocks, why it stopped, and its token counts."""

    id: str
    type: str
    role: str
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: dict[str, int]


class TokenCount(BaseModel):
    """POST /v1/messages/count_tokens."""

    input_tokens: int


GENERATION_ERRORS = (400, 401, 413, 422, 429, 503)  # every route that takes a request body
OPENAI_GENERATION_ERRORS = (*GENERATION_ERRORS, 404)  # ... and names a model
