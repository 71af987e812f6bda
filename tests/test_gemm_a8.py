"""W4A8 and Q8_0 blocks against int8 x at many tokens (csrc/gemm_a8.c): panels of 64 weight rows repacked so a
vector's lanes are 16 weight rows, against every row of x at once. Each case sits where the tiling could go wrong:
rows of x not a multiple of the 8 a register block takes, weight rows not a multiple of a tile (16) or a panel (64),
K not a multiple of a group or of the 128-weight chunks x is staged in, every group size and scale kind, x's rows
strided, any thread count."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels
from minivllm.model.quantization import QuantizedLinear, quantize_rows_int8
from minivllm.quant_config import QuantConfig

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels on this machine")

SCALES = [("bfloat16", ""), ("float16", ""), ("float16", "float32"), ("bfloat16", "float32"), ("float16", "none")]


def _layer(k: int, n: int, group: int, scale_dtype: str, min_dtype: str, act_blocks: bool,
           bias: bool = True) -> QuantizedLinear:
    torch.manual_seed(k + n + group)
    q = QuantizedLinear(k, n, bias, QuantConfig("w4a8", group, scale_dtype=scale_dtype, min_dtype=min_dtype,
                                                act_blocks=act_blocks))
    q.quantize_from(torch.randn(n, k) * 0.05, torch.randn(n) if bias else None)
    if min_dtype == "float32":  # mins no half type holds: read as float32
        q.mins.add_(torch.rand_like(q.mins) * 1e-3)
    return q


def _x_reference(x: torch.Tensor, act_blocks: bool) -> torch.Tensor:
    """x as the kernel quantizes it, in float64: one scale a row, or one a 32-wide block (computed apart from the
    library's helpers: the scale and the division in float32, as the kernels round)."""
    if not act_blocks:
        xq, xs = quantize_rows_int8(x)
        return xq.double() * xs.double()[:, None]
    m, k = x.shape
    kp = -(-k // 32) * 32
    blocks = F.pad(x, (0, kp - k)).view(m, kp // 32, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(blocks / s).double() * s.double()).view(m, kp)[:, :k]


def _check(q: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    got = q.forward_native(x).double()
    expected = _x_reference(x, q.act_blocks) @ q.dequantize().double().t()
    if q.bias is not None:
        expected += q.bias.double()
    assert (got - expected).abs().max().item() <= 2e-6 * expected.abs().max().item()
    return got


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("k,n", [(100, 70), (1568, 200)])  # one partial group; panels 64 + 6 / 3 * 64 + 8 rows
@pytest.mark.parametrize("m", [17, 30, 64])  # a register block of 1, 6 and none left over
@pytest.mark.parametrize("scale_dtype,min_dtype", SCALES)
def test_many_token_w4a8_equals_its_reference(group, k, n, m, scale_dtype, min_dtype):
    """Every scale kind (bfloat16 ours, float16 GPTQ's / AWQ's / GGUF's, float32 mins, none: Q4_0's -8 scale) and
    group size, per-row x scales; with groups of 32 also x in blocks of 32 (GGUF's default), with an outlier in the
    first block that one row-wide scale would spread over the rest."""
    torch.manual_seed(m)
    x = torch.randn(m, k)
    x[:, 1] *= 60
    _check(_layer(k, n, group, scale_dtype, min_dtype, False), x)
    if group == 32:
        _check(_layer(k, n, group, scale_dtype, min_dtype, True), x)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("act_blocks", [False, True])
def test_many_token_w4a8_any_thread_count_strided_x_no_bias(threads, act_blocks):
    """Panels handed out to whichever thread asks (3 threads, 5 panels: uneven), x's rows a slice of a wider
    tensor, no bias: the same outputs as the reference and as a second run, bit for bit."""
    q = _layer(800, 300, 32, "float16", "none", act_blocks, bias=False)
    torch.manual_seed(3)
    wide = torch.randn(41, 900)
    x = wide[:, 50:850]
    assert x.stride(0) == 900
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _check(q, x)
        assert torch.equal(q.forward_native(x).double(), got)
    finally:
        torch.set_num_threads(before)


def test_many_tokens_agree_with_the_rows_kernel_sixteen_at_a_time():
    """The tiled path (more than 16 rows of x) and the row kernel (16 at a time) compute the same sums in another
    order: within float32 rounding of each other, row for row."""
    q = _layer(2048, 96, 32, "float16", "none", True)
    torch.manual_seed(5)
    x = torch.randn(48, 2048)
    whole = q.forward_native(x)
    parts = torch.cat([q.forward_native(x[i:i + 16]) for i in range(0, 48, 16)])
    assert (whole - parts).abs().max().item() <= 1e-5 * parts.abs().max().item()


def _q8_layer(k: int, n: int, act_blocks: bool) -> QuantizedLinear:
    torch.manual_seed(k + n)
    q = QuantizedLinear(k, n, True, QuantConfig("w8a8", 32, int8_blocks=True, act_blocks=act_blocks))
    q.quantize_from(torch.randn(n, k) * 0.05, torch.randn(n))
    return q


@pytest.mark.parametrize("k,n", [(100, 70), (1568, 200), (2048, 64)])  # a partial block (the last dword tail)
@pytest.mark.parametrize("m", [17, 30, 64])
@pytest.mark.parametrize("act_blocks", [False, True])
def test_many_token_q8_0_blocks_equal_their_reference(k, n, m, act_blocks):
    """GGUF's Q8_0 blocks against int8 x in the same tiles (csrc/gemm_a8.c, q8a8): the weights read as w + 128 with
    -128 scale as each block's min, x per row or in blocks of 32, within float32 rounding of float64; and the weight
    codes' extremes (-128 .. 127 as stored) come through the sign flip."""
    q = _q8_layer(k, n, act_blocks)
    q.qweight[0, :32] = -128
    q.qweight[1, :32] = 127
    torch.manual_seed(m)
    x = torch.randn(m, k)
    x[:, 1] *= 60
    _check(q, x)
