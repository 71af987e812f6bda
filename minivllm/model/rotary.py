"""Rotary position embedding: the rope types real checkpoints use, read from either config style, as one
cos/sin table per distinct rope of a model (Gemma 3's local and global layers each have their own)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minivllm.model import cpu_kernels

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """One rope's settings from either checkpoint style, as one flat dict with rope_type and rope_theta:
    rope_theta + rope_scaling (+ Gemma 3's rope_local_base_freq for its sliding layers), or rope_parameters,
    flat or keyed by layer type ("full_attention" / "sliding_attention")."""
    given = cfg.get("rope_parameters") or {}
    if layer_type is not None and isinstance(given.get(layer_type), dict):
        params = dict(given[layer_type])
    else:
        params = dict(given) if not any(isinstance(v, dict) for v in given.values()) else {}
        if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq") is not None:
            params = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
        elif cfg.get("rope_scaling"):
            params.update(cfg["rope_scaling"])
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if cfg.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if cfg.get("original_max_position_embeddings") is not None and params["rope_type"] == "longrope":
        # Phi-3 keeps the pretraining length beside rope_scaling, and HF gives that field priority.
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return params


def rotary_dim(params: dict[str, Any], head_dim: int) -> int:
    """Dimensions of each head that rotate (partial_rotary_factor: Phi-4-mini turns 0.75 of them)."""
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(f"partial_rotary_factor {params.get('partial_rotary_factor')} gives {dim} rotary "
                         f"dimensions of head_dim {head_dim}; need an even number in 2..{head_dim}")
    return dim


def compute_inv_freq(cfg: dict[str, Any], head_dim: int, layer_type: str | None = None
                     ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim / 2] and the cos/sin scale of a rope (for longrope: of its short factors,
    which serve positions below original_max_position_embeddings)."""
    p = rope_parameters(cfg, layer_type)
    dim = rotary_dim(p, head_dim)
    return _inv_freq(p, dim, cfg, long=False)


def _inv_freq(p: dict[str, Any], dim: int, cfg: dict[str, Any], long: bool) -> tuple[torch.Tensor, float]:
    base = float(p["rope_theta"])
    rope_type = p["rope_type"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
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
    if rope_type == "longrope":
        return _longrope_inv_freq(p, dim, base, cfg, long)
    raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


def _longrope_inv_freq(p: dict[str, Any], dim: int, base: float, cfg: dict[str, Any], long: bool
                       ) -> tuple[torch.Tensor, float]:
    orig = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or cfg["max_position_embeddings"] / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    key = "long_factor" if long else "short_factor"
    ext = torch.tensor(p[key], dtype=torch.float32, device="cpu")
    if ext.shape != (dim // 2,):
        raise ValueError(f"rope_scaling: longrope {key} has {ext.numel()} entries; the {dim} rotary dimensions "
                         f"need {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext * base**shape), float(attention_factor)


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
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn_factor)


@dataclass(slots=True)
class RopeInput:
    """One step's rotary inputs for one rope, shared by every layer that uses it."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor | None  # [T, 1, R/2], None when the fused kernel reads the table itself
    sin: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding over the first rot_dim dimensions of each head, with a cos/sin
    table precomputed for every position.

    LongRoPE (Phi-3/Phi-4-mini) has two factor sets; HF picks one for a whole forward by the sequence's length
    (short while it fits original_max_position_embeddings), so K rows cached before a sequence crosses that length
    keep their short rotation. Here the table holds the short rotation below that position and the long one from
    it on: identical to HF for every sequence within the pretraining length, consistent with the cached keys
    after it, and independent of how a prompt is chunked or batched."""

    cos_sin_cache: torch.Tensor  # a buffer (register_buffer), [max_positions, rot_dim]

    def __init__(self, cfg: dict[str, Any], head_dim: int, max_positions: int, layer_type: str | None = None
                 ) -> None:
        super().__init__()
        self.cfg, self.layer_type, self.max_positions = cfg, layer_type, max_positions
        self.params = rope_parameters(cfg, layer_type)
        self.rot_dim = rotary_dim(self.params, head_dim)
        self.half_rot = self.rot_dim // 2  # (not `half`: that name is nn.Module.half())
        _inv_freq(self.params, self.rot_dim, cfg, long=False)  # unsupported settings fail at build, not at load
        self.register_buffer("cos_sin_cache", torch.empty(max_positions, self.rot_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the table; the loader calls this after materialising a meta-device model."""
        if self.cos_sin_cache.is_meta:
            return
        pos = torch.arange(self.max_positions, dtype=torch.float32)[:, None]
        inv_freq, scale = _inv_freq(self.params, self.rot_dim, self.cfg, long=False)
        freqs = pos * inv_freq[None, :]
        if self.params["rope_type"] == "longrope":
            long_inv, _ = _inv_freq(self.params, self.rot_dim, self.cfg, long=True)
            beyond = pos >= float(self.params["original_max_position_embeddings"])
            freqs = torch.where(beyond, pos * long_inv[None, :], freqs)
        # [max_positions, rot_dim]: cos for the first half then sin, so one gather per step serves both.
        cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device)

    def lookup(self, positions: torch.Tensor) -> RopeInput:
        """What every layer's rotation needs for the step's positions, computed once per forward: the
        positions for the fused kernel, else cos and sin [T, 1, R/2] gathered for the torch ops."""
        if self.cos_sin_cache.device.type == "cpu" and self.cos_sin_cache.dtype == torch.float32 \
                and cpu_kernels.available():
            return RopeInput(positions, None, None)
        cs = self.cos_sin_cache[positions].view(-1, 1, 2, self.half_rot)
        return RopeInput(positions, cs[:, :, 0], cs[:, :, 1])

    def forward(self, x: torch.Tensor, rope: RopeInput) -> torch.Tensor:
        """Rotate x [T, heads, D] (its first rot_dim dimensions); q and k heads go through in one call (half the
        ops of rotating them separately: this runs once per layer per step). Float32 layers on the CPU rotate
        inside Attention.rope_and_cache instead; a step whose lookup left cos/sin to the kernel gathers them
        here."""
        if rope.cos is None:
            cs = self.cos_sin_cache[rope.positions].view(-1, 1, 2, self.half_rot)
            rope = RopeInput(rope.positions, cs[:, :, 0], cs[:, :, 1])
        cos, sin = rope.cos, rope.sin
        assert cos is not None and sin is not None
        xf = x.float()
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        x1, x2 = xf[..., :self.half_rot], xf[..., self.half_rot:self.rot_dim]
        o1, o2 = out[..., :self.half_rot], out[..., self.half_rot:self.rot_dim]
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
        if self.rot_dim < x.shape[-1]:
            out[..., self.rot_dim:] = xf[..., self.rot_dim:]
        return out.to(x.dtype)
