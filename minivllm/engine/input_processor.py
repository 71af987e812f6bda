"""InputProcessor: the one place a request is tokenized, validated and given its defaults.

`LLM`, the HTTP routes and gRPC all build their `EngineRequest`s here (through `LLMEngine` /
`AsyncLLMEngine.process_request`), so a rule such as "the prompt must fit max_model_len" has one
implementation and one error message. It reads no engine state that changes step to step, so it
is safe to call off the engine thread (the servers tokenize large prompts on a worker thread).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minivllm.engine.lora_registry import LoadedLoRA
from minivllm.sampling_params import SamplingParams
from minivllm.slo import TtftSlo, resolve_priority
from minivllm.structured_output.manager import StructuredOutputManager
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


def check_timeout(value: object) -> float:
    """A request's `timeout` (seconds to start): a positive, finite number; ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"timeout: must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """What one request may ask for (--max-prompt-tokens, --max-n, --max-logprobs): bounds a client cannot
    raise, so one request cannot take the server's memory or time from everyone else."""

    max_prompt_tokens: int | None = None  # None: max_model_len bounds it
    max_n: int = 16
    max_logprobs: int = 20

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """ValueError naming the field and the flag when a request asks for more than the limits allow."""
        if self.max_prompt_tokens is not None and num_prompt_tokens > self.max_prompt_tokens:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens exceed the server's limit of "
                             f"{self.max_prompt_tokens} (--max-prompt-tokens); shorten the prompt")
        width = params.beam_width if params.use_beam_search else params.n
        if width > self.max_n:
            name = "beam_width" if params.use_beam_search else "n"
            raise ValueError(f"{name}: {width} exceeds the server's limit of {self.max_n} (--max-n)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name}: {k} exceeds the server's limit of {self.max_logprobs} (--max-logprobs)")


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

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, priority: int | str = 0,
                arrival_time: float | None = None, fit_context: bool = False,
                default_max_tokens: int | None = None, ttft_slo_ms: float | None = None,
                timeout_s: float | None = None, lora: LoadedLoRA | None = None) -> EngineRequest:
        """Tokenize, validate and fill in max_tokens; ValueError naming the problem if the request can never run.
        `priority` is an int or a class name, `ttft_slo_ms` overrides its class's TTFT SLO (slo.py), `timeout_s`
        the longest it may wait to start (past it, it is dropped before any prefill).

        A missing max_tokens is `default_max_tokens` clipped to the room the prompt leaves, or without one
        runs to the end of the context. With `fit_context` (the servers, vLLM's rule) the prompt must leave
        room to generate and an explicit max_tokens must fit the context with the prompt."""
        params = params or SamplingParams()
        priority = resolve_priority(priority)
        arrival_time = arrival_time or time.time()
        deadline = self.ttft_slo.deadline(priority, arrival_time, ttft_slo_ms)
        start_deadline = arrival_time + check_timeout(timeout_s) if timeout_s is not None else math.inf
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
            fill = max(1, room) if default_max_tokens is None else min(default_max_tokens, room)
            params = params.clone(max_tokens=fill)
        return EngineRequest(request_id, text, ids, params, arrival_time, priority, deadline, start_deadline, grammar,
                             lora, waits)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        if self.kv_cache_mode != "paged" and (params.n > 1 or params.use_beam_search):
            # Samples and beams share KV blocks copy-on-write, which only the paged cache does.
            raise ValueError(f"n / use_beam_search: kv_cache_mode={self.kv_cache_mode} serves only n=1 requests "
                             "without beam search; use kv_cache_mode=paged")
        vocab = self.vocab_size
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
