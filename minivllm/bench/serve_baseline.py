"""`bench serve`'s baselines: the offline engine on the same requests (with --roofline, its steps and a
pure-decode step's split) and the workload's roofline, from the model's cost and this machine's ceilings."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from minivllm.bench.loadgen import RequestSpec
from minivllm.config import cpu_count
from minivllm.gc_utils import frozen_heap


def offline(path: str, requests: list[RequestSpec], tokenizer: Any, ns: argparse.Namespace,
             profile: bool = False) -> dict[str, Any]:
    """The offline engine's output tok/s on the same requests at the same concurrency; with profile, every
    step's (seconds, tokens, sequences, context tokens) and a pure-decode step's split at the served batch."""
    from minivllm.bench.throughput import greedy, run_engine
    from minivllm.config import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine

    # As many running at once as the server can have: its clients (closed loop), capped by its max_num_seqs.
    batch = ns.max_num_seqs or ns.concurrency
    if not ns.request_rate:
        batch = min(batch, ns.concurrency)
    engine = LLMEngine(EngineArgs(model=path, num_threads=ns.threads, kv_cache_memory=ns.kv_cache_memory,
                                  max_num_seqs=batch, enable_prefix_caching=False))
    prompts = [tokenizer.encode(r.prompt) for r in requests]
    run_engine(engine, prompts[:2], greedy(4))  # warm-up
    with frozen_heap():  # as the server runs (run_server freezes its start-up heap); unfrozen for the next engine
        return _offline_run(engine, prompts, requests, ns, batch, profile)


def _offline_run(engine: Any, prompts: list[list[int]], requests: list[RequestSpec], ns: argparse.Namespace,
                 batch: int, profile: bool) -> dict[str, Any]:
    from minivllm.bench.throughput import profile_decode
    from minivllm.sampling_params import RequestOutputKind, SamplingParams

    steps: list[tuple[float, int, int, int]] = []
    t0 = time.perf_counter()
    for i, (p, r) in enumerate(zip(prompts, requests, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=ns.ignore_eos,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.add_request(f"offline-{i}", {"prompt_token_ids": p}, params)
    tokens = 0
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        sched = engine.last_schedule
        if profile and sched is not None:  # (bookkeeping outside the step's own time)
            steps.append((time.perf_counter() - ts, sched.num_batched_tokens, len(sched.scheduled),
                          sum(seq.num_tokens for seq, _ in sched.scheduled)))
    out: dict[str, Any] = {"tok_per_s": tokens / (time.perf_counter() - t0)}
    if profile:
        out["steps"] = steps
        # A pure-decode step at the served batch, prompts of the workload's mean length, mid-answer context.
        mean_len = round(statistics.mean(len(p) for p in prompts)) + max(r.max_tokens for r in requests) // 2
        out["decode_profile"] = profile_decode(engine, [prompts[i % len(prompts)][:1] * mean_len for i in range(batch)])
    return out


def _model_cost(path: str) -> tuple[Any, Any]:
    """The model's config and its FLOP/byte cost (roofline.ModelCost) in the dtype the server runs."""
    import torch

    from minivllm.bench.roofline import ModelCost
    from minivllm.config import ModelConfig, resolve_dtype

    mc = ModelConfig.from_pretrained(path)
    return mc, ModelCost.from_config(mc, resolve_dtype("auto", mc.checkpoint_dtype, torch.device("cpu")))


def step_split(steps: list[tuple[float, int, int, int]], roof: dict[str, Any], path: str) -> dict[str, Any]:
    """The offline steps' time against each step's own roofline (this run's ceilings), decode-only steps apart
    from steps that carry prompt tokens."""
    from minivllm.bench.roofline import MachineCeilings

    _, cost = _model_cost(path)
    c = dict(roof["ceilings"])
    ceil = MachineCeilings(int(c.pop("threads")), **c)
    split: dict[str, Any] = {}
    for kind, keep in (("decode", lambda t, n: t == n), ("with prefill", lambda t, n: t != n)):
        sel = [s for s in steps if keep(s[1], s[2])]
        seconds = sum(s[0] for s in sel)
        bound = sum(cost.step_roofline(s[1], s[2], s[3], ceil) for s in sel)
        split[kind] = {"steps": len(sel), "seconds": seconds, "roofline_s": bound,
                       "tokens_per_step": statistics.mean(s[1] for s in sel) if sel else 0.0}
    return split

def _max_num_seqs(flags: list[str], default: int) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-num-seqs", type=int, default=default)
    return p.parse_known_args(flags)[0].max_num_seqs

def roofline(path: str, requests: list[RequestSpec], tokenizer: Any, ns: argparse.Namespace,
              variants: dict[str, list[str]], columns: dict[str, tuple[str, str]],
              earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each column's roofline: the workload's FLOPs at peak, or one weight read per step at most
    min(clients, max_num_seqs) tokens wide, whichever is slower; ceilings measured here, now, and with
    `earlier` (this run's first roofline) the better of the two measurements: the machine's speed drifts by
    a third over minutes, and a roofline from a slow moment flatters every fraction of it."""
    import torch

    from minivllm.bench.roofline import MachineCeilings, measure_ceilings_for

    mc, cost = _model_cost(path)
    # Measured with the server's thread count: the ceilings are the server engine's.
    saved = torch.get_num_threads()
    torch.set_num_threads(ns.server_threads or cpu_count())
    try:
        ceil = measure_ceilings_for(mc, probe_mib=ns.probe_mib)
    finally:
        torch.set_num_threads(saved)
    measured = [ceil.as_dict()]
    if earlier is not None:
        measured.insert(0, earlier["ceilings"])
        best = {k: (min if k == "bandwidth_min" else max)(m[k] for m in measured) for k in measured[0]}
        ceil = MachineCeilings(int(best.pop("threads")), **best)
    prompt_lens = [len(tokenizer.encode(r.prompt)) for r in requests]
    out_lens = [r.max_tokens for r in requests]
    clients = ns.concurrency if not ns.request_rate else ns.num_requests
    base = ns.max_num_seqs or max(ns.concurrency, 1)
    per_key = {}
    for k, (v, _) in columns.items():
        batch = min(clients, _max_num_seqs([*ns.server_arg, *variants[v]], base))
        per_key[k] = cost.serving_roofline(prompt_lens, out_lens, batch, ceil)
    return {"ceilings": ceil.as_dict(), "measured": measured, "prompt_tokens": sum(prompt_lens), "columns": per_key}
