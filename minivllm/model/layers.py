"""Building blocks shared by the model families: linear layers, norms, activations (rotary: model/rotary.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import SHAPE_CLASSES, Kernel, PlannedLinear

# Past this many tokens (the shape classes m<=16 and m>16) a float32 weight's native kernel is csrc/gemm_f32.c's GEMM
# on panels: GPT-2's projections in model order at 8 / 12 / 16 / 50 tokens ran 0.82 / 0.88 / 0.80 / 0.81x oneDNN's
# time, and ahead of csrc/gemv.c's rows (which read the weights once per 16 tokens) from 8 tokens up.
PANELS_PAST = SHAPE_CLASSES[1][0]


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
    - onednn_plain: oneDNN's GEMM on the plain weight: within 5-20% of the packed layout from 4 rows up, and
      as fast as the native kernel at one row on 1B shapes, so a model too large for two layouts keeps the
      plain one only (no second copy) and still runs its prefill through oneDNN;
    - native: csrc/gemv.c streaming the plain weight once for all rows (decode: one pass over the
      weights at ~0.95 of the bandwidth probe, where oneDNN's packed layout reached ~0.6-0.75); past PANELS_PAST
      tokens, where the runner allows a second layout (`allow_panels`), a float32 weight runs csrc/gemm_f32.c's
      GEMM on its own panel-packed copy (made on first use, kept only where the plan picks it there); a weight
      held as panels alone (`keep_panels_only`: model/weight_layout.py, a model too large for two layouts) runs
      that GEMM at every token count;
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
        self.allow_panels = False  # (runner: where memory allows a second copy of the weights)
        self._panels: cpu_kernels.GemmPanels | None = None
        self._trial: cpu_kernels.GemmPanels | None = None  # panels beside the plain weight while a layout is timed
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
        return _onednn_linear(x, self.packed, self.bias)

    def forward_onednn_plain(self, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, self.weight, self.bias)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None  # a candidate only while the dense weight is kept
        return F.linear(x, self.weight, self.bias)

    def gemv_weights(self) -> cpu_kernels.GemvWeights:
        """The plain weight bound for csrc/gemv.c (built on first use, once the weights are final)."""
        if self._gemv is None:
            assert self.weight is not None
            self._gemv = cpu_kernels.GemvWeights.dense(self.weight, self.in_features, self.bias)
        return self._gemv

    def gemm_panels(self) -> cpu_kernels.GemmPanels | None:
        """The panel-packed float32 weight for csrc/gemm_f32.c (packed on first use), or None where not allowed."""
        if self._panels is None and not self.native_rows(1 << 62):
            assert self.weight is not None
            self._panels = cpu_kernels.GemmPanels(self.weight, self.bias)
        return self._panels

    def native_rows(self, largest_m: int) -> bool:
        if self.panels_only():
            return False
        return not (largest_m > PANELS_PAST and self.allow_panels and self.weight is not None
                    and self.weight.dtype == torch.float32)

    def panels_only(self) -> bool:
        """Whether the weight is held as csrc/gemm_f32.c's panels alone (keep_panels_only)."""
        return self.weight is None and self._panels is not None

    def keep_panels_only(self) -> None:
        """Hold the float32 weight as panels alone (model/weight_layout.py: a model too large for two layouts whose
        GEMM on panels streamed one token as fast as the plain rows): the native kernel runs them at every token
        count, and the plain weight, its bound rows and any packed copy go."""
        assert self.weight is not None and self.weight.dtype == torch.float32 and not self.routed
        self._panels = self._trial or cpu_kernels.GemmPanels(self.weight, self.bias)
        self._trial = None
        self.weight, self._gemv, self.packed = None, None, None

    def trial_panels(self, on: bool) -> None:
        """Offer (on) or withdraw the candidate "panels" (the GEMM on panels at every token count) beside the
        plain weight's kernels, for model/weight_layout.py's timing."""
        assert self.weight is not None
        self._trial = cpu_kernels.GemmPanels(self.weight, self.bias) if on else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels_only():
            return self._on_panels(x, self._panels)
        xf = x if x.dtype == torch.float32 else x.float()
        xf = xf if xf.stride(-1) == 1 else xf.contiguous()
        panels = self.gemm_panels() if xf.dim() == 2 and xf.shape[0] > PANELS_PAST else None
        out = panels(xf) if panels is not None else self.gemv_weights()(xf)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def forward_panels(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM on the trial panels at any token count (a candidate only while they are offered)."""
        return self._on_panels(x, self._trial)

    def _on_panels(self, x: torch.Tensor, panels: cpu_kernels.GemmPanels | None) -> torch.Tensor:
        assert panels is not None
        xf = x.reshape(-1, self.in_features).to(torch.float32)
        out = panels(xf if xf.stride(-1) == 1 else xf.contiguous()).view(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def candidates(self) -> dict[str, Kernel]:
        found: dict[str, Kernel] = {}
        if self.panels_only():
            return {"native": self.forward_native}
        if self.packed is not None:
            found["onednn"] = self.forward_onednn
        if self.weight is not None:
            found["torch"] = self.forward_torch
            if onednn_linear_available(self.weight.device, self.weight.dtype):
                found["onednn_plain"] = self.forward_onednn_plain
            if (self.weight.device.type == "cpu" and self.weight.dtype in (torch.float32, torch.bfloat16)
                    and cpu_kernels.available()):
                found["native"] = self.forward_native
        if self._trial is not None:
            found["panels"] = self.forward_panels
        return found

    def timing_key(self) -> tuple[object, ...]:
        return (*super().timing_key(), self.panels_only())  # (panels alone: no tensor of its own to key by)

    def layout_dtype(self) -> torch.dtype:
        """The dtype of the one layout a decode step streams (the plain weight, the packed copy or the panels)."""
        held = self.weight if self.weight is not None else self.packed
        return held.dtype if held is not None else torch.float32  # (panels: float32 only)

    def kernel_copies(self) -> list[torch.Tensor]:
        """The copies of the weight made for one kernel (oneDNN's packed layout, the panels) that it holds, for
        hugepages.collapse_in_place (the panels in huge pages: GPT-2's GEMMs in model order at 50 tokens 0.95-0.98x
        the time)."""
        return [t for t in (self.packed, None if self._panels is None else self._panels.panels) if t is not None]

    def release_unused(self) -> None:
        """After planning: drop the copy of the weight no planned kernel reads."""
        used = {k.__name__ for k in self.kernels}
        if any(k.__name__ == "forward_native" for k, (largest, _) in zip(self.kernels, SHAPE_CLASSES, strict=True)
               if largest > PANELS_PAST):
            self.gemm_panels()  # packed now, not in the first step that needs them
        elif not self.panels_only():
            self._panels = None
        if self.packed is not None and "forward_onednn" not in used and "forward_default" not in used:
            self.packed = None
        if self.weight is not None and used <= {"forward_onednn"}:  # (forward_default is oneDNN once packed)
            self.weight = None
            self._gemv = None


def _onednn_linear(x: torch.Tensor, w: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a packed or plain weight, the rows padded to their bucket (bucket_rows)."""
    x = x.contiguous()
    m = x.shape[0]
    rows = bucket_rows(m) if x.dim() == 2 else m
    if rows == m:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    x = torch.cat((x, x.new_zeros(rows - m, x.shape[1])))
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")[:m]


def fused_ok(x: torch.Tensor) -> bool:
    """Whether csrc/fused_ops.c can take this activation (float32 on the CPU, kernels built)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and cpu_kernels.available()


class ResidualNorm(nn.Module):
    """A norm in vLLM's residual convention: forward(x) normalises x; forward(x, residual) first adds x into the
    residual stream (in place on the CPU's fused pass) and returns (normed, residual). Subclasses give the fused
    native pass (`_fused`, float32 on the CPU) and the torch one (`_norm`)."""

    weight: nn.Parameter

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused_ok(x) and x.stride(-1) == 1 and self.weight.dtype == torch.float32:
            out, res = self._fused(x, residual)
            return out if residual is None else (out, res)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class RMSNorm(ResidualNorm):
    """RMSNorm computed in float32 like the reference, cast back to the input dtype.

    With `residual` (vLLM's convention) it first adds x into the residual stream and returns (normed,
    residual): one fused pass on the CPU instead of a separate add and eight small ops per norm.
    unit_offset (Gemma): the checkpoint stores w and the norm scales by 1 + w; the weight here holds 1 + w in
    float32 (the loader adds the 1), as HF computes it, so every kernel is the plain RMSNorm.
    """

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        dtype = torch.float32 if unit_offset else None
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps, self.unit_offset = eps, unit_offset

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.add_rmsnorm(x, residual, self.weight, self.eps)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Llama's reference casts before the weight; Gemma's multiplies in float32 and casts after.
        return (xf * self.weight).to(dtype) if self.unit_offset else self.weight * xf.to(dtype)


class LayerNorm(ResidualNorm):
    """LayerNorm (weight and bias, GPT-2's) with RMSNorm's residual convention: given `residual`, x is added into
    it in place and (normed, residual) returned, one native pass on the CPU (csrc/fused_ops.c add_layernorm_f32)
    where the add and ATen's layer_norm were two calls. Parameters named as torch.nn.LayerNorm's."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def _fused(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return cpu_kernels.add_layernorm(x, residual, self.weight, self.bias, self.eps)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class GroupRMSNorm(RMSNorm):
    """RMSNorm over consecutive groups of `size` columns of a row slice, in place, one weight [size] for every
    group: q/k norm per head (Qwen3, Gemma 3: size = head_dim) or over the whole projection (OLMo 2: size =
    heads * head_dim, one group)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__(size, eps, unit_offset)
        self.size = size

    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor:  # type: ignore[override]
        """Normalise x [T, n * size] (a view with any row stride, unit column stride) in place; returns x."""
        if fused_ok(x) and x.stride(-1) == 1 and self.weight.dtype == torch.float32:
            cpu_kernels.rmsnorm_groups(x, self.size, self.weight, self.eps)
        else:
            t = x.shape[0]
            x.copy_(self._norm(x.reshape(t, -1, self.size)).reshape(t, -1))
        return x


class SiluAndMul(nn.Module):
    """SwiGLU on a fused [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ok(x) and x.stride(-1) == 1:
            return cpu_kernels.silu_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu(x, approximate="tanh") (GPT-2's gelu_new): the native kernel on float32 CPU rows, 3.4x ATen's at a
    50-sequence step's [50, 3072] (27 against 91 us, equal to 5e-7), else torch."""
    if x.dim() == 2 and fused_ok(x) and x.stride(-1) == 1:
        return cpu_kernels.gelu_tanh(x)
    return F.gelu(x, approximate="tanh")


class GeluTanhAndMul(nn.Module):
    """GeGLU with the tanh approximation of GELU (Gemma's gelu_pytorch_tanh) on a fused [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ok(x) and x.stride(-1) == 1:
            return cpu_kernels.gelu_tanh_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu_tanh": GeluTanhAndMul,
}


class GatedMLP(nn.Module):
    """Gated MLP (SwiGLU, or GeGLU for Gemma) with a fused gate/up projection."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
