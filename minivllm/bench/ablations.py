"""What each technique buys: `bench throughput`'s ablations and its throughput-vs-concurrency sweep.

Each ablation is an engine mode (EngineArgs) run in the same process on the same requests as the full
engine, reported as a ratio to it. The full engine runs before and after its ablations (the machine's
speed drifts), and every engine of a workload gets the same KV pool: the paged engine's peak need, so
that what a mode wastes in memory costs it concurrency, as it would on a full machine.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from minivllm.bench.roofline import MachineCeilings, ModelCost
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Ablation:
    """One technique switched off: the engine flags that do it, and the workload that shows it."""

    name: str
    what: str
    args: dict[str, Any] = field(default_factory=dict)
    workload: str = "mixed"  # mixed | small (the same requests, fewer and shorter) | shared-prefix


ABLATIONS = (
    # Static batching caps the batch at 8, so a continuous engine capped at 8 is its control: the two
    # rows separate what the cap costs from what running each batch to its end costs.
    Ablation("continuous-8", "continuous batching, at most 8 running (the control for static batching)",
             {"max_num_seqs": 8}),
    Ablation("static-batching", "static request-level batching (the seed's): batches of 8, each runs to its "
             "longest request", {"batching": "static", "max_num_seqs": 8}),
    Ablation("contiguous-cache", "contiguous per-request KV cache: max_model_len slots reserved per sequence",
             {"kv_cache_mode": "contiguous"}),
    Ablation("no-chunked-prefill", "chunked prefill off: a prompt joins a step only whole",
             {"enable_chunked_prefill": False}),
    Ablation("no-prefix-caching", "prefix caching off, on requests that share a system prompt",
             {"enable_prefix_caching": False}, "shared-prefix"),
    Ablation("no-kv-cache", "KV cache off: the whole sequence is recomputed every step", {"kv_cache_mode": "none"},
             "small"),
)


@dataclass
class Workload:
    """Requests as token ids, each with its own greedy parameters."""

    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def output_tokens(self) -> int:
        """Tokens the workload generates (ignore_eos: exactly max_tokens each)."""
        return sum(p.max_tokens or 0 for p in self.params)

    def peak_kv_tokens(self, block_size: int) -> int:
        """KV slots the paged engine needs to hold every request at its longest at once."""
        return sum(-(-(len(p) + (sp.max_tokens or 0)) // block_size) * block_size
                   for p, sp in zip(self.prompts, self.params, strict=True))


def make_workloads(n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int,
                   greedy: Any) -> dict[str, Workload]:
    """mixed: n requests with prompt and output lengths uniform in the ranges (so a static batch waits for
    its longest); small: its first 8 requests cut to 16 tokens out (what recomputing everything can
    afford); shared-prefix: n requests of one 256-token system prompt + 16–64 tokens of their own."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(16, vocab) for _ in range(k)]  # noqa: E731
    prompts = [ids(rng.randint(*input_len)) for _ in range(n)]
    outs = [rng.randint(*output_len) for _ in range(n)]
    system = ids(256)
    return {
        "mixed": Workload(prompts, [greedy(o) for o in outs]),
        "small": Workload(prompts[:8], [greedy(min(o, 16)) for o in outs[:8]]),
        "shared-prefix": Workload([system + ids(rng.randint(16, 64)) for _ in range(n)], [greedy(32)] * n),
    }


def _engine(base: EngineArgs, **kw: Any) -> LLMEngine:
    return LLMEngine(replace(base, **kw))


def run_ablations(base: EngineArgs, workloads: dict[str, Workload], run_engine: Any,
                  ablations: tuple[Ablation, ...] = ABLATIONS) -> dict[str, Any]:
    """Every ablation on its workload, next to the full engine run before and after on the same requests."""
    results: dict[str, Any] = {}
    warm = Workload([[20 + i] * 16 for i in range(2)], [workloads["mixed"].params[0].clone(max_tokens=4)] * 2)
    for wname in dict.fromkeys(a.workload for a in ablations):
        wl = workloads[wname]
        todo = [a for a in ablations if a.workload == wname]
        block = base.block_size
        pool = -(-wl.peak_kv_tokens(block) // block)
        max_len = max(len(p) + (sp.max_tokens or 0) for p, sp in zip(wl.prompts, wl.params, strict=True))
        # One pool and one context limit for all: the full engine's peak need, and the longest request
        # rounded up to a block (the contiguous cache reserves that much per sequence).
        num_kv_blocks = max(pool, -(-max_len // block))
        args = replace(base, num_kv_blocks=num_kv_blocks, max_model_len=-(-max_len // block) * block,
                       max_num_seqs=max(len(wl.prompts), 1))
        full = _engine(args)
        run_engine(full, warm.prompts, warm.params)
        runs = [_summary(run_engine(full, wl.prompts, wl.params), wl)]
        outputs = runs[0].pop("outputs")
        abl: dict[str, Any] = {}
        for a in todo:
            eng = _engine(args, **a.args)
            run_engine(eng, warm.prompts, warm.params)
            r = _summary(run_engine(eng, wl.prompts, wl.params), wl)
            r["identical_outputs"] = sum(x == y for x, y in zip(r.pop("outputs"), outputs, strict=True))
            abl[a.name] = {"what": a.what, "args": a.args, **r}
            del eng
        runs.append(_summary(run_engine(full, wl.prompts, wl.params), wl))
        runs[-1].pop("outputs")
        base_tok_s = statistics.mean(r["output_tok_s"] for r in runs)
        for name, r in abl.items():
            r["ratio_to_full"] = r["output_tok_s"] / base_tok_s
            results[name] = {**r, "workload": wname}
        if "static-batching" in abl and "continuous-8" in abl:
            results["static-batching"]["ratio_to_control"] = (abl["static-batching"]["output_tok_s"]
                                                              / abl["continuous-8"]["output_tok_s"])
        results[f"full engine ({wname})"] = {
            "workload": wname, "output_tok_s": base_tok_s, "runs_output_tok_s": [r["output_tok_s"] for r in runs],
            "kv_waste": runs[0]["kv_waste"], "peak_kv_slots": runs[0]["peak_kv_slots"],
            "longest_step_ms": runs[0]["longest_step_ms"], "requests": len(wl.prompts),
            "output_tokens": wl.output_tokens, "pool_slots": num_kv_blocks * block,
            "max_model_len": args.max_model_len}
        del full
    return results


def _summary(r: dict[str, Any], wl: Workload) -> dict[str, Any]:
    return {"elapsed_s": r["elapsed"], "output_tok_s": wl.output_tokens / r["elapsed"], "steps": r["steps"],
            "kv_waste": r["kv_waste"], "peak_kv_slots": r["peak_kv_slots"],
            "longest_step_ms": 1e3 * r["longest_step_s"], "outputs": r["outputs"]}


def spread_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of random ids with lengths evenly spread over [lo, hi]: every n gets the same mix."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(round(lo + (hi - lo) * (i + 0.5) / n))] for i in range(n)]


def sweep_concurrency(engine: LLMEngine, input_len: tuple[int, int], vocab: int, seed: int, output_len: int,
                      levels: list[int], cost: ModelCost, ceil: MachineCeilings, run_engine: Any, greedy: Any
                      ) -> list[dict[str, Any]]:
    """Output tok/s with at most C sequences running (2C requests, at least 4, prompt lengths spread
    evenly over input_len at every level), against the roofline of the same requests at C (their
    prefill and decode FLOPs at peak, or a weight read per step of at most C tokens); one engine, its
    max_num_seqs changed between levels."""
    sched = engine.scheduler
    saved = sched.config
    out = []
    try:
        for c in levels:
            sched.config = replace(saved, max_num_seqs=c)
            reqs = spread_prompts(max(2 * c, 4), *input_len, vocab, seed + c)
            r = run_engine(engine, reqs, greedy(output_len))
            roof = cost.serving_roofline([len(p) for p in reqs], [output_len] * len(reqs), c, ceil)
            out.append({"concurrency": c, "requests": len(reqs), "output_len": output_len,
                        "output_tok_s": len(reqs) * output_len / r["elapsed"], "roofline_tok_s": roof["output_tok_s"],
                        "roofline_bound": roof["bound"], "elapsed_s": r["elapsed"]})
    finally:
        sched.config = saved
    return out
