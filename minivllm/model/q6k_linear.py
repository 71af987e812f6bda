"""A projection in GGUF's Q6_K, run from the file's own superblocks (csrc/gemv_q6k.c).

llama.cpp's quantizer writes the head of its Q4_0, Q4_K_M and Q5_K_M files (the tied embedding where the model has
no head of its own) in Q6_K: 6.56 bits a weight, 210 bytes a superblock of 256 weights. Converted to int8 blocks of
32 it was 8.5 bits, a third of a 1B model's bytes a token, and an approximation of the file's weights; run as it is,
it is the file's bytes and its exact weights (model/gguf_conversion.py builds it). The layer's machinery is
model/superblock_linear.py's.
"""

from __future__ import annotations

import torch

from minivllm.model.superblock_linear import SUPERBLOCK, SuperblockLinear

SUPERBLOCK_BYTES = 210  # ql 128, qh 64, sc 16, d 2


def dequantize_q6k(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 [N, K / 256 * 210] Q6_K rows -> float32 [N, K] (ggml's dequantize_row_q6_K, vectorized)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, SUPERBLOCK_BYTES)
    nsb = b.shape[1]
    ql = b[..., :128].reshape(n, nsb, 2, 64)
    qh = b[..., 128:192].reshape(n, nsb, 2, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [n, nsb, 16]
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # [n, nsb, 1]
    low = torch.cat([ql & 15, ql >> 4], dim=-1)  # a half's weights 0..63 in the low nibbles, 64..127 in the high
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(n, nsb, 2, 128)  # 32 i + l: bits 2i
    q = (low | (high << 4)).reshape(n, nsb, 16, 16).float() - 32
    return (q * (d * sc)[..., None]).reshape(n, nsb * SUPERBLOCK)[:, :in_features]


class Q6KLinear(SuperblockLinear):
    """Q6_K weights [N, K]; `act_blocks`: x quantized per block of 32 to int8 (w8a8's math), else float x."""

    type_name = "Q6_K"
    fmt = "q6k"
    dequantize_rows = staticmethod(dequantize_q6k)
