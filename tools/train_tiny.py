"""Train the embedded default model (a small Llama) and its draft model on CPU, offline, reproducibly.

The data is what every machine with this Python has: the standard library's sources (code, comments
and docstrings), less its test suites and code-page tables. Files are split into train and held-out
by a hash of their path, so the split is the same on every run. A byte-level BPE tokenizer (8k
vocabulary, ChatML specials) is trained on the training split only; both models share it. Training
uses HF transformers' LlamaForCausalLM and plain torch (AdamW, cosine schedule, fixed seed, a fixed
number of steps), with a progress bar and a JSON-lines loss log. The result is two HF-format
directories with bf16 safetensors; metrics.json with the held-out perplexities, a unigram baseline on
the same held-out tokens and the software it ran on; and held_out.safetensors, the held-out tokens and
training unigram counts, so evaluations need not rebuild them from the local standard library.

    python tools/train_tiny.py --out minivllm/default_model --threads 2   # the shipped model; ~1 hour on 2 cores
    python tools/train_tiny.py --out /tmp/smoke --main-steps 10 --draft-steps 10 --eval-tokens 4096
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the distillation stage beside this script
from distill_draft import add_args as add_distill_args  # noqa: E402
from distill_draft import record as record_distillation  # noqa: E402
from distill_draft import run_stage as distill_stage  # noqa: E402

from minivllm.bench.perplexity import hf_token_logprobs, perplexity
from minivllm.default_model import DRAFT_NAME, MAIN_NAME
from minivllm.default_model.corpus import (
    HELD_OUT_EVERY,
    encode_stream,
    read_texts,
    relative_path,
    save_held_out,
    split_files,
    unigram_counts,
    unigram_perplexity,
    windows,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (  # renders tools and tool calls in the Hermes style (the hermes tool-call parser reads them)
    "{%- if tools %}{{ '<|im_start|>system\n' }}{%- if messages[0]['role'] == 'system' %}{{ mess"
    "ages[0]['content'] + '\n\n' }}{%- endif %}{{ '# Tools\n\nYou may call one or more functions to"
    ' assist with the user query.\n\nYou are provided with function signatures within <tools></to'
    "ols> XML tags:\n<tools>' }}{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and argumen"
    'ts within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "argumen'
    'ts": <args-json-object>}\n</tool_call><|im_end|>\n\' }}{%- endif %}{%- for message in message'
    "s %}{%- if tools and loop.first and message['role'] == 'system' %}{%- elif message['role']"
    " == 'assistant' and message.get('tool_calls') %}{{ '<|im_start|>assistant\n' + (message['co"
    "ntent'] + '\n' if message['content'] else '') }}{%- for call in message['tool_calls'] %}{{ "
    '\'<tool_call>\n{"name": "\' + call[\'function\'][\'name\'] + \'", "arguments": \' + (call[\'function'
    "']['arguments'] | tojson) + '}\n</tool_call>' }}{%- if not loop.last %}{{ '\n' }}{%- endif %"
    "}{%- endfor %}{{ '<|im_end|>\n' }}{%- elif message['role'] == 'tool' %}{{ '<|im_start|>user"
    "\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}{%- else %}{{ '"
    "<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{%- endi"
    "f %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

# ~12.6M parameters (tied embeddings) and ~1.4M for the draft: small enough to train in an hour here.
MAIN = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=1024)
DRAFT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=384)
DIRS = {"main": MAIN_NAME, "draft": DRAFT_NAME}  # metrics.json's keys → shipped directory names


def train_tokenizer(texts: list[str], vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def llama_config(shape: dict[str, int], vocab: int, max_len: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, max_position_embeddings=max_len, rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, **shape)


def train(model: torch.nn.Module, data: np.ndarray, steps: int, seq_len: int, batch: int, lr: float,
          seed: int, log_path: str, name: str) -> dict[str, Any]:
    """AdamW with 100 warm-up steps and cosine decay to 10% over `steps`; logs the loss every 10 steps.
    A step count, not a time budget: with the same seed, thread count and software a rerun gives the
    same model (float reductions differ across thread counts and CPUs)."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0 = time.time()
    tokens = 0
    model.train()
    bar = tqdm(total=steps, desc=f"train {name}", unit="step")
    with open(log_path, "a") as log:
        for step in range(1, steps + 1):
            frac = (step - 1) / steps
            cur = lr * min(1.0, step / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = cur
            starts = rng.integers(0, len(data) - seq_len - 1, batch)
            x = torch.from_numpy(np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int64))
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # HF shifts the labels itself
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tokens += batch * seq_len
            if step % 10 == 0:
                log.write(json.dumps({"model": name, "step": step, "tokens": tokens, "loss": loss.item(),
                                      "lr": cur, "elapsed_s": time.time() - t0}) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
    bar.close()
    model.eval()
    return {"steps": steps, "tokens": tokens, "minutes": (time.time() - t0) / 60, "final_loss": loss.item()}


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
    p.add_argument("--out", required=True,
                   help=f"writes OUT/{MAIN_NAME}, OUT/{DRAFT_NAME}, OUT/metrics.json, OUT/train_log.jsonl "
                   "(minivllm/default_model: the shipped files)")
    # ~2.4 s and ~0.3 s a step on 2 cores: about 50 and 7 minutes.
    p.add_argument("--main-steps", type=int, default=1200)
    p.add_argument("--draft-steps", type=int, default=1400)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--held-out-every", type=int, default=HELD_OUT_EVERY, help="1 file in N is held out")
    p.add_argument("--eval-tokens", type=int, default=200_000, help="held-out tokens scored at the end")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cards-only", action="store_true", help="only (re)write the model cards from OUT/metrics.json")
    add_distill_args(p)
    ns = p.parse_args()
    if ns.cards_only:
        with open(os.path.join(ns.out, "metrics.json")) as f:
            write_model_cards(ns.out, json.load(f), " ".join(a for a in sys.argv[1:] if a != "--cards-only"))
        return

    import tokenizers
    import transformers
    from transformers import LlamaForCausalLM

    torch.manual_seed(ns.seed)
    random.seed(ns.seed)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    os.makedirs(ns.out, exist_ok=True)
    train_files, held_files = split_files(ns.held_out_every)
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    print(f"{len(train_texts)} training files, {len(held_texts)} held out")
    tok = train_tokenizer(train_texts, ns.vocab)
    train_ids, held_ids = encode_stream(tok, train_texts), encode_stream(tok, held_texts)
    print(f"{len(train_ids):,} training tokens, {len(held_ids):,} held-out tokens")
    held_tokens = len(held_ids)
    held_ids, counts = held_ids[:ns.eval_tokens], unigram_counts(train_ids, ns.vocab)
    log_path = os.path.join(ns.out, "train_log.jsonl")
    open(log_path, "w").close()
    max_len = 1024
    metrics: dict[str, Any] = {
        "python": sysconfig.get_python_version(), "data": "CPython standard library sources (Python-2.0 license)",
        "train_files": len(train_texts), "held_out_files": len(held_texts), "train_tokens": int(len(train_ids)),
        "held_out_tokens": held_tokens, "vocab": ns.vocab, "seed": ns.seed,
        "held_out_every": ns.held_out_every, "lr": ns.lr, "batch": ns.batch, "seq_len": ns.seq_len,
        "unigram_ppl": unigram_perplexity(counts, held_ids), "eval_tokens": int(len(held_ids)),
        # Which files were held out, so an evaluation can check the local stdlib gives the same text.
        "held_out": [relative_path(f) for f in held_files],
        "software": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "threads": torch.get_num_threads()},
    }
    save_held_out(os.path.join(ns.out, "held_out.safetensors"), held_ids, counts)
    target = None
    for name, shape, steps in (("main", MAIN, ns.main_steps), ("draft", DRAFT, ns.draft_steps)):
        torch.manual_seed(ns.seed)
        model = LlamaForCausalLM(llama_config(shape, ns.vocab, max_len))
        n_params = sum(t.numel() for t in model.parameters())
        print(f"{name}: {n_params / 1e6:.1f}M parameters")
        stats = train(model, train_ids, steps, ns.seq_len, ns.batch, ns.lr, ns.seed, log_path, name)
        # Scored on the bf16 weights that ship, cast back to float32 (what the engine runs on CPU).
        model.to(torch.bfloat16).float()
        ppl = perplexity(hf_token_logprobs(model, windows(held_ids, ns.seq_len)))
        metrics[name] = {"parameters": n_params, **shape, **stats, "held_out_ppl": ppl}
        if name == "main":
            target = model
        elif ns.distill_steps and target is not None:
            # The draft then learns the target's distribution (tools/distill_draft.py): what speculation pays for.
            stage = distill_stage(os.path.join(ns.out, DIRS["main"]), target, model, train_ids, held_ids, ns,
                                  log_path)
            ppl = record_distillation(metrics[name], stage, model, held_ids, ns.seq_len)
        print(f"{name}: held-out perplexity {ppl:.2f} (unigram {metrics['unigram_ppl']:.1f})")
        save(model, tok, os.path.join(ns.out, DIRS[name]), max_len, {**metrics[name], "data": metrics["data"]})
    with open(os.path.join(ns.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
    write_model_cards(ns.out, metrics, " ".join(sys.argv[1:]))


def write_model_cards(out: str, m: dict[str, Any], args: str) -> None:
    """README.md (the model card) in both model directories, from the run's metrics."""
    rows = "\n".join(
        f"| {DIRS[name]} | {m[name]['parameters'] / 1e6:.1f}M | {m[name]['hidden_size']} | "
        f"{m[name]['num_hidden_layers']} | {m[name]['num_attention_heads']}/{m[name]['num_key_value_heads']} | "
        f"{m[name]['tokens'] / 1e6:.1f}M | "
        f"{m[name]['minutes']:.0f} min | {m[name]['final_loss']:.2f} | **{m[name]['held_out_ppl']:.2f}** |"
        for name in ("main", "draft") if name in m)
    distilled = ""
    if "distill" in m.get("draft", {}):
        d = m["draft"]["distill"]
        b, a = d["agreement_before"], d["agreement_after"]
        distilled = (f"- **Draft distillation** (tools/distill_draft.py): {d['steps']} further steps of the draft on "
                     f"KL from the main model's distribution ({d['tokens'] / 1e6:.1f}M tokens, half training-split "
                     f"windows, half the main model's greedy continuations of {d['continuations']} training-split "
                     f"prefixes), peak learning rate {d['lr']:g}. On the main model's greedy continuations of "
                     f"held-out prefixes the draft's next guess is the main model's {b['next_1']:.0%} -> "
                     f"**{a['next_1']:.0%}** of the time, its next four all are {b['next_4']:.0%} -> "
                     f"**{a['next_4']:.0%}**; held-out perplexity {m['draft']['held_out_ppl_before_distill']:.2f} "
                     f"before it.\n")
    card = f"""# Mini-vLLM's embedded default model

Small Llama-architecture language models of Python source, trained from scratch on CPU by
`tools/train_tiny.py` (kept in the Mini-vLLM repository; fixed seed {m['seed']}), so that Mini-vLLM
answers with recognisable text on a machine with no network. `{DRAFT_NAME}` shares `{MAIN_NAME}`'s
tokenizer and serves as its speculative-decoding draft. Not a general assistant: it continues Python code.

| model | parameters | hidden | layers | heads (q/kv) | tokens seen | training time | final loss | held-out perplexity |
|---|---|---|---|---|---|---|---|---|
{rows}

Unigram baseline on the same held-out tokens (training-set token frequencies, add-one smoothing):
perplexity **{m['unigram_ppl']:.1f}**.

- **Data**: {m['data']}: the `.py` files of CPython {m['python']}'s standard library as installed with
  the interpreter, less its test suites and code-page tables ({m['train_files']} files for training,
  {m['train_tokens'] / 1e6:.1f}M tokens). 1 file in {m['held_out_every']}, chosen by a hash of its path, is held out
  ({m['held_out_files']} files, {m['held_out_tokens'] / 1e3:.0f}k tokens).
  The Python Software Foundation License applies to the source text; these weights are derived from it.
- **Tokenizer**: byte-level BPE, {m['vocab']} entries, trained on the training split; specials
  `<|endoftext|>` (BOS/EOS, between files), `<|im_start|>`, `<|im_end|>`; a ChatML chat template.
- **Architecture**: LlamaForCausalLM, RMSNorm, SwiGLU, RoPE (theta 10000), grouped-query attention,
  tied input/output embeddings, 1024 positions; weights stored in bfloat16.
- **Training**: AdamW (betas 0.9/0.95, weight decay 0.1), peak learning rate {m['lr']:g} with 100 warm-up
  steps and cosine decay over a fixed number of steps, batches of {m['batch']} x {m['seq_len']} tokens, gradient
  clipping at 1.0, float32 on CPU. Held-out perplexity is measured on the bfloat16 weights as shipped.
{distilled}- **Reproduce**: `python tools/train_tiny.py {args}`.
"""
    for name in DIRS.values():
        if os.path.isdir(os.path.join(out, name)):
            with open(os.path.join(out, name, "README.md"), "w") as f:
                f.write(card)


if __name__ == "__main__":
    main()
