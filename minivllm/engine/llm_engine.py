"""LLMEngine: add_request / step / abort over the scheduler, block manager and model runner."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.config import (
    CacheConfig,
    EngineArgs,
    ModelConfig,
    SchedulerConfig,
    cpu_count,
    default_batched_tokens,
    default_device,
    parse_size,
    resolve_dtype,
)
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model.runner import ModelRunner, SequenceInput
from minivllm.model.sampler import Sampler, SamplingMetadata
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]


@dataclass
class StepTimings:
    """Seconds per phase of the step, summed over steps (the step-time split)."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Phase → seconds."""
        return {"schedule": self.schedule, "prepare": self.prepare, "forward": self.forward,
                "sample": self.sample, "update": self.update}


class LLMEngine:
    """The synchronous engine core: one `step()` = schedule, one forward, sample, update."""

    def __init__(self, args: EngineArgs) -> None:
        if args.model is None:
            raise ValueError("model: no model directory given")
        self.args = args
        torch.set_num_threads(args.num_threads or cpu_count())
        self.device = torch.device(args.device) if args.device else default_device()
        self.model_config = mc = ModelConfig.from_pretrained(args.model)
        self.dtype = resolve_dtype(args.dtype, mc.checkpoint_dtype, self.device)
        self.max_model_len = args.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        token_budget = args.max_num_batched_tokens or default_batched_tokens(self.device, self.max_model_len,
                                                                             args.enable_chunked_prefill)
        if not args.enable_chunked_prefill and token_budget < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({token_budget}) must be >= max_model_len "
                             f"({self.max_model_len}) when chunked prefill is disabled")
        self.tokenizer = get_tokenizer(args.model)
        per_token = mc.kv_bytes_per_token(self.dtype)
        kv_bytes = (args.num_kv_blocks * args.block_size * per_token if args.num_kv_blocks
                    else parse_size(args.kv_cache_memory))
        self.cache_config = CacheConfig.from_budget(kv_bytes, args.block_size, per_token, args.enable_prefix_caching)
        self.scheduler_config = SchedulerConfig(args.max_num_seqs, token_budget, args.enable_chunked_prefill)
        cc = self.cache_config
        self.runner = ModelRunner(mc, self.dtype, self.device, cc.num_blocks, cc.block_size, self.max_model_len,
                                  args.attention_backend, args.linear_backend)
        self.block_manager = BlockManager(cc.num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.sampler = Sampler(self.device, args.seed)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.seqs: dict[str, Sequence] = {}
        self.timings = StepTimings()
        self._arrivals = itertools.count()
        logger.info("engine: %s (%s, %s) on %s, KV pool %d blocks x %d tokens",
                    mc.architecture, args.model, self.dtype, self.device, cc.num_blocks, cc.block_size)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Build an engine from EngineArgs."""
        return cls(args)

    # ---- requests ----------------------------------------------------------------------------
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
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validate and queue a request; raise ValueError naming the problem if it can never run."""
        params = sampling_params or SamplingParams()
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        self._validate(ids, params)
        seq = Sequence(request_id, ids, params, arrival_time or time.time(), next(self._arrivals), priority, text)
        if params.seed is not None and not params.greedy:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt: the prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token ids must be integers in [0, {vocab}); position {i} holds {t!r}")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens exceed max_model_len {self.max_model_len}; shorten the prompt")
        # Admission that never deadlocks: a request must fit the whole pool alone at its longest.
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        need = self.block_manager.blocks_needed(longest)
        if need > self.block_manager.num_blocks:
            pool = (f"num_kv_blocks={self.args.num_kv_blocks}" if self.args.num_kv_blocks
                    else f"kv_cache_memory={self.args.kv_cache_memory}")
            raise ValueError(
                f"request needs {need} KV blocks for prompt + max_tokens ({longest} tokens) but the whole pool has "
                f"{self.block_manager.num_blocks} ({pool}); lower max_tokens or give the KV cache more memory")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks (unknown or finished ids are ignored)."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None and not seq.status.finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    abort = abort_request

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.num_unfinished > 0

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the outputs of the requests that finished in it."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        t1 = time.perf_counter()
        if self.args.check_invariants:
            for seq, n in sched.scheduled:
                self.block_manager.check_writable(seq, n)
        self.runner.copy_blocks(sched.block_copies)
        inputs = [self._runner_input(seq, n) for seq, n in sched.scheduled]
        logits = self.runner.execute(inputs)
        t2 = time.perf_counter()
        sampling = [seq for (seq, _), inp in zip(sched.scheduled, inputs, strict=True) if inp.sample]
        token_ids = self.sampler.sample(logits, self._sampling_metadata(sampling)) if sampling else []
        t3 = time.perf_counter()
        outputs = self._update(sched, sampling, token_ids)
        t4 = time.perf_counter()
        tm, forward = self.timings, self.runner.last_forward_time
        tm.steps += 1
        tm.schedule += t1 - t0
        tm.prepare += (t2 - t1) - forward
        tm.forward += forward
        tm.sample += t3 - t2
        tm.update += t4 - t3
        if self.args.check_invariants:
            self.check_invariants()
        return outputs

    def _runner_input(self, seq: Sequence, n: int) -> SequenceInput:
        start = seq.num_computed_tokens
        return SequenceInput(seq.token_ids[start:start + n], start, seq.block_table,
                             start + n == seq.num_tokens)

    def _sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        temps, gens, banned = [], [], []
        for seq in seqs:
            p = seq.sampling_params
            temps.append(0.0 if p.greedy else p.temperature)
            gens.append(seq.generator)
            # Before min_tokens, EOS and stop tokens are masked rather than sampled then ignored.
            early = seq.num_output_tokens < p.min_tokens
            banned.append([*(self.eos_token_ids if not p.ignore_eos else ()), *p.stop_token_ids] if early else [])
        return SamplingMetadata(temps, gens, banned)

    def _update(self, sched: SchedulerOutput, sampling: list[Sequence], token_ids: list[int]) -> list[RequestOutput]:
        bm = self.block_manager
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            bm.cache_blocks(seq)
        finished = []
        for seq, tok in zip(sampling, token_ids, strict=True):
            seq.token_ids.append(tok)
            status = self._check_stop(seq, tok)
            if status is not None:
                self.scheduler.finish(seq, status)
                del self.seqs[seq.request_id]
                finished.append(self._make_output(seq))
        return finished

    def _check_stop(self, seq: Sequence, tok: int) -> SequenceStatus | None:
        p = seq.sampling_params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens and ((not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids):
            return SequenceStatus.FINISHED_STOPPED
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _make_output(self, seq: Sequence) -> RequestOutput:
        ids = seq.output_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=seq.sampling_params.skip_special_tokens)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids,
                             [CompletionOutput(0, text, ids, seq.status.value)], True, seq.num_cached_tokens)

    # ---- introspection -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Block accounting agrees with the live sequences."""
        self.block_manager.check_invariants(self.scheduler.running + self.scheduler.waiting)
