"""The engine's configuration, resolved once and frozen (vLLM's VllmConfig): what the engine and its runner read.

EngineArgs (config.py) is the flat surface people set (command-line flags, `LLM(...)` keywords, the server's
options), each field with its default and help. `EngineArgs.create_engine_config()` resolves it once: the
checkpoint's config.json read, the device, dtype, context length, step token budget and quantization decided, sizes
parsed. The result, in the sections below, goes whole to the engine, its model runner (and every tensor-parallel
rank's), the KV-group plan, the swap tier and the speculator. Each flag belongs to one section (config.ARG_SECTIONS),
which is also how the CLI's --help groups the flags.

The *Settings classes hold what was asked, resolved; the *Config classes are what the engine and the scheduler
run with: SchedulerConfig (the step's limits) is resolved here too, CacheConfig (the pool's geometry: how many
blocks) once the engine has planned its KV groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minivllm.config import default_device, parse_size, resolve_dtype
from minivllm.model_config import BASE_MODEL_KEY, ModelConfig
from minivllm.pooler_config import PoolerConfig, resolve_pooler_config
from minivllm.quant_config import QuantConfig

if TYPE_CHECKING:
    from minivllm.config import EngineArgs


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """What to load and how to run it."""

    path: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    quantization: QuantConfig | None  # the checkpoint's own, else the one asked for
    quantization_kernel: str
    linear_backend: str
    attention_backend: str
    enforce_eager: bool
    seed: int
    num_threads: int | None  # None: every core this process may use
    runner: str = "generate"  # or "pooling": embeddings (engine/pooling.py)
    pooler: PoolerConfig | None = None  # --runner pooling: how hidden states become a vector (model/pooler.py)


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The KV cache: its budget and storage, prefix sharing, eviction and preemption."""

    block_size: int
    kv_cache_dtype: str
    kv_cache_memory: str  # as given (named in errors); kv_cache_bytes is the budget
    kv_cache_bytes: int  # the budget of one rank: num_kv_blocks' bytes when given, else kv_cache_memory
    num_kv_blocks: int | None
    enable_prefix_caching: bool  # (never with the ablation cache modes: neither can share blocks)
    kv_cache_mode: str
    sink_window: tuple[int, int] | None  # (sink_tokens, window_tokens) with sink-window eviction
    preemption_mode: str
    swap_space: int  # bytes of the host tier per rank (preemption_mode swap | auto)
    swap_dir: str | None

    @property
    def pool_flag(self) -> str:
        """The flag that sized the pool, as errors name it."""
        return (f"num_kv_blocks={self.num_kv_blocks}" if self.num_kv_blocks
                else f"kv_cache_memory={self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    # Benchmark-only ablation modes (engine/ablation_scheduler.py runs them; the default scheduler has no
    # branch for them):
    static_batching: bool = False  # admit a new batch only when the running one has finished
    reserve_tokens: int | None = None  # contiguous cache: slots each sequence reserves at admission
    recompute_kv: bool = False  # no KV reuse: every step recomputes each sampled sequence from its start
    preemption_mode: str = "recompute"  # recompute | swap | auto (EngineArgs.preemption_mode)

    @property
    def is_ablation(self) -> bool:
        """Whether any ablation mode is on."""
        return self.static_batching or self.reserve_tokens is not None or self.recompute_kv


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pool geometry, derived from the memory budget and the model."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool

    @staticmethod
    def from_budget(budget_bytes: int, block_size: int, bytes_per_token: int,
                    enable_prefix_caching: bool) -> CacheConfig:
        """Size the pool to fit the budget; at least one block is required."""
        num_blocks = budget_bytes // (block_size * bytes_per_token)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {budget_bytes} bytes cannot hold one block of {block_size} tokens "
                f"({block_size * bytes_per_token} bytes); raise the budget")
        return CacheConfig(block_size, int(num_blocks), enable_prefix_caching)


@dataclass(slots=True, frozen=True)
class ParallelConfig:
    """A process's place in the tensor-parallel group (the engine's: rank 0 of tensor_parallel_size)."""

    rank: int = 0
    size: int = 1


@dataclass(frozen=True, slots=True)
class SpeculativeSettings:
    """Speculative decoding: the proposer and how much it proposes."""

    model: str  # "ngram", "suffix" or a draft model's directory
    num_speculative_tokens: int
    adaptive: bool
    prompt_lookup_min: int
    prompt_lookup_max: int
    suffix: tuple[int, int, float, float] = (24, 10000, 1.0, 0.1)  # tree depth, cached requests, spec factor, min prob


@dataclass(frozen=True, slots=True)
class LoRASettings:
    """LoRA serving: the adapter slots and the adapters loaded at start-up."""

    max_loras: int
    max_lora_rank: int
    modules: tuple[tuple[str, str], ...]  # (name, directory)


@dataclass(frozen=True, slots=True)
class ObservabilitySettings:
    """Checks and traces beyond the metrics every engine keeps."""

    check_invariants: bool


@dataclass(frozen=True, slots=True)
class ServingSettings:
    """Admission and the front end: the async engine's and the input processor's bounds."""

    batch_wait_ms: float
    max_waiting: int
    client_stall_timeout: float
    ttft_slo_ms: str | float | None
    reasoning_parser: str | None
    max_prompt_tokens: int | None
    max_n: int
    max_logprobs: int
    max_stop_strings: int
    max_stop_string_length: int
    max_constraint_chars: int


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every section, resolved once from EngineArgs."""

    model_config: ModelConfig  # the checkpoint's config.json
    model: ModelSettings
    cache: CacheSettings
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeSettings | None
    lora: LoRASettings | None
    observability: ObservabilitySettings
    serving: ServingSettings

    @staticmethod
    def from_args(args: EngineArgs, model_config: ModelConfig | None = None) -> EngineConfig:
        """Resolve args (already checked field by field by EngineArgs) against the checkpoint (read here unless
        given) and the machine."""
        assert args.model is not None  # EngineArgs.__post_init__ fills in the default model
        mc = model_config or ModelConfig.from_pretrained(args.model)
        device = torch.device(args.device) if args.device else default_device()
        dtype = resolve_dtype(args.dtype, mc.checkpoint_dtype, device)
        max_model_len = args.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        budget = args.max_num_batched_tokens or default_batched_tokens(device, max_model_len,
                                                                       args.enable_chunked_prefill)
        if not args.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) when "
                             "chunked prefill is disabled")
        per_token = mc.kv_bytes_per_token(dtype, args.tensor_parallel_size, args.kv_cache_dtype)  # one rank's
        paged = args.kv_cache_mode == "paged"
        cache = CacheSettings(
            args.block_size, args.kv_cache_dtype, args.kv_cache_memory,
            (args.num_kv_blocks * args.block_size * per_token if args.num_kv_blocks
             else parse_size(args.kv_cache_memory, "kv_cache_memory")),
            # (pooling: a cached prefix's tokens would not be computed, and a mean over the prompt needs them all)
            args.num_kv_blocks, args.enable_prefix_caching and paged and args.runner != "pooling", args.kv_cache_mode,
            args.sink_window,
            args.preemption_mode, parse_size(args.swap_space, "swap_space"), args.swap_dir)
        scheduler = SchedulerConfig(
            args.max_num_seqs, budget, args.enable_chunked_prefill, static_batching=args.batching == "static",
            reserve_tokens=max_model_len if args.kv_cache_mode == "contiguous" else None,
            recompute_kv=args.kv_cache_mode == "none", preemption_mode=args.preemption_mode)
        pooling = args.runner == "pooling"
        if not pooling and mc.hf_config.get(BASE_MODEL_KEY):
            raise ValueError(f"model: {mc.path} holds a {mc.hf_config[BASE_MODEL_KEY]} (the transformer without a "
                             "language-model head, as embedding checkpoints are): serve it with --runner pooling")
        if pooling and (args.speculative_model is not None or args.speculative_config is not None):
            raise ValueError("runner: speculative decoding has nothing to speed up under --runner pooling (no tokens "
                             "are generated); drop the speculative flags")
        model = ModelSettings(
            args.model, dtype, device, max_model_len,
            QuantConfig.resolve(args.quantization, args.quantization_group_size, args.quantize_lm_head, mc),
            args.quantization_kernel, args.linear_backend, args.attention_backend, args.enforce_eager, args.seed,
            args.num_threads, args.runner,
            resolve_pooler_config(args.model, mc.hf_config, mc.hidden_size, args.pooler_config) if pooling else None)
        speculative = None if args.speculative_model is None else SpeculativeSettings(
            args.speculative_model, args.num_speculative_tokens, args.speculative_adaptive, args.prompt_lookup_min,
            args.prompt_lookup_max, (args.suffix_decoding_max_tree_depth, args.suffix_decoding_max_cached_requests,
                                     args.suffix_decoding_max_spec_factor, args.suffix_decoding_min_token_prob))
        lora = None if not args.enable_lora else LoRASettings(
            args.max_loras, args.max_lora_rank,
            tuple((name, path) for name, _, path in (s.partition("=") for s in args.lora_modules or [])))
        serving = ServingSettings(args.batch_wait_ms, args.max_waiting, args.client_stall_timeout, args.ttft_slo_ms,
                                  args.reasoning_parser, args.max_prompt_tokens, args.max_n, args.max_logprobs,
                                  args.max_stop_strings, args.max_stop_string_length, args.max_constraint_chars)
        return EngineConfig(mc, model, cache, scheduler, ParallelConfig(0, args.tensor_parallel_size), speculative,
                            lora, ObservabilitySettings(args.check_invariants), serving)

    @staticmethod
    def of_model(mc: ModelConfig, **kw: Any) -> EngineConfig:
        """A config for mc's checkpoint with EngineArgs keywords (a model runner on its own: tests, benches)."""
        from minivllm.config import EngineArgs

        return EngineArgs(model=mc.path, **kw).create_engine_config(mc)

    def for_draft(self, mc: ModelConfig) -> EngineConfig:
        """A draft model's runner config: its own checkpoint and context, this engine's dtype, device, kernels and
        block size, full precision, one rank, no eviction."""
        return dataclasses.replace(
            self, model_config=mc,
            model=dataclasses.replace(self.model, path=mc.path, max_model_len=mc.max_position_embeddings,
                                      quantization=None, quantization_kernel="auto"),
            cache=dataclasses.replace(self.cache, kv_cache_dtype="auto", sink_window=None),
            parallel=ParallelConfig(), speculative=None, lora=None)


def default_batched_tokens(device: torch.device, max_model_len: int, chunked_prefill: bool) -> int:
    """Step token budget when none is given.

    On CPU, 512-1024 measured fastest (benchmarks/step_budget.py): prefill ran 1.1-1.3x faster than with
    2048 because a step's activations stay in cache, while re-reading the weights each step costs ~3%
    of a 512-token step. The smaller of the two keeps decode steps short when prefills join them.
    Without chunked prefill a whole prompt must fit one step.
    """
    budget = 512 if device.type == "cpu" else 2048
    return budget if chunked_prefill else max(budget, max_model_len)
