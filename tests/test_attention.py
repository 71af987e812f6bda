"""Paged attention backends agree with a dense reference on random pools, block tables and windows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels

needs_native = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")


def _dense_reference(q, k_ctx, v_ctx, pos, window):
    """q [H, D] at position pos over k/v [pos+1, KVH, D] (one token), GQA by repetition."""
    h, kvh = q.shape[0], k_ctx.shape[1]
    k = k_ctx.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    v = v_ctx.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    keep = torch.arange(pos + 1) > pos - window if window else torch.ones(pos + 1, dtype=torch.bool)
    return F.scaled_dot_product_attention(q[:, None], k, v, attn_mask=keep[None, None, :]).squeeze(1)


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window"), [
    (9, 3, 64, 0),  # SmolLM2 (compiled specialisation)
    (14, 2, 64, 0),  # Qwen2.5-0.5B, G = 7
    (8, 8, 16, 5),  # MHA, tiny head dim (generic vector body)
    (10, 2, 32, 0),  # G = 5, D = 32 (generic vector body)
    (6, 3, 24, 7),  # head dim not a multiple of 16 (scalar body), sliding window
])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_native_matches_dense(heads, kv_heads, head_dim, window, cache_dtype):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    bs, num_blocks = 16, 64
    lens = [1, 7, 16, 17, 50, 130]
    # A bf16 pool is read as the float32 values of its bf16 numbers: the reference uses the same numbers.
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen).to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), 16, dtype=torch.int64)
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
    # q as a view into a wider buffer, as it arrives from the fused qkv projection.
    q = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=gen)[:, :heads]
    out = torch.empty(len(lens), heads, head_dim)
    pos = torch.tensor([n - 1 for n in lens])
    cpu_kernels.paged_attention(out, q, k_cache, v_cache, tables, pos, 1 / math.sqrt(head_dim), window, max(lens))
    for i, n in enumerate(lens):
        slots = torch.stack([tables[i, p // bs] * bs + p % bs for p in range(n)])
        k_ctx = k_cache.view(-1, kv_heads, head_dim)[slots].float()
        v_ctx = v_cache.view(-1, kv_heads, head_dim)[slots].float()
        torch.testing.assert_close(out[i], _dense_reference(q[i], k_ctx, v_ctx, n - 1, window), atol=1e-5, rtol=0)


def _softcapped_reference(q, k_ctx, v_ctx, keep, scale, softcap):
    """Dense attention of one token over k/v [n, KVH, D] keeping keys `keep`, with optional score soft-capping."""
    h, kvh = q.shape[0], k_ctx.shape[1]
    k = k_ctx.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    v = v_ctx.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    s = torch.einsum("hd,hnd->hn", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("hn,hnd->hd", s.softmax(-1), v)


@needs_native
@pytest.mark.parametrize("num_tokens", [1, 3, 48])  # one-head items; ranges of kv heads; whole-row items
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(12, 12, 64), (32, 8, 64), (9, 3, 64), (14, 2, 64),
                                                         (20, 4, 128), (16, 2, 256), (6, 2, 48)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_native_row_items_match_dense(num_tokens, heads, kv_heads, head_dim, cache_dtype):
    """A batch of decodes reads all kv heads of a slot per work item (row items, heads reduced 16 at a time); a
    single sequence one head per item. Every split, cache format, window with attention sinks and soft-capping
    agrees with dense attention over the same (dequantized) values."""
    from minivllm.model.kv_quant import dequantize_kv, quantize_kv

    gen = torch.Generator().manual_seed(heads * 7 + num_tokens)
    bs, num_blocks, scale = 16, 160, head_dim**-0.5
    lens = [1 + (37 * i + 11) % 150 for i in range(num_tokens)]
    k32 = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
    v32 = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
    k_scale = v_scale = None
    if cache_dtype == torch.int8:
        (k_cache, k_scale), (v_cache, v_scale) = quantize_kv(k32, torch.int8), quantize_kv(v32, torch.int8)
        k_ref, v_ref = dequantize_kv(k_cache, k_scale, torch.float32), dequantize_kv(v_cache, v_scale, torch.float32)
    else:
        k_cache, v_cache = k32.to(cache_dtype), v32.to(cache_dtype)
        k_ref, v_ref = k_cache.float(), v_cache.float()
    tables = torch.zeros(num_tokens, 10, dtype=torch.int64)
    for i, n in enumerate(lens):  # sequences may share blocks: only reads happen here
        tables[i, :-(-n // bs)] = torch.randperm(num_blocks, generator=gen)[:-(-n // bs)]
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    pos = torch.tensor([n - 1 for n in lens])
    for window, sinks, softcap in ((0, 0, 0.0), (40, 4, 0.0), (0, 0, 2.5)):
        out = torch.empty(num_tokens, heads, head_dim)
        cpu_kernels.paged_attention(out, q, k_cache, v_cache, tables, pos, scale, window, max(lens), k_scale, v_scale,
                                    sinks, softcap)
        for i, n in enumerate(lens):
            slots = torch.stack([tables[i, p // bs] * bs + p % bs for p in range(n)])
            kk, vv = k_ref.view(-1, kv_heads, head_dim)[slots], v_ref.view(-1, kv_heads, head_dim)[slots]
            p = torch.arange(n)
            keep = (p > n - 1 - window) | (p < sinks) if window else torch.ones(n, dtype=torch.bool)
            torch.testing.assert_close(out[i], _softcapped_reference(q[i], kk, vv, keep, scale, softcap),
                                       atol=2e-5, rtol=1e-4)
