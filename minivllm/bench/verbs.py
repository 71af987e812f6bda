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


def add_bench_verbs(bsub: argparse._SubParsersAction) -> None:
    """One sub-parser per bench verb."""
    from minivllm.bench.throughput import add_throughput_args

    tp = bsub.add_parser("throughput", help="offline throughput vs HF transformers, roofline, step split")
    add_throughput_args(tp)
    tp.set_defaults(func=_bench("throughput", "run_throughput"))
    from minivllm.bench.latency import add_latency_args
    from minivllm.bench.serve import add_serve_args

    lt = bsub.add_parser("latency", help="one request at a time: TTFT and per-token latency vs prompt length")
    add_latency_args(lt)
    lt.set_defaults(func=_bench("latency", "run_latency"))
    sv = bsub.add_parser("serve", help="load generator against a server (HTTP, OpenAI or gRPC) vs the offline engine")
    add_serve_args(sv)
    sv.set_defaults(func=_bench("serve", "run_serve"))
    from minivllm.bench.step_overhead import add_step_args

    st = bsub.add_parser("step", help="non-model share of a decode step with mixed sampling (64, 256 sequences)")
    add_step_args(st)
    st.set_defaults(func=_bench("step_overhead", "run_step"))
    from minivllm.bench.beam_driver import add_beam_args

    bm = bsub.add_parser("beam", help="beam search in the engine's step vs as a driver over single-token requests")
    add_beam_args(bm)
    bm.set_defaults(func=_bench("beam_driver", "run_beam"))
    from minivllm.bench.perplexity import add_perplexity_args

    pp = bsub.add_parser("perplexity",
                         help="held-out perplexity by our engine vs HF transformers and a unigram baseline")
    add_perplexity_args(pp)
    pp.set_defaults(func=_bench("perplexity", "run_perplexity"))
    from minivllm.bench.quantization import add_quantization_args

    qb = bsub.add_parser("quantization", help="every weight format's speed (b=1, batches) and quality, with "
                         "rooflines and HF transformers in the same run")
    add_quantization_args(qb)
    qb.set_defaults(func=_bench("quantization", "run_quantization"))
    from minivllm.bench.all import add_all_args

    al = bsub.add_parser("all", help="every bench in turn, then BENCHMARKS.md regenerated from their results")
    add_all_args(al)
    al.set_defaults(func=_bench("all", "run_all"))


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
