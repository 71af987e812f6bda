"""`minivllm bench lora`: throughput of a batch mixing three LoRA adapters and the base model against the same
requests on the base model alone (one engine, LoRA enabled, the same slots loaded; ABBA rounds).

The adapters are written by `make-lora` (peft) for the model: rank 8 on every projection, rank 16 on q/v, and rank
4 on the MLP. The mixed run gives each request one of the three adapters or none in turn; the base run sends the
same prompts and lengths with no adapter, so both do the same base work and differ by the LoRA deltas (and, on
CPU, by decode steps leaving the native decode stack for the projections' Python path when a batch holds an
adapter).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np

from minivllm.bench.perplexity import evaluation_data
from minivllm.bench.results import save
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.lora_request import LoRARequest
from minivllm.sampling_params import SamplingParams

ADAPTERS = {"all-r8": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
            "qv-r16": (16, ("q_proj", "v_proj")), "mlp-r4": (4, ("gate_proj", "up_proj", "down_proj"))}
MODES = ("base", "mixed")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench lora`."""
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="ABBA-ordered rounds")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _run(eng: LLMEngine, prompts: list[list[int]], loras: list[LoRARequest | None], olen: int, tag: str
         ) -> tuple[float, dict[str, float]]:
    params = SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True)
    tm = eng.timings
    before = (tm.steps, tm.forward)
    for i, (p, lr) in enumerate(zip(prompts, loras, strict=True)):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params, lora_request=lr)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    seconds = time.perf_counter() - t0
    steps = max(tm.steps - before[0], 1)
    return seconds, {"steps": steps, "forward_ms_per_step": 1e3 * (tm.forward - before[1]) / steps}


def run_lora(ns: argparse.Namespace) -> int:
    """Run the bench; print the report; JSON with --out."""
    from minivllm.modelgen.make_lora import make_lora

    if ns.model is None:
        from minivllm.default_model import default_model_path

        ns.model = default_model_path()
    held, _ = evaluation_data(ns.model)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: make_lora(ns.model, os.path.join(tmp, name), rank=r, targets=t, seed=i, std=0.02)
                 for i, (name, (r, t)) in enumerate(ADAPTERS.items())}
        eng = LLMEngine(EngineArgs(model=ns.model, dtype=ns.dtype, max_num_seqs=ns.max_num_seqs, enable_lora=True,
                                   max_lora_rank=16, max_loras=len(ADAPTERS), enable_prefix_caching=False))
        reqs = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())]
        cycle = [None, *reqs]

        def prompts_of(seed: int) -> list[list[int]]:
            g = np.random.default_rng(seed)
            starts = g.integers(0, len(held) - ns.prompt_len, ns.requests)
            return [held[s:s + ns.prompt_len].tolist() for s in starts]

        warm = prompts_of(999)[:8]
        _run(eng, warm, [cycle[i % 4] for i in range(len(warm))], 8, "warm")
        runs: dict[str, list[tuple[float, dict[str, float]]]] = {m: [] for m in MODES}
        for r in range(ns.rounds):
            prompts = prompts_of(r)
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                loras: list[LoRARequest | None] = ([cycle[i % 4] for i in range(ns.requests)] if m == "mixed"
                                                   else [None] * ns.requests)
                runs[m].append(_run(eng, prompts, loras, ns.output_len, f"{m}{r}"))
    tokens = ns.requests * ns.output_len
    rows: dict[str, dict[str, Any]] = {}  # mode → medians, and its runs' tokens/s
    for m in MODES:
        tok_s = [tokens / s for s, _ in runs[m]]
        rows[m] = {"output_tok_s": float(np.median(tok_s)), "runs_tok_s": tok_s,
                   **{k: float(np.median([st[k] for _, st in runs[m]])) for k in runs[m][0][1]}}
    result = {"model": ns.model, "dtype": ns.dtype, "requests": ns.requests, "prompt_len": ns.prompt_len,
              "output_len": ns.output_len, "max_num_seqs": ns.max_num_seqs, "rounds": ns.rounds,
              "adapters": {k: {"rank": r, "targets": list(t)} for k, (r, t) in ADAPTERS.items()}, "rows": rows,
              "mixed_vs_base": rows["mixed"]["output_tok_s"] / rows["base"]["output_tok_s"]}
    print(report(result))
    save(result, ns.out, None)
    return 0


def report(r: dict[str, Any]) -> str:
    """A markdown table and the verdict against the 0.8x target."""
    names = ", ".join(f"{k} (rank {v['rank']}: {', '.join(v['targets'])})" for k, v in r["adapters"].items())
    lines = [f"{r['requests']} requests x {r['rounds']} rounds ABBA, prompts {r['prompt_len']} + outputs "
             f"{r['output_len']} tokens (greedy, ignore_eos), {r['max_num_seqs']} sequences at a time. Mixed: each "
             f"request takes, in turn, the base model or one of three adapters: {names}.", "",
             "| batch | output tok/s (runs) | vs base | forward ms/step |", "|---|---|---|---|"]
    for m, x in r["rows"].items():
        runs = ", ".join(f"{t:.0f}" for t in x["runs_tok_s"])
        vs = x["output_tok_s"] / r["rows"]["base"]["output_tok_s"]
        lines.append(f"| {m} | {x['output_tok_s']:.0f} ({runs}) | **{vs:.2f}x** | {x['forward_ms_per_step']:.2f} |")
    ratio = r["mixed_vs_base"]
    lines += ["", f"Three adapters and the base model in one batch: **{ratio:.2f}x** the base model's throughput "
              f"(target >= 0.8x: {'met' if ratio >= 0.8 else 'missed'})."]
    return "\n".join(lines)
