"""Full-precision projection kernels: every candidate (oneDNN prepacked, the native streaming GEMV,
F.linear) computes the same y = x W^T + b, the plan binds one per shape class, unused copies of
the weight are released, and a plan whose start-up timings steps later beat is re-timed."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import PROMPTS, int4_native_x

from minivllm import LLM, SamplingParams
from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import plan_kernels
from minivllm.model.layers import Linear, onednn_linear_available
from minivllm.model.quantization import (
    quantize_blocks_int8,
    quantize_int4,
    quantize_int8,
    quantize_int8_blocks,
    quantize_rows_int8,
    unpack_int4,
)


def _linear(k: int, n: int, dtype: torch.dtype, bias: bool) -> Linear:
    torch.manual_seed(k + n)
    lin = Linear(k, n, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_()
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(100, 37), (72, 130), (576, 64), (31, 5)])
# (AVX2's native rows: 4 weight rows a pass at 1-2 tokens, 2 at 3-4, 1 at 5-8; AVX-512's 8 at 1-2, then 16 // m:
# 5 at 3, 3 at 5, 2 at 6; blocks of 8 tokens: 17 is 8 + 8 + 1; at 9-16 two rows against 8 tokens then the rest)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 9, 12, 17, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_every_dense_kernel_computes_the_same_linear(dtype, k, n, m, bias):
    lin = _linear(k, n, dtype, bias)
    x = torch.randn(m, k).to(dtype)
    expected = x.double() @ lin.weight.double().t() + (lin.bias.double() if bias else 0)
    packs = onednn_linear_available(torch.device("cpu"), dtype)  # bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT
    if packs:
        lin.pack(keep_weight=True)
    names = set(lin.candidates())
    assert {"onednn", "onednn_plain", "torch", "native"} - ({"onednn", "onednn_plain"} if not packs else set()) \
        <= names or not cpu_kernels.available()
    # bf16 rounds the output (and oneDNN may round the accumulation) to 8 bits of mantissa.
    tol = (2e-6 if dtype == torch.float32 else 1e-2) * expected.abs().max().item()
    for name, kernel in lin.candidates().items():
        got = kernel(x)
        assert got.shape == (m, n) and got.dtype == dtype, name
        assert (got.double() - expected).abs().max().item() <= tol, name


def test_plan_binds_kernels_and_releases_the_unused_copy():
    lins = [_linear(64, 96, torch.float32, True) for _ in range(3)]
    for lin in lins:
        lin.pack(keep_weight=True)
    plan = plan_kernels(lins, "native").names
    assert plan == {"m<=1": "native", "m<=6": "native", "m<=16": "native", "m>16": "native"}
    for lin in lins:
        lin.release_unused()
        assert lin.weight is not None and lin.packed is None
    plan = plan_kernels(lins, "torch").names
    assert set(plan.values()) == {"torch"}
    onednn_only = _linear(64, 96, torch.float32, False)
    onednn_only.pack(keep_weight=True)
    plan_kernels([onednn_only], "onednn")
    onednn_only.release_unused()
    assert onednn_only.weight is None and onednn_only.packed is not None
    with pytest.raises(ValueError,
                       match="'fast' has no kernel here; choose auto or one of onednn, torch, onednn_plain, native"):
        plan_kernels([_packed()], "fast")


def _packed() -> Linear:
    lin = _linear(16, 16, torch.float32, False)
    lin.pack(keep_weight=True)
    return lin


@pytest.mark.parametrize("backend", ["native", "onednn", "onednn_plain", "torch"])
def test_engine_greedy_output_does_not_depend_on_the_linear_backend(model_factory, backend):
    path = model_factory("tiny-llama")
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(path, linear_backend="torch", num_kv_blocks=64).generate(
        PROMPTS, sp, use_tqdm=False)]
    llm = LLM(path, linear_backend=backend, num_kv_blocks=64)
    assert set(llm.llm_engine.runner.linear_kernels.values()) == {backend}
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == ref


@pytest.fixture
def kernel_timed(monkeypatch):
    """The embedded model's one-token class as its kernel timings chose it: where they chose other than native,
    the whole-step timing (model/stack_plan.py) may pin it native, without timings to re-check (an Intel Xeon's
    CI run: oneDNN won the projections alone, the stack won the step, and these tests found no timings)."""
    from minivllm.model import stack_plan

    monkeypatch.setattr(stack_plan, "STACK_CLASSES", ())


def test_a_plan_timed_under_load_is_rechecked_when_steps_beat_its_timings(monkeypatch, kernel_timed):
    """The start-up timing of the decode class's kernel, as if a busy core had inflated it 50x: decode steps
    then run faster than the plan says its projections alone can, so the class is timed again (once: the
    cool-down holds), the timings become plausible again, the decode stack follows the plan, and the outputs
    are unchanged. Both weight layouts are kept: where one kernel wins every class (packed oneDNN on an AVX2-only
    EPYC) the other layout is released and a re-check has nothing to choose between (the test below covers that)."""
    from minivllm.model.decode_stack import _native_classes

    monkeypatch.setattr(Linear, "release_unused", lambda self: None)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(num_kv_blocks=64)  # the embedded model: layers large enough that timings bound its steps
    runner = llm.llm_engine.runner
    plan, check = runner.linear_plan, runner.plan_check
    assert check is not None and plan.timings[0] is not None and len(plan.timed[0].candidates()) > 1
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], sp, use_tqdm=False)]
    # A start-up timed under real load (the suite's previous test still running down) may have been re-checked
    # already in that first generate, and its cool-down would then hold the one this test provokes: start afresh.
    plan.rechecks.clear()
    check.recent[0].clear()
    check.since[0] = check.COOLDOWN
    chosen = plan.chosen[0]
    plan.timings[0][chosen] *= 50
    inflated = plan.timings[0][chosen]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], sp, use_tqdm=False)] == ref
    assert [c for c, _, _ in plan.rechecks] == [0]
    assert plan.timings[0] is not None and plan.timings[0][plan.chosen[0]] < inflated / 5
    assert plan.names["m<=1"] == plan.chosen[0]
    assert all(layer.kernels[0].__name__ == f"forward_{plan.chosen[0]}" for layer in plan.layers)
    if runner.decode_stack is not None:
        assert runner.decode_stack.native_classes == _native_classes(runner.model)
    plan.timings[0][plan.chosen[0]] *= 50  # again at once: within the cool-down, no second re-time
    llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    assert len(plan.rechecks) == 1


def test_a_recheck_does_not_time_again_a_kernel_that_lost_by_far(kernel_timed):
    """A re-check runs inside a serving step: candidates more than RECHECK_SPAN slower than the choice at start-up
    are not timed again (timing a portable path that dequantizes whole layers took a benchmark's b=1 window)."""
    from minivllm.model.kernel_plan import KernelPlan

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(num_kv_blocks=64, quantization="int8")  # candidates: native, int_mm (many tokens), reference
    plan = llm.llm_engine.runner.quant_plans[0]
    assert plan.timings[0] is not None and "reference" in plan.timings[0]
    chosen = plan.chosen[0]
    assert chosen != "reference"
    plan.timings[0][chosen] *= 50  # the choice's timing inflated (steps now beat it)
    plan.timings[0]["reference"] = plan.timings[0][chosen] * (KernelPlan.RECHECK_SPAN + 1)
    others = [n for n in plan.timings[0] if n not in (chosen, "reference")]
    llm.generate(PROMPTS[:1], sp, use_tqdm=False)
    if others:  # re-timed among the near ones only
        assert [c for c, _, _ in plan.rechecks] == [0] and "reference" not in (plan.timings[0] or {})
    else:  # nothing near to choose between: the class is not checked again, and nothing was timed
        assert plan.rechecks == [] and plan.timings[0] is None


def test_a_recheck_times_only_the_kernels_whose_weight_layout_is_still_held(kernel_timed):
    """A kernel timed at start-up whose layout was released since (no class chose it) is not timed again: the
    re-check used to look it up among the layer's candidates and raise KeyError inside a serving step."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(num_kv_blocks=64)
    plan = llm.llm_engine.runner.linear_plan
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], sp, use_tqdm=False)]
    assert plan.timings[0] is not None
    held = set(plan.timings[0]) & set(plan.timed[0].candidates())
    plan.timings[0]["released"] = 1e-9  # as a packed copy timed at start-up, then dropped
    plan.timings[0][plan.chosen[0]] *= 50
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], sp, use_tqdm=False)] == ref
    if len(held) > 1:
        assert [c for c, _, _ in plan.rechecks] == [0] and set(plan.timings[0]) == held
    else:  # one kernel left: nothing to re-time, and the class is not checked again
        assert plan.rechecks == [] and plan.timings[0] is None


def test_a_second_engine_of_the_same_layers_reuses_the_start_up_timings(monkeypatch, kernel_timed):
    """Start-up timings are kept per process by what was timed: a second engine of the same model times nothing and
    plans the same kernels (with its own copy of the timings); other layers (bf16 activations and weights) are
    timed; a re-check's timings replace the kept ones."""
    from minivllm.model import kernel_plan, row_order

    monkeypatch.setattr(Linear, "release_unused", lambda self: None)  # (both layouts stay: a re-check has a choice)
    monkeypatch.setattr(kernel_plan.KernelPlan, "RECHECK_SPAN", float("inf"))
    monkeypatch.setattr(kernel_plan, "_KEPT_TIMINGS", {})  # (as a fresh process: earlier tests built these engines)
    monkeypatch.setattr(kernel_plan, "_KEPT_CHOICES", {})
    plan = LLM(num_kv_blocks=64).llm_engine.runner.linear_plan
    calls: list[int] = []
    original = kernel_plan.best_time
    monkeypatch.setattr(kernel_plan, "best_time", lambda fn, reps=3: calls.append(1) or original(fn, reps))
    again = LLM(num_kv_blocks=64).llm_engine.runner.linear_plan
    assert calls == [] and again.chosen == plan.chosen and again.timings == plan.timings
    assert again.timings[0] is not plan.timings[0]
    order = row_order.state()
    LLM(num_kv_blocks=64, dtype="bfloat16")
    assert calls  # other layers: timed
    calls.clear()
    # (the one-token row order is process-wide and keys the timings: the bf16 engine's may differ from this one's)
    row_order.restore(order)
    timed = again.timings[0]
    assert timed is not None and len(timed) > 1
    again.timings[0] = {n: t * 50 for n, t in timed.items()}
    again.recheck(0)  # times afresh, and keeps what it found
    assert calls and again.timings[0] != plan.timings[0]
    assert LLM(num_kv_blocks=64).llm_engine.runner.linear_plan.timings[0] == again.timings[0]


def _equal_with_threads(g: cpu_kernels.GemvWeights, x: torch.Tensor, expected: torch.Tensor, threads: int) -> None:
    """g(x) with `threads` threads equals the float64 reference within float32 rounding, and a re-run exactly."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, again = g(x), g(x)
    finally:
        torch.set_num_threads(before)
    assert (got.double() - expected).abs().max().item() <= 2e-6 * expected.abs().max().item()
    assert torch.equal(got, again)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "w8a8", "int4", "w4a8"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_token_rows_handed_out_in_chunks_are_each_computed_once(fmt, threads):
    """The one-token GEMVs hand rows out in chunks to whichever thread asks first (csrc/gemv_rows.h take_rows):
    every row exactly once whatever the thread count, N past many chunks and not a multiple of the rows a pass
    takes (8 float rows, 4 quantized) or of the chunk; the outputs equal the float64 reference and a re-run."""
    k, n = 256, 4099  # 1 KiB f32 rows: chunks of 512-1024 rows (at most N / 4), a 3-row tail
    torch.manual_seed(7)
    w = torch.randn(n, k) * 0.05
    x = torch.randn(1, k)
    if fmt in ("f32", "bf16"):
        wt = w if fmt == "f32" else w.bfloat16()
        g, wd = cpu_kernels.GemvWeights.dense(wt, k, None), wt.double()
    elif fmt == "w8a8":
        q, s = quantize_int8(w)
        g, wd = cpu_kernels.GemvWeights(fmt, q, k, s, None, 0), q.double() * s.double()[:, None]
    else:
        q, s, mn = quantize_int4(w, 32)
        g = cpu_kernels.GemvWeights(fmt, q, k, s, mn, 32)
        codes = unpack_int4(q).double().view(n, k // 32, 32)
        wd = (codes * s.double()[..., None] + mn.double()[..., None]).reshape(n, k)
    xd = int4_native_x(x) if fmt == "int4" else x.double()  # (int16 blocks where int4's rows take x so)
    if fmt in ("w8a8", "w4a8"):
        xq, xs = quantize_rows_int8(x)
        xd = xq.double() * xs.double()[:, None]
    expected = xd @ wd.t()
    _equal_with_threads(g, x, expected, threads)


_QUEUE_HARNESS = r"""
#include <omp.h>
#include <stdint.h>
#include <time.h>
#include "gemv_rows.h"

/* Rows [0, N) through a queue set up for nt threads, taken by a region of `threads` (fewer: the missing threads'
 * ranges are left to stealing; a thread that starts late has its range stolen from): count[n] += 1 for each row,
 * returns the pieces taken from another thread's starting range, or -1 when a piece broke the unit alignment. */
int64_t drain(int64_t N, int nt, int threads, int64_t unit, int64_t row_bytes, int late_us, int32_t *count) {
    row_queue_t q;
    rq_init(&q, N, nt, unit, row_bytes);
    int64_t stolen = 0, bad = 0;
#pragma omp parallel num_threads(threads) reduction(+ : stolen, bad)
    {
        const int me = omp_get_thread_num();
        if (me == 1 && late_us) {
            struct timespec t = {0, late_us * 1000L};
            nanosleep(&t, NULL);
        }
        int64_t n, end;
        while (rq_take(&q, &n, &end)) {
            const int64_t lo = N * me / nt / unit * unit, hi = me + 1 == nt ? N : N * (me + 1) / nt / unit * unit;
            stolen += n < lo || n >= hi;
            bad += n % unit != 0 || (end % unit != 0 && end != N) || end <= n;
            for (int64_t i = n; i < end; i++) __atomic_fetch_add(count + i, 1, __ATOMIC_RELAXED);
        }
    }
    return bad ? -1 : stolen;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")
def test_the_row_queue_hands_every_row_out_once_and_steals_from_late_or_missing_threads(tmp_path):
    """csrc/gemv_rows.h's queue (every one-token GEMV's rows): each thread takes its own contiguous range piece by
    piece and then steals the back half of what another has left. Whatever the interleaving every row goes out
    exactly once, pieces stay aligned to the kernel's rows a pass (only a range ending at N has a tail); a range
    whose thread never comes (a queue for more threads than the region got) or comes late is taken by the others."""
    import ctypes
    import subprocess

    csrc = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")
    src, lib = tmp_path / "queue.c", tmp_path / "queue.so"
    src.write_text(_QUEUE_HARNESS)
    subprocess.run(["gcc", "-O2", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", f"-I{csrc}", str(src), "-o", str(lib)],
                   check=True, capture_output=True)
    drain = ctypes.CDLL(str(lib)).drain
    drain.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                      ctypes.c_void_p]
    drain.restype = ctypes.c_int64
    stolen = {}
    for n, unit, row_bytes in [(4099, 4, 1024), (1000, 8, 64), (37, 4, 1 << 20), (3, 4, 16)]:
        for nt, threads, late_us in [(1, 1, 0), (2, 2, 0), (3, 2, 0), (5, 3, 0), (2, 2, 3000), (4, 1, 0)]:
            count = torch.zeros(n, dtype=torch.int32)
            got = drain(n, nt, threads, unit, row_bytes, late_us, count.data_ptr())
            assert got >= 0, (n, nt, threads, "a piece not aligned to the unit")
            assert torch.equal(count, torch.ones(n, dtype=torch.int32)), (n, nt, threads, late_us)
            stolen[(n, nt, threads, late_us)] = got
    assert stolen[(4099, 3, 2, 0)] > 0 and stolen[(4099, 4, 1, 0)] > 0  # ranges without a thread
    assert stolen[(4099, 2, 2, 3000)] > 0  # a thread 3 ms late: the other took from its range
    assert stolen[(4099, 1, 1, 0)] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [4, 7, 12])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_float_rows_at_a_few_tokens_handed_out_in_chunks_are_each_computed_once(dtype, m, threads):
    """Float weights at 2-16 tokens take their rows in chunks too (csrc/gemv_avx512.h dense_all_avx512, each pass
    prefetching the next pass's rows): every row once, N past many chunks, not a multiple of the rows a pass (4, 2,
    then 2 + the rest at 12 tokens) nor of the chunk; equal to the float64 reference and to a re-run."""
    k, n = 256, 4099
    torch.manual_seed(11)
    w = (torch.randn(n, k) * 0.05).to(dtype)
    x = torch.randn(m, k)
    g = cpu_kernels.GemvWeights.dense(w, k, None)
    expected = x.double() @ w.double().t()
    _equal_with_threads(g, x, expected, threads)


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_w4a8_rows_at_a_few_tokens_handed_out_in_chunks_are_each_computed_once(m, threads):
    """W4A8 at 2-16 tokens (below the tiles of csrc/gemm_a8.c) takes its rows in chunks too, each row prefetching
    two rows on: every row once, N past many chunks and not a multiple of them; equal to the reference and a re-run."""
    k, n = 256, 4099
    torch.manual_seed(13)
    q, s, mn = quantize_int4(torch.randn(n, k) * 0.05, 32)
    g = cpu_kernels.GemvWeights("w4a8", q, k, s, mn, 32)
    codes = unpack_int4(q).double().view(n, k // 32, 32)
    wd = (codes * s.double()[..., None] + mn.double()[..., None]).reshape(n, k)
    x = torch.randn(m, k)
    xq, xs = quantize_rows_int8(x)
    _equal_with_threads(g, x, (xq.double() * xs.double()[:, None]) @ wd.t(), threads)


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_int8_block_rows_against_int8_x_handed_out_in_chunks_are_each_computed_once(m, threads):
    """GGUF Q8_0's blocks against x in int8 blocks (csrc/gemv_q8.c, a GGUF head's rows) take their rows in chunks,
    prefetching two rows on from 2 rows of x: every row once, N past many chunks; equal to the reference."""
    k, n = 256, 4099
    torch.manual_seed(17)
    q, s = quantize_int8_blocks(torch.randn(n, k) * 0.05)
    g = cpu_kernels.GemvWeights("q8a8", q, k, s, None, 32, None, True)
    wd = (q.double().view(n, -1, 32) * s.double()[..., None]).reshape(n, k)
    x = torch.randn(m, k)
    _equal_with_threads(g, x, quantize_blocks_int8(x).double() @ wd.t(), threads)


@pytest.mark.parametrize("scales", ["bf16", "f16-sym", "f32"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_token_projections_in_one_region_equal_them_one_by_one(scales, threads):
    """A mixture's chosen experts at one token run in one parallel region per projection kind (csrc/gemv.c's
    linear_gemv_m1_many, W4A8 and float32): each of k projections' outputs bit-equal to its own linear_gemv, with one
    x shared (the gate_ups) or one x each (the downs), N not a multiple of the rows a pass or of the chunk, K not of
    the group; other formats return 0 (their caller runs them one by one), as W4A8 does without VNNI."""
    import ctypes

    lib = cpu_kernels.load_library()
    assert lib is not None
    kin, n, group = 200, 1030, 32
    torch.manual_seed(11)
    gs = []
    for _ in range(3):
        q, s, mn = quantize_int4(torch.randn(n, kin) * 0.05, group)
        gs.append(cpu_kernels.GemvWeights.dense(torch.randn(n, kin), kin, torch.randn(n)) if scales == "f32" else
                  cpu_kernels.GemvWeights("w4a8", q, kin, s, mn, group) if scales == "bf16" else
                  cpu_kernels.GemvWeights("w4a8", q, kin, s.half(), None, group))
    xs = torch.randn(3, kin)
    scratch = torch.empty(max(g.scratch_numel for g in gs))

    def arr(i: int, k: int) -> ctypes.Array:
        return (ctypes.c_void_p * k)(*(g.ptrs[i] for g in gs[:k]))

    def many(k: int, ldx: int, fmt: int) -> tuple[int, torch.Tensor]:
        out = torch.full((k, n), float("nan"))
        biases = (ctypes.c_void_p * k)(*(g.ptrs[3] for g in gs[:k]))
        done = lib.linear_gemv_m1_many(out.data_ptr(), n, xs.data_ptr(), ldx, k, kin, n, fmt, arr(0, k), arr(1, k),
                                       arr(2, k), group, biases, scratch.data_ptr(), torch.get_num_threads())
        return done, out

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (1, 2, 3):
            for ldx in (0, kin):
                done, out = many(k, ldx, gs[0].fmt)
                if not done:  # no VNNI here: the caller's one-by-one path runs
                    assert scales != "f32"
                    continue
                for j in range(k):
                    assert torch.equal(out[j], gs[j](xs[j if ldx else 0].unsqueeze(0))[0]), (k, ldx, j)
        bf16 = cpu_kernels.GemvWeights.dense(torch.randn(n, kin).bfloat16(), kin, None)
        assert lib.linear_gemv_m1_many(xs.data_ptr(), n, xs.data_ptr(), 0, 1, kin, n, bf16.fmt,
                                       (ctypes.c_void_p * 1)(bf16.ptrs[0]), (ctypes.c_void_p * 1)(None),
                                       (ctypes.c_void_p * 1)(None), 0, None, scratch.data_ptr(), threads) == 0
    finally:
        torch.set_num_threads(before)
