"""Tensor parallelism: a loaded model's weights cut into one rank's shard, and the collectives that join
the shards (distributed/shm_comm.py: shared memory on CPU, else torch.distributed's gloo or NCCL).

Megatron's split, as vLLM does it: the fused qkv and gate/up projections are column-parallel (each rank
computes its own heads and its slice of the MLP), o_proj and down are row-parallel (each rank multiplies
its slice of the input and an all-reduce sums the partial outputs; the bias is added by rank 0 alone),
the token embedding is vocab-parallel (each rank looks up its rows, zeros elsewhere, all-reduce) and so is
the LM head (each rank computes its vocabulary slice, an all-gather joins the logits). KV heads are split
with the query heads; with fewer KV heads than ranks, each rank keeps the one KV head its query heads
read (replicated across the ranks that share it). Sharding runs on the loaded full-precision model,
before quantization and kernel planning, so every later stage sees only the rank's shard.

A mixture of experts' layer is split by experts (expert parallelism): each rank keeps E / size whole experts
and, for every token, adds the outputs of those of its k chosen experts that it holds; the router is
replicated, so every rank routes identically (the all-reduce gives every rank the same bits). Qwen2-MoE's
shared expert is split like a dense MLP and its partial output joins the routed one: one all-reduce per MoE
layer, after the whole block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.distributed.shm_comm import get_comm
from minivllm.engine_config import ParallelConfig


def check_tensor_parallel(mc: ModelConfig, size: int, intermediate: int | None) -> None:
    """Raise a clear error where the model cannot be split `size` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if size > mc.num_heads or mc.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {mc.num_heads} attention heads "
                         f"(and be at most that many)")
    kv = mc.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size}: the model's {kv} KV heads can neither be split {size} ways "
                         f"nor replicated evenly ({size} is not a multiple of {kv})")
    if intermediate is not None and intermediate % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the MLP's intermediate size {intermediate}")
    cfg = mc.hf_config
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {experts} experts (each rank holds "
                         "an equal share of every MoE layer's experts)")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the shared expert's intermediate size {shared}")


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _rows(w: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([w[a:b] for a, b in spans])


# The helpers below walk and rewrite a model's module tree by attribute name (layers[i].self_attn.o_proj.weight,
# ...); nn.Module's __getattr__ types every child `Tensor | Module`, so the walked objects are `Any`.
def _column_parallel(lin: Any, spans: list[tuple[int, int]]) -> None:
    """Keep the output rows in `spans` (weight [out, in], bias [out])."""
    lin.weight = _param(_rows(lin.weight.data, spans))
    if lin.bias is not None:
        lin.bias = _param(_rows(lin.bias.data, spans))
    lin.out_features = lin.weight.shape[0]


def _row_parallel(lin: Any, start: int, end: int, rank: int) -> None:
    """Keep input columns [start, end); partial outputs are summed across ranks after the matmul, so only
    rank 0 keeps the bias."""
    lin.weight = _param(lin.weight.data[:, start:end])
    if lin.bias is not None and rank:
        lin.bias = _param(torch.zeros_like(lin.bias.data))
    lin.in_features = end - start


def _all_reduce_hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    get_comm().all_reduce(out)
    return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding table; ids outside give zeros, summed across ranks."""

    def __init__(self, weight: torch.Tensor, start: int) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        get_comm().all_reduce(out)
        return out


def _vocab_shard(weight: torch.Tensor, vocab: int, pc: ParallelConfig) -> tuple[torch.Tensor, int]:
    """This rank's rows of a [vocab, H] table, the vocabulary padded to a multiple of the ranks (the last
    rank's padding rows are zeros: their logits are cut off after the gather)."""
    per = -(-vocab // pc.size)
    start = pc.rank * per
    rows = weight[start:min(start + per, vocab)]
    if rows.shape[0] < per:
        rows = torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])])
    return rows, start


def _shard_vocab(model: Any, embed_name: str, vocab: int, pc: ParallelConfig) -> None:
    """Vocab-parallel embedding and LM head (tied ones share the shard); logits gathered to the full vocab."""
    embed: nn.Embedding = getattr(model, embed_name)
    tied = model.lm_head.weight is embed.weight
    rows, start = _vocab_shard(embed.weight.data, vocab, pc)
    setattr(model, embed_name, VocabParallelEmbedding(rows, start))
    head = model.lm_head
    if tied:
        head.weight = getattr(model, embed_name).weight
    else:
        head.weight = _param(_vocab_shard(head.weight.data, vocab, pc)[0])
    head.out_features = head.weight.shape[0]


def _head_spans(first: int, count: int, d: int, offset: int = 0) -> list[tuple[int, int]]:
    return [(offset + first * d, offset + (first + count) * d)]


def _row_parallel_names(model: Any) -> list[str]:
    """The modules whose outputs are partial sums: o_proj and the MLP's down projection, or a whole MoE block."""
    if hasattr(model, "layers"):
        return [f"layers.{i}.{m}" for i, layer in enumerate(model.layers)
                for m in ("self_attn.o_proj", "mlp" if hasattr(layer.mlp, "experts") else "mlp.down_proj")]
    return [f"h.{i}.{m}" for i in range(len(model.h)) for m in ("attn.c_proj", "mlp.c_proj")]


def attach_collectives(model: nn.Module, mc: ModelConfig, pc: ParallelConfig) -> None:
    """The all-reduce after every row-parallel projection and the logits' all-gather, as forward hooks on the
    final modules (after quantization, which replaces the projections)."""
    if pc.size == 1:
        return
    for name in _row_parallel_names(model):
        model.get_submodule(name).register_forward_hook(_all_reduce_hook)
    vocab = mc.vocab_size

    def gather(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        return torch.cat(get_comm().all_gather(out), dim=-1)[..., :vocab]

    model.get_submodule("lm_head").register_forward_hook(gather)


def _shard_gated_mlp(mlp: Any, r: int, n: int) -> None:
    """Column-parallel gate/up (this rank's slice of both halves), row-parallel down."""
    inter = mlp.down_proj.in_features
    per = inter // n
    _column_parallel(mlp.gate_up_proj, [(r * per, (r + 1) * per), (inter + r * per, inter + (r + 1) * per)])
    _row_parallel(mlp.down_proj, r * per, (r + 1) * per, r)


def _shard_experts(moe: Any, r: int, n: int) -> None:
    """Keep experts [r E/n, (r+1) E/n) of a MoE block (model/moe.py) and this rank's slice of its shared expert."""
    per = moe.num_experts // n
    moe.keep_experts(r * per, (r + 1) * per)
    if moe.shared_expert is not None:
        _shard_gated_mlp(moe.shared_expert, r, n)


def shard_model(model: nn.Module, mc: ModelConfig, pc: ParallelConfig) -> None:
    """Cut a loaded Llama-family or GPT-2 model down to rank pc.rank's shard, in place (attach_collectives
    then joins the shards)."""
    if pc.size == 1:
        return
    r, n, d = pc.rank, pc.size, mc.head_dim
    hq = mc.num_heads // n
    tree: Any = model  # walked by attribute name (see _column_parallel)
    if hasattr(model, "layers"):  # Llama, Mistral, Qwen2
        kv = mc.kv_heads_per_rank(n)
        kv_first = r * hq // (mc.num_heads // mc.num_kv_heads)  # the KV head of this rank's first query head
        q_size, kv_size = mc.num_heads * d, mc.num_kv_heads * d
        for layer in tree.layers:
            attn = layer.self_attn
            _column_parallel(attn.qkv_proj, _head_spans(r * hq, hq, d) + _head_spans(kv_first, kv, d, q_size)
                             + _head_spans(kv_first, kv, d, q_size + kv_size))
            _row_parallel(attn.o_proj, r * hq * d, (r + 1) * hq * d, r)
            attn.q_size, attn.kv_size = hq * d, kv * d
            attn.attn.num_heads, attn.attn.num_kv_heads = hq, kv
            if hasattr(layer.mlp, "experts"):
                _shard_experts(layer.mlp, r, n)
            else:
                _shard_gated_mlp(layer.mlp, r, n)
        _shard_vocab(model, "embed_tokens", mc.vocab_size, pc)
    elif hasattr(model, "h"):  # GPT-2: fused [q; k; v] rows, heads == KV heads
        hidden = mc.hidden_size
        for block in tree.h:
            attn = block.attn
            _column_parallel(attn.c_attn, [(i * hidden + r * hq * d, i * hidden + (r + 1) * hq * d) for i in range(3)])
            _row_parallel(attn.c_proj, r * hq * d, (r + 1) * hq * d, r)
            attn.attn.num_heads = attn.attn.num_kv_heads = hq
            inner = block.mlp.c_fc.out_features
            per = inner // n
            _column_parallel(block.mlp.c_fc, [(r * per, (r + 1) * per)])
            _row_parallel(block.mlp.c_proj, r * per, (r + 1) * per, r)
        _shard_vocab(model, "wte", mc.vocab_size, pc)
    else:
        raise ValueError(f"tensor parallelism: no sharding rule for {type(model).__name__}")


def intermediate_size(mc: ModelConfig) -> int:
    """The MLP width the split must divide (GPT-2: n_inner, default 4 * hidden)."""
    cfg = mc.hf_config
    return int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * mc.hidden_size)
