"""GPT-2's native ops against torch's: GELU (tanh approximation), and the residual add fused into LayerNorm."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels
from minivllm.model.layers import LayerNorm, gelu_tanh

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels on this machine")


@pytest.mark.parametrize(("m", "n"), [(1, 3072), (7, 100), (50, 3072), (300, 768)])  # one row; a ragged width; rows
@pytest.mark.parametrize("threads", [1, 2])                                        # split between threads or not
def test_gelu_tanh_equals_torch_on_strided_rows(m, n, threads):
    torch.manual_seed(m + n)
    wide = torch.randn(m, n + 13) * 4  # the rows of a wider buffer (any row stride)
    wide[0, :6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-30, -9.5])  # saturated tails, zeros, a denormal-ish one
    x = wide[:, :n]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = gelu_tanh(x)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh"), atol=2e-6, rtol=1e-5)
    assert out.is_contiguous() and out.shape == (m, n)


def test_gelu_tanh_leaves_other_dtypes_and_shapes_to_torch():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(gelu_tanh(x), F.gelu(x, approximate="tanh"))
    y = torch.randn(2, 3, 64)  # (not 2-D: torch)
    torch.testing.assert_close(gelu_tanh(y), F.gelu(y, approximate="tanh"))


@pytest.mark.parametrize(("m", "h"), [(1, 768), (7, 100), (50, 768), (300, 64)])  # one row; ragged width; many rows
@pytest.mark.parametrize("threads", [1, 2])
def test_add_layernorm_adds_into_the_residual_and_normalises_like_torch(m, h, threads):
    torch.manual_seed(m * h)
    norm = LayerNorm(h, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h))
        norm.bias.copy_(torch.randn(h))
    wide = torch.randn(m, h + 9) * 3 + 5  # a sublayer's output as a view with a row stride; a large mean
    x = wide[:, :h]
    residual = torch.randn(m, h) * 2
    expected_stream = x + residual
    expected = F.layer_norm(expected_stream, (h,), norm.weight, norm.bias, 1e-5)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            out, stream = norm(x, residual)
    finally:
        torch.set_num_threads(old)
    assert stream is residual  # updated in place, as RMSNorm's fused add does
    torch.testing.assert_close(stream, expected_stream, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(wide[:, :h], x)  # the sublayer's output is left as it was


def test_layernorm_without_a_residual_and_off_the_fast_path():
    torch.manual_seed(0)
    norm = LayerNorm(96, 1e-6)
    with torch.no_grad():
        norm.bias.fill_(0.5)
        x = torch.randn(5, 96)
        before = x.clone()
        torch.testing.assert_close(norm(x), F.layer_norm(before, (96,), norm.weight, norm.bias, 1e-6),
                                   atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(x, before, atol=0, rtol=0)  # no residual: x is read only
        xb, rb = torch.randn(3, 96, dtype=torch.bfloat16), torch.randn(3, 96, dtype=torch.bfloat16)
        out, stream = norm.to(torch.bfloat16)(xb, rb)  # bfloat16: torch's ops, the same convention
        torch.testing.assert_close(stream, xb + rb)
        torch.testing.assert_close(out, F.layer_norm(xb + rb, (96,), norm.weight, norm.bias, 1e-6))
