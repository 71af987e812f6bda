"""The engine's requests from queued to retired: add (validated), fork (n > 1), a sampling slot per sequence, finish,
abort, and fail (a request a fault touched is aborted and its reason kept for the front end). A component LLMEngine
composes: it holds the request table; the step calls it where a request's life changes."""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

import torch

from minivllm.engine.input_processor import EngineRequest, InputProcessor, Prompt, RequestSpec, duplicate_request_id
from minivllm.engine.lora_registry import LoadedLoRA, LoRARegistry
from minivllm.engine.sequence import BeamState, Sequence, SequenceGroup, SequenceStatus
from minivllm.lora_request import LoRARequest
from minivllm.model.input_batch import InputBatch, SlotParams
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.hooks import HookSet
    from minivllm.engine.output_processor import OutputProcessor
    from minivllm.engine.scheduler import Scheduler
    from minivllm.engine.stats import StatsRecorder

logger = logging.getLogger(__name__)
TIMEOUT_REASON = "request timed out"  # how the reason of a request dropped for its timeout begins


class RequestLifecycle:
    """Requests in and out of the engine, and the table of those not yet finished."""

    def __init__(self, device: torch.device, scheduler: Scheduler, hooks: HookSet, recorder: StatsRecorder,
                 input_batch: InputBatch, input_processor: InputProcessor, loras: LoRARegistry,
                 output_processor: OutputProcessor, eos_token_ids: frozenset[int]) -> None:
        # No reference back to the engine: a cycle would keep a dropped engine's weights and KV pool alive.
        self.device, self.scheduler, self.hooks, self.recorder = device, scheduler, hooks, recorder
        self.input_batch, self.input_processor, self.loras = input_batch, input_processor, loras
        self.output_processor, self.eos_token_ids = output_processor, eos_token_ids
        self.groups: dict[str, SequenceGroup] = {}
        # request id → why it failed, for requests a fault touched (aborted; see fail_request)
        self.failed_requests: dict[str, str] = {}
        self._arrivals = itertools.count()  # arrival order of the requests' sequences

    # ---- in ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    priority: int | str = 0, arrival_time: float | None = None, ttft_slo_ms: float | None = None,
                    timeout_s: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request (with `lora_request`, under that adapter, loaded on first use); raise
        ValueError naming the problem if it can never run."""
        lora = self.loras.resolve(lora_request)
        self.add_engine_request(self.process_request(request_id, prompt, sampling_params, priority, arrival_time,
                                                     ttft_slo_ms=ttft_slo_ms, timeout_s=timeout_s, lora=lora))

    def process_request(self, request_id: str, prompt: Prompt, sampling_params: SamplingParams | None = None,
                        priority: int | str = 0, arrival_time: float | None = None,
                        ttft_slo_ms: float | None = None, timeout_s: float | None = None,
                        lora: LoadedLoRA | None = None) -> EngineRequest:
        """Tokenize and validate without touching engine state (safe off the engine thread): InputProcessor.process
        with a RequestSpec of these fields."""
        spec = RequestSpec(sampling_params or SamplingParams(), priority, arrival_time, ttft_slo_ms=ttft_slo_ms,
                           timeout_s=timeout_s, lora=lora)
        return self.input_processor.process(request_id, prompt, spec)

    def add_engine_request(self, req: EngineRequest) -> None:
        """Queue a request that process_request() built."""
        if req.request_id in self.groups:
            raise ValueError(duplicate_request_id(req.request_id))
        if req.lora is not None:
            self.loras.check_current(req.lora)
        request_id, ids, params = req.request_id, req.prompt_token_ids, req.params
        group = SequenceGroup(request_id, req.prompt, ids, params, req.arrival_time, ttft_deadline=req.ttft_deadline,
                              start_deadline=req.start_deadline, grammar=req.grammar, lora=req.lora,
                              grammar_after_reasoning=req.grammar_after_reasoning, seats=req.seats)
        self.hooks.request_added(group)
        seq = Sequence(request_id, ids, params, next(self._arrivals), req.priority, group, 0)
        group.seqs.append(seq)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        if params.use_beam_search:
            assert params.max_tokens is not None  # process_request filled it in
            group.beam = BeamState(params.beam_width, params.length_penalty, params.early_stopping,
                                   params.max_tokens, [seq], [0.0])
        self.init_sequence(seq)
        self.groups[request_id] = group
        self.scheduler.add(seq)

    def init_sequence(self, seq: Sequence) -> None:
        """A new sequence's detokenizer, seeded generator and features' state."""
        p = seq.sampling_params
        if p.seed is not None and not p.greedy:
            # Sample i of a request draws from its own stream, so n > 1 stays reproducible.
            seq.generator = torch.Generator(device=self.device).manual_seed(p.seed + seq.index)
        assert seq.group is not None
        self.output_processor.init_sequence(seq, seq.group.prompt_token_ids)
        self.hooks.sequence_added(seq)

    # ---- sampling ------------------------------------------------------------------------------
    def sample_targets(self, rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The draws of a step's sampled rows: a request with n > 1 forks at its first sample (n draws from the
        same row); each drawing sequence holds an input-batch slot with its settings (written once)."""
        targets: list[tuple[Sequence, int]] = []
        for seq, r in rows:
            group = seq.group
            assert group is not None
            targets.append((seq, r))
            if group.params.n > 1 and not group.forked:
                group.forked = True
                for i in range(1, group.params.n):
                    child = Sequence(group.request_id, group.prompt_token_ids, group.params, seq.arrival_index,
                                     seq.priority, group, i)
                    self.scheduler.fork(seq, child)
                    self.init_sequence(child)
                    group.seqs.append(child)
                    targets.append((child, r))
        for seq, _ in targets:
            self.ensure_slot(seq)
        return targets

    def ensure_slot(self, seq: Sequence) -> None:
        """seq's input-batch slot, its settings written at its first sample (or first since a fork)."""
        if seq.slot >= 0:
            return
        p = seq.sampling_params
        # Before min_tokens, EOS and stop tokens are masked rather than sampled then ignored.
        banned = (*(self.eos_token_ids if not p.ignore_eos else ()), *p.stop_token_ids)
        params = SlotParams(0.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p, p.presence_penalty,
                            p.frequency_penalty, p.repetition_penalty, p.logprobs, p.min_tokens, banned, seq.generator)
        seq.slot = self.input_batch.add(params, seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids)

    # ---- out -----------------------------------------------------------------------------------
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None if unknown or done)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        group.aborted = True
        live = group.beam.live if group.beam is not None else group.seqs
        for seq in live:
            if not seq.status.finished:
                self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if group.beam is not None:
            group.beam.live = []
        if self.recorder.enabled:
            self.recorder.finished(group, self.scheduler.clock())
        return self.output_processor.make_output(group)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence: its blocks go back to the pool, its sampling slot to the input batch."""
        self.scheduler.finish(seq, status)
        if seq.slot >= 0:
            self.input_batch.remove(seq.slot)
            seq.slot = -1
        self.hooks.sequence_finished(seq)

    def fail_request(self, request_id: str, reason: str) -> None:
        """Abort a request a fault touched (its blocks freed now) and keep why, for take_failed_requests."""
        if request_id in self.groups:
            self.failed_requests[request_id] = reason
            try:
                self.abort_request(request_id)
            except Exception:  # building its last output failed again; its blocks and slot were released first
                logger.exception("request %s: its final output could not be built", request_id)

    def take_failed_requests(self) -> dict[str, str]:
        """Requests failed since the last call (request id → reason); they produce no further outputs."""
        failed, self.failed_requests = self.failed_requests, {}
        return failed

    # ---- adapters ------------------------------------------------------------------------------
    def remove_lora(self, name: str) -> None:
        """Unload an adapter (KeyError if unknown; ValueError while requests use it)."""
        in_use = sum(1 for g in self.groups.values() if g.lora is not None and g.lora.name == name)
        self.loras.remove(name, in_use)
