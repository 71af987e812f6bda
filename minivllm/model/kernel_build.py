"""The native CPU kernels' build: the C sources shipped in the package compiled once per machine with the system C
compiler (-march=native, so keyed by the CPU's flags) into a shared library cached on disk; model/cpu_kernels.py
loads it and binds its functions."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

logger = logging.getLogger(__name__)

# (an undeclared function is an error: GCC 12 only warns, and the library then loads with a symbol that fails on
# its first call, on the ISA whose headers left it undefined)
_COMPILE = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11", "-Werror=implicit-function-declaration", "-c"]
# Linked without -ffast-math: with it GCC adds crtfastmath.o, whose constructor turns on flush-to-zero
# for the whole process (torch's denormals included) the moment the library is loaded.
_LINK = ["-shared", "-fopenmp"]


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(root, "minivllm", "kernels")


def _march() -> str:
    """The ISA the kernels are built for: this CPU's (native), or an older one named by $MINIVLLM_KERNEL_MARCH
    (x86-64-v3: AVX2 + FMA) to run and test an AVX2 machine's kernels on an AVX-512 one."""
    return "-march=" + (os.environ.get("MINIVLLM_KERNEL_MARCH") or "native")


def _cpu_signature() -> str:
    """-march=native code must not be reused on a different CPU: key the cache by its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


# Longest compiles first (paged attention's two units, then gemv.c): the build runs one compiler per core.
_SOURCES = ("paged_attention_wide.c", "paged_attention.c", "gemv.c", "gemm_a8.c", "gemv_int4.c", "gemv_w4a8.c",
            "gemv_q8.c", "gemv_q6k.c", "gemv_q4k.c", "fused_ops.c", "sampling.c", "decode_stack.c", "moe_decode.c",
            "quantize_rows.c", "greedy_loop.c", "membw.c", "gemm_f32.c")
# included by the sources: copied and hashed with them
_HEADERS = ("paged_attention.h", "paged_attention_items.h", "paged_attention_rows.h", "gemv_common.h", "gemv_rows.h",
            "gemv_m1.h", "gemv_avx2.h", "gemv_w4a8_avx2.h", "gemv_bf16dot.h", "gemv_avx512.h", "gemv_int4_bf16dot.h",
            "gemv_int4_int16dot.h", "hsum_avx2.h",
            "simd_width.h", "decode_stack.h", "group_window.h", "stage_rows.h", "q6k_unpack.h", "q4k_unpack.h",
            "superblock_rows.h")


def build_library() -> str | None:
    """The library's path, compiled first where this machine has no build of these sources yet; None where it
    cannot be built (no compiler, a failed compile: the engine then runs the portable torch paths)."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.warning("native CPU kernels: no C compiler found; using the portable torch paths")
        return None
    csrc = resources.files("minivllm.model").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_text() for name in _SOURCES}
    headers = {name: csrc.joinpath(name).read_text() for name in _HEADERS}
    compile_args = [_march(), *_COMPILE]
    out_dir = _cache_dir()
    lib_path = os.path.join(out_dir, _library_name(cc, [*sources.values(), *headers.values()], compile_args))
    if not os.path.isfile(lib_path):
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            for name, text in headers.items():
                with open(os.path.join(tmp, name), "w") as f:
                    f.write(text)
            objects = []
            for name, text in sources.items():
                src = os.path.join(tmp, name)
                with open(src, "w") as f:
                    f.write(text)
                objects.append(src[:-2] + ".o")
            # One compiler per core: the sources are independent (27 s of -O3 on one core, a first start's
            # longest wait); threads suffice, each only waits on its gcc.
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                built = list(pool.map(lambda o: _run(cc, [*compile_args, o[:-2] + ".c", "-o", o]), objects))
            if not all(built):
                return None
            tmp_lib = os.path.join(tmp, "lib.so")
            if not _run(cc, [*_LINK, *objects, "-o", tmp_lib, "-lm"]):
                return None
            os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see a partial file
    return lib_path


def _library_name(cc: str, texts: list[str], compile_args: list[str]) -> str:
    """The cached library's file name: a hash of the sources, the compiler, its flags (the ISA among them) and the
    CPU's, so no build is loaded where it was not made for."""
    parts = [*texts, cc, *compile_args, *_LINK, _cpu_signature()]
    return f"minivllm_kernels-{hashlib.sha256(chr(10).join(parts).encode()).hexdigest()[:16]}.so"


def _run(cc: str, args: list[str]) -> bool:
    proc = subprocess.run([cc, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        logger.warning("native CPU kernels: build failed (%s); using the portable torch paths",
                       proc.stderr.strip()[-500:])
    return proc.returncode == 0
