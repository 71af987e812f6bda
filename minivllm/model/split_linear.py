"""A projection whose output rows are held in consecutive parts of different weight types.

llama.cpp's Q4_K_M quantizer gives a layer's q and k Q4_K and, in a third of the layers, its v Q6_K: the fused
qkv_proj then mixes two superblock types. Converted to one format (int8 blocks of 32) it read 8.5 bits a weight
where the file holds 4.5 and 6.56, and approximated the file's weights; as parts, each part holds the file's rows
and runs its own kernels (planned as any layer), and the outputs are joined. The checkpoint's rows reach the part
that holds them (models/weights.py routes by `row_spans`); the native decode stack chains the parts
(csrc/decode_stack.h's proj_t.next).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from minivllm.model.kernel_plan import PlannedLinear


class SplitLinear(nn.Module):
    """y = [part_0(x), part_1(x), ...]: parts of one input width, their output rows consecutive."""

    # The buffers a checkpoint fills, routed to the parts' own (WeightLoader).
    routed_buffers = ("qweight", "bias")

    def __init__(self, parts: Sequence[PlannedLinear]) -> None:
        super().__init__()
        if len(parts) < 2 or len({p.in_features for p in parts}) != 1:
            raise ValueError("SplitLinear: two or more parts of one input width")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # model/lora.py's slots
        spans, start = [], 0
        for i, p in enumerate(parts):
            spans.append((start, start + p.out_features, f"parts.{i}"))
            start += p.out_features
        self.row_spans = tuple(spans)  # (first row, end, the part's name) of each part

    def planned(self) -> list[PlannedLinear]:
        """The parts, each a planned layer of its own (model/decode_stack.py walks them)."""
        return [p for p in self.parts if isinstance(p, PlannedLinear)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.lora is None else self.lora(x, out)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rows {[(a, b) for a, b, _ in self.row_spans]}"
