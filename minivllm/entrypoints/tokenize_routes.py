"""POST /tokenize and POST /detokenize in vLLM's shapes, for clients that budget their prompts: a prompt or a
conversation (through the chat template, as /v1/chat/completions renders it) → token ids and the model's context
length; token ids → text. Behind the API key when one is set (vLLM leaves them open; they cost compute and the chat
template's output shows the server's system prompt conventions)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from minivllm.engine.input_processor import check_unicode
from minivllm.entrypoints.api_schema import OPENAI_GENERATION_ERRORS, responses
from minivllm.entrypoints.chat_utils import chat_prompt
from minivllm.entrypoints.protocol import MAX_TEMPLATE_KWARGS, ChatMessage, checked_template_kwargs
from minivllm.entrypoints.serving import APIError, ServerState, bad_request
from minivllm.entrypoints.tool_calls import ChatTool, template_messages

router = APIRouter()
_INLINE_CHARS = 4096  # longer texts are tokenized on a worker thread, off the event loop


class TokenizeRequest(BaseModel):
    """POST /tokenize: `prompt` (vLLM's completion form) or `messages` (its chat form), not both."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=MAX_TEMPLATE_KWARGS)
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    """The prompt's token ids, their count, the model's context length, and (asked for) each token's string."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """The text of the token ids."""

    prompt: str


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _off_loop(size: int, fn: Any, *args: Any) -> Any:
    return fn(*args) if size <= _INLINE_CHARS else await asyncio.to_thread(fn, *args)


async def tokenize_prompt(st: ServerState, prompt: str, add_special_tokens: bool | None) -> list[int]:
    """A text's token ids (special tokens added unless asked not to); shared with gRPC's Tokenize."""
    try:
        check_unicode(prompt)
    except ValueError as e:
        raise bad_request(e) from None
    add = True if add_special_tokens is None else add_special_tokens
    return await _off_loop(len(prompt), lambda: st.tokenizer.encode(prompt, add_special_tokens=add))


@router.post("/tokenize", responses=responses(TokenizeResponse, *OPENAI_GENERATION_ERRORS))
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """Token ids of a prompt or of a conversation rendered by the chat template."""
    st = _state(request)
    st.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) and messages (a conversation)", "prompt")
    tok = st.tokenizer
    if body.prompt is not None:
        ids = await tokenize_prompt(st, body.prompt, body.add_special_tokens)
    else:
        assert body.messages is not None
        try:
            kwargs = checked_template_kwargs(body.chat_template_kwargs)
        except ValueError as e:
            raise bad_request(e) from None
        if body.continue_final_message:
            if body.add_generation_prompt:
                raise APIError(400, "continue_final_message: cannot be combined with add_generation_prompt (set it "
                                    "false)", "continue_final_message")
            kwargs["continue_final_message"] = True
        messages = [m.as_template_dict() for m in body.messages]
        if any("tool_calls" in m for m in messages):
            messages = template_messages(messages)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] or None  # as the template shows them
        try:
            text = (await asyncio.to_thread(chat_prompt, tok, messages, body.add_generation_prompt, None, tools,
                                            kwargs))["prompt"]
        except ValueError as e:
            raise bad_request(e) from None
        add = bool(body.add_special_tokens)
        ids = await _off_loop(len(text), lambda: tok.encode(text, add_special_tokens=add))
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids, "token_strs": strs})


@router.post("/detokenize", responses=responses(DetokenizeResponse, *OPENAI_GENERATION_ERRORS))
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    """The text of token ids (special tokens kept, as vLLM's detokenize does)."""
    st = _state(request)
    st.check_model(body.model)
    vocab = len(st.tokenizer)
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: token ids must be in [0, {vocab}); position {bad} holds {body.tokens[bad]}",
                       "tokens")
    text = await _off_loop(len(body.tokens), st.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})
