"""The layers a start-up timing of the native kernels reads: the model's first ones, in its order, past the
last-level cache, as a decode step streams them (model/row_order.py's choices: on a Sapphire Rapids-class Xeon with
480 MiB of L3 the first 64M weights of a W4A8 model, 32 MB, ran from the cache, where four rows a pass and one by one
tied, while the decode from memory ran 1.18x as fast one by one)."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from minivllm.model.kernel_plan import TIMED_WEIGHTS, PlannedLinear

TIMED_LLC = 2  # weights timed: at least this many times the last-level cache's bytes (and TIMED_WEIGHTS weights)


@functools.cache
def llc_bytes() -> int:
    """The last-level cache's size in bytes as sysfs gives it for cpu0 (0 where unknown)."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    best = (0, 0)
    try:
        for index in (d for d in os.listdir(root) if d.startswith("index")):
            with open(os.path.join(root, index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(root, index, "size")) as f:
                size = f.read().strip()
            unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
            best = max(best, (level, int(size.rstrip("KMG")) * unit))
    except (OSError, ValueError):
        return 0
    return best[1]


def weight_bytes(q: torch.nn.Module) -> int:
    """Bytes of q's weights (and their scales and mins) a one-token matmul streams."""
    w = getattr(q, "weight", None)
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(b.numel() * b.element_size() for name, b in q.named_buffers(recurse=False) if name != "bias")


def timed_layers(layers: Sequence[PlannedLinear]) -> list[PlannedLinear]:
    """The layers a row-order timing runs over, in the model's order: the first ones until they hold TIMED_WEIGHTS
    weights and TIMED_LLC times the last-level cache's bytes (all of a smaller model)."""
    timed, weights, nbytes, want = [], 0, 0, TIMED_LLC * llc_bytes()
    for q in layers:
        timed.append(q)
        weights += q.in_features * q.out_features
        nbytes += weight_bytes(q)
        if weights >= TIMED_WEIGHTS and nbytes >= want:
            break
    return timed
