"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (JSON and SSE)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from minivllm.engine.async_engine import AsyncStream
from minivllm.engine.input_processor import Prompt
from minivllm.engine.lora_registry import LoadedLoRA
from minivllm.entrypoints.api_schema import OPENAI_GENERATION_ERRORS, ChatCompletion, Completion, ModelList, responses
from minivllm.entrypoints.chat_serving import for_tools, render_chat, tool_plan
from minivllm.entrypoints.chat_utils import ChoiceStream, chat_message
from minivllm.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, beam_search_fields
from minivllm.entrypoints.serving import (
    APIError,
    ServerState,
    bad_request,
    new_request_id,
    prompt_logprobs_json,
)
from minivllm.entrypoints.streaming import merge, sse
from minivllm.entrypoints.tool_calls import ToolPlan, finish_reason
from minivllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from minivllm.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


@router.get("/v1/models", responses=responses(ModelList, 401))
async def list_models(request: Request) -> JSONResponse:
    """The model this server serves, then its LoRA adapters (each with the base model as parent)."""
    st = _state(request)
    card = {"object": "model", "created": st.created, "owned_by": "minivllm", "max_model_len": st.max_model_len}
    return JSONResponse({"object": "list", "data": [
        # "root" names, never a server path (vLLM puts the model directory there; a client needs no file layout).
        {"id": st.model_name, "root": st.model_name, "parent": None, **card},
        *({"id": name, "root": name, "parent": st.model_name, **card} for name in st.loras)]})


def _check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")


def _params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None,
            prompt_logprobs: int | None = None, constraint: GuidedDecodingParams | None = None) -> SamplingParams:
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    try:
        if req.use_beam_search:  # vLLM's meaning: n beams, all returned, best first
            return req.sampling_params(max_tokens, kind, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                       **beam_search_fields(req.n, req.length_penalty, req.early_stopping))
        return req.sampling_params(max_tokens, kind, n=req.n, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                   guided_decoding=constraint)
    except ValueError as e:
        raise bad_request(e) from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top(pos: PositionLogprobs, k: int) -> list[Any]:
    return sorted(pos.values(), key=lambda lp: lp.rank)[:k]


def _completion_logprobs(c: CompletionOutput, k: int, offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs for the tokens of c (text offsets continue from offset)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(c.token_ids, c.logprobs or [], strict=False):
        chosen = pos[tid]
        tokens.append(chosen.decoded_token)
        token_lps.append(chosen.logprob)
        tops.append({lp.decoded_token: lp.logprob for lp in _top(pos, k)})
        offsets.append(offset)
        offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(c: CompletionOutput, k: int) -> dict[str, Any]:
    """OpenAI's chat logprobs: one entry per token with its top alternatives."""
    def entry(lp: Any) -> dict[str, Any]:
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}

    return {"content": [{**entry(pos[tid]), "top_logprobs": [entry(lp) for lp in _top(pos, k)]}
                        for tid, pos in zip(c.token_ids, c.logprobs or [], strict=False)]}


async def _submit(st: ServerState, prompts: list[Prompt], params: SamplingParams,
                  body: CompletionRequest | ChatCompletionRequest, prefix: str, lora: LoadedLoRA | None,
                  request: Request) -> tuple[str, list[AsyncStream]]:
    rid = new_request_id(prefix)
    return rid, await st.submit(await st.prepare(rid, prompts, params, body.priority, ttft_slo_ms=body.ttft_slo_ms,
                                                      timeout_s=body.timeout, lora=lora, request=request))


# ---- /v1/completions -----------------------------------------------------------------------------------
@router.post("/v1/completions", responses=responses(Completion, *OPENAI_GENERATION_ERRORS, stream=True))
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    """Text completion for one prompt or a list of prompts."""
    st = _state(request)
    t0 = request.state.t0
    lora = st.check_model(body.model)
    model = lora.name if lora is not None else st.model_name
    _check_unsupported(body)
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported by this server", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, f"best_of ({body.best_of}) must equal n ({body.n}) on this server", "best_of")
    echo_logprobs = body.echo and body.logprobs is not None
    if echo_logprobs and body.stream:
        raise APIError(400, "echo together with logprobs is not supported with stream=true", "echo")
    prompts = completion_prompts(body.prompt)
    # echo with logprobs scores the prompt too (OpenAI's legacy behaviour): through prompt_logprobs.
    prompt_lp = max(body.prompt_logprobs or 0, body.logprobs or 0) if echo_logprobs else body.prompt_logprobs
    params = _params(body, body.max_tokens, body.logprobs, prompt_lp)
    rid, streams = await _submit(st, prompts, params, body, "cmpl", lora, request)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _completion_events(st, body, _Chunker(st, rid, "text_completion", created, include_usage, model),
                                    streams)
        return st.stream_response("/v1/completions", t0, events, streams)
    outs = await st.wait_finals(request, streams)
    choices, completion_tokens = [], 0
    for i, out in enumerate(outs):
        echo = _prompt_text(st, out) if body.echo else ""
        echoed = _echo_logprobs(st, out, body.logprobs) if echo_logprobs and body.logprobs is not None else None
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            lps = None
            if body.logprobs is not None:
                # Offsets run on from the echoed tokens' own texts, so they stay in step with `tokens`.
                start = sum(len(t) for t in echoed["tokens"]) if echoed is not None else 0
                lps = _completion_logprobs(c, body.logprobs, start)
                if echoed is not None:
                    lps = {k: echoed[k] + lps[k] for k in lps}
            choice = {"index": i * body.n + c.index, "text": echo + c.text, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason, "logprobs": lps}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out, body.prompt_logprobs)
            if body.use_beam_search:  # the beam's score (vLLM's cumulative_logprob), best first
                choice["cumulative_logprob"] = c.cumulative_logprob
            choices.append(choice)
    st.count("/v1/completions", "success", t0)
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices,
                         "usage": _usage(sum(len(o.prompt_token_ids) for o in outs), completion_tokens)})


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], field: str = "prompt") -> list[Prompt]:
    """A text, texts, token ids or lists of them (OpenAI's prompt / input) → the engine's prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, f"{field}: the list is empty", field)
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": prompt}]
    if all(isinstance(p, str) for p in prompt):
        return list(cast(list[str], prompt))  # (all() does not narrow the union for mypy)
    return [{"prompt_token_ids": p} for p in prompt]


def _prompt_text(st: ServerState, out: RequestOutput) -> str:
    return out.prompt if out.prompt is not None else st.tokenizer.decode(out.prompt_token_ids)


def _echo_logprobs(st: ServerState, out: RequestOutput, k: int) -> dict[str, Any]:
    """The prompt's part of legacy completions logprobs under echo (its first token has no logprob)."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tid, pos in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=True):
        text = pos[tid].decoded_token if pos is not None else st.tokenizer.decode([tid])
        tokens.append(text)
        token_lps.append(pos[tid].logprob if pos is not None else None)
        tops.append({lp.decoded_token: lp.logprob for lp in _top(pos, k)} if pos is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


@dataclass
class _Chunker:
    """Formats the SSE chunks of one streamed OpenAI response."""

    st: ServerState
    rid: str
    object: str
    created: int
    include_usage: bool
    model: str  # the served name the request asked for (the base model's, or a LoRA adapter's)

    def __call__(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        data: dict[str, Any] = {"id": self.rid, "object": self.object, "created": self.created,
                                "model": self.model, "choices": choices}
        if self.include_usage:  # OpenAI: usage null on every chunk but the last
            data["usage"] = usage
        return sse(json.dumps(data, ensure_ascii=False))


async def _completion_events(st: ServerState, body: CompletionRequest, chunk: _Chunker, streams: list[AsyncStream]
                             ) -> AsyncIterator[str]:
    completion_tokens = 0
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    async for i, out in merge(streams):
        for c in out.outputs:
            index = i * body.n + c.index
            text = c.text
            if body.echo and index not in echoed:
                echoed.add(index)
                text = _prompt_text(st, out) + text
            completion_tokens += len(c.token_ids)
            lps = None
            if body.logprobs is not None:
                lps = _completion_logprobs(c, body.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lps["tokens"])
            yield chunk([{"index": index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason}])
    if chunk.include_usage:
        yield chunk([], _usage(sum(len(s.prompt_token_ids) for s in streams), completion_tokens))


# ---- /v1/chat/completions ------------------------------------------------------------------------------
@router.post("/v1/chat/completions",
             responses=responses(ChatCompletion, *OPENAI_GENERATION_ERRORS, stream=True))
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    """A reply to a conversation, through the tokenizer's chat template."""
    st = _state(request)
    t0 = request.state.t0
    lora = st.check_model(body.model)
    model = lora.name if lora is not None else st.model_name
    _check_unsupported(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    try:
        guided = body.guided_decoding()
    except ValueError as e:
        raise bad_request(e) from None
    plan = tool_plan(st, body.tools, body.tool_choice, body.parallel_tool_calls, guided)
    params = for_tools(_params(body, max_tokens, logprobs, body.prompt_logprobs, plan.constraint), plan)
    if body.chat_template is not None:  # untrusted Jinja from a client: refused, as vLLM does by default
        raise APIError(400, "chat_template: a request may not carry its own chat template", "chat_template")
    try:
        template_kwargs = body.template_kwargs()
    except ValueError as e:
        raise bad_request(e) from None
    turn = await render_chat(st, [m.as_template_dict() for m in body.messages], plan, template_kwargs,
                             body.add_generation_prompt)
    prompt = turn.prompt
    rid, streams = await _submit(st, [prompt], params, body, "chatcmpl", lora, request)
    created = int(time.time())
    k = body.top_logprobs or 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _chat_events(body, _Chunker(st, rid, "chat.completion.chunk", created, include_usage, model),
                              streams[0], k, plan, st.reasoning_parser, prompt["prompt"])
        return st.stream_response("/v1/chat/completions", t0, events, streams)
    (out,) = await st.wait_finals(request, streams)
    choices = []
    for c in out.outputs:
        message = chat_message(plan, c.text, st.reasoning_parser, prompt["prompt"])
        finish = finish_reason(plan, c.finish_reason, len(message.get("tool_calls") or []))
        choices.append({"index": c.index, "message": message, "logprobs": _chat_logprobs(c, k) if body.logprobs
                        else None, "finish_reason": finish, "stop_reason": c.stop_reason})
    st.count("/v1/chat/completions", "success", t0)
    response = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices,
                "usage": _usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}
    if body.prompt_logprobs is not None:  # vLLM puts the chat's prompt logprobs beside the choices
        response["prompt_logprobs"] = prompt_logprobs_json(out, body.prompt_logprobs)
    return JSONResponse(response)


async def _chat_events(body: ChatCompletionRequest, chunk: _Chunker, stream: AsyncStream, k: int, plan: ToolPlan,
                       reasoning_parser: str | None, prompt: str | None) -> AsyncIterator[str]:
    completion_tokens = 0
    choices = [ChoiceStream(plan, reasoning_parser, prompt) for _ in range(body.n)]
    for i in range(body.n):  # OpenAI opens every choice with the role
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for out in stream:
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choice = choices[c.index]
            deltas = choice.feed(c.text, c.finish_reason is not None)
            lps = _chat_logprobs(c, k) if body.logprobs else None
            # Several deltas (reasoning, content, a call) go out as consecutive chunks; the last one carries the
            # logprobs and the finish reason.
            for d in deltas[:-1]:
                yield chunk([{"index": c.index, "delta": d, "logprobs": None, "finish_reason": None}])
            if not deltas and c.finish_reason is None and lps is None:
                continue  # text held back (a tag or a tool call being read): nothing to send yet
            yield chunk([{"index": c.index, "delta": deltas[-1] if deltas else {}, "logprobs": lps,
                          "finish_reason": choice.finish_reason(c.finish_reason), "stop_reason": c.stop_reason}])
    if chunk.include_usage:
        yield chunk([], _usage(len(stream.prompt_token_ids), completion_tokens))
