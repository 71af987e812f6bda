"""Weight quantization as a weight transform: int8 (per-channel), int4 (group-wise), W8A8, W4A8.

After loading, every projection `Linear` of the model (and the LM head unless told otherwise) becomes a
`QuantizedLinear` holding packed integer weights; the model code does not change. Layouts and the
native kernels are in csrc/quant_gemm.c; `dequantize()` gives the exact weight every kernel computes
with, and the portable path (any device, any M) is a matmul against it.

Which kernel runs is chosen per shape class (1 token, a few, many) by timing the candidates on the
model's own layers at start-up (kernel_plan.plan_kernels): the CPU model changes between machines, and
what is fastest differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import SHAPE_CLASSES, Kernel, PlannedLinear
from minivllm.model.layers import Linear
from minivllm.quant_config import GROUPED_METHODS, QuantConfig

HANDFUL = SHAPE_CLASSES[1][0]  # tokens of a batch-1 speculative verification (kernel_plan.py)


# ---- packing (torch, any device) -------------------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [N, K] int8, scale [N] float32), w ≈ scale[:, None] * q."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16,
                  symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4: (packed [N, Kp/2] uint8, scale [N, G], min [N, G], both bf16 or float16); or
    symmetric by Q4_0's rule (min -8 scale, which a layer built with min_dtype "none" does not store).

    K is zero-padded to Kp, a multiple of the group size. The min costs no extra work in the kernel
    (it multiplies the group's sum of x, computed once per token) and cuts the error of groups whose
    weights are not centred on zero. Codes are chosen against the stored (bf16) scale and min, so they
    are the nearest codes for the weights the kernels actually use.
    """
    n, k = w.shape
    kp = -(-k // group_size) * group_size
    wf = F.pad(w.float(), (0, kp - k)).view(n, kp // group_size, group_size)
    lo, hi = wf.amin(-1), wf.amax(-1)
    if symmetric:  # Q4_0's rule: the weight of largest magnitude is code 0 (-8 scale), the min is -8 scale
        peak = torch.where(-lo > hi, lo, hi)
        scale = (peak / -8).to(scale_dtype)
        scale = torch.where(scale != 0, scale, torch.ones_like(scale))
        mins = -8 * scale
    else:
        scale = ((hi - lo) / 15).to(scale_dtype)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        mins = lo.to(scale_dtype)
    q = torch.round((wf - mins.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(q.view(n, kp)), scale, mins


def quantize_int8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in blocks of 32 (GGUF's Q8_0): (q [N, Kp] int8, scale [N, Kp / 32] float16), K zero-padded
    to Kp; codes chosen against the stored float16 scale."""
    n, k = w.shape
    kp = -(-k // 32) * 32
    wf = F.pad(w.float(), (0, kp - k)).view(n, kp // 32, 32)
    amax = wf.abs().amax(-1)
    scale = (amax / 127).to(torch.float16)
    # A scale rounded down would clip the block's peak (at 127); the next float16 up keeps it within half a step.
    scale = torch.where(scale.float() * 127 < amax, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
    if not torch.isfinite(scale).all():
        raise ValueError("int8 blocks: a block's peak weight is too large for a float16 scale (|w| > 8.3e6)")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, kp), scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, Kp] (0..15, Kp a multiple of 32) → the kernels' packed [N, Kp/2] uint8: each 32-code block is 16
    bytes, byte j holding code j (low nibble) and code j + 16 (high)."""
    n, kp = codes.shape
    q = codes.to(torch.uint8).view(n, kp // 32, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, kp // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Codes [N, Kp] (0..15) of a packed int4 weight."""
    n = packed.shape[0]
    b = packed.view(n, -1, 16)
    return torch.stack([b & 15, b >> 4], dim=2).view(n, -1)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's dynamic activation quantization: per row, symmetric, absmax / 127."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(xf / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_blocks_int8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the W4A8 / Q8_0-block kernels see it with activation blocks: each 32-wide block of a row in int8 with
    its own scale (absmax / 127, llama.cpp's Q8_0 activations), returned dequantized (float32)."""
    xf = x.float()
    m, k = xf.shape
    xb = F.pad(xf, (0, -k % 32)).view(m, -1, 32)
    amax = xb.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return (torch.round(xb / scale).clamp(-127, 127) * scale).view(m, -1)[:, :k]


class QuantizedLinear(PlannedLinear):
    """A Linear whose weight is stored quantized; forward picks the kernel planned for the input's M."""

    # buffers (register_buffer); `mins` exists only for the grouped (int4) methods. int8 / w8a8 weights are per
    # output channel, or with cfg.int8_blocks in blocks of 32 with float16 scales (`blocked`: GGUF's Q8_0).
    checkpoint_buffers = ("qweight", "scales", "mins", "bias")  # what a pre-quantized checkpoint fills (weights.py)
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, cfg: QuantConfig) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method, self.group_size = cfg.method, cfg.group_size
        self.grouped = cfg.method in GROUPED_METHODS  # int4 weights: packed nibbles, group scale and min
        self.blocked = cfg.int8_blocks
        self.symmetric = self.grouped and cfg.min_dtype == "none"  # no mins stored: each is -8 * scale
        self.act_blocks = cfg.act_blocks  # quantized x: per 32-weight block (quantize_blocks_int8), not per row
        if self.grouped:
            kp = -(-in_features // cfg.group_size) * cfg.group_size
            half = cfg.torch_scale_dtype
            self.register_buffer("qweight", torch.empty(out_features, kp // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.empty(out_features, kp // cfg.group_size, dtype=half))
            if not self.symmetric:
                self.register_buffer("mins", torch.empty(out_features, kp // cfg.group_size,
                                                         dtype=cfg.torch_min_dtype))
        elif self.blocked:
            kp = -(-in_features // 32) * 32
            self.register_buffer("qweight", torch.empty(out_features, kp, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(out_features, kp // 32, dtype=torch.float16))
        else:
            self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
            self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))
        # float32 whatever the model dtype: the kernels add it to float32 accumulators.
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32) if bias else None)
        self._gemv: cpu_kernels.GemvWeights | None = None  # bound on first native call (buffers final by then)
        self._gemv_a8: cpu_kernels.GemvWeights | None = None  # int4's weights bound for the w4a8 kernel
        self.kernels = (QuantizedLinear.forward_reference,) * len(SHAPE_CLASSES)  # the portable path until plan_kernels

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Fill the packed buffers from a full-precision weight [N, K]."""
        if self.grouped:
            q, s, m = quantize_int4(weight, self.group_size, self.scales.dtype, self.symmetric)
            self.qweight.copy_(q)
            self.scales.copy_(s)
            if not self.symmetric:
                self.mins.copy_(m)
        elif self.blocked:
            q, s = quantize_int8_blocks(weight)
            self.qweight.copy_(q)
            self.scales.copy_(s)
        else:
            q, s = quantize_int8(weight)
            self.qweight.copy_(q)
            self.scales.copy_(s)
        if bias is not None:
            assert self.bias is not None  # built with bias=True for a biased source layer
            self.bias.copy_(bias)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] every kernel computes with."""
        if self.grouped:
            n, g = self.out_features, self.scales.shape[1]
            q = unpack_int4(self.qweight).float().view(n, g, self.group_size)
            mins = -8 * self.scales.float() if self.symmetric else self.mins.float()
            w = q * self.scales.float()[..., None] + mins[..., None]
            return w.view(n, -1)[:, :self.in_features]
        if self.blocked:
            n, nb = self.scales.shape
            w = self.qweight.float().view(n, nb, 32) * self.scales.float()[..., None]
            return w.view(n, -1)[:, :self.in_features]
        return self.qweight.float() * self.scales[:, None]

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Portable path (any device, any M): dequantize, then a float32 matmul."""
        bias = None if self.bias is None else self.bias.float()
        if self.method == "w8a8" and not self.blocked:
            xq, xs = quantize_rows_int8(x)
            y = (xq.float() @ self.qweight.float().t()) * (xs[:, None] * self.scales[None, :])
            return y if bias is None else y + bias
        if self.method in ("w4a8", "w8a8") and self.act_blocks:
            y = quantize_blocks_int8(x) @ self.dequantize().t()
            return y if bias is None else y + bias
        if self.method in ("w4a8", "w8a8"):
            xq, xs = quantize_rows_int8(x)
            y = (xq.float() @ self.dequantize().t()) * xs[:, None]
            return y if bias is None else y + bias
        return F.linear(x.float(), self.dequantize(), bias)

    def gemv_weights(self) -> cpu_kernels.GemvWeights:
        """The packed weight bound for csrc/gemv.c (built on first use, once the buffers are final)."""
        if self._gemv is None:
            bias = None if self.bias is None else self.bias.float().contiguous()
            fmt = ("q8a8" if self.method == "w8a8" else "q8") if self.blocked else self.method
            self._gemv = cpu_kernels.GemvWeights(fmt, self.qweight, self.in_features, self.scales,
                                                 self.mins if self.grouped and not self.symmetric else None,
                                                 self.group_size if self.grouped or self.blocked else 0, bias,
                                                 self.act_blocks and self.method in ("w4a8", "w8a8"))
        return self._gemv

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The C kernels of csrc/gemv.c (CPU, float32 activations): weights read once for all M rows."""
        xf = x if x.dtype == torch.float32 else x.float()
        return self.gemv_weights()(xf if xf.stride(-1) == 1 else xf.contiguous())

    def forward_native_a8(self, x: torch.Tensor) -> torch.Tensor:
        """int4 (int8, int8 block) weights through W4A8's (W8A8's, q8a8's) native kernel: x's rows quantized to
        int8, integer dot products."""
        if self._gemv_a8 is None:
            bias = None if self.bias is None else self.bias.float().contiguous()
            if not self.grouped and not self.blocked:  # per-channel int8: W8A8's kernel (where int_mm has no VNNI)
                self._gemv_a8 = cpu_kernels.GemvWeights("w8a8", self.qweight, self.in_features, self.scales, None, 0,
                                                        bias)
            elif self.blocked:
                self._gemv_a8 = cpu_kernels.GemvWeights("q8a8", self.qweight, self.in_features, self.scales, None,
                                                        32, bias, self.act_blocks)
            else:
                self._gemv_a8 = cpu_kernels.GemvWeights("w4a8", self.qweight, self.in_features, self.scales,
                                                        None if self.symmetric else self.mins, self.group_size, bias,
                                                        self.act_blocks)
        xf = x if x.dtype == torch.float32 else x.float()
        return self._gemv_a8(xf if xf.stride(-1) == 1 else xf.contiguous())

    def forward_int_mm(self, x: torch.Tensor) -> torch.Tensor:
        """W8A8 through torch's integer GEMM (`torch._int_mm`, oneDNN's VNNI path on CPU); on the CPU the
        activation quantization and the rescale around it are one native pass each (eleven torch ops)."""
        if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_kernels.available():
            xq, xs = cpu_kernels.quantize_rows_s8(x if x.stride(-1) == 1 else x.contiguous())
            acc = torch._int_mm(xq, self.qweight.t())
            return cpu_kernels.rescale_i32(acc, xs, self.scales, self.bias)
        xq, xs = quantize_rows_int8(x)
        y = torch._int_mm(xq, self.qweight.t()).float() * (xs[:, None] * self.scales[None, :])
        return y if self.bias is None else y + self.bias

    def candidates(self) -> dict[str, Kernel]:
        """Kernels that compute this layer's math on this device (same result within float rounding)."""
        found: dict[str, Kernel] = {"reference": self.forward_reference}
        if self.qweight.device.type == "cpu" and cpu_kernels.available():
            found["native"] = self.forward_native
        if self.method in ("w8a8", "int8") and not self.blocked:  # int8 and w8a8: the same per-channel int8
            found["int_mm"] = self.forward_int_mm
        # int4 and w4a8 weights are the same packed groups, int8 and w8a8 the same per-channel codes; int8 blocks run
        # weight-only or against int8 x
        if self.method in ("int4", "int8") and "native" in found:
            found["native_a8"] = self.forward_native_a8
        return found

    def plan_kind(self) -> str:
        return f"{self.method}{' blocks' if self.blocked else ''}"

    def quantizes_activations(self, name: str) -> bool:
        """Whether kernel `name` computes with x's rows quantized to int8 (W8A8 / W4A8 math)."""
        return self.method in ("w8a8", "w4a8") or name in ("int_mm", "native_a8")

    def eligible(self, name: str, largest_m: int) -> bool:
        """A weight-only layer (int8, int4) may quantize its activations only in steps of more than a handful of
        tokens (prefill, batches), where its own kernels trail float32's GEMM: one-token and speculative-handful
        steps keep the exact weight-only math. The quality of that mix: W8A8's / W4A8's on those steps (BENCHMARKS.md,
        bench quantization)."""
        return self.method in ("w8a8", "w4a8") or not self.quantizes_activations(name) or largest_m > HANDFUL

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        blocks = (", blocks of 32" if self.blocked else "") + (", x in blocks of 32" if self.act_blocks else "")
        return f"in={self.in_features}, out={self.out_features}, method={self.method}, group={self.group_size}{blocks}"


def check_device(cfg: QuantConfig | None, device: torch.device) -> None:
    """Fail early where a mode (if any) has no kernel at all."""
    if cfg is not None and device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantization {cfg.method}: no kernel for device {device.type!r}; supported: cpu, cuda")


def quantize_model(model: nn.Module, cfg: QuantConfig, materialize: bool = True,
                   overrides: dict[str, QuantConfig] | None = None) -> int:
    """Replace every Linear (the LM head too unless cfg says not) by a QuantizedLinear, in place; a module named in
    `overrides` (its qualified name) takes that configuration instead (a GGUF file's int4 layers beside int8 ones).

    materialize=False builds empty quantized layers (for loading a saved quantized checkpoint).
    Returns the number of layers replaced."""
    replaced = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or (name == "lm_head" and not cfg.quantize_lm_head):
                continue
            weight = child.weight
            assert weight is not None, "quantize before packing"
            own = (overrides or {}).get(f"{prefix}.{name}" if prefix else name, cfg)
            q = QuantizedLinear(child.in_features, child.out_features, child.bias is not None, own)
            q.routed = child.routed
            if materialize:
                q = q.to(weight.device)
                q.quantize_from(weight.detach(), None if child.bias is None else child.bias.detach())
            setattr(parent, name, q)
            replaced += 1
    return replaced
