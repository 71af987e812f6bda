"""Quantized KV cache (--kv-cache-dtype int8 | fp8): storage dtypes, and quantize / dequantize in torch ops.

Each (token, kv head) row of K and of V is stored as one byte per value with its own float16 scale
(absmax / qmax). Finer than a scale per block: a block fills one token at a time, so a per-block scale
would either be fixed before the block's later tokens are seen (clipping them) or force the block to be
requantized as it grows; a per-row scale is written once with its row, needs no coordination between the
threads writing one block, and costs 2 bytes per head_dim bytes (3% at head_dim 64). The native kernels
(csrc/fused_ops.c kv_quantize_rows, csrc/paged_attention.c) do the same arithmetic for int8.
"""

from __future__ import annotations

import torch

# The largest finite float16: a scale past it (|x| > 8.3e6 in int8) saturates rather than overflowing.
_FP16_MAX = 65504.0


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's element dtype for a --kv-cache-dtype value (auto: the model's dtype). fp8 needs a device
    with fp8 arithmetic: a CUDA GPU of compute capability 8.9 or later."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"kv_cache_dtype: fp8 needs a CUDA GPU with fp8 (compute capability 8.9+), not "
                             f"{device}; use int8 (same size, native kernels on CPU)")
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype: unknown {kv_cache_dtype!r}; choose auto, int8 or fp8")


def indexable(t: torch.Tensor) -> torch.Tensor:
    """t as bytes where it holds fp8: CUDA's index, index_put and index_copy kernels take no float8 dtype (torch 2.11
    on an H200: "index_copy_cuda" not implemented for 'Float8_e4m3fn'), and the pool's gathers, scatters and block
    copies only move values. Any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a pool of this dtype holds quantized rows with scales."""
    return dtype in (torch.int8, torch.float8_e4m3fn)


def _qmax(dtype: torch.dtype) -> float:
    return 127.0 if dtype == torch.int8 else torch.finfo(dtype).max


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] → (values [..., D] of dtype, float16 scales [...]): scale = absmax / qmax rounded to
    float16; values x / scale (rounded to nearest even for int8). An all-zero row gets scale 0."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / _qmax(dtype)).clamp_(max=_FP16_MAX).half()
    sf = scale.float()
    inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf)).unsqueeze(-1)
    if dtype == torch.int8:
        q = (xf * inv).round_().clamp_(-127, 127).to(torch.int8)
    else:
        q = (xf * inv).to(dtype)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., D], float16 scales [...]) → rows of `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
