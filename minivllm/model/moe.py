"""A mixture-of-experts MLP on the CPU: a router picks top-k experts per token, tokens are grouped by expert, and
each active expert runs one GEMM over all its tokens (GEMV at one token); results are scattered back weighted by
their routing probabilities. No Python runs per token: the loop is over the experts that received any.

Every family (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) routes the same way in transformers: softmax of the router
logits in float32 over all experts, top-k, renormalised to sum 1 where the config says (`norm_topk_prob`;
Mixtral always), cast back to the model's dtype. Qwen2-MoE adds a shared expert (a dense gated MLP) scaled by
sigmoid(shared_expert_gate(x)). Checkpoints hold the experts merged per layer (gate_up_proj [E, 2I, H], gate rows
first, and down_proj [E, H, I]) or one by one; they run as a Linear per expert and projection (Experts), the
layout and kernel the model's plan picks for their shapes (one expert's GEMV at decode streams oneDNN's packed
layout at 21 GB/s here where a slice of the merged tensor through aten streamed 14).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from minivllm.model import cpu_kernels
from minivllm.model.layers import ACTIVATIONS, GatedMLP, Linear


@dataclass(frozen=True, slots=True)
class MoESpec:
    """A family's expert layers, read from its config."""

    num_experts: int
    top_k: int
    intermediate: int  # each expert's (moe_intermediate_size)
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (0: none)


class Experts(nn.Module):
    """The experts of one layer: a gate/up and a down projection each, our Linear layers, so they run on the kernels
    the model's plan times for their shapes (oneDNN's packed layout, the native GEMV at one token) and quantize
    with the model (--quantization: a QuantizedLinear each). Checkpoints store them merged ([E, 2I, H] and
    [E, H, I]) or one by one: both load into these (DecoderForCausalLM.load_weights)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.start = 0  # the global id of gate_up[0]: under expert parallelism a rank holds a contiguous share
        self.gate_up = nn.ModuleList(Linear(hidden, 2 * intermediate, bias=False) for _ in range(num_experts))
        self.down = nn.ModuleList(Linear(intermediate, hidden, bias=False) for _ in range(num_experts))
        for layer in (*self.gate_up, *self.down):
            cast(Linear, layer).routed = True

    def holds(self, e: int) -> bool:
        """Whether global expert e is held here (all of them without expert parallelism)."""
        return 0 <= e - self.start < len(self.gate_up)

    def run(self, e: int, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """Global expert e's gated MLP over its tokens x [n, H]: one GEMM (GEMV at one token) per projection."""
        return cast(torch.Tensor, self.down[e - self.start](act(self.gate_up[e - self.start](x))))


class RouterLinear(nn.Linear):
    """A router (or shared-expert gate): torch's Linear, never quantized (it is tiny and decides discrete choices),
    computed in float32 on the CPU by the same native GEMV the decode stack binds (gemv_weights), so the module path
    and the stack route alike: two summation orders once put two experts' logits on either side of a top-k cut, and
    under W4A8, whose activation codes turn 1-ulp differences into steps, the paths' logits then parted by 1e-2."""

    _gemv: cpu_kernels.GemvWeights | None = None

    def gemv_weights(self) -> cpu_kernels.GemvWeights:
        """The weight bound for csrc/gemv.c, in its float type (built on first use, once the weights are final)."""
        if self._gemv is None:
            self._gemv = cpu_kernels.GemvWeights.dense(self.weight, self.in_features, self.bias)
        return self._gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type == "cpu" \
                and cpu_kernels.available():
            return self.gemv_weights()(x if x.is_contiguous() else x.contiguous())
        return super().forward(x)


class SparseMoE(nn.Module):
    """The MoE block that takes a decoder layer's MLP place: [T, H] -> [T, H]."""

    expert_tokens: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, hidden: int, spec: MoESpec, act: str, mlp_bias: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = spec.num_experts, spec.top_k, spec.norm_topk_prob
        self.intermediate = spec.intermediate
        self.gate = RouterLinear(hidden, spec.num_experts, bias=False)
        self.experts = Experts(spec.num_experts, hidden, spec.intermediate)
        self.act = ACTIVATIONS[act]()
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: RouterLinear | None = None
        if spec.shared_intermediate:
            self.shared_expert = GatedMLP(hidden, spec.shared_intermediate, mlp_bias, act)
            self.shared_expert_gate = RouterLinear(hidden, 1, bias=False)
        # Tokens routed to each expert since start-up (/metrics: minivllm:moe_expert_tokens_total).
        self.register_buffer("expert_tokens", torch.zeros(spec.num_experts, dtype=torch.int64), persistent=False)

    def reset_buffers(self) -> None:
        """The counters from zero (the loader builds the model on the meta device: to_empty leaves them garbage,
        and /metrics reported start-up counts in the trillions)."""
        self.expert_tokens.zero_()

    def keep_experts(self, start: int, end: int) -> None:
        """Expert parallelism (distributed/parallel.py): hold experts [start, end) only; the others' tokens add
        nothing here (another rank's partial sum carries them). The router stays whole: every rank routes alike
        and counts every routed token."""
        ex = self.experts
        ex.gate_up, ex.down = nn.ModuleList(ex.gate_up[start:end]), nn.ModuleList(ex.down[start:end])
        ex.start = start

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as transformers' routers compute them."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if x.shape[0] == 1:  # one decoding sequence: its k experts in turn, no grouping to do (a third of the ops)
            return self._one_token(x, weights[0], ids[0])
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_tokens += counts
        token_of = order // self.top_k
        xs = x.index_select(0, token_of)
        whole = len(self.experts.gate_up) == self.num_experts
        out = torch.empty_like(xs) if whole else torch.zeros_like(xs)  # (another rank's experts' rows: 0)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n and self.experts.holds(e):
                out[start:start + n] = self.experts.run(e, xs[start:start + n], self.act)
            start += n
        out.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1))
        y = torch.zeros_like(x).index_add_(0, token_of, out)
        return self._add_shared(x, y)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.expert_tokens.index_add_(0, ids, torch.ones_like(ids))
        y: torch.Tensor | None = None
        for w, e in zip(weights.tolist(), ids.tolist(), strict=True):
            if self.experts.holds(e):
                out = self.experts.run(e, x, self.act).mul_(w)
                y = out if y is None else y.add_(out)
        return self._add_shared(x, torch.zeros_like(x) if y is None else y)

    def _add_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Qwen2-MoE's shared expert, gated per token, added to the routed experts' sum y."""
        if self.shared_expert is None:
            return y
        assert self.shared_expert_gate is not None
        return y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def expert_load(model: nn.Module) -> dict[int, list[int]]:
    """Tokens routed to each expert since start-up, per MoE layer index (empty for a dense model)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return {}
    return {i: cast(SparseMoE, layer.mlp).expert_tokens.tolist() for i, layer in enumerate(layers)
            if isinstance(getattr(layer, "mlp", None), SparseMoE)}


def moe_spec(cfg: dict[str, Any], num_layers: int, norm_topk_prob: bool, shared: bool = False) -> MoESpec:
    """The expert layers a config describes: experts (num_experts or Mixtral's num_local_experts), top-k, each
    expert's size (moe_intermediate_size, or Mixtral's intermediate_size), the sparse layers (Qwen's
    decoder_sparse_step and mlp_only_layers: every layer by default), Qwen2-MoE's shared expert."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"mixture of experts: num_experts_per_tok {top_k} of {experts} experts; it needs 1 to "
                         "num_experts")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoESpec(experts, top_k, int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]), norm_topk_prob,
                   sparse, int(cfg.get("shared_expert_intermediate_size") or 0) if shared else 0)
