"""The `minivllm bench` verbs: their argument parsers, and dispatch that imports a bench module only when
its verb runs. The CLI adds them under `bench`; `bench all` runs them through `run_bench` (the bench
package never imports the CLI)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable


def _bench(module: str, entry: str) -> Callable[[argparse.Namespace], int]:
    """A bench verb's handler, importing its module only when that verb runs."""
    def run(ns: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"minivllm.bench.{module}"), entry)(ns)

    return run


# verb → (module, its flags' function, its entry point, help)
VERBS: dict[str, tuple[str, str, str, str]] = {
    "throughput": ("throughput", "add_throughput_args", "run_throughput",
                   "offline throughput vs HF transformers, roofline, step split"),
    "latency": ("latency", "add_latency_args", "run_latency",
                "one request at a time: TTFT and per-token latency vs prompt length"),
    "serve": ("serve", "add_serve_args", "run_serve",
              "load generator against a server (HTTP, OpenAI or gRPC) vs the offline engine"),
    "step": ("step_overhead", "add_step_args", "run_step",
             "non-model share of a decode step with mixed sampling (64, 256 sequences)"),
    "beam": ("beam_driver", "add_beam_args", "run_beam",
             "beam search in the engine's step vs as a driver over single-token requests"),
    "speculative": ("speculative", "add_speculative_args", "run_speculative",
                    "decode tok/s with and without n-gram speculation (k swept), acceptance per position"),
    "perplexity": ("perplexity", "add_perplexity_args", "run_perplexity",
                   "held-out perplexity by our engine vs HF transformers and a unigram baseline"),
    "quantization": ("quantization", "add_quantization_args", "run_quantization",
                     "every weight format's speed (b=1, batches) and quality, with rooflines and HF transformers "
                     "in the same run"),
    "parallel": ("parallel", "add_parallel_args", "run_parallel",
                 "decode step time with tensor parallelism (TP=2 processes on gloo) vs one process, b=1 and 64"),
    "replicas": ("replicas", "add_replicas_args", "run_replicas",
                 "Ray Serve replicas (1, 2, 1 with 2 threads) vs one server on the seed's workload, and the "
                 "router's added latency"),
    "liveview": ("live_view", "add_liveview_args", "run_liveview",
                 "what the live view's event feed costs: throughput with and without a /ws/events viewer"),
    "kvcache": ("kv_cache", "add_kvcache_args", "run_kvcache",
                "KV storage at a fixed budget (fp32, bf16, int8): sequences that fit, throughput, int8 and "
                "sink-window quality"),
    "preemption": ("preemption", "add_preemption_args", "run_preemption",
                   "preemption by swap vs recompute (and auto) on a small pool: long prompts / short outputs, and "
                   "the reverse"),
    "slo": ("slo", "add_slo_args", "run_slo",
            "interactive TTFT and batch throughput under a mixed open-loop load, FCFS vs SLO-aware scheduling"),
    "soak": ("soak", "add_soak_args", "run_soak",
             "a real server under constant open-loop load with random hang-ups: RSS over time, leaked KV blocks, "
             "errors by cause, latency per minute"),
    "fairness": ("fairness", "add_fairness_args", "run_fairness",
                 "a light client's latency beside two heavy batch clients, one shared key vs named keys with seats"),
    "guided": ("guided", "add_guided_args", "run_guided",
               "guided JSON decoding vs the same requests unguided (16 sequences), mask time per step, and what "
               "overlapping the masks with the forward hides"),
    "lora": ("lora", "add_lora_args", "run_lora",
             "a batch mixing three LoRA adapters and the base model vs the base model alone (ABBA)"),
    "families": ("families", "add_families_args", "run_families",
                 "each new family's decode (b=1, 64; fp32, w4a8) at a real size vs its Llama twin and vs llama.cpp "
                 "on the same weights (llama.cpp from the [peers] extra)"),
    "peers": ("peers", "add_peers_args", "run_peers",
              "llama.cpp (same bits: F32, BF16, Q8_0, Q4_0) and HF transformers beside us on the same weights at "
              "every precision: b=1, 64 and a 512-token prefill, each engine's streamed bandwidth vs the probe"),
    "embeddings": ("embeddings", "add_embeddings_args", "run_embeddings",
                   "embedding throughput (--runner pooling) at 1, 16 and 64 sequences per call vs HF transformers' "
                   "forward on the same checkpoint"),
    "all": ("all", "add_all_args", "run_all", "every bench in turn, then BENCHMARKS.md regenerated from their results"),
}


def add_bench_verbs(bsub: argparse._SubParsersAction) -> None:
    """One sub-parser per bench verb (each module's flags are declared by the module itself)."""
    for verb, (module, add_args, entry, help_text) in VERBS.items():
        p = bsub.add_parser(verb, help=help_text)
        getattr(importlib.import_module(f"minivllm.bench.{module}"), add_args)(p)
        p.set_defaults(func=_bench(module, entry))


def run_bench(argv: list[str]) -> int:
    """Run one bench verb from its arguments (as `minivllm bench ARGV`); 2 with the message on bad input."""
    parser = argparse.ArgumentParser(prog="minivllm bench")
    add_bench_verbs(parser.add_subparsers(dest="bench", required=True))
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"minivllm bench {ns.bench}: error: {e}", file=sys.stderr)
        return 2
