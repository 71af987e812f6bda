"""Float rows at a few tokens one by one (csrc/gemv_avx512.h's dense_row1_avx512, gemv_few_rows_k) rather than several
a pass: the same linear within float32 rounding, only at 2..4 tokens and rows no longer than the length set; the length
timed at start-up from the shortest row up (model/row_order.py's choose_few_rows); an engine's greedy output the same
whichever is set."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, with_threads

from minivllm import LLM, SamplingParams
from minivllm.model import cpu_kernels, row_order
from minivllm.model.layers import Linear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native kernels did not build here")


@pytest.fixture(autouse=True)
def _restore():
    yield
    row_order.restore(row_order.DEFAULT)
    row_order._KEPT.clear()


def _run(g: cpu_kernels.GemvWeights, x: torch.Tensor, few_k: int, threads: int) -> torch.Tensor:
    row_order.set_few_rows_k(few_k)
    return with_threads(lambda: g(x), threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(384, 1030), (100, 37), (31, 5), (1040, 24)])
@pytest.mark.parametrize("m", [2, 3, 4, 5])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_few_token_rows_one_by_one_compute_the_same_linear(dtype, k, n, m, threads):
    """One by one and in passes: each within float32 rounding of the float64 reference (of the weights as stored), K
    past whole 64- and 16-float blocks, N past whole passes; one by one only where set (2..4 tokens, K within the
    length), and then in another order of the sums (different bits), else the passes' bits exactly."""
    torch.manual_seed(k + n + m)
    w, b, x = (torch.randn(n, k) * 0.05).to(dtype), torch.randn(n), torch.randn(m, k)
    g = cpu_kernels.GemvWeights.dense(w, k, b)
    expected = x.double() @ w.double().t() + b.double()
    tol = 2e-6 * expected.abs().max().item()
    passes, one, shorter = _run(g, x, 0, threads), _run(g, x, k, threads), _run(g, x, k - 1, threads)
    for got in (passes, one):
        assert (got.double() - expected).abs().max().item() <= tol
    assert torch.equal(one, _run(g, x, k, threads))  # (a re-run exactly)
    assert torch.equal(shorter, passes)  # rows longer than the length set keep the passes
    if m > 4 or not row_order.few_rows_ordered():
        assert torch.equal(one, passes)
    elif k >= 64 and n >= 8:
        assert not torch.equal(one, passes)


def _layers(*ks: int) -> list[Linear]:
    torch.manual_seed(0)
    layers = [Linear(k, 512, bias=False) for k in ks]
    for q in layers:
        assert q.weight is not None
        torch.nn.init.normal_(q.weight, 0, 0.05)
    return layers


@pytest.mark.parametrize("wins,expected", [((True, True), 1024), ((True, False), 256), ((False,), 0)])
def test_the_longest_length_one_by_one_keeps_winning_is_set_and_kept(monkeypatch, wins, expected):
    """Shortest row length first, each against the length before; the first that does not beat it by the margin (a
    tie) ends the search; the library follows; the same layers reuse the choice; float16 chooses nothing."""
    if not row_order.few_rows_ordered():
        assert row_order.choose_few_rows(_layers(256, 1024), torch.float32) is None
        return
    timed: list[tuple[int, ...]] = []

    def fake_time_each(kernels, configs, set_config):  # type: ignore[no-untyped-def]
        assert sorted(x.shape for _, x in kernels) == [(row_order.FEW_TOKENS, 256), (row_order.FEW_TOKENS, 1024)]
        timed.append(tuple(configs))
        for c in configs:
            set_config(c)
            for kernel, x in kernels:
                kernel(x)
        current, trial = configs
        return {current: 2.0, trial: 1.0 if wins[len(timed) - 1] else 1.99}

    monkeypatch.setattr(row_order, "_time_each", fake_time_each)
    chosen = row_order.choose_few_rows(_layers(1024, 256), torch.float32)
    assert chosen is not None and chosen.k == expected == row_order.state()[4]
    assert timed == [(0, 256), (256, 1024)][:len(wins)]
    assert [k for k, _ in chosen.timings] == [0, 256, 1024][:len(wins) + 1]
    row_order.set_few_rows_k(0)
    timed.clear()
    assert row_order.choose_few_rows(_layers(1024, 256), torch.float32) == chosen and not timed
    assert row_order.state()[4] == expected  # (set again from the kept choice)
    assert row_order.choose_few_rows(_layers(256), torch.float16) is None


def test_an_engine_times_its_few_token_rows_and_greedy_output_does_not_depend_on_them(model_factory, monkeypatch):
    """The tiny model's engine with the timing finding one by one faster at every length, then never: the length its
    runner reports is the library's, and the greedy tokens (n-gram speculation verifying 2-4 rows a step) are the
    same."""
    path = model_factory("tiny-llama")
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for one in (True, False):
        def fake_time_each(kernels, configs, set_config, one=one):  # type: ignore[no-untyped-def]
            return {c: 1.0 if (c == max(configs)) == one else 2.0 for c in configs}

        monkeypatch.setattr(row_order, "_time_each", fake_time_each)
        row_order._KEPT.clear()
        llm = LLM(path, num_kv_blocks=64, linear_backend="native", speculative_model="ngram",
                  num_speculative_tokens=3, speculative_adaptive=False)
        chosen = llm.llm_engine.runner.few_rows
        if not row_order.few_rows_ordered():
            assert chosen is None
            return
        assert chosen is not None and chosen.k == row_order.state()[4] and (chosen.k > 0) == one
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)])
    assert outs[0] == outs[1]
