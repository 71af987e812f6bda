"""Checkpoint-to-parameter copying with the checks that turn a bad checkpoint into a clear error."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


class WeightLoader:
    """Copies named tensors into a module's parameters and reports what was missing or mismatched."""

    def __init__(self, module: nn.Module, ignore: tuple[str, ...] = ()) -> None:
        self.params: dict[str, torch.Tensor] = dict(module.named_parameters())
        # Layers stored quantized in the checkpoint load into their buffers (QuantizedLinear's packed weights).
        for prefix, m in module.named_modules():
            for b in getattr(m, "checkpoint_buffers", ()):
                t = getattr(m, b, None)
                if isinstance(t, torch.Tensor):
                    self.params[f"{prefix}.{b}" if prefix else b] = t
        # A module holding its rows in parts (model/split_linear.py): its buffers' rows go to the part holding them.
        self.routes: dict[str, list[tuple[int, int, str]]] = {}
        for prefix, m in module.named_modules():
            for b in getattr(m, "routed_buffers", ()):
                self.routes[f"{prefix}.{b}" if prefix else b] = [
                    (a, z, f"{prefix}.{part}.{b}" if prefix else f"{part}.{b}") for a, z, part in m.row_spans]
        self.module_name = type(module).__name__
        self.ignore = ignore
        # A stacked parameter is complete when every row of it has been written.
        self.rows_loaded: dict[str, int] = {}
        self.sources: dict[str, list[str]] = {}  # stacked parameter → checkpoint names loaded into it
        self.unexpected: list[str] = []

    def load(self, name: str, tensor: torch.Tensor, source: str | None = None) -> None:
        """Copy a whole tensor into parameter `name` (`source`: its name in the checkpoint)."""
        p, route = self.params.get(name), self.routes.get(name)
        rows = route[-1][1] if route else p.shape[0] if p is not None else 0
        self.load_slice(name, tensor, 0, rows, source or name)

    def load_slice(self, name: str, tensor: torch.Tensor, offset: int, size: int, source: str) -> None:
        """Copy `tensor` into rows [offset, offset+size) of parameter `name`."""
        route = self.routes.get(name)
        if route is not None:
            part = next(((a, target) for a, z, target in route if a <= offset and offset + size <= z), None)
            if part is None:
                raise ValueError(f"{self.module_name}: weight {source!r} (rows {offset}-{offset + size} of {name}) "
                                 f"spans parts of other types: {[(a, z) for a, z, _ in route]}")
            return self.load_slice(part[1], tensor, offset - part[0], size, source)
        p = self.params.get(name)
        if p is None:
            if not any(source.endswith(s) for s in self.ignore):
                self.unexpected.append(source)
            return
        expected = (size, *p.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{self.module_name}: weight {source!r} has shape {tuple(tensor.shape)} in the "
                             f"checkpoint, expected {expected} from config.json")
        with torch.no_grad():
            p[offset:offset + size].copy_(tensor)
        self.rows_loaded[name] = self.rows_loaded.get(name, 0) + size
        if size < p.shape[0]:
            self.sources.setdefault(name, []).append(source)

    def finish(self) -> None:
        """Raise if any parameter was not (fully) loaded; warn about tensors nothing used."""
        missing = [n + (f" (only {', '.join(self.sources[n])} present)" if n in self.sources else "")
                   for n, p in self.params.items() if self.rows_loaded.get(n, 0) < p.shape[0]]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"{self.module_name}: checkpoint is missing weights: {shown}")
        if self.unexpected:
            logger.warning("%s: ignored %d checkpoint tensors with no matching parameter, e.g. %s",
                           self.module_name, len(self.unexpected), self.unexpected[:3])
