"""The engine's persistent sampling state (model/input_batch.py) through real engines: a request's
tokens do not depend on what else runs, on preemptions (its slot and penalty store survive them) or on
aborts around it, and every slot comes back."""

from __future__ import annotations

from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from tests.conftest import corpus_token_ids

# Seeded draws (each request has its own generator), penalties that read the request's own history,
# min_tokens bans, logprobs, n > 1 children: everything the input batch keeps per slot.
PARAMS = [
    SamplingParams(temperature=0.9, seed=1, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(temperature=0.8, seed=2, top_k=20, top_p=0.9, presence_penalty=0.7, max_tokens=20, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=22, frequency_penalty=1.5, min_tokens=10),
    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=18, min_p=0.05, repetition_penalty=0.9),
    SamplingParams(temperature=0.0, max_tokens=26, logprobs=2),
    SamplingParams(temperature=0.7, seed=4, max_tokens=16, presence_penalty=-0.5, min_tokens=16, ignore_eos=True),
]


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=path, check_invariants=True, enable_prefix_caching=False, **kw))


def _run(engine: LLMEngine, prompts: dict[int, list[int]], abort_at: dict[str, int] | None = None
         ) -> dict[str, list[tuple[list[int], list | None]]]:
    """Request str(i) gets prompts[i] and PARAMS[i % len(PARAMS)]; returns each finished one's completions."""
    abort_at = dict(abort_at or {})
    for i, p in prompts.items():
        engine.add_request(str(i), {"prompt_token_ids": p}, PARAMS[i % len(PARAMS)])
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for rid, at in list(abort_at.items()):
            if at == step:
                engine.abort_request(rid)
                del abort_at[rid]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.logprobs) for c in out.outputs]
        step += 1
    return done


def test_each_request_samples_the_same_alone_crowded_and_preempted(model_factory):
    path = model_factory("tiny-llama")
    solo_engine = _engine(path, num_kv_blocks=256)
    text = corpus_token_ids(solo_engine.tokenizer, 400)
    prompts = {i: text[11 * i: 11 * i + 10 + 5 * i] for i in range(12)}
    alone = {}
    for i, p in prompts.items():
        alone.update(_run(solo_engine, {i: p}))
    # Crowded: everything at once in a pool too small for it (preemptions by recompute), two aborts.
    engine = _engine(path, num_kv_blocks=24, block_size=4)
    crowded = _run(engine, prompts, abort_at={"5": 3, "10": 9})
    assert engine.scheduler.stats.num_preemptions > 0, "the pool was meant to force preemptions"
    assert set(crowded) == {str(i) for i in range(12)} - {"5", "10"}
    for rid, completions in crowded.items():
        assert [t for t, _ in completions] == [t for t, _ in alone[rid]], rid
        for (_, lp_a), (_, lp_b) in zip(completions, alone[rid], strict=True):
            if lp_a is not None:
                assert [list(p) for p in lp_a] == [list(p) for p in lp_b]
    assert engine.input_batch.num_active == 0, "sampling slots leaked"
    assert engine.block_manager.num_used == 0


def test_min_tokens_and_penalties_hold_in_the_engine(model_factory):
    path = model_factory("tiny-llama")
    engine = _engine(path, num_kv_blocks=128)
    out = _run(engine, {0: [5, 6, 7, 8]})["0"]  # PARAMS[0]: repetition 1.3 + frequency 0.4
    eos = engine.eos_token_ids
    # PARAMS[2] through the same engine: greedy with a frequency penalty of 1.5 and min_tokens 10.
    engine.add_request("g", {"prompt_token_ids": [5, 6, 7, 8]}, PARAMS[2])
    toks = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                toks = o.outputs[0].token_ids
    assert len(toks) >= 10 and not set(toks[:9]) & eos
    # A strong frequency penalty under greedy decoding: no token repeats more than a few times.
    assert max(toks.count(t) for t in set(toks)) <= 3
    assert out and engine.input_batch.num_active == 0
