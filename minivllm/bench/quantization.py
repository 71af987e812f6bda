"""`minivllm bench quantization`: speed and quality of every weight format, in one run.

Speed, on a SmolLM2-135M-shaped model (real config, random weights): one request at a time (an
80-token prompt, 128 new tokens: output tok/s including the prefill, and the median decode step),
and offline throughput at 16 and 64 sequences, for fp32, bf16, int8, int4 and w8a8, with HF
transformers fp32 at batch 1 in the same run. Each mode's weight bytes (what one decode step reads)
and its bandwidth roofline at batch 1 (bytes / the probe's median bandwidth: 9 passes before the speed
rounds and 3 at the start of each, so the probe samples the same drift as the modes).

Quality: held-out perplexity of the embedded model in every mode (HF fp32 on the same windows as the
reference), KL divergence of the next-token distributions against our fp32 and top-1 agreement, on
the embedded model and on the SmolLM2-shaped model (random weights: only KL and top-1 mean anything).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from minivllm.bench.latency import one_request
from minivllm.bench.quant_quality import MODES, measure_quality, mode_engine_kwargs
from minivllm.bench.quantization_report import plot, report, targets
from minivllm.bench.results import save
from minivllm.bench.roofline import add_probe_mib_arg, bandwidth_passes, bandwidth_stats
from minivllm.bench.throughput import greedy, hf_batch1, resolve_model, run_engine
from minivllm.config import EngineArgs, ModelConfig, cpu_count
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.layers import Linear
from minivllm.model.quantization import QuantizedLinear
from minivllm.model.superblock_linear import SuperblockLinear


def add_quantization_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench quantization`."""
    p.add_argument("--model", default=None, help="speed model directory (default: make --preset in a cache dir)")
    p.add_argument("--preset", default="smollm2-135m", help="preset to make when --model is not given")
    p.add_argument("--quality-model", default=None, help="perplexity model (default: the embedded model)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    p.add_argument("--group-size", type=int, default=32, help="int4 group size")
    p.add_argument("--prompt-len", type=int, default=80)
    p.add_argument("--output-len", type=int, default=128, help="new tokens of the batch-1 request")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds: each mode's batch-1 request and batches, modes taking turns (medians reported)")
    p.add_argument("--batches", default="16,64", help="offline throughput at these numbers of sequences")
    p.add_argument("--batch-output-len", type=int, default=64, help="new tokens per sequence in the batches")
    p.add_argument("--perplexity-tokens", type=int, default=16384, help="held-out tokens scored per mode")
    p.add_argument("--kl-tokens", type=int, default=2048, help="tokens compared on the speed model")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    add_probe_mib_arg(p)
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers (speed and perplexity)")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG plot next to it)")


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: every projection's weights (the LM head included; a weight kept in two
    layouts counts once), quantization scales, biases and norms. Embedding rows are a gather, not counted."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear | SuperblockLinear):
            total += sum(b.numel() * b.element_size() for b in m.buffers())
        elif isinstance(m, Linear):
            # (one layout of its weight counted: plain, packed or panels alone)
            total += m.in_features * m.out_features * torch.empty((), dtype=m.layout_dtype()).element_size()
            total += 0 if m.bias is None else m.bias.numel() * m.bias.element_size()
        elif type(m).__name__ in ("RMSNorm", "LayerNorm"):
            total += sum(p.numel() * p.element_size() for p in m.parameters())
    return total


def measure_speed(path: str, modes: list[str], ns: argparse.Namespace, prompt: list[int],
                  batch_prompts: dict[int, list[list[int]]], probe: Callable[[], None]) -> list[dict[str, Any]]:
    """Every mode's batch-1 requests and offline batches. All engines are built first and the modes take
    turns round by round (this machine's speed drifts by tens of percent over minutes: a mode measured
    alone, minutes after another, would carry the drift into the ratio); medians over the rounds.
    `probe` runs before each round's batch-1 requests, so the bandwidth is sampled under the same drift."""
    engines = {}
    for mode in modes:
        kw = mode_engine_kwargs(mode, ns.group_size)
        engines[mode] = LLMEngine(EngineArgs(model=path, kv_cache_memory="512MiB", num_threads=ns.threads, **kw))
        one_request(engines[mode], prompt[:8], 4)  # warm-up
    b1: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    batch: dict[str, dict[int, list[float]]] = {m: {b: [] for b in batch_prompts} for m in modes}
    for rnd in range(ns.repeats):
        print(f"speed: round {rnd + 1} of {ns.repeats}", flush=True)
        probe()
        for mode in modes:
            ttft, steps = one_request(engines[mode], prompt, ns.output_len)
            b1[mode].append((ns.output_len / (ttft + sum(steps)), statistics.median(steps)))
        for b, prompts in batch_prompts.items():
            for mode in modes:
                res = run_engine(engines[mode], prompts, greedy(ns.batch_output_len))
                batch[mode][b].append(b * ns.batch_output_len / res["elapsed"])
    rows = []
    for mode in modes:
        runner = engines[mode].runner
        rows.append({
            "mode": mode, "weight_bytes": decode_weight_bytes(runner.model),
            "b1_tok_s": statistics.median(t for t, _ in b1[mode]),
            "b1_decode_step_s": statistics.median(s for _, s in b1[mode]),
            "b1_rounds": [t for t, _ in b1[mode]],
            "kernels": {"linear": runner.linear_kernels, "quantized": runner.quant_kernels},
            "batches": {str(b): {"tok_s": statistics.median(v), "rounds": v} for b, v in batch[mode].items()},
        })
    return rows


def load_times(path: str, modes: list[str], group_size: int, tmp: str) -> dict[str, float]:
    """Seconds to load the model: as float32, quantized at load, and from a checkpoint saved by `minivllm
    quantize` (no quantization work: it should load as fast as float32), for each quantized mode."""
    from minivllm.model.loader import load_model
    from minivllm.model.quantized_checkpoint import save_quantized
    from minivllm.quant_config import QuantConfig

    mc = ModelConfig.from_pretrained(path)
    cpu = torch.device("cpu")

    def timed(m: ModelConfig, quant: QuantConfig | None) -> float:
        t = time.perf_counter()
        load_model(m, torch.float32, cpu, 256, quant)
        return time.perf_counter() - t

    timed(mc, None)  # warm the page cache
    out = {"fp32": timed(mc, None)}
    for mode in modes:
        if mode in ("fp32", "bf16"):
            continue
        cfg = QuantConfig(mode, group_size)
        out[f"{mode} quantized at load"] = timed(mc, cfg)
        saved = save_quantized(load_model(mc, torch.float32, cpu, 256, cfg), mc, cfg, os.path.join(tmp, mode))
        smc = ModelConfig.from_pretrained(saved)
        timed(smc, cfg)
        out[f"{mode} saved checkpoint"] = timed(smc, cfg)
    return out


def run_quantization(ns: argparse.Namespace) -> int:
    """`minivllm bench quantization`."""
    from minivllm.bench.perplexity import evaluation_data, hf_model, hf_token_logprobs
    from minivllm.default_model import default_model_path
    from minivllm.default_model.corpus import windows

    modes = [m.strip() for m in ns.modes.split(",")]
    for m in modes:
        mode_engine_kwargs(m)
    threads = ns.threads or cpu_count()
    torch.set_num_threads(threads)
    path = resolve_model(ns.model, ns.preset)
    vocab = ModelConfig.from_pretrained(path).vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(16, vocab) for _ in range(ns.prompt_len)]
    batches = [int(b) for b in ns.batches.split(",") if b]
    batch_prompts = {b: [[rng.randrange(16, vocab) for _ in range(ns.prompt_len)] for _ in range(b)] for b in batches}

    rates = bandwidth_passes(ns.probe_mib, threads=threads)
    rows = measure_speed(path, modes, ns, prompt, batch_prompts,
                         lambda: rates.extend(bandwidth_passes(ns.probe_mib, passes=3, threads=threads)))
    bw_median, bw_min, bw_max = bandwidth_stats(rates)
    for r in rows:
        r["b1_roofline_tok_s"] = bw_median / r["weight_bytes"]
        r["b1_roofline_frac"] = (1 / r["b1_decode_step_s"]) / r["b1_roofline_tok_s"]
    result: dict[str, Any] = {
        "model": path, "threads": threads, "prompt_len": ns.prompt_len, "output_len": ns.output_len,
        "batch_output_len": ns.batch_output_len, "group_size": ns.group_size,
        "bandwidth": {"median": bw_median, "min": bw_min, "max": bw_max, "passes": len(rates)}, "speed": rows,
    }
    if not ns.no_hf:
        from transformers import AutoModelForCausalLM

        print("speed: HF transformers fp32", flush=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=2, do_sample=False)
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ns.output_len,
                           min_new_tokens=ns.output_len, do_sample=False)
            elapsed = time.perf_counter() - t0
        result["hf_fp32"] = {"b1_tok_s": ns.output_len / elapsed,
                             "b1_decode_tok_s": hf_batch1(model, prompt, 32, 0)}
        del model

    qpath = ns.quality_model or default_model_path()
    held, _ = evaluation_data(qpath, ns.perplexity_tokens)
    wins = windows(held, 256)
    print(f"quality: {len(wins)} windows of held-out text", flush=True)
    hf_lp = None if ns.no_hf else hf_token_logprobs(hf_model(qpath), wins)
    result["quality"] = {"model": qpath, **measure_quality(qpath, wins, modes, ns.group_size, hf_lp)}
    n_kl = max(ns.kl_tokens // 256, 1)
    kl_wins = [[rng.randrange(16, vocab) for _ in range(257)] for _ in range(n_kl)]
    print(f"quality: {n_kl} windows on {path}", flush=True)
    result["quality_speed_model"] = {"model": path, **measure_quality(path, kl_wins, modes, ns.group_size, None)}
    with tempfile.TemporaryDirectory() as tmp:
        print("load times", flush=True)
        result["load_s"] = load_times(path, modes, ns.group_size, tmp)
    result["targets"] = targets(result)
    print(report(result))
    save(result, ns.out, plot)
    return 0
