"""`minivllm bench throughput`: offline throughput vs HF transformers' batched generate, in one process.

Also measures the machine's ceilings in the same run (the speed drifts ±30% over minutes, so only
ratios taken side by side mean anything), the roofline fraction, batch-1 decode against HF batch 1,
and the engine's step-time split.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import torch

from minivllm.bench.ablations import make_workloads, run_ablations, sweep_concurrency
from minivllm.bench.results import save
from minivllm.bench.roofline import MachineCeilings, ModelCost, measure_ceilings_for
from minivllm.bench.throughput_report import plot, report
from minivllm.config import EngineArgs, ModelConfig, cpu_count
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.model import cpu_kernels
from minivllm.model.decode_stack import DecodeStack
from minivllm.sampling_params import RequestOutputKind, SamplingParams


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench throughput`."""
    add_model_args(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len-min", type=int, default=32)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both engines (default: all cores)")
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine step budget (default: engine's)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--no-portable", action="store_true", help="skip the run on the portable torch paths")
    p.add_argument("--no-sampled", action="store_true", help="skip the sampled (T=0.8, top-p 0.95) run")
    p.add_argument("--batch1-output-len", type=int, default=64, help="tokens for the batch-1 decode comparison")
    p.add_argument("--no-ablations", action="store_true", help="skip the ablations (each technique switched off)")
    p.add_argument("--ablation-requests", type=int, default=64,
                   help="requests of the ablation workloads (outputs uniform in [output-len / 8, output-len])")
    p.add_argument("--concurrency-levels", default="1,4,16,64",
                   help="throughput-vs-concurrency sweep: max running sequences per level ('' to skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--output-json", dest="out", default=None,
                   help="write all figures to this JSON file (and a PNG plot next to it)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model / --preset, as every offline bench takes them (see resolve_model)."""
    p.add_argument("--model", default=None, help="model directory (default: make --preset in a cache dir)")
    p.add_argument("--preset", default="smollm2-135m", help="preset to make when --model is not given")


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """The benchmark's requests: exactly max_tokens tokens each, one output when finished."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY, **kw)


def resolve_model(model: str | None, preset: str) -> str:
    """The model directory to benchmark; presets are made once into ~/.cache/minivllm/bench-models."""
    if model:
        return model
    from minivllm.modelgen.make_model import make_model

    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "minivllm",
                         "bench-models", preset)
    if not os.path.isfile(os.path.join(cache, "config.json")):
        make_model(preset, cache)
    return cache


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids with lengths uniform in [lo, hi] (vLLM's random dataset)."""
    rng = random.Random(seed)
    # Ids above the special tokens and below the tokenizer's vocabulary.
    return [[rng.randrange(16, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
               ) -> dict[str, Any]:
    """Run every prompt to completion (params: one for all, or one per prompt); time each step and keep the
    step-time split, the longest step, and how much of the allocated KV memory held tokens."""
    engine.block_manager.reset_prefix_cache()
    t_split0 = dict(engine.timings.as_dict())
    steps0 = engine.timings.steps
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    bm = engine.block_manager
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, per_prompt, strict=True)):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": p}, sp)
    decode_steps: list[tuple[float, int, int]] = []  # (seconds, batch, context tokens) of pure-decode steps
    outputs: dict[str, list[int]] = {}
    held = allocated = 0  # token-steps of KV held vs slot-steps allocated (the waste is the difference)
    peak_slots = 0
    longest: float = 0  # seconds
    bookkeeping = 0.0  # the KV accounting below, kept out of the timings
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        running = list(engine.scheduler.running)
        pure_decode = not engine.scheduler.waiting and all(s.num_computed_tokens == s.num_tokens - 1 for s in running)
        ctx = sum(s.num_tokens for s in running)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        dt = time.perf_counter() - ts
        longest = max(longest, dt)
        if pure_decode and running:
            decode_steps.append((dt, len(running), ctx))
        tb = time.perf_counter()
        slots = bm.num_used * bm.block_size
        held += _kv_slots_holding_tokens(engine.scheduler.running, bm.block_size)
        allocated += slots
        peak_slots = max(peak_slots, slots)
        bookkeeping += time.perf_counter() - tb
    elapsed = time.perf_counter() - t0 - bookkeeping
    split = {k: v - t_split0[k] for k, v in engine.timings.as_dict().items()}
    return {"elapsed": elapsed, "steps": engine.timings.steps - steps0, "split": split,
            "decode_steps": decode_steps, "outputs": [outputs[f"bench-{i}"] for i in range(len(prompts))],
            "kv_waste": 1 - held / allocated if allocated else 0.0, "peak_kv_slots": peak_slots,
            "longest_step_s": longest}


def _kv_slots_holding_tokens(running: list[Any], block_size: int) -> int:
    """Slots of the used blocks that hold a computed token after a step; a block shared by several
    sequences (a cached prefix) counts once. Recompute mode holds nothing between steps."""
    filled: dict[int, int] = {}
    for s in running:
        n = s.num_computed_tokens
        for i, b in enumerate(s.block_table[:-(-n // block_size)]):
            filled[b] = max(filled.get(b, 0), min(block_size, n - i * block_size))
    return sum(filled.values())


def run_hf(path: str, prompts: list[list[int]], output_len: int, pad_id: int) -> dict[str, Any]:
    """HF transformers' batched greedy generate over all prompts at once (left padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
        elapsed = time.perf_counter() - t0
    gen = out[:, width:]
    assert gen.shape[1] == output_len
    return {"elapsed": elapsed, "outputs": gen.tolist(), "model": model}


def hf_batch1(model: Any, prompt: list[int], n: int, pad_id: int) -> float:
    """HF decode tokens/s at batch 1: time(n tokens) - time(1 token) over n - 1 tokens."""
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=pad_id, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        t2 = time.perf_counter()
    return (n - 1) / ((t2 - t1) - (t1 - t0))


def ours_batch1(engine: LLMEngine, prompt: list[int], n: int) -> float:
    """Our decode tokens/s at batch 1, from per-step times after the first token."""
    engine.add_request("b1", {"prompt_token_ids": prompt}, greedy(n))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return (n - 1) / sum(times[1:])


GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm")


def profile_decode(engine: LLMEngine, prompts: list[list[int]], steps: int = 6) -> dict[str, Any]:
    """Where a pure-decode step at len(prompts) concurrent sequences goes (GEMMs / attention / rest), and
    how the step time depends on the thread count (1 vs all cores, alternated in this run)."""
    from torch.profiler import ProfilerActivity, profile

    params = greedy(10_000)
    for i, p in enumerate(prompts):
        engine.add_request(f"prof-{i}", {"prompt_token_ids": p}, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()
    backend: Any = engine.runner.attention_backend  # its decode is shadowed below (mypy refuses that on a method)
    attn_time = [0.0]
    decode = backend.decode

    def timed_decode(*args):
        t = time.perf_counter()
        decode(*args)
        attn_time[0] += time.perf_counter() - t

    backend.decode = timed_decode  # instance attribute: shadows the method until deleted below
    # The native matmuls (csrc/gemv.c, gemm_f32.c) are ctypes calls the profiler cannot see: timed around the call.
    native_time, native_calls = [0.0], {k: k.__call__ for k in (cpu_kernels.GemvWeights, cpu_kernels.GemmPanels)}

    def timed(call):
        def run(self, x):
            t = time.perf_counter()
            out = call(self, x)
            native_time[0] += time.perf_counter() - t
            return out
        return run

    for kind, call in native_calls.items():
        kind.__call__ = timed(call)  # type: ignore[method-assign]
    # A step the decode stack runs (model/decode_stack.py) is one native call: its GEMMs and attention are inside it.
    stack_time, stack_call = [0.0], DecodeStack.__call__

    def timed_stack(self, h, positions):
        t = time.perf_counter()
        out = stack_call(self, h, positions)
        stack_time[0] += time.perf_counter() - t
        return out

    DecodeStack.__call__ = timed_stack  # type: ignore[method-assign]
    # Plain steps (the wall, attention, the engine's phases) alternate with profiled ones (GEMM time only: the
    # profiler's per-op overhead would inflate the rest): drift hits both alike, so their parts add up.
    walls, attns, gemms, stacks = [], [], [], []
    phase_sums: dict[str, float] = {}
    try:
        for _ in range(steps):
            split0, a0, n0, s0 = engine.timings.as_dict(), attn_time[0], native_time[0], stack_time[0]
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
            attns.append(attn_time[0] - a0)
            stacks.append(stack_time[0] - s0)
            native = native_time[0] - n0
            for k, v in engine.timings.as_dict().items():
                phase_sums[k] = phase_sums.get(k, 0.0) + v - split0[k]
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.step()
            gemms.append(native + sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS) / 1e6)
    finally:
        del backend.decode
        for kind, call in native_calls.items():
            kind.__call__ = call  # type: ignore[method-assign]
        DecodeStack.__call__ = stack_call  # type: ignore[method-assign]
    wall, attn, gemm = statistics.median(walls), statistics.median(attns), statistics.median(gemms)
    stack = statistics.median(stacks)
    # The engine's own phases over the plain steps: model = forward (+ logits), the rest is our overhead.
    phases = {k: 1e3 * v / steps for k, v in phase_sums.items()}
    # Thread sweep on the same sequences: alternate so drift hits both settings alike.
    full = torch.get_num_threads()
    by_threads: dict[int, list[float]] = {1: [], full: []}
    for _ in range(3):
        for n in by_threads:
            torch.set_num_threads(n)
            for _ in range(2):
                t = time.perf_counter()
                engine.step()
                by_threads[n].append(time.perf_counter() - t)
    torch.set_num_threads(full)
    for i in range(len(prompts)):
        engine.abort_request(f"prof-{i}")
    return {"batch": len(prompts), "step_ms": 1e3 * wall, "gemm_ms": 1e3 * gemm, "attention_ms": 1e3 * attn,
            "stack_ms": 1e3 * stack, "other_ms": 1e3 * (wall - gemm - attn - stack), "phases_ms": phases,
            "non_model_share": 1 - phases["forward"] / sum(phases.values()),
            "step_ms_by_threads": {n: 1e3 * statistics.median(v) for n, v in by_threads.items()}}


def run_throughput(ns: argparse.Namespace) -> int:
    """Entry point: run everything, print a report, optionally write JSON."""
    threads = ns.threads or cpu_count()
    torch.set_num_threads(threads)
    path = resolve_model(ns.model, ns.preset)
    mc = ModelConfig.from_pretrained(path)
    print(f"model {path} ({mc.architecture}), threads {threads}")
    ceil = measure_ceilings_for(mc)
    engine: LLMEngine | None  # None once the ablations have replaced it
    base = EngineArgs(model=path, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory,
                      max_num_seqs=max(256, ns.num_requests), num_threads=threads,
                      max_num_batched_tokens=ns.max_num_batched_tokens, attention_backend=ns.attention_backend)
    engine = LLMEngine(base)
    vocab = min(len(engine.tokenizer), mc.vocab_size)
    prompts = random_prompts(ns.num_requests, ns.input_len_min, ns.input_len_max, vocab, ns.seed)
    warm = random_prompts(4, 8, 32, vocab, ns.seed + 1)
    params = greedy(ns.output_len)
    run_engine(engine, warm, greedy(4))
    ours = run_engine(engine, prompts, params)
    n_out = ns.num_requests * ns.output_len
    n_prompt = sum(len(p) for p in prompts)
    cost = ModelCost.from_config(mc, engine.dtype)
    roof = cost.workload_roofline([len(p) for p in prompts], ns.output_len, ceil)
    result: dict[str, Any] = {
        "model": path, "architecture": mc.architecture, "dtype": str(engine.dtype), "threads": threads,
        "num_requests": ns.num_requests, "prompt_tokens": n_prompt, "output_tokens": n_out,
        "ceilings": ceil.as_dict(),
        "ours": {"elapsed_s": ours["elapsed"], "output_tok_s": n_out / ours["elapsed"],
                 "total_tok_s": (n_out + n_prompt) / ours["elapsed"], "steps": ours["steps"],
                 "roofline_s": roof, "roofline_fraction": roof / ours["elapsed"]},
        "step_split": _split(ours["split"], ours["steps"]),
        "decode_at_batch": _decode_roofline(ours["decode_steps"], cost, ceil),
    }
    if not ns.no_sampled:
        # Issue-3 check: sampling (temperature 0.8, top-p 0.95) against greedy on the same requests.
        sampled = run_engine(engine, prompts, greedy(ns.output_len).clone(temperature=0.8, top_p=0.95))
        result["sampled"] = {"elapsed_s": sampled["elapsed"], "output_tok_s": n_out / sampled["elapsed"],
                             "ratio_to_greedy": ours["elapsed"] / sampled["elapsed"],
                             "sample_ms_per_step": 1e3 * sampled["split"]["sample"] / sampled["steps"],
                             "greedy_sample_ms_per_step": 1e3 * ours["split"]["sample"] / ours["steps"]}
    b1_prompt = prompts[0][:32]
    result["ours"]["batch1_decode_tok_s"] = ours_batch1(engine, b1_prompt, ns.batch1_output_len)
    result["decode_profile"] = profile_decode(engine, prompts)
    levels = [int(c) for c in ns.concurrency_levels.split(",") if c.strip()]
    if levels:
        result["concurrency_sweep"] = sweep_concurrency(engine, (ns.input_len_min, ns.input_len_max), vocab,
                                                        ns.seed + 3, min(ns.output_len, 64), levels, cost, ceil,
                                                        run_engine, greedy)
    if not ns.no_ablations:
        del engine
        wls = make_workloads(ns.ablation_requests, (ns.input_len_min, ns.input_len_max),
                             (max(1, ns.output_len // 8), ns.output_len), vocab, ns.seed + 2, greedy)
        result["ablations"] = run_ablations(base, wls, run_engine)
        engine = None
    if not ns.no_portable:
        # The same engine on its portable paths (what CUDA / compiler-less machines run): what the
        # CPU fast paths buy, measured on the same requests.
        del engine
        portable = LLMEngine(EngineArgs(model=path, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory,
                                        max_num_seqs=max(256, ns.num_requests), num_threads=threads,
                                        max_num_batched_tokens=ns.max_num_batched_tokens,
                                        attention_backend="torch", linear_backend="torch"))
        run_engine(portable, warm, greedy(4))
        port = run_engine(portable, prompts, params)
        result["portable"] = {"elapsed_s": port["elapsed"], "output_tok_s": n_out / port["elapsed"],
                              "identical_outputs": sum(a == b for a, b in zip(ours["outputs"], port["outputs"],
                                                                                strict=True))}
        tokenizer = portable.tokenizer
        del portable
    else:
        tokenizer = engine.tokenizer if engine is not None else get_tokenizer(path)
    if not ns.no_hf:
        pad = tokenizer.pad_token_id or tokenizer.eos_token_id or 0
        hf = run_hf(path, prompts, ns.output_len, pad)
        same = sum(a == b for a, b in zip(ours["outputs"], hf["outputs"], strict=True))
        b1 = hf_batch1(hf["model"], b1_prompt, ns.batch1_output_len, pad)
        result["hf"] = {"elapsed_s": hf["elapsed"], "output_tok_s": n_out / hf["elapsed"],
                        "batch1_decode_tok_s": b1, "identical_outputs": same}
        result["speedup_vs_hf"] = hf["elapsed"] / ours["elapsed"]
        result["batch1_speedup_vs_hf"] = result["ours"]["batch1_decode_tok_s"] / b1
    print(report(result))
    save(result, ns.out, plot)
    return 0


def _split(split: dict[str, float], steps: int) -> dict[str, Any]:
    total = sum(split.values())
    return {k: {"ms_per_step": 1e3 * v / max(steps, 1), "share": v / total if total else 0.0}
            for k, v in split.items()}


def _decode_roofline(steps: list[tuple[float, int, int]], cost: ModelCost, ceil: MachineCeilings) -> dict[str, Any]:
    """Pure-decode steps at the largest batch: median step time against the step roofline."""
    if not steps:
        return {}
    top = max(b for _, b, _ in steps)
    sel = [(t, c) for t, b, c in steps if b == top]
    med = statistics.median(t for t, _ in sel)
    ctx = int(statistics.median(c for _, c in sel))
    roof = cost.step_roofline(top, top, ctx, ceil)
    return {"batch": top, "steps": len(sel), "median_step_ms": 1e3 * med, "tok_s": top / med,
            "roofline_step_ms": 1e3 * roof, "roofline_fraction": roof / med}
