"""A projection in GGUF's Q6_K, run from the file's own superblocks (csrc/gemv_q6k.c).

llama.cpp's quantizer writes the head of its Q4_0, Q4_K_M and Q5_K_M files (the tied embedding where the model
has no head of its own) in Q6_K: 6.56 bits a weight, 210 bytes a superblock of 256 weights. Converted to int8
blocks of 32 it was 8.5 bits, a third of a 1B model's bytes a token, and an approximation of the file's weights;
run as it is, it is the file's bytes and its exact weights (model/gguf_conversion.py builds it). Weight-only
against float x, or against x in blocks of 32 as int8 (the file's other layers' `a8` math, llama.cpp's Q8_0 x).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import SHAPE_CLASSES, Kernel, PlannedLinear
from minivllm.model.quantization import HANDFUL, quantize_blocks_int8

SUPERBLOCK = 256  # weights
SUPERBLOCK_BYTES = 210  # ql 128, qh 64, sc 16, d 2


def dequantize_q6k(raw: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 [N, K / 256 * 210] Q6_K rows -> float32 [N, K] (ggml's dequantize_row_q6_K, vectorized)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, SUPERBLOCK_BYTES)
    nsb = b.shape[1]
    ql = b[..., :128].reshape(n, nsb, 2, 64)
    qh = b[..., 128:192].reshape(n, nsb, 2, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [n, nsb, 16]
    d = b[..., 208:210].contiguous().view(torch.float16).float()  # [n, nsb, 1]
    low = torch.cat([ql & 15, ql >> 4], dim=-1)  # a half's weights 0..63 in the low nibbles, 64..127 in the high
    high = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).reshape(n, nsb, 2, 128)  # 32 i + l: bits 2i
    q = (low | (high << 4)).reshape(n, nsb, 16, 16).float() - 32
    return (q * (d * sc)[..., None]).reshape(n, nsb * SUPERBLOCK)[:, :in_features]


class Q6KLinear(PlannedLinear):
    """Q6_K weights [N, K]; `act_blocks`: x quantized per block of 32 to int8 (w8a8's math), else float x."""

    checkpoint_buffers = ("qweight", "bias")  # what a GGUF file's rows fill (models/weights.py)
    qweight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, act_blocks: bool, bias: bool = False) -> None:
        super().__init__()
        if in_features % SUPERBLOCK:
            raise ValueError(f"Q6_K: {in_features} input features are not whole superblocks of {SUPERBLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.act_blocks = act_blocks
        self.method = "w8a8" if act_blocks else "int8"  # (the math's name: 6-bit weights, x int8 or float)
        self.register_buffer("qweight", torch.empty(out_features, in_features // SUPERBLOCK * SUPERBLOCK_BYTES,
                                                    dtype=torch.uint8))
        # float32 whatever the model dtype: the kernels add it to float32 accumulators.
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32) if bias else None)
        self._gemv: cpu_kernels.GemvWeights | None = None
        self._gemv_a8: cpu_kernels.GemvWeights | None = None  # a weight-only layer's x-in-blocks kernel
        self.kernels = (Q6KLinear.forward_reference,) * len(SHAPE_CLASSES)

    @classmethod
    def from_blocks(cls, raw: np.ndarray | torch.Tensor, in_features: int, act_blocks: bool) -> Q6KLinear:
        """A layer holding a copy of a GGUF tensor's Q6_K rows (uint8 [N, K / 256 * 210])."""
        data = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw.contiguous()
        if data.dtype != torch.uint8 or data.dim() != 2 or \
                data.shape[1] != in_features // SUPERBLOCK * SUPERBLOCK_BYTES:
            raise ValueError(f"Q6_K: rows of {tuple(data.shape)} {data.dtype} are not {in_features} weights' "
                             "superblocks")
        layer = cls(in_features, data.shape[0], act_blocks)
        layer.qweight.copy_(data)
        return layer

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] every kernel computes with."""
        return dequantize_q6k(self.qweight, self.in_features)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Portable path (any device, any M): dequantize, then a float32 matmul."""
        xf = quantize_blocks_int8(x) if self.act_blocks else x.float()
        return F.linear(xf, self.dequantize(), self.bias)

    def _bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.float().contiguous()

    def gemv_weights(self) -> cpu_kernels.GemvWeights:
        """The superblocks bound for csrc/gemv.c (the native decode stack takes them too)."""
        if self._gemv is None:
            self._gemv = cpu_kernels.GemvWeights("q6k", self.qweight, self.in_features, bias=self._bias(),
                                                 act_blocks=self.act_blocks)
        return self._gemv

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """csrc/gemv_q6k.c (CPU, float32 activations): the superblocks read once for up to 16 rows of x."""
        xf = x if x.dtype == torch.float32 else x.float()
        return self.gemv_weights()(xf if xf.stride(-1) == 1 else xf.contiguous())

    def forward_native_a8(self, x: torch.Tensor) -> torch.Tensor:
        """A weight-only layer against x in blocks of 32 (steps of many tokens only: `eligible`)."""
        if self._gemv_a8 is None:
            self._gemv_a8 = cpu_kernels.GemvWeights("q6k", self.qweight, self.in_features, bias=self._bias(),
                                                    act_blocks=True)
        xf = x if x.dtype == torch.float32 else x.float()
        return self._gemv_a8(xf if xf.stride(-1) == 1 else xf.contiguous())

    def candidates(self) -> dict[str, Kernel]:
        found: dict[str, Kernel] = {"reference": self.forward_reference}
        if self.qweight.device.type == "cpu" and cpu_kernels.available():
            found["native"] = self.forward_native
            if not self.act_blocks:
                found["native_a8"] = self.forward_native_a8
        return found

    def eligible(self, name: str, largest_m: int) -> bool:
        """As QuantizedLinear's: a weight-only layer quantizes its activations only in steps of more than a handful
        of tokens (its float rows convert every 16 codes; the tiles run from 12 rows of x)."""
        return name != "native_a8" or largest_m > HANDFUL

    def plan_kind(self) -> str:
        return f"q6_k{' x in blocks' if self.act_blocks else ''}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, Q6_K{', x in blocks of 32' if self.act_blocks else ''}"
