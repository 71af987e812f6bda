"""Suffix decoding (spec_decode/suffix_proposer.py): proposals equal a plain suffix-tree reading of the same tokens
(longest suffix match up to the tree depth, then the most frequent continuation while its probability holds), the
global cache of finished outputs (eviction, the index rebuilt as it grows), vLLM's config keys, and clear errors.
Lossless generation with it: tests/test_spec_decode.py::test_greedy_outputs_identical_with_and_without_speculation."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import SequenceStatus
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.suffix_proposer import SuffixCache, SuffixProposer


def _seq(seq_id: int, tokens: list[int], prompt_len: int | None = None, finished: bool = False) -> SimpleNamespace:
    n = len(tokens) if prompt_len is None else prompt_len
    return SimpleNamespace(seq_id=seq_id, token_ids=list(tokens), output_token_ids=list(tokens[n:]),
                           status=SequenceStatus.FINISHED_STOPPED if finished else SequenceStatus.RUNNING)


def reference(corpora: list[list[int]], context: list[int], k: int, depth: int, factor: float,
              min_prob: float) -> tuple[list[int], float]:
    """What a suffix tree over the corpora (each its own sequences) proposes after context: the longest suffix of
    context (<= depth) occurring in them, ending before the corpus' own end if the corpus is the context itself;
    then, k' = min(k, int(factor * match)) times, the most frequent next token (the smallest id among equals) while
    the product of shares stays >= min_prob."""
    def occurrences(m: int) -> list[tuple[int, int]]:
        pat = context[-m:]
        return [(c, q) for c, toks in enumerate(corpora) for q in range(m - 1, len(toks))
                if toks[q - m + 1:q + 1] == pat and (toks is not context or q < len(toks) - 1)]

    best = max((m for m in range(1, min(depth, len(context)) + 1) if occurrences(m)), default=0)
    if not best:
        return [], 0.0
    occ, out, prob, score = occurrences(best), [], 1.0, 0.0
    for i in range(1, min(k, int(factor * best)) + 1):
        nxt = [corpora[c][q + i] if q + i < len(corpora[c]) else None for c, q in occ]
        counts = Counter(t for t in nxt if t is not None)
        if not counts:
            break
        top = max(counts.values())
        tok = min(t for t, n in counts.items() if n == top)
        prob *= top / len(occ)
        if prob < min_prob:
            break
        out.append(tok)
        score += prob
        occ = [o for o, t in zip(occ, nxt, strict=True) if t == tok]
    return out, score


@pytest.mark.parametrize("seed", range(40))
def test_proposals_equal_a_suffix_tree_reading(seed):
    """Random repetitive token streams (a small alphabet, copied spans): the proposal from the sequence's own tokens
    and from finished outputs equals the reference's higher-scoring one, for several depths, factors and k."""
    rng = random.Random(seed)
    alphabet = rng.choice([3, 5, 20])
    k, depth = rng.choice([1, 3, 6]), rng.choice([2, 4, 24])
    factor, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4])

    def stream(n: int) -> list[int]:
        toks = [rng.randrange(alphabet) for _ in range(8)]
        while len(toks) < n:
            if rng.random() < 0.5:
                start = rng.randrange(len(toks))
                toks += toks[start:start + rng.randrange(1, 12)]
            else:
                toks.append(rng.randrange(alphabet))
        return toks[:n]

    sp = SuffixProposer(k, depth, 8, factor, min_prob)
    sp.cache.MIN_TAIL = 16  # rebuild the index now and then
    finished = [stream(rng.randrange(5, 40)) for _ in range(rng.randrange(0, 12))]
    for i, out in enumerate(finished):
        sp.release(_seq(100 + i, [0, 1] + out, prompt_len=2, finished=True))
    cached = finished[-8:]  # max_cached_requests
    seq = _seq(1, stream(rng.randrange(2, 60)))
    for _ in range(3):  # the sequence grows between proposals: its buffer follows
        got = sp.speculate(seq, k)  # type: ignore[arg-type]
        own = reference([seq.token_ids], seq.token_ids, k, depth, factor, min_prob)
        glob = reference(cached, seq.token_ids, k, depth, factor, min_prob)
        assert got == max(own, glob, key=lambda r: r[1])[0] if max(own[1], glob[1]) > 0 else got == []
        seq.token_ids += [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))]
    sp.check_invariants()


def test_finished_outputs_are_proposed_to_later_requests_and_the_oldest_leave():
    sp = SuffixProposer(4, 24, 2, 1.0, 0.1)
    sp.release(_seq(1, [9, 9, 10, 11, 12, 13, 14], prompt_len=2, finished=True))
    assert sp.cache.num_tokens == 5 and not sp.local
    # A preempted (not finished) sequence's output is not cached; its buffer goes.
    sp.speculate(_seq(2, [1, 2, 3]), 4)  # type: ignore[arg-type]
    sp.release(_seq(2, [1, 2, 3, 40, 41], prompt_len=3))
    assert sp.cache.num_tokens == 5 and not sp.local
    later = _seq(3, [7, 10, 11, 12])
    assert sp.speculate(later, 4) == [13, 14]  # type: ignore[arg-type]  # match 3 long: up to 3; the output ends
    assert sp.speculate(_seq(4, [5, 11]), 4) == [12]  # type: ignore[arg-type]  # a one-token match proposes one
    for i in range(2):  # two newer outputs push the first out
        sp.release(_seq(10 + i, [0, 20 + i, 21 + i, 22 + i], prompt_len=1, finished=True))
    assert sp.speculate(_seq(5, [7, 10, 11, 12]), 4) == []  # type: ignore[arg-type]
    sp.cache.clear()
    assert sp.cache.num_tokens == 0


def test_the_index_and_the_tail_search_alike():
    """Outputs in the sorted index and in the unindexed tail give the same proposals as one corpus."""
    rng = random.Random(7)
    outs = [[rng.randrange(6) for _ in range(rng.randrange(3, 30))] for _ in range(40)]
    a, b = SuffixCache(100, 8, 5), SuffixCache(100, 8, 5)
    b.MIN_TAIL = 10**9  # b never indexes (all tail); a indexes everything at the end
    for o in outs:
        a.add(o)
        b.add(o)
    a.reindex()
    assert a.num_tail == 0 and b.num_tail == 40 and a.num_tokens == b.num_tokens
    for _ in range(50):
        ctx = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        pa, pb = SuffixProposer(4, 8, 0, 1.0, 0.1), SuffixProposer(4, 8, 0, 1.0, 0.1)
        pa.cache, pb.cache = a, b
        seq = _seq(1, [99] + ctx)  # 99: never in the outputs, so only the cache can propose
        assert pa.speculate(seq, 4) == pb.speculate(seq, 4)  # type: ignore[arg-type]


def test_suffix_speculation_from_vllm_config_and_cached_outputs_in_the_engine(model_factory):
    """{"method": "suffix", ...} builds the suffix proposer; a repeated request is proposed its earlier output from
    the global cache (most proposals accepted), and every output equals the greedy one without speculation."""
    path = model_factory("tiny-llama")
    cfg = {"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_max_tree_depth": 16,
           "suffix_decoding_max_cached_requests": 50, "suffix_decoding_max_spec_factor": 2,
           "suffix_decoding_min_token_prob": 0.2, "adaptive": False}
    engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=128, check_invariants=True, speculative_config=cfg))
    sp = engine.speculator
    assert sp is not None and isinstance(sp.proposer, SuffixProposer) and sp.k == 5
    assert (sp.proposer.depth, sp.proposer.cache.outputs.maxlen, sp.proposer.spec_factor,
            sp.proposer.min_prob) == (16, 50, 2, 0.2)
    plain = LLMEngine(EngineArgs(model=path, num_kv_blocks=128))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(eng: LLMEngine, rid: str) -> list[int]:
        eng.add_request(rid, {"prompt_token_ids": [5, 17, 33, 2, 71, 9]}, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    return list(out.outputs[0].token_ids)
        raise AssertionError("no output")

    want = run(plain, "a")
    assert run(engine, "a") == want
    first = sp.stats.num_accepted_tokens
    assert run(engine, "b") == want  # the same request again: its output is in the cache
    st = sp.stats
    assert st.num_accepted_tokens - first >= 30  # nearly all of the 40 tokens came as accepted proposals
    assert engine.block_manager.num_used == 0 and not sp.proposer.local


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_model="suffix", num_speculative_tokens=2, suffix_decoding_max_tree_depth=0),
     "suffix_decoding_max_tree_depth must be >= 1"),
    (dict(speculative_model="suffix", num_speculative_tokens=2, suffix_decoding_min_token_prob=1.5),
     "suffix_decoding_min_token_prob in"),
    (dict(speculative_config='{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_spec_factor": '
                             '"big"}'), "suffix_decoding_max_spec_factor must be float"),
    (dict(speculative_config='{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": '
                             '2.5}'), "suffix_decoding_max_tree_depth must be int"),
])
def test_bad_suffix_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
