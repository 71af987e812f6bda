"""GPT-2's GELU (tanh approximation) on the native kernel against torch's."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels
from minivllm.model.layers import gelu_tanh

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
