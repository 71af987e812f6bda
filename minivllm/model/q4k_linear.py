"""A projection in GGUF's Q4_K, run from the file's own superblocks (csrc/gemv_q4k.c).

Most of a llama.cpp Q4_K_M file's projections are Q4_K: 4.5 bits a weight, 144 bytes a superblock of 256 weights
(float16 d and dmin, eight 6-bit sub-block scales and mins, 128 bytes of codes). As int4 groups of 32 with a float16
scale and a float32 min (what the load made of them before) they were 5.5 bits and their scales rounded; run as they
are, they are the file's bytes and its exact weights (model/gguf_blocks.py places them). The layer's machinery is
model/superblock_linear.py's.
"""

from __future__ import annotations

import torch

from minivllm.model.superblock_linear import SUPERBLOCK, SuperblockLinear

SUPERBLOCK_BYTES = 144  # d 2, dmin 2, scales and mins 12, codes 128


def dequantize_q4k(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 [N, K / 256 * 144] Q4_K rows -> float32 [N, K] (ggml's get_scale_min_k4 and dequantize_row_q4_K)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, SUPERBLOCK_BYTES)
    nsb = b.shape[1]
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [n, nsb, 1]
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()
    s = b[..., 4:16]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1).float()
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1).float()
    qs = b[..., 16:].reshape(n, nsb, 4, 1, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high
    q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, nsb, 8, 32).float()
    w = q * (d * sc)[..., None] - (dmin * mn)[..., None]
    return w.reshape(n, nsb * SUPERBLOCK)[:, :in_features]


class Q4KLinear(SuperblockLinear):
    """Q4_K weights [N, K]; `act_blocks`: x quantized per block of 32 to int8 (w8a8's math), else float x."""

    type_name = "Q4_K"
    fmt = "q4k"
    dequantize_rows = staticmethod(dequantize_q4k)
