"""`minivllm bench step`: the non-model share of a decode step with mixed sampling.

Every row of a real server's batch asks for something different: greedy, temperature with top-k/top-p,
a seed of its own, penalties, logprobs. This bench fills the engine with N such sequences (eight kinds,
cycled), runs them to pure decode, then times whole `step()` calls: the model's share is the forward
(+ logits) the runner reports, everything else (schedule, packing, sampling, penalties, logprobs,
detokenization, stop checks, outputs) is the engine's overhead. Streaming outputs (DELTA) as a server
asks for them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from minivllm.bench.results import save
from minivllm.bench.throughput import add_model_args, random_prompts, resolve_model
from minivllm.config import EngineArgs, ModelConfig, cpu_count
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import RequestOutputKind, SamplingParams


def add_step_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench step`."""
    add_model_args(p)
    p.add_argument("--batches", default="64,256", help="concurrent sequences to measure, comma-separated")
    p.add_argument("--input-len-min", type=int, default=16)
    p.add_argument("--input-len-max", type=int, default=64)
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per batch size")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures to this JSON file")


def mixed_params(i: int) -> SamplingParams:
    """The i-th row's settings: eight kinds cycled (a server's mix), all long enough to keep decoding."""
    base: dict[str, Any] = {"max_tokens": 10_000, "ignore_eos": True, "output_kind": RequestOutputKind.DELTA}
    kind = i % 8
    extra: dict[str, Any] = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_p": 0.95},
        {"temperature": 1.0, "top_k": 50},
        {"temperature": 0.7, "seed": i},
        {"temperature": 0.9, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.3},
        {"temperature": 0.0, "logprobs": 5},
        {"temperature": 0.8, "min_p": 0.05, "logprobs": 1},
        {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": i, "presence_penalty": 0.5},
    ][kind]
    return SamplingParams(**base, **extra)


MIX = ("greedy", "T=0.8 top-p 0.95", "T=1 top-k 50", "seeded T=0.7", "repetition+frequency+presence penalties",
       "greedy + 5 logprobs", "min-p 0.05 + 1 logprob", "seeded top-k/top-p + presence penalty")


def measure(engine: LLMEngine, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Pure-decode steps at len(prompts) sequences: wall time per step and the engine's phase split."""
    for i, p in enumerate(prompts):
        engine.add_request(f"step-{i}", {"prompt_token_ids": p}, mixed_params(i))
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
        engine.step()
    for _ in range(2):  # warm the decode shapes
        engine.step()
    # The output side's parts, timed by wrapping them on this engine instance only: detokenization with
    # stop checks (append_token, minus the logprob dicts it builds), logprob dicts, RequestOutput assembly.
    op: Any = engine.output_processor  # its methods are shadowed by instance attributes below (mypy refuses that)
    spent = {"detokenize_stop": 0.0, "logprob_dicts": 0.0, "outputs": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[name] += time.perf_counter() - t
        return wrapper

    op.append_token = timed("detokenize_stop", op.append_token)
    op.position_logprobs = timed("logprob_dicts", op.position_logprobs)
    op.make_output = timed("outputs", op.make_output)
    split0 = engine.timings.as_dict()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    for name in ("append_token", "position_logprobs", "make_output"):
        delattr(op, name)  # back to the class's methods
    spent["detokenize_stop"] -= spent["logprob_dicts"]  # the dicts are built inside append_token
    assert len(sched.running) == len(prompts), "every sequence must still be decoding"
    phases = {k: 1e3 * (v - split0[k]) / steps for k, v in engine.timings.as_dict().items()}
    for i in range(len(prompts)):
        engine.abort_request(f"step-{i}")
    wall = 1e3 * sum(walls) / steps
    forward = phases["forward"]
    return {"batch": len(prompts), "step_ms": wall, "step_ms_median": 1e3 * statistics.median(walls),
            "phases_ms": phases, "output_side_ms": {k: 1e3 * v / steps for k, v in spent.items()},
            "forward_ms": forward, "non_model_ms": wall - forward,
            "non_model_share": (wall - forward) / wall}


def report(r: dict[str, Any]) -> str:
    """Markdown: one row per batch size."""
    lines = [f"Pure-decode steps with mixed sampling ({r['model_name']}, {r['dtype']}, {r['threads']} threads), "
             f"rows cycling through: {', '.join(MIX)}; streaming (DELTA) outputs; {r['steps']} steps timed:", "",
             "| sequences | step (ms) | model (ms) | schedule | prepare | sample | update | non-model (ms) | "
             "**non-model share** |", "|---|---|---|---|---|---|---|---|---|"]
    for m in r["batches"]:
        ph = m["phases_ms"]
        lines.append(f"| {m['batch']} | {m['step_ms']:.1f} | {m['forward_ms']:.1f} | {ph['schedule']:.2f} | "
                     f"{ph['prepare']:.2f} | {ph['sample']:.2f} | {ph['update']:.2f} | {m['non_model_ms']:.2f} | "
                     f"**{100 * m['non_model_share']:.1f}%** |")
    lines += ["", "Inside `update`, the output side per step (timed on the engine thread, where it runs): "
              + "; ".join(f"{m['batch']} sequences: detokenization + stop strings "
                          f"{m['output_side_ms']['detokenize_stop']:.2f} ms, logprob dicts "
                          f"{m['output_side_ms']['logprob_dicts']:.2f} ms, RequestOutputs "
                          f"{m['output_side_ms']['outputs']:.2f} ms" for m in r["batches"]) + "."]
    return "\n".join(lines)


def verdict(r: dict[str, Any]) -> str:
    """The issue's target: non-model time at most 5% of the step at 256 sequences."""
    at = {m["batch"]: m for m in r["batches"]}
    if 256 not in at:
        return "Target (non-model ≤ 5% of the step at 256 sequences): not measured in this run."
    share = at[256]["non_model_share"]
    return (f"Target (non-model ≤ 5% of the step at 256 sequences): **{'met' if share <= 0.05 else 'not met'}: "
            f"{100 * share:.1f}%**.")


def run_step(ns: argparse.Namespace) -> int:
    """Entry point."""
    threads = ns.threads or cpu_count()
    torch.set_num_threads(threads)
    path = resolve_model(ns.model, ns.preset)
    mc = ModelConfig.from_pretrained(path)
    batches = [int(b) for b in ns.batches.split(",") if b.strip()]
    engine = LLMEngine(EngineArgs(model=path, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory,
                                  max_num_seqs=max(batches), num_threads=threads, seed=ns.seed))
    vocab = min(len(engine.tokenizer), mc.vocab_size)
    result: dict[str, Any] = {"model": path, "model_name": ns.model or ns.preset, "dtype": str(engine.dtype),
                              "threads": threads, "steps": ns.steps, "batches": []}
    for b in batches:
        prompts = random_prompts(b, ns.input_len_min, ns.input_len_max, vocab, ns.seed + b)
        m = measure(engine, prompts, ns.steps)
        print(f"{b} sequences: step {m['step_ms']:.1f} ms, model {m['forward_ms']:.1f} ms, "
              f"non-model {m['non_model_ms']:.2f} ms ({100 * m['non_model_share']:.1f}%) {m['phases_ms']}", flush=True)
        result["batches"].append(m)
    print(report(result))
    save(result, ns.out, None)
    return 0
