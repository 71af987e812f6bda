"""KV cache groups (engine/kv_groups.py): sliding-window layers keep only their window in the paged cache.

Gemma 3 (tiny: layers local, local, global, local; window 8) holds every block in its global layer's pool and a
window's worth in the local layers' pool, so a long sequence holds a fraction of full attention's KV, measured
from the pools' own accounting; outputs stay HF's; prefix hits longer than the window are served from the window
group's recent blocks; a model whose every layer slides (Mistral) runs a sequence longer than its whole pool."""

from __future__ import annotations

import pytest
from conftest import corpus_token_ids, hf_greedy, hf_model

from minivllm import LLM, SamplingParams
from minivllm.engine.kv_groups import plan_kv_groups


def test_gemma3_long_sequence_holds_its_global_layers_kv_and_a_window(model_factory):
    path = model_factory("tiny-gemma3")
    llm = LLM(path, num_kv_blocks=64, block_size=16, max_num_batched_tokens=64, check_invariants=True)
    engine = llm.llm_engine
    plan = engine.kv_groups
    assert plan.windows == (None, 8) and plan.layers == ((2,), (0, 1, 3))
    bm, window_bm = engine.block_manager, engine.block_manager.groups.managers[0]
    ids = corpus_token_ids(engine.tokenizer, 600)
    engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=40,
                                                                         ignore_eos=True))
    peak_window = 0
    while engine.has_unfinished_requests():
        engine.step()
        seq = engine.groups["long"].seqs[0] if "long" in engine.groups else None
        if seq is not None and not seq.status.finished:
            held_full, held_window = bm.num_used, window_bm.num_used
            peak_window = max(peak_window, held_window)
            # The global layer's pool holds every block so far; the window pool at most the window and a chunk.
            assert held_full == -(-seq.num_computed_tokens // 16) or held_full == -(-(seq.num_computed_tokens + 1)
                                                                                     // 16)
            assert held_window <= -(-(8 - 1 + 64) // 16) + 1
    assert bm.num_used == window_bm.num_used == 0
    # KV held at the end of the sequence (640 tokens) against full attention in all four layers.
    tokens = 640
    held = 1 * tokens + 3 * peak_window * 16
    full = 4 * tokens
    assert held / full < 0.35, (held, full)
    report = plan.tokens_held(tokens, 16)
    assert report["ratio"] < 0.3 and report["layer_tokens_full_attention"] == full


def test_real_gemma3_1b_plan_holds_a_sixth_of_full_attention_at_32k():
    """gemma-3-1b's shape (26 layers, 22 with a 512-token window), 2 GiB of float32 KV: the pools and what a
    32k-token sequence holds."""
    windows = tuple(512 if (i + 1) % 6 else None for i in range(26))
    per_layer_token = 2 * 1 * 256 * 4  # K and V, one KV head of 256, float32
    plan = plan_kv_groups(windows, 2 << 30, 16, per_layer_token, max_num_seqs=8, token_budget=512)
    assert plan.windows == (None, 512) and [len(ls) for ls in plan.layers] == [4, 22]
    held = plan.tokens_held(32768, 16)
    assert 0.16 < held["ratio"] < 0.18, held  # (4 x 32768 + 22 x 528) / (26 x 32768)
    # The global layers' pool holds over 4x the tokens one pool for every layer would at this budget.
    full_pool_tokens = (2 << 30) // (26 * per_layer_token)
    assert plan.num_blocks[0] * 16 > 4 * full_pool_tokens


def test_gemma_outputs_match_hf_with_prefix_hits_past_the_window(model_factory):
    """A shared 200-token prefix (25 windows long): the second request reuses its cached blocks in both groups
    (the window group only needs the last window's), and both equal HF's greedy output."""
    path = model_factory("tiny-gemma2")
    llm = LLM(path, num_kv_blocks=64, block_size=8, check_invariants=True)
    engine = llm.llm_engine
    prefix = corpus_token_ids(engine.tokenizer, 230)
    prompts = [prefix[:200] + prefix[200 + 10 * i:210 + 10 * i] for i in range(2)]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0].outputs[0].token_ids
    hits_before = engine.scheduler.stats.prefix_cache_hits
    second = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.scheduler.stats.prefix_cache_hits - hits_before >= 192
    hf = hf_model(path)
    assert [first, second] == [hf_greedy(hf, p, 16) for p in prompts]


@pytest.mark.parametrize("preset", ["tiny-mistral"])
def test_every_layer_sliding_runs_past_the_pool(model_factory, preset):
    """tiny-mistral's window is 8 tokens: 6 blocks of 16 (96 slots) serve a 300-token sequence, and equal HF."""
    path = model_factory(preset)
    llm = LLM(path, num_kv_blocks=6, block_size=16, max_num_batched_tokens=32, check_invariants=True)
    ids = corpus_token_ids(llm.llm_engine.tokenizer, 200)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=100, min_tokens=100),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy(hf_model(path), ids, 100)
    assert llm.llm_engine.block_manager.num_evicted_blocks > 10


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_gemma_preempts_by_swap_in_every_group(model_factory, tmp_path, mode):
    """A pool too small for the batch: sequences swap out (both groups' blocks) and back, and every output equals
    an unpreempted run's; both host tiers are empty at the end."""
    path = model_factory("tiny-gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30)
    base = LLM(path, num_kv_blocks=256, block_size=8)
    ids = corpus_token_ids(base.llm_engine.tokenizer, 400)
    prompts = [{"prompt_token_ids": ids[20 * i:20 * i + 10 + 5 * i]} for i in range(8)]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, num_kv_blocks=12, block_size=8, max_num_batched_tokens=32, preemption_mode=mode,
              swap_space="8MiB", swap_dir=str(tmp_path), check_invariants=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    engine = llm.llm_engine
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and (stats.num_swap_preemptions > 0 or mode == "auto")
    swap = engine.swap
    assert swap.num_used == 0 and all(m.num_used == 0 for m in swap.group_managers)
    assert engine.block_manager.num_used == 0 and engine.block_manager.groups.num_used == 0


def test_a_window_no_shorter_than_max_model_len_shares_the_full_pool(model_factory):
    """gemma2-2b's 4096-token window served with max_model_len 256 never leaves a token behind: its layers keep their
    KV in the full pool (one group), and a batch of max_num_seqs sequences runs at once. (As a window pool sized for
    4096-token sequences, it admitted a quarter of them: 16 of 64 in `bench families`, which then overstated tok/s.)
    Outputs stay HF's."""
    path = model_factory("tiny-gemma2")
    ids = [(7 * i) % 900 + 5 for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    grouped = LLM(path, max_model_len=64, kv_cache_memory="4MiB", max_num_seqs=32)
    assert grouped.llm_engine.kv_groups.windows == (None, 8) and grouped.llm_engine.runner.num_kv_groups == 2
    merged = LLM(path, max_model_len=8, kv_cache_memory="4MiB", max_num_seqs=32)
    assert merged.llm_engine.kv_groups.windows == (None,) and merged.llm_engine.runner.num_kv_groups == 1
    engine = merged.llm_engine
    for s in range(32):
        engine.add_request(str(s), {"prompt_token_ids": ids[:1] + [s + 5]}, SamplingParams(max_tokens=6,
                                                                                           ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 32
    while engine.has_unfinished_requests():
        engine.step()
    want = hf_greedy(hf_model(path), ids[:2], 6)
    out = merged.generate([{"prompt_token_ids": ids[:2]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == want
