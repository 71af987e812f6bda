"""Native CPU kernels: C sources shipped in the package, compiled once per machine with the system
C compiler and loaded with ctypes.

The library links the same OpenMP runtime torch loaded (same soname, so the dynamic linker reuses
torch's), so its threads are torch's threads: `torch.set_num_threads` governs both and they never
fight each other. Without a compiler the engine falls back to the portable PyTorch backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources

import torch

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(root, "minivllm", "kernels")


def _cpu_signature() -> str:
    """-march=native code must not be reused on a different CPU: key the cache by its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


@functools.cache
def load_paged_attention() -> ctypes.CDLL | None:
    """Compile (once, cached on disk) and load the paged-attention library; None if impossible."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.warning("cpu_native attention: no C compiler found; using the torch backend")
        return None
    source = resources.files("minivllm.model").joinpath("csrc/paged_attention.c").read_text()
    key = hashlib.sha256("\n".join([source, cc, *_FLAGS, _cpu_signature()]).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib_path = os.path.join(out_dir, f"paged_attention-{key}.so")
    if not os.path.isfile(lib_path):
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            src = os.path.join(tmp, "paged_attention.c")
            with open(src, "w") as f:
                f.write(source)
            tmp_lib = os.path.join(tmp, "lib.so")
            proc = subprocess.run([cc, *_FLAGS, src, "-o", tmp_lib, "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                logger.warning("cpu_native attention: compile failed (%s); using the torch backend",
                               proc.stderr.strip()[-500:])
                return None
            os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see a partial file
    lib = ctypes.CDLL(lib_path)
    fn = lib.paged_attention_f32
    i64, p = ctypes.c_int64, ctypes.c_void_p
    c_int = ctypes.c_int
    fn.argtypes = [p, p, i64, p, p, p, i64, p, i64, c_int, c_int, c_int, c_int, ctypes.c_float, i64, i64, p, c_int]
    fn.restype = None
    return lib


_scratch = torch.empty(0)


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, positions: torch.Tensor, scale: float, window: int,
                    max_ctx: int) -> None:
    """Decode attention: out[t] = softmax(q[t] K^T * scale) V over the context of token t (row t of
    block_tables), read in place from the block pool. q [T, H, D] may have any row stride."""
    global _scratch
    lib = load_paged_attention()
    assert lib is not None
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.dtype == torch.float32 and q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous()
    assert block_tables.dtype == torch.int64 and block_tables.stride(1) == 1 and positions.dtype == torch.int64
    threads = torch.get_num_threads()
    need = threads * (num_heads // num_kv_heads) * ((max_ctx + 15) // 16 * 16)
    if _scratch.numel() < need:
        # Grow-only and reused: one engine step runs at a time per process.
        _scratch = torch.empty(int(need * 1.25), dtype=torch.float32)
    lib.paged_attention_f32(
        out.data_ptr(), q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), positions.data_ptr(), num_tokens, num_heads, num_kv_heads, head_dim, block_size,
        scale, window, max_ctx, _scratch.data_ptr(), threads)
