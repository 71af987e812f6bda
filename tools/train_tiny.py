"""Train the embedded default model (a small Llama) and its draft model on CPU, offline, reproducibly.

The data is what every machine with this Python has: the standard library's sources (code, comments
and docstrings). Files are split into train and held-out by a hash of their path, so the split is the
same on every run. A byte-level BPE tokenizer (8k vocabulary, ChatML specials) is trained on the
training split only; both models share it. Training uses HF transformers' LlamaForCausalLM and plain
torch (AdamW, cosine schedule, fixed seed), each model within a time budget, with a progress bar and
a JSON-lines loss log. The result is two HF-format directories with bf16 safetensors, and a
metrics.json with the held-out perplexities (and a unigram baseline on the same held-out tokens).

    python tools/train_tiny.py --out build/default-model            # about an hour on 2 cores
    python tools/train_tiny.py --out /tmp/smoke --main-minutes 0.5 --draft-minutes 0.2 --eval-tokens 4096
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ~12.6M parameters (tied embeddings) and ~1.4M for the draft: small enough to train in an hour here.
MAIN = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=1024)
DRAFT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=384)


def stdlib_files() -> list[str]:
    """Every .py file of the standard library (not site-packages), sorted for a stable order."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "idlelib"))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return sorted(out)


def is_held_out(path: str, root: str, every: int) -> bool:
    """1 file in `every`, chosen by a hash of its path under the stdlib root (stable across runs)."""
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % every == 0


def read_texts(files: list[str]) -> list[str]:
    texts = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                texts.append(fh.read())
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8
    return texts


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_all(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """One stream: each file's tokens followed by <|endoftext|>."""
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids
        ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


def llama_config(shape: dict[str, int], vocab: int, max_len: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, max_position_embeddings=max_len, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, **shape)


def train(model: torch.nn.Module, data: np.ndarray, minutes: float, seq_len: int, batch: int, lr: float,
          seed: int, log_path: str, name: str) -> dict[str, Any]:
    """AdamW with warm-up and cosine decay over a time budget (the schedule follows elapsed time, so
    the run ends on time on any machine); logs the loss every 10 steps."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = minutes * 60
    t0 = time.time()
    step = tokens = 0
    model.train()
    bar = tqdm(total=int(budget), desc=f"train {name}", unit="s")
    with open(log_path, "a") as log:
        while (elapsed := time.time() - t0) < budget:
            frac = elapsed / budget
            cur = lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = cur
            starts = rng.integers(0, len(data) - seq_len - 1, batch)
            x = torch.from_numpy(np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int64))
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # HF shifts the labels itself
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens += batch * seq_len
            if step % 10 == 0:
                log.write(json.dumps({"model": name, "step": step, "tokens": tokens, "loss": loss.item(),
                                      "lr": cur, "elapsed_s": time.time() - t0}) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{loss.item():.3f}", step=step)
            bar.n = min(int(time.time() - t0), int(budget))
            bar.refresh()
    bar.close()
    model.eval()
    return {"steps": step, "tokens": tokens, "minutes": (time.time() - t0) / 60, "final_loss": loss.item()}


@torch.inference_mode()
def perplexity(model: torch.nn.Module, data: np.ndarray, seq_len: int, max_tokens: int) -> float:
    """exp(mean next-token NLL) over consecutive windows of the held-out stream."""
    nll, count = 0.0, 0
    for s in range(0, min(len(data), max_tokens) - 1, seq_len):
        x = torch.from_numpy(data[s:s + seq_len + 1].astype(np.int64))[None]
        if x.shape[1] < 2:
            break
        logits = model(input_ids=x[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    return math.exp(nll / count)


def unigram_perplexity(train_ids: np.ndarray, held: np.ndarray, vocab: int, max_tokens: int) -> float:
    """The baseline: each token's training frequency (add-one smoothed), context ignored."""
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    h = held[:max_tokens][1:]
    return float(math.exp(-logp[h].mean()))


def save(model: Any, tok: Tokenizer, out: str, max_len: int, card: dict[str, Any]) -> None:
    os.makedirs(out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    tok.save(os.path.join(out, "tokenizer.json"))
    eot = "<|endoftext|>"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": eot,
                   "model_max_length": max_len, "clean_up_tokenization_spaces": False,
                   "chat_template": CHATML_TEMPLATE}, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": [0, tok.token_to_id("<|im_end|>")]}, f, indent=2)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(card, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="writes OUT/main, OUT/draft, OUT/metrics.json, OUT/train_log.jsonl")
    p.add_argument("--main-minutes", type=float, default=50.0)
    p.add_argument("--draft-minutes", type=float, default=8.0)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--held-out-every", type=int, default=50, help="1 file in N is held out")
    p.add_argument("--eval-tokens", type=int, default=200_000, help="held-out tokens scored at the end")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cards-only", action="store_true", help="only (re)write the model cards from OUT/metrics.json")
    ns = p.parse_args()
    if ns.cards_only:
        with open(os.path.join(ns.out, "metrics.json")) as f:
            write_model_cards(ns.out, json.load(f), " ".join(a for a in sys.argv[1:] if a != "--cards-only"))
        return

    from transformers import LlamaForCausalLM

    torch.manual_seed(ns.seed)
    random.seed(ns.seed)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    os.makedirs(ns.out, exist_ok=True)
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files()
    held_files = [f for f in files if is_held_out(f, root, ns.held_out_every)]
    train_files = [f for f in files if not is_held_out(f, root, ns.held_out_every)]
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    print(f"{len(train_texts)} training files, {len(held_texts)} held out")
    tok = train_tokenizer(train_texts, ns.vocab)
    train_ids, held_ids = encode_all(tok, train_texts), encode_all(tok, held_texts)
    print(f"{len(train_ids):,} training tokens, {len(held_ids):,} held-out tokens")
    log_path = os.path.join(ns.out, "train_log.jsonl")
    open(log_path, "w").close()
    max_len = 1024
    metrics: dict[str, Any] = {
        "python": sysconfig.get_python_version(), "data": "CPython standard library sources (Python-2.0 license)",
        "train_files": len(train_texts), "held_out_files": len(held_texts), "train_tokens": int(len(train_ids)),
        "held_out_tokens": int(len(held_ids)), "vocab": ns.vocab, "seed": ns.seed,
        "unigram_ppl": unigram_perplexity(train_ids, held_ids, ns.vocab, ns.eval_tokens),
    }
    for name, shape, minutes in (("main", MAIN, ns.main_minutes), ("draft", DRAFT, ns.draft_minutes)):
        torch.manual_seed(ns.seed)
        model = LlamaForCausalLM(llama_config(shape, ns.vocab, max_len))
        n_params = sum(t.numel() for t in model.parameters())
        print(f"{name}: {n_params / 1e6:.1f}M parameters")
        stats = train(model, train_ids, minutes, ns.seq_len, ns.batch, ns.lr, ns.seed, log_path, name)
        # Scored on the bf16 weights that ship, cast back to float32 (what the engine runs on CPU).
        model.to(torch.bfloat16).float()
        ppl = perplexity(model, held_ids, ns.seq_len, ns.eval_tokens)
        metrics[name] = {"parameters": n_params, **shape, **stats, "held_out_ppl": ppl}
        print(f"{name}: held-out perplexity {ppl:.2f} (unigram {metrics['unigram_ppl']:.1f})")
        save(model, tok, os.path.join(ns.out, name), max_len, {**metrics[name], "data": metrics["data"]})
    with open(os.path.join(ns.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    write_model_cards(ns.out, metrics, " ".join(sys.argv[1:]))


def write_model_cards(out: str, m: dict[str, Any], args: str) -> None:
    """README.md (the model card) in both model directories, from the run's metrics."""
    rows = "\n".join(
        f"| {name} | {m[name]['parameters'] / 1e6:.1f}M | {m[name]['hidden_size']} | {m[name]['num_hidden_layers']} | "
        f"{m[name]['num_attention_heads']}/{m[name]['num_key_value_heads']} | {m[name]['tokens'] / 1e6:.1f}M | "
        f"{m[name]['minutes']:.0f} min | {m[name]['final_loss']:.2f} | **{m[name]['held_out_ppl']:.2f}** |"
        for name in ("main", "draft") if name in m)
    card = f"""# Mini-vLLM's embedded default model

Small Llama-architecture language models of Python source, trained from scratch on CPU by
`tools/train_tiny.py` (kept in the Mini-vLLM repository; fixed seed {m['seed']}), so that Mini-vLLM
answers with recognisable text on a machine with no network. `draft` shares `main`'s tokenizer and
serves as its speculative-decoding draft. Not a general assistant: it continues Python code.

| model | parameters | hidden | layers | heads (q/kv) | tokens seen | training time | final loss | held-out perplexity |
|---|---|---|---|---|---|---|---|---|
{rows}

Unigram baseline on the same held-out tokens (training-set token frequencies, add-one smoothing):
perplexity **{m['unigram_ppl']:.1f}**.

- **Data**: {m['data']}: the `.py` files of CPython {m['python']}'s standard library as installed with
  the interpreter ({m['train_files']} files for training, {m['train_tokens'] / 1e6:.1f}M tokens). 1 file in 50,
  chosen by a hash of its path, is held out ({m['held_out_files']} files, {m['held_out_tokens'] / 1e3:.0f}k tokens).
  The Python Software Foundation License applies to the source text; these weights are derived from it.
- **Tokenizer**: byte-level BPE, {m['vocab']} entries, trained on the training split; specials
  `<|endoftext|>` (BOS/EOS, between files), `<|im_start|>`, `<|im_end|>`; a ChatML chat template.
- **Architecture**: LlamaForCausalLM, RMSNorm, SwiGLU, RoPE (theta 10000), grouped-query attention,
  tied input/output embeddings, 1024 positions; weights stored in bfloat16.
- **Training**: AdamW (betas 0.9/0.95, weight decay 0.1), peak learning rate with 100 warm-up steps and
  cosine decay over a fixed time budget, batches of 16 x 256 tokens, gradient clipping at 1.0, float32
  on CPU. Held-out perplexity is measured on the bfloat16 weights as shipped.
- **Reproduce**: `python tools/train_tiny.py {args}`.
"""
    for name in ("main", "draft"):
        if os.path.isdir(os.path.join(out, name)):
            with open(os.path.join(out, name, "README.md"), "w") as f:
                f.write(card)


if __name__ == "__main__":
    main()
