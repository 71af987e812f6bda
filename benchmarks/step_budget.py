"""Prefill throughput against the step token budget (max_num_batched_tokens), alternated in one run.
    python benchmarks/step_budget.py [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

from minivllm.bench.throughput import random_prompts, resolve_model
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--budgets", default="256,512,1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = resolve_model(args.model, "smollm2-135m")
    prompts = random_prompts(48, 32, 256, 8192, 0)
    engines = {int(b): LLMEngine(EngineArgs(model=path, kv_cache_memory="1GiB", enable_prefix_caching=False,
                                            max_num_batched_tokens=int(b)))
               for b in args.budgets.split(",")}
    rates: dict[int, list[float]] = {b: [] for b in engines}
    n = sum(len(p) for p in prompts)
    for r in range(args.rounds):
        for b, eng in engines.items():
            for i, p in enumerate(prompts):
                eng.add_request(f"{r}-{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=1))
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            rates[b].append(n / (time.perf_counter() - t))
    best = max(statistics.median(v) for v in rates.values())
    for b, v in rates.items():
        med = statistics.median(v)
        print(f"max_num_batched_tokens {b:5d}: prefill {med:6.0f} tok/s ({med / best:.2f} of best)")


if __name__ == "__main__":
    main()
