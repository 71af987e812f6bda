"""--kv-eviction sink-window (StreamingLLM): blocks between the attention sinks and the recent window are
freed as a sequence advances, so it can run past the KV pool; attention reads only sinks + window."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.config import EngineArgs
from minivllm.engine.block_manager import EVICTED
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model import cpu_kernels

SINKS, WINDOW = 4, 40


def _run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _engine(path: str, **kw) -> LLMEngine:
    base = dict(model=path, block_size=8, max_num_batched_tokens=32, check_invariants=True)
    return LLMEngine(EngineArgs(**{**base, **kw}))


@pytest.mark.parametrize("backend", ["torch", "cpu_native"])
def test_sequence_longer_than_pool_completes(model_factory, backend):
    if backend == "cpu_native" and not cpu_kernels.available():
        pytest.skip("native CPU kernels did not compile here")
    path = model_factory("tiny-llama")
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    # 12 blocks x 8 tokens = 96 slots; each sequence reaches 30 + 200 = 230 tokens.
    small = _engine(path, num_kv_blocks=12, kv_eviction="sink-window", sink_tokens=SINKS, window_tokens=WINDOW,
                    attention_backend=backend)
    prompts = _prompts(2, 30, small.model_config.vocab_size)
    got = _run(small, prompts, params)
    assert all(len(t) == 200 for t in got.values())
    bm = small.block_manager
    assert bm.num_used == 0 and bm.num_evicted_blocks > 2 * (230 - SINKS - WINDOW) // 8 - 4
    # Lossless against the same attention rule with a pool that never had to free anything...
    big = _engine(path, num_kv_blocks=128, kv_eviction="sink-window", sink_tokens=SINKS, window_tokens=WINDOW,
                  attention_backend=backend, enable_prefix_caching=False)
    assert _run(big, prompts, params) == got
    # ...and equal to full attention for as long as sinks + window cover the whole context.
    full = _engine(path, num_kv_blocks=128, attention_backend=backend)
    same = SINKS + WINDOW - 30
    for k, toks in _run(full, prompts, params).items():
        assert toks[:same] == got[k][:same]
        assert toks != got[k]  # past that, the model sees less: the outputs part


def test_native_matches_torch_with_sinks(model_factory):
    if not cpu_kernels.available():
        pytest.skip("native CPU kernels did not compile here")
    path = model_factory("tiny-llama")
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("torch", "cpu_native"):
        eng = _engine(path, num_kv_blocks=16, kv_eviction="sink-window", sink_tokens=3, window_tokens=21,
                      attention_backend=backend)
        prompts = _prompts(3, 25, eng.model_config.vocab_size)
        outs[backend] = _run(eng, prompts, params)
    assert outs["torch"] == outs["cpu_native"]


def test_eviction_with_prefix_cache_and_samples(model_factory):
    """Forked samples share evicted tables; a repeated prompt hits blocks cached under the same rule."""
    path = model_factory("tiny-llama")
    eng = _engine(path, num_kv_blocks=40, kv_eviction="sink-window", sink_tokens=SINKS, window_tokens=WINDOW)
    prompt = _prompts(1, 60, eng.model_config.vocab_size)[0]
    params = SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=80, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": prompt}, params)
    while eng.has_unfinished_requests():
        eng.step()
        for s in eng.scheduler.running:
            assert EVICTED not in s.block_table[:1]  # the sink block stays
    assert eng.block_manager.num_used == 0
    first = _run(eng, [prompt], SamplingParams(temperature=0, max_tokens=5))
    hits = eng.scheduler.stats.prefix_cache_hits
    again = _run(eng, [prompt], SamplingParams(temperature=0, max_tokens=5))
    assert eng.scheduler.stats.prefix_cache_hits > hits and again == first


def test_without_eviction_request_is_rejected_as_today(model_factory):
    path = model_factory("tiny-llama")
    eng = _engine(path, num_kv_blocks=12)
    with pytest.raises(ValueError, match=r"request needs 29 KV blocks .* whole pool has 12"):
        eng.add_request("x", {"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=200))
    # With eviction the same request fits (its working set is sinks + window + a chunk).
    eng = _engine(path, num_kv_blocks=12, kv_eviction="sink-window", sink_tokens=SINKS, window_tokens=WINDOW)
    eng.add_request("x", {"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=200))
    # A window too large for the pool is still rejected, naming the pool.
    eng = _engine(path, num_kv_blocks=12, kv_eviction="sink-window", sink_tokens=SINKS, window_tokens=200)
    with pytest.raises(ValueError, match="whole pool has 12"):
        eng.add_request("x", {"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=400))


def test_bad_eviction_settings(model_factory):
    with pytest.raises(ValueError, match="kv_eviction must be one of none, sink-window, got 'lru'"):
        EngineArgs(kv_eviction="lru")
    with pytest.raises(ValueError, match="needs window_tokens >= 1"):
        EngineArgs(kv_eviction="sink-window")
    with pytest.raises(ValueError, match="sink_tokens must be >= 0"):
        EngineArgs(kv_eviction="sink-window", window_tokens=8, sink_tokens=-1)
    with pytest.raises(ValueError, match="does not combine with speculative decoding"):
        EngineArgs(kv_eviction="sink-window", window_tokens=8, speculative_model="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="already attends through a sliding window"):
        _engine(model_factory("tiny-mistral"), num_kv_blocks=16, kv_eviction="sink-window", window_tokens=8)


def test_evicted_blocks_reach_the_metrics(model_factory):
    from prometheus_client.parser import text_string_to_metric_families

    from minivllm.entrypoints.metrics import ServerMetrics

    path = model_factory("tiny-llama")
    eng = LLMEngine(EngineArgs(model=path, block_size=8, num_kv_blocks=12, max_num_batched_tokens=32,
                               kv_eviction="sink-window", sink_tokens=SINKS, window_tokens=WINDOW), log_stats=True)
    metrics = ServerMetrics("m")
    eng.add_request("a", {"prompt_token_ids": _prompts(1, 30, eng.model_config.vocab_size)[0]},
                    SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
        metrics.record(eng.take_stats(), eng.snapshot())
    evicted = eng.block_manager.num_evicted_blocks
    assert evicted >= (130 - SINKS - WINDOW) // 8 - 2
    samples = {s.name: s.value for fam in text_string_to_metric_families(metrics.render().decode())
               for s in fam.samples}
    assert samples["minivllm:kv_evicted_blocks_total"] == evicted


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_eviction_under_heavy_preemption(model_factory, tmp_path, mode):
    """Victims preempted before their own allocation in a step still hold blocks their window has left: swapped,
    those are released rather than copied (a swap-in once wrote a fresh copy through an EVICTED entry)."""
    path = model_factory("tiny-llama")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(kv_eviction="sink-window", sink_tokens=SINKS, window_tokens=WINDOW, enable_prefix_caching=False)
    big = _engine(path, num_kv_blocks=256, **kw)
    prompts = _prompts(6, 120, big.model_config.vocab_size)
    want = _run(big, prompts, params)
    # 16 blocks of 8 tokens: prompts of 120 tokens arrive in 32-token chunks, so a victim that is mid-prefill
    # holds blocks its window left in its last chunk.
    small = _engine(path, num_kv_blocks=16, preemption_mode=mode, swap_space="4MiB", swap_dir=str(tmp_path), **kw)
    move = small.runner.move_blocks

    def checked_move(swap_out, swap_in, copies):
        assert all(b >= 0 for pair in (*swap_out, *swap_in, *copies) for b in pair), (swap_out, swap_in, copies)
        return move(swap_out, swap_in, copies)

    small.runner.move_blocks = checked_move
    assert _run(small, prompts, params) == want
    st = small.scheduler.stats
    assert st.num_preemptions >= 4 and (mode == "recompute" or st.num_swap_preemptions >= 4), st
    assert small.block_manager.num_used == 0
    if small.swap is not None:
        assert small.swap.num_used == 0


def test_a_cached_prefix_nearly_the_size_of_the_pool_is_admitted_with_eviction(model_factory):
    """Prefix hits outside the window are not taken at admission: a prompt whose cached blocks nearly fill the
    pool, with more tokens after them, runs (taking every hit, its first chunk could never find room)."""
    path = model_factory("tiny-llama")
    eng = _engine(path, num_kv_blocks=18, kv_eviction="sink-window", sink_tokens=SINKS, window_tokens=WINDOW)
    prompts = _prompts(2, 140, eng.model_config.vocab_size)
    first = _run(eng, prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    hits = eng.scheduler.stats.prefix_cache_hits
    eng.add_request("b", {"prompt_token_ids": prompts[0] + first["0"] + prompts[1][:60]},
                    SamplingParams(temperature=0, max_tokens=4))
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    assert not eng.has_unfinished_requests(), "the request with a long cached prefix never ran"
    assert eng.scheduler.stats.prefix_cache_hits - hits >= 128  # 16 of its 17 full cached blocks
    assert eng.block_manager.num_used == 0
