"""The native kernels built for an AVX2 CPU (MINIVLLM_KERNEL_MARCH=x86-64-v3: csrc/gemv_avx2.h, gemv_w4a8_avx2.h,
hsum_avx2.h in place of the AVX-512 headers) pass the kernel tests on an AVX-512 machine too, so a change to the
shared sources that breaks the AVX2 build, or its results, fails here and not first on an AVX2 CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.model import kernel_build

REPO = Path(__file__).resolve().parent.parent
# the kernel tests the AVX2 headers serve: int4 and W4A8 rows in every order, int8 and the dense rows, the stack
KERNEL_TESTS = ["tests/test_row_order.py", "tests/test_quantization.py", "tests/test_linear_kernels.py",
                "tests/test_prequantized.py", "tests/test_act_blocks.py", "tests/test_gemm_a8.py",
                "tests/test_few_rows.py", "tests/test_decode_stack.py"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def _avx2_build_env() -> dict[str, str]:
    return {**os.environ, "MINIVLLM_KERNEL_MARCH": "x86-64-v3"}


@pytest.mark.skipif("avx512f" not in _cpu_flags() or os.environ.get("MINIVLLM_KERNEL_MARCH") is not None,
                    reason="the native build is the AVX2 one here (or another ISA is asked for already)")
def test_the_avx2_build_passes_the_kernel_tests_on_an_avx512_machine():
    env = _avx2_build_env()
    probe = ("from minivllm.model import cpu_kernels, row_order; lib = cpu_kernels.load_library(); "
             "print(lib is not None, cpu_kernels.int4_x_int16(), row_order.int4_int16_ordered(), "
             "bool(lib.gemv_int4_int16dot()), bool(lib.gemv_int4_bf16dot()))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    # built and loaded; int4's one-token rows AVX2's (x as int16, in W4A8's order), neither AVX-512 dot product's
    assert out.stdout.split() == ["True", "True", "True", "False", "False"], out.stdout + out.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *KERNEL_TESTS,
                          "-k", "not test_quantization.py or int4 or w4a8 or int8"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-3000:] + run.stderr[-1000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail


def test_the_kernel_isa_is_this_cpus_unless_one_is_named(monkeypatch):
    """-march=native by default; MINIVLLM_KERNEL_MARCH names another, and the build's cache key follows it (a
    library built for one ISA is never loaded for another)."""
    names = []
    for march in (None, "x86-64-v3"):
        if march is None:
            monkeypatch.delenv("MINIVLLM_KERNEL_MARCH", raising=False)
        else:
            monkeypatch.setenv("MINIVLLM_KERNEL_MARCH", march)
        args = [kernel_build._march(), *kernel_build._COMPILE]
        assert args[0] == f"-march={march or 'native'}"
        names.append(kernel_build._library_name("gcc", ["int f(void) { return 0; }"], args))
    assert names[0] != names[1]
