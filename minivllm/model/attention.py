"""Paged attention: KV written into a preallocated block pool, read back through block tables.

The runner builds one AttentionMetadata per step and publishes it with `forward_context`; every
Attention layer reads it from there, so model code passes only tensors. Tokens of single-token
queries (decodes) come first in the flat batch, then prefill chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model import cpu_kernels
from minivllm.model.kv_quant import dequantize_kv, indexable, quantize_kv

if TYPE_CHECKING:
    from minivllm.model.lora import LoRAMapping


@dataclass(slots=True)
class PrefillSpan:
    """One prefill chunk in the flat batch: tokens [start, end) at positions num_cached.. onwards."""

    start: int
    end: int
    num_cached: int
    block_table: torch.Tensor | None  # blocks covering cached + new tokens; None when num_cached == 0
    # Attention window → [q, ctx] bool mask (None: plain causal over the chunk itself), built on first use: a
    # model whose layers have different windows (Gemma's local and global layers) needs one per window.
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    group_tables: list[torch.Tensor] = field(default_factory=list)  # its blocks in KV groups 1.. (engine/kv_groups)


@dataclass(slots=True)
class KVGroupTables:
    """One KV group's view of the step (engine/kv_groups.py: the layers of one window share a pool and tables)."""

    slot_mapping: torch.Tensor  # [T] slot of each new token in the group's pool
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] in the group's pool


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers need for one step."""

    slot_mapping: torch.Tensor  # [T] pool slot (block * block_size + offset) of each new token
    num_decodes: int  # tokens [0, num_decodes) are one-token queries, one sequence each
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]; row i is decode token i's sequence
    decode_positions: torch.Tensor | None  # [num_decodes] int64, position of each decode token
    max_decode_seq_len: int
    prefills: list[PrefillSpan]
    sink_tokens: int = 0  # with a window: the first positions every token still attends to (attention sinks)
    lora: LoRAMapping | None = None  # which tokens use which LoRA slot (model/lora.py); None: no adapter this step
    # The torch backend's decode key masks [num_decodes, 1, 1, max_blocks * block_size] per (window, KV group), on
    # first use.
    decode_masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)
    groups: list[KVGroupTables] = field(default_factory=list)  # KV groups 1..: slots and tables of their own

    def slots(self, kv_group: int) -> torch.Tensor:
        """The new tokens' slots in a KV group's pool."""
        return self.slot_mapping if kv_group == 0 else self.groups[kv_group - 1].slot_mapping

    def decode_tables(self, kv_group: int) -> torch.Tensor | None:
        """The decode rows' block tables in a KV group's pool."""
        return self.decode_block_tables if kv_group == 0 else self.groups[kv_group - 1].decode_block_tables


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
    """Multi-head / grouped-query attention over the paged KV cache of one layer.

    sliding_window: the layer's window (each token sees its last `sliding_window` positions; None: all), set
    per layer (Gemma alternates local and global layers) and by --kv-eviction sink-window for every layer.
    softcap: Gemma 2's attention logit soft-capping, softcap * tanh(score / softcap)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.kv_group = 0  # its KV group (the runner's: layers of one window share a pool and block tables)
        # Bound by the model runner once the pool exists: [num_blocks, block_size, kv_heads, head_dim] each, and
        # for a quantized cache (--kv-cache-dtype int8) float16 scales [num_blocks, block_size, kv_heads].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchPagedAttention()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] (views with any row stride) → [T, H*D]. kv_written: the caller already
        stored k and v in their cache slots (rope_and_cache)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        md = get_metadata()
        if not kv_written:
            write_kv(self, k, v, md.slots(self.kv_group))
        out = torch.empty(t, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if md.num_decodes:
            self.backend.decode(self, q[:md.num_decodes], md, out[:md.num_decodes])
        for p in md.prefills:
            out[p.start:p.end] = prefill_sdpa(self, q, k, v, p, md.sink_tokens)
        return out.view(t, self.num_heads * self.head_dim)

    def can_fuse_rope(self, qkv: torch.Tensor) -> bool:
        """Whether rope_and_cache can take this fused qkv output (float32 on the CPU, native kernels)."""
        return (qkv.dtype == torch.float32 and self.k_cache.dtype in (torch.float32, torch.int8)
                and qkv.device.type == "cpu" and qkv.stride(-1) == 1 and cpu_kernels.available())

    def rope_and_cache(self, qkv: torch.Tensor, positions: torch.Tensor | None,
                       cos_sin_cache: torch.Tensor | None) -> None:
        """Rotate the q and k heads of qkv in place (not without a table: a NoPE layer) and store k and v in their
        cache slots, in one pass."""
        cpu_kernels.rope_kv_write(qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions, cos_sin_cache,
                                  self.k_cache, self.v_cache, get_metadata().slots(self.kv_group), self.k_scale,
                                  self.v_scale)

    def cached_kv(self, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks in block_table (any shape of block ids), gathered as `dtype`:
        [*block_table.shape, block_size, kv_heads, head_dim] each (a quantized cache dequantized)."""
        if self.k_scale is None:
            return self.k_cache[block_table], self.v_cache[block_table]
        k = indexable(self.k_cache)[block_table].view(self.k_cache.dtype)
        v = indexable(self.v_cache)[block_table].view(self.v_cache.dtype)
        assert self.v_scale is not None
        return (dequantize_kv(k, self.k_scale[block_table], dtype), dequantize_kv(v, self.v_scale[block_table], dtype))


def write_kv(layer: Attention, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the step's new K/V rows into their pool slots (one op each, no per-sequence loop); a quantized
    cache stores each row's values and scale."""
    kvh, d = layer.k_cache.shape[-2:]
    for cache, scales, x in ((layer.k_cache, layer.k_scale, k), (layer.v_cache, layer.v_scale, v)):
        if scales is None:
            cache.view(-1, kvh, d).index_copy_(0, slot_mapping, x)
        else:
            q, s = quantize_kv(x, cache.dtype)
            indexable(cache).view(-1, kvh, d).index_copy_(0, slot_mapping, indexable(q))
            scales.view(-1, kvh).index_copy_(0, slot_mapping, s)


def prefill_mask(p: PrefillSpan, window: int | None, sinks: int, device: torch.device) -> torch.Tensor | None:
    """The [q, ctx] key mask of a prefill chunk under a window (None: plain causal suffices), built once per
    window per step."""
    if window in p.masks:
        return p.masks[window]
    q = p.end - p.start
    mask = None
    if p.num_cached or (window is not None and q > window):
        ctx = p.num_cached + q
        q_pos = torch.arange(p.num_cached, ctx, device=device)[:, None]
        k_pos = torch.arange(ctx, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= (k_pos > q_pos - window) | (k_pos < sinks)
    p.masks[window] = mask
    return mask


def decode_mask(md: AttentionMetadata, window: int | None, block_size: int, kv_group: int = 0) -> torch.Tensor:
    """The torch backend's key mask of the step's one-token queries under a window, built once per window."""
    mask = md.decode_masks.get((window, kv_group))
    if mask is None:
        tables = md.decode_tables(kv_group)
        assert md.decode_positions is not None and tables is not None
        lens = md.decode_positions[:, None] + 1
        key_pos = torch.arange(tables.shape[1] * block_size, device=lens.device)[None, :]
        mask = key_pos < lens
        if window is not None:
            mask &= (key_pos >= lens - window) | (key_pos < md.sink_tokens)
        mask = md.decode_masks[(window, kv_group)] = mask[:, None, None, :]
    return mask


def attention_softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, softcap: float) -> torch.Tensor:
    """Attention with soft-capped scores (SDPA has no cap): q [B, H, Lq, D], k/v [B, KVH, Lk, D] → [B, H, Lq, D];
    mask [.., Lq, Lk] bool (None: causal over the last Lq keys)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def prefill_sdpa(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: PrefillSpan,
                 sinks: int = 0) -> torch.Tensor:
    """One prefill chunk through SDPA (GEMM-bound, so both backends share it): a chunk without cached
    context attends to its own K/V directly; otherwise its context is gathered from the pool."""
    gqa = layer.num_kv_heads != layer.num_heads
    mask = prefill_mask(p, layer.sliding_window, sinks, q.device)
    qi = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
    table = p.block_table if layer.kv_group == 0 or p.block_table is None else p.group_tables[layer.kv_group - 1]
    if table is None:
        ki = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
        vi = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
    else:
        ctx = p.num_cached + (p.end - p.start)
        kc, vc = layer.cached_kv(table, q.dtype)
        ki = kc.flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
        vi = vc.flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
    if layer.softcap:
        oi = attention_softcapped(qi, ki, vi, mask, layer.scale, layer.softcap)
    else:
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=layer.scale,
                                            enable_gqa=gqa)
    return oi.squeeze(0).transpose(0, 1)


class AttentionBackend:
    """How decode tokens attend to their paged context."""

    def decode(self, layer: Attention, q: torch.Tensor, md: AttentionMetadata, out: torch.Tensor) -> None:
        """Write attention outputs for the md.num_decodes one-token queries q [Bd, H, D] into out."""
        raise NotImplementedError


class TorchPagedAttention(AttentionBackend):
    """Portable backend in plain PyTorch ops (CPU and CUDA alike): decodes gather their blocks into one
    padded batch and make a single SDPA call per layer."""

    def decode(self, layer: Attention, q: torch.Tensor, md: AttentionMetadata, out: torch.Tensor) -> None:
        bt = md.decode_tables(layer.kv_group)
        assert bt is not None
        b, kvh, d = bt.shape[0], layer.num_kv_heads, layer.head_dim
        mask = decode_mask(md, layer.sliding_window, layer.k_cache.shape[1], layer.kv_group)
        kc, vc = layer.cached_kv(bt, q.dtype)
        kc = kc.view(b, -1, kvh, d).transpose(1, 2)
        vc = vc.view(b, -1, kvh, d).transpose(1, 2)
        if layer.softcap:
            o = attention_softcapped(q.unsqueeze(2), kc, vc, mask, layer.scale, layer.softcap)
        else:
            o = F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=mask, scale=layer.scale,
                                               enable_gqa=kvh != layer.num_heads)
        out.copy_(o.squeeze(2))


class CpuNativePagedAttention(AttentionBackend):
    """CPU backend: a compiled kernel reads K/V straight from the pool (no gather copy), float32, bfloat16
    (widened as read) or int8 with its scales; q and the output go through float32."""

    def decode(self, layer: Attention, q: torch.Tensor, md: AttentionMetadata, out: torch.Tensor) -> None:
        tables = md.decode_tables(layer.kv_group)
        assert tables is not None and md.decode_positions is not None
        out32 = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
        cpu_kernels.paged_attention(out32, q if q.dtype == torch.float32 else q.float(), layer.k_cache, layer.v_cache,
                                    tables, md.decode_positions, layer.scale, layer.sliding_window or 0,
                                    md.max_decode_seq_len, layer.k_scale, layer.v_scale, md.sink_tokens,
                                    layer.softcap or 0.0)
        if out32 is not out:
            out.copy_(out32)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchPagedAttention,
    "cpu_native": CpuNativePagedAttention,
}


def get_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Resolve a backend name. 'auto' takes cpu_native for fp32 or bf16 on CPU when it compiles (17.9x the
    torch backend at 64 sequences in fp32, benchmarks/micro_attention.py), else torch."""
    native_ok = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if name == "auto":
        name = "cpu_native" if native_ok and cpu_kernels.available() else "torch"
    if name == "cpu_native" and not (native_ok and cpu_kernels.available()):
        raise ValueError(f"attention_backend: cpu_native needs float32 or bfloat16 on a CPU with a C compiler "
                         f"(got {dtype} on {device})")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend: unknown {name!r}; available: auto, {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()
