"""DecodeStack: a model's layers (model/models/decoder.py's families, and GPT-2's through its `stack_parts`) run by
one native call for all-decode steps.

A batch-1 decode step is ~30 layers of nine small native kernels; dispatching them one by one from
Python (module calls, views, ctypes marshalling) cost ~90 us a layer, a tenth of an fp32 step and a
quarter to a third of a quantized one. csrc/decode_stack.c runs the same kernels back to back (a mixture of
experts' router, routing and expert GEMVs too: csrc/moe_decode.c), and the stack is only taken where the
module path would have run them too: every projection (every expert's) planned `native` for the step's shape
class, the compiled paged attention, no prefill tokens. A float32 projection's native kernel past PANELS_PAST
tokens is csrc/gemm_f32.c's GEMM on panels: the stack binds those panels and runs them there too (a 50-sequence
decode step of SmolLM2-135M 0.85x the module path's time: 30 layers' Python dispatch gone; the stack had stopped at
6 tokens). With float32 activations it computes exactly what the modules do (tests/test_decode_stack.py). In a
bfloat16 model (bf16 weights and KV pool) it keeps the residual stream, norms and attention in float32 between the
kernels, where the module path rounds them to bf16 after every op, and rounds each projection's input to bf16 as the
module path's is (so bf16 weights take AVX512-BF16's dot product, csrc/gemv_bf16dot.h): within bf16 tolerance of the
module path. `enforce_eager` (vLLM's switch for its captured CUDA graphs) turns it off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minivllm.model import cpu_kernels
from minivllm.model.attention import CpuNativePagedAttention, get_metadata
from minivllm.model.kernel_plan import SHAPE_CLASSES, shape_class
from minivllm.model.layers import PANELS_PAST
from minivllm.model.moe import SparseMoE
from minivllm.model.split_linear import SplitLinear

_p, _i64, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_MAX_KV_GROUPS = 4  # csrc/decode_stack.c's


class Proj(ctypes.Structure):
    _fields_ = [("w", _p), ("scale", _p), ("mins", _p), ("bias", _p), ("K", _i64), ("N", _i64), ("G", _i64),
                ("fmt", _i64), ("next", _p), ("panels", _p)]


def proj_table(g: cpu_kernels.GemvWeights) -> Proj:
    """csrc/decode_stack.h's proj_t of bound native weights (the caller keeps g alive)."""
    w, scale, mins, bias = g.ptrs
    return Proj(w, scale, mins, bias, g.k, g.n, g.group, g.fmt)


def panels_table(p: cpu_kernels.GemmPanels) -> Proj:
    """proj_t of a float32 weight held as panels alone: no rows (w NULL), so csrc/decode_stack.h runs the panels at
    every row count (the caller keeps p alive)."""
    bias = None if p.bias is None else p.bias.data_ptr()
    return Proj(None, None, None, bias, p.k, p.n, 0, cpu_kernels.GEMV_FORMATS["f32"], None, p.panels.data_ptr())


class _MoE(ctypes.Structure):
    _fields_ = [("E", _i64), ("k", _i64), ("I", _i64), ("norm_topk", _i64), ("router", Proj), ("gate_up", _p),
                ("down", _p), ("shared_I", _i64), ("shared_gate_up", Proj), ("shared_down", Proj),
                ("shared_gate", Proj), ("expert_tokens", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _p), ("attn_out_norm", _p), ("mlp_norm", _p), ("mlp_out_norm", _p), ("q_norm", _p),
                ("k_norm", _p), ("q_norm_size", _i64), ("k_norm_size", _i64), ("cos_sin", _p), ("rot", _i64),
                ("window", _i64), ("group", _i64), ("qkv", Proj), ("o", Proj), ("gate_up", Proj), ("down", Proj),
                ("k_cache", _p), ("v_cache", _p), ("k_scale", _p), ("v_scale", _p), ("moe", _p),
                ("attn_norm_b", _p), ("mlp_norm_b", _p)]


class _Step(ctypes.Structure):
    _fields_ = [("M", _i64), ("H", _i64), ("I", _i64), ("nq", _i64), ("nkv", _i64), ("D", _i64),
                ("block_size", _i64), ("eps", _f), ("scale", _f), ("softcap", _f), ("res_scale", _f), ("act", _i64),
                ("positions", _p), ("slot_mapping", _p * _MAX_KV_GROUPS), ("block_tables", _p * _MAX_KV_GROUPS),
                ("bt_stride", _i64 * _MAX_KV_GROUPS), ("sinks", _i64), ("max_ctx", _i64), ("gemv_scratch", _p),
                ("attn_scratch", _p), ("work", _p), ("num_threads", _i64),
                ("kv_fmt", _i64), ("moe_work", _p), ("moe_ids", _p), ("x_bf16", _i64), ("panels_past", _i64),
                ("norm_kind", _i64), ("final_norm_b", _p)]

# csrc/decode_stack.h's step_t.act: SwiGLU, GeGLU (tanh), and GPT-2's ungated GELU (tanh)
ACT_SILU_MUL, ACT_GELU_TANH_MUL, ACT_GELU_TANH = 0, 1, 2
_ACTS = {"SiluAndMul": ACT_SILU_MUL, "GeluTanhAndMul": ACT_GELU_TANH_MUL}


@dataclass(slots=True)
class StackParts:
    """One layer as the stack runs it: its family's modules in csrc/decode_stack.h's layer_t roles. A family that
    names them otherwise (GPT-2) hands these over from its layers' `stack_parts()`; model/models/decoder.py's are
    read by name (decoder_parts)."""

    norms: tuple[Any, Any, Any, Any]  # before attention, after it, before the MLP, after it (None: none)
    q_norm: Any
    k_norm: Any
    rotary: Any  # its rope table (None: no rotary)
    attn: Any  # the Attention layer: KV pool, window, group, scale
    qkv: Any
    o: Any
    mlp: Any  # a SparseMoE, or None for a dense MLP of gate_up and down
    gate_up: Any
    down: Any
    act: int  # step_t.act
    residual_scale: float


def decoder_parts(layer: Any) -> StackParts:
    """A model/models/decoder.py DecoderLayer's parts."""
    sa, mlp = layer.self_attn, layer.mlp
    sparse = isinstance(mlp, SparseMoE)
    return StackParts(layer.norms, sa.q_norm, sa.k_norm, sa.rotary, sa.attn, sa.qkv_proj, sa.o_proj,
                      mlp if sparse else None, None if sparse else mlp.gate_up_proj, None if sparse else mlp.down_proj,
                      _ACTS.get(type(mlp.act).__name__, -1), layer.residual_scale)


def model_parts(model: Any) -> tuple[list[StackParts], Any] | None:
    """Every layer's parts and the final norm (None: a model the stack does not know)."""
    hook = getattr(model, "stack_parts", None)
    if hook is not None:
        return hook()
    if not isinstance(getattr(model, "layers", None), nn.ModuleList) or not hasattr(model.layers[0], "norms"):
        return None
    return [decoder_parts(layer) for layer in model.layers], model.norm


# The module trees are walked by attribute name (parts.mlp.experts, ...): nn.Module's __getattr__ types every child
# `Tensor | Module`, so the walked objects are `Any`.
def _projections(parts: StackParts) -> tuple[Any, ...]:
    """Every planned projection of a layer: attention's, then the dense MLP's or every expert's (and Qwen2-MoE's
    shared expert's)."""
    mlp = parts.mlp
    if mlp is None:
        found = parts.qkv, parts.o, parts.gate_up, parts.down
    else:
        shared = () if mlp.shared_expert is None else (mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj)
        found = parts.qkv, parts.o, *mlp.experts.gate_up, *mlp.experts.down, *shared
    return tuple(q for p in found for q in (p.planned() if isinstance(p, SplitLinear) else (p,)))


def _panels_now(proj: Any) -> bool:
    """Whether a projection holds csrc/gemm_f32.c's panels now (a float32 Linear planned native past PANELS_PAST)."""
    return getattr(proj, "_panels", None) is not None


def _planned_panels(model: Any) -> list[Any]:
    """The projections planned native past PANELS_PAST where that kernel is the GEMM on panels, their panels made
    now (else the module path makes them lazily, in the first step needing them, after the stack bound its tables)."""
    found = model_parts(model)
    assert found is not None
    return [p for parts in found[0] for p in _projections(parts)
            if any(p.kernels[c].__name__ == "forward_native" and not p.native_rows(largest)
                   for c, (largest, _) in enumerate(SHAPE_CLASSES)) and p.gemm_panels() is not None]


def _native_classes(model: Any, has_panels: Callable[[Any], bool] = _panels_now) -> tuple[bool, ...]:
    """Per shape class: whether every projection of every layer runs a native kernel there that the stack runs
    too: csrc/gemv.c's rows, or, where a float32 Linear's native kernel is the GEMM on panels (past PANELS_PAST
    tokens), those panels bound in the stack (`has_panels`): it runs them past PANELS_PAST rows as the module does."""
    found = model_parts(model)
    assert found is not None
    projs = [p for parts in found[0] for p in _projections(parts)]
    return tuple(all(p.kernels[c].__name__ == "forward_native" and (p.native_rows(largest) or has_panels(p))
                     for p in projs)
                 for c, (largest, _) in enumerate(SHAPE_CLASSES))


class DecodeStack:
    """The bound layer table of one model: pointers resolved once, so a step fills only its own inputs."""

    def __init__(self, model: Any, native_classes: tuple[bool, ...]) -> None:
        lib = cpu_kernels.load_library()
        assert lib is not None
        self._fn = lib.decode_stack_f32
        self.native_classes = native_classes
        self._bind(model)

    def _bind(self, model: Any) -> None:
        """Resolve the layer and step tables (again after a plan made panels the tables lack: work buffers anew)."""
        found = model_parts(model)
        assert found is not None
        layers, norm = found
        first = layers[0]
        attn = first.attn
        self.hidden = norm.weight.shape[0]
        self.inter = max((p.down.in_features for p in layers if p.mlp is None), default=0)
        moes = [p.mlp for p in layers if p.mlp is not None]
        # (experts, top-k, the larger intermediate of an expert and a shared expert): csrc/moe_decode.c's work
        self.moe_shape = (max(m.num_experts for m in moes), max(m.top_k for m in moes),
                          max(max(m.intermediate, _shared_intermediate(m)) for m in moes)) if moes else None
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.dtype = norm.weight.dtype
        self.layers = (_Layer * len(layers))()
        keep: list[object] = []  # every tensor a pointer below refers to stays alive with the stack
        self._with_panels: set[int] = set()  # the projections whose panels are bound (by id)

        def f32(t: torch.Tensor) -> torch.Tensor:
            """The C side reads float32 norms and rope table (copies of a bf16 model's: a few hundred KB)."""
            t = t.detach().float().contiguous()
            keep.append(t)
            return t

        def ptr(module: Any) -> int | None:  # a norm (its `weight`), or None
            return None if module is None else f32(module.weight).data_ptr()

        def bias(module: Any) -> int | None:  # a LayerNorm's bias, or None
            return None if getattr(module, "bias", None) is None else f32(module.bias).data_ptr()

        def bound(proj: Any) -> Proj:
            """A planned projection's (or a router's) native weights, kept alive with the stack; a split one's
            parts chained (each after the first a table of its own, kept)."""
            if isinstance(proj, SplitLinear):
                first, *rest = (bound(p) for p in proj.planned())
                for before, after in zip([first, *rest], rest, strict=False):
                    keep.append(after)
                    before.next = ctypes.addressof(after)
                return first
            panels = getattr(proj, "_panels", None)
            if panels is not None and getattr(proj, "panels_only", bool)():  # (layers.Linear.keep_panels_only)
                keep.append(panels)
                self._with_panels.add(id(proj))
                return panels_table(panels)
            g = proj.gemv_weights()  # a planned projection's, or a router's (model/moe.py's RouterLinear)
            keep.append(g)
            table = proj_table(g)
            if panels is not None:  # (kept: a later plan may release the module's, never the stack's copy)
                keep.append(panels)
                table.panels = panels.panels.data_ptr()
                self._with_panels.add(id(proj))
            return table

        tables: dict[int, torch.Tensor] = {}  # one float32 copy per rope table the layers share
        for parts, row in zip(layers, self.layers, strict=True):
            row.attn_norm, row.attn_out_norm, row.mlp_norm, row.mlp_out_norm = (ptr(n) for n in parts.norms)
            row.attn_norm_b, row.mlp_norm_b = bias(parts.norms[0]), bias(parts.norms[2])
            row.q_norm, row.k_norm = ptr(parts.q_norm), ptr(parts.k_norm)
            row.q_norm_size = parts.q_norm.size if parts.q_norm is not None else 0
            row.k_norm_size = parts.k_norm.size if parts.k_norm is not None else 0
            rotary = parts.rotary
            if rotary is not None:
                if id(rotary) not in tables:
                    tables[id(rotary)] = f32(rotary.cos_sin_cache)
                table = tables[id(rotary)]
                row.cos_sin, row.rot = table.data_ptr(), rotary.rot_dim
            a = parts.attn
            row.window = a.sliding_window or 0
            row.group = a.kv_group
            row.qkv, row.o = bound(parts.qkv), bound(parts.o)
            if parts.mlp is not None:
                moe = self._moe_table(parts.mlp, bound, keep)
                row.moe = ctypes.addressof(moe)
            else:
                row.gate_up, row.down = bound(parts.gate_up), bound(parts.down)
            row.k_cache, row.v_cache = a.k_cache.data_ptr(), a.v_cache.data_ptr()
            keep += [a.k_cache, a.v_cache]
            if a.k_scale is not None:
                row.k_scale, row.v_scale = a.k_scale.data_ptr(), a.v_scale.data_ptr()
                keep += [a.k_scale, a.v_scale]
        self.final_norm = f32(norm.weight)
        final_bias = bias(norm)
        self._keep = keep
        self.num_groups = 1 + max(p.attn.kv_group for p in layers)
        self.gemv_scratch = torch.empty(max((g.scratch_numel for g in keep if isinstance(g, cpu_kernels.GemvWeights)),
                                                 default=1))
        self.block_size = attn.k_cache.shape[1]
        self.step = _Step(H=self.hidden, I=self.inter, nq=self.num_heads, nkv=self.num_kv_heads, D=self.head_dim,
                          block_size=self.block_size, eps=norm.eps, scale=attn.scale,
                          softcap=attn.softcap or 0.0, res_scale=first.residual_scale,
                          act=first.act, gemv_scratch=self.gemv_scratch.data_ptr(),
                          kv_fmt=cpu_kernels.KV_FORMATS[attn.k_cache.dtype], x_bf16=self.dtype == torch.bfloat16,
                          panels_past=PANELS_PAST, norm_kind=int(final_bias is not None), final_norm_b=final_bias)
        self.n_layers = len(layers)
        self._layers_ptr, self._step_ptr = ctypes.addressof(self.layers), ctypes.addressof(self.step)
        self.residual = torch.empty(0)
        self.work = torch.empty(0)
        self.moe_work, self.moe_ids = torch.empty(0), torch.empty(0, dtype=torch.int64)
        self.attn_scratch = torch.empty(0)

    @staticmethod
    def _moe_table(moe: SparseMoE, bound: Any, keep: list[object]) -> _MoE:
        """csrc/moe_decode.c's table of one layer's experts (and arrays it points to, kept alive)."""
        ex = moe.experts
        gate_up = (Proj * moe.num_experts)(*(bound(q) for q in ex.gate_up))
        down = (Proj * moe.num_experts)(*(bound(q) for q in ex.down))
        table = _MoE(E=moe.num_experts, k=moe.top_k, I=moe.intermediate, norm_topk=int(moe.norm_topk_prob),
                     router=bound(moe.gate), gate_up=ctypes.addressof(gate_up), down=ctypes.addressof(down),
                     expert_tokens=moe.expert_tokens.data_ptr())
        if moe.shared_expert is not None:
            se: Any = moe.shared_expert
            table.shared_I = _shared_intermediate(moe)
            table.shared_gate_up, table.shared_down = bound(se.gate_up_proj), bound(se.down_proj)
            table.shared_gate = bound(moe.shared_expert_gate)
        keep += [gate_up, down, table, moe.expert_tokens]
        return table

    @staticmethod
    def build(model: Any) -> DecodeStack | None:
        """The stack for this model, or None where it would not run the same kernels as the module path."""
        found = model_parts(model) if cpu_kernels.available() else None
        if found is None:
            return None
        layers, norm = found
        if any(p.mlp is not None and len(p.mlp.experts.gate_up) != p.mlp.num_experts for p in layers):
            return None  # a rank's share of the experts (expert parallelism): its ranks run the module path
        attn = layers[0].attn
        if not isinstance(attn.backend, CpuNativePagedAttention) or attn.k_cache.dtype not in cpu_kernels.KV_FORMATS:
            return None
        if any(p.attn.kv_group >= _MAX_KV_GROUPS for p in layers):
            return None  # more attention windows than the C step table has room for
        # One step table for all layers: the same activation, attention scale, residual scale and kind of norm
        # (GPT-2's LayerNorms with biases: only before each sublayer, no residual multiplier).
        layer_norm = getattr(norm, "bias", None) is not None
        if len({(p.act, p.attn.scale, p.residual_scale) for p in layers}) != 1 or layers[0].act < 0 or any(
                (getattr(n, "bias", None) is not None) != layer_norm for p in layers for n in p.norms if n is not None):
            return None
        if layer_norm and (layers[0].residual_scale != 1.0 or any(p.norms[1] or p.norms[3] for p in layers)):
            return None
        _planned_panels(model)
        classes = _native_classes(model)
        return DecodeStack(model, classes) if any(classes) else None

    def refresh(self, model: Any) -> None:
        """The shape classes it runs, after a kernel plan changed (a class newly planned native past PANELS_PAST:
        its panels made and bound now, as Linear.release_unused makes them after the start-up plan)."""
        if any(id(p) not in self._with_panels for p in _planned_panels(model)):
            self._bind(model)
        self.native_classes = _native_classes(model, lambda p: id(p) in self._with_panels)

    def accepts(self, num_tokens: int) -> bool:
        """Whether this step is all decodes and its shape class runs native kernels throughout."""
        md = get_metadata()
        if md.num_decodes != num_tokens or md.prefills or md.lora is not None:
            return False  # (LoRA deltas are added by the projections' Python path)
        return self.native_classes[shape_class(num_tokens)]

    def __call__(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embeddings h [M, H] (float32 ones are written in place) → final-normed hidden states [M, H], in the
        model's dtype."""
        md = get_metadata()
        m = h.shape[0]
        h = h if h.dtype == torch.float32 else h.float()
        assert h.is_contiguous()
        self.reserve(m, md.max_decode_seq_len)
        s = self.step
        s.M, s.positions, s.sinks = m, positions.data_ptr(), md.sink_tokens
        for g in range(self.num_groups):
            bt = md.decode_tables(g)
            assert bt is not None
            s.slot_mapping[g], s.block_tables[g], s.bt_stride[g] = md.slots(g).data_ptr(), bt.data_ptr(), bt.stride(0)
        self._fn(self._layers_ptr, self.n_layers, self.final_norm.data_ptr(), self._step_ptr, h.data_ptr(),
                 self.residual.data_ptr())
        return h if self.dtype == torch.float32 else h.to(self.dtype)

    def native_args(self) -> tuple[int, int, int, int]:
        """The layer table, its length, the final norm and the step table: the first arguments of
        decode_stack_f32 and of the native loops built on it (csrc/greedy_loop.c)."""
        return self._layers_ptr, self.n_layers, self.final_norm.data_ptr(), self._step_ptr

    def reserve(self, m: int, max_ctx: int) -> None:
        """Work buffers for steps of up to m rows attending to up to max_ctx positions, and the step's thread
        count and maximum context (model/greedy_loop.py's rounds fill the rest of the step themselves)."""
        if self.residual.shape[0] < m:
            self.residual = torch.empty(m, self.hidden)
            qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            self.work = torch.empty(m * (2 * self.hidden + qkv + self.num_heads * self.head_dim + 3 * self.inter + 96))
            if self.moe_shape is not None:  # csrc/moe_decode.c's: max(M, k) (E + k + 2H + 3 Imax) floats, 3 M k ids
                e, k, inter = self.moe_shape
                self.moe_work = torch.empty(max(m, k) * (e + k + 2 * self.hidden + 3 * inter))
                self.moe_ids = torch.empty(3 * m * k, dtype=torch.int64)
                self.step.moe_work, self.step.moe_ids = self.moe_work.data_ptr(), self.moe_ids.data_ptr()
        threads = torch.get_num_threads()
        need = cpu_kernels.attention_scratch_floats(threads, self.num_heads, max_ctx)
        if self.attn_scratch.numel() < need:
            self.attn_scratch = torch.empty(int(need * 1.25) + 256)
        s = self.step
        s.max_ctx, s.attn_scratch, s.work = max_ctx, self.attn_scratch.data_ptr(), self.work.data_ptr()
        s.num_threads = threads


def _shared_intermediate(moe: SparseMoE) -> int:
    """Qwen2-MoE's shared expert's intermediate size (0: none)."""
    se: Any = moe.shared_expert
    return 0 if se is None else int(se.down_proj.in_features)
