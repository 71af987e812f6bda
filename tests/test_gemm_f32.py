"""csrc/gemm_f32.c: the float32 GEMM on panel-packed weights that the native kernel runs past PANELS_PAST tokens,
against a float64 reference, and how layers.Linear makes, uses and releases its panels."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import plan_kernels
from minivllm.model.layers import PANELS_PAST, Linear

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels on this machine")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """x W^T + b in float64, and the scale of float32 rounding there: the largest sum of |terms| of an output."""
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    return exact, (x.double().abs() @ w.double().abs().t()).max().item()


@pytest.mark.parametrize(("m", "k", "n"), [
    (17, 100, 37),     # one tile and a ragged one; K not a multiple of a vector; one partial panel
    (23, 64, 70),      # full tiles (AVX2's 6, AVX-512's 14) and the rest; panels past N zero-padded
    (50, 768, 2304),   # GPT-2's qkv at the seed workload's 50 sequences
    (64, 3072, 96),    # a long K (the MLP's down projection)
    (130, 31, 5),      # many tiles; fewer columns than a panel
    (1, 48, 40),       # one token (the kernel takes any M; the layer sends it more than PANELS_PAST)
])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_gemm_equals_the_float64_linear_on_strided_rows(m, k, n, bias, threads):
    torch.manual_seed(m * k + n)
    w, b = torch.randn(n, k) * 0.05, (torch.randn(n) if bias else None)
    x = torch.randn(m, k + 7)[:, :k]  # rows of a wider buffer: any row stride
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_kernels.GemmPanels(w, b)(x)
    finally:
        torch.set_num_threads(old)
    exact, scale = _reference(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
    # float32 sums of k terms: a few units in the last place of the terms' magnitude, as aten's own float32 linear
    assert (got.double() - exact).abs().max().item() <= 1e-6 * scale
    assert (got.double() - exact).abs().max().item() <= 4 * (F.linear(x, w, b).double() - exact).abs().max().item() \
        + 1e-7 * scale


@pytest.mark.parametrize(("m", "k", "n"), [(50, 2048, 96), (20, 3072, 40), (7, 1024, 33), (64, 4096, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_that_share_l1_sets_are_copied_apart_and_give_the_same_bits(m, k, n, threads):
    """x's rows a multiple of 4 KiB apart (K = 1024 floats and its multiples, contiguous) all fall in one L1 set, so
    the kernel first copies them to rows 16 floats longer (in the calling thread's buffer, filled by the team): the
    same sums as x read where it lies (a row stride that does not conflict), bit for bit, at every thread count."""
    torch.manual_seed(m + k)
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    x = torch.randn(m, k)
    apart = torch.zeros(m, k + 5)
    apart[:, :k] = x
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        panels = cpu_kernels.GemmPanels(w, b)
        got, direct = panels(x), panels(apart[:, :k])
    finally:
        torch.set_num_threads(old)
    exact, scale = _reference(x, w, b)
    assert (got.double() - exact).abs().max().item() <= 1e-6 * scale
    assert torch.equal(got, direct)


def _linear(k: int, n: int, dtype: torch.dtype = torch.float32) -> Linear:
    lin = Linear(k, n).to(dtype)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        lin.bias.normal_()
    return lin


def test_the_native_kernel_runs_panels_past_few_tokens_only_where_allowed_and_planned():
    torch.manual_seed(0)
    lin = _linear(96, 80)
    x_many, x_few = torch.randn(PANELS_PAST + 1, 96), torch.randn(PANELS_PAST, 96)
    expected = F.linear(x_many, lin.weight, lin.bias)
    assert lin.gemm_panels() is None  # not allowed: the runner allows it where a second copy is affordable
    torch.testing.assert_close(lin.forward_native(x_many), expected, atol=1e-5, rtol=1e-5)
    lin.allow_panels = True
    torch.testing.assert_close(lin.forward_native(x_few), F.linear(x_few, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    assert lin._panels is None  # PANELS_PAST tokens or fewer: csrc/gemv.c's rows, no panels made
    torch.testing.assert_close(lin.forward_native(x_many), expected, atol=1e-5, rtol=1e-5)
    assert lin._panels is not None  # made on first use past PANELS_PAST
    plan_kernels([lin], "onednn" if "onednn" in lin.candidates() else "torch")
    lin.release_unused()
    assert lin._panels is None  # not planned past PANELS_PAST: released
    other = _linear(96, 80)
    other.allow_panels = True
    plan_kernels([other], "native")
    other.release_unused()
    assert other._panels is not None  # planned there: packed at once, not in the first large step
    torch.testing.assert_close(other(x_many), F.linear(x_many, other.weight, other.bias), atol=1e-5, rtol=1e-5)


def test_a_bfloat16_weight_keeps_the_rows_at_any_token_count():
    lin = _linear(64, 48, torch.bfloat16)
    lin.allow_panels = True
    x = torch.randn(PANELS_PAST + 4, 64, dtype=torch.bfloat16)
    out = lin.forward_native(x)
    assert lin._panels is None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x.float(), lin.weight.float(), lin.bias.float()), atol=2e-2,
                               rtol=2e-2)
