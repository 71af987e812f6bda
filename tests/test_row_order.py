"""The one-token rows (f32, bf16, W8A8; W4A8's own) streamed in passes, row by row or in pairs (csrc/gemv_m1.h,
csrc/gemv_w4a8.c, model/row_order.py): every order computes the same linear, the fastest as timed at start-up is set,
the choice is reused for the same layers, and an engine's greedy output is the same whichever is set."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import PROMPTS, int4_native_x, with_threads

from minivllm import LLM, SamplingParams
from minivllm.model import cpu_kernels, row_order, timed_layers
from minivllm.model.layers import Linear
from minivllm.model.quantization import QuantizedLinear, quantize_int4, quantize_int8, quantize_rows_int8
from minivllm.quant_config import QuantConfig

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="native kernels did not build here")
NEVER = row_order.NEVER


@pytest.fixture(autouse=True)
def _restore_order():
    yield
    row_order.restore(row_order.DEFAULT)
    row_order._KEPT.clear()  # (the next engine times afresh and sets its own)


def _threaded(g: cpu_kernels.GemvWeights, x: torch.Tensor, threads: int) -> torch.Tensor:
    return with_threads(lambda: g(x), threads)


def _one_token(g: cpu_kernels.GemvWeights, x: torch.Tensor, order: int, threads: int) -> torch.Tensor:
    row_order.set_order(order)
    return _threaded(g, x, threads)


def _library_order() -> int:
    lib = cpu_kernels.load_library()
    assert lib is not None
    return int(lib.gemv_m1_order_now())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(576, 1030), (100, 37), (31, 5), (1024, 8)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_row_order_computes_the_same_linear(dtype, k, n, threads):
    """Passes, row by row and pairs: each equal to the float64 reference (of the weights as stored) within float32
    rounding, N past whole passes (a tail), K past whole vectors. Pairs sum each row as the passes do (two
    accumulators a row): the same bits; row by row (four) differs only in rounding."""
    torch.manual_seed(k + n)
    w, b, x = (torch.randn(n, k) * 0.05).to(dtype), torch.randn(n), torch.randn(1, k)
    g = cpu_kernels.GemvWeights.dense(w, k, b)
    expected = x.double() @ w.double().t() + b.double()
    tol = 2e-6 * expected.abs().max().item()
    outs = {order: _one_token(g, x, order, threads) for order in row_order.ORDERS}
    for order, got in outs.items():
        assert (got.double() - expected).abs().max().item() <= tol, order
        assert torch.equal(got, _one_token(g, x, order, threads))  # and a re-run exactly
    assert torch.equal(outs[row_order.PASS], outs[row_order.PAIRS])
    if k >= 64 and n >= 16:
        assert not torch.equal(outs[row_order.PASS], outs[row_order.ONE])


@pytest.mark.parametrize("k,n", [(576, 1030), (100, 37), (31, 5), (8192, 9)])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rows_against_a_bf16_x_in_every_order(k, n, threads):
    """A bfloat16 model's x (every float a bf16: AVX512-BF16's dot product where the CPU has it, csrc/gemv_bf16dot.h):
    within float32 rounding of the float64 reference every way, K past whole 32-weight blocks (the tail masked);
    pairs give the passes' bits."""
    torch.manual_seed(k + n)
    w, b = (torch.randn(n, k) * 0.05).bfloat16(), torch.randn(n)
    x = torch.randn(1, k).bfloat16().float()
    g = cpu_kernels.GemvWeights.dense(w, k, b)
    expected = x.double() @ w.double().t() + b.double()
    outs = {order: _one_token(g, x, order, threads) for order in row_order.ORDERS}
    for order, got in outs.items():
        assert (got.double() - expected).abs().max().item() <= 2e-6 * expected.abs().max().item(), order
    assert torch.equal(outs[row_order.PASS], outs[row_order.PAIRS])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_w8a8_rows_in_every_order_equal_the_reference_and_each_other(threads):
    """W8A8 at one token (AVX-512 VNNI's rows four or two a pass or one by one; elsewhere the order changes nothing):
    the integer sums are exact, so every order gives the same bits, equal to the int8 reference; N = 1030 leaves
    each thread's share a tail past whole passes."""
    k, n = 576, 1030
    torch.manual_seed(3)
    w, x = torch.randn(n, k) * 0.05, torch.randn(1, k)
    q, s = quantize_int8(w)
    g = cpu_kernels.GemvWeights("w8a8", q, k, s, None, 0)
    xq, xs = quantize_rows_int8(x)
    expected = (xq.double() * xs.double()[:, None]) @ (q.double() * s.double()[:, None]).t()
    outs = [_one_token(g, x, order, threads) for order in row_order.ORDERS]
    assert (outs[0].double() - expected).abs().max().item() <= 2e-6 * expected.abs().max().item()
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def _gguf_block_layers(k: int, n: int) -> list[torch.nn.Module]:
    """GGUF's Q4_K and Q6_K superblocks and Q8_0 blocks against x in blocks of 32 (the files' default math)."""
    from test_superblocks import _rows

    from minivllm.model.q4k_linear import Q4KLinear
    from minivllm.model.q6k_linear import Q6KLinear

    q8 = QuantizedLinear(k, n, True, QuantConfig("w8a8", int8_blocks=True, act_blocks=True))
    q8.quantize_from(torch.randn(n, k) * 0.05, torch.randn(n))
    layers: list[torch.nn.Module] = [q8]
    if k % 256 == 0:
        layers += [cls.from_blocks(_rows(cls, n, k, k + n), k, True) for cls in (Q4KLinear, Q6KLinear)]
    return layers


@pytest.mark.parametrize("k,n", [(800, 37), (512, 301), (1024, 2)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gguf_block_rows_in_pairs_give_the_bits_of_one_by_one(k, n, threads):
    """Q8_0, Q4_K and Q6_K rows at one token against x in blocks (AVX-512 VNNI's rows; elsewhere one order): two a
    pass in pairs, one by one otherwise, the same sums for each row (the same bits), equal to the float64 reference
    of the weights as stored; N odd leaves a last row alone, K = 800 a Q8_0 row's last superblock partial."""
    torch.manual_seed(k + n)
    x = torch.randn(1, k) * torch.linspace(0.1, 3.0, k)
    for layer in _gguf_block_layers(k, n):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs = {}
            for order in row_order.ORDERS:
                row_order.set_order(order)
                outs[order] = layer.forward_native(x)
            ref = layer.forward_reference(x).double()
        finally:
            torch.set_num_threads(before)
        assert (outs[row_order.PAIRS].double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item(), layer
        assert all(torch.equal(outs[row_order.ONE], o) for o in outs.values()), layer


def _layers(n: int = 3) -> list[Linear]:
    torch.manual_seed(0)
    layers = [Linear(256, 512, bias=False) for _ in range(n)]
    for q in layers:
        assert q.weight is not None
        torch.nn.init.normal_(q.weight, 0, 0.05)
    return layers


@pytest.mark.parametrize("faster", ["passes", "one", "pairs", "tie"])
def test_the_fastest_order_as_timed_is_set_and_kept_for_the_same_layers(monkeypatch, faster):
    """The rule: the fastest order where its best round beats the passes' by the margin, else the passes (a tie keeps
    them); the library's order follows; a second call on layers of the same shapes reuses the timings; bf16 layers
    are timed on their own; float16 ones choose nothing."""
    state = {"order": row_order.PASS, "timed": 0}
    real_set = row_order.set_order

    def track(order: int) -> None:
        state["order"] = order
        real_set(order)

    p, one, pairs = row_order.PASS, row_order.ONE, row_order.PAIRS
    cost = {"passes": {p: 1.0, one: 2.0, pairs: 1.5}, "one": {p: 2.0, one: 1.0, pairs: 1.5},
            "pairs": {p: 2.0, one: 1.5, pairs: 1.0}, "tie": {p: 1.0, one: 0.99, pairs: 0.985}}[faster]
    want = {"passes": p, "one": one, "pairs": pairs, "tie": p}[faster]

    def fake_best_time(fn, reps=3):
        fn()
        state["timed"] += 1
        return cost[state["order"]]  # (every prefetch distance alike: none is kept)

    monkeypatch.setattr(row_order, "set_order", track)
    monkeypatch.setattr(row_order, "best_time", fake_best_time)
    layers = _layers()
    chosen = row_order.choose_row_order(layers, torch.float32)
    assert chosen is not None and chosen.order == want
    assert chosen.timings == tuple(((o, b), cost[o]) for o in row_order.ORDERS for b in row_order.PREFETCH_BYTES)
    timings = 3 * len(row_order.PREFETCH_BYTES) * row_order.ROUNDS  # each order at each distance
    assert state["timed"] == timings and state["order"] == want == _library_order()
    assert chosen.prefetch == 0
    g = layers[0].gemv_weights()
    x = torch.randn(1, 256)
    assert torch.equal(g(x), _one_token(g, x, want, torch.get_num_threads()))
    real_set(row_order.ONE if want != row_order.ONE else row_order.PASS)
    state["timed"] = 0
    assert row_order.choose_row_order(_layers(), torch.float32) == chosen and state["timed"] == 0
    assert state["order"] == want == _library_order()  # set again from the kept choice
    assert row_order.choose_row_order(_layers(), torch.float16) is None  # (no float16 rows natively)
    state["timed"] = 0
    assert row_order.choose_row_order([q.to(torch.bfloat16) for q in _layers()], torch.bfloat16) == chosen
    assert state["timed"] == timings  # bf16 layers: other layers, timed afresh


def _w8a8_gemv(k: int, n: int) -> cpu_kernels.GemvWeights:
    q, s = quantize_int8(torch.randn(n, k) * 0.05)
    return cpu_kernels.GemvWeights("w8a8", q, k, s, None, 0)


@pytest.mark.parametrize("kind", ["f32", "bf16", "bf16 x", "w8a8"])
@pytest.mark.parametrize("k,n", [(576, 1030), (100, 37), (2048, 9)])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_prefetch_distance_gives_the_bits_of_none_in_every_order(kind, k, n, threads):
    """The one-token float rows (f32; bf16 against a float x and against a bf16 x, the dot-product rows) and W8A8's
    rows with each line some bytes ahead on its way to L2 (a prefetch past a row's or the matrix's end included):
    the same bits as without, in every order."""
    torch.manual_seed(k + n)
    x = torch.randn(1, k)
    if kind == "w8a8":
        g = _w8a8_gemv(k, n)
    else:
        w = torch.randn(n, k) * 0.05
        g = cpu_kernels.GemvWeights.dense(w if kind == "f32" else w.bfloat16(), k, torch.randn(n))
        if kind == "bf16 x":
            x = x.bfloat16().float()
    for order in row_order.ORDERS:
        outs = {}
        for ahead in (0, 64, *row_order.PREFETCH_BYTES[1:], 1 << 20):
            row_order.set_prefetch(ahead)
            outs[ahead] = _one_token(g, x, order, threads)
        assert all(torch.equal(outs[0], o) for o in outs.values()), order


@pytest.mark.parametrize("winner", [0, 4096, 8192, "tie", "one ahead"])
def test_a_prefetch_is_kept_where_it_beats_none_by_the_margin(monkeypatch, winner):
    """Each order is timed at each of PREFETCH_BYTES: the fastest pair kept where it beats the passes without a
    prefetch by MARGIN, else the passes without one (a tie); an order slowest without a prefetch and fastest with one
    is found (timed one after the other, the order first, it was not: a 1B bf16 model kept the passes 1.13x slower);
    the library and state() follow, the choice is kept for the same layers and set again from it; a draft's restore()
    puts every setting back."""
    now = {"ahead": 0}
    real = row_order.set_prefetch

    def track(nbytes: int) -> None:
        now["ahead"] = nbytes
        real(nbytes)

    without = {row_order.PASS: 2.0, row_order.ONE: 3.0, row_order.PAIRS: 1.5}

    def seconds(order: int, ahead: int) -> float:
        if winner == "one ahead":
            return 1.0 if order == row_order.ONE and ahead else without[order]
        if winner == "tie":
            return 1.99 if order == row_order.PASS and ahead else without[order] if ahead == 0 else 2.5
        return (1.0 if ahead == winner else 1.4) if order == row_order.PAIRS else without[order]

    def fake_time_each(kernels, configs, set_config):  # type: ignore[no-untyped-def]
        for c in configs:
            set_config(c)
        return {c: seconds(*c) for c in configs}

    monkeypatch.setattr(row_order, "set_prefetch", track)
    monkeypatch.setattr(row_order, "_time_each", fake_time_each)
    chosen = row_order.choose_row_order(_layers(), torch.float32)
    want = {"tie": 0, "one ahead": row_order.PREFETCH_BYTES[1]}.get(str(winner), winner)
    order = {"tie": row_order.PAIRS, "one ahead": row_order.ONE}.get(str(winner), row_order.PAIRS)
    assert chosen is not None and (chosen.order, chosen.prefetch) == (order, want)
    assert len(chosen.timings) == len(row_order.ORDERS) * len(row_order.PREFETCH_BYTES)
    assert now["ahead"] == want and row_order.state()[2] == want
    saved = row_order.state()
    real(12345)
    assert row_order.choose_row_order(_layers(), torch.float32) == chosen and now["ahead"] == want  # (kept)
    real(777)
    row_order.restore(saved)
    assert row_order.state() == saved


def test_the_timing_reads_past_the_last_level_cache_in_the_models_order(monkeypatch):
    """The layers timed: the first ones until they hold TIMED_WEIGHTS weights and TIMED_LLC times the last-level
    cache's bytes (on a 480 MiB L3 the first 64M weights of a W4A8 model, 32 MB, ran from the cache); all of a
    smaller model; bytes as stored (float weights by their dtype, quantized ones' codes and scales)."""
    real_llc = timed_layers.llc_bytes()  # (sysfs's: 0 where it names no cache)
    assert real_llc >= 0 and (real_llc > 0 or not os.path.isdir("/sys/devices/system/cpu/cpu0/cache/index0"))
    layers = [Linear(256, 512, bias=False) for _ in range(6)]  # 512 KiB of float32 each
    monkeypatch.setattr(timed_layers, "TIMED_WEIGHTS", 1)
    for llc, n in ((0, 1), (256 << 10, 1), (512 << 10, 2), (1 << 20, 4), (1 << 30, 6)):
        monkeypatch.setattr(timed_layers, "llc_bytes", lambda llc=llc: llc)
        assert timed_layers.timed_layers(layers) == layers[:n], llc
    assert timed_layers.weight_bytes(layers[0]) == 512 << 10
    assert timed_layers.weight_bytes(layers[0].to(torch.bfloat16)) == 256 << 10
    q = QuantizedLinear(256, 64, True, QuantConfig("w4a8", 32))
    q.quantize_from(torch.randn(64, 256), torch.randn(64))
    assert timed_layers.weight_bytes(q) == 64 * 128 + 2 * (64 * 8 * 2)  # codes, bf16 scales and mins (no bias)


def _forced(monkeypatch, winner) -> None:  # type: ignore[no-untyped-def]
    """Every start-up timing finds `winner` fastest (1 s against 2 s for any other configuration)."""

    def fake(kernels, configs, set_config):  # type: ignore[no-untyped-def]
        return {c: 1.0 if c == winner else 2.0 for c in configs}

    row_order._KEPT.clear()
    monkeypatch.setattr(row_order, "_time_each", fake)


def _greedy_forced_each_way(path: str, monkeypatch, kwargs: dict, winners, chosen) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """The engine's greedy tokens with the start-up timing finding each of `winners` fastest in turn (each engine's
    choice checked by `chosen(llm, winner)`): all the same."""
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = []
    for winner in winners:
        _forced(monkeypatch, winner)
        llm = LLM(path, num_kv_blocks=64, **kwargs)
        chosen(llm, winner)
        outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)])
    assert all(o == outs[0] for o in outs[1:])
    return outs[0]


def test_an_engine_reports_its_order_and_greedy_output_does_not_depend_on_it(model_factory, monkeypatch):
    path = model_factory("tiny-llama")

    def check(llm, config):  # type: ignore[no-untyped-def]
        chosen = llm.llm_engine.runner.row_order
        assert (chosen.order, chosen.prefetch) == config and config[0] == _library_order()
        assert row_order.state()[2] == config[1]

    configs = list(zip(row_order.ORDERS, row_order.PREFETCH_BYTES, strict=True))  # each order, a distance each
    _greedy_forced_each_way(path, monkeypatch, {"linear_backend": "native"}, configs, check)
    # W8A8's per-channel rows are ordered by the same setting and timed; W4A8's follow a choice of their own
    # (choose_w4a8_rows, below), not this one.
    row_order._KEPT.clear()
    monkeypatch.undo()
    w8a8 = LLM(path, num_kv_blocks=64, quantization="w8a8").llm_engine.runner.row_order
    assert (w8a8 is not None) == row_order.w8a8_ordered()  # (without AVX-512 VNNI the order changes nothing there)
    assert LLM(path, num_kv_blocks=64, quantization="w4a8").llm_engine.runner.row_order is None


def _w4a8_one_token(g: cpu_kernels.GemvWeights, x: torch.Tensor, config: tuple[int, int], threads: int) -> torch.Tensor:
    row_order.set_w4a8_rows(*config)
    return _threaded(g, x, threads)


@pytest.mark.parametrize("k,n,sym", [(4096, 37, False), (2048, 1030, True), (100, 9, False), (576, 6, True)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_w4a8_rows_in_passes_of_four_or_two_and_one_by_one_give_the_same_bits(k, n, sym, threads):
    """W4A8 at one token, every row four or two a pass (NEVER), every row one by one (a length of 1 byte), and the
    length itself (rows of exactly that many bytes go one by one): the same bits each way (the same sums in the same
    order), equal to the reference of the stored weights against quantized x; N past whole passes."""
    torch.manual_seed(k + n)
    w, x = torch.randn(n, k) * 0.05, torch.randn(1, k)
    q, s, m = quantize_int4(w, 32, torch.float16 if sym else torch.bfloat16, sym)
    g = cpu_kernels.GemvWeights("w4a8", q, k, s, None if sym else m, 32, act_blocks=sym)
    layer = QuantizedLinear(k, n, False, QuantConfig("w4a8", 32, act_blocks=sym, scale_dtype="float16" if sym
                                                     else "bfloat16", min_dtype="none" if sym else ""))
    layer.quantize_from(w, None)
    expected = layer.forward_reference(x).double()
    kp = -(-k // 32) * 32
    configs = [(r, b) for r in (4, 2) for b in (NEVER, 1, kp // 2, kp // 2 + 1)]
    outs = [_w4a8_one_token(g, x, c, threads) for c in configs]
    row_order.set_w4a8_prefetch_l2(True)  # (the passes' prefetch into L2 rather than L1: the same bits)
    outs += [_w4a8_one_token(g, x, c, threads) for c in configs]
    row_order.set_w4a8_prefetch_l2(False)
    assert (outs[0].double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # (the same bits either way: the library's own test says which order these rows took)
    for length, want in ((NEVER, False), (1, True), (kp // 2, True), (kp // 2 + 1, False)):
        row_order.set_w4a8_rows(2, length)
        assert row_order.one_by_one(kp // 2) == want, length


def _w4a8_layers(widths: tuple[int, ...]) -> list[QuantizedLinear]:
    torch.manual_seed(1)
    layers = []
    for k in widths:
        q = QuantizedLinear(k, 64, False, QuantConfig("w4a8", 32))
        q.quantize_from(torch.randn(64, k) * 0.05, None)
        layers.append(q)
    return layers


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("pairs", [False, True])
@pytest.mark.parametrize("wins,expected", [((True, True), 128), ((True, False), 512), ((False, True), None),
                                           ((False, False), None)])
def test_w4a8_rows_two_or_four_a_pass_then_one_by_one_from_the_shortest_length_that_wins(monkeypatch, l2, pairs, wins,
                                                                                         expected):
    """First four against two rows a pass (two where they win by the margin), then one by one from each row length,
    longest first (1024-wide rows: 512 bytes, then 256-wide: 128), stopping at the first that does not win by the
    margin; every configuration timed over all the W4A8 layers; the length set is the last that won (NEVER where
    the longest lost); then the passes' prefetch into L1 against L2 in that configuration (L2 where it wins by the
    margin); the library follows; kept for the same layers; no W4A8 layer, no choice."""
    if not row_order.w4a8_ordered():
        pytest.skip("W4A8's one-token rows have one order here (neither AVX-512 VNNI nor AVX2)")
    now = {"config": (4, NEVER), "timed": []}
    real_set = row_order.set_w4a8_rows

    def track(r: int, b: int) -> None:
        now["config"] = (r, b)
        real_set(r, b)

    def fake_time_each(kernels, configs, set_config):  # type: ignore[no-untyped-def]
        assert sorted(x.shape[1] for _, x in kernels) == [256, 1024]  # (all the W4A8 layers each time)
        now["timed"].append(tuple(configs))
        for c in configs:
            set_config(c)
            for kernel, x in kernels:
                kernel(x)
        if configs == (False, True):  # (the prefetch's level, last)
            return {False: 2.0, True: 1.0 if l2 else 1.99}
        if len(now["timed"]) == 1:
            return {(4, NEVER): 2.0, (2, NEVER): 1.0 if pairs else 1.99}
        win = wins[len(now["timed"]) - 2]
        current, trial = configs
        return {current: 2.0, trial: 1.0 if win else 1.99}

    monkeypatch.setattr(row_order, "set_w4a8_rows", track)
    monkeypatch.setattr(row_order, "_time_each", fake_time_each)
    layers = [*_w4a8_layers((256, 1024)), *_layers(1)]  # (a float layer among them: not W4A8's)
    chosen = row_order.choose_w4a8_rows(layers)
    rows = 2 if pairs else 4
    assert chosen is not None
    assert (chosen.pass_rows, chosen.seq_bytes) == (rows, NEVER if expected is None else expected)
    trials = [(rows, 512), (rows, 128)] if wins[0] else [(rows, 512)]
    assert [c for c, _ in chosen.timings] == [(4, NEVER), (2, NEVER), *trials]  # (a tie within the margin: lost)
    assert len(now["timed"]) == 1 + len(trials) + 1 and now["timed"][-1] == (False, True)
    assert chosen.l2 == l2 == row_order.state()[3] and len(chosen.l2_seconds) == 2
    assert now["config"] == (chosen.pass_rows, chosen.seq_bytes) and row_order.state()[1] == now["config"]
    for length in (128, 512):  # rows of 128 and 512 bytes (256 and 1024 wide) as the kernel will read them
        assert row_order.one_by_one(length) == (expected is not None and length >= expected)
    now["timed"].clear()
    assert row_order.choose_w4a8_rows(_w4a8_layers((256, 1024))) == chosen and not now["timed"]
    assert row_order.choose_w4a8_rows(_layers()) is None


def test_a_w4a8_engine_times_its_rows_and_greedy_output_does_not_depend_on_them(model_factory, monkeypatch):
    path = model_factory("tiny-llama")
    if not row_order.w4a8_ordered():  # (neither AVX-512 VNNI nor AVX2: one order, nothing timed)
        assert LLM(path, num_kv_blocks=64, quantization="w4a8").llm_engine.runner.w4a8_rows is None
        return

    def check(llm, winner):  # type: ignore[no-untyped-def]
        chosen = llm.llm_engine.runner.w4a8_rows
        assert chosen is not None and (chosen.pass_rows, chosen.seq_bytes) == row_order.state()[1]
        assert chosen.pass_rows == winner[0] and (chosen.seq_bytes != NEVER) == (winner[1] != NEVER)

    _greedy_forced_each_way(path, monkeypatch, {"quantization": "w4a8"}, [(4, NEVER), (2, NEVER)], check)
    # one by one: every length wins against the passes
    def one(kernels, configs, set_config):  # type: ignore[no-untyped-def]
        return {c: 1.0 if isinstance(c, tuple) and c[1] != NEVER else 2.0 for c in configs}

    row_order._KEPT.clear()
    monkeypatch.setattr(row_order, "_time_each", one)
    llm = LLM(path, num_kv_blocks=64, quantization="w4a8")
    check(llm, (4, 0))
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    forced = _greedy_forced_each_way(path, monkeypatch, {"quantization": "w4a8"}, [(4, NEVER)], check)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == forced
    assert LLM(path, num_kv_blocks=64).llm_engine.runner.w4a8_rows is None  # (float layers: nothing to time)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 3])
def test_int4_rows_that_follow_w4a8s_order_give_the_same_bits_every_way(dtype, threads):
    """int4's one-token rows against a bfloat16 model's x (AVX512-BF16's dot product, csrc/gemv_int4_bf16dot.h) or x
    as int16 (a float32 model's by AVX512-VNNI's vpdpwssd, csrc/gemv_int4_int16dot.h; any by AVX2's vpmaddwd,
    csrc/gemv_avx2.h) go four or two a pass or one by one as W4A8's choice says: every way the same bits, within
    float32 rounding of the float64 reference of the x they take (conftest.int4_native_x), N = 1030 leaving tails past
    whole passes, K = 1000 zero-padded to whole groups; so the start-up timing times them in such a model, and not
    where the CPU has none of these (AVX-512 without VNNI: the float rows, read one row at a time)."""
    torch.manual_seed(5)
    k, n = 1000, 1030
    q = QuantizedLinear(k, n, True, QuantConfig("int4", 32))
    q.quantize_from(torch.randn(n, k) * 0.05, torch.randn(n))
    ordered = row_order.int4_bf16dot() if dtype == torch.bfloat16 else False
    ordered = ordered or row_order.int4_int16_ordered()
    if not ordered:
        assert row_order.choose_w4a8_rows([q], dtype) is None
        pytest.skip(f"no ordered int4 rows here (AVX-512 without VNNI): a {dtype} x takes them one at a time")
    x = torch.randn(1, k).to(dtype).float()
    expected = int4_native_x(x) @ q.dequantize().double().t() + q.bias.double()
    outs = []
    for rows, seq_bytes, l2 in [(4, NEVER, False), (2, NEVER, True), (4, 1, False), (2, 4096, False)]:
        row_order.set_w4a8_rows(rows, seq_bytes)
        row_order.set_w4a8_prefetch_l2(l2)
        outs.append(with_threads(lambda: q.forward_native(x), threads))
        assert (outs[-1].double() - expected).abs().max().item() <= 2e-6 * expected.abs().max().item()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert row_order.choose_w4a8_rows([q], dtype) is not None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_int4_engine_times_w4a8s_order_where_its_rows_follow_it_and_greedy_output_does_not_depend_on_it(
        model_factory, monkeypatch, dtype):
    path = model_factory("tiny-llama")
    # (native kernels at every shape: the plan's timing would pick bf16 rounding of its own per engine)
    kwargs = {"quantization": "int4", "dtype": dtype, "quantization_kernel": "native"}
    if not ((dtype == "bfloat16" and row_order.int4_bf16dot()) or row_order.int4_int16_ordered()):
        assert LLM(path, num_kv_blocks=64, **kwargs).llm_engine.runner.w4a8_rows is None
        return

    def check(llm, winner):  # type: ignore[no-untyped-def]
        chosen = llm.llm_engine.runner.w4a8_rows
        assert chosen is not None and (chosen.pass_rows, chosen.seq_bytes) == row_order.state()[1]
        assert chosen.pass_rows == winner[0]

    _greedy_forced_each_way(path, monkeypatch, kwargs, [(4, NEVER), (2, NEVER)], check)
