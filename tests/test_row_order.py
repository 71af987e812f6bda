"""The one-token float rows (f32, bf16) streamed row by row or several a pass (csrc/gemv_m1.h, model/row_order.py):
both orders compute the same linear, the faster one as timed at start-up is set, the choice is reused for the same
layers, and an engine's greedy output is the same either way."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from minivllm import LLM, SamplingParams
from minivllm.model import cpu_kernels, row_order
from minivllm.model.layers import Linear
from minivllm.model.quantization import QuantizedLinear, quantize_int4, quantize_int8, quantize_rows_int8
from minivllm.quant_config import QuantConfig

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native kernels did not build here")


@pytest.fixture(autouse=True)
def _restore_order():
    yield
    row_order.set_sequential(False)
    row_order.set_w4a8_seq_bytes(row_order.NEVER)
    row_order._KEPT.clear()  # (the next engine times afresh and sets its own)


def _threaded(g: cpu_kernels.GemvWeights, x: torch.Tensor, threads: int) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return g(x)
    finally:
        torch.set_num_threads(before)


def _one_token(g: cpu_kernels.GemvWeights, x: torch.Tensor, sequential: bool, threads: int) -> torch.Tensor:
    row_order.set_sequential(sequential)
    return _threaded(g, x, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(576, 1030), (100, 37), (31, 5), (1024, 8)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_both_row_orders_compute_the_same_linear(dtype, k, n, threads):
    """Row by row and several rows a pass: each equal to the float64 reference (of the weights as stored) within
    float32 rounding, N past whole passes (a tail), K past whole vectors; the two differ only in rounding (their
    sums run in other orders)."""
    torch.manual_seed(k + n)
    w, b, x = (torch.randn(n, k) * 0.05).to(dtype), torch.randn(n), torch.randn(1, k)
    g = cpu_kernels.GemvWeights.dense(w, k, b)
    expected = x.double() @ w.double().t() + b.double()
    tol = 2e-6 * expected.abs().max().item()
    outs = {seq: _one_token(g, x, seq, threads) for seq in (False, True)}
    for seq, got in outs.items():
        assert (got.double() - expected).abs().max().item() <= tol, seq
        assert torch.equal(got, _one_token(g, x, seq, threads))  # and a re-run exactly
    if k >= 64 and n >= 16:  # (rows of a pass summed with 2 accumulators each, row by row with 4: other bits)
        assert not torch.equal(outs[False], outs[True])


@pytest.mark.parametrize("k,n", [(576, 1030), (100, 37), (31, 5), (8192, 9)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rows_against_a_bf16_x_in_both_orders(k, n, threads):
    """A bfloat16 model's x (every float a bf16: AVX512-BF16's dot product where the CPU has it, csrc/gemv_bf16dot.h):
    within float32 rounding of the float64 reference both ways, K past whole 32-weight blocks (the tail masked)."""
    torch.manual_seed(k + n)
    w, b = (torch.randn(n, k) * 0.05).bfloat16(), torch.randn(n)
    x = torch.randn(1, k).bfloat16().float()
    g = cpu_kernels.GemvWeights.dense(w, k, b)
    expected = x.double() @ w.double().t() + b.double()
    for seq in (False, True):
        got = _one_token(g, x, seq, threads)
        assert (got.double() - expected).abs().max().item() <= 2e-6 * expected.abs().max().item(), seq


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_w8a8_rows_in_both_orders_equal_the_reference_and_each_other(threads):
    """W8A8 at one token (AVX-512 VNNI's rows four a pass or one by one; elsewhere the order changes nothing): the
    integer sums are exact, so both orders give the same bits, equal to the int8 reference."""
    k, n = 576, 1030
    torch.manual_seed(3)
    w, x = torch.randn(n, k) * 0.05, torch.randn(1, k)
    q, s = quantize_int8(w)
    g = cpu_kernels.GemvWeights("w8a8", q, k, s, None, 0)
    xq, xs = quantize_rows_int8(x)
    expected = (xq.double() * xs.double()[:, None]) @ (q.double() * s.double()[:, None]).t()
    outs = [_one_token(g, x, seq, threads) for seq in (False, True)]
    assert (outs[0].double() - expected).abs().max().item() <= 2e-6 * expected.abs().max().item()
    assert torch.equal(outs[0], outs[1])


def _layers(n: int = 3) -> list[Linear]:
    torch.manual_seed(0)
    layers = [Linear(256, 512, bias=False) for _ in range(n)]
    for q in layers:
        assert q.weight is not None
        torch.nn.init.normal_(q.weight, 0, 0.05)
    return layers


@pytest.mark.parametrize("faster", ["sequential", "interleaved", "tie"])
def test_the_faster_order_as_timed_is_set_and_kept_for_the_same_layers(monkeypatch, faster):
    """The rule: row by row where its best round beats the interleaved one's by the margin, else interleaved (a tie
    keeps the passes); the library's flag follows (seen in the output's bits); a second call on layers of the same
    shapes reuses the timings; bf16 layers are timed on their own; float16 ones choose nothing."""
    state = {"seq": False, "timed": 0}
    real_set = row_order.set_sequential

    def track(on: bool) -> None:
        state["seq"] = on
        real_set(on)

    cost = {"sequential": {True: 1.0, False: 2.0}, "interleaved": {True: 2.0, False: 1.0},
            "tie": {True: 0.99, False: 1.0}}[faster]

    def fake_best_time(fn, reps=3):
        fn()
        state["timed"] += 1
        return cost[bool(state["seq"])]

    monkeypatch.setattr(row_order, "set_sequential", track)
    monkeypatch.setattr(row_order, "best_time", fake_best_time)
    layers = _layers()
    chosen = row_order.choose_row_order(layers, torch.float32)
    assert chosen is not None and chosen.sequential == (faster == "sequential")
    assert (chosen.sequential_s, chosen.interleaved_s) == (cost[True], cost[False])
    assert state["timed"] == 2 * row_order.ROUNDS and state["seq"] == chosen.sequential
    g = layers[0].gemv_weights()
    x = torch.randn(1, 256)
    got = g(x)
    assert torch.equal(got, _one_token(g, x, chosen.sequential, torch.get_num_threads()))
    assert not torch.equal(got, _one_token(g, x, not chosen.sequential, torch.get_num_threads()))
    real_set(not chosen.sequential)
    state["timed"] = 0
    assert row_order.choose_row_order(_layers(), torch.float32) == chosen and state["timed"] == 0
    assert state["seq"] == chosen.sequential  # set again from the kept choice
    assert row_order.choose_row_order(_layers(), torch.float16) is None  # (no float16 rows natively)
    state["timed"] = 0
    assert row_order.choose_row_order([q.to(torch.bfloat16) for q in _layers()], torch.bfloat16) == chosen
    assert state["timed"] == 2 * row_order.ROUNDS  # bf16 layers: other layers, timed afresh


def _greedy_forced_each_way(path: str, monkeypatch, kwargs: dict, chosen) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The engine's greedy tokens with the start-up rule forced one way, then the other (each engine's choice
    checked by `chosen(llm, one_by_one)`): both the same."""
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for seq in (False, True):
        row_order._KEPT.clear()
        monkeypatch.setattr(row_order, "MARGIN", 1e9 if seq else 0.0)
        llm = LLM(path, num_kv_blocks=64, **kwargs)
        chosen(llm, seq)
        outs[seq] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert outs[False] == outs[True]
    return outs[True]


def test_an_engine_reports_its_order_and_greedy_output_does_not_depend_on_it(model_factory, monkeypatch):
    path = model_factory("tiny-llama")

    def check(llm, seq):  # type: ignore[no-untyped-def]
        assert llm.llm_engine.runner.row_order.sequential == seq

    _greedy_forced_each_way(path, monkeypatch, {"linear_backend": "native"}, check)
    # W8A8's per-channel rows are ordered by the same flag and timed; W4A8's follow a row length of their own
    # (choose_w4a8_rows, below), not this flag.
    w8a8 = LLM(path, num_kv_blocks=64, quantization="w8a8").llm_engine.runner.row_order
    assert (w8a8 is not None) == row_order.w8a8_ordered()  # (without AVX-512 VNNI the order changes nothing there)
    assert LLM(path, num_kv_blocks=64, quantization="w4a8").llm_engine.runner.row_order is None


def _w4a8_one_token(g: cpu_kernels.GemvWeights, x: torch.Tensor, seq_bytes: int, threads: int) -> torch.Tensor:
    row_order.set_w4a8_seq_bytes(seq_bytes)
    return _threaded(g, x, threads)


@pytest.mark.parametrize("k,n,sym", [(4096, 37, False), (2048, 1030, True), (100, 9, False), (576, 6, True)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_w4a8_rows_one_by_one_and_four_a_pass_give_the_same_bits(k, n, sym, threads):
    """W4A8 at one token, every row four a pass (NEVER), every row one by one (a length of 1 byte), and the length
    itself (rows of exactly that many bytes go one by one): the same bits each way (the same sums in the same
    order), equal to the reference of the stored weights against quantized x; N past whole passes of four."""
    torch.manual_seed(k + n)
    w, x = torch.randn(n, k) * 0.05, torch.randn(1, k)
    q, s, m = quantize_int4(w, 32, torch.float16 if sym else torch.bfloat16, sym)
    g = cpu_kernels.GemvWeights("w4a8", q, k, s, None if sym else m, 32, act_blocks=sym)
    layer = QuantizedLinear(k, n, False, QuantConfig("w4a8", 32, act_blocks=sym, scale_dtype="float16" if sym
                                                     else "bfloat16", min_dtype="none" if sym else ""))
    layer.quantize_from(w, None)
    expected = layer.forward_reference(x).double()
    kp = -(-k // 32) * 32
    outs = [_w4a8_one_token(g, x, b, threads) for b in (row_order.NEVER, 1, kp // 2, kp // 2 + 1)]
    assert (outs[0].double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # (the same bits either way: the library's own test says which order these rows took)
    for length, want in ((row_order.NEVER, False), (1, True), (kp // 2, True), (kp // 2 + 1, False)):
        row_order.set_w4a8_seq_bytes(length)
        assert row_order.one_by_one(kp // 2) == want, length


def _w4a8_layers(widths: tuple[int, ...]) -> list[QuantizedLinear]:
    torch.manual_seed(1)
    layers = []
    for k in widths:
        q = QuantizedLinear(k, 64, False, QuantConfig("w4a8", 32))
        q.quantize_from(torch.randn(64, k) * 0.05, None)
        layers.append(q)
    return layers


@pytest.mark.parametrize("wins,expected", [((True, True), 128), ((True, False), 512), ((False, True), None),
                                           ((False, False), None)])
def test_w4a8_rows_one_by_one_from_the_shortest_length_that_wins_at_every_longer_one(monkeypatch, wins, expected):
    """Lengths timed longest first (1024-wide rows: 512 bytes, then 256-wide: 128), stopping at the first where one
    by one does not win by the margin; the length set is the last that won (NEVER where the longest lost); the
    library follows (a call's bits are those of the order set); kept for the same layers; no W4A8 layer, no
    choice."""
    if not row_order.w4a8_ordered():
        pytest.skip("W4A8's one-token rows have one order here (no AVX-512 VNNI)")
    now = {"bytes": row_order.NEVER, "timed": []}
    real_set = row_order.set_w4a8_seq_bytes

    def track(n: int) -> None:
        now["bytes"] = n
        real_set(n)

    def fake_time_both(kernels, set_order):
        widths = {x.shape[1] for _, x in kernels}
        assert len(widths) == 1  # (one row length at a time)
        now["timed"].append(widths.pop())
        for kernel, x in kernels:
            kernel(x)
        return {True: 1.0, False: 2.0} if wins[len(now["timed"]) - 1] else {True: 1.0, False: 1.01}

    monkeypatch.setattr(row_order, "set_w4a8_seq_bytes", track)
    monkeypatch.setattr(row_order, "_time_both", fake_time_both)
    layers = [*_w4a8_layers((256, 1024)), *_layers(1)]  # (a float layer among them: not W4A8's)
    chosen = row_order.choose_w4a8_rows(layers)
    assert chosen is not None and chosen.seq_bytes == (row_order.NEVER if expected is None else expected)
    assert [t[0] for t in chosen.timings] == ([512, 128] if wins[0] else [512])  # (a tie within the margin: lost)
    assert now["timed"] == ([1024, 256] if wins[0] else [1024])
    assert now["bytes"] == chosen.seq_bytes and row_order.state()[1] == chosen.seq_bytes
    for length in (128, 512):  # rows of 128 and 512 bytes (256 and 1024 wide) as the kernel will read them
        assert row_order.one_by_one(length) == (expected is not None and length >= expected)
    now["timed"].clear()
    assert row_order.choose_w4a8_rows(_w4a8_layers((256, 1024))) == chosen and not now["timed"]
    assert row_order.choose_w4a8_rows(_layers()) is None


def test_a_w4a8_engine_times_its_rows_and_greedy_output_does_not_depend_on_them(model_factory, monkeypatch):
    path = model_factory("tiny-llama")
    if not row_order.w4a8_ordered():  # (no AVX-512 VNNI: the rows have one order, nothing is timed)
        assert LLM(path, num_kv_blocks=64, quantization="w4a8").llm_engine.runner.w4a8_rows is None
        return

    def check(llm, seq):  # type: ignore[no-untyped-def]
        chosen = llm.llm_engine.runner.w4a8_rows
        assert chosen is not None and (chosen.seq_bytes != row_order.NEVER) == seq

    _greedy_forced_each_way(path, monkeypatch, {"quantization": "w4a8"}, check)
    assert LLM(path, num_kv_blocks=64).llm_engine.runner.w4a8_rows is None  # (float layers: nothing to time)
