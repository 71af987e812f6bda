"""`minivllm bench speculative`: decode speed with and without speculative decoding, in one run.

Tasks: held-out standard-library code (prompts cut from the embedded model's held-out token stream) and
a repetitive one (a code excerpt followed by "the same code again", which the model can copy). For each
of 1 and 8 streams: greedy decode without speculation, then with the n-gram proposer for each k, in
ABBA order across rounds; output tok/s, the ratio to no speculation, and acceptance per position. A
64-sequence run checks that adaptive speculation does not cost throughput when batches are large.
(The draft-model proposer is not there yet; its column will join these.)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from minivllm.bench.results import save
from minivllm.config import EngineArgs, cpu_count
from minivllm.default_model import default_model_path, held_out_path
from minivllm.default_model.corpus import load_held_out
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.sampling_params import RequestOutputKind, SamplingParams


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench speculative`."""
    p.add_argument("--model", default=None, help="target model (default: the embedded one)")
    p.add_argument("--ks", default="1,2,3,4,5,6", help="num_speculative_tokens values to sweep")
    p.add_argument("--streams", default="1,8", help="concurrent requests per measurement")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--large-batch", type=int, default=64, help="sequences of the large-batch check (0: skip)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="write the figures to this JSON file")


def _prompts(engine: LLMEngine, n: int, prompt_len: int, held: Any) -> dict[str, list[list[int]]]:
    # The held-out stream is in the embedded tokenizer's ids: through text for any other model.
    source = get_tokenizer(default_model_path())
    tok = engine.tokenizer
    span = 4 * prompt_len
    step = max((len(held) - span) // n, 1)  # n excerpts spread over the whole held-out stream
    code = [tok.encode(source.decode(held[i * step: i * step + span].tolist()),
                       add_special_tokens=False)[:prompt_len] for i in range(n)]
    again = tok.encode("\n\n# The same code again, unchanged:\n", add_special_tokens=False)
    rep = [c + again + c[:8] for c in code]
    return {"code": code, "repetitive": rep}


def _run(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of greedy decoding of prompts, all at once."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"spec-{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * output_len / (time.perf_counter() - t)


def run_speculative(ns: argparse.Namespace) -> int:
    """Entry point."""
    torch.set_num_threads(cpu_count())
    model = ns.model or default_model_path()
    ks = [int(k) for k in ns.ks.split(",") if k.strip()]
    streams = [int(s) for s in ns.streams.split(",") if s.strip()]
    held, _ = load_held_out(held_out_path())
    engines = {"off": LLMEngine(EngineArgs(model=model, enable_prefix_caching=False))}
    for k in ks:
        engines[f"ngram k={k}"] = LLMEngine(EngineArgs(model=model, enable_prefix_caching=False,
                                                       speculative_model="ngram", num_speculative_tokens=k))
    tasks = _prompts(engines["off"], max(streams + [ns.large_batch]), ns.prompt_len, held)
    for eng in engines.values():  # warm-up: kernel plans and first-call costs out of the timings
        _run(eng, tasks["code"][:2], 8)
    tok_s: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    order = list(engines)
    for rnd in range(ns.rounds):
        for name in order if rnd % 2 == 0 else order[::-1]:
            for task, prompts in tasks.items():
                for s in streams:
                    tok_s[name].setdefault(f"{task}, {s} stream(s)", []).append(
                        _run(engines[name], prompts[:s], ns.output_len))
    if ns.large_batch:
        best = f"ngram k={ks[len(ks) // 2]}"
        for name in ("off", best, best, "off"):
            tok_s[name].setdefault(f"code, {ns.large_batch} sequences", []).append(
                _run(engines[name], tasks["code"][:ns.large_batch], ns.output_len // 2))
    mean = {name: {c: sum(v) / len(v) for c, v in cols.items()} for name, cols in tok_s.items()}
    result: dict[str, Any] = {"model": model, "ks": ks, "streams": streams, "output_len": ns.output_len,
                              "tok_s": tok_s, "mean_tok_s": mean,
                              "ratio": {name: {c: v / mean["off"][c] for c, v in cols.items()}
                                        for name, cols in mean.items()},
                              "acceptance": {}}
    for name, eng in engines.items():
        sp = eng.speculator
        if sp is not None:
            st = sp.stats
            result["acceptance"][name] = {
                "drafts": st.num_drafts, "draft_tokens": st.num_draft_tokens, "accepted": st.num_accepted_tokens,
                "rate": st.num_accepted_tokens / st.num_draft_tokens if st.num_draft_tokens else 0.0,
                "per_position": [a / st.num_drafts if st.num_drafts else 0.0 for a in st.accepted_per_position],
                "proposals_withheld": sp.num_skipped}
    print(report(result))
    save(result, ns.out, None)
    return 0


def report(r: dict[str, Any]) -> str:
    """Markdown: tok/s and ratio per configuration and task, then acceptance per position."""
    cols = list(r["mean_tok_s"]["off"])
    lines = ["| engine | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, vals in r["mean_tok_s"].items():
        cells = [f"{vals[c]:.1f}" + (f" (**{r['ratio'][name][c]:.2f}x**)" if name != "off" else "") if c in vals
                 else "" for c in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| proposer | accepted / proposed | acceptance by position | proposals withheld (adaptive) |",
              "|---|---|---|---|"]
    for name, a in r["acceptance"].items():
        pos = ", ".join(f"{100 * x:.0f}%" for x in a["per_position"])
        lines.append(f"| {name} | {a['accepted']} / {a['draft_tokens']} ({100 * a['rate']:.0f}%) | {pos} | "
                     f"{a['proposals_withheld']} |")
    return "\n".join(lines)


def verdict(r: dict[str, Any]) -> str:
    """The issue's targets, judged from this run (the draft-model target waits for the draft proposer)."""
    ratio = r["ratio"]
    rep = [(v["repetitive, 1 stream(s)"], n) for n, v in ratio.items() if n != "off" and "repetitive, 1 stream(s)" in v]
    big = [(v[c], n) for n, v in ratio.items() for c in v if n != "off" and c.endswith("sequences")]
    eight = [v[c] for n, v in ratio.items() for c in v if n != "off" and "8 stream" in c]
    best, best_name = max(rep) if rep else (0.0, "-")
    met = best >= 1.5 and all(x >= 0.95 for x, _ in big)
    eight_s = f"; 8 streams {min(eight):.2f}-{max(eight):.2f}x" if eight else ""
    lines = [f"Targets (issue 16): >= 1.5x with n-gram on the repetitive task (best here {best:.2f}x, {best_name}, "
             "1 stream); never below 0.95x at the large batch (" + ", ".join(f"{n}: {x:.2f}x" for x, n in big)
             + f"){eight_s}: **{'met' if met else 'not met'}**."]
    if not met:
        lines.append("What bounds it: a step with proposals leaves the one-call native decode stack for the "
                     "module-by-module path, so verification costs more than the weight read it shares, and the "
                     "adaptive cost models still let proposals through where they lose. Verification on the native "
                     "stack is the next step.")
    return " ".join(lines)
