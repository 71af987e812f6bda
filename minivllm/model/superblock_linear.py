"""A projection in one of GGUF's K-quants, run from the file's own superblocks of 256 weights (model/q6k_linear.py:
Q6_K, csrc/gemv_q6k.c; model/q4k_linear.py: Q4_K, csrc/gemv_q4k.c).

llama.cpp's quantizer writes most of a Q4_K_M file's projections in Q4_K and the rest (and the head of its Q4_0,
Q4_K_M and Q5_K_M files) in Q6_K. Run as the file holds them they are its bytes (4.5 and 6.56 bits a weight) and its
exact weights; converted to our int4 groups or int8 blocks they were more bytes a token and an approximation.
Weight-only against float x, or against x in blocks of 32 as int8 (the file's other layers' `a8` math, llama.cpp's
Q8_0 x).
"""

from __future__ import annotations

from typing import ClassVar, Self

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.model import cpu_kernels
from minivllm.model.kernel_plan import SHAPE_CLASSES, Kernel, PlannedLinear
from minivllm.model.quantization import HANDFUL, quantize_blocks_int8

SUPERBLOCK = 256  # weights


class SuperblockLinear(PlannedLinear):
    """Superblock weights [N, K] (a subclass names the type); `act_blocks`: x quantized per block of 32 to int8
    (w8a8's math), else float x."""

    type_name: ClassVar[str]  # the file's name of the type ("Q6_K")
    fmt: ClassVar[str]  # csrc/gemv.c's format (cpu_kernels.GEMV_FORMATS)
    checkpoint_buffers = ("qweight", "bias")  # what a GGUF file's rows fill (models/weights.py)
    qweight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, act_blocks: bool, bias: bool = False) -> None:
        super().__init__()
        if in_features % SUPERBLOCK:
            raise ValueError(f"{self.type_name}: {in_features} input features are not whole superblocks of "
                             f"{SUPERBLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.act_blocks = act_blocks
        self.method = "w8a8" if act_blocks else "int8"  # (the math's name: weights in codes, x int8 or float)
        self.register_buffer("qweight", torch.empty(out_features, self.row_bytes(in_features), dtype=torch.uint8))
        # float32 whatever the model dtype: the kernels add it to float32 accumulators.
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32) if bias else None)
        self._gemv: cpu_kernels.GemvWeights | None = None
        self._gemv_a8: cpu_kernels.GemvWeights | None = None  # a weight-only layer's x-in-blocks kernel
        self.kernels = (SuperblockLinear.forward_reference,) * len(SHAPE_CLASSES)

    @classmethod
    def row_bytes(cls, in_features: int) -> int:
        return in_features // SUPERBLOCK * cpu_kernels.SUPERBLOCK_BYTES[cls.fmt]

    @classmethod
    def from_blocks(cls, raw: np.ndarray | torch.Tensor, in_features: int, act_blocks: bool) -> Self:
        """A layer holding a copy of a GGUF tensor's rows of this type (uint8 [N, K / 256 * superblock bytes])."""
        data = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw.contiguous()
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != cls.row_bytes(in_features):
            raise ValueError(f"{cls.type_name}: rows of {tuple(data.shape)} {data.dtype} are not {in_features} "
                             "weights' superblocks")
        layer = cls(in_features, data.shape[0], act_blocks)
        layer.qweight.copy_(data)
        return layer

    @staticmethod
    def dequantize_rows(raw: torch.Tensor, in_features: int) -> torch.Tensor:
        """uint8 rows of superblocks -> float32 [N, K] (the type's ggml dequantizer)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] every kernel computes with."""
        return self.dequantize_rows(self.qweight, self.in_features)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Portable path (any device, any M): dequantize, then a float32 matmul."""
        xf = quantize_blocks_int8(x) if self.act_blocks else x.float()
        return F.linear(xf, self.dequantize(), self.bias)

    def _bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.float().contiguous()

    def gemv_weights(self) -> cpu_kernels.GemvWeights:
        """The superblocks bound for csrc/gemv.c (the native decode stack takes them too)."""
        if self._gemv is None:
            self._gemv = cpu_kernels.GemvWeights(self.fmt, self.qweight, self.in_features, bias=self._bias(),
                                                 act_blocks=self.act_blocks)
        return self._gemv

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """csrc/gemv.c (CPU, float32 activations): the superblocks read once for up to 16 rows of x (the rows), or
        tiles of them for all rows of x at once (x in blocks, from 12 rows)."""
        xf = x if x.dtype == torch.float32 else x.float()
        return self.gemv_weights()(xf if xf.stride(-1) == 1 else xf.contiguous())

    def forward_native_a8(self, x: torch.Tensor) -> torch.Tensor:
        """A weight-only layer against x in blocks of 32 (steps of many tokens only: `eligible`)."""
        if self._gemv_a8 is None:
            self._gemv_a8 = cpu_kernels.GemvWeights(self.fmt, self.qweight, self.in_features, bias=self._bias(),
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
        return f"{self.type_name.lower()}{' x in blocks' if self.act_blocks else ''}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {self.type_name}"
                f"{', x in blocks of 32' if self.act_blocks else ''}")
