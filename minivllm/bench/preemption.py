"""`minivllm bench preemption`: preemption by swap against recompute, on two workloads.

Every mode (recompute, swap, auto) runs the same offline requests on one small KV pool, so sequences preempt
each other throughout; the engines alternate in ABBA order within one run. Reported per workload: output tok/s
(ratio to recompute), preemptions by mode, bytes moved to and from the host tier, and the tokens the forwards
computed beyond the workload's own (what recompute redoes). Workloads:

- long prompts, short outputs: a preempted sequence has a long prompt computed, which recompute redoes and a
  swap copies (block bytes instead of a prefill);
- short prompts, long outputs: the victims have little computed, and what they have is cheap to recompute;
- a long shared prefix (a system prompt) before short unique prompts: a victim's prefix blocks are held by the
  sequences still running, so a recompute finds them in the prefix cache and redoes only its own tokens, while
  a swap copies its whole table out (the shared blocks come back by hash, uncopied).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import numpy as np

from minivllm.bench.perplexity import evaluation_data
from minivllm.bench.results import save
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams

MODES = ("recompute", "swap", "auto")


def add_preemption_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench preemption`."""
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workloads",
                   default="long-prompt=32x448x64,long-prompt-uncached=32x448x64:no-prefix-caching,"
                           "long-output=48x16x256,shared-prefix=48x32x128x384",
                   help="NAME=REQUESTSxPROMPTxOUTPUT[xSHARED_PREFIX][:no-prefix-caching], comma-separated")
    p.add_argument("--kv-cache-memory", default="11520KiB",
                   help="the small pool every mode gets (the embedded model in float32: 120 blocks)")
    p.add_argument("--swap-space", default="256MiB")
    p.add_argument("--swap-dir", default=None, help="where the host tier's file goes (default: the temp directory)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="ABBA-ordered rounds")
    p.add_argument("--out", default=None, help="write the results as JSON here")


def _workloads(spec: str) -> dict[str, tuple[int, int, int, int, bool]]:
    """name → (requests, prompt, output, shared prefix, prefix caching on)."""
    out = {}
    for part in spec.split(","):
        name, _, shape = part.partition("=")
        shape, _, option = shape.partition(":")
        n, p, o, *shared = (int(x) for x in shape.split("x"))
        out[name.strip()] = (n, p, o, shared[0] if shared else 0, option != "no-prefix-caching")
    return out


def _run_once(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict[str, float]:
    eng.take_stats()  # start the counters afresh
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    seconds = time.perf_counter() - t0
    st = eng.take_stats()
    return {"seconds": seconds, "preemptions": st.num_preemptions, "swap_preemptions": st.num_swap_preemptions,
            "swap_out_bytes": st.kv_swap_out_bytes, "swap_in_bytes": st.kv_swap_in_bytes,
            "computed_tokens": sum(st.num_iteration_tokens), "prefix_hits": st.prefix_cache_hits}


def _workload(ns: argparse.Namespace, held: np.ndarray, shape: tuple[int, int, int, int, bool], swap_dir: str
              ) -> dict[str, Any]:
    n, plen, olen, shared, prefix_caching = shape

    def prompts_of(seed: int) -> list[list[int]]:
        # Fresh prompts each round (the same for every mode): a repeat would hit the previous round's prefix cache.
        g = np.random.default_rng(seed)
        prefix = held[(s := int(g.integers(0, len(held) - shared))):s + shared].tolist()
        return [prefix + held[s:s + plen].tolist() for s in g.integers(0, len(held) - plen, n)]

    warm = prompts_of(1000)[:8]
    params = SamplingParams(temperature=0, max_tokens=olen, ignore_eos=True)
    engines = {m: LLMEngine(EngineArgs(model=ns.model, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory,
                                       max_num_seqs=ns.max_num_seqs, preemption_mode=m, swap_space=ns.swap_space,
                                       swap_dir=swap_dir, enable_prefix_caching=prefix_caching), log_stats=True)
               for m in MODES}
    outputs: dict[str, list[list[int]]] = {}
    for m, eng in engines.items():  # warm-up (and the greedy outputs each mode must agree on)
        got = {}
        for i, p in enumerate(warm):
            eng.add_request(f"warm-{i}", {"prompt_token_ids": p}, params)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        outputs[m] = [got[f"warm-{i}"] for i in range(len(warm))]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for r in range(ns.rounds):
        prompts = prompts_of(r)
        for m in MODES if r % 2 == 0 else MODES[::-1]:
            runs[m].append(_run_once(engines[m], prompts, params, f"{r}"))
    bs = engines["recompute"].cache_config.block_size
    rows: dict[str, dict[str, Any]] = {}  # mode → medians, and its runs' seconds
    for m in MODES:
        secs = float(np.median([x["seconds"] for x in runs[m]]))
        rows[m] = {k: float(np.median([x[k] for x in runs[m]])) for k in runs[m][0]}
        rows[m].update({"seconds": secs, "output_tok_s": n * olen / secs, "runs_s": [x["seconds"] for x in runs[m]]})
    return {"requests": n, "prompt_len": plen, "output_len": olen, "shared_prefix": shared,
            "prefix_caching": prefix_caching,
            "needed_tokens": n * (plen + olen - 1) + shared,  # the shared prefix computed once (prefix caching)
            "pool_tokens": engines["recompute"].cache_config.num_blocks * bs, "rows": rows,
            "same_outputs": all(outputs[m] == outputs["recompute"] for m in MODES)}


def run_preemption(ns: argparse.Namespace) -> int:
    """Run the bench; print the report; JSON with --out."""
    if ns.model is None:
        from minivllm.default_model import default_model_path

        ns.model = default_model_path()
    held, _ = evaluation_data(ns.model)
    with tempfile.TemporaryDirectory() as tmp:
        swap_dir = ns.swap_dir or tmp
        result = {"model": ns.model, "dtype": ns.dtype, "kv_cache_memory": ns.kv_cache_memory,
                  "swap_space": ns.swap_space, "max_num_seqs": ns.max_num_seqs, "rounds": ns.rounds,
                  "workloads": {name: _workload(ns, held, shape, swap_dir)
                                for name, shape in _workloads(ns.workloads).items()}}
    print(report(result))
    save(result, ns.out, None)
    return 0


def report(r: dict[str, Any]) -> str:
    """A markdown table per workload, then which mode won where."""
    lines = []
    verdicts = []
    for name, w in r["workloads"].items():
        rows, base = w["rows"], w["rows"]["recompute"]
        shared = f" after a shared {w['shared_prefix']}-token prefix" if w.get("shared_prefix") else ""
        shared += "" if w.get("prefix_caching", True) else " (prefix caching off)"
        lines += [f"**{name}**: {w['requests']} requests of {w['prompt_len']} prompt{shared} + {w['output_len']} "
                  f"output tokens ({w['needed_tokens']} tokens of work) on a pool of {w['pool_tokens']} tokens; greedy "
                  f"outputs of the three modes {'identical' if w['same_outputs'] else 'DIFFER'}.", "",
                  "| mode | output tok/s | vs recompute | preemptions (by swap) | swapped out / in | tokens computed "
                  "beyond the work | prefix-cache hits |", "|---|---|---|---|---|---|---|"]
        for m, x in rows.items():
            extra = x["computed_tokens"] - w["needed_tokens"]
            runs = ", ".join(f"{w['requests'] * w['output_len'] / s:.0f}" for s in x["runs_s"])
            vs = x["output_tok_s"] / base["output_tok_s"]
            lines.append(f"| {m} | {x['output_tok_s']:.0f} (runs {runs}) | **{vs:.2f}x** | "
                         f"{x['preemptions']:.0f} ({x['swap_preemptions']:.0f}) | "
                         f"{x['swap_out_bytes'] / 2**20:.1f} / {x['swap_in_bytes'] / 2**20:.1f} MiB | "
                         f"{extra:.0f} | {x['prefix_hits']:.0f} |")
        lines.append("")
        ratio = rows["swap"]["output_tok_s"] / base["output_tok_s"]
        won = "swap wins" if ratio > 1.05 else "recompute wins" if ratio < 0.95 else "no mode wins beyond 5%"
        sw, au = rows["swap"], rows["auto"]
        if (au["swap_preemptions"], au["swap_out_bytes"]) == (sw["swap_preemptions"], sw["swap_out_bytes"]):
            gap = abs(au["output_tok_s"] / sw["output_tok_s"] - 1)
            auto = (f"auto made swap's choices (the same preemptions and bytes), so the {100 * gap:.0f}% between "
                    "their rows is this run's noise")
        else:
            best = max(sw["output_tok_s"], base["output_tok_s"])
            auto = (f"auto swapped {au['swap_preemptions']:.0f} of {au['preemptions']:.0f} preemptions: "
                    f"{au['output_tok_s'] / best:.2f}x the better of the two")
        redo = base["computed_tokens"] - w["needed_tokens"]
        verdicts.append(f"- {name}: swap {ratio:.2f}x recompute ({won}; recompute redid {redo:.0f} tokens, "
                        f"{100 * redo / w['needed_tokens']:.0f}% of the work); {auto}.")
    verdicts.append("\nA swapped block moves as one copy of its bytes each way, while a recomputed one is a prefill of "
                    "its tokens; so swap pays in proportion to what recompute would redo, and where recompute redoes "
                    "little (a victim finds its own blocks still in the prefix cache when it is readmitted) swapping "
                    "buys nothing measurable.")
    return "\n".join([*lines, *verdicts])
