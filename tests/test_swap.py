"""Preemption by swap (--preemption-mode recompute|swap|auto, --swap-space, --swap-dir): under heavy preemption
greedy outputs equal those of an unpreempted run in every mode, block and swap accounting hold after every step
and nothing is held in either tier at the end; prefix hashes survive a swap round trip; aborts free host blocks;
samples, beams and tensor parallelism swap too; bad settings are clear errors; the metrics report both tiers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import corpus_token_ids, run_staggered
from prometheus_client.parser import text_string_to_metric_families

from minivllm import LLM, SamplingParams
from minivllm.config import EngineArgs
from minivllm.engine.block_manager import BlockManager
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.stats import IterationStats, SchedulerSnapshot
from minivllm.engine.step_trace import StepTracer
from minivllm.engine.swap_manager import PreemptionCosts, SwapManager
from minivllm.engine_config import SchedulerConfig
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.model.kv_swap import HostKVTier, block_bytes, check_capacity
from minivllm.sampling_params import BeamSearchParams

N_REQ = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
ARRIVALS = [i // 2 for i in range(N_REQ)]  # two new requests every step


@pytest.fixture(scope="module")
def setup(model_factory):
    path = model_factory("tiny-llama")
    solo_engine = LLMEngine(EngineArgs(model=path, num_kv_blocks=256, enable_prefix_caching=False))
    text = corpus_token_ids(solo_engine.tokenizer, 400)
    prompts = [text[11 * i: 11 * i + 5 + 3 * i] for i in range(N_REQ)]  # 5..50 tokens
    solo = {i: run_staggered(solo_engine, [p], PARAMS, [0])[0] for i, p in enumerate(prompts)}
    return path, prompts, solo


def _engine(path: str, tmp_path, log_stats: bool = False, **kw) -> LLMEngine:
    # 8 blocks of 16 tokens: one long request (50 + 40 tokens) takes 6 of them, so sequences preempt each
    # other throughout.
    kw = {"num_kv_blocks": 8, "max_num_batched_tokens": 32, "swap_space": "4MiB", **kw}
    return LLMEngine(EngineArgs(model=path, check_invariants=True, swap_dir=str(tmp_path), **kw), log_stats)


def _assert_clean(engine: LLMEngine) -> None:
    bm, swap = engine.block_manager, engine.swap
    assert not engine.has_unfinished_requests() and not engine.scheduler.swapped
    assert bm.num_used == 0 and bm.num_free_blocks == bm.num_blocks, "device blocks leaked"
    if swap is not None:
        assert swap.num_used == 0 and len(swap.free_ids) == swap.num_blocks, "host blocks leaked"
    engine.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_heavy_preemption_equals_unpreempted(setup, tmp_path, mode):
    path, prompts, solo = setup
    engine = _engine(path, tmp_path, log_stats=True, preemption_mode=mode)
    tracer, records, swapped_seen = StepTracer(), [], []
    step = engine.step

    def traced_step():
        out = step()
        swapped_seen.append(engine.snapshot().num_swapped_blocks)
        records.append(tracer.build(engine, engine.take_stats()))  # the live view copes with swapped requests
        return out

    engine.step = traced_step
    assert run_staggered(engine, prompts, PARAMS, ARRIVALS) == solo
    st = engine.scheduler.stats
    assert st.num_preemptions >= 15, st
    swapped_ids = {rid for r in records for rid in r["swapped_out"]}
    if mode == "recompute":
        assert engine.swap is None and st.num_swap_preemptions == 0 and not swapped_ids
    elif mode == "auto":  # its picks follow timings measured here (a fixed-cost run below checks the mix)
        assert st.num_swap_preemptions <= st.num_preemptions
    else:
        # The tier has room for everything and nothing is an idle beam: every preemption is a swap.
        assert st.num_swap_preemptions == st.num_preemptions
        # Blocks still cached on device at resume come back by their hash, not by a copy.
        assert 0 < st.swap_in_bytes < st.swap_out_bytes
        assert max(swapped_seen) > 0 and swapped_ids and max(r["num_swapped"] for r in records) > 0
    _assert_clean(engine)
    # Every counter reached the stats (and so the metrics) exactly once.
    assert sum(r["generation_tokens"] for r in records) == N_REQ * PARAMS.max_tokens
    # The prefix cache left behind, blocks restored from the host included, holds the right KV.
    again = {i: run_staggered(engine, [p], PARAMS, [0])[0] for i, p in enumerate(prompts)}
    assert again == solo
    _assert_clean(engine)


def test_auto_picks_the_cheaper_per_sequence(setup, tmp_path, monkeypatch):
    """With costs fixed (a block moved costs 7 prefill tokens), a swap (paid twice) is cheaper only for a
    sequence with enough computed tokens per block: small ones are recomputed, large ones swapped."""
    path, prompts, solo = setup
    monkeypatch.setattr(PreemptionCosts, "observe", lambda *args: None)
    engine = _engine(path, tmp_path, preemption_mode="auto")
    assert engine.swap is not None
    engine.swap.costs.prefill_s_per_token, engine.swap.costs.swap_s_per_block = 1.0, 7.0
    assert run_staggered(engine, prompts, PARAMS, ARRIVALS) == solo
    st = engine.scheduler.stats
    assert 0 < st.num_swap_preemptions < st.num_preemptions, st
    _assert_clean(engine)


def test_a_full_tier_falls_back_to_recompute(setup, tmp_path):
    path, prompts, solo = setup
    probe = _engine(path, tmp_path)
    engine = _engine(path, tmp_path, preemption_mode="swap", swap_space=str(3 * probe.runner.swap_block_bytes))
    assert engine.swap is not None and engine.swap.num_blocks == 3
    assert run_staggered(engine, prompts, PARAMS, ARRIVALS) == solo
    st = engine.scheduler.stats
    assert 0 < st.num_swap_preemptions < st.num_preemptions, st
    _assert_clean(engine)


def test_aborting_a_swapped_request_frees_its_host_blocks(setup, tmp_path):
    path, prompts, solo = setup
    engine = _engine(path, tmp_path, preemption_mode="swap")
    swap = engine.swap
    assert swap is not None
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, PARAMS)
    for _ in range(200):
        engine.step()
        if engine.scheduler.swapped:
            break
    victim = engine.scheduler.swapped[-1]
    held, its = swap.num_used, len(swap.tables[victim.seq_id])
    assert held >= its > 0
    out = engine.abort_request(victim.request_id)
    assert out is not None and out.finished and victim.status == SequenceStatus.FINISHED_ABORTED
    assert swap.num_used == held - its and victim.seq_id not in swap.tables
    engine.check_invariants()
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0].token_ids
    assert done == {i: t for i, t in solo.items() if str(i) != victim.request_id}
    _assert_clean(engine)


def test_prefix_hashes_survive_a_swap_round_trip():
    """Without a model: a swapped-out sequence's full blocks stay cached under their hashes (a new request
    with its prompt hits them), and its swap-in reuses them by hash, copying back only its partial block."""
    bm = BlockManager(16, 4)
    swap = SwapManager(16, 64, bm)
    sched = Scheduler(SchedulerConfig(8, 64, True, preemption_mode="swap"), bm, swap)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks and a partial one
    a = Sequence("a", prompt, SamplingParams(), 0)
    sched.add(a)
    out = sched.schedule()
    assert out.scheduled == [(a, 18)]
    a.num_computed_tokens = 18
    bm.cache_blocks(a)
    a.token_ids.append(7)
    blocks = list(a.block_table)
    sched.running.remove(a)
    sched._preempt(a)
    moves_out, moves_in = swap.take()
    assert a.status == SequenceStatus.SWAPPED and a.num_computed_tokens == 18 and not a.block_table
    assert [d for d, _ in moves_out] == blocks and not moves_in
    assert all(bm.hash_to_block[h] == b for h, b in zip(a.block_hashes[:4], blocks, strict=False))
    b = Sequence("b", prompt + [5, 6], SamplingParams(), 1)
    assert bm.get_computed_blocks(b) == blocks[:4]
    out = sched.schedule()  # a resumes before anything waiting is admitted
    assert out.scheduled[0] == (a, 1) and a.status == SequenceStatus.RUNNING
    assert a.block_table[:4] == blocks[:4]
    assert out.swap_in == [(moves_out[4][1], a.block_table[4])]
    bm.check_invariants(sched.running + sched.waiting)
    swap.check_invariants(sched.swapped)


def test_samples_and_beams_swap_too(setup, tmp_path):
    path, prompts, _ = setup
    sampled = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True)
    ref = LLM(path, num_kv_blocks=256)
    tight = LLM(path, num_kv_blocks=8, max_num_batched_tokens=16, check_invariants=True, preemption_mode="swap",
                swap_space="4MiB", swap_dir=str(tmp_path))
    few = prompts[4:10]

    def ids(outs):
        return [[c.token_ids for c in o.outputs] for o in outs]

    assert ids(tight.generate(few, sampled, use_tqdm=False)) == ids(ref.generate(few, sampled, use_tqdm=False))
    assert ids(tight.beam_search(few[:3], beams)) == ids(ref.beam_search(few[:3], beams))
    st = tight.llm_engine.scheduler.stats
    assert st.num_swap_preemptions > 0, st
    _assert_clean(tight.llm_engine)


def test_tensor_parallel_ranks_swap_their_shards(setup, tmp_path):
    path, prompts, solo = setup
    engine = _engine(path, tmp_path, preemption_mode="swap", tensor_parallel_size=2)
    try:
        assert run_staggered(engine, prompts[:8], PARAMS, ARRIVALS[:8]) == {i: solo[i] for i in range(8)}
        assert engine.scheduler.stats.num_swap_preemptions > 0
        _assert_clean(engine)
    finally:
        engine.runner.group.shutdown()


def test_host_tier_moves_every_pool_tensor_and_leaves_no_file(tmp_path):
    # A cache and the float16 scales of a quantized one: each [2, layers, blocks, ...].
    pools = [torch.randn(2, 3, 10, 4, 2, 8), torch.randn(2, 3, 10, 4, 2).half()]
    tier = HostKVTier(pools, 6, str(tmp_path))
    assert os.listdir(tmp_path) == []  # unlinked once mapped
    assert block_bytes(pools) == 3 * 2 * 4 * 2 * 8 * 4 + 3 * 2 * 4 * 2 * 2
    before = [p.clone() for p in pools]
    tier.swap_out(pools, [(1, 4), (7, 0), (3, 5)])
    for p in pools:
        p.zero_()
    tier.swap_in(pools, [(4, 2), (0, 9), (5, 3)])
    for p, b in zip(pools, before, strict=True):
        assert torch.equal(p[:, :, 2], b[:, :, 1]) and torch.equal(p[:, :, 9], b[:, :, 7])
        assert torch.equal(p[:, :, 3], b[:, :, 3]) and not p[:, :, 0].any()


def test_host_tier_reserves_its_file_space_when_made(tmp_path):
    """The swap file's blocks are allocated when the tier is made, not at a first write, where a disk that filled up
    meanwhile would be a SIGBUS mid-step (issue 33, item 9): the free space drops by the tier's size; a tier the disk
    cannot hold is an error naming swap_space, and leaves no file."""
    pools = [torch.zeros(2, 4, 8, 16, 8, 64)]  # a block: 2 x 4 layers x 16 tokens x 8 heads x 64 x 4 bytes = 256 KiB
    before = shutil.disk_usage(tmp_path).free
    tier = HostKVTier(pools, 1024, str(tmp_path))
    assert tier.nbytes == 256 << 20
    assert before - shutil.disk_usage(tmp_path).free >= 0.9 * tier.nbytes
    del tier
    with pytest.raises(ValueError, match=r"swap_space: cannot reserve the host KV tier's .* GiB .* in .*; lower "
                                         r"--swap-space or point --swap-dir at a larger disk"):
        HostKVTier(pools, 1 << 32, str(tmp_path))  # 1 PiB
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("kw", "match"), [
    ({"preemption_mode": "evict"}, r"preemption_mode must be one of recompute, swap, auto, got 'evict'"),
    ({"swap_space": "lots"}, r"swap_space: cannot parse size 'lots'"),
    ({"swap_space": "0"}, r"swap_space must be positive"),
    ({"swap_dir": "/nonexistent/swap"}, r"swap_dir: '/nonexistent/swap' is not an existing directory"),
    ({"preemption_mode": "swap", "kv_cache_mode": "none"}, r"preemption_mode=swap needs kv_cache_mode=paged"),
])
def test_bad_settings_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="unused", **kw)


def test_a_tier_larger_than_the_disk_or_smaller_than_a_block_is_a_clear_error(setup, tmp_path):
    path = setup[0]
    with pytest.raises(ValueError, match=r"swap_space: the host KV tier needs .* GiB .*more than the .* GiB .*of "
                                         r"free disk space in .*lower --swap-space"):
        _engine(path, tmp_path, preemption_mode="swap", swap_space="1000TiB")
    with pytest.raises(ValueError, match=r"swap_space: 100 bytes cannot hold one KV block \(12288 bytes"):
        _engine(path, tmp_path, preemption_mode="auto", swap_space="100B")
    with pytest.raises(ValueError, match=r"more than the .* of available host memory; lower --swap-space"):
        check_capacity(1 << 60, True, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_serve_help_shows_the_flags():
    out = subprocess.run([sys.executable, "-m", "minivllm", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--preemption-mode", "--swap-space", "--swap-dir"):
        assert flag in out.stdout


def test_metrics_report_both_tiers_and_preemptions_by_mode():
    m = ServerMetrics("m")
    m.record(IterationStats(num_preemptions=5, num_swap_preemptions=3, kv_swap_out_bytes=4096,
                            kv_swap_in_bytes=1024),
             SchedulerSnapshot(1, 2, 0.5, num_swapped=2, cpu_cache_usage=0.25, num_swapped_blocks=7))
    got = {s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
           for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}
    assert got["minivllm:num_preemptions_total[]"] == 5
    assert got["minivllm:num_preemptions_by_mode_total[('mode', 'swap')]"] == 3
    assert got["minivllm:num_preemptions_by_mode_total[('mode', 'recompute')]"] == 2
    assert got["minivllm:kv_swap_out_bytes_total[]"] == 4096 and got["minivllm:kv_swap_in_bytes_total[]"] == 1024
    assert got["minivllm:kv_cache_usage_perc[]"] == 0.5 and got["minivllm:cpu_cache_usage_perc[]"] == 0.25
    assert got["minivllm:num_requests_swapped[]"] == 2 and got["minivllm:num_swapped_blocks[]"] == 7
