"""`minivllm bench perplexity`: held-out perplexity of the embedded models (or any model trained on the
same corpus), computed by our engine from prompt_logprobs and by HF transformers on the same weights,
against a unigram baseline on the same held-out tokens.

The held-out text is the standard library files that tools/train_tiny.py held out. For the embedded
tokenizer its tokens (and the training unigram counts) ship in held_out.safetensors; another model's
tokenizer re-encodes the local standard library's split. The stream is cut into windows of seq_len + 1
tokens overlapping by one, as in training's evaluation, so the figures are comparable to the model
card's.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import numpy as np
import torch

from minivllm.bench.results import save
from minivllm.default_model import default_draft_model_path, default_model_path, held_out_path
from minivllm.default_model.corpus import (
    encode_stream,
    load_held_out,
    read_texts,
    split_files,
    unigram_counts,
    unigram_perplexity,
    windows,
)


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


def evaluation_data(model_dir: str, max_tokens: int | None = None) -> tuple[np.ndarray, float]:
    """(held-out token ids, unigram perplexity on them) for the model's tokenizer: the shipped ones for
    the embedded tokenizer, else rebuilt from the local standard library with the model's tokenizer."""
    tok = load_tokenizer(model_dir)
    if tok.to_str() == load_tokenizer(default_model_path()).to_str():
        held, counts = load_held_out(held_out_path())
    else:
        train_files, held_files = split_files()
        held = encode_stream(tok, read_texts(held_files))
        counts = unigram_counts(encode_stream(tok, read_texts(train_files)), tok.get_vocab_size())
    held = held[:max_tokens] if max_tokens else held
    return held, unigram_perplexity(counts, held)


def perplexity(token_logprobs: np.ndarray) -> float:
    """exp(mean negative log-likelihood)."""
    return math.exp(-float(np.mean(token_logprobs)))


def engine_token_logprobs(model_dir: str, wins: list[list[int]], **engine_kwargs: Any) -> np.ndarray:
    """log p(token | prefix) for every scored token of the windows, from our engine's prompt_logprobs
    (one request per window; float32 by default, as the HF reference)."""
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    llm = LLM(model_dir, **{"kv_cache_memory": "256MiB", "dtype": "float32", **engine_kwargs})
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in wins], params, use_tqdm=False)
    out: list[float] = []
    for w, o in zip(wins, outs, strict=True):
        if o.prompt_logprobs is None or len(o.prompt_logprobs) != len(w):
            raise ValueError(f"engine returned {len(o.prompt_logprobs or [])} prompt logprobs for {len(w)} tokens")
        out += [entry[tok].logprob for tok, entry in zip(w[1:], o.prompt_logprobs[1:], strict=True)]  # type: ignore[index]
    return np.asarray(out, dtype=np.float64)


def hf_model(model_dir: str) -> torch.nn.Module:
    """HF transformers' model on the same weights, in float32 (our engine's CPU dtype)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_token_logprobs(model: torch.nn.Module, wins: list[list[int]], batch: int = 8) -> np.ndarray:
    """The same log-probabilities from an HF causal LM, in the windows' order (training's evaluation too)."""
    out: list[np.ndarray] = []
    i = 0
    while i < len(wins):
        # Consecutive windows of one length batch together; only the stream's last may be shorter.
        j = i
        while j < len(wins) and j - i < batch and len(wins[j]) == len(wins[i]):
            j += 1
        x = torch.tensor(wins[i:j])
        logp = torch.log_softmax(model(input_ids=x[:, :-1]).logits.float(), dim=-1)
        out.append(logp.gather(-1, x[:, 1:, None]).squeeze(-1).flatten().double().numpy())
        i = j
    return np.concatenate(out)


def run_perplexity(ns: argparse.Namespace) -> int:
    """`minivllm bench perplexity`."""
    models = ns.model or [default_model_path(), default_draft_model_path()]
    rows: list[dict[str, Any]] = []
    for path in models:
        held, unigram = evaluation_data(path, ns.max_tokens)
        wins = windows(held, ns.seq_len)
        ours = engine_token_logprobs(path, wins)
        row = {"model": os.path.basename(os.path.normpath(path)), "tokens": len(ours), "unigram": unigram,
               "engine": perplexity(ours)}
        if not ns.no_hf:
            ref = hf_token_logprobs(hf_model(path), wins)
            hf = perplexity(ref)
            row |= {"hf": hf, "rel_diff": abs(row["engine"] - hf) / hf,
                    "max_logprob_diff": float(np.abs(ours - ref).max())}
        rows.append(row)
    result = {"seq_len": ns.seq_len, "rows": rows}
    print(report(result))
    save(result, ns.out, plot)
    return 0


def report(result: dict[str, Any]) -> str:
    """The markdown table."""
    lines = ["| model | scored tokens | unigram baseline | engine (prompt_logprobs) | HF transformers | "
             "relative difference | largest per-token logprob difference |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        hf = f"{r['hf']:.3f} | {r['rel_diff']:.1e} | {r['max_logprob_diff']:.1e}" if "hf" in r else "- | - | -"
        lines.append(f"| {r['model']} | {r['tokens']:,} | {r['unigram']:.1f} | **{r['engine']:.3f}** | {hf} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], png: str) -> None:
    """Bars: each model's held-out perplexity by our engine next to the unigram baseline (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    unigrams = sorted({round(r["unigram"], 6) for r in rows}, reverse=True)  # one per tokenizer
    labels = [f"unigram{'' if len(unigrams) == 1 else f' {i + 1}'}" for i in range(len(unigrams))]
    labels += [r["model"] for r in rows]
    values = unigrams + [r["engine"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color=["grey"] * len(unigrams) + ["C0"] * len(rows))
    ax.set_yscale("log")
    ax.set_ylim(1, max(values) * 2)  # from perplexity 1 (a perfect model), so bar heights compare honestly
    ax.set_ylabel("held-out perplexity (log)")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
