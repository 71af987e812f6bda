"""InputProcessor: the one place a request is tokenized, validated and given its defaults.

`LLM`, the HTTP routes and gRPC all build their `EngineRequest`s here (through `LLMEngine` /
`AsyncLLMEngine.process_request`), so a rule such as "the prompt must fit max_model_len" has one
implementation and one error message. It reads no engine state that changes step to step, so it
is safe to call off the engine thread (the servers tokenize large prompts on a worker thread).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.client_seats import ClientSeats
from minivllm.engine.lora_registry import LoadedLoRA
from minivllm.sampling_params import RequestOutputKind, SamplingParams
from minivllm.slo import TtftSlo, resolve_priority
from minivllm.structured_output.manager import FIELD_NAMES, StructuredOutputManager
from minivllm.structured_output.reasoning import prompt_closes_thinking

Prompt = str | list[int] | dict[str, Any]


def check_unicode(text: str, what: str = "prompt") -> None:
    """ValueError naming `what` if the text holds a lone surrogate (JSON's "\\ud800", or bytes that encode one
    slip through json.loads): such a string is not Unicode text, and the tokenizer cannot take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: not valid Unicode text: a lone surrogate {text[e.start]!r} at character "
                         f"{e.start}") from None


def duplicate_request_id(request_id: str) -> str:
    """The error of a request id already in flight (the engine's requests, or a server's streams)."""
    return f"request_id: {request_id!r} is already in use by a request in flight"


def check_timeout(value: object) -> float:
    """A request's `timeout` (seconds to start): a positive, finite number; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"timeout: must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """What one request (and one API call) may ask for: bounds a client cannot raise, so one request cannot take
    the server's memory or time from everyone else. Every limit is checked here, once, whatever the entry point."""

    max_prompt_tokens: int | None = None  # None: max_model_len bounds it (--max-prompt-tokens)
    max_n: int = 16  # samples or beams (--max-n)
    max_logprobs: int = 20  # --max-logprobs
    max_num_seqs: int | None = None  # a request's samples or beams run at once: at most the step's seats
    max_call_requests: int | None = None  # prompts in one API call: at most the waiting queue (--max-waiting)
    max_stop_strings: int = 64  # --max-stop-strings: each is matched against new text every step
    max_stop_string_length: int = 1024  # --max-stop-string-length, in characters
    max_constraint_chars: int = 131072  # --max-constraint-chars: a guided-decoding constraint's JSON form

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """ValueError naming the field and the flag when a request asks for more than the limits allow."""
        if self.max_prompt_tokens is not None and num_prompt_tokens > self.max_prompt_tokens:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens exceed the server's limit of "
                             f"{self.max_prompt_tokens} (--max-prompt-tokens); shorten the prompt")
        width = params.beam_width if params.use_beam_search else params.n
        name = "beam_width" if params.use_beam_search else "n"
        if width > self.max_n:
            raise ValueError(f"{name}: {width} exceeds the server's limit of {self.max_n} (--max-n)")
        if self.max_num_seqs is not None and width > self.max_num_seqs:
            raise ValueError(f"{name}: {width} exceeds max_num_seqs ({self.max_num_seqs}), the sequences one step "
                             "runs (--max-num-seqs)")
        if len(params.stop) > self.max_stop_strings:
            raise ValueError(f"stop: {len(params.stop)} stop strings exceed the server's limit of "
                             f"{self.max_stop_strings} (--max-stop-strings)")
        longest = max(map(len, params.stop), default=0)
        if longest > self.max_stop_string_length:
            raise ValueError(f"stop: a stop string of {longest} characters exceeds the server's limit of "
                             f"{self.max_stop_string_length} (--max-stop-string-length)")
        gd = params.guided_decoding
        if gd is not None:
            size = len(json.dumps(getattr(gd, gd.kind)))  # (the compile cache keys on the same text)
            if size > self.max_constraint_chars:
                raise ValueError(f"{FIELD_NAMES[gd.kind]}: the constraint is {size} characters, over the server's "
                                 f"limit of {self.max_constraint_chars} (--max-constraint-chars)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name}: {k} exceeds the server's limit of {self.max_logprobs} (--max-logprobs)")

    def check_call(self, num_prompts: int) -> None:
        """ValueError when one call brings more prompts than the waiting queue holds (a 429 would make the client
        retry something that never fits)."""
        if self.max_call_requests is not None and num_prompts > self.max_call_requests:
            raise ValueError(f"prompts: {num_prompts} prompts in one request exceed max_waiting "
                             f"({self.max_call_requests}); split the batch")


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """How a caller wants its prompts run, built once per API call (a route, gRPC, LLM.generate): everything of a
    request but its prompt and id."""

    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int | str = 0  # an int, or a class name (slo.py)
    arrival_time: float | None = None  # None: when it is processed
    fit_context: bool = False  # the servers' (vLLM's) rule: see InputProcessor.process
    default_max_tokens: int | None = None  # a missing max_tokens (clipped to the room the prompt leaves)
    ttft_slo_ms: float | None = None  # overrides its class's TTFT SLO
    timeout_s: float | None = None  # the longest it may wait to start (then dropped before any prefill)
    lora: LoadedLoRA | None = None  # the adapter it runs with (None: the base model)
    seats: ClientSeats | None = None  # a named API key's share of the engine (engine/client_seats.py)


@dataclass
class EngineRequest:
    """A tokenized, validated request, ready to be queued (built off the engine thread)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    ttft_deadline: float = math.inf  # arrival_time + its TTFT SLO (slo.py); inf: none
    start_deadline: float = math.inf  # arrival_time + its timeout: not started by then, it is dropped unprefilled
    grammar: str | None = None  # guided decoding: the compiled constraint (structured_output/manager.py)
    lora: LoadedLoRA | None = None  # the adapter it runs with (None: the base model)
    grammar_after_reasoning: bool = False  # the grammar applies from the end of the thinking on (reasoning.py)
    seats: ClientSeats | None = None  # a named API key's share of the engine (engine/client_seats.py)


class InputProcessor:
    """Prompt → token ids, the request's limits checked against the model and the KV pool."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, kv_cache_mode: str,
                 blocks_needed: Callable[[int], int], num_blocks: int, pool: str,
                 ttft_slo_ms: str | float | None = None, seq_block_cap: int | None = None,
                 limits: RequestLimits | None = None, structured: StructuredOutputManager | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.kv_cache_mode = kv_cache_mode
        self.blocks_needed, self.num_blocks, self.pool = blocks_needed, num_blocks, pool
        self.seq_block_cap = seq_block_cap  # sink-window eviction: the most blocks a sequence ever holds at once
        self.ttft_slo = TtftSlo.parse(ttft_slo_ms)  # the classes' default deadlines (--ttft-slo-ms)
        self.limits = limits or RequestLimits()
        self.structured = structured  # compiles guided-decoding constraints (None: guided requests refused)
        self.reasoning_parser = reasoning_parser  # a thinking model: guided decoding waits for </think>

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A prompt (text, token ids, or {"prompt_token_ids": [...]}) → (text, token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: the prompt is empty")
            check_unicode(prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")

    def process_call(self, request_id: str, prompts: list[Prompt], spec: RequestSpec) -> list[EngineRequest]:
        """The requests of one API call (ids request_id-0, -1, ...), all under one spec and arrival time."""
        self.limits.check_call(len(prompts))
        if spec.arrival_time is None:
            spec = dataclasses.replace(spec, arrival_time=time.time())
        return [self.process(f"{request_id}-{i}", p, spec) for i, p in enumerate(prompts)]

    def process(self, request_id: str, prompt: Prompt, spec: RequestSpec) -> EngineRequest:
        """Tokenize, validate and fill in max_tokens; ValueError naming the problem if the request can never run.

        A missing max_tokens is `default_max_tokens` clipped to the room the prompt leaves, or without one
        runs to the end of the context. With `fit_context` (the servers, vLLM's rule) the prompt must leave
        room to generate and an explicit max_tokens must fit the context with the prompt."""
        params, fit_context, lora = spec.params, spec.fit_context, spec.lora
        priority = resolve_priority(spec.priority)
        arrival_time = spec.arrival_time or time.time()
        deadline = self.ttft_slo.deadline(priority, arrival_time, spec.ttft_slo_ms)
        start_deadline = arrival_time + check_timeout(spec.timeout_s) if spec.timeout_s is not None else math.inf
        text, ids = self.tokenize(prompt)
        room = self.max_model_len - len(ids)
        if fit_context:
            if room == 0:
                raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within max_model_len "
                                 f"{self.max_model_len}; shorten the prompt")
            if params.max_tokens is not None and params.max_tokens > room >= 0:
                raise ValueError(f"max_tokens: the prompt has {len(ids)} tokens and max_tokens is "
                                 f"{params.max_tokens}, together over max_model_len {self.max_model_len}; lower "
                                 "max_tokens")
        self._validate(ids, params)
        grammar = None
        if params.guided_decoding is not None:
            if self.structured is None:
                raise ValueError("guided decoding is not available on this engine")
            grammar = self.structured.compile(params.guided_decoding)  # ValueError naming the field if invalid
        # A thinking model answers after </think>: unless the prompt already closed the thinking, the grammar waits.
        waits = grammar is not None and self.reasoning_parser is not None and not prompt_closes_thinking(
            text if text is not None else self.tokenizer.decode(ids))
        if params.max_tokens is None:
            default_max_tokens = spec.default_max_tokens
            fill = max(1, room) if default_max_tokens is None else min(default_max_tokens, room)
            params = params.clone(max_tokens=fill)
        return EngineRequest(request_id, text, ids, params, arrival_time, priority, deadline, start_deadline, grammar,
                             lora, waits, spec.seats)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        if self.kv_cache_mode != "paged" and (params.n > 1 or params.use_beam_search):
            # Samples and beams share KV blocks copy-on-write, which only the paged cache does.
            raise ValueError(f"n / use_beam_search: kv_cache_mode={self.kv_cache_mode} serves only n=1 requests "
                             "without beam search; use kv_cache_mode=paged")
        if params.use_beam_search and params.output_kind == RequestOutputKind.DELTA:
            # Beams are reordered and pruned until the end: there is nothing final to stream before it.
            raise ValueError("use_beam_search / beam_width: beam search is not supported with stream=true or "
                             "GenerateStream; beams are reordered until the last step")
        vocab = self.vocab_size
        # (C loops, not a Python one per id: a 100k-id prompt checks in a few ms; the loop only names the culprit)
        if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab:
            for i, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"prompt: token ids must be integers in [0, {vocab}); position {i} holds {t!r}")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens exceed max_model_len {self.max_model_len}; shorten the prompt")
        self.limits.check(len(ids), params)
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids: {bad_stop} are not below the vocabulary size {vocab}")
        # Admission that never deadlocks: every sequence of a request must fit the whole pool alone at
        # its longest (samples and beams can then always make progress one at a time).
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        need = self.blocks_needed(longest)
        if self.seq_block_cap is not None:
            need = min(need, self.seq_block_cap)
        if need > self.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks for prompt + max_tokens ({longest} tokens) but the whole pool has "
                f"{self.num_blocks} ({self.pool}); lower max_tokens or give the KV cache more memory")
