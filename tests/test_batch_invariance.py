"""Batch invariance (greedy): a request's output does not depend on what else runs with it, whatever
the batching, chunking, prefix caching or preemption. Block invariants are checked after every step."""

from __future__ import annotations

import pytest
from conftest import corpus_token_ids, run_staggered

from minivllm import SamplingParams
from minivllm.config import EngineArgs
from minivllm.engine.llm_engine import LLMEngine

N_REQ = 16
MAX_TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _engine(path: str, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    return LLMEngine(EngineArgs(model=path, check_invariants=True, **kw))


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gpt2"])
def setup(request, model_factory):
    path = model_factory(request.param)
    solo_engine = _engine(path, enable_prefix_caching=False)
    text = corpus_token_ids(solo_engine.tokenizer, 400)
    # 16 prompts of lengths 3..108 taken at different offsets of real text.
    prompts = [text[7 * i: 7 * i + 3 + 7 * i] for i in range(N_REQ)]
    solo = {}
    for i, p in enumerate(prompts):
        solo[i] = run_staggered(solo_engine, [p], PARAMS, [0])[0]
    return path, prompts, solo, text


def _assert_clean(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_used == 0, "blocks leaked"
    assert bm.num_free_blocks == bm.num_blocks
    engine.check_invariants()


ARRIVALS = [i // 2 for i in range(N_REQ)]  # two new requests every step


@pytest.mark.parametrize("attention_backend", ["cpu_native", "torch"])
def test_mixed_batch_equals_solo(setup, attention_backend):
    path, prompts, solo, _ = setup
    engine = _engine(path, attention_backend=attention_backend)
    assert run_staggered(engine, prompts, PARAMS, ARRIVALS) == solo
    _assert_clean(engine)


def test_small_chunked_prefill_equals_solo(setup):
    path, prompts, solo, _ = setup
    engine = _engine(path, max_num_batched_tokens=8)
    steps_before = engine.timings.steps
    assert run_staggered(engine, prompts, PARAMS, ARRIVALS) == solo
    # Every prompt longer than 8 tokens had to be split: more steps than tokens/8 would need unchunked.
    assert engine.timings.steps - steps_before >= sum(len(p) for p in prompts) // 8
    _assert_clean(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_system_prompt_prefix_caching(setup, prefix_caching):
    path, _, _, text = setup
    system = text[:70]  # four full 16-token blocks shared by every request
    prompts = [system + text[100 + 5 * i: 100 + 5 * i + 3 + i] for i in range(N_REQ)]
    solo_engine = _engine(path, enable_prefix_caching=False)
    solo = {i: run_staggered(solo_engine, [p], PARAMS, [0])[0] for i, p in enumerate(prompts)}
    engine = _engine(path, enable_prefix_caching=prefix_caching)
    assert run_staggered(engine, prompts, PARAMS, ARRIVALS) == solo
    stats = engine.scheduler.stats
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    if prefix_caching:
        # The first arrivals compute the system prompt; every later one hits its 4 blocks.
        assert stats.prefix_cache_hits >= (N_REQ - 2) * 4 * 16
    else:
        assert stats.prefix_cache_hits == 0
    _assert_clean(engine)


def test_preemption_in_tiny_pool_equals_solo(setup):
    path, prompts, solo, _ = setup
    engine = _engine(path, num_kv_blocks=12)
    assert engine.block_manager.num_blocks == 12
    assert run_staggered(engine, prompts, PARAMS, ARRIVALS) == solo
    assert engine.scheduler.stats.num_preemptions > 0
    _assert_clean(engine)


def test_aborts_free_every_block(setup):
    path, prompts, solo, _ = setup
    engine = _engine(path, num_kv_blocks=20)
    aborts = {i: 3 + i for i in range(0, N_REQ, 3)}
    done = run_staggered(engine, prompts, PARAMS, ARRIVALS, aborts=aborts)
    assert set(done) == set(range(N_REQ)) - set(aborts)
    assert all(done[i] == solo[i] for i in done)
    _assert_clean(engine)


# The ablation baselines of `bench throughput` must compute the same thing, only slower or with more memory.
@pytest.mark.parametrize("mode", [{"batching": "static", "max_num_seqs": 4},
                                  {"kv_cache_mode": "contiguous", "max_model_len": 160},
                                  {"kv_cache_mode": "none"}], ids=["static", "contiguous", "no-kv-cache"])
def test_ablation_modes_equal_solo(setup, mode):
    path, prompts, solo, _ = setup
    # Contiguous: 40 blocks hold four 160-token reservations (10 blocks each), so reservation, not the
    # prompts' size, limits how many run.
    blocks = 40 if mode.get("kv_cache_mode") == "contiguous" else 256
    engine = LLMEngine(EngineArgs(model=path, check_invariants=True, num_kv_blocks=blocks, **mode), log_stats=True)
    step, seen = engine.step, []

    def watched_step():
        before = {s.request_id: s.num_output_tokens for s in engine.scheduler.running}
        out = step()
        after = {s.request_id for s in engine.scheduler.running}
        seen.append((before, after, engine.block_manager.num_used))
        return out

    engine.step = watched_step
    assert run_staggered(engine, prompts, PARAMS, ARRIVALS) == solo
    for before, after, used in seen:
        if mode.get("batching") == "static" and after - set(before):
            # Requests join only a batch that has not started decoding (or a new one).
            assert not any(before.values()), (before, after)
        if mode.get("kv_cache_mode") == "contiguous":
            assert used == 10 * len(after) and len(after) <= 4
    steps = engine.take_stats().num_iteration_tokens
    total = sum(len(p) for p in prompts) + N_REQ * (MAX_TOKENS - 1)
    if mode.get("kv_cache_mode") == "none":
        # Every token is computed once per later step of its sequence: far more than once.
        per_seq = sum(sum(range(len(p), len(p) + MAX_TOKENS)) for p in prompts)
        assert sum(steps) == per_seq
    else:
        assert sum(steps) == total  # no recompute, no preemption
    _assert_clean(engine)


def test_ablation_modes_refuse_what_needs_shared_blocks(setup):
    path = setup[0]
    for mode in ("contiguous", "none"):
        engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=256, max_model_len=160, kv_cache_mode=mode))
        assert not engine.block_manager.enable_prefix_caching
        for params in (SamplingParams(n=2), SamplingParams(use_beam_search=True, beam_width=2, max_tokens=4)):
            with pytest.raises(ValueError, match=f"kv_cache_mode={mode} serves only n=1"):
                engine.add_request("x", [5, 6, 7], params)
    with pytest.raises(ValueError, match="reserves max_model_len"):
        LLMEngine(EngineArgs(model=path, num_kv_blocks=4, max_model_len=160, kv_cache_mode="contiguous"))
    with pytest.raises(ValueError, match="batching must be one of"):
        EngineArgs(model=path, batching="dynamic")
