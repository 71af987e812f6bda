"""Activation blocks: x quantized per 32-weight block, each block its own scale (llama.cpp's Q8_0 activations, what
its Q4_0 / Q4_1 / Q8_0 dot products multiply), as GGUF files' int4 groups and int8 blocks run with int8 x."""

import ctypes

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels
from minivllm.model.quantization import QuantizedLinear, quantize_blocks_int8, quantize_rows_int8
from minivllm.quant_config import QuantConfig

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels on this machine")


def _blocks_reference(x: torch.Tensor) -> torch.Tensor:
    """x's 32-wide blocks quantized independently of quantize_blocks_int8: the scale and the division in float32 (as
    the kernels compute them, so ties round alike), the codes times their scale in float64."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    out = torch.zeros(m, kp, dtype=torch.float64)
    xp = F.pad(x, (0, kp - k))
    for b in range(kp // 32):
        blk = xp[:, 32 * b:32 * b + 32]
        amax = blk.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        out[:, 32 * b:32 * b + 32] = torch.round(blk / s).double() * s.double()
    return out[:, :k]


def _layer(method: str, k: int, n: int, scale_dtype: str, min_dtype: str) -> QuantizedLinear:
    torch.manual_seed(k + n)
    q = QuantizedLinear(k, n, True, QuantConfig(method, 32, scale_dtype=scale_dtype, min_dtype=min_dtype,
                                                act_blocks=True))
    q.quantize_from(torch.randn(n, k) * 0.05, torch.randn(n))
    return q


@pytest.mark.parametrize("k", [100, 800, 1568, 2048])  # a partial block; superblocks and 1-3 chunks over; whole ones
@pytest.mark.parametrize("m", [1, 3, 5, 12, 20])  # (one token: four rows a pass; AVX2: 8 tokens a pass; > 16: twice)
@pytest.mark.parametrize("scale_dtype,min_dtype", [("bfloat16", ""), ("float16", "float32"), ("float16", "none")])
def test_w4a8_with_activation_blocks_equals_its_reference(k, m, scale_dtype, min_dtype):
    """Every kernel of a W4A8 layer with activation blocks (and of an int4 one's activation-quantized path for long
    steps) computes x's blocks each at its own scale against the stored int4 groups, in float64 within float32
    rounding; x has an outlier in its first block, so one row-wide scale would miss by far."""
    for method in ("w4a8", "int4"):
        q = _layer(method, k, 67, scale_dtype, min_dtype)
        assert q.act_blocks and "x in blocks of 32" in q.extra_repr()
        torch.manual_seed(m)
        x = torch.randn(m, k)
        x[:, 1] *= 60
        expected = _blocks_reference(x) @ q.dequantize().double().t() + q.bias.double()
        names = ["native", "reference"] if method == "w4a8" else ["native_a8"]
        for name in names:
            got = q.candidates()[name](x).double()
            assert (got - expected).abs().max().item() <= 2e-6 * expected.abs().max().item(), (method, name)
        if method == "w4a8" and k >= 800:  # one scale for the whole row: another, coarser computation
            xq, xs = quantize_rows_int8(x)
            rows = (xq.double() * xs.double()[:, None]) @ q.dequantize().double().t() + q.bias.double()
            exact = x.double() @ q.dequantize().double().t() + q.bias.double()
            assert (rows - exact).abs().max() > 3 * (expected - exact).abs().max()


@pytest.mark.parametrize("k", [100, 800, 1568])  # a partial block; a superblock and a partial one
@pytest.mark.parametrize("m", [1, 3, 5, 20])
def test_int8_blocks_with_activation_blocks_equal_their_reference(k, m):
    """GGUF's Q8_0 blocks against x in blocks of 32 (llama.cpp's Q8_0 x Q8_0 dot product): W8A8's native kernel and
    reference, and an int8-block layer's activation-quantized path, within float32 rounding of float64."""
    for method in ("w8a8", "int8"):
        torch.manual_seed(k + m)
        q = QuantizedLinear(k, 67, True, QuantConfig(method, 32, int8_blocks=True, act_blocks=True))
        q.quantize_from(torch.randn(67, k) * 0.05, torch.randn(67))
        assert "blocks of 32, x in blocks of 32" in q.extra_repr()
        x = torch.randn(m, k)
        x[:, 1] *= 60
        expected = _blocks_reference(x) @ q.dequantize().double().t() + q.bias.double()
        for name in (["native", "reference"] if method == "w8a8" else ["native_a8"]):
            got = q.candidates()[name](x).double()
            assert (got - expected).abs().max().item() <= 2e-6 * expected.abs().max().item(), (method, name)


def test_quantize_blocks_int8_scales_each_block_on_its_own():
    x = torch.tensor([[0.5, -1.0] + [0.0] * 30 + [100.0, 3.0] + [0.0] * 4])  # a block, then a partial one
    y = quantize_blocks_int8(x)
    assert y.shape == x.shape
    assert torch.allclose(y[0, :2], torch.tensor([round(0.5 * 127) / 127, -1.0]), atol=1e-7)
    assert y[0, 32].item() == 100.0 and abs(y[0, 33].item() - round(3 * 1.27) / 1.27) < 1e-5
    assert torch.equal(y[0, 2:32], torch.zeros(30))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chosen_experts_in_one_region_with_activation_blocks_equal_them_one_by_one(threads):
    """linear_gemv_m1_many (a mixture's chosen experts at one token) stages x's block scales once for the shared x
    or once per x: each projection's output bit-equal to its own call."""
    lib = cpu_kernels.load_library()
    assert lib is not None
    kin, n = 200, 1030
    layers = [_layer("w4a8", kin, n, "float16", "none") for _ in range(3)]
    gs = [q.gemv_weights() for q in layers]
    assert all(g.fmt & cpu_kernels._ACT_BLOCKS for g in gs)
    xs = torch.randn(3, kin)
    xs[:, 0] *= 40
    scratch = torch.empty(max(g.scratch_numel for g in gs))

    def arr(i: int, k: int) -> ctypes.Array:
        return (ctypes.c_void_p * k)(*(g.ptrs[i] for g in gs[:k]))

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (1, 3):
            for ldx in (0, kin):
                out = torch.full((k, n), float("nan"))
                if not lib.linear_gemv_m1_many(out.data_ptr(), n, xs.data_ptr(), ldx, k, kin, n, gs[0].fmt,
                                               arr(0, k), arr(1, k), arr(2, k), 32, arr(3, k), scratch.data_ptr(),
                                               threads):
                    continue  # no VNNI here: the caller's one-by-one path runs
                for j in range(k):
                    assert torch.equal(out[j], gs[j](xs[j if ldx else 0].unsqueeze(0))[0]), (k, ldx, j)
    finally:
        torch.set_num_threads(before)


def test_activation_blocks_only_for_int4_groups_of_32_and_int8_blocks():
    with pytest.raises(ValueError, match="activation blocks are for int4 groups of 32 and int8 blocks"):
        QuantConfig("w4a8", 64, act_blocks=True)
    with pytest.raises(ValueError, match="activation blocks are for int4 groups of 32 and int8 blocks"):
        QuantConfig("w8a8", 32, act_blocks=True)  # (per-channel int8)


# (amax, x, n): x / (amax / 127) is exactly n + 0.5 in float32, which x * (127 / amax) misses by an ulp
TIES = [(2.729365825653076, 0.5265312194824219, 24), (1.4442534446716309, 0.0170581117272377, 1),
        (0.6434073448181152, 0.3217036724090576, 63)]


@pytest.mark.parametrize("amax,x,n", TIES)
def test_activation_codes_round_ties_to_even_as_torch_does(amax, x, n):
    """x / s exactly halfway between two codes rounds to the even one, as torch.round does, in every kernel that
    quantizes activations (W8A8's rows, W4A8's rows and blocks, Q8_0's blocks): -ffast-math's x * (1 / s) missed
    such ties by one code (GCC kept the reciprocal under optimize("no-reciprocal-math"))."""
    k = 64
    row = torch.zeros(1, k)
    row[0, 0], row[0, 1], row[0, 33] = amax, x, amax  # (block 1 holds amax too: its scale is the row's)
    row[0, 34] = x
    assert (row[0, 1] / (row[0, 0] / 127)).item() == n + 0.5
    xq, _ = cpu_kernels.quantize_rows_s8(row)
    expected, _ = quantize_rows_int8(row)
    assert xq[0, 1].item() == expected[0, 1].item() == n + (n % 2)
    assert torch.equal(xq, expected)
    w = torch.zeros(2, k)
    w[0, 1] = w[1, 34] = 1.0  # each output is one activation's code times its scale
    for cfg in (QuantConfig("w4a8", 32), QuantConfig("w4a8", 32, act_blocks=True),
                QuantConfig("w8a8", 32, int8_blocks=True), QuantConfig("w8a8", 32, int8_blocks=True, act_blocks=True)):
        q = QuantizedLinear(k, 2, False, cfg)
        q.quantize_from(w, None)
        native, reference = q.forward_native(row), q.forward_reference(row)
        assert torch.allclose(native, reference, rtol=1e-4, atol=0), cfg  # (one code off: >= 1 / 64 off)
