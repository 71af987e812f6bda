"""LLMEngine: add_request / step / abort over the scheduler, block manager and model runner."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from minivllm.config import EngineArgs, cpu_count
from minivllm.engine.async_stream import failure_text
from minivllm.engine.beam_search import BeamSearcher
from minivllm.engine.fault_injection import FaultInjectionHook, FaultInjector
from minivllm.engine.hooks import HookSet, StepHook
from minivllm.engine.input_processor import EngineRequest, InputProcessor, Prompt, RequestLimits
from minivllm.engine.kv_groups import plan_for_engine
from minivllm.engine.lora_registry import LoadedLoRA, LoRARegistry
from minivllm.engine.output_processor import OutputProcessor
from minivllm.engine.pooling import PoolingProcessor
from minivllm.engine.request_lifecycle import TIMEOUT_REASON, RequestLifecycle
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from minivllm.engine.stats import IterationStats, SchedulerSnapshot, StatsRecorder, StepTimings, scheduler_snapshot
from minivllm.engine.step_guard import Span, StepGuard, runner_inputs
from minivllm.engine.swap_manager import SwapCostHook, build_swap_manager
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from minivllm.model.runner import ModelRunner, SequenceInput
from minivllm.model.sampler import TokenLogprobs
from minivllm.model.step_sampling import SamplingRequest
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.factory import build_speculator
from minivllm.spec_decode.hook import SpeculationHook
from minivllm.spec_decode.speculator import Speculator
from minivllm.structured_output.hook import GuidedDecodingHook
from minivllm.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from minivllm.lora_request import LoRARequest
    from minivllm.model.lora import LoRAAdapter

logger = logging.getLogger(__name__)


def _scheduler_class(config: SchedulerConfig) -> type[Scheduler]:
    """The default scheduler, or the benchmark-only ablation one (imported only when asked for)."""
    if not config.is_ablation:
        return Scheduler
    from minivllm.engine.ablation_scheduler import AblationScheduler

    return AblationScheduler


class LLMEngine:
    """The synchronous engine core: one `step()` = schedule, one forward, sample, update; requests come and go
    through its RequestLifecycle."""

    def __init__(self, config: EngineConfig | EngineArgs, log_stats: bool = False) -> None:
        # The config, resolved once (engine_config.py), goes whole to the runner and the features' builders.
        self.config = config = config if isinstance(config, EngineConfig) else config.create_engine_config()
        ms, c = config.model, config.cache
        torch.set_num_threads(ms.num_threads or cpu_count())
        self.device, self.dtype, self.max_model_len = ms.device, ms.dtype, ms.max_model_len
        self.model_config = mc = config.model_config
        self.tokenizer = get_tokenizer(ms.path)
        # KV groups (kv_groups.py): a pool and block tables per attention window among the layers.
        self.kv_groups = plan_for_engine(config)
        self.cache_config = cc = CacheConfig(c.block_size, self.kv_groups.num_blocks[0], c.enable_prefix_caching)
        reserve = config.scheduler.reserve_tokens
        if reserve is not None and -(-reserve // cc.block_size) > cc.num_blocks:
            raise ValueError(f"kv_cache_mode=contiguous reserves max_model_len ({reserve}) slots per sequence but the "
                             f"pool holds {cc.num_blocks * cc.block_size}; give the KV cache more memory or lower "
                             "max_model_len")
        self.scheduler_config = config.scheduler
        self.quant_config = ms.quantization
        self.runner = ModelRunner(config, cc.num_blocks, self.kv_groups.group_blocks)
        self.block_manager = self.kv_groups.block_manager(cc.block_size, cc.enable_prefix_caching, c.sink_window)
        self.swap = build_swap_manager(c, self.runner, self.block_manager)  # None: preemption by recompute only
        self.scheduler = _scheduler_class(self.scheduler_config)(self.scheduler_config, self.block_manager, self.swap)
        # The runner samples (model/step_sampling.py); the engine gives sequences their slots in its input batch.
        self.sampler = self.runner.sampling.sampler
        self.input_batch = self.runner.sampling.input_batch  # the sampled sequences' settings and penalty stores
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        spare_core = self.device.type != "cpu" or cpu_count() > torch.get_num_threads()
        self.structured = StructuredOutputManager(self.tokenizer, mc.vocab_size, self.eos_token_ids, spare_core)
        sv = config.serving
        cap = self.kv_groups.sequence_block_cap(c.sink_window, config.scheduler.max_num_batched_tokens, cc.block_size)
        self.input_processor = InputProcessor(self.tokenizer, mc.vocab_size, self.max_model_len, c.kv_cache_mode,
                                              self.block_manager.blocks_needed, cc.num_blocks, c.pool_flag,
                                              sv.ttft_slo_ms, cap,
                                              RequestLimits(sv.max_prompt_tokens, sv.max_n, sv.max_logprobs,
                                                            config.scheduler.max_num_seqs, sv.max_waiting,
                                                            sv.max_stop_strings, sv.max_stop_string_length,
                                                            sv.max_constraint_chars),
                                              self.structured, sv.reasoning_parser)
        lora = config.lora
        self.loras = LoRARegistry(None if lora is None else self.runner.init_lora(lora.max_loras, lora.max_lora_rank))
        for name, path in lora.modules if lora is not None else ():
            self.loras.add(name, path)
        self._failures: dict[str, str] = {}  # this step's: request id → reason (failed once the step is done)
        self.faults = FaultInjector.from_env()  # None unless the test-only hook is armed
        self.speculator = build_speculator(config.speculative, self) if config.speculative else None
        # --runner pooling: prompts are pooled into vectors after the forward instead of sampled (pooling.py)
        self.pooler = PoolingProcessor(ms.pooler) if ms.pooler is not None else None
        self.every_row = ms.pooler is not None and ms.pooler.every_row  # the runner returns every token's row
        self.hooks = HookSet([])
        self._install_hooks()
        self.timings = StepTimings()
        self._sample_time = 0.0  # sampler seconds within the current step
        self.recorder = StatsRecorder(self.eos_token_ids)  # IterationStats since the last take_stats()
        self.log_stats = log_stats  # gather IterationStats (the server's metrics); off for offline use
        self.requests = RequestLifecycle(self.device, self.scheduler, self.hooks, self.recorder, self.input_batch,
                                         self.input_processor, self.loras, self.output_processor, self.eos_token_ids)
        self.groups = self.requests.groups  # the unfinished requests (the same dict)
        if self.pooler is not None:
            self.pooler.requests = self.requests
        self.beams = BeamSearcher(self.scheduler, self.recorder, self.eos_token_ids, self.max_model_len)
        self._in_flight: SchedulerOutput | None = None  # the step in progress (to name its requests on error)
        self.last_schedule: SchedulerOutput | None = None  # the last step's, for the live view (step_trace.py)
        logger.info("engine: %s (%s, %s%s) on %s, KV pool %d blocks x %d tokens",
                    mc.architecture, config.model.path, self.dtype,
                    f", {self.quant_config.method} {self.runner.quant_kernels}" if self.quant_config else "",
                    self.device, cc.num_blocks, cc.block_size)

    def _install_hooks(self) -> None:
        """The feature hooks of the current features, and the step guard around the forward they wrap."""
        self.hooks.install(self._feature_hooks())  # (in place: the request lifecycle holds the same HookSet)
        runner = self.runner  # (not self: a closure over the engine would keep a dropped engine alive in a cycle)
        self.guard = StepGuard(self.hooks.wrap_forward(lambda scheduled, inputs: runner.execute(inputs)),
                               isolate=self.config.parallel.size == 1)

    def set_speculator(self, speculator: Speculator | None) -> None:
        """Attach or detach speculative decoding between requests: the speculative bench compares one engine with
        and without its speculator (the same weights and memory placement on both sides)."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_speculator: the engine has unfinished requests")
        self.speculator = speculator
        self._install_hooks()

    def _feature_hooks(self) -> list[StepHook]:
        """The optional features' hooks, in the order each point calls them (proposals are made before guided
        decoding trims them)."""
        hooks: list[StepHook] = []
        if self.speculator is not None:
            hooks.append(SpeculationHook(self.speculator))
        hooks.append(GuidedDecodingHook(self.structured, self._failures.setdefault))
        if self.swap is not None:
            hooks.append(SwapCostHook(self.swap))
        if self.faults is not None:
            hooks.append(FaultInjectionHook(self.faults, self.tokenizer))
        if self.pooler is not None:
            hooks.append(self.pooler)
        return hooks

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_stats: bool = False) -> LLMEngine:
        """Build an engine from EngineArgs."""
        return cls(args, log_stats)

    # ---- requests (engine/request_lifecycle.py) ------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    priority: int | str = 0, arrival_time: float | None = None, ttft_slo_ms: float | None = None,
                    timeout_s: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; ValueError naming the problem if it can never run."""
        self.requests.add_request(request_id, prompt, sampling_params, priority, arrival_time, ttft_slo_ms,
                                  timeout_s, lora_request)

    def process_request(self, request_id: str, prompt: Prompt, sampling_params: SamplingParams | None = None,
                        priority: int | str = 0, arrival_time: float | None = None,
                        ttft_slo_ms: float | None = None, timeout_s: float | None = None,
                        lora: LoadedLoRA | None = None) -> EngineRequest:
        """Tokenize and validate without touching engine state (safe off the engine thread)."""
        return self.requests.process_request(request_id, prompt, sampling_params, priority, arrival_time,
                                             ttft_slo_ms, timeout_s, lora)

    def add_engine_request(self, req: EngineRequest) -> None:
        """Queue a request that process_request() built."""
        self.requests.add_engine_request(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None if unknown or done)."""
        return self.requests.abort_request(request_id)

    abort = abort_request

    def take_failed_requests(self) -> dict[str, str]:
        """Requests failed since the last call (request id → reason); they produce no further outputs."""
        return self.requests.take_failed_requests()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.groups)

    def add_lora(self, name: str, path: str, adapter: LoRAAdapter | None = None) -> LoadedLoRA:
        """Load a PEFT adapter under a name; ValueError naming the problem."""
        return self.loras.add(name, path, adapter)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (KeyError if unknown; ValueError while requests use it)."""
        self.requests.remove_lora(name)

    @property
    def log_stats(self) -> bool:
        """Whether the engine gathers IterationStats (the server's metrics)."""
        return self.recorder.enabled

    @log_stats.setter
    def log_stats(self, on: bool) -> None:
        self.recorder.enabled = on

    # ---- what the metrics and the live view read -----------------------------------------------
    def take_stats(self) -> IterationStats:
        """The stats gathered since the previous call (scheduler counters as deltas)."""
        return self.recorder.take(self.scheduler.stats, self.speculator.stats if self.speculator else None,
                                  self.block_manager.num_evicted_blocks)

    def snapshot(self, extra_waiting: int = 0) -> SchedulerSnapshot:
        """Requests running, waiting and swapped, and KV usage of both tiers, now."""
        return scheduler_snapshot(self.scheduler, len(self.groups), extra_waiting)

    def check_invariants(self) -> None:
        """Block accounting of both tiers agrees with the live sequences, and every sampling slot belongs to one."""
        live = self.scheduler.running + self.scheduler.waiting + self.scheduler.swapped
        self.block_manager.check_invariants(live)
        if self.swap is not None:
            self.swap.check_invariants(self.scheduler.swapped)
        if self.speculator is not None:
            self.speculator.proposer.check_invariants()
        slots = [s.slot for s in live if s.slot >= 0]
        assert len(set(slots)) == len(slots) == self.input_batch.num_active, (slots, self.input_batch.num_active)

    def take_failed_step(self) -> list[str]:
        """The request ids of a step that raised (empty if none was in progress); clears it."""
        sched, self._in_flight = self._in_flight, None
        return list(dict.fromkeys(seq.request_id for seq, _ in sched.scheduled)) if sched else []

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the outputs it produced (per each request's output kind)."""
        t0 = time.perf_counter()
        hooks = self.hooks
        hooks.before_schedule(self.scheduler)
        sched = self.scheduler.schedule()
        hooks.after_schedule(sched)
        for seq in sched.expired:  # not started within its timeout: dropped before any prefill
            assert seq.group is not None
            self.requests.fail_request(seq.request_id, f"{TIMEOUT_REASON}: not started within its timeout of "
                                                       f"{seq.group.start_deadline - seq.group.arrival_time:.3g} s "
                                                       "(the server is busy); dropped before prefill, retry later")
        t1 = time.perf_counter()
        moves_s = self._move_blocks(sched)  # before an empty return too: a step may move out all it had
        if sched.is_empty:
            return []
        self._in_flight = sched
        if self.log_stats:
            self.recorder.scheduled(sched.scheduled, sched.num_batched_tokens, sched.now)
        if self.config.observability.check_invariants:
            for seq, n in sched.scheduled:
                self.block_manager.check_writable(seq, n)
        hooks.before_forward(sched.scheduled)
        guarded = self.guard.forward(sched.scheduled, *runner_inputs(sched.scheduled, self.every_row))
        sched.scheduled, logits = guarded.scheduled, guarded.logits
        failures = self._failures  # request id → reason: no outputs, aborted after the step
        failures.clear()
        failures.update(guarded.failed)
        if not failures:  # a bisected step's time is not the batch's
            hooks.after_forward(sched, self.runner.last_forward_time, moves_s, self.runner.last_forward_first)
        t2 = time.perf_counter()
        self._sample_time = 0.0
        touched = (self._process(sched, guarded.inputs, guarded.spans, logits) if self.pooler is None
                   else self.pooler.process(sched, guarded.inputs, guarded.spans, logits))  # logits: hidden states
        hooks.end_step()
        t3 = time.perf_counter()
        now = self.scheduler.clock()  # time.time() but for tests, which script it (deadlines in steps)
        outputs = []
        for group in touched:
            if group.request_id in failures:
                continue
            if self.log_stats:
                self.recorder.token_times(group, now)
            try:
                out = self.output_processor.make_output(group)
            except Exception as e:  # e.g. detokenizing: fails this request only
                failures[group.request_id] = f"internal error building this request's output: {failure_text(e)}"
                continue
            if out is not None:
                outputs.append(out)
            if group.finished:
                self.groups.pop(group.request_id, None)
                if self.log_stats:
                    self.recorder.finished(group, now)
        self.recorder.produced.clear()
        self.last_schedule, self._in_flight = sched, None
        for rid, reason in list(failures.items()):
            self.requests.fail_request(rid, reason)
        t4 = time.perf_counter()
        tm, forward = self.timings, self.runner.last_forward_time
        tm.steps += 1
        tm.schedule += t1 - t0
        tm.prepare += (t2 - t1) - forward
        tm.forward += forward
        tm.sample += self._sample_time
        tm.update += (t3 - t2 - self._sample_time) + (t4 - t3)
        if self.config.observability.check_invariants:
            self.check_invariants()
        return outputs

    def _move_blocks(self, sched: SchedulerOutput) -> float:
        """The step's swaps, then its copy-on-write copies, in every KV group; the seconds the swaps took."""
        seconds = self.runner.move_blocks(sched.swap_out, sched.swap_in, sched.block_copies)
        for g, copies in enumerate(sched.group_copies, 1):  # the window KV groups' (kv_groups.py)
            swaps = sched.group_swaps[g - 1] if sched.group_swaps else ([], [])
            seconds += self.runner.move_blocks(*swaps, copies, g)
        return seconds

    def _process(self, sched: SchedulerOutput, inputs: list[SequenceInput], spans: list[Span],
                 logits: torch.Tensor) -> list[SequenceGroup]:
        """Everything after the forward: prompt logprobs, sampling, beams, stops. Returns touched groups."""
        sample_rows: list[tuple[Sequence, int]] = []
        prompt_jobs: list[tuple[Sequence, int, int, int]] = []
        spec_jobs: list[tuple[Sequence, int, int]] = []
        for (seq, n), (i0, _, r0, r1) in zip(sched.scheduled, spans, strict=True):
            if seq.spec_token_ids:
                spec_jobs.append((seq, n, r0))
                continue  # computed tokens and cached blocks follow verification
            inp = inputs[i0]
            if inp.all_logits:
                prompt_jobs.append((seq, inp.start_pos, n, r0))
            if inp.sample:
                sample_rows.append((seq, r1 - 1))
            seq.num_computed_tokens += n
            self.block_manager.cache_blocks(seq)
        # The runner samples every row in one call (the logits stay behind it): prompt logprobs, beams' log-probs,
        # draws (n > 1 forks first, so each sample has its slot), verifications; the features' logits processors
        # (guided masks) first. Then each new token goes through the stop checks and the hooks.
        req = SamplingRequest()
        owners = self.output_processor.prompt_logprob_rows(prompt_jobs, req) if prompt_jobs else []
        beams = [(s, r) for s, r in sample_rows if s.group is not None and s.group.beam is not None]
        req.beam_rows = [r for _, r in beams]
        plain = [(s, r) for s, r in sample_rows if s.group is not None and s.group.beam is None]
        targets = self.requests.sample_targets(plain)
        req.samples = [(r, s.slot) for s, r in targets]
        if spec_jobs:
            assert self.speculator is not None
            for seq, _, _ in spec_jobs:  # (a prompt cached up to its last token verifies before its first sample)
                self.requests.ensure_slot(seq)
            req.verifications = [self.speculator.verification(seq, row, n) for seq, n, row in spec_jobs]
        rows = [(s, r, 1) for s, r in plain] + [(s, row, n) for s, n, row in spec_jobs]
        if rows:
            hooks = self.hooks
            req.logits_processors.append(lambda x: hooks.process_logits(x, rows))
        out = self.runner.sample(logits, req)
        self._sample_time += out.seconds
        touched: dict[str, SequenceGroup] = {}
        if owners:
            self.output_processor.add_prompt_logprobs(owners, out.prompt_logprobs)
        if beams:
            assert out.beam_logprobs is not None
            self.beams.step(out.beam_logprobs, [s for s, _ in beams], touched)
        if out.sampled is not None:
            for (seq, _), tok, lp in zip(targets, out.sampled.token_ids, out.sampled.logprobs, strict=True):
                self._take_tokens(seq, [tok], lp, touched)
        for seq, _, _, _ in prompt_jobs:
            assert seq.group is not None
            touched.setdefault(seq.group.request_id, seq.group)
        for (seq, _, _), v, kept in zip(spec_jobs, req.verifications, out.verified, strict=True):
            assert self.speculator is not None
            self.speculator.record(seq, v.proposed, kept)
            self._take_tokens(seq, kept, None, touched)
            if not seq.status.finished:
                self.input_batch.extend(seq.slot, kept)  # its penalty counts, if it has penalties
                # KV holds the last token and the accepted proposals; the new last token is computed next step.
                seq.num_computed_tokens = seq.num_tokens - 1
                self.block_manager.cache_blocks(seq)
        self.scheduler.update_from_output([s for s, _ in sample_rows])
        return list(touched.values())

    def _take_tokens(self, seq: Sequence, tokens: list[int], lp: TokenLogprobs | None,
                     touched: dict[str, SequenceGroup]) -> None:
        """seq's new tokens, each through the stop checks and the hooks, until one finishes it."""
        for tok in tokens:
            self.recorder.generated(seq.request_id, 1)
            status = self.hooks.token_accepted(seq, tok, self._append_token(seq, tok, lp))
            if status is not None:
                self.requests.finish(seq, status)
                break
        assert seq.group is not None
        touched.setdefault(seq.group.request_id, seq.group)

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> SequenceStatus | None:
        """output_processor.append_token; an error there (detokenizing) fails seq's request, not the step."""
        try:
            return self.output_processor.append_token(seq, token, lp)
        except Exception as e:
            self._failures.setdefault(seq.request_id, f"internal error detokenizing this request: {failure_text(e)}")
            return None
