"""`minivllm bench perplexity`: held-out perplexity of the embedded models (or any model trained on the
same corpus), computed by our engine from prompt_logprobs and by HF transformers on the same weights,
against a unigram baseline on the same held-out tokens.

The held-out text is the standard library files that tools/train_tiny.py held out (the split is a
hash of each path, so it is rebuilt here, not shipped). The stream is cut into windows of seq_len + 1
tokens overlapping by one, as in training's evaluation, so the figures are comparable to the model
card's.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from typing import Any

import numpy as np
import torch

from minivllm.bench.results import save
from minivllm.default_model import default_draft_model_path, default_model_path
from minivllm.default_model.corpus import encode_stream, read_texts, split_files, unigram_perplexity, windows


def add_perplexity_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench perplexity`."""
    p.add_argument("--model", action="append", default=None,
                   help="a model directory (repeat for several; default: the embedded model and its draft)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens scored per window")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N held-out tokens")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers reference")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG plot next to it)")


def load_tokenizer(model_dir: str) -> Any:
    """The model's `tokenizers.Tokenizer` (tokenizer.json)."""
    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: no tokenizer.json in {model_dir!r}")
    return Tokenizer.from_file(path)


def held_out_ids(tokenizer: Any, max_tokens: int | None = None) -> np.ndarray:
    """The held-out files as one token stream."""
    _, held = split_files()
    ids = encode_stream(tokenizer, read_texts(held))
    return ids[:max_tokens] if max_tokens else ids


def nll_sum(wins: list[list[int]], prompt_logprobs: list[list[dict[int, Any] | None]]) -> tuple[float, int]:
    """(sum of -log p(token | prefix), tokens scored) from each window's prompt_logprobs."""
    nll, count = 0.0, 0
    for w, plp in zip(wins, prompt_logprobs, strict=True):
        for tok, entry in zip(w[1:], plp[1:], strict=True):
            assert entry is not None
            nll -= entry[tok].logprob
            count += 1
    return nll, count


def engine_perplexity(model_dir: str, wins: list[list[int]], **engine_kwargs: Any) -> float:
    """exp(mean NLL) of the windows, scored by our engine's prompt_logprobs (one request per window)."""
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    llm = LLM(model_dir, **{"kv_cache_memory": "256MiB", **engine_kwargs})
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in wins], params, use_tqdm=False)
    nll, count = nll_sum(wins, [o.prompt_logprobs for o in outs])
    return math.exp(nll / count)


def hf_perplexity(model_dir: str, wins: list[list[int]]) -> float:
    """The same figure from HF transformers' model on the same weights (float32, as our engine on CPU)."""
    from transformers import AutoModelForCausalLM

    return model_perplexity(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), wins)


@torch.inference_mode()
def model_perplexity(model: torch.nn.Module, wins: list[list[int]], batch: int = 8) -> float:
    """exp(mean NLL) of the windows under an HF causal LM (training's evaluation uses it too)."""
    nll, count = 0.0, 0
    for i in range(0, len(wins), batch):
        group = wins[i:i + batch]
        # Windows of one length batch together; the stream's last window may be shorter.
        for length in sorted({len(w) for w in group}):
            x = torch.tensor([w for w in group if len(w) == length])
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
            count += x[:, 1:].numel()
    return math.exp(nll / count)


def run_perplexity(ns: argparse.Namespace) -> int:
    """`minivllm bench perplexity`."""
    models = ns.model or [default_model_path(), default_draft_model_path()]
    train_files, _ = split_files()
    rows: list[dict[str, Any]] = []
    baselines: dict[str, float] = {}
    for path in models:
        tok = load_tokenizer(path)
        held = held_out_ids(tok, ns.max_tokens)
        key = hashlib.sha256(tok.to_str().encode()).hexdigest()
        if key not in baselines:  # one unigram baseline per tokenizer (the embedded pair share one)
            baselines[key] = unigram_perplexity(encode_stream(tok, read_texts(train_files)), held, tok.get_vocab_size())
        wins = windows(held, ns.seq_len)
        row = {"model": os.path.basename(os.path.normpath(path)), "tokens": int(len(held) - 1),
               "unigram": baselines[key], "engine": engine_perplexity(path, wins)}
        if not ns.no_hf:
            row["hf"] = hf_perplexity(path, wins)
            row["rel_diff"] = abs(row["engine"] - row["hf"]) / row["hf"]
        rows.append(row)
    result = {"seq_len": ns.seq_len, "rows": rows}
    print(report(result))
    save(result, ns.out, plot)
    return 0


def report(result: dict[str, Any]) -> str:
    """The markdown table."""
    lines = ["| model | held-out tokens | unigram baseline | engine (prompt_logprobs) | HF transformers | "
             "relative difference |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        hf = f"{r['hf']:.3f} | {r['rel_diff']:.1e}" if "hf" in r else "- | -"
        lines.append(f"| {r['model']} | {r['tokens']:,} | {r['unigram']:.1f} | **{r['engine']:.3f}** | {hf} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: str) -> None:
    """Bars: each model's held-out perplexity by our engine next to the unigram baseline (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = ["unigram"] + [r["model"] for r in rows]
    values = [rows[0]["unigram"]] + [r["engine"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color=["grey"] + ["C0"] * len(rows))
    ax.set_yscale("log")
    ax.set_ylim(1, max(values) * 2)  # from perplexity 1 (a perfect model), so bar heights compare honestly
    ax.set_ylabel("held-out perplexity (log)")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
