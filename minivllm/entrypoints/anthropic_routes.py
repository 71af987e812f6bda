"""Anthropic's Messages API: POST /v1/messages (whole and streamed) and POST /v1/messages/count_tokens, for the
clients and coding agents that speak it to local servers. The conversation goes through the same chat pipeline as
/v1/chat/completions (chat_serving.py); the reply comes back as content blocks (thinking with a reasoning parser,
text, tool_use) and, streamed, as Anthropic's events: message_start, content_block_start / _delta / _stop per block,
message_delta with the stop reason and usage, message_stop. Errors are in Anthropic's shape on these routes
(serving.APIError.response), and the key may come as `x-api-key` (auth.credentials)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from minivllm.engine.async_engine import AsyncStream
from minivllm.entrypoints.anthropic_protocol import CountTokensRequest, MessagesRequest
from minivllm.entrypoints.api_schema import (
    GENERATION_ERRORS,
    AnthropicErrorResponse,
    AnthropicMessageOut,
    TokenCount,
    responses,
)
from minivllm.entrypoints.chat_serving import ChatTurn, for_tools, render_chat, tool_plan
from minivllm.entrypoints.chat_utils import ChoiceStream, Delta, chat_message
from minivllm.entrypoints.serving import APIError, ServerState, bad_request, new_request_id
from minivllm.entrypoints.tool_calls import ToolPlan
from minivllm.outputs import CompletionOutput
from minivllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

router = APIRouter()


def event(name: str, data: dict[str, Any]) -> str:
    """One Server-Sent Event with its event name (Anthropic's clients dispatch on it)."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error_event(err: APIError) -> str:
    return event("error", err.anthropic_body())


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _turn(st: ServerState, body: CountTokensRequest, count_only: bool) -> tuple[ChatTurn, GuidedDecodingParams
                                                                                     | None]:
    """The rendered conversation and the reply's output format (output_config)."""
    try:
        messages = body.chat_messages()
        tools, choice, parallel = body.chat_tools()
        guided = body.guided_decoding() if isinstance(body, MessagesRequest) else None
    except ValueError as e:
        raise bad_request(e) from None
    if count_only:  # what the request would show the template, without asking for a tool parser
        shown = tools if choice != "none" else None  # (tool_choice none hides them, as on /v1/chat/completions)
        plan = ToolPlan("none", [t.model_dump(exclude_none=True) for t in shown] if shown else None)
    else:
        plan = tool_plan(st, tools, choice, parallel, guided, "output_config.format")
    return await render_chat(st, messages, plan, body.template_kwargs()), guided


@router.post("/v1/messages/count_tokens", responses=responses(TokenCount, *GENERATION_ERRORS, 404,
                                                              error_model=AnthropicErrorResponse))
async def count_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    """The prompt tokens a Messages request would take: {"input_tokens"}."""
    st = _state(request)
    st.check_model(body.model)
    turn, _ = await _turn(st, body, count_only=True)
    return JSONResponse({"input_tokens": len(turn.prompt["prompt_token_ids"])})


def _params(body: MessagesRequest, plan: ToolPlan, guided: GuidedDecodingParams | None) -> SamplingParams:
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    fields: dict[str, Any] = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                              "stop": body.stop_sequences}
    try:
        params = SamplingParams(max_tokens=body.max_tokens, output_kind=kind, guided_decoding=plan.constraint or guided,
                                **{k: v for k, v in fields.items() if v is not None})
    except ValueError as e:
        raise bad_request(e) from None
    return for_tools(params, plan)


def _stop_reason(finish: str | None, stop: str | int | None, calls: int) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished reply."""
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return ("end_turn" if finish is not None else None), None


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"] or "{}")
    except ValueError:  # cut off by max_tokens mid-arguments: the block keeps what there is
        args = {"_partial_arguments": fn["arguments"]}
    return {"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1), "name": fn["name"],
            "input": args if isinstance(args, dict) else {"value": args}}


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's fields (chat_utils.chat_message) → Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    blocks += [_tool_use(c) for c in message.get("tool_calls") or ()]
    return blocks


@router.post("/v1/messages", responses=responses(AnthropicMessageOut, *GENERATION_ERRORS, 404, stream=True,
                                                 error_model=AnthropicErrorResponse))
async def create_message(body: MessagesRequest, request: Request) -> Response:
    """A reply to a conversation, in Anthropic's shape."""
    st = _state(request)
    t0 = request.state.t0
    lora = st.check_model(body.model)
    turn, guided = await _turn(st, body, count_only=False)
    params = _params(body, turn.plan, guided)
    rid = new_request_id("msg")
    streams = await st.submit(await st.prepare(rid, [turn.prompt], params, lora=lora, request=request))
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        events = _events(st, body, turn, streams[0], msg_id)
        return st.stream_response("/v1/messages", t0, events, streams, done=None, error_event=_error_event)
    (out,) = await st.wait_finals(request, streams)
    c = out.outputs[0]
    message = chat_message(turn.plan, c.text, st.reasoning_parser, turn.text)
    blocks = _blocks(message)
    reason, sequence = _stop_reason(c.finish_reason, c.stop_reason, sum(b["type"] == "tool_use" for b in blocks))
    st.count("/v1/messages", "success", t0)
    return JSONResponse({"id": msg_id, "type": "message", "role": "assistant", "model": body.model,
                         "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": _usage(len(out.prompt_token_ids), len(c.token_ids))})


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0}


class BlockStream:
    """A streamed reply's chat deltas → Anthropic's content-block events (one block open at a time, indexed from 0:
    a thinking block, text, then one tool_use block per call)."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.calls = 0

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        return out + [event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                    "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def stop(self) -> list[str]:
        """Close the open block, if any."""
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def feed(self, delta: Delta) -> list[str]:
        """The events of one chat delta (reasoning, content, or tool-call pieces)."""
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:  # a call's first piece: a new tool_use block
                self.calls += 1
                out += self._start({"type": "tool_use", "id": call["id"].replace("call_", "toolu_", 1),
                                    "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out


async def _events(st: ServerState, body: MessagesRequest, turn: ChatTurn, stream: AsyncStream, msg_id: str
                  ) -> AsyncIterator[str]:
    prompt_tokens = len(stream.prompt_token_ids)
    yield event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": body.model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": _usage(prompt_tokens, 0)}})
    choice = ChoiceStream(turn.plan, st.reasoning_parser, turn.text)
    blocks = BlockStream()
    tokens, last = 0, CompletionOutput(0, "", [])
    async for out in stream:
        last = out.outputs[0]
        tokens += len(last.token_ids)
        for d in choice.feed(last.text, last.finish_reason is not None):
            for e in blocks.feed(d):
                yield e
    for e in blocks.stop():
        yield e
    reason, sequence = _stop_reason(last.finish_reason, last.stop_reason, blocks.calls)
    yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": {"output_tokens": tokens}})
    yield event("message_stop", {"type": "message_stop"})
