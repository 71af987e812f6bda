"""Engine configuration: EngineArgs is the one place flags and defaults live."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from minivllm.model_config import ModelConfig
from minivllm.quant_config import QUANTIZATION_KERNELS, QuantConfig
from minivllm.sampling_params import MAX_LOGPROBS
from minivllm.slo import TtftSlo
from minivllm.spec_decode.config import parse_speculative_config
from minivllm.structured_output.reasoning import REASONING_PARSER_NAMES

if TYPE_CHECKING:
    from minivllm.engine_config import EngineConfig

__all__ = ["ModelConfig"]  # re-exported: config is where EngineArgs' users find it

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_size(value: str | int, what: str) -> int:
    """Parse a memory size such as 2GiB, 512MiB, 1.5GB or a plain byte count; `what` names the setting in
    the error."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{what}: cannot parse size {value!r}; use e.g. '2GiB', '512MiB' or bytes")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """Map a --dtype value to a torch dtype.

    'auto' is float32 on CPU (this class of CPU runs fp32 matmuls faster than bf16, and fp32 keeps
    exact parity with the reference) and the checkpoint's own dtype on an accelerator.
    """
    if name == "auto":
        # Unknown or float32 checkpoint dtypes stay float32: exact, if slower.
        return torch.float32 if device.type == "cpu" else _DTYPES.get(checkpoint_dtype or "", torch.float32)
    if name not in _DTYPES:
        raise ValueError(f"dtype: unsupported value {name!r}; choose one of auto, float32, bfloat16, float16")
    return _DTYPES[name]


def default_device() -> torch.device:
    """CUDA when present, otherwise the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


RUNNERS = ("generate", "pooling")
BATCHING_MODES = ("continuous", "static")
KV_CACHE_MODES = ("paged", "contiguous", "none")
PREEMPTION_MODES = ("recompute", "swap", "auto")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_EVICTION_MODES = ("none", "sink-window")


# Each flag's section of the engine's config (engine_config.EngineConfig), which is also its group in --help.
ARG_SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "runner", "pooler_config", "dtype", "device", "max_model_len", "quantization",
              "quantization_group_size", "quantize_lm_head", "quantization_kernel", "linear_backend",
              "attention_backend", "enforce_eager", "seed", "num_threads"),
    "cache": ("kv_cache_memory", "num_kv_blocks", "kv_cache_dtype", "block_size", "enable_prefix_caching",
              "kv_cache_mode", "kv_eviction", "sink_tokens", "window_tokens", "preemption_mode", "swap_space",
              "swap_dir"),
    "scheduler": ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "batching"),
    "parallel": ("tensor_parallel_size",),
    "speculative": ("speculative_model", "num_speculative_tokens", "speculative_adaptive", "prompt_lookup_max",
                    "prompt_lookup_min", "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "speculative_config"),
    "lora": ("enable_lora", "lora_modules", "max_loras", "max_lora_rank"),
    "observability": ("check_invariants",),
    "serving": ("batch_wait_ms", "max_waiting", "client_stall_timeout", "ttft_slo_ms", "reasoning_parser",
                "max_prompt_tokens", "max_n", "max_logprobs", "max_stop_strings", "max_stop_string_length",
                "max_constraint_chars"),
}


def _arg(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Every engine flag with its default; the CLI, `LLM(...)` and the server all build from this."""

    model: str | None = _arg(None, "Hugging Face-format model directory (default: the embedded model)")
    runner: str = _arg("generate", "generate | pooling: pooling serves embeddings (/v1/embeddings, LLM.embed): "
                       "prompts are pooled into one vector each, nothing is generated")
    pooler_config: str | dict[str, Any] | None = _arg(
        None, "--runner pooling: {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true} (default: the "
        "checkpoint's sentence-transformers config, else LAST, normalized)")
    dtype: str = _arg("auto", "float32 | bfloat16 | float16 | auto (float32 on CPU, checkpoint dtype on GPU)")
    kv_cache_memory: str = _arg("2GiB", "memory budget for the paged KV cache pool, e.g. 2GiB")
    num_kv_blocks: int | None = _arg(None, "pool size in blocks, overriding kv_cache_memory (tests, debugging)")
    kv_cache_dtype: str = _arg(
        "auto", "KV cache storage: auto (the model's dtype) | int8 (one byte per value and a float16 scale per token "
        "and head: ~1.9x the tokens of bf16 and ~3.8x of fp32 in the same kv_cache_memory) | fp8 (e4m3, the same "
        "layout, on CUDA GPUs with fp8)")
    kv_eviction: str = _arg(
        "none", "none | sink-window (StreamingLLM, opt-in, lossy past sink_tokens + window_tokens): every token "
        "attends to the first sink_tokens positions and the last window_tokens, and the blocks in between are "
        "freed, so a sequence can run past the KV pool (up to max_model_len)")
    sink_tokens: int = _arg(4, "kv_eviction sink-window: attention-sink tokens kept at the start of a sequence")
    window_tokens: int | None = _arg(None, "kv_eviction sink-window: the recent tokens each token attends to")
    block_size: int = _arg(16, "tokens per KV cache block")
    max_num_seqs: int = _arg(256, "most sequences running in one step")
    max_num_batched_tokens: int | None = _arg(
        None, "token budget of one step (default: 512 on CPU, 2048 on GPU; without chunked prefill at least "
        "max_model_len)")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's context length)")
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = _arg(True, "split long prefills across steps within the token budget")
    num_threads: int | None = _arg(None, "torch intra-op threads for the engine (default: all cores)")
    attention_backend: str = _arg("auto", "paged attention implementation: auto | torch | cpu_native")
    linear_backend: str = _arg(
        "auto", "full-precision projections: auto (timed per shape class at start-up among oneDNN prepacked, oneDNN "
        "on plain weights and the native streaming kernel) | onednn | onednn_plain | native | torch")
    quantization: str | None = _arg(
        None, "quantize weights at load: int8 (per-channel, weight-only) | int4 (group-wise, weight-only) | w8a8 "
        "(int8 weights and per-token int8 activations) | w4a8 (int4 weights as int4, per-token int8 activations: "
        "llama.cpp Q4_0's kind of decode); a checkpoint saved by `minivllm quantize` loads as saved")
    quantization_group_size: int = _arg(32, "int4, w4a8: weights per scale/min group (32, 64, 128 or 256)")
    quantize_lm_head: bool = _arg(True, "quantize the LM head too (the largest matrix of a small model)")
    quantization_kernel: str = _arg(
        "auto", "quantized matmul kernel: auto (timed per shape class at start-up) | native | reference | int_mm "
        "(w8a8; int8 at many-token steps) | native_a8 (int4 / int8 at many-token steps: W4A8's / W8A8's kernel)")
    enforce_eager: bool = _arg(
        False, "run every step module by module (vLLM's name): the one-call native decoder stack that all-decode "
        "steps take on CPU float32 activations is off (debugging, A/B)")
    seed: int = _arg(0, "seed of the engine's random generator")
    device: str | None = _arg(None, "cpu | cuda (default: cuda when present)")
    check_invariants: bool = _arg(False, "check block-manager invariants after every step (tests, debugging)")
    batch_wait_ms: float = _arg(
        0.0, "serving: when the engine is idle, coalesce arrivals for up to this many ms before the first prefill "
        "step (0: continuous batching already merges arrivals)")
    max_waiting: int = _arg(512, "serving: most requests queued before new ones get 429 with Retry-After")
    client_stall_timeout: float = _arg(
        30.0, "serving: a client that reads nothing of its stream for this many seconds while outputs pile up is "
        "dropped (its request aborted, its KV freed); one that sends nothing more of its request body for as long "
        "gets 408 and is disconnected")
    # Per-request bounds a client cannot raise (input_processor.RequestLimits): safe defaults for a shared server.
    max_prompt_tokens: int | None = _arg(None, "longest prompt accepted, in tokens (default: max_model_len)")
    max_n: int = _arg(16, "most samples (n) or beams (beam_width) one request may ask for")
    max_logprobs: int = _arg(20, "most top logprobs (logprobs, prompt_logprobs) one request may ask for (vLLM's "
                                 "default)")
    max_stop_strings: int = _arg(64, "most stop strings one request may give (each is matched against new text on "
                                     "every step of each of its sequences)")
    max_stop_string_length: int = _arg(1024, "longest stop string accepted, in characters")
    max_constraint_chars: int = _arg(
        131072, "largest guided-decoding constraint accepted (JSON schema, regex, choices or grammar, in characters "
        "of its JSON form): compiling one costs the server time and memory")
    ttft_slo_ms: str | float | None = _arg(
        None, "default time-to-first-token SLO per priority class, e.g. interactive=500,batch=30000 (a class not "
        "named has no deadline; one number is interactive's). A request's deadline is its arrival plus its own "
        "ttft_slo_ms or its class's; within a priority, the earliest deadline is admitted first")
    batching: str = _arg(
        "continuous", "continuous | static. static is request-level batching, the seed's and HF generate's (an "
        "ablation baseline): a batch of up to max_num_seqs requests is admitted only once the previous batch has "
        "finished, so it runs to its longest request; with --batch-wait-ms a batch waits that long to fill")
    kv_cache_mode: str = _arg(
        "paged", "paged | contiguous | none (ablation baselines). contiguous: each sequence reserves max_model_len "
        "slots at admission, as a per-request contiguous cache must; none: no KV reuse, the whole sequence is "
        "recomputed every step. Both serve only n=1 requests without beam search")
    preemption_mode: str = _arg(
        "recompute", "how a running sequence gives up its KV blocks when the pool runs out: recompute (drop them; "
        "recomputed when it resumes) | swap (copy them to a host tier of swap_space and back when it resumes; "
        "recompute when the tier is full) | auto (per sequence, the cheaper of the two by measured costs: prefill "
        "seconds per token vs copy seconds per block)")
    swap_space: str = _arg(
        "4GiB", "preemption_mode swap|auto: the host tier's size per rank, e.g. 4GiB (vLLM's default): pinned host "
        "memory on CUDA, a memory-mapped file on CPU or wherever swap_dir is given; unused with recompute")
    swap_dir: str | None = _arg(
        None, "directory of the swap file (e.g. on an SSD; default: the system's temp directory); the file is "
        "unlinked as soon as it is mapped, so nothing is left behind")

    tensor_parallel_size: int = _arg(
        1, "shard the model across this many processes spawned by the engine (torch.distributed: gloo on CPU, NCCL "
        "on CUDA; on x86-64 CPUs the collectives go through shared memory, MINIVLLM_TP_COMM=gloo to keep gloo): "
        "column-parallel qkv/gate_up, row-parallel o/down, vocab-parallel embedding and LM head; kv_cache_memory "
        "is per rank. The ranks do not run the caller's main module: scripts need no __main__ guard")

    speculative_model: str | None = _arg(
        None, "speculative decoding proposer: ngram (prompt lookup: the tokens that followed the latest earlier "
        "occurrence of the sequence's last n tokens), suffix (suffix decoding: the most frequent continuation of the "
        "longest suffix match in the sequence or in earlier requests' outputs), a draft model directory "
        "(same tokenizer as the model), or default-draft (the embedded model's). Requests without penalties, "
        "logprobs or beams speculate")
    num_speculative_tokens: int = _arg(0, "tokens proposed per step for each speculating sequence")
    speculative_adaptive: bool = _arg(
        True, "propose only where the measured step costs say the step then yields tokens faster (per step and "
        "per request); off: every eligible sequence proposes every step")
    prompt_lookup_max: int = _arg(4, "ngram proposer: the longest suffix matched")
    prompt_lookup_min: int = _arg(1, "ngram proposer: the shortest suffix matched")
    suffix_decoding_max_tree_depth: int = _arg(24, "suffix proposer: the longest suffix matched")
    suffix_decoding_max_cached_requests: int = _arg(
        10000, "suffix proposer: finished requests whose outputs are searched (the oldest leave first; 0: none)")
    suffix_decoding_max_spec_factor: float = _arg(
        1.0, "suffix proposer: at most this many proposals per matched token (and num_speculative_tokens)")
    suffix_decoding_min_token_prob: float = _arg(
        0.1, "suffix proposer: proposals stop where the continuation's estimated probability falls below this")
    speculative_config: str | dict[str, Any] | None = _arg(
        None, "speculative decoding as vLLM's JSON, instead of the flags above: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3} or {\"model\": \"DIR|default-draft\", "
        "\"num_speculative_tokens\": 3} (also \"prompt_lookup_min\", \"adaptive\")")

    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT format, every decoder family) next to the base model")
    reasoning_parser: str | None = _arg(
        None, "qwen3 | deepseek_r1: the model thinks in <think> ... </think> before it answers; the thinking goes to "
        "reasoning_content, and guided decoding (and so tool_choice required or named) constrains the answer only")
    lora_modules: list[str] | None = _arg(
        None, "adapters to load at start-up, each NAME=DIR (PEFT: adapter_config.json + adapter_model.safetensors); "
        "a request picks one by naming it as its model")
    max_loras: int = _arg(4, "most LoRA adapters loaded at once (each takes a slot in every adapted projection)")
    max_lora_rank: int = _arg(16, "highest LoRA rank accepted (slots are sized for it)")

    def __post_init__(self) -> None:
        if self.model is None:
            from minivllm.default_model import default_model_path

            self.model = default_model_path()
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got {self.batch_wait_ms}")
        if not self.client_stall_timeout > 0:
            raise ValueError(f"client_stall_timeout must be > 0 seconds, got {self.client_stall_timeout}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.pooler_config is not None and self.runner != "pooling":
            raise ValueError("pooler_config applies to --runner pooling only")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_NAMES)}, got "
                             f"{self.reasoning_parser!r}")
        for name in ("max_prompt_tokens", "max_n", "max_stop_strings", "max_stop_string_length",
                     "max_constraint_chars"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        TtftSlo.parse(self.ttft_slo_ms)  # ValueError naming what is wrong, at start-up rather than per request
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_mode not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache_mode must be one of {', '.join(KV_CACHE_MODES)}, got {self.kv_cache_mode!r}")
        self._check_eviction()
        self._check_swap()
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        for spec in self.lora_modules or []:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: expected NAME=DIR, got {spec!r}")
        if self.quantization is not None:
            QuantConfig(self.quantization, self.quantization_group_size, self.quantize_lm_head)
        if self.quantization_kernel not in QUANTIZATION_KERNELS:
            raise ValueError(f"quantization_kernel must be one of {', '.join(QUANTIZATION_KERNELS)}, "
                             f"got {self.quantization_kernel!r}")
        self._check_speculative()
        if parse_size(self.kv_cache_memory, "kv_cache_memory") <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")

    def _check_swap(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got "
                             f"{self.preemption_mode!r}")
        # Checked even with recompute (where it is unused): a typo should not wait for the day swap is turned on.
        if parse_size(self.swap_space, "swap_space") <= 0:
            raise ValueError(f"swap_space must be positive, got {self.swap_space!r}")
        if self.swap_dir is not None and not os.path.isdir(self.swap_dir):
            raise ValueError(f"swap_dir: {self.swap_dir!r} is not an existing directory")
        if self.preemption_mode != "recompute" and self.kv_cache_mode != "paged":
            raise ValueError(f"preemption_mode={self.preemption_mode} needs kv_cache_mode=paged, got "
                             f"{self.kv_cache_mode!r}")

    def _check_eviction(self) -> None:
        if self.kv_eviction not in KV_EVICTION_MODES:
            raise ValueError(f"kv_eviction must be one of {', '.join(KV_EVICTION_MODES)}, got {self.kv_eviction!r}")
        if self.kv_eviction == "none":
            return
        if self.window_tokens is None or self.window_tokens < 1:
            raise ValueError(f"kv_eviction sink-window needs window_tokens >= 1, got {self.window_tokens}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.kv_cache_mode != "paged":
            raise ValueError(f"kv_eviction sink-window needs kv_cache_mode=paged, got {self.kv_cache_mode!r}")
        if self.speculative_model is not None or self.speculative_config is not None:
            raise ValueError("kv_eviction sink-window does not combine with speculative decoding (the draft's own "
                             "pool and the verified rows assume the full context)")

    @property
    def sink_window(self) -> tuple[int, int] | None:
        """(sink_tokens, window_tokens) with sink-window eviction, else None."""
        return None if self.kv_eviction == "none" else (self.sink_tokens, int(self.window_tokens or 0))

    def _check_speculative(self) -> None:
        if self.speculative_config is not None:
            if self.speculative_model is not None or self.num_speculative_tokens:
                raise ValueError("give speculative_config or speculative_model / num_speculative_tokens, not both")
            for name, value in parse_speculative_config(self.speculative_config).items():
                setattr(self, name, value)
        if self.speculative_model is None:
            if self.num_speculative_tokens:
                raise ValueError("num_speculative_tokens needs speculative_model (ngram, suffix or a draft model)")
            return
        if self.speculative_model == "default-draft":  # the embedded model's trained draft
            from minivllm.default_model import default_draft_model_path

            self.speculative_model = default_draft_model_path()
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with speculative_model, got "
                             f"{self.num_speculative_tokens}")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(f"suffix_decoding_max_tree_depth must be >= 1 and suffix_decoding_max_cached_requests "
                             f">= 0, got {self.suffix_decoding_max_tree_depth} / "
                             f"{self.suffix_decoding_max_cached_requests}")
        if not (self.suffix_decoding_max_spec_factor > 0 and 0 <= self.suffix_decoding_min_token_prob <= 1):
            raise ValueError(f"suffix_decoding_max_spec_factor must be > 0 and suffix_decoding_min_token_prob in "
                             f"[0, 1], got {self.suffix_decoding_max_spec_factor} / "
                             f"{self.suffix_decoding_min_token_prob}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min / prompt_lookup_max must satisfy 1 <= min <= max, got "
                             f"{self.prompt_lookup_min} / {self.prompt_lookup_max}")
        if self.kv_cache_mode != "paged":
            raise ValueError(f"speculative decoding needs kv_cache_mode=paged, got {self.kv_cache_mode!r}")

    def create_engine_config(self, model_config: ModelConfig | None = None) -> EngineConfig:
        """The engine's frozen, nested config, resolved once (engine_config.py)."""
        from minivllm.engine_config import EngineConfig

        return EngineConfig.from_args(self, model_config)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
        """Add one --flag per field, with the field's default and help, grouped by the config's sections."""
        from minivllm.cli_args import add_dataclass_args

        add_dataclass_args(cls, parser, positional="model" if positional_model else None, sections=ARG_SECTIONS)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """Build from parsed CLI arguments."""
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def cpu_count() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
