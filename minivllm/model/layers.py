"""Building blocks shared by the model families: norms, rotary embedding, activations."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import SHAPE_CLASSES, Kernel, PlannedLinear


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear can run here (CPU, fp32 or bf16)."""
    # bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: without them oneDNN's reorder raises (an AMD EPYC without AVX512).
    bf16_ok = dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16) \
        and bf16_ok


def bucket_rows(m: int) -> int:
    """The row count oneDNN runs for m rows: m up to 16, else m rounded up to one of 8 steps per octave (at most
    12.5% padding rows, discarded). oneDNN caches a primitive per (rows, shape), megabytes each at hundreds of
    rows: every distinct token count of a step made a new one, and a server's memory grew by ~1 GB over minutes
    of varied traffic (`bench soak`) before the cache's 1024 entries filled; buckets keep the shapes to ~8 per
    octave."""
    if m <= 16:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


class Linear(PlannedLinear):
    """y = x W^T + b through one of three kernels per shape class (kernel_plan.plan_kernels):

    - onednn: oneDNN's prepacked GEMM (2.1-2.5x aten's MKL path at 1 to 512 tokens on this class of
      CPU, benchmarks/micro_linear.py);
    - native: csrc/gemv.c streaming the plain weight once for all rows (decode: one pass over the
      weights at ~0.95 of the bandwidth probe, where oneDNN reached ~0.6-0.75);
    - torch: F.linear, the portable path.
    When the plan uses both a packed and a plain kernel, both copies of the weight are kept.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self._gemv: cpu_kernels.GemvWeights | None = None
        self.kernels = (Linear.forward_default,) * len(SHAPE_CLASSES)

    def pack(self, keep_weight: bool = False) -> None:
        """Add the prepacked oneDNN weight; the dense copy is released unless kept for other kernels."""
        assert self.weight is not None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_weight:
            self.weight = None

    def forward_default(self, x: torch.Tensor) -> torch.Tensor:
        """Before planning: oneDNN when packed, else F.linear."""
        return self.forward_onednn(x) if self.packed is not None else self.forward_torch(x)

    def forward_onednn(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        rows = bucket_rows(m) if x.dim() == 2 else m
        if rows == m:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        x = torch.cat((x, x.new_zeros(rows - m, x.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:m]

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def gemv_weights(self) -> cpu_kernels.GemvWeights:
        """The plain weight bound for csrc/gemv.c (built on first use, once the weights are final)."""
        if self._gemv is None:
            assert self.weight is not None
            bias = None if self.bias is None else self.bias.detach().float().contiguous()
            fmt = "f32" if self.weight.dtype == torch.float32 else "bf16"
            self._gemv = cpu_kernels.GemvWeights(fmt, self.weight.detach(), self.in_features, bias=bias)
        return self._gemv

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        out = self.gemv_weights()(xf if xf.stride(-1) == 1 else xf.contiguous())
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def candidates(self) -> dict[str, Kernel]:
        found: dict[str, Kernel] = {}
        if self.packed is not None:
            found["onednn"] = self.forward_onednn
        if self.weight is not None:
            found["torch"] = self.forward_torch
            if (self.weight.device.type == "cpu" and self.weight.dtype in (torch.float32, torch.bfloat16)
                    and cpu_kernels.available()):
                found["native"] = self.forward_native
        return found

    def release_unused(self) -> None:
        """After planning: drop the copy of the weight no planned kernel reads."""
        used = {k.__name__ for k in self.kernels}
        if self.packed is not None and "forward_onednn" not in used and "forward_default" not in used:
            self.packed = None
        if self.weight is not None and used <= {"forward_onednn"}:
            self.weight = None
            self._gemv = None


def fused_ok(x: torch.Tensor) -> bool:
    """Whether csrc/fused_ops.c can take this activation (float32 on the CPU, kernels built)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and cpu_kernels.available()


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in float32 like the reference, cast back to the input dtype.

    With `residual` (vLLM's convention) it first adds x into the residual stream and returns (normed,
    residual): one fused pass on the CPU instead of a separate add and eight small ops per norm.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused_ok(x) and x.stride(-1) == 1 and self.weight.dtype == torch.float32:
            out, res = cpu_kernels.add_rmsnorm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, res)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class SiluAndMul(nn.Module):
    """SwiGLU on a fused [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ok(x) and x.stride(-1) == 1:
            return cpu_kernels.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either checkpoint style: rope_theta + rope_scaling, or rope_parameters."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update(scaling)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def compute_inv_freq(cfg: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale for the rope types real Llama-3.x / Qwen2.5 configs use."""
    p = _rope_params(cfg)
    base = float(p["rope_theta"])
    rope_type = p["rope_type"]
    dim = head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(p, dim, base, cfg)
    raise ValueError(
        f"rope_scaling: unsupported rope type {rope_type!r}; supported: default, linear, llama3, yarn")


def _yarn_inv_freq(p: dict[str, Any], dim: int, base: float, cfg: dict[str, Any]) -> tuple[torch.Tensor, float]:
    orig = float(p.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
    factor = p.get("factor") or cfg["max_position_embeddings"] / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = p.get("attention_factor")
    if attn_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


@dataclass(slots=True)
class RopeInput:
    """One step's rotary inputs, shared by every layer."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor | None  # [T, 1, D/2], None when the fused kernel reads the table itself
    sin: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a cos/sin table precomputed for every position."""

    def __init__(self, cfg: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.head_dim, self.max_positions = cfg, head_dim, max_positions
        self.half = head_dim // 2
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the table; the loader calls this after materialising a meta-device model."""
        if self.cos_sin_cache.is_meta:
            return
        inv_freq, scale = compute_inv_freq(self.cfg, self.head_dim)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_positions, head_dim]: cos for the first half then sin, so one gather per step serves both.
        cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device)

    def lookup(self, positions: torch.Tensor) -> RopeInput:
        """What every layer's rotation needs for the step's positions, computed once per forward: the
        positions for the fused kernel, else cos and sin [T, 1, D/2] gathered for the torch ops."""
        if self.cos_sin_cache.device.type == "cpu" and self.cos_sin_cache.dtype == torch.float32 \
                and cpu_kernels.available():
            return RopeInput(positions, None, None)
        cs = self.cos_sin_cache[positions].view(-1, 1, 2, self.half)
        return RopeInput(positions, cs[:, :, 0], cs[:, :, 1])

    def forward(self, x: torch.Tensor, rope: RopeInput) -> torch.Tensor:
        """Rotate x [T, heads, D]; q and k heads go through in one call (half the ops of rotating them
        separately: this runs once per layer per step). Float32 Llama layers on the CPU rotate inside
        Attention.rope_and_cache instead; a step whose lookup left cos/sin to the kernel gathers them here."""
        if rope.cos is None:
            cs = self.cos_sin_cache[rope.positions].view(-1, 1, 2, self.half)
            rope = RopeInput(rope.positions, cs[:, :, 0], cs[:, :, 1])
        cos, sin = rope.cos, rope.sin
        xf = x.float()
        x1, x2 = xf[..., :self.half], xf[..., self.half:]
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        o1, o2 = out[..., :self.half], out[..., self.half:]
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
        return out.to(x.dtype)
