"""OpenAI's Responses API: POST /v1/responses (whole and streamed), GET and DELETE /v1/responses/{id}.

Input text or items (messages, earlier function calls and their outputs), `instructions`, function tools, text.format
as a constraint, and `previous_response_id` continuing a stored conversation (responses_store.py; `store: false`
keeps nothing). The conversation goes through the same chat pipeline as /v1/chat/completions (chat_serving.py); the
reply becomes output items (reasoning with a reasoning parser, message, function_call) and, streamed, the events the
official client reads: response.created / in_progress, per item output_item.added, its parts' deltas and dones,
output_item.done, then response.completed (or response.incomplete at max_output_tokens)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from minivllm.engine.async_engine import AsyncStream
from minivllm.entrypoints.api_schema import OPENAI_GENERATION_ERRORS, ResponseDeleted, ResponseObject, responses
from minivllm.entrypoints.chat_serving import ChatTurn, for_tools, render_chat, tool_plan
from minivllm.entrypoints.chat_utils import ChoiceStream, Delta, chat_message
from minivllm.entrypoints.clients import current_client
from minivllm.entrypoints.responses_protocol import ResponsesRequest
from minivllm.entrypoints.responses_store import ResponseStore, StoredResponse
from minivllm.entrypoints.serving import APIError, ServerState, bad_request, new_request_id
from minivllm.outputs import CompletionOutput
from minivllm.sampling_params import RequestOutputKind, SamplingParams

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _store(request: Request) -> ResponseStore:
    return request.app.state.response_store


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r} (responses are kept in memory: the most recent "
                         "ones, made with store true, for the key that made them)", param)


class Reply:
    """The response object being built: its fields from the request, its output items as they complete."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int) -> None:
        self.body, self.model, self.prompt_tokens = body, model, prompt_tokens
        self.id, self.created = _id("resp"), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.output_tokens = 0

    def json(self, status: str, finish: str | None = None) -> dict[str, Any]:
        """The response object (status in_progress while streaming; completed, or incomplete at the token limit)."""
        b = self.body
        if finish == "length":
            status = "incomplete"
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else \
            {"type": "text"}
        choice = b.tool_choice.model_dump() if b.tool_choice is not None and not isinstance(b.tool_choice, str) else \
            (b.tool_choice or "auto")
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "instructions": b.instructions,
                "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()], "tool_choice": choice,
                "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature,
                "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
                "previous_response_id": b.previous_response_id, "store": b.store, "metadata": b.metadata or {},
                "text": {"format": fmt}, "truncation": "disabled", "reasoning": None,
                "usage": {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": self.output_tokens,
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": self.prompt_tokens + self.output_tokens}}


def _items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's fields (chat_utils.chat_message) → Responses output items."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append({"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                      "content": [_text_part(message["content"])]})
    items += [{"type": "function_call", "id": _id("fc"), "call_id": c["id"], "name": c["function"]["name"],
               "arguments": c["function"]["arguments"], "status": "completed"} for c in message.get("tool_calls") or ()]
    return items


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply as the chat-template turn a next response continues from."""
    text = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


async def _prepare(st: ServerState, store: ResponseStore, body: ResponsesRequest) -> tuple[ChatTurn, SamplingParams,
                                                                                            list[dict[str, Any]]]:
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id, current_client.get())
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = [dict(m) for m in previous.messages]
    try:
        messages = body.chat_messages(history)
        tools, choice = body.chat_tools()
        guided = body.guided_decoding()
    except ValueError as e:
        raise bad_request(e) from None
    plan = tool_plan(st, tools, choice, body.parallel_tool_calls, guided, "text.format")
    turn = await render_chat(st, messages, plan)
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    fields: dict[str, Any] = {k: v for k, v in (("temperature", body.temperature), ("top_p", body.top_p))
                              if v is not None}
    try:
        params = SamplingParams(max_tokens=body.max_output_tokens, output_kind=kind,
                                guided_decoding=plan.constraint or guided, **fields)
    except ValueError as e:
        raise bad_request(e) from None
    # The stored conversation: without this request's instructions (a next turn brings its own).
    kept = messages[1:] if body.instructions else messages
    return turn, for_tools(params, plan), kept


@router.post("/v1/responses", responses=responses(ResponseObject, *OPENAI_GENERATION_ERRORS, stream=True))
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    """A model response to text or items, optionally continuing a stored one."""
    st, store = _state(request), _store(request)
    t0 = request.state.t0
    lora = st.check_model(body.model)
    model = lora.name if lora is not None else st.model_name
    turn, params, messages = await _prepare(st, store, body)
    streams = await st.submit(await st.prepare(new_request_id("resp"), [turn.prompt], params, lora=lora,
                                               request=request))
    reply = Reply(body, model, len(turn.prompt["prompt_token_ids"]))
    client = current_client.get()

    def keep(finish: str | None) -> dict[str, Any]:
        if finish == "length" and reply.output:  # the item the limit cut off
            reply.output[-1]["status"] = "incomplete"
        final = reply.json("completed", finish)
        if body.store:
            store.put(reply.id, StoredResponse(final, messages + [_assistant_turn(reply.output)], client))
        return final

    if body.stream:
        events = _events(st, turn, streams[0], reply, keep)
        return st.stream_response("/v1/responses", t0, events, streams, done=None, error_event=_error_event)
    (out,) = await st.wait_finals(request, streams)
    c = out.outputs[0]
    reply.output = _items(chat_message(turn.plan, c.text, st.reasoning_parser, turn.text))
    reply.output_tokens = len(c.token_ids)
    st.count("/v1/responses", "success", t0)
    return JSONResponse(keep(c.finish_reason))


@router.get("/v1/responses/{response_id}", responses=responses(ResponseObject, 401, 404, 422))
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    """A stored response."""
    entry = _store(request).get(response_id, current_client.get())
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.response)


@router.delete("/v1/responses/{response_id}", responses=responses(ResponseDeleted, 401, 404, 422))
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    """Forget a stored response."""
    if not _store(request).delete(response_id, current_client.get()):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _error_event(err: APIError) -> str:
    data = {"type": "error", "code": err.type, "message": err.message, "param": err.param, "sequence_number": 0}
    return f"event: error\ndata: {json.dumps(data)}\n\n"


class ItemStream:
    """A streamed reply's chat deltas → the Responses events of its output items (one item open at a time: reasoning,
    message, then one function_call per call); finished items are appended to the reply's output."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.seq = 0
        self.item: dict[str, Any] | None = None
        self.text = ""

    def event(self, data: dict[str, Any]) -> str:
        """One SSE event, numbered."""
        data["sequence_number"] = self.seq
        self.seq += 1
        return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.reply.output)}

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        out = self.close()
        self.item, self.text = item, ""
        out.append(self.event({"type": "response.output_item.added", "output_index": len(self.reply.output),
                               "item": dict(item, status="in_progress")}))
        if part is not None:
            out.append(self.event({"type": "response.content_part.added", **self._where(), "content_index": 0,
                                   "part": part}))
        return out

    def close(self) -> list[str]:
        """Finish the open item, if any."""
        item = self.item
        if item is None:
            return []
        where, out = self._where(), []
        if item["type"] == "message":
            part = _text_part(self.text)
            out += [self.event({"type": "response.output_text.done", **where, "content_index": 0, "text": self.text,
                                "logprobs": []}),
                    self.event({"type": "response.content_part.done", **where, "content_index": 0, "part": part})]
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            out += [self.event({"type": "response.reasoning_text.done", **where, "content_index": 0,
                                "text": self.text}),
                    self.event({"type": "response.content_part.done", **where, "content_index": 0, "part": part})]
            item["content"] = [part]
        else:
            item["arguments"] = self.text
            out.append(self.event({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                                   "arguments": self.text}))
        item["status"] = "completed"
        out.append(self.event({"type": "response.output_item.done", "output_index": where["output_index"],
                               "item": item}))
        self.reply.output.append(item)
        self.item = None
        return out

    def feed(self, delta: Delta) -> list[str]:
        """The events of one chat delta."""
        out: list[str] = []
        kind = self.item["type"] if self.item is not None else None
        if delta.get("reasoning_content"):
            if kind != "reasoning":
                out += self._open({"type": "reasoning", "id": _id("rs"), "summary": [], "content": []},
                                  {"type": "reasoning_text", "text": ""})
            self.text += delta["reasoning_content"]
            out.append(self.event({"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                                   "delta": delta["reasoning_content"]}))
        if delta.get("content"):
            if kind != "message":
                out += self._open({"type": "message", "id": _id("msg"), "role": "assistant", "content": []},
                                  _text_part(""))
            self.text += delta["content"]
            out.append(self.event({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                                   "delta": delta["content"], "logprobs": []}))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:
                out += self._open({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                                   "name": fn.get("name", ""), "arguments": ""}, None)
            if fn.get("arguments"):
                self.text += fn["arguments"]
                out.append(self.event({"type": "response.function_call_arguments.delta", **self._where(),
                                       "delta": fn["arguments"]}))
        return out


async def _events(st: ServerState, turn: ChatTurn, stream: AsyncStream, reply: Reply, keep: Any
                  ) -> AsyncIterator[str]:
    items = ItemStream(reply)
    started = reply.json("in_progress")
    yield items.event({"type": "response.created", "response": started})
    yield items.event({"type": "response.in_progress", "response": started})
    choice = ChoiceStream(turn.plan, st.reasoning_parser, turn.text)
    last = CompletionOutput(0, "", [])
    async for out in stream:
        last = out.outputs[0]
        reply.output_tokens += len(last.token_ids)
        for d in choice.feed(last.text, last.finish_reason is not None):
            for e in items.feed(d):
                yield e
    for e in items.close():
        yield e
    final = keep(last.finish_reason)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield items.event({"type": kind, "response": final})
