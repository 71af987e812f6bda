"""Paged attention: KV written into a preallocated block pool, read back through block tables.

The runner builds one AttentionMetadata per step and publishes it with `forward_context`; every
Attention layer reads it from there, so model code passes only tensors. Tokens of single-token
queries (decodes) come first in the flat batch, then prefill chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model import cpu_kernels


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk in the flat batch: tokens [start, end) at positions num_cached.. onwards."""

    start: int
    end: int
    num_cached: int
    block_table: torch.Tensor | None  # blocks covering cached + new tokens; None when num_cached == 0
    mask: torch.Tensor | None  # [q, ctx] bool; None means plain causal over the chunk itself


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers need for one step."""

    slot_mapping: torch.Tensor  # [T] pool slot (block * block_size + offset) of each new token
    num_decodes: int  # tokens [0, num_decodes) are one-token queries, one sequence each
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    decode_positions: torch.Tensor | None  # [num_decodes] int64, position of each decode token
    decode_rows: torch.Tensor | None  # [num_decodes] int64, arange: decode token i uses table row i
    max_decode_seq_len: int
    sliding_window: int | None
    prefills: list[PrefillSpan]


_metadata: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Publish the step's attention metadata to every Attention layer for one forward."""
    global _metadata
    _metadata = metadata
    try:
        yield
    finally:
        _metadata = None


def get_metadata() -> AttentionMetadata:
    """The metadata of the forward in progress."""
    assert _metadata is not None, "Attention called outside forward_context"
    return _metadata


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache of one layer."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        # Bound by the model runner once the pool exists: [num_blocks, block_size, kv_heads, head_dim] each.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: Callable[..., torch.Tensor] = torch_paged_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] → [T, H*D]."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        md = get_metadata()
        write_kv(self.k_cache, self.v_cache, k, v, md.slot_mapping)
        return self.backend(self, q, k, v, md).view(t, self.num_heads * self.head_dim)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the step's new K/V rows into their pool slots (one op each, no per-sequence loop)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def torch_paged_attention(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          md: AttentionMetadata) -> torch.Tensor:
    """Portable backend in plain PyTorch ops: runs on CPU and CUDA alike.

    Decodes gather their blocks into one padded batch and make a single SDPA call per layer;
    prefill chunks without cached context attend to their own K/V directly (no gather).
    """
    out = torch.empty_like(q)
    nd = md.num_decodes
    gqa = layer.num_kv_heads != layer.num_heads
    if nd:
        out[:nd] = _decode_sdpa(layer, q[:nd], md).squeeze(2)
    for p in md.prefills:
        qi = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
        if p.block_table is None:
            ki = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            vi = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
        else:
            ctx = p.num_cached + (p.end - p.start)
            ki = _gather(layer.k_cache, p.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
            vi = _gather(layer.v_cache, p.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask, is_causal=p.mask is None,
                                            scale=layer.scale, enable_gqa=gqa)
        out[p.start:p.end] = oi.squeeze(0).transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks_in_table * block_size, KVH, D] copy of one sequence's context."""
    return cache[block_table].flatten(0, 1)


def _decode_sdpa(layer: Attention, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
    bt = md.decode_block_tables
    assert bt is not None and md.decode_mask is not None
    b = bt.shape[0]
    kc = layer.k_cache[bt].view(b, -1, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
    vc = layer.v_cache[bt].view(b, -1, layer.num_kv_heads, layer.head_dim).transpose(1, 2)
    return F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=md.decode_mask, scale=layer.scale,
                                          enable_gqa=layer.num_kv_heads != layer.num_heads)


def cpu_native_paged_attention(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               md: AttentionMetadata) -> torch.Tensor:
    """CPU backend: decodes read K/V straight from the pool in a compiled kernel (no gather copy);
    prefill chunks use the same SDPA paths as the torch backend (GEMM-bound there)."""
    nd = md.num_decodes
    if not md.prefills:
        out = torch.empty_like(q)
    else:
        out = torch_paged_attention(layer, q, k, v, replace(md, num_decodes=0))
    if nd:
        cpu_kernels.paged_attention(out[:nd], q[:nd].contiguous(), layer.k_cache, layer.v_cache,
                                    md.decode_block_tables, md.decode_rows, md.decode_positions, layer.scale,
                                    md.sliding_window or 0, md.max_decode_seq_len)
    return out


ATTENTION_BACKENDS: dict[str, Callable[..., torch.Tensor]] = {
    "torch": torch_paged_attention,
    "cpu_native": cpu_native_paged_attention,
}


def get_backend(name: str, device: torch.device, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """Resolve a backend name. 'auto' takes cpu_native for fp32 on CPU when it compiles (it decodes
    several times faster than gathering blocks for SDPA; see benchmarks/micro_attention.py), else torch."""
    native_ok = device.type == "cpu" and dtype == torch.float32
    if name == "auto":
        name = "cpu_native" if native_ok and cpu_kernels.load_paged_attention() is not None else "torch"
    if name == "cpu_native" and not (native_ok and cpu_kernels.load_paged_attention() is not None):
        raise ValueError(f"attention_backend: cpu_native needs float32 on a CPU with a C compiler "
                         f"(got {dtype} on {device})")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; available: auto, {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]
