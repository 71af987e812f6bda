"""Grammar engines for guided decoding, measured on our vocabularies: the cost of one token mask per step and of
compiling a grammar, for llguidance, xgrammar and outlines-core (whichever are installed).

The walk: a valid document is tokenized with the model's tokenizer; at each of its tokens the engine computes the
next-token bitmask, then consumes the token, exactly what a guided sequence costs per decode step. Two grammars:
a JSON schema with nested objects, arrays, enums and required fields, and a regex (an ISO date and an e-mail).
Vocabularies: the embedded model's byte-level BPE (8,192) and one trained here on the standard library (32,000),
the size class of Llama-2/Mistral. Single-threaded, one sequence: the per-row cost a step pays per guided row.

    python benchmarks/micro_grammar.py [--out benchmarks/results/micro_grammar.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from minivllm.bench.guided import SCHEMA

# A document valid under SCHEMA (bench guided's: nested objects, arrays, enums, required fields).
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines"],
                  "address": {"city": "London", "zip": "12345"}})
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]) [a-z]{1,12}@[a-z]{1,12}\.(com|org)"
REGEX_DOC = "2024-11-25 ada@example.org"


def tokenizer_json(vocab: int) -> str:
    """tokenizer.json text: the embedded model's (8,192), or a byte-level BPE of `vocab` trained on the stdlib."""
    if vocab == 8192:
        from minivllm.default_model import default_model_path

        with open(os.path.join(default_model_path(), "tokenizer.json")) as f:
            return f.read()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from minivllm.modelgen.make_model import corpus_files

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(corpus_files(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                  show_progress=False))
    return tok.to_str()


def walk(fill: Callable[[int], None], consume: Callable[[int], Any], ids: list[int]) -> list[float]:
    """Seconds per mask over one walk through ids."""
    times = []
    for tid in ids:
        t0 = time.perf_counter()
        fill(tid)
        times.append(time.perf_counter() - t0)
        consume(tid)
    return times


def bench_llguidance(tok_json: str, eos: int, ids: dict[str, list[int]]) -> dict[str, Any]:
    import llguidance
    import llguidance.torch

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok_json, eos_token=eos)
    out: dict[str, Any] = {"tokenizer_s": time.perf_counter() - t0}
    grammars = {"json": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA),
                "regex": llguidance.LLMatcher.grammar_from_regex(REGEX)}
    mask = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
    for kind, grammar in grammars.items():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lt, grammar)
        llguidance.torch.fill_next_token_bitmask(m, mask)
        compile_s = time.perf_counter() - t0
        runs = []
        for _ in range(3):
            m = llguidance.LLMatcher(lt, grammar)
            runs.append(walk(lambda _t, m=m: llguidance.torch.fill_next_token_bitmask(m, mask),
                             m.consume_token, ids[kind]))
            assert not m.is_error(), m.get_error()
        out[kind] = _summary(runs, compile_s)
    return out


def bench_xgrammar(tok_json: str, eos: int, ids: dict[str, list[int]]) -> dict[str, Any]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=_tokenizers(tok_json))
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out: dict[str, Any] = {"tokenizer_s": time.perf_counter() - t0}
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for kind in ("json", "regex"):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA)) if kind == "json" else compiler.compile_regex(REGEX)
        m = xgr.GrammarMatcher(compiled)
        m.fill_next_token_bitmask(mask)
        compile_s = time.perf_counter() - t0
        runs = []
        for _ in range(3):
            m = xgr.GrammarMatcher(compiled)
            runs.append(walk(lambda _t, m=m: m.fill_next_token_bitmask(mask), m.accept_token, ids[kind]))
        out[kind] = _summary(runs, compile_s)
    return out


def bench_outlines_core(tok_json: str, eos: int, ids: dict[str, list[int]]) -> dict[str, Any]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    tok = _tokenizers(tok_json)
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    vocab: dict[bytes, list[int]] = {}
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    for text, tid in tok.get_vocab().items():
        if tid == eos or text in specials:
            continue
        vocab.setdefault(bytes(byte_of[c] for c in text), []).append(tid)
    t0 = time.perf_counter()
    v = Vocabulary(eos, vocab)
    out: dict[str, Any] = {"tokenizer_s": time.perf_counter() - t0}
    mask = torch.zeros((tok.get_vocab_size() + 31) // 32, dtype=torch.int32)
    for kind, regex in (("json", build_regex_from_schema(json.dumps(SCHEMA))), ("regex", REGEX)):
        t0 = time.perf_counter()
        index = Index(regex, v)
        g = Guide(index)
        g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        compile_s = time.perf_counter() - t0
        runs = []
        for _ in range(3):
            g = Guide(index)
            runs.append(walk(lambda _t, g=g: g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()),
                             g.advance, ids[kind]))
        out[kind] = _summary(runs, compile_s)
    return out


def _tokenizers(tok_json: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tok_json)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map of byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _summary(runs: list[list[float]], compile_s: float) -> dict[str, float]:
    per = [statistics.median(col) for col in zip(*runs, strict=True)]  # per position, median of the runs
    return {"compile_ms": compile_s * 1e3, "mask_us_mean": statistics.fmean(per) * 1e6,
            "mask_us_p50": statistics.median(per) * 1e6, "mask_us_max": max(per) * 1e6, "tokens": len(per)}


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines_core}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[8192, 32000])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for vocab in args.vocab:
        tok_json = tokenizer_json(vocab)
        tok = _tokenizers(tok_json)
        eos = tok.token_to_id("<|endoftext|>")
        ids = {"json": tok.encode(DOC).ids, "regex": tok.encode(REGEX_DOC).ids}
        for name, fn in ENGINES.items():
            try:
                r = fn(tok_json, eos, ids)
            except ImportError as e:
                print(f"{name}: not installed ({e})", file=sys.stderr)
                continue
            results[f"{name}@{tok.get_vocab_size()}"] = r
            for kind in ("json", "regex"):
                s = r[kind]
                print(f"{name:14s} vocab {tok.get_vocab_size():6d} {kind:5s}: mask mean {s['mask_us_mean']:7.1f} us "
                      f"p50 {s['mask_us_p50']:7.1f} max {s['mask_us_max']:8.1f} over {s['tokens']} tokens; "
                      f"compile {s['compile_ms']:7.1f} ms; tokenizer setup {r['tokenizer_s'] * 1e3:.0f} ms")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
