"""`minivllm bench latency`: one request at a time — time to first token and per-token decode latency
against prompt length, on the offline engine, with the roofline of each in the same run.

TTFT here is the engine's: from add_request to the step that returns the first token (prefill, in
chunks of the step budget for long prompts). Per-token latency is the median decode step after it.
The model-bound floor for a decode step at batch 1 is reading every weight once (weight bytes /
measured bandwidth); for the prefill it is 2 x params x prompt tokens / measured FLOP/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from minivllm.bench.results import save
from minivllm.bench.roofline import ModelCost, measure_ceilings_for
from minivllm.bench.throughput import greedy, random_prompts, resolve_model
from minivllm.config import EngineArgs, ModelConfig, cpu_count
from minivllm.engine.llm_engine import LLMEngine


def add_latency_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench latency`."""
    p.add_argument("--model", default=None, help="model directory (default: make --preset in a cache dir)")
    p.add_argument("--preset", default="smollm2-135m", help="preset to make when --model is not given")
    p.add_argument("--prompt-lens", default="16,64,256,1024", help="comma-separated prompt lengths in tokens")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="requests per prompt length (the median is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG plot next to it)")


def one_request(engine: LLMEngine, prompt: list[int], output_len: int) -> tuple[float, list[float]]:
    """(TTFT, decode step times) of one request run alone."""
    engine.block_manager.reset_prefix_cache()  # a repeat must not hit the previous run's prompt
    t0 = time.perf_counter()
    engine.add_request("latency", {"prompt_token_ids": prompt}, greedy(output_len))
    group = engine.groups["latency"]
    ttft, steps, last = None, [], t0
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        if ttft is None and group.seqs[0].num_output_tokens > 0:
            ttft = now - t0
        elif ttft is not None:
            steps.append(now - last)
        last = now
    assert ttft is not None
    return ttft, steps


def run_latency(ns: argparse.Namespace) -> int:
    """`minivllm bench latency`."""
    threads = ns.threads or cpu_count()
    torch.set_num_threads(threads)
    path = resolve_model(ns.model, ns.preset)
    config = ModelConfig.from_pretrained(path)
    lens = sorted({int(x) for x in ns.prompt_lens.split(",")})
    if lens[-1] + ns.output_len > config.max_position_embeddings:
        raise ValueError(f"--prompt-lens: {lens[-1]} + {ns.output_len} tokens exceed the model's context "
                         f"({config.max_position_embeddings})")
    engine = LLMEngine(EngineArgs(model=path, num_threads=threads, dtype=ns.dtype, kv_cache_memory="1GiB"))
    ceilings = measure_ceilings_for(config, engine.dtype)
    cost = ModelCost.from_config(config, engine.dtype)
    one_request(engine, random_prompts(1, 8, 8, config.vocab_size, seed=99)[0], 4)  # warm-up
    rows = []
    for n in lens:
        runs = [one_request(engine, p, ns.output_len)
                for p in random_prompts(ns.repeats, n, n, config.vocab_size, seed=n)]
        ttft = statistics.median(r[0] for r in runs)
        tpot = statistics.median(statistics.median(r[1]) for r in runs)
        prefill_floor = 2 * (cost.body_params * n + cost.head_params) / ceilings.peak_flops
        decode_floor = cost.weight_bytes / ceilings.bandwidth
        rows.append({"prompt_len": n, "ttft_ms": 1000 * ttft, "tpot_ms": 1000 * tpot,
                     "prefill_tok_per_s": n / ttft, "decode_tok_per_s": 1 / tpot,
                     "ttft_floor_ms": 1000 * prefill_floor, "tpot_floor_ms": 1000 * decode_floor})
        print(f"prompt {n:5d}: TTFT {1000 * ttft:8.1f} ms, per token {1000 * tpot:6.1f} ms", flush=True)
    result = {"model": path, "threads": threads, "output_len": ns.output_len, "repeats": ns.repeats,
              "ceilings": {"peak_flops": ceilings.peak_flops, "bandwidth": ceilings.bandwidth},
              "weight_bytes": cost.weight_bytes, "rows": rows}
    print(report(result))
    save(result, ns.out, plot)
    return 0


def report(r: dict[str, Any]) -> str:
    """A markdown table."""
    c = r["ceilings"]
    lines = [f"one request at a time, {r['output_len']} tokens out, median of {r['repeats']}, {r['threads']} threads; "
             f"measured now: {c['peak_flops'] / 1e9:.0f} GFLOP/s, {c['bandwidth'] / 1e9:.1f} GB/s",
             "", "| prompt tokens | TTFT | prefill tok/s | TTFT floor (FLOP/s) | per-token latency | floor (weights / "
             "bandwidth) |", "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['prompt_len']} | {x['ttft_ms']:.1f} ms | {x['prefill_tok_per_s']:.0f} | "
                     f"{x['ttft_floor_ms']:.1f} ms | {x['tpot_ms']:.1f} ms | {x['tpot_floor_ms']:.1f} ms |")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: str) -> None:
    """TTFT and per-token latency against prompt length, with their floors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [x["prompt_len"] for x in r["rows"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.plot(xs, [x["ttft_ms"] for x in r["rows"]], "o-", label="TTFT")
    a.plot(xs, [x["ttft_floor_ms"] for x in r["rows"]], "k--", label="floor: 2·params·tokens / FLOP/s")
    b.plot(xs, [x["tpot_ms"] for x in r["rows"]], "o-", label="per-token latency")
    b.plot(xs, [x["tpot_floor_ms"] for x in r["rows"]], "k--", label="floor: weight bytes / bandwidth")
    for ax, title in ((a, "time to first token (ms)"), (b, "decode step, batch 1 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend(fontsize=7)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"minivllm bench latency: {os.path.basename(r['model'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
