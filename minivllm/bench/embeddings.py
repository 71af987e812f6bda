"""`minivllm bench embeddings`: embedding throughput (sequences/s) of `--runner pooling` against HF transformers'
forward on the same checkpoint: one sequence at a time, and batches of 16 and 64.

Both sides pool the same way (the last token's final hidden state, L2-normalized: Qwen3-Embedding's recipe) from
the same token ids. HF runs each batch as one padded forward (left padding, an attention mask: how sentence-
transformers and HF's own examples batch); we hand the batch to the engine (LLM.embed), whose scheduler packs the
prompts without padding into steps of the token budget. Each point is measured in ABBA rounds on one process (the
medians reported), and the two sides' vectors are compared (max |difference|)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from minivllm.bench.results import save
from minivllm.bench.throughput import random_prompts, resolve_model
from minivllm.config import cpu_count

BATCHES = (1, 16, 64)


def add_embeddings_args(p: argparse.ArgumentParser) -> None:
    """Flags of `minivllm bench embeddings`."""
    p.add_argument("--model", default=None, help="model directory (default: make --preset in a cache dir)")
    p.add_argument("--preset", default="qwen3-0.6b", help="preset to make when --model is not given (Qwen3-0.6B "
                                                           "is Qwen3-Embedding-0.6B's shape)")
    p.add_argument("--min-len", type=int, default=16, help="shortest input, tokens")
    p.add_argument("--max-len", type=int, default=64, help="longest input, tokens")
    p.add_argument("--single", type=int, default=8, help="sequences embedded one at a time for the batch-1 point")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds per point (medians reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--out", default=None, help="write the results as JSON here (and a PNG plot next to it)")


class HFEmbedder:
    """HF transformers' AutoModel forward, last-token pooled and normalized, one padded batch per call."""

    def __init__(self, path: str, pad_id: int) -> None:
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        self.pad_id = pad_id

    @torch.inference_mode()
    def __call__(self, batch: list[list[int]]) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
        return torch.nn.functional.normalize(hidden.float(), dim=-1)


def _timed(fn: Any, batches: list[list[list[int]]]) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    vectors = [fn(b) for b in batches]
    return time.perf_counter() - t0, torch.cat(vectors)


def run_embeddings(ns: argparse.Namespace) -> int:
    """`minivllm bench embeddings`."""
    from minivllm import LLM

    threads = ns.threads or cpu_count()
    torch.set_num_threads(threads)
    path = resolve_model(ns.model, ns.preset)
    llm = LLM(path, runner="pooling", pooler_config={"pooling_type": "LAST", "normalize": True}, num_threads=threads,
              kv_cache_memory="1GiB")
    vocab = llm.llm_engine.model_config.vocab_size
    hf = HFEmbedder(path, pad_id=0)

    def ours(batch: list[list[int]]) -> torch.Tensor:
        outs = llm.embed([{"prompt_token_ids": p} for p in batch], use_tqdm=False)
        return torch.tensor([o.outputs.embedding for o in outs])

    ours(random_prompts(2, 8, 8, vocab, seed=1))  # warm-up: kernel plans, first allocations
    hf(random_prompts(2, 8, 8, vocab, seed=1))
    rows = []
    for b in BATCHES:
        n = ns.single if b == 1 else b
        prompts = random_prompts(n, ns.min_len, ns.max_len, vocab, seed=b)
        batches = [prompts[i:i + b] for i in range(0, n, b)]
        times: dict[str, list[float]] = {"ours": [], "hf": []}
        vecs: dict[str, torch.Tensor] = {}
        for r in range(ns.rounds):
            for side in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
                seconds, vecs[side] = _timed(ours if side == "ours" else hf, batches)
                times[side].append(seconds)
        row = {"batch": b, "sequences": n, "tokens": sum(map(len, prompts)),
               "ours_seq_per_s": n / statistics.median(times["ours"]),
               "hf_seq_per_s": n / statistics.median(times["hf"]),
               "max_abs_diff": float((vecs["ours"] - vecs["hf"]).abs().max())}
        row["ratio"] = row["ours_seq_per_s"] / row["hf_seq_per_s"]
        rows.append(row)
        print(f"batch {b:3d}: ours {row['ours_seq_per_s']:7.2f} seq/s, HF {row['hf_seq_per_s']:7.2f} seq/s "
              f"({row['ratio']:.2f}x), max |diff| {row['max_abs_diff']:.1e}", flush=True)
    command = ["embeddings", *(["--model", ns.model] if ns.model else ["--preset", ns.preset]), "--min-len",
               str(ns.min_len), "--max-len", str(ns.max_len), "--rounds", str(ns.rounds)]
    result = {"model": path, "preset": None if ns.model else ns.preset, "threads": threads, "rounds": ns.rounds,
              "min_len": ns.min_len, "max_len": ns.max_len, "rows": rows, "command": command}
    print(report(result))
    save(result, ns.out, plot)
    return 0


def report(r: dict[str, Any]) -> str:
    """A markdown table."""
    lines = ["| sequences per call | tokens | ours seq/s | HF transformers seq/s | ours / HF | max abs diff |",
             "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['batch']} | {x['tokens']} | {x['ours_seq_per_s']:.2f} | {x['hf_seq_per_s']:.2f} | "
                     f"**{x['ratio']:.2f}x** | {x['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: str) -> None:
    """Sequences/s of both sides against the batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [str(x["batch"]) for x in r["rows"]]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    width = 0.38
    pos = range(len(xs))
    ax.bar([p - width / 2 for p in pos], [x["ours_seq_per_s"] for x in r["rows"]], width, label="minivllm pooling")
    ax.bar([p + width / 2 for p in pos], [x["hf_seq_per_s"] for x in r["rows"]], width, label="HF transformers")
    ax.set_xticks(list(pos), xs)
    ax.set_xlabel("sequences per call")
    ax.set_ylabel("sequences / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
