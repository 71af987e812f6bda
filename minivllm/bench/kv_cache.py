"""`minivllm bench kvcache`: what the KV cache's storage costs and buys.

1. Capacity and throughput at one fixed KV budget: each storage (float32, bfloat16, int8 under a float32 or
   a bfloat16 model) runs the same offline requests, long enough that the pool, not max_num_seqs, bounds
   how many run at once; reported: the pool's tokens, the most sequences running in one step, preemptions,
   output tok/s (ratios to the model's own dtype in the same run).
2. Quality of int8 K/V: every held-out window decoded one token a step (teacher-forced), so every key and
   value but the current token's is read back from the cache: perplexity, KL(float cache || int8) and
   top-1 agreement, on the embedded model.
3. Quality cost of sink-window eviction (StreamingLLM) on windows longer than sinks + window, the same way.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from minivllm.bench.perplexity import evaluation_data
from minivllm.bench.results import save
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.runner import ModelRunner, SequenceInput
from minivllm.sampling_params import SamplingParams

STORAGES: dict[str, dict[str, Any]] = {  # name → engine kwargs
    "fp32": {"dtype": "float32"},
    "fp32+int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
    "bf16": {"dtype": "bfloat16"},
    "bf16+int8": {"dtype": "bfloat16", "kv_cache_dtype": "int8"},
}


def add_kvcache_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench kvcache`."""
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--kv-cache-memory", default="24MiB", help="the fixed KV budget every storage gets")
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--prompt-len", type=int, default=320)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="ABBA-ordered rounds of the throughput runs")
    p.add_argument("--quality-windows", type=int, default=8, help="held-out windows decoded per storage")
    p.add_argument("--quality-len", type=int, default=256,
                   help="tokens per window (the embedded model was trained on 256: past that, full attention "
                        "extrapolates and a window can score better than it)")
    p.add_argument("--sinks", type=int, default=4, help="sink-window eviction: sink tokens")
    p.add_argument("--windows", default="32,64,128", help="sink-window eviction: window sizes measured")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _throughput(ns: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    engines = {name: LLMEngine(EngineArgs(model=ns.model, kv_cache_memory=ns.kv_cache_memory,
                                          enable_prefix_caching=False, **kw)) for name, kw in STORAGES.items()}
    for name, eng in engines.items():  # warm-up: first-step allocations and kernel caches out of the timing
        eng.add_request(f"warm-{name}", {"prompt_token_ids": prompts[0]}, params)
        while eng.has_unfinished_requests():
            eng.step()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    order = list(engines)
    for r in range(ns.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            eng = engines[name]
            for i, p in enumerate(prompts):
                eng.add_request(f"{r}-{i}", {"prompt_token_ids": p}, params)
            peak, pre0 = 0, eng.scheduler.stats.num_preemptions
            t0 = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
                peak = max(peak, len(eng.scheduler.running))
            dt = time.perf_counter() - t0
            runs[name].append({"seconds": dt, "peak_running": peak,
                               "preemptions": eng.scheduler.stats.num_preemptions - pre0})
    rows = {}
    for name, eng in engines.items():
        cc = eng.cache_config
        secs = float(np.median([x["seconds"] for x in runs[name]]))
        rows[name] = {"pool_tokens": cc.num_blocks * cc.block_size, "num_blocks": cc.num_blocks,
                      "peak_running": max(x["peak_running"] for x in runs[name]),
                      "preemptions": int(np.median([x["preemptions"] for x in runs[name]])),
                      "output_tok_s": len(prompts) * ns.output_len / secs, "seconds": secs}
    return rows


def teacher_forced_logprobs(runner: ModelRunner, wins: list[list[int]], prefill: int = 1) -> torch.Tensor:
    """log-softmax of the next-token logits at positions prefill-1 .. len-2 of every window, all windows
    decoded together one token a step: [B, len - prefill, V]."""
    bs, tables, nxt = runner.block_size, [], 0
    for w in wins:
        n = -(-len(w) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    out = [runner.execute([SequenceInput(w[:prefill], 0, t, True) for w, t in zip(wins, tables, strict=True)])]
    for i in range(prefill, len(wins[0]) - 1):
        out.append(runner.execute([SequenceInput([w[i]], i, t, True) for w, t in zip(wins, tables, strict=True)]))
    return torch.log_softmax(torch.stack(out, 1).float(), -1)


def _runner(model: str, n_tokens: int, **kw: Any) -> ModelRunner:
    eng = LLMEngine(EngineArgs(model=model, num_kv_blocks=-(-n_tokens // 16) + 1, **kw))
    return eng.runner


def _compare(ref: torch.Tensor, got: torch.Tensor, wins: list[list[int]], prefill: int = 1) -> dict[str, float]:
    targets = torch.tensor([w[prefill:] for w in wins])
    nll = -got.gather(-1, targets[..., None]).mean().item()
    ref_nll = -ref.gather(-1, targets[..., None]).mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    return {"perplexity": float(np.exp(nll)), "ref_perplexity": float(np.exp(ref_nll)),
            "perplexity_change": float(np.exp(nll - ref_nll) - 1), "kl": kl, "top1": top1,
            "tokens": int(targets.numel())}


def _quality(ns: argparse.Namespace, held: np.ndarray) -> dict[str, Any]:
    n, length = ns.quality_windows, ns.quality_len
    wins = [held[i * length:(i + 1) * length].tolist() for i in range(n)]
    total = n * length
    ref = teacher_forced_logprobs(_runner(ns.model, total, dtype="float32"), wins)
    int8 = teacher_forced_logprobs(_runner(ns.model, total, dtype="float32", kv_cache_dtype="int8"), wins)
    bf16 = teacher_forced_logprobs(_runner(ns.model, total, dtype="bfloat16"), wins)
    bf16_int8 = teacher_forced_logprobs(_runner(ns.model, total, dtype="bfloat16", kv_cache_dtype="int8"), wins)
    result: dict[str, Any] = {"int8": _compare(ref, int8, wins), "bf16": _compare(ref, bf16, wins),
                              "bf16+int8": _compare(bf16, bf16_int8, wins), "windows": n, "length": length}
    eviction: dict[str, dict[str, Any]] = {}  # window → the comparison (and past_window: its own, nested)
    for w in (int(x) for x in ns.windows.split(",")):
        got = teacher_forced_logprobs(_runner(ns.model, total, dtype="float32", kv_eviction="sink-window",
                                              sink_tokens=ns.sinks, window_tokens=w), wins)
        eviction[str(w)] = _compare(ref, got, wins)
        past = ns.sinks + w  # positions whose context the eviction actually shortens
        if past < length - 1:
            eviction[str(w)]["past_window"] = _compare(ref[:, past:], got[:, past:], [x[past:] for x in wins])
    result["eviction"] = eviction
    return result


def run_kvcache(ns: argparse.Namespace) -> int:
    """Run the bench; print the report; JSON with --out."""
    if ns.model is None:
        from minivllm.default_model import default_model_path

        ns.model = default_model_path()
    held, _ = evaluation_data(ns.model)
    g = np.random.default_rng(0)
    starts = g.integers(0, len(held) - ns.prompt_len, ns.num_requests)
    prompts = [held[s:s + ns.prompt_len].tolist() for s in starts]
    result = {"model": ns.model, "kv_cache_memory": ns.kv_cache_memory, "num_requests": ns.num_requests,
              "prompt_len": ns.prompt_len, "output_len": ns.output_len, "sinks": ns.sinks,
              "throughput": _throughput(ns, prompts), "quality": _quality(ns, held)}
    print(report(result))
    save(result, ns.out, None)
    return 0


def report(r: dict[str, Any]) -> str:
    """Markdown tables and the issue's targets."""
    t = r["throughput"]
    seq = r["prompt_len"] + r["output_len"]
    lines = [f"KV budget {r['kv_cache_memory']}; {r['num_requests']} requests of {r['prompt_len']} prompt + "
             f"{r['output_len']} output tokens ({seq} each), prefix caching off.", "",
             "| storage | pool tokens | sequences that fit | most running in a step | preemptions | output tok/s | "
             "vs its model's dtype |", "|---|---|---|---|---|---|---|"]
    for name, x in t.items():
        base = t[name.split("+")[0]]
        ratio = x["output_tok_s"] / base["output_tok_s"]
        lines.append(f"| {name} | {x['pool_tokens']} | {x['pool_tokens'] // seq} | {x['peak_running']} | "
                     f"{x['preemptions']} | {x['output_tok_s']:.0f} | {ratio:.2f}x |")
    q = r["quality"]
    lines += ["", f"Quality (embedded model, {q['windows']} held-out windows of {q['length']} tokens decoded one "
              "token a step, so every earlier key and value is read back from the cache):", "",
              "| cache | against | perplexity | reference | change | KL | top-1 agreement |",
              "|---|---|---|---|---|---|---|"]
    for name, against in (("int8", "fp32"), ("bf16", "fp32"), ("bf16+int8", "bf16")):
        x = q[name]
        lines.append(f"| {name} | {against} | {x['perplexity']:.3f} | {x['ref_perplexity']:.3f} | "
                     f"{100 * x['perplexity_change']:+.2f}% | {x['kl']:.5f} | {100 * x['top1']:.2f}% |")
    lines += ["", f"Sink-window eviction ({r['sinks']} sinks) against full attention, float32:", "",
              "| window | perplexity | full | change | KL | top-1 | change past sinks + window |",
              "|---|---|---|---|---|---|---|"]
    for w, x in q["eviction"].items():
        past = x.get("past_window")
        past_s = f"{100 * past['perplexity_change']:+.2f}%" if past else "–"
        lines.append(f"| {w} | {x['perplexity']:.3f} | {x['ref_perplexity']:.3f} | "
                     f"{100 * x['perplexity_change']:+.2f}% | {x['kl']:.4f} | {100 * x['top1']:.1f}% | {past_s} |")
    ratio_f = t["fp32+int8"]["peak_running"] / max(1, t["fp32"]["peak_running"])
    ratio_b = t["bf16+int8"]["peak_running"] / max(1, t["bf16"]["peak_running"])
    lines += ["", f"Targets: sequences at the same budget >= 1.8x: {ratio_b:.2f}x against bf16, {ratio_f:.2f}x "
              f"against fp32 ({'met' if min(ratio_b, ratio_f) >= 1.8 else 'not met'}); throughput not lower: "
              f"{t['fp32+int8']['output_tok_s'] / t['fp32']['output_tok_s']:.2f}x (fp32 model), "
              f"{t['bf16+int8']['output_tok_s'] / t['bf16']['output_tok_s']:.2f}x (bf16 model); perplexity cost "
              f"+<=0.5%: {100 * q['int8']['perplexity_change']:+.2f}% "
              f"({'met' if q['int8']['perplexity_change'] <= 0.005 else 'not met'})."]
    return "\n".join(lines)
